"""Tensor-core primitives for numba kernels, beside kernels/ptx.py and built the same way: each
instruction is one ``ptx.Intrinsic`` pairing a numba intrinsic (llvmlite inline PTX, sm_80+)
with a plain-Python twin that the simulator runs, and kernels call the module-level names.

``mma_bf16`` / ``mma_f16``: D = A B + C for one m16n8k16 tile (mma.sync.aligned.m16n8k16.row.col,
f32 accumulate). Per lane, A is 4 uint32 words (8 bf16 / f16 values, two a word, the lower
index in the low half), B 2 words, C 4 float32; it returns D's 4 float32::

    d0, d1, d2, d3 = mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

``ldmatrix_x4`` / ``ldmatrix_x4_trans`` (ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16):
every lane names one 16-byte row of shared memory (an array and a flat element offset);
lanes 8j .. 8j+7 give the rows of matrix j, and each lane receives 4 words, word j from
matrix j. ``cp_async16`` (cp.async.cg.shared.global, 16 bytes), ``cp_async_commit``,
``cp_async_wait(n)`` (cp.async.wait_group n, n a compile-time integer) and
``cp_async_wait_all``. ``f2bf2`` rounds two float32 to a bf16 pair word (cvt.rn.bf16x2.f32),
the way ``ptx.f2h2`` does for f16 (P of attention into an A fragment).

Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type" and
"ldmatrix"; g = lane >> 2, t = lane % 4; h the half of a word, 0 the low one):

    A 16x16, word r:  row g + 8 (r & 1),  col 2t + h + 8 (r >> 1)     (a_coord)
    B 16x8,  word r:  row 2t + h + 8 r,   col g                       (b_coord)
    C/D 16x8, f32 i:  row g + 8 (i >> 1), col 2t + (i & 1)            (c_coord)
    ldmatrix, word j: matrix j, row g, cols 2t + h; with .trans row 2t + h, col g

so ``ldmatrix_x4`` of a row-major 16x16 A tile (lane L pointing at row L % 16, column
8 (L >> 4)) gives A's four words in order, and ``ldmatrix_x4_trans`` of a row-major
[k, n] tile (lane L at row (L % 8) + 8 ((L >> 3) & 1), column 8 (L >> 4)) gives two B
fragments, words (0, 1) for columns 0-7 and (2, 3) for columns 8-15.

The twins. mma and ldmatrix are warp-collective: each lane's twin deposits its operands in
its warp's exchange slot (one per simulated block and warp), and the last of the 32 lanes to
arrive computes the whole warp's result (``warp_mma`` / ``warp_ldmatrix``, also callable on
the host with every lane's registers) and wakes the others, which each take their lane's
part. That is a warp-level rendezvous, independent of syncthreads, so the warps of a block
need not reach an mma together; every lane of a warp must (as on the GPU), and the warp must
be full (a block of a multiple of 32 threads). The mma twin multiplies in float64 and rounds
D once to float32 (the GPU's tensor cores round their f32 sums differently: compare with a
tolerance, not bits). cp.async's twin copies at once (commit and wait are no-ops there),
so a kernel must still synchronise (syncthreads) before other threads read the tile, as on
the GPU. Shared tiles that ldmatrix / cp.async touch must be 16-byte aligned on the GPU: declare
them ``cuda.shared.array(shape, uint16, alignment=SMEM_ALIGN)`` (None in the simulator,
which has no alignment argument).
"""
import threading
import weakref

import numpy as np
from llvmlite import ir
from numba import types
from numba.core.errors import TypingError
from numba.cuda.extending import intrinsic

from ..device import SIMULATOR
from .ptx import flat, pack2, pair

INTRINSICS: dict = {}          # this module's ptx.Intrinsic records, by name
SMEM_ALIGN = None if SIMULATOR else 16
KINDS = ("bf16", "f16")

_F32, _I32, _I64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)


# ---- layouts (one statement of them, used by the twins and the notebook) ------------------------
def a_coord(lane: int, r: int, h: int) -> tuple:
    """(row, col) in the 16x16 A tile of half ``h`` of word ``r`` of ``lane``."""
    g, t = lane >> 2, lane & 3
    return g + 8 * (r & 1), 2 * t + h + 8 * (r >> 1)


def b_coord(lane: int, r: int, h: int) -> tuple:
    """(row k, col n) in the 16x8 B tile of half ``h`` of word ``r`` of ``lane``."""
    g, t = lane >> 2, lane & 3
    return 2 * t + h + 8 * r, g


def c_coord(lane: int, i: int) -> tuple:
    """(row, col) in the 16x8 C / D tile of float ``i`` of ``lane``."""
    g, t = lane >> 2, lane & 3
    return g + 8 * (i >> 1), 2 * t + (i & 1)


