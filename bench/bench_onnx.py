"""ONNX models through rlx.onnx beside torch (and onnxruntime when importable), issue 35's bench.

torchvision's ResNet-18 and a small transformers BERT (random weights) are exported in this
process with torch.onnx.export at opset 17, loaded with rlx.onnx.load, run at batch 8 and
compared with the torch model's outputs (``rel`` = max |ours - torch| / max |torch|), then timed:
ours as ``m.run(feeds)`` (host numpy in and out, as a user calls it) and as the compiled
executable's device run (``exe.run(..., outputs="device")`` on device inputs), torch eager on
device tensors, onnxruntime (CUDA provider when present) on host arrays. ms per batch, mean of
20 after 3 warm-ups, best of 3.

  python bench/bench_onnx.py [--out bench/results/onnx.json] [--batch 8]
"""
from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import time_torch, write_results  # noqa: E402


def wall_ms(fn, iters=20, warmup=3, repeats=3, sync=None) -> float:
    for _ in range(warmup):
        fn()
    if sync:
        sync()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        if sync:
            sync()
        best = min(best, (time.perf_counter() - t) * 1e3 / iters)
    return best


def export(torch, model, args, names, dynamic=None) -> bytes:
    f = io.BytesIO()
    kw = dict(opset_version=17, input_names=names, dynamic_axes=dynamic)
    try:     # the TorchScript exporter (torch >= 2.5 defaults to the dynamo one)
        torch.onnx.export(model, args, f, dynamo=False, **kw)
    except TypeError:
        torch.onnx.export(model, args, f, **kw)
    return f.getvalue()


def models(torch, batch):
    import torchvision
    rn = torchvision.models.resnet18(weights=None).eval().cuda()
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    yield "resnet18", rn, (x,), ["input.1"]
    from transformers import BertConfig, BertModel
    cfg = BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                     intermediate_size=1024, vocab_size=8000)
    bert = BertModel(cfg).eval().cuda()
    ids = torch.randint(0, 8000, (batch, 128), device="cuda")
    mask = torch.ones(batch, 128, dtype=torch.int64, device="cuda")

    class Wrap(torch.nn.Module):      # last_hidden_state only: one output
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, i, a):
            return self.m(input_ids=i, attention_mask=a).last_hidden_state
    yield "bert-small", Wrap(bert).eval(), (ids, mask), ["input_ids", "attention_mask"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path,
                   default=Path(__file__).resolve().parent / "results" / "onnx.json")
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args(argv)
    import torch
    import onnx
    import rlx_numba as rlx
    from numba import cuda
    try:
        import onnxruntime as ort
    except ImportError:
        ort = None
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rows = []
    print(f"{'model':12} {'rel':>9} {'rlx run ms':>11} {'rlx dev ms':>11} {'torch ms':>9} "
          f"{'ort ms':>8}")
    for name, model, targs, names in models(torch, args.batch):
        with torch.no_grad():
            ref = model(*targs).float().cpu().numpy()
            blob = export(torch, model, targs, names)
        feeds = {n: a.cpu().numpy() for n, a in zip(names, targs)}
        m = rlx.onnx.load(onnx.load_from_string(blob))
        t0 = time.perf_counter()
        (y,) = m.run(feeds)
        first_s = time.perf_counter() - t0
        rel = float(np.abs(y - ref).max() / max(np.abs(ref).max(), 1e-30))
        run_ms = wall_ms(lambda: m.run(feeds))
        exe = m.executable
        dev = {n: cuda.to_device(feeds[n]) for n in m.device_inputs}
        dev_ms = wall_ms(lambda: exe.run(dev, outputs="device"), sync=cuda.synchronize)
        with torch.no_grad():
            torch_ms = time_torch(torch, lambda: model(*targs), 20, 3, 3)
        ort_ms = None
        if ort is not None:
            prov = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider")
                    if p in ort.get_available_providers()]
            s = ort.InferenceSession(blob, providers=prov)
            ort_ms = wall_ms(lambda: s.run(None, feeds))
        print(f"{name:12} {rel:9.2e} {run_ms:11.2f} {dev_ms:11.2f} {torch_ms:9.2f} "
              f"{ort_ms if ort_ms is not None else float('nan'):8.2f}  (first run "
              f"{first_s:.1f} s incl. compile)")
        rows.append(dict(model=name, batch=args.batch, rel=rel, rlx_run_ms=run_ms,
                         rlx_device_ms=dev_ms, torch_ms=torch_ms, ort_ms=ort_ms,
                         first_run_s=first_s, ok=rel < 1e-3))
    write_results(args.out, torch, rows)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
