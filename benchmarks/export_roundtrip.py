"""`fblc export` round trips on the zoo: each family's model, each adapter kind and full fine-tuning.

    python benchmarks/export_roundtrip.py [--only gpt2,resnet,...] [--kinds full,lora,fura-s,memflora]

Per (architecture, kind): compile the bundle (fblc compile), give every tensor it trains a random value (a
model tensor: its own value times 1 + 0.1 N(0, 1); an adapter factor: 0.2 N(0, 1); the merge is what is checked,
not training), fblc export, then onnxruntime's logits on the exported file against the step's forward with those
values (the model after the import passes and the adapter's pass, graph mode). Prints one row each: the
largest |exported - step| / max |step| (the tests hold 1e-5), how far the values moved the logits, and the
seconds of compile and export; a kind that does not apply (MemFLoRA without a conv) says why.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)

import onnx_ir as ir  # noqa: E402
import onnxruntime as ort  # noqa: E402

from fblc import bundle_format as fmt  # noqa: E402
from fblc.cli import main as fblc  # noqa: E402
from fblc.compiler.adapters import AdapterConfig  # noqa: E402
from fblc.compiler.model_io import load_model  # noqa: E402
from fblc.passes.fura_s import FuraS  # noqa: E402
from fblc.passes.memory_floor import MemoryFloor  # noqa: E402
from fblc.passes.pipeline import TrainingOptions, import_passes, run_passes  # noqa: E402
from support import zoo  # noqa: E402

KINDS = {"full": [], "lora": ["--adapter", "lora"], "fura-s": ["--adapter", "fura-s"],
         "memflora": ["--adapter", "memflora"]}


def logits(model: ir.Model | str, inputs: dict[str, np.ndarray]) -> np.ndarray:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    source = model if isinstance(model, str) else ir.to_proto(model).SerializeToString()
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"]).run(None, inputs)[0]


def step_forward(path: str, kind: str, trained: dict[str, np.ndarray], inputs: dict[str, np.ndarray]) -> np.ndarray:
    model = run_passes(load_model(path), import_passes(TrainingOptions()))
    if kind != "full":
        (FuraS(AdapterConfig(kind)) if kind == "fura-s" else MemoryFloor(AdapterConfig(kind)))(model)
    for name, array in trained.items():
        model.graph.initializers[name].const_value = ir.tensor(array, name=name)
    return logits(model, inputs)


def row(arch: zoo.Architecture, kind: str, directory: str) -> tuple[str, ...]:
    exported = zoo.build(arch, directory)
    bundle = os.path.join(directory, f"{arch.name}_{kind}")
    started = time.perf_counter()
    if fblc(["compile", exported.path, "-o", bundle, "-q", *KINDS[kind]]) != 0:
        return arch.name, arch.family, kind, "n/a (compile refused it: above)", "-", "-", "-"
    compiled = time.perf_counter() - started
    rng = np.random.default_rng(0)
    source = ir.load(exported.path).graph.initializers
    trained = {}
    for p in fmt.load_manifest(bundle)["parameters"]:
        noise = rng.standard_normal(p["shape"])
        value = source.get(p["name"])
        trained[p["name"]] = (value.const_value.numpy() * (1 + 0.1 * noise) if value is not None and
                              value.const_value is not None else 0.2 * noise).astype(np.float32)
    params = bundle + ".npz"
    np.savez(params, **trained)
    started = time.perf_counter()
    assert fblc(["export", bundle, "--params", params, "-o", bundle + ".onnx", "-q"]) == 0
    seconds = time.perf_counter() - started
    expected = step_forward(exported.path, kind, trained, exported.inputs)
    got, before = logits(bundle + ".onnx", exported.inputs), logits(exported.path, exported.inputs)
    scale = np.abs(expected).max()
    return (arch.name, arch.family, kind, "ok" if np.abs(got - expected).max() <= 1e-5 * scale else "FAIL",
            f"{np.abs(got - expected).max() / scale:.2e}", f"{np.abs(got - before).max() / scale:.2e}",
            f"{compiled:.1f} / {seconds:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(zoo.DEVICE.values()), help="comma-separated architecture names "
                        "(default: one per family, tests/support/zoo.DEVICE)")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    header = ("architecture", "family", "kind", "result", "max rel err", "logits moved", "compile / export s")
    print(" | ".join(header), flush=True)
    with tempfile.TemporaryDirectory() as directory:
        for name in args.only.split(","):
            for kind in args.kinds.split(","):
                print(" | ".join(row(zoo.BY_NAME[name], kind, directory)), flush=True)


if __name__ == "__main__":
    main()
