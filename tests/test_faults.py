"""Faults an operator of a long-lived service meets (issue 36): one executable run from two
threads at once, two executables from two threads, a KeyboardInterrupt in the middle of a run,
the interpreter's exit (the teardown device.at_exit orders)."""
import os
import threading

import numpy as np
import pytest

import rlx_numba as rlx
from rlx_numba.device import SIMULATOR


def _exe(mode="stream"):
    g = rlx.Graph("faults")
    x = g.input("x", (5, 3))
    g.set_outputs([g.reduce_sum(x * 2.0 + 1.0, [1])])
    return rlx.compile(g, exec_mode=mode)


def test_one_executable_from_two_threads_serialises():
    """Each thread gets the results of its own inputs: runs share the arena, so run() holds
    the executable for the whole run (bind, launch, copy back)."""
    exe = _exe()
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        for _ in range(6):
            xv = rng.standard_normal((5, 3)).astype(np.float32)
            (got,) = exe.run({"x": xv})
            if not np.allclose(got, (xv.astype(np.float64) * 2 + 1).sum(1), rtol=1e-5, atol=1e-5):
                errors.append(seed)
    threads = [threading.Thread(target=worker, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


@pytest.mark.parametrize("mode", ["stream", "graph"])
def test_two_executables_from_two_threads(mode):
    """Two executables (their own arenas and streams) run at once from two threads, each
    compiled in its thread too: every result is its own inputs' (a softmax row kernel and a
    matmul with a reduction, different shapes)."""
    errors, exes = [], {}

    def build(which):
        g = rlx.Graph(f"faults_{which}")
        if which == 0:
            x = g.input("x", (4, 9))
            g.set_outputs([g.softmax(x * 3.0, -1)])
        else:
            x = g.input("x", (6, 5))
            g.set_outputs([g.reduce_sum(x @ g.constant(np.eye(5, 3, dtype=np.float32)), [1])])
        exes[which] = rlx.compile(g, exec_mode=mode)

    def want(which, xv):
        x64 = xv.astype(np.float64)
        if which == 0:
            z = np.exp(3 * x64 - (3 * x64).max(-1, keepdims=True))
            return z / z.sum(-1, keepdims=True)
        return x64[:, :3].sum(1)

    def worker(which):
        try:
            build(which)
            rng = np.random.default_rng(which)
            for _ in range(5):
                xv = rng.standard_normal((4, 9) if which == 0 else (6, 5)).astype(np.float32)
                (got,) = exes[which].run({"x": xv})
                if not np.allclose(got, want(which, xv), rtol=1e-5, atol=1e-6):
                    errors.append((which, "wrong"))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append((which, repr(e)))
    threads = [threading.Thread(target=worker, args=(w,)) for w in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.parametrize("mode", ["stream", "eager", "graph"])
def test_keyboard_interrupt_leaves_the_executable_usable(mode, monkeypatch):
    """A KeyboardInterrupt raised by a step's launch (Ctrl-C while steps are enqueued)
    propagates, and the next runs give the right results. On a GPU, GRAPH mode launches
    copies of the steps (runtime/cudagraph.py ``_launcher``) in its first, uncaptured run and
    then captures: the interrupt hits that first run, and the next run captures anew."""
    from rlx_numba.runtime import cudagraph
    fired = []

    def interrupting(launch):
        def go():
            if not fired:
                fired.append(1)
                raise KeyboardInterrupt
            return launch()
        return go
    real_launcher = cudagraph._launcher
    monkeypatch.setattr(cudagraph, "_launcher", lambda s, st: interrupting(real_launcher(s, st)))
    exe = _exe(mode)
    xv = np.arange(15, dtype=np.float32).reshape(5, 3)
    want = (xv.astype(np.float64) * 2 + 1).sum(1)
    step = exe.steps[-1]
    if exe._runner is None:            # STREAM, EAGER (and every mode in the simulator)
        step.compile()
        step.launch = interrupting(step.launch)
    with pytest.raises(KeyboardInterrupt):
        exe.run({"x": xv})
    assert fired
    np.testing.assert_allclose(exe.run({"x": xv})[0], want, rtol=1e-6)
    np.testing.assert_allclose(exe.run({"x": xv + 1})[0], want + 6, rtol=1e-6)


EXIT_SCRIPT = r"""
import rlx_numba
from rlx_numba import device
from rlx_numba.distributed import comm as C

class FakeNccl:
    def ncclCommAbort(self, handle):
        print("abort", handle, flush=True)
    def ncclCommDestroy(self, handle):
        print("destroy", handle, flush=True)

def fake(rank, handle):
    c = object.__new__(C.NcclCommunicator)
    c.rank, c.world_size, c.lib, c.handle = rank, 2, FakeNccl(), handle
    C._OPEN_NCCL.add(c)
    return c

left_open, closed = fake(0, "h0"), fake(1, "h1")
closed.close()                                     # destroyed by the user: not aborted again
device.at_exit(lambda: print("hook 1", flush=True))
@device.at_exit
def broken():
    raise RuntimeError("boom")
device.at_exit(lambda: print("hook 3", flush=True))
print("exiting", flush=True)
"""


def test_exit_teardown_aborts_open_communicators_in_order():
    """At interpreter exit the at_exit hooks run newest first, before numba's handlers; one
    that raises is logged and the rest still run; an NCCL communicator still open is aborted
    (with a warning naming the fix), one the user closed is left alone. A subprocess (the
    simulator: the NCCL library is a stand-in)."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "RLX_NUMBA_SIMULATOR": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["destroy h1", "exiting", "hook 3", "hook 1", "abort h0"], \
        (r.stdout, r.stderr)
    assert "broken raised RuntimeError: boom" in r.stderr, r.stderr
    assert "NCCL communicator of rank 0 of 2 still open at exit: aborted" in r.stderr, r.stderr


ORDER_SCRIPT = r"""
import weakref
import rlx_numba
from rlx_numba import device


class Held:
    pass


held = Held()
weakref.finalize(held, print, "finalizer", flush=True)   # made after rlx_numba's import
device.at_exit(lambda: print("hook", flush=True))
"""


def test_exit_hooks_run_before_the_finalizers():
    """The exit hooks run before weakref's finalizers (numba's module unloads and frees are
    finalizers), even for a finalizer made after rlx_numba's import: atexit runs the last
    registered first, and numba.cuda's import (before rlx_numba's handler) registers
    weakref's exit function."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", ORDER_SCRIPT], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "RLX_NUMBA_SIMULATOR": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["hook", "finalizer"], (r.stdout, r.stderr)


@pytest.mark.skipif(SIMULATOR, reason="numba's contexts: a GPU")
def test_exit_leaves_device_memory_to_the_driver():
    """The last exit hook keeps numba's frees and module unloads deferred for every context
    numba made (the driver frees them with the process): after it, a context's pending
    deallocations are disabled."""
    import subprocess
    import sys
    script = ("import numpy as np, rlx_numba\nfrom numba import cuda\nfrom rlx_numba import device\n"
              "a = cuda.to_device(np.ones(4))\ndevice.run_exit_hooks()\n"
              "print(cuda.current_context().deallocations.is_disabled)\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True"], (r.stdout, r.stderr)


def test_out_of_memory_is_told_apart():
    """What counts as running out of device memory: the driver's error, a library's
    ALLOC_FAILED, a cuDNN / cuSOLVER handle that could not be made; nothing else."""
    from rlx_numba.device import out_of_memory

    class CudnnError(RuntimeError):
        pass

    assert out_of_memory(RuntimeError("cuGraphInstantiate failed: CUDA_ERROR_OUT_OF_MEMORY"))
    assert out_of_memory(RuntimeError("cublasCreate_v2 failed: CUBLAS_STATUS_ALLOC_FAILED (3)"))
    assert out_of_memory(CudnnError("cudnnCreate failed: cuDNN status 4000 INTERNAL_ERROR"))
    assert not out_of_memory(CudnnError("cudnnConvolutionForward failed: BAD_PARAM"))
    assert not out_of_memory(ValueError("matmul: shapes [2, 3] and [4, 5] do not agree"))


def test_out_of_memory_retries_once_after_freeing(monkeypatch, caplog):
    """A compile that runs out of device memory runs once more after the unreferenced
    executables are collected and numba's pending frees flushed; any other error, or a
    second failure, reaches the caller as it is."""
    from rlx_numba import device
    freed = []
    monkeypatch.setattr(device, "SIMULATOR", False)
    monkeypatch.setattr(device, "release_unreferenced", lambda: freed.append(1))
    calls = []

    @device.retry_out_of_memory
    def flaky(fail):
        calls.append(1)
        if len(calls) <= fail:
            raise RuntimeError("cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY")
        return "built"

    assert flaky(1) == "built" and len(calls) == 2 and freed == [1]
    assert "ran out of device memory" in caplog.text
    calls.clear()
    with pytest.raises(RuntimeError, match="OUT_OF_MEMORY"):
        flaky(2)
    assert len(calls) == 2 and freed == [1, 1]

    @device.retry_out_of_memory
    def wrong():
        calls.append(1)
        raise ValueError("matmul: bad shapes")

    calls.clear()
    with pytest.raises(ValueError):
        wrong()
    assert len(calls) == 1 and freed == [1, 1]


def test_cudnn_handle_goes_idle_with_its_stream_and_serves_the_next(monkeypatch):
    """A stream's cuDNN handle and workspace go idle when the stream dies and the next new
    stream takes them (cudnnSetStream to it) instead of a cudnnCreate; two live streams
    have two handles; nothing is destroyed; a grown workspace goes with its stream. A
    recording stand-in for libcudnn, so it runs without a GPU."""
    import ctypes
    import gc

    from numba import cuda

    from rlx_numba import cudnn
    calls = []

    class Lib:
        def cudnnCreate(self, ref):
            ref._obj.value = 1000 + sum(c[0] == "create" for c in calls)
            calls.append(("create", ref._obj.value))

        def cudnnSetStream(self, h, s):
            calls.append(("set", h.value, s.value))

        def cudnnDestroy(self, h):
            calls.append(("destroy", h.value))

    class Buf:            # a device allocation (the simulator's have no device pointer)
        def __init__(self, size, dtype):
            self.size, self.device_ctypes_pointer = size, ctypes.c_void_p(id(self))

    gc.collect()
    monkeypatch.setattr(cuda, "device_array", Buf)
    monkeypatch.setattr(cudnn, "lib", Lib)
    monkeypatch.setattr(cudnn, "_key", lambda s: (0, id(s)))
    monkeypatch.setattr(cudnn, "WORKSPACE_BYTES", 16)
    for name in ("_handles", "_idle", "_big_ws"):
        monkeypatch.setattr(cudnn, name, {})
    s1, s2 = cuda.stream(), cuda.stream()
    h1, _ = cudnn.handle(s1)
    h2, _ = cudnn.handle(s2)
    assert h1.value != h2.value and cudnn.live_handles() == 2
    assert cudnn.handle(s1)[0] is h1                      # the stream's own, every time
    cudnn.workspace(s1, 64)                               # grown past WORKSPACE_BYTES
    assert len(cudnn._big_ws) == 1
    del s1
    gc.collect()
    assert cudnn.live_handles() == 2 and not cudnn._big_ws
    s3 = cuda.stream()
    h3, _ = cudnn.handle(s3)
    assert h3 is h1 and calls[-1] == ("set", h1.value, id(s3))
    assert [c[0] for c in calls].count("create") == 2
    assert not any(c[0] == "destroy" for c in calls)
    del s2, s3


@pytest.mark.skipif(SIMULATOR, reason="cuDNN / cuSOLVER handles: a GPU")
def test_library_handles_go_with_their_stream():
    """cuBLAS and cuSOLVER handles (and workspaces) made for a stream are destroyed when the
    stream is collected, and a cuDNN handle goes idle for the next stream (cudnnCreate +
    cudnnDestroy leaves host memory behind): a process compiling executable after
    executable, each with streams of its own, must not keep them all."""
    import gc

    from numba import cuda

    from rlx_numba import cudnn, cusolver
    from rlx_numba.cublas import gemm
    gc.collect()                  # no other dead stream goes idle during the test
    s = cuda.stream()
    key = (cuda.get_current_device().id, int(s))
    gemm.blas_handle(s, False)
    solver = cusolver.available()[0]
    if solver:
        cusolver.handle(s)
    assert any(k[:2] == key for k in gemm._blas) and (not solver or key in cusolver._handles)
    if cudnn.available()[0]:
        before = cudnn.live_handles()
        first, _ = cudnn.handle(s)
        made = cudnn.live_handles()
        assert made in (before, before + 1)
    del s
    gc.collect()
    assert not any(k[:2] == key for k in gemm._blas) and key not in gemm._ws
    assert not solver or key not in cusolver._handles
    if cudnn.available()[0]:
        assert cudnn.live_handles() == made           # idle, not destroyed
        for _ in range(3):                            # stream after stream: one handle serves
            s = cuda.stream()
            h, _ = cudnn.handle(s)
            assert cudnn.live_handles() == made
            del s
            gc.collect()
            assert h.value == first.value             # the idle one, bound to s


@pytest.mark.skipif(SIMULATOR, reason="host memory a compiled cuDNN graph keeps: a GPU")
def test_conv_graph_after_conv_graph_keeps_no_host_memory():
    """A service compiling conv graph after conv graph, each executable with a stream of its
    own: on an H200 each one kept ~87 KB of host memory (cudnnCreate + cudnnDestroy a stream
    left ~23 KB, and a fresh handle's plans the rest) until handles went idle for the next
    stream; ~2.5 KB on a reused handle. 60 graphs to warm the shapes' caches, then 120."""
    import ctypes
    import gc

    from rlx_numba import cudnn
    if not cudnn.available()[0]:
        pytest.skip("no cuDNN")
    libc = ctypes.CDLL("libc.so.6")

    def rss():
        gc.collect()
        libc.malloc_trim(0)
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    rng = np.random.default_rng(0)

    def conv(i):
        c, h = 3 + i % 5, 12 + i % 7
        g = rlx.Graph(f"conv{i}")
        g.set_outputs([g.conv(g.input("x", (1, c, h, 12)), g.input("k", (4, c, 3, 3)),
                              padding=1)])
        rlx.compile(g).run({"x": rng.standard_normal((1, c, h, 12), np.float32),
                            "k": rng.standard_normal((4, c, 3, 3), np.float32)})

    for i in range(60):
        conv(i)
    before = rss()
    for i in range(120):
        conv(i)
    grown = (rss() - before) / 120
    assert grown < 30e3, f"{grown / 1e3:.1f} KB of host memory kept a compiled conv graph"
