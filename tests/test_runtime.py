"""The bundle and the local runtime: atomic writes, checksums, data files, devices, build errors, Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from fblc import bundle_format as fmt
from fblc.bundle_format import BundleError
from fblc.cli import main
from fblc.codegen.compile import compile_model
from fblc.errors import FblcError
from fblc.compiler.model_io import save_model_atomically
from fblc.compiler.optimizers import OptimizerConfig
from fblc.compiler.reference import ReferenceStep
from fblc.passes.pipeline import TrainingOptions
from fblc.profiles.profile import TARGETS_DIR
from fblc.runtime.local import DataError, KernelBuildError, LocalRunner
from fblc.runtime.opencl import DeviceError, select_device
from tests.conftest import make_model
from tests.support.bundles import rechecksum

OPTIONS = TrainingOptions(loss="mse", optimizer=OptimizerConfig("adamw", lr=0.05, weight_decay=0.01))


def elementwise_model(path: str, rows: int = 3) -> str:
    """y = sigmoid(x * w + b): only elementwise and reduction kernels."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Mul", ["x", "w"], ["m"], name="scale"), helper.make_node("Add", ["m", "b"], ["a"], name="shift"),
             helper.make_node("Sigmoid", ["a"], ["y"], name="squash")]
    onnx.save(make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, 5])],
                         [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, 5])],
                         {"w": rng.standard_normal((rows, 5)).astype(np.float32),
                          "b": rng.standard_normal(5).astype(np.float32)}), path)
    return path


def batch(rows: int = 3, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((rows, 5)).astype(np.float32),
            "labels": rng.uniform(0, 1, (rows, 5)).astype(np.float32)}


@pytest.fixture
def bundle(tmp_path) -> str:
    out = str(tmp_path / "bundle")
    compile_model(elementwise_model(str(tmp_path / "model.onnx")), out, "adreno830", "fp32", OPTIONS)
    return out


@pytest.mark.usefixtures("optimised_kernel_builds")  # in-place state updates as a user's optimised build runs them
def test_bundle_files_and_several_steps_match_onnxruntime(tmp_path, bundle) -> None:
    assert {fmt.MANIFEST, fmt.PLAN, fmt.KERNELS, fmt.PARAMS, fmt.REPORT} <= set(os.listdir(bundle))
    manifest = json.load(open(os.path.join(bundle, fmt.MANIFEST)))
    assert manifest["format_version"] == fmt.FORMAT_VERSION and manifest["target"] == "adreno830"
    assert [p["name"] for p in manifest["parameters"]] == ["w", "b"]
    step, _ = compile_model(str(tmp_path / "model.onnx"), str(tmp_path / "again"), "adreno830", "fp32", OPTIONS)
    save_model_atomically(step, str(tmp_path / "step.onnx"))
    reference, runner = ReferenceStep(str(tmp_path / "step.onnx")), LocalRunner(bundle)
    for seed in range(5):  # the state swaps carry parameters and Adam state across steps
        feeds = batch(seed=seed)
        np.testing.assert_allclose(runner.step(feeds), reference.step(feeds), rtol=1e-4, atol=1e-5)
    for name, value in reference.parameters().items():
        np.testing.assert_allclose(runner.parameters()[name], value, rtol=1e-4, atol=1e-5)


def _rewrite(bundle: str, name: str, edit) -> None:
    path = os.path.join(bundle, name)
    with open(path, "rb") as handle:
        data = handle.read()
    with open(path, "wb") as handle:
        handle.write(edit(data))


def test_corrupt_or_other_version_bundles_are_refused(bundle) -> None:
    _rewrite(bundle, fmt.PARAMS, lambda data: data[:-4] + b"\x01\x02\x03\x04")
    with pytest.raises(BundleError, match="params.bin' does not match the checksum"):
        LocalRunner(bundle)
    manifest = json.load(open(os.path.join(bundle, fmt.MANIFEST)))
    manifest["format_version"] = 99
    json.dump(manifest, open(os.path.join(bundle, fmt.MANIFEST), "w"))
    with pytest.raises(BundleError, match=f"version 99; this fblc reads fblc-bundle version {fmt.FORMAT_VERSION}"):
        LocalRunner(bundle)


