"""Strict shape inference: onnx's C++ inference over a weightless copy, merged back into the IR.

Every value must end with a static shape. Those that do not are reported all at once
(`shape_gaps`): nodes of an op onnx has no shape inference for (another domain's op, an
unregistered function) and nodes whose shape depends on data although their inputs are static.
Nodes left unknown only because an input is unknown are not named: the node that caused it is.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import onnx
import onnx_ir as ir

from fblc.errors import FblcError, ShapeError, UnsupportedOpError
from fblc.compiler.gaps import DEFAULT_DOMAINS, OpGap, describe_gaps, describe_nodes, group_by_op

_INLINE_LIMIT = 1024  # bytes; larger initializers go to inference as typed inputs, without data


def _weightless_proto(model: ir.Model) -> onnx.ModelProto:
    """The model as a proto whose large initializers are typed graph inputs without data.

    Shape inference needs only their types; serialising gigabytes of weights (or computing
    lazy optimizer state) would cost more than the inference itself.
    """
    graph = model.graph
    detached = {name: v.const_value for name, v in graph.initializers.items()
                if v.const_value is not None and v.const_value.nbytes > _INLINE_LIMIT}
    for name in detached:
        graph.initializers[name].const_value = None
    serde_logger = logging.getLogger("onnx_ir.serde")
    level = serde_logger.level
    serde_logger.setLevel(logging.ERROR)  # it warns about each initializer left without data
    try:
        proto = ir.to_proto(model)
    finally:
        serde_logger.setLevel(level)
        for name, tensor in detached.items():
            graph.initializers[name].const_value = tensor
    declared = {i.name for i in proto.graph.input}
    for name, tensor in detached.items():
        if name not in declared:
            # the tensor's own shape: a value a pass folded into an initializer may still carry the unknown
            # dimensions inference gave it as a node output
            proto.graph.input.append(onnx.helper.make_tensor_value_info(name, int(tensor.dtype), list(tensor.shape)))
    return proto


def _is_static(value: ir.Value | None) -> bool:
    return value is None or (value.shape is not None and value.shape.is_static() and value.dtype is not None)


def has_shape_inference(op_type: str, domain: str = "") -> bool:
    """Whether the import infers static shapes for the op: onnx has a schema with an inference
    function for it (not every schema has one: GroupNormalization is only a function body, which
    onnx's inference does not expand). The op audit and `fblc check` ask this too."""
    if domain not in DEFAULT_DOMAINS or not onnx.defs.has(op_type):
        return False
    return bool(onnx.defs.get_schema(op_type).has_type_and_shape_inference_function)


@dataclass(frozen=True)
class ShapeGaps:
    """Nodes whose outputs have no static shape after inference, by cause."""

    no_rule: list[OpGap]  # onnx has no shape inference for the op
    data_dependent: list[OpGap]  # static inputs, yet the output's shape depends on their data
    first_value: ir.Value | None  # the first unresolved output of all (for the one-value message)
    # the data-dependent nodes no other one feeds (NonZero, not the Range that counts its output), each with
    # the graph inputs whose values decide its shape
    causes: list[tuple[ir.Node, list[str]]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.no_rule or self.data_dependent or self.first_value is not None)


def shape_gaps(model: ir.Model) -> ShapeGaps:
    """Every node that leaves a value without a static shape, by cause (see the module docstring)."""
    no_rule: list[ir.Node] = []
    data_dependent: list[ir.Node] = []
    causes: list[tuple[ir.Node, list[str]]] = []
    first: ir.Value | None = None
    graph_inputs = {v.name for v in model.graph.inputs}
    # per value: the graph inputs its data comes from, and whether a data-dependent shape is upstream of it
    sources: dict[str, frozenset[str]] = {name: frozenset([name]) for name in graph_inputs}
    after_unknown: set[str] = set()
    for node in model.graph:
        named = [v.name for v in node.inputs if v is not None and v.name]
        feeding = frozenset().union(*(sources.get(name, frozenset()) for name in named))
        downstream = any(name in after_unknown for name in named)
        unresolved = [v for v in node.outputs if not _is_static(v)]
        if unresolved:
            if first is None:
                first = unresolved[0]
            if not has_shape_inference(node.op_type, node.domain):
                no_rule.append(node)
            elif all(_is_static(v) for v in node.inputs):
                data_dependent.append(node)
                if not downstream:
                    causes.append((node, sorted(feeding)))
        for value in node.outputs:
            sources[value.name] = feeding
            if downstream or unresolved:
                after_unknown.add(value.name)
    return ShapeGaps(group_by_op(no_rule), group_by_op(data_dependent), first, causes)


def shape_error(gaps: ShapeGaps) -> FblcError:
    """One error for all of `gaps`: an unsupported op when some op has no shape rule, else a ShapeError."""
    dynamic_remedy = "pass --input-shape for every dynamic input; if that is done, this op's shape depends on data"
    nodes = sum(len(g.nodes) for g in gaps.data_dependent)
    if not gaps.no_rule and nodes <= 1 and gaps.first_value is not None:  # the wording of one value
        value = gaps.first_value
        node = value.producer()
        where = f"node '{node.name}' ({node.op_type})" if node is not None else "no node"
        return ShapeError(f"cannot infer a static shape for '{value.name}', output of {where}", dynamic_remedy)
    listed = ", ".join(f"{g.op} ({describe_nodes(g.nodes)})" for g in gaps.data_dependent)
    dynamic = (f"{nodes} node{' has a shape' if nodes == 1 else 's have shapes'} that depend{'s' if nodes == 1 else ''} "
               f"on data: {listed}") if nodes else ""
    if nodes > len(gaps.causes) > 0:  # say which ones start it: the rest only inherit their unknown sizes
        by_inputs: dict[tuple[str, ...], list[str]] = {}
        for node, inputs in gaps.causes:
            by_inputs.setdefault(tuple(inputs), []).append(node.name or node.op_type)
        dynamic += "; " + "; ".join(
            f"{describe_nodes(starts, counted=False)} size{'s its output' if len(starts) == 1 else ' their outputs'} "
            + (f"by the values of {', '.join(map(repr, inputs))}"
               if inputs else "by constant values that inference cannot read")
            for inputs, starts in by_inputs.items())
        dynamic_remedy += ("; export the model with the inputs named above as constants (or a fixed-size form of "
                           "the op), so every size is known before training")
    if not gaps.no_rule:
        return ShapeError(dynamic, dynamic_remedy)
    causes = [describe_gaps("shape rule at import", gaps.no_rule)] + ([dynamic] if dynamic else [])
    return UnsupportedOpError("; ".join(causes), "fblc reads standard ONNX ops (opset 18): export the model without "
                              "custom-domain ops or runtime-specific fusions" + ("; " + dynamic_remedy if dynamic else ""),
                              ops=[g.op for g in gaps.no_rule])


def infer_shapes(model: ir.Model, require_static: bool = True) -> bool:
    """Infer the shape and dtype of every value; with `require_static`, raise one error naming every
    node that leaves a value without a static shape (`shape_gaps`)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(_weightless_proto(model), check_type=True,
                                                     strict_mode=True, data_prop=True)
    except onnx.shape_inference.InferenceError as error:
        first_line = str(error).strip().splitlines()[0]
        raise ShapeError(f"shape inference failed: {first_line}",
                         "check --input-shape against what the model expects") from None
    found = {vi.name: vi for vi in list(inferred.graph.value_info) + list(inferred.graph.output)}
    modified = False
    for node in model.graph:
        for value in node.outputs:
            info = found.get(value.name)
            if info is not None and info.type.HasField("tensor_type"):
                tensor_type = info.type.tensor_type
                dtype = ir.DataType(tensor_type.elem_type) if tensor_type.elem_type else None
                shape = None
                if tensor_type.HasField("shape"):
                    shape = ir.Shape([d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                                      for d in tensor_type.shape.dim])
                if dtype is not None and value.dtype != dtype:
                    value.dtype = dtype
                    modified = True
                if shape is not None and value.shape != shape:
                    value.shape = shape
                    modified = True
    if require_static:
        gaps = shape_gaps(model)
        if gaps:
            raise shape_error(gaps)
        refuse_unrunnable_values(model)
    return modified


def refuse_unrunnable_values(model: ir.Model) -> None:
    """Raise naming the first value no kernel can hold: a string tensor (kernels compute on numbers), or a
    float tensor a node computes with no element at all (a zero-size Split part, a Reshape to a 0 dim: a texture
    has at least one texel)."""
    graph = model.graph
    for value in list(graph.inputs) + [v for node in graph for v in node.outputs]:
        producer = value.producer()
        if value.dtype == ir.DataType.STRING:
            where = f"'{value.name}'" + (f" (made by node '{producer.name}', {producer.op_type})" if producer else "")
            raise UnsupportedOpError(f"{where} holds strings: fblc's kernels compute on numbers only",
                                     "do string processing (tokenization, labels) outside the model")
        if producer is not None and producer.op_type != "Constant" and value.dtype is not None \
                and value.dtype.is_floating_point() and (refusal := no_element(value)) is not None:
            raise refusal


def no_element(value: ir.Value) -> ShapeError | None:
    """The refusal of `value` where its static shape holds no element (a texture has at least one texel), else
    None. Integer values are checked only where a kernel would write them (codegen/plan.lower): shape arithmetic
    may make empty ones that never reach a kernel."""
    shape, producer = value.shape, value.producer()
    if shape is None or not shape.is_static() or all(int(d) != 0 for d in shape):
        return None
    where = f"'{value.name}'" + (f" (made by node '{producer.name}', {producer.op_type})" if producer else "")
    return ShapeError(f"{where} has shape {list(shape)}: no element, and a texture needs one",
                      "remove the empty branch from the model, or export it with --input-shape values that give "
                      "every tensor an element")
