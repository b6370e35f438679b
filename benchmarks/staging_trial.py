"""A trial, not a mechanism: what staging a conv's texels in __local saves in image storage on PoCL.

    python benchmarks/staging_trial.py [--kernel k8|k30] [--units N] [--trips N] [--bundle DIR] [--repeats 7]

Issue 39 asks for PoCL's image storage (software read_imagef: a proxy for a phone's fetch count) within 3x of
PyTorch eager; register tiles could not cut the reads enough (i39d-img). This script measures the other way the
issue names, work-group staging, on real launches before anyone builds it into the conv builder: a T-ResNet B=64
launch as fblc compiled it, against copies of the same kernel text in which, at each trip of the reduction's loop
(`--trips N`: every N-th trip, for N trips), a work-group first reads the texels that all its work-items read
in that trip into __local once, between two barriers, and every work-item then takes its texels from there
(TRIALS: `k8`, a forward conv with its BatchNorm/ReLU epilogue, groups of one batch element's 96 work-items;
`k30`, a weight gradient looping over the batch, groups of 32 work-items x `--units`). Nothing else changes (the
products, masks, clamps and the epilogue are the compiled kernel's), so the outputs must be bit-identical, which
the script checks.

It prints each variant's least CPU time over `--repeats` launches (process CPU time: PoCL's worker thread
included, so other processes on a shared machine do not inflate it) and the texel reads per launch. Variants:
compiled, staged (inputs and weights), weights only, inputs only, and staged without image reads (the __local
loads kept, the read_imagef calls replaced by constants: the floor that the rest of the kernel sets); and, for
reference, the same launch in buffer storage (kernels.buffer.cl).

The bundle is compiled here (`--bundle DIR` reuses one) by benchmarks/step_time.py's compile_bundle. The kernel's
source is rewritten as text: a change to the conv builder's output shape makes this script refuse, naming what it
did not find.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

@dataclass(frozen=True)
class Trial:
    """One compiled launch and how its staged copies are written: at the top of each trip of `loop` (a line of the
    kernel), a work-group of `unit` * units work-items reads the trip's `x_texels(units)` input texels and
    `w_texels(units)` weight texels into __local (`x_load`/`w_load`: the C of texel j's read), and every read that
    `x_read`/`w_read` match takes `xs[...]`/`ws[...]` instead (`x_at`/`w_at`: the local index, from the match)."""

    kernel: str
    items: int  # the launch's work-items
    unit: int  # work-items of the smallest group whose reads the staging covers
    loop: str
    var: str  # the loop's variable, and its step
    step: int
    trips: int  # of `loop`
    x_reads: int  # texel reads per work-item and trip as compiled: input, weights
    w_reads: int
    x_texels: Callable[[int], int]
    w_texels: Callable[[int], int]
    x_load: str
    w_load: str
    x_read: re.Pattern[str]
    w_read: re.Pattern[str]
    x_at: Callable[[re.Match[str]], str]
    w_at: Callable[[re.Match[str]], str]
    positive: int = -1  # an input that must be positive (a BatchNorm variance), or -1

    @property
    def guard(self) -> str:
        return f"  if (g >= {self.items}) {{\n    return;\n  }}\n"


def _offset(match: re.Match[str], sign: int = 1, number: int = 2) -> int:
    """The literal `+ k` / `- k` of a texel read's index (0 where there is none)."""
    return (-1 if match.group(sign) == "-" else 1) * int(match.group(number) or 0)


_X8 = re.compile(r"read_imagef\(in0, SMP, NOTE\(0, TEXEL_P2\((?:clamp\()?\(?q110(?: ([+-]) (\d+))?\)?"
                 r"(?:, 0, 122879\))?, 13\)\)\)")
_W8 = re.compile(r"read_imagef\(in1, SMP, NOTE\(1, TEXEL_P2\(\(?q139(?: ([+]) (\d+))?\)?, 13\)\)\)")
_X30 = re.compile(r"read_imagef\(in0, SMP, NOTE\(0, TEXEL_P2\((?:clamp\()?\(?(q112|q142)(?: ([+-]) (\d+))?\)?"
                  r"(?:, 0, 122879\))?, 13\)\)\)")
_W30 = re.compile(r"read_imagef\(in1, SMP, NOTE\(1, TEXEL_P2\(\(?(q125|q151)(?: ([+]) (\d+))?\)?, 13\)\)\)")

TRIALS = {
    # blocks.2.conv1 (forward, BatchNorm/ReLU epilogue): 6144 work-items of 4 output channels x 20 positions, 32
    # blocks of 4 input channels. A unit is one batch element's 96 work-items (32 channel tiles x 3 position
    # tiles); a block's texels: 62 of each element's input (60 positions x 4 channels, and the halo) and 1024 of
    # the weights (128 output channels x 4 input channels x 8 taps). Texel q110 + k is the element's (u2 >> 2) + k
    # + 1; q139 + 256 r + t is weight row u1 + r's texel t.
    "k8": Trial("k8_Conv", 6144, 96, "for (int blk101 = 0; blk101 < 128; blk101 += 4) {", "blk101", 4, 32, 28, 32,
                lambda units: 62 * units, lambda units: 1024,
                "read_imagef(in0, SMP, TEXEL_P2(clamp(((((first + j / 62) * 7680) + (blk101 * 60)) >> 2) - 1 "
                "+ j % 62, 0, 122879), 13))",
                "read_imagef(in1, SMP, TEXEL_P2(blk101 * 2 + (j >> 3) * 256 + (j & 7), 13))", _X8, _W8,
                lambda m: f"xs[(u0 - first) * 62 + (u2 >> 2) + {_offset(m) + 1}]",
                lambda m: f"ws[(u1 + {_offset(m) // 256}) * 8 + {_offset(m) % 256}]", positive=6),
    # grad/blocks.2.conv2 (a weight gradient, [128 x, 128 dY, 5 taps]): 2048 work-items of 2 input channels x 4
    # dY channels x 5 taps, a loop over the 64 batch elements (c106) around blocks of dY positions. A unit is 32
    # work-items (2 input channels, all 128 dY channels); a batch element's texels: 15 per channel row of x (60
    # positions) for the unit's rows, with the halo, and all 1920 of dY's. Texel q112 + k (q142: the rest after
    # the block loop) is x's (u0 - 2 first) * 15 + blk / 4 + k + 1; q125 + k (q151) is dY's u1 * 15 + blk / 4 + k.
    "k30": Trial("k30_Conv", 2048, 32, "for (int c106 = 0; c106 < 64; ++c106) {", "c106", 1, 64, 3 * 12 + 8,
                 3 * 16 + 12,
                 lambda units: 30 * units + 2, lambda units: 1920,
                 "read_imagef(in0, SMP, TEXEL_P2(clamp(first * 30 + c106 * 1920 - 1 + j, 0, 122879), 13))",
                 "read_imagef(in1, SMP, TEXEL_P2(c106 * 1920 + j, 13))", _X30, _W30,
                 lambda m: f"xs[(u0 - 2 * first) * 15 + {'(blk108 >> 2) + ' if m.group(1) == 'q112' else ''}"
                           f"{_offset(m, 2, 3) + 1}]",
                 lambda m: f"ws[u1 * 15 + {'(blk108 >> 2) + ' if m.group(1) == 'q125' else ''}{_offset(m, 2, 3)}]"),
}


def refuse(trial: Trial, what: str) -> SystemExit:
    return SystemExit(f"staging_trial: {trial.kernel} of this tree's T-ResNet bundle has no {what}; the conv "
                      "builder's output changed since the trial was written (update its Trial)")


def staged_source(trial: Trial, kernel: str, units: int, stage_x: bool, stage_w: bool, reads: bool = True,
                  trips: int = 1) -> str:
    """`kernel` (the trial's compiled text) with the chosen operands staged by groups of `units` units, `trips`
    trips of the loop at a time (one pair of barriers for them: the accumulators cross fewer barriers)."""
    group = trial.unit * units
    for needed in (trial.loop, trial.guard):
        if needed not in kernel:
            raise refuse(trial, f"line '{needed.strip()}'")
    name = f"{trial.kernel}_staged_{int(stage_x)}{int(stage_w)}{int(reads)}_{units}_{trips}"
    x_size, w_size = trial.x_texels(units), trial.w_texels(units)
    text = kernel.replace(f"__kernel void {trial.kernel}(",
                          f"__kernel __attribute__((reqd_work_group_size({group}, 1, 1))) void {name}(")
    # every work-item reaches the barriers: the launch is whole groups, so no work-item is past the end
    text = text.replace(trial.guard, f"  const int lid = get_local_id(0);\n  const int first = get_group_id(0) * "
                        f"{units};\n" + (f"  __local float4 xs[{x_size * trips}];\n" if stage_x else "")
                        + (f"  __local float4 ws[{w_size * trips}];\n" if stage_w else ""))
    ahead = f"({trial.var} + t * {trial.step})"  # trip t of those staged together
    loads = ((f"      for (int j = lid; j < {x_size}; j += {group}) xs[t * {x_size} + j] = "
              f"{trial.x_load.replace(trial.var, ahead) if reads else '(float4)(j)'};\n" if stage_x else "")
             + (f"      for (int j = lid; j < {w_size}; j += {group}) ws[t * {w_size} + j] = "
                f"{trial.w_load.replace(trial.var, ahead) if reads else '(float4)(j)'};\n" if stage_w else ""))
    slot = f"(({trial.var} / {trial.step}) % {trips})"  # this trip's place among those staged together
    text = text.replace(trial.loop, trial.loop + f"\n    if ({slot} == 0) {{\n    barrier(CLK_LOCAL_MEM_FENCE);\n"
                        f"    for (int t = 0; t < {trips}; ++t) {{\n" + loads + "    }\n"
                        "    barrier(CLK_LOCAL_MEM_FENCE);\n    }")
    for staged, pattern, at, what in ((stage_x, trial.x_read, trial.x_at, "input"),
                                      (stage_w, trial.w_read, trial.w_at, "weight")):
        if staged:
            if not pattern.search(text):
                raise refuse(trial, f"{what} read of the expected form")
            size = x_size if pattern is trial.x_read else w_size
            text = pattern.sub(lambda m: at(m).replace("s[", f"s[{slot} * {size} + ", 1), text)
    return text


def build_bundle(directory: str) -> str:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import step_time

    (_, _, inputs, _, _), = step_time.build_cases(directory, ["tresnet"])
    bundle = os.path.join(directory, "tresnet.bundle")
    step_time.compile_bundle(inputs["path"], bundle)
    return bundle


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", help="a T-ResNet B=64 bundle of this tree (default: compiled here)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--kernel", choices=sorted(TRIALS), default="k8", help="the launch (TRIALS)")
    parser.add_argument("--units", type=int, default=1, help="units per work-group (k8: 96 work-items, one batch "
                        "element; k30: 32 work-items, two input channels)")
    parser.add_argument("--trips", type=int, default=1, help="trips of the loop staged at once (a divisor of its "
                        "trips)")
    parser.add_argument("--items", type=int, help="launch only the first ITEMS work-items (whole groups of every "
                        "variant; the rest of each output stays zero): a run under `oclgrind --data-races "
                        "--local-mem-size 1048576` (with --opt-disable; oclgrind sets aside every kernel's __local "
                        "arrays for each launch) finishes in minutes")
    parser.add_argument("--opt-disable", action="store_true", help="build with -cl-opt-disable (oclgrind)")
    args = parser.parse_args()
    trial = TRIALS[args.kernel]
    items = args.items or trial.items
    os.environ.setdefault("POCL_MAX_PTHREAD_COUNT", "1")  # one worker: CPU time is then one core's work
    import pyopencl as cl

    with tempfile.TemporaryDirectory() as directory:
        bundle = args.bundle or build_bundle(directory)
        with open(os.path.join(bundle, "plan.json")) as handle:
            plan = json.load(handle)
        with open(os.path.join(bundle, "kernels.cl")) as handle:
            lines = handle.read().split("\n")
        with open(os.path.join(bundle, "kernels.buffer.cl")) as handle:
            buffer_lines = handle.read().split("\n")
    spec = next((k for k in plan["kernels"] if k["function"] == trial.kernel), None)
    if spec is None:
        raise refuse(trial, "launch")
    first_kernel = next(i for i, line in enumerate(lines) if line.startswith("__kernel"))
    preamble = "\n".join(lines[:first_kernel - 1])
    kernel = "\n".join(lines[spec["lines"][0] - 1:spec["lines"][1]])
    group = trial.unit * args.units
    variants = {"compiled": (trial.kernel, spec["local_size"][0], (trial.x_reads + trial.w_reads) * items)}
    sources = [kernel]
    if items % group or items % spec["local_size"][0] or items > trial.items:
        raise SystemExit(f"--items {items}: whole groups of {group} and of {spec['local_size'][0]} work-items, "
                         f"at most {trial.items}")
    for label, x, w, reads in (("staged", True, True, True), ("weights only", False, True, True),
                               ("inputs only", True, False, True), ("staged, no reads", True, True, False)):
        text = staged_source(trial, kernel, args.units, x, w, reads, args.trips)
        sources.append(text)
        per_trip = ((trial.x_texels(args.units) if x else trial.x_reads * group)
                    + (trial.w_texels(args.units) if w else trial.w_reads * group)) if reads else 0
        name = re.search(r"void (\w+)\(", text).group(1)  # type: ignore[union-attr]
        variants[label] = (name, group, per_trip * (items // group))
    context = cl.create_some_context(False)
    queue = cl.CommandQueue(context)
    options = ["-cl-opt-disable"] if args.opt_disable else []
    program = cl.Program(context, preamble + "\n".join(sources)).build(options=options)
    buffer_first = next(i for i, line in enumerate(buffer_lines) if line.startswith("__kernel"))
    buffer_program = cl.Program(context, "\n".join(buffer_lines[:buffer_first - 1] + buffer_lines[
        spec["buffer_lines"][0] - 1:spec["buffer_lines"][1]])).build(options=options)
    rng = np.random.default_rng(0)
    formats = {"rgba_f32": (cl.channel_order.RGBA, cl.channel_type.FLOAT, 4, np.float32),
               "r_mask8": (cl.channel_order.R, cl.channel_type.UNSIGNED_INT8, 1, np.uint8)}

    def image(texture_id: int, data: np.ndarray | None = None) -> cl.Image:
        texture = plan["textures"][texture_id]
        order, kind, channels, dtype = formats[texture["format"]]
        if data is None:  # an output: zeros where a shortened launch (--items) writes nothing
            data = np.zeros((texture["height"], texture["width"], channels), dtype)
        flags = cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR
        return cl.create_image(context, flags, cl.ImageFormat(order, kind), (texture["width"], texture["height"]),
                               hostbuf=data)

    inputs, buffers = [], []
    for index, texture_id in enumerate(spec["inputs"]):
        texture = plan["textures"][texture_id]
        data = rng.standard_normal((texture["height"], texture["width"], 4)).astype(np.float32)
        data = np.abs(data) + 1.0 if index == trial.positive else data
        inputs.append(image(texture_id, data))
        buffers.append(cl.Buffer(context, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR, hostbuf=data))
    # the same launch in buffer storage (kernels.buffer.cl, LocalRunner's storage "buffer"): what image storage is
    # measured against; its texels in index order, so its outputs are not compared with the images'
    buffer_outputs = [cl.Buffer(context, cl.mem_flags.READ_WRITE, plan["textures"][t]["width"]
                                * plan["textures"][t]["height"] * (16 if plan["textures"][t]["format"] == "rgba_f32"
                                                                   else 1) + 16) for t in spec["outputs"]]
    outputs = {label: [image(t) for t in spec["outputs"]] for label in variants}
    kernels = {label: getattr(program, name) for label, (name, _, _) in variants.items()}
    for label, kernel_object in kernels.items():
        kernel_object.set_args(*outputs[label], *inputs)
    kernels["buffer storage"] = getattr(buffer_program, trial.kernel)
    kernels["buffer storage"].set_args(*buffer_outputs, *buffers)
    variants["buffer storage"] = (trial.kernel, spec["local_size"][0], -1)  # -1: no texel reads of an image
    best = {label: float("inf") for label in variants}
    for round_ in range(args.repeats + 1):  # round 0 warms PoCL's per-launch compile (timed only alone)
        for label, (_, local, _) in variants.items():
            started = time.process_time()
            try:
                cl.enqueue_nd_range_kernel(queue, kernels[label], (items,), (local,)).wait()
            except cl.Error as error:
                raise SystemExit(f"staging_trial: the {label} launch of {trial.kernel} in groups of {local} failed "
                                 f"on {queue.device.name.strip()}: {error}") from None
            if round_ or not args.repeats:
                best[label] = min(best[label], (time.process_time() - started) * 1e3)

    def read_back(label: str) -> list[np.ndarray]:
        arrays = []
        for texture_id, output in zip(spec["outputs"], outputs[label]):
            texture = plan["textures"][texture_id]
            _, _, channels, dtype = formats[texture["format"]]
            array = np.empty((texture["height"], texture["width"], channels), dtype)
            cl.enqueue_copy(queue, array, output, origin=(0, 0), region=(texture["width"], texture["height"]))
            arrays.append(array)
        return arrays

    reference = read_back("compiled")
    print(f"{trial.kernel} (T-ResNet B=64, image storage, {items} work-items, "
          f"{os.environ['POCL_MAX_PTHREAD_COUNT']} thread), least CPU ms of {args.repeats}; groups of "
          f"{group} work-items for the staged variants")
    print(f"{'variant':<18} {'CPU ms':>8} {'vs compiled':>11} {'texel reads':>12}  outputs")
    for label, (_, _, reads) in variants.items():
        same = "" if label in ("compiled", "buffer storage") else (
            "bit-identical" if all(np.array_equal(a, b) for a, b in zip(reference, read_back(label)))
            else "differ" if "no reads" not in label else "(not compared)")
        count = "-" if reads < 0 else str(reads * trial.trips)
        print(f"{label:<18} {best[label]:8.1f} {best[label] / best['compiled']:11.2f} {count:>12}  {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
