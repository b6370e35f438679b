"""GroupMerges: how a group kernel's work-items join their partials (KernelBuilder's, docs/ARCHITECTURE.md §3).

A long reduction dealt out to a work-group leaves each work-item a partial; `merge_across_group` joins them by a
__local tree of TREE_FAN_IN partials a level (log4 of the group's barriers), or by sub-group built-ins where the
profile says the device has them (the tree stays in the same source as the fallback), and
`merge_tiles_across_group` sums partial tiles through __local rows of an odd pitch (no bank conflicts).
"""

from __future__ import annotations

import operator
from functools import reduce
from typing import TYPE_CHECKING, Callable, Sequence

from fblc.codegen import ir as kir
from fblc.codegen.ir import INT, Block, Expr, Statement, Var, const

if TYPE_CHECKING:
    from fblc.codegen.textures import TextureTable

TREE_FAN_IN = 4  # partials a work-item joins per level of a group's __local tree
#: how a group joins its work-items' partials: the join of two (the __local tree's) and the sub-group built-in
MERGES: dict[str, tuple[Callable[[Expr, Expr], Expr], str]] = {
    "add": (operator.add, "sub_group_reduce_add"), "max": (lambda a, b: kir.call("fmax", a, b), "sub_group_reduce_max")}


class GroupMerges:
    """The merges of KernelBuilder's group kernels; the attributes below are KernelBuilder's."""

    table: TextureTable
    group_size: int | None
    tiles_per_group: int
    shared_floats: int
    shared: Var

    def merge_across_group(self, accs: Sequence[Var | kir.Lane], merge: str = "add", prologue: bool = False) -> None:
        """Join every work-item's partials `accs` (floats, or lanes of a float4: all of them with one set of
        barriers) by `merge` (MERGES), in the lane loop or the per-texel `prologue`; then every work-item holds
        the results. Where the profile says the device has sub-groups, each sub-group joins its partials with a
        sub-group built-in and the group only its sub-groups' results; the __local tree is the fallback in the
        same source (a device compiler without them takes it). Only in a group kernel's uniform code: every
        work-item must reach the barriers (and the sub-group built-ins)."""
        assert self.group_size is not None and self.tiles_per_group == 1, "a merge across one item's group"
        self.shared_floats = max(self.shared_floats, len(accs) * self.group_size)
        block = self.prologue if prologue else self.body
        tree = self._merge_tree(accs, MERGES[merge][0])
        if self.table.profile.subgroups:
            block.add(kir.WithFeature("subgroups", self._merge_sub_groups(accs, merge), tree))
        else:
            block.add(*tree)

    def _partial(self, value: int, slot: Expr) -> kir.Element:
        """The __local slot of partial `slot` of merged value `value`: a value's partials are consecutive
        words, so consecutive work-items touch consecutive words (no bank conflicts)."""
        assert self.group_size is not None
        return kir.Element(self.shared, slot + value * self.group_size if value else slot)

    def _merge_tree(self, accs: Sequence[Var | kir.Lane], two: Callable[[Expr, Expr], Expr]) -> list[Statement]:
        """The __local tree: each level joins TREE_FAN_IN partials a work-item (log4 of the group's
        barriers, not log2), down to at most TREE_FAN_IN partials, which every work-item then joins itself."""
        out, lid, live = Block(self.numbering), self.lid, self.group_size
        assert live is not None and live & (live - 1) == 0, f"a tree over {live} work-items"
        for v, acc in enumerate(accs):
            out.assign(self._partial(v, lid), acc)
        out.add(kir.Barrier())
        while live > TREE_FAN_IN:
            live //= TREE_FAN_IN
            joins = [kir.Assign(self._partial(v, lid), reduce(two, [self._partial(v, lid + k * live if k else lid)
                                                                    for k in range(TREE_FAN_IN)]))
                     for v in range(len(accs))]
            out.add(kir.If(lid.lt(live), joins), kir.Barrier())
        for v, acc in enumerate(accs):
            out.assign(acc, reduce(two, [self._partial(v, const(k)) for k in range(live)]))
        out.add(kir.Barrier())  # shared is free again for the next merge
        return out.statements

    def _merge_sub_groups(self, accs: Sequence[Var | kir.Lane], merge: str) -> list[Statement]:
        """Each sub-group joins its work-items' partials (a sub-group built-in), its first work-item stores
        them, and every work-item joins the group's few sub-group results: two barriers whatever the size."""
        two, built_in = MERGES[merge]
        out = Block(self.numbering)
        for acc in accs:  # assigned in place: a value folded into the `if` below would leave the built-in
            out.assign(acc, kir.call(built_in, acc, dtype=kir.FLOAT))  # to some work-items only
        sub_group = kir.call("get_sub_group_id", dtype=INT)
        out.add(kir.If(kir.call("get_sub_group_local_id", dtype=INT).eq(0),
                       [kir.Assign(self._partial(v, sub_group), acc) for v, acc in enumerate(accs)]))
        out.add(kir.Barrier())
        count = out.let(kir.call("get_num_sub_groups", dtype=INT), "subs")
        for v, acc in enumerate(accs):
            out.assign(acc, self._partial(v, const(0)))
        with out.loop("j", 1, count) as (j, join):
            for v, acc in enumerate(accs):
                join.assign(acc, two(acc, self._partial(v, j)))
        out.add(kir.Barrier())  # shared is free again for the next merge
        return out.statements

    def merge_tiles_across_group(self, array: Var, lanes: int) -> list[Statement]:
        """Statements that sum the work-items' partial tiles `array[lanes]` (a reduction the group dealt
        out) through __local memory: each work-item stores its partials as a row of `pitch` words, work-item j
        sums column j (and every group_size-th after it) in work-item order into the column's first word, and
        work-item 0, the one that writes the tile (`finish`), reads the totals. The pitch is odd, so the rows'
        stores and the columns' sums both touch distinct banks across consecutive work-items."""
        group = self.group_size
        assert group is not None, "a merge across the group needs a group kernel"
        pitch = lanes | 1
        self.shared_floats = max(self.shared_floats, group * pitch)
        out = Block(self.numbering)
        with out.loop("j", 0, lanes, unroll=True) as (j, store):
            store.assign(kir.Element(self.shared, self.lid * pitch + j), kir.Element(array, j))
        out.add(kir.Barrier())
        with out.loop("j", self.lid, lanes, step=group) as (j, sums):
            total = sums.mutable(const(0.0, kir.FLOAT), "total")
            with sums.loop("part", 0, group) as (part, terms):
                terms.assign(total, kir.Element(self.shared, part * pitch + j), "+=")
            sums.assign(kir.Element(self.shared, j), total)  # column j is work-item j's alone
        out.add(kir.Barrier())
        with out.loop("j", 0, lanes, unroll=True) as (j, read):
            read.assign(kir.Element(array, j), kir.Element(self.shared, j))
        return out.statements
