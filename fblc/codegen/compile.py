"""`fblc compile`: model -> training step -> fused kernels -> bundle."""

from __future__ import annotations

import dataclasses
import gc
import os
import tempfile
import time
from typing import Any, Callable, Mapping

import onnx_ir as ir


from fblc.codegen.bundle import build_documents, write_bundle
from fblc.codegen.collector import collector_paused
from fblc.codegen.export_record import adapter_fingerprint, export_record
from fblc.bundle_format import FLOAT_FORMATS
from fblc.choices import FORWARD
from fblc.codegen.plan import BufferTable, Program, buffer_table, lower, step_schedules
from fblc.codegen.reports import TIMELINE_PLOT, as_allocated, estimate_object, layout_object, memory_report
from fblc.codegen.schedule import load_overrides
from fblc.codegen.weight_report import weights_report
from fblc.errors import FblcError
from fblc.compiler.model_io import load_model
from fblc.compiler.summary import adapter_report, trained_set_source, trained_tensors
from fblc.compiler.torch_names import manifest_fields
from fblc.passes.memory_plan import MemoryPlan, MemoryPlanPass, OverBudgetError, check_budget
from fblc.passes.pipeline import PassHook, TrainingOptions, build_training_graph
from fblc.passes.quantize_weights import reused_quantization
from fblc.profiles import PORTABLE_IMAGE_EDGE, Profile, load_profile


#: a report.json object computed from a scratch copy of the bundle and the step, before the bundle is written
ReportAnnex = Callable[[str, ir.Model], Any]


def launches_per_step(program: Program) -> int:
    """The launches a step enqueues: the plan's, its loops' bodies as often as they repeat."""
    return sum(program.repetitions(index) for index in range(len(program.kernels)))


def build_report(model: ir.Model, program: Program, table: BufferTable, seconds: float) -> dict[str, Any]:
    beyond = [{"name": t.name, "width": t.width, "height": t.height} for t in program.textures
              if max(t.width, t.height) > PORTABLE_IMAGE_EDGE]
    return {"compile_seconds": round(seconds, 3), "step_nodes": len(model.graph),
            "kernels": len(program.kernels), "launches_per_step": launches_per_step(program),
            "distinct_kernels": len({k.function for k in program.kernels}),
            "kernels_per_family": program.family_counts(),
            "textures": len(program.textures), "texture_bytes": table.texture_bytes,
            "initial_bytes": sum(contents.nbytes for contents in program.initial.values()),
            "portable_image_edge": PORTABLE_IMAGE_EDGE, "beyond_portable_edge": beyond}


#: builds of the step under --device-memory: the first, then retries that recompute more layers while the
#: lowered plan is over the budget and layers are left
RECOMPUTE_ATTEMPTS = 4


def build_program(model_path: str, options: TrainingOptions, profile: Profile, overrides: Mapping[str, dict[str, Any]],
                  dump_dir: str | None = None, on_pass: PassHook | None = None,
                  marks: list[tuple[str, float, float]] | None = None, co_launched_kernels: bool = True
                  ) -> tuple[ir.Model, Program, BufferTable, MemoryPlan]:
    """The step graph, its kernels, its buffer table and its memory plan (what fblc compile writes, nothing
    packed or written), holding --device-memory: where the bundle keeps more live than pass recompute's
    estimate (node order, every value its own buffer) and recomputable layers are left, it is built again
    from the model as read with recompute aiming lower by the overshoot. `marks` gets the stages' (name,
    wall, CPU) ends; a failed attempt's time lands in the next one's `passes`."""
    plans: list[MemoryPlan] = []

    def observe(index: int, graph_pass: ir.passes.PassBase, model: ir.Model) -> None:
        if isinstance(graph_pass, MemoryPlanPass) and graph_pass.plan is not None:
            plans.append(graph_pass.plan)  # the step's one memory plan, which report.json shows too
        if on_pass is not None:
            on_pass(index, graph_pass, model)

    def attempt(model: ir.Model, options: TrainingOptions) -> tuple[ir.Model, Program, BufferTable]:
        step = build_training_graph(model, options, dump_dir=dump_dir, on_pass=observe, lower=profile,
                                    schedules=step_schedules(profile, options.dtype, overrides))
        stages.append(("passes", time.perf_counter(), time.process_time()))
        program = lower(step, profile, options.dtype, overrides=overrides, co_launched_kernels=co_launched_kernels)
        stages.append(("codegen", time.perf_counter(), time.process_time()))
        table = buffer_table(step, program, profile)
        stages.append(("buffer_table", time.perf_counter(), time.process_time()))
        if options.device_memory > 0:  # raising, the attempt's graph and kernels go (a 1B step holds GBs)
            check_budget(as_allocated(plans[-1], table), options.device_memory, table.allocated_bytes,
                         forward=options.trainer == FORWARD)
        return step, program, table

    model: ir.Model | None = load_model(model_path)
    stages = [("read_model", time.perf_counter(), time.process_time())]
    with reused_quantization():  # a retry quantizes nothing again
        for tries in range(RECOMPUTE_ATTEMPTS):
            try:
                step, program, table = attempt(model if model is not None else load_model(model_path), options)
                break
            except OverBudgetError as over:
                target = (options.recompute_target or options.device_memory) - (over.peak - over.budget)
                if not over.layers_left or tries == RECOMPUTE_ATTEMPTS - 1 or target <= 0:
                    raise
                options = dataclasses.replace(options, recompute_target=target)
            del stages[1:]  # the failed attempt's time lands in the next one's `passes`
            plans.clear()
            model = None  # the failed attempt's graph (passes rewrite it in place) goes before the model is read again
            gc.collect()  # it is full of cycles (nodes <-> values) and compile_model pauses the cyclic collector
    if marks is not None:
        marks += stages
    return step, program, table, plans[-1]


