"""The optimizer update as a graph node: compile_train's (train.py) last node.

  "optim_update"  one multi-tensor update of every trained param (kernels/optim.py): it
                  writes, in place, the flat f32 buffer holding the params (input 0: memory
                  kind INPLACE, its result aliases it), the optimizer state buffers, the half
                  copies of the params the forward reads (mixed precision) and the loss
                  scaler; runtime/lower_optim.py lowers it to [clip sum of squares] [found-inf
                  flags] the update [the scale update].

Inputs, in order: ``params`` (f32 [total]), ``hyper`` (f32 [4]: the per-step values the host
writes, optim.py), the ``nstates`` state buffers (f32 [total] each), the ``len(sizes)``
gradients (f32, param k's has sizes[k] elements), the trained params themselves (views the
trainer binds into ``params``: listed so the node declares that it writes them), then
``halves`` ([total] in the half dtype) when ``half_offsets`` is given, then ``scaler`` (f32
[3]: scale, clean steps, found inf) when ``scaling`` is given.

Attributes: ``rule`` "sgd" | "adam" and ``hp`` its hyperparameters ((name, value) pairs:
sgd momentum, dampening, weight_decay, nesterov; adam beta1, beta2, eps, weight_decay,
decoupled, amsgrad); ``offsets`` / ``sizes`` of param k in ``params`` (and in the states);
``half_offsets`` (param k's half copy in ``halves``, -1 for none) or None; ``max_norm``
(clip_grad_norm) or None; ``scaling`` (growth_factor, backoff_factor, growth_interval) or None.
"""
from __future__ import annotations

from . import dtypes as dt
from .opdef import F32, INPLACE, defop
from .ops import fmt

RULES = {"sgd": ("momentum", "dampening", "weight_decay", "nesterov"),
         "adam": ("beta1", "beta2", "eps", "weight_decay", "decoupled", "amsgrad")}
NSTATES = {"sgd": (0, 1), "adam": (2, 3)}     # the state counts a rule may keep


def operands(node) -> dict:
    """An optim_update node's input ids by role: params, hyper, states, grads, trained,
    halves (or None), scaler (or None)."""
    a, ins = node.attrs, list(node.inputs)
    n, s = len(a["sizes"]), a["nstates"]
    out = {"params": ins[0], "hyper": ins[1], "states": ins[2:2 + s],
           "grads": ins[2 + s:2 + s + n], "trained": ins[2 + s + n:2 + s + 2 * n]}
    rest = ins[2 + s + 2 * n:]
    out["halves"] = rest.pop(0) if a["half_offsets"] is not None else None
    out["scaler"] = rest.pop(0) if a["scaling"] is not None else None
    return out


def infer_optim_update(params, hyper, *rest, rule, hp, nstates, offsets, sizes,
                       half_offsets=None, max_norm=None, scaling=None):
    op = "optim_update"
    if rule not in RULES:
        raise ValueError(f"{op}: rule must be one of {', '.join(RULES)}, got {rule!r}")
    names = tuple(k for k, _ in hp)
    if names != RULES[rule]:
        raise ValueError(f"{op}: rule {rule!r} takes hp {RULES[rule]}, got {names}")
    if nstates not in NSTATES[rule]:
        raise ValueError(f"{op}: rule {rule!r} keeps {' or '.join(map(str, NSTATES[rule]))} "
                         f"state buffers, got nstates={nstates}")
    n = len(sizes)
    if len(offsets) != n or not n:
        raise ValueError(f"{op}: offsets ({len(offsets)}) and sizes ({n}) must name the same "
                         f"params, at least one")
    want = 2 * n + nstates + (half_offsets is not None) + (scaling is not None)
    if len(rest) != want:
        raise ValueError(f"{op}: expected {2 + want} inputs (params, hyper, {nstates} states, "
                         f"{n} grads, {n} trained params"
                         f"{', halves' if half_offsets is not None else ''}"
                         f"{', scaler' if scaling is not None else ''}), got {2 + len(rest)}")
    total = params.node.size
    if params.dtype != dt.F32 or len(params.shape) != 1:
        raise ValueError(f"{op}: params must be f32 [total], got {params.dtype} "
                         f"{fmt(params.shape)}")
    if any(o < 0 or o + s > total for o, s in zip(offsets, sizes)):
        raise ValueError(f"{op}: a param's [offset, offset + size) leaves params "
                         f"{fmt(params.shape)}: offsets {offsets}, sizes {sizes}")
    if hyper.dtype != dt.F32 or hyper.node.size != 4:
        raise ValueError(f"{op}: hyper must be f32 [4], got {hyper.dtype} {fmt(hyper.shape)}")
    states, grads = rest[:nstates], rest[nstates:nstates + n]
    trained, extra = rest[nstates + n:nstates + 2 * n], list(rest[nstates + 2 * n:])
    for k, s in enumerate(states):
        if s.dtype != dt.F32 or tuple(s.shape) != tuple(params.shape):
            raise ValueError(f"{op}: states[{k}] must be f32 {fmt(params.shape)} like params, "
                             f"got {s.dtype} {fmt(s.shape)}")
    for k, (g, p, size) in enumerate(zip(grads, trained, sizes)):
        if g.dtype != dt.F32 or g.node.size != size:
            raise ValueError(f"{op}: grads[{k}] must be f32 with {size} elements, got "
                             f"{g.dtype} {fmt(g.shape)}")
        if p.dtype != dt.F32 or p.node.size != size:
            raise ValueError(f"{op}: trained[{k}] must be an f32 param with {size} elements, "
                             f"got {p.dtype} {fmt(p.shape)}")
    if half_offsets is not None:
        h = extra.pop(0)
        if h.dtype not in (dt.F16, dt.BF16) or tuple(h.shape) != tuple(params.shape):
            raise ValueError(f"{op}: halves must be f16 or bf16 {fmt(params.shape)}, got "
                             f"{h.dtype} {fmt(h.shape)}")
        if len(half_offsets) != n:
            raise ValueError(f"{op}: half_offsets must have {n} entries, got "
                             f"{len(half_offsets)}")
    if scaling is not None:
        sc = extra.pop(0)
        if sc.dtype != dt.F32 or tuple(sc.shape) != (3,):
            raise ValueError(f"{op}: scaler must be f32 [3], got {sc.dtype} {fmt(sc.shape)}")
        if len(scaling) != 3:
            raise ValueError(f"{op}: scaling must be (growth_factor, backoff_factor, "
                             f"growth_interval), got {scaling!r}")
    return params.shape, dt.F32


defop("optim_update", infer_optim_update, memory=INPLACE, dtype_rule=F32,
      doc="the multi-tensor optimizer update (compile_train): params, state, half copies and "
          "the loss scaler written in place")
