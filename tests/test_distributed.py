"""Collectives as graph ops and what is built on them, on the in-process communicator (ranks as
threads; the simulator on CPU CI, one GPU shared by the ranks on a GPU): every collective
against NumPy, their gradients, a tensor-parallel tiny Llama equal to the unsharded one, and
data-parallel training equal to one process on the concatenated batch."""
import json

import numpy as np
import pytest

import rlx_numba as rlx
from rlx_numba import distributed as dist
from rlx_numba.models import LlamaForCausalLM
from rlx_numba.models.llama import LlamaConfig, shard_config

OPS = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}


def _feeds(world, shape, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "f":
        return [rng.uniform(0.5, 1.5, shape).astype(dtype) * (-1) ** r for r in range(world)]
    return [rng.integers(-9, 10, shape).astype(dtype) for r in range(world)]


def _reduced(xs, op):
    out = xs[0]
    for x in xs[1:]:
        out = OPS["sum" if op == "avg" else op](out, x)
    return out / len(xs) if op == "avg" else out


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_against_numpy(world):
    shape = (4, 3, 5)
    xs = _feeds(world, shape)
    ks = _feeds(world, (4, 7), np.int32, seed=1)

    def rank(comm):
        g = rlx.Graph("collectives")
        x, k = g.input("x", shape), g.input("k", (4, 7), "i32")
        g.set_outputs([g.all_reduce(x, op) for op in ("sum", "avg", "max", "min", "prod")]
                      + [g.all_gather(x, 0), g.all_gather(x, 1), g.all_gather(x, -1),
                         g.reduce_scatter(x, 0), g.reduce_scatter(x, 0, "max"),
                         g.broadcast(x, world - 1), g.all_reduce(k), g.all_gather(k, 1)])
        return rlx.compile(g).run({"x": xs[comm.rank], "k": ks[comm.rank]})
    for r, got in enumerate(dist.run_ranks(world, rank)):
        wants = [_reduced(xs, op) for op in ("sum", "avg", "max", "min", "prod")]
        wants += [np.concatenate(xs, a) for a in (0, 1, 2)]
        part = shape[0] // world
        wants += [_reduced(xs, op)[r * part:(r + 1) * part] for op in ("sum", "max")]
        wants += [xs[-1], _reduced(ks, "sum"), np.concatenate(ks, 1)]
        for out, want in zip(got, wants):
            np.testing.assert_allclose(out, want, rtol=1e-6)
            assert out.dtype == want.dtype


def test_reduce_scatter_on_an_inner_axis():
    xs = _feeds(2, (3, 6))

    def rank(comm):
        g = rlx.Graph("rs")
        x = g.input("x", (3, 6))
        g.set_outputs([g.reduce_scatter(x, axis=1, op="avg")])
        return rlx.compile(g).run({"x": xs[comm.rank]})[0]
    for r, got in enumerate(dist.run_ranks(2, rank)):
        np.testing.assert_allclose(got, ((xs[0] + xs[1]) / 2)[:, 3 * r:3 * r + 3], rtol=1e-6)


def test_collective_gradients():
    # the loss is the sum of the ranks' losses sum(seed_r * y_r)
    world, shape = 2, (4, 3)
    xs = _feeds(world, shape)
    seeds = {k: _feeds(world, s, seed=9 + i) for i, (k, s) in enumerate(
        [("ar", shape), ("ag", (4, 6)), ("rs", (2, 3)), ("bc", shape)])}

    def rank(comm):
        r = comm.rank
        g = rlx.Graph("grads")
        x = g.input("x", shape)
        ys = {"ar": g.all_reduce(x), "ag": g.all_gather(x, 1), "rs": g.reduce_scatter(x, 0),
              "bc": g.broadcast(x, 1)}
        outs = []
        for k, y in ys.items():
            loss = g.sum(y * g.constant(seeds[k][r]))
            outs += g.grad(loss, [x])
        g.set_outputs(outs)
        return rlx.compile(g).run({"x": xs[r]})
    total = {k: sum(s) for k, s in seeds.items()}
    for r, (d_ar, d_ag, d_rs, d_bc) in enumerate(dist.run_ranks(world, rank)):
        np.testing.assert_allclose(d_ar, total["ar"], rtol=1e-6)
        np.testing.assert_allclose(d_ag, total["ag"][:, 3 * r:3 * r + 3], rtol=1e-6)
        np.testing.assert_allclose(d_rs, np.concatenate(seeds["rs"], 0), rtol=1e-6)
        np.testing.assert_allclose(d_bc, total["bc"] if r == 1 else 0 * total["bc"], rtol=1e-6)


def test_collective_errors():
    g = rlx.Graph("errs")
    x = g.input("x", (3, 4))
    cases = [
        (lambda: g.all_reduce(x), "all_reduce: no communicator"),
        (lambda: g.all_reduce(x, "mean", world_size=2, rank=0), "all_reduce: op must be one of"),
        (lambda: g.reduce_scatter(x, 0, world_size=2, rank=0),
         r"reduce_scatter: x f32 \[3, 4\] axis 0 \(3\) is not a multiple of world_size 2"),
        (lambda: g.all_gather(x, 2, world_size=2, rank=1), "all_gather: axis 2 out of range"),
        (lambda: g.broadcast(x, 2, world_size=2, rank=0), r"broadcast: root must be a rank in"),
        (lambda: g.all_reduce(x, world_size=2, rank=2), "need world_size >= 1 and 0 <= rank"),
        (lambda: g.all_reduce(g.input("b", (2,), "bool"), world_size=2, rank=0),
         "all_reduce: x must be one of"),
    ]
    for fn, msg in cases:
        with pytest.raises(ValueError, match=msg):
            fn()
    y = g.all_reduce(x, world_size=2, rank=0)
    g.set_outputs([y])
    with pytest.raises(ValueError, match=r"all_reduce %\d+ needs a communicator"):
        rlx.compile(g)

    def wrong(comm):
        with pytest.raises(ValueError, match="was built for rank 0 of 2, but the current "
                                             "communicator is rank 0 of 1"):
            rlx.compile(g)
    dist.run_ranks(1, wrong)


def _tiny(heads=4, kv=2, layers=2, **kw):
    return LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=24, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv,
                       max_position_embeddings=32, **kw)


