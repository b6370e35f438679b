"""How a reduction's products reach a work-item's accumulators: three forms, and the cost that picks one
(docs/ARCHITECTURE.md §3, "A long reduction's work-item").

- "lanes": `float acc[lanes]`, a scalar multiply-add per product (PoCL's SLP vectorizer packs them).
- "texels": `float4 acc[lanes / 4]`, lane l in component l % 4 of texel l / 4 (swizzles where the k-th
  products of a texel's four lanes are not one texel's).
- "sums": `float4 acc[lanes]`, whose components sum every fourth step, added once at the end.
Paired (`pair_stride`), float4s t and t + pair are the halves of a float8.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from fblc.codegen.ir import (
    FLOAT, FLOAT4, FLOAT8, Assign, Block, Const, Element, Expr, Lane, Swizzle, Var, Vector, const)
from fblc.profiles.profile import PAIRED_SUM_FLOAT4S, SIMD_SUM_FLOAT4S

LANES = 4
FORMS = ("lanes", "texels", "sums")
#: the floats a SIMD register must hold for a work-item's float4 accumulators to pair into float8s
PAIRED_SIMD_FLOATS = 8

Operation = tuple[Expr, Expr, Expr]  # (target, x operand, w operand): `target += x * w`


class Update(NamedTuple):
    """`x * w` added to float4 accumulator `texel` (its `component`, or all four: None); x and w are float4s
    or scalars that OpenCL widens."""

    texel: int
    component: int | None
    x: Expr
    w: Expr


@dataclass(frozen=True)
class Accumulators:
    """Where a reduction of `lanes` outputs sums, in `form` (see the module docstring): the array `array`."""

    array: Var
    form: str = "lanes"
    pair: int = 0  # >0: float4s t and t + pair (t // pair even) are the halves of one float8

    def __post_init__(self) -> None:
        assert self.form in FORMS, f"accumulator form {self.form!r} is none of {', '.join(FORMS)}"
        assert not self.pair or self.form != "lanes", "only float4 accumulators pair into float8s"

    @staticmethod
    def declared(block: Block, kind: str, form: str, pair: int, lanes: int) -> Accumulators:
        """The accumulators of `lanes` outputs, declared all zero in `block`."""
        if form == "lanes":
            return Accumulators(block.array(kind, FLOAT, lanes, [const(0.0, FLOAT)] * lanes), form, pair)
        count = float4_count(form, lanes)
        assert not pair or count % (2 * pair) == 0, f"{count} float4s do not pair at stride {pair}"
        dtype, length = (FLOAT8, count // 2) if pair else (FLOAT4, count)
        zero = Vector(dtype, (const(0.0, FLOAT),))
        return Accumulators(block.array(kind, dtype, length, [zero] * length), form, pair)

    def totals(self, block: Block, lanes: int) -> Var:
        """The array `float acc[lanes]` of each output's total (the accumulators themselves in form lanes)."""
        if self.form == "lanes":
            return self.array
        if self.form == "texels":
            values = [self._float4(lane // LANES, lane % LANES) for lane in range(lanes)]
        else:
            values = [(sums.lane(0) + sums.lane(1)) + (sums.lane(2) + sums.lane(3))
                      for sums in map(self._float4, range(lanes))]
        return block.array("acc", FLOAT, lanes, values)

    def _float8(self, texel: int) -> tuple[Element, int]:
        """(the float8 that holds float4 `texel`, its half: 0 low, 1 high)."""
        pair = self.pair
        return Element(self.array, const(texel // (2 * pair) * pair + texel % pair)), texel // pair % 2

    def _float4(self, texel: int, component: int | None = None) -> Expr:
        """Float4 accumulator `texel`, or its `component`."""
        if not self.pair:
            whole = Element(self.array, const(texel))
            return whole if component is None else whole.lane(component)
        float8, half = self._float8(texel)
        return Swizzle(float8, LANES * half, LANES) if component is None else float8.lane(LANES * half + component)

    def add(self, terms: Sequence[tuple[int, Expr, Expr]], offsets: Sequence[tuple[int, int]] = ()) -> list[Assign]:
        """Statements that add each (lane, x, w) product to its lane; `offsets`, (x, w) element offsets of
        each product, find the runs the sums form adds four at a time."""
        return [Assign(target, x * w, "+=")  # type: ignore[arg-type]
                for target, x, w in self.operations(terms, offsets)]

    def operations(self, terms: Sequence[tuple[int, Expr, Expr]], offsets: Sequence[tuple[int, int]] = ()
                   ) -> list[Operation]:
        """The multiply-adds of the products, lane by lane, each lane's in their order. Interleaved updates of
        strided accumulators (a stride-2 ConvTranspose's even lanes from one texel's x, y, z, w) crash LLVM
        15's InstCombine in Debian's PoCL 3.1 (ShuffleVectorInst::isIdentityWithPadding)."""
        by_lane: dict[int, list[int]] = {}  # each lane's products in their order, lanes in order
        for index in sorted(range(len(terms)), key=lambda index: terms[index][0]):
            by_lane.setdefault(terms[index][0], []).append(index)
        if self.form == "lanes":
            return [(Element(self.array, const(lane)), *terms[i][1:]) for lane, run in by_lane.items() for i in run]
        sums = self.form == "sums"
        return self._paired(self._sums(terms, offsets, by_lane) if sums else self._texels(terms, by_lane))

    def _texels(self, terms: Sequence[tuple[int, Expr, Expr]], by_lane: dict[int, list[int]]) -> list[Update]:
        """The k-th products of a texel's four lanes are one float4 multiply-add; where a lane lacks
        its k-th product, the others add component by component."""
        updates: list[Update] = []
        for texel in sorted({lane // LANES for lane in by_lane}):
            runs = [[terms[i][1:] for i in by_lane.get(texel * LANES + component, [])] for component in range(LANES)]
            for k in range(max(len(run) for run in runs)):
                if all(k < len(run) for run in runs):
                    updates.append(_whole(texel, [run[k] for run in runs]))
                else:
                    updates += [Update(texel, component, *run[k]) for component, run in enumerate(runs) if k < len(run)]
        return updates

    def _paired(self, updates: list[Update]) -> list[Operation]:
        """The updates' multiply-adds. Paired, a low half's whole update and its high half's first unmatched
        whole update by the same w or the same x are one float8 multiply-add, at the low half's place in the
        order; every other update adds into its float4 or its component at its own place."""
        def whole(u: Update, high: int) -> bool:
            return bool(self.pair) and u.component is None and u.texel // self.pair % 2 == high

        high: dict[int, list[tuple[int, Update]]] = {}  # a high half's whole updates, with their positions
        for position, u in enumerate(updates):
            if whole(u, 1):
                high.setdefault(u.texel, []).append((position, u))
        float8s: dict[int, Operation] = {}  # by the position of the low half's update
        absorbed: set[int] = set()  # the positions of the high halves' updates that joined one
        for position, u in enumerate(updates):
            partner = high.get(u.texel + self.pair, []) if whole(u, 0) else []
            match = next((k for k, (_, other) in enumerate(partner) if other.w == u.w or other.x == u.x), None)
            if match is not None:
                high_position, other = partner.pop(match)
                absorbed.add(high_position)
                float8s[position] = (self._float8(u.texel)[0], float8_of(u.x, other.x), float8_of(u.w, other.w))
        return [float8s.get(position, (self._float4(u.texel, u.component), u.x, u.w))
                for position, u in enumerate(updates) if position not in absorbed]

    def _sums(self, terms: Sequence[tuple[int, Expr, Expr]], offsets: Sequence[tuple[int, int]],
              by_lane: dict[int, list[int]]) -> list[Update]:
        """A lane's products along one diagonal (x - w fixed) at four consecutive w from a multiple of 4 are
        one float4 multiply-add (w a whole texel); the others add into component w % 4."""
        assert len(offsets) == len(terms), "the sums form needs each product's (x, w) offsets"
        updates: list[Update] = []
        for lane, indices in by_lane.items():
            indices = sorted(indices, key=lambda i: (offsets[i][0] - offsets[i][1], offsets[i][1]))
            at = 0
            while at < len(indices):
                run = indices[at:at + LANES]
                x0, w0 = offsets[run[0]]
                whole = w0 % LANES == 0 and [offsets[i] for i in run] == [(x0 + k, w0 + k) for k in range(LANES)]
                updates.append(_whole(lane, [terms[i][1:] for i in run]) if whole
                               else Update(lane, w0 % LANES, *terms[run[0]][1:]))
                at += LANES if whole else 1
        return updates


def _whole(texel: int, products: Sequence[tuple[Expr, Expr]]) -> Update:
    """Four (x, w) products as one float4 multiply-add into accumulator `texel`."""
    xs, ws = zip(*products)
    return Update(texel, None, float4_of(xs), float4_of(ws))


def cost(operations: Sequence[Operation]) -> int:
    """Instructions of `operations` on SIMD registers: one per multiply-add, one per distinct operand built
    from several texels or components, float8s and their halves included (a shuffle or an insert; a
    scalar broadcasts from memory for free, and a float8 of two whole texels is a load and an insert
    from memory)."""
    built = {part for _, x, w in operations for operand in (x, w) for part in _built(operand)}
    return len(operations) + len(built)


def _built(operand: Expr) -> list[Expr]:
    """`operand` if shuffles or inserts build it (a Vector), with the halves of a float8 that they build;
    a float8 of two named float4s (whole texels) is not built."""
    if not isinstance(operand, Vector):
        return []
    if operand.dtype.lanes == LANES:
        return [operand]
    parts = [part for half in operand.parts for part in _built(half)]
    return parts if all(isinstance(half, Var) for half in operand.parts) else [operand] + parts


def pair_stride(products: Sequence[tuple[int, int, int]], form: str, lanes: int, simd_floats: int) -> int:
    """The stride that pairs float4 accumulators into float8s at least cost (`cost` of one block of
    (lane, x offset, w offset) `products`), or 0: no pairing is cheaper, the form has no float4s, or a
    SIMD register holds fewer than PAIRED_SIMD_FLOATS floats."""
    if form == "lanes" or simd_floats < PAIRED_SIMD_FLOATS:
        return 0
    costs = {stride: cost(_stand_in_operations(products, form, stride))
             for stride in pairings(float4_count(form, lanes))}
    return min(costs, key=lambda stride: (costs[stride], stride))


def pairings(count: int) -> tuple[int, ...]:
    """Strides that pair `count` float4 accumulators two by two (0: no pairing)."""
    return (0,) + tuple(s for s in range(1, count // 2 + 1) if count % (2 * s) == 0)


def _stand_in_operations(products: Sequence[tuple[int, int, int]], form: str, pair: int = 0) -> list[Operation]:
    """The operations of a block of (lane, x offset, w offset) `products` in `form` (paired at `pair`),
    each element a stand-in read from texel-aligned bases (what the costs compare)."""
    def element(tensor: str, offset: int) -> Expr:  # a lane of the texel holding it
        return Var(tensor, offset >> 2, FLOAT4).lane(offset & 3)

    terms = [(lane, element("X", x), element("W", w)) for lane, x, w in products]
    return Accumulators(Var("a", 0, FLOAT4), form, pair).operations(terms, [(x, w) for _, x, w in products])


def block_cost(products: Sequence[tuple[int, int, int]], form: str) -> float:
    """Instructions per product of a block of (lane, x offset, w offset) `products` summed in `form` (its
    `cost`, and a load per distinct texel of X and of W, read from texel-aligned bases): what tiles of
    different shapes compare by."""
    loads = len({x >> 2 for _, x, _ in products}) + len({w >> 2 for _, _, w in products})
    return (cost(_stand_in_operations(products, form)) + loads) / max(1, len(products))


def choose_form(products: Sequence[tuple[int, int, int]], lanes: int, long: bool, cpu: bool,
                simd_floats: int = 1) -> str:
    """The form for `lanes` outputs whose block of (lane, x offset, w offset) `products` belongs to a
    reduction longer than SERIAL_REDUCTION (`long`) or not, on a CPU or not, whose SIMD register holds
    `simd_floats` floats; see the module docstring."""
    if lanes % LANES or not (long or simd_floats >= PAIRED_SIMD_FLOATS):
        return "lanes"
    if not cpu or lanes > sum_float4s(simd_floats):
        return "texels"
    return min(("texels", "sums"), key=lambda form: block_cost(products, form))


def sum_float4s(simd_floats: int) -> int:
    """The most float4 partial sums (the "sums" form) a CPU work-item keeps whose SIMD register holds
    `simd_floats` floats: two to a register where they pair into float8s (pair_stride)."""
    return PAIRED_SUM_FLOAT4S if simd_floats >= PAIRED_SIMD_FLOATS else SIMD_SUM_FLOAT4S


def float4_count(form: str, lanes: int) -> int:
    """The float4 accumulators of `lanes` outputs in `form` (texels: 4 outputs each; sums: one each)."""
    return lanes // LANES if form == "texels" else lanes


def float8_of(low: Expr, high: Expr) -> Expr:
    """Two halves (float4s or scalars) as a float8: a scalar that is both halves as itself (OpenCL widens
    it), else each half a float4 (a scalar widened)."""
    if low == high and low.dtype.lanes == 1:
        return low
    return Vector(FLOAT8, tuple(half if half.dtype.lanes == LANES else Vector(FLOAT4, (half,)) for half in (low, high)))


def float4_of(values: Sequence[Expr]) -> Expr:
    """Four scalars as a float4: the scalar when all four are one (OpenCL widens it), a texel itself for
    its own x, y, z, w, swizzles for runs of one texel's consecutive components."""
    if len(set(values)) == 1:
        return values[0]
    parts: list[tuple[Expr, list[int]]] = []  # (texel or scalar, its components)
    for value in values:
        texel = value.vector if isinstance(value, Lane) and isinstance(value.index, Const) else None
        if not isinstance(texel, Var):
            parts.append((value, []))
            continue
        component = int(value.index.value)  # type: ignore[union-attr]
        if parts and parts[-1][0] == texel and parts[-1][1] and parts[-1][1][-1] + 1 == component:
            parts[-1][1].append(component)
        else:
            parts.append((texel, [component]))
    if len(parts) == 1 and parts[0][1] == list(range(LANES)):
        return parts[0][0]
    return Vector(FLOAT4, tuple(part if not components else part.lane(components[0]) if len(components) == 1
                                else Swizzle(part, components[0], len(components)) for part, components in parts))
