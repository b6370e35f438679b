"""Phone-GPU figures of the kernels fblc compiles, before (a git revision) and after (this tree), in one table; no GPU.

    python benchmarks/phone_kernels.py [--base 41fc349] [--models mobilenet_v2,llama,tresnet]
                                       [--targets adreno830,mali-g925] [--kernels N]

Each model is exported once (here), then compiled for each target by both versions of fblc: the base revision
checked out into a temporary git worktree (as benchmarks/before_after.py does) and this tree, each in its own
process. The figures come from fblc/tools/kernel_stats.py (with lane_use.py and item_values.py: this tree's,
loaded by path into both processes, so both sides are measured alike), from the kernel IR of every launch and the bundle's plan.json and report.json:

- whole/site, whole/step: the fraction of texel fetches that use every channel of their texel (all four lanes
  of an RGBA texel), counted once per read site of every launch (site), and weighted by how often each site runs
  per step (step): per work-item, the trips of its loops and the branches its ifs take where the IR's integer
  prologue gives them (from get_global_id), interval bounds of the trips elsewhere, an if's heavier branch where
  its condition depends on data or a loop variable;
- est. runs %: the share of whole/step's fetch runs counted under upper estimates (a condition on data or on a
  loop variable, trips from interval bounds): the rest are exact for the kernels' integer prologue;
- launches: kernel launches per step (plan.json);
- small FLOP %: the share of the step's FLOPs (report.json estimate.kernels[*].flops) in launches with fewer
  work-items (plan.json items) than the device holds at once: compute_units x waves_per_unit x wave_size of the
  profile, or kernel_stats' stated estimate where the profile has no such figures (the header line says which);
- half %: the share of float arithmetic (lane-operations per step) computed in half, compiled with --dtype fp16;
- MB/step and est ms: report.json's estimate of bytes moved and of the step's time (from the profile, not measured:
  fblc.profiles.roofline on the nodes' FLOPs and each texture read once);
- IR est ms (fp32) and fp16 IR ms (--dtype fp16): the same roofline on what each launch's kernel IR runs (its
  lane-operations, wasted lanes included, half ones at the profile's half_rate, and every whole texel it fetches:
  kernel_stats.ir_estimate), this tree's profile figures for both sides;
- fp16 launch: launches per step compiled with --dtype fp16.

With `--kernels N`, after the table: each model and target's N launches of the largest IR estimate (fp32), before
and after, with what sets their time (kernel_stats.launch_estimates): family, work-items, ms, bound (launch,
compute, fetch: the texture units, memory: DRAM), lane-operations (M slots), MB of whole texels fetched, MB read
and written in DRAM; then the IR estimate summed by family. Where the step's time goes, kernel by kernel.

The models: MobileNetV2 [8, 3, 97, 60] (17 classes, exported as benchmarks/step_time.py does), the Llama decoder
of the tests (2 layers, hidden 64) at B=4, T=128, and T-ResNet B=64 (examples/tresnet.py, as step_time.py).
With `--base HEAD` (or the revision this tree is at) both sides are the same fblc: a smoke run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODELS = ("mobilenet_v2", "llama", "tresnet")
TOOLS = os.path.join(ROOT, "fblc", "tools")  # kernel_stats.py, lane_use.py and item_values.py measure both sides
PROFILES = os.path.join(ROOT, "fblc", "profiles")  # and roofline.py, with this tree's profile figures
#: the profile figures fblc.profiles.roofline reads (this tree's, given to both sides)
RATES = ("peak_gflops", "device_items", "wave_size", "fp16", "half_rate", "compute_units", "texture_bytes_per_clock",
         "bandwidth_gbps", "launch_us")

#: run in each side's checkout (its fblc first on the path): compile each job, print its figures as one JSON line
DRIVER = """
import importlib.util, json, os, sys, types
import fblc.tools, fblc.profiles
for module, path in (("fblc.profiles.roofline", os.path.join(sys.argv[3], "roofline.py")),
                     *((f"fblc.tools.{name}", os.path.join(sys.argv[1], f"{name}.py"))
                       for name in ("item_values", "lane_use", "kernel_stats"))):  # this tree's modules, under
    # their own names (imported in this order by kernel_stats)
    spec = importlib.util.spec_from_file_location(module, path)
    stats = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    spec.loader.exec_module(stats)
