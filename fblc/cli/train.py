"""Commands that run a bundle: run (train), push (to a phone), devices (list what can run it).

`fblc run` stops at the first step whose loss or trainable parameters are not finite (a learning
rate that diverges): going on would train for hours on NaN. It reads the parameters back after
every step for that check, and keeps the last finite ones, which --save-params then writes. A step
that dynamic loss scaling skipped (metric `skipped` 1) left the parameters as they were: it is no
divergence, whatever its loss.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, Mapping, Sequence

import numpy as np

from fblc import bundle_format as fmt
from fblc.cli.data import batches
from fblc.cli.outputs import print_step, report_saved, save_trained
from fblc.errors import FblcError

if TYPE_CHECKING:
    from fblc.runtime.local import LocalRunner

DIVERGED_REMEDY = "compile the bundle again with a smaller --lr and train again"
NOT_SAVED = "parameters not saved: add --save-params FILE.npz"


def _progress(total: int, enabled: bool) -> Iterator[None]:
    if not enabled:
        yield from (None for _ in range(total))
        return
    from rich.progress import track

    yield from track(range(total), description="training", transient=True, console=None)


def interrupted(done: int, steps: int, save_path: str | None,
                parameters: Callable[[], dict[str, np.ndarray]]) -> str:
    """What a Ctrl-C after `done` of `steps` steps leaves: the parameters after step `done`, saved if asked."""
    if not save_path:
        return f"after {done} of {steps} steps; nothing saved (no --save-params)"
    if not done:
        return f"before the first of {steps} steps finished; nothing saved"
    written, why = save_trained(save_path, parameters)
    saved = f"saved the parameters after step {done} to"
    return f"after {done} of {steps} steps; " + (f"{why}; {saved} '{written}' instead" if why else f"{saved} {written}")


def non_finite(parameters: Mapping[str, np.ndarray]) -> str:
    """'' when every value is finite, else what is not: "parameter 'w1' is nan (3 of 48 values not finite)"."""
    for name, value in parameters.items():
        bad = ~np.isfinite(value)
        if bad.any():
            return (f"parameter '{name}' is {value[bad].flat[0]} ({int(bad.sum())} of {value.size} values not "
                    "finite)")
    return ""


def is_divergence(loss: float, metrics: Mapping[str, float]) -> bool:
    """A non-finite loss of a step that loss scaling did not skip."""
    return not math.isfinite(loss) and metrics.get("skipped") != 1


@dataclass
class Finite:
    """The parameters after the last step whose loss and parameters were all finite (step 0: none yet)."""
    step: int = 0
    parameters: dict[str, np.ndarray] = field(default_factory=dict)


def stopped(cause: str, kept: Finite, save_path: str | None, remedy: str = DIVERGED_REMEDY) -> FblcError:
    """The error that stops a run at `cause`, after saving the last finite parameters when --save-params asks."""
    if not save_path:
        return FblcError(f"{cause}; nothing saved (no --save-params)", remedy)
    if not kept.step:
        return FblcError(f"{cause}; no step ended with finite parameters: nothing saved to '{save_path}'", remedy)
    written, why = save_trained(save_path, lambda: kept.parameters)
    saved = f"saved the parameters after step {kept.step}, the last finite ones, to '{written}'"
    return FblcError(f"{cause}; {why}; {saved} instead" if why else f"{cause}; {saved}", remedy)


def summary(losses: Sequence[float], seconds: float, skipped: int, saved: str) -> str:
    """The closing line of a run: steps, first -> last loss, time, and where the parameters went."""
    skips = f" ({skipped} skipped by loss scaling)" if skipped else ""
    where = "" if saved else f"; {NOT_SAVED}"  # a saved file is named by the line that follows (report_saved)
    steps = f"{len(losses)} step{'s' if len(losses) != 1 else ''}"
    return (f"trained {steps}{skips} in {seconds:.1f} s: loss {losses[0]:.6f} -> {losses[-1]:.6f}"
            f"{where}")


def note_renamed(manifest: dict, quiet: bool) -> None:
    """After saving: say which saved arrays are torch parameters of another name (the keys stay ONNX names)."""
    from fblc.compiler.torch_names import renamed_note

    note = None if quiet else renamed_note(manifest["parameters"])
    if note:
        print(f"note: {note}", file=sys.stderr)


def cmd_run(args: argparse.Namespace) -> int:
    from fblc.runtime.local import LocalRunner

    if getattr(args, "infer", False):
        if (args.device == "adb" or args.device.startswith("adb:")) and args.storage == "buffer":
            raise FblcError(f"--storage {args.storage} is for a local OpenCL device: the native runner on a phone "
                            "holds every texture as an image2d_t", "drop --storage, or run on a local device")
        from fblc.cli.infer import cmd_infer

        return cmd_infer(args)
    if getattr(args, "specialist", None):
        raise FblcError("--specialist is given without --infer: a specialist is loaded into a forward bundle with "
                        "adapter sites (fblc compile --trainer none --adapter KIND)", "add --infer -o OUTPUTS.npz")
    if args.device == "adb" or args.device.startswith("adb:"):
        from fblc.cli.run_adb import cmd_run_adb

        if args.storage == "buffer":
            raise FblcError(f"--storage {args.storage} is for a local OpenCL device: the native runner on a phone "
                            "holds every texture as an image2d_t", "drop --storage, or run on a local device")

        return cmd_run_adb(args)
    if getattr(args, "kernel_times", False):
        raise FblcError("--kernel-times times the kernels of the native runner on a phone (--device adb:SERIAL)",
                        "drop --kernel-times here; on this machine, benchmarks/estimate_check.py times each kernel")
    # the manifest (its own digest) and the data are checked before the runner builds its kernels (a minute
    # and more for a large model); the runner checks the other files' checksums
    manifest = fmt.load_manifest(args.bundle)
    if fmt.is_forward(manifest):
        raise FblcError(f"'{args.bundle}' is a forward bundle (--trainer none): it computes the model's outputs and "
                        "trains nothing", "add --infer -o OUTPUTS.npz to run it, or compile a training step")
    if "external_rewards" in manifest:
        raise FblcError(f"'{args.bundle}' takes its ES rewards from the application (--reward external), which "
                        "`fblc run` cannot compute", "train it from Python: fblc.runtime.LocalRunner(BUNDLE)"
                        ".step(feeds, reward=fn), or compile with --reward neg-loss or accuracy")
    cut, note = batches(args.data, manifest)
    runner = LocalRunner(args.bundle, device=None if args.device == "local" else args.device, progress=not args.quiet,
                         storage=args.storage)
    if note and not args.quiet:
        print(f"note: {note}", file=sys.stderr)
    if runner.storage_reason and not args.quiet:
        print(f"note: --storage auto chose {runner.storage}: {runner.storage_reason}", file=sys.stderr)
    if not args.quiet and not args.json:
        print(f"training {args.bundle} on {runner.device.name.strip()}: {args.steps} steps, "
              f"{len(cut)} batch{'es' if len(cut) != 1 else ''} of {runner.manifest['inputs'][0]['shape'][0]}")
    started = time.perf_counter()
    try:
        kept, losses, skipped = _train(runner, cut, args)
    except KeyboardInterrupt:
        # runner.steps counts the steps whose updates are in place: a step cut short left the state as it was
        raise KeyboardInterrupt(interrupted(runner.steps, args.steps, args.save_params, runner.parameters)) from None
    seconds = time.perf_counter() - started
    written, why = "", ""
    if args.save_params:  # the parameters read after the last step: no device read can fail here
        written, why = save_trained(args.save_params, lambda: kept.parameters)
    if not args.quiet and not args.json:
        print(summary(losses, seconds, skipped, written))
    if args.save_params:
        report_saved(written, why, args.save_params, len(kept.parameters), args.quiet, args.json)
        note_renamed(manifest, args.quiet)
    return 0


def _train(runner: LocalRunner, cut: Sequence[Mapping[str, np.ndarray]],
           args: argparse.Namespace) -> tuple[Finite, list[float], int]:
    """Run the steps, printing each; (the last finite parameters, the losses, the steps loss scaling skipped).
    FblcError at the first step that diverges, or whose parameters cannot be read back."""
    show_bar = sys.stderr.isatty() and not args.quiet and not args.json
    kept, losses, skipped = Finite(), [], 0
    for step, _ in enumerate(_progress(args.steps, show_bar), start=1):
        started = time.perf_counter()
        loss = runner.step(cut[(step - 1) % len(cut)])
        elapsed = (time.perf_counter() - started) * 1e3
        if args.json or not args.quiet:
            print_step(step, loss, runner.metrics, elapsed, args.json)
        losses.append(loss)
        skipped += runner.metrics.get("skipped") == 1
        if is_divergence(loss, runner.metrics):
            raise stopped(f"training diverged at step {step}: its loss is {loss}", kept, args.save_params)
        try:
            parameters = runner.parameters()
        except Exception as error:  # a driver failure ends the run, but never loses what it trained
            first = (str(error).strip().splitlines() or [""])[0]
            raise stopped(f"reading the parameters back after step {step} failed ({type(error).__name__}: {first})",
                          kept, args.save_params, "rerun with --debug for the traceback and report it") from error
        bad = non_finite(parameters)
        if bad:
            raise stopped(f"training diverged at step {step}: {bad}", kept, args.save_params)
        kept = Finite(step, parameters)
    return kept, losses, skipped


def cmd_push(args: argparse.Namespace) -> int:
    from fblc.runtime.adb import cmd_push as push

    return push(args)


def cmd_devices(args: argparse.Namespace) -> int:
    from fblc.runtime.adb import describe_devices
    from fblc.runtime.opencl import list_devices

    found = list_devices()
    print("OpenCL devices:" if found else "no OpenCL device found (pip install pocl-binary-distribution)")
    for line in found:
        print(f"  {line}")
    print("adb devices (--device adb:SERIAL):")
    for line in describe_devices():
        print(f"  {line}")
    return 0
