"""A Program: a planned graph (plan.py) bound to device memory and lowered to ordered Steps.

    LowerCtx   all a lowering sees: the graph, what runs, the memory roots, the outputs, the
               device memory (``buf``), small arrays the steps own, shared scratch, the param
               store's half / f32 copies and the stream
    Program    the ctx plus each node's Steps in graph order; every Step declares the byte
               ranges it reads and writes (schedule.py and cudagraph.py order by them); the
               public hooks a param store and compile_train drive it by

CudaExecutable (executable.py) binds inputs to a Program, runs and profiles it.
"""
from __future__ import annotations

import logging
import sys

import numpy as np

from ..device import SIMULATOR, byte_view
from ..ir import dtypes as dt
from ..ir.opdef import is_inplace, is_leaf, opdef
from ..ir.ops import fmt
from ..modes import CompileMode, ExecMode
from . import (lower, lower_attention, lower_complex, lower_custom, lower_dist,  # noqa: F401
               lower_fft, lower_grouped, lower_linalg,
               lower_loss, lower_lowp, lower_matmul, lower_norm, lower_optim, lower_quant,
               lower_random,
               lower_delta, lower_reduce, lower_rope, lower_sample, lower_scan, lower_shape,
               lower_sort,
               lower_vision)  # (each registers its lowerings)
from . import trace
from .params import ParamStore
from .plan import Plan, plan_graph

log = logging.getLogger("rlx_numba")


def _cuda():
    from numba import cuda
    return cuda


