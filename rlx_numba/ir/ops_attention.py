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

Backward (``g.grad``): FlashAttention-2 style, see the VJP at the end and
kernels/attention_bwd.py: attention_lse (the rows' log-sum-exp), attention_bwd_delta
(rowsum(dO * O)), attention_bwd_dq, attention_bwd_dkv ([2, *k.shape]: dK then dV) and, for a
bias gradient only, attention_bwd_ds (dS, [B, Hq, Sq, Sk]).
"""
from __future__ import annotations

import math

from . import dtypes as dt
from .autodiff import sum_to, vjp
from .ops import broadcast_shapes, fmt


def infer_attention(q, k, v, mask, bias, num_heads, window, scale, softcap):
    op = "attention"
    for arg, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != dt.F32:
            raise ValueError(f"{op}: {arg} must be f32, got {t.dtype} {fmt(t.shape)}")
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
    for arg, t, want in (("mask", mask, dt.BOOL), ("bias", bias, dt.F32)):
        if t is None:
            continue
        if t.dtype != want:
            raise ValueError(f"{op}: {arg} must be {want}, got {t.dtype} {fmt(t.shape)}")
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
    dims = dict(b=b, hq=hq, hkv=hkv, sq=sq, sk=sk, d=d)
    return q.shape, dt.F32, dims


class AttentionOps:
    def attention(self, q, k, v, *, causal: bool = False, window: int | None = None, mask=None,
                  bias=None, scale: float | None = None, softcap: float | None = None,
                  num_heads: int | None = None):
        """softmax(scale * q k^T (+ bias), masked) @ v per head; see the module docstring."""
        ins = [self._check("attention", "q", q), self._check("attention", "k", k),
               self._check("attention", "v", v)]
        if mask is not None:
            ins.append(self._check("attention", "mask", mask))
        if bias is not None:
            ins.append(self._check("attention", "bias", bias))
        if not isinstance(causal, bool):
            raise ValueError(f"attention: causal must be a bool, got {causal!r}")
        shape, d, dims = infer_attention(q, k, v, mask, bias, num_heads, window, scale, softcap)
        scale = float(scale) if scale is not None else 1.0 / math.sqrt(dims["d"]) if dims["d"] else 1.0
        return self._add("attention", ins, shape, d, causal=causal, window=window,
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
    extra = [t for t in (mask, bias) if t is not None]
    rows = (a["b"], a["hq"], a["sq"])
    # filled by the forward's flash kernel (WRITTEN_BY_INPUT), else its own step
    lse = g._add("attention_lse", (g.tensor(n.id), q, k, *extra), rows, dt.F32, **a)
    dl = g._add("attention_bwd_delta", (g.tensor(n.id), dy), rows, dt.F32, **a)
    ins = (q, k, v, dy, lse, dl, *extra)
    dq = g._add("attention_bwd_dq", ins, q.shape, dt.F32, **a)
    dkv = g._add("attention_bwd_dkv", ins, (2, *k.shape), dt.F32, **a)
    dk = g.reshape(g.narrow(dkv, 0, 0, 1), k.shape)
    dv = g.reshape(g.narrow(dkv, 0, 1, 1), v.shape)
    grads = [dq, dk, dv]
    if mask is not None:
        grads.append(None)
    if bias is not None:
        ds = g._add("attention_bwd_ds", ins, (a["b"], a["hq"], a["sq"], a["sk"]), dt.F32, **a)
        grads.append(sum_to(g, ds, bias.shape))
    return grads
