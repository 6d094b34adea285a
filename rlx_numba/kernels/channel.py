"""channel_affine (ir/ops_vision.py): y[n, c, s] = (x[n, c, s] - center[c]) * scale[c] +
shift[c] over x [N, C, S...], the per-channel step of batch_norm and group_norm. Launched as
kernels/conv.py's lines: a line is one (n, c) row, read and written contiguously, its channel's
values loaded once. channel_affine_var_kernel takes var and eps too: its scale is
scale[c] / sqrt(var[c] + eps) (batch_norm's)."""
import math

from numba import cuda, float32, uint64

from .launch import jit


@jit
def channel_affine_kernel(out, x, center, scale, shift, rows, channels, length):
    line = uint64(cuda.blockIdx.y) * uint64(cuda.blockDim.y) + uint64(cuda.threadIdx.y)
    while line < rows:
        c = line % channels
        m, a, b = center[c], scale[c], shift[c]
        s = uint64(cuda.threadIdx.x)
        while s < length:
            out[line * length + s] = (x[line * length + s] - m) * a + b
            s += uint64(cuda.blockDim.x)
        line += uint64(cuda.gridDim.y) * uint64(cuda.blockDim.y)


@jit
def channel_affine_var_kernel(out, x, center, scale, shift, var, eps, rows, channels, length):
    line = uint64(cuda.blockIdx.y) * uint64(cuda.blockDim.y) + uint64(cuda.threadIdx.y)
    while line < rows:
        c = line % channels
        m, b = center[c], shift[c]
        a = scale[c] / math.sqrt(var[c] + float32(eps))
        s = uint64(cuda.threadIdx.x)
        while s < length:
            out[line * length + s] = (x[line * length + s] - m) * a + b
            s += uint64(cuda.blockDim.x)
        line += uint64(cuda.gridDim.y) * uint64(cuda.blockDim.y)
