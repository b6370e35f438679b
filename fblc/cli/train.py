"""Commands that run a bundle: run (train), push (to a phone), devices (list what can run it)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, Iterator

import numpy as np

from fblc.cli.data import batches, read_manifest
from fblc.cli.outputs import print_step, report_fallback, save_trained
from fblc.errors import FblcError


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


def note_renamed(manifest: dict, quiet: bool) -> None:
    """After saving: say which saved arrays are torch parameters of another name (the keys stay ONNX names)."""
    from fblc.compiler.torch_names import renamed_note

    note = None if quiet else renamed_note(manifest["parameters"])
    if note:
        print(f"note: {note}", file=sys.stderr)


def cmd_run(args: argparse.Namespace) -> int:
    from fblc.runtime.local import LocalRunner

    if args.device == "adb" or args.device.startswith("adb:"):
        from fblc.cli.run_adb import cmd_run_adb

        if args.storage != "image":
            raise FblcError(f"--storage {args.storage} is for a local OpenCL device: the native runner on a phone "
                            "holds every texture as an image2d_t", "drop --storage, or run on a local device")

        return cmd_run_adb(args)
    # the data is checked before the runner builds its kernels (a minute and more for a large model)
    manifest = read_manifest(args.bundle)
    if "external_rewards" in manifest:
        raise FblcError(f"'{args.bundle}' takes its ES rewards from the application (--reward external), which "
                        "`fblc run` cannot compute", "train it from Python: fblc.runtime.LocalRunner(BUNDLE)"
                        ".step(feeds, reward=fn), or compile with --reward neg-loss or accuracy")
    cut, note = batches(args.data, manifest)
    runner = LocalRunner(args.bundle, device=None if args.device == "local" else args.device, progress=not args.quiet,
                         storage=args.storage)
    if note and not args.quiet:
        print(f"note: {note}", file=sys.stderr)
    if args.storage == "image" and not args.quiet and runner.device.type & runner.cl.device_type.CPU:
        print(f"note: {runner.device.name.strip()} is a CPU, whose OpenCL images are software: --storage buffer "
              "runs the same kernels several times faster", file=sys.stderr)
    if not args.quiet and not args.json:
        print(f"training {args.bundle} on {runner.device.name.strip()}: {args.steps} steps, "
              f"{len(cut)} batch{'es' if len(cut) != 1 else ''} of {runner.manifest['inputs'][0]['shape'][0]}")
    show_bar = sys.stderr.isatty() and not args.quiet and not args.json
    try:
        for step, _ in enumerate(_progress(args.steps, show_bar), start=1):
            started = time.perf_counter()
            loss = runner.step(cut[(step - 1) % len(cut)])
            elapsed = (time.perf_counter() - started) * 1e3
            if args.json or not args.quiet:
                print_step(step, loss, runner.metrics, elapsed, args.json)
    except KeyboardInterrupt:
        # runner.steps counts the steps whose updates are in place: a step cut short left the state as it was
        raise KeyboardInterrupt(interrupted(runner.steps, args.steps, args.save_params, runner.parameters)) from None
    if args.save_params:
        report_fallback(*save_trained(args.save_params, runner.parameters))
        note_renamed(manifest, args.quiet)
    return 0


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
