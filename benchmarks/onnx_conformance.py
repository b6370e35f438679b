"""ONNX's node tests as forward bundles on the local device: a conformance report (issue 42 item 4).

    python benchmarks/onnx_conformance.py [--ops Relu,Add] [--storage image|buffer|both] [-j 1]
        [--group 12] [--case-timeout 60] [--out docs/CONFORMANCE.md]

Every node test of the installed onnx package's backend suite (`onnx.backend.test.case.node`: the model, its
inputs and expected outputs, as onnx's backend runner takes them) is compiled with `--trainer none` and run by
LocalRunner.infer on PoCL in each storage; onnxruntime runs the same model beside it. A case is
- *unsupported* when fblc refuses it (an FblcError at compile: the op, an attribute, a dtype), with the message;
- *failed* when it runs and an output differs from onnx's expected one beyond the case's own tolerances (onnx's
  backend runner's: rtol 1e-3, atol 1e-7 unless the case sets its own; a bfloat16 output at rtol 2^-6 at least,
  two of its ulps, as that runner), with the worst difference, or when the
  device run raises (the error's first line) or passes the case's time limit;
- *passed* otherwise. The `ort` column counts the cases onnxruntime gets right by the same test.

PoCL's build is the cost (~1.2 CPU s for a one-Relu bundle, most of it the program's fixed part), so cases are
batched: `--group` cases of one opset side by side in one model (names prefixed `cN__`), one compile and one
build per storage. A refusal names its node, so the refused case leaves the group and the rest compile again;
a group whose run raises is split in halves down to the case that raises. Cases with subgraphs run alone.
Each group runs in a child process killed after `--case-timeout` seconds per case in it (then run one by one).
"""

from __future__ import annotations

import argparse
import importlib
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from collections import Counter, defaultdict
from unittest import mock

import numpy as np
import onnx
from onnx import helper

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.conformance_report import (Case, Outcome, Result, commit_of_tree, load_outcomes,  # noqa: E402
                                           report, save_outcomes, write)

SEPARATOR = "__"
STORAGES = ("image", "buffer")
BFLOAT16_RTOL = 2 ** -6  # onnx's backend runner's least rtol for a bfloat16 output (two bfloat16 ulps)
SKIPPED: list[str] = []  # cases load_cases left out


def load_cases(ops: set[str] | None = None, modules: list[str] | None = None, leave_out: set[str] = set()) -> list[Case]:
    """The node test cases (of `ops` if given). `modules`: import only these generator modules of
    onnx.backend.test.case.node (e.g. 'relu'): a few ops without the whole suite's ~5 CPU s of generation."""
    from onnx.backend.test.case import node as suite
    if modules is None:
        tests = suite.collect_testcases()
    else:
        for module in modules:
            importlib.import_module(f"{suite.__name__}.{module}")
        tests = suite._NodeTestCases
    cases, op_of = [], {}
    for test in tests:
        if test.model is None or not test.data_sets:
            continue
        if "_expanded" not in test.name and len(test.model.graph.node) == 1:
            op_of[test.name] = test.model.graph.node[0].op_type
    for test in tests:
        if test.model is None or not test.data_sets:
            continue
        base = test.name.split("_expanded")[0]
        op = op_of.get(base) or op_of.get(test.name) or test.model.graph.node[-1].op_type
        if (ops and op not in ops) or op in leave_out:
            continue
        fed, wanted = test.data_sets[0]
        initialized = {t.name for t in test.model.graph.initializer}
        names = [v.name for v in test.model.graph.input if v.name not in initialized]
        if len(fed) != len(names) or not all(isinstance(v, np.ndarray) for v in (*fed, *wanted)):
            SKIPPED.append(test.name)  # TensorProto data (float8, int4), sequences, left-out optional inputs: not run
            continue
        cases.append(Case(test.name, op, test.model, dict(zip(names, fed)),
                          dict(zip([v.name for v in test.model.graph.output], wanted)),
                          float(test.rtol), float(test.atol)))
    return cases


def has_subgraph(model: onnx.ModelProto) -> bool:
    return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
               for n in model.graph.node for a in n.attribute)


