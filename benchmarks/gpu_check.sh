#!/usr/bin/env bash
# fblc on a real OpenCL GPU, in image storage (image2d_t textures, as on a phone), in one run and one table:
#   1. the OpenCL driver is visible (clinfo if installed, and pyopencl): the device is picked and named;
#   2. the device tests (fblc's numbers against onnxruntime / PyTorch) run on that device: the tests take their
#      device from FBLC_OPENCL_DEVICE (fblc/runtime/opencl.py), which this script sets to opencl:P:D; on a GPU
#      LocalRunner's storage "auto" is image, and fblc.tools.verify runs image storage, so they run in images;
#   3. benchmarks/step_time.py (fblc image / buffer against PyTorch eager on the CPU) and benchmarks/layout.py
#      (naive against rtile layouts, image storage) on that device, for --target's kernels;
#   4. one table of all of it (check, case, figure, value), also written to OUT/gpu_check.txt.
#
# usage: benchmarks/gpu_check.sh [--platform TEXT] [--allow-cpu] [--quick] [--target adreno830] [--steps N]
#                                [--tests "FILES"] [-k EXPR] [--slow] [--jobs N] [--wheelhouse DIR] [--out DIR]
#        benchmarks/gpu_check.sh --make-wheelhouse DIR   (here, with network: the wheels a GPU machine lacks)
#   --platform TEXT  the first device with images whose platform or device name contains TEXT (default: the first
#                    GPU with images); --allow-cpu lets it be a CPU: a dry run on PoCL (--platform Portable), which
#                    checks the script, not a GPU
#   --quick          a few minutes: a -k selection of the device tests, step_time on mlp and tresnet, layout on llama
#   --wheelhouse DIR install DIR/*.whl without network first (pyopencl and what it needs; --make-wheelhouse makes
#                    one for CPython 3.12 on x86-64 Linux, the device machines' python3)
#   --jobs N         pytest-xdist workers for the tests (default 1); --slow: the tests marked slow too
# Exit status: 0 when the driver was found and every test passed, 1 otherwise (the table is printed either way).
set -u -o pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
PLATFORM="" ALLOW_CPU=0 QUICK=0 MARK="not slow" TARGET=adreno830 STEPS=5 TESTS="" KEXPR="" JOBS=1 WHEELHOUSE="" OUTDIR="${OUT:-}"
WHEELS="pyopencl pytools siphash24 platformdirs"  # what fblc needs that the device machines' image lacks
while [ $# -gt 0 ]; do
  case "$1" in
    --platform) PLATFORM=$2; shift 2 ;;
    --allow-cpu) ALLOW_CPU=1; shift ;;
    --quick) QUICK=1; shift ;;
    --slow) MARK=""; shift ;;
    --target) TARGET=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --tests) TESTS=$2; shift 2 ;;
    -k) KEXPR=$2; shift 2 ;;
    --jobs) JOBS=$2; shift 2 ;;
    --wheelhouse) WHEELHOUSE=$2; shift 2 ;;
    --out) OUTDIR=$2; shift 2 ;;
    --make-wheelhouse)
      mkdir -p "$2" && exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$2" $WHEELS ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
