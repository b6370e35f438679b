"""The `estimate` object of report.json: each kernel's time on the target, from its profile alone.

An estimate, not a measurement: max(flops / peak, bytes / bandwidth) plus the launch overhead per kernel,
their sum per step. Reads count every texture once (a perfect texture cache) unless `fblc compile
--cache-report`'s simulated misses replace them; `benchmarks/estimate_check.py` compares the estimate's
ranking of kernels with per-kernel times measured on the local device.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import onnx_ir as ir

from fblc.codegen.plan import Program, kernel_groups
from fblc.compiler.flops import node_flops
from fblc.profiles import Profile
from fblc.profiles.profile import LAUNCH_OVERHEAD_US


def estimate_object(model: ir.Model, program: Program, profile: Profile,
                    cache: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """report.json's `estimate`, from the profile's peak, bandwidth and launch overhead."""
    # by the fuse pass's kernel id (k12): a group's kernels are named k12_Op, k12_Op_stats...
    group_flops = {g.name.split("_", 1)[0]: sum(node_flops(n) for n in g.nodes) for g in kernel_groups(model.graph)}
    misses = {k["kernel"]: k["misses"] for k in cache["kernels"]} if cache else {}
    block_texels = profile.tex_block_width * profile.tex_block_height
    kernels, total = [], 0.0
    for kernel in program.kernels:
        flops = group_flops.pop(kernel.name.split("_", 1)[0], 0)  # counted once, at the group's first kernel
        written = sum(program.textures[t].image_bytes for t in kernel.outputs)
        read = sum(program.textures[t].image_bytes for t in set(kernel.inputs))
        if kernel.name in misses:  # simulated misses of the traced kernel: whole blocks of 16-byte texels
            read = misses[kernel.name] * block_texels * 16
        compute_ms = flops / (profile.peak_gflops * 1e6)
        memory_ms = (read + written) / (profile.bandwidth_gbps * 1e6)
        work_ms, launch_ms = max(compute_ms, memory_ms), LAUNCH_OVERHEAD_US * 1e-3
        bound = "launch" if launch_ms > work_ms else "compute" if compute_ms >= memory_ms else "memory"
        kernels.append({"kernel": kernel.name, "family": kernel.family, "flops": flops, "bytes": read + written,
                        "ms": round(work_ms + launch_ms, 6), "bound": bound})
        total += work_ms + launch_ms
    return {"kind": "estimate from the target profile (peak_gflops, bandwidth_gbps, launch overhead), not measured",
            "profile": profile.name, "reads": "simulated cache misses" if misses else "each texture once",
            "step_ms": round(total, 4), "flops": sum(k["flops"] for k in kernels),
            "bytes": sum(k["bytes"] for k in kernels), "kernels": kernels}


def estimate_summary(estimate: Mapping[str, Any], top: int = 6) -> str:
    """The readable version `fblc compile --report` prints."""
    bounds = Counter(k["bound"] for k in estimate["kernels"])
    lines = [f"estimate for {estimate['profile']} (from its profile, not measured): {estimate['step_ms']:.3f} ms per "
             f"step, {estimate['flops'] / 1e9:.3f} GFLOP, {estimate['bytes'] / 1e6:.1f} MB moved; kernels bound by "
             + ", ".join(f"{kind} {count}" for kind, count in sorted(bounds.items()))]
    return "\n".join(lines + [f"  {k['kernel'][:32]:<32} {k['family']:<12} {k['ms']:9.4f} ms  {k['bound']}"
                              for k in sorted(estimate["kernels"], key=lambda k: -k["ms"])[:top]])
