"""The architecture zoo table: each tiny transformers architecture, one SGD step in fblc vs PyTorch.

    python benchmarks/zoo.py [--only llama,bert,...] [--markdown]

Runs the harness of tests/test_zoo.py (tests/support/zoo_check.py) on every zoo entry and prints
one row per architecture: family, exporter, the exported model's op count, the result (ok, FAIL,
or the error that stopped it, with the entry's xfail mark, or a note that the exporter folded parameters away), the worst error relative
to the tolerance (|fblc - torch| / (rtol |torch| + floor); 1.0 is the limit) and the seconds taken.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)

from support import zoo, zoo_check  # noqa: E402


def _row(arch: zoo.Architecture, directory: str) -> tuple[str, ...]:
    started = time.perf_counter()
    mark = f" [xfail: {arch.xfail_until}]" if arch.xfail_until else (" [folded by the exporter]" if arch.folded else "")
    try:
        outcome = zoo_check.check(arch, directory)
    except Exception as error:  # noqa: BLE001 - a table row, not a test: report what stopped it
        message = " ".join(str(error).split())[:120]
        return (arch.name, arch.family, arch.exporter, "-", f"{type(error).__name__}: {message}{mark}", "-",
                f"{time.perf_counter() - started:.1f}")
    result = "ok" if outcome.ok else "FAIL: " + " ".join(outcome.failure().split())[:120]
    return (arch.name, arch.family, arch.exporter, str(outcome.ops), result + mark, f"{outcome.worst:.3g}",
            f"{outcome.seconds:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated architecture names")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = parser.parse_args()
    chosen = [zoo.BY_NAME[n] for n in args.only.split(",")] if args.only else zoo.ZOO
    header = ("architecture", "family", "exporter", "ops", "result", "worst/tol", "s")
    rows = []
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as directory:
        for arch in chosen:
            rows.append(_row(arch, directory))
            if not args.markdown:
                print("  ".join(rows[-1]), flush=True)
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for row in rows:
            print("| " + " | ".join(row) + " |")
    passed = sum(r[4].startswith("ok") for r in rows)
    print(f"\n{passed}/{len(rows)} train like PyTorch; {sum(float(r[6]) for r in rows):.0f} s in all")


if __name__ == "__main__":
    main()
