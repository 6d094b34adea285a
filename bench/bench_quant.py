"""Quantised products on the GPU beside torch in the same process (issue 18's bench).

GEMV rows (M = 1, decode): y = x @ W^T for a packed W [N, K] through ``g.dequant_matmul``
(kernels/quant.py's dequantise-in-registers GEMV), as device us a product and as GB/s and
% of copy bandwidth on the *packed* bytes (what the product has to read). Beside it, torch's
bf16 GEMV of the same shape (x.bfloat16() @ w_bf16.t(): torch has no q4 kernel; a bf16 weight
is the smallest one it runs), and our f32 GEMV (matmul tier 3) for scale.
GEMM rows (M = 512, prefill): dequantize to bf16 into the arena + matmul tier 0 (cuBLAS bf16
tensor cores, f32 accumulation, x cast to bf16), TFLOP/s beside torch bf16 mm and torch f32 mm
(TF32 off) of the same shape.
Grouped rows (mixture of experts): ``g.grouped_matmul`` of 8192 rows (4096 tokens x top-2)
routed over 64 experts, K = N = 1024, f32, beside a torch loop over the experts (index, mm,
index_copy: what a plain MoE layer does) and torch bf16 mm of the same FLOPs (one [8192, 1024]
@ [1024, 1024] product): TFLOP/s. The same in bf16 / f16 (x, w and the result; f32 sums): the
default lowering (beside cuBLAS: the CUDA-core grouped kernel reading halves) and ``tc`` (matmul
tier 5 offered, RLX_NUMBA_MATMUL_TIERS=5: the numba tensor-core grouped kernel), beside torch's
mm in that dtype of the same FLOPs (issue 31's bar: bf16 tc >= 0.6x).
Dequantised grouped row: ``g.dequant_grouped_matmul`` at decode (8 rows, each through its
own expert of 64, K 2048, N 1408, q4_0), GB/s on the packed bytes of the 8 experts touched,
beside a torch loop of 8 bf16 GEMVs.
Every time: a CUDA graph of 50 products replayed over >= 5 ms windows, best of 3 (bench_gemv's
``graph_us``). ``err``: max |ours - ref| / max |ref| with ref = x @ dequantize(W)^T in float64
(our dequantize: checked against gguf.quants.dequantize in tests/test_quant.py).

  python bench/bench_quant.py [--schemes q4_0,q4_k,q8_0,int4] [--out F]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gemv import graph_us  # noqa: E402
from common import Results, copy_bandwidth, free_device_memory, time_torch  # noqa: E402

GEMV_SHAPES = ((4096, 4096), (11008, 4096), (4096, 11008))    # (N, K)
GEMM_SHAPE = (512, 4096, 4096)                                 # (M, N, K)
GGUF = {"q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24),
        "q8_0": (32, 34), "q2_k": (256, 84), "q3_k": (256, 110), "q4_k": (256, 144),
        "q5_k": (256, 176), "q6_k": (256, 210)}
F16_AT = {"q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q8_0": (0,),
          "q2_k": (80, 82), "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}
GROUP = 128                                                    # int4 / int8 group size


def packed(rng, scheme, n, k):
    """(w bytes, scales or None, dtype) of a random valid packed [N, K] weight."""
    if scheme in GGUF:
        qk, bb = GGUF[scheme]
        raw = rng.integers(0, 256, (n, k // qk, bb), dtype=np.uint8)
        for at in F16_AT[scheme]:
            d = rng.uniform(-0.01, 0.01, (n, k // qk)).astype(np.float16)
            raw[:, :, at:at + 2] = d.view(np.uint8).reshape(n, k // qk, 2)
        return raw.reshape(n, -1), None, "u8"
    scales = rng.uniform(0.001, 0.01, (n, k // GROUP)).astype(np.float32)
    if scheme == "int8":
        return rng.integers(-128, 128, (n, k), dtype=np.int8), scales, "i8"
    return rng.integers(0, 256, (n, k // 2), dtype=np.uint8), scales, "u8"


def _compiled(rlx, build, w, scales, wdt):
    """An executable of ``build(g, w_param, scales_param)`` with the packed weight set."""
    g = rlx.Graph("quant")
    pw = g.param("w", w.shape, wdt)
    ps = g.param("s", scales.shape) if scales is not None else None
    g.set_outputs([build(g, pw, ps)])
    exe = rlx.compile(g)
    exe.set_param("w", w)
    if ps is not None:
        exe.set_param("s", scales)
    return exe


def rlx_product(rlx, m, scheme, w, scales, wdt, k):
    """(y = x @ W^T executable, W dequantised executable)."""
    gs = GROUP if scales is not None else None
    exe = _compiled(rlx, lambda g, pw, ps: g.dequant_matmul(g.input("x", (m, k)), pw, ps,
                                                            scheme=scheme, group_size=gs),
                    w, scales, wdt)
    deq = _compiled(rlx, lambda g, pw, ps: g.dequantize(pw, ps, scheme=scheme, group_size=gs),
                    w, scales, wdt)
    return exe, deq


def timed_steps(cuda, torch, exe, stream):
    ext = cuda.external_stream(stream.cuda_stream)
    for s in exe.steps:
        s.bind(ext, True)

    def enqueue(steps=exe.steps):
        for s in steps:
            s()
    us = graph_us(torch, enqueue, stream)
    exe.stream.synchronize()
    return us


def row(rlx, cuda, torch, m, n, k, scheme, copy_gbs):
    rng = np.random.default_rng(0)
    w, scales, wdt = packed(rng, scheme, n, k)
    exe, deq = rlx_product(rlx, m, scheme, w, scales, wdt, k)
    x = torch.randn(m, k, device="cuda")
    (view,) = exe.run({"x": x}, outputs="view")
    got = torch.as_tensor(view, device="cuda").clone()
    (wdv,) = deq.run({}, outputs="view")
    wd = torch.as_tensor(wdv, device="cuda").clone()
    ref = x.double() @ wd.double().t()
    err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
    stream = torch.cuda.Stream()
    us = timed_steps(cuda, torch, exe, stream)
    wb = wd.to(torch.bfloat16)
    bf16_us = graph_us(torch, lambda: x.bfloat16() @ wb.t(), stream)
    f32_us = graph_us(torch, lambda: torch.nn.functional.linear(x, wd), stream)
    out = dict(m=m, n=n, k=k, scheme=scheme, packed_bytes=int(w.nbytes), us=us, err=err,
               kernels=[s.kernel_name for s in exe.steps], torch_bf16_us=bf16_us,
               torch_f32_us=f32_us)
    out["gbs"] = w.nbytes / (us * 1e-6) / 1e9
    out["copy_pct"] = 100 * out["gbs"] / copy_gbs
    out["tflops"] = 2 * m * n * k / (us * 1e-6) / 1e12
    out["torch_bf16_tflops"] = 2 * m * n * k / (bf16_us * 1e-6) / 1e12
    out["torch_f32_tflops"] = 2 * m * n * k / (f32_us * 1e-6) / 1e12
    del exe, deq, view, wdv, got, wd, wb, x
    free_device_memory(cuda, torch)
    return out


GROUPED = (8192, 1024, 1024, 64)      # rows, K, N, experts


def grouped_row(rlx, cuda, torch):
    m, k, n, e = GROUPED
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=gen)
    w = torch.randn(e, k, n, device="cuda", generator=gen) / k ** 0.5
    ids = torch.randint(0, e, (m,), device="cuda", generator=gen, dtype=torch.int32)
    g = rlx.Graph("grouped")
    gx, gi = g.input("x", (m, k)), g.input("ids", (m,), "i32")
    g.set_outputs([g.grouped_matmul(gx, g.param("w", (e, k, n)), gi)])
    exe = rlx.compile(g)
    exe.set_param("w", w.cpu().numpy())
    (view,) = exe.run({"x": x, "ids": ids}, outputs="view")
    got = torch.as_tensor(view, device="cuda").clone()
    ref = torch.bmm(x.double()[:, None, :], w.double()[ids.long()])[:, 0]
    err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
    stream = torch.cuda.Stream()
    us = timed_steps(cuda, torch, exe, stream)
    idl = ids.long()

    def loop():
        out = torch.empty(m, n, device="cuda")
        for j in range(e):
            rows = (idl == j).nonzero(as_tuple=True)[0]
            out.index_copy_(0, rows, x.index_select(0, rows) @ w[j])
        return out
    loop_us = time_torch(torch, loop, 5, 2, 3) * 1e3     # (nonzero syncs: no CUDA graph)
    xb, wb = x.bfloat16(), w[0].bfloat16()
    bf16_us = graph_us(torch, lambda: xb @ wb, stream)
    fl = 2 * m * k * n
    return dict(m=m, k=k, n=n, experts=e, us=us, err=err, torch_loop_us=loop_us,
                torch_bf16_mm_us=bf16_us, tflops=fl / us / 1e6, torch_loop_tflops=fl / loop_us / 1e6,
                torch_bf16_tflops=fl / bf16_us / 1e6, kernels=[s.kernel_name for s in exe.steps])


def grouped_half_row(rlx, cuda, torch, d, tc):
    """grouped_matmul of GROUPED in ``d`` (bf16 / f16) end to end; ``tc``: tier 5 offered (the
    tensor-core grouped kernel), else the default lowering. Inputs go in as host arrays
    (torch's bf16 tensors have no __cuda_array_interface__); only the steps are timed."""
    import ml_dtypes
    m, k, n, e = GROUPED
    host = {"bf16": ml_dtypes.bfloat16, "f16": np.float16}[d]
    tdt = {"bf16": torch.bfloat16, "f16": torch.float16}[d]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((m, k)).astype(host)
    w = (rng.standard_normal((e, k, n)) / k ** 0.5).astype(host)
    ids = rng.integers(0, e, m).astype(np.int32)
    old = os.environ.pop("RLX_NUMBA_MATMUL_TIERS", None)
    if tc:
        os.environ["RLX_NUMBA_MATMUL_TIERS"] = "5"
    try:
        g = rlx.Graph(f"grouped_{d}")
        gx, gi = g.input("x", (m, k), d), g.input("ids", (m,), "i32")
        g.set_outputs([g.grouped_matmul(gx, g.param("w", (e, k, n), d), gi)])
        exe = rlx.compile(g)
    finally:
        os.environ.pop("RLX_NUMBA_MATMUL_TIERS", None)
        if old is not None:
            os.environ["RLX_NUMBA_MATMUL_TIERS"] = old
    exe.set_param("w", w)
    (got,) = exe.run({"x": x, "ids": ids})
    x64, ref = x.astype(np.float64), np.zeros((m, n))
    for j in range(e):      # float64 on the host, an expert at a time
        ref[ids == j] = x64[ids == j] @ w[j].astype(np.float64)
    err = float(np.abs(got.astype(np.float64) - ref).max() / np.abs(ref).max())
    stream = torch.cuda.Stream()
    us = timed_steps(cuda, torch, exe, stream)
    tx = torch.randn(m, k, device="cuda").to(tdt)
    tw = (torch.randn(k, n, device="cuda") / k ** 0.5).to(tdt)
    mm_us = graph_us(torch, lambda: tx @ tw, stream)
    fl = 2 * m * k * n
    return dict(m=m, k=k, n=n, experts=e, dtype=d, tc=tc, us=us, err=err,
                torch_mm_us=mm_us, tflops=fl / us / 1e6, torch_tflops=fl / mm_us / 1e6,
                ratio=mm_us / us, kernels=[s.kernel_name for s in exe.steps])


DGROUPED = (8, 64, 2048, 1408)       # decode rows (4 tokens x top-2), experts, K, N


def dequant_grouped_row(rlx, cuda, torch, copy_gbs, scheme="q4_0"):
    """g.dequant_grouped_matmul at decode: 8 rows, each through its own expert's packed
    [N, K] weight (64 experts, OLMoE-sized), beside a torch loop of bf16 GEMVs over the same
    experts (torch has no packed kernel). GB/s on the packed bytes of the experts touched."""
    m, e, k, n = DGROUPED
    rng = np.random.default_rng(0)
    w = np.stack([packed(rng, scheme, n, k)[0] for _ in range(e)])
    ids = rng.choice(e, m, replace=False).astype(np.int32)
    g = rlx.Graph("dgrouped")
    gx, gi = g.input("x", (m, k)), g.input("ids", (m,), "i32")
    g.set_outputs([g.dequant_grouped_matmul(gx, g.param("w", w.shape, "u8"), gi, scheme=scheme)])
    exe = rlx.compile(g)
    exe.set_param("w", w)
    x = torch.randn(m, k, device="cuda")
    idt = torch.as_tensor(ids, device="cuda")
    exe.run({"x": x, "ids": idt}, outputs="view")
    stream = torch.cuda.Stream()
    us = timed_steps(cuda, torch, exe, stream)
    wb = torch.randn(m, n, k, device="cuda").bfloat16()       # the touched experts, bf16
    xb = x.bfloat16()
    loop_us = graph_us(torch, lambda: [xb[i] @ wb[i].t() for i in range(m)], stream)
    touched = w[0].nbytes * m
    return dict(m=m, experts=e, k=k, n=n, scheme=scheme, us=us, torch_bf16_loop_us=loop_us,
                gbs=touched / (us * 1e-6) / 1e9, copy_pct=100 * touched / (us * 1e-6) / 1e9 / copy_gbs,
                kernels=[s.kernel_name for s in exe.steps])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schemes", default="q4_0,q4_k,q8_0,int4")
    p.add_argument("--gemm-schemes", default="q4_0,q4_k")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "quant.json")
    args = p.parse_args(argv)
    import rlx_numba as rlx
    if rlx.simulator_enabled():
        print("bench_quant: no CUDA GPU here (simulator); this benchmark needs a GPU. Nothing measured.")
        return 0
    import torch
    from numba import cuda
    torch.backends.cuda.matmul.allow_tf32 = False
    gpu = torch.cuda.get_device_name()
    copy_gbs = copy_bandwidth(torch, 1 << 28)
    print(f"GPU: {gpu}   torch {torch.__version__}   copy bandwidth {copy_gbs:.0f} GB/s "
          f"(torch copy_ of 1 GiB, read + write)\n")
    results = []
    out = Results(args.out, gpu=gpu, copy_gbs=copy_gbs, results=results)
    hdr = (f"{'scheme':<6} {'M':>4} {'N':>6} {'K':>6} {'MB':>6} | {'us':>8} {'GB/s':>6} "
           f"{'copy%':>5} {'TFLOP/s':>7} | {'torch bf16 us':>13} {'TFLOP/s':>7} | "
           f"{'torch f32 us':>12} |  err")
    print(hdr + "\n" + "-" * len(hdr))
    todo = [(1, n, k, s) for s in args.schemes.split(",") if s for n, k in GEMV_SHAPES]
    todo += [(GEMM_SHAPE[0], GEMM_SHAPE[1], GEMM_SHAPE[2], s) for s in args.gemm_schemes.split(",") if s]
    for m, n, k, scheme in todo:
        try:
            r = row(rlx, cuda, torch, m, n, k, scheme, copy_gbs)
        except Exception as e:  # noqa: BLE001 - report the row, keep going
            print(f"{scheme:<6} {m:>4} {n:>6} {k:>6} ERROR {type(e).__name__}: {e}", flush=True)
            results.append(dict(m=m, n=n, k=k, scheme=scheme, error=str(e)))
            out.save()
            free_device_memory(cuda, torch)
            continue
        results.append(r)
        out.save()
        print(f"{scheme:<6} {m:>4} {n:>6} {k:>6} {r['packed_bytes'] / 1e6:6.2f} | {r['us']:8.2f} "
              f"{r['gbs']:6.0f} {r['copy_pct']:5.0f} {r['tflops']:7.2f} | {r['torch_bf16_us']:13.2f} "
              f"{r['torch_bf16_tflops']:7.2f} | {r['torch_f32_us']:12.2f} | {r['err']:.0e}  "
              f"{' + '.join(r['kernels'])}", flush=True)
    def grouped_line(r):
        return (f"\ngrouped_matmul {r['m']} rows x {r['k']} x {r['n']}, {r['experts']} experts: "
                f"{r['us']:.1f} us {r['tflops']:.2f} TFLOP/s | torch loop {r['torch_loop_us']:.1f} "
                f"us {r['torch_loop_tflops']:.2f} | torch bf16 mm {r['torch_bf16_mm_us']:.1f} us "
                f"{r['torch_bf16_tflops']:.1f} | ours / bf16 mm "
                f"{r['torch_bf16_mm_us'] / r['us']:.3f}x | err {r['err']:.0e}")

    def grouped_half_line(r):
        return (f"grouped_matmul {r['dtype']}{' tc' if r['tc'] else ''} {r['m']} rows x {r['k']} "
                f"x {r['n']}, {r['experts']} experts: {r['us']:.1f} us {r['tflops']:.2f} TFLOP/s | "
                f"torch {r['dtype']} mm {r['torch_mm_us']:.1f} us {r['torch_tflops']:.1f} | ours / "
                f"mm {r['ratio']:.3f}x | err {r['err']:.0e} | {' + '.join(r['kernels'])}")

    def dgrouped_line(r):
        return (f"dequant_grouped_matmul {r['scheme']} {r['m']} rows x {r['k']} x {r['n']}, "
                f"{r['experts']} experts: {r['us']:.1f} us, {r['gbs']:.0f} GB/s of the touched "
                f"experts ({r['copy_pct']:.0f}% of copy) | torch bf16 GEMV loop "
                f"{r['torch_bf16_loop_us']:.1f} us")

    half_rows = tuple((f"grouped_matmul {d}{' tc' if tc else ''}",
                       lambda d=d, tc=tc: grouped_half_row(rlx, cuda, torch, d, tc), grouped_half_line)
                      for d, tc in (("bf16", False), ("bf16", True), ("f16", True)))
    for name, measure, line in (("grouped_matmul", lambda: grouped_row(rlx, cuda, torch), grouped_line),
                                *half_rows,
                                ("dequant_grouped_matmul",
                                 lambda: dequant_grouped_row(rlx, cuda, torch, copy_gbs), dgrouped_line)):
        try:
            r = measure()
            results.append(r)
            print(line(r), flush=True)
        except Exception as e:  # noqa: BLE001 - report the row, keep going
            print(f"{name} ERROR {type(e).__name__}: {e}")
            results.append(dict(row=name, error=str(e)))
        out.save()
    out.done()
    return 0


if __name__ == "__main__":
    sys.exit(main())
