"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE and OLMoE as transformers builds them.

MoeForCausalLM is LlamaForCausalLM (the same graphs, KV cache, generate, sampling, tokenizer,
``weights=`` options) over a LlamaConfig with ``num_experts`` > 0, whose sparse layers
build_llama routes (blocks.moe_mlp, beside the dense blocks: this module builds on llama.py,
so the block lives below both): softmax over the router's logits, the top k (renormalised for
Mixtral, and for Qwen2-MoE / OLMoE when ``norm_topk_prob``), the experts' SwiGLU as grouped
products, the k outputs summed with their routing weights (plus Qwen2-MoE's sigmoid-gated
shared expert). Its params use transformers 5's names: ``mlp.gate.weight`` [E, H] (the
router), ``mlp.experts.gate_up_proj`` [E, 2I, H] (gate's rows, then up's) and
``mlp.experts.down_proj`` [E, H, I]. ``from_safetensors`` reads those, or the per-expert
tensors of hub checkpoints (what transformers 5's conversion mapping stacks on load):
Mixtral's ``block_sparse_moe.gate`` and ``block_sparse_moe.experts.N.w1 / w3 / w2`` (gate, up,
down), Qwen2-MoE's and OLMoE's ``mlp.experts.N.gate_proj / up_proj / down_proj``.

``weights="f16"/"bf16"`` stores the 2-D product weights half (router and shared expert
included); the 3-D expert weights stay f32 there. With ``dtype="f16"/"bf16"`` the whole graph,
the experts' grouped products included, runs in that dtype (f32 sums, one rounding).
"""
from __future__ import annotations

import re

import numpy as np

from .llama import LlamaConfig, LlamaForCausalLM
from .weights import is_float

# a per-expert tensor: (layer, block, expert, projection)
_PER_EXPERT = re.compile(r"model\.layers\.(\d+)\.(block_sparse_moe|mlp)\.experts\.(\d+)\."
                         r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight")
_ROLE = {"w1": "gate", "w3": "up", "w2": "down",
         "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def fuse_experts(config: LlamaConfig, arrays: dict, source="checkpoint") -> dict:
    """``arrays`` with per-expert tensors stacked into transformers 5's fused ones
    (``mlp.experts.gate_up_proj`` = [gate; up] of each expert, ``mlp.experts.down_proj``)
    and Mixtral's ``block_sparse_moe.gate`` renamed ``mlp.gate``; fused tensors pass as they
    are. A layer whose per-expert set is incomplete, or that has both forms, raises naming
    the tensor."""
    out, layers = {}, {}
    for name, arr in arrays.items():
        m = _PER_EXPERT.fullmatch(name)
        if m is None:
            out[name.replace(".block_sparse_moe.gate.", ".mlp.gate.")] = arr
            continue
        n, block, e, proj = m.groups()
        layers.setdefault(int(n), {})[(int(e), _ROLE[proj])] = (name, block, proj, arr)
    e_n = config.num_experts
    h, i = config.hidden_size, config.moe_intermediate_size
    for n, parts in sorted(layers.items()):
        p = f"model.layers.{n}."
        if not config.sparse_layer(n):
            name = next(iter(parts.values()))[0]
            raise ValueError(f"{source}: unexpected tensor {name!r} (layer {n} has a dense MLP "
                             f"in this config)")
        fused = [p + "mlp.experts.gate_up_proj", p + "mlp.experts.down_proj"]
        if any(f in out for f in fused):
            raise ValueError(f"{source}: layer {n} has both per-expert tensors "
                             f"({next(iter(parts.values()))[0]!r}) and fused ones "
                             f"({next(f for f in fused if f in out)!r})")
        # the names this layer's form (Mixtral's w1/w3/w2 or gate/up/down_proj) should have
        _, block, proj, _ = next(iter(parts.values()))
        names = ({"gate": "w1", "up": "w3", "down": "w2"} if proj in ("w1", "w2", "w3") else
                 {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"})
        stacks = {}
        for role, shape in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))):
            rows = []
            for e in range(e_n):
                want = f"{p}{block}.experts.{e}.{names[role]}.weight"
                if (e, role) not in parts:
                    raise ValueError(f"{source}: missing tensor {want!r} (expert {e} of "
                                     f"{e_n} in layer {n})")
                name, _, _, arr = parts.pop((e, role))
                if tuple(arr.shape) != shape or not is_float(arr):
                    raise ValueError(f"{source}: tensor {name!r} is {arr.dtype} "
                                     f"{list(arr.shape)}, expected a float {list(shape)}")
                rows.append(np.asarray(arr, np.float32))
            stacks[role] = np.stack(rows)
        if parts:                     # experts past num_experts, or a mix of both namings
            raise ValueError(f"{source}: unexpected tensor {next(iter(parts.values()))[0]!r} "
                             f"(the config has {e_n} experts)")
        out[fused[0]] = np.concatenate([stacks["gate"], stacks["up"]], axis=1)
        out[fused[1]] = stacks["down"]
    return out


class MoeForCausalLM(LlamaForCausalLM):
    """A Mixtral / Qwen2-MoE / OLMoE causal LM (module docstring): LlamaForCausalLM whose
    config has experts. ``from_config`` (random weights, a LlamaConfig or a config.json dict
    of model_type 'mixtral', 'qwen2_moe' or 'olmoe') and ``from_safetensors`` (a transformers
    folder, per-expert or fused expert tensors) as LlamaForCausalLM's."""

    def __init__(self, config: LlamaConfig, params: dict, **kw):
        if isinstance(config, LlamaConfig) and not config.num_experts:
            raise ValueError(f"MoeForCausalLM: the config has no experts (model_type "
                             f"{config.model_type!r}, num_experts 0); use LlamaForCausalLM")
        super().__init__(config, params, **kw)

    @classmethod
    def _checkpoint_params(cls, config, arrays, source) -> dict:
        return fuse_experts(config, arrays, source)

    @classmethod
    def from_gguf(cls, path, weights: str = "f32", **kw):
        raise ValueError("MoeForCausalLM.from_gguf: GGUF mixture-of-experts files are not "
                         "supported; use from_safetensors")
