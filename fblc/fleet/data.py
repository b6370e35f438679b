"""A fleet's data: the rows of one `.npz` (one array per model input, and `labels`, as `fblc run --data` reads),
a held-out part for the server's evaluation, and the training rows split among clients.

Each client computes the same split (seeded) and keeps its own part: in a simulation the rows never leave the
client's process except as the trained tensors the client returns. Partitions (PARTITIONS):
- `iid`: a random permutation cut into equal parts;
- `dirichlet:ALPHA`: per class, the rows divided among the clients by proportions drawn from Dirichlet(ALPHA)
  (small ALPHA: each client sees few classes; Hsu et al. 2019, the split most federated benchmarks use);
- `by-label`: the rows sorted by label and cut into equal contiguous shards (each client one or two classes:
  McMahan et al.'s pathological split).
A client left with no rows (possible under a small ALPHA) gets one row from the largest part, so every client
trains.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np

from fblc.errors import FblcError

LABELS = "labels"


@dataclass(frozen=True)
class Rows:
    """Arrays with the same number of rows, by name (model inputs and `labels`)."""

    arrays: Mapping[str, np.ndarray]

    def __len__(self) -> int:
        return int(len(self.arrays[LABELS]))

    def take(self, index: np.ndarray) -> "Rows":
        return Rows({name: array[index] for name, array in self.arrays.items()})

    @property
    def labels(self) -> np.ndarray:
        return self.arrays[LABELS]


def load_rows(path: str, inputs: Mapping[str, list[int]]) -> Rows:
    """The `.npz` at `path` as Rows; `inputs` (name -> the bundle's shape, batch first) says which arrays the
    model reads: each must be there with the bundle's row shape, and `labels` too."""
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as error:
        raise FblcError(f"cannot read --data '{path}' ({error})", "give an .npz with one array per model input "
                        "and 'labels'") from None
    with data:
        arrays = {name: data[name] for name in data.files}
    missing = [name for name in [*inputs, LABELS] if name not in arrays]
    if missing:
        raise FblcError(f"--data '{path}' has no array {missing[0]!r}", f"it needs {', '.join([*inputs, LABELS])}")
    rows = {len(arrays[name]) for name in [*inputs, LABELS]}
    if len(rows) != 1:
        raise FblcError(f"--data '{path}': the arrays have different numbers of rows ({sorted(rows)})",
                        "give every array the same first axis")
    for name, shape in inputs.items():
        if list(arrays[name].shape[1:]) != list(shape[1:]):
            raise FblcError(f"--data '{path}': '{name}' rows have shape {list(arrays[name].shape[1:])}; the bundle "
                            f"reads {list(shape[1:])}", "give rows of the compiled shape")
    return Rows({name: arrays[name] for name in [*inputs, LABELS]})


def held_out(rows: Rows, fraction: float, seed: int) -> tuple[Rows, Rows]:
    """(training rows, held-out rows): a seeded random `fraction` of the rows held out."""
    order = np.random.default_rng(seed).permutation(len(rows))
    count = int(round(len(rows) * fraction))
    return rows.take(np.sort(order[count:])), rows.take(np.sort(order[:count]))


def _iid(labels: np.ndarray, clients: int, rng: np.random.Generator, _: float) -> list[np.ndarray]:
    return list(np.array_split(rng.permutation(len(labels)), clients))


def _dirichlet(labels: np.ndarray, clients: int, rng: np.random.Generator, alpha: float) -> list[np.ndarray]:
    parts: list[list[int]] = [[] for _ in range(clients)]
    for label in np.unique(labels):
        rows = rng.permutation(np.flatnonzero(labels == label))
        cuts = (np.cumsum(rng.dirichlet(np.full(clients, alpha))) * len(rows)).astype(int)[:-1]
        for part, chunk in zip(parts, np.split(rows, cuts)):
            part.extend(chunk.tolist())
    return [np.asarray(sorted(part), dtype=np.int64) for part in parts]


def _by_label(labels: np.ndarray, clients: int, rng: np.random.Generator, _: float) -> list[np.ndarray]:
    order = np.argsort(labels, kind="stable")
    return list(np.array_split(order, clients))


#: partition name -> (rows' labels, clients, rng, parameter) -> row indices per client
PARTITIONS: dict[str, Callable[[np.ndarray, int, np.random.Generator, float], list[np.ndarray]]] = {
    "iid": _iid, "dirichlet": _dirichlet, "by-label": _by_label}


def parse_partition(text: str) -> tuple[str, float]:
    """`iid`, `by-label` or `dirichlet:ALPHA` as (name, parameter)."""
    name, _, value = text.partition(":")
    if name not in PARTITIONS:
        raise FblcError(f"unknown partition '{text}'", "choose iid, by-label or dirichlet:ALPHA (e.g. dirichlet:0.5)")
    if name == "dirichlet":
        try:
            alpha = float(value)
        except ValueError:
            alpha = -1.0
        if not alpha > 0:
            raise FblcError(f"partition '{text}' needs a positive ALPHA", "write dirichlet:0.5")
        return name, alpha
    if value:
        raise FblcError(f"partition '{name}' takes no parameter (got '{text}')", f"write {name}")
    return name, 0.0


def partition(labels: np.ndarray, clients: int, scheme: str, seed: int) -> list[np.ndarray]:
    """Row indices of each of `clients` clients under `scheme` (parse_partition's text); every client gets a row."""
    name, parameter = parse_partition(scheme)
    if clients > len(labels):
        raise FblcError(f"{clients} clients but {len(labels)} training rows", "use fewer clients or more data")
    parts = PARTITIONS[name](labels, clients, np.random.default_rng(seed), parameter)
    for index, part in enumerate(parts):
        if len(part) == 0:  # a row from the largest part: every client trains
            largest = max(range(clients), key=lambda i: len(parts[i]))
            parts[index], parts[largest] = parts[largest][-1:], parts[largest][:-1]
    return parts


def batches(rows: Rows, batch: int, seed: int | Sequence[int]) -> Iterator[dict[str, np.ndarray]]:
    """Batches of `batch` rows without end: each pass over the rows in a new seeded order; rows fewer than a batch
    are drawn with replacement (a phone with 7 photos still trains on batches of the compiled size)."""
    rng = np.random.default_rng(seed)
    while True:
        order = (rng.permutation(len(rows)) if len(rows) >= batch
                 else rng.choice(len(rows), size=batch, replace=True))
        for start in range(0, len(order) - batch + 1, batch):
            yield dict(rows.take(order[start:start + batch]).arrays)
