"""Several GPUs through NCCL beside torch.distributed in the same processes (issue 21's bench).
Run one process per GPU:

  rlx-numba launch --gpus 2 bench/bench_distributed.py [--skip allreduce,tp,dp] [--out F]
  (or python -m rlx_numba.cli launch ... from a source tree)

  all_reduce (sum, f32) of 1 MB .. 1 GB: our graph's all_reduce step (ncclAllReduce on the
    executable's stream) against torch.distributed.all_reduce (NCCL), CUDA events over 20
    calls; bus bandwidth 2 (n - 1) / n x bytes / time, bar 0.9x torch;
  a Llama-3.2-1B-shaped config with random weights: logits of tensor_parallel=2 against the
    unsharded model (rank 0, tensor_parallel=1), bar 1e-4 relative; greedy decode tok/s at
    batch 1 and 8 (32 new tokens after an 8-token prompt, generate(), best of 2), bar TP=2 >=
    1.3x TP=1 at batch 8;
  a data-parallel training step of the SmolLM2-135M config (AdamW, batch 8 x 256 a GPU):
    samples/s on every GPU against one GPU alone, bar 1.7x.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Results, time_rlx, time_torch  # noqa: E402

LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                tie_word_embeddings=True)
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
               rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)


def say(comm, *a):
    if comm.rank == 0:
        print(*a, flush=True)


def allreduce_rows(rlx, torch, tdist, comm, cuda):
    rows, w = [], comm.world_size
    for mb in (1, 16, 256, 1024):
        n = mb * (1 << 20) // 4
        g = rlx.Graph("ar")
        g.set_outputs([g.all_reduce(g.input("x", (n,)))])
        exe = rlx.compile(g)
        x = np.full(n, comm.rank + 1, np.float32)
        got = exe.run({"x": x})[0]
        ok = bool((got == w * (w + 1) / 2).all())
        (step,) = [s for s in exe.steps if s.info.get("collective")]
        ours = time_rlx(cuda, step, exe.stream, 20, 3, 3)
        t = torch.full((n,), float(comm.rank + 1), device="cuda")
        theirs = time_torch(torch, lambda: tdist.all_reduce(t), 20, 3, 3)
        bus = 2 * (w - 1) / w * n * 4 / 1e9
        rows.append(dict(row=f"all_reduce {mb} MB", check=ok, rlx_ms=ours, torch_ms=theirs,
                         rlx_busbw=bus / (ours * 1e-3), torch_busbw=bus / (theirs * 1e-3),
                         ratio=theirs / ours))
        r = rows[-1]
        say(comm, f"{r['row']:<24} ok {ok}  ours {ours:8.3f} ms {r['rlx_busbw']:7.1f} GB/s  torch "
                  f"{theirs:8.3f} ms {r['torch_busbw']:7.1f} GB/s  ratio {r['ratio']:5.2f}")
        del exe
    return rows


def _decode_rate(model, ids, new=32):
    model.generate(ids, max_new_tokens=new)           # compile + warm
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new)
        best = min(best, time.perf_counter() - t0)
    return ids.shape[0] * new / best, out


def tp_rows(rlx, torch, tdist, comm):
    from rlx_numba.models import LlamaForCausalLM
    from rlx_numba.models.llama import LlamaConfig
    cfg = LlamaConfig(**LLAMA_1B)
    rng = np.random.default_rng(0)
    ids1, ids8 = rng.integers(0, cfg.vocab_size, (1, 8)), rng.integers(0, cfg.vocab_size, (8, 8))
    t0 = time.perf_counter()
    full = LlamaForCausalLM.from_config(cfg, seed=0).params       # every rank: same weights
    say(comm, f"(random 1B weights made in {time.perf_counter() - t0:.0f} s)")
    tp = LlamaForCausalLM(cfg, full, tensor_parallel=comm.world_size)
    logits_tp = tp(ids8)
    rate = {}
    for b, ids in ((1, ids1), (8, ids8)):
        rate[("tp", b)], gen_tp = _decode_rate(tp, ids)
    del tp
    rows = []
    tdist.barrier()
    if comm.rank == 0:      # the unsharded model alone on GPU 0 (no collectives)
        one = LlamaForCausalLM(cfg, full)
        logits_1 = one(ids8)
        for b, ids in ((1, ids1), (8, ids8)):
            rate[("one", b)], gen_1 = _decode_rate(one, ids)
        rel = float(np.abs(logits_tp - logits_1).max() / np.abs(logits_1).max())
        same = bool((gen_tp == gen_1).all())
        for b in (1, 8):
            rows.append(dict(row=f"Llama-3.2-1B config decode b{b}", tp=comm.world_size,
                             tp_tok_s=rate[("tp", b)], one_tok_s=rate[("one", b)],
                             ratio=rate[("tp", b)] / rate[("one", b)], rel=rel,
                             same_tokens_b8=same))
            r = rows[-1]
            say(comm, f"{r['row']:<32} TP={comm.world_size} {r['tp_tok_s']:8.1f} tok/s  TP=1 "
                      f"{r['one_tok_s']:8.1f} tok/s  ratio {r['ratio']:5.2f}  logits rel {rel:.1e}"
                      f"  same tokens (b8) {same}")
        del one
    tdist.barrier()
    return rows


def dp_rows(rlx, torch, tdist, comm, batch=8, seq=256, steps=5):
    from numba import cuda

    from rlx_numba.models import LlamaForCausalLM
    from rlx_numba.models.llama import LlamaConfig
    cfg = LlamaConfig(**SMOLLM2)
    rng = np.random.default_rng(comm.rank)
    ids = rng.integers(0, cfg.vocab_size, (batch, seq))

    def rate(data_parallel):
        m = LlamaForCausalLM.from_config(cfg, seed=0)
        tr = m.trainer(batch, seq, rlx.optim.AdamW(lr=1e-4), data_parallel=data_parallel)
        tr.step(ids)                                  # compile, capture
        cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = tr.step(ids)
        return batch * steps / (time.perf_counter() - t0), loss, tr
    rows = []
    many, loss, tr = rate(True)
    # every replica made the same updates (the averaged gradients): equal weights everywhere
    w = torch.tensor(tr.trainer.get_param("model.layers.0.mlp.down_proj.weight"), device="cuda")
    lo, hi = w.clone(), w.clone()
    tdist.all_reduce(lo, op=tdist.ReduceOp.MIN)
    tdist.all_reduce(hi, op=tdist.ReduceOp.MAX)
    same = bool(torch.equal(lo, hi))
    steps_info = [s.kernel_name for s in tr.trainer.exe.steps if "second stream" in s.kernel_name
                  or s.kernel_name.startswith("wait for")]
    del tr
    tdist.barrier()
    if comm.rank == 0:      # one GPU alone, the same batch (no collectives)
        one, _, _ = rate(False)
        total = many * comm.world_size
        rows.append(dict(row=f"SmolLM2-135M DP train step b{batch}x{seq} a GPU",
                         gpus=comm.world_size, dp_samples_s=total, one_samples_s=one,
                         ratio=total / one, loss=float(loss), replicas_equal=same,
                         overlap_steps=len(steps_info)))
        say(comm, f"{rows[-1]['row']:<40} {comm.world_size} GPUs {total:8.1f} samples/s  one GPU "
                  f"{one:8.1f} samples/s  ratio {total / one:5.2f}  replicas equal {same}  "
                  f"loss {float(loss):.3f}  ({len(steps_info)} overlap / join steps)")
    tdist.barrier()
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path,
                   default=Path(__file__).resolve().parent / "results" / "distributed.json")
    p.add_argument("--skip", default="", help="comma-separated: allreduce, tp, dp")
    args = p.parse_args()
    skip = set(args.skip.split(","))
    import torch
    import torch.distributed as tdist
    from numba import cuda

    import rlx_numba as rlx
    import rlx_numba.distributed  # noqa: F401
    comm = rlx.distributed.init()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", comm.rank)))
    port = int(os.environ.get("MASTER_PORT", 29500)) + 1
    tdist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank,
                             world_size=comm.world_size)
    torch.backends.cuda.matmul.allow_tf32 = False
    say(comm, f"GPUs: {comm.world_size} x {torch.cuda.get_device_name()}   torch "
              f"{torch.__version__}   NCCL {rlx.distributed.nccl.version()}\n")
    results = []
    out = Results(args.out, gpu=torch.cuda.get_device_name(), rows=results)
    parts = [("allreduce", lambda: allreduce_rows(rlx, torch, tdist, comm, cuda)),
             ("tp", lambda: tp_rows(rlx, torch, tdist, comm)),
             ("dp", lambda: dp_rows(rlx, torch, tdist, comm))]
    for name, rows in parts:
        if name not in skip:
            results += rows()
            if comm.rank == 0:          # a part's rows kept should a later one be stopped
                out.save()
    if comm.rank == 0:
        out.done()
    tdist.destroy_process_group()
    rlx.distributed.destroy()


if __name__ == "__main__":
    main()
