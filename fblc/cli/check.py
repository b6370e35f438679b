"""`fblc check MODEL`: which of the model's ops fblc supports, and whether it trains and runs, without compiling.

Exit 0 when everything the step needs is supported, 1 when something is missing (printed),
2 for bad input as every command (fblc.cli.main).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Sequence

from fblc.cli.options import training_options

if TYPE_CHECKING:  # the analysis imports the whole compiler: only when the command runs
    from fblc.tools.coverage import Coverage

COLUMNS = ("op", "nodes", "import", "gradient", "kernel", "layout class")


def table(rows: Sequence[Sequence[str]], right: Sequence[int] = (1,)) -> list[str]:
    """A plain table with aligned columns (the CLI draws no rich tables); `right`: right-aligned columns."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [cell.rjust(widths[i]) if i in right else cell.ljust(widths[i]) for i, cell in enumerate(row)]
        lines.append("  ".join(cells).rstrip())
    return lines


def _verdict(label: str, ok: bool, detail: str) -> str:
    return f"{label}: {'yes' if ok else 'no'} - {detail}"


def report(model_path: str, coverage: Coverage) -> str:
    """What `fblc check` prints: the op table, then one line per question."""
    rows = [COLUMNS] + [(r.op, str(r.nodes), r.imported, r.gradient, r.kernel, r.layout) for r in coverage.rows]
    nodes = sum(r.nodes for r in coverage.rows)
    lines = [f"{model_path}: {nodes} nodes of {len(coverage.rows)} op types after import"]
    if coverage.lowered:
        lines.append("lowered at import into the ops below: " + ", ".join(
            f"{op} ({count} node{'s' if count != 1 else ''})" for op, count in coverage.lowered.items()))
    lines += [*table(rows), ""]
    lines.append(_verdict("import", coverage.imports.ok, coverage.imports.detail))
    lines.append(_verdict("train (graph mode)", coverage.trains.ok, coverage.trains.detail))
    lines.append(_verdict("run on the device", coverage.runs.ok, coverage.runs.detail))
    applies = [kind for kind, v in coverage.adapters.items() if v.ok]
    lines.append(f"adapters: {', '.join(applies) if applies else 'none apply'}")
    for kind, verdict in coverage.adapters.items():
        lines.append(_verdict(f"  {kind}", verdict.ok, verdict.detail))
    lines.extend(coverage.trained)
    lines.append("supported: everything this model's training step needs" if coverage.supported else
                 "missing: see the 'no' lines above; docs/ARCHITECTURE.md section 8 says how to add an op")
    return "\n".join(lines)


def cmd_check(args: argparse.Namespace) -> int:
    from fblc.tools.coverage import check_model
    from fblc.compiler.model_io import load_model

    coverage = check_model(load_model(args.model), training_options(args))
    if not args.quiet:
        print(report(args.model, coverage))
    return 0 if coverage.supported else 1


def add_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from fblc.cli.options import add_training_options

    check = commands.add_parser(
        "check", help="list MODEL's ops and what fblc supports of them, without compiling",
        description="Import MODEL and print each of its op types with its node count and status: import (shape "
                    "inference), gradient rule (needed, not needed, missing), OpenCL kernel emitter, FTD layout "
                    "class; then whether the model trains (graph mode), runs on the device, and which adapters "
                    "apply. The options change the step checked as they change the one compiled (--adapter, "
                    "--rank, --adapter-sites, --block, --fura-sites and --tile-mb: the adapter's ops and the "
                    "trained set); check covers the backprop step, not ES's (--trainer es). Exit 0 when everything "
                    "is supported, 1 when something is missing.")
    add_training_options(check, step=False)
    check.set_defaults(run=cmd_check)
