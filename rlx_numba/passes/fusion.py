"""Element-wise fusion and epilogue folding: the "fuse" step of compile().

``fuse(graph, live, root, is_view, strided)`` reads the graph (never changes it: a Graph can be compiled
again, with or without fusion) and returns a ``Fusion``: the nodes that are never materialised
(``interior``: no arena buffer, no Step) and, per surviving root, the Node the executable lowers
in the graph node's place (``nodes``). Nine rewrites:

- **Element-wise regions.** A live element-wise node (its OpDef's ``elementwise``, not a view)
  is computed inside its consumer's kernel when it has exactly one reader, that reader is
  element-wise too, it is not a graph output, and its shape equals the reader's output shape
  (so broadcasting happens only at a region's leaves, whose shapes broadcast to the root's).
  A region becomes one virtual ``fused`` node: its inputs are the region's leaves (each once),
  ``attrs["expr"]`` the nested expression of kernels/codegen.py. Interior f16/bf16/i32 values
  are rounded (wrapped) to their dtype as a stored tensor would be, so a fused chain gives the
  same values as the unfused one.
- **Matmul epilogues.** A region that is exactly ``activation(matmul(a, b) + bias) + residual``
  (each part optional, bias [N], residual of the output's shape, all f32) with a single-use
  matmul becomes the matmul itself with that epilogue (what ``g.linear`` lowers to), so the
  cuBLASLt tier can fuse it; a ``dequant_matmul`` (the quantised GEMV) likewise.
- **Relu epilogues.** ``relu(linear(...))`` and ``relu(linear(...) + r)`` over a single-use
  linear with no activation or residual, the region exactly that, r and every node of the
  linear's shape and dtype, becomes the linear with ``activation="relu"`` (and r as its
  residual with ``residual_first``: added before the relu, as cuBLASLt adds C): a
  channels-last ResNet's 1x1 convs (ir/ops_vision.py), the block's skip and relu included.
  relu(linear) is exact in any dtype (rounding commutes with relu); a half relu(linear + r)
  rounds once where the graph rounds twice.
- **Residual epilogues.** ``linear(...) + r`` (any float dtype), and ``matmul(a, b) + r`` of
  f16 / bf16 operands, with r and the add of the product's shape and dtype (no promotion),
  become the product with ``residual=r``: cuBLASLt adds it as C (beta = 1) when there is no
  activation, so a transformer's skip connection costs no kernel. A half result is then
  rounded once where the graph as written rounds twice (the product, then the sum): it may
  differ by that one rounding.
- **Conv epilogues.** ``relu(conv + bias (+ z))`` over a single-use conv that cuDNN runs
  (the compiler's legalise stage left it a conv node) or the numba implicit-GEMM kernel runs
  (an ``implicit_gemm`` node of a conv), bias [K] broadcast over the positions and z of the
  output's shape, all in the conv's dtype (f32, f16 or bf16), becomes that node with the
  epilogue: one cudnnConvolutionBiasActivationForward, or the kernel's tile store (a ResNet
  block's conv, bias, skip and relu). A half conv then rounds once, after the relu.
- **Gated epilogues.** ``gated(x @ w (+ bias), interleaved=True)`` over a single-use
  product (matmul, linear or dequant_matmul) of a 2-D weight with at most 16 rows (decode),
  the gated of the product's dtype (f32, or f16 / bf16),
  becomes the product with a ``gated``
  epilogue: the skinny-product kernel pairs each block's interleaved gate and up columns, so
  a SwiGLU MLP's activation costs no kernel of its own. A half product is then rounded once
  (act(gate) * up from its f32 sums) where the graph as written rounds the product first:
  it may differ by that one rounding (runtime/lower_matmul.py: every tier rounds it once).
- **Norm prologues.** ``rms_norm(x)`` over the last axis (no beta, no residual) read only as
  the A of a product of a 2-D weight with at most 16 rows (decode; the product possibly
  folded above), gamma and the product of x's dtype, becomes that product with
  ``rms_norm_eps`` and gamma as its last input: the skinny-product kernel normalises x as it
  reads it, so a decoder layer's norms cost no kernel of their own; other tiers run the
  norm as a step before the product (runtime/lower_matmul.py).
- **Rope / KV-write prologues.** A decode attention (few queries a kv head: the split-K
  decode kernel) over exactly the three results of a ``rope_kv_write`` (q and the caches
  after the write), which nothing else reads, becomes a ``rope_kv_attention`` node taking
  the rope_kv_write's inputs: each block of its kernel writes the new k / v rows that lie
  among its keys into the caches (a row is read by those blocks alone), rotates its queries
  from the packed qkv, and attends -- one kernel where there were two, a decoder layer's rope
  costs no launch; the same values and cache contents (q rounded to its dtype as
  rope_kv_write stores it).
- **Residual + norm.** ``layer_norm(a + b)`` / ``rms_norm(a + b)`` over a single-use add of
  two same-shape tensors of its dtype (f32, f16 or bf16: a half norm rounds a + b to the dtype
  before it uses it, as the add's kernel would) becomes the norm with ``residual=b`` (one row
  kernel). When exactly one
  operand would have been fused into the add, that operand keeps a kernel of its own instead
  (as many kernels; it may then be a matmul epilogue), and a matmul epilogue leaves such an add
  to the norm.

A strided narrow (``strided``: runtime/lower.py ``strided_narrows``) is a leaf that only the generated
element-wise kernels can read (through its row stride): the matmul-epilogue and norm-residual
folds are not made over one.

A rewritten root runs at its own position in the step order and reads every leaf there. That is
wrong when an in-place node (kv_write) between a leaf's original reader and the root overwrites
the leaf's memory, so such readers are kept materialised (see ``_hazards``).

``RLX_NUMBA_FUSION=0`` turns the pass off (every node lowers on its own).
"""
from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass, field

