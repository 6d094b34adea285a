"""The compiled graphs a model keeps, one per input shape, with what they share."""
from __future__ import annotations

import gc
from collections import OrderedDict

from ..runtime.params import ParamStore


class ExecutableCache(OrderedDict):
    """Executables by key, least recently used first. They share ``params`` (one device copy
    of the model's weights) and ``stream`` (a model's graphs run one after another, so one
    stream, one cuBLAS handle and workspace, serves them all)."""

    def __init__(self, name: str = "model"):
        super().__init__()
        self.params = ParamStore(name)
        self._stream = None

    @property
    def stream(self):
        if self._stream is None:
            from numba import cuda
            self._stream = cuda.stream()
        return self._stream

    def fetch(self, key, limit: int, make):
        """The executable for ``key``, from ``make()`` when missing. At most ``limit`` are
        kept: the least recently used go first, and are freed before ``make`` runs (with a
        cycle collection, for anything a caller's own reference cycle still holds)."""
        exe = self.get(key)
        if exe is not None:
            self.move_to_end(key)
            return exe
        if self and len(self) >= limit and self._stream is not None:
            self._stream.synchronize()   # a generation's step queued ahead may use what goes
        while self and len(self) >= limit:
            self.popitem(last=False)
            gc.collect()
        self[key] = exe = make()
        return exe


def next_pow2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def bucket_length(n: int, *, lo: int, steps: int, align: int = 8) -> int:
    """``n`` rounded up to a grid of padded lengths, so inputs of many lengths share a few
    compiled shapes: at least ``lo``; above it, ``steps`` lengths an octave (2**k < n <=
    2**(k+1) rounds up to a multiple of max(align, 2**k / steps)), so the padding wastes at
    most about 1/steps of the tokens."""
    n = int(n)
    if n <= lo:
        return lo
    step = max(align, (1 << ((n - 1).bit_length() - 1)) // steps)
    return -(-n // step) * step


def model_dtype(model: str, dtype) -> str:
    """A model's ``dtype=`` ("f32", "bf16", "f16"), or a ValueError naming the model."""
    from ..modes import parse_precision
    try:
        return parse_precision(dtype)
    except ValueError:
        raise ValueError(f"{model}: dtype must be 'f32', 'bf16' or 'f16', got {dtype!r}") from None


def in_dtype(g, dtype: str):
    """The model graph ``g`` run in ``dtype`` (``Graph.to_dtype``: weights, constants and the
    KV caches in that dtype, f32 inputs cast as they enter); its half float outputs cast back
    to f32 on the device, so a model's methods return f32 whatever it computes in."""
    if dtype == "f32":
        return g
    h = g.to_dtype(dtype)
    outs = [h.tensor(o) for o in h.outputs]
    h.set_outputs([h.cast(t, "f32") if t.dtype.name == dtype else t for t in outs])
    return h
