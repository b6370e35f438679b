"""The native runner (fblc/runtime/native, C99), built with CMake here and run on PoCL: the same losses and
parameters as LocalRunner on the bundles of the earlier tests, its program cache, its refusals of bad
bundles and data, Ctrl-C, its profile mode (`fblc profile --device native`), and the aarch64 cross build.

The runner opens libOpenCL.so.1 (Debian: ocl-icd-libopencl1), pointed at the PoCL of the pyopencl wheel,
the device LocalRunner uses (pocl_wheel_environment). Missing tools skip these tests, except under
FBLC_CI=1 (.ci/run), where they must be there.
"""

from __future__ import annotations

import ctypes.util
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from fblc import bundle_format as fmt
from support.bundles import edit_plan, rechecksum
from fblc.codegen.compile import compile_model
from fblc.compiler.optimizers import OptimizerConfig
from fblc.passes.pipeline import TrainingOptions
from fblc.runtime.local import LocalRunner
from fblc.cli import main
from fblc.profiles import PORTABLE_IMAGE_EDGE, load_profile
from fblc.profiles.cache_model import PATTERNS
from fblc.profiles.profiler import measurement_plan
from fblc.runtime.native import (AARCH64_TOOLCHAIN, NATIVE_DIR, RunnerError, binary_kind, build_runner,
                                 pocl_wheel_environment, profile_with_runner, pyopencl_build_options, read_results,
                                 run_runner, write_data, SYSTEM_VENDORS)
from tests.test_runtime import OPTIONS, batch, elementwise_model

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from mlp import build_mlp  # noqa: E402
from tresnet import build_tresnet  # noqa: E402

CROSS_ENTROPY = TrainingOptions(loss="cross_entropy", optimizer=OptimizerConfig("adamw", lr=0.01, weight_decay=0.01))
_BUILT: dict[str, str] = {}


def require(condition: bool, what: str) -> None:
    """Skip without `what`, but fail under FBLC_CI=1, where .ci/run installs everything."""
    if not condition:
        if os.environ.get("FBLC_CI") == "1":
            pytest.fail(f"{what} is missing (FBLC_CI=1: .ci/run should have installed it)")
        pytest.skip(f"{what} is missing")


@pytest.fixture(scope="session")
def runner_binary(tmp_path_factory) -> str:
    """The runner, built once per session with CMake (shared with tests/test_adb.py)."""
    if "host" not in _BUILT:
        require(shutil.which("cmake") is not None and shutil.which("cc") is not None, "cmake / a C compiler")
        _BUILT["host"] = build_runner(str(tmp_path_factory.mktemp("runner-build")))
    return _BUILT["host"]


@pytest.fixture(scope="session")
def opencl_env(tmp_path_factory) -> dict[str, str]:
    """Environment for the runner to find the wheel's PoCL through libOpenCL.so.1, building with the options
    pyopencl gives LocalRunner's build, so that PoCL compiles each bundle's kernels once for both."""
    require(ctypes.util.find_library("OpenCL") is not None, "libOpenCL.so.1 (apt-get install ocl-icd-libopencl1)")
    env = pocl_wheel_environment(str(tmp_path_factory.mktemp("icd")))
    drivers = glob.glob(os.path.join(os.environ.get("OCL_ICD_VENDORS") or SYSTEM_VENDORS, "*.icd"))
    require(bool(env) or bool(drivers) or bool(os.environ.get("FBLC_OPENCL_LIBRARY")),
            "an OpenCL driver for the runner (the PoCL of the pyopencl wheel, or apt-get install pocl-opencl-icd)")
    return {**env, **pyopencl_build_options()}


