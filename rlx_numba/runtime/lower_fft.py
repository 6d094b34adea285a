"""The FFT family's tiers and lowerings (ir/ops_fft.py).

Tier 0, cuFFT (cufft.py): the "dft", "rdft" and "irdft" nodes as one batched C2C / R2C / C2R
call each, any length. Tier 1, numba: the compiler rewrites those nodes (ops_fft.expand_fft)
into "fft" and "bluestein" nodes and graph ops. An "fft" node is rows of n = 2^p complex
values in Stockham passes of fft_pass_kernel: one (a row a block, in shared memory) up to
shared_n, else passes of radix up to max_radix (the geometry's) over every row, ping-ponging between the
output and a scratch array. A
"bluestein" node is one kernel a row (its chirp and filter tables made on the host in
float64). ``RLX_NUMBA_FFT_TIERS`` (a subset of 0,1)
limits the choice; the simulator runs tier 1.
"""
from __future__ import annotations

import math
import os

import numpy as np

from .. import cufft
from ..device import SIMULATOR
from ..ir.opdef import is_inplace, is_leaf
from ..ir.ops import fmt
from ..ir.opdef import Tier, add_tier, set_chooser
from ..ir.ops_fft import FFT_NODES, bluestein_tables, expand_fft
from ..kernels import fft as K
from ..kernels.launch import default_geometry, grid_3d
from .lower import CallStep, Step, env_tiers, log, lowering, step_name

_U = np.uint64


def _table(ctx, z) -> object:
    """A complex128 table as an interleaved f32 device array."""
    return ctx.device_array(np.stack([z.real, z.imag], -1).reshape(-1).astype(np.float32))


def _rows(n) -> tuple[int, int]:
    """(length, rows) of an FFT node over [..., length, 2]."""
    length = n.shape[-2]
    return length, n.size // (2 * length)


@lowering("fft")
def _lower_fft(ctx, n):
    if n.size == 0:
        return []
    length, rows = _rows(n)
    sign = np.float32(1.0 if n.attrs["inverse"] else -1.0)
    what = f"{'inverse ' if n.attrs['inverse'] else ''}fft {rows}x{length} of {fmt(n.shape)}"
    # one pass (the whole row a block in shared memory) up to shared_n, else passes of
    # radix 2^b, the b's as even as they come (each <= log2 max_radix)
    geo = default_geometry("fft")
    p = length.bit_length() - 1
    npass = 1 if length <= geo.shared_n else -(-p // (geo.max_radix.bit_length() - 1))
    bits = [p // npass + (k < p % npass) for k in range(npass)]
    # the last pass writes out: an odd count starts in out, an even one in a scratch array
    out = ctx.buf(n)
    bufs = [out] if npass == 1 else [out, ctx.device_array(np.zeros(n.size, np.float32))]
    if npass % 2 == 0:
        bufs.reverse()
    steps, src, ns = [], ctx.buf(n.inputs[0]), 1
    for k, b in enumerate(bits):
        radix = 1 << b
        nr = length // radix
        lines = min(geo.pass_lines, nr, ns if k else geo.pass_lines)
        dst = bufs[k % 2]
        steps.append(Step(step_name(n), f"{what} pass {k + 1}/{npass} radix {radix}",
                          K.fft_pass_kernel(radix, lines, k == 0),
                          grid_3d(rows * nr // lines), (geo.threads,),
                          (dst, src, _U(rows), _U(length), _U(nr), _U(ns),
                           _U(ns.bit_length() - 1), sign),
                          {"flops": 5 * rows * length * b, "bytes": 2 * n.nbytes}))
        src, ns = dst, ns * radix
    return steps


@lowering("bluestein")
def _lower_bluestein(ctx, n):
    """Bluestein's DFT of rows of any length, one kernel (kernels/fft.py)."""
    if n.size == 0:
        return []
    length, rows = _rows(n)
    m, c, filt = bluestein_tables(length, n.attrs["inverse"])
    args = (ctx.buf(n), ctx.buf(n.inputs[0]), _table(ctx, c), _table(ctx, filt), _U(rows))
    what = (f"{'inverse ' if n.attrs['inverse'] else ''}bluestein fft {rows}x{length} "
            f"({m} points) of {fmt(n.shape)}")
    return [Step(step_name(n), what, K.bluestein_row_kernel(length, m), grid_3d(rows),
                 (default_geometry("fft").threads,), args,
                 {"flops": 10 * rows * m * math.log2(m)})]


def fft_tier(n) -> tuple[int, str]:
    """(tier, why not tier 0) for an FFT node: 0 cuFFT, 1 the numba kernels."""
    tiers = env_tiers("RLX_NUMBA_FFT_TIERS", {0: "cuFFT", 1: "numba Stockham / Bluestein"})
    if 0 not in tiers:
        return 1, "tier 0 not allowed by RLX_NUMBA_FFT_TIERS"
    if 1 in tiers and SIMULATOR:
        return 1, "the simulator has no cuFFT"
    ok, err = cufft.available()
    if ok or 1 not in tiers:
        return 0, ""
    return 1, f"tier 0: {err}"


def _owned_by(ctx, src, n) -> bool:
    """Whether only ``n`` reads ``src``'s memory and nothing needs it after (cuFFT's C2R may
    overwrite its input)."""
    g = ctx.graph
    if is_leaf(src.op) or is_inplace(src.op) or ctx.is_view(src) \
            or src.id in g.outputs:
        return False
    return all(m.id == n.id or src.id not in m.inputs for m in g.nodes)


@lowering(*FFT_NODES, tier="cuFFT")
def _lower_cufft(ctx, n):
    """Tier 0: one cuFFT call (the compiler left this node to cuFFT)."""
    if n.size == 0:
        return []
    src = ctx.graph.nodes[n.inputs[0]]
    length = n.attrs["n"] if n.op == "irdft" else src.shape[-1] if n.op == "rdft" \
        else n.shape[-2]
    rows = math.prod(n.shape[:-1 if n.op == "irdft" else -2]) if n.op != "rdft" \
        else math.prod(src.shape[:-1])
    kind = {"dft": cufft.C2C, "rdft": cufft.R2C, "irdft": cufft.C2R}[n.op]
    inverse = bool(n.attrs.get("inverse"))
    x, out = ctx.buf(src), ctx.buf(n)
    if n.op == "irdft" and not _owned_by(ctx, src, n):
        x = ctx.device_array(np.zeros(src.size, np.float32))     # C2R overwrites its input
        copy = (ctx.buf(src), x)
    else:
        copy = None

    def make(stream):
        call = cufft.exec_call(stream, kind, length, rows, x.device_ctypes_pointer.value,
                               out.device_ctypes_pointer.value, inverse)
        if copy is None:
            return call
        x_ = copy[1]

        def go():
            x_.copy_to_device(copy[0], stream=stream)
            call()
        return go
    what = {"dft": "ifft" if inverse else "fft", "rdft": "rfft", "irdft": "irfft"}[n.op]
    return [CallStep(step_name(n), f"cufft {what} {rows}x{length} of {fmt(n.shape)}", make,
                     {"flops": 5 * rows * length * math.log2(max(length, 2)), "tier": 0})]


for _op in FFT_NODES:   # tier 1 rewrites the node into the numba kernels' ops at legalise
    add_tier(_op, Tier("numba Stockham / Bluestein", None, rewrite=expand_fft))
    set_chooser(_op, lambda graph, n: fft_tier(n), "RLX_NUMBA_FFT_TIERS")
