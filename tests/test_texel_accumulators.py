"""Accumulators.add: a reduction's products as C lines, per lane or four lanes a float4 multiply-add.

Golden lines for both forms and for a texel whose lanes do not all have a k-th product; the kernels
that use texel accumulators (a work-group's shared tile) are checked against onnxruntime in
test_kernels_contraction (the "shared" cases) and under oclgrind ("shared tiles")."""

from fblc.codegen.kernels.texel import Accumulators

# lane, x, w: a GEMM tile's row (one x times a texel of w), then a conv's window across two texels
TERMS = [(0, "A.x", "B.x"), (1, "A.x", "B.y"), (2, "A.x", "B.z"), (3, "A.x", "B.w"),
         (4, "C.y", "D.x"), (5, "C.z", "D.x"), (6, "C.w", "D.x"), (7, "E.x", "D.x")]


def test_per_lane_lines_keep_each_lanes_order_lane_by_lane() -> None:
    terms = [(1, "a1", "w1"), (0, "a0", "w0"), (1, "b1", "v1"), (0, "b0", "v0")]
    assert Accumulators("acc").add(terms) == ["acc[0] += a0 * w0;", "acc[0] += b0 * v0;",
                                              "acc[1] += a1 * w1;", "acc[1] += b1 * v1;"]


def test_four_lanes_products_are_one_float4_multiply_add() -> None:
    assert Accumulators("accv1", texels=True).add(TERMS) == [
        "accv1[0] += A.x * B;",  # one scalar widens; a texel's own x, y, z, w is the texel
        "accv1[1] += (float4)(C.yzw, E.x) * D.x;"]  # consecutive components as swizzles


def test_a_texel_whose_lanes_lack_a_product_adds_by_component() -> None:
    """Lane 3 has no second product (a masked tap dropped at compile time): the texel's second products
    are added component by component, masked expressions stay whole, and every lane keeps its order."""
    terms = [(lane, f"(m ? X.{'xyzw'[lane]} : 0.0f)", "W.x") for lane in range(4)]
    terms += [(lane, f"Y.{'xyzw'[lane]}", "V.y") for lane in range(3)]
    assert Accumulators("accv1", texels=True).add(terms) == [
        "accv1[0] += (float4)((m ? X.x : 0.0f), (m ? X.y : 0.0f), (m ? X.z : 0.0f), (m ? X.w : 0.0f)) * W.x;",
        "accv1[0].x += Y.x * V.y;", "accv1[0].y += Y.y * V.y;", "accv1[0].z += Y.z * V.y;"]
