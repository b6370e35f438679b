"""`fblc tune`: kernel shape keys in plan.json, profile `schedules` entries by shape, and the tuning loop.

Golden: a tune run on PoCL writes a valid profile whose entry (keyed by the kernel's shape, with a measured
source) a later compile for that profile applies (plan.json records the tuned value; the bundle's profile digest
changes). Negative: a candidate whose kernel writes different outputs is dropped however fast it is; a profile
entry by shape without a source, an unknown --device, a model with nothing to tune are clear errors. Numeric: the
candidates run on the device, each kernel compared with the default bundle's on the same inputs
(runtime/tune.py's tolerance). The times are rigged (a kernel off its default schedule "takes" half the time):
which schedule is faster on this shared CPU is noise at this size, and the test is of what tune does with it.
"""

from __future__ import annotations

import json
import os
from typing import Any

import onnx
import pytest

from fblc import bundle_format as fmt
from fblc.cli import main
from fblc.codegen.compile import compile_model
from fblc.codegen.schedule import OVERRIDABLE, load_overrides
from fblc.errors import FblcError
from fblc.profiles import load_profile, parse_profile
from fblc.runtime.tune import LocalBench, difference
from fblc.tools.tune import tune
from tests.conftest import mlp_proto
from tests.test_runtime import OPTIONS

import numpy as np


def _schedules(bundle: str) -> dict[str, dict[str, Any]]:
    with open(os.path.join(bundle, fmt.PLAN), encoding="utf-8") as handle:
        plan = json.load(handle)
    return {k["name"]: {f: k["schedule"][f] for f in OVERRIDABLE} | {"key": k["schedule"]["shape_key"]}
            for k in plan["kernels"]}


class RiggedBench(LocalBench):
    """LocalBench's real runs and checks; a kernel off its default schedule takes half the time, and a kernel
    whose name ends in `corrupt`, off its default, adds 1 to its first output after each launch (a wrong kernel)."""

    def __init__(self, feeds: Any, corrupt: str) -> None:
        super().__init__(feeds, repeats=1)
        self.corrupt, self.defaults = corrupt, {}

    def reference(self, bundle: str, watched: Any) -> Any:
        self.defaults = _schedules(bundle)
        return super().reference(bundle, watched)

    def _runner(self, bundle: str) -> Any:
        runner = super()._runner(bundle)
        runner.changed = {n for n, s in _schedules(bundle).items() if s != self.defaults.get(n, s)}
        launch = runner.launch

        def launched(index: int, *args: Any, **kwargs: Any) -> Any:
            event = launch(index, *args, **kwargs)
            spec = runner.plan["kernels"][index]
            if spec["name"].endswith(self.corrupt) and spec["name"] in runner.changed:
                runner.queue.finish()
                runner.upload(spec["outputs"][0], runner._read(spec["outputs"][0]) + 1.0)
            return event

        runner.launch = launched
        return runner

    def _times(self, runner: Any) -> dict[str, float]:
        return {name: 0.5 if name in runner.changed else 1.0 for name in super()._times(runner)}


