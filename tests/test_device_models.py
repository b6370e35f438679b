"""Every model of the training-graph tests, one step on the local OpenCL device (PoCL) against onnxruntime.

The same step graph runs on both sides from the same parameters and batch; the loss, every
gradient, updated parameter and optimizer state must agree, for the shipped targets (their bundles
run on PoCL: textures stay within the portable image edge), under `--layout rtile` and
`--layout naive` alike: fp32 within rtol 1e-4 / atol 1e-5, fp16 textures (fp32 accumulation) within rtol 1e-2 / atol 1e-3 (fblc.tools.verify).
"""

from __future__ import annotations

import pytest

from fblc.tools.verify import verify_model
from fblc.compiler.adapters import AdapterConfig
from fblc.compiler.optimizers import OptimizerConfig
from fblc.passes.pipeline import TrainingOptions
from tests.support import models

#: steps whose kernels build optimised, as a user's run builds them (tests/conftest.py): an MLP, a conv net
#: and a decoder; the others build with -cl-opt-disable, as the rest of the suite, for its time
OPTIMISED_MODELS = ("mlp", "tresnet", "llama")

MODELS = {
    "mlp": models.mlp,
    "tresnet": models.tresnet,
    "resnet_legacy": models.resnet_legacy,
    "resnet_dynamo_optimized": models.resnet_dynamo_optimized,
    "mobilenet_v2": models.mobilenet_v2,
    "llama": lambda directory: models.llama(directory)[0],
    "llama_optimized": lambda directory: models.llama(directory)[1],
}
# SGD: Adam's first step is lr * g / (|g| + eps), so for gradients near eps it magnifies the last-bit
# differences of two correct fp32 summation orders past any fixed tolerance; AdamW kernels are
# checked exactly on the small models of test_runtime.py and the kernel tests.
SGD = OptimizerConfig("sgd", lr=0.1, momentum=0.9, weight_decay=1e-4)
NO_ADAPTER = AdapterConfig()


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("device_models"))


def _verify(name: str, export_dir: str, dtype: str, layout: str = "rtile",
            adapter: AdapterConfig = NO_ADAPTER, target: str = "adreno830") -> None:
    exported = MODELS[name](export_dir)
    feeds = {**exported.inputs, "labels": exported.labels}
    rows = verify_model(exported.path, TrainingOptions(input_shapes=exported.input_shapes, loss="cross_entropy",
                                                       optimizer=SGD, layout=layout, adapter=adapter),
                        target=target, dtype=dtype, feeds=feeds)
    failed = [r for r in rows if not r.ok]
    assert not failed, f"{len(failed)}/{len(rows)} tensors differ, worst: " + "; ".join(
        f"{r.name} abs {r.max_abs:.2e} rel {r.max_rel:.2e}" for r in sorted(failed, key=lambda r: -r.max_rel)[:5])
    assert {"loss"} < {r.name for r in rows}


# rtile steps under `-m slow` for the suite's time: the zoo's ResNet (legacy export) runs on the device
# too, and the optimized Llama export's kernels are the plain export's (llama, above) but for its fused ops;
# MobileNetV2's (about 160 CPU s cold: PoCL compiles both bodies of each co-launched pair into its work-group
# function, held once in the source or not; 82 before co-launch): its depthwise and pointwise conv paths run in
# test_kernels_contraction's merged steps, co-launched kernels on adreno830 in the
# T-ResNet, Llama and MLP steps here, its graph against PyTorch in test_memory_floor and test_exported_models
SLOW_MODELS = ("resnet_legacy", "llama_optimized", "mobilenet_v2")
# The flat baseline runs on one export of each architecture: its kernels (no tiles, copies for data
# movement) do not depend on the exporter, whose op variants the R-Tile runs above cover. The conv nets'
# and the decoder's naive steps are under `-m slow` for the suite's time (PoCL's cold compile: 20 to
# 40 s): the conv kernel tests run every conv path under naive (test_kernels_contraction's TEXEL_CASES),
# test_layout_passes runs an attention step under naive, and benchmarks/layout.py runs both models'.
NAIVE_MODELS = ("mlp",)
SLOW_NAIVE_MODELS = ("llama", "tresnet", "resnet_legacy")


#: T-ResNet's rtile step shares its bundle (and so PoCL's build of it) with test_texture_placement's three steps
TRESNET_GROUP = "tresnet-adreno830"


@pytest.mark.parametrize("name, layout", [pytest.param(name, "rtile", marks=[pytest.mark.xdist_group(TRESNET_GROUP)]
                                                       if name == "tresnet" else [])
                                          for name in MODELS if name not in SLOW_MODELS]
                         + [pytest.param(name, "rtile", marks=pytest.mark.slow) for name in SLOW_MODELS]
                         + [(name, "naive") for name in NAIVE_MODELS]
                         + [pytest.param(name, "naive", marks=pytest.mark.slow) for name in SLOW_NAIVE_MODELS])
def test_one_step_on_pocl_matches_onnxruntime_fp32(name: str, layout: str, export_dir: str, request) -> None:
    """Both layouts: R-Tile textures with remapped data movement, and the flat baseline with copies; compiled
    for phone targets whose images may be 16384 wide, run on PoCL, whose images stop at 8192."""
    if name in OPTIMISED_MODELS and layout == "rtile":
        request.getfixturevalue("optimised_kernel_builds")
    _verify(name, export_dir, "fp32", layout, target="adreno830" if layout == "rtile" else "mali-g925")


# the Llama decoder's fp16 step is under `-m slow` for the suite's time: test_mixed_precision trains GPT-2 in fp16
# fp16 conv kernels also run in test_kernels_contraction's fp16 cases; T-ResNet's whole step is under -m slow
@pytest.mark.parametrize("name", ["mlp", pytest.param("tresnet", marks=pytest.mark.slow),
                                  pytest.param("llama", marks=pytest.mark.slow)])
def test_one_step_on_pocl_matches_onnxruntime_fp16(name: str, export_dir: str) -> None:
    _verify(name, export_dir, "fp16", target="adreno730")


# MobileNetV2's MemFLoRA step compiles 320 kernels (75 s in CI on a cold cache): `pytest -m slow` runs it; its
# graph is checked against PyTorch in test_memory_floor, its depthwise kernels by the plain MobileNetV2 step here.
# T-ResNet's (26 CPU s cold) too: test_native_runner's MemFLoRA T-ResNet (the same builder, 6 channels of 16
# samples) checks its step on PoCL against onnxruntime, and test_layout_passes' MASK_WRITERS every tiling's mask
@pytest.mark.parametrize("name", [pytest.param("tresnet", marks=pytest.mark.slow),
                                  pytest.param("mobilenet_v2", marks=pytest.mark.slow)])
def test_memflora_step_on_pocl_matches_onnxruntime(name: str, export_dir: str) -> None:
    """MemFLoRA's backward reads its activations' one-bit masks (r_mask8, written a byte per two texels
    by the conv kernels of every tiling: spatial tiles of 5, channel tiles, texels of a row, one per
    lane): the adapter gradients, which go through them, must still equal onnxruntime's."""
    _verify(name, export_dir, "fp32", adapter=AdapterConfig("memflora", rank=2, seed=4), target="local")
