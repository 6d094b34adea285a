"""im2col and col2im (ir/ops_vision.py), 1/2/3-d as 3-d with unit leading dims.

``geo`` (uint64 [18]): kernel (kd, kh, kw), cols spatial (od, oh, ow), image spatial (d, h, w),
stride, pad (low side), dilation, each (depth, height, width). Image element [n, c, z, y, x]
and cols element [n, c, (kz, ky, kx), (oz, oy, ox)] (flat [N, C, K, O]: the group split of
ir/ops_vision.py is the same memory) meet where z = oz*stride - pad + kz*dilation (and so on).

The kernels are made per (kernel, stride, dilation), compile-time constants, so the window
loops unroll and the stride tests are multiplications, not divisions. A block's threads run
along lines (one output row of one kernel offset; one image row), threadIdx.y picks the line,
so a line's index is decoded once and the loads and stores along it are coalesced. Index math
is uint64 (as kernels/codegen.py's): numba adds a negative-index fix-up to signed subscripts and
sign fix-ups to signed // and %. Window positions are compared in the padded input, so no
index goes negative.

Each factory takes the data's storage kind (kernels/halfio.py: "f32", "f16", "bf16") as a
compile-time string: loads widen to f32, sums run in f32, stores round once (the
implicit-GEMM kernels through kernels/matmul.py's tile store hook, their epilogue included).
"""
import functools

import numpy as np
from numba import cuda, float32, uint64

from . import halfio
from . import matmul as mm
from .launch import block_rows, grid_3d, inline, jit, waves_cap


def u64s(*vals):
    """The values as uint64 compile-time constants (a kernel's index arithmetic stays unsigned)."""
    return tuple(np.uint64(v) for v in vals)


