"""Kernel boilerplate in one place: the ``jit`` decorator every kernel uses, and launch
geometry. The simulator runs one OS thread per CUDA thread, so its launches are kept small
(grid-stride loops cover the rest)."""
import contextlib
from dataclasses import dataclass

from numba import cuda

from ..device import SIMULATOR, device_info
from . import cache


def jit(fn=None, *, launch_bounds=None):
    """``@jit`` / ``@jit(launch_bounds=...)``: a ``cuda.jit`` kernel cached on disk (see
    kernels/cache.py). The simulator takes no launch bounds and caches nothing."""
    def deco(f):
        if SIMULATOR:
            return cuda.jit(f)
        opts = {} if launch_bounds is None else {"launch_bounds": launch_bounds}
        return cache.attach(cuda.jit(**opts)(f), opts)
    return deco(fn) if fn is not None else deco

# a device function the compiler must inline (a call per element costs more than the work);
# the simulator takes no forceinline
inline = cuda.jit(device=True) if SIMULATOR else cuda.jit(device=True, forceinline=True)


def device(f):
    """A device function, called (the compiler decides whether to inline it)."""
    return cuda.jit(device=True)(f)


def py_in_sim(f):
    """A device function on a GPU; in the simulator the plain Python function (a device-function
    call there costs ~15 us). Only for helpers that need no barrier; they may use the cuda
    module's atomics only when the kernels calling them live in the same module (the simulator
    swaps a kernel's own module's ``cuda`` while it runs)."""
    return f if SIMULATOR else cuda.jit(device=True)(f)

# ---- tile geometry: each kernel family's factories take a geometry object; the default one
# (the GPU's tuned shapes, or small ones in the simulator, where every CUDA thread is Python)
# is chosen here, once. The simulator can run a family's GPU geometry too (tests do).
_GEOMETRY: dict[str, tuple[object, object]] = {}
_OVERRIDE: dict[str, object] = {}


def register_geometry(family: str, gpu, sim):
    """A kernel family's geometries: ``gpu`` tuned for the GPU, ``sim`` for the simulator."""
    _GEOMETRY[family] = (gpu, sim)


def default_geometry(family: str):
    """The geometry a lowering builds ``family``'s kernels with on this device."""
    if family in _OVERRIDE:
        return _OVERRIDE[family]
    gpu, sim = _GEOMETRY[family]
    return sim if SIMULATOR else gpu


@contextlib.contextmanager
def override_geometry(family: str, geo):
    """Within the block, lowerings build ``family``'s kernels with ``geo`` (e.g. the
    simulator running the GPU's tile shapes, in tests)."""
    old = _OVERRIDE.get(family)
    _OVERRIDE[family] = geo
    try:
        yield geo
    finally:
        if old is None:
            del _OVERRIDE[family]
        else:
            _OVERRIDE[family] = old


def gpu_geometry(family: str):
    """``family``'s GPU geometry, whatever the device (the simulator tests run it)."""
    return _GEOMETRY[family][0]


def sim_geometry(family: str):
    """``family``'s simulator geometry, whatever the device (a GPU test runs it)."""
    return _GEOMETRY[family][1]


_SM = None


def sm_count() -> int:
    global _SM
    if _SM is None:
        _SM = device_info()["sm_count"]
    return _SM


