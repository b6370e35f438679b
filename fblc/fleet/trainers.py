"""What trains on a fleet client: the bundle's step on the client's device, behind one interface.

DEVICES maps the device kind (the text before the first ':' of `--device`) to the trainer that runs it:
- `local` / `opencl`: LocalRunner, the bundle's kernels on this machine's OpenCL device (PoCL here);
- `graph`: the training step as ONNX (`fblc train-graph` with the bundle's options) in onnxruntime: the same
  arithmetic without kernels, for simulating many clients cheaply.
A trainer is built once per process (trainer_for caches it): a simulation runs many clients in one worker, each
message sets the global tensors and restarts the optimizer state, so no client's state leaks into another's.
Every trainer exposes the bundle's trainable tensors (manifest.json `parameters`) by ONNX name, and
checked_global refuses a global model whose names or shapes differ from them.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from fblc import bundle_format as fmt
from fblc.errors import FblcError
from fblc.texel_layout import TexelLayout, unpack


class Trainer(Protocol):
    """One device's training step with settable trainable tensors."""

    #: the bundle's trainable tensors: name -> shape
    shapes: dict[str, tuple[int, ...]]

    def set_parameters(self, arrays: Mapping[str, np.ndarray], keep_state: bool = False) -> None:
        """Take these trainable tensors and (unless `keep_state`) the optimizer state the bundle starts from."""

    def step(self, feeds: Mapping[str, np.ndarray]) -> float:
        """One training step on a batch; its loss."""

    def parameters(self) -> dict[str, np.ndarray]:
        """The trainable tensors now, by name."""

    def train_reporting_seeds(self, batches: Sequence[Mapping[str, np.ndarray]], iteration: int, seed: int
                              ) -> tuple[Any, list[float]]:
        """ES steps on `batches` from noise iteration `iteration`: (fblc.fleet.es_seeds.SeedReport, the losses)."""


def initial_tensors(bundle: str, entries: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """The initial values of manifest `parameters` / `states` entries, decoded from params.bin through each texture's
    layout (what a runtime uploads before the first step), by name."""
    manifest, plan = fmt.load_verified(bundle)
    del manifest
    out = {}
    with open(os.path.join(bundle, fmt.PARAMS), "rb") as handle:
        for entry in entries:
            texture = plan["textures"][entry["texture"]]
            init = texture["init"]
            handle.seek(init["offset"])
            data = np.frombuffer(handle.read(init["nbytes"]), dtype=fmt.NUMPY_DTYPES[texture["format"]])
            layout = (TexelLayout.from_dict(texture["layout"]) if "layout" in texture
                      else TexelLayout("flat", texture["width"], texture["height"]))
            count = int(np.prod(entry["shape"], dtype=np.int64))
            out[entry["name"]] = unpack(data, layout, count).astype(np.float32).reshape(entry["shape"])
    return out


def checked_global(arrays: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]], where: str) -> None:
    """Refuse a global model whose tensors are not exactly the bundle's trainable ones, by name and shape."""
    missing = sorted(set(shapes) - set(arrays))
    if missing:
        raise FblcError(f"the global model lacks '{missing[0]}' ({len(missing)} of the {len(shapes)} tensors {where} "
                        "trains are missing)", "run the server and the clients with the same bundle")
    extra = sorted(set(arrays) - set(shapes))
    if extra:
        raise FblcError(f"the global model has tensor '{extra[0]}', which {where} does not train ({len(extra)} such)",
                        "run the server and the clients with the same bundle")
    for name, shape in shapes.items():
        got = tuple(np.shape(arrays[name]))
        if got != tuple(shape):
            raise FblcError(f"global tensor '{name}' has shape {list(got)}; {where} trains it as {list(shape)}",
                            "run the server and the clients with the same bundle")


