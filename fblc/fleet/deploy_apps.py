"""The ServerApp and ClientApp that `fblc fleet serve` / `fblc fleet join` run in Flower's own processes.

Each message runs in a fresh `flwr-clientapp` process (Flower's subprocess isolation), so what a client keeps
between rounds lives on disk: pyopencl's and PoCL's kernel caches for `local`, the pushed bundle and the
runner's program cache on the phone for `adb:SERIAL`. The SuperNode's node config names the client's own
bundle, data file and device; the run config (`fblc fleet serve`'s options) the round's figures. A client
sends back only the bundle's trainable tensors (or, for ES rounds that send seeds, its seed report) and the
metrics `num-examples`, `train-loss` (the mean of its K losses) and `bytes-up`: its data never leaves it. The
trainers are fblc.fleet.trainers' (`local`, `adb:SERIAL`: fblc.fleet.adb_trainer).
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fblc import bundle_format as fmt
from fblc.fleet import es_seeds
from fblc.fleet.rounds import (BYTES_UP, ES_ITERATION, ES_SEED, EXAMPLES, LOSS, REWARDS, STRATEGIES, PromptGrid,
                               SeedFedAvg, TooFewClients, as_numpy, as_record, payload_bytes)
from fblc.fleet.trainers import bundle_shapes, checked_global, device_kind, initial_parameters, trainer_for
from fblc.paths import write_atomically

Batches = Sequence[Mapping[str, np.ndarray]]


def _round_batches(batches: Batches, server_round: int, steps: int) -> list[Mapping[str, np.ndarray]]:
    """The K batches of a round: the partition's batches in turn, continuing where the last round stopped."""
    first = (server_round - 1) * steps
    return [batches[(first + k) % len(batches)] for k in range(steps)]


def _proximal_steps(trainer: Any, batches: Batches, start: Mapping[str, np.ndarray], mu: float, lr: float
                    ) -> list[float]:
    """Steps with FedProx's w -= lr * mu * (w - w_global) after each (exact for plain SGD at the step's lr)."""
    losses = []
    for feeds in batches:
        losses.append(trainer.step(feeds))
        now = trainer.parameters()
        trainer.set_parameters({k: v - lr * mu * (v - start[k]) for k, v in now.items()}, keep_state=True)
    return losses


def train_reply(content: RecordDict, node: Mapping[str, Any], run: Mapping[str, Any]) -> RecordDict:
    """One training round on this client: the reply's content. A global model that is not its bundle's is refused
    (fblc.fleet.trainers.checked_global) before its data is read."""
    from fblc.cli.data import batches as read_batches

    bundle, device = str(node["bundle"]), str(node["device"])
    manifest, _ = fmt.load_verified(bundle)
    start = as_numpy(content["arrays"])
    checked_global(start, bundle_shapes(manifest), f"bundle '{bundle}'")  # before a kernel is built
    config = content["config"]
    trainer = trainer_for(bundle, device)
    if device_kind(device) == "adb" and node.get("runner"):
        trainer.runner = str(node["runner"])  # type: ignore[attr-defined]  (AdbTrainer: the runner to push)
    trainer.set_parameters(start)
    steps = int(run["local-steps"])
    data, _ = read_batches(str(node["data"]), manifest)
    batches = _round_batches(data, int(config["server-round"]), steps)
    examples = len(data) * manifest["inputs"][0]["shape"][0]
    if ES_ITERATION in config:  # an ES round that sends seeds: the local device's runner reports its rewards
        report, losses = trainer.train_reporting_seeds(batches, int(config[ES_ITERATION]),
                                                       es_seeds.es_spec(bundle).seed)
        arrays = ArrayRecord({REWARDS: Array(report.rewards)})
        metrics = {ES_SEED: report.seed, ES_ITERATION: report.iteration}
    elif float(config.get("proximal-mu", 0.0)) > 0:  # FedProx: the proximal term's step after each step (as
        losses = _proximal_steps(trainer, batches, start, float(config["proximal-mu"]),  # fblc.fleet.client)
                                 float(run["proximal-lr"]))
        arrays, metrics = as_record(trainer.parameters()), {}
    else:  # an adb device trains the round in one run of the runner (the optimizer state lasts the round)
        losses = trainer.train(batches) if hasattr(trainer, "train") else [trainer.step(b) for b in batches]
        arrays, metrics = as_record(trainer.parameters()), {}
    reply = RecordDict({"arrays": arrays, "metrics": MetricRecord({EXAMPLES: examples, LOSS: float(np.mean(losses)),
                                                                   **metrics})})
    reply["metrics"][BYTES_UP] = payload_bytes(reply) + 8
    return reply


client_app = ClientApp()


@client_app.train()
def _client_train(msg: Message, context: Context) -> Message:
    return Message(content=train_reply(msg.content, context.node_config, context.run_config), reply_to=msg)


server_app = ServerApp()

#: what the ServerApp writes when too few SuperNodes connected (fblc fleet serve reads it)
STOPPED = "stopped.json"


@server_app.main()
def _server_main(grid: Grid, context: Context) -> None:
    run = context.run_config
    bundle, out = str(run["bundle"]), str(run["out"])
    manifest, _ = fmt.load_verified(bundle)
    wait = float(run["wait-clients"])
    figures = dict(manifest=manifest, out=out, timeout=float(run["round-timeout"]),
                   keep_replies=bool(run["keep-replies"]), fraction_train=float(run["fraction"]),
                   min_train_nodes=int(run["min-clients"]), min_available_nodes=int(run["min-clients"]),
                   wait_clients=wait if wait > 0 else None)
    if bool(run["es-seeds"]):
        strategy = SeedFedAvg(spec=es_seeds.es_spec(bundle), local_steps=int(run["local-steps"]), **figures)
    else:
        kind, options = STRATEGIES[str(run["strategy"])]
        strategy = kind(**figures, **{argument: float(run[key]) for argument, key in options.items()})
    try:
        result = strategy.start(grid=PromptGrid(grid), initial_arrays=as_record(initial_parameters(bundle)),
                                num_rounds=int(run["rounds"]), timeout=float(run["round-timeout"]))
    except TooFewClients as stop:  # the model of the rounds that ran is kept, and serve says why it stopped
        arrays = as_numpy(stop.arrays)
        write_atomically(f"{out}/global.npz", lambda handle: np.savez(handle, **arrays))
        stopped = {"round": stop.server_round, "connected": stop.connected, "needed": stop.needed,
                   "waited": stop.waited, "message": str(stop)}
        write_atomically(f"{out}/{STOPPED}", lambda handle: handle.write(json.dumps(stopped).encode()))
        print(f"fleet: stopped: {stop}; the global model after {stop.server_round - 1} rounds: {out}/global.npz",
              flush=True)
        return
    final = as_numpy(result.arrays)
    write_atomically(f"{out}/global.npz", lambda handle: np.savez(handle, **final))
    print(f"fleet: the global model after {int(run['rounds'])} rounds: {out}/global.npz", flush=True)
