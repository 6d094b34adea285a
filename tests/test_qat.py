"""Fake quantisation (ir/ops_qat.py) against NumPy ports of torch's kernels
(aten/src/ATen/native/quantized/cuda/FakeQuantizeCore.cu and the learnable backward of
FakeQuantPerTensorAffine.cpp): per tensor and per channel, exact ties (half to even), the
clamp, half inputs, the straight-through and LSQ gradients, and the errors."""
import ml_dtypes
import numpy as np
import pytest

import rlx_numba as rlx


def fq_ref(x, scale, zp, qmin, qmax, axis=None):
    """torch's forward in float32: (clamp(zp + nearbyint(x * (1.0f / scale))) - zp) * scale,
    and the mask of its gradient."""
    x = np.asarray(x, np.float32)
    s = np.asarray(scale, np.float32)
    z = np.asarray(zp, np.int64)
    if axis is not None:
        shape = (-1,) + (1,) * (x.ndim - axis % x.ndim - 1)
        s, z = s.reshape(shape), z.reshape(shape)
    inv = (np.float32(1.0) / s).astype(np.float32)
    q = np.rint((x * inv).astype(np.float32)).astype(np.int64) + z
    y = ((np.clip(q, qmin, qmax) - z).astype(np.float32) * s).astype(np.float32)
    return y, (q >= qmin) & (q <= qmax)


def lsq_ref(x, scale, dy, qmin, qmax):
    """torch's _fake_quantize_learnable_per_tensor_affine_backward (zero point 0, grad_factor
    1): (dx, dscale)."""
    x, dy = np.asarray(x, np.float32), np.asarray(dy, np.float32)
    s = np.float32(np.asarray(scale).reshape(-1)[0])
    inv = np.float32(1.0) / s
    xq = np.rint(x * inv).astype(np.int64)
    dx = dy * ((xq >= qmin) & (xq <= qmax))
    xfq = (np.clip(xq, qmin, qmax).astype(np.float32) * s).astype(np.float32)
    ds = np.where(xq < qmin, dy * np.float32(qmin),
                  np.where(xq > qmax, dy * np.float32(qmax), dy * (xfq - x) * inv))
    return dx.astype(np.float32), np.float64(ds.astype(np.float64).sum())


def _run(build, feeds, params=()):
    g = rlx.Graph("qat")
    outs = build(g)
    g.set_outputs(outs)
    exe = rlx.compile(g)
    for name, v in params:
        exe.set_param(name, v)
    return exe.run(feeds)


@pytest.mark.parametrize("shape, qmin, qmax, zp", [((5, 7), -128, 127, 3), ((3, 4, 5), 0, 15, 7)])
def test_per_tensor_forward_ties_and_clamp(rng, shape, qmin, qmax, zp):
    scale = np.float32(0.25)                       # 1 / scale exact: x * inv hits .5 exactly
    x = rng.uniform(-40, 40, shape).astype(np.float32)
    x.flat[:4] = [1.125, 1.375, -0.625, 0.875]     # 4.5, 5.5, -2.5, 3.5: ties both ways
    x.flat[4:6] = [1e3, -1e3]                      # far outside the range: clamped
    g_s, g_z = np.array(scale, np.float32), np.array(zp, np.int32)
    (got,) = _run(lambda g: [g.fake_quantize(g.input("x", shape), g.param("s", ()),
                                             g.param("z", (), "i32"), quant_min=qmin,
                                             quant_max=qmax)],
                  {"x": x}, [("s", g_s), ("z", g_z)])
    want, _ = fq_ref(x, scale, zp, qmin, qmax)
    np.testing.assert_array_equal(got, want)
    if qmin == -128:
        np.testing.assert_array_equal(got.flat[:4], [1.0, 1.5, -0.5, 1.0])  # half to even


@pytest.mark.parametrize("axis", [1, -1, 0])
def test_per_channel_forward_and_straight_through_gradient(rng, axis):
    shape = (3, 5, 4)
    c = shape[axis]
    scale = rng.uniform(0.01, 0.2, c).astype(np.float32)
    zp = rng.integers(-5, 6, c).astype(np.int32)
    x = rng.uniform(-4, 4, shape).astype(np.float32)
    w = rng.standard_normal(shape).astype(np.float32)

    def build(g):
        xt = g.input("x", shape)
        y = g.fake_quantize(xt, g.param("s", (c,)), g.param("z", (c,), "i32"), quant_min=-20,
                            quant_max=20, axis=axis)
        loss = g.reduce_sum(y * g.constant(w))
        return [y] + list(g.grad(loss, [xt]))
    y, dx = _run(build, {"x": x}, [("s", scale), ("z", zp)])
    want, mask = fq_ref(x, scale, zp, -20, 20, axis=axis)
    np.testing.assert_array_equal(y, want)
    assert 0 < mask.sum() < mask.size                          # both sides of the clamp
    np.testing.assert_array_equal(dx, np.where(mask, w, 0.0))


