"""Several small kernel-test models as one step: one PoCL build for all of them, each case judged on its own rows.

The suite's time is mostly PoCL building kernels from a cold cache, and a small case pays more for its
program (the OpenCL C front end over the preamble, the optimizer and loss kernels, the runner) than for its
own kernels: 16 unary activations one model each cost 16 x 1.1 CPU s, merged 3.7 to 4.9 CPU s. `merged`
renames each case's values and nodes under a prefix, puts the graphs side by side and sums their scalar
losses into one `loss`; `verify_model` runs that step once, and `rows_of` hands each case the rows of its
own parameters. Each case's branch is the graph it was alone (the same ops, shapes and attributes, its loss
seeded by Sum's gradient of 1 as the lone loss is by 1): `merged` checks that fuse put no two cases' nodes in
one kernel, so the kernels each case runs are the kernels it ran alone.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import replace
from unittest import mock

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from fblc.compiler import keys
from fblc.passes import fuse
from fblc.passes.pipeline import TrainingOptions
from fblc.tools.verify import Comparison, verify_model

SEPARATOR = "__"
#: each case's loss times a trainable scalar of its own: that scalar's gradient is the case's loss, a row of the
#: case's own (a plain sum would judge a case's forward only within the merged loss's tolerance, diluted)
LOSS_SCALE = "loss_scale"
LOSS_NODE = "merged_loss"
#: in the names of each case's last node (its loss) and of its scale's Mul: the loss side, not the case's subject.
#: fuse folds total reductions of one stage into one kernel, so the cases' losses may share one
HARNESS = "loss_harness"  # the Sum of the cases' losses, which fuse may join with their ReduceSums


def _renamed(model: onnx.ModelProto, prefix: str) -> onnx.GraphProto:
    graph = onnx.GraphProto()
    graph.CopyFrom(model.graph)

    def name(value: str) -> str:
        return f"{prefix}{SEPARATOR}{value}" if value else value

    for node in graph.node:
        node.name = name(node.name or node.output[0])
        node.input[:] = [name(v) for v in node.input]
        node.output[:] = [name(v) for v in node.output]
    for values in (graph.input, graph.output, graph.value_info):
        for value in values:
            value.name = name(value.name)
    for tensor in graph.initializer:
        tensor.name = name(tensor.name)
    return graph


def merged(cases: dict[str, onnx.ModelProto]) -> onnx.ModelProto:
    """One model of `cases` (id -> a model whose one output is a scalar loss), its output `loss` their Sum."""
    assert cases and all(SEPARATOR not in case for case in cases)
    opsets = {model.opset_import[0].version for model in cases.values()}
    nodes, inputs, initializers, losses = [], [], [], []
    for index, (case, model) in enumerate(cases.items()):
        assert len(model.graph.output) == 1, case
        graph = _renamed(model, case)
        last = next(node for node in graph.node if graph.output[0].name in node.output)
        last.name = f"{case}{SEPARATOR}{HARNESS}_loss"  # the case's loss: harness, as the Sum of them
        nodes += graph.node
        inputs += graph.input
        initializers += graph.initializer
        # a scale of its own per case (tie_weights would make equal ones one parameter)
        scale = f"{case}{SEPARATOR}{LOSS_SCALE}"
        initializers.append(numpy_helper.from_array(np.array(1 + (index + 1) / 256, np.float32), scale))
        nodes.append(helper.make_node("Mul", [graph.output[0].name, scale], [f"{scale}d"], name=f"{case}{SEPARATOR}{HARNESS}_scale"))
        losses.append(f"{scale}d")
    nodes.append(helper.make_node("Sum", losses, ["loss"], name=LOSS_NODE))
    graph = helper.make_graph(nodes, "merged", inputs, [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                              initializer=initializers)
    # the cases' ops are the same at every opset from 18 on that they are written at (Gelu needs 20)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", max(opsets))])
    onnx.checker.check_model(model)
    return model


def case_of(name: str, cases: list[str]) -> str | None:
    """The case whose prefix `name` (a value or node name of the step) holds: at its start or after a '/' (the
    backward's and optimizer's names, `grad/CASE__node/...`), up to the first separator."""
    found = {match for match in re.findall(rf"(?:^|/)(\w+?){SEPARATOR}", name) if match in cases}
    return found.pop() if len(found) == 1 else None


def assert_no_kernel_spans_two_cases(step: ir.Model, cases: list[str]) -> None:
    """fuse put each kernel's nodes in one case (the loss side aside: each case's loss and scale, their Sum; harness,
    not subject): each case runs the kernels of its op that it ran alone."""
    loss_kernels = {node.metadata_props.get(keys.KERNEL) for node in step.graph if node.name == LOSS_NODE}
    cases_of_kernel: dict[str, set[str]] = {}
    for node in step.graph:
        kernel = node.metadata_props.get(keys.KERNEL)
        if not kernel or kernel == "alias" or kernel in loss_kernels or f"{SEPARATOR}{HARNESS}" in (node.name or ""):
            continue
        names = [node.name or ""] + [v.name for v in (*node.inputs, *node.outputs) if v is not None and v.name]
        cases_of_kernel.setdefault(kernel, set()).update(c for c in (case_of(n, cases) for n in names) if c)
    mixed = {kernel: found for kernel, found in cases_of_kernel.items() if len(found) > 1}
    assert not mixed, mixed
    assert set().union(*cases_of_kernel.values()) == set(cases), "a case has no kernel"


def rows_of(rows: list[Comparison], case: str, cases: list[str]) -> list[Comparison]:
    """The rows of `case`'s own outputs (its parameters' gradients and updates), and the merged loss."""
    return [row for row in rows if case_of(row.name, cases) == case or row.name == "loss"]


def verify_merged(cases: dict[str, onnx.ModelProto], options: TrainingOptions, folder: str, target: str = "local",
                  dtype: str = "fp32", storage: str = "image",
                  feeds: dict[str, dict[str, np.ndarray]] | None = None) -> list[Comparison]:
    """`verify_model`'s rows of one step of all `cases` merged (each case's kernels its own: checked first)."""
    from fblc.codegen.compile import compile_model

    path = os.path.join(folder, "merged.onnx")
    onnx.save(merged(cases), path)
    # fuse folds reductions of one signature from different sites (BatchNorm sites of one map shape) into one
    # kernel: here the sites are different cases, each of which ran its reductions in kernels of its own alone
    with mock.patch.object(fuse, "SAME_SHAPE_REDUCTIONS", 1):
        step, _ = compile_model(path, os.path.join(folder, "bundle"), target, dtype, replace(options, dtype=dtype))
        assert_no_kernel_spans_two_cases(step, list(cases))
        fed = {f"{case}{SEPARATOR}{name}": value for case, values in (feeds or {}).items()
               for name, value in values.items()}
        return verify_model(path, options, target=target, dtype=dtype, storage=storage, feeds=fed or None)


def assert_case_matches(rows: list[Comparison], case: str, cases: list[str]) -> None:
    """`case`'s own rows match; the merged loss's row counts against it only where no case's own rows fail (a case
    that is off moves the sum too: that case's test fails, not every test of its step; a sum off with every case
    right is the harness's, and fails them all)."""
    own = rows_of(rows, case, cases)
    assert len(own) > 1, f"{case}: no rows of its own"
    bad = [row for row in own if not row.ok and row.name != "loss"]
    if not any(not row.ok and case_of(row.name, cases) for row in rows):
        bad += [row for row in own if row.name == "loss" and not row.ok]
    assert not bad, "\n".join(f"{r.name}: max_abs {r.max_abs:.3g} max_rel {r.max_rel:.3g}" for r in bad)


