"""Target profiles (format, provenance, validation), the texture-cache model and the profiler."""

from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest

from fblc.cli import main
from fblc.errors import FblcError
from fblc.profiles import FIGURES, load_profile, parse_profile, shipped_targets
from fblc.profiles.cache_model import CacheGeometry, TextureCache, pattern_reads, simulate
from fblc.profiles.profile import TARGETS_DIR
from tests.support.profile_plan import small_profile_plan

SIDE = 512


def test_shipped_profiles_load_and_every_figure_says_where_it_came_from(capsys) -> None:
    assert {"adreno830", "adreno730", "mali-g925", "local"} <= set(shipped_targets())
    for name in shipped_targets():
        profile = load_profile(name)
        assert set(profile.sources) == set(FIGURES)
        assert all(source.split(":")[0] in ("measured", "vendor documentation", "paper", "estimated")
                   or source.startswith("measured") for source in profile.sources.values())
    assert main(["targets"]) == 0
    out = capsys.readouterr().out
    assert "adreno830" in out and "mali-g925" in out and "8x4" in out
    # what the device holds at once: adreno830's 6 units x 4 waves x 64 (a figure change moves it)
    row = next(line for line in out.splitlines() if line.startswith("adreno830"))
    assert f" {load_profile('adreno830').device_items} " in row and " 1536 " in row


def _local() -> dict:
    with open(os.path.join(TARGETS_DIR, "local.json"), encoding="utf-8") as handle:
        return json.load(handle)


@pytest.mark.parametrize("edit, message", [
    (lambda p: p["figures"].pop("l1_bytes"), "lacks the figures l1_bytes"),
    (lambda p: p["figures"]["tex_block_width"].update(value=3), "tex_block_width is 3: a texture-cache block side is a power of two"),
    (lambda p: p["figures"]["l2_bytes"].update(value=1024), "l2_bytes 1024 is smaller than l1_bytes"),
    (lambda p: p["figures"]["wave_size"].update(value=-8), "'wave_size' (work-items per wave / warp / subgroup) is -8: it must be positive"),
    (lambda p: p["figures"]["fp16"].update(value="yes"),
     "'fp16' (cl_khr_fp16: kernels compute in half under --dtype fp16; half textures need no figure) must be "
     "true or false"),
    (lambda p: p["figures"]["peak_gflops"].update(source="trust me"), "'peak_gflops' has source 'trust me'; it must start with one of"),
    (lambda p: p.pop("gpu"), "'gpu' is missing or empty"),
    (lambda p: p["figures"]["private_floats"].update(value=132), "private_floats is 132: a work-item's accumulators are whole float4s, 4 to 128 floats on a CPU"),
    (lambda p: p["figures"]["cpu"].update(value=False), "private_floats is 128: a work-item's accumulators are whole float4s, 4 to 64 floats on a GPU"),
    (lambda p: p["figures"]["half_rate"].update(value=8.0), "half_rate is 8.0: half arithmetic runs 1 to 4 times"),
], ids=["missing", "block-not-power-of-two", "l2-below-l1", "negative", "bool", "no-provenance", "no-gpu", "private",
        "private-gpu", "half-rate"])
