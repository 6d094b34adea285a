"""Lowering of selective_scan and its gradient (kernels/scan.py). The forward is three steps:
chunk scans from zero (end states and delta sums into a scratch array of the executable),
the carry across chunks (start states, and the last state into the node's output), and the
chunk scans from their start states (y). The gradient redoes the first two into its own
scratch, zeroes dA / dB / dC (atomics add into them) and runs the reverse kernel."""
from __future__ import annotations

import numpy as np

from ..ir.ops import fmt
from ..kernels import reduce as RK
from ..kernels import scan as K
from ..kernels.launch import grid_1d
from .lower import Step, lowering, step_name

_U = np.uint64


def _dims(ctx, n):
    """(batch, dim, length, N, chunks, B * D * L) of a scan node or its gradient."""
    u, _, a = (ctx.graph.nodes[i] for i in n.inputs[:3])
    bt, dm, length = u.shape
    return bt, dm, length, a.shape[1], max(1, -(-length // K.CHUNK)), bt * dm * length


def _chunk_steps(ctx, n, last):
    """Steps 1-2 of the forward into a fresh scratch: (steps, states)."""
    bt, dm, length, ns, nc, _ = _dims(ctx, n)
    u, delta, a, b, c = (ctx.buf(i) for i in n.inputs[:5])
    states = ctx.device_array(np.zeros(bt * dm * nc * ns, np.float32))
    dsum = ctx.device_array(np.zeros(bt * dm * nc, np.float32))
    sizes = (_U(bt), _U(dm), _U(length), _U(nc))
    name, what = step_name(n), f"{bt}x{dm}x{length} N={ns}, {nc} chunks of {K.CHUNK}"
    g1 = grid_1d(bt * dm * nc, 128)
    g2 = grid_1d(bt * dm * ns, 128)
    return [Step(name, f"selective scan chunks {what}", K.scan_kernel(ns, K.FIRST), (g1[0],),
                 (g1[1],), (states, states, dsum, u, delta, a, b, c) + sizes, {}),
            Step(name, f"selective scan carry {what}", K.carry_kernel(ns), (g2[0],), (g2[1],),
                 (last, states, dsum, a, _U(bt), _U(dm), _U(nc)), {})], states, dsum


@lowering("selective_scan")
def _lower_scan(ctx, n):
    bt, dm, length, ns, nc, ny = _dims(ctx, n)
    if ny == 0:
        return []
    out = ctx.buf(n)
    steps, states, dsum = _chunk_steps(ctx, n, out[ny:])
    u, delta, a, b, c = (ctx.buf(i) for i in n.inputs)
    g1 = grid_1d(bt * dm * nc, 128)
    steps.append(Step(step_name(n), f"selective scan {bt}x{dm}x{length} N={ns}",
                      K.scan_kernel(ns, K.FINAL), (g1[0],), (g1[1],),
                      (out[:ny], states, dsum, u, delta, a, b, c, _U(bt), _U(dm), _U(length),
                       _U(nc)), {"flops": 6 * ny * ns}))
    return steps


@lowering("selective_scan_grad")
def _lower_scan_grad(ctx, n):
    bt, dm, length, ns, nc, ny = _dims(ctx, n)
    if ny == 0:
        return []
    out = ctx.buf(n)
    last = ctx.device_array(np.zeros(bt * dm * ns, np.float32))
    steps, states, _ = _chunk_steps(ctx, n, last)
    sizes = [dm * ns, bt * ns * length, bt * ns * length, ny, ny]
    at = np.cumsum([0] + sizes)
    parts = [out[at[i]:at[i + 1]] for i in range(5)]
    zero = ctx.device_array(np.zeros(1, np.float32))
    blocks, threads = grid_1d(int(at[3]))
    steps.append(Step(step_name(n), f"fill 0 dA dB dC {fmt(n.shape)}", RK.fill, (blocks,),
                      (threads,), (out, zero, _U(at[3])), {}))
    u, delta, a, b, c, dflat = (ctx.buf(i) for i in n.inputs)
    g2 = grid_1d(bt * dm, 128)
    steps.append(Step(step_name(n), f"selective scan grad {bt}x{dm}x{length} N={ns}",
                      K.scan_grad_kernel(ns), (g2[0],), (g2[1],),
                      (*parts, states, u, delta, a, b, c, dflat[:ny], dflat[ny:], _U(bt),
                       _U(dm), _U(length), _U(nc)), {"flops": 14 * ny * ns}))
    return steps
