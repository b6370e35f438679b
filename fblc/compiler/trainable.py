"""Which initializers are parameters: the default rule behind the trainable/frozen split.

Default: every float initializer trains, except BatchNormalization running statistics, those
read only where no gradient flows (Resize's roi and scales: CONSTANT_SLOTS) and,
in models from torch.onnx's dynamo exporter, tensors the exporter marks as buffers or
constants (such as rotary `inv_freq`). A tensor that onnxscript's optimizer folded (a
pre-transposed weight, a conv with BatchNorm fused in, a causal mask, a cos/sin table)
trains when it sits in a weight slot of a contraction or normalisation op, since that is
where exporters fold weights, and is a constant elsewhere.
"""

from __future__ import annotations

import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.graph import is_float
from fblc.compiler.keys import Role
from fblc.compiler.ops import OPS
from fblc.compiler.torch_names import signature_parameters

BN_RUNNING_STAT_INPUTS = (3, 4)
#: op type -> input slots that hold weights (the op table's `weights`, fblc/compiler/ops.py)
WEIGHT_SLOTS: dict[str, tuple[int, ...]] = {op: entry.weights for op, entry in OPS.items() if entry.weights}


#: op type -> input slots no gradient flows into (Resize's roi and scales): a float initializer read only there
#: is a constant, not a parameter that autodiff would refuse to train (the op table's `constants`)
CONSTANT_SLOTS: dict[str, tuple[int, ...]] = {op: entry.constants for op, entry in OPS.items() if entry.constants}


def is_bn_running_stat(value: ir.Value) -> bool:
    return any(use.node.op_type == "BatchNormalization" and use.idx in BN_RUNNING_STAT_INPUTS
               for use in value.uses())


def has_exporter_kinds(graph: ir.Graph) -> bool:
    """True when the exporter recorded which initializers are parameters."""
    return any(keys.TORCH_INPUT_KIND in v.metadata_props for v in graph.initializers.values())


def exported_parameters(graph: ir.Graph) -> set[str]:
    """The torch parameter names the dynamo exporter's graph signature lists (empty without one)."""
    return set(signature_parameters(graph).values())


def folded_torch_sources(graph: ir.Graph) -> dict[str, list[str]]:
    """Constants that onnxscript's optimizer folded from torch parameters: initializer name -> the
    parameters (by the exporter's signature) it was computed from.

    The optimizer folds a parameter read only through constant-index ops (BERT's position
    embeddings gathered at constant ids, ViT's cls token expanded over the batch) into a new
    constant, and the parameter is gone from the file, so it cannot train. A constant that trains
    anyway (one in a weight slot) is left out, and so is a pre-transposed weight, which is its parameter
    (fblc.compiler.torch_names) even when --freeze froze it.
    """
    parameters = exported_parameters(graph)
    found: dict[str, list[str]] = {}
    for name, value in graph.initializers.items():
        record = value.metadata_props.get(keys.ONNXSCRIPT_FOLDED_FROM)
        if record is None or keys.get_role(value) == Role.PARAM.value or keys.TORCH_NAME in value.metadata_props:
            continue  # trains, or is a parameter itself (a pre-transposed weight) that --freeze froze
        sources = sorted({s.strip(" '\"") for s in record.strip("[]").split(",")} & parameters)
        if sources:
            found[name] = sources
    return found


def is_parameter_like(value: ir.Value, exporter_kinds: bool) -> bool:
    """Whether `value` (an initializer) is a weight by nature, before user patterns apply."""
    if not is_float(value) or is_bn_running_stat(value):
        return False
    kind = value.metadata_props.get(keys.TORCH_INPUT_KIND)
    if kind is not None:
        return kind == "PARAMETER"
    # The dynamo exporter tags every tensor it lifts, so an untagged one in its output was made
    # by onnxscript's optimizer; not every rewrite records folded_from (a conv with BatchNorm
    # fused in keeps the conv weight's name and loses its tags), so both take the slot rule.
    if keys.ONNXSCRIPT_FOLDED_FROM in value.metadata_props or exporter_kinds:
        return any(use.idx in WEIGHT_SLOTS.get(use.node.op_type, ()) for use in value.uses())
    uses = value.uses()
    return not uses or not all(use.idx in CONSTANT_SLOTS.get(use.node.op_type, ()) for use in uses)
