"""`fblc export`: the model a bundle was compiled from, with trained parameters, as a standard ONNX file.

The graph, its opset and its input/output names are the source model's (read with onnx_ir, not fblc's loader,
which converts opsets); initializer values change, and a shared adapted weight gets a copy (below).
fblc.codegen.export_record says what the bundle keeps for this. What each kind of trained tensor becomes (float64 sums, stored in the weight's dtype):

- a trained model tensor (full fine-tuning, --train/--freeze): replaces the initializer of its name;
- LoRA / MemFLoRA / MemFLoRA-SG at a conv W [out, in, k...]: W + U * P, (U * P)[o, i, k] = sum_r U[o, r, k] P[r, i]
  (the branch Conv(Conv1x1(x, P), U) with the base conv's stride, pads and dilation is Conv(x, U * P); the
  BatchNorm that follows keeps scaling it, which is the inherited scale a_s the step applies);
- LoRA at a linear layer: W + A B, or W + (A B)^T where W is stored [out, in] (Gemm transB, Transpose(W));
- FuRA-S: per column block k of width b (rows of x's features), W_k <- (I + R_k diag(delta_k) R_k^T) W_k for W
  stored [in, out], W_k (I + R_k diag(delta_k) R_k^T) for W stored [out, in]: the step's input transform
  x_k + R_k (delta_k (R_k^T x_k)) moved into the weight.

A weight that other nodes also read (a tied embedding and head, a weight two adapted layers share) is not merged
in place: each adapted layer reads its merged copy `<W>.<node>.merged`, the other readers W as it was, as in the step.
Frozen factors come from the trained file where they trained (LoRA's A, MemFLoRA-SG's P), else from the bundle's
factors.npz. Under --weights int8/int4/fp16 the merge is into the source model's own fp32 weight, not the
rounded one the device computed with (the delta was trained against the rounded weight: QLoRA's merge).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np
import onnx_ir as ir

from fblc.codegen.export_record import sampled_sha256
from fblc.compiler.model_io import external_data_offsets
from fblc import bundle_format as fmt
from fblc.errors import BundleError, FblcError

Delta = Callable[[np.ndarray], np.ndarray]  # the merged weight (float64) from the source weight (float64)


def _factor(name: str, trained: Mapping[str, np.ndarray], frozen: Mapping[str, np.ndarray], bundle: str) -> np.ndarray:
    if name in trained:
        return np.asarray(trained[name], np.float64)
    if name in frozen:
        return np.asarray(frozen[name], np.float64)
    raise BundleError(f"adapter factor '{name}' is neither in the trained parameters nor in '{bundle}/{fmt.FACTORS}'; "
                      "compile the bundle again with this fblc")


def _branch_merge(site: dict[str, Any], trained: Mapping[str, np.ndarray], frozen: Mapping[str, np.ndarray],
                  bundle: str) -> Delta:
    """W + U * P (a conv site) or W + A B (a linear site) of a LoRA/MemFLoRA site record (compiler.adapters)."""
    down, up = (_factor(site[key], trained, frozen, bundle) for key in ("P", "U"))
    if site.get("kind", "conv") == "linear":
        delta = down @ up  # [in, out]
        return lambda w: w + (delta.T if site["extra"].get("transposed") else delta)
    projection = down.reshape(down.shape[0], down.shape[1])  # P [r, in, 1, ...]: a 1x1 conv
    return lambda w: w + np.einsum("or...,ri->oi...", up, projection)


def _fura_merge(site: dict[str, Any], delta: np.ndarray, frozen: Mapping[str, np.ndarray], bundle: str) -> Delta:
    """W with each block's singular values scaled by 1 + delta (compiler.fura_s), for a fura_s site record."""
    right = _factor(site["right"], {}, frozen, bundle)  # [K, b, r]
    blocks, width, rank = right.shape
    values = delta[site["offset"]:site["offset"] + blocks * rank].reshape(blocks, rank)
    # M_k = I + R_k diag(delta_k) R_k^T, symmetric
    mixes = np.eye(width) + np.einsum("kbr,kr,kcr->kbc", right, values, right)

    def merged(w: np.ndarray) -> np.ndarray:
        if site["transposed"]:  # W [out, in]: columns are input features
            return np.einsum("okb,kbc->okc", w.reshape(w.shape[0], blocks, width), mixes).reshape(w.shape)
        return np.einsum("kbc,kcm->kbm", mixes, w.reshape(blocks, width, w.shape[1])).reshape(w.shape)

    return merged


@dataclass(frozen=True)
class SiteMerge:
    """One adapter site's merge: the source weight, the node of the source graph that reads it there (the
    MatMul/Gemm/Conv, directly or through a Transpose), and the merged weight as a function of the source one."""

    weight: str
    node: str
    merged: Delta


