"""The phone path: push a bundle and the native runner with adb, run it in `adb shell`, pull the results.

Everything goes through the `adb` binary on PATH (or $FBLC_ADB), the way a user would type it (adb_client.py).
On the device a bundle lives in /data/local/tmp/fblc/<bundle name>/ (its files, `fblc-runner`,
`.fblc-pushed` naming what was pushed, and the runner's `kernels.cache`); a run works in
runs/<id>/ below it (the data file, then results.json and params.bin), which is removed when the
run ends, whether it succeeded or not. A forward bundle (--trainer none) runs each batch once and
leaves outputs.bin there too: the model's outputs, decoded as LocalRunner.read does (runtime/native
read_results). A push goes to a hidden staging folder that is renamed into place only when complete,
so a failed push (full disk, lost device) leaves the previous bundle, or nothing, never half a bundle;
locally, parameters are written atomically. `fblc profile --device adb:S` runs the same runner's profile
mode (adb_profile.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import threading
import time
import uuid
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from fblc import bundle_format as fmt
from fblc.runtime.native import (ANDROID_BUILD, HOST_BUILD, OUTPUTS_OUT, PARAMS_OUT, RESULTS, RUNNER_NAME,
                                 UNAME_MACHINES, BinaryKind, RunnerResults, binary_kind, read_results,
                                 runner_candidates, write_data)
from fblc.runtime import specialist as specialists
from fblc.runtime.adb_client import EXIT_MARK, Adb, AdbError, RunnerFailed, _explain, _last_line, _quote

REMOTE_ROOT = "/data/local/tmp/fblc"
STAMP = ".fblc-pushed"
Say = Callable[[str], None]


# --- the runner for a device ------------------------------------------------------------------------------
def device_kind(adb: Adb, serial: str) -> BinaryKind:
    _, output = adb.shell(serial, "uname -m; getprop ro.build.version.sdk 2>/dev/null || true")
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    machine = UNAME_MACHINES.get(lines[0] if lines else "", lines[0] if lines else "unknown")
    android = len(lines) > 1 and lines[1].isdigit()
    return BinaryKind(machine, "android" if android else "linux")


def _fits(runner: BinaryKind, device: BinaryKind) -> bool:
    return runner.machine == device.machine and runner.system in (device.system, "static")


def choose_runner(adb: Adb, serial: str, explicit: str | None) -> str:
    device = device_kind(adb, serial)
    candidates = runner_candidates(explicit)
    if not candidates:
        raise AdbError(f"no native runner built for {serial} ({device}); build it (README: 'Phones'; the Android "
                       f"build goes to {os.path.relpath(ANDROID_BUILD)}) or pass --runner PATH / set FBLC_RUNNER")
    kinds = [(path, binary_kind(path)) for path in candidates if os.path.isfile(path)]
    if not kinds:
        raise AdbError(f"runner '{candidates[0]}' does not exist; build it (see the README) or fix --runner")
    for path, kind in kinds:
        if _fits(kind, device):
            return path
    found = "; ".join(f"{p} is {k}" for p, k in kinds)
    raise AdbError(f"no runner for {serial}, which runs {device} binaries: {found}; build the runner for it "
                   f"(README: 'Phones'; host build: {os.path.relpath(HOST_BUILD)}) or pass --runner PATH")


# --- push -------------------------------------------------------------------------------------------------
def remote_dir(bundle: str) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]", "_", os.path.basename(os.path.abspath(bundle))) or "bundle"
    return f"{REMOTE_ROOT}/{name}"


def _sha256(path: str) -> str:
    return fmt.sha256_of(path)


def stamp_of(bundle: str, runner: str) -> str:
    return f"{_sha256(os.path.join(bundle, fmt.MANIFEST))}-{_sha256(runner)}"


def pushed_stamp(adb: Adb, serial: str, remote: str) -> str:
    _, output = adb.shell(serial, f"cat {_quote(remote + '/' + STAMP)} 2>/dev/null || true")
    return output.strip()


def push_bundle(adb: Adb, serial: str, bundle: str, runner: str, say: Say = lambda line: None) -> str:
    """Push `bundle` and `runner` to the device, atomically; returns the remote folder."""
    manifest, _ = fmt.load_verified(bundle)
    remote = remote_dir(bundle)
    staging = f"{REMOTE_ROOT}/.{os.path.basename(remote)}.partial-{uuid.uuid4().hex[:8]}"
    names = [fmt.MANIFEST, *sorted(set(fmt.CHECKSUMMED) | set(manifest.get("checksums", {})))]
    files = [os.path.join(bundle, name) for name in names]
    size = sum(os.path.getsize(f) for f in files) + os.path.getsize(runner)
    # staging folders of pushes that died with their device are removed first (names are [A-Za-z0-9._-])
    adb.shell(serial, f"rm -rf {REMOTE_ROOT}/.{os.path.basename(remote)}.partial-*; mkdir -p {_quote(staging)}")
    try:
        adb.push(serial, files, staging + "/", what=f"the bundle '{os.path.basename(os.path.abspath(bundle))}'")
        adb.push(serial, [runner], f"{staging}/{RUNNER_NAME}", what="the runner")
        adb.shell(serial, f"chmod 755 {_quote(staging + '/' + RUNNER_NAME)} && "
                          f"echo {stamp_of(bundle, runner)} > {_quote(staging + '/' + STAMP)} && "
                          f"rm -rf {_quote(remote)} && mv {_quote(staging)} {_quote(remote)}")
    except BaseException:
        adb.remove(serial, staging)
        raise
    say(f"pushed {bundle} ({len(files)} files) and the runner ({size / 1024:.0f} KiB) to {serial}:{remote}")
    return remote


def cmd_push(args: Any) -> int:
    adb = Adb()
    serial = adb.choose(args.serial)
    runner = choose_runner(adb, serial, args.runner)
    push_bundle(adb, serial, args.bundle, runner, say=(lambda line: None) if args.quiet else print)
    return 0


# --- run --------------------------------------------------------------------------------------------------
def run_on_device(adb: Adb, serial: str, bundle: str, batches: Sequence[dict], steps: int, runner: str | None = None,
                  on_line: Callable[[dict[str, Any]], None] = lambda line: None, say: Say = lambda line: None,
                  kernel_times: bool = False, specialist: Mapping[str, np.ndarray] | None = None,
                  initial: bytes | None = None) -> RunnerResults:
    """Push if needed, train `steps` steps on the device, pull and return the results (each kernel's device
    time only with `kernel_times`). A forward bundle's steps are its inferences: results.outputs, one per step;
    `specialist` (adapter tensors by name, runtime/specialist.py) goes with the data, the bundle's push unchanged.
    `initial`: the parameters and states to start from, as a params.bin of the bundle's layout (a fleet round's
    global model, fblc.fleet.bundle_params), pushed with the data; the bundle on the device stays as it is."""
    manifest, plan = fmt.load_verified(bundle)
    remote = remote_dir(bundle)
    runner_path = choose_runner(adb, serial, runner)
    if pushed_stamp(adb, serial, remote) != stamp_of(bundle, runner_path):
        push_bundle(adb, serial, bundle, runner_path, say)
    run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    run_dir = f"{remote}/runs/{run_id}"
    with tempfile.TemporaryDirectory(prefix="fblc-adb-") as local:
        data = os.path.join(local, "data.bin")
        write_data(data, manifest, plan, batches)
        adb.shell(serial, f"mkdir -p {_quote(run_dir)}")
        try:
            adb.push(serial, [data], f"{run_dir}/data.bin", what="the data")
            timed = " --kernel-times" if kernel_times else ""
            if specialist is not None:  # its texels alone: a few KB where the weights are megabytes
                arrays = specialists.checked(manifest, bundle, specialist, "the specialist")
                specialists.write_native(os.path.join(local, "specialist.bin"), manifest, plan, arrays)
                adb.push(serial, [os.path.join(local, "specialist.bin")], f"{run_dir}/specialist.bin",
                         what="the specialist")
                timed += f" --specialist runs/{run_id}/specialist.bin"
            if initial is not None:
                with open(os.path.join(local, "params.in"), "wb") as handle:
                    handle.write(initial)
                adb.push(serial, [handle.name], f"{run_dir}/params.in", what="the parameters")
                timed += f" --params runs/{run_id}/params.in"
            stream_runner(adb, serial, remote,
                          f". --data runs/{run_id}/data.bin --steps {steps} --out runs/{run_id}{timed}", on_line)
            pulled = os.path.join(local, "results")
            os.makedirs(pulled)
            # a forward bundle's outputs, or an ES step's member rewards (the runner reads both back per step)
            read_back = fmt.is_forward(manifest) or any(o["name"] == "rewards" for o in manifest["outputs"])
            files = [RESULTS, PARAMS_OUT] + ([OUTPUTS_OUT] if read_back else [])
            adb.pull(serial, [f"{run_dir}/{name}" for name in files], pulled)
            return read_results(pulled, plan)
        finally:
            adb.remove(serial, run_dir)


def stream_runner(adb: Adb, serial: str, remote: str, arguments: str,
                  on_line: Callable[[dict[str, Any]], None]) -> None:
    """Run `remote`/fblc-runner `arguments` (already shell-quoted) in `remote` on the device, handing each JSON
    line it prints to `on_line` as it comes; AdbError with the runner's own error (and compiler log) if it fails."""
    command = f"cd {_quote(remote)} && ./{RUNNER_NAME} {arguments}; echo {EXIT_MARK}$?"
    process = subprocess.Popen([adb.binary, "-s", serial, "shell", command], stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
    code, other, errors_seen = None, [], []
    assert process.stdout is not None and process.stderr is not None
    drain = threading.Thread(target=lambda: errors_seen.append(process.stderr.read()), daemon=True)  # type: ignore
    drain.start()  # stderr in its own thread: a chatty runner must not block on a full pipe
    try:
        for line in process.stdout:
            text = line.strip()
            if text.startswith(EXIT_MARK):
                code = int(text[len(EXIT_MARK):] or 1)
                continue
            if text.startswith("{"):
                try:
                    on_line(json.loads(text))
                    continue
                except ValueError:
                    pass
            if text:
                other.append(text)
        process.wait()
        drain.join(timeout=30)
        stderr = errors_seen[0] if errors_seen else ""
    except BaseException:  # Ctrl-C: closing adb hangs the runner up on the device; it writes nothing
        process.kill()
        process.wait()
        raise
    messages = [line for line in (stderr.splitlines() + other) if line.strip()]
    first = next((i for i, line in enumerate(messages) if line.startswith("fblc-runner: error: ")), None)
    # the runner's error line, and what follows it (a kernel's compiler log), as LocalRunner reports it
    errors = [] if first is None else ["\n".join([messages[first].split("error: ", 1)[1], *messages[first + 1:]])]
    if code is None:
        raise AdbError(_explain(stderr, serial) or f"the run on {serial} ended without an exit status "
                                                   f"({_last_line(stderr or 'adb gave no output')})")
    if code != 0:
        why = errors[0] if errors else _last_line("\n".join(messages) or f"exit status {code}")
        raise RunnerFailed(f"the runner failed on {serial}: {why}")


def describe_devices() -> list[str]:
    """Lines for `fblc devices`: the adb devices, or why there are none. A server that the listing
    starts is stopped again (a listing should leave no daemon behind); one already running is left."""
    try:
        adb = Adb()
    except AdbError as error:
        return [f"(adb: {error})"]
    started = False
    try:
        started = adb.start_server()
        devices = adb.devices()
    except AdbError as error:
        return [f"(adb: {error})"]
    finally:
        if started:
            adb.kill_server()
    if not devices:
        return ["(no adb device attached; 'adb connect HOST:PORT' for one on the network)"]
    lines = []
    for device in devices:
        note = {"unauthorized": " (accept the USB debugging prompt on the phone)",
                "offline": " (reconnect it)"}.get(device.state, "")
        lines.append(f"adb:{device.serial}  {device.state}{note}  {device.description}".rstrip())
    return lines
