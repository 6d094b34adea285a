"""Real models beside PyTorch, f32, same process, random weights from a seed (both sides hold
the same weights).

MiniLM-L6 (all-MiniLM-L6-v2's config): sentences/s at batch 1, 32, 256, seq 128, mean pooling
and L2 normalisation, embeddings back on the host on both sides. Bar: batch 32 >= torch eager.
Then a corpus of 4096 sentences of 3-60 random words through SentenceEncoder.encode (a
sentence-transformers folder written from the config, random weights, a word-level tokenizer)
beside sentence-transformers' encode of the same folder, at batch 32 and 128. Bars: batch 128
>= batch 32, and >= 3x sentence-transformers at both.
Llama (SmolLM2-135M's config): prefill tokens/s for a 512-token prompt (batch 1; the next
token back on the host), and decode tokens/s at batch 1 and 8 (greedy, 32-token prompts,
--new tokens; our loop brings every token to the host, torch's keeps them on the device).
Bars: decode batch 1 >= 1000 tok/s and >= 2x torch eager, batch 8 >= 5000 tok/s; the device
bytes a generate adds (free memory before the model's first graph and after the decode, all
its graphs alive) <= 1.2x the weights plus the KV cache; kernel launches a decoder layer in
the decode step (the steps of a 2-layer decode graph minus a 1-layer one's) <= 8. Times are
wall clock (perf_counter around whole calls, synchronised), best of 3. torch.compile columns
where it works (the encoder and the prefill; the decode loop's growing cache would recompile
every step, so none there).
Weight formats (``--only formats``; issue 18): Llama decode tok/s at batch 1 and 8 (greedy,
32-token prompts, --new tokens, the generate loop timed as above) with the same random weights
held f32, bf16 (set_param_half) and GGUF-packed q4_0 / q4_k (``LlamaForCausalLM.quantized``:
the bench quantises them), for SmolLM2-135M's config and a Llama-3.2-1B-shaped one (where the
weight bytes, not the launches, decide the speed), with the device bytes each holds (weights
and KV caches, by format).
Bars: 1B batch 1, q4 >= 2.5x and bf16 >= 1.6x the f32 tok/s; SmolLM2, every format >= 1.0x f32
at both batches.

Qwen3-Next (``--only qwen3next``; issue 33): the hybrid decoder (gated-delta and attention
layers, MoE with a shared expert) at a small config (QWEN3NEXT, f32, random weights spread
wider than transformers' init), saved by transformers' Qwen3NextForCausalLM and loaded by ours:
decode tok/s at batch 1 and 4 (16-token prompts, --new tokens; (t(n) - t(1)) / (n - 1) of
whole greedy generate calls on both sides) with our decode graph run as a stream and as one
CUDA graph, beside transformers' eager generate (its torch code paths: fla / causal-conv1d
kernels swapped out where installed, as tests/test_qwen3_next_gpu.py), and whether the greedy
tokens are the same (the row's pass).

  python bench/bench_models.py [--no-compile] [--decode-exec-mode stream] [--weights f16]
                               [--new 128] [--out bench/results/models.json]
"""
from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Results, dist_version, free_device_memory  # noqa: E402

MINILM = dict(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
              intermediate_size=1536, max_position_embeddings=512, type_vocab_size=2,
              layer_norm_eps=1e-12, hidden_act="gelu")
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
               rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
               bos_token_id=1, eos_token_id=2)


def wall(fn, sync, iters: int, warmup: int = 2, repeats: int = 3) -> float:
    """Seconds per call of fn() (synchronised at the end of each timed batch), best of repeats."""
    for _ in range(warmup):
        fn()
    sync()
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t) / iters)
    return best


def hf_llama_config(transformers, d: dict):
    """transformers.LlamaConfig of our config dict: rope theta under rope_parameters where the
    installed transformers has them (5.x), else rope_theta (4.x); checked by reading it back."""
    from rlx_numba.models import LlamaConfig
    kw = dict(d, hidden_act="silu")
    theta = kw.pop("rope_theta")
    if hasattr(transformers.LlamaConfig, "rope_parameters") or \
            "rope_parameters" in inspect.signature(transformers.LlamaConfig.__init__).parameters:
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    else:
        kw["rope_theta"] = theta
    cfg = transformers.LlamaConfig(**kw)
    back = LlamaConfig.from_dict(cfg.to_dict())
    if back.rope_theta != theta:
        raise RuntimeError(f"transformers config lost rope theta {theta}: {back.rope_theta}")
    return cfg


