"""Train a small Llama-architecture language model on a text file, byte by byte.

The body of ``examples/train_tiny_llama.py`` and of ``rlx-numba demo --train`` (here, so the CLI
can import it: examples/ is not a package). Tokens are the text's UTF-8 bytes (vocabulary 256,
no tokenizer); each step trains on ``batch`` random windows of ``seq`` bytes, scored on
next-byte prediction (``LlamaTrainer``: labels = the ids, Hugging Face's
shift), with AdamW, a linear warm-up then cosine decay of the learning rate (``set_lr``: no
recompile) and global-norm clipping at 1.0.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

from ..device import simulator_enabled
from ..optim import AdamW
from .llama import LlamaConfig, LlamaForCausalLM, llama_param_shapes

VOCAB = 256                      # bytes
# (steps, batch, seq, hidden, layers, lr): a GPU's defaults and the simulator's, where every
# CUDA thread is an OS thread and one step of even the smallest model takes seconds
GPU_DEFAULTS = dict(steps=300, batch=16, seq=128, hidden=128, layers=4, lr=3e-3)
SIM_DEFAULTS = dict(steps=3, batch=1, seq=8, hidden=16, layers=1, lr=1e-2)


def default_text() -> tuple[str, bytes]:
    """The repository's README.md; in an installed package without it, the package's
    docstrings (some English and code to learn from)."""
    readme = Path(__file__).resolve().parents[2] / "README.md"
    if readme.is_file():
        return str(readme), readme.read_bytes()
    import rlx_numba
    from .. import compiler, optim, train
    docs = "\n\n".join(m.__doc__ or "" for m in (rlx_numba, compiler, optim, train))
    return "rlx_numba's docstrings", docs.encode()


def tiny_config(hidden: int, layers: int, seq: int) -> LlamaConfig:
    """A Llama of ``hidden`` width: heads of 16 (two heads below 32), half as many key/value
    heads (grouped-query attention) where that divides, SwiGLU of ~8/3 hidden, tied
    embeddings, positions for twice the training window (the sample runs a little past it)."""
    if not isinstance(hidden, int) or hidden < 4 or hidden % 4:
        raise ValueError(f"train_tiny_llama: hidden must be a multiple of 4, >= 4, got {hidden!r}")
    heads = hidden // 16 if hidden >= 32 else 2
    if hidden % heads or (hidden // heads) % 2:
        raise ValueError(f"train_tiny_llama: hidden {hidden} does not split into {heads} heads "
                         f"of even size (use a multiple of 16)")
    kv = heads // 2 if heads % 2 == 0 else heads
    return LlamaConfig(vocab_size=VOCAB, hidden_size=hidden,
                       intermediate_size=max(8, (8 * hidden // 3 + 7) // 8 * 8),
                       num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv, max_position_embeddings=max(64, 2 * seq),
                       rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)


def lr_at(step: int, steps: int, lr: float) -> float:
    """Linear warm-up over the first 10% of the steps (at least 1), then cosine decay to lr/10."""
    warm = max(1, steps // 10)
    if step < warm:
        return lr * (step + 1) / warm
    t = (step - warm) / max(1, steps - warm)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train_tiny_llama(data: bytes, *, steps: int, batch: int, seq: int, hidden: int, layers: int,
                     lr: float, seed: int = 0, exec_mode="graph", on_step=None):
    """Train a fresh ``tiny_config`` Llama on random ``seq``-byte windows of ``data``.
    ``on_step(step, loss)`` is called after each step. Returns (model, losses): the model holds
    the trained weights (``LlamaTrainer.update_model``)."""
    for arg, v, lo in (("steps", steps, 1), ("batch", batch, 1), ("seq", seq, 2),
                       ("layers", layers, 1)):
        if not isinstance(v, (int, np.integer)) or v < lo:
            raise ValueError(f"train_tiny_llama: {arg} must be an int >= {lo}, got {v!r}")
    if not lr > 0:
        raise ValueError(f"train_tiny_llama: lr must be > 0, got {lr!r}")
    tokens = np.frombuffer(bytes(data), np.uint8)
    if tokens.size < seq + 1:
        raise ValueError(f"train_tiny_llama: the text has {tokens.size} bytes; a window of seq "
                         f"{seq} needs at least {seq + 1}")
    cfg = tiny_config(hidden, layers, seq)
    model = LlamaForCausalLM.from_config(cfg, seed=seed, std=0.02)
    trainer = model.trainer(batch, seq, AdamW(lr=lr_at(0, steps, lr), weight_decay=0.01),
                            clip_grad_norm=1.0, exec_mode=exec_mode)
    rng = np.random.default_rng(seed)
    losses = []
    for step in range(steps):
        trainer.set_lr(lr_at(step, steps, lr))
        starts = rng.integers(0, tokens.size - seq + 1, batch)
        ids = np.stack([tokens[s:s + seq] for s in starts]).astype(np.int64)
        losses.append(trainer.step(ids))
        if on_step is not None:
            on_step(step, losses[-1])
    trainer.update_model()
    return model, losses


def _progress(steps: int):
    """(on_step, close): a tqdm bar when tqdm is installed, else a line every ~5% of steps."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        every, t0 = max(1, steps // 20), time.perf_counter()

        def on_step(step, loss):
            if step % every == 0 or step == steps - 1:
                print(f"step {step + 1:5d}/{steps}  loss {loss:.4f}  "
                      f"({time.perf_counter() - t0:.1f} s)", flush=True)
        return on_step, lambda: None
    bar = tqdm(total=steps, desc="training", unit="step")

    def on_step(step, loss):
        bar.set_postfix(loss=f"{loss:.4f}")
        bar.update(1)
    return on_step, bar.close


