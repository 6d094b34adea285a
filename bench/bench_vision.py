"""Vision ops and models on the GPU beside torch in the same process (issue 17's bench).

Each row builds one op as a graph, checks it against torch (F.conv2d / conv_transpose2d /
conv3d / max_pool2d / avg_pool2d, f32, TF32 off: ``rel`` is max |ours - torch| / max |torch|),
then times ours as the sum of its steps' CUDA-event times (``exe.profile``) and torch's call
by CUDA events (mean of 20, best of 3). ``ratio`` = torch us / ours (>= 1: ours faster); the
steps column says where our time goes. The NHWC rows run ``channels_last=True`` beside torch on
channels_last tensors of the same memory. Model rows: ResNet-50 and ViT-B/16 (random weights,
batch 32, 224 x 224) images/s, ours (the compiled executable on a device-resident batch, in its
exec mode) beside torchvision's eager model, each timed with CUDA events on its own stream over
10 runs (best of 3); in bf16 ours has dtype="bf16" and torch runs under autocast bf16
(ResNet channels-last). The convolution rows are timed again on tiers 1 and 2
(RLX_NUMBA_CONV_TIERS) and with TF32 on both sides.

  python bench/bench_vision.py [--out F] [--no-models | --models-only] [--dtypes f32,bf16]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Results, time_rlx, time_torch  # noqa: E402


def rows(rlx, F, rng):
    w = lambda *s: (rng.standard_normal(s) * 0.05).astype(np.float32)   # noqa: E731
    return [
        ("conv 3x3 s1 64->64 56x56 b8", (8, 64, 56, 56),
         lambda g, x, p: g.conv(x, p["w"], p["b"], padding=1),
         lambda x, p: F.conv2d(x, p["w"], p["b"], padding=1), {"w": w(64, 64, 3, 3), "b": w(64)}),
        ("conv 1x1 256->64 56x56 b8", (8, 256, 56, 56), lambda g, x, p: g.conv(x, p["w"]),
         lambda x, p: F.conv2d(x, p["w"]), {"w": w(64, 256, 1, 1)}),
        ("conv 7x7 s2 3->64 224 b8", (8, 3, 224, 224),
         lambda g, x, p: g.conv(x, p["w"], stride=2, padding=3),
         lambda x, p: F.conv2d(x, p["w"], stride=2, padding=3), {"w": w(64, 3, 7, 7)}),
        ("depthwise 3x3 128ch 28x28 b8", (8, 128, 28, 28),
         lambda g, x, p: g.conv(x, p["w"], padding=1, groups=128),
         lambda x, p: F.conv2d(x, p["w"], padding=1, groups=128), {"w": w(128, 1, 3, 3)}),
        ("conv_transpose 2x2 s2 128->64 28 b8", (8, 128, 28, 28),
         lambda g, x, p: g.conv_transpose(x, p["w"], stride=2),
         lambda x, p: F.conv_transpose2d(x, p["w"], stride=2), {"w": w(128, 64, 2, 2)}),
        ("conv3d 3x3x3 16->32 16^3 b2", (2, 16, 16, 16, 16),
         lambda g, x, p: g.conv(x, p["w"], padding=1),
         lambda x, p: F.conv3d(x, p["w"], padding=1), {"w": w(32, 16, 3, 3, 3)}),
        ("max pool 3x3 s2 p1 64ch 112 b8", (8, 64, 112, 112),
         lambda g, x, p: g.pool(x, "max", 3, 2, 1), lambda x, p: F.max_pool2d(x, 3, 2, 1), {}),
        ("avg pool 3x3 s2 p1 ceil 64ch 56 b8", (8, 64, 56, 56),
         lambda g, x, p: g.pool(x, "avg", 3, 2, 1, ceil_mode=True, count_include_pad=False),
         lambda x, p: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False), {}),
        ("group_norm 32 groups 320ch 64x64 b4", (4, 320, 64, 64),
         lambda g, x, p: g.group_norm(x, 32, p["g"], p["b"]),
         lambda x, p: F.group_norm(x, 32, p["g"], p["b"]), {"g": w(320), "b": w(320)}),
        ("layer_norm2d 256ch 64x64 b4", (4, 256, 64, 64),
         lambda g, x, p: g.layer_norm2d(x, p["g"], p["b"]),
         lambda x, p: _layer_norm2d(x, p["g"], p["b"]), {"g": w(256), "b": w(256)}),
        ("batch_norm (eval) 256ch 56x56 b8", (8, 256, 56, 56),
         lambda g, x, p: g.batch_norm(x, p["m"], p["v"], p["g"], p["b"]),
         lambda x, p: F.batch_norm(x, p["m"], p["v"], p["g"], p["b"]),
         {"m": w(256), "v": 1 + np.abs(w(256)), "g": w(256), "b": w(256)}),
        ("resize bilinear 2x 64ch 56x56 b8", (8, 64, 56, 56),
         lambda g, x, p: g.resize(x, scale_factor=2, mode="bilinear"),
         lambda x, p: F.interpolate(x, scale_factor=2, mode="bilinear"), {}),
        ("resize nearest 2x 64ch 56x56 b8", (8, 64, 56, 56),
         lambda g, x, p: g.resize(x, scale_factor=2, mode="nearest"),
         lambda x, p: F.interpolate(x, scale_factor=2, mode="nearest"), {}),
        ("pad reflect 1 64ch 56x56 b8", (8, 64, 56, 56),
         lambda g, x, p: g.pad(x, (1, 1, 1, 1), "reflect"),
         lambda x, p: F.pad(x, (1, 1, 1, 1), "reflect"), {}),
        # channels last: x [N, H, W, C], weights [Cout, kh, kw, Cin]; torch gets the same
        # memory as channels_last NCHW views (no copies), its output viewed back as NHWC
        ("NHWC conv 3x3 s1 64->64 56x56 b8", (8, 56, 56, 64),
         lambda g, x, p: g.conv(x, p["w"], p["b"], padding=1, channels_last=True),
         lambda x, p: F.conv2d(_cf(x), _cf(p["w"]), p["b"], padding=1).permute(0, 2, 3, 1),
         {"w": w(64, 3, 3, 64), "b": w(64)}),
        ("NHWC conv 1x1 256->64 56x56 b8", (8, 56, 56, 256),
         lambda g, x, p: g.conv(x, p["w"], channels_last=True),
         lambda x, p: F.conv2d(_cf(x), _cf(p["w"])).permute(0, 2, 3, 1),
         {"w": w(64, 1, 1, 256)}),
        ("NHWC max pool 3x3 s2 p1 64ch 112 b8", (8, 112, 112, 64),
         lambda g, x, p: g.pool(x, "max", 3, 2, 1, channels_last=True),
         lambda x, p: F.max_pool2d(_cf(x), 3, 2, 1).permute(0, 2, 3, 1), {}),
        # a global pool: one mean reduction (it was two resample nodes, the first strided)
        ("NHWC adaptive avg pool 7x7->1 2048ch b32 bf16", (32, 7, 7, 2048),
         lambda g, x, p: g.adaptive_avg_pool(x, (1, 1), channels_last=True),
         lambda x, p: F.adaptive_avg_pool2d(_cf(x), 1).permute(0, 2, 3, 1), {}, "bf16"),
    ]


def _cf(t):
    """An NHWC (or KRSC) torch tensor as the channels_last NCHW view of the same memory."""
    return t.permute(0, 3, 1, 2)


def _layer_norm2d(x, g, b, eps=1e-6):     # SAM's LayerNorm2d, as written there
    u = x.mean(1, keepdim=True)
    s = (x - u).pow(2).mean(1, keepdim=True)
    x = (x - u) / (s + eps).sqrt()
    return g[:, None, None] * x + b[:, None, None]


def model_row(rlx, torch, arch, batch, dtype="f32"):
    """images/s of our model and torchvision's eager one (same random weights). dtype "bf16":
    ours with dtype="bf16", torch under autocast bf16 (ResNet in channels-last, its fastest
    layout), as a torch user runs them."""
    import tempfile

    import torchvision
    from numba import cuda
    from safetensors.torch import save_file

    from rlx_numba.models import ResNet, ViT
    torch.manual_seed(0)
    tmodel = getattr(torchvision.models, arch)(weights=None).eval().cuda()
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/m.safetensors"
        save_file({k: v.contiguous().cpu() for k, v in tmodel.state_dict().items()}, path)
        ours = (ResNet if arch.startswith("resnet") else ViT).from_safetensors(path, arch,
                                                                               dtype=dtype)
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    exe = ours.executable(batch, 224, 224)
    dx = cuda.as_cuda_array(x)
    torch.cuda.synchronize()
    t_ours = time_rlx(cuda, lambda: exe.run({"images": dx}, outputs="view"), exe.stream, 10, 2, 3)
    tx = x
    if dtype != "f32" and arch.startswith("resnet"):
        tmodel = tmodel.to(memory_format=torch.channels_last)
        tx = x.contiguous(memory_format=torch.channels_last)
    half = {"bf16": torch.bfloat16, "f16": torch.float16}.get(dtype)
    with torch.no_grad(), torch.autocast("cuda", half or torch.float32, enabled=half is not None):
        (got,) = exe.run({"images": dx})
        want = tmodel(tx).float().cpu().numpy()
        t_torch = time_torch(torch, lambda: tmodel(tx), 10, 2, 3)
    rel = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
    row = dict(layer=f"{arch} {dtype}", batch=batch, rel=rel, rlx_per_s=batch / (t_ours * 1e-3),
               torch_per_s=batch / (t_torch * 1e-3), ratio=t_torch / t_ours)
    if half is not None:          # issue 32's bar: at least torch autocast's images/s
        row.update(bar=1.0, **{"pass": row["ratio"] >= 1.0})
    return row


CONV_ROWS = 6        # the first rows of rows() are the convolutions: also timed by tier


def bench_row(rlx, torch, F, rng, row, label=""):
    """One row: ours (compiled as the environment says) against torch's call, checked."""
    name, xs, build, ref, params, *rest = row
    dtype = rest[0] if rest else "f32"          # a half row: x rounded, torch in that dtype
    x = rng.standard_normal(xs).astype(np.float32)
    if dtype != "f32":
        import ml_dtypes
        x = x.astype(ml_dtypes.bfloat16 if dtype == "bf16" else np.float16)
    g = rlx.Graph("vision")
    xt = g.input("x", xs, dtype)
    g.set_outputs([build(g, xt, {k: g.param(k, v.shape) for k, v in params.items()})])
    exe = rlx.compile(g)
    for k, v in params.items():
        exe.set_param(k, v)
    (got,) = exe.run({"x": x})
    got = got.astype(np.float32)
    tx = torch.tensor(x.astype(np.float32), device="cuda")
    if dtype != "f32":
        tx = tx.to(torch.bfloat16 if dtype == "bf16" else torch.float16)
    tp = {k: torch.tensor(v, device="cuda") for k, v in params.items()}
    want = ref(tx, tp).float().cpu().numpy()
    rel = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
    prof = exe.profile({"x": x}, warmup=2)
    ours = prof.total_ms * 1e3
    theirs = time_torch(torch, lambda: ref(tx, tp), 20, 3, 3) * 1e3
    steps = " | ".join(f"{r.kernel[:24]} {r.ms * 1e3:.1f}" for r in prof)
    name = f"{name} {label}".strip()
    print(f"{name:<44} {rel:8.1e} {ours:9.1f} {theirs:9.1f} {theirs / ours:6.2f}  {steps}",
          flush=True)
    return dict(layer=name, rel=rel, rlx_us=ours, torch_us=theirs, ratio=theirs / ours,
                steps=[(r.kernel, r.ms * 1e3) for r in prof])