@pytest.mark.parametrize("storage, source, lines", [("image", fmt.KERNELS, "lines"),
                                                    ("buffer", fmt.BUFFER_KERNELS, "buffer_lines")])
def test_a_kernel_that_fails_to_build_is_named_with_the_compiler_log(bundle, storage, source, lines) -> None:
    """The kernel and its line in the source of the runner's storage (plan.json's `lines` or `buffer_lines`)."""
    plan = json.load(open(os.path.join(bundle, fmt.PLAN)))
    victim = plan["kernels"][2]
    _rewrite(bundle, source, lambda data: data.replace(f"void {victim['function']}(".encode(),
                                                       f"void {victim['function']}(undeclared_type z, ".encode()))
    rechecksum(bundle, source)
    with pytest.raises(KernelBuildError) as error:
        LocalRunner(bundle, storage=storage)
    line = int(re.search(rf"'{victim['name']}' \({re.escape(source)} line (\d+)\)", str(error.value)).group(1))
    assert victim[lines][0] <= line <= victim[lines][1] and "undeclared_type" in str(error.value)


def test_data_files_with_missing_or_misshaped_arrays_list_what_is_expected(tmp_path, bundle, capsys) -> None:
    data = str(tmp_path / "data.npz")
    np.savez(data, x=np.zeros((6, 4), np.float32))
    code = main(["run", bundle, "--data", data, "--steps", "1"])
    err = capsys.readouterr().err
    assert code == 2
    assert "'x' has shape [6, 4]; 'labels' is missing" in err and "expected arrays" in err and "x [3, 5]" in err
    with pytest.raises(DataError, match="'labels' is missing"):
        LocalRunner(bundle).step({"x": np.zeros((3, 5), np.float32)})


def test_run_iterates_batches_saves_params_and_prints_json(tmp_path, bundle, capsys) -> None:
    data = str(tmp_path / "data.npz")
    feeds = batch(rows=6)
    np.savez(data, **feeds)
    saved = str(tmp_path / "trained.npz")
    assert main(["run", bundle, "--data", data, "--steps", "4", "--json", "--save-params", saved]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4] and all(line["ms"] > 0 for line in lines)
    runner = LocalRunner(bundle)
    expected = [runner.step({k: v[(s % 2) * 3:(s % 2) * 3 + 3] for k, v in feeds.items()}) for s in range(4)]
    np.testing.assert_allclose([line["loss"] for line in lines], expected, rtol=1e-6)
    trained = np.load(saved)
    assert sorted(trained.files) == ["b", "w"] and trained["w"].shape == (3, 5)
    np.testing.assert_allclose(trained["w"], runner.parameters()["w"], rtol=1e-6)


def test_device_errors_say_what_to_do(monkeypatch) -> None:
    with pytest.raises(DeviceError, match=r"'opencl:9:9' does not exist; available: opencl:0:0"):
        select_device("opencl:9:9")
    with pytest.raises(DeviceError, match="use 'local' or 'opencl:PLATFORM:DEVICE'"):
        select_device("cuda:0")
    import pyopencl as cl

    monkeypatch.setattr(cl, "get_platforms", lambda: [])
    with pytest.raises(DeviceError, match="pip install pocl-binary-distribution"):
        select_device("local")


