"""Apache TVM on fblc's training steps: a third numeric reference, and the compiler fblc must beat.

fblc's step is plain ONNX (`fblc train-graph`), so TVM needs no autodiff of its own: its ONNX
importer (`tvm.relax.frontend.onnx`) sees an ordinary graph. `run_on_cpu` builds a step for TVM's
LLVM CPU target and runs it; `build_opencl` builds it with TVM's Adreno texture pipeline (target
`qcom/adreno-opencl-texture`; code generation only: the PyPI wheel has no OpenCL runtime) and
returns the OpenCL source and the bytes its memory plan allocates.

Before TVM sees a step, `prepare` rewrites the nodes that TVM imports wrongly or cannot build into
equivalent primitive ops (tvm_rewrites.REWRITES, keyed by op type, each saying why) and lists every
rewrite; `check_rewrites` has onnxruntime confirm that the rewritten step computes what the original
does. Every TVM build runs in a child process (`python -m fblc.baselines.tvm`), because some of
TVM's failures end the process (a SIGFPE in the Adreno pipeline's ConvertLayout): a build that fails
is bisected to the first node whose prefix of the graph fails (TvmBuildError names it), and a run
that disagrees with onnxruntime to the first node whose output differs (`first_difference`).

Needs the `tvm` extra: pip install -e '.[tvm]'.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx

from fblc.baselines.tvm_rewrites import CPU_TARGET, OPENCL_TARGET, PLAIN_OPENCL_TARGET, AppliedRewrite, prepare
from fblc.errors import FblcError
from fblc.compiler.reference import run_model
from fblc.tools.verify import Comparison, compare

CHILD_TIMEOUT_S = 1800


class TvmBuildError(FblcError):
    """TVM could not import or build a step; the message names the first node that fails."""


@dataclass
class CpuRun:
    outputs: dict[str, np.ndarray]
    rewrites: list[AppliedRewrite]
    step_ms: float  # median over the repeats


@dataclass
class TunedCpuRun(CpuRun):
    """The step on TVM's CPU build with MetaSchedule's schedules (fblc/baselines/tvm_tuning.py)."""
    trials_per_task: int
    tasks: int  # the fused kernels MetaSchedule tuned
    tuning_s: float  # the search's time, when it ran (a cached tuning's too)
    cached: bool  # the records came from an earlier run: this one tuned nothing
    cost_model: str
    target: str
    records: str  # the folder of the tuning records


@dataclass
class OpenclBuild:
    source: str
    build_s: float  # TVM's import and build, timed in its process
    planned_bytes: int  # the memory plan's alloc_storage calls, and the inputs and constants it holds
    target: str
    texture_failure: str | None  # why the texture pipeline could not build it, if it could not


@dataclass
class Difference:
    """The first node, in graph order, whose output TVM computes differently from onnxruntime."""
    node: onnx.NodeProto
    output: Comparison  # verify.compare's row of that output (its name says a differing shape)

    def __str__(self) -> str:
        return (f"first differing node {_describe(self.node)}: '{self.output.name}' differs by up to "
                f"{self.output.max_abs:.3g}")


@dataclass
class StepComparison:
    rows: list[Comparison]
    rewrites: list[AppliedRewrite]
    difference: Difference | None
    step_ms: float  # TVM's CPU step, median over the repeats

    @property
    def ok(self) -> bool:
        return all(row.ok for row in self.rows)


# --- the child process: everything that imports tvm -----------------------------------------------

def _child(argv: list[str]) -> int:
    import tvm
    from tvm import relax
    from tvm.relax.frontend.onnx import from_onnx

    kind, model_path, out = argv[0], argv[1], argv[2]
    started = time.perf_counter()
    module = from_onnx(onnx.load(model_path), keep_params_in_input=False)
    if kind in ("cpu", "cpu-tuned"):
        feeds, repeats = dict(np.load(argv[3])), int(argv[4])
        timing = {}
        if kind == "cpu":
            executable = tvm.compile(module, target=CPU_TARGET)
        else:
            from fblc.baselines.tvm_tuning import tuned_executable

            executable, timing = tuned_executable(module, onnx.load(model_path), argv[5], int(argv[6]))
        machine = relax.VirtualMachine(executable, tvm.cpu())
        arguments = [tvm.runtime.tensor(np.ascontiguousarray(feeds[p.name])) for p in module["main"].params]
        times, result = [], None
        for _ in range(max(1, repeats)):
            begin = time.perf_counter()
            result = machine["main"](*arguments)
            times.append((time.perf_counter() - begin) * 1e3)
        values = [result] if hasattr(result, "numpy") else list(result)  # one output or a tuple
        np.savez(out, **{f"out{i}": np.asarray(v.numpy()) for i, v in enumerate(values)})
        timing["step_ms"] = float(np.median(times))
    else:
        from tvm.relax.backend.adreno import pipeline as adreno

        target = tvm.target.Target(argv[3], host=CPU_TARGET)
        lowered = adreno.get_default_pipeline(target)(module)
        executable = tvm.compile(lowered, target=target, relax_pipeline=None)
        built = time.perf_counter()
        sources = []

        def collect(lib: tvm.runtime.Module) -> None:
            if lib.kind == "opencl":
                sources.append(lib.inspect_source("cl"))
            for imported_lib in lib.imports:
                collect(imported_lib)
        collect(executable.mod)
        with open(out, "w") as handle:
            handle.write("\n".join(sources))
        timing = {"build_s": built - started, "storage_bytes": _storage_bytes(lowered.script())}
    with open(out + ".json", "w") as handle:
        json.dump(timing, handle)
    return 0


_STORAGE = re.compile(r'alloc_storage\(R\.shape\(\[([\d, ]+)\]\), [^,]+, R\.dtype\("(\w+)"\)')


def _storage_bytes(script: str) -> int:
    """Bytes of the storages a lowered module allocates: buffers in bytes, textures in texels of a dtype."""
    return sum(int(np.prod([int(d) for d in dims.split(",")])) * np.dtype(dtype).itemsize
               for dims, dtype in _STORAGE.findall(script))


def _run_child(arguments: list[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run([sys.executable, "-m", "fblc.baselines.tvm", *arguments], capture_output=True,
                              text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(arguments, 124, "", f"timed out after {CHILD_TIMEOUT_S} s")


def _out_path(model_path: str, kind: str) -> str:
    """Where the child writes what it made: the outputs (cpu, .npz) or the OpenCL source (.cl)."""
    return model_path + (".out.npz" if kind.startswith("cpu") else ".out.cl")


def _failure(done: subprocess.CompletedProcess[str]) -> str:
    lines = [line.strip() for line in done.stderr.splitlines() if line.strip() and "Warning" not in line]
    errors = [line for line in lines if "Error" in line.split(":")[0] or "Check failed" in line]
    if done.returncode < 0:
        return f"the TVM process died of signal {-done.returncode}"
    return (errors or lines or [f"exit status {done.returncode}"])[-1]


def _build_in_child(model: onnx.ModelProto, kind: str, scratch: str, extra: list[str],
                    bisect: bool = True) -> tuple[str, dict]:
    path = os.path.join(scratch, f"{kind}.onnx")
    onnx.save(model, path)
    out = _out_path(path, kind)
    done = _run_child([kind, path, out, *extra])
    if done.returncode != 0:
        target = {"cpu": CPU_TARGET, "cpu-tuned": "llvm (host CPU) tuned by MetaSchedule"}.get(kind, extra[0])
        where = first_failing_node(model, kind, scratch, extra) if bisect else "not bisected"
        raise TvmBuildError(f"TVM cannot build the step for {target}: {_failure(done)}; {where}",
                            "the op is TVM's limit, not the model's: add a rewrite to fblc/baselines/tvm_rewrites.py")
    with open(out + ".json") as handle:
        return out, json.load(handle)


def run_on_cpu(step: onnx.ModelProto, feeds: Mapping[str, np.ndarray], repeats: int = 1) -> CpuRun:
    """The step, prepared for TVM's CPU target, imported, built and run `repeats` times."""
    model, rewrites = prepare(step, CPU_TARGET)
    inputs = _data_inputs(model)
    with tempfile.TemporaryDirectory(prefix="fblc-tvm-") as scratch:
        feeds_path = os.path.join(scratch, "feeds.npz")
        np.savez(feeds_path, **{k: v for k, v in feeds.items() if k in inputs})
        out, timing = _build_in_child(model, "cpu", scratch, [feeds_path, str(repeats)])
        with np.load(out) as loaded:
            values = [loaded[f"out{i}"] for i in range(len(loaded.files))]
    names = [o.name for o in model.graph.output]
    return CpuRun(dict(zip(names, values)), rewrites, timing["step_ms"])


