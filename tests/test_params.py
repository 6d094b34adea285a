"""ParamStore: executables compiled against one store share one device copy of their params."""
import gc

import numpy as np
import pytest

import rlx_numba as rlx
from rlx_numba.ir import dtypes as dt


def _mlp(name, k=7, n=5, m=3):
    g = rlx.Graph(name)
    x = g.input("x", (m, k), "f32")
    w = g.param("w", (k, n), "f32")
    b = g.param("b", (n,), "f32")
    g.set_outputs([g.linear(x, w, b, activation="relu")])
    return g


def _ref(x, w, b):
    return np.maximum(x.astype(np.float64) @ w + b, 0)


def test_two_executables_share_one_copy():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((7, 5)).astype(np.float32)
    b = rng.standard_normal(5).astype(np.float32)
    store = rlx.ParamStore("mlp")
    e1 = rlx.compile(_mlp("a", m=3), params=store)
    e2 = rlx.compile(_mlp("b", m=4), params=store)     # another shape of the same model
    e1.set_param("w", w)
    e1.set_param("b", b)
    x = rng.standard_normal((4, 7)).astype(np.float32)
    np.testing.assert_allclose(e2.run({"x": x})[0], _ref(x, w, b), rtol=1e-5, atol=1e-5)
    r1, r2 = e1.memory_report(), e2.memory_report()
    assert r1["param_bytes"] == (7 * 5 + 5) * 4 and r1["shared_param_bytes"] == 0
    assert r2["param_bytes"] == 0 and r2["shared_param_bytes"] == (7 * 5 + 5) * 4
    assert "params (shared)" in str(r2)
    assert store.nbytes == (7 * 5 + 5) * 4 and len(store) == 2
    # a new value through the second is what the first reads
    w2 = rng.standard_normal((7, 5)).astype(np.float32)
    e2.set_param("w", w2)
    x3 = rng.standard_normal((3, 7)).astype(np.float32)
    np.testing.assert_allclose(e1.run({"x": x3})[0], _ref(x3, w2, b), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(e1.get_param("w"), w2)


def test_private_stores_by_default():
    rng = np.random.default_rng(1)
    e1, e2 = rlx.compile(_mlp("a")), rlx.compile(_mlp("b"))
    w = rng.standard_normal((7, 5)).astype(np.float32)
    e1.set_param("w", w)
    e1.set_param("b", np.zeros(5, np.float32))
    assert e2.memory_report()["param_bytes"] == (7 * 5 + 5) * 4
    with pytest.raises(ValueError, match=r"param\(s\) never set: b, w"):
        e2.run({"x": np.ones((3, 7), np.float32)})
    with pytest.raises(ValueError, match="get_param 'w': the param was never set"):
        e2.get_param("w")


def test_two_layouts_stay_in_step():
    """A weight read only by products is stored [N, K]; a graph that also reads it
    element-wise stores it [K, N]. One store keeps both copies equal."""
    rng = np.random.default_rng(2)
    store = rlx.ParamStore()
    e_t = rlx.compile(_mlp("products"), params=store)
    g = rlx.Graph("elementwise")
    w = g.param("w", (7, 5), "f32")
    g.set_outputs([g.exp(w)])
    # compiled after the weight was set: its layout is derived on the device
    w1 = rng.standard_normal((7, 5)).astype(np.float32)
    e_t.set_param("w", w1)
    e_t.set_param("b", np.zeros(5, np.float32))
    e_n = rlx.compile(g, params=store)
    assert e_n.transposed == set() and e_t.transposed
    np.testing.assert_allclose(e_n.run()[0], np.exp(w1), rtol=1e-6)
    # a device array through the row-major one reaches the [N, K] copy
    from numba import cuda
    w2 = rng.standard_normal((7, 5)).astype(np.float32)
    e_n.set_param("w", cuda.to_device(w2))
    x = rng.standard_normal((3, 7)).astype(np.float32)
    np.testing.assert_allclose(e_t.run({"x": x})[0], _ref(x, w2, 0), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(e_t.get_param("w"), w2)
    np.testing.assert_array_equal(e_n.get_param("w"), w2)
    assert store.nbytes == 2 * 7 * 5 * 4 + 5 * 4


def test_half_weight_is_seen_by_every_executable():
    rng = np.random.default_rng(3)
    store = rlx.ParamStore()
    e1 = rlx.compile(_mlp("a"), params=store)
    e2 = rlx.compile(_mlp("b", m=2), params=store)
    w = rng.standard_normal((7, 5)).astype(np.float32)
    e1.set_param_half("w", w, "bf16")
    e1.set_param("b", np.zeros(5, np.float32))
    wh = w.astype(dt.BF16.host).astype(np.float32)
    for e in (e1, e2):
        hdt, dev = e.half_param(e._params["w"])
        assert hdt == dt.BF16
        np.testing.assert_array_equal(
            dev.copy_to_host().view(dt.BF16.host).astype(np.float32).reshape(5, 7), wh.T)
        np.testing.assert_array_equal(e.get_param("w"), wh)
    x = rng.standard_normal((2, 7)).astype(np.float32)
    np.testing.assert_allclose(e2.run({"x": x})[0], _ref(x, wh, 0), rtol=2e-2, atol=2e-2)
    e2.set_param("w", w)                    # back to f32 for both
    assert e1.half_param(e1._params["w"]) is None
    np.testing.assert_array_equal(e1.get_param("w"), w)
    assert store.bytes_by_format() == {"f32": 7 * 5 * 4 + 5 * 4}    # the half copy was freed


def test_kv_cache_written_by_one_is_read_by_the_other():
    """A prefill-like graph writes a cache param in place; a second graph reads it."""
    rng = np.random.default_rng(4)
    store = rlx.ParamStore()
    gw = rlx.Graph("write")
    cache = gw.param("cache", (1, 2, 6, 3), "f32")
    new = gw.input("new", (1, 2, 2, 3), "f32")
    gw.set_outputs([gw.kv_write(cache, new, 1)])
    gr = rlx.Graph("read")
    c = gr.param("cache", (1, 2, 6, 3), "f32")
    gr.set_outputs([c * 2.0])
    ew, er = rlx.compile(gw, params=store), rlx.compile(gr, params=store)
    ew.set_param("cache", np.zeros((1, 2, 6, 3), np.float32))
    v = rng.standard_normal((1, 2, 2, 3)).astype(np.float32)
    ew.run({"new": v})
    want = np.zeros((1, 2, 6, 3), np.float32)
    want[:, :, 1:3] = v
    np.testing.assert_array_equal(er.run()[0], 2 * want)
    assert er.memory_report()["param_bytes"] == 0


def test_shapes_and_dtypes_are_separate_entries():
    store = rlx.ParamStore()
    g1, g2 = rlx.Graph("a"), rlx.Graph("b")
    g1.set_outputs([g1.exp(g1.param("p", (3,), "f32"))])
    g2.set_outputs([g2.exp(g2.param("p", (4,), "f32"))])
    e1, e2 = rlx.compile(g1, params=store), rlx.compile(g2, params=store)
    e1.set_param("p", np.ones(3, np.float32))
    with pytest.raises(ValueError, match="never set: p"):
        e2.run()
    assert len(store) == 2


def test_entries_go_with_their_last_executable():
    store = rlx.ParamStore()
    e1 = rlx.compile(_mlp("a"), params=store)
    e2 = rlx.compile(_mlp("b"), params=store)
    e1.set_param("b", np.ones(5, np.float32))
    del e1
    gc.collect()
    assert len(store) == 2                  # e2 still reads both
    np.testing.assert_array_equal(e2.get_param("b"), np.ones(5, np.float32))
    del e2
    gc.collect()
    assert len(store) == 0 and store.nbytes == 0
    assert store._pool.nbytes == 0          # the slabs went back to the driver


def test_bad_store_and_unknown_param():
    with pytest.raises(ValueError, match="compile: params must be a rlx_numba.ParamStore"):
        rlx.compile(_mlp("a"), params={"w": 1})
    e = rlx.compile(_mlp("a"))
    with pytest.raises(ValueError, match="get_param: graph 'a' has no param 'q'"):
        e.get_param("q")


def test_llama_graphs_share_weights_and_kv_cache():
    """A model's forward, prefill and decode graphs read one copy of the weights, and a prefill
    and the decode graph of one shape one KV cache (no copy between them)."""
    from rlx_numba.models import LlamaConfig, LlamaForCausalLM
    from rlx_numba.models.llama import llama_param_shapes
    cfg = LlamaConfig(vocab_size=29, hidden_size=16, intermediate_size=19, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                      tie_word_embeddings=True)
    m = LlamaForCausalLM.from_config(cfg, seed=1, std=0.3)
    weights = sum(int(np.prod(s)) * 4 for s in llama_param_shapes(cfg).values())
    fwd = m.executable("forward", 1, 3)
    pre = m.executable("prefill", 1, 3, 16)
    dec = m.executable("decode", 1, 1, 16)
    assert fwd.memory_report()["param_bytes"] == weights
    for e in (pre, dec):
        assert e.memory_report()["shared_param_bytes"] >= weights
    cache = 2 * 1 * 1 * 16 * 8 * 4          # k and v: [batch, kv heads, rows, head dim] f32
    assert pre.memory_report()["param_bytes"] == cache
    # its cache is the prefill's; it adds only its rows' left pads ([batch, 1] i32)
    assert dec.memory_report()["param_bytes"] == 4
    assert m._exes.params.nbytes == weights + cache + 4
    assert pre.stream is dec.stream is fwd.stream
    prompt = np.array([[3, 17, 5]])
    out = m.generate(prompt, 4)
    seq = prompt
    for _ in range(4):                                  # no cache: the whole sequence a token
        seq = np.concatenate([seq, m(seq)[:, -1].argmax(-1)[:, None]], 1)
    np.testing.assert_array_equal(out, seq)


def test_bert_executables_share_weights():
    from rlx_numba.models import BertConfig, BertModel
    cfg = BertConfig(vocab_size=31, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=20, max_position_embeddings=16)
    m = BertModel.from_config(cfg, seed=2)
    ids = np.array([[2, 7, 30, 1]])
    a = m.run(ids)
    e1, e2 = m.executable(1, 4), m.executable(2, 4)
    assert e2.memory_report()["param_bytes"] == 0
    assert e2.memory_report()["shared_param_bytes"] == e1.memory_report()["param_bytes"] > 0
    np.testing.assert_allclose(m.run(np.concatenate([ids, ids[:, ::-1]]))[:1], a, rtol=1e-5,
                               atol=1e-5)


def test_half_copy_in_a_layout_made_after_the_half_set():
    """A graph storing the weight row-major sets it half; a graph compiled afterwards stores it
    [N, K] and gets the half copy transposed on its way in."""
    rng = np.random.default_rng(5)
    store = rlx.ParamStore()
    g = rlx.Graph("row_major")
    w = g.param("w", (7, 5), "f32")
    g.set_outputs([g.exp(w)])
    e_n = rlx.compile(g, params=store)
    wv = rng.standard_normal((7, 5)).astype(np.float32)
    e_n.set_param_half("w", wv, "f16")
    e_t = rlx.compile(_mlp("products"), params=store)
    hdt, dev = e_t.half_param(e_t._params["w"])
    np.testing.assert_array_equal(dev.copy_to_host().view(np.float16).reshape(5, 7),
                                  wv.astype(np.float16).T)
    np.testing.assert_array_equal(e_t.get_param("w"), wv.astype(np.float16).astype(np.float32))


def test_param_written_in_place_keeps_one_layout():
    store = rlx.ParamStore()
    gw = rlx.Graph("writer")
    mem = gw.param("mem", (6, 4), "f32")
    new = gw.input("new", (1, 1, 1, 4), "f32")
    gw.set_outputs([gw.kv_write(gw.reshape(mem, (1, 1, 6, 4)), new, 2)])
    gr = rlx.Graph("reader")                 # reads mem only as a product's weight: [N, K]
    x = gr.input("x", (2, 6), "f32")
    gr.set_outputs([gr.matmul(x, gr.param("mem", (6, 4), "f32"))])
    writer = rlx.compile(gw, params=store)   # (kept: an entry goes with its last executable)
    with pytest.raises(ValueError, match=r"compile: param 'mem' \[6, 4\]: another graph of the "
                                         r"store writes it in place, and this graph stores it "
                                         r"\[N, K\]"):
        rlx.compile(gr, params=store)
    store2 = rlx.ParamStore()
    reader = rlx.compile(gr, params=store2)
    with pytest.raises(ValueError, match=r"param 'mem' \[6, 4\]: this graph writes it in place, "
                                         r"and this graph stores it row-major"):
        rlx.compile(gw, params=store2)
    assert writer.transposed == set() and reader.transposed


def test_old_constructor_still_compiles():
    """CudaExecutable(graph, ...) from before compiler.py: deprecated, still whole."""
    from rlx_numba.runtime import executable as ex
    rng = np.random.default_rng(6)
    with pytest.warns(DeprecationWarning, match="CudaExecutable\\(graph, ...\\) is deprecated"):
        e = rlx.CudaExecutable(_mlp("old"), "jit", "stream")
    w, b = rng.standard_normal((7, 5)).astype(np.float32), np.zeros(5, np.float32)
    e.set_param("w", w)
    e.set_param("b", b)
    x = rng.standard_normal((3, 7)).astype(np.float32)
    np.testing.assert_allclose(e.run({"x": x})[0], _ref(x, w, b), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ex.eager(_mlp("e"), {"x": x}, {"w": w, "b": b})[0], _ref(x, w, b),
                               rtol=1e-5, atol=1e-5)
    assert ex.compile(_mlp("c")).steps


def test_pool_packs_copies_into_slabs_and_reuses_freed_ranges():
    """The driver maps allocations past ~1 MiB in 2 MiB pages; the store carves its copies
    from slabs instead: aligned, disjoint, fewer bytes than one allocation each."""
    from rlx_numba.runtime.params import ALIGN, PAGE, _Pool, _up
    pool = _Pool()
    sizes = [300, 5000, 1 << 20, 1300000, 7, 2200000, 513]
    views = [pool.alloc(n) for n in sizes]
    spans = [pool._where[id(v)] for v in views]
    for (slab, off, n), want in zip(spans, sizes):
        assert off % ALIGN == 0 and n >= want and off + n <= slab[0].size
    for i, (s1, o1, n1) in enumerate(spans):        # no two copies overlap
        for s2, o2, n2 in spans[i + 1:]:
            assert s1 is not s2 or o1 + n1 <= o2 or o2 + n2 <= o1
    assert pool.nbytes < sum(_up(n, PAGE) for n in sizes)
    for k, v in enumerate(views):                   # each keeps its own bytes
        v[:sizes[k]].copy_to_device(np.full(sizes[k], k + 1, np.uint8))
    for k, v in enumerate(views):
        assert (v.copy_to_host()[:sizes[k]] == k + 1).all()
    slab, off, _ = spans[1]
    pool.free(views[1])
    again = pool.alloc(4000)                        # first fit: the freed range
    s_again, o_again, _ = pool._where[id(again)]
    assert s_again is slab and o_again == off
    half = pool.alloc(10, np.uint16)                # typed: exactly the bytes asked
    assert half.dtype == np.uint16 and half.shape == (5,)
    for v in views[:1] + views[2:] + [again, half]:
        pool.free(v)
    assert pool.nbytes == 0 and not pool._where


def _tied(m=3):
    """A table gathered row-major that is also the head's weight (tied embeddings), and a
    weight read only by a product (stored [N, K])."""
    g = rlx.Graph(f"tied{m}")
    ids, x = g.input("ids", (m,), "i32"), g.input("x", (m, 7), "f32")
    e, w = g.param("e", (11, 7), "f32"), g.param("w", (7, 7), "f32")
    h = g.gather(e, ids) + g.linear(x, w)
    g.set_outputs([h @ g.transpose(e, (1, 0))])
    return g


def _tied_ref(ids, x, e, w):
    h = e.astype(np.float64)[ids] + x.astype(np.float64) @ w
    return h @ e.T


def _product(name, m):
    g = rlx.Graph(name)
    x = g.input("x", (m, 7), "f32")
    g.set_outputs([g.linear(x, g.param("w", (7, 7), "f32"))])
    return g


def test_half_weight_read_only_by_products_keeps_no_f32_copy(monkeypatch):
    """set_param_half: the [N, K] f32 copy of a weight only products read is dropped (they
    read the half copy), a row-major one is kept; a later graph deriving the row-major layout
    or reading f32 (tier 4: the simulator, M > 16) gets it back; set_param goes back to f32;
    nothing leaks."""
    from numba import cuda
    monkeypatch.setenv("RLX_NUMBA_MATMUL_TIERS", "0,3")   # the tiers reading the half copy
    rng = np.random.default_rng(7)
    store = rlx.ParamStore()
    exe = rlx.compile(_tied(), params=store)
    ev = rng.standard_normal((11, 7)).astype(np.float32)
    wv = rng.standard_normal((7, 7)).astype(np.float32)
    exe.set_param_half("e", ev, "bf16")
    exe.set_param_half("w", wv, "bf16")
    eh, wh = (v.astype(dt.BF16.host).astype(np.float32) for v in (ev, wv))
    assert exe.transposed == {exe._params["w"].id}
    by = {"f32": 11 * 7 * 4, "bf16": (11 * 7 + 7 * 7) * 2}     # e: f32 kept (gathered)
    assert store.bytes_by_format() == by == exe.memory_report()["param_bytes_by_format"]
    assert {s.info["tier"] for s in exe.steps if "tier" in s.info} <= {0, 3}
    with pytest.raises(RuntimeError, match=r"param 'w' \[7, 7\] is stored bf16 and holds no "
                                           r"f32 copy in this graph.s layout"):
        exe.buf(exe._params["w"])
    ids = np.array([3, 10, 0], np.int32)
    x = rng.standard_normal((3, 7)).astype(np.float32)
    tol = dict(rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(exe.run({"ids": ids, "x": x})[0], _tied_ref(ids, x, eh, wh), **tol)
    np.testing.assert_array_equal(exe.get_param("w"), wh)     # from the half copy
    np.testing.assert_array_equal(exe.get_param("e"), eh)
    # a graph reading w element-wise: its row-major layout is derived from the half copy
    g = rlx.Graph("elementwise")
    g.set_outputs([g.exp(g.param("w", (7, 7), "f32"))])
    e_n = rlx.compile(g, params=store)
    assert e_n.memory_report()["param_bytes"] == 7 * 7 * (4 + 2)   # f32 and half, row-major
    np.testing.assert_allclose(e_n.run()[0], np.exp(wh), rtol=1e-6)
    assert store.bytes_by_format() == {"f32": (11 * 7 + 7 * 7) * 4,
                                       "bf16": (11 * 7 + 2 * 7 * 7) * 2}
    # a product of 20 rows: tier 0 on a GPU; tier 4 in the simulator, which reads f32
    e20 = rlx.compile(_product("rows20", 20), params=store)
    x20 = rng.standard_normal((20, 7)).astype(np.float32)
    np.testing.assert_allclose(e20.run({"x": x20})[0], x20 @ wh, **tol)
    f32_w = 2 if rlx.simulator_enabled() else 1                  # layouts holding f32 w
    assert store.bytes_by_format()["f32"] == (11 * 7 + f32_w * 7 * 7) * 4
    np.testing.assert_allclose(exe.run({"ids": ids, "x": x})[0], _tied_ref(ids, x, eh, wh), **tol)
    # back to f32: every layout holds f32 again, no half copy of w
    wv2 = rng.standard_normal((7, 7)).astype(np.float32)
    exe.set_param("w", wv2)
    assert store.bytes_by_format() == {"f32": (11 * 7 + 2 * 7 * 7) * 4, "bf16": 11 * 7 * 2}
    assert exe.half_param(exe._params["w"]) is None
    assert all(s.info["tier"] != 0 for s in e20.steps if "tier" in s.info)
    np.testing.assert_allclose(exe.run({"ids": ids, "x": x})[0], _tied_ref(ids, x, eh, wv2), **tol)
    np.testing.assert_allclose(e20.run({"x": x20})[0], x20 @ wv2, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(e_n.run()[0], np.exp(wv2), rtol=1e-6)
    np.testing.assert_array_equal(e20.get_param("w"), wv2)
    # half again, then f32 from a device array through the [N, K] graph
    exe.set_param_half("w", wv, "f16")
    wv3 = rng.standard_normal((7, 7)).astype(np.float32)
    e20.set_param("w", cuda.to_device(wv3))
    np.testing.assert_allclose(exe.run({"ids": ids, "x": x})[0], _tied_ref(ids, x, eh, wv3), **tol)
    np.testing.assert_allclose(e_n.run()[0], np.exp(wv3), rtol=1e-6)
    np.testing.assert_array_equal(exe.get_param("w"), wv3)
    del exe, e_n, e20
    gc.collect()
    assert len(store) == 0 and store._pool.nbytes == 0 and not store._pool._where


def test_half_weight_of_a_graph_compiled_after_the_set(monkeypatch):
    """A graph compiled after set_param_half stores the weight [N, K]: it gets the half copy
    only (its own layout, derived from the row-major one) and reads it."""
    monkeypatch.setenv("RLX_NUMBA_MATMUL_TIERS", "0,3")
    rng = np.random.default_rng(8)
    store = rlx.ParamStore()
    g = rlx.Graph("row_major")
    g.set_outputs([g.exp(g.param("w", (7, 7), "f32"))])
    e_n = rlx.compile(g, params=store)
    wv = rng.standard_normal((7, 7)).astype(np.float32)
    e_n.set_param_half("w", wv, "f16")
    e_t = rlx.compile(_product("later", 2), params=store)
    assert e_t.memory_report()["param_bytes"] == 7 * 7 * 2       # the [N, K] half copy only
    assert store.bytes_by_format() == {"f32": 7 * 7 * 4, "f16": 2 * 7 * 7 * 2}
    x = rng.standard_normal((2, 7)).astype(np.float32)
    wh = wv.astype(np.float16).astype(np.float32)
    np.testing.assert_allclose(e_t.run({"x": x})[0], x @ wh, rtol=3e-3, atol=3e-3)
    np.testing.assert_array_equal(e_t.get_param("w"), wh)


def test_half_weight_read_through_a_transpose_keeps_no_f32_copy(monkeypatch):
    """nn.Linear's [N, K] weight read row-major through an absorbed transpose (as the models'
    projections are): only products read it, so set_param_half drops its f32 copy; a graph
    that gathers its rows binds later and gets the f32 copy back, made from the half one."""
    monkeypatch.setenv("RLX_NUMBA_MATMUL_TIERS", "0,3")
    rng = np.random.default_rng(9)
    store = rlx.ParamStore()
    g = rlx.Graph("proj")
    x = g.input("x", (3, 7), "f32")
    w = g.param("w", (5, 7), "f32")                       # [N, K]
    g.set_outputs([g.matmul(x, g.transpose(w, (1, 0)))])
    exe = rlx.compile(g, params=store)
    assert exe.transposed == set() and exe.absorbed
    wv = rng.standard_normal((5, 7)).astype(np.float32)
    exe.set_param_half("w", wv, "bf16")
    wh = wv.astype(dt.BF16.host).astype(np.float64)
    assert store.bytes_by_format() == {"bf16": 5 * 7 * 2}
    again = rlx.compile(g, params=store).memory_report()      # shares what the store holds
    assert (again["param_bytes"], again["shared_param_bytes"]) == (0, 5 * 7 * 2)
    xv = rng.standard_normal((3, 7)).astype(np.float32)
    got = exe.run({"x": xv})[0]
    tier0 = any(s.info.get("tier") == 0 for s in exe.steps)
    xr = xv.astype(dt.BF16.host).astype(np.float64) if tier0 else xv.astype(np.float64)
    np.testing.assert_allclose(got, xr @ wh.T, rtol=1e-4, atol=1e-4)
    g2 = rlx.Graph("rows")
    ids = g2.input("ids", (2,), "i32")
    g2.set_outputs([g2.gather(g2.param("w", (5, 7), "f32"), ids)])
    e2 = rlx.compile(g2, params=store)
    assert store.bytes_by_format() == {"f32": 5 * 7 * 4, "bf16": 5 * 7 * 2}
    np.testing.assert_array_equal(e2.run({"ids": np.array([4, 1], np.int32)})[0], wh[[4, 1]])
    np.testing.assert_allclose(exe.run({"x": xv})[0], got, rtol=0, atol=0)
