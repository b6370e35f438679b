"""MemFLoRA's Table 3 beside fblc's memory plans: peak training-state / saved memory [MB] per batch size.

    python benchmarks/memory.py [--batches 1,8,32,64] [--models tresnet,mobilenet_v2] [--json out.json]

For each model and method fblc builds the training step (`--adapter none --bn-train`, the
paper's full fine-tuning with train-mode BatchNorm; `none` with eval-mode BatchNorm as an
extra row; `lora`, `memflora`, `memflora-sg`, all at r = 2), fuses it into kernels and runs
its memory planner; every figure comes from that plan (fp32, masks at the images the target's
kernel tiles write: one bit an element, lifetimes over the kernel launch order), as report.json's. Models: MobileNetV2 from a transformers config (17 classes, random
weights, BatchNormalization kept, exported once by torch.onnx with a dynamic batch) on
[B, 3, 97, 60], and T-ResNet (examples/tresnet.py) on [B, 97, 60, 1]. Beside each entry
stands the paper's (Table 3, Opportunity-shaped input; its LoRA rows are LoRA-C, a different
CNN LoRA, so they are context, not a target). At B = 64 the device peak (every live
allocation, inputs and temporaries included, each freed after its last reader: the planner's
`live_peak`) stands beside the paper's Jetson figure
(Table 7), and the issue's targets are checked.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fblc.compiler.adapters import AdapterConfig  # noqa: E402
from fblc.compiler.model_io import load_model  # noqa: E402
from fblc.codegen.plan import step_schedules  # noqa: E402
from fblc.profiles import load_profile  # noqa: E402
from fblc.compiler.optimizers import OptimizerConfig  # noqa: E402
from fblc.passes.memory_plan import plan_memory  # noqa: E402
from fblc.passes.pipeline import TrainingOptions, build_training_graph  # noqa: E402

MB = 1e6
BATCHES = (1, 8, 32, 64)
#: method label -> (adapter, bn_train)
METHODS = {"Full FT": ("none", True), "Full FT (eval BN)": ("none", False), "LoRA": ("lora", False),
           "MemFLoRA": ("memflora", False), "MemFLoRA-SG": ("memflora-sg", False)}
#: the paper's Table 3: (peak, saved) per batch size, then the optimizer state [MB]; "LoRA" is LoRA-C
PAPER = {
    "tresnet": {"Full FT": ([(9.02, 0.90), (13.84, 7.09), (35.08, 28.33), (63.40, 56.65)], 4.49),
                "LoRA": ([(5.51, 3.10), (11.53, 9.12), (32.20, 29.79), (59.76, 57.35)], 0.10),
                "MemFLoRA": ([(2.44, 0.02), (2.50, 0.11), (2.81, 0.42), (3.23, 0.83)], 0.08),
                "MemFLoRA-SG": ([(2.50, 0.02), (2.78, 0.11), (3.74, 0.42), (5.01, 0.83)], 0.10)},
    "mobilenet_v2": {"Full FT": ([(43.20, 16.12), (109.00, 81.91), (346.93, 319.85), (666.64, 639.56)], 17.97),
                     "LoRA": ([(27.17, 17.61), (90.00, 80.44), (305.40, 295.84), (592.61, 583.05)], 0.30),
                     "MemFLoRA": ([(9.63, 0.20), (10.54, 1.11), (13.66, 4.23), (17.83, 8.40)], 0.16),
                     "MemFLoRA-SG": ([(9.91, 0.20), (11.73, 1.11), (17.97, 4.23), (26.30, 8.40)], 0.16)},
}
JETSON_B64 = {"tresnet": {"Full FT": 66.20, "LoRA": 64.08, "MemFLoRA": 19.43},
              "mobilenet_v2": {"Full FT": 673.39, "LoRA": 601.45, "MemFLoRA": 95.43}}
NAMES = {"tresnet": "T-ResNet", "mobilenet_v2": "MobileNetV2"}
TARGET = "adreno830"  # the profile whose kernel schedules decide the saved masks' images (--target)


def export_models(directory: str, names: list[str]) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """name -> (ONNX path, input name, input shape without the batch)."""
    found: dict[str, tuple[str, str, tuple[int, ...]]] = {}
    if "tresnet" in names:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
        from tresnet import build_tresnet

        for batch in BATCHES:  # the builder writes static shapes
            build_tresnet(os.path.join(directory, f"tresnet_{batch}.onnx"), batch=batch)
        found["tresnet"] = (os.path.join(directory, "tresnet_{batch}.onnx"), "x", (97, 60, 1))
    if "mobilenet_v2" in names:
        import torch
        import transformers

        from tests.support.models import logits_only, randomize_batch_norm

        torch.manual_seed(0)
        config = transformers.MobileNetV2Config(num_labels=17, image_size=97)
        module = transformers.MobileNetV2ForImageClassification(config)
        module = logits_only(randomize_batch_norm(module, seed=1), "pixel_values").eval()
        path = os.path.join(directory, "mobilenet_v2.onnx")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(module, (torch.zeros(2, 3, 97, 60),), dynamo=True, optimize=False,
                                        opset_version=18, verbose=False,
                                        dynamic_shapes=({0: torch.export.Dim("batch")},))
        program.save(path)
        found["mobilenet_v2"] = (path, "pixel_values", (3, 97, 60))
    return found


def measure(path: str, input_name: str, shape: tuple[int, ...], adapter: str, bn_train: bool, rank: int,
            tile_bytes: int = -1, target: str = TARGET) -> dict[str, Any]:
    options = TrainingOptions(input_shapes={input_name: shape}, bn_train=bn_train,
                              optimizer=OptimizerConfig(name="adam", lr=1e-3, weight_decay=5e-4),
                              adapter=AdapterConfig(adapter, rank=rank), tile_bytes=tile_bytes)
    profile = load_profile(target)
    # with the target's kernel schedules, as `fblc compile` lowers: a saved mask takes the image its writer's
    # tile allows (report.json's figures, not a plan that assumes every mask at one bit)
    step = build_training_graph(load_model(path), options, lower=profile, schedules=step_schedules(profile, "fp32"))
    summary = plan_memory(step).summary()
    summary.pop("floor", None)
    return summary


def run(names: list[str], batches: list[int], rank: int, target: str = TARGET) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="fblc-memory-") as directory:
        started = time.perf_counter()
        exported = export_models(directory, names)
        print(f"models ready in {time.perf_counter() - started:.0f} s", file=sys.stderr)
        for name in names:
            path, input_name, sample = exported[name]
            results[name] = {}
            for method, (adapter, bn_train) in METHODS.items():
                results[name][method] = {}
                for batch in batches:
                    started = time.perf_counter()
                    figures = measure(path.format(batch=batch), input_name, (batch, *sample), adapter, bn_train, rank,
                                      target=target)
                    results[name][method][batch] = figures
                    print(f"{NAMES[name]} {method} B={batch}: {time.perf_counter() - started:.1f} s", file=sys.stderr)
            last = batches[-1]
            results[name]["MemFLoRA, no batch tiling"] = {last: measure(path.format(batch=last), input_name,
                                                                          (last, *sample), "memflora", False, rank, 0,
                                                                          target)}
    return results


def table(results: dict[str, Any], batches: list[int]) -> str:
    lines = []
    for name, methods in results.items():
        lines.append(f"\n{NAMES[name]}, r = 2, fp32: peak training state / saved [MB], fblc (paper Table 3)")
        header = f"{'method':<19}" + "".join(f"{'B=' + str(b):>31}" for b in batches) + f"{'optimizer':>18}"
        lines.append(header)
        for method, per_batch in methods.items():
            if method not in METHODS:
                continue
            paper_rows, paper_opt = PAPER[name].get(method, (None, None))
            cells = []
            for b in batches:
                figures = per_batch[b]
                ours = f"{figures['training_state_peak'] / MB:.2f}/{figures['saved'] / MB:.2f}"
                theirs = ""
                if paper_rows is not None and b in BATCHES:
                    peak, saved = paper_rows[BATCHES.index(b)]
                    theirs = f" ({peak:.2f}/{saved:.2f})"
                cells.append(f"{ours + theirs:>31}")
            optimizer = f"{per_batch[batches[-1]]['optimizer'] / MB:.2f}" + (f" ({paper_opt:.2f})" if paper_opt else "")
            lines.append(f"{method:<19}" + "".join(cells) + f"{optimizer:>18}")
        last = batches[-1]
        lines.append(f"live peak at B={last} [MB], every live allocation freed after its last reader, batch tiling at 8 MB per activation with an "
                     "adapter (paper: Jetson Table 7, B=64):")
        for method, per_batch in methods.items():
            jetson = JETSON_B64[name].get(method)
            figures = per_batch[last]
            lines.append(f"  {method:<27}{figures['live_peak'] / MB:>9.2f}" + (f"   ({jetson:.2f})" if jetson else "")
                         + f"   at {figures['live_peak_at']}")
    return "\n".join(lines)


def targets(results: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """The issue's targets at B = 64 on MobileNetV2 (and the same reading of Table 3 on T-ResNet)."""
    checks = []
    for name, limits in (("mobilenet_v2", (8.40, 17.83, 48.0, 0.987)), ("tresnet", (0.83, 3.23, None, None))):
        if name not in results or 64 not in results[name]["MemFLoRA"]:
            continue
        memflora = results[name]["MemFLoRA"][64]
        full = results[name]["Full FT"][64]
        saved, peak, device, reduction = limits
        label = NAMES[name]
        checks.append((f"{label} MemFLoRA saved <= {saved} MB", memflora["saved"] / MB <= saved,
                       f"{memflora['saved'] / MB:.2f} MB"))
        checks.append((f"{label} MemFLoRA training-state peak <= {peak} MB", memflora["training_state_peak"] / MB <= peak,
                       f"{memflora['training_state_peak'] / MB:.2f} MB"))
        untiled = results[name].get("MemFLoRA, no batch tiling", {}).get(64)
        if device is not None:
            checks.append((f"{label} MemFLoRA live peak <= {device} MB", memflora["live_peak"] / MB <= device,
                           f"{memflora['live_peak'] / MB:.2f} MB" + (
                               f" (without batch tiling {untiled['live_peak'] / MB:.2f} MB)" if untiled else "")))
        cut = 1 - memflora["saved"] / full["saved"]
        versus_eval = 1 - memflora["saved"] / results[name]["Full FT (eval BN)"][64]["saved"]
        if reduction is not None:
            checks.append((f"{label} saved-state reduction vs Full FT >= {reduction:.1%}", cut >= reduction - 5e-4,
                           f"{cut:.2%} (vs Full FT with eval BN: {versus_eval:.2%})"))
        else:
            print(f"{label} saved-state reduction vs Full FT: {cut:.2%} (paper 98.5%), vs Full FT with eval BN: "
                  f"{versus_eval:.2%}")
        for method in ("MemFLoRA", "MemFLoRA-SG", "LoRA", "Full FT"):
            ok = results[name][method][64]["floor_ok"]
            want = method.startswith("MemFLoRA")
            checks.append((f"{label} floor check {'passes' if want else 'fails'} for {method}", ok == want,
                           "floor ok" if ok else "floor violated"))
    return checks