def ldmatrix_coord(lane: int, h: int, trans: bool) -> tuple:
    """(row, col) in its 8x8 matrix of half ``h`` of the word ``lane`` receives (word j of an
    x4 load comes from matrix j, whose row r is the one lane 8 j + r pointed at)."""
    g, t = lane >> 2, lane & 3
    return (2 * t + h, g) if trans else (g, 2 * t + h)


# ---- half bit patterns <-> float (host side, for the twins) -----------------------------------
def _halves(words) -> np.ndarray:
    """uint32 words -> their uint16 halves, [..., 2] (low half first)."""
    w = np.asarray(words, np.uint64).astype(np.uint32)
    return np.stack([w & 0xFFFF, w >> 16], -1).astype(np.uint16)


def half_bits_to_f64(bits, kind: str) -> np.ndarray:
    """bf16 / f16 bit patterns (uint16) as float64."""
    bits = np.asarray(bits, np.uint16)
    if kind == "f16":
        return bits.view(np.float16).astype(np.float64)
    if kind == "bf16":
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    raise ValueError(f"mma kind {kind!r}: expected one of {KINDS}")


# ---- the warps' twins ---------------------------------------------------------------------------
def warp_mma(kind: str, a, b, c) -> np.ndarray:
    """Every lane's D of one mma.m16n8k16 (row.col, f32 accumulate) from every lane's
    registers: ``a`` [32, 4] and ``b`` [32, 2] uint32 words of ``kind`` pairs, ``c`` [32, 4]
    float32; returns [32, 4] float32. A B + C is formed in float64 and rounded once."""
    ah, bh = _halves(a), _halves(b)
    c = np.asarray(c, np.float64)
    A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
    for lane in range(32):
        for r in range(4):
            for h in range(2):
                A[a_coord(lane, r, h)] = half_bits_to_f64(ah[lane, r, h], kind)
        for r in range(2):
            for h in range(2):
                B[b_coord(lane, r, h)] = half_bits_to_f64(bh[lane, r, h], kind)
        for i in range(4):
            C[c_coord(lane, i)] = c[lane, i]
    D = (A @ B + C).astype(np.float32)
    return np.array([[D[c_coord(lane, i)] for i in range(4)] for lane in range(32)], np.float32)


def warp_ldmatrix(rows, trans: bool) -> np.ndarray:
    """Every lane's 4 words of ldmatrix .x4 (``trans``: .trans) given the 16-byte row each lane
    points at: ``rows`` [32, 8] uint16 (row r of matrix j is rows[8 j + r])."""
    m = np.asarray(rows, np.uint16).reshape(4, 8, 8).astype(np.uint32)
    out = np.zeros((32, 4), np.uint32)
    for lane in range(32):
        lo, hi = ldmatrix_coord(lane, 0, trans), ldmatrix_coord(lane, 1, trans)
        for j in range(4):
            out[lane, j] = m[j][lo] | (m[j][hi] << 16)
    return out


class _Exchange:
    """One warp's rendezvous: 32 operand slots, a count and a generation."""

    def __init__(self):
        self.cond = threading.Condition()
        self.ops: list = [None] * 32
        self.count = 0
        self.gen = 0
        self.result = None


_EXCHANGES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # block -> {warp: _Exchange}
_EXCHANGES_LOCK = threading.Lock()


def _exchange(thread):
    """(the calling simulated thread's warp exchange, its lane). The simulator runs each CUDA
    thread of a block as a BlockThread (thread_id: the linear index in the block), under one
    BlockManager per block, which keys the exchanges."""
    block = getattr(thread, "_manager", None)
    if block is None or not hasattr(thread, "thread_id"):
        raise RuntimeError("a warp-collective twin runs inside a simulated kernel only "
                           "(on the host call warp_mma / warp_ldmatrix with every lane's data)")
    warp, lane = divmod(int(thread.thread_id), 32)
    nthreads = int(np.prod(block._block_dim))
    if nthreads - 32 * warp < 32:
        raise RuntimeError(f"warp-collective instruction in a partial warp (block of {nthreads} "
                           "threads): the block must be a multiple of 32 threads")
    with _EXCHANGES_LOCK:
        ex = _EXCHANGES.setdefault(block, {}).setdefault(warp, _Exchange())
    return ex, lane


