"""Sequence ops and the Mamba model on the GPU beside torch / transformers in the same process
(issue 20's bench).

  selective_scan B8 Dm1536 N16 L2048 (softplus, D, z): ours (the three chunk kernels, CUDA
    events over the executable's steps) against transformers' slow path (MambaMixer's
    reference scan in torch: deltaA / deltaB_u materialised, a loop over L), bar 10x;
  Mamba (mamba-130m's config, random weights) greedy decode at batch 1: tokens/s of ours
    (prefill, then one decode graph run a token) against transformers' generate (its slow
    path: no mamba_ssm kernels), bar 2x;
  rfft / fft / irfft of 2^20 points batch 64 and rfft of a length that is not a power of two
    against torch.fft (cuFFT): our tier 0 (cuFFT, bar 0.9x) and tier 1 (numba Stockham, and
    Bluestein for 1000; bar 0.3x);
  sort of 1M f32 (one row) and 4096 rows x 32k against torch.sort(stable=True), bar 0.7x;
    the same 4096 x 32k sort in bf16 and topk 64 of it in i32 (no bar: measured and stated);
  c64 (complex64): fft, the product (cublasCgemm / the numba kernel) and a chain of
    element-wise ops beside torch in complex64 (no bar: measured and stated).
Kernel times are CUDA-event sums of the executable's steps (exe.profile); torch's by events.

  python bench/bench_signal.py [--out F] [--skip scan,fft,decode,complex]
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Results, time_torch  # noqa: E402


def scan_row(rlx, torch, rng, b=8, dm=1536, n=16, length=2048):
    F = torch.nn.functional
    feed = dict(u=rng.standard_normal((b, dm, length)), delta=rng.standard_normal((b, dm, length)),
                A=-np.exp(rng.standard_normal((dm, n)) * 0.5),
                B=rng.standard_normal((b, n, length)), C=rng.standard_normal((b, n, length)),
                D=rng.standard_normal(dm), z=rng.standard_normal((b, dm, length)))
    feed = {k: v.astype(np.float32) for k, v in feed.items()}
    g = rlx.Graph("scan")
    t = {k: g.input(k, v.shape) for k, v in feed.items()}
    g.set_outputs([g.selective_scan(t["u"], t["delta"], t["A"], t["B"], t["C"], D=t["D"],
                                    z=t["z"], delta_softplus=True)])
    exe = rlx.compile(g)
    (got,) = exe.run(feed)
    prof = exe.profile(feed, warmup=1)
    T = {k: torch.tensor(v, device="cuda") for k, v in feed.items()}

    def slow():    # transformers' MambaMixer.slow_forward, its scan
        dt = F.softplus(T["delta"])
        dA = torch.exp(T["A"][None, :, None, :] * dt[:, :, :, None])
        dBu = dt[:, :, :, None] * T["B"].transpose(1, 2)[:, None] * T["u"][:, :, :, None]
        st = torch.zeros(b, dm, n, device="cuda")
        ys = []
        for i in range(length):
            st = dA[:, :, i] * st + dBu[:, :, i]
            ys.append(torch.matmul(st, T["C"][:, :, i, None])[..., 0])
        y = torch.stack(ys, dim=-1) + T["u"] * T["D"][None, :, None]
        return y * F.silu(T["z"])
    with torch.no_grad():
        want = slow().cpu().numpy()
        theirs = time_torch(torch, slow, 1, 1, 2)
    rel = float(np.abs(got - want).max() / np.abs(want).max())
    return dict(row=f"selective_scan B{b} Dm{dm} N{n} L{length}", rel=rel,
                rlx_ms=prof.total_ms, torch_ms=theirs, ratio=theirs / prof.total_ms,
                steps=[(r.kernel, r.ms) for r in prof])


def op_row(rlx, torch, name, shape, build, ref, check, tiers=None, dtype="f32",
           env="RLX_NUMBA_FFT_TIERS"):
    """One graph op beside its torch call: (rel or equality, ours ms, torch ms); ``tiers``:
    ``env`` (RLX_NUMBA_FFT_TIERS) while it compiles; a c64 ``dtype`` feeds complex64 x."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape).astype(np.float32)
    if dtype == "c64":
        x = (x + 1j * rng.standard_normal(shape)).astype(np.complex64)
    elif dtype in ("f16", "bf16"):
        import ml_dtypes
        x = x.astype(ml_dtypes.bfloat16 if dtype == "bf16" else np.float16)
    elif dtype == "i32":
        x = rng.integers(-2**31, 2**31 - 1, shape, dtype=np.int64).astype(np.int32)
    g = rlx.Graph(name)
    g.set_outputs(list(build(g, g.input("x", shape, dtype))))
    if tiers:
        os.environ[env] = tiers
        name += f" tier {tiers}"
    try:
        exe = rlx.compile(g)
    finally:
        os.environ.pop(env, None)
    got = exe.run({"x": x})
    tx = torch.tensor(x.astype(np.float32) if dtype in ("f16", "bf16") else x, device="cuda")
    if dtype in ("f16", "bf16"):
        tx = tx.to(torch.bfloat16 if dtype == "bf16" else torch.float16)
    want = ref(tx)
    ok = check(got, want)
    prof = exe.profile({"x": x}, warmup=1)
    theirs = time_torch(torch, lambda: ref(tx), 5, 1, 3)
    return dict(row=name, check=ok, rlx_ms=prof.total_ms, torch_ms=theirs,
                ratio=theirs / prof.total_ms, steps=[(r.kernel, r.ms) for r in prof])


