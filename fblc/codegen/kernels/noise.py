"""Counter-based random numbers on the device: the noise of evolution strategies.

Pass es_noise puts these where the ONNX step reads its `noise` input [P, D], so no noise crosses
the bus and no [P, D] tensor is stored (attribute `seed`; input 0 the iteration count, which
lives on the device):

- PhiloxNormal(iteration) -> [1, D]: member row `row` of the noise, made where it is read;
- PhiloxWeightedSum(weights [1, P], iteration) -> [1, D]: sum_i weights[i] * noise row i (the ES
  direction), each row made again inside the kernel.

Output texel t of row i is one Philox4x32-10 call on counter (t, iteration, i, 0) under key
(seed low, seed high) and two Box-Muller pairs, exactly as `fblc.compiler.philox.es_noise`
computes it: the words are integer arithmetic (mul_hi and a 32-bit product), so they equal
numpy's bit for bit; the normals differ by the device's rounding of log, sqrt, sin and cos.
"""

from __future__ import annotations

from fblc.codegen.builder import KernelBuilder
from fblc.codegen.cl import Kernel
from fblc.codegen.kernels import KernelGroup, register_kernel
from fblc.codegen.textures import TextureTable
from fblc.compiler.philox import MULTIPLIERS, ROUNDS, WEYL, seed_key
from fblc.compiler.values import attr, static_shape

FAMILY = "random"
#: 2^-24: a 24-bit integer to a float in [0, 1), exactly
UNIT = "5.9604644775390625e-08f"


def _builder(table: TextureTable, group: KernelGroup) -> KernelBuilder:
    b = KernelBuilder(table, group.name, FAMILY, group.outputs)
    b.nodes.append(group.anchor.name)
    return b


def _normals(b: KernelBuilder, seed: int, iteration: str, row: str) -> tuple[list[str], str]:
    """Lines that leave texel t's four normals of member row `row` (a C expression) in a float[4]; its name."""
    key_low, key_high = seed_key(seed)
    c = [b.fresh("c") for _ in range(4)]
    k0, k1, step, hi0, hi1, mixed0, mixed2 = (b.fresh(h) for h in ("k", "k", "step", "hi", "hi", "w", "w"))
    normal = b.fresh("noise")
    lines = [
        f"uint {c[0]} = (uint)t, {c[1]} = (uint)({iteration}), {c[2]} = (uint)({row}), {c[3]} = 0u;",
        f"uint {k0} = {key_low}u, {k1} = {key_high}u;",
        f"for (int {step} = 0; {step} < {ROUNDS}; ++{step}) {{",
        f"  if ({step}) {{ {k0} += {WEYL[0]}u; {k1} += {WEYL[1]}u; }}",
        f"  const uint {hi0} = mul_hi({MULTIPLIERS[0]}u, {c[0]}), {hi1} = mul_hi({MULTIPLIERS[1]}u, {c[2]});",
        f"  {c[0]} *= {MULTIPLIERS[0]}u; {c[2]} *= {MULTIPLIERS[1]}u;",
        f"  const uint {mixed0} = {hi1} ^ {c[1]} ^ {k0}, {mixed2} = {hi0} ^ {c[3]} ^ {k1};",
        f"  {c[3]} = {c[0]}; {c[1]} = {c[2]}; {c[0]} = {mixed0}; {c[2]} = {mixed2};",
        "}",
        f"float {normal}[4];",
    ]
    for lane, (radius_word, angle_word) in ((0, (c[0], c[1])), (2, (c[2], c[3]))):
        radius, angle = b.fresh("radius"), b.fresh("angle")
        lines += [f"const float {radius} = sqrt(-2.0f * log((float)(({radius_word} >> 8) + 1u) * {UNIT}));",
                  f"const float {angle} = 6.283185307179586f * ((float)({angle_word} >> 8) * {UNIT});",
                  f"{normal}[{lane}] = {radius} * cos({angle});",
                  f"{normal}[{lane + 1}] = {radius} * sin({angle});"]
    return lines, normal


@register_kernel("PhiloxNormal")
def emit_philox_normal(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    node = group.anchor
    b = _builder(table, group)
    lines, normal = _normals(b, int(attr(node, "seed", 0)), b.load(node.inputs[0], "0"), str(int(attr(node, "row", 0))))
    b.emit_texel(*lines)
    return [b.finish([f"{normal}[lane]"])]


@register_kernel("PhiloxWeightedSum")
def emit_philox_weighted_sum(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    node = group.anchor
    weights, iteration = node.inputs[0], node.inputs[1]
    b = _builder(table, group)
    row, total, weight, k = b.fresh("row"), b.fresh("total"), b.fresh("weight"), b.fresh("k")
    lines, normal = _normals(b, int(attr(node, "seed", 0)), b.load(iteration, "0"), row)
    b.emit_texel(f"float {total}[4] = {{0.0f, 0.0f, 0.0f, 0.0f}};",
                 f"for (int {row} = 0; {row} < {static_shape(weights)[-1]}; ++{row}) {{",
                 *[f"  {line}" for line in lines],
                 f"  const float {weight} = {b.load(weights, row)};",
                 f"  for (int {k} = 0; {k} < 4; ++{k}) {total}[{k}] += {weight} * {normal}[{k}];",
                 "}")
    return [b.finish([f"{total}[lane]"])]
