"""What the commands read and write (issue 36): no output may be one of the command's inputs, names must fit
the file system before any work, a failed write says why and leaves nothing behind, a save says what it wrote
where, files and folders take the user's umask, and a model path that is a folder, no UTF-8 or has truncated
external data is one clear error."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
import sys

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from fblc.cli import main, outputs
from fblc.codegen.bundle import write_bundle
from fblc.compiler import model_io
from fblc.errors import FblcError
from tests.conftest import mlp_proto
from tests.test_bad_values import bundle, files_under, mlp_data, no_runner, refused  # noqa: F401 (fixtures)


def _data(folder) -> str:
    path = str(folder / "data.npz")
    np.savez(path, **mlp_data())
    return path


def _external_model(folder, location: str = "mlp.data") -> tuple[str, str]:
    """The MLP with its weights in an external data file; (model, data file)."""
    path = str(folder / "mlp.onnx")
    onnx.save(mlp_proto(), path, save_as_external_data=True, all_tensors_to_one_file=True, location=location,
              size_threshold=0)
    return path, str(folder / location)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# --- no output may be an input ------------------------------------------------------------------------------
def test_run_may_not_write_its_data_or_bundle(tmp_path, bundle, capsys, no_runner) -> None:
    data = _data(tmp_path)
    kept = open(data, "rb").read()
    assert refused(capsys, str(tmp_path), "run", bundle, "--data", data, "--save-params", data) == (
        f"--save-params '{data}' is the --data file '{data}', which this command reads: writing it would overwrite "
        "that input; choose another --save-params file")
    stem = data[:-len(".npz")]  # numpy.savez adds .npz: the data file again
    assert refused(capsys, str(tmp_path), "run", bundle, "--data", data, "--save-params", stem).startswith(
        f"--save-params '{stem}' (written as '{data}') is the --data file '{data}'")
    os.link(data, tmp_path / "alias.npz")
    assert "is the --data file" in refused(capsys, str(tmp_path), "run", bundle, "--data", data, "--save-params",
                                           str(tmp_path / "alias.npz"))
    manifest = os.path.join(bundle, "manifest.json")
    assert refused(capsys, str(tmp_path), "run", bundle, "--data", data, "--results", manifest, "--device",
                   "adb:127.0.0.1:1") == (
        f"--results '{manifest}' is the bundle '{bundle}' (its manifest.json), which this command reads: writing it "
        "would overwrite that input; choose another --results file")
    both = str(tmp_path / "out.npz")
    assert refused(capsys, str(tmp_path), "run", bundle, "--data", data, "--save-params", both, "--results", both,
                   "--device", "adb:127.0.0.1:1") == (
        f"--results '{both}' is also --save-params '{both}'; give each output its own file")
    assert open(data, "rb").read() == kept


def test_a_model_is_never_overwritten_by_its_own_step_or_bundle(tmp_path, mlp_path, capsys) -> None:
    assert refused(capsys, str(tmp_path), "train-graph", mlp_path, "-o", mlp_path) == (
        f"-o '{mlp_path}' is the model '{mlp_path}', which this command reads: writing it would overwrite that "
        "input; choose another -o file")
    os.symlink(mlp_path, tmp_path / "alias.onnx")
    assert f"is the model '{mlp_path}'" in refused(capsys, str(tmp_path), "train-graph", mlp_path, "-o",
                                                   str(tmp_path / "alias.onnx"))
    external = tmp_path / "external"
    external.mkdir()
    model, data = _external_model(external, location="step.onnx.data")
    assert refused(capsys, str(tmp_path), "train-graph", model, "-o", data).startswith(
        f"-o '{data}' is the external data file '{data}' of the model '{model}'")
    step = str(external / "step.onnx")  # its weights past 1 GiB would go to step.onnx.data: the model's
    assert refused(capsys, str(tmp_path), "train-graph", model, "-o", step).startswith(
        f"-o '{step}' (which may also write 'step.onnx.data' beside it) is the external data file")

    out = tmp_path / "bundle"
    assert main(["compile", mlp_path, "-o", str(out), "-q"]) == 0
    inside = str(out / "mlp.onnx")
    onnx.save(mlp_proto(), inside)
    assert refused(capsys, str(tmp_path), "compile", inside, "-o", str(out), "--force") == (
        f"-o '{out}' holds the model '{inside}', and writing the bundle replaces the whole folder; choose another -o "
        "folder, or move that input out of it")
    os.remove(inside)
    assert refused(capsys, str(tmp_path), "compile", mlp_path, "-o", str(out), "--dump-dir", str(out / "d")) == (
        f"--dump-dir '{out}/d' is inside the bundle folder -o '{out}', which writing the bundle replaces whole; "
        "choose a --dump-dir outside it")


# --- names the file system cannot take ----------------------------------------------------------------------
def test_names_too_long_are_refused_before_any_work(tmp_path, bundle, mlp_path, capsys, no_runner) -> None:
    name_max = os.pathconf(tmp_path, "PC_NAME_MAX")
    data = _data(tmp_path)
    long = str(tmp_path / ("p" * (name_max + 45)))
    message = refused(capsys, str(tmp_path), "run", bundle, "--data", data, "--save-params", long)
    assert message.endswith(f"the name 'pppppppppppppppppppppppppppppppp...pppppppppppp.npz' is {name_max + 49} bytes "
                            f"long, over the file system's limit of {name_max} bytes per name; choose a shorter name")
    step = str(tmp_path / ("s" * (name_max - 8) + ".onnx"))  # fits; its .data beside it would not
    assert "(which may also write 'sss" in refused(capsys, str(tmp_path), "train-graph", mlp_path, "-o", step)
    deep = os.path.join(str(tmp_path), *["d" * 200] * 25, "bundle")
    message = refused(capsys, str(tmp_path), "compile", mlp_path, "-o", deep)
    assert f"the path is {len(deep)} bytes long (absolute), over the system's limit of" in message
    assert message.endswith("choose a shorter path, or a folder nearer the root") and len(message) < 400


def test_a_failed_save_falls_back_to_a_short_name(tmp_path, monkeypatch) -> None:
    spare = tmp_path / "spare"
    spare.mkdir()
    monkeypatch.setattr(outputs.tempfile, "tempdir", str(spare))
    asked = str(tmp_path / ("p" * 300 + ".npz"))  # past the check (a library call): the save itself fails
    written, why = outputs.save_trained(asked, lambda: {"w": np.ones(3, np.float32)})
    assert os.path.dirname(written) == str(spare) and len(os.path.basename(written)) < 64
    assert why.endswith("(File name too long)") and np.load(written)["w"].tolist() == [1, 1, 1]


# --- what --save-params writes, and says -------------------------------------------------------------------
def test_save_params_takes_a_file_and_says_what_it_wrote(tmp_path, bundle, capsys) -> None:
    data, folder = _data(tmp_path), tmp_path / "out"
    folder.mkdir()
    assert refused(capsys, str(tmp_path), "run", bundle, "--data", data, "--save-params", str(folder)) == (
        f"--save-params '{folder}' is a folder; give a file name, e.g. {folder}/trained.npz")
    assert not os.path.exists(f"{folder}.npz")
    asked = str(folder / "trained")
    assert main(["run", bundle, "--data", data, "--steps", "1", "--save-params", asked]) == 0
    size = os.path.getsize(f"{asked}.npz")
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"saved 4 trained parameters ({size / 1e3:.1f} kB) to '{asked}.npz' (.npz added to --save-params '{asked}')")
    assert main(["run", bundle, "--data", data, "--steps", "1", "--save-params", f"{asked}.npz", "-q"]) == 0
    assert capsys.readouterr().out == ""


# --- a write that fails -------------------------------------------------------------------------------------
def _write_bundle(path: str) -> None:
    write_bundle(path, {}, {}, "", b"", {})


def _write_model(path: str) -> None:
    model_io.save_model_atomically(ir.serde.deserialize_model(mlp_proto()), path)


@pytest.mark.parametrize("write", [_write_bundle, _write_model], ids=["bundle", "model"])
def test_a_name_too_long_leaves_no_folders_and_says_so(tmp_path, write) -> None:
    target = str(tmp_path / "a" / "b" / ("x" * 300))  # past the CLI's check (a library call): the rename fails
    with pytest.raises(FblcError) as raised:
        write(target)
    message = str(raised.value)
    shown = "x" * 32 + "..." + "x" * 16
    assert f"(the name '{shown}' is 300 bytes long, over the file system's limit of" in message
    assert message.endswith("choose a shorter name") and "disk" not in message
    assert files_under(str(tmp_path)) == set()


def _no_space(*args: object, **kwargs: object) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_while_writing_the_step_says_so_and_leaves_nothing(tmp_path, mlp_path, capsys,
                                                                        monkeypatch) -> None:
    def half_then_full(model: ir.Model, path: str, **kwargs: object) -> None:
        with open(path, "wb") as handle:
            handle.write(b"half a model")
        _no_space()

    monkeypatch.setattr(model_io.ir, "save", half_then_full)
    step = str(tmp_path / "new" / "step.onnx")
    assert refused(capsys, str(tmp_path), "train-graph", mlp_path, "-o", step) == (
        f"cannot write the ONNX model '{step}' (No space left on device); nothing was written; free disk space, or "
        "choose a folder on another disk")


def test_a_full_disk_after_the_external_data_removes_it(tmp_path, mlp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(model_io, "INLINE_WEIGHTS_LIMIT", 0)  # the weights go to step.onnx.data, placed first
    step = str(tmp_path / "step.onnx")
    replace = os.replace
    monkeypatch.setattr(model_io.os, "replace", lambda source, target: _no_space() if target == step
                        else replace(source, target))
    assert "(No space left on device)" in refused(capsys, str(tmp_path), "train-graph", mlp_path, "-o", step)


def test_a_full_disk_while_writing_a_bundle_keeps_the_previous_one(tmp_path, monkeypatch) -> None:
    out = str(tmp_path / "bundle")
    _write_bundle(out)
    before = files_under(str(tmp_path))
    monkeypatch.setattr("fblc.bundle_format.sha256_of", _no_space)
    with pytest.raises(FblcError, match=r"\(No space left on device\); nothing was written; free disk space"):
        _write_bundle(out)
    assert files_under(str(tmp_path)) == before


FILL_A_TINY_DISK = """
import sys
from fblc.cli import main
for command in (["train-graph", sys.argv[1], "-o", sys.argv[2] + "/a/step.onnx"],
                ["compile", sys.argv[1], "-o", sys.argv[2] + "/b/bundle"]):
    print(main([*command, "-q"]))
