"""rope, kv_write and rope_kv_write: shape rules and the Graph builder methods (mixed into Graph).
Kernels: kernels/rope.py; lowering: runtime/lower_rope.py.

dtypes: x / qkv f32, f16 or bf16 (the result in that dtype; the rotation computed in f32),
the cos / sin tables f32 or x's dtype (HF's rotary embedding casts its f32 tables to x's
dtype); a KV cache has the dtype of what is written into it (a half model keeps a half
cache)."""
from __future__ import annotations

import operator

import numpy as np

from . import dtypes as dt
from .autodiff import scatter_grad, vjp, zeros
from .opdef import F32, INPLACE, STORAGE, defop
from .ops import fmt
from .ops_norm import further_result

INDEX_DTYPES = (dt.I32, dt.I64)


def _int(op, arg, v):
    """A Python/NumPy int (not a bool) as int, else None."""
    if isinstance(v, bool):
        return None
    try:
        return operator.index(v)
    except TypeError:
        return None


def _table(op, arg, t, x, xname):
    """cos / sin: f32, or the rotated operand's (half) dtype."""
    if t.dtype not in (dt.F32, x.dtype):
        want = "f32" if x.dtype == dt.F32 else f"f32 or {x.dtype} ({xname}'s dtype)"
        raise ValueError(f"{op}: {arg} must be {want}, got {t.dtype} {fmt(t.shape)}")


def _float(op, arg, t):
    if not t.dtype.is_float:
        raise ValueError(f"{op}: {arg} must be f32, f16 or bf16, got {t.dtype} {fmt(t.shape)}")


def _index_tensor(op, arg, t):
    if t.dtype not in INDEX_DTYPES:
        raise ValueError(f"{op}: {arg} must be i32 or i64, got {t.dtype} {fmt(t.shape)}")


def _base(t):
    """The node whose memory ``t`` shares (through reshapes, narrows, same-dtype casts,
    kv_writes)."""
    g, n = t.graph, t.node
    while (n.op in ("reshape", "narrow", "kv_write", "kv_written")
           or (n.op == "cast" and g.nodes[n.inputs[0]].dtype == n.dtype)):
        n = g.nodes[n.inputs[0]]
    return n


def _as_int(v):
    """v as an int when it is one (NumPy ints too), else as given (the inference rejects it)."""
    i = _int("", "", v)
    return v if i is None else i


def _not_constant(op, arg, t):
    base = _base(t)
    if base.op == "constant":
        raise ValueError(f"{op}: {arg} {fmt(t.shape)} is (a view of) constant %{base.id}; a "
                         f"cache is written in place, so make it a param (it persists across "
                         f"runs) or an input")


# ---- inference (ir/opdef.py) ---------------------------------------------------------------------
def _rot(op, n_rot, d, where):
    """n_rot as an int, checked: even, in [2, D]."""
    nr = _int(op, "n_rot", n_rot)
    if nr is None or nr < 2 or nr > d or nr % 2:
        raise ValueError(f"{op}: n_rot must be an even int in [2, D] with D = {d}{where}, got "
                         f"{n_rot!r}")
    return nr


def _positions_input(op, positions, b, s, what):
    _index_tensor(op, "positions", positions)
    if tuple(positions.shape) not in ((s,), (b, s)):
        raise ValueError(f"{op}: positions must be [S] = [{s}] or [B, S] = [{b}, {s}] "
                         f"({what}), got {fmt(positions.shape)}")


