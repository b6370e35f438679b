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
    """The first id of `array` outside a table that the manifest input `entry` indexes (its "indexes",
    recorded by the index_ranges pass), as "array 'NAME' has ...; give ids in ..."; None when all fit."""
    array = np.asarray(array)
    if array.dtype.kind not in "iubf":  # floats: ids a Python caller did not cast
        return None
    for bound in entry.get("indexes") or []:
        position = bound.get("position")
        ids = array if position is None else array[..., position]
        size = bound["size"]
        outside = (ids < -size) | (ids >= size)  # a negative id counts from the end, as in ONNX
        if not outside.any():
            continue
        where = first_index(outside) + ([] if position is None else [position])
        value = array[tuple(where)].item()
        value = int(value) if float(value).is_integer() else value
        entries = f"{size} rows" if bound["axis"] == 0 else f"{size} entries along axis {bound['axis']}"
        side = "past" if value >= size else "before the start of"
        tuple_entry = "" if position is None else f" with entry {position} of each index tuple"
        return (f"array '{entry['name']}' has {value} at index {where}: {side} the table '{bound['table']}' of "
                f"{entries} that node '{bound['node']}' indexes{tuple_entry}; give ids in [0, {size}) (or -{size} "
                "to -1, counting from the end)")
    return None



def kind_problem(manifest: Mapping[str, Any], bundle: str, forward: bool) -> str | None:
    """Why `bundle` cannot run as asked: a training bundle given to inference (`forward`), or a forward bundle
    (--trainer none) given to training; None when it can."""
    is_forward = manifest.get("step") == "forward"  # fblc.bundle_format.FORWARD_STEP
    if forward and not is_forward:
        return (f"'{bundle}' is a training bundle: its step computes a loss and updates parameters, and takes "
                "labels; compile the model with --trainer none for a forward bundle to run with --infer")
    if not forward and is_forward:
        return (f"'{bundle}' is a forward bundle (--trainer none): it computes the model's outputs and trains "
                "nothing; run it with --infer (LocalRunner.infer), or compile a training step")
    return None


def extra_feeds_problem(manifest: Mapping[str, Any], bundle: str, feeds: Mapping[str, Any]) -> str | None:
    """Inference feeds the forward bundle does not read, named (a step's missing ones are check_feeds'); None
    when there are none. A stray array is refused, not dropped: it is likely a misnamed input."""
    names = [entry["name"] for entry in manifest["inputs"]]
    extra = sorted(set(feeds) - set(names))
    if not extra:
        return None
    return (f"{', '.join(repr(name) for name in extra)} {'is' if len(extra) == 1 else 'are'} not an input of the "
            f"forward bundle '{bundle}', which reads {', '.join(repr(name) for name in names)}")
