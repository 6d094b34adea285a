"""Training a BERT: the kind "train" graph's loss, logits and gradients against a float64
NumPy BERT (tests/test_models.py's np_bert) and central differences, and BertTrainer's steps."""
import numpy as np
import pytest

import rlx_numba as rlx
from rlx_numba.models import BertConfig, BertModel, build_bert
from rlx_numba.models.bert import head_shapes
from test_models import np_bert

CFG = BertConfig(vocab_size=23, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=12, max_position_embeddings=12, type_vocab_size=2,
                 layer_norm_eps=1e-12)
# the trainers' (a step runs every kernel of the simulator: one layer, few rows)
SMALL = BertConfig(vocab_size=23, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                   intermediate_size=12, max_position_embeddings=8, type_vocab_size=2,
                   layer_norm_eps=1e-12)


def np_pooled(cfg, params, ids, mask, types, pooling):
    h = np_bert(cfg, params, ids, mask, types)
    m = mask[..., None]
    out = []
    for mode in pooling:                           # sentence-transformers' order
        out.append(h[:, 0] if mode == "cls" else (h * m).sum(1) / m.sum(1))
    return np.concatenate(out, -1)


def np_head_loss(cfg, params, ids, mask, types, labels, pooling, loss):
    P = {k: v.astype(np.float64) for k, v in params.items()}
    y = np_pooled(cfg, P, ids, mask, types, pooling)
    logits = y @ P["classifier.weight"].T + P["classifier.bias"]
    if loss == "mse":
        return float(((logits - labels) ** 2).mean()), logits
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    keep = labels != -100
    picked = np.take_along_axis(logp, np.where(keep, labels, 0)[:, None], -1)[:, 0]
    return float(-(picked * keep).sum() / keep.sum()), logits


def batch(rng, b=3, s=7):
    ids = rng.integers(1, CFG.vocab_size, (b, s))
    mask = np.ones((b, s), bool)
    mask[1, 4:] = False                            # a padded row
    types = np.zeros((b, s), np.int64)
    types[2, 3:] = 1
    return ids, mask, types


def with_head(model, n_labels, pooling, rng):
    head = {k: 0.3 * rng.standard_normal(shape)
            for k, shape in head_shapes(CFG, n_labels, pooling).items()}
    return {**model.params, **{k: v.astype(np.float32) for k, v in head.items()}}


@pytest.fixture(scope="module")
def model():
    return BertModel.from_config(CFG, seed=7, std=0.2)


def test_train_graph_loss_and_gradients_match_numpy(model, rng):
    pooling, n_labels = ("cls", "mean"), 3
    ids, mask, types = batch(rng)
    labels = np.array([2, 0, -100])                # a row with no loss
    params = with_head(model, n_labels, pooling, rng)
    g = build_bert(CFG, *ids.shape, pooling=pooling, kind="train", num_labels=n_labels)
    loss = g.tensor(g.outputs[0])
    names = [n.name for n in g.nodes if n.op == "param"]
    assert set(names) == set(params)
    grads = g.grad(loss, [g.tensor(n.id) for n in g.nodes if n.op == "param"])
    g.set_outputs([loss, g.tensor(g.outputs[1]), *grads])
    exe = rlx.compile(g)
    for name, arr in params.items():
        exe.set_param(name, arr)
    feed = {"input_ids": ids.astype(np.int32), "token_type_ids": types.astype(np.int32),
            "attention_mask": mask, "labels": labels.astype(np.int64)}
    got = exe.run(feed)
    want, logits = np_head_loss(CFG, params, ids, mask, types, labels, pooling, "cross_entropy")
    np.testing.assert_allclose(got[0].reshape(()), want, rtol=1e-4)
    np.testing.assert_allclose(got[1], logits, rtol=1e-4, atol=1e-5)
    dp = dict(zip(names, got[2:]))
    p64 = {k: v.astype(np.float64) for k, v in params.items()}
    eps = 1e-5
    for name in ("classifier.weight", "embeddings.word_embeddings.weight",
                 "embeddings.position_embeddings.weight", "embeddings.token_type_embeddings.weight",
                 "encoder.layer.0.attention.self.key.weight", "encoder.layer.0.output.LayerNorm.bias",
                 "encoder.layer.1.intermediate.dense.weight", "encoder.layer.1.attention.output.LayerNorm.weight"):
        p = p64[name]
        for k in range(2):
            idx = tuple(int(rng.integers(0, d)) for d in p.shape)
            if name == "embeddings.word_embeddings.weight":
                idx = (int(ids[0, k + 1]),) + idx[1:]          # a row that is read
            elif name == "embeddings.position_embeddings.weight":
                idx = (k + 2,) + idx[1:]                       # a position in the batch
            elif name == "embeddings.token_type_embeddings.weight":
                idx = (k,) + idx[1:]
            old = p[idx]
            p[idx] = old + eps
            hi = np_head_loss(CFG, p64, ids, mask, types, labels, pooling, "cross_entropy")[0]
            p[idx] = old - eps
            lo = np_head_loss(CFG, p64, ids, mask, types, labels, pooling, "cross_entropy")[0]
            p[idx] = old
            fd = (hi - lo) / (2 * eps)
            assert abs(dp[name][idx] - fd) <= 1e-4 + 2e-3 * abs(fd), (name, idx, dp[name][idx], fd)
    # rows past the sequence, and token ids no row reads, get no gradient
    np.testing.assert_array_equal(dp["embeddings.position_embeddings.weight"][ids.shape[1]:], 0)
    unread = np.setdiff1d(np.arange(CFG.vocab_size), ids)
    np.testing.assert_array_equal(dp["embeddings.word_embeddings.weight"][unread], 0)


