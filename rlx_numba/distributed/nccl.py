"""NCCL through ctypes: the handful of calls rlx_numba.distributed needs (communicator set-up,
the four collectives, group calls), prototyped once when the library is first loaded.

The library is NVIDIA's pip wheel (``nvidia-nccl-cu12``: ``nvidia/nccl/lib``; ``-cu13``:
``nvidia/nccl/lib`` or ``nvidia/cu13/lib``), ``$CUDA_HOME``, or the system loader, found the
way ``rlx_numba/cudnn.py`` finds cuDNN. Nothing here touches a GPU until a communicator is
made, so ``available()`` and ``version()`` work on any machine that has the library.
Enum values are nccl.h's (NCCL 2.x).
"""
from __future__ import annotations

import ctypes
from ctypes import POINTER, byref, c_char, c_char_p, c_int, c_size_t, c_void_p

SONAME = "libnccl.so.2"
NCCL_UNIQUE_ID_BYTES = 128

# ncclDataType_t
INT8, UINT8, INT32, UINT32, INT64, UINT64, FLOAT16, FLOAT32, FLOAT64, BFLOAT16 = range(10)
DTYPES = {"int8": INT8, "uint8": UINT8, "int32": INT32, "uint32": UINT32, "int64": INT64,
          "uint64": UINT64, "float16": FLOAT16, "float32": FLOAT32, "float64": FLOAT64,
          "bfloat16": BFLOAT16}
# ncclRedOp_t
OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}
# ncclResult_t
RESULTS = {0: "ncclSuccess", 1: "ncclUnhandledCudaError", 2: "ncclSystemError",
           3: "ncclInternalError", 4: "ncclInvalidArgument", 5: "ncclInvalidUsage",
           6: "ncclRemoteError", 7: "ncclInProgress"}


class ncclUniqueId(ctypes.Structure):
    _fields_ = [("internal", c_char * NCCL_UNIQUE_ID_BYTES)]


class NcclError(RuntimeError):
    """A failing NCCL call: ``call`` (its name), ``result`` (the ncclResult_t), ``text``
    (ncclGetErrorString's text, then ncclGetLastError's when it says more)."""

    def __init__(self, call: str, result: int, text: str = ""):
        self.call, self.result, self.text = call, result, text
        name = RESULTS.get(result, "unknown ncclResult_t")
        super().__init__(f"{call} failed: ncclResult_t {result} ({name}): {text}".rstrip(": "))


P = c_void_p
Comm = c_void_p     # ncclComm_t (an opaque pointer)
Stream = c_void_p   # cudaStream_t
PROTOS = {
    "ncclGetVersion": [POINTER(c_int)],
    "ncclGetUniqueId": [POINTER(ncclUniqueId)],
    "ncclCommInitRank": [POINTER(Comm), c_int, ncclUniqueId, c_int],   # the id goes by value
    "ncclCommDestroy": [Comm],
    "ncclCommAbort": [Comm],
    "ncclCommCount": [Comm, POINTER(c_int)],
    "ncclCommUserRank": [Comm, POINTER(c_int)],
    # (send, recv, count, datatype, op, comm, stream)
    "ncclAllReduce": [P, P, c_size_t, c_int, c_int, Comm, Stream],
    # (send, recv, sendcount, datatype, comm, stream)
    "ncclAllGather": [P, P, c_size_t, c_int, Comm, Stream],
    # (send, recv, recvcount, datatype, op, comm, stream)
    "ncclReduceScatter": [P, P, c_size_t, c_int, c_int, Comm, Stream],
    # (send, recv, count, datatype, root, comm, stream)
    "ncclBroadcast": [P, P, c_size_t, c_int, c_int, Comm, Stream],
    "ncclGroupStart": [],
    "ncclGroupEnd": [],
}

_lib = None


def _candidates() -> list[str]:
    from ..cublas.loader import wheel_candidates
    return wheel_candidates((SONAME,), ("nvidia/nccl/lib", "nvidia/cu13/lib"))


def lib():
    """The prototyped library, loaded once; raises RuntimeError naming every place tried."""
    global _lib
    if _lib is None:
        from ..cublas.loader import load_first
        loaded = load_first(f"NCCL ({SONAME})", _candidates())
        _prototype(loaded)
        _lib = loaded
    return _lib


def _prototype(loaded) -> None:
    err = loaded.ncclGetErrorString
    err.argtypes, err.restype = [c_int], c_char_p
    last = loaded.ncclGetLastError
    last.argtypes, last.restype = [Comm], c_char_p
    for name, argtypes in PROTOS.items():
        fn = getattr(loaded, name)
        fn.argtypes, fn.restype = argtypes, c_int
        fn.errcheck = (lambda result, func, args, err=err, last=last:
                       _check(result, func, err, last))


def _check(result, func, err, last):
    if result != 0:
        text = (err(result) or b"").decode(errors="replace")
        # ncclGetLastError ignores its comm argument in NCCL 2.x: the calling thread's last error
        detail = (last(None) or b"").decode(errors="replace").strip()
        if detail and detail not in text:
            text = f"{text}; last error: {detail}"
        raise NcclError(func.__name__, result, text)
    return result


def available() -> tuple[bool, str]:
    """(True, "") when the library loads (no GPU work), else (False, why: every place tried,
    on one line). Never raises."""
    from ..cublas.loader import probe
    return probe(lib, whole=True)


def version() -> int:
    """NCCL's version code (e.g. 22105 for 2.21.5)."""
    v = c_int(0)
    lib().ncclGetVersion(byref(v))
    return v.value


def unique_id() -> bytes:
    """A fresh ncclUniqueId (128 bytes) for rank 0 to hand to every other rank."""
    uid = ncclUniqueId()
    lib().ncclGetUniqueId(byref(uid))
    # .internal stops at the first NUL; the raw struct bytes are the id
    return ctypes.string_at(byref(uid), NCCL_UNIQUE_ID_BYTES)


def as_unique_id(uid: bytes) -> ncclUniqueId:
    """The struct for 128 id bytes (from ``unique_id()`` on rank 0)."""
    if not isinstance(uid, (bytes, bytearray)) or len(uid) != NCCL_UNIQUE_ID_BYTES:
        got = len(uid) if isinstance(uid, (bytes, bytearray)) else type(uid).__name__
        raise ValueError(f"ncclUniqueId: expected {NCCL_UNIQUE_ID_BYTES} bytes, got {got}")
    out = ncclUniqueId()
    ctypes.memmove(byref(out), bytes(uid), NCCL_UNIQUE_ID_BYTES)
    return out


def dtype_code(dtype_name: str, call: str = "nccl") -> int:
    try:
        return DTYPES[dtype_name]
    except KeyError:
        raise ValueError(f"{call}: dtype {dtype_name!r} has no NCCL type; one of "
                         f"{sorted(DTYPES)}") from None


def op_code(op: str, call: str = "nccl") -> int:
    try:
        return OPS[op]
    except KeyError:
        raise ValueError(f"{call}: op {op!r} is not one of {list(OPS)}") from None