def merges(export: Mapping[str, Any], trained: Mapping[str, np.ndarray], frozen: Mapping[str, np.ndarray],
           bundle: str) -> tuple[list[SiteMerge], set[str]]:
    """(each adapter site's merge, the trained tensors the adapter's sites consumed)."""
    adapter = export.get("adapter")
    if adapter is None:
        return [], set()
    result: list[SiteMerge] = []
    used: set[str] = set()
    for site in adapter["sites"]:
        if adapter["adapter"] == "fura-s":
            delta = np.asarray(trained[adapter["delta"]], np.float64)
            result.append(SiteMerge(site["weight"], site["node"], _fura_merge(site, delta, frozen, bundle)))
            used.add(adapter["delta"])
        else:  # memory_floor's records name the adapted node `conv`, a MatMul/Gemm at a linear site
            result.append(SiteMerge(site["weight"], site["conv"], _branch_merge(site, trained, frozen, bundle)))
            used.update((site["P"], site["U"]))
    return result, used


def _site_use(weight: ir.Value, node: str) -> ir.Usage | None:
    """The use of `weight` that reaches the node named `node`: by it, or by a Transpose that only it reads."""
    for use in weight.uses():
        if use.node.name == node:
            return use
        readers = use.node.outputs[0].uses() if use.node.op_type == "Transpose" else []
        if readers and all(reader.node.name == node for reader in readers):
            return use
    return None


def _apply_merges(graph: ir.Graph, site_merges: list[SiteMerge], source: str) -> list[str]:
    """Merge each site into its weight in place where the site alone reads it; where other nodes read it too (a
    tied embedding and head, a weight two layers share) the site reads a merged copy `<weight>.<node>.merged`
    and the others the weight as it was, as in the step. Returns the copies' names."""
    copies = []
    for merge in site_merges:
        value = graph.initializers.get(merge.weight)
        if value is None or value.const_value is None:
            raise FblcError(f"the adapted weight '{merge.weight}' is not an initializer of '{source}' (the compiler "
                            "derived it, e.g. a folded transpose or BatchNorm), so it has no place in the source "
                            "graph", "report it; meanwhile the trained values are in the --params file, by ONNX name")
        use = _site_use(value, merge.node)
        if use is None:
            raise FblcError(f"'{source}' has no node '{merge.node}' reading weight '{merge.weight}', where the bundle "
                            "adapted it", "give the model the bundle was compiled from (--model)")
        original = value.const_value.numpy()
        merged = _stored(merge.merged(np.asarray(original, np.float64)), original, merge.weight, source)
        if len(value.uses()) == 1 and not value.is_graph_output():
            value.const_value = ir.tensor(merged, name=merge.weight)
            continue
        name = f"{merge.weight}.{merge.node}.merged"
        while name in graph.initializers:
            name += "_"
        copy = ir.Value(name=name, shape=value.shape, type=value.type, const_value=ir.tensor(merged, name=name))
        graph.register_initializer(copy)
        use.node.replace_input_with(use.idx, copy)
        copies.append(name)
        if not value.uses() and not value.is_graph_input() and not value.is_graph_output():  # every reader adapted
            graph.initializers.pop(merge.weight)
    return copies


def _stored(new: np.ndarray, original: np.ndarray, name: str, source: str) -> np.ndarray:
    """`new` in the dtype of the source tensor it replaces, whose shape it must have."""
    if new.shape != original.shape:
        raise FblcError(f"trained tensor '{name}' has shape {list(new.shape)}; '{source}' holds it as "
                        f"{list(original.shape)}", "give the --save-params file of this bundle")
    return new.astype(original.dtype)


def _checked_params(manifest: Mapping[str, Any], trained: Mapping[str, np.ndarray], params_path: str) -> None:
    """Every trainable tensor of the bundle in `trained` with its shape, and nothing else but step state (--bn-train's
    running statistics, which --save-params does not write but a caller may add)."""
    expected = {p["name"]: tuple(p["shape"]) for p in manifest["parameters"]}
    for name, shape in expected.items():
        if name not in trained:
            raise FblcError(f"'{params_path}' has no tensor '{name}', a trained parameter of the bundle",
                            "give the file 'fblc run BUNDLE --save-params' wrote for this bundle")
        if tuple(trained[name].shape) != shape:
            raise FblcError(f"tensor '{name}' in '{params_path}' has shape {list(trained[name].shape)}; the bundle "
                            f"trains it as {list(shape)}", "give the --save-params file of this bundle")
    states = {s["name"]: tuple(s["shape"]) for s in manifest["states"]}
    for name in set(trained) & set(states):
        if tuple(trained[name].shape) != states[name]:
            raise FblcError(f"tensor '{name}' in '{params_path}' has shape {list(trained[name].shape)}; the bundle "
                            f"holds it as {list(states[name])}", "give the --save-params file of this bundle")
    extra = sorted(set(trained) - set(expected) - set(states))
    if extra:
        raise FblcError(f"'{params_path}' holds {len(extra)} tensor(s) the bundle does not train, e.g. '{extra[0]}'",
                        "give the --save-params file of this bundle (another bundle's parameters would be merged "
                        "wrongly)")


