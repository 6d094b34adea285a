"""Gated DeltaNet (Qwen3-Next's linear attention; fla's chunk_gated_delta_rule), a builder
method mixed into Graph, with its decode step.

Per head the state S [Dk, Dv] evolves token by token (fla's naive recurrent reference):
S <- S exp(g_t); u_t = beta_t (v_t - S^T k_t); S <- S + k_t u_t^T; o_t = S^T q_t, with q scaled
by Dk ** -0.5 (after an optional l2 norm of q and k over Dk).

Built in the chunked form of fla and of transformers' torch_chunk_gated_delta_rule. The
tokens split into chunks of C; everything that does not need the state runs for all chunks at
once as batched products and element-wise ops: the within-chunk decays exp(G_i - G_j) (G the
chunk's running sum of g), the unit lower-triangular system (I - A)^-1 of the delta rule (the
op "unit_lower_inverse_scaled": forward substitution, a block a chunk, writing the two
column-scaled copies (I - A)^-1 diag(beta) and -(I - A)^-1 diag(beta exp(G)) the products
read; its VJP two batched products), u = (I - A)^-1 beta v, W = (I - A)^-1 beta k exp(G),
the within-chunk attention and the decayed keys. Only the state pass is sequential, the op
"delta_state_scan" (one kernel for all chunks, kernels/delta.py):

    h_n entering chunk n;  v'_n = u_n - W_n h_n;  h_{n+1} = exp(G_last) h_n + K_dec^T v'_n

after which o = (q exp(G)) h_n + attn v'_n for all chunks at once. Its VJP is the same op run
backwards over the chunks (the adjoint state obeys the transposed recurrence) and batched
products. Padding tokens (g = 0, beta = 0) leave the state unchanged."""
from __future__ import annotations

import numpy as np

from . import dtypes as dt
from .autodiff import vjp, zeros
from .opdef import F32_ONLY, defop
from .ops import fmt

# Shared memory (f32 words) the state pass's kernel may use (dynamic shared memory: 120 KB,
# two blocks of the GPU's geometry a multiprocessor on an H100 / H200). A block holds S's
# [Dk, VS] slice, X's [C, VS] and P and Q [C, Dk] of a chunk (kernels/delta.py); with up to
# SCAN_MAX_COLUMNS columns and SCAN_MAX_ROWS thread rows, the builder picks C to fit. (GPUs
# allowing a block less get a smaller layout at lowering: kernels/delta.py fit_state_scan.)
SCAN_SHARED_FLOATS = 30 * 1024
SCAN_MAX_COLUMNS = 64
SCAN_MAX_ROWS = 16
MAX_DK = 256
MAX_CHUNK = 64      # unit_lower_inverse's kernel: [C, C] padded to 16, 32 or 64 in shared memory


