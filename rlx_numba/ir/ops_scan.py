"""selective_scan (Mamba's S6, mamba_ssm's selective_scan_ref) and softplus: the scan's OpDefs
(ir/opdef.py), argument checks, the Graph builder methods (mixed into Graph) and its VJP.

The "selective_scan" node is the recurrence alone (kernels/scan.py, lowering
runtime/lower_scan.py): inputs u, delta, A, B, C; its output is flat, [y (B*D*L) | the last
state (B*D*N)], which the builder cuts into y [B, D, L] and last [B, D, N]. delta_bias,
softplus, the D skip and the z gate are graph ops around it, so autodiff covers them; the
node's VJP is one "selective_scan_grad" node, flat [dA | dB | dC | du | ddelta].
"""
from __future__ import annotations

from . import dtypes as dt
from .autodiff import vjp
from .opdef import F32_ONLY, defop
from .ops import fmt


_F32, _HALVES = dt.F32, (dt.F16, dt.BF16)   # (selective_state_update's argument dt shadows
                                             # the module)


def _desc(t):
    return f"{t.dtype} {fmt(t.shape)}"


def scan_dims(op, u, delta, A, B, C) -> tuple:
    """(batch, dim, length, state) of the scan's operands u, delta, A, B, C, checked."""
    for arg, t in (("u", u), ("delta", delta), ("A", A), ("B", B), ("C", C)):
        if t.dtype != dt.F32:
            raise ValueError(f"{op}: {arg} must be f32, got {_desc(t)}")
    if len(u.shape) != 3:
        raise ValueError(f"{op}: u must be [batch, dim, length], got {_desc(u)}")
    bt, dm, length = u.shape
    if len(A.shape) != 2 or A.shape[0] != dm:
        raise ValueError(f"{op}: A must be [{dm}, N] (dim of u {_desc(u)}), got {_desc(A)}")
    n = A.shape[1]
    if not 1 <= n <= 256:
        raise ValueError(f"{op}: A's state size must be 1..256, got {_desc(A)}")
    for arg, t, want in (("delta", delta, (bt, dm, length)), ("B", B, (bt, n, length)),
                         ("C", C, (bt, n, length))):
        if tuple(t.shape) != want:
            raise ValueError(f"{op}: {arg} must be f32 {fmt(want)} (u {_desc(u)}, A "
                             f"{_desc(A)}), got {_desc(t)}")
    return bt, dm, length, n


def infer_selective_scan(u, delta, A, B, C):
    """Flat [y (B*D*L) | the last state (B*D*N)]."""
    bt, dm, length, n = scan_dims("selective_scan", u, delta, A, B, C)
    return (bt * dm * length + bt * dm * n,), _F32


def infer_selective_scan_grad(u, delta, A, B, C, dflat):
    """Flat [dA | dB | dC | du | ddelta] from the forward's operands and its flat gradient."""
    bt, dm, length, n = scan_dims("selective_scan_grad", u, delta, A, B, C)
    want = (bt * dm * length + bt * dm * n,)
    if dflat.dtype != _F32 or tuple(dflat.shape) != want:
        raise ValueError(f"selective_scan_grad: dflat must be f32 {fmt(want)}, got "
                         f"{_desc(dflat)}")
    return (dm * n + 2 * bt * n * length + 2 * bt * dm * length,), _F32


defop("selective_scan", infer_selective_scan, dtype_rule=F32_ONLY,
      doc="Mamba's S6 recurrence: flat [y | the last state]")
defop("selective_scan_grad", infer_selective_scan_grad, dtype_rule=F32_ONLY,
      doc="selective_scan's gradient: flat [dA | dB | dC | du | ddelta]")


