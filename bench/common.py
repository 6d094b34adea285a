"""Shared pieces of the GPU benchmarks: CUDA-event timing for rlx steps and torch calls."""
from __future__ import annotations

import gc
import math
import time


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


def write_results(path, torch, rows) -> None:
    """The rows as JSON at ``path`` (its folder made), with the GPU's name."""
    import json
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), rows=rows), indent=1))
    print(f"\nwrote {path}")
