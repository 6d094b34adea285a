"""Long-run soak (issue 36): many generated tokens and many train steps in one process, with the
host's resident memory, the device memory in use and the model's compiled graphs printed as
they go; exits 1 if any of them grew after the warm-up by more than ``--slack`` (bytes) or
at all (graphs).

    python tools/soak.py [--tokens 100000] [--steps 5000] [--graphs 0] [--config smollm2|tiny]
        [--new 128] [--batch 1] [--train-batch 8 --seq 256] [--slack 64e6] [--trace N]

``--graphs N`` first compiles, runs and drops N small graphs (a product, a convolution and
a solve whose shapes cycle through 60 distinct ones, in stream, graph and multistream modes),
as a service compiling graph after graph does; what is cached per distinct shape (kernels,
tuning verdicts, library plans) fills during the first cycle, so with N >= 600 the baseline
(the first tenth) comes after it; its count column is the live cuBLAS / cuDNN / cuSOLVER
handles, which must not grow. ``--trace N`` prints, after each phase, the N places whose
live Python allocations grew most from the baseline on (tracemalloc, which slows the run).

Generation runs ``generate`` of ``--new`` tokens (random prompts of varying lengths within one
bucket, so the same graphs serve every call) until ``--tokens`` are made; training runs
``--steps`` AdamW steps of the model's trainer on random ids. The first tenth of each is the
warm-up (compiles, allocator pools). In the simulator use --config tiny and small counts."""
from __future__ import annotations

import argparse
import os
import tracemalloc
import sys
import time
from pathlib import Path

import numpy as np

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
               rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            tie_word_embeddings=True)


