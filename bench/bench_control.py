"""Control flow beside PyTorch (same process, CUDA events): ``g.scan`` of an RNN cell
h = tanh(h W + x_t U + b) over T steps (default 1024, batch 64, hidden 512, f32), compiled in
GRAPH mode (the unrolled loop is one CUDA-graph replay), against torch's eager Python loop of
the same math. Bar: >= 2x torch eager. Prints our launches a step and checks both agree.

  python bench/bench_control.py [--steps 1024] [--batch 64] [--hidden 512]
      [--out bench/results/control.json]      (GPU only)
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Results, time_torch  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1024)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--out", type=Path,
                   default=Path(__file__).resolve().parent / "results" / "control.json")
    args = p.parse_args(argv)
    import rlx_numba as rlx
    if rlx.simulator_enabled():
        print("bench_control: no CUDA GPU here (simulator); this benchmark needs a GPU. "
              "Nothing measured.")
        return 0
    import torch
    t, b, h = args.steps, args.batch, args.hidden
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((t, b, h)).astype(np.float32)
    h0 = rng.standard_normal((b, h)).astype(np.float32)
    w = (rng.standard_normal((h, h)) / np.sqrt(h)).astype(np.float32)
    u = (rng.standard_normal((h, h)) / np.sqrt(h)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(h)).astype(np.float32)

    def cell(sub, hh, ww, uu, bb, x):
        hn = sub.activation("tanh", sub.matmul(hh, ww) + sub.matmul(x, uu) + bb)
        return [hn, ww, uu, bb], [hn]

    g = rlx.Graph("rnn")
    ins = [g.input("h0", (b, h)), g.param("W", (h, h)), g.param("U", (h, h)), g.param("b", (h,))]
    (last, *_), _ys = g.scan(cell, ins, [g.input("xs", (t, b, h))])
    g.set_outputs([last])
    exe = rlx.compile(g, exec_mode="graph")
    for k, v in (("W", w), ("U", u), ("b", bias)):
        exe.set_param(k, v)
    feed = {"h0": h0, "xs": xs}
    ours = exe.run(feed)[0]

    tx, th, tw, tu, tb = (torch.from_numpy(a).cuda() for a in (xs, h0, w, u, bias))

    def torch_loop():
        hh = th
        for i in range(t):
            hh = torch.tanh(hh @ tw + tx[i] @ tu + tb)
        return hh
    ref = torch_loop().cpu().numpy()
    err = float(np.abs(ours - ref).max())
    import time

    from numba import cuda
    feed = {k: cuda.to_device(v) for k, v in feed.items()}   # (device inputs, as torch's are)
    exe.run(feed, outputs="view")
    cuda.synchronize()
    best = np.inf
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(3):
            exe.run(feed, outputs="view")
        cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / 3 * 1e3)
    torch_ms = time_torch(torch, torch_loop, 3, 1, 3)
    ratio = torch_ms / best
    launches = len(exe.steps) / t
    print(f"{torch.cuda.get_device_name()}: scan RNN T={t} B={b} H={h} f32: ours {best:.2f} ms "
          f"({launches:.1f} launches a step, one CUDA graph), torch eager loop {torch_ms:.2f} ms, "
          f"{ratio:.2f}x (bar >= 2x: {'PASS' if ratio >= 2 else 'FAIL'}), max |diff| {err:.1e}")
    Results(args.out, gpu=torch.cuda.get_device_name(), rows=[dict(
        op="scan_rnn", steps=t, batch=b, hidden=h, rlx_ms=best, torch_ms=torch_ms, ratio=ratio,
        launches_per_step=launches, max_diff=err, bar=">= 2x",
        **{"pass": bool(ratio >= 2)})]).done()
    return 0


if __name__ == "__main__":
    sys.exit(main())