def infer_rope(x, cos, sin, *positions, n_rot, interleaved, position_offset):
    op = "rope"
    if len(x.shape) not in (3, 4):
        raise ValueError(f"{op}: x must be [B, H, S, D] (or [B, S, D]), got {fmt(x.shape)}")
    _float(op, "x", x)
    b, s, d = x.shape[0], x.shape[-2], x.shape[-1]
    half = _rot(op, n_rot, d, f" (x {fmt(x.shape)})") // 2
    for arg, t in (("cos", cos), ("sin", sin)):
        if len(t.shape) != 2 or t.shape[1] != half:
            raise ValueError(f"{op}: {arg} must be [max_pos, n_rot/2] = [max_pos, {half}] "
                             f"(n_rot {n_rot}, x {fmt(x.shape)}), got {fmt(t.shape)}")
        _table(op, arg, t, x, "x")
    if cos.dtype != sin.dtype:
        raise ValueError(f"{op}: cos {cos.dtype} {fmt(cos.shape)} and sin {sin.dtype} "
                         f"{fmt(sin.shape)} must have the same dtype")
    if tuple(cos.shape) != tuple(sin.shape):
        raise ValueError(f"{op}: cos {fmt(cos.shape)} and sin {fmt(sin.shape)} must have the "
                         f"same shape")
    max_pos = cos.shape[0]
    if max_pos == 0:
        raise ValueError(f"{op}: cos and sin {fmt(cos.shape)} hold no positions")
    if not isinstance(interleaved, bool):
        raise ValueError(f"{op}: interleaved must be a bool, got {interleaved!r}")
    off = _int(op, "position_offset", position_offset)
    if off is None or off < 0:
        raise ValueError(f"{op}: position_offset must be an int >= 0, got {position_offset!r}")
    if len(positions) > 1:
        raise ValueError(f"{op}: at most one positions input, got {len(positions)}")
    if not positions:
        if off + s > max_pos:
            raise ValueError(f"{op}: position_offset {off} + S {s} (x {fmt(x.shape)}) exceeds "
                             f"max_pos {max_pos} (cos/sin {fmt(cos.shape)})")
    else:
        if off:
            raise ValueError(f"{op}: pass either position_offset ({off}) or positions "
                             f"{fmt(positions[0].shape)}, not both")
        _positions_input(op, positions[0], b, s, f"x {fmt(x.shape)}")
    return x.shape, x.dtype


def _check_position(op, arg, p, rest, s, max_s, src, dst, rows="S"):
    """An in-place write of ``s`` rows into ``max_s`` at int ``p``, or (p None) at the scalar
    index tensor ``rest[0]``; the inputs after it."""
    if p is not None:
        if _int(op, arg, p) is None or p < 0 or p + s > max_s:
            raise ValueError(f"{op}: {arg} {p} + {rows} {s} ({src}) must lie in [0, max_S] = "
                             f"[0, {max_s}] ({dst})")
        return list(rest)
    if not rest:
        raise ValueError(f"{op}: {arg} is None and no {arg} tensor is an input")
    position = rest[0]
    _index_tensor(op, arg, position)
    if tuple(position.shape) not in ((), (1,)):
        raise ValueError(f"{op}: {arg} must be a scalar tensor, shape [] or [1], got "
                         f"{fmt(position.shape)}")
    return list(rest[1:])


def infer_kv_write(cache, new, *rest, position):
    op = "kv_write"
    if len(cache.shape) != 4:
        raise ValueError(f"{op}: cache must be [B, H, max_S, D], got {fmt(cache.shape)}")
    if len(new.shape) != 4:
        raise ValueError(f"{op}: new must be [B, H, s, D], got {fmt(new.shape)}")
    b, h, max_s, d = cache.shape
    s = new.shape[2]
    if (new.shape[0], new.shape[1], new.shape[3]) != (b, h, d):
        raise ValueError(f"{op}: new must be [B, H, s, D] = [{b}, {h}, s, {d}] to match cache "
                         f"{fmt(cache.shape)}, got {fmt(new.shape)}")
    if s > max_s:
        raise ValueError(f"{op}: new {fmt(new.shape)} has {s} rows but cache "
                         f"{fmt(cache.shape)} holds only {max_s}")
    if new.dtype != cache.dtype:
        raise ValueError(f"{op}: new is {new.dtype} {fmt(new.shape)} but cache is "
                         f"{cache.dtype} {fmt(cache.shape)}; they must match")
    if _check_position(op, "position", position, rest, s, max_s, f"new {fmt(new.shape)}",
                       f"cache {fmt(cache.shape)}", rows="s"):
        raise ValueError(f"{op}: inputs after the position: {len(rest)} inputs in all")
    return cache.shape, cache.dtype


