"""Lowering of the ops in ir/ops_sample.py (kernels in kernels/sample.py).

topk over rows of n (x seen as [rows, n], the axis last):
  * n <= SMALL_N: ``topk_small``, a thread per row;
  * rows too few to fill the GPU and k small next to n: two stages, ``topk_segments`` (a block
    per row segment: its exact top k candidates) then ``topk_rows`` over the S*k candidates;
  * else ``topk_rows`` over the row itself.
``topk_rows`` sorts the k winners in shared memory when pow2(k) <= the geometry's smem_sort, else in a
global scratch row. topk_values is ``gather_rows``.

sample over rows of n (greedy never gets here: the builder makes it argmax):
  * n <= SMALL_N: ``sample_small``, a thread per row;
  * top_k > 0: the topk stages (NaN lowest) write each row's top_k keys sorted by index, then
    ``sample_rows`` draws over those k (top_p, if any, among them);
  * no top_k, no top_p, rows that split into segments: ``sample_seg_max``,
    ``sample_seg_mass`` (grid-wide) and ``sample_pick`` (a block per row);
  * else (top_p alone, or rows too short to split) ``sample_rows`` over the whole row.

Temporaries (candidates, sort scratch, key lists, the seed of an int seed) are small device
arrays owned by the executable.
"""
from __future__ import annotations

import math

import numpy as np

from ..kernels import sample as K
from ..kernels.launch import default_geometry, grid_1d, pow2_at_least, sm_count
from ..device import SIMULATOR
from .lower import Step, lowering, step_name

_U = np.uint64


