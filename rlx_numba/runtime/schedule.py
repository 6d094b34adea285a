"""Multi-stream scheduling (ExecMode.MULTISTREAM): which stream runs each node's steps, and
which CUDA events order the streams. Pure Python; the runner is in cudagraph.py.

A unit is one node's steps, kept together on one stream in order (a node's steps may share
scratch memory). Two units conflict when one writes bytes of the arena that the other reads
or writes (read-after-write, write-after-read, write-after-write: the memory planner reuses
offsets, so unrelated tensors share bytes at different times). A later unit must then run
after the earlier one: on the same stream (in order), or after waiting on an event recorded
behind the earlier one (or behind a unit its stream already waited for).

Memory outside the arena (a step's small device arrays) belongs to one node, or is a
read-only placeholder several nodes pass for unused arguments; cuBLAS workspaces are per
stream. So the arena's byte ranges (params': ranges past it) are the only shared state, and
every Step declares the ranges it reads and writes (``Step.reads`` / ``Step.writes``).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass
class Schedule:
    streams: int                  # how many streams there are (0 is the executable's stream)
    stream: list                  # unit index -> stream
    waits: list                   # unit index -> units whose event its stream waits on first
    joins: list                   # units (each stream's last, 0 excepted) stream 0 waits on at
                                  # the end: capture wants every forked stream joined back

    @property
    def used(self) -> list:
        """The streams other than 0 that run some unit, in order."""
        return sorted({s for s in self.stream if s})

    @property
    def recorded(self) -> list:
        """The units behind which an event is recorded (waited on by some stream)."""
        return sorted({d for w in self.waits for d in w} | set(self.joins))


def dependencies(reads, writes) -> list:
    """For each unit, the earlier units it conflicts with (RAW, WAR, WAW on byte ranges).
    ``reads[u]`` and ``writes[u]`` are lists of half-open ``(lo, hi)`` byte ranges.

    The ranges are cut into elementary segments at every endpoint; per segment the last
    writer and the readers since it are kept, so a unit only meets the units that touched
    its own bytes most recently (older ones are ordered behind those)."""
    cuts = sorted({x for rs in (*reads, *writes) for lo, hi in rs if hi > lo for x in (lo, hi)})
    last_writer = [-1] * len(cuts)
    readers = [[] for _ in cuts]

    def segments(rs):
        for lo, hi in rs:
            if hi > lo:
                yield from range(bisect.bisect_left(cuts, lo), bisect.bisect_left(cuts, hi))

    deps = []
    for u in range(len(reads)):
        d = set()
        for k in segments(reads[u]):
            if last_writer[k] >= 0:
                d.add(last_writer[k])                          # read after write
        written = set(segments(writes[u]))
        for k in written:
            if last_writer[k] >= 0:
                d.add(last_writer[k])                          # write after write
            d.update(readers[k])                               # write after read
        for k in written:
            last_writer[k], readers[k] = u, []
        for k in segments(reads[u]):
            readers[k].append(u)
        d.discard(u)
        deps.append(sorted(d))
    return deps


def assign_streams(reads, writes, n: int) -> Schedule:
    """Place units (in program order) on ``n`` streams.

    A unit goes on the stream of its latest dependency that is still that stream's last unit
    (it continues that chain, no event needed), else on the stream idle the longest. Each
    stream carries a vector clock (per stream, the last unit known finished before its next
    one), so a dependency already covered by an earlier wait costs no new event."""
    if n < 1:
        raise ValueError(f"assign_streams: n must be >= 1, got {n}")
    deps = dependencies(reads, writes)
    count = len(deps)
    stream, waits = [0] * count, [[] for _ in range(count)]
    tail = [-1] * n                        # stream -> its last unit
    clock = [[-1] * n for _ in range(n)]   # stream -> per stream, last unit ordered before
    after = [None] * count                 # unit -> its stream's clock right after it
    for u, du in enumerate(deps):
        chained = [d for d in du if tail[stream[d]] == d]
        s = stream[max(chained)] if chained else min(range(n), key=lambda t: (tail[t], t))
        c = clock[s]
        for d in sorted(du, reverse=True):          # latest first: it covers earlier ones
            t = stream[d]
            if t != s and c[t] < d:
                waits[u].append(d)
                c[:] = [max(x, y) for x, y in zip(c, after[d])]
        stream[u], tail[s], c[s] = s, u, u
        after[u] = list(c)
    joins = [tail[s] for s in range(1, n) if tail[s] >= 0]
    return Schedule(n, stream, waits, joins)


def node_units(exe):
    """The units of an executable (or a Program): ``[(node id, steps, reads, writes)]`` in
    step order, the ranges being the bytes its steps declared they read and write (Program
    fills them from the node's operands and results)."""
    program = getattr(exe, "program", exe)
    units = []
    for nid, steps in program.node_steps.items():
        if steps:
            reads, writes = [], []
            for s in steps:
                reads += [r for r in s.reads if r not in reads]
                writes += [w for w in s.writes if w not in writes]
            units.append((nid, list(steps), reads, writes))
    return units