def lines_launch(lines: int, width: int, split: bool = False):
    """(grid, block) for ``lines`` lines of ``width`` elements (the kernels grid-stride).
    ``split``, for a kernel whose x threads stride over blocks too: where lines alone are too
    few to fill the GPU, a line's width is split over x blocks (a channels-last 7x7 -> 1
    resample of [32, 7, 7, 2048] over axis 1 is 32 lines of 14,336: 32 blocks took 176 us on
    an H200)."""
    tx, ty = block_rows(width, 128)
    gy = -(-lines // ty)
    gx = max(1, min(-(-width // tx), -(-waves_cap(tx * ty, 1) // gy))) if split else 1
    return grid_3d(gx, gy), (tx, ty)


@inline
def window_at(p, tap, dil, stride, n):
    """The output index whose window holds padded-input position ``p`` at kernel tap ``tap``
    (one dim), or ``n`` when none does (col2im's and pool_grad's gathers; all uint64)."""
    if p < tap * dil:
        return n
    t = p - tap * dil
    if t % stride != 0 or t // stride >= n:
        return n
    return t // stride


@functools.lru_cache(maxsize=None)
def im2col_kernel(k, stride, dil, kind="f32"):
    """cols[n, c, kidx, o] = x at the window position, 0 in the padding. A line is one output
    row (n, c, oz, oy); its threads write that row for every kernel tap in turn (the taps'
    reads of x overlap, in L1), so the line is decoded once for all of them. Arguments (cols,
    x, nc, geo)."""
    ld, st = halfio.load(kind), halfio.store(kind)
    kd, kh, kw = u64s(*k)
    sd, sh, sw = u64s(*stride)
    dd, dh, dw = u64s(*dil)
    kk = kd * kh * kw

    @jit
    def kernel(cols, x, nc, geo):
        od, oh, ow, d, h, w = geo[3], geo[4], geo[5], geo[6], geo[7], geo[8]
        pd, ph, pw = geo[12], geo[13], geo[14]
        oo = od * oh * ow
        line = uint64(cuda.blockIdx.y) * uint64(cuda.blockDim.y) + uint64(cuda.threadIdx.y)
        while line < nc * od * oh:
            oy, t = line % oh, line // oh
            oz, q = t % od, t // od
            row = q * kk * oo + (oz * oh + oy) * ow      # cols row of tap 0, this output row
            for kz in range(kd):
                zp = oz * sd + uint64(kz) * dd           # in the padded input
                for ky in range(kh):
                    yp = oy * sh + uint64(ky) * dh
                    inside = pd <= zp < pd + d and ph <= yp < ph + h
                    src = ((q * d + zp - pd) * h + yp - ph) * w if inside else uint64(0)
                    for kx in range(kw):
                        dst = row + ((uint64(kz) * kh + uint64(ky)) * kw + uint64(kx)) * oo
                        ox = uint64(cuda.threadIdx.x)
                        while ox < ow:
                            xp = ox * sw + uint64(kx) * dw
                            v = float32(0.0)
                            if inside and pw <= xp < pw + w:
                                v = ld(x, src + xp - pw)
                            st(cols, dst + ox, v)
                            ox += uint64(cuda.blockDim.x)
            line += uint64(cuda.gridDim.y) * uint64(cuda.blockDim.y)

    return kernel


@functools.lru_cache(maxsize=None)
def col2im_kernel(k, stride, dil, kind="f32"):
    """img[n, c, z, y, x] = the sum of the cols entries whose window position is (z, y, x):
    for each kernel offset, the output position (z + pad - k*dilation) / stride when that
    divides exactly and lies inside (a gather: no atomics). Arguments (img, cols, nc, geo)."""
    ld, st = halfio.load(kind), halfio.store(kind)
    kd, kh, kw = u64s(*k)
    sd, sh, sw = u64s(*stride)
    dd, dh, dw = u64s(*dil)
    kk = kd * kh * kw

    @jit
    def kernel(img, cols, nc, geo):
        od, oh, ow, d, h, w = geo[3], geo[4], geo[5], geo[6], geo[7], geo[8]
        pd, ph, pw = geo[12], geo[13], geo[14]
        oo = od * oh * ow
        line = uint64(cuda.blockIdx.y) * uint64(cuda.blockDim.y) + uint64(cuda.threadIdx.y)
        while line < nc * d * h:
            y, t = line % h, line // h
            z, q = t % d, t // d
            xx = uint64(cuda.threadIdx.x)
            while xx < w:
                acc = float32(0.0)
                for kz in range(kd):
                    oz = window_at(z + pd, uint64(kz), dd, sd, od)
                    if oz == od:
                        continue
                    for ky in range(kh):
                        oy = window_at(y + ph, uint64(ky), dh, sh, oh)
                        if oy == oh:
                            continue
                        for kx in range(kw):
                            ox = window_at(xx + pw, uint64(kx), dw, sw, ow)
                            if ox == ow:
                                continue
                            r = (q * kk + (uint64(kz) * kh + uint64(ky)) * kw + uint64(kx))
                            acc += ld(cols, r * oo + (oz * oh + oy) * ow + ox)
                st(img, line * w + xx, acc)
                xx += uint64(cuda.blockDim.x)
            line += uint64(cuda.gridDim.y) * uint64(cuda.blockDim.y)

    return kernel


# ---- the numba tier: implicit-GEMM convolutions ------------------------------------------
# kernels/matmul.py's tiled product with B (and A) gathered from the image and the weight as
# the tiles load, so no column matrix is ever written. For batch z = n * G + g:
#   conv            y[n, g] [Kg, L] = w[g] [Kg, R] @ cols, cols[(c, tap), o] the image at o's
#                   window position for tap (0 in the padding): im2col on the fly;
#   conv_transpose  img[n, g] [Cg, S] = w[g]^T [Cg, (k, tap)] @ z gathered, the z entry whose
#                   window holds the image position at tap (window_at; 0 where none): col2im's
#                   gather on the fly.
# a_off / b_off hold each z's first element of the weight and of the gathered source.

@functools.lru_cache(maxsize=None)
def conv_gemm_kernel(k, stride, dil, transposed, kind="f32", bias=False, residual=False,
                     relu=False):
    """kernel(out, w, src, m, n, kdim, a_off, b_off, batch, geo) (geo: im2col's, above), w,
    src and out of storage ``kind`` (the f32 sums rounded once on the store). With an
    epilogue (passes/fusion.py's conv epilogue) the kernel takes (b, z, plane, channels)
    after geo, and each f32 sum gets, before that one rounding, + b[channel] (``bias``: b
    [channels] of ``kind``), + z at the output's element (``residual``: z of out's shape and
    ``kind``), then relu (NaN propagates, as torch's); out is [N, channels, plane] flat, so
    element i's channel is i // plane % channels (b and z are unused where their flag is
    off). Launch with kernels/matmul.py's sgemm_launch(m, n, batch)."""
    ld, st = halfio.load(kind), halfio.store(kind)
    kd, kh, kw = u64s(*k)
    sd, sh, sw = u64s(*stride)
    dd, dh, dw = u64s(*dil)
    kk, khw = kd * kh * kw, kh * kw
    zero = float32(0.0)

    @inline
    def fetch_w(a, ao, r, q, m, kdim, geo):
        if transposed:    # w [Kc, Cg, taps]: row r = c, q = (k, tap)
            return ld(a, ao + (q // kk * m + r) * kk + q % kk)
        return ld(a, ao + r * kdim + q)

    @inline
    def out_position(cl, n, geo):
        """Output position cl's window origin in the padded input (forward conv)."""
        ow, oh = geo[5], geo[4]
        ox, r = cl % ow, cl // ow
        return r // oh * sd, r % oh * sh, ox * sw

    @inline
    def image_position(cl, n, geo):
        """Image position cl in the padded input (conv_transpose)."""
        h, w = geo[7], geo[8]
        xx, r = cl % w, cl // w
        return r // h + geo[12], r % h + geo[13], xx + geo[14]

    @inline
    def gather_image(b, bo, q, cl, pos, n, kdim, geo):
        d, h, w = geo[6], geo[7], geo[8]
        c, t = q // kk, q % kk
        zp = pos[0] + t // khw * dd               # in the padded input
        yp = pos[1] + t // kw % kh * dh
        xp = pos[2] + t % kw * dw
        if geo[12] <= zp < geo[12] + d and geo[13] <= yp < geo[13] + h \
                and geo[14] <= xp < geo[14] + w:
            return ld(b, bo + ((c * d + zp - geo[12]) * h + yp - geo[13]) * w + xp - geo[14])
        return float32(0.0)

    @inline
    def gather_cols(b, bo, q, cl, pos, n, kdim, geo):
        od, oh, ow = geo[3], geo[4], geo[5]
        kc, t = q // kk, q % kk
        oz = window_at(pos[0], t // khw, dd, sd, od)
        oy = window_at(pos[1], t // kw % kh, dh, sh, oh)
        ox = window_at(pos[2], t % kw, dw, sw, ow)
        if oz == od or oy == oh or ox == ow:
            return float32(0.0)
        return ld(b, bo + (kc * od + oz) * oh * ow + oy * ow + ox)

    @inline
    def put(c, i, v):
        """The tile store hook: c = (out, b, z, plane, channels); the epilogue, one rounding."""
        out, b, z, plane, channels = c
        if bias:
            v += ld(b, i // plane % channels)
        if residual:
            v += ld(z, i)
        if relu and v < zero:      # (NaN < 0 is false: NaN stays)
            v = zero
        st(out, i, v)

    tiles = mm.gemm_tiles(False, False, fetch_w, gather_cols if transposed else gather_image,
                          image_position if transposed else out_position, put)

    if bias or residual or relu:
        @jit(launch_bounds=mm.LAUNCH_BOUNDS)
        def kernel(out, w, src, m, n, kdim, a_off, b_off, batch, geo, b, z, plane, channels):
            tiles((out, b, z, plane, channels), w, src, m, n, kdim, a_off, b_off, batch, geo)
    else:
        @jit(launch_bounds=mm.LAUNCH_BOUNDS)
        def kernel(out, w, src, m, n, kdim, a_off, b_off, batch, geo):
            tiles((out, out, out, m, m), w, src, m, n, kdim, a_off, b_off, batch, geo)

    return kernel
