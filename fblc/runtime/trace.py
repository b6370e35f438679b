"""Which texels a kernel's work-items read: the bundle's own kernels, built with -DFBLC_TRACE.

Every texel read in kernels.cl (image storage) places its coordinate through the preamble's NOTE.
Built with FBLC_TRACE it also records (argument, x, y) into a buffer, in each work-item's issue order,
up to CAPACITY reads per work-item (the count goes on): the texel's place in its layout, which the
texture cache sees, so the tracer holds its textures as images on any device. The tracer runs one work-group at a time
(a global offset and the launch's own work-group size from plan.json) on the local OpenCL device,
so the groups it records are the ones the schedule launches; call `step(feeds)`
first, so the textures hold what a training step reads (gathers read where the data says). The texture-cache model (fblc.profiles.cache_model) replays
the reads; fblc.tools.cache_report sums them per kernel.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from fblc import bundle_format as fmt
from fblc.runtime.local import LocalRunner

CAPACITY = 256  # reads recorded per work-item
TRACE_DEFINE = "-DFBLC_TRACE"
#: the work-group of a launch without a schedule (bundles from before plan.json recorded one)
UNSCHEDULED_GROUP = 64


def group_of(launch: dict[str, Any]) -> int:
    """Work-items per work-group of a plan.json launch."""
    return (launch.get("local_size") or [UNSCHEDULED_GROUP])[0]


@dataclass
class GroupReads:
    """One work-group's reads in issue order: every item's k-th read before any item's (k+1)-th."""

    textures: np.ndarray  # texture id of each read
    xs: np.ndarray
    ys: np.ndarray
    issued: int  # reads the work-items made, recorded or not


class ReadTracer(LocalRunner):
    """A LocalRunner whose kernels also record the texels they read."""

    def __init__(self, bundle: str, device: str | None = None) -> None:
        # the trace buffers are sized in the build options, so the plan is read before the runner
        # reads (and verifies) the whole bundle
        with open(os.path.join(bundle, fmt.PLAN), encoding="utf-8") as handle:
            group_size = max(group_of(launch) for launch in json.load(handle)["kernels"])
        # silent: it never steps, so the first-step report of its kernel build would never end
        super().__init__(bundle, device, build_options=(TRACE_DEFINE, f"-DFBLC_TRACE_CAPACITY={CAPACITY}",
                                                        f"-DFBLC_TRACE_ITEMS={group_size}"), progress=False,
                         storage="image")
        cl = self.cl
        self.group_size = group_size  # the largest work-group of the plan: the trace buffers hold one
        self._trace = cl.Buffer(self.context, cl.mem_flags.READ_WRITE, group_size * CAPACITY * 16)
        self._counts = cl.Buffer(self.context, cl.mem_flags.READ_WRITE, group_size * 4)
        self.extra_arguments = (self._trace, self._counts)  # TRACE_PARAM of every kernel

    def groups(self, kernel_index: int) -> int:
        launch = self.plan["kernels"][kernel_index]
        return -(-launch["global_size"][0] // group_of(launch))

    def reads(self, kernel_index: int, group: int) -> GroupReads:
        """The reads of work-group `group` of launch `kernel_index`."""
        spec = self.plan["kernels"][kernel_index]
        total, local = spec["global_size"][0], group_of(spec)
        offset = group * local
        size = min(local, total - offset)
        self.cl.enqueue_fill_buffer(self.queue, self._counts, np.int32(0), 0, self.group_size * 4)
        self.launch(kernel_index, offset, size)
        counts = np.empty(self.group_size, dtype=np.int32)
        records = np.empty((self.group_size, CAPACITY, 4), dtype=np.int32)
        self.cl.enqueue_copy(self.queue, counts, self._counts)
        self.cl.enqueue_copy(self.queue, records, self._trace)
        counts = counts[:size]
        recorded = np.minimum(counts, CAPACITY)
        ks, items = np.nonzero(np.arange(CAPACITY)[:, None] < recorded[None, :])  # k-major: the issue order
        picked = records[items, ks]
        inputs = np.asarray(spec["inputs"])
        return GroupReads(inputs[picked[:, 0]], picked[:, 1], picked[:, 2], int(counts.sum()))