def run(runner: str, bundle: str, data: str, out: str, steps: int, env: dict[str, str], *extra: str,
        check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([runner, bundle, "--data", data, "--steps", str(steps), "--out", out, *extra],
                          capture_output=True, text=True, env={**os.environ, **env})
    if check:
        assert done.returncode == 0, done.stderr
    return done


def compare_with_local(bundle: str, feeds: list[dict[str, np.ndarray]], steps: int, runner_binary: str,
                       env: dict[str, str]) -> LocalRunner:
    """The runner's losses, parameters, bytes and launches are LocalRunner's (returned, after its steps)."""
    local = LocalRunner(bundle, storage="image")  # images, as the runner holds them
    expected = [local.step(feeds[s % len(feeds)]) for s in range(steps)]
    # LocalRunner first, the runner without its program cache: PoCL then compiles every kernel once for both
    # (fetching a program binary for the cache makes PoCL compile all kernels again; the cache has its own test)
    native = run_runner(runner_binary, bundle, feeds, steps, env=env, cache=False, kernel_times=True)
    np.testing.assert_allclose(native.losses, expected, rtol=1e-5)
    reference = local.parameters()
    assert list(native.parameters) == list(reference)
    for name, value in reference.items():
        assert native.parameters[name].shape == value.shape and native.parameters[name].dtype == np.float32
        np.testing.assert_allclose(native.parameters[name], value, rtol=1e-5, atol=1e-7, err_msg=name)
    images = json.load(open(os.path.join(bundle, fmt.PLAN)))["images"]  # shared by textures of disjoint lifetimes
    assert native.bytes_allocated["textures"] == sum(i["width"] * i["height"] * fmt.TEXEL_BYTES[i["format"]]
                                                    for i in images) == local.allocated_bytes
    kernels = json.load(open(os.path.join(bundle, fmt.PLAN)))["kernels"]
    assert [k["name"] for k in native.kernels] == [k["name"] for k in kernels]
    assert all(k["calls"] == steps and k["total_ms"] >= 0 for k in native.kernels)
    assert sum(native.kernel_ms) > 0 and len(native.step_ms) == steps
    return local


@pytest.fixture
def bundle(tmp_path) -> str:
    out = str(tmp_path / "bundle")
    compile_model(elementwise_model(str(tmp_path / "model.onnx")), out, "adreno830", "fp32", OPTIONS)
    return out


def test_elementwise_bundle_trains_as_with_the_python_runtime(bundle, runner_binary, opencl_env) -> None:
    compare_with_local(bundle, [batch(seed=1), batch(seed=2)], 5, runner_binary, opencl_env)


def _classifier_feeds(shape: tuple[int, ...], classes: int, batches: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    return [{"x": rng.standard_normal(shape).astype(np.float32),
             "labels": rng.integers(0, classes, shape[0]).astype(np.int64)} for _ in range(batches)]


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_mlp_trains_as_with_the_python_runtime(tmp_path, runner_binary, opencl_env, dtype) -> None:
    """fp16 (dynamic loss scaling): the third batch holds an inf, so that step is skipped and the runner,
    like LocalRunner, commits none of its updates (plan.json swaps_if_finite)."""
    path = build_mlp(str(tmp_path / "mlp.onnx"), batch=8, in_features=12, hidden=(16, 16), classes=5)
    compile_model(path, str(tmp_path / "mlp"), "adreno830", dtype, CROSS_ENTROPY)
    feeds = _classifier_feeds((8, 12), 5, 3 if dtype == "fp16" else 2)
    if dtype == "fp16":
        feeds[2]["x"][0, 0] = np.inf  # its gradients are NaN
    local = compare_with_local(str(tmp_path / "mlp"), feeds, 3, runner_binary, opencl_env)
    assert local.metrics.get("skipped") == (1.0 if dtype == "fp16" else None), local.metrics


def test_fura_s_es_bundle_trains_as_with_the_python_runtime_and_reports_its_reward(tmp_path, runner_binary,
                                                                                  opencl_env) -> None:
    """Forward-only training (--trainer es --adapter fura-s): the runner makes the same Philox noise on the
    device, so its losses and delta equal LocalRunner's, and each step's line carries the bundle's metric."""
    import dataclasses

    from fblc.compiler.adapters import AdapterConfig
    from fblc.compiler.es import EsConfig

    path = build_mlp(str(tmp_path / "mlp.onnx"), batch=8, in_features=16, hidden=(16,), classes=5)
    options = dataclasses.replace(CROSS_ENTROPY, adapter=AdapterConfig(kind="fura-s", block=8), trainer="es",
                                  es=EsConfig(pairs=2, seed=3), optimizer=OptimizerConfig("sgd", lr=1.0))
    compile_model(path, str(tmp_path / "es"), "adreno830", "fp32", options)
    feeds = _classifier_feeds((8, 16), 5, 1)
    compare_with_local(str(tmp_path / "es"), feeds, 3, runner_binary, opencl_env)
    data = str(tmp_path / "data.bin")
    manifest, plan = fmt.load_verified(str(tmp_path / "es"))
    write_data(data, manifest, plan, feeds)
    os.makedirs(tmp_path / "out")
    done = run(runner_binary, str(tmp_path / "es"), data, str(tmp_path / "out"), 2, opencl_env)
    lines = [json.loads(line) for line in done.stdout.splitlines() if '"step"' in line]
    assert [sorted(line) for line in lines] == [["loss", "ms", "reward_mean", "step"]] * 2
    # each step's member rewards come back in outputs.bin (what a fleet client sends instead of its delta)
    local = LocalRunner(str(tmp_path / "es"), storage="image", progress=False)
    for step, outputs in enumerate(read_results(str(tmp_path / "out"), plan).outputs):
        local.step(feeds[0])
        np.testing.assert_allclose(outputs["rewards"], local.read_before_swap("rewards"), rtol=1e-6, err_msg=step)
    assert step == 1
    # the members are one forward the plan's loop repeats: a loop past the last launch is refused by both runtimes
    plan["loops"][0]["end"] = len(plan["kernels"]) + 1
    with open(tmp_path / "es" / fmt.PLAN, "w") as handle:
        json.dump(plan, handle)
    manifest["checksums"][fmt.PLAN] = fmt.sha256_of(str(tmp_path / "es" / fmt.PLAN))
    with open(tmp_path / "es" / fmt.MANIFEST, "wb") as handle:
        handle.write(fmt.sealed_manifest({k: v for k, v in manifest.items() if k != fmt.MANIFEST_DIGEST}))
    refused = run(runner_binary, str(tmp_path / "es"), data, str(tmp_path / "out"), 1, opencl_env, check=False)
    assert refused.returncode == 2 and "a loop of plan.json is not a range of launches" in refused.stderr
    with pytest.raises(fmt.BundleError, match="a loop of plan.json is not a range of launches"):
        LocalRunner(str(tmp_path / "es"), progress=False)
    external = dataclasses.replace(options, es=EsConfig(pairs=2, reward="external"))
    compile_model(path, str(tmp_path / "external"), "adreno830", "fp32", external)
    refused = run(runner_binary, str(tmp_path / "external"), data, str(tmp_path / "out"), 1, opencl_env, check=False)
    assert refused.returncode == 2 and "takes its ES rewards from the application" in refused.stderr


def test_tiled_parameters_train_and_read_back_as_with_the_python_runtime(tmp_path, runner_binary, opencl_env) -> None:
    """Under the traced search, weights and Adam moments may take R-Tile layouts: the runner uploads
    params.bin as written and reads each parameter back through texel_xy, element for element as
    LocalRunner unpacks it."""
    import dataclasses

    from fblc.tools.traced_layouts import with_traced_reads

    path = build_mlp(str(tmp_path / "mlp.onnx"), batch=8, in_features=64, hidden=(64,), classes=8)
    feeds = _classifier_feeds((8, 64), 8, 2)
    options = with_traced_reads(path, "adreno830", "fp32", dataclasses.replace(CROSS_ENTROPY, layout_search="traced"),
                                feeds[0])
    compile_model(path, str(tmp_path / "mlp"), "adreno830", "fp32", options)
    with open(os.path.join(tmp_path, "mlp", fmt.PLAN), encoding="utf-8") as handle:
        textures = json.load(handle)["textures"]
    with open(os.path.join(tmp_path, "mlp", fmt.MANIFEST), encoding="utf-8") as handle:
        parameters = {p["texture"] for p in json.load(handle)["parameters"]}
    assert any(t["id"] in parameters and t.get("layout", {}).get("kind") == "rtile" for t in textures)
    compare_with_local(str(tmp_path / "mlp"), feeds, 3, runner_binary, opencl_env)


@pytest.mark.slow  # CI: the MemFLoRA T-ResNet below trains the same blocks on the runner
def test_tresnet_batch_4_trains_as_with_the_python_runtime(tmp_path, runner_binary, opencl_env) -> None:
    # T-ResNet's blocks (64 -> 128 -> 128 maps, convs 8/5/3, BN, shortcuts) at batch 4, on a short
    # 6-channel window so that PoCL's kernel compile and two steps take seconds
    path = build_tresnet(str(tmp_path / "tresnet.onnx"), batch=4, channels=6, samples=16, classes=17)
    compile_model(path, str(tmp_path / "tresnet"), "adreno830", "fp32", CROSS_ENTROPY)
    compare_with_local(str(tmp_path / "tresnet"), _classifier_feeds((4, 6, 16, 1), 17, 1), 2, runner_binary,
                       opencl_env)


def test_memflora_tresnet_allocates_its_saved_masks_as_r_mask8_and_trains_as_with_the_python_runtime(
        tmp_path, runner_binary, opencl_env) -> None:
    """MemFLoRA saves a one-bit mask per activation: the runner allocates those r_mask8 images (a byte
    per 8 elements) exactly as LocalRunner and the plan do, and its steps, whose adapter gradients
    go through the masks, equal LocalRunner's, whose first step equals onnxruntime's (every output of the
    step: this is the suite's MemFLoRA T-ResNet on PoCL against onnxruntime; test_device_models' step of
    the full-size export is under `-m slow`)."""
    from fblc.compiler.adapters import AdapterConfig
    from fblc.tools.verify import verify_model

    path = build_tresnet(str(tmp_path / "tresnet.onnx"), batch=4, channels=6, samples=16, classes=5)
    options = TrainingOptions(loss="cross_entropy", optimizer=OptimizerConfig("adam", lr=1e-3),
                              adapter=AdapterConfig("memflora", rank=2))
    feeds = _classifier_feeds((4, 6, 16, 1), 5, 1)
    rows = verify_model(path, options, "adreno830", "fp32", feeds=feeds[0], keep_bundle=str(tmp_path / "tresnet"))
    assert "loss" in {r.name for r in rows} and any(r.name.endswith(".grad") for r in rows)
    assert all(r.ok for r in rows), [r for r in rows if not r.ok][:5]
    with open(os.path.join(tmp_path, "tresnet", fmt.PLAN), encoding="utf-8") as handle:
        textures = json.load(handle)["textures"]
    masks = [t for t in textures if t["format"] == "r_mask8"]
    assert masks and all(t["width"] * t["height"] == -(-int(np.prod(t["shape"])) // 8) for t in masks)
    compare_with_local(str(tmp_path / "tresnet"), feeds, 2, runner_binary, opencl_env)


def test_program_binary_is_cached_next_to_the_bundle(tmp_path, bundle, runner_binary, opencl_env) -> None:
    feeds = [batch(seed=3)]
    first = run_runner(runner_binary, bundle, feeds, 2, env=opencl_env)
    cache = os.path.join(bundle, "kernels.cache")
    assert not first.program["from_cache"] and os.path.isfile(cache)
    assert first.kernel_ms is None and not first.kernels  # no profiling queue unless --kernel-times
    second = run_runner(runner_binary, bundle, feeds, 2, env=opencl_env)
    assert second.program["from_cache"] and second.losses == first.losses
    with open(cache, "r+b") as handle:  # a damaged cache is rebuilt, never trusted
        handle.seek(40)
        handle.write(b"garbage!")
    third = run_runner(runner_binary, bundle, feeds, 2, env=opencl_env)
    assert not third.program["from_cache"] and third.losses == first.losses
    assert run_runner(runner_binary, bundle, feeds, 2, env=opencl_env).program["from_cache"]
    fmt.load_verified(bundle)  # the cache file does not disturb the bundle's checks


def _rewrite(path: str, edit) -> None:
    with open(path, "rb") as handle:
        data = handle.read()
    with open(path, "wb") as handle:
        handle.write(edit(data))


def _data(tmp_path, bundle: str, feeds: list[dict[str, np.ndarray]]) -> str:
    manifest, plan = fmt.load_verified(bundle)
    path = str(tmp_path / "data.bin")
    write_data(path, manifest, plan, feeds)
    return path


def test_the_runner_checks_format_version_and_checksums_like_the_python_side(tmp_path, bundle, runner_binary,
                                                                             opencl_env) -> None:
    source = open(os.path.join(NATIVE_DIR, "src", "bundle.h")).read()
    assert re.search(r'#define FBLC_FORMAT_NAME "([^"]+)"', source).group(1) == fmt.FORMAT_NAME
    assert int(re.search(r"#define FBLC_FORMAT_VERSION (\d+)", source).group(1)) == fmt.FORMAT_VERSION
    data, out = _data(tmp_path, bundle, [batch()]), str(tmp_path / "out")
    os.makedirs(out)
    _rewrite(os.path.join(bundle, fmt.PARAMS), lambda d: d[:-4] + b"\x01\x02\x03\x04")
    done = run(runner_binary, bundle, data, out, 1, opencl_env, check=False)
    assert done.returncode == 2 and "params.bin' does not match the checksum in manifest.json" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and os.listdir(out) == []
    manifest = json.load(open(os.path.join(bundle, fmt.MANIFEST)))
    manifest["format_version"] = 99
    json.dump(manifest, open(os.path.join(bundle, fmt.MANIFEST), "w"))
    done = run(runner_binary, bundle, data, out, 1, opencl_env, check=False)
    assert done.returncode == 2 and f"version 99; this runner reads fblc-bundle version {fmt.FORMAT_VERSION}" in done.stderr
    done = run(runner_binary, str(tmp_path / "nowhere"), data, out, 1, opencl_env, check=False)
    assert done.returncode == 2 and "manifest.json is missing" in done.stderr


def test_a_kernel_that_fails_to_build_is_named_with_the_compiler_log(tmp_path, bundle, runner_binary,
                                                                      opencl_env) -> None:
    plan = json.load(open(os.path.join(bundle, fmt.PLAN)))
    victim = plan["kernels"][2]["name"]
    _rewrite(os.path.join(bundle, fmt.KERNELS), lambda d: d.replace(f"void {victim}(".encode(),
                                                                      f"void {victim}(undeclared_type z, ".encode()))
    rechecksum(bundle, fmt.KERNELS)
    with pytest.raises(RunnerError) as error:
        run_runner(runner_binary, bundle, [batch()], 1, env=opencl_env)
    assert f"rejected kernel '{victim}' (kernels.cl line" in str(error.value) and "undeclared_type" in str(error.value)


def test_data_for_another_bundle_and_a_missing_library_are_refused(tmp_path, bundle, runner_binary,
                                                                   opencl_env) -> None:
    other = str(tmp_path / "other")
    compile_model(elementwise_model(str(tmp_path / "m4.onnx"), rows=4), other, "adreno830", "fp32", OPTIONS)
    data, out = _data(tmp_path, other, [batch(rows=4)]), str(tmp_path / "out")
    os.makedirs(out)
    done = run(runner_binary, bundle, data, out, 1, opencl_env, check=False)
    assert done.returncode == 2 and "has 80 bytes per batch of 'x', the bundle takes 60" in done.stderr
    _rewrite(data, lambda d: d[:-3])
    done = run(runner_binary, other, data, out, 1, opencl_env, check=False)
    assert done.returncode == 2 and "is truncated" in done.stderr
    done = run(runner_binary, bundle, _data(tmp_path, bundle, [batch()]), out, 1,
               {**opencl_env, "FBLC_OPENCL_LIBRARY": "/nonexistent/libOpenCL.so"}, check=False)
    assert done.returncode == 3 and "cannot open FBLC_OPENCL_LIBRARY=/nonexistent/libOpenCL.so" in done.stderr
    assert os.listdir(out) == []


def test_a_params_file_starts_the_run_from_its_values(tmp_path, bundle, runner_binary, opencl_env) -> None:
    """--params: a params.bin of the bundle's layout with other values (a fleet round's global model,
    fblc.fleet.bundle_params) is where training starts; the bundle and its checksums stay as they are."""
    from fblc.fleet.bundle_params import params_bin
    from fblc.fleet.trainers import initial_parameters

    start = {name: value + 0.5 for name, value in initial_parameters(bundle).items()}
    params, data = str(tmp_path / "params.in"), _data(tmp_path, bundle, [batch(seed=3)])
    with open(params, "wb") as handle:
        handle.write(params_bin(bundle, start))
    local = LocalRunner(bundle, storage="image")
    for entry in local.manifest["parameters"]:
        local.upload(entry["texture"], start[entry["name"]])
    expected = [local.step(batch(seed=3)) for _ in range(2)]
    out = str(tmp_path / "out")
    os.makedirs(out)
    run(runner_binary, bundle, data, out, 2, opencl_env, "--params", params, "--no-cache")
    native = read_results(out)
    np.testing.assert_allclose(native.losses, expected, rtol=1e-5)
    for name, value in local.parameters().items():
        np.testing.assert_allclose(native.parameters[name], value, rtol=1e-5, atol=1e-7, err_msg=name)
    with open(params, "ab") as handle:
        handle.write(b"\0" * 4)
    shutil.rmtree(out)
    os.makedirs(out)
    done = run(runner_binary, bundle, data, out, 1, opencl_env, "--params", params, check=False)
    size = os.path.getsize(os.path.join(bundle, fmt.PARAMS))
    assert done.returncode == 2 and f"holds {size + 4} bytes, the bundle's params.bin {size}" in done.stderr
    assert os.listdir(out) == []


def test_ctrl_c_leaves_no_results(tmp_path, bundle, runner_binary, opencl_env) -> None:
    data, out = _data(tmp_path, bundle, [batch()]), str(tmp_path / "out")
    os.makedirs(out)
    process = subprocess.Popen([runner_binary, bundle, "--data", data, "--steps", "100000000", "--out", out],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, **opencl_env})
    assert process.stdout is not None
    assert "device" in json.loads(process.stdout.readline())
    assert json.loads(process.stdout.readline())["step"] == 1
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130 and "interrupted" in stderr
    assert os.listdir(out) == []


def test_devices_and_version(runner_binary, opencl_env) -> None:
    done = subprocess.run([runner_binary, "--devices"], capture_output=True, text=True,
                          env={**os.environ, **opencl_env})
    devices = [json.loads(line) for line in done.stdout.splitlines()]
    assert done.returncode == 0 and devices and devices[0]["id"] == "0:0" and devices[0]["images"] is True
    version = subprocess.run([runner_binary, "--version"], capture_output=True, text=True).stdout
    assert f"bundle format {fmt.FORMAT_NAME} {fmt.FORMAT_VERSION}" in version
    assert binary_kind(runner_binary).system == "linux"


def test_results_are_read_back_from_the_runner_files(tmp_path, bundle, runner_binary, opencl_env) -> None:
    data, out = _data(tmp_path, bundle, [batch(seed=4), batch(seed=5)]), str(tmp_path / "out")
    os.makedirs(out)
    done = run(runner_binary, bundle, data, out, 3, opencl_env)
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line.get("step") for line in lines] == [None, 1, 2, 3]
    assert sorted(os.listdir(out)) == ["params.bin", "results.json"]
    results = read_results(out)
    assert results.losses == [line["loss"] for line in lines[1:]]
    assert results.device["name"] and results.raw["steps"] == 3 and results.bytes_allocated["host_staging"] > 0


def check_measured_profile(path: str) -> dict:
    """A profile that `fblc profile` measured: it loads, its measured figures say so, its pattern table holds
    the four patterns at positive rates, and its geometry is one a cache can have. Returns its document."""
    profile = load_profile(path)
    for figure in ("tex_block_width", "tex_block_height", "l1_bytes", "bandwidth_gbps", "peak_gflops", "wave_size",
                   "image2d_max_width", "max_work_group_size", "l2_bytes", "cpu", "simd_floats", "subgroups"):
        assert profile.sources[figure].startswith("measured"), (figure, profile.sources[figure])
    rates = profile.raw["measurements"]["pattern_reads_per_second"]
    assert set(rates) == set(PATTERNS) and all(rates[p] and all(v > 0 for v in rates[p].values()) for p in PATTERNS)
    relative = profile.raw["measurements"]["relative_to_column_major"]
    assert all(abs(v - 1) < 1e-12 for v in relative["column-major"].values())
    assert profile.tex_block_width in (1, 2, 4, 8, 16) and profile.tex_block_height in (1, 2, 4, 8, 16)
    assert profile.line_bytes == profile.tex_block_width * 16
    assert profile.block_bytes <= profile.l1_bytes <= profile.l2_bytes
    assert profile.bandwidth_gbps > 0 and profile.peak_gflops > 0
    assert 1 <= profile.wave_size <= profile.max_work_group_size
    assert profile.image2d_max_width >= 2048 and profile.image2d_max_height >= 2048
    return profile.raw


def test_profile_mode_measures_the_same_device_as_the_local_profiler(tmp_path, runner_binary, opencl_env,
                                                                    capsys, small_profile_plan) -> None:
    """`fblc profile --device native`: the runner times the plan on PoCL, fblc interprets it as a local run;
    what clGetDeviceInfo says matches pyopencl's view of the same device."""
    import pyopencl as cl

    from fblc.runtime.opencl import select_device

    out = str(tmp_path / "native.json")
    assert main(["profile", "--device", "native", "--runner", runner_binary, "-o", out]) == 0
    printed = capsys.readouterr().out
    assert "(benchmarks built in" in printed and "bandwidth and flops" in printed and "launches" in printed
    document = check_measured_profile(out)
    assert document["measurements"]["backend"].startswith("fblc-runner ")
    device = select_device(None)
    figures = {name: entry["value"] for name, entry in document["figures"].items()}
    assert document["gpu"] == device.name.strip() and document["opencl_version"] == device.version.strip()
    assert figures["max_work_group_size"] == device.max_work_group_size
    # The pip PoCL's image limit is not one constant: processes on one machine have seen 8192 and 16384
    # (fblc places every texture within PORTABLE_IMAGE_EDGE for that reason), so only the floor is compared.
    assert min(figures["image2d_max_width"], figures["image2d_max_height"], device.image2d_max_width,
               device.image2d_max_height) >= PORTABLE_IMAGE_EDGE
    assert figures["l2_bytes"] >= device.global_mem_cache_size
    kernel = cl.Kernel(cl.Program(cl.Context([device]), measurement_plan()["source"]).build(), "pattern_read")
    assert figures["wave_size"] == min(device.max_work_group_size, kernel.get_work_group_info(
        cl.kernel_work_group_info.PREFERRED_WORK_GROUP_SIZE_MULTIPLE, device))


def test_a_plan_whose_kernel_does_not_build_is_named_and_nothing_is_written(tmp_path, runner_binary,
                                                                            opencl_env) -> None:
    plan = measurement_plan()
    plan["source"] = plan["source"].replace("__kernel void footprint_read(", "__kernel void footprint_read(oops ")
    with pytest.raises(RunnerError) as error:
        profile_with_runner(runner_binary, plan, env=opencl_env)
    message = str(error.value)
    assert message.startswith("the OpenCL compiler of ") and "rejected the benchmark kernel 'footprint_read' (line " \
        in message.splitlines()[0] and "oops" in message
    path, out = str(tmp_path / "plan.json"), tmp_path / "out"
    out.mkdir()
    json.dump(plan, open(path, "w"))
    done = subprocess.run([runner_binary, "--profile", path, "--out", str(out / "results.json")], capture_output=True,
                          text=True, env={**os.environ, **opencl_env})
    assert done.returncode == 2 and "rejected the benchmark kernel 'footprint_read'" in done.stderr
    assert os.listdir(out) == []  # no results, no partial file
    json.dump({"format": "fblc-profile-plan", "version": 7}, open(path, "w"))
    done = subprocess.run([runner_binary, "--profile", path, "--out", str(out / "results.json")], capture_output=True,
                          text=True, env={**os.environ, **opencl_env})
    assert done.returncode == 2 and "is not an fblc-profile-plan of version 1" in done.stderr
    assert "write it again with 'fblc profile'" in done.stderr and os.listdir(out) == []


def test_aarch64_cross_build(tmp_path) -> None:
    require(shutil.which("aarch64-linux-gnu-gcc") is not None, "aarch64-linux-gnu-gcc (apt-get install "
                                                               "gcc-aarch64-linux-gnu)")
    require(shutil.which("cmake") is not None, "cmake")
    binary = build_runner(str(tmp_path / "aarch64"), toolchain=AARCH64_TOOLCHAIN)
    kind = binary_kind(binary)
    assert (kind.machine, kind.system) == ("aarch64", "linux")


def test_sizes_that_overflow_and_work_groups_the_device_cannot_run_are_refused(tmp_path, bundle, runner_binary,
                                                                               opencl_env) -> None:
    """Sizes from plan.json are multiplied with overflow checks, and every texture must fit the plan image
    it is bound to; the plan's work-group size is the one launched (a group beyond the device fails naming the kernel, and nothing is written)."""
    data, out = _data(tmp_path, bundle, [batch()]), str(tmp_path / "out")
    os.makedirs(out)
    original = open(os.path.join(bundle, fmt.PLAN)).read()

    def huge_shape(plan: dict) -> None:
        plan["textures"][0]["shape"] = [2**40, 2**40]

    edit_plan(bundle, huge_shape)
    done = run(runner_binary, bundle, data, out, 1, opencl_env, check=False)
    assert done.returncode == 2 and "more elements than a size holds" in done.stderr, done.stderr
    open(os.path.join(bundle, fmt.PLAN), "w").write(original)

    def image_too_narrow(plan: dict) -> None:  # the runner allocates plan.json's images as they are
        plan["images"][plan["textures"][0]["image"]]["width"] = plan["textures"][0]["width"] + 1

    edit_plan(bundle, image_too_narrow)
    done = run(runner_binary, bundle, data, out, 1, opencl_env, check=False)
    assert done.returncode == 2 and "does not fit its image" in done.stderr, done.stderr
    open(os.path.join(bundle, fmt.PLAN), "w").write(original)

    def huge_groups(plan: dict) -> None:
        for launch in plan["kernels"]:
            launch["local_size"], launch["global_size"] = [1 << 20], [1 << 20]

    edit_plan(bundle, huge_groups)
    done = run(runner_binary, bundle, data, out, 1, opencl_env, check=False)
    first = json.load(open(os.path.join(bundle, fmt.PLAN)))["kernels"][0]["name"]
    assert done.returncode != 0 and f"launching kernel '{first}' failed" in done.stderr, done.stderr
    assert "work-groups of 1048576" in done.stderr and os.listdir(out) == []
