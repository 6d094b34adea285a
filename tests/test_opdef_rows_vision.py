"""The OpDefs of the norm, attention, rope, vision, quant and MoE families (issue 37): every op
declared with its inference, and multi-result ops built by one bind whose further results the
producer finds in Node.results."""
import numpy as np
import pytest

import rlx_numba as rlx
from rlx_numba.ir.opdef import F32, FRESH, INPLACE, opdef

FAMILY_OPS = (
    "softmax", "log_softmax", "layer_norm", "rms_norm", "residual_sum", "softmax_bwd",
    "norm_bwd", "norm_bwd_stats", "norm_param_bwd",
    "attention", "attention_lse", "attention_bwd_delta", "attention_bwd_dq",
    "attention_bwd_dkv", "attention_bwd_ds",
    "rope", "kv_write", "rope_kv_write", "kv_written",
    "conv", "conv_transpose", "conv_wgrad", "implicit_gemm", "im2col", "col2im", "pool",
    "pool_grad", "channel_affine", "resample",
    "dequantize", "dequant_matmul", "dequant_grouped_matmul",
    "grouped_matmul", "grouped_matmul_wgrad")


@pytest.mark.parametrize("op", FAMILY_OPS)
def test_declared_beside_builder(op):
    d = opdef(op)
    assert d.infer is not None and d.owner.startswith("rlx_numba.ir.ops_"), (op, d.owner)


def test_further_results_and_memory_kinds():
    for op in ("residual_sum", "norm_bwd_stats", "attention_lse"):
        assert opdef(op).written_by == 0 and opdef(op).memory == FRESH
    assert opdef("kv_written").memory == INPLACE and opdef("kv_written").written_by == 1
    assert opdef("kv_write").memory == INPLACE and opdef("kv_write").written_by is None
    assert opdef("rope_kv_write").results == (("kv_written", 3), ("kv_written", 4))
    assert opdef("norm_bwd").results == (("norm_bwd_stats", None),)
    # softmax, conv and attention take f16 / bf16 natively since issue 32
    # (tests/test_rows_half.py, test_vision_half.py, test_attention_half.py)
    assert all(opdef(op).dtype_rule == F32 for op in ("softmax", "conv", "attention", "rope",
                                                          "rope_kv_write"))


def test_norm_return_residual_is_one_bind():
    g = rlx.Graph("n")
    x, r = g.input("x", (2, 3, 8), "f16"), g.input("r", (2, 3, 8), "f16")
    gamma = g.param("g", (8,))
    y, s = g.rms_norm(x, gamma, residual=r, return_residual=True)
    assert str(y.dtype) == str(s.dtype) == "f16"
    norm = next(n for n in g.nodes if n.op == "rms_norm")
    (sid,) = norm.results
    assert g.nodes[sid].op == "residual_sum" and g.nodes[sid].inputs == (norm.id,)
    plain = g.layer_norm(g.input("z", (4, 8)), gamma)
    assert plain.node.results == [] and "return_residual" not in plain.node.attrs
    ys = g.bind("layer_norm", [g.input("a", (4, 8)), gamma, g.input("b", (4, 8))], axis=1,
                eps=1e-5, has_beta=False, has_residual=True, return_residual=True)
    assert [t.node.op for t in ys] == ["layer_norm", "residual_sum"]
    with pytest.raises(ValueError, match="residual_sum: a further result of"):
        g.bind("residual_sum", [ys[0]])
    with pytest.raises(ValueError, match="layer_norm: return_residual=True needs a residual"):
        g.bind("layer_norm", [g.input("c", (4, 8)), gamma], axis=1, eps=1e-5, has_beta=False,
               has_residual=False, return_residual=True)


def test_norm_bwd_and_attention_lse_are_results():
    g = rlx.Graph("b")
    x = g.input("x", (3, 8))
    gamma = g.param("g", (8,))
    dh, dg, _ = g.norm_bwd("layer_norm", g.input("dy", (3, 8)), x, gamma)
    (stats,) = dh.node.results
    assert g.nodes[stats].op == "norm_bwd_stats" and g.nodes[stats].shape == (3, 2)
    q = g.input("q", (1, 2, 4, 8))
    k, v = g.input("k", (1, 1, 6, 8)), g.input("v", (1, 1, 6, 8))
    y = g.attention(q, k, v, causal=True)
    g.grad(g.reduce_sum(y), [q])
    (lse,) = y.node.results
    assert g.nodes[lse].op == "attention_lse" and g.nodes[lse].shape == (1, 2, 4)


def test_rope_kv_write_results_survive_a_rewrite():
    g = rlx.Graph("r")
    qkv = g.input("qkv", (1, 2, 4 * 8))
    cs = g.input("cs", (6, 4))
    kc, vc = g.param("kc", (1, 1, 6, 8)), g.param("vc", (1, 1, 6, 8))
    q, k_all, v_all = g.rope_kv_write(qkv, cs, cs, kc, vc, 0, num_heads=2, num_kv_heads=1)
    assert q.shape == (1, 2, 2, 8) and q.node.results == [k_all.id, v_all.id]
    assert k_all.node.inputs == (kc.id, q.id) and v_all.node.inputs == (vc.id, q.id)
    g.set_outputs([q, k_all, v_all])
    moved = {}
    h = g.rewritten(lambda *a: None, moved)
    assert h.nodes[moved[q.id].id].results == [moved[k_all.id].id, moved[v_all.id].id]


@pytest.mark.parametrize("size,k,stride,padding", [
    (7, 3, 2, 1), (6, 3, 2, 0), (5, 4, 1, "same"), (9, 2, 3, 0)])
def test_conv_shapes_come_from_inference(size, k, stride, padding):
    """conv's output size follows from its inputs and attrs (pad_hi: padding='same' with an
    even kernel pads one more on the high side); its VJP's conv_transpose gives x's size
    exactly though conv floors (rows no window reaches), and that one's VJP the conv's."""
    g = rlx.Graph("c")
    x = g.input("x", (1, 2, size, size))
    w = g.input("w", (3, 2, k, k))
    y = g.conv(x, w, stride=stride, padding=padding)
    want = size if padding == "same" else (size + 2 * padding - k) // stride + 1
    assert y.shape == (1, 3, want, want)
    dx, dw = g.grad(g.reduce_sum(y), [x, w])
    assert dx.shape == x.shape and dw.shape == w.shape
    ct = next(n for n in g.nodes if n.op == "conv_transpose")
    again = g.bind("conv", [g.tensor(ct.id), w], **ct.attrs)
    assert again.shape == y.shape


def test_conv_transpose_output_padding_is_pad_hi():
    g = rlx.Graph("t")
    z = g.input("z", (1, 4, 3, 3))
    w = g.input("w", (4, 2, 3, 3))
    y = g.conv_transpose(z, w, stride=2, padding=1, output_padding=1)
    assert y.shape == (1, 2, 6, 6) and y.node.attrs["pad_hi"] == (0, 0)
    dz, = g.grad(g.reduce_sum(y), [z])
    assert dz.shape == z.shape
