"""`fblc fleet simulate`: Flower's simulation engine (on Ray) runs the ServerApp and one ClientApp per simulated
client on this machine, and the same number of steps is trained centrally for comparison.

Ray runs the clients in `workers` worker processes (one CPU each); each worker builds the bundle's trainer once
and serves every client scheduled on it. The central run trains the same trainer on all training rows for
rounds x (clients per round) x (local steps) steps and is evaluated, like the fleet, after each round's worth
of steps, so both curves are over the same number of steps.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import replace
from typing import Callable

import numpy as np

from fblc.fleet.client import FleetSpec, client_app, split
from fblc.fleet.data import batches
from fblc.fleet.es_seeds import es_spec
from fblc.fleet.evaluate import Evaluator
from fblc.fleet.server import History, ServerSpec, server_app
from fblc.fleet.trainers import device_kind, initial_parameters, trainer_for
from fblc.runtime.opencl import select_device
from fblc.errors import FblcError

#: Ray's shared-memory object store: the messages are small (a model's trainable tensors)
OBJECT_STORE_BYTES = 128 << 20


#: Flower's warnings about what the fleet does on purpose: run_simulation (the Python entry of its simulation engine,
#: deprecated in favour of the `flwr run` CLI) and no client-side evaluation (the server evaluates)
EXPECTED_WARNINGS = ("The `run_simulation` function is deprecated", "fraction_evaluate is set to 0.0")


def _failures_only(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    if any(expected in message for expected in EXPECTED_WARNINGS):
        return False
    return record.levelno >= logging.WARNING or "error" in message.lower()


def clients_per_round(fleet: FleetSpec, server: ServerSpec) -> int:
    """How many clients Flower samples each round (FedAvg.configure_train's rule)."""
    return max(int(fleet.clients * server.fraction), server.min_train)


def simulate(fleet: FleetSpec, server: ServerSpec, workers: int = 2, say: Callable[[str], None] = print,
             keep_replies: bool = False, flower_log: bool = False) -> History:
    """Run the fleet in Flower's simulation engine; the History of its rounds."""
    from flwr.simulation import run_simulation

    split(fleet)  # a bad --data, partition or device fails here, before Ray starts
    if device_kind(fleet.device) == "graph":  # an onnxruntime session: cheap (a kernel build is not: the workers')
        trainer_for(fleet.bundle, fleet.device, fleet.step)
    else:  # the OpenCL device exists (the workers build the kernels)
        select_device(None if fleet.device == "local" else fleet.device)
    history = History(keep_replies=keep_replies)
    evaluator = Evaluator(fleet.bundle, split(fleet)[1], fleet.batch)
    server = replace(server, min_available=min(server.min_available or fleet.clients, fleet.clients))
    backend = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
               "init_args": {"num_cpus": workers, "include_dashboard": False, "log_to_driver": flower_log,
                             "object_store_memory": OBJECT_STORE_BYTES}}  # Flower gives Ray's workers our sys.path
    logger = logging.getLogger("flwr")
    if not flower_log:  # Flower's round-by-round INFO lines, but not the replies that failed and why
        logger.addFilter(_failures_only)
    try:
        with warnings.catch_warnings():  # Ray's notice about GPU variables: the clients ask for no GPU
            warnings.filterwarnings("ignore", message="Tip: In future versions of Ray", category=FutureWarning)
            run_simulation(server_app(server, initial_parameters(fleet.bundle), evaluator, history, say,
                                      es_spec(fleet.bundle) if server.es_seeds else None),
                           client_app(fleet), num_supernodes=fleet.clients, backend_config=backend,
                           verbose_logging=flower_log)
    finally:
        logger.removeFilter(_failures_only)
    if len(history.rounds) != server.rounds + 1:
        raise FblcError(f"the simulation stopped after {len(history.rounds) - 1} of {server.rounds} rounds",
                        "Flower's log above says why (rerun with --flower-log for all of it)")
    return history


def central(fleet: FleetSpec, server: ServerSpec, say: Callable[[str], None] = print) -> list[dict[str, float]]:
    """The same trainer on all training rows, as many steps as the fleet trains per round, evaluated each round."""
    train, test, _ = split(fleet)
    trainer = trainer_for(fleet.bundle, fleet.device, fleet.step)
    trainer.set_parameters(initial_parameters(fleet.bundle))
    evaluator = Evaluator(fleet.bundle, test, fleet.batch)
    per_round = clients_per_round(fleet, server) * server.local_steps
    feed = batches(train, fleet.batch, seed=(fleet.seed, 1 << 30))
    rounds = [{"round": 0.0, "steps": 0.0, **evaluator(trainer.parameters())}]
    for index in range(1, server.rounds + 1):
        losses = [trainer.step(next(feed)) for _ in range(per_round)]
        rounds.append({"round": float(index), "steps": float(index * per_round), "train_loss": float(np.mean(losses)),
                       **evaluator(trainer.parameters())})
    say(f"central: {server.rounds * per_round} steps on all {len(train)} training rows, held-out loss "
        f"{rounds[-1]['loss']:.4f}" + (f", accuracy {rounds[-1]['accuracy']:.3f}" if "accuracy" in rounds[-1] else ""))
    return rounds
