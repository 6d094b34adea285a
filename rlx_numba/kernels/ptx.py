"""Memory instructions numba's CUDA API does not expose, as numba intrinsics (LLVM IR and
inline PTX), each one ``Intrinsic`` holding its GPU body and its plain Python twin (what the
simulator runs; tests/test_ptx_gpu.py checks on a GPU that both agree). Kernels call the
module-level names, bound once to the body this device runs.

``ld2`` / ``ld4``: two / four float32 in one 8- / 16-byte load of read-only data
(ld.global.nc.v2.f32, .v4.f32); ``ld4w``: 16 bytes of any array as four uint32 words (8 half
weights), and ``h2f`` to widen an f16 pair word (cvt.f32.f16), ``f2h2`` to round two float32
to one (cvt.rn.f16x2.f32); ``vld4`` / ``vld4w`` and ``vst4`` / ``vst2`` / ``st4w``: 16-byte
loads and 16- / 8-byte stores of memory the kernel also writes (shared memory, partials,
dequantised weights, an element-wise kernel's output that is also its input). numba's array accesses are one element each, and a warp waiting on its load
queue, not DRAM, is what bounds the decode kernel. ``ldh`` / ``ldw`` / ``fld4`` / ``fbits`` / ``spread4``: 32-bit words of packed
quantised data and their bit fields as exact floats (numba types every integer op 64-bit).
``ticket``: atomicAdd(+1) with
acquire-release semantics (atom.acq_rel.gpu), the last-block-combines handshake without
the two sequentially consistent fences (membar.gl) that numba's threadfence would add.
``grid_wait`` / ``grid_launch_dependents``: programmatic dependent launch (sm_90,
griddepcontrol): a kernel launched with the programmatic-serialization attribute
(runtime/lower.py ``fast_launch(pdl=True)``) may start while the kernel before it in the
stream still runs; ``grid_wait`` returns once that kernel has completed and its writes are
visible, so nothing it writes may be read (nor anything it reads be written) before the wait.
``grid_launch_dependents`` lets the next such kernel start before this one ends. Both are
no-ops in a kernel launched without the attribute.
Indices are flat element offsets from the array's start, whatever its rank.
"""
import threading

import numpy as np
from llvmlite import ir
from numba import types
from numba.cuda.extending import intrinsic

from ..device import SIMULATOR


class Intrinsic:
    """One instruction sequence: ``gpu`` the numba intrinsic, ``twin`` the same computation in
    plain Python (on NumPy arrays, or the simulator's); ``fn`` the one kernels call here."""

    def __init__(self, name: str, gpu, twin):
        self.name, self.gpu, self.twin = name, gpu, twin
        self.fn = twin if SIMULATOR else gpu


INTRINSICS: dict[str, Intrinsic] = {}


def pair(name: str, gpu, twin, registry: dict | None = None):
    """Record ``Intrinsic(name, gpu, twin)`` in ``registry`` (this module's INTRINSICS unless
    another kernel module passes its own, e.g. kernels/mma.py) and return what kernels call."""
    reg = INTRINSICS if registry is None else registry
    reg[name] = Intrinsic(name, gpu, twin)
    return reg[name].fn


# ---- GPU bodies --------------------------------------------------------------------------------
_F32, _I32, _I64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)


def _data(context, builder, aryty, ary):
    return context.make_array(aryty)(context, builder, ary).data


def _load(name, n, invariant):
    def typer(typingctx, arr, idx):
        sig = types.UniTuple(types.float32, n)(arr, idx)

        def codegen(context, builder, sig, args):
            vt = ir.VectorType(_F32, n)
            ptr = builder.gep(_data(context, builder, sig.args[0], args[0]), [args[1]])
            v = builder.load(builder.bitcast(ptr, vt.as_pointer()), align=4 * n)
            if invariant:   # lets the compiler use the read-only path (ld.global.nc)
                v.set_metadata("invariant.load", builder.module.add_metadata([]))
            return context.make_tuple(builder, sig.return_type, [
                builder.extract_element(v, ir.Constant(_I32, i)) for i in range(n)])
        return sig, codegen
    typer.__name__ = name
    return typer


