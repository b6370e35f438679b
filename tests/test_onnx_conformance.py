"""benchmarks/onnx_conformance.py (issue 42 item 4) on a handful of ops: onnx's own node tests of Relu, Add, MatMul,
Softmax and Conv run as batched forward bundles on PoCL (buffer storage) through the benchmark's code path, and
pass against onnx's expected outputs; an op fblc lacks (Det) is reported unsupported with the refusal."""

from __future__ import annotations

import numpy as np
import onnx

from benchmarks import onnx_conformance as conformance
from benchmarks.conformance_report import case_status

OPS = {"Relu", "Add", "MatMul", "Softmax", "Conv", "Det"}
MODULES = ["relu", "add", "matmul", "softmax", "conv", "det"]
#: Add's integer widths and Softmax's other axes left out: the same kernels, ~1 CPU s of build (the benchmark runs them)
LEFT_OUT = ("_int", "_uint", "softmax_axis_1", "softmax_axis_2", "softmax_negative", "softmax_default")


def test_node_tests_of_a_handful_of_ops_pass(tmp_path) -> None:
    cases = [c for c in conformance.load_cases(OPS, MODULES)
             if "_expanded" not in c.name and not any(part in c.name for part in LEFT_OUT)]
    assert {c.op for c in cases} == OPS and len(cases) > 15
    det = [c for c in cases if c.op == "Det"]  # compiled alone: in a group it would make the group's cases compile
    # alone too (how a group finds its refused cases), ~2 CPU s more
    outcomes = conformance.run_all([c for c in cases if c.op != "Det"], ["buffer"], group=32, jobs=1, timeout=60,
                                   progress=False)
    bad = {o.case.name: o.results for o in outcomes if case_status(o) != "passed"}
    assert not bad, bad
    refusals = [conformance.compiled(c.model, str(tmp_path), str(tmp_path / c.name)) for c in det]
    assert det and all(r is not None and r.status == "unsupported" and "op Det" in r.detail for r in refusals), refusals
    # the judge itself: an output off by more than onnx's tolerance fails, naming its worst element
    case = next(c for c in cases if c.name == "test_relu")
    off = {n: v + np.float32(1e-2) * (v == v.max()) for n, v in case.expected.items()}
    result = conformance.compare(case, off)
    assert result.status == "failed" and "1 of 60 off" in result.detail, result
    assert conformance.compare(case, case.expected).status == "passed"


def test_a_rerun_of_some_cases_replaces_their_outcomes(tmp_path) -> None:
    """docs/CONFORMANCE.md joins saved runs: a later run of cases an earlier one holds (ops rerun after a change)
    replaces their outcomes, adds no skips, and the report's header names it a rerun at its commit."""
    from benchmarks.conformance_report import Case, Outcome, Result, load_outcomes, report, save_outcomes

    def run(path: str, results: dict[str, str], skipped: int) -> str:
        outcomes = [Outcome(Case(name, "Celu", onnx.ModelProto(), {}, {}, 0.0, 0.0), {"buffer": Result(status)}, True)
                    for name, status in results.items()]
        save_outcomes(str(tmp_path / path), outcomes, ["buffer"], 1.0, skipped, f"run {path}", "abc1234")
        return str(tmp_path / path)

    first = run("all.json", {"test_celu": "passed", "test_celu_bfloat16": "failed"}, 3)
    again = run("again.json", {"test_celu_bfloat16": "passed"}, 1)
    outcomes, storages, seconds, skipped, runs = load_outcomes([first, again])
    assert {o.case.name: case_status(o) for o in outcomes} == {"test_celu": "passed", "test_celu_bfloat16": "passed"}
    assert (skipped, seconds) == (3, 2.0)
    assert "at commit abc1234, a rerun: its cases replace those above" in runs[1] and "rerun" not in runs[0]
    assert "**Totals**: 2 passed, 0 failed" in report(outcomes, storages, "report", seconds, skipped, runs)
