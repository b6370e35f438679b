"""Philox4x32-10 and the normal noise of evolution strategies, in numpy (the device kernel's reference).

Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011) maps a
128-bit counter and a 64-bit key to four 32-bit words with ten rounds of two 32 x 32 -> 64-bit
multiplies; it is counter-based, so any element of a stream is computed on its own, in any
order, by any work-item, and only the key and counter cross the bus.

ES noise element j of member row i (noise [P, D]) of an iteration takes the words of counter
(j // 4, iteration, i, 0) under key (seed mod 2^32, seed // 2^32): four consecutive elements of
a row are one Philox call, and every row is a stream of its own, so the device makes one row
where it is read and never stores the whole [P, D]. Words (w0, w1) give lanes 0 and 1, (w2, w3)
lanes 2 and 3, by Box-Muller on
24-bit uniforms u = ((w >> 8) + 1) / 2^24 in (0, 1] for the radius and v = (w >> 8) / 2^24 in
[0, 1) for the angle: z0 = sqrt(-2 ln u) cos(2 pi v), z1 = sqrt(-2 ln u) sin(2 pi v).

The words are bit for bit those of the OpenCL kernel (integer arithmetic only); the normals
agree to float32 rounding of log, sqrt, sin and cos (a few ulp), which OpenCL does not fix.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
WEYL = (0x9E3779B9, 0xBB67AE85)
ROUNDS = 10
MASK32 = 0xFFFFFFFF


def philox4x32(counter: np.ndarray, key: tuple[int, int]) -> np.ndarray:
    """Philox4x32-10 of counters [n, 4] (uint32) under `key` (two uint32): words [n, 4] (uint32)."""
    c = [counter[:, k].astype(np.uint64) for k in range(4)]
    k0, k1 = np.uint64(key[0] & MASK32), np.uint64(key[1] & MASK32)
    m0, m1 = np.uint64(MULTIPLIERS[0]), np.uint64(MULTIPLIERS[1])
    low, shift = np.uint64(MASK32), np.uint64(32)
    for round_index in range(ROUNDS):
        if round_index:
            k0 = (k0 + np.uint64(WEYL[0])) & low
            k1 = (k1 + np.uint64(WEYL[1])) & low
        p0, p1 = m0 * c[0], m1 * c[2]
        c = [((p1 >> shift) ^ c[1] ^ k0) & low, p1 & low, ((p0 >> shift) ^ c[3] ^ k1) & low, p0 & low]
    return np.stack(c, axis=1).astype(np.uint32)


def seed_key(seed: int) -> tuple[int, int]:
    return seed & MASK32, (seed >> 32) & MASK32


def box_muller(words: np.ndarray) -> np.ndarray:
    """Four normals per row of words [n, 4], as the kernel computes them (float32)."""
    w = words.astype(np.float64)
    top = np.floor(w / 256.0)  # w >> 8
    radius_u, angle_u = (top[:, 0::2] + 1.0) / 2.0 ** 24, top[:, 1::2] / 2.0 ** 24
    radius = np.sqrt(-2.0 * np.log(radius_u.astype(np.float32).astype(np.float64)))
    angle = 2.0 * np.pi * angle_u.astype(np.float32).astype(np.float64)
    out = np.empty(words.shape, np.float64)
    out[:, 0::2], out[:, 1::2] = radius * np.cos(angle), radius * np.sin(angle)
    return out.astype(np.float32)


def es_noise(seed: int, iteration: int, shape: Sequence[int]) -> np.ndarray:
    """The ES noise [P, D] of `iteration` (standard normal, float32): element (i, j) from Philox
    counter (j // 4, iteration, i, 0) and key `seed` (module docstring)."""
    rows, width = (int(d) for d in shape)
    texels = -(-width // 4)
    counter = np.zeros((rows, texels, 4), np.uint32)
    counter[:, :, 0] = np.arange(texels, dtype=np.uint64).astype(np.uint32)
    counter[:, :, 1] = np.uint32(iteration & MASK32)
    counter[:, :, 2] = np.arange(rows, dtype=np.uint64).astype(np.uint32)[:, None]
    words = philox4x32(counter.reshape(-1, 4), seed_key(seed))
    return box_muller(words).reshape(rows, texels * 4)[:, :width]
