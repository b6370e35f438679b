"""Bad values are refused before any work: one `fblc: error:` line naming the value, exit 2, nothing written."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import tempfile
from typing import Callable, Iterator

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import helper, numpy_helper

from fblc import bundle_format as fmt
from fblc.cli import main
from fblc.cli import outputs
from fblc.passes.ftd_taxonomy import UNKNOWN_OP_CLASS, ftd_class
from fblc.runtime.local import LocalRunner
from tests.conftest import mlp_proto
from tests.support.bundles import compiled
from tests.support.interrupt import interruptible

CLASSES = 3  # the MLP's logits [4, 3]


def files_under(folder: str) -> set[str]:
    return {os.path.relpath(os.path.join(root, name), folder)
            for root, dirs, names in os.walk(folder) for name in dirs + names}


def refused(capsys: pytest.CaptureFixture[str], folder: str, *args: str) -> str:
    """Run the CLI; assert the one-line refusal and that nothing under `folder` changed; the message."""
    before = files_under(folder)
    code = main(list(args))
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("fblc: error: "), err
    assert "Traceback" not in err and "internal error" not in err
    assert files_under(folder) == before
    return err.strip()[len("fblc: error: "):]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> str:
    return compiled(str(tmp_path_factory.mktemp("bundle")), mlp_proto(), "mlp")


def mlp_data(rows: int = 8, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((rows, 6)).astype(np.float32), "labels": rng.integers(0, CLASSES, rows)}


@pytest.fixture
def no_runner(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building the runner is the work a refusal must come before: here it would be an internal error."""
    def build(*args: object, **kwargs: object) -> None:
        raise AssertionError("the runner was built before the bad value was refused")

    monkeypatch.setattr(LocalRunner, "__init__", build)


