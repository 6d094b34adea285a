"""Matmul TFLOP/s of each tier of the ladder beside torch, same process, CUDA events.

Shapes (M x K x N, or batch x (M x K x N)): 4096^3, 8192^3, 1x4096x4096 (decode),
32x4096x11008, 8192x1024x4096 (a BERT-large FFN up-projection, the linear-with-bias-gelu_tanh
shape), 64x(512x64x512). Rows, each against its torch counterpart:
  tier2 fp32  - cublasSgemm(/strided batched)      vs torch.matmul, allow_tf32 off  (bar 0.95)
  tier2 tf32  - the same with TF32 allowed           vs torch.matmul, allow_tf32 on   (bar 0.95)
  tier1 bias+gelu_tanh - one cuBLASLt call            vs torch mm + bias + gelu(tanh) (bar 1.00)
  tier0 bf16  - bf16 weight, activations cast, GemmEx vs torch bf16 matmul          (bar 0.90 on
                the weight-bound shapes 1x4096x4096 and 32x4096x11008; others reported)
  tier4 numba - the register-tiled numba SGEMM        vs torch fp32 (cuBLAS)        (bar 0.25 at 4096^3)
  f64         - f64 operands: cublasDgemm (tier 2)    vs torch float64 matmul        (bar 0.95)
  bf16 / f16  - a graph in that dtype (x, w and the result; f32 sums), the default ladder
                (cuBLASLt; GemmStridedBatchedEx when batched) vs torch.matmul on CUDA tensors of
                the same dtype                                                    (bar 0.90 at 4096^3)
  tc_bf16 / tc_f16 - the same graph forced on tier 5, the numba tensor-core GEMM
                (RLX_NUMBA_MATMUL_TIERS=5) vs torch.matmul in that dtype          (bar 0.50 at 4096^3)
  bf16gelu / f16gelu - linear(x, w, bias, "gelu_tanh") in that dtype, one cuBLASLt call with
                the bias and GELU in its epilogue vs torch gelu(addmm(bias, x, w), tanh) in the
                same dtype                                                 (bar 0.90 at 8192x1024x4096)
  fp8         - scaled_matmul, e4m3 x e4m3, per-tensor scales, bf16 out, b given as the transpose
                of an [N, K] input (cuBLASLt fp8, one call) vs torch._scaled_mm on the same
                operands (b.t() column-major, as torch requires)               (bar 0.90 at 8192^3)
  fp8row      - the same with rowwise scales ([M, 1], [1, N]) vs torch._scaled_mm rowwise: one Lt
                call with outer-vector scales where cuBLAS has them (the kernels column says)
  fp8row0     - fp8row with RLX_NUMBA_LT_OUTER_VEC=0: Lt's f32 sums + the scale epilogue kernel
                (the two rowwise paths side by side; reported, no bar)
  int8        - qmatmul, i8 x i8 -> i32 (cuBLASLt int8, b given as a transpose) vs torch._int_mm;
                its bar is against our own bf16 product of the same shape (the default ladder,
                timed in the same run: column vs_bf16)                        (bar 1.50 at 8192^3)
Only the kernels are timed (the executable's steps back to back; inputs already on the device).

  python bench/bench_matmul.py [--shapes 4096x4096x4096,...] [--iters 10]
      [--tiers 2,2tf32,1,0,4,f64,bf16,f16,bf16gelu,f16gelu,tc_bf16,tc_f16,fp8,fp8row,fp8row0,int8]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Results, free_device_memory, time_rlx, time_torch  # noqa: E402

SHAPES = "4096x4096x4096,8192x8192x8192,1x4096x4096,32x4096x11008,8192x1024x4096,64:512x64x512"
TIERS = "2,2tf32,1,0,4,f64,bf16,f16,bf16gelu,f16gelu,tc_bf16,tc_f16,fp8,fp8row,fp8row0,int8"
LOWP_ROWS = ("fp8", "fp8row", "fp8row0", "int8")
LOWP_BAR = {"fp8": (0.9, (1, 8192, 8192, 8192)), "int8": (1.5, (1, 8192, 8192, 8192))}
WEIGHT_BOUND = {(1, 1, 4096, 4096), (1, 32, 4096, 11008)}
# half rows: (graph dtype, torch dtype name, epilogue activation) and where their bar applies
HALF_ROWS = {"bf16": ("bf16", "bfloat16", None), "f16": ("f16", "float16", None),
             "bf16gelu": ("bf16", "bfloat16", "gelu_tanh"), "f16gelu": ("f16", "float16", "gelu_tanh"),
             "tc_bf16": ("bf16", "bfloat16", None), "tc_f16": ("f16", "float16", None)}
HALF_BAR = {None: (1, 4096, 4096, 4096), "gelu_tanh": (1, 8192, 1024, 4096)}


def parse(shape):
    batch, _, mkn = shape.rpartition(":")
    m, k, n = (int(v) for v in mkn.split("x"))
    return int(batch or 1), m, k, n


def timed_row(tier, batch, m, k, n, exe, tfn, err, cuda, torch, iters) -> dict:
    """One row's timings: our steps launched back to back (device ms and the host time to
    enqueue them: launch-bound when ~ the device ms) against torch's ``tfn``."""
    steps = exe.steps

    def launch():
        for s in steps:
            s()
    n_iter = max(2, iters if m * n * k * batch < 2**36 else iters // 2)
    rlx_ms = time_rlx(cuda, launch, exe.stream, n_iter, 2, 3)
    exe.stream.synchronize()
    t0 = time.perf_counter()
    for _ in range(n_iter):
        launch()
    host_ms = (time.perf_counter() - t0) * 1e3 / n_iter
    exe.stream.synchronize()
    torch_ms = time_torch(torch, tfn, n_iter, 2, 3)
    flops = 2.0 * batch * m * n * k
    return dict(tier=tier, shape=f"{batch}:{m}x{k}x{n}", rlx_ms=rlx_ms,
                rlx_tflops=flops / rlx_ms / 1e9, torch_tflops=flops / torch_ms / 1e9,
                ratio=torch_ms / rlx_ms, rel_err=err, host_ms=host_ms,
                kernels=[s.kernel_name for s in steps],
                tiers=[s.info.get("tier") for s in steps if "tier" in s.info])


def bench_half(tier, batch, m, k, n, rlx, cuda, torch, iters):
    """A row of HALF_ROWS: the product in f16 / bf16 end to end (no tier restriction: the
    ladder's own choice; the tc_ rows: tier 5 forced) against torch in the same dtype; inputs go in as host arrays of the
    half dtype (torch's bf16 tensors have no __cuda_array_interface__), only kernels timed."""
    import ml_dtypes
    import numpy as np
    F = torch.nn.functional
    d, tname, act = HALF_ROWS[tier]
    tdt = getattr(torch, tname)
    torch.backends.cuda.matmul.allow_tf32 = False
    tc = tier.startswith("tc_")
    if tc:
        os.environ["RLX_NUMBA_MATMUL_TIERS"] = "5"
    else:
        os.environ.pop("RLX_NUMBA_MATMUL_TIERS", None)
    g = rlx.Graph(f"mm_{tier}")
    ashape = (batch, m, k) if batch > 1 else (m, k)
    wshape = (batch, k, n) if batch > 1 else (k, n)
    x = g.input("x", ashape, d)
    if batch > 1:
        g.set_outputs([g.matmul(x, g.input("w", wshape, d))])
    else:
        w, b = g.param("w", wshape, d), g.param("b", (n,), d)
        g.set_outputs([g.linear(x, w, b if act else None, activation=act)])
    exe = rlx.compile(g)
    tx = torch.randn(*ashape, device="cuda").to(tdt)
    tw = (torch.randn(*wshape, device="cuda") / k ** 0.5).to(tdt)
    tb = torch.randn(n, device="cuda").to(tdt)
    host = {"bf16": ml_dtypes.bfloat16, "f16": np.float16}[d]
    as_host = lambda t: t.float().cpu().numpy().astype(host)  # noqa: E731
    inputs = {"x": as_host(tx)}
    if batch > 1:
        inputs["w"] = as_host(tw)
    else:
        exe.set_param("w", as_host(tw))
        exe.set_param("b", as_host(tb))
    (got,) = exe.run(inputs)
    if act:
        tfn = lambda: F.gelu(torch.addmm(tb, tx, tw), approximate="tanh")  # noqa: E731
    else:
        tfn = lambda: torch.matmul(tx, tw)  # noqa: E731
    ref = tfn().float().cpu().numpy().astype(np.float64)
    err = float(np.abs(got.astype(np.float64) - ref).max() / max(np.abs(ref).max(), 1e-6))
    res = timed_row(tier, batch, m, k, n, exe, tfn, err, cuda, torch, iters)
    applies = (batch, m, k, n) == HALF_BAR[act]
    bar = 0.5 if tc else 0.9
    res["bar"] = bar if applies else None
    # both sides sum in f32 and round once; they differ by about an output rounding (bf16 2^-8)
    tol = 2e-2 if d == "bf16" else 4e-3
    res["pass"] = (res["ratio"] >= bar if applies else True) and err <= tol
    del exe, tx, tw, tb
    free_device_memory(cuda, torch)
    return res


def bench_lowp(tier, batch, m, k, n, rlx, cuda, torch, iters):
    """A row of LOWP_ROWS (module docstring): scaled_matmul against torch._scaled_mm, or
    qmatmul against torch._int_mm and our bf16 product. Inputs made by torch on the device and
    handed over as host arrays (torch's fp8 tensors have no __cuda_array_interface__)."""
    import ml_dtypes
    import numpy as np
    os.environ.pop("RLX_NUMBA_MATMUL_TIERS", None)
    os.environ.pop("RLX_NUMBA_LOWP_TIERS", None)
    os.environ["RLX_NUMBA_LT_OUTER_VEC"] = "0" if tier == "fp8row0" else "1"
    g = rlx.Graph(f"mm_{tier}")
    if tier == "int8":
        ta = torch.randint(-128, 128, (m, k), device="cuda", dtype=torch.int8)
        tbt = torch.randint(-128, 128, (n, k), device="cuda", dtype=torch.int8)
        tb = tbt.t()
        g.set_outputs([g.qmatmul(g.input("a", (m, k), "i8"),
                                 g.transpose(g.input("bt", (n, k), "i8")))])
        inputs = {"a": ta.cpu().numpy(), "bt": tbt.cpu().numpy()}
        tfn = lambda: torch._int_mm(ta, tb)  # noqa: E731
    else:
        e4 = torch.float8_e4m3fn
        ta = (torch.randn(m, k, device="cuda") * 4).to(e4)
        tbt = (torch.randn(n, k, device="cuda") * 4).to(e4)
        tb = tbt.t()                               # column-major [K, N], as torch requires
        row = tier.startswith("fp8row")
        tsa = (torch.rand(m, 1, device="cuda") + 0.5) if row else torch.tensor(0.8, device="cuda")
        tsb = (torch.rand(1, n, device="cuda") / k) if row else torch.tensor(1.0 / k, device="cuda")
        g.set_outputs([g.scaled_matmul(
            g.input("a", (m, k), "f8e4m3"), g.transpose(g.input("bt", (n, k), "f8e4m3")),
            g.input("sa", tuple(tsa.shape), "f32"), g.input("sb", tuple(tsb.shape), "f32"),
            out_dtype="bf16")])
        f8 = lambda t: t.view(torch.uint8).cpu().numpy().view(ml_dtypes.float8_e4m3fn)  # noqa: E731
        inputs = {"a": f8(ta), "bt": f8(tbt), "sa": tsa.cpu().numpy(), "sb": tsb.cpu().numpy()}
        tfn = lambda: torch._scaled_mm(ta, tb, tsa, tsb, out_dtype=torch.bfloat16)  # noqa: E731
    exe = rlx.compile(g)
    (got,) = exe.run(inputs)
    ref = tfn().float().cpu().numpy().astype(np.float64)
    err = float(np.abs(got.astype(np.float64) - ref).max() / max(np.abs(ref).max(), 1e-6))
    res = timed_row(tier, batch, m, k, n, exe, tfn, err, cuda, torch, iters)
    bar, at = LOWP_BAR.get(tier, (None, None))
    applies = (batch, m, k, n) == at
    if tier == "int8":       # against our bf16 product of the same shape (default ladder)
        gb = rlx.Graph("mm_bf16_base")
        gb.set_outputs([gb.matmul(gb.input("x", (m, k), "bf16"), gb.input("w", (k, n), "bf16"))])
        eb = rlx.compile(gb)
        eb.run({"x": np.ones((m, k), ml_dtypes.bfloat16), "w": np.ones((k, n), ml_dtypes.bfloat16)})
        base = eb.steps

        def launch_bf16():
            for s in base:
                s()
        n_iter = max(2, iters if m * n * k < 2**36 else iters // 2)
        bf16_ms = time_rlx(cuda, launch_bf16, eb.stream, n_iter, 2, 3)
        res["vs_bf16"] = bf16_ms / res["rlx_ms"]
        res["bf16_kernels"] = [s.kernel_name for s in base]
        ok_speed = res["vs_bf16"] >= bar if applies else True
        tol = 0.0                                   # integer products: exact
        del eb
    else:
        ok_speed = res["ratio"] >= bar if applies else True
        tol = 2e-2                                  # one bf16 rounding apart at most, about
    # (int8: the bar is on vs_bf16, not on ratio, which is against torch._int_mm; said so)
    res["bar"] = (f"{bar} vs bf16" if tier == "int8" else bar) if applies else None
    res["pass"] = ok_speed and err <= tol
    del exe, ta, tb, tbt
    free_device_memory(cuda, torch)
    return res


def bench(tier, batch, m, k, n, rlx, cuda, torch, iters):
    if tier in LOWP_ROWS:
        return bench_lowp(tier, batch, m, k, n, rlx, cuda, torch, iters)
    if tier in HALF_ROWS:
        return bench_half(tier, batch, m, k, n, rlx, cuda, torch, iters)
    F = torch.nn.functional
    tf32 = tier == "2tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    rlx.cublas.allow_tf32 = tf32
    os.environ["RLX_NUMBA_MATMUL_TIERS"] = {"2tf32": "2", "f64": "2"}.get(tier, tier)
    dtype, tdt = ("f64", torch.float64) if tier == "f64" else ("f32", torch.float32)
    g = rlx.Graph(f"mm_{tier}")
    ashape = (batch, m, k) if batch > 1 else (m, k)
    x = g.input("x", ashape, dtype)
    if batch > 1:
        w = g.input("w", (batch, k, n), dtype)
        g.set_outputs([g.matmul(x, w)])
    else:
        w, b = g.param("w", (k, n), dtype), g.param("b", (n,), dtype)
        if tier == "1":
            g.set_outputs([g.linear(x, w, b, activation="gelu_tanh")])
        else:
            g.set_outputs([g.linear(x, w)])
    exe = rlx.compile(g)
    tx = torch.randn(*ashape, device="cuda", dtype=tdt)
    tw = torch.randn(*((batch, k, n) if batch > 1 else (k, n)), device="cuda", dtype=tdt) / k ** 0.5
    tb = torch.randn(n, device="cuda", dtype=tdt)
    inputs = {"x": tx}
    if batch > 1:
        inputs["w"] = tw
    else:
        exe.set_param("b", tb)
        if tier == "0":
            exe.set_param_half("w", tw.cpu().numpy(), "bf16")
        else:
            exe.set_param("w", tw)
    torch.cuda.synchronize()
    (view,) = exe.run(inputs, outputs="view")
    got = torch.as_tensor(view, device="cuda")
    if tier == "1":
        tfn = lambda: F.gelu(torch.matmul(tx, tw) + tb, approximate="tanh")  # noqa: E731
    elif tier == "0":
        xb, wb = tx.to(torch.bfloat16), tw.to(torch.bfloat16)
        tfn = lambda: torch.matmul(xb, wb)  # noqa: E731
    else:
        tfn = lambda: torch.matmul(tx, tw)  # noqa: E731
    ref = tfn() if tier == "f64" else tfn().float()
    err = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
    res = timed_row(tier, batch, m, k, n, exe, tfn, err, cuda, torch, iters)
    bar = {"2": 0.95, "2tf32": 0.95, "1": 1.0, "0": 0.9, "4": 0.25, "f64": 0.95}[tier]
    applies = (tier not in ("0", "4")) or (tier == "0" and (batch, m, k, n) in WEIGHT_BOUND) \
        or (tier == "4" and (batch, m, k, n) == (1, 4096, 4096, 4096))
    res["bar"] = bar if applies else None
    tol = 3e-2 if tier in ("0", "2tf32", "1") else 1e-12 if tier == "f64" else 1e-4
    res["pass"] = (res["ratio"] >= bar if applies else True) and err <= tol
    del exe, view, got, tx, tw, tb
    free_device_memory(cuda, torch)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=SHAPES)
    p.add_argument("--tiers", default=TIERS)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "matmul.json")
    args = p.parse_args(argv)
    import rlx_numba as rlx
    import rlx_numba.cublas  # noqa: F401 - rlx.cublas.allow_tf32
    if rlx.simulator_enabled():
        print("bench_matmul: no CUDA GPU here (simulator); this benchmark needs a GPU. Nothing measured.")
        return 0
    import torch
    from numba import cuda
    gpu = torch.cuda.get_device_name()
    print(f"GPU: {gpu}   torch {torch.__version__}   cuBLAS {rlx.cublas.info().get('cublas')}\n")
    hdr = (f"{'tier':<8} {'shape':<18} {'rlx TFLOP/s':>11} {'torch TFLOP/s':>13} {'ratio':>6} "
           f"{'bar':>5}  ok   rel.err  steps")
    print(hdr + "\n" + "-" * len(hdr))
    results = []
    out = Results(args.out, gpu=gpu, results=results)
    for shape in args.shapes.split(","):
        batch, m, k, n = parse(shape)
        for tier in args.tiers.split(","):
            if tier == "4" and m * n * k * batch > 2**37:
                continue                      # 8192^3 on the numba kernel: not interesting
            if batch > 1 and tier in ("0", "1", "bf16gelu", "f16gelu", *LOWP_ROWS):
                continue                      # those tiers are for weights (2-D params)
            if tier == "int8" and m <= 16:
                continue                      # torch._int_mm takes only M > 16
            if tier.endswith("gelu") and (batch, m, k, n) != HALF_BAR["gelu_tanh"]:
                continue                      # the epilogue rows: their one shape
            try:
                r = bench(tier, batch, m, k, n, rlx, cuda, torch, args.iters)
            except Exception as e:  # noqa: BLE001 - report the row, keep going
                print(f"{tier:<8} {shape:<18} ERROR {type(e).__name__}: {e}")
                results.append(dict(tier=tier, shape=shape, error=str(e), **{"pass": False}))
                out.save()
                free_device_memory(cuda, torch)
                continue
            results.append(r)
            out.save()
            bar = (f"{r['bar']:.2f}" if isinstance(r["bar"], float) else str(r["bar"])) \
                if r["bar"] else "  -  "
            print(f"{tier:<8} {shape:<18} {r['rlx_tflops']:11.1f} {r['torch_tflops']:13.1f} "
                  f"{r['ratio']:6.2f} {bar:>5}  {'PASS' if r['pass'] else 'FAIL'} {r['rel_err']:.1e}  "
                  f"{' | '.join(r['kernels'])}  [{1e3 * r['rlx_ms']:.0f} us a run, host enqueue "
                  f"{1e3 * r['host_ms']:.0f} us]"
                  + (f"  {r['vs_bf16']:.2f}x our bf16 ({' | '.join(r['bf16_kernels'])})"
                     if "vs_bf16" in r else ""), flush=True)
    os.environ.pop("RLX_NUMBA_MATMUL_TIERS", None)
    os.environ.pop("RLX_NUMBA_LT_OUTER_VEC", None)
    out.done()
    fails = sum(not r["pass"] for r in results)
    print(f"{len(results) - fails}/{len(results)} rows pass")
    return 0


if __name__ == "__main__":
    sys.exit(main())