def fft_sort_rows(rlx, torch):
    """The fft and sort rows, each yielded once measured."""
    def rel(got, want):
        w = want.cpu().numpy()
        if want.is_complex() and not np.iscomplexobj(got[0]):     # the [..., 2] form
            w = torch.view_as_real(want).cpu().numpy()
        return float(np.abs(got[0] - w).max() / np.abs(w).max())

    def same(got, want):
        return bool((got[1] == want.indices.cpu().numpy()).all())

    def same_values(got, want):        # (torch.topk's order among ties is not specified)
        return bool((got[0] == want.values.cpu().numpy()).all())
    ffts = [
        ("rfft 2^20 x 64", (64, 2**20), lambda g, x: [g.rfft(x)],
         lambda x: torch.fft.rfft(x), rel),
        ("fft 2^20 x 64", (64, 2**20, 2), lambda g, x: [g.fft(x)],
         lambda x: torch.fft.fft(torch.view_as_complex(x)), rel),
        ("irfft 2^20 x 64", (64, 2**19 + 1, 2), lambda g, x: [g.irfft(x)],
         lambda x: torch.fft.irfft(torch.view_as_complex(x)), rel),
        ("rfft 1000 x 4096", (4096, 1000), lambda g, x: [g.rfft(x)],
         lambda x: torch.fft.rfft(x), rel),
    ]
    rows = [
        ("sort 1M f32", (1, 2**20), lambda g, x: g.sort(x),
         lambda x: torch.sort(x, stable=True), same),
        ("sort 4096 x 32k f32", (4096, 32768), lambda g, x: g.sort(x),
         lambda x: torch.sort(x, stable=True), same),
    ]
    typed = [   # f16 / bf16 sort: ordered by the f32 cast; i32 topk: a sort's first k
        ("sort 4096 x 32k bf16", (4096, 32768), lambda g, x: g.sort(x),
         lambda x: torch.sort(x, stable=True), same, "bf16"),
        ("topk 64 of 4096 x 32k i32", (4096, 32768), lambda g, x: g.topk(x, 64),
         lambda x: torch.topk(x, 64), same_values, "i32"),
    ]
    yield from (op_row(rlx, torch, *r, tiers=t) for r in ffts for t in ("0", "1"))
    yield from (op_row(rlx, torch, *r) for r in rows)
    yield from (op_row(rlx, torch, *r[:5], dtype=r[5]) for r in typed)


def complex_rows(rlx, torch):
    """c64 (issue 33): fft on complex64 (cuFFT C2C / the numba Stockham kernels), the
    product (cublasCgemm: tier 0; the numba complex64 kernel: tier 1, at a size it finishes
    in), and a chain of complex element-wise ops (built on f32 pairs: one fused kernel or a
    few), each beside torch's complex64 call, yielded once measured. No bar: measured and
    stated."""
    def rel(got, want):
        w = want.cpu().numpy()
        return float(np.abs(got[0] - w).max() / np.abs(w).max())
    fft = ("c64 fft 2^20 x 64", (64, 2**20), lambda g, x: [g.fft(x)],
           lambda x: torch.fft.fft(x), rel)
    ew = ("c64 |x * x - 1j| / (x + 2), 2^24", (2**24,),
          lambda g, x: [g.abs(x * x - 1j) / (x + 2.0)],
          lambda x: torch.abs(x * x - 1j) / (x + 2.0), rel)
    mm = [(f"c64 matmul {n}^3", (n, n), lambda g, x: [g.matmul(x, x)], lambda x: x @ x, rel, t)
          for n, t in ((4096, "0"), (1024, "1"))]
    yield from (op_row(rlx, torch, *fft, tiers=t, dtype="c64") for t in ("0", "1"))
    yield from (op_row(rlx, torch, *r[:5], tiers=r[5], dtype="c64",
                       env="RLX_NUMBA_CMATMUL_TIERS") for r in mm)
    yield op_row(rlx, torch, *ew, dtype="c64")


