"""A loopback adb device: adbd's side of adb's transport protocol on 127.0.0.1, for the tests.

Debian's real `adb` client talks to it exactly as to a phone: `adb connect 127.0.0.1:PORT`, then
`adb -s 127.0.0.1:PORT push/pull/shell ...`. What it implements, as adbd does
(system/core/adb/protocol.txt, SYNC.TXT, shell_protocol.h of AOSP):

- the transport: 24-byte little-endian headers (command, arg0, arg1, length, checksum, magic)
  and the messages CNXN, AUTH, OPEN, OKAY, WRTE, CLSE, with adb's flow control (one WRTE in
  flight per stream until the other side's OKAY);
- `shell:` and `shell,v2,...:` (the shell protocol: stdin/stdout/stderr/exit packets, so the
  client gets the command's exit status) and `exec:`; commands run with /bin/sh in the device's
  root folder;
- `sync:` for push and pull: STAT, LIST, SEND (DATA.../DONE), RECV, QUIT.

The device's `/data/local/tmp` is a host folder (`root`): sync paths under it are mapped, and
shell commands get the text `/data/local/tmp` replaced by the folder (a textual mapping: enough
for fblc's commands, not a sandbox). Test knobs: `unauthorized=True` answers CNXN with an AUTH
challenge and never accepts a key (`adb devices` then lists it as unauthorized), and
`capacity=BYTES` makes a push that would grow the folder past it fail the way a full phone
does ("write failed: No space left on device").

    python -m tests.support.adb_device --port PORT --root DIR [--unauthorized] [--capacity BYTES]

serves until killed.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from typing import Callable

A_SYNC, A_CNXN, A_OPEN, A_OKAY = 0x434E5953, 0x4E584E43, 0x4E45504F, 0x59414B4F
A_CLSE, A_WRTE, A_AUTH = 0x45534C43, 0x45545257, 0x48545541
A_VERSION = 0x01000001  # with this version neither side checks payload checksums
MAX_PAYLOAD = 256 * 1024
AUTH_TOKEN, AUTH_SIGNATURE, AUTH_RSAPUBLICKEY = 1, 2, 3
NAMES = {A_SYNC: "SYNC", A_CNXN: "CNXN", A_OPEN: "OPEN", A_OKAY: "OKAY", A_CLSE: "CLSE", A_WRTE: "WRTE",
         A_AUTH: "AUTH"}
FEATURES = "shell_v2,cmd,fixed_push_mkdir"  # no stat_v2 / sendrecv_v2: the client uses the classic sync requests
SYNC_DATA_MAX = 64 * 1024
DEVICE_TMP = "/data/local/tmp"

# shell protocol packet ids (shell_protocol.h)
SHELL_STDIN, SHELL_STDOUT, SHELL_STDERR, SHELL_EXIT, SHELL_CLOSE_STDIN, SHELL_WINDOW = 0, 1, 2, 3, 4, 5


def _packet(command: int, arg0: int, arg1: int, data: bytes = b"") -> bytes:
    return struct.pack("<6I", command, arg0, arg1, len(data), sum(data) & 0xFFFFFFFF, command ^ 0xFFFFFFFF) + data


class Stream:
    """One adb stream (an OPENed service): a byte pipe in, flow-controlled WRTEs out."""

    def __init__(self, connection: "Connection", local_id: int, remote_id: int) -> None:
        self.connection, self.local_id, self.remote_id = connection, local_id, remote_id
        self._inbox = bytearray()
        self._condition = threading.Condition()
        self._can_write = True
        self.remote_closed = False
        self.closed = False
        self.on_remote_close: Callable[[], None] | None = None

    # from the transport
    def feed(self, data: bytes) -> None:
        with self._condition:
            self._inbox += data
            self._condition.notify_all()

    def acknowledged(self) -> None:
        with self._condition:
            self._can_write = True
            self._condition.notify_all()

    def close_from_remote(self) -> None:
        with self._condition:
            self.remote_closed = self.closed = True
            self._condition.notify_all()
        if self.on_remote_close:
            self.on_remote_close()

    # for the service
    def read_exactly(self, size: int) -> bytes | None:
        with self._condition:
            while len(self._inbox) < size and not self.closed:
                self._condition.wait()
            if len(self._inbox) < size:
                return None
            data = bytes(self._inbox[:size])
            del self._inbox[:size]
            return data

    def read_some(self) -> bytes:
        """Whatever has arrived (b"" once the other side closed the stream)."""
        with self._condition:
            while not self._inbox and not self.closed:
                self._condition.wait()
            data = bytes(self._inbox)
            self._inbox.clear()
            return data

    def write(self, data: bytes) -> bool:
        limit = self.connection.max_payload
        for start in range(0, len(data), limit):
            with self._condition:
                while not self._can_write and not self.closed:
                    self._condition.wait()
                if self.closed:
                    return False
                self._can_write = False
            self.connection.send(A_WRTE, self.local_id, self.remote_id, data[start:start + limit])
        return True

    def close(self) -> None:
        with self._condition:
            if self.closed:
                return
            self.closed = True
            self._condition.notify_all()
        self.connection.send(A_CLSE, self.local_id, self.remote_id)
        self.connection.forget(self.local_id)


class Connection(threading.Thread):
    """The transport to one adb server (one TCP connection)."""

    def __init__(self, device: "LoopbackDevice", sock: socket.socket) -> None:
        super().__init__(daemon=True, name="adb-loopback-connection")
        self.device, self.sock = device, sock
        self.max_payload = MAX_PAYLOAD
        self.streams: dict[int, Stream] = {}
        self._next_id = 1
        self._send_lock = threading.Lock()
        self._streams_lock = threading.Lock()

    def send(self, command: int, arg0: int, arg1: int, data: bytes = b"") -> None:
        with self._send_lock:
            try:
                self.sock.sendall(_packet(command, arg0, arg1, data))
            except OSError:
                pass  # the server went away; the reader notices

    def forget(self, local_id: int) -> None:
        with self._streams_lock:
            self.streams.pop(local_id, None)

    def _read_exactly(self, size: int) -> bytes | None:
        chunks = bytearray()
        while len(chunks) < size:
            try:
                chunk = self.sock.recv(size - len(chunks))
            except OSError:
                return None
            if not chunk:
                return None
            chunks += chunk
        return bytes(chunks)

    def run(self) -> None:
        try:
            while True:
                header = self._read_exactly(24)
                if header is None:
                    break
                command, arg0, arg1, length, _, magic = struct.unpack("<6I", header)
                if magic != command ^ 0xFFFFFFFF:
                    break  # not adb: drop the connection as adbd does
                data = self._read_exactly(length) if length else b""
                if data is None:
                    break
                self._handle(command, arg0, arg1, data)
        finally:
            with self._streams_lock:
                streams = list(self.streams.values())
            for stream in streams:
                stream.close_from_remote()
            try:
                self.sock.close()
            except OSError:
                pass

    def _handle(self, command: int, arg0: int, arg1: int, data: bytes) -> None:
        if command == A_CNXN:
            self.max_payload = max(4096, min(MAX_PAYLOAD, arg1))
            if self.device.unauthorized:
                self.send(A_AUTH, AUTH_TOKEN, 0, os.urandom(20))
            else:
                banner = (f"device::ro.product.name={self.device.product};ro.product.model={self.device.model};"
                          f"ro.product.device={self.device.product};features={FEATURES}")
                self.send(A_CNXN, A_VERSION, MAX_PAYLOAD, banner.encode())
        elif command == A_AUTH:
            if arg0 == AUTH_SIGNATURE:  # no key is ever accepted: ask again, then wait for the "user" forever
                self.send(A_AUTH, AUTH_TOKEN, 0, os.urandom(20))
        elif command == A_OPEN:
            if self.device.unauthorized:
                self.send(A_CLSE, 0, arg0)
                return
            service = data.rstrip(b"\0").decode("utf-8", "replace")
            with self._streams_lock:
                local_id = self._next_id
                self._next_id += 1
                stream = Stream(self, local_id, arg0)
                self.streams[local_id] = stream
            handler = self.device.service(service)
            if handler is None:
                self.forget(local_id)
                self.send(A_CLSE, 0, arg0)
                return
            self.send(A_OKAY, local_id, arg0)
            threading.Thread(target=self._serve, args=(handler, stream), daemon=True,
                             name=f"adb-{service[:20]}").start()
        elif command in (A_OKAY, A_WRTE, A_CLSE):
            with self._streams_lock:
                stream = self.streams.get(arg1)
            if stream is None:
                return  # a message for a stream that is gone: ignored, as the protocol says
            if command == A_OKAY:
                stream.acknowledged()
            elif command == A_WRTE:
                stream.feed(data)
                self.send(A_OKAY, stream.local_id, stream.remote_id)
            else:
                self.forget(stream.local_id)
                stream.close_from_remote()

    @staticmethod
    def _serve(handler: Callable[[Stream], None], stream: Stream) -> None:
        try:
            handler(stream)
        finally:
            stream.close()


class LoopbackDevice:
    """Serve the adb device protocol on 127.0.0.1:`port` (0: any free port) with `root` as /data/local/tmp."""

    def __init__(self, root: str, port: int = 0, unauthorized: bool = False, capacity: int | None = None,
                 product: str = "fblc_loopback", model: str = "fblc_loopback_device") -> None:
        self.root = os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)
        self.unauthorized, self.capacity, self.product, self.model = unauthorized, capacity, product, model
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", port))
        self._listener.listen(4)
        self.port = self._listener.getsockname()[1]
        self._connections: list[Connection] = []
        self._thread: threading.Thread | None = None
        self._processes: set[subprocess.Popen] = set()
        self._lock = threading.Lock()

    @property
    def serial(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "LoopbackDevice":
        self._thread = threading.Thread(target=self._accept, daemon=True, name="adb-loopback")
        self._thread.start()
        return self

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connection = Connection(self, sock)
            self._connections.append(connection)
            connection.start()

    def stop(self) -> None:
        try:
            self._listener.close()
        except OSError:
            pass
        for connection in self._connections:
            try:
                connection.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with self._lock:
            processes = list(self._processes)
        for process in processes:
            _hang_up(process)

    def __enter__(self) -> "LoopbackDevice":
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    # paths ----------------------------------------------------------------------------------------
    def local_path(self, remote: str) -> str | None:
        """The host path of a device path under /data/local/tmp, else None."""
        remote = os.path.normpath("/" + remote.lstrip("/")) if remote else "/"
        if remote == DEVICE_TMP or remote.startswith(DEVICE_TMP + "/"):
            return self.root + remote[len(DEVICE_TMP):]
        return None

    def used_bytes(self) -> int:
        total = 0
        for folder, _, files in os.walk(self.root):
            for name in files:
                try:
                    total += os.lstat(os.path.join(folder, name)).st_size
                except OSError:
                    pass
        return total

    # services -------------------------------------------------------------------------------------
    def service(self, name: str) -> Callable[[Stream], None] | None:
        if name == "sync:":
            return self._sync
        if name.startswith("shell") and ":" in name:
            head, command = name.split(":", 1)
            args = head.split(",")[1:] if "," in head else []
            if head.split(",")[0] == "shell":
                return lambda stream: self._shell(stream, command, "v2" in args)
        if name.startswith("exec:"):
            return lambda stream: self._shell(stream, name[len("exec:"):], False, merge_stderr=False)
        return None  # unknown service: the stream is refused with CLSE, as adbd does

    def _shell(self, stream: Stream, command: str, protocol_v2: bool, merge_stderr: bool = True) -> None:
        command = command.replace(DEVICE_TMP, self.root)
        environment = dict(os.environ, HOME=self.root, TMPDIR=self.root)
        try:
            process = subprocess.Popen(["/bin/sh", "-c", command] if command.strip() else ["/bin/sh"], cwd=self.root,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE if protocol_v2 or not merge_stderr else subprocess.STDOUT,
                                       env=environment, start_new_session=True)
        except OSError as error:
            if protocol_v2:
                stream.write(self._shell_packet(SHELL_STDERR, f"/system/bin/sh: {error}\n".encode()))
                stream.write(self._shell_packet(SHELL_EXIT, b"\x7f"))
            return
        with self._lock:
            self._processes.add(process)
        stream.on_remote_close = lambda: _hang_up(process)  # adbd hangs up a shell whose stream the client closed

        def pump(source, packet_id: int) -> None:
            for chunk in iter(lambda: source.read1(SYNC_DATA_MAX), b""):
                stream.write(self._shell_packet(packet_id, chunk) if protocol_v2 else chunk)

        pumps = [threading.Thread(target=pump, args=(process.stdout, SHELL_STDOUT), daemon=True)]
        if process.stderr is not None:
            pumps.append(threading.Thread(target=pump, args=(process.stderr, SHELL_STDERR), daemon=True))
        for thread in pumps:
            thread.start()
        threading.Thread(target=self._shell_stdin, args=(stream, process, protocol_v2), daemon=True).start()
        code = process.wait()
        for thread in pumps:
            thread.join()
        with self._lock:
            self._processes.discard(process)
        if protocol_v2 and not stream.closed:
            stream.write(self._shell_packet(SHELL_EXIT, bytes([code & 0xFF if code >= 0 else 128 - code])))

    @staticmethod
    def _shell_packet(packet_id: int, data: bytes) -> bytes:
        return struct.pack("<BI", packet_id, len(data)) + data

    @staticmethod
    def _shell_stdin(stream: Stream, process: subprocess.Popen, protocol_v2: bool) -> None:
        stdin = process.stdin
        assert stdin is not None
        try:
            if not protocol_v2:
                for data in iter(stream.read_some, b""):
                    stdin.write(data)
                    stdin.flush()
                return
            while True:
                header = stream.read_exactly(5)
                if header is None:
                    return
                packet_id, length = struct.unpack("<BI", header)
                data = stream.read_exactly(length) if length else b""
                if data is None:
                    return
                if packet_id == SHELL_STDIN:
                    stdin.write(data)
                    stdin.flush()
                elif packet_id == SHELL_CLOSE_STDIN:
                    return
        except (BrokenPipeError, ValueError, OSError):
            pass
        finally:
            try:
                stdin.close()
            except OSError:
                pass

    # sync -----------------------------------------------------------------------------------------
    def _sync(self, stream: Stream) -> None:
        while True:
            header = stream.read_exactly(8)
            if header is None:
                return
            request, length = header[:4], struct.unpack("<I", header[4:])[0]
            if request == b"QUIT":
                return
            if length > 1024:
                self._fail(stream, "path too long")
                return
            path = (stream.read_exactly(length) or b"").decode("utf-8", "replace")
            if request == b"STAT":
                self._stat(stream, path)
            elif request == b"LIST":
                self._list(stream, path)
            elif request == b"SEND":
                if not self._receive_file(stream, path):
                    return
            elif request == b"RECV":
                if not self._send_file(stream, path):
                    return
            else:
                self._fail(stream, f"unknown sync request {request!r}")
                return

    @staticmethod
    def _fail(stream: Stream, message: str) -> None:
        data = message.encode()
        stream.write(b"FAIL" + struct.pack("<I", len(data)) + data)

    def _stat(self, stream: Stream, path: str) -> None:
        local = self.local_path(path)
        try:
            info = os.stat(local if local is not None else path)
            reply = struct.pack("<4sIII", b"STAT", info.st_mode & 0xFFFFFFFF, info.st_size & 0xFFFFFFFF,
                                int(info.st_mtime) & 0xFFFFFFFF)
        except OSError:
            reply = struct.pack("<4sIII", b"STAT", 0, 0, 0)
        stream.write(reply)

    def _list(self, stream: Stream, path: str) -> None:
        local = self.local_path(path)
        out = bytearray()
        try:
            entries = [".", ".."] + sorted(os.listdir(local)) if local is not None else []
        except OSError:
            entries = []
        for name in entries:
            try:
                info = os.lstat(os.path.join(local, name))  # type: ignore[arg-type]
            except OSError:
                continue
            encoded = name.encode()
            out += struct.pack("<4sIIII", b"DENT", info.st_mode & 0xFFFFFFFF, info.st_size & 0xFFFFFFFF,
                               int(info.st_mtime) & 0xFFFFFFFF, len(encoded)) + encoded
        out += struct.pack("<4sIIII", b"DONE", 0, 0, 0, 0)
        stream.write(bytes(out))

    def _receive_file(self, stream: Stream, spec: str) -> bool:
        """SEND: DATA chunks then DONE; OKAY, or FAIL (after draining the file, as adbd does)."""
        path, _, mode_text = spec.rpartition(",")
        if not path:
            path, mode_text = spec, "33188"
        mode = int(mode_text) if mode_text.isdigit() else 0o100644
        local = self.local_path(path)
        error = None if local is not None else f"couldn't create file: Permission denied (not under {DEVICE_TMP})"
        partial = f"{local}.adb-partial-{os.getpid()}-{threading.get_ident()}" if local else None
        handle = None
        if error is None:
            try:
                os.makedirs(os.path.dirname(local), exist_ok=True)  # type: ignore[arg-type]
                handle = open(partial, "wb")  # type: ignore[arg-type]
            except OSError as exc:
                error = f"couldn't create file: {exc.strerror}"
        budget = None if self.capacity is None else self.capacity - self.used_bytes()
        written, mtime = 0, None
        while True:
            header = stream.read_exactly(8)
            if header is None:
                break
            kind, size = header[:4], struct.unpack("<I", header[4:])[0]
            if kind == b"DONE":
                mtime = size
                break
            if kind != b"DATA" or size > SYNC_DATA_MAX:
                error = error or "invalid data message"
                break
            data = stream.read_exactly(size)
            if data is None:
                break
            if error is None and budget is not None and written + size > budget:
                error = "write failed: No space left on device"
            if error is None and handle is not None:
                try:
                    handle.write(data)
                    written += size
                except OSError as exc:
                    error = f"write failed: {exc.strerror}"
        if handle is not None:
            handle.close()
        if error is None and mtime is None:
            error = "connection closed before DONE"
        if error is not None:
            if partial and os.path.exists(partial):
                os.unlink(partial)
            self._fail(stream, error)
            return False
        os.chmod(partial, mode & 0o777)  # type: ignore[arg-type]
        os.utime(partial, (mtime, mtime))  # type: ignore[arg-type]
        os.replace(partial, local)  # type: ignore[arg-type]
        stream.write(b"OKAY" + struct.pack("<I", 0))
        return True

    def _send_file(self, stream: Stream, path: str) -> bool:
        local = self.local_path(path)
        try:
            handle = open(local if local is not None else path, "rb")
        except OSError as exc:
            self._fail(stream, f"open failed: {exc.strerror}")
            return False
        with handle:
            for chunk in iter(lambda: handle.read(SYNC_DATA_MAX), b""):
                if not stream.write(b"DATA" + struct.pack("<I", len(chunk)) + chunk):
                    return False
        return stream.write(b"DONE" + struct.pack("<I", 0))


def _hang_up(process: subprocess.Popen) -> None:
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGHUP)
        except (ProcessLookupError, PermissionError):
            pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.adb_device",
                                     description="A loopback adb device on 127.0.0.1 for fblc's tests.")
    parser.add_argument("--port", type=int, required=True, help="TCP port (then: adb connect 127.0.0.1:PORT)")
    parser.add_argument("--root", required=True, help="host folder that is the device's /data/local/tmp")
    parser.add_argument("--unauthorized", action="store_true", help="never accept the host's key")
    parser.add_argument("--capacity", type=int, help="bytes the root may hold before pushes fail as on a full disk")
    args = parser.parse_args(argv)
    device = LoopbackDevice(args.root, args.port, unauthorized=args.unauthorized, capacity=args.capacity).start()
    print(f"loopback adb device on {device.serial}, /data/local/tmp = {device.root}", flush=True)
    stop = threading.Event()
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, lambda *_: stop.set())
    stop.wait()
    device.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
