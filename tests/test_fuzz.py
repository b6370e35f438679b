"""The fuzzer's seeded run (fblc/tools/fuzz.py), its generator, and the findings it made.

The CI run (CI_GRAPHS random graphs, every CI_DEVICE_EVERY-th of them also on the local OpenCL
device under both layouts, and CI_MUTATIONS broken files: the figures are stated there alone, and
README's sentence on it is checked against them) takes about 30 s; `python -m fblc.tools.fuzz
--graphs 3000 ...` is the long run.
"""

from __future__ import annotations

import os
import re
import types

import numpy as np
import onnx
import pytest

from fblc.compiler.model_io import load_model
from fblc.errors import ModelLoadError
from fblc.tools import fuzz
from fblc.tools.random_graphs import random_graph

CI_GRAPHS, CI_DEVICE_EVERY, CI_MUTATIONS = 200, 100, 300
README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def test_seeded_run_finds_nothing(tmp_path) -> None:
    summary = fuzz.fuzz(graphs=CI_GRAPHS, seed=0, device_every=CI_DEVICE_EVERY, mutations=CI_MUTATIONS,
                        workdir=str(tmp_path))
    assert summary.graphs == CI_GRAPHS and summary.mutations == CI_MUTATIONS
    assert summary.device_graphs == CI_GRAPHS // CI_DEVICE_EVERY
    assert summary.findings == [], "\n".join(str(f) for f in summary.findings)
    assert summary.ops is not None and len(summary.ops) >= 44, sorted(summary.ops)


def test_the_readme_states_the_ci_run_s_figures() -> None:
    """README's "CI runs N graphs (D on the device) and M broken files" is this module's CI run (it said
    300 and 400 while CI ran 200 and 300)."""
    text = " ".join(open(README, encoding="utf-8").read().split())
    stated = re.search(r"CI runs (\d+) graphs \((\d+) on the device\) and (\d+) broken files", text)
    assert stated, "README no longer states the fuzzer's CI run"
    assert tuple(map(int, stated.groups())) == (CI_GRAPHS, CI_GRAPHS // CI_DEVICE_EVERY, CI_MUTATIONS)


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


@pytest.mark.parametrize("findings", [0, 1, 10, 20])
def test_the_exit_code_is_1_when_any_finding_was_made(findings: int, monkeypatch, tmp_path, capsys) -> None:
    """Each of 10 graphs finds `findings` // 10 (or one graph finds one): 10 and 20 findings exit 1 too (the
    summary line "10 findings" contains "0 findings", which the exit code once looked for)."""
    per_graph = [[fuzz.Finding(seed, "gradient", "planted")] * (findings // 10) for seed in range(10)]
    if findings == 1:
        per_graph[3] = [fuzz.Finding(3, "gradient", "planted")]
    monkeypatch.setattr(fuzz, "check_graph",
                        lambda seed, workdir, device=False: (types.SimpleNamespace(ops=["Relu"]), per_graph[seed]))
    code = fuzz.main(["--graphs", "10", "--mutations", "0", "--device-every", "0", "--keep", str(tmp_path)])
    assert f"broken files: {findings} findings" in capsys.readouterr().out
    assert code == (1 if findings else 0)


def _write(tmp_path, name: str, data: bytes) -> str:
    path = os.path.join(tmp_path, name)
    with open(path, "wb") as handle:
        handle.write(data)
    return path


def _two_relus() -> bytes:
    """x -> Relu (node 'first_node', output 'middle') -> Relu -> y, serialised."""
    nodes = [onnx.helper.make_node("Relu", ["x"], ["middle"], name="first_node"),
             onnx.helper.make_node("Relu", ["middle"], ["y"], name="second_node")]
    value = [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [2, 3]) for n in ("x", "y")]
    graph = onnx.helper.make_graph(nodes, "g", value[:1], value[1:])
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)]).SerializeToString()


def test_finding_a_node_name_that_is_not_utf8_is_a_load_error(tmp_path) -> None:
    """Finding (flipped bytes, e.g. seed 205): a node name with non-UTF-8 bytes reached onnx_ir as bytes and
    crashed the shape inference's serialisation (SerdeError from ir.to_proto)."""
    path = _write(tmp_path, "name.onnx", _two_relus().replace(b"first_node", b"fir\x98t_node"))
    with pytest.raises(ModelLoadError, match="node name b'fir\\\\x98t_node' of a Relu node is not UTF-8"):
        load_model(path)


def test_finding_an_input_name_that_is_not_utf8_is_a_load_error(tmp_path) -> None:
    """Finding (flipped bytes, e.g. seeds 29, 157): onnx's checker raised UnicodeDecodeError on a node
    input name with non-UTF-8 bytes."""
    data = _two_relus()
    second = data.index(b"middle", data.index(b"middle") + 1)  # the second Relu's input, not the output
    path = _write(tmp_path, "input.onnx", data[:second] + b"mid\xa3le" + data[second + len(b"middle"):])
    with pytest.raises(ModelLoadError, match="not UTF-8"):
        load_model(path)


def test_finding_a_type_that_onnx_ir_cannot_read_is_a_load_error(tmp_path) -> None:
    """Finding (flipped bytes, seed 5765): an initializer of data type 54 passes onnx's checker, and
    onnx_ir's deserialisation raised SerdeError."""
    bias = onnx.numpy_helper.from_array(np.ones(3, np.float32), "bias")
    bias.data_type = 54
    values = [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [3]) for n in ("x", "y")]
    graph = onnx.helper.make_graph([onnx.helper.make_node("Add", ["x", "bias"], ["y"], name="add")], "g",
                                   values[:1], values[1:], [bias])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)])
    path = _write(tmp_path, "type.onnx", model.SerializeToString())
    with pytest.raises(ModelLoadError, match="54 is not a valid DataType"):
        load_model(path)


@pytest.mark.parametrize("kind", sorted(fuzz.MUTATIONS))
def test_each_mutation_kind_gives_a_clear_error_or_a_step(kind: str, tmp_path) -> None:
    seed = sorted(fuzz.MUTATIONS).index(kind)  # check_mutation picks the kind from the seed
    assert fuzz.check_mutation(seed, str(tmp_path)) == (kind, None)