def test_mse_train_graph_matches_numpy(model, rng):
    pooling, n_labels = ("mean",), 2
    ids, mask, types = batch(rng)
    targets = rng.standard_normal((3, n_labels))
    params = with_head(model, n_labels, pooling, rng)
    g = build_bert(CFG, *ids.shape, pooling=pooling, kind="train", num_labels=n_labels,
                   loss="mse")
    exe = rlx.compile(g)
    for name, arr in params.items():
        exe.set_param(name, arr)
    got = exe.run({"input_ids": ids.astype(np.int32), "token_type_ids": types.astype(np.int32),
                   "attention_mask": mask, "labels": targets.astype(np.float32)})
    want, logits = np_head_loss(CFG, params, ids, mask, types, targets, pooling, "mse")
    np.testing.assert_allclose(got[0].reshape(()), want, rtol=1e-4)
    np.testing.assert_allclose(got[1], logits, rtol=1e-4, atol=1e-5)


def test_bert_trainer_learns_a_batch_and_updates_the_model(rng):
    m = BertModel.from_config(SMALL, seed=9, std=0.3)
    before = {k: v.copy() for k, v in m.params.items()}
    ids = rng.integers(1, SMALL.vocab_size, (2, 5))
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], bool)
    types = np.array([[0, 0, 1, 1, 1], [0, 0, 0, 0, 0]])
    labels = np.array([1, 0])
    tr = m.trainer(2, 5, rlx.optim.AdamW(lr=2e-2), num_labels=2, exec_mode="stream", seed=1)
    head0 = tr.head_params()
    assert head0["classifier.weight"].shape == (2, SMALL.hidden_size)
    np.testing.assert_array_equal(head0["classifier.bias"], 0)
    first = np_head_loss(SMALL, {**m.params, **head0}, ids, mask, types, labels, ("cls",),
                         "cross_entropy")[0]
    losses = [tr.step(ids, labels, mask, types) for _ in range(2)]
    np.testing.assert_allclose(losses[0], first, rtol=1e-4)   # the loss before the first update
    assert losses[-1] < losses[0]                  # the same batch: it is learnt
    tr.update_model()
    changed = "encoder.layer.0.intermediate.dense.weight"
    assert not np.array_equal(m.params[changed], before[changed])
    np.testing.assert_array_equal(m.params[changed], tr.trainer.get_param(changed))
    # the model runs with the trained weights; the trainer's next loss is the NumPy one
    h = m.run(ids, mask, types)
    np.testing.assert_allclose(h, np_bert(SMALL, m.params, ids, mask, types), rtol=2e-3,
                               atol=2e-4)
    want = np_head_loss(SMALL, {**m.params, **tr.head_params()}, ids, mask, types, labels,
                        ("cls",), "cross_entropy")[0]
    np.testing.assert_allclose(tr.step(ids, labels, mask, types), want, rtol=1e-4)


def test_bert_regression_trainer(rng):
    """One label: mse, [batch] targets, mean pooling."""
    m = BertModel.from_config(SMALL, seed=2, std=0.3)
    ids = rng.integers(1, SMALL.vocab_size, (2, 4))
    t = np.array([0.5, -1.0])
    reg = m.trainer(2, 4, rlx.optim.SGD(lr=0.1), num_labels=1, pooling="mean",
                    exec_mode="stream")
    assert reg.loss == "mse"
    first = np_head_loss(SMALL, {**m.params, **reg.head_params()}, ids, np.ones((2, 4), bool),
                         np.zeros((2, 4), np.int64), t[:, None], ("mean",), "mse")[0]
    r = [reg.step(ids, t) for _ in range(2)]
    np.testing.assert_allclose(r[0], first, rtol=1e-4)
    assert r[-1] < r[0]


def test_bert_train_errors(model):
    with pytest.raises(ValueError, match="build_bert: kind must be 'forward' or 'train'"):
        build_bert(CFG, 2, 4, kind="decode")
    with pytest.raises(ValueError, match="loss 'cross_entropy' needs num_labels >= 2"):
        build_bert(CFG, 2, 4, kind="train", num_labels=1, loss="cross_entropy")
    with pytest.raises(ValueError, match="num_labels must be a positive int"):
        build_bert(CFG, 2, 4, kind="train", num_labels=0)
    with pytest.raises(ValueError, match="loss 'hinge' is not supported"):
        build_bert(CFG, 2, 4, kind="train", num_labels=2, loss="hinge")
    with pytest.raises(ValueError, match="num_labels and loss belong to kind 'train'"):
        build_bert(CFG, 2, 4, num_labels=2)
    tr = model.trainer(2, 4, rlx.optim.SGD(lr=0.1), exec_mode="stream")
    ids = np.ones((2, 4), np.int64)
    with pytest.raises(ValueError, match=r"BertTrainer.step: input_ids must be an integer \[2, 4\]"):
        tr.step(ids[:, :3], np.array([0, 1]))
    with pytest.raises(ValueError, match=r"labels hold 5, outside \[0, 2\)"):
        tr.step(ids, np.array([0, 5]))
    with pytest.raises(ValueError, match=r"labels must be integer class indices \[2\]"):
        tr.step(ids, np.array([0.5, 1.0]))
    with pytest.raises(ValueError, match="BertTrainer head: tensor 'classifier.weight' has shape"):
        model.trainer(2, 4, rlx.optim.SGD(lr=0.1), head={"classifier.weight": np.zeros((3, 16)),
                                                         "classifier.bias": np.zeros(2)})
