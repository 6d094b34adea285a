"""Attention beside torch's scaled_dot_product_attention, f32, same process, CUDA events.

Prefill (causal): B8 H32 S{1024, 4096} D128 and D64, and GQA Hq32/Hkv8; TFLOP/s counts the
causal half, 2 * B * Hq * S^2 * D, for both sides. Bar: >= 0.80 x torch.
Decode: B8 Hq32 Hkv8, one query, Sk {1024, 8192, 32768}, D128; GB/s of K and V read
(2 * B * Hkv * Sk * D * 4 bytes). Bar: >= 70% of the device's copy bandwidth.
Each side is timed over windows of back-to-back launches (CUDA events, best of 3) of at least
``--iters`` launches and at least 5 ms, the same rule for both.

  python bench/bench_attention.py [--iters 10] [--out bench/results/attention.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_bandwidth, free_device_memory, gbps, time_rlx, time_torch  # noqa: E402

PREFILL = [(8, 32, 32, 1024, 128), (8, 32, 32, 4096, 128), (8, 32, 32, 1024, 64),
           (8, 32, 32, 4096, 64), (8, 32, 8, 1024, 128), (8, 32, 8, 4096, 128)]
DECODE = [(8, 32, 8, 1024, 128), (8, 32, 8, 8192, 128), (8, 32, 8, 32768, 128)]


WINDOW_MS = 5.0


def _iters(iters: int, est_ms: float) -> int:
    """Launches a timed window: ``iters``, or more when that would last under WINDOW_MS."""
    return max(iters, min(1000, int(WINDOW_MS / max(est_ms, 1e-4))))


def bench(b, hq, hkv, sq, sk, d, causal, rlx, cuda, torch, iters):
    F = torch.nn.functional
    g = rlx.Graph("attn")
    q = g.input("q", (b, hq, sq, d))
    k, v = g.input("k", (b, hkv, sk, d)), g.input("v", (b, hkv, sk, d))
    g.set_outputs([g.attention(q, k, v, causal=causal)])
    exe = rlx.compile(g)
    tq = torch.randn(b, hq, sq, d, device="cuda")
    tk, tv = torch.randn(b, hkv, sk, d, device="cuda"), torch.randn(b, hkv, sk, d, device="cuda")
    torch.cuda.synchronize()
    (view,) = exe.run({"q": tq, "k": tk, "v": tv}, outputs="view")
    tfn = lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal,  # noqa: E731
                                                 enable_gqa=hq != hkv)
    ref = tfn()
    err = (torch.as_tensor(view, device="cuda") - ref).abs().max().item()
    steps = exe.steps

    def launch():
        for s in steps:
            s()
    # windows of at least WINDOW_MS: in a window of a few short launches the GPU's wait for
    # the first one (the host's enqueue, ~10 us) would count as a sizeable part of each
    rlx_ms = time_rlx(cuda, launch, exe.stream, _iters(iters, time_rlx(cuda, launch, exe.stream, 3, 1, 1)), 2, 3)
    torch_ms = time_torch(torch, tfn, _iters(iters, time_torch(torch, tfn, 3, 1, 1)), 2, 3)
    res = dict(shape=f"B{b} Hq{hq} Hkv{hkv} Sq{sq} Sk{sk} D{d}", causal=causal, rlx_ms=rlx_ms,
               torch_ms=torch_ms, ratio=torch_ms / rlx_ms, max_err=err,
               kernels=[s.kernel_name for s in steps])
    del exe, view, tq, tk, tv, ref
    free_device_memory(cuda, torch)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "attention.json")
    args = p.parse_args(argv)
    import rlx_numba as rlx
    if rlx.simulator_enabled():
        print("bench_attention: no CUDA GPU here (simulator); this benchmark needs a GPU. Nothing measured.")
        return 0
    import torch
    from numba import cuda
    gpu = torch.cuda.get_device_name()
    copy = copy_bandwidth(torch)
    print(f"GPU: {gpu}   torch {torch.__version__}   torch copy_ {copy:.0f} GB/s\n")
    results = []
    print(f"{'prefill (causal)':<34} {'rlx TFLOP/s':>11} {'torch TFLOP/s':>13} {'ratio':>6}  bar  max|err|  kernel")
    for b, hq, hkv, s, d in PREFILL:
        r = bench(b, hq, hkv, s, s, d, True, rlx, cuda, torch, args.iters)
        flops = 2.0 * b * hq * s * s * d
        r.update(rlx_tflops=flops / r["rlx_ms"] / 1e9, torch_tflops=flops / r["torch_ms"] / 1e9,
                 bar=0.8)
        r["pass"] = r["ratio"] >= 0.8 and r["max_err"] < 1e-3
        results.append(r)
        print(f"{r['shape']:<34} {r['rlx_tflops']:11.1f} {r['torch_tflops']:13.1f} {r['ratio']:6.2f}  "
              f"{'PASS' if r['pass'] else 'FAIL'} {r['max_err']:.1e}  {r['kernels'][0]}", flush=True)
    print(f"\n{'decode (1 query)':<34} {'rlx GB/s':>11} {'torch GB/s':>13} {'% copy':>6}  bar  max|err|  kernels")
    for b, hq, hkv, sk, d in DECODE:
        r = bench(b, hq, hkv, 1, sk, d, False, rlx, cuda, torch, args.iters)
        kv = 2 * b * hkv * sk * d * 4
        r.update(rlx_gbps=gbps(kv, r["rlx_ms"]), torch_gbps=gbps(kv, r["torch_ms"]), bar="0.70 copy")
        r["pass"] = r["rlx_gbps"] >= 0.7 * copy and r["max_err"] < 1e-3
        results.append(r)
        print(f"{r['shape']:<34} {r['rlx_gbps']:11.0f} {r['torch_gbps']:13.0f} "
              f"{100 * r['rlx_gbps'] / copy:5.0f}%  {'PASS' if r['pass'] else 'FAIL'} "
              f"{r['max_err']:.1e}  {' | '.join(r['kernels'])}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(gpu=gpu, copy_gbps=copy, results=results), indent=1))
    fails = sum(not r["pass"] for r in results)
    print(f"\n{len(results) - fails}/{len(results)} rows pass; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