def load_torch(torch, model, params):
    """Copy our params into a transformers model (strict except the tied head / buffers)."""
    res = model.load_state_dict({k: torch.from_numpy(v) for k, v in params.items()}, strict=False)
    bad = [k for k in res.missing_keys if k != "lm_head.weight"] + list(res.unexpected_keys)
    if bad:
        raise RuntimeError(f"weights do not map onto the transformers model: {bad[:5]}")
    return model


def bench_bert(torch, transformers, args, rows):
    from rlx_numba.models import BertConfig, BertModel
    F = torch.nn.functional
    ours = BertModel.from_config(BertConfig(**MINILM), seed=0, weights=args.weights,
                                 dtype=args.dtype)
    hf = transformers.BertModel(transformers.BertConfig(**MINILM), add_pooling_layer=False)
    hf = load_torch(torch, hf, ours.params).cuda().eval().to(args.torch_dtype)
    comp = torch.compile(hf) if args.compile else None

    def pooled(model, ids, mask):
        h = model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        m = mask[..., None].float()
        return F.normalize((h * m).sum(1) / m.sum(1).clamp(min=1e-9), dim=-1).cpu()

    rng = np.random.default_rng(0)
    print(f"\n{'MiniLM-L6 config, seq 128':<28} {'rlx sent/s':>11} {'eager':>9} {'compile':>9} "
          f"{'x eager':>8}  bar   min cos")
    for b in (1, 32, 256):
        ids = rng.integers(1000, 30000, (b, 128)).astype(np.int32)
        mask = np.ones((b, 128), bool)
        types = np.zeros((b, 128), np.int32)
        exe = ours.executable(b, 128, pooling=("mean",), normalize=True)
        feed = {"input_ids": ids, "token_type_ids": types, "attention_mask": mask}
        tids, tmask = torch.from_numpy(ids).long().cuda(), torch.from_numpy(mask).long().cuda()
        ours_y = exe.run(feed)[0]
        with torch.inference_mode():
            ref = pooled(hf, tids, tmask).numpy()
            iters = max(3, 256 // b)
            t_rlx = wall(lambda: exe.run(feed), lambda: None, iters)
            t_eager = wall(lambda: pooled(hf, tids, tmask), torch.cuda.synchronize, iters)
            t_comp = math.nan
            if comp is not None:
                try:
                    t_comp = wall(lambda: pooled(comp, tids, tmask), torch.cuda.synchronize, iters)
                except Exception as e:  # noqa: BLE001 - "where it works"
                    print(f"  torch.compile failed at batch {b}: {type(e).__name__}: {e}")
        cos = float((ours_y * ref).sum(1).min())          # both unit vectors
        ratio = t_eager / t_rlx
        bar_b = 32 if args.dtype == "f32" else 256     # f32: batch 32; half: batch 256
        r = dict(model="minilm", dtype=args.dtype, batch=b, seq=128, rlx_per_s=b / t_rlx,
                 eager_per_s=b / t_eager, compile_per_s=b / t_comp, ratio=ratio, min_cos=cos,
                 bar=1.0 if b == bar_b else None,
                 **{"pass": (ratio >= 1.0 if b == bar_b else True) and cos >= args.min_cos})
        rows.append(r)
        print(f"  batch {b:<20} {r['rlx_per_s']:11.0f} {r['eager_per_s']:9.0f} "
              f"{r['compile_per_s']:9.0f} {ratio:8.2f}  {'1.0x' if b == bar_b else '  - '}  "
              f"{cos:.6f} {'PASS' if r['pass'] else 'FAIL'}", flush=True)
    ours._exes.clear()
    free_device_memory(args.cuda, torch)
    bench_corpus(torch, args, ours, rows)


def _corpus(rng, n=4096):
    """n sentences of 3-60 words from a 5000-word vocabulary (lengths uniform)."""
    words = [f"w{i}" for i in range(5000)]
    return words, [" ".join(rng.choice(words, int(rng.integers(3, 61)))) for _ in range(n)]


def _write_st_folder(path, cfg, params, words):
    """A sentence-transformers folder (BERT weights, a word-level tokenizer with [CLS] ... [SEP],
    mean pooling, Normalize) that both sides load."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3}
    for w in words:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "[PAD]",
         "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
         "model_max_length": 128}))
    (path / "config.json").write_text(json.dumps(
        {"model_type": "bert", "architectures": ["BertModel"], **cfg.to_dict(),
         "position_embedding_type": "absolute"}))
    save_file(dict(params), str(path / "model.safetensors"))
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}]))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": cfg.hidden_size, "pooling_mode_mean_tokens": True}))
    (path / "2_Normalize").mkdir()
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128}))


def bench_corpus(torch, args, bert, rows):
    """SentenceEncoder.encode of a ragged corpus beside sentence-transformers (both f32)."""
    import tempfile
    from rlx_numba.models import SentenceEncoder
    words, texts = _corpus(np.random.default_rng(2))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        _write_st_folder(folder, bert.config, bert.params, words)
        enc = SentenceEncoder.from_pretrained(folder, weights=args.weights, dtype=args.dtype)
        st = None
        try:
            from sentence_transformers import SentenceTransformer
            st = SentenceTransformer(str(folder), device="cuda").to(args.torch_dtype)
        except Exception as e:  # noqa: BLE001 - the row still reports our side
            print(f"  sentence-transformers could not load the folder: {type(e).__name__}: {e}")
        print(f"\n{'corpus 4096 x 3-60 words':<28} {'rlx sent/s':>11} {'s-t':>9} {'x s-t':>8}"
              f"  bars  min cos")
        got = {}
        for b in (32, 128):
            t_rlx = wall(lambda: enc.encode(texts, batch_size=b), lambda: None, 1, warmup=1)
            mine = enc.encode(texts, batch_size=b)
            t_st, cos = math.nan, math.nan
            if st is not None:
                with torch.inference_mode():
                    t_st = wall(lambda: st.encode(texts, batch_size=b, convert_to_numpy=True),
                                torch.cuda.synchronize, 1, warmup=1)
                    ref = st.encode(texts, batch_size=b, convert_to_numpy=True)
                cos = float((mine * ref).sum(1).min())
            got[b] = len(texts) / t_rlx
            ratio = t_st / t_rlx
            ok = ratio >= 3.0 and (b == 32 or got[b] >= got[32]) and cos >= args.min_cos
            r = dict(model="minilm-corpus", dtype=args.dtype, batch=b, sentences=len(texts), rlx_per_s=got[b],
                     st_per_s=len(texts) / t_st, ratio=ratio, min_cos=cos, bar=3.0)
            r["pass"] = bool(ok)
            rows.append(r)
            print(f"  batch {b:<20} {got[b]:11.0f} {r['st_per_s']:9.0f} {ratio:8.2f}  3.0x"
                  f"{' >=b32' if b == 128 else '      '}  {cos:.6f} {'PASS' if ok else 'FAIL'}",
                  flush=True)
        del st
    bert._exes.clear()
    free_device_memory(args.cuda, torch)


def decode_profile(model, cap, pos):
    """exe.profile() of the batch-1 decode graph, summed by kernel kind (a step's time brackets
    it with events, so on a launch-bound graph it holds the wait for the launch too)."""
    from collections import defaultdict
    dec = model.executable("decode", 1, 1, cap, (0.0, 0, 1.0))
    feed = {"input_ids": np.zeros((1, 1), np.int32), "pos": np.array([pos], np.int32),
            "seed": np.zeros(1, np.int64)}
    prof = dec.profile(feed)
    by = defaultdict(lambda: [0, 0.0])
    for r in prof:
        kind = " ".join(r.kernel.split()[:2])
        by[kind][0] += 1
        by[kind][1] += r.ms
    print(f"    decode step profile ({len(prof)} steps, {prof.total_ms * 1e3:.0f} us summed):")
    for kind, (cnt, ms) in sorted(by.items(), key=lambda kv: -kv[1][1]):
        print(f"      {kind:<34} {cnt:4d} steps {ms * 1e3:8.1f} us")


def settle(ctx):
    """Collect garbage and flush numba's deferred frees: device bytes then held are live."""
    import gc
    gc.collect()
    ctx.deallocations.clear()
    ctx.synchronize()


def launches_per_layer(LlamaConfig, LlamaForCausalLM, d: dict, args) -> int:
    """Steps of the decode graph of a 2-layer model minus a 1-layer one's (same config)."""
    counts = []
    for layers in (1, 2):
        m = LlamaForCausalLM.from_config(LlamaConfig(**dict(d, num_hidden_layers=layers)), seed=0,
                                         weights=args.weights, exec_mode=args.decode_exec_mode)
        counts.append(len(m.executable("decode", 1, 1, 64).steps))
    return counts[1] - counts[0]


def bench_llama(torch, transformers, args, rows):
    from rlx_numba.models import LlamaConfig, LlamaForCausalLM
    from rlx_numba.models.executables import next_pow2
    ours = LlamaForCausalLM.from_config(LlamaConfig(**SMOLLM2), seed=0, weights=args.weights,
                                        exec_mode=args.decode_exec_mode, dtype=args.dtype)
    hf_cfg = hf_llama_config(transformers, SMOLLM2)
    hf = load_torch(torch, transformers.LlamaForCausalLM(hf_cfg), ours.params).cuda().eval()
    hf = hf.to(args.torch_dtype)
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(hf.forward).parameters else {}
    rng = np.random.default_rng(1)

    # prefill: 512 tokens, batch 1, the next token on the host
    s = 512
    ids = rng.integers(0, SMOLLM2["vocab_size"], (1, s)).astype(np.int32)
    exe = ours.executable("prefill", 1, s, 1024)
    feed = {"input_ids": ids, "pad": np.zeros((1, 1), np.int32), "seed": np.zeros(1, np.int64)}
    tids = torch.from_numpy(ids).long().cuda()

    def torch_prefill(model):
        return model(input_ids=tids, use_cache=True, **keep).logits[:, -1].argmax(-1).cpu()

    with torch.inference_mode():
        t_rlx = wall(lambda: exe.run(feed, outputs="view")[0].copy_to_host(), lambda: None, 5)
        t_eager = wall(lambda: torch_prefill(hf), torch.cuda.synchronize, 5)
        t_comp = math.nan
        if args.compile:
            try:
                comp = torch.compile(hf)
                t_comp = wall(lambda: torch_prefill(comp), torch.cuda.synchronize, 5)
            except Exception as e:  # noqa: BLE001
                print(f"  torch.compile failed on the prefill: {type(e).__name__}: {e}")
    r = dict(model="llama", phase="prefill", batch=1, tokens=s, rlx_per_s=s / t_rlx,
             eager_per_s=s / t_eager, compile_per_s=s / t_comp, ratio=t_eager / t_rlx, bar=None)
    r["pass"] = True
    rows.append(r)
    print(f"\n{'SmolLM2-135M config':<28} {'rlx tok/s':>11} {'eager':>9} {'compile':>9} "
          f"{'x eager':>8}  bar   tokens equal")
    print(f"  prefill 512, batch 1        {r['rlx_per_s']:11.0f} {r['eager_per_s']:9.0f} "
          f"{r['compile_per_s']:9.0f} {r['ratio']:8.2f}   - ", flush=True)
    ours._exes.clear()

    per_layer = launches_per_layer(LlamaConfig, LlamaForCausalLM, SMOLLM2, args)
    r = dict(model="llama", phase="decode launches a layer", launches=per_layer, bar=8)
    r["pass"] = per_layer <= 8
    rows.append(r)
    print(f"  decode launches a layer     {per_layer:11d} {'':>9} {'':>9} {'':>8}  <= 8  "
          f"{'PASS' if r['pass'] else 'FAIL'}")

    # decode: greedy, 32-token prompts, args.new tokens
    n = args.new
    ctx = args.cuda.current_context()
    for b in (1, 8):
        prompt = rng.integers(0, SMOLLM2["vocab_size"], (b, 32))
        ours._exes = type(ours._exes)("llama")     # a fresh store: the weights upload again
        settle(ctx)
        free0 = ctx.get_memory_info()[0]
        times, got = [], []
        for _ in range(2):              # the first pass compiles
            stamps, toks = [], []
            for tok in ours.generate_stream(prompt, n):
                stamps.append(time.perf_counter())
                toks.append(tok)
            times.append((stamps[-1] - stamps[0]) / (n - 1))
            got = np.stack(toks, 1)
        t_rlx = times[-1]
        settle(ctx)
        used = free0 - ctx.get_memory_info()[0]
        arenas = sum(e.arena_bytes for e in ours._exes.values())
        print(f"    (store {ours._exes.params.nbytes / 2**20:.1f} MiB, arenas {arenas / 2**20:.1f} "
              f"MiB, {len(ours._exes)} graphs: {', '.join(map(str, ours._exes))})")
        cap = min(max(16, next_pow2(32 + n - 1)), SMOLLM2["max_position_embeddings"])
        isz = 4 if args.dtype == "f32" else 2          # the model's dtype: weights and KV
        kv = 2 * SMOLLM2["num_hidden_layers"] * b * SMOLLM2["num_key_value_heads"] * cap * 64 * isz
        need = sum(v.size for v in ours.params.values()) * isz + kv
        with torch.inference_mode():
            tp = torch.from_numpy(prompt).long().cuda()

            def torch_decode():
                out = hf(input_ids=tp, use_cache=True, **keep)
                past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                toks = [tok]
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(n - 1):
                    out = hf(input_ids=tok, past_key_values=past, use_cache=True)
                    past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                    toks.append(tok)
                torch.cuda.synchronize()
                return (time.perf_counter() - t0) / (n - 1), torch.cat(toks, 1).cpu().numpy()

            torch_decode()
            runs = [torch_decode() for _ in range(2)]
            t_eager, ref = min(runs, key=lambda x: x[0])
        same = int((got == ref).all(0).cumprod().sum())       # leading steps equal in every row
        ratio = t_eager / t_rlx
        bar = 1000 if b == 1 else 5000
        r = dict(model="llama", phase="decode", batch=b, new_tokens=n, rlx_per_s=b / t_rlx,
                 eager_per_s=b / t_eager, compile_per_s=math.nan, ratio=ratio, bar=bar,
                 equal_leading_steps=same, exec_mode=str(args.decode_exec_mode),
                 device_bytes=used, weights_and_kv_bytes=need)
        # half: both sides round differently at every layer, so after the first differing
        # pick the greedy sequences part ways (reported, not a bar)
        r["pass"] = (b / t_rlx >= bar and (ratio >= 2.0 or b > 1) and used <= 1.2 * need
                     and (same == n or args.dtype != "f32"))
        rows.append(r)
        print(f"  decode, batch {b:<13} {r['rlx_per_s']:11.0f} {r['eager_per_s']:9.0f} "
              f"{'n/a':>9} {ratio:8.2f}  {bar}/s  {same}/{n} "
              f"{'PASS' if r['pass'] else 'FAIL'}", flush=True)
        if b == 1:
            decode_profile(ours, cap, prompt.shape[1] + n - 2)
        print(f"    device bytes of the generate {used / 2**20:.0f} MiB = "
              f"{used / need:.2f}x weights + KV cache ({need / 2**20:.0f} MiB; bar 1.2x)")
        ours._exes.clear()
    free_device_memory(args.cuda, torch)


LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                bos_token_id=128000, eos_token_id=128001)
FORMATS = ("f32", "bf16", "q4_0", "q4_k")


