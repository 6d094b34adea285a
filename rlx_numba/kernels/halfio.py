"""Loads and stores of float data in its storage dtype: the one place kernels widen and round.

Every kernel that takes f16 / bf16 data computes and accumulates in f32 (as torch's CUDA
kernels do): ``load(kind)`` widens element k to float32, ``store(kind)`` rounds a float32 to
the storage dtype (nearest even) and writes it. bf16 lives on the device as its uint16 bit
pattern (numba and the simulator have no bf16 arrays). A kernel factory takes the kind as a
compile-time string (``io_kind(dtype)``), so each compiled kernel is straight-line code for
one dtype.

    ld = load("bf16"); st = store("bf16")
    v = ld(x, k)            # float32
    st(out, k, v * 2)       # out[k] = bf16(v * 2)
"""
from numba import float32
from numba.core.types import float16

from . import elementwise as ew
from .launch import py_in_sim
from ..device import SIMULATOR

KINDS = ("f32", "f16", "bf16")

# the plain Python conversions in the simulator (a device-function call there costs ~15 us)
_b2f = ew.bf16_to_f32.fn if SIMULATOR else ew.bf16_to_f32
_f2b = ew.f32_to_bf16.fn if SIMULATOR else ew.f32_to_bf16


def io_kind(dtype) -> str:
    """"f32" / "f16" / "bf16" for a float DType (or its name); ValueError otherwise."""
    name = getattr(dtype, "name", dtype)
    if name not in KINDS:
        raise ValueError(f"no float storage kind for dtype {name!r}; expected one of {KINDS}")
    return name


@py_in_sim
def ld_f32(x, k):
    return float32(x[k])


@py_in_sim
def ld_f16(x, k):
    return float32(x[k])


@py_in_sim
def ld_bf16(x, k):
    return _b2f(x[k])


@py_in_sim
def st_f32(out, k, v):
    out[k] = float32(v)


@py_in_sim
def st_f16(out, k, v):
    out[k] = float16(v)


@py_in_sim
def st_bf16(out, k, v):
    out[k] = _f2b(float32(v))


@py_in_sim
def rd_f32(v):
    return float32(v)


@py_in_sim
def rd_f16(v):
    return float32(float16(v))


@py_in_sim
def rd_bf16(v):
    return _b2f(_f2b(float32(v)))


_LOAD = {"f32": ld_f32, "f16": ld_f16, "bf16": ld_bf16}
_STORE = {"f32": st_f32, "f16": st_f16, "bf16": st_bf16}
_ROUND = {"f32": rd_f32, "f16": rd_f16, "bf16": rd_bf16}


def load(kind: str):
    """The device function ``(x, k) -> float32`` reading element k of a ``kind`` array."""
    return _LOAD[io_kind(kind)]


def store(kind: str):
    """The device function ``(out, k, v)`` writing float32 v rounded to ``kind``."""
    return _STORE[io_kind(kind)]


def round_to(kind: str):
    """The device function ``v -> float32`` giving v rounded to ``kind`` (kept as float32)."""
    return _ROUND[io_kind(kind)]
