"""Llama decoder (pre-norm RMSNorm, RoPE in Hugging Face's half-split layout, grouped-query
attention, SwiGLU MLP, tied or untied LM head) built on the public Graph API, and
LlamaForCausalLM: weights from a config (random), a Hugging Face folder or a GGUF file;
``model(input_ids)`` -> logits; ``generate`` with a KV cache (one prefill graph, then one decode
graph replayed per token).

The same config and graphs cover the mixture-of-experts decoders of that family (Mixtral,
Qwen2-MoE, OLMoE: ``num_experts`` > 0): their sparse layers route each token to its top-k
experts (grouped_matmul over transformers 5's fused expert weights), with Qwen2-MoE's shared
expert and dense layers, OLMoE's q/k norms and Mixtral's sliding window. models/moe.py has
their model class and checkpoint loading.

Parameters keep Hugging Face's names and layouts (a projection is [out, in]); the graphs read
them through a transpose of the last two axes, which the products take as an operand flag, so
no weight is copied or transposed on the host.
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields, replace

import numpy as np

from .. import Graph, compile
from ..device import SIMULATOR, gc_paused, in_cuda_context
from ..ir.ops_quant import GGUF as GGUF_SCHEMES
from ..modes import parse_exec_mode
from .blocks import (Positions, Weights, add_norm, decoder_attention, decoder_positions,
                     embedding, gated_mlp, lm_head, moe_mlp, norm)
from .blocks import pad_name, rope_tables  # noqa: F401  (this module's names before blocks.py)
from .executables import ExecutableCache, bucket_length, in_dtype, model_dtype, next_pow2
from .weights import (LEGACY_BLOCKS, GGUFFile, as_path, check_gguf_vocab, check_params,
                      dequantize_blocks, gguf_tokenizer, load_safetensors, quantize, read_json,
                      reverse_permute)

log = logging.getLogger("rlx_numba")


# ---- config ------------------------------------------------------------------------------------
@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None        # None: = num_attention_heads (no GQA)
    head_dim: int | None = None                   # None: hidden_size // num_attention_heads
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None
    model_type: str = "llama"                     # config.json's: one of MODEL_TYPES
    qkv_bias: bool = False                        # q/k/v biases without o_proj's (Qwen2-MoE)
    qk_norm: bool = False                         # OLMoE: RMSNorm over all of q / k, before rope
    clip_qkv: float | None = None                 # OLMoE: q, k, v clamped to [-c, c]
    sliding_window: int | None = None             # Mixtral: keys pos - w < j <= pos
    # mixture of experts (Mixtral, Qwen2-MoE, OLMoE); num_experts 0: every MLP dense
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None      # an expert's; None: intermediate_size
    norm_topk_prob: bool = False                  # renormalise the top-k probabilities
    shared_expert_intermediate_size: int = 0      # Qwen2-MoE's sigmoid-gated shared expert
    decoder_sparse_step: int = 1                  # Qwen2-MoE: n sparse if (n + 1) % step == 0
    mlp_only_layers: list = field(default_factory=list)   # ... and not listed here
    extra: dict = field(default_factory=dict, repr=False)   # keys we read but do not use

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            v = getattr(self, f)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"LlamaConfig: {f} must be a positive int, got {v!r}")
            setattr(self, f, int(v))
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"LlamaConfig: hidden_size {self.hidden_size} is not a multiple "
                                 f"of num_attention_heads {self.num_attention_heads}; give "
                                 f"head_dim")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"LlamaConfig: head_dim must be even (rope rotates pairs), got "
                             f"{self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"LlamaConfig: num_attention_heads {self.num_attention_heads} must "
                             f"be a multiple of num_key_value_heads {self.num_key_value_heads}")
        if not self.rope_theta > 0 or not self.rms_norm_eps >= 0:
            raise ValueError(f"LlamaConfig: rope_theta must be > 0 and rms_norm_eps >= 0, got "
                             f"{self.rope_theta!r}, {self.rms_norm_eps!r}")
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"LlamaConfig: model_type must be one of {', '.join(MODEL_TYPES)}, "
                             f"got {self.model_type!r}")
        for f, v in (("clip_qkv", self.clip_qkv), ("sliding_window", self.sliding_window)):
            if v is not None and not v > 0:
                raise ValueError(f"LlamaConfig: {f} must be None or > 0, got {v!r}")
        self._check_moe()

    def _check_moe(self):
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size
        for f, lo in (("num_experts", 0), ("num_experts_per_tok", 1), ("moe_intermediate_size", 1),
                      ("shared_expert_intermediate_size", 0), ("decoder_sparse_step", 1)):
            v = getattr(self, f)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < lo:
                raise ValueError(f"LlamaConfig: {f} must be an int >= {lo}, got {v!r}")
            setattr(self, f, int(v))
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"LlamaConfig: num_experts_per_tok {self.num_experts_per_tok} exceeds "
                             f"num_experts {self.num_experts} (top-k of the router's experts)")
        if not isinstance(self.mlp_only_layers, (list, tuple)):
            raise ValueError(f"LlamaConfig: mlp_only_layers must be a list of layer indices, got "
                             f"{self.mlp_only_layers!r}")
        bad = [n for n in self.mlp_only_layers
               if not isinstance(n, (int, np.integer)) or not 0 <= n < self.num_hidden_layers]
        if bad:
            raise ValueError(f"LlamaConfig: mlp_only_layers must hold layer indices in [0, "
                             f"{self.num_hidden_layers}), got {bad[0]!r}")
        self.mlp_only_layers = sorted({int(n) for n in self.mlp_only_layers})

    def sparse_layer(self, n: int) -> bool:
        """Whether layer n's MLP is routed experts (Qwen2-MoE's rule; every layer of Mixtral
        and OLMoE)."""
        return (self.num_experts > 0 and n not in self.mlp_only_layers
                and (n + 1) % self.decoder_sparse_step == 0)

    @property
    def eos_ids(self) -> list[int]:
        e = self.eos_token_id
        return [] if e is None else [int(e)] if np.isscalar(e) else [int(x) for x in e]

    @classmethod
    def from_dict(cls, d: dict, source="config") -> "LlamaConfig":
        """From a Hugging Face config.json dict (transformers 4 or 5 layout) of model_type
        'llama', 'mixtral', 'qwen2_moe' or 'olmoe' (keys it lacks take transformers' defaults
        for that type; router_jitter_noise and the aux-loss keys only matter in training)."""
        mt = d.get("model_type", "llama")
        if mt not in MODEL_TYPES:
            raise ValueError(f"{source}: model_type is {mt!r}; LlamaConfig reads "
                             f"{', '.join(map(repr, MODEL_TYPES))} configs")
        d = {**_TYPE_DEFAULTS.get(mt, {}), **{k: v for k, v in d.items() if v is not None}}
        if mt == "mixtral":        # top-k always renormalised; every expert intermediate_size
            d.update(num_experts=d.get("num_local_experts", d.get("num_experts")),
                     norm_topk_prob=True, moe_intermediate_size=d["intermediate_size"])
        elif mt == "olmoe":
            d["qk_norm"] = True
        elif mt == "qwen2_moe":
            if d.get("use_sliding_window") or any(t != "full_attention"
                                                  for t in d.get("layer_types") or ()):
                raise ValueError(f"{source}: Qwen2-MoE's sliding-window layers "
                                 f"(use_sliding_window) are not supported")
            d.pop("sliding_window", None)
        else:
            d.pop("sliding_window", None)
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{source}: hidden_act {act!r} is not supported (Llama uses silu)")
        rope = d.get("rope_parameters") or {}          # transformers 5 keeps theta here
        scaling = d.get("rope_scaling") or {}
        rtype = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
        if rtype not in (None, "default"):
            raise ValueError(f"{source}: rope scaling {rtype!r} is not supported (only the "
                             f"default rope)")
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        names = {f.name for f in fields(cls)} - {"extra", "rope_theta", "model_type"}
        kw = {k: d[k] for k in names if k in d and d[k] is not None}
        try:
            return cls(rope_theta=float(theta), model_type=mt, **kw)
        except TypeError as e:
            raise ValueError(f"{source}: {e}") from None

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("extra")
        return d


MODEL_TYPES = ("llama", "mixtral", "qwen2_moe", "olmoe")
# transformers' defaults for the keys a hub config.json of that type may leave out
_TYPE_DEFAULTS = {
    "mixtral": {"rms_norm_eps": 1e-5, "rope_theta": 1e6, "num_local_experts": 8,
                "num_experts_per_tok": 2},
    "qwen2_moe": {"rms_norm_eps": 1e-6, "qkv_bias": True, "num_experts": 60,
                  "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                  "shared_expert_intermediate_size": 5632, "norm_topk_prob": False},
    "olmoe": {"rms_norm_eps": 1e-5, "num_experts": 64, "num_experts_per_tok": 8,
              "norm_topk_prob": False},
}


def llama_param_shapes(cfg: LlamaConfig) -> dict[str, tuple]:
    """Every parameter of the model, by its Hugging Face name, with its shape."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    out = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        out[p + "input_layernorm.weight"] = (h,)
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            out[p + f"self_attn.{name}.weight"] = (rows, h)
            if cfg.attention_bias or cfg.qkv_bias:
                out[p + f"self_attn.{name}.bias"] = (rows,)
        out[p + "self_attn.o_proj.weight"] = (h, q)
        if cfg.attention_bias:
            out[p + "self_attn.o_proj.bias"] = (h,)
        if cfg.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (q,)
            out[p + "self_attn.k_norm.weight"] = (kv,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        if cfg.sparse_layer(n):    # transformers 5's names and layouts ([E, out, in])
            e, mi = cfg.num_experts, cfg.moe_intermediate_size
            si = cfg.shared_expert_intermediate_size
            out[p + "mlp.gate.weight"] = (e, h)                       # the router
            out[p + "mlp.experts.gate_up_proj"] = (e, 2 * mi, h)      # gate's rows, then up's
            out[p + "mlp.experts.down_proj"] = (e, h, mi)
            if si:
                for name, shape in (("gate_proj", (si, h)), ("up_proj", (si, h)),
                                    ("down_proj", (h, si))):
                    out[p + f"mlp.shared_expert.{name}.weight"] = shape
                out[p + "mlp.shared_expert_gate.weight"] = (1, h)
            continue
        for name, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            out[p + f"mlp.{name}.weight"] = shape
            if cfg.mlp_bias:
                out[p + f"mlp.{name}.bias"] = (shape[0],)
    out["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    return out


# the packed projections of build_llama(fused=True): one product a pack, its weight (and bias)
# the parts' rows one after the other -- gate and up's rows interleaved (gate 0, up 0, gate 1,
# ...), so that at decode the product's kernel pairs them in its epilogue (Graph.gated)
PACKS = (("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
         ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
         ("mlp.shared_expert.gate_up_proj", ("mlp.shared_expert.gate_proj",
                                             "mlp.shared_expert.up_proj")))
INTERLEAVED = ("mlp.gate_up_proj", "mlp.shared_expert.gate_up_proj")


def _packs(cfg: LlamaConfig, names):
    """(packed name, [part names]) of every packed weight / bias whose parts are in names."""
    for n in range(cfg.num_hidden_layers):
        for packed, parts in PACKS:
            for what in ("weight", "bias"):
                full = [f"model.layers.{n}.{part}.{what}" for part in parts]
                if full[0] in names:
                    yield f"model.layers.{n}.{packed}.{what}", full, packed in INTERLEAVED


def graph_param_shapes(cfg: LlamaConfig, fused: bool = True) -> dict[str, tuple]:
    """The params of ``build_llama(cfg, ..., fused=fused)``: those of ``llama_param_shapes``,
    except that with ``fused`` each layer's q/k/v projections are one
    ``self_attn.qkv_proj`` ([q + 2 kv, hidden]: q's rows, then k's, then v's; the bias
    likewise) and gate/up one ``mlp.gate_up_proj`` ([2 intermediate, hidden]: gate's and up's
    rows interleaved, gate's first; the bias likewise)."""
    shapes = llama_param_shapes(cfg)
    if not fused:
        return shapes
    for packed, parts, _ in list(_packs(cfg, shapes)):
        rows = [shapes.pop(name) for name in parts]
        shapes[packed] = (sum(r[0] for r in rows),) + rows[0][1:]
    return shapes


def graph_params(cfg: LlamaConfig, params: dict, fused: bool = True) -> dict:
    """The graph's params (``graph_param_shapes``) from Hugging Face-named ones (checked, as
    LlamaForCausalLM.params holds them): the packed weights concatenated on the host."""
    out = dict(params)
    if not fused:
        return out
    for packed, parts, interleaved in list(_packs(cfg, params)):
        arrs = [out.pop(name) for name in parts]
        out[packed] = _pack(arrs, interleaved)
    return out


def _pack(arrs, interleaved: bool, out=None) -> np.ndarray:
    """The parts' rows one after the other (``interleaved``: row i of each part in turn), into
    ``out`` when given."""
    if out is None:
        out = np.empty((sum(a.shape[0] for a in arrs),) + arrs[0].shape[1:],
                       np.result_type(*arrs))
    if interleaved:
        rows = out.reshape((arrs[0].shape[0], len(arrs)) + arrs[0].shape[1:])
        for k, a in enumerate(arrs):
            rows[:, k] = a
    else:
        np.concatenate(arrs, axis=0, out=out)
    return out


def graph_param_reader(cfg: LlamaConfig, params: dict, fused: bool = True):
    """``read(name)``: graph_params(cfg, params, fused)[name] without packing every weight
    first. A packed one is written into a host buffer kept per shape, which the next packed
    read of that shape overwrites: use a value before reading the next (set_param copies it
    during the call). A fresh process's first compile of SmolLM2-135M no longer faults in
    280 MB of new pages for 60 packs (graph_params 0.18-0.26 s of CPU on the 2-core dev
    host, these reads 0.04 s)."""
    packs = {p: (parts, inter) for p, parts, inter in _packs(cfg, params)} if fused else {}
    bufs = {}

    def read(name):
        if name not in packs:
            return params[name]
        parts, interleaved = packs[name]
        arrs = [params[p] for p in parts]
        key = ((sum(a.shape[0] for a in arrs),) + arrs[0].shape[1:], np.result_type(*arrs))
        if key not in bufs:
            bufs[key] = np.empty(*key)
        return _pack(arrs, interleaved, bufs[key])
    return read


def unpack_graph_params(cfg: LlamaConfig, gp: dict, fused: bool = True) -> dict:
    """Hugging Face-named params from the graph's (``graph_params``' inverse): the packed
    weights split back into their parts."""
    out = dict(gp)
    if not fused:
        return out
    shapes = llama_param_shapes(cfg)
    names = {part for _, parts, _ in _packs(cfg, shapes) for part in parts}
    for packed, parts, interleaved in list(_packs(cfg, names)):
        arr = out.pop(packed)
        if interleaved:
            for k, name in enumerate(parts):
                out[name] = np.ascontiguousarray(arr[k::len(parts)])
        else:
            ends = np.cumsum([shapes[name][0] for name in parts])[:-1]
            for name, piece in zip(parts, np.split(arr, ends, axis=0)):
                out[name] = np.ascontiguousarray(piece)
    return out


def product_weights(cfg: LlamaConfig, fused: bool = True) -> list[str]:
    """The graph params that are the weight of a product (what set_param_half may store
    half); with tied embeddings the token table is the LM head's weight too."""
    names = [k for k, s in graph_param_shapes(cfg, fused).items()
             if len(s) == 2 and k != "model.embed_tokens.weight"]
    return names + (["model.embed_tokens.weight"] if cfg.tie_word_embeddings else [])


# ---- tensor parallelism (Megatron's layout) ---------------------------------------------------
# q/k/v and gate/up are split by output rows (heads, intermediate units), o_proj and down_proj
# by input columns (their partial products summed by an all_reduce, then their bias added),
# the token table and the head by vocabulary rows (vocab-parallel: each rank looks up the ids in
# its range, an all_reduce sums the rows; the logits' shards are all-gathered)
ROW_PARALLEL = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def shard_config(cfg: LlamaConfig, world: int) -> LlamaConfig:
    """One rank's config of a ``world``-way tensor-parallel ``cfg``: a world-th of the vocabulary,
    the attention and KV heads and the intermediate units (head_dim kept)."""
    if world == 1:
        return cfg
    need = {"vocab_size": cfg.vocab_size, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads,
            "intermediate_size": cfg.intermediate_size}
    bad = [f"{k} {v}" for k, v in need.items() if v % world]
    if bad:
        raise ValueError(f"tensor_parallel={world}: {', '.join(bad)} not a multiple of {world}")
    if cfg.num_experts or cfg.qk_norm:
        raise ValueError(f"tensor_parallel={world}: mixture-of-experts layers and qk_norm (a norm "
                         f"over every head) are not sharded; use tensor_parallel=1")
    return replace(cfg, head_dim=cfg.head_dim, **{k: v // world for k, v in need.items()})


def _slicer(rank: int, world: int):
    """select(name, shape) -> the index of rank's slice of a Hugging Face-named tensor."""
    def select(name, shape):
        if world == 1 or name.endswith(("norm.weight", "o_proj.bias", "down_proj.bias")) \
                or name.endswith("rotary_emb.inv_freq"):
            return None
        axis = 1 if name.endswith(ROW_PARALLEL) else 0
        k = shape[axis] // world
        return (slice(None),) * axis + (slice(rank * k, (rank + 1) * k),)
    return select


def shard_params(params: dict, rank: int, world: int) -> dict:
    """Rank ``rank``'s slices of full Hugging Face-named ``params`` (see shard_config)."""
    select = _slicer(rank, world)
    out = {}
    for name, a in params.items():
        part = select(name, np.shape(a))
        out[name] = a if part is None else np.ascontiguousarray(a[part])
    return out


def cache_names(cfg: LlamaConfig) -> list[str]:
    return [f"cache.{n}.{kv}" for n in range(cfg.num_hidden_layers) for kv in ("k", "v")]


# ---- the graph -----------------------------------------------------------------------------------
def build_llama(cfg: LlamaConfig, batch: int, seq: int, *, kind: str = "forward",
                cache_len: int | None = None, temperature: float = 0.0, top_k: int = 0,
                top_p: float = 1.0, fused: bool = True, quant: dict | None = None,
                tensor_parallel: tuple | None = None, qat: str | None = None) -> Graph:
    """A Llama graph over ``input_ids`` [batch, seq] (i32 input), params named as in
    ``graph_param_shapes(cfg, fused)`` (set them from Hugging Face-named weights with
    ``graph_params``). ``quant``: graph param name -> (scheme, packed shape) of the weights
    kept packed (GGUF blocks): that param is u8, its products ``Graph.dequant_matmul`` and the
    token table's lookup ``Graph.dequantize(rows=)``.

    ``fused`` (the default) packs each layer into fewer, fatter kernels: one product for
    q/k/v and one for gate/up (over the packed weights), RoPE of q and k with the KV-cache
    write in one kernel (Graph.rope_kv_write), silu(gate) * up (Graph.gated over the
    interleaved gate/up product: at decode the product's epilogue). ``fused=False`` builds
    one product a projection and separate rope / kv_write steps (same values; the reference
    the fused graph is tested against).

    kind "forward": outputs the logits [batch, seq, vocab] (causal attention over the seq
    tokens at positions 0..seq-1). kind "train": the forward graph with ``labels`` (i64
    [batch, seq], Hugging Face's convention: the input ids again, -100 where no loss) whose
    output is the mean next-token cross-entropy (position t against labels[:, t + 1]), what
    ``rlx.compile_train`` differentiates. kind "prefill": also writes every layer's rotated keys and
    values into the caches (params ``cache.N.k`` / ``cache.N.v``, [batch, kv_heads, cache_len,
    head_dim]) at rows 0..seq-1; outputs the next token ids [batch] (i64, sampled from the last
    position), the last logits [batch, vocab], then the caches. kind "decode" (seq 1): takes
    ``pos`` (i32 [1], the row this token goes to), writes its key/value there, attends to rows
    0..pos, outputs the next ids and the logits. The prefill and decode graphs take ``seed``
    (i64 [1]) for sampling (``temperature``, ``top_k``, ``top_p`` as in Graph.sample; 0 is
    greedy).

    Ragged batches (prompts of different lengths) are left-padded: ``pad`` (i32 [batch, 1],
    the pad tokens at the start of each row) is a run() input of the prefill graph and a param
    of the decode graph (set once a generation, like the caches, so a decode step copies no
    more inputs than before). Row r's token at column t sits at position t - pad[r] for RoPE,
    and the keys in columns < pad[r] are masked out of every query's attention (a pad query
    sees no key: zeros). The decode step writes every row's key/value at cache row ``pos`` and
    rotates it with position pos - pad[r]. All-zero pads give the plain [batch, seq] graph's
    results.

    ``tensor_parallel=(rank, world)``: the graph of one rank of a world-way tensor-parallel model
    (shard_config / shard_params: its params are that rank's slices, under the same names);
    the collectives run on the current communicator (rlx_numba.distributed). Every rank
    outputs the full logits, ids and its own KV-cache heads.

    ``qat``: quantisation-aware training toward GGUF "q8_0" or "q4_0" (blocks.QAT_SCHEMES):
    the projections, head and token table are read fake-quantised to that format
    (straight-through gradients), so a model trained so loses little when
    ``LlamaForCausalLM.quantized(qat)`` packs it. Not with ``quant`` or tensor parallelism."""
    _check_build(cfg, batch, seq, kind, cache_len)
    b, s, vocab = int(batch), int(seq), cfg.vocab_size
    world = (tensor_parallel or (0, 1))[1]
    if qat is not None and (quant or world > 1):
        raise ValueError("build_llama: qat= trains f32 weights of a whole model; not with "
                         "packed (quant=) weights or tensor parallelism")
    if world > 1:
        if quant:
            raise ValueError("build_llama: packed (GGUF) weights are not tensor-parallel")
        cfg = shard_config(cfg, world)
    cached = kind in ("prefill", "decode")
    g = Graph(f"llama_{kind}_{b}x{s}" + (f"_cache{cache_len}" if cached else ""))
    w = Weights.declare(g, graph_param_shapes(cfg, fused), quant, tensor_parallel, qat)
    ids = g.input("input_ids", (b, s), "i32")
    at = decoder_positions(g, cfg, kind, b, s, cache_len)
    stream, branch = embedding(w, "model.embed_tokens", ids), None   # [b, s, hidden]
    caches = []
    for n in range(cfg.num_hidden_layers):
        branch, stream, written = llama_layer(w, cfg, n, branch, stream, at, fused=fused,
                                              separate=kind == "decode")
        caches += written
    if kind == "prefill" and s > 1:    # only the last position's logits are needed
        branch, stream = g.narrow(branch, 1, s - 1, 1), g.narrow(stream, 1, s - 1, 1)
    if kind == "decode":     # the add into the last down product, the norm into the head
        final = add_norm(w, "model.norm", branch, stream, eps=cfg.rms_norm_eps, separate=True)[0]
    else:
        final = norm(w, "model.norm", branch, eps=cfg.rms_norm_eps, residual=stream)
    logits = lm_head(w, "lm_head" if "lm_head.weight" in w else "model.embed_tokens", final)
    if kind == "forward":
        g.set_outputs([logits])
    elif kind == "train":  # next-token cross-entropy: position t predicts labels[:, t + 1]
        labels = g.input("labels", (b, s), "i64")
        pred = g.reshape(g.narrow(logits, 1, 0, s - 1), (b * (s - 1), vocab))
        target = g.reshape(g.narrow(labels, 1, 1, s - 1), (b * (s - 1),))
        g.set_outputs([g.cross_entropy(pred, target, ignore_index=-100)])
    else:
        logits = g.reshape(logits, (b, vocab))
        seed = g.input("seed", (1,), "i64")
        nxt = g.sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        g.set_outputs([nxt, logits] + caches)
    return g


def llama_layer(w: Weights, cfg: LlamaConfig, n: int, branch, stream, at: Positions, *,
                fused: bool, separate: bool = False):
    """Decoder layer ``n`` on the residual stream: (its MLP's output, the stream, the caches
    a prefill wrote). ``branch`` is the previous layer's MLP output, not yet added to
    ``stream`` (None before the first layer): the add and the norm after it are one kernel,
    or with ``separate`` (decode) the add folds into the product before it and the norm
    into the one after (blocks.add_norm)."""
    p, eps = f"model.layers.{n}.", cfg.rms_norm_eps
    hn, stream = add_norm(w, p + "input_layernorm", branch, stream, eps=eps, separate=separate)
    a, written = decoder_attention(w, cfg, p + "self_attn.", hn, at, fused=fused,
                                   cache=(f"cache.{n}.k", f"cache.{n}.v") if at.cached else None)
    hn, stream = add_norm(w, p + "post_attention_layernorm", a, stream, eps=eps,
                          separate=separate)
    if cfg.sparse_layer(n):
        return moe_mlp(w, cfg, p + "mlp.", hn, fused=fused), stream, written
    return gated_mlp(w, p + "mlp.", hn, fused=fused), stream, written


def _check_build(cfg: LlamaConfig, batch, seq, kind, cache_len):
    if kind not in ("forward", "prefill", "decode", "train"):
        raise ValueError(f"build_llama: kind must be 'forward', 'prefill', 'decode' or 'train', "
                         f"got {kind!r}")
    for arg, v in (("batch", batch), ("seq", seq)):
        if not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"build_llama: {arg} must be a positive int, got {v!r}")
    if kind == "decode" and seq != 1:
        raise ValueError(f"build_llama: a decode graph takes one token a row (seq 1), got {seq}")
    if kind == "train" and seq < 2:
        raise ValueError(f"build_llama: a train graph needs seq >= 2 (position t predicts "
                         f"token t + 1), got {seq}")
    cached = kind in ("prefill", "decode")
    if cached and (not isinstance(cache_len, (int, np.integer)) or not seq <= cache_len):
        raise ValueError(f"build_llama: {kind} needs cache_len >= seq ({seq}), got "
                         f"{cache_len!r}")
    n_pos = cache_len if cached else seq
    if n_pos > cfg.max_position_embeddings:
        raise ValueError(f"build_llama: {n_pos} positions exceed max_position_embeddings "
                         f"{cfg.max_position_embeddings}")


# ---- the model -----------------------------------------------------------------------------------
def prompt_bucket(n: int) -> int:
    """The columns ``generate`` left-pads a batch whose longest prompt has ``n`` tokens to
    (unless max_seq_len leaves less room): multiples of 8 up to 64, then four lengths an
    octave (80, 96, 112, 128, 160, ...)."""
    return bucket_length(n, lo=8, steps=4)


def _shard_of(tensor_parallel, weights) -> tuple[int, int]:
    """(rank, world) of a model built with ``tensor_parallel`` (None: (0, 1))."""
    if tensor_parallel is None:
        return 0, 1
    if not isinstance(tensor_parallel, (int, np.integer)) or tensor_parallel < 1:
        raise ValueError(f"LlamaForCausalLM: tensor_parallel must be a positive int, got "
                         f"{tensor_parallel!r}")
    from ..distributed import current
    comm = current()
    if comm is None or comm.world_size != tensor_parallel:
        raise ValueError(f"LlamaForCausalLM: tensor_parallel={tensor_parallel} needs a current "
                         f"communicator of {tensor_parallel} ranks (rlx_numba.distributed.init or "
                         f"run_ranks), got {comm!r}")
    if weights == "gguf" and tensor_parallel > 1:
        raise ValueError("LlamaForCausalLM: packed GGUF weights are not tensor-parallel")
    return comm.rank, int(tensor_parallel)


class LlamaForCausalLM:
    """A Llama causal LM over rlx_numba executables.

    ``params``: name -> array in Hugging Face's names and layouts (``llama_param_shapes``);
    checked, kept on the host as f32. ``weights`` "f16" or "bf16" stores the product weights
    half on the device (``set_param_half``: half operands, f32 accumulation). ``exec_mode`` is
    the decode graph's (the one replayed per token): "graph" by default, one CUDA graph
    replayed per token (the simulator runs it as "stream"); the other graphs run "stream".
    Compiled graphs are kept per shape (the ``max_cached`` most recent); they all read one
    device copy of the weights (a ParamStore) and run on one stream, and a prefill and the
    decode graph of the same batch and cache length share their KV cache.

    ``tensor_parallel=N``: this process (or in-process rank) is one of N ranks of a
    tensor-parallel model (build_llama's layout); the current communicator
    (rlx_numba.distributed.init / run_ranks) must have N ranks. ``params`` may be the full
    weights (this rank keeps its slices: shard_params) or the rank's slices already
    (``from_safetensors(..., tensor_parallel=N)`` reads only those). Every rank returns the
    same logits and tokens."""

    def __init__(self, config: LlamaConfig, params: dict, *, tokenizer=None, weights: str = "f32",
                 exec_mode="graph", max_cached: int = 4, source="params", packed=None,
                 tensor_parallel: int | None = None, dtype="f32"):
        if not isinstance(config, LlamaConfig):
            raise ValueError(f"LlamaForCausalLM: config must be a LlamaConfig, got "
                             f"{type(config).__name__}")
        if weights not in ("f32", "f16", "bf16", "gguf"):
            raise ValueError(f"LlamaForCausalLM: weights must be 'f32', 'f16', 'bf16' or 'gguf', "
                             f"got {weights!r}")
        self.dtype = model_dtype(type(self).__name__, dtype)
        if self.dtype != "f32" and weights != "f32":
            raise ValueError(f"{type(self).__name__}: dtype={self.dtype!r} stores every weight "
                             f"in {self.dtype} already; weights={weights!r} is for f32 models")
        if (weights == "gguf") != (packed is not None):
            raise ValueError("LlamaForCausalLM: weights='gguf' comes from from_gguf (the file's "
                             "packed blocks); other weights take no packed=")
        try:
            mode = parse_exec_mode(exec_mode)
        except ValueError as e:
            raise ValueError(f"LlamaForCausalLM: {str(e).removeprefix('compile: ')}") from None
        self.config = config
        self.shard = _shard_of(tensor_parallel, weights)
        self.local_config = shard_config(config, self.shard[1])
        ignore = ("lm_head.weight",) if config.tie_word_embeddings else ()
        full = llama_param_shapes(config)
        if self.shard[1] > 1 and all(np.shape(v) == full.get(k) for k, v in params.items()):
            params = shard_params(params, *self.shard)
        self.params = check_params(llama_param_shapes(self.local_config), params, source,
                                   ignore=ignore)
        self.tokenizer = tokenizer
        self.weights = weights
        # weights="gguf": HF name -> (scheme, u8 [N, bytes]) of the projections kept packed on
        # the device (self.params still holds every weight dequantised, on the host)
        self.packed = packed or {}
        self.exec_mode = mode
        self.max_cached = max_cached
        self._exes = ExecutableCache("llama")   # with one device copy of the weights
        self._kv_owner: dict = {}      # (batch, cache rows) -> the generation using that cache
        self._token_rings: dict = {}   # (batch, cache rows) -> pinned buffers (_token_ring)

    # ---- training ---------------------------------------------------------------------------------
    def trainer(self, batch: int, seq: int, optimizer, *, clip_grad_norm=None,
                exec_mode="graph", deterministic=False,
                data_parallel=False, precision="f32", qat=None) -> "LlamaTrainer":
        """Next-token training of this model's weights on [batch, seq] token windows (the
        ``build_llama`` kind "train" graph through ``rlx.compile_train``): forward, backward
        and ``optimizer``'s update as one executable. See LlamaTrainer. ``data_parallel``:
        this process is one replica of data-parallel training (``rlx.compile_train``'s), its
        ``batch`` rows its share of the global batch. ``precision``: "f32", or "bf16" / "f16"
        mixed precision (``rlx.compile_train``'s: f32 master weights, half compute). ``qat``:
        quantisation-aware training toward GGUF "q8_0" / "q4_0" (build_llama's); then
        ``update_model()`` and ``quantized(qat)`` give the packed model."""
        return LlamaTrainer(self, batch, seq, optimizer, clip_grad_norm=clip_grad_norm,
                            exec_mode=exec_mode, deterministic=deterministic,
                            data_parallel=data_parallel, precision=precision, qat=qat)

    # ---- constructors ---------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config, seed: int = 0, std: float = 0.02, **kw) -> "LlamaForCausalLM":
        """Random weights from ``seed``: projections and embeddings N(0, std), norm gains
        1 + N(0, 0.1), biases N(0, std). ``config`` is a LlamaConfig or a config.json dict."""
        if isinstance(config, dict):
            config = LlamaConfig.from_dict(config)
        rng = np.random.default_rng(seed)
        params = {}
        for name, shape in llama_param_shapes(config).items():
            if name.endswith("norm.weight"):
                params[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            else:
                params[name] = (std * rng.standard_normal(shape)).astype(np.float32)
        return cls(config, params, source=f"from_config(seed={seed})", **kw)

    @classmethod
    def from_safetensors(cls, folder, **kw) -> "LlamaForCausalLM":
        """A Hugging Face folder: config.json, model.safetensors (or shards) with HF tensor
        names; tokenizer.json when present."""
        folder = as_path(folder)
        config = LlamaConfig.from_dict(read_json(folder / "config.json", "config.json"),
                                       source=folder / "config.json")
        tp = kw.get("tensor_parallel")
        arrays = load_safetensors(folder, _slicer(*_shard_of(tp, "f32")) if tp else None)
        # older checkpoints carry the rotary tables as buffers; they are recomputed here
        arrays = {k: v for k, v in arrays.items() if not k.endswith("rotary_emb.inv_freq")}
        tok = None
        if (folder / "tokenizer.json").exists():
            from tokenizers import Tokenizer
            tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        src = folder / "model.safetensors" if (folder / "model.safetensors").exists() else folder
        return cls(config, cls._checkpoint_params(config, arrays, src), tokenizer=tok,
                   source=src, **kw)

    @classmethod
    def _checkpoint_params(cls, config, arrays, source) -> dict:
        """A checkpoint's tensors under the names of ``llama_param_shapes`` (MoeForCausalLM
        renames and stacks per-expert tensors)."""
        if config.num_experts:
            raise ValueError(f"{source}: a mixture-of-experts model (model_type "
                             f"{config.model_type!r}); load it with "
                             f"rlx_numba.models.MoeForCausalLM")
        return arrays

    @classmethod
    def from_gguf(cls, path, weights: str = "f32", **kw) -> "LlamaForCausalLM":
        """A llama.cpp GGUF file (architecture 'llama'): weights dequantised to f32 (any type
        the gguf package reads: F32, F16, BF16, Q4_0, Q4_1, Q8_0, K-quants, ...), Q/K rows
        un-permuted back to the half-split rope layout; the tokenizer from its vocabulary.
        ``weights="gguf"``: the projections, token table and head stored in a block format
        dequant_matmul reads (q4_0 .. q8_0, q2_k .. q6_k) stay packed on the device, their
        products dequantising as they go (the table's lookup dequantises the rows it reads);
        the other tensors (norms, F16 / F32 ones) are f32."""
        f = GGUFFile(as_path(path))
        config = llama_config_from_gguf(f)
        names = {}
        for gname in f.names:
            hf = _gguf_to_hf(gname)
            if hf is None:
                raise ValueError(f"{f.path}: unexpected tensor {gname!r} for a llama model")
            names[hf] = gname

        def heads_of(hf):
            return (config.num_attention_heads if hf.endswith(("q_proj.weight", "q_proj.bias"))
                    else config.num_key_value_heads
                    if hf.endswith(("k_proj.weight", "k_proj.bias")) else None)

        def read(hf):
            arr, heads = f.tensor(names[hf]), heads_of(hf)
            return _unpermute(f, names[hf], arr, heads, config.head_dim) if heads else arr

        # dequantising is whole-array numpy work, which releases the GIL: the tensors in
        # parallel (SmolLM2-135M's 272 on a many-core host); the first failure in file order
        # is the one raised, as one at a time
        with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
            arrays = dict(zip(names, pool.map(read, names)))
        packed = {}
        for hf, gname in names.items():
            arr, heads = arrays[hf], heads_of(hf)
            scheme = f.type_name(gname).lower()
            if (weights == "gguf" and scheme in GGUF_SCHEMES
                    and (hf.endswith("_proj.weight") or hf in ("model.embed_tokens.weight",
                                                               "lm_head.weight"))):
                raw = f.raw(gname).reshape(arr.shape[0], -1)
                packed[hf] = (scheme, reverse_permute(raw, heads) if heads else raw)
        if weights == "gguf":
            kw["packed"] = packed
        tok = None
        if f.get("tokenizer.ggml.model") is not None:
            try:
                check_gguf_vocab(f)
                # built on first use (m.tokenizer): 0.3-0.6 s for a 49k vocabulary, which a
                # process generating from token ids never needs
                tok = _Deferred(lambda: gguf_tokenizer(f))
            except ValueError as e:
                log.warning("%s", e)
        return cls(config, arrays, tokenizer=tok, source=f.path, weights=weights, **kw)

    def quantized(self, scheme: str, **kw) -> "LlamaForCausalLM":
        """This model with its projections, token table and head quantised to GGUF ``scheme``
        (weights.quantize: q4_0, q4_1, q5_0, q5_1, q8_0, q4_k) and kept packed on the device,
        as ``from_gguf(weights="gguf")`` keeps a file's. A weight whose K is not a multiple
        of q4_k's 256 takes q5_0, as llama.cpp's quantizer falls back; one not a multiple of
        32 stays f32. ``params`` become the dequantised values; ``kw`` as the constructor's
        (exec_mode, max_cached)."""
        params, packed = dict(self.params), {}
        for name, v in self.params.items():
            if v.ndim != 2 or not (name.endswith("_proj.weight") or name in (
                    "model.embed_tokens.weight", "lm_head.weight")):
                continue
            s = scheme if v.shape[1] % (256 if scheme.endswith("_k") else 32) == 0 else (
                "q5_0" if scheme.endswith("_k") and v.shape[1] % 32 == 0 else None)
            if s is not None:
                raw = quantize(v, s)
                packed[name] = (s, raw)
                params[name] = _dequantized(raw, s, v.shape)
        kw = {"exec_mode": self.exec_mode, "max_cached": self.max_cached, **kw}
        return type(self)(self.config, params, tokenizer=self._tokenizer, weights="gguf",
                          packed=packed, source=f"quantized({scheme!r})", **kw)

    # ---- compiled graphs -------------------------------------------------------------------------
    def executable(self, kind: str, batch: int, seq: int, cache_len: int | None = None,
                   sampling=(0.0, 0, 1.0)):
        """The compiled graph of ``build_llama(kind, batch, seq, ...)`` with the weights set
        (compiled on first use, then kept)."""
        key = (kind, batch, seq, cache_len, tuple(sampling))
        return self._exes.fetch(key, self.max_cached,
                                lambda: self._compile(kind, batch, seq, cache_len, sampling))

    @gc_paused                   # (one context scope and one pause for the compile and the
    @in_cuda_context             # uploads)
    def _compile(self, kind, batch, seq, cache_len, sampling):
        t, k, p = sampling
        fused, packed = self._graph_packed()
        quant = {name: (scheme, raw.shape) for name, (scheme, raw) in packed.items()}
        g = build_llama(self.config, batch, seq, kind=kind, cache_len=cache_len, temperature=t,
                        top_k=k, top_p=p, fused=fused, quant=quant,
                        tensor_parallel=self.shard if self.shard[1] > 1 else None)
        g = in_dtype(g, self.dtype)
        local = self.local_config
        exe = compile(g, exec_mode=self.exec_mode if kind == "decode" else "stream",
                      params=self._exes.params, stream=self._exes.stream)
        half = set(product_weights(local)) if self.weights in ("f16", "bf16") else set()
        caches = set(cache_names(local))
        unset = exe.unset_params        # the first executable of the store uploads them
        weights = graph_param_reader(local, self.params, fused=fused)
        for name in unset:
            if name in caches:          # rows past the prompt are never read; zeros keep them tidy
                exe.set_param(name, np.zeros((batch, local.num_key_value_heads, cache_len,
                                              local.head_dim), np.float32))
            elif name == pad_name(cache_len):   # no padding until a generation sets its pads
                exe.set_param(name, np.zeros((batch, 1), np.int32))
            elif name in packed:
                exe.set_param(name, packed[name][1])
            elif name in half:
                exe.set_param_half(name, weights(name), self.weights)
            else:
                exe.set_param(name, weights(name))
        return exe

    def device_bytes(self) -> dict:
        """Device bytes of the weights (and KV caches) the model's executables share, by format
        (f32, a half copy, u8 packed GGUF blocks): ParamStore.bytes_by_format."""
        return self._exes.params.bytes_by_format()

    @property
    def cached_executables(self) -> int:
        """Compiled graphs the model holds (prefill / decode / train shapes, at most
        ``max_cached`` of the generation ones): a long-running service checks it stays flat."""
        return len(self._exes)

    def _graph_packed(self):
        """(fused, graph param name -> (scheme, packed bytes)): the packed weights under the
        graph's names. A fused pack (qkv, gate/up) of packed parts of one scheme is their
        rows concatenated (or interleaved) as graph_params does; a pack whose parts differ
        in scheme or packing builds the unfused graph instead. Built once (every compile of
        the model reads it)."""
        if not self.packed:
            return True, {}
        if getattr(self, "_packed_graph", None) is None:
            self._packed_graph = self._pack_graph()
        return self._packed_graph

    def _pack_graph(self):
        out = dict(self.packed)
        for pname, parts, interleaved in list(_packs(self.config, set(self.params))):
            got = [self.packed.get(name) for name in parts]
            if all(v is None for v in got):
                continue
            if any(v is None for v in got) or len({(v[0], v[1].shape[1]) for v in got}) > 1:
                return False, dict(self.packed)
            for name in parts:
                del out[name]
            arrs = [v[1] for v in got]
            out[pname] = (got[0][0], np.stack(arrs, axis=1).reshape(-1, arrs[0].shape[1])
                          if interleaved else np.concatenate(arrs, axis=0))
        return True, out

    def _prompts(self, prompt_ids, what: str):
        """(rows, ragged): the prompts as a list of int32 arrays, and whether they came as a
        list of prompts of different lengths rather than a [seq] or [batch, seq] array (a
        list of equal-length prompts is the [batch, seq] array it spells)."""
        ragged = False
        if isinstance(prompt_ids, (list, tuple)) and prompt_ids and np.ndim(prompt_ids[0]) >= 1:
            lens = {len(p) if np.ndim(p) == 1 else None for p in prompt_ids}
            ragged = len(lens) > 1 or None in lens     # (a bad prompt is reported below)
        if not ragged:
            return list(self._ids(prompt_ids, what)), False
        rows, v = [], self.config.vocab_size
        for r, p in enumerate(prompt_ids):
            a = np.asarray(p)
            if a.ndim != 1 or a.size == 0:
                raise ValueError(f"LlamaForCausalLM.{what}: prompt {r} of the list must be a "
                                 f"non-empty 1-D sequence of token ids, got shape "
                                 f"{list(a.shape)}")
            if not np.issubdtype(a.dtype, np.integer):
                raise ValueError(f"LlamaForCausalLM.{what}: prompt {r} of the list must hold "
                                 f"integer token ids, got {a.dtype}")
            bad = np.flatnonzero((a < 0) | (a >= v))
            if bad.size:
                raise ValueError(f"LlamaForCausalLM.{what}: token id {a[bad[0]]} at [{r}, "
                                 f"{int(bad[0])}] is outside the vocabulary [0, {v})")
            rows.append(a.astype(np.int32))
        return rows, True

    def _ids(self, input_ids, what: str) -> np.ndarray:
        a = np.asarray(input_ids)
        if a.ndim == 1:
            a = a[None, :]
        if a.ndim != 2 or a.size == 0:
            raise ValueError(f"LlamaForCausalLM.{what}: token ids must be [seq] or [batch, seq] "
                             f"and non-empty, got shape {list(np.shape(input_ids))}")
        if not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"LlamaForCausalLM.{what}: token ids must be integers, got {a.dtype}")
        v = self.config.vocab_size
        bad = np.flatnonzero((a < 0) | (a >= v))
        if bad.size:
            at = np.unravel_index(int(bad[0]), a.shape)
            raise ValueError(f"LlamaForCausalLM.{what}: token id {a[at]} at {list(map(int, at))} "
                             f"is outside the vocabulary [0, {v})")
        return a.astype(np.int32)

    # ---- inference ------------------------------------------------------------------------------
    def __call__(self, input_ids) -> np.ndarray:
        """Logits [batch, seq, vocab] (numpy f32) of token ids [seq] or [batch, seq]
        ([seq, vocab] for a 1-D input)."""
        ids = self._ids(input_ids, "__call__")
        if ids.shape[1] > self.config.max_position_embeddings:
            raise ValueError(f"LlamaForCausalLM.__call__: {ids.shape[1]} tokens exceed "
                             f"max_position_embeddings {self.config.max_position_embeddings}")
        exe = self.executable("forward", *ids.shape)
        (logits,) = exe.run({"input_ids": ids})
        return logits[0] if np.ndim(input_ids) == 1 else logits

    def generate_stream(self, prompt_ids, max_new_tokens: int, *, temperature: float = 0.0,
                        top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                        eos_token_id=None, max_seq_len: int | None = None):
        """Yield the next token ids ([batch] int64) one step at a time: the prefill graph runs
        the prompts once and fills the KV cache, then the decode graph (compiled once for this
        batch and cache length) runs per token with the position and the token as inputs. The
        token goes from one step to the next on the device, and each step is queued before
        the previous one's tokens are read back: the device runs one step ahead of what was
        yielded (wasted when the stream stops at EOS).

        ``prompt_ids``: token ids [seq] or [batch, seq], or a list of prompts (1-D sequences of
        token ids) of different lengths. The prompts are left-padded to a bucketed length
        (``prompt_bucket``: multiples of 8, then four lengths an octave), the rows' pads given
        to the graphs at run time (build_llama), so calls whose longest prompt falls in one
        bucket share the compiled graphs. Each prompt's tokens take positions 0..len-1 and its pads are masked
        out of attention, so a row generates what it would alone.

        Rows that produced ``eos_token_id`` (an int or a list) keep yielding it; the stream
        ends when every row has, or after ``max_new_tokens``. ``max_seq_len`` sets the cache
        rows (default: the padded prompt plus the new tokens, rounded up to a power of two);
        it must hold the longest prompt plus the new tokens (the padding shrinks to fit). The
        KV cache lives in the decode graph, which the generations of one shape share: a stream
        that another generation of the same shape overtook raises RuntimeError instead of
        reading the other's cache."""
        rows, _ = self._prompts(prompt_ids, "generate")
        if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
            raise ValueError(f"LlamaForCausalLM.generate: max_new_tokens must be a positive int, "
                             f"got {max_new_tokens!r}")
        lens = np.array([len(r) for r in rows])
        b, s = len(rows), int(lens.max())
        need = s + max_new_tokens - 1                 # the last token is never fed back
        limit = self.config.max_position_embeddings
        if need > limit:
            raise ValueError(f"LlamaForCausalLM.generate: prompt {s} + {max_new_tokens} new tokens "
                             f"need {need} positions; the model has {limit}")
        padded = prompt_bucket(s)
        cap = max_seq_len if max_seq_len is not None else min(
            max(16, next_pow2(padded + max_new_tokens - 1)), limit)
        if not isinstance(cap, (int, np.integer)) or not need <= cap <= limit:
            raise ValueError(f"LlamaForCausalLM.generate: max_seq_len must be in [{need}, {limit}] "
                             f"(prompt {s} + {max_new_tokens} new tokens - 1), got {max_seq_len!r}")
        padded = min(padded, cap - max_new_tokens + 1)   # >= s: the cache holds it all
        ids = np.zeros((b, padded), np.int32)             # pad columns: token 0, masked out
        for r, p in enumerate(rows):
            ids[r, padded - len(p):] = p
        pad = (padded - lens).astype(np.int32).reshape(b, 1)
        eos = set() if eos_token_id is None else (
            {int(eos_token_id)} if np.isscalar(eos_token_id) else {int(e) for e in eos_token_id})
        sampling = (float(temperature), int(top_k), float(top_p))
        pre = self.executable("prefill", b, padded, cap, sampling)
        dec = self.executable("decode", b, 1, cap, sampling) if max_new_tokens > 1 else None

        def seed_of(step):             # Philox streams of adjacent keys are independent
            return np.array([(int(seed) + step) % 2**63], np.int64)

        # the prefill writes the KV cache (and the decode graph's row pads) that the decode
        # graph of its shape reads (store entries of that shape): from here on, a stream of
        # the same shape that started before would read another's
        owner = self._kv_owner[(b, cap)] = object()
        if dec is not None:   # (a blocking copy: before the prefill is queued, not behind it)
            dec.set_param(pad_name(cap), pad)
        # The GPU never waits for the host: decode step s + 1 is queued (its input the ids
        # step s leaves on the device) before step s's ids are read back, each step's ids
        # copied to a pinned slot (two, used in turn) with an event to wait on alone. The
        # prefill and decode graphs share the model's stream, which orders it all.
        from numba import cuda
        ring, feeds = self._token_ring(b, cap), {}
        events = [cuda.event(**({} if SIMULATOR else {"timing": False})) for _ in ring]

        def queue(exe, inputs, step):
            """Queue a run and its ids' copy home; its ids as the decode graph's input_ids."""
            out = exe.run(inputs, outputs="view", wait=False)[0]
            out.copy_to_host(ring[step % 2], stream=exe.stream)
            events[step % 2].record(exe.stream)
            if exe not in feeds:   # i64 ids' low words (little-endian, ids < 2^31) as i32 [b, 1]
                feeds[exe] = out.view(np.int32).reshape(b, 2)[:, :1]   # (one view every run)
            return feeds[exe]

        def fetch(step):
            events[step % 2].synchronize()
            return ring[step % 2].astype(np.int64)   # a copy: the slot is refilled 2 steps on

        feed = queue(pre, {"input_ids": ids, "pad": pad, "seed": seed_of(0)}, 0)
        done = np.zeros(b, bool)
        tok = None
        for step in range(max_new_tokens):
            if step and self._kv_owner.get((b, cap)) is not owner:
                raise RuntimeError("LlamaForCausalLM.generate_stream: another generation of the "
                                   f"same shape (batch {b}, cache {cap}) started on this model "
                                   "and replaced this one's KV cache; run them one after the "
                                   "other, or on separate models")
            if step + 1 < max_new_tokens:   # step + 1 reads step's ids: both stream-ordered
                feed = queue(dec, {"input_ids": feed, "pos": np.array([padded + step], np.int32),
                                   "seed": seed_of(step + 1)}, step + 1)
            new = fetch(step)
            if eos:   # (a finished row goes on with its own draws on the device: rows are apart)
                new = new if tok is None else np.where(done, tok, new)
                done |= np.isin(new, list(eos))
            tok = new
            yield tok
            if done.all():
                return

    def _token_ring(self, b: int, cap: int) -> list:
        """Two pinned [b] i64 buffers the generations of shape (b, cap) copy their ids into.
        Kept by the model: a step queued ahead may still copy into one after its generation
        ended (eos, or abandoned), which freeing it then would race; the next generation of
        the shape queues its copies behind that one."""
        ring = self._token_rings.get((b, cap))
        if ring is None:
            from numba import cuda
            ring = self._token_rings[(b, cap)] = [cuda.pinned_array(b, np.int64)
                                                  for _ in range(2)]
        return ring

    def generate(self, prompt_ids, max_new_tokens: int, *, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_token_id=None,
                 max_seq_len: int | None = None, streamer=None):
        """The prompt followed by the generated tokens, [batch, seq + n] int64 ([seq + n] for a
        1-D prompt), like transformers' generate. For a list of prompts of different lengths
        (``generate_stream``), a list of int64 arrays, one a prompt: the prompt followed by its own tokens, up to and
        including its first ``eos_token_id`` (what generating it alone gives). ``temperature``
        0 is greedy; otherwise top_k / top_p sampling with ``seed`` (the same seed gives the
        same tokens). ``streamer(ids)`` is called with each step's [batch] ids as they come."""
        rows, ragged = self._prompts(prompt_ids, "generate")
        steps = []
        for tok in self.generate_stream(rows if ragged else prompt_ids, max_new_tokens,
                                        temperature=temperature, top_k=top_k, top_p=top_p,
                                        seed=seed, eos_token_id=eos_token_id,
                                        max_seq_len=max_seq_len):
            steps.append(tok)
            if streamer is not None:
                streamer(tok)
        new = np.stack(steps, axis=1)
        if ragged:
            eos = [] if eos_token_id is None else (
                [int(eos_token_id)] if np.isscalar(eos_token_id) else list(eos_token_id))
            out = []
            for p, t in zip(rows, new):
                hit = np.flatnonzero(np.isin(t, eos))
                t = t[:hit[0] + 1] if hit.size else t
                out.append(np.concatenate([p.astype(np.int64), t]))
            return out
        prompt = np.atleast_2d(np.asarray(prompt_ids)).astype(np.int64)
        out = np.concatenate([prompt, new], axis=1)
        return out[0] if np.ndim(prompt_ids) == 1 else out

    # ---- text -----------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        """The ``tokenizers.Tokenizer`` (None without one); from_gguf's is built here, on first
        use."""
        if isinstance(self._tokenizer, _Deferred):
            self._tokenizer = self._tokenizer.make()
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, tok):
        self._tokenizer = tok

    def _tok(self):
        if self.tokenizer is None:
            raise ValueError("LlamaForCausalLM: this model has no tokenizer (pass tokenizer=, or "
                             "load a folder with tokenizer.json or a GGUF with a BPE vocabulary)")
        return self.tokenizer

    def encode(self, text: str) -> list[int]:
        return self._tok().encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok().decode([int(i) for i in np.ravel(ids)], skip_special_tokens=False)

    def chat_prompt(self, user: str, system: str | None = None) -> list[int]:
        """Token ids of a one-turn chat in ChatML (``<|im_start|>role\\n...<|im_end|>\\n``, the
        format of SmolLM2 and Qwen instruct models), ending with the assistant's header."""
        if self._tok().token_to_id("<|im_start|>") is None:
            raise ValueError("LlamaForCausalLM.chat_prompt: the vocabulary has no <|im_start|> "
                             "(not a ChatML model); pass token ids to generate() instead")
        turns = ([("system", system)] if system else []) + [("user", user)]
        text = "".join(f"<|im_start|>{r}\n{t}<|im_end|>\n" for r, t in turns)
        return self.encode(text + "<|im_start|>assistant\n")

    def stream_text(self, prompt_ids, max_new_tokens: int, **kw):
        """Yield the text of a generation (one prompt) piece by piece as tokens come, up to
        the first end token (the config's EOS ids and <|im_end|>, unless ``eos_token_id`` is
        given). Other keywords as in generate()."""
        if len(self._prompts(prompt_ids, "stream_text")[0]) != 1:
            raise ValueError("LlamaForCausalLM.stream_text: one prompt at a time")
        eos = kw.pop("eos_token_id", None)
        if eos is None:
            end = self._tok().token_to_id("<|im_end|>")
            eos = self.config.eos_ids + ([end] if end is not None else [])
        eos = {int(eos)} if np.isscalar(eos) else {int(e) for e in eos}
        ids, shown = [], ""
        for tok in self.generate_stream(prompt_ids, max_new_tokens, eos_token_id=eos or None,
                                        **kw):
            if int(tok[0]) in eos:
                return
            ids.append(int(tok[0]))
            text = self.decode(ids)
            if text.endswith("\ufffd"):          # a character still split across tokens
                continue
            yield text[len(shown):]
            shown = text

    def __repr__(self):
        c = self.config
        moe = (f", {c.num_experts} experts top-{c.num_experts_per_tok}" if c.num_experts else "")
        return (f"{type(self).__name__}({c.num_hidden_layers} layers, hidden {c.hidden_size}, "
                f"heads {c.num_attention_heads}/{c.num_key_value_heads}{moe}, vocab "
                f"{c.vocab_size}, weights {self.weights}, decode {self.exec_mode})")


# ---- GGUF ------------------------------------------------------------------------------------------
_GGUF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight", "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.weight": "mlp.up_proj.weight", "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.weight": "mlp.down_proj.weight", "ffn_down.bias": "mlp.down_proj.bias",
}
_GGUF_TOP = {"token_embd.weight": "model.embed_tokens.weight",
             "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


class _Deferred:
    """A value made on first use (LlamaForCausalLM.tokenizer)."""

    def __init__(self, make):
        self.make = make


def _dequantized(raw, scheme, shape):
    """The f32 values of GGUF blocks (the gguf package's dequantize; ours for the 32-weight
    schemes, value for value the same and faster)."""
    if scheme in LEGACY_BLOCKS:
        return dequantize_blocks(raw, scheme).reshape(shape)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    return np.ascontiguousarray(dequantize(raw, getattr(GGMLQuantizationType, scheme.upper())),
                                dtype=np.float32).reshape(shape)


def _gguf_to_hf(name: str) -> str | None:
    if name in _GGUF_TOP:
        return _GGUF_TOP[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _GGUF_LAYER:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER[parts[2]]}"
    return None


def _unpermute(f, gname, arr, n_head, head_dim):
    if arr.shape[0] != n_head * head_dim:
        raise ValueError(f"{f.path}: tensor {gname!r} has shape {list(arr.shape)}, expected "
                         f"{n_head * head_dim} rows ({n_head} heads of {head_dim})")
    return reverse_permute(arr, n_head)


def llama_config_from_gguf(f: GGUFFile) -> LlamaConfig:
    """LlamaConfig from a GGUF's llama.* metadata."""
    arch = f.require("general.architecture")
    if arch != "llama":
        raise ValueError(f"{f.path}: general.architecture is {arch!r}; from_gguf reads 'llama'")

    def one(key, default=None):
        v = f.get(f"llama.{key}", default)
        if isinstance(v, list):            # per-layer values: only a uniform model is supported
            if len(set(v)) != 1:
                raise ValueError(f"{f.path}: llama.{key} varies by layer ({v[:4]}...); not "
                                 f"supported")
            v = v[0]
        if v is None:
            raise ValueError(f"{f.path}: GGUF metadata 'llama.{key}' is missing")
        return v

    scaling = f.get("llama.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"{f.path}: rope scaling {scaling!r} is not supported")
    if "rope_freqs.weight" in f.names:
        raise ValueError(f"{f.path}: tensor 'rope_freqs.weight' (scaled rope frequencies) is not "
                         f"supported")
    heads = int(one("attention.head_count"))
    hidden = int(one("embedding_length"))
    head_dim = int(one("attention.key_length", hidden // heads))
    rot = int(one("rope.dimension_count", head_dim))
    if rot != head_dim:
        raise ValueError(f"{f.path}: llama.rope.dimension_count {rot} != head dim {head_dim} "
                         f"(partial rotary is not supported)")
    tokens = f.length("tokenizer.ggml.tokens")        # not decoded: only the count
    if f.get("llama.vocab_size") is not None:
        vocab = int(f.get("llama.vocab_size"))
    elif tokens is not None:
        vocab = tokens
    elif "token_embd.weight" in f.names:
        vocab = f.shape("token_embd.weight")[0]
    else:
        raise ValueError(f"{f.path}: no vocabulary size (llama.vocab_size, tokenizer.ggml.tokens "
                         f"or token_embd.weight)")
    bias = any(n.endswith("attn_q.bias") for n in f.names)
    try:
        return LlamaConfig(
            vocab_size=vocab, hidden_size=hidden,
            intermediate_size=int(one("feed_forward_length")),
            num_hidden_layers=int(one("block_count")), num_attention_heads=heads,
            num_key_value_heads=int(one("attention.head_count_kv", heads)), head_dim=head_dim,
            max_position_embeddings=int(one("context_length")),
            rope_theta=float(one("rope.freq_base", 10000.0)),
            rms_norm_eps=float(one("attention.layer_norm_rms_epsilon", 1e-5)),
            tie_word_embeddings="output.weight" not in f.names,
            attention_bias=bias, mlp_bias=any(n.endswith("ffn_up.bias") for n in f.names),
            bos_token_id=f.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=f.get("tokenizer.ggml.eos_token_id"))
    except ValueError as e:
        raise ValueError(f"{f.path}: {e}") from None


class LlamaTrainer:
    """Trains a LlamaForCausalLM's weights (f32) on next-token prediction.

    ``step(input_ids, labels=None) -> loss`` runs one forward + backward + update on the
    device (labels default to the ids themselves, Hugging Face's convention: position t is
    scored against token t + 1; -100 marks a position with no loss) and returns the mean
    cross-entropy before the update. ``update_model()`` copies the trained weights back into
    the model's ``params`` (Hugging Face names) and drops its compiled graphs, so ``generate``
    then uses them. ``trainer`` is the underlying rlx.Trainer (set_lr, memory_report, ...)."""

    def __init__(self, model: LlamaForCausalLM, batch: int, seq: int, optimizer, *,
                 clip_grad_norm=None, exec_mode="graph", deterministic=False,
                 data_parallel=False, precision="f32", qat=None):
        from ..train import compile_train
        if model.shard[1] > 1:
            raise ValueError("LlamaForCausalLM.trainer: a tensor-parallel model does not train "
                             "here; train data-parallel (data_parallel=True) on full replicas")
        self.model, self.batch, self.seq = model, int(batch), int(seq)
        g = build_llama(model.config, batch, seq, kind="train", qat=qat)
        self.trainer = compile_train(g, g.tensor(g.outputs[0]), optimizer,
                                     exec_mode=exec_mode, clip_grad_norm=clip_grad_norm,
                                     deterministic=deterministic, data_parallel=data_parallel,
                                     precision=precision)
        for name, arr in graph_params(model.config, model.params).items():
            self.trainer.set_param(name, arr)

    def step(self, input_ids, labels=None) -> float:
        ids = np.asarray(input_ids)
        want = (self.batch, self.seq)
        lab = ids if labels is None else np.asarray(labels)
        for arg, a in (("input_ids", ids), ("labels", lab)):
            if a.shape != want or not np.issubdtype(a.dtype, np.integer):
                raise ValueError(f"LlamaTrainer.step: {arg} must be an integer {list(want)} array "
                                 f"(the trainer's batch and seq), got {a.dtype} {list(a.shape)}")
        vocab = self.model.config.vocab_size
        if ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(f"LlamaTrainer.step: input_ids hold {int(ids.min())}..{int(ids.max())}, "
                             f"outside [0, {vocab})")
        return self.trainer.step({"input_ids": ids.astype(np.int32), "labels": lab.astype(np.int64)})

    def set_lr(self, lr: float) -> None:
        self.trainer.set_lr(lr)

    def update_model(self) -> None:
        gp = {name: self.trainer.get_param(name) for name in self.trainer.params}
        self.model.params.update(unpack_graph_params(self.model.config, gp))
        # a fresh store and cache: graphs still held elsewhere keep the old weights' store
        self.model._exes = ExecutableCache("llama")
        self.model._kv_owner.clear()
