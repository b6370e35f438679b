"""Texture placement: every image fits the portable edge when it can, and the layout search picks the fold.

Images stay within PORTABLE_IMAGE_EDGE x PORTABLE_IMAGE_EDGE (what the pip PoCL, oclgrind and most phone
drivers allow) whenever a tensor's texels fit in that square, whatever the target allows; only a
larger tensor uses the target's own limit, and the compile report names it. A flat tensor's fold is
chosen by the same cache-geometry score as R-Tile tiles. The numeric side, phone-target bundles that
run on PoCL and equal onnxruntime, is tests/test_device_models.py; here, several steps in a row equal
onnxruntime's, since a parameter and its update swap images after each step and must share a fold.
"""

from __future__ import annotations

import json
import math

import numpy as np

import pytest

from fblc.cli import main
from fblc.passes.layout_score import MAX_PADDING, Geometry, block_efficiency, rank_folds
from fblc.profiles import PORTABLE_IMAGE_EDGE, load_profile, placement_limits, shipped_targets
from fblc.texel_layout import flat_layout
from tests.test_device_models import SGD, TRESNET_GROUP

EDGE = PORTABLE_IMAGE_EDGE
STREAM = (("stream", 1.0),)


def test_placement_limits_cap_at_the_portable_edge_only_when_the_image_fits() -> None:
    assert placement_limits(16384, 16384, 15360) == (EDGE, EDGE)
    assert placement_limits(16384, 16384, EDGE * EDGE) == (EDGE, EDGE)
    assert placement_limits(16384, 16384, EDGE * EDGE + 1) == (16384, 16384)
    assert placement_limits(4096, 16384, 100) == (4096, EDGE)  # a smaller device limit stays