@collector_paused
def compile_model(model_path: str, out_dir: str, target: str, dtype: str, options: TrainingOptions,
                  dump_dir: str | None = None, on_pass: PassHook | None = None,
                  annexes: Mapping[str, ReportAnnex] | None = None, schedules: str | None = None,
                  co_launched_kernels: bool = True) -> tuple[ir.Model, dict[str, Any]]:
    """Compile `model_path` into the bundle `out_dir`; returns the fused step graph and the report.

    `schedules`: a schedule file (codegen/schedule.py: kernel name -> fields) over the kernels' own
    schedules and the target profile's `schedules` section; plan.json records every kernel's.

    `co_launched_kernels=False`: every kernel its own launch (codegen/co_launch.py), as fblc tune measures them.

    `annexes`: more report.json objects by key, each computed from a scratch copy of the finished
    bundle (e.g. `fblc compile --cache-report`'s simulated texture-cache figures, which run the
    kernels: fblc.tools.cache_report.cache_annex). The bundle itself is written once, complete."""
    if dtype not in FLOAT_FORMATS:
        raise FblcError(f"unknown --dtype '{dtype}'", f"choose one of: {', '.join(FLOAT_FORMATS)}")
    profile = load_profile(target)  # --dtype fp16 on any target: half textures are core OpenCL (CL_HALF_FLOAT);
    # the profile's `fp16` (cl_khr_fp16) decides only whether kernels also compute in half (codegen/ir/precision.py)
    started = time.perf_counter()
    options = dataclasses.replace(options, dtype=dtype)
    overrides = load_overrides(schedules, profile)
    marks = [("start", started, time.process_time())]  # wall and CPU seconds (the process's, both threads)
    step, program, table, plan = build_program(model_path, options, profile, overrides, dump_dir, on_pass, marks,
                                               co_launched_kernels)
    report = build_report(step, program, table, time.perf_counter() - started)
    report["memory"], timeline = memory_report(plan, table)
    report["layout"] = layout_object(step, program, options)
    report["trained"] = {"chosen_by": trained_set_source(step.graph),
                         "tensors": [{"name": v.name, **manifest_fields(v), "shape": list(v.shape)}
                                     for v in trained_tensors(step.graph)]}
    # how the step trains, for a reader that replays its updates (fleet ES rounds that send seeds: fblc.fleet.es_seeds)
    report["training"] = {"trainer": options.trainer, "optimizer": dataclasses.asdict(options.optimizer),
                          **({"es": dataclasses.asdict(options.es)} if options.trainer == "es" else {})}
    report["weights"] = weights_report(step, program, report["memory"], options.weights.weights,
                                       options.weights.group)
    adapter = adapter_report(step)
    if adapter is not None:
        report["adapter"] = adapter
    manifest, plan, params, buffer_file = build_documents(step, program, table, profile, dtype, report)
    manifest["export"], factors = export_record(model_path, step)  # what `fblc export` reads back
    fingerprint = adapter_fingerprint(manifest["export"]["source"], step)  # what a specialist is checked against
    if fingerprint is not None:
        manifest["fingerprint"] = fingerprint
    buffer_file.update(factors)
    if annexes:
        with tempfile.TemporaryDirectory() as scratch:
            draft = os.path.join(scratch, "bundle")
            write_bundle(draft, manifest, plan, program.source, params, report, extra=buffer_file)
            for key, annex in annexes.items():
                report[key] = annex(draft, step)
    report["estimate"] = estimate_object(step, program, profile, report.get("cache"))
    marks.append(("reports", time.perf_counter(), time.process_time()))
    report["timings"] = {name: round(end - begin, 3) for (_, begin, _), (name, end, _) in zip(marks, marks[1:])}
    # CPU seconds of the same stages (params.bin's: timings' write_params_cpu): on a loaded machine the wall
    # clock says more about the other processes than about the compiler
    report["timings_cpu"] = {name: round(end - begin, 3) for (_, _, begin), (name, _, end) in zip(marks, marks[1:])}
    write_bundle(out_dir, manifest, plan, program.source, params, report,  # adds timings' WRITE_PARAMS
                 extra={**buffer_file, TIMELINE_PLOT: timeline})
    return step, report
