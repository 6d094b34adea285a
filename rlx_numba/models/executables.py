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
        while self and len(self) >= limit:
            self.popitem(last=False)
            gc.collect()
        self[key] = exe = make()
        return exe
