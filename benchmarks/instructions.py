"""Instruction counts of one training step under oclgrind, `--layout naive` against `rtile`: device-independent evidence.

    python benchmarks/instructions.py [--models llama,mobilenet_v2] [--target adreno830]  (or --models mlp)

Each model is compiled for the target twice (naive and rtile layouts); one step of each bundle
runs on oclgrind's simulated OpenCL device (`oclgrind --inst-counts`, Debian's `oclgrind`
package), which counts every LLVM instruction each kernel executes. The table sums them per
step: image reads and writes, FMAs (llvm.fmuladd and fma calls), other float arithmetic,
integer division and remainder, private-memory loads and stores, the div/rem per FMA ratio
that index arithmetic costs, and image reads per FMA (texel fetches per multiply-add: what
whole-texel reads lower); the last column is naive / rtile for each figure. The row "image reads,
IR" is fblc/tools/kernel_stats.py's count of the same step's texel fetches from the kernel IR, which
benchmarks/phone_kernels.py reports without running anything: it should be oclgrind's within a few %.

The models are small (oclgrind interprets every work-item): the 2-layer Llama decoder of the
tests (B=2, T=16) and MobileNetV2 on [1, 3, 32, 32]; `mlp`, examples/mlp.py's [8, 32] MLP, is the
seconds-long case that tests/test_benchmarks.py runs to see the script still works.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fblc.tools.kernel_stats import compile_figures  # noqa: E402
from fblc.passes.pipeline import TrainingOptions  # noqa: E402

#: figure -> how an oclgrind instruction line (its opcode text) counts toward it
FIGURES: dict[str, re.Pattern[str]] = {
    "image reads": re.compile(r"call _Z\d+read_image"),
    "image writes": re.compile(r"call _Z\d+write_image"),
    "FMAs": re.compile(r"call (llvm\.fmuladd|llvm\.fma\.|_Z3fma)"),
    "float add/mul/div": re.compile(r"^(fadd|fsub|fmul|fdiv)$"),
    "int div/rem": re.compile(r"^(sdiv|srem|udiv|urem)$"),
    "private loads": re.compile(r"^load private"),
    "private stores": re.compile(r"^store private"),
}
LINE = re.compile(r"^\s*(\d+) - (.+)$")
#: the image reads of a step as fblc/tools/kernel_stats.py counts them from the kernel IR (sites times work-items
#: times loop trips, an if's heavier branch), beside oclgrind's count: the check of that estimate
IR_READS = "image reads, IR"
#: ratio rows after the figures: name -> (numerator, denominator figure); image reads per FMA is what
#: whole-texel reads lower (issue 39: a fetch that feeds four multiply-adds, not one)
RATIOS: dict[str, tuple[str, str]] = {"div/rem per FMA": ("int div/rem", "FMAs"),
                                      "image reads per FMA": ("image reads", "FMAs")}

ONE_STEP = """
import sys, numpy as np
from fblc import bundle_format as fmt
from fblc.runtime.local import LocalRunner
manifest, _ = fmt.load_verified(sys.argv[1])
rng = np.random.default_rng(0)
feeds = {e["name"]: (rng.integers(0, 2, e["shape"]) if e["dtype"].startswith("int")
                     else rng.standard_normal(e["shape"])).astype(e["dtype"]) for e in manifest["inputs"]}
