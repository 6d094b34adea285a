"""Training a Llama: the kind "train" graph's loss and gradients against a float64 NumPy Llama
(tests/test_models.py's np_llama) and finite differences, and LlamaTrainer's steps."""
import dataclasses

import numpy as np
import pytest

import rlx_numba as rlx
from rlx_numba.models import LlamaForCausalLM, build_llama
from rlx_numba.models.llama import graph_params, unpack_graph_params
from test_models import GQA, np_llama

# test_models.py's GQA Llama made narrower for these train graphs (the simulator's time goes
# into the products, ~ m n k): still two layers, GQA 2:1, a tied head, head dim 8 (rope pairs)
TRAIN = dataclasses.replace(GQA, vocab_size=29, hidden_size=16, intermediate_size=24,
                            num_attention_heads=2, num_key_value_heads=1)


def np_loss(cfg, params, ids, labels):
    """Mean next-token cross-entropy (Hugging Face's shift; -100 labels ignored)."""
    logits = np_llama(cfg, params, ids)[:, :-1]
    tgt = labels[:, 1:]
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    keep = tgt != -100
    picked = np.take_along_axis(logp, np.where(keep, tgt, 0)[..., None], -1)[..., 0]
    return float(-(picked * keep).sum() / keep.sum())


def train_graph_grads(cfg, params, ids, labels):
    """The kind "train" graph's loss and every param's gradient, unpacked to Hugging Face
    names (the packed projections split like the weights)."""
    g = build_llama(cfg, *ids.shape, kind="train")
    loss = g.tensor(g.outputs[0])
    names = [n.name for n in g.nodes if n.op == "param"]
    grads = g.grad(loss, [g.tensor(n.id) for n in g.nodes if n.op == "param"])
    g.set_outputs([loss, *grads])
    exe = rlx.compile(g)
    for name, arr in graph_params(cfg, params).items():
        exe.set_param(name, arr)
    got = exe.run({"input_ids": ids.astype(np.int32), "labels": labels.astype(np.int64)})
    return got[0], unpack_graph_params(cfg, dict(zip(names, got[1:])))


@pytest.fixture(scope="module")
def model():
    return LlamaForCausalLM.from_config(TRAIN, seed=3, std=0.2)


def test_pack_unpack_round_trip(model):
    gp = graph_params(TRAIN, model.params)
    back = unpack_graph_params(TRAIN, gp)
    assert set(back) == set(model.params)
    for k, v in model.params.items():
        np.testing.assert_array_equal(back[k], v, err_msg=k)


def test_train_graph_loss_and_gradients_match_numpy(model, rng):
    b, s = 2, 5
    ids = rng.integers(0, TRAIN.vocab_size, (b, s))
    labels = ids.copy()
    labels[1, 2] = -100                         # a position with no loss
    loss, dhf = train_graph_grads(TRAIN, model.params, ids, labels)
    np.testing.assert_allclose(loss, np_loss(TRAIN, model.params, ids, labels), rtol=1e-4)
    # the packed params' gradients, unpacked like the weights, against central differences
    params = {k: v.astype(np.float64) for k, v in model.params.items()}
    eps = 1e-5
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp.gate_proj.weight",
                 "model.layers.0.input_layernorm.weight", "model.norm.weight"):
        p = params[name]
        for idx in [tuple(rng.integers(0, d) for d in p.shape) for _ in range(3)]:
            if name == "model.embed_tokens.weight":
                idx = (int(ids[0, 1]),) + idx[1:]      # a row that is read
            old = p[idx]
            p[idx] = old + eps
            hi = np_loss(TRAIN, params, ids, labels)
            p[idx] = old - eps
            lo = np_loss(TRAIN, params, ids, labels)
            p[idx] = old
            fd = (hi - lo) / (2 * eps)
            assert abs(dhf[name][idx] - fd) <= 1e-4 + 2e-3 * abs(fd), (name, idx, dhf[name][idx], fd)


def test_llama_trainer_steps_and_updates_the_model(rng):
    cfg = dataclasses.replace(TRAIN, num_hidden_layers=1)      # (one layer: the simulator is slow)
    m = LlamaForCausalLM.from_config(cfg, seed=5, std=0.2)
    before = {k: v.copy() for k, v in m.params.items()}
    tr = m.trainer(2, 4, rlx.optim.AdamW(lr=1e-2), exec_mode="stream")
    ids = rng.integers(0, cfg.vocab_size, (2, 4))
    first = np_loss(cfg, m.params, ids, ids)
    losses = [tr.step(ids) for _ in range(2)]
    np.testing.assert_allclose(losses[0], first, rtol=1e-4)   # the loss before the first update
    assert losses[-1] < losses[0]                  # the same batch: it is learnt
    tr.update_model()
    assert not np.array_equal(m.params["model.layers.0.mlp.down_proj.weight"],
                              before["model.layers.0.mlp.down_proj.weight"])
    np.testing.assert_allclose(np_loss(cfg, m.params, ids, ids), tr.step(ids), rtol=1e-4)
    with pytest.raises(ValueError, match=r"LlamaTrainer.step: input_ids must be an integer \[2, 4\]"):
        tr.step(ids[:, :3])
    with pytest.raises(ValueError, match="build_llama: a train graph needs seq >= 2"):
        m.trainer(2, 1, rlx.optim.SGD(lr=0.1))
