"""GEMM calls prepared once and replayed: handles, workspaces, and row-major operand mapping.

cuBLAS is column-major. A row-major [R, C] buffer is, to cuBLAS, a column-major [C, R] matrix
(its transpose) with leading dimension C. So the row-major product C[M,N] = A[M,K] @ B[K,N] is
the column-major C^T[N,M] = B^T[N,K] @ A^T[K,M]: swap the operands and call with m=N, n=M.
An operand stored transposed (A as [K, M], B as [N, K]) becomes an OP_T flag, never a copy.
A cuBLASLt bias of length N (one per output feature) is then a bias over D's rows, which is
exactly what the BIAS epilogues take.

Every ``*_plan`` function does all the work that can be done ahead (handle for the stream,
descriptors, algorithm heuristics, ctypes argument packing) and returns a no-argument callable
that enqueues the GEMM on the stream.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import tempfile
from ctypes import byref, c_double, c_float, c_int, c_int32, c_uint32, c_uint64, c_void_p, sizeof
from dataclasses import dataclass

from ..device import when_stream_dies
from . import api

log = logging.getLogger("rlx_numba")

WORKSPACE_BYTES = 32 << 20      # NVIDIA's recommendation for Hopper (4 MiB elsewhere is enough)
TUNE_ALGOS = 8                  # cuBLASLt algorithms timed per product at compile time

_blas: dict = {}                 # (device, stream, tf32) -> cublasHandle_t
_lt: dict = {}                   # device -> cublasLtHandle_t
_ws: dict = {}                   # (device, stream) -> workspace device array


def _device_id() -> int:
    from numba import cuda
    return cuda.get_current_device().id


def _stream_ptr(stream) -> int:
    return int(stream) if stream is not None else 0     # numba's Stream.__int__: the CUstream


def workspace(stream, dev: int | None = None) -> tuple[int, int]:
    """(device pointer, bytes) of the workspace of (device, stream), allocated once."""
    from numba import cuda
    key = (_device_id() if dev is None else dev, _stream_ptr(stream))
    if key not in _ws:
        _ws[key] = cuda.device_array(WORKSPACE_BYTES, dtype="u1")
        # a stream's workspace and handles go with it (32 MiB, and a cuBLAS handle holds
        # ~64 MiB of its own on an H100)
        when_stream_dies(stream, _drop_stream, key)
    return _ws[key].device_ctypes_pointer.value, WORKSPACE_BYTES


def live_handles() -> int:
    """cuBLAS handles alive in this process (one per stream and math mode until the stream
    goes)."""
    return len(_blas)


def _drop_stream(key) -> None:
    _ws.pop(key, None)
    for k in [k for k in _blas if k[:2] == key]:
        api.libs()[0].cublasDestroy_v2(_blas.pop(k))


def blas_handle(stream, tf32: bool) -> c_void_p:
    """One cuBLAS handle per (device, stream, math mode), bound to its stream and workspace."""
    blas, _ = api.libs()
    key = (_device_id(), _stream_ptr(stream), tf32)
    if key not in _blas:
        h = c_void_p()
        blas.cublasCreate_v2(byref(h))
        blas.cublasSetStream_v2(h, c_void_p(key[1]))
        ptr, size = workspace(stream, key[0])
        blas.cublasSetWorkspace_v2(h, c_void_p(ptr), size)
        # a split-K reduction sums in f32 for a half C too (the default may sum its partials
        # in C's type: more roundings than the one the contract allows)
        blas.cublasSetMathMode(h, (api.TF32_TENSOR_OP_MATH if tf32 else api.DEFAULT_MATH)
                               | api.DISALLOW_REDUCED_PRECISION_REDUCTION)
        _blas[key] = h
    return _blas[key]


def lt_handle(dev: int) -> c_void_p:
    _, lt = api.libs()
    if dev not in _lt:
        h = c_void_p()
        lt.cublasLtCreate(byref(h))
        _lt[dev] = h
    return _lt[dev]


@dataclass(frozen=True)
class Colmajor:
    """A row-major problem C[M,N] = op(A) @ op(B) in cuBLAS's column-major terms."""
    opa: int
    opb: int
    m: int
    n: int
    k: int
    lda: int
    ldb: int
    ldc: int


