"""Vision ops (NCHW, PyTorch's semantics): conv, conv_transpose and pool, 1/2/3-d.

conv and conv_transpose (the spatial rank is the weight's) are built on two data-movement ops
and the matmul tier ladder:

  im2col  x [N, C, *S] -> cols [N, G, C/G * prod(k), prod(O)]: cols[n, g, (c, kidx), o] =
          x[n, g*C/G + c, o*stride - pad + kidx*dilation] (zero outside x)
  col2im  its adjoint: cols -> image [N, C, *S], every window's contributions summed (a
          gather: each image element reads the cols entries that map to it, no atomics)

conv is im2col, then w [G, Cout/G, C/G * prod(k)] @ cols (a batched product: cuBLAS on a GPU,
the numba SGEMM in the simulator) and the bias; conv_transpose is w^T @ x and col2im. Each
is the other's VJP, so gradients to x, w and bias come from these and the matmul's.
Kernels: kernels/conv.py; lowering: runtime/lower_vision.py.
"""
from __future__ import annotations

import math
import operator

from . import dtypes as dt
from .autodiff import vjp
from .ops import fmt


def _desc(t) -> str:
    return f"{t.dtype} {fmt(t.shape)}"


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


def _geometry(op, x, w, n_spatial_w):
    """(d, batched, x as [N, C, *S]) for weight ``w`` of rank d + 2; x is [N, C, *S] or
    unbatched [C, *S]."""
    d = n_spatial_w
    if d not in (1, 2, 3):
        raise ValueError(f"{op}: w must be 3-, 4- or 5-D ([out, in, *kernel] for 1/2/3 spatial "
                         f"dims), got {_desc(w)}")
    if len(x.shape) not in (d + 1, d + 2):
        raise ValueError(f"{op}: x must be [N, C, *spatial] or [C, *spatial] with {d} spatial "
                         f"dims for w {_desc(w)}, got {_desc(x)}")
    for arg, t in (("x", x), ("w", w)):
        if t.dtype != dt.F32:
            raise ValueError(f"{op}: {arg} must be f32, got {_desc(t)}")
    return d, len(x.shape) == d + 2


def _bias(g, op, bias, cout, y, d):
    if bias is None:
        return y
    g._check(op, "bias", bias)
    if tuple(bias.shape) != (cout,) or bias.dtype != dt.F32:
        raise ValueError(f"{op}: bias must be f32 [{cout}] (one per output channel), got "
                         f"{_desc(bias)}")
    return g.add(y, g.reshape(bias, (cout,) + (1,) * d))


