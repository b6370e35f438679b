"""Activations that fit: the memory plan of a Llama-shaped step with the loss over vocabulary chunks and with
checkpointing against a --device-memory budget (issue 40, part 5). Compile only (the plan; no bundle written).

    PYTHONPATH=$PWD python benchmarks/activation_memory.py --hidden 2048 --ffn 8192 --adapter lora \
        --budgets 2750

For each case: live_peak, saved bytes, launches, and with a budget the layers recomputed and FLOPs added.
The model is benchmarks/llama_shaped.py's (sparse weights: no gigabytes of host memory for them; the real
vocabulary, 128256, by default). `--loss-chunk 0` is the step before chunking.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.llama_shaped import LlamaShape, build_llama_shaped  # noqa: E402
from fblc.compiler.adapters import AdapterConfig  # noqa: E402
from fblc.compiler.model_io import load_model  # noqa: E402
from fblc.compiler.optimizers import OptimizerConfig  # noqa: E402
from fblc.errors import FblcError  # noqa: E402
from fblc.passes.memory_plan import check_budget, plan_memory  # noqa: E402
from fblc.passes.pipeline import TrainingOptions, build_training_graph  # noqa: E402
from fblc.profiles import load_profile  # noqa: E402


def measure(path: str, adapter: str, chunk: int, budget_mb: float, target: str) -> dict[str, object]:
    options = TrainingOptions(adapter=AdapterConfig(adapter, rank=8), optimizer=OptimizerConfig(name="adam"),
                              loss_chunk=chunk, device_memory=int(budget_mb * 1e6))
    started = time.process_time()
    try:
        plan = plan_memory(build_training_graph(load_model(path), options, lower=load_profile(target)))
        if options.device_memory:  # the lowered plan's live peak (fblc compile checks the bundle's allocation too)
            check_budget(plan, options.device_memory)
    except FblcError as refused:
        return {"loss_chunk": chunk, "budget_MB": budget_mb, "refused": str(refused)}
    summary = plan.summary()
    recompute = summary.get("recompute", {})
    return {"loss_chunk": chunk, "budget_MB": budget_mb, "live_peak_MB": round(summary["live_peak"] / 1e6, 1),
            "saved_MB": round(summary["saved"] / 1e6, 1), "weights_MB": round(summary["weights"] / 1e6, 1),
            "launches": summary["launches"], "layers_recomputed": len(recompute.get("layers", [])),
            "gflops_added": round(recompute.get("flops_added", 0) / 1e9, 2), "cpu_s": round(time.process_time() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--adapter", default="lora", help="lora or none (full fine-tuning)")
    parser.add_argument("--budgets", type=float, nargs="*", default=[], metavar="MB",
                        help="--device-memory budgets to plan for, each with the chunked loss")
    parser.add_argument("--target", default="adreno830")
    parser.add_argument("--one", nargs=3, metavar=("MODEL", "CHUNK", "BUDGET"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:  # one case in its own process: the host memory of one compile is all a case holds
        print(json.dumps(measure(args.one[0], args.adapter, int(args.one[1]), float(args.one[2]), args.target)))
        return 0
    shape = LlamaShape(layers=args.layers, hidden=args.hidden, ffn=args.ffn, heads=max(args.hidden // 64, 1),
                       kv_heads=max(args.hidden // 256, 1), vocab=args.vocab, seq=args.seq)
    with tempfile.TemporaryDirectory() as directory:
        path = build_llama_shaped(os.path.join(directory, "llama.onnx"), shape)
        for chunk, budget in [(0, 0.0), (-1, 0.0)] + [(-1, b) for b in args.budgets]:
            case = subprocess.run([sys.executable, os.path.abspath(__file__), "--adapter", args.adapter, "--target",
                                   args.target, "--one", path, str(chunk), str(budget)],
                                  check=True, capture_output=True, text=True)
            print(json.dumps({"shape": f"{args.layers}L h{args.hidden} ffn{args.ffn} V{args.vocab} T{args.seq}",
                              "adapter": args.adapter, **json.loads(case.stdout.strip().splitlines()[-1])}),
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