from ..ir import dtypes as dt
from ..ir.graph import Node
from ..ir.opdef import is_elementwise, is_inplace
from ..kernels.attention import decode_rows
from ..kernels.gemv import MAX_M

# a region's size caps: numba kernels take every input as ~7 parameters (4 KiB in all), and
# the generated source repeats the expression per unrolled element
MAX_LEAVES = 16
MAX_MEMBERS = 32
# interior values rounded to their dtype, and the dtype they are computed in before that
_ROUNDED = {dt.F16: dt.F32, dt.BF16: dt.F32, dt.I32: dt.I64, dt.U8: dt.I64, dt.I8: dt.I64}
NORMS = ("layer_norm", "rms_norm")


def enabled() -> bool:
    return os.environ.get("RLX_NUMBA_FUSION", "1") != "0"


@dataclass
class Region:
    root: int
    members: tuple      # node ids in graph order, the root last
    leaves: tuple       # kernel inputs (node ids, each once), in expression order
    expr: tuple         # kernels/codegen.py expression over ("in", k, dtype) leaves


@dataclass
class Fusion:
    interior: frozenset = frozenset()
    nodes: dict = field(default_factory=dict)     # root id -> Node lowered in its place
    regions: dict = field(default_factory=dict)   # root id -> Region (element-wise kernels)
    folds: dict = field(default_factory=dict)     # root id -> (kind, member ids) of the folds


