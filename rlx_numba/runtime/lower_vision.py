"""Lowering of the ops of ir/ops_vision.py. conv, conv_transpose and conv_wgrad: one cuDNN call
(tier 0, cudnn.py) where ``conv_tier`` says 0; elsewhere the compiler has rewritten them as
im2col / col2im and products (tier 1, the matmul ladder) or as an implicit_gemm node (tier 2,
the numba kernel); a channels-last conv is one cuDNN NHWC call on tier 0 and two transposes
around the channels-first rewrite on the others (ir/ops_vision.py channels_first_rewrite).
im2col, col2im (kernels/conv.py), pool and pool_grad (kernels/pool.py): one
kernel each, made for the node's kernel size, stride and dilation, its threads along lines of
the output (kernels/conv.py), the rest of the geometry a small uint64 device array; resample
(kernels/resample.py) and channel_affine (kernels/channel.py) run along lines too. Every kernel
is made for its data's storage kind (kernels/halfio.py): f16 / bf16 load as f32, the math is
f32, the result is stored in the node's dtype."""
from __future__ import annotations

import math
import os

import numpy as np

from .. import cublas, cudnn
from ..device import SIMULATOR
from ..ir import dtypes as dt
from ..ir.opdef import Tier, add_tier, set_chooser
from ..ir.ops import fmt
from ..ir.ops_vision import (CONV_OPS, channels_first_rewrite, expand_conv, half_product,
                             implicit_gemm, to_first)
from ..kernels import channel as C
from ..kernels import halfio
from ..kernels import conv as K
from ..kernels import matmul as mm
from ..kernels import pool as P
from ..kernels import resample as R
from . import lower
from .lower import CallStep, Step, lowering, step_name


def _3d(a, key, unit):
    return (unit,) * (3 - len(a["kernel"])) + tuple(a[key])


def _consts(a):
    """(kernel, stride, dilation) as 3-d: the kernels' compile-time constants."""
    return _3d(a, "kernel", 1), _3d(a, "stride", 1), _3d(a, "dilation", 1)


def _geo(ctx, a):
    """kernel, cols spatial, image spatial, stride, pad, dilation as 3-d (unit dims in front)."""
    vals = [v for key, unit in (("kernel", 1), ("cols", 1), ("image", 1), ("stride", 1),
                                ("pad", 0), ("dilation", 1)) for v in _3d(a, key, unit)]
    return ctx.device_array(np.array(vals, np.uint64))


def _step(ctx, n, kern, args, src_nodes, what, line_shape):
    """One Step over the lines of ``line_shape`` (its last dim along a line)."""
    if n.size == 0:
        return []
    a = n.attrs
    grid, block = K.lines_launch(math.prod(line_shape[:-1]), line_shape[-1])
    return [Step(step_name(n), f"{what} {'x'.join(map(str, a['kernel']))} of "
                 f"{fmt(ctx.graph.nodes[n.inputs[0]].shape)}", kern, grid, block,
                 (ctx.buf(n),) + tuple(ctx.buf(s) for s in src_nodes) + args + (_geo(ctx, a),),
                 {"bytes": n.nbytes + sum(s.nbytes for s in src_nodes)})]


@lowering("im2col")
def _lower_im2col(ctx, n):
    x = ctx.graph.nodes[n.inputs[0]]
    nc = x.shape[0] * x.shape[1]
    return _step(ctx, n, K.im2col_kernel(*_consts(n.attrs), halfio.io_kind(n.dtype)),
                 (np.uint64(nc),), [x], "im2col",
                 (nc,) + _3d(n.attrs, "cols", 1))


@lowering("col2im")
def _lower_col2im(ctx, n):
    cols = ctx.graph.nodes[n.inputs[0]]
    nc = n.shape[0] * n.shape[1]
    return _step(ctx, n, K.col2im_kernel(*_consts(n.attrs), halfio.io_kind(n.dtype)),
                 (np.uint64(nc),), [cols], "col2im",
                 (nc,) + _3d(n.attrs, "image", 1))


