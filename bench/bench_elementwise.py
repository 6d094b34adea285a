"""Element-wise kernel bandwidth: rlx_numba's generated kernels against PyTorch, same process.

Ops at 2^28 f32 elements (``--size-log2``):
  add   a + b, same shape                        bytes = 3 * 4n
  mul   [R, C] * [C] row vector (broadcast)      bytes = 4n + 4C + 4n
  gelu  exact (erf) GELU                         bytes = 4n + 4n
  cast  f32 -> f16                               bytes = 4n + 2n
  and in f16 (the 16-byte vector kernels of half data): mul_bcast and gelu, half the bytes
  fake_quantize  [R, C] per channel (axis 1, int8 range) against
        torch.fake_quantize_per_channel_affine   bytes = 4n + 4n (x in, y out; ours also
        writes q, the backward's residual: its steps are timed together)

Only the kernel is timed: the compiled executable's single Step is launched repeatedly on
``exe.stream`` between two CUDA events (inputs already in the arena). PyTorch's equivalent is
timed with ``torch.cuda.Event`` on the same sizes. GB/s = (bytes read + bytes written) / time.
The bar is rlx >= 0.85 x torch. torch's ``copy_`` bandwidth is printed for reference.

  python bench/bench_elementwise.py [--size-log2 28] [--iters 20] [--warmup 3] [--repeats 3]
                                    [--out bench/results/elementwise.json] [--sweep]

``--sweep`` times the add kernel under several launch geometries (threads 128/256/512; blocks =
ceil(n/threads) or sm_count * waves * (2048 // threads)) to pick the default in
``rlx_numba/kernels/launch.py``.

GPU only: under the numba CUDA simulator it prints a message and exits 0.
"""
from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Results, dist_version, free_device_memory, gbps, time_rlx, time_torch  # noqa: E402

BAR = 0.85
HERE = Path(__file__).resolve().parent


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-log2", type=int, default=28, help="elements per tensor = 2^N (default 28)")
    p.add_argument("--iters", type=int, default=20, help="timed launches per measurement (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed launches first (default 3)")
    p.add_argument("--repeats", type=int, default=3,
                   help="measurements per op; the fastest is kept (default 3)")
    p.add_argument("--out", type=Path, default=HERE / "results" / "elementwise.json",
                   help="JSON output path (default bench/results/elementwise.json)")
    p.add_argument("--sweep", action="store_true",
                   help="also time add under several (blocks, threads) launch geometries")
    a = p.parse_args(argv)
    if a.size_log2 < 2 or a.size_log2 > 31:
        p.error("--size-log2 must be in 2..31")
    if a.iters < 1 or a.warmup < 0 or a.repeats < 1:
        p.error("--iters and --repeats must be >= 1, --warmup >= 0")
    return a


