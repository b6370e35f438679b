"""The torch name of each initializer, where the exporter recorded it, so that users may name parameters as in torch.

torch.onnx's exporters do not always keep a parameter's name:

- the dynamo exporter names a lifted parameter after its torch name (`fc1.weight`), and records the
  ExportedProgram's graph signature (`p_fc1_weight: PARAMETER target='fc1.weight'`) and, per node,
  the FX node it came from (`pkg.torch.onnx.fx_node`); onnxscript's optimizer then folds the
  Transpose of each `nn.Linear` weight into a new constant `val_N` that records only
  `folded_from: ['fc1.weight']`. The MatMul reading it comes from `aten.linear(x, %p_fc1_weight, ...)`,
  and `aten.linear` multiplies by the weight transposed: `val_N` is `fc1.weight` transposed. A
  `weight.T` in the model's own code (Falcon's Linear) folds into a constant named after its FX
  node, `permute`/`t`/`transpose`: that too is the weight transposed.
- the legacy (TorchScript) exporter names parameters by their torch names, except the constants its
  folding makes: a Linear's transposed weight becomes `onnx::MatMul_N`. Nodes are named after the
  module path of the call (`/model/layers.0/mlp/up_proj/MatMul`), but a module whose forward never
  ran is missing from that path (OPT's `model`), so the path is anchored on the parameters that kept
  their names: the bias of the same module, or a parameter of an enclosing one.

A tensor nothing records (an ONNX file from elsewhere, a constant folded from several parameters, a
dynamo-lifted buffer) has no torch name. `record_torch_names` writes `fblc.torch_name` (and
`fblc.torch_transposed` = "1" when the ONNX tensor is the torch tensor with its last two axes swapped)
on each named initializer. Checked by value against the torch modules of every model of
tests/support/zoo.py, through all three exporters.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import numpy as np

from fblc.compiler import keys

if TYPE_CHECKING:  # `fblc run` reads the manifest's names without loading onnx_ir
    import onnx_ir as ir

TORCH_PRODUCER = "pytorch"  # the producer_name both torch exporters write
_SIGNATURE_ENTRY = re.compile(r"^\s*(\S+): (\w+) target='([^']+)'", re.MULTILINE)
#: the FX call a dynamo-exported node came from: its target and its argument list
_FX_CALL = re.compile(r"call_function\[target=([\w.]+)\]\(args = \(([^)]*)\)")
_LINEAR = "torch.ops.aten.linear.default"
#: the FX node names of a transpose (`weight.T` is `permute`, `t` or `transpose`), which onnxscript's optimizer
#: gives the constant it folds such a call into
_TRANSPOSE_NAME = re.compile(r"^(permute|t|transpose)(_\d+)?$")
FX_NODE = "pkg.torch.onnx.fx_node"
ORIGINAL_NODE_NAME = "pkg.torch.onnx.original_node_name"


@dataclass(frozen=True)
class TorchName:
    """An ONNX tensor is the torch parameter `name`, or its transpose (last two axes swapped)."""

    name: str
    transposed: bool = False


def signature_parameters(graph: ir.Graph) -> dict[str, str]:
    """The parameters of the dynamo exporter's graph signature: placeholder name -> torch name."""
    text = graph.metadata_props.get(keys.TORCH_GRAPH_SIGNATURE, "")
    return {placeholder: target for placeholder, kind, target in _SIGNATURE_ENTRY.findall(text) if kind == "PARAMETER"}


def _folded_sources(value: ir.Value) -> list[str]:
    text = value.metadata_props.get(keys.ONNXSCRIPT_FOLDED_FROM)
    if not text:
        return []
    try:
        sources = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return []
    return [s for s in sources if isinstance(s, str)] if isinstance(sources, (list, tuple)) else []


def _linear_weight_placeholder(node: ir.Node) -> str | None:
    """The placeholder a dynamo-exported node's `aten.linear` call takes as its weight, or None."""
    call = _FX_CALL.search(node.metadata_props.get(FX_NODE, ""))
    if call is None or call.group(1) != _LINEAR:
        return None
    arguments = [a.strip() for a in call.group(2).split(",")]
    return arguments[1].lstrip("%") if len(arguments) > 1 else None


