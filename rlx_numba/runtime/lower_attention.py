"""Lowering of attention (kernels in kernels/attention.py): the prefill (flash) kernel, or the
split-K decode kernel when the queries that share a key/value head are few."""
from __future__ import annotations

import numpy as np

from ..kernels import attention as A
from ..kernels.launch import sm_count
from ..device import SIMULATOR
from .lower import Step, lowering, step_name


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


def _dummy(exe, dtype):
    key = f"_attn_dummy_{np.dtype(dtype).name}"
    if not hasattr(exe, key):
        setattr(exe, key, exe.device_array(np.zeros(1, dtype)))
    return getattr(exe, key)


@lowering("attention")
def _lower_attention(exe, n):
    g = exe.graph
    a = n.attrs
    b, hq, hkv, sq, sk, d = a["b"], a["hq"], a["hkv"], a["sq"], a["sk"], a["d"]
    if b * hq * sq * d == 0:
        return []
    ins = [g.nodes[i] for i in n.inputs]
    q, k, v = ins[:3]
    rest = ins[3:]
    mask = rest.pop(0) if a["has_mask"] else None
    bias = rest.pop(0) if a["has_bias"] else None
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
    geom = exe.device_array(np.array([vals[key] for key in A.GEOM], np.int64))
    mbuf = exe.buf(mask) if mask is not None else _dummy(exe, np.bool_)
    bbuf = exe.buf(bias) if bias is not None else _dummy(exe, np.float32)
    scale = np.float32(a["scale"])
    softcap = np.float32(a["softcap"] or 1.0)
    flags = (a["causal"], a["window"] is not None, mask is not None, bias is not None,
             a["softcap"] is not None)
    args = (exe.buf(q), exe.buf(k), exe.buf(v), mbuf, bbuf, geom, scale, softcap)
    name, flops = step_name(n), {"flops": 4 * b * hq * sq * sk * d}
    rows_c = A.decode_rows(hq // hkv, sq, d)
    if rows_c is not None and sk > 0:      # few queries a kv head: split the keys instead
        dpl = -(-d // 32)
        sm = 1 if SIMULATOR else sm_count()
        splits, chunk = A.decode_plan(b, hkv, sk, sm)
        rows_c, groups = A.decode_groups(rows_c, hq // hkv * sq, splits * b * hkv, sm)
        part = b * hkv * groups * splits * rows_c
        pm, pl = (exe.device_array(np.zeros(part, np.float32)) for _ in range(2))
        pacc = exe.device_array(np.zeros(part * 32 * dpl, np.float32))
        count = exe.device_array(np.zeros(b * hkv * groups, np.int32))   # tickets (kernel resets)
        # (K and V read pair dims a load: the buffers are aligned for that, arena slots being
        # 256-byte aligned and a view starting where its buffer does)
        kern = A.decode_split(dpl, rows_c, A.decode_pair(d), *flags)
        return [Step(name, f"attention decode D={d} {b}x{hq}/{hkv}x{sq}x{sk} {splits} splits"
                     f"{f' {groups} row groups' if groups > 1 else ''}",
                     kern, (splits, b * hkv, groups), (A.DEC_NW * 32,),
                     (exe.buf(n), pm, pl, pacc, count, *args, np.int64(chunk),
                      np.int64(splits), *(np.int64(x) for x in (hkv, sk, *ks))),
                     {**flops, "splits": splits, "chunk": chunk, "rows_c": rows_c})]
    # 16-byte loads of q, k, v: rows of whole groups of 4 from an aligned start (arena slots
    # are 256-byte aligned; a view may start anywhere)
    vec = d % 4 == 0 and all(_aligned16(exe.buf(t)) for t in (q, k, v))
    kern = A.flash(A.head_split(d), vec, *flags)
    grid, block = A.flash_launch(b, hq, sq, d)
    return [Step(name, f"attention flash D={d} {'causal ' if flags[0] else ''}"
                 f"{b}x{hq}x{sq}x{sk}", kern, grid, block, (exe.buf(n), *args), flops)]
