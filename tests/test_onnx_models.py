"""rlx.onnx on the patterns torch.onnx.export writes for the issue-35 models (ResNet-18, ViT-B/16,
transformers BERT and Llama; TorchScript opset 17 and dynamo opset 18), each cut down to a few
elements so the simulator runs it in about a second: BERT's embeddings (token_type_ids buffer
longer than 64, GatherElements by position ids) and mask arithmetic (Cast / GatherND / And /
Where / -inf or finfo.min / Softmax / IsNaN), Llama's RMSNorm (Pow / ReduceMean / Sqrt /
Reciprocal) and rotary half-swap (Slice to INT64_MAX / Neg / Concat) with grouped KV heads
(Unsqueeze / Expand / Reshape), ViT's patchify Conv, class-token Concat and packed-QKV split
(Unsqueeze / 5-D Transpose / Squeeze / Gather of a scalar index) and exact-erf GELU.

The oracle is onnx's own ReferenceEvaluator on the same model (NumPy, written by the onnx
project). The full models run on a GPU in bench/bench_onnx.py."""
from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402
from onnx.reference.op_run import OpRun  # noqa: E402

import rlx_numba as rlx  # noqa: E402

F, I64, B = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL
I64_MAX = np.iinfo(np.int64).max
FMIN = float(np.finfo(np.float32).min)


class _GatherElements(OpRun):
    """The oracle's GatherElements: onnx's reference fails past 64 along the axis (np.choose)."""
    op_domain = ""

    def _run(self, data, indices, axis=None):
        i = np.where(indices < 0, indices + data.shape[axis], indices)
        return (np.take_along_axis(data, i, axis),)


_GatherElements.__name__ = "GatherElements"


