"""Issue 43's targets for a fleet on Flower, one table: scikit-learn's digits, examples/fleet_digits.py's CNN
compiled for adreno830, clients in Flower's simulation engine in graph mode (the step ONNX in onnxruntime).

    PYTHONPATH=$PWD python benchmarks/fleet.py [--rounds 40] [--local-steps 20] [--folder runs/fleet_bench]

Rows:
- full fine-tuning, 20 clients, Dirichlet(0.5) split, every client every round: the fleet's held-out accuracy
  after ROUNDS rounds against the same trainer trained centrally for the same number of steps in total
  (rounds x 20 x K); target: within 2 points;
- MemFLoRA and LoRA (rank 2): the CNN first trained centrally on upright digits (the full bundle's step,
  `--pretrain` steps, exported with `fblc export`'s merge), then a fleet of 20 clients (Dirichlet 0.5) adapts it
  to the digits turned by 45 degrees; bytes each client uploads per round (Flower's serialized arrays) against
  the model's weights; target: <= 1 %;
- 100 clients, 5 rounds of 5 steps, IID, full fine-tuning, every client every round: seconds per round (round 1
  includes Ray's start, reported apart), on this machine's cores.
- ES rounds that send seeds (`--trainer es --adapter fura-s`, 15 pairs, SGD): two clients train K steps from the
  pretrained CNN on the local OpenCL device (PoCL) and send their Philox seed, first iteration and member rewards;
  the server's replay of those (fblc.fleet.es_seeds) against the FedAvg of the models the clients trained, and the
  bytes each sends (Flower's serialized arrays and its five metrics) against sending its model; target: <= 1 KB.
- The same ES bundle in `fblc fleet simulate --es-seeds` (graph mode: the ES step ONNX in onnxruntime, its noise
  numpy's Philox twin): 10 clients (Dirichlet 0.5) adapt the pretrained CNN to the turned digits, every reply a
  seed report, every round's model the server's replay; accuracy, bytes per client per round and seconds per round
  against the same number of ES steps trained centrally.
`--rows full,adapters,hundred,es,es-sim` picks rows (all by default; ~15 minutes on 2 shared cores).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

from fleet_digits import build_digits_cnn, digits  # noqa: E402

from fblc.cli import main as fblc  # noqa: E402
from fblc.compiler.model_io import save_model_atomically  # noqa: E402
from fblc.fleet import report  # noqa: E402
from fblc.fleet.client import FleetSpec, split  # noqa: E402
from fblc.fleet.data import batches  # noqa: E402
from fblc.fleet.server import ServerSpec  # noqa: E402
from fblc.fleet.simulate import central, simulate  # noqa: E402
from fblc.fleet.trainers import initial_parameters, trainer_for  # noqa: E402
from fblc.tools.export import exported_model  # noqa: E402

LR = "0.1"


def bundle(folder: str, model: str, name: str, *flags: str) -> tuple[str, str]:
    """Compile `model` for adreno830 and write its step ONNX with the same options: (bundle, step)."""
    out, step = os.path.join(folder, name), os.path.join(folder, f"{name}.step.onnx")
    options = ["--optimizer", "sgd", "--lr", LR, *flags, "-q"]
    if not os.path.isdir(out):
        assert fblc(["compile", model, "--target", "adreno830", "-o", out, "--force", *options]) == 0
    if not os.path.isfile(step):
        assert fblc(["train-graph", model, "-o", step, *options]) == 0
    return out, step


def pretrained(folder: str, full: tuple[str, str], data: str, steps: int) -> str:
    """The CNN trained centrally on upright digits for `steps` steps, as ONNX (the adapters' frozen base)."""
    path = os.path.join(folder, "digits_cnn_pretrained.onnx")
    if os.path.isfile(path):
        return path
    spec = FleetSpec(full[0], data, 1, device="graph", step=full[1])
    trainer = trainer_for(spec.bundle, "graph", spec.step)
    trainer.set_parameters(initial_parameters(spec.bundle))
    feed = batches(split(spec)[0], spec.batch, seed=7)
    for _ in range(steps):
        trainer.step(next(feed))
    model, _ = exported_model(spec.bundle, trainer.parameters(), "pretraining")
    save_model_atomically(model, path)
    return path


def run(spec: FleetSpec, server: ServerSpec, with_central: bool = True) -> dict[str, Any]:
    started = time.perf_counter()
    history = simulate(spec, server, say=lambda line: print("  " + line, flush=True))
    seconds = time.perf_counter() - started
    reference = central(spec, server, say=lambda line: print("  " + line, flush=True)) if with_central else None
    rounds = history.rounds
    return {"rounds": rounds, "central": reference, "seconds": seconds, "model_bytes": report.model_bytes(spec.bundle),
            "first_round_s": rounds[1]["seconds"],
            "later_round_s": float(np.mean([r["seconds"] for r in rounds[2:]])) if len(rounds) > 2 else float("nan")}


def es_seed_row(folder: str, base: str, data: str, steps: int) -> list[str]:
    """ES rounds that send seeds, 2 clients x `steps` local steps on PoCL: the replay's error and the bytes sent."""
    from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict

    from fblc.fleet import es_seeds
    from fblc.fleet.rounds import as_record, payload_bytes

    print("ES (fura-s, 15 pairs) rounds that send seeds, 2 clients on the local OpenCL device", flush=True)
    made, _ = es_bundle(folder, base)
    spec = es_seeds.es_spec(made)
    fleet = FleetSpec(made, data, 2, "iid", steps, "local")
    start = initial_parameters(made)
    trainer = trainer_for(made, "local")
    started = time.perf_counter()
    reports, models, sent, models_sent = [], [], [], []
    for client in range(2):
        rows = split(fleet)[0].take(split(fleet)[2][client])
        feed = batches(rows, fleet.batch, seed=client)
        trainer.set_parameters(start)
        iteration = es_seeds.iteration_base(1, client, steps, 2)
        report_, _ = es_seeds.train_reporting_seeds(trainer.runner, [next(feed) for _ in range(steps)], steps,
                                                    iteration, spec.seed)
        reports.append((report_, len(rows)))
        models.append((trainer.parameters(), len(rows)))
        metrics = {"num-examples": len(rows), "train-loss": 0.0, "bytes-up": 0, "es-seed": spec.seed,
                   "es-iteration": iteration}
        sent.append(payload_bytes(RecordDict({"arrays": ArrayRecord({"es.rewards": Array(report_.rewards)}),
                                              "metrics": MetricRecord(metrics)})))
        models_sent.append(payload_bytes(RecordDict({"arrays": as_record(models[-1][0]),
                                                     "metrics": MetricRecord(dict(list(metrics.items())[:3]))})))
    seconds = time.perf_counter() - started
    rebuilt = es_seeds.aggregate(spec, start, reports)
    total = sum(rows for _, rows in models)
    error = max(float(np.abs(rebuilt[name] - sum(m[name].astype(np.float64) * rows / total for m, rows in models)
                             ).max()) for name in start)
    return [f"ES seeds, fura-s, 15 pairs, 2 clients (replay error {error:.1e})", f"1 x 2 x {steps}", "", "",
            f"{max(sent):,} (model: {max(models_sent):,})", f"{seconds / 2:.2f} per client",
            "ES with seeds <= 1 KB", "met" if max(sent) <= 1024 else "not met"]


def es_bundle(folder: str, base: str) -> tuple[str, str]:
    """The pretrained CNN with FuRA-S trained by ES (15 pairs, SGD) for adreno830, and its step ONNX."""
    made, step = os.path.join(folder, "es"), os.path.join(folder, "es.step.onnx")
    flags = ["--trainer", "es", "--adapter", "fura-s", "--pairs", "15", "--es-optimizer", "sgd", "--lr", LR, "-q"]
    if not os.path.isdir(made):
        assert fblc(["compile", base, "--target", "adreno830", "-o", made, "--force", *flags]) == 0
    if not os.path.isfile(step):
        assert fblc(["train-graph", base, "-o", step, *flags]) == 0
    return made, step


def es_simulated_row(folder: str, base: str, data: str, rounds: int, steps: int) -> list[str]:
    """`fblc fleet simulate --es-seeds` in graph mode, 10 clients: accuracy, bytes and seconds per round."""
    print("ES (fura-s, 15 pairs) rounds that send seeds, 10 simulated clients, dirichlet:0.5, graph mode", flush=True)
    made, step = es_bundle(folder, base)
    spec = FleetSpec(made, data, 10, "dirichlet:0.5", steps, "graph", step)
    result = run(spec, ServerSpec(rounds=rounds, local_steps=steps, es_seeds=True))
    first, last, central_ = result["rounds"][0], result["rounds"][-1], result["central"][-1]
    sent = last["bytes_up_per_client"]
    return ["ES seeds simulated, fura-s, 15 pairs, 10 clients", f"{rounds} x 10 x {steps}",
            f"{first['accuracy']:.3f} -> {last['accuracy']:.3f}", f"{central_['accuracy']:.3f}",
            f"{sent:,.0f} ({100 * sent / result['model_bytes']:.3f} %)", f"{result['later_round_s']:.2f}",
            "ES with seeds <= 1 KB", "met" if sent <= 1024 else "not met"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default=os.path.join(ROOT, "runs", "fleet_bench"))
    parser.add_argument("--rounds", type=int, default=40, help="rounds of the 20-client rows (default 40)")
    parser.add_argument("--local-steps", type=int, default=20, help="K of the 20-client rows (default 20)")
    parser.add_argument("--pretrain", type=int, default=600, help="central steps of the adapters' base model")
    parser.add_argument("--adapter-rounds", type=int, default=10, help="rounds of the adapter rows (default 10)")
    parser.add_argument("--es-rounds", type=int, default=10, help="rounds of the simulated ES row (default 10)")
    parser.add_argument("--rows", default="full,adapters,hundred,es,es-sim", help="which rows (default all five)")
    args = parser.parse_args()
    os.makedirs(args.folder, exist_ok=True)
    model = build_digits_cnn(os.path.join(args.folder, "digits_cnn.onnx"), batch=16)
    upright, turned = os.path.join(args.folder, "digits.npz"), os.path.join(args.folder, "digits_45.npz")
    np.savez(upright, **digits())
    np.savez(turned, **digits(45.0))
    full = bundle(args.folder, model, "full")
    rows: list[list[str]] = []
    kinds = set(args.rows.split(","))
    if "full" in kinds:
        full_row(args, full, upright, rows)
    if "adapters" in kinds:
        adapter_rows(args, full, upright, turned, rows)
    if "hundred" in kinds:
        hundred_row(full, upright, rows)
    if "es" in kinds:
        rows.append(es_seed_row(args.folder, pretrained(args.folder, full, upright, args.pretrain), turned, steps=5))
    if "es-sim" in kinds:
        rows.append(es_simulated_row(args.folder, pretrained(args.folder, full, upright, args.pretrain), turned,
                                     args.es_rounds, steps=5))
    head = ["case", "rounds x clients x K", "fleet acc.", "central acc.", "B up/client/round (% model)",
            "s/round", "target", "result"]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    print()
    for row in [head, *rows]:
        print(" | ".join(cell.ljust(width) for cell, width in zip(row, widths)))
    print(f"model: examples/fleet_digits.py CNN, {report.model_bytes(full[0]):,} B of fp32 weights; "
          f"{os.cpu_count()} CPUs")
    return 0


def full_row(args: argparse.Namespace, full: tuple[str, str], upright: str, rows: list[list[str]]) -> None:
    print("full fine-tuning, 20 clients, dirichlet:0.5", flush=True)
    spec = FleetSpec(full[0], upright, 20, "dirichlet:0.5", args.local_steps, "graph", full[1])
    result = run(spec, ServerSpec(rounds=args.rounds, local_steps=args.local_steps))
    fleet_acc, central_acc = result["rounds"][-1]["accuracy"], result["central"][-1]["accuracy"]
    rows.append(["full, 20 clients, dirichlet:0.5", f"{args.rounds} x 20 x {args.local_steps}",
                 f"{fleet_acc:.3f}", f"{central_acc:.3f}",
                 f"{result['rounds'][-1]['bytes_up_per_client']:,.0f} "
                 f"({100 * result['rounds'][-1]['bytes_up_per_client'] / result['model_bytes']:.1f} %)",
                 f"{result['later_round_s']:.2f}", "accuracy within 2 points of central",
                 "met" if central_acc - fleet_acc <= 0.02 else f"not met ({100 * (central_acc - fleet_acc):.1f})"])


def adapter_rows(args: argparse.Namespace, full: tuple[str, str], upright: str, turned: str,
                 rows: list[list[str]]) -> None:
    base = pretrained(args.folder, full, upright, args.pretrain)
    for adapter in ("memflora", "lora"):
        print(f"{adapter} rank 2 on the pretrained CNN, 20 clients, dirichlet:0.5, digits turned 45 degrees",
              flush=True)
        made = bundle(args.folder, base, adapter, "--adapter", adapter, "--rank", "2")
        spec = FleetSpec(made[0], turned, 20, "dirichlet:0.5", args.local_steps, "graph", made[1])
        result = run(spec, ServerSpec(rounds=args.adapter_rounds, local_steps=args.local_steps))
        sent = result["rounds"][-1]["bytes_up_per_client"]
        share = 100 * sent / result["model_bytes"]
        rows.append([f"{adapter} r=2, 20 clients, dirichlet:0.5 (45 deg)",
                     f"{args.adapter_rounds} x 20 x {args.local_steps}",
                     f"{result['rounds'][0]['accuracy']:.3f} -> {result['rounds'][-1]['accuracy']:.3f}",
                     f"{result['central'][-1]['accuracy']:.3f}", f"{sent:,.0f} ({share:.2f} %)",
                     f"{result['later_round_s']:.2f}", "bytes/client/round <= 1 % of the model",
                     "met" if share <= 1.0 else "not met"])


def hundred_row(full: tuple[str, str], upright: str, rows: list[list[str]]) -> None:
    print("full fine-tuning, 100 clients, iid, every client every round, 5 rounds of 5 steps", flush=True)
    spec = FleetSpec(full[0], upright, 100, "iid", 5, "graph", full[1])
    result = run(spec, ServerSpec(rounds=5, local_steps=5), with_central=False)
    last = result["rounds"][-1]
    rows.append(["full, 100 clients, iid", "5 x 100 x 5", f"{last['accuracy']:.3f}", "",
                 f"{last['bytes_up_per_client']:,.0f} (100 clients: {last['bytes_up'] / 1e6:.1f} MB)",
                 f"{result['later_round_s']:.2f} (round 1: {result['first_round_s']:.1f})",
                 "time per round (graph mode, this machine)", "reported"])


if __name__ == "__main__":
    sys.exit(main())