_gpu_ld2 = intrinsic(_load("ld2", 2, True))
_gpu_ld4 = intrinsic(_load("ld4", 4, True))
_gpu_vld4 = intrinsic(_load("vld4", 4, False))


def _load_words(name, invariant):
    def typer(typingctx, arr, idx):
        """The 16 bytes at a[i] (any element type; i a flat element offset, 16-byte aligned)
        as 4 uint32 words in one load: 8 f16/bf16 values at once."""
        sig = types.UniTuple(types.uint32, 4)(arr, idx)

        def codegen(context, builder, sig, args):
            vt = ir.VectorType(_I32, 4)
            ptr = builder.gep(_data(context, builder, sig.args[0], args[0]), [args[1]])
            v = builder.load(builder.bitcast(ptr, vt.as_pointer()), align=16)
            if invariant:
                v.set_metadata("invariant.load", builder.module.add_metadata([]))
            return context.make_tuple(builder, sig.return_type, [
                builder.extract_element(v, ir.Constant(_I32, i)) for i in range(4)])
        return sig, codegen
    typer.__name__ = name
    return typer


_gpu_ld4w = intrinsic(_load_words("ld4w", True))
_gpu_vld4w = intrinsic(_load_words("vld4w", False))


@intrinsic
def _gpu_h2f(typingctx, word):
    """(low, high) f16 halves of a uint32 word as float32 (two cvt.f32.f16)."""
    sig = types.UniTuple(types.float32, 2)(word)

    def codegen(context, builder, sig, args):
        st = ir.LiteralStructType([_F32, _F32])
        asm = ir.InlineAsm(ir.FunctionType(st, [_I32]),
                           "{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, $2;\n\t"
                           "cvt.f32.f16 $0, l;\n\tcvt.f32.f16 $1, h;\n\t}", "=f,=f,r")
        r = builder.call(asm, [args[0]])
        return context.make_tuple(builder, sig.return_type,
                                  [builder.extract_value(r, 0), builder.extract_value(r, 1)])
    return sig, codegen


def pack2(kind: str):
    """The GPU body rounding two float32 to ``kind`` ("f16" / "bf16", nearest even) packed in
    a uint32 word, ``lo`` in its low half: one cvt.rn.{kind}x2.f32 (sm_80+), whose FIRST
    source goes to the upper half."""
    @intrinsic
    def _gpu_pack2(typingctx, lo, hi):
        sig = types.uint32(lo, hi)

        def codegen(context, builder, sig, args):
            a, b = (context.cast(builder, v, t, types.float32) for v, t in zip(args, sig.args))
            asm = ir.InlineAsm(ir.FunctionType(_I32, [_F32, _F32]),
                               f"cvt.rn.{kind}x2.f32 $0, $2, $1;", "=r,f,f")
            return builder.call(asm, [a, b])
        return sig, codegen
    return _gpu_pack2


_gpu_f2h2 = pack2("f16")


@intrinsic
def _gpu_ldh(typingctx, arr, idx):
    """The halfword a[i] (a uint16 array) as uint32, a read-only load."""
    sig = types.uint32(arr, idx)

    def codegen(context, builder, sig, args):
        i = context.cast(builder, args[1], sig.args[1], types.int64)
        v = builder.load(builder.gep(_data(context, builder, sig.args[0], args[0]), [i]))
        v.set_metadata("invariant.load", builder.module.add_metadata([]))
        return builder.zext(v, _I32)
    return sig, codegen


