"""Qwen3-Next (transformers' Qwen3NextForCausalLM) on the public graph API: a hybrid decoder
whose layers mix, as the config's ``layer_types`` say, gated-delta linear attention
("linear_attention") and gated softmax attention ("full_attention"), each followed by a
sparse MoE block (routed experts plus a sigmoid-gated shared expert) or a dense SwiGLU MLP.

The blocks, as transformers builds them:
- RMSNorms are zero-centred: the gain is 1 + weight (the decoder's two norms, the final norm,
  q_norm and k_norm);
- full attention: q_proj yields per head the query and an output gate side by side ([heads,
  2 head_dim]), q_norm / k_norm (RMSNorm over head_dim), rope over the first head_dim *
  partial_rotary_factor dims (half split), grouped-query causal attention, the output times
  sigmoid(gate), o_proj;
- gated DeltaNet: in_proj_qkvz / in_proj_ba laid out per key head ([q, k, v of the value
  heads of that group, z of them] and [b, a]), a causal depthwise conv1d with SiLU over
  q, k, v (no bias), beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias), q and k
  repeated over the value heads of their group, the gated delta rule with q/k l2 norm
  (Graph.gated_delta_net), an RMSNorm per value head (gain ``norm.weight``, not
  zero-centred) times silu(z), out_proj;
- MoE: softmax router, top-k (renormalised with norm_topk_prob), the experts' SwiGLU, plus
  the shared expert times sigmoid(shared_expert_gate) (blocks.moe_mlp).

``params`` keep transformers' names and layouts (transformers 5's fused expert tensors; a
checkpoint's per-expert tensors are stacked on load). The graphs read a few of them
rearranged on the host (``graph_params``): the zero-centred gains as 1 + weight
(``<norm>.gain``), q_proj's query rows, k_proj, v_proj and q_proj's gate rows as one
``qkvg_proj``, in_proj_qkvz and in_proj_ba regrouped as one ``in_proj`` ([q of every key
head; k; v of every value head; z; b; a]), -exp(A_log) as ``A``, and gate/up interleaved as
one ``gate_up_proj`` (blocks.gated_mlp's fused form) -- one product where transformers runs
two to four.

Generation: the prefill graph runs the prompt, writes the attention layers' KV caches
(params shared with the decode graph of its batch and cache length, as LlamaForCausalLM's)
and outputs each gated-delta layer's conv state (the conv's last conv_kernel - 1 inputs)
and recurrent state (the delta rule's last state, [batch, value heads, key dim, value
dim]); a decode step takes one token, its cache row ``pos`` and those states, and returns
the next ones (the conv as a dot over the window, the delta rule from its initial state
over one token), as models/mamba.py carries its states.
"""
from __future__ import annotations

from dataclasses import InitVar, asdict, dataclass, field, fields

import numpy as np

from ..compiler import compile
from ..ir.graph import Graph
from .blocks import (Weights, add_norm, causal_conv1d, decoder_positions, embedding, gated_mlp,
                     lm_head, moe_mlp, pad_name)
from .executables import ExecutableCache, in_dtype, model_dtype, next_pow2
from .moe import fuse_experts
from .weights import as_path, check_params, load_safetensors, read_json

LAYER_TYPES = ("linear_attention", "full_attention")


