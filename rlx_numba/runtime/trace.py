"""Timing a run step by step: ``exe.profile(inputs)`` and ``RLX_NUMBA_TRACE=path.json``.

On a GPU each step is bracketed by CUDA events on the executable's stream (GPU time, not
Python's), queued behind a sleeping kernel so the host enqueues every step before the first
runs (without it a step of a few us would time the host's launch of the next); under the
simulator by the host clock. ``Profile`` prints as a table (step, kernel
or library call, time, bytes or FLOPs, achieved GB/s or TFLOP/s where the step says how much
it moves or computes) and writes a Chrome/Perfetto trace: one complete ("X") event per step,
with its kernel, tier and launch geometry in ``args``.

NVTX: when the ``nvtx`` package is installed, a traced or profiled run puts each step inside
an NVTX range named after it (domain "rlx_numba"), so Nsight Systems shows the steps on its
timeline; ``RLX_NUMBA_NVTX=1`` at compile time does that for every run() (STREAM and EAGER).
A range costs ~0.2 us of Python a step without a profiler attached (measured: the wrapper's
call and a push/pop with attributes built once); with the variable unset run() loops over the
bare steps, at no cost.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field

import numpy as np

from ..device import SIMULATOR

log = logging.getLogger("rlx_numba")


@dataclass
class StepTime:
    name: str
    kernel: str
    start_ms: float          # from the start of the run
    ms: float
    info: dict = field(default_factory=dict)

    @property
    def gbps(self):
        b = self.info.get("bytes")
        return b / (self.ms * 1e-3) / 1e9 if b and self.ms > 0 else None

    @property
    def tflops(self):
        f = self.info.get("flops")
        return f / (self.ms * 1e-3) / 1e12 if f and self.ms > 0 else None


class Profile(list):
    """The StepTimes of one run, in order; ``str()`` is a table."""

    def __init__(self, rows, graph_name: str, device: str):
        super().__init__(rows)
        self.graph_name, self.device = graph_name, device

    @property
    def total_ms(self) -> float:
        return sum(r.ms for r in self)

    def __str__(self) -> str:
        w = max([len(r.name) for r in self] + [4])
        k = min(48, max([len(r.kernel) for r in self] + [6]))
        lines = [f"{self.graph_name} on {self.device}: {len(self)} steps, {self.total_ms:.3f} ms",
                 f"{'step':<{w}}  {'kernel':<{k}}  {'ms':>9}  {'GB/s':>7}  {'TFLOP/s':>7}"]
        for r in self:
            gb, tf = r.gbps, r.tflops
            lines.append(f"{r.name:<{w}}  {r.kernel[:k]:<{k}}  {r.ms:9.4f}  "
                         f"{(f'{gb:7.0f}' if gb else ''):>7}  {(f'{tf:7.2f}' if tf else ''):>7}")
        return "\n".join(lines)

    def chrome_trace(self) -> dict:
        events = [{"name": r.name, "cat": "step", "ph": "X", "pid": 0, "tid": 0,
                   "ts": r.start_ms * 1e3, "dur": r.ms * 1e3,
                   "args": {"kernel": r.kernel, **{key: r.info[key] for key in
                            ("tier", "flops", "bytes", "grid", "block") if key in r.info}}}
                  for r in self]
        return {"traceEvents": events, "displayTimeUnit": "ms",
                "otherData": {"graph": self.graph_name, "device": self.device}}

    def write_trace(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)


def timed_steps(steps, stream, cuda, graph_name: str, device: str) -> Profile:
    """Run ``steps`` once, timing each (inside NVTX ranges when nvtx is installed); returns
    the Profile."""
    domain = nvtx_domain()
    if domain is not None:
        steps = [Ranged(s, domain) for s in steps]
    rows = []
    if SIMULATOR:
        t0 = time.perf_counter()
        for s in steps:
            a = time.perf_counter()
            s()
            b = time.perf_counter()
            rows.append(StepTime(s.name, s.kernel_name, (a - t0) * 1e3, (b - a) * 1e3, _info(s)))
        return Profile(rows, graph_name, device)
    # the GPU sleeps while the host enqueues every step behind the first event, so the
    # events time the kernels, not the host's launches (~us each, longer than a small kernel)
    from ..kernels.gemv import spin
    events = [cuda.event() for _ in range(len(steps) + 1)]
    spin[1, 1, stream](np.int64(max(3_000_000, 30_000 * len(steps))))
    events[0].record(stream)
    for s, e in zip(steps, events[1:]):
        s()
        e.record(stream)
    events[-1].synchronize()
    for i, s in enumerate(steps):
        rows.append(StepTime(s.name, s.kernel_name, cuda.event_elapsed_time(events[0], events[i]),
                             cuda.event_elapsed_time(events[i], events[i + 1]), _info(s)))
    return Profile(rows, graph_name, device)


def _info(step) -> dict:
    info = {k: v for k, v in step.info.items() if k in ("tier", "flops", "bytes")}
    if hasattr(step, "grid"):
        info.update(grid=list(step.grid), block=list(step.block))
    return info


# ---- NVTX -------------------------------------------------------------------------------------
_domain = False   # not looked up yet


def nvtx_domain():
    """The "rlx_numba" NVTX domain when the ``nvtx`` package is installed, else None."""
    global _domain
    if _domain is False:
        try:
            import nvtx
            _domain = nvtx.get_domain("rlx_numba")
        except Exception:  # noqa: BLE001 - not installed (or broken): no ranges
            _domain = None
    return _domain


class Ranged:
    """A step that runs inside an NVTX range named after it; its other attributes are the
    step's."""
    __slots__ = ("step", "_domain", "_attrs")

    def __init__(self, step, domain):
        self.step, self._domain = step, domain
        self._attrs = domain.get_event_attributes(message=step.name)

    def __call__(self) -> None:
        self._domain.push_range(self._attrs)
        try:
            self.step()
        finally:
            self._domain.pop_range()

    def __getattr__(self, name):
        return getattr(self.step, name)


def nvtx_wrapped(steps):
    """``steps`` itself, or with RLX_NUMBA_NVTX=1 (and nvtx installed) each step as ``Ranged``."""
    if os.environ.get("RLX_NUMBA_NVTX") != "1":
        return steps
    domain = nvtx_domain()
    if domain is None:
        log.warning("RLX_NUMBA_NVTX=1 but the nvtx package is not installed: no NVTX ranges")
        return steps
    return [Ranged(s, domain) for s in steps]
