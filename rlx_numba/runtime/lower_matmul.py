"""Lowering of matmul and linear: the tier ladder of DESIGN.md.

Each product is planned once, at compile time, taking the first tier whose preconditions hold:

  0  the weight (B) is a param stored half by ``set_param_half``: the activations are cast to
     that half type (a generated cast kernel), then ``cublasGemmEx`` with f32 accumulation
     (a half weight read only by products holds no f32 copy while they read the half one:
     a tier that reads f32 asks the store to make it again, ``_f32_weight``);
  1  cuBLASLt, every unbatched product: the bias and relu / gelu_tanh fused in its epilogue
     (a residual with no activation rides along as C with beta = 1);
  2  ``cublasSgemm_v2`` / strided-batched / pointer-array batched (batched products, or
     where cuBLASLt has no algorithm);
  3  the skinny-product kernel (kernels/gemv.py) for unbatched products of M <= 16 rows whose
     weight is stored [N, K] (f32, or half by set_param_half), the whole epilogue fused. On a
     GPU it is timed at compile time against the tier the ladder would take (0 or 1) for that
     exact shape, weight dtype, epilogue and exec mode (replayed from a CUDA graph under
     GRAPH) -- every step that tier adds: tier 0's cast kernel, the product, the epilogue and
     gated kernels -- and the faster one runs; the verdict is kept on
     disk beside the kernel cache (``tier_choices.json``), so another process does not time
     again. Under the simulator it runs only when RLX_NUMBA_MATMUL_TIERS names it;
  5  the numba tensor-core GEMM (kernels/matmul_tc.py: mma.m16n8k16, ldmatrix, a cp.async
     pipeline), f16 / bf16 products only, its epilogue (bias, activation, residual) fused and
     rounded once; tried after the cuBLAS tiers and before tier 4. With cuBLAS it is timed at
     compile time against the cuBLAS tier's steps (epilogue kernel included) for that shape,
     layout, epilogue and exec mode, as tier 3 is (verdicts in the same file, keyed
     ``tc...``), and the faster runs -- products of 2^28 flops (512^3) or more only
     (``TC_TIMED_MIN_FLOPS``), smaller ones take the cuBLAS tier untimed; without cuBLAS it
     takes every half product tier 3 does not; a product tier 3 takes, or one with a gated
     epilogue, is not offered to it. Offered only where RLX_NUMBA_MATMUL_TIERS names it, or
     on a GPU without cuBLAS (``tier5_offered``: opt-in beside cuBLAS until GPU timings say
     where it wins; the simulator's mma twins are slow). f16 / bf16 grouped_matmul takes the
     same kernel's grouped mode wherever tier 5 is offered (runtime/lower_grouped.py);
  4  the numba register-tiled SGEMM (kernels/matmul.py): everywhere, the simulator included.

Whatever a tier leaves of the epilogue ``activation(A@B + bias) + residual`` runs as one
generated element-wise kernel over the output, in place.

f64 products (every operand f64) compute in f64 end to end: tier 2 as cublasDgemm (strided /
pointer-array batched), else tier 4's f64 kind, the epilogue kernel in f64; the other tiers
have no f64 form (``_f64_product``).

f16 / bf16 products (every operand of that dtype, torch's rule) sum in f32 and round once to
their dtype, the epilogue included (DESIGN.md): tier 1 with A, B and the half type's D (f32
compute and scale: tensor cores), tier 2 through cublasGemmEx / GemmStridedBatchedEx /
GemmBatchedEx, tier 4 loading and storing through kernels/halfio.py, tier 5 in mma fragments.
cuBLAS and cuBLASLt sum split-K partials in f32 for a half D (gemm.py: never in D's type).
Where a half product's epilogue is computed:

- cuBLASLt fusing the whole of it (bias, relu, a residual as C before any activation:
  ``lt_fuses``): a model's fast path, as torch's addmm runs it; on an H200 Lt rounds the
  product to D's type before it adds the bias (half an ulp of the product, which a bias
  that cancels it leaves), so this one is not a single rounding; its GELU epilogue (the tanh
  form) was up to ~1.2 ulp off its formula there, so gelu_tanh takes the next way;
- otherwise a cuBLAS tier (gelu, gelu_tanh and the other activations, a residual after an
  activation, everything on tier 2) writes D in f32 (f32 C / D under COMPUTE_32F) into an
  arena scratch the memory plan gives the node (``f32_scratch_elems``), and the element-wise
  kernel applies the whole epilogue to those sums and rounds once (10 bytes an element of
  the product moved instead of 6: D written and read in 4 bytes; rounding D to half first
  would err by up to |f'(z)| u |z| more, f' the activation's slope at z = x @ w + bias, which
  a residual that cancels y, or a steep activation, makes many ulps of y);
- tier 4 (the numba SGEMM: the simulator, or no cuBLAS) writes its f32 sums into that
  scratch likewise;
- tier 5 applies the whole epilogue to its f32 fragments in its store: one rounding;
- a gated epilogue (passes/fusion.py: SwiGLU's act(gate + bias) * (up + bias) over the
  interleaved columns): tier 3 computes it from its f32 sums and rounds y once; the other
  tiers write the f32 sums to an f32 scratch of the node's own (the bias added in place
  there by the epilogue kernel, in f32) and the gated kernel rounds once.

Tier 3 takes x, y, bias and residual in the
half type with a weight of that type (a half param, stored [N, K] as f32 ones are); tier 0
(an f32 graph's set_param_half weight) passes them over, saying why.

Batch dims broadcast; a 2-D weight folds the leading dims of A into M (one GEMM). An operand
produced by a transpose of its last two axes whose every consumer is a product is not
materialised: it reaches the GEMM as an op-T flag (``absorbed_transposes``).

``RLX_NUMBA_LOG_FALLBACK=1`` logs the tier of every product and why the tiers above it were
passed over; the same goes in each step's ``info``. ``RLX_NUMBA_MATMUL_TIERS=2,4`` restricts
the tiers tried (for tests and comparisons).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from dataclasses import dataclass

import numpy as np
from numba import types

from .. import cublas
from ..device import SIMULATOR, device_info
from ..ir import dtypes as dt
from ..ir.graph import Graph
from ..kernels import elementwise as ew
from ..kernels import gemv as gv
from ..kernels import matmul as mm
from ..kernels import matmul_tc as mtc
from ..kernels.halfio import io_kind
from ..kernels.launch import default_geometry, sm_count
from .lower import (CallStep, Step, compile_off_thread, data_ptr, elementwise_step, env_tiers,
                    gated_step, log, log_tier, lowering, pdl_supported, step_name)
from .lower_norm import rms_norm_steps

LT_ACTIVATIONS = (None, "relu", "gelu_tanh")   # cuBLASLt's GELU is the tanh form
LT_HALF_ACTIVATIONS = (None, "relu")           # (its GELU is off by ~1.2 ulp of a half D)
NO_EPILOGUE = {"bias": None, "activation": None, "residual": None, "residual_first": False}


def lt_fuses(activation, has_residual, residual_first) -> bool:
    """Whether cuBLASLt fuses the whole epilogue of a half product (``_lt_step``): the bias,
    relu, and a residual added as C before any activation (none, or ``residual_first``)."""
    return activation in LT_HALF_ACTIVATIONS and (not has_residual or activation is None
                                                  or residual_first)


PRODUCTS = ("matmul", "linear")
# ops reading their input 1 (b / w) through a transpose flag (lower_lowp.py: the low-precision
# products' tiers read b stored [N, K] as well as [K, N])
B_TRANS_OPS = ("linear", "scaled_matmul", "qmatmul")


def consumers_of(graph: Graph) -> dict:
    """node id -> [(consumer node, input position)]."""
    out: dict[int, list] = {}
    for n in graph.nodes:
        for j, i in enumerate(n.inputs):
            out.setdefault(i, []).append((n, j))
    return out


def absorbed_transposes(graph: Graph, live_outputs) -> set:
    """Transposes of the last two axes that only feed products (matmul's operands, the weight
    or b of linear, scaled_matmul and qmatmul) and are not outputs: their consumers read the
    input with a transpose flag."""
    consumers = consumers_of(graph)
    out = set()
    for n in graph.nodes:
        if n.op != "transpose" or n.id in live_outputs:
            continue
        r = len(n.shape)
        if tuple(n.attrs["perm"]) != tuple(range(r - 2)) + (r - 1, r - 2):
            continue
        uses = consumers.get(n.id, [])
        if uses and all(m.op == "matmul" or (m.op in B_TRANS_OPS and j == 1) for m, j in uses):
            out.add(n.id)
    return out


def transposed_weights(graph: Graph, live_outputs) -> set:
    """2-D float params (f32, f16, bf16) read only as a product's weight (B): stored
    transposed, [N, K] as nn.Linear holds them, so cuBLAS runs them op-T (its TN kernels are
    about twice as fast as NN on the skinny products of decoding and small batches: 3.9
    against 7.5 us for 16x256x256 on an H200). set_param / set_param_half transpose on the
    way in."""
    consumers = consumers_of(graph)
    return {n.id for n in graph.nodes
            if n.op == "param" and n.dtype in (dt.F32, dt.F16, dt.BF16) and len(n.shape) == 2
            and n.size
            and n.id not in live_outputs and consumers.get(n.id)
            and all(m.op in PRODUCTS and j == 1 for m, j in consumers[n.id])}


def read_as_weight(consumers: dict, absorbed: set, nid) -> bool:
    """Whether node ``nid`` is read only as products' weight (B): directly or through absorbed
    transposes that feed only products' B."""
    uses = consumers.get(nid)
    return bool(uses) and all((m.op in PRODUCTS and j == 1)
                              or (m.id in absorbed and read_as_weight(consumers, absorbed, m.id))
                              for m, j in uses)


