"""Lowering of cross_entropy and cross_entropy_bwd (kernels/loss.py): one block per row,
a grid-stride loop over the rows."""
from __future__ import annotations

import numpy as np

from ..device import SIMULATOR
from ..kernels import loss as K
from ..kernels.halfio import io_kind
from ..kernels.launch import sm_count
from .lower import Step, lowering, step_name


def _geometry(rows: int, c: int):
    block = K.block_for(c)
    blocks = max(1, min(rows, 2 if SIMULATOR else sm_count() * max(1, 2048 // block)))
    return (blocks,), (block,)


def _label_check(ctx, n, labels, c):
    """run() rejects labels fed as host arrays outside [0, C) other than ignore_index (as a
    range: values between ignore_index and 0 get past it, and the kernel's NaN shows them)."""
    ig = n.attrs["ignore_index"]
    ctx.add_index_check(labels, min(0, ig), max(c - 1, ig),
                        f"{n.op} %{n.id} (labels of {c} classes, ignore_index {ig})")


@lowering("cross_entropy", "cross_entropy_bwd")
def _lower_cross_entropy(ctx, n):
    g = ctx.graph
    x, labels = g.nodes[n.inputs[0]], g.nodes[n.inputs[1]]
    c = x.shape[-1]
    rows = labels.size
    _label_check(ctx, n, labels, c)
    if rows == 0:
        return []
    grid, block = _geometry(rows, c)
    xk = io_kind(x.dtype)      # the logits' storage kind (the loss rows are f32)
    scalars = (np.int64(rows), np.int64(c), np.int64(n.attrs["ignore_index"]),
               np.float32(n.attrs["label_smoothing"]))
    if n.op == "cross_entropy":
        return [Step(step_name(n), f"ce_forward block={block[0]}", K.ce_forward(block[0], xk), grid,
                     block, (ctx.buf(n), ctx.buf(x), ctx.buf(labels), *scalars),
                     {"bytes": x.nbytes + labels.nbytes + n.nbytes})]
    dy = g.nodes[n.inputs[2]]
    return [Step(step_name(n), f"ce_backward block={block[0]}", K.ce_backward(block[0], xk), grid,
                 block, (ctx.buf(n), ctx.buf(x), ctx.buf(labels), ctx.buf(dy), *scalars),
                 {"bytes": 3 * x.nbytes + labels.nbytes + dy.nbytes})]