def fuse(graph, live, root, is_view, strided=frozenset()) -> Fusion:
    """The fusion plan of ``graph``: ``live`` the node ids that run, ``root`` node id -> the
    node id owning its memory, ``is_view(node)`` whether a node aliases its input, ``strided``
    the narrows that are views only the generated element-wise kernels can read."""
    if not enabled():
        return Fusion()
    nodes = graph.nodes
    outputs = set(graph.outputs)
    uses = Counter(i for n in nodes if n.id in live for i in n.inputs)
    consumer = {i: n.id for n in nodes if n.id in live for i in n.inputs}
    writes = [(n.id, root[n.id]) for n in nodes if n.id in live and is_inplace(n.op)]

    def single(i):        # one reader, and nothing outside the graph sees it
        return uses[i] == 1 and i not in outputs

    def elementwise(n):
        return n.id in live and is_elementwise(n.op) and not is_view(n)

    # adds that a norm can take as its residual= (folded below when the add is a region of
    # its own); when one of their operands was fused into them, that operand gets a region of
    # its own instead ("sealed" adds take no members): as many kernels, and the operand's
    # region may then fold into a matmul epilogue
    # (not a norm that a skinny product can take as its prologue: its add folds into the
    # product before it instead, and the norm costs no kernel)
    norm_adds = {n.inputs[0] for n in nodes
                 if n.op in NORMS and n.id in live and not n.attrs["has_residual"]
                 and _residual_add(nodes, nodes[n.inputs[0]], single)
                 and not (single(n.id)
                         and _norm_prologue(nodes, n, consumer[n.id], {}, set()) is not None)}
    forced: set = set()   # members that must stay materialised (in-place hazards)
    sealed: set = set()
    while True:
        groups = _regions(nodes, elementwise, single, forced, sealed)
        bad = _hazards(nodes, groups, writes, root)
        seal = {x for x in norm_adds - sealed if len(groups.get(x, ())) > 1
                and sum(i in groups[x] for i in set(nodes[x].inputs)) == 1}
        if not bad and not seal:
            break
        forced |= bad
        sealed |= seal
    out = Fusion()
    interior = set()
    region_of = {m: r for r, ms in groups.items() for m in ms}
    for r, ms in groups.items():
        if len(ms) > 1:
            leaves: dict = {}
            expr = _expr(nodes, r, r, set(ms), leaves)
            out.regions[r] = Region(r, tuple(sorted(ms)), tuple(leaves), expr)
            interior.update(m for m in ms if m != r)
    for n in nodes:   # matmul epilogues: a region that is exactly the linear epilogue
        if (n.op in ("matmul", "dequant_matmul") and n.id in live and single(n.id)
                and consumer.get(n.id) in region_of):
            r = region_of[consumer[n.id]]
            if r in out.nodes:    # a @ b + c @ d: the first product took the add already
                continue
            fold = _matmul_epilogue(nodes, n, groups[r], consumer, norm_adds)
            if fold is not None and strided.intersection(fold.inputs[2:]):
                fold = None    # the product's epilogue reads dense operands
            if fold is not None and not _hazards(nodes, {r: groups[r] + [n.id]}, writes, root):
                out.regions.pop(r, None)
                out.nodes[r] = fold
                out.folds[r] = ("matmul epilogue", tuple(sorted(groups[r] + [n.id])))
                interior.update(m for m in groups[r] + [n.id] if m != r)
    for n in nodes:   # relu epilogues: relu(linear(...)) and relu(linear(...) + r), one dtype
        if (n.op == "linear" and n.id in live and single(n.id) and n.attrs["activation"] is None
                and not n.attrs["has_residual"] and consumer.get(n.id) in region_of):
            r = region_of[consumer[n.id]]
            fold = None if r in out.nodes else _relu_epilogue(nodes, n, groups[r])
            if fold is not None and strided.intersection(fold.inputs[-1:]):
                fold = None    # the product's epilogue reads dense operands
            if fold is None or _hazards(nodes, {r: groups[r] + [n.id]}, writes, root):
                continue
            out.regions.pop(r, None)
            out.nodes[r] = fold
            out.folds[r] = ("relu epilogue", tuple(sorted(groups[r] + [n.id])))
            interior.update(m for m in groups[r] + [n.id] if m != r)
    for n in nodes:   # residual adds: linear(...) + r, and a half matmul + r, of one dtype
        if (n.op in ("linear", "matmul") and n.id in live and single(n.id)
                and not n.attrs.get("has_residual") and consumer.get(n.id) in region_of
                and (n.op == "linear" or n.dtype != dt.F32)):
            r = region_of[consumer[n.id]]
            if r in out.nodes:
                continue
            fold = _residual_epilogue(nodes, n, groups[r], norm_adds)
            if fold is not None and strided.intersection(fold.inputs[-1:]):
                fold = None
            if fold is not None and not _hazards(nodes, {r: groups[r] + [n.id]}, writes, root):
                out.regions.pop(r, None)
                out.nodes[r] = fold
                out.folds[r] = ("residual epilogue", tuple(sorted(groups[r] + [n.id])))
                interior.update(m for m in groups[r] + [n.id] if m != r)
    for n in nodes:   # conv epilogues: relu(conv + bias (+ z)), the conv on tier 0 or 2
        if ((n.op == "conv" or n.op == "implicit_gemm" and n.attrs["of"] == "conv")
                and n.id in live and single(n.id) and consumer.get(n.id) in region_of
                and n.attrs.get("activation") is None):
            r = region_of[consumer[n.id]]
            fold = _conv_epilogue(nodes, n, groups[r], consumer)
            if fold is not None and strided.intersection(fold.inputs[2:]):
                fold = None
            if fold is not None and not _hazards(nodes, {r: groups[r] + [n.id]}, writes, root):
                out.regions.pop(r, None)
                out.nodes[r] = fold
                out.folds[r] = ("conv epilogue", tuple(sorted(groups[r] + [n.id])))
                interior.update(m for m in groups[r] + [n.id] if m != r)
    for n in nodes:   # gated epilogues: gated(x @ w (+ bias), interleaved) of a skinny product
        if n.op == "gated" and n.id in live:
            fold = _gated_epilogue(nodes, n, out.nodes, single)
            if fold is not None and not _hazards(nodes, {n.id: [n.inputs[0], n.id]}, writes, root):
                members = out.folds.pop(n.inputs[0], ("", (n.inputs[0],)))[1] + (n.id,)
                out.nodes.pop(n.inputs[0], None)
                out.nodes[n.id] = fold
                out.folds[n.id] = ("gated epilogue", tuple(sorted(members)))
                interior.update(m for m in members if m != n.id)
    for n in nodes:   # residual + norm
        if n.op in NORMS and n.id in live and not n.attrs["has_residual"]:
            fold = _norm_residual(nodes, n, single, region_of, groups)
            if n.inputs[0] in out.nodes:   # its add already became a matmul's epilogue
                fold = None
            if fold is not None and strided.intersection((fold.inputs[0], fold.inputs[-1])):
                fold = None                # the norm reads dense operands
            if fold is not None and not _hazards(nodes, {n.id: [n.inputs[0], n.id]}, writes, root):
                out.nodes[n.id] = fold
                out.folds[n.id] = ("norm residual", (n.inputs[0], n.id))
                interior.add(n.inputs[0])
    for n in nodes:   # norm prologues: a skinny product of rms_norm(x) reads x itself
        if n.op == "rms_norm" and n.id in live and single(n.id) and n.id not in out.nodes:
            pid = _norm_prologue(nodes, n, consumer[n.id], out.nodes, interior)
            if (pid is None or strided.intersection(n.inputs)
                    or _hazards(nodes, {pid: [n.id, pid]}, writes, root)):
                continue
            prod = out.nodes.get(pid, nodes[pid])
            out.nodes[pid] = Node(pid, prod.op, (n.inputs[0],) + prod.inputs[1:] + (n.inputs[1],),
                                  prod.shape, prod.dtype,
                                  {**prod.attrs, "rms_norm_eps": float(n.attrs["eps"])})
            kind, members = out.folds.get(pid, ("", (pid,)))
            out.folds[pid] = (f"{kind} + norm prologue" if kind else "norm prologue",
                              tuple(sorted(members + (n.id,))))
            interior.add(n.id)
    readers: dict = {}    # node id -> the live nodes reading it
    for n in nodes:
        if n.id in live:
            for i in n.inputs:
                readers.setdefault(i, set()).add(n.id)
    for n in nodes:   # rope_kv_write prologues: the decode attention over its q and caches
        if n.op == "attention" and n.id in live and n.id not in out.nodes:
            fold = _rope_kv_prologue(nodes, n, live, outputs, writes, root, readers)
            if fold is not None:
                rkw = nodes[n.inputs[0]]
                out.nodes[n.id] = fold
                out.folds[n.id] = ("rope_kv_write prologue",
                                   tuple(sorted((rkw.id, *rkw.results, n.id))))
                interior.update((rkw.id, *rkw.results))
    for r, reg in out.regions.items():
        root_node = nodes[r]
        out.nodes[r] = Node(r, "fused", reg.leaves, root_node.shape, root_node.dtype,
                            {"expr": reg.expr, "members": reg.members})
    out.interior = frozenset(interior)
    return out


