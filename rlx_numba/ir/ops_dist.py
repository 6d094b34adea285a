"""Collectives as graph ops (rlx_numba.distributed): all_reduce, all_gather, reduce_scatter,
broadcast, their OpDefs (ir/opdef.py), argument checks and VJPs. Lowering:
runtime/lower_dist.py (NCCL on the executable's stream, or the in-process communicator of the
simulator and CPU tests).

A graph is built for one rank: ``world_size`` and ``rank`` are the communicator's (the
thread's or process's current one, ``distributed.current()``) unless given. The nodes:
  "all_reduce"      x -> x's shape, every rank's x reduced element-wise (attr op)
  "all_gather"      x -> [world, *x.shape], rank r's x at index r
  "reduce_scatter"  x [world, *rest] -> rest: rank r gets the reduction of every rank's x[r]
  "broadcast"       x -> x's shape, rank ``root``'s x
  "all_reduce_inplace"  all_reduce into x's own memory (memory kind INPLACE), with attr
                    ``overlap``: on a second stream, joined before the optimizer's update
                    (compile_train's data-parallel buckets; no VJP)
The builder methods move ``axis`` with transposes and reshapes around them. Gradients follow
the convention of data- and tensor-parallel training: the loss is the sum of every rank's
loss, so all_reduce(sum)'s VJP is all_reduce(sum), all_gather's is reduce_scatter(sum) and
the other way, broadcast's is the sum of the ranks' gradients at the root (zeros elsewhere).
"""
from __future__ import annotations

import numpy as np

from . import dtypes as dt
from .autodiff import vjp
from .opdef import INPLACE, STORAGE, defop
from .ops import fmt

REDUCE_OPS = ("sum", "avg", "max", "min", "prod")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
# the dtypes NCCL has a type for (bf16 is stored as uint16 and reduced as bfloat16)
NCCL_TYPES = (dt.F32, dt.F16, dt.BF16, dt.I32, dt.I64, dt.I8, dt.U8)


def world(op, world_size, rank):
    """(world_size, rank): the arguments, else the current communicator's."""
    if world_size is None or rank is None:
        from ..device import current_comm
        comm = current_comm()
        if comm is None:
            raise ValueError(f"{op}: no communicator; call rlx_numba.distributed.init() (or "
                             f"build inside distributed.run_ranks) or pass world_size= and rank=")
        world_size = comm.world_size if world_size is None else world_size
        rank = comm.rank if rank is None else rank
    if not isinstance(world_size, (int, np.integer)) or world_size < 1 \
            or not isinstance(rank, (int, np.integer)) or not 0 <= rank < world_size:
        raise ValueError(f"{op}: need world_size >= 1 and 0 <= rank < world_size, got "
                         f"world_size={world_size!r}, rank={rank!r}")
    return int(world_size), int(rank)


def _axis(op, x, axis):
    nd = len(x.shape)
    if not isinstance(axis, (int, np.integer)) or not -nd <= axis < nd:
        raise ValueError(f"{op}: axis {axis!r} out of range for x {x.dtype} {fmt(x.shape)}")
    return int(axis) % nd


def _reduce_op(op, red):
    if red not in REDUCE_OPS:
        raise ValueError(f"{op}: op must be one of {REDUCE_OPS}, got {red!r}")


def _collective(op, x, world, rank, reduce=None):
    """The checks every collective node makes of its operand and attrs."""
    check_dtype(op, x)
    if reduce is not None:
        _reduce_op(op, reduce)
    if (isinstance(world, bool) or not isinstance(world, int) or world < 1
            or isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world):
        raise ValueError(f"{op}: need world >= 1 and 0 <= rank < world, got world={world!r}, "
                         f"rank={rank!r}")


def infer_all_reduce(x, reduce, world, rank):
    _collective("all_reduce", x, world, rank, reduce)
    return x.shape, x.dtype


def infer_all_reduce_inplace(x, reduce, world, rank, overlap=False):
    if not isinstance(overlap, bool):
        raise ValueError(f"all_reduce_inplace: overlap must be a bool, got {overlap!r}")
    _collective("all_reduce_inplace", x, world, rank, reduce)
    return x.shape, x.dtype


def infer_all_gather(x, world, rank):
    _collective("all_gather", x, world, rank)
    return (world,) + tuple(x.shape), x.dtype


def infer_reduce_scatter(x, reduce, world, rank):
    _collective("reduce_scatter", x, world, rank, reduce)
    if not x.shape or x.shape[0] != world:
        raise ValueError(f"reduce_scatter: x must be [world={world}, ...] (one part a rank), "
                         f"got {x.dtype} {fmt(x.shape)}")
    return tuple(x.shape[1:]), x.dtype


def infer_broadcast(x, root, world, rank):
    _collective("broadcast", x, world, rank)
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < world:
        raise ValueError(f"broadcast: root must be a rank in [0, {world}), got {root!r}")
    return x.shape, x.dtype


defop("all_reduce", infer_all_reduce, dtype_rule=STORAGE,
      doc="every rank's x reduced element-wise (reduce: sum avg max min prod)")
defop("all_gather", infer_all_gather, dtype_rule=STORAGE,
      doc="[world, *x.shape]: rank r's x at index r")
