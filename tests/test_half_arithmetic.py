"""Half arithmetic under --dtype fp16 (codegen/ir/precision.py): which kernels compute in `real`, that their
accumulators stay float, that a target without cl_khr_fp16 gets none, and that a real OpenCL compiler (clang-15)
builds every kernel of fp16 bundles both ways the preamble defines `real` (half with cl_khr_fp16, float
without, what PoCL and oclgrind run). The numbers of half arithmetic need a device with cl_khr_fp16:
tests/test_mixed_precision.py's 50-step test runs there and skips elsewhere."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from fblc.bundle_format import HALF_BUILD_OPTION
from fblc.codegen import ir as kir
from fblc.codegen.ir.precision import HALF_RUN, arithmetic_counts, computes_in_half, half_arithmetic
from fblc.codegen.render.opencl import BUFFER, render_kernel
from fblc.codegen.render.source import assemble_source
from fblc.codegen.compile import compile_model
from fblc.passes.pipeline import TrainingOptions
from tests.support import models
from tests.support.kernel_ir import lowered_kernels

CLANG = "clang-15"


def _real_arguments(kernel: kir.KernelIR) -> list[kir.Argument]:
    return [a for a in kernel.arguments if a.kind == "real"]


def test_fp16_kernels_on_half_textures_compute_in_real_and_accumulate_in_float(mlp_path) -> None:
    """adreno830 (cl_khr_fp16), --dtype fp16: the kernels that write or read only half textures compute in real,
    every accumulator (a variable assigned again, an array) of theirs stays float, and a kernel that both reads
    and writes fp32 (the optimizer update, the loss) has no real at all. The same step for `local` (no
    cl_khr_fp16) and for fp32 has no real anywhere."""
    # each co-launched kernel's parts (codegen/co_launch.py: a half kernel may share a launch with a float one)
    kernels = [part.ir for k in lowered_kernels(mlp_path, "adreno830", "fp16") for part in (k.parts or [k])]
    half = [k for k in kernels if computes_in_half(k)]
    assert half and len(half) < len(kernels)
    for kernel in kernels:
        assert bool(_real_arguments(kernel)) == computes_in_half(kernel), kernel.name
        floats = [a for a in kernel.arguments if a.kind in ("float", "real")]
        if floats and all(a.element == "float4" for a in floats):  # the master copy's and the loss chain's kernels
            assert not _real_arguments(kernel), kernel.name
    for kernel in half:
        for statement in kir.walk(kernel.body):
            accumulator = isinstance(statement, kir.DeclareArray) or (
                isinstance(statement, kir.Declare) and not statement.const)
            if accumulator and statement.var.dtype.is_float:
                assert statement.var.dtype.scalar == "float", (kernel.name, statement)
    counts = arithmetic_counts(kernels)
    assert counts["real"] > 0 and counts["float"] > 0
    for target, dtype in (("local", "fp16"), ("adreno830", "fp32")):
        others = [k.ir for k in lowered_kernels(mlp_path, target, dtype)]
        assert not any(_real_arguments(k) for k in others) and arithmetic_counts(others)["real"] == 0, (target, dtype)


def _kernel(body_of, arguments: list[kir.Argument]) -> kir.KernelIR:
    block = kir.Block(kir.Numbering())
    body_of(block)
    return kir.KernelIR("k", arguments, block.statements)


def test_the_retyping_rule_on_handmade_ir() -> None:
    """Golden: half inputs load as real4; a product of two is real; an fp32 input (not a parameter) stays
    float and widens what it meets; a literal takes its partner's type; isnan gets float; an accumulator
    stays float and takes a run of HALF_RUN products summed in real, but not a term that reads it;
    the store converts to the half output's real4. Negative: a kernel writing and reading fp32 is unchanged."""
    x, w = (kir.Argument("in", i, "float", "half", None) for i in (0, 1))
    scale = kir.Argument("in", 2, "float", "float4", None)
    out = kir.Argument("out", 0, "float", "half", None)

    def body(b: kir.Block) -> None:
        acc = b.mutable(kir.const(0.0, kir.FLOAT), "acc", kir.FLOAT)
        a, c = b.let(kir.Load(x, kir.const(0)), "a"), b.let(kir.Load(w, kir.const(0)), "c")
        for lane in range(HALF_RUN + 1):
            b.assign(acc, a.lane(lane % 4) * c.lane(lane % 4), "+=")
        b.assign(acc, kir.Cast(kir.REAL, acc) * a.lane(0), "+=")  # a real term that reads its accumulator
        s = b.let(kir.Load(scale, kir.const(0)), "s")
        b.let(kir.call("isnan", a.lane(0), dtype=kir.INT), "n")
        b.add(kir.Store(out, kir.const(0), (a * 0.5 + s) * acc))

    kernel = half_arithmetic(_kernel(body, [out, x, w, scale]))
    declared = {s.var.kind: s for s in kir.walk(kernel.body) if isinstance(s, kir.Declare)}
    assert declared["a"].var.dtype == declared["c"].var.dtype == kir.REAL4
    assert declared["s"].var.dtype == kir.FLOAT4 and declared["acc"].var.dtype == kir.FLOAT
    assert declared["n"].init.args[0] == kir.Cast(kir.FLOAT, kir.Lane(declared["a"].var, kir.const(0)))
    sums = [s for s in kir.walk(kernel.body) if isinstance(s, kir.Assign)]
    assert len(sums) == 3  # HALF_RUN products in one, the fifth alone, the one reading acc alone
    assert isinstance(sums[0].value, kir.Cast) and sums[0].value.a.dtype == kir.REAL
    assert [sum(isinstance(e, kir.Binary) and e.op == "*" for e in kir.walk_expr(s.value)) for s in sums] == [4, 1, 1]
    store = next(s for s in kir.walk(kernel.body) if isinstance(s, kir.Store))
    assert store.argument.kind == "real" and store.value.dtype == kir.REAL4
    widened = store.value.a.a.a  # (a * 0.5 + s) * acc: a * 0.5 (real4, its literal real) widened to meet s
    assert widened == kir.Cast(kir.FLOAT4, kir.Binary("*", declared["a"].var, kir.Const(0.5, kir.REAL4), kir.REAL4))
    source = render_kernel(kernel, BUFFER)
    for c in ("((real)0.5f)", "convert_real4(vload_half4(0, in0))", "vstore_half4_rte(convert_float4(", "(float)"):
        assert c in source, (c, source)
    fp32 = [kir.Argument("out", 0, "float", "float4", None), kir.Argument("in", 0, "float", "float4", None)]
    unchanged = _kernel(lambda b: b.add(kir.Store(fp32[0], kir.const(0), kir.Load(fp32[1], kir.const(0)))), fp32)
    assert half_arithmetic(unchanged) is unchanged


