"""What fblc supports of a model, found without compiling it: the analysis behind `fblc check`.

It runs the passes only as far as each question needs (import; the training passes up to autodiff,
then the backward; the step's layout and fusion, without the layout search, which needs a target;
each adapter's passes on a copy), and asks the registries the same way the compiler would, so that
a model `check` passes also compiles (up to the attribute limits an emitter only checks when it
writes the kernel, e.g. AveragePool's ceil_mode).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Mapping

import onnx_ir as ir

from fblc.codegen.kernels import KERNEL_EMITTERS
from fblc.codegen.plan import kernel_groups
from fblc.compiler.adapters import (LINEAR_ADAPTERS, MEMORY_FLOOR_ADAPTERS, find_sites, select_adapter_sites,
                                    select_linear_sites)
from fblc.compiler.autodiff import GRADIENTS, differentiable_nodes, gradient_gaps
from fblc.errors import FblcError, UnsupportedOpError
from fblc.compiler.gaps import OpGap, op_label
from fblc.compiler.index_map import ALWAYS_VIEWS
from fblc.compiler.shapes import shape_error, shape_gaps
from fblc.compiler.summary import role_counts, skipped_site_label, trained_set_lines
from fblc.passes.build_gradients import BuildGradients, trainable_params
from fblc.passes.ftd_taxonomy import FTD_CLASSES, UNKNOWN_OP_CLASS
from fblc.passes.fuse import FuseKernels
from fblc.passes.infer_shapes import InferShapes
from fblc.passes.pipeline import TrainingOptions, import_passes, layout_passes, run_passes, training_passes
from fblc.passes.split_softmax import SPLITS
from fblc.tools.op_audit import LOWERINGS
from fblc.compiler import keys


@dataclass(frozen=True)
class OpRow:
    """One op type of the imported model and what each table says about it."""

    op: str
    nodes: int
    imported: str  # ok | no shape rule | data-dependent
    gradient: str  # yes | not needed | missing | refused | has rule | no rule (the last two: need unknown)
    kernel: str  # yes | missing | view | constant | not needed (attribute limits show only when compiling)
    layout: str  # FTD class, or the default class with "(default)"


@dataclass(frozen=True)
class Verdict:
    ok: bool
    detail: str


@dataclass
class Coverage:
    rows: list[OpRow]
    imports: Verdict
    trains: Verdict
    runs: Verdict
    adapters: dict[str, Verdict] = field(default_factory=dict)
    trained: list[str] = field(default_factory=list)  # the default trained set by layer group (summary.py)
    #: op -> nodes of the loaded model that the import rewrote into other ops (lower_composites, lower_recurrent)
    lowered: dict[str, int] = field(default_factory=dict)

    @property
    def supported(self) -> bool:
        return self.imports.ok and self.trains.ok and self.runs.ok


def _split_at_gradients(passes: list[ir.passes.PassBase]) -> tuple[list[ir.passes.PassBase], list[ir.passes.PassBase]]:
    """(the training passes before autodiff, autodiff and after): the need for rules is known in between."""
    index = next(i for i, p in enumerate(passes) if isinstance(p, BuildGradients))
    return passes[:index], passes[index:]


def _kernel_status(node: ir.Node, missing: set[str]) -> str:
    if op_label(node) in missing:
        return "missing"
    if node.domain in ("", "ai.onnx") and node.op_type in ALWAYS_VIEWS:
        return "view"  # reads its input's texture
    if node.op_type == "Constant":
        return "constant"  # its texture is preloaded
    if node.domain in ("", "ai.onnx") and node.op_type in SPLITS:
        return "split"  # split_softmax: a ReduceLogSumExp and an elementwise map
    return "yes" if KERNEL_EMITTERS.has(node) else "not needed"  # not in the step (folded, rewritten)


def _forward_kernel_gaps(forward: list[ir.Node]) -> list[OpGap]:
    """Without a step to fuse, every forward node but a view or a Constant would anchor a kernel."""
    return KERNEL_EMITTERS.missing(n for n in forward if n.op_type not in ALWAYS_VIEWS | SPLITS.keys()
                                   and n.op_type != "Constant")


def _adapter_verdict(model: ir.Model, options: TrainingOptions, kind: str) -> Verdict:
    """Whether `--adapter kind` builds: eligible conv (or, for lora, linear) sites, and gradient rules for its step."""
    adapted = replace(options, adapter=replace(options.adapter, kind=kind))
    sites = select_adapter_sites(find_sites(model.graph), options.adapter.sites)
    linear = select_linear_sites(model.graph, adapted.adapter, bool(sites))
    if not sites and not linear:
        pointwise = " and a 1x1 kernel" if options.adapter.sites == "pointwise" else ""
        return Verdict(False, f"no Conv with groups == 1{pointwise}" + (
            ", no MatMul/Gemm with a constant weight" if kind in LINEAR_ADAPTERS else ""))
    copy = ir.serde.deserialize_model(ir.serde.serialize_model(model))  # value metadata (roles) survives
    try:
        run_passes(copy, _split_at_gradients(training_passes(adapted))[0])
    except FblcError as error:  # e.g. a rank larger than a site's channels, --bn-train
        return Verdict(False, error.cause)
    gaps = gradient_gaps(copy.graph, copy.graph.outputs[0], trainable_params(copy.graph))
    if gaps:
        return Verdict(False, GRADIENTS.error(gaps).cause)
    meta = keys.json_of(copy.metadata_props, keys.ADAPTER)  # the sites --rank fits, and those it does not
    kinds = Counter(site["kind"] for site in meta["sites"])
    skipped = meta["skipped"]
    found = [f"{count} {kind} site{'s' if count != 1 else ''}" for kind, count in sorted(kinds.items())] + (
        [f"{len(skipped)} skipped ({skipped_site_label(skipped[0])}: {skipped[0]['reason']}"
         f"{', ...' if len(skipped) > 1 else ''})"] if skipped else [])
    return Verdict(True, ", ".join(filter(None, found)))


def _rows(nodes: list[ir.Node], imported: Mapping[str, str], gradient: Mapping[str, str],
          missing_kernels: set[str]) -> list[OpRow]:
    """A row per op type, in the order of its first node; an op neither table names imports, needs no gradient."""
    counts = Counter(op_label(node) for node in nodes)
    first: dict[str, ir.Node] = {}
    for node in nodes:
        first.setdefault(op_label(node), node)
    return [OpRow(label, counts[label], imported.get(label, "ok"), gradient.get(label, "not needed"),
                  _kernel_status(node, missing_kernels), layout.value if (layout := FTD_CLASSES.get(node, None))
                  is not None else f"{UNKNOWN_OP_CLASS.value} (default)") for label, node in first.items()]


def check_model(model: ir.Model, options: TrainingOptions) -> Coverage:
    """The support of `model` (as loaded) under `options`; raises FblcError only for bad input
    (dynamic dims without --input-shape, --train matching nothing, an --adapter without sites...)."""
    lowered = dict(Counter(n.op_type for n in model.graph if n.domain in ("", "ai.onnx") and n.op_type in LOWERINGS))
    for graph_pass in import_passes(options):
        try:
            run_passes(model, [graph_pass])
        except FblcError:  # a shape gap is a finding; anything else (e.g. a dynamic dim) is bad input
            if not isinstance(graph_pass, InferShapes) or not shape_gaps(model):
                raise
            break  # what follows needs static shapes
    forward = list(model.graph)
    found = shape_gaps(model)
    imported = {**dict.fromkeys((g.op for g in found.data_dependent), "data-dependent"),
                **dict.fromkeys((g.op for g in found.no_rule), "no shape rule")}
    if found:  # the training passes need static shapes: say what the tables hold, need unknown
        rules = {label: "has rule" if label in GRADIENTS else "no rule" for label in map(op_label, forward)}
        rows = _rows(forward, imported, rules, {g.op for g in _forward_kernel_gaps(forward)})
        blocked = Verdict(False, "not analysed: the training step needs every shape static")
        return Coverage(rows, Verdict(False, shape_error(found).cause), blocked, blocked,
                        {kind: blocked for kind in MEMORY_FLOOR_ADAPTERS}, lowered=lowered)
    adapters = {kind: _adapter_verdict(model, options, kind) for kind in MEMORY_FLOOR_ADAPTERS}

    before, after = _split_at_gradients(training_passes(options))
    run_passes(model, before)
    graph = model.graph
    trained = trained_set_lines(graph, shown=None)
    needed = {op_label(n) for n in differentiable_nodes(graph, graph.outputs[0], trainable_params(graph))}
    missing = {g.op for g in gradient_gaps(graph, graph.outputs[0], trainable_params(graph))}
    refused: set[str] = set()
    try:
        run_passes(model, after)
        tensors, elements = role_counts(model.graph).get(keys.Role.PARAM.value, (0, 0))
        trains = Verdict(True, f"{tensors} trainable tensor{'s' if tensors != 1 else ''}, {elements:,} parameters")
    except UnsupportedOpError as error:  # every op without a rule, and every node a rule refuses
        trains = Verdict(False, error.cause)
        refused = set(error.ops) - missing
    gradient = {**dict.fromkeys(needed, "yes"), **dict.fromkeys(refused, "refused"),
                **dict.fromkeys(missing, "missing")}
    if trains.ok:
        groups = kernel_groups(run_passes(model, layout_passes(options) + [FuseKernels()]).graph)
        kernel_gaps = KERNEL_EMITTERS.missing(g.anchor for g in groups)
        runs = (Verdict(False, KERNEL_EMITTERS.error(kernel_gaps).cause) if kernel_gaps else
                Verdict(True, f"every one of the step's {len(groups)} kernels has an emitter"))
    else:  # no step: the forward's nodes are all that is known to need a kernel
        kernel_gaps = _forward_kernel_gaps(forward)
        unknown = "the training step cannot be built, so its backward is not known"
        runs = Verdict(False, f"{KERNEL_EMITTERS.error(kernel_gaps).cause} (in the forward), and {unknown}"
                       if kernel_gaps else unknown)
    rows = _rows(forward, imported, gradient, {g.op for g in kernel_gaps})
    return Coverage(rows, Verdict(True, f"{len(forward)} nodes, every shape static"), trains, runs, adapters, trained,
                    lowered)
