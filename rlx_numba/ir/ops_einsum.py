"""einsum and dot_general (numpy.einsum, jax.lax.dot_general): builder methods mixed into
Graph that lower to the ops the graph already has -- a transpose where an operand's axes are
not already in [batch, free, contracted] order, reshapes (views), one batched matmul per
pair of operands, reduce_sum for an index only one operand carries -- so every matmul tier,
the fusion of products and the ops' VJPs apply with nothing new to lower or differentiate.

dot_general(a, b, contracting=(lhs, rhs), batch=(lhs, rhs)): out = batch dims (in the order
given), then a's free dims, then b's free dims, each in its operand's order (lax's rule).
einsum("ij,jk->ik", a, b, ...): explicit "->" only, no "..." and no index repeated within an
operand (no diagonals); operands contracted left to right, an index shared by the pair
stays a batch dim while the output or a later operand still needs it."""
from __future__ import annotations

import math

from .ops import fmt, product_dtype


def _axes(op, arg, dims, rank):
    """dims (a sequence of ints, negatives from the end) as non-negative axes."""
    if not isinstance(dims, (list, tuple)) or not all(isinstance(d, int) and not isinstance(d, bool)
                                                      for d in dims):
        raise ValueError(f"{op}: {arg} must be a sequence of ints, got {dims!r}")
    out = [d + rank if d < 0 else d for d in dims]
    if any(not 0 <= d < rank for d in out):
        raise ValueError(f"{op}: {arg} {list(dims)} out of range for rank {rank}")
    if len(set(out)) != len(out):
        raise ValueError(f"{op}: {arg} {list(dims)} repeats an axis")
    return out


def _pair(op, arg, value):
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ValueError(f"{op}: {arg} must be a pair (lhs dims, rhs dims), got {value!r}")
    return value


