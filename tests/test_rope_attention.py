"""The fusion pass's rope_kv_write prologue: a decode attention over a rope_kv_write's q and
caches becomes one rope_kv_attention kernel (kernels/attention.py decode_split(rope=True))
that rotates q as it loads it from the packed qkv, writes the kv head's new k / v rows into the
caches and attends. Against the unfolded graph (RLX_NUMBA_FUSION=0: the rope_kv_write kernel,
then the decode kernel) the outputs and the caches after the step are bit for bit the same;
against float64 NumPy on the same half-rounded inputs within the unit roundoff. Also: the
split plan (keys over several blocks a kv head: each writes the new rows among its keys) and
row groups (several blocks a kv head, each writing the same rows) give the same bits, and a q
read elsewhere keeps its own kernel."""
import numpy as np
import pytest

import rlx_numba as rlx
from conftest import ON_GPU
from halfref import HOST, assert_half_close, f64, rounded
from test_fused_decoder import tables
from rlx_numba.kernels import attention as A
from rlx_numba.runtime.schedule import node_units


def np_rot(x, cos, sin, p, n_rot, interleaved):
    """x [..., D] (float64) of one token at position p, rotated like Graph.rope."""
    half = n_rot // 2
    i0 = np.arange(0, n_rot, 2) if interleaved else np.arange(half)
    i1 = i0 + 1 if interleaved else i0 + half
    out = x.copy()
    a, b = x[..., i0], x[..., i1]
    c, s = f64(cos[p]), f64(sin[p])
    out[..., i0], out[..., i1] = a * c - b * s, b * c + a * s
    return out


def reference(qkv, cos, sin, kc, vc, cpos, pos, hq, hkv, n_rot, inter, dt):
    """(attention output [B, Hq, S, D], k cache, v cache) in float64: the rotated q and k
    rounded to ``dt`` as rope_kv_write stores them, query i seeing keys 0 .. cpos + i."""
    b, s, _ = qkv.shape
    d = kc.shape[-1]
    x = f64(qkv).reshape(b, s, hq + 2 * hkv, d)
    q = np.zeros((b, hq, s, d))
    k, v = f64(kc).copy(), f64(vc).copy()
    rd = lambda t: f64(rounded(t, dt))              # noqa: E731
    for r in range(b):
        for t in range(s):
            p = pos[r, t]
            q[r, :, t] = rd(np_rot(x[r, t, :hq], cos, sin, p, n_rot, inter))
            k[r, :, cpos + t] = rd(np_rot(x[r, t, hq:hq + hkv], cos, sin, p, n_rot, inter))
            v[r, :, cpos + t] = x[r, t, hq + hkv:]
    g = hq // hkv
    kk, vv = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    sc = q @ kk.transpose(0, 1, 3, 2) / np.sqrt(d)
    keep = np.arange(kc.shape[2])[None, :] <= cpos + np.arange(s)[:, None]
    sc = np.where(keep, sc, -np.inf)
    pr = np.exp(sc - sc.max(-1, keepdims=True))
    return (pr / pr.sum(-1, keepdims=True)) @ vv, k, v


def build(dt, b, s, hq, hkv, d, max_s, n_rot, inter, posmode, tdt, q_out=False):
    """The decode step: rope_kv_write at the run() input cache position ``cp``, the
    attention over its q and caches (query i keeps keys 0 .. cp + i)."""
    nr = d if n_rot is None else n_rot
    cos, sin = tables(max_s + 2, nr)
    g = rlx.Graph("rope_attention")
    qkv = g.input("qkv", (b, s, (hq + 2 * hkv) * d), dt)
    kc, vc = g.param("kc", (b, hkv, max_s, d), dt), g.param("vc", (b, hkv, max_s, d), dt)
    cp = g.input("cp", (1,), "i32")
    positions = None
    if posmode == "bs":
        positions = g.input("pos", (b, s), "i32")
    elif posmode == "s":
        positions = g.input("pos", (s,), "i64")
    q, k, v = g.rope_kv_write(qkv, g.constant(rounded(cos, tdt)), g.constant(rounded(sin, tdt)),
                              kc, vc, cp, num_heads=hq, num_kv_heads=hkv, n_rot=n_rot,
                              interleaved=inter, positions=positions)
    col = g.constant(np.arange(max_s, dtype=np.int32)[None, :])
    keep = col <= cp + g.constant(np.arange(s, dtype=np.int32)[:, None])
    y = g.attention(q, k, v, mask=keep)
    g.set_outputs([y, q] if q_out else [y])
    return g, (cos, sin), nr, (kc, vc)