#: --device's rows: (label, model, options beside --optimizer / --es-optimizer); every one with sgd and adam
DEVICE_CASES = (("MLP full FT", "mlp", {}), ("Llama 2-layer full FT", "llama", {}),
                ("T-ResNet B=4 full FT", "tresnet", {}),
                ("MobileNetV2 B=64 MemFLoRA r=2", "mobilenet_v2", {"adapter": "memflora"}),
                ("MLP FuRA-S ES", "mlp", {"trainer": "es", "adapter": "fura-s"}),
                ("Llama FuRA-S ES", "llama", {"trainer": "es", "adapter": "fura-s"}))
#: the ratio device_peak / live_peak the issue asks for, and the least that is sane (the allocator never holds
#: less than what is live: below this the two figures count different things)
RATIO_LIMITS = (0.95, 1.1)


def device_models(directory: str, names: set[str]) -> dict[str, tuple[str, dict[str, tuple[int, ...]]]]:
    """name -> (ONNX path, input shapes to compile with) of the --device table's models."""
    from tests.support import models

    found: dict[str, tuple[str, dict[str, tuple[int, ...]]]] = {}
    if "mlp" in names:
        found["mlp"] = (models.mlp(directory).path, {})
    if "llama" in names:
        found["llama"] = (models.llama(directory)[0].path, {})
    if "tresnet" in names:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
        from tresnet import build_tresnet

        found["tresnet"] = (build_tresnet(os.path.join(directory, "tresnet_4.onnx"), batch=4), {})
    if "mobilenet_v2" in names:
        path, input_name, sample = export_models(directory, ["mobilenet_v2"])["mobilenet_v2"]
        found["mobilenet_v2"] = (path, {input_name: (64, *sample)})
    return found


