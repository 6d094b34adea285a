"""Control flow: g.cond, g.while_loop and g.scan (jax.lax semantics), builder methods mixed
into Graph.

A body is a Python function called with a sub-graph handle and its operands as inputs of that
sub-graph; what it builds is checked closed (a tensor captured from the outer graph raises, as
``Graph.check`` does for any foreign tensor) and then inlined into the outer graph. Shapes are
static per compile, so every construct becomes ordinary nodes -- one CUDA graph captures a
whole loop, the fusion and matmul passes see through it, and autodiff differentiates it with
the VJPs the ops already have (the carries are saved, as any forward tensor is):

* ``cond``: both branches are built and the result is ``where(pred, true, false)`` per output
  (jax.lax.cond under vmap; a gradient reaches only the taken branch's operands, but a NaN
  that the untaken branch's own derivative produces still multiplies a zero -- keep both
  branches finite, e.g. clamp before a sqrt, as with jnp.where).
* ``scan``: unrolled, ``length`` copies of the body.
* ``while_loop``: unrolled to ``max_iterations`` masked bodies: carry <- where(active, body(carry),
  carry), active <- active and cond(carry); every body runs (there is no early exit on the
  device), so the result is jax's for any loop that stops within max_iterations, and the carry
  after max_iterations body runs otherwise.

Unrolling costs compile time linear in the trip count (each copy is a few nodes) and none at
run time: in GRAPH mode the whole loop is one replay with no host round trip per step."""
from __future__ import annotations

import numpy as np

from .ops import fmt


def _tensors(op, what, xs, graph) -> list:
    """xs (a Tensor or a list / tuple of them) as a list of Tensors of ``graph``."""
    from .graph import Tensor
    items = list(xs) if isinstance(xs, (list, tuple)) else [xs]
    for i, t in enumerate(items):
        if not isinstance(t, Tensor):
            raise ValueError(f"{op}: {what}[{i}] must be a Tensor, got {type(t).__name__}")
        graph.check(op, f"{what}[{i}]", t)
    return items


def _sig(ts) -> list:
    return [(t.shape, t.dtype) for t in ts]


def _desc(sig) -> str:
    return ", ".join(f"{d} {fmt(s)}" for s, d in sig)


class Body:
    """A body function traced once into its own sub-graph, inlined as often as needed."""

    def __init__(self, outer, op: str, what: str, fn, sig):
        from .graph import Graph
        if not callable(fn):
            raise ValueError(f"{op}: {what} must be a callable (sub-graph, *operands) -> list, "
                             f"got {type(fn).__name__}")
        self.op, self.what = op, what
        sub = self.sub = Graph(f"{outer.name}.{op}.{what}")
        self.args = [sub.input(f"arg{i}", s, d) for i, (s, d) in enumerate(sig)]
        try:
            res = fn(sub, *self.args)
        except ValueError as e:
            if "belongs to graph" in str(e):
                raise ValueError(f"{op}: {what} uses a tensor of another graph ({e}); a body "
                                 f"sees only its operands: pass the tensor in as one") from None
            raise
        self.outs = _tensors(op, f"{what}'s results", res if isinstance(res, (list, tuple))
                             else [res], sub)
        leaves = [n for n in sub.nodes if n.op in ("input", "param") and n.id not in
                  {a.id for a in self.args}]
        if leaves:
            raise ValueError(f"{op}: {what} creates {leaves[0].op} {leaves[0].name!r}; a body "
                             f"sees only its operands: pass it in as one")
        self._consts = {}

    def __call__(self, outer, operands) -> list:
        """The body's nodes added to ``outer`` with its inputs bound to ``operands``."""
        done = {a.id: t for a, t in zip(self.args, operands)}
        for n in self.sub.nodes:
            if n.id in done:
                continue
            if n.op == "constant":     # one copy in the outer graph, whatever the trip count
                if n.id not in self._consts:
                    c = outer.constant(n.attrs["value"], n.dtype)
                    c.node.attrs.update(n.attrs)
                    self._consts[n.id] = c
                done[n.id] = self._consts[n.id]
                continue
            done[n.id] = outer.add_node(n.op, [done[i] for i in n.inputs], n.shape, n.dtype,
                                        None, **n.attrs)
        return [done[t.id] for t in self.outs]


