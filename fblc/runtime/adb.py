"""The phone path: push a bundle and the native runner with adb, run it in `adb shell`, pull the results.

Everything goes through the `adb` binary on PATH (or $FBLC_ADB), the way a user would type it.
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
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from fblc import bundle_format as fmt
from fblc.bundle_format import BundleError
from fblc.runtime.native import (ANDROID_BUILD, HOST_BUILD, OUTPUTS_OUT, PARAMS_OUT, RESULTS, RUNNER_NAME,
                                 UNAME_MACHINES, BinaryKind, RunnerResults, binary_kind, read_results,
                                 runner_candidates, write_data)
from fblc.runtime import specialist as specialists

REMOTE_ROOT = "/data/local/tmp/fblc"
STAMP = ".fblc-pushed"
EXIT_MARK = "fblc-exit:"
SHELL_TIMEOUT = 120.0
TRANSFER_TIMEOUT = 600.0
Say = Callable[[str], None]


class AdbError(BundleError):
    """adb missing, no or the wrong device, a failed transfer or a failed run on the device."""


class RunnerFailed(AdbError):
    """The runner itself failed on the device: its error line (and a compiler's log) is the message."""


@dataclass(frozen=True)
class AdbDevice:
    serial: str
    state: str            # device, unauthorized, offline, no permissions, ...
    description: str      # model:... product:... from `adb devices -l`


def _quote(path: str) -> str:
    return shlex.quote(path)


class Adb:
    """The adb client binary."""

    def __init__(self, binary: str | None = None) -> None:
        name = binary or os.environ.get("FBLC_ADB") or "adb"
        found = shutil.which(name)
        if found is None:
            raise AdbError(f"adb not found ({'FBLC_ADB=' + name if os.environ.get('FBLC_ADB') else 'not on PATH'}); "
                           "install Android platform-tools (Debian: apt-get install adb) or set FBLC_ADB to the "
                           "adb binary")
        self.binary = found

    # running adb ------------------------------------------------------------------------------------
    def _run(self, args: Sequence[str], timeout: float = SHELL_TIMEOUT) -> subprocess.CompletedProcess:
        try:
            return subprocess.run([self.binary, *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AdbError(f"'adb {' '.join(args[:4])}' did not answer within {timeout:.0f} s; check the device "
                           "and the cable (adb devices), then retry") from None

    def start_server(self) -> bool:
        """Start the adb server unless one is running; whether this call started it (adb then says
        "* daemon started successfully" on stderr; it says nothing when one was running)."""
        done = self._run(["start-server"], timeout=60)
        if done.returncode != 0:
            raise AdbError(f"'adb start-server' failed: {_last_line(done.stderr or done.stdout)}")
        return "daemon started" in done.stderr + done.stdout

    def kill_server(self) -> None:
        self._run(["kill-server"], timeout=30)

    def devices(self) -> list[AdbDevice]:
        done = self._run(["devices", "-l"], timeout=60)
        if done.returncode != 0:
            raise AdbError(f"'adb devices' failed: {_last_line(done.stderr or done.stdout)}")
        found = []
        listing = done.stdout.split("List of devices attached", 1)[-1]
        for line in listing.splitlines():
            line = line.strip()
            if not line or line.startswith("*"):
                continue
            parts = line.split(None, 1)
            if len(parts) < 2:
                continue
            serial, rest = parts
            state = "no permissions" if rest.startswith("no permissions") else rest.split()[0]
            description = " ".join(p for p in rest.split()[1:] if not p.startswith("transport_id:"))
            found.append(AdbDevice(serial, state, description))
        return found

    def choose(self, serial: str | None) -> str:
        """The serial to use: `serial`, or the one device attached; a clear error for every other case."""
        devices = self.devices()
        if serial:
            matches = [d for d in devices if d.serial == serial]
            if not matches:
                attached = ", ".join(f"{d.serial} ({d.state})" for d in devices) or "none"
                hint = f"; for a network device run 'adb connect {serial}' first" if ":" in serial else ""
                raise AdbError(f"no adb device '{serial}' (attached: {attached}){hint}")
            device = matches[0]
        else:
            if not devices:
                raise AdbError("no adb device found; connect a phone with USB debugging on (check with 'adb "
                               "devices'), or 'adb connect HOST:PORT' for one on the network")
            if len(devices) > 1:
                raise AdbError(f"several adb devices are attached ({', '.join(d.serial for d in devices)}); "
                               "choose one with --serial S (fblc push) or --device adb:S (fblc run)")
            device = devices[0]
        _check_state(device)
        return device.serial

    def shell(self, serial: str, command: str, check: bool = True, timeout: float = SHELL_TIMEOUT) -> tuple[int, str]:
        """Run `command` with the device's sh; (exit status, stdout+stderr). The status is read from a
        marker line, so it is right even on devices whose adbd lacks the shell protocol."""
        done = self._run(["-s", serial, "shell", f"{command}; echo {EXIT_MARK}$?"], timeout=timeout)
        output = done.stdout + done.stderr
        match = re.search(rf"{EXIT_MARK}(\d+)\s*$", done.stdout)
        if match is None:
            raise AdbError(_explain(output, serial) or f"'adb shell' on {serial} failed: {_last_line(output)}")
        code = int(match.group(1))
        output = (done.stdout[:match.start()] + done.stderr).strip()
        if check and code != 0:
            raise AdbError(f"'{command}' failed on {serial} (exit status {code}): {_last_line(output)}")
        return code, output

    def push(self, serial: str, sources: Sequence[str], destination: str, what: str) -> None:
        done = self._run(["-s", serial, "push", *sources, destination], timeout=TRANSFER_TIMEOUT)
        if done.returncode != 0:
            output = done.stderr + done.stdout
            if "No space left on device" in output:
                raise AdbError(f"{serial} is full: pushing {what} to {destination} failed (No space left on device); "
                               f"free space on the phone (adb -s {serial} shell df -h /data/local/tmp) and retry")
            raise AdbError(_explain(output, serial) or f"pushing {what} to {serial}:{destination} failed: "
                                                       f"{_last_line(output)}")

    def remove(self, serial: str, path: str) -> None:
        """rm -rf `path` on the device, best effort: it cleans up after a failure, which must stay the error shown."""
        try:
            self.shell(serial, f"rm -rf {_quote(path)}", check=False, timeout=30)
        except AdbError:
            pass

    def pull(self, serial: str, sources: Sequence[str], destination: str) -> None:
        done = self._run(["-s", serial, "pull", *sources, destination], timeout=TRANSFER_TIMEOUT)
        if done.returncode != 0:
            output = done.stderr + done.stdout
            if "No space left on device" in output:
                raise AdbError(f"this computer's disk is full: pulling the results from {serial} failed")
            raise AdbError(_explain(output, serial)
                           or f"pulling the results from {serial} failed: {_last_line(output)}")


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip() and not line.startswith("*")]
    return lines[-1] if lines else "no output"


def _check_state(device: AdbDevice) -> None:
    if device.state == "device":
        return
    if device.state == "unauthorized":
        raise AdbError(f"device {device.serial} is unauthorized: unlock the phone and accept the 'Allow USB "
                       "debugging' prompt, then retry")
    if device.state == "offline":
        raise AdbError(f"device {device.serial} is offline; reconnect it (adb reconnect, or replug the cable) and "
                       "retry")
    if device.state == "no permissions":
        raise AdbError(f"no permission to use device {device.serial}; set up udev rules for it (see 'adb devices')")
    raise AdbError(f"device {device.serial} is in state '{device.state}', not ready; wait for it (adb wait-for-device)")


def _explain(output: str, serial: str) -> str | None:
    """adb's own error lines, said in fblc's words (for a device that changed state since we looked)."""
    if "unauthorized" in output:
        return f"device {serial} is unauthorized: accept the 'Allow USB debugging' prompt on the phone, then retry"
    if "offline" in output:
        return f"device {serial} is offline; reconnect it and retry"
    if "not found" in output and "device" in output:
        return f"device {serial} is gone (adb: {_last_line(output)}); reconnect it and retry"
    if "more than one device" in output:
        return "several adb devices are attached; choose one with --serial S / --device adb:S"
    return None


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
