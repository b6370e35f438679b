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
-cl-opt-disable), and pyopencl's binary cache is off so that option reaches every build.
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


def _under_oclgrind(arguments: list[str]) -> subprocess.CompletedProcess[str]:
    if shutil.which("oclgrind") is None:
        if os.environ.get("FBLC_CI") == "1":
            pytest.fail("oclgrind is missing (FBLC_CI=1: .ci/run should have installed it)")
        pytest.skip("oclgrind (apt-get install oclgrind) is missing")
    return subprocess.run(["oclgrind", "--data-races", "--build-options", "-cl-opt-disable", sys.executable,
                           *arguments], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYOPENCL_NO_CACHE": "1", "FBLC_OPENCL_DEVICE": "local"})


def _reports(done: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in done.stderr.splitlines() if any(mark in line for mark in REPORTS)]


def test_oclgrind_reports_a_write_past_the_end_and_a_race() -> None:
    """Negative case: the checks the steps rely on fire on kernels that break the rules."""
    reports = _reports(_under_oclgrind(["-c", RUN_BROKEN_KERNELS]))
    assert any("Invalid write" in line for line in reports), reports
    assert any("data race" in line for line in reports), reports


#: cases left to `-m slow` for the suite's time (the conv net, the embedding and the shared tiles cover their
#: kernel families, the Llama decoder's attention runs under -m slow; MemFLoRA's adapter covers LoRA's and
#: shares its backward with MemFLoRA-SG's)
SLOW_CASES = {"resnet", "gpt2", "llama", "convnet lora", "convnet memflora-sg"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.slow] if c in SLOW_CASES else []) for c in CASES])
def test_one_step_on_oclgrind_is_clean_and_matches_onnxruntime(case: str, tmp_path) -> None:
    done = _under_oclgrind(["-m", "tests.support.oclgrind_steps", str(tmp_path), case])
    reports = _reports(done)
    assert not reports, "\n".join(reports[:20])
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {case: []}
