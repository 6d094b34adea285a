"""rlx.compile_train: forward + backward + optimizer update as one executable.

    tr = rlx.compile_train(g, loss, optimizer=rlx.optim.AdamW(lr=1e-3), params=None,
                           exec_mode="graph", clip_grad_norm=None)
    tr.set_param("w", w0); loss_value = tr.step({"x": xb, "t": tb}); tr.set_lr(3e-4)

How it is put together:

- The user's graph is left as it was: compile_train copies it (same node ids) and appends to
  the copy the backward (``grad(loss, params)``) and one f32 input, ``HYPER``, that carries
  the optimizer's per-step values (lr, bias corrections). The copy's outputs are the loss and
  the grads, so the memory plan keeps the grads in the arena to the end of the run and the
  activations the backward reads live as long as it reads them (one arena, one plan).
- The trained params live in one flat f32 device buffer owned by the trainer, each at a
  256-byte aligned offset; each optimizer state is a buffer of the same layout. The
  executable binds the params from a ParamStore (``TrainStore``) whose entries for the
  trained params are views into that buffer, so set_param / get_param and every kernel of the
  forward and backward read and write the very bytes the update writes. Trained params are
  stored row-major (never [N, K], see lower_matmul.transposed_weights), the grads' layout.
- The update is the last step of the executable: one multi-tensor kernel launch over every
  param (kernels/optim.py), after a sum-of-squares launch when ``clip_grad_norm`` is set.
  GRAPH mode captures the whole train step (inputs aside) as one CUDA graph; ``step()``
  writes the new per-step values into the HYPER input like any other input.
"""
from __future__ import annotations


import numpy as np

from .ir import dtypes as dt
from .ir.graph import Graph, Tensor
from .ir.opdef import INPLACE, ops_where
from .ir.ops import fmt
from .ir.ops_dist import world
from .kernels import optim as kopt
from .memory import ALIGN, MemoryReport
from .modes import parse_compile_mode, parse_exec_mode
from .optim import HYPER_LEN, Optimizer, check_number
from .runtime import lower, lower_dist
from .runtime.executable import CudaExecutable
from .runtime.params import ParamStore
from .runtime.plan import legalise, plan_graph
from .runtime.program import Program

HYPER = "__optim_hyper__"     # the input that carries the optimizer's per-step values


