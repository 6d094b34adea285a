"""Geometry sweep of the tensor-core flash kernel (attention tier 1, kernels/attention_tc.py)
beside torch's scaled_dot_product_attention in the same dtype: each candidate TcAttnGeometry's
kernel launched directly (attention_tc.direct_launch: no graph) on torch's tensors, CUDA
events, best of 3; every result checked against torch's output (both round P to the io dtype
for P V: they differ by a few roundings). TFLOP/s counts 4 B Hq Sq Sk D, half of it when
causal (bench/bench_attention.py's convention); the bar is >= 0.4x torch forward at D128
S4096 causal. The candidates are attention_tc.SWEEP_GEOMETRIES, the shipped GPU_GEOMETRY
first (warps of 16 query rows, keys a tile (halved to fit 48 KB at large D), launch bounds'
blocks an SM). A CUDA error leaves the context unusable, so the sweep stops at the first one.

  python bench/sweep_attention_tc.py [--shapes 8x32x4096x128,8x32x4096x64] [--kinds bf16]
      [--causal both] [--iters 10] [--lse]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import time_rlx, time_torch  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="8x32x4096x128,8x32x4096x64",
                   help="BxHxSxD (Hkv = H), comma-separated; BxHqxHkvxSxD for GQA")
    p.add_argument("--kinds", default="bf16")
    p.add_argument("--causal", default="both", choices=("both", "yes", "no"))
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--lse", action="store_true", help="also write the LSE (the training forward)")
    args = p.parse_args(argv)
    import rlx_numba as rlx
    if rlx.simulator_enabled():
        print("sweep_attention_tc: needs a GPU. Nothing measured.")
        return 0
    import numpy as np
    import torch
    import torch.nn.functional as F
    from numba import cuda
    from numba.cuda.cudadrv.driver import CudaAPIError
    from rlx_numba.kernels import attention_tc as ATC
    print(f"GPU: {torch.cuda.get_device_name()}   torch {torch.__version__}")
    stream = cuda.default_stream()
    causals = {"both": (True, False), "yes": (True,), "no": (False,)}[args.causal]
    for shape in args.shapes.split(","):
        dims = [int(x) for x in shape.split("x")]
        b, hq, hkv, s, d = dims if len(dims) == 5 else (dims[0], dims[1], dims[1], dims[2], dims[3])
        for kind in args.kinds.split(","):
            tdt = torch.bfloat16 if kind == "bf16" else torch.float16
            tq = torch.randn(b, hq, s, d, device="cuda").to(tdt)
            tk, tv = (torch.randn(b, hkv, s, d, device="cuda").to(tdt) for _ in range(2))
            out = torch.empty_like(tq)
            lse = torch.empty(b, hq, s, device="cuda", dtype=torch.float32) if args.lse else None
            dq, dk, dv = (cuda.as_cuda_array(t.view(torch.int16)).view(np.uint16)
                          for t in (tq, tk, tv))
            do = cuda.as_cuda_array(out.view(torch.int16)).view(
                np.uint16 if kind == "bf16" else np.float16)
            dl = cuda.as_cuda_array(lse) if lse is not None else None
            for causal in causals:
                kw = dict(is_causal=causal, enable_gqa=hq != hkv)
                ref = F.scaled_dot_product_attention(tq, tk, tv, **kw).float()
                torch_ms = time_torch(torch, lambda: F.scaled_dot_product_attention(
                    tq, tk, tv, **kw), args.iters, 3, 3)
                flops = 4.0 * b * hq * s * s * d * (0.5 if causal else 1.0)
                print(f"\n{kind} B{b} Hq{hq} Hkv{hkv} S{s} D{d} {'causal' if causal else 'full'}"
                      f"{' +lse' if args.lse else ''}: torch {flops / torch_ms / 1e9:.0f} "
                      "TFLOP/s", flush=True)
                for geo in ATC.SWEEP_GEOMETRIES:
                    cand = (geo.warps, geo.keys(d), geo.min_blocks)
                    out.zero_()
                    torch.cuda.synchronize()
                    try:
                        launch = ATC.direct_launch(do, dq, dk, dv, kind, causal=causal, lse=dl,
                                                   geo=geo)
                        ms = time_rlx(cuda, lambda: launch(stream), stream, args.iters, 2, 3)
                        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                        ok = err <= (2e-2 if kind == "bf16" else 4e-3)
                        print(f"  warps {cand[0]} keys {cand[1]:3d} min_blocks {cand[2]}: "
                              f"{flops / ms / 1e9:6.0f} TFLOP/s {ms * 1e3:9.1f} us  "
                              f"{torch_ms / ms:5.3f}x torch  err {err:.1e} "
                              f"{'ok' if ok else 'WRONG'}", flush=True)
                    except CudaAPIError as e:
                        print(f"  {cand}: CUDA ERROR {e}; the context is unusable, stopping",
                              flush=True)
                        return 1
                    except Exception as e:  # noqa: BLE001 - report the candidate, keep going
                        print(f"  {cand}: ERROR {type(e).__name__}: {e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
