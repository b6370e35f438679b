"""The `estimate` object of report.json: each kernel's time on the target, from its profile alone.

An estimate, not a measurement (report.json says so). Per kernel:
- flops: the arithmetic of the nodes it computes (fblc.compiler.flops; a fused group that emits
  several kernels counts at its first);
- bytes: every texture it reads, once, and every texture it writes, in their real formats and
  padded image sizes (a perfect texture cache: `fblc compile --cache-report`'s simulated misses
  then replace the reads, block by block, where they exist);
- ms = max(flops / peak_gflops, bytes / bandwidth_gbps) + the profile's launch overhead, and
  `bound` says which term decided.
The step is the kernels' sum (they run one after another). `benchmarks/estimate_check.py`
compares the estimate's ranking of kernels with per-kernel times measured on the local device.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import onnx_ir as ir

from fblc import bundle_format as fmt
from fblc.codegen.plan import Program
from fblc.compiler import keys
from fblc.compiler.flops import node_flops
from fblc.profiles import Profile
from fblc.profiles.profile import LAUNCH_OVERHEAD_US


def estimate_object(model: ir.Model, program: Program, profile: Profile,
                    cache: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """report.json's `estimate`, from the profile's peak, bandwidth and launch overhead."""
    members: dict[str, list[ir.Node]] = {}  # the fuse pass's kernel id (k12) -> its nodes
    for node in model.graph:
        if keys.KERNEL in node.metadata_props:
            members.setdefault(node.metadata_props[keys.KERNEL], []).append(node)
    textures = {t.id: t for t in program.textures}
    misses = {k["kernel"]: k["misses"] for k in cache["kernels"]} if cache else {}
    block_texels = profile.tex_block_width * profile.tex_block_height

    def image(texture_id: int) -> int:
        texture = textures[texture_id]
        return fmt.image_bytes(texture.format, texture.width, texture.height)

    kernels, total = [], 0.0
    for kernel in program.kernels:
        group = kernel.name.split("_", 1)[0]  # a group's kernels are named k12_Op, k12_Op_stats...
        flops = sum(node_flops(n) for n in members.pop(group, []))  # counted once, at the group's first kernel
        written = sum(image(t) for t in kernel.outputs)
        read = sum(image(t) for t in set(kernel.inputs))
        if kernel.name in misses:  # simulated misses of the traced kernel: whole blocks of 16-byte texels
            read = misses[kernel.name] * block_texels * 16
        compute_ms = flops / (profile.peak_gflops * 1e6)
        memory_ms = (read + written) / (profile.bandwidth_gbps * 1e6)
        work_ms, launch_ms = max(compute_ms, memory_ms), LAUNCH_OVERHEAD_US * 1e-3
        ms = work_ms + launch_ms
        bound = "launch" if launch_ms > work_ms else "compute" if compute_ms >= memory_ms else "memory"
        kernels.append({"kernel": kernel.name, "family": kernel.family, "flops": flops, "bytes": read + written,
                        "ms": round(ms, 6), "bound": bound})
        total += ms
    return {"kind": "estimate from the target profile (peak_gflops, bandwidth_gbps, launch overhead), not measured",
            "profile": profile.name, "reads": "simulated cache misses" if misses else "each texture once",
            "step_ms": round(total, 4), "flops": sum(k["flops"] for k in kernels),
            "bytes": sum(k["bytes"] for k in kernels), "kernels": kernels}


def estimate_summary(estimate: Mapping[str, Any], top: int = 6) -> str:
    """The readable version `fblc compile --report` prints."""
    bounds: dict[str, int] = {}
    for k in estimate["kernels"]:
        bounds[k["bound"]] = bounds.get(k["bound"], 0) + 1
    lines = [f"estimate for {estimate['profile']} (from its profile, not measured): {estimate['step_ms']:.3f} ms per "
             f"step, {estimate['flops'] / 1e9:.3f} GFLOP, {estimate['bytes'] / 1e6:.1f} MB moved; kernels bound by "
             + ", ".join(f"{kind} {count}" for kind, count in sorted(bounds.items()))]
    for k in sorted(estimate["kernels"], key=lambda k: -k["ms"])[:top]:
        lines.append(f"  {k['kernel'][:32]:<32} {k['family']:<12} {k['ms']:9.4f} ms  {k['bound']}")
    return "\n".join(lines)