# ---- config ------------------------------------------------------------------------------------
@dataclass
class Qwen3NextConfig:
    """transformers' Qwen3NextConfig (its defaults: Qwen3-Next-80B-A3B's shapes)."""
    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 48
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    max_position_embeddings: int = 32768
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    num_experts: int = 512                       # 0: every MLP dense
    num_experts_per_tok: int = 10
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512  # 0: no shared expert
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list = field(default_factory=list)
    layer_types: list | None = None             # None: every full_attention_interval-th full
    full_attention_interval: InitVar[int] = 4   # (only read to make layer_types)
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None

    sliding_window = None                       # (no sliding window: blocks.decoder_positions)

    def __post_init__(self, full_attention_interval):
        if self.layer_types is None:
            k = full_attention_interval
            if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 1:
                raise ValueError(f"Qwen3NextConfig: full_attention_interval must be an int >= 1, "
                                 f"got {k!r}")
            self.layer_types = ["full_attention" if (n + 1) % k == 0 else "linear_attention"
                                for n in range(self.num_hidden_layers)]
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim",
                  "max_position_embeddings", "linear_conv_kernel_dim", "linear_key_head_dim",
                  "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
                  "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            self._int(f, 1)
        for f in ("num_experts", "shared_expert_intermediate_size"):
            self._int(f, 0)
        lt = self.layer_types
        if not isinstance(lt, (list, tuple)) or len(lt) != self.num_hidden_layers:
            raise ValueError(f"Qwen3NextConfig: layer_types must list one type per layer "
                             f"({self.num_hidden_layers}), got {lt!r}")
        bad = [t for t in lt if t not in LAYER_TYPES]
        if bad:
            raise ValueError(f"Qwen3NextConfig: layer_types holds {bad[0]!r}; each must be "
                             f"one of {', '.join(LAYER_TYPES)}")
        self.layer_types = list(lt)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"Qwen3NextConfig: num_attention_heads {self.num_attention_heads} "
                             f"must be a multiple of num_key_value_heads "
                             f"{self.num_key_value_heads}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"Qwen3NextConfig: linear_num_value_heads "
                             f"{self.linear_num_value_heads} must be a multiple of "
                             f"linear_num_key_heads {self.linear_num_key_heads}")
        if not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(f"Qwen3NextConfig: partial_rotary_factor must be in (0, 1], got "
                             f"{self.partial_rotary_factor!r}")
        rot = self.rotary_dim
        if rot < 2 or rot % 2:
            raise ValueError(f"Qwen3NextConfig: the rotary dims (head_dim {self.head_dim} x "
                             f"partial_rotary_factor {self.partial_rotary_factor} = {rot}) must "
                             f"be even and >= 2 (rope turns pairs)")
        if not self.rope_theta > 0 or not self.rms_norm_eps >= 0:
            raise ValueError(f"Qwen3NextConfig: rope_theta must be > 0 and rms_norm_eps >= 0, "
                             f"got {self.rope_theta!r}, {self.rms_norm_eps!r}")
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"Qwen3NextConfig: num_experts_per_tok {self.num_experts_per_tok} "
                             f"exceeds num_experts {self.num_experts}")
        bad = [n for n in self.mlp_only_layers
               if not isinstance(n, (int, np.integer)) or not 0 <= n < self.num_hidden_layers]
        if bad:
            raise ValueError(f"Qwen3NextConfig: mlp_only_layers must hold layer indices in [0, "
                             f"{self.num_hidden_layers}), got {bad[0]!r}")
        self.mlp_only_layers = sorted({int(n) for n in self.mlp_only_layers})

    def _int(self, f, lo):
        v = getattr(self, f)
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < lo:
            raise ValueError(f"Qwen3NextConfig: {f} must be an int >= {lo}, got {v!r}")
        setattr(self, f, int(v))

    @property
    def rotary_dim(self) -> int:
        """The dims rope turns at the start of each head (transformers' int(head_dim *
        partial_rotary_factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    def sparse_layer(self, n: int) -> bool:
        """Whether layer n's MLP is the MoE block (transformers' rule)."""
        return (self.num_experts > 0 and n not in self.mlp_only_layers
                and (n + 1) % self.decoder_sparse_step == 0)

    def linear(self, n: int) -> bool:
        """Whether layer n is a gated-delta (linear attention) layer."""
        return self.layer_types[n] == "linear_attention"

    @classmethod
    def from_dict(cls, d: dict, source="config") -> "Qwen3NextConfig":
        """From a transformers config.json / to_dict() of model_type 'qwen3_next' (4.x's
        top-level rope_theta / partial_rotary_factor or 5's rope_parameters; layer_types, or
        full_attention_interval)."""
        mt = d.get("model_type", "qwen3_next")
        if mt != "qwen3_next":
            raise ValueError(f"{source}: model_type is {mt!r}; Qwen3NextConfig reads "
                             f"'qwen3_next' configs")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{source}: hidden_act {act!r} is not supported (Qwen3-Next uses "
                             f"silu)")
        rope = dict(d.get("rope_scaling") or {}, **(d.get("rope_parameters") or {}))
        rtype = rope.get("rope_type", rope.get("type", "default"))
        if rtype not in (None, "default"):
            raise ValueError(f"{source}: rope scaling {rtype!r} is not supported (only the "
                             f"default rope)")
        kw = {f.name: d[f.name] for f in fields(cls) if d.get(f.name) is not None}
        if d.get("full_attention_interval") is not None:
            kw["full_attention_interval"] = d["full_attention_interval"]
        for k in ("rope_theta", "partial_rotary_factor"):
            if rope.get(k) is not None:
                kw[k] = rope[k]
        try:
            return cls(**kw)
        except TypeError as e:
            raise ValueError(f"{source}: {e}") from None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["model_type"] = "qwen3_next"
        return d


# ---- params -----------------------------------------------------------------------------------
def qwen3_next_param_shapes(cfg: Qwen3NextConfig) -> dict[str, tuple]:
    """Every parameter by its transformers name, with its shape (transformers 5's fused
    expert tensors)."""
    h, d = cfg.hidden_size, cfg.head_dim
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    kd, vd = nk * cfg.linear_key_head_dim, nv * cfg.linear_value_head_dim
    out = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        out[p + "input_layernorm.weight"] = (h,)
        if cfg.linear(n):
            a = p + "linear_attn."
            out.update({a + "in_proj_qkvz.weight": (2 * kd + 2 * vd, h),
                        a + "in_proj_ba.weight": (2 * nv, h),
                        a + "conv1d.weight": (2 * kd + vd, 1, cfg.linear_conv_kernel_dim),
                        a + "dt_bias": (nv,), a + "A_log": (nv,),
                        a + "norm.weight": (cfg.linear_value_head_dim,),
                        a + "out_proj.weight": (h, vd)})
        else:
            a = p + "self_attn."
            for name, rows in (("q_proj", 2 * hq * d), ("k_proj", hkv * d), ("v_proj", hkv * d)):
                out[a + name + ".weight"] = (rows, h)
                if cfg.attention_bias:
                    out[a + name + ".bias"] = (rows,)
            out[a + "o_proj.weight"] = (h, hq * d)
            if cfg.attention_bias:
                out[a + "o_proj.bias"] = (h,)
            out[a + "q_norm.weight"] = (d,)
            out[a + "k_norm.weight"] = (d,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        if cfg.sparse_layer(n):
            e, mi = cfg.num_experts, cfg.moe_intermediate_size
            si = cfg.shared_expert_intermediate_size
            out[p + "mlp.gate.weight"] = (e, h)
            out[p + "mlp.experts.gate_up_proj"] = (e, 2 * mi, h)
            out[p + "mlp.experts.down_proj"] = (e, h, mi)
            if si:
                out.update({p + "mlp.shared_expert.gate_proj.weight": (si, h),
                            p + "mlp.shared_expert.up_proj.weight": (si, h),
                            p + "mlp.shared_expert.down_proj.weight": (h, si),
                            p + "mlp.shared_expert_gate.weight": (1, h)})
        else:
            i = cfg.intermediate_size
            out.update({p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                        p + "mlp.down_proj.weight": (h, i)})
    out["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    return out


def _is_centred_norm(name: str) -> bool:
    """A zero-centred RMSNorm's weight (gain 1 + weight); linear_attn.norm is not one."""
    return name == "model.norm.weight" or name.endswith(
        ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
         "self_attn.k_norm.weight"))