# --- option values ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, message", [
    (["--lr", "nan"], "--lr nan is not a finite learning rate >= 0; give e.g. --lr 0.01"),
    (["--lr", "inf"], "--lr inf is not a finite learning rate >= 0"),
    (["--lr", "-0.1"], "--lr -0.1 is not a finite learning rate >= 0"),
    (["--betas", "0.9", "1"], "--betas 0.9 1 has a beta outside [0, 1); give two numbers in [0, 1)"),
    (["--betas", "-0.1", "0.999"], "--betas -0.1 0.999 has a beta outside [0, 1)"),
    (["--eps", "0"], "--eps 0 is not a finite epsilon > 0; give e.g. --eps 1e-8"),
    (["--eps=-1e-8"], "--eps -1e-08 is not a finite epsilon > 0"),
    (["--momentum", "-0.9"], "--momentum -0.9 is not a finite momentum >= 0"),
    (["--weight-decay", "-0.01"], "--weight-decay -0.01 is not a finite weight decay >= 0"),
    (["--weight-decay", "nan"], "--weight-decay nan is not a finite weight decay >= 0"),
    (["--tile-mb", "nan"], "--tile-mb nan is not a finite size >= 0"),
    (["--rank", "4"], "--rank 4 is given with --adapter none, which has no rank; add --adapter lora, memflora or "
                      "memflora-sg, or drop --rank"),
    (["--adapter", "lora", "--rank", "0"], "--rank 0 is not a positive rank"),
    (["--adapter", "memflora", "--seed=-1"], "--seed -1 is not a seed >= 0"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_option_values_are_refused_by_every_command(tmp_path, mlp_path, capsys, flags, message) -> None:
    for command in (["train-graph", mlp_path, "-o", str(tmp_path / "step.onnx")],
                    ["compile", mlp_path, "-o", str(tmp_path / "bundle")], ["verify", mlp_path]):
        assert message in refused(capsys, str(tmp_path), *command, *flags)


def test_good_edge_values_are_accepted(tmp_path, mlp_path, capsys) -> None:
    out = tmp_path / "step.onnx"
    assert main(["train-graph", mlp_path, "-o", str(out), "-q", "--optimizer", "adam", "--lr", "0", "--betas", "0",
                 "0.5", "--momentum", "0", "--weight-decay", "0"]) == 0
    assert out.exists()


def test_steps_below_one_are_refused_on_every_device(tmp_path, bundle, capsys, no_runner) -> None:
    data = str(tmp_path / "data.npz")
    np.savez(data, **mlp_data())
    for device in ("local", "adb:127.0.0.1:1"):
        message = refused(capsys, str(tmp_path), "run", bundle, "--data", data, "--steps", "0", "--device", device)
        assert message == "--steps 0 is not a number of steps >= 1; give e.g. --steps 10"


# --- data ---------------------------------------------------------------------------------------------------
def _with(name: str, change: Callable[[np.ndarray], np.ndarray]) -> Callable[[str], None]:
    def write(path: str) -> None:
        data = mlp_data()
        data[name] = change(data[name])
        np.savez(path, **data)
    return write


def _set(index: tuple[int, ...], value: float) -> Callable[[np.ndarray], np.ndarray]:
    def change(array: np.ndarray) -> np.ndarray:
        array = array.copy()
        array[index] = value
        return array
    return change


def _text(path: str) -> None:
    with open(path, "w") as handle:
        handle.write("x,labels\n0.5,1\n")


@pytest.mark.parametrize("name, write, message", [
    ("nan.npz", _with("x", _set((5, 3), np.nan)),
     "data file '{data}': array 'x' has NaN at index [5, 3]; replace or drop the rows with NaN or inf"),
    ("inf.npz", _with("x", _set((2, 0), -np.inf)), "array 'x' has -inf at index [2, 0]"),
    ("label3.npz", _with("labels", _set((6,), CLASSES)),
     "array 'labels' has 3 at index [6]: not a class of the model's output (0 to 2) nor the ignore index -100; give "
     "labels in [0, 3), or -100 for a position that does not count"),
    ("negative.npz", _with("labels", _set((1,), -1)), "array 'labels' has -1 at index [1]: not a class"),
    ("fraction.npz", _with("labels", lambda a: np.where(np.arange(8) == 4, 1.5, a)),
     "array 'labels' has 1.5 at index [4], but the bundle takes int64 there (class indices)"),
    ("strings.npz", _with("x", lambda a: a.astype(str)), "array 'x' holds strings (dtype <U"),
    ("objects.npz", _with("labels", lambda a: a.astype(object)), "array 'labels' holds Python objects (dtype object)"),
    ("data.csv", _text, "cannot read data file '{data}': it is not an .npz (numpy.savez's zip of named arrays); write "
                        "one with numpy.savez('{stem}.npz', x=..., labels=...) holding arrays: x [4, 6] float32, "
                        "labels [4] int64"),
    ("single.npy", lambda path: np.save(path, mlp_data()["x"]), "it is a single .npy array, not an .npz"),
    ("missing.npz", lambda path: None, "cannot read data file '{data}': no such file; give an .npz written by "
                                       "numpy.savez with arrays: x [4, 6] float32, labels [4] int64"),
    ("scalar.npz", _with("labels", lambda a: np.array(1)), "'labels' has shape []; expected arrays"),
], ids=["nan", "inf", "label-past-classes", "negative-label", "fractional-label", "strings", "objects", "csv",
        "npy", "missing", "scalar"])
def test_bad_data_is_refused_before_the_runner_is_built(tmp_path, bundle, capsys, no_runner, name, write,
                                                        message) -> None:
    data = str(tmp_path / name)
    write(data)
    saved = str(tmp_path / "trained.npz")
    expected = message.format(data=data, stem=os.path.splitext(data)[0])
    assert expected in refused(capsys, str(tmp_path), "run", bundle, "--data", data, "--save-params", saved)
    if name == "nan.npz":  # the phone path reads the same batches, before it looks for adb or a device
        message = refused(capsys, str(tmp_path), "run", bundle, "--data", data, "--device", "adb:127.0.0.1:1")
        assert expected in message


def test_the_manifest_records_the_classes_and_the_ignore_index_trains(tmp_path, bundle, capsys) -> None:
    manifest = json.load(open(os.path.join(bundle, fmt.MANIFEST)))
    labels = [entry for entry in manifest["inputs"] if entry["name"] == "labels"]
    assert labels and labels[0]["classes"] == CLASSES and labels[0]["ignore_index"] == -100
    data = str(tmp_path / "data.npz")
    _with("labels", _set((0,), -100))(data)
    assert main(["run", bundle, "--data", data, "--steps", "2", "-q"]) == 0


# --- where the commands write -------------------------------------------------------------------------------
@pytest.fixture
def read_only(tmp_path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A folder nobody may write to. Root may write anywhere, so as root access(2) is told what another user
    would hear."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
    if os.geteuid() == 0:
        real = os.access
        monkeypatch.setattr(outputs.os, "access", lambda path, mode: False if os.path.abspath(path) == str(folder)
                            else real(path, mode))
    yield str(folder)
    folder.chmod(stat.S_IRWXU)


def test_save_params_into_a_missing_or_read_only_folder_is_refused_before_training(tmp_path, bundle, read_only,
                                                                                    capsys, no_runner) -> None:
    data = str(tmp_path / "data.npz")
    np.savez(data, **mlp_data())
    missing = str(tmp_path / "no-such-folder" / "trained.npz")
    assert refused(capsys, str(tmp_path), "run", bundle, "--data", data, "--save-params", missing) == (
        f"--save-params '{missing}': folder '{os.path.dirname(missing)}' does not exist; create it first (mkdir -p "
        f"{os.path.dirname(missing)}) or choose another path")
    locked = os.path.join(read_only, "trained.npz")
    assert refused(capsys, str(tmp_path), "run", bundle, "--data", data, "--save-params", locked) == (
        f"--save-params '{locked}': folder '{read_only}' is not writable; choose a folder you can write to, or fix "
        "its permissions")
    results = str(tmp_path / "no" / "r.json")
    message = refused(capsys, str(tmp_path), "run", bundle, "--data", data, "--results", results, "--device",
                      "adb:127.0.0.1:1")  # --results is the phone runner's file
    assert message.startswith(f"--results '{tmp_path}/no/r.json': folder '{tmp_path}/no' does not exist")


def test_a_save_that_fails_after_training_goes_to_a_fallback(tmp_path, bundle, monkeypatch, capsys) -> None:
    data, folder = str(tmp_path / "data.npz"), tmp_path / "out"
    np.savez(data, **mlp_data())
    folder.mkdir()
    spare = tmp_path / "spare"
    spare.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spare))
    step = LocalRunner.step

    def step_then_lose_the_folder(self: LocalRunner, feeds: dict) -> float:
        if folder.exists():
            folder.rmdir()  # e.g. removed by another program while training ran
        return step(self, feeds)

    monkeypatch.setattr(LocalRunner, "step", step_then_lose_the_folder)
    code = main(["run", bundle, "--data", data, "--steps", "3", "-q", "--save-params", str(folder / "t.npz")])
    err = capsys.readouterr().err.strip().splitlines()[-1]  # the last line: building the runner may say more
    fallback = [str(spare / name) for name in os.listdir(spare)]
    assert code == 2 and len(fallback) == 1 and "internal error" not in err
    assert err == (f"fblc: error: cannot write --save-params '{folder}/t.npz' (No such file or directory); saved the "
                   f"trained parameters to '{fallback[0]}' instead; move that file where you want it")
    assert sorted(np.load(fallback[0]).files) == ["b1", "b2", "w1", "w2"]


