"""Accumulators: a reduction's products as IR statements in each form (checked as IR nodes), and the cost
that picks a form.

The multiply-adds of the lanes, texels and sums forms (and a texel whose lanes do not all have a k-th
product), paired float8s and the totals; choose_form on a weight gradient's block and a GEMM's. The
kernels that use texels and sums (a work-group's shared tile) are checked against onnxruntime in
test_kernels_contraction (the "shared" cases) and under oclgrind ("shared tiles")."""

import pytest

from fblc.codegen import ir
from fblc.codegen.kernels.accumulators import Accumulators, choose_form, cost, pair_stride, vector_texels


def named(name: str, dtype: ir.DType = ir.FLOAT4) -> ir.Var:
    return ir.Var(name, 0, dtype, name)


def lane(name: str, component: str) -> ir.Expr:
    return named(name).lane("xyzw".index(component))


def scalar(name: str) -> ir.Var:
    return named(name, ir.FLOAT)


def float4(*parts: ir.Expr) -> ir.Vector:
    return ir.Vector(ir.FLOAT4, parts)


def mad(target: ir.Expr, x: ir.Expr, w: ir.Expr) -> ir.Assign:
    """`target += x * w`."""
    return ir.Assign(target, x * w, "+=")  # type: ignore[arg-type]


def at(accumulators: Accumulators, index: int) -> ir.Element:
    return ir.Element(accumulators.array, ir.const(index))


def accumulators(form: str = "lanes", pair: int = 0) -> Accumulators:
    dtype = ir.FLOAT if form == "lanes" else ir.FLOAT8 if pair else ir.FLOAT4
    return Accumulators(named("acc" if form == "lanes" else "accv1", dtype), form, pair)


def totals(accumulators: Accumulators, lanes: int) -> tuple[ir.Expr, ...]:
    """The initial values of the `float acc[lanes]` array of totals (declared into a block of its own)."""
    block = ir.Block(ir.Numbering())
    array = accumulators.totals(block, lanes)
    assert block.statements == [ir.DeclareArray(array, lanes, block.statements[0].init)] and array.dtype == ir.FLOAT
    return block.statements[0].init


def sum_of(float4_value: ir.Expr) -> ir.Expr:
    """A sums accumulator's total: its components added pairwise."""
    return ((float4_value.lane(0) + float4_value.lane(1)) + (float4_value.lane(2) + float4_value.lane(3)))


# lane, x, w: a GEMM tile's row (one x times a texel of w), then a conv's window across two texels
TERMS = [(0, lane("A", "x"), lane("B", "x")), (1, lane("A", "x"), lane("B", "y")), (2, lane("A", "x"), lane("B", "z")),
         (3, lane("A", "x"), lane("B", "w")), (4, lane("C", "y"), lane("D", "x")), (5, lane("C", "z"), lane("D", "x")),
         (6, lane("C", "w"), lane("D", "x")), (7, lane("E", "x"), lane("D", "x"))]


def test_per_lane_multiply_adds_keep_each_lanes_order_lane_by_lane() -> None:
    terms = [(1, scalar("a1"), scalar("w1")), (0, scalar("a0"), scalar("w0")), (1, scalar("b1"), scalar("v1")),
             (0, scalar("b0"), scalar("v0"))]
    acc = accumulators()
    assert acc.add(terms) == [mad(at(acc, 0), scalar("a0"), scalar("w0")), mad(at(acc, 0), scalar("b0"), scalar("v0")),
                              mad(at(acc, 1), scalar("a1"), scalar("w1")), mad(at(acc, 1), scalar("b1"), scalar("v1"))]
    block = ir.Block(ir.Numbering())
    assert acc.totals(block, 2) is acc.array and not block.statements  # the lanes are their own totals


