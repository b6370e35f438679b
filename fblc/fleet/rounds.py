"""The ServerApp's strategies for a deployment: Flower's FedAvg that says which clients a round left out and why,
records each round, and the same for ES rounds whose clients send seeds.

Flower's FedAvg already survives a client that fails (its reply is an error message, aggregated around) or never
answers (`Grid.send_and_receive` returns at the round's timeout with what came); it logs the errors but not the
silent nodes. `LoggedFedAvg` compares the nodes it sampled with the replies and logs every node left out with
its reason (its error, or no reply within the timeout), refuses to average a reply whose tensors are not the
global model's (a client of another bundle would corrupt the round), and writes each round's aggregate and a
JSON line (clients, failures, bytes uploaded per client, mean train loss) to the run's folder.
"""

from __future__ import annotations

import json
import os
from logging import INFO, WARNING
from typing import Any, Iterable, Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAdam, FedAvg, FedProx

from fblc.fleet import es_seeds
from fblc.fleet.bundle_params import ModelMismatch, check_tensors

#: the reply's MetricRecord keys a client sends (no other metric leaves a client)
EXAMPLES, LOSS, BYTES_UP, ES_SEED, ES_ITERATION = "num-examples", "train-loss", "bytes-up", "es-seed", "es-iteration"
REWARDS = "es.rewards"


def payload_bytes(content: RecordDict) -> int:
    """Bytes of the arrays and metrics in a message's content: what a client uploads, before transport framing."""
    arrays = sum(len(a.data) for record in content.array_records.values() for a in record.values())
    return arrays + 8 * sum(len(record) for record in content.metric_records.values())


