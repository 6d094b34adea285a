"""Lowering of delta_state_scan (ir/ops_delta.py; kernels/delta.py): one launch for all
chunks, a block per (head, slice of V's columns)."""
from __future__ import annotations

import numpy as np

from ..device import SIMULATOR, device_info, max_shared_per_block
from ..kernels import delta as K
from ..kernels.launch import default_geometry
from .lower import Step, data_ptr, lowering, step_name


@lowering("delta_state_scan")
def _lower_state_scan(ctx, n):
    ins = [ctx.graph.nodes[i] for i in n.inputs]
    heads, chunks, c, k = ins[0].shape
    v = ins[2].shape[3]
    if heads * chunks * c * k * v == 0:
        return []
    # the default geometry where this GPU allows its shared memory, else a smaller layout
    geo, vs, shared_pq = K.fit_state_scan(k, c, v, default_geometry("delta_state_scan"),
                                          max_shared_per_block())
    has_bias = len(ins) == 6
    reverse = bool(n.attrs.get("reverse", False))
    p, q, a, d, s0 = (ctx.buf(i) for i in n.inputs[:5])
    # P and Q copied 16 bytes at a time (cp.async: sm_80+) where their rows allow it
    vec = k % 4 == 0 and all(data_ptr(b) % 16 == 0 for b in (p, q)) \
        and (SIMULATOR or device_info()["cc"] >= (8, 0))
    kernel = K.state_scan_kernel(k, c, vs, geo, reverse, has_bias, vec, shared_pq)
    # the further results (states, final) where they are live, else scratch the kernel
    # writes and nothing reads
    outs = {"delta_scan_states": (heads * chunks * k * v), "delta_scan_final": (heads * k * v)}
    for r in n.results:
        op = ctx.graph.nodes[r].op
        if r in ctx.live and isinstance(outs.get(op), int):
            outs[op] = ctx.buf(r)
    for op, size in outs.items():
        if isinstance(size, int):
            outs[op] = ctx.device_array(np.zeros(size, np.float32))
    bias = ctx.buf(n.inputs[5]) if has_bias else d          # (not read without a bias)
    blocks = heads * -(-v // vs)
    grid = min(blocks, 2) if SIMULATOR else blocks
    return [Step(step_name(n), f"delta state scan {heads} heads x {chunks} chunks of {c}, "
                 f"K={k} V={v}{' reversed' if reverse else ''}, {vs} columns a block"
                 f"{', P and Q in one buffer' if shared_pq else ''}", kernel, (grid,),
                 (geo.rt * geo.ct,),
                 (outs["delta_scan_states"], ctx.buf(n), outs["delta_scan_final"], p, q, a, d,
                  s0, bias, np.int64(heads), np.int64(chunks), np.int64(v)),
                 {"flops": 4 * heads * chunks * c * k * v},
                 shared=K.shared_bytes(k, c, vs, geo, shared_pq))]


@lowering("delta_scan_states", "delta_scan_final")
def _lower_further(ctx, n):
    return []   # written by delta_state_scan's kernel


@lowering("unit_lower_inverse", "unit_lower_inverse_scaled")
def _lower_unit_lower_inverse(ctx, n):
    c = n.shape[-1]
    count = int(np.prod(n.shape[:-2], dtype=np.int64))
    if count * c == 0:
        return []
    grid = min(count, 2) if SIMULATOR else count
    a = ctx.buf(n.inputs[0])
    out2 = tout = s1 = s2 = a                                  # (not touched when plain)
    scaled = n.op == "unit_lower_inverse_scaled"
    write_t = False
    if scaled:
        s1, s2 = ctx.buf(n.inputs[1]), ctx.buf(n.inputs[2])
        for r in n.results:             # T diag(s2) always (scratch when dead), T where live
            op = ctx.graph.nodes[r].op
            live = r in ctx.live
            if op == "unit_lower_inverse_second":
                out2 = ctx.buf(r) if live else ctx.device_array(np.zeros(count * c * c,
                                                                          np.float32))
            elif op == "unit_lower_inverse_t" and live:
                tout, write_t = ctx.buf(r), True
    what = (f", two column-scaled copies{' and T' if write_t else ''}" if scaled else "")
    return [Step(step_name(n), f"unit lower inverse {count} x {c}x{c}{what}",
                 K.unit_lower_inverse_kernel(c, scaled, write_t), (grid,), (K.inverse_size(c),),
                 (ctx.buf(n), out2, tout, a, s1, s2, np.int64(count)),
                 {"flops": count * c ** 3 // 3})]


@lowering("unit_lower_inverse_second", "unit_lower_inverse_t")
def _lower_inverse_further(ctx, n):
    return []   # written by unit_lower_inverse_scaled's kernel