def decode_tok_s(model, batch, n, vocab, ctx):
    """Decode tok/s of ``model.generate_stream`` (the second of two runs: the first compiles)."""
    prompt = np.random.default_rng(1).integers(0, vocab, (batch, 32))
    for _ in range(2):
        stamps = []
        for _tok in model.generate_stream(prompt, n):
            stamps.append(time.perf_counter())
    settle(ctx)
    return batch * (n - 1) / (stamps[-1] - stamps[0])


def bench_formats(args, rows):
    from rlx_numba.models import LlamaConfig, LlamaForCausalLM
    ctx = args.cuda.current_context()
    print(f"\n{'decode tok/s by weight format':<30} {'batch 1':>9} {'x f32':>6} {'batch 8':>9} "
          f"{'x f32':>6} {'device MiB':>11} (weights + the batch-8 KV caches)")
    for label, d in (("SmolLM2-135M config", SMOLLM2), ("Llama-3.2-1B shape", LLAMA_1B)):
        cfg = LlamaConfig(**d)
        base = LlamaForCausalLM.from_config(cfg, seed=0, exec_mode=args.decode_exec_mode)
        f32 = {}
        for fmt in FORMATS:
            if fmt.startswith("q"):
                m = base.quantized(fmt)
            else:
                m = LlamaForCausalLM(cfg, base.params, weights=fmt, exec_mode=args.decode_exec_mode)
            r = dict(model=label, phase="decode", weights=fmt)
            for b in (1, 8):
                r[f"b{b}_tok_s"] = decode_tok_s(m, b, args.new, cfg.vocab_size, ctx)
            r["device_bytes_by_format"] = m.device_bytes()
            r["device_bytes"] = held = sum(r["device_bytes_by_format"].values())
            if fmt == "f32":
                f32 = r
            for b in (1, 8):
                r[f"b{b}_x_f32"] = r[f"b{b}_tok_s"] / f32[f"b{b}_tok_s"]
            big = d is LLAMA_1B
            bar = (2.5 if fmt.startswith("q") else 1.6 if fmt == "bf16" else None) if big else 1.0
            r["bar"] = bar
            r["pass"] = bar is None or fmt == "f32" or (
                r["b1_x_f32"] >= bar and (big or r["b8_x_f32"] >= bar))
            rows.append(r)
            print(f"  {label:<20} {fmt:<9} {r['b1_tok_s']:9.0f} {r['b1_x_f32']:6.2f} "
                  f"{r['b8_tok_s']:9.0f} {r['b8_x_f32']:6.2f} {held / 2**20:11.1f}  "
                  f"{'' if fmt == 'f32' or bar is None else ('PASS' if r['pass'] else 'FAIL')}",
                  flush=True)
            del m
            settle(ctx)
        del base
        settle(ctx)