def _is_folded_transpose(value: ir.Value, placeholder: str) -> bool:
    """Whether `value`, folded from the 2-D parameter `placeholder` alone, is it transposed: the weight of
    the `aten.linear` calls that read it, or a folded `weight.T` (named after its FX node)."""
    uses = list(value.uses())
    linear = bool(uses) and all(use.node.op_type == "MatMul" and use.idx == 1
                                and _linear_weight_placeholder(use.node) == placeholder for use in uses)
    return linear or _TRANSPOSE_NAME.match(value.name or "") is not None


def _dynamo_names(graph: ir.Graph) -> dict[str, TorchName]:
    parameters = signature_parameters(graph)
    placeholders = {target: placeholder for placeholder, target in parameters.items()}
    found: dict[str, TorchName] = {}
    for name, value in graph.initializers.items():
        placeholder = value.metadata_props.get(ORIGINAL_NODE_NAME, "")
        if keys.TORCH_INPUT_KIND in value.metadata_props and placeholder in parameters:  # lifted as it is
            found[name] = TorchName(parameters[placeholder])
            continue
        sources = _folded_sources(value)
        if len(sources) == 1 and sources[0] in placeholders and value.shape is not None and len(value.shape) == 2 \
                and _is_folded_transpose(value, placeholders[sources[0]]):
            found[name] = TorchName(sources[0], transposed=True)
    return found


def _scope_path(node_name: str) -> str | None:
    """The module path a legacy-exported node name records (`/model/layers.0/mlp/up_proj/MatMul` ->
    `model.layers.0.mlp.up_proj`), or None for a name without one.

    Each scope is a module's name in its parent, numeric atoms looking past to their container
    (`layers.0`); a container whose forward ran (nn.Sequential) is a scope of its own, so
    `net/net.2/net.2.0` is the module `net.2.0`.
    """
    if not node_name.startswith("/") or node_name.count("/") < 2:
        return None
    parts: list[str] = []
    for scope in node_name.split("/")[1:-1]:
        if parts and scope.startswith(parts[-1] + "."):
            parts[-1] = scope
        elif scope:
            parts.append(scope)
    return ".".join(parts) or None


def _module_prefixes(graph: ir.Graph) -> dict[str, set[str]]:
    """Scope path -> what precedes it in the torch module path, learnt from the parameters that kept
    their torch names (`/decoder/layers.0/self_attn/q_proj/Add` reads `model.decoder...q_proj.bias`:
    the path `decoder...q_proj` lies under `model.`)."""
    prefixes: dict[str, set[str]] = {}
    for node in graph:
        path = _scope_path(node.name or "")
        if path is None:
            continue
        for value in node.inputs:
            if value is None or not value.is_initializer() or "::" in (value.name or ""):
                continue
            module = value.name.rpartition(".")[0]
            if module == path or module.endswith("." + path):
                prefixes.setdefault(path, set()).add(module[: len(module) - len(path)])
    return prefixes


def _prefix_of(path: str, prefixes: Mapping[str, set[str]]) -> str | None:
    """The prefix learnt for `path` or its nearest enclosing path; "" when none was learnt; None when
    the evidence disagrees."""
    parts = path.split(".")
    for end in range(len(parts), 0, -1):
        learnt = prefixes.get(".".join(parts[:end]))
        if learnt:
            return next(iter(learnt)) if len(learnt) == 1 else None
    return ""


def _legacy_names(graph: ir.Graph) -> dict[str, TorchName]:
    found: dict[str, TorchName] = {}
    prefixes = _module_prefixes(graph)
    for name, value in graph.initializers.items():
        if "::" not in name:  # the exporter kept the torch name
            found[name] = TorchName(name)
    for name, value in graph.initializers.items():
        if not name.startswith("onnx::MatMul") or value.shape is None or len(value.shape) != 2:
            continue
        paths = {_scope_path(use.node.name or "") if use.node.op_type == "MatMul" and use.idx == 1 else None
                 for use in value.uses()}
        if len(paths) != 1 or None in paths:
            continue
        path = paths.pop()
        prefix = _prefix_of(path, prefixes)
        if prefix is None:
            continue
        torch_name = f"{prefix}{path}.weight"
        same = graph.initializers.get(torch_name)
        if same is not None and (same.shape is None or list(same.shape) != list(value.shape)[::-1]):
            continue  # a tensor of that name that is not this one transposed: the guess is wrong
        found[name] = TorchName(torch_name, transposed=True)
    return found