def compile_train(g: Graph, loss: Tensor, optimizer: Optimizer, params=None,
                  exec_mode="graph", clip_grad_norm=None, compile_mode="jit",
                  stream=None, deterministic=False, data_parallel=False) -> "Trainer":
    """Compile one training step of ``g``: the forward to the scalar ``loss``, its gradient
    with respect to ``params``, and ``optimizer``'s update of them in place.

    ``params``: param Tensors or names of ``g`` (f32); None means every f32 param ``loss``
    depends on (through a differentiable path). ``clip_grad_norm=max_norm`` scales the
    gradients as ``torch.nn.utils.clip_grad_norm_(params, max_norm)`` before the update.
    ``exec_mode``: "graph" (the step captured as one CUDA graph), "stream" or "eager".
    ``deterministic``: the same gradient bits every step for the same inputs (``g.grad``'s:
    embedding gradients summed in index order instead of by atomic adds).
    ``data_parallel``: this process (or in-process rank) is one replica of data-parallel
    training on the current communicator (rlx_numba.distributed): the gradients are averaged
    over the ranks before the update (flattened into buckets of BUCKET_BYTES, one
    all_reduce("avg") a bucket, on a second stream while the backward goes on), so every
    replica makes the same update, the one of the mean of the ranks' losses; ``step``
    returns this rank's loss.
    ``g`` itself is not changed (the backward is appended to a copy of it)."""
    if not isinstance(g, Graph):
        raise ValueError(f"compile_train: g must be a rlx_numba.Graph, got {type(g).__name__}")
    g.check("compile_train", "loss", loss)
    if not loss.dtype.is_float or loss.node.size != 1:
        raise ValueError(f"compile_train: loss must be a float scalar (shape () or (1,)), got "
                         f"{loss!r}")
    if not isinstance(optimizer, Optimizer):
        raise ValueError(f"compile_train: optimizer must be a rlx_numba.optim optimizer (SGD, "
                         f"Adam, AdamW), got {type(optimizer).__name__}")
    em, cm = parse_exec_mode(exec_mode), parse_compile_mode(compile_mode)
    if em.kind == "multistream" or em.streams > 1:
        raise ValueError(f"compile_train: exec_mode {em} is not supported (the update reads "
                         f"every gradient at once); use 'graph', 'stream' or 'eager'")
    max_norm = None if clip_grad_norm is None else check_number(
        "compile_train", "clip_grad_norm", clip_grad_norm, lo=0.0)
    ids = _trained(g, loss, params)

    tg = g.copy()
    wrt = [tg.tensor(i) for i in ids]
    grads = tg.grad(tg.tensor(loss.id), wrt, deterministic=deterministic)
    if data_parallel:
        grads = _averaged(tg, grads)
    hyper = tg.input(HYPER, (HYPER_LEN,), "f32")
    loss_t = tg.tensor(loss.id)
    tg.set_outputs([loss_t] + grads)
    n_forward = len(g.nodes)
    moved: dict = {}
    tg = legalise(tg, moved)   # (the convolutions cuDNN does not run: a copy, other node ids)
    if moved:
        ids = [moved[i].id for i in ids]
        grads, hyper, loss_t = [moved[d.id] for d in grads], moved[hyper.id], moved[loss_t.id]
        n_forward = moved[n_forward - 1].id + 1
    plan = plan_graph(tg)
    stuck = [k for k, d in enumerate(grads) if tg.nodes[plan.root[d.id]].op == "param"]
    if stuck:       # a gradient that is a param's own memory: the update needs it in the arena
        for k in stuck:
            grads[k] = grads[k] * 1.0
        tg.set_outputs([loss_t] + grads)
        plan = plan_graph(tg)
    plan.transposed = plan.transposed - set(ids)     # row-major, like their grads

    layout = _Layout([tg.nodes[i] for i in ids], len(optimizer.states))
    store = TrainStore(f"{g.name}.train", layout.slots)
    program = Program(plan, cm, em, store, stream)
    program.lower_all()
    steps = program.lower_group(hyper.id, lambda ctx: _update_steps(
        ctx, plan, optimizer, layout, [d.id for d in grads], hyper, max_norm), hyper.node)
    steps[:0] = lower_dist.join_steps(program)     # the overlapped all_reduces done
    program.append_group(hyper.id, steps)   # last: the update runs after every other step
    exe = CudaExecutable(program)
    return Trainer(g, exe, tg, optimizer, ids, layout, plan, n_forward, max_norm)


BUCKET_BYTES = 25 << 20     # torch DDP's default bucket


def _averaged(g: Graph, grads: list) -> list:
    """``grads`` averaged over the current communicator's ranks: packed into buckets of up to
    BUCKET_BYTES, last param first (the order the backward finishes them), one in-place
    all_reduce ("avg") a bucket, overlapped with the rest of the backward, then narrowed
    back out of it."""
    buckets, size = [[]], 0
    for k in reversed(range(len(grads))):
        n = grads[k].node.size
        if buckets[-1] and 4 * (size + n) > BUCKET_BYTES:
            buckets.append([])
            size = 0
        buckets[-1].append(k)
        size += n
    w, r = world("compile_train", None, None)
    out = list(grads)
    for ks in buckets:
        flat = [g.reshape(grads[k], (grads[k].node.size,)) for k in ks]
        flat = g.concat(flat, 0) if len(flat) > 1 else flat[0]
        # in place (the bucket lives to the update) and on a second stream: the later
        # buckets' backward runs while NCCL averages this one (runtime/lower_dist.py)
        red = g.bind("all_reduce_inplace", [flat], reduce="avg", world=w, rank=r, overlap=True)
        off = 0
        for k in ks:
            n = grads[k].node.size
            out[k] = g.reshape(g.narrow(red, 0, off, n), grads[k].shape)
            off += n
    return out


# ---- which params, the graph copy -------------------------------------------------------------
def _grad_reachable(g: Graph, y: int) -> set:
    """Node ids ``y`` depends on through float nodes and no stop_gradient."""
    seen, stack = {y}, [y]
    while stack:
        n = g.nodes[stack.pop()]
        if n.op == "reshape" and n.attrs.get("stop_gradient"):
            continue
        for i in n.inputs:
            if i not in seen and g.nodes[i].dtype.is_float:
                seen.add(i)
                stack.append(i)
    return seen


