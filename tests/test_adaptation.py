"""benchmarks/adaptation.py's smallest path: the digits CNN pretrained briefly, exported, and adapted by
FuRA-S ES on the local device for a few steps, with the figures its table prints read from the run."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest


@pytest.mark.slow  # about 15 s (torch's export, a PoCL build): CI leaves it to pytest -m slow
def test_fura_s_es_adapts_the_pretrained_digits_cnn(tmp_path):
    pytest.importorskip("sklearn")  # imported here: collecting this file costs CI no torch import
    pytest.importorskip("torch")
    from benchmarks import adaptation
    from benchmarks.adaptation_models import digits_task

    task = digits_task(str(tmp_path), batch=32, steps=30)
    scale = dataclasses.replace(adaptation.QUICK, pairs=2)
    fura_s = next(t for t in adaptation.TRAINERS if t.adapter == "fura-s")
    result = adaptation.adapt(task, fura_s, sigma=0.05, lr=1.0, scale=scale, steps=3, seed=0, split="val")
    assert result["loss after"] != result["loss before"]  # the delta moved: the evaluation reads trained values
    assert 0 < result["values"] < 1000  # block singular values of the two Gemm weights, not the weights
    assert result["device peak"] > 0 and 0.0 <= result["beat"] <= 1.0
    assert 0.0 <= result["accuracy after"] <= 1.0 and np.isfinite(result["loss after"])
    written = os.stat(task.path).st_mtime_ns
    digits_task(str(tmp_path), batch=32, steps=30)
    assert os.stat(task.path).st_mtime_ns == written  # cached: no second pretraining and export