def grid_1d(n: int, threads: int = 256, waves: int = 32) -> tuple[int, int]:
    """(blocks, threads) for a grid-stride loop over n items."""
    if SIMULATOR:
        return (max(1, min(2, -(-n // 16))), 16)
    blocks = -(-n // threads)
    # enough blocks to fill every SM several times; the loop strides over the rest
    return (max(1, min(blocks, sm_count() * waves * (2048 // threads))), threads)


MAX_GRID_YZ = 65535


def grid_3d(bx: int, by: int = 1, bz: int = 1) -> tuple[int, int, int]:
    """A grid of (bx, by, bz) blocks clamped to the hardware limits (the kernel grid-strides
    over the rest on each axis); at most 2 x 2 x 1 blocks in the simulator."""
    if SIMULATOR:
        return (max(1, min(bx, 2)), max(1, min(by, 2)), 1)
    return (max(1, min(bx, 2**31 - 1)), max(1, min(by, MAX_GRID_YZ)), max(1, min(bz, MAX_GRID_YZ)))


def block_rows(ncols: int, threads: int = 256) -> tuple[int, int]:
    """(tx, ty) for a block over rows of ncols contiguous elements: tx threads along a row (a
    power of two, so short rows waste few lanes), ty rows per block; tx * ty = threads
    (16 in the simulator)."""
    if SIMULATOR:
        threads = 16
    tx = min(threads, 1 << max(0, ncols - 1).bit_length())
    return tx, threads // tx


def waves_cap(threads: int = 256, waves: int = 32) -> int:
    """How many blocks of this size fill every SM ``waves`` times (grid-stride loops do the
    rest); 4 in the simulator."""
    if SIMULATOR:
        return 4
    return sm_count() * waves * max(1, 2048 // threads)


def pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


# ---- reductions (kernels/reduce.py) ---------------------------------------------------------
# A reduction pass is a "row" pass (the reduced elements are contiguous: groups of G threads
# stream a row) or a "column" pass (x seen as [outer, r, inner]: threads span the contiguous
# inner positions and loop over r). When the output alone cannot fill the GPU, the reduced
# extent is split across blocks into partials and a second, small pass combines them.
# A split aims at one wave (every SM full once): a second, part-filled wave would cost about
# as much as the first.
SIM_BLOCK = 16                              # threads a block in the simulator


@dataclass(frozen=True)
class ReduceGeometry:
    """row_geometry / col_geometry's shapes: the GPU's (tuned on an H200) or, small, the
    simulator's (threads and barriers cost milliseconds there: few of each)."""
    small: bool
    row_per_thread: int     # elements a thread, at least, when splitting
    wave_threads: int       # resident threads per SM


register_geometry("reduce", gpu=ReduceGeometry(False, 8, 2048), sim=ReduceGeometry(True, 4, 32))


def row_geometry(rows: int, n: int, split: bool = True, geo: ReduceGeometry | None = None):
    """(g, block, blocks, nseg, seg) for reducing ``rows`` contiguous rows of ``n`` elements.

    g threads a row (a power of two), block // g rows a block, a grid-stride loop over the
    rest. Long rows of which there are too few to fill the GPU are cut into ``nseg`` segments
    of ``seg`` elements (then a second pass reduces the [rows, nseg] partials). ``geo``: the
    device's default geometry unless given."""
    geo = geo or default_geometry("reduce")
    if geo.small:
        g = 1 if n < 64 else min(8, pow2_at_least(-(-n // 64)))
        block = SIM_BLOCK
    else:   # ~16 elements a thread, at most 512 threads a row, 512-thread blocks (H200 sweep)
        g = min(512, pow2_at_least(-(-n // 16)))
        block = max(g, 512)
    nseg, seg = 1, n
    wave = geo.wave_threads * sm_count()
    if split and rows * g * 2 <= wave and n >= 4 * g * geo.row_per_thread:
        nseg = min(wave // (rows * g), n // (g * geo.row_per_thread))
        seg = -(-n // nseg)
        seg = -(-seg // 32) * 32               # segments start on 128-byte boundaries (f32)
        nseg = -(-n // seg)
    groups = rows * nseg
    blocks = max(1, min(-(-groups // (block // g)), 2 if geo.small else sm_count() * 32))
    return g, block, blocks, nseg, seg


def col_geometry(outer: int, r: int, inner: int, split: bool = True,
                 geo: ReduceGeometry | None = None):
    """(bx, by, nbx, blocks_x, nsplit, rchunk) for reducing x [outer, r, inner] over r.

    A block is bx x by threads: bx consecutive inner positions (coalesced) by by lanes that
    take every by-th row, combined through shared memory at the end. Blocks loop over the
    nbx * outer column tiles; when there are too few tiles to fill the GPU, r is cut into
    nsplit chunks of rchunk rows (grid.y), each writing partials for a second pass. ``geo``:
    the device's default geometry unless given."""
    geo = geo or default_geometry("reduce")
    small = geo.small
    bx = min(8 if small else 32, pow2_at_least(inner))
    threads = SIM_BLOCK if small else 256
    nbx = -(-inner // bx)
    tiles = nbx * outer
    if not small and not split and tiles < sm_count():
        threads = 1024                          # a final pass over partials: few, wide blocks
    by = max(1, min(threads // bx, pow2_at_least(r)))
    if small and tiles > 4:
        by = 1   # barriers cost milliseconds there: with many tiles, no shared-memory step
    nsplit, rchunk = 1, r
    min_rows = 2 if small else 16               # rows a thread at least, when splitting
    wave = max(1, geo.wave_threads * sm_count() // (bx * by))   # blocks resident at once
    if split and tiles * 2 <= wave and r >= 2 * by * min_rows:
        nsplit = max(1, min(wave // tiles, r // (by * min_rows), 65535))
        rchunk = -(-r // nsplit)
        nsplit = -(-r // rchunk)
    blocks_x = max(1, min(tiles, 2 if small else 2**31 - 1))
    return bx, by, nbx, blocks_x, nsplit, rchunk