def scan_shared_layout(k: int, c: int, vs: int, rt: int, shared_pq: bool = False) -> dict:
    """The state pass's shared memory (kernels/delta.py), in f32 words, for Dk = k, chunks of
    c, vs columns of V a block and rt thread rows: S [kp, vs + 4] (kp >= k: a thread's rows
    of S are a multiple of 4 consecutive ones), X [c, vs + 4], P [rt ceil(c / rt), kp + 4]
    and Q [c, kp + 4] (rows padded by 16 bytes: rows a warp reads at once fall in distinct
    banks); offsets of each and the total. ``shared_pq``: Q in P's buffer (one staged at a
    time: GPUs with less shared memory a block)."""
    tr2 = -(-(-(-k // rt)) // 4) * 4
    kp, ks, vsp = rt * tr2, rt * tr2 + 4, vs + 4
    x = kp * vsp
    p = x + c * vsp
    p_end = p + rt * -(-c // rt) * ks
    q = p if shared_pq else p_end
    return dict(tr1=-(-c // rt), tr2=tr2, kp=kp, ks=ks, vsp=vsp, s=0, x=x, p=p, q=q,
                total=max(p_end, q + c * ks))


def scan_chunk_fits(dk: int, c: int) -> bool:
    """Whether the state pass's kernel fits chunks of c tokens with Dk = dk at any geometry
    (the most columns and thread rows)."""
    return scan_shared_layout(dk, c, SCAN_MAX_COLUMNS, SCAN_MAX_ROWS)["total"] \
        <= SCAN_SHARED_FLOATS


def _state_scan_dims(op, p, q, a, d, s0, bias=None):
    for arg, t in (("P", p), ("Q", q), ("A", a), ("d", d), ("s0", s0), ("bias", bias)):
        if t is not None and t.dtype != dt.F32:
            raise ValueError(f"{op}: {arg} must be f32, got {t.dtype} {fmt(t.shape)}")
    if len(p.shape) != 4 or q.shape != p.shape:
        raise ValueError(f"{op}: P and Q must be [G, N, C, K] of one shape, got P "
                         f"{fmt(p.shape)}, Q {fmt(q.shape)}")
    g, n, c, k = p.shape
    if len(a.shape) != 4 or a.shape[:3] != (g, n, c):
        raise ValueError(f"{op}: A must be [G, N, C, V] = [{g}, {n}, {c}, V], got "
                         f"{fmt(a.shape)}")
    v = a.shape[3]
    for arg, t, want in (("d", d, (g, n)), ("s0", s0, (g, k, v)),
                         ("bias", bias, (g, n, k, v))):
        if t is not None and tuple(t.shape) != want:
            raise ValueError(f"{op}: {arg} must be {fmt(want)}, got {fmt(t.shape)}")
    return g, n, c, k, v


def _infer_state_scan(p, q, a, d, s0, bias=None, *, reverse=False):
    """X [G, N, C, V]; further results: states [G, N, K, V] (entering each chunk), the
    final state [G, K, V]."""
    g, n, c, k, v = _state_scan_dims("delta_state_scan", p, q, a, d, s0, bias)
    return [((g, n, c, v), dt.F32), ((g, n, k, v), dt.F32), ((g, k, v), dt.F32)]


def _further_result(op):
    def infer(*inputs, **attrs):
        raise ValueError(f"{op}: a further result of delta_state_scan: that op's bind makes "
                         f"it, not a bind of its own")
    return infer


defop("delta_state_scan", _infer_state_scan, dtype_rule=F32_ONLY,
      results=(("delta_scan_states", None), ("delta_scan_final", None)),
      doc="the chunked gated delta rule's state pass: per chunk n (reversed when reverse) "
          "states[n] = S, X[n] = A[n] + P[n] S, S = d[n] S + Q[n]^T X[n] (+ bias[n]); "
          "-> (X, states, the final S)")
for _op in ("delta_scan_states", "delta_scan_final"):
    defop(_op, _further_result(_op), written_by=0, dtype_rule=F32_ONLY,
          doc="a further result of delta_state_scan, stored by its kernel")


def _pending(g):
    """delta_state_scan node id -> {result op: (the zero its VJP handed the scan, d result)}:
    a further result is no function of X, the node it hangs on, so its VJP keeps its
    gradient here for the scan's VJP (which runs later in the same grad() walk) and hands X a
    zero, so that the scan's VJP runs even when X itself is unused; that VJP drops the zeros."""
    return g.__dict__.setdefault("_delta_scan_grads", {})


@vjp("delta_scan_states", "delta_scan_final")
def _further_vjp(g, node, dy):
    x = g.tensor(node.inputs[0])
    z = zeros(g, x.shape)
    _pending(g).setdefault(x.id, {})[node.op] = (z.id, dy)
    return [z]


def _strip(g, dy, zids):
    """dy without the zeros the further results' VJPs added (None when nothing else is left)."""
    if dy is None or dy.id in zids:
        return None
    node = dy.node
    if node.op == "binary" and node.attrs.get("kind") == "add":
        a, b = (_strip(g, g.tensor(i), zids) for i in node.inputs)
        if a is None or b is None:
            return b if a is None else a
        return dy if (a.id, b.id) == tuple(node.inputs) else a + b
    return dy


@vjp("delta_state_scan")
def _state_scan_vjp(g, node, dx):
    """The adjoint G_n of the state entering chunk n + 1 runs the same recurrence backwards:
    X'_n = dX_n + Q_n G_n (dA_n), G_{n-1} = d_n G_n + P_n^T X'_n + dstates_n; then
    dP_n = X'_n S_n^T, dQ_n = X_n G_n^T, dd_n = <S_n, G_n>, dbias_n = G_n, ds0 = the last G."""
    ins = [g.tensor(i) for i in node.inputs]
    p, q, a, d, s0 = ins[:5]
    gg, n, c, k, v = _state_scan_dims("delta_state_scan", *ins)
    marked = _pending(g).pop(node.id, {})
    dx = _strip(g, dx, {z for z, _ in marked.values()})
    dstates = marked.get("delta_scan_states", (None, None))[1]
    dfinal = marked.get("delta_scan_final", (None, None))[1]
    x = g.tensor(node.id)
    states = g.tensor(next(r for r in node.results if g.nodes[r].op == "delta_scan_states"))
    dxt, adj, ds0 = g.bind("delta_state_scan",
                           [q, p, zeros(g, x.shape) if dx is None else dx, d,
                            zeros(g, s0.shape) if dfinal is None else dfinal]
                           + ([] if dstates is None else [dstates]),
                           reverse=not node.attrs.get("reverse", False))
    tr = (0, 1, 3, 2)
    dp = g.matmul(dxt, g.transpose(states, tr))
    dq = g.matmul(x, g.transpose(adj, tr))
    dd = g.reduce_sum(states * adj, [2, 3])
    return [dp, dq, dxt, dd, ds0] + ([adj] if len(ins) == 6 else [])


def _infer_unit_lower_inverse(a):
    if a.dtype != dt.F32 or len(a.shape) < 2 or a.shape[-1] != a.shape[-2] \
            or not 1 <= a.shape[-1] <= MAX_CHUNK:
        raise ValueError(f"unit_lower_inverse: A must be f32 [..., C, C] with C <= {MAX_CHUNK}, "
                         f"got {a.dtype} {fmt(a.shape)}")
    return a.shape, dt.F32


defop("unit_lower_inverse", _infer_unit_lower_inverse, dtype_rule=F32_ONLY,
      doc="(I - A)^-1 of A's strictly lower triangle, [..., C, C] (C <= 64)")


@vjp("unit_lower_inverse")
def _unit_lower_inverse_vjp(g, node, dt_):
    """T = (I - A)^-1: dT = T dA T, so dA = T^T dT T^T on the strictly lower triangle (the
    only part read)."""
    return [_inverse_da(g, g.tensor(node.id), dt_)]


def _inverse_da(g, t, dt_):
    """dA = T^T dT T^T on the strictly lower triangle, for T = (I - A)^-1 (dT = T dA T)."""
    c = t.shape[-1]
    tt = g.transpose(t, tuple(range(t.ndim - 2)) + (t.ndim - 1, t.ndim - 2))
    da = g.matmul(g.matmul(tt, dt_), tt)
    strict = g.constant(np.tril(np.ones((c, c), bool), -1))
    return g.where(strict, da, g.constant(np.zeros((), np.float32)))


def _infer_unit_lower_inverse_scaled(a, s1, s2):
    """T diag(s1) [..., C, C]; further results: T diag(s2), T."""
    _infer_unit_lower_inverse(a)
    for arg, t in (("s1", s1), ("s2", s2)):
        if t.dtype != dt.F32 or tuple(t.shape) != tuple(a.shape[:-1]):
            raise ValueError(f"unit_lower_inverse_scaled: {arg} must be f32 "
                             f"{fmt(a.shape[:-1])} (a column scale of each matrix of A "
                             f"{fmt(a.shape)}), got {t.dtype} {fmt(t.shape)}")
    return [(a.shape, dt.F32)] * 3


defop("unit_lower_inverse_scaled", _infer_unit_lower_inverse_scaled, dtype_rule=F32_ONLY,
      results=(("unit_lower_inverse_second", None), ("unit_lower_inverse_t", None)),
      doc="T = (I - A)^-1 of A's strictly lower triangle [..., C, C] (C <= 64) column-scaled "
          "twice, one kernel: -> (T diag(s1), T diag(s2), T), s1 and s2 [..., C]")
for _op in ("unit_lower_inverse_second", "unit_lower_inverse_t"):
    defop(_op, _further_result(_op), written_by=0, dtype_rule=F32_ONLY,
          doc="a further result of unit_lower_inverse_scaled, stored by its kernel (T only "
              "where something reads it)")
vjp("unit_lower_inverse_second", "unit_lower_inverse_t")(_further_vjp)


@vjp("unit_lower_inverse_scaled")
def _unit_lower_inverse_scaled_vjp(g, node, dx):
    """out_k = T diag(s_k): dT = sum_k dout_k diag(s_k) (+ dT of T itself), ds_k = the column
    sums of T * dout_k; then dA = T^T dT T^T on the strict lower triangle, as
    unit_lower_inverse's."""
    a, s1, s2 = (g.tensor(i) for i in node.inputs)
    marked = _pending(g).pop(node.id, {})
    d1 = _strip(g, dx, {z for z, _ in marked.values()})
    d2 = marked.get("unit_lower_inverse_second", (None, None))[1]
    t = g.tensor(next(r for r in node.results if g.nodes[r].op == "unit_lower_inverse_t"))
    c = a.shape[-1]
    dt_ = marked.get("unit_lower_inverse_t", (None, None))[1]
    grads = []
    for d, sk in ((d1, s1), (d2, s2)):
        if d is None:
            grads.append(None)
            continue
        term = d * g.reshape(sk, sk.shape[:-1] + (1, c))
        dt_ = term if dt_ is None else dt_ + term
        grads.append(g.reduce_sum(t * d, [a.ndim - 2]))
    if dt_ is None:
        return [None] + grads
    return [_inverse_da(g, t, dt_)] + grads


def _check(op, q, k, v, g_, beta, initial_state, scale, state_arg="initial_state"):
    for arg, t in (("q", q), ("k", k), ("v", v), ("g", g_), ("beta", beta)):
        if t.dtype != dt.F32:
            raise ValueError(f"{op}: {arg} must be f32 (cast half tensors first), got {t.dtype} "
                             f"{fmt(t.shape)}")
    if len(q.shape) != 4 or q.shape != k.shape:
        raise ValueError(f"{op}: q and k must be [B, T, H, Dk] of one shape, got q "
                         f"{fmt(q.shape)}, k {fmt(k.shape)}")
    b, t, h, _ = q.shape
    if len(v.shape) != 4 or v.shape[:3] != (b, t, h):
        raise ValueError(f"{op}: v must be [B, T, H, Dv] = [{b}, {t}, {h}, Dv], got "
                         f"{fmt(v.shape)}")
    for arg, x in (("g", g_), ("beta", beta)):
        if x.shape != (b, t, h):
            raise ValueError(f"{op}: {arg} must be [B, T, H] = {fmt((b, t, h))}, got "
                             f"{fmt(x.shape)}")
    if initial_state is not None:
        want = (b, h, q.shape[3], v.shape[3])
        if initial_state.dtype != dt.F32 or initial_state.shape != want:
            raise ValueError(f"{op}: {state_arg} must be f32 {fmt(want)}, got "
                             f"{initial_state.dtype} {fmt(initial_state.shape)}")
    if scale is not None and (not isinstance(scale, (int, float)) or isinstance(scale, bool)
                              or not np.isfinite(scale)):
        raise ValueError(f"{op}: scale must be a finite number or None, got {scale!r}")


class DeltaOps:
    """Builder methods; self is the Graph."""

    def gated_delta_net(self, q, k, v, g_, beta, *, scale=None, initial_state=None,
                        use_qk_l2norm=False, chunk_size=64):
        """(o [B, T, H, Dv], final_state [B, H, Dk, Dv]) of the gated delta rule over q, k
        [B, T, H, Dk], v [B, T, H, Dv], g_ (log decay) and beta [B, T, H]; scale None =
        Dk ** -0.5; initial_state [B, H, Dk, Dv] or zeros; use_qk_l2norm: q and k divided by
        sqrt(sum x^2 + 1e-6) over Dk first. f32. ``chunk_size``: tokens a chunk (the result
        does not depend on it beyond rounding; at most 64, the next power of two >= T, and
        what the state pass's shared memory holds for Dk are used)."""
        op = "gated_delta_net"
        for arg, t in (("q", q), ("k", k), ("v", v), ("g_", g_), ("beta", beta)):
            self.check(op, arg, t)
        if initial_state is not None:
            self.check(op, "initial_state", initial_state)
        _check(op, q, k, v, g_, beta, initial_state, scale)
        if not isinstance(use_qk_l2norm, bool):
            raise ValueError(f"{op}: use_qk_l2norm must be a bool, got {use_qk_l2norm!r}")
        if (not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1
                or chunk_size & (chunk_size - 1)):
            raise ValueError(f"{op}: chunk_size must be a power of two, got {chunk_size!r}")
        b, t, h, dk = q.shape
        dv = v.shape[3]
        if dk > MAX_DK:
            raise ValueError(f"{op}: Dk must be at most {MAX_DK}, got q {fmt(q.shape)}")
        c = min(chunk_size, MAX_CHUNK, 1 << max(0, (t - 1).bit_length()))
        while not scan_chunk_fits(dk, c):
            c //= 2                 # the state pass's shared memory bounds the chunk
        n = -(-t // c)
        qs = float(dk ** -0.5 if scale is None else scale)
        if use_qk_l2norm:
            q, k = self._l2norm(q, qs), self._l2norm(k)
        else:
            q = q * qs

        def heads(x, d):          # [B, T, H(, D)] -> [B, H, N, C(, D)], T padded with zeros
            x = self.transpose(x, (0, 2, 1, 3) if d else (0, 2, 1))
            if n * c != t:
                pad = (b, h, n * c - t) + ((d,) if d else ())
                x = self.concat([x, self.constant(np.zeros(pad, np.float32))], 2)
            return self.reshape(x, (b, h, n, c) + ((d,) if d else ()))

        q, k, v = heads(q, dk), heads(k, dk), heads(v, dv)
        gs = self.cumsum(heads(g_, 0), 3)                     # G: the chunk's running log decay
        # beta (and exp(G)) scale the rows of k and v; they are applied to the [C, C] factors
        # instead (a row scale of A, a column scale of (I - A)^-1): passes over [C, C] per
        # chunk rather than over [C, D] ones
        bh = heads(beta, 0)
        lower = self.constant(np.tril(np.ones((c, c), bool)))
        strict = self.constant(np.tril(np.ones((c, c), bool), -1))
        zero = self.constant(np.zeros((), np.float32))
        gi = self.reshape(gs, (b, h, n, c, 1))
        gj = self.reshape(gs, (b, h, n, 1, c))

        def decay(mask):
            # exp(G_i - G_j) where mask; the exponent is masked first so that no exp overflows
            # above the diagonal (its gradient would be 0 * inf there). Built once for each
            # reader: a chain with one reader of its shape fuses into that reader's kernel,
            # so the [C, C] decays are never stored
            return self.activation("exp", self.where(mask, gi - gj, zero))
        kt = self.transpose(k, (0, 1, 2, 4, 3))
        # A = -diag(beta) (k k^T * decay), its strict triangle
        a = self.where(strict, -(self.matmul(k, kt) * decay(strict)
                                 * self.reshape(bh, (b, h, n, c, 1))), zero)
        # u = (I - A)^-1 diag(beta) v and -W = -(I - A)^-1 diag(beta exp(G)) k (the state pass
        # adds P h, P = -W): the inverse's kernel writes both column-scaled copies, so neither
        # scale is a pass over [C, C] of its own
        bw = -(bh * self.activation("exp", gs))
        tri_b, tri_w, _ = self.bind("unit_lower_inverse_scaled", [a, bh, bw])
        u = self.matmul(tri_b, v)                              # [B, H, N, C, Dv]
        w_neg = self.matmul(tri_w, k)
        attn = self.where(lower, self.matmul(q, kt) * decay(lower), zero)   # within a chunk
        # G_last, the chunk's total log decay: only element-wise kernels read it (exp before
        # any reshape), so it is a strided narrow read in place, not a copy
        g_last = self.narrow(gs, 3, c - 1, 1)                  # [B, H, N, 1]
        k_dec = k * self.reshape(self.activation("exp", g_last - gs), (b, h, n, c, 1))
        s_dec = self.reshape(self.activation("exp", g_last), (b * h, n))
        s0 = self.reshape(initial_state, (b * h, dk, dv)) if initial_state is not None else \
            self.constant(np.zeros((b * h, dk, dv), np.float32))
        v_new, states, last = self.bind(
            "delta_state_scan", [self.reshape(w_neg, (b * h, n, c, dk)),
                                 self.reshape(k_dec, (b * h, n, c, dk)),
                                 self.reshape(u, (b * h, n, c, dv)), s_dec, s0])
        states = self.reshape(states, (b, h, n, dk, dv))       # h_n entering each chunk
        v_new = self.reshape(v_new, (b, h, n, c, dv))
        # (q exp(G)) h_n as exp(G) (q h_n): the row scale on the product, not a pass over q
        o = self.activation("exp", gi) * self.matmul(q, states) + self.matmul(attn, v_new)
        o = self.reshape(o, (b, h, n * c, dv))
        if n * c != t:
            o = self.narrow(o, 2, 0, t)
        return self.transpose(o, (0, 2, 1, 3)), self.reshape(last, (b, h, dk, dv))

    def gated_delta_step(self, q, k, v, g_, beta, state, *, scale=None, use_qk_l2norm=False):
        """One token of the gated delta rule (the decode step; transformers'
        torch_recurrent_gated_delta_rule at T = 1): q, k [B, 1, H, Dk], v [B, 1, H, Dv], g_ and
        beta [B, 1, H], state [B, H, Dk, Dv] (None: zeros) -> (o [B, 1, H, Dv], the new state
        [B, H, Dk, Dv]), the layouts of gated_delta_net at T = 1. f32.

        S' = e S + k d^T with e = exp(g), d = beta (v - e S^T k); o = S'^T q = e S^T q +
        (k . q) d: one batched product [q; k] @ S reads the state once, one fused
        element-wise pass writes the new one."""
        op = "gated_delta_step"
        for arg, t in (("q", q), ("k", k), ("v", v), ("g_", g_), ("beta", beta)):
            self.check(op, arg, t)
        if state is not None:
            self.check(op, "state", state)
        _check(op, q, k, v, g_, beta, state, scale, state_arg="state")
        if not isinstance(use_qk_l2norm, bool):
            raise ValueError(f"{op}: use_qk_l2norm must be a bool, got {use_qk_l2norm!r}")
        b, t, h, dk = q.shape
        dv = v.shape[3]
        if t != 1:
            raise ValueError(f"{op}: one token a step: q must be [B, 1, H, Dk], got "
                             f"{fmt(q.shape)} (gated_delta_net runs whole sequences)")
        qs = float(dk ** -0.5 if scale is None else scale)
        if use_qk_l2norm:
            q, k = self._l2norm(q, qs), self._l2norm(k)
        else:
            q = q * qs
        q, k = (self.reshape(x, (b, h, 1, dk)) for x in (q, k))   # [B, 1, H, D]: T = 1
        if state is None:
            state = self.constant(np.zeros((b, h, dk, dv), np.float32))
        m = self.matmul(self.concat([q, k], 2), state)            # [B, H, 2, Dv]
        sq, sk = self.narrow(m, 2, 0, 1), self.narrow(m, 2, 1, 1)
        e = self.activation("exp", self.reshape(g_, (b, h, 1, 1)))
        d = (self.reshape(v, (b, h, 1, dv)) - e * sk) * self.reshape(beta, (b, h, 1, 1))
        new = e * state + self.reshape(k, (b, h, dk, 1)) * d
        o = e * sq + self.reduce_sum(k * q, [3], keep_dim=True) * d
        return self.reshape(o, (b, 1, h, dv)), new

    def _l2norm(self, x, scale=1.0):
        """x / sqrt(sum x^2 + 1e-6) over the last axis, times ``scale``: rms_norm with eps
        1e-6 / D and gamma scale / sqrt(D) (x sqrt(D) rsqrt(sum x^2 + 1e-6) scale / sqrt(D)),
        one row kernel forward and backward."""
        d = x.shape[-1]
        return self.rms_norm(x, self.constant(np.full(d, scale / np.sqrt(d), np.float32)),
                             eps=1e-6 / d)
