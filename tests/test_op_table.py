"""The op table (fblc/compiler/ops.py) against the registries that hold the rules that are code.

An op in one of them and missing from another fails here, naming the op and both registries: the
gradient registry (compiler/gradients), the kernel registry (codegen/kernels KERNEL_EMITTERS) and
the elementwise expressions (codegen/kernels/elementwise.py EXPRESSIONS, activations.py
ACTIVATIONS). An op the table says has no gradient or no kernel carries the reason in its row.
No kernel is built: the registries are read as tables.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import pytest

import fblc.compiler.gradients  # noqa: F401  (fills the gradient registry)
from fblc.codegen.kernels import KERNEL_EMITTERS
from fblc.codegen.kernels.activations import ACTIVATIONS
from fblc.codegen.kernels.elementwise import EXPRESSIONS
from fblc.compiler import ops
from fblc.compiler.autodiff import GRADIENTS
from fblc.compiler.flops import FLOP_RULES
from fblc.compiler.gradients.unary import UNARY
from fblc.compiler.shape_rules import NAMED_RULES
from fblc.tools.op_audit import LOWERINGS
from fblc.passes.split_softmax import SPLITS

TABLE = "the op table (fblc/compiler/ops.py)"
GRADIENT_REGISTRY = "the gradient registry (fblc/compiler/gradients)"
KERNEL_REGISTRY = "the kernel registry (fblc/codegen/kernels KERNEL_EMITTERS)"
EXPRESSION_TABLE = "the elementwise expressions (fblc/codegen/kernels/elementwise.py EXPRESSIONS)"
ACTIVATION_TABLE = "the activations (fblc/codegen/kernels/activations.py ACTIVATIONS)"


def _missing(op: str, found_in: str, missing_from: str, hint: str = "") -> str:
    return f"{op}: in {found_in}, missing from {missing_from}" + (f" ({hint})" if hint else "")


def mismatches(table: Mapping[str, ops.Op], gradients: Collection[str], kernels: Collection[str],
               expressions: Collection[str], activations: Collection[str]) -> list[str]:
    """Every disagreement between the table and the registries, one line each."""
    problems = []
    for name, registry in ((GRADIENT_REGISTRY, gradients), (KERNEL_REGISTRY, kernels),
                           (EXPRESSION_TABLE, expressions), (ACTIVATION_TABLE, activations)):
        problems += [_missing(op, name, TABLE, "add its row") for op in sorted(set(registry) - set(table))]
    for op, row in table.items():
        if not row.no_gradient and op not in gradients:
            problems.append(_missing(op, TABLE, GRADIENT_REGISTRY, "write its rule, or say in no_gradient why none"))
        if row.no_gradient and op in gradients:
            problems.append(f"{op}: has a rule in {GRADIENT_REGISTRY}, but {TABLE} says no_gradient: {row.no_gradient}")
        if not row.no_kernel and op not in kernels:
            problems.append(_missing(op, TABLE, KERNEL_REGISTRY, "register its emitter, or say in no_kernel why none"))
        if row.no_kernel and op in kernels:
            problems.append(f"{op}: has an emitter in {KERNEL_REGISTRY}, but {TABLE} says no_kernel: {row.no_kernel}")
        computed_per_element = row.kind is ops.Kind.ELEMENTWISE or row.fuses_into_readers
        if computed_per_element and op not in expressions:
            problems.append(_missing(op, f"{TABLE} (kind {row.kind.value})", EXPRESSION_TABLE,
                                     "the elementwise kernel would accept it and fail to compile it"))
    for op in sorted(set(expressions) & set(table)):
        row = table[op]
        if row.kind is not ops.Kind.ELEMENTWISE and not row.fuses_into_readers:
            problems.append(f"{op}: in {EXPRESSION_TABLE}, but {TABLE} gives kind {row.kind.value}: fuse would "
                            "never put it in an elementwise chain")
    problems += [_missing(op, ACTIVATION_TABLE, EXPRESSION_TABLE) for op in sorted(set(activations) - set(expressions))]
    return problems


def _real() -> dict[str, Collection[str]]:
    return {"gradients": GRADIENTS.supported(), "kernels": KERNEL_EMITTERS.supported(),
            "expressions": set(EXPRESSIONS), "activations": set(ACTIVATIONS)}


def test_the_table_and_the_registries_agree() -> None:
    problems = mismatches(ops.OPS, **_real())
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize("registry,op,names", [
    ("gradients", "Softsign", (TABLE, GRADIENT_REGISTRY)),
    ("kernels", "CumSum", (TABLE, KERNEL_REGISTRY)),
    ("expressions", "HardSwish", (TABLE, EXPRESSION_TABLE)),
    ("table", "Sin", (GRADIENT_REGISTRY, TABLE)),
])
def test_a_missing_entry_is_named_with_both_registries(registry: str, op: str, names: tuple[str, str]) -> None:
    registries = {name: set(entries) for name, entries in _real().items()}
    table = dict(ops.OPS)
    if registry == "table":
        del table[op]
    else:
        registries[registry].discard(op)
    problems = mismatches(table, **registries)
    assert problems and all(op in p for p in problems), problems
    assert any(all(name in p for name in names) for p in problems), problems


def test_an_elementwise_row_without_an_expression_fails() -> None:
    """The bug the table exists for: an op fuse treats as elementwise that the kernel cannot compile."""
    table = {**ops.OPS, "Tan": ops.Op(ops.Kind.ELEMENTWISE, ops.Ftd.DEPENDENT_CONSISTENT, "torch.tan",
                                      per_sample=True, reads=ops.ANY_VIEW)}
    registries = {name: set(entries) for name, entries in _real().items()}
    registries["gradients"].add("Tan")
    registries["kernels"].add("Tan")
    expected = _missing("Tan", f"{TABLE} (kind elementwise)", EXPRESSION_TABLE,
                        "the elementwise kernel would accept it and fail to compile it")
    assert mismatches(table, **registries) == [expected]


def test_every_named_rule_exists() -> None:
    assert sorted({row.flops for row in ops.OPS.values()} - set(FLOP_RULES)) == []
    assert sorted({row.shape for row in ops.OPS.values() if row.shape} - set(NAMED_RULES)) == []


def test_the_reasons_match_the_import_rewrites() -> None:
    """`lowered` means an import lowering (lower_composites, lower_recurrent, lower_dft) rewrites it; `split`,
    that split_softmax does."""
    assert sorted(op for op, row in ops.OPS.items() if row.no_kernel == ops.LOWERED) == sorted(LOWERINGS)
    assert sorted(op for op, row in ops.OPS.items() if row.no_kernel == ops.SPLIT) == sorted(SPLITS)


def test_every_op_that_runs_has_an_ftd_class_and_consistent_views() -> None:
    for op, row in ops.OPS.items():
        assert row.ftd is not None or (row.no_kernel and row.no_gradient), f"{op}: give it an FTD class"
        assert not row.reads or ops.Reads.STRIDED in row.reads, f"{op}: offset or folded views are strided ones"


def test_unary_gradients_are_one_input_ops_of_the_table() -> None:
    assert sorted(op for op in UNARY if op not in ops.OPS) == []
