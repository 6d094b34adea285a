"""The arena planner: reuse on chains, no overlap of live buffers, results unchanged by reuse."""
import numpy as np
import pytest

import rlx_numba as rlx
from rlx_numba.memory import ALIGN, Buffer, plan


def _overlaps(bufs):
    for i, a in enumerate(bufs):
        for b in bufs[i + 1:]:
            if a.start <= b.end and b.start <= a.end:          # live at the same time
                if a.offset < b.offset + b.size and b.offset < a.offset + a.size:
                    return a, b
    return None


@pytest.mark.parametrize("seed", range(20))
def test_plan_random_intervals_never_overlap(seed):
    rng = np.random.default_rng(seed)
    bufs = []
    for k in range(int(rng.integers(1, 40))):
        s = int(rng.integers(0, 30))
        bufs.append(Buffer(k, int(rng.integers(0, 5000)), s, s + int(rng.integers(0, 10)),
                           pinned=bool(rng.random() < 0.1)))
    top = plan(bufs)
    assert _overlaps(bufs) is None
    assert all(b.offset % ALIGN == 0 and b.offset + b.size <= top for b in bufs)
    # never worse than no reuse, and at least the peak of simultaneously live bytes
    assert top <= sum(b.size for b in bufs)
    peak = max(sum(b.size for b in bufs if b.start <= t <= b.end) for t in range(45))
    assert top >= peak


def test_chain_reuses_memory(monkeypatch):
    monkeypatch.setenv("RLX_NUMBA_FUSION", "0")   # fused, the chain has no intermediates
    g = rlx.Graph("chain")
    x = g.input("x", (64,), "f32")
    h = x
    for _ in range(6):
        h = g.tanh(h) * 0.5
    g.set_outputs([h])
    exe = rlx.compile(g)
    rep = exe.memory_report()
    assert rep["arena_bytes"] < rep["unshared_bytes"]
    # 12 intermediates of 256 B would need 3 KiB; a chain needs two live at a time
    assert rep["intermediate_bytes"] >= 10 * 256
    assert rep["arena_bytes"] <= rep["unshared_bytes"] - rep["intermediate_bytes"] + 3 * 256
    xs = np.linspace(-2, 2, 64, dtype=np.float32)
    ref = xs.astype(np.float64)
    for _ in range(6):
        ref = np.tanh(ref) * 0.5
    np.testing.assert_allclose(exe.run({"x": xs})[0], ref, rtol=1e-5, atol=1e-6)
    text = str(rep)
    assert "arena" in text and "without reuse" in text


def test_views_alias_and_extend_life():
    g = rlx.Graph("views")
    x = g.input("x", (3, 4), "f32")
    e = g.exp(x)
    r = g.reshape(e, (12,))
    c = g.cast(r, "f32")           # same dtype: a view
    y = g.neg(g.sin(x))            # runs after e's last direct use
    z = g.reshape(c, (4, 3)) + 1.0
    g.set_outputs([z, y])
    exe = rlx.compile(g)
    assert exe.memory_report()["views"] == 3
    rng = np.random.default_rng(1)
    xs = rng.standard_normal((3, 4)).astype(np.float32)
    z_, y_ = exe.run({"x": xs})
    np.testing.assert_allclose(z_, np.exp(xs).reshape(4, 3) + 1, rtol=1e-6)
    np.testing.assert_allclose(y_, -np.sin(xs), rtol=1e-6, atol=1e-7)


_UNARY = {"tanh": np.tanh, "sin": np.sin, "neg": np.negative, "abs": np.abs,
          "sigmoid": lambda v: 1 / (1 + np.exp(-v))}
_BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "max": np.maximum,
           "min": np.minimum}


@pytest.mark.parametrize("seed", range(3))
def test_random_graphs_match_numpy_and_never_overlap(seed):
    """Random DAGs of element-wise ops with broadcasting: results equal NumPy's, and no two
    buffers live at the same step share bytes."""
    rng = np.random.default_rng(100 + seed)
    g = rlx.Graph(f"random{seed}")
    shapes = [(5, 3), (3,), (5, 1), (1, 3)]
    tensors, values = [], []
    for k in range(3):
        s = shapes[k % len(shapes)]
        tensors.append(g.input(f"x{k}", s, "f32"))
        values.append(rng.standard_normal(s).astype(np.float32))
    feed = {f"x{k}": v for k, v in enumerate(values)}
    ref = [v.astype(np.float64) for v in values]
    for _ in range(14):
        if rng.random() < 0.4:
            kind = str(rng.choice(list(_UNARY)))
            j = int(rng.integers(len(tensors)))
            tensors.append(g.activation(kind, tensors[j]))
            ref.append(_UNARY[kind](ref[j]))
        else:
            kind = str(rng.choice(list(_BINARY)))
            i, j = (int(v) for v in rng.integers(len(tensors), size=2))
            tensors.append(g.binary(kind, tensors[i], tensors[j]))
            ref.append(_BINARY[kind](ref[i], ref[j]))
    outs = sorted({int(v) for v in rng.integers(3, len(tensors), size=3)})
    g.set_outputs([tensors[o] for o in outs])
    exe = rlx.compile(g)
    bufs = list(exe.buffers.values())
    assert _overlaps(bufs) is None
    for got, o in zip(exe.run(feed), outs):
        np.testing.assert_allclose(got, ref[o], rtol=1e-5, atol=1e-6)


def test_wide_index_path_matches(monkeypatch, rng):
    """Outputs of 2**32+ elements use int64 division instead of magic numbers: same results."""
    import rlx_numba.runtime.lower as lower
    monkeypatch.setattr(lower, "IDX32_LIMIT", 0)
    g = rlx.Graph("wide")
    a = g.input("a", (3, 1, 5), "f32")
    b = g.input("b", (4, 1), "f32")
    g.set_outputs([a - b])
    av = rng.standard_normal((3, 1, 5)).astype(np.float32)
    bv = rng.standard_normal((4, 1)).astype(np.float32)
    exe = rlx.compile(g)
    assert "r // d" in exe.steps[0].info["source"]
    np.testing.assert_array_equal(exe.run({"a": av, "b": bv})[0], av - bv)
