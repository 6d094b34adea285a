"""pool (max / avg) and its gradient (ir/ops_vision.py), 1/2/3-d as 3-d with unit leading dims.
``geo`` is kernels/conv.py's: kernel, output spatial, input spatial, stride, pad, dilation.
Max takes the first largest value of a window in row-major order (a NaN wins, as torch's);
its gradient goes to that element. Avg divides by the window clipped to the padded input
(count_include_pad) or to the input. The gradients gather (a thread an input element, over
the windows that hold it): no atomics, the same bits every run."""
import functools
import math

from numba import cuda, float32, int64

from .launch import jit


@cuda.jit(device=True)
def _divisor(geo, oz, oy, ox, include_pad):
    """avg's divisor of window (oz, oy, ox): the window clipped to the padded input, or to
    the input."""
    kd, kh, kw, d, h, w = geo[0], geo[1], geo[2], geo[6], geo[7], geo[8]
    z0, y0, x0 = oz * geo[9] - geo[12], oy * geo[10] - geo[13], ox * geo[11] - geo[14]
    if include_pad:
        return float32((min(z0 + kd, d + geo[12]) - z0) * (min(y0 + kh, h + geo[13]) - y0)
                       * (min(x0 + kw, w + geo[14]) - x0))
    return float32((min(z0 + kd, d) - max(z0, 0)) * (min(y0 + kh, h) - max(y0, 0))
                   * (min(x0 + kw, w) - max(x0, 0)))


@cuda.jit(device=True)
def _window(x, base, geo, oz, oy, ox, is_max, include_pad):
    """(value, flat input offset of the max) of window (oz, oy, ox); for avg (mean, -1)."""
    kd, kh, kw = geo[0], geo[1], geo[2]
    d, h, w = geo[6], geo[7], geo[8]
    z0, y0, x0 = oz * geo[9] - geo[12], oy * geo[10] - geo[13], ox * geo[11] - geo[14]
    acc = float32(-math.inf) if is_max else float32(0.0)
    at = int64(-1)
    for kz in range(kd):
        z = z0 + kz * geo[15]
        if z < 0 or z >= d:
            continue
        for ky in range(kh):
            y = y0 + ky * geo[16]
            if y < 0 or y >= h:
                continue
            for kx in range(kw):
                xx = x0 + kx * geo[17]
                if xx < 0 or xx >= w:
                    continue
                off = (z * h + y) * w + xx
                v = x[base + off]
                if is_max:
                    if v > acc or (v != v and acc == acc) or at < 0:
                        acc, at = v, off
                else:
                    acc += v
    if not is_max:
        acc = acc / _divisor(geo, oz, oy, ox, include_pad)
    return float32(acc), at


@functools.lru_cache(maxsize=None)
def pool_kernel(is_max: bool, include_pad: bool):
    """out[nc, o] = the window's max / mean; arguments (out, x, nc, geo)."""
    @jit
    def kernel(out, x, nc, geo):
        od, oh, ow = geo[3], geo[4], geo[5]
        dhw = geo[6] * geo[7] * geo[8]
        i = int64(cuda.grid(1))
        while i < nc * od * oh * ow:
            ox, oy, oz, q = i % ow, (i // ow) % oh, (i // (ow * oh)) % od, i // (ow * oh * od)
            out[i] = _window(x, q * dhw, geo, oz, oy, ox, is_max, include_pad)[0]
            i += cuda.gridsize(1)
    return kernel


@functools.lru_cache(maxsize=None)
def pool_grad_kernel(is_max: bool, include_pad: bool):
    """dx[nc, z, y, x] = the sum over the windows holding it of dy (max: where it is the
    window's max; avg: dy / the window's divisor); arguments (dx, x, dy, nc, geo)."""
    @jit
    def kernel(dx, x, dy, nc, geo):
        kd, kh, kw, od, oh, ow = geo[0], geo[1], geo[2], geo[3], geo[4], geo[5]
        d, h, w = geo[6], geo[7], geo[8]
        i = int64(cuda.grid(1))
        while i < nc * d * h * w:
            xx, y, z, q = i % w, (i // w) % h, (i // (w * h)) % d, i // (w * h * d)
            me = (z * h + y) * w + xx
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
                        oz, oy, ox = tz // geo[9], ty // geo[10], tx // geo[11]
                        o = q * od * oh * ow + (oz * oh + oy) * ow + ox
                        if is_max:
                            if _window(x, q * d * h * w, geo, oz, oy, ox, True, False)[1] == me:
                                acc += dy[o]
                        else:
                            acc += dy[o] / _divisor(geo, oz, oy, ox, include_pad)
            dx[i] = acc
            i += cuda.gridsize(1)
    return kernel
