"""Training beside PyTorch, f32, same process, the same weights and batches on both sides.

Llama (SmolLM2-135M's config), batch 8 x seq 256: one AdamW step (forward + backward +
update; LlamaForCausalLM.trainer) in tokens/s vs transformers' LlamaForCausalLM (loss =
model(input_ids, labels=ids).loss, torch.optim.AdamW, zero_grad(set_to_none)) eager, and
torch.compile of the model where it works. Bar: >= 1.0x torch eager. The first step's loss
(before any update, same weights) must agree within 1e-3 relative.
Memory of that step: our device bytes (free memory before the trainer is built minus free
memory after a few steps, everything alive: weights, AdamW state, arena, graphs) vs torch's
torch.cuda.max_memory_allocated over building the model on the device and the same steps.
Bar: ours <= torch's.
MiniLM-L6 (all-MiniLM-L6-v2's config), batch 32 x seq 128: one AdamW step of the encoder
with a linear 2-class head on the [CLS] embedding and cross-entropy (BertModel.trainer; torch:
transformers' BertModel without pooler, dropout 0, the same nn.Linear head), sentences/s; no
bar (the loss must agree).
Attention backward alone, causal, B8 H32 S{1024, 4096} D{64, 128}: the nodes
g.grad(attention(q, k, v), [q, k, v], seed=dO) appends (log-sum-exp, delta, dQ, dK/dV
kernels; the forward runs once before, outside the timed window) vs torch's SDPA backward
(torch.autograd.grad(out, (q, k, v), dO) of one retained forward). TFLOP/s counts 2.5x the
causal forward, 5 * B * H * S^2 * D, for both. Bar: >= 0.5x torch.
Timing: wall clock (perf_counter around whole steps, synchronised) for the train steps, best of
3 (our step returns its loss on the host every call; torch's is not synchronised per step);
CUDA events for the attention backward, as bench_attention.

The Llama step runs at each --precision (default f32, then bf16): bf16 / f16 with precision=
beside torch under autocast (GradScaler for f16). Bars: >= 1.3x torch eager and >= 1.0x
torch.compile.

  python bench/bench_train.py [--only llama|bert|attention] [--no-compile] [--iters 5]
                              [--precision f32,bf16]
                              [--profile] [--exec-mode graph] [--out bench/results/train.json]
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Results, dist_version, free_device_memory, time_rlx, time_torch  # noqa: E402
from bench_models import MINILM, SMOLLM2, hf_llama_config, load_torch, settle, wall  # noqa: E402

LLAMA_SHAPE = (8, 256)
BERT_SHAPE = (32, 128)
ATTN = [(8, 32, 1024, 64), (8, 32, 1024, 128), (8, 32, 4096, 64), (8, 32, 4096, 128)]
LR, WD = 1e-4, 0.01             # AdamW's, both sides (betas and eps: torch's defaults)
LOSS_RTOL = 1e-3
WINDOW_MS = 5.0


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def torch_steps(torch, step, model, args, what):
    """torch's side of a train-step row: the first step's loss, the eager step's wall time, the
    peak bytes allocated up to then, and torch.compile's step time (nan: off, or it failed)."""
    loss0 = step(model).item()
    t_eager = wall(lambda: step(model), torch.cuda.synchronize, args.iters)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    t_comp = math.nan
    if args.compile:
        try:
            comp = torch.compile(model)
            t_comp = wall(lambda: step(comp), torch.cuda.synchronize, args.iters)
        except Exception as e:  # noqa: BLE001 - "where it works"
            print(f"  torch.compile failed on the {what} train step: {type(e).__name__}: {e}")
    return loss0, t_eager, t_comp, peak