def bench_decode_1b(torch, transformers, args, rows):
    """The Llama-3.2-1B shape in bf16: decode tok/s at batch 1 and 8 (greedy, 32-token
    prompts) beside transformers' eager model in bf16. Bars: batch 1 >= 80% of the weight-read
    floor (the bf16 weights read once a token at the GPU's copy bandwidth, taken as 3.0 TB/s
    on an H100 80GB HBM3 and 4.0 TB/s on an H200), batch 8 >= 4x torch eager."""
    from rlx_numba.models import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(**LLAMA_1B)
    ours = LlamaForCausalLM.from_config(cfg, seed=0, exec_mode=args.decode_exec_mode,
                                        dtype="bf16")
    hf = load_torch(torch, transformers.LlamaForCausalLM(hf_llama_config(transformers, LLAMA_1B)),
                    ours.params).to(torch.bfloat16).cuda().eval()
    ctx = args.cuda.current_context()
    weight_bytes = 2 * sum(v.size for k, v in ours.params.items())
    bw = 4.0e12 if "H200" in torch.cuda.get_device_name() else 3.0e12
    floor = bw / weight_bytes
    print(f"\n{'Llama-3.2-1B shape, bf16':<28} {'rlx tok/s':>11} {'eager':>9} {'x eager':>8}  bar")
    for b in (1, 8):
        t_ours = b / decode_tok_s(ours, b, args.new, cfg.vocab_size, ctx)
        prompt = torch.from_numpy(np.random.default_rng(1).integers(0, cfg.vocab_size, (b, 32))).cuda()
        with torch.inference_mode():
            def torch_decode():
                out = hf(input_ids=prompt, use_cache=True)
                past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(args.new - 1):
                    out = hf(input_ids=tok, past_key_values=past, use_cache=True)
                    past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                torch.cuda.synchronize()
                return (time.perf_counter() - t0) / (args.new - 1)
            torch_decode()
            t_eager = min(torch_decode() for _ in range(2))
        ratio = t_eager / t_ours
        if b == 1:
            bar, ok = f">= {0.8 * floor:.0f}/s (80% of {floor:.0f})", 1 / t_ours >= 0.8 * floor
        else:
            bar, ok = ">= 4x eager", ratio >= 4.0
        r = dict(model="llama-1b", dtype="bf16", phase="decode", batch=b, rlx_per_s=b / t_ours,
                 eager_per_s=b / t_eager, ratio=ratio, floor_tok_s=floor, bar=bar)
        r["pass"] = bool(ok)
        rows.append(r)
        print(f"  decode, batch {b:<13} {b / t_ours:11.0f} {b / t_eager:9.0f} {ratio:8.2f}  "
              f"{bar} {'PASS' if ok else 'FAIL'}", flush=True)
    del ours, hf
    settle(ctx)
    free_device_memory(args.cuda, torch)


