"""im2col and col2im (ir/ops_vision.py), 1/2/3-d as 3-d with unit leading dims.

``geo`` (int64 [18]): kernel (kd, kh, kw), cols spatial (od, oh, ow), image spatial (d, h, w),
stride, pad (low side), dilation, each (depth, height, width). Image element [n, c, z, y, x]
and cols element [n, c, (kz, ky, kx), (oz, oy, ox)] (flat [N, C, K, O]: the group split of
ir/ops_vision.py is the same memory) meet where z = oz*stride - pad + kz*dilation (and so on).

The kernels are made per (kernel, stride, dilation), compile-time constants, so the window
loops unroll and the stride tests are multiplications, not divisions. A block's threads run
along lines (one output row of one kernel offset; one image row), threadIdx.y picks the line,
so a line's index is decoded once and the loads and stores along it are coalesced.
"""
import functools

from numba import cuda, float32, int64

from .launch import block_rows, grid_3d, jit


def lines_launch(lines: int, width: int):
    """(grid, block) for ``lines`` lines of ``width`` elements (the kernels grid-stride)."""
    tx, ty = block_rows(width, 128)
    return grid_3d(1, -(-lines // ty)), (tx, ty)


@functools.lru_cache(maxsize=None)
def im2col_kernel(k, stride, dil):
    """cols[n, c, kidx, o] = x at the window position, 0 in the padding. Arguments (cols, x,
    nc, geo)."""
    kd, kh, kw = k
    sd, sh, sw = stride
    dd, dh, dw = dil
    kk = kd * kh * kw

    @jit
    def kernel(cols, x, nc, geo):
        od, oh, ow, d, h, w = geo[3], geo[4], geo[5], geo[6], geo[7], geo[8]
        pd, ph, pw = geo[12], geo[13], geo[14]
        line = int64(cuda.blockIdx.y) * cuda.blockDim.y + cuda.threadIdx.y
        while line < nc * kk * od * oh:
            oy, t = line % oh, line // oh
            oz, t = t % od, t // od
            kidx, q = t % kk, t // kk
            kx, ky, kz = kidx % kw, (kidx // kw) % kh, kidx // (kw * kh)
            z, y = oz * sd - pd + kz * dd, oy * sh - ph + ky * dh
            inside = z >= 0 and z < d and y >= 0 and y < h
            src, dst = ((q * d + z) * h + y) * w, line * ow
            ox = int64(cuda.threadIdx.x)
            while ox < ow:
                xx = ox * sw - pw + kx * dw
                v = float32(0.0)
                if inside and xx >= 0 and xx < w:
                    v = x[src + xx]
                cols[dst + ox] = v
                ox += cuda.blockDim.x
            line += cuda.gridDim.y * cuda.blockDim.y

    return kernel


@functools.lru_cache(maxsize=None)
def col2im_kernel(k, stride, dil):
    """img[n, c, z, y, x] = the sum of the cols entries whose window position is (z, y, x):
    for each kernel offset, the output position (z + pad - k*dilation) / stride when that
    divides exactly and lies inside (a gather: no atomics). Arguments (img, cols, nc, geo)."""
    kd, kh, kw = k
    sd, sh, sw = stride
    dd, dh, dw = dil
    kk = kd * kh * kw

    @jit
    def kernel(img, cols, nc, geo):
        od, oh, ow, d, h, w = geo[3], geo[4], geo[5], geo[6], geo[7], geo[8]
        pd, ph, pw = geo[12], geo[13], geo[14]
        oo = od * oh * ow
        line = int64(cuda.blockIdx.y) * cuda.blockDim.y + cuda.threadIdx.y
        while line < nc * d * h:
            y, t = line % h, line // h
            z, q = t % d, t // d
            xx = int64(cuda.threadIdx.x)
            while xx < w:
                acc = float32(0.0)
                for kz in range(kd):
                    tz = z + pd - kz * dd
                    if tz < 0 or tz % sd != 0 or tz // sd >= od:
                        continue
                    for ky in range(kh):
                        ty = y + ph - ky * dh
                        if ty < 0 or ty % sh != 0 or ty // sh >= oh:
                            continue
                        for kx in range(kw):
                            tx = xx + pw - kx * dw
                            if tx < 0 or tx % sw != 0 or tx // sw >= ow:
                                continue
                            o = ((tz // sd) * oh + ty // sh) * ow + tx // sw
                            acc += cols[(q * kk + (kz * kh + ky) * kw + kx) * oo + o]
                img[line * w + xx] = acc
                xx += cuda.blockDim.x
            line += cuda.gridDim.y * cuda.blockDim.y

    return kernel
