"""The phone path end to end: Debian's real adb client and server talk to the loopback device
(tests/support/adb_device.py) exactly as to a phone; `fblc push` and `fblc run --device adb:S` train a bundle
there with the native runner, `fblc profile --device adb:S` measures the device with it, and every error of
the path gets a one-line message that leaves nothing half-written on either side.

The adb server runs on a port of its own with HOME in a temporary folder (its key and log stay there);
the device's shells inherit this process's environment, so the runner finds PoCL as in
tests/test_native_runner.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fblc import bundle_format as fmt
from fblc.cli import main
from fblc.codegen.compile import compile_model
from fblc.profiles import profiler
from fblc.runtime.adb import Adb, AdbError, remote_dir
from fblc.runtime.adb_profile import PROFILE_DIR, push_profiler
from fblc.runtime.local import LocalRunner
from fblc.runtime.specialist import with_fingerprint
from tests.support.adb_device import LoopbackDevice
from tests.support.bundles import rechecksum
from tests.support.interrupt import interruptible
from tests.test_native_runner import check_measured_profile, require
from tests.test_native_runner import opencl_env, runner_binary  # noqa: F401  (fixtures)
from tests.test_runtime import OPTIONS, batch, elementwise_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _adb(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(["adb", *args], capture_output=True, text=True, timeout=timeout)


def _wait_for(serial: str, state: str) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        listing = _adb("devices").stdout
        if any(line.split() == [serial, state] for line in listing.splitlines()):
            return
        time.sleep(0.05)
    raise AssertionError(f"{serial} never became '{state}':\n{_adb('devices').stdout}")


def connect(device: LoopbackDevice, state: str = "device") -> str:
    out = _adb("connect", device.serial).stdout
    assert device.serial in out, out
    _wait_for(device.serial, state)
    return device.serial


@pytest.fixture(scope="module")
def adb_server(tmp_path_factory, opencl_env):  # noqa: F811
    """A private adb server; the environment the device's shells (and so the runner) inherit."""
    require(shutil.which("adb") is not None, "adb (apt-get install adb)")
    saved = dict(os.environ)
    os.environ.update(opencl_env)
    os.environ["ANDROID_ADB_SERVER_PORT"] = str(_free_port())
    os.environ.pop("ANDROID_SERIAL", None)
    home = str(tmp_path_factory.mktemp("adb-home"))
    started = subprocess.run(["adb", "start-server"], capture_output=True, text=True, timeout=30,
                             env={**os.environ, "HOME": home})
    assert started.returncode == 0, started.stderr
    try:
        yield os.environ["ANDROID_ADB_SERVER_PORT"]
    finally:
        _adb("kill-server")
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture
def phone(tmp_path, adb_server):
    """A connected loopback device; its /data/local/tmp is tmp_path/phone."""
    device = LoopbackDevice(str(tmp_path / "phone")).start()
    connect(device)
    yield device
    _adb("disconnect", device.serial)
    device.stop()


@pytest.fixture
def bundle(tmp_path) -> str:
    out = str(tmp_path / "ew_bundle")
    compile_model(elementwise_model(str(tmp_path / "model.onnx")), out, "adreno830", "fp32", OPTIONS)
    return out


def _device_files(device: LoopbackDevice) -> list[str]:
    found = []
    for folder, _, files in os.walk(device.root):
        found += [os.path.relpath(os.path.join(folder, name), device.root) for name in files]
    return sorted(found)


