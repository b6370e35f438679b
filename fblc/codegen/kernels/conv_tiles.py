"""Register-tile shapes of the conv kernels (conv.py, conv_transpose.py) under R-Tile codegen (docs/ARCHITECTURE.md
§3, "Under `--layout rtile`"), within PRIVATE_FLOATS accumulators. A saved mask whose bytes such a tile splits
falls back to r_mask4 (schedule.pairs_mask_bytes): twice the mask's bits, 1/16 of the float tensor's, for 1/rows
of the input reads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from fblc.codegen.kernels.accumulators import LANES
from fblc.compiler.values import numel
from fblc.profiles.profile import PRIVATE_FLOATS

CHANNEL_ROWS = (8, 4, 2)  # output channels of a register tile, the first that fits (R-Tile codegen)
#: rows at least this long (no multiple of 4) take tiles of two texel columns on the row path: whole bytes of a
#: saved mask, more lanes sharing the weights, where most pairs lie within one row
PAIR_ROW = 16
BATCH_ROWS = (8, 4, 2)  # batch elements of a channel tile's register tile, the first that fits
SPATIAL_ROWS = (4, 3, 2)  # output rows of a 2-D spatial tile where channels cannot stack (R-Tile codegen)
STATIC_PRODUCTS = 1024  # a 2-D tile enumerates its row taps while a block keeps at most this many products


def channel_rows(tiled: bool, out_shape: Sequence[int], cg_out: int, choices: Sequence[int]
                 ) -> tuple[int, int, int, int]:
    """(rows, row_step, columns, stride): a work-item of `columns` consecutive texels of one output channel
    (the first of `choices` that fits) also computes the same positions of rows - 1 more channels of its
    group (cg_out), row_step apart: positions line up with texel columns only every 4 * columns /
    gcd(plane, 4 * columns) channels. Its rows are `stride` texels apart. (1, 1, the last choice, 1)
    where none fits, or under naive: one channel."""
    plane = numel(out_shape[2:])
    if tiled:
        for columns in choices:
            step = LANES * columns // math.gcd(plane, LANES * columns)
            stride = step * plane // LANES
            for rows in CHANNEL_ROWS:
                if cg_out % (rows * step) == 0 and rows * columns * LANES <= PRIVATE_FLOATS:
                    return rows, step, columns, stride
    return 1, 1, choices[-1], 1


def stack_rows(out_shape: Sequence[int], axis: int, lanes: int, products: int) -> tuple[int, int]:
    """(rows, stride): output rows along `axis` that a work-item of `lanes` outputs also computes, `stride`
    texels apart: the first of SPATIAL_ROWS that divides the axis with rows * `lanes` accumulators within
    PRIVATE_FLOATS and their `products` each (taps x input channels of a block) within STATIC_PRODUCTS."""
    rows = next((rows for rows in SPATIAL_ROWS if out_shape[axis] % rows == 0 and rows * lanes <= PRIVATE_FLOATS
                 and rows * lanes * products <= STATIC_PRODUCTS), 1)
    return rows, numel(out_shape[axis + 1:]) // LANES


def batch_count(tiled: bool, out_shape: Sequence[int], lanes: int) -> int:
    """Batch elements a channel tile's work-item of `lanes` outputs computes under R-Tile codegen (they share
    every weight read; the weight gradient's batch axis is the input channels, sharing the dY reads): the
    first of BATCH_ROWS within PRIVATE_FLOATS accumulators; 1 under naive."""
    fits = [batches for batches in BATCH_ROWS if out_shape[0] % batches == 0 and batches * lanes <= PRIVATE_FLOATS]
    return fits[0] if tiled and fits else 1


def texels_per_item(texels: int) -> int:
    """Texels a work-item of a spatial tile covers: the most (up to 5) that divide a row of `texels`."""
    return next(n for n in (5, 4, 3, 2, 1) if texels % n == 0)