def as_numpy(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {name: array.numpy() for name, array in record.items()}


def as_record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({name: Array(np.ascontiguousarray(value)) for name, value in arrays.items()})


class Logged:
    """Put before one of Flower's FedAvg family (FedAvg, FedProx, FedAdam: their aggregate_train filters through
    FedAvg's): logs every client a round left out and why, averages only the replies that fit, records the rounds."""

    def __init__(self, manifest: Mapping[str, Any], out: str, timeout: float, keep_replies: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(fraction_evaluate=0.0, min_evaluate_nodes=0, **kwargs)  # type: ignore[call-arg]
        self.manifest, self.out, self.timeout, self.keep_replies = manifest, out, timeout, keep_replies
        self.sampled: dict[int, list[int]] = {}
        self.sent: dict[int, list[Message]] = {}
        self.start_arrays: dict[int, dict[str, np.ndarray]] = {}

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
                        ) -> Iterable[Message]:
        messages = list(super().configure_train(server_round, arrays, config, grid))  # type: ignore[misc]
        self.sampled[server_round] = [m.metadata.dst_node_id for m in messages]
        self.sent[server_round] = messages  # the Grid gives each its message id when it pushes it
        self.start_arrays[server_round] = as_numpy(arrays)
        return messages

    def usable(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        """The replies to average; every sampled node left out is logged with its reason."""
        replies = list(replies)
        # the node a reply answers for: the SuperLink's own error replies (a node that stopped sending heartbeats)
        # come from the SuperLink, not the node
        to_node = {(m.metadata.message_id or m.object_id): m.metadata.dst_node_id
                   for m in self.sent.get(server_round, [])}
        node_of = {id(m): to_node.get(m.metadata.reply_to_message_id, m.metadata.src_node_id) for m in replies}
        answered = set(node_of.values())
        for node in self.sampled.get(server_round, []):
            if node not in answered:
                log(WARNING, "round %d: node %d left out: no reply within the round's timeout of %g s "
                    "(disconnected, or still training)", server_round, node, self.timeout)
        good = []
        for message in replies:
            node = node_of[id(message)]
            if message.has_error():
                log(WARNING, "round %d: node %d left out: its ClientApp failed: %s", server_round, node,
                    message.error.reason.strip().splitlines()[-1] if message.error.reason else "(no reason given)")
                continue
            try:
                self.check_reply(message.content)
            except ModelMismatch as error:
                log(WARNING, "round %d: node %d left out: %s", server_round, node, error.one_line())
                continue
            good.append(message)
        return good

    def check_reply(self, content: RecordDict) -> None:
        check_tensors(self.manifest, as_numpy(content["arrays"]), what="its model")

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        good = self.usable(server_round, replies)
        arrays, metrics = super().aggregate_train(server_round, good) if good else (None, None)
        if arrays is None:
            log(WARNING, "round %d: no client's model to average; the global model stays as it was", server_round)
        self.record(server_round, arrays, good)
        return arrays, metrics

    def record(self, server_round: int, arrays: ArrayRecord | None, good: list[Message]) -> None:
        os.makedirs(self.out, exist_ok=True)
        if arrays is not None:
            np.savez(os.path.join(self.out, f"round-{server_round}.npz"), **as_numpy(arrays))
        if self.keep_replies:  # what each client sent, as it arrived: "<i>/<array>" and "<i>/<metric>"
            sent = {f"{i}/{name}": value for i, m in enumerate(good) for name, value in
                    [*as_numpy(m.content["arrays"]).items(),
                     *((k, np.array(v)) for k, v in m.content["metrics"].items())]}
            np.savez(os.path.join(self.out, f"round-{server_round}-replies.npz"), **sent)
        metrics = [m.content["metrics"] for m in good]
        line = {"round": server_round, "sampled": len(self.sampled.get(server_round, [])), "clients": len(good),
                "bytes_up_per_client": [int(m[BYTES_UP]) for m in metrics],
                "train_loss": float(np.mean([m[LOSS] for m in metrics])) if metrics else None}
        with open(os.path.join(self.out, "rounds.jsonl"), "a", encoding="utf-8") as handle:
            handle.write(json.dumps(line) + "\n")
        log(INFO, "round %d: %d of %d clients averaged, train loss %s, %s B uploaded per client", server_round,
            line["clients"], line["sampled"], "-" if line["train_loss"] is None else f"{line['train_loss']:.5f}",
            "/".join(str(b) for b in line["bytes_up_per_client"]) or "-")


class LoggedFedAvg(Logged, FedAvg):
    """FedAvg weighted by `num-examples`, logged and recorded."""


class LoggedFedProx(Logged, FedProx):
    """FedProx (the clients add the proximal step: `proximal-mu` in the round's config), logged and recorded."""


class LoggedFedAdam(Logged, FedAdam):
    """FedAdam (Adam on the server over the averaged update), logged and recorded."""


#: fblc fleet serve --strategy -> the logged strategy and its options (argument -> run config key)
STRATEGIES: dict[str, tuple[type, dict[str, str]]] = {
    "fedavg": (LoggedFedAvg, {}),
    "fedprox": (LoggedFedProx, {"proximal_mu": "proximal-mu"}),
    "fedadam": (LoggedFedAdam, {"eta": "eta"}),
}


class SeedFedAvg(LoggedFedAvg):
    """ES rounds that send seeds: each client gets its own noise iterations; the server replays every client's
    steps from its seed report (fblc.fleet.es_seeds) and averages the models that gives, weighted by examples."""

    def __init__(self, manifest: Mapping[str, Any], out: str, timeout: float, spec: es_seeds.EsSpec,
                 local_steps: int, **kwargs: Any) -> None:
        super().__init__(manifest, out, timeout, **kwargs)
        self.spec, self.local_steps = spec, local_steps

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
                        ) -> Iterable[Message]:
        messages = list(super().configure_train(server_round, arrays, config, grid))
        clients = max(len(messages), 1)
        for index, message in enumerate(messages):  # the content is shared: give each its own copy of the config
            own = ConfigRecord(dict(message.content["config"]))
            own[ES_ITERATION] = es_seeds.iteration_base(server_round, index, self.local_steps, clients)
            message.content = RecordDict({"arrays": message.content["arrays"], "config": own})
        return messages

    def check_reply(self, content: RecordDict) -> None:
        rewards = as_numpy(content["arrays"]).get(REWARDS)
        if rewards is None or rewards.ndim != 2 or rewards.shape[1] != 2 * self.spec.pairs:
            raise ModelMismatch(f"its seed report holds no rewards [K, {2 * self.spec.pairs}]")

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        good = self.usable(server_round, replies)
        arrays = None
        if good:
            reports = [(es_seeds.SeedReport(int(metrics[ES_SEED]), int(metrics[ES_ITERATION]),
                                            as_numpy(m.content["arrays"])[REWARDS]), int(metrics[EXAMPLES]))
                       for m in good for metrics in [m.content["metrics"]]]
            arrays = as_record(es_seeds.aggregate(self.spec, self.start_arrays[server_round], reports))
        else:
            log(WARNING, "round %d: no client's seed report to replay; the global model stays as it was", server_round)
        self.record(server_round, arrays, good)
        return arrays, None
