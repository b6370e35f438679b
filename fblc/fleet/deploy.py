"""A real deployment on Flower's own processes: `fblc fleet serve` runs a SuperLink and `flwr run`, `fblc fleet
join` a SuperNode that drives one device.

`serve` starts `flower-superlink` (one port for Fleet, Control and Runtime APIs, plain HTTP on the loopback or a
trusted network: `--insecure`), writes a Flower config naming it (its own FLWR_HOME), and runs the app of
fblc/fleet/flower_app with `flwr run --stream`, whose log it prints; the ServerApp waits for `--min-clients`
SuperNodes, at most `--wait-clients` seconds a round (fblc.fleet.rounds). `join` runs `flower-supernode` against
that address with the node config its ClientApp reads (bundle, data, device, runner) until it is stopped.
Neither installs anything at run time: the apps import the fblc this Python has (runtime dependency installation
off; PYTHONPATH carries this fblc to Flower's children).

Every process either command starts, and every process those start (SuperExec, flwr-serverapp,
flwr-clientapp, which Flower detaches into sessions of their own), carries FBLC_FLEET_SESSION=<id> in its
environment; stopping finds them by it in /proc and ends them by id: terminate, then kill what is left after
a grace period, so a deployment leaves no process behind.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Mapping, TextIO

from fblc.errors import FblcError

MARKER = "FBLC_FLEET_SESSION"
FLOWER_APP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flower_app")
CONNECTION = "fblc"
START_TIMEOUT = 60.0
#: seconds between a SuperExec's asks for a task to launch (a flwr-serverapp or a message's flwr-clientapp):
#: Flower's default 1 s is waited (0.5 s on average) before every message's process starts; an idle SuperLink and
#: its SuperExec used 0.20 CPU s in 30 s at 1 s, 0.82 at 0.2 s (2 shared cores): 0.5 halves the wait for ~1 % of a core
TASK_POLL = "0.5"
GRACE = 5.0
Say = Callable[[str], None]


class FleetError(FblcError):
    """A Flower process would not start or failed."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def flower_env(home: str, session: str) -> dict[str, str]:
    """The environment of the Flower processes: this Python's scripts first on PATH (SuperLink and SuperNode
    start `flower-superexec` by name), this fblc importable, the session's marker and Flower home."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    python_path = os.pathsep.join(p for p in [root, os.environ.get("PYTHONPATH", "")] if p)
    return {"FLWR_SUPEREXEC_TASK_POLL_INTERVAL": TASK_POLL, **os.environ, "PATH": path, "PYTHONPATH": python_path,
            "FLWR_HOME": home, MARKER: session, "PYTHONUNBUFFERED": "1"}


@dataclass
class Started:
    name: str
    process: subprocess.Popen
    log: str

    def tail(self, lines: int = 15) -> str:
        try:
            with open(self.log, encoding="utf-8", errors="replace") as handle:
                return "\n".join(handle.read().splitlines()[-lines:])
        except OSError:
            return ""


def start(name: str, argv: list[str], env: Mapping[str, str], log: str) -> Started:
    with open(log, "ab") as handle:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=handle, stderr=subprocess.STDOUT,
                                   env=dict(env), start_new_session=True)
    return Started(name, process, log)


def wait_listening(started: Started, port: int, timeout: float = START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if started.process.poll() is not None:
            raise FleetError(f"{started.name} exited with status {started.process.returncode}:\n{started.tail()}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise FleetError(f"{started.name} did not listen on port {port} within {timeout:g} s:\n{started.tail()}")


def session_processes(session: str) -> list[int]:
    """Ids of the live processes whose environment carries this session's marker."""
    needle = f"{MARKER}={session}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                if needle in handle.read().split(b"\0"):
                    with open(f"/proc/{entry}/stat", "rb") as stat:
                        if stat.read().rsplit(b")", 1)[1].split()[0] != b"Z":  # a zombie is already gone
                            found.append(int(entry))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def session_cpu_seconds(session: str) -> float:
    """CPU seconds the session's live processes used, with their reaped children (Flower's per-message
    flwr-clientapp processes are children of a SuperExec): /proc/PID/stat utime, stime, cutime, cstime."""
    total = 0
    for pid in session_processes(session):
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
            total += sum(int(fields[k]) for k in (11, 12, 13, 14))
        except (OSError, IndexError, ValueError):
            continue
    return total / os.sysconf("SC_CLK_TCK")