@intrinsic
def _gpu_ldw(typingctx, arr, idx):
    """The little-endian uint32 of halfwords a[i], a[i + 1] (a uint16 array; any i: two
    read-only 2-byte loads joined in 32-bit registers -- numba's own integer ops widen
    every value to 64 bits)."""
    sig = types.uint32(arr, idx)

    def codegen(context, builder, sig, args):
        base = _data(context, builder, sig.args[0], args[0])
        i = context.cast(builder, args[1], sig.args[1], types.int64)
        lo = builder.load(builder.gep(base, [i]))
        hi = builder.load(builder.gep(base, [builder.add(i, ir.Constant(_I64, 1))]))
        for v in (lo, hi):
            v.set_metadata("invariant.load", builder.module.add_metadata([]))
        return builder.or_(builder.zext(lo, _I32),
                           builder.shl(builder.zext(hi, _I32), ir.Constant(_I32, 16)))
    return sig, codegen


@intrinsic
def _gpu_fld4(typingctx, word, stride, sh, mask, xo, hw, hstride, hsh, hmask, hpos, bias):
    """Four bit fields of a 32-bit word as float32, in 32-bit integer ops: field i is
    ((word >> (stride i + sh)) & mask) ^ xo, OR-ed with ((hw >> (hstride i + hsh)) & hmask)
    << hpos (its high bits from another word), then made a float exactly by OR-ing it
    into the mantissa of 2**23: returned as that float less ``bias`` (2**23 + offset)."""
    sig = types.UniTuple(types.float32, 4)(word, stride, sh, mask, xo, hw, hstride, hsh,
                                           hmask, hpos, bias)

    def codegen(context, builder, sig, args):
        w, st, s, m, x, h, hst, hs, hm, hp = (
            context.cast(builder, a, t, types.uint32) for a, t in zip(args[:10], sig.args[:10]))
        b = context.cast(builder, args[10], sig.args[10], types.float32)
        outs = []
        for i in range(4):
            c = ir.Constant(_I32, i)
            f = builder.xor(builder.and_(builder.lshr(w, builder.add(builder.mul(st, c), s)), m), x)
            g = builder.and_(builder.lshr(h, builder.add(builder.mul(hst, c), hs)), hm)
            f = builder.or_(builder.or_(f, builder.shl(g, hp)), ir.Constant(_I32, 0x4B000000))
            outs.append(builder.fsub(builder.bitcast(f, _F32), b))
        return context.make_tuple(builder, sig.return_type, outs)
    return sig, codegen


@intrinsic
def _gpu_fbits(typingctx, word, sh, mask):
    """float32 of (word >> sh) & mask (32-bit ops; exact through the 2**23 mantissa)."""
    sig = types.float32(word, sh, mask)

    def codegen(context, builder, sig, args):
        w, s, m = (context.cast(builder, a, t, types.uint32) for a, t in zip(args, sig.args))
        f = builder.or_(builder.and_(builder.lshr(w, s), m), ir.Constant(_I32, 0x4B000000))
        return builder.fsub(builder.bitcast(f, _F32), ir.Constant(_F32, 8388608.0))
    return sig, codegen


@intrinsic
def _gpu_spread4(typingctx, word, j):
    """A word whose byte i is bit j + i of ``word`` (j + 3 < 32)."""
    sig = types.uint32(word, j)

    def codegen(context, builder, sig, args):
        w, jj = (context.cast(builder, a, t, types.uint32) for a, t in zip(args, sig.args))
        v = builder.and_(builder.lshr(w, jj), ir.Constant(_I32, 15))
        out = builder.and_(v, ir.Constant(_I32, 1))
        for bit, sh in ((2, 7), (4, 14), (8, 21)):
            out = builder.or_(out, builder.shl(builder.and_(v, ir.Constant(_I32, bit)),
                                               ir.Constant(_I32, sh)))
        return out
    return sig, codegen


