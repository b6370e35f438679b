"""Runs that went wrong quietly: a diverging training, an edited manifest, a profile with a NaN figure, a bogus
FBLC_OPENCL_DEVICE, the runner's build hint; and what `fblc run` says it chose (storage) and left (summary)."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import subprocess

import numpy as np
import onnx
import pytest

from fblc import bundle_format as fmt
from fblc.cli import main
from fblc.runtime.local import LocalRunner
from fblc.runtime.native import RunnerResults
from tests.conftest import mlp_proto
from tests.test_bad_values import bundle, mlp_data, no_runner, refused  # noqa: F401  (fixtures)
from tests.test_native_runner import runner_binary  # noqa: F401  (fixture)

SUMMARY = r"trained (\d+) steps( \(\d+ skipped by loss scaling\))? in [\d.]+ s: loss [-\d.]+ -> [-\d.]+"
SMALLER_LR = "compile the bundle again with a smaller --lr and train again"


@pytest.fixture(scope="module")
def diverging(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The MLP at --lr 1e30: step 1's loss is finite, its update is not (NaN loss from step 2)."""
    folder = tmp_path_factory.mktemp("diverging")
    onnx.save(mlp_proto(), str(folder / "mlp.onnx"))
    out = str(folder / "mlp")
    assert main(["compile", str(folder / "mlp.onnx"), "-o", out, "--lr", "1e30", "-q"]) == 0
    return out


@pytest.fixture
def data(tmp_path) -> str:
    path = str(tmp_path / "data.npz")
    np.savez(path, **mlp_data())  # two batches of 4
    return path


def parameters_after(bundle: str, steps: int) -> dict[str, np.ndarray]:
    """What `fblc run` trains in `steps` steps on `data`'s two batches, by LocalRunner."""
    runner, batches = LocalRunner(bundle, progress=False), mlp_data()
    for step in range(steps):
        runner.step({name: array[(step % 2) * 4:(step % 2) * 4 + 4] for name, array in batches.items()})
    return runner.parameters()


def assert_saved(path: str, expected: dict[str, np.ndarray]) -> None:
    saved = np.load(path)
    assert sorted(saved.files) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(saved[name], value, rtol=1e-6, err_msg=name)