@pytest.mark.parametrize("target", shipped_targets())
@pytest.mark.parametrize("shape", [(61440,), (16, 3840), (8, 32, 49, 30), (4, 64, 112, 112)])
def test_folds_fit_the_portable_edge_and_hold_every_texel(target: str, shape: tuple[int, ...]) -> None:
    geometry = Geometry.of(load_profile(target))
    texels = -(-math.prod(shape) // 4)
    ranked = rank_folds(shape, STREAM, geometry)
    for candidate in ranked:
        layout = candidate.layout
        assert layout.kind == "flat" and layout.width <= EDGE and layout.height <= EDGE
        assert texels <= layout.width * layout.height <= (1 + MAX_PADDING) * texels
    assert ranked[0].scored_by == "block count"


@pytest.mark.parametrize("target", shipped_targets())
def test_a_stream_is_folded_into_blocks_where_the_cache_has_2d_blocks(target: str) -> None:
    """15360 texels (a T-ResNet activation at batch 16; was a 15360 x 1 strip under a 16384 limit). Where the
    target's cache blocks are several texel rows tall, the search folds it so that each block a wave
    fetches is read whole, fetching fewer blocks than the widest strip; with one-row blocks (cache lines)
    every fold costs the same (and ties go to one without padding)."""
    geometry = Geometry.of(load_profile(target))
    best = rank_folds((15360 * 4,), STREAM, geometry)[0].layout
    strip = flat_layout(15360, EDGE)
    assert (strip.width, strip.height) == (8192, 2) and best.width * best.height == 15360
    if geometry.block_height == 1:
        assert len({c.score for c in rank_folds((15360 * 4,), STREAM, geometry)}) == 1
    else:
        assert best.height > 2
        assert block_efficiency(best, "stream", 1, 15360, geometry) > \
            block_efficiency(strip, "stream", 1, 15360, geometry)


def test_a_tensor_narrower_than_a_block_stays_one_row() -> None:
    geometry = Geometry.of(load_profile("adreno830"))
    assert [(c.layout.width, c.layout.height) for c in rank_folds((2, 3), STREAM, geometry)] == [(2, 1)]


def test_a_tensor_beyond_the_portable_square_uses_the_targets_limit() -> None:
    profile = load_profile("adreno830")
    shape = (EDGE * EDGE + 4 * EDGE,)  # one texel row more than the square holds, as elements x 4
    layout = rank_folds((shape[0] * 4,), STREAM, Geometry.of(profile))[0].layout
    assert max(layout.width, layout.height) > EDGE
    assert layout.width <= profile.image2d_max_width and layout.height <= profile.image2d_max_height


def test_the_compile_report_names_textures_beyond_the_portable_edge(monkeypatch, mlp_path, tmp_path, capsys) -> None:
    """With the edge shrunk to 2 texels, the MLP's 8-texel tensors no longer fit 2 x 2: they take adreno830's
    own limit, and both the printed summary and report.json say which."""
    import fblc.codegen.compile
    import fblc.profiles.profile

    assert main(["compile", mlp_path, "--target", "adreno830", "-o", str(tmp_path / "portable")]) == 0
    assert json.load(open(tmp_path / "portable" / "report.json"))["beyond_portable_edge"] == []
    assert "note:" not in capsys.readouterr().out
    monkeypatch.setattr(fblc.profiles.profile, "PORTABLE_IMAGE_EDGE", 2)
    monkeypatch.setattr(fblc.codegen.compile, "PORTABLE_IMAGE_EDGE", 2)
    assert main(["compile", mlp_path, "--target", "adreno830", "-o", str(tmp_path / "large")]) == 0
    beyond = json.load(open(tmp_path / "large" / "report.json"))["beyond_portable_edge"]
    assert beyond and all(max(t["width"], t["height"]) > 2 for t in beyond)
    assert "use adreno830's own image limit" in capsys.readouterr().out


@pytest.mark.xdist_group(TRESNET_GROUP)  # test_device_models' T-ResNet rtile step: the same kernels.cl, built once
def test_steps_after_the_first_equal_onnxruntime(tmp_path, optimised_kernel_builds) -> None:
    """Three steps of T-ResNet compiled for adreno830 on PoCL against onnxruntime's run of the same step
    graph (fblc.compiler.reference), each step's loss within rtol 1e-4: after every step P.new's image becomes
    P's (and the momentum's update the momentum's), so a fold chosen by accesses (P is read by convs, P.new
    written by the optimizer) would read the next step's weights through the wrong width. The classifier weight
    [17, 128], which Gemm reads along rows and columns, is large enough for its accesses to prefer another fold
    than its update's stream. The bundle is test_device_models' T-ResNet rtile step's (same export, options and
    target, built optimised in both), so pyopencl's binary cache builds its kernels once for both tests (they
    share an xdist group: one worker, one after the other); it was a 6-channel T-ResNet of its own under AdamW,
    27 s of a CI run (AdamW's states swapping over many steps: test_many_steps' mlp-adamw, 50 steps)."""
    from fblc.codegen.compile import compile_model
    from fblc.compiler.model_io import load_model, save_model_atomically
    from fblc.compiler.reference import ReferenceStep
    from fblc.passes.pipeline import TrainingOptions, build_training_graph
    from fblc.runtime.local import LocalRunner
    from tests.support import models

    exported = models.tresnet(str(tmp_path))
    options = TrainingOptions(input_shapes=exported.input_shapes, loss="cross_entropy", optimizer=SGD, dtype="fp32")
    compile_model(exported.path, str(tmp_path / "bundle"), "adreno830", "fp32", options)
    save_model_atomically(build_training_graph(load_model(exported.path), options), str(tmp_path / "step.onnx"))
    feeds = {**exported.inputs, "labels": exported.labels}
    reference = ReferenceStep(str(tmp_path / "step.onnx"))
    device = LocalRunner(str(tmp_path / "bundle"), progress=False, storage="image")  # placement is of images
    expected = [reference.step(feeds) for _ in range(3)]
    measured = [device.step(feeds) for _ in range(3)]
    assert np.allclose(measured, expected, rtol=1e-4, atol=0), (measured, expected)


def test_a_tensor_beyond_32_bit_indices_is_refused_naming_it(tmp_path) -> None:
    """mali-g925's 65536 x 65536 images hold 2^34 elements, but kernel indices are 32-bit ints:
    a tensor of more than 2^31 - 1 elements is a compile error, not an overflow on the device."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from fblc.codegen.compile import compile_model
    from fblc.errors import FblcError
    from fblc.passes.pipeline import TrainingOptions

    shape = [2, 65536, 16400]  # 2,149,580,800 elements
    graph = helper.make_graph([helper.make_node("Mul", ["x", "w"], ["y"], name="scale")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
                              [numpy_helper.from_array(np.array([1.5], np.float32), "w")])
    path = str(tmp_path / "big.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    with pytest.raises(FblcError, match=r"\[2, 65536, 16400\] has 2,149,580,800 elements .* 32-bit int indices"):
        compile_model(path, str(tmp_path / "bundle"), "mali-g925", "fp32", TrainingOptions(loss="mse"))
    assert not (tmp_path / "bundle").exists()
