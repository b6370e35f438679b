"""Compile time of the Llama-3.2-1B-shaped training step: every pass and the codegen.

    python benchmarks/compile_time.py [--repeats 5] [--target adreno830] [--layout rtile]
    python benchmarks/compile_time.py --end-to-end [--layers 16] [--adapter lora --rank 8] [--weights int4] [--repeats 1]

The model is the graph-build benchmark's Llama-3.2-1B-shaped decoder (16 layers, hidden 2048,
FFN 8192, 32/8 heads, vocab 128256, sequence 256), whose 1.2 G weights sit in a sparse external
file that is never read. Timed, as `fblc compile` runs them: reading the model, the import and
training passes, the layout passes (ftd_taxonomy, tile_remap, rtile_select), fuse and the
memory plan, and the codegen (kernels, textures, kernels.cl). Not timed: packing the
parameters' initial contents into params.bin, which is a copy of the weights (4.9 GB here)
and no compiler work. Target: median under 3 s on a 2-core machine (FBLayout reports 6.1 s for
the layout compilation of a 1B graph, MNN 723 s).

`--end-to-end` times what `fblc compile` does instead (codegen.compile.compile_model), the bundle
written through params.bin (the weights packed from the memory-mapped external data: codegen/params.py),
with report.json's `timings` (write_params: the disk-write share) and `timings_cpu` (the same stages' CPU seconds,
write_params_cpu params.bin's; on a loaded machine measure these) and the process's peak host memory
(ru_maxrss, which counts the mapped weight pages it holds). Issue 40's targets: under 20 s, <= 3 GB.
The default adapter there is LoRA r=8 (full fine-tuning would write Adam's two states for every weight).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.llama_shaped import LlamaShape, build_llama_shaped  # noqa: E402
from fblc.codegen.compile import compile_model  # noqa: E402
from fblc.codegen.plan import lower  # noqa: E402
from fblc.compiler.adapters import AdapterConfig  # noqa: E402
from fblc.compiler.model_io import load_model  # noqa: E402
from fblc.compiler.optimizers import OptimizerConfig  # noqa: E402
from fblc.compiler.quantize import WEIGHT_FORMATS, WeightFormat  # noqa: E402
from fblc.passes.pipeline import TrainingOptions, build_training_graph  # noqa: E402
from fblc.passes.layout_score import rank_candidates  # noqa: E402
from fblc.profiles import load_profile  # noqa: E402

TARGET_SECONDS = 3.0
END_TO_END_SECONDS, END_TO_END_RSS_GB = 20.0, 3.0  # issue 40: `fblc compile` of the 1B shape, params.bin included


def compile_once(path: str, options: TrainingOptions, target: str) -> dict[str, float]:
    profile = load_profile(target)
    rank_candidates.cache_clear()  # every run scores its tiles from scratch
    started = time.perf_counter()
    passes: dict[str, float] = {}
    last = [started]

    def lap(index: int, graph_pass: object, model: object) -> None:
        now = time.perf_counter()
        passes[getattr(graph_pass, "name", type(graph_pass).__name__)] = now - last[0]
        last[0] = now

    model = load_model(path)
    read = time.perf_counter()
    last[0] = read
    step = build_training_graph(model, options, on_pass=lap, lower=profile)
    built = time.perf_counter()
    program = lower(step, profile, "fp32", with_contents=False)
    done = time.perf_counter()
    layout = sum(passes.get(name, 0.0) for name in ("ftd_taxonomy", "tile_remap", "rtile_select"))
    return {"read": read - started, "passes": built - read - layout, "layout passes": layout,
            "codegen": done - built, "total": done - started, "kernels": float(len(program.kernels)),
            "nodes": float(len(step.graph))}


def compile_end_to_end(path: str, options: TrainingOptions, target: str, out_dir: str) -> dict[str, float]:
    """`fblc compile`'s work, the bundle written to `out_dir`: report.json's timings, the wall total, and the
    process's peak host memory so far (GB)."""
    rank_candidates.cache_clear()
    started = time.perf_counter()
    step, report = compile_model(path, out_dir, target, "fp32", options)
    total = time.perf_counter() - started
    cpu = {f"{name} cpu": seconds for name, seconds in report["timings_cpu"].items()}
    cpu["total cpu"] = sum(report["timings_cpu"].values()) + report["timings"]["write_params_cpu"]
    return {**report["timings"], **cpu, "total": total, "kernels": float(report["kernels"]),
            "nodes": float(len(step.graph)),
            "params GB": os.path.getsize(os.path.join(out_dir, "params.bin")) / 1e9,
            "peak RSS GB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9}


def end_to_end(args: argparse.Namespace, options: TrainingOptions) -> int:
    with tempfile.TemporaryDirectory() as directory:
        path = build_llama_shaped(os.path.join(directory, "llama_shaped.onnx"), LlamaShape(layers=args.layers))
        runs = []
        for repeat in range(args.repeats):
            runs.append(compile_end_to_end(path, options, args.target, os.path.join(directory, "bundle")))
            print(f"  run {repeat + 1}/{args.repeats}: {runs[-1]['total']:.2f} s", file=sys.stderr)
    columns = [c for c in runs[0] if c not in ("kernels", "nodes")]
    print(f"llama-3.2-1b-shaped ({args.layers} layers) `fblc compile` end to end, --target {args.target} --adapter "
          f"{options.adapter.kind} --rank {options.adapter.rank} --weights {options.weights.weights}: "
          f"{int(runs[0]['nodes'])} step nodes, {int(runs[0]['kernels'])} kernels; median of {args.repeats} runs "
          "(seconds: wall, then CPU)")
    for part in ([c for c in columns if not c.endswith(" cpu")], [c for c in columns if c.endswith(" cpu")]):
        print("  ".join(f"{c:>16}" for c in part))
        print("  ".join(f"{statistics.median(r[c] for r in runs):16.3f}" for c in part))
    total, peak = statistics.median(r["total"] for r in runs), max(r["peak RSS GB"] for r in runs)
    print(f"median total {total:.2f} s ({'met' if total < END_TO_END_SECONDS else 'NOT met'}: under "
          f"{END_TO_END_SECONDS:.0f} s); peak host RSS {peak:.2f} GB ({'met' if peak <= END_TO_END_RSS_GB else 'NOT met'}"
          f": <= {END_TO_END_RSS_GB:.0f} GB)")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=None, help="default: 5, under --end-to-end 1")
    parser.add_argument("--target", default="adreno830")
    parser.add_argument("--layout", default="rtile", choices=["rtile", "naive"])
    parser.add_argument("--end-to-end", action="store_true",
                        help="time `fblc compile` through the written bundle (params.bin included), with peak RSS")
    parser.add_argument("--layers", type=int, default=16, help="decoder layers (--end-to-end; default: 16, the 1B)")
    parser.add_argument("--adapter", default=None, help="default: none, under --end-to-end lora")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--weights", default="fp32", choices=WEIGHT_FORMATS,
                        help="frozen weights' storage (--end-to-end; default: fp32)")
    args = parser.parse_args()
    args.repeats = args.repeats or (1 if args.end_to_end else 5)
    adapter = args.adapter or ("lora" if args.end_to_end else "none")
    options = TrainingOptions(loss="cross_entropy", optimizer=OptimizerConfig("adamw", lr=1e-4, weight_decay=0.01),
                              layout=args.layout, weights=WeightFormat(args.weights),
                              adapter=AdapterConfig(adapter, rank=args.rank) if adapter != "none" else AdapterConfig())
    if args.end_to_end:
        return end_to_end(args, options)
    with tempfile.TemporaryDirectory() as directory:
        path = build_llama_shaped(os.path.join(directory, "llama_1b_shaped.onnx"))
        runs = []
        for repeat in range(args.repeats):
            runs.append(compile_once(path, options, args.target))
            print(f"  run {repeat + 1}/{args.repeats}: {runs[-1]['total']:.2f} s", file=sys.stderr)
    columns = ["read", "passes", "layout passes", "codegen", "total"]
    print(f"llama-3.2-1b-shaped training step, --target {args.target} --layout {args.layout}: "
          f"{int(runs[0]['nodes'])} step nodes, {int(runs[0]['kernels'])} kernels; median of {args.repeats} runs")
    print("  ".join(f"{c + ' s':>15}" for c in columns))
    print("  ".join(f"{statistics.median(r[c] for r in runs):15.3f}" for c in columns))
    total = statistics.median(r["total"] for r in runs)
    print(f"median total {total:.2f} s = {total / TARGET_SECONDS:.2f}x the {TARGET_SECONDS:.0f} s target "
          f"({'met' if total < TARGET_SECONDS else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
