"""The blocks model graphs are composed of: the token embedding, the norms, the attention
blocks (a decoder's causal one with rope and the KV cache, an encoder's), the MLP blocks
(gated, plain, mixture of experts) and the LM head. build_llama (Llama and the MoE decoders),
build_bert, build_vit and build_mamba (whose mixer is mamba.mamba_mixer, a block a hybrid
decoder can take too) put them together layer by layer.

A block takes the graph's ``Weights`` (its params by name, and how its products read them:
packed GGUF weights, tensor parallelism), the Hugging Face name of the module it reads
(``model.layers.3.mlp.``) and the tensors it works on, and returns tensors. A projection
``name`` is the params ``name.weight`` [out, in] (read through a transpose the products take
as an operand flag, so no weight is copied) and ``name.bias`` when the model has one.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ir.graph import Graph, Tensor


# GGUF block formats a QAT graph fake-quantises its weights to (weights.quantize's): block
# size along K, the block's scale from its values, and the integer range
QAT_SCHEMES = {
    "q8_0": (32, "absmax", -127, 127),      # d = max|x| / 127
    "q4_0": (32, "signed", -8, 7),          # d = x at max|x| / -8 (that value maps to -8)
}


def fake_quant_weight(g: Graph, w: Tensor, scheme: str) -> Tensor:
    """``w`` [N, K] fake-quantised as GGUF ``scheme`` stores it (QAT_SCHEMES): blocks of 32
    along K, each with the scale llama.cpp's quantizer divides by (f32: the same integers
    but at ties, which it rounds away from zero and this half to even; the file keeps the
    scale in f16, so its values differ by that rounding, 2^-11 relative); straight-through
    gradient to w, none through the scale (Graph.fake_quantize)."""
    block, rule, qmin, qmax = QAT_SCHEMES[scheme]
    n, k = w.shape
    blocks = g.reshape(w, (n * k // block, block))
    amax = g.reduce("max", g.activation("abs", blocks), (1,))
    if rule == "absmax":
        d = g.binary("div", amax, float(qmax))     # amax / 127 in f32, as the quantizer
    else:    # the value of largest magnitude, sign kept: max if max >= -min, else min
        hi, lo = g.reduce("max", blocks, (1,)), g.reduce("min", blocks, (1,))
        d = g.where(g.compare("ge", hi, g.activation("neg", lo)), hi, lo) * (1.0 / qmin)
    d = g.where(g.compare("eq", amax, 0.0), 1.0, d)   # an all-zero block: any scale gives 0
    q = g.fake_quantize(blocks, d, None, quant_min=qmin, quant_max=qmax, axis=0)
    return g.reshape(q, (n, k))


class Weights:
    """A graph's params by name and how its products read them. ``quant``: param name ->
    (scheme, packed shape) of the weights kept packed (GGUF blocks: u8 params their products
    dequantise as they go). ``tensor_parallel=(rank, world)``: the graph is one rank's of a
    world-way tensor-parallel model (Megatron's layout): a row-parallel projection's
    products are partial sums an all_reduce adds up before its bias. ``qat``: a GGUF scheme
    of QAT_SCHEMES: the products' weights and the token table (f32 params) are read
    fake-quantised to it (fake_quant_weight), those whose K is a multiple of its block."""

    def __init__(self, g: Graph, params: dict, quant: dict | None = None,
                 tensor_parallel: tuple | None = None, qat: str | None = None):
        if qat is not None and qat not in QAT_SCHEMES:
            raise ValueError(f"Weights: qat must be one of {', '.join(QAT_SCHEMES)} or None, "
                             f"got {qat!r}")
        self.g, self.params, self.quant, self.qat = g, params, quant or {}, qat
        self.rank, self.world = tensor_parallel or (0, 1)

    @classmethod
    def declare(cls, g: Graph, shapes: dict, quant: dict | None = None,
                tensor_parallel: tuple | None = None, qat: str | None = None) -> "Weights":
        """The params ``shapes`` (name -> shape) declared on ``g`` in that order: f32, or u8
        of the packed shape for those in ``quant``."""
        quant = quant or {}
        params = {k: g.param(k, quant[k][1], "u8") if k in quant else g.param(k, shape)
                  for k, shape in shapes.items()}
        return cls(g, params, quant, tensor_parallel, qat)

    def matrix(self, name: str) -> Tensor:
        """Param ``name`` as a product or a lookup reads it: fake-quantised under ``qat``."""
        t = self.params[name]
        if self.qat and name not in self.quant and len(t.shape) == 2 \
                and t.shape[1] % QAT_SCHEMES[self.qat][0] == 0:
            return fake_quant_weight(self.g, t, self.qat)
        return t

    def __getitem__(self, name: str) -> Tensor:
        return self.params[name]

    def __contains__(self, name: str) -> bool:
        return name in self.params

    def get(self, name: str) -> Tensor | None:
        return self.params.get(name)

    def all_reduce(self, x: Tensor) -> Tensor:
        return self.g.all_reduce(x, world_size=self.world, rank=self.rank)

    def all_gather(self, x: Tensor, axis: int) -> Tensor:
        return self.g.all_gather(x, axis, world_size=self.world, rank=self.rank)

    def linear(self, x: Tensor, name: str, *, activation=None,
               row_parallel: bool = False) -> Tensor:
        """x @ W^T (+ bias) of projection ``name``, its ``activation`` in the product's
        epilogue. A packed weight's product is Graph.dequant_matmul. ``row_parallel``: the
        weight is split by input columns across the ranks (o_proj, down_proj), so with
        tensor parallelism the partial products are all-reduced and the bias added after."""
        g, wname, bias = self.g, name + ".weight", self.params.get(name + ".bias")
        packed = wname in self.quant
        reduce = row_parallel and self.world > 1
        if activation is not None and (packed or reduce):
            raise ValueError(f"Weights.linear: {name}: an activation is fused into a plain "
                             f"product only (not a packed or row-parallel one)")
        if packed:
            y = g.dequant_matmul(x, self.params[wname], scheme=self.quant[wname][0])
        elif reduce:
            y = self.all_reduce(g.linear(x, g.transpose(self.matrix(wname), (1, 0))))
        else:
            return g.linear(x, g.transpose(self.matrix(wname), (1, 0)), bias,
                            activation=activation)
        return y if bias is None else y + bias


# ---- embedding, norms, head ----------------------------------------------------------------------
def embedding(w: Weights, name: str, ids: Tensor) -> Tensor:
    """The rows of table ``name`` ([vocab, hidden]) for ``ids``: [*ids.shape, hidden]. A
    packed table dequantises only the rows it reads. Tensor-parallel (vocab-parallel): this
    rank holds rows [rank V, (rank + 1) V) of the table; an id outside them gives zeros and
    an all_reduce sums the ranks' rows."""
    g, table = w.g, w[name + ".weight"]
    if w.world > 1:
        v = table.shape[0]
        local = ids - w.rank * v
        mine = g.min(local >= 0, local < v)
        rows = g.gather(table, g.min(g.max(local, 0), v - 1))
        return w.all_reduce(rows * g.reshape(g.cast(mine, "f32"), tuple(ids.shape) + (1,)))
    if name + ".weight" in w.quant:
        return g.dequantize(table, scheme=w.quant[name + ".weight"][0], rows=ids)
    return g.gather(w.matrix(name + ".weight"), ids)


def norm(w: Weights, name: str, x: Tensor, *, eps: float, kind: str = "rms",
         residual: Tensor | None = None, return_residual: bool = False, gain: str = "weight"):
    """``kind`` "rms" or "layer" norm of x (+ ``residual``, added in the same kernel) with the
    gain ``name.weight`` (``name.<gain>``) and the shift ``name.bias`` when there is one; with
    ``return_residual`` also the sum x + residual (Graph.rms_norm / layer_norm)."""
    if kind not in ("rms", "layer"):
        raise ValueError(f"norm: kind must be 'rms' or 'layer', got {kind!r}")
    f = w.g.rms_norm if kind == "rms" else w.g.layer_norm
    return f(x, w[f"{name}.{gain}"], w.get(name + ".bias"), eps=eps, residual=residual,
             return_residual=return_residual)


def add_norm(w: Weights, name: str, branch: Tensor | None, stream: Tensor, *, eps: float,
             kind: str = "rms", separate: bool = False, gain: str = "weight"):
    """A pre-norm residual step: (norm(stream + branch), stream + branch) in one kernel;
    with no branch (the first layer's), (norm(stream), stream). ``separate``: the add as a
    node of its own (a decode step: it folds into the product computing ``branch`` as its
    residual, and the norm into the product reading it, passes/fusion.py). ``gain``: the
    gain param's suffix (norm's)."""
    if branch is None:
        return norm(w, name, stream, eps=eps, kind=kind, gain=gain), stream
    if separate:
        stream = w.g.add(branch, stream)
        return norm(w, name, stream, eps=eps, kind=kind, gain=gain), stream
    return norm(w, name, branch, eps=eps, kind=kind, residual=stream, return_residual=True,
                gain=gain)


def lm_head(w: Weights, name: str, x: Tensor) -> Tensor:
    """Logits x @ W^T of head ``name`` ([vocab, hidden]: its own or the tied token table);
    tensor-parallel, every rank's vocabulary shard all-gathered side by side."""
    logits = w.linear(x, name)
    return w.all_gather(logits, -1) if w.world > 1 else logits


# ---- a decoder's causal attention ------------------------------------------------------------
def rope_tables(head_dim: int, theta: float, n_pos: int):
    """cos, sin [n_pos, head_dim/2] computed like transformers' Llama rotary embedding, in f32
    (inverse frequencies, position * frequency and cos/sin all f32), so long positions match
    the reference's rounding rather than a more exact f64 angle."""
    exps = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv = (np.float32(1.0) / (np.float32(theta) ** exps)).astype(np.float32)
    ang = np.arange(n_pos, dtype=np.float32)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


@dataclass
class Positions:
    """Where a decoder graph's tokens sit (the rope tables and positions, the keys each query
    sees), shared by its layers' attention blocks; ``decoder_positions`` builds it."""
    kind: str                   # "forward", "train", "prefill" or "decode"
    batch: int
    seq: int
    cache_len: int | None       # the KV caches' rows (prefill, decode)
    window: int | None          # a sliding window: keys pos - window < j <= pos
    cos: Tensor
    sin: Tensor
    rows: Tensor | None = None      # forward, train, prefill: [b s, 1] each token's position
    tok_pos: Tensor | None = None   # prefill: [b, s] each token's position
    keys: Tensor | None = None      # prefill: bool [b, 1, 1, s], the keys past each row's pads
    pos: Tensor | None = None       # decode: i32 [1], the cache row of the new token
    rope_pos: Tensor | None = None  # decode: [b, 1], the new token's position (pos - pad)
    keep: Tensor | None = None      # decode: bool [b, 1, 1, cache_len], the live cache rows

    @property
    def cached(self) -> bool:
        return self.kind in ("prefill", "decode")


def decoder_positions(g: Graph, cfg, kind: str, batch: int, seq: int,
                      cache_len: int | None = None, *, rotary_dim: int | None = None) -> Positions:
    """The rope tables (cfg.head_dim, or ``rotary_dim`` for a partial rotary embedding that
    turns only a head's first dims; cfg.rope_theta) and positions of a ``kind`` graph over
    [batch, seq] tokens, with its inputs: a prefill's ``pad`` (i32 [batch, 1], each row's
    left pads: row r's column t sits at position t - pad[r], its pad columns masked out as
    keys), a decode step's ``pos`` (i32 [1]) and the param of its rows' pads (``pad_name``;
    rows pad..pos live, and only the last cfg.sliding_window of them with a window)."""
    b, s, win = batch, seq, cfg.sliding_window
    cached = kind in ("prefill", "decode")
    cos_np, sin_np = rope_tables(rotary_dim or cfg.head_dim, cfg.rope_theta,
                                 cache_len if cached else s)
    at = Positions(kind, b, s, cache_len if cached else None, win,
                   g.constant(cos_np), g.constant(sin_np))
    if kind == "decode":
        at.pos = g.input("pos", (1,), "i32")
        pad = g.param(pad_name(cache_len), (b, 1), "i32")
        col = g.constant(np.arange(cache_len, dtype=np.int32))
        live = g.min(col >= pad, col <= at.pos)        # bool min: and
        if win is not None:
            live = g.min(live, col > at.pos - win)
        at.keep = g.reshape(live, (b, 1, 1, cache_len))
        at.rope_pos = at.pos - pad                                       # [b, 1]
    elif kind == "prefill":
        pad = g.input("pad", (b, 1), "i32")
        col = g.constant(np.arange(s, dtype=np.int32))
        at.tok_pos = g.max(col - pad, 0)                                 # [b, s]
        at.rows = g.reshape(at.tok_pos, (b * s, 1))
        at.keys = g.reshape(col >= pad, (b, 1, 1, s))
    else:              # token t of row r sits at position t (no transposes)
        at.rows = g.constant(np.tile(np.arange(s, dtype=np.int32), b).reshape(b * s, 1))
    return at


def pad_name(cache_len: int) -> str:
    """The decode graph's param of its rows' left pads (KV-cache state like the caches, so
    named by the cache length: decode graphs of other cache lengths keep their own)."""
    return f"pad.cache{cache_len}"


def decoder_attention(w: Weights, cfg, prefix: str, x: Tensor, at: Positions, *, fused: bool,
                      cache: tuple | None = None):
    """A decoder layer's attention over x [b, s, hidden] -> (o_proj's output [b, s, hidden],
    the caches a prefill wrote). ``cfg``: a LlamaConfig (heads, KV heads, head_dim, qk_norm,
    clip_qkv, rms_norm_eps). The ``prefix`` q/k/v projections (qkv_projection), rope at
    ``at``'s positions, grouped-query attention (causal, ``at``'s window and masks), o_proj
    (row-parallel).

    Prefill and decode graphs (``cache``: the layer's K and V cache param names, declared
    here, [b, kv heads, cache_len, head_dim]) write the rotated keys and values into the
    caches: a prefill at rows 0..s-1, a decode step at row ``at.pos``, which then attends to
    every live row. With ``fused`` rope of q and k and the cache write are one kernel
    (Graph.rope_kv_write), else rope and kv_write steps (same values)."""
    if (cache is not None) != at.cached:
        raise ValueError(f"decoder_attention: a prefill or decode graph's layer takes its cache "
                         f"names, a {at.kind} graph's none; got cache={cache!r}")
    g, b, s, win = w.g, at.batch, at.seq, at.window
    d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    packed = fused and at.cached       # rope_kv_write takes the packed q/k/v
    qkv = qkv_projection(w, cfg, prefix, x, fused=fused, packed=packed)
    if not packed:
        q, k, v = qkv
    written = []
    if at.cached:
        kc, vc = (g.param(name, (b, hkv, at.cache_len, d)) for name in cache)
    if packed:                         # rope of q and k and the cache write: one kernel
        row = at.pos if at.kind == "decode" else 0       # the cache row of the first token
        qh, k_all, v_all = g.rope_kv_write(
            qkv, at.cos, at.sin, kc, vc, row, num_heads=hq, num_kv_heads=hkv,
            positions=at.rope_pos if at.kind == "decode" else at.tok_pos)
        if at.kind == "decode":
            a = g.reshape(g.attention(qh, k_all, v_all, mask=at.keep), (b, 1, hq * d))
        else:          # the prompt's keys/values: the caches' first s rows
            kp, vp = (g.narrow(t, 2, 0, s) for t in (k_all, v_all))
            a = g.attention(qh, kp, vp, causal=True, window=win, mask=at.keys)  # [b, hq, s, d]
            a = g.reshape(g.transpose(a, (0, 2, 1, 3)), (b, s, hq * d))
            written += [k_all, v_all]
    elif at.kind == "decode":
        qh = g.rope(g.reshape(q, (b, hq, 1, d)), at.cos, at.sin, positions=at.rope_pos)
        kh = g.rope(g.reshape(k, (b, hkv, 1, d)), at.cos, at.sin, positions=at.rope_pos)
        k_all = g.kv_write(kc, kh, at.pos)
        v_all = g.kv_write(vc, g.reshape(v, (b, hkv, 1, d)), at.pos)
        a = g.reshape(g.attention(qh, k_all, v_all, mask=at.keep), (b, 1, hq * d))
    else:              # rope over [b s, heads, 1, d], attention over [b, s, heads d]
        qh = g.rope(g.reshape(q, (b * s, hq, 1, d)), at.cos, at.sin, positions=at.rows)
        kh = g.rope(g.reshape(k, (b * s, hkv, 1, d)), at.cos, at.sin, positions=at.rows)
        a = g.attention(g.reshape(qh, (b, s, hq * d)), g.reshape(kh, (b, s, hkv * d)), v,
                        causal=True, window=win, mask=at.keys, num_heads=hq)
        if at.cached:                  # a prefill's cache as [b, kv heads, rows, d]
            for c, t in ((kc, kh), (vc, v)):
                heads = g.transpose(g.reshape(t, (b, s, hkv, d)), (0, 2, 1, 3))
                written.append(g.kv_write(c, heads, 0))
    return w.linear(a, prefix + "o_proj", row_parallel=True), written


def qkv_projection(w: Weights, cfg, prefix: str, x: Tensor, *, fused: bool,
                   packed: bool = False):
    """The q, k and v of x [b, s, hidden] ([b, s, heads head_dim] each; ``cfg`` as
    decoder_attention's): the ``prefix`` q_proj, k_proj and v_proj products, or with ``fused``
    the slices of one qkv_proj product; OLMoE's RMSNorm over all of q's / k's heads (q_norm,
    k_norm) and clamp to [-clip_qkv, clip_qkv]. ``packed``: instead one [b, s, (heads + 2 kv
    heads) head_dim] tensor, each token's q, k and v heads side by side (what
    Graph.rope_kv_write takes): a fused product as it is, unless the norm or clamp came
    between."""
    g, d = w.g, cfg.head_dim
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    prep = cfg.qk_norm or cfg.clip_qkv is not None
    if fused:
        qkv = w.linear(x, prefix + "qkv_proj")
        if packed and not prep:
            return qkv
        q, k, v = [g.narrow(qkv, 2, o * d, n * d)        # the slices (copies)
                   for o, n in ((0, hq), (hq, hkv), (hq + hkv, hkv))]
    else:
        q, k, v = (w.linear(x, prefix + f"{m}_proj") for m in ("q", "k", "v"))
    if cfg.qk_norm:
        q = norm(w, prefix + "q_norm", q, eps=cfg.rms_norm_eps)
        k = norm(w, prefix + "k_norm", k, eps=cfg.rms_norm_eps)
    if cfg.clip_qkv is not None:
        c = float(cfg.clip_qkv)
        q, k, v = (g.min(g.max(t, -c), c) for t in (q, k, v))
    return g.concat([q, k, v], 2) if packed else (q, k, v)


# ---- an encoder's attention ----------------------------------------------------------------------
def encoder_attention(w: Weights, x: Tensor, names: tuple, *, num_heads: int,
                      mask: Tensor | None = None) -> Tensor:
    """Bidirectional multi-head attention over x [b, s, hidden]: the projections ``names``
    (q, k, v, then the output's), every query seeing the keys ``mask`` keeps (all without
    one)."""
    q_name, k_name, v_name, o_name = names
    q, k, v = (w.linear(x, n) for n in (q_name, k_name, v_name))
    return w.linear(w.g.attention(q, k, v, mask=mask, num_heads=num_heads), o_name)


# ---- a recurrent mixer's causal conv -------------------------------------------------------------
def causal_conv1d(g: Graph, x: Tensor, weight: Tensor, bias: Tensor | None = None, *,
                  state: Tensor | None = None):
    """The causal depthwise conv1d of Mamba's and Qwen3-Next's gated-delta mixers (nn.Conv1d
    with groups = channels, left-padded by k - 1, no activation) over x [b, C, s], weight
    [C, 1, k], bias [C] -> (y [b, C, s], the last k - 1 inputs [b, C, k - 1]: the state a
    decode step goes on from). ``state``: a decode step's (s = 1) those of the tokens
    before; the conv is then a dot over the window."""
    b, c, s = x.shape
    k = weight.shape[-1]
    if state is not None:
        window = g.concat([state, x], 2)                                  # [b, C, k]
        y = g.reduce_sum(window * g.reshape(weight, (c, k)), 2)
        if bias is not None:
            y = y + bias
        return g.reshape(y, (b, c, 1)), g.narrow(window, 2, 1, k - 1)
    xp = g.pad(x, (k - 1, 0))
    return g.conv(xp, weight, bias, groups=c), g.narrow(xp, 2, s, k - 1)


# ---- MLPs ------------------------------------------------------------------------------------
def mlp(w: Weights, x: Tensor, up: str, down: str, *, activation: str) -> Tensor:
    """down(activation(up(x))): BERT's intermediate / output, a ViT's MLP."""
    return w.linear(w.linear(x, up, activation=activation), down)


def gated_mlp(w: Weights, prefix: str, x: Tensor, *, fused: bool) -> Tensor:
    """SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x)), down_proj row-parallel. With
    ``fused`` gate and up are one product over ``prefix`` gate_up_proj (their rows
    interleaved, gate's first) whose halves Graph.gated pairs: at decode (<= 16 rows) in
    the skinny product's epilogue (passes/fusion.py), else one kernel."""
    if fused:
        act = w.g.gated(w.linear(x, prefix + "gate_up_proj"), "silu", interleaved=True)
    else:
        act = w.g.silu(w.linear(x, prefix + "gate_proj")) * w.linear(x, prefix + "up_proj")
    return w.linear(act, prefix + "down_proj", row_parallel=True)


def moe_mlp(w: Weights, cfg, prefix: str, x: Tensor, *, fused: bool) -> Tensor:
    """The sparse MLP of the MoE decoders (models/moe.py; transformers' Mixtral / Qwen2-MoE /
    OLMoE) over x's tokens: softmax over the router's (``prefix`` gate) logits, the top
    cfg.num_experts_per_tok (renormalised with cfg.norm_topk_prob), each token's row
    repeated k times beside its k expert ids, the experts' SwiGLU as two grouped products
    over the fused [E, out, in] weights (experts.gate_up_proj: gate's rows, then up's;
    experts.down_proj), the k outputs summed with their routing weights; plus Qwen2-MoE's
    shared expert (a gated_mlp) times sigmoid(shared_expert_gate)."""
    g, k = w.g, cfg.num_experts_per_tok
    h = x.shape[-1]
    t = int(np.prod(x.shape[:-1]))
    xt = g.reshape(x, (t, h))
    top, ids = g.topk(g.softmax(w.linear(xt, prefix + "gate"), axis=-1), k)      # [t, k]
    if cfg.norm_topk_prob:
        top = top / g.sum(top, -1, keep_dim=True)
    ids = g.reshape(ids, (t * k,))
    rows = g.reshape(g.expand(g.reshape(xt, (t, 1, h)), (t, k, h)), (t * k, h))
    gate_up = g.grouped_matmul(rows, w[prefix + "experts.gate_up_proj"], ids, trans_w=True)
    y = g.grouped_matmul(g.gated(gate_up, "silu"), w[prefix + "experts.down_proj"], ids,
                         trans_w=True)                                          # [t k, h]
    y = g.sum(g.reshape(y, (t, k, h)) * g.reshape(top, (t, k, 1)), 1)          # [t, h]
    if cfg.shared_expert_intermediate_size:
        y = y + g.sigmoid(w.linear(xt, prefix + "shared_expert_gate")) * gated_mlp(
            w, prefix + "shared_expert.", xt, fused=fused)
    return g.reshape(y, tuple(x.shape))
