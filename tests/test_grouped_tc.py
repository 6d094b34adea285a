"""grouped_matmul on tensor cores (kernels/matmul_tc.py's grouped mode): f16 / bf16 rows
routed to experts by kernels/grouped.py's routing (its tables padded to the tensor-core
geometry's row tile), f32 sums in mma fragments, one rounding -- against float64 NumPy on the
same half-rounded inputs (tests/halfref.py). The simulator's mma twins are slow: the
simulator geometry's tile is 32 x 16 x 16 (two warps), so the shapes here are one or two tiles
each way, K and N not multiples of the tile, odd row counts an expert and an empty expert."""

import numpy as np
import pytest
from numba import cuda

import rlx_numba as rlx
from conftest import ON_GPU
from halfref import HALVES, HOST, assert_half_close, f64, half_accumulated, rounded
from rlx_numba.kernels import matmul_tc as mtc
from rlx_numba.kernels.launch import override_geometry
from rlx_numba.runtime.lower_matmul import tier5_offered
from test_mma import _toolkit, assemble_sm80, compile_sm80


def oracle(x, w, ids, trans_w):
    """out[i] = x[i] @ W_{ids[i]} in float64 (W_e = w[e], or w[e]^T with trans_w)."""
    x, w = f64(x), f64(w)
    if trans_w:
        w = w.transpose(0, 2, 1)
    return np.stack([x[i] @ w[e] for i, e in enumerate(ids)]) if len(ids) else \
        np.zeros((0, w.shape[2]))


def grouped_tc(x, w, ids, d, trans_w=False, geo=None):
    """x [m, k], w [E, k, n] ([E, n, k] with trans_w) in ``d``'s host storage -> (out [m, n]
    in it, whether cp.async loads ran): matmul_tc.grouped_direct_launch (the routing at the
    geometry's row tile, then the grouped tensor-core kernel) on device arrays."""
    m, n = x.shape[0], w.shape[1] if trans_w else w.shape[2]
    store = np.uint16 if d == "bf16" else np.float16
    out = cuda.to_device(np.full((m, n), 7, store))      # (every row is written)
    launch = mtc.grouped_direct_launch(
        out, cuda.to_device(np.ascontiguousarray(x).view(np.uint16)),
        cuda.to_device(np.ascontiguousarray(w).view(np.uint16)),
        cuda.to_device(ids.astype(np.int32)), w.shape[0], d, trans_w, geo)
    launch()
    return out.copy_to_host().view(HOST[d]), launch.vec


def _data(rng, d, m, k, n, e, trans_w):
    x = rounded(rng.standard_normal((m, k)), d)
    w = rounded(rng.standard_normal((e, n, k) if trans_w else (e, k, n)), d)
    return x, w


# 3 experts: 5 rows, none, 4 rows (unsorted); K 24 and N 24 (two K tiles of 16 and two column
# tiles, the second ones partial; cp.async: rows of 24 halves are 16-byte aligned) or K 20, N 20
# (element loads)
@pytest.mark.parametrize("d,k,trans_w", [("bf16", 24, False), ("f16", 20, True)])
def test_grouped_tc_experts(rng, d, k, trans_w):
    ids = np.array([2, 0, 0, 2, 0, 2, 0, 2, 0])
    x, w = _data(rng, d, ids.size, k, k, 3, trans_w)
    got, vec = grouped_tc(x, w, ids, d, trans_w)
    assert vec == (k % 8 == 0)
    assert_half_close(got, oracle(x, w, ids, trans_w), d, what=f"grouped tc k={k}")


def test_grouped_tc_expert_over_two_row_tiles(rng):
    """One expert's 35 rows span two routed row tiles (32 rows a tile in the simulator), the
    other's 1 row its own padded tile."""
    d = "f16"
    ids = np.array([1] * 20 + [0] + [1] * 15)
    x, w = _data(rng, d, ids.size, 16, 8, 2, False)
    got, _ = grouped_tc(x, w, ids, d)
    assert_half_close(got, oracle(x, w, ids, False), d, what="two row tiles")


