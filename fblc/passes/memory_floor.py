"""memory_floor: insert the MemFLoRA adapter (or the LoRA baseline) and freeze the backbone.

Selected by `--adapter memflora|memflora-sg|lora --rank R [--seed S]`; `--adapter none` (the
default) leaves the model alone (full fine-tuning).

Rewrite (the builders are in fblc.compiler.adapters, which states the exact graph):
- every initializer that would train becomes `frozen`;
- at every adapter site (a Conv with groups == 1, followed by an optional eval-mode
  BatchNormalization and an optional Relu/Clip; `--adapter-sites` chooses which convs, `auto`
  keeps MemFLoRA's placement: the pointwise convs of a network with depthwise convs, else all)
  the conv becomes z = (Conv(x, W) + Conv(Conv1x1(x, P), U)) * s + t with P frozen
  (N(0, std 1/sqrt(r)), drawn in site order from `--seed`), U trainable and zero, s and t the
  BatchNorm folded into the per-channel affine map (s = 1 without BatchNorm); for `lora`, P is
  trainable too;
- `lora` only, at every linear site (a MatMul/Gemm with a constant float weight W, FuRA-S's site
  finder; `--adapter-sites auto` takes them when no conv site is chosen, `linear` always, and
  then no conv): the layer's output y becomes y + MatMul(MatMul(x, A), B), A [in, r] trainable
  N(0, std 1/sqrt(r)) drawn after the convs' P, B [r, out] trainable zeros, W frozen;
- a chosen site narrower than the rank (fewer input or output channels/features) is skipped: it
  is frozen like an unchosen one, and the metadata lists it under `skipped` with the reason;
- every other Conv-BatchNorm site folds the BatchNorm into its frozen weights and bias;
- every Relu and constant-bound Clip (ReLU6) becomes its mask form (bool mask + Where), so
  that the backward reads a one-bit mask instead of the full-width activation.
The model's metadata `fblc.adapter` describes the sites and the skipped ones (JSON); the graph's
`fblc.trained_by` says the adapter's factors are the trained set. Unused initializers go.

Preconditions: import passes ran (static shapes, constants folded, zero Pads folded into the
convs); BatchNormalization in eval mode (not with `--bn-train`); runs before mark_trainable.
In place; `modified` is false for `--adapter none` and `fura-s` (pass fura_s).
Errors: an unknown adapter, a non-positive rank, `--bn-train` with an adapter, no eligible
site, a rank larger than the input or output channels (or features) of every chosen site,
`--adapter-sites linear` with memflora.
"""

from __future__ import annotations

from typing import NoReturn

import numpy as np
import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.adapters import (MEMORY_FLOOR_ADAPTERS, AdapterConfig, Site, SiteRecord, SkippedSite,
                                    activation_name, channel_view, clip_bounds, describe, emit_masked_activation,
                                    find_sites, folded_affine, new_initializer, rank_misfit, rank_refusal,
                                    select_adapter_sites, select_linear_sites, trained_by)
from fblc.compiler.fura_s import FuraSite
from fblc.errors import FblcError
from fblc.compiler.graph import Emitter, replace_output, static_shape
from fblc.compiler.keys import Role
from fblc.passes.contracts import ContractPass


def _attributes(node: ir.Node) -> dict[str, object]:
    return {name: a.value for name, a in node.attributes.items()}


def _weight_prefix(weight: ir.Value) -> str:
    return weight.name[: -len(".weight")] if weight.name.endswith(".weight") else weight.name


def _fitting(rank: int, convs: list[Site], linear: list[FuraSite]) -> tuple[list[Site], list[FuraSite],
                                                                           list[SkippedSite]]:
    """(the convs, the linear layers a rank-`rank` branch fits, the others as skipped sites: rank_misfit)."""
    skipped: list[SkippedSite] = []
    kept_convs, kept_linear = [], []
    for conv in convs:
        reason = rank_misfit(rank, *conv.channels, "conv")
        if reason is None:
            kept_convs.append(conv)
        else:
            skipped.append(SkippedSite(conv.conv.name, "conv", *conv.channels, reason))
    for layer in linear:
        reason = rank_misfit(rank, layer.n_in, layer.m_out, "linear")
        if reason is None:
            kept_linear.append(layer)
        else:
            skipped.append(SkippedSite(layer.node.name, "linear", layer.n_in, layer.m_out, reason, layer.weight.name))
    return kept_convs, kept_linear, skipped


