"""Geometry sweep of the tensor-core GEMM (matmul tier 5, kernels/matmul_tc.py) beside
torch.matmul in the same dtype: each candidate TcGeometry's kernel launched directly (no graph)
on device arrays (matmul_tc.direct_launch: the flat views the kernel indexes; the GPU tests
launch the same way), CUDA events, best of 3; every result checked against torch's (both sum
in f32 and round once: they differ by about an output rounding). The candidates are
matmul_tc.SWEEP_GEOMETRIES, the shipped GPU_GEOMETRY first. Pick the fastest correct geometry
for GPU_GEOMETRY (the 48 KB static shared-memory limit bounds tiles x stages). A CUDA error
(a fault) leaves the context unusable, so the sweep stops at the first one.

  python bench/sweep_matmul_tc.py [--shapes 4096x4096x4096,8192x1024x4096] [--kinds bf16,f16]
      [--layouts NN,NT] [--iters 20]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import sweep_candidate, time_torch  # noqa: E402

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
                # the stored operands, kept alive while their device views are used
                sa = (ta_.t() if tra else ta_).contiguous()
                sb = (tb_.t() if trb else tb_).contiguous()
                out = torch.empty(m, n, device="cuda", dtype=tdt)
                a = cuda.as_cuda_array(sa.view(torch.int16)).view(np.uint16)
                b = cuda.as_cuda_array(sb.view(torch.int16)).view(np.uint16)
                c = cuda.as_cuda_array(out.view(torch.int16)).view(
                    np.uint16 if kind == "bf16" else np.float16)
                for geo in mtc.SWEEP_GEOMETRIES:
                    if not sweep_candidate(
                            torch, cuda, lay, geo,
                            lambda: mtc.direct_launch(c, a, b, m, n, k, kind, tra, trb, geo),
                            stream, args.iters, out, ref, kind, flops, torch_ms,
                            f"  smem {geo.shared_bytes()} B"):
                        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