def test_four_lanes_products_are_one_float4_multiply_add() -> None:
    acc = accumulators("texels")
    assert acc.add(TERMS) == [
        mad(at(acc, 0), lane("A", "x"), named("B")),  # one scalar widens; a texel's own x, y, z, w is the texel
        mad(at(acc, 1), float4(ir.Swizzle(named("C"), 1, 3), lane("E", "x")), lane("D", "x"))]  # runs swizzle


def test_a_texel_whose_lanes_lack_a_product_adds_by_component() -> None:
    """Lane 3 has no second product (a masked tap dropped at compile time): the texel's second products
    are added component by component, masked expressions stay whole, and every lane keeps its order."""
    m = named("m", ir.INT)
    masked = [ir.select(m, lane("X", "xyzw"[k]), ir.const(0.0, ir.FLOAT)) for k in range(4)]
    terms = [(k, masked[k], lane("W", "x")) for k in range(4)]
    terms += [(k, lane("Y", "xyzw"[k]), lane("V", "y")) for k in range(3)]
    acc = accumulators("texels")
    assert acc.add(terms) == [mad(at(acc, 0), float4(*masked), lane("W", "x"))] + [
        mad(at(acc, 0).lane(k), lane("Y", "xyzw"[k]), lane("V", "y")) for k in range(3)]


def test_sums_add_four_steps_of_a_diagonal_as_one_float4_and_the_rest_by_component() -> None:
    """Lane 0 reads x at w + 1 for w = 0..5: w 0..3 are one texel of W times a window of X; w 4 and 5 do
    not fill a texel and add into components x and y. Lane 1's products come out of order and sort."""
    terms = [(0, scalar(f"X{w + 1}"), scalar(f"W{w}")) for w in range(6)]
    terms += [(1, scalar(f"Y{w}"), scalar(f"V{w}")) for w in (3, 1, 2, 0)]
    offsets = [(w + 1, w) for w in range(6)] + [(w, w) for w in (3, 1, 2, 0)]

    def run(name: str, first: int) -> ir.Vector:
        return float4(*(scalar(f"{name}{k}") for k in range(first, first + 4)))

    acc = accumulators("sums")
    assert acc.add(terms, offsets) == [
        mad(at(acc, 0), run("X", 1), run("W", 0)), mad(at(acc, 0).lane(0), scalar("X5"), scalar("W4")),
        mad(at(acc, 0).lane(1), scalar("X6"), scalar("W5")), mad(at(acc, 1), run("Y", 0), run("V", 0))]
    assert totals(acc, 1) == (sum_of(at(acc, 0)),)


def test_cost_counts_the_operands_shuffles_build() -> None:
    """A scalar (widened from memory) and a whole texel cost nothing; a float4 built from components, a
    float8 built of two texels' halves... each distinct one costs one, shared ones once."""
    built = ir.vector(ir.FLOAT4, lane("A", "x"), lane("A", "y"), lane("B", "x"), lane("B", "y"))
    whole8 = ir.Vector(ir.FLOAT8, (named("A"), named("B")))
    assert cost([(named("acc"), lane("A", "x"), named("B"))]) == 1
    assert cost([(named("acc"), built, named("B")), (named("acc"), built, lane("A", "x"))]) == 3
    assert cost([(named("acc"), whole8, scalar("w"))]) == 1
    assert cost([(named("acc"), ir.Vector(ir.FLOAT8, (named("A"), built)), scalar("w"))]) == 3


def _weight_gradient_block(taps: int, rows: int = 4, steps: int = 16) -> list[tuple[int, int, int]]:
    """(lane, x, w) of a 1-D weight gradient's block: lane = row * taps + tap sums X[t + tap - 1] * dY[row, t]."""
    return [(row * taps + tap, step + tap - 1, row * 64 + step)
            for step in range(steps) for row in range(rows) for tap in range(taps)]


