"""Lowering of the ops in ir/ops_rope.py (kernels in kernels/rope.py).

rope_kv_write's node is q; its caches come back as ``kv_written`` nodes (in-place aliases of the
caches, its further results: OpDef written_by) that its kernel fills and that lower to nothing.

kv_write is an in-place op (its OpDef's memory kind INPLACE): the executable gives its result the memory of its
input 0 (the cache), so the kernel here only writes the new rows into ``ctx.buf(n)``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ir.ops import fmt
from ..kernels import rope as k
from ..kernels.halfio import io_kind
from ..kernels.launch import block_rows, grid_3d, waves_cap
from ..kernels.shape import SPAN
from .lower import Step, lowering, pdl_supported, step_name

U = np.uint64
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _dummy(ctx):
    """A one-element i64 array for the kernels' unused position argument."""
    return ctx.shared("rope_dummy", lambda: np.zeros(1, np.int64))


def _geometry(ncols, nrows, per_thread=1):
    """(grid, block) for x along rows of ncols items (per_thread each a trip), y over rows."""
    tx, ty = block_rows(-(-ncols // per_thread))
    cap = waves_cap(tx * ty)
    gx = min(-(-ncols // (tx * per_thread)), cap)
    gy = min(-(-nrows // ty), max(1, cap // gx))
    return grid_3d(gx, gy), (tx, ty)


@lowering("rope")
def _lower_rope(ctx, n):
    g = ctx.graph
    x, cos, sin = (g.nodes[i] for i in n.inputs[:3])
    if len(x.shape) == 4:
        b, h, s, d = x.shape
    else:
        (b, s, d), h = x.shape, 1
    n_rot = n.attrs["n_rot"]
    half = n_rot // 2
    max_pos = cos.shape[0]
    pos = _dummy(ctx)
    use_pos, pos_bstride = False, 0
    if len(n.inputs) > 3:
        pnode = g.nodes[n.inputs[3]]
        ctx.add_index_check(pnode, 0, max_pos - 1,
                            f"rope %{n.id} (x {fmt(x.shape)}, positions of cos/sin "
                            f"{fmt(cos.shape)})")
        pos, use_pos = ctx.buf(pnode), True
        pos_bstride = s if len(pnode.shape) == 2 else 0
    if n.size == 0:
        return []
    ngroups = -(-h // k.HPT)
    ncols = half + (d - n_rot)
    nrows = b * ngroups * s
    mul, gap = (2, 1) if n.attrs["interleaved"] else (1, half)
    grid, block = _geometry(ncols, nrows)
    args = (ctx.buf(n), ctx.buf(x), ctx.buf(cos), ctx.buf(sin), pos, U(nrows), U(s), U(h),
            U(ngroups), U(d), U(half), U(ncols), U(mul), U(gap), U(n.attrs["position_offset"]),
            U(pos_bstride), use_pos, np.int64(max_pos))
    layout = "gptj" if n.attrs["interleaved"] else "neox"
    kern = k.rope(io_kind(x.dtype), io_kind(cos.dtype))
    return [Step(step_name(n), f"rope {layout} n_rot={n_rot}/{d}", kern, grid, block, args,
                 {"bytes": 2 * x.nbytes + 2 * cos.dtype.itemsize * b * s * half})]


@lowering("kv_write")
def _lower_kv_write(ctx, n):
    g = ctx.graph
    cache, new = g.nodes[n.inputs[0]], g.nodes[n.inputs[1]]
    b, h, max_s, d = cache.shape
    s = new.shape[2]
    pos, use_pos, position = _dummy(ctx), False, n.attrs["position"]
    if len(n.inputs) > 2:
        pnode = g.nodes[n.inputs[2]]
        ctx.add_index_check(pnode, 0, max_s - s,
                            f"kv_write %{n.id} (cache {fmt(cache.shape)}, new {fmt(new.shape)})")
        pos, use_pos, position = ctx.buf(pnode), True, 0
    if new.size == 0:
        return []
    nrows = b * h * s
    width = _UINT[new.dtype.itemsize]
    grid, block = _geometry(d, nrows, SPAN)
    args = (ctx.buf(n).view(width), ctx.buf(new).view(width), pos, np.int64(position), use_pos,
            U(nrows), U(s), U(max_s), U(d))
    return [Step(step_name(n), f"kv_write {nrows}x{d} into {max_s} rows", k.kv_write, grid, block,
                 args, {"bytes": 2 * new.nbytes})]


@dataclass
class RopeKV:
    """What a rope_kv_write node's kernel takes besides its arrays (qkv, q and the caches),
    also what the decode attention kernel that folds it in takes
    (runtime/lower_attention.py): the cache position (``cpos`` a device array when
    ``use_cpos``, else ``position``), the per-token rope positions (``pos`` when ``use_pos``,
    ``pos_bstride`` apart a batch row), the geometry."""
    cpos: object
    position: int
    use_cpos: bool
    pos: object
    pos_bstride: int
    use_pos: bool
    b: int
    s: int
    hq: int
    hkv: int
    d: int
    n_rot: int
    interleaved: bool
    max_s: int
    max_pos: int

    @property
    def half(self):
        return self.n_rot // 2

    @property
    def ncols(self):            # a head's work items: the rotated pairs, the passed-through dims
        return self.half + self.d - self.n_rot

    @property
    def pair(self):             # (pair_mul, pair_gap): pair i is columns (i mul, i mul + gap)
        return (2, 1) if self.interleaved else (1, self.half)

    @property
    def layout(self):
        return f"{'gptj' if self.interleaved else 'neox'} n_rot={self.n_rot}/{self.d}"


def rope_kv_operands(ctx, n) -> RopeKV:
    """The RopeKV of rope_kv_write node ``n`` (a graph node); registers its run() index
    checks (the cache position, the positions)."""
    g = ctx.graph
    a = n.attrs
    qkv, cos, sin, kc, vc = (g.nodes[i] for i in n.inputs[:5])
    rest = [g.nodes[i] for i in n.inputs[5:]]
    b, hkv, max_s, d = kc.shape
    s, max_pos = qkv.shape[1], cos.shape[0]
    what = f"rope_kv_write %{n.id} (qkv {fmt(qkv.shape)}, caches {fmt(kc.shape)}"
    cpos, use_cpos, position = _dummy(ctx), False, a["cache_position"]
    if position is None:
        pnode = rest.pop(0)
        # without positions it is also the rope position of the first token: within cos/sin
        hi = max_s - s if a["has_positions"] else min(max_s, max_pos) - s
        ctx.add_index_check(pnode, 0, hi, what + (")" if a["has_positions"] else
                                                  f", cos/sin {fmt(cos.shape)})"))
        cpos, use_cpos, position = ctx.buf(pnode), True, 0
    pos, use_pos, pos_bstride = _dummy(ctx), False, 0
    if a["has_positions"]:
        pnode = rest.pop(0)
        ctx.add_index_check(pnode, 0, max_pos - 1, what + f", positions of cos/sin "
                            f"{fmt(cos.shape)})")
        pos, use_pos, pos_bstride = ctx.buf(pnode), True, (s if len(pnode.shape) == 2 else 0)
    return RopeKV(cpos, position, use_cpos, pos, pos_bstride, use_pos, b, s, a["num_heads"], hkv,
                  d, a["n_rot"], a["interleaved"], max_s, max_pos)


@lowering("rope_kv_write")
def _lower_rope_kv_write(ctx, n):
    g = ctx.graph
    qkv, cos, sin, kc, vc = (g.nodes[i] for i in n.inputs[:5])
    r = rope_kv_operands(ctx, n)
    if qkv.size == 0:
        return []
    nh = r.hq + 2 * r.hkv
    nrows = r.b * r.s * nh
    grid, block = _geometry(r.d, nrows)
    # the kv_written results alias the caches: their buffers are the caches' own
    args = (ctx.buf(n), ctx.buf(kc), ctx.buf(vc), ctx.buf(qkv), ctx.buf(cos), ctx.buf(sin),
            r.cpos, np.int64(r.position), r.use_cpos, r.pos, U(r.pos_bstride), r.use_pos,
            U(nrows), U(r.s), U(r.hq), U(r.hkv), U(nh), U(r.d), U(r.half), U(r.ncols),
            U(r.pair[0]), U(r.pair[1]), U(r.max_s), np.int64(r.max_pos))
    pdl = pdl_supported()
    kern = k.rope_kv_write(io_kind(qkv.dtype), io_kind(cos.dtype), pdl)
    return [Step(step_name(n), f"rope_kv_write {r.layout} {r.b}x{r.s} heads {r.hq}/{r.hkv}",
                 kern, grid, block, args,
                 {"bytes": 2 * qkv.nbytes + 2 * cos.dtype.itemsize * r.b * r.s * r.half},
                 pdl=pdl)]


@lowering("kv_written")
def _lower_kv_written(ctx, n):
    return []       # filled by its rope_kv_write's kernel (input 1)
