"""fuse: group the step graph's nodes into kernels.

Rewrite: writes `fblc.kernel` = `k<N>` on every node that runs in a kernel (N is the launch
order), and `alias` on views (Identity, and data movement that tile_remap turned into index
maps) that read their root's texture. Two kernels merge when both are elementwise chains (or one is a
contraction, MatMul/Gemm/Conv/ConvTranspose, or a reduction, and the other only feeds its epilogue), their
outputs have the same shape (one work-item per output element serves both), the consumer reads
the producer's output in its own order (directly, or through a view that keeps the order), and no third
kernel lies between them (merging would form a cycle), and the merged kernel reads at most
READ_IMAGE_ARGS textures (a sum over every parameter's gradient stays within what OpenCL guarantees). An elementwise node tries to merge
with the kernels of all its inputs, so chains over parameters and optimizer state (Adam's
moment updates) become one kernel, and an optimizer update joins the kernel that makes its gradient (a weight
gradient's conv, a reduction over the batch): no launch of its own. A Transpose marked keys.WRITTEN_BY_PRODUCER
(a conv weight gradient in W's own order, kept by tile_remap on CPU targets) joins the conv that makes its input,
whose kernel then runs over the Transpose's elements (written_by, adopt). Sibling reductions (one input shape, the same
reduced axes and output shape: BatchNorm's dgamma and dbeta) whose inputs one kernel makes, or that read one
input, fold in one kernel, each in turn per output element; so do total reductions (one output element) of one
stage whatever their inputs (the finite check's sum of each parameter's gradient), each joining the last such
kernel while it reads at most READ_IMAGE_ARGS textures. An elementwise node that only a reduction reads, as its input,
from operands of its own shape read in their order (`reduction_prologue`: BatchNorm's dy * x_hat under dgamma) is
the reduction's prologue: its kernel computes each texel as it folds it, from the operands' texels, and the node's
output is never stored (its siblings are found through the operands' kernels). A reduction of another reduction's
signature that is no sibling (the next BatchNorm site of the same map shape) joins the last kernel of that
signature while the merged kernel holds at most SAME_SHAPE_REDUCTIONS reductions: one launch for several sites'
dgamma and dbeta, the earlier sites' maps kept until the last site's are made. A Concat or constant Pad (GATHERS) merges into the
elementwise chain that reads it, which then computes it per element from its inputs' textures
(a rotary embedding's rotate_half, a slice's gradient summed with another), but never with a
contraction or reduction, or with a kernel that makes one of its inputs (it reads them at other elements than
its own). Every other op runs alone. Backward nodes join a kernel of the forward or the loss (and so run early,
what they make saved for the backward) only where that frees a saved value or makes bool masks
(keeps_backward_late); pass recompute's copies never do. No kernel holds nodes of two phases of a loop (before, body, after:
pass es_loop). Kernels are numbered in a topological order, each as early as its own first node or the
earliest kernel that needs it (a merged kernel may read a producer placed later in the graph). Preconditions: static shapes; topologically sorted graph. In place;
`modified` is true when any annotation changed.
"""

from __future__ import annotations

import networkx as nx
import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.index_map import is_view, map_of, real_producer, real_readers, view_root
from fblc.compiler.values import attr, static_shape
from fblc.passes.contracts import ContractPass
from fblc.passes.fusion_rules import (ALIAS, CONTRACTIONS, DEQUANTIZING_READS, ELEMENTWISE, GATHERS, IN_READERS,
                                      REDUCTIONS, TOTAL, dequantized_in_readers, kernel_of, reduced_axes,
                                      reduction_prologue, reduction_signature, written_by)
from fblc.profiles.profile import READ_IMAGE_ARGS

#: kinds of kernel that an elementwise epilogue can join but never a prologue: their anchors fold their inputs
#: (a reduction's prologue is the exception: `reduction_prologue`)
ANCHORED = ("contraction", "reduction")
#: the most reductions of one signature that are no siblings a kernel folds (four BatchNorm sites' dgamma and dbeta:
#: each merge keeps the earlier sites' dy and x_hat live until the last site's are made, so few; MobileNetV2 B=8
#: adreno830: 4 gave 213 launches, 8 gives 203 and a device peak 0.8 MB (1 %) higher)
SAME_SHAPE_REDUCTIONS = 8


