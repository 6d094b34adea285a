"""rlx.optim and rlx.compile_train: each optimizer's first steps against NumPy implementations
of torch.optim's update rules written here (float64), clip_grad_norm against torch's
clip_grad_norm_ rule, a small model trained against a NumPy training loop, set_lr, and the
errors."""
import re

import numpy as np
import pytest

import rlx_numba as rlx
from rlx_numba.optim import SGD, Adam, AdamW

W_SHAPE, B_SHAPE = (5, 7), (3,)      # w spans two update chunks in the simulator (32 each)
SCALES = (1.0, 0.3, 1.7, 0.1)       # per-step gradient scales: v falls at some step (amsgrad)


# ---- NumPy references of torch.optim (torch/optim/sgd.py, adam.py, clip_grad.py) --------------
def sgd_ref(lr, momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0):
    state = {}

    def step(k, p, g):
        d = g + weight_decay * p if weight_decay else g
        if momentum:
            buf = state.get(k)
            buf = d.copy() if buf is None else momentum * buf + (1 - dampening) * d
            state[k] = buf
            d = d + momentum * buf if nesterov else buf
        return p - lr * d
    return step


def adam_ref(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False,
             decoupled=False):
    state = {}

    def step(k, p, g):
        m, v, vmax, t = state.get(k, (np.zeros_like(p), np.zeros_like(p), np.zeros_like(p), 0))
        t += 1
        if weight_decay and decoupled:
            p = p * (1 - lr * weight_decay)
        elif weight_decay:
            g = g + weight_decay * p
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        if amsgrad:
            vmax = np.maximum(vmax, v)
        bc1, bc2 = 1 - betas[0] ** t, 1 - betas[1] ** t
        denom = np.sqrt(vmax if amsgrad else v) / np.sqrt(bc2) + eps
        state[k] = (m, v, vmax, t)
        return p - lr / bc1 * m / denom
    return step


def clip_ref(grads, max_norm):
    total = np.sqrt(sum(float((g ** 2).sum()) for g in grads.values()))
    coef = min(max_norm / (total + 1e-6), 1.0)
    return {k: g * coef for k, g in grads.items()}


# ---- a model whose gradients are known in closed form -----------------------------------------
def quad_model():
    """loss = sum(c * w^2) / 2 + sum(d * b^2) / 2 + sum(e * b): dw = c * w, db = d * b + e."""
    g = rlx.Graph("quad")
    c, d, e = g.input("c", W_SHAPE), g.input("d", B_SHAPE), g.input("e", B_SHAPE)
    w, b = g.param("w", W_SHAPE), g.param("b", B_SHAPE)
    loss = g.reduce_sum(c * w * w) * 0.5 + g.reduce_sum(d * b * b) * 0.5 + g.reduce_sum(e * b)
    g.set_outputs([loss])
    return g, loss


def quad_grads(p, feed):
    return {"w": feed["c"] * p["w"], "b": feed["d"] * p["b"] + feed["e"]}


def quad_loss(p, feed):
    return float((feed["c"] * p["w"] ** 2).sum() / 2 + (feed["d"] * p["b"] ** 2).sum() / 2
                 + (feed["e"] * p["b"]).sum())


def quad_feeds(rng, n):
    return [{"c": rng.uniform(0.5, 2.0, W_SHAPE).astype(np.float32) * s,
             "d": rng.uniform(0.5, 2.0, B_SHAPE).astype(np.float32) * s,
             "e": rng.standard_normal(B_SHAPE).astype(np.float32) * s} for s in SCALES[:n]]