def _store_codegen(context, builder, sig, args):
    ty = sig.args[0].dtype                  # the array's element type (f32, u32 words)
    n = len(args) - 2
    vt = ir.VectorType(context.get_value_type(ty), n)
    v = ir.Constant(vt, ir.Undefined)
    for i in range(n):
        x = context.cast(builder, args[2 + i], sig.args[2 + i], ty)
        v = builder.insert_element(v, x, ir.Constant(_I32, i))
    ptr = builder.gep(_data(context, builder, sig.args[0], args[0]), [args[1]])
    builder.store(v, builder.bitcast(ptr, vt.as_pointer()), align=4 * n)
    return context.get_dummy_value()


@intrinsic
def _gpu_vst2(typingctx, arr, idx, x0, x1):
    return types.void(arr, idx, x0, x1), _store_codegen


@intrinsic
def _gpu_vst4(typingctx, arr, idx, x0, x1, x2, x3):
    return types.void(arr, idx, x0, x1, x2, x3), _store_codegen


@intrinsic
def _gpu_st4w(typingctx, arr, idx, w0, w1, w2, w3):
    """Four uint32 words into the 16 bytes at a[i] (any element type; i a flat element
    offset, 16-byte aligned): 8 f16/bf16 values in one store."""
    sig = types.void(arr, idx, w0, w1, w2, w3)

    def codegen(context, builder, sig, args):
        vt = ir.VectorType(_I32, 4)
        v = ir.Constant(vt, ir.Undefined)
        for i in range(4):
            x = context.cast(builder, args[2 + i], sig.args[2 + i], types.uint32)
            v = builder.insert_element(v, x, ir.Constant(_I32, i))
        ptr = builder.gep(_data(context, builder, sig.args[0], args[0]), [args[1]])
        builder.store(v, builder.bitcast(ptr, vt.as_pointer()), align=16)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def _gpu_ticket(typingctx, arr, idx):
    """atomicAdd(&arr[idx], 1) on an int32 array with acquire-release semantics at GPU
    scope (atom.acq_rel.gpu): the caller's writes (and, after a block barrier, its
    block's) are visible before the ticket, and the holder of the last ticket sees
    every earlier holder's."""
    sig = types.int32(arr, idx)

    def codegen(context, builder, sig, args):
        ptr = builder.gep(_data(context, builder, sig.args[0], args[0]), [args[1]])
        asm = ir.InlineAsm(ir.FunctionType(_I32, [_I64]),
                           "{\n\t.reg .u64 a;\n\tcvta.to.global.u64 a, $1;\n\t"
                           "atom.acq_rel.gpu.global.add.u32 $0, [a], 1;\n\t}",
                           "=r,l,~{memory}", side_effect=True)
        return builder.call(asm, [builder.ptrtoint(ptr, _I64)])
    return sig, codegen


def _void_asm(name, text):
    def typer(typingctx):
        def codegen(context, builder, sig, args):
            builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), text, "~{memory}",
                                      side_effect=True), [])
            return context.get_dummy_value()
        return types.void(), codegen
    typer.__name__ = name
    return typer


_gpu_grid_wait = intrinsic(_void_asm("grid_wait", "griddepcontrol.wait;"))
_gpu_grid_launch_dependents = intrinsic(_void_asm("grid_launch_dependents",
                                                  "griddepcontrol.launch_dependents;"))


# ---- Python twins (plain functions: a device-function call costs ~15 us in the simulator) ------
def flat(a):
    """The array (a NumPy array, or the simulator's wrapper of one) as a flat view: the index
    the twins take is flat, as the GPU bodies' pointer arithmetic is."""
    return getattr(a, "_ary", a).reshape(-1)


def _twin_ld2(a, i):
    f = flat(a)
    return f[i], f[i + 1]


def _twin_ld4(a, i):
    f = flat(a)
    return f[i], f[i + 1], f[i + 2], f[i + 3]


