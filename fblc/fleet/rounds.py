"""The ServerApp's strategies for a deployment: Flower's FedAvg that says which clients a round left out and why,
records each round, and the same for ES rounds whose clients send seeds.

Flower's FedAvg already survives a client that fails (its reply is an error message, aggregated around) or never
answers (`Grid.send_and_receive` returns at the round's timeout with what came); it logs the errors but not the
silent nodes. `LoggedFedAvg` compares the nodes it sampled with the replies and logs every node left out with
its reason (its error, or no reply within the timeout), refuses to average a reply whose tensors are not the
global model's (a client of another bundle would corrupt the round), and writes each round's aggregate and a
JSON line (clients, failures, bytes uploaded per client, mean train loss) to the run's folder.

Flower's own sample_nodes waits without limit while fewer than min-available nodes are connected; `Logged` waits
first, at most `wait_clients` seconds, and then raises TooFewClients (the ServerApp saves the global model so far
and stops). `PromptGrid` polls the SuperLink for a round's replies every POLL seconds instead of the 3 s Flower's
Grid sleeps between pulls (a round ended up to 3 s after its last reply).
"""

from __future__ import annotations

import json
import os
import time
from logging import INFO, WARNING
from typing import Any, Iterable, Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAdam, FedAvg, FedProx

from fblc.fleet import es_seeds
from fblc.fleet.bundle_params import ModelMismatch, check_tensors
from fblc.paths import write_atomically

#: the reply's MetricRecord keys a client sends (no other metric leaves a client)
EXAMPLES, LOSS, BYTES_UP, ES_SEED, ES_ITERATION = "num-examples", "train-loss", "bytes-up", "es-seed", "es-iteration"
REWARDS = "es.rewards"


#: seconds between a round's pulls of its replies from the SuperLink (Flower's Grid: 3)
POLL = 0.25
#: seconds between the logged lines while a round waits for SuperNodes to connect
WAIT_LOG = 30.0


class TooFewClients(Exception):
    """Fewer SuperNodes than a round needs stayed connected for the whole wait: the run stops."""

    def __init__(self, server_round: int, connected: int, needed: int, waited: float, arrays: ArrayRecord) -> None:
        super().__init__(f"round {server_round}: only {connected} of the {needed} SuperNodes it needs (--min-clients) "
                         f"were connected after {waited:g} s (--wait-clients)")
        self.server_round, self.connected, self.needed, self.waited, self.arrays = (server_round, connected, needed,
                                                                                    waited, arrays)