from fblc.passes.pipeline import TrainingOptions
for job in json.loads(sys.argv[2]):
    try:
        figures, bundle = stats.compile_figures(job["model"], job["bundle"], job["target"], job["dtype"],
                                                TrainingOptions(input_shapes=job["shapes"]),
                                                job["resident_items"], types.SimpleNamespace(**job["rates"]))
        result = {"whole_site": figures.whole_share(False), "whole_step": figures.whole_share(True),
                  "estimated": figures.estimated_fetch_runs / figures.fetch_runs if figures.fetch_runs else 0.0,
                  "fetches": figures.fetches, "fetch_runs": figures.fetch_runs, "half": figures.half_share(),
                  "unbounded_loops": figures.unbounded_loops, **bundle}
    except Exception as error:  # a version that cannot compile a case: its row says so, the others still run
        result = {"error": f"{type(error).__name__}: {error}"[:300]}
    print(json.dumps({**job, **result}), flush=True)
"""


def export_models(directory: str, names: list[str]) -> dict[str, tuple[str, dict[str, list[int]]]]:
    """name -> (ONNX path, input shapes) of each model asked for."""
    import torch
    import transformers

    from tests.support import models

    exported: dict[str, tuple[str, dict[str, list[int]]]] = {}
    if "mobilenet_v2" in names:
        x = np.random.default_rng(0).standard_normal((8, 3, 97, 60)).astype(np.float32)
        path = os.path.join(directory, "mobilenet_v2.onnx")
        models.export_mobilenet_v2(path, x, num_labels=17, image_size=97)
        exported["mobilenetv2 [8,3,97,60]"] = (path, {})
    if "llama" in names:  # tests.support.models.llama's decoder, at the B=4, T=128
        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
        module = models.logits_only(models.randomize_norm_weights(transformers.LlamaForCausalLM(config), seed=3),
                                    "input_ids", use_cache=False).eval()
        ids = np.random.default_rng(2).integers(0, config.vocab_size, size=(4, 128)).astype(np.int64)
        path = os.path.join(directory, "llama.onnx")
        models._quiet_dynamo_export(module, (torch.from_numpy(ids),)).save(path)
        exported["llama 2L B=4 T=128"] = (path, {})
    if "tresnet" in names:
        path = models._example("tresnet")(os.path.join(directory, "tresnet.onnx"), batch=64)
        exported["t-resnet B=64"] = (path, {})
    return exported


def measure(tree: str, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each job's figures, compiled by the fblc of checkout `tree`."""
    environment = dict(os.environ, PYTHONPATH=tree)
    done = subprocess.run([sys.executable, "-c", DRIVER, TOOLS, json.dumps(jobs), PROFILES], cwd=tree, env=environment,
                          capture_output=True, text=True)
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or len(results) != len(jobs):
        raise SystemExit(f"measuring in {tree} failed:\n{done.stderr[-3000:]}")
    return results


COLUMNS = (("whole/site", "whole_site", "{:.3f}"), ("whole/step", "whole_step", "{:.3f}"),
           ("est. runs %", "estimated", "{:.1%}"),
           ("launches", "launches", "{:d}"), ("small FLOP %", "small_flop_share", "{:.1%}"),
           ("half %", "half", "{:.1%}"), ("MB/step", "bytes", "{:.1f}"), ("est ms", "step_ms", "{:.3f}"),
           ("IR est ms", "ir_step_ms", "{:.3f}"), ("fp16 IR ms", "fp16_ir_step_ms", "{:.3f}"),
           ("fp16 launch", "fp16_launches", "{:d}"))


#: columns taken from the --dtype fp16 compile: column key -> its figure
HALF_KEYS = {"half": "half", "fp16_ir_step_ms": "ir_step_ms", "fp16_launches": "launches"}


def cell(result: dict[str, Any] | None, key: str, form: str) -> str:
    if result is None or "error" in result:
        return "-"
    return form.format(result[key] / 1e6 if key == "bytes" else result[key])


