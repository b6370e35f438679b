"""Median local training-step time under `--layout rtile` against `--layout naive`, side by side.

    python benchmarks/layout.py [--steps 5] [--models llama,mobilenet_v2] [--target local]

Same model, batch, optimizer (AdamW) and device (the local OpenCL device, PoCL on this CPU);
only the layout differs. naive is the conventional baseline: flat row-major textures, every
Transpose/Reshape/Expand a copy kernel, contractions one output texel per work-item. rtile is
fblc's FBLayout: R-Tile layouts, data movement turned into index maps, contractions over 8x8
output tiles. Models: the 2-layer Llama decoder of the tests (hidden 64, GQA 4/2 heads) at
batch 4, sequence 128; transformers' MobileNetV2 (17 classes) at [16, 3, 97, 60]. Each side:
one warm-up step (the OpenCL JIT), then --steps steps of each, the two layouts stepping in turn
(a shared machine's speed drifts; alternating gives both the same drift), and the medians.
Targets: naive/rtile >= 2.5x on the Llama decoder, >= 2x on MobileNetV2 (FBLayout reports 2.2-5.7x
on phones).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fblc.runtime.local import LocalRunner  # noqa: E402
from benchmarks.step_time import compile_bundle, interleaved_ms, runner_stepper  # noqa: E402
from tests.support import models  # noqa: E402

LAYOUTS = ("naive", "rtile")
TARGETS = {"llama": 2.5, "mobilenet": 2.0}  # naive/rtile step-time ratios (issue 13)


def llama_case(directory: str) -> tuple[str, str, dict[str, np.ndarray]]:
    import torch
    import transformers

    batch, seq = 4, 128
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq)
    module = models.logits_only(transformers.LlamaForCausalLM(config), "input_ids", use_cache=False).eval()
    ids = np.random.default_rng(2).integers(0, config.vocab_size, size=(batch, seq)).astype(np.int64)
    path = os.path.join(directory, "llama_b4_t128.onnx")
    models._quiet_dynamo_export(module, (torch.from_numpy(ids),)).save(path)
    labels = np.concatenate([ids[:, 1:], np.full((batch, 1), -100)], axis=1)
    return f"llama 2L B={batch} T={seq}", path, {"input_ids": ids, "labels": labels}


def mobilenet_case(directory: str, batch: int = 16) -> tuple[str, str, dict[str, np.ndarray]]:
    import torch
    import transformers

    torch.manual_seed(0)
    module = models.logits_only(transformers.MobileNetV2ForImageClassification(
        transformers.MobileNetV2Config(num_labels=17, image_size=97)), "pixel_values").eval()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, 3, 97, 60)).astype(np.float32)
    path = os.path.join(directory, f"mobilenet_v2_b{batch}.onnx")
    models._quiet_dynamo_export(module, (torch.from_numpy(x),)).save(path)
    return (f"mobilenetv2 [{batch},3,97,60]", path,
            {"pixel_values": x, "labels": rng.integers(0, 17, batch).astype(np.int64)})


CASES = {"llama": llama_case, "mobilenet_v2": mobilenet_case}


def interleaved_step_ms(path: str, feeds: dict[str, np.ndarray], directory: str, key: str, steps: int,
                        target: str) -> dict[str, tuple[float, dict]]:
    """Median step of each layout, the two runners stepping in turn (step_time.interleaved_ms): a shared
    machine's speed drifts over minutes, and alternating makes both layouts see the same drift."""
    bundles = {layout: os.path.join(directory, f"{key}.{layout}") for layout in LAYOUTS}
    reports = {layout: compile_bundle(path, bundles[layout], layout, target) for layout in LAYOUTS}
    runners = {layout: LocalRunner(bundles[layout], storage="image") for layout in LAYOUTS}  # layouts place images
    medians = interleaved_ms({layout: runner_stepper(runners[layout], feeds) for layout in LAYOUTS},
                             steps, settle=False)  # one thread pool (PoCL's) on both sides
    return {layout: (medians[layout], reports[layout]) for layout in LAYOUTS}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--models", default=",".join(CASES))
    parser.add_argument("--target", default="local", help="profile the layouts are chosen for (default: local)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for key in args.models.split(","):
            name, path, feeds = CASES[key](directory)
            print(f"  {name}", file=sys.stderr)
            measured = interleaved_step_ms(path, feeds, directory, key, args.steps, args.target)
            for layout in LAYOUTS:
                print(f"    {layout}: {measured[layout][0]:.1f} ms per step", file=sys.stderr)
            rows.append((name, measured))
    print(f"{'model':<26} {'naive ms':>10} {'rtile ms':>10} {'naive/rtile':>12} {'movement kernels':>17} "
          f"{'kernels':>15}")
    for name, measured in rows:
        (naive_ms, naive), (rtile_ms, rtile) = measured["naive"], measured["rtile"]
        movement = f"{naive['layout']['data_movement_after']} -> {rtile['layout']['data_movement_after']}"
        kernels = f"{naive['kernels']} -> {rtile['kernels']}"
        print(f"{name:<26} {naive_ms:10.1f} {rtile_ms:10.1f} {naive_ms / rtile_ms:12.2f} {movement:>17} {kernels:>15}")
    for prefix, label in (("llama", "llama decoder"), ("mobilenet", "mobilenetv2")):
        found = [m for n, m in rows if n.startswith(prefix)]
        if found:
            ratio, target = found[0]["naive"][0] / found[0]["rtile"][0], TARGETS[prefix]
            print(f"{label}: naive/rtile {ratio:.2f}x, target >= {target:g}x ({'met' if ratio >= target else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