class ControlOps:
    """Builder methods; self is the Graph."""

    def cond(self, pred, true_fn, false_fn, operands=()):
        """jax.lax.cond: true_fn(sub, *operands) if pred else false_fn(sub, *operands); pred a
        bool () tensor; both branches return lists of the same shapes and dtypes. Both are
        computed and selected per output (see the module docstring)."""
        op = "cond"
        self.check(op, "pred", pred)
        if pred.shape != () or str(pred.dtype) != "bool":
            raise ValueError(f"{op}: pred must be a bool () tensor, got {pred.dtype} "
                             f"{fmt(pred.shape)}")
        ops_ = _tensors(op, "operands", operands, self)
        t = Body(self, op, "true_fn", true_fn, _sig(ops_))
        f = Body(self, op, "false_fn", false_fn, _sig(ops_))
        if _sig(t.outs) != _sig(f.outs):
            raise ValueError(f"{op}: true_fn returns [{_desc(_sig(t.outs))}] but false_fn "
                             f"returns [{_desc(_sig(f.outs))}]")
        return [self.where(pred, a, b) for a, b in zip(t(self, ops_), f(self, ops_))]

    def scan(self, fn, init, xs, length=None, reverse=False):
        """jax.lax.scan: fn(sub, carry..., x_t...) -> (new_carry list, y_t list), carry and
        x_t lists (xs sliced on axis 0); returns (final carry list, ys list, each [length,
        ...]). ``reverse`` runs t = length-1 .. 0 and keeps ys[t] aligned with xs[t]."""
        op = "scan"
        carry = _tensors(op, "init", init, self)
        xs_ = _tensors(op, "xs", xs, self) if not (isinstance(xs, (list, tuple)) and not xs) else []
        if not isinstance(reverse, bool):
            raise ValueError(f"{op}: reverse must be a bool, got {reverse!r}")
        lens = {t.shape[0] for t in xs_ if t.shape}
        if any(not t.shape for t in xs_):
            raise ValueError(f"{op}: every xs needs a leading axis to scan over, got "
                             f"[{_desc(_sig(xs_))}]")
        if len(lens) > 1:
            raise ValueError(f"{op}: xs disagree on the leading axis: [{_desc(_sig(xs_))}]")
        if length is None:
            if not lens:
                raise ValueError(f"{op}: length is needed when there are no xs")
            length = lens.pop()
        elif (not isinstance(length, (int, np.integer)) or isinstance(length, bool) or length < 0
              or lens and lens != {length}):
            raise ValueError(f"{op}: length must be a non-negative int matching xs' leading "
                             f"axis, got {length!r} for [{_desc(_sig(xs_))}]")
        x_sig = [(t.shape[1:], t.dtype) for t in xs_]
        body = Body(self, op, "fn", _pair_fn(op, fn, len(carry)), _sig(carry) + x_sig)
        nc = len(carry)
        new_c, ys_sig = body.outs[:nc], _sig(body.outs[nc:])
        if _sig(new_c) != _sig(carry):
            raise ValueError(f"{op}: fn's new carry [{_desc(_sig(new_c))}] differs from init "
                             f"[{_desc(_sig(carry))}]")
        ys = [[None] * length for _ in ys_sig]
        steps = range(length - 1, -1, -1) if reverse else range(length)
        for t in steps:
            x_t = [self.reshape(self.narrow(x, 0, t, 1), x.shape[1:]) for x in xs_]
            out = body(self, carry + x_t)
            carry = out[:nc]
            for j, y in enumerate(out[nc:]):
                ys[j][t] = self.reshape(y, (1,) + y.shape)
        stacked = [self.concat(parts, 0) if length else self._empty_stack(s, d)
                   for parts, (s, d) in zip(ys, ys_sig)]
        return carry, stacked

    def _empty_stack(self, shape, dtype):
        return self.constant(np.zeros((0,) + tuple(shape), dtype.host), dtype)

    def while_loop(self, cond_fn, body_fn, init, max_iterations):
        """jax.lax.while_loop with a bound: while cond_fn(sub, *carry): carry =
        body_fn(sub, *carry), stopping after max_iterations body runs (no error). Unrolled
        with a mask (see the module docstring)."""
        op = "while_loop"
        carry = _tensors(op, "init", init, self)
        if (not isinstance(max_iterations, (int, np.integer)) or isinstance(max_iterations, bool)
                or max_iterations < 0):
            raise ValueError(f"{op}: max_iterations must be a non-negative int, got "
                             f"{max_iterations!r}")
        c = Body(self, op, "cond_fn", cond_fn, _sig(carry))
        if len(c.outs) != 1 or c.outs[0].shape != () or str(c.outs[0].dtype) != "bool":
            raise ValueError(f"{op}: cond_fn must return one bool () tensor, got "
                             f"[{_desc(_sig(c.outs))}]")
        b = Body(self, op, "body_fn", body_fn, _sig(carry))
        if _sig(b.outs) != _sig(carry):
            raise ValueError(f"{op}: body_fn returns [{_desc(_sig(b.outs))}] but the carry is "
                             f"[{_desc(_sig(carry))}]")
        active = c(self, carry)[0]
        for i in range(int(max_iterations)):
            new = b(self, carry)      # (a carry the body passes through needs no select)
            carry = [o if n.id == o.id else self.where(active, n, o) for n, o in zip(new, carry)]
            if i + 1 < max_iterations:     # (min of two bools: and)
                active = self.binary("min", active, c(self, carry)[0])
        return carry


def _pair_fn(op, fn, nc):
    """scan's fn returning (carry list, ys list) as one flat list for Body."""
    if not callable(fn):
        raise ValueError(f"{op}: fn must be a callable (sub-graph, *carry, *x_t) -> "
                         f"(new_carry, ys), got {type(fn).__name__}")

    def flat(sub, *args):
        res = fn(sub, *args)
        if not isinstance(res, (list, tuple)) or len(res) != 2:
            raise ValueError(f"{op}: fn must return (new_carry list, ys list), got "
                             f"{type(res).__name__}")
        new_c, ys = (list(r) if isinstance(r, (list, tuple)) else [r] for r in res)
        if len(new_c) != nc:
            raise ValueError(f"{op}: fn returned {len(new_c)} carries, init has {nc}")
        return new_c + ys
    return flat
