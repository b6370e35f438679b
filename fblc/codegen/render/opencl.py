"""The renderer: kernel IR to OpenCL C, the one place that writes C.

It names each variable by its kind and number (`acc12`; the few names shared with the host or
the preamble are fixed), maps each IR operation to C in one table, and folds a const value read
exactly once into its reader when that keeps its meaning: the value reads nothing that changes
(no array element, no variable assigned again) and its reader runs as often as it would
(the same loop, not a loop inside). Texture arguments, reads and writes are a Storage's templates
(IMAGE: image2d_t at the layout's coordinate, kernels.cl; BUFFER: __global buffers indexed by the
texel, kernels.buffer.cl): one kernel IR renders to either.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from fblc.codegen import ir
from fblc.codegen.render.preamble import BUFFER_PREAMBLE, PREAMBLE, REAL_IMAGE_PREAMBLE, REAL_PREAMBLE

COMPONENTS = "xyzw"
LANE_FUNCTIONS = {"float": "lane_f", "int": "lane_i", "uint": "lane_i", "real": "lane_r"}
INDENT = "  "
#: the preamble's macro that says an optional feature (ir.FEATURES) is there (preamble.FEATURE_TESTS)
FEATURE_MACROS = {"subgroups": "FBLC_SUBGROUPS"}


def float_literal(value: float) -> str:
    if math.isnan(value):
        return "NAN"
    if math.isinf(value):
        return "INFINITY" if value > 0 else "(-INFINITY)"
    text = repr(float(np.float32(value)))
    return f"{text}f" if ("." in text or "e" in text) else f"{text}.0f"


def literal(value: float | int | bool, dtype: ir.DType) -> str:
    if dtype.scalar == "real":  # a float literal would widen half arithmetic to float (and a half vector refuses it)
        return f"((real){float_literal(float(value))})"
    if dtype.is_float:
        return float_literal(float(value))
    if dtype.scalar in ("uint", "ulong"):
        return f"{int(value)}u"
    return str(int(value))


def type_name(dtype: ir.DType) -> str:
    return f"__local {dtype.c_name}*" if dtype.local_pointer else dtype.c_name


def name_of(var: ir.Var) -> str:
    return var.name or f"{var.kind}{var.number}"


@dataclass(frozen=True)
class Storage:
    """How a kernel source holds textures: C templates of an argument's declaration (by role) and of a texel's
    read, write and window (by the argument's `key` field) of the argument's name {a}, number {i}, element type
    {e}, the texel's place {t}, the value {v}; a window's texels q, q + 1 as read {first}, {second}, and {q}, its
    first element {x} (q * 4 + s) and its shift {s}."""

    preamble: str
    places: bool  # texel t at its layout's int2 coordinate (TexelLayout.c_coord), else at index t
    key: str
    parameters: dict[str, str]
    loads: dict[str, str]
    stores: dict[str, str]
    windows: dict[str, str]
    params_tail: str = ""  # after the arguments, and the body's first lines (the trace's, in image storage)
    prologue: tuple[str, ...] = ()
    real_preamble: str = REAL_PREAMBLE  # what a source with half kernels adds to `preamble`
    #: element {x} of an argument read as its own scalar where the storage addresses elements (a buffer's floats):
    #: lane x & 3 of texel x >> 2 without loading the texel and picking its lane at run time (lane_f)
    elements: dict[str, str] = field(default_factory=dict)
    #: whether a work-group stages the texels its work-items share in __local (ir.Stage, Load.staged): images,
    #: whose reads PoCL runs in software (a function call a texel), not buffers, whose loads are memory reads
    stages: bool = False
    #: after a function's parameters (render_function), and after a call's arguments ({i}: Invoke.inputs_from)
    function_tail: str = ""
    call_tail: str = ""


#: read_imagef, write_imageui...; read_imager / write_imager: the preamble's read_imageh where real is half
IMAGE_SUFFIXES = {"float": "f", "int": "i", "uint": "ui", "real": "r"}
#: image2d_t textures, what phones run (kernels.cl); under FBLC_TRACE each read also records its place (NOTE)
IMAGE = Storage(PREAMBLE, True, "kind", {"in": "read_only image2d_t {a}", "out": "write_only image2d_t {a}"},
                {k: f"read_image{s}({{a}}, SMP, NOTE({{i}}, {{t}}))" for k, s in IMAGE_SUFFIXES.items()},
                {k: f"write_image{s}({{a}}, {{t}}, {{v}})" for k, s in IMAGE_SUFFIXES.items()},
                {"float": "window4({first}, {second}, {s})", "real": "window4_r({first}, {second}, {s})"},
                " TRACE_PARAM", ("TRACE_INIT",), REAL_IMAGE_PREAMBLE, stages=True, function_tail=" TRACE_FN_PARAM",
                call_tail=" TRACE_ARGS({i})")
#: __global buffers of texels in index order (kernels.buffer.cl: LocalRunner's storage "buffer", for a CPU's OpenCL,
#: whose images are software), by element type: fp16 4 halfs a texel, a mask a byte (lane x of an image's uint4);
#: a half kernel's ("real:" element) converts each texel it reads to real4 and each it writes back
_BUFFER_LOADS = {"float4": "{a}[{t}]", "half": "vload_half4({t}, {a})"}
_BUFFER_STORES = {"float4": "{a}[{t}] = {v}", "half": "vstore_half4_rte({v}, {t}, {a})"}
# one unaligned load (LocalRunner leaves a texel of slack past each buffer)
# at element {x} (= {q} * 4 + {s}): the address as one sum, which PoCL's vectoriser turns into far simpler loads than
# the texel's and shift's (ViT's attention scores over 65 tokens: 0.21 -> 0.17 ms a launch)
_BUFFER_WINDOWS = {"float4": "vload4(0, (__global const float*){a} + {x})", "half": "vload_half4(0, {a} + {x})"}
BUFFER = Storage(BUFFER_PREAMBLE, False, "stored_as",
                 {"in": "__global const {e}* restrict {a}", "out": "__global {e}* restrict {a}"},
                 {**_BUFFER_LOADS, "int4": "{a}[{t}]", "uchar": "(uint4)({a}[{t}], 0u, 0u, 0u)",
                  **{f"real:{e}": f"convert_real4({load})" for e, load in _BUFFER_LOADS.items()}},
                 {**_BUFFER_STORES, "int4": "{a}[{t}] = {v}", "uchar": "{a}[{t}] = (uchar)(({v}).x)",
                  **{f"real:{e}": store.replace("{v}", "convert_float4({v})") for e, store in _BUFFER_STORES.items()}},
                 {**_BUFFER_WINDOWS, **{f"real:{e}": f"convert_real4({w})" for e, w in _BUFFER_WINDOWS.items()}},
                 elements={"float4": "((__global const float*){a})[{x}]"})


def _split(e: ir.Expr, op: str, value: int) -> bool:
    """Whether `e` is `x op value` (an element index's texel, x >> 2, or lane, x & 3)."""
    return isinstance(e, ir.Binary) and e.op == op and isinstance(e.b, ir.Const) and e.b.value == value


class Renderer:
    """Renders one kernel (or one expression) to C for `storage`; `folded` holds the values inlined into
    their reader."""

    def __init__(self, folded: dict[ir.Var, ir.Expr] | None = None, storage: Storage = IMAGE,
                 inputs_from: str = "") -> None:
        self.folded = folded or {}
        self.storage = storage
        self.inputs_from = inputs_from  # C added to an input's number (a function's: the launch's number of its in0)

    def texture(self, templates: dict[str, str], a: ir.Argument, texel: str = "", **more: str) -> str:
        """The storage's C of `templates` for argument `a` at texel index `texel` (C)."""
        place = a.layout.c_coord(texel) if self.storage.places and texel else texel  # type: ignore[attr-defined]
        return templates[getattr(a, self.storage.key)].format(a=a.name, i=f"{self.inputs_from}{a.index}", t=place,
                                                              **more)

    # expressions --------------------------------------------------------------------------------
    def expr(self, e: ir.Expr) -> str:
        return getattr(self, "_" + type(e).__name__)(e)

    def _Const(self, e: ir.Const) -> str:
        return literal(e.value, e.dtype)

    def _Var(self, e: ir.Var) -> str:
        if e in self.folded:
            return self.expr(self.folded[e])
        return name_of(e)

    def _Binary(self, e: ir.Binary) -> str:
        return f"({self.expr(e.a)} {e.op} {self.expr(e.b)})"

    def _Unary(self, e: ir.Unary) -> str:
        return f"({e.op}{self.expr(e.a)})"

    def _Call(self, e: ir.Call) -> str:
        if e.function == "WINDOW":  # an emitter's texel window: WINDOW(argument, first, second, q, x, s)
            parts = dict(zip(("first", "second", "q", "x", "s"), map(self.expr, e.args[1:])))
            return self.texture(self.storage.windows, e.args[0].argument, **parts)  # type: ignore[attr-defined]
        return f"{e.function}({', '.join(self.expr(a) for a in e.args)})"

    def _Select(self, e: ir.Select) -> str:
        return f"({self.expr(e.condition)} ? {self.expr(e.if_true)} : {self.expr(e.if_false)})"

    def _Cast(self, e: ir.Cast) -> str:
        if e.dtype.lanes > 1 and e.a.dtype.lanes == e.dtype.lanes:  # vectors convert by function, not by C cast
            return f"convert_{e.dtype.c_name}({self.expr(e.a)})"
        return f"(({e.dtype.c_name}){self.expr(e.a)})"

    def _Vector(self, e: ir.Vector) -> str:
        return f"({e.dtype.c_name})({', '.join(self.expr(p) for p in e.parts)})"

    def _Lane(self, e: ir.Lane) -> str:
        element = self._element_read(e)
        if element is not None:
            return element
        vector = self.expr(e.vector)
        if isinstance(e.index, ir.Const):
            lane = int(e.index.value)
            return f"{vector}.{COMPONENTS[lane]}" if e.vector.dtype.lanes <= 4 else f"{vector}.s{lane:x}"
        return f"{LANE_FUNCTIONS[e.vector.dtype.scalar]}({vector}, {self.expr(e.index)})"

    def _element_read(self, e: ir.Lane) -> str | None:
        """`Lane(Load(a, x >> 2), x & 3)` as the storage's element read of x, where it has one."""
        vector = e.vector
        while isinstance(vector, ir.Var) and vector in self.folded:
            vector = self.folded[vector]
        if not (isinstance(vector, ir.Load) and _split(vector.texel, ">>", 2) and _split(e.index, "&", 3)):
            return None
        template = self.storage.elements.get(getattr(vector.argument, self.storage.key))
        x = self.expr(vector.texel.a)  # type: ignore[attr-defined]
        if template is None or x != self.expr(e.index.a):  # type: ignore[attr-defined]
            return None
        return template.format(a=vector.argument.name, x=x)

    def _Element(self, e: ir.Element) -> str:
        return f"{name_of(e.array)}[{self.expr(e.index)}]"

    def _StagedChoice(self, e: ir.StagedChoice) -> str:
        return self.expr(e.staged if self.storage.stages else e.plain)

    def _Load(self, e: ir.Load) -> str:
        if e.staged is not None and self.storage.stages:
            return self.expr(e.staged)
        return self.texture(self.storage.loads, e.argument, self.expr(e.texel))

    def _Swizzle(self, e: ir.Swizzle) -> str:
        if e.vector.dtype.lanes == 8 and e.count == 4:  # a float8's half
            return f"{self.expr(e.vector)}.{('lo', 'hi')[e.first // e.count]}"
        if e.vector.dtype.lanes > 4:  # a float16's quarter: .s0123, .s4567, .s89ab, .scdef
            return f"{self.expr(e.vector)}.s{''.join(f'{lane:x}' for lane in range(e.first, e.first + e.count))}"
        return f"{self.expr(e.vector)}.{COMPONENTS[e.first:e.first + e.count]}"

    def _ArgumentRef(self, e: ir.ArgumentRef) -> str:
        return e.argument.name

    def condition(self, e: ir.Expr) -> str:
        """A condition inside `if (..)` / `while (..)`: without the parentheses of its comparison, which
        clang reports around an `==` (-Wparentheses-equality) as compiler output."""
        while isinstance(e, ir.Var) and e in self.folded:
            e = self.folded[e]
        text = self.expr(e)
        return text[1:-1] if isinstance(e, ir.Binary) else text

    # statements ---------------------------------------------------------------------------------
    def statements(self, body: Sequence[ir.Statement], depth: int) -> list[str]:
        return [line for s in body for line in self.statement(s, depth)]

    def statement(self, s: ir.Statement, depth: int) -> list[str]:
        pad = INDENT * depth
        if isinstance(s, ir.Declare):
            if s.var in self.folded:
                return []
            init = f" = {self.expr(s.init)}" if s.init is not None else ""
            qualifier = "const " if s.const and not s.var.dtype.local_pointer else "volatile " if s.volatile else ""
            return [f"{pad}{qualifier}{type_name(s.var.dtype)} {name_of(s.var)}{init};"]
        if isinstance(s, ir.DeclareArray):
            length = self.expr(s.length) if isinstance(s.length, ir.Expr) else str(s.length)
            init = f" = {{{', '.join(self.expr(v) for v in s.init)}}}" if s.init else ""
            space = ("__local " if s.local else "") + ("const " if s.constant else "")
            return [f"{pad}{space}{s.var.dtype.c_name} {name_of(s.var)}[{length}]{init};"]
        if isinstance(s, ir.Assign):
            return [f"{pad}{self.expr(s.target)} {s.op} {self.expr(s.value)};"]
        if isinstance(s, ir.Store):
            return [f"{pad}{self.texture(self.storage.stores, s.argument, self.expr(s.texel), v=self.expr(s.value))};"]
        if isinstance(s, ir.For):
            return self._for(s, depth)
        if isinstance(s, ir.If):
            lines = [f"{pad}if ({self.condition(s.condition)}) {{"] + self.statements(s.then, depth + 1)
            if s.orelse:
                lines += [f"{pad}}} else {{"] + self.statements(s.orelse, depth + 1)
            return lines + [f"{pad}}}"]
        if isinstance(s, ir.WithFeature):  # the device compiler's choice: preprocessor lines
            return [f"{pad}#ifdef {FEATURE_MACROS[s.feature]}", *self.statements(s.then, depth),
                    f"{pad}#else", *self.statements(s.orelse, depth), f"{pad}#endif"]
        if isinstance(s, ir.Stage):
            return self.statements(s.then, depth) if self.storage.stages else []
        if isinstance(s, ir.Invoke):
            arguments = ", ".join(self.expr(a) for a in s.arguments)
            return [f"{pad}{s.function}({arguments}{self.storage.call_tail.format(i=s.inputs_from)});"]
        if isinstance(s, ir.While):
            return [f"{pad}while ({self.condition(s.condition)}) {{", *self.statements(s.body, depth + 1), f"{pad}}}"]
        return [pad + {ir.Break: "break;", ir.Return: "return;",
                       ir.Barrier: "barrier(CLK_LOCAL_MEM_FENCE);"}[type(s)]]

    def _for(self, s: ir.For, depth: int) -> list[str]:
        pad, name = INDENT * depth, name_of(s.var)
        condition = self.expr(s.condition) if s.condition is not None else f"{name} < {self.expr(s.stop)}"
        step = f"++{name}" if (s.step, s.step_op) == (1, "+=") else f"{name} {s.step_op} {s.step}"
        head = [f"{pad}#pragma unroll"] if s.unroll else []
        return head + [f"{pad}for (int {name} = {self.expr(s.start)}; {condition}; {step}) {{"] + \
            self.statements(s.body, depth + 1) + [f"{pad}}}"]


def _parameter(storage: Storage, a: ir.Argument, aliased: frozenset[str]) -> str:
    """Argument `a` in the kernel's signature; without `restrict` where the launch binds another argument's
    texture to it too (an update in place): C may not assume two aliasing pointers apart."""
    text = storage.parameters[a.role].format(a=a.name, e=a.element)
    return text.replace(" restrict", "") if a.name in aliased else text


def render_kernel(kernel: ir.KernelIR, storage: Storage = IMAGE, folds: dict[ir.Var, ir.Expr] | None = None,
                  prologue: bool = True) -> str:
    """The __kernel's C for `storage`: its texture arguments, then its body (`folds`: its `foldable`, if known);
    without the storage's prologue where the body only calls functions that have theirs (`prologue` false)."""
    params = ", ".join(_parameter(storage, a, kernel.aliased) for a in kernel.arguments)
    folds = foldable(kernel.body) if folds is None else folds
    body = [INDENT + line for line in (storage.prologue if prologue else ())]
    body += Renderer(folds, storage).statements(kernel.body, 1)
    # a kernel written for one work-group size says so: the driver may then size registers and __local for it
    size = f"__attribute__((reqd_work_group_size({kernel.group_size}, 1, 1))) " if kernel.group_size else ""
    return "\n".join([f"{size}__kernel void {kernel.name}({params}{storage.params_tail}) {{", *body, "}"])


def render_function(function: ir.KernelIR, values: Sequence[ir.Var], arrays: Sequence[ir.Var],
                    storage: Storage = IMAGE) -> str:
    """A function (not a __kernel) of `function`'s body that __kernels call (ir.Invoke): its texture arguments,
    then `values` (const), then its __local `arrays` as pointers (OpenCL C declares __local only in a __kernel),
    then the storage's function tail (a trace's buffers and the caller's number of the function's input 0);
    `inline __attribute__((always_inline))` where it is `inlined` (as the layouts' coordinate functions)."""
    # an inlined one's pointers without `restrict`: its __kernel's carry it, and clang's inliner declares a scope
    # for each restrict one (llvm.experimental.noalias.scope.decl), which oclgrind 21.10 cannot run
    aliased = frozenset(a.name for a in function.arguments) if function.inlined else function.aliased
    params = [_parameter(storage, a, aliased) for a in function.arguments]
    params += [f"const {v.dtype.c_name} {name_of(v)}" for v in values]
    params += [f"__local {v.dtype.c_name}* {name_of(v)}" for v in arrays]
    renderer = Renderer(foldable(function.body), storage, "fblc_in0 + ")
    body = [INDENT + line for line in storage.prologue] + renderer.statements(function.body, 1)
    head = "inline __attribute__((always_inline)) void" if function.inlined else "void"
    return "\n".join([f"{head} {function.name}({', '.join(params)}{storage.function_tail}) {{", *body, "}"])


def foldable(body: Sequence[ir.Statement]) -> dict[ir.Var, ir.Expr]:
    """Const values to inline: read once, by a reader in the same loop, and reading nothing that changes."""
    changing = {s.var for s in ir.walk(body) if isinstance(s, ir.DeclareArray)
                or (isinstance(s, ir.Declare) and not s.const)}
    uses: Counter[ir.Var] = Counter()
    use_loop: dict[ir.Var, int] = {}
    decl_loop: dict[ir.Var, int] = {}
    inits: dict[ir.Var, ir.Expr] = {}
    loops = 0

    def visit(statements: Sequence[ir.Statement]) -> None:
        nonlocal loops
        for s in statements:
            if isinstance(s, ir.Declare) and s.const and s.init is not None:
                decl_loop[s.var], inits[s.var] = loops, s.init
            for sub in _vars_read(ir.statement_exprs(s)):
                uses[sub] += 1
                use_loop[sub] = loops
            inner = isinstance(s, (ir.For, ir.While))
            loops += inner
            for block in ir.nested(s):
                visit(block)
            loops -= inner

    visit(body)
    folded = {}
    for var, init in inits.items():
        if var.name or uses[var] != 1 or use_loop.get(var) != decl_loop[var]:
            continue
        reads = list(ir.walk_expr(init))
        if any(isinstance(e, ir.Element) or (isinstance(e, ir.Var) and e in changing) for e in reads):
            continue
        folded[var] = init
    return folded


def _vars_read(exprs: Sequence[ir.Expr]) -> list[ir.Var]:
    """Each Var in `exprs`, once per occurrence (ir.walk_expr's nodes, in another order): foldable visits every
    expression of a kernel, and a stack without a generator per node costs a third of the walk."""
    found: list[ir.Var] = []
    stack = list(exprs)
    while stack:
        node = stack.pop()
        kind = type(node)
        if kind is ir.Var:
            found.append(node)  # type: ignore[arg-type]
        elif kind is not ir.Const:
            for value in vars(node).values():
                if isinstance(value, ir.Expr):
                    stack.append(value)
                elif isinstance(value, tuple):
                    stack.extend(value)
    return found
