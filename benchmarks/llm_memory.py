"""Memory of LLM-shaped training steps per trainer and frozen-weight format (issue 40, part 6).

    PYTHONPATH=$PWD python benchmarks/llm_memory.py [--shapes 1b,0.5b] [--trainers es,lora,full]
        [--weights fp32,fp16,int8,int4] [--cases 0.5b/lora/int4,...] [--quick] [--time-limit 600]
        [--rss-limit-gb 3] [--device-memory MB] [--weight-group 32] [--dtype fp32|fp16] [--json out.json]
    PYTHONPATH=$PWD python benchmarks/llm_memory.py --adaptation [--steps 40]

Shapes (benchmarks/llama_shaped.py, B=1, T=256, weights in a sparse external file that is never written):
`1b` Llama-3.2-1B (16 layers, hidden 2048, FFN 8192, 32/8 heads, vocab 128256) and `0.5b` a Qwen2.5-0.5B
shape (24 layers, hidden 896, FFN 4864, 14/2 heads, vocab 151936; untied LM head, no QKV biases); `1b-tied`
the 1B shape with the LM head tied to the embedding table (Llama-3.2-1B's tie_word_embeddings; not in the
default --shapes).
Trainers: `es` FuRA-S ES (--trainer es --adapter fura-s --block 64 --pairs 4, SGD), `lora` LoRA r=8 backprop
(Adam), `full` every weight by backprop (Adam). Weight formats: --weights fp32|fp16|int8|int4 (group 32, or
--weight-group N); `--dtype fp16` stores the step's activations in half (fblc compile --dtype);
only frozen contraction weights are quantized, so under `full` they change nothing but what is frozen.

Each case compiles in its own process the way `fblc compile` does (codegen.compile.compile_model) up to the
buffer table, without writing the bundle: params.bin's contents stay lazy (PackedConstant), nothing is packed.
Printed per case: `device` (report.json memory.device_peak: what the runtimes allocate), `live` (the memory
plan's live_peak), the stored bytes by category (report.json weights.bytes: frozen quantized, frozen float, which
includes the Gather-read embedding table, trainable, adapters, optimizer state), trainable values, launches per
step, compile CPU seconds (the case process's CPU time, import and model read included) and the case's host peak
RSS (os.wait4's ru_maxrss, which counts the mapped pages of the weight file that were read: quantizing reads every
frozen weight) and its peak anonymous RSS (/proc RssAnon sampled every 0.5 s: what the compile allocated). A case
past `--time-limit` CPU seconds or `--rss-limit-gb` of anonymous memory is killed and printed as "over limit".
Under the table, each case's live peak broken down (peak_breakdown): frozen quantized weights, FuRA-S's R, other
weights, trained state, activations, and the largest activations live there.
`--device-memory MB` compiles the backprop cases (lora, full) with that budget (`fblc compile --device-memory`:
pass recompute recomputes layers in the backward until the plan fits; a budget under the floor fails naming
it); the table's `budget_MB` column says which rows had one, `recomputed` how many layers pass recompute chose and
`recompute_GFLOP` the forward FLOPs they add to the step.

`--adaptation`: the small pretrained decoder of benchmarks/adaptation.py (a byte-level 2-layer Llama), its
test loss (onnxruntime on the step graph, quantized weights included) with --weights fp32, int8 and int4 before
and after LoRA r=2 fine-tuning on the device (Adam, the same steps and batches for each format), each loss
relative to fp32's (issue 40's target: int4 within 2 % after fine-tuning). The decoder is pretrained (PyTorch) on
first use and cached in --out, shared with `benchmarks/adaptation.py --quick`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.llama_shaped import LlamaShape, build_llama_shaped  # noqa: E402

SHAPES = {
    "1b": LlamaShape(),
    "0.5b": LlamaShape(layers=24, hidden=896, ffn=4864, heads=14, kv_heads=2, vocab=151936),
    "1b-tied": LlamaShape(tied=True),  # Llama-3.2-1B as released: its LM head is the embedding table
}
TRAINERS = ("es", "lora", "full")
WEIGHTS = ("fp32", "fp16", "int8", "int4")
#: --quick: the 0.5B shape, the two adapter trainers, fp32 against int4
QUICK = ("0.5b/es/fp32", "0.5b/es/int4", "0.5b/lora/fp32", "0.5b/lora/int4")
COLUMNS = ("budget_MB", "recomputed", "recompute_GFLOP", "device_MB", "live_MB", "saved_MB", "frozen_q_MB", "frozen_f_MB", "trainable_MB", "adapters_MB", "optimizer_MB",
           "trainable_values", "launches", "compile_cpu_s", "host_rss_GB", "anon_rss_GB")


def step_options(trainer: str, weights: str, budget_mb: float = 0.0, group: int = 32) -> Any:
    from fblc import choices
    from fblc.compiler.adapters import AdapterConfig
    from fblc.compiler.es import EsConfig
    from fblc.compiler.optimizers import OptimizerConfig
    from fblc.compiler.quantize import WeightFormat
    from fblc.passes.pipeline import TrainingOptions

    adam = OptimizerConfig("adam", lr=1e-4)
    by_trainer = {
        "es": dict(trainer="es", adapter=AdapterConfig("fura-s", block=64), es=EsConfig(pairs=4),
                   optimizer=OptimizerConfig("sgd", lr=choices.ES_SGD_LR)),
        "lora": dict(adapter=AdapterConfig("lora", rank=8), optimizer=adam),
        "full": dict(optimizer=adam),
    }
    budget = {"device_memory": int(budget_mb * 1e6)} if budget_mb and trainer != "es" else {}
    return TrainingOptions(loss="cross_entropy", weights=WeightFormat(weights, group=group), **by_trainer[trainer],
                           **budget)


def measure(path: str, trainer: str, weights: str, target: str, budget_mb: str = "0", group: str = "32",
            dtype: str = "fp32") -> dict[str, Any]:
    """One case in this process: compile_model's steps up to the buffer table (no bundle, no params.bin)."""
    import numpy as np

    from fblc.codegen.compile import build_program, launches_per_step
    from fblc.codegen.reports import memory_report
    from fblc.codegen.weight_report import weights_report
    from fblc.compiler.summary import trained_tensors
    from fblc.profiles import load_profile

    options = step_options(trainer, weights, float(budget_mb), int(group))
    profile = load_profile(target)
    # initial contents stay lazy: nothing is packed or read here
    step, program, table, plan = build_program(path, dataclasses.replace(options, dtype=dtype), profile, {})
    memory, _ = memory_report(plan, table)
    stored = weights_report(step, program, memory, weights, options.weights.group)["bytes"]
    trained = sum(int(np.prod(v.shape.numpy())) for v in trained_tensors(step.graph))
    mb = lambda n: round(n / 1e6, 1)  # noqa: E731
    return {"peak": peak_breakdown(plan, table),
            "budget_MB": mb(options.device_memory) if options.device_memory else "-",
            "recomputed": len(plan.recompute.get("layers", [])) if options.device_memory else "-",
            "recompute_GFLOP": round(plan.recompute.get("flops_added", 0) / 1e9, 1) if options.device_memory else "-",
            "device_MB": mb(memory["device_peak"]), "live_MB": mb(memory["live_peak"]),
            "saved_MB": mb(memory["saved"]),
            "frozen_q_MB": mb(stored["frozen_quantized"]), "frozen_f_MB": mb(stored["frozen_float"]),
            "trainable_MB": mb(stored["trainable"]), "adapters_MB": mb(stored["adapters"]),
            "optimizer_MB": mb(stored["optimizer_state"]), "trainable_values": trained,
            "launches": launches_per_step(program), "compile_cpu_s": round(time.process_time(), 1)}