class VisionOps:
    """Builder methods; ``self`` is the Graph."""

    def conv(self, x, w, bias=None, *, stride=1, padding=0, dilation=1, groups=1):
        """torch.nn.functional.conv1d/2d/3d: x [N, C, *S] (or [C, *S]), w [Cout, C/groups,
        *k], bias [Cout] -> [N, Cout, *O], O = (S + pad_lo + pad_hi - dilation*(k - 1) - 1)
        // stride + 1. padding: an int, one int a spatial dim, "valid" (0) or "same" (stride
        1 only; an odd total puts the extra on the high side, as torch does)."""
        op = "conv"
        self._check(op, "x", x)
        self._check(op, "w", w)
        d, batched = _geometry(op, x, w, len(w.shape) - 2)
        xb = x if batched else self.reshape(x, (1,) + tuple(x.shape))
        n, c, size = xb.shape[0], xb.shape[1], tuple(xb.shape[2:])
        cout, cg, k = w.shape[0], w.shape[1], tuple(w.shape[2:])
        groups = _ints(op, "groups", groups, 1, 1)[0]
        if c % groups or cout % groups:
            raise ValueError(f"{op}: channels must divide into groups={groups}: x {_desc(x)} has "
                             f"{c} in, w {_desc(w)} has {cout} out")
        if cg != c // groups:
            raise ValueError(f"{op}: w {_desc(w)} must have C/groups = {c // groups} input "
                             f"channels for x {_desc(x)} and groups={groups}")
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
        span = tuple(dl * (kk - 1) + 1 for dl, kk in zip(dilation, k))
        if any(sp > s + a + b for sp, s, a, b in zip(span, size, lo, hi)):
            raise ValueError(f"{op}: the kernel {fmt(k)} (dilation {fmt(dilation)}: spans "
                             f"{fmt(span)}) is larger than the padded input {fmt(size)} + "
                             f"padding {fmt(lo)}/{fmt(hi)}")
        out = tuple((s + a + b - sp) // st + 1
                    for s, a, b, sp, st in zip(size, lo, hi, span, stride))
        geo = dict(kernel=k, stride=stride, pad=lo, dilation=dilation, image=size, cols=out)
        r = cg * math.prod(k)
        if all(v == 1 for v in k + stride) and not any(lo + hi):    # 1x1: x is its own cols
            cols = self.reshape(xb, (n, groups, r, math.prod(out)))
        else:
            cols = self._add("im2col", (xb,), (n, groups, r, math.prod(out)), dt.F32, **geo)
        y = self.matmul(self.reshape(w, (groups, cout // groups, r)), cols)
        y = _bias(self, op, bias, cout, self.reshape(y, (n, cout) + out), d)
        return y if batched else self.reshape(y, (cout,) + out)

    def conv_transpose(self, x, w, bias=None, *, stride=1, padding=0, output_padding=0,
                       dilation=1, groups=1):
        """torch.nn.functional.conv_transpose1d/2d/3d: x [N, C, *S] (or [C, *S]), w [C,
        Cout/groups, *k], bias [Cout] -> [N, Cout, *O], O = (S - 1)*stride - 2*padding +
        dilation*(k - 1) + output_padding + 1 (output_padding < stride or < dilation)."""
        op = "conv_transpose"
        self._check(op, "x", x)
        self._check(op, "w", w)
        d, batched = _geometry(op, x, w, len(w.shape) - 2)
        xb = x if batched else self.reshape(x, (1,) + tuple(x.shape))
        n, c, size = xb.shape[0], xb.shape[1], tuple(xb.shape[2:])
        groups = _ints(op, "groups", groups, 1, 1)[0]
        if w.shape[0] != c or c % groups:
            raise ValueError(f"{op}: w {_desc(w)} must be [C, Cout/groups, *kernel] with C = "
                             f"{c} (x {_desc(x)}) divisible by groups={groups}")
        cog, k = w.shape[1], tuple(w.shape[2:])
        cout = cog * groups
        stride = _ints(op, "stride", stride, d, 1)
        dilation = _ints(op, "dilation", dilation, d, 1)
        pad = _ints(op, "padding", padding, d, 0)
        opad = _ints(op, "output_padding", output_padding, d, 0)
        if any(p >= max(s, dl) for p, s, dl in zip(opad, stride, dilation)):
            raise ValueError(f"{op}: output_padding {fmt(opad)} must be smaller than stride "
                             f"{fmt(stride)} or dilation {fmt(dilation)}")
        out = tuple((s - 1) * st - 2 * p + dl * (kk - 1) + op_ + 1
                    for s, st, p, dl, kk, op_ in zip(size, stride, pad, dilation, k, opad))
        if any(o <= 0 for o in out):
            raise ValueError(f"{op}: the output would be {fmt(out)} for x {_desc(x)}, kernel "
                             f"{fmt(k)}, stride {fmt(stride)}, padding {fmt(pad)}")
        cg, kk = c // groups, math.prod(k)
        wt = self.transpose(self.reshape(w, (groups, cg, cog * kk)), (0, 2, 1))
        cols = self.matmul(wt, self.reshape(xb, (n, groups, cg, math.prod(size))))
        y = self._add("col2im", (cols,), (n, cout) + out, dt.F32, kernel=k, stride=stride,
                      pad=pad, dilation=dilation, image=out, cols=size)
        y = _bias(self, op, bias, cout, y, d)
        return y if batched else self.reshape(y, (cout,) + out)


    def pool(self, x, kind, kernel_size, stride=None, padding=0, *, dilation=1,
             ceil_mode=False, count_include_pad=True):
        """torch's max_pool1d/2d/3d ("max") and avg_pool1d/2d/3d ("avg") over x [N, C, *S]
        (or [C, *S]); the spatial rank is kernel_size's length, or x's rank - 2 for an int.
        stride None = kernel_size; padding <= half the (dilated) window; dilation: max only;
        ceil_mode: windows that start inside the input or its low padding round the output
        size up; count_include_pad: avg divides by the window clipped to the padded input
        (else to the input)."""
        op = "pool"
        self._check(op, "x", x)
        if kind not in ("max", "avg"):
            raise ValueError(f"{op}: kind must be 'max' or 'avg', got {kind!r}")
        d = len(kernel_size) if isinstance(kernel_size, (tuple, list)) else len(x.shape) - 2
        if d not in (1, 2, 3) or len(x.shape) not in (d + 1, d + 2):
            raise ValueError(f"{op}: x must be [N, C, *spatial] or [C, *spatial] with 1-3 "
                             f"spatial dims for kernel_size {kernel_size!r}, got {_desc(x)}")
        if x.dtype != dt.F32:
            raise ValueError(f"{op}: x must be f32, got {_desc(x)}")
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
        size = tuple(xb.shape[2:])
        out = []
        for s, p, sp, sd in zip(size, pad, span, st):
            o = (s + 2 * p - sp + (sd - 1 if ceil_mode else 0)) // sd + 1
            if ceil_mode and (o - 1) * sd >= s + p:     # the last window starts in the padding
                o -= 1
            out.append(o)
        if any(o < 1 for o in out):
            raise ValueError(f"{op}: the window {fmt(span)} is larger than the padded input "
                             f"{fmt(size)} + 2 x {fmt(pad)}")
        y = self._add("pool", (xb,), tuple(xb.shape[:2]) + tuple(out), dt.F32, kind=kind,
                      kernel=k, stride=st, pad=pad, dilation=dil, image=size, cols=tuple(out),
                      count_include_pad=bool(count_include_pad))
        return y if batched else self.reshape(y, tuple(x.shape[:1]) + tuple(out))


@vjp("pool")
def _pool_vjp(g, node, dy):
    x = g.tensor(node.inputs[0])
    return [g._add("pool_grad", (x, dy), x.shape, dt.F32, **node.attrs)]


@vjp("im2col")
def _im2col_vjp(g, node, dy):
    x = g.tensor(node.inputs[0])
    return [g._add("col2im", (dy,), x.shape, dt.F32, **node.attrs)]


@vjp("col2im")
def _col2im_vjp(g, node, dy):
    cols = g.tensor(node.inputs[0])
    return [g._add("im2col", (dy,), cols.shape, dt.F32, **node.attrs)]
