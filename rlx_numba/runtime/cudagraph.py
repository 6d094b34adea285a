"""ExecMode.GRAPH and ExecMode.MULTISTREAM(n): a Runner enqueues one run of an executable's
steps, either spread over n streams ordered by events (schedule.py decides where), or
captured once into a CUDA graph and replayed, or both (capture follows the forked streams).

The driver calls go through ``cuda.bindings.driver``, the binding numba-cuda 0.30 and
cuda.core already load: typed handles and the installed CUDA's own signatures
(no hand-written ctypes prototypes to get wrong: cuGraphInstantiate changed its arguments in
CUDA 12, several calls have _v2 symbols), and each call returns its CUresult to check.

Capture uses CU_STREAM_CAPTURE_MODE_THREAD_LOCAL: a call from this thread that is unsafe
during capture (an allocation, a synchronous copy, a sync) fails loudly and invalidates the
capture, so a step that does one is found and named, instead of running once at capture time
and being missing from the replays (RELAXED mode's behaviour); and other threads of the
process (a data loader, PyTorch's allocator) are not restricted, as GLOBAL mode would do.
Numba does its allocations and syncs on the calling thread, so there is nothing to miss.

Under the simulator there are no graphs and launches are synchronous: GRAPH and MULTISTREAM
run as STREAM, which is logged once per mode.
"""
from __future__ import annotations

import copy
import functools
import numbers
import weakref

import numpy as np

from ..device import SIMULATOR, in_cuda_context, retry_out_of_memory
from .lower import CallStep, Step, log
from .schedule import Schedule, assign_streams, node_units

_said = set()   # modes whose simulator fallback was logged


def _cuda():
    from numba import cuda
    return cuda


def runner_for(exe):
    """The Runner for exe's GRAPH / MULTISTREAM mode (None: run as STREAM). For GRAPH the
    steps are audited here, at compile time."""
    mode = exe.exec_mode
    graph = mode.kind == "graph"
    if graph:
        audit(exe.steps, str(mode))
    if SIMULATOR:
        if str(mode) not in _said:
            _said.add(str(mode))
            log.warning("ExecMode.%s runs as ExecMode.STREAM under the CUDA simulator (it has no "
                        "CUDA graphs, and its launches are synchronous)", mode)
        return None
    return Runner(exe, mode.streams, graph)


# ---- what forbids capture ----------------------------------------------------------------------
def _is_device_array(a) -> bool:
    if SIMULATOR:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        return isinstance(a, FakeCUDAArray)
    return hasattr(a, "__cuda_array_interface__")


def _by_value(a) -> bool:
    if isinstance(a, tuple):
        return all(_by_value(x) for x in a)
    return isinstance(a, (numbers.Number, np.generic))


def capture_problem(step) -> str | None:
    """Why ``step`` cannot be captured into a CUDA graph, or None.

    A kernel Step's launch is one cuLaunchKernel when its arguments are device arrays and
    scalars; a host array would make numba allocate, copy in and copy back (with a sync) at
    every launch. A CallStep is a cuBLAS/cuBLASLt call on a handle whose stream and
    workspace were set when it was planned, so it enqueues work and nothing else; a library
    call that cannot be captured says so with ``info["capture"] = "why"``."""
    if isinstance(step, Step):
        for k, a in enumerate(step.args):
            if not (_is_device_array(a) or _by_value(a)):
                return (f"kernel argument {k} is a {type(a).__name__}, not a device array or a "
                        f"scalar (numba would allocate, copy and sync at every launch)")
        return None
    if isinstance(step, CallStep):
        why = step.info.get("capture")
        return f"library call: {why}" if why else None
    return f"unknown step type {type(step).__name__}"


def audit(steps, mode: str = "GRAPH") -> None:
    """Raise ValueError naming the first step that cannot be captured."""
    for s in steps:
        why = capture_problem(s)
        if why:
            raise ValueError(f"compile: ExecMode.{mode}: step {s.name} ({s.kernel_name}) cannot "
                             f"be captured into a CUDA graph: {why}; use ExecMode.STREAM")


# ---- the runner ----------------------------------------------------------------------------------
def cu_driver():
    from cuda.bindings import driver
    return driver


def _err_name(drv, err) -> str:
    res = drv.cuGetErrorName(err)
    name = res[1].decode() if res[0] == drv.CUresult.CUDA_SUCCESS else ""
    return name or str(err)


