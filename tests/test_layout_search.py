"""The layout search decides: traced access streams pick the layout of least estimated time.

`--layout-search traced` replays the texels the step's kernels really read (traced once under flat
layouts: fblc.tools.traced_layouts) through each candidate layout and the target's texture-cache
model; each reading launch's misses enter the target's time estimate, which decides. The unit test would fail with a constant scorer (the block-count order would stand); the
model test compiles a real export under the traced search and checks its step against onnxruntime.
"""

from __future__ import annotations

import dataclasses
import numpy as np
import pytest

from fblc.compiler.optimizers import OptimizerConfig
from fblc.errors import FblcError
from fblc.passes.layout_score import (
    TRACED_CANDIDATES,
    Access,
    Geometry,
    TracedStream,
    block_efficiency,
    rank_candidates,
    rank_folds,
    rescore_traced,
)
from fblc.passes.pipeline import TrainingOptions
from fblc.profiles import load_profile
from fblc.profiles.cache_model import TextureCache
from fblc.texel_layout import TexelLayout

GEOMETRY = Geometry.of(load_profile("adreno830"))


def _misses(layout: TexelLayout, texels: np.ndarray) -> int:
    cache = TextureCache(GEOMETRY.cache)
    return cache.access(*cache.blocks_of(*layout.coords(texels)))


def test_traced_streams_choose_the_candidate_with_the_fewest_simulated_misses() -> None:
    """A [256, 256] tensor that the block count scores for a stream, read by a kernel whose 64 work-items
    each own a row and walk 16 texels along it (every item's k-th read before any (k+1)-th): the traced
    re-score must put first the candidate with the fewest misses on that walk, fewer than the block
    count's choice (a constant scorer would keep the block count's order)."""
    rows, texel_cols, items, steps = 256, 64, 64, 16
    walk = (np.arange(steps)[:, None] + np.arange(items)[None, :] * texel_cols).reshape(-1)  # issue order
    ranked = rank_candidates(rows, texel_cols * 4, (("stream", 1.0),), GEOMETRY)
    rescored = rescore_traced(ranked, [TracedStream(walk, 1.0)], GEOMETRY)
    assert rescored[0].scored_by == "traced estimate"
    misses = {c.layout: _misses(c.layout, walk) for c in ranked[:TRACED_CANDIDATES]}
    assert misses[rescored[0].layout] == min(misses.values())
    assert misses[rescored[0].layout] < misses[ranked[0].layout], (rescored[0].layout, ranked[0].layout)


def test_misses_in_a_launch_bound_by_its_arithmetic_decide_nothing() -> None:
    """Two launches read a [256, 256] tensor: A, 200 times, with 4 work-items walking 128 texels of their
    rows (2x128 tiles miss least: 12 blocks against 16), and B once, with 64 work-items walking 16 (2x128
    tiles miss 512, the others 32). By misses alone, A's weight picks 2x128. When A's arithmetic takes
    longer than its reads ever could, only B's reads change the estimate, and it picks a tile B misses
    least on; a scorer that counts misses, or a constant one, keeps 2x128."""
    rows, texel_cols = 256, 64
    walk_a = (np.arange(128)[:, None] + np.arange(4)[None, :] * texel_cols).reshape(-1)
    walk_b = (np.arange(16)[:, None] + np.arange(64)[None, :] * texel_cols).reshape(-1)
    ranked = rank_candidates(rows, texel_cols * 4, (("stream", 1.0),), GEOMETRY)[:TRACED_CANDIDATES]
    tiles_of_2x128 = [c.layout for c in ranked if (c.layout.tile_h, c.layout.tile_w) == (2, 128)]
    assert tiles_of_2x128 and _misses(tiles_of_2x128[0], walk_b) > _misses(ranked[-1].layout, walk_b)

    def choice(compute_ms_of_a: float) -> TexelLayout:
        streams = [TracedStream(walk_a, 200.0, "a", compute_ms_of_a), TracedStream(walk_b, 1.0, "b")]
        return rescore_traced(ranked, streams, GEOMETRY)[0].layout

    assert choice(0.0) == tiles_of_2x128[0]  # both launches bound by their reads: the fewest misses win
    bound = choice(1000.0)
    assert bound != tiles_of_2x128[0] and _misses(bound, walk_b) == min(_misses(c.layout, walk_b) for c in ranked)