# ---- timing ------------------------------------------------------------------------------------
# ---- the ops -----------------------------------------------------------------------------------
def make_cases(rlx, torch, log2: int):
    """(name, shapes, graph builder, torch inputs, torch fn, bytes) for each op."""
    n = 1 << log2
    rows, cols = 1 << (log2 - log2 // 2), 1 << (log2 // 2)
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.float32, generator=gen)

    def g_add():
        g = rlx.Graph("bench_add")
        a, b = g.input("a", (n,), "f32"), g.input("b", (n,), "f32")
        g.set_outputs([g.add(a, b)])
        return g

    def g_mul(dt="f32"):
        g = rlx.Graph(f"bench_mul_bcast_{dt}")
        a, b = g.input("a", (rows, cols), dt), g.input("b", (cols,), dt)
        g.set_outputs([g.mul(a, b)])
        return g

    def g_gelu(dt="f32"):
        g = rlx.Graph(f"bench_gelu_{dt}")
        x = g.input("x", (n,), dt)
        g.set_outputs([g.gelu(x)])
        return g

    def g_cast():
        g = rlx.Graph("bench_cast")
        x = g.input("x", (n,), "f32")
        g.set_outputs([g.cast(x, "f16")])
        return g

    def g_fake_quantize():
        g = rlx.Graph("bench_fake_quantize")
        x = g.input("x", (rows, cols), "f32")
        s, z = g.input("s", (cols,), "f32"), g.input("z", (cols,), "i32")
        g.set_outputs([g.fake_quantize(x, s, z, quant_min=-128, quant_max=127, axis=1)])
        return g

    F = torch.nn.functional
    return [
        dict(op="add", desc=f"[{n}] + [{n}]", graph=g_add,
             inputs=lambda: {"a": randn(n), "b": randn(n)},
             out=lambda: torch.empty(n, device="cuda", dtype=torch.float32),
             torch_fn=lambda i, o: (lambda: torch.add(i["a"], i["b"], out=o)),
             nbytes=3 * 4 * n, tol=0.0),
        dict(op="mul_bcast", desc=f"[{rows},{cols}] * [{cols}]", graph=g_mul,
             inputs=lambda: {"a": randn(rows, cols), "b": randn(cols)},
             out=lambda: torch.empty(rows, cols, device="cuda", dtype=torch.float32),
             torch_fn=lambda i, o: (lambda: torch.mul(i["a"], i["b"], out=o)),
             nbytes=4 * n + 4 * cols + 4 * n, tol=0.0),
        dict(op="gelu", desc=f"gelu(erf) [{n}]", graph=g_gelu,
             inputs=lambda: {"x": randn(n) * 3},
             out=lambda: None,
             torch_fn=lambda i, o: (lambda: F.gelu(i["x"], approximate="none")),
             nbytes=4 * n + 4 * n, tol=1e-4),
        dict(op="mul_bcast_f16", desc=f"f16 [{rows},{cols}] * [{cols}]",
             graph=lambda: g_mul("f16"),
             inputs=lambda: {"a": randn(rows, cols).half(), "b": randn(cols).half()},
             out=lambda: torch.empty(rows, cols, device="cuda", dtype=torch.float16),
             torch_fn=lambda i, o: (lambda: torch.mul(i["a"], i["b"], out=o)),
             nbytes=2 * n + 2 * cols + 2 * n, tol=0.0),
        dict(op="gelu_f16", desc=f"f16 gelu(erf) [{n}]", graph=lambda: g_gelu("f16"),
             inputs=lambda: {"x": (randn(n) * 3).half()},
             out=lambda: None,
             torch_fn=lambda i, o: (lambda: F.gelu(i["x"], approximate="none")),
             nbytes=2 * n + 2 * n, tol=2e-2),
        dict(op="cast_f32_f16", desc=f"f32->f16 [{n}]", graph=g_cast,
             inputs=lambda: {"x": randn(n) * 100},
             out=lambda: None,
             torch_fn=lambda i, o: (lambda: i["x"].to(torch.float16)),
             nbytes=4 * n + 2 * n, tol=0.0),
        dict(op="fake_quantize", desc=f"per channel [{rows},{cols}] axis 1", multi=True,
             graph=g_fake_quantize,
             inputs=lambda: {"x": randn(rows, cols), "s": randn(cols).abs() * 0.05 + 0.01,
                             "z": torch.randint(-10, 10, (cols,), device="cuda",
                                                dtype=torch.int32, generator=gen)},
             out=lambda: None,
             torch_fn=lambda i, o: (lambda: torch.fake_quantize_per_channel_affine(
                 i["x"], i["s"], i["z"], 1, -128, 127)),
             nbytes=4 * n + 4 * n, tol=0.0),
    ]


def bench_op(rlx, cuda, torch, case, args, sweep: bool):
    exe = rlx.compile(case["graph"]())
    if len(exe.steps) != 1 and not case.get("multi"):
        raise RuntimeError(f"{case['op']}: expected one step, got {[s.name for s in exe.steps]}")
    step = exe.steps[0]
    steps = list(exe.steps)
    launch = step if len(steps) == 1 else (lambda: [s() for s in steps])
    inputs = case["inputs"]()
    torch.cuda.synchronize()          # inputs written on torch's stream before numba reads them
    (view,) = exe.run(inputs, outputs="view")   # binds inputs into the arena, compiles, runs once
    out = case["out"]()
    fn = case["torch_fn"](inputs, out)
    ref = fn()
    if ref is None:
        ref = out
    torch.cuda.synchronize()
    got = torch.as_tensor(view, device="cuda")
    if got.dtype != ref.dtype or tuple(got.shape) != tuple(ref.shape):
        raise RuntimeError(f"{case['op']}: rlx gave {got.dtype}{tuple(got.shape)}, torch "
                           f"{ref.dtype}{tuple(ref.shape)}")
    diff = (got.float() - ref.float()).abs().max().item()
    del got, ref

    rlx_ms = time_rlx(cuda, launch, exe.stream, args.iters, args.warmup, args.repeats)
    torch_ms = time_torch(torch, fn, args.iters, args.warmup, args.repeats)
    r = dict(op=case["op"], shape=case["desc"], bytes=case["nbytes"],
             rlx_ms=rlx_ms, rlx_gbps=gbps(case["nbytes"], rlx_ms),
             torch_ms=torch_ms, torch_gbps=gbps(case["nbytes"], torch_ms),
             grid=list(step.grid), block=list(step.block),
             modes=list(step.info.get("modes", ())), dims=list(step.info.get("dims", ())),
             steps=len(steps), max_abs_diff=diff, diff_ok=diff <= case["tol"])
    r["ratio"] = r["rlx_gbps"] / r["torch_gbps"]
    r["pass"] = r["ratio"] >= BAR
    sweep_rows = (launch_sweep(rlx, cuda, exe, step, case["nbytes"], args)
                  if sweep and len(steps) == 1 else None)
    del exe, step, steps, launch, inputs, out, fn, view
    free_device_memory(cuda, torch)
    return r, sweep_rows


