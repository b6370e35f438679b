"""The kernel IR and its renderer, without building kernels: which values the renderer folds into
their reader, kernel de-duplication by equal IR, ratchets on the C text left outside the renderer, and where
a step's kernels read a scalar input."""

from __future__ import annotations

import ast
import os
import re

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from fblc.codegen import ir as kir
from fblc.codegen.cl import Kernel
from fblc.codegen.ir import FLOAT, INT, Block, Numbering, const
from fblc.codegen.plan import share_kernels
from fblc.codegen.render.opencl import foldable, render_kernel
from fblc.compiler.optimizers import OptimizerConfig
from fblc.passes.pipeline import TrainingOptions
from fblc.texel_layout import flat_layout
from tests.support.kernel_ir import lowered_kernels

CODEGEN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fblc", "codegen")


#: what a C fragment looks like (the regex of /work/shared/tools/ctext.py)
C_TEXT = re.compile(r"read_image|write_image|__kernel|__local|__global|barrier\(|vload|vstore|"
                    r"\b(?:float|half|int|uint)[248]?\s+\w+\s*(?:=|\[|;)|;\s*(?:$|\\n)|\{\s*(?:$|\\n)|\bfor\s*\(")


def _argument(role: str, index: int) -> kir.Argument:
    return kir.Argument(role, index, "float", "float4", flat_layout(4, 64))


def _scale_kernel(name: str, factor: float) -> kir.KernelIR:
    """out0[t] = in0[t] * factor: a kernel built the same way whatever its name."""
    block = Block(Numbering())
    t = block.let(kir.call("get_global_id", 0, dtype=INT), "t")
    value = block.let(kir.Load(_argument("in", 0), t) * factor, "v")
    block.add(kir.Store(_argument("out", 0), t, value))
    return kir.KernelIR(name, [_argument("out", 0), _argument("in", 0)], block.statements)


def test_a_value_read_once_folds_into_its_reader() -> None:
    block = Block(Numbering())
    x = block.let(kir.call("get_global_id", 0, dtype=INT), "x")
    once = block.let(x * 2 + 1, "once")
    block.add(kir.Store(_argument("out", 0), x, kir.vector(kir.FLOAT4, once.cast(FLOAT), 0.0, 0.0, 0.0)))
    folded = foldable(block.statements)
    assert folded.get(once) == x * 2 + 1
    assert x not in folded  # read twice
    text = render_kernel(kir.KernelIR("k", [_argument("out", 0)], block.statements))
    assert "once" not in text and "((x100 * 2) + 1)" in text, text


def test_a_value_read_twice_in_a_deeper_loop_or_reading_what_changes_stays() -> None:
    block = Block(Numbering())
    twice = block.let(kir.call("get_global_id", 0, dtype=INT), "twice")
    hoisted = block.let(twice * 3, "hoisted")  # read once, but inside a loop: computed once, not per trip
    acc = block.mutable(const(0.0, FLOAT), "acc")
    array = block.array("a", FLOAT, 4, (0.0,) * 4)
    of_acc = block.let(acc + 1.0, "ofacc")  # reads a variable assigned again later
    of_array = block.let(kir.Element(array, const(1)) * 2.0, "ofarray")  # reads an array element
    with block.loop("k", 0, 4) as (k, body):
        body.assign(acc, (hoisted + k).cast(FLOAT), "+=")
    block.assign(kir.Element(array, twice), of_acc + of_array)
    folded = foldable(block.statements)
    assert not {twice, hoisted, of_acc, of_array} & set(folded), folded


def test_kernels_built_alike_are_equal_ir_and_share_one_function() -> None:
    same, other = _scale_kernel("k1", 2.0), _scale_kernel("k2", 2.0)
    different = _scale_kernel("k3", 3.0)
    assert (same.arguments, same.body) == (other.arguments, other.body)
    assert same.body != different.body
    # after k3 the group (same arguments) has two bodies: later kernels are found among those of their hash
    later = [_scale_kernel("k4", 2.0), _scale_kernel("k5", 3.0), _scale_kernel("k6", 4.0), _scale_kernel("k7", 4.0)]
    kernels = [Kernel(ir.name, "elementwise", ir, 1) for ir in (same, other, different, *later)]
    share_kernels(kernels)
    assert [k.function for k in kernels] == ["k1", "k1", "k3", "k1", "k3", "k6", "k6"]
    assert [k.twin for k in kernels] == ["k1", "k1", "k3", "k1", "k3", "k6", "k6"]