def _regions(nodes, elementwise, single, forced, sealed) -> dict:
    """root id -> [member ids] for every element-wise node (singletons included), grown from
    each root down through inputs that may be computed inside their reader (``forced`` nodes
    are never members, ``sealed`` nodes take none)."""
    groups, taken = {}, set()
    for n in reversed(nodes):
        if not elementwise(n) or n.id in taken:
            continue
        members, stack = [n.id], [n.id]
        while stack:
            m = stack.pop()
            for i in () if m in sealed else nodes[m].inputs:
                x = nodes[i]
                if (not elementwise(x) or i in forced or not single(i) or i in members
                        or x.shape != nodes[m].shape or len(members) >= MAX_MEMBERS
                        or len(_leaf_ids(nodes, members + [i])) > MAX_LEAVES):
                    continue   # a leaf: materialised (its own region's root)
                members.append(i)
                stack.append(i)
        taken.update(members)
        groups[n.id] = sorted(members)
    return groups


def _leaf_ids(nodes, members) -> set:
    ms = set(members)
    return {i for m in members for i in nodes[m].inputs if i not in ms}


def _hazards(nodes, groups, writes, root) -> set:
    """Members that read a leaf whose memory an in-place node overwrites after that read and
    before the region's root runs (where the fused kernel would read it)."""
    bad = set()
    for r, ms in groups.items():
        inside = set(ms)
        for m in ms:
            if m == r:
                continue
            for i in nodes[m].inputs:
                if i not in inside and any(m < k < r and w == root[i] for k, w in writes):
                    bad.add(m)
    return bad


