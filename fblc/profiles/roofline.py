"""A launch's time on the target from its profile's figures: the model of report.json's `estimate` and of
benchmarks/phone_kernels.py's kernel-IR estimate. An estimate, never a measurement.

A launch takes the longest of three times, plus the profile's `launch_us`:

- arithmetic: its issue slots (lane-instructions: an add, a multiply, a fused multiply-add, a min, each one
  slot a lane) at one a lane a clock, half ones `half_rate` times faster, at the share of the device's lanes
  its waves occupy (occupancy: a launch of fewer waves than the device runs at once leaves lanes idle). The
  lanes of a wave whose work-items returned early, or that its work-group leaves empty (a group of 8 work-items
  in a wave of 64), issue with it: the slots are scaled from the work-items that work to the waves' lanes.
  A transcendental (exp, rsqrt) counts one slot, though special-function units run them slower;
- texture fetches: the bytes of every texel fetched, whole (a fetch that uses one lane of an RGBA fp32 texel
  still moves its 16 bytes), at `texture_bytes_per_clock` from each compute unit its work-groups reach;
- DRAM: the bytes read from and written to memory, at `bandwidth_gbps`.

The clock is not a figure of its own: it is what `peak_gflops` gives for the device's fp32 lanes
(Profile.device_items, compute_units x waves_per_unit x wave_size), two flops a lane a clock.
What the model leaves out: latency hiding by resident waves, the tail of a launch whose waves do not divide
among the units, the register pressure that halves resident waves, caches between the texture L1 and DRAM, and
overlap of consecutive launches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LaunchWork:
    """What one launch does: `items` work-items that work, launched as `launched` in work-groups of `group`."""

    items: int
    launched: int
    group: int
    float_slots: float  # fp32 issue slots, lane-instructions (a float4 add is 4; a fused multiply-add 1 a lane)
    half_slots: float  # issue slots in half (at half_rate where the device has it)
    fetched_bytes: float  # whole texels fetched through the texture units
    dram_bytes: float  # read from and written to DRAM


@dataclass(frozen=True)
class LaunchTime:
    compute_ms: float
    fetch_ms: float
    dram_ms: float
    launch_ms: float
    lane_share: float  # of the device's lanes its waves occupy (at most 1)
    unit_share: float  # of the compute units its work-groups reach (at most 1)

    @property
    def ms(self) -> float:
        return max(self.compute_ms, self.fetch_ms, self.dram_ms) + self.launch_ms

    @property
    def bound(self) -> str:
        """What sets its time: launch, compute, fetch (texture units) or memory (DRAM)."""
        work = {"compute": self.compute_ms, "fetch": self.fetch_ms, "memory": self.dram_ms}
        slowest = max(work, key=lambda k: work[k])
        return "launch" if self.launch_ms > work[slowest] else slowest


def clock_hz(profile: Any) -> float:
    """The device's clock as its fp32 peak gives it: two flops (an FMA) a lane a clock."""
    return profile.peak_gflops * 1e9 / (2 * profile.device_items)


def work_groups(launched: int, group: int) -> int:
    """Work-groups of a launch of `launched` work-items in groups of `group` (at least one)."""
    return max(1, math.ceil(launched / max(1, group)))


def waves(profile: Any, launched: int, group: int) -> int:
    """Waves of a launch: each work-group takes whole waves (a group smaller than a wave fills one alone)."""
    return work_groups(launched, group) * math.ceil(max(1, group) / profile.wave_size)


def launch_time(profile: Any, work: LaunchWork) -> LaunchTime:
    """The launch's time on `profile`'s device (this module's docstring says how)."""
    wave_count = waves(profile, work.launched, work.group)
    lanes = wave_count * profile.wave_size  # lanes its waves hold, working or not
    lane_share = min(1.0, lanes / profile.device_items)
    issued = lanes / max(1, work.items)  # each working item's slots issue for its wave's idle lanes too
    half_rate = profile.half_rate if profile.fp16 else 1.0
    slots_per_ms = profile.device_items * clock_hz(profile) / 1e3 * lane_share
    compute_ms = issued * (work.float_slots + work.half_slots / half_rate) / slots_per_ms
    unit_share = min(1.0, work_groups(work.launched, work.group) / profile.compute_units)
    fetch_per_ms = profile.texture_bytes_per_clock * profile.compute_units * unit_share * clock_hz(profile) / 1e3
    return LaunchTime(compute_ms, work.fetched_bytes / fetch_per_ms, work.dram_bytes / (profile.bandwidth_gbps * 1e6),
                      profile.launch_us * 1e-3, lane_share, unit_share)