@pytest.mark.parametrize("d", HALVES)
def test_grouped_tc_accumulates_in_f32(rng, d):
    """K = 32 positive terms of similar size: the sum grows to ~8 while each term is ~0.25,
    so a half accumulator rounds every partial sum to u * 8 -- an error of about sqrt(K) to K
    half-ulps of the partial sums, far outside 2 u |y| (checked: the half-accumulated
    result fails the bound); f32 sums rounded once pass it."""
    k, n = 32, 8
    ids = np.array([0, 1, 1, 0, 1])
    x = rounded(rng.uniform(0.3, 0.7, (ids.size, k)), d)
    w = rounded(rng.uniform(0.3, 0.7, (2, k, n)), d)
    want = oracle(x, w, ids, False)
    half = np.stack([half_accumulated(x[i:i + 1], w[e], d)[0] for i, e in enumerate(ids)])
    with pytest.raises(AssertionError):
        assert_half_close(half, want, d, what="half accumulation")
    got, _ = grouped_tc(x, w, ids, d)
    assert_half_close(got, want, d, what="f32 accumulation")


@pytest.mark.skipif(not ON_GPU, reason="GPU size (the simulator runs the tiny ones above)")
@pytest.mark.parametrize("d", HALVES)
@pytest.mark.parametrize("trans_w", [False, True])
def test_grouped_tc_gpu_size(rng, d, trans_w):
    """2048 rows over 8 experts (uneven, one empty), 512 x 256 each, on the GPU geometry."""
    e, k, n = 8, 512, 256
    p = np.array([0.3, 0.2, 0.15, 0.0, 0.1, 0.1, 0.1, 0.05])
    ids = rng.choice(e, 2048, p=p)
    x, w = _data(rng, d, ids.size, k, n, e, trans_w)
    got, vec = grouped_tc(x, w, ids, d, trans_w)
    assert vec
    assert_half_close(got, oracle(x, w, ids, trans_w), d, what="grouped tc GPU size")


# ---- the graph: grouped_matmul of f16 / bf16 x and w lowers to the grouped tensor-core step
# where matmul tier 5 is offered (RLX_NUMBA_MATMUL_TIERS names it), to the CUDA-core kernel
# reading the halves otherwise; half in, half out, no casts either way

@pytest.fixture
def tier5(monkeypatch):
    monkeypatch.setenv("RLX_NUMBA_MATMUL_TIERS", "5")


def _graph(d, m, k, n, e, trans_w):
    g = rlx.Graph("moe_tc")
    wshape = (e, n, k) if trans_w else (e, k, n)
    y = g.grouped_matmul(g.input("x", (m, k), d), g.input("w", wshape, d),
                         g.input("ids", (m,), "i32"), trans_w=trans_w)
    assert y.dtype.name == d and not any(nd.op == "cast" for nd in g.nodes)
    g.set_outputs([y])
    return g


def _gemm_steps(exe):
    return [s.kernel_name for s in exe.steps if "gemm" in s.kernel_name]


@pytest.mark.parametrize("d,k,n,trans_w", [("bf16", 24, 20, True), ("f16", 20, 24, False)])
def test_grouped_matmul_half_on_tensor_cores(rng, tier5, d, k, n, trans_w):
    ids = np.array([2, 0, 0, 2, 0, 2, 0, 2, 0], np.int32)      # expert 1 empty
    x, w = _data(rng, d, ids.size, k, n, 3, trans_w)
    exe = rlx.compile(_graph(d, ids.size, k, n, 3, trans_w))
    names = _gemm_steps(exe)
    assert len(names) == 1 and names[0].startswith(f"numba tc grouped gemm {d}"), names
    aligned = k % 8 == 0 and (trans_w or n % 8 == 0)   # x's and w's rows of 16-byte multiples
    assert names[0].endswith("cp.async" if aligned else "element loads"), names
    (got,) = exe.run({"x": x, "w": w, "ids": ids})
    assert_half_close(got, oracle(x, w, ids, trans_w), d, what="graph, tier 5")
    bad = ids.copy()
    bad[3] = 7              # a device-array id out of range: its row routed nowhere, zeroed
    (got,) = exe.run({"x": x, "w": w, "ids": cuda.to_device(bad)})
    want = oracle(x, w, ids, trans_w)
    want[3] = 0
    assert_half_close(got, want, d, what="graph, tier 5, a bad id")


