import sys
import zlib

import numpy as np
import pytest

import rlx_numba as rlx

ON_GPU = not rlx.simulator_enabled()

if not ON_GPU:
    # The simulator runs a CUDA thread per OS thread and polls at syncthreads(); Python's
    # default 5 ms thread switch interval makes every barrier wait that long.
    sys.setswitchinterval(1e-4)


@pytest.fixture
def rng(request):
    # a fixed seed per test, so a failure reproduces
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def run_graph(g, inputs=None, params=None, mode="stream"):
    """Compile g, set params, run once; numpy outputs."""
    exe = rlx.compile(g, exec_mode=mode)
    for k, v in (params or {}).items():
        exe.set_param(k, v)
    return exe.run(inputs or {})