#: stages whose nodes run before the backward (a node without one is the model's forward)
EARLY_STAGES = ("forward", "loss")


def _stage(node: ir.Node) -> str:
    return node.metadata_props.get(keys.STAGE, "forward")


def _kind(node: ir.Node) -> str:
    if node.op_type in ELEMENTWISE and len(node.outputs) == 1:
        return "elementwise"
    if node.op_type in CONTRACTIONS:
        return "contraction"
    if node.op_type in REDUCTIONS and len(node.outputs) == 1:
        return "reduction"
    mode = attr(node, "mode", "constant")
    if node.op_type in GATHERS and (mode.decode() if isinstance(mode, bytes) else mode) == "constant":
        return "gather"
    return "single"


class _Groups:
    """Kernels under construction: union-find over nodes, with what merging needs to know."""

    def __init__(self, nodes: list[ir.Node]) -> None:
        self.position = {id(n): i for i, n in enumerate(nodes)}
        self.root: dict[int, int] = {}
        self.members: dict[int, list[ir.Node]] = {}
        self.kind: dict[int, str] = {}
        self.shape: dict[int, tuple[int, ...]] = {}
        self.span: dict[int, tuple[int, int]] = {}  # group -> (first, last) node position
        # the graph does not change while fusing: each node's readers and producers, through views, once
        self.readers = {id(n): [c for v in n.outputs for c in real_readers(v)] for n in nodes}
        self.producers = {id(n): [p for p in map(real_producer, n.inputs) if p is not None] for n in nodes}
        self.reads: dict[int, set[int]] = {}  # group -> the textures (view roots) its nodes read
        self.writes: dict[int, set[int]] = {}  # group -> the values its nodes make
        self.gathers: dict[int, list[ir.Node]] = {}  # group -> its Concat / Pad nodes
        self.anchors: dict[int, list[ir.Node]] = {}  # group -> the contraction or reductions it is built around
        self.signature: dict[int, tuple] = {}  # a reduction group -> what a sibling reduction must share
        #: group -> a level above every kernel it reads (longest path from the graph's inputs), kept by merge
        self.level: dict[int, int] = {}
        #: group -> whether it holds nodes of the forward or the loss (run before the backward), of the backward, and
        #: copies that pass recompute made (`keeps_backward_late`)
        self.early: dict[int, bool] = {}
        self.late: dict[int, bool] = {}
        self.copies: dict[int, bool] = {}
        #: backward elementwise nodes computed from forward values and constants alone (through others of them): they
        #: can join a forward kernel, so a forward value that only they read need not stay for the backward
        self.movable: set[int] = set()
        for node in nodes:
            if _stage(node) == "backward" and _kind(node) == "elementwise" and all(
                    p.op_type == "Constant" or _stage(p) in EARLY_STAGES or id(p) in self.movable
                    for p in self.producers[id(node)]):
                self.movable.add(id(node))
        #: group -> the groups it reads from (predecessors), kept by add and merge: the cycle search
        #: (reaches_through_third) asks for them over and over, and recomputing them walked every member
        self._predecessors: dict[int, set[int]] = {}

    def add(self, node: ir.Node) -> int:
        key = id(node)
        self.root[key] = key
        self.members[key] = [node]
        self.span[key] = (self.position[key], self.position[key])
        self.kind[key] = _kind(node)
        self.gathers[key] = [node] if self.kind[key] == "gather" else []
        self.anchors[key] = [node] if self.kind[key] in ANCHORED else []
        self.signature[key] = reduction_signature(node) if self.kind[key] == "reduction" else ()
        self.shape[key] = static_shape(node.outputs[0])
        self.reads[key] = {id(view_root(v)) for v in node.inputs if v is not None}
        self.writes[key] = {id(v) for v in node.outputs if v is not None}
        self.early[key], self.late[key] = _stage(node) in EARLY_STAGES, _stage(node) == "backward"
        self.copies[key] = keys.RECOMPUTE in node.metadata_props
        # nodes come in graph order (producers first): a node added later is no one's predecessor before it
        self._predecessors[key] = self._neighbours(key, self.producers)
        self.level[key] = 1 + max((self.level[g] for g in self.predecessors(key)), default=0)
        return key

    def textures_read(self, a: int, b: int) -> int:
        """The textures a kernel of groups a and b together reads (what neither makes itself)."""
        return len((self.reads[a] | self.reads[b]) - self.writes[a] - self.writes[b])

    def find(self, key: int) -> int:
        while self.root[key] != key:
            self.root[key] = self.root[self.root[key]]
            key = self.root[key]
        return key

    def of(self, node: ir.Node) -> int | None:
        return self.find(id(node)) if id(node) in self.root else None

    def phase(self, group: int) -> str | None:
        """Before, in or after the plan's loop (keys.LOOP_PHASE, pass es_loop); None in a step with no loop."""
        return self.members[group][0].metadata_props.get(keys.LOOP_PHASE)

    def first(self, group: int) -> int:
        return self.span[group][0]

    def last(self, group: int) -> int:
        return self.span[group][1]

    def _neighbours(self, group: int, links: dict[int, list[ir.Node]]) -> set[int]:
        found = set()
        for node in self.members[group]:
            for linked in links[id(node)]:
                other = self.of(linked)
                if other is not None and other != group:
                    found.add(other)
        return found

    def successors(self, group: int) -> set[int]:
        return self._neighbours(group, self.readers)

    def predecessors(self, group: int) -> set[int]:
        return self._predecessors[group]

    def reaches_through_third(self, source: int, target: int) -> bool:
        """A path source -> X -> ... -> target with X another kernel (merging would make a cycle).

        Searched backwards from target: only kernels of a level above source's can lie on it (the levels,
        not the nodes' positions: a kernel that spans the graph links nodes that no node path links)."""
        limit = self.level[source]
        frontier = [g for g in self.predecessors(target) if g != source]
        seen = set(frontier)
        while frontier:
            group = frontier.pop()
            if self.level[group] <= limit:
                continue  # source is no ancestor of it
            for predecessor in self.predecessors(group):
                if predecessor == source:
                    return True
                if predecessor not in seen:
                    seen.add(predecessor)
                    frontier.append(predecessor)
        return False

    def siblings(self, node: ir.Node) -> list[int]:
        """Kernels that may hold a sibling of reduction `node`: the readers of the kernel that makes its
        input (BatchNorm's dgamma and dbeta reduce two outputs of one kernel), or of its input itself; with a
        prologue (its input computed in its own kernel), those of each of the prologue's operands."""
        own = self.of(node)
        sources = [node.inputs[0]]
        producer = real_producer(node.inputs[0]) if node.inputs[0] is not None else None
        if producer is not None and self.of(producer) == own:
            sources = list(producer.inputs)
        found: set[int | None] = set()
        for source in sources:
            producer = real_producer(source) if source is not None else None
            if producer is not None and self.of(producer) is not None:
                found |= self.successors(self.of(producer))  # type: ignore[arg-type]
            elif source is not None:
                found |= {self.of(reader) for reader in real_readers(view_root(source))}
        return sorted((g for g in found if g is not None and g != own and self.kind[g] == "reduction"),
                      key=self.first)

    def can_merge(self, a: int, b: int) -> bool:
        if a == b or "single" in (self.kind[a], self.kind[b]) or self.shape[a] != self.shape[b]:
            return False
        if self.phase(a) != self.phase(b):
            return False  # one runs in a loop's body, the other before or after it (es_loop)
        if self.kind[a] in ANCHORED and self.kind[b] in ANCHORED and not (
                self.kind[a] == self.kind[b] == "reduction" and self.signature[a] == self.signature[b]):
            return False  # two contractions, or reductions of different extents (each has its own schedule)
        if self.gathers[a] or self.gathers[b]:  # a gather reads its inputs' textures at other elements
            if self.kind[a] in ANCHORED or self.kind[b] in ANCHORED:
                return False
            if any(self.of(producer) in (a, b) for gather in self.gathers[a] + self.gathers[b]
                   for producer in self.producers[id(gather)]):
                return False
        for anchored, other in ((a, b), (b, a)):
            if any(self.of(producer) == other for anchor in self.anchors[anchored]
                   for producer in self.producers[id(anchor)]):
                return False  # the other kernel would be an anchor's prologue
        if self.textures_read(a, b) > READ_IMAGE_ARGS or not self.keeps_backward_late(a, b):
            return False
        return not self.reaches_through_third(a, b) and not self.reaches_through_third(b, a)

    def keeps_backward_late(self, a: int, b: int) -> bool:
        """False where merging would run a kernel's backward nodes in a kernel of the forward (or the loss) for
        nothing: a copy of pass recompute (run in the forward, it and what it makes stay live to the backward, as
        if never recomputed), or nodes that free no forward value: each output becomes one more saved activation
        beside the inputs that stay saved anyway (RMSNorm's Pow backward 2x beside x, the residual stream: 67 MB
        on the 1B LoRA step). They run early where some forward value has no backward reader but them (what they
        make is saved instead of it) or where they make only bool masks (a ReLU gradient's y > 0: saved at one bit
        an element, a launch of their own in the backward where the kernel reading them is a contraction's)."""
        for early, late in ((a, b), (b, a)):
            if self.early[early] and self.late[late] and not self.early[late]:
                masks = all(v.dtype == ir.DataType.BOOL for n in self.members[late] for v in n.outputs)
                return not self.copies[late] and (masks or self._frees(late, early))
        return True

    def _frees(self, late: int, early: int) -> bool:
        """Whether a value that `late`'s nodes read, made in the forward or in kernel `early`, has no backward reader
        outside groups late and early but movable ones (BatchNorm's x - mean, made early, read by x_hat's Mul alone; a
        GELU's x, read by its derivative's chain)."""
        made_early = {id(n) for n in self.members[early]}
        inside = made_early | {id(n) for n in self.members[late]}
        for node in self.members[late]:
            for producer in self.producers[id(node)]:
                if (_stage(producer) in EARLY_STAGES or id(producer) in made_early) and all(
                        id(reader) in inside or id(reader) in self.movable
                        for reader in self.readers[id(producer)] if _stage(reader) == "backward"):
                    return True
        return False

    def merge(self, a: int, b: int) -> int:
        keep, gone = (a, b) if self.kind[a] in ANCHORED or self.kind[b] not in ANCHORED else (b, a)
        self.root[gone] = keep
        self.anchors[keep] += self.anchors.pop(gone)
        anchors = {id(n) for n in self.anchors[keep]}
        merged = sorted(self.members[keep] + self.members.pop(gone),
                        key=lambda n: (id(n) not in anchors, self.position[id(n)]))
        self.members[keep] = merged
        (a_first, a_last), (b_first, b_last) = self.span[keep], self.span.pop(gone)
        self.span[keep] = (min(a_first, b_first), max(a_last, b_last))
        self.reads[keep] = (self.reads[keep] | self.reads.pop(gone)) - self.writes[keep]
        self.writes[keep] |= self.writes.pop(gone)
        self.reads[keep] -= self.writes[keep]
        self.gathers[keep] += self.gathers.pop(gone)
        self.level[keep] = max(self.level[keep], self.level.pop(gone))
        for flags in (self.early, self.late, self.copies):
            flags[keep] |= flags.pop(gone)
        for table in (self.kind, self.shape, self.signature):
            table.pop(gone)
        self._predecessors[keep] = (self._predecessors[keep] | self._predecessors.pop(gone)) - {keep, gone}
        for successor in self.successors(keep):  # they read gone's nodes from keep now
            predecessors = self._predecessors[successor]
            predecessors.discard(gone)
            predecessors.add(keep)
        self._raise_levels(keep)
        return keep

    def adopt(self, producer: int, written: int) -> int:
        """Merge `written`, a Transpose that `producer`'s kernel writes in its order, into that kernel: its
        work-items then run over the Transpose's elements (its epilogue and readers see that shape)."""
        shape = self.shape[written]
        keep = self.merge(producer, written)
        self.shape[keep] = shape
        return keep

    def _raise_levels(self, group: int) -> None:
        """Lift the kernels after `group` above it (a merge may have raised it above a successor's level)."""
        stack = [group]
        while stack:
            lower = stack.pop()
            for successor in self.successors(lower):
                if self.level[successor] <= self.level[lower]:
                    self.level[successor] = self.level[lower] + 1
                    stack.append(successor)


