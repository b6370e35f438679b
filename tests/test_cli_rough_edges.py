"""The rough edges a newcomer hits (issue 36): a slow `--help`, a silent kernel build, kernel counts that
disagree, `check` options that do nothing, commands without a description, an adb server left running."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from types import ModuleType, SimpleNamespace
from typing import Callable

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from fblc import choices
from fblc.cli import build_parser, main
from fblc.runtime import build_progress
from fblc.runtime.build_progress import POCL_PLATFORM, BuildProgress
from tests.conftest import make_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY = ("onnx", "onnx_ir", "onnxruntime", "numpy", "pyopencl", "torch")


def subcommands() -> argparse._SubParsersAction:
    return next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))


def commands() -> dict[str, argparse.ArgumentParser]:
    return dict(subcommands().choices)


# --- `fblc --help` and argument errors import nothing heavy -----------------------------------------------------
PARSER_PATHS = """
import contextlib, io, json, sys
import fblc.cli as cli
cli.build_parser()
for argv in (["--help"], ["compile", "--help"], ["compile"], ["run", "b", "--data", "d.npz", "--lr", "x"],
             ["compile", "m.onnx", "-o", "out", "--loss", "bogus"], ["compile", "m.onnx", "-o", "out", "--lr", "nan"]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            code = cli.main(argv)
        except SystemExit as exit:
            code = exit.code
    assert code in (0, 2), (argv, code)
print(json.dumps(sorted(name for name in json.loads(sys.argv[1]) if name in sys.modules)))
"""


def test_help_and_argument_errors_import_no_compiler_runtime_or_numpy() -> None:
    done = subprocess.run([sys.executable, "-c", PARSER_PATHS, json.dumps(HEAVY)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []  # was onnx, onnx_ir and numpy: 1.5 s before a usage line


def test_the_choice_tables_agree_with_the_modules_that_implement_them() -> None:
    from fblc.compiler import adapters, es, losses, optimizers

    assert {name: spec.help for name, spec in losses.LOSSES.items()} == choices.LOSSES
    assert choices.IGNORE_INDEX == losses.IGNORE_INDEX
    assert choices.OPTIMIZERS == tuple(optimizers.OPTIMIZERS)
    assert set(choices.ES_OPTIMIZERS) <= set(optimizers.OPTIMIZERS)
    assert choices.ADAPTERS == adapters.ADAPTERS
    assert choices.DEFAULT_RANK == adapters.AdapterConfig().rank
    assert choices.REWARDS == es.REWARDS
    defaults = es.EsConfig()
    assert (choices.ES_PAIRS, choices.ES_SIGMA, choices.ES_REWARD) == (defaults.pairs, defaults.sigma, defaults.reward)


# --- every command says what it does -----------------------------------------------------------------------------
def test_every_command_has_a_help_line_and_a_description() -> None:
    parsers = commands()
    assert {"devices", "targets"} <= set(parsers)
    undescribed = [name for name, parser in parsers.items() if not (parser.description or "").strip()]
    assert undescribed == []  # was devices and targets
    listed = {action.dest: action.help for action in subcommands()._choices_actions}  # `fblc --help`'s list
    assert [name for name in parsers if not listed.get(name)] == []


# --- check takes the options that change the step it checks, and those only --------------------------------------
ES_OPTIONS = ("--trainer", "--pairs", "--sigma", "--reward", "--es-optimizer")
ADAPTER_OPTIONS = ("--adapter", "--rank", "--adapter-sites", "--block", "--fura-sites", "--tile-mb")


def options(command: str) -> set[str]:
    return {option for action in commands()[command]._actions for option in action.option_strings}


def test_check_takes_the_adapter_options_and_not_the_es_ones_or_seed() -> None:
    assert options("check") & {*ES_OPTIONS, "--seed"} == set()  # listed by `fblc check --help`, and did nothing
    assert set(ADAPTER_OPTIONS) <= options("check")
    assert {*ES_OPTIONS, *ADAPTER_OPTIONS, "--seed"} <= options("compile")


def test_check_refuses_an_es_option_as_an_argument_error(mlp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exit:  # was an internal error (StopIteration), exit 1
        main(["check", mlp_path, "--trainer", "es"])
    assert exit.value.code == 2
    assert "unrecognized arguments: --trainer es" in capsys.readouterr().err


def test_check_honours_the_adapter_options(mlp_path, capsys) -> None:
    assert main(["check", mlp_path]) == 0
    assert "  w1  (1 tensor, 48 values)" in capsys.readouterr().out
    assert main(["check", mlp_path, "--adapter", "lora", "--rank", "1"]) == 0
    out = capsys.readouterr().out
    assert "  w1.adapter_A  (1 tensor, 6 values)" in out and "  w1  (1 tensor" not in out


# --- compile and run count kernels the same way ------------------------------------------------------------------
def test_compile_says_distinct_kernels_and_launches(tmp_path, capsys) -> None:
    """Two equal 8x8 layers launch the same kernels twice: the counts differ."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["a"]),
             helper.make_node("MatMul", ["a", "w2"], ["y"]), helper.make_node("Relu", ["y"], ["logits"])]
    weights = {name: rng.standard_normal((8, 8)).astype(np.float32) for name in ("w1", "w2")}
    path = str(tmp_path / "twice.onnx")
    onnx.save(make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
                         [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [4, 8])], weights), path)
    bundle = str(tmp_path / "twice")
    assert main(["compile", path, "-o", bundle]) == 0
    with open(os.path.join(bundle, "plan.json"), encoding="utf-8") as handle:
        launches = json.load(handle)["kernels"]
    distinct = len({launch["function"] for launch in launches})
    assert distinct < len(launches)
    assert f" {distinct} distinct kernels ({len(launches)} launches: " in capsys.readouterr().out


