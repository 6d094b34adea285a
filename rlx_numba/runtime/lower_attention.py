"""Lowering of attention, three tiers (``RLX_NUMBA_ATTENTION_TIERS``, RLX_NUMBA_LOG_FALLBACK=1
logs why one was passed over): 0, cuDNN's fused attention for f16 / bf16 (tensor cores;
causal, GQA, a bias or a bool mask; with the rows' log-sum-exp when the backward needs it);
1, the numba tensor-core flash kernel (kernels/attention_tc.py: f16 / bf16 prefill on
mma.sync, every mask and attribute of the f32 kernels, the LSE for the backward; in the
simulator only where RLX_NUMBA_ATTENTION_TIERS names it, its mma twins being slow); 2, the
numba f32-accumulating kernels (kernels/attention.py): the prefill (flash) kernel, or the
split-K decode kernel when the queries that share a key/value head are few. Then its backward
(built by attention's VJP in ir/ops_attention.py): one node giving dQ, dK and dV
(attention_bwd_dq), three tiers under ``RLX_NUMBA_ATTENTION_BWD_TIERS``: 0, cuDNN's fused
backward (one call; not with a bias gradient), 1, the numba tensor-core backward for f16 / bf16
(kernels/attention_tc_bwd.py: mma.sync dQ and dK / dV kernels with every mask and attribute of
the forward's; in the simulator only where the variable names it, its mma twins being slow),
2, the numba f32-accumulating kernels (kernels/attention_bwd.py), which run everything.
A forward on one tier and a backward on another agree: cuDNN's softmax stats are our LSE
(cudnn.py). cuDNN builds its graph when tier 0 is considered (_cudnn_builds), so one it has no
engine for falls to the next tier, the reason logged. ``rope_kv_attention`` (passes/fusion.py's
fold of a rope_kv_write into the decode attention after it) lowers here too: the decode kernel
with the rope and the cache write in it."""
from __future__ import annotations

import dataclasses
import os

import numpy as np

from ..kernels import attention as A
from ..kernels import attention_bwd as AB
from ..kernels import attention_tc as ATC
from ..kernels import attention_tc_bwd as ATB
from ..kernels.halfio import io_kind
from ..kernels.launch import default_geometry, sm_count
from .. import cudnn
from ..device import SIMULATOR, device_info
from ..ir import dtypes as dt
from ..ir.opdef import opdef
from .lower import (CallStep, Step, elementwise_step, env_tiers, lowering, pdl_supported,
                    step_name)
from .lower_rope import rope_kv_operands

U = np.uint64


def _bcast_strides(shape, full):
    """Element strides of a contiguous tensor broadcast to ``full`` (4-D): 0 on size-1 dims."""
    shape = (1,) * (len(full) - len(shape)) + tuple(shape)
    strides, acc = [], 1
    for dim in reversed(shape):
        strides.append(0 if dim == 1 else acc)
        acc *= dim
    return list(reversed(strides))


def _aligned16(buf) -> bool:
    return SIMULATOR or buf.device_ctypes_pointer.value % 16 == 0


def _dummy(ctx, dtype):
    return ctx.shared(f"attn_dummy_{np.dtype(dtype).name}", lambda: np.zeros(1, dtype))


def _geom(ctx, n, q, k, mask, bias, q_strides=None):
    """attention's GEOM array (kernels/attention.py) of node ``n``'s attributes; q's element
    strides (batch, head, row) ``q_strides`` where q is not laid out as the output is."""
    a = n.attrs
    b, hq, hkv, sq, sk, d = a["b"], a["hq"], a["hkv"], a["sq"], a["sk"], a["d"]
    full = (b, hq, sq, sk)
    if len(q.shape) == 4:
        qs, ks = (hq * sq * d, sq * d, d), (hkv * sk * d, sk * d, d)
    else:
        qs, ks = (sq * hq * d, d, hq * d), (sk * hkv * d, d, hkv * d)
    ms = _bcast_strides(mask.shape, full) if mask is not None else [0] * 4
    bs = _bcast_strides(bias.shape, full) if bias is not None else [0] * 4
    vals = dict(hq=hq, g=hq // hkv, sq=sq, sk=sk, d=d, q_b=qs[0], q_h=qs[1], q_s=qs[2],
                k_b=ks[0], k_h=ks[1], k_s=ks[2], o_b=qs[0], o_h=qs[1], o_s=qs[2],
                m_b=ms[0], m_h=ms[1], m_q=ms[2], m_k=ms[3], b_b=bs[0], b_h=bs[1], b_q=bs[2],
                b_k=bs[3], window=a["window"] or 0, off=sk - sq)
    if q_strides is not None:
        vals.update(q_b=q_strides[0], q_h=q_strides[1], q_s=q_strides[2])
    return ctx.device_array(np.array([vals[key] for key in A.GEOM], np.int64)), ks


def _masks(ctx, n, rest):
    """(mask node, bias node, their buffers or dummies, the kernels' flags, scale, softcap)
    of an attention node whose trailing inputs are ``rest``."""
    a = n.attrs
    rest = list(rest)
    mask = rest.pop(0) if a["has_mask"] else None
    bias = rest.pop(0) if a["has_bias"] else None
    mbuf = ctx.buf(mask) if mask is not None else _dummy(ctx, np.bool_)
    bbuf = ctx.buf(bias) if bias is not None else _dummy(ctx, np.float32)
    flags = (a["causal"], a["window"] is not None, mask is not None, bias is not None,
             a["softcap"] is not None)
    return mask, bias, mbuf, bbuf, flags, np.float32(a["scale"]), np.float32(a["softcap"] or 1.0)


