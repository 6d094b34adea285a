"""ctypes prototypes for the cuBLAS and cuBLASLt calls rlx_numba makes, and their enums.

Every function has argtypes and restype set (a wrong call fails in ctypes, not in the
library), and an errcheck that turns a non-zero cublasStatus_t into ``CublasError`` naming
the call and the status. Values from the CUDA 12.9 and 13.x headers (identical in both).
Pointers and opaque handles are ``c_void_p``; device pointers are passed as ints.
"""
from __future__ import annotations

import ctypes
from ctypes import POINTER, c_float, c_int, c_int64, c_size_t, c_uint64, c_void_p

from .loader import load_cublas

# cublasOperation_t, cublasMath_t, cublasGemmAlgo_t
OP_N, OP_T, OP_C = 0, 1, 2
DEFAULT_MATH, TF32_TENSOR_OP_MATH = 0, 3
# a flag of the math mode: split-K reductions in the compute type (f32), never a half output's
DISALLOW_REDUCED_PRECISION_REDUCTION = 16
GEMM_DEFAULT = -1
# cudaDataType / cublasComputeType_t
R_32F, R_16F, R_16BF = 0, 2, 14
DATA_TYPE = {"f32": R_32F, "f16": R_16F, "bf16": R_16BF}     # kernels/halfio.py's kinds
COMPUTE_32F, COMPUTE_32F_FAST_TF32 = 68, 77
R_8I, R_32I, R_8F_E4M3, R_8F_E5M2 = 3, 10, 28, 29        # the low-precision products' types
COMPUTE_32I = 72
# cuBLASLt: matmul desc attributes, epilogues, preference attributes
DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE, DESC_BIAS_POINTER = 3, 4, 7, 8
DESC_A_SCALE_POINTER, DESC_B_SCALE_POINTER = 17, 18      # f32 device scalars (fp8 operands)
DESC_A_SCALE_MODE, DESC_B_SCALE_MODE = 31, 32            # cuBLAS 12.9+: how the scales apply
MATRIX_SCALE_OUTER_VEC_32F = 3                           # an f32 vector along the outer dim
EPILOGUE_DEFAULT, EPILOGUE_RELU, EPILOGUE_BIAS, EPILOGUE_RELU_BIAS = 1, 2, 4, 6
EPILOGUE_GELU, EPILOGUE_GELU_BIAS = 32, 36
PREF_MAX_WORKSPACE_BYTES = 1
PREF_REDUCTION_SCHEME_MASK = 3
# cublasLtReductionScheme_t: INPLACE (1) and OUTPUT_TYPE (4) sum split-K partials in D's type
REDUCTION_SCHEME_COMPUTE_TYPE = 2

STATUS = {0: "CUBLAS_STATUS_SUCCESS", 1: "CUBLAS_STATUS_NOT_INITIALIZED",
          3: "CUBLAS_STATUS_ALLOC_FAILED", 7: "CUBLAS_STATUS_INVALID_VALUE",
          8: "CUBLAS_STATUS_ARCH_MISMATCH", 11: "CUBLAS_STATUS_MAPPING_ERROR",
          13: "CUBLAS_STATUS_EXECUTION_FAILED", 14: "CUBLAS_STATUS_INTERNAL_ERROR",
          15: "CUBLAS_STATUS_NOT_SUPPORTED", 16: "CUBLAS_STATUS_LICENSE_ERROR"}


class CublasError(RuntimeError):
    def __init__(self, call: str, status: int):
        self.call, self.status = call, status
        super().__init__(f"{call} failed: {STATUS.get(status, 'unknown status')} ({status})")


class AlgoT(ctypes.Structure):                 # cublasLtMatmulAlgo_t
    _fields_ = [("data", c_uint64 * 8)]


class HeuristicResultT(ctypes.Structure):      # cublasLtMatmulHeuristicResult_t (96 bytes)
    _fields_ = [("algo", AlgoT), ("workspaceSize", c_size_t), ("state", c_int),
                ("wavesCount", c_float), ("reserved", c_int * 4)]


