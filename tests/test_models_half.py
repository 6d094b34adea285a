"""Models with dtype="bf16" / "f16" against the same models (same weights) in f32.

A half model rounds its weights, its activations after every op and its KV cache to the
dtype, computing inside each kernel in f32; through tiny layers its outputs stay within a
few dozen unit roundoffs of the f32 model's (relative to the largest value), and they differ
from them by more than f32 noise (the half path really ran).
"""
import numpy as np
import pytest

from halfref import UNIT
from rlx_numba.models import (BertConfig, BertModel, LlamaConfig, LlamaForCausalLM, ResNet,
                              ResNetConfig, ViT, ViTConfig)

pytest.importorskip("tokenizers")

LLAMA = LlamaConfig(vocab_size=53, hidden_size=32, intermediate_size=44, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                    rope_theta=500.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
BERT = BertConfig(vocab_size=41, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                  intermediate_size=44, max_position_embeddings=24, type_vocab_size=2,
                  layer_norm_eps=1e-12)


def rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.abs(got - want).max() / np.abs(want).max()


def check(got, want, dtype, k=48):
    """Within k u of the f32 model, and not equal to it to f32 precision."""
    assert np.asarray(got).dtype == np.float32          # model methods return f32
    e = rel(got, want)
    assert e < k * UNIT[dtype], f"{dtype}: relative error {e:.3g} > {k} u"
    assert e > UNIT[dtype] / 64, f"{dtype}: {e:.3g}: no half rounding happened"


@pytest.fixture(scope="module")
def llama32():
    return LlamaForCausalLM.from_config(LLAMA, seed=7, std=0.3)


def test_llama_half_logits_and_greedy_tokens(llama32, dtype="bf16"):
    # (bf16 here, f16 in the BERT test: the simulator's compiles of these graphs are slow)
    m = LlamaForCausalLM(LLAMA, llama32.params, dtype=dtype)
    ids = np.array([[3, 17, 52, 0, 9], [41, 4, 4, 28, 1]])
    check(m(ids), llama32(ids), dtype)
    # greedy decode through the half KV cache picks the f32 model's tokens (std 0.3: the
    # logits are far apart): the prefill's token, then two decode steps (the second reads a
    # cache row the first wrote); a decode step costs the simulator ~10 s in bf16
    prompt = [5, 11, 2]
    np.testing.assert_array_equal(m.generate(prompt, 3), llama32.generate(prompt, 3))
    # the weights and caches really are half on the device
    by = m.device_bytes()
    assert dtype in by and by.get("f32", 0) < by[dtype], by


def test_bert_half_embeddings():
    ref = BertModel.from_config(BERT, seed=5, std=0.2)
    m = BertModel(BERT, ref.params, dtype="f16")
    ids = np.array([[2, 9, 40, 17, 3, 0, 0], [2, 5, 3, 0, 0, 0, 0]])
    mask, types = ids != 0, np.zeros_like(ids)
    check(m(ids, mask, types), ref(ids, mask, types), "f16")


@pytest.mark.parametrize("model", ["vit", "resnet"])
def test_vision_half_logits(rng, model):
    if model == "vit":
        cfg = ViTConfig(image_size=8, patch_size=4, hidden_dim=8, num_layers=2, num_heads=2,
                        mlp_dim=12, num_classes=5)
        ref = ViT.from_config(cfg, seed=2)
        m = ViT(cfg, ref.params, dtype="bf16")
    else:
        cfg = ResNetConfig("basic", (1, 1, 1, 1), width=2, num_classes=5)
        ref = ResNet.from_config(cfg, seed=1)
        m = ResNet(cfg, ref.params, dtype="bf16")
    x = rng.standard_normal((2, 3, 8, 8) if model == "vit" else (1, 3, 32, 32))
    x = x.astype(np.float32)
    check(m.logits(x), ref.logits(x), "bf16", k=64)


def test_model_dtype_errors(llama32):
    with pytest.raises(ValueError, match="LlamaForCausalLM: dtype must be 'f32', 'bf16' or "
                                         "'f16', got 'fp8'"):
        LlamaForCausalLM(LLAMA, llama32.params, dtype="fp8")
    with pytest.raises(ValueError, match="dtype='bf16' stores every weight in bf16 already"):
        LlamaForCausalLM(LLAMA, llama32.params, dtype="bf16", weights="f16")
