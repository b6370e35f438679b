"""The native runner (`fblc-runner`, C99 in this folder) seen from Python: build it, write its data
file, read its results, and run it here.

The runner reads a bundle exactly as `LocalRunner` does and knows nothing about ONNX. It takes its
batches from a data file that fblc writes from the `.npz` of `fblc run` (`write_data`), and leaves
`results.json` (losses, step times, per-kernel device times, bytes allocated) and `params.bin` (the
trained parameters, float32) in an output folder (`read_results`); a forward bundle's run (--trainer none)
also leaves `outputs.bin`, each step's model outputs, which `read_results` decodes as LocalRunner.read does.
`fblc push` / `fblc run --device adb:S` run the same binary on a phone (fblc/runtime/adb.py). Its `--profile`
mode times the launches of a measurement plan from `fblc profile` (fblc/profiles/profiler.py) and writes their
raw timings:
`profile_with_runner` runs it here, `fblc profile --device adb:S` on a phone (fblc/runtime/adb_profile.py).
"""

from __future__ import annotations

import glob
import json
import os
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from fblc import bundle_format as fmt
from fblc.bundle_format import BundleError
from fblc.runtime import specialist as specialists

NATIVE_DIR = os.path.dirname(os.path.abspath(__file__))
RUNNER_NAME = "fblc-runner"
DATA_MAGIC = b"FBLCDAT1"
RESULTS, PARAMS_OUT, OUTPUTS_OUT = "results.json", "params.bin", "outputs.bin"
# Where the README's build commands put the runner; `fblc push` looks here when no --runner is given.
HOST_BUILD = os.path.join(NATIVE_DIR, "build", "host")
ANDROID_BUILD = os.path.join(NATIVE_DIR, "build", "android-arm64")
AARCH64_TOOLCHAIN = os.path.join(NATIVE_DIR, "cmake", "aarch64-linux-gnu.cmake")


class RunnerError(BundleError):
    """The native runner could not be built, found or run; the message says why and what to do."""


# --- building ------------------------------------------------------------------------------------------
def build_runner(build_dir: str = HOST_BUILD, toolchain: str | None = None,
                 cmake_args: Sequence[str] = ()) -> str:
    """Configure and build the runner with CMake into `build_dir`; returns the binary's path."""
    cmake = shutil.which("cmake")
    if cmake is None:
        raise RunnerError("cmake not found; install it (apt-get install cmake, or pip install cmake) to build the "
                          "native runner")
    configure = [cmake, "-S", NATIVE_DIR, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release", *cmake_args]
    if toolchain:
        configure.append(f"-DCMAKE_TOOLCHAIN_FILE={toolchain}")
    for command in (configure, [cmake, "--build", build_dir, "--parallel", str(os.cpu_count() or 2)]):
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if done.returncode != 0:
            raise RunnerError(f"building the native runner failed ({' '.join(command[:2])} ...):\n"
                              f"{done.stdout.strip()[-3000:]}")
    binary = os.path.join(build_dir, RUNNER_NAME)
    if not os.path.isfile(binary):
        raise RunnerError(f"the build in {build_dir} produced no {RUNNER_NAME}")
    return binary


def build_command(build_dir: str = HOST_BUILD) -> str:
    """The shell command that builds the runner into `build_dir` (build_runner's, as a user pastes it): absolute
    paths, so that it works from any folder."""
    source, build = shlex.quote(NATIVE_DIR), shlex.quote(os.path.abspath(build_dir))
    return f"cmake -S {source} -B {build} && cmake --build {build}"


# --- ELF: what a runner binary runs on ------------------------------------------------------------------
ELF_MACHINES = {3: "x86", 40: "arm", 62: "x86_64", 183: "aarch64", 243: "riscv64"}
UNAME_MACHINES = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64",
                  "armv7l": "arm", "armv8l": "arm", "i686": "x86", "i386": "x86", "riscv64": "riscv64"}


@dataclass(frozen=True)
class BinaryKind:
    machine: str          # x86_64, aarch64, ...
    system: str           # "android" (bionic's linker), "linux" (another interpreter) or "static"

    def __str__(self) -> str:
        return f"{self.system} {self.machine}" if self.system != "static" else f"static {self.machine}"


