"""Graph builders of the memory-floor adapters (MemFLoRA) and of the LoRA baseline.

What a Conv-(BatchNorm)-(activation) *site* becomes:

- MemFLoRA, at a conv with groups == 1, eval-mode BatchNorm folded into the per-channel
  affine map s = gamma / sqrt(var + eps), t = beta - mean * s (+ s * conv bias):

      q = Conv1x1(x, P)                 P [r, C_in, 1, 1], frozen, N(0, std 1/sqrt(r))
      a = Conv(q, U)                    U [C_out, r, k...], trainable, zero; the base conv's
                                        kernel, stride, pads and dilation
      z = (Conv(x, W) + a) * s + t      = conv(x, W) * s + t + a * s  (the inherited scale a_s)
      y = act(z)                        in mask form (below)

  The backward of this graph, from the ordinary gradient rules, reads q and the mask and
  nothing else of the forward: dU = conv_weight_grad(q, g * s), dq = conv_input_grad(U, g * s),
  dx = conv_input_grad(W, g * s) + conv_input_grad(P, dq) with g = mask * dy. A site without
  BatchNorm takes s = 1 (its bias, if any, is t).
- LoRA (the baseline): the same branch with P trainable, so the backward also reads x.
- LoRA at a *linear* site (`--adapter lora` only): a MatMul x @ W or Gemm whose W is a constant
  float parameter, found by FuRA-S's site finder (fblc.compiler.fura_s.find_fura_sites: Gemm
  transB, the legacy exporter's folded W^T, GPT-2's Conv1D, MatMul(x, Transpose(W))); the layer
  y = x W (+ bias) becomes

      y = x W (+ bias) + (x A) B        A [in, r], trainable, N(0, std 1/sqrt(r)) (as P above)
                                        B [r, out], trainable, zero: the model is unchanged at init

  with W frozen (standard LoRA; no activation or BatchNorm is folded in). Which layers
  (`--adapter-sites`, LINEAR_SITES): `auto` adapts the Conv sites when the model has any and the
  linear sites only when it has none (an MLP, a transformer without a conv stem), so LoRA on a
  CNN stays the Conv baseline that MemFLoRA is compared with (its classifier Gemm gets no
  branch); `linear` adapts the linear sites alone (a ViT, whose patch-embedding Conv would
  otherwise be the only site); `all` and `pointwise` choose convs only.
- A chosen site whose channels (features) are fewer than the rank is *skipped*: it stays frozen,
  as an unchosen conv does, and the report lists it with the reason (SkippedSite); only a model
  whose every chosen site is skipped is refused (rank_refusal names them and the largest rank
  that fits one). `auto`'s choice between convs and linear layers is made before this, so a
  CNN whose convs are all too narrow is refused rather than silently adapted at its classifier.
- Every other Conv-BN site: BatchNorm is folded into the frozen weights (W * s, b * s + t).
- Activations in *mask form*: Relu(z) and Clip(z, lo, hi) become
  mask = lo < z < hi (bool) and y = Where(mask, z, Where(z >= hi, hi, lo)); the gradient rule
  of Where reads only the mask, and the saturation value is not differentiable. The memory
  planner accounts a bool tensor at one bit per element (bit-packed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import onnx_ir as ir

from fblc import choices
from fblc.compiler import keys
from fblc.errors import FblcError
from fblc.compiler.graph import Emitter, attr, const_array, static_shape
from fblc.compiler.fura_s import FuraSite, find_fura_sites
from fblc.compiler.keys import Role

#: the adapters of the memory floor (pass memory_floor, Conv sites); "fura-s" is pass fura_s (MatMul/Gemm sites)
MEMORY_FLOOR_ADAPTERS = ("lora", "memflora", "memflora-sg")
ADAPTERS = ("none", *MEMORY_FLOOR_ADAPTERS, "fura-s")
SITE_SELECTIONS = choices.ADAPTER_SITES
#: --adapter lora: whether a --adapter-sites selection adapts the MatMul/Gemm layers, given whether it chose a conv
LINEAR_SITES: dict[str, Callable[[bool], bool]] = {
    "auto": lambda chose_conv: not chose_conv, "all": lambda _: False, "pointwise": lambda _: False,
    "linear": lambda _: True,
}
#: the adapters that may take a linear site
LINEAR_ADAPTERS = ("lora",)



@dataclass(frozen=True)
class AdapterConfig:
    kind: str = "none"
    rank: int = 2
    seed: int = 0
    sites: str = "auto"
    #: fura-s: the column-block width B (None: chosen to fit every site, fblc.compiler.fura_s.chosen_block) and
    #: the regex of its sites (None: every MatMul/Gemm B fits)
    block: int | None = None
    fura_sites: str | None = None

    def validate(self) -> None:
        if self.kind not in ADAPTERS:
            raise FblcError(f"unknown adapter '{self.kind}'", f"choose one of: {', '.join(ADAPTERS)}")
        if self.sites not in SITE_SELECTIONS:
            raise FblcError(f"unknown adapter site selection '{self.sites}'",
                            f"choose one of: {', '.join(SITE_SELECTIONS)}")
        if self.kind == "fura-s" and self.block is not None and self.block < 1:
            raise FblcError(f"--block {self.block} is not a positive block width", "use e.g. --block 64")
        if self.kind in MEMORY_FLOOR_ADAPTERS and self.rank < 1:
            raise FblcError(f"--rank {self.rank} is not a positive rank", "use --rank 1 or more (the paper uses 2, 4, 8)")
        if self.kind in MEMORY_FLOOR_ADAPTERS and self.kind not in LINEAR_ADAPTERS and self.sites == "linear":
            raise FblcError(f"--adapter-sites linear is given with --adapter {self.kind}, which adapts Conv layers "
                            "only",
                            "use --adapter lora for MatMul/Gemm layers, or --adapter-sites auto, all or pointwise")

    @property
    def trains_projection_by_replay(self) -> bool:
        return self.kind == "memflora-sg"


@dataclass
class Site:
    """A Conv, the eval-mode BatchNormalization that alone reads it (or None), and the activation
    that alone reads that (Relu or Clip, or None)."""

    conv: ir.Node
    bn: ir.Node | None
    act: ir.Node | None

    @property
    def output(self) -> ir.Value:
        last = self.act or self.bn or self.conv
        return last.outputs[0]

    @property
    def groups(self) -> int:
        return int(attr(self.conv, "group", 1))

    @property
    def kernel(self) -> tuple[int, ...]:
        return tuple(static_shape(self.conv.inputs[1])[2:])

    @property
    def channels(self) -> tuple[int, int]:
        w = static_shape(self.conv.inputs[1])
        return w[1] * self.groups, w[0]


@dataclass
class SiteRecord:
    """What the report says about one adapter site."""

    conv: str
    weight: str
    P: str
    U: str
    c_in: int
    c_out: int
    kernel: list[int]
    scale: str  # "bn": the inherited BatchNorm scale; "1": no BatchNorm at this site
    activation: str
    params: int
    #: "conv", or "linear" (a MatMul/Gemm site of LoRA: `conv` names the node, P is A [in, r], U is B [r, out])
    kind: str = "conv"
    extra: dict[str, Any] = field(default_factory=dict)


#: what a site's sizes count, by site kind
SIZE_UNITS = {"conv": "channels", "linear": "features"}


@dataclass(frozen=True)
class SkippedSite:
    """A chosen site the adapter cannot take, and why (report.json `adapter.skipped`)."""

    node: str
    kind: str  # "conv" or "linear"
    c_in: int
    c_out: int
    reason: str
    weight: str = ""

    @property
    def label(self) -> str:
        """How messages name the site, with its sizes: conv 'c' (1 in, 8 out), or linear layer 'fc'
        (weight 'w': 8 in, 3 out)."""
        weight = f"weight '{self.weight}': " if self.kind == "linear" else ""
        node = f"conv '{self.node}'" if self.kind == "conv" else f"linear layer '{self.node}'"
        return f"{node} ({weight}{self.c_in} in, {self.c_out} out)"

    @property
    def unit(self) -> str:
        return SIZE_UNITS[self.kind]


def rank_misfit(rank: int, c_in: int, c_out: int, kind: str) -> str | None:
    """Why a rank-`rank` branch does not fit a `kind` site of c_in inputs and c_out outputs, or None: the
    bottleneck would be wider than the layer it adapts."""
    if rank <= min(c_in, c_out):
        return None
    return f"--rank {rank} is larger than its {SIZE_UNITS[kind]} ({c_in} in, {c_out} out)"


#: at most this many sites are named in one message; report.json lists every one
NAMED_SITES = 6


def rank_refusal(rank: int, skipped: Sequence[SkippedSite]) -> FblcError:
    """The error when --rank fits none of the chosen sites: each site's sizes and the largest rank that fits one."""
    largest = max(min(s.c_in, s.c_out) for s in skipped)
    units = " or ".join(sorted({s.unit for s in skipped}))
    if len(skipped) == 1:
        cause = f"--rank {rank} is larger than the {units} of {skipped[0].label}, the model's only adapter site"
    else:
        named = ", ".join(s.label for s in skipped[:NAMED_SITES])
        more = f" and {len(skipped) - NAMED_SITES} more" if len(skipped) > NAMED_SITES else ""
        cause = (f"--rank {rank} is larger than the {units} of every one of the {len(skipped)} adapter sites: "
                 f"{named}{more}")
    return FblcError(cause, f"use --rank {largest} or less (the largest rank that fits a site)")


