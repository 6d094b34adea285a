"""Attention beside torch's scaled_dot_product_attention, f32, same process, CUDA events.

Prefill (causal): B8 H32 S{1024, 4096} D128 and D64, and GQA Hq32/Hkv8; TFLOP/s counts the
causal half, 2 * B * Hq * S^2 * D, for both sides. Bar: >= 0.80 x torch.
Decode: B8 Hq32 Hkv8, one query, Sk {1024, 8192, 32768}, D128; GB/s of K and V read
(2 * B * Hkv * Sk * D * 4 bytes). Bar: >= 70% of the device's copy bandwidth.
Each side is timed over windows of back-to-back launches (CUDA events, best of 3) of at least
``--iters`` launches and at least 5 ms, the same rule for both.

Half precision (issue 31), bf16 and f16 beside torch's SDPA in the same dtype: tokens B * S =
32k, H32, S {1k, 4k, 16k}, D {64, 128}, causal and not, forward (TFLOP/s 4 B H S^2 D, halved
when causal) and backward (2.5x the forward's FLOPs; time = forward+backward - forward, on
both sides), per tier (RLX_NUMBA_ATTENTION_TIERS): tier 0 (cuDNN's fused attention forward and
backward, bar 0.95x both), tier 1 (the numba tensor-core flash forward and tensor-core
backward; bars 0.4x forward and 0.3x backward at D128 S4k) and tier 2 (the numba
f32-accumulating forward and backward kernels; no bar). Half-KV decode: the decode rows with bf16 K / V (bar 85% of copy).
Errors: max |ours - ref| / max |ref|, ref torch's SDPA in f32 of the same half inputs (torch's
own half result's error printed beside it).

  python bench/bench_attention.py [--iters 10] [--parts f32,half,decode_half]
      [--dtypes bf16,f16] [--tiers 0,1] [--seqs 1024,4096,16384] [--out bench/results/attention.json]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Results, copy_bandwidth, free_device_memory, gbps, time_rlx, time_torch  # noqa: E402

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


HALF_TOKENS, HALF_HEADS = 32768, 32
HALF_TOL = {"bf16": 2e-2, "f16": 4e-3}      # a few roundings of the output (bf16 2^-8, f16 2^-11)


def _to_host(t, dtype):
    """A torch half tensor as the host array rlx takes (bf16 through its bits: numpy has none)."""
    import ml_dtypes
    if dtype == "bf16":
        return t.view(__import__("torch").int16).cpu().numpy().view(ml_dtypes.bfloat16)
    return t.cpu().numpy()


def _rel_err(got, ref) -> float:
    """max |got - ref| / max |ref|, got a host array (half) and ref a torch f32 tensor."""
    import numpy as np
    r = ref.cpu().numpy().astype(np.float64)
    return float(np.abs(np.asarray(got, np.float64) - r).max() / max(np.abs(r).max(), 1e-30))


def bench_half(b, h, s, d, causal, dtype, tier, rlx, cuda, torch, iters):
    """Forward and backward of one half-precision row on ``tier`` (RLX_NUMBA_ATTENTION_TIERS)."""
    import os
    F = torch.nn.functional
    tdt = {"bf16": torch.bfloat16, "f16": torch.float16}[dtype]
    os.environ["RLX_NUMBA_ATTENTION_TIERS"] = str(tier)
    # the backward's tier of the same number: cuDNN's fused one, the numba tensor-core
    # kernels, the numba f32 kernels
    os.environ["RLX_NUMBA_ATTENTION_BWD_TIERS"] = str(tier)
    try:
        shape = (b, h, s, d)
        tq, tk, tv, tdo = (torch.randn(*shape, device="cuda").to(tdt) for _ in range(4))
        feeds = {n: _to_host(t, dtype) for n, t in zip("qkv", (tq, tk, tv))}
        exes = {}
        for part in ("fwd", "fwdbwd"):
            g = rlx.Graph(f"attn_{part}")
            q, k, v = (g.input(n, shape, dtype) for n in "qkv")
            y = g.attention(q, k, v, causal=causal)
            if part == "fwd":
                g.set_outputs([y])
            else:
                do = g.input("do", shape, dtype)
                g.set_outputs([y, *g.grad(y, [q, k, v], seed=do)])
            exes[part] = rlx.compile(g)
        got = exes["fwdbwd"].run({**feeds, "do": _to_host(tdo, dtype)})
        # the f32 reference of the same half inputs, and torch's own half result
        q32, k32, v32 = (t.float().requires_grad_() for t in (tq, tk, tv))
        o32 = F.scaled_dot_product_attention(q32, k32, v32, is_causal=causal)
        refs = [o32.detach(), *torch.autograd.grad(o32, (q32, k32, v32), tdo.float())]
        errs = [_rel_err(gt.astype("float64"), r) for gt, r in zip(got, refs)]
        qh, kh, vh = (t.clone().requires_grad_() for t in (tq, tk, tv))
        oh = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal)
        t_errs = [_rel_err(x.detach().float().cpu().numpy(), r) for x, r in
                  zip([oh, *torch.autograd.grad(oh, (qh, kh, vh), tdo)], refs)]
        del q32, k32, v32, o32, refs, oh
        fwd = lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)  # noqa: E731

        def fwdbwd():
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal)
            torch.autograd.grad(o, (qh, kh, vh), tdo)
        ms = {}
        for part, exe in exes.items():
            steps = exe.steps

            def launch(steps=steps):
                for st in steps:
                    st()
            est = time_rlx(cuda, launch, exe.stream, 2, 1, 1)
            ms["rlx_" + part] = time_rlx(cuda, launch, exe.stream, _iters(iters, est), 2, 3)
        for part, fn in (("fwd", fwd), ("fwdbwd", fwdbwd)):
            ms["torch_" + part] = time_torch(torch, fn, _iters(iters, time_torch(torch, fn, 2, 1, 1)), 2, 3)
        kernels = {p: [st.kernel_name for st in e.steps] for p, e in exes.items()}
    finally:
        os.environ.pop("RLX_NUMBA_ATTENTION_TIERS", None)
        os.environ.pop("RLX_NUMBA_ATTENTION_BWD_TIERS", None)
    flops = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
    rows = []
    for part, fl in (("fwd", flops), ("bwd", 2.5 * flops)):
        if part == "fwd":
            r_ms, t_ms, err, t_err = ms["rlx_fwd"], ms["torch_fwd"], errs[0], t_errs[0]
        else:
            r_ms = ms["rlx_fwdbwd"] - ms["rlx_fwd"]
            t_ms = ms["torch_fwdbwd"] - ms["torch_fwd"]
            err, t_err = max(errs[1:]), max(t_errs[1:])
        bar = (0.95 if tier == 0 else
               (0.4 if part == "fwd" else 0.3) if tier == 1 and (s, d) == (4096, 128) else None)
        ok_err = err <= max(HALF_TOL[dtype], 2 * t_err)
        rows.append(dict(shape=f"B{b} H{h} S{s} D{d}", dtype=dtype, causal=causal, tier=tier,
                         part=part, rlx_ms=r_ms, torch_ms=t_ms, ratio=t_ms / r_ms,
                         rlx_tflops=fl / r_ms / 1e9, torch_tflops=fl / t_ms / 1e9, bar=bar,
                         max_err=err, torch_err=t_err,
                         pass_=(bar is None or t_ms / r_ms >= bar) and ok_err,
                         kernels=kernels["fwd" if part == "fwd" else "fwdbwd"]))
    for r in rows:
        r["pass"] = r.pop("pass_")
    del exes, tq, tk, tv, tdo, qh, kh, vh
    free_device_memory(cuda, torch)
    return rows


def half_rows(args, rlx, cuda, torch, results, save):
    print(f"\n{'half prefill':<40} {'rlx TFLOP/s':>11} {'torch TFLOP/s':>13} {'ratio':>6}  bar  "
          f"err (torch's)  kernels")
    for dtype in args.dtypes.split(","):
        for tier in (int(t) for t in args.tiers.split(",")):
            for d in (64, 128):
                for s in (int(x) for x in args.seqs.split(",")):
                    for causal in (True, False):
                        if tier != 0 and s != 4096:   # tier 1's bar is at S4k only
                            continue
                        label = (f"{dtype} t{tier} S{s} D{d}{' causal' if causal else ''}")
                        try:
                            rows = bench_half(max(1, HALF_TOKENS // s), HALF_HEADS, s, d, causal,
                                              dtype, tier, rlx, cuda, torch, args.iters)
                        except Exception as e:  # noqa: BLE001 - report the row, keep going
                            print(f"{label:<40} ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
                            results.append(dict(shape=label, dtype=dtype, tier=tier, causal=causal,
                                                error=f"{type(e).__name__}: {e}", **{"pass": False}))
                            save()
                            free_device_memory(cuda, torch)
                            continue
                        for r in rows:
                            results.append(r)
                            ks = sorted(set(r["kernels"]))
                            print(f"{label + ' ' + r['part']:<40} {r['rlx_tflops']:11.1f} "
                                  f"{r['torch_tflops']:13.1f} {r['ratio']:6.2f} "
                                  f"{r['bar'] if r['bar'] is not None else '-':>4} "
                                  f"{'PASS' if r['pass'] else 'FAIL'} {r['max_err']:.1e} "
                                  f"({r['torch_err']:.1e})  {' | '.join(ks)[:160]}", flush=True)
                        save()


def decode_half_rows(args, rlx, cuda, torch, copy, results, save):
    """The decode rows with bf16 q / K / V (bar 85% of copy bandwidth on K and V's bytes)."""
    import os
    os.environ.pop("RLX_NUMBA_ATTENTION_TIERS", None)
    F = torch.nn.functional
    print(f"\n{'decode bf16 (1 query)':<34} {'rlx GB/s':>11} {'torch GB/s':>13} {'% copy':>6}  bar  max|err|")
    for b, hq, hkv, sk, d in DECODE:
        tq = torch.randn(b, hq, 1, d, device="cuda").bfloat16()
        tk, tv = (torch.randn(b, hkv, sk, d, device="cuda").bfloat16() for _ in range(2))
        g = rlx.Graph("attn_dec")
        q = g.input("q", tq.shape, "bf16")
        k, v = g.input("k", tk.shape, "bf16"), g.input("v", tv.shape, "bf16")
        g.set_outputs([g.attention(q, k, v)])
        exe = rlx.compile(g)
        (got,) = exe.run({n: _to_host(t, "bf16") for n, t in zip("qkv", (tq, tk, tv))})
        ref = F.scaled_dot_product_attention(tq.float(), tk.float(), tv.float(), enable_gqa=True)
        err = _rel_err(got.astype("float64"), ref)
        tfn = lambda: F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)  # noqa: E731
        steps = exe.steps

        def launch():
            for st in steps:
                st()
        rlx_ms = time_rlx(cuda, launch, exe.stream, _iters(args.iters, time_rlx(cuda, launch, exe.stream, 3, 1, 1)), 2, 3)
        torch_ms = time_torch(torch, tfn, _iters(args.iters, time_torch(torch, tfn, 3, 1, 1)), 2, 3)
        kv = 2 * b * hkv * sk * d * 2
        r = dict(shape=f"B{b} Hq{hq} Hkv{hkv} Sq1 Sk{sk} D{d}", dtype="bf16", rlx_ms=rlx_ms,
                 torch_ms=torch_ms, rlx_gbps=gbps(kv, rlx_ms), torch_gbps=gbps(kv, torch_ms),
                 bar="0.85 copy", max_err=err, kernels=[st.kernel_name for st in steps])
        r["pass"] = r["rlx_gbps"] >= 0.85 * copy and err <= HALF_TOL["bf16"]
        results.append(r)
        save()
        print(f"{r['shape']:<34} {r['rlx_gbps']:11.0f} {r['torch_gbps']:13.0f} "
              f"{100 * r['rlx_gbps'] / copy:5.0f}%  {'PASS' if r['pass'] else 'FAIL'} "
              f"{err:.1e}  {' | '.join(r['kernels'])}", flush=True)
        del exe, tq, tk, tv, ref
        free_device_memory(cuda, torch)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--parts", default="f32,half,decode_half",
                   help="comma-separated: f32 (prefill + decode), half (prefill), decode_half")
    p.add_argument("--dtypes", default="bf16,f16")
    p.add_argument("--tiers", default="0,1", help="half prefill tiers (RLX_NUMBA_ATTENTION_TIERS)")
    p.add_argument("--seqs", default="1024,4096,16384", help="half prefill sequence lengths")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "attention.json")
    args = p.parse_args(argv)
    parts = set(args.parts.split(","))
    if parts - {"f32", "half", "decode_half"}:
        p.error(f"--parts: unknown {sorted(parts - {'f32', 'half', 'decode_half'})}")
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
    out = Results(args.out, gpu=gpu, copy_gbps=copy, results=results)
    if "f32" in parts:
        f32_rows(args, rlx, cuda, torch, copy, results, out.save)
    if "half" in parts:
        half_rows(args, rlx, cuda, torch, results, out.save)
    if "decode_half" in parts:
        decode_half_rows(args, rlx, cuda, torch, copy, results, out.save)
    out.done()
    fails = sum(not r["pass"] for r in results)
    print(f"{len(results) - fails}/{len(results)} rows pass")
    return 0