def train_quad(rng, opt, ref_step, clip=None, steps=4):
    """Train quad_model ``steps`` steps on the device and in NumPy; compare every step."""
    g, loss = quad_model()
    tr = rlx.compile_train(g, loss, opt, clip_grad_norm=clip)
    p = {"w": rng.standard_normal(W_SHAPE).astype(np.float32),
         "b": rng.standard_normal(B_SHAPE).astype(np.float32)}
    for k, v in p.items():
        tr.set_param(k, v)
    p = {k: v.astype(np.float64) for k, v in p.items()}
    for feed in quad_feeds(rng, steps):
        f64 = {k: v.astype(np.float64) for k, v in feed.items()}
        got = tr.step(feed)
        np.testing.assert_allclose(got, quad_loss(p, f64), rtol=1e-5, atol=1e-6)
        grads = quad_grads(p, f64)
        if clip is not None:
            grads = clip_ref(grads, clip)
        p = {k: ref_step(k, p[k], grads[k]) for k in p}
        for k in p:
            np.testing.assert_allclose(tr.get_param(k), p[k], rtol=2e-5, atol=2e-6, err_msg=k)
    return tr, p


SGD_CASES = [dict(), dict(momentum=0.9), dict(momentum=0.9, dampening=0.3),
             dict(momentum=0.9, nesterov=True), dict(momentum=0.8, weight_decay=0.1),
             dict(weight_decay=0.05)]


@pytest.mark.parametrize("kw", SGD_CASES, ids=lambda kw: ",".join(kw) or "plain")
def test_sgd_matches_torch_rule(rng, kw):
    tr, _ = train_quad(rng, SGD(0.1, **kw), sgd_ref(0.1, **kw))
    if kw.get("momentum"):
        assert set(tr.optimizer_state("w")) == {"momentum_buffer"}


ADAM_CASES = [dict(), dict(weight_decay=0.1), dict(amsgrad=True, betas=(0.9, 0.5)),
              dict(amsgrad=True, betas=(0.8, 0.6), weight_decay=0.05),
              dict(betas=(0.8, 0.99), eps=1e-3)]


@pytest.mark.parametrize("kw", ADAM_CASES, ids=lambda kw: ",".join(kw) or "default")
def test_adam_matches_torch_rule(rng, kw):
    tr, p = train_quad(rng, Adam(lr=0.05, **kw), adam_ref(lr=0.05, **kw))
    st = tr.optimizer_state("w")
    ams = {"max_exp_avg_sq"} if kw.get("amsgrad") else set()
    assert set(st) == {"exp_avg", "exp_avg_sq"} | ams
    if kw.get("amsgrad"):     # the case is only a test of amsgrad if the max mattered
        assert (st["max_exp_avg_sq"] > st["exp_avg_sq"] * (1 + 1e-3)).any()


@pytest.mark.parametrize("kw", [dict(), dict(weight_decay=0.2, amsgrad=True, betas=(0.9, 0.5))],
                         ids=["default", "wd,amsgrad"])
def test_adamw_matches_torch_rule(rng, kw):
    train_quad(rng, AdamW(lr=0.05, **kw), adam_ref(lr=0.05, decoupled=True,
                                                    **{"weight_decay": 0.01, **kw}))


def test_adam_and_adamw_differ_in_weight_decay(rng):
    """The same weight_decay: L2 in the gradient (Adam) and decoupled (AdamW) give different
    params, each its own torch rule (checked above); here only that they are not mixed up."""
    seed = int(rng.integers(1 << 30))
    _, p1 = train_quad(np.random.default_rng(seed), Adam(lr=0.05, weight_decay=0.3),
                       adam_ref(lr=0.05, weight_decay=0.3), steps=2)
    _, p2 = train_quad(np.random.default_rng(seed), AdamW(lr=0.05, weight_decay=0.3),
                       adam_ref(lr=0.05, weight_decay=0.3, decoupled=True), steps=2)
    assert not np.allclose(p1["w"], p2["w"], rtol=1e-4)


@pytest.mark.parametrize("opt,ref,max_norm", [
    (lambda: SGD(0.1, momentum=0.9), lambda: sgd_ref(0.1, momentum=0.9), 0.5),
    (lambda: SGD(0.1, momentum=0.9), lambda: sgd_ref(0.1, momentum=0.9), 1e4),
    (lambda: AdamW(lr=0.05, eps=0.5), lambda: adam_ref(lr=0.05, eps=0.5, weight_decay=0.01,
                                                       decoupled=True), 0.5)],
    ids=["sgd-clipped", "sgd-unclipped", "adamw-clipped"])
