"""What a work-group reduction costs, per group kernel, under oclgrind: one training step of small cases.

    python benchmarks/group_reductions.py [--target adreno830]

Cases (each compiled for the target, one step run on oclgrind's simulated device with `--inst-counts`,
kernels built with -cl-opt-disable as tests/test_oclgrind.py does): a LayerNorm over rows of 2048 with its
statistics (a training step's Mean / InvStdDev kernel), a ReduceLogSumExp over rows of 2048, a MatMul over
K = 1100 (a register tile shared by a work-group) and a 3x3 weight gradient over 40 x 36 maps (the same).
For every launch that runs in work-groups it prints the group size and, summed over its work-items, the
instructions executed, the barriers reached, the __local loads and stores, and the image reads. Run it on
two checkouts to compare (oclgrind has no sub-groups: these are the __local tree's counts).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from onnx import helper  # noqa: E402

from fblc.codegen.compile import compile_model  # noqa: E402
from tests.test_kernels_contraction import OPTIONS, TILE_CASES, write_case  # noqa: E402

ONE_STEP = """
import sys
from fblc.runtime.local import LocalRunner
print("loss", LocalRunner(sys.argv[1], progress=False, storage="image", device_workarounds=False).step({}))
"""
CASES = {
    "layernorm [4, 2048]": ([helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["y", "mean", "inv"],
                                              axis=-1, epsilon=1e-5)],
                            {"x": (4, 2048), "scale": (2048,), "bias": (2048,)}),
    "logsumexp [4, 2048]": ([helper.make_node("Constant", [], ["axes"], value=helper.make_tensor("axes", 7, [1], [1])),
                             helper.make_node("ReduceLogSumExp", ["x", "axes"], ["y"], keepdims=1)], {"x": (4, 2048)}),
    "matmul K=1100": TILE_CASES["matmul_long_k_shared"][:2],
    "conv3x3 dW 40x36": TILE_CASES["conv3x3_weight_grad_shared"][:2],
}
#: figure -> how an oclgrind instruction line (its opcode text) counts toward it
FIGURES = {"barriers": re.compile(r"call _Z7barrier"), "local loads/stores": re.compile(r"^(load|store) local"),
           "image reads": re.compile(r"call _Z\d+read_image")}
KERNEL = re.compile(r"Instructions executed for kernel '(\w+)'")
LINE = re.compile(r"^\s*([\d,]+) - (.+)$")


def kernel_counts(bundle: str) -> dict[str, Counter[str]]:
    """Per __kernel, the figures of one step of `bundle` on oclgrind."""
    done = subprocess.run(["oclgrind", "--inst-counts", "--build-options", "-cl-opt-disable", sys.executable, "-c",
                           ONE_STEP, bundle], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYOPENCL_NO_CACHE": "1"})
    if done.returncode != 0 or "loss" not in done.stdout:
        raise RuntimeError(f"oclgrind run of {bundle} failed:\n{done.stderr[-2000:]}")
    counts: dict[str, Counter[str]] = {}
    current: Counter[str] | None = None
    for line in (done.stdout + done.stderr).splitlines():
        if match := KERNEL.match(line):
            current = counts.setdefault(match.group(1), Counter())
        elif (match := LINE.match(line)) and current is not None:
            count, opcode = int(match.group(1).replace(",", "")), match.group(2).strip()
            current["instructions"] += count
            for figure, pattern in FIGURES.items():
                current[figure] += count if pattern.search(opcode) else 0
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="adreno830")
    args = parser.parse_args(argv)
    if shutil.which("oclgrind") is None:
        print("oclgrind is not installed: apt-get install oclgrind (scripts/install_system_packages.sh)",
              file=sys.stderr)
        return 2
    print(f"one training step under oclgrind, compiled for {args.target}: the launches that run in work-groups")
    print(f"{'case':<20} {'kernel':<30} {'group':>5} {'instructions':>13} {'barriers':>9} {'local ld/st':>11} "
          f"{'image reads':>11}")
    with tempfile.TemporaryDirectory() as directory:
        for name, (nodes, inits) in CASES.items():
            path = write_case(os.path.join(directory, f"{len(os.listdir(directory))}.onnx"), nodes, inits)
            bundle = f"{path}.bundle"
            compile_model(path, bundle, args.target, "fp32", OPTIONS)
            with open(os.path.join(bundle, "plan.json"), encoding="utf-8") as handle:
                launches = json.load(handle)["kernels"]
            counts = kernel_counts(bundle)
            for launch in launches:
                if launch.get("schedule", {}).get("group_size", 1) > 1:
                    c = counts.get(launch["function"], Counter())
                    print(f"{name:<20} {launch['name']:<30} {launch['local_size'][0]:>5} {c['instructions']:>13,d} "
                          f"{c['barriers']:>9,d} {c['local loads/stores']:>11,d} {c['image reads']:>11,d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
