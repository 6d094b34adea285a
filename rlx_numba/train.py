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
- The update is the graph's last node, "optim_update" (ir/ops_optim.py), whose inputs are the
  trainer's buffers (params of the graph, named ``__train__.*``, bound by the TrainStore),
  HYPER, the grads and the trained params; runtime/lower_optim.py lowers it to one
  multi-tensor kernel launch over every param (kernels/optim.py), after a sum-of-squares
  launch when ``clip_grad_norm`` is set. GRAPH mode captures the whole train step (inputs
  aside) as one CUDA graph; ``step()`` writes the new per-step values into the HYPER input
  like any other input.
- Mixed precision (``precision="bf16" | "f16"``): the forward is ``g.autocast(precision)``
  with each cast of a trained param to the half dtype replaced by a param leaf, the param's
  half copy, which the update writes beside the f32 master value (same launch); the half
  copy's gradient reaches the update cast back to f32, as the cast's VJP would. f16 adds
  GradScaler's dynamic loss scaling: the backward starts from loss * scale (a
  ``__train__.loss_scaler`` leaf), the update checks the grads for inf / NaN on the device,
  skips on any and unscales otherwise, and a one-block launch updates the scale.
"""
from __future__ import annotations


import numpy as np

from .ir import dtypes as dt
from .ir.graph import Graph, Tensor
from .ir.opdef import INPLACE, VIEW, opdef, ops_where
from .ir.ops import fmt
from .ir.ops_dist import world
from .memory import ALIGN, MemoryReport
from .modes import parse_compile_mode, parse_exec_mode, parse_precision
from .optim import HYPER_LEN, Optimizer, check_number
from .runtime.executable import CudaExecutable
from .runtime.params import ParamStore
from .runtime.plan import legalise, plan_graph
from .runtime.program import Program

HYPER = "__optim_hyper__"     # the input that carries the optimizer's per-step values


HALF = {"f32": None, "bf16": dt.BF16, "f16": dt.F16}
OWN = "__train__."          # the names of the leaves the trainer adds and owns
SCALER = OWN + "loss_scaler"
LAYOUT_OPS = ("reshape", "transpose")      # cast(op(w)) == op(cast(w)): values only moved


def compile_train(g: Graph, loss: Tensor, optimizer: Optimizer, params=None,
                  exec_mode="graph", clip_grad_norm=None, compile_mode="jit",
                  stream=None, deterministic=False, data_parallel=False, precision="f32",
                  init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5,
                  growth_interval=2000) -> "Trainer":
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
    ``precision``: "f32", or "bf16" / "f16" for mixed precision (torch.autocast + GradScaler):
    the step runs ``g.autocast(precision)``; the params (master weights) and the optimizer
    state stay f32, and the half copies the forward reads (its casts of the params) are
    written by the update, not cast again each step. "f16" adds dynamic loss scaling by
    torch.amp.GradScaler's rules: the loss times the scale (``init_scale``) before the
    backward, the grads divided by it in the update; a step whose grads hold an inf or NaN
    leaves params and state untouched (and does not count as an optimizer step) and scales
    the scale by ``backoff_factor``; ``growth_interval`` clean steps in a row scale it by
    ``growth_factor`` (``Trainer.loss_scale``); GradScaler's defaults and checks.
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
    try:
        precision = parse_precision(precision)
    except ValueError as e:
        raise ValueError(f"compile_train: {e}") from None
    half = HALF[precision]
    scaling = None
    if half == dt.F16:
        init_scale = check_number("compile_train", "init_scale", init_scale, lo=0.0,
                                  lo_open=True)
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) \
                or growth_interval < 1:
            raise ValueError(f"compile_train: growth_interval must be an int >= 1, got "
                             f"{growth_interval!r}")
        growth_factor = check_number("compile_train", "growth_factor", growth_factor, lo=1.0,
                                     lo_open=True)
        backoff_factor = check_number("compile_train", "backoff_factor", backoff_factor,
                                      lo=0.0, hi=1.0, lo_open=True, hi_open=True)
        scaling = (growth_factor, backoff_factor, growth_interval)
    em, cm = parse_exec_mode(exec_mode), parse_compile_mode(compile_mode)
    if em.kind == "multistream" or em.streams > 1:
        raise ValueError(f"compile_train: exec_mode {em} is not supported (the update reads "
                         f"every gradient at once); use 'graph', 'stream' or 'eager'")
    max_norm = None if clip_grad_norm is None else check_number(
        "compile_train", "clip_grad_norm", clip_grad_norm, lo=0.0)
    names = [g.nodes[i].name for i in _trained(g, loss, params)]

    tg, loss_t, halves = _forward(g, loss, half, set(names))
    n_forward = len(tg.nodes)
    grads = _grads(tg, loss_t, names, halves, scaling is not None, deterministic)
    if data_parallel:
        grads = _averaged(tg, grads)
    tg.set_outputs([loss_t] + grads)
    moved: dict = {}
    tg = legalise(tg, moved)   # (the convolutions cuDNN does not run: a copy, other node ids)
    if moved:
        grads, loss_t = [moved[d.id] for d in grads], moved[loss_t.id]
        n_forward = moved[n_forward - 1].id + 1
    stuck = _stuck(tg, grads)
    for k in stuck:         # a gradient that is a param's own memory: the update needs it in
        grads[k] = grads[k] * 1.0           # the arena

    trained = [tg.leaf(n) for n in names]
    copies = half if halves else None       # (no product read a trained param: no copies)
    layout = _Layout([t.node for t in trained], optimizer.states, copies,
                     [halves.get(n) for n in names], scaling is not None)
    rule, hp = optimizer.rule()
    leaves = {name: tg.param(name, shape, dtype) if tg.leaf(name) is None else tg.leaf(name)
              for name, (shape, dtype, _) in layout.slots.items() if name.startswith(OWN)}
    hyper = tg.input(HYPER, (HYPER_LEN,), "f32")
    ins = ([leaves[layout.flat_name], hyper] + [leaves[layout.state_name(s)]
                                                for s in optimizer.states]
           + grads + trained)
    if copies is not None:
        ins.append(leaves[layout.half_name])
    if scaling is not None:
        ins.append(leaves[SCALER])
    update = tg.bind("optim_update", ins, rule=rule, hp=hp, nstates=len(optimizer.states),
                     offsets=tuple(layout.offsets), sizes=tuple(layout.sizes),
                     half_offsets=None if copies is None else tuple(layout.half_offsets),
                     max_norm=max_norm, scaling=scaling)
    tg.set_outputs([loss_t])
    plan = plan_graph(tg)
    # the trainer's buffers are row-major, as the grads
    plan.transposed = plan.transposed - {t.id for t in trained} - {
        tg.leaf(h).id for h in halves.values()}
    store = TrainStore(f"{g.name}.train", layout.slots)     # (its external memory)
    program = Program(plan, cm, em, store, stream)
    program.lower_all()
    exe = CudaExecutable(program)
    return Trainer(g, exe, tg, optimizer, names, layout, plan, n_forward, max_norm,
                   [d.id for d in grads], update, precision, scaling, init_scale, halves)


def _forward(g: Graph, loss: Tensor, half, names: set):
    """(the graph the step runs, its loss, {trained param name: the name of its half copy}):
    a copy of ``g`` (same node ids); for a half precision ``g.autocast(half)`` in which each
    cast of a trained param to ``half`` is a param leaf instead (the update writes it). A
    cast of a layout op of the param (a transpose or reshape: the Hugging Face [out, in]
    weights) becomes that op of the half leaf."""
    if half is None:
        tg = g.copy()
        return tg, tg.tensor(loss.id), {}
    src = g.copy()
    src.set_outputs([src.tensor(loss.id)])       # (autocast keeps the outputs' order)
    ag = src.autocast(half.name)
    halves, leaves = {}, {}

    def expand(h, n, ins):
        if n.op != "cast" or n.dtype != half:
            return None
        chain, p = [], ag.nodes[n.inputs[0]]
        while p.op in LAYOUT_OPS:
            chain.append(p)
            p = ag.nodes[p.inputs[0]]
        if p.op != "param" or p.name not in names:
            return None
        if p.name not in leaves:
            halves[p.name] = OWN + "half." + p.name
            leaves[p.name] = h.param(halves[p.name], p.shape, half)
        t = leaves[p.name]
        for m in reversed(chain):
            t = h.bind(m.op, [t], **m.attrs)
        return t
    moved: dict = {}
    tg = ag.rewritten(expand, moved)
    return tg, moved[ag.outputs[0]], halves


def _grads(tg: Graph, loss: Tensor, names, halves: dict, scaled: bool, deterministic) -> list:
    """The f32 gradient of each trained param: through its f32 uses and (cast back to f32,
    as the cast's VJP) through its half copy; with loss scaling, of loss * scale."""
    y = loss
    if scaled:
        sc = tg.param(SCALER, (3,), "f32")
        scale = tg.reshape(tg.narrow(sc, 0, 0, 1), loss.shape)
        y = (loss if loss.dtype == dt.F32 else tg.cast(loss, "f32")) * scale
    reach = _grad_reachable(tg, y.id)
    wrt, parts = [], []
    for n in names:
        got = []
        for leaf in (tg.leaf(n), tg.leaf(halves[n]) if n in halves else None):
            if leaf is not None and leaf.id in reach:
                got.append(len(wrt))
                wrt.append(leaf)
        parts.append(got)
    gs = tg.grad(y, wrt, deterministic=deterministic)
    out = []
    for got in parts:
        terms = [gs[k] if gs[k].dtype == dt.F32 else tg.cast(gs[k], "f32") for k in got]
        total = terms[0]
        for t in terms[1:]:
            total = total + t
        out.append(total)
    return out


def _stuck(tg: Graph, grads: list) -> list:
    """The indices of the grads whose memory may be a param's (a VJP that hands an operand
    back, seen through views): the update reads grads from the arena."""
    out = []
    for k, d in enumerate(grads):
        n = d.node
        while opdef(n.op).memory in (VIEW, INPLACE) and n.inputs:   # (a narrow may be a copy:
            n = tg.nodes[n.inputs[0]]                               # copied again, harmless)
        if n.op == "param":
            out.append(k)
    return out


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
    """The trainer's device buffers: the flat f32 param buffer (param k at ``offsets[k]``, a
    multiple of 256 bytes), each optimizer state in the same layout, for a half precision the
    half copies in the same layout (``half_offsets[k]``, -1 for a param the forward reads
    only in f32), and with loss scaling the scaler [scale, clean steps, found inf].
    ``slots``: name -> (shape, dtype, flat uint8 device view) of every param the TrainStore
    binds to them: the trained params, their half copies and the update's own leaves."""

    def __init__(self, nodes, states, half, half_names, scaling=False):
        from numba import cuda
        per = ALIGN // (4 if half is None else 2)     # 256-byte aligned in f32 and in half
        self.names = [n.name for n in nodes]
        self.sizes = [n.size for n in nodes]
        self.offsets, top = [], 0
        for n in self.sizes:
            self.offsets.append(top)
            top += -(-max(n, 1) // per) * per
        self.total = top
        ends = self.offsets[1:] + [top]

        def buffer(name, dtype, host=None):
            size = dtype.itemsize
            mem = cuda.to_device(np.zeros(size * top, np.uint8) if host is None else
                                 np.ascontiguousarray(host).view(np.uint8))
            self.slots[name] = ((len(mem) // size,), dtype, mem)
            return mem

        self.slots = {}
        self.flat_name, self.half_name = OWN + "params", OWN + "half"
        self.flat = buffer(self.flat_name, dt.F32)
        self.params = self.flat.view(np.float32)
        for nd, o, e in zip(nodes, self.offsets, ends):
            self.slots[nd.name] = (tuple(nd.shape), dt.F32, self.flat[4 * o:4 * e])
        self.states = [buffer(self.state_name(s), dt.F32).view(np.float32) for s in states]
        self.half_offsets = [-1] * len(nodes)
        self.half_nbytes = 0
        if half is not None:
            hflat = buffer(self.half_name, half)
            self.half_nbytes = len(hflat)
            for k, (nd, o, e, hn) in enumerate(zip(nodes, self.offsets, ends, half_names)):
                if hn is not None:
                    self.half_offsets[k] = o
                    self.slots[hn] = (tuple(nd.shape), half, hflat[2 * o:2 * e])
        self.scaler = buffer(SCALER, dt.F32, np.zeros(3, np.float32)).view(np.float32) \
            if scaling else None

    @staticmethod
    def state_name(state: str) -> str:
        return OWN + state

    @property
    def nbytes(self) -> int:
        return 4 * self.total


class TrainStore(ParamStore):
    """The trainer's ParamStore: the trained params and the update's own leaves are bound to
    the trainer's buffers (``external``: row-major, only the update writes them in place);
    its other params are stored as usual. Another graph may share it (``rlx.compile(g,
    params=tr.exe.params)``: it sees the trained values) as long as it reads the trained
    params row-major."""

    def bind(self, exe, node, transposed: bool, written: bool = False, weight_only=None):
        if self.external(node) is not None:
            if written and not node.name.startswith(OWN):
                raise ValueError(f"compile_train: param {node.name!r} is written in place by "
                                 f"the graph ({', '.join(sorted(ops_where(memory=INPLACE)))}); "
                                 f"it cannot be trained")
            if transposed:
                raise ValueError(f"compile: param {node.name!r} is trained (stored row-major in "
                                 f"the trainer's buffer), and this graph would store it [N, K]; "
                                 f"compile it with its own ParamStore and copy the values with "
                                 f"get_param")
        return super().bind(exe, node, transposed, written, weight_only)


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
                ("half copies", self["half_copy_bytes"]),
                ("gradients", self["grad_bytes"]),
                ("saved for bwd", self["saved_for_backward_bytes"])]
        return "\n".join([super().__str__()] + [f"  {k:<18}{mib(v)}" for k, v in rows])

    __repr__ = __str__


class Trainer:
    """What ``compile_train`` returns: ``step(inputs) -> loss``, ``set_param``, ``get_param``,
    ``set_lr``, ``optimizer_state(name)``, ``memory_report()``, ``profile(inputs)``,
    ``loss_scale``; ``exe`` is the compiled executable (its graph, ``.graph``, is the training
    graph: the forward (autocast for a half ``precision``), the backward and the update node;
    it takes one more input, HYPER, which ``step`` fills), ``params`` the trained params'
    names, ``precision`` the compute precision."""

    def __init__(self, g, exe, tg, optimizer, names, layout, plan, n_forward, max_norm,
                 grad_ids, update, precision, scaling, init_scale, halves):
        self.exe, self.graph, self.optimizer = exe, tg, optimizer
        self.source_graph = g
        self.params = list(names)
        self.precision = precision
        self.clip_grad_norm = max_norm
        self.steps_done = 0           # train steps run
        self.optimizer_steps = 0      # of them, those that updated (f16: not the skipped ones)
        self.update = update          # the optim_update node (Tensor)
        self._lr = optimizer.lr
        self._layout, self._index = layout, {n: k for k, n in enumerate(layout.names)}
        self._halves, self._scaling = halves, scaling
        self._stats = self._memory(plan, n_forward, grad_ids)
        # the trainer's own leaves start set: zero state, and the scaler at init_scale
        for name, (shape, dtype, _) in layout.slots.items():
            if name.startswith(OWN):
                v = np.zeros(shape, dtype.host)
                if name == SCALER:
                    v[0] = init_scale
                exe.set_param(name, v)

    # ---- training ------------------------------------------------------------------------------
    def step(self, inputs: dict | None = None) -> float:
        """Forward, backward and update once; returns this step's loss (before the update,
        unscaled)."""
        loss = self.exe.run(self._with_hyper(inputs, "step"), outputs="view")[0]
        self.steps_done += 1
        d = self.graph.nodes[self.graph.outputs[0]].dtype
        value = float(loss.copy_to_host().reshape(-1).view(d.host)[0])
        if self._scaling is None or not self._scaler()[2]:
            self.optimizer_steps += 1
        return value

    def profile(self, inputs: dict | None = None, warmup: int = 1):
        """``exe.profile`` of the train step (a table per step, the update's included). Every
        run of it trains: warmup + 2 steps (warmup + 1 without warmup), all with the per-step
        values of the next step, and counted in ``steps_done`` and ``optimizer_steps``."""
        prof = self.exe.profile(self._with_hyper(inputs, "profile"), warmup)
        ran = warmup + (2 if warmup else 1)
        self.steps_done += ran
        self.optimizer_steps += ran
        return prof

    def _with_hyper(self, inputs, what):
        inputs = dict(inputs or {})
        if HYPER in inputs:
            raise ValueError(f"{what}: input name {HYPER!r} is reserved for the optimizer")
        inputs[HYPER] = self.optimizer.hyper(self._lr, self.optimizer_steps + 1)
        return inputs

    def _scaler(self) -> np.ndarray:
        self.exe.stream.synchronize()
        return self._layout.scaler.copy_to_host()

    @property
    def loss_scale(self) -> float:
        """The loss scale the next step uses (f16: GradScaler.get_scale(); else 1.0, as a
        disabled GradScaler)."""
        return 1.0 if self._scaling is None else float(self._scaler()[0])

    @property
    def lr(self) -> float:
        return self._lr

    def set_lr(self, lr) -> None:
        """The learning rate from the next step on (read by the update at run time: no
        recompile, and a captured CUDA graph stays valid)."""
        self._lr = self.optimizer.check_lr(lr)

    # ---- params and state ----------------------------------------------------------------------
    def set_param(self, name: str, value) -> None:
        """Set any param of the graph (trained or not); the optimizer state is kept (a
        trained param's half copy is set to its rounding)."""
        self.exe.set_param(name, value)
        half = self._halves.get(name)
        if half is not None:
            h = self.graph.leaf(half).dtype.host
            self.exe.set_param(half, self.exe.get_param(name).astype(h))

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
    def _memory(self, plan, n_forward, grad_ids) -> dict:
        nodes = self.graph.nodes
        order = [n.id for n in nodes if n.id in plan.live]
        first_bwd = next((t for t, nid in enumerate(order) if nid >= n_forward), len(order))
        saved = sum(b.size for b in plan.buffers.values()
                    if b.key < n_forward and not b.pinned and b.end >= first_bwd
                    and nodes[b.key].op != "param")
        grads = {plan.root[i] for i in grad_ids}
        return {"trained_params": len(self.params),
                "trained_param_bytes": self._layout.nbytes,
                "optimizer_state_bytes": self._layout.nbytes * len(self.optimizer.states),
                "half_copy_bytes": self._layout.half_nbytes,
                "grad_bytes": sum(plan.buffers[r].size for r in grads),
                "saved_for_backward_bytes": saved}

    def memory_report(self) -> TrainMemoryReport:
        """The executable's memory report plus trained_param_bytes, optimizer_state_bytes,
        grad_bytes (arena outputs) and saved_for_backward_bytes (forward activations still in
        the arena when the backward starts)."""
        rep = dict(self.exe.memory_report())
        # the trained params and the update's leaves are bound as views into the trainer's
        # buffers: counted there, not twice
        names = set(self._layout.slots)
        rep["param_bytes"] -= sum(n.nbytes for n in self.graph.nodes
                                  if n.op == "param" and n.name in names)
        return TrainMemoryReport({**rep, **self._stats})

    def __repr__(self):
        return (f"Trainer({self.graph.name!r}, {type(self.optimizer).__name__}, "
                f"{len(self.params)} params, {self.steps_done} steps, lr {self._lr:g})")