@lowering("pool")
def _lower_pool(ctx, n):
    a, x = n.attrs, ctx.graph.nodes[n.inputs[0]]
    if a.get("channels_last"):      # a line: one output position's channels
        kern = P.pool_nhwc_kernel(*_consts(a), a["kind"] == "max", a["count_include_pad"],
                                  halfio.io_kind(n.dtype))
        lines, c = n.size // n.shape[-1], n.shape[-1]
        return _step(ctx, n, kern, (np.uint64(lines), np.uint64(c)), [x],
                     f"{a['kind']} pool NHWC", (lines, c))
    nc = n.shape[0] * n.shape[1]
    kern = P.pool_kernel(*_consts(a), a["kind"] == "max", a["count_include_pad"],
                         halfio.io_kind(n.dtype))
    cols = _3d(a, "cols", 1)
    lines = -(-nc * cols[0] * cols[1] // P.GROUP)
    return _step(ctx, n, kern, (np.uint64(nc),), [x], f"{a['kind']} pool", (lines, cols[2]))


@lowering("pool_grad")
def _lower_pool_grad(ctx, n):
    a = n.attrs
    x, dy = (ctx.graph.nodes[i] for i in n.inputs)
    nc = n.shape[0] * n.shape[1]
    kern = P.pool_grad_kernel(*_consts(a), a["kind"] == "max", a["count_include_pad"],
                              halfio.io_kind(n.dtype))
    return _step(ctx, n, kern, (np.uint64(nc),), [x, dy], f"{a['kind']} pool grad",
                 (nc,) + _3d(a, "image", 1))


@lowering("channel_affine")
def _lower_channel_affine(ctx, n):
    if n.size == 0:
        return []
    x, center, scale, shift = n.inputs[:4]
    rows = n.shape[0] * n.shape[1]
    length = n.size // rows
    grid, block = K.lines_launch(rows, length)
    kinds = halfio.io_kind(n.dtype), halfio.io_kind(ctx.graph.nodes[center].dtype)
    with_var = len(n.inputs) == 5                # batch_norm's: scale / sqrt(var + eps)
    var = ctx.buf(n.inputs[4] if with_var else center)
    kern = C.channel_affine_kernel(*kinds, with_var)
    return [Step(step_name(n), f"channel affine of {fmt(n.shape)}", kern, grid, block,
                 (ctx.buf(n), ctx.buf(x), ctx.buf(center), ctx.buf(scale), ctx.buf(shift), var,
                  np.float32(n.attrs.get("eps", 0.0)), np.uint64(rows), np.uint64(n.shape[1]),
                  np.uint64(length)),
                 {"bytes": 2 * n.nbytes})]


@lowering("resample")
def _lower_resample(ctx, n):
    if n.size == 0:
        return []
    a, x = n.attrs, ctx.graph.nodes[n.inputs[0]]
    ax = a["axis"]
    idx, w = a["idx"], a["w"]
    olen, taps = idx.shape
    inner = math.prod(n.shape[ax + 1:])
    rows = math.prod(n.shape[:ax])
    kind, okind = halfio.io_kind(x.dtype), halfio.io_kind(n.dtype)   # (f32 intermediates)
    u = np.uint64
    table = lambda i, w, c: (ctx.device_array(i.reshape(-1)),  # noqa: E731
                             ctx.device_array(w.reshape(-1)), ctx.device_array(c))
    tables = table(idx, w, a["const"])
    what = f"{x.shape[ax]} -> {olen} ({taps} taps)"
    if "idx2" in a:
        olen2, taps2 = a["idx2"].shape
        grid, block = K.lines_launch(-(-rows * olen // R.GROUP), olen2)
        kern = R.resample2_kernel(taps, taps2, kind, okind)
        tables += table(a["idx2"], a["w2"], a["const2"])
        sizes = (u(rows), u(olen), u(x.shape[ax]), u(olen2), u(x.shape[ax + 1]))
        what = (f"axes {ax}, {ax + 1} {fmt(x.shape[ax:])} -> {fmt(n.shape[ax:])} "
                f"({taps}x{taps2} taps)")
    elif inner == 1:
        grid, block = K.lines_launch(rows, olen)
        kern, sizes = (R.resample_last_kernel(taps, kind, okind),
                       (u(rows), u(olen), u(x.shape[ax])))
        what = f"axis {ax} {what}"
    else:
        grid, block = K.lines_launch(rows * olen, inner, split=True)
        kern, sizes = (R.resample_kernel(taps, kind, okind),
                       (u(rows), u(olen), u(x.shape[ax]), u(inner)))
        what = f"axis {ax} {what}"
    return [Step(step_name(n), f"resample {what} of {fmt(x.shape)}", kern, grid, block,
                 (ctx.buf(n), ctx.buf(x)) + tables + sizes, {"bytes": n.nbytes + x.nbytes})]


# ---- the convolutions: the tier ladder ------------------------------------------------------
#   0  cuDNN (cudnn.py): this module's lowering of conv / conv_transpose / conv_wgrad;
#   1  im2col / col2im and the matmul ladder: the compiler rewrites the node
#      (ir/ops_vision.py expand_conv);
#   2  the numba implicit-GEMM kernels (kernels/conv.py): the compiler rewrites conv and
#      conv_transpose into an "implicit_gemm" node; the weight gradient takes tier 1 there
#      (im2col and the product of the matmul ladder).
# The simulator runs tier 2 (tier 1 for a 1x1 convolution, which needs no im2col).

def _tiers() -> set:
    return lower.env_tiers("RLX_NUMBA_CONV_TIERS", {0: "cuDNN", 1: "im2col + matmul ladder",
                                                    2: "numba implicit GEMM"})


def conv_tier(graph, n) -> tuple[int, str]:
    """(tier, why not a lower one) for conv-family node ``n``: 0 cuDNN, 1 im2col / col2im and
    products, 2 the numba implicit-GEMM kernel."""
    tiers, why = _tiers(), []
    image, cols = _conv_shapes(graph, n)
    a = n.attrs
    # channels last: cuDNN takes it as it is (NHWC descriptors); the products of tier 1 and the
    # numba kernel read channels first, so those tiers add two transposes around it
    cl = a.get("channels_last", False)
    one_by_one = (all(v == 1 for v in a["kernel"] + a["stride"]) and not any(a["pad"])
                  and image[2:] == cols[2:] and not cl)
    # a strided 1x1 (a ResNet's downsample) in half: im2col is the subsampled image
    strided_1x1 = (n.op == "conv" and n.dtype != dt.F32 and all(v == 1 for v in a["kernel"])
                   and not any(a["pad"]) and not one_by_one and not cl)
    # tier 1 in half needs matmul in half (else its product is f32 between two casts: the
    # numba kernel, tier 2, reads half directly); the weight gradient has no tier 2
    gemm = half_product(n.dtype)
    if 0 not in tiers:
        why.append("tier 0 not allowed by RLX_NUMBA_CONV_TIERS")
    elif SIMULATOR:
        why.append("the simulator has no cuDNN")
    elif one_by_one and 1 in tiers and gemm:
        why.append("a 1x1 convolution is one batched product, no im2col (cuBLAS: 25.7 us "
                   "against cuDNN's 45.4 for 8x256x56x56 -> 64 on an H200)")
    elif strided_1x1 and 1 in tiers and gemm:
        why.append("a strided 1x1 convolution in half is a subsampling im2col and one "
                   "batched product (cuDNN's NCHW bf16 took 285 us for 32x256x56x56 -> 512, "
                   "stride 2, on an H200: 23 TFLOP/s)")
    else:
        for s, o, k, st, p, dl in zip(image[2:], cols[2:], a["kernel"], a["stride"], a["pad"],
                                      a["dilation"]):
            if (s + 2 * p - dl * (k - 1) - 1) // st + 1 != o:
                why.append(f"cuDNN pads both sides alike: image {fmt(image[2:])} with padding "
                           f"{fmt(a['pad'])} on both sides does not give {fmt(cols[2:])}")
                break
        else:
            ok, err = cudnn.available()
            if ok:
                return 0, ""
            why.append(f"tier 0: {err}")
    if n.op == "conv_wgrad" or 2 not in tiers:
        if 1 not in tiers:
            why.append("the weight gradient has no tier-2 kernel" if n.op == "conv_wgrad"
                       else "tier 2 not allowed by RLX_NUMBA_CONV_TIERS")
        return 1, "; ".join(why)
    if 1 in tiers and gemm and (one_by_one or not SIMULATOR and cublas.available()[0]):
        return 1, "; ".join(why)
    why.append("tier 1 not allowed by RLX_NUMBA_CONV_TIERS" if 1 not in tiers
               else f"tier 1: matmul takes no {n.dtype} operands yet" if not gemm
               else "no cuBLAS for tier 1's product" if not SIMULATOR
               else "the simulator runs the numba kernel")
    return 2, "; ".join(why)


def _conv_shapes(graph, n):
    """(image [N, C, *S], cols [N, K, *O]) of a conv-family node in the forward conv's terms
    (channels-first order for a channels-last node too)."""
    a, b = (graph.nodes[i].shape for i in n.inputs[:2])
    image, cols = {"conv": (a, n.shape), "conv_transpose": (n.shape, a), "conv_wgrad": (a, b)}[n.op]
    if n.attrs.get("channels_last"):
        image, cols = (tuple(s[i] for i in to_first(len(s))) for s in (image, cols))
    return image, cols


@lowering("implicit_gemm")
def _lower_implicit_gemm(ctx, n):
    """Tier 2: one kernels/conv.py conv_gemm_kernel launch, with passes/fusion.py's conv
    epilogue relu(conv + bias (+ z)) where the node carries one (its inputs 2 and 3)."""
    if n.size == 0:
        return []
    g, a = ctx.graph, n.attrs
    src, w = (g.nodes[i] for i in n.inputs[:2])
    transposed = a["of"] == "conv_transpose"
    image, cols = (n.shape, src.shape) if transposed else (src.shape, n.shape)
    groups, taps = a["groups"], math.prod(a["kernel"])
    batch = image[0] * groups
    if transposed:     # img[nn, g] [Cg, S] = w[g]^T [Cg, Kg taps] @ z gathered
        kg = cols[1] // groups
        m, ncols, kdim = w.shape[1], math.prod(image[2:]), kg * taps
        a_off = [(z % groups) * kg * m * taps for z in range(batch)]
        b_off = [(z // groups * cols[1] + z % groups * kg) * math.prod(cols[2:])
                 for z in range(batch)]
    else:              # y[nn, g] [Kg, L] = w[g] [Kg, Cg taps] @ image gathered
        cg = image[1] // groups
        m, ncols, kdim = cols[1] // groups, math.prod(cols[2:]), cg * taps
        a_off = [(z % groups) * m * kdim for z in range(batch)]
        b_off = [(z // groups * image[1] + z % groups * cg) * math.prod(image[2:])
                 for z in range(batch)]
    bias, res = a.get("has_bias", False), a.get("has_residual", False)
    relu = a.get("activation") == "relu"
    kern = K.conv_gemm_kernel(*_consts(a), transposed, halfio.io_kind(n.dtype), bias, res, relu)
    grid, block = mm.sgemm_launch(m, ncols, batch)
    geo = dict(a, image=image[2:], cols=cols[2:])
    out, epi = ctx.buf(n), ()
    if bias or res or relu:      # bias, z (the output where absent), plane, channels
        extra = [ctx.buf(i) for i in n.inputs[2:]]
        epi = (extra.pop(0) if bias else out, extra.pop(0) if res else out,
               np.uint64(math.prod(n.shape[2:])), np.uint64(n.shape[1]))
    tags = " +bias" * bias + " +z" * res + " relu" * relu
    return [Step(step_name(n), f"numba implicit-GEMM {a['of']}{tags} "
                 f"{'x'.join(map(str, a['kernel']))} of {fmt(src.shape)} -> {fmt(n.shape)}",
                 kern, grid, block,
                 (out, ctx.buf(w), ctx.buf(src), np.uint64(m), np.uint64(ncols),
                  np.uint64(kdim), ctx.device_array(np.array(a_off, np.int64)),
                  ctx.device_array(np.array(b_off, np.int64)), np.uint64(batch),
                  _geo(ctx, geo)) + epi,
                 {"flops": 2 * batch * m * ncols * kdim, "tier": 2})]


@lowering(*CONV_OPS, tier="cuDNN")
def _lower_conv(ctx, n):
    """One cuDNN call (the compiler left this node to tier 0)."""
    if n.size == 0:
        return []
    g, a = ctx.graph, n.attrs
    image, cols = _conv_shapes(g, n)
    w_shape = n.shape if n.op == "conv_wgrad" else g.nodes[n.inputs[1]].shape
    cl = a.get("channels_last", False)
    if cl:            # KRSC in memory; cuDNN's filter dims are [K, C, *k] whatever the format
        w_shape = tuple(w_shape[i] for i in to_first(len(w_shape)))
    kind, x, w, y = {
        "conv": ("fwd", n.inputs[0], n.inputs[1], n.id),
        "conv_transpose": ("bwd_data", n.id, n.inputs[1], n.inputs[0]),
        "conv_wgrad": ("bwd_filter", n.inputs[0], n.id, n.inputs[1]),
    }[n.op]
    ptr = lambda i: ctx.buf(i).device_ctypes_pointer.value     # noqa: E731
    tf32 = cublas.allow_tf32
    epi = {}                  # passes/fusion.py's conv epilogue: relu(conv + bias (+ z))
    if a.get("has_bias"):
        epi["bias_ptr"] = ptr(n.inputs[2])
        if a.get("has_residual"):
            epi["z_ptr"] = ptr(n.inputs[3])
    make = lambda stream: cudnn.conv_plan(  # noqa: E731
        stream, kind, image, w_shape, cols, a["pad"], a["stride"], a["dilation"], a["groups"],
        ptr(x), ptr(w), ptr(y), tf32, dtype=halfio.io_kind(n.dtype), channels_last=cl, **epi)
    flops = 2 * math.prod(cols) * math.prod(w_shape[1:])
    tags = (" +bias" * bool(epi) + " +z" * ("z_ptr" in epi) + " relu" * bool(epi)
            + " NHWC" * cl)
    return [CallStep(step_name(n), f"cudnn {kind}{tags} {'x'.join(map(str, a['kernel']))} of "
                     f"{fmt(image)} -> {fmt(cols)}", make, {"flops": flops, "tier": 0})]


for _op in CONV_OPS:    # tiers 1 and 2 rewrite the node at legalise (compiler.py)
    add_tier(_op, Tier("im2col / col2im and the matmul ladder", None,
                       rewrite=channels_first_rewrite(expand_conv)))
    add_tier(_op, Tier("the numba implicit-GEMM kernel", None,
                       rewrite=channels_first_rewrite(implicit_gemm)))
    set_chooser(_op, conv_tier, "RLX_NUMBA_CONV_TIERS")
