"""topk and sample: their OpDefs (ir/opdef.py), argument checks, shape rules and the Graph
builder methods (mixed into Graph). Kernels: kernels/sample.py; lowering: runtime/lower_sample.py.

topk(x, k, axis) becomes, in the graph:
  [transpose moving ``axis`` last, when it is not]    (one copy of x; the kernels want rows)
  topk         (xt) -> i64 [..., k]  the indices, sorted by value descending, ties to the
                                     smaller index, NaN above everything (like torch.topk)
  topk_values  (xt, idx) -> x.dtype  x gathered at the indices (values keep x's dtype)
  [transposes moving the k axis back]

sample(logits, ...) is one ``sample`` node (logits [, seed]) -> i64 ids of logits.shape[:-1],
except greedy (temperature 0, or top_k 1), which is argmax over the last axis.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from . import dtypes as dt
from .autodiff import vjp, zeros
from .opdef import EXACT, F32, STORAGE, defop
from .ops import fmt, normalize_axis

MAX_ROW = 2**32 - 2     # indices are packed into 32 bits of the kernels' sort keys


def _float_x(op, arg, t):
    if not t.dtype.is_float:
        raise ValueError(f"{op}: {arg} must be a float tensor (f32, f16 or bf16), got {t.dtype} "
                         f"{fmt(t.shape)}")
    if len(t.shape) == 0:
        raise ValueError(f"{op}: {arg} must have rank >= 1, got a scalar")


def _int_arg(v):
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _real_arg(v):
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


def topk_args(x, k, axis):
    """(normalised axis, n, k as int) of topk(x, k, axis); ValueError otherwise."""
    if not (x.dtype.is_float or x.dtype == dt.I32):
        raise ValueError(f"topk: x must be f32, f16, bf16 or i32, got {x.dtype} "
                         f"{fmt(x.shape)}")
    if len(x.shape) == 0:
        raise ValueError("topk: x must have rank >= 1, got a scalar")
    if isinstance(axis, np.integer):
        axis = int(axis)
    axis = normalize_axis("topk", "axis", axis, len(x.shape))
    n = x.shape[axis]
    if not _int_arg(k):
        raise ValueError(f"topk: k must be an int, got {k!r}")
    k = int(k)
    if not 1 <= k <= n:
        raise ValueError(f"topk: k must be in [1, {n}] (x {fmt(x.shape)} has {n} elements along "
                         f"axis {axis}), got k={k}")
    if n > MAX_ROW:
        raise ValueError(f"topk: x {fmt(x.shape)} has {n} elements along axis {axis}; at most "
                         f"{MAX_ROW} are supported")
    return axis, n, k


def check_sample(logits, temperature, top_k, top_p, seed):
    """Validate sample's arguments; returns (temperature, top_k, top_p, seed) normalised, seed
    an int in [0, 2^64) or a Tensor."""
    _float_x("sample", "logits", logits)
    if logits.shape[-1] == 0:
        raise ValueError(f"sample: logits {fmt(logits.shape)} has an empty last axis; there is "
                         f"nothing to sample")
    if logits.shape[-1] > MAX_ROW:
        raise ValueError(f"sample: logits {fmt(logits.shape)}: at most {MAX_ROW} tokens a row")
    if not _real_arg(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"sample: temperature must be a finite number >= 0 (0 means greedy), "
                         f"got {temperature!r}")
    if not _int_arg(top_k) or top_k < 0:
        raise ValueError(f"sample: top_k must be an int >= 0 (0 means no top-k filter), got "
                         f"{top_k!r}")
    if not _real_arg(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"sample: top_p must be a number in (0, 1] (1 means no top-p filter), "
                         f"got {top_p!r}")
    if _int_arg(seed):
        if not -2**63 <= int(seed) < 2**64:
            raise ValueError(f"sample: seed must fit in 64 bits, got {seed!r}")
        seed = int(seed) % 2**64
    elif hasattr(seed, "graph") and hasattr(seed, "dtype"):       # a Tensor
        if seed.dtype not in (dt.I32, dt.I64) or tuple(seed.shape) not in ((), (1,)):
            raise ValueError(f"sample: a seed tensor must be i32 or i64 of shape [] or [1], got "
                             f"{seed.dtype} {fmt(seed.shape)}")
    else:
        raise ValueError(f"sample: seed must be an int or an i32/i64 Tensor of shape [] or [1], "
                         f"got {type(seed).__name__}")
    return float(temperature), int(top_k), float(top_p), seed


def infer_topk(x, k):
    """The node: the k largest of each row of x (the axis last), i64 indices."""
    topk_args(x, k, -1)
    return tuple(x.shape[:-1]) + (k,), dt.I64


def infer_topk_values(x, idx, k):
    """x's rows gathered at idx [..., k] (topk's, or argsort's with k the row length)."""
    want = tuple(x.shape[:-1]) + (k,)
    if idx.dtype != dt.I64 or tuple(idx.shape) != want:
        raise ValueError(f"topk_values: idx must be i64 {fmt(want)} (x {fmt(x.shape)}, k={k}), "
                         f"got {idx.dtype} {fmt(idx.shape)}")
    return want, x.dtype