def exporter_torch_names(model: ir.Model) -> dict[str, TorchName]:
    """ONNX initializer name -> its torch name, for the initializers a torch exporter recorded."""
    if (model.producer_name or "") != TORCH_PRODUCER:
        return {}
    graph = model.graph
    if keys.TORCH_GRAPH_SIGNATURE in graph.metadata_props:
        return _dynamo_names(graph)
    return _legacy_names(graph)


def record_torch_names(model: ir.Model) -> bool:
    """Write each initializer's torch name into its metadata (`fblc.torch_name`, `fblc.torch_transposed`);
    whether any changed."""
    changed = False
    for name, torch_name in exporter_torch_names(model).items():
        value = model.graph.initializers[name]
        changed |= torch_name_of(value) != torch_name
        value.metadata_props[keys.TORCH_NAME] = torch_name.name
        if torch_name.transposed:
            value.metadata_props[keys.TORCH_TRANSPOSED] = "1"
    return changed


def torch_name_of(value: ir.Value) -> TorchName | None:
    """The torch name recorded on `value` at import, or None."""
    name = value.metadata_props.get(keys.TORCH_NAME)
    return None if name is None else TorchName(name, value.metadata_props.get(keys.TORCH_TRANSPOSED) == "1")


def names_of(value: ir.Value) -> tuple[str, ...]:
    """The names a --train/--freeze pattern may match: the ONNX name, and the torch name where it differs."""
    torch_name = torch_name_of(value)
    return (value.name,) if torch_name is None or torch_name.name == value.name else (value.name, torch_name.name)


def display_name(value: ir.Value) -> str:
    """What to show a user: the torch name where one is recorded, else the ONNX name."""
    torch_name = torch_name_of(value)
    return value.name if torch_name is None else torch_name.name


def described(value: ir.Value) -> str:
    """The torch name with the ONNX name beside it where they differ (`fc3.weight (ONNX 'onnx::MatMul_12',
    transposed)`), for messages that must name both."""
    torch_name = torch_name_of(value)
    if torch_name is None or torch_name.name == value.name:
        return value.name
    return f"{torch_name.name} (ONNX '{value.name}'{', transposed' if torch_name.transposed else ''})"


def manifest_fields(value: ir.Value) -> dict[str, Any]:
    """The torch name fields of a parameter's manifest entry (none where nothing is recorded)."""
    torch_name = torch_name_of(value)
    if torch_name is None:
        return {}
    return {"torch_name": torch_name.name, **({"torch_transposed": True} if torch_name.transposed else {})}


def torch_state_dict(arrays: Mapping[str, np.ndarray], entries: Iterable[Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """Saved parameters (`fblc run --save-params`, by ONNX name) as torch tensors would hold them: by torch
    name, transposed back where the export transposed them, for `module.load_state_dict(..., strict=False)`.
    `entries` are the bundle manifest's `parameters`; a parameter without a torch name keeps its ONNX name."""
    state: dict[str, np.ndarray] = {}
    for entry in entries:
        array = arrays[entry["name"]]
        name = entry.get("torch_name", entry["name"])
        state[name] = np.ascontiguousarray(np.swapaxes(array, -1, -2)) if entry.get("torch_transposed") else array
    return state


#: how many renamed parameters a note names
SHOWN_RENAMES = 3


def renamed_note(entries: Iterable[Mapping[str, Any]]) -> str | None:
    """After `--save-params`: which saved arrays (keyed by ONNX name) are torch parameters of another name,
    and how to get torch's names and layout; None when every key is its torch name."""
    renamed = [e for e in entries if e.get("torch_name", e["name"]) != e["name"] or e.get("torch_transposed")]
    if not renamed:
        return None
    shown = ", ".join(f"'{e['name']}' is {e['torch_name']}{' transposed' if e.get('torch_transposed') else ''}"
                      for e in renamed[:SHOWN_RENAMES])
    more = f" and {len(renamed) - SHOWN_RENAMES} more" if len(renamed) > SHOWN_RENAMES else ""
    return (f"the saved arrays are keyed by ONNX name; {len(renamed)} of them are torch parameters of another name "
            f"({shown}{more}): manifest.json 'parameters' gives each its torch_name, and "
            "fblc.compiler.torch_names.torch_state_dict(arrays, manifest['parameters']) renames and transposes "
            "them for torch's load_state_dict")
