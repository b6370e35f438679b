"""What batching an ES step's members would cost: launches per step, and one member's live bytes in the loop body.

    python benchmarks/es_members.py MODEL.onnx [--pairs 1 16] [--block 64] [--weights int4] [--target adreno830]

Compiles MODEL with `--trainer es --adapter fura-s` at each P of --pairs and prints, per P, report.json's `kernels`
(the plan's launch records) and `launches_per_step` (what a step enqueues: the loop body once per member, 2P
times), the plan's loop, and from the step's memory plan (its buffers: class, bytes, first and last launch) the
largest non-weight bytes live at one launch of the loop body: `member_local` (buffers made and freed inside the
body: what each member batched into one launch would add), `carried` (live across the body: the loop's
accumulators, the inputs). Issue 40 asks whether 2P members per launch fit its 0.8 GB target: a batch holds 2P x
member_local at once.
The 1B-shaped model: benchmarks/llama_shaped.py (4.9 GB of sparse
external data; each compile writes a bundle of that size in a scratch folder, removed after).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fblc.cli import build_parser  # noqa: E402
from fblc.cli.options import training_options  # noqa: E402
from fblc.codegen.compile import compile_model  # noqa: E402
from fblc.compiler import keys  # noqa: E402
from fblc.compiler.es_loop import BODY  # noqa: E402
from fblc.passes.memory_plan import launch_schedule, plan_memory  # noqa: E402


def body_bytes(step: object) -> dict[str, int]:
    """The loop body's launches and the largest non-weight bytes live at one of them (the memory plan's buffers),
    split by whether the buffer lives inside the body only (member_local) or across it (carried)."""
    graph = step.graph  # type: ignore[attr-defined]
    index, steps, _, _ = launch_schedule(graph)
    body = [index[id(n)] for n in graph if n.metadata_props.get(keys.LOOP_PHASE) == BODY and id(n) in index]
    first, last = min(body), max(body)
    local, carried = [0] * steps, [0] * steps
    for buffer in plan_memory(step).buffers:  # type: ignore[arg-type]
        if buffer.cls == "weight":
            continue
        into = local if first <= buffer.first and buffer.last <= last else carried
        for launch in range(max(buffer.first, first), min(buffer.last, last) + 1):
            into[launch] += buffer.bytes
    span = range(first, last + 1)
    return {"member_local": max(local[k] for k in span), "carried": max(carried[k] for k in span),
            "live": max(local[k] + carried[k] for k in span)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--pairs", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--block", default="64")
    parser.add_argument("--weights", default="fp32")
    parser.add_argument("--target", default="adreno830")
    args = parser.parse_args()
    for pairs in args.pairs:
        with tempfile.TemporaryDirectory() as scratch:
            out = os.path.join(scratch, "bundle")
            cli = build_parser().parse_args(["compile", args.model, "--target", args.target, "--trainer", "es",
                                             "--adapter", "fura-s", "--block", args.block, "--pairs", str(pairs),
                                             "--weights", args.weights, "-o", out])
            step, report = compile_model(args.model, out, args.target, "fp32", training_options(cli))
            with open(os.path.join(out, "plan.json")) as handle:
                loops = [{k: loop[k] for k in ("begin", "end", "count")} for loop in json.load(handle)["loops"]]
        memory = report["memory"]
        print(json.dumps({"P": pairs, "kernels": report["kernels"], "launches_per_step": report["launches_per_step"],
                          "loops": loops, **body_bytes(step), "weights": memory["weights"],
                          "device_peak": memory["device_peak"]}), flush=True)


if __name__ == "__main__":
    main()
