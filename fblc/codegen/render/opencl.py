"""The renderer: kernel IR to OpenCL C, the one place that writes C.

It names each variable by its kind and number (`acc12`; the few names shared with the host or
the preamble are fixed), maps each IR operation to C in one table, and folds a const value read
exactly once into its reader when that keeps its meaning: the value reads nothing that changes
(no array element, no variable assigned again) and its reader runs as often as it would
(the same loop, not a loop inside). Texture arguments, reads and writes are a storage's
(ImageStorage: image2d_t at the texture layout's coordinate, kernels.cl; BufferStorage: __global
buffers indexed by the texel, kernels.buffer.cl): one kernel IR renders to either.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Sequence

import numpy as np

from fblc.codegen import ir
from fblc.codegen.render.preamble import BUFFER_PREAMBLE, PREAMBLE

COMPONENTS = "xyzw"
LANE_FUNCTIONS = {"float": "lane_f", "int": "lane_i", "uint": "lane_i"}
IMAGE_SUFFIXES = {"float": "f", "int": "i", "uint": "ui"}  # read_imagef, write_imageui...
#: a texel's read and write in a buffer, by the buffer's element type (bundle_format.BUFFER_C_TYPES): fp16
#: storage holds 4 halfs a texel, a mask a byte a texel (lane x of the uint4 an image read gives)
BUFFER_LOADS = {"float4": "{a}[{t}]", "int4": "{a}[{t}]", "half": "vload_half4({t}, {a})",
                "uchar": "(uint4)({a}[{t}], 0u, 0u, 0u)"}
BUFFER_STORES = {"float4": "{a}[{t}] = {v}", "int4": "{a}[{t}] = {v}", "half": "vstore_half4_rte({v}, {t}, {a})",
                 "uchar": "{a}[{t}] = (uchar)(({v}).x)"}
#: elements s..s+3 from texel q of a float buffer: one unaligned load (LocalRunner leaves a texel of slack)
BUFFER_WINDOWS = {"float4": "vload4(0, (__global const float*){a} + {q} * 4 + {s})",
                  "half": "vload_half4(0, {a} + {q} * 4 + {s})"}
INDENT = "  "


def float_literal(value: float) -> str:
    if math.isnan(value):
        return "NAN"
    if math.isinf(value):
        return "INFINITY" if value > 0 else "(-INFINITY)"
    text = repr(float(np.float32(value)))
    return f"{text}f" if ("." in text or "e" in text) else f"{text}.0f"


def literal(value: float | int | bool, dtype: ir.DType) -> str:
    if dtype.is_float:
        return float_literal(float(value))
    if dtype.scalar in ("uint", "ulong"):
        return f"{int(value)}u"
    return str(int(value))


def type_name(dtype: ir.DType) -> str:
    return f"__local {dtype.c_name}*" if dtype.local_pointer else dtype.c_name


def name_of(var: ir.Var) -> str:
    return var.name or f"{var.kind}{var.number}"


class ImageStorage:
    """Textures as image2d_t, what phones run (kernels.cl): texel t of an argument sits at its layout's int2
    coordinate (TexelLayout.c_coord); under FBLC_TRACE each read also records it (NOTE, fblc.runtime.trace)."""

    preamble, places, params_tail, prologue = PREAMBLE, True, " TRACE_PARAM", ("TRACE_INIT",)

    def parameter(self, a: ir.Argument) -> str:
        return f"{'read_only' if a.role == 'in' else 'write_only'} image2d_t {a.name}"

    def load(self, a: ir.Argument, texel: str) -> str:
        return f"read_image{IMAGE_SUFFIXES[a.kind]}({a.name}, SMP, NOTE({a.index}, {coord(a, texel)}))"

    def store(self, a: ir.Argument, texel: str, value: str) -> str:
        return f"write_image{IMAGE_SUFFIXES[a.kind]}({a.name}, {coord(a, texel)}, {value})"

    def window(self, a: ir.Argument, first: str, second: str, q: str, s: str) -> str:
        """window4 of texels q and q + 1 of `a`, already read as `first` and `second`."""
        return f"window4({first}, {second}, {s})"


class BufferStorage:
    """Textures as __global buffers of their texels in index order (kernels.buffer.cl, LocalRunner's storage
    "buffer": a CPU's OpenCL images are software): texel t is element t, whatever the layout."""

    preamble, places, params_tail, prologue = BUFFER_PREAMBLE, False, "", ()

    def parameter(self, a: ir.Argument) -> str:
        return f"__global {'const ' if a.role == 'in' else ''}{a.element}* restrict {a.name}"

    def load(self, a: ir.Argument, texel: str) -> str:
        return BUFFER_LOADS[a.element].format(a=a.name, t=texel)

    def store(self, a: ir.Argument, texel: str, value: str) -> str:
        return BUFFER_STORES[a.element].format(a=a.name, t=texel, v=value)

    def window(self, a: ir.Argument, first: str, second: str, q: str, s: str) -> str:
        return BUFFER_WINDOWS[a.element].format(a=a.name, q=q, s=s)


Storage = ImageStorage | BufferStorage
IMAGE, BUFFER = ImageStorage(), BufferStorage()


def coord(argument: ir.Argument, texel: str) -> str:
    """The int2 place of texel `texel` (C) of an image argument: its layout's."""
    return argument.layout.c_coord(texel)  # type: ignore[attr-defined,no-any-return]


class Renderer:
    """Renders one kernel (or one expression) to C for `storage`; `folded` holds the values inlined into
    their reader."""

    def __init__(self, folded: dict[ir.Var, ir.Expr] | None = None, storage: Storage = IMAGE) -> None:
        self.folded = folded or {}
        self.storage = storage

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
        if e.function == "WINDOW":  # elements s..s+3 of texels q, q + 1 (emitters' texel windows)
            return self.storage.window(e.args[0].argument, *map(self.expr, e.args[1:]))  # type: ignore[attr-defined]
        return f"{e.function}({', '.join(self.expr(a) for a in e.args)})"

    def _Select(self, e: ir.Select) -> str:
        return f"({self.expr(e.condition)} ? {self.expr(e.if_true)} : {self.expr(e.if_false)})"

    def _Cast(self, e: ir.Cast) -> str:
        return f"(({e.dtype.c_name}){self.expr(e.a)})"

    def _Vector(self, e: ir.Vector) -> str:
        return f"({e.dtype.c_name})({', '.join(self.expr(p) for p in e.parts)})"

    def _Lane(self, e: ir.Lane) -> str:
        vector = self.expr(e.vector)
        if isinstance(e.index, ir.Const):
            lane = int(e.index.value)
            return f"{vector}.{COMPONENTS[lane]}" if e.vector.dtype.lanes <= 4 else f"{vector}.s{lane:x}"
        return f"{LANE_FUNCTIONS[e.vector.dtype.scalar]}({vector}, {self.expr(e.index)})"

    def _Element(self, e: ir.Element) -> str:
        return f"{name_of(e.array)}[{self.expr(e.index)}]"

    def _Load(self, e: ir.Load) -> str:
        return self.storage.load(e.argument, self.expr(e.texel))

    def _Swizzle(self, e: ir.Swizzle) -> str:
        if e.vector.dtype.lanes == 8:  # a float8's half
            return f"{self.expr(e.vector)}.{('lo', 'hi')[e.first // e.count]}"
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
            return [f"{pad}{'const ' if s.const and not s.var.dtype.local_pointer else ''}{type_name(s.var.dtype)} "
                    f"{name_of(s.var)}{init};"]
        if isinstance(s, ir.DeclareArray):
            length = self.expr(s.length) if isinstance(s.length, ir.Expr) else str(s.length)
            init = f" = {{{', '.join(self.expr(v) for v in s.init)}}}" if s.init else ""
            space = ("__local " if s.local else "") + ("const " if s.constant else "")
            return [f"{pad}{space}{s.var.dtype.c_name} {name_of(s.var)}[{length}]{init};"]
        if isinstance(s, ir.Assign):
            return [f"{pad}{self.expr(s.target)} {s.op} {self.expr(s.value)};"]
        if isinstance(s, ir.Store):
            return [f"{pad}{self.storage.store(s.argument, self.expr(s.texel), self.expr(s.value))};"]
        if isinstance(s, ir.Evaluate):
            return [f"{pad}{self.expr(s.expr)};"]
        if isinstance(s, ir.For):
            return self._for(s, depth)
        if isinstance(s, ir.If):
            lines = [f"{pad}if ({self.condition(s.condition)}) {{"] + self.statements(s.then, depth + 1)
            if s.orelse:
                lines += [f"{pad}}} else {{"] + self.statements(s.orelse, depth + 1)
            return lines + [f"{pad}}}"]
        if isinstance(s, ir.While):
            return [f"{pad}while ({self.condition(s.condition)}) {{"] + self.statements(s.body, depth + 1) + [f"{pad}}}"]
        return [pad + {ir.Break: "break;", ir.Return: "return;",
                       ir.Barrier: "barrier(CLK_LOCAL_MEM_FENCE);"}[type(s)]]

    def _for(self, s: ir.For, depth: int) -> list[str]:
        pad, name = INDENT * depth, name_of(s.var)
        condition = self.expr(s.condition) if s.condition is not None else f"{name} < {self.expr(s.stop)}"
        step = f"++{name}" if (s.step, s.step_op) == (1, "+=") else f"{name} {s.step_op} {s.step}"
        head = [f"{pad}#pragma unroll"] if s.unroll else []
        return head + [f"{pad}for (int {name} = {self.expr(s.start)}; {condition}; {step}) {{"] + \
            self.statements(s.body, depth + 1) + [f"{pad}}}"]


def render_kernel(kernel: ir.KernelIR, storage: Storage = IMAGE) -> str:
    """The __kernel's C for `storage`: its texture arguments, then its body."""
    params = ", ".join(storage.parameter(a) for a in kernel.arguments)
    body = [INDENT + line for line in storage.prologue] + Renderer(foldable(kernel.body), storage).statements(
        kernel.body, 1)
    return "\n".join([f"__kernel void {kernel.name}({params}{storage.params_tail}) {{", *body, "}"])


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
            for e in ir.statement_exprs(s):
                for sub in ir.walk_expr(e):
                    if isinstance(sub, ir.Var):
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