def _trained(g: Graph, loss: Tensor, params) -> list:
    """The node ids of the params to train (see compile_train)."""
    reach = _grad_reachable(g, loss.id)
    all_params = [n for n in g.nodes if n.op == "param"]
    if params is None:
        ids = [n.id for n in all_params if n.dtype == dt.F32 and n.id in reach]
        if not ids:
            raise ValueError(f"compile_train: loss {loss!r} depends on no f32 param of graph "
                             f"{g.name!r} (params: "
                             f"{', '.join(f'{n.name} {n.dtype}' for n in all_params) or 'none'})")
        return ids
    if isinstance(params, (str, Tensor)):
        params = [params]
    ids = []
    for k, p in enumerate(params):
        if isinstance(p, str):
            leaf = g.leaf(p)
            nid = None if leaf is None else leaf.id
            if nid is None or g.nodes[nid].op != "param":
                raise ValueError(f"compile_train: graph {g.name!r} has no param {p!r} (params: "
                                 f"{', '.join(n.name for n in all_params) or 'none'})")
        elif isinstance(p, Tensor):
            g.check("compile_train", f"params[{k}]", p)
            nid = p.id
            if p.node.op != "param":
                raise ValueError(f"compile_train: params[{k}] {p!r} is not a param (it is a "
                                 f"{p.node.op} node)")
        else:
            raise ValueError(f"compile_train: params[{k}] must be a param Tensor or its name, "
                             f"got {type(p).__name__}")
        n = g.nodes[nid]
        if n.dtype != dt.F32:
            raise ValueError(f"compile_train: param {n.name!r} is {n.dtype} {fmt(n.shape)}; only "
                             f"f32 params can be trained")
        if nid in ids:
            raise ValueError(f"compile_train: param {n.name!r} is listed twice in params")
        if nid not in reach:
            raise ValueError(f"compile_train: loss {loss!r} does not depend on param {n.name!r} "
                             f"(no differentiable path); leave it out of params")
        ids.append(nid)
    return ids




