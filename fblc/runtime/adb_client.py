"""The adb client: the `adb` binary on PATH (or $FBLC_ADB) run as a user would type it, its device listing and
states, `shell` with the exit status read from a marker line, push / pull / remove, and adb's error lines said in
fblc's words (AdbError). What fblc does with a phone over it (choosing the runner, pushing a bundle, running it) is
in adb.py.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from typing import Sequence

from fblc.bundle_format import BundleError

EXIT_MARK = "fblc-exit:"
SHELL_TIMEOUT = 120.0
TRANSFER_TIMEOUT = 600.0


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
