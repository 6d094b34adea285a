"""Warm start (issue 36): ``rlx-numba warmup MODEL`` in one process, then fresh processes that
each import rlx_numba, load the GGUF with ``from_gguf`` and run a first ``generate`` -- the
figure the issue bounds (<= 1.5 s on an H100, kernels and tuning verdicts from the disk
cache). Each fresh process prints its phases, the kernel cache's hits and misses, and names
every kernel it had to compile (kernels/cache.py MISSED: a warm process should list none).

    python tools/warm_start.py MODEL.gguf [--runs 3] [--cache DIR] [--prompt-len 32]
        [--new 8] [--weights f32|gguf] [--no-warmup] [--profile N]

``--cache``: the kernel cache dir for every process (RLX_NUMBA_CACHE_DIR; default a fresh
temporary one, so the warmup starts cold). ``--profile N``: the first fresh process runs under
cProfile and prints its N costliest calls (cumulative). Exits 1 when a fresh process missed
the cache."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import numpy as np
import rlx_numba
from rlx_numba.kernels import cache
from rlx_numba.models import LlamaForCausalLM
path, weights = sys.argv[1], sys.argv[4]
plen, new, top = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[5])
prof = None
if top:
    import cProfile
    prof = cProfile.Profile()
    prof.enable()
t1 = time.perf_counter()
m = LlamaForCausalLM.from_gguf(path, weights=weights)
t2 = time.perf_counter()
m.generate(np.ones((1, plen), np.int64), new)
t3 = time.perf_counter()
if prof is not None:
    import pstats
    prof.disable()
    pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(top)
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "generate_s": t3 - t2,
                  "hits": cache.STATS["hits"], "misses": cache.STATS["misses"],
                  "missed": cache.MISSED}))
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a Llama-family .gguf file")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--cache", help="kernel cache dir (default: a fresh temporary one)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new", type=int, default=8)
    p.add_argument("--weights", default="f32", choices=("f32", "gguf"))
    p.add_argument("--no-warmup", action="store_true", help="the cache is filled already")
    p.add_argument("--profile", type=int, default=0, metavar="N")
    a = p.parse_args(argv)
    tmp = None
    if a.cache is None:
        tmp = tempfile.TemporaryDirectory(prefix="rlx_warm_")
        a.cache = tmp.name
    env = {**os.environ, "RLX_NUMBA_CACHE_DIR": a.cache}
    env.pop("NUMBA_CACHE_DIR", None)
    print(f"kernel cache: {a.cache}")
    if not a.no_warmup:
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "rlx_numba.cli", "warmup", a.model,
                            "--prompt-len", str(a.prompt_len), "--new", str(a.new),
                            "--weights", a.weights], env=env,
                           capture_output=True, text=True)
        print(r.stdout.strip())
        if r.returncode:
            print(r.stderr[-3000:], file=sys.stderr)
            return r.returncode
        print(f"warmup process: {time.perf_counter() - t:.1f} s wall")
    rows, bad = [], False
    for i in range(a.runs):
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-c", CHILD, a.model, str(a.prompt_len), str(a.new),
                            a.weights, str(a.profile if i == 0 else 0)], env=env,
                           capture_output=True, text=True)
        wall = time.perf_counter() - t
        if r.returncode:
            print(r.stderr[-3000:], file=sys.stderr)
            return r.returncode
        if a.profile and i == 0:
            print(r.stderr[-20000:])
        row = json.loads(r.stdout.strip().splitlines()[-1])
        row["wall_s"] = wall
        rows.append(row)
        print(f"fresh process {i}: {wall:.2f} s wall; import {row['import_s']:.2f} s, from_gguf "
              f"{row['load_s']:.2f} s, first generate {row['generate_s']:.2f} s (load + "
              f"generate {row['load_s'] + row['generate_s']:.2f} s); kernel cache "
              f"{row['hits']} hits, {row['misses']} misses")
        for name in row["missed"]:
            print(f"    compiled: {name}")
        bad |= row["misses"] > 0
    print(json.dumps({"model": a.model, "weights": a.weights, "runs": rows}))
    if tmp is not None:
        tmp.cleanup()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