def test_no_gradient_reaches_scale_or_zero_point(rng):
    x = rng.uniform(-2, 2, (4, 6)).astype(np.float32)

    def build(g):
        xt, s = g.input("x", (4, 6)), g.input("s", ())
        y = g.fake_quantize(xt, s, g.input("z", (), "i32"))
        return list(g.grad(g.reduce_sum(y), [s]))
    (ds,) = _run(build, {"x": x, "s": np.array(0.1, np.float32), "z": np.array(0, np.int32)})
    np.testing.assert_array_equal(ds, 0.0)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_half_input_computes_in_f32_and_rounds_once(rng, dtype):
    host = ml_dtypes.bfloat16 if dtype == "bf16" else np.float16
    x = rng.uniform(-3, 3, (5, 9)).astype(host)
    scale = np.float32(0.037)                      # y = k * 0.037: not a half value, rounded
    (got,) = _run(lambda g: [g.fake_quantize(g.input("x", (5, 9), dtype), g.param("s", ()),
                                             g.param("z", (), "i32"))],
                  {"x": x}, [("s", np.array(scale)), ("z", np.array(0, np.int32))])
    assert got.dtype == host
    want, _ = fq_ref(x.astype(np.float32), scale, 0, -128, 127)
    np.testing.assert_array_equal(got, want.astype(host))


def test_lsq_forward_and_gradients_match_torchs_rule(rng):
    shape, qmin, qmax = (6, 11), -8, 7
    scale = np.array([0.3], np.float32)
    x = rng.uniform(-4, 4, shape).astype(np.float32)
    x.flat[0] = 0.45                                # x / scale = 1.5: a tie
    dy = rng.standard_normal(shape).astype(np.float32)

    def build(g):
        xt = g.input("x", shape)
        s = g.param("s", (1,))
        y = g.fake_quantize_lsq(xt, s, quant_min=qmin, quant_max=qmax)
        return [y] + list(g.grad(g.reduce_sum(y * g.constant(dy)), [xt, s]))
    y, dx, ds = _run(build, {"x": x}, [("s", scale)])
    want_y, _ = fq_ref(x, scale[0], 0, qmin, qmax)
    want_dx, want_ds = lsq_ref(x, scale, dy, qmin, qmax)
    np.testing.assert_array_equal(y, want_y)
    np.testing.assert_array_equal(dx, want_dx)
    assert ds.shape == (1,)
    np.testing.assert_allclose(ds[0], want_ds, rtol=1e-5, atol=1e-5 * np.abs(dy).sum())


def test_lsq_half_input_sums_the_scale_gradient_in_f32(rng):
    """bf16 x and dy over 4,096 elements: the scale's gradient is one sum of 4,096 terms,
    which summed in bf16 (8 bits) would be off by far more than f32's roundings; x's gradient
    is dy masked, exact."""
    shape, qmin, qmax = (64, 64), -8, 7
    x = rng.uniform(-3, 3, shape).astype(ml_dtypes.bfloat16)
    w = rng.standard_normal(shape).astype(ml_dtypes.bfloat16)
    scale = np.array([0.3], np.float32)

    def build(g):
        xt = g.input("x", shape, "bf16")
        s = g.param("s", (1,))
        y = g.fake_quantize_lsq(xt, s, quant_min=qmin, quant_max=qmax)
        return list(g.grad(g.reduce_sum(y * g.constant(w, "bf16")), [xt, s]))
    dx, ds = _run(build, {"x": x}, [("s", scale)])
    want_dx, want_ds = lsq_ref(x.astype(np.float32), scale, w.astype(np.float32), qmin, qmax)
    assert dx.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(dx.astype(np.float32), want_dx)
    terms = np.abs(w.astype(np.float64)).sum() * qmax
    assert abs(ds[0] - want_ds) <= 64 * 2.0 ** -24 * terms      # f32 sums: a few u each
    assert 64 * 2.0 ** -24 * terms < 2.0 ** -8 * abs(want_ds)   # a bf16 sum's one rounding


def test_lsq_scale_learns(rng):
    """A few SGD steps on the scale alone lower the quantisation error of a fixed x."""
    x = rng.standard_normal((64,)).astype(np.float32)
    g = rlx.Graph("lsq_sgd")
    xt, s = g.input("x", (64,)), g.input("s", (1,))
    err = g.reduce_sum(g.activation("abs", g.fake_quantize_lsq(xt, s, quant_min=-4,
                                                               quant_max=3) - xt))
    (ds,) = g.grad(err, [s])
    g.set_outputs([err, ds])
    exe = rlx.compile(g)
    sv = np.array([0.05], np.float32)               # far too small: most of x clamps
    first = None
    for _ in range(30):
        e, d = exe.run({"x": x, "s": sv})
        first = e if first is None else first
        sv = (sv - 0.002 * d).astype(np.float32)
    assert e < 0.5 * first


