"""TVM's tuned CPU build of a step: MetaSchedule's search over each fused kernel's schedules, its records
cached between runs, and the step built from the best one found per kernel.

A TVM user who ships a CPU step tunes it: the untuned LLVM build (tvm.py's "cpu" kind) leaves every
kernel as TVM's legalization wrote it (plain loops: no threads, no tiling, no vectors). Here the step
is tuned for the host CPU (its LLVM name and core count) with `trials` MetaSchedule trials per fused
kernel (task), the budget the caller states. Runs in tvm.py's child process only (it imports tvm).

The records live in `cache/<step digest>-<target>-<trials>t/` (MetaSchedule's JSON database, its
logs and `tuned.json`, what the tuning took); a folder is moved into place only once its tuning has
finished, so a record folder is whole or absent, and a second run of the same step, target and budget
tunes nothing.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time

from typing import TYPE_CHECKING

import onnx

if TYPE_CHECKING:  # the child process's imports: the parent never imports tvm
    import tvm
    from tvm.s_tir import meta_schedule as ms

TUNED_RECORD = "tuned.json"


def host_target() -> tvm.target.Target:
    """LLVM for this machine's CPU (MetaSchedule needs its core count to parallelize)."""
    import tvm
    from tvm.target import codegen

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return tvm.target.Target({"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu(), "num-cores": cores})


def records_folder(cache: str, model: onnx.ModelProto, target: tvm.target.Target, trials: int) -> str:
    """The cache folder of one step (its serialized graph's digest), target, TVM version and budget."""
    import tvm

    digest = hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest()[:16]
    host = f"{target.kind.name}-{target.attrs.get('mcpu', 'generic')}-{int(target.attrs['num-cores'])}cores"
    return os.path.join(cache, f"{digest}-{host}-tvm{tvm.__version__}-{trials}t")


def _in_process_builder() -> ms.builder.PyBuilder:
    """MetaSchedule's default build and export, in this process: its LocalBuilder starts a fresh
    process pool for every batch of candidates, and each worker imports tvm.s_tir.tensor_intrin
    (37 s on this 2-core machine), which would be most of a small budget's tuning time."""
    from tvm.s_tir.meta_schedule.builder import BuilderResult, PyBuilder
    from tvm.s_tir.meta_schedule.builder.local_builder import default_build, default_export
    from tvm.ir.utils import derived_object

    @derived_object
    class InProcessBuilder(PyBuilder):
        def build(self, build_inputs: list) -> list:
            results = []
            for item in build_inputs:
                try:
                    results.append(BuilderResult(default_export(default_build(item.mod, item.target, None)), None))
                except Exception as error:  # noqa: BLE001  (a candidate that fails to build is a failed trial)
                    results.append(BuilderResult(None, f"build failed: {error}"))
            return results

    return InProcessBuilder()


def tune(fused: tvm.IRModule, target: tvm.target.Target, folder: str, trials: int) -> dict:
    """`fused` (legalized and fused, as the CPU pipeline leaves it) tuned into `folder` unless it holds
    a finished tuning already; what the tuning took (tuned.json)."""
    from tvm.s_tir import meta_schedule as ms

    record = os.path.join(folder, TUNED_RECORD)
    if os.path.exists(record):
        with open(record) as handle:
            return {**json.load(handle), "cached": True}
    parent = os.path.dirname(folder)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".tuning-", dir=parent)
    try:
        started = time.perf_counter()
        tasks = ms.relax_integration.extract_tasks(fused, target)
        cores = int(target.attrs["num-cores"])
        contexts, weights = ms.relax_integration.extracted_tasks_to_tune_contexts(tasks, staging, num_threads=cores,
                                                                                   seed=0)
        # xgboost is not a dependency of apache-tvm: without it, candidates are ranked at random
        cost_model = "xgb" if importlib.util.find_spec("xgboost") else "random"
        ms.tune_tasks(tasks=contexts, task_weights=weights, work_dir=staging, max_trials_global=trials * len(contexts),
                      max_trials_per_task=trials, num_trials_per_iter=min(trials, 64), builder=_in_process_builder(),
                      cost_model=cost_model)
        done = {"tasks": len(contexts), "trials_per_task": trials, "tuning_s": time.perf_counter() - started,
                "cost_model": cost_model, "target": str(target)}
        with open(os.path.join(staging, TUNED_RECORD), "w") as handle:
            json.dump(done, handle)
        os.replace(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {**done, "cached": False}


def tuned_executable(module: tvm.IRModule, model: onnx.ModelProto, cache: str,
                     trials: int) -> tuple[tvm.relax.VMExecutable, dict]:
    """The step built for the host CPU with its tuned schedules (kernels without a record stay as
    the untuned build has them); what the tuning took."""
    import tvm
    from tvm.relax.backend.cpu_generic import pipeline as cpu
    from tvm.s_tir import meta_schedule as ms

    target = host_target()
    with target:
        fused = tvm.transform.Sequential(cpu.library_dispatch_passes(target) + cpu.legalize_passes(target))(module)
    folder = records_folder(cache, model, target, trials)
    done = tune(fused, target, folder, trials)
    database = ms.database.JSONDatabase(work_dir=folder)
    return ms.relax_integration.compile_relax(database, module, target, None), {**done, "records": folder}
