"""A kernel source of the bundle for one storage (kernels.cl: images; kernels.buffer.cl: buffers): its
preamble (with the `real` type where a kernel computes in half), in image storage the R-Tile layouts'
coordinate functions, and one __kernel per distinct kernel (Kernel.function) rendered from its IR, each after a
comment naming what it computes."""

from __future__ import annotations

from typing import Sequence

from fblc.codegen.cl import Kernel
from fblc.codegen.render.opencl import IMAGE, Storage
from fblc.texel_layout import TexelLayout

COMMENT_LENGTH = 400  # a fused group's comment names its nodes: long ones are cut


def assemble_source(kernels: Sequence[Kernel], layouts: Sequence[TexelLayout], storage: Storage = IMAGE
                    ) -> tuple[str, dict[str, tuple[int, int]]]:
    """(the source, each kernel's (first, last) line of its function there). A kernel whose `function`
    is another's (an identical one, plan.share_kernels) is written once, under the first's name."""
    lines = storage.preamble.splitlines()
    if any(a.kind == "real" for kernel in kernels for a in kernel.ir.arguments):
        lines += storage.real_preamble.splitlines()
    rtile = {layout.c_function: layout for layout in layouts if layout.kind == "rtile" and storage.places}
    lines += [line for name in sorted(rtile) for line in rtile[name].c_definition().splitlines()]
    spans: dict[str, tuple[int, int]] = {}
    for kernel in kernels:
        if kernel.function != kernel.name:
            spans[kernel.name] = spans[kernel.function]
            continue
        start = len(lines) + 1
        lines.append(f"// {kernel.family}: {', '.join(kernel.nodes)}"[:COMMENT_LENGTH])
        lines.extend(kernel.render(storage).splitlines())
        spans[kernel.name] = (start, len(lines))
        lines.append("")
    return "\n".join(lines) + "\n", spans