def _prefixed(case: Case, prefix: str) -> onnx.GraphProto:
    graph = onnx.GraphProto()
    graph.CopyFrom(case.model.graph)

    def name(value: str) -> str:
        return f"{prefix}{SEPARATOR}{value}" if value else value

    for index, node in enumerate(graph.node):
        node.name = name(node.name or f"n{index}")
        node.input[:] = [name(v) for v in node.input]
        node.output[:] = [name(v) for v in node.output]
    for values in (graph.input, graph.output, graph.value_info):
        for value in values:
            value.name = name(value.name)
    for tensor in graph.initializer:
        tensor.name = name(tensor.name)
    return graph


def merged_model(cases: dict[str, Case]) -> onnx.ModelProto:
    """One model holding `cases` (prefix -> case, all of one opset) side by side."""
    first = next(iter(cases.values())).model
    if len(cases) == 1:
        return first
    nodes, inputs, outputs, initializers, infos, functions = [], [], [], [], [], {}
    for prefix, case in cases.items():
        graph = _prefixed(case, prefix)
        nodes += graph.node
        inputs += graph.input
        outputs += graph.output
        initializers += graph.initializer
        infos += graph.value_info
        for function in case.model.functions:
            functions[(function.domain, function.name)] = function
    graph = helper.make_graph(nodes, "conformance", inputs, outputs, initializer=initializers, value_info=infos)
    model = helper.make_model(graph, opset_imports=list(first.opset_import), functions=list(functions.values()))
    model.ir_version = max(c.model.ir_version for c in cases.values())
    return model


def compare(case: Case, got: dict[str, np.ndarray]) -> Result:
    """`got` (the case's outputs by their own names) against onnx's expected ones, np.testing's way."""
    worst = ""
    for name, want in case.expected.items():
        have = got.get(name)
        if have is None:
            return Result("failed", f"output {name} missing")
        if have.shape != want.shape:
            return Result("failed", f"output {name} shape {list(have.shape)}, expected {list(want.shape)}")
        brain = want.dtype.name == "bfloat16"  # ml_dtypes' (kind V): onnx's runner allows two of its ulps
        if want.dtype.kind in "fc" or brain:
            w, h = want.astype(np.float32 if brain else want.dtype).astype(np.float64), have.astype(np.float64)
            rtol = max(case.rtol, BFLOAT16_RTOL) if brain else case.rtol
            nan = np.isnan(w) != np.isnan(h)
            bad = nan | (np.abs(h - w) > case.atol + rtol * np.abs(w))
            bad &= ~(np.isinf(w) & (w == h))
            if bad.any():
                if nan.any():
                    return Result("failed", f"output {name}: NaN where expected differs ({int(nan.sum())} of {w.size})")
                diff = np.nan_to_num(np.abs(h - w), nan=np.inf)
                at = int(np.argmax(np.where(bad, diff, -1)))
                worst = (f"output {name}: {int(bad.sum())} of {w.size} off, worst abs "
                         f"{diff.flat[at]:.3g} (got {h.flat[at]:.6g}, expected {w.flat[at]:.6g})")
                return Result("failed", worst)
        elif not np.array_equal(have, want.astype(have.dtype) if have.dtype != want.dtype else want):
            return Result("failed", f"output {name}: {int((have != want).sum())} of {want.size} elements differ")
    return Result("passed")


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def compiled(model: onnx.ModelProto, folder: str, bundle: str) -> Result | None:
    """Compile `model` as a forward bundle into `bundle`: None, or why not (a refusal: unsupported, with its
    message; any other error: failed, fblc should have refused by name)."""
    from fblc.codegen.compile import compile_model
    from fblc.errors import FblcError
    from fblc.passes import fuse
    from fblc.passes.pipeline import TrainingOptions

    path = os.path.join(folder, "model.onnx")
    onnx.save(model, path)
    try:  # each case's reductions in kernels of its own, as alone (tests/support/merged_steps.py)
        with mock.patch.object(fuse, "SAME_SHAPE_REDUCTIONS", 1):
            compile_model(path, bundle, "local", "fp32", TrainingOptions(trainer="none"))
    except FblcError as error:
        return Result("unsupported", str(error).split("; supported ops:")[0].strip().splitlines()[0][:300])
    except Exception as error:
        return Result("failed", f"compile: {_first_line(error)}")
    return None