def op_rows(rlx, torch, F, cublas, rng, results, save):
    """The op rows, then the convolutions again on each lower tier and with TF32, appended to
    ``results``, ``save()`` after each."""
    import os
    table = rows(rlx, F, rng)

    def run(row, label=""):
        results.append(bench_row(rlx, torch, F, rng, row, label))
        save()
    for row in table:
        run(row)
    print("\nthe convolutions on each lower tier (RLX_NUMBA_CONV_TIERS)")
    for tier in ("1", "2"):
        os.environ["RLX_NUMBA_CONV_TIERS"] = tier
        try:
            for row in table[:CONV_ROWS]:
                run(row, f"[tier {tier}]")
        finally:
            os.environ.pop("RLX_NUMBA_CONV_TIERS")
    print("\nTF32 on, both sides (torch.backends.cudnn / cuda.matmul.allow_tf32, "
          "rlx_numba.cublas.allow_tf32)")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    cublas.allow_tf32 = True
    try:
        for row in table[:CONV_ROWS]:
            run(row, "[tf32]")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        cublas.allow_tf32 = False


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path,
                   default=Path(__file__).resolve().parent / "results" / "vision.json")
    p.add_argument("--no-models", action="store_true", help="skip the ResNet-50 / ViT rows")
    p.add_argument("--models-only", action="store_true", help="only the ResNet-50 / ViT rows")
    p.add_argument("--dtypes", default="f32,bf16", help="the model rows' dtypes")
    args = p.parse_args()
    import torch
    import torch.nn.functional as F

    import rlx_numba as rlx
    from rlx_numba import cublas
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rng = np.random.default_rng(0)
    print(f"GPU: {torch.cuda.get_device_name()}   torch {torch.__version__}   f32, TF32 off\n")
    print(f"{'layer':<44} {'rel':>8} {'ours us':>9} {'torch us':>9} {'ratio':>6}  steps (us)")
    results = []
    out = Results(args.out, gpu=torch.cuda.get_device_name(), rows=results)
    if not args.models_only:
        op_rows(rlx, torch, F, cublas, rng, results, out.save)
    if not args.no_models:
        print(f"\n{'model, batch 32, 224 x 224':<44} {'rel':>8} {'ours img/s':>11} "
              f"{'torch img/s':>11} {'ratio':>6}")
        for dtype in args.dtypes.split(","):
            for arch in ("resnet50", "vit_b_16"):
                r = model_row(rlx, torch, arch, 32, dtype)
                print(f"{r['layer']:<44} {r['rel']:8.1e} {r['rlx_per_s']:11.0f} "
                      f"{r['torch_per_s']:11.0f} {r['ratio']:6.2f}", flush=True)
                results.append(r)
                out.save()
    out.done()


if __name__ == "__main__":
    main()
