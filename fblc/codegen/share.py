"""Kernels with equal IR built once: `share_kernels` sets each kernel's `function` and `twin` (codegen/cl.py).

Kernels are grouped by their arguments (and the aliased ones); a group's first kernel is compared with the next
whole (an equal body is the common case: optimizer updates, backward pieces of same-shaped tensors), and a group
with two or more different bodies finds a kernel's equal among those of the same hash of the body only. Comparing
each kernel with every earlier different one took 2.4 of the 1B ES step's compile's CPU seconds (13,000 unequal
pairs, most of them alike up to a texel index deep in the eighth statement).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fblc.codegen.cl import Kernel
from fblc.codegen import ir as kir


def share_kernels(kernels: list[Kernel]) -> None:
    """Set each kernel's `function`: its own name, or that of the first kernel with equal IR (the same
    arguments and body; names aside), whose __kernel its launches then share. Optimizer updates and backward
    pieces of same-shaped tensors repeat exactly: building each once shortens the OpenCL compile. And the `twin`
    of each kernel and co-launched part (codegen/co_launch.py): the first of them with equal IR, whose body the
    source holds once as a function where a co-launched kernel runs it (render/source.py)."""
    hashes: dict[int, int] = {}  # id(kernel) -> hash of its body, shared: a kernel with no parts is its own part
    launched, bodies = FirstEqual(hashes), FirstEqual(hashes)
    # a co-launched kernel's IR is made from its parts' (equal where their twins are), counts of textures, starts
    # and group size (co_launch.merged): one made from the same is equal to the first's, found without comparing
    made_from: dict[tuple[Any, ...], Kernel] = {}
    for kernel in kernels:
        for part in kernel.parts or [kernel]:
            part.twin = bodies.first(part).name
        key = (tuple((p.twin, len(p.outputs), len(p.inputs)) for p in kernel.parts), tuple(kernel.starts),
               kernel.group_size, tuple(kernel.ir.arguments), kernel.ir.aliased)
        first = made_from.get(key) if kernel.parts else None
        if first is None:
            first = launched.first(kernel)
            if kernel.parts:
                made_from[key] = first
        kernel.function = first.name


class FirstEqual:
    """The first of the kernels given so far with IR equal to a kernel's (the kernel itself, added, if none).
    `hashes`: bodies' hashes by id of their kernel, which stay alive and unchanged while this is used."""

    def __init__(self, hashes: dict[int, int]) -> None:
        self.hashes = hashes
        self.single: dict[tuple[Any, ...], Kernel] = {}  # groups with one body so far: its first kernel
        self.hashed: dict[tuple[Any, ...], dict[int, list[Kernel]]] = {}  # the others: their firsts by body hash

    def first(self, kernel: Kernel) -> Kernel:
        ir = kernel.ir
        assert isinstance(ir, kir.KernelIR), f"{kernel.name} has no IR"
        group = (tuple(ir.arguments), ir.aliased)
        by_hash = self.hashed.get(group)
        if by_hash is None:
            single = self.single.setdefault(group, kernel)
            if single is kernel or single.ir.body == ir.body:  # type: ignore[attr-defined]
                return single
            del self.single[group]
            by_hash = self.hashed[group] = {self._hash(single): [single]}
        alike = by_hash.setdefault(self._hash(kernel), [])
        found = next((k for k in alike if k.ir.body == ir.body), None)  # type: ignore[attr-defined]
        if found is None:
            alike.append(kernel)
        return found or kernel

    def _hash(self, kernel: Kernel) -> int:
        found = self.hashes.get(id(kernel))
        if found is None:
            found = self.hashes[id(kernel)] = hash(structure(kernel.ir.body))  # type: ignore[union-attr]
        return found


#: each statement class's fields, in order (what its dataclass __eq__ compares)
_FIELDS: dict[type, tuple[str, ...]] = {}


def structure(statements: list[kir.Statement]) -> tuple[object, ...]:
    """`statements` as nested tuples, hashable (expressions are frozen dataclasses that hash by their fields) and
    equal where the statements are: each statement its class and its fields, a statement list a tuple of them."""
    out = []
    for statement in statements:
        cls = type(statement)
        names = _FIELDS.get(cls)
        if names is None:
            names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(statement) if f.compare)
        out.append((cls, *(structure(value) if isinstance(value, list) else value
                           for value in (getattr(statement, name) for name in names))))
    return tuple(out)
