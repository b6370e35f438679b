"""A kernel source of the bundle for one storage (kernels.cl: images; kernels.buffer.cl: buffers): its
preamble (with the `real` type where a kernel computes in half), in image storage the R-Tile layouts'
coordinate functions, and one __kernel per distinct kernel (Kernel.function) rendered from its IR, each after a
comment naming what it computes. A kernel that a co-launched kernel runs as a part (codegen/co_launch.py: where
co_launch.dispatched) is a function the source holds once, before the first __kernel
that calls it, named after the first of its twins (Kernel.twin): the co-launched __kernels, and the __kernel of
a launch of its own with that body, call it."""

from __future__ import annotations

from typing import Sequence

from fblc.codegen.cl import Kernel
from fblc.codegen.co_launch import dispatch, dispatched, part_function
from fblc.codegen.render.opencl import IMAGE, Storage, render_function, render_kernel
from fblc.texel_layout import TexelLayout

COMMENT_LENGTH = 400  # a fused group's comment names its nodes: long ones are cut


def assemble_source(kernels: Sequence[Kernel], layouts: Sequence[TexelLayout], storage: Storage = IMAGE
                    ) -> tuple[str, dict[str, tuple[int, int]]]:
    """(the source, each kernel's (first, last) line of its function there, from the functions of its parts
    that it is the first to call). A kernel whose `function` is another's (an identical one,
    share.share_kernels) is written once, under the first's name."""
    lines = storage.preamble.splitlines()
    if any(a.kind == "real" for kernel in kernels for a in kernel.ir.arguments):
        lines += storage.real_preamble.splitlines()
    rtile = {layout.c_function: layout for layout in layouts if layout.kind == "rtile" and storage.places}
    lines += [line for name in sorted(rtile) for line in rtile[name].c_definition().splitlines()]
    called = {_twin(part) for kernel in kernels if dispatched(kernel) for part in kernel.parts}
    written: set[str] = set()
    spans: dict[str, tuple[int, int]] = {}
    for kernel in kernels:
        if kernel.function != kernel.name:
            spans[kernel.name] = spans[kernel.function]
            continue
        start = len(lines) + 1
        if kernel.parts:  # the parts' functions, or (not co_launch.dispatched) its IR: copies of their bodies
            parts = kernel.parts if dispatched(kernel) else []
        else:
            parts = [kernel] if _twin(kernel) in called else []
        for part in parts:
            if _twin(part) not in written:
                written.add(_twin(part))
                function, values, arrays = part_function(part, _function(part))
                lines.append(f"// {part.family}: {', '.join(part.nodes)}"[:COMMENT_LENGTH])
                lines.extend(render_function(function, values, arrays, storage).splitlines())
                lines.append("")
        lines.append(f"// {kernel.family}: {', '.join(kernel.nodes)}"[:COMMENT_LENGTH])
        rendered = render_kernel(dispatch(kernel, _function), storage, prologue=False) if parts else \
            kernel.render(storage)
        lines.extend(rendered.splitlines())
        spans[kernel.name] = (start, len(lines))
        lines.append("")
    return "\n".join(lines) + "\n", spans


def _twin(kernel: Kernel) -> str:
    return kernel.twin or kernel.name


def _function(part: Kernel) -> str:
    """The name of the function that holds `part`'s body (kernel names end in an ONNX op's name, never `_part`)."""
    return f"{_twin(part)}_part"