print("loss", LocalRunner(sys.argv[1], progress=False, storage="image", device_workarounds=False).step(feeds))
"""


MODELS = ("mlp", "llama", "mobilenet_v2")


def build_models(directory: str, names: list[str]) -> dict[str, tuple[str, dict[str, list[int]]]]:
    built = {}
    if "mlp" in names:
        import importlib.util

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        spec = importlib.util.spec_from_file_location("fblc_example_mlp", os.path.join(root, "examples", "mlp.py"))
        assert spec is not None and spec.loader is not None
        example = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(example)
        built["mlp B=8"] = (example.build_mlp(os.path.join(directory, "mlp.onnx")), {})
    if "llama" in names:
        from tests.support import models

        exported, _ = models.llama(directory)
        built["llama 2L B=2 T=16"] = (exported.path, exported.input_shapes)
    if "mobilenet_v2" in names:
        import numpy as np

        from tests.support import models

        pixels = np.random.default_rng(0).standard_normal((1, 3, 32, 32)).astype(np.float32)
        path = os.path.join(directory, "mobilenet_v2.onnx")
        models.export_mobilenet_v2(path, pixels, num_labels=10, image_size=32)
        built["mobilenetv2 [1,3,32,32]"] = (path, {"pixel_values": [1, 3, 32, 32]})
    return built


def counts_of_one_step(bundle: str) -> Counter[str]:
    """The figures of one step of `bundle` on oclgrind, summed over its kernels."""
    done = subprocess.run(["oclgrind", "--inst-counts", sys.executable, "-c", ONE_STEP, bundle],
                          capture_output=True, text=True, check=False, cwd=os.path.dirname(os.path.dirname(
                              os.path.abspath(__file__))))
    if done.returncode != 0 or "loss" not in done.stdout:
        raise RuntimeError(f"oclgrind run of {bundle} failed:\n{done.stderr[-2000:]}")
    figures: Counter[str] = Counter()
    for line in (done.stdout + done.stderr).splitlines():
        match = LINE.match(line)
        if not match:
            continue
        count, opcode = int(match.group(1)), match.group(2).strip()
        for figure, pattern in FIGURES.items():
            if pattern.search(opcode):
                figures[figure] += count
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama,mobilenet_v2", help=f"of {', '.join(MODELS)}")
    parser.add_argument("--target", default="adreno830")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.models.split(",")) - set(MODELS))
    if unknown:
        parser.error(f"--models {','.join(unknown)}: not a model of this benchmark; choose of {', '.join(MODELS)}")
    if shutil.which("oclgrind") is None:
        print("oclgrind is not installed: apt-get install oclgrind (scripts/install_system_packages.sh)",
              file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for name, (path, shapes) in build_models(directory, args.models.split(",")).items():
            measured = {}
            for layout in ("naive", "rtile"):
                bundle = os.path.join(directory, f"{os.path.basename(path)}.{layout}")
                # each kernel its own launch: co-launch pairs the two layouts' kernels differently, and a part's
                # idle work-items differ from its own launch's (the layouts' arithmetic is what is compared)
                figures, _ = compile_figures(path, bundle, args.target, "fp32",
                                             TrainingOptions(input_shapes=shapes, layout=layout),
                                             co_launched_kernels=False)
                measured[layout] = counts_of_one_step(bundle)
                measured[layout][IR_READS] = round(figures.fetch_runs)
                print(f"  measured {name} {layout}", file=sys.stderr)
            rows.append((name, measured))
    print(f"one training step under oclgrind, compiled for {args.target}")
    print(f"{'model':<26} {'figure':<20} {'naive':>14} {'rtile':>14} {'naive/rtile':>12}")
    for name, measured in rows:
        for figure in list(FIGURES) + [IR_READS] + list(RATIOS):
            if figure in RATIOS:
                over, under = RATIOS[figure]
                naive, rtile = (measured[k][over] / max(1, measured[k][under]) for k in ("naive", "rtile"))
                ratio = f"{naive / rtile:12.2f}" if rtile else f"{'-':>12}"
                print(f"{name:<26} {figure:<20} {naive:14.3f} {rtile:14.3f} {ratio}")
                continue
            naive, rtile = measured["naive"][figure], measured["rtile"][figure]
            ratio = f"{naive / rtile:12.2f}" if rtile else f"{'-':>12}"
            print(f"{name:<26} {figure:<20} {naive:14,d} {rtile:14,d} {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
