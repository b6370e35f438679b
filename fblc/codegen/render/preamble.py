"""The OpenCL preambles the kernel sources start with: the helper functions kernels call (lane_f,
window4...), in a source with half kernels the `real` type and its helpers (REAL_PREAMBLE), and in
kernels.cl (image storage) the sampler, TEXEL_P2 of the layouts' coordinates and the trace hooks
(TRACE_PARAM, TRACE_INIT, NOTE: fblc.runtime.trace builds kernels.cl with FBLC_TRACE)."""

from fblc.bundle_format import HALF_BUILD_OPTION

HALF_MACRO = HALF_BUILD_OPTION.removeprefix("-D")  # what a runtime defines for a device with cl_khr_fp16

#: FBLC_SUBGROUPS where the device compiler has sub-group built-ins (cl_khr_subgroups, or OpenCL C 3.0's
#: feature): group reductions then merge within sub-groups first (ir.WithFeature; the __local tree otherwise)
FEATURE_TESTS = """\
#if defined(cl_khr_subgroups) || defined(__opencl_c_subgroups)
#define FBLC_SUBGROUPS
#endif
#ifdef cl_khr_subgroups
#pragma OPENCL EXTENSION cl_khr_subgroups : enable
#endif
"""

def _erf_rational(name: str, vector: str, nan_pick: str) -> str:
    """erf(a) within 5e-7 (absolute and relative, tests/test_erf_rational.py) as a rational function of odd
    degree 13 over even degree 8 on [-4, 4], where |erf| rounds to 1 beyond (Eigen's generic_fast_erf_float):
    a dozen multiply-adds and a division, where a library erf takes ~30x as long on PoCL (GELU's epilogues).
    One source for float and float4 (codegen/texel_wide.py), so the two cannot drift apart."""
    return f"""inline {vector} {name}({vector} a) {{
  const {vector} x = clamp(a, -4.0f, 4.0f), x2 = x * x;
  {vector} p = x2 * -2.72614225801306e-10f + 2.77068142495902e-08f;
  p = x2 * p - 2.10102402082508e-06f;
  p = x2 * p - 5.69250639462346e-05f;
  p = x2 * p - 7.34990630326855e-04f;
  p = x2 * p - 2.95459980854025e-03f;
  p = x2 * p - 1.60960333262415e-02f;
  {vector} q = x2 * -1.45660718464996e-05f - 2.13374055278905e-04f;
  q = x2 * q - 1.68282697438203e-03f;
  q = x2 * q - 7.37332916720468e-03f;
  q = x2 * q - 1.42647390514189e-02f;
  return {nan_pick};  // clamp would turn a NaN into -1
}}
"""


HELPERS = FEATURE_TESTS + """\
inline float lane_f(float4 v, int l) { return l == 0 ? v.x : l == 1 ? v.y : l == 2 ? v.z : v.w; }
inline int lane_i(int4 v, int l) { return l == 0 ? v.x : l == 1 ? v.y : l == 2 ? v.z : v.w; }
""" + _erf_rational("erf_rational", "float", "isnan(a) ? a : x * p / q") \
    + _erf_rational("erf_rational4", "float4", "select(x * p / q, a, isnan(a))") + """\
inline int wrap_row(int r, int n) { return r < 0 ? r + n : r; }  // ONNX: a negative index counts from the end
// elements s..s+3 of the 8 in texels a, b (s in 0..3, known at run time). Branches, not a chain of
// ?: over vector literals, which oclgrind's compiler got wrong (a conv's sums changed)
inline float4 window4(float4 a, float4 b, int s) {
  if (s == 0) return a;
  if (s == 1) return (float4)(a.yzw, b.x);
  if (s == 2) return (float4)(a.zw, b.xy);
  return (float4)(a.w, b.xyz);
}
"""

