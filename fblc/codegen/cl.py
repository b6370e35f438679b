"""Kernel: one __kernel of a bundle as the emitters hand it to the plan; `strides_of`: the row-major
strides every emitter indexes with (shapes, strides and texture widths are compile-time literals)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fblc.codegen import ir as kir
from fblc.codegen.render.opencl import Storage, foldable, render_kernel
from fblc.compiler.index_map import row_major_strides as strides_of
from fblc.profiles import Profile

__all__ = ["Kernel", "strides_of"]


@dataclass
class Kernel:
    """One __kernel: its IR, launch size and texture arguments (outputs first)."""

    name: str
    family: str
    ir: kir.KernelIR = field(repr=False, compare=False)
    global_size: int
    outputs: list[int] = field(default_factory=list)  # texture ids
    inputs: list[int] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)  # ONNX node names it computes
    function: str = ""  # the __kernel it launches: its own, or an identical one emitted earlier
    #: the work-group size the kernel is written for (its work-items share __local memory), or None:
    #: any size, the target profile's schedule chooses
    group_size: int | None = None
    #: the kernels a co-launched kernel runs, each over its own range of work-items, as they were built
    #: (codegen/co_launch.py); [] for a kernel of its own
    parts: list[Kernel] = field(default_factory=list, repr=False)
    #: each part's first work-item in the co-launched kernel's range
    starts: list[int] = field(default_factory=list, repr=False)
    #: the first of the step's kernels and co-launched parts with IR equal to its own (share.share_kernels): where a
    #: co-launched kernel runs it, the source holds its body once, as that one's function (co_launch.part_function)
    twin: str = ""
    #: its body as a function, where a co-launched kernel runs it (co_launch.part_function: the IR, its values and
    #: __local arrays), made once for both storages' sources
    function_ir: tuple[kir.KernelIR, list[kir.Var], list[kir.Var]] | None = field(default=None, init=False,
                                                                                repr=False, compare=False)

    def launch(self, profile: Profile) -> tuple[int, int]:
        """(global size, work-group size) it launches with: its own group size (whole groups), else the
        profile's (Profile.launch_size)."""
        if self.group_size is not None:
            return self.global_size, self.group_size
        return profile.launch_size(self.global_size)

    #: (the IR `folds` was found for, its foldable)
    _folded: tuple[kir.KernelIR, dict[kir.Var, kir.Expr]] | None = field(default=None, init=False, repr=False,
                                                                          compare=False)

    def render(self, storage: Storage) -> str:
        """Its __kernel in `storage`, rendered when first asked (a kernel that an identical one replaces
        never is); the values the renderer folds are found once for every storage."""
        return render_kernel(self.ir, storage, self.folds)

    @property
    def folds(self) -> dict[kir.Var, kir.Expr]:
        """The values the renderer folds into their reader (render.opencl.foldable), found once per IR: the
        in-place proof (codegen/inplace.py) and both storages' renders ask; a kernel whose IR is replaced
        (plan.compute_in_half's half arithmetic: other Vars) finds them again. The IR's statements are not
        changed after emission, and the IR held here keeps its id from being reused."""
        if self._folded is None or self._folded[0] is not self.ir:
            self._folded = (self.ir, foldable(self.ir.body))
        return self._folded[1]
