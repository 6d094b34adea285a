"""GPU acceptance of MoeForCausalLM against transformers (torch and transformers are on the GPU
image; never dependencies): OlmoeForCausalLM, Qwen2MoeForCausalLM and MixtralForCausalLM built
from small configs with random weights (f32, eager attention), saved with save_pretrained and
loaded with MoeForCausalLM.from_safetensors; the last position's logits agree within 1e-3 of
the largest |logit| and 32 greedy tokens equal transformers' generate(do_sample=False).
Skipped under the simulator (and without torch / transformers)."""
import numpy as np
import pytest

import rlx_numba as rlx

pytestmark = pytest.mark.skipif(rlx.simulator_enabled(), reason="needs a GPU, torch and "
                                                                 "transformers")
torch = pytest.importorskip("torch") if not rlx.simulator_enabled() else None
transformers = pytest.importorskip("transformers") if not rlx.simulator_enabled() else None

from rlx_numba.models import MoeForCausalLM  # noqa: E402

COMMON = dict(vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=False)
# an expert's intermediate size 96: no two of the expert weights' dims are equal (2 * 96 != 256),
# so a layout other than [E, 2I, H] / [E, H, I] fails the shape check instead of loading
MODELS = {
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(intermediate_size=96, num_experts=8, num_experts_per_tok=2)),
    # layer 1 dense; the others sparse with the shared expert
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(intermediate_size=256, moe_intermediate_size=96,
                       shared_expert_intermediate_size=160, num_experts=8,
                       num_experts_per_tok=2, mlp_only_layers=[1])),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=96, num_local_experts=8, num_experts_per_tok=2)),
}


def _init(model, seed):
    """Weights spread wider than transformers' init (std 0.02), so that the router's top-k
    and the greedy picks are far from ties: norm gains 1 + N(0, 0.1), routers N(0, 0.5),
    everything else N(0, 0.08)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.08)


@pytest.mark.parametrize("mt", list(MODELS))
def test_moe_matches_transformers(tmp_path, mt):
    from safetensors import safe_open
    torch.backends.cuda.matmul.allow_tf32 = False       # f32 products on both sides
    torch.backends.cudnn.allow_tf32 = False
    conf_cls, model_cls, extra = MODELS[mt]
    cfg = getattr(transformers, conf_cls)(**COMMON, **extra)
    cfg._attn_implementation = "eager"
    hf = getattr(transformers, model_cls)(cfg).float()
    _init(hf, 0)
    hf = hf.cuda().eval()
    hf.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
        names = sorted(k for k in f.keys() if k.startswith("model.layers.0."))
        shapes = {k: f.get_slice(k).get_shape() for k in names}
    print(f"\n{mt} (transformers {transformers.__version__}) saved layer 0 as:")
    for k in names:
        print(f"  {k} {shapes[k]}")

    ours = MoeForCausalLM.from_safetensors(tmp_path)
    assert ours.config.model_type == mt and ours.config.num_experts == 8
    rng = np.random.default_rng(1)
    ids = rng.integers(0, COMMON["vocab_size"], (2, 13))
    with torch.no_grad():
        want = hf(input_ids=torch.from_numpy(ids).cuda()).logits[:, -1].double().cpu().numpy()
    got = ours(ids)[:, -1].astype(np.float64)
    rel = np.abs(got - want).max() / np.abs(want).max()
    print(f"{mt}: last-position logits, max |diff| / max |logit| = {rel:.2e}")
    assert rel <= 1e-3, rel

    prompt = ids[:, :7]
    hf.generation_config.eos_token_id = None          # random weights: never stop early
    hf.generation_config.pad_token_id = 0
    with torch.no_grad():
        ref = hf.generate(torch.from_numpy(prompt).cuda(), max_new_tokens=32,
                          do_sample=False).cpu().numpy()
    out = ours.generate(prompt, 32)
    np.testing.assert_array_equal(out, ref)
