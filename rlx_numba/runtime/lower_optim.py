"""Lowering of "optim_update" (ir/ops_optim.py): compile_train's update, kernels/optim.py.

Steps, in order: the join of the overlapped gradient all_reduces (data parallel), the chunks'
sums of squares (clip_grad_norm), the chunks' found-inf flags (loss scaling), the one
multi-tensor update launch over every param, the scale update (loss scaling). The grads are
read where the memory plan put them in the arena (a table of chunks gives their offsets).
"""
from __future__ import annotations

import numpy as np

from ..ir import dtypes as dt
from ..ir.ops_optim import operands
from ..kernels import halfio
from ..kernels import optim as K
from . import lower_dist
from .lower import Step, lowering, step_name, view_window


@lowering("optim_update")
def _optim_update(ctx, n):
    a, io = n.attrs, operands(n)
    g, root = ctx.graph, ctx.roots
    grad_off = []
    for gid in io["grads"]:
        r = root[gid]
        if g.nodes[r].op == "param":
            raise ValueError(f"compile: optim_update %{n.id}: gradient %{gid} is param "
                             f"{g.nodes[r].name!r}'s memory; the update reads grads from the "
                             f"arena (copy it first)")
        off, _ = view_window(g, gid, root)
        grad_off.append(ctx.buffers[r].offset // 4 + off)
    halves = a["half_offsets"] or [-1] * len(a["sizes"])
    rows = [(o + s, go + s, min(K.CHUNK, size - s), -1 if h < 0 else h + s)
            for o, go, size, h in zip(a["offsets"], grad_off, a["sizes"], halves)
            for s in range(0, size, K.CHUNK)]
    nchunks = np.int64(len(rows))
    table = ctx.device_array(np.array(rows, np.int64).reshape(-1, 4))
    grads = ctx.arena[:ctx.arena_bytes - ctx.arena_bytes % 4].view(np.float32)
    params, hyper = ctx.buf(io["params"]), ctx.buf(io["hyper"])
    states = [ctx.buf(s) for s in io["states"]]
    numel = sum(a["sizes"])
    blocks, threads = K.grid(len(rows))
    what = f"{len(a['sizes'])} params, {numel} over {len(rows)} chunks"
    steps = lower_dist.join_steps(ctx)
    placeholder = ctx.shared(("optim_update", "f32[1]"), lambda: np.zeros(1, np.float32))

    partials, npart, max_norm = placeholder, np.int64(0), np.float32(0.0)
    if a["max_norm"] is not None:
        partials, npart = ctx.device_array(np.zeros(len(rows), np.float32)), nchunks
        max_norm = np.float32(a["max_norm"])
        steps.append(Step(f"{step_name(n)} clip_grad_norm", f"grad_sumsq {what}", K.grad_sumsq,
                          (blocks,), (threads,), (partials, grads, table, nchunks),
                          {"bytes": 4 * numel}))
    scaler, flags, nflags = placeholder, placeholder, np.int64(0)
    if a["scaling"] is not None:
        scaler = ctx.buf(io["scaler"])
        flags, nflags = ctx.device_array(np.zeros(len(rows), np.float32)), nchunks
        steps.append(Step(f"{step_name(n)} found_inf", f"grad_nonfinite {what}",
                          K.grad_nonfinite, (blocks,), (threads,), (flags, grads, table, nchunks),
                          {"bytes": 4 * numel}))
    kind, half_out = "f32", placeholder
    if io["halves"] is not None:
        h = g.nodes[io["halves"]]
        kind, half_out = halfio.io_kind(h.dtype), ctx.buf(h)

    hp = dict(a["hp"])
    rule = a["rule"]
    if rule == "sgd":
        buf = states[0] if states else params        # (not read when momentum is 0)
        args = (params, grads, buf, table, nchunks, hyper, np.float32(hp["momentum"]),
                np.float32(hp["dampening"]), np.float32(hp["weight_decay"]),
                np.int32(hp["nesterov"]))
    else:
        max_sq = states[2] if hp["amsgrad"] else states[1]   # (not read without amsgrad)
        b1, b2 = hp["beta1"], hp["beta2"]
        args = (params, grads, states[0], states[1], max_sq, table, nchunks, hyper,
                np.float32(1 - b1), np.float32(b2), np.float32(1 - b2), np.float32(hp["eps"]),
                np.float32(hp["weight_decay"]), np.int32(hp["decoupled"]),
                np.int32(hp["amsgrad"]))
    args += (partials, npart, max_norm, half_out, scaler, flags, nflags)
    kernel = K.update_kernel(rule, kind)
    itemsize = 4 + (dt.dtype(kind).itemsize if kind != "f32" else 0)
    label = "sgd" if rule == "sgd" else "adamw" if hp["decoupled"] else "adam"
    steps.append(Step(f"{step_name(n)} optim.{label}", f"{kernel.py_func.__name__} {what}", kernel,
                      (blocks,), (threads,), args,
                      {"bytes": numel * (itemsize + 8 + 8 * len(states))}))
    if a["scaling"] is not None:
        growth, backoff, interval = a["scaling"]
        steps.append(Step(f"{step_name(n)} scale", "amp_update_scale", K.amp_update_scale,
                          (1,), (K.BLOCK,), (scaler, flags, nflags, np.float32(growth),
                                             np.float32(backoff), np.float32(interval)),
                          {"bytes": 4 * len(rows)}))
    # what it writes besides input 0: the state, the trained params' views, the half copies
    # and the scaler (the node declares input 0; these it declares here)
    wrote = [ctx.byte_range(i) for i in io["states"] + io["trained"]
             + [i for i in (io["halves"], io["scaler"]) if i is not None]]
    for s in steps:
        s.writes = [w for w in wrote if w is not None]
    return steps
