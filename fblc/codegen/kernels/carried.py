"""What a work-item of a staged reduction carries across the group's barriers on a CPU device.

A CPU's OpenCL (PoCL) runs a work-group's work-items one after another between two barriers, and keeps every
value a work-item needs past a barrier in a context array of the group, one element per work-item. Its compiler
first hoists what the block loop does not change out of the loop, so a staged reduction carried:
- each staged read's address: `st[slot * 56 + k]` for k = 0..83 became 84 pointers in the context, each loaded
  again after every barrier before its read;
- its accumulators as separate variables (the compiler splits an array indexed by constants), so as many
  context arrays, each the group's size apart: 8 KB in groups of 256 float8s, all in the same sets of a 32 KB L1.
MobileNetV2 [8,3,97,60]'s 1x1 weight gradients (groups of 256, 16 float8 accumulators, 8 blocks) ran 4x slower
than with neither carried (2.5 -> 0.6 ms, PoCL, one thread).

Where a work-item meets the copy's barriers CARRIED_BLOCKS times or more, it carries instead each staged
operand's slot as one volatile int and a volatile zero, both read again after each copy: the reads' addresses
are computed inside the barrier's region from the slot read there, and each block copies the accumulators it
updates in from `acc[k + zero]` and back, an index known only at run time, so that the array stays one, whose
context holds each work-item's accumulators together, while a block's updates stay in registers (updated in the
array itself, T-ResNet B=64's k8 with 384 updates a block took 1.8x its time). Only where the storage stages
(ir.Stage, ir.StagedChoice): buffers keep the plain form.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Sequence

from fblc.codegen.ir import (INT, Assign, Block, Const, Declare, Element, Expr, Lane, Stage, StagedChoice, Statement,
                             Swizzle, Var)
from fblc.profiles.profile import CARRIED_BLOCKS, Profile

if TYPE_CHECKING:  # texel.py imports staging.py, which imports this module
    from fblc.codegen.kernels.texel import Reduction


def carries(profile: Profile, reduction: Reduction) -> bool:
    """Whether the work-items of `reduction`, staged, carry their slots and accumulators as this module writes
    them: on a CPU, where each runs CARRIED_BLOCKS blocks or more (the block loop's and the rest's, in each trip
    of the loops around them), each block with its copy's barriers."""
    axis = reduction.blocked
    blocks = (reduction._looped // axis.block + (reduction._looped < axis.extent)) * math.prod(
        loop.trips for loop in reduction.loops)
    return profile.cpu and blocks >= CARRIED_BLOCKS


@dataclass
class Carried:
    """The volatile values a staged reduction's work-item carries: `zero` and the staged operands' `slots`."""

    zero: Var
    slots: dict[str, Var]

    @staticmethod
    def declared(block: Block, slots: dict[str, Var]) -> Carried:
        """Declare the volatile zero and a volatile copy of each operand's slot (by name) in `block`, where the
        storage stages."""
        zero = block.var("zc", INT)
        carried = {name: block.var("slotc", INT) for name in slots}
        block.add(Stage([Declare(zero, Const(0, INT), const=False, volatile=True),
                         *(Declare(carried[name], slot, const=False, volatile=True) for name, slot in slots.items())]))
        return Carried(zero, carried)

    def read(self, stage: Block) -> tuple[Var, dict[str, Var]]:
        """The zero and each slot as read after a copy's barriers (declared into `stage`, the copy's block)."""
        return stage.let(self.zero, "z"), {name: stage.let(slot, "slot") for name, slot in self.slots.items()}


def in_registers(block: Block, assigns: Sequence[Assign], array: Var, zero: Var) -> list[Statement]:
    """A block's updates `assigns` of the accumulators `array`, where the storage stages: each element they
    update copied in at `k + zero` before them, updated as a private variable, and copied back after them
    (the array, indexed at run time, stays one in the group's context; its elements stay in registers
    between the copies); elsewhere the updates as they are."""
    copies: dict[Element, Var] = {}

    def target(expr: Expr) -> Expr:
        if isinstance(expr, Element) and expr.array == array:
            if expr not in copies:
                copies[expr] = block.var("ra", array.dtype)
            return StagedChoice(expr, copies[expr], array.dtype)
        if isinstance(expr, (Lane, Swizzle)):
            return replace(expr, vector=target(expr.vector))
        return expr

    updates = [replace(a, target=target(a.target)) for a in assigns]
    at = {element: Element(array, element.index + zero) for element in copies}
    return [Stage([Declare(copy, at[element], const=False) for element, copy in copies.items()]), *updates,
            Stage([Assign(at[element], copy) for element, copy in copies.items()])]