def bench_llama(torch, transformers, rlx, args, rows, precision):
    from rlx_numba.models import LlamaConfig, LlamaForCausalLM
    b, s = LLAMA_SHAPE
    ctx = args.cuda.current_context()
    ours = LlamaForCausalLM.from_config(LlamaConfig(**SMOLLM2), seed=0)
    ids = np.random.default_rng(3).integers(0, SMOLLM2["vocab_size"], (b, s)).astype(np.int64)

    # ours: device bytes of the whole trainer (nothing else of ours is alive)
    free_device_memory(args.cuda, torch)
    settle(ctx)
    free0 = ctx.get_memory_info()[0]
    tr = ours.trainer(b, s, rlx.optim.AdamW(lr=LR, weight_decay=WD), exec_mode=args.exec_mode,
                      precision=precision)
    loss0 = tr.step(ids)            # compiles (and captures the graph); the loss before updating
    t_rlx = wall(lambda: tr.step(ids), lambda: None, args.iters)
    settle(ctx)
    used = free0 - ctx.get_memory_info()[0]
    report = tr.trainer.memory_report()
    if args.profile:
        print_top(tr.trainer.profile({"input_ids": ids.astype(np.int32), "labels": ids}), 25)
    print(f"\nrlx train step memory (SmolLM2-135M config, batch {b} x seq {s}):\n{report}")
    del tr
    ours._exes.clear()
    settle(ctx)

    # torch eager: the same weights (from the model's host params, which no step changed)
    free_device_memory(args.cuda, torch)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    hf = load_torch(torch, transformers.LlamaForCausalLM(hf_llama_config(transformers, SMOLLM2)),
                    ours.params).cuda().train()
    opt = torch.optim.AdamW(hf.parameters(), lr=LR, weight_decay=WD)
    tids = torch.from_numpy(ids).cuda()

    half = {"bf16": torch.bfloat16, "f16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler("cuda") if precision == "f16" else None

    def torch_step(model):        # autocast (and GradScaler for f16), as a torch user trains
        with torch.autocast("cuda", half or torch.float32, enabled=half is not None):
            loss = model(input_ids=tids, labels=tids, use_cache=False).loss
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)
        return loss

    tloss0, t_eager, t_comp, peak = torch_steps(torch, torch_step, hf, args, "Llama")
    peak -= base
    del hf, opt, tids
    free_device_memory(args.cuda, torch)

    tokens = b * s
    ratio = t_eager / t_rlx
    dl = _rel(loss0, tloss0)
    # f32: >= 1.0x eager; half: >= 1.3x eager autocast and >= 1.0x torch.compile (when run)
    bar = 1.0 if precision == "f32" else 1.3
    rtol = LOSS_RTOL if precision == "f32" else 2e-2     # half logits round differently
    r = dict(case="llama train step", precision=precision, batch=b, seq=s,
             rlx_tok_s=tokens / t_rlx, eager_tok_s=tokens / t_eager,
             compile_tok_s=tokens / t_comp, ratio=ratio, compile_ratio=t_comp / t_rlx, bar=bar,
             rlx_loss0=loss0, torch_loss0=tloss0, loss_rel_diff=dl,
             exec_mode=str(args.exec_mode))
    r["pass"] = bool(ratio >= bar and dl <= rtol and not (
        precision != "f32" and t_comp / t_rlx < 1.0))
    rows.append(r)
    m = dict(case="llama train step memory", precision=precision, batch=b, seq=s,
             rlx_bytes=int(used),
             torch_bytes=int(peak),
             ratio=used / peak, bar="<= 1.0x torch",
             **{k: int(report[k]) for k in ("arena_bytes", "trained_param_bytes",
                                            "optimizer_state_bytes", "grad_bytes",
                                            "saved_for_backward_bytes")})
    m["pass"] = bool(used <= peak)
    rows.append(m)
    print(f"\n{'SmolLM2-135M config, AdamW':<30} {'rlx tok/s':>10} {'eager':>9} {'compile':>9} "
          f"{'x eager':>8}  bar   loss0 rlx / torch")
    print(f"  train step b{b} x s{s:<14} {r['rlx_tok_s']:10.0f} {r['eager_tok_s']:9.0f} "
          f"{r['compile_tok_s']:9.0f} {ratio:8.2f}  {bar}x  {loss0:.5f} / {tloss0:.5f} "
          f"{'PASS' if r['pass'] else 'FAIL'}")
    print(f"  peak device bytes            {_mib(used):>10} {_mib(peak):>9} {'':>9} "
          f"{used / peak:8.2f}  <=1.0x torch  {'PASS' if m['pass'] else 'FAIL'}", flush=True)


