"""What `fblc fleet simulate` prints and writes: the round table, the plot, the model's size for the bytes ratio."""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import numpy as np
import onnx

from fblc import bundle_format as fmt
from fblc.paths import write_atomically

#: ONNX tensor element type -> bytes per element, for the sizes a model's weights take
ELEMENT_BYTES = {onnx.TensorProto.FLOAT: 4, onnx.TensorProto.FLOAT16: 2, onnx.TensorProto.BFLOAT16: 2,
                 onnx.TensorProto.DOUBLE: 8}


def model_bytes(bundle: str) -> int:
    """The float weights of the model the bundle was compiled from, in bytes (what full fine-tuning would send)."""
    source = fmt.load_manifest(bundle)["export"]["source"]["path"]
    model = onnx.load(source, load_external_data=False)
    return sum(int(np.prod(t.dims, dtype=np.int64)) * ELEMENT_BYTES[t.data_type]
               for t in model.graph.initializer if t.data_type in ELEMENT_BYTES)


def table(rounds: Sequence[dict[str, float]], central: Sequence[dict[str, float]] | None) -> str:
    """One line per round: clients, losses, accuracy (the fleet's, the central run's), bytes up, seconds."""
    head = ["round", "clients", "train loss", "held-out loss", "accuracy", "central acc.", "B up/client", "B up",
            "s"]
    lines = []
    for index, entry in enumerate(rounds):
        reference = central[index] if central is not None and index < len(central) else {}
        lines.append([str(int(entry["round"])), f"{int(entry.get('clients', 0))}",
                      f"{entry['train_loss']:.4f}" if "train_loss" in entry else "",
                      f"{entry['loss']:.4f}", f"{entry['accuracy']:.3f}" if "accuracy" in entry else "",
                      f"{reference['accuracy']:.3f}" if "accuracy" in reference else "",
                      f"{entry['bytes_up_per_client']:,.0f}" if "bytes_up_per_client" in entry else "",
                      f"{entry['bytes_up']:,.0f}" if "bytes_up" in entry else "",
                      f"{entry['seconds']:.2f}" if index else ""])
    widths = [max(len(row[i]) for row in [head, *lines]) for i in range(len(head))]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in [head, *lines])


def plot(rounds: Sequence[dict[str, float]], central: Sequence[dict[str, float]] | None, path: str,
         title: str) -> None:
    """Held-out accuracy (or loss) per round, fleet and central; bytes uploaded per round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = "accuracy" if "accuracy" in rounds[0] else "loss"
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot([r["round"] for r in rounds], [r[metric] for r in rounds], "o-", label="fleet (held-out)")
    if central is not None:
        left.plot([r["round"] for r in central], [r[metric] for r in central], "s--", label="central, same steps")
    left.set_xlabel("round")
    left.set_ylabel(f"held-out {metric}")
    left.legend()
    trained = [r for r in rounds if "bytes_up" in r]
    right.bar([r["round"] for r in trained], [r["bytes_up"] for r in trained])
    right.set_xlabel("round")
    right.set_ylabel("bytes uploaded (all clients)")
    figure.suptitle(title)
    figure.tight_layout()
    write_atomically(path, lambda handle: figure.savefig(handle, format="png"))
    plt.close(figure)


def save_json(path: str, data: Any) -> None:
    write_atomically(path, lambda handle: handle.write(json.dumps(data, indent=1).encode()))


def saved_files(folder: str) -> dict[str, str]:
    return {"history": os.path.join(folder, "fleet.json"), "plot": os.path.join(folder, "fleet.png"),
            "params": os.path.join(folder, "global.npz")}
