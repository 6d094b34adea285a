"""MambaForCausalLM against a NumPy Mamba written here (transformers' slow path), greedy
generation through the recurrent states against the full forward, safetensors loading, and
(on the GPU) against transformers' MambaForCausalLM."""
import json

import numpy as np
import pytest

from conftest import ON_GPU
from rlx_numba.models.mamba import MambaConfig, MambaForCausalLM, mamba_param_shapes

TINY = MambaConfig(vocab_size=23, hidden_size=8, state_size=3, num_hidden_layers=2,
                   conv_kernel=3, expand=2, time_step_rank=2)


def np_mamba(cfg, P, ids):
    """transformers' MambaMixer.slow_forward, layer by layer, in float64."""
    P = {k: v.astype(np.float64) for k, v in P.items()}
    di, n, r, k = cfg.intermediate_size, cfg.state_size, cfg.time_step_rank, cfg.conv_kernel
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    rms = lambda v, w: v / np.sqrt((v * v).mean(-1, keepdims=True) + cfg.layer_norm_epsilon) * w  # noqa: E731
    h = P["backbone.embeddings.weight"][ids]                       # [b, s, d]
    b, s = ids.shape
    for i in range(cfg.num_hidden_layers):
        p = f"backbone.layers.{i}.mixer."
        xz = rms(h, P[f"backbone.layers.{i}.norm.weight"]) @ P[p + "in_proj.weight"].T
        x, z = xz[..., :di].transpose(0, 2, 1), xz[..., di:].transpose(0, 2, 1)   # [b, di, s]
        xp = np.concatenate([np.zeros((b, di, k - 1)), x], 2)
        w = P[p + "conv1d.weight"][:, 0]
        xc = np.stack([(xp[:, :, t:t + k] * w).sum(-1) for t in range(s)], 2)
        xc = silu(xc + P[p + "conv1d.bias"][:, None])
        dbl = xc.transpose(0, 2, 1) @ P[p + "x_proj.weight"].T
        dt = dbl[..., :r] @ P[p + "dt_proj.weight"].T + P[p + "dt_proj.bias"]
        dt = np.log1p(np.exp(dt)).transpose(0, 2, 1)                # [b, di, s]
        Bm, Cm = dbl[..., r:r + n], dbl[..., r + n:]                # [b, s, n]
        A = -np.exp(P[p + "A_log"])
        st = np.zeros((b, di, n))
        ys = []
        for t in range(s):
            st = np.exp(dt[:, :, t, None] * A) * st + (dt[:, :, t] * xc[:, :, t])[..., None] \
                * Bm[:, None, t]
            ys.append((st * Cm[:, None, t]).sum(-1))
        y = (np.stack(ys, 2) + xc * P[p + "D"][:, None]) * silu(z)
        h = h + y.transpose(0, 2, 1) @ P[p + "out_proj.weight"].T
    h = rms(h, P["backbone.norm_f.weight"])
    return h @ P["backbone.embeddings.weight"].T


def test_mamba_logits_against_numpy(rng):
    model = MambaForCausalLM.from_config(TINY, seed=3)
    ids = rng.integers(0, TINY.vocab_size, (2, 7))
    got = model.logits(ids)
    want = np_mamba(TINY, model.params, ids)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())
    np.testing.assert_allclose(model.logits(ids[1]), got[1], rtol=1e-5, atol=1e-6)


def test_mamba_generate_uses_the_states(rng):
    """Greedy decoding through prefill + decode steps equals re-running the whole forward
    each step (a prompt shorter than the conv window included). Three new tokens: the
    prefill's, then two decode steps, the second reading the states the first wrote."""
    model = MambaForCausalLM.from_config(TINY, seed=5)
    for prompt in (rng.integers(0, TINY.vocab_size, (2, 5)), np.array([[4], [9]])):
        out = model.generate(prompt, max_new_tokens=3)
        seq = prompt
        for _ in range(3):
            nxt = np.argmax(np_mamba(TINY, model.params, seq)[:, -1], -1)[:, None]
            seq = np.concatenate([seq, nxt], 1)
        np.testing.assert_array_equal(out, seq)


def test_mamba_from_safetensors(tmp_path, rng):
    pytest.importorskip("safetensors")
    from safetensors.numpy import save_file
    ref = MambaForCausalLM.from_config(TINY, seed=1)
    save_file(dict(ref.params, **{"lm_head.weight": ref.params["backbone.embeddings.weight"]}),
              str(tmp_path / "model.safetensors"))
    hf = {"model_type": "mamba", "vocab_size": 23, "hidden_size": 8, "state_size": 3,
          "num_hidden_layers": 2, "conv_kernel": 3, "expand": 2, "time_step_rank": 2,
          "layer_norm_epsilon": 1e-5, "use_bias": False, "use_conv_bias": True,
          "tie_word_embeddings": True, "intermediate_size": 16}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    model = MambaForCausalLM.from_safetensors(tmp_path)
    ids = rng.integers(0, 23, (1, 4))
    np.testing.assert_allclose(model.logits(ids), ref.logits(ids), rtol=1e-6, atol=1e-6)


def test_mamba_errors():
    with pytest.raises(ValueError, match="MambaConfig: hidden_size must be a positive int"):
        MambaConfig(hidden_size=0)
    model = MambaForCausalLM.from_config(TINY)
    with pytest.raises(ValueError, match=r"MambaForCausalLM.logits: token ids must be in \[0, 23\)"):
        model.logits(np.array([[1, 23]]))
    shapes = mamba_param_shapes(TINY)
    bad = {k: np.zeros(v, np.float32) for k, v in shapes.items()}
    bad["backbone.layers.0.mixer.A_log"] = np.zeros((16, 4), np.float32)
    with pytest.raises(ValueError, match="A_log"):
        MambaForCausalLM(TINY, bad)


@pytest.mark.skipif(not ON_GPU, reason="transformers' Mamba on the GPU image")
def test_mamba_against_transformers(rng):
    """mamba-130m's config with random weights: logits within 1e-3 relative, 32 greedy tokens
    equal (transformers' slow path: no mamba_ssm kernels on the image)."""
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    cfg = tf.MambaConfig(vocab_size=50280, hidden_size=768, state_size=16, num_hidden_layers=24,
                         conv_kernel=4, expand=2, layer_norm_epsilon=1e-5)
    torch.manual_seed(0)
    ref = tf.MambaForCausalLM(cfg).eval().cuda()
    params = {k: v.detach().float().cpu().numpy() for k, v in ref.state_dict().items()}
    params.pop("lm_head.weight", None)
    ours = MambaForCausalLM(MambaConfig.from_hf(cfg.to_dict()), params)
    ids = rng.integers(0, 50280, (1, 24))
    with torch.no_grad():
        want = ref(torch.tensor(ids, device="cuda")).logits.float().cpu().numpy()
        gen = ref.generate(torch.tensor(ids, device="cuda"), max_new_tokens=32, do_sample=False,
                           min_new_tokens=32).cpu().numpy()
    got = ours.logits(ids)
    assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max()
    np.testing.assert_array_equal(ours.generate(ids, max_new_tokens=32), gen[:, :24 + 32])
