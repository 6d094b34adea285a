"""cuBLAS and cuBLASLt through ctypes (see loader.py for where the libraries are found).

``allow_tf32`` (default False, like torch.backends.cuda.matmul.allow_tf32): f32 matmuls
compiled while it is True may use TF32 tensor cores (10-bit mantissa inputs, f32 accumulation).
It is read when a graph is compiled; ``RLX_NUMBA_TF32=1`` sets the default.
"""
import os

from .api import CublasError
from .loader import LibraryNotFound, load_nvrtc

allow_tf32: bool = os.environ.get("RLX_NUMBA_TF32", "0") == "1"


def available() -> tuple[bool, str]:
    """(True, "") when cuBLAS and cuBLASLt load, else (False, why). Never raises."""
    try:
        from . import api
        api.libs()
        return True, ""
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return False, str(e)


def info() -> dict:
    """Paths and versions of the libraries found (for ``rlx-numba info``)."""
    out = {}
    try:
        from . import api
        blas, lt = api.libs()
        out.update(cublas=blas.path, cublasLt=lt.path, cublasLt_version=lt.version)
    except Exception as e:  # noqa: BLE001
        out["cublas"] = f"not found: {str(e).splitlines()[0]}"
    try:
        out["nvrtc"] = load_nvrtc().path
    except Exception as e:  # noqa: BLE001
        out["nvrtc"] = f"not found: {str(e).splitlines()[0]}"
    return out


__all__ = ["CublasError", "LibraryNotFound", "allow_tf32", "available", "info"]
