"""ES rounds that send seeds (issue 43 item 3): two clients train an ES bundle on PoCL from one global model,
each with its own noise iterations; the server's replay of their seed reports (fblc.fleet.es_seeds) averages to
what their trained models average to, and a client's reply is its rewards and four metrics: a few hundred bytes."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, RecordDict

from fblc.codegen.compile import compile_model
from fblc.compiler.es import EsConfig
from fblc.compiler.optimizers import OptimizerConfig
from fblc.errors import FblcError
from fblc.fleet import es_seeds
from fblc.fleet.deploy_apps import train_reply
from fblc.fleet.rounds import as_numpy, as_record, payload_bytes
from fblc.fleet.trainers import initial_parameters
from fblc.passes.pipeline import TrainingOptions
from fblc.runtime.local import LocalRunner
from tests.test_adb import adb_server, phone  # noqa: F401  (fixtures)
from tests.test_native_runner import opencl_env, runner_binary  # noqa: F401  (fixtures)
from tests.test_runtime import batch, elementwise_model

STEPS, PAIRS = 3, 4


@pytest.fixture(scope="module")
def es_bundle(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("es-fleet")
    bundle = str(folder / "bundle")
    options = TrainingOptions(loss="mse", trainer="es", es=EsConfig(pairs=PAIRS, sigma=0.05, seed=7),
                              optimizer=OptimizerConfig("sgd", lr=0.5, momentum=0.9, weight_decay=0.01))
    compile_model(elementwise_model(str(folder / "model.onnx")), bundle, "adreno830", "fp32", options)
    return bundle


def test_the_replayed_seed_reports_average_to_the_trained_models(es_bundle) -> None:
    spec = es_seeds.es_spec(es_bundle)
    start = {name: value + 0.1 for name, value in initial_parameters(es_bundle).items()}  # a later round's global model
    runner = LocalRunner(es_bundle, progress=False)
    trained, reports = [], []
    for client, (rows, seed) in enumerate([(6, 1), (9, 2)]):
        for entry in runner.manifest["parameters"]:
            runner.upload(entry["texture"], start[entry["name"]])
        feeds = batch(rows=rows, seed=seed)
        batches = [{k: v[i:i + 3] for k, v in feeds.items()} for i in range(0, rows, 3)]
        iteration = es_seeds.iteration_base(server_round=4, client=client, steps=STEPS, clients=2)
        report, _ = es_seeds.train_reporting_seeds(runner, batches, STEPS, iteration, spec.seed)
        assert report.rewards.shape == (STEPS, 2 * PAIRS) and report.nbytes() <= 1024
        trained.append((runner.parameters(), rows))
        reports.append((report, rows))
    assert reports[0][0].iteration != reports[1][0].iteration  # the clients' noise differs
    rebuilt = es_seeds.aggregate(spec, start, reports)
    total = sum(rows for _, rows in trained)
    for name in start:
        from_deltas = sum(model[name].astype(np.float64) * rows / total for model, rows in trained)
        moved = np.abs(from_deltas - start[name]).max()
        assert moved > 1e-3  # the clients did move the model
        # float32 noise: the device's log/sqrt/sin/cos against numpy's, a few ulp per element
        np.testing.assert_allclose(rebuilt[name], from_deltas, rtol=0, atol=1e-6)


def test_a_seed_reply_is_rewards_and_metrics_only(es_bundle, tmp_path) -> None:
    data = str(tmp_path / "data.npz")
    feeds = batch(rows=6, seed=3)
    np.savez(data, **feeds)
    content = RecordDict({"arrays": as_record(initial_parameters(es_bundle)),
                          "config": ConfigRecord({"server-round": 2, "es-iteration": 30})})
    reply = train_reply(content, {"bundle": es_bundle, "data": data, "device": "local"}, {"local-steps": STEPS})
    assert list(reply.array_records) == ["arrays"] and list(as_numpy(reply["arrays"])) == ["es.rewards"]
    assert sorted(reply["metrics"]) == ["bytes-up", "es-iteration", "es-seed", "num-examples", "train-loss"]
    assert reply["metrics"]["es-iteration"] == 30 and reply["metrics"]["es-seed"] == 7
    # K x 2P float32 rewards as Flower's .npy bytes (a 128-byte header) and five 8-byte metrics, whatever the
    # model's size
    assert reply["metrics"]["bytes-up"] == payload_bytes(reply) == 128 + STEPS * 2 * PAIRS * 4 + 5 * 8


def test_a_bundle_whose_steps_cannot_be_replayed_is_refused(es_bundle, tmp_path) -> None:
    import json
    import shutil

    copy = str(tmp_path / "adam")
    shutil.copytree(es_bundle, copy)
    report = json.load(open(f"{copy}/report.json"))
    report["training"]["optimizer"]["name"] = "adam"
    with open(f"{copy}/report.json", "w") as handle:
        json.dump(report, handle)
    from tests.support.bundles import rechecksum

    rechecksum(copy, "report.json")
    with pytest.raises(FblcError, match="adam's cannot be replayed"):
        es_seeds.es_spec(copy)


@pytest.mark.slow  # ~6 CPU s of its own (an adb server, a push, the runner's build): test_native_runner checks the
# runner's rewards, test_fleet_deploy the adb path
def test_a_phone_reports_the_rewards_the_local_device_does(es_bundle, phone, runner_binary) -> None:  # noqa: F811
    """Over adb the runner reads each ES step's member rewards back (outputs.bin) from a run that starts at the
    round's global model and noise iteration (--params): the seed report and the model are LocalRunner's."""
    from fblc.fleet.adb_trainer import AdbTrainer

    spec = es_seeds.es_spec(es_bundle)
    start = {name: value - 0.2 for name, value in initial_parameters(es_bundle).items()}
    feeds = batch(rows=6, seed=4)
    batches = [{k: v[i:i + 3] for k, v in feeds.items()} for i in (0, 3, 0)]
    trainer = AdbTrainer(es_bundle, f"adb:{phone.serial}")
    trainer.runner = runner_binary
    trainer.set_parameters(start)
    report, losses = trainer.train_reporting_seeds(batches, 21, spec.seed)
    local = LocalRunner(es_bundle, progress=False, storage="image")
    for entry in local.manifest["parameters"]:
        local.upload(entry["texture"], start[entry["name"]])
    expected, expected_losses = es_seeds.train_reporting_seeds(local, batches, 3, 21, spec.seed)
    np.testing.assert_allclose(report.rewards, expected.rewards, rtol=1e-6)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-6)
    replayed = es_seeds.replay(spec, start, report)
    for name, value in trainer.parameters().items():
        np.testing.assert_allclose(value, local.parameters()[name], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(replayed[name], value, rtol=0, atol=1e-6)


def test_the_seed_strategy_gives_each_client_its_noise_and_replays_their_reports(es_bundle, tmp_path) -> None:
    """SeedFedAvg at the message level: distinct first iterations per node in one round, the aggregate of the
    replies is es_seeds.aggregate of their reports, weighted by examples."""
    from flwr.app import Array, ArrayRecord, Message, MetricRecord

    from fblc import bundle_format as fmt
    from fblc.fleet.rounds import SeedFedAvg
    from tests.support.fleet_messages import Nodes, task_identity

    with task_identity():
        spec = es_seeds.es_spec(es_bundle)
        manifest, _ = fmt.load_verified(es_bundle)
        start = initial_parameters(es_bundle)
        strategy = SeedFedAvg(manifest=manifest, out=str(tmp_path), timeout=30.0, spec=spec, local_steps=STEPS,
                              min_train_nodes=2, min_available_nodes=2)
        sent = list(strategy.configure_train(3, as_record(start), ConfigRecord(), Nodes([7, 8])))
        iterations = [int(m.content["config"]["es-iteration"]) for m in sent]
        assert iterations == [es_seeds.iteration_base(3, k, STEPS, 2) for k in range(2)] and len(set(iterations)) == 2
        rng = np.random.default_rng(0)
        reports = [(es_seeds.SeedReport(spec.seed, it, rng.standard_normal((STEPS, 2 * PAIRS)).astype(np.float32)),
                    rows) for it, rows in zip(iterations, (6, 9))]
        replies = [Message(content=RecordDict({"arrays": ArrayRecord({"es.rewards": Array(report.rewards)}),
                                               "metrics": MetricRecord({"num-examples": rows, "train-loss": 0.1,
                                                                        "bytes-up": 264, "es-seed": report.seed,
                                                                        "es-iteration": report.iteration})}),
                           reply_to=message) for message, (report, rows) in zip(sent, reports)]
        arrays, _ = strategy.aggregate_train(3, replies)
    expected = es_seeds.aggregate(spec, start, reports)
    for name, value in as_numpy(arrays).items():
        np.testing.assert_array_equal(value, expected[name])
        assert np.abs(value - start[name]).max() > 1e-3


def test_simulated_seed_rounds_rebuild_what_the_clients_trained_in_graph_mode(es_bundle, tmp_path) -> None:
    """`fblc fleet simulate --es-seeds` without Ray: the simulation's seed strategy and ClientApp on two clients in
    graph mode (the ES step ONNX in onnxruntime, its noise numpy's Philox twin): each reply is rewards and metrics,
    and the aggregate the server rebuilds from them equals the FedAvg of the models the clients trained."""
    from flwr.app import Context

    from fblc.compiler.model_io import load_model, save_model_atomically
    from fblc.compiler.optional_state import with_optional_state
    from fblc.fleet.client import FleetSpec, client_app, client_rows
    from fblc.fleet.server import History, ServerSpec, strategy_of
    from fblc.fleet.trainers import trainer_for
    from fblc.passes.pipeline import build_training_graph
    from tests.support.fleet_messages import Nodes, task_identity

    step = str(tmp_path / "step.onnx")
    options = TrainingOptions(loss="mse", trainer="es", es=EsConfig(pairs=PAIRS, sigma=0.05, seed=7),
                              optimizer=OptimizerConfig("sgd", lr=0.5, momentum=0.9, weight_decay=0.01))
    save_model_atomically(with_optional_state(build_training_graph(
        load_model(elementwise_model(str(tmp_path / "model.onnx"))), options)), step)
    np.savez(tmp_path / "rows.npz", **batch(rows=30, seed=6))
    fleet = FleetSpec(es_bundle, str(tmp_path / "rows.npz"), clients=2, local_steps=STEPS, device="graph", step=step)
    server = ServerSpec(rounds=1, local_steps=STEPS, min_train=2, min_available=2, es_seeds=True)
    history = History(keep_replies=True)
    start = {name: value + 0.1 for name, value in initial_parameters(es_bundle).items()}
    with task_identity():
        strategy = strategy_of(server, history, es_seeds.es_spec(es_bundle))
        sent = list(strategy.configure_train(2, as_record(start), ConfigRecord({"local-steps": STEPS}), Nodes([7, 8])))
        app, replies, trained = client_app(fleet), [], []
        for client, message in enumerate(sent):
            message.metadata.__dict__["_message_id"] = message.object_id  # what the Grid does as it pushes it
            context = Context(run_id=1, node_id=7 + client, node_config={"partition-id": client}, state=RecordDict(),
                              run_config={})
            replies.append(app(message=message, context=context))
            model = trainer_for(fleet.bundle, "graph", step).parameters()  # what it trained, and did not send
            trained.append(({k: v.copy() for k, v in model.items()}, len(client_rows(fleet, client))))
        arrays, _ = strategy.aggregate_train(2, replies)
    assert len({int(m.content["config"]["es-iteration"]) for m in sent}) == 2  # each client its own noise
    for reply in replies:
        assert list(as_numpy(reply.content["arrays"])) == ["es.rewards"]
        # K x 2P float32 rewards with the .npy header and the seed and first iteration, whatever the model's size
        assert reply.content["metrics"]["bytes-up"] == 128 + STEPS * 2 * PAIRS * 4 + 2 * 8 <= 1024
    total = sum(rows for _, rows in trained)
    for name, value in as_numpy(arrays).items():
        from_deltas = sum(model[name].astype(np.float64) * rows / total for model, rows in trained)
        assert np.abs(from_deltas - start[name]).max() > 1e-3  # the clients did move the model
        np.testing.assert_allclose(value, from_deltas, rtol=0, atol=1e-6)  # float32 rounding of the two sums
    assert history.pending["clients"] == 2 and history.pending["bytes_up_per_client"] < 1024