P = c_void_p
# name: argtypes (restype is the status int for all of them)
CUBLAS = {
    "cublasCreate_v2": [POINTER(c_void_p)],
    "cublasDestroy_v2": [P],
    "cublasSetStream_v2": [P, P],
    "cublasSetMathMode": [P, c_int],
    "cublasSetWorkspace_v2": [P, P, c_size_t],
    "cublasSgemm_v2": [P, c_int, c_int, c_int, c_int, c_int, P, P, c_int, P, c_int, P, P, c_int],
    "cublasSgemmStridedBatched": [P, c_int, c_int, c_int, c_int, c_int, P, P, c_int, c_int64,
                                  P, c_int, c_int64, P, P, c_int, c_int64, c_int],
    "cublasSgemmBatched": [P, c_int, c_int, c_int, c_int, c_int, P, P, c_int, P, c_int, P, P,
                           c_int, c_int],
    # f64 products (the same arguments, double alpha / beta and data)
    "cublasDgemm_v2": [P, c_int, c_int, c_int, c_int, c_int, P, P, c_int, P, c_int, P, P, c_int],
    "cublasDgemmStridedBatched": [P, c_int, c_int, c_int, c_int, c_int, P, P, c_int, c_int64,
                                  P, c_int, c_int64, P, P, c_int, c_int64, c_int],
    "cublasDgemmBatched": [P, c_int, c_int, c_int, c_int, c_int, P, P, c_int, P, c_int, P, P,
                           c_int, c_int],
    # c64 products (the same arguments, cuComplex alpha / beta and data; ops N, T or C)
    "cublasCgemm_v2": [P, c_int, c_int, c_int, c_int, c_int, P, P, c_int, P, c_int, P, P, c_int],
    "cublasCgemmStridedBatched": [P, c_int, c_int, c_int, c_int, c_int, P, P, c_int, c_int64,
                                  P, c_int, c_int64, P, P, c_int, c_int64, c_int],
    "cublasCgemmBatched": [P, c_int, c_int, c_int, c_int, c_int, P, P, c_int, P, c_int, P, P,
                           c_int, c_int],
    "cublasGemmEx": [P, c_int, c_int, c_int, c_int, c_int, P, P, c_int, c_int, P, c_int, c_int,
                     P, P, c_int, c_int, c_int, c_int],
    "cublasGemmBatchedEx": [P, c_int, c_int, c_int, c_int, c_int, P, P, c_int, c_int, P, c_int,
                            c_int, P, P, c_int, c_int, c_int, c_int, c_int],
    "cublasGemmStridedBatchedEx": [P, c_int, c_int, c_int, c_int, c_int, P, P, c_int, c_int,
                                   c_int64, P, c_int, c_int, c_int64, P, P, c_int, c_int,
                                   c_int64, c_int, c_int, c_int],
    # the linear-algebra tier 0 (runtime/lower_linalg.py): batched trsm, LU, QR; f32 and f64
    # (the D forms: the same arguments, double data and alpha)
    **{f"cublas{t}{name}": args for t in "SD" for name, args in {
        "trsmBatched": [P, c_int, c_int, c_int, c_int, c_int, c_int, P, P, c_int, P, c_int,
                        c_int],
        "getrfBatched": [P, c_int, P, c_int, P, P, c_int],
        "getrsBatched": [P, c_int, c_int, c_int, P, c_int, P, P, c_int, P, c_int],
        "geqrfBatched": [P, c_int, c_int, P, c_int, P, P, c_int]}.items()},
}
CUBLASLT = {
    "cublasLtCreate": [POINTER(c_void_p)],
    "cublasLtDestroy": [P],
    "cublasLtMatmulDescCreate": [POINTER(c_void_p), c_int, c_int],
    "cublasLtMatmulDescDestroy": [P],
    "cublasLtMatmulDescSetAttribute": [P, c_int, P, c_size_t],
    "cublasLtMatrixLayoutCreate": [POINTER(c_void_p), c_int, c_uint64, c_uint64, c_int64],
    "cublasLtMatrixLayoutDestroy": [P],
    "cublasLtMatmulPreferenceCreate": [POINTER(c_void_p)],
    "cublasLtMatmulPreferenceDestroy": [P],
    "cublasLtMatmulPreferenceSetAttribute": [P, c_int, P, c_size_t],
    "cublasLtMatmulAlgoGetHeuristic": [P, P, P, P, P, P, P, c_int, POINTER(HeuristicResultT),
                                       POINTER(c_int)],
    "cublasLtMatmul": [P, P, P, P, P, P, P, P, P, P, P, P, POINTER(AlgoT), P, c_size_t, P],
    "cublasLtMatmulAlgoCheck": [P, P, P, P, P, P, POINTER(AlgoT), POINTER(HeuristicResultT)],
}


def _errcheck(status, func, args):
    if status != 0:
        raise CublasError(func.__name__, status)
    return status


class _Lib:
    """Attribute access to the prototyped functions of one library."""

    def __init__(self, loaded, protos):
        self.path, self.major = loaded.path, loaded.major
        for name, argtypes in protos.items():
            fn = getattr(loaded.lib, name)
            fn.argtypes, fn.restype, fn.errcheck = argtypes, c_int, _errcheck
            setattr(self, name, fn)


_libs: dict[str, _Lib] = {}


def libs() -> tuple[_Lib, _Lib]:
    """(cublas, cublasLt), loaded and prototyped once; raises LibraryNotFound."""
    if not _libs:
        lt, blas = load_cublas()
        _libs["cublasLt"] = _Lib(lt, CUBLASLT)
        _libs["cublas"] = _Lib(blas, CUBLAS)
        ver = lt.lib.cublasLtGetVersion
        ver.argtypes, ver.restype = [], c_size_t
        _libs["cublasLt"].version = int(ver())
    return _libs["cublas"], _libs["cublasLt"]
