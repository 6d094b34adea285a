"""attention's VJP (FlashAttention-2 style backward, kernels/attention_bwd.py): dQ, dK, dV (and
dbias) against central finite differences of a float64 NumPy attention written here, for every
attribute: causal / not (Sq <, =, > Sk), window, bool mask (a row with every key masked),
bias, scale, softcap, GQA / MQA, the rank-3 [B, S, H*D] layout; tiny odd shapes (simulator)."""
import numpy as np
import pytest

import rlx_numba as rlx
from gradcheck import check
from test_attention import ref_attention


def attention64(q, k, v, causal=False, window=None, mask=None, bias=None, scale=None,
                softcap=None, num_heads=None):
    """float64 attention; q [B, Hq, Sq, D], k / v [B, Hkv, Sk, D] (or rank 3 with num_heads)."""
    rank3 = q.ndim == 3
    if rank3:
        b, sq, hd = q.shape
        d = hd // num_heads
        q = q.reshape(b, sq, num_heads, d).transpose(0, 2, 1, 3)
        k, v = (t.reshape(b, t.shape[1], -1, d).transpose(0, 2, 1, 3) for t in (k, v))
    o = ref_attention(q, k, v, causal, window, mask, bias, scale, softcap)
    if rank3:
        o = o.transpose(0, 2, 1, 3).reshape(b, sq, num_heads * d)
    return o


def _grad_case(rng, qs, ks, *, mask=None, bias=None, wrt=("q", "k", "v"), sample=None, **kw):
    g = rlx.Graph("attn_grad")
    q, k, v = g.input("q", qs), g.input("k", ks), g.input("v", ks)
    feed = {"q": rng.standard_normal(qs), "k": rng.standard_normal(ks),
            "v": rng.standard_normal(ks)}
    extra = {}
    if mask is not None:
        extra["mask"] = g.input("mask", mask.shape, "bool")
        feed["mask"] = mask
    if bias is not None:
        extra["bias"] = g.input("bias", bias.shape)
        feed["bias"] = bias
    y = g.attention(q, k, v, **extra, **kw)
    seed = rng.standard_normal(y.shape)
    tensors = {"q": q, "k": k, "v": v, **extra}
    check(g, y, {n: tensors[n] for n in wrt}, feed,
          lambda **f: attention64(f["q"], f["k"], f["v"], mask=f.get("mask"),
                                  bias=f.get("bias"), **kw), seed=seed, sample=sample)


