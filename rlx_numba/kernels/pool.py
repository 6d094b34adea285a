"""pool (max / avg) and its gradient (ir/ops_vision.py), 1/2/3-d as 3-d with unit leading dims;
a channels-last pool (pool_nhwc_kernel) runs its threads along the channels.
``geo``, the launch and the uint64 index math are kernels/conv.py's (kernel, output spatial,
input spatial, stride, pad, dilation; a block's threads along lines), the kernel, stride and
dilation compile-time constants. Max takes the first largest value of a window in row-major
order, or its last NaN (torch's ``v > max || isnan(v)``); its gradient goes to that element.
Avg divides by the window clipped to the padded input (count_include_pad) or to the input.
The gradients gather (a thread an input element, over the windows that hold it): no atomics,
the same bits every run. The factories take the data's storage kind (kernels/halfio.py):
loads widen to f32, the mean and the gradient's sums run in f32, the store rounds once."""
import functools
import math

from numba import cuda, float32, int64, uint64

from . import halfio
from .conv import u64s, window_at
from .launch import inline, jit


@functools.lru_cache(maxsize=None)
def _window_fn(k, stride, dil, is_max, include_pad, kind, channels_last=False):
    """window(x, base, geo, oz, oy, ox, cs) -> (max or mean in f32, flat offset of the max or
    -1); ``channels_last``: neighbouring positions are ``cs`` elements apart (the channels),
    else 1 (``cs`` unused)."""
    ld = halfio.load(kind)
    kd, kh, kw = u64s(*k)
    sd, sh, sw = u64s(*stride)
    dd, dh, dw = u64s(*dil)
    divisor = _divisor_fn(k, stride, include_pad)

    @inline
    def window(x, base, geo, oz, oy, ox, cs):
        d, h, w, pd, ph, pw = geo[6], geo[7], geo[8], geo[12], geo[13], geo[14]
        acc = float32(-math.inf) if is_max else float32(0.0)
        at = int64(-1)
        for kz in range(kd):
            zp = oz * sd + uint64(kz) * dd              # in the padded input
            if zp < pd or zp >= pd + d:
                continue
            for ky in range(kh):
                yp = oy * sh + uint64(ky) * dh
                if yp < ph or yp >= ph + h:
                    continue
                for kx in range(kw):
                    xp = ox * sw + uint64(kx) * dw
                    if xp < pw or xp >= pw + w:
                        continue
                    off = ((zp - pd) * h + yp - ph) * w + xp - pw
                    v = ld(x, base + off * cs) if channels_last else ld(x, base + off)
                    if is_max:   # torch's rule: any NaN replaces, so the last NaN wins
                        if v > acc or v != v or at < 0:
                            acc, at = v, int64(off)
                    else:
                        acc += v
        if not is_max:
            acc = acc / divisor(geo, oz, oy, ox)
        return acc, at

    return window


@functools.lru_cache(maxsize=None)
def _divisor_fn(k, stride, include_pad):
    """divisor(geo, oz, oy, ox): avg's divisor of a window, the window clipped to the padded
    input or to the input (in padded coordinates: the input is [pad, pad + size))."""
    kd, kh, kw = u64s(*k)
    sd, sh, sw = u64s(*stride)

    @inline
    def divisor(geo, oz, oy, ox):
        d, h, w, pd, ph, pw = geo[6], geo[7], geo[8], geo[12], geo[13], geo[14]
        z0, y0, x0 = oz * sd, oy * sh, ox * sw
        if include_pad:
            n = ((min(z0 + kd, d + 2 * pd) - z0) * (min(y0 + kh, h + 2 * ph) - y0)
                 * (min(x0 + kw, w + 2 * pw) - x0))
        else:
            n = ((min(z0 + kd, d + pd) - max(z0, pd)) * (min(y0 + kh, h + ph) - max(y0, ph))
                 * (min(x0 + kw, w + pw) - max(x0, pw)))
        return float32(n)

    return divisor


# output lines a thread of pool_kernel, their loads issued before any store (as
# kernels/resample.py's GROUP). On an H200, 3x3 s2 max pool of 8x64x112x112: 32.8 -> 31.1 us,
# avg pool (ceil) of 8x64x56x56: 11.9 -> 11.1 us with 2 (4: 31.5 and 11.8; 8: 33.6 and 13.8)
GROUP = 2


