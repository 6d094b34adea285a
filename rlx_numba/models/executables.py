"""The compiled graphs a model keeps, one per input shape."""
from __future__ import annotations

import gc
from collections import OrderedDict


class ExecutableCache(OrderedDict):
    """Executables by key, least recently used first."""

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