def run_group(cases: dict[str, Case], storages: list[str], folder: str) -> dict[str, dict[str, Result]]:
    """Compile `cases` (prefix -> case) as one forward bundle and run it in each storage. When the group does not
    compile, each case compiles alone (graph passes only, ~0.4 CPU s; the group again after each refusal would
    cost time quadratic in its refused cases) and the refused leave it; a group whose run raises is halved down
    to the case that raises."""
    from fblc.runtime.local import LocalRunner

    results: dict[str, dict[str, Result]] = {}
    live = dict(cases)
    while live:
        bundle = os.path.join(tempfile.mkdtemp(dir=folder), "bundle")  # its own: the halves below build theirs
        problem = compiled(merged_model(live), folder, bundle)
        if problem is None:
            break
        if len(live) == 1:
            results[live.popitem()[0]] = {s: problem for s in storages}
            break
        for prefix in list(live):
            alone = compiled(live[prefix].model, folder, os.path.join(tempfile.mkdtemp(dir=folder), "bundle"))
            if alone is not None:
                results[prefix] = {s: alone for s in storages}
                del live[prefix]
        if live and all(p not in results for p in cases):  # every case compiles alone, not together: each alone
            for prefix in list(live):
                results.update(run_group({prefix: live.pop(prefix)}, storages, folder))
            return results
    if not live:
        return results
    feeds = {(f"{p}{SEPARATOR}{n}" if len(live) > 1 else n): v for p, c in live.items() for n, v in c.inputs.items()}
    for storage in storages:
        started = time.perf_counter()
        try:
            got = LocalRunner(bundle, storage=storage, progress=False).infer(feeds)
        except Exception as error:
            if len(live) > 1:
                prefixes = list(live)
                for half in (prefixes[:len(prefixes) // 2], prefixes[len(prefixes) // 2:]):
                    for prefix, by in run_group({p: live[p] for p in half}, [storage], folder).items():
                        results.setdefault(prefix, {}).update(by)
                continue
            prefix = next(iter(live))
            results.setdefault(prefix, {})[storage] = Result("failed", f"run: {_first_line(error)}")
            continue
        seconds = (time.perf_counter() - started) / len(live)
        for prefix, case in live.items():
            own = {n: got.get(f"{prefix}{SEPARATOR}{n}" if len(live) > 1 else n) for n in case.expected}
            result = compare(case, {n: v for n, v in own.items() if v is not None})
            result.seconds = seconds
            results.setdefault(prefix, {})[storage] = result
    return results


def ort_passes(case: Case) -> bool:
    import onnxruntime
    onnxruntime.set_default_logger_severity(4)  # its warnings on old opsets and errors on refused cases: the column says
    try:
        session = onnxruntime.InferenceSession(case.model.SerializeToString(), providers=["CPUExecutionProvider"])
        got = dict(zip([o.name for o in session.get_outputs()], session.run(None, case.inputs)))
    except Exception:
        return False
    return compare(case, got).status == "passed"


def _child(cases: dict[str, Case], storages: list[str], queue: multiprocessing.Queue) -> None:
    try:
        with tempfile.TemporaryDirectory() as folder:
            queue.put(run_group(cases, storages, folder))
    except BaseException as error:  # the parent reruns the group one by one
        queue.put(f"{_first_line(error)}\n{traceback.format_exc()}")


def groups_of(cases: list[Case], size: int) -> list[list[Case]]:
    """Runs of at most `size` cases of one opset (each with subgraphs alone), in the suite's order."""
    by_opset: dict[tuple, list[Case]] = defaultdict(list)
    alone = []
    for case in cases:
        if has_subgraph(case.model):
            alone.append([case])
        else:
            by_opset[tuple((o.domain, o.version) for o in case.model.opset_import)].append(case)
    runs = [group[k:k + size] for group in by_opset.values() for k in range(0, len(group), size)]
    return runs + alone


def run_all(cases: list[Case], storages: list[str], group: int, jobs: int, timeout: float,
            progress: bool = True) -> list[Outcome]:
    """Every case's outcome: groups in child processes (`jobs` at once), each killed after `timeout` s per case."""
    # forked from a clean server, not from this process: a fork of a process whose OpenCL driver already runs
    # threads (PoCL's pthread device, as in a test worker) can inherit a held lock and hang
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["onnx", "fblc.runtime.local", "fblc.codegen.compile"])
    outcomes = {case.name: Outcome(case, ort=ort_passes(case)) for case in cases}
    pending = [[c for c in g] for g in groups_of(cases, group)]
    running: list[tuple[multiprocessing.Process, multiprocessing.Queue, list[Case], float]] = []
    done_ops: Counter = Counter()
    total_ops = Counter(c.op for c in cases)
    while pending or running:
        while pending and len(running) < jobs:
            batch = pending.pop(0)
            queue = context.Queue()
            named = {f"c{k}": case for k, case in enumerate(batch)}
            process = context.Process(target=_child, args=(named, storages, queue), daemon=True)
            process.start()
            running.append((process, queue, batch, time.monotonic() + timeout * len(batch)))
        time.sleep(0.05)
        for entry in list(running):
            process, queue, batch, deadline = entry
            answer = None
            if not queue.empty():
                answer = queue.get()
            elif process.is_alive() and time.monotonic() < deadline:
                continue
            elif process.is_alive() or process.exitcode != 0 or queue.empty():
                process.kill()
                answer = f"timed out after {timeout * len(batch):.0f} s" if process.exitcode in (None, -9) \
                    else f"child exited {process.exitcode}"
            process.join()
            running.remove(entry)
            if isinstance(answer, str):
                if len(batch) > 1:
                    pending[:0] = [[c] for c in batch]
                    continue
                for storage in storages:
                    outcomes[batch[0].name].results[storage] = Result("failed", answer.splitlines()[0])
            else:
                for k, case in enumerate(batch):
                    outcomes[case.name].results.update(answer.get(f"c{k}", {}))
            for case in batch:
                done_ops[case.op] += 1
                if progress and done_ops[case.op] == total_ops[case.op]:
                    by = Counter(r.status for o in outcomes.values() if o.case.op == case.op for r in o.results.values())
                    print(f"{case.op}: {total_ops[case.op]} cases; over {'+'.join(storages)}: "
                          + ", ".join(f"{n} {s}" for s, n in sorted(by.items())),
                          file=sys.stderr, flush=True)
    return list(outcomes.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", help="comma-separated op types (default all)")
    parser.add_argument("--ops-from-kernels", action="store_true", help="the ops docs/OPS.md lists with a kernel")
    parser.add_argument("--storage", choices=[*STORAGES, "both"], default="both")
    parser.add_argument("--group", type=int, default=12, help="cases per bundle")
    parser.add_argument("-j", "--jobs", type=int, default=1)
    parser.add_argument("--case-timeout", type=float, default=60.0, help="seconds per case")
    parser.add_argument("--out", help="write the report here (default: print it)")
    parser.add_argument("--save", help="also write the outcomes as JSON here")
    parser.add_argument("--report-from", help="comma-separated saved outcomes: report them, run nothing")
    parser.add_argument("--except-ops-from-kernels", action="store_true", help="leave out the ops with a kernel")
    args = parser.parse_args(argv)
    command = "python benchmarks/onnx_conformance.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.report_from:
        outcomes, storages, seconds, skipped, runs = load_outcomes(args.report_from.split(","))
        return write(report(outcomes, storages, command.strip(), seconds, skipped, runs), args.out)
    ops = set(args.ops.split(",")) if args.ops else None
    if args.ops_from_kernels:
        ops = (ops or set()) | kernel_ops()
    storages = list(STORAGES) if args.storage == "both" else [args.storage]
    started, commit = time.perf_counter(), commit_of_tree()  # the tree the run tests: a later commit may land meanwhile
    cases = load_cases(ops, leave_out=kernel_ops() if args.except_ops_from_kernels else set())
    skipped = len(SKIPPED)
    print(f"{len(cases)} cases of {len({c.op for c in cases})} ops", file=sys.stderr, flush=True)
    outcomes = run_all(cases, storages, args.group, args.jobs, args.case_timeout)
    seconds = time.perf_counter() - started
    if args.save:
        save_outcomes(args.save, outcomes, storages, seconds, skipped, command.strip(), commit)
    return write(report(outcomes, storages, command.strip(), seconds, skipped), args.out)


def kernel_ops() -> set[str]:
    """The ops docs/OPS.md's tables give a kernel (yes, view or lowered)."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "OPS.md")
    ops = set()
    with open(path) as handle:
        for line in handle:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) >= 5 and cells[4] in ("yes", "view", "lowered"):
                ops.add(cells[0])
    return ops


if __name__ == "__main__":
    sys.exit(main())