class PromptGrid:
    """A Grid whose send_and_receive pulls the replies every POLL s (Flower's push, pull and wait, without the 3 s
    sleep between pulls); everything else is the Grid's."""

    def __init__(self, grid: Grid, poll: float = POLL) -> None:
        self.grid, self.poll = grid, poll

    def __getattr__(self, name: str) -> Any:
        return getattr(self.grid, name)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        waiting = set(self.grid.push_messages(messages))
        end = time.monotonic() + (timeout or 0.0)
        replies: list[Message] = []
        while timeout is None or time.monotonic() < end:
            pulled = list(self.grid.pull_messages(waiting))
            replies.extend(pulled)
            waiting.difference_update(m.metadata.reply_to_message_id for m in pulled)
            if not waiting:
                break
            time.sleep(self.poll)
        return replies


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
                 wait_clients: float | None = None, **kwargs: Any) -> None:
        super().__init__(fraction_evaluate=0.0, min_evaluate_nodes=0, **kwargs)  # type: ignore[call-arg]
        self.manifest, self.out, self.timeout, self.keep_replies = manifest, out, timeout, keep_replies
        self.wait_clients = wait_clients
        self.sampled: dict[int, list[int]] = {}
        self.sent: dict[int, list[Message]] = {}
        self.start_arrays: dict[int, dict[str, np.ndarray]] = {}

    def wait_for_nodes(self, server_round: int, arrays: ArrayRecord, grid: Grid) -> None:
        """Return once the round's SuperNodes are connected; TooFewClients after `wait_clients` seconds."""
        needed = max(int(self.min_available_nodes), int(self.min_train_nodes))  # type: ignore[attr-defined]
        started, logged = time.monotonic(), None
        while (connected := len(list(grid.get_node_ids()))) < needed:
            waited = time.monotonic() - started
            if self.wait_clients is not None and waited >= self.wait_clients:
                raise TooFewClients(server_round, connected, needed, self.wait_clients, arrays)
            if logged is None or waited - logged >= WAIT_LOG:
                log(INFO, "round %d waits for SuperNodes: %d connected of the %d it needs (at most %s)", server_round,
                    connected, needed, "without limit" if self.wait_clients is None else f"{self.wait_clients:g} s")
                logged = waited
            time.sleep(0.5)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
                        ) -> Iterable[Message]:
        self.wait_for_nodes(server_round, arrays, grid)
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
            if message.has_error():  # from the node (its ClientApp raised) or from the SuperLink (the node is gone)
                log(WARNING, "round %d: node %d left out: %s: %s", server_round, node,
                    "its ClientApp failed" if message.metadata.src_node_id == node else "the SuperLink reports",
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
            kept = as_numpy(arrays)
            write_atomically(os.path.join(self.out, f"round-{server_round}.npz"),
                             lambda handle: np.savez(handle, **kept))
        if self.keep_replies:  # what each client sent, as it arrived: "<i>/<array>" and "<i>/<metric>"
            sent = {f"{i}/{name}": value for i, m in enumerate(good) for name, value in
                    [*as_numpy(m.content["arrays"]).items(),
                     *((k, np.array(v)) for k, v in m.content["metrics"].items())]}
            write_atomically(os.path.join(self.out, f"round-{server_round}-replies.npz"),
                             lambda handle: np.savez(handle, **sent))
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


def seed_messages(messages: Iterable[Message], server_round: int, local_steps: int) -> list[Message]:
    """A round's train messages, each with its client's own first ES iteration (`es-iteration` in its config)."""
    messages = list(messages)
    clients = max(len(messages), 1)
    for index, message in enumerate(messages):  # the content is shared: give each its own copy of the config
        own = ConfigRecord(dict(message.content["config"]))
        own[ES_ITERATION] = es_seeds.iteration_base(server_round, index, local_steps, clients)
        message.content = RecordDict({"arrays": message.content["arrays"], "config": own})
    return messages


def replayed(spec: es_seeds.EsSpec, start: Mapping[str, np.ndarray], replies: Iterable[Message]) -> ArrayRecord:
    """The FedAvg (weighted by examples) of the models the replies' seed reports replay to from `start`."""
    reports = [(es_seeds.SeedReport(int(metrics[ES_SEED]), int(metrics[ES_ITERATION]),
                                    as_numpy(m.content["arrays"])[REWARDS]), int(metrics[EXAMPLES]))
               for m in replies for metrics in [m.content["metrics"]]]
    return as_record(es_seeds.aggregate(spec, start, reports))


class SeedFedAvg(LoggedFedAvg):
    """ES rounds that send seeds: each client gets its own noise iterations; the server replays every client's
    steps from its seed report (fblc.fleet.es_seeds) and averages the models that gives, weighted by examples."""

    def __init__(self, manifest: Mapping[str, Any], out: str, timeout: float, spec: es_seeds.EsSpec,
                 local_steps: int, **kwargs: Any) -> None:
        super().__init__(manifest, out, timeout, **kwargs)
        self.spec, self.local_steps = spec, local_steps

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
                        ) -> Iterable[Message]:
        return seed_messages(super().configure_train(server_round, arrays, config, grid), server_round,
                             self.local_steps)

    def check_reply(self, content: RecordDict) -> None:
        rewards = as_numpy(content["arrays"]).get(REWARDS)
        if rewards is None or rewards.ndim != 2 or rewards.shape[1] != 2 * self.spec.pairs:
            raise ModelMismatch(f"its seed report holds no rewards [K, {2 * self.spec.pairs}]")

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        good = self.usable(server_round, replies)
        arrays = None
        if good:
            arrays = replayed(self.spec, self.start_arrays[server_round], good)
        else:
            log(WARNING, "round %d: no client's seed report to replay; the global model stays as it was", server_round)
        self.record(server_round, arrays, good)
        return arrays, None