QWEN3NEXT = dict(vocab_size=8192, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                 linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
                 linear_value_head_dim=64, num_experts=16, num_experts_per_tok=4,
                 moe_intermediate_size=256, shared_expert_intermediate_size=256,
                 max_position_embeddings=4096, tie_word_embeddings=False)   # every 4th: attention


def torch_paths(model) -> set:
    """transformers' torch code paths in every gated-delta layer of a Qwen3-Next ``model`` (its
    fallbacks when fla and causal-conv1d are missing), whatever is installed; returns what was
    swapped."""
    mod = __import__(type(model).__module__, fromlist=["_"])
    swapped = set()
    for m in model.modules():
        if type(m).__name__ != "Qwen3NextGatedDeltaNet":
            continue
        for attr, fn in (("chunk_gated_delta_rule", "torch_chunk_gated_delta_rule"),
                         ("recurrent_gated_delta_rule", "torch_recurrent_gated_delta_rule"),
                         ("causal_conv1d_update", "torch_causal_conv1d_update")):
            ref = getattr(mod, fn, None)
            if ref is not None and hasattr(m, attr) and getattr(m, attr) is not ref:
                setattr(m, attr, ref)
                swapped.add(attr)
        if getattr(m, "causal_conv1d_fn", None) is not None:
            m.causal_conv1d_fn = None
            swapped.add("causal_conv1d_fn")
        if type(m.norm).__name__ != "Qwen3NextRMSNormGated":
            norm = mod.Qwen3NextRMSNormGated(m.head_v_dim, eps=m.layer_norm_epsilon)
            norm.weight.data.copy_(m.norm.weight.data.float())
            m.norm = norm.to(m.norm.weight.device)
            swapped.add("norm")
    return swapped


