"""`--layout-search traced`: choose every tensor's layout on the reads its kernels really make.

A tensor's layout does not change which elements a kernel reads, or in what order: kernels
address elements by their logical (row-major) index and map it through the texture's layout
only at the read, and their work decomposition depends on the shapes and the schedule, never on
a tensor's layout. So one traced run fixes the access streams for every candidate layout:

1. the step is compiled with `--layout-search flat` (same kernels, tiles and remapping; every
   texture flat, so a traced (x, y) is the logical texel y * width + x);
2. its kernels run one training step on the local OpenCL device with read tracing
   (fblc.runtime.trace.ReadTracer), and `sample` work-groups spread over each launch record,
   in issue order, the texels they read; each root tensor collects its streams from every
   kernel that reads it, forward and backward;
3. the step is compiled again with those streams: rtile_select replays them through each
   candidate layout and the target's texture-cache model, and each reading launch's missed
   blocks enter the target's time estimate (its arithmetic and other bytes from the flat
   bundle's report.json `estimate`): the least estimated time wins.

The streams come from running the kernels anywhere (they are a property of the kernels, not of
the device); only the cache model that scores them is the target's.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from fblc import bundle_format as fmt
from fblc.codegen.compile import compile_model
from fblc.compiler.reference import random_feeds
from fblc.passes.layout_score import TracedReads, TracedStream
from fblc.passes.pipeline import TrainingOptions
from fblc.profiles import load_profile
from fblc.profiles.cache_model import sampled_groups
from fblc.runtime.trace import ReadTracer


class LaunchCost(NamedTuple):
    """A launch of the traced (flat) bundle in its report.json `estimate`, on the target."""

    compute_ms: float  # FLOPs over the profile's peak
    memory_ms: float  # every texture it reads once and every one it writes, over bandwidth
    ms_per_byte: float


def launch_costs(report: Mapping[str, Any], target: str) -> dict[str, LaunchCost]:
    """The target's estimate of each launch of a compiled bundle (codegen.reports (estimate)), by kernel name."""
    profile = load_profile(target)
    per_byte = 1.0 / (profile.bandwidth_gbps * 1e6)
    return {k["kernel"]: LaunchCost(k["flops"] / (profile.peak_gflops * 1e6), k["bytes"] * per_byte, per_byte)
            for k in report["estimate"]["kernels"]}


def logical_reads(tracer: ReadTracer, sample: int = 2, costs: Mapping[str, LaunchCost] | None = None) -> TracedReads:
    """Per root tensor, the logical texels each sampled work-group of each launch read (issue order),
    weighted by launch groups / sampled groups x reads issued / reads recorded; with `costs` (by
    kernel name), each stream carries its launch's arithmetic time and its other bytes' time."""
    streams: dict[str, list[TracedStream]] = {}
    for index, launch in enumerate(tracer.plan["kernels"]):
        groups = tracer.groups(index)
        chosen = sampled_groups(groups, sample)
        cost = (costs or {}).get(launch["name"])
        for group in chosen:
            traced = tracer.reads(index, group)
            recorded = traced.textures.size
            if not recorded:
                continue
            weight = groups / len(chosen) * traced.issued / recorded
            for texture_id in np.unique(traced.textures).tolist():
                texture = tracer.textures[texture_id]
                if "layout" in texture:  # a mask (bytes, not texels): its layout is not searched
                    continue
                picked = traced.textures == texture_id
                texels = traced.ys[picked].astype(np.int64) * texture["width"] + traced.xs[picked]
                compute_ms = other_ms = 0.0
                if cost is not None:  # the launch's other bytes: all it moves, less this texture read once
                    own_ms = fmt.image_bytes(texture["format"], texture["width"], texture["height"]) * cost.ms_per_byte
                    compute_ms, other_ms = cost.compute_ms, max(0.0, cost.memory_ms - own_ms)
                streams.setdefault(texture["name"], []).append(
                    TracedStream(texels, weight, launch["name"], compute_ms, other_ms))
    return streams


def trace_reads(model_path: str, target: str, dtype: str, options: TrainingOptions,
                feeds: Mapping[str, np.ndarray] | None = None, sample: int = 2, device: str | None = None) -> TracedReads:
    """The access streams of the step's kernels (module docstring, steps 1-2), on `feeds` or a random batch."""
    with tempfile.TemporaryDirectory() as scratch:
        bundle = os.path.join(scratch, "flat")
        step, report = compile_model(model_path, bundle, target, dtype,
                                     dataclasses.replace(options, layout_search="flat", traced_reads=None))
        tracer = ReadTracer(bundle, device)
        tracer.step(feeds if feeds is not None else random_feeds(step))
        return logical_reads(tracer, sample, launch_costs(report, target))


def with_traced_reads(model_path: str, target: str, dtype: str, options: TrainingOptions,
                      feeds: Mapping[str, np.ndarray] | None = None, sample: int = 2,
                      device: str | None = None) -> TrainingOptions:
    """`options` ready to compile: under `--layout-search traced` (and rtile) with the traced reads
    (module docstring, steps 1-2); any other options as they are."""
    if options.layout != "rtile" or options.layout_search != "traced" or options.traced_reads is not None:
        return options
    return dataclasses.replace(options, traced_reads=trace_reads(model_path, target, dtype, options, feeds, sample,
                                                                 device))
