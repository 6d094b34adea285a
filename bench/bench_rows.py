"""Row-op bandwidth: rlx_numba's softmax, norms, reductions and transpose beside PyTorch.

For f32 rows x cols in 32768x4096, 4096x32768, 262144x256, 1024x131072 (``--shapes``):
softmax, log_softmax, layer_norm, rms_norm, fused residual + rms_norm (also writing the sum),
sum over the last axis, sum over the first axis, transpose of the last two axes. Only the
kernels are timed (the executable's steps launched back to back between CUDA events; inputs
already in the arena); torch's equivalent with torch.cuda.Event in the same process.
GB/s = the bytes the op must move (each input read once, each output written once) / time, for
both sides, so a ratio is a ratio of times. The bar: rlx >= 0.90 x torch on every row.

  python bench/bench_rows.py [--shapes 32768x4096,...] [--ops softmax,...] [--iters 20]
                             [--out bench/results/rows.json]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Results, copy_bandwidth, dist_version, free_device_memory, gbps, time_rlx, time_torch  # noqa: E402

BAR = 0.90
SHAPES = "32768x4096,4096x32768,262144x256,1024x131072"
OPS = ("softmax", "log_softmax", "layer_norm", "rms_norm", "residual_rms_norm", "sum_last",
       "sum_first", "transpose")


def case(op, R, C, rlx, torch):
    """(build(g) -> outputs, torch_fn(t) -> outputs, bytes, tolerance) for one op."""
    F = torch.nn.functional
    n = R * C
    if op in ("softmax", "log_softmax"):
        return (lambda g, x, r, w, b: [getattr(g, op)(x, -1)],
                lambda x, r, w, b: [getattr(torch, op)(x, -1)], 8 * n, 1e-5)
    if op == "layer_norm":
        return (lambda g, x, r, w, b: [g.layer_norm(x, w, b, eps=1e-5)],
                lambda x, r, w, b: [F.layer_norm(x, (C,), w, b, 1e-5)], 8 * n, 1e-4)
    if op == "rms_norm":
        return (lambda g, x, r, w, b: [g.rms_norm(x, w, eps=1e-6)],
                lambda x, r, w, b: [F.rms_norm(x, (C,), w, 1e-6)], 8 * n, 1e-4)
    if op == "residual_rms_norm":
        def t(x, r, w, b):
            h = x + r
            return [F.rms_norm(h, (C,), w, 1e-6), h]
        return (lambda g, x, r, w, b: list(g.rms_norm(x, w, eps=1e-6, residual=r, return_residual=True)),
                t, 16 * n, 1e-4)
    if op == "sum_last":
        return (lambda g, x, r, w, b: [g.sum(x, -1)], lambda x, r, w, b: [x.sum(-1)],
                4 * n + 4 * R, 1e-2)
    if op == "sum_first":
        return (lambda g, x, r, w, b: [g.sum(x, 0)], lambda x, r, w, b: [x.sum(0)],
                4 * n + 4 * C, 1e-2)
    if op == "transpose":
        return (lambda g, x, r, w, b: [g.transpose(x, (1, 0))],
                lambda x, r, w, b: [x.transpose(-1, -2).contiguous()], 8 * n, 0.0)
    raise ValueError(f"unknown op {op!r}")


def bench(op, R, C, rlx, cuda, torch, args):
    build, tfn, nbytes, tol = case(op, R, C, rlx, torch)
    g = rlx.Graph(op)
    x, r = g.input("x", (R, C)), g.input("r", (R, C))
    w, b = g.param("w", (C,)), g.param("b", (C,))
    outs = build(g, x, r, w, b)
    g.set_outputs(outs)
    exe = rlx.compile(g)
    tx = torch.randn(R, C, device="cuda")
    tr = torch.randn(R, C, device="cuda")
    tw = torch.randn(C, device="cuda")
    tb = torch.randn(C, device="cuda")
    exe.set_param("w", tw)
    exe.set_param("b", tb)
    torch.cuda.synchronize()
    views = exe.run({"x": tx, "r": tr}, outputs="view")
    refs = tfn(tx, tr, tw, tb)
    torch.cuda.synchronize()
    diff = 0.0
    for v, ref in zip(views, refs):
        got = torch.as_tensor(v, device="cuda")
        scale = max(1.0, ref.abs().max().item()) if op.startswith("sum") else 1.0
        diff = max(diff, ((got - ref).abs().max() / scale).item())
    steps = exe.steps

    def launch():
        for s in steps:
            s()
    rlx_ms = time_rlx(cuda, launch, exe.stream, args.iters, 3, 3)
    torch_ms = time_torch(torch, lambda: tfn(tx, tr, tw, tb), args.iters, 3, 3)
    res = dict(op=op, shape=f"{R}x{C}", bytes=nbytes, rlx_ms=rlx_ms, torch_ms=torch_ms,
               rlx_gbps=gbps(nbytes, rlx_ms), torch_gbps=gbps(nbytes, torch_ms),
               ratio=torch_ms / rlx_ms, max_diff=diff, diff_ok=diff <= tol,
               kernels=[s.kernel_name for s in steps])
    res["pass"] = res["ratio"] >= BAR and res["diff_ok"]
    del exe, views, refs, tx, tr, tw, tb
    free_device_memory(cuda, torch)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=SHAPES)
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "rows.json")
    args = p.parse_args(argv)
    import rlx_numba as rlx
    if rlx.simulator_enabled():
        print("bench_rows: no CUDA GPU here (simulator); this benchmark needs a GPU. Nothing measured.")
        return 0
    import torch
    from numba import cuda
    gpu = torch.cuda.get_device_name()
    copy = copy_bandwidth(torch)
    print(f"GPU: {gpu}   torch {torch.__version__}   numba-cuda {dist_version('numba-cuda')}   "
          f"torch copy_ {copy:.0f} GB/s\n")
    hdr = f"{'op':<18} {'shape':<13} {'rlx GB/s':>9} {'torch GB/s':>10} {'ratio':>6} {'% copy':>6}  bar   diff     kernel"
    print(hdr + "\n" + "-" * len(hdr))
    results = []
    out = Results(args.out, gpu=gpu, copy_gbps=copy, bar=BAR, results=results)
    for shape in args.shapes.split(","):
        R, C = (int(v) for v in shape.split("x"))
        for op in args.ops.split(","):
            try:
                r = bench(op, R, C, rlx, cuda, torch, args)
            except Exception as e:  # noqa: BLE001 - report the row, keep going
                print(f"{op:<18} {shape:<13} ERROR {type(e).__name__}: {e}")
                results.append(dict(op=op, shape=shape, error=str(e), **{"pass": False}))
                out.save()
                free_device_memory(cuda, torch)
                continue
            results.append(r)
            out.save()
            print(f"{op:<18} {shape:<13} {r['rlx_gbps']:9.0f} {r['torch_gbps']:10.0f} "
                  f"{r['ratio']:6.2f} {100 * r['rlx_gbps'] / copy:5.0f}%  "
                  f"{'PASS' if r['pass'] else 'FAIL'}  {r['max_diff']:.1e}  {r['kernels'][0]}")
    out.done()
    fails = sum(not r["pass"] for r in results)
    print(f"{len(results) - fails}/{len(results)} rows meet the bar (>= {BAR:.2f} x torch)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
