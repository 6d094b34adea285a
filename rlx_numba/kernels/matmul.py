"""Matrix products: a shared-memory tiled SGEMM, the tier that runs everywhere (simulator
included). Row-major C[z] = A[z] @ B[z] for each batch z, with per-batch element offsets given
as arrays so any batch broadcasting needs no copies. (The register-tiled kernel and the cuBLAS
tiers come with the matmul issue.)"""
from numba import cuda, float32

TILE = 16


@cuda.jit(cache=True)
def sgemm_tiled(c, a, b, m, n, k, a_off, b_off, batch):
    sa = cuda.shared.array((TILE, TILE), float32)
    sb = cuda.shared.array((TILE, TILE), float32)
    tx = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    row = cuda.blockIdx.y * TILE + ty
    col = cuda.blockIdx.x * TILE + tx
    for z in range(cuda.blockIdx.z, batch, cuda.gridDim.z):
        ao = a_off[z]
        bo = b_off[z]
        acc = float32(0.0)
        for t in range(0, k, TILE):
            sa[ty, tx] = a[ao + row * k + t + tx] if (row < m and t + tx < k) else float32(0.0)
            sb[ty, tx] = b[bo + (t + ty) * n + col] if (t + ty < k and col < n) else float32(0.0)
            cuda.syncthreads()
            for q in range(TILE):
                acc += sa[ty, q] * sb[q, tx]
            cuda.syncthreads()
        if row < m and col < n:
            c[z * m * n + row * n + col] = acc


def sgemm_geometry(m: int, n: int, batch: int):
    return ((-(-n // TILE), -(-m // TILE), min(batch, 65535)), (TILE, TILE))
