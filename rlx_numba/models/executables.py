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
