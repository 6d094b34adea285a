"""attention: shape rules and the Graph builder method (mixed into Graph).
Kernels: kernels/attention.py; lowering: runtime/lower_attention.py.

q [B, Hq, Sq, D], k / v [B, Hkv, Sk, D] with Hq a multiple of Hkv (GQA / MQA: query head h
reads key/value head h // (Hq / Hkv), nothing is repeated in memory); or rank 3
[B, S, H * D] with ``num_heads`` = Hq (Hkv follows from k's last dim). Scores are
``scale * q . k`` (scale defaults to 1/sqrt(D)); ``softcap``: s = softcap * tanh(s / softcap);
then ``bias`` (additive, broadcastable to [B, Hq, Sq, Sk]) and the masks: ``causal`` and
``window`` are aligned to the end of the keys (query i sits at position Sk - Sq + i; causal
keeps keys j <= pos, window w keeps pos - w < j <= pos), ``mask`` is a bool keep-mask
broadcastable to [B, Hq, Sq, Sk]. A query whose keys are all masked gets zeros, never NaN.

dtypes (as torch's SDPA): q, k and v one float dtype (f32, f16 or bf16), the output in it;
``bias`` f32 or q's dtype; ``mask`` bool. The kernels compute in f32 (scores, the online
softmax, P V) and round the output once. The LSE and delta rows are f32; dQ, dK, dV are in the
inputs' dtype, a bias's gradient in the bias's.

Backward (``g.grad``): FlashAttention-2 style, see the VJP at the end and
kernels/attention_bwd.py: attention_lse (the rows' log-sum-exp, natural log, of the scores
scale * q.k (softcapped, + bias, masked): the forward's kernel writes it, cuDNN's "stats" being
the same numbers), then ONE backward node, attention_bwd_dq on (q, k, v, O, dO, LSE, [mask],
[bias]), whose bind gives dQ and two further results its steps fill: attention_bwd_dkv
([2, *k.shape]: dK then dV) and attention_bwd_delta (rowsum(dO * O) [B, Hq, Sq], f32). One node
because cuDNN's fused backward computes all three in one call (tier 0); the numba tier runs the
delta, dQ and dK/dV kernels into them. For a bias gradient only, attention_bwd_ds (dS,
[B, Hq, Sq, Sk]) reads that delta (cuDNN's tier then passes the node over: it keeps its delta).
"""
from __future__ import annotations

import math

from . import dtypes as dt
from .autodiff import sum_to, vjp
from .opdef import F32, defop
from .ops import broadcast_shapes, fmt
from .ops_norm import further_result