def graph_param_shapes(cfg: Qwen3NextConfig) -> dict[str, tuple]:
    """The params of ``build_qwen3_next`` (module docstring: graph_params' names)."""
    hf = qwen3_next_param_shapes(cfg)
    h, d = cfg.hidden_size, cfg.head_dim
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    kd, vd = nk * cfg.linear_key_head_dim, nv * cfg.linear_value_head_dim
    out = {}
    for name, shape in hf.items():
        if _is_centred_norm(name):
            out[name[:-len("weight")] + "gain"] = shape
        elif name.endswith("self_attn.q_proj.weight"):
            out[name.replace("q_proj", "qkvg_proj")] = (2 * (hq + hkv) * d, h)
        elif name.endswith("self_attn.q_proj.bias"):
            out[name.replace("q_proj", "qkvg_proj")] = (2 * (hq + hkv) * d,)
        elif name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight",
                            "self_attn.k_proj.bias", "self_attn.v_proj.bias",
                            "linear_attn.in_proj_ba.weight", "mlp.up_proj.weight",
                            "shared_expert.up_proj.weight")):
            continue                        # part of a pack
        elif name.endswith("linear_attn.in_proj_qkvz.weight"):
            out[name.replace("in_proj_qkvz", "in_proj")] = (2 * kd + 2 * vd + 2 * nv, h)
        elif name.endswith("linear_attn.A_log"):
            out[name[:-len("A_log")] + "A"] = shape
        elif name.endswith(("mlp.gate_proj.weight", "shared_expert.gate_proj.weight")):
            out[name.replace("gate_proj", "gate_up_proj")] = (2 * shape[0], shape[1])
        else:
            out[name] = shape
    return out


