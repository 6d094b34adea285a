"""im2col and col2im (ir/ops_vision.py), 1/2/3-d as 3-d with unit leading dims.

``geo`` (int64 [18]): kernel (kd, kh, kw), cols spatial (od, oh, ow), image spatial (d, h, w),
stride, pad (low side), dilation, each (depth, height, width). Image element [n, c, z, y, x]
and cols element [n, c, (kz, ky, kx), (oz, oy, ox)] (flat [N, C, K, O]: the group split of
ir/ops_vision.py is the same memory) meet where z = oz*stride - pad + kz*dilation (and so on).
"""
from numba import cuda, float32, int64

from .launch import jit


@jit
def im2col_kernel(cols, x, n, c, geo):
    """cols[n, c, k, o] = x at the window position, 0 in the padding; a thread an element
    (grid-stride, o fastest: neighbouring threads read neighbouring x at stride 1)."""
    kd, kh, kw, od, oh, ow = geo[0], geo[1], geo[2], geo[3], geo[4], geo[5]
    d, h, w = geo[6], geo[7], geo[8]
    kk, oo = kd * kh * kw, od * oh * ow
    total = n * c * kk * oo
    i = int64(cuda.grid(1))
    while i < total:
        o, r = i % oo, i // oo
        kidx, nc = r % kk, r // kk
        ox, oy, oz = o % ow, (o // ow) % oh, o // (ow * oh)
        kx, ky, kz = kidx % kw, (kidx // kw) % kh, kidx // (kw * kh)
        z = oz * geo[9] - geo[12] + kz * geo[15]
        y = oy * geo[10] - geo[13] + ky * geo[16]
        xx = ox * geo[11] - geo[14] + kx * geo[17]
        v = float32(0.0)
        if 0 <= z < d and 0 <= y < h and 0 <= xx < w:
            v = x[((nc * d + z) * h + y) * w + xx]
        cols[i] = v
        i += cuda.gridsize(1)


@jit
def col2im_kernel(img, cols, n, c, geo):
    """img[n, c, z, y, x] = the sum of the cols entries whose window position is (z, y, x):
    for each kernel offset, the output position (z + pad - k*dilation) / stride when that
    divides exactly and lies inside (a gather, a thread an image element: no atomics)."""
    kd, kh, kw, od, oh, ow = geo[0], geo[1], geo[2], geo[3], geo[4], geo[5]
    d, h, w = geo[6], geo[7], geo[8]
    kk, oo = kd * kh * kw, od * oh * ow
    total = n * c * d * h * w
    i = int64(cuda.grid(1))
    while i < total:
        xx, y, z, nc = i % w, (i // w) % h, (i // (w * h)) % d, i // (w * h * d)
        acc = float32(0.0)
        for kz in range(kd):
            tz = z + geo[12] - kz * geo[15]
            if tz < 0 or tz % geo[9] != 0 or tz // geo[9] >= od:
                continue
            for ky in range(kh):
                ty = y + geo[13] - ky * geo[16]
                if ty < 0 or ty % geo[10] != 0 or ty // geo[10] >= oh:
                    continue
                for kx in range(kw):
                    tx = xx + geo[14] - kx * geo[17]
                    if tx < 0 or tx % geo[11] != 0 or tx // geo[11] >= ow:
                        continue
                    o = ((tz // geo[9]) * oh + ty // geo[10]) * ow + tx // geo[11]
                    acc += cols[(nc * kk + (kz * kh + ky) * kw + kx) * oo + o]
        img[i] = acc
        i += cuda.gridsize(1)