def test_grouped_matmul_half_gradients(rng, tier5):
    """dx is the same half node with trans_w flipped (on tensor cores too); dw the f32 weight
    gradient of the f32-cast operands, rounded to w's dtype."""
    d, m, k, n, e = "f16", 7, 16, 8, 2
    ids = np.array([1, 0, 1, 1, 0, 1, 1], np.int32)
    x, w = _data(rng, d, m, k, n, e, False)
    dy = rounded(rng.standard_normal((m, n)), d)
    g = rlx.Graph("moe_tc_grad")
    xt, wt = g.input("x", (m, k), d), g.input("w", (e, k, n), d)
    y = g.grouped_matmul(xt, wt, g.input("ids", (m,), "i32"))
    dx, dw = g.grad(y, [xt, wt], seed=g.constant(dy))
    assert dx.dtype.name == d and dw.dtype.name == d
    g.set_outputs([dx, dw])
    exe = rlx.compile(g)
    assert sum(name.startswith("numba tc grouped gemm") for name in _gemm_steps(exe)) == 1
    got_dx, got_dw = exe.run({"x": x, "w": w, "ids": ids})
    assert_half_close(got_dx, np.stack([f64(dy[i]) @ f64(w[ids[i]]).T for i in range(m)]), d,
                      what="dx")
    want_dw = np.zeros((e, k, n))
    for i in range(m):
        want_dw[ids[i]] += np.outer(f64(x[i]), f64(dy[i]))
    assert_half_close(got_dw, want_dw, d, what="dw")


def test_grouped_matmul_geometry_family(rng, tier5):
    """The lowering builds routing and kernel with the "grouped_tc" family's geometry (its
    own knob beside matmul_tc's): a 16-row tile of one warp, 3 K stages, so expert 0's 21
    rows take two routed tiles."""
    d, k, n = "f16", 40, 16
    geo = mtc.TcGeometry(16, 16, 16, 16, 16, stages=3)
    ids = np.array([0] * 12 + [1] + [0] * 9, np.int32)
    x, w = _data(rng, d, ids.size, k, n, 2, False)
    with override_geometry("grouped_tc", geo):
        exe = rlx.compile(_graph(d, ids.size, k, n, 2, False))
    names = _gemm_steps(exe)
    assert len(names) == 1 and "16x16x16/1w" in names[0], names
    assert any(s.kernel_name.endswith("in tiles of 16") for s in exe.steps), \
        [s.kernel_name for s in exe.steps]
    (got,) = exe.run({"x": x, "w": w, "ids": ids})
    assert_half_close(got, oracle(x, w, ids, False), d, what="grouped_tc geometry")


def test_grouped_matmul_half_on_cuda_cores(rng):
    """Tier 5 not offered (the simulator's default): the CUDA-core grouped kernel loads the
    halves (f32 sums, one rounding), an out-of-range device id's row comes out zero."""
    d, k, n = "bf16", 7, 5
    ids = np.array([1, 0, 1, 1, 3, 0], np.int32)
    x, w = _data(rng, d, ids.size, k, n, 2, False)
    exe = rlx.compile(_graph(d, ids.size, k, n, 2, False))
    names = _gemm_steps(exe)
    assert len(names) == 1 and names[0].startswith("grouped gemm") and d in names[0], names
    (got,) = exe.run({"x": x, "w": w, "ids": cuda.to_device(ids)})
    want = oracle(x, w, np.where(ids < 2, ids, 0), False)
    want[4] = 0
    assert_half_close(got, want, d, what="graph, CUDA cores")


def test_grouped_matmul_operand_dtypes(rng):
    """One half dtype: the node takes it (a half result); a mix: both cast to f32, an f32
    result; the node itself rejects a mix, naming the op, the operands and their dtypes."""
    g = rlx.Graph("moe_dt")
    ids = g.input("ids", (4,), "i32")
    xh, wh = g.input("x", (4, 6), "f16"), g.input("w", (3, 6, 5), "f16")
    assert g.grouped_matmul(xh, wh, ids).dtype.name == "f16"
    assert g.grouped_matmul(xh, g.input("wb", (3, 6, 5), "bf16"), ids).dtype.name == "f32"
    with pytest.raises(ValueError, match=r"grouped_matmul: x and w must have one dtype .*got "
                                         r"x f16 \[4, 6\] and w bf16 \[3, 6, 5\]"):
        g.bind("grouped_matmul", (xh, g.input("wb2", (3, 6, 5), "bf16"), ids), trans_w=False)