# --- the first step's kernel build moves ---------------------------------------------------------------------------
def pocl_device() -> SimpleNamespace:
    return SimpleNamespace(name="pthread-test ", platform=SimpleNamespace(name=POCL_PLATFORM))


def touched_program(cache: str, name: str) -> str:
    """A program folder PoCL just built (its last_accessed touched), no kernel compiled into it yet."""
    folder = os.path.join(cache, name[:2], name)
    os.makedirs(folder)
    open(os.path.join(folder, "last_accessed"), "w").close()
    return folder


def compile_kernel(program: str, function: str) -> None:
    """What a kernel's first launch leaves in PoCL's cache: its work-group function for the launch's local size."""
    os.makedirs(os.path.join(program, function, "64-1-1-goffs0-smallgrid"))
    open(os.path.join(program, function, "64-1-1-goffs0-smallgrid", f"{function}.so"), "w").close()


def wait_for(said: list[str], count: int) -> list[str]:
    deadline = time.monotonic() + 30
    while len(said) < count and time.monotonic() < deadline:
        time.sleep(0.005)
    return said


@pytest.fixture
def fast_ticks(tmp_path, monkeypatch) -> str:
    monkeypatch.setattr(build_progress, "PROGRESS_EVERY_S", 0.01)
    monkeypatch.setenv("POCL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("POCL_KERNEL_CACHE", raising=False)
    return str(tmp_path)


def test_the_first_step_says_how_many_kernels_are_built_as_it_builds_them(fast_ticks) -> None:
    said: list[str] = []
    progress = BuildProgress(said.append, pocl_device(), ["k0_A", "k1_B", "k2_C"])
    progress.start()
    touched_program(fast_ticks, "GEPROBE")  # fblc's device probe, built at the same time: none of our kernels
    ours = touched_program(fast_ticks, "MJOURS")
    progress.program_built()
    assert said == [f"building 3 distinct kernels for pthread-test (first run; cached in {fast_ticks})"]
    time.sleep(0.1)
    assert len(said) == 1  # nothing compiled yet: nothing new to say (a runner left unstepped stays quiet)
    compile_kernel(ours, "k0_A")
    assert re.fullmatch(r"  built 1 of 3 \(\d+ s\)", wait_for(said, 2)[1])
    compile_kernel(ours, "k1_B")
    assert re.fullmatch(r"  built 2 of 3 \(\d+ s\)", wait_for(said, 3)[2])
    compile_kernel(ours, "k2_C")
    wait_for(said, 4)
    progress.first_step_done()
    assert re.fullmatch(r"built 3 distinct kernels in \d+\.\d s", said[-1])
    lines = len(said)
    time.sleep(0.1)
    assert len(said) == lines  # the ticker stopped with the step


def test_a_slow_program_build_says_that_it_still_builds(fast_ticks, monkeypatch) -> None:
    monkeypatch.setattr(build_progress, "ANNOUNCE_AFTER_S", 0.01)
    said: list[str] = []
    other_driver = SimpleNamespace(name="gpu-test", platform=SimpleNamespace(name="NVIDIA CUDA"))
    progress = BuildProgress(said.append, other_driver, ["k0_A"])
    progress.start()
    assert re.fullmatch(r"  still building \(\d+ s\)", wait_for(said, 2)[1])  # inside clBuildProgram
    progress.program_built()
    assert re.fullmatch(r"built 1 kernel in \d+\.\d s", said[-1])
    lines = len(said)
    time.sleep(0.1)
    assert len(said) == lines


# a fresh process, so that PoCL reads this POCL_CACHE_DIR; the lines come every 10 ms
COLD_STEP = """
import sys
import numpy as np
from fblc.runtime import build_progress
from fblc.runtime.local import LocalRunner
build_progress.PROGRESS_EVERY_S = 0.01
runner = LocalRunner(sys.argv[1], progress=print)
runner.step(dict(np.load(sys.argv[2])))
"""


def test_a_cold_first_step_counts_its_kernels_while_pocl_compiles_them(tmp_path, mlp_path) -> None:
    bundle, data = str(tmp_path / "mlp"), str(tmp_path / "batch.npz")
    assert main(["compile", mlp_path, "-o", bundle, "-q"]) == 0
    np.savez(data, x=np.ones((4, 6), np.float32), labels=np.array([0, 1, 2, 0]))
    cache = str(tmp_path / "pocl-cache")
    os.mkdir(cache)
    done = subprocess.run([sys.executable, "-c", COLD_STEP, bundle, data], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "POCL_CACHE_DIR": cache}, timeout=600)
    assert done.returncode == 0, done.stderr
    counts = [tuple(map(int, found.groups())) for found in re.finditer(r"^  built (\d+) of (\d+) ", done.stdout, re.M)]
    # the step's blocking read held the GIL: no line came until every kernel was built
    assert any(0 < built < total for built, total in counts), done.stdout