def print_table(base: str, rows: list[tuple[str, str, dict[str, dict[str, Any]]]], sizes: dict[str, str]) -> None:
    print(f"phone-kernel figures: before = {base}, after = this tree (fblc/tools/kernel_stats.py; est = report.json "
          f"estimate, not measured)")
    for target, how in sizes.items():
        print(f"  device size of {target}: {how}")
    header = f"{'model':<24} {'target':<10} {'side':<7}" + "".join(f" {name:>12}" for name, _, _ in COLUMNS)
    print(header)
    for model, target, sides in rows:
        for side in ("before", "after"):
            fp32, fp16 = sides.get(f"{side} fp32"), sides.get(f"{side} fp16")
            cells = [cell(fp16 if key in HALF_KEYS else fp32, HALF_KEYS.get(key, key), form)
                     for _, key, form in COLUMNS]
            print(f"{model:<24} {target:<10} {side:<7}" + "".join(f" {c:>12}" for c in cells))
        ratios = []
        for _, key, _ in COLUMNS:
            dtype = "fp16" if key in HALF_KEYS else "fp32"
            old, new = sides.get(f"before {dtype}"), sides.get(f"after {dtype}")
            key = HALF_KEYS.get(key, key)
            ok = old and new and "error" not in old and "error" not in new and old[key]
            ratios.append(f"{new[key] / old[key]:.3f}" if ok else "-")  # type: ignore[index]
        print(f"{model:<24} {target:<10} {'a/b':<7}" + "".join(f" {r:>12}" for r in ratios))
    for model, target, sides in rows:
        for name, result in sides.items():
            if "error" in result:
                print(f"  {model} {target} {name}: did not compile: {result['error']}")


def print_kernels(rows: list[tuple[str, str, dict[str, dict[str, Any]]]], top: int) -> None:
    """Each model and target's `top` launches by IR estimate (fp32), before and after, and the sums by family."""
    for model, target, sides in rows:
        for side in ("before", "after"):
            result = sides.get(f"{side} fp32")
            if not result or "error" in result:
                continue
            kernels = result["ir_kernels"]
            families: dict[str, float] = {}
            for kernel in kernels:
                families[kernel["family"]] = families.get(kernel["family"], 0.0) + kernel["ms"]
            print(f"\n{model} {target} {side}: IR est {result['ir_step_ms']:.3f} ms over {len(kernels)} launches; "
                  + ", ".join(f"{family} {ms:.3f}" for family, ms in sorted(families.items(), key=lambda f: -f[1])))
            print(f"  {'kernel':<22} {'family':<12} {'items':>7} {'ms':>7} {'bound':<8} {'M slots':>8} "
                  f"{'fetch MB':>9} {'DRAM MB':>8}")
            for kernel in sorted(kernels, key=lambda k: -k["ms"])[:top]:
                print(f"  {kernel['kernel'][:22]:<22} {kernel['family'][:12]:<12} {kernel['items']:>7} "
                      f"{kernel['ms']:>7.3f} {kernel['bound']:<8} {kernel['slots'] / 1e6:>8.2f} "
                      f"{kernel['fetched_bytes'] / 1e6:>9.2f} {kernel['dram_bytes'] / 1e6:>8.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="41fc349", help="the git revision to compare against (before)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"of {', '.join(MODELS)}")
    parser.add_argument("--targets", default="adreno830,mali-g925")
    parser.add_argument("--kernels", type=int, default=0, metavar="N",
                        help="also list each model and target's N launches of the largest IR estimate")
    args = parser.parse_args(argv)
    names, targets = args.models.split(","), args.targets.split(",")
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        parser.error(f"--models {','.join(unknown)}: not a model of this benchmark; choose of {', '.join(MODELS)}")
    from fblc.profiles import load_profile
    from fblc.tools.kernel_stats import device_items

    resident = {target: device_items(load_profile(target)) for target in targets}  # this tree's, for both sides
    rates = {target: {name: getattr(load_profile(target), name) for name in RATES} for target in targets}
    sizes = {target: f"{items} work-items, {how}" for target, (items, how) in resident.items()}
    with tempfile.TemporaryDirectory() as scratch:
        exported = export_models(scratch, names)
        print("  exported " + ", ".join(exported), file=sys.stderr)
        jobs = [{"name": name, "model": path, "shapes": shapes, "target": target, "dtype": dtype,
                 "resident_items": resident[target][0], "rates": rates[target]}
                for name, (path, shapes) in exported.items() for target in targets for dtype in ("fp32", "fp16")]
        base = os.path.join(scratch, "base")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-q", base, args.base], check=True)
        results: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
        try:
            for side, tree in (("before", base), ("after", ROOT)):
                side_jobs = [{**job, "bundle": os.path.join(scratch, f"{side}-{n}")} for n, job in enumerate(jobs)]
                for result in measure(tree, side_jobs):
                    results.setdefault((result["name"], result["target"]), {})[f"{side} {result['dtype']}"] = result
                print(f"  measured {side}", file=sys.stderr)
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", base], check=False)
    table = [(model, target, sides) for (model, target), sides in results.items()]
    print_table(args.base, table, sizes)
    if args.kernels:
        print_kernels(table, args.kernels)
    return 0


if __name__ == "__main__":
    sys.exit(main())
