"""Faults in a fleet round (issue 43 item 6), at the message level (no Flower process, no OpenCL): a client that
fails, one that never replies (timed out, disconnected) and one of another bundle are left out of the round with
the reason in the server's log while the others are averaged; a client refuses a global model that does not fit
its bundle; what a client sends is its trainable tensors and three metrics, nothing of its data."""

from __future__ import annotations

import json
import logging
import os
import re

import numpy as np
import pytest
from flwr.app import ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAdam

from fblc import bundle_format as fmt
from fblc.codegen.compile import compile_model
from fblc.compiler.optimizers import OptimizerConfig
from fblc.fleet import deploy_apps, trainers
from fblc.errors import FblcError
from fblc.fleet.rounds import STRATEGIES, as_numpy, as_record
from fblc.fleet.trainers import initial_parameters
from fblc.passes.pipeline import TrainingOptions
from tests.support.fleet_messages import Nodes, task_identity
from tests.test_runtime import batch, elementwise_model


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("fleet-faults")
    out = str(folder / "bundle")
    compile_model(elementwise_model(str(folder / "model.onnx")), out, "adreno830", "fp32",
                  TrainingOptions(loss="mse", optimizer=OptimizerConfig("sgd", lr=0.5)))
    return out


@pytest.fixture
def identity():
    with task_identity():
        yield


def _reply(message: Message, arrays: dict[str, np.ndarray], examples: int) -> Message:
    metrics = MetricRecord({"num-examples": examples, "train-loss": 0.5, "bytes-up": 100})
    return Message(content=RecordDict({"arrays": as_record(arrays), "metrics": metrics}), reply_to=message)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_failed_silent_and_foreign_clients_are_left_out_and_logged(bundle, tmp_path, identity, name) -> None:
    manifest, _ = fmt.load_verified(bundle)
    start = initial_parameters(bundle)
    kind, options = STRATEGIES[name]
    strategy = kind(manifest=manifest, out=str(tmp_path), timeout=30.0, min_train_nodes=5, min_available_nodes=5,
                    **{argument: 0.5 for argument in options})
    sent = {m.metadata.dst_node_id: m for m in
            strategy.configure_train(1, as_record(start), ConfigRecord(), Nodes([11, 12, 13, 14, 15]))}
    for message in sent.values():  # what the Grid does as it pushes them
        message.metadata.__dict__["_message_id"] = message.object_id
    good = {name: value + 1.0 for name, value in start.items()}
    better = {name: value + 4.0 for name, value in start.items()}
    replies = [_reply(sent[11], good, 3), _reply(sent[12], better, 1),
               Message(error=Error(code=0, reason="RuntimeError: the phone's GPU was lost"), reply_to=sent[13]),
               _reply(sent[14], {"w": start["w"].T, "b": start["b"]}, 50),  # node 14 of another bundle
               Message(error=Error(code=0, reason="Node Unavailable: no heartbeat"), reply_to=sent[15])]
    replies[-1].metadata.__dict__["_src_node_id"] = 1  # the SuperLink answers for a node that went silent
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("flwr").addHandler(handler)
    try:
        arrays, _ = strategy.aggregate_train(1, replies)
        strategy.sampled[2] = [11, 12, 16]  # round 2: node 16 disconnected mid-round and never replied
        strategy.usable(2, replies[:2])
    finally:
        logging.getLogger("flwr").removeHandler(handler)
    assert arrays is not None
    if name == "fedadam":  # the server's Adam step over the two good clients' average, as Flower's own takes it
        plain = FedAdam(min_train_nodes=2, min_available_nodes=2, eta=0.5)
        plain.configure_train(1, as_record(start), ConfigRecord(), Nodes([11, 12]))
        expected = as_numpy(plain.aggregate_train(1, replies[:2])[0])
    else:  # FedAvg and FedProx: (3 (x + 1) + 1 (x + 4)) / 4 of the two good clients
        expected = {tensor: value + 1.75 for tensor, value in start.items()}
    for tensor, value in as_numpy(arrays).items():
        np.testing.assert_allclose(value, expected[tensor], rtol=1e-6)
    text = "\n".join(records)
    assert "node 13 left out: its ClientApp failed: RuntimeError: the phone's GPU was lost" in text
    assert "node 14 left out: its model's tensor 'w' is [5, 3], the bundle trains [3, 5]" in text
    assert "node 15 left out: the SuperLink reports: Node Unavailable: no heartbeat" in text
    assert "round 2: node 16 left out: no reply within the round's timeout of 30 s" in text
    line = json.loads(open(os.path.join(tmp_path, "rounds.jsonl")).readline())
    assert line == {"round": 1, "sampled": 5, "clients": 2, "bytes_up_per_client": [100, 100], "train_loss": 0.5}