# --- the quickstart ends with a summary -------------------------------------------------------------------------------
def quickstart() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fblc_example_quickstart", os.path.join(ROOT, "examples",
                                                                                          "quickstart.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_quickstart_ends_with_where_the_bundle_is_and_how_to_keep_the_parameters() -> None:
    text = quickstart().summary(20, "runs/quickstart/tresnet.adreno830", "runs/quickstart/sensor.npz")
    assert "bundle: runs/quickstart/tresnet.adreno830/" in text
    assert ("fblc run runs/quickstart/tresnet.adreno830 --data runs/quickstart/sensor.npz --steps 20 --save-params "
            "runs/quickstart/trained.npz") in text


# --- fblc devices leaves no adb server it started ------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _until(condition: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + 10
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


@pytest.fixture
def adb_port(tmp_path, monkeypatch) -> int:
    """A port of its own for the adb server, and a HOME for its key; no server there yet."""
    if shutil.which("adb") is None:
        pytest.skip("adb is missing (apt-get install adb)")
    port = _free_port()
    monkeypatch.setenv("ANDROID_ADB_SERVER_PORT", str(port))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("FBLC_ADB", raising=False)
    yield port
    subprocess.run(["adb", "kill-server"], capture_output=True, timeout=30)


def test_devices_stops_the_adb_server_it_started(adb_port, capsys) -> None:
    assert main(["devices"]) == 0
    assert "adb devices (--device adb:SERIAL):" in capsys.readouterr().out
    assert _until(lambda: not _listening(adb_port))  # was left running


def test_devices_leaves_a_running_adb_server_running(adb_port, capsys) -> None:
    subprocess.run(["adb", "start-server"], capture_output=True, timeout=30, check=True)
    assert _listening(adb_port)
    assert main(["devices"]) == 0
    assert _listening(adb_port)
