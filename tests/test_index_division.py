"""Index arithmetic without integer division: kernels divide by a literal through a shift or a
multiply by its reciprocal (fblc.texel_layout.div_index / mod_index, which the codegen and the
layouts' coordinates use: a flat image's TexelLayout.c_coord, R-Tile's RTILE_ functions, c_definition).

Golden: `reciprocal` is exact for every 31-bit dividend of sampled divisors (Granlund and
Montgomery's bound, checked in Python integers). Numeric: the C of div_index, mod_index, a flat
layout of width 1000 and R-Tile layouts, run on the local OpenCL device over dividends up to 2^31 - 1, equals numpy's floor
division and TexelLayout.coords. Negative: no division or remainder operator is left in the C.
"""

from __future__ import annotations

import numpy as np
import pytest

from fblc.codegen.render.preamble import PREAMBLE
from fblc.texel_layout import TexelLayout, div_index, mod_index, reciprocal

DIVISORS = [3, 5, 6, 7, 9, 36, 96, 160, 960, 1000, 2304, 12544, 65535, 65537, 999_999_937, 2**31 - 1]
EDGE_DIVIDENDS = [0, 1, 2**31 - 1, 2**31 - 2, 2**30, 2**30 - 1]


def _dividends(divisor: int, rng: np.random.Generator) -> list[int]:
    near = [q * divisor + r for q in ((2**31 - 1) // divisor, (2**31 - 1) // divisor - 1, 1) for r in (-1, 0, 1)]
    return [x for x in EDGE_DIVIDENDS + near + rng.integers(0, 2**31, 64).tolist() if 0 <= x < 2**31]


@pytest.mark.parametrize("divisor", DIVISORS)
def test_the_reciprocal_is_exact_for_31_bit_dividends(divisor: int) -> None:
    multiplier, shift = reciprocal(divisor)
    assert 0 < multiplier < 2**32
    for x in _dividends(divisor, np.random.default_rng(divisor)):
        assert (x * multiplier) >> (32 + shift) == x // divisor, (divisor, x)


def test_no_division_operator_is_left_in_the_index_code() -> None:
    for divisor in DIVISORS + [4, 64]:
        for code in (div_index("x", divisor), mod_index("x", divisor)):
            assert "/" not in code and "%" not in code, code
    layout = TexelLayout("rtile", 24, 16, rows=48, cols=36, tile_h=3, tile_w=12, packing="block",
                         arrangement="columns", tiles_per_row=3)
    assert "/" not in layout.c_definition() and "%" not in layout.c_definition()
    flat = TexelLayout("flat", 1000, 30).c_coord("t")
    assert "/" not in flat and "%" not in flat


RTILE_LAYOUTS = [
    TexelLayout("rtile", 24, 16, rows=48, cols=36, tile_h=3, tile_w=12, packing="block", arrangement="columns",
                tiles_per_row=3),
    TexelLayout("rtile", 60, 4, rows=10, cols=40, tile_h=5, tile_w=8, packing="strip", arrangement="rows",
                tiles_per_row=6),
]


def test_division_code_on_the_device_equals_numpy_and_the_layout_reference() -> None:
    cl = pytest.importorskip("pyopencl")
    from fblc.runtime.opencl import select_device

    device = select_device()
    context = cl.Context([device])
    queue = cl.CommandQueue(context)
    rng = np.random.default_rng(0)
    bodies, expected = [], []
    for k, divisor in enumerate(DIVISORS[:-1]):  # int literals: up to 2^31 - 2
        bodies.append(f"out[{2 * k} * n + i] = {div_index('x', divisor)};")
        bodies.append(f"out[{2 * k + 1} * n + i] = {mod_index('x', divisor)};")
    count = 2 * len(DIVISORS[:-1])
    flat = TexelLayout("flat", 1000, 3_000_000)
    bodies.append(f"{{ const int2 c = {flat.c_coord('x')}; out[{count} * n + i] = c.x; out[{count + 1} * n + i] = c.y; }}")
    count += 2
    for layout in RTILE_LAYOUTS:
        bodies.append(f"{{ const int2 c = {layout.c_coord(f'x % {layout.rows * layout.cols // 4}')}; "
                      f"out[{count} * n + i] = c.x; out[{count + 1} * n + i] = c.y; }}")
        count += 2
    source = PREAMBLE + "".join(layout.c_definition() + "\n" for layout in RTILE_LAYOUTS) + (
        "__kernel void divide(__global const int *xs, __global int *out, const int n) {\n"
        "  const int i = get_global_id(0); if (i >= n) return; const int x = xs[i];\n  "
        + "\n  ".join(bodies) + "\n}\n")
    xs = np.array(sorted({x for d in DIVISORS for x in _dividends(d, rng)}), dtype=np.int32)
    program = cl.Program(context, source).build()
    xs_buffer = cl.Buffer(context, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR, hostbuf=xs)
    out = np.zeros((count, xs.size), dtype=np.int32)
    out_buffer = cl.Buffer(context, cl.mem_flags.WRITE_ONLY, out.nbytes)
    program.divide(queue, (xs.size,), None, xs_buffer, out_buffer, np.int32(xs.size))
    cl.enqueue_copy(queue, out, out_buffer)
    wide = xs.astype(np.int64)
    for k, divisor in enumerate(DIVISORS[:-1]):
        expected += [wide // divisor, wide % divisor]
    expected += [wide % 1000, wide // 1000]
    for layout in RTILE_LAYOUTS:
        expected += list(layout.coords(wide % (layout.rows * layout.cols // 4)))
    for row, (got, want) in enumerate(zip(out, expected)):
        assert np.array_equal(got, want), f"row {row}: first difference at x = {xs[np.argmax(got != want)]}"