def _sole_consumer(value: ir.Value) -> ir.Node | None:
    uses = value.uses()
    if len(uses) != 1 or value.is_graph_output():
        return None
    return uses[0].node


def clip_bounds(node: ir.Node) -> tuple[float | None, float | None] | None:
    """(lo, hi) of a Relu (0, None) or of a Clip with constant bounds; None for anything else."""
    if node.domain != "":
        return None
    if node.op_type == "Relu":
        return 0.0, None
    if node.op_type != "Clip":
        return None
    bounds: list[float | None] = []
    for index in (1, 2):
        value = node.inputs[index] if index < len(node.inputs) else None
        if value is None:
            bounds.append(None)
            continue
        array = const_array(value)
        if array is None or np.asarray(array).size != 1:
            return None
        bounds.append(float(np.asarray(array).reshape(-1)[0]))
    if bounds[0] is None and bounds[1] is None:
        return None
    return bounds[0], bounds[1]


def activation_name(bounds: tuple[float | None, float | None] | None) -> str:
    if bounds is None:
        return "none"
    if bounds == (0.0, None):
        return "relu"
    if bounds == (0.0, 6.0):
        return "relu6"
    return f"clip({bounds[0]}, {bounds[1]})"


def find_sites(graph: ir.Graph) -> list[Site]:
    """Every Conv of the graph with the BatchNormalization and activation that follow it alone."""
    sites = []
    for node in graph:
        if node.op_type != "Conv" or node.domain != "" or const_array(node.inputs[1]) is None:
            continue
        bn = _sole_consumer(node.outputs[0])
        if bn is not None and not (bn.op_type == "BatchNormalization" and bn.domain == "" and bn.inputs[0] is node.outputs[0]
                                   and not int(attr(bn, "training_mode", 0))
                                   and all(const_array(v) is not None for v in bn.inputs[1:5])):
            bn = None
        last = (bn or node).outputs[0]
        act = _sole_consumer(last)
        if act is not None and clip_bounds(act) is None:
            act = None
        sites.append(Site(node, bn, act))
    return sites