#: a frozen quantized weight's packed integers or scales (`W.q`, `W.scale`; a chunked LM head's slices `W.q/START`)
QUANTIZED_NAME = re.compile(r"\.(q|scale)(/\d+)?( |$)")


def peak_breakdown(plan: Any, table: Any) -> dict[str, Any]:
    """What is live at the plan's live peak (the runtimes' in-place updates merged as memory_report does), in MB by
    category: the frozen quantized weights (their packed integers and scales), FuRA-S's R factors, other weights,
    the trained state (trainable values, ES noise and optimizer state), and the rest (activations and temporaries,
    the largest named with their launch range), so that what decides the peak can be read off."""
    in_place = [name for t in table.textures for name in t.values if name.endswith(".new") and name[:-4] in t.values]
    plan = plan.updated_in_place(in_place)
    live = sum(plan.timeline[cls] for cls in plan.timeline)
    at = int(live.argmax()) if plan.steps else 0
    held = [b for b in plan.buffers if b.first <= at <= b.last]

    def category(b: Any) -> str:
        names = " ".join(b.values or [b.name])
        if b.cls == "weight":
            if QUANTIZED_NAME.search(names):
                return "frozen_quantized"
            return "fura_R" if ".fura_R" in names else "weights_other"
        return "state" if b.cls in ("optimizer", "grad", "input") else "activations"

    sums: dict[str, int] = {}
    for b in held:
        sums[category(b)] = sums.get(category(b), 0) + b.bytes
    largest = sorted((b for b in held if category(b) == "activations"), key=lambda b: -b.bytes)[:6]
    return {"at": plan.labels[at] if plan.steps else "", "launch": at, "launches": plan.steps,
            **{k: round(v / 1e6, 1) for k, v in sorted(sums.items())},
            "largest_activations": [f"{b.name} {b.shape} {b.dtype} {b.bytes / 1e6:.1f} MB [{b.first}, {b.last}]"
                                    for b in largest]}