def infer_rope_kv_write(qkv, cos, sin, k_cache, v_cache, *rest, num_heads, num_kv_heads,
                        head_dim, n_rot, interleaved, cache_position, has_positions):
    """q [B, Hq, S, D] and the two caches after the write (kv_written: in place)."""
    op = "rope_kv_write"
    _float(op, "qkv", qkv)
    for arg, t in (("cos", cos), ("sin", sin)):
        _table(op, arg, t, qkv, "qkv")
    if cos.dtype != sin.dtype:
        raise ValueError(f"{op}: cos {cos.dtype} {fmt(cos.shape)} and sin {sin.dtype} "
                         f"{fmt(sin.shape)} must have the same dtype")
    for arg, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != qkv.dtype:
            raise ValueError(f"{op}: {arg} is {t.dtype} {fmt(t.shape)} but qkv is {qkv.dtype} "
                             f"{fmt(qkv.shape)}; the caches hold qkv's dtype")
    hq, hkv = _int(op, "num_heads", num_heads), _int(op, "num_kv_heads", num_kv_heads)
    if hq is None or hkv is None or hq < 1 or hkv < 1 or hq % hkv:
        raise ValueError(f"{op}: num_heads ({num_heads!r}) and num_kv_heads "
                         f"({num_kv_heads!r}) must be positive ints, num_heads a multiple "
                         f"of num_kv_heads")
    if len(k_cache.shape) != 4:
        raise ValueError(f"{op}: k_cache must be [B, Hkv, max_S, D], got {fmt(k_cache.shape)}")
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"{op}: v_cache {fmt(v_cache.shape)} must have k_cache's shape "
                         f"{fmt(k_cache.shape)}")
    b, hc, max_s, d = k_cache.shape
    if hc != hkv:
        raise ValueError(f"{op}: k_cache {fmt(k_cache.shape)} has {hc} heads, num_kv_heads is "
                         f"{hkv}")
    if head_dim != d:
        raise ValueError(f"{op}: head_dim {head_dim!r} is not the caches' D = {d}")
    width = (hq + 2 * hkv) * d
    if len(qkv.shape) != 3 or qkv.shape[0] != b or qkv.shape[2] != width:
        raise ValueError(f"{op}: qkv must be [B, S, (num_heads + 2 num_kv_heads) * D] = "
                         f"[{b}, S, {width}] (heads {hq}/{hkv}, caches "
                         f"{fmt(k_cache.shape)}), got {fmt(qkv.shape)}")
    s = qkv.shape[1]
    if s > max_s:
        raise ValueError(f"{op}: qkv {fmt(qkv.shape)} has {s} tokens but the caches "
                         f"{fmt(k_cache.shape)} hold only {max_s} rows")
    nr = _rot(op, n_rot, d, "")
    for arg, t in (("cos", cos), ("sin", sin)):
        if len(t.shape) != 2 or t.shape[1] != nr // 2 or t.shape[0] == 0:
            raise ValueError(f"{op}: {arg} must be [max_pos, n_rot/2] = [max_pos, {nr // 2}] "
                             f"with max_pos >= 1 (n_rot {nr}), got {fmt(t.shape)}")
    if tuple(cos.shape) != tuple(sin.shape):
        raise ValueError(f"{op}: cos {fmt(cos.shape)} and sin {fmt(sin.shape)} must have the "
                         f"same shape")
    if not isinstance(interleaved, bool):
        raise ValueError(f"{op}: interleaved must be a bool, got {interleaved!r}")
    max_pos = cos.shape[0]
    p = cache_position
    rest = _check_position(op, "cache_position", p, rest, s, max_s, f"qkv {fmt(qkv.shape)}",
                           f"caches {fmt(k_cache.shape)}")
    if p is not None and not has_positions and p + s > max_pos:
        raise ValueError(f"{op}: positions cache_position {p} + S {s} exceed max_pos "
                         f"{max_pos} (cos/sin {fmt(cos.shape)})")
    if len(rest) != bool(has_positions):
        raise ValueError(f"{op}: {len(rest)} inputs after the caches' position do not match "
                         f"has_positions={has_positions}")
    if has_positions:
        _positions_input(op, rest[0], b, s, f"qkv {fmt(qkv.shape)}")
    return [((b, hq, s, d), qkv.dtype), (k_cache.shape, k_cache.dtype),
            (v_cache.shape, v_cache.dtype)]