def graph_params(cfg: Qwen3NextConfig, params: dict) -> dict:
    """The graph's params (``graph_param_shapes``) from transformers-named ``params`` (as
    Qwen3NextForCausalLM.params holds them): module docstring."""
    d, hq = cfg.head_dim, cfg.num_attention_heads
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = nv // nk
    plain = graph_param_shapes(cfg)        # names the graph reads as they are
    out = {}
    for name, v in params.items():
        v = np.asarray(v, np.float32)
        if _is_centred_norm(name):
            out[name[:-len("weight")] + "gain"] = 1 + v
        elif name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            # per head [query, gate] -> every head's query rows, k, v, every head's gate rows
            qg = v.reshape((hq, 2 * d) + v.shape[1:])
            kv = [params[name.replace("q_proj", m)] for m in ("k_proj", "v_proj")]
            out[name.replace("q_proj", "qkvg_proj")] = np.concatenate(
                [qg[:, :d].reshape((hq * d,) + v.shape[1:])] + [np.asarray(t, np.float32)
                                                                for t in kv]
                + [qg[:, d:].reshape((hq * d,) + v.shape[1:])], axis=0)
        elif name.endswith("linear_attn.in_proj_qkvz.weight"):
            # per key head [q, k, v of its r value heads, z of them] -> q | k | v | z, then
            # in_proj_ba's per key head [b of its r value heads, a of them] -> b | a
            h = v.shape[1]
            grp = v.reshape(nk, 2 * dk + 2 * r * dv, h)
            ba = np.asarray(params[name.replace("in_proj_qkvz", "in_proj_ba")],
                            np.float32).reshape(nk, 2 * r, h)
            cuts = (0, dk, 2 * dk, 2 * dk + r * dv, 2 * dk + 2 * r * dv)
            parts = [grp[:, a:b].reshape(-1, h) for a, b in zip(cuts, cuts[1:])]
            parts += [ba[:, :r].reshape(-1, h), ba[:, r:].reshape(-1, h)]
            out[name.replace("in_proj_qkvz", "in_proj")] = np.concatenate(parts, axis=0)
        elif name.endswith("linear_attn.A_log"):
            out[name[:-len("A_log")] + "A"] = -np.exp(v)
        elif name.endswith(("mlp.gate_proj.weight", "shared_expert.gate_proj.weight")):
            up = np.asarray(params[name.replace("gate_proj", "up_proj")], np.float32)
            out[name.replace("gate_proj", "gate_up_proj")] = np.stack(
                [v, up], axis=1).reshape(-1, v.shape[1])      # rows gate 0, up 0, gate 1, ...
        elif name in plain:
            out[name] = v
    return out


# ---- the graph ---------------------------------------------------------------------------------
def state_names(cfg: Qwen3NextConfig) -> list[str]:
    """The recurrent states a decode graph takes and returns, in order: per gated-delta layer
    n, ``conv.n`` [batch, conv channels, conv_kernel - 1] and ``delta.n`` [batch, value heads,
    key head dim, value head dim]."""
    return [f"{kind}.{n}" for n in range(cfg.num_hidden_layers) if cfg.linear(n)
            for kind in ("conv", "delta")]


def state_shapes(cfg: Qwen3NextConfig, batch: int) -> dict[str, tuple]:
    nv = cfg.linear_num_value_heads
    ch = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + nv * cfg.linear_value_head_dim
    out = {}
    for name in state_names(cfg):
        out[name] = ((batch, ch, cfg.linear_conv_kernel_dim - 1) if name.startswith("conv") else
                     (batch, nv, cfg.linear_key_head_dim, cfg.linear_value_head_dim))
    return out


def cache_names(cfg: Qwen3NextConfig) -> list[str]:
    return [f"cache.{n}.{kv}" for n in range(cfg.num_hidden_layers) if not cfg.linear(n)
            for kv in ("k", "v")]