def test_bad_profiles_are_refused_with_what_to_fix(edit, message: str) -> None:
    document = copy.deepcopy(_local())
    edit(document)
    with pytest.raises(FblcError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_profile(document, "bad.json")


def test_unknown_target_and_unreadable_file(tmp_path) -> None:
    with pytest.raises(FblcError, match="unknown target 'adreno999'; choose one of: adreno730, adreno830"):
        load_profile("adreno999")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(FblcError, match="is not valid JSON"):
        load_profile(str(broken))


def test_lru_sets_evict_the_least_recent_block() -> None:
    cache = TextureCache(CacheGeometry(block_width=4, block_height=1, sets=1, ways=2))
    blocks = np.array([0, 1, 0, 2, 1])  # 0 1 hit0 2(evicts 1) 1(miss)
    assert cache.access(blocks, np.zeros(5, int)) == 4


def _misses(geometry: CacheGeometry, pattern: str, threads: int) -> int:
    total = SIDE * SIDE // 4
    return simulate(geometry, pattern_reads(pattern, threads, 4, SIDE, SIDE, total), total // threads, sample=16).misses


def test_the_model_prefers_the_pattern_that_matches_the_block_shape() -> None:
    """A CPU-like cache (a 64-byte line = 4 texels of a row) favours row-major; 8x8 blocks favour Block-8."""
    line = CacheGeometry(block_width=4, block_height=1, sets=64, ways=8)
    square = CacheGeometry(block_width=8, block_height=8, sets=16, ways=4)
    assert _misses(line, "row-major", 64) <= _misses(line, "block-8", 64) < _misses(line, "column-major", 64)
    assert _misses(square, "block-8", 64) < _misses(square, "row-major", 64)
    stats = simulate(square, pattern_reads("block-8", 64, 4, SIDE, SIDE, SIDE * SIDE // 4), 100, sample=10)
    assert stats.texel_reads == 100 * 64 * 4 and stats.block_fetches <= stats.misses and 0 <= stats.hit_rate <= 1


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> str:
    """`fblc profile --device local`: the profile's path. (How long it takes, and whether the measured
    pattern speeds rank as the cache model does, depend on machine load: benchmarks/profile_ranking.py.)"""
    out = str(tmp_path_factory.mktemp("profile") / "mydevice.json")
    with small_profile_plan():  # the shipped plan's path at a twentieth of its work (tests/support/profile_plan.py)
        assert main(["profile", "--device", "local", "-o", out]) == 0
    return out


def test_profile_measures_the_local_device_and_compiles_for_it(measured, tmp_path, capsys) -> None:
    out = measured
    profile = load_profile(out)
    assert profile.sources["tex_block_width"].startswith("measured")
    assert profile.sources["compute_units"].startswith("measured") and profile.device_items >= profile.wave_size
    measured = profile.raw["measurements"]["pattern_reads_per_second"]
    assert set(measured) == {"row-major", "column-major", "block-4", "block-8"}
    assert all(rate > 0 for row in measured.values() for rate in row.values())
    assert main(["profile", "--show", out]) == 0
    assert "relative to column-major" in capsys.readouterr().out
    assert os.path.getsize(out[: -len(".json")] + ".png") > 1000
    from tests.test_runtime import OPTIONS, elementwise_model
    from fblc.codegen.compile import compile_model

    compile_model(elementwise_model(str(tmp_path / "m.onnx")), str(tmp_path / "b"), out, "fp32", OPTIONS)
    assert json.load(open(tmp_path / "b" / "manifest.json"))["target"] == "mydevice"


def test_a_device_that_rejects_a_benchmark_kernel_is_a_clear_error(monkeypatch, capsys, tmp_path) -> None:
    from fblc.profiles import profiler

    monkeypatch.setattr(profiler, "SOURCE", profiler.SOURCE.replace("__kernel void fma_loop(", "__kernel void fma_loop(oops "))
    assert main(["profile", "--device", "local", "-o", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    first = err.splitlines()[0]  # the cause and the remedy on one line; the compiler's log below it
    assert "rejected the benchmark kernel 'fma_loop' (line " in first and "profile another device" in first
    assert "oops" in err
    assert not os.path.exists(tmp_path / "p.json")


def _timings(plan: dict, knee_x: int = 8, knee_y: int = 2, fitting_blocks: int = 512) -> dict:
    """Raw results, as a backend returns them, of a device with block_width knee_x, block_height knee_y, an L1
    of `fitting_blocks` blocks, 20 GB/s and 100 GFLOP/s, whose Block-8 launches of 64 work-items it refused."""
    from fblc.profiles.profiler import FORMAT_VERSION, RESULTS_FORMAT

    rates = {"row-major": 4e9, "column-major": 1e9, "block-4": 2e9, "block-8": 3e9}
    launches = []
    for launch in plan["launches"]:
        what = launch["measures"]
        if what["probe"] == "pattern":
            if what["pattern"] == "block-8" and what["threads"] == 64:
                launches.append({"id": launch["id"], "skipped": "local size 64 > 32"})
                continue
            seconds = what["texel_reads"] / (rates[what["pattern"]] * what["threads"] / 8)
        elif what["probe"] == "pair":
            knee = knee_x if what["axis"] == "x" else knee_y
            noisy = launch["id"].endswith("round 1")  # one slow round: each offset keeps its cheapest
            seconds = what["pairs"] * (5e-9 if what["offset"] >= knee or noisy else 1e-9)
        elif what["probe"] == "footprint":
            fits = what["blocks"] <= fitting_blocks or what["block_width"] != knee_x  # only knee_x's run counts
            seconds = what["reads"] * (1e-9 if fits else 4e-9)
        else:
            seconds = what["bytes"] / 20e9 if what["probe"] == "bandwidth" else what["flops"] / 100e9
        launches.append({"id": launch["id"], "seconds": seconds})
    return {"format": RESULTS_FORMAT, "version": FORMAT_VERSION, "backend": "synthetic", "seconds": 1.0,
            "device": {"name": "Synthetic GPU", "vendor": "Nobody", "version": "OpenCL 3.0", "image2d_max_width": 16384,
                       "image2d_max_height": 8192, "max_work_group_size": 256, "global_mem_cache_size": 1 << 20,
                       "max_compute_units": 2, "max_clock_frequency": 390},
            "kernels": {"pattern_read": {"work_group_size": 32, "preferred_work_group_size_multiple": 32}},
            "launches": launches}


def test_one_interpretation_of_raw_timings_for_every_backend() -> None:
    """interpret() is the only reader of timings (pyopencl's and the native runner's): knees, capacity at the
    measured block width, throughput relative to column-major, device facts, skipped launches left out."""
    from fblc.profiles.profiler import fill_texels, interpret, measurement_plan

    plan = measurement_plan()
    document = interpret(plan, _timings(plan), "synthetic")
    profile = parse_profile(document, "synthetic")
    assert (profile.tex_block_width, profile.tex_block_height, profile.line_bytes) == (8, 2, 128)
    assert profile.l1_bytes == 512 * 8 * 16 and profile.l2_bytes == 1 << 20
    assert (profile.bandwidth_gbps, profile.peak_gflops, profile.wave_size) == (20.0, 100.0, 32)
    assert (profile.image2d_max_width, profile.image2d_max_height, profile.max_work_group_size) == (16384, 8192, 256)
    # 100 GFLOP/s at 390 MHz: 128 lanes, over 2 compute units of 32-wide waves
    assert (profile.compute_units, profile.waves_per_unit, profile.device_items) == (2, 2, 128)
    assert profile.sources["waves_per_unit"].startswith("measured") and "128 lanes" in profile.sources["waves_per_unit"]
    older = _timings(plan)  # a runner that reports neither: local.json's estimates stay
    del older["device"]["max_compute_units"], older["device"]["max_clock_frequency"]
    assert parse_profile(interpret(plan, older, "older"), "older").sources["compute_units"].startswith("estimated")
    relative = document["measurements"]["relative_to_column_major"]
    assert relative["row-major"] == {"8": 4.0, "16": 4.0, "32": 4.0, "64": 4.0}
    assert list(relative["block-8"]) == ["8", "16", "32"]
    assert document["measurements"]["backend"] == "synthetic"
    broken = _timings(plan)
    broken["launches"].pop()
    with pytest.raises(FblcError, match="time other launches than the plan holds; rebuild the native runner"):
        interpret(plan, broken, "synthetic")
    # the image fill both backends write: (scramble(k ^ seed) >> 8) / 2^23 - 1, here against plain integers
    texels = fill_texels(4, 2, 7).reshape(-1)

    def scramble(v: int) -> int:
        v ^= v >> 16
        v = (v * 0x7FEB352D) & 0xFFFFFFFF
        v ^= v >> 15
        v = (v * 0x846CA68B) & 0xFFFFFFFF
        return v ^ (v >> 16)

    assert [float(t) for t in texels] == [(scramble(k ^ 7) >> 8) / 2 ** 23 - 1 for k in range(32)]
