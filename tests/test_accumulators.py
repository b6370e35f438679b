"""Accumulators: a reduction's products as C lines in each form, and the cost that picks a form.

Golden lines for the lanes, texels and sums forms (and a texel whose lanes do not all have a k-th
product); choose_form on a weight gradient's block and a GEMM's. The kernels that use texels and sums
(a work-group's shared tile) are checked against onnxruntime in test_kernels_contraction (the
"shared" cases) and under oclgrind ("shared tiles")."""

import pytest

from fblc.codegen.kernels.accumulators import Accumulators, choose_form

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
