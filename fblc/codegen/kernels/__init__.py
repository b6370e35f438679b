"""Kernel emitters by table: one registry keyed by the op type that anchors a kernel.

An emitter gets the TextureTable and a KernelGroup (its nodes, in order, and the values the
rest of the step reads) and returns the OpenCL kernels that compute them.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from typing import Callable

import onnx_ir as ir

from fblc.codegen.cl import Kernel
from fblc.codegen.textures import TextureTable
from fblc.compiler.registry import OpRegistry


@dataclass
class KernelGroup:
    name: str
    nodes: list[ir.Node]
    outputs: list[ir.Value]  # values read outside the group, or graph outputs

    @property
    def anchor(self) -> ir.Node:
        return self.nodes[0]


Emitter = Callable[[TextureTable, KernelGroup], list[Kernel]]


#: the modules whose emitters register themselves on import
EMITTER_MODULES = ("activations", "contraction", "conv", "conv_transpose", "elementwise", "gather", "movement",
                   "noise", "normalize", "pooling", "reduce", "resample", "scan", "sort")


def _load_emitters() -> None:
    for module in EMITTER_MODULES:
        import_module(f"fblc.codegen.kernels.{module}")


KERNEL_EMITTERS: OpRegistry[Emitter] = OpRegistry(
    "OpenCL kernel emitter", "this op cannot run on the GPU yet", loader=_load_emitters)
register_kernel = KERNEL_EMITTERS.register
