"""Measuring a bundle's kernels for `fblc tune` (fblc/tools/tune.py): each launch's device time, and whether the
kernels whose schedule changed still compute what the reference bundle's kernels compute.

On a local OpenCL device (LocalBench) the check is per kernel and in isolation: the reference bundle runs one step
launch by launch and keeps the outputs of the kernels that may change; a candidate bundle then runs the same step
launch by launch, compares each such kernel's outputs with the reference's and writes the reference's outputs
into its textures before the next launch, so every kernel is compared on exactly the reference's inputs and a
mismatch names the kernel that made it. Then the whole step runs `repeats` times on a profiling queue and each
launch keeps its fastest time (the least disturbed by other work on the machine).

On a phone (AdbBench) the native runner times each kernel (--kernel-times) over `repeats` steps; it hands back
only the losses and the parameters after its last step, so the check is of those, against the reference run's,
and a mismatch is the whole bundle's (the caller tries the changed kernels one by one to find it).

The tolerance (TOLERANCES): a schedule changes the order of a kernel's sums (float reassociation), nothing else.
A float output may move by `rtol` of the largest magnitude among the kernel's float inputs and that output (the
reference's), element by element (NaN only where the reference has NaN). The inputs are in the scale because a
sum that cancels (a gradient's sum, near 0) moves by the rounding of its terms, not of its result; a wrong index,
a lost or doubled term moves an output by a term's size, which is more unless that term is below `rtol` of the
largest input. An integer output (a saved mask, an index) may differ in at most `MASK_FLIPS` of its elements: a
comparison of a sum that lies within rounding of its threshold may flip.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Collection, Mapping, Sequence

import numpy as np

from fblc import bundle_format as fmt
from fblc.errors import FblcError

#: texture format family -> rtol against the largest magnitude of the kernel's float inputs and the output: an
#: fp32 sum of n terms reassociated moves by about sqrt(n) x 6e-8 of their magnitudes (1e-3: n up to 10^8 typical,
#: 10^4 at worst); a half texture's rounding flips one unit in its last place (2^-10 of the value) where the fp32
#: sum before it moved across a rounding boundary
TOLERANCES = {"float": 1e-3, "half": 1e-2}
#: the fraction of an integer output's elements that may differ (see the module docstring)
MASK_FLIPS = 1e-3
#: a phone's whole-step check (losses and parameters after the run): the kernels' reassociations accumulate
#: over the step and its updates
STEP_TOLERANCES = {"fp32": 1e-3, "fp16": 1e-2}


@dataclass
class Measurement:
    """A bundle's launch times (ms, by kernel name) and the changed kernels whose outputs differ (name -> how);
    `whole`: a difference no kernel could be blamed for (a phone's whole-step check), else ""."""

    times: dict[str, float]
    rejected: dict[str, str] = field(default_factory=dict)
    whole: str = ""


def difference(reference: np.ndarray, got: np.ndarray, texture_format: str, inputs_scale: float = 0.0) -> str:
    """"" when `got` is `reference` up to reassociation (module docstring), else how it differs;
    `inputs_scale`: the largest magnitude among the kernel's float inputs."""
    if reference.shape != got.shape:
        return f"shape {list(got.shape)} instead of {list(reference.shape)}"
    if texture_format in fmt.INTEGER_FORMATS:
        flips = int(np.count_nonzero(reference != got))
        allowed = int(MASK_FLIPS * reference.size)
        return "" if flips <= allowed else f"{flips} of {reference.size} elements differ (at most {allowed} may)"
    ref, out = reference.astype(np.float64), got.astype(np.float64)
    nan_ref, nan_out = np.isnan(ref), np.isnan(out)
    if (nan_ref != nan_out).any():
        return f"NaN at {int(np.count_nonzero(nan_ref != nan_out))} elements where the reference has none or has one"
    finite = ~nan_ref
    if not finite.any():
        return ""
    scale = max(float(np.max(np.abs(ref[finite]))), inputs_scale)
    rtol = TOLERANCES["half" if "f16" in texture_format else "float"]
    error = float(np.max(np.abs(out[finite] - ref[finite])))
    return "" if error <= rtol * scale else (f"max abs difference {error:.3g} > {rtol:g} x {scale:.3g}, the largest "
                                             "magnitude of its inputs and the reference output")


def _largest(array: np.ndarray) -> float:
    finite = np.abs(array[np.isfinite(array)].astype(np.float64))
    return float(finite.max()) if finite.size else 0.0


class LocalBench:
    """Times and checks bundles on a local OpenCL device (see the module docstring)."""

    def __init__(self, feeds: Mapping[str, np.ndarray], device: str | None = None, storage: str = "auto",
                 repeats: int = 5) -> None:
        self.feeds, self.device, self.storage, self.repeats = dict(feeds), device, storage, repeats
        self.trace: dict[str, dict[str, np.ndarray]] = {}  # kernel name -> its outputs by texture name
        self.inputs_scale: dict[str, float] = {}  # kernel name -> the largest magnitude of its float inputs
        self.device_name = ""

    def _runner(self, bundle: str) -> Any:
        from fblc.runtime.local import LocalRunner

        runner = LocalRunner(bundle, device=self.device, profiling=True, progress=False, storage=self.storage)
        if "external_rewards" in runner.manifest:
            raise FblcError(f"'{bundle}' takes its ES rewards from the application (--reward external)",
                            "tune a bundle compiled with --reward neg-loss or accuracy")
        self.device_name = f"{runner.device.name.strip()} ({runner.device.platform.name.strip()}, {runner.storage})"
        runner.check_feeds(self.feeds)
        return runner

    def _upload_feeds(self, runner: Any) -> None:
        for entry in runner.manifest["inputs"]:
            runner.upload(entry["texture"], np.asarray(self.feeds[entry["name"]]))

    def reference(self, bundle: str, watched: Collection[str]) -> Measurement:
        """Run the reference bundle, keeping the outputs of the `watched` kernels (those that may change)."""
        runner = self._runner(bundle)
        self._upload_feeds(runner)
        self.trace = {}
        for index, spec in enumerate(runner.plan["kernels"]):
            runner.launch(index)
            if spec["name"] in watched:
                runner.queue.finish()
                self.trace[spec["name"]] = {runner.textures[t]["name"]: runner._read(t) for t in spec["outputs"]}
                self.inputs_scale[spec["name"]] = max([_largest(runner._read(t)) for t in spec["inputs"]
                                                       if runner.textures[t]["format"] not in fmt.INTEGER_FORMATS],
                                                      default=0.0)
        return Measurement(self._times(runner))

    def measure(self, bundle: str, changed: Collection[str]) -> Measurement:
        """Time `bundle` and compare each `changed` kernel with the reference (in isolation: module docstring)."""
        runner = self._runner(bundle)
        by_name = {t["name"]: t["id"] for t in runner.textures}
        rejected: dict[str, str] = {}
        self._upload_feeds(runner)
        for index, spec in enumerate(runner.plan["kernels"]):
            runner.launch(index)
            expected = self.trace.get(spec["name"]) if spec["name"] in changed else None
            if expected is None:
                continue
            runner.queue.finish()
            for name, reference in expected.items():
                texture = by_name[name]
                problem = difference(reference, runner._read(texture), runner.textures[texture]["format"],
                                     self.inputs_scale[spec["name"]])
                if problem and spec["name"] not in rejected:
                    rejected[spec["name"]] = f"output '{name}': {problem}"
                runner.upload(texture, reference)  # the next kernels read exactly the reference's values
        return Measurement(self._times(runner), rejected)

    def _times(self, runner: Any) -> dict[str, float]:
        best: dict[str, float] = {}
        for _ in range(self.repeats):
            self._upload_feeds(runner)
            names, events = [], []
            for index in runner.launch_sequence():  # a loop's launches once per repetition: the fastest counts
                names.append(runner.plan["kernels"][index]["name"])
                events.append(runner.launch(index))
            runner.queue.finish()
            for name, event in zip(names, events):
                ms = (event.profile.end - event.profile.start) * 1e-6
                best[name] = min(ms, best.get(name, ms))
        return best


class AdbBench:
    """Times bundles on a phone with the native runner and checks each run's losses and final parameters
    against the reference run's (see the module docstring)."""

    def __init__(self, feeds: Mapping[str, np.ndarray], serial: str | None, dtype: str, runner: str | None = None,
                 repeats: int = 5) -> None:
        from fblc.runtime.adb import Adb

        self.adb = Adb()
        self.serial = self.adb.choose(serial)
        self.feeds, self.dtype, self.runner, self.repeats = dict(feeds), dtype, runner, repeats
        self.device_name = f"adb:{self.serial}"
        self.expected: tuple[list[float], dict[str, np.ndarray]] | None = None

    def _run(self, bundle: str) -> Any:
        from fblc.runtime.adb import run_on_device

        results = run_on_device(self.adb, self.serial, bundle, [self.feeds], 1 + self.repeats, runner=self.runner,
                                kernel_times=True)
        if results.device.get("name"):
            self.device_name = f"adb:{self.serial} ({results.device['name']})"
        return results

    @staticmethod
    def _times(results: Any) -> dict[str, float]:
        return {k["name"]: float(k.get("min_ms", k["mean_ms"])) for k in results.kernels}

    def reference(self, bundle: str, watched: Collection[str]) -> Measurement:
        results = self._run(bundle)
        self.expected = (list(results.losses), dict(results.parameters))
        return Measurement(self._times(results))

    def measure(self, bundle: str, changed: Collection[str]) -> Measurement:
        results = self._run(bundle)
        assert self.expected is not None, "reference() first"
        losses, parameters = self.expected
        rtol = STEP_TOLERANCES[self.dtype]
        whole = _step_difference(losses, results.losses, parameters, results.parameters, rtol)
        return Measurement(self._times(results), whole=whole)


def _step_difference(losses: Sequence[float], got_losses: Sequence[float], parameters: Mapping[str, np.ndarray],
                     got: Mapping[str, np.ndarray], rtol: float) -> str:
    """"" when a run's losses and parameters are the reference run's within `rtol` of each one's magnitude."""
    pairs = [("the losses", np.asarray(losses), np.asarray(got_losses))]
    pairs += [(f"parameter '{name}'", value, got.get(name, np.full_like(value, np.nan))) for name, value in
              parameters.items()]
    for what, reference, value in pairs:
        scale = float(np.max(np.abs(reference))) if reference.size else 0.0
        error = float(np.max(np.abs(np.asarray(value, np.float64) - reference))) if reference.size else 0.0
        if not np.isfinite(error) or error > rtol * max(scale, 1e-30):
            return f"{what} after the run differ by {error:.3g} (more than {rtol:g} x {scale:.3g})"
    return ""
