"""Training steps on oclgrind, a second OpenCL implementation that checks what PoCL forgives.

oclgrind (Debian's `oclgrind`, installed by scripts/install_system_packages.sh) simulates an OpenCL
device and reports invalid memory accesses (the __local partials of group reductions) and data races
between work-items (`--data-races`). One step of each case of tests/support/oclgrind_steps.py runs
there: any such report fails the test, and every output of the step must equal onnxruntime's (fp32
tolerances of fblc.tools.verify). An image read outside its image is not reported (a MergeRuns read
50,000 elements past its row went unreported and only gave wrong numbers): the numbers check that. Kernels are built with -cl-opt-disable: oclgrind's interpreter
runs some optimised LLVM IR wrongly (a T-ResNet weight-gradient conv that PoCL and numpy agree on,
0.011 off on oclgrind, exact with -cl-opt-disable), and pyopencl's binary cache is off so that
option reaches every build.
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


@pytest.mark.parametrize("case", list(CASES))
def test_one_step_on_oclgrind_is_clean_and_matches_onnxruntime(case: str, tmp_path) -> None:
    if shutil.which("oclgrind") is None:
        if os.environ.get("FBLC_CI") == "1":
            pytest.fail("oclgrind is missing (FBLC_CI=1: .ci/run should have installed it)")
        pytest.skip("oclgrind (apt-get install oclgrind) is missing")
    done = subprocess.run(["oclgrind", "--data-races", "--build-options", "-cl-opt-disable", sys.executable, "-m",
                           "tests.support.oclgrind_steps", str(tmp_path), case],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYOPENCL_NO_CACHE": "1", "FBLC_OPENCL_DEVICE": "local"})
    reports = [line for line in done.stderr.splitlines() if any(mark in line for mark in REPORTS)]
    assert not reports, "\n".join(reports[:20])
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {case: []}