def _twin_ld4w(a, i):
    f = flat(a)
    w = np.ascontiguousarray(f[i: i + 16 // f.itemsize]).view(np.uint32)
    return w[0], w[1], w[2], w[3]


def _twin_h2f(word):
    h = np.array([word], np.uint32).view(np.float16).astype(np.float32)
    return h[0], h[1]


def _twin_f2h2(lo, hi):
    return np.array([lo, hi], np.float32).astype(np.float16).view(np.uint32)[0]


def _twin_ldh(a, i):
    return np.uint32(flat(a)[i])


def _twin_ldw(a, i):
    f = flat(a)
    return np.uint32(int(f[i]) | (int(f[i + 1]) << 16))


def _twin_fld4(word, stride, sh, mask, xo, hw, hstride, hsh, hmask, hpos, bias):
    w, h = int(word), int(hw)
    out = []
    for i in range(4):
        f = (((w >> (stride * i + sh)) & mask) ^ xo) | (((h >> (hstride * i + hsh)) & hmask) << hpos)
        out.append(np.float32(np.float32(8388608 + f) - np.float32(bias)))
    return out[0], out[1], out[2], out[3]


def _twin_fbits(word, sh, mask):
    return np.float32((int(word) >> int(sh)) & int(mask))


def _twin_spread4(word, j):
    v = (int(word) >> int(j)) & 15
    return np.uint32((v & 1) | ((v & 2) << 7) | ((v & 4) << 14) | ((v & 8) << 21))


def _twin_vst2(a, i, x0, x1):
    f = flat(a)
    f[i], f[i + 1] = x0, x1


def _twin_vst4(a, i, x0, x1, x2, x3):
    f = flat(a)
    f[i], f[i + 1], f[i + 2], f[i + 3] = x0, x1, x2, x3


def _twin_st4w(a, i, w0, w1, w2, w3):
    f = flat(a)
    f[i: i + 16 // f.itemsize].view(np.uint32)[:] = [int(w) & 0xFFFFFFFF for w in (w0, w1, w2, w3)]


_TICKETS = threading.Lock()     # (the simulator runs a CUDA thread per OS thread)


def _twin_none():     # the simulator runs a kernel after the one before it has ended
    return None


def _twin_ticket(arr, idx):
    with _TICKETS:
        f = flat(arr)
        old = f[idx]
        f[idx] = old + 1
    return old


# ---- what kernels call -------------------------------------------------------------------------
# (a[i], ..., a[i + n - 1]) in one 4n-byte load, i a multiple of n and the data 4n-byte
# aligned: ld2 and ld4 for data the kernel only reads, vld4 for memory it also writes
ld2 = pair("ld2", _gpu_ld2, _twin_ld2)
ld4 = pair("ld4", _gpu_ld4, _twin_ld4)
vld4 = pair("vld4", _gpu_vld4, _twin_ld4)
ld4w = pair("ld4w", _gpu_ld4w, _twin_ld4w)
vld4w = pair("vld4w", _gpu_vld4w, _twin_ld4w)
h2f = pair("h2f", _gpu_h2f, _twin_h2f)
f2h2 = pair("f2h2", _gpu_f2h2, _twin_f2h2)
ldh = pair("ldh", _gpu_ldh, _twin_ldh)
ldw = pair("ldw", _gpu_ldw, _twin_ldw)
fld4 = pair("fld4", _gpu_fld4, _twin_fld4)
fbits = pair("fbits", _gpu_fbits, _twin_fbits)
spread4 = pair("spread4", _gpu_spread4, _twin_spread4)
# a[i: i + n] = x0, ..., in one 4n-byte store of 4-byte elements (i a multiple of n, aligned)
vst2 = pair("vst2", _gpu_vst2, _twin_vst2)
vst4 = pair("vst4", _gpu_vst4, _twin_vst4)
st4w = pair("st4w", _gpu_st4w, _twin_st4w)   # the 16 bytes at any array's a[i]: 4 uint32 words
ticket = pair("ticket", _gpu_ticket, _twin_ticket)
grid_wait = pair("grid_wait", _gpu_grid_wait, _twin_none)
grid_launch_dependents = pair("grid_launch_dependents", _gpu_grid_launch_dependents, _twin_none)
