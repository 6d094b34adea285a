"""Mixture-of-experts decoders (MoeForCausalLM: Mixtral, Qwen2-MoE, OLMoE) against a NumPy
forward written here (float64, a loop over tokens and their experts, as transformers' modeling
files compute it): logits of the three model types, greedy generation with the KV cache
against a loop that recomputes everything, the unfused graph, from_safetensors with
per-expert (hub) and fused (transformers 5) tensor names, and the errors. Tiny shapes: the
whole file runs in the simulator in well under a minute."""
import json

import ml_dtypes
import numpy as np
import pytest

import rlx_numba as rlx
from rlx_numba.models import LlamaConfig, LlamaForCausalLM, MoeForCausalLM, build_llama
from rlx_numba.models.llama import graph_params

pytest.importorskip("safetensors")
from safetensors.numpy import save_file  # noqa: E402
from test_models import close, np_attention, np_rms, np_rope_tables  # noqa: E402

BASE = {"vocab_size": 29, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "max_position_embeddings": 64, "hidden_act": "silu"}
CONFIGS = {
    # sliding window 4 < the 7-token inputs: it masks keys; jitter is training-only
    "mixtral": {**BASE, "model_type": "mixtral", "intermediate_size": 6, "num_local_experts": 4,
                "num_experts_per_tok": 2, "sliding_window": 4, "router_jitter_noise": 0.1,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}},
    # layer 0 dense (decoder_sparse_step 2), layer 1 sparse with the shared expert; q/k/v biases
    "qwen2_moe": {**BASE, "model_type": "qwen2_moe", "intermediate_size": 14,
                  "moe_intermediate_size": 6, "shared_expert_intermediate_size": 10,
                  "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": False,
                  "decoder_sparse_step": 2, "use_sliding_window": False,
                  "sliding_window": 4096, "rope_theta": 10000.0},
    # q/k norms, clip_qkv (1.5 clamps some q/k values at this scale), top-3 renormalised
    "olmoe": {**BASE, "model_type": "olmoe", "intermediate_size": 6, "num_experts": 4,
              "num_experts_per_tok": 3, "norm_topk_prob": True, "clip_qkv": 1.5,
              "rms_norm_eps": 1e-5, "tie_word_embeddings": True},
}
IDS = np.array([[3, 17, 28, 0, 9, 9, 21], [11, 4, 4, 26, 1, 8, 2]])


# ---- NumPy reference (transformers' modeling_mixtral / _qwen2_moe / _olmoe, written out) -------
def np_silu(x):
    return x / (1 + np.exp(-x))


def np_swiglu(P, x, m):
    return (np_silu(x @ P[m + "gate_proj.weight"].T) * (x @ P[m + "up_proj.weight"].T)) \
        @ P[m + "down_proj.weight"].T


def np_moe_block(cfg, P, p, h):
    """Router softmax, top-k (ties to the smaller expert, like torch.topk), renormalised for
    Mixtral or with norm_topk_prob, each chosen expert's SwiGLU weighted; the shared expert
    times sigmoid(its gate)."""
    t = h.reshape(-1, h.shape[-1])
    logits = t @ P[p + "mlp.gate.weight"].T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    gu, down = P[p + "mlp.experts.gate_up_proj"], P[p + "mlp.experts.down_proj"]
    i = gu.shape[1] // 2
    out = np.zeros_like(t)
    for r in range(t.shape[0]):
        top = np.argsort(-probs[r], kind="stable")[:cfg.num_experts_per_tok]
        w = probs[r, top]
        if cfg.model_type == "mixtral" or cfg.norm_topk_prob:
            w = w / w.sum()
        for e, we in zip(top, w):
            a = np_silu(t[r] @ gu[e, :i].T) * (t[r] @ gu[e, i:].T)
            out[r] += we * (a @ down[e].T)
    if p + "mlp.shared_expert_gate.weight" in P:
        gate = 1 / (1 + np.exp(-(t @ P[p + "mlp.shared_expert_gate.weight"].T)))
        out += gate * np_swiglu(P, t, p + "mlp.shared_expert.")
    return out.reshape(h.shape)