def infer_sample(logits, *seed_t, temperature, top_k, top_p, seed):
    if seed_t:      # a seed tensor instead of the int attr
        if seed is not None or len(seed_t) != 1 or seed_t[0].dtype != dt.I64:
            raise ValueError(f"sample: takes one i64 seed input (with the seed attr None), got "
                             f"{[str(t.dtype) for t in seed_t]} and seed={seed!r}")
        seed = seed_t[0]
    check_sample(logits, temperature, top_k, top_p, seed)
    return tuple(logits.shape[:-1]), dt.I64


defop("topk", infer_topk, dtype_rule=EXACT,
      doc="i64 indices of each row's k largest, by value descending (ties: smaller index)")
defop("topk_values", infer_topk_values, dtype_rule=STORAGE,
      doc="x's rows gathered at i64 indices [..., k] (topk's values, sort's values)")
defop("sample", infer_sample, dtype_rule=F32,
      doc="i64 token ids drawn from softmax(logits / temperature) after top_k / top_p")


class SampleOps:
    """Builder methods; ``self`` is the Graph."""

    def topk(self, x, k, axis: int = -1):
        """(values, indices) of the k largest elements along ``axis`` of f32 / f16 / bf16 / i32
        x, sorted descending; ties go to the smaller index; NaN counts as larger than every
        number (several NaNs: by index), like torch.topk. values keep x's dtype, indices are
        i64. A non-last axis is moved last by a transpose (a copy of x) and the results moved
        back; i32 rows are the first k of a stable descending sort."""
        self.check("topk", "x", x)
        axis, _, k = topk_args(x, k, axis)
        if x.dtype == dt.I32:     # the stable descending sort's first k (ties: smaller index)
            vals, idx = self.sort(x, axis, descending=True)
            return self.narrow(vals, axis, 0, k), self.narrow(idx, axis, 0, k)
        last = len(x.shape) - 1
        xt = x
        if axis != last:
            perm = [a for a in range(len(x.shape)) if a != axis] + [axis]
            xt = self.transpose(x, perm)
        idx = self.bind("topk", [xt], k=k)
        vals = self.bind("topk_values", [xt, idx], k=k)
        if axis != last:
            inv = [int(a) for a in np.argsort(perm)]
            vals, idx = self.transpose(vals, inv), self.transpose(idx, inv)
        return vals, idx

    def sample(self, logits, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
               seed=0):
        """i64 token ids, one per row of ``logits`` (sampling over the last axis): shape
        logits.shape[:-1].

        p = softmax(logits / temperature); ``top_k`` > 0 keeps the k largest logits (ties: the
        smaller indices, so exactly k); ``top_p`` < 1 then keeps the smallest set of the
        largest probabilities (renormalised over the top_k set, as Hugging Face does) whose
        sum reaches top_p (at least one token); one uniform per row picks a token by inverse
        CDF over the kept tokens in index order. temperature 0 (or top_k 1) is greedy: argmax,
        ties to the smaller index. NaN logits are never drawn (greedy: argmax's rule, NaN
        wins); a row of only NaNs gives 0.

        Randomness is Philox4x32-10 with counter (row, 0, 0, 0) and key (seed mod 2^32,
        seed >> 32): the same seed and logits give the same ids on a GPU and in the simulator.
        ``seed`` is a Python int, or an i32/i64 tensor of shape [] or [1] (e.g. a run() input,
        so a replayed decode graph can change it every step)."""
        self.check("sample", "logits", logits)
        if hasattr(seed, "graph"):
            self.check("sample", "seed", seed)
        temperature, top_k, top_p, seed = check_sample(logits, temperature, top_k, top_p, seed)
        n = logits.shape[-1]
        seed_t = None
        if not isinstance(seed, int):
            seed_t = seed if seed.dtype == dt.I64 else self.cast(seed, dt.I64)
        if temperature == 0 or top_k == 1 or n == 1:
            return self.argmax(logits, -1)
        if top_k >= n:
            top_k = 0                       # keeps everything
        ins = (logits,) if seed_t is None else (logits, seed_t)
        return self.bind("sample", ins, temperature=temperature, top_k=top_k, top_p=top_p,
                         seed=seed if seed_t is None else None)


# ---- VJPs (ir/autodiff.py); topk's indices and sample's ids are integers: no gradient ----------
@vjp("topk_values")
def _vjp_topk_values(g, n, dy):
    """dy scattered back to the k chosen positions of each row (torch.topk's values
    gradient); rows are flattened so one scatter_add does every row."""
    xt, idx = g.tensor(n.inputs[0]), g.tensor(n.inputs[1])
    length, k = xt.shape[-1], idx.shape[-1]
    rows = math.prod(xt.shape[:-1])
    base = g.constant((np.arange(rows, dtype=np.int64) * length).reshape(idx.shape[:-1] + (1,)))
    flat = g.reshape(idx + base, (rows * k,))
    d = dy if dy.dtype == dt.F32 else g.cast(dy, dt.F32)
    dx = g.scatter_add(zeros(g, (rows * length,)), flat, g.reshape(d, (rows * k,)), 0)
    return [g.reshape(dx, xt.shape), None]