def rss() -> int:
    """This process's resident bytes now (Linux /proc; 0 elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def device_used() -> int:
    """Device bytes in use (free/total of the context; 0 in the simulator)."""
    import rlx_numba as rlx
    if rlx.simulator_enabled():
        return 0
    from numba import cuda
    free, total = cuda.current_context().get_memory_info()
    return total - free


class Watch:
    """Rows of (done, rss, device, count); the baseline is the first row after warm-up.
    ``count()``: what must not grow at all (the model's compiled graphs, or live library
    handles), named ``counted``."""

    def __init__(self, what: str, total: int, count, counted: str = "graphs", trace: int = 0):
        self.what, self.total, self.count, self.counted = what, total, count, counted
        self.trace, self.snap = trace, None
        self.base = None
        self.worst = (0, 0, 0)
        print(f"{'':8}{what:>10} {'host MiB':>10} {'device MiB':>11} {counted:>7} {'s':>8}")
        self.t0 = time.perf_counter()

    def row(self, done: int) -> None:
        now = (rss(), device_used(), self.count())
        if self.base is None and done >= self.total // 10:
            self.base = now
            if self.trace:         # what is allocated from here on and still alive at the end
                tracemalloc.start(25)
                self.snap = tracemalloc.take_snapshot()
        if self.base is not None:
            self.worst = tuple(max(w, n - b) for w, n, b in zip(self.worst, now, self.base))
        print(f"{'':8}{done:>10} {now[0] / 2**20:>10.1f} {now[1] / 2**20:>11.1f} {now[2]:>7} "
              f"{time.perf_counter() - self.t0:>8.1f}", flush=True)

    def ok(self, slack: float) -> bool:
        host, dev, graphs = self.worst
        good = host <= slack and dev <= slack and graphs == 0
        print(f"{self.what}: after warm-up host +{host / 2**20:.1f} MiB, device "
              f"+{dev / 2**20:.1f} MiB, {self.counted} +{graphs}: {'flat' if good else 'GREW'}")
        if self.snap is not None:
            self.report_growth()
        return good

    def report_growth(self) -> None:
        """The ``trace`` places whose live Python allocations grew most since the baseline,
        each with the innermost frames that made them (--trace)."""
        grown = [s for s in tracemalloc.take_snapshot().compare_to(self.snap, "traceback")
                 if s.size_diff > 0][:self.trace]
        tracemalloc.stop()
        self.snap = None
        for s in grown:
            print(f"  +{s.size_diff / 1024:.1f} KiB in {s.count_diff:+d} blocks, made at:")
            for line in s.traceback.format(limit=8):
                print(f"    {line}")


def live_handles() -> int:
    """cuBLAS, cuDNN and cuSOLVER handles alive in this process (0 in the simulator)."""
    from rlx_numba import cudnn, cusolver
    from rlx_numba.cublas import gemm
    return gemm.live_handles() + cudnn.live_handles() + cusolver.live_handles()


CHURN_SHAPES = 60   # distinct graphs the churn cycles through (per-shape caches fill in one)


def churn_graph(rlx, i: int, rng):
    """The i-th of a stream of small graphs a long-lived service might compile: a product
    (cuBLAS), a convolution (cuDNN) and a solve (cuSOLVER), with shapes that change from one
    to the next through CHURN_SHAPES distinct ones; (graph, inputs)."""
    j = i % CHURN_SHAPES
    m, c = 8 + j, 3 + j % 5
    g = rlx.Graph(f"churn{i}")
    x, w = g.input("x", (m, 64)), g.input("w", (64, 32))
    img, k = g.input("img", (1, c, 12, 12)), g.input("k", (4, c, 3, 3))
    a, b = g.input("a", (2, 8, 8)), g.input("b", (2, 8, 3))
    g.set_outputs([g.matmul(x, w), g.conv(img, k, padding=1), g.linalg_solve(a, b)])
    inputs = {"x": rng.standard_normal((m, 64), np.float32),
              "w": rng.standard_normal((64, 32), np.float32),
              "img": rng.standard_normal((1, c, 12, 12), np.float32),
              "k": rng.standard_normal((4, c, 3, 3), np.float32),
              "a": (rng.standard_normal((2, 8, 8)) + 8 * np.eye(8)).astype(np.float32),
              "b": rng.standard_normal((2, 8, 3), np.float32)}
    return g, inputs


def load_model(name: str):
    """(config, a LlamaForCausalLM of that config with random weights)."""
    from rlx_numba.models import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(**(SMOLLM2 if name == "smollm2" else TINY))
    return cfg, LlamaForCausalLM.from_config(cfg, seed=0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=100_000)
    p.add_argument("--steps", type=int, default=5_000)
    p.add_argument("--config", choices=["smollm2", "tiny"], default="smollm2")
    p.add_argument("--new", type=int, default=128, help="tokens a generate call makes")
    p.add_argument("--batch", type=int, default=1, help="generation batch")
    p.add_argument("--train-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--graphs", type=int, default=0, help="distinct graphs to compile, run and "
                   "drop first (a service compiling graph after graph)")
    p.add_argument("--slack", type=float, default=64e6, help="bytes of growth allowed")
    p.add_argument("--trace", type=int, default=0, metavar="N", help="after each phase, the N "
                   "places whose live Python allocations grew most since the baseline "
                   "(tracemalloc from the baseline on: slower)")
    p.add_argument("--every", type=int, default=0, help="rows every N tokens / steps "
                                                        "(default: ten rows)")
    args = p.parse_args(argv)
    import rlx_numba as rlx
    from rlx_numba.device import release_unreferenced
    rng = np.random.default_rng(0)
    good = True
    if args.graphs:       # compile, run and drop distinct graphs, each mode in turn
        modes = ("stream", "graph", "multistream")
        w = Watch("graphs", args.graphs, live_handles, "handles", args.trace)
        every = args.every or max(1, args.graphs // 10)
        for i in range(1, args.graphs + 1):
            g, inputs = churn_graph(rlx, i, rng)
            rlx.compile(g, exec_mode=modes[i % len(modes)]).run(inputs)
            if i % every == 0 or i == args.graphs:
                release_unreferenced()     # what a dropped executable held, freed now
                w.row(i)
        good &= w.ok(args.slack)
    if not (args.tokens or args.steps):
        return 0 if good else 1
    cfg, model = load_model(args.config)
    if args.tokens:
        w = Watch("tokens", args.tokens, lambda: model.cached_executables, trace=args.trace)
        every, done, mark = args.every or max(1, args.tokens // 10), 0, 0
        while done < args.tokens:
            plen = int(rng.integers(25, 33))          # one prompt bucket: the same graphs
            model.generate(rng.integers(0, cfg.vocab_size, (args.batch, plen)), args.new)
            done += args.batch * args.new
            if done - mark >= every or done >= args.tokens:
                w.row(done)
                mark = done
        good &= w.ok(args.slack)
    if args.steps:
        tr = model.trainer(args.train_batch, args.seq, rlx.optim.AdamW(1e-4))
        w = Watch("steps", args.steps, lambda: model.cached_executables, trace=args.trace)
        every = args.every or max(1, args.steps // 10)
        for s in range(1, args.steps + 1):
            tr.step(rng.integers(0, cfg.vocab_size, (args.train_batch, args.seq)))
            if s % every == 0 or s == args.steps:
                w.row(s)
        good &= w.ok(args.slack)
    return 0 if good else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
