"""Kernels as IR for codegen tests: compile a model to its kernels (fblc.codegen.ir.KernelIR each) and
query their structure (loads, loops, barriers, local arrays) instead of matching C text."""

from __future__ import annotations

from typing import Iterator, TypeVar

from fblc.codegen import ir as kir
from fblc.codegen.cl import Kernel
from fblc.codegen.plan import lower, step_schedules
from fblc.codegen.schedule import load_overrides
from fblc.compiler.model_io import load_model
from fblc.passes.pipeline import TrainingOptions, build_training_graph
from fblc.profiles import load_profile

Node = TypeVar("Node")


def lowered_kernels(model_path: str, target: str = "local", dtype: str = "fp32",
                    options: TrainingOptions = TrainingOptions()) -> list[Kernel]:
    """The step's kernels as `fblc compile` emits them (each with its `.ir`), in launch order: a co-launched
    kernel's parts (codegen/co_launch.py) in its place, each as it was emitted."""
    import dataclasses

    profile = load_profile(target)
    options = dataclasses.replace(options, dtype=dtype)
    overrides = load_overrides(None, profile)
    step = build_training_graph(load_model(model_path), options, lower=profile,
                                schedules=step_schedules(profile, dtype, overrides))
    return [part for kernel in lower(step, profile, dtype, overrides=overrides).kernels
            for part in (kernel.parts or [kernel])]


def statements(kernel: Kernel) -> Iterator[kir.Statement]:
    """Every statement of the kernel, nested ones included, but for what a work-group's staging holds (an
    ir.Stage's copies into __local, codegen/kernels/staging.py): the kernel's own reads, as buffers render it."""
    assert isinstance(kernel.ir, kir.KernelIR), f"{kernel.name} has no IR"
    return _unstaged(kernel.ir.body)


def _unstaged(body: list[kir.Statement]) -> Iterator[kir.Statement]:
    for statement in body:
        yield statement
        if not isinstance(statement, kir.Stage):
            for nested in kir.nested(statement):
                yield from _unstaged(nested)


def expressions(kernel: Kernel) -> Iterator[kir.Expr]:
    """Every expression the kernel's statements read, sub-expressions included."""
    for statement in statements(kernel):
        for expr in kir.statement_exprs(statement):
            yield from kir.walk_expr(expr)


def of_type(kernel: Kernel, node_type: type[Node]) -> list[Node]:
    """The kernel's statements or expressions of one IR type (kir.Load, kir.For, kir.Barrier...)."""
    found = [s for s in statements(kernel) if isinstance(s, node_type)]
    return found + [e for e in expressions(kernel) if isinstance(e, node_type)]


def loads_of(kernel: Kernel, argument: str) -> list[kir.Load]:
    """The kernel's texel reads of argument `argument` ("in0", ...)."""
    return [e for e in of_type(kernel, kir.Load) if e.argument.name == argument]


def keep_lowered(monkeypatch) -> list[dict[str, Kernel]]:  # type: ignore[no-untyped-def]
    """From now on in the test, the kernels (each with its `.ir`) of every bundle compile_model writes, by
    kernel name, one dict per compile in order: the bundle's own kernels, without compiling it twice."""
    from fblc.codegen import compile as compile_module

    kept: list[dict[str, Kernel]] = []

    def lower_kept(*args, **kwargs):  # type: ignore[no-untyped-def]
        program = lower(*args, **kwargs)
        kept.append({kernel.name: kernel for kernel in program.kernels})
        return program

    monkeypatch.setattr(compile_module, "lower", lower_kept)
    return kept


def profile_with(directory: str, target: str, **figures: object) -> str:
    """A copy of a shipped target profile with some figures' values changed, written under `directory`:
    its path, which `--target` and load_profile take (e.g. the local CPU at a GPU's 64 accumulator floats)."""
    import json
    import os

    from fblc.profiles.profile import TARGETS_DIR

    with open(os.path.join(TARGETS_DIR, f"{target}.json"), encoding="utf-8") as handle:
        document = json.load(handle)
    for name, value in figures.items():
        document["figures"][name]["value"] = value
    path = os.path.join(directory, f"{target}-{'-'.join(f'{k}{v}' for k, v in figures.items())}.json")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(document, handle)
    return path
