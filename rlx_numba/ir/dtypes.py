"""The thirteen dtypes, their NumPy mapping and the promotion rule.

bf16 has no NumPy dtype of its own: on the host it is ``ml_dtypes.bfloat16``, on the device its
16-bit pattern is stored as uint16 (numba and its simulator have no bf16 arrays). The fp8 types
likewise: ``ml_dtypes.float8_e4m3fn`` / ``float8_e5m2`` on the host, their bytes as uint8 on
the device (kernels/elementwise.py converts, with ml_dtypes' rounding). c64 is NumPy's
complex64 on the host and on the device: its memory is the interleaved (re, im) f32 pairs that
the [..., 2] f32 form reads through a view (ir/ops_complex.py), so no kernel sees it.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np


@dataclass(frozen=True)
class DType:
    name: str          # "f32", ...
    host: np.dtype     # what run() takes and returns
    storage: np.dtype  # what the device array holds
    kind: str          # "float", "int", "bool" or "complex"
    rank: int          # promotion order

    @property
    def itemsize(self) -> int:
        return self.storage.itemsize

    @property
    def is_float(self) -> bool:
        return self.kind == "float"

    @property
    def is_complex(self) -> bool:
        return self.kind == "complex"

    @property
    def is_int(self) -> bool:
        return self.kind == "int"

    def __str__(self) -> str:
        return self.name

    __repr__ = __str__


BOOL = DType("bool", np.dtype(np.bool_), np.dtype(np.bool_), "bool", 0)
U8 = DType("u8", np.dtype(np.uint8), np.dtype(np.uint8), "int", 1)
I8 = DType("i8", np.dtype(np.int8), np.dtype(np.int8), "int", 1)
I16 = DType("i16", np.dtype(np.int16), np.dtype(np.int16), "int", 2)
I32 = DType("i32", np.dtype(np.int32), np.dtype(np.int32), "int", 3)
I64 = DType("i64", np.dtype(np.int64), np.dtype(np.int64), "int", 4)
F8E4M3 = DType("f8e4m3", np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(np.uint8), "float", 5)
F8E5M2 = DType("f8e5m2", np.dtype(ml_dtypes.float8_e5m2), np.dtype(np.uint8), "float", 5)
BF16 = DType("bf16", np.dtype(ml_dtypes.bfloat16), np.dtype(np.uint16), "float", 6)
F16 = DType("f16", np.dtype(np.float16), np.dtype(np.float16), "float", 6)
F32 = DType("f32", np.dtype(np.float32), np.dtype(np.float32), "float", 7)
F64 = DType("f64", np.dtype(np.float64), np.dtype(np.float64), "float", 8)
C64 = DType("c64", np.dtype(np.complex64), np.dtype(np.complex64), "complex", 9)

ALL = (F32, F16, BF16, I32, I64, U8, I8, BOOL, I16, F8E4M3, F8E5M2, F64, C64)
FP8 = (F8E4M3, F8E5M2)
_BY_NAME = {d.name: d for d in ALL}
_ALIASES = {"float64": F64, "float32": F32, "float16": F16, "bfloat16": BF16, "int32": I32, "int64": I64,
            "uint8": U8, "int8": I8, "bool_": BOOL, "int16": I16, "float8_e4m3fn": F8E4M3,
            "float8_e5m2": F8E5M2, "complex64": C64}
_BY_HOST = {d.host: d for d in ALL}


def dtype(x) -> DType:
    """Parse "f32" / "float32" / np.float32 / np.dtype / DType into a DType."""
    if isinstance(x, DType):
        return x
    if isinstance(x, str):
        d = _BY_NAME.get(x) or _ALIASES.get(x)
        if d is None:
            raise ValueError(f"unknown dtype {x!r}; expected one of {', '.join(_BY_NAME)}")
        return d
    try:
        npd = np.dtype(x)
    except TypeError:
        raise ValueError(f"unknown dtype {x!r}; expected one of {', '.join(_BY_NAME)}") from None
    d = _BY_HOST.get(npd)
    if d is None:
        raise ValueError(f"NumPy dtype {npd} has no rlx_numba dtype; expected one of "
                         f"{', '.join(str(d.host) for d in ALL)}")
    return d


def promote(a: DType, b: DType) -> DType:
    """Result dtype of a binary op: bool < u8, i8 < i16 < i32 < i64 < fp8 < f16, bf16 < f32
    < f64 (so f64 with any other dtype is f64, as torch) < c64 (c64 with any real dtype but f64
    is c64, as torch's complex64; f64 with c64 raises: torch's complex128 is absent); f16 with bf16 is f32, e4m3 with e5m2 is f32 (torch refuses to promote fp8; arithmetic on
    fp8 here computes in f32 like any float), u8 with i8 is i16 (as PyTorch)."""
    if a == b:
        return a
    if {a, b} == {F64, C64}:     # torch gives complex128, which does not exist here
        raise ValueError("f64 with c64 would be complex128, which rlx_numba does not have; "
                         "cast the f64 operand to f32 first")
    if {a, b} in ({F16, BF16}, {F8E4M3, F8E5M2}):
        return F32
    if {a, b} == {U8, I8}:
        return I16
    return a if a.rank > b.rank else b


def compute_dtype(d: DType) -> DType:
    """The dtype float math on ``d`` runs in: f64 for f64, f32 for every other dtype (halves
    and fp8 widen to f32, as torch's CUDA kernels do)."""
    return F64 if d == F64 else F32


def scalar_dtype(value, other: DType) -> DType:
    """dtype of a Python scalar beside a tensor of dtype ``other`` (weak, like PyTorch)."""
    if isinstance(value, (bool, np.bool_)):
        return BOOL
    if isinstance(value, (int, np.integer)):
        return other if other.kind != "bool" else I64
    if isinstance(value, (float, np.floating)):
        return other if other.is_float else F32
    if isinstance(value, (complex, np.complexfloating)):
        return C64
    raise ValueError(f"cannot use {type(value).__name__} {value!r} as a tensor operand")
