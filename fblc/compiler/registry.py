"""Tables keyed by op type: gradient rules, shape rules, and later kernel emitters and FTD classes.

Registering an op twice is an error; looking up an op the table lacks raises an error that
names the op, the node and the supported list. `missing` checks a whole set of nodes first and
`error` names every op it found in one error (fblc/compiler/gaps.py).
"""

from __future__ import annotations

from typing import Callable, Generic, Iterable, Sequence, TypeVar

import onnx_ir as ir

from fblc.errors import FblcError
from fblc.compiler.gaps import DEFAULT_DOMAINS, OpGap, combined_error, group_by_op

Entry = TypeVar("Entry")


class OpRegistry(Generic[Entry]):
    """One table from ONNX op type (default domain) to an entry of kind `what`."""

    def __init__(self, what: str, remedy: str, loader: Callable[[], object] | None = None) -> None:
        self.what = what
        self.remedy = remedy
        self._entries: dict[str, Entry] = {}
        self._loader = loader  # imports the modules that fill the table, on first use

    def register(self, *op_types: str) -> Callable[[Entry], Entry]:
        """Decorator: the decorated entry serves `op_types`."""

        def decorate(entry: Entry) -> Entry:
            for op_type in op_types:
                if op_type in self._entries:
                    raise ValueError(f"{self.what} for {op_type} registered twice")
                self._entries[op_type] = entry
            return entry

        return decorate

    def _load(self) -> None:
        if self._loader is not None:
            loader, self._loader = self._loader, None
            loader()

    def supported(self) -> list[str]:
        self._load()
        return sorted(self._entries)

    def __contains__(self, op_type: str) -> bool:
        self._load()
        return op_type in self._entries

    def get(self, node: ir.Node, default: Entry) -> Entry:
        """`node`'s entry, or `default` for an op the table lacks (a table with a safe fallback)."""
        self._load()
        found = self._entries.get(node.op_type) if node.domain in DEFAULT_DOMAINS else None
        return default if found is None else found

    def has(self, node: ir.Node) -> bool:
        """Whether `node` has an entry (its op type, in the default domain: another domain's op of
        the same name is another op)."""
        self._load()
        return node.domain in DEFAULT_DOMAINS and node.op_type in self._entries

    def missing(self, nodes: Iterable[ir.Node]) -> list[OpGap]:
        """The ops of `nodes` the table lacks, each with its nodes, in the order they first occur."""
        return group_by_op(n for n in nodes if not self.has(n))

    def error(self, gaps: Sequence[OpGap], refusals: Sequence[FblcError] = ()) -> FblcError:
        """One error naming every gap (and every node an entry refused), with the supported ops."""
        return combined_error(self.what, self.remedy, self.supported(), gaps, refusals)

    def lookup(self, node: ir.Node) -> Entry:
        if not self.has(node):
            raise self.error(self.missing([node]))
        return self._entries[node.op_type]
