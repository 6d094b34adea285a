"""Lowering of the ops of ir/ops_vision.py. conv, conv_transpose and conv_wgrad: one cuDNN call
(tier 0, cudnn.py), where ``conv_tier0`` allows it; elsewhere the compiler has rewritten them
as im2col / col2im and products (the matmul ladder: cuBLAS on a GPU, the numba SGEMM in the
simulator). im2col, col2im (kernels/conv.py), pool and pool_grad (kernels/pool.py): one
kernel each, made for the node's kernel size, stride and dilation, its threads along lines of
the output (kernels/conv.py), the rest of the geometry a small uint64 device array; resample
(kernels/resample.py) and channel_affine (kernels/channel.py) run along lines too."""
from __future__ import annotations

import math
import os

import numpy as np

from .. import cublas, cudnn
from ..device import SIMULATOR
from ..ir.ops import fmt
from ..kernels import channel as C
from ..kernels import conv as K
from ..kernels import pool as P
from ..kernels import resample as R
from . import lower
from .lower import CallStep, Step, lowering, step_name


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
    return _step(exe, n, K.im2col_kernel(*_consts(n.attrs)), (np.uint64(nc),), [x], "im2col",
                 (nc,) + _3d(n.attrs, "cols", 1))


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


@lowering("channel_affine")
def _lower_channel_affine(exe, n):
    if n.size == 0:
        return []
    x, center, scale, shift = n.inputs
    rows = n.shape[0] * n.shape[1]
    length = n.size // rows
    grid, block = K.lines_launch(rows, length)
    return [Step(step_name(n), f"channel affine of {fmt(n.shape)}", C.channel_affine_kernel,
                 grid, block, (exe.buf(n), exe.buf(x), exe.buf(center), exe.buf(scale),
                               exe.buf(shift), np.uint64(rows), np.uint64(n.shape[1]),
                               np.uint64(length)), {"bytes": 2 * n.nbytes})]


@lowering("resample")
def _lower_resample(exe, n):
    if n.size == 0:
        return []
    a, x = n.attrs, exe.graph.nodes[n.inputs[0]]
    ax = a["axis"]
    idx, w = a["idx"], a["w"]
    olen, taps = idx.shape
    inner = math.prod(n.shape[ax + 1:])
    rows = math.prod(n.shape[:ax])
    u = np.uint64
    tables = (exe.device_array(idx.reshape(-1)), exe.device_array(w.reshape(-1)),
              exe.device_array(a["const"]))
    if inner == 1:
        grid, block = K.lines_launch(rows, olen)
        kern, sizes = R.resample_last_kernel, (u(rows), u(olen), u(x.shape[ax]), u(taps))
    else:
        grid, block = K.lines_launch(rows * olen, inner)
        kern, sizes = R.resample_kernel, (u(rows), u(olen), u(x.shape[ax]), u(inner), u(taps))
    return [Step(step_name(n), f"resample axis {ax} {x.shape[ax]} -> {olen} ({taps} taps) of "
                 f"{fmt(x.shape)}", kern, grid, block,
                 (exe.buf(n), exe.buf(x)) + tables + sizes, {"bytes": n.nbytes + x.nbytes})]


# ---- the convolutions: cuDNN (tier 0), or im2col / col2im and products -----------------------
def conv_tier0(graph, n) -> tuple[bool, str]:
    """Whether cuDNN runs conv-family node ``n`` (else the compiler rewrites it as im2col /
    col2im and products, ir/ops_vision.py expand_conv), and why not."""
    if SIMULATOR:
        return False, "the simulator has no cuDNN"
    tiers = os.environ.get("RLX_NUMBA_CONV_TIERS")
    if tiers and "0" not in tiers.replace(" ", "").split(","):
        return False, "tier 0 not allowed by RLX_NUMBA_CONV_TIERS"
    image, cols = _conv_shapes(graph, n)
    a = n.attrs
    if (all(v == 1 for v in a["kernel"] + a["stride"]) and not any(a["pad"])
            and image[2:] == cols[2:]):
        return False, ("a 1x1 convolution is one batched product, no im2col (cuBLAS: 25.7 us "
                       "against cuDNN's 45.4 for 8x256x56x56 -> 64 on an H200)")
    for s, o, k, st, p, dl in zip(image[2:], cols[2:], a["kernel"], a["stride"], a["pad"],
                                  a["dilation"]):
        if (s + 2 * p - dl * (k - 1) - 1) // st + 1 != o:
            return False, (f"cuDNN pads both sides alike: image {fmt(image[2:])} with padding "
                           f"{fmt(a['pad'])} on both sides does not give {fmt(cols[2:])}")
    ok, why = cudnn.available()
    return ok, f"tier 0: {why}" if why else ""


def _conv_shapes(graph, n):
    """(image [N, C, *S], cols [N, K, *O]) of a conv-family node in the forward conv's terms."""
    a, b = (graph.nodes[i].shape for i in n.inputs[:2])
    return {"conv": (a, n.shape), "conv_transpose": (n.shape, a), "conv_wgrad": (a, b)}[n.op]


def log_conv_tier(n, tier0, why) -> None:
    if os.environ.get("RLX_NUMBA_LOG_FALLBACK") == "1":
        lower.log.warning("%s %%%d: conv tier %s%s", n.op, n.id,
                          "0 (cuDNN)" if tier0 else "1 (im2col / col2im and the matmul ladder)",
                          "" if tier0 else f"; {why}")


@lowering("conv", "conv_transpose", "conv_wgrad")
def _lower_conv(exe, n):
    """One cuDNN call (the compiler left this node to tier 0)."""
    if n.size == 0:
        return []
    g, a = exe.graph, n.attrs
    image, cols = _conv_shapes(g, n)
    w_shape = n.shape if n.op == "conv_wgrad" else g.nodes[n.inputs[1]].shape
    kind, x, w, y = {
        "conv": ("fwd", n.inputs[0], n.inputs[1], n.id),
        "conv_transpose": ("bwd_data", n.id, n.inputs[1], n.inputs[0]),
        "conv_wgrad": ("bwd_filter", n.inputs[0], n.id, n.inputs[1]),
    }[n.op]
    ptr = lambda i: exe.buf(i).device_ctypes_pointer.value     # noqa: E731
    tf32 = cublas.allow_tf32
    epi = {}                  # passes/fusion.py's conv epilogue: relu(conv + bias (+ z))
    if a.get("has_bias"):
        epi["bias_ptr"] = ptr(n.inputs[2])
        if a.get("has_residual"):
            epi["z_ptr"] = ptr(n.inputs[3])
    make = lambda stream: cudnn.conv_plan(  # noqa: E731
        stream, kind, image, w_shape, cols, a["pad"], a["stride"], a["dilation"], a["groups"],
        ptr(x), ptr(w), ptr(y), tf32, **epi)
    flops = 2 * math.prod(cols) * math.prod(w_shape[1:])
    tags = " +bias" * bool(epi) + " +z" * ("z_ptr" in epi) + " relu" * bool(epi)
    return [CallStep(step_name(n), f"cudnn {kind}{tags} {'x'.join(map(str, a['kernel']))} of "
                     f"{fmt(image)} -> {fmt(cols)}", make, {"flops": flops, "tier": 0})]
