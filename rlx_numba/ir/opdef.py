"""One definition per op: the ``OpDef`` registry.

Every op the graph can hold is one ``OpDef``, declared beside its builder in ir/ops_*.py (as a
JAX lax primitive is one stanza): its name, its inference (inputs and attributes -> one or
more (shape, dtype) results, raising ValueError that names the op, the argument and the
shapes), its memory kind, its compute-dtype rule, its VJP (ir/autodiff.py ``vjp``) and its
ordered implementation tiers (runtime/lower*.py register them with ``tier`` / ``lowering``).
``Graph.bind(op, inputs, **attrs)`` builds a node from the definition alone; nothing else
decides shapes.

Memory kinds (what the memory plan, fusion and the scheduler read):

    leaf      input / param / constant: bound or uploaded, never computed
    fresh     the node owns a new buffer its own steps write
    view      the node aliases input 0's memory and runs nothing (``view_if`` narrows
              that down: a narrow is a view only of an aligned contiguous slice)
    inplace   the node writes into input 0's memory and its result aliases it

``written_by=k``: the node's memory is filled by the kernel of input k's node (its
producer), not by steps of its own: a further result of a multi-result op. The producer
finds such results in ``Node.results`` (``Graph.bind`` links them), never by scanning.

Compute-dtype rules (what an f16 / bf16 input computes in):

    storage   no arithmetic: values move in their own dtype (shape ops, gathers, collectives)
    f32       math in f32 whatever the float storage; results in the dtype inference gives
    f32-only  takes f32 operands only today (a half operand raises at build time)
    exact     integer / index results computed exactly (argmax, sort indices, compares)

f64: an op takes f64 operands (or gives an f64 result) only where its OpDef says ``f64=True``
(its kernels compute in f64 end to end: no f32 step anywhere); STORAGE ops, which only move
values, take them by default. Any other op raises ValueError at build time naming the op and
the dtype (``infer_results``, the one place every node's dtypes pass), never a silent f32.

c64: an op takes a c64 operand (or gives a c64 result) only where its OpDef says
``c64=True`` (the views between c64 and its [..., 2] f32 pairs, the c64 product cmatmul,
reshape; ir/ops_complex.py builds every other complex op from them); no other op does, STORAGE ops included (their kernels
move 4-byte or smaller elements). Any other op raises ValueError at build time naming the op,
the argument and its shape.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

LEAF, FRESH, VIEW, INPLACE = "leaf", "fresh", "view", "inplace"
MEMORY_KINDS = (LEAF, FRESH, VIEW, INPLACE)
STORAGE, F32, F32_ONLY, EXACT = "storage", "f32", "f32-only", "exact"
DTYPE_RULES = (STORAGE, F32, F32_ONLY, EXACT)


@dataclass
class Tier:
    """One way to run an op. ``plan(ctx, node)`` returns its steps (or None: it does not apply
    to this node after all, and the next tier is tried); ``available(ctx, node)`` returns None
    when the tier can run the node, else the reason it cannot (logged with
    RLX_NUMBA_LOG_FALLBACK=1). ``ctx`` is what a lowering sees of the executable. A tier
    with ``rewrite(g, node, inputs) -> Tensor`` instead runs as other ops: the compiler's
    legalise stage rebuilds the node so when the op's ``choose`` picks it."""
    name: str
    plan: Callable | None
    available: Callable | None = None
    rewrite: Callable | None = None


@dataclass
class OpDef:
    name: str
    infer: Callable | None           # (*inputs, **attrs) -> (shape, dtype) | [(shape, dtype), ...]
    memory: str = FRESH
    dtype_rule: str = F32
    doc: str = ""
    elementwise: bool = False        # one output element from the same element of each input
    view_if: Callable | None = None  # (node, graph) -> bool: a view only when this holds
    written_by: int | None = None    # the input whose node's kernel fills this node
    results: tuple = ()              # (op, aliased input or None) of each further result
    tier_env: str | None = None      # the RLX_NUMBA_*_TIERS variable restricting its tiers
    choose: Callable | None = None   # (graph, node) -> (tier index, why): picked at legalise
    vjp: Callable | None = None      # fn(g, node, dy) -> [d input, ...] (ir/autodiff.py)
    tiers: list = field(default_factory=list)
    owner: str = ""                  # the module that declared it
    f64: bool | None = None          # computes f64 in f64 (None: only STORAGE ops do)
    c64: bool = False                # takes / gives c64 (complex64)

    @property
    def takes_f64(self) -> bool:
        return self.dtype_rule == STORAGE if self.f64 is None else self.f64

    def infer_results(self, inputs, attrs) -> list:
        """[(shape, dtype), ...] for these inputs and attributes (ValueError for an f64
        operand or result of an op without f64 kernels, or a c64 one of an op without c64)."""
        if not self.c64:
            for i, t in enumerate(inputs):
                if getattr(t.dtype, "name", None) == C64_NAME:
                    raise ValueError(_no_c64(self.name, f"input {i} is c64 {list(t.shape)}"))
        if not self.takes_f64:
            for i, t in enumerate(inputs):
                if getattr(t.dtype, "name", None) == F64_NAME:
                    raise ValueError(_no_f64(self.name, f"input {i} is f64 "
                                                        f"{list(t.shape)}"))
        out = self.infer(*inputs, **attrs)
        if isinstance(out, tuple) and len(out) == 2 and not isinstance(out[1], tuple):
            out = [out]
        res = [(tuple(s), d) for s, d in out]
        if not self.takes_f64 and any(getattr(d, "name", None) == F64_NAME for _, d in res):
            raise ValueError(_no_f64(self.name, "its result would be f64"))
        if not self.c64 and any(getattr(d, "name", None) == C64_NAME for _, d in res):
            raise ValueError(_no_c64(self.name, "its result would be c64"))
        return res