def device_table(target: str, rank: int) -> list[dict[str, Any]]:
    """report.json's live_peak and device_peak (what the runtimes allocate on `target`) of each DEVICE_CASES
    row, compiled as `fblc compile` does, and for the local target LocalRunner's allocated bytes."""
    from fblc.codegen.compile import compile_model
    from fblc.compiler.es import EsConfig

    rows = []
    with tempfile.TemporaryDirectory(prefix="fblc-memory-device-") as directory:
        found = device_models(directory, {model for _, model, _ in DEVICE_CASES})
        for label, model, extra in DEVICE_CASES:
            path, shapes = found[model]
            for optimizer in ("sgd", "adam"):
                es = extra.get("trainer") == "es"
                options = TrainingOptions(input_shapes=shapes, trainer=extra.get("trainer", "backprop"),
                                          adapter=AdapterConfig(extra.get("adapter", "none"), rank=rank),
                                          optimizer=OptimizerConfig(optimizer, lr=1.0 if es else 1e-2),
                                          es=EsConfig(), tile_bytes=-1)  # as `fblc compile` gives them
                started = time.process_time()
                _, report = compile_model(path, os.path.join(directory, "bundle"), target, "fp32", options)
                memory = report["memory"]
                rows.append({"case": label, "optimizer": optimizer, "live_peak": memory["live_peak"],
                             "device_peak": memory["device_peak"], "ratio": memory["device_peak"] / memory["live_peak"],
                             "storage": memory["device_storage"], "arena_images": memory["arena_images"]})
                print(f"{label} {optimizer}: {time.process_time() - started:.1f} CPU-s", file=sys.stderr)
    return rows


