"""The fuzzer's seeded run (fblc/tools/fuzz.py), its generator, and the findings it made.

The CI run checks 300 random graphs (4 of them on the local OpenCL device under both layouts) and
400 broken files in under a minute; `python -m fblc.tools.fuzz --graphs 3000 ...` is the long run.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest

from fblc.compiler.model_io import load_model
from fblc.errors import ModelLoadError
from fblc.tools import fuzz
from fblc.tools.random_graphs import random_graph


def test_seeded_run_finds_nothing(tmp_path) -> None:
    summary = fuzz.fuzz(graphs=300, seed=0, device_every=75, mutations=400, workdir=str(tmp_path))
    assert summary.graphs == 300 and summary.device_graphs == 4 and summary.mutations == 400
    assert summary.findings == [], "\n".join(str(f) for f in summary.findings)
    assert summary.ops is not None and len(summary.ops) >= 40, sorted(summary.ops)


def test_generated_graphs_are_valid_and_differ() -> None:
    graphs = [random_graph(seed) for seed in range(20)]
    for graph in graphs:
        onnx.checker.check_model(graph.model, full_check=True)
    assert len({graph.model.SerializeToString() for graph in graphs}) == 20
    assert random_graph(7).model.SerializeToString() == random_graph(7).model.SerializeToString()


def test_a_wrong_gradient_rule_is_found(monkeypatch, tmp_path) -> None:
    """Negative case: Tanh's gradient 5 % too large is a `gradient` finding in most graphs that use it."""
    from fblc.compiler.autodiff import GRADIENTS

    assert "Tanh" in GRADIENTS
    rule = GRADIENTS._entries["Tanh"]

    def five_percent_off(e, node, grads, needed):  # type: ignore[no-untyped-def]
        return [None if g is None else e.op("Mul", g, e.scalar(1.05, g)) for g in rule(e, node, grads, needed)]

    monkeypatch.setitem(GRADIENTS._entries, "Tanh", five_percent_off)
    seeds = [seed for seed in range(60) if "Tanh" in random_graph(seed).ops]
    stages = [[f.stage for f in fuzz.check_graph(seed, str(tmp_path))[1]] for seed in seeds]
    # a Tanh on a side branch (a Concat's) moves the parameters' gradients by less than 1 %
    assert sum(found == ["gradient"] for found in stages) >= len(seeds) // 2, list(zip(seeds, stages))
    assert all(found in ([], ["gradient"]) for found in stages)


def _write(tmp_path, name: str, data: bytes) -> str:
    path = os.path.join(tmp_path, name)
    with open(path, "wb") as handle:
        handle.write(data)
    return path


@pytest.mark.parametrize("seed", [437, 1381, 1565])
def test_finding_a_name_that_is_not_utf8_is_a_load_error(seed: int, tmp_path) -> None:
    """Finding: a flipped byte in a node name reached onnx_ir as bytes and crashed the shape
    inference's serialisation (SerdeError from ir.to_proto)."""
    rng = np.random.default_rng(seed)
    path = _write(tmp_path, "mutant.onnx", fuzz.MUTATIONS["flipped"](random_graph(seed).model, rng))
    with pytest.raises(ModelLoadError, match="not UTF-8"):
        load_model(path)


@pytest.mark.parametrize("seed", [29, 53])
def test_finding_checker_utf8_crash_is_a_load_error(seed: int, tmp_path) -> None:
    """Finding: onnx's checker raised UnicodeDecodeError on a flipped byte inside a string field."""
    rng = np.random.default_rng(seed)
    path = _write(tmp_path, "mutant.onnx", fuzz.MUTATIONS["flipped"](random_graph(seed).model, rng))
    with pytest.raises(ModelLoadError, match="not UTF-8"):
        load_model(path)


@pytest.mark.parametrize("kind", sorted(fuzz.MUTATIONS))
def test_each_mutation_kind_gives_a_clear_error_or_a_step(kind: str, tmp_path) -> None:
    seed = sorted(fuzz.MUTATIONS).index(kind)  # check_mutation picks the kind from the seed
    assert fuzz.check_mutation(seed, str(tmp_path)) == (kind, None)