def colmajor(m: int, n: int, k: int, trans_a: bool, trans_b: bool) -> Colmajor:
    """cuBLAS's A is our B (stored [K,N], or [N,K] when trans_b), its B is our A (stored
    [M,K], or [K,M] when trans_a)."""
    return Colmajor(opa=api.OP_T if trans_b else api.OP_N, opb=api.OP_T if trans_a else api.OP_N,
                    m=n, n=m, k=k, lda=k if trans_b else n, ldb=m if trans_a else k, ldc=n)


_ONE, _ZERO = c_float(1.0), c_float(0.0)
_ONE64, _ZERO64 = c_double(1.0), c_double(0.0)


def sgemm_plan(stream, cm: Colmajor, a_ptr: int, b_ptr: int, c_ptr: int, *, tf32: bool,
               batch: int = 1, stride_a: int = 0, stride_b: int = 0, ptr_arrays=None,
               f64: bool = False):
    """cublasSgemm_v2 (batch 1), cublasSgemmStridedBatched (element strides of our A and B,
    0 for a broadcast operand), or cublasSgemmBatched with device arrays of pointers
    (``ptr_arrays`` = (A pointers, B pointers, C pointers)) for any other batch broadcast.
    ``f64``: the same calls of cublasDgemm (double data, alpha and beta; no TF32)."""
    blas, _ = api.libs()
    h = blas_handle(stream, tf32 and not f64)
    one, zero = (_ONE64, _ZERO64) if f64 else (_ONE, _ZERO)
    call = "cublasD" if f64 else "cublasS"
    head = (h, cm.opa, cm.opb, cm.m, cm.n, cm.k, byref(one))
    if ptr_arrays is not None:
        pa, pb, pc = (p.device_ctypes_pointer.value for p in ptr_arrays)
        args = head + (c_void_p(pb), cm.lda, c_void_p(pa), cm.ldb, byref(zero), c_void_p(pc),
                       cm.ldc, batch)
        fn = getattr(blas, call + "gemmBatched")
    elif batch > 1:
        args = head + (c_void_p(b_ptr), cm.lda, stride_b, c_void_p(a_ptr), cm.ldb, stride_a,
                       byref(zero), c_void_p(c_ptr), cm.ldc, cm.m * cm.n, batch)
        fn = getattr(blas, call + "gemmStridedBatched")
    else:
        args = head + (c_void_p(b_ptr), cm.lda, c_void_p(a_ptr), cm.ldb, byref(zero),
                       c_void_p(c_ptr), cm.ldc)
        fn = getattr(blas, call + "gemm_v2")
    return lambda: fn(*args)


_C_ONE, _C_ZERO = (c_float * 2)(1.0, 0.0), (c_float * 2)(0.0, 0.0)     # cuComplex


def cgemm_plan(stream, cm: Colmajor, a_ptr: int, b_ptr: int, c_ptr: int, *, batch: int = 1,
               stride_a: int = 0, stride_b: int = 0, ptr_arrays=None):
    """cublasCgemm_v2 / CgemmStridedBatched / CgemmBatched (complex64, ``cm``'s ops N, T or
    C), as ``sgemm_plan`` lays them out."""
    blas, _ = api.libs()
    h = blas_handle(stream, False)
    head = (h, cm.opa, cm.opb, cm.m, cm.n, cm.k, byref(_C_ONE))
    if ptr_arrays is not None:
        pa, pb, pc = (p.device_ctypes_pointer.value for p in ptr_arrays)
        args = head + (c_void_p(pb), cm.lda, c_void_p(pa), cm.ldb, byref(_C_ZERO), c_void_p(pc),
                       cm.ldc, batch)
        fn = blas.cublasCgemmBatched
    elif batch > 1:
        args = head + (c_void_p(b_ptr), cm.lda, stride_b, c_void_p(a_ptr), cm.ldb, stride_a,
                       byref(_C_ZERO), c_void_p(c_ptr), cm.ldc, cm.m * cm.n, batch)
        fn = blas.cublasCgemmStridedBatched
    else:
        args = head + (c_void_p(b_ptr), cm.lda, c_void_p(a_ptr), cm.ldb, byref(_C_ZERO),
                       c_void_p(c_ptr), cm.ldc)
        fn = blas.cublasCgemm_v2
    return lambda: fn(*args)