def device_lines(rows: list[dict[str, Any]], target: str) -> str:
    lines = [f"\ndevice_peak (what the runtimes allocate on {target}) against live_peak (the planner's), fp32 [MiB]",
             f"{'case':<32}{'optimizer':>10}{'live_peak':>12}{'device_peak':>13}{'ratio':>8}"]
    for row in rows:
        lines.append(f"{row['case']:<32}{row['optimizer']:>10}{row['live_peak'] / 2**20:>12.3f}"
                     f"{row['device_peak'] / 2**20:>13.3f}{row['ratio']:>8.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tresnet,mobilenet_v2")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--rank", type=int, default=2)
    parser.add_argument("--json", metavar="FILE", help="write every figure as JSON")
    parser.add_argument("--target", default=TARGET,
                        help=f"profile whose kernel schedules lower the steps (the masks' images follow the tiles; "
                             f"default: {TARGET})")
    parser.add_argument("--device", action="store_true",
                        help="instead: compile MLP, Llama, T-ResNet, MobileNetV2 B=64 MemFLoRA and FuRA-S ES (sgd, adam) "
                             "for --target and compare each report.json's device_peak with its live_peak")
    args = parser.parse_args(argv)
    if args.device:
        rows = device_table(args.target, args.rank)
        print(device_lines(rows, args.target))
        low, high = RATIO_LIMITS
        bad = [f"{r['case']} {r['optimizer']}: {r['ratio']:.3f}" for r in rows if not low <= r["ratio"] <= high]
        print(f"\n[{'FAIL' if bad else 'PASS'}] every device_peak within {low}-{high} x live_peak"
              + (": " + ", ".join(bad) if bad else ""))
        mobilenet = [r for r in rows if r["case"].startswith("MobileNetV2")]
        over = [r for r in mobilenet if r["device_peak"] > 32 * 2**20]
        print(f"[{'FAIL' if over else 'PASS'}] MobileNetV2 B=64 MemFLoRA device_peak <= 32 MiB: "
              + ", ".join(f"{r['optimizer']} {r['device_peak'] / 2**20:.2f} MiB" for r in mobilenet))
        if args.json:
            with open(args.json, "w", encoding="utf-8") as handle:
                json.dump(rows, handle, indent=1)
        return 1 if bad or over else 0
    names = [n for n in args.models.split(",") if n]
    batches = [int(b) for b in args.batches.split(",")]
    results = run(names, batches, args.rank, args.target)
    print(table(results, batches))
    checks = targets(results)
    if checks:
        print("\ntargets at B=64:")
        for text, ok, value in checks:
            print(f"  [{'PASS' if ok else 'FAIL'}] {text}: {value}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=1, default=str)
    return 0 if all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
