"""The benchmark scripts still run: each on its smallest case, its table checked for figures that can be.

benchmarks/instructions.py on examples/mlp.py's MLP (two steps under oclgrind, about 3 s).
"""

from __future__ import annotations

import os
import re
import shutil

import pytest

#: multiply-adds of the MLP's forward pass, [8, 32] through 32 -> 64 -> 64 -> 10
MLP_FORWARD_MACS = 8 * (32 * 64 + 64 * 64 + 64 * 10)


def test_instruction_counts_print_a_table_of_both_layouts(capsys) -> None:
    """The step's FMAs are its contractions' multiply-adds whichever layout holds them (the forward's
    and the two backward products', so between 1x and 4x the forward's); every kernel reads and
    writes images; the last column is naive / rtile."""
    if shutil.which("oclgrind") is None:
        if os.environ.get("FBLC_CI") == "1":
            pytest.fail("oclgrind is missing (FBLC_CI=1: .ci/run should have installed it)")
        pytest.skip("oclgrind (apt-get install oclgrind) is missing")
    from benchmarks import instructions

    assert instructions.main(["--models", "mlp"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "one training step under oclgrind, compiled for adreno830", lines
    rows = {}
    for line in lines[2:]:
        row = re.fullmatch(r"mlp B=8 +(\D+?) +([\d,.]+) +([\d,.]+) +([\d.]+|-)", line)
        assert row, line
        figure, naive, rtile, ratio = row.groups()
        rows[figure] = (float(naive.replace(",", "")), float(rtile.replace(",", "")), ratio)
    assert list(rows) == list(instructions.FIGURES) + ["div/rem per FMA"], lines
    naive_fmas, rtile_fmas, _ = rows["FMAs"]
    assert naive_fmas == rtile_fmas and MLP_FORWARD_MACS <= rtile_fmas <= 4 * MLP_FORWARD_MACS, rows["FMAs"]
    for figure in ("image reads", "image writes", "float add/mul/div"):
        naive, rtile, ratio = rows[figure]
        assert naive > 0 and rtile > 0 and float(ratio) == pytest.approx(naive / rtile, abs=0.006), (figure, ratio)