"""


@pytest.mark.skipif(not shutil.which("unshare"), reason="needs unshare(1) to mount a tmpfs in a namespace")
def test_a_real_full_disk_is_one_clear_error_and_leaves_nothing(tmp_path, mlp_path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    # an 8 KiB tmpfs, mounted in a user and mount namespace of its own: gone with the process
    script = f'mount -t tmpfs -o size=8k tmpfs "$1" || exit 99; "{sys.executable}" -c "$2" "$3" "$1"; ls -A "$1"'
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", str(disk), FILL_A_TINY_DISK, mlp_path],
                          capture_output=True, text=True, timeout=120)
    if done.returncode == 99 or "unshare" in done.stderr.split(":")[0]:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    assert done.stdout.split() == ["2", "2"], done.stderr  # exit codes; then nothing left on the disk
    assert done.stderr.splitlines() == [
        f"fblc: error: cannot write the ONNX model '{disk}/a/step.onnx' (No space left on device); nothing was "
        "written; free disk space, or choose a folder on another disk",
        f"fblc: error: cannot write the bundle '{disk}/b/bundle' (No space left on device); nothing was written; "
        "free disk space, or choose a folder on another disk"]


# --- modes --------------------------------------------------------------------------------------------------
def test_outputs_take_the_umask_and_a_replaced_file_keeps_its_mode(tmp_path) -> None:
    old = os.umask(0o022)
    try:
        out, params, step = str(tmp_path / "bundle"), str(tmp_path / "p.npz"), str(tmp_path / "step.onnx")
        _write_bundle(out)
        outputs.save_parameters(params, {"w": np.ones(2, np.float32)})
        _write_model(step)
        assert (_mode(out), _mode(params), _mode(step)) == (0o755, 0o644, 0o644)
        assert {_mode(os.path.join(out, name)) for name in os.listdir(out)} == {0o644}
        os.chmod(out, 0o750)
        os.chmod(params, 0o640)
        _write_bundle(out)
        outputs.save_parameters(params, {"w": np.ones(2, np.float32)})
        assert (_mode(out), _mode(params)) == (0o750, 0o640)
    finally:
        os.umask(old)


# --- the model path -----------------------------------------------------------------------------------------
def test_a_folder_given_as_the_model_names_what_it_holds(tmp_path, capsys) -> None:
    one, none, two = (tmp_path / name for name in ("one", "none", "two"))
    for folder, models in ((one, ["mlp.onnx"]), (none, []), (two, ["a.onnx", "b.onnx"])):
        folder.mkdir()
        for name in models:
            onnx.save(mlp_proto(), str(folder / name))
    for command in (["check", str(one)], ["train-graph", str(one), "-o", str(tmp_path / "s.onnx")],
                    ["compile", str(one), "-o", str(tmp_path / "b")]):
        assert refused(capsys, str(tmp_path), *command) == (
            f"'{one}' is a folder, not an ONNX model file; give the model in it: {one}/mlp.onnx")
    assert refused(capsys, str(tmp_path), "check", str(none)).endswith("(it holds no .onnx file); give the model "
                                                                        "file's path")
    assert "(it holds 2 .onnx files: a.onnx, b.onnx)" in refused(capsys, str(tmp_path), "check", str(two))


def test_file_names_that_are_no_utf8_work_in_every_command(tmp_path, capsys) -> None:
    def named(raw: bytes) -> str:  # as argv hands such a name over
        return os.path.join(str(tmp_path), os.fsdecode(raw))

    model, out = named(b"m\xff.onnx"), named(b"b\xff")
    onnx.save(mlp_proto(), model)
    np.savez(named(b"d\xff.npz"), **mlp_data())
    shown = f"{tmp_path}/m\\xff.onnx"  # as `ls -b` shows it
    assert main(["check", model]) == 0 and capsys.readouterr().out.startswith(f"{shown}: 4 nodes")
    assert main(["train-graph", model, "-o", named(b"s\xff.onnx")]) == 0
    assert f"wrote {tmp_path}/s\\xff.onnx" in capsys.readouterr().out
    assert main(["compile", model, "-o", out]) == 0 and f"compiled {shown}" in capsys.readouterr().out
    assert main(["run", out, "--data", named(b"d\xff.npz"), "--steps", "1", "--save-params", named(b"p\xff")]) == 0
    assert f"to '{tmp_path}/p\\xff.npz'" in capsys.readouterr().out
    assert refused(capsys, str(tmp_path), "check", named(b"n\xff.onnx")) == (
        f"cannot read '{tmp_path}/n\\xff.onnx': no such file; check the path")


def test_truncated_external_data_names_the_tensor_the_file_and_the_sizes(tmp_path, capsys) -> None:
    model, data = _external_model(tmp_path)
    with open(data, "r+b") as handle:
        handle.truncate(100)
    for command in (["check", model], ["train-graph", model, "-o", str(tmp_path / "step.onnx")]):
        assert refused(capsys, str(tmp_path), *command) == (
            f"'{model}': tensor 'w1' needs 192 bytes at offset 0 of its external data file '{data}', which holds 100 "
            "bytes from there (100 in all); the file is truncated or from another export: copy it again whole, or "
            "export the model again")


# --- --results ----------------------------------------------------------------------------------------------
def test_results_on_a_local_device_is_refused(tmp_path, bundle, capsys, no_runner) -> None:
    assert refused(capsys, str(tmp_path), "run", bundle, "--data", _data(tmp_path), "--results",
                   str(tmp_path / "r.json")) == (
        "--results is the native runner's results file, written only on a phone (--device adb:SERIAL); with --device "
        "local nothing would be written; drop --results, or add --json for one JSON object per step (step, loss, ms) "
        "on stdout")
