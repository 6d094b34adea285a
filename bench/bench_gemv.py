"""Skinny products (decode sizes): matmul tier 3 (kernels/gemv.py) beside our cuBLASLt tier
and torch, as device time a product and as a share of the GPU's copy bandwidth on the
weight bytes (the bytes a product has to read: N * K * 4 for f32, N * K * 2 for bf16).

Rows: M in {1, 8} x (N, K) in {(960, 576), (576, 576), (3072, 576), (576, 1536),
(49152, 576)} (SmolLM2-135M's products and its vocabulary projection) x weight f32 / bf16:
  tier3    y = x @ W^T through our executable, RLX_NUMBA_MATMUL_TIERS=3 (the numba kernel;
           with a bf16 weight it rounds x to bf16 in registers, as tier 0's cast does);
  lt       the same product on our cuBLASLt tier: tier 1 (f32, TF32 off) or tier 0 (bf16:
           x cast to bf16 by our cast kernel, then cuBLASLt with f32 output) -- the steps it
           runs, cast included;
  torch    f32: F.linear(x, w) (cuBLAS, TF32 off). bf16: x.bfloat16() @ w_bf16.t(), i.e.
           torch's cast kernel plus a bf16 GEMM with a bf16 output (what a bf16 torch model
           does; it writes half the output bytes ours does, which at these sizes is noise).
Each is captured R times into one CUDA graph (torch.cuda.graph; our steps bound to the
capture stream), and the graph replayed over windows of >= 5 ms, CUDA events, best of 3:
device time a product including the gap between kernels inside a graph, as in a decode step.
``copy %`` = weight bytes / time / copy bandwidth (torch copy_ of 1 GiB, same run). Also
reported: which tier our compile-time timing picks when both are allowed, for an executable
compiled with exec_mode="graph" (``pick``, with the times it measured: a CUDA graph of 20).

With --norm each row is the product of rms_norm(x) instead (tier 3 takes the norm as its
prologue, the cuBLASLt row runs a norm step first, torch F.rms_norm then the product).

  python bench/bench_gemv.py [--m 1,8] [--shapes 960x576,...] [--dtypes f32,bf16] [--norm]
      [--out F]
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Results, copy_bandwidth, free_device_memory  # noqa: E402

SHAPES = "960x576,576x576,3072x576,576x1536,49152x576"
REPS = 50               # products a graph
EPS = 1e-6              # --norm's rms_norm eps
WINDOW_MS = 5.0


def graph_us(torch, enqueue, stream) -> float:
    """Device us a product: ``enqueue()`` REPS times captured in one graph on ``stream``,
    replayed over windows of >= WINDOW_MS, best of 3."""
    with torch.cuda.stream(stream):
        for _ in range(3):
            enqueue()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        for _ in range(REPS):
            enqueue()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):   # (replay() runs on the current stream)
        g.replay()
        torch.cuda.synchronize()
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        n = max(1, math.ceil(WINDOW_MS / max(e0.elapsed_time(e1), 1e-3)))
        best = math.inf
        for _ in range(3):
            e0.record()
            for _ in range(n):
                g.replay()
            e1.record()
            e1.synchronize()
            best = min(best, e0.elapsed_time(e1) / n)
    del g
    return best * 1e3 / REPS


def rlx_exe(rlx, tiers, m, n, k, wdt, w_kn, mode="stream", gamma=None):
    """A compiled y = x @ w with the weight set (f32, or bf16 by set_param_half); with
    ``gamma`` y = rms_norm(x, gamma, eps=EPS) @ w (the norm prologue: tier 3 normalises in its
    kernel, the other tiers run a row step first)."""
    if tiers is None:
        os.environ.pop("RLX_NUMBA_MATMUL_TIERS", None)
    else:
        os.environ["RLX_NUMBA_MATMUL_TIERS"] = tiers
    g = rlx.Graph("skinny")
    x = g.input("x", (m, k))
    if gamma is not None:
        x = g.rms_norm(x, g.param("gamma", (k,)), eps=EPS)
    g.set_outputs([g.linear(x, g.param("w", (k, n)))])
    exe = rlx.compile(g, exec_mode=mode)
    if gamma is not None:
        exe.set_param("gamma", gamma)
    if wdt == "f32":
        exe.set_param("w", w_kn)
    else:
        exe.set_param_half("w", w_kn, wdt)
    os.environ.pop("RLX_NUMBA_MATMUL_TIERS", None)
    return exe


def row(rlx, cuda, torch, m, n, k, wdt, copy_gbs, norm=False):
    F = torch.nn.functional
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5     # [N, K] like nn.Linear
    x = torch.randn(m, k, device="cuda", generator=gen)
    w_kn = w.t().contiguous().cpu().numpy()
    gam = (1 + 0.1 * torch.randn(k, device="cuda", generator=gen)) if norm else None
    xin = F.rms_norm(x, (k,), gam, eps=EPS) if norm else x      # what the product reads
    wbytes = n * k * (4 if wdt == "f32" else 2)
    out = dict(m=m, n=n, k=k, dtype=wdt, weight_bytes=wbytes, rms_norm=norm)
    stream = torch.cuda.Stream()
    ext = cuda.external_stream(stream.cuda_stream)
    if wdt == "f32":
        ref = (xin.double() @ w.double().t()).float()
    else:
        wb = w.to(torch.bfloat16)
        ref = (xin.double() @ wb.double().t()).float()
    for label, tiers in (("tier3", "3"), ("lt", "1" if wdt == "f32" else "0"), ("pick", None)):
        exe = rlx_exe(rlx, tiers, m, n, k, wdt, w_kn, "graph" if label == "pick" else "stream",
                      gam.cpu().numpy() if norm else None)
        (view,) = exe.run({"x": x}, outputs="view")
        got = torch.as_tensor(view, device="cuda")
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        prod = [s for s in exe.steps if "tier" in s.info][0]
        out[f"{label}_tier"] = prod.info["tier"]
        out[f"{label}_kernels"] = [s.kernel_name for s in exe.steps]
        out[f"{label}_err"] = err
        if label == "pick":
            out["pick_why"] = prod.info["why"]
            timed = [w for w in prod.info["why"] if "timed: tier 3" in w]   # (tier 3 us, other us)
            out["pick_timed"] = [float(v) for v in re.findall(r"([0-9.]+) us", timed[0])] if timed else []
        else:
            steps = exe.steps
            for s in steps:
                s.bind(ext, True)

            def enqueue(steps=steps):
                for s in steps:
                    s()
            out[f"{label}_us"] = graph_us(torch, enqueue, stream)
            exe.stream.synchronize()
        del exe, view, got
    nrm = (lambda: F.rms_norm(x, (k,), gam, eps=EPS)) if norm else (lambda: x)  # noqa: E731
    if wdt == "f32":
        tfn = lambda: F.linear(nrm(), w)  # noqa: E731
    else:
        tfn = lambda: nrm().bfloat16() @ wb.t()  # noqa: E731
    out["torch_us"] = graph_us(torch, tfn, stream)
    out["rlx_us"] = picked_us(out)
    for label in ("tier3", "lt", "torch"):
        out[f"{label}_copy_pct"] = 100 * wbytes / (out[f"{label}_us"] * 1e-6) / (copy_gbs * 1e9)
    del w, x
    free_device_memory(cuda, torch)
    return out


def picked_us(row: dict) -> float:
    """The time of the tier the default ladder picked (tier 3's or cuBLASLt's, as timed)."""
    return row["tier3_us"] if row["pick_tier"] == row["tier3_tier"] else row["lt_us"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", default="1,8")
    p.add_argument("--shapes", default=SHAPES)
    p.add_argument("--dtypes", default="f32,bf16")
    p.add_argument("--norm", action="store_true",
                   help="the product of rms_norm(x) (tier 3's norm prologue; torch: F.rms_norm "
                        "then the product)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "gemv.json")
    args = p.parse_args(argv)
    import rlx_numba as rlx
    if rlx.simulator_enabled():
        print("bench_gemv: no CUDA GPU here (simulator); this benchmark needs a GPU. Nothing measured.")
        return 0
    import torch
    from numba import cuda
    torch.backends.cuda.matmul.allow_tf32 = False
    gpu = torch.cuda.get_device_name()
    copy_gbs = copy_bandwidth(torch, 1 << 28)
    print(f"GPU: {gpu}   torch {torch.__version__}   copy bandwidth {copy_gbs:.0f} GB/s "
          f"(torch copy_ of 1 GiB, read + write)\n"
          f"device us a product (CUDA graph of {REPS}, windows >= {WINDOW_MS:g} ms); "
          f"copy % = weight bytes / time / copy bandwidth\n")
    hdr = (f"{'M':>2} {'N':>6} {'K':>5} {'W':<4} {'MB':>6} | {'tier3 us':>8} {'copy%':>5} | "
           f"{'lt us':>7} {'copy%':>5} | {'torch us':>8} {'copy%':>5} | pick (3 / lt us)       err3   plan")
    print(hdr + "\n" + "-" * len(hdr))
    results = []
    out = Results(args.out, gpu=gpu, copy_gbs=copy_gbs, reps=REPS, results=results)
    for m in (int(v) for v in args.m.split(",")):
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            for wdt in args.dtypes.split(","):
                try:
                    r = row(rlx, cuda, torch, m, n, k, wdt, copy_gbs, args.norm)
                except Exception as e:  # noqa: BLE001 - report the row, keep going
                    print(f"{m:>2} {n:>6} {k:>5} {wdt:<4} ERROR {type(e).__name__}: {e}", flush=True)
                    results.append(dict(m=m, n=n, k=k, dtype=wdt, error=str(e)))
                    out.save()
                    free_device_memory(cuda, torch)
                    continue
                results.append(r)
                out.save()
                plan = r["tier3_kernels"][-1].split(f"{m}x{n}x{k} ")[-1]
                print(f"{m:>2} {n:>6} {k:>5} {wdt:<4} {r['weight_bytes'] / 1e6:6.2f} | "
                      f"{r['tier3_us']:8.2f} {r['tier3_copy_pct']:5.0f} | {r['lt_us']:7.2f} "
                      f"{r['lt_copy_pct']:5.0f} | {r['torch_us']:8.2f} {r['torch_copy_pct']:5.0f} | "
                      f"{r['pick_tier']:>4} {'/'.join(f'{v:.1f}' for v in r['pick_timed']):<17} "
                      f"{r['tier3_err']:.0e}  {plan}", flush=True)
    out.done()
    return 0


if __name__ == "__main__":
    sys.exit(main())