defop("rope", infer_rope, dtype_rule=F32,
      doc="rotary position embedding of x [B, (H,) S, D] from cos / sin tables")
defop("kv_write", infer_kv_write, memory=INPLACE, dtype_rule=STORAGE,
      doc="new's rows written into the cache at position, in place; the cache after")
# the caches after a rope_kv_write: aliases of their memory (input 0) that the rope_kv_write
# node (input 1) fills
defop("rope_kv_write", infer_rope_kv_write, dtype_rule=F32,
      results=(("kv_written", 3), ("kv_written", 4)),
      doc="RoPE of q and k and the KV-cache write from a packed qkv, in one kernel")
defop("kv_written", further_result("kv_written", "rope_kv_write"), memory=INPLACE,
      written_by=1, dtype_rule=F32,
      doc="a KV cache after rope_kv_write wrote into it in place")


def _folded_by_fusion(*inputs, **attrs):
    raise ValueError("rope_kv_attention is made by the fusion pass (passes/fusion.py) from a "
                     "rope_kv_write and the decode attention over its q and caches, not bind")


# inputs: rope_kv_write's, then the attention's mask / bias; attrs: the attention's, and
# "rope_kv_write": that node's id (runtime/lower_attention.py)
defop("rope_kv_attention", _folded_by_fusion, dtype_rule=F32,
      doc="a decode attention with the rope_kv_write of its q and caches folded in: one kernel "
          "rotates q, writes the new k / v rows and attends (passes/fusion.py)")


