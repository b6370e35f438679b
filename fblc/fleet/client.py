"""The fleet's Flower ClientApp: a bundle trains K local steps on the client's own rows and returns what trains.

A train message carries the global trainable tensors (ArrayRecord `arrays`) and the round's config (ConfigRecord
`config`: `server-round`, `local-steps`, and under FedProx `proximal-mu` and `proximal-lr`). The client sets the
tensors on its trainer (fblc.fleet.trainers: built once per process; the optimizer state restarts each round),
trains, and replies with the same tensor names (the bundle's trainable set: under an adapter only the adapter's
tensors, so the frozen model never travels) and a MetricRecord with `num-examples` (its rows: FedAvg's weight),
`train-loss` (the mean of its K losses) and `bytes-up` (the bytes of the arrays it sends). Its rows stay in the
process: they are read from the data file and split as every client splits them (fblc.fleet.data), and only the
trained tensors and those three numbers leave.

FedProx's proximal term mu/2 |w - w_global|^2 is not in the compiled step: after each step the client takes the
term's gradient step, w -= proximal-lr * mu * (w - w_global) (exact for plain SGD at the step's learning rate).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from fblc.fleet.data import LABELS, Rows, batches, held_out, load_rows, partition
from fblc.fleet.trainers import trainer_for
from fblc import bundle_format as fmt


@dataclass(frozen=True)
class FleetSpec:
    """What every client and the server agree on: the bundle, the data and how it is split."""

    bundle: str
    data: str
    clients: int
    partition: str = "iid"
    local_steps: int = 5
    device: str = "graph"
    step: str | None = None
    holdout: float = 0.2
    seed: int = 0

    def inputs(self) -> dict[str, list[int]]:
        """The model inputs the bundle reads (name -> compiled shape), labels left out."""
        return {e["name"]: e["shape"] for e in fmt.load_manifest(self.bundle)["inputs"] if e["name"] != LABELS}

    @property
    def batch(self) -> int:
        return int(next(iter(self.inputs().values()))[0])


_split: dict[FleetSpec, tuple[Rows, Rows, list[np.ndarray]]] = {}


def split(spec: FleetSpec) -> tuple[Rows, Rows, list[np.ndarray]]:
    """(training rows, held-out rows, each client's row indices into the training rows): the same in every process."""
    if spec not in _split:
        train, test = held_out(load_rows(spec.data, spec.inputs()), spec.holdout, spec.seed)
        _split[spec] = (train, test, partition(train.labels, spec.clients, spec.partition, spec.seed))
    return _split[spec]


def client_rows(spec: FleetSpec, client: int) -> Rows:
    train, _, parts = split(spec)
    return train.take(parts[client])


def local_training(spec: FleetSpec, client: int, arrays: Mapping[str, np.ndarray], config: Mapping[str, Any]
                   ) -> tuple[dict[str, np.ndarray], int, float]:
    """Client `client`'s round: (trained tensors, its number of rows, mean loss of its local steps)."""
    trainer = trainer_for(spec.bundle, spec.device, spec.step)
    rows = client_rows(spec, client)
    trainer.set_parameters(arrays)
    steps = int(config.get("local-steps", spec.local_steps))
    mu, lr = float(config.get("proximal-mu", 0.0)), float(config.get("proximal-lr", 0.0))
    round_ = int(config.get("server-round", 0))
    losses = []
    feed = batches(rows, spec.batch, seed=(spec.seed, round_, client))
    for _ in range(steps):
        losses.append(trainer.step(next(feed)))
        if mu > 0:
            now = trainer.parameters()
            trainer.set_parameters({k: v - lr * mu * (v - arrays[k]) for k, v in now.items()}, keep_state=True)
    return trainer.parameters(), len(rows), float(np.mean(losses))


def seed_training(spec: FleetSpec, client: int, arrays: Mapping[str, np.ndarray], config: Mapping[str, Any]
                  ) -> tuple[Any, int, float]:
    """Client `client`'s ES round that sends seeds (`es-iteration` in the config): (its seed report: seed, first
    iteration, member rewards; its number of rows, mean loss). The trainer keeps the model it trained."""
    from fblc.fleet.es_seeds import es_spec

    trainer = trainer_for(spec.bundle, spec.device, spec.step)
    rows = client_rows(spec, client)
    trainer.set_parameters(arrays)
    feed = batches(rows, spec.batch, seed=(spec.seed, int(config.get("server-round", 0)), client))
    steps = [next(feed) for _ in range(int(config.get("local-steps", spec.local_steps)))]
    report, losses = trainer.train_reporting_seeds(steps, int(config["es-iteration"]), es_spec(spec.bundle).seed)
    return report, len(rows), float(np.mean(losses))


def client_app(spec: FleetSpec) -> Any:
    """The ClientApp: each simulated or deployed SuperNode's `partition-id` (node config) picks its rows."""
    from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        arrays = {name: array.numpy() for name, array in message.content["arrays"].items()}
        client, config = int(context.node_config["partition-id"]), message.content["config"]
        extra = {}
        if "es-iteration" in config:  # an ES round that sends seeds: the rewards travel, not the model
            report, examples, loss = seed_training(spec, client, arrays, config)
            trained = {"es.rewards": report.rewards}
            extra = {"es-seed": report.seed, "es-iteration": report.iteration}
        else:
            trained, examples, loss = local_training(spec, client, arrays, config)
        record = ArrayRecord({name: Array(np.ascontiguousarray(value, np.float32)) for name, value in trained.items()})
        sent = sum(len(array.data) for array in record.values()) + 8 * len(extra)
        metrics = MetricRecord({"num-examples": examples, "train-loss": loss, "bytes-up": sent, **extra})
        return Message(RecordDict({"arrays": record, "metrics": metrics}), reply_to=message)

    return app