def _source_model(export: Mapping[str, Any], model_path: str | None, bundle: str) -> str:
    """The source model's path: --model or the one recorded, after checking it is the model compiled."""
    source = export["source"]
    path = model_path or source["path"]
    if not os.path.isfile(path):
        raise FblcError(f"the model '{bundle}' was compiled from, '{path}', is not there",
                        "give its current path with --model PATH (its sha256 is checked)")
    if fmt.sha256_of(path) != source["sha256"]:
        raise FblcError(f"'{path}' is not the model '{bundle}' was compiled from (its sha256 differs from the one "
                        "recorded in the manifest)", "give the original model with --model PATH, or compile and train "
                        "again from this one")
    offsets = external_data_offsets(path)  # the graph's, equal to the compiled one's: its sha256 matched
    for relative, recorded in source.get("external_data", {}).items():
        data = os.path.join(os.path.dirname(os.path.abspath(path)), relative)
        state = "missing" if not os.path.isfile(data) else _data_change(data, recorded, offsets.get(data, []))
        if state:
            raise FblcError(f"the external data file '{data}' of '{path}' is {state}", "keep the model's .data files beside it, unchanged (a moved model: move them too)")
    return path


def _data_change(path: str, recorded: str | Mapping[str, Any], offsets: list[int]) -> str | None:
    """How the external data file `path` differs from its record (export_record.data_record; a bundle of
    before it holds the whole file's sha256), or None."""
    if isinstance(recorded, str):
        return None if fmt.sha256_of(path) == recorded else "not the one compiled (its sha256 differs)"
    if os.path.getsize(path) != recorded["bytes"]:
        return f"not the one compiled ({os.path.getsize(path):,} bytes, not {recorded['bytes']:,})"
    if sampled_sha256(path, offsets) != recorded["sampled_sha256"]:
        return "not the one compiled (the bytes of its tensors differ where sampled)"
    return None


def _frozen_factors(bundle: str, manifest: Mapping[str, Any]) -> dict[str, np.ndarray]:
    name = manifest["export"].get("factors")
    if name is None:
        return {}
    path = os.path.join(bundle, name)
    if not os.path.isfile(path) or fmt.sha256_of(path) != manifest.get("checksums", {}).get(name):
        raise BundleError(f"'{path}' is missing or does not match its checksum in {fmt.MANIFEST}; compile the bundle "
                          "again")
    with np.load(path) as data:
        return {key: data[key] for key in data.files}


def load_trained(params_path: str) -> dict[str, np.ndarray]:
    """The arrays of the .npz `params_path` by name, or an error naming the file."""
    return fmt.npz_tensors(params_path, "--params", "give the .npz file 'fblc run BUNDLE --save-params' wrote")


def exported_model(bundle: str, trained: Mapping[str, np.ndarray], params_path: str,
                   model_path: str | None = None) -> tuple[ir.Model, dict[str, Any]]:
    """The source model of `bundle` with `trained` (ONNX names) in it, adapters merged; and a summary
    {source, replaced, merged (weights), copies (merged copies of shared weights, _apply_merges), kept (the step
    state that is a model tensor and `trained` lacks)} for the command's output."""
    manifest = fmt.load_manifest(bundle)
    export = manifest.get("export")
    if export is None:
        raise BundleError(f"'{bundle}' does not record the model it was compiled from (compiled by an fblc before "
                          "'fblc export'); compile it again with this fblc")
    _checked_params(manifest, trained, params_path)
    source = _source_model(export, model_path, bundle)
    merge, used = merges(export, trained, _frozen_factors(bundle, manifest), bundle)
    model = ir.load(source)
    initializers = model.graph.initializers
    for name in trained:
        if name in used:
            continue
        value = initializers.get(name)
        if value is None or value.const_value is None:
            raise FblcError(f"trained tensor '{name}' is not an initializer of '{source}' (the compiler derived it, "
                            "e.g. a folded transpose or BatchNorm), so it has no place in the source graph",
                            "report it; meanwhile the trained values are in the --params file, by ONNX name")
        value.const_value = ir.tensor(_stored(np.asarray(trained[name]), value.const_value.numpy(), name, source),
                                      name=name)
    copies = _apply_merges(model.graph, merge, source)
    # step state that is a model tensor (--bn-train's running statistics) and was not given: the model's own stays
    kept = sorted(s["name"] for s in manifest["states"] if s["name"] in initializers and s["name"] not in trained)
    return model, {"source": source, "replaced": sorted(set(trained) - used), "merged": [m.weight for m in merge],
                   "copies": copies, "kept": kept}


def adapter_tensors(bundle: str, trained: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A specialist: the adapter's trained tensors, unmerged (empty for a bundle without an adapter). The frozen
    factors they pair with (P, R) are not in it: a model served with the same adapter sites holds them."""
    manifest = fmt.load_manifest(bundle)
    export = manifest.get("export") or {}
    if export.get("adapter") is None:
        return {}
    _, used = merges(export, trained, _frozen_factors(bundle, manifest), bundle)
    return {name: trained[name] for name in sorted(used) if name in trained}