def cpu_seconds(pid: int) -> float:
    """The process's user + system CPU time so far (/proc/PID/stat), 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def anonymous_bytes(pid: int) -> int:
    """The process's resident anonymous memory (RssAnon): what it allocated, without the mapped file pages (the
    weight file's, which the kernel can drop at any time) that VmRSS and ru_maxrss also count."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_case(path: str, trainer: str, weights: str, target: str, time_limit: float, rss_limit: float,
             budget_mb: float = 0.0, group: int = 32, dtype: str = "fp32") -> dict[str, Any]:
    """The case in a child process, killed past `time_limit` CPU seconds or `rss_limit` bytes of anonymous resident
    memory; its peak RSS from wait4."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:  # files: no pipe fills up
        child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--one", path, trainer, weights, target,
                                  str(budget_mb), str(group), dtype],
                                 stdout=out, stderr=err, text=True)
        started, over, anonymous = time.monotonic(), None, 0
        while True:  # wait4, not poll(): the child's own rusage (its peak RSS) comes with the reaping
            pid, status, usage = os.wait4(child.pid, os.WNOHANG)
            if pid == child.pid:
                code = os.waitstatus_to_exitcode(status)
                break
            if cpu_seconds(child.pid) > time_limit:  # CPU, not wall: the machine is shared
                over = f"over limit: {time_limit:.0f} CPU s"
            anonymous = max(anonymous, anonymous_bytes(child.pid))
            if not over and anonymous > rss_limit:
                over = f"over limit: anonymous RSS > {rss_limit / 1e9:.1f} GB"
            if over:
                child.kill()
                _, _, usage = os.wait4(child.pid, 0)
                code = -9
                break
            time.sleep(0.5)
        child.returncode = code  # reaped here: Popen must not wait for it again
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    rss = {"host_rss_GB": round(usage.ru_maxrss * 1024 / 1e9, 2), "anon_rss_GB": round(anonymous / 1e9, 2), "wall_s": round(time.monotonic() - started, 1)}
    if over:
        return {"status": over, **rss}
    if code != 0:
        return {"status": "failed: " + (stderr.strip().splitlines() or ["?"])[-1][:300], **rss}
    return {"status": "ok", **json.loads(stdout.strip().splitlines()[-1]), **rss}


def chosen_cases(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    if args.cases or args.quick:
        names = args.cases.split(",") if args.cases else list(QUICK)
        cases = [tuple(name.split("/")) for name in names]
        for case in cases:
            if len(case) != 3 or case[0] not in SHAPES or case[1] not in TRAINERS or case[2] not in WEIGHTS:
                raise SystemExit(f"--cases: '{'/'.join(case)}' is not SHAPE/TRAINER/WEIGHTS with SHAPE in "
                                 f"{list(SHAPES)}, TRAINER in {list(TRAINERS)}, WEIGHTS in {list(WEIGHTS)}")
        return cases  # type: ignore[return-value]
    return [(s, t, w) for s in args.shapes.split(",") for t in args.trainers.split(",") for w in args.weights.split(",")]


def print_table(rows: list[dict[str, Any]]) -> None:
    head = f"{'case':<16}" + "".join(f"{c:>{max(len(c) + 2, 9)}}" for c in COLUMNS)
    print(head)
    for row in rows:
        name = f"{row['shape']}/{row['trainer']}/{row['weights']}"
        if row["status"] != "ok":
            print(f"{name:<16}  {row['status']} (after {row['wall_s']} s, host RSS {row['host_rss_GB']} GB, "
                  f"anonymous {row['anon_rss_GB']} GB)")
            continue
        print(f"{name:<16}" + "".join(f"{row[c]:>{max(len(c) + 2, 9)}}" for c in COLUMNS))
    for row in rows:
        if row["status"] == "ok" and "peak" in row:
            peak = row["peak"]
            parts = ", ".join(f"{k} {v}" for k, v in peak.items() if isinstance(v, float))
            print(f"{row['shape']}/{row['trainer']}/{row['weights']}: live peak at launch {peak['launch']} of "
                  f"{peak['launches']} ({peak['at']}), MB: {parts}; largest: {'; '.join(peak['largest_activations'][:2])}")


def adaptation_rows(steps: int, lr: float, folder: str) -> list[dict[str, Any]]:
    """The quick adaptation benchmark's pretrained decoder, LoRA r=2 on top of fp32, int8 and int4 frozen weights:
    held-out test loss (onnxruntime on the step's own graph, the quantized weights included) before and after
    `steps` Adam steps on the device (LocalRunner, buffer storage), the same batches in the same order each time."""
    import numpy as np

    from benchmarks.adaptation import QUICK as SCALE, Evaluator
    from benchmarks.adaptation_models import decoder_task
    from fblc.codegen.compile import compile_model
    from fblc.compiler.adapters import AdapterConfig
    from fblc.compiler.optimizers import OptimizerConfig
    from fblc.compiler.quantize import WeightFormat
    from fblc.passes.pipeline import TrainingOptions
    from fblc.runtime.local import LocalRunner

    os.makedirs(folder, exist_ok=True)
    task = decoder_task(folder, SCALE.decoder_batch, SCALE.decoder_length, SCALE.decoder_pretrain_steps,
                        SCALE.eval_batches)
    rows: list[dict[str, Any]] = []
    for weights in ("fp32", "int8", "int4"):
        options = TrainingOptions(adapter=AdapterConfig("lora", rank=2, seed=0), optimizer=OptimizerConfig("adam", lr=lr),
                                  weights=WeightFormat(weights))
        evaluate = Evaluator(task, options)
        with tempfile.TemporaryDirectory() as scratch:
            bundle = os.path.join(scratch, "bundle")
            _, report = compile_model(task.path, bundle, "local", "fp32", options)
            runner = LocalRunner(bundle, storage="buffer", progress=False)
            before = evaluate(runner.parameters(), "test")[0]
            train = task.batches["train"]
            order = np.random.default_rng(0).permutation(len(train))
            for k in range(steps):
                inputs, labels = train[order[k % len(train)]]
                runner.step({task.input_name: inputs, "labels": labels})
            after = evaluate(runner.parameters(), "test")[0]
        rows.append({"weights": weights, "loss_before": round(before, 4), "loss_after": round(after, 4),
                     "device_MB": round(report["memory"]["device_peak"] / 1e6, 3),
                     "max_weight_error": max((q.get("error", 0.0) for q in report["weights"]["quantized"]),
                                             default=0.0)})
    base = rows[0]
    print(f"pretrained decoder (benchmarks/adaptation.py --quick's), LoRA r=2 Adam lr {lr:g}, {steps} steps; "
          "held-out test loss; vs fp32 in %")
    print(f"{'weights':<8}{'before':>9}{'vs fp32':>9}{'after':>9}{'vs fp32':>9}{'device_MB':>11}{'max rel. error':>16}")
    for row in rows:
        row["before_vs_fp32_pct"] = round(100 * (row["loss_before"] / base["loss_before"] - 1), 2)
        row["after_vs_fp32_pct"] = round(100 * (row["loss_after"] / base["loss_after"] - 1), 2)
        print(f"{row['weights']:<8}{row['loss_before']:>9.4f}{row['before_vs_fp32_pct']:>+8.2f}%{row['loss_after']:>9.4f}"
              f"{row['after_vs_fp32_pct']:>+8.2f}%{row['device_MB']:>11.3f}{row['max_weight_error']:>16.4f}")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="1b,0.5b", help=f"comma-separated: {', '.join(SHAPES)}")
    parser.add_argument("--trainers", default=",".join(TRAINERS), help=f"comma-separated: {', '.join(TRAINERS)}")
    parser.add_argument("--weights", default=",".join(WEIGHTS), help=f"comma-separated: {', '.join(WEIGHTS)}")
    parser.add_argument("--cases", default=None, help="SHAPE/TRAINER/WEIGHTS,... (e.g. 1b/lora/int4) instead")
    parser.add_argument("--quick", action="store_true", help=f"the cases {', '.join(QUICK)}")
    parser.add_argument("--target", default="adreno830")
    parser.add_argument("--time-limit", type=float, default=600.0, help="CPU seconds per case (default 600)")
    parser.add_argument("--rss-limit-gb", type=float, default=3.0, help="anonymous resident memory per case (default 3)")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--device-memory", type=float, default=0.0, metavar="MB",
                        help="a device-memory budget for the backprop cases (fblc compile --device-memory)")
    parser.add_argument("--adaptation", action="store_true", help="the quantized pretrained decoder's loss instead")
    parser.add_argument("--steps", type=int, default=40, help="--adaptation: LoRA fine-tuning steps")
    parser.add_argument("--lr", type=float, default=1e-2, help="--adaptation: Adam's learning rate (default 1e-2)")
    parser.add_argument("--out", default="runs/adaptation", help="--adaptation: the pretrained decoder's cache "
                        "(benchmarks/adaptation.py --quick's)")
    parser.add_argument("--weight-group", type=int, default=32, help="--weight-group of the quantized formats (default 32)")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "fp16"),
                        help="the step's storage precision (fblc compile --dtype; default fp32)")
    parser.add_argument("--one", nargs=7, metavar=("MODEL", "TRAINER", "WEIGHTS", "TARGET", "BUDGET", "GROUP", "DTYPE"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(*args.one)))
        return 0
    if args.adaptation:
        rows = adaptation_rows(args.steps, args.lr, args.out)
    else:
        rows = []
        with tempfile.TemporaryDirectory() as directory:
            paths: dict[str, str] = {}
            for shape, trainer, weights in chosen_cases(args):
                if shape not in paths:
                    paths[shape] = build_llama_shaped(os.path.join(directory, f"llm_{shape}.onnx"), SHAPES[shape])
                row = {"shape": shape, "trainer": trainer, "weights": weights,
                       **run_case(paths[shape], trainer, weights, args.target, args.time_limit,
                                  args.rss_limit_gb * 1e9, args.device_memory, args.weight_group, args.dtype)}
                print(json.dumps(row), file=sys.stderr, flush=True)
                rows.append(row)
        print(f"--target {args.target}, --dtype {args.dtype}, --weight-group {args.weight_group}, B=1 T=256; "
              "MB = 1e6 bytes; frozen_q includes the embedding table (Gather-read, quantized like the rest)")
        print_table(rows)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)
    return 0


if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    raise SystemExit(main())