def weight_only_params(graph: Graph, absorbed: set, transposed: set) -> set:
    """Params read only as a product's weight (B): those stored [N, K] (``transposed``), and
    2-D params whose every reader is a product's B or an absorbed transpose feeding only
    products' B (nn.Linear's [N, K] weights through ``linear``). A half weight among them
    needs no f32 copy (runtime/params.py)."""
    consumers = consumers_of(graph)
    return set(transposed) | {n.id for n in graph.nodes if n.op == "param" and len(n.shape) == 2
                              and read_as_weight(consumers, absorbed, n.id)}


@dataclass
class Operand:
    buf: object        # flat device view of the stored matrix (or matrices); None for a half
                       # weight holding no f32 copy (tiers 0 and 3 read ctx.half_param)
    node: object       # the node whose memory that is (a transpose's input when absorbed)
    trans: bool        # stored as the transpose of the logical operand (last two axes)
    shape: tuple       # logical shape [..., rows, cols]


def operand(ctx, nid) -> Operand:
    g = ctx.graph
    n = g.nodes[nid]
    if nid in ctx.absorbed:
        src = g.nodes[n.inputs[0]]
        return Operand(ctx.weight_buf(src), src, True, n.shape)
    return Operand(ctx.weight_buf(n), n, nid in ctx.transposed, n.shape)


def _f32_weight(ctx, b: Operand, tier, why) -> Operand:
    """``b`` for a tier that reads the weight as f32. A half weight read only by products
    holds no f32 copy while they read the half one; where one cannot (no cuBLAS, a tier
    restriction), the store makes the f32 copy again and keeps it while the weight is half."""
    if b.buf is not None:
        return b
    if b.node.op != "param":    # a dequantised weight written bf16 takes tier 0 (lower_quant.py)
        raise RuntimeError(f"tier {tier}: %{b.node.id} was written bf16 for tier 0 only")
    why.append(f"tier {tier} reads the half weight's f32 copy (kept beside the half one)")
    return dataclasses.replace(b, buf=ctx.param_f32(b.node))


def matmul_env_tiers():
    """The tiers RLX_NUMBA_MATMUL_TIERS allows; tier 4 always (a product must lower)."""
    return env_tiers("RLX_NUMBA_MATMUL_TIERS", TIER_NAMES) | {4}


TIER_NAMES = {0: "cuBLAS GemmEx on a half weight", 1: "cuBLASLt, fused epilogue",
              2: "cuBLAS Sgemm", 3: "numba skinny product",
              5: "numba tensor-core GEMM (f16 / bf16)", 4: "numba SGEMM"}   # (in the order tried)
# the products' one lowering runs the ladder itself (tiers 3 and 5 are timed against the cuBLAS
# tier per shape, which a first-that-applies runner cannot express)
LADDER = "ladder: " + " | ".join(f"{t} {w}" for t, w in TIER_NAMES.items()) + \
    " [RLX_NUMBA_MATMUL_TIERS]"


def _batch_offsets(shape, batch_shape, mat):
    """Element offset of each batch matrix of an operand (0-stride on broadcast dims)."""
    z = np.arange(math.prod(batch_shape))
    bshape = (1,) * (len(batch_shape) - len(shape[:-2])) + tuple(shape[:-2])
    idx = np.zeros(len(z), np.int64)
    rem, mult = z.copy(), 1
    for d in range(len(batch_shape) - 1, -1, -1):
        coord = rem % batch_shape[d]
        rem //= batch_shape[d]
        if bshape[d] != 1:
            idx += coord * mult
        mult *= bshape[d]
    return idx * mat


def _uniform_stride(offs):
    """The stride s with offs == s * arange, or None."""
    if len(offs) < 2:
        return 0
    s = int(offs[1] - offs[0])
    return s if np.array_equal(offs, s * np.arange(len(offs))) else None


