"""What a texel read costs on the local OpenCL device in each read_imagef form, against a buffer load.

    POCL_MAX_PTHREAD_COUNT=1 python benchmarks/image_read_forms.py

Issue 39 (PoCL's image storage within 3x of PyTorch): PoCL runs image reads in software, so their form might
matter. Each kernel sums 64 texel reads per work-item (16,384 work-items, an 8192 x 16 RGBA float image) in one
form: fblc's sampler (render/preamble.py SMP: unnormalised, CLK_ADDRESS_NONE, nearest), the same with
CLK_ADDRESS_CLAMP_TO_EDGE (clamping in the sampler rather than in the index), OpenCL 1.2's sampler-less
read_imagef(image, int2), and a __global float4 load. Prints each one's least process CPU time over 7 launches
and ns per read, and whether all four summed the same values. Two runs (2026-12-06, PoCL on this machine's
CPU, loaded): 5.90, 6.69, 6.03, 0.69 and 5.73, 5.77, 5.75, 0.61 ns a read: the image forms cost alike (fblc's
is the cheapest or tied); the software read itself, ~9x a buffer load, is the cost, so only fewer reads help.
"""
import os
import time
os.environ.setdefault("POCL_MAX_PTHREAD_COUNT", "1")
import numpy as np
import pyopencl as cl
W, H, READS, ITEMS = 8192, 16, 64, 16384
src = """
__constant sampler_t SMP = CLK_NORMALIZED_COORDS_FALSE | CLK_ADDRESS_NONE | CLK_FILTER_NEAREST;
__constant sampler_t SMPC = CLK_NORMALIZED_COORDS_FALSE | CLK_ADDRESS_CLAMP_TO_EDGE | CLK_FILTER_NEAREST;
#define TEXEL_P2(t, s) ((int2)((t) & ((1 << (s)) - 1), (t) >> (s)))
__kernel void sampler(read_only image2d_t in, __global float4* out) {
  const int g = get_global_id(0); float4 acc = 0.0f;
  for (int k = 0; k < %(R)d; ++k) acc += read_imagef(in, SMP, TEXEL_P2(g * 7 + k, 13));
  out[g] = acc; }
__kernel void clamped(read_only image2d_t in, __global float4* out) {
  const int g = get_global_id(0); float4 acc = 0.0f;
  for (int k = 0; k < %(R)d; ++k) acc += read_imagef(in, SMPC, TEXEL_P2(g * 7 + k, 13));
  out[g] = acc; }
__kernel void nosampler(read_only image2d_t in, __global float4* out) {
  const int g = get_global_id(0); float4 acc = 0.0f;
  for (int k = 0; k < %(R)d; ++k) acc += read_imagef(in, TEXEL_P2(g * 7 + k, 13));
  out[g] = acc; }
__kernel void buffer(__global const float4* in, __global float4* out) {
  const int g = get_global_id(0); float4 acc = 0.0f;
  for (int k = 0; k < %(R)d; ++k) acc += in[g * 7 + k];
  out[g] = acc; }
""" % {"R": READS}
ctx = cl.create_some_context(False); q = cl.CommandQueue(ctx)
prg = cl.Program(ctx, src).build()
data = np.random.default_rng(0).standard_normal((H, W, 4)).astype(np.float32)
img = cl.create_image(ctx, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR, cl.ImageFormat(cl.channel_order.RGBA, cl.channel_type.FLOAT), (W, H), hostbuf=data)
buf = cl.Buffer(ctx, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR, hostbuf=data)
outs = {n: cl.Buffer(ctx, cl.mem_flags.WRITE_ONLY, ITEMS * 16) for n in ("sampler", "clamped", "nosampler", "buffer")}
best = {n: 1e9 for n in outs}
for r in range(8):
    for n in outs:
        k = getattr(prg, n); k.set_args(buf if n == "buffer" else img, outs[n])
        t = time.process_time(); cl.enqueue_nd_range_kernel(q, k, (ITEMS,), (64,)).wait(); t = time.process_time() - t
        if r: best[n] = min(best[n], t)
res = {n: np.empty((ITEMS, 4), np.float32) for n in outs}
for n in outs: cl.enqueue_copy(q, res[n], outs[n])
same = all(np.array_equal(res["sampler"], res[n]) for n in outs)
reads = ITEMS * READS
for n in outs: print(f"{n:10s} {best[n]*1e3:8.2f} ms  {best[n]*1e9/reads:6.2f} ns/read")
print("outputs identical:", same)