def test_clip_grad_norm(rng, opt, ref, max_norm):
    tr, _ = train_quad(rng, opt(), ref(), clip=max_norm, steps=3)
    kernels = [s.kernel.py_func.__name__ for s in tr.exe.steps[-2:]]
    assert kernels[0] == "grad_sumsq" and kernels[1].endswith("_update")


def test_gradient_that_is_a_param_gets_its_own_arena_copy(rng, monkeypatch):
    """A VJP may hand an operand back as a gradient: d sum(w * v) / dw is v itself, a param
    outside the arena; compile_train copies such a gradient into the arena for the update."""
    from rlx_numba.ir import autodiff
    monkeypatch.setitem(autodiff.VJPS, "binary",
                        lambda g, n, dy: [g.tensor(n.inputs[1]), g.tensor(n.inputs[0])])
    g = rlx.Graph("dot")
    w, v = g.param("w", (5,)), g.param("v", (5,))
    loss = g.reduce_sum(w * v)
    g.set_outputs([loss])
    tr = rlx.compile_train(g, loss, SGD(0.1))
    wv, vv = rng.standard_normal(5).astype(np.float32), rng.standard_normal(5).astype(np.float32)
    tr.set_param("w", wv)
    tr.set_param("v", vv)
    np.testing.assert_allclose(tr.step(), float((wv * vv).sum()), rtol=1e-5)
    np.testing.assert_allclose(tr.get_param("w"), wv - 0.1 * vv, rtol=1e-6)
    np.testing.assert_allclose(tr.get_param("v"), vv - 0.1 * wv, rtol=1e-6)


def test_one_update_launch_for_all_params(rng):
    g, loss = quad_model()
    tr = rlx.compile_train(g, loss, Adam())
    names = [s.kernel.py_func.__name__ for s in tr.exe.steps]
    assert names.count("adam_update") == 1 and names[-1] == "adam_update"
    assert "grad_sumsq" not in names


# ---- compile_train on a small model -----------------------------------------------------------
def tanh_model(extra=False):
    """loss = mean((tanh(x * w + b) - t)^2), w [7, 9], b [9] broadcast over rows."""
    g = rlx.Graph("tanh_fit")
    x, t = g.input("x", (7, 9)), g.input("t", (7, 9))
    w, b = g.param("w", (7, 9)), g.param("b", (9,))
    z = x * w + b
    if extra:   # params compile_train must leave alone: unused, behind stop_gradient, f16
        g.param("unused", (4,))
        s = g.param("frozen", (9,))
        h = g.param("half", (9,), "f16")
        z = z + g.stop_gradient(s) * 0.5 + g.cast(h, "f32")
    d = g.tanh(z) - t
    loss = g.reduce_mean(d * d)
    g.set_outputs([loss])
    return g, loss


def tanh_step(x, t, w, b, c=0.0):
    h = np.tanh(x * w + b + c)
    d = h - t
    dz = 2 * d / d.size * (1 - h * h)
    return float((d * d).mean()), dz * x, dz.sum(0)


def _batches(rng, n):
    return [(rng.standard_normal((7, 9)).astype(np.float32),
             rng.uniform(-0.9, 0.9, (7, 9)).astype(np.float32)) for _ in range(n)]