def bench_bert(torch, transformers, rlx, args, rows):
    from rlx_numba.models import BertConfig, BertModel
    F = torch.nn.functional
    b, s = BERT_SHAPE
    nl = 2
    rng = np.random.default_rng(4)
    ids = rng.integers(1000, 30000, (b, s)).astype(np.int64)
    mask = np.ones((b, s), bool)
    types = np.zeros((b, s), np.int64)
    labels = rng.integers(0, nl, b).astype(np.int64)
    head = {"classifier.weight": (0.02 * rng.standard_normal((nl, MINILM["hidden_size"])))
            .astype(np.float32), "classifier.bias": np.zeros(nl, np.float32)}

    ours = BertModel.from_config(BertConfig(**MINILM), seed=0)
    tr = ours.trainer(b, s, rlx.optim.AdamW(lr=LR, weight_decay=WD), num_labels=nl,
                      pooling=("cls",), head=head, exec_mode=args.exec_mode)
    loss0 = tr.step(ids, labels, mask, types)
    t_rlx = wall(lambda: tr.step(ids, labels, mask, types), lambda: None, args.iters)
    del tr
    ours._exes.clear()
    free_device_memory(args.cuda, torch)

    cfg = transformers.BertConfig(**MINILM, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    hf = load_torch(torch, transformers.BertModel(cfg, add_pooling_layer=False), ours.params)
    hf = hf.cuda().train()
    lin = torch.nn.Linear(MINILM["hidden_size"], nl).cuda()
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(head["classifier.weight"]))
        lin.bias.copy_(torch.from_numpy(head["classifier.bias"]))
    opt = torch.optim.AdamW(list(hf.parameters()) + list(lin.parameters()), lr=LR,
                            weight_decay=WD)
    tids, tmask, ttypes, tlab = (torch.from_numpy(a).cuda() for a in
                                 (ids, mask.astype(np.int64), types, labels))

    def torch_step(model):
        h = model(input_ids=tids, attention_mask=tmask, token_type_ids=ttypes).last_hidden_state
        loss = F.cross_entropy(lin(h[:, 0]), tlab)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    tloss0, t_eager, t_comp, _ = torch_steps(torch, torch_step, hf, args, "BERT")
    del hf, lin, opt
    free_device_memory(args.cuda, torch)
    ratio = t_eager / t_rlx
    dl = _rel(loss0, tloss0)
    r = dict(case="minilm train step", batch=b, seq=s, rlx_sent_s=b / t_rlx,
             eager_sent_s=b / t_eager, compile_sent_s=b / t_comp, ratio=ratio,
             compile_ratio=t_comp / t_rlx, bar=None, rlx_loss0=loss0, torch_loss0=tloss0,
             loss_rel_diff=dl, exec_mode=str(args.exec_mode))
    r["pass"] = bool(dl <= LOSS_RTOL)
    rows.append(r)
    print(f"\n{'MiniLM-L6 config, AdamW, CLS head':<30} {'rlx sent/s':>10} {'eager':>9} "
          f"{'compile':>9} {'x eager':>8}  bar   loss0 rlx / torch")
    print(f"  train step b{b} x s{s:<14} {r['rlx_sent_s']:10.0f} {r['eager_sent_s']:9.0f} "
          f"{r['compile_sent_s']:9.0f} {ratio:8.2f}   -    {loss0:.5f} / {tloss0:.5f} "
          f"{'PASS' if r['pass'] else 'FAIL'}", flush=True)


def print_top(prof, n):
    """A profiled step's time summed by kernel (or library call), the n largest."""
    by = {}
    for r in prof:
        t, c = by.get(r.kernel, (0.0, 0))
        by[r.kernel] = (t + r.ms, c + 1)
    print(f"\n{prof.graph_name}: {len(prof)} steps, {prof.total_ms:.2f} ms; top kernels")
    for k, (t, c) in sorted(by.items(), key=lambda kv: -kv[1][0])[:n]:
        print(f"  {t:9.3f} ms {100 * t / prof.total_ms:5.1f}%  x{c:<4} {k[:90]}")


def _iters(iters: int, est_ms: float) -> int:
    """Launches a timed window: ``iters``, or more when that would last under WINDOW_MS."""
    return max(iters, min(1000, int(WINDOW_MS / max(est_ms, 1e-4))))


