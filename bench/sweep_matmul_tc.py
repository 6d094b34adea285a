"""Geometry sweep of the tensor-core GEMM (matmul tier 5, kernels/matmul_tc.py) beside
torch.matmul in the same dtype: each candidate TcGeometry's kernel launched directly (no graph)
on device arrays, CUDA events, best of 3; every result checked against torch's (both sum in
f32 and round once: they differ by about an output rounding). Pick the fastest correct
geometry for GPU_GEOMETRY (the 48 KB static shared-memory limit bounds tiles x stages).

  python bench/sweep_matmul_tc.py [--shapes 4096x4096x4096,8192x1024x4096] [--kinds bf16,f16]
      [--layouts NN,NT] [--iters 20]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import time_rlx, time_torch  # noqa: E402

# (bm, bn, bk, wm, wn, stages, min_blocks): the shipped one first
CANDIDATES = [(128, 128, 32, 64, 32, 2, 1), (128, 128, 32, 64, 32, 2, 2),
              (128, 128, 16, 64, 32, 4, 1), (128, 128, 16, 64, 32, 4, 2),
              (128, 128, 16, 64, 32, 3, 2), (128, 64, 32, 64, 32, 2, 2),
              (128, 64, 32, 32, 32, 3, 2), (64, 128, 32, 32, 64, 2, 2)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="4096x4096x4096,8192x1024x4096")
    p.add_argument("--kinds", default="bf16,f16")
    p.add_argument("--layouts", default="NN,NT",
                   help="A, B stored N (as is) or T ([k, m] / [n, k])")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    import rlx_numba as rlx
    if rlx.simulator_enabled():
        print("sweep_matmul_tc: needs a GPU. Nothing measured.")
        return 0
    import numpy as np
    import torch
    from numba import cuda
    from rlx_numba.kernels import matmul_tc as mtc
    print(f"GPU: {torch.cuda.get_device_name()}   torch {torch.__version__}")
    stream = cuda.default_stream()
    for shape in args.shapes.split(","):
        m, k, n = (int(v) for v in shape.split("x"))
        for kind in args.kinds.split(","):
            tdt = torch.bfloat16 if kind == "bf16" else torch.float16
            ta_ = torch.randn(m, k, device="cuda").to(tdt)
            tb_ = (torch.randn(k, n, device="cuda") / k ** 0.5).to(tdt)
            ref = torch.matmul(ta_, tb_).float()
            torch_ms = time_torch(torch, lambda: torch.matmul(ta_, tb_), args.iters, 3, 3)
            flops = 2.0 * m * n * k
            print(f"\n{kind} {m}x{k}x{n}: torch {flops / torch_ms / 1e9:.0f} TFLOP/s")
            for lay in args.layouts.split(","):
                tra, trb = lay[0] == "T", lay[1] == "T"
                def bits(t):
                    return cuda.as_cuda_array(t.contiguous().view(torch.int16)).view(np.uint16)
                a = bits(ta_.t() if tra else ta_)
                b = bits(tb_.t() if trb else tb_)
                out = torch.empty(m, n, device="cuda", dtype=tdt)
                c = cuda.as_cuda_array(out.view(torch.int16)).view(
                    np.uint16 if kind == "bf16" else np.float16)
                dummy = cuda.device_array(1, c.dtype)
                z = cuda.to_device(np.zeros(1, np.int64))
                vec = mtc.vec_ok(tra, trb, m, n, k, [0], [0],
                                 (a.device_ctypes_pointer.value, b.device_ctypes_pointer.value))[0]
                for cand in CANDIDATES:
                    geo = mtc.TcGeometry(*cand)
                    try:
                        kern = mtc.tc_gemm_kernel(tra, trb, kind, vec, geo=geo)
                        grid, block = mtc.tc_launch(m, n, 1, geo)
                        args_ = (c, a, b, dummy, dummy, np.int64(m), np.int64(n), np.int64(k), z, z,
                                 np.int64(1))
                        launch = lambda: kern[grid, block, stream](*args_)  # noqa: E731
                        ms = time_rlx(cuda, launch, stream, args.iters, 2, 3)
                        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                        ok = err <= (2e-2 if kind == "bf16" else 4e-3)
                        print(f"  {lay} {cand}: {flops / ms / 1e9:6.0f} TFLOP/s  "
                              f"{torch_ms / ms:5.2f}x torch  err {err:.1e} "
                              f"{'ok' if ok else 'WRONG'}"
                              f"  smem {geo.shared_bytes()} B", flush=True)
                    except Exception as e:  # noqa: BLE001 - report the candidate, keep going
                        print(f"  {lay} {cand}: ERROR {type(e).__name__}: {e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