def decode_row(torch, rng, new_tokens=64, prompt=8):
    import transformers as tf

    from rlx_numba.models import MambaConfig, MambaForCausalLM
    cfg = tf.MambaConfig(vocab_size=50280, hidden_size=768, state_size=16, num_hidden_layers=24,
                         conv_kernel=4, expand=2)
    torch.manual_seed(0)
    ref = tf.MambaForCausalLM(cfg).eval().cuda()
    params = {k: v.detach().float().cpu().numpy() for k, v in ref.state_dict().items()}
    params.pop("lm_head.weight", None)
    ours = MambaForCausalLM(MambaConfig.from_hf(cfg.to_dict()), params)
    ids = rng.integers(0, 50280, (1, prompt))
    ours.generate(ids, max_new_tokens=new_tokens)          # compile + warm
    best_ours = best_theirs = float("inf")
    tids = torch.tensor(ids, device="cuda")
    with torch.no_grad():
        ref.generate(tids, max_new_tokens=4, do_sample=False)
        for _ in range(2):
            t0 = time.perf_counter()
            mine = ours.generate(ids, max_new_tokens=new_tokens)
            best_ours = min(best_ours, time.perf_counter() - t0)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            theirs = ref.generate(tids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  do_sample=False)
            torch.cuda.synchronize()
            best_theirs = min(best_theirs, time.perf_counter() - t0)
    same = bool((mine == theirs.cpu().numpy()).all())
    return dict(row=f"Mamba-130m config decode b1 ({prompt} + {new_tokens} tokens)",
                rlx_tok_s=new_tokens / best_ours, torch_tok_s=new_tokens / best_theirs,
                ratio=best_theirs / best_ours, same_tokens=same)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path,
                   default=Path(__file__).resolve().parent / "results" / "signal.json")
    p.add_argument("--skip", default="", help="comma-separated: scan, fft (fft and sort), decode, complex")
    args = p.parse_args()
    skip = set(args.skip.split(","))
    import torch

    import rlx_numba as rlx
    torch.backends.cuda.matmul.allow_tf32 = False
    rng = np.random.default_rng(0)
    print(f"GPU: {torch.cuda.get_device_name()}   torch {torch.__version__}   f32\n")
    results = []
    out = Results(args.out, gpu=torch.cuda.get_device_name(), rows=results)
    r = scan_row(rlx, torch, rng) if "scan" not in skip else None
    if r:
        print(f"{r['row']:<44} rel {r['rel']:.1e}  ours {r['rlx_ms']:8.2f} ms  slow path "
          f"{r['torch_ms']:8.2f} ms  ratio {r['ratio']:6.1f}   "
              + " | ".join(f"{k[:28]} {ms:.2f}" for k, ms in r["steps"]), flush=True)
        results.append(r)
        out.save()
    for r in itertools.chain(fft_sort_rows(rlx, torch) if "fft" not in skip else (),
                             complex_rows(rlx, torch) if "complex" not in skip else ()):
        print(f"{r['row']:<44} check {r['check']}  ours {r['rlx_ms']:8.3f} ms  torch "
              f"{r['torch_ms']:8.3f} ms  ratio {r['ratio']:5.2f}   "
              + " | ".join(f"{k[:28]} {ms:.3f}" for k, ms in r["steps"][:6]), flush=True)
        results.append(r)
        out.save()
    if "decode" not in skip:
        r = decode_row(torch, rng)
        print(f"{r['row']:<44} ours {r['rlx_tok_s']:7.1f} tok/s  transformers "
              f"{r['torch_tok_s']:7.1f} tok/s  ratio {r['ratio']:5.2f}  same tokens: "
              f"{r['same_tokens']}", flush=True)
        results.append(r)
    out.done()


if __name__ == "__main__":
    main()
