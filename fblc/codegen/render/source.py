"""kernels.cl: the preamble, the R-Tile layouts' coordinate functions, the trace's argument numbers
and one __kernel per distinct kernel (Kernel.function), each after a comment naming what it computes."""

from __future__ import annotations

from typing import Sequence

from fblc.codegen.cl import Kernel
from fblc.codegen.render.preamble import PREAMBLE
from fblc.texel_layout import TexelLayout

COMMENT_LENGTH = 400  # a fused group's comment names its nodes: long ones are cut


def assemble_source(kernels: Sequence[Kernel], layouts: Sequence[TexelLayout]) -> tuple[str, dict[str, tuple[int, int]]]:
    """(kernels.cl, each kernel's (first, last) line of its function there). A kernel whose `function`
    is another's (an identical one, plan.share_kernels) is written once, under the first's name."""
    lines = PREAMBLE.splitlines()
    rtile = {layout.c_function: layout for layout in layouts if layout.kind == "rtile"}
    lines += [line for name in sorted(rtile) for line in rtile[name].c_definition().splitlines()]
    arguments = max((len(k.inputs) for k in kernels), default=0)
    lines += ["#ifdef FBLC_TRACE"] + [f"#define ARG_in{k} {k}" for k in range(arguments)] + ["#endif"]
    spans: dict[str, tuple[int, int]] = {}
    for kernel in kernels:
        if kernel.function != kernel.name:
            spans[kernel.name] = spans[kernel.function]
            continue
        start = len(lines) + 1
        lines.append(f"// {kernel.family}: {', '.join(kernel.nodes)}"[:COMMENT_LENGTH])
        lines.extend(kernel.source.splitlines())
        spans[kernel.name] = (start, len(lines))
        lines.append("")
    return "\n".join(lines) + "\n", spans