def _blocks(n: int, block: int) -> int:
    """Blocks of a block-per-item kernel (grid-stride over the rest)."""
    cap = 2 if SIMULATOR else sm_count() * max(1, 2048 // block) * 4
    return max(1, min(n, cap))


def _block_for(m: int) -> int:
    """Threads of a block that works on m elements: ~8 a thread, 64..1024 (or the
    geometry's fixed block: the simulator's)."""
    geo = default_geometry("sample")
    if geo.block:
        return geo.block
    return min(1024, max(64, pow2_at_least(-(-m // 8))))


def _segments(rows: int, n: int, k: int):
    """(nseg, seg): rows cut into segments of seg elements so that rows * nseg blocks fill
    the GPU, each segment at most seg_max (staged in shared memory by topk) and at least
    min_seg and 8k (topk's candidates are then at most n/8); nseg 1 when that cannot be."""
    geo = default_geometry("sample")
    want, min_seg = geo.seg_want or 2 * sm_count(), geo.min_seg
    nseg = max(-(-want // rows), -(-n // geo.seg_max))
    seg = -(-n // nseg) if nseg > 1 else n
    seg = -(-seg // 32) * 32                  # segments start on 128-byte boundaries (f32)
    nseg = -(-n // seg)
    if nseg >= 2 and seg <= geo.seg_max and seg >= max(min_seg, 8 * k):
        return nseg, seg
    return 1, n


def topk_plan(rows: int, n: int, k: int) -> dict:
    """How topk of [rows, n] runs: mode "small", "one" or "two" (and its geometry)."""
    if n <= K.SMALL_N:
        return {"mode": "small"}
    geo = default_geometry("sample")
    kp = pow2_at_least(k)
    plan = {"kp": kp, "smem": kp <= geo.smem_sort}
    nseg, seg = _segments(rows, n, k)
    if nseg >= 2:
        m = nseg * k
        plan.update(mode="two", nseg=nseg, seg=seg, block1=geo.seg_block, seg_max=geo.seg_max)
    else:
        m = n
        plan.update(mode="one")
    slots = pow2_at_least(m)
    plan["block"] = _block_for(m)
    plan["stage"] = slots if slots + (kp if plan["smem"] else 0) <= geo.smem_keys else 0
    return plan


def _topk_steps(ctx, name, out, x_buf, ld, rows, n, k, plan, out_kind, nan_low, nbytes,
                itemsize):
    """Steps writing out [rows, k]: indices sorted by key (IDX_OUT) or keys by index."""
    kp, smem = plan["kp"], plan["smem"]
    scratch = ctx.device_array(np.zeros(1 if smem else rows * kp, np.uint64))
    steps = []
    src, mm = x_buf, n
    if plan["mode"] == "two":
        nseg, seg, b1 = plan["nseg"], plan["seg"], plan["block1"]
        cand = ctx.device_array(np.zeros(rows * nseg * k, np.uint64))
        k1 = K.topk_segments(ld, b1, nan_low, plan["seg_max"])
        steps.append(Step(name + " candidates", f"topk_segments {rows}x{nseg} segments of {seg}",
                          k1, (_blocks(rows * nseg, b1),), (b1,),
                          (cand, x_buf, _U(rows * nseg), _U(n), _U(nseg), _U(seg), _U(k)),
                          {"bytes": nbytes}))
        src, mm, ld = cand, nseg * k, "keys"
    block = plan["block"]
    k2 = K.topk_rows(ld, block, kp, smem, plan["stage"], out_kind, nan_low)
    where = "smem" if smem else "global"
    staged = " staged" if plan["stage"] else ""
    steps.append(Step(name, f"topk_rows{staged} [{rows}, {mm}] k={k} sort {kp} in {where}", k2,
                      (_blocks(rows, block),), (block,),
                      (out, src, scratch, _U(rows), _U(mm), _U(k)),
                      {"bytes": rows * mm * (8 if ld == "keys" else itemsize) + rows * k * 8}))
    return steps


@lowering("topk")
def _lower_topk(ctx, n):
    x = ctx.graph.nodes[n.inputs[0]]
    if n.size == 0:
        return []
    k = n.attrs["k"]
    cols = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    name = step_name(n)
    plan = topk_plan(rows, cols, k)
    nbytes = x.size * x.dtype.itemsize
    if plan["mode"] == "small":
        blocks, threads = grid_1d(rows)
        return [Step(name, f"topk_small [{rows}, {cols}] k={k}", K.topk_small(x.dtype.name),
                     (blocks,), (threads,), (ctx.buf(n), ctx.buf(x), _U(rows), _U(cols), _U(k)),
                     {"bytes": nbytes + n.size * 8})]
    return _topk_steps(ctx, name, ctx.buf(n), ctx.buf(x), x.dtype.name, rows, cols, k, plan,
                       K.IDX_OUT, False, nbytes, x.dtype.itemsize)


@lowering("topk_values")
def _lower_topk_values(ctx, n):
    x = ctx.graph.nodes[n.inputs[0]]
    idx = ctx.graph.nodes[n.inputs[1]]
    if n.size == 0:
        return []
    k, cols = n.shape[-1], x.shape[-1]
    blocks, threads = grid_1d(n.size)
    return [Step(step_name(n), f"gather_rows k={k}", K.gather_rows, (blocks,), (threads,),
                 (ctx.buf(n), ctx.buf(x), ctx.buf(idx), _U(n.size), _U(cols), _U(k)),
                 {"bytes": n.size * (8 + 2 * x.dtype.itemsize)})]


@lowering("sample")
def _lower_sample(ctx, n):
    g = ctx.graph
    x = g.nodes[n.inputs[0]]
    if n.size == 0:
        return []
    cols = x.shape[-1]
    rows = n.size
    name = step_name(n)
    a = n.attrs
    if len(n.inputs) > 1:
        seed = ctx.buf(g.nodes[n.inputs[1]])
    else:
        seed = ctx.device_array(np.array([a["seed"]], np.uint64).view(np.int64))
    inv_t = np.float32(1.0 / a["temperature"])
    has_p = a["top_p"] < 1.0
    p = _U(K.top_p_fixed(a["top_p"]) if has_p else 0)
    top_k = a["top_k"]
    ld = x.dtype.name
    nbytes = x.size * x.dtype.itemsize
    what = f"T={a['temperature']:g} top_k={top_k} top_p={a['top_p']:g}"
    if cols <= K.SMALL_N:
        scale = np.float32(2.0 ** K.frac_bits(cols))
        blocks, threads = grid_1d(rows)
        return [Step(name, f"sample_small [{rows}, {cols}] {what}", K.sample_small(ld),
                     (blocks,), (threads,),
                     (ctx.buf(n), ctx.buf(x), seed, _U(rows), _U(cols), _U(top_k), has_p, p,
                      inv_t, scale), {"bytes": nbytes})]
    steps = []
    if top_k == 0 and not has_p:
        nseg, seg = _segments(rows, cols, 1)
        if nseg >= 2:
            return _sample_segments(ctx, name, n, x, seed, rows, cols, nseg, seg, inv_t, what)
    src, mm = ctx.buf(x), cols
    if top_k > 0:
        keys = ctx.device_array(np.zeros(rows * top_k, np.uint64))
        plan = topk_plan(rows, cols, top_k)
        steps += _topk_steps(ctx, name + " top_k", keys, ctx.buf(x), ld, rows, cols, top_k, plan,
                             K.KEYS_BY_INDEX, True, nbytes, x.dtype.itemsize)
        src, mm, ld = keys, top_k, "keys"
    block = _block_for(mm)
    scale = np.float32(2.0 ** K.frac_bits(mm))
    kern = K.sample_rows(ld, block, has_p)
    steps.append(Step(name, f"sample_rows [{rows}, {mm}] {what}", kern,
                      (_blocks(rows, block),), (block,),
                      (ctx.buf(n), src, seed, _U(rows), _U(mm), p, inv_t, scale),
                      {"bytes": rows * mm * (8 if ld == "keys" else x.dtype.itemsize)}))
    return steps


def _sample_segments(ctx, name, n, x, seed, rows, cols, nseg, seg, inv_t, what):
    """No top_k/top_p, rows long enough to split: segment maxima, segment masses (grid-wide),
    then a block per row finds the segment and the token."""
    block = default_geometry("sample").seg_block
    nq = rows * nseg
    segmax = ctx.device_array(np.zeros(nq, np.int64))
    segmass = ctx.device_array(np.zeros(nq, np.int64))
    scale = np.float32(2.0 ** K.frac_bits(cols))
    ld = x.dtype.name
    xb = ctx.buf(x)
    nbytes = x.size * x.dtype.itemsize
    grid = (_blocks(nq, block),)
    geo = f"{rows}x{nseg} segments of {seg}"
    return [Step(name + " max", f"sample_seg_max {geo}", K.sample_seg_max(ld, block), grid,
                 (block,), (segmax, xb, _U(nq), _U(cols), _U(nseg), _U(seg)), {"bytes": nbytes}),
            Step(name + " mass", f"sample_seg_mass {geo}", K.sample_seg_mass(ld, block), grid,
                 (block,), (segmass, segmax, xb, _U(nq), _U(cols), _U(nseg), _U(seg), inv_t,
                            scale), {"bytes": nbytes}),
            Step(name, f"sample_pick [{rows}, {cols}] {what}", K.sample_pick(ld, block),
                 (_blocks(rows, block),), (block,),
                 (ctx.buf(n), xb, segmax, segmass, seed, _U(rows), _U(cols), _U(nseg), _U(seg),
                  inv_t, scale), {"bytes": rows * seg * x.dtype.itemsize + nq * 16})]