class MemoryFloor(ContractPass):
    """Insert MemFLoRA/LoRA adapters, fold BatchNorm, put activations in mask form (in place)."""

    name = "memory_floor"
    requires_facts = ("static shapes",)
    ensures_facts = ("static shapes",)

    def __init__(self, config: AdapterConfig, bn_train: bool = False) -> None:
        super().__init__()
        self.config = config
        self.bn_train = bn_train

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        config = self.config
        config.validate()
        if config.kind not in MEMORY_FLOOR_ADAPTERS:
            return ir.passes.PassResult(model, False)
        if self.bn_train:
            raise FblcError(f"--adapter {config.kind} needs BatchNormalization in eval mode (the memory floor folds it "
                            "into a fixed affine map)", "drop --bn-train, or use --adapter none for full fine-tuning")
        graph = model.graph
        sites = find_sites(graph)
        chosen = select_adapter_sites(sites, config.sites)
        linear = select_linear_sites(graph, config, bool(chosen))  # before the freeze: it looks for `param` weights
        if not chosen and not linear:
            self._no_site(graph)
        chosen, linear, skipped = _fitting(config.rank, chosen, linear)
        if not chosen and not linear:
            raise rank_refusal(config.rank, skipped)
        for value in graph.initializers.values():
            if keys.get_role(value) == Role.PARAM.value:
                keys.set_role(value, Role.FROZEN)
        rng = np.random.default_rng(config.seed)
        chosen_ids = {id(s.conv) for s in chosen}
        emitter = Emitter(graph, stage="forward")
        records: list[SiteRecord] = []
        masked = 0
        for site in sites:
            emitter.anchor = site.conv
            emitter.prefix = site.conv.name
            if id(site.conv) in chosen_ids:
                records.append(self._adapter_site(emitter, graph, site, rng))
            else:
                self._frozen_site(emitter, graph, site)
            masked += site.act is not None
        for layer in linear:
            emitter.anchor, emitter.prefix = layer.node, layer.node.name
            records.append(self._linear_site(emitter, graph, layer, rng))
        for node in list(graph):  # activations outside conv sites (after a residual add, say)
            bounds = clip_bounds(node)
            if bounds is None or node.inputs[0] is None:
                continue
            emitter.anchor, emitter.prefix = node, node.name
            y, _ = emit_masked_activation(emitter, node.inputs[0], bounds)
            replace_output(node.outputs[0], y)
            graph.remove(node, safe=True)
            masked += 1
        for name, value in list(graph.initializers.items()):
            if not value.uses() and not value.is_graph_input() and not value.is_graph_output():
                graph.initializers.pop(name)
        model.metadata_props[keys.ADAPTER] = describe(config, records, len(sites) - len(chosen), masked, skipped)
        graph.metadata_props[keys.TRAINED_BY] = trained_by(config.kind, len(records))
        return ir.passes.PassResult(model, True)

    def _adapter_site(self, e: Emitter, graph: ir.Graph, site: Site, rng: np.random.Generator) -> SiteRecord:
        config = self.config
        conv = site.conv
        x, weight = conv.inputs[0], conv.inputs[1]
        rank_sp = len(static_shape(x)) - 2
        c_in, c_out = site.channels
        kernel = list(site.kernel)
        prefix = _weight_prefix(weight)
        projection = (rng.standard_normal((config.rank, c_in) + (1,) * rank_sp) / np.sqrt(config.rank)).astype(np.float32)
        p = new_initializer(graph, f"{prefix}.adapter_P", projection,
                            Role.PARAM if config.kind == "lora" else Role.FROZEN)
        u = new_initializer(graph, f"{prefix}.adapter_U", np.zeros([c_out, config.rank] + kernel, np.float32), Role.PARAM)
        scale, shift = folded_affine(site)
        attributes = _attributes(conv)
        attributes.pop("group", None)
        base = e.op("Conv", x, weight, **attributes)
        q = e.op("Conv", x, p, name=f"{prefix}.adapter_q")
        q.metadata_props[keys.ADAPTER_SITE_Q] = conv.name
        sites_of_x = [x.metadata_props.get(keys.ADAPTER_SITE_X), conv.name]
        x.metadata_props[keys.ADAPTER_SITE_X] = ",".join(filter(None, sites_of_x))
        branch = e.op("Conv", q, u, **attributes)
        z = e.op("Add", base, branch)
        if scale is not None:
            z = e.op("Mul", z, channel_view(e, scale, rank_sp + 2))
        if shift is not None:
            z = e.op("Add", z, channel_view(e, shift, rank_sp + 2))
        bounds = clip_bounds(site.act) if site.act is not None else None
        y = emit_masked_activation(e, z, bounds)[0] if bounds is not None else z
        replace_output(site.output, y)
        self._remove_site(graph, site)
        return SiteRecord(conv=conv.name, weight=weight.name, P=p.name, U=u.name, c_in=c_in, c_out=c_out, kernel=kernel,
                          scale="bn" if site.bn is not None else "1", activation=activation_name(bounds),
                          params=int(np.prod(static_shape(u))) + (int(projection.size) if config.kind == "lora" else 0),
                          extra={"x": x.name, "q": q.name})

    def _linear_site(self, e: Emitter, graph: ir.Graph, site: FuraSite, rng: np.random.Generator) -> SiteRecord:
        """y = node(x, W, ...) + (x A) B in place of the MatMul/Gemm `site.node` (W frozen, A and B trainable)."""
        rank, node = self.config.rank, site.node
        prefix = _weight_prefix(site.weight)
        if f"{prefix}.adapter_A" in graph.initializers:  # a weight read by two layers (tied): a branch each
            prefix = f"{prefix}.{node.name}"
        down = (rng.standard_normal((site.n_in, rank)) / np.sqrt(rank)).astype(np.float32)
        a = new_initializer(graph, f"{prefix}.adapter_A", down, Role.PARAM)
        b = new_initializer(graph, f"{prefix}.adapter_B", np.zeros((rank, site.m_out), np.float32), Role.PARAM)
        x = node.inputs[0]  # not site.x: an adapted layer before this one may have replaced it
        assert x is not None, "find_fura_sites keeps only layers with an activation operand"
        base = e.op(node.op_type, *node.inputs, **_attributes(node))
        q = e.op("MatMul", x, a, name=f"{prefix}.adapter_q")
        y = e.op("Add", base, e.op("MatMul", q, b))
        replace_output(node.outputs[0], y)
        graph.remove(node, safe=True)
        return SiteRecord(conv=node.name, weight=site.weight.name, P=a.name, U=b.name, c_in=site.n_in,
                          c_out=site.m_out, kernel=[], scale="1", activation="none", kind="linear",
                          params=int(down.size) + rank * site.m_out,
                          # transposed: W stored [out, in] (fblc export merges A B into it)
                          extra={"x": x.name, "q": q.name, "transposed": site.transposed})

    def _no_site(self, graph: ir.Graph) -> NoReturn:
        config = self.config
        convs = sum(1 for n in graph if n.op_type == "Conv")
        pointwise = " and a 1x1 kernel" if config.sites == "pointwise" else ""
        found = (f"{convs} Conv node(s), none with groups == 1{pointwise}" if config.sites != "linear"
                 else "--adapter-sites linear")
        if config.kind == "lora":
            raise FblcError(f"--adapter lora found no eligible site in the model ({found}; no MatMul/Gemm with a "
                            "constant float weight)", "LoRA adapts Conv layers with groups == 1 and MatMul/Gemm "
                            "layers with constant weights; use --adapter none for this model")
        raise FblcError(f"--adapter {config.kind} found no eligible site in the model ({found})",
                        "MemFLoRA adapts Conv layers with groups == 1; use --adapter none for this model")

    @staticmethod
    def _frozen_site(e: Emitter, graph: ir.Graph, site: Site) -> None:
        """BatchNorm folded into the frozen weights; the activation in mask form."""
        if site.bn is None and site.act is None:
            return
        conv = site.conv
        x, weight = conv.inputs[0], conv.inputs[1]
        bias = conv.inputs[2] if len(conv.inputs) > 2 else None
        scale, shift = folded_affine(site)
        if scale is not None:
            w = weight.const_value.numpy() if weight.const_value is not None else None
            assert w is not None, "find_sites keeps only convs with constant weights"
            folded = (w * scale.reshape([-1] + [1] * (w.ndim - 1))).astype(np.float32)
            weight = new_initializer(graph, f"{weight.name}.bn_folded", folded, Role.FROZEN, factor=False)
            bias = new_initializer(graph, f"{_weight_prefix(conv.inputs[1])}.bias_bn_folded", shift, Role.FROZEN,
                                   factor=False)
        z = e.op("Conv", x, weight, bias, **_attributes(conv)) if bias is not None else e.op("Conv", x, weight,
                                                                                            **_attributes(conv))
        bounds = clip_bounds(site.act) if site.act is not None else None
        y = emit_masked_activation(e, z, bounds)[0] if bounds is not None else z
        replace_output(site.output, y)
        MemoryFloor._remove_site(graph, site)

    @staticmethod
    def _remove_site(graph: ir.Graph, site: Site) -> None:
        for node in (site.act, site.bn, site.conv):
            if node is not None:
                graph.remove(node, safe=True)
