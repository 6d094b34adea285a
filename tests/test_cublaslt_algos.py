"""cuBLASLt algorithm choices kept on disk (cublas/gemm.py AlgoStore): a process takes a
product's algorithm from the file instead of running the heuristic and timing its candidates
again. The store itself runs anywhere; restoring into cuBLASLt needs a GPU."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import rlx_numba as rlx
from rlx_numba.cublas import gemm

ROOT = Path(__file__).resolve().parent.parent


def test_algo_store_keeps_choices_across_processes_and_ignores_damage(tmp_path, caplog):
    one, two = bytes(range(64)), bytes(64)
    a = gemm.AlgoStore(tmp_path)
    assert a.get("p1") is None                    # no file yet
    a.put("p1", one)
    gemm.AlgoStore(tmp_path).put("p2", two)       # another process: both kept
    b = gemm.AlgoStore(tmp_path)
    assert b.get("p1") == one and b.get("p2") == two and b.get("p3") is None
    path = tmp_path / gemm.AlgoStore.FILE
    path.write_text("{not json")                  # damaged: read as empty, then rewritten
    assert b.get("p1") is None
    b.put("p1", one)
    assert gemm.AlgoStore(tmp_path).get("p1") == one
    path.write_text(json.dumps({"p1": "zz" * 64, "p2": 5, "p3": "00" * 10}))   # foreign values
    assert [b.get(p) for p in ("p1", "p2", "p3")] == [None, None, None]
    (tmp_path / "file").write_text("")
    with caplog.at_level("WARNING", logger="rlx_numba"):
        gemm.AlgoStore(tmp_path / "file").put("p1", one)     # not a directory: a warning
    assert "could not save a cuBLASLt algorithm choice" in caplog.text


LINEAR = r"""
import json
import numpy as np
import rlx_numba as rlx
from rlx_numba.cublas import gemm
rng = np.random.default_rng(3)
x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((5, 33), (33, 17), (17,)))
g = rlx.Graph("lt")
h = g.linear(g.input("x", (5, 33), "f32"), g.param("w", (33, 17), "f32"),
             g.param("b", (17,), "f32"), activation="relu")
g.set_outputs([h])
exe = rlx.compile(g)
exe.set_param("w", w)
exe.set_param("b", b)
(y,) = exe.run({"x": x})
print(json.dumps({"y": y.tolist(), "hits": gemm.ALGOS.stats["hits"],
                  "misses": gemm.ALGOS.stats["misses"]}))
"""


@pytest.mark.skipif(rlx.simulator_enabled(), reason="cuBLASLt runs on a GPU only")
def test_second_process_restores_the_cublaslt_algorithm_gpu(tmp_path):
    """A linear on the cuBLASLt tier (RLX_NUMBA_MATMUL_TIERS=1) in two processes sharing an
    empty cache dir: the first chooses and stores the algorithm, the second restores it
    (cublasLtMatmulAlgoCheck accepts it) and computes the same output, bit for bit; both
    match a float64 oracle to TF32's precision."""
    env = {**os.environ, "RLX_NUMBA_CACHE_DIR": str(tmp_path), "RLX_NUMBA_MATMUL_TIERS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    runs = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", LINEAR], env=env, capture_output=True,
                           text=True, timeout=300, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-3000:]
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["misses"] >= 1 and first["hits"] == 0
    assert second["hits"] >= 1 and second["misses"] == 0
    assert second["y"] == first["y"]
    rng = np.random.default_rng(3)
    x, w, b = (rng.standard_normal(s) for s in ((5, 33), (33, 17), (17,)))
    x, w, b = (a.astype(np.float32).astype(np.float64) for a in (x, w, b))
    want = np.maximum(x @ w + b, 0)
    scale = np.abs(x) @ np.abs(w) + np.abs(b)
    assert np.all(np.abs(np.array(second["y"]) - want) <= 2 ** -10 * scale + 1e-6)
