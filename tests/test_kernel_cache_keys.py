"""The kernel disk cache's keys are the same in every process (kernels/cache.py func_key).

A key that changes from one process to the next makes the kernel a miss in every process: it
is compiled (seconds for gemv's kernels on an H100) and written again each time. numba
pickles an intrinsic (kernels/ptx.py's loads, which gemv's kernels hold in their closures)
with a uuid1 drawn per process, and cells of sets / dynamic classes would change with the
hash seed; so the keys of the kernels a Llama prefill and decode step use (the GPU's
variants: ptx loads, programmatic dependent launch, norm prologue, gated epilogue, half
activations) are computed in two processes with different PYTHONHASHSEED and compared.

The processes import rlx_numba with the simulator off (RLX_NUMBA_SIMULATOR=0): the factories
then build real numba CUDA dispatchers, which needs no GPU (nothing is compiled)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import rlx_numba as rlx
from test_cache import NUMBA_FAKES

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import json
from rlx_numba.kernels import attention, gemv, quant, reduce, rope, rows
from rlx_numba.kernels.cache import func_key
geo = attention.GPU
kernels = {
    # gemv (tier 3): m, nw, tw, cpw, u, kind, vec, bias, act, res, minb, gated, xkind, norm, pdl
    "gemv qkv norm pdl": gemv.gemv_kernel(1, 4, 1, 4, 2, "f32", 4, False, None, False, 1,
                                          False, "f32", True, True),
    "gemv o residual": gemv.gemv_kernel(1, 4, 1, 4, 2, "f32", 4, False, None, True, 1, False,
                                        "f32", False, False),
    "gemv gate/up silu": gemv.gemv_kernel(1, 4, 2, 2, 2, "f32", 4, False, "silu", False, 3,
                                          True, "f32", True, True),
    "gemv bf16": gemv.gemv_kernel(1, 4, 1, 4, 2, "bf16", 8, True, "gelu", False, 1, False,
                                  "bf16", False, False),
    "gemv q4_1": quant.gemv_kernel("q4_1", 8, 1, 4, 1, False, 1, 2, False, "silu", False,
                                   True),
    "decode attention": attention.decode_split(geo, 2, 3, 2, True, False, True, False, False,
                                               "f32", "f32", True),
    "prefill attention": attention.flash(geo, attention.head_split(geo, 64), True, True, False,
                                         True, False, False),
    "rms_norm": rows.rows_reg(3, 256, 4, 576, False, True, True, False, True, "f32", "f32"),
    "rope_kv_write": rope.rope_kv_write("f32", "f32", False),
    "argmax": reduce.arg_rows(4, "f32", "f32", 2, 256, 1),
}
out = {name: list(func_key(k.py_func)) for name, k in kernels.items()}
# a miss (the cache dir is empty) is counted and named
from numba.cuda import types
from rlx_numba.kernels import cache


""" + NUMBA_FAKES + """


sig = (types.float32[::1],)
got = kernels["rope_kv_write"]._cache.load_overload(sig, Context())
print(json.dumps({"keys": out, "loaded": got, "misses": cache.STATS["misses"],
                  "missed": cache.MISSED}))
"""


def _start(seed: str, tmp_path):
    env = {**os.environ, "RLX_NUMBA_SIMULATOR": "0", "PYTHONHASHSEED": seed,
           "RLX_NUMBA_CACHE_DIR": str(tmp_path / seed),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for var in ("NUMBA_ENABLE_CUDASIM", "NUMBA_CACHE_DIR"):
        env.pop(var, None)
    return subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _keys(proc) -> dict:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_kernel_cache_keys_equal_across_processes(tmp_path):
    p1, p2 = _start("1", tmp_path), _start("2", tmp_path)     # at once: two imports of numba
    r1, r2 = _keys(p1), _keys(p2)
    a, b = r1["keys"], r2["keys"]
    assert a.keys() == b.keys() and len(a) == 10
    differ = {name: (a[name], b[name]) for name in a if a[name] != b[name]}
    assert not differ, f"kernel-cache keys differ between two processes: {differ}"
    # every one of these is a closure: its cells are in the key (not only its bytecode)
    assert all(len(code) == 64 and len(cells) == 64 for code, cells in a.values()), a
    # and the key tells variants apart
    assert len({tuple(v) for v in a.values()}) == len(a)
    # an empty cache: the kernel is a miss, counted and named (cache.MISSED, logged at INFO)
    assert r1["loaded"] is None and r1["misses"] == 1
    assert r1["missed"] == ["rlx_numba.kernels.rope.rope_kv_write.<locals>.rope_kv_write_kernel "
                            "(array(float32, 1d, C))"]


GENERATE = r"""
import json
import numpy as np
from rlx_numba.kernels import cache
from rlx_numba.models import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=True)
out = LlamaForCausalLM.from_config(cfg, seed=0).generate(np.array([[3, 14, 15, 9, 2]]), 3)
print(json.dumps({"tokens": out.tolist(), "hits": cache.STATS["hits"],
                  "misses": cache.STATS["misses"], "missed": cache.MISSED}))
"""


def test_key_does_not_change_when_a_compile_prints_llvm_types():
    """An intrinsic's codegen holds llvmlite IR types and constants; str() caches their IR
    text in their __dict__ the first time a compile prints them. Keyed by that __dict__, a
    gemv kernel made before any compile in one process and after one in another got two keys
    (on an H200 a second process missed one gemv variant every time)."""
    from llvmlite import ir

    from rlx_numba.kernels.cache import func_key

    def factory(t, c):
        def kernel():
            return t, c
        return kernel

    i32, three = ir.IntType(32), ir.Constant(ir.IntType(8), 3)
    before = func_key(factory(i32, three))
    str(i32), str(three), three.get_reference()       # what a compile does to them
    assert func_key(factory(i32, three)) == before
    assert func_key(factory(ir.IntType(64), three)) != before    # and the type still counts


@pytest.mark.skipif(rlx.simulator_enabled(),
                    reason="the simulator compiles nothing: no disk cache to hit")
def test_second_process_compiles_none_of_a_models_kernels_gpu(tmp_path):
    """A Llama prefill + decode in one process fills an empty kernel cache; a second process
    doing the same compiles nothing (every kernel a hit, cache.MISSED empty) and gives the
    same tokens. Every product (5 rows or 1) on tier 3, gemv's kernels (ptx loads and, on
    compute capability 9.0+, programmatic dependent launch in their closures): they missed
    in every process while an intrinsic's per-process uuid was in their keys."""
    env = {**os.environ, "RLX_NUMBA_CACHE_DIR": str(tmp_path), "RLX_NUMBA_MATMUL_TIERS": "3",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("NUMBA_CACHE_DIR", None)
    runs = []
    for seed in ("1", "2"):
        r = subprocess.run([sys.executable, "-c", GENERATE], env={**env, "PYTHONHASHSEED": seed},
                           capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-3000:]
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["misses"] > 0 and any("gemv" in name for name in first["missed"]), first
    assert second["missed"] == [] and second["misses"] == 0, second
    assert second["hits"] >= first["misses"] and second["tokens"] == first["tokens"]
