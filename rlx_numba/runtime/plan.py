"""The planning stages of compile() (compiler.py lists them all): legalise, validate, views,
layout, fuse and plan turn a Graph into a Plan; nothing here touches the device."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..ir.graph import Graph
from ..ir.opdef import is_inplace, is_leaf, opdef
from ..ir.ops import fmt
from ..memory import ALIGN, Buffer, MemoryReport, plan
from ..passes import fusion as fusion_pass
from . import lower, lower_fft, lower_matmul, lower_vision  # noqa: F401 (their tiers)


@dataclass
class Plan:
    """What the stages before ``bind`` decided about a graph."""
    graph: Graph
    live: set            # node ids that run (or are leaves)
    root: dict           # node id -> node id that owns its memory (views, in-place writes)
    absorbed: set        # transposes read by products through an op-T flag
    strided: set         # narrows read in place (strides) by the element-wise kernels alone
    copied: set          # narrows kept as copies (memory they would view is overwritten later)
    transposed: set      # weight params stored [N, K]
    fusion: object       # passes.fusion.Fusion
    buffers: dict        # root node id -> Buffer (params: a range past the arena, no bytes in it)
    arena_bytes: int
    report: MemoryReport
    # node id -> Buffer of the arena bytes its steps use as scratch, live at its step alone
    # (a half product's f32 result on the numba tier: lower_matmul.f32_scratch_elems)
    scratch: dict = field(default_factory=dict)

    def is_view(self, n) -> bool:
        return views_input(n, self.graph, self.strided, self.copied, self.absorbed)


def views_input(n, graph, strided, copied, absorbed) -> bool:
    """The views stage's rule: ``n`` owns no memory and reads its input's (a plain view, a
    strided narrow not kept as a copy, a transpose products read through an op-T flag)."""
    return ((lower.is_view(n, graph) or n.id in strided) and n.id not in copied
            or n.id in absorbed)


def legalise(graph: Graph, moved: dict | None = None) -> Graph:
    """``graph``, or a copy in which each node whose op picks its tier here (its OpDef's
    ``choose``: the conv family, runtime/lower_vision.py; the FFTs, lower_fft.py) and got a
    tier that rewrites it (im2col / col2im and products, the numba implicit-GEMM node, the
    numba FFT nodes) is rebuilt as that tier's ops. RLX_NUMBA_LOG_FALLBACK=1 logs each choice.
    ``moved`` receives node id -> its Tensor in the copy (nothing when no copy is made)."""
    rewrite = {}
    for n in graph.nodes:
        d = opdef(n.op)
        if d.choose is None:
            continue
        tier, why = d.choose(graph, n)
        lower.log_tier(n, n.op, f"{tier} ({d.tiers[tier].name})", why)
        if d.tiers[tier].rewrite is not None:
            rewrite[n.id] = d.tiers[tier].rewrite
    if not rewrite:
        return graph
    return graph.rewritten(lambda g, n, ins: rewrite[n.id](g, n, ins) if n.id in rewrite
                           else None, moved)


def plan_graph(graph: Graph) -> Plan:
    """The stages legalise .. plan."""
    if not graph.outputs:
        raise ValueError(f"compile: graph {graph.name!r} has no outputs; call set_outputs()")
    graph = legalise(graph)
    outputs = set(graph.outputs)
    live = reachable(graph)
    absorbed = lower_matmul.absorbed_transposes(graph, outputs)
    strided = lower.strided_narrows(graph, outputs)
    transposed = lower_matmul.transposed_weights(graph, outputs)
    copied = set()       # narrows kept as copies: see overwritten_narrows

    def is_view(n):     # (copied and strided change below)
        return views_input(n, graph, strided, copied, absorbed)

    root = aliases(graph, live, is_view)
    copied = overwritten_narrows(graph, live, root)
    if copied:
        strided -= copied
        root = aliases(graph, live, is_view)
    for w in graph.nodes:       # an in-place write must reach the memory it names
        r = graph.nodes[root.get(w.id, w.id)]
        if w.id in live and is_inplace(w.op) and r.op == "narrow":
            raise ValueError(f"compile: {w.op} %{w.id} writes in place into narrow %{r.id} "
                             f"{fmt(r.shape)}, which is a copy here (not a contiguous slice at a "
                             f"{ALIGN}-byte multiple, or what it views is overwritten later), so "
                             f"the write would not reach %{r.inputs[0]}; write into the whole "
                             f"tensor or slice it contiguously at an aligned offset")
    lower.check_inplace(graph, live, root)
    # fused regions and folded epilogues: interior nodes get no buffer and no step, a root
    # lowers as fusion.nodes[id] (the graph itself is not changed)
    fused = fusion_pass.fuse(graph, live, root, is_view, strided)
    buffers, arena_bytes, report, scratch = plan_memory(graph, live, root, fused)
    return Plan(graph, live, root, absorbed, strided, copied, transposed, fused, buffers,
                arena_bytes, report, scratch)


def aliases(graph: Graph, live: set, is_view) -> dict:
    """node id -> the node id owning its memory: views and in-place writes alias input 0."""
    root = {}
    for n in graph.nodes:
        if n.id in live:
            alias = is_view(n) or is_inplace(n.op)
            root[n.id] = root[n.inputs[0]] if alias else n.id
    return root


def overwritten_narrows(graph: Graph, live: set, root: dict) -> set:
    """Narrows that would be views of memory an in-place write (not one through the narrow
    itself) changes later in the graph: read as views they would see the new contents, so
    they stay copies made at their position, as a narrow always was."""
    nodes = graph.nodes

    def through(w, n):          # does w write through n (n on w's alias chain)?
        m = nodes[w.inputs[0]]
        while True:
            if m.id == n.id:
                return True
            if root[m.id] == m.id:
                return False
            m = nodes[m.inputs[0]]

    writes = [w for w in nodes if w.id in live and is_inplace(w.op)]
    return {n.id for n in nodes
            if n.op == "narrow" and n.id in live and root[n.id] != n.id
            and any(w.id > n.id and root[w.id] == root[n.id] and not through(w, n)
                    for w in writes)}


def reachable(graph: Graph) -> set:
    """The outputs' ancestors and every in-place write's, plus every input and param."""
    live, stack = set(), list(graph.outputs) + [n.id for n in graph.nodes if is_inplace(n.op)]
    while stack:
        i = stack.pop()
        if i not in live:
            live.add(i)
            stack.extend(graph.nodes[i].inputs)
    live.update(n.id for n in graph.nodes if n.op in ("input", "param"))
    return live


def plan_memory(graph: Graph, live: set, root: dict, fused):
    """(buffers, arena bytes, MemoryReport, scratch): a buffer lives from the step that writes
    it to its last reader; inputs, constants and outputs for the whole run; a node's scratch
    (``Plan.scratch``) at its own step alone. Params are not in the arena (a ParamStore holds
    them): their Buffers only give them byte ranges of their own, past the arena's, by which
    schedule.py orders steps."""
    nodes = graph.nodes
    order = [n.id for n in nodes if n.id in live]
    t_of = {nid: t for t, nid in enumerate(order)}
    last = len(order)
    outputs = {root[o] for o in graph.outputs}
    bufs, scratch = {}, {}
    views = 0
    for nid in order:
        if nid in fused.interior:
            continue
        n = fused.nodes.get(nid, nodes[nid])   # a fused root reads its region's leaves
        if root[nid] != nid:
            views += 1
        else:
            pinned = is_leaf(n.op) or nid in outputs
            # a node the kernel of its input writes (residual_sum) is live from that step
            by = opdef(n.op).written_by     # filled by its producer's kernel: live from there
            start = t_of[n.inputs[by]] if by is not None else t_of[nid]
            bufs[nid] = Buffer(nid, n.nbytes, start, t_of[nid], pinned)
        extra = 4 * lower_matmul.f32_scratch_elems(graph, n)
        if extra:
            scratch[nid] = Buffer(nid, extra, t_of[nid], t_of[nid])
        for i in n.inputs:   # a read extends the life of the buffer behind the operand
            b = bufs[root[i]]
            b.end = max(b.end, t_of[nid])
    for b in bufs.values():
        if b.pinned:
            b.start, b.end = 0, last
    in_arena = [b for b in bufs.values() if nodes[b.key].op != "param"] + list(scratch.values())
    arena_bytes = top = plan(in_arena)
    for b in bufs.values():
        if nodes[b.key].op == "param":
            b.offset, top = top, top + b.size
    by = {"input": 0, "constant": 0}
    out_b = inter = 0
    for b in in_arena:
        op = nodes[b.key].op
        if op in by:
            by[op] += b.size
        elif b.pinned:
            out_b += b.size
        else:
            inter += b.size
    unshared = sum(b.size for b in in_arena)
    report = MemoryReport(
        arena_bytes=arena_bytes, unshared_bytes=unshared, buffers=len(in_arena), views=views,
        input_bytes=by["input"], constant_bytes=by["constant"], output_bytes=out_b,
        intermediate_bytes=inter, saved_fraction=1 - arena_bytes / unshared if unshared else 0.0)
    return bufs, arena_bytes, report, scratch
