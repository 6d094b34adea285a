"""Lowering of argsort (kernels/sort.py): keys, tile sorts, merge passes, indices. The keys
ping-pong between two uint64 arrays of the executable."""
from __future__ import annotations

import numpy as np

from ..ir import dtypes as dt
from ..kernels import sort as K
from ..kernels.launch import default_geometry, grid_1d, grid_3d, pow2_at_least
from .lower import Step, lowering, step_name

_U = np.uint64


@lowering("argsort")
def _lower_argsort(ctx, n):
    if n.size == 0:
        return []
    x = ctx.graph.nodes[n.inputs[0]]
    length = n.shape[-1]
    rows = n.size // length
    keys = [ctx.device_array(np.zeros(n.size, np.uint64)) for _ in range(2)]
    bits = ctx.buf(x).view(np.uint32)
    name = step_name(n)
    order = "descending" if n.attrs["descending"] else "ascending"
    blocks, threads = grid_1d(n.size)
    kind = K.F32 if x.dtype == dt.F32 else K.I32
    steps = [Step(name, f"sort keys {rows}x{length} {order}",
                  K.key_kernel(kind, n.attrs["descending"]), (blocks,), (threads,),
                  (keys[0], bits, _U(n.size), _U(length)), {})]
    geo = default_geometry("sort")
    tile = min(geo.tile, pow2_at_least(length))
    if tile > 1:
        tiles = rows * -(-length // tile)
        steps.append(Step(name, f"sort tiles of {tile}", K.tile_sort_kernel(tile),
                          grid_3d(tiles), (min(geo.threads, tile // 2),),
                          (keys[0], _U(rows), _U(length)), {}))
    cur, width = 0, tile
    while width < length:       # (tile == geo.tile here: a row longer than one tile)
        steps.append(Step(name, f"sort merge runs of {width}",
                          K.merge_tile_kernel(tile, geo.probes),
                          grid_3d(rows * -(-length // tile)), (geo.threads,),
                          (keys[1 - cur], keys[cur], _U(rows), _U(length), _U(width)),
                          {"bytes": 16 * n.size}))
        cur, width = 1 - cur, width * 2
    steps.append(Step(name, f"sort indices {rows}x{length}", K.index_kernel, (blocks,),
                      (threads,), (ctx.buf(n), keys[cur], _U(n.size)),
                      {"bytes": n.size * 16}))
    return steps
