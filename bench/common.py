"""Shared pieces of the GPU benchmarks: CUDA-event timing for rlx steps and torch calls, and
the results file each bench rewrites as its rows complete."""
from __future__ import annotations

import gc
import json
import math
import os
import time
from pathlib import Path


def time_rlx(cuda, launch, stream, iters: int, warmup: int, repeats: int) -> float:
    """Mean ms per launch of ``launch()`` (which enqueues on ``stream``), best of ``repeats``."""
    for _ in range(warmup):
        launch()
    stream.synchronize()
    best = math.inf
    for _ in range(repeats):
        e0, e1 = cuda.event(), cuda.event()   # timing=True is the default
        e0.record(stream)
        for _ in range(iters):
            launch()
        e1.record(stream)
        e1.synchronize()
        best = min(best, cuda.event_elapsed_time(e0, e1) / iters)
    return best


def sweep_candidate(torch, cuda, label, geo, make_launch, stream, iters: int, out, ref, kind: str,
                    flops: float, torch_ms: float, extra: str = "") -> bool:
    """Time and check one tensor-core geometry of a sweep and print its row: ``make_launch()``
    gives a ``launch(stream)`` (with ``.vec``) writing the torch tensor ``out``, zeroed first
    (a candidate that writes nothing reads WRONG); ok within a few half roundings of the f32
    ``ref`` (2e-2 bf16, 4e-3 f16). False after a CUDA fault: the context is unusable, every
    later call would fail the same way."""
    from numba.cuda.cudadrv.driver import CudaAPIError
    cand = (geo.bm, geo.bn, geo.bk, geo.wm, geo.wn, geo.stages, geo.min_blocks)
    out.zero_()
    torch.cuda.synchronize()
    try:
        launch = make_launch()
        ms = time_rlx(cuda, lambda: launch(stream), stream, iters, 2, 3)
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        ok = err <= (2e-2 if kind == "bf16" else 4e-3)
        print(f"  {label} {cand}: {flops / ms / 1e9:6.0f} TFLOP/s {ms * 1e3:8.1f} us  "
              f"{torch_ms / ms:5.3f}x torch  err {err:.1e} {'ok' if ok else 'WRONG'}  "
              f"{'cp.async' if launch.vec else 'element loads'}{extra}", flush=True)
    except CudaAPIError as e:
        print(f"  {label} {cand}: CUDA ERROR {e}; the context is unusable, stopping", flush=True)
        return False
    except Exception as e:  # noqa: BLE001 - report the candidate, keep going
        print(f"  {label} {cand}: ERROR {type(e).__name__}: {e}", flush=True)
    return True


def time_torch(torch, fn, iters: int, warmup: int, repeats: int) -> float:
    """Mean ms per call of ``fn()`` on torch's current stream, best of ``repeats``."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(repeats):
        e0 = torch.cuda.Event(enable_timing=True)
        e1 = torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(iters):
            fn()
        e1.record()
        e1.synchronize()
        best = min(best, e0.elapsed_time(e1) / iters)
    return best


def dist_version(name: str) -> str:
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:  # noqa: BLE001 - informational only
        return "?"


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


SETTLE_S = 2.0


def free_device_memory(cuda, torch):
    """Free what the last row left (torch's cache, numba's deferred frees). After a release of
    gigabytes the GPU runs slower for a second or so: on an H100, decode Sk1024 took 34.9 us
    and torch's 463 us right after freeing 20 GB, 30.8 and 423 two seconds later (bench_attention's
    GQA prefill rows free ~17 GB just before its decode rows); so wait SETTLE_S then."""
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    try:  # numba defers frees; flush them so the next op starts from a clean heap
        cuda.current_context().deallocations.clear()
    except Exception:  # noqa: BLE001 - best effort
        pass
    if before - torch.cuda.memory_reserved() > 1 << 30:
        time.sleep(SETTLE_S)


def copy_bandwidth(torch, n: int = 1 << 27) -> float:
    """GB/s of torch's f32 copy_ (one read and one write), the device's practical ceiling."""
    a, c = torch.empty(n, device="cuda"), torch.empty(n, device="cuda")
    gb = gbps(8 * n, time_torch(torch, lambda: c.copy_(a), 20, 3, 3))
    del a, c
    return gb


def write_json(path, doc) -> None:
    """``doc`` as JSON at ``path`` (its folder made), whole or not at all: written to a temporary
    file beside it, then renamed over it, so a bench stopped mid-write leaves the last good one.
    Non-finite floats become null (strict JSON); what json cannot write goes as its str."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(_finite(doc), indent=1, default=str, allow_nan=False) + "\n"
    # not *.json: the report skips it (and removes one a bench stopped here left)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _finite(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


class Results:
    """A bench's JSON, rewritten whole after each row or part (``save``), so that a bench stopped
    by its time limit or a fault leaves the rows it finished; ``complete`` is false in it until
    ``done``. ``fields`` are the bench's top-level fields (gpu, copy_gbps, results, ...): a list
    among them is the bench's own, which it appends its rows to, and each write takes it as it
    stands then."""

    def __init__(self, path, **fields):
        self.path, self.fields = path, fields

    def save(self, **fields) -> None:
        """Rewrite the file with the rows so far (``fields`` added or replaced first)."""
        self.fields.update(fields)
        write_json(self.path, dict(self.fields, complete=False))

    def done(self, **fields) -> None:
        """The last write: ``complete`` true."""
        self.fields.update(fields)
        write_json(self.path, dict(self.fields, complete=True))
        print(f"\nwrote {self.path}")

    def run_parts(self, parts, only, rows) -> None:
        """Each (name, fn) of ``parts`` that ``only`` names (comma-separated; None: all), the
        file rewritten after each (a part's rows kept should a later one pass the time limit),
        with the seconds each took (``part_seconds``: what a time limit must allow); then
        ``done`` and how many of ``rows`` (dicts with "pass") pass."""
        took = self.fields.setdefault("part_seconds", {})
        for name, run in parts:
            if only is None or name in only.split(","):
                t0 = time.perf_counter()
                run()
                took[name] = round(took.get(name, 0.0) + time.perf_counter() - t0, 1)
                print(f"[{name}: {took[name]:.0f} s]", flush=True)
                self.save()
        self.done()
        fails = sum(not r["pass"] for r in rows)
        print(f"{len(rows) - fails}/{len(rows)} rows pass")
