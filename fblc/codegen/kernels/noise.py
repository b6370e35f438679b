"""Counter-based random numbers on the device: PhiloxNormal, the noise of evolution strategies.

PhiloxNormal(iteration) -> [shape] standard normals (attributes `seed`, `shape`), the op that
pass es_noise puts where the ONNX step takes its `noise` input. Output texel t is one
Philox4x32-10 call on counter (t, iteration, 0, 0) under key (seed low, seed high) and two
Box-Muller pairs, exactly as `fblc.compiler.philox.es_noise` computes it: the words are
integer arithmetic (mul_hi and a 32-bit product), so they equal numpy's bit for bit; the
normals differ by the device's rounding of log, sqrt, sin and cos. Nothing but the seed and
the iteration count, which lives on the device, is needed: no noise crosses the bus.
"""

from __future__ import annotations

from fblc.codegen.builder import KernelBuilder
from fblc.codegen.cl import Kernel
from fblc.codegen.kernels import KernelGroup, register_kernel
from fblc.codegen.textures import TextureTable
from fblc.compiler.philox import MULTIPLIERS, ROUNDS, WEYL, seed_key
from fblc.compiler.values import attr

FAMILY = "random"
#: 2^-24: a 24-bit integer to a float in [0, 1), exactly
UNIT = "5.9604644775390625e-08f"


@register_kernel("PhiloxNormal")
def emit_philox_normal(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    node = group.anchor
    b = KernelBuilder(table, group.name, FAMILY, group.outputs)
    b.nodes.append(node.name)
    key_low, key_high = seed_key(int(attr(node, "seed", 0)))
    c = [b.fresh("c") for _ in range(4)]
    k0, k1, step, hi0, hi1, normal = b.fresh("k"), b.fresh("k"), b.fresh("step"), b.fresh("hi"), b.fresh("hi"), \
        b.fresh("noise")
    mixed0, mixed2 = b.fresh("w"), b.fresh("w")
    iteration = b.load(node.inputs[0], "0")
    b.emit_texel(
        f"uint {c[0]} = (uint)t, {c[1]} = (uint)({iteration}), {c[2]} = 0u, {c[3]} = 0u;",
        f"uint {k0} = {key_low}u, {k1} = {key_high}u;",
        f"for (int {step} = 0; {step} < {ROUNDS}; ++{step}) {{",
        f"  if ({step}) {{ {k0} += {WEYL[0]}u; {k1} += {WEYL[1]}u; }}",
        f"  const uint {hi0} = mul_hi({MULTIPLIERS[0]}u, {c[0]}), {hi1} = mul_hi({MULTIPLIERS[1]}u, {c[2]});",
        f"  {c[0]} *= {MULTIPLIERS[0]}u; {c[2]} *= {MULTIPLIERS[1]}u;",
        f"  const uint {mixed0} = {hi1} ^ {c[1]} ^ {k0}, {mixed2} = {hi0} ^ {c[3]} ^ {k1};",
        f"  {c[3]} = {c[0]}; {c[1]} = {c[2]}; {c[0]} = {mixed0}; {c[2]} = {mixed2};",
        "}",
        f"float {normal}[4];",
        *_box_muller(b, normal, 0, c[0], c[1]),
        *_box_muller(b, normal, 2, c[2], c[3]),
    )
    return [b.finish([f"{normal}[lane]"])]


def _box_muller(b: KernelBuilder, normal: str, lane: int, radius_word: str, angle_word: str) -> list[str]:
    radius, angle = b.fresh("radius"), b.fresh("angle")
    return [f"const float {radius} = sqrt(-2.0f * log((float)(({radius_word} >> 8) + 1u) * {UNIT}));",
            f"const float {angle} = 6.283185307179586f * ((float)({angle_word} >> 8) * {UNIT});",
            f"{normal}[{lane}] = {radius} * cos({angle});",
            f"{normal}[{lane + 1}] = {radius} * sin({angle});"]
