"""Lowering: each graph node becomes zero or more Steps with every argument bound ahead.

A Step is one kernel launch: a numba launcher already configured with grid, block and stream,
plus its argument tuple; a CallStep is one library call prepared the same way. run() only
calls them.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import math
import os
import threading
from collections.abc import MutableMapping
from dataclasses import dataclass, field

import numpy as np

from ..ir import dtypes as dt
from ..ir.graph import Graph, Node
from ..ir.opdef import (OPS, VIEW, Tier, add_tier, is_elementwise, is_inplace, ops_where,
                        opdef)
from ..ir.ops_shape import narrow_contiguous, narrow_layout
from ..kernels import codegen
from ..kernels.launch import grid_1d
from ..device import SIMULATOR, in_cuda_context

log = logging.getLogger("rlx_numba")

IDX32_LIMIT = 2**32  # below this many elements, broadcast offsets use magic-number division


def lowering(*ops, tier: str | None = None, available=None):
    """Register ``fn(ctx, node) -> [Step | None, ...]`` as tier ``tier`` (default: the
    function's module and name) of these ops (their OpDef's tiers, tried in the order
    registered: ``plan_node``). ``ctx`` is the program's LowerCtx (program.py):
    ``ctx.graph``, ``ctx.buf(node)`` (flat device view), ``ctx.device_array(host)`` and the
    rest it lists. ``available(ctx, node)``
    returns None when the tier can run the node, else why not."""
    def deco(fn):
        name = tier or f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__.lstrip('_')}"
        for op in ops:
            add_tier(op, Tier(name, fn, available))
        return fn
    return deco


class LoweringTable(MutableMapping):
    """op name -> the plan of its first tier (a view of the OpDefs; tests swap one in)."""

    def __getitem__(self, op):
        if op not in OPS or not OPS[op].tiers:
            raise KeyError(op)
        return OPS[op].tiers[0].plan

    def __setitem__(self, op, fn):
        d = opdef(op)
        if d.tiers:
            d.tiers[0] = dataclasses.replace(d.tiers[0], plan=fn)
        else:
            d.tiers.append(Tier("kernel", fn))

    def __delitem__(self, op):
        self[op]
        OPS[op].tiers.pop(0)

    def __iter__(self):
        return (n for n, d in OPS.items() if d.tiers)

    def __len__(self):
        return sum(1 for _ in self)


LOWERINGS = LoweringTable()


def plan_node(ctx, n) -> list:
    """The steps of node ``n``: its op's first tier that is allowed (the OpDef's
    RLX_NUMBA_*_TIERS variable), available and applies; RLX_NUMBA_LOG_FALLBACK=1 logs the
    tiers passed over and why."""
    d = opdef(n.op)
    if not any(t.plan for t in d.tiers):
        raise NotImplementedError(f"compile: op {n.op!r} (node %{n.id}) has no lowering yet")
    allowed = (env_tiers(d.tier_env, {i: t.name for i, t in enumerate(d.tiers)})
               if d.tier_env else range(len(d.tiers)))
    why = []
    for i, t in enumerate(d.tiers):
        if t.plan is None:      # a rewrite tier: legalise has run it, or it was not chosen
            continue
        if i not in allowed:
            why.append(f"tier {i} ({t.name}) not allowed by {d.tier_env}")
            continue
        reason = t.available(ctx, n) if t.available is not None else None
        if reason is None:
            steps = t.plan(ctx, n)
            if steps is not None:
                if why:
                    log_tier(n, n.op, f"{i} ({t.name})", why)
                return steps
            reason = "does not apply"
        why.append(f"tier {i} ({t.name}): {reason}")
    raise NotImplementedError(f"compile: no tier of {n.op} runs node %{n.id}: " + "; ".join(why))


def log_tier(n, family: str, tier: str, why) -> None:
    """With RLX_NUMBA_LOG_FALLBACK=1, one line: the ``family`` tier that runs node ``n`` and
    why the ones before it did not (every op family logs through here)."""
    if os.environ.get("RLX_NUMBA_LOG_FALLBACK") == "1":
        why = [why] if isinstance(why, str) else list(why)
        log.warning("%s: %s tier %s%s", step_name(n), family, tier,
                    "".join(f"; {w}" for w in why if w))


def env_tiers(var: str, names: dict) -> set:
    """The tiers environment variable ``var`` allows (a comma-separated subset of ``names``:
    tier -> what it is), all of them when it is unset; ValueError naming it otherwise."""
    env = os.environ.get(var)
    if not env:
        return set(names)
    try:
        tiers = {int(t) for t in env.replace(" ", "").split(",") if t}
    except ValueError:
        tiers = set()
    if not tiers or not tiers <= set(names):
        raise ValueError(f"{var}={env!r}: expected a comma-separated subset of "
                         + ", ".join(f"{t} ({w})" for t, w in names.items()))
    return tiers


def step_name(n: Node) -> str:
    return f"%{n.id} {n.op}" + (f".{n.attrs['kind']}" if "kind" in n.attrs else "")


def is_view(node: Node, graph: Graph) -> bool:
    """Nodes that own no memory: they alias their input's buffer (their OpDef's memory kind
    is VIEW and its ``view_if`` holds: a narrow only of an aligned contiguous slice; other
    narrows are views only where ``strided_narrows`` says so, which depends on their
    readers)."""
    d = OPS.get(node.op)
    if d is not None and d.memory == VIEW:
        return d.view_if is None or d.view_if(node, graph)
    return False


def strided_narrows(graph: Graph, live_outputs) -> set:
    """Narrows that are not plain views (``is_view``: strided, or at an offset that cuBLAS
    and vector loads would not take) but which only element-wise kernels read (and which are
    not outputs): those kernels read them in place through their strides and offset
    (codegen's strided inputs, ``view_strides``; scalar loads, any alignment), so the narrow
    is a view and costs no kernel. The fusion pass keeps such a narrow out of the folds whose
    kernels read dense operands (matmul epilogues, norm residuals)."""
    readers: dict[int, list] = {}
    for n in graph.nodes:
        for i in n.inputs:
            readers.setdefault(i, []).append(n)
    return {n.id for n in graph.nodes
            if n.op == "narrow" and n.id not in live_outputs and not is_view(n, graph)
            and readers.get(n.id)
            and all(is_elementwise(m.op) and not is_view(m, graph) for m in readers[n.id])}


def view_strides(ctx, node: Node):
    """Per-dim element strides of a strided narrow view (its input's contiguous strides),
    or None for a node stored contiguously."""
    if node.id not in getattr(ctx, "strided", ()):
        return None
    return contiguous_strides(ctx.graph.nodes[node.inputs[0]].shape)


def view_window(graph: Graph, nid: int, root) -> tuple:
    """(offset, count) in elements of node ``nid``'s storage inside its root's buffer: narrow
    views start at an offset; a strided narrow spans its rows and the gaps between them."""
    n = graph.nodes[nid]
    if n.size == 0:
        return 0, 1
    off, m = 0, n             # (in bytes: a view may change the dtype, c64 <-> f32 pairs)
    while root[m.id] != m.id:
        if m.op == "narrow":
            off += narrow_layout(m, graph)[0] * m.dtype.itemsize
        m = graph.nodes[m.inputs[0]]
    assert off % n.dtype.itemsize == 0, (nid, off)
    off //= n.dtype.itemsize
    count = n.size
    if n.op == "narrow" and root[nid] != nid and not narrow_contiguous(n, graph):
        _, rows, width, stride = narrow_layout(n, graph)
        count = (rows - 1) * stride + width
    return off, count


def check_inplace(graph: Graph, live, root) -> None:
    """Raise ValueError when a node (or an output) reads memory that an INPLACE node already
    overwrote, through a tensor other than that node's result (or a view of it). Steps run in
    graph order, so such a read would see the new contents, not the tensor's own."""
    cur, gen, last = {}, {}, {}   # root -> writes so far; node -> writes it saw; root -> writer

    def read(reader, i):
        r = root[i]
        if gen.get(i, 0) != cur.get(r, 0):
            w = graph.nodes[last[r]]
            raise ValueError(f"compile: {reader} reads %{i} ({graph.nodes[i].op}) after {w.op} "
                             f"%{w.id} overwrote its memory in place; read %{w.id}'s result "
                             f"instead, or build the reader before %{w.id}")

    for n in graph.nodes:
        if n.id not in live:
            continue
        for i in n.inputs:
            read(f"%{n.id} {n.op}", i)
        if is_inplace(n.op):
            r = root[n.id]
            cur[r] = gen[n.id] = cur.get(r, 0) + 1
            last[r] = n.id
        elif root[n.id] != n.id:      # a view: the contents its input had
            gen[n.id] = gen.get(n.inputs[0], 0)
    for k, o in enumerate(graph.outputs):
        read(f"output {k}", o)


@dataclass
class Step:
    name: str                 # "%7 binary.add"
    kernel_name: str
    kernel: object            # the numba dispatcher
    grid: tuple
    block: tuple
    args: tuple
    info: dict = field(default_factory=dict)
    launch: object = None
    shared: int = 0           # bytes of dynamic shared memory (cuda.shared.array(0, ...))
    reads: list = field(default_factory=list)    # (lo, hi) bytes it reads (Program fills them)
    writes: list = field(default_factory=list)   # (lo, hi) bytes it writes
    pdl: bool = False         # a programmatic dependent launch (the kernel calls ptx.grid_wait)

    def bind(self, stream, aot: bool) -> None:
        """Prepare the launch: under the simulator numba's launcher; on a GPU the launch is
        packed once (at the first call, or now when ``aot``) by ``fast_launch``."""
        self._stream = stream
        self.launch = None
        if SIMULATOR:   # configured at every call: the simulator's kernel[grid, block] sets
            # the grid on the kernel object itself, which every executable shares
            self.launch = functools.partial(_sim_launch, self.kernel, self.grid, self.block,
                                            stream, self.args, self.shared)
        elif aot:
            self.compile()

    def compile(self) -> None:
        """Compile the kernel (or load it from the disk cache) and pack the launch, unless
        that is done (always, in the simulator: it compiles nothing)."""
        if self.launch is None:
            self.launch = fast_launch(self.kernel, self.grid, self.block, self._stream, self.args,
                                      self.shared, self.pdl)

    def __call__(self) -> None:
        if self.launch is None:   # JIT: compile on first use
            self.compile()
        self.launch()


def _sim_launch(kernel, grid, block, stream, args, shared=0):
    kernel[grid, block, stream, shared](*args)


@in_cuda_context
def fast_launch(dispatcher, grid, block, stream, args, shared: int = 0, pdl: bool = False):
    """A no-argument callable that enqueues the kernel with these (fixed) arguments.

    numba's ``kernel[grid, block, stream](*args)`` types every argument, finds the overload
    and converts each argument on every call (tens of microseconds of Python a launch). A
    step's arguments never change (arena views and scalars), so all of that is done once
    here: the kernel is compiled for the argument types (by the dispatcher itself, so its
    disk cache is used: ``specialize`` would make a fresh dispatcher without one), the
    arguments are converted to the driver's parameter list by numba's own ``_prepare_args``,
    and packed once more into the ``void *kernelParams[]`` the driver takes, so each call is
    one ctypes ``cuLaunchKernel`` (cuda.core's ``launch`` converted the ~7 values of every
    array argument at each call: 11.0-11.3 us of host time a launch against 8.6-8.9 us now,
    over bench_runtime's block graph on an H100; the rest is the driver call).

    ``pdl``: cuLaunchKernelEx with programmatic stream serialization allowed (the kernel may
    start before the one ahead of it in the stream ends; it must call ptx.grid_wait before
    touching that kernel's data -- kernels/ptx.py). Stream capture keeps it as a programmatic
    edge of the CUDA graph."""

    with _LOAD_LOCK:
        kern = compile_off_thread(dispatcher, tuple(dispatcher.typeof_pyval(a) for a in args))
        if kern.debug or kern.cooperative:    # not expected here; keep numba's full path
            return functools.partial(dispatcher[grid, block, stream, shared], *args)
        kern.bind()   # load the module into the context and set it up, as numba's launch does
        func = int(kern._codelibrary.get_cufunc().handle)
    if shared > 48 << 10:   # past 48 KiB a kernel must opt in to dynamic shared memory
        _set_max_dynamic_shared(func, shared, dispatcher.py_func.__qualname__)
    retr, params = [], []
    for ty, val in zip(kern.argument_types, args):
        kern._prepare_args(ty, val, stream, retr, params)
    if retr:                              # host arrays would need a copy back: not a step's
        raise TypeError("fast_launch: a step argument is a host array")
    grid = tuple(int(v) for v in grid) + (1,) * (3 - len(grid))
    block = tuple(int(v) for v in block) + (1,) * (3 - len(block))
    # numba passes an array as Python ints (pointers and intp sizes: 8 bytes each), scalars
    # as ctypes values and booleans as bools; each gets a slot that lives with the closure
    slots = [p if isinstance(p, ctypes._SimpleCData) else
             ctypes.c_bool(bool(p)) if isinstance(p, (bool, np.bool_)) else ctypes.c_int64(int(p))
             for p in params]
    table = (ctypes.c_void_p * max(1, len(slots)))(*[ctypes.addressof(v) for v in slots])
    name = dispatcher.py_func.__qualname__
    if pdl:
        cfg = _LaunchConfig(*grid, *block, int(shared), ctypes.c_void_p(int(stream)),
                            ctypes.pointer(_PDL_ATTR), 1)
        call, fn = (ctypes.byref(cfg), ctypes.c_void_p(func), table, None), _cu_launch_kernel_ex()
        slots.append(cfg)                 # (kept alive with the closure)
    else:
        call = (ctypes.c_void_p(func), *grid, *block, int(shared),
                ctypes.c_void_p(int(stream)), table, None)
        fn = _cu_launch_kernel()

    def go(fn=fn, call=call, keep=(slots, args)):   # (defaults: fast lookups a launch)
        err = fn(*call)
        if err:
            raise RuntimeError(f"cuLaunchKernel of {name} grid {grid} block {block} failed: "
                               f"CUresult {err}")
    return go


# numba-cuda's module table is not thread-safe: two threads loading the same kernel into one
# context (the ranks of distributed.run_ranks on one GPU) fail with "key already in dictionary"
_LOAD_LOCK = threading.RLock()


def compile_off_thread(dispatcher, sig):
    """``dispatcher.compile(sig)``, on a worker thread when it has to compile: numba-cuda keeps
    the frames of its latest compile alive (seen on an H100; nothing gc can see holds them),
    and on this thread they would reach the caller's locals -- a step's arena views, the
    executable whose run() compiled -- until the next compile. A worker's stack holds only
    the dispatcher and the types."""
    kern = dispatcher.overloads.get(sig)
    if kern is not None:
        return kern
    out = {}

    def work():
        try:
            out["kernel"] = dispatcher.compile(sig)
        except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
            out["error"] = e
    t = threading.Thread(target=work, name="rlx_numba compile")
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["kernel"]


def _set_max_dynamic_shared(func: int, nbytes: int, name: str) -> None:
    """The opt-in past 48 KiB: CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES (8) on the
    handle numba launches. numba-cuda loads modules as libraries, so that handle can be a
    CUkernel (cuLaunchKernel takes either), which cuFuncSetAttribute refuses with
    CUDA_ERROR_INVALID_HANDLE (400); a CUkernel takes cuKernelSetAttribute for the context's
    device. A failure names the kernel, the bytes and the device's opt-in limit."""
    cu = ctypes.CDLL("libcuda.so.1")
    cu.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    call, err = "cuFuncSetAttribute", cu.cuFuncSetAttribute(ctypes.c_void_p(func), 8, int(nbytes))
    dev = ctypes.c_int()
    if err == 400 and hasattr(cu, "cuKernelSetAttribute"):
        call, err = "cuCtxGetDevice", cu.cuCtxGetDevice(ctypes.byref(dev))
        if not err:
            cu.cuKernelSetAttribute.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                                ctypes.c_int]
            call = "cuKernelSetAttribute"
            err = cu.cuKernelSetAttribute(8, int(nbytes), ctypes.c_void_p(func), dev.value)
    if err:
        limit = ctypes.c_int(-1)
        if not cu.cuCtxGetDevice(ctypes.byref(dev)):    # MAX_SHARED_MEMORY_PER_BLOCK_OPTIN (97)
            cu.cuDeviceGetAttribute(ctypes.byref(limit), 97, dev.value)
        raise RuntimeError(f"{name}: {call} for {nbytes} bytes of dynamic shared memory failed: "
                           f"CUresult {err} (this GPU allows {limit.value} bytes a block)")


class _LaunchAttr(ctypes.Structure):
    """CUlaunchAttribute: an id (padded to 8 bytes) and a 64-byte value union."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (cuda.h, CUDA 12+)."""
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttr)), ("n_attrs", ctypes.c_uint)]

    def __init__(self, gx, gy, gz, bx, by, bz, shared, stream, attrs, n):
        super().__init__((ctypes.c_uint * 3)(gx, gy, gz), (ctypes.c_uint * 3)(bx, by, bz),
                         shared, stream, attrs, n)


# CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (6) = 1
_PDL_ATTR = _LaunchAttr(6, b"", 1, b"")


@functools.cache
def _cu_launch_kernel_ex():
    """libcuda's cuLaunchKernelEx (CUDA 12+) through ctypes, as cuLaunchKernel below."""
    fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def pdl_supported() -> bool:
    """Whether products launch as programmatic dependents (kernels/ptx.py grid_wait): on a GPU
    of compute capability 9.0 or newer, unless RLX_NUMBA_PDL=0."""
    if SIMULATOR or os.environ.get("RLX_NUMBA_PDL", "1") == "0":
        return False
    from ..device import device_info
    return tuple(device_info()["cc"]) >= (9, 0)


@functools.cache
def _cu_launch_kernel():
    """libcuda's cuLaunchKernel through ctypes (the driver numba itself has loaded): the
    launch is the hot call, and a ctypes call with ready arguments costs ~1 us where
    cuda.bindings' wrapper re-checks its arguments; its prototype is unchanged since CUDA 4
    (no _v2), so a hand-written one is safe here, unlike cudagraph.py's calls."""
    fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
    u = ctypes.c_uint
    fn.argtypes = [ctypes.c_void_p, u, u, u, u, u, u, u, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


@dataclass
class CallStep:
    """A library call (cuBLAS): ``make(stream)`` prepares it for a stream and returns the
    no-argument callable that enqueues it."""
    name: str
    kernel_name: str
    make: object
    info: dict = field(default_factory=dict)
    launch: object = None
    reads: list = field(default_factory=list)    # as Step's
    writes: list = field(default_factory=list)

    def bind(self, stream, aot: bool) -> None:
        self.launch = self.make(stream)

    def compile(self) -> None:
        """Nothing to compile: a library call is prepared by bind()."""

    def __call__(self) -> None:
        self.launch()


def node_expr(node: Node, graph: Graph):
    """The single-op element-wise expression of a node, its inputs as in0, in1, ..."""
    leaves = tuple(("in", j, graph.nodes[i].dtype) for j, i in enumerate(node.inputs))
    attr = node.attrs.get("kind")
    return (node.op, attr, node.dtype) + leaves


def elementwise_step(name, expr, out, out_shape, ins, in_shapes, in_dtypes,
                     in_strides=None) -> Step | None:
    """A generated element-wise kernel writing ``out`` (flat) from flat inputs ``ins``
    (``in_strides[j]``: input j's per-dim element strides when it is a strided view): the
    vector kernel where ``vector_access`` allows it, else the scalar one."""
    n = math.prod(out_shape)
    if n == 0:
        return None
    modes, dims, strides = codegen.broadcast_layout(out_shape, in_shapes, in_strides)
    idx32 = n < IDX32_LIMIT
    vec = vector_access(expr[2], out, ins, in_dtypes, modes, dims, strides)
    src = codegen.kernel_source(expr, in_dtypes, modes, len(dims), idx32, vec)
    kernel = codegen.load_kernel(src)
    sizes = [n]   # passed as uint64: the kernel's index math is unsigned
    if "bcast" in modes:
        for d in dims[1:]:
            sizes += [d, *codegen.magic_divisor(d)] if idx32 else [d]
        for j, mode in enumerate(modes):
            if mode == "bcast":
                sizes += strides[j]
    args = [out, *ins, *(np.uint64(v) for v in sizes)]
    blocks, threads = grid_1d(n if vec is None else -(-n // codegen.VEC))
    nbytes = n * out.dtype.itemsize + sum(a.size * a.dtype.itemsize for a in ins)
    return Step(name, "elementwise " + codegen.expr_repr(expr) + (f" vec{codegen.VEC}" if vec else ""),
                kernel, (blocks,), (threads,), tuple(args),
                {"source": src, "modes": modes, "dims": dims, "n": n, "bytes": nbytes, "vec": vec})


_HALF = (dt.F16, dt.BF16)
_WIDE = (dt.F16, dt.BF16, dt.F32)    # the dtypes the vector kernel moves 16 bytes at a time


def data_ptr(buf) -> int:
    """The address of a device array's first element (the host array's in the simulator)."""
    return buf.ctypes.data if SIMULATOR else buf.device_ctypes_pointer.value


def _span(buf) -> tuple[int, int]:
    p = data_ptr(buf)
    return p, p + buf.size * buf.dtype.itemsize


def vector_access(out_dtype, out, ins, in_dtypes, modes, dims, strides):
    """How the vector kernel reads each input (codegen.VEC_KINDS), or None for the scalar
    kernel: used where half data moves (a f16/bf16 output or "full" input; f32 alone gains
    little over the scalar kernel's 4-byte loads) and every 16-byte access is legal: the
    output (if f16/bf16/f32) and each full float input 16-byte aligned, else the scalar
    kernel. Bcast inputs never block it: one whose last collapsed dim is contiguous, with
    rows of whole vectors at aligned offsets (the halves of gated's input), is read 16 bytes
    at a time; one broadcast along the last dim (a per-channel bias over H*W) is read once
    for the VEC elements; others element by element. An input that may alias the output
    (in-place epilogues) gets plain loads, not the read-only path."""
    vec = codegen.VEC
    if not (out_dtype in _HALF or any(m == "full" and d in _HALF for m, d in zip(modes, in_dtypes))):
        return None
    if out_dtype in _WIDE and data_ptr(out) % 16:
        return None
    lo, hi = _span(out)
    rows = dims[-1] % vec == 0            # no vector crosses the last dim's rows
    kinds = []
    for a, d, mode, st in zip(ins, in_dtypes, modes, strides):
        if mode == "scalar" or mode == "bcast" and rows and st[-1] == 0:
            kinds.append("one")
            continue
        wide = d in _WIDE and data_ptr(a) % 16 == 0
        if mode == "full" and d in _WIDE and not wide:
            return None
        if mode == "bcast" and not (wide and rows and st[-1] == 1
                                    and all(s % vec == 0 for s in st[:-1])):
            wide = False
        if not wide:
            kinds.append("el")
            continue
        a_lo, a_hi = _span(a)
        kinds.append("vld" if a_lo < hi and lo < a_hi else "ld")
    return tuple(kinds)


# ---- lowering of the element-wise ops --------------------------------------------
def gated_step(name, out, x_buf, x_shape, d, activation, interleaved, x_strides=None,
               residual=None, out_dtype=None) -> Step | None:
    """activation(gate) * up (+ residual) into ``out`` [..., n] as one generated kernel reading
    x [..., 2n] in place: gate and up are two strided inputs over x's buffer (the halves of
    its last axis, or its even and odd entries). x of dtype ``d``; ``out`` and the residual
    of ``out_dtype`` (default d): an f32 x is rounded once to it on the store."""
    od = d if out_dtype is None else out_dtype
    st = list(x_strides) if x_strides is not None else contiguous_strides(x_shape)
    h = x_shape[-1] // 2
    out_shape = tuple(x_shape[:-1]) + (h,)
    pair = st[:-1] + [st[-1] * (2 if interleaved else 1)]
    up = x_buf[st[-1] * (1 if interleaved else h):]
    expr = ("binary", "mul", d, ("activation", activation, d, ("in", 0, d)), ("in", 1, d))
    ins, strides = [x_buf, up], [pair, pair]
    if residual is not None:
        expr = ("binary", "add", d, expr, ("in", 2, od))
        ins.append(residual)
        strides.append(None)
    if od != d:
        expr = ("cast", None, od, expr)
    return elementwise_step(name, expr, out, out_shape, ins, [out_shape] * len(ins),
                            [d, d, od][:len(ins)], strides)


def contiguous_strides(shape) -> list:
    st, acc = [], 1
    for d in reversed(shape):
        st.append(acc)
        acc *= d
    return st[::-1]


@lowering("gated")
def _lower_gated(ctx, n):
    x = ctx.graph.nodes[n.inputs[0]]
    return [gated_step(step_name(n), ctx.buf(n), ctx.buf(x), x.shape, x.dtype,
                       n.attrs["activation"], n.attrs["interleaved"], view_strides(ctx, x))]


@lowering("gated_bwd")
def _lower_gated_bwd(ctx, n):
    """dx of gated (its VJP) as one generated kernel over dx viewed [..., m, 2] (interleaved)
    or [..., 2, m] (halves): a two-entry selector along the pair axis picks d gate =
    activation_grad(dy * up, gate) or d up = dy * activation(gate); gate, up and dy are read
    in place, strided and broadcast along the pair axis (no narrow or concat copies)."""
    dy, x = (ctx.graph.nodes[i] for i in n.inputs)
    act, m, lead = n.attrs["activation"], x.shape[-1] // 2, list(x.shape[:-1])
    st = view_strides(ctx, x) or contiguous_strides(x.shape)
    ds = view_strides(ctx, dy) or contiguous_strides(dy.shape)
    zeros = [0] * len(lead)
    if n.attrs["interleaved"]:
        shape, up_at = tuple(lead + [m, 2]), st[-1]
        pair, dys, sel = st[:-1] + [2 * st[-1], 0], ds[:-1] + [ds[-1], 0], zeros + [0, 1]
    else:
        shape, up_at = tuple(lead + [2, m]), m * st[-1]
        pair, dys, sel = st[:-1] + [0, st[-1]], ds[:-1] + [0, ds[-1]], zeros + [1, 0]
    f = dt.F32
    gate, up, dyv, first = ("in", 0, f), ("in", 1, f), ("in", 2, f), ("in", 3, dt.BOOL)
    expr = ("where", None, f, first,
            ("activation_grad", act, f, ("binary", "mul", f, dyv, up), gate),
            ("binary", "mul", f, dyv, ("activation", act, f, gate)))
    xb = ctx.buf(x)
    pick = ctx.device_array(np.array([True, False]))
    return [elementwise_step(step_name(n), expr, ctx.buf(n), shape,
                             [xb, xb[up_at:], ctx.buf(dy), pick], [shape] * 4, [f, f, f, dt.BOOL],
                             [pair, pair, dys, sel])]


@lowering(*sorted(ops_where(elementwise=True)))
def _lower_elementwise(ctx, n):
    """One op, or a fused region (passes/fusion.py: inputs are the region's leaves, the
    expression in attrs) as one generated kernel."""
    ins = [ctx.graph.nodes[i] for i in n.inputs]
    if n.op == "fused":
        expr = n.attrs["expr"]
        name = f"%{n.id} fused[{' '.join(f'%{m}' for m in n.attrs['members'])}]"
    else:
        expr, name = node_expr(n, ctx.graph), step_name(n)
    return [elementwise_step(name, expr, ctx.buf(n), n.shape, [ctx.buf(i) for i in ins],
                             [i.shape for i in ins], [i.dtype for i in ins],
                             [view_strides(ctx, i) for i in ins])]
