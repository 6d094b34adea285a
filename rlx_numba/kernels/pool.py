"""pool (max / avg) and its gradient (ir/ops_vision.py), 1/2/3-d as 3-d with unit leading dims.
``geo`` and the launch are kernels/conv.py's (kernel, output spatial, input spatial, stride,
pad, dilation; a block's threads along lines), the kernel, stride and dilation compile-time
constants. Max takes the first largest value of a window in row-major order (a NaN wins, as
torch's); its gradient goes to that element. Avg divides by the window clipped to the padded
input (count_include_pad) or to the input. The gradients gather (a thread an input element,
over the windows that hold it): no atomics, the same bits every run."""
import functools
import math

from numba import cuda, float32, int64

from .launch import jit


@functools.lru_cache(maxsize=None)
def _window_fn(k, stride, dil, is_max, include_pad):
    """window(x, base, geo, oz, oy, ox) -> (max or mean, flat offset of the max or -1)."""
    kd, kh, kw = k
    sd, sh, sw = stride
    dd, dh, dw = dil

    @cuda.jit(device=True)
    def window(x, base, geo, oz, oy, ox):
        d, h, w = geo[6], geo[7], geo[8]
        z0, y0, x0 = oz * sd - geo[12], oy * sh - geo[13], ox * sw - geo[14]
        acc = float32(-math.inf) if is_max else float32(0.0)
        at = int64(-1)
        for kz in range(kd):
            z = z0 + kz * dd
            if z < 0 or z >= d:
                continue
            for ky in range(kh):
                y = y0 + ky * dh
                if y < 0 or y >= h:
                    continue
                for kx in range(kw):
                    xx = x0 + kx * dw
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
            acc = acc / _divisor(geo, oz, oy, ox, kd, kh, kw, sd, sh, sw, include_pad)
        return acc, at

    return window


@functools.lru_cache(maxsize=None)
def pool_kernel(k, stride, dil, is_max: bool, include_pad: bool):
    """out[nc, o] = the window's max / mean; arguments (out, x, nc, geo)."""
    window = _window_fn(k, stride, dil, is_max, include_pad)

    @jit
    def kernel(out, x, nc, geo):
        od, oh, ow = geo[3], geo[4], geo[5]
        dhw = geo[6] * geo[7] * geo[8]
        line = int64(cuda.blockIdx.y) * cuda.blockDim.y + cuda.threadIdx.y
        while line < nc * od * oh:
            oy, t = line % oh, line // oh
            oz, q = t % od, t // od
            ox = int64(cuda.threadIdx.x)
            while ox < ow:
                out[line * ow + ox] = window(x, q * dhw, geo, oz, oy, ox)[0]
                ox += cuda.blockDim.x
            line += cuda.gridDim.y * cuda.blockDim.y

    return kernel


@functools.lru_cache(maxsize=None)
def pool_grad_kernel(k, stride, dil, is_max: bool, include_pad: bool):
    """dx[nc, z, y, x] = the sum over the windows holding it of dy (max: where it is the
    window's max; avg: dy / the window's divisor); arguments (dx, x, dy, nc, geo)."""
    kd, kh, kw = k
    sd, sh, sw = stride
    dd, dh, dw = dil
    window = _window_fn(k, stride, dil, is_max, include_pad)

    @jit
    def kernel(dx, x, dy, nc, geo):
        od, oh, ow, d, h, w = geo[3], geo[4], geo[5], geo[6], geo[7], geo[8]
        line = int64(cuda.blockIdx.y) * cuda.blockDim.y + cuda.threadIdx.y
        while line < nc * d * h:
            y, t = line % h, line // h
            z, q = t % d, t // d
            xx = int64(cuda.threadIdx.x)
            while xx < w:
                me = (z * h + y) * w + xx
                acc = float32(0.0)
                for kz in range(kd):
                    tz = z + geo[12] - kz * dd
                    if tz < 0 or tz % sd != 0 or tz // sd >= od:
                        continue
                    for ky in range(kh):
                        ty = y + geo[13] - ky * dh
                        if ty < 0 or ty % sh != 0 or ty // sh >= oh:
                            continue
                        for kx in range(kw):
                            tx = xx + geo[14] - kx * dw
                            if tx < 0 or tx % sw != 0 or tx // sw >= ow:
                                continue
                            oz, oy, ox = tz // sd, ty // sh, tx // sw
                            o = (q * od + oz) * oh * ow + oy * ow + ox
                            if is_max:
                                if window(x, q * d * h * w, geo, oz, oy, ox)[1] == me:
                                    acc += dy[o]
                            else:
                                acc += dy[o] / _divisor(geo, oz, oy, ox, kd, kh, kw, sd, sh, sw,
                                                        include_pad)
                dx[line * w + xx] = acc
                xx += cuda.blockDim.x
            line += cuda.gridDim.y * cuda.blockDim.y

    return kernel


@cuda.jit(device=True)
def _divisor(geo, oz, oy, ox, kd, kh, kw, sd, sh, sw, include_pad):
    """avg's divisor of window (oz, oy, ox): the window clipped to the padded input, or to
    the input."""
    d, h, w = geo[6], geo[7], geo[8]
    z0, y0, x0 = oz * sd - geo[12], oy * sh - geo[13], ox * sw - geo[14]
    if include_pad:
        div = ((min(z0 + kd, d + geo[12]) - z0) * (min(y0 + kh, h + geo[13]) - y0)
               * (min(x0 + kw, w + geo[14]) - x0))
    else:
        div = ((min(z0 + kd, d) - max(z0, 0)) * (min(y0 + kh, h) - max(y0, 0))
               * (min(x0 + kw, w) - max(x0, 0)))
    return float32(div)