def bundle_shapes(manifest: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    return {p["name"]: tuple(p["shape"]) for p in manifest["parameters"]}


class LocalTrainer:
    """The bundle's kernels on a local OpenCL device (LocalRunner)."""

    def __init__(self, bundle: str, device: str, step_path: str | None = None) -> None:
        from fblc.runtime.local import LocalRunner

        del step_path
        self.runner = LocalRunner(bundle, device=None if device == "local" else device, progress=False)
        self.shapes = bundle_shapes(self.runner.manifest)
        self._states = initial_tensors(bundle, self.runner.manifest["states"])

    def set_parameters(self, arrays: Mapping[str, np.ndarray], keep_state: bool = False) -> None:
        checked_global(arrays, self.shapes, f"bundle '{self.runner.bundle}'")
        for entry in self.runner.manifest["parameters"]:
            self.runner.upload(entry["texture"], np.asarray(arrays[entry["name"]], np.float32))
        for entry in [] if keep_state else self.runner.manifest["states"]:
            self.runner.upload(entry["texture"], self._states[entry["name"]])

    def step(self, feeds: Mapping[str, np.ndarray]) -> float:
        return self.runner.step(feeds)

    def train_reporting_seeds(self, batches: Sequence[Mapping[str, np.ndarray]], iteration: int, seed: int
                              ) -> tuple[Any, list[float]]:
        """ES steps on `batches` from noise iteration `iteration`: (the seed report, the losses)."""
        from fblc.fleet.es_seeds import train_reporting_seeds

        return train_reporting_seeds(self.runner, batches, len(batches), iteration, seed)

    def parameters(self) -> dict[str, np.ndarray]:
        return self.runner.parameters()


class GraphTrainer:
    """The training step as ONNX in onnxruntime (fblc.compiler.reference.ReferenceStep): no kernels."""

    def __init__(self, bundle: str, device: str, step_path: str | None = None) -> None:
        from fblc.compiler.reference import ReferenceStep

        del device
        if step_path is None:
            raise FblcError("device 'graph' runs the training step as ONNX, and no step was given",
                            "write it with 'fblc train-graph MODEL -o step.onnx' and the bundle's training options, "
                            "and pass --step step.onnx")
        self.reference = ReferenceStep(step_path)
        self.shapes = bundle_shapes(fmt.load_manifest(bundle))
        steps = {name: tuple(value.shape) for name, value in self.reference.parameters().items()}
        if steps != self.shapes:
            differ = sorted(set(steps) ^ set(self.shapes)) or sorted(n for n in steps if steps[n] != self.shapes[n])
            raise FblcError(f"step '{step_path}' does not train what bundle '{bundle}' trains (e.g. '{differ[0]}')",
                            "write the step with the options the bundle was compiled with (fblc train-graph)")
        self._initial = {name: value.copy() for name, value in self.reference.state.items()}

    def set_parameters(self, arrays: Mapping[str, np.ndarray], keep_state: bool = False) -> None:
        checked_global(arrays, self.shapes, "the step")
        state = self.reference.state if keep_state else self._initial
        self.reference.state = {name: (np.asarray(arrays[name], np.float32) if name in self.shapes else value.copy())
                                for name, value in state.items()}

    def step(self, feeds: Mapping[str, np.ndarray]) -> float:
        return self.reference.step(feeds)

    def train_reporting_seeds(self, batches: Sequence[Mapping[str, np.ndarray]], iteration: int, seed: int
                              ) -> tuple[Any, list[float]]:
        """ES steps on `batches`, the noise of iterations `iteration`, `iteration` + 1, ... as the device draws it
        (ReferenceStep feeds es_noise(its seed, its step count)): (the seed report of the step's `rewards`, the
        losses)."""
        from fblc.compiler.es import REWARDS_OUTPUT
        from fblc.fleet.es_seeds import SeedReport

        if self.reference.noise_seed != seed:
            raise FblcError(f"the step's ES noise seed is {self.reference.noise_seed}, the bundle's {seed}",
                            "write the step with the options the bundle was compiled with (fblc train-graph)")
        self.reference.steps = iteration
        losses, rewards = [], []
        for feeds in batches:
            losses.append(self.reference.step(feeds))
            rewards.append(np.asarray(self.reference.last[REWARDS_OUTPUT], np.float32).reshape(-1))
        return SeedReport(seed, iteration, np.stack(rewards)), losses

    def parameters(self) -> dict[str, np.ndarray]:
        return self.reference.parameters()


def _adb_trainer(bundle: str, device: str, step_path: str | None = None) -> Trainer:
    from fblc.fleet.adb_trainer import AdbTrainer  # imports this module

    return AdbTrainer(bundle, device, step_path)


#: device kind -> the trainer that runs it
DEVICES: dict[str, Callable[[str, str, str | None], Trainer]] = {
    "local": LocalTrainer, "opencl": LocalTrainer, "graph": GraphTrainer, "adb": _adb_trainer}

_cache: dict[tuple[str, str, str | None], Trainer] = {}


def device_kind(device: str) -> str:
    kind = device.split(":", 1)[0]
    if kind not in DEVICES:
        raise FblcError(f"unknown fleet device '{device}'", f"choose one of: {', '.join(sorted(DEVICES))}")
    return kind


def trainer_for(bundle: str, device: str, step_path: str | None = None) -> Trainer:
    """The trainer of `bundle` on `device`, built once per process (a kernel build or an onnxruntime session)."""
    key = (os.path.abspath(bundle), device, step_path and os.path.abspath(step_path))
    if key not in _cache:
        _cache[key] = DEVICES[device_kind(device)](bundle, device, step_path)
    return _cache[key]


def initial_parameters(bundle: str) -> dict[str, np.ndarray]:
    """The bundle's trainable tensors as compiled: the global model of round 0."""
    return initial_tensors(bundle, fmt.load_manifest(bundle)["parameters"])