@pytest.mark.parametrize("world,cfg,new", [
    (2, _tiny(layers=1, attention_bias=True, mlp_bias=True), 2),  # forward, prefill, decode
    (4, _tiny(kv=4, layers=1, tie_word_embeddings=True), 0)])   # forward
def test_tensor_parallel_llama_equals_unsharded(world, cfg, new):
    # the unsharded model: test_models' NumPy Llama and greedy loop over the same weights
    # (that model on one device equals them: test_models)
    from test_models import np_greedy, np_llama
    ref = LlamaForCausalLM.from_config(cfg, seed=1, exec_mode="stream")
    ids = np.random.default_rng(0).integers(0, 48, (2, 5))
    want = np_llama(cfg, ref.params, ids)
    tokens = np_greedy(cfg, ref.params, ids, new) if new else None

    def rank(comm):
        m = LlamaForCausalLM(cfg, ref.params, tensor_parallel=world, exec_mode="stream")
        assert m.params["model.layers.0.mlp.down_proj.weight"].shape == (16, 24 // world)
        return m(ids), m.generate(ids, new) if new else None
    for logits, gen in dist.run_ranks(world, rank):
        np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
        np.testing.assert_array_equal(gen, tokens)


def test_tensor_parallel_reads_only_its_slices(tmp_path):
    from safetensors.numpy import save_file
    cfg = _tiny()
    ref = LlamaForCausalLM.from_config(cfg, seed=2, exec_mode="stream")
    save_file(ref.params, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    ids = np.arange(6).reshape(1, 6)

    def rank(comm):
        m = LlamaForCausalLM.from_safetensors(tmp_path, tensor_parallel=2, exec_mode="stream")
        k = m.params["model.layers.1.self_attn.k_proj.weight"]
        full = ref.params["model.layers.1.self_attn.k_proj.weight"]
        np.testing.assert_array_equal(k, full[comm.rank * 4:(comm.rank + 1) * 4])
        return m(ids)
    from test_models import np_llama    # the unsharded model, in NumPy
    want = np_llama(cfg, ref.params, ids)
    for got in dist.run_ranks(2, rank):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6 * np.abs(want).max())


def test_tensor_parallel_errors():
    with pytest.raises(ValueError, match="num_key_value_heads 2 not a multiple of 4"):
        shard_config(_tiny(), 4)
    with pytest.raises(ValueError, match="tensor_parallel=2 needs a current communicator"):
        LlamaForCausalLM.from_config(_tiny(), tensor_parallel=2)


@pytest.mark.parametrize("world", [2, 4])
def test_data_parallel_step_equals_one_process_on_the_whole_batch(world):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 5)).astype(np.float32)
    t = rng.standard_normal((8, 3)).astype(np.float32)
    w0 = rng.standard_normal((5, 3)).astype(np.float32)
    b0 = rng.standard_normal(3).astype(np.float32)

    def trainer(rows, dp):
        g = rlx.Graph("mlp")
        xi, ti = g.input("x", (rows, 5)), g.input("t", (rows, 3))
        y = g.tanh(g.linear(xi, g.param("w", (5, 3)), g.param("b", (3,))))
        loss = g.mean((y - ti) * (y - ti))
        tr = rlx.compile_train(g, loss, rlx.optim.Adam(lr=0.1), exec_mode="stream",
                               data_parallel=dp)
        tr.set_param("w", w0)
        tr.set_param("b", b0)
        return tr
    one = trainer(8, False)
    losses = [one.step({"x": x, "t": t}) for _ in range(2)]
    part = 8 // world

    def rank(comm):
        tr = trainer(part, True)
        feed = {"x": x[comm.rank * part:(comm.rank + 1) * part],
                "t": t[comm.rank * part:(comm.rank + 1) * part]}
        mine = [tr.step(feed) for _ in range(2)]
        return mine, tr.get_param("w"), tr.get_param("b")
    res = dist.run_ranks(world, rank)
    for step in range(2):     # the mean of the ranks' losses is the whole batch's loss
        np.testing.assert_allclose(np.mean([r[0][step] for r in res]), losses[step], rtol=1e-5)
    for _, w, b in res:
        np.testing.assert_allclose(w, one.get_param("w"), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(b, one.get_param("b"), rtol=1e-5, atol=1e-6)


def test_data_parallel_llama_matches_one_process():
    cfg = _tiny(layers=1)
    ids = np.random.default_rng(4).integers(0, 48, (2, 4))

    def rank(comm):
        m = LlamaForCausalLM.from_config(cfg, seed=1, exec_mode="stream")
        tr = m.trainer(1, 4, rlx.optim.SGD(lr=0.5), exec_mode="stream", data_parallel=True)
        tr.step(ids[comm.rank:comm.rank + 1])
        tr.update_model()
        return m.params
    tr = LlamaForCausalLM.from_config(cfg, seed=1, exec_mode="stream")
    t = tr.trainer(2, 4, rlx.optim.SGD(lr=0.5), exec_mode="stream")
    t.step(ids)
    t.update_model()
    for params in dist.run_ranks(2, rank):
        for k, v in tr.params.items():
            np.testing.assert_allclose(params[k], v, rtol=1e-5, atol=1e-6, err_msg=k)