def product_steps(ctx, n, a: Operand, b: Operand, out_shape, bias=None, activation=None,
                  residual=None, gated=None, residual_first=False, norm=None) -> list:
    """Steps computing activation(A @ B + bias) + residual into the node's buffer
    (``residual_first``: activation(A @ B + bias + residual), passes/fusion.py's fold of a
    ResNet block's relu(conv + bias + skip): cuBLASLt adds C before its epilogue; tiers 3 and
    5, whose kernels add the residual last, pass it over); with
    ``gated`` (an activation: passes/fusion.py's gated epilogue, 2-D weight with gate/up
    columns interleaved) gated(A @ B + bias) + residual, half the columns. Tier 3 does that
    in its epilogue; the others write the product (+ bias) to a scratch of their own and a
    gated kernel reads it. ``norm`` (gamma node, eps): the product of rms_norm(A) over K
    (passes/fusion.py's norm prologue): tier 3 normalises in its kernel; the others take a
    row-norm step into a scratch of A's dtype first."""
    name = step_name(n)
    out = ctx.buf(n)
    # f16 / bf16 products: half operands, f32 sums, half result; f64: all f64 (_f64_product)
    kind = "f64" if n.dtype == dt.F64 else io_kind(n.dtype)
    half = kind != "f32"
    if a.node.dtype != n.dtype:   # (an f32 graph's half-stored weight is an f32 node)
        raise ValueError(f"{name}: a product of {a.node.dtype} operands cannot write "
                         f"{n.dtype} (a fold must keep the product's dtype)")
    m, k, ncols = a.shape[-2], a.shape[-1], b.shape[-1]
    batch_shape = tuple(out_shape[:-2])
    if len(b.shape) == 2 and not a.trans:       # fold A's leading dims into M: one GEMM
        m, batch_shape = m * math.prod(batch_shape), ()
    batch = math.prod(batch_shape)
    if batch * m * ncols == 0:
        return []
    epi = {"bias": bias, "activation": activation, "residual": residual,
           "residual_first": residual_first}
    post, full = [], out      # full: where the ladder's tiers write the [M, N] product
    full_dt = n.dtype         # and its dtype

    def gated_scratch(sdt):
        """(scratch, [gated step]): the [M, N] product (+ bias) in ``sdt``, which the gated
        kernel reads and rounds once to the node's dtype."""
        scratch = ctx.device_array(np.zeros(batch * m * ncols, sdt.storage))
        return scratch, [gated_step(name + " gated", out, scratch, (batch * m, ncols), sdt,
                                    gated, True, residual=ctx.buf(residual) if residual is not None
                                    else None, out_dtype=n.dtype)]
    if gated:     # the product (+ bias) in f32 (a half one's sums too): the gated kernel
        # rounds once
        full_dt = dt.compute_dtype(n.dtype)
        full, post = gated_scratch(full_dt)
        epi = {"bias": bias, "activation": None, "residual": None, "residual_first": False}
    steps, why = [], []
    has_epi = any(epi[k] is not None for k in ("bias", "activation", "residual"))
    if k == 0:   # an empty sum: zeros (exact in any dtype), then the epilogue in place
        zero = ctx.device_array(np.zeros(1, np.bool_))
        steps.append(elementwise_step(name + " zero", ("cast", None, full_dt, ("in", 0, dt.BOOL)),
                                      full, (batch * m * ncols,), [zero], [(1,)], [dt.BOOL]))
        return (steps + _epilogue(ctx, name, full, (batch * m, ncols), **epi, out_dtype=full_dt)
                + post)
    wide = []

    def sums():
        """Where a half product whose tier leaves (part of) its epilogue to a kernel writes its
        f32 sums: the gated scratch, else the arena scratch the memory plan gave the node
        (``f32_scratch_elems``), or an array of its own where the plan did not foresee one
        (the tiers allowed changed since: a product planned again by set_param_half; cuBLASLt
        refused a product whose epilogue it would fuse)."""
        if gated:
            return full
        if not wide:
            size = batch * m * ncols
            dst = ctx.scratch_buf(n)
            if dst is None or dst.size < size:
                dst = ctx.device_array(np.empty(size, np.float32))
            wide.append(dst[:size])
        return wide[0]
    offs_a = _batch_offsets(a.shape, batch_shape, m * k) if batch > 1 else np.zeros(1, np.int64)
    offs_b = _batch_offsets(b.shape, batch_shape, k * ncols) if batch > 1 else np.zeros(1, np.int64)
    tiers = matmul_env_tiers()
    ok, reason = (False, "the simulator has no cuBLAS") if SIMULATOR else cublas.available()
    flops = 2 * batch * m * ncols * k
    if n.dtype == dt.F64:
        if norm is not None or gated:
            raise AssertionError(f"{name}: an f64 product with a norm prologue or a gated "
                                 f"epilogue (passes/fusion.py folds neither for f64)")
        return _f64_product(ctx, n, name, a, b, out, m, ncols, k, batch, offs_a,
                            offs_b, epi, flops, tiers, ok, reason)
    skinny = (_tier3(ctx, name, a, b, out, m, ncols, k, batch,
                     {"bias": bias, "activation": gated or activation, "residual": residual,
                      "gated": bool(gated), "norm": norm}, why)
              if 3 in tiers and not residual_first else None)
    if 3 not in tiers:
        why.append("tier 3 not allowed by RLX_NUMBA_MATMUL_TIERS")
    elif residual_first:
        why.append("tier 3: its kernel adds the residual after the activation")
    pre = []          # the other tiers' norm step: rms_norm(A) into a scratch they read as A
    if norm is not None:
        normed = ctx.device_array(np.zeros(m * k, a.node.dtype.storage))
        pre = rms_norm_steps(ctx, name + " norm prologue", normed, a.buf, ctx.buf(norm[0]), m, k,
                             norm[1], a.node.dtype, norm[0].dtype)
        a = Operand(normed, a.node, False, a.shape)
    tensor = None       # tier 5's steps: a half product tier 3 does not take
    if 5 not in tiers:
        why.append("tier 5 not allowed by RLX_NUMBA_MATMUL_TIERS")
    elif skinny is not None:
        why.append("tier 5: tier 3 takes this skinny product")
    elif gated:
        why.append("tier 5: a gated epilogue (tier 3, or a product into the gated kernel)")
    elif residual_first:
        why.append("tier 5: its kernel adds the residual after the activation")
    else:
        tensor = _tier5(ctx, name, a, b, out, m, ncols, k, batch, offs_a, offs_b, epi, kind, why)
        tensor = tensor and pre + tensor
    for tier in (0, 1, 2):
        if tier not in tiers:
            why.append(f"tier {tier} not allowed by RLX_NUMBA_MATMUL_TIERS")
            continue
        if not ok:
            why.append(f"tier {tier}: {reason.splitlines()[0]}")
            continue
        if tier == 0 and half:
            why.append(f"tier 0: the operands are {kind} (tier 0 casts an f32 graph's "
                       f"activations for a weight stored half by set_param_half)")
            continue
        if tier:
            b = _f32_weight(ctx, b, tier, why)
        # a half product rounds once (the module docstring): D of its dtype where cuBLASLt
        # fuses the whole epilogue (or there is none), else the f32 sums, which the epilogue
        # kernel reads
        split = half and (has_epi or gated) and not (
            tier == 1 and not gated and lt_fuses(activation, residual is not None, residual_first))
        dst = sums() if split else full
        plan = _TIERS[tier](ctx, name, a, b, dst, m, ncols, k, batch, offs_a, offs_b,
                            NO_EPILOGUE if split else epi, why, kind=kind,
                            out_kind="f32" if split else kind)
        if plan is not None:
            steps, left = plan
            left = epi if split else {**epi, **left}      # what the tier left of the epilogue
            steps = pre + steps + _epilogue(ctx, name, full, (batch * m, ncols), **left,
                                            src=dst, out_dtype=full_dt) + post
            if skinny is not None and m == 1 and half:
                # one row of half activations: tier 3 streams the weight at 85-105% of copy
                # bandwidth where cuBLASLt reaches 37-98% (bench_gemv, H100, the 1B shapes);
                # a timing over a weight that fits in L2 misleads (the 1B shape's 33 MB down
                # projection + residual: cuBLASLt timed faster, 16.7 us in the decode against
                # tier 3's 10.4)
                why.append(f"tier {tier}: one row of {kind} activations takes tier 3 untimed")
                return _done(n, 3, why, skinny, flops)
            if skinny is not None:   # the faster of the two, timed (or known) for this shape:
                # all of ``steps`` (tier 0's cast kernel included), as the run launches them
                key = _choice_key(ctx, b, m, ncols, k, epi, tier, gated, kind, norm is not None)
                us3, us = _timed_choice(ctx, skinny, steps, key)
                timed = f"timed: tier 3 {us3:.2f} us a product, tier {tier} {us:.2f} us"
                if us3 <= us:
                    why.append(f"tier {tier}: slower ({timed})")
                    return _done(n, 3, why, skinny, flops)
                why.append(f"tier 3: slower ({timed})")
            elif tensor is not None and flops < TC_TIMED_MIN_FLOPS:
                why.append(f"tier 5: not timed against tier {tier} below "
                           f"{TC_TIMED_MIN_FLOPS:.1e} flops (launch-bound sizes: not worth "
                           "compiling the kernel)")
            elif tensor is not None:    # the same for tier 5, against the whole cuBLAS plan
                key = _tc_choice_key(a, b, m, ncols, k, batch, epi, tier, kind, ctx)
                try:
                    us5, us = _timed_choice(ctx, tensor, steps, key)
                except Exception as e:    # noqa: BLE001  (a kernel that fails to build here
                    # must not take the cuBLAS tier's products down with it: said, not silent)
                    log.warning("rlx_numba: %s: tier 5 failed to build or run: %s", name, e)
                    why.append(f"tier 5: failed to build or run ({type(e).__name__}: {e})")
                else:
                    timed = f"timed: tier 5 {us5:.2f} us a product, tier {tier} {us:.2f} us"
                    if us5 <= us:
                        why.append(f"tier {tier}: slower ({timed})")
                        return _done(n, 5, why, tensor, flops)
                    why.append(f"tier 5: slower ({timed})")
            return _done(n, tier, why, steps, flops, last=len(pre) + len(plan[0]) - 1)
    if skinny is not None:
        return _done(n, 3, why, skinny, flops)
    if tensor is not None:
        return _done(n, 5, why, tensor, flops)
    b = _f32_weight(ctx, b, 4, why)
    dst = sums() if half and (has_epi or gated) else full   # f32: one rounding, the kernel's
    out_kind = kind if dst is out else "f32"
    kern = mm.sgemm_kernel(a.trans, b.trans, kind, out_kind)
    grid, block = mm.sgemm_launch(m, ncols, batch)
    tag = "" if kind == "f32" else f" {kind}->{out_kind}"
    steps = [Step(name, f"numba sgemm{tag} {batch}x{m}x{ncols}x{k}", kern, grid, block,
                  (dst, a.buf, b.buf, np.int64(m), np.int64(ncols), np.int64(k),
                   ctx.device_array(offs_a), ctx.device_array(offs_b), np.int64(batch)))]
    return (pre + _done(n, 4, why, steps, flops)
            + _epilogue(ctx, name, full, (batch * m, ncols), **epi, src=dst, out_dtype=full_dt)
            + post)


