"""compile_train(..., precision="bf16" | "f16"): mixed-precision training.

Oracle: the recipe of torch.autocast + GradScaler written here in NumPy (float64 between the
roundings): f32 master weights, the forward's products on half-rounded operands rounded to
half, the sum / tanh / loss in f32, the backward's half tensors rounded where the graph holds
them in half, the grads unscaled and applied to the f32 masters. The model is a linear layer
built from a broadcast multiply and a sum (ops that take half today), its weight cast to the
half dtype as autocast casts a product's weight.
"""
import numpy as np
import pytest

import rlx_numba as rlx
from halfref import HOST, UNIT, f64, rounded
from rlx_numba.optim import SGD, AdamW

R, K, N = 3, 5, 4


def half_linear_model(dtype):
    """loss = mean((tanh(sum_k half(x)[r, k] * half(w)[k, n] + b) - t)^2)."""
    g = rlx.Graph("half_linear")
    x, t = g.input("x", (R, K)), g.input("t", (R, N))
    w, b = g.param("w", (K, N)), g.param("b", (N,))
    prod = g.reshape(g.cast(x, dtype), (R, K, 1)) * g.reshape(g.cast(w, dtype), (1, K, N))
    h = g.reduce_sum(prod, axes=1)           # autocast: summed in f32 (torch's sum policy)
    d = g.tanh(h + b) - t
    loss = g.reduce_mean(d * d)
    g.set_outputs([loss])
    return g, loss


def recipe(x, t, w, b, dtype, scale=1.0, half=True):
    """(loss, dw, db, found_inf) of one step of the mixed-precision recipe (``half=False``:
    the same in f32 throughout, to show the checks below tell the two apart)."""
    def r(a):
        if not half:
            return f64(a)
        with np.errstate(over="ignore", invalid="ignore"):
            return f64(np.asarray(a, np.float32).astype(HOST[dtype]))
    xh, wh = r(x), r(w)
    prod = r(xh[:, :, None] * wh[None])
    y = np.tanh(prod.sum(1) + b)
    e = y - t
    loss = float((e * e).mean())
    dz = (2 * e / e.size * scale) * (1 - y * y)          # f32 in the graph, scaled seed
    dprod = r(np.broadcast_to(dz[:, None, :], (R, K, N)))   # the f32 cast's VJP: to half
    # the half mul's VJP: dprod * x widened to f32, summed over the rows in f32, rounded once
    with np.errstate(invalid="ignore"):
        dw = r((xh[:, :, None] * dprod).sum(0))
    db = dz.sum(0)
    found = not (np.isfinite(dw).all() and np.isfinite(db).all())
    return loss, dw / scale, db / scale, found


def sgd_momentum(lr, mom):
    buf = {}

    def step(k, p, gr):
        buf[k] = gr if k not in buf else mom * buf[k] + gr
        return p - lr * buf[k]
    return step


def adamw(lr, wd, b1=0.9, b2=0.999, eps=1e-8):
    state = {}

    def step(k, p, gr):
        m, v, t = state.get(k, (0.0, 0.0, 0))
        t += 1
        m, v = b1 * m + (1 - b1) * gr, b2 * v + (1 - b2) * gr * gr
        state[k] = (m, v, t)
        p = p * (1 - lr * wd)
        return p - lr / (1 - b1 ** t) * m / (np.sqrt(v) / np.sqrt(1 - b2 ** t) + eps)
    return step


def clipped(grads, max_norm):
    """torch.nn.utils.clip_grad_norm_ over all the grads."""
    if max_norm is None:
        return grads
    norm = np.sqrt(sum((gr * gr).sum() for gr in grads))
    return [gr * min(max_norm / (norm + 1e-6), 1.0) for gr in grads]


OPTS = {"sgd": (lambda: SGD(0.5, momentum=0.9), lambda: sgd_momentum(0.5, 0.9), 0.5, None),
        "adamw-clip": (lambda: AdamW(lr=0.02, weight_decay=0.1), lambda: adamw(0.02, 0.1),
                       0.02, 0.05)}


def _data(rng, steps):
    return [(rng.standard_normal((R, K)).astype(np.float32),
             rng.uniform(-0.8, 0.8, (R, N)).astype(np.float32)) for _ in range(steps)]