def bench_attention_bwd(torch, rlx, args, rows):
    F = torch.nn.functional
    cuda = args.cuda
    print(f"\n{'attention backward (causal)':<30} {'rlx TFLOP/s':>11} {'torch TFLOP/s':>13} "
          f"{'ratio':>6}  bar  rel err  rlx kernels (ms)")
    for b, h, s, d in ATTN:
        g = rlx.Graph("attn_bwd")
        q, k, v = (g.input(n, (b, h, s, d)) for n in ("q", "k", "v"))
        dout = g.input("dO", (b, h, s, d))
        out = g.attention(q, k, v, causal=True)
        n_fwd = len(g.nodes)
        # out an output too: kept to the end of a run, so the backward-only launches below
        # read the forward's values
        g.set_outputs(g.grad(out, [q, k, v], seed=dout) + [out])
        exe = rlx.compile(g)
        gen = torch.Generator(device="cuda").manual_seed(0)
        tq, tk, tv, tdo = (torch.randn(b, h, s, d, device="cuda", generator=gen)
                           for _ in range(4))
        for t in (tq, tk, tv):
            t.requires_grad_(True)
        tout = F.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
        tfn = lambda: torch.autograd.grad(tout, (tq, tk, tv), tdo, retain_graph=True)  # noqa: E731
        ref = tfn()
        torch.cuda.synchronize()
        views = exe.run({"q": tq.detach(), "k": tk.detach(), "v": tv.detach(), "dO": tdo},
                        outputs="view")
        err = max(((torch.as_tensor(vw, device="cuda") - r).abs().max() / r.abs().max()).item()
                  for vw, r in zip(views, ref))
        # the backward: the steps of the nodes grad appended (the forward ran in the run above)
        bwd = [(nid, st) for nid, st in exe._node_steps.items() if nid >= n_fwd and st]
        steps = [x for _, st in bwd for x in st]

        def launch(steps=steps):
            for x in steps:
                x()
        est = time_rlx(cuda, launch, exe.stream, 2, 1, 1)
        rlx_ms = time_rlx(cuda, launch, exe.stream, _iters(args.iters, est), 2, 3)
        parts = []
        for nid, st in bwd:          # each kernel of the backward alone
            one = lambda st=st: [x() for x in st]  # noqa: E731
            ms = time_rlx(cuda, one, exe.stream, max(2, args.iters // 2), 1, 2)
            if ms > 0.01 * rlx_ms:
                parts.append(f"{exe.graph.nodes[nid].op.removeprefix('attention_')} {ms:.2f}")
        torch_ms = time_torch(torch, tfn, _iters(args.iters, time_torch(torch, tfn, 2, 1, 1)),
                              2, 3)
        flops = 5.0 * b * h * s * s * d
        ratio = torch_ms / rlx_ms
        r = dict(case="attention backward", shape=f"B{b} H{h} S{s} D{d}", causal=True,
                 rlx_ms=rlx_ms, torch_ms=torch_ms, rlx_tflops=flops / rlx_ms / 1e9,
                 torch_tflops=flops / torch_ms / 1e9, ratio=ratio, bar=0.5, rel_err=err,
                 kernels=[x.kernel_name for x in steps], parts=parts)
        r["pass"] = bool(ratio >= 0.5 and err < 1e-3)
        rows.append(r)
        print(f"  {r['shape']:<28} {r['rlx_tflops']:11.1f} {r['torch_tflops']:13.1f} "
              f"{ratio:6.2f}  {'PASS' if r['pass'] else 'FAIL'} {err:.1e}  {', '.join(parts)}",
              flush=True)
        del exe, views, tq, tk, tv, tdo, tout, ref
        free_device_memory(cuda, torch)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=["llama", "bert", "attention"])
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--iters", type=int, default=5, help="steps a timed window (train steps)")
    p.add_argument("--profile", action="store_true",
                   help="print the Llama train step's time by kernel (one profiled step)")
    p.add_argument("--exec-mode", default="graph", help="the trainers' exec_mode")
    p.add_argument("--precision", default="f32,bf16",
                   help="the Llama step's precision= values, comma-separated, of f32, bf16, "
                        "f16 (torch: autocast, GradScaler for f16)")
    p.add_argument("--out", type=Path,
                   default=Path(__file__).resolve().parent / "results" / "train.json")
    args = p.parse_args(argv)
    precisions = args.precision.split(",")
    if not precisions or set(precisions) - {"f32", "bf16", "f16"}:
        p.error(f"--precision: comma-separated f32, bf16, f16; got {args.precision!r}")
    import rlx_numba as rlx
    if rlx.simulator_enabled():
        print("bench_train: no CUDA GPU here (simulator); this benchmark needs a GPU. "
              "Nothing measured.")
        return 0
    import torch
    import transformers
    from numba import cuda
    args.cuda = cuda
    torch.backends.cuda.matmul.allow_tf32 = False     # f32 on both sides
    torch.backends.cudnn.allow_tf32 = False
    gpu = torch.cuda.get_device_name()
    print(f"GPU: {gpu}   torch {torch.__version__}   transformers {transformers.__version__}   "
          f"numba-cuda {dist_version('numba-cuda')}   exec {args.exec_mode}   AdamW lr {LR} "
          f"wd {WD}")
    rows = []
    out = Results(args.out, gpu=gpu, exec_mode=str(args.exec_mode), lr=LR, weight_decay=WD,
                  results=rows)
    sections = [*(("llama", lambda pr=pr: bench_llama(torch, transformers, rlx, args, rows, pr))
                  for pr in precisions),
                ("bert", lambda: bench_bert(torch, transformers, rlx, args, rows)),
                ("attention", lambda: bench_attention_bwd(torch, rlx, args, rows))]
    out.run_parts(sections, args.only, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
