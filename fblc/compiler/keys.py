"""Metadata keys that fblc writes on nodes and values (Netron shows node metadata)."""

from __future__ import annotations

import enum

FTD = "fblc.ftd"
#: On a value: its texel layout (TexelLayout JSON) chosen by rtile_select or the texture table.
LAYOUT = "fblc.layout"
#: On the graph: the layout mode the step was lowered under ("rtile" or "naive").
LAYOUT_MODE = "fblc.layout_mode"
#: On a node: a readable summary of its outputs' layouts, for Netron (never read back).
LAYOUT_NOTE = "fblc.layout_note"
#: On a remapped data-movement node: the strided map of its output over its root (index_map.py).
INDEX_MAP = "fblc.index_map"
#: On a float storage root: "fp32" or "fp16", the format its texture takes (storage_precision).
STORAGE = "fblc.storage"
ROLE = "fblc.role"
KERNEL = "fblc.kernel"
#: On a kernel group's anchor node: JSON of its kernels' schedules by kernel name (kernel_schedules).
SCHEDULE = "fblc.schedule"
MEM = "fblc.mem"
#: Which pass emitted a node: "forward", "loss", "backward", "es", "optimizer".
STAGE = "fblc.stage"
#: For a backward node: the forward node whose gradient rule emitted it.
GRAD_OF = "fblc.grad_of"
#: On the labels of a class-index loss: the number of classes (the logits' last dim), for the bundle's manifest.
CLASSES = "fblc.classes"
#: On an integer model input: JSON of the tightest table its values index (index_ranges), for the bundle's manifest.
INDEX_TABLE = "fblc.index_table"
#: On the value the loss is computed from (the model's first output): "1" (ES's accuracy reward reads it).
PREDICTION = "fblc.prediction"

#: On the graph: what chose the trained set when an adapter did (its factors, FuRA-S's singular values), as text.
TRAINED_BY = "fblc.trained_by"
#: On the graph: the --train/--freeze patterns mark_trainable applied, as text ("--freeze 'head'").
TRAINED_PATTERNS = "fblc.trained_patterns"

# Keys written by torch.onnx's dynamo exporter and by onnxscript's optimizer.
TORCH_INPUT_KIND = "pkg.torch.export.graph_signature.InputSpec.kind"
ONNXSCRIPT_FOLDED_FROM = "pkg.onnxscript.optimizer.folded_from"
#: On the graph (dynamo exporter): the ExportedProgram's signature, one `name: KIND target='torch.name'` per input.
TORCH_GRAPH_SIGNATURE = "pkg.torch.export.ExportedProgram.graph_signature"
#: On an initializer: the torch parameter it is, where the exporter recorded it (fblc.compiler.torch_names).
TORCH_NAME = "fblc.torch_name"
#: On an initializer with TORCH_NAME: "1" when it is the torch tensor with its last two axes swapped.
TORCH_TRANSPOSED = "fblc.torch_transposed"


class Role(str, enum.Enum):
    """Role of a value in the training graph."""

    INPUT = "input"
    LABEL = "label"
    PARAM = "param"
    FROZEN = "frozen"
    ACTIVATION = "activation"
    SAVED = "saved"
    GRAD = "grad"
    OPT_STATE = "opt_state"
    #: the ES step's perturbations (an input of the ONNX step; made on the device in a bundle)
    NOISE = "noise"
    #: a step output the runtimes report beside the loss (ES's rewards)
    METRIC = "metric"
    #: ES rewards the application computes (--reward external): an input uploaded mid-step
    REWARD = "reward"


def set_role(value: "object", role: Role) -> None:
    value.metadata_props[ROLE] = role.value  # type: ignore[attr-defined]


def get_role(value: "object") -> str | None:
    return value.metadata_props.get(ROLE)  # type: ignore[attr-defined]