def build_qwen3_next(cfg: Qwen3NextConfig, batch: int, seq: int, *, kind: str = "forward",
                     cache_len: int | None = None) -> Graph:
    """A Qwen3-Next graph over ``input_ids`` (i32 [batch, seq]), params ``graph_param_shapes``.

    kind "forward": the logits [batch, seq, vocab]. kind "prefill": also takes ``pad`` (i32
    [batch, 1], each row's left pads: row r's column t sits at position t - pad[r]; its pad
    columns are masked out as keys and zeroed before the gated-delta layers, whose states
    they then leave at zero, as transformers does); writes the attention layers' rotated keys
    and values into the caches (params ``cache.n.k`` / ``cache.n.v``, [batch, kv heads,
    cache_len, head_dim]) at rows 0..seq-1; outputs the greedy next ids (i64 [batch]), the
    last position's logits [batch, vocab], the states (``state_names``), then the caches.
    kind "decode" (seq 1): takes ``pos`` (i32 [1], the cache row of this token) and the
    states as inputs of those names (the rows' pads: the param ``pad_name(cache_len)``);
    outputs the next ids, the logits and the next states."""
    if kind not in ("forward", "prefill", "decode"):
        raise ValueError(f"build_qwen3_next: kind must be 'forward', 'prefill' or 'decode', got "
                         f"{kind!r}")
    for arg, v in (("batch", batch), ("seq", seq)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
            raise ValueError(f"build_qwen3_next: {arg} must be a positive int, got {v!r}")
    if kind == "decode" and seq != 1:
        raise ValueError(f"build_qwen3_next: a decode graph takes one token a row (seq 1), got "
                         f"{seq}")
    cached = kind != "forward"
    if cached and (not isinstance(cache_len, (int, np.integer)) or not seq <= cache_len):
        raise ValueError(f"build_qwen3_next: {kind} needs cache_len >= seq ({seq}), got "
                         f"{cache_len!r}")
    n_pos = cache_len if cached else seq
    if n_pos > cfg.max_position_embeddings:
        raise ValueError(f"build_qwen3_next: {n_pos} positions exceed max_position_embeddings "
                         f"{cfg.max_position_embeddings}")
    b, s = int(batch), int(seq)
    g = Graph(f"qwen3_next_{kind}_{b}x{s}" + (f"_cache{cache_len}" if cached else ""))
    w = Weights.declare(g, graph_param_shapes(cfg))
    ids = g.input("input_ids", (b, s), "i32")
    at = decoder_positions(g, cfg, kind, b, s, cache_len, rotary_dim=cfg.rotary_dim)
    stream, branch = embedding(w, "model.embed_tokens", ids), None
    eps, decode = cfg.rms_norm_eps, kind == "decode"
    states, caches = [], []
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        x, stream = add_norm(w, p + "input_layernorm", branch, stream, eps=eps, separate=decode,
                             gain="gain")
        if cfg.linear(n):
            a, st = gated_delta_block(w, cfg, p + "linear_attn.", x, at,
                                      state=(f"conv.{n}", f"delta.{n}") if decode else None)
            states += st
        else:
            a, written = gated_attention_block(
                w, cfg, p + "self_attn.", x, at,
                cache=(f"cache.{n}.k", f"cache.{n}.v") if cached else None)
            caches += written
        x, stream = add_norm(w, p + "post_attention_layernorm", a, stream, eps=eps,
                             separate=decode, gain="gain")
        branch = (moe_mlp(w, cfg, p + "mlp.", x, fused=True) if cfg.sparse_layer(n)
                  else gated_mlp(w, p + "mlp.", x, fused=True))
    if kind == "prefill" and s > 1:          # only the last position's logits are needed
        branch, stream = g.narrow(branch, 1, s - 1, 1), g.narrow(stream, 1, s - 1, 1)
    final = add_norm(w, "model.norm", branch, stream, eps=eps, separate=decode, gain="gain")[0]
    logits = lm_head(w, "lm_head" if "lm_head.weight" in w else "model.embed_tokens", final)
    if kind == "forward":
        g.set_outputs([logits])
    else:
        logits = g.reshape(logits, (b, cfg.vocab_size))
        # the prefill's caches are outputs so that their writes stay in the graph
        g.set_outputs([g.argmax(logits, 1), logits] + states + caches)
    return g


def gated_attention_block(w: Weights, cfg: Qwen3NextConfig, p: str, x, at, *,
                          cache: tuple | None = None):
    """Qwen3-Next's full attention ``p`` over x [b, s, hidden] (module docstring) -> (o_proj's
    output, the caches a prefill wrote). ``cache``: the K and V cache param names of a
    prefill or decode graph (blocks.decoder_attention's convention)."""
    g, b, s = w.g, at.batch, at.seq
    d, hq, hkv, rot = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.rotary_dim
    qkvg = w.linear(x, p + "qkvg_proj")                       # [b, s, (2 hq + 2 hkv) d]
    q, k, v, gate = (g.narrow(qkvg, 2, o * d, m * d) for o, m in
                     ((0, hq), (hq, hkv), (hq + hkv, hkv), (hq + 2 * hkv, hq)))
    q = g.rms_norm(g.reshape(q, (b, s, hq, d)), w[p + "q_norm.gain"], eps=cfg.rms_norm_eps)
    k = g.rms_norm(g.reshape(k, (b, s, hkv, d)), w[p + "k_norm.gain"], eps=cfg.rms_norm_eps)
    written = []
    if at.kind == "decode":
        kc, vc = (g.param(name, (b, hkv, at.cache_len, d)) for name in cache)
        qh = g.rope(g.reshape(q, (b, hq, 1, d)), at.cos, at.sin, n_rot=rot,
                    positions=at.rope_pos)
        kh = g.rope(g.reshape(k, (b, hkv, 1, d)), at.cos, at.sin, n_rot=rot,
                    positions=at.rope_pos)
        k_all = g.kv_write(kc, kh, at.pos)
        v_all = g.kv_write(vc, g.reshape(v, (b, hkv, 1, d)), at.pos)
        a = g.reshape(g.attention(qh, k_all, v_all, mask=at.keep), (b, 1, hq * d))
    else:              # rope over [b s, heads, 1, d], attention over [b, s, heads d]
        qh = g.rope(g.reshape(q, (b * s, hq, 1, d)), at.cos, at.sin, n_rot=rot,
                    positions=at.rows)
        kh = g.rope(g.reshape(k, (b * s, hkv, 1, d)), at.cos, at.sin, n_rot=rot,
                    positions=at.rows)
        a = g.attention(g.reshape(qh, (b, s, hq * d)), g.reshape(kh, (b, s, hkv * d)), v,
                        causal=True, mask=at.keys, num_heads=hq)
        if cache is not None:          # a prefill's cache as [b, kv heads, rows, d]
            for name, t in zip(cache, (kh, v)):
                c = g.param(name, (b, hkv, at.cache_len, d))
                written.append(g.kv_write(c, g.transpose(g.reshape(t, (b, s, hkv, d)),
                                                         (0, 2, 1, 3)), 0))
    return w.linear(a * g.sigmoid(gate), p + "o_proj"), written


def gated_delta_block(w: Weights, cfg: Qwen3NextConfig, p: str, x, at, *,
                      state: tuple | None = None):
    """Qwen3-Next's gated DeltaNet ``p`` over x [b, s, hidden] (module docstring) -> (its
    output [b, s, hidden], [conv state, recurrent state] after the last token). ``state``: a
    decode step's (seq 1) input names of those states, which it goes on from."""
    g = w.g
    b, s, _ = x.shape
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, kw = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    kd, vd, r = nk * dk, nv * dv, nv // nk
    ch = 2 * kd + vd
    if at.keys is not None:            # a prefill's pad columns: zeros (no state change)
        x = g.where(g.reshape(at.keys, (b, s, 1)), x, 0.0)
    proj = w.linear(x, p + "in_proj")                         # [b, s, ch + vd + 2 nv]
    mixed = g.narrow(proj, 2, 0, ch)
    z = g.reshape(g.narrow(proj, 2, ch, vd), (b, s, nv, dv))
    beta = g.sigmoid(g.narrow(proj, 2, ch + vd, nv))
    decay = w[p + "A"] * g.softplus(g.narrow(proj, 2, ch + vd + nv, nv) + w[p + "dt_bias"])
    if state is not None:              # one token: [b, 1, ch] is [b, ch, 1]
        conv, conv_state = causal_conv1d(g, g.reshape(mixed, (b, ch, 1)), w[p + "conv1d.weight"],
                                         state=g.input(state[0], (b, ch, kw - 1)))
        conv = g.reshape(g.silu(conv), (b, 1, ch))
        s0 = g.input(state[1], (b, nv, dk, dv))
    else:
        conv, conv_state = causal_conv1d(g, g.transpose(mixed, (0, 2, 1)),
                                         w[p + "conv1d.weight"])
        conv = g.transpose(g.silu(conv), (0, 2, 1))                   # [b, s, ch]
    q = g.reshape(g.narrow(conv, 2, 0, kd), (b, s, nk, dk))
    k = g.reshape(g.narrow(conv, 2, kd, kd), (b, s, nk, dk))
    v = g.reshape(g.narrow(conv, 2, 2 * kd, vd), (b, s, nv, dv))
    if r > 1:                          # key head j serves value heads j r .. j r + r - 1
        q, k = (g.reshape(g.expand(g.reshape(t, (b, s, nk, 1, dk)), (b, s, nk, r, dk)),
                          (b, s, nv, dk)) for t in (q, k))
    if state is not None:              # a decode step: the recurrence itself, no chunk machinery
        o, last = g.gated_delta_step(q, k, v, decay, beta, s0, use_qk_l2norm=True)
    else:
        o, last = g.gated_delta_net(q, k, v, decay, beta, use_qk_l2norm=True)
    o = g.rms_norm(o, w[p + "norm.weight"], eps=cfg.rms_norm_eps) * g.silu(z)
    return w.linear(g.reshape(o, (b, s, vd)), p + "out_proj"), [conv_state, last]


# ---- the model ---------------------------------------------------------------------------------
class Qwen3NextForCausalLM:
    """transformers' Qwen3NextForCausalLM, inference: ``model(ids)`` -> logits and greedy
    ``generate`` (prefill, then one decode graph per token over the KV caches and the
    gated-delta states).

    ``params``: name -> array in transformers' names and layouts (``qwen3_next_param_shapes``),
    kept on the host as f32. ``dtype``: "f32", "bf16" or "f16" (the graphs run in it,
    executables.in_dtype). ``exec_mode``: the decode graph's ("stream", or "graph": one CUDA
    graph replayed per token; the simulator runs it as a stream); the others run "stream".
    Compiled graphs are kept per shape (the ``max_cached`` most recent); they share one
    device copy of the weights and one stream."""

    def __init__(self, config: Qwen3NextConfig, params: dict, *, dtype="f32",
                 exec_mode="stream", max_cached: int = 4, source="params"):
        if not isinstance(config, Qwen3NextConfig):
            raise ValueError(f"Qwen3NextForCausalLM: config must be a Qwen3NextConfig, got "
                             f"{type(config).__name__}")
        if exec_mode not in ("stream", "graph"):
            raise ValueError(f"Qwen3NextForCausalLM: exec_mode must be 'stream' or 'graph', got "
                             f"{exec_mode!r}")
        self.dtype = model_dtype("Qwen3NextForCausalLM", dtype)
        self.config = config
        ignore = ("lm_head.weight",) if config.tie_word_embeddings else ()
        self.params = check_params(qwen3_next_param_shapes(config), params, source,
                                   ignore=ignore)
        self.exec_mode, self.max_cached = exec_mode, max_cached
        self._exes = ExecutableCache("qwen3_next")

    @classmethod
    def from_config(cls, config, seed: int = 0, std: float = 0.02, **kw):
        """Random weights from ``seed``: projections, experts, router and embeddings N(0, std);
        the zero-centred norms' weights N(0, 0.1) (gains 1 + that); linear_attn.norm 1 +
        N(0, 0.1); A_log = log U(1, 16) and dt_bias 1 (transformers' init draws A in (0, 16)).
        ``config``: a Qwen3NextConfig or a config.json dict."""
        if isinstance(config, dict):
            config = Qwen3NextConfig.from_dict(config)
        rng = np.random.default_rng(seed)
        params = {}
        for name, shape in qwen3_next_param_shapes(config).items():
            if _is_centred_norm(name):
                v = 0.1 * rng.standard_normal(shape)
            elif name.endswith("linear_attn.norm.weight"):
                v = 1 + 0.1 * rng.standard_normal(shape)
            elif name.endswith("A_log"):
                v = np.log(rng.uniform(1, 16, shape))
            elif name.endswith("dt_bias"):
                v = np.ones(shape)
            else:
                v = std * rng.standard_normal(shape)
            params[name] = np.asarray(v, np.float32)
        return cls(config, params, source=f"from_config(seed={seed})", **kw)

    @classmethod
    def from_safetensors(cls, folder, **kw):
        """A transformers folder: config.json and model.safetensors (or shards); per-expert
        tensors are stacked into the fused ones, the multi-token-prediction head (``mtp.*``,
        which transformers skips too) is left out."""
        folder = as_path(folder)
        config = Qwen3NextConfig.from_dict(read_json(folder / "config.json", "config.json"),
                                           source=folder / "config.json")
        # (rotary tables some checkpoints carry as buffers are recomputed here)
        arrays = {k: v for k, v in load_safetensors(folder).items()
                  if not k.startswith("mtp.") and not k.endswith("rotary_emb.inv_freq")}
        return cls(config, fuse_experts(config, arrays, folder), source=folder, **kw)

    # ---- compiled graphs --------------------------------------------------------------------
    def executable(self, kind: str, batch: int, seq: int, cache_len: int | None = None):
        """The compiled ``build_qwen3_next(kind, batch, seq, cache_len)`` with its params set
        (compiled on first use, then kept)."""
        return self._exes.fetch((kind, batch, seq, cache_len), self.max_cached,
                                lambda: self._compile(kind, batch, seq, cache_len))

    def _compile(self, kind, batch, seq, cache_len):
        g = in_dtype(build_qwen3_next(self.config, batch, seq, kind=kind, cache_len=cache_len),
                     self.dtype)
        exe = compile(g, exec_mode=self.exec_mode if kind == "decode" else "stream",
                      params=self._exes.params, stream=self._exes.stream)
        cfg = self.config
        caches = set(cache_names(cfg))
        unset = exe.unset_params           # the first executable of the store uploads them
        weights = graph_params(cfg, self.params) if set(unset) - caches - {
            pad_name(cache_len)} else {}
        for name in unset:
            if name in caches:
                exe.set_param(name, np.zeros((batch, cfg.num_key_value_heads, cache_len,
                                              cfg.head_dim), np.float32))
            elif name == pad_name(cache_len):
                exe.set_param(name, np.zeros((batch, 1), np.int32))
            else:
                exe.set_param(name, weights[name])
        return exe

    @property
    def cached_executables(self) -> int:
        return len(self._exes)

    def _ids(self, input_ids, what: str) -> np.ndarray:
        a = np.asarray(input_ids)
        if a.ndim == 1:
            a = a[None, :]
        if a.ndim != 2 or a.size == 0 or not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"Qwen3NextForCausalLM.{what}: token ids must be integers [seq] or "
                             f"[batch, seq], non-empty; got {a.dtype} {list(np.shape(input_ids))}")
        v = self.config.vocab_size
        if a.min() < 0 or a.max() >= v:
            raise ValueError(f"Qwen3NextForCausalLM.{what}: token ids must be in [0, {v}), got "
                             f"{a.min()}..{a.max()}")
        return a.astype(np.int32)

    # ---- inference --------------------------------------------------------------------------
    def __call__(self, input_ids) -> np.ndarray:
        """Logits [batch, seq, vocab] (f32) of ids [seq] or [batch, seq] ([seq, vocab] for a
        1-D input)."""
        ids = self._ids(input_ids, "__call__")
        if ids.shape[1] > self.config.max_position_embeddings:
            raise ValueError(f"Qwen3NextForCausalLM.__call__: {ids.shape[1]} tokens exceed "
                             f"max_position_embeddings {self.config.max_position_embeddings}")
        (logits,) = self.executable("forward", *ids.shape).run({"input_ids": ids})
        return logits[0] if np.ndim(input_ids) == 1 else logits

    def generate(self, prompt_ids, max_new_tokens: int, *, max_seq_len: int | None = None,
                 output_logits: bool = False):
        """Greedy continuation: the prompt followed by ``max_new_tokens`` ids, [batch, seq + n]
        int64 ([seq + n] for a 1-D prompt), as transformers' generate(do_sample=False). A list
        of prompts of different lengths runs left-padded (each row generates what it would
        alone) and returns a list of 1-D arrays. ``max_seq_len``: the KV caches' rows
        (default the prompt plus the new tokens, rounded up to a power of two, at least 16).
        ``output_logits``: also the logits of each step, f32 [batch, n, vocab] (a list of
        [n, vocab] for a list of prompts)."""
        ragged = (isinstance(prompt_ids, (list, tuple)) and len(prompt_ids) > 0
                  and np.ndim(prompt_ids[0]) == 1
                  and len({len(p) for p in prompt_ids}) > 1)
        rows = ([self._ids(p, "generate")[0] for p in prompt_ids] if ragged
                else list(self._ids(prompt_ids, "generate")))
        if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
            raise ValueError(f"Qwen3NextForCausalLM.generate: max_new_tokens must be a positive "
                             f"int, got {max_new_tokens!r}")
        lens = np.array([len(r) for r in rows])
        b, s = len(rows), int(lens.max())
        need, limit = s + max_new_tokens - 1, self.config.max_position_embeddings
        cap = max_seq_len if max_seq_len is not None else min(max(16, next_pow2(need)), limit)
        if not isinstance(cap, (int, np.integer)) or not need <= cap <= limit:
            raise ValueError(f"Qwen3NextForCausalLM.generate: max_seq_len must be in [{need}, "
                             f"{limit}] (prompt {s} + {max_new_tokens} new tokens - 1), got "
                             f"{max_seq_len!r}")
        ids = np.zeros((b, s), np.int32)            # pad columns: token 0, masked out
        for i, row in enumerate(rows):
            ids[i, s - len(row):] = row
        pad = (s - lens).astype(np.int32).reshape(b, 1)
        states = state_names(self.config)
        # views into the arenas: a run copies its inputs in before it writes any output
        out = self.executable("prefill", b, s, cap).run({"input_ids": ids, "pad": pad},
                                                        outputs="view")
        dec = self.executable("decode", b, 1, cap) if max_new_tokens > 1 else None
        if dec is not None:
            dec.set_param(pad_name(cap), pad)
        new, logits = [], []
        for t in range(max_new_tokens):
            nxt = out[0].copy_to_host()
            new.append(nxt)
            if output_logits:
                logits.append(out[1].copy_to_host())
            if t == max_new_tokens - 1:
                break
            feed = {"input_ids": nxt.astype(np.int32).reshape(b, 1),
                    "pos": np.array([s + t], np.int32)}
            feed.update(zip(states, out[2:2 + len(states)]))
            out = dec.run(feed, outputs="view")
        new = np.stack(new, axis=1).astype(np.int64)
        if ragged:
            res = [np.concatenate([r.astype(np.int64), t]) for r, t in zip(rows, new)]
            lg = list(np.stack(logits, axis=1)) if output_logits else None
        else:
            res = np.concatenate([ids.astype(np.int64), new], axis=1)
            lg = np.stack(logits, axis=1) if output_logits else None
            if np.ndim(prompt_ids) == 1:
                res, lg = res[0], (lg[0] if output_logits else None)
        return (res, lg) if output_logits else res

    def __repr__(self):
        c = self.config
        kinds = "".join("L" if c.linear(n) else "A" for n in range(c.num_hidden_layers))
        return (f"Qwen3NextForCausalLM({c.num_hidden_layers} layers {kinds}, hidden "
                f"{c.hidden_size}, {c.num_experts} experts top-{c.num_experts_per_tok}, vocab "
                f"{c.vocab_size}, dtype {self.dtype})")


__all__ = ["Qwen3NextConfig", "Qwen3NextForCausalLM", "build_qwen3_next", "graph_params",
           "graph_param_shapes", "qwen3_next_param_shapes", "state_names"]