def test_a_client_refuses_a_global_model_that_is_not_its_bundles(bundle, tmp_path) -> None:
    start = initial_parameters(bundle)
    data = str(tmp_path / "data.npz")
    np.savez(data, **batch(rows=6))
    node, run = {"bundle": bundle, "data": data, "device": "local"}, {"local-steps": 1}
    cases = {"the global model lacks 'b'": {"w": start["w"]},
             "the global model has tensor 'extra', which": {**start, "extra": np.zeros(2, np.float32)},
             "global tensor 'b' has shape [6];": {**start, "b": np.zeros(6, np.float32)}}
    for message, arrays in cases.items():
        content = RecordDict({"arrays": as_record(arrays), "config": ConfigRecord({"server-round": 1})})
        with pytest.raises(FblcError, match=re.escape(message)):  # before any kernel is built or data read
            deploy_apps.train_reply(content, node, run)


def test_only_the_trainable_tensors_and_three_metrics_leave_a_client(bundle, tmp_path, monkeypatch) -> None:
    start = initial_parameters(bundle)
    feeds = batch(rows=9, seed=5)
    data = str(tmp_path / "data.npz")
    np.savez(data, **feeds)
    seen = []

    class Trained:  # the device's part: what it trained on, and its result
        shapes = trainers.bundle_shapes(fmt.load_manifest(bundle))

        def __init__(self, *args) -> None:
            self.values = {}

        def set_parameters(self, arrays, keep_state=False) -> None:
            self.values = dict(arrays)

        def step(self, feeds) -> float:
            seen.append(feeds)
            self.values = {name: value * 0.5 for name, value in self.values.items()}
            return 0.25

        def parameters(self):
            return self.values

    monkeypatch.setitem(trainers.DEVICES, "local", Trained)
    monkeypatch.setattr(trainers, "_cache", {})
    content = RecordDict({"arrays": as_record(start), "config": ConfigRecord({"server-round": 2})})
    reply = deploy_apps.train_reply(content, {"bundle": bundle, "data": data, "device": "local"}, {"local-steps": 2})
    # round 2 of 2 steps over 3 batches: batches 2 and 0, in turn
    assert [b["x"].tolist() for b in seen] == [feeds["x"][6:9].tolist(), feeds["x"][0:3].tolist()]
    assert list(reply.array_records) == ["arrays"] and list(reply.metric_records) == ["metrics"]
    assert not reply.config_records
    assert sorted(as_numpy(reply["arrays"])) == ["b", "w"]
    assert dict(reply["metrics"]) == {"num-examples": 9, "train-loss": 0.25, "bytes-up": reply["metrics"]["bytes-up"]}
    payload = b"".join(a.data for a in reply["arrays"].values())
    for name, value in feeds.items():  # no row of the data, in any form, is in what is sent
        for row in value:
            assert row.astype(np.float32).tobytes() not in payload, name
    for name, value in as_numpy(reply["arrays"]).items():
        np.testing.assert_array_equal(value, start[name] * 0.25)

    # FedProx's round: after each step w -= lr mu (w - w_global)
    content["config"]["proximal-mu"] = 0.5
    reply = deploy_apps.train_reply(content, {"bundle": bundle, "data": data, "device": "local"},
                                    {"local-steps": 2, "proximal-lr": 0.2})
    for name, value in as_numpy(reply["arrays"]).items():
        w = start[name] * 0.5
        w = w - 0.1 * (w - start[name])
        w = w * 0.5
        np.testing.assert_allclose(value, w - 0.1 * (w - start[name]), rtol=1e-6)


def test_a_round_waits_for_too_few_nodes_only_as_long_as_it_may(bundle, tmp_path, identity) -> None:
    """Flower's sampling waits without limit while fewer than min-available nodes are connected; the fleet's
    strategy waits `wait_clients` seconds, logging the count, then stops the run with the model it had."""
    from fblc.fleet.rounds import LoggedFedAvg, TooFewClients

    manifest, _ = fmt.load_verified(bundle)
    strategy = LoggedFedAvg(manifest=manifest, out=str(tmp_path), timeout=30.0, min_train_nodes=3,
                            min_available_nodes=3, wait_clients=0.6)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("flwr").addHandler(handler)
    start = as_record(initial_parameters(bundle))
    try:
        with pytest.raises(TooFewClients, match=re.escape("round 4: only 2 of the 3 SuperNodes it needs "
                                                          "(--min-clients) were connected after 0.6 s")) as stopped:
            strategy.configure_train(4, start, ConfigRecord(), Nodes([7, 8]))
        sent = strategy.configure_train(4, start, ConfigRecord(), Nodes([7, 8, 9]))  # enough: no wait
    finally:
        logging.getLogger("flwr").removeHandler(handler)
    assert stopped.value.arrays is start and (stopped.value.connected, stopped.value.needed) == (2, 3)
    assert len(list(sent)) == 3
    assert records[0] == "round 4 waits for SuperNodes: 2 connected of the 3 it needs (at most 0.6 s)"