def _f64_product(ctx, n, name, a, b, out, m, ncols, k, batch, offs_a, offs_b, epi, flops,
                 tiers, ok, reason):
    """An f64 product, computed in f64 throughout: tier 2's cublasDgemm (strided / pointer-array
    batched) on a GPU with cuBLAS, else tier 4's numba kernel in its f64 kind (the DGEMM: the
    simulator, no cuBLAS, RLX_NUMBA_MATMUL_TIERS); then the epilogue kernel in place, in f64.
    Tiers 0, 1, 3 and 5 have no f64 form (a half weight, cuBLASLt's TF32 / half epilogues, the
    f32 skinny kernel, tensor cores), so they are passed over."""
    why = [f"tier {t}: no f64 form" for t in (0, 1) if t in tiers]
    steps = None
    if 2 not in tiers:
        why.append("tier 2 not allowed by RLX_NUMBA_MATMUL_TIERS")
    elif not ok:
        why.append(f"tier 2: {reason.splitlines()[0]}")
    else:
        from ..cublas import gemm
        cm = gemm.colmajor(m, ncols, k, a.trans, b.trans)
        sa, sb = _uniform_stride(offs_a), _uniform_stride(offs_b)
        ptrs, call = None, "cublasDgemm" if batch == 1 else "cublasDgemmStridedBatched"
        if batch > 1 and (sa is None or sb is None):
            ptrs = (gemm.pointer_array(data_ptr(a.buf), offs_a, 8),
                    gemm.pointer_array(data_ptr(b.buf), offs_b, 8),
                    gemm.pointer_array(data_ptr(out), np.arange(batch) * m * ncols, 8))
            ctx.keep(ptrs)
            call = "cublasDgemmBatched"
        make = lambda stream: gemm.sgemm_plan(stream, cm, data_ptr(a.buf), data_ptr(b.buf),  # noqa: E731
                                              data_ptr(out), tf32=False, batch=batch,
                                              stride_a=sa or 0, stride_b=sb or 0,
                                              ptr_arrays=ptrs, f64=True)
        steps = _done(n, 2, why, [CallStep(name, f"{call} {batch}x{m}x{ncols}x{k}", make)],
                      flops)
    if steps is None:
        why += [f"tier {t}: no f64 form" for t in (3,) if t in tiers]
        kern = mm.sgemm_kernel(a.trans, b.trans, "f64", "f64")
        grid, block = mm.sgemm_launch(m, ncols, batch)
        steps = _done(n, 4, why, [Step(name, f"numba dgemm {batch}x{m}x{ncols}x{k}", kern, grid,
                                       block, (out, a.buf, b.buf, np.int64(m), np.int64(ncols),
                                               np.int64(k), ctx.device_array(offs_a),
                                               ctx.device_array(offs_b), np.int64(batch)))],
                      flops)
    return steps + _epilogue(ctx, name, out, (batch * m, ncols), **epi, out_dtype=dt.F64)


