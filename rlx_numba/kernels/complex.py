"""The c64 product's numba kernel (ir/ops_complex.py "cmatmul"; runtime/lower_complex.py):
simple and exact in its order, for the simulator and GPUs without cuBLAS (a GPU with cuBLAS
runs cublasCgemm)."""
import functools

from numba import complex64, cuda, int64

from .launch import jit


@functools.lru_cache(maxsize=None)
def cgemm_kernel(ha: bool, hb: bool):
    """kernel(out, a, b, m, n, k, offs_a, offs_b, batch): out[z, i, j] = sum over p of
    op(a)[z][i, p] op(b)[z][p, j] in complex64, p in order; op conjugates and transposes the
    stored matrix where ``ha`` / ``hb`` (a stored [K, M], b stored [N, K]); offs_a / offs_b:
    each batch entry's element offset in a / b (broadcasting repeats them). A thread an
    output element, grid-strided."""

    @jit
    def kernel(out, a, b, m, n, k, offs_a, offs_b, batch):
        total = batch * m * n
        t = int64(cuda.grid(1))
        while t < total:
            z = t // (m * n)
            r = t - z * m * n
            i = r // n
            j = r - i * n
            oa = offs_a[z]
            ob = offs_b[z]
            acc = complex64(0)
            for p in range(k):
                x = a[oa + p * m + i].conjugate() if ha else a[oa + i * k + p]
                y = b[ob + j * k + p].conjugate() if hb else b[ob + p * n + j]
                acc += x * y
            out[t] = acc
            t += cuda.gridsize(1)

    return kernel
