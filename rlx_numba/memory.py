"""Liveness-based arena planner.

Every tensor a graph computes gets a byte range in one device arena. A buffer is live from the
step that writes it to the last step that reads it (inclusive at both ends, so a step never
writes over its own inputs); inputs, params, constants and outputs are live for the whole run.
Views (reshape, same-dtype cast) own no memory: they extend the life of the buffer they alias.
Placement is greedy by size (largest first, lowest offset that overlaps no live neighbour),
the usual heuristic for this offline interval-packing problem.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

ALIGN = 256  # bytes: cuBLAS and vector loads want aligned pointers


@dataclass
class Buffer:
    key: int            # the node id that owns it
    nbytes: int
    start: int          # first step index it must hold data
    end: int            # last step index it must hold data
    pinned: bool = False
    offset: int = -1

    @property
    def size(self) -> int:
        return -(-max(self.nbytes, 1) // ALIGN) * ALIGN


def plan(buffers: list[Buffer]) -> int:
    """Assign ``offset`` to every buffer; return the arena size in bytes."""
    placed: list[tuple] = []     # (offset, end offset, start, end) of placed buffers, by offset
    top = 0
    for size, b in sorted(((b.size, b) for b in buffers), key=lambda t: (-t[0], t[1].start, t[1].key)):
        s, e = b.start, b.end
        off = 0
        for lo, hi, ps, pe in placed:     # the lowest gap among the ones live with b
            if ps <= e and s <= pe:
                if off + size <= lo:
                    break
                if hi > off:
                    off = hi
        b.offset = off
        bisect.insort(placed, (off, off + size, s, e))
        top = max(top, off + size)
    return top


class MemoryReport(dict):
    """A dict of arena statistics that prints as a small table. Params are not in the arena:
    ``param_bytes`` counts those this executable added to its ParamStore, ``shared_param_bytes``
    those it found there (another executable of the store holds them: not counted twice);
    ``param_bytes_by_format`` the device bytes of every param it reads by format (f32, the half
    copy of a set_param_half weight, u8 packed quantised blocks, ...)."""

    def __str__(self) -> str:
        def mib(n):
            return f"{n / 2**20:10.3f} MiB" if n >= 2**16 else f"{n:10d} B  "
        rows = [("arena (planned)", self["arena_bytes"]),
                ("without reuse", self["unshared_bytes"]),
                ("  inputs", self["input_bytes"]), ("  constants", self["constant_bytes"]),
                ("  outputs", self["output_bytes"]),
                ("  intermediates", self["intermediate_bytes"]),
                ("params (own)", self.get("param_bytes", 0)),
                ("params (shared)", self.get("shared_param_bytes", 0))]
        out = [f"memory plan: {self['buffers']} buffers, {self['views']} views, "
               f"reuse saves {100 * self['saved_fraction']:.1f}%"]
        out += [f"  {name:<18}{mib(v)}" for name, v in rows]
        out += [f"    as {fmt:<13}{mib(v)}" for fmt, v in sorted(self.get("param_bytes_by_format", {}).items())]
        return "\n".join(out)

    __repr__ = __str__
