"""Co-launch: independent kernels of a GPU step run as one launch (horizontal fusion).

A phone's OpenCL driver costs a launch tens of microseconds (the profile's `launch_us`), and most of a small
model's backward launches hold fewer work-items than the GPU (an input gradient and the previous layer's weight
gradient each fill part of it). Two kernels that neither read nor write what the other writes, with no launch
between them that either depends on, run as one __kernel over both ranges of work-items: the first `span` of the
launch run the first kernel's body, the rest the second's with get_global_id (get_group_id) less its start. So the
pair pays one launch, and a fetch-bound kernel's texture work overlaps a memory-bound one's DRAM traffic.

Rules (`co_launch`): a kernel joins the nearest earlier launch it may move up to: it commutes with every launch
from there to its own place (it reads nothing they write, writes nothing they read or write), the launch holds
fewer than CO_LAUNCH_PARTS kernels, reads at most READ_IMAGE_ARGS and writes at most WRITE_IMAGE_ARGS images,
and their work-group sizes agree: kernels written for one group size (Kernel.group_size: __local memory,
barriers) join only kernels of that size, or of any size where theirs is whole waves (a kernel of any size
launched in groups of 4 would leave 60 lanes of each 64-lane wave idle). Each part's range is whole groups of
the launch's size, so a barrier is reached by a whole group or by none. A kernel with a __local array declared
below its body's top level is left alone (OpenCL C wants __local variables at the kernel's outermost scope: the
top-level ones are hoisted, renamed where two parts name theirs alike). Only on GPU profiles (a CPU's OpenCL runs
a launch's work-items on the same cores and pays little per launch: PoCL's steps are left as they are), and not
in a step with a loop of launches (ES members: plan.json's loops index the launches).

The merged kernel's texture arguments are its parts' outputs, then their inputs, each part's renumbered; its
variables are renumbered past the first part's, so the IR stays one kernel's numbering (the renderer names a
variable by its kind and number). Its `parts` are the kernels it runs (report.json's estimate counts their nodes'
FLOPs; plan.json's schedule gives each part's). That IR is what the launch runs, as the figures and the estimate
read it; the source writes it as calls (`dispatch`) of each part's function (`part_function`), held once for every
launch that runs that body (render/source.py). A part with barriers (a group reduction) is a function of one
exit that the device compiler's front end inlines (`part_function`):

- one exit: its guard `if (t >= n) return;` is written `if (t < n) { the rest }` (`one_exit`). PoCL 3.1 built with
  -cl-opt-disable (the suite's and oclgrind's builds) inlines a function with barriers into its __kernel and, where
  that function had a second exit (an early return) and the __kernel branched before the call (the pair's `if`),
  replicated the function's exit block for the paths after the barrier and so took an `if` on the local id there
  as uniform: the group's first work-item ran it, the others skipped it (the MLP fp16 step for adreno730: 385 of
  512 outputs of a MatMul's group reduction off; right on oclgrind, race-free, and on optimised PoCL);
- inlined (`KernelIR.inlined`: always_inline, as the layouts' coordinate functions): PoCL's own inlining of a
  function with barriers, after its front end, cost MobileNetV2's group pairs 2.8x the CPU time of their copied
  bodies to build (k144_Conv_k145_Conv: 23.7 CPU s, copied 8.5, inlined by the front end 6.5).

Both are the same program for every compiler. A part whose return sits anywhere but in such a guard stays copied
into the pair (`dispatched`).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable, Sequence

from fblc.codegen import ir as kir
from fblc.codegen.cl import Kernel
from fblc.codegen.render.opencl import name_of
from fblc.profiles import Profile
from fblc.profiles.profile import READ_IMAGE_ARGS, WRITE_IMAGE_ARGS

#: the most kernels one launch runs (two: a weight gradient and the next input gradient of a backward)
CO_LAUNCH_PARTS = 2
#: the work-item builtins whose values a part sees shifted by its start (in items, or in groups), and the name of
#: the value a part's function is called with for each (part_function)
SHIFTED = {"get_global_id": 1, "get_group_id": 0}
FIRST = {"get_global_id": "first_item", "get_group_id": "first_group"}


def co_launch(kernels: list[Kernel], profile: Profile, looped: bool) -> list[Kernel]:
    """The launches of `kernels` (in launch order) with independent neighbours merged (this module's rules);
    `kernels` itself where nothing merges, the profile is a CPU's or the step has a loop of launches (`looped`)."""
    if profile.cpu or looped:
        return kernels
    launches: list[list[Kernel]] = []
    for kernel in kernels:
        reads, writes = set(kernel.inputs), set(kernel.outputs)
        for launch in reversed(launches):
            their_reads = {t for part in launch for t in part.inputs}
            their_writes = {t for part in launch for t in part.outputs}
            depends = reads & their_writes or writes & (their_reads | their_writes)
            if not depends and _joins(launch, kernel, profile.wave_size):
                launch.append(kernel)
                break
            if depends:
                launches.append([kernel])
                break
        else:
            launches.append([kernel])
    return [launch[0] if len(launch) == 1 else merged(launch, profile) for launch in launches]


def _joins(launch: Sequence[Kernel], kernel: Kernel, wave: int) -> bool:
    parts = [*launch, kernel]
    sizes = {part.group_size for part in parts} - {None}
    any_size = any(part.group_size is None for part in parts)  # launched in the others' groups: whole waves only
    return (len(parts) <= CO_LAUNCH_PARTS and len(sizes) <= 1 and all(map(_hoistable, parts))
            and not (any_size and sizes and min(sizes) % wave)
            and sum(len(set(part.inputs)) for part in parts) <= READ_IMAGE_ARGS
            and sum(len(part.outputs) for part in parts) <= WRITE_IMAGE_ARGS)


def _hoistable(kernel: Kernel) -> bool:
    """Whether every __local array of the kernel is declared at its body's top level."""
    top = {id(s) for s in kernel.ir.body}
    return all(id(s) in top for s in kir.walk(kernel.ir.body) if isinstance(s, kir.DeclareArray) and s.local)


def merged(parts: Sequence[Kernel], profile: Profile) -> Kernel:
    """One kernel running `parts` over consecutive ranges of its work-items (this module's docstring)."""
    group = next((part.group_size for part in parts if part.group_size is not None), None)
    granule = group or profile.wave_size  # a part's range: whole groups, else whole waves (no wave runs two)
    hoisted: list[kir.Statement] = []
    names: set[str] = set()
    arguments: list[kir.Argument] = []
    start = out_base = in_base = 0
    offset = 0  # added to the part's variable numbers
    starts: list[int] = []
    bodies: list[list[kir.Statement]] = []
    for index, part in enumerate(parts):
        relabel = _Relabel(offset, _shifts(start, group), out_base, in_base)
        for argument in part.ir.arguments:
            arguments.append(relabel.argument(argument))
        for statement in part.ir.body:
            if _local(statement):
                name = statement.var.name
                if name and name in names:
                    relabel.renamed[name] = f"{name}_{index}"
                names.add(relabel.renamed.get(name, name))
        if index:
            statements, top = [relabel.any(s) for s in part.ir.body], relabel.top
        else:  # its own numbers, arguments and work-item ids: its statements as they are (not changed after emission)
            statements, top = list(part.ir.body), _declared_top(part.ir.body)
        hoisted += [s for s in statements if _local(s)]
        starts.append(start)
        bodies.append([s for s in statements if not _local(s)])
        last = index == len(parts) - 1 and group is None  # a launch of one group size is whole groups
        span = part.global_size if last else -(-part.global_size // granule) * granule
        start += span
        out_base += len(part.outputs)
        in_base += len(part.inputs)
        offset = (offset if top is None else top) + 1
    arguments.sort(key=lambda a: (a.role != "out", a.index))
    name = "_".join(part.name for part in parts)
    families = {part.family for part in parts}
    kernel = Kernel(name, parts[0].family if len(families) == 1 else "mixed",
                    kir.KernelIR(name, arguments, hoisted + _branches(bodies, starts, group), group),
                    start, [t for part in parts for t in part.outputs], [t for part in parts for t in part.inputs],
                    [n for part in parts for n in part.nodes], group_size=group)
    kernel.parts, kernel.starts = list(parts), starts
    return kernel


def _branches(bodies: Sequence[list[kir.Statement]], starts: Sequence[int], group: int | None
              ) -> list[kir.Statement]:
    """if (id < the next part's start) {..} else {..}: in groups where the launch has a size (a branch uniform in
    each group, as its barriers want, and plainly so to the device compiler)."""
    item = kir.call("get_group_id" if group else "get_global_id", 0, dtype=kir.INT)
    body = bodies[-1]
    for statements, after in zip(reversed(bodies[:-1]), reversed(starts[1:])):
        body = [kir.If(item.lt(after // (group or 1)), statements, body)]
    return body


def _shifts(start: int, group: int | None) -> dict[str, kir.Expr]:
    """What a part starting at work-item `start` subtracts from each of SHIFTED."""
    if not start:
        return {}
    return {function: kir.const(start if in_items else start // (group or 1)) for function, in_items in SHIFTED.items()}


def _declared_top(body: Sequence[kir.Statement]) -> int | None:
    """The largest number of a variable `body` declares (None where it declares none): that of any it reads, as
    C wants a variable declared before it is read, but for the named ones (work-item ids, a function's values:
    number 0, whose C name is their own)."""
    return max((s.var.number for s in kir.walk(body) if isinstance(s, _DECLARING)), default=None)


#: the statements that declare a variable (`var`)
_DECLARING = (kir.Declare, kir.DeclareArray, kir.For)


def _local(statement: kir.Statement) -> bool:
    return isinstance(statement, kir.DeclareArray) and statement.local


def _builtins(body: kir.KernelIR) -> list[str]:
    """Those of SHIFTED that the kernel calls."""
    called = {e.function for s in kir.walk(body.body) for x in kir.statement_exprs(s) for e in kir.walk_expr(x)
              if isinstance(e, kir.Call)}
    return [function for function in SHIFTED if function in called]


def dispatched(kernel: Kernel) -> bool:
    """Whether the source runs co-launched `kernel`'s parts as functions (`dispatch`), not as copies of their bodies
    (its IR): where each part with barriers can be written with one exit (`one_exit`; this module's docstring)."""
    return bool(kernel.parts) and all(not _barriers(part.ir.body) or one_exit(part.ir.body) is not None
                                      for part in kernel.parts)


def _barriers(body: Sequence[kir.Statement]) -> bool:
    return any(isinstance(s, kir.Barrier) for s in kir.walk(body))


#: each comparison's negation: a guard `if (a >= b) return;` held as `if (a < b) { .. }`
NEGATED = {"<": ">=", ">=": "<", "<=": ">", ">": "<=", "==": "!=", "!=": "=="}


def one_exit(body: Sequence[kir.Statement]) -> list[kir.Statement] | None:
    """`body` leaving only by its end: each top-level guard `if (c) return;` written `if (!c) { what follows }`
    (the same work-items run the same statements); None where a return sits anywhere else (in a loop, in a
    branch that does more than return)."""
    for index, statement in enumerate(body):
        if isinstance(statement, kir.If) and not statement.orelse and \
                [type(s) for s in statement.then] == [kir.Return]:
            rest = one_exit(body[index + 1:])
            return None if rest is None else [*body[:index], kir.If(_negated(statement.condition), rest)]
        if any(isinstance(s, kir.Return) for s in kir.walk([statement])):
            return None
    return list(body)


def _negated(condition: kir.Expr) -> kir.Expr:
    if isinstance(condition, kir.Binary) and condition.op in NEGATED:
        return kir.Binary(NEGATED[condition.op], condition.a, condition.b, condition.dtype)
    return ~condition


def part_function(part: Kernel, name: str) -> tuple[kir.KernelIR, list[kir.Var], list[kir.Var]]:
    """(`part`'s body as function `name`, the values it is called with, its __local arrays): what the source holds
    once for a kernel that a co-launched kernel runs (render.opencl.render_function). Its work-item ids are those
    of the launch less the values it is called with (FIRST, of those of SHIFTED it calls: 0 where it runs as a
    launch of its own); its top-level __local arrays are the calling __kernel's (`dispatch`); with barriers, it
    has one exit (`one_exit`) and is inlined (this module's docstring)."""
    if part.function_ir is not None and part.function_ir[0].name == name:  # both storages' sources ask
        return part.function_ir
    builtins = _builtins(part.ir)
    values = [kir.Var("first", 0, kir.INT, FIRST[function]) for function in builtins]
    relabel = _Relabel(0, dict(zip(builtins, values)), 0, 0)
    body = [relabel.any(s) for s in part.ir.body if not _local(s)]
    barriers = _barriers(body)
    if barriers:
        body = one_exit(body)
        assert body is not None, f"{part.name}: a return of its body is not a guard at its top level (dispatched)"
    arrays = [s.var for s in part.ir.body if _local(s)]  # type: ignore[union-attr]
    part.function_ir = (kir.KernelIR(name, part.ir.arguments, body, None, part.ir.aliased, inlined=barriers), values,
                        arrays)
    return part.function_ir


def dispatch(kernel: Kernel, function: Callable[[Kernel], str]) -> kir.KernelIR:
    """The __kernel of `kernel` (a co-launched one, or one whose body is also a co-launched kernel's part) where
    each part's body is function `function(part)` (`part_function`): the parts' __local arrays (named apart), and
    over each part's range of work-items a call of its function with its arguments, as `merged` branches."""
    parts, starts = kernel.parts or [kernel], kernel.starts or [0]
    group = kernel.group_size
    declared: list[kir.Statement] = []
    names: set[str] = set()
    calls: list[list[kir.Statement]] = []
    out_base = in_base = 0
    for index, (part, start) in enumerate(zip(parts, starts)):
        arrays = []
        for statement in part.ir.body:
            if isinstance(statement, kir.DeclareArray) and statement.local:
                name = name_of(statement.var)
                var = dataclasses.replace(statement.var, name=f"{name}_{index}" if name in names else name)
                names.add(var.name)
                declared.append(dataclasses.replace(statement, var=var))
                arrays.append(var)
        relabel = _Relabel(0, {}, out_base, in_base)
        shifts = {"get_global_id": start, "get_group_id": start // (group or 1)}
        arguments = [kir.ArgumentRef(relabel.argument(a)) for a in part.ir.arguments]
        _, values, _ = part_function(part, function(part))  # made once: each storage's source asks
        arguments += [kir.const(shifts[builtin]) for value in values
                      for builtin in SHIFTED if FIRST[builtin] == value.name]
        calls.append([kir.Invoke(function(part), (*arguments, *arrays), in_base)])
        out_base += len(part.outputs)
        in_base += len(part.inputs)
    return kir.KernelIR(kernel.name, kernel.ir.arguments, declared + _branches(calls, starts, group), group,
                        kernel.ir.aliased)


class _Relabel:
    """One part's IR in the merged kernel: variables renumbered by `offset` (and hoisted __local arrays
    renamed), arguments renumbered past the earlier parts' (outputs from `out_base`, inputs from `in_base`),
    and work-item ids less the part's start (`shifts`: what each of SHIFTED less); `top`: the largest variable
    number it wrote (None before any), where the next part's numbers start.

    An expression is an immutable value that a kernel's IR shares between its readers (a texel's index, a loop
    variable): each is relabelled once (`done`, by identity) and one with nothing to relabel is kept, not copied
    (the 1B model's co-launched step copied 3.6M nodes). Statements are mutable: each is a new one."""

    def __init__(self, offset: int, shifts: dict[str, kir.Expr], out_base: int, in_base: int) -> None:
        self.offset, self.shifts = offset, shifts
        self.out_base, self.in_base = out_base, in_base
        self.renamed: dict[str, str] = {}
        self.top: int | None = None
        self.done: dict[int, kir.Expr] = {}  # by id of an expression of the part's IR (alive while it is relabelled)

    def argument(self, a: kir.Argument) -> kir.Argument:
        base = self.out_base if a.role == "out" else self.in_base
        return dataclasses.replace(a, index=a.index + base) if base else a

    def any(self, value: Any) -> Any:
        if type(value) is kir.Const:  # the commonest node, and one with nothing to relabel
            return value
        if isinstance(value, kir.Expr):
            found = self.done.get(id(value))
            if found is None:
                found = self.done[id(value)] = self._expr(value)
            return found
        if isinstance(value, list):
            return [self.any(v) for v in value]
        if isinstance(value, tuple):
            items = tuple(map(self.any, value))
            return value if all(map(operator.is_, value, items)) else items
        if isinstance(value, kir.Argument):
            return self.argument(value)
        if isinstance(value, kir.DType) or not dataclasses.is_dataclass(value) or isinstance(value, type):
            return value
        return type(value)(*(self.any(getattr(value, name)) for name in _init_fields(type(value))))

    def _expr(self, value: kir.Expr) -> kir.Expr:
        if isinstance(value, kir.Var):
            number, name = value.number + self.offset, self.renamed.get(value.name, value.name)
            self.top = number if self.top is None else max(self.top, number)
            return value if (number, name) == (value.number, value.name) else dataclasses.replace(
                value, number=number, name=name)
        if isinstance(value, kir.Call) and value.function in self.shifts:
            return kir.Binary("-", value, self.shifts[value.function], value.dtype)
        fields = value.__dict__
        changed = None
        for name in _expr_fields(type(value)):
            old = fields[name]
            if (new := self.any(old)) is not old:
                changed = changed or dict(fields)
                changed[name] = new
        if changed is None:
            return value
        copy = object.__new__(type(value))  # an Expr is a plain dataclass of its fields: a copy of them, some new
        copy.__dict__.update(changed)
        return copy


#: each IR dataclass's fields that its constructor takes, in its order (_Relabel reads them per node)
_INIT_FIELDS: dict[type, tuple[str, ...]] = {}


def _init_fields(cls: type) -> tuple[str, ...]:
    names = _INIT_FIELDS.get(cls)
    if names is None:
        names = _INIT_FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls) if f.init)
    return names


#: the types of an expression's fields that hold no expression, variable or argument: what _Relabel keeps
_LEAVES = {"DType", "str", "int", "float", "bool", "None", "|"}
#: each Expr class's constructor fields that may hold one (a field of another type too, where it is not one of
#: _LEAVES: Expr's subclasses annotate their fields)
_EXPR_FIELDS: dict[type, tuple[str, ...]] = {}


def _expr_fields(cls: type) -> tuple[str, ...]:
    names = _EXPR_FIELDS.get(cls)
    if names is None:
        names = _EXPR_FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls) if f.init and not set(
            str(f.type).split()) <= _LEAVES)
    return names


def co_launched(schedules: dict[str, dict[str, Any]], kernel: Kernel) -> dict[str, Any]:
    """plan.json's schedule of `kernel`: its own, or for a co-launched one its first part's with `parts`, each
    part's (by name)."""
    if not kernel.parts:
        return schedules[kernel.name]
    return {**schedules[kernel.parts[0].name], "parts": {part.name: schedules[part.name] for part in kernel.parts}}