def f32_scratch_elems(graph: Graph, n) -> int:
    """Elements of the f32 scratch that product node ``n`` (as the fusion pass lowers it)
    writes, for the memory plan (plan.py puts it in the arena, live at the node's step
    alone): a half product with an epilogue that a kernel applies, its tier writing the f32
    sums there for that kernel to round once -- on a GPU with cuBLAS, every such product but
    an unbatched one whose epilogue cuBLASLt fuses whole (tier 1, ``lt_fuses``); without
    (the simulator, no library, RLX_NUMBA_MATMUL_TIERS), tier 4's. 0 for any other node,
    and where tier 5 is offered without cuBLAS (it fuses the epilogue; should it pass a
    product over, tier 4 makes its own scratch). A product planned otherwise than foreseen
    here (an absorbed transpose of A unfolding the batch; cuBLASLt refusing one it would
    fuse) makes its own (``product_steps``)."""
    a = n.attrs
    if (n.op not in PRODUCTS or n.dtype not in (dt.F16, dt.BF16) or a.get("gated")
            or not (a.get("has_bias") or a.get("activation") or a.get("has_residual"))
            or not n.size or not graph.nodes[n.inputs[0]].shape[-1]):
        return 0
    tiers = matmul_env_tiers()
    if not SIMULATOR and {1, 2} & tiers and cublas.available()[0]:
        unbatched = n.op == "linear" or len(graph.nodes[n.inputs[1]].shape) == 2 or \
            math.prod(n.shape[:-2]) == 1
        whole = 1 in tiers and unbatched and lt_fuses(a.get("activation"), a.get("has_residual"),
                                                      a.get("residual_first", False))
        return 0 if whole else n.size
    if tier5_offered():
        return 0        # tier 5 takes every half product tier 3 does not (both fuse the epilogue)
    return n.size


def _done(n, tier, why, steps, flops, last=-1):
    """Steps of the chosen tier, its product step (``last``) carrying the tier and why."""
    steps[last].info.update(tier=tier, why=list(why), flops=flops)
    log_tier(n, "matmul", f"{tier} ({steps[last].kernel_name})", why)
    return steps


def _epilogue(ctx, name, out, shape, bias=None, activation=None, residual=None, src=None,
              out_dtype=dt.F32, residual_first=False):
    """out = activation(src + bias) + residual (``residual_first``: activation(src + bias +
    residual)) as one generated kernel (or nothing), in f32 (f64 for an f64 product)
    and rounded once to ``out_dtype`` on the store; src (f32) is out itself (in place, an f32
    product) or a half product's f32 scratch. Bias and residual are read in their dtype."""
    src = out if src is None else src
    if bias is None and activation is None and residual is None:
        if src is not out:
            raise AssertionError(f"{name}: a product written to a scratch with no epilogue")
        return []
    f = dt.compute_dtype(out_dtype)      # f32, or f64 for an f64 product
    dts = [f if src is not out else out_dtype]
    expr = ("in", 0, dts[0])
    ins, shapes = [src], [shape]
    if bias is not None:
        expr = ("binary", "add", f, expr, ("in", len(ins), bias.dtype))
        ins.append(ctx.buf(bias))
        shapes.append(bias.shape)
        dts.append(bias.dtype)
    if activation and not residual_first:
        expr = ("activation", activation, f, expr)
    if residual is not None:
        expr = ("binary", "add", f, expr, ("in", len(ins), residual.dtype))
        ins.append(ctx.buf(residual))
        shapes.append(shape)
        dts.append(residual.dtype)
    if activation and residual_first:
        expr = ("activation", activation, f, expr)
    if out_dtype != f:
        expr = ("cast", None, out_dtype, expr)
    return [elementwise_step(name + " epilogue", expr, out, shape, ins, shapes, dts)]


def _tier0(ctx, name, a, b, out, m, n, k, batch, offs_a, offs_b, epi, why, kind, out_kind):
    # (kind and out_kind are f32: tier 0 takes an f32 graph's products)
    half = ctx.half_param(b.node)
    if half is None:
        why.append("tier 0: the weight is not stored half (set_param_half)")
        return None
    hdt, hbuf = half
    sa, sb = _uniform_stride(offs_a), _uniform_stride(offs_b)
    if batch > 1 and (sa is None or sb is None):
        why.append("tier 0: the batch broadcast has no single stride")
        return None
    from ..cublas import api, gemm
    size = a.node.size
    scratch = ctx.device_array(np.empty(size, hdt.storage))
    cast = elementwise_step(name + f" cast {hdt}", ("cast", None, hdt, ("in", 0, dt.F32)), scratch,
                            (size,), [a.buf], [(size,)], [dt.F32])
    cm = gemm.colmajor(m, n, k, a.trans, b.trans)
    code = api.R_16BF if hdt == dt.BF16 else api.R_16F
    if batch == 1:   # cuBLASLt: better kernels for skinny (decode) shapes, and the epilogue
        lt = _lt_step(ctx, name, cm, scratch, hbuf, out, epi, why, in_type=code, label=str(hdt))
        if lt is not None:
            return [cast, lt[0]], lt[1]
    make = lambda stream: gemm.gemm_ex_plan(stream, cm, data_ptr(scratch), code, data_ptr(hbuf), code,  # noqa: E731
                                            data_ptr(out), batch=batch, stride_a=sa or 0,
                                            stride_b=sb or 0)
    return [cast, CallStep(name, f"cublasGemmEx {hdt} {batch}x{m}x{n}x{k}", make)], {}


def _lt_step(ctx, name, cm, a_buf, b_buf, out, epi, why, in_type, label, out_type=None):
    """One planned cuBLASLt step fusing what it can of the epilogue, and the epilogue left
    over; None (with the reason in ``why``) when the library has no algorithm. ``out_type``
    (C, D and the bias; default f32): a half product's own type, or f32 into a scratch."""
    from ..cublas import api, gemm
    bias, act, res = epi["bias"], epi["activation"], epi["residual"]
    lt_act = act if act in LT_ACTIVATIONS else None
    # C = residual, beta = 1, added before the activation: where there is none, or where the
    # node wants it there (residual_first; an activation cuBLASLt lacks then runs on D)
    fuse_res = res is not None and (act is None or epi.get("residual_first", False))
    tf32 = cublas.allow_tf32 and in_type == api.R_32F
    kw = dict(tf32=tf32, activation=lt_act, in_type=in_type,
              out_type=api.R_32F if out_type is None else out_type,
              # the bias is added before any activation: fused even when the activation
              # is left to the epilogue kernel
              bias_ptr=data_ptr(ctx.buf(bias)) if bias is not None else None,
              residual_ptr=data_ptr(ctx.buf(res)) if fuse_res else None)
    try:   # plan now, so a shape the library refuses falls through at compile time
        first = gemm.lt_plan(ctx.stream, cm, data_ptr(a_buf), data_ptr(b_buf), data_ptr(out), **kw)
    except cublas.CublasError as e:
        why.append(f"cuBLASLt: {e}")
        return None
    own = ctx.stream            # (not ctx: a step must not keep its executable alive)
    make = lambda stream: first if stream is own else gemm.lt_plan(  # noqa: E731
        stream, cm, data_ptr(a_buf), data_ptr(b_buf), data_ptr(out), **kw)
    fused_bias = kw["bias_ptr"] is not None
    tags = "+".join(t for t in (label, "bias" if fused_bias else "", lt_act or "",
                                "residual" if fuse_res else "") if t)
    step = CallStep(name, f"cublasLt {tags} {cm.n}x{cm.m}x{cm.k}{' tf32' if tf32 else ''}", make)
    left = {"bias": None if fused_bias else bias, "activation": None if lt_act else act,
            "residual": None if fuse_res else res}
    return step, left