def cu_check(drv, res, what):
    """The values of a cuda.bindings call after its CUresult; raises RuntimeError."""
    if res[0] != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {_err_name(drv, res[0])}")
    return res[1] if len(res) == 2 else res[1:]


def instantiate(drv, graph):
    """cuGraphInstantiate of a captured graph; out of device memory, it runs once more after
    ``release_unreferenced`` (an executable's graph needs memory of its own)."""
    return retry_out_of_memory(
        lambda: cu_check(drv, drv.cuGraphInstantiate(graph, 0), "cuGraphInstantiate"))()


def _launcher(step, stream):
    """A callable enqueueing ``step`` on ``stream``, compiled and packed now. The step itself
    stays bound to the executable's stream (profile(), tracing and EAGER use it as is)."""
    c = copy.copy(step)
    c.bind(stream, True)
    return c.launch if c.launch is not None else c


def destroy_graph(exec_, graph):
    drv = cu_driver()
    if exec_ is not None:
        drv.cuGraphExecDestroy(exec_)
    if graph is not None:
        drv.cuGraphDestroy(graph)


class Runner:
    """One run's work for ``run()``: the steps on ``streams`` streams (the executable's stream
    first) in the order of a Schedule, optionally captured into a CUDA graph.

    The launch list is built from ``exe.steps`` on the first run and again whenever that list
    is replaced (set_param_half re-plans products): the graph is then captured anew. Inputs
    are copied into the arena on the executable's stream before ``run()`` and params live in
    the arena, so neither needs a new capture."""

    def __init__(self, exe, streams: int, graph: bool):
        # a proxy: the executable owns its runner, and a cycle would keep its arena on the
        # device until the cycle collector happens to run
        self.exe, self.graph = weakref.proxy(exe), graph
        self.mode = str(exe.exec_mode)
        self.streams = [exe.stream] + [_cuda().stream() for _ in range(streams - 1)]
        self._built_from = None   # the exe.steps list the launch list was built from
        self._calls = []          # the launch list: no-argument callables, in issue order
        self._labels = []         # per call: (what it is, stream index), for capture errors
        self.schedule = None
        self._exec = None
        self._fin = None
        self.captures = 0         # graphs captured so far (a re-plan captures again)
        self.graph_nodes = self.kernel_nodes = 0

    # -- building -------------------------------------------------------------------------------
    @in_cuda_context
    def _build(self):
        exe = self.exe
        self._drop_graph()
        steps = exe.steps
        if self.graph:
            audit(steps, self.mode)
        n = len(self.streams)
        if n == 1:
            units = [(None, [s], None, None) for s in steps]
            sched = Schedule(1, [0] * len(units), [[] for _ in units], [])
        else:
            units = node_units(exe)
            flat = [s for u in units for s in u[1]]
            if len(flat) != len(steps) or any(a is not b for a, b in zip(flat, steps)):
                raise RuntimeError(f"run: ExecMode.{self.mode}: the executable's steps are not "
                                   f"grouped by node as its node table says; cannot schedule")
            sched = assign_streams([u[2] for u in units], [u[3] for u in units], n)
        timing = {} if SIMULATOR else {"timing": False}
        events = {d: _cuda().event(**timing) for d in sched.recorded}
        calls, labels = [], []

        def add(call, label, si):
            calls.append(call)
            labels.append((label, si))

        if sched.used:   # the other streams start after the inputs were copied in on stream 0
            fork = _cuda().event(**timing)
            add(functools.partial(fork.record, self.streams[0]), "fork event record", 0)
            for si in sched.used:
                add(functools.partial(fork.wait, self.streams[si]), f"fork wait on stream {si}", si)
        for u, (_, ustep, _, _) in enumerate(units):
            si = sched.stream[u]
            st = self.streams[si]
            for d in sched.waits[u]:
                add(functools.partial(events[d].wait, st), f"event wait on stream {si}", si)
            for s in ustep:
                add(_launcher(s, st), f"step {s.name} ({s.kernel_name})", si)
            if u in events:
                add(functools.partial(events[u].record, st), f"event record on stream {si}", si)
        for d in sched.joins:   # every stream joins back before the results are read
            add(functools.partial(events[d].wait, self.streams[0]), "join wait on stream 0", 0)
        self._calls, self._labels, self.schedule = calls, labels, sched
        self._events = events
        self._built_from = steps

    def _drop_graph(self):
        if self._fin is not None:
            self.exe.stream.synchronize()     # no replay of it still queued
            self._fin()
            self._fin = None
        self._exec = None

    # -- running --------------------------------------------------------------------------------
    def run(self):
        """Enqueue one run on the executable's stream (inputs already bound)."""
        if self._built_from is not self.exe.steps:
            self._build()
        if not self.graph:
            for call in self._calls:
                call()
            return
        if self._exec is None:
            for call in self._calls:      # the first run: uncaptured (this run's results) ...
                call()
            try:
                self.exe.stream.synchronize()
            except Exception as e:
                raise RuntimeError(f"run: ExecMode.{self.mode}: the first (uncaptured) run of "
                                   f"{self.exe.graph.name!r} failed: {e}; ExecMode.EAGER names "
                                   f"the failing step") from e
            self._capture()               # ... then the capture, replayed from the next run on
            return
        self._launch()

    @in_cuda_context
    def _capture(self):
        from numba import cuda
        drv = cu_driver()
        hs = [drv.CUstream(int(s)) for s in self.streams]
        active = drv.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE
        cu_check(drv, drv.cuStreamBeginCapture(
            hs[0], drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
            "cuStreamBeginCapture")
        failure, graph = None, None
        try:
            with cuda.defer_cleanup():      # no deferred cuMemFree while capturing
                for call, (label, si) in zip(self._calls, self._labels):
                    try:
                        call()
                    except Exception as e:  # noqa: BLE001 - reported below, naming the step
                        failure = f"{label} failed while being captured: {e}"
                        break
                    err, status = drv.cuStreamIsCapturing(hs[si])
                    if err != drv.CUresult.CUDA_SUCCESS:
                        failure = f"{label} broke the capture ({_err_name(drv, err)})"
                        break
                    if status != active:
                        failure = (f"{label} broke the capture (stream status "
                                   f"{getattr(status, 'name', status)})")
                        break
        finally:
            res = drv.cuStreamEndCapture(hs[0])   # always: never leave the stream capturing
            if res[0] == drv.CUresult.CUDA_SUCCESS:
                graph = res[1]
            elif failure is None:
                failure = f"cuStreamEndCapture: {_err_name(drv, res[0])}"
            for h in hs[1:]:                      # a forked stream left unjoined by a failure
                if drv.cuStreamIsCapturing(h)[1] != drv.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE:
                    drv.cuStreamEndCapture(h)
        if failure is not None or graph is None:
            if graph is not None:
                drv.cuGraphDestroy(graph)
            raise RuntimeError(f"run: ExecMode.{self.mode}: capturing {self.exe.graph.name!r} "
                               f"into a CUDA graph failed: {failure or 'no graph'}. The streams are "
                               f"out of capture mode; ExecMode.STREAM runs the graph uncaptured")
        try:
            nodes, count = cu_check(drv, drv.cuGraphGetNodes(graph, 0), "cuGraphGetNodes")
            nodes, _ = cu_check(drv, drv.cuGraphGetNodes(graph, count), "cuGraphGetNodes")
            kernel = drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL
            self.graph_nodes = int(count)
            self.kernel_nodes = sum(cu_check(drv, drv.cuGraphNodeGetType(nd), "cuGraphNodeGetType")
                                    == kernel for nd in nodes)
            exec_ = instantiate(drv, graph)
        except Exception:
            drv.cuGraphDestroy(graph)
            raise
        self._fin = weakref.finalize(self, destroy_graph, exec_, graph)
        self._fin.atexit = False   # at exit the driver frees it with the context, maybe gone by then
        cu_check(drv, drv.cuGraphUpload(exec_, hs[0]), "cuGraphUpload")
        self._exec = exec_
        self.captures += 1
        launch = functools.partial(drv.cuGraphLaunch, exec_, hs[0])
        ok, mode = drv.CUresult.CUDA_SUCCESS, self.mode

        def replay():     # (no reference to self: the finalizer above must be able to run)
            res = launch()
            if res[0] != ok:
                raise RuntimeError(f"run: ExecMode.{mode}: cuGraphLaunch failed: "
                                   f"{_err_name(drv, res[0])}")
        self._launch = replay
