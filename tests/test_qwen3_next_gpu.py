"""GPU acceptance of Qwen3NextForCausalLM against transformers' Qwen3NextForCausalLM (torch and
transformers are on the GPU image; never dependencies): a small hybrid config (gated-delta and
attention layers, MoE and dense MLPs) with random weights, f32, eager attention and
transformers' torch implementations of the gated delta rule and the conv (fla / causal-conv1d
kernels, when installed, are swapped out: the reference is transformers' own torch code, TF32
off), saved with save_pretrained and loaded with Qwen3NextForCausalLM.from_safetensors. The
logits of every position agree within 1e-4 of the largest |logit|; 16 greedy tokens equal
transformers' generate(do_sample=False); a ragged batch and the CUDA-graph decode give the same
tokens. Skipped under the simulator (and without torch / a transformers with Qwen3-Next)."""
import sys
from pathlib import Path

import numpy as np
import pytest

import rlx_numba as rlx

pytestmark = pytest.mark.skipif(rlx.simulator_enabled(), reason="needs a GPU, torch and "
                                                                 "transformers")
torch = pytest.importorskip("torch") if not rlx.simulator_enabled() else None
transformers = pytest.importorskip("transformers") if not rlx.simulator_enabled() else None

from rlx_numba.models import Qwen3NextForCausalLM  # noqa: E402

# layers: gated-delta (MoE), attention (dense: mlp_only_layers), gated-delta (MoE), attention
# (MoE); 2 value heads a key head; rotary over a quarter of head_dim (transformers' default)
SMALL = dict(vocab_size=1000, hidden_size=128, intermediate_size=160, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             layer_types=["linear_attention", "full_attention"] * 2,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
             linear_value_head_dim=24, linear_conv_kernel_dim=4, num_experts=8,
             num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=64,
             mlp_only_layers=[1], max_position_embeddings=256, tie_word_embeddings=False)


def build_hf(seed=0, **over):
    """transformers' model of SMALL (bench_models.hf_qwen3next: f32, eager attention, torch
    paths, weights spread wider than its init, so that routing and greedy picks are far from
    ties)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from bench_models import hf_qwen3next
    hf = hf_qwen3next(torch, transformers, seed, dict(SMALL, **over))
    print(f"\ntransformers {transformers.__version__}: the torch code paths of its gated-delta "
          f"layers (fla / causal-conv1d swapped out where installed)")
    return hf


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    if not hasattr(transformers, "Qwen3NextForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no Qwen3NextForCausalLM")
    torch.backends.cuda.matmul.allow_tf32 = False       # f32 products on both sides
    torch.backends.cudnn.allow_tf32 = False
    hf = build_hf()
    path = tmp_path_factory.mktemp("qwen3next")
    hf.save_pretrained(path)
    from safetensors import safe_open
    with safe_open(str(path / "model.safetensors"), framework="numpy") as f:
        names = sorted(k for k in f.keys() if k.startswith(("model.layers.0.",
                                                            "model.layers.1.")))
        print("saved layers 0 and 1 as:")
        for k in names:
            print(f"  {k} {f.get_slice(k).get_shape()}")
    return hf, Qwen3NextForCausalLM.from_safetensors(path)


def test_logits_match_transformers(pair):
    hf, ours = pair
    assert ours.config.layer_types == SMALL["layer_types"]
    assert ours.config.rotary_dim == 8                 # 32 x transformers' default 0.25
    ids = np.random.default_rng(1).integers(0, SMALL["vocab_size"], (2, 19))
    with torch.no_grad():
        want = hf(input_ids=torch.from_numpy(ids).cuda()).logits.double().cpu().numpy()
    got = ours(ids).astype(np.float64)
    rel = np.abs(got - want).max() / np.abs(want).max()
    print(f"logits [2, 19, 1000]: max |diff| / max |logit| = {rel:.2e}")
    assert rel <= 1e-4, rel


def test_greedy_tokens_match_transformers(pair):
    hf, ours = pair
    prompt = np.random.default_rng(2).integers(0, SMALL["vocab_size"], (2, 7))
    hf.generation_config.eos_token_id = None            # random weights: never stop early
    hf.generation_config.pad_token_id = 0
    with torch.no_grad():
        ref = hf.generate(torch.from_numpy(prompt).cuda(), max_new_tokens=16,
                          do_sample=False).cpu().numpy()
    out = ours.generate(prompt, 16)
    print(f"ours  {out[:, 7:].tolist()}\nthem  {ref[:, 7:].tolist()}")
    np.testing.assert_array_equal(out, ref)
    graph = Qwen3NextForCausalLM(ours.config, ours.params, exec_mode="graph")
    np.testing.assert_array_equal(graph.generate(prompt, 16), ref)     # CUDA-graph decode


def test_ragged_prompts_generate_as_alone(pair):
    """Left-padded rows (pad columns masked from attention, zeroed before the gated-delta
    layers) give transformers' tokens for each prompt alone."""
    hf, ours = pair
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, SMALL["vocab_size"], n) for n in (3, 9, 6)]
    got = ours.generate(prompts, 12)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    for p, row in zip(prompts, got):
        with torch.no_grad():
            ref = hf.generate(torch.from_numpy(p[None]).cuda(), max_new_tokens=12,
                              do_sample=False).cpu().numpy()[0]
        np.testing.assert_array_equal(row, ref)


def test_bf16_model_near_transformers_f32(pair):
    """dtype="bf16" (weights and activations bf16, f32 math inside the kernels) is as close to
    transformers' f32 logits as transformers' own bf16 model is: the same rounding of the
    same weights, so the two errors are of one size (a top-k routing flip near a tie moves
    both). Bound: twice torch's bf16 error, floored at 2^-7 (a few bf16 ulps)."""
    import copy
    hf, ours = pair
    half = Qwen3NextForCausalLM(ours.config, ours.params, dtype="bf16")
    ids = np.random.default_rng(4).integers(0, SMALL["vocab_size"], (2, 11))
    with torch.no_grad():
        x = torch.from_numpy(ids).cuda()
        want = hf(input_ids=x).logits.double().cpu().numpy()
        hf16 = copy.deepcopy(hf).to(torch.bfloat16)
        theirs = hf16(input_ids=x).logits.double().cpu().numpy()
    scale = np.abs(want).max()
    rel, torch_rel = (np.abs(half(ids) - want).max() / scale,
                      np.abs(theirs - want).max() / scale)
    print(f"bf16 logits: max |diff| / max |logit| = {rel:.2e} (transformers bf16: "
          f"{torch_rel:.2e})")
    assert rel <= max(2 * torch_rel, 2.0 ** -7), (rel, torch_rel)