def stop_session(session: str, grace: float = GRACE) -> list[int]:
    """End every process of the session (SIGTERM, then SIGKILL after `grace`); the ids still alive (none)."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
        pids = session_processes(session)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while pids and time.monotonic() < deadline:
            _reap()
            pids = session_processes(session)
            time.sleep(0.1)
        if not pids:
            return []
    return session_processes(session)


def _reap() -> None:
    """Collect our own exited children (a zombie of ours would otherwise look alive)."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def _exit_on_signal(number: int, frame: object) -> None:
    raise SystemExit(128 + number)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def config_args(values: Mapping[str, object]) -> str:
    """Flower's `key=value` list (run config, node config), values as TOML."""
    return " ".join(f"{key}={_toml_value(value)}" for key, value in values.items())


def serve(run_config: Mapping[str, object], port: int, work: str, say: Say, stream: TextIO | None = None) -> int:
    """Start a SuperLink on `port`, run the fleet app on it to the end, stop everything; flwr run's exit status."""
    session = uuid.uuid4().hex
    home = os.path.join(work, "flwr-home")
    os.makedirs(home, exist_ok=True)
    with open(os.path.join(home, "config.toml"), "w", encoding="utf-8") as handle:
        handle.write(f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
                     f'address = "127.0.0.1:{port}"\ninsecure = true\n')
    env = flower_env(home, session)
    previous = signal.signal(signal.SIGTERM, _exit_on_signal)  # stopped by a service manager: still clean up
    try:
        link = start("flower-superlink", [os.path.join(os.path.dirname(sys.executable), "flower-superlink"),
                                          "--insecure", "--host", "0.0.0.0", "--port", str(port),
                                          "--disable-runtime-dependency-installation"],
                     env, os.path.join(work, "superlink.log"))
        wait_listening(link, port)
        say(f"SuperLink on port {port} (log: {link.log}); waiting for {run_config['min-clients']} SuperNodes "
            f"(fblc fleet join ... --superlink HOST:{port})")
        command = [os.path.join(os.path.dirname(sys.executable), "flwr"), "run", FLOWER_APP, CONNECTION, "--stream",
                   "--run-config", config_args(run_config)]
        run = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               env=env, text=True, bufsize=1)
        assert run.stdout is not None
        for line in run.stdout:
            (stream or sys.stdout).write(line)
        code = run.wait()
        if link.process.poll() is not None:
            raise FleetError(f"the SuperLink exited during the run:\n{link.tail()}")
        return code
    finally:
        signal.signal(signal.SIGTERM, previous)
        say(f"the SuperLink's processes used {session_cpu_seconds(session):.1f} CPU s")
        left = stop_session(session)
        if left:
            say(f"warning: processes {left} of the deployment outlived SIGKILL")


def join(superlink: str, node_config: Mapping[str, object], port: int | None, say: Say,
         work: str | None = None) -> int:
    """Run a SuperNode for one device until it stops or is interrupted; every process it started is ended."""
    session = uuid.uuid4().hex
    work = work or tempfile.mkdtemp(prefix="fblc-supernode-")
    home = os.path.join(work, "flwr-home")
    os.makedirs(home, exist_ok=True)
    port = port or free_port()
    env = flower_env(home, session)
    argv = [os.path.join(os.path.dirname(sys.executable), "flower-supernode"), "--insecure", "--superlink", superlink,
            "--port", str(port), "--node-config", config_args(node_config)]
    say(f"SuperNode for {node_config['device']} joining {superlink} (ClientApp API port {port}): "
        f"{shlex.join(argv[1:])}")
    process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    previous = signal.signal(signal.SIGTERM, _exit_on_signal)  # stopped by a service manager: still clean up
    try:
        return process.wait()
    except KeyboardInterrupt:
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        say(f"the SuperNode's processes used {session_cpu_seconds(session):.1f} CPU s")
        stop_session(session)
