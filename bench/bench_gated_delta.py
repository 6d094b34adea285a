"""GatedDeltaNet beside PyTorch (same process): ``g.gated_delta_net`` (the chunked form: the
within-chunk parts as batched products over all chunks, one kernel for the state pass across
chunks) compiled in GRAPH mode, forward alone and forward + backward (rlx's ``g.grad`` in the
same graph: o and dq, dk, dv, dg, dbeta for an upstream dO), against transformers'
``torch_chunk_gated_delta_rule`` (Qwen3-Next's torch path; autograd for its backward), and
the decode step ``g.gated_delta_step`` against ``torch_recurrent_gated_delta_rule`` at T = 1.

Default B4 T4096 H16 Dk = Dv = 128, chunk 64, q/k l2 norm on (as Qwen3-Next calls it), f32 on
both sides (ours takes f32 only: half inputs are cast first, so there is no bf16 row). Bars:
>= 10x torch for the forward and for forward + backward (issue 33), >= 2x for the decode step.
Both sides must agree: max |ours - torch| / max |torch| <= 2e-3 on o and on every gradient
(both compute in f32 but solve the chunk's triangular system differently).

  python bench/bench_gated_delta.py [--batch 4] [--seq 4096] [--heads 16] [--dk 128]
      [--dv 128] [--tf32] [--profile] [--out bench/results/gated_delta.json]   (GPU only)

--tf32: TF32 products on both sides (torch.backends.cuda.matmul.allow_tf32 and
RLX_NUMBA_TF32's switch); --profile prints our forward's and training graph's per-step
profile (where the time goes); --scan-geometries "16,8,32 16,16,64 8,8,32 16,4,16" times our
forward with each (thread rows, thread columns, state columns a block) of the state pass's
kernel (kernels/delta.py; rows at most 16, state columns at most 64 and a multiple of 4 thread
columns), then stops.
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Results, free_device_memory, time_torch  # noqa: E402

TOL = 2e-3


def torch_reference(torch):
    """(chunk, recurrent): transformers' torch implementations, or a port of them here when
    transformers (or its Qwen3-Next module) cannot be imported."""
    try:
        from transformers.models.qwen3_next.modeling_qwen3_next import (
            torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule)
        return torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule, "transformers"
    except Exception as e:  # noqa: BLE001 - say which one runs
        print(f"transformers' Qwen3-Next module not importable ({type(e).__name__}: {e}); "
              f"timing this file's port of torch_chunk_gated_delta_rule instead")
    F = torch.nn.functional

    def l2n(x):
        return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)

    def chunk_rule(query, key, value, g, beta, chunk_size=64, initial_state=None,
                   output_final_state=False, use_qk_l2norm_in_kernel=False):
        # the same algorithm and op order as transformers 5.x: the triangular system row by
        # row, then a Python loop over the chunks
        dtype = query.dtype
        if use_qk_l2norm_in_kernel:
            query, key = l2n(query), l2n(key)
        query, key, value, beta, g = (x.transpose(1, 2).contiguous().float()
                                      for x in (query, key, value, beta, g))
        b, h, t, dk = key.shape
        dv = value.shape[-1]
        pad = (chunk_size - t % chunk_size) % chunk_size
        query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
        beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
        query = query * dk ** -0.5
        v_beta, k_beta = value * beta[..., None], key * beta[..., None]
        query, key, value, k_beta, v_beta = (x.reshape(b, h, -1, chunk_size, x.shape[-1])
                                             for x in (query, key, value, k_beta, v_beta))
        g = g.reshape(b, h, -1, chunk_size).cumsum(-1)
        upper = torch.triu(torch.ones(chunk_size, chunk_size, dtype=torch.bool,
                                      device=query.device))
        decay = (g[..., :, None] - g[..., None, :]).tril().exp().float().tril()
        attn = -((k_beta @ key.transpose(-1, -2)) * decay).masked_fill(upper, 0)
        for i in range(1, chunk_size):
            row, sub = attn[..., i, :i].clone(), attn[..., :i, :i].clone()
            attn[..., i, :i] = row + (row[..., None] * sub).sum(-2)
        attn = attn + torch.eye(chunk_size, dtype=attn.dtype, device=attn.device)
        value = attn @ v_beta
        k_cum = attn @ (k_beta * g.exp()[..., None])
        s = torch.zeros(b, h, dk, dv).to(value) if initial_state is None else \
            initial_state.to(value)
        out = torch.zeros_like(value)
        strict = torch.triu(torch.ones(chunk_size, chunk_size, dtype=torch.bool,
                                       device=query.device), diagonal=1)
        for i in range(query.shape[2]):
            q_i, k_i, v_i = query[:, :, i], key[:, :, i], value[:, :, i]
            a_i = (q_i @ k_i.transpose(-1, -2) * decay[:, :, i]).masked_fill_(strict, 0)
            v_new = v_i - k_cum[:, :, i] @ s
            out[:, :, i] = (q_i * g[:, :, i, :, None].exp()) @ s + a_i @ v_new
            s = s * g[:, :, i, -1, None, None].exp() + \
                (k_i * (g[:, :, i, -1, None] - g[:, :, i]).exp()[..., None]).transpose(-1, -2) \
                @ v_new
        out = out.reshape(b, h, -1, dv)[:, :, :t].transpose(1, 2).contiguous().to(dtype)
        return out, (s if output_final_state else None)

    def recurrent_rule(query, key, value, g, beta, initial_state, output_final_state,
                       use_qk_l2norm_in_kernel=False):
        dtype = query.dtype
        if use_qk_l2norm_in_kernel:
            query, key = l2n(query), l2n(key)
        query, key, value, beta, g = (x.transpose(1, 2).contiguous().float()
                                      for x in (query, key, value, beta, g))
        b, h, t, dk = key.shape
        query = query * dk ** -0.5
        out = torch.zeros(b, h, t, value.shape[-1]).to(value)
        s = torch.zeros(b, h, dk, value.shape[-1]).to(value) if initial_state is None else \
            initial_state.to(value)
        for i in range(t):
            s = s * g[:, :, i].exp()[..., None, None]
            delta = (value[:, :, i] - (s * key[:, :, i, :, None]).sum(-2)) * beta[:, :, i, None]
            s = s + key[:, :, i, :, None] * delta[..., None, :]
            out[:, :, i] = (s * query[:, :, i, :, None]).sum(-2)
        return out.transpose(1, 2).contiguous().to(dtype), (s if output_final_state else None)

    return chunk_rule, recurrent_rule, "port in bench_gated_delta.py"


def rel_err(ours, ref) -> float:
    ref = ref.detach().float().cpu().numpy() if hasattr(ref, "detach") else ref
    return float(np.abs(np.asarray(ours, np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30))


def time_ours(cuda, exe, feed, iters=5, repeats=3) -> float:
    """ms per run (GRAPH mode: one CUDA-graph replay), device inputs, best of ``repeats``."""
    exe.run(feed, outputs="view")
    cuda.synchronize()
    best = np.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            exe.run(feed, outputs="view")
        cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / iters * 1e3)
    return best


def make_inputs(rng, b, t, h, dk, dv):
    return dict(q=rng.standard_normal((b, t, h, dk)).astype(np.float32),
                k=rng.standard_normal((b, t, h, dk)).astype(np.float32),
                v=rng.standard_normal((b, t, h, dv)).astype(np.float32),
                g=np.log(rng.uniform(0.9, 1.0, (b, t, h))).astype(np.float32),
                beta=(1 / (1 + np.exp(-rng.standard_normal((b, t, h))))).astype(np.float32))


def row(name, shape, ours, torch_ms, bar, err, launches, extra=None):
    ratio = torch_ms / ours
    ok = ratio >= bar and err <= TOL
    print(f"{name:<22} {shape:<26} {ours:9.3f} {torch_ms:9.3f} {ratio:7.2f}x  >= {bar:g}x  "
          f"{err:8.1e}  {launches:5d}  {'PASS' if ok else 'FAIL'}", flush=True)
    return dict(op=name, shape=shape, rlx_ms=ours, torch_ms=torch_ms, ratio=ratio,
                bar=f">= {bar:g}x, max rel err <= {TOL:g}", max_rel_err=err, launches=launches,
                **(extra or {}), **{"pass": bool(ok)})


def sweep_scan(rlx, cuda, x, names, spec) -> int:
    """Our forward timed with each geometry of the state pass's kernel (its step and the chunk
    inverse's alone too, from exe.profile)."""
    from rlx_numba.kernels.delta import StateScanGeometry
    from rlx_numba.kernels.launch import override_geometry
    feed = {n: cuda.to_device(a) for n, a in x.items()}
    ref = None
    for item in spec.split():
        rt, ct, vs = (int(v) for v in item.split(","))
        g = rlx.Graph("gdn_fwd")
        ins = {n: g.input(n, a.shape) for n, a in x.items()}
        o, _ = g.gated_delta_net(*(ins[n] for n in names), use_qk_l2norm=True)
        g.set_outputs([o])
        with override_geometry("delta_state_scan", StateScanGeometry(rt, ct, vs)):
            exe = rlx.compile(g, exec_mode="graph")
            (got,) = exe.run(feed)
            ms = time_ours(cuda, exe, feed)
            prof = str(exe.profile(feed))
        ref = got if ref is None else ref
        scan = [line for line in prof.splitlines()
                if "delta_state_scan" in line or "unit_lower_inverse" in line]
        print(f"geometry rt={rt} ct={ct} vs={vs}: forward {ms:.3f} ms, max |diff| vs the first "
              f"{float(np.abs(got - ref).max()):.1e}\n  " + "\n  ".join(scan), flush=True)
        del exe
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dk", type=int, default=128)
    p.add_argument("--dv", type=int, default=128)
    p.add_argument("--tf32", action="store_true")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--scan-geometries", default="")
    p.add_argument("--out", type=Path,
                   default=Path(__file__).resolve().parent / "results" / "gated_delta.json")
    args = p.parse_args(argv)
    import rlx_numba as rlx
    if rlx.simulator_enabled():
        print("bench_gated_delta: no CUDA GPU here (simulator); this benchmark needs a GPU. "
              "Nothing measured.")
        return 0
    import torch
    from numba import cuda

    from rlx_numba import cublas
    if args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        cublas.allow_tf32 = True
    chunk_rule, recurrent_rule, which = torch_reference(torch)
    b, t, h, dk, dv = args.batch, args.seq, args.heads, args.dk, args.dv
    rng = np.random.default_rng(0)
    x = make_inputs(rng, b, t, h, dk, dv)
    dout = rng.standard_normal((b, t, h, dv)).astype(np.float32)
    names = ("q", "k", "v", "g", "beta")
    shape = f"B{b} T{t} H{h} Dk{dk} Dv{dv}"
    prec = "f32, TF32 products" if args.tf32 else "f32"
    print(f"{torch.cuda.get_device_name()}: GatedDeltaNet {shape}, chunk 64, q/k l2 norm, "
          f"{prec}; torch side: {which}")
    print(f"{'case':<22} {'shape':<26} {'ours ms':>9} {'torch ms':>9} {'ratio':>8}  {'bar':<6} "
          f"{'rel err':>8}  {'steps':>5}  result")
    rows = []
    out = Results(args.out, gpu=torch.cuda.get_device_name(), rows=rows)

    if args.scan_geometries:
        return sweep_scan(rlx, cuda, x, names, args.scan_geometries)

    # ---- forward
    g = rlx.Graph("gdn_fwd")
    ins = {n: g.input(n, a.shape) for n, a in x.items()}
    o, s = g.gated_delta_net(*(ins[n] for n in names), use_qk_l2norm=True)
    g.set_outputs([o, s])
    fwd = rlx.compile(g, exec_mode="graph")
    feed = {n: cuda.to_device(a) for n, a in x.items()}
    got_o, got_s = fwd.run(feed)
    tx = {n: torch.from_numpy(a).cuda() for n, a in x.items()}

    def torch_fwd():
        with torch.no_grad():
            return chunk_rule(tx["q"], tx["k"], tx["v"], tx["g"], tx["beta"],
                              output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref_o, ref_s = torch_fwd()
    err = max(rel_err(got_o, ref_o), rel_err(got_s, ref_s))
    del ref_o, ref_s
    ours = time_ours(cuda, fwd, feed)
    torch_ms = time_torch(torch, torch_fwd, 2, 1, 3)
    rows.append(row("chunked forward", shape, ours, torch_ms, 10, err, len(fwd.steps),
                    dict(torch_impl=which, precision=prec)))
    out.save()
    if args.profile:
        print(fwd.profile(feed))
    del fwd, got_o, got_s
    free_device_memory(cuda, torch)

    # ---- forward + backward: o and the five input gradients for an upstream dO
    g = rlx.Graph("gdn_train")
    ins = {n: g.input(n, a.shape) for n, a in x.items()}
    o, _ = g.gated_delta_net(*(ins[n] for n in names), use_qk_l2norm=True)
    grads = g.grad(o, [ins[n] for n in names], seed=g.input("dout", dout.shape))
    g.set_outputs([o, *grads])
    train = rlx.compile(g, exec_mode="graph")
    feed["dout"] = cuda.to_device(dout)
    got = train.run(feed)
    txg = {n: a.clone().requires_grad_(True) for n, a in tx.items()}
    tdout = torch.from_numpy(dout).cuda()

    def torch_train():
        out, _ = chunk_rule(txg["q"], txg["k"], txg["v"], txg["g"], txg["beta"],
                            output_final_state=True, use_qk_l2norm_in_kernel=True)
        return out, torch.autograd.grad(out, [txg[n] for n in names], tdout)
    ref_o, ref_grads = torch_train()
    errs = {"o": rel_err(got[0], ref_o)}
    errs.update({f"d{n}": rel_err(a, r) for n, a, r in zip(names, got[1:], ref_grads)})
    del ref_o, ref_grads, got
    print("  forward + backward max rel err: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    ours = time_ours(cuda, train, feed, iters=3)
    torch_ms = time_torch(torch, torch_train, 1, 1, 3)
    rows.append(row("chunked fwd + bwd", shape, ours, torch_ms, 10, max(errs.values()),
                    len(train.steps), dict(errors=errs, torch_impl=which, precision=prec)))
    out.save()
    if args.profile:
        print(train.profile(feed))
    del train, feed, txg, tx
    free_device_memory(cuda, torch)

    # ---- decode step: one token with a state
    x1 = make_inputs(rng, b, 1, h, dk, dv)
    x1["s0"] = (0.1 * rng.standard_normal((b, h, dk, dv))).astype(np.float32)
    g = rlx.Graph("gdn_step")
    ins = {n: g.input(n, a.shape) for n, a in x1.items()}
    o, s = g.gated_delta_step(*(ins[n] for n in names), ins["s0"], use_qk_l2norm=True)
    g.set_outputs([o, s])
    step = rlx.compile(g, exec_mode="graph")
    feed = {n: cuda.to_device(a) for n, a in x1.items()}
    got_o, got_s = step.run(feed)
    tx = {n: torch.from_numpy(a).cuda() for n, a in x1.items()}

    def torch_step():
        with torch.no_grad():
            return recurrent_rule(tx["q"], tx["k"], tx["v"], tx["g"], tx["beta"], tx["s0"], True,
                                  use_qk_l2norm_in_kernel=True)
    ref_o, ref_s = torch_step()
    err = max(rel_err(got_o, ref_o), rel_err(got_s, ref_s))
    ours = time_ours(cuda, step, feed, iters=100)
    torch_ms = time_torch(torch, torch_step, 100, 10, 3)
    rows.append(row("decode step (T=1)", f"B{b} H{h} Dk{dk} Dv{dv}", ours, torch_ms, 2, err,
                    len(step.steps), dict(torch_impl=which, precision=prec)))
    out.done()
    return 0


if __name__ == "__main__":
    sys.exit(main())