def _expr(nodes, nid, root, members, leaves) -> tuple:
    """The codegen expression of ``nid`` over the region ``members`` (root ``root``);
    ``leaves`` collects the kernel inputs (node id -> input index) in order of first use."""
    n = nodes[nid]
    if nid not in members:
        return ("in", leaves.setdefault(nid, len(leaves)), n.dtype)
    kids = tuple(_expr(nodes, i, root, members, leaves) for i in n.inputs)
    kind = n.attrs.get("kind")
    if nid != root and n.op != "cast" and n.dtype in _ROUNDED:
        # stored, this value would be rounded to f16/bf16 or wrapped to int32 (numba computes
        # int32 arithmetic in int64): do the same before its reader sees it
        return ("cast", None, n.dtype, (n.op, kind, _ROUNDED[n.dtype]) + kids)
    return (n.op, kind, n.dtype) + kids


def _matmul_epilogue(nodes, mm, members, consumer, norm_adds):
    """The matmul node computing ``activation(mm + bias) + residual`` when the region
    ``members`` is exactly that chain over ``mm`` (all f32), else None. An add in
    ``norm_adds`` is left to its norm as the residual (that costs no kernel on any tier).
    A half product's bias / activation chain is not folded: it rounds the product to half
    before the adds (an f32 add of it, under autocast, included) and the fold would not (its
    residual add of the same dtype is: ``_residual_epilogue``)."""
    if mm.dtype != dt.F32:
        return None
    shape, n_cols = mm.shape, mm.shape[-1]
    chain, cur = [], mm.id
    bias = act = res = None

    def step():
        nonlocal cur
        chain.append(nxt.id)
        cur = nxt.id

    def other(n):   # the add's operand that is not the chain (None when both are)
        a, b = n.inputs
        return nodes[b] if a == cur and b != cur else nodes[a] if b == cur and a != cur else None

    def add_of(n, want):
        if n.op != "binary" or n.attrs["kind"] != "add" or n.dtype != dt.F32 or n.shape != shape:
            return None
        o = other(n)
        return o if o is not None and o.dtype == dt.F32 and o.shape == want else None

    nxt = nodes[consumer[mm.id]]
    bias = add_of(nxt, (n_cols,))
    if bias is not None:
        step()
        nxt = nodes[consumer[cur]] if cur != members[-1] else None
    if nxt is not None and nxt.op == "activation" and nxt.dtype == dt.F32 and nxt.shape == shape:
        act = nxt.attrs["kind"]
        step()
        nxt = nodes[consumer[cur]] if cur != members[-1] else None
    if nxt is not None and nxt.id not in norm_adds:
        res = add_of(nxt, shape)
        if res is not None:
            step()
    if not chain or chain[-1] != members[-1] or sorted(chain) != list(members):
        return None
    ins = mm.inputs + tuple(t.id for t in (bias, res) if t is not None)
    keep = mm.attrs if mm.op == "dequant_matmul" else {}     # (its scheme, ...)
    return Node(members[-1], mm.op, ins, shape, dt.F32,
                {**keep, "activation": act, "has_bias": bias is not None,
                 "has_residual": res is not None})


