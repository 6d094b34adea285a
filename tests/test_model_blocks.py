"""rlx_numba.models.blocks (the blocks build_llama, build_bert, build_mamba and build_vit are
composed of) on tiny shapes against NumPy (float64), and the checks of their arguments. The
whole models are tested in test_models.py, test_fused_decoder.py, test_moe.py and the rest."""
import math

import numpy as np
import pytest

from conftest import run_graph
from rlx_numba import Graph
from rlx_numba.models.blocks import (Weights, add_norm, decoder_attention, decoder_positions,
                                     embedding, encoder_attention, gated_mlp, lm_head, mlp,
                                     norm)
from rlx_numba.models.llama import LlamaConfig


def close(got, want, tol=2e-4):
    want = np.asarray(want, np.float64)
    err = np.abs(np.asarray(got, np.float64) - want).max() / max(np.abs(want).max(), 1e-30)
    assert err < tol, f"relative error {err:.3g}"


def _params(rng, shapes):
    return {k: (0.3 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}


def _silu(x):
    return x / (1 + np.exp(-x))


@pytest.mark.parametrize("fused", [True, False])
def test_gated_mlp_embedding_and_head(rng, fused):
    """embedding -> gated_mlp (fused: one interleaved gate/up product) -> lm_head, with biases."""
    v, h, i = 11, 8, 12
    shapes = {"emb.weight": (v, h), "head.weight": (v, h), "mlp.down_proj.weight": (h, i),
              "mlp.down_proj.bias": (h,)}
    parts = {f"mlp.{m}_proj.{t}": (i, h) if t == "weight" else (i,)
             for m in ("gate", "up") for t in ("weight", "bias")}
    P = _params(rng, {**shapes, **parts})
    if fused:                          # gate's and up's rows interleaved, as graph_params packs
        for t in ("weight", "bias"):
            gate, up = P.pop(f"mlp.gate_proj.{t}"), P.pop(f"mlp.up_proj.{t}")
            P[f"mlp.gate_up_proj.{t}"] = np.stack([gate, up], 1).reshape((2 * i,) + gate.shape[1:])
    g = Graph("blocks")
    w = Weights.declare(g, {k: a.shape for k, a in P.items()})
    ids = g.input("ids", (2, 3), "i32")
    x = embedding(w, "emb", ids)
    g.set_outputs([lm_head(w, "head", gated_mlp(w, "mlp.", x, fused=fused))])
    idx = rng.integers(0, v, (2, 3)).astype(np.int32)
    (got,) = run_graph(g, {"ids": idx}, P)
    Q = {k: a.astype(np.float64) for k, a in P.items()}
    if fused:
        gu = Q["mlp.gate_up_proj.weight"], Q["mlp.gate_up_proj.bias"]
        gate_w, up_w, gate_b, up_b = gu[0][0::2], gu[0][1::2], gu[1][0::2], gu[1][1::2]
    else:
        gate_w, up_w = Q["mlp.gate_proj.weight"], Q["mlp.up_proj.weight"]
        gate_b, up_b = Q["mlp.gate_proj.bias"], Q["mlp.up_proj.bias"]
    xe = Q["emb.weight"][idx]
    act = _silu(xe @ gate_w.T + gate_b) * (xe @ up_w.T + up_b)
    y = act @ Q["mlp.down_proj.weight"].T + Q["mlp.down_proj.bias"]
    close(got, y @ Q["head.weight"].T)


def test_encoder_attention_mlp_and_norms(rng):
    """A post-norm encoder layer (BERT's) from the blocks, padded keys masked out."""
    b, s, h, heads, i, eps = 2, 5, 8, 2, 16, 1e-5
    names = ("q", "k", "v", "o")
    shapes = {f"{m}.{t}": (h, h) if t == "weight" else (h,) for m in names
              for t in ("weight", "bias")}
    shapes.update({"up.weight": (i, h), "up.bias": (i,), "down.weight": (h, i),
                   "down.bias": (h,), "ln.weight": (h,), "ln.bias": (h,)})
    P = _params(rng, shapes)
    g = Graph("encoder")
    w = Weights.declare(g, shapes)
    x = g.input("x", (b, s, h))
    mask = g.input("mask", (b, s), "bool")
    a = encoder_attention(w, x, names, num_heads=heads, mask=g.reshape(mask, (b, 1, 1, s)))
    y = norm(w, "ln", a, eps=eps, kind="layer", residual=x)
    g.set_outputs([y, mlp(w, y, "up", "down", activation="relu")])
    xv = rng.standard_normal((b, s, h)).astype(np.float32)
    keep = np.ones((b, s), bool)
    keep[1, 3:] = False
    got_y, got_f = run_graph(g, {"x": xv, "mask": keep}, P)

    Q = {k: a.astype(np.float64) for k, a in P.items()}
    X = xv.astype(np.float64)

    def lin(t, n):
        return t @ Q[n + ".weight"].T + Q[n + ".bias"]

    def split(t):                      # [b, s, h] -> [b, heads, s, d]
        return t.reshape(b, s, heads, h // heads).transpose(0, 2, 1, 3)

    q, k, v = (split(lin(X, n)) for n in "qkv")
    sc = np.where(keep[:, None, None, :], q @ k.transpose(0, 1, 3, 2) / math.sqrt(h // heads),
                  -np.inf)
    pr = np.exp(sc - sc.max(-1, keepdims=True))
    att = ((pr / pr.sum(-1, keepdims=True)) @ v).transpose(0, 2, 1, 3).reshape(b, s, h)
    z = lin(att, "o") + X
    z = (z - z.mean(-1, keepdims=True)) / np.sqrt(z.var(-1, keepdims=True) + eps)
    want_y = z * Q["ln.weight"] + Q["ln.bias"]
    close(got_y, want_y)
    close(got_f, lin(np.maximum(lin(want_y, "up"), 0), "down"))


def test_add_norm_carries_the_residual_stream(rng):
    """add_norm without a branch: (norm(stream), stream); with one: the sum normed and kept."""
    h, eps = 8, 1e-6
    P = _params(rng, {"n.weight": (h,)})
    g = Graph("stream")
    w = Weights.declare(g, {"n.weight": (h,)})
    x, br = g.input("x", (3, h)), g.input("br", (3, h))
    n0, s0 = add_norm(w, "n", None, x, eps=eps)
    n1, s1 = add_norm(w, "n", br, x, eps=eps)
    assert s0 is x
    g.set_outputs([n0, n1, s1])
    xv, bv = (rng.standard_normal((3, h)).astype(np.float32) for _ in range(2))
    got0, got1, got_s = run_graph(g, {"x": xv, "br": bv}, P)

    def rms(t):
        return t / np.sqrt((t * t).mean(-1, keepdims=True) + eps) * P["n.weight"]

    close(got0, rms(xv.astype(np.float64)))
    close(got1, rms(xv.astype(np.float64) + bv))
    close(got_s, xv.astype(np.float64) + bv)


def test_block_argument_checks():
    g = Graph("checks")
    w = Weights.declare(g, {"p.weight": (4, 32), "n.weight": (32,)},
                        quant={"p.weight": ("q8_0", (4, 34))})
    x = g.input("x", (2, 32))
    with pytest.raises(ValueError, match="Weights.linear: p: an activation is fused into a plain"):
        w.linear(x, "p", activation="relu")
    with pytest.raises(ValueError, match="norm: kind must be 'rms' or 'layer'"):
        norm(w, "n", x, eps=1e-6, kind="batch")
    cfg = LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=2)
    g = Graph("attention")
    w = Weights.declare(g, {f"a.{m}_proj.weight": (8, 8) for m in "qkvo"})
    at = decoder_positions(g, cfg, "forward", 1, 2)
    hn = g.input("x", (1, 2, 8))
    with pytest.raises(ValueError, match="a forward graph's none"):
        decoder_attention(w, cfg, "a.", hn, at, fused=False, cache=("k", "v"))
    at = decoder_positions(g, cfg, "decode", 1, 1, cache_len=4)
    with pytest.raises(ValueError, match="a prefill or decode graph's layer takes its cache"):
        decoder_attention(w, cfg, "a.", g.input("y", (1, 1, 8)), at, fused=False)
