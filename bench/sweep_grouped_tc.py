"""Geometry sweep of the grouped tensor-core product (grouped_matmul in f16 / bf16 where
matmul tier 5 is offered: kernels/matmul_tc.py's grouped mode) at issue 31's MoE shape, 8192
rows routed uniformly at random over 64 experts, K = N = 1024, beside torch's mm in the same
dtype of the same FLOPs (one [8192, 1024] @ [1024, 1024]; issue 31's bar: >= 0.6x in bf16).
Each candidate TcGeometry's routing + product launched directly (matmul_tc.
grouped_direct_launch, no graph), CUDA events, best of 3, every result checked against torch
(per expert, f32 sums on both sides). The candidates: matmul_tc.SWEEP_GEOMETRIES (the shipped
GPU_GEOMETRY first) and two 64-row tiles (an expert's ~128 +- 11 rows pad to fewer wasted
rows in tiles of 64). The fastest correct one becomes the "grouped_tc" family's GPU geometry
(kernels/matmul_tc.py: register_geometry("grouped_tc", ...)). A CUDA error leaves the context
unusable: the sweep stops there.

  python bench/sweep_grouped_tc.py [--kinds bf16,f16] [--trans-w 0,1] [--iters 20]
      [--shape 8192x1024x1024x64]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import sweep_candidate, time_torch  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", default="bf16,f16")
    p.add_argument("--trans-w", default="0,1", help="w [E, K, N] (0) or [E, N, K] (1)")
    p.add_argument("--shape", default="8192x1024x1024x64", help="rows x K x N x experts")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    import rlx_numba as rlx
    if rlx.simulator_enabled():
        print("sweep_grouped_tc: needs a GPU. Nothing measured.")
        return 0
    import numpy as np
    import torch
    from numba import cuda
    from rlx_numba.kernels import matmul_tc as mtc
    m, k, n, e = (int(v) for v in args.shape.split("x"))
    geos = mtc.SWEEP_GEOMETRIES + tuple(mtc.TcGeometry(*g) for g in (
        (64, 128, 16, 32, 64, 4, 2), (64, 128, 32, 32, 64, 3, 2)))
    print(f"GPU: {torch.cuda.get_device_name()}   torch {torch.__version__}")
    stream = cuda.default_stream()
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids_t = torch.randint(0, e, (m,), device="cuda", generator=gen, dtype=torch.int32)
    ids = cuda.as_cuda_array(ids_t)
    counts = torch.bincount(ids_t, minlength=e)
    print(f"{m} rows over {e} experts: {int(counts.min())} .. {int(counts.max())} rows an expert")
    flops = 2.0 * m * n * k
    for kind in args.kinds.split(","):
        tdt = torch.bfloat16 if kind == "bf16" else torch.float16
        x = torch.randn(m, k, device="cuda", generator=gen).to(tdt)
        mm_w = (torch.randn(k, n, device="cuda", generator=gen) / k ** 0.5).to(tdt)
        torch_ms = time_torch(torch, lambda: x @ mm_w, args.iters, 3, 3)
        print(f"\n{kind}: torch mm {m}x{k}x{n} {flops / torch_ms / 1e9:.0f} TFLOP/s "
              f"({torch_ms * 1e3:.1f} us)")
        for tw in (bool(int(v)) for v in args.trans_w.split(",")):
            w = (torch.randn(e, n, k, device="cuda", generator=gen) / k ** 0.5).to(tdt)
            w = w if tw else w.transpose(1, 2).contiguous()
            we = w.transpose(1, 2) if tw else w                  # [E, K, N] views
            ref = torch.empty(m, n, device="cuda")
            for j in range(e):
                r = (ids_t == j).nonzero(as_tuple=True)[0]
                ref[r] = (x[r].float() @ we[j].float())
            out = torch.empty(m, n, device="cuda", dtype=tdt)
            xa = cuda.as_cuda_array(x.view(torch.int16)).view(np.uint16)
            wa = cuda.as_cuda_array(w.view(torch.int16)).view(np.uint16)
            oa = cuda.as_cuda_array(out.view(torch.int16)).view(
                np.uint16 if kind == "bf16" else np.float16)
            for geo in geos:
                if not sweep_candidate(
                        torch, cuda, "w^T" if tw else "w  ", geo,
                        lambda: mtc.grouped_direct_launch(oa, xa, wa, ids, e, kind, tw, geo),
                        stream, args.iters, out, ref, kind, flops, torch_ms):
                    return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