def np_moe(cfg, params, ids, window="config"):
    """Logits [B, S, V] in float64. ``window``: the sliding window (default the config's)."""
    P = {k: v.astype(np.float64) for k, v in params.items()}
    w = cfg.sliding_window if window == "config" else window
    s, eps = ids.shape[1], cfg.rms_norm_eps
    cos, sin = np_rope_tables(cfg, s)
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    keep = (j <= i) & ((j > i - w) if w else True)

    def proj(x, name):
        y = x @ P[name + ".weight"].T
        return y + P[name + ".bias"] if name + ".bias" in P else y

    x = P["model.embed_tokens.weight"][ids]
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        h = np_rms(x, P[p + "input_layernorm.weight"], eps)
        q, k, v = (proj(h, p + f"self_attn.{m}_proj") for m in "qkv")
        if p + "self_attn.q_norm.weight" in P:        # OLMoE: over all heads, before rope
            q = np_rms(q, P[p + "self_attn.q_norm.weight"], eps)
            k = np_rms(k, P[p + "self_attn.k_norm.weight"], eps)
        if cfg.clip_qkv is not None:
            q, k, v = (np.clip(t, -cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
        x = x + proj(np_attention(cfg, q, k, v, cos, sin, keep), p + "self_attn.o_proj")
        h = np_rms(x, P[p + "post_attention_layernorm.weight"], eps)
        sparse = n not in cfg.mlp_only_layers and (n + 1) % cfg.decoder_sparse_step == 0
        x = x + (np_moe_block(cfg, P, p, h) if sparse else np_swiglu(P, h, p + "mlp."))
    x = np_rms(x, P["model.norm.weight"], eps)
    head = P["lm_head.weight"] if "lm_head.weight" in P else P["model.embed_tokens.weight"]
    return x @ head.T


def np_greedy(cfg, params, ids, n):
    seq = np.array(ids)
    for _ in range(n):
        seq = np.concatenate([seq, np_moe(cfg, params, seq)[:, -1].argmax(-1)[:, None]], 1)
    return seq


@pytest.fixture(scope="module")
def models():
    # std 0.3: logits and router probabilities spread out, far from ties
    return {mt: MoeForCausalLM.from_config(c, seed=5, std=0.3) for mt, c in CONFIGS.items()}


# ---- forward and generation ---------------------------------------------------------------------
@pytest.mark.parametrize("mt", list(CONFIGS))
def test_moe_forward_matches_numpy(models, mt):
    m = models[mt]
    want = np_moe(m.config, m.params, IDS)
    close(m(IDS), want)
    # the options under test change the result (so the match above checks them)
    if mt == "mixtral":
        assert np.abs(np_moe(m.config, m.params, IDS, window=None) - want).max() > 1e-2
    if mt == "olmoe":
        free = LlamaConfig(**{**m.config.to_dict(), "clip_qkv": None})
        assert np.abs(np_moe(free, m.params, IDS) - want).max() > 1e-2


def test_moe_unfused_graph_matches_fused(models):
    """build_llama(fused=False) (one product a projection, the shared expert's gate and up
    apart) gives the NumPy forward's logits, as the fused graph does (test above)."""
    m = models["qwen2_moe"]
    exe = rlx.compile(build_llama(m.config, *IDS.shape, fused=False))
    for name, arr in graph_params(m.config, m.params, fused=False).items():
        exe.set_param(name, arr)
    (got,) = exe.run({"input_ids": IDS.astype(np.int32)})
    close(got, np_moe(m.config, m.params, IDS))


@pytest.mark.parametrize("mt", ["qwen2_moe", "olmoe"])
def test_moe_generate_greedy_matches_numpy_loop(models, mt):
    """Prefill, then the decode graph (the routing on the device each step), against a loop
    that recomputes the whole sequence for every token. Two new tokens: the prefill's and one
    decode step reading the cache (more steps rerun the same graph)."""
    m = models[mt]
    prompt = IDS[:, :5]
    np.testing.assert_array_equal(m.generate(prompt, 2), np_greedy(m.config, m.params, prompt, 2))


def test_moe_generate_ragged_with_sliding_window(models):
    """Mixtral with a window of 4: prompts of 3 and 6 tokens left-padded into one batch, 2
    new tokens each; every row's tokens are the NumPy loop's over that prompt alone (the
    decode step at position 6 sees cache rows 3..6 only: its window reaches back over the
    cache rows, past the 6-token row's first ones; the pads stay masked)."""
    m = models["mixtral"]
    prompts = [IDS[0, :3], IDS[1, :6]]
    out = m.generate([list(p) for p in prompts], 2)
    for p, o in zip(prompts, out):
        np.testing.assert_array_equal(o, np_greedy(m.config, m.params, p[None], 2)[0])


def test_grouped_matmul_trans_w(rng):
    """trans_w reads w as [E, N, K]: out[i] = x[i] @ w[ids[i]]^T."""
    x = rng.standard_normal((7, 5)).astype(np.float32)
    w = rng.standard_normal((3, 4, 5)).astype(np.float32)
    ids = np.array([2, 0, 2, 1, 1, 2, 0])
    g = rlx.Graph("gm_t")
    y = g.grouped_matmul(g.input("x", x.shape), g.param("w", w.shape),
                         g.input("ids", (7,), "i64"), trans_w=True)
    assert y.shape == (7, 4)
    g.set_outputs([y])
    exe = rlx.compile(g)
    exe.set_param("w", w)
    (got,) = exe.run({"x": x, "ids": ids})
    close(got, np.einsum("mk,mnk->mn", x.astype(np.float64), w[ids].astype(np.float64)), 1e-5)
    with pytest.raises(ValueError, match=r"grouped_matmul: x \[7, 5\] has K=5 but w \[3, 5, 4\] "
                                         r"has K=4 \(trans_w: w is \[E, N, K\]\)"):
        g.grouped_matmul(g.input("x2", x.shape), g.param("w2", (3, 5, 4)),
                         g.input("ids2", (7,), "i64"), trans_w=True)


# ---- config ------------------------------------------------------------------------------------
def test_moe_configs_read_transformers_keys():
    mix = LlamaConfig.from_dict(CONFIGS["mixtral"])
    assert (mix.num_experts, mix.num_experts_per_tok, mix.moe_intermediate_size,
            mix.norm_topk_prob, mix.sliding_window, mix.rope_theta, mix.rms_norm_eps) == \
        (4, 2, 6, True, 4, 1000.0, 1e-5)               # eps: Mixtral's default
    qw = LlamaConfig.from_dict(CONFIGS["qwen2_moe"])
    assert qw.qkv_bias and not qw.attention_bias and qw.sliding_window is None
    assert [qw.sparse_layer(n) for n in range(2)] == [False, True]
    ol = LlamaConfig.from_dict(CONFIGS["olmoe"])
    assert ol.qk_norm and ol.clip_qkv == 1.5 and ol.norm_topk_prob
    step = LlamaConfig.from_dict({**CONFIGS["qwen2_moe"], "num_hidden_layers": 4,
                                  "decoder_sparse_step": 1, "mlp_only_layers": [0, 2]})
    assert [step.sparse_layer(n) for n in range(4)] == [False, True, False, True]
    # a config round-trips through to_dict
    assert LlamaConfig(**mix.to_dict()) == mix


def test_moe_config_errors(models):
    with pytest.raises(ValueError, match="num_experts_per_tok 5 exceeds num_experts 4"):
        LlamaConfig.from_dict({**CONFIGS["olmoe"], "num_experts_per_tok": 5})
    with pytest.raises(ValueError, match="mlp_only_layers must hold layer indices in "
                                         r"\[0, 2\), got 2"):
        LlamaConfig.from_dict({**CONFIGS["qwen2_moe"], "mlp_only_layers": [2]})
    with pytest.raises(ValueError, match="sliding-window layers .use_sliding_window. are not "
                                         "supported"):
        LlamaConfig.from_dict({**CONFIGS["qwen2_moe"], "use_sliding_window": True})
    with pytest.raises(ValueError, match="model_type is 'deepseek_v3'"):
        LlamaConfig.from_dict({**CONFIGS["olmoe"], "model_type": "deepseek_v3"})
    dense = LlamaConfig(vocab_size=5, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                        num_attention_heads=2)
    with pytest.raises(ValueError, match="MoeForCausalLM: the config has no experts"):
        MoeForCausalLM.from_config(dense)
    with pytest.raises(ValueError, match="GGUF mixture-of-experts files are not supported"):
        MoeForCausalLM.from_gguf("x.gguf")
    assert repr(models["olmoe"]).startswith("MoeForCausalLM(2 layers, hidden 16, heads 2/1, "
                                            "4 experts top-3")


# ---- from_safetensors -------------------------------------------------------------------------
def per_expert(cfg, params):
    """The hub checkpoint's tensors: Mixtral's block_sparse_moe.gate / experts.N.w1 w3 w2,
    the others' mlp.experts.N.gate_proj / up_proj / down_proj."""
    out = {}
    for name, arr in params.items():
        if ".mlp.experts." not in name:
            if cfg.model_type == "mixtral":
                name = name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
            out[name] = arr
            continue
        p, what = name.split(".mlp.experts.")
        block, (g, u, dn) = (("block_sparse_moe", ("w1", "w3", "w2")) if cfg.model_type == "mixtral"
                             else ("mlp", ("gate_proj", "up_proj", "down_proj")))
        for e in range(arr.shape[0]):
            if what == "gate_up_proj":
                i = arr.shape[1] // 2
                out[f"{p}.{block}.experts.{e}.{g}.weight"] = arr[e, :i]
                out[f"{p}.{block}.experts.{e}.{u}.weight"] = arr[e, i:]
            else:
                out[f"{p}.{block}.experts.{e}.{dn}.weight"] = arr[e]
    return out


def write_folder(path, config, tensors):
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
              str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("mt", list(CONFIGS))
def test_moe_from_safetensors_both_name_styles(models, tmp_path, mt):
    m = models[mt]
    hub = per_expert(m.config, m.params)
    assert not any(".experts.gate_up_proj" in k for k in hub)
    # one expert's gate stored bf16: widened exactly into its rows of the fused weight
    n = 1 if mt == "qwen2_moe" else 0                   # the first sparse layer
    block, gate = ("block_sparse_moe", "w1") if mt == "mixtral" else ("mlp", "gate_proj")
    key = f"model.layers.{n}.{block}.experts.0.{gate}.weight"
    hub[key] = hub[key].astype(ml_dtypes.bfloat16)
    want_hub = dict(m.params)
    fused = f"model.layers.{n}.mlp.experts.gate_up_proj"
    want_hub[fused] = m.params[fused].copy()
    want_hub[fused][0, :hub[key].shape[0]] = hub[key].astype(np.float32)
    for style, tensors, want in (("hub", hub, want_hub), ("fused", m.params, m.params)):
        got = MoeForCausalLM.from_safetensors(write_folder(tmp_path / style, CONFIGS[mt],
                                                           tensors))
        assert got.config == m.config and set(got.params) == set(m.params)
        for k, v in want.items():
            np.testing.assert_array_equal(got.params[k], v, err_msg=f"{style} {k}")


def test_moe_checkpoint_errors(models, tmp_path):
    m = models["mixtral"]
    hub = per_expert(m.config, m.params)
    cfg = CONFIGS["mixtral"]

    def load(tensors, name):
        return MoeForCausalLM.from_safetensors(write_folder(tmp_path / name, cfg, tensors))

    lost = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    gone = {k: v for k, v in hub.items() if k != lost}
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.block_sparse_moe\."
                                         r"experts\.3\.w2\.weight' \(expert 3 of 4 in layer 1\)"):
        load(gone, "gone")
    extra = {**hub, "model.layers.0.block_sparse_moe.experts.4.w1.weight": np.zeros((6, 16),
                                                                                   np.float32)}
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.block_sparse_moe\."
                                         r"experts\.4\.w1\.weight' \(the config has 4 experts\)"):
        load(extra, "extra")
    both = {**hub, "model.layers.0.mlp.experts.down_proj": m.params[
        "model.layers.0.mlp.experts.down_proj"]}
    with pytest.raises(ValueError, match="layer 0 has both per-expert tensors"):
        load(both, "both")
    bad = {**hub, "model.layers.0.block_sparse_moe.experts.1.w3.weight": np.zeros((5, 16),
                                                                                 np.float32)}
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.0\.block_sparse_moe\.experts\.1\."
                                         r"w3\.weight' is float32 \[5, 16\], expected a float "
                                         r"\[6, 16\]"):
        load(bad, "bad")
    no_router = {k: v for k, v in hub.items()
                 if k != "model.layers.0.block_sparse_moe.gate.weight"}
    with pytest.raises(ValueError, match=r"missing tensor\(s\) 'model\.layers\.0\.mlp\.gate\."
                                         r"weight'"):
        load(no_router, "no_router")
    fused = {k: v for k, v in m.params.items() if k != "model.layers.1.mlp.experts.down_proj"}
    with pytest.raises(ValueError, match=r"missing tensor\(s\) 'model\.layers\.1\.mlp\.experts\."
                                         r"down_proj'"):
        load(fused, "fused")
    with pytest.raises(ValueError, match="a mixture-of-experts model .model_type 'mixtral'.; load "
                                         "it with rlx_numba.models.MoeForCausalLM"):
        LlamaForCausalLM.from_safetensors(tmp_path / "fused")


