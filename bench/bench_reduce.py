"""Reduction bandwidth beside PyTorch (same process, CUDA events): f32 sum over the last and the
first axis at 32768x4096, 4096x32768, 262144x256, 1024x131072 (bar: >= 0.90 x torch), then,
for information, argmax over a vocabulary, cumsum, max, mean, a bf16 sum, an interleaved axis
set and a full sum. GB/s = bytes read (and written, for cumsum) / time.

  python bench/bench_reduce.py [--out bench/results/reduce.json]      (GPU only)
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Results, free_device_memory, gbps, time_rlx, time_torch  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "reduce.json")
    args = p.parse_args(argv)
    import rlx_numba as rlx
    if rlx.simulator_enabled():
        print("bench_reduce: no CUDA GPU here (simulator); this benchmark needs a GPU. Nothing measured.")
        return 0
    import ml_dtypes
    import torch
    from numba import cuda
    print(torch.cuda.get_device_name(), flush=True)
    SHAPES = [(32768, 4096), (4096, 32768), (262144, 256), (1024, 131072)]
    IT, WU, REP = 20, 3, 3

    def rlx_graph(x_t, build, dtype="f32"):
        g = rlx.Graph("b"); xi = g.input("x", tuple(x_t.shape), dtype); g.set_outputs([build(g, xi)])
        exe = rlx.compile(g)
        exe.run({"x": x_t}, outputs="view")
        st = exe.steps
        def launch():
            for s in st: s()
        return exe, launch

    def rlx_sum(x_t, axis):
        return rlx_graph(x_t, lambda g, t: g.sum(t, axis))

    res = []
    out = Results(args.out, gpu=torch.cuda.get_device_name(), results=res)
    for shape in SHAPES:
        x = torch.randn(*shape, device="cuda", dtype=torch.float32)
        nbytes = x.numel() * 4
        for axis in (1, 0):
            exe, launch = rlx_sum(x, axis)
            (y,) = exe.run({"x": x}, outputs="view")
            ref = x.sum(axis)
            yt = torch.as_tensor(y.copy_to_host(), device="cuda")
            err = ((yt - ref).abs().max() / ref.abs().max()).item()
            t_r = time_rlx(cuda, launch, exe.stream, IT, WU, REP)
            t_t = time_torch(torch, lambda: torch.sum(x, axis), IT, WU, REP)
            r = dict(op=f"sum axis {axis}", shape="x".join(map(str, shape)), axis=axis,
                     rlx_gbps=gbps(nbytes, t_r), torch_gbps=gbps(nbytes, t_t), ratio=t_t / t_r,
                     err=err, kernels=[s.kernel_name for s in exe.steps])
            res.append(r)
            out.save()
            print(f"{str(shape):16} axis {axis}: rlx {r['rlx_gbps']:7.0f} GB/s  torch {r['torch_gbps']:7.0f} GB/s  "
                  f"ratio {r['ratio']:.3f}  err {err:.1e}  {r['kernels']}", flush=True)
            del exe
            free_device_memory(cuda, torch)
        del x
        free_device_memory(cuda, torch)

    # ---- extras (information only): argmax over a vocab, cumsum, max/mean, half inputs -------------
    EXTRAS = [
        ("argmax", (1, 128256), torch.float32, "f32", lambda g, t: g.argmax(t, -1), lambda x: torch.argmax(x, -1)),
        ("argmax", (64, 128256), torch.float32, "f32", lambda g, t: g.argmax(t, -1), lambda x: torch.argmax(x, -1)),
        ("argmax0", (32768, 4096), torch.float32, "f32", lambda g, t: g.argmax(t, 0), lambda x: torch.argmax(x, 0)),
        ("cumsum-1", (32768, 4096), torch.float32, "f32", lambda g, t: g.cumsum(t, -1), lambda x: torch.cumsum(x, -1)),
        ("cumsum0", (32768, 4096), torch.float32, "f32", lambda g, t: g.cumsum(t, 0), lambda x: torch.cumsum(x, 0)),
        ("max-1", (32768, 4096), torch.float32, "f32", lambda g, t: g.reduce_max(t, -1), lambda x: torch.amax(x, -1)),
        ("mean0", (32768, 4096), torch.float32, "f32", lambda g, t: g.mean(t, 0), lambda x: torch.mean(x, 0)),
        ("sum-1 bf16", (32768, 4096), torch.bfloat16, "bf16", lambda g, t: g.sum(t, -1), lambda x: torch.sum(x, -1)),
        ("sum(0,2)", (64, 512, 1024), torch.float32, "f32", lambda g, t: g.sum(t, (0, 2)), lambda x: torch.sum(x, (0, 2))),
        ("sum all", (1, 2**27), torch.float32, "f32", lambda g, t: g.sum(t), lambda x: torch.sum(x)),
    ]
    rng = np.random.default_rng(0)
    for name, shape, tdt, rdt, build, tfn in EXTRAS:
        xh = rng.standard_normal(shape, dtype=np.float32)
        if rdt == "bf16":
            xh = xh.astype(ml_dtypes.bfloat16)
        x = torch.from_numpy(xh.astype(np.float32)).to("cuda").to(tdt)
        nbytes = x.numel() * x.element_size() * (2 if name.startswith("cumsum") else 1)
        try:
            exe, launch = rlx_graph(xh, build, rdt)
            (y,) = exe.run({"x": xh})
            ref = tfn(x).double().cpu().numpy()
            ok = "ok" if np.allclose(y.astype(np.float64), ref, rtol=1e-2, atol=1e-2) else "WRONG"
            t_r = time_rlx(cuda, launch, exe.stream, IT, WU, REP)
            t_t = time_torch(torch, lambda: tfn(x), IT, WU, REP)
            print(f"{name:12} {str(shape):16}: rlx {gbps(nbytes, t_r):7.0f} GB/s ({t_r*1e3:8.1f} us)  "
                  f"torch {gbps(nbytes, t_t):7.0f} GB/s ({t_t*1e3:8.1f} us)  ratio {t_t / t_r:.2f} {ok} "
                  f"{[s.kernel_name for s in exe.steps]}", flush=True)
            res.append(dict(op=name, shape="x".join(map(str, shape)), dtype=rdt,
                            rlx_gbps=gbps(nbytes, t_r), torch_gbps=gbps(nbytes, t_t),
                            ratio=t_t / t_r, close=ok == "ok",
                            kernels=[s.kernel_name for s in exe.steps]))
            out.save()
            del exe
        except Exception as e:  # noqa: BLE001
            print(f"{name} {shape}: FAILED {type(e).__name__}: {e}", flush=True)
        del x
        free_device_memory(cuda, torch)
    out.done()
    return 0


if __name__ == "__main__":
    sys.exit(main())
