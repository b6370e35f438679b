"""A trial, not a mechanism: what staging a conv's texels in __local saves in image storage on PoCL.

    python benchmarks/staging_trial.py [--bundle DIR] [--repeats 7]

Issue 39 asks for PoCL's image storage (software read_imagef: a proxy for a phone's fetch count) within 3x of
PyTorch eager; register tiles could not cut the reads enough (i39d-img). This script measures the other way the
issue names, work-group staging, on one real launch before anyone builds it into the conv builder: T-ResNet B=64's
`k8_Conv` (blocks.2.conv1 with its BatchNorm/ReLU epilogue, 6144 work-items of a 4-channel x 20-position tile,
32 blocks of 4 input channels) as fblc compiled it, against a copy of the same kernel text in which, at each
block, a work-group of 96 work-items (the 32 channel tiles x 3 position tiles of one batch element; `--batches N`:
N elements) first reads the block's input texels (62 per element: 60 positions x 4 channels and the halo) and
weight texels (1024: 128 output channels x 4 channels x 8 taps) into __local once, between two barriers, and every
work-item then takes its 28 + 32 texels from there. Nothing else changes (the products, masks, clamps and the
epilogue are the compiled kernel's), so the outputs must be bit-identical, which the script checks.

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

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KERNEL = "k8_Conv"
ITEMS = 6144  # the launch's work-items
ITEMS_PER_ELEMENT = 96  # 32 channel tiles x 3 position tiles of one batch element
X_TEXELS, W_TEXELS = 62, 1024  # one block's input texels of one element (with the halo), and its weight texels
BLOCK_LOOP = "for (int blk101 = 0; blk101 < 128; blk101 += 4) {"
X_READ = re.compile(r"read_imagef\(in0, SMP, NOTE\(0, TEXEL_P2\((?:clamp\()?\(?q110(?: ([+-]) (\d+))?\)?"
                    r"(?:, 0, 122879\))?, 13\)\)\)")
W_READ = re.compile(r"read_imagef\(in1, SMP, NOTE\(1, TEXEL_P2\(\(?q139(?: \+ (\d+))?\)?, 13\)\)\)")
GUARD = f"  if (g >= {ITEMS}) {{\n    return;\n  }}\n"


def refuse(what: str) -> SystemExit:
    return SystemExit(f"staging_trial: {KERNEL} of this tree's T-ResNet bundle has no {what}; the conv builder's "
                      "output changed since the trial was written (update the patterns)")


def staged_source(kernel: str, batches: int, stage_x: bool, stage_w: bool, reads: bool = True) -> str:
    """`kernel` (k8_Conv's text) with the chosen operands staged per block by a group of `batches` elements."""
    group = ITEMS_PER_ELEMENT * batches
    for needed in (BLOCK_LOOP, GUARD):
        if needed not in kernel:
            raise refuse(f"line '{needed.strip()}'")
    name = f"k8_staged_{int(stage_x)}{int(stage_w)}{int(reads)}_{batches}"
    text = kernel.replace(f"__kernel void {KERNEL}(",
                          f"__kernel __attribute__((reqd_work_group_size({group}, 1, 1))) void {name}(")
    # every work-item reaches the barriers: the launch is whole groups, so no work-item is past the end
    text = text.replace(GUARD, f"  const int lid = get_local_id(0);\n  const int first = get_group_id(0) * {batches};\n"
                        + (f"  __local float4 xs[{X_TEXELS * batches}];\n" if stage_x else "")
                        + (f"  __local float4 ws[{W_TEXELS}];\n" if stage_w else ""))
    x_load = (f"read_imagef(in0, SMP, TEXEL_P2(clamp(((((first + j / {X_TEXELS}) * 7680) + (blk101 * 60)) >> 2) - 1 "
              f"+ j % {X_TEXELS}, 0, 122879), 13))" if reads else "(float4)(j)")
    w_load = ("read_imagef(in1, SMP, TEXEL_P2(blk101 * 2 + (j >> 3) * 256 + (j & 7), 13))" if reads
              else "(float4)(j)")
    loads = ((f"      for (int j = lid; j < {X_TEXELS * batches}; j += {group}) xs[j] = {x_load};\n" if stage_x else "")
             + (f"      for (int j = lid; j < {W_TEXELS}; j += {group}) ws[j] = {w_load};\n" if stage_w else ""))
    text = text.replace(BLOCK_LOOP, BLOCK_LOOP + "\n    barrier(CLK_LOCAL_MEM_FENCE);\n" + loads
                        + "    barrier(CLK_LOCAL_MEM_FENCE);")
    if stage_x:  # texel q110 + k is the element's texel (u2 >> 2) + k + 1 of the block's 62 (from q110 - 1)
        if not X_READ.search(text):
            raise refuse("input read at q110")
        text = X_READ.sub(lambda m: f"xs[(u0 - first) * {X_TEXELS} + (u2 >> 2) + "
                          f"{(-1 if m.group(1) == '-' else 1) * int(m.group(2) or 0) + 1}]", text)
    if stage_w:  # texel q139 + 256 r + t is weight row u1 + r's texel t of the block's 8
        if not W_READ.search(text):
            raise refuse("weight read at q139")
        text = W_READ.sub(lambda m: f"ws[(u1 + {int(m.group(1) or 0) // 256}) * 8 + {int(m.group(1) or 0) % 256}]",
                          text)
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
    parser.add_argument("--batches", type=int, default=1, help="batch elements per work-group (96 work-items each)")
    parser.add_argument("--items", type=int, default=ITEMS, help="launch only the first ITEMS work-items (whole "
                        "groups of every variant; the rest of each output stays zero): a run under `oclgrind "
                        "--data-races` (with --opt-disable) finishes in minutes")
    parser.add_argument("--opt-disable", action="store_true", help="build with -cl-opt-disable (oclgrind)")
    args = parser.parse_args()
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
    spec = next((k for k in plan["kernels"] if k["function"] == KERNEL), None)
    if spec is None:
        raise refuse("launch")
    first_kernel = next(i for i, line in enumerate(lines) if line.startswith("__kernel"))
    preamble = "\n".join(lines[:first_kernel - 1])
    kernel = "\n".join(lines[spec["lines"][0] - 1:spec["lines"][1]])
    variants = {"compiled": (KERNEL, spec["local_size"][0], 60 * args.items)}
    sources = [kernel]
    groups = args.items // (ITEMS_PER_ELEMENT * args.batches)
    if args.items % (ITEMS_PER_ELEMENT * args.batches) or args.items % spec["local_size"][0] or args.items > ITEMS:
        raise SystemExit(f"--items {args.items}: whole groups of {ITEMS_PER_ELEMENT * args.batches} and of "
                         f"{spec['local_size'][0]} work-items, at most {ITEMS}")
    for label, x, w, reads in (("staged", True, True, True), ("weights only", False, True, True),
                               ("inputs only", True, False, True), ("staged, no reads", True, True, False)):
        text = staged_source(kernel, args.batches, x, w, reads)
        sources.append(text)
        per_block = ((X_TEXELS * args.batches if x else 28 * ITEMS_PER_ELEMENT * args.batches)
                     + (W_TEXELS if w else 32 * ITEMS_PER_ELEMENT * args.batches)) if reads else 0
        name = re.search(r"void (\w+)\(", text).group(1)  # type: ignore[union-attr]
        variants[label] = (name, ITEMS_PER_ELEMENT * args.batches, per_block * groups)
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
        data = np.abs(data) + 1.0 if index == 6 else data  # index 6: a variance
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
    kernels["buffer storage"] = getattr(buffer_program, KERNEL)
    kernels["buffer storage"].set_args(*buffer_outputs, *buffers)
    variants["buffer storage"] = (KERNEL, spec["local_size"][0], -1)  # -1: no texel reads of an image
    best = {label: float("inf") for label in variants}
    for round_ in range(args.repeats + 1):  # round 0 warms PoCL's per-launch compile (timed only alone)
        for label, (_, local, _) in variants.items():
            started = time.process_time()
            cl.enqueue_nd_range_kernel(queue, kernels[label], (args.items,), (local,)).wait()
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
    print(f"{KERNEL} (T-ResNet B=64, image storage, {args.items} work-items, "
          f"{os.environ['POCL_MAX_PTHREAD_COUNT']} thread), least CPU ms of {args.repeats}; groups of "
          f"{ITEMS_PER_ELEMENT * args.batches} work-items for the staged variants")
    print(f"{'variant':<18} {'CPU ms':>8} {'vs compiled':>11} {'texel reads':>12}  outputs")
    for label, (_, _, reads) in variants.items():
        same = "" if label in ("compiled", "buffer storage") else (
            "bit-identical" if all(np.array_equal(a, b) for a, b in zip(reference, read_back(label)))
            else "differ" if "no reads" not in label else "(not compared)")
        count = "-" if reads < 0 else str(reads * 32)  # 32 blocks of 4 input channels
        print(f"{label:<18} {best[label]:8.1f} {best[label] / best['compiled']:11.2f} {count:>12}  {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
