"""The OpenCL preamble every kernels.cl starts with: the storage macros the renderer writes texture
reads and writes through (IMAGE_IN / IMAGE_OUT, RDF / WRF ... with PLACE: image2d_t, or buffers
under FBLC_BUFFERS), the trace hooks, and the helper functions kernels call (lane_f, window4, ldm...)."""

PREAMBLE = """\
// fblc kernels: element i of a tensor is lane i%4 of texel i/4 of an RGBA image2d_t; where texel t
// sits is the texture's layout (TexelLayout.c_coord): flat, or an RTILE_ function (c_definition).
__constant sampler_t SMP = CLK_NORMALIZED_COORDS_FALSE | CLK_ADDRESS_NONE | CLK_FILTER_NEAREST;
#define TEXEL_P2(t, s) ((int2)((t) & ((1 << (s)) - 1), (t) >> (s)))  // a width of 2^s texels: no division
inline float lane_f(float4 v, int l) { return l == 0 ? v.x : l == 1 ? v.y : l == 2 ? v.z : v.w; }
inline int lane_i(int4 v, int l) { return l == 0 ? v.x : l == 1 ? v.y : l == 2 ? v.z : v.w; }
inline int wrap_row(int r, int n) { return r < 0 ? r + n : r; }  // ONNX: a negative index counts from the end
// elements s..s+3 of the 8 in texels a, b (s in 0..3, known at run time). Branches, not a chain of
// ?: over vector literals, which oclgrind's compiler got wrong (a conv's sums changed)
inline float4 window4(float4 a, float4 b, int s) {
  if (s == 0) return a;
  if (s == 1) return (float4)(a.yzw, b.x);
  if (s == 2) return (float4)(a.zw, b.xy);
  return (float4)(a.w, b.xyz);
}
#ifdef FBLC_BUFFERS  // LocalRunner(storage="buffer"): each texture's texels in index order in a buffer
#define IMAGE_IN(type, n) __global const type* restrict n
#define IMAGE_OUT(type, n) __global type* restrict n
#define PLACE(t, c) ((int2)((t), 0))  // texel t is element t: the layout's coordinate c goes unused
#define AT(img, c) ((c).x)
inline float4 __attribute__((overloadable)) load_f(__global const float4* p, int i) { return p[i]; }
inline float4 __attribute__((overloadable)) load_f(__global const half* p, int i) { return vload_half4(i, p); }
// window4 of texels q and q + 1 as one unaligned load (LocalRunner leaves a texel of slack past each buffer)
inline float4 __attribute__((overloadable)) window_f(__global const float4* p, int q, int s) {
  return vload4(0, (__global const float*)p + q * 4 + s);
}
inline float4 __attribute__((overloadable)) window_f(__global const half* p, int q, int s) {
  return vload_half4(0, p + q * 4 + s);
}
#define WINDOW(img, a, b, q, s) window_f(img, q, s)
inline void __attribute__((overloadable)) store_f(__global float4* p, int i, float4 v) { p[i] = v; }
inline void __attribute__((overloadable)) store_f(__global half* p, int i, float4 v) { vstore_half4_rte(v, i, p); }
#define READ_F(img, c) load_f(img, AT(img, c))
#define READ_I(img, c) img[AT(img, c)]
#define READ_U(img, c) ((uint4)(img[AT(img, c)], 0u, 0u, 0u))
#define WRF(img, c, v) store_f(img, AT(img, c), v)
#define WRI(img, c, v) (img[AT(img, c)] = (v))
#define WRU(img, c, v) (img[AT(img, c)] = (uchar)((v).x))
#else  // what phones run: image2d_t textures
#define PLACE(t, c) (c)  // texel t sits at c, the texture's layout (TexelLayout.c_coord)
#define WINDOW(img, a, b, q, s) window4(a, b, s)  // a and b: texels q and q + 1 of img, already read
#define IMAGE_IN(type, n) read_only image2d_t n
#define IMAGE_OUT(type, n) write_only image2d_t n
#define READ_F(img, c) read_imagef(img, SMP, c)
#define READ_I(img, c) read_imagei(img, SMP, c)
#define READ_U(img, c) read_imageui(img, SMP, c)
#define WRF(img, c, v) write_imagef(img, c, v)
#define WRI(img, c, v) write_imagei(img, c, v)
#define WRU(img, c, v) write_imageui(img, c, v)
#endif
#ifdef FBLC_TRACE  // fblc.runtime.trace: every texel read also records (argument, x, y) per work-item
#define TRACE_PARAM , __global int4* fblc_trace, __global int* fblc_counts
#define TRACE_INIT const int fblc_item = get_global_id(0) - get_global_offset(0); int fblc_n = 0;
inline int fblc_note(__global int4* trace, __global int* counts, int item, int* n, int arg, int2 c) {
  if (item >= FBLC_TRACE_ITEMS) return 0;  // a whole launch runs too: only one group's worth is kept
  if (*n < FBLC_TRACE_CAPACITY) trace[item * FBLC_TRACE_CAPACITY + *n] = (int4)(arg, c.x, c.y, 0);
  counts[item] = ++*n;  // a call, so two reads in one expression are sequenced
  return 0;
}
#define NOTE(img, c) fblc_note(fblc_trace, fblc_counts, fblc_item, &fblc_n, ARG_##img, c)
#define RDF(img, c) (NOTE(img, c), READ_F(img, c))
#define RDI(img, c) (NOTE(img, c), READ_I(img, c))
#define RDU(img, c) (NOTE(img, c), READ_U(img, c))
#else
#define TRACE_PARAM
#define TRACE_INIT
#define RDF(img, c) READ_F(img, c)
#define RDI(img, c) READ_I(img, c)
#define RDU(img, c) READ_U(img, c)
#endif
// a boolean tensor saved for the backward: element i is bit i%8 of byte i/8 (r_mask8; r_mask4: i%4, i/4)
#define ldm(img, bit, coord) ((int)(RDU(img, coord).x >> (bit)) & 1)
"""