@pytest.mark.parametrize("mode", ["graph", "stream", "eager"])
def test_compile_train_matches_numpy_loop(rng, mode):
    g, loss = tanh_model()
    n_nodes, outs = len(g.nodes), list(g.outputs)
    tr = rlx.compile_train(g, loss, AdamW(lr=0.05, weight_decay=0.1), exec_mode=mode)
    assert tr.params == ["w", "b"]
    assert len(g.nodes) == n_nodes and g.outputs == outs      # the user's graph is unchanged
    w = rng.standard_normal((7, 9)).astype(np.float32)
    b = rng.standard_normal(9).astype(np.float32) * 0.3
    tr.set_param("w", w)
    tr.set_param("b", b)
    ref = adam_ref(lr=0.05, weight_decay=0.1, decoupled=True)
    w, b = w.astype(np.float64), b.astype(np.float64)
    for x, t in _batches(rng, 4):
        want, dw, db = tanh_step(x.astype(np.float64), t.astype(np.float64), w, b)
        np.testing.assert_allclose(tr.step({"x": x, "t": t}), want, rtol=1e-5)
        w, b = ref("w", w, dw), ref("b", b, db)
        np.testing.assert_allclose(tr.get_param("w"), w, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(tr.get_param("b"), b, rtol=1e-4, atol=1e-5)
    assert tr.steps_done == 4
    # the user's graph still runs (on the trained values, through the trainer's store)
    exe = rlx.compile(g, params=tr.exe.params)
    x, t = _batches(rng, 1)[0]
    want = tanh_step(x.astype(np.float64), t.astype(np.float64), w, b)[0]
    np.testing.assert_allclose(exe.run({"x": x, "t": t})[0], want, rtol=1e-4)
    np.testing.assert_allclose(tr.step({"x": x, "t": t}), want, rtol=1e-4)


def test_default_params_skip_unreachable_frozen_and_half(rng):
    g, loss = tanh_model(extra=True)
    tr = rlx.compile_train(g, loss, SGD(0.5, momentum=0.5))
    assert tr.params == ["w", "b"]
    w, b = rng.standard_normal((7, 9)).astype(np.float32), np.zeros(9, np.float32)
    frozen = rng.standard_normal(9).astype(np.float32)
    half = rng.standard_normal(9).astype(np.float16)
    for k, v in dict(w=w, b=b, unused=np.ones(4, np.float32), frozen=frozen, half=half).items():
        tr.set_param(k, v)
    c = frozen.astype(np.float64) * 0.5 + half.astype(np.float64)
    ref = sgd_ref(0.5, momentum=0.5)
    w, b = w.astype(np.float64), b.astype(np.float64)
    for x, t in _batches(rng, 3):
        want, dw, db = tanh_step(x.astype(np.float64), t.astype(np.float64), w, b, c)
        np.testing.assert_allclose(tr.step({"x": x, "t": t}), want, rtol=1e-5)
        w, b = ref("w", w, dw), ref("b", b, db)
    np.testing.assert_allclose(tr.get_param("w"), w, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(tr.get_param("b"), b, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(tr.get_param("frozen"), frozen)
    np.testing.assert_array_equal(tr.get_param("unused"), np.ones(4, np.float32))
    # explicit params: only those train
    tr2 = rlx.compile_train(g, loss, SGD(0.5), params=[g.tensor(g._leaf_names["b"])])
    assert tr2.params == ["b"]


def test_set_lr_changes_the_next_step_without_recompiling(rng):
    g, loss = tanh_model()
    tr = rlx.compile_train(g, loss, Adam(lr=0.05))
    exe, steps = tr.exe, tr.exe.steps
    w = rng.standard_normal((7, 9)).astype(np.float32)
    b = np.zeros(9, np.float32)
    tr.set_param("w", w)
    tr.set_param("b", b)
    lrs = [0.05, 0.05, 0.2, 0.001]
    state, w, b = {}, w.astype(np.float64), b.astype(np.float64)
    for lr, (x, t) in zip(lrs, _batches(rng, 4)):
        tr.set_lr(lr)
        assert tr.lr == lr
        _, dw, db = tanh_step(x.astype(np.float64), t.astype(np.float64), w, b)
        tr.step({"x": x, "t": t})
        # torch keeps the state across lr changes (param_groups[0]["lr"] = lr)
        for k, p, gr in (("w", w, dw), ("b", b, db)):
            m, v, tt = state.get(k, (0.0, 0.0, 0))
            tt += 1
            m, v = 0.9 * m + 0.1 * gr, 0.999 * v + 0.001 * gr * gr
            state[k] = (m, v, tt)
            p = p - lr / (1 - 0.9 ** tt) * m / (np.sqrt(v) / np.sqrt(1 - 0.999 ** tt) + 1e-8)
            if k == "w":
                w = p
            else:
                b = p
        np.testing.assert_allclose(tr.get_param("w"), w, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(tr.get_param("b"), b, rtol=1e-4, atol=1e-5)
    assert tr.exe is exe and tr.exe.steps is steps


def test_memory_report_and_repr(rng):
    g, loss = tanh_model()
    tr = rlx.compile_train(g, loss, AdamW(), clip_grad_norm=1.0)
    r = tr.memory_report()
    assert r["trained_params"] == 2
    assert r["trained_param_bytes"] == 256 + 256        # w (63 f32) and b (9 f32), 256-aligned
    assert r["optimizer_state_bytes"] == 2 * 512         # exp_avg, exp_avg_sq
    assert r["grad_bytes"] == 512
    assert 0 < r["saved_for_backward_bytes"] <= r["arena_bytes"]
    assert "optimizer state" in str(r) and "saved for bwd" in str(r)
    assert "AdamW" in repr(tr) and "2 params" in repr(tr)
    tr.set_param("w", rng.standard_normal((7, 9)).astype(np.float32))
    tr.set_param("b", np.zeros(9, np.float32))
    x, t = _batches(rng, 1)[0]
    prof = tr.profile({"x": x, "t": t})
    assert tr.steps_done == 3 and "adam_update" in str(prof) and "grad_sumsq" in str(prof)


# ---- errors -----------------------------------------------------------------------------------
@pytest.mark.parametrize("make,msg", [
    (lambda: SGD(-0.1), "SGD: lr must satisfy 0.0 <= lr"),
    (lambda: SGD(0.1, momentum=-1), "SGD: momentum must satisfy"),
    (lambda: SGD(0.1, 0.9, 0.0, 1e-4), "takes from 2 to 3 positional arguments"),
    (lambda: SGD(0.1, nesterov=True), "nesterov=True requires momentum > 0 and dampening == 0"),
    (lambda: SGD(0.1, momentum=0.9, dampening=0.1, nesterov=True), "dampening == 0"),
    (lambda: SGD(0.1, weight_decay=-1e-3), "SGD: weight_decay must satisfy"),
    (lambda: SGD(float("nan")), "SGD: lr must be a finite number"),
    (lambda: Adam(lr="0.1"), "Adam: lr must be a finite number"),
    (lambda: Adam(betas=(1.0, 0.9)), "Adam: betas[0] must satisfy 0.0 <= betas[0] < 1.0"),
    (lambda: Adam(betas=(0.9, -0.1)), "Adam: betas[1] must satisfy"),
    (lambda: Adam(betas=0.9), "Adam: betas must be a pair"),
    (lambda: Adam(eps=-1e-8), "Adam: eps must satisfy"),
    (lambda: AdamW(weight_decay=-0.01), "AdamW: weight_decay must satisfy"),
    (lambda: AdamW(amsgrad=1), "AdamW: amsgrad must be a bool"),
])
def test_optimizer_argument_errors(make, msg):
    with pytest.raises((ValueError, TypeError), match=re.escape(msg)):
        make()


def test_compile_train_deterministic_embedding(rng):
    """deterministic=True: the embedding's gradient through the ordered scatter_add (index
    order, the same bits every step); one SGD step against NumPy's np.add.at."""
    g = rlx.Graph("emb")
    e = g.param("e", (6, 3))
    ids = g.input("ids", (8,), "i32")
    r = g.input("r", (8, 3))
    loss = g.reduce_sum(g.gather(e, ids, 0) * r)
    g.set_outputs([loss])
    tr = rlx.compile_train(g, loss, SGD(0.5), deterministic=True)
    assert [n.attrs["deterministic"] for n in tr.exe.graph.nodes if n.op == "scatter_add"] == [True]
    ev = rng.standard_normal((6, 3)).astype(np.float32)
    iv = np.array([2, 0, 2, 5, 2, 1, 0, 2], np.int32)
    rv = rng.standard_normal((8, 3)).astype(np.float32)
    tr.set_param("e", ev)
    tr.step({"ids": iv, "r": rv})
    d = np.zeros_like(ev)
    np.add.at(d, iv, rv)
    np.testing.assert_array_equal(tr.get_param("e"), ev - np.float32(0.5) * d)


def test_compile_train_errors():
    g, loss = tanh_model(extra=True)
    nodes = {n.name: g.tensor(n.id) for n in g.nodes if n.name}
    other = rlx.Graph("other")
    ow = other.param("w", (7, 9))
    cases = [
        (dict(loss=nodes["x"] * 2.0), "loss must be a float scalar"),
        (dict(params=["half"]), "param 'half' is f16 [9]; only f32 params can be trained"),
        (dict(params=["nope"]), "graph 'tanh_fit' has no param 'nope'"),
        (dict(params=[ow]), "belongs to graph 'other'"),
        (dict(params=[nodes["x"]]), "is not a param (it is a input node)"),
        (dict(params=["x"]), "has no param 'x'"),
        (dict(params=["unused"]), "does not depend on param 'unused'"),
        (dict(params=["frozen"]), "does not depend on param 'frozen'"),
        (dict(params=["w", "w"]), "listed twice"),
        (dict(params=[3]), "params[0] must be a param Tensor or its name"),
        (dict(optimizer="adam"), "optimizer must be a rlx_numba.optim optimizer"),
        (dict(exec_mode="multistream(2)"), "exec_mode MULTISTREAM(2) is not supported"),
        (dict(clip_grad_norm=-1.0), "clip_grad_norm must satisfy 0.0 <= clip_grad_norm"),
        (dict(deterministic="yes"), "grad: deterministic must be a bool"),
        (dict(loss=ow), "belongs to graph 'other'"),
    ]
    for kw, msg in cases:
        args = {"loss": loss, "optimizer": SGD(0.1), **kw}
        with pytest.raises(ValueError, match=re.escape(msg)):
            rlx.compile_train(g, args.pop("loss"), **args)
    i = rlx.Graph("ints")
    k = i.input("k", (3,), "i32")
    with pytest.raises(ValueError, match="depends on no f32 param"):
        rlx.compile_train(i, i.reduce_sum(i.cast(k, "f32")), SGD(0.1))


def test_sharing_the_store_with_a_graph_that_stores_a_trained_weight_transposed():
    """A graph reading a trained param only as a product's weight would store it [N, K]: a
    second copy the update would not write, so compiling it against the store is refused."""
    g = rlx.Graph("sq")
    w = g.param("w", (3, 4))
    loss = g.reduce_sum(w * w)
    g.set_outputs([loss])
    tr = rlx.compile_train(g, loss, SGD(0.1))
    h = rlx.Graph("use")
    h.set_outputs([h.matmul(h.input("x", (2, 3)), h.param("w", (3, 4)))])
    with pytest.raises(ValueError, match="param 'w' is trained .* would store it \\[N, K\\]"):
        rlx.compile(h, params=tr.exe.params)


def test_trainer_errors(rng):
    g, loss = tanh_model()
    tr = rlx.compile_train(g, loss, SGD(0.1))
    x, t = _batches(rng, 1)[0]
    with pytest.raises(ValueError, match=r"param\(s\) never set: b, w"):
        tr.step({"x": x, "t": t})
    assert tr.steps_done == 0
    with pytest.raises(ValueError, match="SGD: lr must satisfy"):
        tr.set_lr(-1.0)
    with pytest.raises(ValueError, match="reserved for the optimizer"):
        tr.step({"x": x, "t": t, "__optim_hyper__": np.zeros(4, np.float32)})
    with pytest.raises(ValueError, match="'x' is not a trained param"):
        tr.optimizer_state("x")
    with pytest.raises(ValueError, match="set_param: graph 'tanh_fit' has no param 'q'"):
        tr.set_param("q", np.zeros(3, np.float32))
