"""Kernels of an OpenCL source, counted the same way for fblc's kernels.cl and TVM's generated code.

A kernel is a `__kernel void NAME(ARGS) {` definition (declarations without a body are not);
it uses textures when an argument is an `image2d_t`; it moves data when every op its name
lists is a data-movement op (MOVEMENT_OPS). Both compilers name a kernel after the ops in it:
fblc `k12_Transpose`, TVM `fused_reshape3_transpose2_kernel` or `te_layout_transform_kernel`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_DEFINITION = re.compile(r"__kernel\s+void\s+(\w+)\s*\(([^)]*)\)\s*\{")
#: ops that only move or copy elements, by either compiler's spelling (lower case; multi-word first)
MOVEMENT_OPS = ("layout_transform", "broadcast_to", "expand_dims", "strided_slice", "dynamic_strided_slice",
                "transpose", "reshape", "expand", "concatenate", "concat", "split", "slice", "squeeze",
                "unsqueeze", "flatten", "pad", "tile", "copy", "identity", "permute_dims", "collapse_sum_to")
_NAME_NOISE = re.compile(r"^(k\d+_|fused_|te_)+|_kernel(_\d+)?$")


@dataclass(frozen=True)
class Kernel:
    name: str
    arguments: tuple[str, ...]

    @property
    def uses_textures(self) -> bool:
        return any("image2d_t" in argument for argument in self.arguments)

    @property
    def moves_data(self) -> bool:
        # TVM numbers repeated ops (reshape13, transpose5): the op is the token without its digits
        tokens = [re.sub(r"\d+$", "", token) for token in _NAME_NOISE.sub("", self.name).lower().split("_")]
        rest = "_" + "_".join(token for token in tokens if token) + "_"
        for op in MOVEMENT_OPS:
            while f"_{op}_" in rest:  # a loop: replace() skips the second of two in a row
                rest = rest.replace(f"_{op}_", "_")
        return rest.strip("_") == ""


@dataclass(frozen=True)
class KernelCounts:
    kernels: int
    data_movement: int
    with_textures: int


def kernels(source: str) -> list[Kernel]:
    """Every kernel defined in `source`, once each, in order."""
    found: dict[str, Kernel] = {}
    for match in _DEFINITION.finditer(source):
        arguments = tuple(a.strip() for a in match.group(2).split(",") if a.strip())
        found.setdefault(match.group(1), Kernel(match.group(1), arguments))
    return list(found.values())


def count_kernels(source: str) -> KernelCounts:
    defined = kernels(source)
    return KernelCounts(len(defined), sum(k.moves_data for k in defined), sum(k.uses_textures for k in defined))
