"""The first run of a bundle says on stderr that it builds the kernels; a run from the kernel cache says nothing."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest

from fblc.codegen.compile import compile_model
from fblc.compiler.optimizers import OptimizerConfig
from fblc.passes.pipeline import TrainingOptions
from fblc.runtime import build_progress
from fblc.runtime.build_progress import POCL_PLATFORM, BuildProgress
from fblc.runtime.local import LocalRunner
from fblc.runtime.opencl import select_device
from tests.support import models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a fresh process, so that PoCL reads this POCL_CACHE_DIR; stderr is a pipe, not a terminal
TWO_STEPS = """
import sys
import numpy as np
from fblc.runtime.local import LocalRunner
feeds = dict(np.load(sys.argv[2]))
runner = LocalRunner(sys.argv[1])
print(runner.step(feeds), runner.step(feeds))
"""


@pytest.fixture(scope="module")
def mlp_bundle(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """The MLP compiled for the local device, and an .npz of one batch."""
    folder = tmp_path_factory.mktemp("progress")
    exported = models.mlp(str(folder))
    bundle = str(folder / "mlp")
    compile_model(exported.path, bundle, "local", "fp32", TrainingOptions(
        loss="cross_entropy", optimizer=OptimizerConfig("adamw", lr=0.01)))
    feeds = str(folder / "batch.npz")
    np.savez(feeds, **exported.inputs, labels=exported.labels)
    return bundle, feeds


def two_steps(bundle: str, feeds: str, cache: str) -> tuple[str, str]:
    done = subprocess.run([sys.executable, "-c", TWO_STEPS, bundle, feeds], cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "POCL_CACHE_DIR": cache},
                          timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stdout, done.stderr


def test_the_first_run_says_what_it_builds_and_a_cached_run_says_nothing(tmp_path, mlp_bundle) -> None:
    bundle, feeds = mlp_bundle
    with open(os.path.join(bundle, "plan.json"), encoding="utf-8") as handle:
        kernels = len({k["function"] for k in json.load(handle)["kernels"]})
    device = select_device().name.strip()
    cache = str(tmp_path / "pocl-cache")
    os.mkdir(cache)
    losses, said = two_steps(bundle, feeds, cache)
    assert re.fullmatch(rf"building {kernels} distinct kernels for {re.escape(device)} \(first run; cached in "
                        rf"{re.escape(cache)}\)\n(  built \d+ of {kernels} \(\d+ s\)\n)*"  # a build past PROGRESS_EVERY_S
                        rf"built {kernels} distinct kernels in \d+\.\d s\n", said), said
    again, said = two_steps(bundle, feeds, cache)
    assert said == "" and again == losses


def test_progress_false_is_silent(mlp_bundle, capsys) -> None:
    bundle, feeds = mlp_bundle
    LocalRunner(bundle, progress=False).step(dict(np.load(feeds)))
    assert capsys.readouterr().err == ""


# --- the report's logic, on a kernel cache laid out as PoCL lays it out ---------------------------------------
def pocl_device() -> SimpleNamespace:
    return SimpleNamespace(name="pthread-test ", platform=SimpleNamespace(name=POCL_PLATFORM))


def program_folder(cache: str, compiled: list[str]) -> None:
    """A program just built: its last_accessed touched, a work-group function for each of `compiled`
    (and the generic one of a binary query, which launches do not use)."""
    folder = os.path.join(cache, "AB", "CDEFGH")
    os.makedirs(folder)
    open(os.path.join(folder, "last_accessed"), "w").close()
    for name in compiled:
        os.makedirs(os.path.join(folder, name, "64-1-1-goffs0-smallgrid"))
        open(os.path.join(folder, name, "64-1-1-goffs0-smallgrid", f"{name}.so"), "w").close()
    os.makedirs(os.path.join(folder, "k2_C", "0-0-0"))
    open(os.path.join(folder, "k2_C", "0-0-0", "k2_C.so"), "w").close()


def test_a_partly_cached_program_counts_only_the_kernels_left_to_build(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("POCL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("POCL_KERNEL_CACHE", raising=False)
    said: list[str] = []
    progress = BuildProgress(said.append, pocl_device(), ["k0_A", "k1_B", "k2_C"])
    progress.start()
    program_folder(str(tmp_path), ["k0_A"])
    progress.program_built()
    assert said == [f"building 2 of 3 distinct kernels for pthread-test (the others are cached in {tmp_path})"]
    progress.first_step_done()
    progress.first_step_done()  # once only
    assert len(said) == 2 and re.fullmatch(r"built 2 distinct kernels in \d+\.\d s", said[1])


def test_a_cached_program_says_nothing_and_a_disabled_cache_says_so(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("POCL_CACHE_DIR", str(tmp_path))
    said: list[str] = []
    progress = BuildProgress(said.append, pocl_device(), ["k0_A", "k1_B"])
    progress.start()
    program_folder(str(tmp_path), ["k0_A", "k1_B"])
    progress.program_built()
    progress.first_step_done()
    assert said == []
    monkeypatch.setenv("POCL_KERNEL_CACHE", "0")
    progress = BuildProgress(said.append, pocl_device(), ["k0_A", "k1_B"])
    progress.start()
    progress.program_built()
    assert said == ["building 2 distinct kernels for pthread-test (not cached: POCL_KERNEL_CACHE is off)"]


def test_a_slow_build_is_announced_while_it_runs_where_the_cache_cannot_be_read(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("POCL_CACHE_DIR", str(tmp_path / "not-a-pocl-layout"))
    monkeypatch.setattr(build_progress, "ANNOUNCE_AFTER_S", 0.05)
    said: list[str] = []
    progress = BuildProgress(said.append, pocl_device(), ["k0_A"])
    progress.start()
    deadline = time.time() + 10
    while not said and time.time() < deadline:  # clBuildProgram still running
        time.sleep(0.01)
    assert said == [f"building 1 kernel for pthread-test (first run; cached in {tmp_path / 'not-a-pocl-layout'})"]
    progress.program_built()
    progress.first_step_done()
    assert len(said) == 2 and said[1].startswith("built 1 kernel in ")