def binary_kind(path: str) -> BinaryKind:
    """Machine and C library of an ELF executable (from its header and PT_INTERP)."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(1 << 16)
    except OSError as error:
        raise RunnerError(f"cannot read the runner '{path}' ({error.strerror})") from None
    if data[:4] != b"\x7fELF" or len(data) < 64:
        raise RunnerError(f"'{path}' is not an executable (no ELF header); build the runner (see the README)")
    wide, little = data[4] == 2, data[5] == 1
    order = "<" if little else ">"
    machine = struct.unpack_from(order + "H", data, 18)[0]
    if wide:
        phoff, = struct.unpack_from(order + "Q", data, 32)
        phentsize, phnum = struct.unpack_from(order + "HH", data, 54)
    else:
        phoff, = struct.unpack_from(order + "I", data, 28)
        phentsize, phnum = struct.unpack_from(order + "HH", data, 42)
    system = "static"
    for index in range(phnum):
        at = phoff + index * phentsize
        if at + phentsize > len(data):
            break
        kind = struct.unpack_from(order + "I", data, at)[0]
        if kind == 3:  # PT_INTERP
            if wide:  # Elf64_Phdr: p_offset at 8, p_filesz at 32
                offset, size = (struct.unpack_from(order + "Q", data, at + k)[0] for k in (8, 32))
            else:  # Elf32_Phdr: p_offset at 4, p_filesz at 16
                offset, size = (struct.unpack_from(order + "I", data, at + k)[0] for k in (4, 16))
            interpreter = data[offset:offset + size].rstrip(b"\0").decode("ascii", "replace")
            system = "android" if interpreter.startswith("/system/bin/linker") else "linux"
    return BinaryKind(ELF_MACHINES.get(machine, f"machine {machine}"), system)


def runner_candidates(explicit: str | None = None) -> list[str]:
    """Runner binaries to consider, best first: --runner, $FBLC_RUNNER, then the README's build folders."""
    if explicit:
        return [explicit]
    if os.environ.get("FBLC_RUNNER"):
        return [os.environ["FBLC_RUNNER"]]
    return [p for p in (os.path.join(ANDROID_BUILD, RUNNER_NAME), os.path.join(HOST_BUILD, RUNNER_NAME))
            if os.path.isfile(p)]


# --- the data file --------------------------------------------------------------------------------------
def texture_dtype(plan: Mapping[str, Any], texture_id: int) -> np.dtype:
    return np.dtype(fmt.NUMPY_DTYPES[plan["textures"][texture_id]["format"]])


def write_data(path: str, manifest: Mapping[str, Any], plan: Mapping[str, Any],
               batches: Sequence[Mapping[str, np.ndarray]]) -> int:
    """Write `batches` (feeds by input name) as the runner's data file; returns its size in bytes.

    Each input becomes its texture's element type exactly as LocalRunner.upload converts it (int64
    labels to int32, floats to float32 or float16), flat and unpadded."""
    inputs = manifest["inputs"]
    sizes = [int(np.prod(e["shape"], dtype=np.int64)) * texture_dtype(plan, e["texture"]).itemsize for e in inputs]
    with open(path, "wb") as handle:
        handle.write(DATA_MAGIC + struct.pack("<II", len(batches), len(inputs)))
        handle.write(struct.pack(f"<{len(inputs)}I", *sizes))
        for feeds in batches:
            for entry, size in zip(inputs, sizes):
                array = np.asarray(feeds[entry["name"]])
                if list(array.shape) != list(entry["shape"]):
                    raise BundleError(f"'{entry['name']}' has shape {list(array.shape)}; the bundle expects "
                                      f"{entry['shape']}")
                flat = np.ascontiguousarray(array.reshape(-1).astype(texture_dtype(plan, entry["texture"])))
                assert flat.nbytes == size
                handle.write(flat.tobytes())
        return handle.tell()


# --- results --------------------------------------------------------------------------------------------
@dataclass
class RunnerResults:
    """What the runner reports after a run."""

    losses: list[float]
    step_ms: list[float]
    kernel_ms: list[float] | None         # device time of all kernels, per step (None: run without kernel_times)
    submit_ms: list[float]                # host time of the uploads and launches, per step
    kernels: list[dict[str, Any]]         # per launch: name, function, calls, total_ms, mean_ms, min_ms (if timed)
    bytes_allocated: dict[str, int]
    device: dict[str, str]
    program: dict[str, Any]
    parameters: dict[str, np.ndarray] = field(repr=False)
    raw: dict[str, Any] = field(repr=False)
    #: a forward bundle's model outputs by name, one dict per step (batch); empty for a training bundle
    outputs: list[dict[str, np.ndarray]] = field(default_factory=list, repr=False)