class FuseKernels(ContractPass):
    """Assign nodes to kernels, fusing elementwise chains with each other and into contraction epilogues (in place)."""

    name = "fuse"
    requires_facts = ("static shapes", "index maps")
    ensures_facts = ("kernels", "kernel order")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        nodes = list(model.graph)
        groups = _Groups(nodes)
        totals: dict[tuple, int] = {}  # a total reduction's signature -> the last kernel that holds one
        recent: dict[tuple, int] = {}  # another reduction's signature -> the last kernel that holds one
        in_readers = {id(n) for n in nodes if dequantized_in_readers(n)}
        prologues = {id(reduction): n for n in nodes if (reduction := reduction_prologue(n)) is not None
                     and reduction.metadata_props.get(keys.LOOP_PHASE) == n.metadata_props.get(keys.LOOP_PHASE)}
        for node in nodes:
            if is_view(node) or id(node) in in_readers:
                continue
            group = groups.add(node)
            written = written_by(node)
            if written is not None and groups.of(written) is not None:
                groups.adopt(groups.of(written), group)  # type: ignore[arg-type]
                continue
            if any(prologues.get(id(reader)) is node for reader in groups.readers[id(node)]):
                continue  # its reduction's prologue: joins that kernel with it (below)
            if groups.kind[group] == "reduction":
                prologue = prologues.get(id(node))
                if prologue is not None:
                    group = groups.merge(group, groups.of(prologue))  # type: ignore[arg-type]
                signature = groups.signature[group]
                last = [totals[signature]] if signature[0] == TOTAL and signature in totals else []
                for sibling in groups.siblings(node) + last:
                    if groups.can_merge(groups.find(sibling), group):
                        group = groups.merge(groups.find(sibling), group)
                if signature[0] == TOTAL:
                    totals[signature] = group
                    continue
                earlier = groups.find(recent[signature]) if signature in recent else None
                if earlier is not None and earlier != group and groups.can_merge(earlier, group) \
                        and len(groups.anchors[earlier]) + len(groups.anchors[group]) <= SAME_SHAPE_REDUCTIONS:
                    group = groups.merge(earlier, group)
                recent[signature] = group
                continue
            if groups.kind[group] != "elementwise":
                continue
            for value in node.inputs:
                # through a view only when it reads in the producer's order: element i is element i
                producer = real_producer(value) if value is not None and map_of(value).contiguous else None
                other = groups.of(producer) if producer is not None else None
                if other is not None and groups.can_merge(other, group):
                    group = groups.merge(other, group)
        order = self._launch_order(groups)
        assignment = {id(n): ALIAS for n in nodes if is_view(n)} | {key: IN_READERS for key in in_readers}
        for index, group in enumerate(order):
            for node in groups.members[group]:
                assignment[id(node)] = f"k{index}"
        modified = False
        for node in nodes:
            if node.metadata_props.get(keys.KERNEL) != assignment[id(node)]:
                node.metadata_props[keys.KERNEL] = assignment[id(node)]
                modified = True
        return ir.passes.PassResult(model, modified)

    @staticmethod
    def _launch_order(groups: _Groups) -> list[int]:
        dag = nx.DiGraph()
        dag.add_nodes_from(groups.members)
        for group in groups.members:
            dag.add_edges_from((group, successor) for successor in groups.successors(group))
        first = {g: groups.first(g) for g in groups.members}
        # a kernel is wanted as early as the earliest kernel that needs it: a merged kernel (a weight gradient's
        # contraction with its optimizer update) may read a producer placed later in the graph (Adam's bias
        # corrections, made from the step count alone); ordered by its own first node, that producer would run
        # late and hold the merged kernel, and every activation the contraction reads, to the end of the step
        wanted = dict(first)
        for group in reversed(list(nx.topological_sort(dag))):
            wanted[group] = min([first[group], *(wanted[s] for s in dag.successors(group))])
        return list(nx.lexicographical_topological_sort(dag, key=lambda g: (wanted[g], first[g])))


#: fusion_rules's names that modules and tests import from fuse
__all__ = ["ALIAS", "DEQUANTIZING_READS", "FuseKernels", "IN_READERS", "REDUCTIONS", "dequantized_in_readers",
           "kernel_of", "reduced_axes", "reduction_prologue", "written_by"]