def f32_rows(args, rlx, cuda, torch, copy, results, save):
    print(f"{'prefill (causal)':<34} {'rlx TFLOP/s':>11} {'torch TFLOP/s':>13} {'ratio':>6}  bar  max|err|  kernel")
    for b, hq, hkv, s, d in PREFILL:
        r = bench(b, hq, hkv, s, s, d, True, rlx, cuda, torch, args.iters)
        flops = 2.0 * b * hq * s * s * d
        r.update(rlx_tflops=flops / r["rlx_ms"] / 1e9, torch_tflops=flops / r["torch_ms"] / 1e9,
                 bar=0.8)
        r["pass"] = r["ratio"] >= 0.8 and r["max_err"] < 1e-3
        results.append(r)
        save()
        print(f"{r['shape']:<34} {r['rlx_tflops']:11.1f} {r['torch_tflops']:13.1f} {r['ratio']:6.2f}  "
              f"{'PASS' if r['pass'] else 'FAIL'} {r['max_err']:.1e}  {r['kernels'][0]}", flush=True)
    print(f"\n{'decode (1 query)':<34} {'rlx GB/s':>11} {'torch GB/s':>13} {'% copy':>6}  bar  max|err|  kernels")
    for b, hq, hkv, sk, d in DECODE:
        r = bench(b, hq, hkv, 1, sk, d, False, rlx, cuda, torch, args.iters)
        kv = 2 * b * hkv * sk * d * 4
        r.update(rlx_gbps=gbps(kv, r["rlx_ms"]), torch_gbps=gbps(kv, r["torch_ms"]), bar="0.70 copy")
        r["pass"] = r["rlx_gbps"] >= 0.7 * copy and r["max_err"] < 1e-3
        results.append(r)
        save()
        print(f"{r['shape']:<34} {r['rlx_gbps']:11.0f} {r['torch_gbps']:13.0f} "
              f"{100 * r['rlx_gbps'] / copy:5.0f}%  {'PASS' if r['pass'] else 'FAIL'} "
              f"{r['max_err']:.1e}  {' | '.join(r['kernels'])}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