class ScanOps:
    """Builder methods; ``self`` is the Graph."""

    def softplus(self, x):
        """torch.nn.functional.softplus (beta 1): log(1 + exp(x)), as relu(x) + log1p(e) with
        e = exp(-|x|) (no exp overflows); log1p(e) as e (1 - e / 2) below e = 1e-3, where
        log(1 + e) would round 1 + e (its error there: e^3 / 3)."""
        self.check("softplus", "x", x)
        if x.dtype != dt.F32:
            raise ValueError(f"softplus: x must be f32, got {_desc(x)}")
        e = self.exp(self.neg(self.abs(x)))
        small = self.mul(e, self.sub(1.0, self.mul(e, 0.5)))
        return self.add(self.relu(x), self.where(self.lt(e, 1e-3), small,
                                                 self.log(self.add(e, 1.0))))

    def selective_scan(self, u, delta, A, B, C, D=None, z=None, delta_bias=None,
                       delta_softplus=False, return_last_state=False):
        """mamba_ssm's selective_scan_ref: u, delta [Bt, Dm, L], A [Dm, N], B, C [Bt, N, L],
        D [Dm], z [Bt, Dm, L], delta_bias [Dm]. delta += delta_bias, then softplus when
        ``delta_softplus``; x_l = exp(delta_l A) x_{l-1} + delta_l B_l u_l from x = 0,
        y_l = C_l . x_l (+ D u_l) (* silu(z_l)). Returns y [Bt, Dm, L], and with
        ``return_last_state`` (y, the last x [Bt, Dm, N])."""
        op = "selective_scan"
        for arg, t in (("u", u), ("delta", delta), ("A", A), ("B", B), ("C", C)):
            self.check(op, arg, t)
        # one float dtype for every operand (A may stay f32, as Mamba keeps A_log); a half
        # scan runs the recurrence in f32 (the kernel's) and returns that dtype
        fd = u.dtype
        for arg, t in (("delta", delta), ("B", B), ("C", C), ("D", D), ("z", z),
                       ("delta_bias", delta_bias), ("A", A)):
            if t is not None and t.dtype != fd and not (arg == "A" and t.dtype == _F32):
                raise ValueError(f"{op}: {arg} must be {fd} like u {_desc(u)}, got {_desc(t)}")
        if fd not in (_F32, *_HALVES):
            raise ValueError(f"{op}: u must be f32, f16 or bf16, got {_desc(u)}")
        f32 = (lambda t: t) if fd == _F32 else (lambda t: t if t.dtype == _F32 else self.cast(t, _F32))
        bt, dm, length, n = scan_dims(op, *(f32(t) for t in (u, delta, A, B, C)))
        want = {"D": (dm,), "z": (bt, dm, length), "delta_bias": (dm,)}
        for arg, t in (("D", D), ("z", z), ("delta_bias", delta_bias)):
            if t is None:
                continue
            self.check(op, arg, t)
            if tuple(t.shape) != want[arg]:
                raise ValueError(f"{op}: {arg} must be {fd} {fmt(want[arg])} (u {_desc(u)}, A "
                                 f"{_desc(A)}), got {_desc(t)}")
        if delta_bias is not None:
            delta = self.add(delta, self.reshape(delta_bias, (dm, 1)))
        if delta_softplus:
            delta = self.softplus(delta)
        ny, nl = bt * dm * length, bt * dm * n
        flat = self.bind(op, [f32(t) for t in (u, delta, A, B, C)])
        if fd != _F32:
            flat = self.cast(flat, fd)
        y = self.reshape(self.narrow(flat, 0, 0, ny), (bt, dm, length))
        if D is not None:
            y = self.add(y, self.mul(u, self.reshape(D, (dm, 1))))
        if z is not None:
            y = self.mul(y, self.silu(z))
        if return_last_state:
            return y, self.reshape(self.narrow(flat, 0, ny, nl), (bt, dm, n))
        return y

    def selective_state_update(self, state, x, dt, A, B, C, D=None, z=None, dt_bias=None,
                               dt_softplus=False):
        """One step of the scan (mamba_ssm's selective_state_update, generation): state
        [Bt, Dm, N], x and dt [Bt, Dm], B and C [Bt, N], A [Dm, N], D / dt_bias [Dm], z
        [Bt, Dm]. Returns (y [Bt, Dm], the next state): state' = exp(dt A) state + dt x B,
        y = C . state' (+ D x) (* silu(z)). Element-wise graph ops (fused)."""
        op = "selective_state_update"
        self.check(op, "state", state)
        if len(state.shape) != 3 or state.dtype not in (_F32, *_HALVES):
            raise ValueError(f"{op}: state must be float [batch, dim, N], got {_desc(state)}")
        fd = state.dtype
        bt, dm, n = state.shape
        want = {"x": (bt, dm), "dt": (bt, dm), "A": (dm, n), "B": (bt, n), "C": (bt, n),
                "D": (dm,), "z": (bt, dm), "dt_bias": (dm,)}
        for arg, t in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D), ("z", z),
                       ("dt_bias", dt_bias)):
            if t is None:
                continue
            self.check(op, arg, t)
            if tuple(t.shape) != want[arg] or t.dtype not in (fd, _F32 if arg == "A" else fd):
                raise ValueError(f"{op}: {arg} must be {fd} {fmt(want[arg])} (state "
                                 f"{_desc(state)}), got {_desc(t)}")
        if dt_bias is not None:
            dt = self.add(dt, dt_bias)
        if dt_softplus:
            dt = self.softplus(dt)
        dt3 = self.reshape(dt, (bt, dm, 1))
        new = self.add(self.mul(state, self.exp(self.mul(dt3, A))),
                       self.mul(self.mul(dt3, self.reshape(x, (bt, dm, 1))),
                                self.reshape(B, (bt, 1, n))))
        y = self.reduce_sum(self.mul(new, self.reshape(C, (bt, 1, n))), 2)
        if D is not None:
            y = self.add(y, self.mul(x, D))
        if z is not None:
            y = self.mul(y, self.silu(z))
        return y, new


@vjp("selective_scan")
def _selective_scan_vjp(g, node, dflat):
    u, delta, A, B, C = (g.tensor(i) for i in node.inputs)
    bt, dm, length = u.shape
    n = A.shape[1]
    sizes = {"dA": dm * n, "dB": bt * n * length, "dC": bt * n * length,
             "du": bt * dm * length, "ddelta": bt * dm * length}
    flat = g.bind("selective_scan_grad", [u, delta, A, B, C, dflat])
    out, at = {}, 0
    for name, size in sizes.items():
        out[name] = g.narrow(flat, 0, at, size)
        at += size
    return [g.reshape(out["du"], u.shape), g.reshape(out["ddelta"], u.shape),
            g.reshape(out["dA"], A.shape), g.reshape(out["dB"], B.shape),
            g.reshape(out["dC"], C.shape)]