def _collective(name: str, operand, combine):
    """Lane's share of ``combine([operand of lane 0, ..., lane 31])`` (a list of 32), once every
    lane of the calling thread's warp has called this with the same ``name``."""
    thread = threading.current_thread()
    ex, lane = _exchange(thread)
    with ex.cond:
        if ex.ops[lane] is not None:
            raise RuntimeError(f"{name}: lane {lane} arrived twice before its warp completed")
        ex.ops[lane] = (name, operand)
        ex.count += 1
        gen = ex.gen
        if ex.count == 32:
            names = {op[0] for op in ex.ops}
            try:
                if len(names) != 1:
                    raise RuntimeError(f"lanes of one warp called different collectives: {names}")
                ex.result = combine([op[1] for op in ex.ops])
            except Exception as e:        # every lane raises it
                ex.result = e
            ex.ops, ex.count = [None] * 32, 0
            ex.gen += 1
            ex.cond.notify_all()
        else:
            while ex.gen == gen:
                ex.cond.wait(0.05)
                if getattr(thread, "abort", False):   # another simulated thread raised
                    raise RuntimeError(f"{name}: kernel aborted while waiting for the warp")
        res = ex.result      # (stays until this lane has joined the next collective)
    if isinstance(res, Exception):
        raise res
    return res[lane]