def test_tune_keeps_a_faster_schedule_drops_a_wrong_one_and_a_later_compile_applies_it(tmp_path) -> None:
    model, out = str(tmp_path / "mlp.onnx"), str(tmp_path / "tuned.json")
    onnx.save(mlp_proto(), model)
    lines: list[str] = []
    result = tune(model, OPTIONS, "local", "fp32", lambda feeds: RiggedBench(feeds, corrupt="_MatMul"), out,
                  budget_s=600, pattern="Gemm|MatMul", limit=2, say=lines.append)
    gemm, matmul = sorted(result.shapes, key=lambda s: s.kernels[0].endswith("_MatMul"))
    assert gemm.kernels == ["k0_Gemm"] and [k.endswith("_MatMul") for k in matmul.kernels] == [True], lines
    tuned_fields = gemm.candidates[1]
    assert gemm.best == 1 and tuned_fields and set(tuned_fields) <= {"tile_rows", "tile_columns", "group_size",
                                                                     "accumulator_form", "pair_stride"}, lines
    assert matmul.best == 0 and "differ from the default's" in matmul.dropped[1], lines
    with open(out, encoding="utf-8") as handle:
        raw = json.load(handle)
    parse_profile(raw, out)
    entry = raw["schedules"][gemm.key]
    assert set(raw["schedules"]) == {gemm.key} and entry["source"].startswith("measured: fblc tune ")
    assert {k: entry[k] for k in tuned_fields} == tuned_fields

    compile_model(model, str(tmp_path / "default"), "local", "fp32", OPTIONS)
    compile_model(model, str(tmp_path / "tuned"), out, "fp32", OPTIONS)
    default, tuned = _schedules(str(tmp_path / "default")), _schedules(str(tmp_path / "tuned"))
    assert default["k0_Gemm"]["key"] == tuned["k0_Gemm"]["key"] == gemm.key
    assert {k: tuned["k0_Gemm"][k] for k in tuned_fields} == tuned_fields != {k: default["k0_Gemm"][k]
                                                                               for k in tuned_fields}
    assert tuned[matmul.kernels[0]] == default[matmul.kernels[0]]
    digests = [fmt.load_manifest(str(tmp_path / b))["profile_digest"] for b in ("default", "tuned")]
    assert digests[0] != digests[1]


def test_the_tolerance_takes_reassociation_and_refuses_more() -> None:
    rng = np.random.default_rng(0)
    terms = rng.standard_normal((64, 4096)).astype(np.float32)
    forward, backward = terms.sum(axis=1), terms[:, ::-1].sum(axis=1)  # the same sums, another order
    assert difference(forward, backward, "rgba_f32") == ""
    wrong = forward.copy()
    wrong[3] += 0.01 * np.abs(forward).max()  # a term of the sum lost, or one more
    assert "max abs difference" in difference(forward, wrong, "rgba_f32")
    cancelling = np.concatenate([terms, -terms[:, rng.permutation(4096)]], axis=1)  # sums ~0: rounding left
    first, second = cancelling.sum(axis=1), cancelling[:, ::-1].sum(axis=1)
    assert difference(first, second, "rgba_f32") != ""  # against the result alone, rounding looks like an error
    assert difference(first, second, "rgba_f32", inputs_scale=float(np.abs(terms).max())) == ""
    assert difference(first, second + 0.01, "rgba_f32", inputs_scale=float(np.abs(terms).max())) != ""
    mask = (forward > 0).astype(np.int64)
    assert difference(mask, 1 - mask, "r_mask8").startswith(f"{mask.size} of {mask.size} elements differ")


def test_a_shape_entry_needs_a_source_and_an_unknown_shape_is_skipped(tmp_path) -> None:
    local = load_profile("local")
    raw = {**local.raw, "schedules": {"Gemm/0123456789abcdef": {"tile_rows": 4}}}
    with pytest.raises(FblcError, match="schedules entry 'Gemm/0123456789abcdef' has source None"):
        load_overrides(None, parse_profile(raw, "p.json"))
    raw["schedules"]["Gemm/0123456789abcdef"]["source"] = "measured: fblc tune 2026-01-01 on somewhere"
    assert load_overrides(None, parse_profile(raw, "p.json")) == {"Gemm/0123456789abcdef": {"tile_rows": 4}}


def test_tune_errors_name_the_device_and_the_missing_choices(tmp_path, capsys) -> None:
    model = str(tmp_path / "mlp.onnx")
    onnx.save(mlp_proto(), model)
    assert main(["tune", model, "--device", "phone", "-o", str(tmp_path / "t.json")]) == 2
    assert "unknown --device 'phone'; give local, opencl:P:D" in capsys.readouterr().err
    assert main(["tune", model, "--kernels", "Conv", "-o", str(tmp_path / "t.json"), "-q"]) == 2
    assert "no kernel of" in capsys.readouterr().err and not os.path.exists(tmp_path / "t.json")
