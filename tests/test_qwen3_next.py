"""Qwen3NextForCausalLM against a float64 NumPy port of transformers' Qwen3-Next written here
from its modeling code's definitions (the per-key-head in_proj_qkvz / in_proj_ba layout, the
causal depthwise conv + SiLU, the gated delta rule as its naive recurrence, the gated RMSNorm,
the per-head [query, gate] q_proj, partial rope, zero-centred norms, the MoE with its shared
expert): the forward logits, and generate's prefill and decode-step logits against the
oracle's logits of the whole sequence (the KV caches, conv states and recurrent states carried
right). Tiny configs mixing both layer kinds; tests/test_qwen3_next_gpu.py checks transformers
itself on a GPU."""
import json

import numpy as np
import pytest

from rlx_numba.models import Qwen3NextConfig, Qwen3NextForCausalLM
from rlx_numba.models.qwen3_next import graph_param_shapes, graph_params

# layer 0 gated-delta with the MoE (2 value heads a key head), layer 1 attention, dense MLP
CFG_A = dict(vocab_size=37, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, head_dim=8,
             partial_rotary_factor=0.5, layer_types=["linear_attention", "full_attention"],
             linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
             linear_value_head_dim=6, num_experts=3, num_experts_per_tok=2,
             moe_intermediate_size=12, shared_expert_intermediate_size=10, mlp_only_layers=[1],
             rope_theta=1000.0, max_position_embeddings=64)
# attention first (with biases, the MoE), then a gated-delta layer (a key head per value head,
# conv kernel 3) with a dense MLP; tied embeddings
CFG_B = dict(CFG_A, layer_types=["full_attention", "linear_attention"], mlp_only_layers=[1],
             linear_num_key_heads=2, linear_num_value_heads=2, linear_conv_kernel_dim=3,
             attention_bias=True, tie_word_embeddings=True, norm_topk_prob=False,
             num_experts_per_tok=1)


