"""Device discovery, the simulator switch and the CLI, each in a fresh process."""
import os
import subprocess
import sys

import pytest

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
