"""How a reduction's products reach a work-item's accumulators: three forms, and the cost that picks one
(docs/ARCHITECTURE.md §3, "A long reduction's work-item").

- "lanes": `float acc[lanes]`, a scalar multiply-add per product (PoCL's SLP vectorizer packs them).
- "texels": `float4 acc[lanes / 4]`, lane l in component l % 4 of texel l / 4 (swizzles where the k-th
  products of a texel's four lanes are not one texel's).
- "sums": `float4 acc[lanes]`, whose components sum every fourth step, added once at the end.
Paired (`pair_stride`), float4s t and t + pair are the halves of a float8; grouped by four (`width` 4, where a
contraction's SIMD register holds 16 floats: AVX-512), float4s t, t + pair, t + 2 pair, t + 3 pair are the
quarters of a float16 (one zmm register: PoCL's GEMM tiles 82 -> 141 GFLOP/s on AVX-512, gemm 256x128x512).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from fblc.codegen.ir import (
    FLOAT, FLOAT4, Assign, Block, Const, Element, Expr, Lane, Swizzle, Var, Vector, const)
from fblc.profiles.profile import PAIRED_SUM_FLOAT4S, SIMD_SUM_FLOAT4S

LANES = 4
FORMS = ("lanes", "texels", "sums")
#: the floats a SIMD register must hold for a work-item's float4 accumulators to pair into float8s
PAIRED_SIMD_FLOATS = 8
#: float4s one accumulator vector may group: two (a float8), four (a float16) where the register holds 16 floats
VECTOR_TEXELS = (2, 4)

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
    width: int = 2  # float4s a paired vector holds (VECTOR_TEXELS): t + k * pair is its k-th quarter at 4

    def __post_init__(self) -> None:
        assert self.form in FORMS, f"accumulator form {self.form!r} is none of {', '.join(FORMS)}"
        assert not self.pair or self.form != "lanes", "only float4 accumulators pair into float8s"
        assert self.width in VECTOR_TEXELS, f"{self.width} float4s a vector: choose one of {VECTOR_TEXELS}"

    @staticmethod
    def declared(block: Block, kind: str, form: str, pair: int, lanes: int, width: int = 2) -> Accumulators:
        """The accumulators of `lanes` outputs, declared all zero in `block` (paired: `width` float4s a vector)."""
        if form == "lanes":
            return Accumulators(block.array(kind, FLOAT, lanes, [const(0.0, FLOAT)] * lanes), form, pair)
        count = float4_count(form, lanes)
        assert not pair or count % (width * pair) == 0, f"{count} float4s do not group by {width} at stride {pair}"
        dtype, length = (FLOAT.vector(LANES * width), count // width) if pair else (FLOAT4, count)
        zero = Vector(dtype, (const(0.0, FLOAT),))
        return Accumulators(block.array(kind, dtype, length, [zero] * length), form, pair, width)

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

    def _vector(self, texel: int) -> tuple[Element, int]:
        """(the float8 or float16 that holds float4 `texel`, its part: 0 low .. width - 1)."""
        pair, width = self.pair, self.width
        return Element(self.array, const(texel // (width * pair) * pair + texel % pair)), texel // pair % width

    def _float4(self, texel: int, component: int | None = None) -> Expr:
        """Float4 accumulator `texel`, or its `component`."""
        if not self.pair:
            whole = Element(self.array, const(texel))
            return whole if component is None else whole.lane(component)
        vector, part = self._vector(texel)
        return Swizzle(vector, LANES * part, LANES) if component is None else vector.lane(LANES * part + component)

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
        if self.form == "lanes":
            return [(Element(self.array, const(lane)), *terms[i][1:])
                    for lane, run in _by_lane(terms).items() for i in run]
        return self._paired(self.updates(terms, offsets))

    def updates(self, terms: Sequence[tuple[int, Expr, Expr]], offsets: Sequence[tuple[int, int]] = ()
                ) -> list[Update]:
        """The float4 forms' updates of the products before any grouping (what `_paired` groups, at any stride)."""
        by_lane = _by_lane(terms)
        return self._sums(terms, offsets, by_lane) if self.form == "sums" else self._texels(terms, by_lane)

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
        """The updates' multiply-adds. Paired, a low part's whole update and, of each higher part of its
        vector, the first unmatched whole update by the same w or the same x as it are one float8 (float16)
        multiply-add, at the low part's place in the order, where every part has one; every other update adds
        into its float4 or its component at its own place."""
        def part(u: Update) -> int | None:
            return u.texel // self.pair % self.width if self.pair and u.component is None else None

        higher: dict[int, list[tuple[int, Update]]] = {}  # a higher part's whole updates, with their positions
        for position, u in enumerate(updates):
            if part(u):
                higher.setdefault(u.texel, []).append((position, u))
        vectors: dict[int, Operation] = {}  # by the position of the low part's update
        absorbed: set[int] = set()  # the positions of the higher parts' updates that joined one
        for position, u in enumerate(updates):
            if part(u) != 0:
                continue
            partners = [higher.get(u.texel + k * self.pair, []) for k in range(1, self.width)]
            matches = [next((k for k, (_, other) in enumerate(partner) if other.w == u.w or other.x == u.x), None)
                       for partner in partners]
            if None in matches:
                continue
            others = [partner.pop(match) for partner, match in zip(partners, matches)]  # type: ignore[call-overload]
            absorbed.update(high_position for high_position, _ in others)
            group = [u] + [other for _, other in others]
            vectors[position] = (self._vector(u.texel)[0], vector_of([g.x for g in group]),
                                 vector_of([g.w for g in group]))
        return [vectors.get(position, (self._float4(u.texel, u.component), u.x, u.w))
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


def _by_lane(terms: Sequence[tuple[int, Expr, Expr]]) -> dict[int, list[int]]:
    """Each lane's products (their indices) in their order, lanes in order."""
    by_lane: dict[int, list[int]] = {}
    for index in sorted(range(len(terms)), key=lambda index: terms[index][0]):
        by_lane.setdefault(terms[index][0], []).append(index)
    return by_lane


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


def pair_stride(products: Sequence[tuple[int, int, int]], form: str, lanes: int, simd_floats: int,
                width: int = 2) -> int:
    """The stride that groups float4 accumulators `width` by `width` into float8s (float16s) at least cost
    (`cost` of one block of (lane, x offset, w offset) `products`), or 0: no grouping is cheaper, the form
    has no float4s, or a SIMD register holds fewer than `width` float4s (PAIRED_SIMD_FLOATS at least)."""
    if form == "lanes" or simd_floats < max(PAIRED_SIMD_FLOATS, LANES * width):
        return 0
    block = tuple(products)
    costs = {stride: _stand_in_cost(block, form, stride, width)[0]
             for stride in pairings(float4_count(form, lanes), width)}
    return min(costs, key=lambda stride: (costs[stride], stride))


def vector_texels(products: Sequence[tuple[int, int, int]], form: str, lanes: int, simd_floats: int,
                  widest: int) -> tuple[int, int]:
    """(float4s per accumulator vector, their stride: pair_stride) of the VECTOR_TEXELS up to `widest` that
    costs least (`cost`; of equals the wider: a float16 multiply-add is one AVX-512 instruction); (2, 0) where
    grouping costs more than none."""
    options = [(width, pair_stride(products, form, lanes, simd_floats, width))
               for width in VECTOR_TEXELS if width <= widest]
    grouped = [(instructions, -width, stride) for width, stride in options if stride
               for instructions, gathers in [_stand_in_cost(tuple(products), form, stride, width)]
               if width == 2 or not gathers]
    if not grouped:
        return 2, 0
    _, negative, stride = min(grouped)
    return -negative, stride


def _gathers(operations: Sequence[Operation]) -> bool:
    """Whether a wider-than-float4 operand has a part gathered from lanes of several texels (B read along K):
    PoCL's float16 of four gathered float4s took more shuffles than its multiply-adds saved (a GPT-2
    MatMul that reads its B along K, k46: 0.51 -> 0.59 ms), which `cost` does not see."""
    return any(isinstance(part, Vector) and len(part.parts) > 1 for _, x, w in operations for operand in (x, w)
               if isinstance(operand, Vector) and operand.dtype.lanes > LANES for part in operand.parts)


def pairings(count: int, width: int = 2) -> tuple[int, ...]:
    """Strides that group `count` float4 accumulators `width` by `width` (0: no grouping)."""
    return (0,) + tuple(s for s in range(1, count // width + 1) if count % (width * s) == 0)


# a model's kernels judge the same blocks again and again (every conv of a tile shape; the cost of stride 0 is
# block_cost's, the chosen stride's vector_texels'), and every stride groups the same updates: T-ResNet's MemFLoRA
# step for `local` compiled in 10.9 CPU s, most of it building these stand-ins
@functools.lru_cache(maxsize=1024)
def _stand_in_cost(products: tuple[tuple[int, int, int], ...], form: str, pair: int, width: int) -> tuple[int, bool]:
    """(`cost`, `_gathers`) of the stand-in operations of a block of `products` (_stand_in_operations)."""
    operations = _stand_in_operations(products, form, pair, width)
    return cost(operations), _gathers(operations)


def _stand_in_operations(products: Sequence[tuple[int, int, int]], form: str, pair: int = 0,
                         width: int = 2) -> list[Operation]:
    """The operations of a block of (lane, x offset, w offset) `products` in `form` (grouped `width` by `width`
    at `pair`), each element a stand-in read from texel-aligned bases (what the costs compare)."""
    accumulators = Accumulators(Var("a", 0, FLOAT4), form, pair, width)
    if form == "lanes":
        return accumulators.operations(*_stand_in_terms(tuple(products)))
    return accumulators._paired(list(_stand_in_updates(tuple(products), form)))


@functools.lru_cache(maxsize=256)
def _stand_in_terms(products: tuple[tuple[int, int, int], ...]
                    ) -> tuple[tuple[tuple[int, Expr, Expr], ...], tuple[tuple[int, int], ...]]:
    """(the (lane, x, w) terms, their (x, w) offsets) of `products`, each element a lane of the texel holding it."""
    def element(tensor: str, offset: int) -> Expr:
        return Var(tensor, offset >> 2, FLOAT4).lane(offset & 3)

    terms = tuple((lane, element("X", x), element("W", w)) for lane, x, w in products)
    return terms, tuple((x, w) for _, x, w in products)


@functools.lru_cache(maxsize=256)
def _stand_in_updates(products: tuple[tuple[int, int, int], ...], form: str) -> tuple[Update, ...]:
    """The updates of the stand-in terms of `products` in float4 `form`, before grouping (Accumulators.updates)."""
    return tuple(Accumulators(Var("a", 0, FLOAT4), form).updates(*_stand_in_terms(products)))


def block_cost(products: Sequence[tuple[int, int, int]], form: str) -> float:
    """Instructions per product of a block of (lane, x offset, w offset) `products` summed in `form` (its
    `cost`, and a load per distinct texel of X and of W, read from texel-aligned bases): what tiles of
    different shapes compare by."""
    loads = len({x >> 2 for _, x, _ in products}) + len({w >> 2 for _, _, w in products})
    return (_stand_in_cost(tuple(products), form, 0, 2)[0] + loads) / max(1, len(products))


def choose_form(products: Sequence[tuple[int, int, int]], lanes: int, long: bool, cpu: bool,
                simd_floats: int = 1, widest: int = 2) -> str:
    """The form for `lanes` outputs whose block of (lane, x offset, w offset) `products` belongs to a
    reduction longer than SERIAL_REDUCTION (`long`) or not, on a CPU or not, whose SIMD register holds
    `simd_floats` floats, whose float4 accumulators may group up to `widest` to a vector; see the module
    docstring. The sums form counts in registers: where its float4s group four to a float16 (vector_texels:
    whole texels of both operands, as a contraction that reads B along K has), a register holds four."""
    if lanes % LANES or not (long or simd_floats >= PAIRED_SIMD_FLOATS):
        return "lanes"
    if not cpu or lanes > sum_float4s(simd_floats, widest):
        return "texels"
    if lanes > sum_float4s(simd_floats) and vector_texels(products, "sums", lanes, simd_floats, widest)[0] < widest:
        return "texels"
    return min(("texels", "sums"), key=lambda form: block_cost(products, form))


def sum_float4s(simd_floats: int, width: int = 2) -> int:
    """The most float4 partial sums (the "sums" form) a CPU work-item keeps whose SIMD register holds
    `simd_floats` floats: two to a register where they pair into float8s (pair_stride), `width` where they
    group `width` to a vector (VECTOR_TEXELS; the register holds that many float4s). The registers the sums
    take stay PAIRED_SUM_FLOAT4S / 2 whatever the width: ViT's forward contractions (B read along K) in 64
    sums grouped into 16 float16s ran 1.7-2.1x faster than in texels with their swizzles (PoCL, AVX-512)."""
    if simd_floats < PAIRED_SIMD_FLOATS:
        return SIMD_SUM_FLOAT4S
    return PAIRED_SUM_FLOAT4S * min(width, simd_floats // LANES) // 2


def float4_count(form: str, lanes: int) -> int:
    """The float4 accumulators of `lanes` outputs in `form` (texels: 4 outputs each; sums: one each)."""
    return lanes // LANES if form == "texels" else lanes


def vector_of(parts: Sequence[Expr]) -> Expr:
    """Float4s or scalars as the parts of a float8 (two) or float16 (four): a scalar that is every part as
    itself (OpenCL widens it), else each part a float4 (a scalar widened)."""
    if len(set(parts)) == 1 and parts[0].dtype.lanes == 1:
        return parts[0]
    return Vector(FLOAT.vector(LANES * len(parts)),
                  tuple(part if part.dtype.lanes == LANES else Vector(FLOAT4, (part,)) for part in parts))


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
