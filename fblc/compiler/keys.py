"""Metadata keys that fblc writes on models, graphs, nodes and values (Netron shows node metadata).

Every `fblc.*` key is a constant here and nowhere else (tests/test_metadata_keys.py checks the package);
JSON-valued keys are read through the accessors at the end, which parse each distinct text once.
"""

from __future__ import annotations

import enum
import json
from functools import lru_cache
from typing import Any, Mapping

from fblc.texel_layout import TexelLayout

FTD = "fblc.ftd"
#: On a state output under dynamic loss scaling: "finite" where the runtimes swap it only after a finite step
#: (commit_if_finite; plan.json swaps_if_finite).
COMMIT = "fblc.commit"
#: On a value: its texel layout (TexelLayout JSON) chosen by rtile_select or the texture table.
LAYOUT = "fblc.layout"
#: On the graph: the layout mode the step was lowered under ("rtile" or "naive").
LAYOUT_MODE = "fblc.layout_mode"
#: On a node: a readable summary of its outputs' layouts, for Netron (never read back).
LAYOUT_NOTE = "fblc.layout_note"
#: On a remapped data-movement node: the strided map of its output over its root (index_map.py).
INDEX_MAP = "fblc.index_map"
#: On a data-movement node tile_remap looked at: "remapped", or the check that kept it a copy.
REMAP = "fblc.remap"
#: REMAP's value on a Transpose that the kernel making its input writes in the Transpose's order (a conv weight
#: gradient in W's own order: gradients/linalg.conv_weight_grad): neither a view nor a kernel of its own
WRITTEN_BY_PRODUCER = "kept: written in this order by the kernel that makes its input"
#: On a value: the score table of rtile_select's layout choice (the layout report reads it).
LAYOUT_CHOICE = "fblc.layout_choice"
#: On a float storage root: "fp32" or "fp16", the format its texture takes (storage_precision).
STORAGE = "fblc.storage"
ROLE = "fblc.role"
#: On a node: the kernel it belongs to, k<N> in launch order, or "alias" for a view (fuse).
KERNEL = "fblc.kernel"
#: On a kernel group's anchor node: JSON of its kernels' schedules by kernel name (kernel_schedules).
SCHEDULE = "fblc.schedule"
#: On a value that owns a buffer: JSON of its memory class, bytes and live range (memory_plan).
MEM = "fblc.mem"
#: On the model: JSON of the memory plan's summary and floor check (memory_plan).
MEMORY = "fblc.memory"
#: On the model: JSON of batch_tile's tiling (chunks, front nodes, the cut value, sizes).
BATCH_TILE = "fblc.batch_tile"
#: On the model: the parameters the loss does not depend on, comma-separated (build_gradients).
UNUSED_PARAMS = "fblc.unused_params"
#: In a graph's `meta` (in memory, never saved): the Emitter's counter of fresh names.
EMITTER_NAMES = "fblc.emitter_names"
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

#: On the model: JSON description of the inserted adapter (kind, rank, sites).
ADAPTER = "fblc.adapter"
#: On an initializer an adapter made (LoRA A/B, MemFLoRA P/U, FuRA-S R): never quantized (quantize_weights).
ADAPTER_FACTOR = "fblc.adapter_factor"
#: On the model: JSON list of the weights quantize_weights rewrote (name, format, group, relative error);
#: on a DequantizeLinear/Cast output it made: the weight's name.
QUANTIZED = "fblc.quantized"
RECOMPUTE = "fblc.recompute"  # a recomputed copy's layer; the model's summary (JSON) of pass recompute
#: On each adapter site's bottleneck q: the site's conv node.
ADAPTER_SITE_Q = "fblc.adapter.q"
#: On dL/dq (memflora-sg keeps it for the replay): the name of its q.
ADAPTER_SITE_DQ = "fblc.adapter.dq"
#: On a site's input x: the site's conv node (the replay of memflora-sg recomputes it).
ADAPTER_SITE_X = "fblc.adapter.x"
#: On a site input that memflora-sg's replay recomputes: the site's conv node.
ADAPTER_REPLAY = "fblc.adapter.replay"
#: On an adapter's mask: "1".
ADAPTER_MASK = "fblc.adapter.mask"
#: On the model: JSON description of the FuRA-S sites.
FURA_S = "fblc.fura_s"
#: On the model: JSON of the ES configuration (pairs, sigma, reward, seed, values).
ES = "fblc.es"
#: On a graph input that a loop of the kernel plan carries (ES members in a loop, fblc.compiler.es_loop): the
#: name of the graph output that becomes its value for the next repetition (the runtimes swap the two textures).
LOOP_CARRIED = "fblc.loop_carried"
#: On a node (pass es_loop): "before", "body" or "after" the plan's loop; fuse merges no two kernels of different ones.
LOOP_PHASE = "fblc.loop_phase"

#: On the graph: what chose the trained set when an adapter did (its factors, FuRA-S's singular values), as text.
TRAINED_BY = "fblc.trained_by"
#: On the graph: the --train/--freeze patterns mark_trainable applied, as text ("--freeze 'head'").
TRAINED_PATTERNS = "fblc.trained_patterns"
#: On the graph: "1" when the step is the model's forward alone (--trainer none, pass forward_step).
FORWARD_STEP = "fblc.forward_step"
#: On the graph of a forward step with adapter sites (--trainer none --adapter): JSON list of the adapter tensors a
#: specialist replaces at run time (LoRA's A/B, MemFLoRA's U, FuRA-S's delta), in the adapter pass's order.
SPECIALIST = "fblc.specialist"

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
    #: what a loop of the kernel plan carries (ES members in a loop, fblc.compiler.es_loop): the graph input and
    #: the output that is its next value (LOOP_CARRIED)
    CARRIED = "carried"


def set_role(value: "object", role: Role) -> None:
    value.metadata_props[ROLE] = role.value  # type: ignore[attr-defined]


def get_role(value: "object") -> str | None:
    return value.metadata_props.get(ROLE)  # type: ignore[attr-defined]


# Typed accessors: each distinct JSON text is parsed once (passes ask for the same layout or map of a
# value many times), and what they return is shared between callers: read it, never change it.

@lru_cache(maxsize=8192)
def _layout(text: str) -> TexelLayout:
    return TexelLayout.from_dict(json.loads(text))


def layout_of(value: "object") -> TexelLayout | None:
    """The texel layout `value` was given (LAYOUT), or None before rtile_select."""
    text = value.metadata_props.get(LAYOUT)  # type: ignore[attr-defined]
    return _layout(text) if text else None


@lru_cache(maxsize=1024)
def _parsed(text: str) -> Any:
    return json.loads(text)


def json_of(props: Mapping[str, str], key: str, default: Any = None) -> Any:
    """The JSON metadata `key` of `props` (a model's, graph's, node's or value's `metadata_props`),
    parsed once per distinct text and shared: copy it before changing it. `default` when absent."""
    text = props.get(key)
    return _parsed(text) if text else default