def _tier1(ctx, name, a, b, out, m, n, k, batch, offs_a, offs_b, epi, why, kind, out_kind):
    """Every unbatched product, whatever its epilogue: cuBLASLt fuses what it can (the
    bias always, relu / gelu_tanh, a residual with no activation) and the epilogue kernel
    does the rest. Even with nothing to fuse it beats cublasSgemm_v2 on the host (a call cost
    ~11 against ~23 us of CPU on an H100 box: Sgemm runs cuBLAS's own heuristic each call),
    and its algorithm was timed at compile time. f16 / bf16 operands: A, B, C and D (and the
    bias) of that type, f32 compute and scale (tensor cores); ``out_kind`` f32: D holds the
    f32 sums for the epilogue kernel (the module docstring's roundings)."""
    if batch > 1:
        why.append("tier 1: batched product")
        return None
    from ..cublas import api, gemm
    cm = gemm.colmajor(m, n, k, a.trans, b.trans)
    label = "" if kind == "f32" else kind if out_kind == kind else f"{kind}->{out_kind}"
    lt = _lt_step(ctx, name, cm, a.buf, b.buf, out, epi, why, in_type=api.DATA_TYPE[kind],
                  label=label, out_type=api.DATA_TYPE[out_kind])
    return None if lt is None else ([lt[0]], lt[1])


def _tier2(ctx, name, a, b, out, m, n, k, batch, offs_a, offs_b, epi, why, kind, out_kind):
    """cublasSgemm (strided / pointer-array batched) for f32; for f16 / bf16 operands
    cublasGemmEx / GemmStridedBatchedEx / GemmBatchedEx with f32 compute, C of ``out_kind``
    (the operands' type, or f32 sums for the epilogue kernel to round once)."""
    from ..cublas import gemm
    cm = gemm.colmajor(m, n, k, a.trans, b.trans)
    if kind != "f32":
        return _tier2_ex(ctx, name, a, b, out, m, n, k, batch, offs_a, offs_b, cm, kind, out_kind)
    tf32 = cublas.allow_tf32
    sa, sb = _uniform_stride(offs_a), _uniform_stride(offs_b)
    ptrs, kind = None, "cublasSgemm" if batch == 1 else "cublasSgemmStridedBatched"
    if batch > 1 and (sa is None or sb is None):
        ptrs = (gemm.pointer_array(data_ptr(a.buf), offs_a, 4), gemm.pointer_array(data_ptr(b.buf), offs_b, 4),
                gemm.pointer_array(data_ptr(out), np.arange(batch) * m * n, 4))
        ctx.keep(ptrs)
        kind = "cublasSgemmBatched"
    make = lambda stream: gemm.sgemm_plan(stream, cm, data_ptr(a.buf), data_ptr(b.buf), data_ptr(out),  # noqa: E731
                                          tf32=tf32, batch=batch, stride_a=sa or 0,
                                          stride_b=sb or 0, ptr_arrays=ptrs)
    return [CallStep(name, f"{kind} {batch}x{m}x{n}x{k}{' tf32' if tf32 else ''}", make)], {}


def _tier2_ex(ctx, name, a, b, out, m, n, k, batch, offs_a, offs_b, cm, kind, out_kind):
    from ..cublas import api, gemm
    code, c_code = api.DATA_TYPE[kind], api.DATA_TYPE[out_kind]
    sa, sb = _uniform_stride(offs_a), _uniform_stride(offs_b)
    ptrs, call = None, "cublasGemmEx" if batch == 1 else "cublasGemmStridedBatchedEx"
    if batch > 1 and (sa is None or sb is None):
        isz, osz = np.dtype(a.buf.dtype).itemsize, np.dtype(out.dtype).itemsize
        ptrs = (gemm.pointer_array(data_ptr(a.buf), offs_a, isz),
                gemm.pointer_array(data_ptr(b.buf), offs_b, isz),
                gemm.pointer_array(data_ptr(out), np.arange(batch) * m * n, osz))
        ctx.keep(ptrs)
        call = "cublasGemmBatchedEx"
    make = lambda stream: gemm.gemm_ex_plan(stream, cm, data_ptr(a.buf), code, data_ptr(b.buf),  # noqa: E731
                                            code, data_ptr(out), c_type=c_code, batch=batch,
                                            stride_a=sa or 0, stride_b=sb or 0, ptr_arrays=ptrs)
    to = "" if out_kind == kind else f"->{out_kind}"
    return [CallStep(name, f"{call} {kind}{to} {batch}x{m}x{n}x{k}", make)], {}


_TIERS = {0: _tier0, 1: _tier1, 2: _tier2}