def _kinds(t, bias):
    """(storage kind of q / k / v (``t``'s dtype), the bias's) for the kernel factories."""
    return io_kind(t.dtype), io_kind(bias.dtype) if bias is not None else "f32"


def _tag(kind) -> str:
    """A step description's dtype tag: none for f32."""
    return "" if kind == "f32" else f" {kind}"


def _vec(kind, d, bufs) -> bool:
    """16-byte loads of f32 q, k, v (...): rows of whole groups of 4 from an aligned start
    (arena slots are 256-byte aligned; a view may start anywhere). Half data is read an
    element at a time."""
    return kind == "f32" and d % 4 == 0 and all(_aligned16(b) for b in bufs)


def _decodes(a) -> bool:
    """attention node attrs ``a`` run the split-K decode kernel (else flash)."""
    return A.decode_rows(a["hq"] // a["hkv"], a["sq"], a["d"]) is not None and a["sk"] > 0


def _sdpa_refusal(a, q, mask, bias):
    """Why cuDNN's fused attention (forward or backward) cannot run an attention of attrs
    ``a`` on q node ``q`` with these mask / bias nodes; None when it can."""
    kind = q.dtype.name
    sq, sk = a["sq"], a["sk"]
    return ("f32 operands (cuDNN's fused attention takes f16 / bf16)" if kind == "f32" else
            "an empty operand (the numba kernels write its zeros)"
            if 0 in (a["b"], a["hq"], sq, sk, a["d"]) else
            "a sliding window" if a["window"] is not None else
            "softcap" if a["softcap"] is not None else
            f"head dim {a['d']} (a multiple of 8 up to 128)" if a["d"] % 8 or a["d"] > 128 else
            "causal with more queries than keys" if a["causal"] and sq > sk else
            "causal with fewer queries than keys and a mask or bias (cuDNN's bottom-right "
            "causal mask takes no bias)"
            if a["causal"] and sq < sk and (mask is not None or bias is not None) else
            "a mask and a bias together" if mask is not None and bias is not None else
            f"a {bias.dtype} bias (cuDNN adds one of q's dtype)"
            if bias is not None and bias.dtype.name != kind else None)


def _cudnn_unavailable(ctx, n):
    """None when cuDNN's fused attention (tier 0) runs attention node ``n``, else why not."""
    if SIMULATOR:
        return "the simulator has no cuDNN"
    g, a = ctx.graph, n.attrs
    ins = [g.nodes[i] for i in n.inputs]
    mask, bias = _mask_and_bias(n, ins[3:])
    why = _sdpa_refusal(a, ins[0], mask, bias) or (
        "few queries a kv head (the split decode kernel)" if _decodes(a) else None)
    why = why or cudnn.frontend()[1]
    return why or _cudnn_builds(ctx, n, ins[0], mask, bias, False,
                                stats=any(r in ctx.live for r in g.nodes[n.id].results))


def _cudnn_bwd_unavailable(ctx, n):
    """None when cuDNN's fused backward (tier 0) runs attention_bwd_dq node ``n`` (dQ, dK, dV
    in one call), else why not."""
    if SIMULATOR:
        return "the simulator has no cuDNN"
    g, a = ctx.graph, n.attrs
    ins = [g.nodes[i] for i in n.inputs]
    mask, bias = _mask_and_bias(n, ins[6:])
    _, delta = _bwd_results(g, n)
    why = _sdpa_refusal(a, ins[0], mask, bias) or (
        "a bias gradient (attention_bwd_ds reads the delta, which cuDNN keeps to itself)"
        if delta in ctx.live else
        "grad(deterministic=True) (cuDNN's fused backward adds dQ with atomics)"
        if a.get("deterministic") else _bwd_bias_dims(a, ins[0], mask, bias)[1])
    why = why or cudnn.frontend()[1]
    return why or _cudnn_builds(ctx, n, ins[0], mask, bias, True,
                                mask_dims=_bwd_bias_dims(a, ins[0], mask, bias)[0])


def _cudnn_builds(ctx, n, q, mask, bias, backward, mask_dims=None, stats=False):
    """None when cuDNN builds the graph of node ``n`` (now, on the program's stream: cached,
    the step's bind reuses it), else why not (an engine it lacks falls to the numba tier
    here, not as an error when the step is bound)."""
    dims_q, dims_kv, sq_, sk_, causal, bias_dims = _sdpa_geometry(n, q, mask, bias, mask_dims)
    kw = dict(dims_q=dims_q, dims_kv=dims_kv, strides_q=sq_, strides_kv=sk_,
              dtype=q.dtype.name, scale=n.attrs["scale"], causal=causal, bias_dims=bias_dims,
              ptrs=None)
    try:
        if backward:
            cudnn.sdpa_backward_plan(ctx.stream, **kw)
        else:
            cudnn.sdpa_plan(ctx.stream, stats=stats, **kw)
    except cudnn.CudnnError as e:
        return f"cuDNN builds no graph for it ({e})"
    return None


_BWD_MASK_BYTES = 256 << 20


def _bwd_bias_dims(a, q, mask, bias):
    """(the dims cuDNN's fused backward reads the additive bias in, None), (None, None)
    without one, or (None, why not). A bias must broadcast as [1, 1 or Hq, Sq, Sk] or
    [B, Hq, Sq, Sk], the shapes its backward engines are known to take (not [B, 1, ...], nor
    a bias broadcast over the queries or keys); a bool mask's bias is made at the smallest of
    those covering the mask, up to _BWD_MASK_BYTES."""
    full = [a["b"], a["hq"], a["sq"], a["sk"]]
    t = bias if bias is not None else mask
    if t is None:
        return None, None
    dims = _dims4(t.shape, full)
    if dims[2:] == full[2:] and (dims[0] == 1 or dims[:2] == full[:2]):
        return dims, None
    if bias is not None:
        return None, (f"a bias broadcast as {dims} (cuDNN's fused backward takes [1, 1 or Hq, "
                      f"Sq, Sk] or [B, Hq, Sq, Sk])")
    dims = [1, dims[1], *full[2:]] if dims[0] == 1 else full
    if int(np.prod(dims)) * q.dtype.itemsize > _BWD_MASK_BYTES:
        return None, f"a mask whose additive bias for cuDNN's fused backward is {dims} (> 256 MiB)"
    return dims, None


def _mask_and_bias(n, rest):
    rest = list(rest)
    mask = rest.pop(0) if n.attrs["has_mask"] else None
    bias = rest.pop(0) if n.attrs["has_bias"] else None
    return mask, bias


def _bwd_results(g, n):
    """The ids of attention_bwd_dq node ``n``'s further results: ([dK, dV], delta)."""
    dkv, delta = g.nodes[n.id].results
    return dkv, delta


def _dims4(shape, full):
    """A mask's / bias's shape as 4 dims broadcast against ``full`` (1 where it broadcasts)."""
    shape = (1,) * (4 - len(shape)) + tuple(shape)
    return [f if s != 1 else 1 for s, f in zip(shape, full)]


def _ptr(buf) -> int:
    return buf.device_ctypes_pointer.value


def _sdpa_args(ctx, n, q, mask, bias, what, ptrs, mask_dims=None):
    """What cuDNN's graphs of attention (or backward) node ``n`` share: (dims_q, dims_kv,
    strides_q, strides_kv, causal, bias_dims, the steps making a bool mask's additive bias),
    the bias's pointer added to ``ptrs`` (the call's operands); None when one of those is off
    a 16-byte boundary (a view may start anywhere; arena slots are 256-byte aligned): cuDNN's
    tensors are declared 16-byte aligned, so the numba tier takes that node (the lowering
    returns None: "does not apply"). A bool mask becomes a bias of q's dtype (0 where kept,
    -inf where masked) made by one element-wise kernel, of the mask's broadcast dims or
    ``mask_dims`` (a broadcast of them)."""
    if bias is not None:
        ptrs["bias"] = _ptr(ctx.buf(bias))
    if any(p % 16 for p in ptrs.values()):
        return None
    dims_q, dims_kv, sq_, sk_, causal, bias_dims = _sdpa_geometry(n, q, mask, bias, mask_dims)
    steps = []
    if bias is None and mask is not None:
        own = _dims4(mask.shape, (dims_q[0], dims_q[1], dims_q[2], dims_kv[2]))
        host = q.dtype.storage
        buf = ctx.device_array(np.empty(int(np.prod(bias_dims)), host))
        consts = [ctx.device_array(np.array([v], np.float32).astype(q.dtype.host).view(host))
                  for v in (0.0, -np.inf)]
        steps.append(elementwise_step(
            f"{step_name(n)} {what} mask bias",
            ("where", None, q.dtype, ("in", 0, dt.BOOL), ("in", 1, q.dtype), ("in", 2, q.dtype)),
            buf, tuple(bias_dims), [ctx.buf(mask)] + consts,
            [tuple(own), (1,), (1,)], [dt.BOOL, q.dtype, q.dtype]))
        ptrs["bias"] = _ptr(buf)
    return dims_q, dims_kv, sq_, sk_, causal, bias_dims, steps


def _sdpa_geometry(n, q, mask, bias, mask_dims=None):
    """(dims_q, dims_kv, strides_q, strides_kv, causal, bias_dims) of cuDNN's graphs of node
    ``n``: [B, H, S, D] dims with the element strides of q's layout (rank 4, or [B, S, H * D]);
    the bias's broadcast dims, or a bool mask's (or ``mask_dims``)."""
    a = n.attrs
    b, hq, hkv, sq, sk, d = a["b"], a["hq"], a["hkv"], a["sq"], a["sk"], a["d"]
    if len(q.shape) == 4:
        sq_, sk_ = (hq * sq * d, sq * d, d, 1), (hkv * sk * d, sk * d, d, 1)
    else:                               # [B, S, H * D]
        sq_, sk_ = (sq * hq * d, d, hq * d, 1), (sk * hkv * d, d, hkv * d, 1)
    full = (b, hq, sq, sk)
    bias_dims = (_dims4(bias.shape, full) if bias is not None else
                 list(mask_dims or _dims4(mask.shape, full)) if mask is not None else None)
    causal = None if not a["causal"] else "top_left" if sq == sk else "bottom_right"
    return (b, hq, sq, d), (b, hkv, sk, d), sq_, sk_, causal, bias_dims


def _sdpa_desc(what, kind, a, causal, bias_dims) -> str:
    return (f"cudnn {what} {kind} D={a['d']} {'causal ' if causal else ''}"
            f"{a['b']}x{a['hq']}/{a['hkv']}x{a['sq']}x{a['sk']}{' +bias' if bias_dims else ''}")


@lowering("attention", tier="cuDNN fused SDPA", available=_cudnn_unavailable)
def _lower_attention_cudnn(ctx, n):
    """One cuDNN fused-attention call (f16 / bf16 q, k, v), with the rows' log-sum-exp (its
    softmax stats) into the attention_lse node when that is live (training). Its flash kernel
    rounds the probabilities to q's dtype for the P V product on tensor cores (as
    FlashAttention-2 does): an output's error is within a few units of roundoff of
    sum_j p_j |v_j|, not of |o| (the numba kernels keep P in f32). A bool mask becomes an
    additive bias (_sdpa_args); a query row that keeps no key comes out 0, as the numba
    kernels' (cuDNN's flash kernel guards an all -inf row; tests/test_attention_half.py checks
    it)."""
    g, a = ctx.graph, n.attrs
    ins = [g.nodes[i] for i in n.inputs]
    q, k, v = ins[:3]
    mask, bias = _mask_and_bias(n, ins[3:])
    kind = q.dtype.name
    ptrs = {"q": _ptr(ctx.buf(q)), "k": _ptr(ctx.buf(k)), "v": _ptr(ctx.buf(v)),
            "o": _ptr(ctx.buf(n))}
    # a live attention_lse of this node (its VJP): cuDNN's stats are those numbers
    lse = [r for r in g.nodes[n.id].results if r in ctx.live]
    if lse:
        ptrs["stats"] = _ptr(ctx.buf(lse[0]))
    args = _sdpa_args(ctx, n, q, mask, bias, "sdpa", ptrs)
    if args is None:
        return None
    dims_q, dims_kv, sq_, sk_, causal, bias_dims, steps = args
    make = lambda stream: cudnn.sdpa_plan(  # noqa: E731
        stream, dims_q=dims_q, dims_kv=dims_kv, strides_q=sq_, strides_kv=sk_, dtype=kind,
        scale=a["scale"], causal=causal, bias_dims=bias_dims, ptrs=ptrs, stats=bool(lse))
    desc = _sdpa_desc("sdpa", kind, a, causal, bias_dims) + (" +lse" if lse else "")
    return steps + [CallStep(step_name(n), desc, make,
                             {"flops": 4 * a["b"] * a["hq"] * a["sq"] * a["sk"] * a["d"],
                              "tier": 0})]


TC_TIER = 1          # the tensor-core flash kernel's place in the ladder


def _tc_unavailable(ctx, n):
    """None when the tensor-core flash kernel (tier 1) runs node ``n``, else why not."""
    g, a = ctx.graph, n.attrs
    ins = [g.nodes[i] for i in n.inputs]
    q, k, v = ins[:3]
    kind = q.dtype.name
    if kind not in ATC.KINDS:
        return f"{kind} operands (it takes f16 / bf16)"
    if SIMULATOR and not _tier_named(TC_TIER):
        return "the simulator runs it only where RLX_NUMBA_ATTENTION_TIERS names it"
    d = a["d"]
    if d % 16 or not 16 <= d <= ATC.MAX_D:
        return f"head dim {d} (a multiple of 16 up to {ATC.MAX_D})"
    if _decodes(a):
        return "few queries a kv head (the split decode kernel)"
    if a["sk"] == 0:
        return "no keys"
    if a["b"] * a["hq"] > 65535:
        return f"{a['b']} x {a['hq']} (batch x heads) blocks past the grid's y limit"
    if not SIMULATOR and device_info()["cc"] < (8, 0):
        return "mma.sync on bf16 / f16 needs compute capability 8.0"
    if not all(_aligned16(ctx.buf(t)) for t in (q, k, v)):
        return "q / k / v not 16-byte aligned (cp.async, Q read a word at a time)"
    return None


def _tier_named(tier: int, op: str = "attention") -> bool:
    """``op``'s tiers variable (RLX_NUMBA_ATTENTION_TIERS, ..._BWD_TIERS) is set and names
    ``tier``."""
    var = opdef(op).tier_env
    if not os.environ.get(var):
        return False
    names = {i: t.name for i, t in enumerate(opdef(op).tiers)}
    return tier in env_tiers(var, names)


def _operands(ctx, n, q_strides=None):
    """((q, k, v), mask buffer, bias buffer, the kernels' flags, scale, softcap, io kinds, GEOM
    array, k's strides) of a prefill / decode attention node ``n`` for the numba tiers."""
    ins = [ctx.graph.nodes[i] for i in n.inputs]
    q, k, v = ins[:3]
    mask, bias, mbuf, bbuf, flags, scale, softcap = _masks(ctx, n, ins[3:])
    geom, ks = _geom(ctx, n, q, k, mask, bias, q_strides)
    return (q, k, v), mbuf, bbuf, flags, scale, softcap, _kinds(q, bias), geom, ks


@lowering("attention", tier="numba tensor-core flash", available=_tc_unavailable)
def _lower_attention_tc(ctx, n):
    """The tensor-core flash kernel (kernels/attention_tc.py) of an f16 / bf16 prefill, with
    the rows' LSE when its attention_lse is live (the VJP's). Its P is rounded to q's dtype
    before P V, as cuDNN's and FlashAttention-2's: an output's error is a few units of
    roundoff of sum_j p_j |v_j|."""
    g, a = ctx.graph, n.attrs
    b, hq, hkv, sq, sk, d = a["b"], a["hq"], a["hkv"], a["sq"], a["sk"], a["d"]
    if b * hq * sq * d == 0:
        return []
    (q, k, v), mbuf, bbuf, flags, scale, softcap, kinds, geom, _ = _operands(ctx, n)
    lse = [r for r in g.nodes[n.id].results if r in ctx.live]
    geo = default_geometry("attention_tc")
    kern = ATC.flash_tc(geo, d, *flags, A.WITH_LSE if lse else A.NO_LSE, *kinds)
    grid, block = ATC.flash_tc_launch(geo, b, hq, sq)
    bits = [ctx.buf(q).view(np.uint16).view(np.uint32)] + [ctx.buf(t).view(np.uint16)
                                                          for t in (k, v)]
    tile = f"{geo.warps}w mi{geo.mi} {geo.keys(d, any(flags[1:]))} keys"
    return [Step(step_name(n), f"attention tc-flash {kinds[0]} D={d} "
                 f"{'causal ' if flags[0] else ''}{b}x{hq}/{hkv}x{sq}x{sk}"
                 f"{' +lse' if lse else ''} {tile}", kern, grid, block,
                 (ctx.buf(n), ctx.buf(lse[0]) if lse else _dummy(ctx, np.float32), *bits,
                  mbuf, bbuf, geom, scale, softcap),
                 {"flops": 4 * b * hq * sq * sk * d, "tier": TC_TIER})]


@lowering("attention", tier="numba flash / split decode")
def _lower_attention(ctx, n):
    """Tier 2: the f32-accumulating kernels (any float dtype, any head dim, decode)."""
    g = ctx.graph
    a = n.attrs
    b, hq, hkv, sq, sk, d = a["b"], a["hq"], a["hkv"], a["sq"], a["sk"], a["d"]
    if b * hq * sq * d == 0:
        return []
    if _decodes(a):                       # few queries a kv head: split the keys instead
        return [_decode_step(ctx, n, _operands(ctx, n), ctx.buf(n.inputs[0]))]
    (q, k, v), mbuf, bbuf, flags, scale, softcap, kinds, geom, ks = _operands(ctx, n)
    args = (ctx.buf(q), ctx.buf(k), ctx.buf(v), mbuf, bbuf, geom, scale, softcap)
    name, flops = step_name(n), {"flops": 4 * b * hq * sq * sk * d}
    geo = default_geometry("attention")
    vec = _vec(kinds[0], d, (ctx.buf(q), ctx.buf(k), ctx.buf(v)))
    # a live attention_lse of this node (its VJP): the kernel saves each row's log-sum-exp
    lse = [r for r in g.nodes[n.id].results if r in ctx.live]
    kern = A.flash(geo, A.head_split(geo, d), vec, *flags, A.WITH_LSE if lse else A.NO_LSE,
                   *kinds)
    grid, block = A.flash_launch(geo, b, hq, sq, d)
    return [Step(name, f"attention flash{_tag(kinds[0])} D={d} {'causal ' if flags[0] else ''}"
                 f"{b}x{hq}x{sq}x{sk}{' +lse' if lse else ''}", kern, grid, block,
                 (ctx.buf(n), ctx.buf(lse[0]) if lse else _dummy(ctx, np.float32), *args),
                 flops)]


def _decode_step(ctx, n, operands, q_buf, rope=None):
    """The split-K decode kernel's step for attention node ``n`` (its ``_operands``), q read
    from ``q_buf``; with ``rope`` (lower_rope.RopeKV) the kernel that folds rope_kv_write in
    (q_buf then the packed qkv, the geometry's q strides its)."""
    a = n.attrs
    b, hq, hkv, sq, sk, d = a["b"], a["hq"], a["hkv"], a["sq"], a["sk"], a["d"]
    (q, k, v), mbuf, bbuf, flags, scale, softcap, kinds, geom, ks = operands
    sm = 1 if SIMULATOR else sm_count()
    geo = default_geometry("attention")
    geo = dataclasses.replace(geo, dec_nw=A.decode_warps(b, hkv, sk, sm, geo.dec_nw))
    splits, chunk = A.decode_plan(b, hkv, sk, sm, geo.dec_nw)
    rows_c, groups = A.decode_groups(A.decode_rows(hq // hkv, sq, d), hq // hkv * sq,
                                     splits * b * hkv, sm)
    dpl = -(-d // 32)
    part = b * hkv * groups * splits * rows_c
    pm, pl = (ctx.device_array(np.zeros(part, np.float32)) for _ in range(2))
    pacc = ctx.device_array(np.zeros(part * 32 * dpl, np.float32))
    count = ctx.device_array(np.zeros(b * hkv * groups, np.int32))   # tickets (kernel resets)
    # (K and V read pair dims a load: the buffers are aligned for that, arena slots being
    # 256-byte aligned and a view starting where its buffer does)
    pdl = pdl_supported()
    if rope is None:
        tkind, desc = "f32", ""
        f32, i64 = _dummy(ctx, np.float32), _dummy(ctx, np.int64)
        rargs = (f32, f32, i64, np.int64(0), False, i64, np.int64(0), False, *(U(0),) * 4,
                 np.int64(0))
    else:
        g = ctx.graph
        rkw = g.nodes[n.attrs["rope_kv_write"]]
        cos, sin = (g.nodes[i] for i in rkw.inputs[1:3])
        tkind, desc = io_kind(cos.dtype), f" +rope_kv_write {rope.layout}"
        rargs = (ctx.buf(cos), ctx.buf(sin), rope.cpos, np.int64(rope.position), rope.use_cpos,
                 rope.pos, np.int64(rope.pos_bstride), rope.use_pos, U(rope.half),
                 U(rope.ncols), U(rope.pair[0]), U(rope.pair[1]), np.int64(rope.max_pos))
    kern = A.decode_split(geo, dpl, rows_c, A.decode_pair(d), *flags, *kinds, pdl,
                          rope is not None, tkind)
    return Step(step_name(n), f"attention decode{_tag(kinds[0])} D={d} {b}x{hq}/{hkv}x{sq}x{sk} "
                f"{splits} splits{f' {groups} row groups' if groups > 1 else ''}{desc}",
                kern, (splits, b * hkv, groups), (geo.dec_nw * 32,),
                (ctx.buf(n), pm, pl, pacc, count, q_buf, ctx.buf(k), ctx.buf(v), mbuf, bbuf, geom,
                 scale, softcap, np.int64(chunk), np.int64(splits),
                 *(np.int64(x) for x in (hkv, sk, *ks)), *rargs),
                {"flops": 4 * b * hq * sq * sk * d, "splits": splits, "chunk": chunk,
                 "rows_c": rows_c}, pdl=pdl)


@lowering("rope_kv_attention")
def _lower_rope_kv_attention(ctx, n):
    """passes/fusion.py's fold of a rope_kv_write into the decode attention over its q and
    caches: inputs rope_kv_write's (qkv, cos, sin, the caches, [cache position],
    [positions]), then the attention's mask / bias. One kernel (kernels/attention.py
    decode_split(rope=True)): each block writes the kv head's new k / v rows that lie among
    its keys, rotates its queries from qkv, and attends; the step declares the caches' bytes
    written."""
    g, a = ctx.graph, n.attrs
    rkw = g.nodes[a["rope_kv_write"]]
    rope = rope_kv_operands(ctx, rkw)     # (also its run() index checks)
    if a["b"] * a["hq"] * a["sq"] * a["d"] == 0:      # (so is qkv: nothing to write)
        return []
    kc, vc = rkw.inputs[3:5]
    # the attention node this one stands for: q rope_kv_write's, k / v the caches
    att = dataclasses.replace(n, op="attention",
                              inputs=(rkw.id, kc, vc) + n.inputs[len(rkw.inputs):])
    nh = a["hq"] + 2 * a["hkv"]
    ops = _operands(ctx, att, q_strides=(a["sq"] * nh * a["d"], a["d"], nh * a["d"]))
    step = _decode_step(ctx, att, ops, ctx.buf(rkw.inputs[0]), rope)
    step.writes = step.writes + [ctx.byte_range(i) for i in (kc, vc)]
    return [step]


# ---- backward (attention's VJP) --------------------------------------------------------------
@lowering("attention_lse")
def _lower_attention_lse(ctx, n):
    """inputs (the attention node, q, k, [mask], [bias]): the rows' log-sum-exp [B, Hq, Sq],
    saved by the forward's flash kernel; after a decode kernel, the flash kernel without its
    P V."""
    g, a = ctx.graph, n.attrs
    if n.size == 0 or (a["d"] > 0 and not _decodes(a)):
        return []
    ins = [g.nodes[i] for i in n.inputs[1:]]
    q, k = ins[:2]
    mask, bias, mbuf, bbuf, flags, scale, softcap = _masks(ctx, n, ins[2:])
    kinds = _kinds(q, bias)
    geom, _ = _geom(ctx, n, q, k, mask, bias)
    vec = _vec(kinds[0], a["d"], (ctx.buf(q), ctx.buf(k)))
    geo = default_geometry("attention")
    grid, block = A.flash_launch(geo, a["b"], a["hq"], a["sq"], a["d"])
    return [Step(step_name(n), f"attention_lse{_tag(kinds[0])} D={a['d']}",
                 AB.lse(geo, A.head_split(geo, a["d"]), vec, *flags, *kinds), grid, block,
                 (_dummy(ctx, np.float32), ctx.buf(n), ctx.buf(q), ctx.buf(k), ctx.buf(k), mbuf,
                  bbuf, geom, scale, softcap),
                 {"flops": 2 * a["b"] * a["hq"] * a["sq"] * a["sk"] * a["d"]})]


@lowering("attention_bwd_dq", tier="cuDNN fused SDPA backward",
          available=_cudnn_bwd_unavailable)
def _lower_attention_bwd_cudnn(ctx, n):
    """inputs (q, k, v, O, dO, LSE, [mask], [bias]): dQ, dK and dV (the attention_bwd_dkv
    result's halves) in one cuDNN call. The LSE is cuDNN's stats convention (cudnn.py); where
    a mask or bias may leave a row with no key, a row whose LSE is -inf (the numba kernels')
    goes in as +inf (a small element-wise step into a scratch), so every exp(s - LSE) of it is
    0 and the row's gradients zeros. cuDNN rounds P (for dV = P^T dO) and dS (for dQ = dS K,
    dK = dS^T Q) to q's dtype for the tensor-core products."""
    g, a = ctx.graph, n.attrs
    ins = [g.nodes[i] for i in n.inputs]
    q, k, v, o, do, lse = ins[:6]
    mask, bias = _mask_and_bias(n, ins[6:])
    kind = q.dtype.name
    dkv, _ = _bwd_results(g, n)
    ptrs = {"q": _ptr(ctx.buf(q)), "k": _ptr(ctx.buf(k)), "v": _ptr(ctx.buf(v)),
            "o": _ptr(ctx.buf(o)), "do": _ptr(ctx.buf(do)), "stats": _ptr(ctx.buf(lse)),
            "dq": _ptr(ctx.buf(n))}
    if dkv in ctx.live:
        ptrs["dk"] = _ptr(ctx.buf(dkv))
    args = _sdpa_args(ctx, n, q, mask, bias, "sdpa_backward", ptrs,
                      _bwd_bias_dims(a, q, mask, bias)[0])
    if args is None:
        return None
    dims_q, dims_kv, sq_, sk_, causal, bias_dims, steps = args
    if dkv not in ctx.live:             # dK / dV not wanted: cuDNN writes them somewhere
        ptrs["dk"] = _ptr(ctx.device_array(np.empty(2 * k.size, q.dtype.storage)))
    ptrs["dv"] = ptrs["dk"] + k.size * q.dtype.itemsize     # [dK, dV]: dV the second half
    if mask is not None or bias is not None:
        guarded = ctx.device_array(np.empty(lse.size, np.float32))
        consts = [ctx.device_array(np.array([x], np.float32)) for x in (-np.inf, np.inf)]
        steps.append(elementwise_step(
            f"{step_name(n)} lse guard",
            ("where", None, dt.F32, ("compare", "gt", dt.BOOL, ("in", 0, dt.F32),
                                     ("in", 1, dt.F32)),
             ("in", 0, dt.F32), ("in", 2, dt.F32)),
            guarded, (lse.size,), [ctx.buf(lse)] + consts, [(lse.size,), (1,), (1,)],
            [dt.F32, dt.F32, dt.F32]))
        ptrs["stats"] = _ptr(guarded)
    make = lambda stream: cudnn.sdpa_backward_plan(  # noqa: E731
        stream, dims_q=dims_q, dims_kv=dims_kv, strides_q=sq_, strides_kv=sk_, dtype=kind,
        scale=a["scale"], causal=causal, bias_dims=bias_dims, ptrs=ptrs)
    return steps + [CallStep(step_name(n), _sdpa_desc("sdpa_backward", kind, a, causal,
                                                      bias_dims), make,
                             {"flops": 10 * a["b"] * a["hq"] * a["sq"] * a["sk"] * a["d"],
                              "tier": 0})]


def _grads_step(ctx, n, kind, out, q, k, v, do, lse, dl, bias, mbuf, bbuf, flags, scale,
                softcap, geom, nk=0):
    """The numba kernel writing ``out``: dQ, dS or [dK, dV] (``kind``; ``nk`` elements of dK
    before dV) from the buffers ``lse`` and ``dl`` (LSE and delta)."""
    a = n.attrs
    kinds = _kinds(q, bias)
    vec = _vec(kinds[0], a["d"], tuple(ctx.buf(t) for t in (q, k, v, do)))
    args = (out, ctx.buf(q), ctx.buf(k), ctx.buf(v), ctx.buf(do), lse, dl, mbuf, bbuf, geom,
            scale, softcap, np.int64(nk))
    per = {AB.DQ: 6, AB.DS: 4, AB.DKV: 8}[kind]
    flops = {"flops": per * a["b"] * a["hq"] * a["sq"] * a["sk"] * a["d"]}   # 2 a product
    op = {AB.DQ: "attention_bwd_dq", AB.DS: "attention_bwd_ds", AB.DKV: "attention_bwd_dkv"}
    desc = f"{op[kind]}{_tag(kinds[0])} D={a['d']} {'causal ' if a['causal'] else ''}" \
           f"{a['b']}x{a['hq']}/{a['hkv']}x{a['sq']}x{a['sk']}"
    geo = default_geometry("attention")
    grid, block = AB.launch(geo, kind, a["b"], a["hq"], a["hkv"], a["sq"], a["sk"], a["d"])
    return Step(step_name(n), desc, AB.grads(geo, kind, A.head_split(geo, a["d"]), vec, *flags,
                                             *kinds), grid, block, args, flops)


def _delta_step(ctx, n, o, do, lse, delta, geom):
    """(the delta kernel's steps, the Dl buffer): rowsum(dO * O) into the attention_bwd_delta
    result, or a scratch of node ``n``'s own when nothing reads it; no step without rows."""
    rows = lse.size
    if not rows:
        return [], _dummy(ctx, np.float32)
    dl = ctx.buf(delta) if delta in ctx.live else ctx.device_array(np.empty(rows, np.float32))
    geo = default_geometry("attention")
    grid, block = AB.launch_delta(geo, rows)
    return [Step(step_name(n), "attention_bwd_delta", AB.delta(geo, io_kind(o.dtype)), grid, block,
                 (dl, ctx.buf(o), ctx.buf(do), geom, np.int64(rows)))], dl


TC_BWD_TIER = 1      # the tensor-core backward's place in attention_bwd_dq's ladder


def _tc_bwd_unavailable(ctx, n):
    """None when the tensor-core backward (tier 1) runs attention_bwd_dq node ``n``, else why
    not (those fall to tier 2, which runs every attribute)."""
    g, a = ctx.graph, n.attrs
    ins = [g.nodes[i] for i in n.inputs]
    q, k, v, _, do = ins[:5]
    kind = q.dtype.name
    if kind not in ATB.KINDS:
        return f"{kind} operands (it takes f16 / bf16)"
    if SIMULATOR and not _tier_named(TC_BWD_TIER, "attention_bwd_dq"):
        # its mma twins are slow there
        return "the simulator runs it only where RLX_NUMBA_ATTENTION_BWD_TIERS names it"
    d = a["d"]
    if d % 16 or not 16 <= d <= ATB.MAX_D:
        return f"head dim {d} (a multiple of 16 up to {ATB.MAX_D})"
    if max(a["b"] * a["hq"], a["b"] * a["hkv"]) > 65535:
        return f"{a['b']} x {a['hq']} (batch x heads) blocks past the grid's y limit"
    if not SIMULATOR and device_info()["cc"] < (8, 0):
        return "mma.sync on bf16 / f16 needs compute capability 8.0"
    if not all(_aligned16(ctx.buf(t)) for t in (q, k, v, do)):
        return "q / k / v / dO not 16-byte aligned (cp.async)"
    return None


def _bwd_operands(ctx, n):
    """What both numba backward tiers of attention_bwd_dq node ``n`` read: its operands, masks
    and flags, the dK / dV result, the geometry array, and the delta step with its buffer."""
    g = ctx.graph
    ins = [g.nodes[i] for i in n.inputs]
    q, k, v, o, do, lse = ins[:6]
    mask, bias, mbuf, bbuf, flags, scale, softcap = _masks(ctx, n, ins[6:])
    dkv, delta = _bwd_results(g, n)
    geom, _ = _geom(ctx, n, q, k, mask, bias)
    steps, dl = _delta_step(ctx, n, o, do, lse, delta, geom)
    return q, k, v, do, lse, bias, mbuf, bbuf, flags, scale, softcap, dkv, geom, steps, dl


@lowering("attention_bwd_dq", tier="numba tensor-core backward", available=_tc_bwd_unavailable)
def _lower_attention_bwd_tc(ctx, n):
    """inputs (q, k, v, O, dO, LSE, [mask], [bias]): the delta kernel (into the
    attention_bwd_delta result when a bias gradient reads it), then the tensor-core dQ kernel
    (this node) and dK / dV kernel (the attention_bwd_dkv result), each skipped when its output
    is empty. P and dS are rounded to q's dtype for the products (as cuDNN and
    FlashAttention-2): a gradient's error is a few u of the magnitudes of its sums. No atomics
    (a GQA group's dK / dV are summed in one block): grad(deterministic=True) runs here too."""
    a = n.attrs
    (q, k, v, do, lse, bias, mbuf, bbuf, flags, scale, softcap, dkv, geom, steps,
     dl) = _bwd_operands(ctx, n)
    kind, d = q.dtype.name, a["d"]
    geo = default_geometry("attention_tc_bwd")
    lse_buf = ctx.buf(lse) if lse.size else _dummy(ctx, np.float32)
    bits = [ctx.buf(t).view(np.uint16) for t in (q, k, v, do)]
    dims = f"{a['b']}x{a['hq']}/{a['hkv']}x{a['sq']}x{a['sk']}"
    for which, out, size, name, per in ((ATB.DQ, n, n.size, "dq", 6),
                                        (ATB.DKV, dkv, k.size, "dkv", 8)):
        if not size or (which == ATB.DKV and dkv not in ctx.live):
            continue
        kern = ATB.grads_tc(geo, which, d, *flags, *_kinds(q, bias))
        grid, block = ATB.launch(geo, which, a["b"], a["hq"], a["hkv"], a["sq"], a["sk"])
        steps.append(Step(step_name(n), f"attention_bwd_{name} tc {kind} D={d} "
                          f"{'causal ' if a['causal'] else ''}{dims} {geo.warps}w "
                          f"{geo.cols(d, sum(flags))} cols", kern, grid, block,
                          (ctx.buf(out), *bits, lse_buf, dl, mbuf, bbuf, geom, scale,
                           softcap, np.int64(k.size)),
                          {"flops": per * a["b"] * a["hq"] * a["sq"] * a["sk"] * d,
                           "tier": TC_BWD_TIER}))
    return steps


@lowering("attention_bwd_dq", tier="numba delta / dQ / dK-dV kernels")
def _lower_attention_bwd(ctx, n):
    """inputs (q, k, v, O, dO, LSE, [mask], [bias]): the delta kernel (``_delta_step``), then
    the dQ kernel (this node) and the dK / dV kernel (the attention_bwd_dkv result), each
    skipped when its output is empty (no queries: dK and dV are still written, zeros)."""
    (q, k, v, do, lse, bias, mbuf, bbuf, flags, scale, softcap, dkv, geom, steps,
     dl) = _bwd_operands(ctx, n)
    common = (q, k, v, do, ctx.buf(lse) if lse.size else _dummy(ctx, np.float32), dl, bias,
              mbuf, bbuf, flags, scale, softcap, geom)
    if n.size:
        steps.append(_grads_step(ctx, n, AB.DQ, ctx.buf(n), *common))
    if dkv in ctx.live and k.size:
        steps.append(_grads_step(ctx, n, AB.DKV, ctx.buf(dkv), *common, nk=k.size))
    return steps


@lowering("attention_bwd_dkv", "attention_bwd_delta")
def _lower_attention_bwd_results(ctx, n):
    return []   # written by their attention_bwd_dq node's steps


@lowering("attention_bwd_ds")
def _lower_attention_bwd_ds(ctx, n):
    """inputs (q, k, v, dO, LSE, delta, [mask], [bias]): dS [B, Hq, Sq, Sk] (for a bias
    gradient)."""
    g = ctx.graph
    if n.size == 0:
        return []
    ins = [g.nodes[i] for i in n.inputs]
    q, k, v, do, lse, dl = ins[:6]
    mask, bias, mbuf, bbuf, flags, scale, softcap = _masks(ctx, n, ins[6:])
    geom, _ = _geom(ctx, n, q, k, mask, bias)
    return [_grads_step(ctx, n, AB.DS, ctx.buf(n), q, k, v, do, ctx.buf(lse), ctx.buf(dl), bias,
                        mbuf, bbuf, flags, scale, softcap, geom)]