def read_results(folder: str, plan: Mapping[str, Any] | None = None) -> RunnerResults:
    """The runner's results.json and params.bin in `folder`, parameters as float32 arrays by ONNX name; a forward
    bundle's outputs.bin too, decoded with its `plan` (plan.json)."""
    try:
        with open(os.path.join(folder, RESULTS), encoding="utf-8") as handle:
            raw = json.load(handle)
        blob = np.fromfile(os.path.join(folder, raw.get("params_file", PARAMS_OUT)), dtype="<f4")
    except (OSError, ValueError) as error:
        raise RunnerError(f"the runner's results in {folder} are unreadable ({error})") from None
    parameters = {}
    for entry in raw["parameters"]:
        start, count = entry["offset"] // 4, entry["nbytes"] // 4
        parameters[entry["name"]] = blob[start:start + count].reshape(entry["shape"]).copy()
    outputs = _read_outputs(folder, raw, plan) if "outputs" in raw else []
    return RunnerResults(raw["losses"], raw["step_ms"], raw.get("kernel_ms"), raw["submit_ms"], raw["kernels"],
                         raw["bytes_allocated"], raw["device"], raw["program"], parameters, raw, outputs)


def _read_outputs(folder: str, raw: Mapping[str, Any], plan: Mapping[str, Any] | None) -> list[dict[str, np.ndarray]]:
    """outputs.bin: per step, each output's texture elements (float32, or int32 for an integer texture), viewed
    as its value with plan.json's value_maps / value_shapes (fmt.value_of, as LocalRunner.read); integers as
    int64 and floats as float32, as LocalRunner.read gives them."""
    if plan is None:
        raise RunnerError(f"the runner's outputs in {folder} need the bundle's plan.json to decode")
    path = os.path.join(folder, raw["outputs_file"])
    try:
        blob = np.fromfile(path, dtype=np.uint8)
    except OSError as error:
        raise RunnerError(f"the runner's outputs '{path}' are unreadable ({error.strerror})") from None
    step_bytes = raw["step_bytes"]
    if len(blob) != step_bytes * raw["steps"]:
        raise RunnerError(f"the runner's outputs '{path}' hold {len(blob)} bytes, not {raw['steps']} steps of "
                          f"{step_bytes}")
    steps = []
    for step in range(raw["steps"]):
        values = {}
        for entry in raw["outputs"]:
            start = step * step_bytes + entry["offset"]
            integer = entry["dtype"] == "int32"
            elements = blob[start:start + 4 * entry["elements"]].view("<i4" if integer else "<f4")
            elements = elements.astype(np.int64 if integer else np.float32).reshape(
                plan["textures"][entry["texture"]]["shape"])
            values[entry["name"]] = fmt.value_of(dict(plan), entry["name"], elements)
        steps.append(values)
    return steps


# --- running here ---------------------------------------------------------------------------------------
#: where the ICD loader looks for drivers when OCL_ICD_VENDORS is unset
SYSTEM_VENDORS = "/etc/OpenCL/vendors"


def pocl_wheel_environment(state_dir: str | None = None) -> dict[str, str]:
    """Environment that makes the runner's libOpenCL.so.1 (the ICD loader, Debian: ocl-icd-libopencl1) see
    the device LocalRunner uses here when that is the PoCL of the pyopencl / pocl-binary-distribution wheels.

    pyopencl lists the loader's drivers (OCL_ICD_VENDORS, else SYSTEM_VENDORS) before its wheel's PoCL, and
    the runner sees the loader's drivers alone. So where the loader has drivers, both runtimes already
    start from the same list and this returns {}; likewise when the caller chose (FBLC_OPENCL_LIBRARY set)
    or no wheel PoCL exists. Otherwise it writes an ICD vendors folder with one .icd file naming the
    wheel's libpocl and returns {"OCL_ICD_VENDORS": folder}."""
    vendors = os.environ.get("OCL_ICD_VENDORS") or SYSTEM_VENDORS
    if os.environ.get("FBLC_OPENCL_LIBRARY") or glob.glob(os.path.join(vendors, "*.icd")):
        return {}
    found = []
    for module in ("pyopencl", "pocl_binary_distribution"):
        try:
            package = __import__(module)
        except ImportError:
            continue
        found += sorted(glob.glob(os.path.join(os.path.dirname(package.__file__), ".libs", "libpocl*.so*")))
    if not found:
        return {}
    folder = state_dir or os.path.join(tempfile.gettempdir(), f"fblc-icd-{os.getuid()}")
    os.makedirs(folder, exist_ok=True)
    icd = os.path.join(folder, "pocl-wheel.icd")
    if not os.path.isfile(icd) or open(icd, encoding="utf-8").read().strip() != found[0]:
        temporary = f"{icd}.{os.getpid()}"
        with open(temporary, "w", encoding="utf-8") as handle:
            handle.write(found[0] + "\n")
        os.replace(temporary, icd)
    return {"OCL_ICD_VENDORS": folder}