def _residual_epilogue(nodes, prod, members, norm_adds):
    """``prod`` (a linear, or a half matmul) with ``residual=r`` when the region ``members`` is
    exactly ``prod + r`` with r of prod's shape and all three of prod's dtype (no
    promotion), else None; an add in ``norm_adds`` is left to its norm.

    cuBLASLt takes the residual as C with beta = 1 when there is no activation (one rounding
    of acc + bias + r, where the unfolded graph rounds the product to its dtype and then the
    sum: a half result may differ by that one rounding, never by more); with an activation
    the epilogue kernel adds it (as many kernels as before)."""
    if len(members) != 1 or members[0] in norm_adds:
        return None
    add = nodes[members[0]]
    if (add.op != "binary" or add.attrs["kind"] != "add" or add.dtype != prod.dtype
            or add.shape != prod.shape):
        return None
    a, b = add.inputs
    if (a == prod.id) == (b == prod.id):
        return None
    r = nodes[b if a == prod.id else a]
    if r.dtype != prod.dtype or r.shape != prod.shape:
        return None
    attrs = dict(prod.attrs) if prod.op == "linear" else {"activation": None, "has_bias": False}
    return Node(add.id, prod.op, prod.inputs + (r.id,), prod.shape, prod.dtype,
                {**attrs, "has_residual": True})


def _relu_epilogue(nodes, lin, members):
    """``lin`` (a linear with no activation or residual) with ``activation="relu"`` when the
    region ``members`` is exactly relu(lin), or with the residual r too (``residual_first``:
    relu(x @ w + bias + r), the order cuBLASLt's C takes) when it is exactly relu(lin + r), r
    and every node of lin's shape and dtype; else None. relu(lin) is exact in any dtype
    (rounding commutes with relu); a half relu(lin + r) rounds once where the graph rounds lin
    and lin + r (as the residual epilogue)."""
    relu = nodes[members[-1]]
    if (relu.op != "activation" or relu.attrs["kind"] != "relu" or relu.dtype != lin.dtype
            or relu.shape != lin.shape):
        return None
    attrs = {**lin.attrs, "activation": "relu"}
    if members == [relu.id] and relu.inputs == (lin.id,):
        return Node(relu.id, "linear", lin.inputs, lin.shape, lin.dtype, attrs)
    add = nodes[relu.inputs[0]]
    if (sorted(members) != sorted([add.id, relu.id]) or add.op != "binary"
            or add.attrs["kind"] != "add" or add.dtype != lin.dtype or add.shape != lin.shape
            or list(add.inputs).count(lin.id) != 1):
        return None
    r = nodes[add.inputs[1] if add.inputs[0] == lin.id else add.inputs[0]]
    if r.dtype != lin.dtype or r.shape != lin.shape:
        return None
    return Node(relu.id, "linear", lin.inputs + (r.id,), lin.shape, lin.dtype,
                {**attrs, "has_residual": True, "residual_first": True})


