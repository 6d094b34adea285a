"""Vision ops (NCHW, PyTorch's semantics), 1/2/3-d: conv, conv_transpose, pool, the norms
(batch_norm, group_norm, layer_norm2d: compositions of graph ops), pad, resize and
adaptive_avg_pool (one "resample" node an axis, below).

conv and conv_transpose (the spatial rank is the weight's) are nodes of their own, as is the
weight gradient conv_wgrad; the VJPs map each to the others. The compiler leaves them to cuDNN
(tier 0) or rewrites them (``expand_conv``) with two data-movement ops and the matmul ladder:

  im2col  x [N, C, *S] -> cols [N, G, C/G * prod(k), prod(O)]: cols[n, g, (c, kidx), o] =
          x[n, g*C/G + c, o*stride - pad + kidx*dilation] (zero outside x)
  col2im  its adjoint: cols -> image [N, C, *S], every window's contributions summed (a
          gather: each image element reads the cols entries that map to it, no atomics)

conv is im2col, then w [G, Cout/G, C/G * prod(k)] @ cols (a batched product: cuBLAS on a GPU,
the numba SGEMM in the simulator); conv_transpose is w^T @ x and col2im; conv_wgrad is the sum
over the batch of dy @ cols^T. Bias is a broadcast add after the node.
Kernels: kernels/conv.py; lowering: runtime/lower_vision.py.

Channels last (``channels_last=True`` on conv, pool and adaptive_avg_pool): x [N, *S, C], y
[N, *O, K], conv's weight [K, *k, C/groups] (cuDNN's KRSC). A 1x1 conv (stride dividing the
size, no padding, one group) is built as a product ([N*O, C] @ w^T + bias: ``linear``, whose
bias / relu / residual epilogues cuBLASLt fuses); any other is a conv node with
``channels_last`` set, which cuDNN runs as NHWC and the other tiers as transposes around the
channels-first rewrite (``channels_first_rewrite``); its VJP is the channels-first one between
transposes. pool has a channels-last kernel (kernels/pool.py; its gradient transposes around
the channels-first one); adaptive_avg_pool resamples the spatial axes where they are.

Every op here takes f32, f16 or bf16 (dtype rule "f32": loads widen, math and sums in f32, one
rounding to the result, which is in x's dtype). conv's x and w (and conv_wgrad's x and dy) must
share one dtype, and bias is in it too, as torch requires; batch norm's per-channel operands
are f32 or x's dtype (torch's cuDNN batch norm takes f32 statistics with half x).
"""
from __future__ import annotations

import dataclasses
import math
import operator

import numpy as np

from . import dtypes as dt
from .autodiff import vjp
from .opdef import F32, F32_ONLY, defop, opdef
from .ops import fmt


def _desc(t) -> str:
    return f"{t.dtype} {fmt(t.shape)}"


def to_first(rank):
    """The permutation taking a channels-last tensor of ``rank`` dims to channels first."""
    return (0, rank - 1) + tuple(range(1, rank - 1))


def to_last(rank):
    """The permutation taking a channels-first tensor of ``rank`` dims to channels last."""
    return (0,) + tuple(range(2, rank)) + (1,)


def _first(shape):
    """A channels-last shape [N, *S, C] in channels-first order [N, C, *S]."""
    return tuple(shape[i] for i in to_first(len(shape)))


def _last(shape):
    return tuple(shape[i] for i in to_last(len(shape)))


def _channels_last(op, v):
    if not isinstance(v, bool):
        raise ValueError(f"{op}: channels_last must be True or False, got {v!r}")
    return v


# The vision ops take f32, f16 and bf16 (kernels load through kernels/halfio.py: math and
# accumulation in f32, one rounding to the result, which is in x's dtype, as torch's).
FLOATS = (dt.F32, dt.F16, dt.BF16)


def _float(op, arg, t, want=""):
    if t.dtype not in FLOATS:
        raise ValueError(f"{op}: {arg} must be f32, f16 or bf16{want}, got {_desc(t)}")


def _same_float(op, pairs):
    """Every (arg, tensor) of ``pairs`` one float dtype (torch's rule for conv: no promotion)."""
    (a0, t0), rest = pairs[0], pairs[1:]
    _float(op, a0, t0)
    for arg, t in rest:
        if t.dtype != t0.dtype:
            raise ValueError(f"{op}: {arg} must have {a0}'s dtype {t0.dtype} (no promotion, as "
                             f"torch), got {arg} {_desc(t)} and {a0} {_desc(t0)}")


def _ints(op, arg, v, d, lo):
    """``v`` (an int or a sequence of d ints, each >= lo) as a d-tuple, or ValueError."""
    vals = (v,) * d if not isinstance(v, (tuple, list)) else tuple(v)
    try:
        out = tuple(operator.index(x) for x in vals if not isinstance(x, bool))
    except TypeError:
        out = ()
    if len(out) != d or len(vals) != d or any(x < lo for x in out):
        raise ValueError(f"{op}: {arg} must be an int >= {lo} or {d} of them, got {v!r}")
    return out


def _geometry(op, x, w, n_spatial_w, cl=False):
    """(d, batched, x as [N, C, *S]) for weight ``w`` of rank d + 2; x is [N, C, *S] or
    unbatched [C, *S] ([N, *S, C] or [*S, C] channels last: ``cl``)."""
    d = n_spatial_w
    if d not in (1, 2, 3):
        dims = "*kernel, in" if cl else "in, *kernel"
        raise ValueError(f"{op}: w must be 3-, 4- or 5-D ([out, {dims}] for 1/2/3 spatial "
                         f"dims), got {_desc(w)}")
    if len(x.shape) not in (d + 1, d + 2):
        want = "[N, *spatial, C] or [*spatial, C]" if cl else "[N, C, *spatial] or [C, *spatial]"
        raise ValueError(f"{op}: x must be {want} with {d} spatial "
                         f"dims for w {_desc(w)}, got {_desc(x)}")
    _same_float(op, (("x", x), ("w", w)))
    return d, len(x.shape) == d + 2


def _conv_input(g, op, x, w, cl=False):
    """(spatial rank, whether x is batched, x batched) of a conv or conv_transpose."""
    g.check(op, "x", x)
    g.check(op, "w", w)
    d, batched = _geometry(op, x, w, len(w.shape) - 2, cl)
    return d, batched, x if batched else g.reshape(x, (1,) + tuple(x.shape))


def _eps(op, eps):
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps < 0:
        raise ValueError(f"{op}: eps must be a number >= 0, got {eps!r}")


def _check_bias(g, op, bias, cout, dtype):
    g.check(op, "bias", bias)
    if tuple(bias.shape) != (cout,) or bias.dtype != dtype:     # torch's rule: x's dtype
        raise ValueError(f"{op}: bias must be {dtype} [{cout}] (one per output channel), got "
                         f"{_desc(bias)} (bias takes x's dtype, as torch's {op})")


