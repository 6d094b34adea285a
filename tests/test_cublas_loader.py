"""The cuBLAS loader and ctypes prototypes: these load without a GPU (the test extra installs
NVIDIA's cuBLAS wheel), so they run on CPU CI too."""
import ctypes

import pytest

from rlx_numba.cublas import api, gemm, loader


def test_major_order_follows_the_driver():
    assert loader.major_order(12040) == [12]
    assert loader.major_order(13000) == [13, 12]
    assert loader.major_order(0) == [12, 13]          # no driver: whatever is installed


def test_libraries_load_and_are_prototyped():
    blas, lt = api.libs()
    for lib, protos in ((blas, api.CUBLAS), (lt, api.CUBLASLT)):
        assert lib.major in (12, 13)
        for name in protos:
            fn = getattr(lib, name)
            assert fn.argtypes and fn.restype is ctypes.c_int and fn.errcheck is api._errcheck
    assert "cublasLt" in lt.path and "cublas" in blas.path
    assert lt.version >= 12000
    assert ctypes.sizeof(api.HeuristicResultT) == 96


def test_status_becomes_an_exception_naming_the_call():
    blas, _ = api.libs()
    with pytest.raises(api.CublasError, match=r"cublasSetMathMode failed: "
                                              r"CUBLAS_STATUS_NOT_INITIALIZED \(1\)"):
        blas.cublasSetMathMode(None, 0)                # a null handle: the library says so
    assert str(api.CublasError("cublasGemmEx", 15)) == \
        "cublasGemmEx failed: CUBLAS_STATUS_NOT_SUPPORTED (15)"


def test_not_found_lists_every_place_tried(monkeypatch):
    monkeypatch.setattr(loader, "_cache", {})
    monkeypatch.setattr(loader, "site_dirs", lambda: [])
    monkeypatch.setattr(loader, "soname", lambda name, major: f"libno_such_{name}.so.{major}")
    monkeypatch.setenv("CUDA_HOME", "/nowhere/cuda")
    with pytest.raises(loader.LibraryNotFound) as e:
        loader.load_cublas()
    msg = str(e.value)
    assert "cuBLAS/cuBLASLt not found" in msg and "pip install 'rlx_numba[cu12]'" in msg
    assert "/nowhere/cuda/lib64/libno_such_cublasLt.so.12 (no such file)" in msg
    assert "libno_such_cublasLt.so.13" in msg


def test_row_major_mapping():
    # row-major C[M,N] = A[M,K] @ B[K,N] is column-major C^T = B^T A^T: operands swapped
    cm = gemm.colmajor(m=3, n=5, k=7, trans_a=False, trans_b=False)
    assert (cm.opa, cm.opb, cm.m, cm.n, cm.k, cm.lda, cm.ldb, cm.ldc) == (0, 0, 5, 3, 7, 5, 7, 5)
    cm = gemm.colmajor(m=3, n=5, k=7, trans_a=True, trans_b=True)   # A stored [7,3], B [5,7]
    assert (cm.opa, cm.opb, cm.lda, cm.ldb, cm.ldc) == (1, 1, 7, 3, 5)
