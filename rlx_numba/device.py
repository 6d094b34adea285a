"""Device discovery and the simulator switch.

Decided once, before numba.cuda is imported: numba reads NUMBA_ENABLE_CUDASIM when
``numba.cuda`` is first imported, so this module must run first (rlx_numba/__init__ does that).
The driver is probed through libcuda directly, so a machine without a GPU never imports
anything that could crash.
"""
from __future__ import annotations

import ctypes
import functools
import gc
import logging
import os
import sys
import threading

log = logging.getLogger("rlx_numba")

_probe: dict | None = None


def _probe_driver() -> dict:
    """Ask libcuda (not numba) whether a GPU is usable. Never raises."""
    global _probe
    if _probe is not None:
        return _probe
    info = {"ok": False, "count": 0, "why": ""}
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        info["why"] = f"no CUDA driver (libcuda.so.1: {e})"
    else:
        ver = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(ver)) == 0:
            info["driver_version"] = ver.value          # e.g. 13000 for CUDA 13.0
        rc = lib.cuInit(0)
        count = ctypes.c_int(0)
        if rc == 0:
            rc = lib.cuDeviceGetCount(ctypes.byref(count))
        if rc != 0:
            info["why"] = f"CUDA driver present but cuInit/cuDeviceGetCount returned {rc}"
        elif count.value == 0:
            info["why"] = "CUDA driver present but no GPU found"
        else:
            info.update(ok=True, count=count.value)
    _probe = info
    return info


def _decide_simulator() -> bool:
    forced = os.environ.get("RLX_NUMBA_SIMULATOR")
    if "numba.cuda" in sys.modules:  # someone imported numba.cuda first: its mode wins
        from numba import config

        on = bool(config.ENABLE_CUDASIM)
        if forced is not None and (forced == "1") != on:
            log.warning("RLX_NUMBA_SIMULATOR=%s ignored: numba.cuda was imported before rlx_numba "
                        "(simulator %s)", forced, "on" if on else "off")
        return on
    if forced in ("0", "1"):
        on = forced == "1"
    elif forced is not None:
        raise ValueError(f"RLX_NUMBA_SIMULATOR must be 0 or 1, got {forced!r}")
    elif os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        on = True
    else:
        probe = _probe_driver()
        on = not probe["ok"]
        if on:
            log.warning("rlx_numba: %s; kernels run in the numba CUDA simulator (slow, for "
                        "correctness only). Set RLX_NUMBA_SIMULATOR=0 to make this an error.",
                        probe["why"])
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1" if on else "0"
    # small test/demo launches are expected; numba's occupancy warning is noise here
    os.environ.setdefault("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "0")
    return on


SIMULATOR: bool = _decide_simulator()


def in_cuda_context(fn):
    """``fn`` run inside one scope of numba's CUDA context: every numba call it makes (a
    device array's slice or copy, a kernel's set-up, a device lookup) finds the context
    attached to the thread, where a call at top level asks the driver and takes numba's lock
    again (~4,000 such lookups cost 0.18 s of a warm SmolLM2-135M process's first generate
    under cProfile on an H200 host). Entry points wrap their whole call: a compile, a run, a
    set_param. The simulator has no context: ``fn`` as it is."""
    if SIMULATOR:
        return fn

    @functools.wraps(fn)
    def call(*args, **kw):
        from numba.cuda.cudadrv.devices import _runtime   # (numba's require_context, once)
        with _runtime.ensure_context():
            return fn(*args, **kw)
    return call


def gc_paused(fn):
    """``fn`` with the cyclic garbage collector paused for its call (restored after, unless
    it was off already): a compile allocates tens of thousands of objects that live on, and
    they set off full collections, each walking every object of the process (numba's
    included): one took 54 ms of compiling SmolLM2-135M's prefill and decode on the dev host.
    Its cycles are collected later, by the collections the allocations after it set off."""
    @functools.wraps(fn)
    def call(*args, **kw):
        was = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kw)
        finally:
            if was:
                gc.enable()
    return call


def out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is a device allocation failing: the driver's CUDA_ERROR_OUT_OF_MEMORY, a
    library's ALLOC_FAILED, or a cuDNN / cuSOLVER handle that could not be created (they say
    INTERNAL_ERROR when the memory a handle needs is missing)."""
    text = f"{type(e).__name__}: {e}"
    return ("OUT_OF_MEMORY" in text or "ALLOC_FAILED" in text
            or type(e).__name__ in ("CudnnError", "CusolverError") and "Create failed" in text)


def release_unreferenced() -> None:
    """Free the device memory nothing references any more: a cycle collection (an executable
    caught in a reference cycle holds its arena, its streams' library handles and workspaces
    until one runs), then numba's deallocations still pending (numba defers frees until
    they reach a fifth of the GPU's memory)."""
    gc.collect()
    if not SIMULATOR:
        from numba import cuda
        cuda.current_context().deallocations.clear()


