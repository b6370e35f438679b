"""Accumulators: a reduction's products as C lines in each form, and the cost that picks a form.

Golden lines for the lanes, texels and sums forms (and a texel whose lanes do not all have a k-th
product); choose_form on a weight gradient's block and a GEMM's. The kernels that use texels and sums
(a work-group's shared tile) are checked against onnxruntime in test_kernels_contraction (the
"shared" cases) and under oclgrind ("shared tiles")."""

import pytest

from fblc.codegen.kernels.accumulators import Accumulators, choose_form, pair_stride

# lane, x, w: a GEMM tile's row (one x times a texel of w), then a conv's window across two texels
TERMS = [(0, "A.x", "B.x"), (1, "A.x", "B.y"), (2, "A.x", "B.z"), (3, "A.x", "B.w"),
         (4, "C.y", "D.x"), (5, "C.z", "D.x"), (6, "C.w", "D.x"), (7, "E.x", "D.x")]


def test_per_lane_lines_keep_each_lanes_order_lane_by_lane() -> None:
    terms = [(1, "a1", "w1"), (0, "a0", "w0"), (1, "b1", "v1"), (0, "b0", "v0")]
    assert Accumulators("acc").add(terms) == ["acc[0] += a0 * w0;", "acc[0] += b0 * v0;",
                                              "acc[1] += a1 * w1;", "acc[1] += b1 * v1;"]


def test_four_lanes_products_are_one_float4_multiply_add() -> None:
    assert Accumulators("accv1", "texels").add(TERMS) == [
        "accv1[0] += A.x * B;",  # one scalar widens; a texel's own x, y, z, w is the texel
        "accv1[1] += (float4)(C.yzw, E.x) * D.x;"]  # consecutive components as swizzles


def test_a_texel_whose_lanes_lack_a_product_adds_by_component() -> None:
    """Lane 3 has no second product (a masked tap dropped at compile time): the texel's second products
    are added component by component, masked expressions stay whole, and every lane keeps its order."""
    terms = [(lane, f"(m ? X.{'xyzw'[lane]} : 0.0f)", "W.x") for lane in range(4)]
    terms += [(lane, f"Y.{'xyzw'[lane]}", "V.y") for lane in range(3)]
    assert Accumulators("accv1", "texels").add(terms) == [
        "accv1[0] += (float4)((m ? X.x : 0.0f), (m ? X.y : 0.0f), (m ? X.z : 0.0f), (m ? X.w : 0.0f)) * W.x;",
        "accv1[0].x += Y.x * V.y;", "accv1[0].y += Y.y * V.y;", "accv1[0].z += Y.z * V.y;"]


def test_sums_add_four_steps_of_a_diagonal_as_one_float4_and_the_rest_by_component() -> None:
    """Lane 0 reads x at w + 1 for w = 0..5: w 0..3 are one texel of W times a window of X; w 4 and 5 do
    not fill a texel and add into components x and y. Lane 1's products come out of order and sort."""
    terms = [(0, f"X{w + 1}", f"W{w}") for w in range(6)] + [(1, f"Y{w}", f"V{w}") for w in (3, 1, 2, 0)]
    offsets = [(w + 1, w) for w in range(6)] + [(w, w) for w in (3, 1, 2, 0)]
    assert Accumulators("accv1", "sums").add(terms, offsets) == [
        "accv1[0] += (float4)(X1, X2, X3, X4) * (float4)(W0, W1, W2, W3);",
        "accv1[0].x += X5 * W4;", "accv1[0].y += X6 * W5;",
        "accv1[1] += (float4)(Y0, Y1, Y2, Y3) * (float4)(V0, V1, V2, V3);"]
    assert Accumulators("accv1", "sums").totals("acc", 1) == (
        "float acc[1] = {(accv1[0].x + accv1[0].y) + (accv1[0].z + accv1[0].w)};")


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
    terms = [(lane, f"X{lane // 4}.{'xyzw'[lane % 4]}", "W.x") for lane in range(8)]
    terms += [(lane, f"Y.{'xyzw'[lane]}", "W.y") for lane in range(4)] + [(5, "Z.x", "W.z")]
    accumulators = Accumulators("accv1", "texels", pair=1)
    assert accumulators.declare(8) == "float8 accv1[1] = {(float8)(0.0f)};"
    assert accumulators.add(terms) == ["accv1[0] += (float8)(X0, X1) * W.x;", "accv1[0].lo += Y * W.y;",
                                       "accv1[0].s5 += Z.x * W.z;"]
    assert accumulators.totals("acc", 8) == (
        "float acc[8] = {accv1[0].s0, accv1[0].s1, accv1[0].s2, accv1[0].s3, "
        "accv1[0].s4, accv1[0].s5, accv1[0].s6, accv1[0].s7};")


def test_paired_sums_widen_a_shared_w_texel_and_keep_their_float4_totals() -> None:
    terms = [(lane, f"X{lane}{w}", f"W{w}") for lane in range(2) for w in range(4)]
    offsets = [(w + lane, w) for lane in range(2) for w in range(4)]
    accumulators = Accumulators("accv1", "sums", pair=1)
    assert accumulators.add(terms, offsets) == [
        "accv1[0] += (float8)((float4)(X00, X01, X02, X03), (float4)(X10, X11, X12, X13)) * "
        "(float8)((float4)(W0, W1, W2, W3), (float4)(W0, W1, W2, W3));"]
    assert accumulators.totals("acc", 2) == (
        "float acc[2] = {(accv1[0].lo.x + accv1[0].lo.y) + (accv1[0].lo.z + accv1[0].lo.w), "
        "(accv1[0].hi.x + accv1[0].hi.y) + (accv1[0].hi.z + accv1[0].hi.w)};")


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
