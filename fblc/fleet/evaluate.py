"""The server's evaluation of a global model on held-out rows: the model `fblc export` would write from it.

The global tensors go into the model the bundle was compiled from (fblc.tools.export: adapters merged into the
frozen weights), and onnxruntime runs that model on the held-out rows in batches of the compiled size (the last
batch padded with its own rows, the padding's outputs dropped). So what is measured is what would be served,
computed apart from the trainers (kernels or the step ONNX) that trained it. A classifier (integer labels)
reports the mean cross-entropy of its first output and the accuracy of its argmax; otherwise the mean squared
error.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import onnx_ir as ir

from fblc.compiler.reference import onnxruntime_session
from fblc.fleet.data import LABELS, Rows
from fblc.tools.export import exported_model


def _cross_entropy(logits: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    loss = -log_probs[np.arange(len(labels)), labels].mean()
    return float(loss), float((logits.argmax(axis=-1) == labels).mean())


class Evaluator:
    """Held-out loss and accuracy of global tensors of `bundle`."""

    def __init__(self, bundle: str, rows: Rows, batch: int) -> None:
        self.bundle, self.rows, self.batch = bundle, rows, batch

    def outputs(self, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
        model, _ = exported_model(self.bundle, arrays, "the global model")
        session = onnxruntime_session(ir.to_proto(model))
        inputs = [i.name for i in session.get_inputs()]
        first = session.get_outputs()[0].name
        parts = []
        for start in range(0, len(self.rows), self.batch):
            index = np.arange(start, start + self.batch) % len(self.rows) if len(self.rows) >= self.batch else \
                np.arange(self.batch) % len(self.rows)
            feeds = {name: self.rows.arrays[name][index] for name in inputs}
            parts.append(session.run([first], feeds)[0][: len(self.rows) - start])
        return np.concatenate(parts)[: len(self.rows)]

    def __call__(self, arrays: Mapping[str, np.ndarray]) -> dict[str, float]:
        outputs = self.outputs(arrays).astype(np.float64)
        labels = self.rows.arrays[LABELS]
        if np.issubdtype(labels.dtype, np.integer):
            loss, accuracy = _cross_entropy(outputs.reshape(len(labels), -1), labels)
            return {"loss": loss, "accuracy": accuracy}
        return {"loss": float(((outputs - labels) ** 2).mean())}