def run_error(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[str, list[int]]:
    """Run the CLI, assert exit 2 with one error line; (its message, the steps printed)."""
    code = main(list(args))
    out, err = capsys.readouterr()
    assert code == 2 and "internal error" not in err, (code, out, err)
    last = err.strip().splitlines()[-1]  # building the runner may say more above
    assert last.startswith("fblc: error: "), err
    steps = [int(line.split()[1]) for line in out.splitlines() if line.startswith("step ")]
    return last[len("fblc: error: "):], steps


# --- 1. non-finite training ---------------------------------------------------------------------------------
def test_a_diverging_run_stops_at_its_first_nan_loss_and_saves_the_last_finite_parameters(diverging, data, tmp_path,
                                                                                          capsys) -> None:
    saved = str(tmp_path / "trained.npz")
    message, steps = run_error(capsys, "run", diverging, "--data", data, "--steps", "5", "--save-params", saved)
    assert steps == [1, 2]
    assert message == (f"training diverged at step 2: its loss is nan; saved the parameters after step 1, the last "
                       f"finite ones, to '{saved}'; {SMALLER_LR}")
    after_one = parameters_after(diverging, 1)
    assert all(np.isfinite(value).all() for value in after_one.values())
    assert_saved(saved, after_one)
    message, _ = run_error(capsys, "run", diverging, "--data", data, "--steps", "5", "-q")
    assert message == f"training diverged at step 2: its loss is nan; nothing saved (no --save-params); {SMALLER_LR}"


def test_a_non_finite_parameter_stops_the_run_and_a_skipped_step_does_not(bundle, data, tmp_path, monkeypatch,
                                                                         capsys) -> None:
    """Step 2 as dynamic loss scaling skips one (inf loss, skipped 1) goes on; step 3 leaves w2 NaN at a finite
    loss (a NaN behind a ReLU): the run stops there, with the parameters after step 2."""
    step, parameters = LocalRunner.step, LocalRunner.parameters

    def skipped_at_two(self: LocalRunner, feeds: dict) -> float:
        loss = step(self, feeds)
        if self.steps == 2:
            self.metrics = {"skipped": 1.0}
            return math.inf
        return loss

    def nan_at_three(self: LocalRunner) -> dict[str, np.ndarray]:
        values = parameters(self)
        if self.steps == 3:
            values["w2"][0, 1] = np.nan
        return values

    monkeypatch.setattr(LocalRunner, "step", skipped_at_two)
    monkeypatch.setattr(LocalRunner, "parameters", nan_at_three)
    saved = str(tmp_path / "trained.npz")
    message, steps = run_error(capsys, "run", bundle, "--data", data, "--steps", "5", "--save-params", saved)
    assert steps == [1, 2, 3]
    assert message == (f"training diverged at step 3: parameter 'w2' is nan (1 of 24 values not finite); saved the "
                       f"parameters after step 2, the last finite ones, to '{saved}'; {SMALLER_LR}")
    monkeypatch.undo()
    assert_saved(saved, parameters_after(bundle, 2))


def test_a_failure_to_read_the_parameters_back_keeps_the_last_ones_read(bundle, data, tmp_path, monkeypatch,
                                                                        capsys) -> None:
    parameters = LocalRunner.parameters

    def failing_from_three(self: LocalRunner) -> dict[str, np.ndarray]:
        if self.steps >= 3:
            raise RuntimeError("clEnqueueReadImage failed: OUT_OF_RESOURCES")
        return parameters(self)

    monkeypatch.setattr(LocalRunner, "parameters", failing_from_three)
    saved = str(tmp_path / "trained.npz")
    message, _ = run_error(capsys, "run", bundle, "--data", data, "--steps", "4", "--save-params", saved)
    assert message == ("reading the parameters back after step 3 failed (RuntimeError: clEnqueueReadImage failed: "
                       f"OUT_OF_RESOURCES); saved the parameters after step 2, the last finite ones, to '{saved}'; "
                       "rerun with --debug for the traceback and report it")
    monkeypatch.undo()
    assert_saved(saved, parameters_after(bundle, 2))


class FakeAdb:
    def choose(self, serial: str | None) -> str:
        return serial or "phone"


def test_adb_runs_that_diverge_are_errors_and_their_parameters_not_saved(bundle, data, tmp_path, monkeypatch,
                                                                         capsys) -> None:
    """The runner on a phone runs every step and hands over the parameters after the last one only."""
    import fblc.cli.run_adb as run_adb

    losses = [1.5, math.nan, math.nan]
    manifest = json.load(open(os.path.join(bundle, fmt.MANIFEST)))
    finite = {p["name"]: np.ones(p["shape"], np.float32) for p in manifest["parameters"]}

    def run_on_device(adb, serial, bundle, batches, steps, runner=None, on_line=None, say=None,
                      kernel_times=False) -> RunnerResults:
        for step, loss in enumerate(losses, start=1):
            on_line({"step": step, "loss": loss, "ms": 1.0})
        parameters = {name: value * (math.nan if math.isnan(losses[-1]) else 1) for name, value in finite.items()}
        return RunnerResults(losses, [1.0] * 3, [0.5] * 3, [0.1] * 3, [], {"textures": 0}, {}, {}, parameters,
                             {"losses": losses})

    monkeypatch.setattr(run_adb, "Adb", FakeAdb)
    monkeypatch.setattr(run_adb, "run_on_device", run_on_device)
    saved, results = str(tmp_path / "trained.npz"), str(tmp_path / "results.json")
    args = ["run", bundle, "--device", "adb:phone", "--data", data, "--steps", "3", "--save-params", saved]
    message, steps = run_error(capsys, *args, "--results", results)
    assert steps == [1, 2, 3] and not os.path.exists(saved) and os.path.exists(results)
    assert message == ("training diverged at step 2: its loss is nan; the runner hands over only the parameters "
                       f"after its last step, 3: not saved; {SMALLER_LR}")
    losses[1:] = [1.2, 1.0]  # finite losses, but NaN reached a parameter
    finite["w1"][0, 0] = math.inf
    message, _ = run_error(capsys, *args)
    assert message.startswith("the parameters after the last step, 3: parameter 'w1' is inf (1 of 48 values not "
                              "finite); the runner hands over only") and not os.path.exists(saved)
    finite["w1"][0, 0] = 1.0
    assert main(args) == 0
    assert_saved(saved, finite)
    *_, closing, saved_line = capsys.readouterr().out.splitlines()
    assert closing.startswith("trained 3 steps in ") and saved_line.endswith(f"to '{saved}'")


# --- 2. bundle integrity ------------------------------------------------------------------------------------
def edited_copy(bundle: str, folder: str, edit) -> str:
    """A copy of `bundle` whose manifest.json `edit` changed, written back as a person would (not sealed)."""
    copy = os.path.join(folder, "edited")
    shutil.copytree(bundle, copy)
    path = os.path.join(copy, fmt.MANIFEST)
    manifest = json.load(open(path))
    edit(manifest)
    with open(path, "w") as handle:
        json.dump(manifest, handle, indent=2)
    return copy


def test_an_edited_manifest_is_refused_before_training(bundle, data, tmp_path, capsys, no_runner) -> None:
    """The reported case: a parameter's texture index edited, run with --save-params, trained and then failed
    to save. The manifest's own digest (manifest_sha256) refuses it, and an older bundle, before any work."""
    edited = edited_copy(bundle, str(tmp_path), lambda m: m["parameters"][0].update(texture=99))
    saved = str(tmp_path / "trained.npz")
    assert refused(capsys, str(tmp_path), "run", edited, "--data", data, "--save-params", saved) == (
        f"'{edited}/manifest.json' does not match its own checksum (manifest_sha256): corrupt or edited; compile the "
        "bundle again")
    for device in ("local", "adb:phone"):
        assert "does not match its own checksum" in refused(capsys, str(tmp_path), "run", edited, "--data", data,
                                                            "--device", device)
    shutil.rmtree(edited)
    older = edited_copy(bundle, str(tmp_path), lambda m: m.update(format_version=3))
    assert refused(capsys, str(tmp_path), "run", older, "--data", data) == (
        f"'{older}' has format 'fblc-bundle' version 3; this fblc reads fblc-bundle version {fmt.FORMAT_VERSION}: "
        "compile it again with this fblc")


def test_the_native_runner_checks_the_manifest_digest_as_the_python_side(bundle, runner_binary, tmp_path) -> None:
    """Before any OpenCL call: a sealed manifest passes (the next error is about the data), an edited one not."""
    def run(folder: str) -> subprocess.CompletedProcess:
        return subprocess.run([runner_binary, folder, "--data", str(tmp_path / "none.bin"), "--steps", "1", "--out",
                               str(tmp_path)], capture_output=True, text=True)

    done = run(bundle)
    assert done.returncode == 2 and "cannot read data file" in done.stderr, done.stderr
    edited = edited_copy(bundle, str(tmp_path), lambda m: m["inputs"][0].update(texture=0))
    done = run(edited)
    assert done.returncode == 2 and done.stderr.strip() == (
        f"fblc-runner: error: '{edited}/manifest.json' does not match its own checksum (manifest_sha256): corrupt "
        "or edited; compile the bundle again")


# --- 3. a profile with an impossible figure -----------------------------------------------------------------
@pytest.mark.parametrize("figure, value, shown", [("bandwidth_gbps", math.nan, "nan"),
                                                  ("l1_bytes", math.inf, "inf"), ("l1_ways", math.nan, "nan")])
def test_a_profile_with_a_nan_or_infinite_figure_is_refused_naming_it(tmp_path, mlp_path, capsys, figure, value,
                                                                      shown) -> None:
    from fblc.profiles.profile import FIGURES, TARGETS_DIR

    document = json.load(open(os.path.join(TARGETS_DIR, "adreno830.json")))
    document["figures"][figure]["value"] = value
    profile = str(tmp_path / "my.json")
    with open(profile, "w") as handle:
        json.dump(document, handle)  # Python writes NaN and Infinity, and reads them back
    assert refused(capsys, str(tmp_path), "compile", mlp_path, "-o", str(tmp_path / "b"), "--target", profile) == (
        f"profile '{profile}': figure '{figure}' ({FIGURES[figure][1]}) is {shown}: it must be a finite positive "
        "number; fix the file, or measure the device with 'fblc profile'")


# --- 4., 5. the device variable, the runner's build hint ----------------------------------------------------
def test_a_bogus_device_variable_is_named_with_its_value_and_the_valid_forms(bundle, data, tmp_path, monkeypatch,
                                                                             capsys) -> None:
    monkeypatch.setenv("FBLC_OPENCL_DEVICE", "bogus")
    message = refused(capsys, str(tmp_path), "run", bundle, "--data", data)
    assert message.startswith("FBLC_OPENCL_DEVICE='bogus' is not a device fblc knows; set FBLC_OPENCL_DEVICE to "
                              "'local' or 'opencl:PLATFORM:DEVICE' (here: opencl:0:0 = ")
    assert message.endswith(", or unset it")
    monkeypatch.setenv("FBLC_OPENCL_DEVICE", "opencl:9:9")
    message = refused(capsys, str(tmp_path), "run", bundle, "--data", data)
    assert message.startswith("FBLC_OPENCL_DEVICE='opencl:9:9' does not exist; available: opencl:0:0 = ")
    assert message.endswith("; set FBLC_OPENCL_DEVICE to one of them, or unset it")


def test_the_native_runner_build_hint_is_one_command_that_works_from_any_folder(tmp_path, monkeypatch,
                                                                                capsys) -> None:
    from fblc.runtime import native

    monkeypatch.setattr(native, "runner_candidates", lambda explicit=None: [])
    monkeypatch.chdir(tmp_path)
    message = refused(capsys, str(tmp_path), "profile", "--device", "native", "-o", "p.json")
    hint = message.split(" with: ", 1)[1]
    assert hint == (f"cmake -S {native.NATIVE_DIR} -B {native.HOST_BUILD} && cmake --build {native.HOST_BUILD}")
    words = shlex.split(hint)
    assert all(os.path.isabs(words[words.index(flag) + 1]) for flag in ("-S", "-B", "--build"))


# --- 6., 7. the storage chosen, the closing summary ---------------------------------------------------------
def test_run_says_which_storage_auto_chose_and_closes_with_a_summary(bundle, data, tmp_path, capsys) -> None:
    import pyopencl as cl

    from fblc.runtime.opencl import select_device

    cpu = bool(select_device().type & cl.device_type.CPU)
    chosen = "buffer" if cpu else "image"
    assert main(["run", bundle, "--data", data, "--steps", "3"]) == 0
    out, err = capsys.readouterr()
    assert err.count("note: --storage auto chose") == 1
    assert f"note: --storage auto chose {chosen}: " in err
    assert ("is a CPU, whose OpenCL images are software: buffers run the same kernels several times faster"
            in err) == cpu
    assert re.fullmatch(SUMMARY + "; parameters not saved: add --save-params FILE.npz", out.splitlines()[-1])
    assert out.splitlines()[-1].startswith("trained 3 steps in ")
    saved = str(tmp_path / "trained.npz")
    assert main(["run", bundle, "--data", data, "--steps", "2", "--save-params", saved]) == 0
    out = capsys.readouterr().out
    *_, closing, saved_line = out.splitlines()
    assert re.fullmatch(SUMMARY, closing), closing
    assert saved_line.startswith("saved 4 trained parameters (") and saved_line.endswith(f"to '{saved}'")
    assert_saved(saved, parameters_after(bundle, 2))
    assert LocalRunner(bundle, progress=False).storage == chosen
    assert LocalRunner(bundle, progress=False, storage="image").storage_reason == ""
