"""The preamble's erf_rational (Erf and exact Gelu in every kernel source): within ERF_TOLERANCE of erf.

Numeric: run on the local OpenCL device over a dense grid of [-6, 6] (beyond +-4 erf rounds to +-1), magnitudes
from 1e-30 to 3 of both signs and the infinities, against Python's math.erf in double precision; a NaN stays
NaN. The tolerance is the one the preamble states, absolute and relative.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from fblc.codegen.render.preamble import PREAMBLE

ERF_TOLERANCE = 5e-7


def test_erf_rational_is_within_its_stated_tolerance_of_erf() -> None:
    cl = pytest.importorskip("pyopencl")
    from fblc.runtime.opencl import select_device

    context = cl.Context([select_device()])
    queue = cl.CommandQueue(context)
    source = PREAMBLE + ("__kernel void erfs(__global const float *xs, __global float *out) {\n"
                         "  const int i = get_global_id(0); out[i] = erf_rational(xs[i]);\n}\n")
    program = cl.Program(context, source).build()
    magnitudes = np.float32(10.0) ** np.linspace(-30.0, 0.5, 4096, dtype=np.float32)
    xs = np.concatenate([np.linspace(-6.0, 6.0, 1 << 18, dtype=np.float32), magnitudes, -magnitudes,
                         np.array([np.inf, -np.inf, 0.0, np.nan], np.float32)])
    flags = cl.mem_flags
    xs_buffer = cl.Buffer(context, flags.READ_ONLY | flags.COPY_HOST_PTR, hostbuf=xs)
    out_buffer = cl.Buffer(context, flags.WRITE_ONLY, xs.nbytes)
    program.erfs(queue, xs.shape, None, xs_buffer, out_buffer)
    out = np.empty_like(xs)
    cl.enqueue_copy(queue, out, out_buffer).wait()
    assert np.isnan(out[-1]), "erf_rational(NaN) should stay NaN"
    reference = np.array([math.erf(float(x)) for x in xs[:-1]])
    error = np.abs(out[:-1].astype(np.float64) - reference)
    worst = int(np.argmax(error / np.maximum(np.abs(reference), 1.0)))
    assert np.all(error <= ERF_TOLERANCE * np.maximum(np.abs(reference), 1.0)), \
        (xs[worst], out[worst], reference[worst])
    relative = error / np.maximum(np.abs(reference), np.finfo(np.float64).tiny)
    assert np.all(relative[reference != 0] <= ERF_TOLERANCE), float(relative[reference != 0].max())
