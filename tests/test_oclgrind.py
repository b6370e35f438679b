"""Training steps on oclgrind, a second OpenCL implementation that checks what PoCL forgives.

oclgrind (Debian's `oclgrind`, installed by scripts/install_system_packages.sh) simulates an OpenCL
device and reports invalid memory accesses (the __local partials of group reductions) and data races
between work-items (`--data-races`). One step of each case of tests/support/oclgrind_steps.py runs
there (contractions; convolutions incl. strided, depthwise, pointwise and grouped; BatchNorm on batch
statistics and LayerNorm; max, average and global pools; gathers and row scatters; causal masks; the
fused SGD-momentum and AdamW; every adapter: lora, memflora, memflora-sg, fura-s): any such report
fails the test, and every output of the step must equal onnxruntime's (fp32 tolerances of
fblc.tools.verify). An image read outside its image is not reported (a MergeRuns read 50,000
elements past its row went unreported and only gave wrong numbers): the numbers check that, and
the conv net and the embedding run again in LocalRunner's buffer storage, where a read or write
past the end of a texture's buffer is reported (a texel index one too far fails them).
Kernels are built with -cl-opt-disable: oclgrind's interpreter runs some optimised LLVM IR wrongly
(a T-ResNet weight-gradient conv that PoCL and numpy agree on, 0.011 off on oclgrind, exact with
-cl-opt-disable; the 2-bit lane indices of a ViT's Q.K^T MatMul, every tensor of its step wrong), and
pyopencl's binary cache is off so that option reaches every build. LocalRunner does both on Oclgrind by
itself: the ViT attention case runs as a user runs it, without --build-options or PYOPENCL_NO_CACHE.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.support.oclgrind_steps import CASES

#: what oclgrind prints when a kernel breaks a rule (its error reports and fatal errors)
REPORTS = ("Invalid read", "Invalid write", "data race", "Uninitialized", "OCLGRIND FATAL ERROR", "out-of-bounds")

#: kernels that write one element past their buffer and race on one element
BROKEN_KERNELS = r"""
__kernel void past_the_end(__global float *out) { out[get_global_id(0) + 1] = 1.0f; }
__kernel void racing(__global float *out) { out[0] += (float)get_global_id(0); }
"""
RUN_BROKEN_KERNELS = f"""
import pyopencl as cl
context = cl.create_some_context(interactive=False)
queue = cl.CommandQueue(context)
program = cl.Program(context, {BROKEN_KERNELS!r}).build()
buffer = cl.Buffer(context, cl.mem_flags.READ_WRITE, 16 * 4)
program.past_the_end(queue, (16,), None, buffer)
program.racing(queue, (16,), (16,), buffer)
queue.finish()
"""


def _under_oclgrind(arguments: list[str], by_hand: bool = True,
                    cache_home: str | None = None) -> subprocess.CompletedProcess[str]:
    """`python ARGUMENTS` under oclgrind; `by_hand`: with -cl-opt-disable and no pyopencl cache asked for by the
    test, else as a user runs it (pyopencl's cache under `cache_home`, LocalRunner left to choose)."""
    if shutil.which("oclgrind") is None:
        if os.environ.get("FBLC_CI") == "1":
            pytest.fail("oclgrind is missing (FBLC_CI=1: .ci/run should have installed it)")
        pytest.skip("oclgrind (apt-get install oclgrind) is missing")
    options = ["--build-options", "-cl-opt-disable"] if by_hand else []
    env = {key: value for key, value in os.environ.items() if by_hand or key != "PYOPENCL_NO_CACHE"}
    env.update({"PYOPENCL_NO_CACHE": "1"} if by_hand else {"XDG_CACHE_HOME": cache_home} if cache_home else {})
    return subprocess.run(["oclgrind", "--data-races", *options, sys.executable, *arguments], capture_output=True,
                          text=True, timeout=600, env={**env, "FBLC_OPENCL_DEVICE": "local"})


def _reports(done: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in done.stderr.splitlines() if any(mark in line for mark in REPORTS)]


def test_oclgrind_reports_a_write_past_the_end_and_a_race() -> None:
    """Negative case: the checks the steps rely on fire on kernels that break the rules."""
    reports = _reports(_under_oclgrind(["-c", RUN_BROKEN_KERNELS]))
    assert any("Invalid write" in line for line in reports), reports
    assert any("data race" in line for line in reports), reports


#: cases left to `-m slow` for the suite's time (the conv net, the embedding and the shared tiles cover their
#: kernel families, the Llama decoder's attention runs under -m slow; MemFLoRA's adapter covers LoRA's and
#: shares its backward with MemFLoRA-SG's; the group reductions' images cover their __local merges)
SLOW_CASES = {"resnet", "gpt2", "llama", "convnet lora", "convnet memflora-sg", "group reductions in buffers"}


#: cases run as a user runs them (test_the_runner_builds_unoptimised_and_uncached_on_oclgrind)
AS_A_USER = {"vit attention"}


def _assert_clean_and_equal(done: subprocess.CompletedProcess[str], case: str) -> None:
    reports = _reports(done)
    assert not reports, "\n".join(reports[:20])
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {case: []}


@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.slow] if c in SLOW_CASES else [])
                                  for c in CASES if c not in AS_A_USER])
def test_one_step_on_oclgrind_is_clean_and_matches_onnxruntime(case: str, tmp_path) -> None:
    _assert_clean_and_equal(_under_oclgrind(["-m", "tests.support.oclgrind_steps", str(tmp_path), case]), case)


def test_the_runner_builds_unoptimised_and_uncached_on_oclgrind(tmp_path) -> None:
    """Optimised, oclgrind 21.10 gets every tensor of a ViT attention step wrong (2-bit lane indices left
    unmasked), and pyopencl's cache, whose keys leave out oclgrind's --build-options, would serve that
    binary to a user who then adds -cl-opt-disable: LocalRunner builds with -cl-opt-disable outside the
    cache on Oclgrind by itself, says so once, and the step matches onnxruntime on every tensor."""
    cache = tmp_path / "cache"
    for case in sorted(AS_A_USER):
        done = _under_oclgrind(["-m", "tests.support.oclgrind_steps", str(tmp_path), case], by_hand=False,
                               cache_home=str(cache))
        _assert_clean_and_equal(done, case)
        notes = [line for line in done.stderr.splitlines() if line.startswith("note: ") and "-cl-opt-disable" in line]
        assert len(notes) == 1, done.stderr[-3000:]
        cached = [str(path) for path in cache.rglob("source.cl") if "__kernel void k" in path.read_text()]
        assert not cached, cached  # only select_device's probe kernel may sit in pyopencl's cache
