"""ONNX models through rlx.onnx beside onnxruntime and the torch model (issue 35's acceptance).

Four models with random weights -- torchvision ResNet-18 and ViT-B/16 at 224 (ViT's zero-
initialised head re-drawn, else every output is 0 and the errors 0/0), a bert-base-sized
transformers BertModel (seq 128, sample 0 padded after 100 tokens; last_hidden_state) and a small
transformers LlamaForCausalLM (hidden 512, 4 layers, 8 heads, 4 KV heads, seq 128, the same
padding, use_cache=False; logits) -- each exported twice in this process from the CPU model:
TorchScript at opset 17 and dynamo at opset 18. Batch 8, f32, TF32 off in torch and in rlx.

Per row: ``rel ort`` = max |rlx - ort| / max |ort| (bar <= 1e-4), ``rel torch`` the same against
the torch model on the GPU; ms per batch of rlx's compiled executable on device inputs
(``dev``: exe.run(outputs="view"), the figure compared with torch), of ``m.run(feeds)`` host
to host (``run``), torch eager on device tensors, onnxruntime (CPU provider, the image has no
other: printed, no bar); ``x torch`` = torch ms / rlx dev ms (bar >= 1.0). PASS needs both bars;
a model that cannot be exported, loaded or run is a row saying why, not passing. rlx compiles
with ``--exec-mode`` (default graph: one CUDA graph replay a run).

ViT's TorchScript export runs with torch's MHA fast path off (aten::_native_multi_head_attention
has no ONNX symbolic); Llama gets an explicit attention_mask (without one transformers' mask
code calls aten::diff, which the TorchScript exporter lacks), falling back to
attn_implementation="eager" for an export that still fails.

  python bench/bench_onnx.py [--only bert,llama:ts17] [--exec-mode stream] [--batch 8]
                             [--out bench/results/onnx.json]
"""
from __future__ import annotations

import argparse
import contextlib
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Results, dist_version, free_device_memory  # noqa: E402

MODELS = ("resnet18", "vit_b_16", "bert", "llama")
EXPORTERS = (("ts17", 17, False), ("dyn18", 18, True))
REL_BAR, SPEED_BAR = 1e-4, 1.0
SEQ, PAD_FROM = 128, 100
BERT = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
            intermediate_size=3072, vocab_size=30522, max_position_embeddings=512)
LLAMA = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             intermediate_size=1536, vocab_size=32000, max_position_embeddings=512)


def timed_ms(fn, sync, budget_s=0.4, repeats=3) -> float:
    """ms per call of fn(): 2 warm-ups, then as many calls as fit ``budget_s`` (3 to 50) per
    repeat, synchronised at each repeat's end; best of ``repeats``."""
    for _ in range(2):
        fn()
    sync()
    t = time.perf_counter()
    fn()
    sync()
    iters = int(min(50, max(3, budget_s / max(time.perf_counter() - t, 1e-6))))
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t) * 1e3 / iters)
    return best


def best_single_ms(fn, n=3) -> float:
    """ms of the fastest of ``n`` calls (onnxruntime on the CPU: ~0.1-1 s a call here)."""
    best = math.inf
    for _ in range(n):
        t = time.perf_counter()
        fn()
        best = min(best, (time.perf_counter() - t) * 1e3)
    return best


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return math.inf
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


class Wrap:
    """forward(ids, mask) -> one tensor (last_hidden_state or logits): one ONNX output."""

    @staticmethod
    def make(torch, m, field, **kw):
        class W(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.m = m

            def forward(self, ids, mask):
                return getattr(self.m(input_ids=ids, attention_mask=mask, **kw), field)
        return W().eval()


def build(torch, name, batch):
    """(CPU model, CPU args, ONNX input names)."""
    torch.manual_seed(0)
    if name in ("resnet18", "vit_b_16"):
        import torchvision
        m = getattr(torchvision.models, name)(weights=None).eval()
        if name == "vit_b_16":      # torchvision zero-initialises the head
            torch.nn.init.normal_(m.heads.head.weight, std=0.02)
            torch.nn.init.normal_(m.heads.head.bias, std=0.02)
        return m, (torch.randn(batch, 3, 224, 224),), ["x"]
    import transformers
    mask = torch.ones(batch, SEQ, dtype=torch.int64)
    mask[0, PAD_FROM:] = 0
    if name == "bert":
        cfg = transformers.BertConfig(**BERT)
        m = Wrap.make(torch, transformers.BertModel(cfg).eval(), "last_hidden_state")
        ids = torch.randint(0, BERT["vocab_size"], (batch, SEQ))
    else:
        cfg = transformers.LlamaConfig(**LLAMA)
        m = Wrap.make(torch, transformers.LlamaForCausalLM(cfg).eval(), "logits",
                      use_cache=False)
        ids = torch.randint(0, LLAMA["vocab_size"], (batch, SEQ))
    return m, (ids, mask), ["input_ids", "attention_mask"]


@contextlib.contextmanager
def export_setup(torch, name, exp, eager_attn):
    """Switches an export needs, undone after it."""
    undo = []
    if name == "vit_b_16" and exp == "ts17" and hasattr(torch.backends, "mha"):
        was = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)
        undo.append(lambda: torch.backends.mha.set_fastpath_enabled(was))
    if eager_attn is not None:
        inner = eager_attn.m
        old = inner.config._attn_implementation
        _set_attn(inner, "eager")
        undo.append(lambda: _set_attn(inner, old))
    try:
        yield
    finally:
        for u in undo:
            u()


