"""The fleet's Flower ServerApp: rounds of one of Flower's strategies over the bundle's trainable tensors.

STRATEGIES maps `--strategy` to Flower's own: FedAvg (McMahan et al. 2017: the clients' tensors averaged,
weighted by their `num-examples`), FedProx (FedAvg, with `proximal-mu` sent to the clients, which add the
proximal step: fblc.fleet.client) and FedAdam (Reddi et al. 2021: Adam on the server over the averaged update,
server learning rate `eta`). Each round Flower samples `fraction` of the connected clients (at least
`min_train`), waits for `min_available` to be connected, and aggregates the replies that arrive within
`timeout`; failed replies are logged by Flower and left out. The global model starts from the bundle's own
tensors (params.bin) and after every round is evaluated on held-out rows (fblc.fleet.evaluate); clients do no
evaluation of their own. The round's records (History) hold each client's reply weight, loss and bytes, and with
`keep_replies` the replies' tensors (tests compare the aggregate with a numpy FedAvg of them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from fblc.fleet.evaluate import Evaluator

#: --strategy -> (Flower strategy class name, the ServerSpec fields it takes as keyword arguments)
STRATEGIES: dict[str, tuple[str, dict[str, str]]] = {
    "fedavg": ("FedAvg", {}),
    "fedprox": ("FedProx", {"proximal_mu": "proximal_mu"}),
    "fedadam": ("FedAdam", {"eta": "eta", "eta_l": "lr", "tau": "tau"}),
}


@dataclass(frozen=True)
class ServerSpec:
    rounds: int = 10
    strategy: str = "fedavg"
    fraction: float = 1.0
    min_train: int = 1
    min_available: int = 1
    timeout: float = 3600.0
    local_steps: int = 5
    #: FedProx: mu, and the learning rate of the clients' proximal step (the bundle's --lr)
    proximal_mu: float = 0.01
    lr: float = 0.1
    #: FedAdam: the server's learning rate and adaptivity
    eta: float = 0.01
    tau: float = 1e-3
    #: ES rounds that send seeds: clients report seeds and rewards, the server replays their steps (FedAvg only)
    es_seeds: bool = False


@dataclass
class History:
    """Per round (0: the initial model): evaluation, clients, mean train loss, bytes uploaded, seconds."""

    rounds: list[dict[str, float]] = field(default_factory=list)
    keep_replies: bool = False
    #: round -> [(tensors, num-examples)] of each reply (keep_replies)
    replies: dict[int, list[tuple[dict[str, np.ndarray], int]]] = field(default_factory=dict)
    final: dict[str, np.ndarray] = field(default_factory=dict)
    pending: dict[str, float] = field(default_factory=dict)


def strategy_of(spec: ServerSpec, history: History, seeds: Any = None) -> Any:
    """Flower's strategy for `spec`, its train-metrics aggregation recording each round's replies in `history`;
    with `seeds` (the bundle's fblc.fleet.es_seeds.EsSpec) FedAvg over the models replayed from seed reports."""
    import flwr.serverapp.strategy as strategies
    from flwr.app import MetricRecord, RecordDict

    def train_metrics(records: list[RecordDict], weight_key: str) -> MetricRecord:
        metrics = [next(iter(r.metric_records.values())) for r in records]
        weights = np.array([float(m[weight_key]) for m in metrics])
        sent = [float(m["bytes-up"]) for m in metrics]
        history.pending = {"round": float(len(history.rounds)), "clients": float(len(records)),
                           "examples": float(weights.sum()),
                           "train_loss": float(np.dot(weights, [float(m["train-loss"]) for m in metrics])
                                               / weights.sum()),
                           "bytes_up_per_client": float(np.mean(sent)), "bytes_up": float(np.sum(sent))}
        if history.keep_replies:
            history.replies[len(history.rounds)] = [
                ({k: a.numpy() for k, a in next(iter(r.array_records.values())).items()}, int(m[weight_key]))
                for r, m in zip(records, metrics)]
        return MetricRecord(history.pending)

    if seeds is not None:
        return _seed_strategy(seeds, spec, train_metrics)
    name, extra = STRATEGIES[spec.strategy]
    return getattr(strategies, name)(
        fraction_train=spec.fraction, fraction_evaluate=0.0, min_train_nodes=spec.min_train,
        min_evaluate_nodes=0, min_available_nodes=spec.min_available, train_metrics_aggr_fn=train_metrics,
        **{argument: getattr(spec, source) for argument, source in extra.items()})


def _seed_strategy(seeds: Any, spec: ServerSpec, train_metrics: Callable[..., Any]) -> Any:
    """FedAvg whose clients each get their own ES iterations and send seed reports, which it replays
    (fblc.fleet.rounds.seed_messages, replayed: what `fblc fleet serve --es-seeds` does)."""
    from flwr.serverapp.strategy import FedAvg

    from fblc.fleet.rounds import as_numpy, replayed, seed_messages

    class SeedRounds(FedAvg):
        global_model: dict[str, np.ndarray] = {}  # the round's, which the replays start from

        def configure_train(self, server_round: int, arrays: Any, config: Any, grid: Any) -> Any:
            self.global_model = as_numpy(arrays)
            return seed_messages(super().configure_train(server_round, arrays, config, grid), server_round,
                                 spec.local_steps)

        def aggregate_train(self, server_round: int, replies: Any) -> tuple[Any, Any]:
            good = [m for m in replies if not m.has_error()]  # Flower's log names the failed ones
            if not good:
                return None, None
            return replayed(seeds, self.global_model, good), train_metrics([m.content for m in good], "num-examples")

    return SeedRounds(fraction_train=spec.fraction, fraction_evaluate=0.0, min_train_nodes=spec.min_train,
                      min_evaluate_nodes=0, min_available_nodes=spec.min_available)


def run_rounds(grid: Any, spec: ServerSpec, initial: dict[str, np.ndarray], evaluator: Evaluator,
               history: History, say: Callable[[str], None], seeds: Any = None) -> None:
    """Flower's strategy.start over `grid`, evaluating and recording each round."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord

    clock = {"last": time.perf_counter()}

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        started = time.perf_counter()
        tensors = {name: array.numpy() for name, array in arrays.items()}
        result = evaluator(tensors)
        entry = {"round": float(server_round), "seconds": started - clock["last"], **result}
        if server_round:  # no replies this round (all failed: Flower logs why): no aggregation ran
            replied = history.pending.get("round") == float(server_round)
            entry.update(history.pending if replied else {"clients": 0.0})
        history.rounds.append(entry)
        history.final = tensors
        say(progress_line(entry, spec.rounds))
        clock["last"] = time.perf_counter()
        return MetricRecord(result)

    config = ConfigRecord({"local-steps": spec.local_steps, "proximal-lr": spec.lr})
    strategy = strategy_of(spec, history, seeds)
    strategy.start(grid=grid, initial_arrays=ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in
                                                          initial.items()}),
                   num_rounds=spec.rounds, timeout=spec.timeout, train_config=config, evaluate_fn=evaluate)


def progress_line(entry: dict[str, float], rounds: int) -> str:
    accuracy = f", accuracy {entry['accuracy']:.3f}" if "accuracy" in entry else ""
    if not entry["round"]:
        return f"round 0/{rounds}: held-out loss {entry['loss']:.4f}{accuracy} (the initial model)"
    if not entry["clients"]:
        return (f"round {int(entry['round'])}/{rounds}: no client replied (the global model stays; Flower's log above "
                f"says why), held-out loss {entry['loss']:.4f}{accuracy}")
    return (f"round {int(entry['round'])}/{rounds}: {int(entry['clients'])} clients, train loss "
            f"{entry['train_loss']:.4f}, held-out loss {entry['loss']:.4f}{accuracy}, "
            f"{entry['bytes_up_per_client']:,.0f} B up per client, {entry['seconds']:.2f} s")


def server_app(spec: ServerSpec, initial: dict[str, np.ndarray], evaluator: Evaluator, history: History,
               say: Callable[[str], None], seeds: Any = None) -> Any:
    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp

    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        del context
        run_rounds(grid, spec, initial, evaluator, history, say, seeds)

    return app
