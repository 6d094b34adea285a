"""CudaExecutable: what compile() made of a graph (an arena, params from a ParamStore, bound
Steps), and run(). The compile pipeline itself is rlx_numba/compiler.py."""
from __future__ import annotations

import enum
import functools
import logging
import os
import sys
import warnings
from dataclasses import dataclass

import numpy as np

from ..ir import dtypes as dt
from ..ir.ops import fmt
from ..memory import MemoryReport
from . import (lower, lower_attention, lower_dist, lower_fft, lower_grouped,  # noqa: F401
               lower_loss, lower_matmul, lower_norm, lower_quant, lower_random, lower_reduce,
               lower_rope, lower_sample, lower_scan, lower_shape, lower_sort,
               lower_vision)  # (each registers its lowerings)
from ..device import SIMULATOR
from . import trace
from .params import ParamStore

log = logging.getLogger("rlx_numba")


class CompileMode(enum.Enum):
    JIT = "jit"   # kernels compile on first use
    AOT = "aot"   # every kernel compiled inside compile()


@dataclass(frozen=True)
class ExecMode:
    kind: str
    streams: int = 1

    @staticmethod
    def MULTISTREAM(n: int, graph: bool = False) -> "ExecMode":  # noqa: N802 - the contract's name
        """n streams ordered by events; with ``graph=True`` that is captured into one CUDA
        graph (GRAPH over n streams)."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"ExecMode.MULTISTREAM: n must be a positive int, got {n!r}")
        return ExecMode("graph" if graph else "multistream", n)

    def __str__(self) -> str:
        if self.kind == "graph" and self.streams > 1:
            return f"MULTISTREAM({self.streams}, graph=True)"
        return self.kind.upper() if self.kind != "multistream" else f"MULTISTREAM({self.streams})"


ExecMode.STREAM = ExecMode("stream")    # launches queued on one stream, one sync per run
ExecMode.EAGER = ExecMode("eager")      # a sync after every step: errors point at their step
ExecMode.GRAPH = ExecMode("graph")


def _compile_mode(m) -> CompileMode:
    if isinstance(m, CompileMode):
        return m
    try:
        return CompileMode(str(m).lower())
    except ValueError:
        raise ValueError(f"compile: unknown compile_mode {m!r}; expected 'jit' or 'aot'") from None


def _exec_mode(m) -> ExecMode:
    if isinstance(m, ExecMode):
        return m
    s = str(m).lower()
    if s in ("stream", "eager", "graph"):
        return getattr(ExecMode, s.upper())
    if s.startswith("multistream"):
        digits = s[len("multistream"):].strip("():")
        if digits and not digits.isdigit():
            raise ValueError(f"compile: exec_mode {m!r}: the stream count must be an int")
        return ExecMode.MULTISTREAM(int(digits) if digits else 2)
    raise ValueError(f"compile: unknown exec_mode {m!r}; expected stream, eager, graph or "
                     f"multistream(n)")


def _cuda():
    from numba import cuda
    return cuda


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
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    cuda = _cuda()
    if isinstance(x, DeviceNDArray):
        return x
    return cuda.as_cuda_array(x) if cuda.is_cuda_array(x) else None


class CudaExecutable:
    """A compiled graph: an arena, params bound from a ParamStore, bound Steps, and run().
    Made by ``rlx_numba.compile`` (compiler.py), which plans the graph and lowers it."""

    def __init__(self, plan, compile_mode=CompileMode.JIT, exec_mode=ExecMode.STREAM,
                 params: ParamStore | None = None, stream=None):
        if not hasattr(plan, "graph"):   # CudaExecutable(graph, ...): the pre-compiler.py way
            warnings.warn("CudaExecutable(graph, ...) is deprecated: use rlx_numba.compile(graph, "
                          "...) or CudaExecutable.compile_with", DeprecationWarning, stacklevel=2)
            from ..compiler import plan_graph
            from .params import check_store
            compile_mode, exec_mode = _compile_mode(compile_mode), _exec_mode(exec_mode)
            check_store(params)
            self.__init__(plan_graph(plan), compile_mode, exec_mode, params, stream)
            self.lower_all()
            self.start_runner()
            return
        graph = self.graph = plan.graph
        self.plan = plan
        self.compile_mode, self.exec_mode = compile_mode, exec_mode
        # params live in a store, shared with the other executables compiled against it
        self.params = ParamStore(graph.name) if params is None else params
        self._outputs = list(graph.outputs)  # the graph may grow later; this executable won't
        cuda = _cuda()
        self._cuda = cuda
        # executables that run one after another (a model's graphs) may share a stream, and
        # with it their cuBLAS handle and 32 MiB workspace (one per stream)
        self.stream = cuda.stream() if stream is None else stream
        self._stream_handle = 0 if SIMULATOR else int(self.stream)   # the CUstream, for _memcpy
        self.absorbed, self.transposed, self.fusion = plan.absorbed, plan.transposed, plan.fusion
        self.strided = plan.strided            # strided narrows: views element-wise kernels read
        self._live, self._root = plan.live, plan.root
        self.buffers, self.arena_bytes, self._report = plan.buffers, plan.arena_bytes, plan.report
        self.arena = cuda.device_array(max(self.arena_bytes, 1), dtype=np.uint8)
        nodes = graph.nodes
        self._params = {n.name: n for n in nodes if n.op == "param"}
        self._param_mem = {}                 # param node id -> its flat uint8 store array (or
                                             # None: a half weight's dropped f32 copy, params.py)
        self._bind_params()
        self._bufs = {}                      # node id -> flat device view of its storage
        for nid in self._root:
            if nid not in self.fusion.interior:
                self._bufs[nid] = self._flat(nid)
        self._inputs = {n.name: n for n in nodes if n.op == "input"}
        # device addresses of the inputs' slots (run() copies into them with one driver call)
        self._in_ptr = {} if SIMULATOR else {
            n.id: self._bufs[n.id].device_ctypes_pointer.value for n in self._inputs.values()}
        self._unset = {name for name, n in self._params.items() if not self._entry(n).is_set}
        for n in nodes:
            if n.op == "constant" and n.id in self._live and n.size:
                self._bufs[n.id].copy_to_device(self._storage(n.attrs["value"], n.dtype))
        self._extra = []                     # small device arrays steps own (batch offsets)
        self._owned = {}                     # node id -> those its steps own (a re-plan drops them)
        self._index_checks = {}              # input name -> [(lo, hi, what)], see add_index_check
        self._views = {}                     # output node id -> its arena view (run "view")
        self._node_steps = {}                # node id -> its bound steps, in graph order
        self.steps = None                    # lower_all() makes them
        self._runner = None                  # GRAPH / MULTISTREAM: see cudagraph.py
        # node id -> (half dtype, view): a node only products read as their weight that its
        # lowering wrote half into its own buffer (a dequantised weight for tier 0's tensor cores)
        self.half_outputs = {}

    def lower_all(self) -> None:
        """Lower every node that runs to bound Steps (AOT: and compile their kernels)."""
        for n in self.graph.nodes:
            if n.id in self._live and n.id not in self.fusion.interior:
                self._node_steps[n.id] = self._lower_bound(self.fusion.nodes.get(n.id, n))
        self._flatten_steps()
        self._compile_steps(self.steps)

    def start_runner(self) -> None:
        """GRAPH / MULTISTREAM: the runner that captures or spreads the steps."""
        if self.exec_mode.kind in ("graph", "multistream"):
            from .cudagraph import runner_for
            self._runner = runner_for(self)

    def _lower_bound(self, n):
        mark = len(self._extra)
        steps = [s for s in self._lower(n) if s is not None]
        self._owned[n.id] = self._extra[mark:]
        del self._extra[mark:]
        for s in steps:
            s.bind(self.stream, False)
        return steps

    def _compile_steps(self, steps) -> None:
        """AOT: compile every kernel of ``steps`` now (or load it from the disk cache), under
        a progress bar when someone watches; JIT leaves that to each step's first call."""
        if self.compile_mode is not CompileMode.AOT:
            return
        for s in _progress(steps, f"compile {self.graph.name}"):
            log.info("compile %s: %s %s", self.graph.name, s.name, s.kernel_name)
            s.compile()

    def _flatten_steps(self):
        self.steps: list = [s for steps in self._node_steps.values() for s in steps]
        # what run() loops over: the steps, or with RLX_NUMBA_NVTX=1 each inside an NVTX range
        self._loop_steps = trace.nvtx_wrapped(self.steps)

    @classmethod
    def compile_with(cls, graph, compile_mode=CompileMode.JIT, exec_mode=ExecMode.STREAM,
                     params: ParamStore | None = None, stream=None):
        """The contract's spelling of ``rlx_numba.compile`` (compiler.py, the floor above)."""
        from ..compiler import compile as compile_graph
        return compile_graph(graph, compile_mode, exec_mode, params, stream)

    # ---- compile-time pieces ------------------------------------------------------------------
    def _is_view(self, n) -> bool:
        return self.plan.is_view(n)

    def _bind_params(self):
        """Bind every param to its store entry (created there, or found: shared)."""
        own = shared = 0
        written = {self._root[n.id] for n in self.graph.nodes
                   if n.op in lower.INPLACE and n.id in self._live}
        weight_only = lower_matmul.weight_only_params(self.graph, self.absorbed, self.transposed)
        for n in self._params.values():
            e, mem, added = self.params.bind(self, n, n.id in self.transposed, n.id in written,
                                             weight_only=n.id in weight_only)
            self._param_mem[n.id] = mem
            if added:
                own += added
            else:               # what the store holds for it (a half weight: its half copy)
                shared += sum(ParamStore.entry_bytes(e).values())
        self._report.update(param_bytes=own, shared_param_bytes=shared)

    def _entry(self, node):
        return self.params.entry(node)

    def _flat(self, nid):
        n = self.graph.nodes[nid]
        root = self._root[nid]
        storage = n.dtype.storage
        off, count = lower.view_window(self.graph, nid, self._root)   # narrow views: an offset
        start = off * storage.itemsize
        if root in self._param_mem:
            mem = self._param_mem[root]
            if mem is None:               # a half weight's dropped f32 copy (params.py)
                return None
            return mem[start:start + count * storage.itemsize].view(storage)
        start += self.buffers[root].offset
        return self.arena[start:start + count * storage.itemsize].view(storage)

    def device_array(self, host):
        """A small device array owned by this executable (e.g. a step's index table)."""
        a = self._cuda.to_device(host)
        self._extra.append(a)
        return a

    def keep(self, arrays) -> None:
        """Keep device arrays a step points at (e.g. cuBLAS pointer tables) alive."""
        self._extra.extend(arrays)

    def _rebind_param(self, name) -> None:
        """The store dropped or made again the f32 copy of param ``name``: take the new views
        (the products that read them are planned again by the store's set)."""
        node = self._params.get(name)
        if node is None:
            return
        self._param_mem[node.id] = self._entry(node).copies[node.id in self.transposed]
        if hasattr(self, "_bufs"):           # (else __init__ makes them next)
            for nid in self._bufs:
                if self._root[nid] == node.id:
                    self._bufs[nid] = self._flat(nid)

    def weight_buf(self, node):
        """``buf(node)`` for a product's weight, or None where it has no f32 copy: a half weight
        only products read (see ``half_param`` and ``param_f32``), or a weight dequantised to
        bf16 (``half_outputs``)."""
        return None if node.id in self.half_outputs else self._bufs[node.id]

    def param_f32(self, node):
        """The f32 copy of param ``node`` in this executable's layout, made again by the store
        where set_param_half dropped it (for a product on a tier that reads f32)."""
        self.params.f32_copy(node, node.id in self.transposed)     # (rebinds our views)
        return self.buf(node)

    def half_param(self, node):
        """(half dtype, device array) when the param ``node`` was set by set_param_half, or
        ``node`` is a weight its lowering wrote half (``half_outputs``)."""
        if node.id in self.half_outputs:
            return self.half_outputs[node.id]
        if node.op != "param":
            return None
        half = self._entry(node).half
        return None if half is None else (half[0], half[1][node.id in self.transposed])

    def add_index_check(self, node, lo: int, hi: int, what: str) -> None:
        """Have run() check that the index tensor ``node`` holds only values in [lo, hi] when
        it is (a view of) a run() input given as a host array; raises IndexError naming
        ``what`` (the op), the input and the bad value. Device arrays are not checked (that
        would need a sync and a copy): the kernels then clamp or drop bad indices."""
        root = self.graph.nodes[self._root[getattr(node, "id", node)]]
        if root.op == "input":
            self._index_checks.setdefault(root.name, []).append((lo, hi, what))

    def _check_index_input(self, name, arr):
        if not arr.size:
            return
        lo_v, hi_v = arr.min(), arr.max()
        for lo, hi, what in self._index_checks[name]:
            if lo_v < lo or hi_v > hi:
                pos = np.unravel_index(int(np.flatnonzero((arr < lo) | (arr > hi))[0]), arr.shape)
                raise IndexError(f"run: {what}: input {name!r} holds index {arr[pos]} at "
                                 f"{list(map(int, pos))}, out of range [{lo}, {hi}]")

    def buf(self, node_or_id):
        """The flat device view of a node's storage."""
        nid = getattr(node_or_id, "id", node_or_id)
        b = self._bufs[nid]
        if b is None:      # never a freed copy's bytes
            p = self.graph.nodes[self._root[nid]]
            raise RuntimeError(
                f"graph {self.graph.name!r}: param {p.name!r} {fmt(p.shape)} is stored "
                f"{self._entry(p).half[0]} and holds no f32 copy in this graph's layout (only "
                f"products read it here, from the half copy); a step reading it as f32 must "
                f"ask for it with param_f32()")
        return b

    @staticmethod
    def _storage(arr, d: dt.DType):
        return np.ascontiguousarray(arr).view(d.storage).reshape(-1)

    def _lower(self, n):
        if n.op in ("input", "param", "constant") or self._is_view(n):
            return []
        return lower.plan_node(self, n)

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
            self.params.set_host(node, arr.astype(node.dtype.host))
        self._unset.discard(name)

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

    def _relower_products_named(self, name):
        """The store says param ``name`` changed its half copy: plan its products again."""
        node = self._params.get(name)
        if node is not None and getattr(self, "steps", None) is not None:   # compiled
            self._relower_products(node)

    def _relower_products(self, param):
        """Plan again the products whose weight is ``param`` (its storage changed)."""
        g = self.graph
        for nid in self._node_steps:
            n = self.fusion.nodes.get(nid, g.nodes[nid])   # a matmul with a folded epilogue
            if n.op in lower_matmul.PRODUCTS and len(n.inputs) > 1:
                w = g.nodes[n.inputs[1]]
                if w.id in self.absorbed:
                    w = g.nodes[w.inputs[0]]
                if w.id == param.id:
                    self._node_steps[nid] = self._lower_bound(n)
                    self._compile_steps(self._node_steps[nid])
        self._flatten_steps()

    def _copy_in(self, node, src, what):
        """Device-to-device copy of a device array into the node's arena slot."""
        if tuple(src.shape) != node.shape:
            raise ValueError(f"{what} {node.name!r}: expected shape {fmt(node.shape)}, got "
                             f"{fmt(src.shape)}")
        if np.dtype(src.dtype) != node.dtype.storage:
            raise ValueError(f"{what} {node.name!r}: expected dtype {node.dtype}, got device "
                             f"array of {src.dtype}")
        if not node.size:
            return
        dst, stored_t = self._bufs[node.id], node.id in self.transposed
        if stored_t and src.is_f_contiguous() and not src.is_c_contiguous():
            # e.g. torch's linear.weight.t(): its memory already is the [N, K] stored here
            if SIMULATOR:   # (the simulator's arrays copy in logical order)
                dst.copy_to_device(np.ascontiguousarray(src.copy_to_host().T).reshape(-1))
            else:
                self._d2d(dst, src, node, what)
        elif not src.is_c_contiguous():
            raise ValueError(f"{what} {node.name!r}: device array must be C-contiguous"
                             f"{' (or F-contiguous: the weight is stored transposed)' if stored_t else ''}")
        elif stored_t:
            lower_shape.transpose_matrix(dst, src.reshape(-1), *node.shape, self.stream)
            self.stream.synchronize()    # the caller may free or change src on return
        elif SIMULATOR:
            dst.copy_to_device(src.reshape(-1), stream=self.stream)
        else:
            self._d2d(dst, src, node, what)

    def _d2d(self, dst, src, node, what):
        """dst <- src's node.nbytes as they lie in memory (see _memcpy)."""
        self._memcpy("cuMemcpyDtoDAsync", dst.device_ctypes_pointer.value,
                     src.device_ctypes_pointer.value, node, f"{what} {node.name!r}")

    def _memcpy(self, copy, dst, src, node, what):
        """One driver copy of node.nbytes queued on the executable's stream (numba's
        copy_to_device costs tens to ~160 us of checks and views a call; a decode step copies
        three small inputs a token)."""
        drv = _driver()
        err, = getattr(drv, copy)(dst, src, node.nbytes, self._stream_handle)
        if err != drv.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{what}: {copy} failed: {err}")

    def _bind_input(self, name, value):
        node = self._inputs[name]
        dev = _as_device_array(value)
        if dev is not None:
            return self._copy_in(node, dev, "run: input")
        arr = value if isinstance(value, np.ndarray) else np.asarray(value, dtype=node.dtype.host)
        if arr.dtype != node.dtype.host:
            raise ValueError(f"run: input {name!r} must be {node.dtype} ({node.dtype.host}), got "
                             f"{arr.dtype}; convert it with .astype()")
        if tuple(arr.shape) != node.shape:
            raise ValueError(f"run: input {name!r} must have shape {fmt(node.shape)}, got "
                             f"{fmt(arr.shape)}")
        if name in self._index_checks:
            self._check_index_input(name, arr)
        if not node.size:
            return
        if SIMULATOR:
            self._bufs[node.id].copy_to_device(self._storage(arr, node.dtype), stream=self.stream)
        else:   # from pageable memory the call returns once the bytes are staged
            host = np.ascontiguousarray(arr)
            self._memcpy("cuMemcpyHtoDAsync", self._in_ptr[node.id], host.ctypes.data, node,
                         f"run: input {name!r}")

    def run(self, inputs: dict | None = None, outputs: str = "numpy"):
        """Run the graph. Returns a list of numpy arrays, or of device arrays with
        ``outputs="device"`` (fresh copies) or ``outputs="view"`` (views into the arena, valid
        until the next run). Device results hold the storage dtype: bf16 comes back as its
        uint16 bit pattern (numba has no bf16 arrays)."""
        if outputs not in ("numpy", "device", "view"):
            raise ValueError(f"run: outputs must be 'numpy', 'device' or 'view', got {outputs!r}")
        self._bind_inputs(inputs or {})
        trace = os.environ.get("RLX_NUMBA_TRACE")
        if trace:                        # a Chrome/Perfetto trace of this run, step by step
            self._timed().write_trace(trace)
            return self._results(outputs)
        if self._runner is not None:     # the steps on several streams, or a graph replay
            self._runner.run()
            return self._results(outputs)
        eager = self.exec_mode.kind == "eager"
        for step in self._loop_steps:
            step()
            if eager:
                try:
                    self.stream.synchronize()
                except Exception as e:
                    raise RuntimeError(f"run: step {step.name} ({step.kernel_name}) failed: {e}") from e
        return self._results(outputs)

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

    def _bind_inputs(self, inputs: dict) -> None:
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
            self._bind_input(name, value)

    def _timed(self):
        from ..device import device_info
        from .trace import timed_steps
        return timed_steps(self.steps, self.stream, self._cuda, self.graph.name, device_info()["name"])

    def _results(self, outputs):
        res = []
        for o in self._outputs:
            n = self.graph.nodes[o]
            buf = self._bufs[o]
            if outputs == "numpy":
                host = buf.copy_to_host(stream=self.stream) if n.size else np.empty(0, n.dtype.storage)
                res.append(host)
            else:
                view = self._views.get(o)
                if view is None:          # the same arena view every run: made once
                    view = self._views[o] = buf[:n.size].reshape(n.shape) if n.size else buf[:0]
                res.append(view if outputs == "view" else self._copy_device(view))
        self.stream.synchronize()
        if outputs == "numpy":
            res = [h[:self.graph.nodes[o].size].view(self.graph.nodes[o].dtype.host)
                   .reshape(self.graph.nodes[o].shape) for h, o in zip(res, self._outputs)]
        return res

    def _copy_device(self, view):
        out = self._cuda.device_array(view.shape, view.dtype, stream=self.stream)
        if view.size:
            out.copy_to_device(view, stream=self.stream)
        return out

    def __repr__(self):
        return (f"CudaExecutable({self.graph.name!r}, {len(self.steps)} steps, "
                f"arena {self.arena_bytes} B, {self.compile_mode.name}, {self.exec_mode})")


def _progress(items, desc: str):
    """``items`` under a tqdm progress bar on stderr when it is a terminal or this is a
    Jupyter kernel; as they are otherwise (logs and pipes stay clean)."""
    isatty = getattr(sys.stderr, "isatty", None)
    if not ((isatty is not None and isatty()) or "ipykernel" in sys.modules):
        return items
    from tqdm import tqdm
    return tqdm(items, desc=desc, unit="kernel", leave=False, file=sys.stderr)


def compile(graph, compile_mode="jit", exec_mode="stream", params=None, stream=None):  # noqa: A001
    """Deprecated home of ``rlx_numba.compile`` (compiler.py), kept for code that imports it
    from here."""
    from ..compiler import compile as compile_graph
    return compile_graph(graph, compile_mode, exec_mode, params, stream)


def eager(graph, inputs=None, params=None):
    """Deprecated home of ``rlx_numba.eager`` (compiler.py)."""
    from ..compiler import eager as eager_graph
    return eager_graph(graph, inputs, params)