def _twin_mma(kind):
    def twin(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        op = ((a0, a1, a2, a3), (b0, b1), (c0, c1, c2, c3))

        def combine(ops):
            return warp_mma(kind, [o[0] for o in ops], [o[1] for o in ops], [o[2] for o in ops])
        d = _collective("mma_" + kind, op, combine)
        return d[0], d[1], d[2], d[3]
    twin.__name__ = f"twin_mma_{kind}"
    return twin


def _row16(arr, i) -> np.ndarray:
    """The 16 bytes at element offset ``i`` of ``arr`` as 8 uint16."""
    f = flat(arr)
    return np.ascontiguousarray(f[i: i + 16 // f.itemsize]).view(np.uint16).copy()


def _twin_ldmatrix(trans):
    def twin(arr, i):
        def combine(ops):       # (every lane has arrived: read the rows now, as the GPU does)
            return warp_ldmatrix(np.stack([_row16(a, int(j)) for a, j in ops]), trans)
        w = _collective("ldmatrix_x4" + ("_trans" if trans else ""), (arr, i), combine)
        return w[0], w[1], w[2], w[3]
    twin.__name__ = "twin_ldmatrix_x4" + ("_trans" if trans else "")
    return twin


def _twin_cp_async16(dst, di, src, si):
    d, s = flat(dst), flat(src)
    d[di: di + 16 // d.itemsize].view(np.uint8)[:] = s[si: si + 16 // s.itemsize].view(np.uint8)


def _twin_cp_async_commit():
    pass


def _twin_cp_async_wait(n):
    pass


def _twin_cp_async_wait_all():
    pass


def _twin_f2bf2(lo, hi):
    """Two float32 rounded to bf16 (nearest even; NaN stays NaN), ``lo`` in the low half."""
    u = np.array([lo, hi], np.float32).view(np.uint32).astype(np.uint64)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = np.isnan(np.array([lo, hi], np.float32))
    r = np.where(nan, (u >> 16) | 0x40, r) & 0xFFFF
    return np.uint32(int(r[0]) | (int(r[1]) << 16))


# ---- GPU bodies ---------------------------------------------------------------------------------
def _ptr(context, builder, aryty, ary, idx, idxty):
    """The generic address of ary[idx] (flat element offset) as i64."""
    data = context.make_array(aryty)(context, builder, ary).data
    i = context.cast(builder, idx, idxty, types.int64)
    return builder.ptrtoint(builder.gep(data, [i]), _I64)


def _mma_intrinsic(kind):
    def typer(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        args = (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
        for x in args[:6]:
            if not isinstance(x, types.Integer):
                raise TypingError(f"mma_{kind}: A / B operands are uint32 words, got {x}")
        sig = types.UniTuple(types.float32, 4)(*args)

        def codegen(context, builder, sig, args):
            w = [context.cast(builder, v, t, types.uint32) for v, t in zip(args[:6], sig.args[:6])]
            c = [context.cast(builder, v, t, types.float32) for v, t in zip(args[6:], sig.args[6:])]
            st = ir.LiteralStructType([_F32] * 4)
            asm = ir.InlineAsm(
                ir.FunctionType(st, [_I32] * 6 + [_F32] * 4),
                f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32 "
                "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
                "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
            r = builder.call(asm, w + c, attrs=("convergent",))
            return context.make_tuple(builder, sig.return_type,
                                      [builder.extract_value(r, i) for i in range(4)])
        return sig, codegen
    typer.__name__ = f"mma_{kind}"
    return intrinsic(typer)


def _ldmatrix_intrinsic(trans):
    name = "ldmatrix_x4" + ("_trans" if trans else "")

    def typer(typingctx, arr, idx):
        """Each lane's 16-byte row of shared memory at arr[idx] (flat element offset)."""
        sig = types.UniTuple(types.uint32, 4)(arr, idx)

        def codegen(context, builder, sig, args):
            p = _ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            st = ir.LiteralStructType([_I32] * 4)
            asm = ir.InlineAsm(
                ir.FunctionType(st, [_I64]),
                "{\n\t.reg .u64 a;\n\t.reg .u32 s;\n\tcvta.to.shared.u64 a, $4;\n\t"
                "cvt.u32.u64 s, a;\n\t"
                f"ldmatrix.sync.aligned.m8n8.x4{'.trans' if trans else ''}.shared.b16 "
                "{$0, $1, $2, $3}, [s];\n\t}",
                "=r,=r,=r,=r,l,~{memory}", side_effect=True)
            r = builder.call(asm, [p], attrs=("convergent",))
            return context.make_tuple(builder, sig.return_type,
                                      [builder.extract_value(r, i) for i in range(4)])
        return sig, codegen
    typer.__name__ = name
    return intrinsic(typer)


@intrinsic
def _gpu_cp_async16(typingctx, dst, di, src, si):
    """16 bytes from global src[si] to shared dst[di] (flat element offsets, both 16-byte
    aligned), asynchronously: cp.async.cg (through L2 only)."""
    sig = types.void(dst, di, src, si)

    def codegen(context, builder, sig, args):
        d = _ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        s = _ptr(context, builder, sig.args[2], args[2], args[3], sig.args[3])
        asm = ir.InlineAsm(
            ir.FunctionType(ir.VoidType(), [_I64, _I64]),
            "{\n\t.reg .u64 d, g;\n\t.reg .u32 s;\n\tcvta.to.shared.u64 d, $0;\n\t"
            "cvt.u32.u64 s, d;\n\tcvta.to.global.u64 g, $1;\n\t"
            "cp.async.cg.shared.global [s], [g], 16;\n\t}",
            "l,l,~{memory}", side_effect=True)
        builder.call(asm, [d, s])
        return context.get_dummy_value()
    return sig, codegen


def _asm_void(text):
    def codegen(context, builder, sig, args):
        asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), text, "~{memory}",
                           side_effect=True)
        builder.call(asm, [])
        return context.get_dummy_value()
    return codegen


@intrinsic
def _gpu_cp_async_commit(typingctx):
    """Close the group of this thread's cp.async issued since the last commit."""
    return types.void(), _asm_void("cp.async.commit_group;")


@intrinsic
def _gpu_cp_async_wait_all(typingctx):
    """Wait for all of this thread's cp.async (committed or not)."""
    return types.void(), _asm_void("cp.async.wait_all;")


@intrinsic
def _gpu_cp_async_wait(typingctx, n):
    """Wait until at most ``n`` of this thread's committed cp.async groups are pending (n a
    compile-time integer: a literal or a closure constant)."""
    if not isinstance(n, types.IntegerLiteral):
        raise TypingError("cp_async_wait(n): n must be a compile-time integer constant")
    return types.void(n), _asm_void(f"cp.async.wait_group {int(n.literal_value)};")


# ---- what kernels call --------------------------------------------------------------------------
mma_bf16 = pair("mma_bf16", _mma_intrinsic("bf16"), _twin_mma("bf16"), INTRINSICS)
mma_f16 = pair("mma_f16", _mma_intrinsic("f16"), _twin_mma("f16"), INTRINSICS)
ldmatrix_x4 = pair("ldmatrix_x4", _ldmatrix_intrinsic(False), _twin_ldmatrix(False), INTRINSICS)
ldmatrix_x4_trans = pair("ldmatrix_x4_trans", _ldmatrix_intrinsic(True), _twin_ldmatrix(True),
                         INTRINSICS)
cp_async16 = pair("cp_async16", _gpu_cp_async16, _twin_cp_async16, INTRINSICS)
cp_async_commit = pair("cp_async_commit", _gpu_cp_async_commit, _twin_cp_async_commit, INTRINSICS)
cp_async_wait = pair("cp_async_wait", _gpu_cp_async_wait, _twin_cp_async_wait, INTRINSICS)
cp_async_wait_all = pair("cp_async_wait_all", _gpu_cp_async_wait_all, _twin_cp_async_wait_all,
                         INTRINSICS)
f2bf2 = pair("f2bf2", pack2("bf16"), _twin_f2bf2, INTRINSICS)


def mma(kind: str):
    """``mma_bf16`` or ``mma_f16`` by kind (a kernel factory's compile-time string)."""
    if kind not in KINDS:
        raise ValueError(f"mma kind {kind!r}: expected one of {KINDS}")
    return mma_bf16 if kind == "bf16" else mma_f16
