"""Commands that run a bundle: run (train), push (to a phone), devices (list what can run it)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any, Iterator

import numpy as np


def batches(data_path: str, manifest: dict[str, Any]) -> tuple[list[dict[str, np.ndarray]], str]:
    """The data file cut into batches of the compiled size, and a note on rows left out."""
    from fblc.runtime.local import DataError

    expected = ", ".join(f"{e['name']} {e['shape']}" for e in manifest["inputs"])
    try:
        data = dict(np.load(data_path))
    except (OSError, ValueError) as error:
        raise DataError(f"cannot read data file '{data_path}' ({error}); it must be an .npz with arrays: "
                        f"{expected}") from None
    rows = None
    problems = []
    for entry in manifest["inputs"]:
        array = data.get(entry["name"])
        if array is None:
            problems.append(f"'{entry['name']}' is missing")
            continue
        if list(array.shape[1:]) != entry["shape"][1:] or array.shape[0] < entry["shape"][0]:
            problems.append(f"'{entry['name']}' has shape {list(array.shape)}")
            continue
        rows = array.shape[0] if rows is None else min(rows, array.shape[0])
    if problems:
        raise DataError(f"data file '{data_path}': {'; '.join(problems)}; expected arrays (any number of rows, at "
                        f"least one batch): {expected}")
    batch = manifest["inputs"][0]["shape"][0]
    count = rows // batch
    cut = [{e["name"]: data[e["name"]][k * batch:(k + 1) * batch] for e in manifest["inputs"]} for k in range(count)]
    note = f"{rows - count * batch} rows past the last full batch are not used" if rows % batch else ""
    return cut, note


def save_parameters(path: str, parameters: dict[str, np.ndarray]) -> None:
    """np.savez to `path` atomically."""
    folder = os.path.dirname(os.path.abspath(path))
    handle, temporary = tempfile.mkstemp(prefix=".fblc-", suffix=".npz", dir=folder)
    os.close(handle)
    try:
        np.savez(temporary, **parameters)
        os.replace(temporary, path if path.endswith(".npz") else path + ".npz")
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def _progress(total: int, enabled: bool) -> Iterator[None]:
    if not enabled:
        yield from (None for _ in range(total))
        return
    from rich.progress import track

    yield from track(range(total), description="training", transient=True, console=None)


def cmd_run(args: argparse.Namespace) -> int:
    from fblc.runtime.local import LocalRunner

    if args.device == "adb" or args.device.startswith("adb:"):
        from fblc.runtime.adb import cmd_run_adb

        return cmd_run_adb(args)
    runner = LocalRunner(args.bundle, device=None if args.device == "local" else args.device)
    cut, note = batches(args.data, runner.manifest)
    if note and not args.quiet:
        print(f"note: {note}", file=sys.stderr)
    if not args.quiet and not args.json:
        print(f"training {args.bundle} on {runner.device.name.strip()}: {args.steps} steps, "
              f"{len(cut)} batch{'es' if len(cut) != 1 else ''} of {runner.manifest['inputs'][0]['shape'][0]}")
    show_bar = sys.stderr.isatty() and not args.quiet and not args.json
    try:
        for step, _ in enumerate(_progress(args.steps, show_bar), start=1):
            started = time.perf_counter()
            loss = runner.step(cut[(step - 1) % len(cut)])
            elapsed = (time.perf_counter() - started) * 1e3
            if args.json:
                print(json.dumps({"step": step, "loss": loss, "ms": round(elapsed, 3)}), flush=True)
            elif not args.quiet:
                print(f"step {step:4d}  loss {loss:.6f}  {elapsed:8.1f} ms", flush=True)
    finally:
        if args.save_params and runner.steps:
            save_parameters(args.save_params, runner.parameters())
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