def gemm_ex_plan(stream, cm: Colmajor, a_ptr: int, a_type: int, b_ptr: int, b_type: int,
                 c_ptr: int, *, c_type: int = api.R_32F, batch: int = 1, stride_a: int = 0,
                 stride_b: int = 0, ptr_arrays=None):
    """cublasGemmEx / GemmStridedBatchedEx with half (f16/bf16) operands, f32 accumulation
    (COMPUTE_32F, f32 alpha and beta: tensor cores) and C of ``c_type`` (f32, or the operands'
    half type, rounded once); cublasGemmBatchedEx with device arrays of pointers
    (``ptr_arrays`` = (A pointers, B pointers, C pointers)) for any other batch broadcast."""
    blas, _ = api.libs()
    h = blas_handle(stream, False)
    head = (h, cm.opa, cm.opb, cm.m, cm.n, cm.k, byref(_ONE))
    tail = (api.COMPUTE_32F, api.GEMM_DEFAULT)
    if ptr_arrays is not None:
        pa, pb, pc = (p.device_ctypes_pointer.value for p in ptr_arrays)
        args = head + (c_void_p(pb), b_type, cm.lda, c_void_p(pa), a_type, cm.ldb,
                       byref(_ZERO), c_void_p(pc), c_type, cm.ldc, batch) + tail
        fn = blas.cublasGemmBatchedEx
    elif batch > 1:
        args = head + (c_void_p(b_ptr), b_type, cm.lda, stride_b, c_void_p(a_ptr), a_type,
                       cm.ldb, stride_a, byref(_ZERO), c_void_p(c_ptr), c_type, cm.ldc,
                       cm.m * cm.n, batch) + tail
        fn = blas.cublasGemmStridedBatchedEx
    else:
        args = head + (c_void_p(b_ptr), b_type, cm.lda, c_void_p(a_ptr), a_type, cm.ldb,
                       byref(_ZERO), c_void_p(c_ptr), c_type, cm.ldc) + tail
        fn = blas.cublasGemmEx
    return lambda: fn(*args)


# the split-K reductions a half D allows: none, or partials summed in f32 (the compute type)
# in the workspace; not INPLACE or OUTPUT_TYPE, which round each partial to D's half type
HALF_D_REDUCTIONS = api.REDUCTION_SCHEME_COMPUTE_TYPE

LT_EPILOGUES = {(False, None): api.EPILOGUE_DEFAULT, (True, None): api.EPILOGUE_BIAS,
                (False, "relu"): api.EPILOGUE_RELU, (True, "relu"): api.EPILOGUE_RELU_BIAS,
                (False, "gelu_tanh"): api.EPILOGUE_GELU, (True, "gelu_tanh"): api.EPILOGUE_GELU_BIAS}


