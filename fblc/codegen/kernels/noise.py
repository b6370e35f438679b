"""Counter-based random numbers on the device: the noise of evolution strategies (pass es_noise).

PhiloxNormal makes member row `row` (or the row its second input holds: ES members in a loop) of the noise where
it is read; PhiloxWeightedSum sums weighted rows, each
made again in the kernel; both as `fblc.compiler.philox.es_noise` computes them; docs/ARCHITECTURE.md §2.
"""

from __future__ import annotations

import onnx_ir as ir

from fblc.codegen.builder import KernelBuilder
from fblc.codegen.ir import FLOAT, INT, UINT, Block, Element, Expr, Var, call, const
from fblc.codegen.kernels import lane_kernel
from fblc.compiler.philox import MULTIPLIERS, ROUNDS, WEYL, seed_key
from fblc.compiler.values import attr, static_shape

FAMILY = "random"
#: 2^-24: a 24-bit integer to a float in [0, 1), exactly
UNIT = const(2.0 ** -24, FLOAT)
TWO_PI = const(6.283185307179586, FLOAT)


def _u(value: int) -> Expr:
    return const(value, UINT)


def _normals(block: Block, t: Var, seed: int, iteration: Expr, row: Expr) -> Var:
    """Build into `block` texel t's four normals of member row `row`, left in a float[4]; returns it."""
    key_low, key_high = seed_key(seed)
    c = [block.mutable(word.cast(UINT), "c") for word in (t, iteration, row, _u(0))]
    k0, k1 = block.mutable(_u(key_low), "k"), block.mutable(_u(key_high), "k")
    with block.loop("step", 0, ROUNDS) as (step, rounds):
        with rounds.when(step.ne(0)) as bump:
            bump.assign(k0, _u(WEYL[0]), "+=")
            bump.assign(k1, _u(WEYL[1]), "+=")
        hi0 = rounds.let(call("mul_hi", _u(MULTIPLIERS[0]), c[0]), "hi")
        hi1 = rounds.let(call("mul_hi", _u(MULTIPLIERS[1]), c[2]), "hi")
        rounds.assign(c[0], _u(MULTIPLIERS[0]), "*=")
        rounds.assign(c[2], _u(MULTIPLIERS[1]), "*=")
        mixed0 = rounds.let(hi1 ^ c[1] ^ k0, "w")
        mixed2 = rounds.let(hi0 ^ c[3] ^ k1, "w")
        for target, value in ((c[3], c[0]), (c[1], c[2]), (c[0], mixed0), (c[2], mixed2)):
            rounds.assign(target, value)
    normal = block.array("noise", FLOAT, 4)
    for lane, (radius_word, angle_word) in ((0, (c[0], c[1])), (2, (c[2], c[3]))):
        uniform = ((radius_word >> 8) + 1).cast(FLOAT) * UNIT
        radius = block.let(call("sqrt", const(-2.0, FLOAT) * call("log", uniform)), "radius")
        angle = block.let(TWO_PI * ((angle_word >> 8).cast(FLOAT) * UNIT), "angle")
        block.assign(Element(normal, const(lane)), radius * call("cos", angle))
        block.assign(Element(normal, const(lane + 1)), radius * call("sin", angle))
    return normal


@lane_kernel(FAMILY, "PhiloxNormal")
def emit_philox_normal(b: KernelBuilder, node: ir.Node) -> list[Expr]:
    iteration = b.element(node.inputs[0], const(0))
    # the row: a second input (a member loop's row index, es_loop), else the `row` attribute
    row = b.element(node.inputs[1], const(0)) if len(node.inputs) > 1 else const(int(attr(node, "row", 0)), INT)
    normal = _normals(b.prologue, b.t, int(attr(node, "seed", 0)), iteration, row)
    return [Element(normal, b.lane)]


@lane_kernel(FAMILY, "PhiloxWeightedSum")
def emit_philox_weighted_sum(b: KernelBuilder, node: ir.Node) -> list[Expr]:
    weights, iteration = node.inputs[0], node.inputs[1]
    prologue = b.prologue
    total = prologue.array("total", FLOAT, 4, (0.0,) * 4)
    with prologue.loop("row", 0, static_shape(weights)[-1]) as (row, member):
        normal = _normals(member, b.t, int(attr(node, "seed", 0)), b.element(iteration, const(0)), row)
        weight = member.let(b.element(weights, row), "weight")
        with member.loop("k", 0, 4) as (k, lanes):
            lanes.assign(Element(total, k), weight * Element(normal, k), "+=")
    return [Element(total, b.lane)]