CASES = {
    # name: (q shape, k shape, attributes)
    "plain": ((1, 2, 5, 3), (1, 2, 7, 3), {}),
    "causal_sq_lt_sk": ((1, 2, 3, 5), (1, 1, 6, 5), {"causal": True}),        # GQA 2:1
    "causal_square": ((2, 1, 6, 4), (2, 1, 6, 4), {"causal": True}),
    "causal_sq_gt_sk": ((1, 1, 7, 3), (1, 1, 4, 3), {"causal": True}),        # rows with no key
    "window": ((1, 2, 6, 3), (1, 2, 9, 3), {"window": 3}),
    "window_causal": ((1, 1, 9, 2), (1, 1, 9, 2), {"window": 2, "causal": True}),
    "softcap_scale": ((1, 2, 5, 3), (1, 2, 6, 3), {"softcap": 1.5, "scale": 1.3}),
    "mqa_4": ((1, 4, 5, 2), (1, 1, 5, 2), {"causal": True, "scale": 0.6}),
    "d_9": ((1, 1, 5, 9), (1, 1, 6, 9), {}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_attention_grad(rng, name):
    qs, ks, kw = CASES[name]
    _grad_case(rng, qs, ks, **kw)


def test_attention_grad_rank3_gqa(rng):
    """[B, S, H*D] with num_heads: 4 query heads over 2 key/value heads, D 3, causal."""
    _grad_case(rng, (2, 5, 12), (2, 6, 6), num_heads=4, causal=True)


def test_attention_grad_mask(rng):
    """A bool keep-mask broadcast over heads, with one query row that keeps no key (its output
    and its gradients are zeros), plus softcap."""
    mask = rng.random((1, 1, 5, 6)) < 0.6
    mask[0, 0, 2] = False
    mask[0, 0, 0, 0] = True
    _grad_case(rng, (2, 2, 5, 3), (2, 2, 6, 3), mask=mask, softcap=2.0)


@pytest.mark.parametrize("bias_shape", [(1, 2, 4, 5), (5,)])
def test_attention_grad_bias(rng, bias_shape):
    """An additive bias, differentiated too: dS summed over its broadcast dims."""
    _grad_case(rng, (2, 2, 4, 3), (2, 1, 5, 3), bias=rng.standard_normal(bias_shape),
               wrt=("q", "k", "v", "bias"), causal=True)


def test_attention_grad_no_sq_by_sk_node(rng):
    """Without a bias gradient no backward node is [.., Sq, Sk]: the probabilities are
    recomputed from the log-sum-exp, which the forward's flash kernel saves (no step of its
    own); after the decode kernel (few queries a key/value head) the LSE node has its step."""
    for sq, saved in ((24, True), (8, False)):
        g = rlx.Graph("attn_nodes")
        q, k, v = (g.input(n, (1, 2, s, 4)) for n, s in (("q", sq), ("k", 16), ("v", 16)))
        y = g.attention(q, k, v, causal=True)
        grads = g.grad(g.reduce_sum(y), [q, k, v])
        g.set_outputs(grads)
        start = y.id + 1
        assert [tuple(n.shape) for n in g.nodes[start:] if n.shape[-2:] == (sq, 16)] == []
        assert {n.op for n in g.nodes[start:]} >= {"attention_lse", "attention_bwd_delta",
                                                    "attention_bwd_dq", "attention_bwd_dkv"}
        assert [t.shape for t in grads] == [q.shape, k.shape, v.shape]
        exe = rlx.compile(g)
        lse = next(n.id for n in g.nodes if n.op == "attention_lse")
        assert (not exe._node_steps[lse]) == saved
        assert ("+lse" in exe._node_steps[y.id][0].kernel_name) == saved


def test_attention_grad_constant_bias_no_ds(rng):
    """A constant bias (a mask as numbers) takes no gradient: its dS node is dead, never run."""
    bias = np.where(rng.random((4, 5)) < 0.3, -np.inf, 0.0).astype(np.float32)
    bias[:, 0] = 0.0
    g = rlx.Graph("attn_cbias")
    q, k, v = g.input("q", (1, 2, 4, 3)), g.input("k", (1, 2, 5, 3)), g.input("v", (1, 2, 5, 3))
    y = g.attention(q, k, v, bias=g.constant(bias))
    seed = rng.standard_normal(y.shape)
    feed = {"q": rng.standard_normal(q.shape), "k": rng.standard_normal(k.shape),
            "v": rng.standard_normal(k.shape)}
    check(g, y, {"q": q, "k": k, "v": v}, feed,
          lambda **f: attention64(f["q"], f["k"], f["v"], bias=bias.astype(np.float64)),
          seed=seed)
    exe = rlx.compile(g)
    assert not [s for s in exe.steps if "attention_bwd_ds" in s.name]


@pytest.mark.parametrize("sq,sk", [(3, 0), (0, 5)])
def test_attention_grad_empty(sq, sk):
    """No keys: output and dQ are zeros; no queries: dK and dV are zeros (written, not left as
    whatever the arena held)."""
    g = rlx.Graph("attn_empty")
    q, k, v = g.input("q", (1, 2, sq, 4)), g.input("k", (1, 2, sk, 4)), g.input("v", (1, 2, sk, 4))
    y = g.attention(q, k, v, causal=True)
    grads = g.grad(g.reduce_sum(y * 1.0), [q, k, v])
    g.set_outputs([y, *grads])
    out = rlx.compile(g).run({"q": np.ones(q.shape, np.float32),
                              "k": np.ones(k.shape, np.float32),
                              "v": np.ones(k.shape, np.float32)})
    for o, t in zip(out, [y, q, k, v]):
        assert o.shape == t.shape and not np.any(o)


def test_attention_grad_rank3_everything(rng):
    """Rank 3, GQA 3:1, window, a mask broadcast over batch, softcap and a differentiated
    bias broadcast over batch and heads, Sq < Sk."""
    mask = rng.random((1, 3, 5, 7)) < 0.8
    _grad_case(rng, (2, 5, 6), (2, 7, 2), num_heads=3, window=3, mask=mask, softcap=1.7,
               bias=rng.standard_normal((5, 7)), wrt=("q", "k", "v", "bias"))


def test_attention_grad_several_tiles(rng):
    """Several row and column tiles each way (the simulator's tiles: 16 x 16), Sq != Sk,
    GQA 2:1, a head dim of three groups of 4 a thread (d 36: 12 dims a thread of 4 lanes,
    zero-padded to 48), a window shorter than a tile, softcap and scale."""
    _grad_case(rng, (1, 2, 20, 36), (1, 1, 40, 36), sample=40, causal=True, window=13,
               softcap=3.0, scale=0.4)


@pytest.mark.parametrize("wrt", [("q", "k", "v"), ("q",), ("q", "k", "v", "bias")])
def test_attention_grad_one_backward_node(wrt):
    """One attention_bwd_dq node gives dQ and its further results [dK, dV] and delta (cuDNN's
    tier computes all three in one call); the numba tier fills them with the delta, dQ and
    dK / dV kernels as that node's steps, the dK / dV one only when dK or dV is wanted."""
    g = rlx.Graph("attn_one")
    q, k, v = g.input("q", (1, 2, 5, 4)), g.input("k", (1, 1, 6, 4)), g.input("v", (1, 1, 6, 4))
    ts = {"q": q, "k": k, "v": v}
    if "bias" in wrt:
        ts["bias"] = g.input("bias", (5, 6))
    y = g.attention(q, k, v, causal=True, bias=ts.get("bias"))
    g.set_outputs(g.grad(g.reduce_sum(y), [ts[n] for n in wrt]))
    (node,) = [n for n in g.nodes if n.op == "attention_bwd_dq"]
    assert [g.nodes[r].op for r in node.results] == ["attention_bwd_dkv", "attention_bwd_delta"]
    assert [g.nodes[r].shape for r in node.results] == [(2, 1, 1, 6, 4), (1, 2, 5)]
    exe = rlx.compile(g)
    names = [s.kernel_name.split()[0] for s in exe._node_steps[node.id]]
    assert names == ["attention_bwd_delta", "attention_bwd_dq"] + (
        ["attention_bwd_dkv"] if "k" in wrt else [])
    assert not any(exe._node_steps.get(r) for r in node.results)


def test_attention_bwd_errors():
    g = rlx.Graph("attn_err")
    q, k = g.input("q", (1, 2, 5, 4)), g.input("k", (1, 1, 6, 4))
    y = g.attention(q, k, k)
    lse = g.bind("attention_lse", (y, q, k), **y.node.attrs)
    with pytest.raises(ValueError, match=r"attention_bwd_dkv: a further result of "
                                         r"attention_bwd_dq"):
        g.bind("attention_bwd_dkv", [q], **y.node.attrs)
    with pytest.raises(ValueError, match=r"attention_bwd_dq: O \[1, 2, 6, 4\], dO \[1, 2, 5, 4\] "
                                         r"and LSE \[1, 2, 5\] must be q's \[1, 2, 5, 4\]"):
        g.bind("attention_bwd_dq", (q, k, k, g.input("o", (1, 2, 6, 4)), y, lse),
               **y.node.attrs)


def test_attention_grad_deterministic_marks_the_backward():
    """grad(deterministic=True) marks the backward node (cuDNN's fused backward adds dQ with
    atomics: its tier passes such a node to the numba kernels, which use none)."""
    for det in (False, True):
        g = rlx.Graph("attn_det")
        q, k = g.input("q", (1, 2, 5, 4)), g.input("k", (1, 2, 6, 4))
        g.grad(g.reduce_sum(g.attention(q, k, k)), [q, k], deterministic=det)
        (node,) = [n for n in g.nodes if n.op == "attention_bwd_dq"]
        assert node.attrs.get("deterministic", False) == det
