"""Forward bundles of every zoo family on the local device and through the adb runner, against onnxruntime.

    python benchmarks/forward_zoo.py [--only gpt2,resnet,...|all] [--target adreno830] [--no-adb]
                                     [--storages image,buffer]

For one model of each family of the zoo (tests/support/zoo.py: its five families, with vision split as its table
groups it into CNNs, ViTs and dense prediction, and audio's recurrent entry on its own; FAMILIES below names the
model that stands for each): `fblc compile --trainer none --target adreno830` (a phone profile; the kernels run on
PoCL here), then

- `LocalRunner.infer` in image and in buffer storage (launches: the plan's launch sequence; device peak: the bytes
  the OpenCL driver reports for the runner's allocations);
- the native runner over the loopback adb device (tests/support/adb_device.py: `fblc run --infer --device
  adb:SERIAL`, which pushes the bundle and the runner and pulls outputs.bin): image storage only, as on a phone
  (the runner holds every texture as an image2d_t; `--storage buffer` over adb is refused by the CLI);

each compared with onnxruntime on the original model file (an independent reference: the step graph is not
involved). Tolerance (fblc.tools.verify's fp32 one, against the output's scale): every element within
1e-4 |ort| + 1e-5 max |ort|; the table prints max |fblc - ort| / max |ort|. `time` is the seconds of the
run itself: LocalRunner's construction (PoCL builds the kernels, or finds them in its cache from an earlier run)
and one inference; adb: `fblc run`'s own timing of the push of bundle and runner, the runner's build and its run.
The loopback device's shells have HOME in the device folder, so PoCL's cache there starts empty, as on a phone
the first time: the adb time includes compiling every kernel (a second run of a pushed bundle takes ~0.5 s).
`--only all --storages buffer --no-adb` runs every zoo architecture locally.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)

from fblc import bundle_format as fmt  # noqa: E402
from fblc.cli import main as fblc  # noqa: E402
from fblc.compiler.reference import onnxruntime_session  # noqa: E402
from fblc.runtime.local import LocalRunner  # noqa: E402
from fblc.runtime.native import build_runner, pocl_wheel_environment, pyopencl_build_options  # noqa: E402
from support import zoo  # noqa: E402
from support.adb_device import LoopbackDevice  # noqa: E402

#: (family, the zoo model that stands for it): the zoo's five families, vision and audio split as its table groups them
FAMILIES = (("decoder LLM", "gpt2"), ("encoder", "distilbert"), ("encoder-decoder", "bart"),
            ("vision CNN", "resnet"), ("vision ViT", "vit"), ("segmentation (dense)", "dpt"),
            ("audio", "hubert"), ("recurrent", "activity_gru"))
RTOL, ATOL_SCALE = 1e-4, 1e-5


@dataclass
class Row:
    family: str
    model: str
    storage: str
    launches: str = "-"
    peak: str = "-"
    local: str = "-"
    adb: str = "-"
    seconds: str = "-"
    ok: bool = True

    def cells(self) -> tuple[str, ...]:
        return (self.family, self.model, self.storage, self.launches, self.peak, self.local, self.adb, self.seconds,
                "ok" if self.ok else "FAIL")


def error(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> tuple[float, bool]:
    """(the largest max |got - ort| / max |ort| over the outputs, whether every element is within tolerance)."""
    worst, ok = 0.0, list(got) == list(expected)
    for name, want in expected.items():
        have = got.get(name)
        if have is None or have.shape != want.shape:
            return float("inf"), False
        diff, scale = np.abs(have.astype(np.float64) - want), float(np.abs(want).max(initial=0.0)) or 1.0
        worst = max(worst, float(diff.max(initial=0.0)) / scale)
        ok &= bool((diff <= RTOL * np.abs(want) + ATOL_SCALE * scale).all())
    return worst, ok


class Phone:
    """A private adb server and a connected loopback device (as tests/test_adb.py's fixtures), with the native runner
    built once; the device's shells inherit this process's environment, set up so its runner sees the PoCL that
    LocalRunner uses."""

    def __init__(self, folder: str) -> None:
        os.environ.update({**pocl_wheel_environment(os.path.join(folder, "icd")), **pyopencl_build_options()})
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["ANDROID_ADB_SERVER_PORT"] = str(sock.getsockname()[1])
        os.environ.pop("ANDROID_SERIAL", None)
        home = os.path.join(folder, "adb-home")  # adb keeps its key there, not in the user's ~/.android
        os.makedirs(home)
        self._adb("start-server", env={**os.environ, "HOME": home})
        self.device = LoopbackDevice(os.path.join(folder, "phone")).start()
        self.serial = self.device.serial
        self._adb("connect", self.serial)
        deadline = time.monotonic() + 15
        while not any(line.split() == [self.serial, "device"] for line in self._adb("devices").splitlines()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.serial} never came up in 'adb devices'")
            time.sleep(0.05)
        self.runner = build_runner(os.path.join(folder, "runner-build"))

    @staticmethod
    def _adb(*args: str, env: dict[str, str] | None = None) -> str:
        done = subprocess.run(["adb", *args], capture_output=True, text=True, timeout=30, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"adb {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def infer(self, bundle: str, feeds: dict[str, np.ndarray], folder: str) -> tuple[dict[str, np.ndarray], float]:
        data, out = os.path.join(folder, "inputs.npz"), os.path.join(folder, "outputs.npz")
        np.savez(data, **feeds)
        started = time.perf_counter()
        code = fblc(["run", bundle, "--infer", "--device", f"adb:{self.serial}", "--data", data, "-o", out, "-q",
                     "--runner", self.runner])
        seconds = time.perf_counter() - started
        if code != 0:
            raise RuntimeError(f"fblc run --infer over adb exited {code} (its error is above)")
        with np.load(out) as written:
            return {name: written[name] for name in written.files}, seconds

    def close(self) -> None:
        self._adb("disconnect", self.serial)
        self.device.stop()
        self._adb("kill-server")


def rows_of(family: str, arch: zoo.Architecture, folder: str, target: str, phone: Phone | None,
            storages: list[str]) -> list[Row]:
    exported = zoo.build(arch, folder)
    expected = dict(zip([o.name for o in onnxruntime_session(exported.path).get_outputs()],
                        onnxruntime_session(exported.path).run(None, exported.inputs)))
    bundle = os.path.join(folder, f"{arch.name}_forward")
    started = time.perf_counter()
    if fblc(["compile", exported.path, "-o", bundle, "-q", "--trainer", "none", "--target", target]) != 0:
        return [Row(family, arch.name, "-", local="compile refused it (above)", ok=False)]
    compiled = time.perf_counter() - started
    print(f"# {arch.name}: compiled in {compiled:.1f} s; planned device peak "
          f"{fmt.read_json(os.path.join(bundle, fmt.REPORT))['memory']['device_peak']:,} B", flush=True)
    rows = []
    for storage in storages:
        row = Row(family, arch.name, storage)
        try:
            started = time.perf_counter()
            runner = LocalRunner(bundle, storage=storage, progress=False)
            got = runner.infer(exported.inputs)
            row.seconds = f"{time.perf_counter() - started:.1f}"
            row.launches, row.peak = str(sum(1 for _ in runner.launch_sequence())), f"{runner.allocated_bytes:,}"
            worst, row.ok = error(got, expected)
            row.local = f"{worst:.1e}"
        except Exception as failure:  # noqa: BLE001  (a row says what failed; the others still run)
            row.local, row.ok = f"{type(failure).__name__}: {str(failure)[:80]}", False
        if storage == "image" and phone is not None:
            try:
                got, seconds = phone.infer(bundle, exported.inputs, folder)
                worst, ok = error(got, expected)
                row.adb, row.ok, row.seconds = f"{worst:.1e}", row.ok and ok, f"{row.seconds} / {seconds:.1f}"
            except Exception as failure:  # noqa: BLE001
                row.adb, row.ok = f"{type(failure).__name__}: {str(failure)[:80]}", False
        elif storage == "buffer":
            row.adb = "n/a (images)"
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = dict((model, family) for family, model in FAMILIES)
    parser.add_argument("--only", default=",".join(names), help="comma-separated zoo architectures, or all "
                        "(default: one per family)")
    parser.add_argument("--storages", default="image,buffer", help="LocalRunner storages (default: image,buffer)")
    parser.add_argument("--target", default="adreno830", help="fblc compile --target (default: adreno830)")
    parser.add_argument("--no-adb", action="store_true", help="local runs only")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    if not args.no_adb and shutil.which("adb") is None:
        sys.exit("adb not found (apt-get install adb), or pass --no-adb")
    header = ("family", "model", "storage", "launches", "device peak B", "max rel err local", "adb", "time s (local / adb)",
              "result")
    table: list[Row] = []
    with tempfile.TemporaryDirectory() as folder:
        phone = None if args.no_adb else Phone(folder)
        try:
            for name in [a.name for a in zoo.ZOO] if args.only == "all" else args.only.split(","):
                arch = zoo.BY_NAME[name]
                rows = rows_of(names.get(name, arch.family), arch, folder, args.target, phone,
                               args.storages.split(","))
                table += rows
                for row in rows:
                    print(" | ".join(row.cells()), flush=True)
        finally:
            if phone is not None:
                phone.close()
    print("\n" + " | ".join(header))
    print(" | ".join("---" for _ in header))
    for row in table:
        print(" | ".join(row.cells()))
    failed = [f"{r.model} ({r.storage})" for r in table if not r.ok]
    print(f"\n{len(table) - len(failed)} of {len(table)} rows within tolerance" +
          (f"; failed: {', '.join(failed)}" if failed else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
