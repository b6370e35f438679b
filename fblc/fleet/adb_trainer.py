"""A fleet client's trainer on a phone over adb: the bundle's native runner, K steps per round in one run.

The bundle is pushed once (fblc.runtime.adb: re-pushed only when it changes), so the runner's program cache on
the phone lasts across rounds; each round hands the runner the global model as a params.bin of the bundle's
layout (`fblc-runner --params`, fblc.fleet.bundle_params), trains the round's batches in one run, and pulls the
trained tensors back. An ES round sets the noise counter the same way and reads each step's member rewards
back (the runner's outputs.bin), for rounds that send seeds. The optimizer state starts from the bundle's own at
every run, as LocalTrainer's restarts every round: `train` takes the round's batches at once, and `step` is a
run of one step (exact for plain SGD, not for momentum or Adam, whose state would restart each step).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from fblc import bundle_format as fmt
from fblc.errors import FblcError
from fblc.fleet.es_seeds import SeedReport
from fblc.fleet.bundle_params import params_bin
from fblc.fleet.trainers import bundle_shapes, checked_global, initial_parameters


class AdbTrainer:
    """The bundle on the adb device `adb:SERIAL` (fblc.fleet.trainers' Trainer, plus `train`)."""

    def __init__(self, bundle: str, device: str, step_path: str | None = None) -> None:
        from fblc.runtime.adb import Adb

        del step_path
        self.bundle, self.adb = bundle, Adb()
        self.serial = self.adb.choose(device.split(":", 1)[1] or None)
        self.shapes = bundle_shapes(fmt.load_manifest(bundle))
        self.values = initial_parameters(bundle)
        #: the native runner to push (None: the one fblc built, fblc.runtime.native.runner_candidates)
        self.runner: str | None = None

    def set_parameters(self, arrays: Mapping[str, np.ndarray], keep_state: bool = False) -> None:
        if keep_state:
            raise FblcError("an adb client restarts the optimizer state at every run of the runner",
                            "use --strategy fedavg or fedadam for phones (FedProx's proximal step keeps the state)")
        checked_global(arrays, self.shapes, f"bundle '{self.bundle}'")
        self.values = {name: np.asarray(arrays[name], np.float32) for name in self.shapes}

    def train(self, batches: Sequence[Mapping[str, np.ndarray]]) -> list[float]:
        """The batches' steps in one run on the phone, from the tensors set; their losses."""
        from fblc.runtime.adb import run_on_device

        results = run_on_device(self.adb, self.serial, self.bundle, batches, len(batches), runner=self.runner,
                                initial=params_bin(self.bundle, self.values))
        self.values = {name: results.parameters[name] for name in self.shapes}
        return [float(loss) for loss in results.losses]

    def train_reporting_seeds(self, batches: Sequence[Mapping[str, np.ndarray]], iteration: int, seed: int
                              ) -> tuple[SeedReport, list[float]]:
        """An ES round on the phone: the runner's noise counter starts at `iteration`, and it reads each step's
        member rewards back (outputs.bin), which the seed report carries instead of the model."""
        from fblc.compiler.es import ITERATION  # here: it loads onnx_ir (fblc.fleet.es_seeds.z_scores says why)
        from fblc.runtime.adb import run_on_device

        initial = params_bin(self.bundle, {**self.values, ITERATION: np.array(iteration, np.float32)})
        results = run_on_device(self.adb, self.serial, self.bundle, batches, len(batches), runner=self.runner,
                                initial=initial)
        self.values = {name: results.parameters[name] for name in self.shapes}
        rewards = np.stack([step["rewards"] for step in results.outputs]).astype(np.float32)
        return SeedReport(seed, iteration, rewards), [float(loss) for loss in results.losses]

    def step(self, feeds: Mapping[str, np.ndarray]) -> float:
        return self.train([feeds])[0]

    def parameters(self) -> dict[str, np.ndarray]:
        return dict(self.values)
