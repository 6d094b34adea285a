"""CudaExecutable: a Program (program.py: what compile() made of a graph: its arena, params
from a ParamStore, bound Steps) with its inputs bound, run and profiled. The compile pipeline
is listed in rlx_numba/compiler.py; its stages live below this module (plan.py, program.py)."""
from __future__ import annotations

import functools
import os
import threading
import warnings

import numpy as np

from ..device import SIMULATOR, gc_paused, in_cuda_context, retry_out_of_memory
from ..ir import dtypes as dt
from ..ir.graph import Graph
from ..ir.ops import fmt
from ..memory import MemoryReport
from ..modes import CompileMode, ExecMode, parse_compile_mode, parse_exec_mode
from . import lower_shape
from .params import ParamStore, check_store
from .program import Program, build_program, storage

@functools.cache
def _driver():
    from cuda.bindings import driver
    return driver


def _as_device_array(x):
    """x as a numba device array if it lives on the device (numba array, or anything with the
    CUDA Array Interface: torch, cupy), else None."""
    if SIMULATOR:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        return x if isinstance(x, FakeCUDAArray) else None
    from numba import cuda
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    if isinstance(x, DeviceNDArray):
        return x
    return cuda.as_cuda_array(x) if cuda.is_cuda_array(x) else None


def _pitched(a):
    """(rows, row bytes, pitch) when device array ``a`` is rows of contiguous bytes lying a
    fixed pitch apart (what one 2-D copy reads), else None."""
    dims = [(n, st) for n, st in zip(a.shape, a.strides) if n != 1]
    if not dims:
        return None
    (rows, pitch), width = dims[0], a.dtype.itemsize
    for n, st in reversed(dims[1:]):
        if st != width:
            return None
        width *= n
    return (rows, width, pitch) if pitch >= width else None


def _empty_device(shape, dtype):
    """A zero-size device array of the output's shape (no memory behind it)."""
    from numba import cuda
    return cuda.device_array(shape, dtype)


def _from_python(name, node, value) -> np.ndarray:
    """A run() input given as a Python scalar or (nested) list, as an array of the input's
    dtype: only where no value changes kind (floats are never truncated to an integer input)
    and integers fit; anything else raises naming the input."""
    want = f"run: input {name!r} ({node.dtype} {fmt(node.shape)})"
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError) as e:      # ragged lists and the like
        raise ValueError(f"{want}: cannot read {type(value).__name__} as an array: {e}") from None
    kinds = "biuf" if node.dtype.is_float else "bui" if node.dtype.kind != "bool" else "b"
    if arr.dtype == np.dtype(node.dtype.host):   # e.g. a NumPy scalar of bf16 / fp8 (kind "V")
        return arr
    if arr.dtype.kind not in kinds:
        raise ValueError(f"{want}: got {type(value).__name__} {value!r:.60} ({arr.dtype}); "
                         f"pass {node.dtype} values (a NumPy array of {node.dtype.host})")
    host = np.dtype(node.dtype.host)
    if arr.dtype.kind in "ui" and host.kind in "ui" and arr.size and (
            arr.min() < np.iinfo(host).min or arr.max() > np.iinfo(host).max):
        raise ValueError(f"{want}: values {arr.min()} .. {arr.max()} do not fit {node.dtype}")
    return arr.astype(host)


@retry_out_of_memory
@gc_paused
@in_cuda_context
def compile_graph(graph, compile_mode=CompileMode.JIT, exec_mode=ExecMode.STREAM,
                  params: ParamStore | None = None, stream=None) -> "CudaExecutable":
    """What ``rlx_numba.compile`` (compiler.py) and ``CudaExecutable.compile_with`` do: parse
    the modes, check the store, build the Program and bind it."""
    cm, em = parse_compile_mode(compile_mode), parse_exec_mode(exec_mode)
    check_store(params)
    return CudaExecutable(build_program(graph, cm, em, params, stream))


