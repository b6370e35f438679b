"""In-place state updates: a state's `.new` written into the state's own texture where that is provably safe, so
the pair needs no second texture and no swap after the step (docs/ARCHITECTURE.md §4).

A (state, .new) pair keeps two textures swapped after every step while the update reads the old value. The
update writes over the state instead when
- one launch writes `.new`, reads the state, and is the last launch that reads it (nothing after needs the
  old value), outside any plan loop;
- in that launch every read of the state and every write of `.new` index one texel, the same integer form
  of the work-item ids and loop variables (quotients and remainders of shifts, masks and reciprocal
  divisions folded: a tile's row and column put back together), and that form takes a different value at
  every work-item and loop repetition that makes an access (enumerated over the launch's work-items and
  the loops' values, each access's If guards masking the points: a group reduction's lane 0), so no
  work-item reads a texel another writes; no read of the state (or use of a variable holding one, which
  the renderer may fold there) follows a write of `.new`, and a loop around both repeats over other texels,
  so no work-item reads its own new value; no window read of the state;
- both textures have one format and layout (the next step reads the new value through the state's layout).
Pairs gated by the finite check (plan.json `swaps_if_finite`: a skipped step must keep the old value) and
the carried pairs of a loop (ES members) keep their two textures: the caller passes only the ungated pairs.
A form the proof cannot read (an index it has no rule for) keeps the pair: the proof only ever refuses.

The kernel then takes the state's texture as an input and as an output: buffer storage binds the one buffer
to both pointers, whose `restrict` the renderer drops (KernelIR.aliased); image storage binds one image to
a read_only and a write_only argument, which OpenCL 1.2 leaves undefined (OpenCL 2.0's read_write images are
the defined form); every work-item reads its texel before it writes it and no other work-item touches it,
which PoCL and oclgrind run as written.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterator, Sequence

from fblc.codegen import ir as kir
from fblc.codegen.cl import Kernel
from fblc.codegen.params import TextureContents
from fblc.codegen.render.opencl import foldable
from fblc.codegen.index_forms import Affine, Guard, c_name, declarations, index_bases, index_form, injective
from fblc.codegen.ir.expressions import Argument, ArgumentRef, Expr, Load, Var
from fblc.codegen.textures import Texture

#: the expressions updates_in_place reads among those of a body (the rest only cost the walk a tuple each)
_LOOKED_AT = frozenset({Load, ArgumentRef, Var})


def _accesses(statements: Sequence[kir.Statement], loops: tuple[int, ...] = (), guards: Guard = ()
              ) -> Iterator[tuple[kir.Statement, tuple[int, ...], Guard, Expr]]:
    """(statement, the ids of the loops around it, the conditions of the Ifs it is in the then-branch of, each
    expression it reads or writes that the proof looks at: a texel read, a window read, a variable, a Store's
    target texel) in program order."""
    for statement in statements:
        texel = statement.texel if isinstance(statement, kir.Store) else None
        for expr in kir.statement_exprs(statement):
            for inner in kir.walk_expr(expr):
                if type(inner) in _LOOKED_AT or inner is texel:
                    yield statement, loops, guards, inner
        inside = loops + (id(statement),) if isinstance(statement, (kir.For, kir.While)) else loops
        if isinstance(statement, kir.If):
            yield from _accesses(statement.then, inside, guards + (statement.condition,))
            yield from _accesses(statement.orelse, inside, guards)
            continue
        for body in kir.nested(statement):
            yield from _accesses(body, inside, guards)


def updates_in_place(body: kir.KernelIR, state: Argument, new: Argument, items: int | None = None,
                     group_size: int | None = None, folds: dict[Var, Expr] | None = None) -> bool:
    """Whether every work-item of `body` reads input `state` only at the texel it writes output `new` at,
    before it writes it, and no two work-items share that texel (the module docstring's conditions);
    `items`: the launch's work-items and `group_size` its work-group's, where known; `folds`: `body`'s
    render.opencl.foldable, where known (Kernel.folds)."""
    declared = declarations(body.body)
    holders = _holders(body.body, state, foldable(body.body) if folds is None else folds)
    forms: set[Affine | None] = set()
    reads: list[tuple[int, ...]] = []  # the loops around each read
    guards: list[Guard] = []  # each access's
    writes = 0
    for statement, loops, guard, expr in _accesses(body.body):
        if isinstance(expr, ArgumentRef) and expr.argument == state:
            return False  # a window read: neighbouring texels
        if isinstance(expr, Load) and expr.argument == state:
            forms.add(index_form(expr.texel, declared))
            guards.append(guard)
        if isinstance(expr, Load) and expr.argument == state or isinstance(expr, Var) and c_name(expr) in holders:
            reads.append(loops)
        if isinstance(statement, kir.Store) and statement.argument == new and expr is statement.texel:
            forms.add(index_form(statement.texel, declared))
            guards.append(guard)
            writes += 1
    if not writes or len(forms) != 1:
        return False
    form = next(iter(forms))
    if form is None or not injective(form, declared, items, group_size, guards):
        return False  # two work-items (or two repetitions of a loop) could share a texel
    # reads before writes, and no loop around both a read and a write unless its repetitions touch other texels
    # (the loops whose variable the injective index holds, alone or in quotients)
    indexed = {id(declared[base[1]]) for base in index_bases(form) if base[0] == "loop"}
    write_loops = _write_loops(body.body, new) - indexed
    return not any(set(loops) & write_loops for loops in reads) and \
        _reads_before_writes(body.body, state, new, holders)


def _holders(statements: Sequence[kir.Statement], state: Argument, folded: dict[Var, Expr]) -> set[str]:
    """The const variables the renderer folds into their one reader (`folded`: render.opencl.foldable of
    `statements`) whose value holds a read of `state`: the read happens at that use, not at the declaration."""
    held: set[str] = set()
    for statement in kir.walk(statements):
        if isinstance(statement, kir.Declare) and statement.var in folded and statement.init is not None and any(
                isinstance(e, Load) and e.argument == state or isinstance(e, Var) and c_name(e) in held
                for e in kir.walk_expr(statement.init)):
            held.add(c_name(statement.var))
    return held


def _write_loops(statements: Sequence[kir.Statement], new: Argument, loops: tuple[int, ...] = ()) -> set[int]:
    """The ids of the loops around any write of `new`."""
    found: set[int] = set()
    for statement in statements:
        if isinstance(statement, kir.Store) and statement.argument == new:
            found |= set(loops)
        inside = loops + (id(statement),) if isinstance(statement, (kir.For, kir.While)) else loops
        for body in kir.nested(statement):
            found |= _write_loops(body, new, inside)
    return found


def _reads_before_writes(statements: Sequence[kir.Statement], state: Argument, new: Argument,
                         holders: set[str]) -> bool:
    """Whether, in program order, no read of `state` (or use of a variable holding one) follows a write of
    `new`."""
    written = False
    for statement in kir.walk(statements):  # a statement reads what it reads before it writes
        if written and any(isinstance(e, Load) and e.argument == state or isinstance(e, Var) and c_name(e) in holders
                           for expr in kir.statement_exprs(statement) for e in kir.walk_expr(expr)):
            return False
        written = written or isinstance(statement, kir.Store) and statement.argument == new
    return True


def _movable_after(kernels: Sequence[Kernel], writer: int, last: int, looped: set[int], merged: dict[int, int]
                   ) -> bool:
    """Whether launch `writer` may run right after launch `last` (> writer) instead: no launch between reads,
    or writes, what it writes, nor writes what it reads, and no plan loop lies there (its launch range would
    shift). `merged`: the `.new` textures already chosen to write over their states (.new -> state), which
    write their state then."""
    def textures(ids: list[int]) -> set[int]:
        return {merged.get(t, t) for t in ids}

    written, read = textures(kernels[writer].outputs), textures(kernels[writer].inputs)
    return not any(index in looped or written & (textures(kernels[index].inputs) | textures(kernels[index].outputs))
                   or read & textures(kernels[index].outputs) for index in range(writer, last + 1) if index != writer)


class _Proofs:
    """updates_in_place of a launch, answered once per kernel body: optimizer updates of same-shaped states repeat
    exactly (codegen/share.share_kernels shares their __kernel), and each proof walks the body and enumerates its
    texels."""

    def __init__(self) -> None:
        self.known: dict[tuple, list[tuple[kir.KernelIR, bool]]] = {}

    def __call__(self, update: Kernel, state: Argument, new: Argument) -> bool:
        body = update.ir
        alike = self.known.setdefault((tuple(body.arguments), state, new, update.global_size, update.group_size), [])
        for seen, answer in alike:
            if seen.body == body.body:
                return answer
        answer = updates_in_place(body, state, new, update.global_size, update.group_size, update.folds)
        alike.append((body, answer))
        return answer


def in_place_pairs(kernels: list[Kernel], textures: Sequence[Texture], pairs: Sequence[tuple[int, int]],
                   kept: set[int], looped: set[int]) -> list[tuple[int, int]]:
    """The (state, .new) texture pairs of `pairs` whose update can write over the state; `kept`: textures that
    must keep their own texture whatever (a loop's carried pairs); `looped`: the launches a loop repeats (a
    repetition would read the new value where it wants the old). An update that a later launch's read of the old
    state follows (an input gradient reading a weight whose update the weight gradient's kernel makes) moves after
    that reader where nothing between depends on it: `kernels` is reordered then (in place)."""
    chosen = []
    proven = _Proofs()
    writing: dict[int, list[Kernel]] = {}  # texture -> the launches that write it, those that read it: each pair
    reading: dict[int, list[Kernel]] = {}  # asks of two textures, and scanning every launch each time was O(n^2)
    for kernel in kernels:
        for texture in set(kernel.outputs):
            writing.setdefault(texture, []).append(kernel)
        for texture in set(kernel.inputs):
            reading.setdefault(texture, []).append(kernel)
    position = {id(kernel): index for index, kernel in enumerate(kernels)}  # rebuilt where a launch moves
    for state, new in pairs:
        if state in kept or new in kept:
            continue
        if textures[state].format != textures[new].format or textures[state].layout != textures[new].layout:
            continue
        writers = writing.get(new, [])
        readers = sorted(position[id(kernel)] for kernel in reading.get(state, []))
        if len(writers) != 1 or state in writing or not readers:
            continue
        writer = position[id(writers[0])]
        update = kernels[writer]
        if new in update.inputs or writer in looped or state not in update.inputs:
            continue
        if update.inputs.count(state) != 1 or update.outputs.count(new) != 1:
            continue
        arguments = {(a.role, a.index): a for a in update.ir.arguments}
        state_argument = arguments.get(("in", update.inputs.index(state)))
        new_argument = arguments.get(("out", update.outputs.index(new)))
        if state_argument is None or new_argument is None or not proven(update, state_argument, new_argument):
            continue
        last = readers[-1]
        if last != writer:  # a later launch reads the old state: the update goes after it, where it may
            if not _movable_after(kernels, writer, last, looped, {n: s for s, n in chosen}):
                continue
            kernels.insert(last, kernels.pop(writer))
            position = {id(kernel): index for index, kernel in enumerate(kernels)}
        chosen.append((state, new))
    return chosen


def merge_textures(kernels: list[Kernel], textures: list[Texture], values: dict[str, int],
                   initial: dict[int, TextureContents], merged: Sequence[tuple[int, int]]) -> list[int]:
    """Make each `.new` of `merged` its state's texture: its writer's output and its values go to the state, its
    texture goes, and the textures are numbered again. Rewrites the arguments in place; returns old id -> new id
    (a merged `.new`'s: its state's) for the caller's other tables."""
    into = {new: state for state, new in merged}
    kept = [t for t in textures if t.id not in into]
    renumber = [-1] * len(textures)
    for position, texture in enumerate(kept):
        renumber[texture.id] = position
    for new, state in into.items():
        renumber[new] = renumber[state]
        textures[state].values.extend(v for v in textures[new].values if v not in textures[state].values)
    for kernel in kernels:
        kernel.outputs = [renumber[t] for t in kernel.outputs]
        kernel.inputs = [renumber[t] for t in kernel.inputs]
    for name in values:
        values[name] = renumber[values[name]]
    moved = {renumber[t]: array for t, array in initial.items()}
    initial.clear()
    initial.update(moved)
    textures[:] = [replace(t, id=renumber[t.id]) for t in kept]
    return renumber