def test_compile_output_that_is_a_file_or_in_a_read_only_folder(tmp_path, mlp_path, read_only, capsys) -> None:
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    assert refused(capsys, str(tmp_path), "compile", mlp_path, "-o", str(a_file)) == (
        f"-o '{a_file}' is an existing file, not a bundle folder; choose a new folder name for the bundle")
    assert "is a file, not a folder" in refused(capsys, str(tmp_path), "compile", mlp_path, "-o", f"{a_file}/b")
    for command in (["compile", mlp_path, "-o", os.path.join(read_only, "bundle")],
                    ["train-graph", mlp_path, "-o", os.path.join(read_only, "deeper", "step.onnx")],
                    ["profile", "-o", os.path.join(read_only, "gpu.json")],
                    ["train-graph", mlp_path, "-o", str(tmp_path / "s.onnx"), "--dump-dir", read_only]):
        assert f"folder '{read_only}' is not writable" in refused(capsys, str(tmp_path), *command)
    assert refused(capsys, str(tmp_path), "train-graph", mlp_path, "-o", str(tmp_path)) == (
        f"-o '{tmp_path}' is a folder; give a file name, e.g. {tmp_path}/step.onnx")
    assert refused(capsys, str(tmp_path), "compile", mlp_path, "-o", str(tmp_path / "b"), "--dump-dir",
                   str(a_file)) == f"--dump-dir '{a_file}' is an existing file, not a folder; choose a folder name"