def default_tuning_cache() -> str:
    """Where tuning records are kept between runs: $XDG_CACHE_HOME/fblc/tvm-tuning (~/.cache by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fblc", "tvm-tuning")


def run_tuned_on_cpu(step: onnx.ModelProto, feeds: Mapping[str, np.ndarray], trials_per_task: int,
                     repeats: int = 1, cache: str | None = None) -> TunedCpuRun:
    """The step, prepared for TVM's CPU target, tuned by MetaSchedule for the host CPU with
    `trials_per_task` trials per fused kernel (records kept in `cache`, reused by a later run of the
    same step, CPU and budget), built with the best schedules found and run `repeats` times."""
    if trials_per_task < 1:
        raise FblcError(f"a tuning budget of {trials_per_task} trials per task tunes nothing",
                        "give at least 1 (the untuned build is run_on_cpu)")
    model, rewrites = prepare(step, CPU_TARGET)
    inputs = _data_inputs(model)
    with tempfile.TemporaryDirectory(prefix="fblc-tvm-") as scratch:
        feeds_path = os.path.join(scratch, "feeds.npz")
        np.savez(feeds_path, **{k: v for k, v in feeds.items() if k in inputs})
        extra = [feeds_path, str(repeats), os.path.abspath(cache or default_tuning_cache()), str(trials_per_task)]
        try:  # no bisection: each try would be a tuning
            out, timing = _build_in_child(model, "cpu-tuned", scratch, extra, bisect=False)
        except TvmBuildError as error:
            raise TvmBuildError(error.cause + _serialization_check(),
                                "compare with TVM's untuned build (run_on_cpu) instead") from None
        with np.load(out) as loaded:
            values = [loaded[f"out{i}"] for i in range(len(loaded.files))]
    names = [o.name for o in model.graph.output]
    return TunedCpuRun(dict(zip(names, values)), rewrites, timing["step_ms"], timing["trials_per_task"],
                       timing["tasks"], timing["tuning_s"], timing["cached"], timing["cost_model"], timing["target"],
                       timing["records"])


def _serialization_check() -> str:
    """'' where TVM can serialize its IR, else why MetaSchedule died: it saves every task's module as
    JSON, which crashes where apache-tvm-ffi is newer than the apache-tvm build knows (0.1.15 with 0.27)."""
    probe = "import tvm; tvm.ir.save_json(tvm.tirx.IntImm('int32', 1))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600)
    if done.returncode == 0:
        return ""
    from importlib.metadata import version

    return (f" (TVM's IR serialization, which MetaSchedule needs, fails here: {_failure(done)}, with apache-tvm "
            f"{version('apache-tvm')} and apache-tvm-ffi {version('apache-tvm-ffi')}: "
            "pip install 'apache-tvm-ffi<0.1.15')")


def build_opencl(step: onnx.ModelProto, bisect: bool = True) -> OpenclBuild:
    """The step through TVM's Adreno texture pipeline: its OpenCL source, build time and planned bytes.

    Where that pipeline fails, the failure is kept in `texture_failure` (bisected to its first node
    unless `bisect` is False: each try is a build), and TVM's plain Adreno pipeline (buffers, no
    textures) builds the step."""
    model, _ = prepare(step, OPENCL_TARGET)
    with tempfile.TemporaryDirectory(prefix="fblc-tvm-") as scratch:
        try:
            out, timing = _build_in_child(model, "opencl", scratch, [OPENCL_TARGET], bisect)
            target, texture_failure = OPENCL_TARGET, None
        except TvmBuildError as error:
            out, timing = _build_in_child(model, "opencl", scratch, [PLAIN_OPENCL_TARGET], bisect)
            target, texture_failure = PLAIN_OPENCL_TARGET, error.cause
        with open(out) as handle:
            source = handle.read()
    planned = int(timing["storage_bytes"]) + _held_bytes(model)
    return OpenclBuild(source, timing["build_s"], planned, target, texture_failure)


def _data_inputs(model: onnx.ModelProto) -> dict[str, tuple[np.dtype, list[int]]]:
    """The graph inputs without an initializer: their dtype and shape."""
    initialized = {t.name for t in model.graph.initializer}
    return {i.name: (onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type),
                     [d.dim_value for d in i.type.tensor_type.shape.dim])
            for i in model.graph.input if i.name not in initialized}


def _held_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the step's inputs and initializers (parameters, optimizer state, the batch), which TVM
    holds as constants and arguments beside its memory plan."""
    tensors = [(onnx.helper.tensor_dtype_to_np_dtype(t.data_type), list(t.dims)) for t in model.graph.initializer]
    return sum(int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
               for dtype, dims in [*tensors, *_data_inputs(model).values()])


