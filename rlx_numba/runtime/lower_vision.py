"""Lowering of im2col, col2im (kernels/conv.py), pool and pool_grad (kernels/pool.py), the ops
of ir/ops_vision.py: one grid-stride kernel each, the geometry a small int64 device array."""
from __future__ import annotations


import numpy as np

from ..kernels import conv as K
from ..kernels import pool as P
from ..kernels.launch import grid_1d
from ..ir.ops import fmt
from .lower import Step, lowering, step_name


def _geo(exe, a):
    """kernel, cols spatial, image spatial, stride, pad, dilation as 3-d (unit dims in front)."""
    lead = 3 - len(a["kernel"])
    vals = []
    for key, unit in (("kernel", 1), ("cols", 1), ("image", 1), ("stride", 1), ("pad", 0),
                      ("dilation", 1)):
        vals += [unit] * lead + list(a[key])
    return exe.device_array(np.array(vals, np.int64))


def _step(exe, n, kernel, out, src, what):
    a = n.attrs
    if n.size == 0:
        return []
    nb, c = src.shape[0], (n.shape[1] if kernel is K.col2im_kernel else src.shape[1])
    grid, block = grid_1d(n.size)
    return [Step(step_name(n), f"{what} {'x'.join(map(str, a['kernel']))} kernel, image "
                 f"{'x'.join(map(str, a['image']))}, {nb}x{c} channels", kernel, (grid,),
                 (block,), (exe.buf(n), exe.buf(src), np.int64(nb), np.int64(c), _geo(exe, a)),
                 {"bytes": n.nbytes + src.nbytes})]


@lowering("im2col")
def _lower_im2col(exe, n):
    x = exe.graph.nodes[n.inputs[0]]
    return _step(exe, n, K.im2col_kernel, n, x, "im2col")


@lowering("col2im")
def _lower_col2im(exe, n):
    cols = exe.graph.nodes[n.inputs[0]]
    return _step(exe, n, K.col2im_kernel, n, cols, "col2im")


@lowering("pool")
def _lower_pool(exe, n):
    if n.size == 0:
        return []
    a, x = n.attrs, exe.graph.nodes[n.inputs[0]]
    nc = n.shape[0] * n.shape[1]
    grid, block = grid_1d(n.size)
    kern = P.pool_kernel(a["kind"] == "max", a["count_include_pad"])
    return [Step(step_name(n), f"{a['kind']} pool {'x'.join(map(str, a['kernel']))} of "
                 f"{fmt(x.shape)}", kern, (grid,), (block,),
                 (exe.buf(n), exe.buf(x), np.int64(nc), _geo(exe, a)),
                 {"bytes": n.nbytes + x.nbytes})]


@lowering("pool_grad")
def _lower_pool_grad(exe, n):
    if n.size == 0:
        return []
    a = n.attrs
    x, dy = (exe.graph.nodes[i] for i in n.inputs)
    nc = n.shape[0] * n.shape[1]
    grid, block = grid_1d(n.size)
    kern = P.pool_grad_kernel(a["kind"] == "max", a["count_include_pad"])
    return [Step(step_name(n), f"{a['kind']} pool grad {'x'.join(map(str, a['kernel']))} of "
                 f"{fmt(x.shape)}", kern, (grid,), (block,),
                 (exe.buf(n), exe.buf(x), exe.buf(dy), np.int64(nc), _geo(exe, a)),
                 {"bytes": n.nbytes + x.nbytes + dy.nbytes})]