def select_adapter_sites(sites: Sequence[Site], selection: str) -> list[Site]:
    """The sites that get an adapter: convs with groups == 1.

    `all`: every such conv. `pointwise`: only the 1x1 ones. `auto`: `pointwise` when the model
    also has depthwise convs (MobileNet-style, where MemFLoRA adapts the pointwise convs),
    else `all` (T-ResNet, where it adapts every conv). `linear`: none.
    """
    if selection == "linear":  # LoRA's MatMul/Gemm layers alone (select_linear_sites)
        return []
    dense = [s for s in sites if s.groups == 1]
    if selection == "auto":
        depthwise = any(s.groups > 1 and s.groups == s.channels[0] for s in sites)
        selection = "pointwise" if depthwise else "all"
    if selection == "pointwise":
        return [s for s in dense if all(k == 1 for k in s.kernel)]
    return dense


def select_linear_sites(graph: ir.Graph, config: AdapterConfig, chose_conv: bool) -> list[FuraSite]:
    """The MatMul/Gemm layers that get a LoRA branch (LINEAR_SITES): FuRA-S's sites (constant float
    `param` weights, so call this before the backbone freezes) under --adapter lora, else none."""
    if config.kind not in LINEAR_ADAPTERS or not LINEAR_SITES[config.sites](chose_conv):
        return []
    return find_fura_sites(graph)