# ---- device layout ----------------------------------------------------------------------------
class _Layout:
    """The flat param buffer and the optimizer state buffers: param k at ``offsets[k]`` (f32
    elements, a multiple of 256 bytes) in each."""

    def __init__(self, nodes, nstates: int):
        from numba import cuda
        per = ALIGN // 4
        self.names = [n.name for n in nodes]
        self.sizes = [n.size for n in nodes]
        self.offsets, top = [], 0
        for n in self.sizes:
            self.offsets.append(top)
            top += -(-max(n, 1) // per) * per
        self.total = top
        self.flat = cuda.to_device(np.zeros(4 * top, np.uint8))
        self.params = self.flat.view(np.float32)
        ends = self.offsets[1:] + [top]
        self.slots = {nd.name: (tuple(nd.shape), self.flat[4 * o:4 * e])
                      for nd, o, e in zip(nodes, self.offsets, ends)}
        self.state = cuda.to_device(np.zeros(max(1, nstates * top), np.float32))
        self.states = [self.state[s * top:(s + 1) * top] for s in range(nstates)]

    @property
    def nbytes(self) -> int:
        return 4 * self.total


class TrainStore(ParamStore):
    """A ParamStore whose trained params are views into a trainer's flat buffer (row-major,
    never written in place by the graph); its other params are stored as usual. Another graph
    may share it (``rlx.compile(g, params=tr.exe.params)``: it sees the trained values) as
    long as it reads the trained params row-major."""

    def __init__(self, name: str, slots: dict):
        super().__init__(name)
        self._slots = slots           # name -> (shape, flat uint8 view)

    def bind(self, exe, node, transposed: bool, written: bool = False, weight_only=None):
        shape, view = self._slots.get(node.name, (None, None))
        if view is None or (tuple(node.shape), node.dtype) != (shape, dt.F32):
            return super().bind(exe, node, transposed, written, weight_only)
        if written:
            raise ValueError(f"compile_train: param {node.name!r} is written in place by the "
                             f"graph ({', '.join(sorted(ops_where(memory=INPLACE)))}); it cannot be "
                             f"trained")
        if transposed:
            raise ValueError(f"compile: param {node.name!r} is trained (stored row-major in the "
                             f"trainer's buffer), and this graph would store it [N, K]; compile "
                             f"it with its own ParamStore and copy the values with get_param")
        key = (node.name, tuple(node.shape), node.dtype)
        e = self._entries.get(key)
        created = e is None
        if created:
            e = self._new_entry(key, node)
            e.copies[False] = view
        self._use(exe, key, e)
        return e, view, e.nbytes if created else 0     # (the bytes it added: ParamStore.bind)

    def _release(self, key):
        e = self._entries.get(key)
        if e is not None and self._slots.get(e.name, (None, None))[1] is e.copies.get(False):
            e.count -= 1
            if not e.count:        # the trainer owns the bytes: nothing goes back to the pool
                del self._entries[key]
                self._free_halves(e)
            return
        super()._release(key)


def _update_steps(exe, plan, optimizer, layout, grad_ids, hyper, max_norm):
    """The update's Steps: [sum of squares (clip_grad_norm)], the multi-tensor update.
    ``exe``: the program's LowerCtx, as a lowering gets it."""
    graph, root = exe.graph, plan.root
    goffs = []
    for gid in grad_ids:
        off, _ = lower.view_window(graph, gid, root)
        goffs.append(plan.buffers[root[gid]].offset // 4 + off)
    rows = [(o + s, go + s, min(kopt.CHUNK, n - s))
            for o, go, n in zip(layout.offsets, goffs, layout.sizes)
            for s in range(0, n, kopt.CHUNK)]
    nchunks = len(rows)
    table = exe.device_array(np.array(rows or [(0, 0, 0)], np.int64).reshape(-1, 3))
    grads = exe.arena[:plan.arena_bytes].view(np.float32)
    hyper_dev = exe.buf(hyper.node)
    numel = sum(layout.sizes)
    blocks, threads = kopt.grid(nchunks)
    steps, clip = [], None
    if max_norm is not None:
        partials = exe.device_array(np.zeros(max(1, nchunks), np.float32))
        clip = (partials, nchunks, max_norm)
        steps.append(lower.Step(f"%{hyper.id} clip_grad_norm", f"grad_sumsq {numel} over "
                                f"{nchunks} chunks", kopt.grad_sumsq, (blocks,), (threads,),
                                (partials, grads, table, np.int64(nchunks)),
                                {"bytes": 4 * numel}))
    name = type(optimizer).__name__
    for kernel, args in optimizer.launches(layout.params, grads, layout.states, table,
                                           nchunks, hyper_dev, clip):
        nbytes = 4 * numel * (3 + 2 * len(optimizer.states))
        steps.append(lower.Step(f"%{hyper.id} optim.{name.lower()}", f"{kernel.py_func.__name__} "
                                f"{len(layout.sizes)} params, {numel} over {nchunks} chunks",
                                kernel, (blocks,), (threads,), args, {"bytes": nbytes}))
    return steps


# ---- the trainer ------------------------------------------------------------------------------
class TrainMemoryReport(MemoryReport):
    """The executable's memory plan plus the training figures: the trained params' flat
    buffer, the optimizer state, the gradients (arena outputs) and the activations the
    backward keeps (arena bytes live where the forward ends)."""

    def __str__(self) -> str:
        def mib(n):
            return f"{n / 2**20:10.3f} MiB" if n >= 2**16 else f"{n:10d} B  "
        rows = [("trained params", self["trained_param_bytes"]),
                ("optimizer state", self["optimizer_state_bytes"]),
                ("gradients", self["grad_bytes"]),
                ("saved for bwd", self["saved_for_backward_bytes"])]
        return "\n".join([super().__str__()] + [f"  {k:<18}{mib(v)}" for k, v in rows])

    __repr__ = __str__


class Trainer:
    """What ``compile_train`` returns: ``step(inputs) -> loss``, ``set_param``, ``get_param``,
    ``set_lr``, ``optimizer_state(name)``, ``memory_report()``, ``profile(inputs)``; ``exe`` is
    the compiled executable (its graph, ``.graph``, is the training copy with the backward; it
    takes one more input, HYPER, which ``step`` fills), ``params`` the trained params' names."""

    def __init__(self, g, exe, tg, optimizer, ids, layout, plan, n_forward, max_norm):
        self.exe, self.graph, self.optimizer = exe, tg, optimizer
        self.source_graph = g
        self.params = [tg.nodes[i].name for i in ids]
        self.clip_grad_norm = max_norm
        self.steps_done = 0
        self._lr = optimizer.lr
        self._layout, self._index = layout, {n: k for k, n in enumerate(layout.names)}
        self._stats = self._memory(plan, n_forward)

    # ---- training ------------------------------------------------------------------------------
    def step(self, inputs: dict | None = None) -> float:
        """Forward, backward and update once; returns this step's loss (before the update)."""
        loss = self.exe.run(self._with_hyper(inputs, "step"), outputs="view")[0]
        self.steps_done += 1
        return float(loss.copy_to_host().reshape(-1)[0])

    def profile(self, inputs: dict | None = None, warmup: int = 1):
        """``exe.profile`` of the train step (a table per step, the update's included). Every
        run of it trains: warmup + 2 steps (warmup + 1 without warmup), all with the per-step
        values of the next step, and counted in ``steps_done``."""
        prof = self.exe.profile(self._with_hyper(inputs, "profile"), warmup)
        self.steps_done += warmup + (2 if warmup else 1)
        return prof

    def _with_hyper(self, inputs, what):
        inputs = dict(inputs or {})
        if HYPER in inputs:
            raise ValueError(f"{what}: input name {HYPER!r} is reserved for the optimizer")
        inputs[HYPER] = self.optimizer.hyper(self._lr, self.steps_done + 1)
        return inputs

    @property
    def lr(self) -> float:
        return self._lr

    def set_lr(self, lr) -> None:
        """The learning rate from the next step on (read by the update at run time: no
        recompile, and a captured CUDA graph stays valid)."""
        self._lr = self.optimizer.check_lr(lr)

    # ---- params and state ----------------------------------------------------------------------
    def set_param(self, name: str, value) -> None:
        """Set any param of the graph (trained or not); the optimizer state is kept."""
        self.exe.set_param(name, value)

    def get_param(self, name: str) -> np.ndarray:
        return self.exe.get_param(name)

    def optimizer_state(self, name: str) -> dict:
        """A trained param's optimizer state as numpy ({"exp_avg": ..., ...}: torch's keys)."""
        k = self._index.get(name)
        if k is None:
            raise ValueError(f"optimizer_state: {name!r} is not a trained param (trained: "
                             f"{', '.join(self.params)})")
        self.exe.stream.synchronize()
        o, n = self._layout.offsets[k], self._layout.sizes[k]
        shape = self.graph.leaf(name).shape
        return {s: buf[o:o + n].copy_to_host().reshape(shape)
                for s, buf in zip(self.optimizer.states, self._layout.states)}

    # ---- reporting -----------------------------------------------------------------------------
    def _memory(self, plan, n_forward) -> dict:
        nodes = self.graph.nodes
        order = [n.id for n in nodes if n.id in plan.live]
        first_bwd = next((t for t, nid in enumerate(order) if nid >= n_forward), len(order))
        saved = sum(b.size for b in plan.buffers.values()
                    if b.key < n_forward and not b.pinned and b.end >= first_bwd
                    and nodes[b.key].op != "param")
        grads = {plan.root[o] for o in self.graph.outputs[1:]}
        return {"trained_params": len(self.params),
                "trained_param_bytes": self._layout.nbytes,
                "optimizer_state_bytes": self._layout.nbytes * len(self.optimizer.states),
                "grad_bytes": sum(plan.buffers[r].size for r in grads),
                "saved_for_backward_bytes": saved}

    def memory_report(self) -> TrainMemoryReport:
        """The executable's memory report plus trained_param_bytes, optimizer_state_bytes,
        grad_bytes (arena outputs) and saved_for_backward_bytes (forward activations still in
        the arena when the backward starts)."""
        rep = dict(self.exe.memory_report())
        # the trained params are bound as views into the flat buffer: counted there, not twice
        names = set(self.params)
        rep["param_bytes"] -= sum(n.nbytes for n in self.graph.nodes
                                  if n.op == "param" and n.name in names)
        return TrainMemoryReport({**rep, **self._stats})

    def __repr__(self):
        return (f"Trainer({self.graph.name!r}, {type(self.optimizer).__name__}, "
                f"{len(self.params)} params, {self.steps_done} steps, lr {self._lr:g})")