class RopeOps:
    """Builder methods; ``self`` is the Graph."""

    def rope(self, x, cos, sin, *, n_rot=None, interleaved: bool = False, position_offset=0,
             positions=None):
        """Rotary position embedding of x [B, H, S, D] (or [B, S, D], one head), f32, f16 or
        bf16 (the result in x's dtype, rotated in f32).

        The first ``n_rot`` dims (default D; even, <= D) are rotated in pairs, the other
        D - n_rot pass through. Pairs are (i, i + n_rot/2) (NeoX / Llama half split) by
        default, (2i, 2i + 1) (GPT-J) with ``interleaved=True``; pair i of the token at
        position p becomes (x0 cos - x1 sin, x1 cos + x0 sin) with cos = cos[p, i],
        sin = sin[p, i]. cos and sin are [max_pos, n_rot/2] tensors (inputs, params or
        constants; f32, or x's dtype), e.g. cos[p, i] = cos(p * base**(-2i/n_rot)).

        The position of token s is ``position_offset + s`` (a Python int, checked here:
        position_offset + S <= max_pos), or ``positions[s]`` / ``positions[b, s]`` when
        ``positions`` (an i32/i64 tensor [S] or [B, S]) is given; that is how one compiled
        decode graph moves forward from run to run. Positions fed to run() as host arrays are
        range-checked there (IndexError); in-graph and device-array positions are clamped to
        [0, max_pos - 1]. Returns x's shape and dtype."""
        op = "rope"
        self.check(op, "x", x)
        self.check(op, "cos", cos)
        self.check(op, "sin", sin)
        if n_rot is None:
            n_rot = x.shape[-1] if x.shape else 0
        ins = [x, cos, sin]
        if positions is not None:
            ins.append(self.check(op, "positions", positions))
        return self.bind(op, ins, n_rot=_as_int(n_rot), interleaved=interleaved,
                         position_offset=_as_int(position_offset))

    def axial_rope2d(self, x, end_x: int, end_y: int, theta: float = 10000.0):
        """SAM 2's axial RoPE (compute_axial_cis + apply_rotary_enc) of x [B, H, T, D] (or
        [B, T, D]) with T = end_x * end_y: token t sits at column t % end_x, row t // end_x;
        pairs (2j, 2j + 1) rotate as complex numbers, the first D/4 pairs by the column at
        frequencies theta ** (-4j / D), the last D/4 by the row. The rope op with interleaved
        pairs and these angles as its cos / sin tables (f32 constants), so it keeps rope's
        kernel, dtypes and VJP."""
        op = "axial_rope2d"
        self.check(op, "x", x)
        for arg, v in (("end_x", end_x), ("end_y", end_y)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{op}: {arg} must be a positive int, got {v!r}")
        if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not theta > 0:
            raise ValueError(f"{op}: theta must be a positive number, got {theta!r}")
        if x.ndim not in (3, 4) or x.shape[-2] != end_x * end_y or x.shape[-1] % 4:
            raise ValueError(f"{op}: x must be [B, H, T, D] or [B, T, D] with T = end_x * end_y "
                             f"= {end_x * end_y} and D a multiple of 4, got {fmt(x.shape)}")
        d = x.shape[-1]
        freqs = 1.0 / theta ** (np.arange(0, d, 4)[: d // 4] / d)
        t = np.arange(end_x * end_y)
        ang = np.concatenate([np.outer(t % end_x, freqs), np.outer(t // end_x, freqs)], axis=1)
        return self.rope(x, self.constant(np.cos(ang).astype(np.float32)),
                         self.constant(np.sin(ang).astype(np.float32)), interleaved=True)

    def kv_write(self, cache, new, position):
        """Write ``new`` [B, H, s, D] into ``cache`` [B, H, max_S, D] at rows
        position .. position + s - 1 IN PLACE, and return the updated cache: a tensor that
        shares the cache's memory (no copy of the cache is made; only the s new rows move).

        ``position`` is a Python int (checked here: 0 <= position, position + s <= max_S) or
        an i32/i64 tensor of shape [] or [1], typically a run() input. A position fed to run()
        as a host array is range-checked there (IndexError unless 0 <= position <= max_S - s);
        an in-graph or device-array position is not checked: rows that would land outside
        [0, max_S) are dropped (never written out of bounds), the others are written.

        cache and new have the same dtype (f32, f16 or bf16 activations; any dtype is copied bit
        for bit; a mismatch is a ValueError).
        A param cache keeps its arena slot across runs, so what one run writes is there in the
        next (set it once with set_param, e.g. to zeros). An input cache is copied in on
        every run. A constant cannot be a cache (a constant's values must not change).

        The write happens when its step runs, in graph order: read the cache through the
        returned tensor. compile() raises if a node built after the kv_write still reads the
        cache tensor itself (its old contents are gone). kv_write nodes always run, even when
        nothing reads their result (the write to a param is the point).

        Decode, one compiled graph replayed token after token::

            kc = g.param("k_cache", (B, H, MAX_S, D)); vc = g.param("v_cache", (B, H, MAX_S, D))
            pos = g.input("pos", (1,), "i32")          # tokens already in the cache
            q = g.rope(q_new, cos, sin, positions=pos)  # q_new, k_new, v_new [B, H, 1, D]
            k_all = g.kv_write(kc, g.rope(k_new, cos, sin, positions=pos), pos)
            v_all = g.kv_write(vc, v_new, pos)
            keep = g.constant(np.arange(MAX_S)) <= pos  # [MAX_S] bool: keys 0..pos are valid
            y = g.attention(q, k_all, v_all, mask=keep)
            # run with {"pos": np.array([t], np.int32)} for t = 0, 1, 2, ...

        With s > 1 new tokens (a chunked prefill), query i sits at pos + i: positions
        ``pos + g.constant(np.arange(s))`` for rope, and the mask
        ``g.constant(np.arange(MAX_S)[None, :]) <= pos + g.constant(np.arange(s)[:, None])``
        ([s, MAX_S], broadcast by attention over batch and heads)."""
        op = "kv_write"
        self.check(op, "cache", cache)
        self.check(op, "new", new)
        _not_constant(op, "cache", cache)
        ins = [cache, new]
        p = self._write_position(op, "position", position, ins)
        return self.bind(op, ins, position=p)

    def _write_position(self, op, arg, position, ins):
        """The first row an in-place write goes to: an int (returned, checked by the op's
        inference), or a scalar index tensor (appended to ``ins``; None)."""
        p = _int(op, arg, position)
        if p is not None:
            return p
        if not (hasattr(position, "graph") and hasattr(position, "node")):
            raise ValueError(f"{op}: {arg} must be an int or an i32/i64 tensor of shape [] or "
                             f"[1], got {type(position).__name__}")
        ins.append(self.check(op, arg, position))
        return None

    def rope_kv_write(self, qkv, cos, sin, k_cache, v_cache, cache_position, *, num_heads: int,
                      num_kv_heads: int, n_rot=None, interleaved: bool = False, positions=None):
        """RoPE of q and k and the KV-cache write, in one kernel, from the packed output of a
        fused Q/K/V product: ``qkv`` [B, S, (Hq + 2 Hkv) * D] (f32, f16 or bf16; the caches of
        the same dtype), each token's row the Hq query
        heads, then the Hkv key heads, then the Hkv value heads (D each: the product of
        concatenated q/k/v weights). Returns ``(q, k_all, v_all)``:

        - q: the rotated queries, [B, Hq, S, D] in qkv's dtype (a new tensor);
        - k_all, v_all: ``k_cache`` / ``v_cache`` [B, Hkv, max_S, D] after the rotated keys and
          the plain values of the S tokens were written IN PLACE at rows cache_position ..
          cache_position + S - 1 (as kv_write: the results share the caches' memory; read the
          caches through them).

        Rotation as in ``rope`` (``n_rot``, ``interleaved``, cos / sin [max_pos, n_rot/2]);
        ``cache_position`` as kv_write's ``position`` (a Python int, or an i32/i64 tensor of
        shape [] or [1]; a host-array run() input is range-checked, an in-graph one is not: rows
        landing outside the cache are dropped). Token s's rope position is
        ``positions[s]`` / ``positions[b, s]`` when ``positions`` (an i32/i64 tensor [S] or
        [B, S]) is given (per-row positions of left-padded batches), else
        cache_position + s; positions are clamped to [0, max_pos - 1] on the device (run()
        range-checks host-array inputs).

        When q and the caches feed one decode attention and nothing else reads them, compile()
        folds this op into that attention's kernel (passes/fusion.py): the same values and
        cache contents, one launch fewer."""
        op = "rope_kv_write"
        for arg, t in (("qkv", qkv), ("cos", cos), ("sin", sin), ("k_cache", k_cache),
                       ("v_cache", v_cache)):
            self.check(op, arg, t)
        d = k_cache.shape[-1] if len(k_cache.shape) == 4 else None
        if n_rot is None:
            n_rot = d
        ins = [qkv, cos, sin, k_cache, v_cache]
        p = self._write_position(op, "cache_position", cache_position, ins)
        if positions is not None:
            ins.append(self.check(op, "positions", positions))
        attrs = dict(num_heads=_as_int(num_heads), num_kv_heads=_as_int(num_kv_heads),
                     head_dim=d, n_rot=_as_int(n_rot), interleaved=interleaved,
                     cache_position=p, has_positions=positions is not None)
        for arg, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            _not_constant(op, arg, t)
        if _base(k_cache).id == _base(v_cache).id:
            raise ValueError(f"{op}: k_cache and v_cache share the memory of %{_base(k_cache).id}; "
                             f"they must be distinct tensors")
        # q, and the caches after the write: aliases of their memory that q's kernel fills
        return self.bind(op, ins, **attrs)


# ---- VJPs (ir/autodiff.py) -----------------------------------------------------------------------
def _pairs(g, t, nr, interleaved):
    """(first, second) halves of the rotated pairs of t [..., D]: [..., nr/2] each."""
    lead, half = tuple(t.shape[:-1]), nr // 2
    r = g.narrow(t, -1, 0, nr) if nr != t.shape[-1] else t
    if not interleaved:
        return g.narrow(r, -1, 0, half), g.narrow(r, -1, half, half)
    r = g.reshape(r, lead + (half, 2))
    return (g.reshape(g.narrow(r, -1, 0, 1), lead + (half,)),
            g.reshape(g.narrow(r, -1, 1, 1), lead + (half,)))


@vjp("rope")
def _vjp_rope(g, n, dy):
    """dx: dy rotated by the opposite angle (rope with -sin: the rotation's transpose), the
    pass-through dims unchanged. d cos / d sin: per token dy0 x0 + dy1 x1 and dy1 x0 - dy0 x1,
    summed over batch and heads, then added into the table rows of the token positions (a
    slice for position_offset, a scatter_add for a positions tensor, clamped to the table
    as the forward clamps)."""
    ins = [g.tensor(i) for i in n.inputs]
    x, cos, sin = ins[:3]
    pos = ins[3] if len(ins) > 3 else None
    a = n.attrs
    nr, inter, off = a["n_rot"], a["interleaved"], a["position_offset"]
    if dy.dtype != x.dtype:           # (as torch's autograd: a gradient takes its tensor's dtype)
        dy = g.cast(dy, x.dtype)
    dx = g.rope(dy, cos, -sin, n_rot=nr, interleaved=inter, position_offset=off, positions=pos)
    rest = [None] if pos is not None else []
    if cos.node.op == "constant" and sin.node.op == "constant":    # the usual tables
        return [dx, None, None] + rest
    if x.dtype != dt.F32:             # the tables' gradients summed in f32
        x, dy = g.cast(x, dt.F32), g.cast(dy, dt.F32)
    x0, x1 = _pairs(g, x, nr, inter)
    d0, d1 = _pairs(g, dy, nr, inter)
    half, max_pos = nr // 2, cos.shape[0]
    b, s = x.shape[0], x.shape[-2]
    heads = (1,) if len(x.shape) == 4 else ()
    out = []
    for per_tok in (d0 * x0 + d1 * x1, d1 * x0 - d0 * x1):      # [B, (H,) S, half]
        if heads:
            per_tok = g.reduce_sum(per_tok, 1)                    # [B, S, half]
        if pos is None or len(pos.shape) == 1:
            per_pos = g.reduce_sum(per_tok, 0)                    # [S, half]
        else:
            per_pos = g.reshape(per_tok, (b * s, half))
        if pos is None:
            parts = [per_pos]
            if off:
                parts.insert(0, zeros(g, (off, half)))
            if max_pos - off - s:
                parts.append(zeros(g, (max_pos - off - s, half)))
            out.append(g.concat(parts, 0) if len(parts) > 1 else per_pos)
        else:
            p = g.reshape(pos, (pos.shape[0] * (pos.shape[1] if len(pos.shape) == 2 else 1),))
            p = g.min(g.max(p, 0), max_pos - 1)
            out.append(scatter_grad(g, zeros(g, (max_pos, half)), p, per_pos, 0))
    if cos.dtype != dt.F32:           # half tables: their gradients in their dtype
        out = [g.cast(t, cos.dtype) for t in out]
    return [dx, out[0], out[1]] + rest


def _no_gradient(why):
    def fn(g, n, dy):
        raise ValueError(f"grad: op {n.op} (%{n.id} {fmt(n.shape)}) has no gradient: {why}")
    return fn


# In-place cache writes carry no gradient: the cache's old contents are gone (and a param
# cache is rewritten by every run), so no gradient can reach the values it held. Raised only
# when a gradient has to flow through one (train on the prefill path: attention over the
# fresh k/v, no cache).
vjp("kv_write", "kv_written")(_no_gradient(
    "it writes a KV cache in place; differentiate a graph without the cache (attention over "
    "the new k / v themselves)"))
vjp("rope_kv_write")(_no_gradient(
    "it writes the KV caches in place; build training graphs from rope, attention and "
    "separate q / k / v instead"))