def folded_affine(site: Site) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(s, t) of the site's eval-mode BatchNorm with the conv bias folded into t; s None without BN."""
    conv_bias = const_array(site.conv.inputs[2]) if len(site.conv.inputs) > 2 and site.conv.inputs[2] is not None else None
    bias = None if conv_bias is None else np.asarray(conv_bias, np.float64)
    if site.bn is None:
        return None, (None if bias is None else bias.astype(np.float32))
    gamma, beta, mean, var = (np.asarray(const_array(v), np.float64) for v in site.bn.inputs[1:5])
    epsilon = float(attr(site.bn, "epsilon", 1e-5))
    scale = gamma / np.sqrt(var + epsilon)
    shift = beta - mean * scale
    if bias is not None:
        shift = shift + bias * scale
    return scale.astype(np.float32), shift.astype(np.float32)


def new_initializer(graph: ir.Graph, name: str, array: np.ndarray, role: Role, factor: bool = True) -> ir.Value:
    """A new initializer; `factor`: an adapter's own tensor (not a base weight folded anew), never quantized."""
    if name in graph.initializers:
        raise FblcError(f"the model already has a tensor named '{name}'", "rename it before adding an adapter")
    value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
                     const_value=ir.tensor(array, name=name))
    keys.set_role(value, role)
    if factor:
        value.metadata_props[keys.ADAPTER_FACTOR] = "1"  # never quantized (passes/quantize_weights.py)
    graph.register_initializer(value)
    return value


def channel_view(e: Emitter, vector: np.ndarray, rank: int) -> ir.Value:
    return e.const(vector.reshape([1, -1] + [1] * (rank - 2)).astype(np.float32))


def emit_masked_activation(e: Emitter, z: ir.Value, bounds: tuple[float | None, float | None],
                           name: str | None = None) -> tuple[ir.Value, ir.Value]:
    """(y, mask) of Clip(z, lo, hi) in mask form: the backward reads only the bool mask."""
    lo, hi = bounds
    inside = None
    for bound, compare in ((lo, "Greater"), (hi, "Less")):
        if bound is None:
            continue
        test = e.op(compare, z, e.scalar(bound, z))
        inside = test if inside is None else e.op("And", inside, test)
    assert inside is not None
    if hi is None:
        saturated = e.scalar(lo, z)
    elif lo is None:
        saturated = e.scalar(hi, z)
    else:
        saturated = e.op("Where", e.op("GreaterOrEqual", z, e.scalar(hi, z)), e.scalar(hi, z), e.scalar(lo, z))
    inside.metadata_props[keys.ADAPTER_MASK] = "1"
    y = e.op("Where", inside, z, saturated, name=name)
    return y, inside


#: what of each memory-floor adapter trains, and what the step does with the rest
TRAINED_FACTORS = {"lora": ("both factors of the branch", ""), "memflora": ("the factor U", " (P stays fixed)"),
                   "memflora-sg": ("the factor U", " (P trains by replay)")}


def trained_by(kind: str, adapted: int) -> str:
    """What chose the trained set under a memory-floor adapter (keys.TRAINED_BY)."""
    factors, note = TRAINED_FACTORS[kind]
    return f"--adapter {kind}: {factors} at {adapted} site{'s' if adapted != 1 else ''}{note}"


def describe(config: AdapterConfig, records: Sequence[SiteRecord], frozen_sites: int, masked: int,
             skipped: Sequence[SkippedSite] = ()) -> str:
    convs = [r for r in records if r.kind == "conv"]
    no_bn = [r.conv for r in convs if r.scale == "1"]
    linear = len(records) - len(convs)
    notes = [f"{len(no_bn)} conv site(s) without BatchNormalization take a_s = 1" if no_bn else
             "every conv adapter site inherits its BatchNorm scale a_s" if convs else "",
             f"{linear} linear site(s): y = x W + (x A) B" if linear else ""]
    return json.dumps({
        "adapter": config.kind, "rank": config.rank, "seed": config.seed, "site_selection": config.sites,
        "sites": [r.__dict__ for r in records], "adapter_sites": len(records), "linear_sites": linear,
        "frozen_sites": frozen_sites, "masked_activations": masked, "trainable_params": sum(r.params for r in records),
        "sites_without_batchnorm": no_bn, "note": "; ".join(filter(None, notes)),
        "skipped": [{"node": k.node, "kind": k.kind, "weight": k.weight, "in": k.c_in, "out": k.c_out,
                     "reason": k.reason} for k in skipped],
    })