class CudaExecutable:
    """A compiled graph: a Program (an arena, params bound from a ParamStore, bound Steps)
    and run(). Made by ``rlx_numba.compile`` (compiler.py)."""

    def __init__(self, program, compile_mode=CompileMode.JIT, exec_mode=ExecMode.STREAM,
                 params: ParamStore | None = None, stream=None):
        if isinstance(program, Graph):   # CudaExecutable(graph, ...): the pre-compiler.py way
            warnings.warn("CudaExecutable(graph, ...) is deprecated: use rlx_numba.compile(graph, "
                          "...) or CudaExecutable.compile_with", DeprecationWarning, stacklevel=2)
            compile_mode, exec_mode = parse_compile_mode(compile_mode), parse_exec_mode(exec_mode)
            check_store(params)
            program = build_program(program, compile_mode, exec_mode, params, stream)
        if not isinstance(program, Program):
            raise TypeError(f"CudaExecutable: expected a Program (use rlx_numba.compile), got "
                            f"{type(program).__name__}")
        self.program = program
        self._run_lock = threading.RLock()   # one run at a time: runs share the arena
        ctx = self._ctx = program.ctx
        graph = self.graph = program.graph
        self.plan = program.plan
        self.compile_mode, self.exec_mode = program.compile_mode, program.exec_mode
        self.params, self.stream = program.params, program.stream
        self._outputs = ctx.outputs
        self._stream_handle = 0 if SIMULATOR else int(self.stream)   # the CUstream, for _memcpy
        self.absorbed, self.transposed, self.fusion = ctx.absorbed, ctx.transposed, ctx.fusion
        self.strided = ctx.strided             # strided narrows: views element-wise kernels read
        self._root = ctx.roots
        self.buffers, self.arena_bytes, self._report = ctx.buffers, ctx.arena_bytes, ctx.report
        self.arena = ctx.arena
        self._params = ctx.param_nodes
        self._inputs = {n.name: n for n in graph.nodes if n.op == "input"}
        # device addresses of the inputs' slots (run() copies into them with one driver call)
        self._in_ptr = {} if SIMULATOR else {
            n.id: ctx.bufs[n.id].device_ctypes_pointer.value for n in self._inputs.values()}
        self._unset = {name for name, n in self._params.items() if not self._entry(n).is_set}
        self._views = {}                     # output node id -> its arena view (run "view")
        self._runner = None                  # GRAPH / MULTISTREAM: see cudagraph.py
        self._ran = False                    # run() has returned once (see _first_run)
        if self.exec_mode.kind in ("graph", "multistream"):
            from .cudagraph import runner_for
            self._runner = runner_for(self)

    @classmethod
    def compile_with(cls, graph, compile_mode=CompileMode.JIT, exec_mode=ExecMode.STREAM,
                     params: ParamStore | None = None, stream=None):
        """The contract's spelling of ``rlx_numba.compile`` (compiler.py)."""
        return compile_graph(graph, compile_mode, exec_mode, params, stream)

    # the program's steps and memory, as this executable runs them
    @property
    def steps(self) -> list:
        return self.program.steps

    @property
    def runner(self):
        """What runs the steps in GRAPH and MULTISTREAM modes (runtime/cudagraph.py: its
        ``schedule``, ``streams``, ``kernel_nodes``, ``captures`` and ``run()``, which enqueues
        one run with the inputs already bound); None in STREAM and EAGER, and for every mode
        in the simulator."""
        return self._runner

    @property
    def _loop_steps(self) -> list:
        return self.program.loop_steps

    @property
    def _node_steps(self) -> dict:
        return self.program.node_steps

    @property
    def _extra(self) -> list:
        return self._ctx.extra

    @property
    def _owned(self) -> dict:
        return self._ctx.owned

    @property
    def half_outputs(self) -> dict:
        return self._ctx.half_outputs

    def _entry(self, node):
        return self.params.entry(node)

    def buf(self, node_or_id):
        """The flat device view of a node's storage."""
        return self._ctx.buf(node_or_id)

    def half_param(self, node):
        """(half dtype, device array) when the param ``node`` is stored half (LowerCtx's)."""
        return self._ctx.half_param(node)

    def _check_index_input(self, name, arr):
        if not arr.size:
            return
        lo_v, hi_v = arr.min(), arr.max()
        for lo, hi, what in self._ctx.index_checks[name]:
            if lo_v < lo or hi_v > hi:
                pos = np.unravel_index(int(np.flatnonzero((arr < lo) | (arr > hi))[0]), arr.shape)
                raise IndexError(f"run: {what}: input {name!r} holds index {arr[pos]} at "
                                 f"{list(map(int, pos))}, out of range [{lo}, {hi}]")

    # ---- public API ---------------------------------------------------------------------------
    def memory_report(self) -> MemoryReport:
        by_format: dict = {}
        for n in self._params.values():     # as set now (a half copy appears with set_param_half)
            for k, v in self.params.entry_bytes(self._entry(n)).items():
                by_format[k] = by_format.get(k, 0) + v
        return MemoryReport(self._report, param_bytes_by_format=by_format)

    @property
    def fused_regions(self):
        """[(root node id, [member node ids], generated kernel source)] for each element-wise
        region fused into one kernel (the source is None for an empty tensor: no step). The
        folded epilogues (matmul + bias/activation/residual, residual add + norm) are in
        ``self.fusion.folds``."""
        return [(r, list(reg.members),
                 next((s.info.get("source") for s in self._node_steps[r]), None))
                for r, reg in self.fusion.regions.items()]

    @property
    def input_names(self):
        return list(self._inputs)

    @property
    def param_names(self):
        return list(self._params)

    @property
    def unset_params(self) -> list:
        """The params nobody has set yet (through this executable or another of its store)."""
        return [k for k, n in self._params.items() if not self._entry(n).is_set]

    @in_cuda_context
    def set_param(self, name: str, value) -> None:
        """Copy a weight to the device; checks the name, shape and dtype."""
        node = self._params.get(name)
        if node is None:
            known = ", ".join(self._params) or "none"
            raise ValueError(f"set_param: graph {self.graph.name!r} has no param {name!r} "
                             f"(params: {known})")
        dev = _as_device_array(value)
        if dev is not None:
            self.params.hold_f32(node)      # (after set_param_half: the f32 copies come back)
            self._copy_in(node, dev, "set_param")
            self.params.refresh_layouts(node, node.id in self.transposed, self.stream)
            # other executables of the store run on other streams: the copy must have landed
            self.stream.synchronize()
            self.params.mark_set(node)
        else:
            arr = np.asarray(value)
            if arr.dtype != node.dtype.host and not np.can_cast(arr.dtype, node.dtype.host, "same_kind"):
                raise ValueError(f"set_param {name!r}: dtype {arr.dtype} cannot be converted to the "
                                 f"param's {node.dtype} (shape {fmt(node.shape)})")
            if tuple(arr.shape) != node.shape:
                raise ValueError(f"set_param {name!r}: expected shape {fmt(node.shape)}, got "
                                 f"{fmt(arr.shape)}")
            # (no copy when the dtype matches: the host value is only read, during this call)
            self.params.set_host(node, arr.astype(node.dtype.host, copy=False))
        self._unset.discard(name)

    @in_cuda_context
    def get_param(self, name: str) -> np.ndarray:
        """A param's value back from the device as numpy, as it was set (a weight stored
        transposed comes back in its logical shape; a half-stored one as its rounded f32)."""
        node = self._params.get(name)
        if node is None:
            known = ", ".join(self._params) or "none"
            raise ValueError(f"get_param: graph {self.graph.name!r} has no param {name!r} "
                             f"(params: {known})")
        if name in self._unset:
            self._unset = {k for k in self._unset if not self._entry(self._params[k]).is_set}
            if name in self._unset:
                raise ValueError(f"get_param {name!r}: the param was never set")
        self.stream.synchronize()
        return self.params.get_host(node, node.id in self.transposed)

    @in_cuda_context
    def set_param_half(self, name: str, value, dtype: str) -> None:
        """Store an f32 weight on the device as f16 or bf16 (``dtype``): the products that take
        it as their weight then read the half copy (matmul tier 0: half operands, f32
        accumulation; tier 3: the skinny kernel reads it directly). A weight read only by
        products keeps no f32 copy on the device; anything else that reads the param sees the
        half-rounded values as f32. set_param() later goes back to f32."""
        node = self._params.get(name)
        if node is None:
            known = ", ".join(self._params) or "none"
            raise ValueError(f"set_param_half: graph {self.graph.name!r} has no param {name!r} "
                             f"(params: {known})")
        if dtype not in ("f16", "bf16"):
            raise ValueError(f"set_param_half {name!r}: dtype must be 'f16' or 'bf16', got {dtype!r}")
        if node.dtype != dt.F32:
            raise ValueError(f"set_param_half {name!r}: the param is {node.dtype}; only f32 params "
                             f"can be stored half")
        if _as_device_array(value) is not None:
            raise ValueError(f"set_param_half {name!r}: pass a host array (it is rounded on the host)")
        arr = np.asarray(value)
        if tuple(arr.shape) != node.shape:
            raise ValueError(f"set_param_half {name!r}: expected shape {fmt(node.shape)}, got "
                             f"{fmt(arr.shape)}")
        if not np.issubdtype(arr.dtype, np.floating) and arr.dtype != dt.BF16.host:
            raise ValueError(f"set_param_half {name!r}: expected a float array, got {arr.dtype}")
        self.params.set_half(node, arr, dt.dtype(dtype))
        self._unset.discard(name)

    def _copy_in(self, node, src, what, sync=True):
        """Device-to-device copy of a device array into the node's arena slot. ``sync=False``
        (run(wait=False)): the caller keeps src unchanged until the stream has read it."""
        if tuple(src.shape) != node.shape:
            raise ValueError(f"{what} {node.name!r}: expected shape {fmt(node.shape)}, got "
                             f"{fmt(src.shape)}")
        if np.dtype(src.dtype) != node.dtype.storage:
            raise ValueError(f"{what} {node.name!r}: expected dtype {node.dtype}, got device "
                             f"array of {src.dtype}")
        if not node.size:
            return
        dst, stored_t = self._ctx.bufs[node.id], node.id in self.transposed
        if stored_t and src.is_f_contiguous() and not src.is_c_contiguous():
            # e.g. torch's linear.weight.t(): its memory already is the [N, K] stored here
            if SIMULATOR:   # (the simulator's arrays copy in logical order)
                dst.copy_to_device(np.ascontiguousarray(src.copy_to_host().T).reshape(-1))
            else:
                self._d2d(dst, src, node, what)
        elif not src.is_c_contiguous():
            rows = None if stored_t else _pitched(src)
            if rows is None:
                how = (" (or F-contiguous: the weight is stored transposed)" if stored_t else
                       " (or rows of contiguous elements a fixed pitch apart)")
                raise ValueError(f"{what} {node.name!r}: device array must be C-contiguous{how}")
            if SIMULATOR:
                dst.copy_to_device(np.ascontiguousarray(src.copy_to_host()).reshape(-1),
                                   stream=self.stream)
            else:
                self._d2d_rows(dst, src, *rows, node, what)
        elif stored_t:
            lower_shape.transpose_matrix(dst, src.reshape(-1), *node.shape, self.stream)
            if sync:
                self.stream.synchronize()    # the caller may free or change src on return
        elif SIMULATOR:
            dst.copy_to_device(src.reshape(-1), stream=self.stream)
        else:
            self._d2d(dst, src, node, what)

    def _d2d(self, dst, src, node, what):
        """dst <- src's node.nbytes as they lie in memory (see _memcpy)."""
        self._memcpy("cuMemcpyDtoDAsync", dst.device_ctypes_pointer.value,
                     src.device_ctypes_pointer.value, node, f"{what} {node.name!r}")

    def _d2d_rows(self, dst, src, rows, width, pitch, node, what):
        """dst <- ``rows`` rows of ``width`` bytes lying ``pitch`` bytes apart in src (a column
        of a matrix, or i64 ids' low words read as i32): one cuMemcpy2DAsync, no kernel."""
        drv = _driver()
        cp = drv.CUDA_MEMCPY2D()
        cp.srcMemoryType = cp.dstMemoryType = drv.CUmemorytype.CU_MEMORYTYPE_DEVICE
        cp.srcDevice, cp.srcPitch = src.device_ctypes_pointer.value, pitch
        cp.dstDevice, cp.dstPitch = dst.device_ctypes_pointer.value, width
        cp.WidthInBytes, cp.Height = width, rows
        err, = drv.cuMemcpy2DAsync(cp, self._stream_handle)
        if err != drv.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{what} {node.name!r}: cuMemcpy2DAsync failed: {err}")

    def _memcpy(self, copy, dst, src, node, what):
        """One driver copy of node.nbytes queued on the executable's stream (numba's
        copy_to_device costs tens to ~160 us of checks and views a call; a decode step copies
        three small inputs a token)."""
        drv = _driver()
        err, = getattr(drv, copy)(dst, src, node.nbytes, self._stream_handle)
        if err != drv.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{what}: {copy} failed: {err}")

    def _bind_input(self, name, value, wait=True):
        node = self._inputs[name]
        dev = _as_device_array(value)
        if dev is not None:
            return self._copy_in(node, dev, "run: input", sync=wait)
        arr = value if isinstance(value, np.ndarray) else _from_python(name, node, value)
        if arr.dtype != node.dtype.host:
            raise ValueError(f"run: input {name!r} must be {node.dtype} ({node.dtype.host}), got "
                             f"{arr.dtype}; convert it with .astype()")
        if tuple(arr.shape) != node.shape:
            raise ValueError(f"run: input {name!r} must have shape {fmt(node.shape)}, got "
                             f"{fmt(arr.shape)}")
        if name in self._ctx.index_checks:
            self._check_index_input(name, arr)
        if not node.size:
            return
        if SIMULATOR:
            self._ctx.bufs[node.id].copy_to_device(storage(arr, node.dtype), stream=self.stream)
        else:   # from pageable memory the call returns once the bytes are staged
            host = np.ascontiguousarray(arr)
            self._memcpy("cuMemcpyHtoDAsync", self._in_ptr[node.id], host.ctypes.data, node,
                         f"run: input {name!r}")

    def run(self, inputs: dict | None = None, outputs: str = "numpy", wait: bool = True):
        """Run the graph. Returns a list of numpy arrays, or of device arrays with
        ``outputs="device"`` (fresh copies) or ``outputs="view"`` (views into the arena, valid
        until the next run). Device results hold the storage dtype: bf16 comes back as its
        uint16 bit pattern (numba has no bf16 arrays).

        ``wait=False`` (with ``outputs="view"`` only) returns once the input copies and the
        steps are queued on ``self.stream``, without synchronizing it: the views hold the
        results once the stream reaches that point (synchronize it, or wait on an event
        recorded on it after the run) and until the next run. Device inputs are read when the
        stream gets there, so keep them unchanged until then; host inputs are copied before
        run returns. The next run's input copies queue behind this run's steps, so a view may
        be fed straight back as the next run's input (a decode loop that never waits).

        Threads calling run() on one executable at once are served one after the other (the
        runs share the arena); "view" results are then only valid until the other thread's
        run -- give each thread its own executable (``compile_with``) to overlap them."""
        with self._run_lock:
            if self._ran:
                return self._run(inputs, outputs, wait)
            out = self._first_run(inputs, outputs, wait)
            self._ran = True
            return out

    @gc_paused
    @in_cuda_context
    def _first_run(self, inputs, outputs, wait):
        """The first run loads (or compiles) every kernel and packs its launch (JIT), and
        builds and captures a CUDA graph (GRAPH): host work done in one CUDA context scope,
        with the collector paused. Later runs make few numba calls and allocate little."""
        return self._run(inputs, outputs, wait)

    def _run(self, inputs, outputs, wait):
        if outputs not in ("numpy", "device", "view"):
            raise ValueError(f"run: outputs must be 'numpy', 'device' or 'view', got {outputs!r}")
        if not wait and outputs != "view":   # "numpy" and "device" copy the results: they wait
            raise ValueError(f"run: wait=False needs outputs='view', got outputs={outputs!r}")
        self._bind_inputs(inputs or {}, wait)
        trace = os.environ.get("RLX_NUMBA_TRACE")
        if trace:                        # a Chrome/Perfetto trace of this run, step by step
            self._timed().write_trace(trace)
            return self._results(outputs, wait)
        if self._runner is not None:     # the steps on several streams, or a graph replay
            self._runner.run()
            return self._results(outputs, wait)
        eager = self.exec_mode.kind == "eager"
        for step in self._loop_steps:
            step()
            if eager:
                try:
                    self.stream.synchronize()
                except Exception as e:
                    raise RuntimeError(f"run: step {step.name} ({step.kernel_name}) failed: {e}") from e
        return self._results(outputs, wait)

    def profile(self, inputs: dict | None = None, warmup: int = 1):
        """Run once (after ``warmup`` untimed runs, which also compile) and return a Profile:
        per step its kernel or library call, time (CUDA events on a GPU), and achieved GB/s or
        TFLOP/s where the step knows its bytes or FLOPs. ``print()`` it; ``.write_trace(path)``
        writes a Chrome/Perfetto trace."""
        for _ in range(warmup):
            self.run(inputs, outputs="view")
        if warmup:      # the steps one by one too (a graph replay does not launch them)
            self._bind_inputs(inputs or {})
            for s in self.steps:
                s()
        self._bind_inputs(inputs or {})
        return self._timed()

    def _bind_inputs(self, inputs: dict, wait: bool = True) -> None:
        """Check run()'s inputs and params, and copy the inputs into the arena."""
        unknown = [k for k in inputs if k not in self._inputs]
        if unknown:
            raise ValueError(f"run: unknown input(s) {', '.join(map(repr, unknown))}; graph "
                             f"{self.graph.name!r} takes {', '.join(self._inputs) or 'no inputs'}")
        missing = [k for k in self._inputs if k not in inputs]
        if missing:
            raise ValueError(f"run: missing input(s) {', '.join(map(repr, missing))}")
        if self._unset:     # (another executable of the store may have set them since)
            self._unset = {k for k in self._unset if not self._entry(self._params[k]).is_set}
        if self._unset:
            raise ValueError(f"run: param(s) never set: {', '.join(sorted(self._unset))}; call "
                             f"set_param() first")
        for name, value in inputs.items():
            self._bind_input(name, value, wait)

    def _timed(self):
        from ..device import device_info
        from .trace import timed_steps
        from numba import cuda
        return timed_steps(self.steps, self.stream, cuda, self.graph.name, device_info()["name"])

    def _results(self, outputs, wait=True):
        res = []
        for o in self._outputs:
            n = self.graph.nodes[o]
            buf = self._ctx.bufs[o]
            if outputs == "numpy":
                host = buf.copy_to_host(stream=self.stream) if n.size else np.empty(0, n.dtype.storage)
                res.append(host)
            else:
                view = self._views.get(o)
                if view is None:          # the same arena view every run: made once
                    view = self._views[o] = (buf[:n.size].reshape(n.shape) if n.size else
                                             _empty_device(n.shape, buf.dtype))
                res.append(view if outputs == "view" else self._copy_device(view))
        if wait:
            self.stream.synchronize()
        if outputs == "numpy":
            res = [h[:self.graph.nodes[o].size].view(self.graph.nodes[o].dtype.host)
                   .reshape(self.graph.nodes[o].shape) for h, o in zip(res, self._outputs)]
        return res

    def _copy_device(self, view):
        from numba import cuda
        out = cuda.device_array(view.shape, view.dtype, stream=self.stream)
        if view.size:
            out.copy_to_device(view, stream=self.stream)
        return out

    def __repr__(self):
        return (f"CudaExecutable({self.graph.name!r}, {len(self.steps)} steps, "
                f"arena {self.arena_bytes} B, {self.compile_mode.name}, {self.exec_mode})")


def compile(graph, compile_mode="jit", exec_mode="stream", params=None, stream=None):  # noqa: A001
    """Deprecated home of ``rlx_numba.compile`` (compiler.py), kept for code that imports it
    from here."""
    return compile_graph(graph, compile_mode, exec_mode, params, stream)


def eager(graph, inputs=None, params=None):
    """Deprecated home of ``rlx_numba.eager`` (compiler.py)."""
    exe = compile_graph(graph, CompileMode.JIT, ExecMode.EAGER)
    for k, v in (params or {}).items():
        exe.set_param(k, v)
    return exe.run(inputs or {})
