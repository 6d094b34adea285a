"""Lowering of im2col, col2im (kernels/conv.py), pool and pool_grad (kernels/pool.py) and
resample (kernels/resample.py), the ops of ir/ops_vision.py. The first four: one kernel each,
made for the node's kernel size, stride and dilation, its threads along lines of the output
(kernels/conv.py), the rest of the geometry a small uint64 device array."""
from __future__ import annotations

import math

import numpy as np

from ..ir.ops import fmt
from ..kernels import conv as K
from ..kernels import pool as P
from ..kernels import resample as R
from ..kernels.launch import grid_1d
from .lower import Step, lowering, step_name


def _3d(a, key, unit):
    return (unit,) * (3 - len(a["kernel"])) + tuple(a[key])


def _consts(a):
    """(kernel, stride, dilation) as 3-d: the kernels' compile-time constants."""
    return _3d(a, "kernel", 1), _3d(a, "stride", 1), _3d(a, "dilation", 1)


def _geo(exe, a):
    """kernel, cols spatial, image spatial, stride, pad, dilation as 3-d (unit dims in front)."""
    vals = [v for key, unit in (("kernel", 1), ("cols", 1), ("image", 1), ("stride", 1),
                                ("pad", 0), ("dilation", 1)) for v in _3d(a, key, unit)]
    return exe.device_array(np.array(vals, np.uint64))


def _step(exe, n, kern, args, src_nodes, what, line_shape):
    """One Step over the lines of ``line_shape`` (its last dim along a line)."""
    if n.size == 0:
        return []
    a = n.attrs
    grid, block = K.lines_launch(math.prod(line_shape[:-1]), line_shape[-1])
    return [Step(step_name(n), f"{what} {'x'.join(map(str, a['kernel']))} of "
                 f"{fmt(exe.graph.nodes[n.inputs[0]].shape)}", kern, grid, block,
                 (exe.buf(n),) + tuple(exe.buf(s) for s in src_nodes) + args + (_geo(exe, a),),
                 {"bytes": n.nbytes + sum(s.nbytes for s in src_nodes)})]


@lowering("im2col")
def _lower_im2col(exe, n):
    x = exe.graph.nodes[n.inputs[0]]
    nc = x.shape[0] * x.shape[1]
    kk = math.prod(n.attrs["kernel"])
    return _step(exe, n, K.im2col_kernel(*_consts(n.attrs)), (np.uint64(nc),), [x], "im2col",
                 (nc * kk,) + _3d(n.attrs, "cols", 1))


@lowering("col2im")
def _lower_col2im(exe, n):
    cols = exe.graph.nodes[n.inputs[0]]
    nc = n.shape[0] * n.shape[1]
    return _step(exe, n, K.col2im_kernel(*_consts(n.attrs)), (np.uint64(nc),), [cols], "col2im",
                 (nc,) + _3d(n.attrs, "image", 1))


@lowering("pool")
def _lower_pool(exe, n):
    a, x = n.attrs, exe.graph.nodes[n.inputs[0]]
    nc = n.shape[0] * n.shape[1]
    kern = P.pool_kernel(*_consts(a), a["kind"] == "max", a["count_include_pad"])
    return _step(exe, n, kern, (np.uint64(nc),), [x], f"{a['kind']} pool",
                 (nc,) + _3d(a, "cols", 1))


@lowering("pool_grad")
def _lower_pool_grad(exe, n):
    a = n.attrs
    x, dy = (exe.graph.nodes[i] for i in n.inputs)
    nc = n.shape[0] * n.shape[1]
    kern = P.pool_grad_kernel(*_consts(a), a["kind"] == "max", a["count_include_pad"])
    return _step(exe, n, kern, (np.uint64(nc),), [x, dy], f"{a['kind']} pool grad",
                 (nc,) + _3d(a, "image", 1))


@lowering("resample")
def _lower_resample(exe, n):
    if n.size == 0:
        return []
    a, x = n.attrs, exe.graph.nodes[n.inputs[0]]
    ax = a["axis"]
    idx, w = a["idx"], a["w"]
    olen, taps = idx.shape
    inner = math.prod(n.shape[ax + 1:])
    grid, block = grid_1d(n.size)
    u = np.uint64
    return [Step(step_name(n), f"resample axis {ax} {x.shape[ax]} -> {olen} ({taps} taps) of "
                 f"{fmt(x.shape)}", R.resample_kernel, (grid,), (block,),
                 (exe.buf(n), exe.buf(x), exe.device_array(idx.reshape(-1)),
                  exe.device_array(w.reshape(-1)), exe.device_array(a["const"]), u(n.size),
                  u(olen), u(x.shape[ax]), u(inner), u(taps)),
                 {"bytes": n.nbytes + x.nbytes})]