# ---- the oracle --------------------------------------------------------------------------------
def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _silu(x):
    return x / (1 + np.exp(-x))


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def _attention(c, P, p, x):
    b, s, _ = x.shape
    d, hq, hkv, eps = c.head_dim, c.num_attention_heads, c.num_key_value_heads, c.rms_norm_eps

    def proj(name):
        y = x @ P[p + name + ".weight"].T
        return y + P[p + name + ".bias"] if p + name + ".bias" in P else y

    qg = proj("q_proj").reshape(b, s, hq, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(b, s, hq * d)
    k = proj("k_proj").reshape(b, s, hkv, d)
    v = proj("v_proj").reshape(b, s, hkv, d)
    q = _rms(q, 1 + P[p + "q_norm.weight"], eps)
    k = _rms(k, 1 + P[p + "k_norm.weight"], eps)
    rot = int(d * c.partial_rotary_factor)
    inv = 1.0 / c.rope_theta ** (np.arange(0, rot, 2) / rot)
    ang = np.arange(s)[:, None] * inv[None]
    cos = np.cos(np.concatenate([ang, ang], -1))[None, :, None]
    sin = np.sin(np.concatenate([ang, ang], -1))[None, :, None]

    def rope(t):
        r = t[..., :rot]
        half = np.concatenate([-r[..., rot // 2:], r[..., :rot // 2]], -1)
        return np.concatenate([r * cos + half * sin, t[..., rot:]], -1)

    q, k = rope(q), rope(k)
    k, v = (np.repeat(t, hq // hkv, axis=2) for t in (k, v))
    sc = np.einsum("bqhd,bkhd->bhqk", q, k) * d ** -0.5
    sc = np.where(np.tril(np.ones((s, s), bool)), sc, -np.inf)
    pr = np.exp(sc - sc.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    o = np.einsum("bhqk,bkhd->bqhd", pr, v).reshape(b, s, hq * d)
    return proj_out(P, p + "o_proj", o * _sigmoid(gate))


def proj_out(P, name, x):
    y = x @ P[name + ".weight"].T
    return y + P[name + ".bias"] if name + ".bias" in P else y


def _gated_delta(c, P, p, x):
    b, s, _ = x.shape
    nk, nv = c.linear_num_key_heads, c.linear_num_value_heads
    dk, dv, kw = c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel_dim
    r = nv // nk
    qkvz = (x @ P[p + "in_proj_qkvz.weight"].T).reshape(b, s, nk, 2 * dk + 2 * r * dv)
    q, k = qkvz[..., :dk], qkvz[..., dk:2 * dk]
    v = qkvz[..., 2 * dk:2 * dk + r * dv].reshape(b, s, nv, dv)
    z = qkvz[..., 2 * dk + r * dv:].reshape(b, s, nv, dv)
    ba = (x @ P[p + "in_proj_ba.weight"].T).reshape(b, s, nk, 2 * r)
    beta = _sigmoid(ba[..., :r].reshape(b, s, nv))
    a = ba[..., r:].reshape(b, s, nv)
    mixed = np.concatenate([q.reshape(b, s, -1), k.reshape(b, s, -1), v.reshape(b, s, -1)], -1)
    w = P[p + "conv1d.weight"][:, 0]                                   # [channels, kw]
    padded = np.concatenate([np.zeros((b, kw - 1, mixed.shape[2])), mixed], 1)
    conv = _silu(sum(padded[:, j:j + s] * w[:, j] for j in range(kw)))
    q = conv[..., :nk * dk].reshape(b, s, nk, dk)
    k = conv[..., nk * dk:2 * nk * dk].reshape(b, s, nk, dk)
    v = conv[..., 2 * nk * dk:].reshape(b, s, nv, dv)
    g = -np.exp(P[p + "A_log"]) * np.log1p(np.exp(a + P[p + "dt_bias"]))
    q, k = (np.repeat(t, r, axis=2) for t in (q, k))
    q, k = (t / np.sqrt((t * t).sum(-1, keepdims=True) + 1e-6) for t in (q, k))
    q = q * dk ** -0.5
    state = np.zeros((b, nv, dk, dv))
    o = np.zeros((b, s, nv, dv))
    for t in range(s):                 # fla's naive recurrence
        state = state * np.exp(g[:, t])[..., None, None]
        mem = np.einsum("bhkv,bhk->bhv", state, k[:, t])
        delta = (v[:, t] - mem) * beta[:, t][..., None]
        state = state + np.einsum("bhk,bhv->bhkv", k[:, t], delta)
        o[:, t] = np.einsum("bhkv,bhk->bhv", state, q[:, t])
    o = _rms(o, P[p + "norm.weight"], c.rms_norm_eps) * _silu(z)
    return o.reshape(b, s, nv * dv) @ P[p + "out_proj.weight"].T


def _swiglu(x, gate, up, down):
    return (_silu(x @ gate.T) * (x @ up.T)) @ down.T


def _moe(c, P, p, x):
    xt = x.reshape(-1, x.shape[-1])
    lg = xt @ P[p + "gate.weight"].T
    pr = np.exp(lg - lg.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    top = np.argsort(-pr, -1, kind="stable")[:, :c.num_experts_per_tok]
    wt = np.take_along_axis(pr, top, -1)
    if c.norm_topk_prob:
        wt /= wt.sum(-1, keepdims=True)
    mi = c.moe_intermediate_size
    gu, dn = P[p + "experts.gate_up_proj"], P[p + "experts.down_proj"]
    y = np.zeros_like(xt)
    for t in range(len(xt)):
        for e, we in zip(top[t], wt[t]):
            y[t] += we * _swiglu(xt[t], gu[e, :mi], gu[e, mi:], dn[e])
    se = p + "shared_expert."
    y += _sigmoid(xt @ P[p + "shared_expert_gate.weight"].T) * _swiglu(
        xt, P[se + "gate_proj.weight"], P[se + "up_proj.weight"], P[se + "down_proj.weight"])
    return y.reshape(x.shape)


def oracle_logits(cfg, params, ids):
    P = {k: v.astype(np.float64) for k, v in params.items()}
    eps = cfg.rms_norm_eps
    h = P["model.embed_tokens.weight"][ids]
    for n, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{n}."
        x = _rms(h, 1 + P[p + "input_layernorm.weight"], eps)
        h = h + (_gated_delta(cfg, P, p + "linear_attn.", x) if kind == "linear_attention"
                 else _attention(cfg, P, p + "self_attn.", x))
        x = _rms(h, 1 + P[p + "post_attention_layernorm.weight"], eps)
        sparse = cfg.num_experts and n not in cfg.mlp_only_layers
        h = h + (_moe(cfg, P, p + "mlp.", x) if sparse else _swiglu(
            x, P[p + "mlp.gate_proj.weight"], P[p + "mlp.up_proj.weight"],
            P[p + "mlp.down_proj.weight"]))
    h = _rms(h, 1 + P["model.norm.weight"], eps)
    return h @ P.get("lm_head.weight", P["model.embed_tokens.weight"]).T


def _close(got, want, what):
    # f32 end to end through ~20 products of length <= 32 and two recurrences: a few hundred
    # unit roundoffs (2^-24) of the largest logit
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 2e-5, f"{what}: max |diff| / max |logit| = {err:.2e}"


# ---- tests -------------------------------------------------------------------------------------
def test_forward_matches_numpy():
    cfg = Qwen3NextConfig(**CFG_A)
    m = Qwen3NextForCausalLM.from_config(cfg, seed=1, std=0.3)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 6)
    _close(m(ids), oracle_logits(cfg, m.params, ids[None])[0], "forward logits")


def test_generate_carries_the_states():
    """Prompts of 4 and 2 tokens (the second left-padded: its pads masked from attention and
    zeroed before the gated-delta layer, whose conv window of 2 then holds them), prefill, then
    2 decode steps: each step's logits are the oracle's over that row's own sequence at that
    position (conv window, recurrent state and KV cache carried), the ids their argmax."""
    cfg = Qwen3NextConfig(**CFG_B)
    m = Qwen3NextForCausalLM.from_config(cfg, seed=2, std=0.3)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, cfg.vocab_size, n) for n in (4, 2)]
    out, logits = m.generate(prompts, 3, output_logits=True)
    for p, row, lg in zip(prompts, out, logits):
        assert row.dtype == np.int64 and row.shape == (len(p) + 3,) and lg.shape == (3, 37)
        np.testing.assert_array_equal(row[:len(p)], p)
        want = oracle_logits(cfg, m.params, row[None, :-1])[0, len(p) - 1:]
        _close(lg, want, f"prefill + decode logits of the {len(p)}-token prompt")
        np.testing.assert_array_equal(row[len(p):], want.argmax(-1))


def test_graph_params_regroup_the_projections():
    """The host-side regrouping (graph_params) against the layouts it is read with: q_proj's
    per-head [query, gate] rows, in_proj_qkvz / in_proj_ba's per-key-head groups."""
    cfg = Qwen3NextConfig(**CFG_A)
    m = Qwen3NextForCausalLM.from_config(cfg, seed=4)
    gp = graph_params(cfg, m.params)
    assert {k: v.shape for k, v in gp.items()} == graph_param_shapes(cfg)
    P, d = m.params, cfg.head_dim
    qkvg = gp["model.layers.1.self_attn.qkvg_proj.weight"]
    q = P["model.layers.1.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(qkvg[d:2 * d], q[2 * d:3 * d])              # head 1's query
    np.testing.assert_array_equal(qkvg[-2 * d:-d], q[d:2 * d])                 # head 0's gate
    np.testing.assert_array_equal(qkvg[2 * d:3 * d], P["model.layers.1.self_attn.k_proj.weight"])
    inp = gp["model.layers.0.linear_attn.in_proj.weight"]
    qkvz = P["model.layers.0.linear_attn.in_proj_qkvz.weight"]
    ba = P["model.layers.0.linear_attn.in_proj_ba.weight"]
    # one key head: [q 8, k 8, v 2x6, z 2x6] -> q | k | v | z, then [b 2, a 2] -> b | a
    np.testing.assert_array_equal(inp[:40], qkvz)
    np.testing.assert_array_equal(inp[40:], ba)
    np.testing.assert_array_equal(gp["model.norm.gain"], 1 + P["model.norm.weight"])
    np.testing.assert_allclose(gp["model.layers.0.linear_attn.A"],
                               -np.exp(P["model.layers.0.linear_attn.A_log"]), rtol=1e-6)


def test_graph_params_two_key_heads():
    cfg = Qwen3NextConfig(**dict(CFG_A, linear_num_key_heads=2, linear_num_value_heads=4))
    P = Qwen3NextForCausalLM.from_config(cfg, seed=5).params
    inp = graph_params(cfg, P)["model.layers.0.linear_attn.in_proj.weight"]
    grp = P["model.layers.0.linear_attn.in_proj_qkvz.weight"].reshape(2, 40, 32)
    ba = P["model.layers.0.linear_attn.in_proj_ba.weight"].reshape(2, 4, 32)
    want = np.concatenate([grp[:, :8].reshape(-1, 32), grp[:, 8:16].reshape(-1, 32),
                           grp[:, 16:28].reshape(-1, 32), grp[:, 28:].reshape(-1, 32),
                           ba[:, :2].reshape(-1, 32), ba[:, 2:].reshape(-1, 32)])
    np.testing.assert_array_equal(inp, want)


def test_config_from_transformers_dicts():
    """transformers 4.x (top-level rope_theta / partial_rotary_factor, full_attention_interval)
    and 5.x (rope_parameters, layer_types) config dicts give the same config."""
    base = {k: v for k, v in CFG_A.items()
            if k not in ("layer_types", "rope_theta", "partial_rotary_factor")}
    base.update(num_hidden_layers=4, mlp_only_layers=[], model_type="qwen3_next",
                hidden_act="silu", initializer_range=0.02, router_aux_loss_coef=0.001)
    v4 = Qwen3NextConfig.from_dict(dict(base, rope_theta=1e6, partial_rotary_factor=0.25,
                                        full_attention_interval=2, rope_scaling=None))
    v5 = Qwen3NextConfig.from_dict(dict(
        base, layer_types=["linear_attention", "full_attention"] * 2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                         "partial_rotary_factor": 0.25}))
    assert v4 == v5
    assert v4.layer_types == ["linear_attention", "full_attention"] * 2
    assert v4.rope_theta == 1e6 and v4.rotary_dim == 2
    c = Qwen3NextConfig(**{k: v for k, v in CFG_A.items()
                           if k not in ("layer_types", "num_hidden_layers")},
                        num_hidden_layers=8)         # transformers' default interval: 4
    assert c.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert Qwen3NextConfig().rotary_dim == 64


def test_from_safetensors_stacks_per_expert_tensors(tmp_path):
    """A transformers 4.x checkpoint (per-expert tensors, an mtp.* head, a rotary buffer) loads
    by name."""
    from safetensors.numpy import save_file
    cfg = Qwen3NextConfig(**CFG_A)
    P = Qwen3NextForCausalLM.from_config(cfg, seed=6).params
    disk = {k: v for k, v in P.items() if ".experts." not in k}
    p, mi = "model.layers.0.mlp.experts.", cfg.moe_intermediate_size
    for e in range(cfg.num_experts):
        gu = P[p + "gate_up_proj"][e]
        disk[f"{p}{e}.gate_proj.weight"] = np.ascontiguousarray(gu[:mi])
        disk[f"{p}{e}.up_proj.weight"] = np.ascontiguousarray(gu[mi:])
        disk[f"{p}{e}.down_proj.weight"] = P[p + "down_proj"][e]
    disk["mtp.fc.weight"] = np.zeros((2, 2), np.float32)
    disk["model.rotary_emb.inv_freq"] = np.ones(2, np.float32)
    save_file(disk, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg.to_dict(), hidden_act="silu")))
    m = Qwen3NextForCausalLM.from_safetensors(tmp_path)
    assert m.config == cfg and set(m.params) == set(P)
    for k in P:
        np.testing.assert_array_equal(m.params[k], P[k])


@pytest.mark.parametrize("change, match", [
    (dict(layer_types=["linear_attention"]), "one type per layer"),
    (dict(layer_types=["linear_attention", "sliding_attention"]), "'sliding_attention'"),
    (dict(linear_num_key_heads=2, linear_num_value_heads=3), "multiple of linear_num_key_heads"),
    (dict(num_key_value_heads=3), "multiple of num_key_value_heads"),
    (dict(partial_rotary_factor=0.1), "rotary dims"),
    (dict(num_experts_per_tok=4), "exceeds num_experts"),
    (dict(mlp_only_layers=[2]), "mlp_only_layers"),
    (dict(hidden_size=0), "hidden_size must be an int >= 1"),
    (dict(layer_types=None, full_attention_interval=0), "full_attention_interval must be"),
])
def test_config_errors(change, match):
    with pytest.raises(ValueError, match=match):
        Qwen3NextConfig(**dict(CFG_A, **change))


def test_errors():
    with pytest.raises(ValueError, match="model_type is 'llama'"):
        Qwen3NextConfig.from_dict(dict(CFG_A, model_type="llama"))
    with pytest.raises(ValueError, match="rope scaling 'yarn'"):
        Qwen3NextConfig.from_dict(dict(CFG_A, rope_scaling={"rope_type": "yarn"}))
    cfg = Qwen3NextConfig(**CFG_A)
    m = Qwen3NextForCausalLM.from_config(cfg)
    params = dict(m.params)
    params.pop("model.layers.0.linear_attn.A_log")
    with pytest.raises(ValueError, match="missing tensor.*linear_attn.A_log"):
        Qwen3NextForCausalLM(cfg, params)
    with pytest.raises(ValueError, match="max_seq_len must be in \\[6, 64\\]"):
        m.generate(np.zeros((1, 4), np.int64), 3, max_seq_len=5)
    with pytest.raises(ValueError, match="token ids must be in \\[0, 37\\)"):
        m.generate(np.array([[1, 37]]), 2)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int"):
        m.generate(np.array([[1, 2]]), 0)
    with pytest.raises(ValueError, match="exec_mode must be"):
        Qwen3NextForCausalLM(cfg, m.params, exec_mode="eager")
