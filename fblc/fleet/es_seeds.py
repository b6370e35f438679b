"""ES rounds that send seeds: a client reports its Philox seed, first iteration and member rewards; the server
rebuilds the client's update from them with the same noise.

An ES step draws its perturbations eps [P, D] from Philox (fblc.compiler.philox: key `--seed`, counter
(texel, iteration, row)), so noise is a function of (seed, iteration) that the device and numpy compute alike.
The update is then a function of the 2P member rewards alone (fblc.compiler.es):

    z = z-scores of the rewards (0 where they agree to AGREEMENT), g = (1/2P) sum_i (z_i+ - z_i-) eps_i,
    grad = -sigma g,  and the optimizer's step from the round's global model.

A client that trained K steps from the global model theta_0, starting at iteration `it0`, sends (seed, it0,
rewards [K, 2P]): 8 K P bytes of float32 plus two integers, whatever the model's size (K = 4, P = 8: 256 B),
instead of D floats. The server replays the K steps from theta_0 with the optimizer the bundle was compiled with
(report.json `training`; SGD with momentum and weight decay, whose state starts at zero each round as the
client's does), which gives the client's model up to float32 rounding of the noise (the device's log, sqrt,
sin and cos are not numpy's to the ulp). Each client gets its own iterations (`iteration_base`), so no two
members of a round share noise.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from fblc import bundle_format as fmt
from fblc.compiler.philox import es_noise
from fblc.errors import FblcError

#: optimizers whose step the server can replay from the gradients alone (state zero at the round's start)
REPLAYABLE = ("sgd",)
#: float32 holds integers exactly up to 2^24: es.iteration is a float32 state
MAX_ITERATION = 2 ** 24


@dataclass(frozen=True)
class EsSpec:
    """What the server needs of a bundle to replay its ES steps."""

    pairs: int
    sigma: float
    seed: int
    optimizer: Mapping[str, Any]
    #: the trainable tensors in the order the noise's D columns run over them (the step's input order)
    shapes: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def width(self) -> int:
        return int(sum(np.prod(shape, dtype=np.int64) for _, shape in self.shapes))


@dataclass(frozen=True)
class SeedReport:
    """What an ES client sends instead of its model: its noise's seed and first iteration, the rewards."""

    seed: int
    iteration: int
    rewards: np.ndarray  # [K steps, 2P members], float32

    def nbytes(self) -> int:
        return int(self.rewards.astype(np.float32).nbytes) + 16  # two 64-bit integers


def es_spec(bundle: str) -> EsSpec:
    """The bundle's ES figures and optimizer (report.json `training`, written by `fblc compile`)."""
    manifest, _ = fmt.load_verified(bundle)
    with open(os.path.join(bundle, fmt.REPORT), encoding="utf-8") as handle:
        training = json.load(handle).get("training")
    if training is None or training.get("trainer") != "es":
        raise FblcError(f"{bundle} is no ES bundle (report.json training: {training})",
                        "compile it with --trainer es for rounds that send seeds")
    optimizer = training["optimizer"]
    if optimizer["name"] not in REPLAYABLE:
        raise FblcError(f"ES rounds that send seeds replay the clients' steps, and {optimizer['name']}'s cannot be "
                        "replayed from the rewards", f"compile the bundle with --optimizer "
                        f"{' or '.join(REPLAYABLE)}, or send the model (the default)")
    es = training["es"]
    shapes = tuple((p["name"], tuple(p["shape"])) for p in manifest["parameters"])
    return EsSpec(int(es["pairs"]), float(es["sigma"]), int(es["seed"]), optimizer, shapes)


def z_scores(rewards: np.ndarray) -> np.ndarray:
    """fblc.compiler.es.z_scores in numpy (float32, as the step computes it)."""
    from fblc.compiler.es import AGREEMENT  # imported here: fblc.compiler.es loads onnx_ir (2.8 s in every
    # flwr-clientapp process, which imports this module whether or not its round is ES)
    r = rewards.astype(np.float32)
    centred = r - r.mean(dtype=np.float32)
    std = np.sqrt(np.mean(centred * centred, dtype=np.float32))
    if not std > np.max(np.abs(r)) * np.float32(AGREEMENT):
        return np.zeros_like(r)
    return centred / max(std, np.float32(1e-30))


