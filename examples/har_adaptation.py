"""HAR adaptation with MemFLoRA on the local OpenCL device, beside full fine-tuning and LoRA.

    python examples/har_adaptation.py [--models tresnet,mobilenet_v2] [--steps 50] [--batch 64]
                                      [--pretrain-steps 60] [--out runs/har_adaptation]

Synthetic sensor windows (97 channels x 60 samples, 17 classes; examples/har_finetune.py
makes them): a source domain, and a target domain shifted as a new sensor placement would
shift it. Each model (T-ResNet [B, 97, 60, 1]; MobileNetV2 from a transformers config, BN
kept, on [B, 3, 97, 60] with the window repeated over 3 channels, which needs torch and
transformers) is first trained on the source domain (full fine-tuning, Adam), then adapted
to the target domain three ways, each an `fblc compile` bundle run by the pyopencl runtime:
MemFLoRA r=2 (`--adapter memflora`), full fine-tuning (`--adapter none`) and LoRA r=2
(`--adapter lora`), all with Adam lr 1e-3, weight decay 5e-4, the paper's protocol. It prints
the macro-F1 on held-out target windows before and after, and the memory table of the three
bundles (from report.json: saved state, training-state peak, device peak, floor check).

On PoCL (a CPU) a batch-64 step takes a while; --steps/--batch/--pretrain-steps shorten a run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import numpy as np
import onnx_ir as ir

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from har_finetune import CHANNELS, CLASSES, SAMPLES, sensor_windows, with_weights  # noqa: E402
from tresnet import build_tresnet  # noqa: E402

from fblc.codegen.compile import compile_model  # noqa: E402
from fblc.compiler.adapters import AdapterConfig  # noqa: E402
from fblc.compiler.model_io import load_model  # noqa: E402
from fblc.compiler.optimizers import OptimizerConfig  # noqa: E402
from fblc.passes.memory_floor import MemoryFloor  # noqa: E402
from fblc.passes.pipeline import TrainingOptions, import_passes, run_passes  # noqa: E402
from fblc.runtime.local import LocalRunner  # noqa: E402

RANK, SEED = 2, 0
METHODS = (("MemFLoRA", "memflora"), ("Full FT", "none"), ("LoRA", "lora"))


def layout(data: dict[str, np.ndarray], model: str) -> dict[str, np.ndarray]:
    """Windows in the model's input layout and input name."""
    if model == "tresnet":
        return {"x": data["x"], "labels": data["labels"]}
    image = np.repeat(data["x"][..., 0][:, None], 3, axis=1)  # [N, 3, 97, 60]
    return {"pixel_values": image.astype(np.float32), "labels": data["labels"]}


def build_model(name: str, batch: int, folder: str) -> tuple[str, str]:
    """(ONNX path, input name) of a freshly initialised model for batch `batch`."""
    if name == "tresnet":
        return build_tresnet(os.path.join(folder, "tresnet.onnx"), batch=batch, channels=CHANNELS, samples=SAMPLES,
                             classes=CLASSES), "x"
    import torch
    import transformers

    from tests.support.models import logits_only

    torch.manual_seed(0)
    module = transformers.MobileNetV2ForImageClassification(
        transformers.MobileNetV2Config(num_labels=CLASSES, image_size=CHANNELS))
    module = logits_only(module, "pixel_values").eval()
    path = os.path.join(folder, "mobilenet_v2.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.zeros(batch, 3, CHANNELS, SAMPLES),), dynamo=True, optimize=False,
                          opset_version=18, verbose=False).save(path)
    return path, "pixel_values"


def macro_f1(predicted: np.ndarray, labels: np.ndarray) -> float:
    scores = []
    for c in range(CLASSES):
        tp = int(np.sum((predicted == c) & (labels == c)))
        fp = int(np.sum((predicted == c) & (labels != c)))
        fn = int(np.sum((predicted != c) & (labels == c)))
        if tp + fp + fn:
            scores.append(2 * tp / (2 * tp + fp + fn))
    return float(np.mean(scores)) if scores else 0.0


def predict(model: ir.Model, data: dict[str, np.ndarray], input_name: str, batch: int) -> np.ndarray:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"])
    out = []
    for start in range(0, len(data["labels"]) - batch + 1, batch):
        out.append(session.run(None, {input_name: data[input_name][start:start + batch]})[0].argmax(-1))
    return np.concatenate(out)