# --- bisection ---------------------------------------------------------------------------------

def _value_types(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    typed = onnx.shape_inference.infer_shapes(model)
    return {v.name: v for v in [*typed.graph.value_info, *typed.graph.output]}


def _with_every_output(model: onnx.ModelProto, count: int | None = None,
                       types: Mapping[str, onnx.ValueInfoProto] | None = None) -> onnx.ModelProto:
    """The first `count` nodes (all by default), every value they make a graph output, typed."""
    types = types if types is not None else _value_types(model)
    prefix = onnx.ModelProto()
    prefix.CopyFrom(model)
    del prefix.graph.node[count if count is not None else len(model.graph.node):]
    del prefix.graph.output[:]
    for node in prefix.graph.node:
        for name in node.output:
            if name and name in types:
                prefix.graph.output.append(types[name])
    return prefix


def first_failing_node(model: onnx.ModelProto, kind: str, scratch: str, extra: list[str]) -> str:
    """'first failing node ...': the shortest prefix of the graph that TVM cannot build, by bisection."""
    if kind == "cpu":
        extra = [os.path.join(scratch, "zeros.npz"), "1"]
        np.savez(extra[0], **{name: np.zeros(dims, dtype) for name, (dtype, dims) in _data_inputs(model).items()})
    types = _value_types(model)

    def builds(count: int) -> bool:
        path = os.path.join(scratch, f"prefix_{count}.onnx")
        onnx.save(_with_every_output(model, count, types), path)
        return _run_child([kind, path, _out_path(path, kind), *extra]).returncode == 0

    low, high = 1, len(model.graph.node)
    while low < high:
        middle = (low + high) // 2
        if builds(middle):
            low = middle + 1
        else:
            high = middle
    return f"first failing node {_describe(model.graph.node[low - 1])}"


def _describe(node: onnx.NodeProto) -> str:
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    return f"'{node.name}' ({node.op_type}, attributes {attributes})"


def first_difference(step: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> Difference | None:
    """Every float value of the step from onnxruntime and from TVM's CPU build, compared in node order."""
    everything = _with_every_output(step)
    expected = run_model(everything, feeds)
    got = run_on_cpu(everything, feeds).outputs
    for node in step.graph.node:
        for name in node.output:
            if name in got and np.issubdtype(expected[name].dtype, np.floating):
                row, = compare({name: got[name]}, {name: expected[name]}, "fp32")
                if not row.ok:
                    return Difference(node, row)
    return None


def compare_step(step: onnx.ModelProto, feeds: Mapping[str, np.ndarray], expected: Mapping[str, np.ndarray],
                 repeats: int = 1) -> StepComparison:
    """TVM's CPU step against `expected` (onnxruntime's, or a device's), every output; bisected if any differs."""
    run = run_on_cpu(step, feeds, repeats)
    rows = compare(run.outputs, {k: v for k, v in expected.items() if k in run.outputs}, "fp32")
    difference = None if all(row.ok for row in rows) else first_difference(step, feeds)
    return StepComparison(rows, run.rewrites, difference, run.step_ms)


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