def _set_attn(model, impl):
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(impl)
    else:
        model.config._attn_implementation = impl


def export(torch, name, model, args, names, exp, opset, dynamo, path):
    """Export to ``path``; returns a note (how it was exported). Raises with the reasons of
    every attempt when none worked."""
    attempts = [None] + ([model] if name in ("bert", "llama") else [])
    errors = []
    for eager_attn in attempts:
        try:
            with export_setup(torch, name, exp, eager_attn), torch.no_grad():
                torch.onnx.export(model, args, str(path), dynamo=dynamo, opset_version=opset,
                                  input_names=names)
            return "attn_implementation=eager" if eager_attn is not None else ""
        except Exception as e:  # noqa: BLE001 - reported in the row
            errors.append(f"{'eager attention: ' if eager_attn is not None else ''}"
                          f"{type(e).__name__}: {_last_line(e)}")
    raise RuntimeError("; ".join(errors))


def _last_line(e) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else repr(e))[:300]


def run_row(torch, cuda, rlx, ort, onnx, key, path, feeds, ref, torch_ms, args):
    """One exported model through rlx and onnxruntime; the row (fields named for
    bench/report.py: rlx_ms beside torch_ms, ratio, bar, pass)."""
    t0 = time.perf_counter()
    m = rlx.onnx.load(onnx.load(str(path)), exec_mode=args.exec_mode)
    feeds = {n: feeds[n] for n in m.input_names}
    (y,) = m.run(feeds)
    first_s = time.perf_counter() - t0
    exe = m.executable
    dev = {n: cuda.to_device(feeds[n]) for n in m.device_inputs}
    # views into the executable's arena: no output allocation or copy a run (torch's eager
    # call takes its outputs from its caching allocator)
    dev_ms = timed_ms(lambda: exe.run(dev, outputs="view"), cuda.synchronize)
    run_ms = timed_ms(lambda: m.run(feeds), cuda.synchronize)
    del m, exe, dev
    rel_ort = rel_ort_torch = ort_ms = math.nan
    if ort is not None:
        s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        of = {i.name: feeds[i.name] for i in s.get_inputs()}
        (yo,) = s.run(None, of)
        rel_ort, rel_ort_torch = rel(y, yo), rel(yo, ref)
        ort_ms = best_single_ms(lambda: s.run(None, of))
    ratio = torch_ms / dev_ms
    row = dict(model=key, batch=args.batch, rlx_ms=dev_ms, torch_ms=torch_ms, ratio=ratio,
               bar=f"rel ort <= {REL_BAR:g}, >= {SPEED_BAR:g}x torch eager",
               pass_=bool(rel_ort <= REL_BAR and ratio >= SPEED_BAR), rel_ort=rel_ort,
               rel_torch=rel(y, ref), rel_ort_torch=rel_ort_torch, rlx_host_run_ms=run_ms,
               ort_cpu_ms=ort_ms, rlx_first_run_s=first_s, exec_mode=args.exec_mode)
    row["pass"] = row.pop("pass_")
    if ort is None:
        row["note"] = "onnxruntime not importable: no rel ort"
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path,
                   default=Path(__file__).resolve().parent / "results" / "onnx.json")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--exec-mode", default="graph")
    p.add_argument("--only", default="", help="comma list of model or model:exporter")
    args = p.parse_args(argv)
    import torch
    import onnx
    import rlx_numba as rlx
    import rlx_numba.cublas
    from numba import cuda
    try:
        import onnxruntime as ort
    except ImportError:
        ort = None
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    rlx_numba.cublas.allow_tf32 = False
    want = [s for s in args.only.split(",") if s]

    def picked(name, exp=None):
        return not want or any(w in (name, f"{name}:{exp}") or (exp is None and
                               w.startswith(name + ":")) for w in want)

    print(f"torch {torch.__version__}, onnx {onnx.__version__}, onnxruntime "
          f"{getattr(ort, '__version__', 'absent')} {ort.get_available_providers() if ort else ''}"
          f", transformers {dist_version('transformers')}, {torch.cuda.get_device_name()}; "
          f"batch {args.batch}, f32, TF32 off, rlx exec_mode {args.exec_mode}")
    hdr = (f"{'model':16} {'rel ort':>9} {'rel torch':>9} {'rlx dev':>8} {'rlx run':>8} "
           f"{'torch':>8} {'ort cpu':>8} {'x torch':>7}")
    print(hdr + "   (ms per batch)")
    rows = []
    out = Results(args.out, gpu=torch.cuda.get_device_name(), rows=rows)

    def record(row):         # the JSON rewritten after every row: a timeout keeps the rows
        rows.append(row)
        out.save()

    tmp = Path(tempfile.mkdtemp(prefix="bench_onnx_"))
    for name in MODELS:
        if not picked(name):
            continue
        t_model = time.perf_counter()
        try:
            model, targs, names = build(torch, name, args.batch)
        except Exception as e:  # noqa: BLE001 - a row that says why (e.g. no transformers)
            for exp, _, _ in EXPORTERS:
                if picked(name, exp):
                    record(dict(model=f"{name}_{exp}", batch=args.batch,
                                error=f"model build failed: {type(e).__name__}: {e}",
                                **{"pass": False}))
                    print(f"{name + '_' + exp:16} FAIL  model build failed: {e}", flush=True)
            continue
        feeds = {n: a.numpy() for n, a in zip(names, targs)}
        files = {}
        for exp, opset, dynamo in EXPORTERS:
            if not picked(name, exp):
                continue
            key = f"{name}_{exp}"
            t = time.perf_counter()
            try:
                note = export(torch, name, model, targs, names, exp, opset, dynamo,
                              tmp / f"{key}.onnx")
                files[key] = (tmp / f"{key}.onnx", note, time.perf_counter() - t)
            except Exception as e:  # noqa: BLE001 - a row that says why
                record(dict(model=key, batch=args.batch, error=f"export failed: {e}",
                            **{"pass": False}))
                print(f"{key:16} FAIL  export failed: {e}", flush=True)
        if not files:
            continue
        model = model.cuda()
        cargs = tuple(a.cuda() for a in targs)
        with torch.no_grad():
            ref = model(*cargs).float().cpu().numpy()
            torch_ms = timed_ms(lambda: model(*cargs), torch.cuda.synchronize)
        for key, (path, note, export_s) in files.items():
            try:
                row = run_row(torch, cuda, rlx, ort, onnx, key, path, feeds, ref, torch_ms, args)
            except Exception as e:  # noqa: BLE001 - a row that says why
                traceback.print_exc()
                row = dict(model=key, batch=args.batch, torch_ms=torch_ms,
                           error=f"rlx failed: {type(e).__name__}: {_last_line(e)}",
                           **{"pass": False})
            row["export_s"] = export_s
            if note:
                row["note"] = "; ".join(filter(None, (row.get("note"), note)))
            record(row)
            if "error" in row:
                print(f"{key:16} FAIL  {row['error']}", flush=True)
                continue
            print(f"{key:16} {row['rel_ort']:9.1e} {row['rel_torch']:9.1e} "
                  f"{row['rlx_ms']:8.2f} {row['rlx_host_run_ms']:8.2f} {torch_ms:8.2f} "
                  f"{row['ort_cpu_ms']:8.1f} {row['ratio']:7.2f}  "
                  f"{'PASS' if row['pass'] else 'FAIL'}  (export {export_s:.1f} s, rlx first run "
                  f"{row['rlx_first_run_s']:.1f} s{'; ' + note if note else ''})", flush=True)
            free_device_memory(cuda, torch)
        del model, cargs
        free_device_memory(cuda, torch)
        print(f"  ({name}: {time.perf_counter() - t_model:.0f} s)", flush=True)
    n_pass = sum(r["pass"] for r in rows)
    print(f"\nPASS {n_pass} of {len(rows)} rows (bars: rel ort <= {REL_BAR:g}, rlx dev >= "
          f"{SPEED_BAR:g}x torch eager)")
    out.done()
    return 0 if rows and n_pass == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