def launch_sweep(rlx, cuda, exe, step, nbytes, args):
    """Time one step under several (blocks, threads); restores its geometry afterwards."""
    from rlx_numba.kernels.launch import sm_count

    n = step.info["n"]
    sms = sm_count()
    default = (step.grid, step.block)
    configs = []
    for threads in (128, 256, 512):
        full = -(-n // threads)
        configs.append((full, threads, "ceil(n/t)"))
        for waves in (1, 2, 4, 8, 16, 32):
            blocks = sms * waves * (2048 // threads)
            if blocks < full:
                configs.append((blocks, threads, f"sm*{waves}*(2048/t)"))
    rows = []
    try:
        for blocks, threads, label in configs:
            step.grid, step.block = (blocks,), (threads,)
            step.bind(exe.stream, False)
            ms = time_rlx(cuda, step, exe.stream, args.iters, args.warmup, args.repeats)
            rows.append(dict(blocks=blocks, threads=threads, rule=label, ms=ms,
                             gbps=gbps(nbytes, ms),
                             default=(step.grid, step.block) == default))
    finally:
        step.grid, step.block = default
        step.bind(exe.stream, False)
    return rows


# ---- output ------------------------------------------------------------------------------------
def print_table(results, copy_gbps):
    head = f"{'op':<14}{'shape':<26}{'rlx GB/s':>10}{'torch GB/s':>12}{'ratio':>8}  {'bar':<6}" \
           f"{'max|diff|':>11}  {'grid x block'}"
    print(head)
    print("-" * len(head))
    for r in results:
        print(f"{r['op']:<14}{r['shape']:<26}{r['rlx_gbps']:>10.0f}{r['torch_gbps']:>12.0f}"
              f"{r['ratio']:>8.3f}  {'PASS' if r['pass'] else 'FAIL':<6}{r['max_abs_diff']:>11.3g}"
              f"{'' if r['diff_ok'] else ' (!)'}  {r['grid'][0]} x {r['block'][0]}")
    print(f"\n(torch copy_ f32 read+write: {copy_gbps:.0f} GB/s; bar: rlx >= {BAR} x torch)")


def print_sweep(rows, nbytes):
    print(f"\nlaunch sweep, add ({nbytes / 1e9:.2f} GB moved per launch):")
    print(f"{'threads':>8}{'blocks':>12}  {'rule':<20}{'ms':>9}{'GB/s':>9}")
    best = max(rows, key=lambda r: r["gbps"])
    for r in rows:
        tag = ("  <- current default" if r["default"] else "") + ("  <- best" if r is best else "")
        print(f"{r['threads']:>8}{r['blocks']:>12}  {r['rule']:<20}{r['ms']:>9.3f}"
              f"{r['gbps']:>9.0f}{tag}")


def main(argv=None) -> int:
    args = parse_args(argv)
    import rlx_numba as rlx  # decides the simulator before numba.cuda is imported

    if rlx.simulator_enabled():
        print("bench_elementwise: no CUDA GPU here (rlx_numba runs in the numba CUDA simulator); "
              "this benchmark needs a GPU. Nothing measured.")
        return 0
    try:
        import torch
    except ImportError:
        print("bench_elementwise: PyTorch is needed for the side-by-side figures "
              "(pip install torch)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_elementwise: torch sees no CUDA device", file=sys.stderr)
        return 2
    import numba
    from numba import cuda

    gpu = torch.cuda.get_device_name()
    n = 1 << args.size_log2
    print(f"GPU: {gpu}   torch {torch.__version__}   numba {numba.__version__}   "
          f"numba-cuda {dist_version('numba-cuda')}")
    print(f"n = 2^{args.size_log2} = {n} elements; {args.warmup} warm-ups, best of {args.repeats} "
          f"x {args.iters} launches\n")

    x = torch.randn(n, device="cuda")
    y = torch.empty_like(x)
    copy_ms = time_torch(torch, lambda: y.copy_(x), args.iters, args.warmup, args.repeats)
    copy_gbps = gbps(2 * 4 * n, copy_ms)
    del x, y
    free_device_memory(cuda, torch)

    results, sweep = [], None
    out = Results(args.out, bench="elementwise", gpu=gpu, torch=torch.__version__,
                  numba=numba.__version__, numba_cuda=dist_version("numba-cuda"),
                  python=platform.python_version(), size_log2=args.size_log2, n=n,
                  iters=args.iters, warmup=args.warmup, repeats=args.repeats, bar=BAR,
                  torch_copy_gbps=copy_gbps, results=results, sweep=sweep)
    for case in make_cases(rlx, torch, args.size_log2):
        t0 = time.perf_counter()
        r, s = bench_op(rlx, cuda, torch, case, args, sweep=args.sweep and case["op"] == "add")
        if s is not None:
            sweep = s
        results.append(r)
        out.save(sweep=sweep)
        print(f"  {r['op']}: done in {time.perf_counter() - t0:.1f} s, max |rlx - torch| = "
              f"{r['max_abs_diff']:.3g}" + ("" if r["diff_ok"] else f"  (tolerance {case['tol']:g} "
                                             "EXCEEDED)"))
    print()
    print_table(results, copy_gbps)
    if sweep:
        print_sweep(sweep, results[0]["bytes"])

    out.done(time=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    wrong = [r["op"] for r in results if not r["diff_ok"]]
    if wrong:
        print(f"bench_elementwise: rlx output differs from torch beyond tolerance for: "
              f"{', '.join(wrong)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
