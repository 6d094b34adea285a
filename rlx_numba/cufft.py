"""cuFFT through ctypes: the FFT family's tier 0 (ir/ops_fft.py, runtime/lower_fft.py).

Batched 1-D plans (cufftPlanMany) of the three transforms the graph has: C2C (fft / ifft,
interleaved complex f32 = our trailing axis of 2), R2C (rfft) and C2R (irfft). A plan is made
once per (device, stream, type, n, batch) and kept; cuFFT allocates its work area with it.

The library is NVIDIA's pip wheel (``nvidia-cufft-cu12``: ``nvidia/cufft/lib/libcufft.so.11``;
``nvidia-cufft`` for CUDA 13: ``nvidia/cu13/lib/libcufft.so.12``), ``$CUDA_HOME``, or the
system loader. cuFFT's soname major is not CUDA's (cuFFT 11 ships with CUDA 12).
"""
from __future__ import annotations

from ctypes import POINTER, byref, c_int, c_void_p

C2C, R2C, C2R = 0x29, 0x2A, 0x2C
FORWARD, INVERSE = -1, 1
SONAMES = ("libcufft.so.12", "libcufft.so.11")
RESULTS = {1: "INVALID_PLAN", 2: "ALLOC_FAILED", 3: "INVALID_TYPE", 4: "INVALID_VALUE",
           5: "INTERNAL_ERROR", 6: "EXEC_FAILED", 7: "SETUP_FAILED", 8: "INVALID_SIZE",
           9: "UNALIGNED_DATA", 11: "INVALID_DEVICE", 13: "NO_WORKSPACE",
           14: "NOT_IMPLEMENTED", 16: "NOT_SUPPORTED"}

P = c_void_p
PROTOS = {
    "cufftGetVersion": [POINTER(c_int)],
    "cufftPlanMany": [POINTER(c_int), c_int, POINTER(c_int), POINTER(c_int), c_int, c_int,
                      POINTER(c_int), c_int, c_int, c_int, c_int],
    "cufftSetStream": [c_int, P],
    "cufftDestroy": [c_int],
    "cufftExecC2C": [c_int, P, P, c_int],
    "cufftExecR2C": [c_int, P, P],
    "cufftExecC2R": [c_int, P, P],
}


class CufftError(RuntimeError):
    def __init__(self, call: str, status: int):
        self.call, self.status = call, status
        super().__init__(f"{call} failed: cufftResult {status} "
                         f"(CUFFT_{RESULTS.get(status, 'UNKNOWN')})")


_lib = None
_plans: dict = {}            # (device, stream, type, n, batch) -> cufftHandle


def _candidates() -> list[str]:
    from .cublas.loader import wheel_candidates
    return wheel_candidates(SONAMES, ("nvidia/cu13/lib", "nvidia/cufft/lib"))


def lib():
    """The prototyped library, loaded once; raises RuntimeError naming every place tried."""
    global _lib
    if _lib is None:
        from .cublas.loader import load_first, prototyped
        _lib = prototyped(load_first("cuFFT (libcufft.so.12 / .11)", _candidates()), PROTOS,
                          CufftError)
    return _lib


def available() -> tuple[bool, str]:
    """(True, "") when the library loads (no GPU work), else (False, why). Never raises."""
    from .cublas.loader import probe
    return probe(lib)


def version() -> int:
    v = c_int()
    lib().cufftGetVersion(byref(v))
    return v.value


def plan(stream, kind: int, n: int, batch: int) -> int:
    """A cufftHandle for ``batch`` contiguous transforms of ``n`` points on ``stream``."""
    from numba import cuda
    s = int(stream) if stream is not None else 0
    key = (cuda.get_current_device().id, s, kind, n, batch)
    if key not in _plans:
        h, dims = c_int(), (c_int * 1)(n)
        # NULL embeds: each transform is contiguous, the next starts n (C2R: its n // 2 + 1
        # input bins; R2C: its n // 2 + 1 output bins) elements on
        lib().cufftPlanMany(byref(h), 1, dims, None, 1, 0, None, 1, 0, kind, batch)
        lib().cufftSetStream(h.value, c_void_p(s))
        _plans[key] = h.value
    return _plans[key]


def exec_call(stream, kind: int, n: int, batch: int, src: int, dst: int, inverse: bool = False):
    """The no-argument callable that enqueues one batched transform from device pointer
    ``src`` to ``dst`` (a C2R transform overwrites ``src``: cuFFT's out-of-place C2R always
    does)."""
    h = plan(stream, kind, n, batch)
    fn = {C2C: lib().cufftExecC2C, R2C: lib().cufftExecR2C, C2R: lib().cufftExecC2R}[kind]
    args = (h, c_void_p(src), c_void_p(dst)) + ((INVERSE if inverse else FORWARD,)
                                                  if kind == C2C else ())
    return lambda: fn(*args)
