"""Gated DeltaNet (Qwen3-Next's linear attention; fla's chunk_gated_delta_rule), a builder
method mixed into Graph.

Per head the state S [Dk, Dv] evolves token by token (fla's naive recurrent reference):
S <- S exp(g_t); u_t = beta_t (v_t - S^T k_t); S <- S + k_t u_t^T; o_t = S^T q_t, with q scaled
by Dk ** -0.5 (after an optional l2 norm of q and k over Dk).

Built here in the chunked form of fla and of transformers' torch_chunk_gated_delta_rule,
from graph ops: the tokens split into chunks of C, everything inside a chunk is batched
products over all chunks at once -- the within-chunk decays exp(G_i - G_j) (G the chunk's
running sum of g), the unit lower-triangular system (I - A)^-1 of the delta rule solved as
(I + A)(I + A^2)(I + A^4)... (A is strictly lower, so A^C = 0: log2 C products instead of C
row updates) -- and only the state passes from chunk to chunk, through g.scan (unrolled: one
CUDA graph). Autodiff differentiates it through those ops' VJPs. Padding tokens (g = 0,
beta = 0) leave the state unchanged."""
from __future__ import annotations

import numpy as np

from . import dtypes as dt
from .ops import fmt


def _check(op, q, k, v, g_, beta, initial_state, scale):
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
            raise ValueError(f"{op}: initial_state must be f32 {fmt(want)}, got "
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
        does not depend on it beyond rounding; at most the next power of two >= T is used)."""
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
        c = min(chunk_size, 1 << max(0, (t - 1).bit_length()))
        n = -(-t // c)
        if use_qk_l2norm:
            q, k = (self._l2norm(x) for x in (q, k))
        q = q * float(dk ** -0.5 if scale is None else scale)

        def heads(x, d):          # [B, T, H(, D)] -> [B, H, N, C(, D)], T padded with zeros
            x = self.transpose(x, (0, 2, 1, 3) if d else (0, 2, 1))
            if n * c != t:
                pad = (b, h, n * c - t) + ((d,) if d else ())
                x = self.concat([x, self.constant(np.zeros(pad, np.float32))], 2)
            return self.reshape(x, (b, h, n, c) + ((d,) if d else ()))

        q, k, v = heads(q, dk), heads(k, dk), heads(v, dv)
        gs = self.cumsum(heads(g_, 0), 3)                     # G: the chunk's running log decay
        bt = self.reshape(heads(beta, 0), (b, h, n, c, 1))
        k_beta, v_beta = k * bt, v * bt
        lower = self.constant(np.tril(np.ones((c, c), bool)))
        strict = self.constant(np.tril(np.ones((c, c), bool), -1))
        zero = self.constant(np.zeros((), np.float32))
        gi = self.reshape(gs, (b, h, n, c, 1))
        diff = gi - self.reshape(gs, (b, h, n, 1, c))
        # exp(G_i - G_j) for j <= i; the exponent is masked first so that no exp overflows
        # above the diagonal (its gradient would be 0 * inf there)
        decay = self.where(lower, self.activation("exp", self.where(lower, diff, zero)), zero)
        kt = self.transpose(k, (0, 1, 2, 4, 3))
        a = self.where(strict, -(self.matmul(k_beta, kt) * decay), zero)
        tri = self._unit_lower_inverse(a, c)                   # (I - A)^-1
        u = self.matmul(tri, v_beta)                           # [B, H, N, C, Dv]
        k_cum = self.matmul(tri, k_beta * self.activation("exp", gi))
        attn = self.where(lower, self.matmul(q, kt) * decay, zero)   # within a chunk
        g_last = self.narrow(gs, 3, c - 1, 1)                  # [B, H, N, 1]
        k_dec = k * self.activation("exp", self.reshape(g_last - gs, (b, h, n, c, 1)))
        q_dec = q * self.activation("exp", gi)
        s_dec = self.activation("exp", self.reshape(g_last, (b, h, n, 1, 1)))
        chunk_first = lambda x: self.transpose(x, (2, 0, 1, 3, 4))   # noqa: E731
        xs = [chunk_first(x) for x in (q_dec, k_dec, u, k_cum, attn, s_dec)]
        s0 = initial_state if initial_state is not None else \
            self.constant(np.zeros((b, h, dk, dv), np.float32))

        def step(sub, s, qd, kd, un, kc, at, sd):
            v_new = un - sub.matmul(kc, s)
            out = sub.matmul(qd, s) + sub.matmul(at, v_new)
            s = s * sd + sub.matmul(sub.transpose(kd, (0, 1, 3, 2)), v_new)
            return [s], [out]

        (last,), (outs,) = self.scan(step, [s0], xs)          # outs [N, B, H, C, Dv]
        o = self.reshape(self.transpose(outs, (1, 2, 0, 3, 4)), (b, h, n * c, dv))
        if n * c != t:
            o = self.narrow(o, 2, 0, t)
        return self.transpose(o, (0, 2, 1, 3)), last

    def _l2norm(self, x):
        ss = self.reduce_sum(x * x, [x.ndim - 1], keep_dim=True)
        return x * self.activation("rsqrt", ss + 1e-6)

    def _unit_lower_inverse(self, a, c):
        """(I - A)^-1 for A strictly lower triangular [..., C, C]: (I + A)(I + A^2)(I + A^4)
        ... up to A^(C/2) (A^C = 0)."""
        eye = self.constant(np.eye(c, dtype=np.float32))
        inv, p = eye + a, a
        m = 2
        while m < c:
            p = self.matmul(p, p)
            inv = self.matmul(inv, eye + p)
            m *= 2
        return inv