def pyopencl_build_options() -> dict[str, str]:
    """{"FBLC_CL_BUILD_OPTIONS": ...}: the options pyopencl adds to LocalRunner's build (its include path, which
    changes no kernel: fblc's kernels include nothing; then what PYOPENCL_BUILD_OPTIONS forces on every build,
    e.g. the test suite's -cl-opt-disable), so that the runner's clBuildProgram matches LocalRunner's and PoCL's
    kernel cache serves both. {} if unknown."""
    try:
        import pyopencl

        options = list(getattr(pyopencl, "_DEFAULT_BUILD_OPTIONS", [])) + list(
            getattr(pyopencl, "_DEFAULT_INCLUDE_OPTIONS", [])) + os.environ.get("PYOPENCL_BUILD_OPTIONS", "").split()
    except ImportError:
        return {}
    return {"FBLC_CL_BUILD_OPTIONS": " ".join(options)} if options else {}


def run_runner(runner: str, bundle: str, batches: Sequence[Mapping[str, np.ndarray]], steps: int,
               device: str | None = None, cache: bool = True, env: Mapping[str, str] | None = None,
               echo: bool = False, kernel_times: bool = False,
               specialist: Mapping[str, np.ndarray] | None = None) -> RunnerResults:
    """Train `bundle` for `steps` steps with the native runner on this machine; the results (each kernel's
    device time only with `kernel_times`: a profiling queue). `specialist`: adapter tensors by name
    (runtime/specialist.py, checked here) that a forward bundle with adapter sites serves."""
    manifest, plan = fmt.load_verified(bundle)
    with tempfile.TemporaryDirectory(prefix="fblc-native-") as work:
        data = os.path.join(work, "data.bin")
        write_data(data, manifest, plan, batches)
        command = [runner, bundle, "--data", data, "--steps", str(steps), "--out", work]
        if specialist is not None:
            arrays = specialists.checked(manifest, bundle, specialist, "the specialist")
            specialists.write_native(os.path.join(work, "specialist.bin"), manifest, plan, arrays)
            command += ["--specialist", os.path.join(work, "specialist.bin")]
        if device:
            command += ["--device", device]
        if not cache:
            command.append("--no-cache")
        if kernel_times:
            command.append("--kernel-times")
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, **(env or {})})
        if echo:
            sys.stdout.write(done.stdout)
        if done.returncode != 0:
            message = done.stderr.strip() or f"exit status {done.returncode}"
            raise RunnerError(message.removeprefix("fblc-runner: error: "))
        return read_results(work, plan)


def profile_with_runner(runner: str, plan: Mapping[str, Any], device: str | None = None,
                        env: Mapping[str, str] | None = None,
                        on_line: Callable[[dict[str, Any]], None] = lambda line: None) -> dict[str, Any]:
    """Time `plan` with the runner's --profile mode on this machine (device "P:D", or the first with images);
    the raw results. Each progress line the runner prints goes to `on_line` as it comes, so a caller can show it."""
    with tempfile.TemporaryDirectory(prefix="fblc-profile-") as work:
        plan_path, results_path = os.path.join(work, "plan.json"), os.path.join(work, "results.json")
        with open(plan_path, "w", encoding="utf-8") as handle:
            json.dump(plan, handle)
        command = [runner, "--profile", plan_path, "--out", results_path] + (["--device", device] if device else [])
        with tempfile.TemporaryFile("w+", encoding="utf-8") as errors:  # a file: a long log cannot block the runner
            process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, text=True, bufsize=1,
                                       env={**os.environ, **(env or {})})
            assert process.stdout is not None
            try:
                for line in process.stdout:
                    if line.startswith("{"):
                        on_line(json.loads(line))
                process.wait()
            except BaseException:  # Ctrl-C (which the runner gets too) or a failing on_line: leave no runner behind
                process.terminate()
                process.wait()
                raise
            errors.seek(0)
            message = errors.read().strip()
        if process.returncode != 0:  # the runner's error line and what follows (a compiler log), not a driver's chatter
            at = message.find("fblc-runner: error: ")
            raise RunnerError(message[at + len("fblc-runner: error: "):] if at >= 0
                              else message or f"exit status {process.returncode}")
        try:
            with open(results_path, encoding="utf-8") as handle:
                return json.load(handle)
        except (OSError, ValueError) as error:
            raise RunnerError(f"the runner's profile results are unreadable ({error})") from None
