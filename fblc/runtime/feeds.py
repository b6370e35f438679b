"""Checks of a step's feeds against the manifest that both the CLI's data file and LocalRunner.step make.

An id outside the table it indexes is not an error on the device: the gather kernels clamp it
into the table, so training would silently read the wrong row (onnxruntime refuses it).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np


def first_index(mask: np.ndarray) -> list[int]:
    """The coordinates of the first True of `mask` (row-major)."""
    return [int(i) for i in np.unravel_index(int(np.argmax(mask)), mask.shape)]


def index_problem(entry: Mapping[str, Any], array: np.ndarray) -> str | None:
    """The first id of `array` outside the table that the manifest input `entry` indexes (its "indexes",
    recorded by the index_ranges pass), as "array 'NAME' has ...; give ids in ..."; None when all fit."""
    table = entry.get("indexes")
    array = np.asarray(array)
    if table is None or array.dtype.kind not in "iubf":  # floats: ids a Python caller did not cast
        return None
    size = table["size"]
    outside = (array < -size) | (array >= size)  # a negative id counts from the end, as in ONNX
    if not outside.any():
        return None
    where = first_index(outside)
    value = array[tuple(where)].item()
    value = int(value) if float(value).is_integer() else value
    entries = f"{size} rows" if table["axis"] == 0 else f"{size} entries along axis {table['axis']}"
    side = "past" if value >= size else "before the start of"
    return (f"array '{entry['name']}' has {value} at index {where}: {side} the table '{table['table']}' of {entries} "
            f"that node '{table['node']}' indexes; give ids in [0, {size}) (or -{size} to -1, counting from the end)")