def feed(rng, dt, b, s, hq, hkv, d, max_s, cpos, posmode):
    qkv = rounded(rng.standard_normal((b, s, (hq + 2 * hkv) * d)), dt)
    kc = rounded(rng.standard_normal((b, hkv, max_s, d)), dt)
    vc = rounded(rng.standard_normal((b, hkv, max_s, d)), dt)
    pos = np.broadcast_to(cpos + np.arange(s), (b, s))
    inputs = {"qkv": qkv, "cp": np.array([cpos], np.int32)}
    if posmode == "bs":                 # per-row positions (a left-padded row: pos - pad)
        pos = np.maximum(pos - rng.integers(0, 3, (b, 1)), 0)
        inputs["pos"] = pos.astype(np.int32)
    elif posmode == "s":
        pos = np.broadcast_to(rng.integers(0, max_s + 2, s), (b, s))
        inputs["pos"] = pos[0].astype(np.int64)
    return inputs, kc, vc, pos


def run(g, inputs, kc, vc, fusion, monkeypatch):
    """(outputs, k cache, v cache after the step, the executable)."""
    with monkeypatch.context() as mp:
        mp.setenv("RLX_NUMBA_FUSION", fusion)
        exe = rlx.compile(g)
    exe.set_param("kc", kc)
    exe.set_param("vc", vc)
    out = exe.run(inputs)
    return out, exe.get_param("kc"), exe.get_param("vc"), exe


