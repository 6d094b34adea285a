"""Lowering of im2col and col2im (ir/ops_vision.py; kernels/conv.py): one grid-stride kernel
each, the geometry a small int64 device array of the node's."""
from __future__ import annotations

import math

import numpy as np

from ..kernels import conv as K
from ..kernels.launch import grid_1d
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
