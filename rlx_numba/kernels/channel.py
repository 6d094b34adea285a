"""channel_affine (ir/ops_vision.py): y[n, c, s] = (x[n, c, s] - center[c]) * scale[c] +
shift[c] over x [N, C, S...], the per-channel step of batch_norm and group_norm. Launched as
kernels/conv.py's lines: a line is one (n, c) row, read and written contiguously, its channel's
values loaded once. With var and eps (batch_norm's) the scale is scale[c] / sqrt(var[c] + eps).
The kernel is made per storage kind (kernels/halfio.py) of x (and out) and of the per-channel
operands (f32 or x's): loads widen to f32, the math is f32, the store rounds once."""
import functools
import math

from numba import cuda, float32, uint64

from . import halfio
from .launch import jit


@functools.lru_cache(maxsize=None)
def channel_affine_kernel(kind="f32", pkind="f32", with_var=False):
    """(out, x, center, scale, shift, var, eps, rows, channels, length); ``with_var``: the
    scale is scale / sqrt(var + eps), else var and eps are not read (any 1-element array)."""
    ld, pld, st = halfio.load(kind), halfio.load(pkind), halfio.store(kind)

    @jit
    def kernel(out, x, center, scale, shift, var, eps, rows, channels, length):
        line = uint64(cuda.blockIdx.y) * uint64(cuda.blockDim.y) + uint64(cuda.threadIdx.y)
        while line < rows:
            c = line % channels
            m, a, b = pld(center, c), pld(scale, c), pld(shift, c)
            if with_var:
                a = a / math.sqrt(pld(var, c) + float32(eps))
            s = uint64(cuda.threadIdx.x)
            while s < length:
                st(out, line * length + s, (ld(x, line * length + s) - m) * a + b)
                s += uint64(cuda.blockDim.x)
            line += uint64(cuda.gridDim.y) * uint64(cuda.blockDim.y)

    return kernel