@pytest.mark.parametrize("taps, expected", [(3, "sums"), (5, "sums"), (4, "texels")])
def test_a_shared_weight_gradient_sums_along_its_reduction_where_its_taps_mix_rows_in_texels(taps: int, expected: str
                                                                                          ) -> None:
    """3 or 5 taps: a texel of outputs holds taps of two rows, so texels need a gathered dY and a window of X
    per multiply-add, while sums read whole dY texels and share each X window across the rows. 4 taps fill
    a texel with one row's: texels broadcast dY and keep a quarter of the registers."""
    assert choose_form(_weight_gradient_block(taps), 4 * taps, long=True, cpu=True) == expected


def test_sums_are_only_for_long_reductions_on_a_cpu_within_the_register_budget() -> None:
    block = _weight_gradient_block(3)
    assert choose_form(block, 12, long=True, cpu=False) == "texels"  # a GPU: swizzles are free
    assert choose_form(block, 12, long=False, cpu=True) == "lanes"  # one work-item's short reduction
    assert choose_form(_weight_gradient_block(7), 28, long=True, cpu=True) == "texels"  # 28 float4s
    gemm = [(lane, k, k * 8 + lane) for k in range(16) for lane in range(8)]  # x broadcast, w a texel row
    assert choose_form(gemm, 8, long=True, cpu=True) == "texels"
    # a 4 x 16 tile that reads B along K (x = A[row, k], w = B[column, k]): its 64 sums exceed the 40 float4s
    # of float8 halves, but grouped four to a float16 take 16 registers, where a vector may hold four
    along_k = [(row * 16 + column, row * 64 + k, column * 64 + k) for k in range(4) for row in range(4)
               for column in range(16)]
    assert choose_form(along_k, 64, long=True, cpu=True, simd_floats=16, widest=4) == "sums"
    assert choose_form(along_k, 64, long=True, cpu=True, simd_floats=16) == "texels"  # float8s: 32 registers
    assert choose_form(along_k, 64, long=True, cpu=True, simd_floats=8, widest=4) == "texels"  # a ymm CPU


def test_a_short_reduction_takes_float4s_only_where_they_pair_into_float8s() -> None:
    block = _conv_row_block()
    assert choose_form(block, 16, long=False, cpu=True, simd_floats=8) == "texels"
    assert choose_form(block, 16, long=False, cpu=True, simd_floats=4) == "lanes"
    assert choose_form(block, 16, long=False, cpu=False) == "lanes"


def _conv_row_block(rows: int = 2, positions: int = 8, taps: int = 3) -> list[tuple[int, int, int]]:
    """(lane, x, w) of a conv tile: lane = row * positions + p sums X[p + tap] * W[row, tap] (a scalar weight)."""
    return [(row * positions + p, p + tap, row * taps + tap) for row in range(rows) for tap in range(taps)
            for p in range(positions)]


def test_two_float4s_that_share_w_are_one_float8_multiply_add() -> None:
    """Pair stride 1: texels 0 and 1 are float8 0's halves. Their updates by W.x are one float8 multiply-add
    (a scalar w stays one); texel 0's update by W.y has no partner and adds into its half; a component
    update adds into its float8 component."""
    terms = [(k, lane(f"X{k // 4}", "xyzw"[k % 4]), lane("W", "x")) for k in range(8)]
    terms += [(k, lane("Y", "xyzw"[k]), lane("W", "y")) for k in range(4)] + [(5, lane("Z", "x"), lane("W", "z"))]
    block = ir.Block(ir.Numbering())
    declared = Accumulators.declared(block, "accv", "texels", 1, 8)
    zero8 = ir.Vector(ir.FLOAT8, (ir.const(0.0, ir.FLOAT),))
    assert block.statements == [ir.DeclareArray(declared.array, 1, (zero8,))] and declared.array.dtype == ir.FLOAT8
    paired = accumulators("texels", pair=1)
    assert paired.add(terms) == [mad(at(paired, 0), ir.Vector(ir.FLOAT8, (named("X0"), named("X1"))), lane("W", "x")),
                                 mad(ir.Swizzle(at(paired, 0), 0, 4), named("Y"), lane("W", "y")),
                                 mad(at(paired, 0).lane(5), lane("Z", "x"), lane("W", "z"))]
    assert totals(declared, 8) == tuple(at(declared, 0).lane(k) for k in range(8))


