"""How a reduction's products reach a work-item's accumulators: three forms, and the cost that picks one.

- "lanes": `float acc[lanes]`, a scalar multiply-add per product (PoCL's SLP vectorizer packs them).
- "texels": `float4 acc[lanes / 4]`, output lane l in component l % 4 of texel l / 4. The k-th products
  of a texel's four lanes are one float4 multiply-add, with swizzles where their operands are not one
  texel (a window of X across two texels, four lanes' different W elements).
- "sums": `float4 acc[lanes]`, one float4 per output whose components sum every fourth step of its
  reduction. Where both operands run along the reduction axis (a weight gradient's X and dY rows), four
  consecutive steps are one multiply-add of a window of X and a whole texel of dY; every output that
  reads the same window shares it. The components are added once, at the end.

Texels and sums serve the reductions longer than SERIAL_REDUCTION (the weight gradients; a GPU's
work-group deals them out, a CPU's work-item runs them alone, Profile.tile_group). Sums are for a CPU
(Profile.cpu), whose float4 is one SIMD register: there every distinct swizzle is a shuffle
instruction, and `choose_form` takes the cheaper of texels and sums by multiply-adds, distinct
swizzled operands and texel loads, within SIMD_SUM_FLOAT4S float4s. On a GPU a swizzle only names
registers and sums would take four times the registers, so texels stay.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fblc.profiles.profile import SIMD_SUM_FLOAT4S

LANES = 4
COMPONENTS = "xyzw"
FORMS = ("lanes", "texels", "sums")

Operation = tuple[str, str, str]  # (target, x operand, w operand): `target += x * w;`


@dataclass(frozen=True)
class Accumulators:
    """Where a reduction of `lanes` outputs sums, in `form` (see the module docstring)."""

    name: str
    form: str = "lanes"

    def __post_init__(self) -> None:
        assert self.form in FORMS, f"accumulator form {self.form!r} is none of {', '.join(FORMS)}"

    def declare(self, lanes: int) -> str:
        """The declaration of the accumulators of `lanes` outputs, all zero."""
        if self.form == "lanes":
            return f"float {self.name}[{lanes}] = {{{', '.join(['0.0f'] * lanes)}}};"
        count = lanes // LANES if self.form == "texels" else lanes
        return f"float4 {self.name}[{count}] = {{{', '.join(['(float4)(0.0f)'] * count)}}};"

    def totals(self, acc: str, lanes: int) -> str | None:
        """The line declaring `float acc[lanes]`, each output's total (None: the accumulators are that already)."""
        if self.form == "lanes":
            return None
        if self.form == "texels":
            values = [f"{self.name}[{lane // LANES}].{COMPONENTS[lane % LANES]}" for lane in range(lanes)]
        else:
            values = [f"({sums}.x + {sums}.y) + ({sums}.z + {sums}.w)" for sums in
                      (f"{self.name}[{lane}]" for lane in range(lanes))]
        return f"float {acc}[{lanes}] = {{{', '.join(values)}}};"

    def add(self, terms: Sequence[tuple[int, str, str]], offsets: Sequence[tuple[int, int]] = ()) -> list[str]:
        """Lines that add each (lane, x, w) product to its lane; `offsets`, (x, w) element offsets of
        each product, find the runs the sums form adds four at a time."""
        return [f"{target} += {x} * {w};" for target, x, w in self.operations(terms, offsets)]

    def operations(self, terms: Sequence[tuple[int, str, str]], offsets: Sequence[tuple[int, int]] = ()
                   ) -> list[Operation]:
        """The multiply-adds of the products, lane by lane, each lane's in their order. Interleaved updates of
        strided accumulators (a stride-2 ConvTranspose's even lanes from one texel's x, y, z, w) crash LLVM
        15's InstCombine in Debian's PoCL 3.1 (ShuffleVectorInst::isIdentityWithPadding)."""
        ordered = sorted(range(len(terms)), key=lambda index: terms[index][0])
        if self.form == "lanes":
            return [(f"{self.name}[{terms[i][0]}]", terms[i][1], terms[i][2]) for i in ordered]
        if self.form == "sums":
            return self._sums(terms, offsets, ordered)
        per_lane: dict[int, list[tuple[str, str]]] = {}
        for index in ordered:
            lane, x, w = terms[index]
            per_lane.setdefault(lane, []).append((x, w))
        operations: list[Operation] = []
        for texel in sorted({lane // LANES for lane in per_lane}):
            runs = [per_lane.get(texel * LANES + component, []) for component in range(LANES)]
            for k in range(max(len(run) for run in runs)):
                if all(k < len(run) for run in runs):
                    xs, ws = zip(*(run[k] for run in runs))
                    operations.append((f"{self.name}[{texel}]", float4_of(xs), float4_of(ws)))
                    continue
                operations += [(f"{self.name}[{texel}].{COMPONENTS[component]}", run[k][0], run[k][1])
                               for component, run in enumerate(runs) if k < len(run)]
        return operations

    def _sums(self, terms: Sequence[tuple[int, str, str]], offsets: Sequence[tuple[int, int]],
              ordered: list[int]) -> list[Operation]:
        """A lane's products along one diagonal (x - w fixed) at four consecutive w from a multiple of 4 are
        one float4 multiply-add (w a whole texel); the others add into component w % 4."""
        assert len(offsets) == len(terms), "the sums form needs each product's (x, w) offsets"
        operations: list[Operation] = []
        by_lane: dict[int, list[int]] = {}
        for index in ordered:
            by_lane.setdefault(terms[index][0], []).append(index)
        for lane, indices in by_lane.items():
            target = f"{self.name}[{lane}]"
            indices.sort(key=lambda i: (offsets[i][0] - offsets[i][1], offsets[i][1]))
            at = 0
            while at < len(indices):
                run = indices[at:at + LANES]
                x0, w0 = offsets[run[0]]
                if w0 % LANES == 0 and [offsets[i] for i in run] == [(x0 + k, w0 + k) for k in range(LANES)]:
                    operations.append((target, float4_of([terms[i][1] for i in run]),
                                       float4_of([terms[i][2] for i in run])))
                    at += LANES
                    continue
                operations.append((f"{target}.{COMPONENTS[w0 % LANES]}", terms[run[0]][1], terms[run[0]][2]))
                at += 1
        return operations


def cost(operations: Sequence[Operation]) -> int:
    """Instructions of `operations` on a SIMD float4: one per multiply-add, one per distinct operand built
    from several texels or components (a shuffle; a scalar broadcasts from memory for free)."""
    return len(operations) + len({operand for _, x, w in operations for operand in (x, w)
                                  if operand.startswith("(float4)(")})


def block_cost(products: Sequence[tuple[int, int, int]], form: str) -> float:
    """Instructions per product of a block of (lane, x offset, w offset) `products` summed in `form` (its
    `cost`, and a load per distinct texel of X and of W, read from texel-aligned bases): what tiles of
    different shapes compare by."""
    terms = [(lane, _element("X", x), _element("W", w)) for lane, x, w in products]
    loads = len({x >> 2 for _, x, _ in products}) + len({w >> 2 for _, _, w in products})
    operations = Accumulators("a", form).operations(terms, [(x, w) for _, x, w in products])
    return (cost(operations) + loads) / max(1, len(products))


def choose_form(products: Sequence[tuple[int, int, int]], lanes: int, long: bool, cpu: bool) -> str:
    """The form for `lanes` outputs whose block of (lane, x offset, w offset) `products` belongs to a
    reduction longer than SERIAL_REDUCTION (`long`) or not, on a CPU or not; see the module docstring."""
    if not long or lanes % LANES:
        return "lanes"
    if not cpu or lanes > SIMD_SUM_FLOAT4S:
        return "texels"
    return min(("texels", "sums"), key=lambda form: block_cost(products, form))


def _element(tensor: str, offset: int) -> str:
    """A stand-in C expression for element `offset` of a tensor read from a texel-aligned base."""
    return f"{tensor}{offset >> 2}".replace("-", "_") + f".{COMPONENTS[offset & 3]}"


def float4_of(values: Sequence[str]) -> str:
    """Four scalar C expressions as a float4: the scalar when all four are one (OpenCL widens it), a
    texel's name for its own x, y, z, w, swizzles for runs of one texel's consecutive components."""
    if len(set(values)) == 1:
        return values[0]
    parts: list[list[str]] = []  # [texel or expression, its components]
    for value in values:
        name, dot, component = value.rpartition(".")
        if not (dot and component in COMPONENTS and name.isidentifier()):
            parts.append([value, ""])
        elif (parts and parts[-1][0] == name and parts[-1][1]
              and COMPONENTS.find(parts[-1][1][-1]) + 1 == COMPONENTS.find(component)):
            parts[-1][1] += component
        else:
            parts.append([name, component])
    if len(parts) == 1 and parts[0][1] == COMPONENTS:
        return parts[0][0]
    return f"(float4)({', '.join(f'{name}.{components}' if components else name for name, components in parts)})"