def lt_plan(stream, cm: Colmajor, a_ptr: int, b_ptr: int, d_ptr: int, *, tf32: bool,
            bias_ptr: int | None = None, activation: str | None = None,
            residual_ptr: int | None = None, in_type: int = api.R_32F,
            out_type: int = api.R_32F):
    """cuBLASLt matmul D = epilogue(A@B [+ bias]) [+ residual]; A and B of ``in_type`` (f32,
    or f16/bf16 with f32 accumulation), D, C and the bias of ``out_type`` (f32, or the
    operands' half type: the bias then has D's type, the library's default for
    BIAS_DATA_TYPE; compute and scale f32 either way; a half D's split-K partials are summed
    in f32, ``HALF_D_REDUCTIONS``). The residual goes in as C with beta = 1, which the
    library adds before the epilogue: callers pass it only without an activation. Raises
    CublasError(NOT_SUPPORTED) when no algorithm fits."""
    _, lt = api.libs()
    dev = _device_id()            # (once: numba's device lookup is a context check each time)
    h = lt_handle(dev)
    keep = []                                   # ctypes objects the call must outlive

    def attr(setter, obj, key, value):
        keep.append(value)
        setter(obj, key, byref(value), sizeof(value))

    compute = api.COMPUTE_32F_FAST_TF32 if tf32 and in_type == api.R_32F else api.COMPUTE_32F
    epilogue = LT_EPILOGUES[(bias_ptr is not None, activation)]
    dkey = (compute, cm.opa, cm.opb, epilogue, bias_ptr)
    desc = _descs.get(dkey)
    if desc is None:
        desc = c_void_p()
        lt.cublasLtMatmulDescCreate(byref(desc), compute, api.R_32F)
        set_desc = lt.cublasLtMatmulDescSetAttribute
        attr(set_desc, desc, api.DESC_TRANSA, c_int32(cm.opa))
        attr(set_desc, desc, api.DESC_TRANSB, c_int32(cm.opb))
        attr(set_desc, desc, api.DESC_EPILOGUE, c_uint32(epilogue))
        if bias_ptr is not None:   # set before the heuristic: it looks at the pointer's alignment
            attr(set_desc, desc, api.DESC_BIAS_POINTER, c_void_p(bias_ptr))
        _descs[dkey] = desc

    def layout(dtype, rows, cols, ld):
        lay = _layouts.get((dtype, rows, cols, ld))
        if lay is None:
            lay = _layouts[(dtype, rows, cols, ld)] = c_void_p()
            lt.cublasLtMatrixLayoutCreate(byref(lay), dtype, rows, cols, ld)
        return lay
    la = layout(in_type, cm.k if cm.opa == api.OP_T else cm.m, cm.m if cm.opa == api.OP_T else cm.k,
                cm.lda)
    lb = layout(in_type, cm.n if cm.opb == api.OP_T else cm.k, cm.k if cm.opb == api.OP_T else cm.n,
                cm.ldb)
    lc = layout(out_type, cm.m, cm.n, cm.ldc)
    ws_ptr, ws_size = workspace(stream, dev)
    beta = c_float(1.0 if residual_ptr is not None else 0.0)
    c_ptr = residual_ptr if residual_ptr is not None else d_ptr
    call = lt.cublasLtMatmul

    def args_for(algo):
        return (h, desc, byref(_ONE), c_void_p(b_ptr), la, c_void_p(a_ptr), lb, byref(beta),
                c_void_p(c_ptr), lc, c_void_p(d_ptr), lc, byref(algo), c_void_p(ws_ptr), ws_size,
                c_void_p(_stream_ptr(stream)))
    # the same problem (shape, types, epilogue, operand alignments) again -- a model's layers
    # repeat shapes -- takes the algorithm chosen the first time: no heuristic, no timing
    reductions = HALF_D_REDUCTIONS if out_type in (api.R_16F, api.R_16BF) else None
    key = (dev, cm, compute, in_type, out_type, epilogue,
           residual_ptr is not None, tuple(p % 256 for p in (a_ptr, b_ptr, d_ptr, bias_ptr or 0,
                                                            residual_ptr or 0)), reductions)
    algo = _lt_algo(key, lt, h, desc, la, lb, lc, ws_size, stream, call, args_for, reductions)
    args = args_for(algo)
    keep += [desc, la, lb, lc, algo, beta]

    def run():
        call(*args)
    run.keep = keep         # the descriptors live as long as the plan (never destroyed early)
    return run


