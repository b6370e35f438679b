"""fblc.fleet: Flower rounds around a bundle, in graph mode (the step ONNX in onnxruntime; no PoCL).

One Flower simulation (Ray starts once: the slow part): 3 clients, 2 rounds of a MemFLoRA bundle of
examples/fleet_digits.py's CNN on 240 of scikit-learn's digits; the global model after the last round must be
numpy's FedAvg of what the clients returned (weighted by their rows, 1e-6), and only U travels. Without Flower:
averaging MemFLoRA's U averages the merged weights exactly (P is shared), where LoRA's averaged factors do not;
the client's FedProx step; a client refuses a global model whose names or shapes differ from its bundle; the
partitions. Cost (2 cores, cold): ~10 CPU s, 33 s wall, 18 s of it the simulation (Ray's start).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from fblc.cli import main
from fblc.errors import FblcError
from fblc.fleet import report
from fblc.fleet.client import FleetSpec, client_rows, local_training
from fblc.fleet.data import partition
from fblc.fleet.server import ServerSpec
from fblc.fleet.trainers import initial_parameters, trainer_for
from fblc.tools.export import exported_model

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from fleet_digits import build_digits_cnn  # noqa: E402

ROWS = 240
#: the tests of fleet_folder run on one xdist worker, which compiles its two bundles and step graphs once
FOLDER_GROUP = pytest.mark.xdist_group("fleet-folder")


@pytest.fixture(scope="module")
def fleet_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    """digits.npz (240 digits) and, per adapter, a bundle and its step ONNX (batch 8, SGD lr 0.1)."""
    sklearn = pytest.importorskip("sklearn.datasets")
    folder = str(tmp_path_factory.mktemp("fleet"))
    model = build_digits_cnn(os.path.join(folder, "digits_cnn.onnx"), batch=8)
    digits = sklearn.load_digits()
    np.savez(os.path.join(folder, "digits.npz"), pixels=(digits.images[:ROWS, None] / 16.0).astype(np.float32),
             labels=digits.target[:ROWS].astype(np.int64))
    for adapter in ("memflora", "lora"):
        flags = ["--optimizer", "sgd", "--lr", "0.1", "--adapter", adapter, "--rank", "2", "-q"]
        assert main(["compile", model, "--target", "adreno830", "-o", os.path.join(folder, adapter), *flags]) == 0
        assert main(["train-graph", model, "-o", os.path.join(folder, f"{adapter}.step.onnx"), *flags]) == 0
    return folder


def spec(folder: str, adapter: str, clients: int = 3, scheme: str = "dirichlet:0.5") -> FleetSpec:
    return FleetSpec(os.path.join(folder, adapter), os.path.join(folder, "digits.npz"), clients, scheme,
                     local_steps=2, device="graph", step=os.path.join(folder, f"{adapter}.step.onnx"))


@FOLDER_GROUP
def test_simulation_aggregates_as_numpy_fedavg(fleet_folder: str) -> None:
    from fblc.fleet.simulate import simulate

    fleet = spec(fleet_folder, "memflora")
    lines: list[str] = []
    history = simulate(fleet, ServerSpec(rounds=2, local_steps=2), workers=1, say=lines.append, keep_replies=True)
    replies = history.replies[2]
    assert len(replies) == 3 and len(history.rounds) == 3 and len(lines) == 3
    assert sorted(n for _, n in replies) == sorted(len(client_rows(fleet, c)) for c in range(3))
    for tensors, _ in replies:  # only what trains travels: MemFLoRA's U, not the frozen model
        assert sorted(tensors) == ["conv2.adapter_U"]
    weights = np.array([n for _, n in replies], np.float64)
    for name, value in history.final.items():
        expected = sum(w * t[name].astype(np.float64) for (t, _), w in zip(replies, weights)) / weights.sum()
        np.testing.assert_allclose(value, expected, rtol=0, atol=1e-6)
        assert np.abs(value - history.replies[1][0][0][name]).max() > 1e-6  # round 2 moved it
    assert history.rounds[2]["bytes_up_per_client"] > 4 * 64 * 2 * 9  # U's floats and Flower's header
    assert "conv2.adapter_U" not in report.table(history.rounds, None) and len(report.table(history.rounds, None)
                                                                               .splitlines()) == 4


def _merged(bundle: str, tensors: dict[str, np.ndarray]) -> np.ndarray:
    model, _ = exported_model(bundle, tensors, "test")
    return model.graph.initializers["conv2.weight"].const_value.numpy().astype(np.float64)


@FOLDER_GROUP
def test_memflora_averaging_u_averages_the_weight_updates(fleet_folder: str) -> None:
    """Two clients train U on different rows; the model of the averaged U is the average of their models (P is
    the bundle's, shared by every client); LoRA's averaged P and U are not the average of its clients' models."""
    gaps = {}
    for adapter in ("memflora", "lora"):
        fleet = spec(fleet_folder, adapter, clients=2, scheme="by-label")
        start = initial_parameters(fleet.bundle)
        trained = [local_training(fleet, client, start, {"local-steps": 20})[0] for client in (0, 1)]
        weights = np.array([len(client_rows(fleet, c)) for c in (0, 1)], np.float64) / ROWS * 1.25
        average = {name: sum(w * t[name] for t, w in zip(trained, weights)) / weights.sum() for name in start}
        separate = sum(w * _merged(fleet.bundle, t) for t, w in zip(trained, weights)) / weights.sum()
        assert np.abs(_merged(fleet.bundle, trained[0]) - _merged(fleet.bundle, trained[1])).max() > 1e-3
        gaps[adapter] = float(np.abs(_merged(fleet.bundle, average) - separate).max())
    assert gaps["memflora"] < 1e-6, gaps  # measured 5.6e-9
    # measured 2.5e-4: the cross term of the two factors' updates, which averaging does not preserve
    assert gaps["lora"] > 100 * max(gaps["memflora"], 1e-8), gaps


@FOLDER_GROUP
def test_fedprox_step_pulls_toward_the_global_model(fleet_folder: str) -> None:
    """The client's proximal step w -= lr * mu * (w - w_global): at lr * mu = 1 it lands on the global tensors, at
    0.5 halfway between the plain step's result and them (one local step)."""
    fleet = spec(fleet_folder, "memflora")
    start = {k: v + 0.01 for k, v in initial_parameters(fleet.bundle).items()}
    plain = local_training(fleet, 0, start, {"local-steps": 1})[0]
    pulled = local_training(fleet, 0, start, {"local-steps": 1, "proximal-mu": 1.0, "proximal-lr": 1.0})[0]
    half = local_training(fleet, 0, start, {"local-steps": 1, "proximal-mu": 0.5, "proximal-lr": 1.0})[0]
    for name in start:
        assert np.abs(plain[name] - start[name]).max() > 1e-4
        np.testing.assert_allclose(pulled[name], start[name], rtol=0, atol=1e-7)
        np.testing.assert_allclose(half[name], (plain[name] + start[name]) / 2, rtol=0, atol=1e-7)


@FOLDER_GROUP
def test_client_refuses_a_global_model_of_another_bundle(fleet_folder: str) -> None:
    fleet = spec(fleet_folder, "memflora")
    trainer = trainer_for(fleet.bundle, "graph", fleet.step)
    good = initial_parameters(fleet.bundle)
    with pytest.raises(FblcError, match="global tensor 'conv2.adapter_U' has shape \\[32, 2, 3, 3\\]; the step "
                                        "trains it as \\[64, 2, 3, 3\\]"):
        trainer.set_parameters({"conv2.adapter_U": np.zeros((32, 2, 3, 3), np.float32)})
    with pytest.raises(FblcError, match="has tensor 'conv2.adapter_P', which the step does not train"):
        trainer.set_parameters({**good, "conv2.adapter_P": np.zeros((2, 32, 1, 1), np.float32)})
    with pytest.raises(FblcError, match="lacks 'conv2.adapter_U'"):
        trainer.set_parameters({})
    with pytest.raises(FblcError, match="does not train what bundle"):
        trainer_for(fleet.bundle, "graph", os.path.join(fleet_folder, "lora.step.onnx"))
    assert main(["fleet", "simulate", fleet.bundle, "--data", fleet.data, "--partition", "dirichlet:0", "-q"]) == 2


@pytest.mark.parametrize("scheme", ["iid", "dirichlet:0.1", "by-label"])
def test_partitions_cover_every_row_once(scheme: str) -> None:
    labels = np.random.default_rng(0).integers(0, 10, 500)
    parts = partition(labels, 40, scheme, seed=1)
    assert len(parts) == 40 and min(len(p) for p in parts) >= 1
    assert sorted(np.concatenate(parts).tolist()) == list(range(500))
    classes = np.mean([len(np.unique(labels[p])) for p in parts])
    assert classes < 5 if scheme != "iid" else classes > 7  # the non-IID splits give each client few classes