def test_the_block_search_ranks_by_the_estimate_of_the_kernels_that_walk_a_tensor() -> None:
    """A flat [64, 1024] tensor streamed by a kernel moving 10x its elements and walked by rows by
    another: the stream wants square folds (128 x 128: rows at half efficiency), the rows walk a wide
    fold. With both kernels bound by their reads, the stream's weight picks the square fold; when the
    streaming kernel's arithmetic outlasts its reads, only the rows walk changes the estimate, and a fold
    it reads at full efficiency wins (a constant scorer, or the block count, keeps one order)."""
    shape, rows, texel_cols = (64, 1024), 64, 256

    def choice(compute_ms_of_stream: float) -> TexelLayout:
        accesses = (Access("stream", 10.0 * 65536, compute_ms_of_stream), Access("rows", 65536.0))
        return rank_folds(shape, accesses, GEOMETRY)[0].layout

    free = choice(0.0)
    assert block_efficiency(free, "stream", rows, texel_cols, GEOMETRY) == 1.0
    assert block_efficiency(free, "rows", rows, texel_cols, GEOMETRY) < 1.0
    bound = choice(1000.0)
    assert bound != free and block_efficiency(bound, "rows", rows, texel_cols, GEOMETRY) == 1.0


def test_traced_search_needs_traced_reads() -> None:
    from fblc.passes.rtile_select import RTileSelect

    with pytest.raises(FblcError, match="needs the reads of the step's kernels"):
        RTileSelect(load_profile("adreno830"), "rtile", "traced")


def test_traced_layouts_train_like_onnxruntime(tmp_path) -> None:
    """The exported MLP of the tests under the traced search: its report says which tensors the traced
    reads chose, and its step equals onnxruntime's (loss and every updated parameter, rtol 1e-4 /
    atol 1e-5). What the traced choice saves on whole steps of the Llama decoder and MobileNetV2 is
    measured by benchmarks/layout_ablation.py (each bundle's own kernels traced and replayed)."""
    from fblc.codegen.compile import compile_model
    from fblc.compiler.model_io import save_model_atomically
    from fblc.compiler.reference import ReferenceStep
    from fblc.runtime.local import LocalRunner
    from fblc.tools.traced_layouts import with_traced_reads
    from tests.support import models

    exported = models.mlp(str(tmp_path))
    feeds = {**exported.inputs, "labels": exported.labels}
    options = TrainingOptions(input_shapes=exported.input_shapes, loss="cross_entropy", layout_search="traced",
                              optimizer=OptimizerConfig("sgd", lr=0.1, momentum=0.9))
    bundle = str(tmp_path / "traced")
    step, report = compile_model(exported.path, bundle, "adreno830", "fp32",
                                 with_traced_reads(exported.path, "adreno830", "fp32", options, feeds))
    assert report["layout"]["search"] == "traced"
    assert "traced estimate" in {t["scored_by"] for t in report["layout"]["tensors"]}
    save_model_atomically(step, str(tmp_path / "step.onnx"))
    reference = ReferenceStep(str(tmp_path / "step.onnx"))
    runner = LocalRunner(bundle, progress=False, storage="image")  # the layouts place texels in images
    assert np.isclose(runner.step(feeds), reference.step(feeds), rtol=1e-4, atol=0)
    expected, got = reference.parameters(), runner.parameters()
    differ = [name for name in expected if not np.allclose(got[name], expected[name], rtol=1e-4, atol=1e-5)]
    assert not differ, differ