def lt_lowp_plan(stream, cm: Colmajor, a_ptr: int, a_type: int, b_ptr: int, b_type: int,
                 d_ptr: int, d_type: int, *, a_scale_ptr: int | None = None,
                 b_scale_ptr: int | None = None, bias_ptr: int | None = None,
                 outer_vec: bool = False):
    """cuBLASLt D = scale_a * scale_b * (A @ B) (+ bias) for fp8 operands (COMPUTE_32F, f32
    scale; D bf16 / f16 / f32, the bias of D's type) or D = A @ B for i8 ones (``d_type``
    R_32I: COMPUTE_32I, int32 scale). Our A and B as in lt_plan (swapped into Lt's B and A),
    so Lt's A scale is our b's. The caller passes the "TN" problem fp8 and int8 kernels need
    (``cm.opa`` T, ``cm.opb`` N: b stored [N, K], a [M, K]). Raises CublasError when no
    algorithm fits (or an older cuBLAS refuses an attribute). The scale pointers are device
    f32 scalars read when the call runs; with ``outer_vec`` (A / B_SCALE_MODE OUTER_VEC_32F,
    cuBLAS 12.9+) f32 vectors along each operand's outer dimension: Lt's A (our b) one a
    column of our output, Lt's B (our a) one a row."""
    _, lt = api.libs()
    dev = _device_id()
    h = lt_handle(dev)
    keep = []

    def attr(setter, obj, key, value):
        keep.append(value)
        setter(obj, key, byref(value), sizeof(value))

    ints = d_type == api.R_32I
    compute, scale = (api.COMPUTE_32I, api.R_32I) if ints else (api.COMPUTE_32F, api.R_32F)
    desc = c_void_p()
    lt.cublasLtMatmulDescCreate(byref(desc), compute, scale)
    set_desc = lt.cublasLtMatmulDescSetAttribute
    attr(set_desc, desc, api.DESC_TRANSA, c_int32(cm.opa))
    attr(set_desc, desc, api.DESC_TRANSB, c_int32(cm.opb))
    if b_scale_ptr is not None:        # Lt's A is our b
        attr(set_desc, desc, api.DESC_A_SCALE_POINTER, c_void_p(b_scale_ptr))
    if a_scale_ptr is not None:
        attr(set_desc, desc, api.DESC_B_SCALE_POINTER, c_void_p(a_scale_ptr))
    if outer_vec:
        attr(set_desc, desc, api.DESC_A_SCALE_MODE, c_int32(api.MATRIX_SCALE_OUTER_VEC_32F))
        attr(set_desc, desc, api.DESC_B_SCALE_MODE, c_int32(api.MATRIX_SCALE_OUTER_VEC_32F))
    epilogue = api.EPILOGUE_DEFAULT if bias_ptr is None else api.EPILOGUE_BIAS
    attr(set_desc, desc, api.DESC_EPILOGUE, c_uint32(epilogue))
    if bias_ptr is not None:
        attr(set_desc, desc, api.DESC_BIAS_POINTER, c_void_p(bias_ptr))
    lays = []
    for dtype, rows, cols, ld in (
            (b_type, cm.k if cm.opa == api.OP_T else cm.m, cm.m if cm.opa == api.OP_T else cm.k,
             cm.lda),
            (a_type, cm.n if cm.opb == api.OP_T else cm.k, cm.k if cm.opb == api.OP_T else cm.n,
             cm.ldb),
            (d_type, cm.m, cm.n, cm.ldc)):
        lay = c_void_p()
        lt.cublasLtMatrixLayoutCreate(byref(lay), dtype, rows, cols, ld)
        lays.append(lay)
    la, lb, lc = lays
    ws_ptr, ws_size = workspace(stream, dev)
    one, zero = (c_int32(1), c_int32(0)) if ints else (c_float(1.0), c_float(0.0))
    call = lt.cublasLtMatmul

    def args_for(algo):
        return (h, desc, byref(one), c_void_p(b_ptr), la, c_void_p(a_ptr), lb, byref(zero),
                c_void_p(d_ptr), lc, c_void_p(d_ptr), lc, byref(algo), c_void_p(ws_ptr), ws_size,
                c_void_p(_stream_ptr(stream)))
    reductions = HALF_D_REDUCTIONS if d_type in (api.R_16F, api.R_16BF) else None
    key = (dev, "lowp", cm, a_type, b_type, d_type, bias_ptr is not None,
           a_scale_ptr is not None, outer_vec,
           tuple(p % 256 for p in (a_ptr, b_ptr, d_ptr, bias_ptr or 0)), reductions)
    algo = _lt_algo(key, lt, h, desc, la, lb, lc, ws_size, stream, call, args_for, reductions)
    args = args_for(algo)
    keep += [desc, la, lb, lc, algo, one, zero]

    def run():
        call(*args)
    run.keep = keep
    return run


