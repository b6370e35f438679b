"""The data file of `fblc run`: read, checked against the bundle's inputs, cut into batches.

Everything is checked before any work, on every array the run feeds: a NaN reaching the
device trains the whole run on NaN, a label past the classes reads beyond the logits (the
kernels do not bounds-check) and an id past the table it indexes reads an edge row (the
gather kernels clamp), so each would silently produce garbage, not an error. So would arrays
of different row counts (rows paired that do not belong together) and labels that are all the
ignore index (nothing to learn). Both runtimes (local and adb) read their batches from here.
"""

from __future__ import annotations

import os
import zipfile
from typing import Any, Mapping

import numpy as np

from fblc.runtime.feeds import first_index, index_problem

#: manifest dtype names (ONNX's) as numpy calls them, for the messages
NUMPY_NAMES = {"float": "float32", "double": "float64", "float16": "float16"}
#: dtype kinds a data array may have (bool, int, uint, float); the others are named in messages
NUMERIC_KINDS = "biuf"
KIND_NAMES = {"U": "strings", "S": "byte strings", "O": "Python objects", "c": "complex numbers",
              "M": "datetimes", "m": "timedeltas", "V": "structured records"}


def _error(message: str) -> Exception:
    from fblc.runtime.local import DataError

    return DataError(message)


def expected_arrays(manifest: Mapping[str, Any]) -> str:
    return ", ".join(f"{e['name']} {e['shape']} {NUMPY_NAMES.get(e['dtype'], e['dtype'])}" for e in manifest["inputs"])


def _open(path: str, manifest: Mapping[str, Any]) -> Any:
    expected = expected_arrays(manifest)
    example = ", ".join(f"{e['name']}=..." for e in manifest["inputs"])
    npz = path if path.endswith(".npz") else os.path.splitext(path)[0] + ".npz"  # numpy.savez adds .npz otherwise
    write_one = f"write one with numpy.savez('{npz}', {example}) holding arrays: {expected}"
    if not os.path.exists(path):
        raise _error(f"cannot read data file '{path}': no such file; give an .npz written by numpy.savez with "
                     f"arrays: {expected}")
    if os.path.isdir(path):
        raise _error(f"cannot read data file '{path}': it is a folder; {write_one}")
    if not zipfile.is_zipfile(path):  # np.load would try it as a pickle and say so, which misleads
        with open(path, "rb") as handle:
            single = handle.read(6) == b"\x93NUMPY"
        what = "a single .npy array, not an .npz" if single else "not an .npz (numpy.savez's zip of named arrays)"
        raise _error(f"cannot read data file '{path}': it is {what}; {write_one}")
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile) as error:
        raise _error(f"cannot read data file '{path}' ({error}); {write_one}") from None


def _read_array(archive: Any, path: str, name: str) -> np.ndarray:
    try:
        array = archive[name]
    except ValueError:  # an object array: loading it would unpickle, i.e. run code from the file
        array = None
    except (OSError, zipfile.BadZipFile) as error:
        raise _error(f"data file '{path}': array '{name}' cannot be read ({error}); write the file again with "
                     "numpy.savez") from None
    kind = "O" if array is None else array.dtype.kind
    if kind not in NUMERIC_KINDS:
        dtype = "object" if array is None else array.dtype.str
        raise _error(f"data file '{path}': array '{name}' holds {KIND_NAMES.get(kind, 'non-numbers')} (dtype "
                     f"{dtype}); fblc trains on numbers only: save it as a numeric array (floats for model inputs, "
                     "int64 class indices for labels)")
    return array


def _number(value: Any) -> str:
    if isinstance(value, (float, np.floating)) and not np.isfinite(value):
        return "NaN" if np.isnan(value) else ("inf" if value > 0 else "-inf")
    return f"{value}"


