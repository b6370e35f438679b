"""The ServerApp and ClientApp that `fblc fleet serve` / `fblc fleet join` run in Flower's own processes.

Each message runs in a fresh `flwr-clientapp` process (Flower's subprocess isolation), so what a client keeps
between rounds lives on disk: pyopencl's and PoCL's kernel caches for `local`, the pushed bundle and the
runner's program cache on the phone for `adb:SERIAL`. The SuperNode's node config names the client's own
bundle, data file and device; the run config (`fblc fleet serve`'s options) the round's figures. A client
sends back only the bundle's trainable tensors (or, for ES rounds that send seeds, its seed report) and the
metrics `num-examples`, `loss` and `bytes-up`: its data never leaves it.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fblc import bundle_format as fmt
from fblc.errors import FblcError
from fblc.fleet import es_seeds
from fblc.fleet.bundle_params import check_global, params_bin, read_tensors
from fblc.fleet.rounds import (BYTES_UP, ES_ITERATION, ES_SEED, EXAMPLES, LOSS, REWARDS, LoggedFedAvg, SeedFedAvg,
                               as_numpy, as_record, payload_bytes)

Batches = Sequence[Mapping[str, np.ndarray]]


def _round_batches(batches: Batches, server_round: int, steps: int) -> list[Mapping[str, np.ndarray]]:
    """The K batches of a round: the partition's batches in turn, continuing where the last round stopped."""
    first = (server_round - 1) * steps
    return [batches[(first + k) % len(batches)] for k in range(steps)]


def _train_local(node: Mapping[str, Any], bundle: str, start: Mapping[str, np.ndarray], batches: Batches
                 ) -> tuple[dict[str, np.ndarray], list[float]]:
    from fblc.runtime.local import LocalRunner

    runner = LocalRunner(bundle, progress=False)
    _upload(runner, start)
    losses = [float(runner.step(feeds)) for feeds in batches]
    return runner.parameters(), losses


def _train_adb(node: Mapping[str, Any], bundle: str, start: Mapping[str, np.ndarray], batches: Batches
               ) -> tuple[dict[str, np.ndarray], list[float]]:
    from fblc.runtime.adb import Adb, run_on_device

    adb = Adb()
    serial = adb.choose(str(node["device"]).split(":", 1)[1] or None)
    results = run_on_device(adb, serial, bundle, batches, len(batches), runner=node.get("runner") or None,
                            initial=params_bin(bundle, start))
    return results.parameters, [float(loss) for loss in results.losses]


def _upload(runner: Any, values: Mapping[str, np.ndarray]) -> None:
    textures = {e["name"]: e["texture"] for e in [*runner.manifest["parameters"], *runner.manifest["states"]]}
    for name, value in values.items():
        runner.upload(textures[name], np.asarray(value, np.float32))


Trainer = Callable[[Mapping[str, Any], str, Mapping[str, np.ndarray], Batches],
                   tuple[dict[str, np.ndarray], list[float]]]
#: --device's kind -> how a client trains there (local: pyopencl's device; adb:SERIAL: the native runner)
DEVICES: dict[str, Trainer] = {"local": _train_local, "adb": _train_adb}


def device_trainer(device: str) -> Trainer:
    kind = device.split(":", 1)[0]
    if kind not in DEVICES:
        raise FblcError(f"fleet device '{device}' is none of: local, adb:SERIAL")
    return DEVICES[kind]


def train_reply(content: RecordDict, node: Mapping[str, Any], run: Mapping[str, Any]) -> RecordDict:
    """One training round on this client: the reply's content. Refuses a global model that is not its bundle's."""
    from fblc.cli.data import batches as read_batches

    bundle = str(node["bundle"])
    manifest, _ = fmt.load_verified(bundle)
    start = as_numpy(content["arrays"])
    check_global(manifest, start)
    config = content["config"]
    steps = int(run["local-steps"])
    data, _ = read_batches(str(node["data"]), manifest)
    batches = _round_batches(data, int(config["server-round"]), steps)
    examples = len(data) * manifest["inputs"][0]["shape"][0]
    if ES_ITERATION in config:  # an ES round that sends seeds: the local device's runner reports its rewards
        from fblc.runtime.local import LocalRunner

        if str(node["device"]) != "local":
            raise FblcError("ES rounds that send seeds need --device local on this client (the adb runner reports "
                            "no per-member rewards yet)")
        spec = es_seeds.es_spec(bundle)
        runner = LocalRunner(bundle, progress=False)
        _upload(runner, start)
        report, losses = es_seeds.train_reporting_seeds(runner, batches, steps, int(config[ES_ITERATION]), spec.seed)
        arrays = ArrayRecord({REWARDS: Array(report.rewards)})
        metrics = {ES_SEED: report.seed, ES_ITERATION: report.iteration}
    else:
        trained, losses = device_trainer(str(node["device"]))(node, bundle, start, batches)
        arrays, metrics = as_record(trained), {}
    reply = RecordDict({"arrays": arrays, "metrics": MetricRecord({EXAMPLES: examples, LOSS: losses[-1], **metrics})})
    reply["metrics"][BYTES_UP] = payload_bytes(reply) + 8
    return reply


client_app = ClientApp()


@client_app.train()
def _client_train(msg: Message, context: Context) -> Message:
    return Message(content=train_reply(msg.content, context.node_config, context.run_config), reply_to=msg)


server_app = ServerApp()


@server_app.main()
def _server_main(grid: Grid, context: Context) -> None:
    run = context.run_config
    bundle, out = str(run["bundle"]), str(run["out"])
    manifest, _ = fmt.load_verified(bundle)
    figures = dict(manifest=manifest, out=out, timeout=float(run["round-timeout"]),
                   keep_replies=bool(run["keep-replies"]), fraction_train=float(run["fraction"]),
                   min_train_nodes=int(run["min-clients"]), min_available_nodes=int(run["min-clients"]))
    strategy = (SeedFedAvg(spec=es_seeds.es_spec(bundle), local_steps=int(run["local-steps"]), **figures)
                if bool(run["es-seeds"]) else LoggedFedAvg(**figures))
    result = strategy.start(grid=grid, initial_arrays=as_record(read_tensors(bundle)),
                            num_rounds=int(run["rounds"]), timeout=float(run["round-timeout"]))
    np.savez(f"{out}/global.npz", **as_numpy(result.arrays))
    print(f"fleet: the global model after {int(run['rounds'])} rounds: {out}/global.npz", flush=True)