def _clang_errors(source_path: str, fp16: bool) -> str:
    """clang-15's errors and warnings on an OpenCL C source for a device with cl_khr_fp16 (given HALF_BUILD_OPTION,
    as the runtimes give it) or without."""
    flags = ["-Xclang", "-cl-ext=+cl_khr_fp16", HALF_BUILD_OPTION] if fp16 else ["-Xclang", "-cl-ext=-cl_khr_fp16"]
    result = subprocess.run([CLANG, "-x", "cl", "-cl-std=CL2.0", *flags, "-fsyntax-only", source_path],
                            capture_output=True, text=True, timeout=120)
    return result.stderr if result.returncode or "warning" in result.stderr else ""


#: the models whose fp16 kernels clang builds: the conv net's families (strided, depthwise, pointwise, grouped
#: convolutions and their gradients, BatchNorm on batch statistics, both pools, a Linear head) in the suite; the
#: T-ResNet and the Llama decoder (norms, attention, gathers, rotary views) under `-m slow` for the suite's time
CLANG_MODELS = {"convnet": (models.small_convnet, TrainingOptions(bn_train=True)),
                "tresnet": (models.tresnet, TrainingOptions()),
                "llama": (lambda directory: models.llama(directory)[0], TrainingOptions())}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if n != "convnet" else [])
                                  for n in CLANG_MODELS])
def test_clang_builds_every_half_kernel_with_and_without_cl_khr_fp16(name: str, tmp_path) -> None:
    """Each fp16 adreno830 bundle's kernels.cl and kernels.buffer.cl, which hold half kernels, type-check in
    clang-15 (OpenCL C 2.0) with cl_khr_fp16 (real is half: read_imageh, half built-ins, half4 vectors) and
    without it (real is float), no error and no warning."""
    if shutil.which(CLANG) is None:
        if os.environ.get("FBLC_CI") == "1":
            pytest.fail(f"{CLANG} is missing (FBLC_CI=1: .ci/run should have installed it)")
        pytest.skip(f"{CLANG} is missing (apt-get install clang-15): half kernels are built by no compiler here")
    build, options = CLANG_MODELS[name]
    bundle = str(tmp_path / "bundle")
    compile_model(build(str(tmp_path)).path, bundle, "adreno830", "fp16", options)
    for source in ("kernels.cl", "kernels.buffer.cl"):
        path = os.path.join(bundle, source)
        assert "typedef half real;" in open(path).read(), f"{source} has no half kernel"
        for fp16 in (True, False):
            errors = _clang_errors(path, fp16)
            assert not errors, f"{source}, cl_khr_fp16 {'on' if fp16 else 'off'}:\n{errors[:3000]}"


def test_a_source_without_half_kernels_has_no_real_preamble(mlp_path) -> None:
    """The real type's preamble comes only with a half kernel: the local (no cl_khr_fp16) fp16 source has none."""
    kernels = lowered_kernels(mlp_path, "local", "fp16")
    source, _ = assemble_source(kernels, [])
    assert "typedef half real;" not in source


def test_arithmetic_counts_static_and_executed() -> None:
    """Golden: `acc += a * b` in a loop of 8: statically one real product and one float sum; a launch of 10
    work-items executes each 80 times; a loop of run-time length counts once."""
    half = kir.Argument("in", 0, "float", "half", None)
    out = kir.Argument("out", 0, "float", "half", None)

    def body(b: kir.Block) -> None:
        acc = b.mutable(kir.const(0.0, kir.FLOAT), "acc", kir.FLOAT)
        with b.loop("k", 0, 8) as (k, inner):
            x = inner.let(kir.Load(half, k), "x")
            inner.assign(acc, x.lane(0) * x.lane(1), "+=")
        with b.loop("r", 0, kir.Load(half, kir.const(0)).lane(0).cast(kir.INT)) as (_, runtime):
            runtime.assign(acc, acc * 2.0)
        b.add(kir.Store(out, kir.const(0), kir.vector(kir.FLOAT4, acc)))

    kernel = half_arithmetic(_kernel(body, [out, half]))
    assert arithmetic_counts([kernel]) == {"real": 1, "float": 2}
    assert arithmetic_counts([(kernel, 10)]) == {"real": 80, "float": 90}