@functools.lru_cache(maxsize=None)
def pool_kernel(k, stride, dil, is_max: bool, include_pad: bool, kind="f32"):
    """out[nc, o] = the window's max / mean; arguments (out, x, nc, geo). A thread does
    GROUP consecutive output lines: launch over ceil(lines / GROUP) of them."""
    window = _window_fn(k, stride, dil, is_max, include_pad, kind)
    st = halfio.store(kind)
    group, ug = GROUP, uint64(GROUP)

    @jit
    def kernel(out, x, nc, geo):
        od, oh, ow = geo[3], geo[4], geo[5]
        dhw = geo[6] * geo[7] * geo[8]
        vals = cuda.local.array(group, float32)
        lines = nc * od * oh
        first = (uint64(cuda.blockIdx.y) * uint64(cuda.blockDim.y) + uint64(cuda.threadIdx.y)) * ug
        while first < lines:
            ox = uint64(cuda.threadIdx.x)
            while ox < ow:
                for r in range(group):
                    line = min(first + uint64(r), lines - uint64(1))
                    oy, t = line % oh, line // oh
                    oz, q = t % od, t // od
                    vals[r] = window(x, q * dhw, geo, oz, oy, ox, uint64(1))[0]
                for r in range(group):
                    if first + uint64(r) < lines:
                        st(out, (first + uint64(r)) * ow + ox, vals[r])
                ox += uint64(cuda.blockDim.x)
            first += uint64(cuda.gridDim.y) * uint64(cuda.blockDim.y) * ug

    return kernel


@functools.lru_cache(maxsize=None)
def pool_nhwc_kernel(k, stride, dil, is_max: bool, include_pad: bool, kind="f32"):
    """Channels last: out[n, o, c] = the window's max / mean over x [N, *S, C]; arguments (out,
    x, lines, c, geo), lines = N * prod(O): a line is one output position's channels, a block's
    threads along them (each warp's loads one contiguous run of x)."""
    window = _window_fn(k, stride, dil, is_max, include_pad, kind, True)
    st = halfio.store(kind)

    @jit
    def kernel(out, x, lines, c, geo):
        od, oh, ow = geo[3], geo[4], geo[5]
        dhw = geo[6] * geo[7] * geo[8]
        line = uint64(cuda.blockIdx.y) * uint64(cuda.blockDim.y) + uint64(cuda.threadIdx.y)
        while line < lines:
            ox, t = line % ow, line // ow
            oy, t = t % oh, t // oh
            oz, q = t % od, t // od
            ch = uint64(cuda.threadIdx.x)
            while ch < c:
                st(out, line * c + ch, window(x, q * dhw * c + ch, geo, oz, oy, ox, c)[0])
                ch += uint64(cuda.blockDim.x)
            line += uint64(cuda.gridDim.y) * uint64(cuda.blockDim.y)

    return kernel


@functools.lru_cache(maxsize=None)
def pool_grad_kernel(k, stride, dil, is_max: bool, include_pad: bool, kind="f32"):
    """dx[nc, z, y, x] = the sum over the windows holding it of dy (max: where it is the
    window's max; avg: dy / the window's divisor); arguments (dx, x, dy, nc, geo)."""
    kd, kh, kw = u64s(*k)
    sd, sh, sw = u64s(*stride)
    dd, dh, dw = u64s(*dil)
    window = _window_fn(k, stride, dil, is_max, include_pad, kind)
    divisor = _divisor_fn(k, stride, include_pad)
    ld, st = halfio.load(kind), halfio.store(kind)

    @jit
    def kernel(dx, x, dy, nc, geo):
        od, oh, ow, d, h, w = geo[3], geo[4], geo[5], geo[6], geo[7], geo[8]
        line = uint64(cuda.blockIdx.y) * uint64(cuda.blockDim.y) + uint64(cuda.threadIdx.y)
        while line < nc * d * h:
            y, t = line % h, line // h
            z, q = t % d, t // d
            xx = uint64(cuda.threadIdx.x)
            while xx < w:
                me = int64((z * h + y) * w + xx)
                acc = float32(0.0)
                zp, yp, xp = z + geo[12], y + geo[13], xx + geo[14]    # in the padded input
                for kz in range(kd):       # the windows holding (z, y, xx), as col2im's
                    oz = window_at(zp, uint64(kz), dd, sd, od)
                    if oz == od:
                        continue
                    for ky in range(kh):
                        oy = window_at(yp, uint64(ky), dh, sh, oh)
                        if oy == oh:
                            continue
                        for kx in range(kw):
                            ox = window_at(xp, uint64(kx), dw, sw, ow)
                            if ox == ow:
                                continue
                            o = ((q * od + oz) * oh + oy) * ow + ox
                            if is_max:
                                if window(x, q * d * h * w, geo, oz, oy, ox,
                                          uint64(1))[1] == me:
                                    acc += ld(dy, o)
                            else:
                                acc += ld(dy, o) / divisor(geo, oz, oy, ox)
                st(dx, line * w + xx, acc)
                xx += uint64(cuda.blockDim.x)
            line += uint64(cuda.gridDim.y) * uint64(cuda.blockDim.y)

    return kernel