defop("reduce_scatter", infer_reduce_scatter, dtype_rule=STORAGE,
      doc="x [world, *rest] -> rest: rank r gets every rank's x[r] reduced")
defop("broadcast", infer_broadcast, dtype_rule=STORAGE, doc="rank root's x on every rank")
defop("all_reduce_inplace", infer_all_reduce_inplace, memory=INPLACE, dtype_rule=STORAGE,
      doc="all_reduce into x's own memory (overlap: on a second stream; compile_train)")


class DistOps:
    """Builder methods; ``self`` is the Graph."""

    def all_reduce(self, x, op: str = "sum", *, world_size=None, rank=None):
        """Every rank's ``x`` reduced element-wise (op "sum", "avg", "max", "min", "prod");
        each rank gets the result."""
        self.check("all_reduce", "x", x)
        check_dtype("all_reduce", x)
        _reduce_op("all_reduce", op)
        w, r = world("all_reduce", world_size, rank)
        return self.bind("all_reduce", [x], reduce=op, world=w, rank=r)

    def all_gather(self, x, axis: int = 0, *, world_size=None, rank=None):
        """The ranks' ``x`` concatenated along ``axis`` in rank order."""
        self.check("all_gather", "x", x)
        check_dtype("all_gather", x)
        w, r = world("all_gather", world_size, rank)
        if not x.shape:
            x = self.reshape(x, (1,))
        a = _axis("all_gather", x, axis)
        y = self.bind("all_gather", [x], world=w, rank=r)
        if a:       # [w, ..., s_a, ...] -> [..., w, s_a, ...]
            perm = tuple(range(1, a + 1)) + (0,) + tuple(range(a + 1, len(x.shape) + 1))
            y = self.transpose(y, perm)
        shape = list(x.shape)
        shape[a] *= w
        return self.reshape(y, tuple(shape))

    def reduce_scatter(self, x, axis: int = 0, op: str = "sum", *, world_size=None, rank=None):
        """The ranks' ``x`` reduced element-wise and split along ``axis`` into world_size
        equal parts: rank r gets part r."""
        self.check("reduce_scatter", "x", x)
        check_dtype("reduce_scatter", x)
        _reduce_op("reduce_scatter", op)
        w, r = world("reduce_scatter", world_size, rank)
        a = _axis("reduce_scatter", x, axis)
        if x.shape[a] % w:
            raise ValueError(f"reduce_scatter: x {x.dtype} {fmt(x.shape)} axis {a} ({x.shape[a]})"
                             f" is not a multiple of world_size {w}")
        part = list(x.shape)
        part[a] //= w
        split = tuple(x.shape[:a]) + (w, part[a]) + tuple(x.shape[a + 1:])
        xs = self.reshape(x, split)
        if a:       # the rank axis first
            perm = (a,) + tuple(range(a)) + tuple(range(a + 1, len(split)))
            xs = self.transpose(xs, perm)
        y = self.bind("reduce_scatter", [xs], reduce=op, world=w, rank=r)
        return self.reshape(y, tuple(part))

    def broadcast(self, x, root: int = 0, *, world_size=None, rank=None):
        """Rank ``root``'s ``x`` on every rank."""
        self.check("broadcast", "x", x)
        check_dtype("broadcast", x)
        w, r = world("broadcast", world_size, rank)
        if not isinstance(root, (int, np.integer)) or not 0 <= root < w:
            raise ValueError(f"broadcast: root must be a rank in [0, {w}), got {root!r}")
        return self.bind("broadcast", [x], root=int(root), world=w, rank=r)


def check_dtype(op, x):
    if x.dtype not in NCCL_TYPES:
        raise ValueError(f"{op}: x must be one of {', '.join(t.name for t in NCCL_TYPES)}, got "
                         f"{x.dtype} {fmt(x.shape)}")


def _same(node):
    return dict(world_size=node.attrs["world"], rank=node.attrs["rank"])


def _linear(node) -> str:
    """The node's reduce op when it has a gradient here ('sum' and 'avg' are linear)."""
    op = node.attrs["reduce"]
    if op not in ("sum", "avg"):
        raise ValueError(f"grad: {node.op} with op {op!r} has no gradient here (only 'sum' "
                         f"and 'avg')")
    return op


@vjp("all_reduce")
def _all_reduce_vjp(g, node, dy):
    return [g.all_reduce(dy, _linear(node), **_same(node))]


@vjp("all_gather")
def _all_gather_vjp(g, node, dy):
    # dy [w, *shape]: rank r's gradient is the sum over ranks of their dy[r]
    return [g.bind("reduce_scatter", [dy], reduce="sum", world=node.attrs["world"],
                   rank=node.attrs["rank"])]


@vjp("reduce_scatter")
def _reduce_scatter_vjp(g, node, dy):
    op = _linear(node)
    w = node.attrs["world"]
    dx = g.bind("all_gather", [dy], world=w, rank=node.attrs["rank"])
    return [dx if op == "sum" else g.mul(dx, 1.0 / w)]


@vjp("broadcast")
def _broadcast_vjp(g, node, dy):
    total = g.all_reduce(dy, "sum", **_same(node))
    return [total if node.attrs["rank"] == node.attrs["root"] else g.mul(total, 0.0)]