def test_push_then_run_trains_on_the_device_like_the_local_run(tmp_path, bundle, phone, runner_binary,  # noqa: F811
                                                               capsys) -> None:
    feeds = batch(rows=6)
    data, saved, results = str(tmp_path / "data.npz"), str(tmp_path / "trained.npz"), str(tmp_path / "results.json")
    np.savez(data, **feeds)
    assert main(["push", bundle, "--serial", phone.serial, "--runner", runner_binary]) == 0
    assert f"to {phone.serial}:/data/local/tmp/fblc/ew_bundle" in capsys.readouterr().out
    remote = phone.local_path(remote_dir(bundle))
    assert sorted(os.listdir(remote)) == sorted([*os.listdir(bundle), "fblc-runner", ".fblc-pushed"])
    assert fmt.load_verified(remote)  # the device's copy is intact

    code = main(["run", bundle, "--device", f"adb:{phone.serial}", "--steps", "4", "--data", data, "--json",
                 "--save-params", saved, "--results", results, "--runner", runner_binary, "--kernel-times"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "pushed" not in out.out  # the device's copy was current
    lines = [json.loads(line) for line in out.out.splitlines()]
    local = LocalRunner(bundle, storage="image")
    expected = [local.step({k: v[(s % 2) * 3:(s % 2) * 3 + 3] for k, v in feeds.items()}) for s in range(4)]
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    np.testing.assert_allclose([line["loss"] for line in lines], expected, rtol=1e-5)
    trained = np.load(saved)
    assert sorted(trained.files) == ["b", "w"]
    for name, value in local.parameters().items():
        np.testing.assert_allclose(trained[name], value, rtol=1e-5, atol=1e-7)
    report = json.load(open(results))
    assert len(report["kernels"]) == len(local.plan["kernels"]) and report["bytes_allocated"]["textures"] > 0
    # the run's folder is gone; the program cache stays next to the device's bundle
    assert "kernels.cache" in os.listdir(remote) and os.listdir(os.path.join(remote, "runs")) == []

    # plain output: banner, steps, timing summary; the cached program is used
    assert main(["run", bundle, "--device", f"adb:{phone.serial}", "--steps", "2", "--data", data,
                 "--runner", runner_binary]) == 0
    text = capsys.readouterr().out
    assert f"training {bundle} on {phone.serial}" in text and "cached program" in text
    assert "step    2  loss" in text and "ms per step" in text and "--kernel-times" in text  # untimed kernels


def test_run_pushes_a_missing_or_changed_bundle_by_itself(tmp_path, bundle, phone, runner_binary,  # noqa: F811
                                                          capsys) -> None:
    data = str(tmp_path / "data.npz")
    np.savez(data, **batch())
    args = ["run", bundle, "--device", f"adb:{phone.serial}", "--steps", "1", "--data", data,
            "--runner", runner_binary]
    assert main(args) == 0
    assert "pushed" in capsys.readouterr().out
    stale = os.path.join(phone.local_path("/data/local/tmp/fblc"), ".ew_bundle.partial-dead0000")
    os.makedirs(stale)  # left by a push whose device vanished
    # the same bundle with other initial parameters (as recompiling a retrained model gives): its manifest differs
    params = os.path.join(bundle, fmt.PARAMS)
    with open(params, "r+b") as handle:
        handle.seek(-4, os.SEEK_END)
        handle.write(np.float32(0.25).tobytes())
    rechecksum(bundle, fmt.PARAMS)
    manifest = json.load(open(os.path.join(bundle, fmt.MANIFEST)))
    assert main(args) == 0
    assert "pushed" in capsys.readouterr().out
    remote = phone.local_path(remote_dir(bundle))
    assert fmt.sha256_of(os.path.join(remote, fmt.PARAMS)) == manifest["checksums"][fmt.PARAMS]
    assert main(args) == 0
    assert "pushed" not in capsys.readouterr().out
    assert [p for p in os.listdir(os.path.dirname(remote)) if p.startswith(".")] == []  # no staging left


def test_fblc_devices_lists_adb_devices(phone, capsys) -> None:
    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    assert "OpenCL devices:" in out and f"adb:{phone.serial}  device  product:fblc_loopback" in out


def _error(capsys, *args: str) -> str:
    code = main(list(args))
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("fblc: error: "), err
    return err


def test_adb_missing_and_no_device(tmp_path, bundle, adb_server, monkeypatch, capsys) -> None:
    monkeypatch.setenv("FBLC_ADB", str(tmp_path / "no-adb-here"))
    err = _error(capsys, "push", bundle)
    assert "adb not found (FBLC_ADB=" in err and "apt-get install adb" in err
    monkeypatch.setenv("FBLC_ADB", "adb")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert "adb not found" in _error(capsys, "push", bundle)
    monkeypatch.undo()
    # a second adb server, with no device connected
    monkeypatch.setenv("ANDROID_ADB_SERVER_PORT", str(_free_port()))
    monkeypatch.setenv("HOME", str(tmp_path))
    try:
        assert "no adb device found" in _error(capsys, "push", bundle)
    finally:
        _adb("kill-server")


def test_several_devices_unauthorized_and_unknown_serial(tmp_path, bundle, phone, capsys) -> None:
    # a second device started from a shell, as the module documents
    port = _free_port()
    process = subprocess.Popen([sys.executable, "-m", "tests.support.adb_device", "--port", str(port), "--root",
                                str(tmp_path / "second")], cwd=REPO, stdout=subprocess.PIPE, text=True)
    locked = LoopbackDevice(str(tmp_path / "locked"), unauthorized=True).start()
    try:
        assert process.stdout is not None and "loopback adb device on" in process.stdout.readline()
        second = f"127.0.0.1:{port}"
        _adb("connect", second)
        _wait_for(second, "device")
        assert _adb("-s", second, "shell", "echo", "hello").stdout.strip() == "hello"
        err = _error(capsys, "push", bundle)
        assert "several adb devices are attached" in err and phone.serial in err and "--serial" in err
        _adb("connect", locked.serial)
        _wait_for(locked.serial, "unauthorized")
        err = _error(capsys, "push", bundle, "--serial", locked.serial)
        assert f"device {locked.serial} is unauthorized" in err and "Allow USB debugging" in err
        err = _error(capsys, "run", bundle, "--device", "adb:127.0.0.1:1", "--data", str(tmp_path / "x.npz"))
        assert "cannot read data file" in err  # the data is checked before the device
        np.savez(str(tmp_path / "x.npz"), **batch())
        err = _error(capsys, "run", bundle, "--device", "adb:127.0.0.1:1", "--data", str(tmp_path / "x.npz"))
        assert "no adb device '127.0.0.1:1'" in err and "adb connect 127.0.0.1:1" in err
        assert [d.state for d in Adb().devices() if d.serial == locked.serial] == ["unauthorized"]
    finally:
        for serial in (f"127.0.0.1:{port}", locked.serial):
            _adb("disconnect", serial)
        process.terminate()
        process.wait(timeout=10)
        locked.stop()


def test_a_full_disk_fails_the_push_and_leaves_nothing(tmp_path, bundle, adb_server, runner_binary,  # noqa: F811
                                                       capsys) -> None:
    device = LoopbackDevice(str(tmp_path / "full"), capacity=20_000).start()  # room for the bundle, not the runner
    try:
        connect(device)
        err = _error(capsys, "push", bundle, "--serial", device.serial, "--runner", runner_binary)
        assert f"{device.serial} is full" in err and "No space left on device" in err
        assert _device_files(device) == []
        assert os.listdir(os.path.join(device.root, "fblc")) == []  # no staging folder either
    finally:
        _adb("disconnect", device.serial)
        device.stop()


def test_a_failed_run_reports_the_runner_error_and_leaves_nothing(tmp_path, bundle, phone, runner_binary,  # noqa: F811
                                                                   capsys) -> None:
    data, saved = str(tmp_path / "data.npz"), str(tmp_path / "trained.npz")
    np.savez(data, **batch())
    assert main(["push", bundle, "--serial", phone.serial, "--runner", runner_binary, "-q"]) == 0
    remote = phone.local_path(remote_dir(bundle))
    with open(os.path.join(remote, fmt.PARAMS), "r+b") as handle:  # the device's copy goes bad
        handle.write(b"\xff\xff\xff\xff")
    before = _device_files(phone)
    err = _error(capsys, "run", bundle, "--device", f"adb:{phone.serial}", "--steps", "2", "--data", data,
                 "--save-params", saved, "--runner", runner_binary)
    assert f"the runner failed on {phone.serial}:" in err and "params.bin' does not match the checksum" in err
    assert not os.path.exists(saved) and [p for p in os.listdir(tmp_path) if p.startswith(".fblc")] == []
    assert _device_files(phone) == before  # the run folder is gone again


def test_a_runner_for_another_machine_is_refused(tmp_path, bundle, phone, capsys) -> None:
    fake = tmp_path / "fblc-runner"
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    header[18:20] = (183).to_bytes(2, "little")  # EM_AARCH64, no program headers: a static aarch64 binary
    fake.write_bytes(bytes(header))
    err = _error(capsys, "push", bundle, "--serial", phone.serial, "--runner", str(fake))
    assert "static aarch64" in err and "linux x86_64" in err
    with pytest.raises(AdbError, match="does not exist"):
        from fblc.runtime.adb import choose_runner

        choose_runner(Adb(), phone.serial, str(tmp_path / "missing"))


def test_ctrl_c_during_a_run_on_the_device_leaves_nothing(tmp_path, bundle, phone, runner_binary) -> None:  # noqa: F811
    data, saved = str(tmp_path / "data.npz"), str(tmp_path / "trained.npz")
    np.savez(data, **batch())
    assert main(["push", bundle, "--serial", phone.serial, "--runner", runner_binary, "-q"]) == 0
    process = subprocess.Popen([sys.executable, "-m", "fblc.cli", "run", bundle, "--device", f"adb:{phone.serial}",
                                "--steps", "100000000", "--data", data, "--save-params", saved, "--runner",
                                runner_binary], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=interruptible)
    assert process.stdout is not None
    assert "training" in process.stdout.readline()
    assert process.stdout.readline().startswith("step    1")
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130 and "Traceback" not in stderr
    assert re.fullmatch(rf"fblc: interrupted after \d+ of 100000000 steps on {re.escape(phone.serial)}; nothing saved "
                        r"\(the runner hands the parameters over only at the end of its run\)\n", stderr), stderr
    assert not os.path.exists(saved)
    deadline = time.monotonic() + 20  # the device hung the runner up; it stops at the end of its step
    while phone._processes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not phone._processes
    runs = os.path.join(phone.local_path(remote_dir(bundle)), "runs")
    assert os.listdir(runs) == []


def test_profile_over_adb_writes_the_profile_a_local_run_would(tmp_path, phone, runner_binary,  # noqa: F811
                                                                capsys, small_profile_plan) -> None:
    out = str(tmp_path / "phone.json")
    assert main(["profile", "--device", f"adb:{phone.serial}", "--runner", runner_binary, "-o", out]) == 0
    printed = capsys.readouterr().out
    assert "pushed the runner" in printed and f"on {phone.serial} (benchmarks built in" in printed
    assert "block width and height" in printed and f"wrote {out}" in printed  # the runner's progress, streamed
    document = check_measured_profile(out)
    assert document["measurements"]["backend"].endswith(f"over adb on {phone.serial}")
    remote = phone.local_path(PROFILE_DIR)
    assert sorted(os.listdir(remote)) == [".fblc-pushed", "fblc-runner", "runs"] and os.listdir(f"{remote}/runs") == []
    said: list[str] = []
    push_profiler(Adb(), phone.serial, runner_binary, say=said.append)
    assert said == []  # the runner there is current: not pushed again


def test_a_benchmark_the_device_cannot_build_fails_the_profile_and_leaves_nothing(tmp_path, phone,  # noqa: F811
                                                                                 runner_binary, monkeypatch,
                                                                                 capsys) -> None:
    monkeypatch.setattr(profiler, "SOURCE", profiler.SOURCE.replace("__kernel void pair_read(", "__kernel void "
                                                                                                   "pair_read(oops "))
    out = str(tmp_path / "phone.json")
    assert main(["profile", "--device", f"adb:{phone.serial}", "--runner", runner_binary, "-o", out, "-q"]) == 2
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith(f"fblc: error: the runner failed on {phone.serial}: the OpenCL compiler of ")
    assert "rejected the benchmark kernel 'pair_read' (line" in first and "profile another device" in first
    assert not os.path.exists(out) and [p for p in os.listdir(tmp_path) if p.startswith(".fblc")] == []
    assert os.listdir(os.path.join(phone.local_path(PROFILE_DIR), "runs")) == []


def test_an_es_bundle_trains_over_adb_and_prints_its_reward(tmp_path, phone, runner_binary, capsys) -> None:  # noqa: F811
    """Forward-only training on the phone path: the device makes its own noise, so its losses and delta are
    LocalRunner's, and each step's line carries reward_mean."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    from mlp import build_mlp

    from fblc.compiler.adapters import AdapterConfig
    from fblc.compiler.es import EsConfig
    from fblc.compiler.optimizers import OptimizerConfig
    from fblc.passes.pipeline import TrainingOptions

    path = build_mlp(str(tmp_path / "mlp.onnx"), batch=8, in_features=16, hidden=(16,), classes=5)
    options = TrainingOptions(adapter=AdapterConfig(kind="fura-s", block=8), trainer="es", es=EsConfig(pairs=2),
                              optimizer=OptimizerConfig("sgd", lr=1.0))
    bundle = str(tmp_path / "es")
    compile_model(path, bundle, "adreno830", "fp32", options)
    rng = np.random.default_rng(4)
    feeds = {"x": rng.standard_normal((8, 16)).astype(np.float32), "labels": rng.integers(0, 5, 8)}
    np.savez(tmp_path / "data.npz", **feeds)
    saved = str(tmp_path / "delta.npz")
    code = main(["run", bundle, "--device", f"adb:{phone.serial}", "--steps", "3", "--data",
                 str(tmp_path / "data.npz"), "--json", "--save-params", saved, "--runner", runner_binary])
    out = capsys.readouterr()
    assert code == 0, out.err
    lines = [json.loads(line) for line in out.out.splitlines()]
    local = LocalRunner(bundle, progress=False, storage="image")
    expected = [local.step(feeds) for _ in range(3)]
    assert [sorted(line) for line in lines] == [["loss", "ms", "reward_mean", "step"]] * 3
    np.testing.assert_allclose([line["loss"] for line in lines], expected, rtol=1e-5)
    np.testing.assert_allclose(np.load(saved)["fura_s.delta"], local.parameters()["fura_s.delta"], rtol=1e-5,
                               atol=1e-7)


def _forward_model(path: str) -> str:
    """h = relu(x @ w + b) [4, 8]; the outputs: ht, h as [4, 2, 4] with its last two axes swapped (a strided view
    of h's texture: plan.json value_maps), and best = argmax(x @ w + b) (int64: an rgba_i32 texture)."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["a"]),
             helper.make_node("Relu", ["a"], ["h"]), helper.make_node("Reshape", ["h", "s"], ["h3"]),
             helper.make_node("Transpose", ["h3"], ["ht"], perm=[0, 2, 1]),
             helper.make_node("ArgMax", ["a"], ["best"], axis=1, keepdims=0)]
    graph = helper.make_graph(nodes, "forward", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6])],
                              [helper.make_tensor_value_info("ht", TensorProto.FLOAT, [4, 4, 2]),
                               helper.make_tensor_value_info("best", TensorProto.INT64, [4])],
                              [numpy_helper.from_array(rng.standard_normal((6, 8)).astype(np.float32), "w"),
                               numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b"),
                               numpy_helper.from_array(np.array([4, 2, 4], np.int64), "s")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_infer_over_adb_equals_onnxruntime_and_the_local_run(tmp_path, phone, runner_binary,  # noqa: F811
                                                              capsys) -> None:
    """A forward bundle (--trainer none) on the phone path: the native runner runs each of two batches once and
    hands their outputs over (outputs.bin, decoded with plan.json's value maps); joined, they equal onnxruntime
    on the model file and LocalRunner.infer. The bundle has a LoRA site (--adapter lora): without a specialist it
    is the model; with one (--specialist, pushed with the data: the bundle is not pushed again) it equals
    onnxruntime on the model with w + A B. Without --infer the bundle is refused before the device is used."""
    from fblc.compiler.reference import onnxruntime_session

    model = _forward_model(str(tmp_path / "forward.onnx"))
    bundle, data, out = str(tmp_path / "fwd"), str(tmp_path / "inputs.npz"), str(tmp_path / "outputs.npz")
    assert main(["compile", model, "-o", bundle, "-q", "--trainer", "none", "--adapter", "lora", "--rank", "2"]) == 0
    x = np.random.default_rng(1).standard_normal((8, 6)).astype(np.float32)  # two batches of the compiled 4 rows
    np.savez(data, x=x)
    code = main(["run", bundle, "--infer", "--device", f"adb:{phone.serial}", "--data", data, "-o", out,
                 "--runner", runner_binary])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert f"ran {bundle} on {phone.serial}" in captured.out
    session, local = onnxruntime_session(model), LocalRunner(bundle, progress=False, storage="image")
    with np.load(out) as written:
        assert written.files == ["ht", "best"] and written["ht"].shape == (8, 4, 2)
        for rows in (slice(0, 4), slice(4, 8)):
            expected = dict(zip(["ht", "best"], session.run(None, {"x": x[rows]})))
            served = local.infer({"x": x[rows]})
            np.testing.assert_array_equal(written["best"][rows], expected["best"])
            np.testing.assert_array_equal(written["best"][rows], served["best"])
            np.testing.assert_allclose(written["ht"][rows], expected["ht"], rtol=1e-4, atol=1e-5)  # fp32 vs ort
            np.testing.assert_allclose(written["ht"][rows], served["ht"], rtol=1e-6, atol=1e-7)  # same kernels
    assert os.listdir(os.path.join(phone.local_path(remote_dir(bundle)), "runs")) == []  # the run's folder is gone

    rng = np.random.default_rng(2)
    lora = {"w.adapter_A": rng.standard_normal((6, 2)).astype(np.float32),
            "w.adapter_B": rng.standard_normal((2, 8)).astype(np.float32)}
    assert sorted(e["name"] for e in local.manifest["specialist"]) == sorted(lora)
    specialist, merged = str(tmp_path / "lora.npz"), onnx.load(model)
    np.savez(specialist, **with_fingerprint(lora, local.manifest["fingerprint"]))  # one the runner compares too
    weight = next(i for i in merged.graph.initializer if i.name == "w")
    weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) + lora["w.adapter_A"] @ lora["w.adapter_B"],
                                            "w"))
    session = onnxruntime_session(merged)
    capsys.readouterr()
    assert main(["run", bundle, "--infer", "--device", f"adb:{phone.serial}", "--data", data, "-o", out,
                 "--runner", runner_binary, "--specialist", specialist]) == 0
    printed = capsys.readouterr().out
    uploaded = sum(e["nbytes"] for e in local.manifest["specialist"])  # A and B's texels: 3 + 4 texels of 16 bytes
    assert "pushed" not in printed and f"2 adapter tensors (28 values), {uploaded} bytes uploaded" in printed
    with np.load(out) as written:
        for rows in (slice(0, 4), slice(4, 8)):
            expected = dict(zip(["ht", "best"], session.run(None, {"x": x[rows]})))
            np.testing.assert_array_equal(written["best"][rows], expected["best"])
            np.testing.assert_allclose(written["ht"][rows], expected["ht"], rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(written["ht"][rows], local.infer({"x": x[rows]}, specialist=lora)["ht"],
                                       rtol=1e-6, atol=1e-7)

    assert main(["run", bundle, "--device", f"adb:{phone.serial}", "--data", data, "--runner", runner_binary]) != 0
    assert "add --infer -o OUTPUTS.npz" in capsys.readouterr().err
