"""`fblc run BUNDLE --infer --data inputs.npz -o outputs.npz`: a forward bundle (--trainer none) on a local device,
or on a phone (--device adb:SERIAL: the native runner, through run_adb.infer_on_device).

The data file is read and checked as for training (fblc.cli.data: finite values, ids inside their tables),
then cut into batches of the compiled size, each run once; the outputs of the batches are joined along
their first axis. Every row must be answered, so rows past the last full batch are refused, not dropped as
a training run drops them; an array the bundle does not read (say 'labels' from a training file) is refused
by name. The outputs are written atomically, by the model's output names.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from fblc import bundle_format as fmt
from fblc.cli.data import batches
from fblc.cli.outputs import save_parameters
from fblc.errors import FblcError
from fblc.runtime import specialist as specialists
from fblc.runtime.feeds import extra_feeds_problem, kind_problem


def _data_names(path: str) -> list[str]:
    """The arrays of the data file (batches() has checked that it is an .npz)."""
    with np.load(path, allow_pickle=False) as archive:
        return list(archive.files)


def joined(results: list[dict[str, np.ndarray]], batch: int) -> dict[str, np.ndarray]:
    """The batches' outputs joined along axis 0 (one batch: as they are). An output whose first axis is not
    the batch (a scalar, a pooled statistic) cannot be joined row by row: refused, asking for one batch."""
    if len(results) == 1:
        return results[0]
    uneven = [name for name, value in results[0].items() if value.ndim == 0 or value.shape[0] != batch]
    if uneven:
        raise FblcError(f"output '{uneven[0]}' has shape {list(results[0][uneven[0]].shape)}, whose first axis is "
                        f"not the batch of {batch}, so {len(results)} batches' outputs cannot be joined row by row",
                        f"give --data exactly one batch ({batch} rows)")
    return {name: np.concatenate([r[name] for r in results]) for name in results[0]}


def specialist_line(bundle: str, manifest: dict, path: str, chosen: dict[str, np.ndarray]) -> str:
    """What loading the specialist cost: its textures' bytes uploaded, against the weights every specialist shares
    (report.json's weights.shared: uploaded once, when the runner starts)."""
    values = sum(int(a.size) for a in chosen.values())
    shared = fmt.read_json(os.path.join(bundle, fmt.REPORT)).get("weights", {}).get("shared")
    kept = f"the weights ({shared:,} bytes) stayed as loaded" if shared is not None else "the weights stayed as loaded"
    return (f"specialist {path}: {len(chosen)} adapter tensors ({values:,} values), "
            f"{specialists.site_bytes(manifest):,} bytes uploaded; {kept}, shared by every specialist")


def cmd_infer(args: argparse.Namespace) -> int:
    from fblc.runtime.local import LocalRunner

    if not args.output:
        raise FblcError("--infer writes the model's outputs to -o, which is not given", "add -o OUTPUTS.npz")
    if args.save_params:
        raise FblcError("--save-params is given with --infer: a forward bundle trains nothing",
                        "drop --save-params")
    manifest = fmt.load_manifest(args.bundle)
    problem = kind_problem(manifest, args.bundle, forward=True)
    if problem is not None:
        raise FblcError(problem, "or drop --infer to train with it")
    cut, note = batches(args.data, manifest)
    problem = extra_feeds_problem(manifest, f"{args.bundle}", {name: None for name in _data_names(args.data)})
    if problem is not None:
        raise FblcError(f"data file '{args.data}': {problem}", "drop that array from the file, or rename it")
    if note:  # rows past the last full batch: an answer for every row, or none
        batch = manifest["inputs"][0]["shape"][0]
        raise FblcError(f"data file '{args.data}': {note}, but --infer answers every row",
                        f"give a multiple of the compiled batch of {batch} rows (pad the last batch and drop its "
                        "outputs)")
    chosen = None  # the specialist's tensors, checked against the bundle's adapter sites before any device work
    if getattr(args, "specialist", None):
        chosen = specialists.checked(manifest, args.bundle, specialists.load_file(args.specialist),
                                     f"specialist '{args.specialist}'")
    started = time.perf_counter()
    if args.device == "adb" or args.device.startswith("adb:"):  # push, build and run on the phone, all timed
        from fblc.cli.run_adb import infer_on_device

        results, where = infer_on_device(args, cut, chosen)
    else:
        runner = LocalRunner(args.bundle, device=None if args.device == "local" else args.device,
                             progress=not args.quiet, storage=args.storage)
        started = time.perf_counter()  # after the kernels' build
        if chosen is not None:
            runner.load_specialist(chosen)
        results, where = [runner.infer(feeds) for feeds in cut], runner.device.name.strip()
    outputs = joined(results, manifest["inputs"][0]["shape"][0] if cut[0] else 1)
    seconds = time.perf_counter() - started
    written = save_parameters(args.output, outputs)  # np.savez, atomically, .npz added where missing
    if not args.quiet:
        shapes = ", ".join(f"{name} {list(value.shape)}" for name, value in outputs.items())
        print(f"ran {args.bundle} on {where}: {len(cut)} batch{'es' if len(cut) != 1 else ''} "
              f"in {seconds:.2f} s; wrote {written} ({shapes})")
        if chosen is not None:
            print(specialist_line(args.bundle, manifest, args.specialist, chosen))
    return 0
