"""Multi-GPU through NCCL: one process per GPU, started by ``rlx-numba launch --gpus N`` (or
torchrun: the same environment variables), each calling ``init()``::

    import rlx_numba.distributed as dist
    comm = dist.init()                      # RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT
    comm.all_reduce(grad, grad, "sum", stream)
    dist.destroy()

Without GPUs (the numba CUDA simulator) the same code runs as threads of one process:
``run_ranks(world_size, fn, *args)`` calls ``fn(comm, *args)`` on each rank with an
``InProcessCommunicator``, which reduces with NumPy in rank order.
"""
from __future__ import annotations

import os

from .comm import (Communicator, GroupAborted, InProcessCommunicator, NcclCommunicator,
                   check_args, current, run_ranks, set_current)
# (launch() stays in .launch: exporting it here would hide the submodule of that name)
from .launch import exchange_file, exchange_tcp
from .nccl import NcclError, available

__all__ = ["init", "destroy", "current", "set_current", "run_ranks", "Communicator",
           "InProcessCommunicator", "NcclCommunicator", "NcclError", "GroupAborted",
           "available", "check_args", "exchange_file", "exchange_tcp"]

DEFAULT_MASTER_PORT = 29500     # torchrun's


def _setting(arg, env: str, default, call: str = "init") -> int:
    if arg is not None:
        return int(arg)
    raw = os.environ.get(env)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{call}: ${env} must be an integer, got {raw!r}") from None


def init(rank: int | None = None, world_size: int | None = None, local_rank: int | None = None,
         init_method: str | None = None, timeout: float = 300.0) -> NcclCommunicator:
    """This process's rank of an NCCL communicator, also made the process-wide current one.

    Arguments override the environment torchrun (and ``rlx-numba launch``) sets: RANK
    (default 0), WORLD_SIZE (default 1), LOCAL_RANK (default RANK: one host), MASTER_ADDR
    (default 127.0.0.1), MASTER_PORT (default 29500). numba's device LOCAL_RANK is selected.
    Rank 0 makes the NCCL unique id; ``init_method`` says how the others get it: None or
    "env://" (TCP on MASTER_ADDR:MASTER_PORT), "tcp://host:port", or "file:///path" (a file
    all ranks see; a fresh path per run). ``timeout``: seconds to wait for the exchange."""
    from ..device import simulator_enabled
    from .comm import process_current
    _process_current = process_current()
    if simulator_enabled():
        raise RuntimeError("distributed.init: NCCL needs GPUs, and kernels run in the numba CUDA "
                           "simulator here; run the ranks as threads with "
                           "rlx_numba.distributed.run_ranks(world_size, fn, ...) (the "
                           "in-process communicator) instead")
    if _process_current is not None and not _process_current.closed:
        raise RuntimeError(f"distributed.init: already initialised ({_process_current!r}); call "
                           f"destroy() first")
    rank = _setting(rank, "RANK", 0)
    world_size = _setting(world_size, "WORLD_SIZE", 1)
    local_rank = _setting(local_rank, "LOCAL_RANK", rank)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"distributed.init: rank {rank} is not in [0, world_size {world_size})")
    ok, why = available()
    if not ok:
        raise RuntimeError(f"distributed.init: {why}")
    from numba import cuda

    from . import nccl
    n_gpus = len(cuda.gpus)
    if not 0 <= local_rank < n_gpus:
        raise ValueError(f"distributed.init: LOCAL_RANK {local_rank} but {n_gpus} GPU(s) visible "
                         f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    cuda.select_device(local_rank)
    uid = nccl.unique_id() if rank == 0 else None
    if world_size > 1:
        method = init_method or "env://"
        if method.startswith("file://"):
            uid = exchange_file(method, rank, world_size, uid, timeout=timeout)
        elif method.startswith("tcp://") or method == "env://":
            if method == "env://":
                addr = os.environ.get("MASTER_ADDR") or "127.0.0.1"
                port = _setting(None, "MASTER_PORT", DEFAULT_MASTER_PORT)
            else:
                addr, sep, port_s = method[len("tcp://"):].rpartition(":")
                if not sep or not port_s.isdigit():
                    raise ValueError(f"distributed.init: init_method {method!r} is not "
                                     f"tcp://host:port")
                port = int(port_s)
            uid = exchange_tcp(addr.strip("[]"), port, rank, world_size, uid, timeout=timeout)
        else:
            raise ValueError(f"distributed.init: init_method {method!r} is not one of "
                             f"env://, tcp://host:port, file:///path")
    comm = NcclCommunicator(rank, world_size, uid)
    set_current(comm, process_wide=True)
    return comm


def destroy() -> None:
    """Close the communicator ``init`` made (ncclCommDestroy) and forget it; a no-op when
    there is none."""
    from .comm import process_current
    c = process_current()
    if c is not None:
        set_current(None, process_wide=True)
        c.close()
