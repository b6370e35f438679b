"""`fblc run BUNDLE --device adb:SERIAL`: train a bundle on a phone through the native runner (runtime/adb.py).

The command checks the data before anything touches the device, prints the runner's steps as
they arrive, and saves the trained parameters before the results file, so that a late failure
never loses them. The runner runs every step and hands over only the parameters after the last
one: a step that diverged (a non-finite loss that loss scaling did not skip) or non-finite final
parameters make the run an error that names the step, and those parameters are not saved (the
results file, with every loss, still is).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from fblc import bundle_format as fmt
from fblc.cli.data import batches
from fblc.cli.outputs import print_step, report_saved, save_trained
from fblc.paths import write_atomically
from fblc.cli.train import DIVERGED_REMEDY, is_divergence, non_finite, note_renamed, summary
from fblc.errors import FblcError
from fblc.runtime import specialist as specialists
from fblc.runtime.adb import Adb, run_on_device


def cmd_run_adb(args: Any) -> int:
    """`fblc run BUNDLE --device adb:SERIAL ...`"""
    # the option values and --save-params's folder were checked by the CLI before this
    manifest, _ = fmt.load_verified(args.bundle)
    if fmt.is_forward(manifest):  # checked before anything touches the device
        raise FblcError(f"'{args.bundle}' is a forward bundle (--trainer none): it computes the model's outputs and "
                        "trains nothing", "add --infer -o OUTPUTS.npz to run it, or compile a training step")
    cut, note = batches(args.data, manifest)  # the data is checked here, before anything touches the device
    adb = Adb()
    serial = adb.choose(args.device[len("adb:"):] or None)
    quiet, as_json = args.quiet, args.json
    done = [0]  # steps the device reported, for a Ctrl-C's message
    diverged_at: list[str] = []  # the first step whose loss is not finite (loss scaling did not skip it)
    skipped = [0]  # steps loss scaling skipped
    if note and not quiet:
        print(f"note: {note}", file=sys.stderr)

    def on_line(line: dict[str, Any]) -> None:
        if "device" in line and not quiet and not as_json:
            source = "cached program" if line.get("program_from_cache") else f"built in {line['build_ms'] / 1e3:.1f} s"
            print(f"training {args.bundle} on {serial} ({line['device']}; kernels {source}): {args.steps} steps, "
                  f"{len(cut)} batch{'es' if len(cut) != 1 else ''} of {manifest['inputs'][0]['shape'][0]}", flush=True)
        elif "step" in line:
            done[0] = line["step"]
            metrics = {k: v for k, v in line.items() if k not in ("step", "loss", "ms")}
            if as_json or not quiet:
                print_step(line["step"], line["loss"], metrics, line["ms"], as_json)
            skipped[0] += metrics.get("skipped") == 1
            if not diverged_at and is_divergence(line["loss"], metrics):
                diverged_at.append(f"training diverged at step {line['step']}: its loss is {line['loss']}")

    say = (lambda text: None) if quiet or as_json else (lambda text: print(text, flush=True))
    started = time.perf_counter()
    try:
        results = run_on_device(adb, serial, args.bundle, cut, args.steps, runner=getattr(args, "runner", None),
                                on_line=on_line, say=say, kernel_times=getattr(args, "kernel_times", False))
    except KeyboardInterrupt:  # the runner on the device is hung up and writes nothing
        raise KeyboardInterrupt(f"after {done[0]} of {args.steps} steps on {serial}; nothing saved (the runner "
                                "hands the parameters over only at the end of its run)") from None
    seconds = time.perf_counter() - started
    failure = diverged_at[0] if diverged_at else _non_finite_after(results.parameters, done[0])
    saved = save_trained(args.save_params, lambda: results.parameters) if args.save_params and not failure else None
    if getattr(args, "results", None):  # after the parameters: those are the result a late failure must not lose
        write_atomically(args.results, lambda out: out.write(json.dumps(results.raw, indent=1).encode()))
    if failure:
        kept = (f"the runner hands over only the parameters after its last step, {done[0]}: not saved"
                if args.save_params else "nothing saved (no --save-params)")
        raise FblcError(f"{failure}; {kept}", DIVERGED_REMEDY)
    if not quiet and not as_json:
        steps = len(results.step_ms)
        wall = sum(results.step_ms[1:]) / max(1, steps - 1) if steps > 1 else results.step_ms[0]
        textures = f"textures {results.bytes_allocated['textures'] / 2**20:.1f} MiB"
        if results.kernel_ms is None:
            print(f"{wall:.2f} ms per step (after the first); {textures} (--kernel-times: each kernel's time)")
        else:
            kernel = sum(results.kernel_ms[1:]) / max(1, steps - 1) if steps > 1 else results.kernel_ms[0]
            top = sorted(results.kernels, key=lambda k: -k["total_ms"])[:3]
            print(f"kernels {kernel:.2f} ms of {wall:.2f} ms per step (after the first); {textures}; slowest: "
                  + ", ".join(f"{k['name']} {k['mean_ms']:.2f} ms" for k in top))
        print(summary(results.losses, seconds, skipped[0], saved[0] if saved else ""))
    if saved:
        report_saved(*saved, args.save_params, len(results.parameters), quiet, as_json)
        note_renamed(manifest, quiet)
    return 0


def infer_on_device(args: Any, cut: list[dict[str, Any]], specialist: dict[str, Any] | None = None
                    ) -> tuple[list[dict[str, Any]], str]:
    """`fblc run BUNDLE --infer --device adb:SERIAL`: each batch once through the native runner on the phone (its
    data checked by cmd_infer, and `specialist`'s tensors: pushed with the data); the outputs of each batch, and
    where they ran."""
    adb = Adb()
    serial = adb.choose(args.device[len("adb:"):] or None)
    say = (lambda text: None) if args.quiet else (lambda text: print(text, flush=True))
    try:
        results = run_on_device(adb, serial, args.bundle, cut, len(cut), runner=getattr(args, "runner", None), say=say,
                                specialist=specialist)
    except KeyboardInterrupt:  # the runner on the device is hung up and writes nothing
        raise KeyboardInterrupt(f"on {serial}; nothing written (the runner hands the outputs over only at the end of "
                                "its run)") from None
    expected = specialists.site_bytes(fmt.load_manifest(args.bundle)) if specialist is not None else 0
    if results.raw.get("specialist_bytes", 0) != expected:  # the runner's own count of what it wrote
        raise FblcError(f"the runner on {serial} wrote {results.raw.get('specialist_bytes', 0)} bytes of the specialist, "
                        f"not the {expected} of its textures",
                        "rebuild the native runner (README: 'Phones'; fblc-runner --version says 4 or later)")
    if len(results.outputs) != len(cut):  # a runner built before forward bundles writes none
        raise FblcError(f"the runner on {serial} handed over {len(results.outputs)} batches' outputs of {len(cut)}",
                        "rebuild the native runner (README: 'Phones'; fblc-runner --version says 3 or later)")
    return results.outputs, f"{serial} ({results.device['name'].strip()})"


def _non_finite_after(parameters: dict[str, Any], step: int) -> str:
    """'' when the parameters the runner handed over are finite, else what is not."""
    bad = non_finite(parameters)
    return f"the parameters after the last step, {step}: {bad}" if bad else ""