#: what a source with half kernels (codegen/ir/precision.py) adds to its preamble
REAL_PREAMBLE = """\
// real: the arithmetic type of the kernels fblc wrote for half (--dtype fp16 on a target whose profile has
// cl_khr_fp16): half where the runtime found cl_khr_fp16 among the device's extensions (it builds with
// -D""" + HALF_MACRO + """), float elsewhere, so one source runs on both
#if defined(""" + HALF_MACRO + """) && defined(cl_khr_fp16)
#pragma OPENCL EXTENSION cl_khr_fp16 : enable
typedef half real;
typedef half4 real4;
typedef half8 real8;
#define convert_real4 convert_half4
#define convert_real8 convert_half8
#else
typedef float real;
typedef float4 real4;
typedef float8 real8;
#define convert_real4 convert_float4
#define convert_real8 convert_float8
#endif
inline real lane_r(real4 v, int l) { return l == 0 ? v.x : l == 1 ? v.y : l == 2 ? v.z : v.w; }
inline real4 window4_r(real4 a, real4 b, int s) {
  if (s == 0) return a;
  if (s == 1) return (real4)(a.yzw, b.x);
  if (s == 2) return (real4)(a.zw, b.xy);
  return (real4)(a.w, b.xyz);
}
"""

#: and an image source's: its reads and writes of real texels
REAL_IMAGE_PREAMBLE = REAL_PREAMBLE + """\
#if defined(""" + HALF_MACRO + """) && defined(cl_khr_fp16)
#define read_imager read_imageh
#define write_imager write_imageh
#else
#define read_imager read_imagef
#define write_imager write_imagef
#endif
"""

PREAMBLE = """\
// fblc kernels: element i of a tensor is lane i%4 of texel i/4 of an RGBA image2d_t; where texel t
// sits is the texture's layout (TexelLayout.c_coord): flat, or an RTILE_ function (c_definition).
__constant sampler_t SMP = CLK_NORMALIZED_COORDS_FALSE | CLK_ADDRESS_NONE | CLK_FILTER_NEAREST;
#define TEXEL_P2(t, s) ((int2)((t) & ((1 << (s)) - 1), (t) >> (s)))  // a width of 2^s texels: no division
""" + HELPERS + """\
#ifdef FBLC_TRACE  // fblc.runtime.trace: every texel read also records (argument, x, y) per work-item
#define TRACE_PARAM , __global int4* fblc_trace, __global int* fblc_counts
#define TRACE_INIT const int fblc_item = get_global_id(0) - get_global_offset(0); int fblc_n = 0;
// a function a co-launched kernel calls (codegen/co_launch.py): the buffers, and the launch's number of its in0
#define TRACE_FN_PARAM , __global int4* fblc_trace, __global int* fblc_counts, const int fblc_in0
#define TRACE_ARGS(in0) , fblc_trace, fblc_counts, in0
inline int2 fblc_note(__global int4* trace, __global int* counts, int item, int* n, int arg, int2 c) {
  if (item < FBLC_TRACE_ITEMS) {  // a whole launch runs too: only one group's worth is kept
    if (*n < FBLC_TRACE_CAPACITY) trace[item * FBLC_TRACE_CAPACITY + *n] = (int4)(arg, c.x, c.y, 0);
    counts[item] = ++*n;  // a call, so two reads in one expression are sequenced
  }
  return c;
}
#define NOTE(arg, c) fblc_note(fblc_trace, fblc_counts, fblc_item, &fblc_n, arg, c)  // input arg's read at c
#else
#define TRACE_PARAM
#define TRACE_INIT
#define TRACE_FN_PARAM
#define TRACE_ARGS(in0)
#define NOTE(arg, c) (c)
#endif
"""

BUFFER_PREAMBLE = """\
// fblc kernels, buffer storage: element i of a tensor is lane i%4 of texel i/4, texel t element t of its
// argument's __global buffer (float4, int4; 4 halfs a texel at fp16; a byte a texel of a mask).
""" + HELPERS