def _tier3(ctx, name, a, b, out, m, n, k, batch, epi, why):
    """The skinny-product kernel step (kernels/gemv.py), epilogue included, or None with the
    reason in ``why``."""
    if SIMULATOR and not (os.environ.get("RLX_NUMBA_MATMUL_TIERS") and 3 in matmul_env_tiers()):
        why.append("tier 3: under the simulator only when RLX_NUMBA_MATMUL_TIERS names it")
        return None
    if batch > 1 or m > gv.MAX_M:
        why.append(f"tier 3: {'batched product' if batch > 1 else f'M = {m} > {gv.MAX_M}'}")
        return None
    if a.trans or len(b.shape) != 2 or not b.trans:
        why.append("tier 3: the weight is not a 2-D matrix stored [N, K] (or A is transposed)")
        return None
    wbuf, kind = _skinny_weight(ctx, b)
    xkind = io_kind(a.node.dtype)    # a half product: x, y, bias, residual of its dtype
    if xkind != "f32" and kind != xkind:
        why.append(f"tier 3: {xkind} activations with a {kind} weight")
        return None
    norm = epi["norm"]
    if norm is not None and norm[0].dtype != a.node.dtype:
        why.append(f"tier 3: a {norm[0].dtype} norm weight of {a.node.dtype} activations")
        return None
    gamma = ctx.buf(norm[0]) if norm is not None else None
    vec = gv.vec_width(kind)
    if k % vec or not SIMULATOR and any(data_ptr(p) % 16 for p in (wbuf, a.buf, gamma)
                                        if p is not None):
        vec = 1                           # rows not 16-byte aligned: element loads
    sm = 1 if SIMULATOR else sm_count()
    geo = default_geometry("gemv")
    nw, tw, cpw, u, groups, splits, kchunk, minb = gv.plan(m, n, k, kind, vec, sm, geo=geo,
                                                           whole_k=norm is not None)
    gated = epi["gated"]
    if gated and nw // tw * cpw % 2:      # a block takes whole (gate, up) pairs
        nw, tw, cpw, u, groups, splits, kchunk, minb = gv.plan(m, n, k, kind, vec, sm,
                                                               cpw=2 * cpw, geo=geo,
                                                               whole_k=norm is not None)
    if norm is not None and splits > 1:   # the kernel's norm needs a team to see all of K
        why.append(f"tier 3: the rms_norm prologue needs K in one split ({splits} planned)")
        return None
    bias, act, res = epi["bias"], epi["activation"], epi["residual"]
    pdl = pdl_supported()     # the weight loads start while the kernel before still runs
    kern = gv.gemv_kernel(m, nw, tw, cpw, u, kind, vec, bias is not None, act, res is not None,
                          minb, gated, xkind, norm is not None, pdl)
    dummy = f32_dummy(ctx)
    part = ctx.device_array(np.zeros(splits * m * n, np.float32)) if splits > 1 else dummy
    count = ctx.device_array(np.zeros(groups, np.int32)) if splits > 1 else dummy
    grid = (min(groups, 2) if SIMULATOR else groups, splits)
    args = (out, a.buf, wbuf, ctx.buf(bias) if bias is not None else dummy,
            ctx.buf(res) if res is not None else dummy, part, count, np.int64(n), np.int64(k),
            np.int64(kchunk), np.int64(splits),
            gamma if gamma is not None else dummy,
            np.float32(norm[1] if norm is not None else 0.0))
    tags = "+".join(t for t in ("rms_norm" if norm is not None else "",
                                kind if xkind == "f32" else f"{kind}x{xkind}",
                                "bias" if bias is not None else "",
                                f"gated {act}" if gated else act or "",
                                "residual" if res is not None else "") if t)
    wbytes = n * k * np.dtype(wbuf.dtype).itemsize
    return [Step(name, f"numba gemv {tags} {m}x{n}x{k} nw{nw} tw{tw} cpw{cpw} u{u} vec{vec}"
                 f"{f' {splits} splits' if splits > 1 else ''}{' pdl' if pdl else ''}", kern, grid,
                 (nw * 32,), args,
                 {"bytes": wbytes + np.dtype(out.dtype).itemsize * (m * k + m * n),
                  "splits": splits}, pdl=pdl)]


def _tier5(ctx, name, a, b, out, m, n, k, batch, offs_a, offs_b, epi, kind, why):
    """The tensor-core GEMM step (kernels/matmul_tc.py) of a half product, its epilogue fused
    (bias and residual in the product's dtype, one rounding), or None with the reason in
    ``why``. Under the simulator only when RLX_NUMBA_MATMUL_TIERS names it (its mma twins are
    slow)."""
    if kind == "f32":
        why.append("tier 5: f32 operands (it takes f16 / bf16 products)")
        return None
    if not tier5_offered():
        why.append("tier 5: only where RLX_NUMBA_MATMUL_TIERS names it, or without cuBLAS")
        return None
    if b.buf is None or b.node.dtype != a.node.dtype:
        why.append(f"tier 5: the weight is {b.node.dtype}, the activations {a.node.dtype}")
        return None
    act = epi["activation"]
    if act and not hasattr(ew, act):
        why.append(f"tier 5: no element-wise activation {act!r}")
        return None
    bits = (lambda buf: buf) if kind == "bf16" else (lambda buf: buf.view(np.uint16))
    abuf, bbuf = bits(a.buf), bits(b.buf)
    ptrs = () if SIMULATOR else (data_ptr(abuf), data_ptr(bbuf))
    vec, unaligned = mtc.vec_ok(a.trans, b.trans, m, n, k, offs_a, offs_b, ptrs)
    if not vec:
        why.append(f"tier 5: element loads, not cp.async: {unaligned}")
    bias, res = epi["bias"], epi["residual"]
    kern = mtc.tc_gemm_kernel(a.trans, b.trans, kind, vec, bias is not None, act,
                              res is not None)
    grid, block = mtc.tc_launch(m, n, batch)
    dummy = ctx.shared(f"tc_dummy_{kind}", lambda: np.zeros(1, np.dtype(out.dtype)))
    args = (out, abuf, bbuf, ctx.buf(bias) if bias is not None else dummy,
            ctx.buf(res) if res is not None else dummy, np.int64(m), np.int64(n), np.int64(k),
            ctx.device_array(offs_a), ctx.device_array(offs_b), np.int64(batch))
    geo = default_geometry("matmul_tc")
    tags = "+".join(t for t in (kind, "NT"[a.trans] + "NT"[b.trans],
                                "bias" if bias is not None else "", act or "",
                                "residual" if res is not None else "",
                                "cp.async" if vec else "element loads") if t)
    return [Step(name, f"numba tc-gemm {tags} {batch}x{m}x{n}x{k} "
                 f"{geo.bm}x{geo.bn}x{geo.bk}/{geo.warps}w", kern, grid, block, args)]


def tier5_offered() -> bool:
    """Whether half products are offered to tier 5: where RLX_NUMBA_MATMUL_TIERS names it
    (beside cuBLAS then timed against it), or by default on a GPU without cuBLAS. Beside
    cuBLAS it is opt-in until its timings on a GPU say where it wins."""
    if os.environ.get("RLX_NUMBA_MATMUL_TIERS"):
        return 5 in matmul_env_tiers()
    return not SIMULATOR and not cublas.available()[0]


def _tc_choice_key(a, b, m, n, k, batch, epi, tier, kind, ctx) -> str:
    """tier_choices.json's key of a tier-5-against-cuBLAS verdict."""
    tags = ",".join(t for t in ("bias" if epi["bias"] is not None else "", epi["activation"] or "",
                                "residual" if epi["residual"] is not None else "") if t)
    return (f"tc{mtc.VERSION}|{device_info()['name']}|{batch}x{m}x{n}x{k}|{kind}|"
            f"{'NT'[a.trans]}{'NT'[b.trans]}|{tags or '-'}|tier{tier}|"
            f"{'graph' if _graph_mode(ctx) else 'stream'}")


def _skinny_weight(ctx, b):
    """(device array, kind) of the weight tier 3 reads: the half copy of an f32 param stored
    by set_param_half, else the weight's own storage (f32, or a half product's f16 / bf16)."""
    half = ctx.half_param(b.node)
    if half is not None:
        return half[1], str(half[0])
    return b.buf, io_kind(b.node.dtype)


def f32_dummy(ctx):
    return ctx.shared("gemv_dummy", lambda: np.zeros(1, np.float32))


# ---- tier 3 against the ladder's tier: timed once per shape, kept on disk -----------------------
# tier 5 is timed against a cuBLAS tier only for products of at least this many flops (512^3:
# 2.7e8): each timing compiles a kernel variant (seconds on a fresh machine), and smaller
# products are launch-bound (the GPU tests' many small half products would each compile one)
TC_TIMED_MIN_FLOPS = 2 ** 28
CHOICE_VERSION = 3          # bump when the kernel or its plan changes: old verdicts are ignored
CHOICE_FILE = "tier_choices.json"
_CHOICES: dict = {}         # this process's verdicts (key -> (tier 3 us, other us))