def _checked(path: str, entry: Mapping[str, Any], array: np.ndarray) -> np.ndarray:
    """`array` as the bundle's input `entry` takes it; the first bad value named by its index otherwise."""
    name = entry["name"]
    if array.dtype.kind == "f":
        bad = ~np.isfinite(array)
        if bad.any():
            where = first_index(bad)
            raise _error(f"data file '{path}': array '{name}' has {_number(array[tuple(where)])} at index {where}; "
                         "replace or drop the rows with NaN or inf (numpy.isfinite finds them)")
    if entry["dtype"].startswith("int") and array.dtype.kind == "f":  # labels saved as floats: whole ones only
        fractional = array != np.round(array)
        if fractional.any():
            where = first_index(fractional)
            raise _error(f"data file '{path}': array '{name}' has {_number(array[tuple(where)])} at index {where}, "
                         f"but the bundle takes {entry['dtype']} there (class indices); save whole numbers "
                         f"({name}.astype(numpy.int64))")
        array = array.astype(np.int64)
    classes = entry.get("classes")
    if classes is not None:
        ignored = entry.get("ignore_index")
        outside = ((array < 0) | (array >= classes)) & (array != ignored)
        if outside.any():
            where = first_index(outside)
            nor = f" nor the ignore index {ignored}" if ignored is not None else ""
            raise _error(f"data file '{path}': array '{name}' has {_number(array[tuple(where)])} at index {where}: "
                         f"not a class of the model's output (0 to {classes - 1}){nor}; give labels in [0, {classes})"
                         + (f", or {ignored} for a position that does not count" if nor else ""))
    problem = index_problem(entry, array)
    if problem is not None:
        raise _error(f"data file '{path}': {problem}")
    return array


def batches(data_path: str, manifest: Mapping[str, Any]) -> tuple[list[dict[str, np.ndarray]], str]:
    """The data file cut into batches of the compiled size, and a note on rows left out."""
    expected = expected_arrays(manifest)
    archive = _open(data_path, manifest)
    arrays: dict[str, np.ndarray] = {}
    problems = []
    with archive:
        for entry in manifest["inputs"]:
            name, shape = entry["name"], entry["shape"]
            if name not in archive.files:
                problems.append(f"'{name}' is missing")
                continue
            array = _read_array(archive, data_path, name)
            if array.ndim != len(shape) or list(array.shape[1:]) != shape[1:] or array.shape[0] < shape[0]:
                problems.append(f"'{name}' has shape {list(array.shape)}")
                continue
            arrays[name] = array
    if not arrays and not problems:  # a step without data inputs: nothing to check or cut
        return [{}], ""
    if problems:
        raise _error(f"data file '{data_path}': {'; '.join(problems)}; expected arrays (any number of rows, at least "
                     f"one batch): {expected}")
    row_counts = {name: array.shape[0] for name, array in arrays.items()}
    if len(set(row_counts.values())) > 1:  # cutting all to the shortest would pair rows that do not belong together
        counts = ", ".join(f"'{name}' {rows}" for name, rows in row_counts.items())
        raise _error(f"data file '{data_path}': its arrays have different row counts ({counts}); each row is one "
                     "example, so give every array the same number of rows")
    rows = min(row_counts.values())
    batch = manifest["inputs"][0]["shape"][0]
    count = rows // batch
    used = {e["name"]: _checked(data_path, e, arrays[e["name"]][:count * batch]) for e in manifest["inputs"]}
    notes = [f"{rows - count * batch} rows past the last full batch are not used"] if rows % batch else []
    notes += [_ignored_labels(data_path, e, used[e["name"]], count, rows) for e in manifest["inputs"]
              if e.get("ignore_index") is not None]
    cut = [{name: array[k * batch:(k + 1) * batch] for name, array in used.items()} for k in range(count)]
    return cut, "; ".join(note for note in notes if note)


def _ignored_labels(path: str, entry: Mapping[str, Any], labels: np.ndarray, count: int, rows: int) -> str:
    """A note naming the batches in which no label counts (every one the ignore index: a loss of 0 and no
    gradient); a file in which none counts trains nothing and is refused."""
    name, ignored = entry["name"], entry["ignore_index"]
    counting = (labels.reshape(count, -1) != ignored).any(axis=1)
    if not counting.any():
        where = f"in the {labels.shape[0]} rows that fill whole batches" if labels.shape[0] < rows else \
            f"in all {rows} rows"
        raise _error(f"data file '{path}': every label in '{name}' is the ignore index {ignored}, {where}, so no "
                     f"position counts in the loss and training would learn nothing; give labels in "
                     f"[0, {entry['classes']}) where the loss should count")
    idle = [str(k + 1) for k in np.flatnonzero(~counting)]
    if not idle:
        return ""
    listed = ", ".join(idle[:10]) + (", ..." if len(idle) > 10 else "")
    one = len(idle) == 1
    return (f"{len(idle)} of {count} batches {'has' if one else 'have'} only ignored labels (every '{name}' value "
            f"{ignored}): batch{'' if one else 'es'} {listed}; {'its step adds' if one else 'their steps add'} no "
            "gradient")
