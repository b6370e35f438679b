#!/usr/bin/env bash
# The Debian / Ubuntu packages the full test suite needs beyond pip (.ci/run runs this too).
# Without them the tests that need them are skipped (with FBLC_CI=1 they fail instead):
#   cmake make gcc libc6-dev       build the native runner (tests/test_native_runner.py, tests/test_adb.py)
#   ocl-icd-libopencl1             the OpenCL ICD loader the runner opens (libOpenCL.so.1)
#   pocl-opencl-icd                Debian's PoCL (3.1, LLVM 15): the local OpenCL device of both runtimes where
#                                  it is installed. The pip wheel's PoCL 3.0 (LLVM 14) cannot build a kernel on
#                                  CPUs its LLVM does not know ("unknown target CPU 'generic'", AMD Zen 5)
#   adb                            Debian's adb client, talking to the loopback device (tests/test_adb.py)
#   gcc-aarch64-linux-gnu libc6-dev-arm64-cross   the runner's aarch64 portability build
#   chromium chromium-driver       open a pass dump in Netron in headless Chromium (tests/test_netron_dump.py)
#   oclgrind                       a simulated OpenCL device that checks accesses and races (tests/test_oclgrind.py)
#                                  and counts instructions (benchmarks/instructions.py)
#   clang-15                       builds the half kernels no local device runs (cl_khr_fp16:
#                                  tests/test_half_arithmetic.py; pocl-opencl-icd pulls it in too)
set -euo pipefail
PACKAGES=(cmake make gcc libc6-dev ocl-icd-libopencl1 pocl-opencl-icd adb gcc-aarch64-linux-gnu libc6-dev-arm64-cross
          chromium chromium-driver oclgrind clang-15)
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
$SUDO apt-get update -qq
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null
echo "installed: ${PACKAGES[*]}"
