"""The pyopencl timing backend of `fblc profile`: run a measurement plan (profiler.py) on a device here.

It returns the raw results in the native runner's format (fblc/runtime/native/src/profile.c), launch for
launch the same work: the same source, image fill, argument values, local-size rule and best-of-repeats
timing from profiling events, so that profiler.interpret reads both alike.
"""

from __future__ import annotations

import math
import re
import time
from typing import Any

import numpy as np

from fblc.errors import FblcError
from fblc.profiles.profiler import (FORMAT_VERSION, REMEDY, RESULTS_FORMAT, Plan, Progress, Results, fill_texels,
                                    kernel_at_line, with_log)


def _log_line(log: str) -> int | None:
    """The line of the first "FILE.cl:LINE:COLUMN:" of a build log (what the runner's opencl_log_line reads)."""
    match = re.search(r"\.cl:(\d+):\d+:", log) or re.search(r":(\d+):\d+:", log)
    return int(match.group(1)) if match else None


def rejected_where(plan: Plan, log: str) -> str:
    """'kernel NAME (line N)' for a build log, as the native runner words it."""
    line = _log_line(log)
    name = kernel_at_line(plan, line) if line else None
    if name:
        return f"kernel '{name}' (line {line})"
    return f"source (line {line}, outside its kernels)" if line else "source (see the log)"


def measure_with_pyopencl(device: Any, plan: Plan, progress: Progress = lambda step: None) -> Results:
    """Run `plan` on a pyopencl device: the raw results, in the native runner's format."""
    import pyopencl as cl

    started = time.perf_counter()
    name = device.name.strip()
    context = cl.Context([device])
    queue = cl.CommandQueue(context, properties=cl.command_queue_properties.PROFILING_ENABLE)
    try:
        program = cl.Program(context, plan["source"]).build()
    except cl.RuntimeError as error:
        log = str(error).strip()
        raise FblcError(f"the OpenCL compiler of {name} rejected the benchmark {rejected_where(plan, log)}",
                        with_log(REMEDY, log)) from None
    build_ms = (time.perf_counter() - started) * 1e3
    kernels = {k["name"]: cl.Kernel(program, k["name"]) for k in plan["kernels"]}
    memory: dict[str, Any] = {}
    for image in plan["images"]:
        if (image["order"], image["type"], image["fill"]) != ("RGBA", "FLOAT", "uniform"):
            raise FblcError(f"the measurement plan's image '{image['name']}' is not RGBA FLOAT with the uniform fill",
                            "profile with the fblc that wrote the plan")
        memory[image["name"]] = cl.create_image(
            context, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR,
            cl.ImageFormat(cl.channel_order.RGBA, cl.channel_type.FLOAT), shape=(image["width"], image["height"]),
            hostbuf=fill_texels(image["width"], image["height"], image["seed"]))
    for buffer in plan["buffers"]:
        memory[buffer["name"]] = cl.Buffer(context, cl.mem_flags.WRITE_ONLY, size=buffer["bytes"])
    info = cl.kernel_work_group_info
    facts = {k: {"work_group_size": int(kernel.get_work_group_info(info.WORK_GROUP_SIZE, device)),
                 "preferred_work_group_size_multiple":
                     int(kernel.get_work_group_info(info.PREFERRED_WORK_GROUP_SIZE_MULTIPLE, device))}
             for k, kernel in kernels.items()}
    progress("kernels built")

    def argument(spec: dict[str, Any]) -> Any:
        return np.int32(spec["int"]) if "int" in spec else memory[spec.get("image", spec.get("buffer"))]

    def best_seconds(launch: dict[str, Any], local: list[int] | None) -> float:
        kernel = kernels[launch["kernel"]]
        try:
            kernel.set_args(*[argument(a) for a in launch["args"]])
            best = float("inf")
            for _ in range(launch["repeats"]):
                event = cl.enqueue_nd_range_kernel(queue, kernel, tuple(launch["global"]),
                                                   None if local is None else tuple(local))
                event.wait()
                best = min(best, (event.profile.end - event.profile.start) * 1e-9)
            return best
        except cl.Error as error:
            raise FblcError(f"{name} failed the benchmark launch '{launch['id']}': {error}", REMEDY) from None

    launches: list[dict[str, Any]] = []
    steps = plan["launches"]
    for index, launch in enumerate(steps):
        local = launch["local"]
        limit = min(int(device.max_work_group_size), facts[launch["kernel"]]["work_group_size"])
        if local and math.prod(local) > limit and launch["too_large"] == "skip":
            launches.append({"id": launch["id"], "skipped": f"local size {math.prod(local)} > {limit}, the most "
                                                            f"'{launch['kernel']}' takes"})
        else:  # too large for "driver": the driver picks the local size
            launches.append({"id": launch["id"],
                             "seconds": best_seconds(launch, None if local and math.prod(local) > limit else local)})
        if index + 1 == len(steps) or steps[index + 1]["step"] != launch["step"]:
            progress(launch["step"])
    return {"format": RESULTS_FORMAT, "version": FORMAT_VERSION, "backend": f"pyopencl {cl.VERSION_TEXT}",
            "device": device_facts(device), "kernels": facts, "build_ms": build_ms, "launches": launches,
            "seconds": time.perf_counter() - started}


def device_facts(device: Any) -> dict[str, Any]:
    """What clGetDeviceInfo says, under the names the native runner writes them."""
    import pyopencl as cl

    return {"name": device.name.strip(), "vendor": device.vendor.strip(), "version": device.version.strip(),
            "driver_version": device.driver_version.strip(), "platform": device.platform.name.strip(),
            "image2d_max_width": int(device.image2d_max_width), "image2d_max_height": int(device.image2d_max_height),
            "max_work_group_size": int(device.max_work_group_size),
            "global_mem_cache_size": int(device.global_mem_cache_size),
            "global_mem_cacheline_size": int(device.get_info(cl.device_info.GLOBAL_MEM_CACHELINE_SIZE)),
            "global_mem_size": int(device.global_mem_size), "local_mem_size": int(device.local_mem_size),
            "max_compute_units": int(device.max_compute_units),
            "max_clock_frequency": int(device.max_clock_frequency),
            "fp16": "cl_khr_fp16" in device.extensions.split(), "cpu": bool(device.type & cl.device_type.CPU),
            "simd_floats": int(device.native_vector_width_float),
            "subgroups": "cl_khr_subgroups" in device.extensions.split()}
