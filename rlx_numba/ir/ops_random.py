"""dropout and random: their OpDefs (ir/opdef.py), argument checks, the Graph builder methods
(mixed into Graph) and dropout's VJP. Both draw from the counter-based Philox4x32-10 stream
defined in kernels/random.py (lowering: runtime/lower_random.py), so a GPU and the simulator
give the same values, and the backward of dropout redraws the forward's mask instead of
storing it.

Each dropout / random built in a graph takes the next ``stream`` number (0, 1, 2, ... in
build order), part of the Philox counter: two dropouts with the same seed still draw
different masks, and a graph built the same way draws the same values.
"""
from __future__ import annotations

import numbers

from . import dtypes as dt
from .autodiff import vjp
from .opdef import F32, defop
from .ops import fmt, normalize_shape

DISTS = ("uniform", "normal")


def _seed(op, seed):
    """An int seed as an int in [0, 2^64), or a checked i32/i64 tensor of shape [] or [1]."""
    if isinstance(seed, numbers.Integral) and not isinstance(seed, bool):
        if not -2**63 <= int(seed) < 2**64:
            raise ValueError(f"{op}: seed must fit in 64 bits, got {seed!r}")
        return int(seed) % 2**64
    if hasattr(seed, "graph") and hasattr(seed, "dtype"):
        if seed.dtype not in (dt.I32, dt.I64) or tuple(seed.shape) not in ((), (1,)):
            raise ValueError(f"{op}: a seed tensor must be i32 or i64 of shape [] or [1], got "
                             f"{seed.dtype} {fmt(seed.shape)}")
        return seed
    raise ValueError(f"{op}: seed must be an int or an i32/i64 Tensor of shape [] or [1], got "
                     f"{type(seed).__name__}")


def _stream_seed(op, seed_t, seed, stream):
    """A node's seed: an int attr, or (seed None) one i64 input of shape [] or [1]."""
    if seed_t:
        (t,) = seed_t
        if seed is not None or t.dtype != dt.I64 or tuple(t.shape) not in ((), (1,)):
            raise ValueError(f"{op}: a seed input must be i64 of shape [] or [1] (and the seed "
                             f"attr None), got {t.dtype} {fmt(t.shape)} and seed={seed!r}")
    elif isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ValueError(f"{op}: seed must be an int in [0, 2^64) or an input, got {seed!r}")
    if isinstance(stream, bool) or not isinstance(stream, int) or stream < 0:
        raise ValueError(f"{op}: stream must be an int >= 0, got {stream!r}")


def infer_dropout(x, *seed_t, p, seed, stream):
    if x.dtype not in (dt.F32, dt.F16, dt.BF16):
        raise ValueError(f"dropout: x must be f32, f16 or bf16, got {x.dtype} {fmt(x.shape)}")
    if not 0.0 < p <= 1.0:
        raise ValueError(f"dropout: p must be in (0, 1], got {p!r}")
    _stream_seed("dropout", seed_t, seed, stream)
    return x.shape, x.dtype


def infer_random(*seed_t, shape, dist, seed, stream):
    if dist not in DISTS:
        raise ValueError(f"random: dist must be one of {', '.join(DISTS)}, got {dist!r}")
    _stream_seed("random", seed_t, seed, stream)
    return normalize_shape("random", "shape", shape), dt.F32


defop("dropout", infer_dropout, dtype_rule=F32,
      doc="x zeroed with probability p (a Philox mask, redrawn by the VJP), kept ones / (1 - p)")
defop("random", infer_random, dtype_rule=F32,
      doc="f32 of shape drawn from the Philox stream: uniform [0, 1) or normal")


class RandomOps:
    """Builder methods; ``self`` is the Graph."""

    def _rng_stream(self) -> int:
        k = getattr(self, "_rng_streams", 0)
        self._rng_streams = k + 1
        return k

    def _seed_inputs(self, op, seed):
        seed = _seed(op, seed)
        if isinstance(seed, int):
            return seed, ()
        self.check(op, "seed", seed)
        return None, (seed if seed.dtype == dt.I64 else self.cast(seed, dt.I64),)

    def dropout(self, x, p: float = 0.5, seed=0):
        """F.dropout in training mode: each element is zeroed with probability ``p`` and the
        rest scaled by 1 / (1 - p); p = 0 returns x itself, p = 1 zeros. Element i is kept
        when its uniform (kernels/random.py's stream for ``seed`` and this op's stream
        number) is >= p. ``seed``: an int, or an i32/i64 tensor of shape [] or [1] (a run()
        input, so a train step can draw a new mask every step). Active in every executable.
        Its gradient is dy times the same mask (redrawn, not stored). x f32, f16 or bf16 (a
        half x is scaled in f32 and rounded once to its dtype)."""
        op = "dropout"
        self.check(op, "x", x)
        if not x.dtype.is_float:
            raise ValueError(f"{op}: x must be a float tensor, got {x.dtype} {fmt(x.shape)}")
        if (isinstance(p, bool) or not isinstance(p, numbers.Real)
                or not 0.0 <= float(p) <= 1.0):
            raise ValueError(f"{op}: p must be a number in [0, 1], got {p!r}")
        seed, extra = self._seed_inputs(op, seed)
        if float(p) == 0.0:
            return x
        return self.bind(op, [x, *extra], p=float(p), seed=seed, stream=self._rng_stream())

    def random(self, shape, dist: str = "uniform", seed=0):
        """An f32 tensor of ``shape`` drawn from the Philox stream: "uniform" in [0, 1) (24
        random bits), or "normal" (standard, Box-Muller). ``seed`` as dropout's. Drawn again
        on every run (the same values for the same seed)."""
        op = "random"
        shape = normalize_shape(op, "shape", shape)
        if dist not in DISTS:
            raise ValueError(f"{op}: dist must be one of {', '.join(DISTS)}, got {dist!r}")
        seed, extra = self._seed_inputs(op, seed)
        return self.bind(op, extra, shape=shape, dist=dist, seed=seed,
                         stream=self._rng_stream())


@vjp("dropout")
def _vjp_dropout(g, n, dy):
    """dy through the forward's mask and scale: the same Philox stream drawn again."""
    extra = tuple(g.tensor(i) for i in n.inputs[1:])
    return [g.bind("dropout", [dy, *extra], **n.attrs)] + [None] * len(extra)
