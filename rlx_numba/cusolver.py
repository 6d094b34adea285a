"""cuSOLVER (dense) through ctypes: the linear-algebra family's tier 0 (ir/ops_linalg.py,
runtime/lower_linalg.py). cuBLAS's batched LU / QR / trsm prototypes live with the other
cuBLAS calls (cublas/api.py).

The library is NVIDIA's pip wheel (``nvidia-cusolver-cu12``: ``nvidia/cusolver/lib/
libcusolver.so.11``; ``nvidia-cusolver`` for CUDA 13: ``nvidia/cu13/lib/libcusolver.so.12``),
``$CUDA_HOME``, or the system loader; its soname major is not CUDA's (cuSOLVER 11 ships with
CUDA 12). libcusolver needs libcublas / libcublasLt, libcusparse and libnvJitLink: the wheels
set no search path to each other, so those are loaded first (RTLD_GLOBAL) from their own wheel
directories when they are there, as torch does.

f32 takes the S routines, f64 the D ones (the same arguments on double data).

One handle per (device, stream). Workspaces are device arrays a step owns (sized by the
``*_bufferSize`` queries when the step is bound); info codes are device int32 arrays read by a
kernel after the call (never by the host: that would need a sync).
"""
from __future__ import annotations

import ctypes
from ctypes import POINTER, byref, c_int, c_void_p
from pathlib import Path

from .device import when_stream_dies

SONAMES = ("libcusolver.so.12", "libcusolver.so.11")
WHEEL_DIRS = ("nvidia/cu13/lib", "nvidia/cusolver/lib")
# what libcusolver links against, by wheel directory (CUDA 12 wheels) or cu13/lib (13)
DEPENDS = {"nvidia/cusolver/lib": [("nvidia/cublas/lib", "libcublasLt.so.12"),
                                   ("nvidia/cublas/lib", "libcublas.so.12"),
                                   ("nvidia/nvjitlink/lib", "libnvJitLink.so.12"),
                                   ("nvidia/cusparse/lib", "libcusparse.so.12")],
           "nvidia/cu13/lib": [("nvidia/cu13/lib", "libcublasLt.so.13"),
                               ("nvidia/cu13/lib", "libcublas.so.13"),
                               ("nvidia/cu13/lib", "libnvJitLink.so.13"),
                               ("nvidia/cu13/lib", "libcusparse.so.12")]}

# cublasFillMode_t, cublasOperation_t, cublasSideMode_t, cublasDiagType_t, cusolverEigMode_t
LOWER, UPPER = 0, 1
OP_N, OP_T = 0, 1
LEFT, RIGHT = 0, 1
NON_UNIT = 0
NOVECTOR, VECTOR = 0, 1
STATUS = {1: "NOT_INITIALIZED", 2: "ALLOC_FAILED", 3: "INVALID_VALUE", 4: "ARCH_MISMATCH",
          5: "MAPPING_ERROR", 6: "EXECUTION_FAILED", 7: "INTERNAL_ERROR",
          8: "MATRIX_TYPE_NOT_SUPPORTED", 9: "NOT_SUPPORTED"}

P, I, IP = c_void_p, c_int, POINTER(c_int)
# the typed routines by their name after the type letter: the S (float) and D (double) forms
# take the same arguments
TYPED = {
    "getrf_bufferSize": [P, I, I, P, I, IP],
    "getrf": [P, I, I, P, I, P, P, P],
    "getrs": [P, I, I, I, P, I, P, P, I, P],
    "potrf_bufferSize": [P, I, I, P, I, IP],
    "potrf": [P, I, I, P, I, P, I, P],
    "potrfBatched": [P, I, I, P, I, P, I],
    "geqrf_bufferSize": [P, I, I, P, I, IP],
    "geqrf": [P, I, I, P, I, P, P, I, P],
    "orgqr_bufferSize": [P, I, I, I, P, I, P, IP],
    "orgqr": [P, I, I, I, P, I, P, P, I, P],
    "syevd_bufferSize": [P, I, I, I, P, I, P, IP],
    "syevd": [P, I, I, I, P, I, P, P, I, P],
    "syevjBatched_bufferSize": [P, I, I, I, P, I, P, IP, P, I],
    "syevjBatched": [P, I, I, I, P, I, P, P, I, P, P, I],
    "gesvdj_bufferSize": [P, I, I, I, I, P, I, P, P, I, P, I, IP, P],
    "gesvdj": [P, I, I, I, I, P, I, P, P, I, P, I, P, I, P, P],
    "gesvdjBatched_bufferSize": [P, I, I, I, P, I, P, P, I, P, I, IP, P, I],
    "gesvdjBatched": [P, I, I, I, P, I, P, P, I, P, I, P, I, P, P, I],
}
PROTOS = {
    "cusolverGetVersion": [IP],
    "cusolverDnCreate": [POINTER(c_void_p)],
    "cusolverDnSetStream": [P, P],
    "cusolverDnDestroy": [P],
    "cusolverDnCreateSyevjInfo": [POINTER(c_void_p)],
    "cusolverDnXsyevjSetSortEig": [P, I],
    "cusolverDnCreateGesvdjInfo": [POINTER(c_void_p)],
    "cusolverDnXgesvdjSetSortEig": [P, I],
    **{f"cusolverDn{t}{name}": args for t in "SD" for name, args in TYPED.items()},
}