def _conv_epilogue(nodes, cv, members, consumer):
    """The conv node computing ``relu(cv + bias (+ z))`` (cuDNN's fused forward: bias [K]
    broadcast over the positions, z of the output's shape, in either order) when the region
    ``members`` is exactly that chain, every node and operand in the conv's dtype, else None.
    In f16 / bf16 the unfused chain rounds the conv, then conv + bias (and + z) to the dtype;
    the fused form sums conv + bias + z in f32 and rounds once, after the relu (a rounding
    commutes with relu): it drops the roundings of the conv and of each add but the last."""
    cl = cv.attrs.get("channels_last", False)    # channels last: the bias [K] unreshaped
    shape, k, dtype = cv.shape, cv.shape[-1 if cl else 1], cv.dtype
    bias_shape = (k,) + (1,) * (len(shape) - 2)
    if dtype not in (dt.F32, dt.F16, dt.BF16):
        return None
    chain, cur, bias, z = [], cv.id, None, None
    while cur in consumer and len(chain) < 3:
        n = nodes[consumer[cur]]
        if n.id not in members or n.dtype != dtype or n.shape != shape:
            return None
        if n.op == "activation":
            if n.attrs["kind"] != "relu" or bias is None:
                return None
            chain.append(n.id)
            break
        if n.op != "binary" or n.attrs["kind"] != "add" or list(n.inputs).count(cur) != 1:
            return None
        o = nodes[n.inputs[1] if n.inputs[0] == cur else n.inputs[0]]
        if o.dtype != dtype:
            return None
        if bias is None and (o.shape == (k,) if cl else (
                o.op == "reshape" and o.shape == bias_shape and nodes[o.inputs[0]].shape == (k,))):
            bias = o
        elif z is None and o.shape == shape:
            z = o
        else:
            return None
        chain.append(n.id)
        cur = n.id
    if not chain or nodes[chain[-1]].op != "activation" or sorted(chain) != list(members):
        return None
    ins = cv.inputs + (bias.id,) + ((z.id,) if z is not None else ())
    return Node(chain[-1], cv.op, ins, shape, dtype,
                {**cv.attrs, "activation": "relu", "has_bias": True, "has_residual": z is not None})


def _gated_epilogue(nodes, gated, folded, single):
    """The product computing ``gated`` as its epilogue (tier 3 pairs the interleaved gate and
    up columns of a block; lower_matmul runs the other tiers into a scratch of their own)
    when its x is a single-use product (f32, f16 or bf16: the gated keeps its dtype), bias
    at most, of a 2-D weight with at most MAX_M rows, else None."""
    x = nodes[gated.inputs[0]]
    prod = folded.get(x.id, x)
    if (not gated.attrs["interleaved"] or gated.dtype not in (dt.F32, dt.F16, dt.BF16)
            or prod.dtype != gated.dtype or not single(x.id)
            or prod.op not in ("matmul", "linear", "dequant_matmul") or prod.attrs.get("activation")
            or prod.attrs.get("has_residual") or len(nodes[prod.inputs[1]].shape) != 2
            or math.prod(x.shape[:-1]) > MAX_M):
        return None
    keep = prod.attrs if prod.op == "dequant_matmul" else {}
    return Node(gated.id, prod.op, prod.inputs, gated.shape, gated.dtype,
                {**keep, "activation": None, "has_bias": bool(prod.attrs.get("has_bias")),
                 "has_residual": False, "gated": gated.attrs["activation"]})