def _choice_key(ctx, b, m, n, k, epi, tier, gated=None, xkind="f32", norm=False) -> str:
    kind = _skinny_weight(ctx, b)[1] + ("" if xkind == "f32" else f"x{xkind}")
    tags = ",".join(t for t in ("rms_norm" if norm else "",
                                "bias" if epi["bias"] is not None else "", epi["activation"] or "",
                                f"gated-{gated}" if gated else "",
                                "residual" if epi["residual"] is not None else "") if t)
    return (f"v{CHOICE_VERSION}|{device_info()['name']}|{m}x{n}x{k}|{kind}|{tags or '-'}|"
            f"tier{tier}|{'graph' if _graph_mode(ctx) else 'stream'}"
            f"{'|tf32' if cublas.allow_tf32 else ''}")


def _choice_path():
    from ..kernels.cache import cache_dir
    return cache_dir() / CHOICE_FILE


def _load_choices() -> dict:
    """The verdicts on disk: key -> [tier 3 us, other us]; anything else in the file (a damaged
    or foreign one) is ignored, and those shapes are timed again."""
    try:
        data = json.loads(_choice_path().read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items()
            if isinstance(v, list) and len(v) == 2
            and all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in v)}


def _save_choice(key, value) -> None:
    """Merge one verdict into the file: read, merge and rename under a lock, so processes
    timing at once keep each other's verdicts."""
    import fcntl
    try:
        path = _choice_path()
        with open(path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = _load_choices()
            data[key] = value
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tier_choices")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=0)
            os.replace(tmp, path)
    except OSError as e:      # a read-only cache: the verdict is kept for this process only
        log.warning("rlx_numba: could not save the tier-3 timing (%s)", e)


def _timed_choice(ctx, skinny, other, key):
    """(tier 3 us, other us) a product: from this process, the disk, or timed now."""
    got = _CHOICES.get(key)
    if got is None:
        disk = _load_choices().get(key)
        if disk is not None:
            got = tuple(float(v) for v in disk)
    if got is None:
        got = (_device_us(ctx, skinny), _device_us(ctx, other))
        us3b = _device_us(ctx, skinny)          # again, after the other: drift shows less
        got = (min(got[0], us3b), got[1])
        _save_choice(key, list(got))
    _CHOICES[key] = got
    return got


TIMED_LAUNCHES = 20


def _graph_mode(ctx) -> bool:
    mode = getattr(ctx, "exec_mode", None)
    return getattr(mode, "kind", None) == "graph"


def _device_us(ctx, steps) -> float:
    """Device time of one run of ``steps`` (us), best of 3 windows of TIMED_LAUNCHES runs, as
    the executable will run them: replayed from a CUDA graph under ExecMode GRAPH (its
    launches sit closer together: a product of two kernels loses less there), else launched
    on the stream, queued behind a sleeping kernel so that the host's enqueue cost is not
    what the events measure. The operands' contents do not matter (the output is
    overwritten by the first real run)."""
    from numba import cuda
    stream = ctx.stream
    for s in steps:
        s.bind(stream, True)
    for _ in range(2):                          # warm-up (and cuBLASLt's first-call setup)
        for s in steps:
            s()
    if _graph_mode(ctx):
        return _graph_us(stream, steps)
    # compiled on a worker thread (lower.compile_off_thread): a compile on this one would keep this
    # stack's frames, the executable being compiled among them, alive
    compile_off_thread(gv.spin, (types.int64,))
    best = math.inf
    for _ in range(3):
        gv.spin[1, 1, stream](np.int64(gv.SPIN_NS))
        e0, e1 = cuda.event(), cuda.event()
        e0.record(stream)
        for _ in range(TIMED_LAUNCHES):
            for s in steps:
                s()
        e1.record(stream)
        e1.synchronize()
        best = min(best, cuda.event_elapsed_time(e0, e1) * 1e3 / TIMED_LAUNCHES)
    return best


def _graph_us(stream, steps) -> float:
    """``_device_us`` through a CUDA graph of TIMED_LAUNCHES runs of the steps."""
    from numba import cuda

    from .cudagraph import cu_check, cu_driver, destroy_graph, instantiate
    drv = cu_driver()
    h = drv.CUstream(int(stream))
    cu_check(drv, drv.cuStreamBeginCapture(
        h, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture")
    try:
        with cuda.defer_cleanup():
            for _ in range(TIMED_LAUNCHES):
                for s in steps:
                    s()
    finally:
        res = drv.cuStreamEndCapture(h)        # always: never leave the stream capturing
    graph = cu_check(drv, res, "cuStreamEndCapture")
    exec_ = None
    try:
        exec_ = instantiate(drv, graph)
        cu_check(drv, drv.cuGraphLaunch(exec_, h), "cuGraphLaunch")
        best = math.inf
        for _ in range(3):
            e0, e1 = cuda.event(), cuda.event()
            e0.record(stream)
            for _ in range(3):
                cu_check(drv, drv.cuGraphLaunch(exec_, h), "cuGraphLaunch")
            e1.record(stream)
            e1.synchronize()
            best = min(best, cuda.event_elapsed_time(e0, e1) * 1e3 / (3 * TIMED_LAUNCHES))
        return best
    finally:
        destroy_graph(exec_, graph)


@lowering("matmul", tier=LADDER)
def _lower_matmul(ctx, n):
    # a matmul folded with its epilogue by passes/fusion.py carries linear's attributes and
    # its bias / residual as inputs 2 and 3
    a, b = (operand(ctx, i) for i in n.inputs[:2])
    bias, res, norm = _epilogue_inputs(ctx.graph, n)
    return product_steps(ctx, n, a, b, n.shape, bias=bias, activation=n.attrs.get("activation"),
                         residual=res, gated=n.attrs.get("gated"),
                         residual_first=n.attrs.get("residual_first", False), norm=norm)


def _epilogue_inputs(g, n):
    """(bias node or None, residual node or None, (gamma node, eps) or None) from
    n.inputs[2:] and n's has_ flags and ``rms_norm_eps`` (passes/fusion.py's norm prologue:
    its gamma is the last input)."""
    rest = [g.nodes[i] for i in n.inputs[2:]]
    bias = rest.pop(0) if n.attrs.get("has_bias") else None
    res = rest.pop(0) if n.attrs.get("has_residual") else None
    eps = n.attrs.get("rms_norm_eps")
    return bias, res, None if eps is None else (rest.pop(0), eps)


@lowering("linear", tier=LADDER)
def _lower_linear(ctx, n):
    g = ctx.graph
    x = g.nodes[n.inputs[0]]
    w = operand(ctx, n.inputs[1])
    k = x.shape[-1]
    a = Operand(ctx.buf(x), x, False, (math.prod(x.shape[:-1]), k))
    bias, res, norm = _epilogue_inputs(g, n)
    return product_steps(ctx, n, a, w, (a.shape[0], w.shape[-1]), bias=bias,
                         activation=n.attrs["activation"], residual=res,
                         gated=n.attrs.get("gated"),
                         residual_first=n.attrs.get("residual_first", False), norm=norm)