def direction(spec: EsSpec, iteration: int, rewards: np.ndarray) -> np.ndarray:
    """g [D] of one step: the noise of `iteration` weighted by the z-scored antithetic reward differences."""
    if rewards.shape != (2 * spec.pairs,):
        raise FblcError(f"an ES step has {2 * spec.pairs} member rewards, the report holds {rewards.shape[0]}")
    z = z_scores(rewards)
    weights = (z[:spec.pairs] - z[spec.pairs:]) / np.float32(2 * spec.pairs)
    return (weights.astype(np.float64) @ es_noise(spec.seed, iteration, (spec.pairs, spec.width)).astype(np.float64)
            ).astype(np.float32)


def replay(spec: EsSpec, start: Mapping[str, np.ndarray], report: SeedReport) -> dict[str, np.ndarray]:
    """The client's model after its K steps from `start` (the round's global model), from its seed report."""
    if report.seed != spec.seed:
        raise FblcError(f"the client's noise seed {report.seed} is not the bundle's {spec.seed}",
                        "server and clients must use bundles compiled with one --seed")
    if report.iteration < 0 or report.iteration + len(report.rewards) > MAX_ITERATION:
        raise FblcError(f"ES iterations {report.iteration}..{report.iteration + len(report.rewards)} leave "
                        f"[0, {MAX_ITERATION}) (es.iteration is a float32 counter)")
    lr, momentum, decay = (float(spec.optimizer[k]) for k in ("lr", "momentum", "weight_decay"))
    theta = np.concatenate([np.asarray(start[name], np.float32).reshape(-1) for name, _ in spec.shapes])
    buffer = np.zeros_like(theta)
    for step, rewards in enumerate(np.asarray(report.rewards, np.float32)):
        grad = -np.float32(spec.sigma) * direction(spec, report.iteration + step, rewards)
        if decay:
            grad = grad + np.float32(decay) * theta
        if momentum:
            buffer = np.float32(momentum) * buffer + grad
            grad = buffer
        theta = theta - np.float32(lr) * grad
    out, offset = {}, 0
    for name, shape in spec.shapes:
        size = int(np.prod(shape, dtype=np.int64))
        out[name] = theta[offset:offset + size].reshape(shape)
        offset += size
    return out


def iteration_base(server_round: int, client: int, steps: int, clients: int) -> int:
    """Client `client`'s first ES iteration in round `server_round` (1-based): disjoint across clients and rounds."""
    first = ((server_round - 1) * clients + client) * steps
    if first + steps > MAX_ITERATION:
        raise FblcError(f"round {server_round} of {clients} clients x {steps} ES steps passes es.iteration's "
                        f"{MAX_ITERATION} exact float32 values", "use fewer rounds, clients or local steps")
    return first


def train_reporting_seeds(runner: Any, batches: Sequence[Mapping[str, np.ndarray]], steps: int, iteration: int,
                          seed: int) -> tuple[SeedReport, list[float]]:
    """K ES steps on a LocalRunner from its current parameters, its optimizer state as compiled (zero: what the
    replay assumes, also on a runner reused across rounds) and its noise counter set to `iteration`; the seed
    report of what it did and the losses."""
    from fblc.compiler.es import ITERATION  # (onnx_ir: see z_scores)
    from fblc.fleet.trainers import initial_tensors

    initial = initial_tensors(runner.bundle, runner.manifest["states"])
    for state in runner.manifest["states"]:
        value = np.array(iteration, np.float32) if state["name"] == ITERATION else initial[state["name"]]
        runner.upload(state["texture"], value)
    rewards, losses = [], []
    for step in range(steps):
        losses.append(float(runner.step(batches[step % len(batches)])))
        rewards.append(runner.read_before_swap("rewards"))
    return SeedReport(seed, iteration, np.stack(rewards).astype(np.float32)), losses


def aggregate(spec: EsSpec, start: Mapping[str, np.ndarray], reports: Sequence[tuple[SeedReport, int]]
              ) -> dict[str, np.ndarray]:
    """FedAvg (weighted by examples) of the clients' replayed models."""
    total = sum(examples for _, examples in reports)
    if total <= 0:
        raise FblcError("no client reported examples in this round")
    models = [(replay(spec, start, report), examples) for report, examples in reports]
    return {name: sum(model[name].astype(np.float64) * (examples / total) for model, examples in models
                      ).astype(np.float32) for name, _ in spec.shapes}
