"""Memory instructions numba's CUDA API does not expose, as numba intrinsics (LLVM IR and
inline PTX), with plain Python twins for the simulator.

``ld2`` / ``ld4``: two / four float32 in one 8- / 16-byte load of read-only data
(ld.global.nc.v2.f32, .v4.f32); ``ld4w``: 16 bytes of any array as four uint32 words (8 half
weights), and ``h2f`` to widen an f16 pair word (cvt.f32.f16); ``vld4``
and ``vst4`` / ``vst2``: a 16-byte load and a 16- / 8-byte store of memory the kernel also
writes (shared memory, partials, dequantised weights). numba's array accesses are one element each, and a warp waiting on its load
queue, not DRAM, is what bounds the decode kernel. ``ldh`` / ``ldw`` / ``fld4`` / ``fbits`` / ``spread4``: 32-bit words of packed
quantised data and their bit fields as exact floats (numba types every integer op 64-bit).
``ticket``: atomicAdd(+1) with
acquire-release semantics (atom.acq_rel.gpu), the last-block-combines handshake without
the two sequentially consistent fences (membar.gl) that numba's threadfence would add.
Indices are flat element offsets from the array's start, whatever its rank.
"""
from ..device import SIMULATOR

if not SIMULATOR:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

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

    # (a[i], ..., a[i + n - 1]) in one 4n-byte load, i a multiple of n and the data 4n-byte
    # aligned: ld2 and ld4 for data the kernel only reads, vld4 for memory it also writes
    ld2 = intrinsic(_load("ld2", 2, True))
    ld4 = intrinsic(_load("ld4", 4, True))
    vld4 = intrinsic(_load("vld4", 4, False))

    @intrinsic
    def ld4w(typingctx, arr, idx):
        """The 16 bytes at a[i] (any element type; i a flat element offset, 16-byte aligned)
        as 4 uint32 words, one read-only load: 8 f16/bf16 weights at once."""
        sig = types.UniTuple(types.uint32, 4)(arr, idx)

        def codegen(context, builder, sig, args):
            vt = ir.VectorType(_I32, 4)
            ptr = builder.gep(_data(context, builder, sig.args[0], args[0]), [args[1]])
            v = builder.load(builder.bitcast(ptr, vt.as_pointer()), align=16)
            v.set_metadata("invariant.load", builder.module.add_metadata([]))
            return context.make_tuple(builder, sig.return_type, [
                builder.extract_element(v, ir.Constant(_I32, i)) for i in range(4)])
        return sig, codegen

    @intrinsic
    def h2f(typingctx, word):
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

    @intrinsic
    def ldh(typingctx, arr, idx):
        """The halfword a[i] (a uint16 array) as uint32, a read-only load."""
        sig = types.uint32(arr, idx)

        def codegen(context, builder, sig, args):
            i = context.cast(builder, args[1], sig.args[1], types.int64)
            v = builder.load(builder.gep(_data(context, builder, sig.args[0], args[0]), [i]))
            v.set_metadata("invariant.load", builder.module.add_metadata([]))
            return builder.zext(v, _I32)
        return sig, codegen

    @intrinsic
    def ldw(typingctx, arr, idx):
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
    def fld4(typingctx, word, stride, sh, mask, xo, hw, hstride, hsh, hmask, hpos, bias):
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
    def fbits(typingctx, word, sh, mask):
        """float32 of (word >> sh) & mask (32-bit ops; exact through the 2**23 mantissa)."""
        sig = types.float32(word, sh, mask)

        def codegen(context, builder, sig, args):
            w, s, m = (context.cast(builder, a, t, types.uint32) for a, t in zip(args, sig.args))
            f = builder.or_(builder.and_(builder.lshr(w, s), m), ir.Constant(_I32, 0x4B000000))
            return builder.fsub(builder.bitcast(f, _F32), ir.Constant(_F32, 8388608.0))
        return sig, codegen

    @intrinsic
    def spread4(typingctx, word, j):
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

    # a[i: i + n] = x0, ..., in one 4n-byte store of 4-byte elements (i a multiple of n, aligned)
    @intrinsic
    def vst2(typingctx, arr, idx, x0, x1):
        return types.void(arr, idx, x0, x1), _store_codegen

    @intrinsic
    def vst4(typingctx, arr, idx, x0, x1, x2, x3):
        return types.void(arr, idx, x0, x1, x2, x3), _store_codegen

    @intrinsic
    def ticket(typingctx, arr, idx):
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
else:   # device functions, so the simulator hands them its cuda module as it does kernels
    import numpy as np
    from numba import cuda

    def _flat(a):    # (the index is flat, as the GPU versions' pointer arithmetic is)
        return getattr(a, "_ary", a).reshape(-1)

    @cuda.jit(device=True)
    def ld2(a, i):
        f = _flat(a)
        return f[i], f[i + 1]

    @cuda.jit(device=True)
    def ld4(a, i):
        f = _flat(a)
        return f[i], f[i + 1], f[i + 2], f[i + 3]

    vld4 = ld4

    @cuda.jit(device=True)
    def ld4w(a, i):
        f = _flat(a)
        w = np.ascontiguousarray(f[i: i + 16 // f.itemsize]).view(np.uint32)
        return w[0], w[1], w[2], w[3]

    @cuda.jit(device=True)
    def h2f(word):
        h = np.array([word], np.uint32).view(np.float16).astype(np.float32)
        return h[0], h[1]

    @cuda.jit(device=True)
    def ldh(a, i):
        return np.uint32(_flat(a)[i])

    @cuda.jit(device=True)
    def ldw(a, i):
        f = _flat(a)
        return np.uint32(int(f[i]) | (int(f[i + 1]) << 16))

    @cuda.jit(device=True)
    def fld4(word, stride, sh, mask, xo, hw, hstride, hsh, hmask, hpos, bias):
        w, h = int(word), int(hw)
        out = []
        for i in range(4):
            f = (((w >> (stride * i + sh)) & mask) ^ xo) | (((h >> (hstride * i + hsh)) & hmask) << hpos)
            out.append(np.float32(np.float32(8388608 + f) - np.float32(bias)))
        return out[0], out[1], out[2], out[3]

    @cuda.jit(device=True)
    def fbits(word, sh, mask):
        return np.float32((int(word) >> int(sh)) & int(mask))

    @cuda.jit(device=True)
    def spread4(word, j):
        v = (int(word) >> int(j)) & 15
        return np.uint32((v & 1) | ((v & 2) << 7) | ((v & 4) << 14) | ((v & 8) << 21))

    @cuda.jit(device=True)
    def vst2(a, i, x0, x1):
        f = _flat(a)
        f[i], f[i + 1] = x0, x1

    @cuda.jit(device=True)
    def vst4(a, i, x0, x1, x2, x3):
        f = _flat(a)
        f[i], f[i + 1], f[i + 2], f[i + 3] = x0, x1, x2, x3

    @cuda.jit(device=True)
    def ticket(arr, idx):
        return cuda.atomic.add(arr, idx, 1)