def hf_qwen3next(torch, transformers, seed=0, config=None):
    """transformers' Qwen3NextForCausalLM of ``config`` (default QWEN3NEXT) on the GPU, f32,
    eager attention, its torch gated-delta / conv code in every layer (torch_paths); weights
    spread wider than its init so that routing and greedy picks are far from ties: N(0, 0.08),
    zero-centred norms N(0, 0.1), routers N(0, 0.5), conv N(0, 0.3), A_log log U(1, 16),
    dt_bias 1 + N(0, 0.2); generation never stops early (random weights)."""
    cfg = transformers.Qwen3NextConfig(**(config or QWEN3NEXT))
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"           # transformers 5: its loop over experts
    hf = transformers.Qwen3NextForCausalLM(cfg).float()
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif "norm" in name:                       # zero-centred: gain 1 + weight
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(1, 16)))
            elif name.endswith("dt_bias"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.5 if name.endswith("mlp.gate.weight") else
                          0.3 if name.endswith("conv1d.weight") else 0.08)
    torch_paths(hf)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf.cuda().eval()


def bench_qwen3next(torch, transformers, args, rows):
    import tempfile

    from rlx_numba.models import Qwen3NextForCausalLM
    if not hasattr(transformers, "Qwen3NextForCausalLM"):
        print(f"\nqwen3next: transformers {transformers.__version__} has no Qwen3NextForCausalLM; "
              f"skipped")
        return
    hf = hf_qwen3next(torch, transformers)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        models = {mode: Qwen3NextForCausalLM.from_safetensors(tmp, exec_mode=mode)
                  for mode in ("stream", "graph")}
    ctx = args.cuda.current_context()
    n = args.new
    print(f"\n{'Qwen3-Next small, f32':<22} {'stream tok/s':>13} {'graph tok/s':>12} "
          f"{'eager tok/s':>12} {'x eager':>8}  same greedy tokens")
    for b in (1, 4):
        prompt = np.random.default_rng(1).integers(0, QWEN3NEXT["vocab_size"], (b, 16))
        tp = torch.from_numpy(prompt).cuda()

        def run_hf(k):
            with torch.inference_mode():
                return hf.generate(tp, max_new_tokens=k, min_new_tokens=k,
                                   do_sample=False).cpu().numpy()

        def per_token(gen):
            gen(1), gen(n)                    # compile / warm up
            t1 = wall(lambda: gen(1), lambda: None, 1, warmup=0)
            tn = wall(lambda: gen(n), lambda: None, 1, warmup=0)
            return (tn - t1) / (n - 1)

        ref = run_hf(n)
        per = {mode: per_token(lambda k, m=m: m.generate(prompt, k, max_seq_len=16 + n))
               for mode, m in models.items()}
        same = all(np.array_equal(m.generate(prompt, n), ref) for m in models.values())
        t_eager = per_token(run_hf)
        best = min(per.values())
        r = dict(model="qwen3next-small", phase="decode", batch=b, tokens=n,
                 rlx_per_s=b / best, rlx_stream_per_s=b / per["stream"],
                 rlx_graph_per_s=b / per["graph"], eager_per_s=b / t_eager,
                 ratio=t_eager / best, bar="same greedy tokens as transformers")
        r["pass"] = bool(same)
        rows.append(r)
        print(f"  decode, batch {b:<7} {b / per['stream']:13.0f} {b / per['graph']:12.0f} "
              f"{b / t_eager:12.0f} {t_eager / best:8.2f}  {'PASS' if same else 'FAIL'}",
              flush=True)
    del models, hf
    settle(ctx)
    free_device_memory(args.cuda, torch)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--decode-exec-mode", default="graph")
    p.add_argument("--weights", default="f32", choices=["f32", "f16", "bf16"])
    p.add_argument("--dtype", default="f32", choices=["f32", "f16", "bf16"],
                   help="the models' dtype= (torch's models .to() the same dtype)")
    p.add_argument("--new", type=int, default=128, help="tokens a decode run generates")
    p.add_argument("--only", default=None, help="comma-separated parts: bert, llama, formats, "
                   "decode1b, qwen3next (default: all)")
    p.add_argument("--out", type=Path,
                   default=Path(__file__).resolve().parent / "results" / "models.json")
    args = p.parse_args(argv)
    known = {"bert", "llama", "formats", "decode1b", "qwen3next"}
    if args.only and set(args.only.split(",")) - known:
        p.error(f"--only: unknown parts {sorted(set(args.only.split(',')) - known)}; "
                f"known: {sorted(known)}")
    import rlx_numba as rlx
    if rlx.simulator_enabled():
        print("bench_models: no CUDA GPU here (simulator); this benchmark needs a GPU. "
              "Nothing measured.")
        return 0
    import torch
    import transformers
    from numba import cuda
    args.cuda = cuda
    args.torch_dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[
        args.dtype]
    # embeddings of a half model against a half torch model: both round at every layer
    args.min_cos = 0.9999 if args.dtype == "f32" else 0.999
    torch.backends.cuda.matmul.allow_tf32 = False     # f32 on both sides
    gpu = torch.cuda.get_device_name()
    print(f"GPU: {gpu}   torch {torch.__version__}   transformers {transformers.__version__}   "
          f"numba-cuda {dist_version('numba-cuda')}   weights {args.weights}   dtype {args.dtype}   "
          f"decode exec "
          f"{args.decode_exec_mode}")
    rows = []
    out = Results(args.out, gpu=gpu, weights=args.weights, results=rows)
    parts = [("bert", lambda: bench_bert(torch, transformers, args, rows)),
             ("llama", lambda: bench_llama(torch, transformers, args, rows)),
             ("formats", lambda: bench_formats(args, rows)),
             ("decode1b", lambda: bench_decode_1b(torch, transformers, args, rows)),
             ("qwen3next", lambda: bench_qwen3next(torch, transformers, args, rows))]
    out.run_parts(parts, args.only, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
