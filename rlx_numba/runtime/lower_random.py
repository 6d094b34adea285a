"""Lowering of dropout and random (kernels/random.py): a grid-stride loop, a thread per block
of four elements (one Philox call). An int seed becomes a one-element device array, so the
kernels read the seed the same way whether it is an attribute or a tensor."""
from __future__ import annotations

import numpy as np

from ..kernels import random as K
from ..kernels.halfio import io_kind
from ..kernels.launch import grid_1d
from .lower import Step, lowering, step_name

_U = np.uint64


def _seed(ctx, n, pos):
    if n.attrs["seed"] is None:
        return ctx.buf(ctx.graph.nodes[n.inputs[pos]])
    return ctx.device_array(np.array([n.attrs["seed"]], np.uint64).view(np.int64))


@lowering("dropout")
def _lower_dropout(ctx, n):
    if n.size == 0:
        return []
    x = ctx.graph.nodes[n.inputs[0]]
    p = n.attrs["p"]
    grid, block = grid_1d(-(-n.size // 4))
    args = (ctx.buf(n), ctx.buf(x), _seed(ctx, n, 1), _U(n.attrs["stream"]), _U(n.size),
            np.float32(p), np.float32(1.0 / (1.0 - p)) if p < 1 else np.float32(0.0))
    return [Step(step_name(n), f"dropout p={p}", K.dropout_kernel(io_kind(n.dtype)), (grid,),
                 (block,), args,
                 {"bytes": 2 * n.nbytes})]


@lowering("random")
def _lower_random(ctx, n):
    if n.size == 0:
        return []
    dist = K.UNIFORM if n.attrs["dist"] == "uniform" else K.NORMAL
    grid, block = grid_1d(-(-n.size // 4))
    args = (ctx.buf(n), _seed(ctx, n, 0), _U(n.attrs["stream"]), _U(n.size), _U(dist))
    return [Step(step_name(n), f"random {n.attrs['dist']}", K.random_kernel, (grid,), (block,),
                 args, {"bytes": n.nbytes})]