def _norm_prologue(nodes, norm, reader, folded, interior):
    """The id of the product lowered in the place of ``reader`` (a fold's root where reader
    became one) that can take ``norm`` as its prologue, else None: an rms_norm over the last
    axis, no beta or residual, gamma of x's dtype (f32, f16 or bf16), whose output is that
    product's A (matmul / linear of a 2-D weight, at most MAX_M rows, K > 0, of x's dtype):
    tier 3 normalises in its kernel (x * gamma in f32, the normed x never rounded to a half
    dtype: it may differ from the graph as written by that one rounding), the other tiers
    take a row step first (runtime/lower_matmul.py)."""
    x, gamma = nodes[norm.inputs[0]], nodes[norm.inputs[1]]
    if (norm.attrs["has_beta"] or norm.attrs["has_residual"] or not x.shape
            or norm.attrs["axis"] % len(x.shape) != len(x.shape) - 1 or x.shape[-1] == 0
            or x.dtype not in (dt.F32, dt.F16, dt.BF16) or gamma.dtype != x.dtype
            or math.prod(x.shape[:-1]) > MAX_M):
        return None
    pid = reader
    if reader in interior:     # folded into another root: the fold whose A it is
        pid = next((r for r, f in folded.items() if f.inputs[:1] == (norm.id,)), None)
        if pid is None:
            return None
    prod = folded.get(pid, nodes[pid])
    if (prod.op not in ("matmul", "linear") or prod.inputs[0] != norm.id
            or norm.id in prod.inputs[1:] or len(nodes[prod.inputs[1]].shape) != 2
            or prod.dtype != x.dtype or "rms_norm_eps" in prod.attrs):
        return None
    return pid


def _rope_kv_prologue(nodes, att, live, outputs, writes, root, readers):
    """The rope_kv_attention node standing for ``att`` and the rope_kv_write it reads, else
    None: ``att`` a decode attention (kernels/attention.py's decode kernel: few queries a kv
    head) of q, k_all, v_all, exactly a rope_kv_write's three results, which nothing else reads
    (the write's two kv_written aliases of the caches aside) nor sees outside the graph, and
    no live result of its own (a training attention's LSE). Between the two nodes no other
    in-place write may touch memory the rope_kv_write reads (the fold moves the reads and
    the caches' write to the attention's place; runtime/lower_attention.py lowers it)."""
    rkw = nodes[att.inputs[0]]
    if rkw.op != "rope_kv_write" or len(rkw.results) != 2 or att.inputs[1:3] != tuple(rkw.results):
        return None
    a = att.attrs
    if (a["sk"] == 0 or decode_rows(a["hq"] // a["hkv"], a["sq"], a["d"]) is None
            or any(r in live for r in att.results)):
        return None
    mine = {rkw.id, *rkw.results}
    if mine & outputs or mine.intersection(att.inputs[3:]):
        return None
    # another reader of q or of the caches after the write (``readers``: the live nodes
    # reading each node, made once a graph: a scan of every node per attention was half of
    # SmolLM2-135M's decode plan, 15 of 32 ms)
    if any(r != att.id and r not in mine for m in mine for r in readers.get(m, ())):
        return None
    read = {root[i] for i in rkw.inputs}
    if any(rkw.id < k < att.id and w in read and k not in mine for k, w in writes):
        return None
    rest = att.inputs[3:]
    return Node(att.id, "rope_kv_attention", rkw.inputs + rest, att.shape, att.dtype,
                {**a, "rope_kv_write": rkw.id})


def _residual_add(nodes, x, single) -> bool:
    """x is a single-use f32 / f16 / bf16 add of two tensors of its own shape and dtype (the
    norm's kernel rounds a half sum to that dtype: the fold changes no value)."""
    return (x.op == "binary" and x.attrs["kind"] == "add" and single(x.id)
            and x.dtype in (dt.F32, dt.F16, dt.BF16)
            and all(nodes[i].dtype == x.dtype and nodes[i].shape == x.shape for i in x.inputs))


def _norm_residual(nodes, norm, single, region_of, groups):
    """The norm with ``residual=`` when its x is a single-use float add of two same-shape
    tensors of its dtype computed by a kernel of its own (a region of one), else None."""
    x = nodes[norm.inputs[0]]
    if not _residual_add(nodes, x, single) or groups.get(region_of.get(x.id)) != [x.id]:
        return None
    a, b = (nodes[i] for i in x.inputs)
    return Node(norm.id, norm.op, (a.id,) + norm.inputs[1:] + (b.id,), norm.shape, norm.dtype,
                {**norm.attrs, "has_residual": True})