def inference_model(path: str, adapter: str, weights: dict[str, np.ndarray]) -> ir.Model:
    """The forward the step trained: the model, with the adapter inserted as the step inserts it, and `weights`."""
    model = run_passes(load_model(path), import_passes(TrainingOptions()))
    if adapter != "none":
        model = MemoryFloor(AdapterConfig(adapter, rank=RANK, seed=SEED))(model).model
    for name, array in weights.items():
        value = model.graph.initializers.get(name)
        if value is not None:
            value.const_value = ir.tensor(array.astype(np.float32), name=name)
    return model


def train(path: str, bundle: str, data: dict[str, np.ndarray], steps: int, batch: int, adapter: str,
          label: str) -> tuple[dict[str, np.ndarray], dict]:
    options = TrainingOptions(optimizer=OptimizerConfig("adam", lr=1e-3, weight_decay=5e-4),
                              adapter=AdapterConfig(adapter, rank=RANK, seed=SEED))
    _, report = compile_model(path, bundle, "local", "fp32", options)
    runner = LocalRunner(bundle)
    count = len(data["labels"]) // batch
    for step in range(steps):
        k = step % count
        started = time.perf_counter()
        loss = runner.step({name: array[k * batch:(k + 1) * batch] for name, array in data.items()})
        print(f"  {label} step {step + 1:3d}/{steps}  loss {loss:.4f}  ({time.perf_counter() - started:.1f} s)",
              flush=True)
    return runner.parameters(), report


def adapt(name: str, args: argparse.Namespace) -> dict:
    folder = os.path.join(args.out, name)
    os.makedirs(folder, exist_ok=True)
    batch = args.batch
    source = layout(sensor_windows(batch * 4, shifted=False, seed=0), name)
    target_train = layout(sensor_windows(batch * 4, shifted=True, seed=1), name)
    target_test = layout(sensor_windows(batch * 4, shifted=True, seed=2), name)
    path, input_name = build_model(name, batch, folder)
    print(f"{name}: pretraining on the source domain ({args.pretrain_steps} steps)", flush=True)
    weights, _ = train(path, os.path.join(folder, "source_bundle"), source, args.pretrain_steps, batch, "none", "source")
    pretrained = with_weights(path, weights, os.path.join(folder, f"{name}_source.onnx"))
    labels = target_test["labels"][: len(target_test["labels"]) // batch * batch]
    before = macro_f1(predict(inference_model(pretrained, "none", {}), target_test, input_name, batch), labels)
    print(f"{name}: target macro-F1 before adaptation {before:.3f}", flush=True)
    results = {"before": before, "methods": {}}
    for label, adapter in METHODS:
        trained, report = train(pretrained, os.path.join(folder, f"{adapter}_bundle"), target_train, args.steps, batch,
                                adapter, label)
        after = macro_f1(predict(inference_model(pretrained, adapter, trained), target_test, input_name, batch), labels)
        results["methods"][label] = {"f1": after, "memory": report["memory"]}
        print(f"{name} {label}: target macro-F1 {before:.3f} -> {after:.3f}", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tresnet", help="tresnet, mobilenet_v2 or both, comma-separated")
    parser.add_argument("--steps", type=int, default=50, help="adaptation steps per method (default 50)")
    parser.add_argument("--pretrain-steps", type=int, default=60, help="steps on the source domain (default 60)")
    parser.add_argument("--batch", type=int, default=64, help="batch size (default 64)")
    parser.add_argument("--out", default="runs/har_adaptation", help="output folder (default runs/har_adaptation)")
    args = parser.parse_args(argv)
    summary = {name: adapt(name, args) for name in args.models.split(",") if name}
    print(f"\nr = {RANK}, Adam lr 1e-3, weight decay 5e-4, batch {args.batch}, {args.steps} steps; "
          "memory from each bundle's plan [MB]")
    print(f"{'model':<14}{'method':<10}{'F1 before':>10}{'F1 after':>10}{'saved':>9}{'state peak':>12}"
          f"{'device peak':>13}  floor")
    for name, result in summary.items():
        for label, figures in result["methods"].items():
            memory = figures["memory"]
            print(f"{name:<14}{label:<10}{result['before']:>10.3f}{figures['f1']:>10.3f}{memory['saved'] / 1e6:>9.2f}"
                  f"{memory['training_state_peak'] / 1e6:>12.2f}{memory['device_peak'] / 1e6:>13.2f}  "
                  f"{'ok' if memory['floor_ok'] else 'violated'}")
    with open(os.path.join(args.out, "summary.json"), "w", encoding="utf-8") as handle:
        json.dump(summary, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