def check(rng, monkeypatch, dt, b, s, hq, hkv, d, max_s, cpos, n_rot=None, inter=False,
          posmode=None, tdt="f32"):
    """The folded step against the unfolded one (bit for bit: output and caches) and against
    NumPy; returns the folded executable."""
    g, (cos, sin), nr, caches = build(dt, b, s, hq, hkv, d, max_s, n_rot, inter, posmode, tdt)
    inputs, kc, vc, pos = feed(rng, dt, b, s, hq, hkv, d, max_s, cpos, posmode)
    (y,), k1, v1, exe = run(g, inputs, kc, vc, "1", monkeypatch)
    (y0,), k0, v0, exe0 = run(g, inputs, kc, vc, "0", monkeypatch)
    # the fold: the attention's unit is all there is besides the mask's kernels
    (unit,) = [u for u in node_units(exe) if g.nodes[u[0]].op == "attention"]
    assert exe.fusion.folds[unit[0]][0] == "rope_kv_write prologue"
    assert len(unit[1]) == 1, [st.kernel_name for st in unit[1]]
    assert not [u for u in node_units(exe) if g.nodes[u[0]].op == "rope_kv_write"]
    assert [u for u in node_units(exe0) if g.nodes[u[0]].op == "rope_kv_write"]
    for cache in caches:                # the steps declare the caches written
        buf = exe.buffers[cache.node.id]
        assert (buf.offset, buf.offset + buf.size) in unit[3]
    for got, want in ((y, y0), (k1, k0), (v1, v0)):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    cs = rounded(cos, tdt).astype(np.float32), rounded(sin, tdt).astype(np.float32)
    wy, wk, wv = reference(inputs["qkv"], *cs, kc, vc, cpos, pos, hq, hkv, nr, inter, dt)
    rows = slice(cpos, cpos + s)
    np.testing.assert_array_equal(np.delete(k1, rows, axis=2), np.delete(kc, rows, axis=2))
    np.testing.assert_array_equal(v1, rounded(wv, dt))           # v moves bit for bit
    if dt == "f32":
        np.testing.assert_allclose(k1, wk, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(y, wy, rtol=1e-4, atol=2e-6)
    else:
        assert_half_close(k1, wk, dt, what="k cache")
        assert_half_close(y, wy, dt, k=4.0, what="attention")
    return exe


@pytest.fixture(autouse=True)
def _numba_tier(monkeypatch):
    monkeypatch.setenv("RLX_NUMBA_ATTENTION_TIERS", "2")


# (dtype, B, S, Hq, Hkv, D, max_S, cache position, n_rot, interleaved, positions, tables):
# positions in the middle of the cache; GQA (3 rows a kv head: a padding row); f32 K / V read
# in 16-byte groups (D 128) and in pairs (D 64); per-row and per-token rope positions, partial
# and GPT-J rotation, half tables; two tokens (S 2)
CASES = [
    ("f32", 1, 1, 2, 1, 128, 6, 3, None, False, None, "f32"),
    ("f32", 1, 1, 2, 2, 64, 5, 2, 48, True, "bs", "f32"),
    ("bf16", 2, 1, 4, 1, 16, 8, 5, 8, True, "bs", "bf16"),
    ("bf16", 1, 1, 6, 2, 36, 9, 4, None, False, None, "f32"),
    ("f16", 2, 2, 3, 1, 8, 7, 2, None, False, "s", "f16"),
]


@pytest.mark.parametrize("dt,b,s,hq,hkv,d,max_s,cpos,n_rot,inter,posmode,tdt", CASES)
def test_folded_decode_matches_unfolded_and_numpy(rng, monkeypatch, dt, b, s, hq, hkv, d, max_s,
                                                  cpos, n_rot, inter, posmode, tdt):
    exe = check(rng, monkeypatch, dt, b, s, hq, hkv, d, max_s, cpos, n_rot, inter, posmode, tdt)
    (st,) = [st for st in exe.steps if "attention" in st.kernel_name]
    assert "+rope_kv_write" in st.kernel_name and st.info["splits"] == 1


def test_split_plan_blocks_write_the_rows_among_their_keys(rng, monkeypatch):
    """Keys over several blocks a kv head (a long cache; the last block of a head combines):
    each block writes the new rows among its keys, here two tokens on either side of a split
    boundary (rows 3 and 4, blocks of 4 keys); and a head's rows over blocks of 2 (a GPU's
    plan for few kv heads): each of those writes the same rows, the same bits."""
    monkeypatch.setattr(A, "decode_plan", lambda b, hkv, sk, sm, nw=None: (-(-sk // 4), 4))
    monkeypatch.setattr(A, "decode_groups", lambda rows_c, rows, blocks, sm: (2, -(-rows // 2)))
    exe = check(rng, monkeypatch, "bf16", 1, 2, 2, 1, 16, 7, 3)
    assert not [st for st in exe.steps if st.kernel_name.startswith("rope_kv_write")]
    (st,) = [st for st in exe.steps if st.kernel_name.startswith("attention")]
    assert st.info["splits"] == 2 and st.grid == (2, 1, 2) and "+rope_kv_write" in st.kernel_name


def test_q_read_elsewhere_is_not_folded(rng, monkeypatch):
    g, _, _, _ = build("f32", 1, 1, 2, 1, 16, 4, None, False, None, "f32", q_out=True)
    inputs, kc, vc, _ = feed(rng, "f32", 1, 1, 2, 1, 16, 4, 1, None)
    (y, q), k1, v1, exe = run(g, inputs, kc, vc, "1", monkeypatch)
    (y0, q0), k0, v0, _ = run(g, inputs, kc, vc, "0", monkeypatch)
    assert not exe.fusion.folds
    assert [st for st in exe.steps if st.kernel_name.startswith("rope_kv_write")]
    for got, want in ((y, y0), (q, q0), (k1, k0), (v1, v0)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.skipif(ON_GPU, reason="on a GPU the GPU geometry and PDL are the defaults")
def test_gpu_geometry_and_programmatic_dependent(rng, monkeypatch):
    """The folded kernel as a GPU of compute capability 9.0 builds it: 4-warp blocks, launched
    as a programmatic dependent (grid_wait before qkv is read: a no-op in the simulator), bf16
    K / V in dim pairs (D 64), the keys over two splits."""
    from rlx_numba.kernels.launch import override_geometry
    from rlx_numba.runtime import lower_attention, lower_rope
    for mod in (lower_attention, lower_rope):
        monkeypatch.setattr(mod, "pdl_supported", lambda: True)
    monkeypatch.setattr(A, "decode_plan", lambda b, hkv, sk, sm, nw=None: (-(-sk // 8), 8))
    with override_geometry("attention", A.GPU):
        exe = check(rng, monkeypatch, "bf16", 1, 1, 4, 1, 64, 12, 9, posmode="bs")
    (st,) = [st for st in exe.steps if st.kernel_name.startswith("attention")]
    assert st.pdl and st.block == (128,) and st.info["splits"] == 2


@pytest.mark.skipif(not ON_GPU, reason="the Llama-3.2-1B decode shapes need a GPU")
@pytest.mark.parametrize("b,max_s,cpos", [(1, 128, 77), (1, 256, 150), (8, 256, 200),
                                          (1, 4096, 3000)])
def test_llama_1b_decode_step_gpu(rng, monkeypatch, b, max_s, cpos):
    """The 1B model's attention in bf16 (32 query heads on 8 kv heads of 64): a 128-row cache
    takes one block a kv head (in row groups on a large GPU), longer ones split the keys over
    blocks (256 rows: bench_models' decode1b, a 32-token prompt and 128 new tokens); the
    unfolded step's bits every time."""
    exe = check(rng, monkeypatch, "bf16", b, 1, 32, 8, 64, max_s, cpos, posmode="bs")
    (st,) = [st for st in exe.steps if st.kernel_name.startswith("attention")]
    assert "+rope_kv_write" in st.kernel_name, st.kernel_name