_lt_choice: dict = {}   # lt_plan's problem key -> the fastest of the heuristic's algorithms
# cuBLASLt descriptors by value, shared by every plan that describes the same thing (a model's
# layers repeat them); host-side objects, read-only once made, never destroyed
_descs: dict = {}       # (compute, opa, opb, epilogue, bias pointer) -> cublasLtMatmulDesc_t
_layouts: dict = {}     # (dtype, rows, cols, ld) -> cublasLtMatrixLayout_t


class AlgoStore:
    """cuBLASLt algorithms chosen in earlier processes, on disk (``<cache dir>/cublaslt_algos
    .json``: problem -> the 64 bytes of its cublasLtMatmulAlgo_t, which cuBLASLt's docs allow
    to be serialised and restored into the same library version). A process takes a problem's
    algorithm from here instead of running the heuristic and timing its candidates again
    (``_fastest``); the problem names the GPU, the library version and the workspace. A
    damaged or foreign file reads as empty; one that cannot be written is a warning."""

    FILE = "cublaslt_algos.json"

    def __init__(self, directory=None):
        self._dir = directory
        self._data, self._stamp = {}, None      # the file's choices as last read, its stat
        self.stats = collections.Counter()      # "hits" (restored), "misses" (chosen here)

    def path(self):
        if self._dir is not None:
            return os.path.join(os.fspath(self._dir), self.FILE)
        from ..kernels.cache import cache_dir
        return os.path.join(cache_dir(), self.FILE)

    def _read(self) -> dict:
        try:
            with open(self.path()) as f:
                data = json.load(f)
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict):
            return {}
        return {k: v for k, v in data.items() if isinstance(v, str) and len(v) == 128}

    def get(self, problem: str) -> bytes | None:
        try:                            # parsed again only when the file changed (a model's
            st = os.stat(self.path())   # compile asks for every product)
            stamp = (st.st_mtime_ns, st.st_size)
        except OSError:
            stamp = None
        if stamp != self._stamp:
            self._data, self._stamp = (self._read() if stamp else {}), stamp
        blob = self._data.get(problem)
        try:
            return None if blob is None else bytes.fromhex(blob)
        except ValueError:
            return None

    def put(self, problem: str, blob: bytes) -> None:
        """Merge one choice into the file (read, merge and rename under a lock: processes
        choosing at once keep each other's choices)."""
        import fcntl
        tmp = None
        try:
            path = self.path()
            with open(path + ".lock", "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                data = self._read()
                data[problem] = bytes(blob).hex()
                fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".cublaslt_algos")
                with os.fdopen(fd, "w") as f:
                    json.dump(data, f, indent=0)
                os.replace(tmp, path)
                tmp = None
        except OSError as e:     # (a full disk: the half-written temp file goes too)
            log.warning("rlx_numba: could not save a cuBLASLt algorithm choice (%s)", e)
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass


ALGOS = AlgoStore()


def _problem(key, lt, ws_size) -> str:
    """``key`` (device ordinal first) as AlgoStore names it: the GPU's name for the ordinal."""
    from numba import cuda
    name = cuda.get_current_device().name
    name = name.decode() if isinstance(name, bytes) else str(name)
    return repr((name, getattr(lt, "version", 0), ws_size) + tuple(key[1:]))