def retry_out_of_memory(fn):
    """``fn``, called once more after ``release_unreferenced`` when it runs out of device
    memory: a process that compiles many graphs in turn (a service, the fuzzer) may hold
    executables it no longer references that the collector has not reached yet."""
    @functools.wraps(fn)
    def call(*args, **kw):
        try:
            return fn(*args, **kw)
        except Exception as e:  # noqa: BLE001 - re-raised unless it is out of memory
            if SIMULATOR or not out_of_memory(e):
                raise
            log.warning("rlx_numba: %s ran out of device memory (%s: %s); freeing what is no "
                        "longer referenced and trying once more", fn.__qualname__,
                        type(e).__name__, e)
            release_unreferenced()
            return fn(*args, **kw)
    return call


def when_stream_dies(stream, fn, *args) -> None:
    """Call ``fn(*args)`` when numba stream ``stream`` is collected (a library's handles and
    workspace bound to it go with it; not at exit, where the driver frees them). The null
    stream (None) never dies."""
    if stream is not None:
        import weakref
        weakref.finalize(stream, fn, *args).atexit = False


def byte_view(base, start: int, stop: int, dtype):
    """``base[start:stop].view(dtype)`` of a flat uint8 device array. On a GPU it is made
    directly from the memory pointer's view, as numba's slicing makes it: numba's
    ``__getitem__`` checks the CUDA context and slices its dummy array each time (23 us
    against 9 us a view on the dev host's CPU), and a compile takes one view a buffer
    (1,447 for SmolLM2-135M's prefill and decode executables)."""
    if (not SIMULATOR and base.ndim == 1 and base.strides == (1,) and base.dtype == "u1"
            and 0 <= start <= stop <= base.size):
        import numpy as np
        dtype = np.dtype(dtype)
        n, rem = divmod(stop - start, dtype.itemsize)
        if n and not rem:
            from numba.cuda.cudadrv.devicearray import DeviceNDArray
            return DeviceNDArray((n,), (dtype.itemsize,), dtype, stream=base.stream,
                                 gpu_data=base.gpu_data.view(start, stop))
    return base[start:stop].view(dtype)


def simulator_enabled() -> bool:
    """True when kernels run in the numba CUDA simulator."""
    return SIMULATOR


def driver_version() -> int | None:
    """The CUDA driver's version (12040 for 12.4), or None without a driver. Never raises."""
    try:
        return _probe_driver().get("driver_version")
    except Exception:  # noqa: BLE001
        return None


def simulator_reason() -> str:
    """Why kernels run in the simulator: the driver probe's answer, or the variable that
    forced it."""
    return _probe_driver()["why"] or "forced by RLX_NUMBA_SIMULATOR=1"


def is_available() -> bool:
    """True when a CUDA GPU and driver can run kernels. Never raises."""
    try:
        return bool(_probe_driver()["ok"])
    except Exception:  # noqa: BLE001 - the contract is "False, never a crash"
        return False


def device_info() -> dict:
    """Name, compute capability and SM count of the current device (or the simulator)."""
    if SIMULATOR:
        return {"name": "numba CUDA simulator", "cc": None, "sm_count": 1, "simulator": True}
    from numba import cuda

    dev = cuda.get_current_device()
    name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
    return {"name": name, "cc": dev.compute_capability,
            "sm_count": dev.MULTIPROCESSOR_COUNT, "simulator": False}


# The simulator has no shared memory limit; it stands for the sm_90 GPUs (H100 / H200) the
# kernels are tuned on
SIMULATOR_SHARED_PER_BLOCK = 227 << 10