def _model(nodes, inputs, outputs, inits, opset):
    g = helper.make_graph(nodes, "m", inputs, outputs,
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _vi(name, t, shape):
    return helper.make_tensor_value_info(name, t, shape)


def _n(op, ins, outs, **kw):
    return helper.make_node(op, ins, [outs] if isinstance(outs, str) else outs, **kw)


def _check(model, feeds, rel=2e-6):
    """rlx vs ReferenceEvaluator: max |a - b| / max |b| per output within ``rel`` (a few f32
    roundings through softmax / norms), NaN where the reference has NaN; returns the graph."""
    want = ReferenceEvaluator(model, new_ops=[_GatherElements]).run(None, feeds)
    m = rlx.onnx.load(model)
    got = m.run(feeds)
    for o, a, b in zip(model.graph.output, got, want):
        b = np.asarray(b)
        assert a.shape == b.shape and a.dtype == b.dtype, (o.name, a.shape, b.shape, a.dtype)
        assert not np.isnan(b).any() and not np.isnan(a).any(), o.name
        err = np.abs(a.astype(np.float64) - b).max() / max(np.abs(b).max(), 1e-30)
        assert err <= rel, (o.name, err)
    return m.graph


def _rand(rng, *shape, s=0.5):
    return (rng.standard_normal(shape) * s).astype(np.float32)


def test_gather_elements_fold_past_64():
    """GatherElements on known inputs with more than 64 along the axis (BERT's token_type_ids
    buffer [1, 512] read at position ids): onnx's reference fails there (np.choose holds 64
    choices, its fallback reshapes wrongly), so the fold runs on NumPy; checked against
    take_along_axis written here, negative indices wrapped; out of range is refused by name."""
    buf = np.arange(3 * 70, dtype=np.int64).reshape(3, 70) * 7 - 5
    idx = np.array([[0, 69, -1, 5], [64, -70, 3, 3]], np.int64)     # 2 rows of 3: a prefix
    nodes = [_n("GatherElements", ["buf", "idx"], "y", axis=1)]
    m = rlx.onnx.load(_model(nodes, [], [_vi("y", I64, [2, 4])], {"buf": buf, "idx": idx}, 17))
    (y,) = m.run({})
    want = np.array([[buf[r, i % 70] for i in idx[r]] for r in range(2)])
    np.testing.assert_array_equal(y, want)
    assert m.executable is None                       # folded: nothing runs on the device
    bad = {"buf": buf, "idx": np.array([[70]], np.int64)}
    with pytest.raises(ValueError, match=r"GatherElements.*indices must lie in \[-70, 70\)"):
        rlx.onnx.load(_model(nodes, [], [_vi("y", I64, [1, 1])], bad, 17))


@pytest.mark.filterwarnings("ignore:invalid value encountered")   # the NaN rows, on purpose
@pytest.mark.parametrize("style", ["ts17", "dyn18"])
def test_bert_embeddings_and_mask(style, rng):
    """BERT's embeddings and one attention head with the padding mask, as each exporter writes
    them: ts17 folds the token-type Expand chain (ConstantOfShape / Mul / Equal / Where) and
    masks with -inf (sample 1 fully masked: Softmax gives NaN rows, IsNaN / Where zero them);
    dyn18 takes GatherND of the bool mask, And with a constant, and finfo.min."""
    bs, s, h, v, L = 2, 5, 8, 11, 70
    ins = [_vi("input_ids", I64, [bs, s]), _vi("attention_mask", I64, [bs, s])]
    c = dict(buf=np.zeros((1, L), np.int64), pos=np.arange(s, dtype=np.int64)[None],
             we=_rand(rng, v, h), te=_rand(rng, 2, h), pe=_rand(rng, L, h),
             lw=_rand(rng, h) + 1, lb=_rand(rng, h), wq=_rand(rng, h, h), wk=_rand(rng, h, h),
             wv=_rand(rng, h, h), zero=np.array(0.0, np.float32), scale=np.array(0.5, np.float32),
             rt2=np.array(np.sqrt(2), np.float32), one=np.array(1.0, np.float32),
             half=np.array(0.5, np.float32), bs_s=np.array([bs, s], np.int64),
             two=np.array([2], np.int64), m1=np.array(-1, np.int64), neg=np.array([1, -1]))
    nodes = [_n("ConstantOfShape", ["two"], "ones", value=numpy_helper.from_array(
                 np.ones(1, np.int64))),
             _n("Mul", ["ones", "m1"], "mones"), _n("Equal", ["neg", "mones"], "eq"),
             _n("Where", ["eq", "ones", "neg"], "shp"), _n("Expand", ["buf", "shp"], "bufx"),
             _n("GatherElements", ["bufx", "pos"], "tt0", axis=1),
             _n("Expand", ["tt0", "bs_s"], "tt"),
             _n("Gather", ["we", "input_ids"], "e0"), _n("Gather", ["te", "tt"], "e1"),
             _n("Gather", ["pe", "pos"], "e2"), _n("Add", ["e0", "e1"], "e01"),
             _n("Add", ["e01", "e2"], "e"),
             _n("LayerNormalization", ["e", "lw", "lb"], "x", epsilon=1e-12),
             _n("Cast", ["attention_mask"], "mb", to=B)]
    if style == "ts17":
        c["ninf"] = np.array(-np.inf, np.float32)
        nodes += [_n("Unsqueeze", ["mb", "one_i"], "m1d"), _n("Unsqueeze", ["m1d", "one_i"],
                                                              "m2d"),
                  _n("Expand", ["m2d", "mshape"], "keep"),
                  _n("Where", ["keep", "zero", "ninf"], "bias")]
        c["one_i"] = np.array([1], np.int64)
        c["mshape"] = np.array([bs, 1, s, s], np.int64)
        feeds_mask = np.ones((bs, s), np.int64)
        feeds_mask[1] = 0                       # a fully masked sample: NaN softmax rows
    else:
        c["gidx"] = np.stack(np.meshgrid(np.arange(bs), np.arange(s), indexing="ij"),
                             -1).reshape(bs, 1, 1, s, 2).astype(np.int64)
        c["band"] = np.ones((1, 1, s, 1), bool)
        c["fmin"] = np.array(FMIN, np.float32)
        nodes += [_n("GatherND", ["mb", "gidx"], "mg"), _n("And", ["band", "mg"], "keep"),
                  _n("Where", ["keep", "zero", "fmin"], "bias")]
        feeds_mask = np.ones((bs, s), np.int64)
        feeds_mask[0, 3:] = 0
    hd = [bs, s, 2, h // 2]
    c["hd"] = np.array(hd, np.int64)
    c["back"] = np.array([bs, s, -1], np.int64)
    for nm in "qkv":
        nodes += [_n("MatMul", ["x", f"w{nm}"], f"{nm}0"),
                  _n("Reshape", [f"{nm}0", "hd"], f"{nm}1", allowzero=1),
                  _n("Transpose", [f"{nm}1"], nm, perm=[0, 2, 1, 3] if nm != "k" else
                     [0, 2, 3, 1])]
    nodes += [_n("MatMul", ["q", "k"], "sc0"), _n("Mul", ["sc0", "scale"], "sc"),
              _n("Add", ["sc", "bias"], "sm0"), _n("Softmax", ["sm0"], "p0", axis=-1),
              _n("IsNaN", ["p0"], "isn"), _n("Where", ["isn", "zero", "p0"], "p"),
              _n("MatMul", ["p", "v"], "o0"), _n("Transpose", ["o0"], "o1", perm=[0, 2, 1, 3]),
              _n("Reshape", ["o1", "back"], "o2"), _n("Div", ["o2", "rt2"], "g0"),
              _n("Erf", ["g0"], "g1"), _n("Add", ["g1", "one"], "g2"),
              _n("Mul", ["o2", "g2"], "g3"), _n("Mul", ["g3", "half"], "y")]
    model = _model(nodes, ins, [_vi("y", F, [bs, s, h])], c, 17 if style == "ts17" else 18)
    ids = rng.integers(0, v, (bs, s)).astype(np.int64)
    _check(model, {"input_ids": ids, "attention_mask": feeds_mask})


def test_llama_rmsnorm_rotary_gqa(rng):
    """Llama (dynamo, opset 18): RMSNorm as Pow / ReduceMean (axes an input) / Add / Sqrt /
    Reciprocal / Mul, rotary as x * cos + cat(-x2, x1) * sin (Slice to INT64_MAX), one KV
    head shared by two query heads (Unsqueeze / Expand / Reshape), a causal mask initializer
    with -inf, SiLU as Sigmoid * x."""
    bs, s, h, nh, d, v = 2, 5, 8, 2, 4, 11
    pos = np.arange(s)[:, None] * (1.0 / 10000 ** (np.arange(0, d, 2) / d))[None]
    emb = np.concatenate([pos, pos], -1)
    causal = np.where(np.tril(np.ones((s, s), bool)), 0.0, -np.inf).astype(np.float32)
    c = dict(we=_rand(rng, v, h, s=1.0), nw=_rand(rng, h) + 1, wq=_rand(rng, h, nh * d),
             wk=_rand(rng, h, d), wv=_rand(rng, h, d), wo=_rand(rng, nh * d, h),
             cos=np.cos(emb)[None, None].astype(np.float32),
             sin=np.sin(emb)[None, None].astype(np.float32),
             mask=np.broadcast_to(causal, (bs, 1, s, s)).copy(),
             two=np.array(2.0, np.float32), ax=np.array([-1], np.int64),
             eps=np.array(1e-6, np.float32), hs=np.array([bs, s, -1, d], np.int64),
             z=np.array([0], np.int64), hf=np.array([d // 2], np.int64),
             big=np.array([I64_MAX], np.int64), a3=np.array([3], np.int64),
             o1=np.array([1], np.int64), a2=np.array([2], np.int64),
             ex=np.array([bs, 1, nh, s, d], np.int64), kv=np.array([bs, nh, s, d], np.int64),
             kf=np.array([-1, s, d], np.int64), kt=np.array([bs, nh, d, s], np.int64),
             sc=np.array(d ** -0.25, np.float32), zero=np.array(0.0, np.float32),
             back=np.array([bs, s, -1], np.int64))
    nodes = [_n("Gather", ["we", "input_ids"], "e"), _n("Pow", ["e", "two"], "p2"),
             _n("ReduceMean", ["p2", "ax"], "ms", keepdims=1), _n("Add", ["ms", "eps"], "mse"),
             _n("Sqrt", ["mse"], "rt"), _n("Reciprocal", ["rt"], "rs"),
             _n("Mul", ["e", "rs"], "xn"), _n("Mul", ["nw", "xn"], "x")]
    for nm in "qk":
        nodes += [_n("MatMul", ["x", f"w{nm}"], f"{nm}0"),
                  _n("Reshape", [f"{nm}0", "hs"], f"{nm}1", allowzero=1),
                  _n("Transpose", [f"{nm}1"], f"{nm}2", perm=[0, 2, 1, 3]),
                  _n("Mul", [f"{nm}2", "cos"], f"{nm}c"),
                  _n("Slice", [f"{nm}2", "z", "hf", "a3", "o1"], f"{nm}a"),
                  _n("Slice", [f"{nm}2", "hf", "big", "a3", "o1"], f"{nm}b"),
                  _n("Neg", [f"{nm}b"], f"{nm}n"),
                  _n("Concat", [f"{nm}n", f"{nm}a"], f"{nm}r", axis=-1),
                  _n("Mul", [f"{nm}r", "sin"], f"{nm}s"),
                  _n("Add", [f"{nm}c", f"{nm}s"], f"{nm}3")]
    nodes += [_n("MatMul", ["x", "wv"], "v0"), _n("Reshape", ["v0", "hs"], "v1", allowzero=1),
              _n("Transpose", ["v1"], "v2", perm=[0, 2, 1, 3])]
    for nm in "kv":
        nodes += [_n("Unsqueeze", [f"{nm}3" if nm == "k" else "v2", "a2"], f"{nm}u"),
                  _n("Expand", [f"{nm}u", "ex"], f"{nm}e"),
                  _n("Reshape", [f"{nm}e", "kv"], f"{nm}g", allowzero=1)]
    nodes += [_n("Reshape", ["kg", "kf"], "k4"), _n("Transpose", ["k4"], "k5", perm=[0, 2, 1]),
              _n("Reshape", ["k5", "kt"], "k6"), _n("Mul", ["q3", "sc"], "qq"),
              _n("Mul", ["k6", "sc"], "kk"), _n("MatMul", ["qq", "kk"], "s0"),
              _n("Add", ["s0", "mask"], "s1"), _n("Softmax", ["s1"], "pr0", axis=-1),
              _n("IsNaN", ["pr0"], "isn"), _n("Where", ["isn", "zero", "pr0"], "pr"),
              _n("MatMul", ["pr", "vg"], "at"), _n("Transpose", ["at"], "at1", perm=[0, 2, 1, 3]),
              _n("Reshape", ["at1", "back"], "at2", allowzero=1), _n("MatMul", ["at2", "wo"], "o"),
              _n("Add", ["e", "o"], "r"), _n("Sigmoid", ["r"], "sg"), _n("Mul", ["r", "sg"], "y")]
    model = _model(nodes, [_vi("input_ids", I64, [bs, s])], [_vi("y", F, [bs, s, h])], c, 18)
    _check(model, {"input_ids": rng.integers(0, v, (bs, s)).astype(np.int64)})


def test_vit_patchify_cls_token_packed_qkv(rng):
    """ViT-B/16 (dynamo, opset 18) in small: a stride = kernel Conv patchify, Reshape /
    Transpose to tokens, the class token Concat'ed in front, position Add, LayerNorm, the packed
    in_proj split by Unsqueeze / 5-D Transpose / Squeeze / Gather of scalar indices, one head,
    the class row picked by Gather and the head as Gemm(transB=1)."""
    bs, ch, hw, p, e, ncls = 2, 3, 8, 4, 6, 3
    t = (hw // p) ** 2 + 1
    c = dict(cw=_rand(rng, e, ch, p, p), cb=_rand(rng, e),
             cls=np.broadcast_to(_rand(rng, 1, 1, e), (bs, 1, e)).copy(),
             pe=_rand(rng, 1, t, e), lw=_rand(rng, e) + 1, lb=_rand(rng, e),
             wi=_rand(rng, e, 3 * e), bi=_rand(rng, 3 * e), wh=_rand(rng, ncls, e),
             bh=_rand(rng, ncls), tok=np.array([bs, e, t - 1], np.int64),
             pk=np.array([t, bs, 3, e], np.int64), u0=np.array([0], np.int64),
             sq=np.array([-2], np.int64), i0=np.array(0, np.int64), i1=np.array(1, np.int64),
             i2=np.array(2, np.int64), sc=np.array(e ** -0.25, np.float32))
    nodes = [_n("Conv", ["x", "cw", "cb"], "c0", kernel_shape=[p, p], strides=[p, p]),
             _n("Reshape", ["c0", "tok"], "c1", allowzero=1),
             _n("Transpose", ["c1"], "c2", perm=[0, 2, 1]),
             _n("Concat", ["cls", "c2"], "c3", axis=1), _n("Add", ["c3", "pe"], "c4"),
             _n("LayerNormalization", ["c4", "lw", "lb"], "ln", epsilon=1e-6),
             _n("Transpose", ["ln"], "tr", perm=[1, 0, 2]), _n("MatMul", ["tr", "wi"], "pj0"),
             _n("Add", ["pj0", "bi"], "pj"), _n("Reshape", ["pj", "pk"], "pk1", allowzero=1),
             _n("Unsqueeze", ["pk1", "u0"], "pk2"),
             _n("Transpose", ["pk2"], "pk3", perm=[3, 1, 2, 0, 4]),
             _n("Squeeze", ["pk3", "sq"], "qkv"),
             _n("Gather", ["qkv", "i0"], "q", axis=0), _n("Gather", ["qkv", "i1"], "k", axis=0),
             _n("Gather", ["qkv", "i2"], "v", axis=0),
             _n("Transpose", ["q"], "qb", perm=[1, 0, 2]),
             _n("Transpose", ["k"], "kb", perm=[1, 2, 0]),
             _n("Transpose", ["v"], "vb", perm=[1, 0, 2]),
             _n("Mul", ["qb", "sc"], "qs"), _n("Mul", ["kb", "sc"], "ks"),
             _n("MatMul", ["qs", "ks"], "s0"), _n("Softmax", ["s0"], "pr", axis=-1),
             _n("MatMul", ["pr", "vb"], "at"), _n("Gather", ["at", "i0"], "clsr", axis=1),
             _n("Gemm", ["clsr", "wh", "bh"], "y", transB=1)]
    model = _model(nodes, [_vi("x", F, [bs, ch, hw, hw])], [_vi("y", F, [bs, ncls])], c, 18)
    _check(model, {"x": _rand(rng, bs, ch, hw, hw, s=1.0)})


def test_gelu_and_rmsnorm_patterns_become_one_op(rng):
    """The exporters' exact GELU in its three operand orders (TorchScript: (x (1 + erf)) 0.5;
    dynamo: x (0.5 (1 + erf)); transformers: (0.5 x) (1 + erf); x / sqrt 2 as a Div or a Mul)
    each become one gelu, and RMSNorm (Pow or x * x, Reciprocal or 1 / Sqrt) one rms_norm; a
    chain whose Erf is also a graph output stays as written. All against the reference."""
    x = _vi("x", F, [3, 7])
    c = dict(rt2=np.array(np.sqrt(2), np.float32), irt2=np.array(np.sqrt(0.5), np.float32),
             one=np.array(1.0, np.float32), half=np.array(0.5, np.float32),
             two=np.array(2.0, np.float32), ax=np.array([-1], np.int64),
             eps=np.array(1e-5, np.float32), w=_rand(rng, 7) + 1, w2=_rand(rng, 7) + 1)
    nodes = []
    for k, (div, form) in enumerate([("Div", "ts"), ("Mul", "dyn"), ("Div", "hf"),
                                     ("Div", "kept")]):
        p = f"g{k}_"
        nodes += [_n(div, ["x", "rt2" if div == "Div" else "irt2"], p + "d"),
                  _n("Erf", [p + "d"], p + "e"), _n("Add", ["one", p + "e"], p + "a")]
        if form in ("ts", "kept"):
            nodes += [_n("Mul", ["x", p + "a"], p + "m"), _n("Mul", [p + "m", "half"], f"y{k}")]
        elif form == "dyn":
            nodes += [_n("Mul", ["half", p + "a"], p + "m"), _n("Mul", ["x", p + "m"], f"y{k}")]
        else:
            nodes += [_n("Mul", ["x", "half"], p + "h"), _n("Mul", [p + "h", p + "a"], f"y{k}")]
    nodes += [_n("Pow", ["x", "two"], "r0p"), _n("ReduceMean", ["r0p", "ax"], "r0m"),
              _n("Add", ["r0m", "eps"], "r0a"), _n("Sqrt", ["r0a"], "r0s"),
              _n("Reciprocal", ["r0s"], "r0r"), _n("Mul", ["x", "r0r"], "r0x"),
              _n("Mul", ["w", "r0x"], "r0"),
              _n("Mul", ["x", "x"], "r1p"), _n("ReduceMean", ["r1p", "ax"], "r1m"),
              _n("Add", ["eps", "r1m"], "r1a"), _n("Sqrt", ["r1a"], "r1s"),
              _n("Div", ["one", "r1s"], "r1r"), _n("Mul", ["r1r", "x"], "r1x"),
              _n("Mul", ["r1x", "w2"], "r1")]
    outs = [_vi(f"y{k}", F, [3, 7]) for k in range(4)] + [_vi("g3_e", F, [3, 7])] + \
        [_vi(f"r{k}", F, [3, 7]) for k in range(2)]
    g = _check(_model(nodes, [x], outs, c, 18), {"x": _rand(rng, 3, 7, s=2.0)})
    ops = [(n.op, n.attrs.get("kind")) for n in g.nodes]
    assert ops.count(("rms_norm", None)) == 2 and not any(o == "reduce" for o, _ in ops), ops
    assert ops.count(("activation", "erf")) == 0 and ops.count(("where", None)) == 2, ops
    assert ops.count(("activation", "gelu")) == 4, ops   # 3 fused, 1 inside the kept Erf


def test_gather_of_known_indices_is_a_narrow(rng):
    """Gather of a scalar index or a run of indices known at load (ViT's packed q / k / v,
    BERT's CLS row) is a narrow: no gather node; out-of-range indices are refused by name."""
    x = _vi("x", F, [3, 4, 5])
    c = dict(i1=np.array(1, np.int64), run=np.array([-3, -2], np.int64),
             odd=np.array([[2, 0]], np.int64))
    nodes = [_n("Gather", ["x", "i1"], "a", axis=0), _n("Gather", ["x", "run"], "b", axis=2),
             _n("Gather", ["x", "odd"], "d", axis=1)]
    outs = [_vi("a", F, [4, 5]), _vi("b", F, [3, 4, 2]), _vi("d", F, [3, 1, 2, 5])]
    g = _check(_model(nodes, [x], outs, c, 17), {"x": _rand(rng, 3, 4, 5)})
    assert [n.op for n in g.nodes].count("gather") == 1           # only the [2, 0] one
    c["i1"] = np.array(3, np.int64)
    with pytest.raises(ValueError, match=r"Gather.*indices must lie in \[-3, 3\)"):
        rlx.onnx.load(_model(nodes, [x], outs, c, 17))
