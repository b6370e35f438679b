"""The pretrained models and the real data of benchmarks/adaptation.py, pretrained here and cached.

Data that nobody here wrote and that ships with the machine:
- bytes of the Python standard library: the decoder pretrains on the source of `Lib/*.py` (sysconfig's
  stdlib path) and adapts to the language reference's prose in `Lib/pydoc_data/topics.py` (the text
  `help()` prints: English, not code), a body of text it never saw;
- scikit-learn's handwritten digits (`sklearn.datasets.load_digits`, 1,797 8 x 8 images inside the
  package): the CNN pretrains on upright digits and adapts to other digits rotated by 45 degrees.

Each model is trained with PyTorch (Adam, lr 3e-3, batch 32) for a given number of steps, exported
with torch.onnx.export (dynamo, opset 18) at the adaptation batch shape and cached in the run folder
with its held-out figures, so that a rerun skips pretraining; the data splits are drawn again from
fixed seeds, the same each time.
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig
import time
import warnings
from dataclasses import dataclass

import numpy as np

IGNORE_INDEX = -100
DIGIT_CLASSES = 10
#: the shift of the digits task: at 45 degrees the quick run's CNN reads 16 % of them right (30: 52 %, 90: 9 %;
#: measured once, while choosing the angle)
ROTATION_DEGREES = 45.0


@dataclass(frozen=True)
class Task:
    """A pretrained model and its shifted task: ONNX file, input name, and batches of each split."""

    name: str
    path: str
    input_name: str
    #: split ("train", "val", "test") -> list of (inputs, labels) batches of the shifted task
    batches: dict[str, list[tuple[np.ndarray, np.ndarray]]]
    classifier: bool  # accuracy is printed for a classifier (digits), not for the decoder
    #: what the pretrained model reached on its own held-out data (loss, accuracy or nan)
    pretrained: dict[str, float]


# --- data ------------------------------------------------------------------------------------


def stdlib_text() -> tuple[bytes, bytes]:
    """(source: Lib/*.py concatenated, shifted: the prose of pydoc_data.topics), both as bytes."""
    from pydoc_data import topics

    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "*.py")))
    source = b"\n".join(open(path, "rb").read() for path in files)
    prose = "\n".join(topics.topics[key] for key in sorted(topics.topics)).encode("utf-8")
    return source, prose


def byte_windows(text: bytes, count: int, length: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """`count` windows of `length` bytes at random offsets, with next-byte labels (last position ignored)."""
    data = np.frombuffer(text, dtype=np.uint8)
    starts = rng.integers(0, len(data) - length - 1, size=count)
    ids = np.stack([data[s:s + length] for s in starts]).astype(np.int64)
    labels = np.full_like(ids, IGNORE_INDEX)
    labels[:, :-1] = ids[:, 1:]
    return ids, labels


def text_splits(text: bytes) -> dict[str, bytes]:
    """Disjoint contiguous thirds-ish of a text: train 60 %, val 20 %, test 20 %."""
    a, b = int(len(text) * 0.6), int(len(text) * 0.8)
    return {"train": text[:a], "val": text[a:b], "test": text[b:]}


def digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as [N, 1, 8, 8] float32 in [0, 1] and int64 labels."""
    from sklearn.datasets import load_digits

    data = load_digits()
    return (data.images[:, None] / 16.0).astype(np.float32), data.target.astype(np.int64)


def rotated(images: np.ndarray, degrees: float = ROTATION_DEGREES) -> np.ndarray:
    """The images turned by `degrees` about their centre (bilinear; scipy comes with scikit-learn)."""
    from scipy import ndimage

    return ndimage.rotate(images, degrees, axes=(2, 3), reshape=False, order=1).astype(np.float32)


def batched(inputs: np.ndarray, labels: np.ndarray, batch: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(inputs[i:i + batch], labels[i:i + batch]) for i in range(0, len(labels) - batch + 1, batch)]


# --- models ----------------------------------------------------------------------------------


def _torch_modules():  # noqa: ANN202 - torch is imported only when pretraining
    import torch
    from torch import nn

    class DigitsCNN(nn.Module):
        """Two convolutions (conv sites for LoRA and MemFLoRA) and a two-layer head (Gemm sites for FuRA-S)."""

        def __init__(self) -> None:
            super().__init__()
            self.conv1, self.conv2 = nn.Conv2d(1, 16, 3, padding=1), nn.Conv2d(16, 32, 3, stride=2, padding=1)
            self.fc1, self.fc2 = nn.Linear(32 * 4 * 4, 64), nn.Linear(64, DIGIT_CLASSES)

        def forward(self, pixels: torch.Tensor) -> torch.Tensor:
            x = torch.relu(self.conv2(torch.relu(self.conv1(pixels))))
            return self.fc2(torch.relu(self.fc1(x.flatten(1))))

    return torch, DigitsCNN


def _export(module, example, path: str) -> None:  # noqa: ANN001
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (example,), dynamo=True, optimize=False, opset_version=18,
                          verbose=False).save(path)


def _adam_loop(module, batches, loss_of, steps: int, lr: float) -> float:  # noqa: ANN001
    """`steps` steps of Adam over `batches(k)`; the seconds they took."""
    import torch

    torch.set_num_threads(1)  # six jobs share two cores here: one thread each
    optimizer = torch.optim.Adam(module.parameters(), lr=lr)
    started = time.perf_counter()
    module.train()
    for step in range(steps):
        inputs, labels = batches(step)
        optimizer.zero_grad()
        loss = loss_of(module, inputs, labels)
        loss.backward()
        optimizer.step()
    module.eval()
    return time.perf_counter() - started


def _held_out(module, batches: list, loss_of) -> dict[str, float]:  # noqa: ANN001
    import torch

    with torch.no_grad():
        losses = [float(loss_of(module, torch.from_numpy(x), torch.from_numpy(y))) for x, y in batches]
    return {"loss": float(np.mean(losses))}


def decoder_task(folder: str, batch: int, length: int, steps: int, eval_batches: int) -> Task:
    """A 2-layer byte-level Llama (transformers config, random init) pretrained on Lib/*.py."""
    path = os.path.join(folder, f"decoder_b{batch}_t{length}_s{steps}.onnx")
    meta_path = path[:-len(".onnx")] + ".json"
    source, prose = stdlib_text()
    splits = text_splits(prose)
    rng = np.random.default_rng(11)
    counts = {"train": None, "val": eval_batches, "test": eval_batches}
    shifted: dict[str, list] = {}
    for split, count in counts.items():
        windows = byte_windows(splits[split], (count or 256) * batch, length, rng)
        shifted[split] = batched(*windows, batch)
    if not _cached(path, meta_path, steps):
        import torch
        import torch.nn.functional as F
        import transformers

        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=length)
        model = transformers.LlamaForCausalLM(config)

        def loss_of(module, ids, labels):  # noqa: ANN001, ANN202
            logits = module(input_ids=ids, use_cache=False).logits
            return F.cross_entropy(logits.reshape(-1, 256), labels.reshape(-1), ignore_index=IGNORE_INDEX)

        code = text_splits(source)
        train_rng = np.random.default_rng(0)
        seconds = _adam_loop(model, lambda _: tuple(torch.from_numpy(a) for a in byte_windows(
            code["train"], 32, length, train_rng)), loss_of, steps, 3e-3)
        code_test = batched(*byte_windows(code["test"], eval_batches * batch, length, np.random.default_rng(1)), batch)
        meta = {"seconds": seconds, "steps": steps, "code held-out": _held_out(model, code_test, loss_of),
                "prose held-out": _held_out(model, shifted["test"], loss_of)}
        from tests.support.models import logits_only

        _export(logits_only(model, "input_ids", use_cache=False).eval(),
                torch.zeros(batch, length, dtype=torch.int64), path)
        _write_json(meta_path, meta)
    meta = json.load(open(meta_path, encoding="utf-8"))
    return Task("decoder", path, "input_ids", shifted, False,
                {"steps": meta["steps"], "seconds": round(meta["seconds"]),
                 "source loss": meta["code held-out"]["loss"], "shifted loss": meta["prose held-out"]["loss"]})


def digits_task(folder: str, batch: int, steps: int) -> Task:
    """The CNN pretrained on upright digits; its task: the digits rotated by ROTATION_DEGREES."""
    path = os.path.join(folder, f"digits_b{batch}_s{steps}.onnx")
    meta_path = path[:-len(".onnx")] + ".json"
    images, labels = digits()
    order = np.random.default_rng(3).permutation(len(labels))
    images, labels = images[order], labels[order]
    # source: the first 1,000 images upright; shifted: the other 797 rotated (train 397, val 200, test 200)
    source_x, source_y, rest_x, rest_y = images[:1000], labels[:1000], rotated(images[1000:]), labels[1000:]
    cuts = {"train": (0, 397), "val": (397, 597), "test": (597, 797)}
    shifted = {split: batched(rest_x[a:b], rest_y[a:b], batch) for split, (a, b) in cuts.items()}
    if not _cached(path, meta_path, steps):
        torch, DigitsCNN = _torch_modules()
        import torch.nn.functional as F

        torch.manual_seed(0)
        model = DigitsCNN()
        train_x, train_y = torch.from_numpy(source_x[:800]), torch.from_numpy(source_y[:800])
        seconds = _adam_loop(model, lambda k: (train_x[(k * 32) % 800:(k * 32) % 800 + 32],
                                             train_y[(k * 32) % 800:(k * 32) % 800 + 32]),
                           lambda m, x, y: F.cross_entropy(m(x), y), steps, 3e-3)
        meta = {"seconds": seconds, "steps": steps}
        for name, (x, y) in {"upright held-out": (source_x[800:], source_y[800:]),
                             "rotated held-out": (rest_x[597:], rest_y[597:])}.items():
            with torch.no_grad():
                logits = model(torch.from_numpy(x))
            meta[name] = {"loss": float(F.cross_entropy(logits, torch.from_numpy(y))),
                          "accuracy": float((logits.argmax(-1).numpy() == y).mean())}
        _export(model.eval(), torch.zeros(batch, 1, 8, 8), path)
        _write_json(meta_path, meta)
    meta = json.load(open(meta_path, encoding="utf-8"))
    return Task("digits", path, "pixels", shifted, True,
                {"steps": meta["steps"], "seconds": round(meta["seconds"]),
                 "source accuracy": meta["upright held-out"]["accuracy"],
                 "shifted accuracy": meta["rotated held-out"]["accuracy"]})


def _cached(path: str, meta_path: str, steps: int) -> bool:
    """Whether a model pretrained for `steps` is in the run folder (another budget trains again)."""
    if not (os.path.exists(path) and os.path.exists(meta_path)):
        return False
    return json.load(open(meta_path, encoding="utf-8")).get("steps") == steps


def _write_json(path: str, data: dict) -> None:
    from fblc.paths import write_atomically

    write_atomically(path, lambda out: out.write(json.dumps(data, indent=1).encode("utf-8")))