def attention_dims(q, k, v, mask, bias, num_heads, window, scale, softcap):
    """The checks of attention's operands; dict(b, hq, hkv, sq, sk, d) (the node's attrs)."""
    op = "attention"
    if not q.dtype.is_float:
        raise ValueError(f"{op}: q must be f32, f16 or bf16, got {q.dtype} {fmt(q.shape)}")
    for arg, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{op}: {arg} must have q's dtype {q.dtype}, got {t.dtype} "
                             f"{fmt(t.shape)} (q {q.dtype} {fmt(q.shape)})")
    rank = len(q.shape)
    if rank not in (3, 4):
        raise ValueError(f"{op}: q must be [B, H, S, D] or [B, S, H*D], got {fmt(q.shape)}")
    for arg, t in (("k", k), ("v", v)):
        if len(t.shape) != rank:
            raise ValueError(f"{op}: {arg} must have q's rank {rank}, got {fmt(t.shape)} "
                             f"(q {fmt(q.shape)})")
    if k.shape != v.shape:
        raise ValueError(f"{op}: k and v must have the same shape, got k {fmt(k.shape)}, "
                         f"v {fmt(v.shape)}")
    if rank == 4:
        if num_heads is not None:
            raise ValueError(f"{op}: num_heads is only for rank-3 inputs; q is {fmt(q.shape)}")
        b, hq, sq, d = q.shape
        bk, hkv, sk, dk = k.shape
    else:
        if not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"{op}: rank-3 q {fmt(q.shape)} needs num_heads (a positive int), "
                             f"got {num_heads!r}")
        b, sq, hd = q.shape
        if hd % num_heads:
            raise ValueError(f"{op}: q's last dim {hd} is not a multiple of num_heads {num_heads}")
        hq, d = num_heads, hd // num_heads
        bk, sk, kd = k.shape
        if d == 0 or kd % d:
            raise ValueError(f"{op}: k's last dim {kd} is not a multiple of the head dim {d} "
                             f"(q {fmt(q.shape)}, num_heads {num_heads})")
        hkv, dk = kd // d, d
    if bk != b or dk != d:
        raise ValueError(f"{op}: k/v {fmt(k.shape)} do not match q {fmt(q.shape)} in batch or "
                         f"head dim")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"{op}: q heads ({hq}) must be a multiple of k/v heads ({hkv})")
    if d > 256:
        raise ValueError(f"{op}: head dim {d} > 256 is not supported")
    full = (b, hq, sq, sk)
    for arg, t, want in (("mask", mask, (dt.BOOL,)), ("bias", bias, (dt.F32, q.dtype))):
        if t is None:
            continue
        if t.dtype not in want:
            names = " or ".join(sorted({w.name for w in want}))
            raise ValueError(f"{op}: {arg} must be {names}, got {t.dtype} {fmt(t.shape)} "
                             f"(q {q.dtype} {fmt(q.shape)})")
        if len(t.shape) > 4 or broadcast_shapes(op, [arg, "scores"], [t.shape, full]) != full:
            raise ValueError(f"{op}: {arg} {fmt(t.shape)} does not broadcast to the scores "
                             f"[B, Hq, Sq, Sk] = {fmt(full)}")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"{op}: window must be a positive int, got {window!r}")
    for arg, val in (("scale", scale), ("softcap", softcap)):
        if val is not None and (not isinstance(val, (int, float)) or not math.isfinite(val)):
            raise ValueError(f"{op}: {arg} must be a finite number, got {val!r}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"{op}: softcap must be > 0, got {softcap!r}")
    return dict(b=b, hq=hq, hkv=hkv, sq=sq, sk=sk, d=d)


def _mask_bias(op, rest, has_mask, has_bias):
    """(mask or None, bias or None) of the inputs after q, k, v."""
    rest = list(rest)
    if len(rest) != has_mask + has_bias:
        raise ValueError(f"{op}: {3 + len(rest)} inputs do not match has_mask={has_mask}, "
                         f"has_bias={has_bias}")
    mask = rest.pop(0) if has_mask else None
    return mask, rest.pop(0) if has_bias else None


def _check_dims(op, got, want):
    if got != want:
        raise ValueError(f"{op}: dims {got} do not match its operands' {want}")


def infer_attention(q, k, v, *rest, causal, window, has_mask, has_bias, scale, softcap,
                    num_heads, b, hq, hkv, sq, sk, d):
    mask, bias = _mask_bias("attention", rest, has_mask, has_bias)
    if not isinstance(causal, bool):
        raise ValueError(f"attention: causal must be a bool, got {causal!r}")
    if not isinstance(scale, float):
        raise ValueError(f"attention: scale must be a float, got {scale!r}")
    _check_dims("attention", dict(b=b, hq=hq, hkv=hkv, sq=sq, sk=sk, d=d),
                attention_dims(q, k, v, mask, bias, num_heads, window, scale, softcap))
    return q.shape, q.dtype


def _bwd_infer(op, n_lead, shape_of, stats=(), result=None):
    """Inference of a backward node: its inputs are ``n_lead`` tensors, then the forward's
    mask / bias; its attributes the forward node's; ``shape_of(lead, attrs)`` its
    shape. The lead inputs share input 0's float dtype except those at ``stats`` (LSE and
    delta: f32); the result is f32 unless ``result`` = "io" (input 0's dtype)."""
    def infer(*inputs, **a):
        lead = inputs[:n_lead]
        mask, bias = _mask_bias(op, inputs[n_lead:], a["has_mask"], a["has_bias"])
        io = lead[0].dtype
        for i, t in enumerate(lead):
            want = dt.F32 if i in stats else io
            if t.dtype != want or not want.is_float:
                raise ValueError(f"{op}: input {i} must be {want if want.is_float else 'float'}"
                                 f" (input 0 is {io}), got {t.dtype} {fmt(t.shape)}")
        if mask is not None and mask.dtype != dt.BOOL:
            raise ValueError(f"{op}: mask must be bool, got {mask.dtype} {fmt(mask.shape)}")
        if bias is not None and bias.dtype not in (dt.F32, io):
            raise ValueError(f"{op}: bias must be f32 or {io}, got {bias.dtype} "
                             f"{fmt(bias.shape)}")
        return shape_of(lead, a), io if result == "io" else dt.F32
    return infer


def _rows(a):
    return (a["b"], a["hq"], a["sq"])


def _lse_shape(lead, a):
    """inputs (the attention node, q, k): o must be q's shape."""
    o, q, _ = lead
    if tuple(o.shape) != tuple(q.shape):
        raise ValueError(f"attention_lse: input 0 must be the attention's output (q's shape "
                         f"{fmt(q.shape)}), got {fmt(o.shape)}")
    return _rows(a)


def _bwd_shapes(lead, a):
    """attention_bwd_dq's inputs (q, k, v, O, dO, LSE): [dQ (q's shape), [dK, dV]
    ([2, *k.shape]), delta (the rows')]."""
    q, k, v, o, do, lse = lead
    if tuple(o.shape) != tuple(q.shape) or tuple(do.shape) != tuple(q.shape) \
            or tuple(lse.shape) != _rows(a):
        raise ValueError(f"attention_bwd_dq: O {fmt(o.shape)}, dO {fmt(do.shape)} and LSE "
                         f"{fmt(lse.shape)} must be q's {fmt(q.shape)}, q's and the rows' "
                         f"{fmt(_rows(a))}")
    return [tuple(q.shape), (2, *k.shape), _rows(a)]


def _infer_bwd(*inputs, **a):
    """attention_bwd_dq: dQ in q's dtype, then its further results [dK, dV] (q's dtype) and
    delta (f32)."""
    shape_dq, dtype = _bwd_infer("attention_bwd_dq", 6, _bwd_shapes, stats=(5,),
                                 result="io")(*inputs, **a)
    dq, dkv, rows = shape_dq
    return [(dq, dtype), (dkv, dtype), (rows, dt.F32)]


def _ds_shape(lead, a):
    """attention_bwd_ds: inputs (q, k, v, dO, LSE, delta): dS [B, Hq, Sq, Sk]."""
    q, k, v, do, lse, dl = lead
    if tuple(do.shape) != tuple(q.shape) or tuple(lse.shape) != _rows(a) \
            or tuple(dl.shape) != _rows(a):
        raise ValueError(f"attention_bwd_ds: dO {fmt(do.shape)}, LSE {fmt(lse.shape)} and delta "
                         f"{fmt(dl.shape)} must be q's {fmt(q.shape)} and the rows' "
                         f"{fmt(_rows(a))}")
    return (a["b"], a["hq"], a["sq"], a["sk"])


defop("attention", infer_attention, dtype_rule=F32, tier_env="RLX_NUMBA_ATTENTION_TIERS",
      doc="softmax(scale * q k^T (+ bias), masked) @ v per head (GQA / MQA): cuDNN's fused "
          "attention, the numba tensor-core flash kernel, or numba flash / split-K")
# filled by the forward's kernel (flash, or cuDNN's stats) when it is live (its VJP makes it);
# after a decode kernel its own step (runtime/lower_attention.py)
defop("attention_lse", _bwd_infer("attention_lse", 3, _lse_shape), written_by=0,
      dtype_rule=F32, doc="the rows' log-sum-exp [B, Hq, Sq] of an attention (its VJP's), f32")
defop("attention_bwd_dq", _infer_bwd, dtype_rule=F32, tier_env="RLX_NUMBA_ATTENTION_BWD_TIERS",
      results=(("attention_bwd_dkv", None), ("attention_bwd_delta", None)),
      doc="attention's backward in one node: dQ (q's shape), and its further results [dK, dV] "
          "and delta: cuDNN's fused SDPA backward, the numba tensor-core (mma.sync) kernels, or "
          "the numba f32 delta / dQ / dK-dV kernels")
defop("attention_bwd_dkv", further_result("attention_bwd_dkv", "attention_bwd_dq"),
      written_by=0, dtype_rule=F32,
      doc="[dK, dV] ([2, *k.shape], GQA: summed over a group), filled by attention_bwd_dq")
defop("attention_bwd_delta", further_result("attention_bwd_delta", "attention_bwd_dq"),
      written_by=0, dtype_rule=F32,
      doc="rowsum(dO * O) [B, Hq, Sq], f32, filled by attention_bwd_dq (attention_bwd_ds reads it)")
defop("attention_bwd_ds", _bwd_infer("attention_bwd_ds", 6, _ds_shape, stats=(4, 5)),
      dtype_rule=F32, doc="attention's dS [B, Hq, Sq, Sk] (for a bias gradient), f32, "
                          "FlashAttention-2 style")


class AttentionOps:
    def attention(self, q, k, v, *, causal: bool = False, window: int | None = None, mask=None,
                  bias=None, scale: float | None = None, softcap: float | None = None,
                  num_heads: int | None = None):
        """softmax(scale * q k^T (+ bias), masked) @ v per head; see the module docstring."""
        ins = [self.check("attention", "q", q), self.check("attention", "k", k),
               self.check("attention", "v", v)]
        if mask is not None:
            ins.append(self.check("attention", "mask", mask))
        if bias is not None:
            ins.append(self.check("attention", "bias", bias))
        if not isinstance(causal, bool):
            raise ValueError(f"attention: causal must be a bool, got {causal!r}")
        # the dims (attrs the kernels read) and the default scale need the checked shapes
        dims = attention_dims(q, k, v, mask, bias, num_heads, window, scale, softcap)
        scale = float(scale) if scale is not None else 1.0 / math.sqrt(dims["d"]) if dims["d"] else 1.0
        return self.bind("attention", ins, causal=causal, window=window,
                         has_mask=mask is not None, has_bias=bias is not None, scale=scale,
                         softcap=None if softcap is None else float(softcap),
                         num_heads=num_heads, **dims)


# ---- backward --------------------------------------------------------------------------------
# FlashAttention-2: the VJP recomputes the probabilities from each row's log-sum-exp (saved by
# the forward, kernels/attention_bwd.py) instead of storing them; no node but dS (only
# for a bias gradient) is Sq x Sk. The backward nodes carry the forward node's attributes.

def _attention_parts(g, n):
    """Handles (q, k, v, mask or None, bias or None) of an attention node's inputs."""
    ins = [g.tensor(i) for i in n.inputs]
    rest = ins[3:]
    mask = rest.pop(0) if n.attrs["has_mask"] else None
    bias = rest.pop(0) if n.attrs["has_bias"] else None
    return ins[0], ins[1], ins[2], mask, bias


@vjp("attention")
def _vjp_attention(g, n, dy):
    """dQ, dK, dV (GQA: dK / dV summed over a group's query heads), None for the mask; the
    bias gets dS summed over its broadcast dims (that one node is [B, Hq, Sq, Sk])."""
    a = n.attrs
    q, k, v, mask, bias = _attention_parts(g, n)
    if dy.dtype != q.dtype:           # (as torch's autograd: a gradient takes its tensor's dtype)
        dy = g.cast(dy, q.dtype)
    extra = [t for t in (mask, bias) if t is not None]
    # filled by the forward's kernel, flash or cuDNN's (written_by: it is in the attention's
    # results); after the decode kernel its own step
    o = g.tensor(n.id)
    lse = g.bind("attention_lse", (o, q, k, *extra), **a)
    # one node for dQ, [dK, dV] and delta (cuDNN's backward is one call giving all of them);
    # inside grad(..., deterministic=True) marked so (cuDNN's adds dQ with atomics)
    det = {"deterministic": True} if g.deterministic_grad else {}
    dq, dkv, dl = g.bind("attention_bwd_dq", (q, k, v, o, dy, lse, *extra), **a, **det)
    dk = g.reshape(g.narrow(dkv, 0, 0, 1), k.shape)
    dv = g.reshape(g.narrow(dkv, 0, 1, 1), v.shape)
    grads = [dq, dk, dv]
    if mask is not None:
        grads.append(None)
    if bias is not None:
        ds = g.bind("attention_bwd_ds", (q, k, v, dy, lse, dl, *extra), **a)
        ds = sum_to(g, ds, bias.shape)     # f32
        grads.append(ds if bias.dtype == ds.dtype else g.cast(ds, bias.dtype))
    return grads