F64_NAME = "f64"
C64_NAME = "c64"


def _no_c64(op: str, what: str) -> str:
    return (f"{op}: dtype c64 is not supported ({what}); complex tensors take g.real / g.imag "
            f"/ g.conj / g.abs / g.angle, + - * /, matmul and the FFTs (or g.view_as_real for "
            f"the [..., 2] f32 form)")


def _no_f64(op: str, what: str) -> str:
    return (f"{op}: dtype f64 is not supported ({what}); its kernels compute in f32 only: "
            f"cast the operands to f32 first")


OPS: dict[str, OpDef] = {}


def defop(name: str, infer: Callable | None, *, memory: str = FRESH, dtype_rule: str = F32,
          doc: str = "", **kw) -> OpDef:
    """Declare op ``name`` (once: a second declaration is an error)."""
    if name in OPS:
        raise ValueError(f"defop: op {name!r} is already declared (by {OPS[name].owner})")
    if memory not in MEMORY_KINDS:
        raise ValueError(f"defop {name}: memory must be one of {MEMORY_KINDS}, got {memory!r}")
    if dtype_rule not in DTYPE_RULES:
        raise ValueError(f"defop {name}: dtype_rule must be one of {DTYPE_RULES}, got "
                         f"{dtype_rule!r}")
    import inspect
    frame = inspect.currentframe().f_back
    owner = frame.f_globals.get("__name__", "") if frame else ""
    d = OpDef(name, infer, memory=memory, dtype_rule=dtype_rule, doc=doc, owner=owner, **kw)
    OPS[name] = d
    return d


def opdef(name: str) -> OpDef:
    d = OPS.get(name)
    if d is None:
        raise ValueError(f"unknown op {name!r}: no OpDef declares it")
    return d


def add_tier(op: str, t: Tier, first: bool = False) -> None:
    """Register tier ``t`` of op ``op`` (runtime/lower*.py); tiers are tried in order."""
    d = opdef(op)
    if any(x.name == t.name for x in d.tiers):
        raise ValueError(f"op {op}: tier {t.name!r} registered twice")
    d.tiers.insert(0, t) if first else d.tiers.append(t)


def set_chooser(op: str, choose: Callable, tier_env: str) -> None:
    """Op ``op`` picks its tier at the compiler's legalise stage with ``choose(graph, node)
    -> (tier index, why the ones before it were passed over)``, ``tier_env`` restricting it
    (runtime/lower_vision.py, lower_fft.py: tiers that rewrite the node into other ops)."""
    d = opdef(op)
    d.choose, d.tier_env = choose, tier_env


def ops_where(**facts) -> frozenset:
    """The names of the ops whose OpDef has these field values (e.g. ``memory=INPLACE``)."""
    return frozenset(n for n, d in OPS.items()
                     if all(getattr(d, k) == v for k, v in facts.items()))


def is_leaf(op: str) -> bool:
    """input, param, constant: bound or uploaded, never computed."""
    return opdef(op).memory == LEAF


def is_inplace(op: str) -> bool:
    """The op writes into its input 0's memory (its result aliases it)."""
    return opdef(op).memory == INPLACE


def is_elementwise(op: str) -> bool:
    return opdef(op).elementwise


def same_as(k: int = 0, dtype=None):
    """Inference for ops whose result has input k's shape (and dtype, unless given)."""
    def infer(*inputs, **attrs):
        x = inputs[k]
        return x.shape, x.dtype if dtype is None else dtype
    return infer