def _bias(g, op, bias, cout, y, d, cl=False):
    if bias is None:
        return y
    _check_bias(g, op, bias, cout, y.dtype)
    # channels last: the bias broadcasts along the last (channel) axis as it is
    return g.add(y, bias if cl else g.reshape(bias, (cout,) + (1,) * d))


# ---- inference (ir/opdef.py) -----------------------------------------------------------------
# A conv-family node relates an image [N, C, *S] and its cols [N, K, *O] through
#   S + pad + pad_hi - span = (O - 1) * stride,  span = dilation * (kernel - 1) + 1,
# conv flooring O (the image's last rows no window reaches), conv_transpose giving S exactly.
# pad_hi is the high side's padding: pad's but for padding="same" with an odd total, and
# pad - output_padding for conv_transpose (negative: rows past the last window).

def _span(a):
    return tuple(dl * (k - 1) + 1 for dl, k in zip(a["dilation"], a["kernel"]))


def _conv_operands(op, x, w, kernel):
    d = len(kernel)
    if len(w.shape) != d + 2 or tuple(w.shape[2:]) != tuple(kernel):
        raise ValueError(f"{op}: w {_desc(w)} must be [*, *, *kernel] with kernel {fmt(kernel)}")
    if len(x.shape) != d + 2:
        raise ValueError(f"{op}: x must be [N, C, *spatial] with {d} spatial dims for w "
                         f"{_desc(w)}, got {_desc(x)}")
    _same_float(op, (("x", x), ("w", w)))


def infer_conv(x, w, **a):
    """[N, K, *O] from x [N, C, *S] and w [K, C/groups, *k]; with ``channels_last`` [N, *O, K]
    from x [N, *S, C] and w [K, *k, C/groups]."""
    op, cl = "conv", a.get("channels_last", False)
    if cl:
        d = len(a["kernel"])
        if len(w.shape) != d + 2 or tuple(w.shape[1:-1]) != tuple(a["kernel"]):
            raise ValueError(f"{op}: w {_desc(w)} must be [*, *kernel, *] (channels last) with "
                             f"kernel {fmt(a['kernel'])}")
        if len(x.shape) != d + 2:
            raise ValueError(f"{op}: x must be [N, *spatial, C] (channels last) with {d} "
                             f"spatial dims for w {_desc(w)}, got {_desc(x)}")
        _same_float(op, (("x", x), ("w", w)))
        xs, ws = _first(x.shape), _first(w.shape)
    else:
        _conv_operands(op, x, w, a["kernel"])
        xs, ws = x.shape, w.shape
    n, c, size = xs[0], xs[1], tuple(xs[2:])
    cout, cg, groups = ws[0], ws[1], a["groups"]
    if c % groups or cout % groups:
        raise ValueError(f"{op}: channels must divide into groups={groups}: x {_desc(x)} has "
                         f"{c} in, w {_desc(w)} has {cout} out")
    if cg != c // groups:
        raise ValueError(f"{op}: w {_desc(w)} must have C/groups = {c // groups} input "
                         f"channels for x {_desc(x)} and groups={groups}")
    lo, hi, span = a["pad"], a["pad_hi"], _span(a)
    if any(sp > s + p + q for sp, s, p, q in zip(span, size, lo, hi)):
        raise ValueError(f"{op}: the kernel {fmt(a['kernel'])} (dilation {fmt(a['dilation'])}: "
                         f"spans {fmt(span)}) is larger than the padded input {fmt(size)} + "
                         f"padding {fmt(lo)}/{fmt(hi)}")
    out = tuple((s + p + q - sp) // st + 1
                for s, p, q, sp, st in zip(size, lo, hi, span, a["stride"]))
    return ((n,) + out + (cout,) if cl else (n, cout) + out), x.dtype


def infer_conv_transpose(z, w, **a):
    op = "conv_transpose"
    _conv_operands(op, z, w, a["kernel"])
    n, c, size, groups = z.shape[0], z.shape[1], tuple(z.shape[2:]), a["groups"]
    if w.shape[0] != c or c % groups:
        raise ValueError(f"{op}: w {_desc(w)} must be [C, Cout/groups, *kernel] with C = "
                         f"{c} (x {_desc(z)}) divisible by groups={groups}")
    out = tuple((o - 1) * st - p - q + sp for o, st, p, q, sp in
                zip(size, a["stride"], a["pad"], a["pad_hi"], _span(a)))
    if any(o <= 0 for o in out):
        raise ValueError(f"{op}: the output would be {fmt(out)} for x {_desc(z)}, kernel "
                         f"{fmt(a['kernel'])}, stride {fmt(a['stride'])}, padding "
                         f"{fmt(a['pad'])}")
    return (n, w.shape[1] * groups) + out, z.dtype


