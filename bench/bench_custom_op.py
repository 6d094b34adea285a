"""A custom op's cost against the same kernel launched by hand (same process, CUDA events).

A fused quick-GELU kernel, x * sigmoid(1.702 x), on 2^N f32 elements (default 2^24), timed
three ways on one stream each: the custom op's Step of a compiled executable (``rlx.custom_op``
/ ``g.custom``; its launch packed at compile time), the same kernel launched by hand with
numba's ``kernel[blocks, threads, stream](out, x)`` on device arrays, and, for reference,
rlx's own fused element-wise chain for the same math (and torch's ``x * sigmoid(1.702 x)``
when torch is installed). A GRAPH-mode executable's whole run (one CUDA-graph replay) is
timed too. Bar: the custom step within 10% of the hand launch (ratio <= 1.10).

  python bench/bench_custom_op.py [--size-log2 24] [--iters 50] [--warmup 5] [--repeats 3]
      [--out bench/results/custom_op.json]      (GPU only)
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Results, gbps, time_rlx  # noqa: E402

BAR = 1.10

import rlx_numba as rlx  # noqa: E402  (before numba.cuda: it decides the simulator)
from numba import cuda   # noqa: E402  (a module global of the kernel, as numba requires)


@cuda.jit
def quick_gelu(out, x):
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, out.shape[0], stride):
        v = x[i]
        out[i] = v / (np.float32(1.0) + math.exp(np.float32(-1.702) * v))


THREADS = 256


def launch(x_shape):
    return min(-(-x_shape[0] // THREADS), 65535), THREADS


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-log2", type=int, default=24)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path,
                   default=Path(__file__).resolve().parent / "results" / "custom_op.json")
    a = p.parse_args(argv)
    if rlx.simulator_enabled():
        print("bench_custom_op: no CUDA GPU here (simulator); this benchmark needs a GPU. "
              "Nothing measured.")
        return 0
    n = 1 << a.size_log2
    nbytes = 8 * n
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal(n).astype(np.float32)
    want = x_np / (1.0 + np.exp(-1.702 * x_np))
    op = rlx.custom_op("bench_quick_gelu", quick_gelu, lambda x: (x.shape, x.dtype), launch)
    timing = (a.iters, a.warmup, a.repeats)
    name = cuda.get_current_device().name
    name = name.decode() if isinstance(name, bytes) else name
    rows = []
    out = Results(a.out, gpu=name, size_log2=a.size_log2, rows=rows)

    def row(label, ms):
        rows.append({"name": label, "ms": ms, "gbps": gbps(nbytes, ms)})
        out.save()

    # the custom op's step
    g = rlx.Graph("custom_op")
    x = g.input("x", (n,))
    g.set_outputs([g.custom(op, x)])
    exe = rlx.compile(g, compile_mode="aot")
    assert np.allclose(exe.run({"x": x_np})[0], want, rtol=1e-5, atol=1e-6)
    (step,) = exe.steps
    row("custom op step", time_rlx(cuda, step, exe.stream, *timing))
    # the same kernel by hand
    stream = cuda.stream()
    x_dev, out_dev = cuda.to_device(x_np, stream=stream), cuda.device_array(n, np.float32)
    blocks, threads = launch((n,))
    k = quick_gelu[blocks, threads, stream]
    k(out_dev, x_dev)
    assert np.allclose(out_dev.copy_to_host(), want, rtol=1e-5, atol=1e-6)
    row("hand launch (numba)", time_rlx(cuda, lambda: k(out_dev, x_dev), stream, *timing))
    # a GRAPH-mode run: one CUDA-graph replay, the input a device array (no host copy)
    exe_g = rlx.compile(g, exec_mode="graph", compile_mode="aot")
    x_in = cuda.to_device(x_np)
    assert np.allclose(exe_g.run({"x": x_in})[0], want, rtol=1e-5, atol=1e-6)
    row("custom op, GRAPH run", time_rlx(
        cuda, lambda: exe_g.run({"x": x_in}, outputs="view", wait=False), exe_g.stream, *timing))
    # rlx's own fused chain
    gb = rlx.Graph("builtin")
    xb = gb.input("x", (n,))
    gb.set_outputs([xb * gb.sigmoid(xb * 1.702)])
    exe_b = rlx.compile(gb, compile_mode="aot")
    assert np.allclose(exe_b.run({"x": x_np})[0], want, rtol=1e-5, atol=1e-6)
    (step_b,) = exe_b.steps
    row("rlx fused chain", time_rlx(cuda, step_b, exe_b.stream, *timing))
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        from common import time_torch
        xt = torch.from_numpy(x_np).cuda()
        row("torch x*sigmoid(1.702x)",
            time_torch(torch, lambda: xt * torch.sigmoid(xt * 1.702), *timing))
    print(f"custom op bench on {name}: 2^{a.size_log2} f32 elements, {nbytes / 1e6:.0f} MB moved")
    for r in rows:
        print(f"  {r['name']:<26} {r['ms'] * 1e3:9.1f} us  {r['gbps']:8.1f} GB/s")
    ratio = rows[0]["ms"] / rows[1]["ms"]
    ok = ratio <= BAR
    print(f"custom step / hand launch = {ratio:.3f} (bar <= {BAR}): {'PASS' if ok else 'FAIL'}")
    out.done(ratio=ratio, bar=BAR, **{"pass": ok})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
