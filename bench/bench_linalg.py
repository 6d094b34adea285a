"""Linear algebra on the GPU beside torch.linalg in the same process (issue 34's bench).

  solve (16 right-hand sides), cholesky, qr (reduced), svd (full_matrices=False), eigh
  on a batch of 4096 64x64 matrices and on one 4096x4096 matrix, f32 (and with --dtypes
  f32,f64 or f64 the same shapes in f64 beside torch.linalg in float64):
  ours on tier 0 (cuSOLVER / cuBLAS, the S or D routines; bar 0.8x torch) and, for the batch,
  tier 1 (the numba kernels, a block a matrix, in the dtype's kind; no bar: measured and
  stated, with a summary of those rows at the end).
Each row checks a gauge-invariant residual (||A X - B||, ||L L^T - A||, ||Q R - A||,
||U S Vh - A||, ||V diag(w) V^T - A||, relative, in float64 on the GPU) for ours and torch's;
a tier 0 row passes with its ratio at the bar and a residual below 1e-3 (f32) or 1e-11 (f64).
Our time is the CUDA-event sum of the executable's steps (exe.profile; a loop of cuSOLVER
calls a matrix counts its host gaps too); torch's by events around the call. The single
4096x4096 svd and eigh take seconds a call: each side is timed once after one untimed call
(the output says so); every other row is the best of repeats.

  python bench/bench_linalg.py [--out F] [--skip batch,numba,single] [--ops solve,qr]
                               [--dtypes f32,f64]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Results, free_device_memory, time_torch  # noqa: E402

BAR = 0.8
OPS = ("solve", "cholesky", "qr", "svd", "eigh")
DTYPES = {"f32": np.float32, "f64": np.float64}
MAX_RESIDUAL = {"f32": 1e-3, "f64": 1e-11}     # f64's: far below anything f32 math reaches
SLOW_SINGLE = ("svd", "eigh")                   # seconds a call at 4096x4096: timed once


def _inputs(rng, op, batch, n, dtype):
    f = DTYPES[dtype]
    a = (rng.standard_normal(batch + (n, n)) / np.sqrt(n)).astype(f)
    if op in ("cholesky", "eigh"):
        a = (a @ np.swapaxes(a, -1, -2) + np.eye(n, dtype=f)).astype(f)
    elif op == "solve":
        a = (a + 2 * np.eye(n)).astype(f)
    feed = {"a": a}
    if op == "solve":
        feed["b"] = rng.standard_normal(batch + (n, 16)).astype(f)
    return feed


def _build(g, op, t):
    a = t["a"]
    return {"solve": lambda: [g.linalg_solve(a, t["b"])], "cholesky": lambda: [g.cholesky(a)],
            "qr": lambda: list(g.qr(a)), "svd": lambda: list(g.svd(a)),
            "eigh": lambda: list(g.eigh(a))}[op]()


def _torch_call(torch, op, t):
    la = torch.linalg
    return {"solve": lambda: la.solve(t["a"], t["b"]), "cholesky": lambda: la.cholesky(t["a"]),
            "qr": lambda: la.qr(t["a"]), "svd": lambda: la.svd(t["a"], full_matrices=False),
            "eigh": lambda: la.eigh(t["a"])}[op]


def _residual(torch, op, t, outs):
    """||reconstruction - A|| / ||A|| (solve: ||A X - B|| / ||B||), float64."""
    d = [torch.as_tensor(np.asarray(o), device="cuda").double() if not torch.is_tensor(o)
         else o.double() for o in outs]
    a = t["a"].double()
    if op == "solve":
        r, ref = a @ d[0] - t["b"].double(), t["b"].double()
    elif op == "cholesky":
        r, ref = d[0] @ d[0].mT - a, a
    elif op == "qr":
        r, ref = d[0] @ d[1] - a, a
    elif op == "svd":
        r, ref = (d[0] * d[1][..., None, :]) @ d[2] - a, a
    else:
        r, ref = (d[1] * d[0][..., None, :]) @ d[1].mT - a, a
    return float(torch.linalg.norm(r.flatten()) / torch.linalg.norm(ref.flatten()))


def _shape(batch, n):
    return f"{batch[0]}x{n}x{n}" if batch else f"{n}x{n}"


def op_row(rlx, torch, op, batch, n, tier, dtype="f32"):
    rng = np.random.default_rng(0)
    feed = _inputs(rng, op, batch, n, dtype)
    g = rlx.Graph(f"{op}")
    t = {k: g.input(k, v.shape, dtype) for k, v in feed.items()}
    g.set_outputs(_build(g, op, t))
    os.environ["RLX_NUMBA_LINALG_TIERS"] = tier
    try:
        exe = rlx.compile(g)
    finally:
        os.environ.pop("RLX_NUMBA_LINALG_TIERS", None)
    heavy = n >= 1024
    once = heavy and op in SLOW_SINGLE
    got = exe.run(feed)                 # (the first run: compiles, sizes the workspaces)
    prof = exe.profile(feed, warmup=0 if once else 1)
    tt = {k: torch.tensor(v, device="cuda") for k, v in feed.items()}
    call = _torch_call(torch, op, tt)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    want = call()                       # (torch's untimed call)
    torch.cuda.synchronize()
    slow = time.perf_counter() - t0 > 0.5      # (the batched svd / eigh: seconds a call)
    want = [want] if torch.is_tensor(want) else list(want)
    if once:
        theirs = time_torch(torch, call, 1, 0, 1)
    else:
        theirs = time_torch(torch, call, 1 if heavy or slow else 5, 1 if not slow else 0,
                            2 if heavy or slow else 3)
    row = dict(row=f"{op} {_shape(batch, n)}", tier=tier, dtype=dtype, rlx_ms=prof.total_ms,
               torch_ms=theirs, ratio=theirs / prof.total_ms,
               rlx_residual=_residual(torch, op, tt, got),
               torch_residual=_residual(torch, op, tt, want), timed_once=once,
               steps=[(r.kernel, r.ms) for r in prof])
    if tier == "0":
        row.update(bar=BAR, **{"pass": row["ratio"] >= BAR
                               and row["rlx_residual"] < MAX_RESIDUAL[dtype]})
    del exe, tt, want, got
    free_device_memory(rlx_cuda(), torch)
    return row


def rlx_cuda():
    from numba import cuda
    return cuda


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path,
                   default=Path(__file__).resolve().parent / "results" / "linalg.json")
    p.add_argument("--skip", default="", help="comma-separated: batch (tier 0 on 4096 64x64), numba (tier 1 on "
                   "them), single (4096x4096)")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {OPS}")
    p.add_argument("--dtypes", default="f32",
                   help="comma-separated: f32, f64 (f64 rows beside torch.linalg in float64)")
    args = p.parse_args()
    skip, ops = set(args.skip.split(",")), [o for o in args.ops.split(",") if o]
    dtypes = [d for d in args.dtypes.split(",") if d]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        p.error(f"--dtypes: unknown {bad}; choose from {list(DTYPES)}")
    import torch

    import rlx_numba as rlx
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"GPU: {torch.cuda.get_device_name()}   torch {torch.__version__}   "
          f"{', '.join(dtypes)}")
    print("tier 0: cuSOLVER / cuBLAS, bar 0.8x torch; tier 1: the numba kernels (a block a "
          "matrix), no bar: measured and stated")
    if "single" not in skip and any(o in SLOW_SINGLE for o in ops):
        print(f"single 4096x4096 {' / '.join(o for o in SLOW_SINGLE if o in ops)}: seconds a "
              f"call, so each side is timed once after one untimed call (no repeats)")
    print()
    cases = ([((4096,), 64, "0")] if "batch" not in skip else []) \
        + ([((4096,), 64, "1")] if "numba" not in skip else []) \
        + ([((), 4096, "0")] if "single" not in skip else [])
    results = []
    out = Results(args.out, gpu=torch.cuda.get_device_name(), rows=results)
    for dtype in dtypes:
        for batch, n, tier in cases:
            for op in ops:
                try:
                    r = op_row(rlx, torch, op, batch, n, tier, dtype)
                except Exception as e:  # noqa: BLE001 - a failed row is reported, the rest run
                    r = dict(row=f"{op} {_shape(batch, n)}", tier=tier, dtype=dtype,
                             error=f"{type(e).__name__}: {e}")
                    print(f"{r['row']:<20} {dtype} tier {tier}  ERROR {r['error']}", flush=True)
                    results.append(r)
                    out.save()
                    continue
                verdict = "  (numba tier: no bar)" if "pass" not in r else \
                    ("  PASS" if r["pass"] else "  FAIL")
                once = " (timed once)" if r["timed_once"] else ""
                print(f"{r['row']:<20} {dtype} tier {tier}  ours {r['rlx_ms']:9.3f} ms  torch "
                      f"{r['torch_ms']:9.3f} ms  {r['ratio']:5.2f}x torch  residual "
                      f"{r['rlx_residual']:.1e} (torch {r['torch_residual']:.1e}){verdict}"
                      f"{once}   " + " | ".join(f"{k[:30]} {ms:.3f}" for k, ms in r["steps"][:5]),
                      flush=True)
                results.append(r)
                out.save()
    numba = [r for r in results if r.get("tier") == "1" and "error" not in r]
    if numba:
        print("\nthe numba tier (tier 1, a block a matrix) on 4096 64x64 matrices, beside "
              "torch.linalg:")
        for r in numba:
            print(f"  {r['row']:<20} {r['dtype']}  {r['rlx_ms']:9.3f} ms  = {r['ratio']:5.2f}x "
                  f"torch ({r['torch_ms']:.3f} ms)  residual {r['rlx_residual']:.1e}")
    out.done()


if __name__ == "__main__":
    main()
