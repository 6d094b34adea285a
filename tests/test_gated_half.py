"""The gated (SwiGLU) epilogue of f16 / bf16 products: ``gated(x @ w (+ b), silu,
interleaved=True)`` over M <= 16 rows folds into the product (passes/fusion.py) as it does in
f32. Tier 3 (the skinny-product kernel) computes act(gate + b) * (up + b) from its f32 sums
and rounds y once; tier 4 and the cuBLAS tiers (GPU) write their f32 sums to a scratch that
the gated kernel reads and rounds once. Against float64 NumPy on the half-rounded inputs
(tests/halfref.py)."""
import numpy as np
import pytest

import rlx_numba as rlx
from conftest import ON_GPU
from halfref import HALVES, assert_half_close, f64, half_accumulated, rounded
from rlx_numba.models import LlamaConfig, LlamaForCausalLM


def silu(v):
    return v / (1 + np.exp(-v))


def _graph(d, lead, k, n2, bias):
    g = rlx.Graph("gated_half")
    x = g.input("x", (*lead, k), d)
    w = g.param("w", (k, n2), d)
    h = g.linear(x, w, g.param("b", (n2,), d) if bias else None)
    y = g.gated(h, "silu", interleaved=True)
    assert y.dtype == rlx.dtype(d)
    g.set_outputs([y])
    return g


def _compile(d, lead, k, n2, bias):
    """The executable, checked to have folded gated into the product: one product step whose
    kernel is the gated gemv (tier 3), else the product and the gated kernel it adds."""
    exe = rlx.compile(_graph(d, lead, k, n2, bias))
    assert [kind for kind, _ in exe.fusion.folds.values()] == ["gated epilogue"]
    (prod,) = [s for s in exe.steps if "tier" in s.info]
    if prod.info["tier"] == 3:
        assert len(exe.steps) == 1 and "gated silu" in prod.kernel_name, prod.kernel_name
    else:     # the product's own steps: f32 sums, its bias, the gated kernel
        assert all(s.name.split()[0] == prod.name.split()[0] for s in exe.steps)
        assert exe.steps[-1].name.split()[-1] == "gated"
        assert f"{d}->f32" in prod.kernel_name, prod.kernel_name
    return exe, prod.info["tier"]


def _want(xv, wv, bv):
    h = f64(xv) @ f64(wv) + (f64(bv) if bv is not None else 0)
    return silu(h[..., 0::2]) * h[..., 1::2]