def max_shared_per_block() -> int:
    """The bytes of shared memory a block of the current device may opt in to (dynamic shared
    memory past 48 KiB: 227 KiB on sm_90, 163 on sm_80, 99 on sm_86/89, 64 on sm_75)."""
    if SIMULATOR:
        return SIMULATOR_SHARED_PER_BLOCK
    from numba import cuda

    dev = cuda.get_current_device()
    try:
        return int(dev.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
    except AttributeError:   # a numba without the attribute's name: the driver's (97)
        cu = ctypes.CDLL("libcuda.so.1")
        handle, limit = ctypes.c_int(), ctypes.c_int()
        err = cu.cuDeviceGet(ctypes.byref(handle), dev.id) or \
            cu.cuDeviceGetAttribute(ctypes.byref(limit), 97, handle.value)
        if err:
            raise RuntimeError(f"cuDeviceGetAttribute(MAX_SHARED_MEMORY_PER_BLOCK_OPTIN) of "
                               f"device {dev.id} failed: CUresult {err}") from None
        return limit.value


# ---- interpreter exit ----------------------------------------------------------------------------
_EXIT_HOOKS: list = []
_exit_installed = False


def at_exit(fn):
    """Run ``fn`` once when the interpreter exits, before numba's exit handlers, the
    finalizers and the CUDA libraries' static destructors: what could race those (an NCCL
    communicator's proxy threads, work still queued on a stream) tears down here, in order.
    Hooks run newest first; one that raises is logged and the others still run."""
    _EXIT_HOOKS.append(fn)
    return fn


def run_exit_hooks() -> None:
    """The teardown ``at_exit`` hooks make, now (atexit calls it; a second call is a no-op)."""
    while _EXIT_HOOKS:
        fn = _EXIT_HOOKS.pop()
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - the remaining hooks must still run
            log.warning("rlx_numba: at exit, %s raised %s: %s",
                        getattr(fn, "__qualname__", fn), type(e).__name__, e)


_KEPT: list = []       # the entered defer_cleanup() of each context, held until the process ends


def _leave_device_memory_to_the_driver() -> None:
    """The last exit hook: numba's frees and module unloads stay deferred from here on. At exit
    weakref's finalizers unload every numba module (cuLibraryUnload) after the teardown of
    other libraries in the process (torch's, NCCL's) has run, and that crashed one
    ``rlx-numba launch --gpus 2 bench/bench_distributed.py`` in three on 2 x H200 (a segfault
    in cuLibraryUnload under weakref's exit function). The driver frees both with the
    process."""
    if SIMULATOR:
        return
    from numba.cuda.cudadrv.driver import driver
    for dev in list(driver.devices.values()):
        ctx = dev.primary_context
        if ctx is not None:
            deferred = ctx.defer_cleanup()
            deferred.__enter__()
            _KEPT.append(deferred)


def install_exit_teardown() -> None:
    """Register run_exit_hooks with atexit, after numba.cuda is imported (rlx_numba/__init__
    does it last), so that it runs before numba's handlers and before weakref's finalizers
    (numba.cuda's import registers their exit function; tests/test_faults.py checks the
    order). (No device-wide synchronize: a hung kernel would then hang the exit, where the
    driver's teardown ends it.)"""
    global _exit_installed
    if _exit_installed:
        return
    import atexit
    _exit_installed = True
    _EXIT_HOOKS.insert(0, _leave_device_memory_to_the_driver)   # hooks run newest first
    atexit.register(run_exit_hooks)


def patch_simulator() -> None:
    """Make the simulator's shared arrays safe: numba's FakeCUDAShared.array finds a block's
    array by (file, line) in a dict with an unlocked get-then-set, so two threads of a block
    could each create their own "shared" array (rare wrong results in row and sampling
    kernels). The same lookup under a lock, with the caller's frame read directly (also
    cheaper than the traceback numba extracts). ``alignment`` (which numba's raises on) is
    accepted: it only matters to the GPU compiler's vector loads."""
    import threading

    import numpy as np
    from numba.cuda.simulator import kernelapi
    from numba.np import numpy_support
    from numba.core import types

    cls = kernelapi.FakeCUDAShared
    if getattr(cls, "_rlx_locked", False):
        return
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        if shape == 0:   # dynamic shared memory: one buffer for all
            count = self._dynshared_size // np.dtype(dtype).itemsize
            return np.frombuffer(self._dynshared.data, dtype=dtype, count=count)
        f = sys._getframe(1)
        caller = (f.f_code.co_filename, f.f_lineno)
        with lock:
            res = self._allocations.get(caller)
            if res is None:
                res = self._allocations[caller] = np.empty(shape, dtype)
        return res

    cls.array = array
    cls._rlx_locked = True
    _patch_block_manager()
    _serialise_launches()


def _serialise_launches() -> None:
    """One simulated launch at a time: numba's simulator swaps a module's ``cuda`` global for
    the launch's fake module (only on the first of overlapping entries) and keeps the kernel
    context in a module global, so two threads launching at once (two executables run from
    two threads) would run one kernel with the other's grid. Device-function calls (from a
    kernel's block threads) pass straight through."""
    import threading

    from numba.cuda.simulator import kernel as K

    cls = K.FakeCUDAKernel
    if getattr(cls, "_rlx_serial", False):
        return
    call = cls.__call__
    lock = threading.Lock()

    def launch(self, *args):
        if self._device:
            return call(self, *args)
        with lock:
            return call(self, *args)

    cls.__call__ = launch
    cls._rlx_serial = True


def _patch_block_manager() -> None:
    """numba's simulator runs a block's threads as OS threads while its BlockManager polls
    them in a loop (is_alive and a syncthreads flag of every thread, over and over) to find
    when all are at a barrier or done: under the GIL that loop took about two thirds of a
    tiny Llama's forward (8.2 million is_alive calls in 33 s). Here each thread counts
    itself in under a condition when it reaches a barrier or ends, and the manager sleeps
    until all have -- the same semantics (a barrier releases when every thread still running
    waits at it; a thread's exception aborts the block and is raised), no polling."""
    import threading

    import numpy as np
    from numba.cuda.simulator import kernel as K

    BT, BM = K.BlockThread, K.BlockManager
    if getattr(BM, "_rlx_evented", False):
        return
    thread_run = BT.run        # runs the kernel, keeping its exception in self.exception

    def syncthreads(self):
        if self.abort:
            raise RuntimeError("abort flag set on syncthreads call")
        m = self._manager
        with m._rlx_cond:
            self.syncthreads_blocked = True
            m._rlx_blocked += 1
            if m._rlx_blocked + m._rlx_done == m._rlx_n:
                m._rlx_cond.notify()
        self.syncthreads_event.wait()
        self.syncthreads_event.clear()
        if self.abort:
            raise RuntimeError("abort flag set on syncthreads clear")

    def run_thread(self):
        try:
            thread_run(self)
        finally:
            m = self._manager
            with m._rlx_cond:
                m._rlx_done += 1
                m._rlx_failed += self.exception is not None
                if m._rlx_failed or m._rlx_blocked + m._rlx_done == m._rlx_n:
                    m._rlx_cond.notify()

    def run_block(self, grid_point, *args):
        if not self._debug and thread_free(self._f):
            return _run_inline(self, self._f, self._block_dim, grid_point, args)

        def target():
            self._f(*args)
        threads = [BT(target, self, grid_point, bp, self._debug)
                   for bp in np.ndindex(*self._block_dim)]
        cond = self._rlx_cond = threading.Condition()
        self._rlx_n, self._rlx_blocked, self._rlx_done, self._rlx_failed = len(threads), 0, 0, 0
        for t in threads:
            t.start()
        with cond:
            while True:
                while not (self._rlx_failed or self._rlx_blocked + self._rlx_done == self._rlx_n):
                    cond.wait()
                if self._rlx_failed:
                    for t in threads:          # abort the others (not joined, as numba's)
                        t.abort = True
                        t.syncthreads_blocked = False
                        t.syncthreads_event.set()
                    bad = next(t for t in threads if t.exception)
                    raise bad.exception[0].with_traceback(bad.exception[1])
                if self._rlx_done == self._rlx_n:
                    return
                for t in threads:              # every running thread waits at the barrier
                    if t.syncthreads_blocked:
                        t.syncthreads_blocked = False
                        t.syncthreads_event.set()
                self._rlx_blocked = 0

    BT.syncthreads, BT.run, BM.run = syncthreads, run_thread, run_block
    BM._rlx_evented = True


# ---- blocks without barriers run their threads one after another, in the calling thread ----------
# Starting an OS thread a simulated thread cost most of the suite's time (12,528 thread starts
# took 13 of 21 s over 230 ONNX node cases), and an element-wise kernel's threads never meet.
# A kernel that can reach no barrier, warp collective or rendezvous twin (kernels/mma.py) runs
# each thread to its end in turn: the same results, as its threads never wait for one another.
_COLLECTIVE = frozenset({
    "syncthreads", "syncthreads_count", "syncthreads_and", "syncthreads_or", "syncwarp",
    "shfl_sync", "shfl_up_sync", "shfl_down_sync", "shfl_xor_sync", "shfl_idx_sync",
    "all_sync", "any_sync", "eq_sync", "ballot_sync", "match_any_sync", "match_all_sync",
    "activemask", "lanemask_lt", "cg", "this_grid",
    # the simulator twins that rendezvous across a warp read the OS thread they run on
    "threading", "current_thread", "Condition", "Barrier", "Event"})
_LIBRARIES = ("numpy", "numba", "math", "cmath", "ml_dtypes", "builtins", "operator")
_FREE: "weakref.WeakKeyDictionary" = None


def thread_free(f) -> bool:
    """True when kernel function ``f`` (a simulator kernel's Python function) can reach none of
    _COLLECTIVE's names through its code, nested code, closure cells and the functions, device
    functions and rlx_numba modules it names (libraries are not entered: a kernel reaches a
    collective only through ``cuda.<name>`` or a twin, both seen by name)."""
    import weakref
    global _FREE
    if _FREE is None:
        _FREE = weakref.WeakKeyDictionary()
    try:
        return _FREE[f]
    except (KeyError, TypeError):
        pass
    free = not _reaches_collective(f, set())
    try:
        _FREE[f] = free
    except TypeError:
        pass
    return free


def _reaches_collective(obj, seen) -> bool:
    import types
    if id(obj) in seen:
        return False
    seen.add(id(obj))
    inner = getattr(obj, "fn", None) or getattr(obj, "py_func", None)   # a device function
    if inner is not None and not isinstance(obj, types.FunctionType):
        return _reaches_collective(inner, seen)
    if isinstance(obj, (tuple, list, dict)):     # device functions kept in a table
        return any(_reaches_collective(o, seen)
                   for o in (obj.values() if isinstance(obj, dict) else obj))
    if not isinstance(obj, types.FunctionType) or \
            (obj.__module__ or "").split(".")[0] in _LIBRARIES:
        return False
    cells = {n: c.cell_contents for n, c in zip(obj.__code__.co_freevars, obj.__closure__ or ())
             if _filled(c)}
    return _code_reaches(obj.__code__, {**obj.__globals__, **cells}, seen, tuple(cells))


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _code_reaches(code, glb, seen, free=()) -> bool:
    """``code`` (or code nested in it) names a collective, or a global or free variable
    ``free`` of it (looked up in ``glb``) reaches one."""
    import types
    names = code.co_names
    if _COLLECTIVE.intersection(names):
        return True
    for name in names + tuple(free):
        v = glb.get(name)
        if isinstance(v, types.ModuleType):
            if v.__name__.startswith("rlx_numba"):       # attributes it may be asked for
                if any(_reaches_collective(getattr(v, a), seen) for a in names
                       if a in v.__dict__):
                    return True
        elif v is not None and _reaches_collective(v, seen):
            return True
    return any(_code_reaches(c, glb, seen, c.co_freevars) for c in code.co_consts
               if isinstance(c, types.CodeType))


def _run_inline(manager, f, block_dim, grid_point, args) -> None:
    """Run every thread of ``manager``'s block (a BlockManager of the thread-free kernel
    function ``f``, ``block_dim`` its 3 dims) in turn in the calling thread, which takes each simulated thread's identity meanwhile (the
    fake cuda module reads threadIdx / blockIdx / thread_id from the current thread). An
    exception is raised as a BlockThread reports it: tid and ctaid in front."""
    import numpy as np
    from numba.cuda.simulator.kernelapi import Dim3
    cur = threading.current_thread()
    keep = {k: cur.__dict__[k] for k in _IDENTITY if k in cur.__dict__}
    bx, by, _ = block_dim
    cur.blockIdx, cur._manager = Dim3(*grid_point), manager
    try:
        for bp in np.ndindex(*block_dim):
            cur.threadIdx, cur.thread_id = Dim3(*bp), bp[0] + bx * (bp[1] + by * bp[2])
            try:
                f(*args)
            except Exception as e:
                msg = f"tid={list(bp)} ctaid={list(grid_point)}" + (f": {e}" if str(e) else "")
                try:
                    err = type(e)(msg)
                except Exception:  # noqa: BLE001 - a type that takes other arguments
                    raise e from None
                raise err.with_traceback(e.__traceback__) from None
    finally:
        for k in _IDENTITY:
            cur.__dict__.pop(k, None)
        cur.__dict__.update(keep)


_IDENTITY = ("blockIdx", "threadIdx", "thread_id", "_manager")


# ---- the communicator of this thread / process ---------------------------------------------------
# rlx_numba.distributed sets it (init: the process's; run_ranks: each rank thread's); the graph's
# collective builders (ir/ops_dist.py) read it for the rank and world size
_comm_local = threading.local()
_comm_process = None


def current_comm(process_wide: bool = False):
    """This thread's communicator, else the process-wide one, else None."""
    comm = None if process_wide else getattr(_comm_local, "comm", None)
    return comm if comm is not None else _comm_process


def set_current_comm(comm, process_wide: bool = False) -> None:
    global _comm_process
    if process_wide:
        _comm_process = comm
    else:
        _comm_local.comm = comm
