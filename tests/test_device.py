"""Device discovery, the simulator switch and the CLI, each in a fresh process."""
import os
import subprocess
import sys

import pytest
from numba import cuda

import rlx_numba as rlx
from rlx_numba.device import _probe_driver

HAS_DRIVER = _probe_driver()["ok"]


def _py(code, **env):
    e = {k: v for k, v in os.environ.items() if k not in ("RLX_NUMBA_SIMULATOR", "NUMBA_ENABLE_CUDASIM")}
    e.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e,
                          timeout=300)


def test_is_available_matches_driver_and_never_raises():
    assert rlx.is_available() is HAS_DRIVER


def test_forced_simulator():
    r = _py("import rlx_numba as r; print(r.simulator_enabled())", RLX_NUMBA_SIMULATOR="1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True"


def test_default_follows_driver_with_one_warning():
    r = _py("import rlx_numba as r; import rlx_numba; print(r.simulator_enabled())")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(not HAS_DRIVER)
    assert r.stderr.count("numba CUDA simulator") == (0 if HAS_DRIVER else 1)


@pytest.mark.skipif(HAS_DRIVER, reason="needs a machine without a CUDA driver")
def test_forced_off_without_gpu_imports_but_reports_no_device():
    r = _py("import rlx_numba as r; print(r.simulator_enabled(), r.is_available())",
            RLX_NUMBA_SIMULATOR="0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False False"


def test_bad_switch_value():
    r = _py("import rlx_numba", RLX_NUMBA_SIMULATOR="yes")
    assert r.returncode != 0 and "RLX_NUMBA_SIMULATOR must be 0 or 1, got 'yes'" in r.stderr


def test_cli_info_and_demo():
    env = {} if HAS_DRIVER else {"RLX_NUMBA_SIMULATOR": "1"}
    r = _py("from rlx_numba.cli import main; raise SystemExit(main(['info']))", **env)
    assert r.returncode == 0, r.stderr
    assert "numba-cuda" in r.stdout and "cudart" in r.stdout
    assert ("simulator" in r.stdout) != HAS_DRIVER
    r = _py("from rlx_numba.cli import main; raise SystemExit(main(['demo']))", **env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK" in r.stdout and "max |rlx - numpy|" in r.stdout


@pytest.mark.skipif(not rlx.simulator_enabled(), reason="the simulator's shared memory")
def test_simulator_shared_arrays_are_one_per_block_line():
    """numba's simulator looked shared arrays up with an unlocked get-then-set: threads of
    one block could get different arrays. rlx_numba installs a locked lookup."""
    import threading

    import numpy as np
    from numba.cuda.simulator import kernelapi
    assert kernelapi.FakeCUDAShared._rlx_locked
    shared = kernelapi.FakeCUDAShared(0)
    start, got = threading.Barrier(16), []

    def thread():
        start.wait()
        got.append(shared.array((4,), np.float32))   # one source line: one array
    ts = [threading.Thread(target=thread) for _ in range(16)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len(got) == 16 and all(a is got[0] for a in got)
    assert shared.array((4,), np.float32) is not got[0]     # another line: another array


@pytest.mark.skipif(not rlx.simulator_enabled(), reason="the simulator's block runner")
def test_simulator_runs_barrier_free_blocks_inline():
    """A kernel that can reach no barrier, warp collective or rendezvous twin runs its threads
    in turn in the launching thread (no OS thread each); one that can (directly, through a
    device function, a module attribute or a table) keeps a thread a CUDA thread."""
    import threading

    import numpy as np

    from rlx_numba import device
    from rlx_numba.kernels import mma, warp

    @cuda.jit(device=True)
    def dev_sync():
        cuda.syncthreads()

    table = {"f": dev_sync}

    def free(out, x):
        i = cuda.grid(1)
        if i < x.size:
            out[i] = x[i] * 2 + cuda.threadIdx.x - cuda.blockIdx.x
            cuda.atomic.add(out, 0, 0.0)

    def direct(out):
        cuda.syncthreads()

    def through_device_fn(out):
        dev_sync()

    def through_table(out):
        table["f"]()

    def through_module(out):
        warp.group_reduce(out[0], out, 32, warp.SUM)

    def through_twin(out):
        mma.ldmatrix_x4(out, 0)

    assert device.thread_free(free)
    for f in (direct, through_device_fn, through_table, through_module, through_twin):
        assert not device.thread_free(f), f.__name__

    seen = set()

    def who(out, x):
        i = cuda.grid(1)
        if i < x.size:
            out[i] = x[i] + 100 * cuda.blockIdx.x + cuda.threadIdx.x

    kern = cuda.jit(who)
    x = np.arange(45, dtype=np.float32)
    out = np.zeros_like(x)
    orig = threading.Thread.start
    threading.Thread.start = lambda self: (seen.add(self), orig(self))
    try:
        kern[3, 16](out, x)
    finally:
        threading.Thread.start = orig
    assert not seen                     # no thread started
    i = np.arange(45)
    np.testing.assert_array_equal(out, x + 100 * (i // 16) + i % 16)
    assert not hasattr(threading.current_thread(), "threadIdx")   # identity handed back

    def bad(out):
        if cuda.threadIdx.x == 5 and cuda.blockIdx.x == 1:
            out[1000] = 1.0
    with pytest.raises(IndexError, match=r"tid=\[5, 0, 0\] ctaid=\[1, 0, 0\]"):
        cuda.jit(bad)[2, 8](np.zeros(4, np.float32))


def test_byte_view_is_numbas_slice_and_view():
    """device.byte_view's GPU path (a DeviceNDArray made straight from the memory pointer's
    view) against numba's own base[start:stop].view(dtype) (its _do_getitem, the slice
    without the context check): shape, strides, dtype, stream, address and extent, for
    views of the arena and of a view, f32 / u16 / f64 / u8. Real numba.cuda classes
    (RLX_NUMBA_SIMULATOR=0) over an address no kernel reads: no driver call is made."""
    code = """
import numpy as np
import rlx_numba
from rlx_numba.device import byte_view
from numba.cuda.cudadrv import driver
from numba.cuda.cudadrv.devicearray import DeviceNDArray
assert not rlx_numba.simulator_enabled()
base_ptr = 1 << 40
mem = driver.MemoryPointer(context=None, pointer=driver.binding.CUdeviceptr(base_ptr), size=4096)
arena = DeviceNDArray((4096,), (1,), np.uint8, stream=0, gpu_data=mem)
inner = byte_view(arena, 512, 2560, np.uint8)
for base in (arena, inner):
    for start, stop, dtype in ((0, 64, np.float32), (256, 1280, np.uint16), (8, 2048, np.float64),
                               (100, 101, np.uint8), (2040, 2048, np.float32)):
        got = byte_view(base, start, stop, dtype)
        want = base._do_getitem(slice(start, stop)).view(dtype)
        assert type(got) is type(want) is DeviceNDArray
        for attr in ("shape", "strides", "dtype", "size", "stream"):
            assert getattr(got, attr) == getattr(want, attr), (attr, start, stop, dtype)
        assert got.device_ctypes_pointer.value == want.device_ctypes_pointer.value
        assert got.gpu_data.size == want.gpu_data.size == stop - start
        assert got.is_c_contiguous()
print(inner.device_ctypes_pointer.value - base_ptr)
"""
    r = _py(code, RLX_NUMBA_SIMULATOR="0")
    if "No module named" in r.stderr and "cuda" in r.stderr:
        pytest.skip(f"numba-cuda's driver bindings are not installed: {r.stderr[-300:]}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "512"


def test_gc_paused_restores_the_collector():
    """device.gc_paused: the cyclic collector off during the call, as it was after it (on, or
    off when the caller had turned it off), also when the call raises."""
    import gc

    from rlx_numba.device import gc_paused
    seen = []

    @gc_paused
    def f(fail=False):
        seen.append(gc.isenabled())
        if fail:
            raise KeyError("x")
        return 7

    was = gc.isenabled()
    try:
        gc.enable()
        assert f() == 7 and gc.isenabled()
        with pytest.raises(KeyError):
            f(fail=True)
        assert gc.isenabled()
        gc.disable()
        assert f() == 7 and not gc.isenabled()
        assert seen == [False, False, False]
    finally:
        (gc.enable if was else gc.disable)()
