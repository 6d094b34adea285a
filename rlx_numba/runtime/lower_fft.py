"""Lowering of the "fft" node (kernels/fft.py): rows of n = 2^p complex values, one kernel a
row in shared memory up to SHARED_N, else one launch a Stockham stage over every row in global
memory, ping-ponging between the output and a scratch array. The twiddle table is made on the
host in float64 (conjugated for the inverse)."""
from __future__ import annotations

import math

import numpy as np

from ..ir.ops import fmt
from ..kernels import fft as K
from ..kernels.launch import grid_1d, grid_3d
from .lower import Step, lowering, step_name

_U = np.uint64


def twiddles(n: int, inverse: bool) -> np.ndarray:
    """exp(-+2 pi i t / n) for t < max(1, n / 2), interleaved f32."""
    t = np.arange(max(1, n // 2))
    w = np.exp((1j if inverse else -1j) * 2 * np.pi * t / n)
    return np.stack([w.real, w.imag], -1).reshape(-1).astype(np.float32)


@lowering("fft")
def _lower_fft(exe, n):
    if n.size == 0:
        return []
    length = n.shape[-2]
    rows = n.size // (2 * length)
    x = exe.buf(n.inputs[0])
    out = exe.buf(n)
    tw = exe.device_array(twiddles(length, n.attrs["inverse"]))
    name = step_name(n)
    what = f"{'inverse ' if n.attrs['inverse'] else ''}fft {rows}x{length} of {fmt(n.shape)}"
    if length <= K.SHARED_N:
        return [Step(name, f"{what} (shared memory)", K.fft_row_kernel(length),
                     grid_3d(rows), (K.THREADS,),
                     (out, x, tw, _U(rows)), {"flops": 5 * rows * length * math.log2(length)})]
    stages = int(math.log2(length))
    scratch = exe.device_array(np.zeros(n.size, np.float32))
    # the last stage writes out: an odd count starts in out, an even one in scratch
    bufs = [out, scratch] if stages % 2 else [scratch, out]
    grid, block = grid_1d(rows * length // 2)
    steps, src, ns = [], x, 1
    for s in range(stages):
        dst = bufs[s % 2]
        steps.append(Step(name, f"{what} stage {s + 1}/{stages}", K.fft_stage_kernel, (grid,),
                          (block,), (dst, src, tw, _U(rows), _U(length), _U(ns)),
                          {"bytes": 4 * n.nbytes // 2}))
        src, ns = dst, ns * 2
    return steps