def _plot(losses, path, title) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    steps = np.arange(1, len(losses) + 1)
    ax.plot(steps, losses, lw=1, alpha=0.5 if len(losses) >= 20 else 1, label="loss a step")
    if len(losses) >= 20:           # each step sees other windows: a running mean shows the trend
        k = max(5, len(losses) // 20)
        ax.plot(steps[k - 1:], np.convolve(losses, np.ones(k) / k, "valid"), lw=2,
                label=f"mean of {k} steps")
    ax.axhline(math.log(VOCAB), ls=":", c="gray", label="ln 256 (uniform bytes)")
    ax.set_xlabel("step")
    ax.set_ylabel("next-byte cross-entropy")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"loss curve: {path}")


def main(argv=None, prog: str = "train_tiny_llama.py") -> int:
    sim = simulator_enabled()
    d = SIM_DEFAULTS if sim else GPU_DEFAULTS
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--text", help="a text file to learn (default: the repository's README.md)")
    p.add_argument("--steps", type=int, default=d["steps"])
    p.add_argument("--batch", type=int, default=d["batch"])
    p.add_argument("--seq", type=int, default=d["seq"], help="bytes a training window")
    p.add_argument("--hidden", type=int, default=d["hidden"])
    p.add_argument("--layers", type=int, default=d["layers"])
    p.add_argument("--lr", type=float, default=d["lr"], help="peak learning rate (AdamW)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample", type=int, default=4 if sim else 96,
                   help="bytes to generate after training (0: none)")
    p.add_argument("--out", default="loss.png", help="the loss plot (needs matplotlib)")
    args = p.parse_args(argv)

    if args.text:
        if not Path(args.text).is_file():
            p.error(f"--text {args.text}: no such file")
        source, data = args.text, Path(args.text).read_bytes()
    else:
        source, data = default_text()
    if sim:
        # the simulator polls at syncthreads(); Python's default 5 ms thread switch interval
        # would make every barrier wait that long (tests/conftest.py does the same)
        sys.setswitchinterval(1e-4)
        print("Running under the numba CUDA simulator (no GPU): every CUDA thread is an OS "
              "thread, so the defaults are a very small model and a few steps "
              f"({SIM_DEFAULTS}); the loss will barely move. On a GPU the defaults are "
              f"{GPU_DEFAULTS}.")
    try:
        cfg = tiny_config(args.hidden, args.layers, args.seq)
    except ValueError as e:
        p.error(str(e))
    n_params = sum(int(np.prod(s)) for name, s in llama_param_shapes(cfg).items()
                   if name != "lm_head.weight")          # tied to the embeddings
    print(f"text: {source} ({len(data)} bytes); model: {args.layers} layers, hidden "
          f"{args.hidden}, {cfg.num_attention_heads} heads ({cfg.num_key_value_heads} kv), "
          f"{n_params:,} params; {args.steps} steps of {args.batch} x {args.seq} bytes, "
          f"AdamW peak lr {args.lr}")
    on_step, close = _progress(args.steps)
    t0 = time.perf_counter()
    try:
        model, losses = train_tiny_llama(data, steps=args.steps, batch=args.batch, seq=args.seq,
                                         hidden=args.hidden, layers=args.layers, lr=args.lr,
                                         seed=args.seed, on_step=on_step)
    finally:
        close()
    dt = time.perf_counter() - t0
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} (ln 256 = {math.log(VOCAB):.4f}); "
          f"{args.steps} steps in {dt:.1f} s, {args.steps * args.batch * args.seq / dt:,.3g} "
          f"tokens/s{' (simulator)' if sim else ''}")
    if not all(math.isfinite(v) for v in losses):
        print("the loss is not finite: lower --lr", file=sys.stderr)
        return 1
    _plot(losses, args.out, f"tiny Llama on {Path(source).name}: {args.layers} layer"
                            f"{'s' if args.layers > 1 else ''}, hidden "
                            f"{args.hidden}")
    if args.sample > 0:
        prompt = np.frombuffer(data[:min(16, args.seq)], np.uint8).astype(np.int64)
        out = model.generate(prompt, args.sample, temperature=0.8, top_k=40, seed=args.seed)
        text = bytes(int(b) for b in out).decode("utf-8", errors="replace")
        print(f"sample (prompt {len(prompt)} bytes, then {args.sample} generated):\n{text}")
    return 0