class EinsumOps:
    """Builder methods; self is the Graph."""

    def dot_general(self, a, b, contracting, batch=((), ())):
        """lax.dot_general: contract a's dims contracting[0] with b's contracting[1]
        (pairwise, equal sizes), keep batch[0] / batch[1] as batch dims; out = batch, a's free
        dims, b's free dims."""
        op = "dot_general"
        self.check(op, "a", a)
        self.check(op, "b", b)
        (lc, rc), (lb, rb) = _pair(op, "contracting", contracting), _pair(op, "batch", batch)
        lc, lb = _axes(op, "contracting[0]", lc, a.ndim), _axes(op, "batch[0]", lb, a.ndim)
        rc, rb = _axes(op, "contracting[1]", rc, b.ndim), _axes(op, "batch[1]", rb, b.ndim)
        product_dtype(op, [("a", a), ("b", b)])
        for arg, l_, r_ in (("contracting", lc, rc), ("batch", lb, rb)):
            if len(l_) != len(r_):
                raise ValueError(f"{op}: {arg} names {len(l_)} dims of a but {len(r_)} of b")
            for i, j in zip(l_, r_):
                if a.shape[i] != b.shape[j]:
                    raise ValueError(f"{op}: {arg} dim {i} of a {fmt(a.shape)} has size "
                                     f"{a.shape[i]}, dim {j} of b {fmt(b.shape)} has "
                                     f"{b.shape[j]}")
        for arg, t, c_, b_ in (("a", a, lc, lb), ("b", b, rc, rb)):
            if set(c_) & set(b_):
                raise ValueError(f"{op}: dims {sorted(set(c_) & set(b_))} of {arg} "
                                 f"{fmt(t.shape)} are both contracting and batch")
        lf = [d for d in range(a.ndim) if d not in lc and d not in lb]
        rf = [d for d in range(b.ndim) if d not in rc and d not in rb]
        out = self.matmul(self._matrix(a, lb, lf, lc), self._matrix(b, rb, rc, rf))
        shape = (tuple(a.shape[d] for d in lb) + tuple(a.shape[d] for d in lf)
                 + tuple(b.shape[d] for d in rf))
        return out if out.shape == shape else self.reshape(out, shape)

    def _matrix(self, x, batch, rows, cols):
        """x as the matrices [B, R, C] (no B without batch dims): reshaped in place when its
        axes already lie as batch, rows, cols; as batch, cols, rows, reshaped and then
        transposed in its last two axes, a transpose the product absorbs (an op-T flag, no
        copy); otherwise one materialised transpose first."""
        size = lambda ds: math.prod(x.shape[d] for d in ds)      # noqa: E731
        lead, r, c = ((size(batch),) if batch else ()), size(rows), size(cols)
        ident = list(range(x.ndim))
        fit = lambda t, shape: t if t.shape == shape else self.reshape(t, shape)   # noqa: E731
        if batch + cols + rows == ident and batch + rows + cols != ident:
            swap = tuple(range(len(lead))) + (len(lead) + 1, len(lead))
            return self.transpose(fit(x, lead + (c, r)), swap)
        if batch + rows + cols != ident:
            x = self.transpose(x, tuple(batch + rows + cols))
        return fit(x, lead + (r, c))

    def einsum(self, spec: str, *operands):
        """numpy.einsum with an explicit output: "bhqd,bhkd->bhqk". Any number of operands;
        an index in one operand only and not in the output is summed; no "...", no index
        repeated within one operand or in the output."""
        op = "einsum"
        if not isinstance(spec, str) or spec.count("->") != 1:
            raise ValueError(f"{op}: spec must be a string with one '->' (the explicit form), "
                             f"got {spec!r}")
        lhs, out_idx = (s.replace(" ", "") for s in spec.split("->"))
        ins = lhs.split(",")
        if "." in spec:
            raise ValueError(f"{op}: '...' is not supported (spec {spec!r}); name every axis")
        if len(ins) != len(operands):
            raise ValueError(f"{op}: spec {spec!r} names {len(ins)} operands, got "
                             f"{len(operands)}")
        sizes = {}
        for i, (idx, t) in enumerate(zip(ins, operands)):
            self.check(op, f"operands[{i}]", t)
            if not all(c.isalpha() for c in idx):
                raise ValueError(f"{op}: operand {i}'s indices {idx!r} must be letters")
            if len(set(idx)) != len(idx):
                raise ValueError(f"{op}: operand {i}'s indices {idx!r} repeat a letter "
                                 f"(diagonals are not supported)")
            if len(idx) != t.ndim:
                raise ValueError(f"{op}: operand {i} has {len(idx)} indices {idx!r} but rank "
                                 f"{t.ndim} {fmt(t.shape)}")
            for c, n in zip(idx, t.shape):
                if sizes.setdefault(c, n) != n:
                    raise ValueError(f"{op}: index {c!r} has size {sizes[c]} in one operand and "
                                     f"{n} in operand {i} {fmt(t.shape)}")
        if not all(c.isalpha() for c in out_idx) or len(set(out_idx)) != len(out_idx):
            raise ValueError(f"{op}: output indices {out_idx!r} must be distinct letters")
        missing = [c for c in out_idx if c not in sizes]
        if missing:
            raise ValueError(f"{op}: output index {missing[0]!r} is in no operand")
        if len(operands) > 1:
            product_dtype(op, [(f"operands[{i}]", t) for i, t in enumerate(operands)])
        terms = [(t, idx) for t, idx in zip(operands, ins)]
        # an index only one operand carries and the output lacks: summed out first
        terms = [self._sum_own(t, idx, out_idx, [j for k, (_, j) in enumerate(terms) if k != i])
                 for i, (t, idx) in enumerate(terms)]
        cur, cidx = terms[0]
        for i, (t, idx) in enumerate(terms[1:], 1):
            later = out_idx + "".join(j for _, j in terms[i + 1:])
            shared = [c for c in cidx if c in idx]
            batch = [c for c in shared if c in later]
            contract = [c for c in shared if c not in later]
            cur = self.dot_general(cur, t, ([cidx.index(c) for c in contract],
                                            [idx.index(c) for c in contract]),
                                   ([cidx.index(c) for c in batch], [idx.index(c) for c in batch]))
            cidx = ("".join(batch) + "".join(c for c in cidx if c not in shared)
                    + "".join(c for c in idx if c not in shared))
        if cidx != out_idx:
            cur = self.transpose(cur, tuple(cidx.index(c) for c in out_idx))
        return cur

    def _sum_own(self, t, idx, out_idx, others):
        """(t summed over the indices no other operand and not the output has, its indices)."""
        own = [k for k, c in enumerate(idx) if c not in out_idx and not any(c in o for o in others)]
        if not own:
            return t, idx
        return self.reduce_sum(t, own), "".join(c for k, c in enumerate(idx) if k not in own)