def test_the_local_device_is_the_first_whose_compiler_builds_a_kernel(monkeypatch) -> None:
    """A driver may list a device whose compiler fails on this CPU (the pip PoCL's LLVM 14 on AMD Zen 5):
    `local` takes the next one that builds, and says what failed when none does."""
    import pyopencl as cl

    from fblc.runtime import opencl

    real = [d for p in cl.get_platforms() for d in p.get_devices() if d.image_support]
    assert real and opencl.build_error(real[0]) is None  # the device the suite runs on builds the probe

    class Device:
        def __init__(self, name: str, error: str | None) -> None:
            self.name, self.error, self.image_support = name, error, True
            self.platform = type("Platform", (), {"version": "OpenCL 3.0 fake"})()

    class Platform:
        def __init__(self, *devices: Device) -> None:
            self.devices = list(devices)

        def get_devices(self) -> list[Device]:
            return self.devices

    broken, working = Device("broken-cpu", "error: unknown target CPU 'generic'"), Device("working-cpu", None)
    later = Device("later-gpu", None)
    probed = []

    def probe(device: Device) -> str | None:
        probed.append(device.name)
        return device.error

    monkeypatch.setattr(opencl, "build_error", probe)
    monkeypatch.setattr(cl, "get_platforms", lambda: [Platform(broken), Platform(working, later)])
    assert select_device("local") is working
    assert probed == ["broken-cpu", "working-cpu"]  # no build on a device after the one chosen
    monkeypatch.setattr(cl, "get_platforms", lambda: [Platform(broken)])
    with pytest.raises(DeviceError, match=r"no OpenCL device here can build a kernel: broken-cpu \(OpenCL 3.0 fake\): "
                                          r"error: unknown target CPU 'generic'.*apt-get install pocl-opencl-icd"):
        select_device("local")


def test_tensor_beyond_the_image_limits_is_named(tmp_path) -> None:
    profile = json.load(open(os.path.join(TARGETS_DIR, "local.json")))
    profile["name"] = "tiny-gpu"
    profile["figures"]["image2d_max_width"]["value"] = profile["figures"]["image2d_max_height"]["value"] = 2
    target = tmp_path / "tiny.json"
    target.write_text(json.dumps(profile))
    with pytest.raises(FblcError, match=r"needs a 2 x 3 texture, beyond tiny-gpu's image limit of 2 x 2"):
        compile_model(elementwise_model(str(tmp_path / "m.onnx"), rows=4), str(tmp_path / "out"), str(target), "fp32",
                      OPTIONS)
    assert not (tmp_path / "out").exists()
    assert [p for p in os.listdir(tmp_path) if p.startswith(".fblc")] == []


def test_ctrl_c_during_run_leaves_the_bundle_untouched(tmp_path, bundle) -> None:
    data = str(tmp_path / "data.npz")
    np.savez(data, **batch())
    before = {name: fmt.sha256_of(os.path.join(bundle, name)) for name in os.listdir(bundle)}
    # SIGINT as a terminal gives it: a shell starts background jobs with SIGINT ignored, which Python keeps
    # (no KeyboardInterrupt: the run went on to its end when this suite was launched with `&`)
    process = subprocess.Popen([sys.executable, "-m", "fblc.cli", "run", bundle, "--data", data, "--steps", "100000"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert process.stdout is not None
    process.stdout.readline()  # the banner
    process.stdout.readline()  # the first step ran
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130 and "interrupted" in stderr and "Traceback" not in stderr
    assert {name: fmt.sha256_of(os.path.join(bundle, name)) for name in os.listdir(bundle)} == before


def test_compile_and_verify_commands(tmp_path, capsys) -> None:
    model = elementwise_model(str(tmp_path / "model.onnx"))
    assert main(["compile", model, "--loss", "mse", "--target", "mali-g925", "-o", str(tmp_path / "b")]) == 0
    assert "kernels (" in capsys.readouterr().out
    assert json.load(open(tmp_path / "b" / fmt.REPORT))["kernels_per_family"]["elementwise"] >= 1
    assert main(["verify", model, "--loss", "mse", "--optimizer", "adam", "--show", "3"]) == 0
    out = capsys.readouterr().out
    assert "max rel err" in out and "tensors match onnxruntime within rtol 0.0001, atol 1e-05 (fp32)" in out
    assert main(["compile", model, "--target", "no-such-gpu", "-o", str(tmp_path / "c")]) == 2
    assert "unknown target 'no-such-gpu'; choose one of: adreno730, adreno830, local, mali-g925" in capsys.readouterr().err