def test_moe_block_gradients_against_finite_differences():
    """The sparse block as build_llama writes it (router softmax, top-k renormalised, rows
    repeated k times, two grouped products over [E, out, in] weights with SwiGLU between,
    the weighted sum) differentiated through g.grad: x, the router and both expert weights
    against central differences of a float64 NumPy oracle (no ties near the top-k cut)."""
    from gradcheck import check
    rng = np.random.default_rng(5)
    t, h, e, i, k = 3, 4, 3, 5, 2
    feed = {"x": rng.standard_normal((t, h)), "router": rng.standard_normal((e, h)),
            "gu": 0.5 * rng.standard_normal((e, 2 * i, h)),
            "down": 0.5 * rng.standard_normal((e, h, i))}
    g = rlx.Graph("moe_grad")
    x, router = g.input("x", (t, h)), g.input("router", (e, h))
    gu, down = g.input("gu", (e, 2 * i, h)), g.input("down", (e, h, i))
    top, ids = g.topk(g.softmax(g.matmul(x, g.transpose(router, (1, 0))), axis=-1), k)
    top = top / g.sum(top, -1, keep_dim=True)
    ids = g.reshape(ids, (t * k,))
    rows = g.reshape(g.expand(g.reshape(x, (t, 1, h)), (t, k, h)), (t * k, h))
    act = g.gated(g.grouped_matmul(rows, gu, ids, trans_w=True), "silu")
    y = g.grouped_matmul(act, down, ids, trans_w=True)
    y = g.sum(g.reshape(y, (t, k, h)) * g.reshape(top, (t, k, 1)), 1)

    def oracle(x, router, gu, down):
        logits = x @ router.T
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        sel = np.argsort(-p, -1, kind="stable")[:, :k]
        out = np.zeros((t, h))
        for r in range(t):
            w = p[r, sel[r]] / p[r, sel[r]].sum()
            for j, ex in enumerate(sel[r]):
                a = gu[ex] @ x[r]
                out[r] += w[j] * (down[ex] @ (np_silu(a[:i]) * a[i:]))
        return out
    check(g, y, {"x": x, "router": router, "gu": gu, "down": down}, feed, oracle,
          seed=rng.standard_normal((t, h)), rtol=1e-3, atol=1e-4)