@pytest.mark.skipif(not ON_GPU, reason="GPU size (the simulator runs the tiny ones above)")
@pytest.mark.parametrize("d", HALVES)
@pytest.mark.parametrize("tc", [False, True])
def test_grouped_matmul_half_gpu_graph(rng, monkeypatch, d, tc):
    """The graph at 2048 rows over 8 experts (one empty), K 512, N 264 (N not a multiple of
    the 128-column tile) with w^T: on tensor cores where tier 5 is offered, else the default
    lowering (beside cuBLAS: the CUDA-core grouped kernel reading halves)."""
    monkeypatch.delenv("RLX_NUMBA_MATMUL_TIERS", raising=False)
    if tc:
        monkeypatch.setenv("RLX_NUMBA_MATMUL_TIERS", "5")
    e, k, n, m = 8, 512, 264, 2048
    ids = rng.choice(e, m, p=[0.3, 0.2, 0.15, 0.0, 0.1, 0.1, 0.1, 0.05]).astype(np.int32)
    x, w = _data(rng, d, m, k, n, e, True)
    exe = rlx.compile(_graph(d, m, k, n, e, True))
    names = _gemm_steps(exe)
    on_tc = tier5_offered()          # (True without the env only where cuBLAS is missing)
    assert on_tc or not tc
    assert len(names) == 1 and names[0].startswith("numba tc grouped" if on_tc else "grouped gemm")
    (got,) = exe.run({"x": x, "w": w, "ids": ids})
    assert_half_close(got, oracle(x, w, ids, True), d, what=f"graph {names[0]}")


@pytest.mark.skipif(ON_GPU or _toolkit() is None, reason="needs ptxas + libnvvm, no GPU")
def test_gpu_grouped_kernels_assemble_without_spills(tmp_path):
    """Without a GPU (as test_matmul_tc's twin): the GPU bodies of the grouped tensor-core
    kernel (cp.async bf16; element loads f16 with w^T), the CUDA-core grouped kernel reading
    halves and the routing at the tensor-core row tile, compiled to PTX for sm_80 and
    assembled by ptxas: the mma / cp.async instructions are there and nothing spills."""
    compile_sm80(f"""
        from rlx_numba.kernels import grouped as G, matmul_tc as T
        u16, f16, i64, i32 = types.uint16, types.float16, types.int64, types.int32
        geo = T.GPU_GEOMETRY
        out = {str(tmp_path)!r}
        for n, (tw, kind, vec) in enumerate([(False, "bf16", True), (True, "f16", False)]):
            c = u16 if kind == "bf16" else f16
            k = T.grouped_kernel(tw, kind, vec, geo)
            sig = (c[:], u16[:], u16[:], c[:], c[:], i64, i64, i64, i32[:], i32[:], i32[:])
            ptx, _ = cuda.compile_ptx(k.py_func, sig, cc=(8, 0),
                                      launch_bounds=(geo.threads, geo.min_blocks))
            open(os.path.join(out, f"tc{{n}}.ptx"), "w").write(ptx)
            k = G.rows_kernel(tw, kind)
            sig = (c[:], c[:], c[:], i64, i64, i64, i32[:], i32[:], i32[:])
            open(os.path.join(out, f"rows{{n}}.ptx"), "w").write(
                cuda.compile_ptx(k.py_func, sig, cc=(8, 0))[0])
            k = G.route_kernel_for(geo.bm)
            sig = (i64[:], i64, i64, i64, i64, i32[:], i32[:], i32[:], i32[:], i32[:], c[:], i64)
            open(os.path.join(out, f"route{{n}}.ptx"), "w").write(
                cuda.compile_ptx(k.py_func, sig, cc=(8, 0))[0])
    """, timeout=600)
    for p in sorted(tmp_path.glob("*.ptx")):
        text = p.read_text()
        if p.name.startswith("tc"):
            for insn in ("mma.sync.aligned.m16n8k16.row.col.f32",
                         "ldmatrix.sync.aligned.m8n8.x4", "cp.async.wait_group 2"):
                assert insn in text, (p.name, insn)
        assemble_sm80(p)
    assert "cp.async.cg.shared.global" in (tmp_path / "tc0.ptx").read_text()
