"""Flower deployments on loopback for the fleet's multi-process tests (tests/test_fleet_deploy*.py): `fblc fleet
join` SuperNodes started once the SuperLink listens (a SuperNode started before it backs off exponentially: 7 tries
and ~25 s to connect), a TCP relay between a SuperNode and the SuperLink that keeps every byte the SuperNode sends,
and the processes of a test's deployment, found by a tag in their environment."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

MARKER = "FBLC_TEST_FLEET"
#: no network from a test: Flower's telemetry and update check off
QUIET = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}


def tagged(tag: str) -> list[int]:
    """Live processes whose environment carries MARKER=tag."""
    needle = f"{MARKER}={tag}".encode()
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle, open(f"/proc/{entry}/stat", "rb") as stat:
                if needle in handle.read().split(b"\0") and stat.read().rsplit(b")", 1)[1].split()[0] != b"Z":
                    found.append(int(entry))
        except OSError:
            continue
    return found


def listening(port: int, timeout: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.2)
    return False


def join_argv(bundle: str, superlink: int, device: str, data: str, runner: str = "") -> list[str]:
    return [sys.executable, "-m", "fblc.cli", "fleet", "join", bundle, "--superlink", f"127.0.0.1:{superlink}",
            "--device", device, "--data", data, *(["--runner", runner] if runner else [])]


class Joins:
    """`fblc fleet join` processes, started from a thread once `port` listens (the SuperLink's: `fleet serve` may
    run in the test's own thread meanwhile)."""

    def __init__(self, port: int, commands: list[tuple[list[str], dict[str, str]]]) -> None:
        self.processes: list[subprocess.Popen] = []
        self.thread = threading.Thread(target=self._start, args=(port, commands), daemon=True)
        self.thread.start()

    def _start(self, port: int, commands: list[tuple[list[str], dict[str, str]]]) -> None:
        if listening(port):
            for argv, env in commands:
                self.processes.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                                       stderr=subprocess.STDOUT, text=True))

    def stop(self) -> list[str]:
        """Terminate them (each stops its SuperNode's processes); their output."""
        self.thread.join()
        for process in self.processes:
            process.terminate()
        return [process.communicate(timeout=60)[0] for process in self.processes]


class Relay:
    """127.0.0.1:port forwarded to the SuperLink at 127.0.0.1:target; `sent` holds every byte the SuperNode that
    connects to it sent (the request side of plain HTTP: what leaves the client)."""

    def __init__(self, target: int) -> None:
        self.target, self.sent, self.lock = target, bytearray(), threading.Lock()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.server.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:  # closed
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:  # the SuperLink has stopped: the SuperNode's retries are refused as they would be
                client.close()
                continue
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, record: bool) -> None:
        try:
            while data := source.recv(65536):
                if record:
                    with self.lock:
                        self.sent.extend(data)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                try:
                    end.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> bytes:
        self.server.close()
        with self.lock:
            return bytes(self.sent)