def _restored(problem, lt, h, desc, la, lb, lc):
    """The algorithm AlgoStore holds for ``problem``, if cuBLASLt accepts it for this
    problem (cublasLtMatmulAlgoCheck), else None."""
    blob = ALGOS.get(problem)
    if blob is None or len(blob) != sizeof(api.AlgoT):
        return None
    algo = api.AlgoT.from_buffer_copy(blob)
    try:
        lt.cublasLtMatmulAlgoCheck(h, desc, la, lb, lc, lc, byref(algo),
                                   byref(api.HeuristicResultT()))
    except api.CublasError:
        return None
    return algo


def _lt_algo(key, lt, h, desc, la, lb, lc, ws_size, stream, call, args_for, reductions=None):
    """The algorithm for problem ``key``: chosen once (cuBLASLt's heuristic's candidates,
    the fastest of them timed by ``_fastest``) and kept on disk (AlgoStore), then taken from
    ``_lt_choice``. ``reductions``: the split-K reduction schemes the candidates may use (a
    cublasLtReductionScheme_t mask; None: any), part of ``key``."""
    algo = _lt_choice.get(key)
    if algo is None:
        problem = _problem(key, lt, ws_size)
        algo = _restored(problem, lt, h, desc, la, lb, lc)
        if algo is not None:
            ALGOS.stats["hits"] += 1
            _lt_choice[key] = algo
            return algo
        pref, ws = c_void_p(), c_uint64(ws_size)
        lt.cublasLtMatmulPreferenceCreate(byref(pref))
        lt.cublasLtMatmulPreferenceSetAttribute(pref, api.PREF_MAX_WORKSPACE_BYTES, byref(ws),
                                                sizeof(ws))
        if reductions is not None:
            mask = c_uint32(reductions)
            lt.cublasLtMatmulPreferenceSetAttribute(pref, api.PREF_REDUCTION_SCHEME_MASK,
                                                    byref(mask), sizeof(mask))
        results, count = (api.HeuristicResultT * TUNE_ALGOS)(), c_int(0)
        lt.cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, lc, lc, pref, TUNE_ALGOS, results,
                                          byref(count))
        lt.cublasLtMatmulPreferenceDestroy(pref)
        if count.value == 0:
            raise api.CublasError("cublasLtMatmulAlgoGetHeuristic (no algorithm)", 15)
        algo = _lt_choice[key] = _fastest(stream, call, args_for,
                                          [results[i].algo for i in range(count.value)])
        ALGOS.stats["misses"] += 1
        ALGOS.put(problem, bytes(algo))
    return algo


def _fastest(stream, call, args_for, algos):
    """The heuristic's first algorithm, or, when it offers several, the fastest of them timed
    on this stream (the heuristic alone picks badly for skinny half-precision products: on an
    H200 a 1x4096x4096 bf16 product ran 3x slower than torch's). The operands' contents do not
    matter for the timing; the output is overwritten by the first real run."""
    if len(algos) == 1:
        return algos[0]
    from numba import cuda
    best, best_ms = algos[0], float("inf")
    for algo in algos:
        args = args_for(algo)
        try:
            call(*args)
        except api.CublasError:     # an algorithm the heuristic offered but cannot run here
            continue
        e0, e1 = cuda.event(), cuda.event()
        e0.record(stream)
        for _ in range(3):
            call(*args)
        e1.record(stream)
        e1.synchronize()
        ms = cuda.event_elapsed_time(e0, e1)
        if ms < best_ms:
            best, best_ms = algo, ms
    return best


def pointer_array(arr_ptr: int, offsets, itemsize: int):
    """A device array of base + offset*itemsize pointers (for cublasSgemmBatched)."""
    import numpy as np
    from numba import cuda
    host = (np.asarray(offsets, np.uint64) * np.uint64(itemsize) + np.uint64(arr_ptr))
    return cuda.to_device(host)