def test_paired_sums_widen_a_shared_w_texel_and_keep_their_float4_totals() -> None:
    terms = [(k, scalar(f"X{k}{w}"), scalar(f"W{w}")) for k in range(2) for w in range(4)]
    offsets = [(w + k, w) for k in range(2) for w in range(4)]
    paired = accumulators("sums", pair=1)
    xs = [float4(*(scalar(f"X{k}{w}") for w in range(4))) for k in range(2)]
    ws = float4(*(scalar(f"W{w}") for w in range(4)))
    assert paired.add(terms, offsets) == [mad(at(paired, 0), ir.Vector(ir.FLOAT8, tuple(xs)),
                                              ir.Vector(ir.FLOAT8, (ws, ws)))]
    assert totals(paired, 2) == tuple(sum_of(ir.Swizzle(at(paired, 0), 4 * half, 4)) for half in range(2))


def test_pair_stride_pairs_neighbouring_texels_of_a_conv_row_on_a_wide_simd_only() -> None:
    """A conv tile of 2 rows x 2 texels: a row's two texels share each weight (stride 1 halves the
    multiply-adds); a GEMM row's two texels share A's scalar. Below 8 floats a register, or in scalar
    lanes, no pairs; nor where no two texels share an operand."""
    block = _conv_row_block()
    assert pair_stride(block, "texels", 16, simd_floats=8) == 1
    assert pair_stride(block, "texels", 16, simd_floats=4) == 0
    assert pair_stride(block, "lanes", 16, simd_floats=16) == 0
    gemm_row = [(lane, k, k * 8 + lane) for k in range(4) for lane in range(8)]  # x broadcast, w a texel row
    assert pair_stride(gemm_row, "texels", 8, simd_floats=8) == 1
    diagonal = [(lane, 4 * (lane // 4) + k, 4 * (lane // 4) + k) for k in range(4) for lane in range(8)]
    assert pair_stride(diagonal, "texels", 8, simd_floats=8) == 0


def test_a_gemm_rows_four_texels_are_one_float16_where_a_register_holds_16_floats() -> None:
    """A GEMM tile row of 4 texels shares A's scalar: grouped by four at stride 1 (one float16 multiply-add,
    one AVX-512 instruction) where a register holds 16 floats and the reduction allows four (a contraction's);
    float8s below that. B read along K (a float4 of w gathers lanes of four texels) keeps float8s or none."""
    row = [(lane, k, k * 16 + lane) for k in range(4) for lane in range(16)]  # x broadcast, w 4 texels
    assert vector_texels(row, "texels", 16, simd_floats=16, widest=4) == (4, 1)
    assert vector_texels(row, "texels", 16, simd_floats=8, widest=4) == (2, 1)
    assert vector_texels(row, "texels", 16, simd_floats=16, widest=2) == (2, 1)
    gathered = [(lane, k, lane * 4 + k) for k in range(4) for lane in range(16)]
    assert vector_texels(gathered, "texels", 16, simd_floats=16, widest=4)[0] == 2
    quads = Accumulators(ir.Var("accv", 0, ir.FLOAT.vector(16), "accv"), "texels", 1, 4)
    terms = [(k, scalar("A"), lane(f"B{k // 4}", "xyzw"[k % 4])) for k in range(16)]
    whole = ir.Vector(ir.FLOAT.vector(16), tuple(named(f"B{t}") for t in range(4)))
    assert quads.add(terms) == [mad(at(quads, 0), scalar("A"), whole)]
    assert totals(quads, 16) == tuple(at(quads, 0).lane(k) for k in range(16))