def _sources() -> list[tuple[str, ast.Module]]:
    found = []
    for directory, _, files in os.walk(CODEGEN):
        for name in files:
            path = os.path.join(directory, name)
            if name.endswith(".py") and "render" not in os.path.relpath(path, CODEGEN):
                with open(path) as handle:
                    found.append((path, ast.parse(handle.read())))
    return found


def _c_literals(tree: ast.Module) -> int:
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return sum(1 for node in ast.walk(tree) if id(node) not in docstrings and isinstance(node, ast.Constant)
               and isinstance(node.value, str) and C_TEXT.search(node.value))


def test_no_c_text_outside_the_renderer() -> None:
    """Emitters build IR; only fblc/codegen/render writes C: a string literal that looks like C anywhere
    else in fblc/codegen fails, naming its file."""
    counts = {path: _c_literals(tree) for path, tree in _sources()}
    assert not {path: n for path, n in counts.items() if n}, f"string literals of C outside fblc/codegen/render: " \
        f"{ {os.path.relpath(path, CODEGEN): n for path, n in counts.items() if n} }"


def test_the_c_text_check_can_fail() -> None:
    """The check itself: an emitter line that writes C is found, prose and IR are not."""
    emitter = ast.parse('b.emit(f"const int {name} = {value};")\nlines = ["for (int k = 0; k < 4; ++k) {"]\n'
                        'note = "one kernel per group"\nvalue = call("fmax", a, b)')
    assert _c_literals(emitter) == 2




def _loads_in_loops(body: list[kir.Statement], loops: frozenset[str] = frozenset()
                    ) -> list[tuple[kir.Load, frozenset[str]]]:
    """Every Load of `body` with the names of the loops around it."""
    found = []
    for statement in body:
        if isinstance(statement, kir.Stage):
            continue
        for expr in kir.statement_exprs(statement):
            found += [(e, loops) for e in kir.walk_expr(expr) if isinstance(e, kir.Load)]
        inner = loops | {statement.var.name} if isinstance(statement, kir.For) else loops
        for nested in kir.nested(statement):
            found += _loads_in_loops(nested, inner)
    return found


def test_a_scalar_read_by_every_output_element_is_read_once_per_work_item(tmp_path) -> None:
    """AdamW's learning rate and bias correction (graph inputs, never literals) broadcast to a 1x1 conv's
    weight gradient, whose last axis (1) puts a texel's lanes in different rows: each is read once per
    work-item, before its texel and lane loops (in image storage each read is a call; MobileNetV2's fused
    updates read them 64 times a work-item), on a CPU's tile of texels and a phone's alike."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((16, 8, 1, 1)).astype(np.float32), "w")
    # a loss of y * y: the weight gradient's dy a whole tensor (a mean of y itself, dy one broadcast element, is
    # test_kernels_contraction's conv1x1_weight_grads_of_a_mean)
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"]), helper.make_node("Mul", ["y", "y"], ["y2"]),
             helper.make_node("ReduceMean", ["y2"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "conv1x1", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8, 6, 6])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [w])
    path = str(tmp_path / "conv1x1.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    options = TrainingOptions(loss="output", optimizer=OptimizerConfig("adamw", lr=1e-3))
    for target in ("local", "adreno830"):
        kernels = lowered_kernels(path, target, "fp32", options)
        scalar_reads = [(kernel.name, loops) for kernel in kernels for load, loops in _loads_in_loops(kernel.ir.body)
                        if not [e for e in kir.walk_expr(load.texel) if isinstance(e, kir.Var)]]
        assert scalar_reads, target  # the update reads its scalars somewhere
        assert all(not loops & {"tt", "rr", "tc", "lane"} for _, loops in scalar_reads), (target, scalar_reads)
