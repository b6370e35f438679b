"""A real deployment on loopback (issue 43 item 5): `fblc fleet serve` runs Flower's SuperLink and `flwr run`; two
`fblc fleet join` SuperNodes train, one on the local OpenCL device and one on the loopback adb device through the
native runner (tests/support/adb_device.py). Two rounds; each client's reply is checked against LocalRunner
trained from the previous global model on that client's batches, each aggregate against a numpy FedAvg of the
replies, and no process of the deployment outlives it."""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest

from fblc.cli import main
from fblc.codegen.compile import compile_model
from fblc.compiler.optimizers import OptimizerConfig
from fblc.fleet.deploy import free_port
from fblc.fleet.trainers import initial_parameters
from fblc.passes.pipeline import TrainingOptions
from fblc.runtime.local import LocalRunner
from tests.support.fleet_deploy import MARKER, QUIET, Joins, join_argv, tagged
from tests.test_adb import REPO, adb_server, phone  # noqa: F401  (fixtures)
from tests.test_native_runner import opencl_env, runner_binary  # noqa: F401  (fixtures)
from tests.test_runtime import batch, elementwise_model

#: two rounds: the second starts from the first's aggregate, and each client's batches wrap around within it (2
#: and 3 batches, 2 steps a round), which is all a third round ran again (each round ~1/3 of the test's wall time:
#: Flower's process per message and its SuperNodes' 3-second polls)
ROUNDS, STEPS = 2, 2


# in the suite again (the suite has room since its xdist groups hold): three rounds ~28 s wall, ~19 CPU s on an
# idle 2-core machine, most of it Flower's process per message and its SuperNodes' 3-second polls
def test_a_superlink_and_two_supernodes_train_two_rounds(tmp_path, phone, runner_binary, capsys) -> None:  # noqa: F811
    bundle = str(tmp_path / "bundle")
    compile_model(elementwise_model(str(tmp_path / "model.onnx")), bundle, "adreno830", "fp32",
                  TrainingOptions(loss="mse", optimizer=OptimizerConfig("sgd", lr=0.5)))
    parts = {"local": batch(rows=6, seed=1), f"adb:{phone.serial}": batch(rows=9, seed=2)}  # 2 and 3 batches
    tag, port, out = uuid.uuid4().hex, free_port(), str(tmp_path / "server")
    env = {**os.environ, MARKER: tag, "PYTHONPATH": REPO, **QUIET}
    for k, feeds in enumerate(parts.values()):
        np.savez(tmp_path / f"part{k}.npz", **feeds)
    joins = Joins(port, [(join_argv(bundle, port, device, str(tmp_path / f"part{k}.npz"), runner_binary), env)
                         for k, device in enumerate(parts)])
    saved = dict(os.environ)
    os.environ.update({MARKER: tag, **QUIET})  # the SuperLink and its children carry the tag too
    try:
        code = main(["fleet", "serve", bundle, "--rounds", str(ROUNDS), "--local-steps", str(STEPS), "--port",
                     str(port), "--round-timeout", "120", "--keep-replies", "-o", out])
    finally:
        os.environ.clear()
        os.environ.update(saved)
        logs = joins.stop()
    printed = capsys.readouterr().out
    assert code == 0, printed + "\n".join(logs)
    with capsys.disabled():  # what the Flower processes cost, for `pytest -s`
        print(*[line for text in [printed, *logs] for line in text.splitlines() if "CPU s" in line], sep="\n")
    for r in range(1, ROUNDS + 1):
        assert f"round {r}: 2 of 2 clients averaged" in printed
    assert not tagged(tag), "processes of the deployment are still running"

    rows = {6: parts["local"], 9: parts[f"adb:{phone.serial}"]}
    start = initial_parameters(bundle)
    local = LocalRunner(bundle, progress=False)  # plain SGD: no optimizer state, so one runner serves every reply
    for r in range(1, ROUNDS + 1):
        sent = np.load(os.path.join(out, f"round-{r}-replies.npz"))
        replies = [{name.split("/", 1)[1]: sent[name] for name in sent.files if name.startswith(f"{i}/")}
                   for i in range(2)]
        assert sorted(int(reply["num-examples"]) for reply in replies) == [6, 9]
        for reply in replies:  # only the trainable tensors and three metrics left each client
            assert sorted(reply) == ["b", "bytes-up", "num-examples", "train-loss", "w"]
            feeds = rows[int(reply["num-examples"])]
            for name, value in start.items():
                local.upload(next(p["texture"] for p in local.manifest["parameters"] if p["name"] == name), value)
            count = len(feeds["x"]) // 3
            for k in range(STEPS):
                first = ((r - 1) * STEPS + k) % count * 3
                local.step({name: value[first:first + 3] for name, value in feeds.items()})
            for name, value in local.parameters().items():
                np.testing.assert_allclose(reply[name], value, rtol=1e-5, atol=1e-6)
        weights = np.array([float(reply["num-examples"]) for reply in replies])
        average = {name: sum(w * reply[name].astype(np.float64) for w, reply in zip(weights / weights.sum(), replies))
                   for name in start}
        aggregate = np.load(os.path.join(out, f"round-{r}.npz"))
        for name in start:
            np.testing.assert_allclose(aggregate[name], average[name], rtol=1e-6, atol=1e-7)
        start = {name: aggregate[name] for name in start}
    final = np.load(os.path.join(out, "global.npz"))
    assert all(np.array_equal(final[name], start[name]) for name in start)