def test_a_bundle_folder_with_other_files_needs_force(tmp_path, mlp_path, capsys) -> None:
    out = tmp_path / "bundle"
    assert main(["compile", mlp_path, "-o", str(out), "-q"]) == 0
    assert main(["compile", mlp_path, "-o", str(out), "-q"]) == 0  # its own files: replaced as before
    (out / "kernels.cache").write_bytes(b"FBLCBIN1")  # the native runner's: fblc's too
    assert main(["compile", mlp_path, "-o", str(out), "-q"]) == 0
    (out / "notes.txt").write_text("my results")
    assert refused(capsys, str(tmp_path), "compile", mlp_path, "-o", str(out)) == (
        f"-o '{out}' holds files fblc did not write (notes.txt), and compiling replaces the whole folder; choose "
        "another -o folder, or add --force to replace it, those files included")
    assert main(["compile", mlp_path, "-o", str(out), "-q", "--force"]) == 0
    assert not (out / "notes.txt").exists() and (out / fmt.MANIFEST).exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    for force in ([], ["--force"]):  # not a bundle: never replaced
        assert refused(capsys, str(tmp_path), "compile", mlp_path, "-o", str(mine), *force) == (
            f"-o '{mine}' exists and is not an fblc bundle (it holds thesis.tex); choose another -o folder")


# --- Ctrl-C -------------------------------------------------------------------------------------------------
def _interrupt_run(tmp_path, bundle: str, *extra: str) -> tuple[int, str]:
    data = str(tmp_path / "data.npz")
    np.savez(data, **mlp_data())
    process = subprocess.Popen([sys.executable, "-m", "fblc.cli", "run", bundle, "--data", data, "--steps", "100000",
                                *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=interruptible)
    assert process.stdout is not None
    process.stdout.readline()  # the banner
    process.stdout.readline()  # the first step ran
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert "Traceback" not in stderr
    return process.returncode, stderr.splitlines()[-1] + "\n"  # the last line: building the runner may say more


def test_ctrl_c_says_what_was_saved_after_how_many_steps(tmp_path, bundle) -> None:
    saved = str(tmp_path / "trained.npz")
    code, stderr = _interrupt_run(tmp_path, bundle, "--save-params", saved)
    found = re.fullmatch(r"fblc: interrupted after (\d+) of 100000 steps; saved the parameters after step (\d+) to "
                         + re.escape(saved) + "\n", stderr)
    assert code == 130 and found and found.group(1) == found.group(2), stderr
    steps = int(found.group(1))
    runner = LocalRunner(bundle)  # the same steps again: the file holds exactly the parameters after them
    data = mlp_data()
    for step in range(steps):
        runner.step({name: array[(step % 2) * 4:(step % 2) * 4 + 4] for name, array in data.items()})
    trained = np.load(saved)
    for name, value in runner.parameters().items():
        np.testing.assert_allclose(trained[name], value, rtol=1e-6)
    code, stderr = _interrupt_run(tmp_path, bundle)
    assert code == 130 and re.fullmatch(r"fblc: interrupted after \d+ of 100000 steps; nothing saved \(no "
                                        r"--save-params\)\n", stderr), stderr


# --- ops the layout passes do not know ----------------------------------------------------------------------
def _with_front(path: str, node: onnx.NodeProto, initializers: list[onnx.TensorProto]) -> str:
    """The MLP with `node` (x -> x2) in front of it: a frozen part of the forward, so no gradient needs it."""
    model = mlp_proto()
    model.graph.node[0].input[0] = "x2"
    model.graph.node.insert(0, node)
    model.graph.initializer.extend(initializers)
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


@pytest.mark.parametrize("node, initializers, extra", [
    (helper.make_node("Tan", ["x"], ["x2"], name="front"), [], []),
    # an op with a frozen initializer operand (Einsum was this case until lower_composites lowered it)
    (helper.make_node("Mod", ["x", "e"], ["x2"], fmod=1, name="front"),
     [numpy_helper.from_array(np.full(6, 7.0, dtype=np.float32), "e")], ["--freeze", "^e$"]),
], ids=["Tan", "Mod"])
def test_an_op_without_a_layout_class_is_an_unsupported_op_not_a_source_edit(tmp_path, capsys, node, initializers,
                                                                             extra) -> None:
    model = _with_front(str(tmp_path / "model.onnx"), node, initializers)
    message = refused(capsys, str(tmp_path), "compile", model, "-o", str(tmp_path / "bundle"), *extra)
    assert message.startswith(f"no OpenCL kernel emitter for op {node.op_type} (node 'front')")
    assert "supported ops: Abs, Add" in message and "fblc/" not in message and ".py" not in message
    assert ftd_class(ir.Node("", node.op_type, [])) == UNKNOWN_OP_CLASS