@pytest.mark.parametrize("d", HALVES)
@pytest.mark.parametrize("tiers,lead,k,n2,bias", [
    ("3,4", (1,), 37, 18, True),      # element loads
    ("3,4", (3,), 64, 10, False),     # vectors of 8 halves; 5 pairs
    ("3,4", (2,), 129, 6, True),      # K split over blocks
    ("4", (2,), 37, 10, True),        # f32 scratch, bias epilogue, gated kernel
    ("4", (1, 3), 19, 6, False),
])
def test_gated_half_epilogue(monkeypatch, rng, d, tiers, lead, k, n2, bias):
    monkeypatch.setenv("RLX_NUMBA_MATMUL_TIERS", tiers)
    exe, tier = _compile(d, lead, k, n2, bias)
    assert tier == int(tiers[0])
    wv = rounded(rng.standard_normal((k, n2)) / np.sqrt(k), d)
    bv = rounded(rng.standard_normal(n2), d) if bias else None
    exe.set_param("w", wv)
    if bias:
        exe.set_param("b", bv)
    xv = rounded(rng.standard_normal((*lead, k)), d)
    (got,) = exe.run({"x": xv})
    assert got.shape == (*lead, n2 // 2)
    # one rounding of y (the sums, bias, silu and product in f32)
    assert_half_close(got, _want(xv, wv, bv), d, k=2, what=f"gated tier {tier}")


@pytest.mark.parametrize("d", HALVES)
@pytest.mark.parametrize("tiers", ["3,4", "4"])
def test_gated_half_accumulation(monkeypatch, rng, d, tiers):
    """K = 512 positive terms near 1/64: gate and up grow to ~8, where an f16 value's spacing
    is 2^-7 (half a term) and a bf16 one's 2^-4 (four terms: adding a term rounds back), so a
    product summing in half loses ~0.05 (f16) or stalls (bf16); silu(gate) * up ~ 64 carries
    8 times that, far past the two roundings (2 u |y|) allowed. Shown on the host first."""
    monkeypatch.setenv("RLX_NUMBA_MATMUL_TIERS", tiers)
    k, n2 = 512, 6
    exe, _ = _compile(d, (2,), k, n2, False)
    xv = rounded(rng.uniform(0.5, 1.5, (2, k)), d)
    wv = rounded(rng.uniform(0.5, 1.5, (k, n2)) / 64, d)
    want = _want(xv, wv, None)
    host = xv.dtype.type
    acc = half_accumulated(xv, wv, d)              # a running sum kept in the half type
    half_y = (silu(f64(acc[:, 0::2])) * f64(acc[:, 1::2])).astype(host)
    with pytest.raises(AssertionError):
        assert_half_close(half_y, want, d, what="half accumulation")
    exe.set_param("w", wv)
    (got,) = exe.run({"x": xv})
    assert_half_close(got, want, d, k=2, what="f32 accumulation")


@pytest.mark.skipif(not ON_GPU, reason="cuBLAS tiers need a GPU")
@pytest.mark.parametrize("d", HALVES)
@pytest.mark.parametrize("tiers", ["1", "2"])
def test_gated_half_cublas_tiers(monkeypatch, rng, d, tiers):
    """cuBLASLt or GemmEx writes the f32 sums into an f32 scratch, the epilogue kernel adds
    the bias there in f32, and the gated kernel rounds y once."""
    monkeypatch.setenv("RLX_NUMBA_MATMUL_TIERS", tiers)
    exe, tier = _compile(d, (3,), 96, 34, True)
    assert tier == int(tiers)
    wv = rounded(rng.standard_normal((96, 34)) / np.sqrt(96), d)
    bv = rounded(rng.standard_normal(34), d)
    exe.set_param("w", wv)
    exe.set_param("b", bv)
    xv = rounded(rng.standard_normal((3, 96)), d)
    (got,) = exe.run({"x": xv})
    assert_half_close(got, _want(xv, wv, bv), d, k=2, what=f"gated tier {tier}")


def test_bf16_llama_decode_folds_its_mlp(monkeypatch):
    """A bf16 Llama's batch-1 decode graph: the fused gate/up product takes silu(gate) * up as
    its epilogue (compile only), as the f32 one does: no gated element-wise kernel is left."""
    monkeypatch.setenv("RLX_NUMBA_MATMUL_TIERS", "3,4")
    cfg = LlamaConfig(vocab_size=29, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                      max_position_embeddings=32, tie_word_embeddings=True)
    ref = LlamaForCausalLM.from_config(cfg, seed=3)
    exe = LlamaForCausalLM(cfg, ref.params, dtype="bf16").executable("decode", 1, 1, 8)
    names = [s.kernel_name for s in exe.steps]
    assert not [n for n in names if "silu" in n and "gemv" not in n], names   # no silu kernel
    (mlp,) = [n for n in names if "gated silu" in n]    # (its rms_norm folded too)
    assert mlp.startswith("numba gemv rms_norm+bf16xbf16"), mlp


@pytest.mark.skipif(ON_GPU, reason="emulates cuBLAS in the simulator (the GPU runs the library)")
@pytest.mark.parametrize("d", HALVES)
@pytest.mark.parametrize("tiers", ["1", "2"])
def test_gated_half_cublas_tiers_emulated(monkeypatch, rng, d, tiers):
    """The cuBLAS tiers' plan in the simulator (test_matmul_half's emulated library: exact
    sums, one rounding to the call's type): the product writes f32 sums, nothing fused, and
    the gated kernel rounds y once (a half scratch would round the product first)."""
    from test_matmul_half import _EmulatedCublas
    monkeypatch.setenv("RLX_NUMBA_MATMUL_TIERS", f"{tiers},4")
    emu = _EmulatedCublas(monkeypatch)
    exe, tier = _compile(d, (3,), 24, 10, True)
    assert tier == int(tiers) and [c[:2] for c in emu.calls] == [("lt" if tier == 1 else "ex", 0)]
    wv, bv = rounded(rng.standard_normal((24, 10)), d), rounded(rng.standard_normal(10), d)
    exe.set_param("w", wv)
    exe.set_param("b", bv)
    xv = rounded(rng.standard_normal((3, 24)), d)
    (got,) = exe.run({"x": xv})
    assert_half_close(got, _want(xv, wv, bv), d, k=1.0, what=f"gated tier {tier}")