OUTDIR=${OUTDIR:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
mkdir -p "$OUTDIR"
cd "$ROOT" || exit 2
if [ -n "$WHEELHOUSE" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fblc-site \
    "$WHEELHOUSE"/*.whl || { echo "gpu_check.sh: installing $WHEELHOUSE/*.whl failed" >&2; exit 2; }
  export PYTHONPATH=/tmp/fblc-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

# 1. the driver ------------------------------------------------------------------------------------------------
if command -v clinfo >/dev/null; then clinfo -l > "$OUTDIR/clinfo.txt" 2>&1; else echo "clinfo: not installed" > "$OUTDIR/clinfo.txt"; fi
pick_device() {  # prints opencl:P:D and the device's description; exit 1 with the listing when none fits
  "$PY" - "$PLATFORM" "$ALLOW_CPU" <<'EOF'
import sys
import pyopencl as cl
want, allow_cpu = sys.argv[1].lower(), sys.argv[2] == "1"
listing, chosen = [], None
for pi, platform in enumerate(cl.get_platforms()):
    for di, device in enumerate(platform.get_devices()):
        gpu = bool(device.type & cl.device_type.GPU)
        text = f"opencl:{pi}:{di} {platform.name.strip()} | {device.name.strip()} | driver {device.driver_version}"
        listing.append(f"{text} | {'GPU' if gpu else 'not a GPU'} | images {'yes' if device.image_support else 'no'}")
        fits = device.image_support and (gpu or allow_cpu) and (not want or want in text.lower())
        if fits and chosen is None:
            chosen = (f"opencl:{pi}:{di}", text + ("" if gpu else " (NOT A GPU: a dry run)"))
print("\n".join(listing), file=sys.stderr)
if chosen is None:
    sys.exit("no OpenCL device fits (--platform %r, --allow-cpu %s)" % (want, allow_cpu))
print(chosen[0]); print(chosen[1])
EOF
}
DEVICE_LINES=$(pick_device 2> "$OUTDIR/devices.txt")
if [ -z "$DEVICE_LINES" ] && [ -z "${OCL_ICD_VENDORS:-}" ]; then
  # the NVIDIA driver mounted without an ICD file: register its OpenCL library with the ICD loader ourselves
  NVIDIA_CL=$(ls /usr/local/nvidia/lib64/libnvidia-opencl.so.1 /usr/lib/x86_64-linux-gnu/libnvidia-opencl.so.1 \
              /usr/lib64/libnvidia-opencl.so.1 2>/dev/null | head -1)
  if [ -n "$NVIDIA_CL" ]; then
    mkdir -p /tmp/fblc-icd && echo "$NVIDIA_CL" > /tmp/fblc-icd/nvidia.icd && export OCL_ICD_VENDORS=/tmp/fblc-icd
    echo "no ICD file named a GPU: registered $NVIDIA_CL through OCL_ICD_VENDORS=/tmp/fblc-icd" >> "$OUTDIR/devices.txt"
    DEVICE_LINES=$(pick_device 2>> "$OUTDIR/devices.txt")
  fi
fi
cat "$OUTDIR/devices.txt" >&2
STATUS=0
if [ -z "$DEVICE_LINES" ]; then
  echo "gpu_check.sh: no usable OpenCL device (see above); nothing else ran" >&2
  STATUS=1
else
  export FBLC_OPENCL_DEVICE=$(echo "$DEVICE_LINES" | head -1)
  echo "$DEVICE_LINES" | tail -1 > "$OUTDIR/device.txt"
  echo "device: $(cat "$OUTDIR/device.txt")" >&2

  # 2. the device tests ----------------------------------------------------------------------------------------
  if [ -z "$TESTS" ]; then
    TESTS="tests/test_device_models.py tests/test_device_more_ops.py tests/test_kernels_activations.py
           tests/test_kernels_contraction.py tests/test_kernels_more.py tests/test_kernels_other.py
           tests/test_kernels_resample.py tests/test_mixed_precision.py"
    [ "$QUICK" = 1 ] && [ -z "$KEXPR" ] && TESTS="tests/test_device_models.py tests/test_kernels_contraction.py" \
      && KEXPR="mlp or tresnet or conv"
  fi
  XDIST=(); [ "$JOBS" -gt 1 ] && XDIST=(-n "$JOBS" --dist loadgroup)
  # shellcheck disable=SC2086  # TESTS is a list of files
  "$PY" -m pytest -q -p no:cacheprovider -o addopts="" "${XDIST[@]}" -m "${MARK:-slow or not slow}" \
    ${KEXPR:+-k "$KEXPR"} $TESTS \
    --junitxml="$OUTDIR/tests.xml" > "$OUTDIR/tests.log" 2>&1 || STATUS=1
  tail -3 "$OUTDIR/tests.log" >&2

  # 3. the benchmarks, image storage on the device -------------------------------------------------------------
  if [ "$QUICK" = 1 ]; then STEP_MODELS=mlp,tresnet LAYOUT_MODELS=llama STEPS=2
  else STEP_MODELS=mlp,tresnet,mobilenet_v2,resnet,llama LAYOUT_MODELS=llama,mobilenet_v2; fi
  "$PY" benchmarks/step_time.py --models "$STEP_MODELS" --steps "$STEPS" --target "$TARGET" \
    > "$OUTDIR/step_time.txt" 2> "$OUTDIR/step_time.err" || echo "step_time.py failed: $OUTDIR/step_time.err" >&2
  "$PY" benchmarks/layout.py --models "$LAYOUT_MODELS" --steps "$STEPS" --target "$TARGET" \
    > "$OUTDIR/layout.txt" 2> "$OUTDIR/layout.err" || echo "layout.py failed: $OUTDIR/layout.err" >&2
fi

# 4. one table -------------------------------------------------------------------------------------------------
"$PY" - "$OUTDIR" "$TARGET" <<'EOF' | tee "$OUTDIR/gpu_check.txt"
import os, re, sys
import xml.etree.ElementTree as ElementTree
from benchmarks.before_after import column_names, rows_of

out, target = sys.argv[1], sys.argv[2]

def text(name):
    path = os.path.join(out, name)
    return open(path).read() if os.path.exists(path) else ""

rows = [("driver", "clinfo -l", "platforms", " / ".join(l.strip() for l in text("clinfo.txt").splitlines()[:4]) or "-"),
        ("driver", "device", "FBLC_OPENCL_DEVICE", os.environ.get("FBLC_OPENCL_DEVICE", "none found")),
        ("driver", "device", "name", text("device.txt").strip() or "-")]
if os.path.exists(os.path.join(out, "tests.xml")):
    suite = ElementTree.parse(os.path.join(out, "tests.xml")).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    failed = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    total, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
    rows += [("device tests", "image storage", "passed", str(total - skipped - len(failed))),
             ("device tests", "image storage", "failed", str(len(failed))),
             ("device tests", "image storage", "skipped", str(skipped)),
             ("device tests", "image storage", "seconds", suite.get("time", "-"))]
    rows += [("device tests", "FAILED", name[-60:], "") for name in failed[:20]]
elif text("tests.log"):
    rows.append(("device tests", "image storage", "did not finish", text("tests.log").strip().splitlines()[-1][:80]))
for name, label in (("step_time.txt", f"step_time ({target})"), ("layout.txt", f"layout ({target})")):
    lines = text(name).splitlines()
    columns = column_names(lines)
    for case, values in rows_of(lines).items():
        rows += [(label, case, column, f"{value:g}") for column, value in zip(columns, values)]
    if not lines:
        rows.append((label, "-", "did not run or failed", name.replace(".txt", ".err")))
width = [max(len(r[i]) for r in rows) for i in range(3)]
print(f"fblc on {os.environ.get('FBLC_OPENCL_DEVICE', 'no device')}, image storage; files in {out}")
for row in rows:
    print("  ".join(cell.ljust(w) for cell, w in zip(row[:3], width)) + "  " + row[3])
EOF
exit $STATUS
