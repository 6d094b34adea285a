"""Training on a real GPU against torch autograd (torch is on the GPU image; never a dependency):
every gradient of a small Llama (two transformer blocks: embedding gather, rms_norm, q/k/v/o
and gate/up/down products, RoPE, causal GQA attention, SwiGLU, tied head, cross-entropy with
ignored labels) against transformers' LlamaForCausalLM within 1e-4 relative, f32 on both
sides; then the same tiny Llama (2 layers, hidden 64) trained 200 AdamW steps from the same
init on the same batches: the loss curves agree within 1e-3 relative at every step; and the
same 200 steps in bf16 mixed precision (ours precision="bf16", torch under autocast bf16) within
2% at every step.

Skipped under the simulator (no torch, and 200 steps of a Llama there take hours); the
simulator's own checks of every VJP against finite differences are the other test_*grad files.
"""
import numpy as np
import pytest

import rlx_numba as rlx

pytestmark = pytest.mark.skipif(rlx.simulator_enabled(), reason="needs a GPU and torch")
torch = pytest.importorskip("torch") if not rlx.simulator_enabled() else None
transformers = pytest.importorskip("transformers") if not rlx.simulator_enabled() else None

from rlx_numba.models import LlamaConfig, LlamaForCausalLM  # noqa: E402
from test_llama_train import train_graph_grads  # noqa: E402

CFG = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)


def _hf(model):
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from bench_models import hf_llama_config, load_torch
    torch.backends.cuda.matmul.allow_tf32 = False       # f32 products on both sides
    torch.backends.cudnn.allow_tf32 = False
    cfg = {k: getattr(CFG, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                        "num_hidden_layers", "num_attention_heads",
                                        "num_key_value_heads", "max_position_embeddings",
                                        "rope_theta", "rms_norm_eps", "tie_word_embeddings")}
    hfc = hf_llama_config(transformers, cfg)
    hfc._attn_implementation = "eager"
    return load_torch(torch, transformers.LlamaForCausalLM(hfc), model.params).cuda().train()


def _rel(a, b):
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def test_every_gradient_of_a_llama_matches_torch_autograd():
    rng = np.random.default_rng(0)
    model = LlamaForCausalLM.from_config(CFG, seed=1, std=0.1)
    b, s = 3, 17
    ids = rng.integers(0, CFG.vocab_size, (b, s))
    labels = ids.copy()
    labels[1, 4:7] = -100
    loss, ours = train_graph_grads(CFG, model.params, ids, labels)

    hf = _hf(model)
    tl = hf(input_ids=torch.from_numpy(ids).cuda(), labels=torch.from_numpy(labels).cuda(),
            use_cache=False).loss
    tl.backward()
    assert _rel(np.float64(loss), tl.item()) <= 1e-5
    want = {k: p.grad.detach().cpu().numpy() for k, p in hf.named_parameters()}
    assert set(ours) == set(want), (set(ours) ^ set(want))
    worst = {k: _rel(ours[k], want[k]) for k in want}
    bad = {k: r for k, r in worst.items() if r > 1e-4}
    assert not bad, bad


def _batches(b, s, steps):
    """``steps`` [b, s] windows of a corpus with structure (repeated random phrases), so the
    loss falls well below log(V)."""
    rng = np.random.default_rng(7)
    phrases = rng.integers(0, CFG.vocab_size, (12, 8))
    corpus = phrases[rng.integers(0, len(phrases), 4000)].reshape(-1)
    starts = rng.integers(0, corpus.size - s, (steps, b))
    return [np.stack([corpus[i:i + s] for i in row]) for row in starts]


def _torch_curve(hf, batches, lr, wd, half=None):
    opt = torch.optim.AdamW(hf.parameters(), lr=lr, weight_decay=wd)
    tcurve = []
    for x in batches:
        t = torch.from_numpy(x).cuda()
        with torch.autocast("cuda", half or torch.float32, enabled=half is not None):
            loss = hf(input_ids=t, labels=t, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        tcurve.append(loss.item())
    return tcurve


def test_tiny_llama_200_adamw_steps_match_torch():
    model = LlamaForCausalLM.from_config(CFG, seed=2, std=0.05)
    b, s, steps, lr, wd = 4, 32, 200, 3e-3, 0.01
    batches = _batches(b, s, steps)
    hf = _hf(model)
    tcurve = _torch_curve(hf, batches, lr, wd)
    tr = model.trainer(b, s, rlx.optim.AdamW(lr=lr, weight_decay=wd))
    curve = [tr.step(x) for x in batches]
    rel = np.abs(np.array(curve) - tcurve) / np.abs(tcurve)
    assert tcurve[-1] < 0.6 * tcurve[0], tcurve[::20]         # it trained
    assert rel.max() <= 1e-3, (int(rel.argmax()), rel.max(), curve[::20], tcurve[::20])
    # the model's weights after the trainer's steps, against torch's
    tr.update_model()
    for k, p in hf.named_parameters():
        assert _rel(model.params[k], p.detach().cpu().numpy()) <= 1e-2, k


def test_tiny_llama_200_bf16_adamw_steps_track_torch_autocast():
    """Mixed precision: f32 masters and AdamW state on both sides, the forward and backward in
    bf16 (ours: compile_train's precision="bf16"; torch: autocast bf16)."""
    model = LlamaForCausalLM.from_config(CFG, seed=2, std=0.05)
    # lr 1e-3, not the f32 test's 3e-3: at 3e-3 this run turns chaotic past step ~80 under bf16
    # rounding, and torch against itself (autocast bf16 with sdpa vs eager attention) differs
    # by 17% at step 159 (H200); at 1e-3 those two agree within 0.3%, as do we.
    b, s, steps, lr, wd = 4, 32, 200, 1e-3, 0.01
    batches = _batches(b, s, steps)
    tcurve = _torch_curve(_hf(model), batches, lr, wd, torch.bfloat16)
    tr = model.trainer(b, s, rlx.optim.AdamW(lr=lr, weight_decay=wd), precision="bf16")
    curve = [tr.step(x) for x in batches]
    rel = np.abs(np.array(curve) - tcurve) / np.abs(tcurve)
    assert tcurve[-1] < 0.6 * tcurve[0], tcurve[::20]         # it trained
    assert rel.max() <= 2e-2, (int(rel.argmax()), rel.max(), curve[::20], tcurve[::20])