class MergedCases:
    """Cases registered as a test module is imported (id -> model), run `chunk` to a merged step when a test first
    asks for a case of that chunk, in the order they were added (PoCL's time per kernel grows with its program,
    so ~12 cases a build, not all in one). Each case's initializers must differ from the other cases' (draw them
    with a seed of the case's own): tie_weights would make equal ones one parameter, and that case no rows."""

    def __init__(self, options: TrainingOptions, chunk: int = 12, target: str = "local") -> None:
        self.options, self.chunk, self.target = options, chunk, target
        self.models: dict[str, onnx.ModelProto] = {}
        self.feeds: dict[str, dict[str, np.ndarray]] = {}  # case -> its fed inputs (by their names in the case)
        self._rows: dict[int, list[Comparison] | Exception] = {}

    def add(self, case: str, model: onnx.ModelProto, feeds: dict[str, np.ndarray] | None = None) -> None:
        assert case not in self.models and SEPARATOR not in case, case
        self.models[case] = model
        self.feeds[case] = feeds or {}

    def check(self, case: str, folder: Callable[[str], str]) -> None:
        """`case`'s rows of its chunk's step (built in `folder(name)` on first use) all match onnxruntime's."""
        names = list(self.models)
        index = names.index(case) // self.chunk
        group = names[index * self.chunk:(index + 1) * self.chunk]
        if index not in self._rows:
            try:
                self._rows[index] = verify_merged({c: self.models[c] for c in group}, self.options,
                                                  folder(f"merged{index}"), self.target,
                                                  feeds={c: self.feeds[c] for c in group})
            except Exception as error:  # the chunk's other tests fail on it too, without building it again
                self._rows[index] = error
        rows = self._rows[index]
        if isinstance(rows, Exception):
            raise rows
        assert_case_matches(rows, case, group)