def infer_conv_wgrad(x, dy, **a):
    """The weight gradient [K, C/groups, *kernel] from the image x [N, C, *S] and the cols'
    gradient dy [N, K, *O]."""
    op, d = "conv_wgrad", len(a["kernel"])
    for arg, t in (("x", x), ("dy", dy)):
        if len(t.shape) != d + 2:
            raise ValueError(f"{op}: {arg} must be [N, C, *spatial] with {d} spatial dims, "
                             f"got {_desc(t)}")
    _same_float(op, (("x", x), ("dy", dy)))
    if x.shape[0] != dy.shape[0] or x.shape[1] % a["groups"] or dy.shape[1] % a["groups"]:
        raise ValueError(f"{op}: x {_desc(x)} and dy {_desc(dy)} must share N and have "
                         f"channels divisible by groups={a['groups']}")
    return (dy.shape[1], x.shape[1] // a["groups"]) + tuple(a["kernel"]), x.dtype


def infer_implicit_gemm(src, w, *, of, **a):
    """conv or conv_transpose (``of``) as one implicit-GEMM kernel: its inference."""
    if of not in ("conv", "conv_transpose"):
        raise ValueError(f"implicit_gemm: of must be 'conv' or 'conv_transpose', got {of!r}")
    return (infer_conv if of == "conv" else infer_conv_transpose)(src, w, **a)


def _unfold(op, t, rank, want):
    """im2col's image / col2im's cols: a float tensor of this rank."""
    _float(op, "input", t)
    if len(t.shape) != rank:
        raise ValueError(f"{op}: input must be {want}, got {_desc(t)}")


def infer_im2col(x, *, kernel, stride, pad, dilation, image, cols, groups):
    op = "im2col"
    _unfold(op, x, 2 + len(kernel), "[N, C, *S]")
    if tuple(x.shape[2:]) != tuple(image) or x.shape[1] % groups:
        raise ValueError(f"{op}: x {_desc(x)} must be [N, C, *image] with image {fmt(image)} "
                         f"and C divisible by groups={groups}")
    return ((x.shape[0], groups, x.shape[1] // groups * math.prod(kernel), math.prod(cols)),
            x.dtype)


def infer_col2im(c, *, kernel, stride, pad, dilation, image, cols):
    """cols [N, G, Cout/G * prod(kernel), prod(cols)] -> the image [N, Cout, *image]."""
    op = "col2im"
    _unfold(op, c, 4, "[N, G, R, L]")
    taps = math.prod(kernel)
    if c.shape[2] % taps or c.shape[3] != math.prod(cols):
        raise ValueError(f"{op}: cols {_desc(c)} must be [N, G, C/G * {taps}, {math.prod(cols)}]"
                         f" for kernel {fmt(kernel)} and cols {fmt(cols)}")
    return (c.shape[0], c.shape[1] * c.shape[2] // taps) + tuple(image), c.dtype


def infer_pool(x, **a):
    """[N, C, *cols] from x [N, C, *image]; ``channels_last``: [N, *cols, C] from [N, *image, C]."""
    op, d, cl = "pool", len(a["kernel"]), a.get("channels_last", False)
    if a["kind"] not in ("max", "avg"):
        raise ValueError(f"{op}: kind must be 'max' or 'avg', got {a['kind']!r}")
    _float(op, "x", x)
    if len(x.shape) != d + 2 or tuple(x.shape[1:-1] if cl else x.shape[2:]) != tuple(a["image"]):
        raise ValueError(f"{op}: x must be {'[N, *image, C]' if cl else '[N, C, *image]'} with "
                         f"image {fmt(a['image'])}, got {_desc(x)}")
    if len(a["cols"]) != d or any(o < 1 for o in a["cols"]):
        raise ValueError(f"{op}: cols {fmt(a['cols'])} must be {d} sizes >= 1")
    if cl:
        return (x.shape[0],) + tuple(a["cols"]) + (x.shape[-1],), x.dtype
    return tuple(x.shape[:2]) + tuple(a["cols"]), x.dtype


def infer_pool_grad(x, dy, **a):
    """dx (x's shape) of a pool node (its attrs) from dy (the pool's output shape)."""
    want, _ = infer_pool(x, **a)
    if tuple(dy.shape) != want or dy.dtype != x.dtype:
        raise ValueError(f"pool_grad: dy must be {x.dtype} {fmt(want)} (x's dtype), got "
                         f"{_desc(dy)} for x {_desc(x)}")
    return x.shape, x.dtype


def infer_channel_affine(x, *params, eps=None):
    """x [N, C, ...] with center, scale, shift (and, with eps, var) [C]: the per-channel
    operands one dtype, f32 or x's (torch's batch norm takes f32 statistics with half x)."""
    op = "channel_affine"
    _float(op, "x", x)
    if len(x.shape) < 2:
        raise ValueError(f"{op}: x must be [N, C, ...], got {_desc(x)}")
    if len(params) != 3 + (eps is not None):
        raise ValueError(f"{op}: {1 + len(params)} inputs: x, center, scale, shift"
                         f"{', var' if eps is not None else ''} expected")
    pdt = params[0].dtype
    for t in params:
        if tuple(t.shape) != (x.shape[1],) or t.dtype != pdt or pdt not in (dt.F32, x.dtype):
            raise ValueError(f"{op}: the per-channel operands must be [{x.shape[1]}], all f32 or "
                             f"all x's dtype (x {_desc(x)}), got "
                             f"{', '.join(_desc(p) for p in params)}")
    return x.shape, x.dtype


def infer_resample(x, *, axis, idx, w, const, idx2=None, w2=None, const2=None, out=None):
    """x with axis (and axis + 1, given the second tables) resampled: out[o] = const[o] +
    sum_t w[o, t] * x[idx[o, t]], in dtype ``out`` (default x's: f32 between the nodes of a
    half tensor resampled along several axes)."""
    op = "resample"
    _float(op, "x", x)
    if not 0 <= axis < len(x.shape) - (idx2 is not None):
        raise ValueError(f"{op}: x must have axis {axis}"
                         f"{' and the next' if idx2 is not None else ''}, got {_desc(x)}")
    shape = list(x.shape)
    for k, (i, ww, c) in enumerate(((idx, w, const), (idx2, w2, const2))):
        if i is None:
            continue
        n_in = x.shape[axis + k]
        if (i.ndim != 2 or ww.shape != i.shape or c.shape != (i.shape[0],)
                or (i.size and (i.min() < 0 or i.max() >= max(n_in, 1)))):
            raise ValueError(f"{op}: the tables of axis {axis + k} ({n_in} long) must be idx / w "
                             f"[out, taps] with indices in range and const [out], got idx "
                             f"{fmt(i.shape)}, w {fmt(ww.shape)}, const {fmt(c.shape)}")
        shape[axis + k] = i.shape[0]
    return tuple(shape), x.dtype if out is None else dt.dtype(out)


defop("conv", infer_conv, dtype_rule=F32,
      doc="N-d convolution (torch's conv1d/2d/3d), NCHW, groups, dilation, asymmetric padding")
defop("conv_transpose", infer_conv_transpose, dtype_rule=F32,
      doc="N-d transposed convolution (torch's conv_transpose1d/2d/3d)")
defop("conv_wgrad", infer_conv_wgrad, dtype_rule=F32,
      doc="a convolution's weight gradient from its image and its output's gradient")
defop("implicit_gemm", infer_implicit_gemm, dtype_rule=F32,
      doc="conv / conv_transpose as one implicit-GEMM kernel (conv tier 2's rewrite)")
defop("im2col", infer_im2col, dtype_rule=F32,
      doc="the image's windows as columns [N, G, C/G * taps, positions] (conv tier 1)")
defop("col2im", infer_col2im, dtype_rule=F32,
      doc="im2col's adjoint: columns summed back into the image (conv tier 1)")
defop("pool", infer_pool, dtype_rule=F32, doc="max / avg pooling over 1-3 spatial dims")
defop("pool_grad", infer_pool_grad, dtype_rule=F32, doc="pool's gradient (a gather)")
defop("channel_affine", infer_channel_affine, dtype_rule=F32,
      doc="(x - center[c]) * scale[c] (/ sqrt(var[c] + eps)) + shift[c] over x [N, C, ...]")
defop("resample", infer_resample, dtype_rule=F32,
      doc="one or two adjacent axes resampled by host tables (pad, resize, adaptive pools)")


def _pointwise(x_shape, a) -> bool:
    """A channels-last 1x1 conv that is a product: one group, no padding, each stride dividing
    its spatial size (the subsampling is then a reshape and a narrow)."""
    return (a["groups"] == 1 and all(k == 1 for k in a["kernel"]) and not any(a["pad"])
            and not any(a["pad_hi"])
            and all(s % st == 0 for s, st in zip(x_shape[1:-1], a["stride"])))


def _pointwise_conv(g, x, w, bias, a):
    """A channels-last 1x1 conv as the product [N*O, C] @ w[K, C]^T + bias (``linear``: the
    matmul tiers fuse its bias and the relu / residual that follow; its VJP is two products).
    A stride subsamples first: each strided axis reshaped to (O, stride) and the first of
    each window kept (a narrow)."""
    op = "conv"
    infer_conv(x, w, **a)                        # the checks and messages of the conv node
    cout, c = w.shape[0], x.shape[-1]
    if bias is not None:
        _check_bias(g, op, bias, cout, x.dtype)
    for i, st in enumerate(a["stride"]):
        if st == 1:
            continue
        ax, shape = 1 + i, tuple(x.shape)
        split = shape[:ax] + (shape[ax] // st, st) + shape[ax + 1:]
        x = g.reshape(g.narrow(g.reshape(x, split), ax + 1, 0, 1), split[:ax + 1] + split[ax + 2:])
    # x [N, *O, C] as it is: linear folds the leading dims into the product's rows, and its
    # result is the conv's (a relu of it can then fold into the product: passes/fusion.py)
    return g.linear(x, g.transpose(g.reshape(w, (cout, c)), (1, 0)), bias)


class VisionOps:
    """Builder methods; ``self`` is the Graph."""

    def conv(self, x, w, bias=None, *, stride=1, padding=0, dilation=1, groups=1,
             channels_last=False):
        """torch.nn.functional.conv1d/2d/3d: x [N, C, *S] (or [C, *S]), w [Cout, C/groups,
        *k], bias [Cout] -> [N, Cout, *O], O = (S + pad_lo + pad_hi - dilation*(k - 1) - 1)
        // stride + 1. padding: an int, one int a spatial dim, "valid" (0) or "same" (stride
        1 only; an odd total puts the extra on the high side, as torch does).
        ``channels_last=True``: x [N, *S, C] (or [*S, C]), w [Cout, *k, C/groups] (cuDNN's
        KRSC), y [N, *O, Cout] (torch's channels_last memory format as the logical layout)."""
        op = "conv"
        cl = _channels_last(op, channels_last)
        d, batched, xb = _conv_input(self, op, x, w, cl)
        cout, k = w.shape[0], tuple(w.shape[1:-1] if cl else w.shape[2:])
        groups = _ints(op, "groups", groups, 1, 1)[0]
        stride = _ints(op, "stride", stride, d, 1)
        dilation = _ints(op, "dilation", dilation, d, 1)
        if isinstance(padding, str):
            if padding == "valid":
                lo = hi = (0,) * d
            elif padding == "same":
                if any(s != 1 for s in stride):
                    raise ValueError(f"{op}: padding='same' needs stride 1, got stride={stride}")
                tot = tuple(dl * (kk - 1) for dl, kk in zip(dilation, k))
                lo = tuple(t // 2 for t in tot)
                hi = tuple(t - t // 2 for t in tot)
            else:
                raise ValueError(f"{op}: padding must be an int, a tuple, 'same' or 'valid', got "
                                 f"{padding!r}")
        else:
            lo = hi = _ints(op, "padding", padding, d, 0)
        attrs = dict(kernel=k, stride=stride, pad=lo, dilation=dilation, groups=groups,
                     pad_hi=hi)
        if cl:
            attrs["channels_last"] = True
        if cl and _pointwise(xb.shape, attrs):
            y = _pointwise_conv(self, xb, w, bias, attrs)
        else:
            y = self.bind("conv", [xb, w], **attrs)
            y = _bias(self, op, bias, cout, y, d, cl)
        return y if batched else self.reshape(y, tuple(y.shape[1:]))

    def conv_transpose(self, x, w, bias=None, *, stride=1, padding=0, output_padding=0,
                       dilation=1, groups=1):
        """torch.nn.functional.conv_transpose1d/2d/3d: x [N, C, *S] (or [C, *S]), w [C,
        Cout/groups, *k], bias [Cout] -> [N, Cout, *O], O = (S - 1)*stride - 2*padding +
        dilation*(k - 1) + output_padding + 1 (output_padding < stride or < dilation)."""
        op = "conv_transpose"
        d, batched, xb = _conv_input(self, op, x, w)
        groups = _ints(op, "groups", groups, 1, 1)[0]
        k = tuple(w.shape[2:])
        stride = _ints(op, "stride", stride, d, 1)
        dilation = _ints(op, "dilation", dilation, d, 1)
        pad = _ints(op, "padding", padding, d, 0)
        opad = _ints(op, "output_padding", output_padding, d, 0)
        if any(p >= max(s, dl) for p, s, dl in zip(opad, stride, dilation)):
            raise ValueError(f"{op}: output_padding {fmt(opad)} must be smaller than stride "
                             f"{fmt(stride)} or dilation {fmt(dilation)}")
        y = self.bind("conv_transpose", [xb, w], kernel=k, stride=stride, pad=pad,
                      dilation=dilation, groups=groups,
                      pad_hi=tuple(p - o for p, o in zip(pad, opad)))
        y = _bias(self, op, bias, y.shape[1], y, d)
        return y if batched else self.reshape(y, tuple(y.shape[1:]))

    def pool(self, x, kind, kernel_size, stride=None, padding=0, *, dilation=1,
             ceil_mode=False, count_include_pad=True, channels_last=False):
        """torch's max_pool1d/2d/3d ("max") and avg_pool1d/2d/3d ("avg") over x [N, C, *S]
        (or [C, *S]); the spatial rank is kernel_size's length, or x's rank - 2 for an int.
        stride None = kernel_size; padding <= half the (dilated) window; dilation: max only;
        ceil_mode: windows that start inside the input or its low padding round the output
        size up; count_include_pad: avg divides by the window clipped to the padded input
        (else to the input). ``channels_last=True``: x [N, *S, C] (or [*S, C]) -> [N, *O, C]
        (one kernel along the channels; its gradient: the channels-first one between transposes)."""
        op = "pool"
        self.check(op, "x", x)
        cl = _channels_last(op, channels_last)
        if kind not in ("max", "avg"):
            raise ValueError(f"{op}: kind must be 'max' or 'avg', got {kind!r}")
        d = len(kernel_size) if isinstance(kernel_size, (tuple, list)) else len(x.shape) - 2
        if d not in (1, 2, 3) or len(x.shape) not in (d + 1, d + 2):
            want = ("[N, *spatial, C] or [*spatial, C] (channels last)" if cl
                    else "[N, C, *spatial] or [C, *spatial]")
            raise ValueError(f"{op}: x must be {want} with 1-3 "
                             f"spatial dims for kernel_size {kernel_size!r}, got {_desc(x)}")
        _float(op, "x", x)
        k = _ints(op, "kernel_size", kernel_size, d, 1)
        st = k if stride is None else _ints(op, "stride", stride, d, 1)
        pad = _ints(op, "padding", padding, d, 0)
        dil = _ints(op, "dilation", dilation, d, 1)
        if kind == "avg" and any(v != 1 for v in dil):
            raise ValueError(f"{op}: avg pooling has no dilation, got dilation={dilation!r}")
        span = tuple(dl * (kk - 1) + 1 for dl, kk in zip(dil, k))
        if any(2 * p > sp for p, sp in zip(pad, span)):
            raise ValueError(f"{op}: padding {fmt(pad)} must be at most half the window "
                             f"{fmt(span)}")
        batched = len(x.shape) == d + 2
        xb = x if batched else self.reshape(x, (1,) + tuple(x.shape))
        size = tuple(xb.shape[1:-1] if cl else xb.shape[2:])
        out = []
        for s, p, sp, sd in zip(size, pad, span, st):
            o = (s + 2 * p - sp + (sd - 1 if ceil_mode else 0)) // sd + 1
            if ceil_mode and (o - 1) * sd >= s + p:     # the last window starts in the padding
                o -= 1
            out.append(o)
        if any(o < 1 for o in out):
            raise ValueError(f"{op}: the window {fmt(span)} is larger than the padded input "
                             f"{fmt(size)} + 2 x {fmt(pad)}")
        y = self.bind("pool", [xb], kind=kind, kernel=k, stride=st, pad=pad, dilation=dil,
                      image=size, cols=tuple(out), count_include_pad=bool(count_include_pad),
                      **({"channels_last": True} if cl else {}))
        return y if batched else self.reshape(y, tuple(y.shape[1:]))

    def batch_norm(self, x, mean, var, gamma=None, beta=None, eps=1e-5):
        """Inference batch norm over x [N, C, ...] with running statistics, per channel:
        (x - mean) / sqrt(var + eps) * gamma + beta (torch's F.batch_norm, training=False)."""
        op = "batch_norm"
        self.check(op, "x", x)
        _float(op, "x", x)
        if len(x.shape) < 2:
            raise ValueError(f"{op}: x must be [N, C, ...], got {_desc(x)}")
        _per_channel(self, op, x, (("mean", mean), ("var", var), ("gamma", gamma),
                                   ("beta", beta)))
        _eps(op, eps)
        return _channel_affine(self, x, mean, gamma, beta, (var, float(eps)))

    def group_norm(self, x, num_groups, gamma=None, beta=None, eps=1e-5):
        """torch's F.group_norm: x [N, C, *S] normalised over each group of C / num_groups
        channels (and every position), then gamma [C] and beta [C] per channel."""
        op = "group_norm"
        self.check(op, "x", x)
        _float(op, "x", x)
        if len(x.shape) < 2:
            raise ValueError(f"{op}: x must be [N, C, ...], got {_desc(x)}")
        n, c = x.shape[:2]
        groups = _ints(op, "num_groups", num_groups, 1, 1)[0]
        if c % groups:
            raise ValueError(f"{op}: the {c} channels of x {_desc(x)} do not divide into "
                             f"num_groups={groups}")
        _per_channel(self, op, x, (("gamma", gamma), ("beta", beta)))
        _eps(op, eps)
        inner = math.prod(x.shape) // (n * groups)
        h = self.layer_norm(self.reshape(x, (n, groups, inner)),
                            self.constant(np.ones(inner, x.dtype.host)), eps=float(eps))
        h = self.reshape(h, x.shape)
        return h if gamma is None and beta is None else _channel_affine(self, h, None, gamma,
                                                                        beta)

    def layer_norm2d(self, x, gamma, beta=None, eps=1e-6):
        """SAM's LayerNorm2d: x [N, C, *S] normalised over C at each position, then gamma [C]
        (and beta [C]) per channel."""
        op = "layer_norm2d"
        self.check(op, "x", x)
        _float(op, "x", x)
        if len(x.shape) < 3:
            raise ValueError(f"{op}: x must be [N, C, *spatial], got {_desc(x)}")
        return self.layer_norm(x, gamma, beta, axis=1, eps=eps)

def _per_channel(g, op, x, named):
    """The given (arg, tensor) of ``named`` (None: absent) are [C], one dtype: f32 or x's."""
    c, first = x.shape[1], None
    for arg, t in named:
        if t is None and arg in ("gamma", "beta"):
            continue
        g.check(op, arg, t)
        want = (first[1].dtype if first else
                "f32" if x.dtype == dt.F32 else f"f32 or {x.dtype}")
        if (tuple(t.shape) != (c,) or t.dtype not in (dt.F32, x.dtype)
                or first and t.dtype != first[1].dtype):
            raise ValueError(f"{op}: {arg} must be {want} [{c}] (one per channel of x "
                             f"{_desc(x)}; the per-channel operands f32 or x's dtype, all "
                             f"one), got {_desc(t)}")
        first = first or (arg, t)


def _channel_affine(g, x, center, scale, shift, var_eps=None):
    """(x - center[c]) * scale[c] + shift[c] over x [N, C, ...] (a None: 0, 1, 0), one kernel;
    with ``var_eps`` = (var, eps) the scale is scale[c] / sqrt(var[c] + eps) (batch_norm: its
    per-channel step in the same kernel, not a launch of its own)."""
    c = x.shape[1]
    given = [t for t in (center, scale, shift) if t is not None]
    host = (given[0].dtype if given else x.dtype).host       # the fills in the given ones' dtype
    fill = lambda t, v: t if t is not None else g.constant(np.full(c, v, host))  # noqa: E731
    ins = (x, fill(center, 0.0), fill(scale, 1.0), fill(shift, 0.0))
    if var_eps is None:
        return g.bind("channel_affine", ins)
    return g.bind("channel_affine", ins + (var_eps[0],), eps=var_eps[1])


@vjp("channel_affine")
def _channel_affine_vjp(g, node, dy):
    x, center, scale = (g.tensor(i) for i in node.inputs[:3])
    axes = (0,) + tuple(range(2, len(x.shape)))
    c = x.shape[1]
    b = (c,) + (1,) * (len(x.shape) - 2)
    dshift = g.reduce_sum(dy, axes)
    centred = g.sub(x, g.reshape(center, b))
    dscale = g.reduce_sum(g.mul(dy, centred), axes)    # of the effective scale
    if len(node.inputs) == 4:
        return [_channel_affine(g, dy, None, scale, None), g.neg(g.mul(dshift, scale)),
                dscale, dshift]
    var = g.tensor(node.inputs[4])
    r = g.rsqrt(g.add(var, node.attrs["eps"]))        # d(s r)/ds = r, d(s r)/dvar = -s r^3 / 2
    eff = g.mul(scale, r)
    dvar = g.mul(g.mul(dscale, g.mul(scale, g.mul(r, g.mul(r, r)))), -0.5)
    return [_channel_affine(g, dy, None, eff, None), g.neg(g.mul(dshift, eff)),
            g.mul(dscale, r), dshift, dvar]


@vjp("pool")
def _pool_vjp(g, node, dy):
    """pool_grad (a gather); channels last: on x and dy transposed to channels first, the
    gradient transposed back."""
    x, a = g.tensor(node.inputs[0]), dict(node.attrs)
    if not a.pop("channels_last", False):
        return [g.bind("pool_grad", (x, dy), **a)]
    r = len(x.shape)
    dx = g.bind("pool_grad", (g.transpose(x, to_first(r)), g.transpose(dy, to_first(r))), **a)
    return [g.transpose(dx, to_last(r))]


@vjp("conv")
def _conv_vjp(g, node, dy):
    """dx: conv_transpose of dy giving x's size exactly: its pad_hi drops the rows of x no
    window reached (conv's floor); dw: conv_wgrad. Channels last: the same on x, w and dy
    transposed to channels first, the gradients transposed back."""
    x, w = (g.tensor(i) for i in node.inputs)
    a = dict(node.attrs)
    if not a.pop("channels_last", False):
        return _conv_grads(g, x, w, dy, a)
    r = len(x.shape)
    first = [g.transpose(t, to_first(r)) for t in (x, w, dy)]
    return [g.transpose(t, to_last(r)) for t in _conv_grads(g, *first, a)]


def _conv_grads(g, x, w, dy, a):
    rem = tuple((s + p + q - sp) % st for s, p, q, sp, st in
                zip(x.shape[2:], a["pad"], a["pad_hi"], _span(a), a["stride"]))
    return [g.bind("conv_transpose", (dy, w),
                   **{**a, "pad_hi": tuple(q - r for q, r in zip(a["pad_hi"], rem))}),
            g.bind("conv_wgrad", (x, dy), **a)]


@vjp("conv_transpose")
def _conv_transpose_vjp(g, node, dy):
    z, w = (g.tensor(i) for i in node.inputs)
    return [g.bind("conv", (dy, w), **node.attrs), g.bind("conv_wgrad", (dy, z), **node.attrs)]


# ---- the convolutions as im2col / col2im and products (where cuDNN does not run them) --------
CONV_OPS = ("conv", "conv_transpose", "conv_wgrad")


def conv_geometry(node, image_shape, cols_shape):
    """im2col / col2im attrs of a conv-family node: ``image_shape`` [N, C, *S] the convolution's
    input, ``cols_shape`` [N, K, *O] its output."""
    a = node.attrs
    return dict(kernel=a["kernel"], stride=a["stride"], pad=a["pad"], dilation=a["dilation"],
                image=tuple(image_shape[2:]), cols=tuple(cols_shape[2:]))


def half_product(dtype) -> bool:
    """Whether the matmul op takes ``dtype`` operands natively (f32 always)."""
    return dtype == dt.F32 or opdef("matmul").dtype_rule != F32_ONLY


def _product(g, a, b, dtype):
    """a @ b of ``dtype`` operands: in that dtype where matmul takes it, else in f32 (the
    operands cast up, the product left f32: the caller rounds once, at its end)."""
    if half_product(dtype):
        return g.matmul(a, b)
    return g.matmul(g.cast(a, dt.F32), g.cast(b, dt.F32))


def _rounded(g, y, dtype):
    return y if y.dtype == dtype else g.cast(y, dtype)


def expand_conv(g, node, ins):
    """A conv-family node as im2col / col2im and the matmul ladder, on graph ``g`` (the
    compiler's rewrite for conv tier 1: runtime/lower_vision.py conv_tier):
      conv            cols = im2col(x); y = w [G, K/G, R] @ cols
      conv_transpose  cols = w^T @ z; img = col2im(cols)
      conv_wgrad      dw = the sum over N of dy [N, G, K/G, L] @ im2col(x)^T
    im2col and col2im take half natively; the products run in half where matmul takes it, else
    in f32 (``_product``; conv_transpose's col2im then sums f32 columns), the result rounded
    once. A half conv_transpose whose windows overlap (col2im sums several columns into an
    image element) takes its product in f32 too, so the sum rounds once, not each column
    first; without overlap (a 1x1, a kernel no wider than its stride) each image element is
    one column, rounded once by the half product. A half weight gradient takes its products
    and their batch sum in f32 and rounds once (a half product would round each sample's
    partial before the sum)."""
    a = node.attrs
    groups, k = a["groups"], a["kernel"]
    if node.op == "conv_transpose":
        z, w = ins
        # two taps of an axis reach one image element where dilation * (k - 1) >= stride
        if node.dtype in (dt.F16, dt.BF16) and any(
                kk > 1 and d * (kk - 1) >= s for kk, s, d in zip(k, a["stride"], a["dilation"])):
            z, w = g.cast(z, dt.F32), g.cast(w, dt.F32)
        n, kc = z.shape[:2]
        r = w.shape[1] * math.prod(k)
        wt = g.transpose(g.reshape(w, (groups, kc // groups, r)), (0, 2, 1))
        cols = _product(g, wt, g.reshape(z, (n, groups, kc // groups, math.prod(z.shape[2:]))),
                        z.dtype)
        img = g.bind("col2im", (cols,), **conv_geometry(node, node.shape, z.shape))
        return _rounded(g, img, node.dtype)
    x = ins[0]
    out_shape = node.shape if node.op == "conv" else ins[1].shape
    kc = out_shape[1]
    n, c = x.shape[:2]
    r, length = c // groups * math.prod(k), math.prod(out_shape[2:])
    trivial = (all(v == 1 for v in k + a["stride"]) and not any(a["pad"])
               and tuple(x.shape[2:]) == tuple(out_shape[2:]))
    cols = (g.reshape(x, (n, groups, r, length)) if trivial else      # 1x1: x is its own cols
            g.bind("im2col", (x,), groups=groups, **conv_geometry(node, x.shape, out_shape)))
    if node.op == "conv":
        y = _product(g, g.reshape(ins[1], (groups, kc // groups, r)), cols, node.dtype)
        return g.reshape(_rounded(g, y, node.dtype), node.shape)
    dy = g.reshape(ins[1], (n, groups, kc // groups, length))
    half = node.dtype != dt.F32
    if half:
        dy, cols = g.cast(dy, dt.F32), g.cast(cols, dt.F32)
    dw = g.reduce_sum(g.matmul(dy, g.transpose(cols, (0, 1, 3, 2))), 0)
    return g.reshape(g.cast(dw, node.dtype) if half else dw, node.shape)


def channels_first_rewrite(rewrite):
    """``rewrite`` (a conv tier's: expand_conv, implicit_gemm) for a channels-last conv too: x
    and w transposed to channels first, that conv rewritten, its result transposed back (the
    tiers other than cuDNN's; correct, not fast)."""
    def run(g, node, ins):
        if not node.attrs.get("channels_last"):
            return rewrite(g, node, ins)
        r = len(node.shape)
        attrs = {k: v for k, v in node.attrs.items() if k != "channels_last"}
        first = dataclasses.replace(node, shape=_first(node.shape), attrs=attrs)
        y = rewrite(g, first, [g.transpose(t, to_first(r)) for t in ins[:2]] + list(ins[2:]))
        return g.transpose(y, to_last(r))
    run.__doc__ = rewrite.__doc__
    return run


def implicit_gemm(g, node, ins):
    """conv / conv_transpose as one kernels/conv.py implicit-GEMM kernel (conv tier 2): f32
    sums rounded once to the node's dtype on the tile store."""
    a = node.attrs
    return g.bind("implicit_gemm", tuple(ins[:2]), of=node.op,
                  **{k: a[k] for k in ("kernel", "stride", "pad", "dilation", "groups", "pad_hi")})


# ---- resampling: pad, resize, adaptive_avg_pool ---------------------------------------------
# Each is separable: out[a, o, b] = const[o] + sum_t w[o, t] * x[a, idx[o, t], b] along each
# axis, with host-made tables (kernels/resample.py). The last two axes, when both resample,
# are one node (one kernel, no intermediate): the last axis' table applied first, then the
# other's (idx2 / w2 / const2 are the last axis'). For the tables made here the order does not
# matter: only pad has constants, and a padded position is the pad value either way. The VJP
# is the same op with the transposed tables (a gather: no atomics).

def _transposed(idx, w, n_in):
    """Tables of the adjoint: for each input i, the (o, w) pairs that read it."""
    pairs = [[] for _ in range(n_in)]
    for o in range(idx.shape[0]):
        for t in range(idx.shape[1]):
            if w[o, t] != 0:
                pairs[idx[o, t]].append((o, w[o, t]))
    taps = max(1, max(len(p) for p in pairs))
    ti, tw = np.zeros((n_in, taps), np.int64), np.zeros((n_in, taps), np.float32)
    for i, p in enumerate(pairs):
        for t, (o, wt) in enumerate(p):
            ti[i, t], tw[i, t] = o, wt
    return ti, tw, np.zeros(n_in, np.float32)


def _resample(g, x, tables):
    """x resampled along each axis of ``tables`` {axis: (idx, w, const or None)}. A half x
    that takes more than one node keeps the nodes between in f32 (each node's store rounds),
    so the result is rounded once, as torch's kernels round it."""
    y, last = x, len(x.shape) - 1
    pair = last in tables and last - 1 in tables
    axes = [a for a in sorted(tables) if not (pair and a == last)]
    half = x.dtype in (dt.F16, dt.BF16) and len(axes) > 1
    for i, axis in enumerate(axes):
        t = [tables[axis]] + ([tables[last]] if pair and axis == last - 1 else [])
        attrs = {}
        for k, (idx, w, const) in enumerate(t):
            sfx = "2" if k else ""
            attrs.update({"idx" + sfx: idx, "w" + sfx: w, "const" + sfx:
                          np.zeros(idx.shape[0], np.float32) if const is None
                          else const.astype(np.float32)})
        if half:
            attrs["out"] = "f32" if i < len(axes) - 1 else x.dtype.name
        y = g.bind("resample", (y,), axis=axis, **attrs)
    return y


@vjp("resample")
def _resample_vjp(g, node, dy):
    x, a = g.tensor(node.inputs[0]), node.attrs
    ax = a["axis"]
    tables = {ax: _transposed(a["idx"], a["w"], x.shape[ax])}
    if "idx2" in a:
        tables[ax + 1] = _transposed(a["idx2"], a["w2"], x.shape[ax + 1])
    # a node between two of a half tensor's (x f32, dy half): its adjoint in f32 as well
    src = g.cast(dy, "f32") if x.dtype == dt.F32 and dy.dtype != dt.F32 else dy
    dx = _resample(g, src, tables)
    return [dx if dx.dtype == x.dtype else g.cast(dx, x.dtype.name)]


def _pad_table(mode, n, lo, hi, value):
    out = n + lo + hi
    idx, w = np.zeros((out, 1), np.int64), np.ones((out, 1), np.float32)
    const = np.zeros(out, np.float32)
    for o in range(out):
        s = o - lo
        if mode == "reflect":
            s = -s if s < 0 else (2 * (n - 1) - s if s >= n else s)
        elif mode == "replicate":
            s = min(max(s, 0), n - 1)
        elif not 0 <= s < n:
            s, w[o, 0], const[o] = 0, 0.0, value
        idx[o, 0] = s
    return idx, w, const


def _resize_table(mode, n_in, n_out, align_corners, scale_factor):
    """torch's upsample index math in float32 (area_pixel_compute_scale / source_index)."""
    f32 = np.float32
    if align_corners:
        scale = f32((n_in - 1) / (n_out - 1)) if n_out > 1 else f32(0.0)
    else:
        scale = f32(1.0 / scale_factor) if scale_factor else f32(n_in / n_out)
    if mode == "nearest":
        idx = np.array([[min(int(np.floor(f32(o) * scale)), n_in - 1)] for o in range(n_out)],
                       np.int64)
        return idx, np.ones((n_out, 1), np.float32), None
    idx, w = np.zeros((n_out, 2), np.int64), np.zeros((n_out, 2), np.float32)
    for o in range(n_out):
        src = scale * f32(o) if align_corners else max(scale * (f32(o) + f32(0.5)) - f32(0.5),
                                                       f32(0.0))
        i0 = min(int(src), n_in - 1)
        lam = f32(src - f32(i0))
        idx[o] = (i0, i0 + 1 if i0 < n_in - 1 else i0)
        w[o] = (f32(1.0) - lam, lam)
    return idx, w, None


def _adaptive_table(n_in, n_out):
    starts = [(o * n_in) // n_out for o in range(n_out)]
    ends = [-(-((o + 1) * n_in) // n_out) for o in range(n_out)]
    taps = max(e - s for s, e in zip(starts, ends))
    idx, w = np.zeros((n_out, taps), np.int64), np.zeros((n_out, taps), np.float32)
    for o, (s, e) in enumerate(zip(starts, ends)):
        idx[o, :e - s] = np.arange(s, e)
        w[o, :e - s] = np.float32(1.0) / np.float32(e - s)
    return idx, w, None


_RESIZE_RANK = {"linear": 1, "bilinear": 2, "trilinear": 3}


class ResampleOps:
    """pad, resize and adaptive_avg_pool; ``self`` is the Graph."""

    def pad(self, x, pads, mode="constant", value=0.0):
        """torch.nn.functional.pad: ``pads`` (left, right) pairs from the last axis back;
        "constant" (pads may be negative: a crop), "reflect" (pads < the axis' size) or
        "replicate"."""
        op = "pad"
        self.check(op, "x", x)
        _float(op, "x", x)
        if mode not in ("constant", "reflect", "replicate"):
            raise ValueError(f"{op}: mode must be 'constant', 'reflect' or 'replicate', got "
                             f"{mode!r}")
        pads = tuple(pads) if isinstance(pads, (tuple, list)) else (pads,)
        try:
            pads = tuple(operator.index(p) for p in pads if not isinstance(p, bool))
        except TypeError:
            pads = ()
        if not pads or len(pads) % 2 or len(pads) // 2 > len(x.shape):
            raise ValueError(f"{op}: pads must be (left, right) int pairs for at most "
                             f"{len(x.shape)} axes of x {_desc(x)}, got {pads!r}")
        y, tables = x, {}
        for j in range(len(pads) // 2):
            axis, lo, hi = len(x.shape) - 1 - j, pads[2 * j], pads[2 * j + 1]
            n = y.shape[axis]
            if mode != "constant" and (lo < 0 or hi < 0):
                raise ValueError(f"{op}: {mode} pads must be >= 0, got {pads!r}")
            if mode == "reflect" and (lo >= n or hi >= n):
                raise ValueError(f"{op}: reflect pads must be smaller than the axis: axis "
                                 f"{axis} of x {_desc(x)} has {n}, pads {pads!r}")
            if mode == "replicate" and n == 0 and lo + hi:
                raise ValueError(f"{op}: replicate cannot pad the empty axis {axis} of {_desc(x)}")
            if lo < 0 or hi < 0:           # a crop first
                if n + min(lo, 0) + min(hi, 0) < 0:
                    raise ValueError(f"{op}: pads {pads!r} crop more than axis {axis} of x "
                                     f"{_desc(x)} holds")
                y = self.narrow(y, axis, -min(lo, 0), n + min(lo, 0) + min(hi, 0))
                n, lo, hi = y.shape[axis], max(lo, 0), max(hi, 0)
            if lo or hi:
                tables[axis] = _pad_table(mode, n, lo, hi, float(value))
        return _resample(self, y, tables)

    def resize(self, x, size=None, scale_factor=None, mode="nearest", align_corners=None):
        """torch.nn.functional.interpolate over x [N, C, *S] (1-3 spatial dims): mode
        "nearest", "linear" (1-d), "bilinear" (2-d) or "trilinear" (3-d); exactly one of
        ``size`` (int or one a dim) and ``scale_factor`` (output floor(S * f)); align_corners
        (linear modes only, default False)."""
        op = "resize"
        self.check(op, "x", x)
        _float(op, "x", x)
        d = len(x.shape) - 2
        if d not in (1, 2, 3):
            raise ValueError(f"{op}: x must be [N, C, *spatial] with 1-3 spatial dims, got "
                             f"{_desc(x)}")
        if mode != "nearest" and _RESIZE_RANK.get(mode) != d:
            raise ValueError(f"{op}: mode must be 'nearest' or the interpolating mode of {d} "
                             f"spatial dims ({[m for m, r in _RESIZE_RANK.items() if r == d][0]}"
                             f"), got {mode!r} for x {_desc(x)}")
        if mode == "nearest" and align_corners is not None:
            raise ValueError(f"{op}: align_corners is for the interpolating modes, not nearest")
        if (size is None) == (scale_factor is None):
            raise ValueError(f"{op}: give exactly one of size and scale_factor")
        spatial = tuple(x.shape[2:])
        if size is not None:
            out = _ints(op, "size", size, d, 1)
            factors = (None,) * d
        else:
            fs = scale_factor if isinstance(scale_factor, (tuple, list)) else (scale_factor,) * d
            if len(fs) != d or any(not isinstance(f, (int, float)) or isinstance(f, bool)
                                   or f <= 0 for f in fs):
                raise ValueError(f"{op}: scale_factor must be a positive number or {d} of them, "
                                 f"got {scale_factor!r}")
            factors = tuple(float(f) for f in fs)
            out = tuple(int(math.floor(s * f)) for s, f in zip(spatial, factors))
            if any(o < 1 for o in out):
                raise ValueError(f"{op}: scale_factor {scale_factor!r} makes an empty output "
                                 f"{fmt(out)} from {fmt(spatial)}")
        return _resample(self, x, {
            2 + j: _resize_table("nearest" if mode == "nearest" else "linear", spatial[j],
                                 out[j], bool(align_corners), factors[j])
            for j in range(d) if out[j] != spatial[j] or factors[j] not in (None, 1.0)})

    def adaptive_avg_pool(self, x, output_size, *, channels_last=False):
        """torch's adaptive_avg_pool1d/2d/3d over x [N, C, *S] (or [C, *S]); the spatial rank is
        output_size's length (x's rank - 2 for an int); a None entry keeps that dim. Window o of
        a dim is [floor(o*S/O), ceil((o+1)*S/O)). ``channels_last=True``: x [N, *S, C] (or
        [*S, C]) -> [N, *O, C]."""
        op = "adaptive_avg_pool"
        self.check(op, "x", x)
        _float(op, "x", x)
        cl = int(_channels_last(op, channels_last))
        sizes = tuple(output_size) if isinstance(output_size, (tuple, list)) else None
        d = len(sizes) if sizes is not None else len(x.shape) - 2
        if d not in (1, 2, 3) or len(x.shape) not in (d + 1, d + 2):
            raise ValueError(f"{op}: x must be [N, C, *spatial] or [C, *spatial] with 1-3 "
                             f"spatial dims for output_size {output_size!r}, got {_desc(x)}")
        first = len(x.shape) - d - cl                     # the first spatial axis
        spatial = tuple(x.shape[first:first + d])
        sizes = sizes if sizes is not None else (output_size,) * d
        out = tuple(s if o is None else _ints(op, "output_size", o, 1, 1)[0]
                    for s, o in zip(spatial, sizes))
        if set(out) == {1} and min(spatial) > 0 and max(spatial) > 1:
            # a global pool (ResNet's and ViT's heads) is one mean reduction: the resample
            # path takes two passes channels-last, the first strided (176 us against torch's
            # 18 for bf16 [32, 7, 7, 2048] on an H200)
            return self.reduce("mean", x, tuple(range(first, first + d)), keep_dim=True)
        return _resample(self, x, {first + j: _adaptive_table(spatial[j], out[j])
                                   for j in range(d) if out[j] != spatial[j]})