def _init(rng):
    return (rng.standard_normal((K, N)).astype(np.float32) * 0.6,
            rng.standard_normal(N).astype(np.float32) * 0.2)


@pytest.mark.parametrize("dtype,opt", [("bf16", "sgd"), ("f16", "sgd"), ("bf16", "adamw-clip"),
                                       ("f16", "adamw-clip")])
def test_mixed_precision_steps_match_the_numpy_recipe(rng, dtype, opt):
    g, loss = half_linear_model(dtype)
    before = str(g)
    make, ref, lr, max_norm = OPTS[opt]
    tr = rlx.compile_train(g, loss, make(), precision=dtype, clip_grad_norm=max_norm)
    assert str(g) == before, "compile_train changed the user's graph"
    assert tr.params == ["w", "b"] and tr.precision == dtype
    # the weight's cast became a half leaf the update writes: no cast of w runs per step
    casts = [n for n in tr.graph.nodes if n.op == "cast" and n.inputs
             and tr.graph.nodes[n.inputs[0]].name == "w"]
    assert not casts
    assert [n.op for n in tr.graph.nodes].count("optim_update") == 1
    scaled = dtype == "f16"
    assert tr.loss_scale == (2.0 ** 16 if scaled else 1.0)
    kernels = [s.kernel.py_func.__name__ for s in tr.exe.steps[-4:]]
    update = "sgd_update" if opt == "sgd" else "adam_update"
    want_kernels = (["grad_sumsq"] if max_norm else []) + (["grad_nonfinite"] if scaled else []) \
        + [update] + (["amp_update_scale"] if scaled else [])
    assert kernels[-len(want_kernels):] == want_kernels

    w, b = _init(rng)
    tr.set_param("w", w)
    tr.set_param("b", b)
    w, b = f64(w), f64(b)
    step, u, apart = ref(), UNIT[dtype], []
    for x, t in _data(rng, 3):
        want, dw, db, found = recipe(x, t, w, b, dtype, scale=tr.loss_scale)
        assert not found
        apart.append(abs(recipe(x, t, w, b, dtype, half=False)[0] - want) / abs(want))
        got = tr.step({"x": x, "t": t})
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)
        if max_norm is not None:      # (the clip acts on the unscaled grads)
            assert np.sqrt((dw * dw).sum() + (db * db).sum()) > 2 * max_norm
        dw, db = clipped([dw, db], max_norm)
        w, b = step("w", w, dw), step("b", b, db)
        # dw is rounded to half in the graph: one half rounding of slack per element, at most
        tol = 1e-6 + lr * 10 * u * max(np.abs(dw).max(), 1.0 if opt != "sgd" else 0.0)
        np.testing.assert_allclose(tr.get_param("w"), w, rtol=1e-5, atol=tol)
        np.testing.assert_allclose(tr.get_param("b"), b, rtol=1e-5, atol=1e-6)
        # the half copy the forward reads is the rounding of the new f32 master
        half = tr.exe.get_param("__train__.half.w")
        np.testing.assert_array_equal(half, rounded(tr.get_param("w"), dtype))
    # the loss check fails for a forward computed in f32: it is that far from the recipe
    assert max(apart) > 5 * 2e-6
    assert tr.steps_done == tr.optimizer_steps == 3
    assert tr.loss_scale == (2.0 ** 16 if scaled else 1.0)
    r = tr.memory_report()
    assert r["half_copy_bytes"] == 2 * (512 // 4 + 512 // 4)    # w (20), b: 256-byte halves
    assert "half copies" in str(r)


def test_f16_inf_gradient_skips_the_update_and_backs_off_then_grows(rng):
    """GradScaler's rules: a step whose grads hold an inf / NaN changes no param, no state and
    no step count, and halves the scale; ``growth_interval`` clean steps double it."""
    g, loss = half_linear_model("f16")
    lr, mom = 0.5, 0.9
    tr = rlx.compile_train(g, loss, SGD(lr, momentum=mom), precision="f16", growth_interval=2)
    w, b = _init(rng)
    tr.set_param("w", w)
    tr.set_param("b", b)
    (x, t), (x2, t2), (x3, t3) = _data(rng, 3)
    bad = x.copy()
    bad[1, 2] = np.inf     # tanh saturates: the loss stays finite, d w = inf * 0 = NaN
    got = tr.step({"x": bad, "t": t})
    assert np.isfinite(got)
    np.testing.assert_array_equal(tr.get_param("w"), w)
    np.testing.assert_array_equal(tr.get_param("b"), b)
    np.testing.assert_array_equal(tr.exe.get_param("__train__.half.w"), rounded(w, "f16"))
    np.testing.assert_array_equal(tr.optimizer_state("w")["momentum_buffer"], 0)
    assert tr.loss_scale == 2.0 ** 15
    assert (tr.steps_done, tr.optimizer_steps) == (1, 0)
    # clean steps: the first is the optimizer's first (momentum buffer = the grad)
    opt, wd, bd = sgd_momentum(lr, mom), f64(w), f64(b)
    for k, (xs, ts) in enumerate([(x2, t2), (x3, t3), (x2, t2)]):
        want, dw, db, found = recipe(xs, ts, wd, bd, "f16", scale=tr.loss_scale)
        assert not found
        np.testing.assert_allclose(tr.step({"x": xs, "t": ts}), want, rtol=2e-6, atol=1e-7)
        wd, bd = opt("w", wd, dw), opt("b", bd, db)
        tol = 1e-6 + lr * 10 * UNIT["f16"] * np.abs(dw).max()
        np.testing.assert_allclose(tr.get_param("w"), wd, rtol=1e-5, atol=tol)
        np.testing.assert_allclose(tr.get_param("b"), bd, rtol=1e-5, atol=1e-6)
        # 2 clean steps in a row: x2; the count restarts after growing
        assert tr.loss_scale == [2.0 ** 15, 2.0 ** 16, 2.0 ** 16][k]
    assert (tr.steps_done, tr.optimizer_steps) == (4, 3)


def test_f16_overflow_in_the_half_backward_backs_off_until_clean(rng):
    """Too large a scale overflows the f16 gradients (65504 is f16's largest): each such step
    is skipped and halves the scale, until the scaled grads fit; the steps that follow train."""
    g, loss = half_linear_model("f16")
    tr = rlx.compile_train(g, loss, SGD(0.5), precision="f16", init_scale=2.0 ** 30)
    w, b = _init(rng)
    tr.set_param("w", w)
    tr.set_param("b", b)
    x, t = _data(rng, 1)[0]
    scale, skips = 2.0 ** 30, 0
    while recipe(x, t, f64(w), f64(b), "f16", scale=scale)[3]:
        scale, skips = scale / 2, skips + 1
    assert 3 <= skips < 30
    for _ in range(skips):
        tr.step({"x": x, "t": t})
        np.testing.assert_array_equal(tr.get_param("w"), w)
    assert tr.loss_scale == scale and tr.optimizer_steps == 0
    want, dw, db, _ = recipe(x, t, f64(w), f64(b), "f16", scale=scale)
    np.testing.assert_allclose(tr.step({"x": x, "t": t}), want, rtol=2e-6, atol=1e-7)
    tol = 1e-6 + 0.5 * 10 * UNIT["f16"] * np.abs(dw).max()
    np.testing.assert_allclose(tr.get_param("w"), f64(w) - 0.5 * dw, rtol=1e-5, atol=tol)
    assert tr.loss_scale == scale and tr.optimizer_steps == 1


def test_f16_scaler_factors_are_the_users(rng):
    """growth_factor / backoff_factor as GradScaler's: an inf step scales the scale by the
    backoff, growth_interval clean steps by the growth."""
    g, loss = half_linear_model("f16")
    tr = rlx.compile_train(g, loss, SGD(0.1), precision="f16", init_scale=2.0 ** 10,
                           growth_factor=4.0, backoff_factor=0.125, growth_interval=1)
    w, b = _init(rng)
    tr.set_param("w", w)
    tr.set_param("b", b)
    (x, t), = _data(rng, 1)
    bad = x.copy()
    bad[0, 0] = np.nan
    tr.step({"x": bad, "t": t})
    assert tr.loss_scale == 2.0 ** 7
    tr.step({"x": x, "t": t})
    assert tr.loss_scale == 2.0 ** 9


@pytest.mark.parametrize("kw,msg", [
    (dict(precision="f8"), "compile_train: precision must be one of"),
    (dict(precision="f16", growth_factor=1.0), "growth_factor must satisfy 1.0 < growth_factor"),
    (dict(precision="f16", backoff_factor=1.0), "backoff_factor must satisfy 0.0 < backoff"),
    (dict(precision="f16", growth_interval=0), "growth_interval must be an int >= 1"),
    (dict(precision="f16", init_scale=-1.0), "init_scale must satisfy"),
])
def test_precision_errors(kw, msg):
    g, loss = half_linear_model("bf16")
    with pytest.raises(ValueError, match=msg):
        rlx.compile_train(g, loss, SGD(0.1), **kw)


# ---- the update node --------------------------------------------------------------------------
def _update_inputs(g, total=64, sizes=(6, 4), half="bf16", scaled=True):
    params, hyper = g.param("flat", (total,)), g.input("hyper", (4,))
    grads = [g.input(f"g{k}", (n,)) for k, n in enumerate(sizes)]
    trained = [g.param(f"p{k}", (n,)) for k, n in enumerate(sizes)]
    rest = ([g.param("halves", (total,), half)] if half else []) + \
        ([g.param("scaler", (3,))] if scaled else [])
    return [params, hyper] + grads + trained + rest


SGD_HP = (("momentum", 0.0), ("dampening", 0.0), ("weight_decay", 0.0), ("nesterov", False))
GOOD = dict(rule="sgd", hp=SGD_HP, nstates=0, offsets=(0, 32), sizes=(6, 4),
            half_offsets=(0, -1), max_norm=None, scaling=(2.0, 0.5, 2000))


def test_optim_update_node_is_inplace_on_the_flat_params():
    g = rlx.Graph("upd")
    ins = _update_inputs(g)
    out = g.bind("optim_update", ins, **GOOD)
    assert out.shape == (64,) and out.dtype.name == "f32"
    from rlx_numba.ir.ops_optim import operands
    io = operands(out.node)
    assert io["params"] == ins[0].id and io["grads"] == [ins[2].id, ins[3].id]
    assert io["halves"] == ins[6].id and io["scaler"] == ins[7].id


@pytest.mark.parametrize("change,msg", [
    (dict(rule="lion"), "optim_update: rule must be one of sgd, adam"),
    (dict(hp=SGD_HP[:2]), "rule 'sgd' takes hp"),
    (dict(nstates=2), "rule 'sgd' keeps 0 or 1 state buffers, got nstates=2"),
    (dict(offsets=(0, 62)), "a param's \\[offset, offset \\+ size\\) leaves params"),
    (dict(scaling=None), "expected 7 inputs .*halves\\), got 8"),
    (dict(half_offsets=(0,)), "half_offsets must have 2 entries, got 1"),
    (dict(sizes=(6, 5)), "grads\\[1\\] must be f32 with 5 elements, got f32 \\[4\\]"),
])
def test_optim_update_node_errors(change, msg):
    g = rlx.Graph("upd")
    with pytest.raises(ValueError, match=msg):
        g.bind("optim_update", _update_inputs(g), **{**GOOD, **change})


def test_optim_update_node_checks_the_half_copies_dtype():
    g = rlx.Graph("upd")
    with pytest.raises(ValueError, match="halves must be f16 or bf16 \\[64\\], got f32 \\[64\\]"):
        g.bind("optim_update", _update_inputs(g, half="f32"), **GOOD)


def test_f16_without_products_scales_the_loss_and_keeps_no_half_copies(rng):
    """autocast casts nothing in an element-wise model: f16 training is the f32 one with the
    loss scaled (a power of two: the same grads) and no half copies."""
    g = rlx.Graph("ew")
    x, t, w = g.input("x", (3, 7)), g.input("t", (3, 7)), g.param("w", (7,))
    d = g.tanh(x * w) - t
    loss = g.reduce_mean(d * d)
    g.set_outputs([loss])
    trs = [rlx.compile_train(g, loss, AdamW(lr=0.05), precision=p) for p in ("f32", "f16")]
    assert trs[1].memory_report()["half_copy_bytes"] == 0
    assert "__train__.half" not in [n.name for n in trs[1].graph.nodes]
    w0 = rng.standard_normal(7).astype(np.float32)
    for tr in trs:
        tr.set_param("w", w0)
    for xb, tb in [(rng.standard_normal((3, 7)).astype(np.float32),
                    rng.uniform(-0.5, 0.5, (3, 7)).astype(np.float32)) for _ in range(2)]:
        a, b = (tr.step({"x": xb, "t": tb}) for tr in trs)
        np.testing.assert_allclose(b, a, rtol=1e-6)
        np.testing.assert_allclose(trs[1].get_param("w"), trs[0].get_param("w"), rtol=1e-5,
                                   atol=1e-6)
    assert trs[1].loss_scale == 2.0 ** 16


# ---- through autocast's products ----------------------------------------------------------------
def _mlp():
    g = rlx.Graph("mlp")
    x, t = g.input("x", (5, 6)), g.input("t", (5, 3))
    w1, b1, w2 = g.param("w1", (6, 7)), g.param("b1", (7,)), g.param("w2", (7, 3))
    d = g.matmul(g.linear(x, w1, b1, activation="gelu"), w2) - t
    loss = g.reduce_mean(d * d)
    g.set_outputs([loss])
    return g, loss


def _mlp_step(x, t, p):
    """(loss, grads) of the MLP in float64."""
    from math import erf
    z = x @ p["w1"] + p["b1"]
    cdf = 0.5 * (1 + np.vectorize(erf)(z / np.sqrt(2)))
    h = z * cdf
    d = h @ p["w2"] - t
    dy = 2 * d / d.size
    dz = (dy @ p["w2"].T) * (cdf + z * np.exp(-z * z / 2) / np.sqrt(2 * np.pi))
    return float((d * d).mean()), {"w1": x.T @ dz, "b1": dz.sum(0), "w2": h.T @ dy}


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_autocast_mlp_trains_with_half_weight_copies(rng, dtype):
    """linear + gelu + matmul under autocast: the three weights' casts become half copies the
    update writes (no cast of a weight runs in the step), the products run in half, and the
    training tracks the float64 one within half precision."""
    g, loss = _mlp()
    before = str(g)
    lr = 0.1
    tr = rlx.compile_train(g, loss, SGD(lr), precision=dtype)
    assert str(g) == before
    nodes = tr.graph.nodes
    assert {n.name for n in nodes if n.op == "param" and n.dtype.name == dtype} == \
        {"__train__.half.w1", "__train__.half.b1", "__train__.half.w2", "__train__.half"}
    assert not [n for n in nodes if n.op == "cast" and nodes[n.inputs[0]].op == "param"]
    assert {nodes[n.inputs[1]].name for n in nodes if n.op in ("linear", "matmul")
            and n.id < nodes[tr.graph.outputs[0]].id} == {"__train__.half.w1",
                                                           "__train__.half.w2"}
    p = {"w1": rng.standard_normal((6, 7)) / 3, "b1": rng.standard_normal(7) / 3,
         "w2": rng.standard_normal((7, 3)) / 3}
    p = {k: v.astype(np.float32) for k, v in p.items()}
    for k, v in p.items():
        tr.set_param(k, v)
    p = {k: f64(v) for k, v in p.items()}
    u, gmax, skipped = UNIT[dtype], 0.0, 0
    for _ in range(4):
        x = rng.standard_normal((5, 6)).astype(np.float32)
        t = rng.standard_normal((5, 3)).astype(np.float32)
        want, grads = _mlp_step(f64(x), f64(t), p)
        done, scale = tr.optimizer_steps, tr.loss_scale
        # a few roundings of the products' operands and outputs: ~u relative
        np.testing.assert_allclose(tr.step({"x": x, "t": t}), want, rtol=6 * u)
        if tr.optimizer_steps == done:
            # f16: the grads times 2^16 overflowed f16 in a product (GradScaler's first steps
            # often do): skipped, params unchanged, the scale halved
            assert dtype == "f16" and tr.loss_scale == scale / 2
            skipped += 1
        else:
            gmax = max(gmax, *(np.abs(gr).max() for gr in grads.values()))
            p = {k: p[k] - lr * grads[k] for k in p}
        for k in p:
            got = tr.get_param(k)
            assert got.dtype == np.float32            # the master weights stay f32
            np.testing.assert_allclose(got, p[k], atol=3 * lr * 16 * u * gmax)
            np.testing.assert_array_equal(tr.exe.get_param("__train__.half." + k),
                                          rounded(got, dtype))
    assert tr.optimizer_steps == 4 - skipped >= 2
    assert tr.loss_scale == (2.0 ** (16 - skipped) if dtype == "f16" else 1.0)


def test_llama_trainer_in_bf16_tracks_the_f32_loss(rng):
    """A one-layer Llama's trainer with precision="bf16": autocast products, attention and
    rope in bf16, f32 master weights the model gets back (update_model)."""
    import dataclasses
    from rlx_numba.models import LlamaForCausalLM
    from test_llama_train import TRAIN, np_loss
    cfg = dataclasses.replace(TRAIN, num_hidden_layers=1)     # (narrow: the simulator is slow)
    m = LlamaForCausalLM.from_config(cfg, seed=5, std=0.2)
    before = m.params["model.layers.0.mlp.down_proj.weight"].copy()
    tr = m.trainer(1, 5, rlx.optim.AdamW(lr=1e-2), exec_mode="stream", precision="bf16")
    assert tr.trainer.precision == "bf16"
    # every product's weight (the [out, in] weights read through a transpose, the tied
    # embedding as the LM head) is a half copy the update writes: no weight cast per step
    nodes = tr.trainer.graph.nodes
    copies = {n.name for n in nodes if (n.name or "").startswith("__train__.half.")}
    layer = "__train__.half.model.layers.0."
    assert copies == {layer + "self_attn.qkv_proj.weight", layer + "self_attn.o_proj.weight",
                      layer + "mlp.gate_up_proj.weight", layer + "mlp.down_proj.weight",
                      "__train__.half.model.embed_tokens.weight"}
    assert not [n for n in nodes if n.op == "cast" and n.dtype.name == "bf16"
                and nodes[n.inputs[0]].op in ("param", "transpose")
                and nodes[nodes[n.inputs[0]].inputs[0] if nodes[n.inputs[0]].inputs
                          else n.inputs[0]].op == "param"]
    ids = rng.integers(0, cfg.vocab_size, (1, 5))
    first = np_loss(cfg, m.params, ids, ids)
    losses = [tr.step(ids) for _ in range(2)]
    # bf16 products (u = 2^-8) over a vocabulary-sized log-softmax: well inside 1e-2
    np.testing.assert_allclose(losses[0], first, rtol=1e-2)
    assert abs(losses[0] - first) > 1e-6 * first      # (and not the f32 computation)
    assert losses[1] < losses[0]
    tr.update_model()
    after = m.params["model.layers.0.mlp.down_proj.weight"]
    assert after.dtype == np.float32 and not np.array_equal(after, before)


def test_bert_trainer_in_f16_tracks_the_f32_one():
    """BertTrainer(precision="f16"): autocast encoder, GradScaler loss scaling, half copies of
    the dense weights and biases; the losses follow the f32 trainer's."""
    from rlx_numba.models import BertModel
    from test_bert_train import SMALL
    ids = np.random.default_rng(0).integers(1, SMALL.vocab_size, (2, 5))
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], bool)
    types, labels = np.array([[0, 0, 1, 1, 1], [0] * 5]), np.array([1, 0])
    losses = {}
    for p in ("f32", "f16"):
        m = BertModel.from_config(SMALL, seed=9, std=0.3)
        tr = m.trainer(2, 5, rlx.optim.AdamW(lr=2e-2), exec_mode="stream", seed=1, precision=p)
        losses[p] = [tr.step(ids, labels, mask, types) for _ in range(2)]
    assert "__train__.half.encoder.layer.0.intermediate.dense.weight" in \
        [n.name for n in tr.trainer.graph.nodes]
    assert tr.trainer.loss_scale == 2.0 ** 16 and tr.trainer.optimizer_steps == 2
    np.testing.assert_allclose(losses["f16"], losses["f32"], rtol=1e-3)
    assert losses["f16"][0] != losses["f32"][0] and losses["f16"][1] < losses["f16"][0]