class LowerCtx:
    """What a lowering ``fn(ctx, node) -> [Step, ...]`` is given: the plan's facts, the bound
    memory and the services a step needs (its own small arrays, shared scratch, param copies).
    It allocates the arena, binds the params from the store and uploads the constants."""

    def __init__(self, plan: Plan, params: ParamStore, stream, exec_mode: ExecMode, owner):
        graph = self.graph = plan.graph
        self.plan = plan
        self.live, self.roots = plan.live, plan.root
        self.outputs = list(graph.outputs)   # the graph may grow later; this program won't
        self.absorbed, self.transposed = plan.absorbed, plan.transposed
        self.strided, self.fusion = plan.strided, plan.fusion
        self.buffers, self.arena_bytes, self.report = plan.buffers, plan.arena_bytes, plan.report
        self.params, self.stream, self.exec_mode = params, stream, exec_mode
        cuda = self.cuda = _cuda()
        self.arena = cuda.device_array(max(self.arena_bytes, 1), dtype=np.uint8)
        self.param_nodes = {n.name: n for n in graph.nodes if n.op == "param"}
        self.param_mem = {}                  # param node id -> its flat uint8 store array (or
                                             # None: a half weight's dropped f32 copy, params.py)
        self._bind_params(owner)
        self.bufs = {}                       # node id -> flat device view of its storage
        for nid in self.roots:
            if nid not in self.fusion.interior:
                self.bufs[nid] = self._flat(nid)
        for n in graph.nodes:
            if n.op == "constant" and n.id in self.live and n.size:
                self.bufs[n.id].copy_to_device(storage(n.attrs["value"], n.dtype))
        self.extra = []                      # small device arrays steps own (batch offsets)
        self.owned = {}                      # node id -> those its steps own (a re-plan drops them)
        self.scratch = {}                    # key -> a read-only array several steps pass
        self.index_checks = {}               # input name -> [(lo, hi, what)], see add_index_check
        # node id -> (half dtype, view): a node only products read as their weight that its
        # lowering wrote half into its own buffer (a dequantised weight for tier 0's tensor cores)
        self.half_outputs = {}
        self.node_steps = {}                 # node id -> its bound steps (Program fills it)

    # ---- memory -------------------------------------------------------------------------------
    def _bind_params(self, owner):
        """Bind every param to its store entry (created there, or found: shared). ``owner``
        is what the store calls back when a param's copies change (the Program)."""
        own = shared = 0
        written = {self.roots[n.id] for n in self.graph.nodes
                   if is_inplace(n.op) and n.id in self.live}
        weight_only = lower_matmul.weight_only_params(self.graph, self.absorbed, self.transposed)
        for n in self.param_nodes.values():
            e, mem, added = self.params.bind(owner, n, n.id in self.transposed, n.id in written,
                                             weight_only=n.id in weight_only)
            self.param_mem[n.id] = mem
            if added:
                own += added
            else:               # what the store holds for it (a half weight: its half copy)
                shared += sum(ParamStore.entry_bytes(e).values())
        self.report.update(param_bytes=own, shared_param_bytes=shared)

    def _flat(self, nid):
        n = self.graph.nodes[nid]
        root = self.roots[nid]
        st = n.dtype.storage
        off, count = lower.view_window(self.graph, nid, self.roots)   # narrow views: an offset
        start = off * st.itemsize
        if root in self.param_mem:
            mem = self.param_mem[root]
            if mem is None:               # a half weight's dropped f32 copy (params.py)
                return None
            return byte_view(mem, start, start + count * st.itemsize, st)
        start += self.buffers[root].offset
        return byte_view(self.arena, start, start + count * st.itemsize, st)

    def rebind_param(self, name) -> None:
        """The store dropped or made again the f32 copy of param ``name``: take the new views."""
        node = self.param_nodes.get(name)
        if node is None:
            return
        self.param_mem[node.id] = self.params.entry(node).copies[node.id in self.transposed]
        if hasattr(self, "bufs"):            # (else __init__ makes them next)
            for nid in self.bufs:
                if self.roots[nid] == node.id:
                    self.bufs[nid] = self._flat(nid)

    def scratch_buf(self, node_or_id):
        """The f32 arena view of the scratch the plan gave node ``node_or_id`` (Plan.scratch),
        or None when it has none."""
        b = self.plan.scratch.get(getattr(node_or_id, "id", node_or_id))
        if b is None:
            return None
        return byte_view(self.arena, b.offset, b.offset + b.nbytes, np.float32)

    def byte_range(self, node_or_id):
        """(lo, hi) bytes of the memory behind a node (params: a range past the arena), or
        None for a fused region's interior (no memory)."""
        b = self.buffers.get(self.roots.get(getattr(node_or_id, "id", node_or_id)))
        return (b.offset, b.offset + b.size) if b is not None else None

    # ---- what lowerings call ------------------------------------------------------------------
    def buf(self, node_or_id):
        """The flat device view of a node's storage."""
        nid = getattr(node_or_id, "id", node_or_id)
        b = self.bufs[nid]
        if b is None:      # never a freed copy's bytes
            p = self.graph.nodes[self.roots[nid]]
            raise RuntimeError(
                f"graph {self.graph.name!r}: param {p.name!r} {fmt(p.shape)} is stored "
                f"{self.params.entry(p).half[0]} and holds no f32 copy in this graph's layout "
                f"(only products read it here, from the half copy); a step reading it as f32 "
                f"must ask for it with param_f32()")
        return b

    def is_view(self, n) -> bool:
        """``n`` owns no memory here: it is read through its input's."""
        return self.plan.is_view(n)

    def device_array(self, host):
        """A small device array owned by the node being lowered (e.g. a step's index table)."""
        a = self.cuda.to_device(host)
        self.extra.append(a)
        return a

    def keep(self, arrays) -> None:
        """Keep device arrays a step points at (e.g. cuBLAS pointer tables) alive."""
        self.extra.extend(arrays)

    def shared(self, key, make):
        """One read-only device array per ``key`` for this program, made by ``make()`` the
        first time (the placeholder steps pass for an argument they do not use)."""
        a = self.scratch.get(key)
        if a is None:
            a = self.scratch[key] = self.cuda.to_device(make())
        return a

    def weight_buf(self, node):
        """``buf(node)`` for a product's weight, or None where it has no f32 copy: a half weight
        only products read (see ``half_param`` and ``param_f32``), or a weight dequantised to
        bf16 (``half_outputs``)."""
        return None if node.id in self.half_outputs else self.bufs[node.id]

    def param_f32(self, node):
        """The f32 copy of param ``node`` in this program's layout, made again by the store
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
        half = self.params.entry(node).half
        return None if half is None else (half[0], half[1][node.id in self.transposed])

    def add_index_check(self, node, lo: int, hi: int, what: str) -> None:
        """Have run() check that the index tensor ``node`` holds only values in [lo, hi] when
        it is (a view of) a run() input given as a host array; raises IndexError naming
        ``what`` (the op), the input and the bad value. Device arrays are not checked (that
        would need a sync and a copy): the kernels then clamp or drop bad indices."""
        root = self.graph.nodes[self.roots[getattr(node, "id", node)]]
        if root.op == "input":
            self.index_checks.setdefault(root.name, []).append((lo, hi, what))


def storage(arr, d: dt.DType):
    """A host array as the flat storage of dtype ``d`` (bf16: its uint16 bits)."""
    return np.ascontiguousarray(arr).view(d.storage).reshape(-1)


class Program:
    """A graph lowered for one stream: its LowerCtx (memory) and each node's Steps."""

    def __init__(self, plan: Plan, compile_mode=CompileMode.JIT, exec_mode=ExecMode.STREAM,
                 params: ParamStore | None = None, stream=None):
        self.graph, self.plan = plan.graph, plan
        self.compile_mode, self.exec_mode = compile_mode, exec_mode
        # params live in a store, shared with the other programs compiled against it
        self.params = ParamStore(plan.graph.name) if params is None else params
        # executables that run one after another (a model's graphs) may share a stream, and
        # with it their cuBLAS handle and 32 MiB workspace (one per stream)
        self.stream = _cuda().stream() if stream is None else stream
        self.ctx = LowerCtx(plan, self.params, self.stream, exec_mode, self)
        self.node_steps = self.ctx.node_steps    # node id -> its bound steps, in graph order
        self.steps = None                        # lower_all() makes them
        self.loop_steps = None                   # what run() loops over (see flatten)

    def lower_all(self) -> None:
        """Lower every node that runs to bound Steps (AOT: and compile their kernels)."""
        fusion = self.ctx.fusion
        for n in self.graph.nodes:
            if n.id in self.ctx.live and n.id not in fusion.interior:
                self.node_steps[n.id] = self.lower_node(fusion.nodes.get(n.id, n))
        self.flatten()
        self.compile_steps(self.steps)

    def lower_node(self, n) -> list:
        """``n``'s bound Steps, each declaring the bytes it reads and writes; the device arrays
        they own are kept under ``n.id`` (a re-plan drops them)."""
        return self.lower_group(n.id, lambda ctx: self._lower(n), n)

    def lower_group(self, nid, make, node=None) -> list:
        """``make(ctx)``'s Steps as the group of node ``nid``: bound to the stream, owning the
        arrays ``make`` asked the ctx for, and declaring (besides what ``make`` declared) the
        memory ``node`` reads and writes when given."""
        ctx = self.ctx
        mark = len(ctx.extra)
        steps = [s for s in make(ctx) if s is not None]
        ctx.owned[nid] = ctx.extra[mark:]
        del ctx.extra[mark:]
        if node is not None and steps:
            reads, writes = self._declared(node)
            for s in steps:
                s.reads = _union(s.reads, reads)
                s.writes = _union(s.writes, writes)
        for s in steps:
            s.bind(self.stream, False)
        return steps

    def _lower(self, n):
        if is_leaf(n.op) or self.ctx.is_view(n):
            return []
        return lower.plan_node(self.ctx, n)

    def _declared(self, n):
        """(reads, writes) byte ranges of node ``n``'s kernels: the memory behind its operands
        (through the operands of those computed inside it: views, a fused region's interior)
        and its result, plus its further results, which its kernel fills (a norm's
        residual_sum, rope_kv_write's caches)."""
        g, ctx = self.graph, self.ctx
        lowered = ctx.fusion.nodes          # a fused root: its region's leaves
        results = [r for r in g.nodes[n.id].results   # its further results (Node.results)
                   if r in ctx.live and r not in ctx.fusion.interior]
        writes = [ctx.byte_range(m) for m in [n.id] + results]
        reads, seen = [], set()
        sc = ctx.plan.scratch.get(n.id)     # written by one of its steps, read by the next
        if sc is not None:
            writes.append((sc.offset, sc.offset + sc.size))
            reads.append(writes[-1])

        def read(node):
            for i in node.inputs:
                if i in seen:
                    continue
                seen.add(i)
                r = ctx.byte_range(i)
                if r is not None:
                    reads.append(r)
                m = lowered.get(i, g.nodes[i])
                # a node without steps (a view; a node computed inside its reader's kernel)
                # is read through the memory of its own operands
                if not is_leaf(m.op) and not self.node_steps.get(i) \
                        and opdef(m.op).written_by is None:
                    read(m)
        read(n)
        return reads, [w for w in writes if w is not None]

    def compile_steps(self, steps) -> None:
        """AOT: compile every kernel of ``steps`` now (or load it from the disk cache), under
        a progress bar when someone watches; JIT leaves that to each step's first call."""
        if self.compile_mode is not CompileMode.AOT:
            return
        for s in _progress(steps, f"compile {self.graph.name}"):
            log.info("compile %s: %s %s", self.graph.name, s.name, s.kernel_name)
            s.compile()

    def flatten(self) -> None:
        """``steps`` again from the node groups (a new list: a runner built from the old one
        builds again)."""
        self.steps = [s for steps in self.node_steps.values() for s in steps]
        # what run() loops over: the steps, or with RLX_NUMBA_NVTX=1 each inside an NVTX range
        self.loop_steps = trace.nvtx_wrapped(self.steps)

    def append_group(self, nid, steps) -> None:
        """Put ``steps`` (bound, e.g. from ``lower_group``) last, as node ``nid``'s group: they
        run after every other step (compile_train's update)."""
        self.node_steps.pop(nid, None)
        self.node_steps[nid] = steps
        self.flatten()
        self.compile_steps(steps)

    # ---- what the param store calls (ParamStore.bind's owner) ---------------------------------
    def rebind_param(self, name) -> None:
        """The store dropped or made again the f32 copy of param ``name``: take the new views
        (the products that read them are planned again by the store's set)."""
        self.ctx.rebind_param(name)

    def relower_products_named(self, name) -> None:
        """The store says param ``name`` changed its half copy: plan its products again."""
        node = self.ctx.param_nodes.get(name)
        if node is not None and self.steps is not None:   # lowered
            self.relower_products(node)

    def relower_products(self, param) -> None:
        """Plan again the products whose weight is ``param`` (its storage changed)."""
        g, ctx = self.graph, self.ctx
        for nid in self.node_steps:
            n = ctx.fusion.nodes.get(nid, g.nodes[nid])   # a matmul with a folded epilogue
            if n.op in lower_matmul.PRODUCTS and len(n.inputs) > 1:
                w = g.nodes[n.inputs[1]]
                if w.id in ctx.absorbed:
                    w = g.nodes[w.inputs[0]]
                if w.id == param.id:
                    self.node_steps[nid] = self.lower_node(n)
                    self.compile_steps(self.node_steps[nid])
        self.flatten()


def _union(a, b) -> list:
    return list(a) + [r for r in b if r not in a]


def _progress(items, desc: str):
    """``items`` under a tqdm progress bar on stderr when it is a terminal or this is a
    Jupyter kernel; as they are otherwise (logs and pipes stay clean)."""
    isatty = getattr(sys.stderr, "isatty", None)
    if not ((isatty is not None and isatty()) or "ipykernel" in sys.modules):
        return items
    from tqdm import tqdm
    return tqdm(items, desc=desc, unit="kernel", leave=False, file=sys.stderr)


def build_program(graph, compile_mode: CompileMode, exec_mode: ExecMode,
                  params: ParamStore | None = None, stream=None) -> Program:
    """The stages legalise .. lower (and AOT) of compile(): a lowered Program."""
    program = Program(plan_graph(graph), compile_mode, exec_mode, params, stream)
    program.lower_all()
    return program
