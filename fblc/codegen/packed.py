"""Reads of quantized weights: an element of a packed integer texture (fblc.compiler.quantize.pack_words), and
where a DequantizeLinear's scale (and zero point) of an element lies. ValueReads (codegen/reads.py) builds the
dequantizing operand of a contraction from these."""

from __future__ import annotations

from typing import Sequence

import onnx_ir as ir

from fblc.codegen import ir as kir
from fblc.codegen.cl import strides_of
from fblc.codegen.ir import INT, Expr, div_index, flat_index
from fblc.compiler.values import attr, static_shape


def packed_element(argument: kir.Argument, bits: int, signed: bool, index: Expr) -> Expr:
    """Element `index` of a packed integer texture (fblc.compiler.quantize.pack_words): bits
    [bits * (i % n), ...) of word i / n, n = 32 / bits; a signed one's sign bit spread by shifting it to bit 31
    (as uint, where a left shift is defined) and back (an int's right shift keeps the sign)."""
    per_word = 32 // bits
    word_index = index >> (per_word.bit_length() - 1)
    word = kir.Load(argument, word_index >> 2).lane(word_index & 3)
    return unpack(word, bits, signed, (index & (per_word - 1)) * bits)


def unpack(word: Expr, bits: int, signed: bool, shift: Expr) -> Expr:
    """The `bits`-bit integer at bit `shift` of int `word`."""
    if signed:
        top = kir.Cast(kir.UINT, word) << (32 - bits - shift)
        return kir.Cast(INT, top) >> (32 - bits)
    return (word >> shift) & ((1 << bits) - 1)


def dequantize_parameter_index(node: ir.Node, coordinates: Sequence[Expr]) -> Expr | None:
    """Flat index into DequantizeLinear `node`'s scale (and zero point) of the element at `coordinates` in its
    data; None for one scale (per tensor)."""
    shape, parameter_shape = static_shape(node.inputs[0]), static_shape(node.inputs[1])
    if not parameter_shape or all(d == 1 for d in parameter_shape):
        return None
    axis = int(attr(node, "axis", 1)) % len(shape)
    if len(parameter_shape) == 1:  # per axis
        return coordinates[axis]
    block = int(attr(node, "block_size", 0)) or 1
    blocked = [div_index(c, block) if k == axis else c for k, c in enumerate(coordinates)]
    return flat_index(list(zip(blocked, strides_of(parameter_shape))))
