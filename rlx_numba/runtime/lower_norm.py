"""Lowerings of softmax, log_softmax, layer_norm, rms_norm (kernels/rows.py)."""
from __future__ import annotations

import math

import numpy as np

from ..kernels import rows
from ..kernels.launch import sm_count
from ..device import SIMULATOR
from .lower import Step, lowering, step_name


def _dummy(exe):
    if not hasattr(exe, "_rows_dummy"):
        exe._rows_dummy = exe.device_array(np.zeros(1, np.float32))
    return exe._rows_dummy


@lowering("softmax", "log_softmax", "layer_norm", "rms_norm")
def _lower_rows(exe, n):
    g = exe.graph
    x = g.nodes[n.inputs[0]]
    if x.size == 0:
        return []
    kind = rows.KINDS[n.op]
    norm = kind in (rows.LAYER_NORM, rows.RMS_NORM)
    dummy = _dummy(exe)
    gamma = beta = res = sum_out = dummy
    has_beta = has_res = write_sum = False
    eps = np.float32(n.attrs.get("eps", 0.0))
    if norm:
        ins = list(n.inputs[1:])
        gamma = exe.buf(ins.pop(0))
        if n.attrs["has_beta"]:
            beta, has_beta = exe.buf(ins.pop(0)), True
        if n.attrs["has_residual"]:
            res, has_res = exe.buf(ins.pop(0)), True
        for m in g.nodes:   # a live residual_sum of this node: the kernel stores x + residual
            if m.op == "residual_sum" and m.inputs[0] == n.id and m.id in exe._live:
                sum_out, write_sum = exe.buf(m), True
    axis = n.attrs["axis"]
    shape = x.shape
    outer, length, inner = math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])
    flags = (has_beta, has_res, write_sum)
    args = [exe.buf(n), exe.buf(x), gamma, beta, res, sum_out]
    name = step_name(n)
    if inner == 1:
        plan = rows.row_plan(length, kind in (rows.SOFTMAX, rows.LOG_SOFTMAX))
        if plan is not None:
            gsize, vpt, block, prefetch, per_sm = plan
            rpb = block // gsize
            blocks = min(-(-outer // rpb), 2 if SIMULATOR else sm_count() * per_sm)
            k = rows.rows_reg(kind, gsize, vpt, block, *flags, prefetch, gsize * vpt == length)
            return [Step(name, f"rows_reg g={gsize} vpt={vpt}{' prefetch' if prefetch else ''}",
                         k, (blocks,), (block,),
                         (*args, np.uint64(outer), np.uint64(length), eps),
                         {"bytes": _bytes(x.size, flags)})]
        block = 32 if SIMULATOR else rows.LOOP_BLOCK
        blocks = min(outer, 2 if SIMULATOR else sm_count() * 2 * (1024 // block))
        # keep the row's head on chip when that saves a good share of pass 2 (on an H200 it
        # lifted 32k-column softmax from 0.89 to 0.92 of torch and hurt 128k-column rms_norm)
        cached = rows.LOOP_CACHED if length <= 4 * rows.LOOP_CACHED else 0
        k = rows.rows_loop(kind, block, rows.LOOP_UNROLL, cached, *flags)
        return [Step(name, f"rows_loop unroll={rows.LOOP_UNROLL}", k, (blocks,), (block,),
                     (*args, np.uint64(outer), np.uint64(length), eps),
                     {"bytes": _bytes(x.size, flags)})]
    threads = 32 if SIMULATOR else 256
    blocks = max(1, min(-(-(outer * inner) // threads), 2 if SIMULATOR else sm_count() * 8))
    k = rows.cols(kind, *flags)
    return [Step(name, "rows_cols", k, (blocks,), (threads,),
                 (*args, outer, length, inner, eps),
                 {"bytes": _bytes(x.size, flags)})]


def _bytes(size, flags):
    _, has_res, write_sum = flags
    return 4 * size * (2 + has_res + write_sum)


@lowering("residual_sum")
def _lower_residual_sum(exe, n):
    return []   # written by the norm's kernel (see _lower_rows)