class CusolverError(RuntimeError):
    def __init__(self, call: str, status: int):
        self.call, self.status = call, status
        super().__init__(f"{call} failed: cusolverStatus {status} "
                         f"(CUSOLVER_STATUS_{STATUS.get(status, 'UNKNOWN')})")


_lib = None
_handles: dict = {}          # (device, stream) -> cusolverDnHandle_t
_params: dict = {}           # "syevj" / "gesvdj" -> their info objects (sorting on)


def _candidates() -> list[str]:
    from .cublas.loader import wheel_candidates
    return wheel_candidates(SONAMES, WHEEL_DIRS)


def _dependencies(path: str) -> None:
    """Load libcusolver's dependencies (RTLD_GLOBAL) from the wheels: the site dir beside it
    first, then every site dir (a user site may hold cuSOLVER, the system one cuBLAS); one
    found nowhere is left to the system loader."""
    from .cublas.loader import site_dirs
    lib_dir = Path(path).parent.as_posix()
    for sub, deps in DEPENDS.items():
        if not lib_dir.endswith(sub):
            continue
        roots = [Path(lib_dir[: -len(sub)])] + site_dirs()
        for dep_dir, so in deps:
            for root in roots:
                p = root / dep_dir / so
                if p.exists():
                    ctypes.CDLL(str(p), mode=ctypes.RTLD_GLOBAL)
                    break


def lib():
    """The prototyped library, loaded once; raises RuntimeError naming every place tried."""
    global _lib
    if _lib is None:
        from .cublas.loader import load_first, prototyped
        loaded = load_first("cuSOLVER (libcusolver.so.12 / .11)", _candidates(),
                            before=_dependencies)
        _lib = prototyped(loaded, PROTOS, CusolverError)
    return _lib


def available() -> tuple[bool, str]:
    """(True, "") when the library loads (no GPU work), else (False, why). Never raises."""
    from .cublas.loader import probe
    return probe(lib)


def version() -> int:
    v = c_int()
    lib().cusolverGetVersion(byref(v))
    return v.value


def handle(stream) -> c_void_p:
    """The cusolverDn handle of (current device, ``stream``)."""
    from numba import cuda
    s = int(stream) if stream is not None else 0
    key = (cuda.get_current_device().id, s)
    if key not in _handles:
        h = c_void_p()
        lib().cusolverDnCreate(byref(h))
        lib().cusolverDnSetStream(h, c_void_p(s))
        _handles[key] = h
        when_stream_dies(stream, _drop_stream, key)
    return _handles[key]


def live_handles() -> int:
    """cuSOLVER handles alive in this process (one per stream until the stream goes)."""
    return len(_handles)


def _drop_stream(key) -> None:
    """The handle of (device, stream) goes with the stream."""
    h = _handles.pop(key, None)
    if h is not None:
        lib().cusolverDnDestroy(h)


def sorted_params(kind: str) -> c_void_p:
    """The syevjInfo / gesvdjInfo with sorting on (defaults otherwise: tolerance machine
    epsilon, 100 sweeps), made once."""
    if kind not in _params:
        p = c_void_p()
        if kind == "syevj":
            lib().cusolverDnCreateSyevjInfo(byref(p))
            lib().cusolverDnXsyevjSetSortEig(p, 1)
        else:
            lib().cusolverDnCreateGesvdjInfo(byref(p))
            lib().cusolverDnXgesvdjSetSortEig(p, 1)
        _params[kind] = p
    return _params[kind]


def buffer_size(name: str, *args) -> int:
    """lwork (elements) from ``cusolverDn<name>_bufferSize(*args, &lwork[, tail])`` (``name``
    with its type letter: "Sgetrf", "Dgetrf"): args
    are every argument before lwork; for the Jacobi queries the ones after it follow as
    ``tail`` in ``args`` after a None placeholder."""
    lwork = c_int()
    if None in args:
        k = args.index(None)
        full = args[:k] + (byref(lwork),) + args[k + 1:]
    else:
        full = args + (byref(lwork),)
    getattr(lib(), f"cusolverDn{name}_bufferSize")(*full)
    return max(int(lwork.value), 1)