@pytest.mark.parametrize("call, match", [
    (lambda g, x, s, z: g.fake_quantize(g.cast(x, "i32"), s, z), "x must be a float tensor"),
    (lambda g, x, s, z: g.fake_quantize(x, g.cast(s, "f16"), z), "scale must be an f32"),
    (lambda g, x, s, z: g.fake_quantize(x, s, g.cast(z, "i64")), "zero_point must be an i32"),
    (lambda g, x, s, z: g.fake_quantize(x, s, z, quant_min=5, quant_max=4),
     r"quant_min \(5\) must be <= quant_max \(4\)"),
    (lambda g, x, s, z: g.fake_quantize(x, g.input("s3", (3,)), g.input("z3", (3,), "i32")),
     r"per tensor \(axis=None\) scale must be \(\) or \[1\], got \[3\]"),
    (lambda g, x, s, z: g.fake_quantize(x, g.input("s3", (3,)), g.input("z3", (3,), "i32"),
                                        axis=1), r"per-channel scale must be \[5\]"),
    (lambda g, x, s, z: g.fake_quantize(x, g.input("s5", (5,)), z, axis=1),
     r"zero_point \[\] must have scale's shape \[5\]"),
    (lambda g, x, s, z: g.fake_quantize(x, s, z, axis=2), r"axis must be an int in \[-2, 2\)"),
    (lambda g, x, s, z: g.fake_quantize_lsq(x, g.input("s3", (3,))), "fake_quantize_lsq: per tensor"),
])
def test_errors_name_the_op_and_argument(call, match):
    g = rlx.Graph("bad")
    x, s, z = g.input("x", (4, 5)), g.input("s", ()), g.input("z", (), "i32")
    with pytest.raises(ValueError, match=match):
        call(g, x, s, z)


# ---- QAT of a model's weights toward GGUF blocks (models/blocks.py fake_quant_weight) ---------
@pytest.mark.parametrize("scheme", ["q8_0", "q4_0"])
def test_fake_quant_weight_gives_the_gguf_blocks_values(rng, scheme):
    """Against llama.cpp's quantizer (the gguf package) then dequantised: the same integers
    (a flip would be a whole step, ~1e-2 here), values within the file's f16 scale rounding;
    an all-zero block stays 0; the gradient is straight-through."""
    pytest.importorskip("gguf")
    from rlx_numba.models.blocks import fake_quant_weight
    from rlx_numba.models.llama import _dequantized
    from rlx_numba.models.weights import quantize
    w = (rng.standard_normal((5, 96)) * 0.3).astype(np.float32)
    w[2, 32:64] = 0.0
    w[3, :32] *= -1.0 if scheme == "q4_0" else 1.0
    dy = rng.standard_normal(w.shape).astype(np.float32)

    def build(g):
        wt = g.input("w", w.shape)
        q = fake_quant_weight(g, wt, scheme)
        return [q] + list(g.grad(g.reduce_sum(q * g.constant(dy)), [wt]))
    got, dw = _run(build, {"w": w})
    want = _dequantized(quantize(w, scheme), scheme, w.shape)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-3 * np.abs(w).max())
    np.testing.assert_array_equal(got[2, 32:64], 0.0)
    if scheme == "q8_0":                       # max|x| maps to 127: every value inside
        np.testing.assert_array_equal(dw, dy)
    else:    # q4_0's range is [-8, 7]: a value of the other sign than the block's largest may
        assert np.all((dw == dy) | (dw == 0)) and (dw == dy).mean() > 0.95   # pass 7 and clamp


def test_llama_qat_trains_and_tracks_the_packed_model():
    """A tiny Llama trained a step with qat="q8_0", then: the QAT forward graph's logits are
    the packed q8_0 model's (model.quantized) to within the file's scale rounding; and the
    errors for a bad scheme or packed weights."""
    pytest.importorskip("gguf")
    from rlx_numba.models import LlamaConfig, LlamaForCausalLM
    from rlx_numba.models.llama import build_llama, graph_params
    cfg = LlamaConfig(vocab_size=53, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                      rope_theta=500.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
    m = LlamaForCausalLM.from_config(cfg, seed=3, std=0.3)
    before = m.params["model.layers.0.mlp.down_proj.weight"].copy()
    tr = m.trainer(2, 6, rlx.optim.AdamW(lr=1e-2), qat="q8_0")
    ids = np.random.default_rng(0).integers(0, 53, (2, 6))
    assert np.isfinite(tr.step(ids))       # (a step costs the simulator ~13 s)
    tr.update_model()
    assert not np.array_equal(m.params["model.layers.0.mlp.down_proj.weight"], before)
    g = build_llama(cfg, 2, 6, kind="forward", qat="q8_0")
    exe = rlx.compile(g)
    for k, v in graph_params(cfg, m.params).items():
        exe.set_param(k, v)
    fq = exe.run({"input_ids": ids.astype(np.int32)})[0]
    packed = m.quantized("q8_0")(ids)
    # (the f32 model is 3e-2 away at this std; the f16 scales of the file account for ~5e-4)
    assert np.abs(fq - packed).max() < 3e-3 * np.abs(packed).max()
    with pytest.raises(ValueError, match="qat must be one of q8_0, q4_0 or None, got 'q3'"):
        build_llama(cfg, 1, 4, qat="q3")
    with pytest.raises(ValueError, match="not with packed"):
        build_llama(cfg, 1, 4, qat="q8_0", quant={"lm_head.weight": ("q8_0", (53, 34))})
