"""Communicators: the collectives (all_reduce, all_gather, reduce_scatter, broadcast) over
contiguous device arrays of any shape, in two implementations of one interface.

* ``NcclCommunicator``: one process per GPU, NCCL through ``nccl.py``. The collectives are
  enqueued on the given stream and return at once (NCCL's semantics); ``prepare`` takes
  raw device pointers and a raw cudaStream_t and returns the call, its arguments converted
  once, for compiled steps that already hold them.
* ``InProcessCommunicator``: ``world_size`` ranks as threads of one process (``run_ranks``),
  the data exchanged through host memory and reduced with NumPy in the array's dtype, rank 0
  first, so the result is deterministic and the same on every rank. It runs under the numba
  CUDA simulator, where it is how multi-rank code is tested without GPUs. Its collectives
  are synchronous.

Element counts are of the flat arrays: all_gather's recv holds world_size * send.size
elements, rank r's send at [r * send.size, (r + 1) * send.size); reduce_scatter's send holds
world_size * recv.size elements and rank r receives the reduction of chunk r.
"""
from __future__ import annotations

import abc
import ctypes
import logging
import threading
import time
import weakref

import numpy as np

from .. import device
from ..device import at_exit
from . import nccl

log = logging.getLogger("rlx_numba")

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
REDUCING = ("all_reduce", "reduce_scatter")
DEFAULT_TIMEOUT = 300.0     # seconds a rank waits at a barrier for the others before failing

def current() -> "Communicator | None":
    """This thread's communicator (set by ``run_ranks`` or ``set_current``), else the
    process-wide one (set by ``init``), else None. (The registry is device.py's, so the graph
    builders below this floor can read it.)"""
    return device.current_comm()


def set_current(comm: "Communicator | None", process_wide: bool = False) -> None:
    """Make ``comm`` this thread's current communicator (or the process-wide one)."""
    if comm is not None and not isinstance(comm, Communicator):
        raise TypeError(f"set_current: expected a Communicator or None, got "
                        f"{type(comm).__name__}")
    device.set_current_comm(comm, process_wide)


def process_current() -> "Communicator | None":
    """The process-wide communicator (``init``'s), whatever this thread's is."""
    return device.current_comm(process_wide=True)


def check_args(name: str, send_size: int, recv_size: int, send_dtype: str, recv_dtype: str,
               op: str, root: int, world_size: int) -> None:
    """Raise ValueError naming the collective, the argument and the sizes when a call cannot
    be right on this rank. Sizes are element counts; dtypes are numpy names ("float32")."""
    if name not in COLLECTIVES:
        raise ValueError(f"collective {name!r} is not one of {list(COLLECTIVES)}")
    if name in REDUCING and op not in nccl.OPS:
        raise ValueError(f"{name}: op {op!r} is not one of {list(nccl.OPS)}")
    if send_dtype != recv_dtype:
        raise ValueError(f"{name}: send is {send_dtype} but recv is {recv_dtype}")
    if send_dtype not in nccl.DTYPES:
        raise ValueError(f"{name}: dtype {send_dtype} is not supported; one of "
                         f"{sorted(nccl.DTYPES)}")
    if name == "all_gather":
        want, have, arg = send_size * world_size, recv_size, "recv"
        how = f"world_size {world_size} x send's {send_size}"
    elif name == "reduce_scatter":
        want, have, arg = recv_size * world_size, send_size, "send"
        how = f"world_size {world_size} x recv's {recv_size}"
    else:
        want, have, arg = send_size, recv_size, "recv"
        how = "send's"
    if have != want:
        raise ValueError(f"{name}: {arg} has {have} elements; expected {want} ({how})")
    if name == "broadcast" and not 0 <= root < world_size:
        raise ValueError(f"broadcast: root {root} is not a rank of world_size {world_size}")


def _device_array(arr, name: str, arg: str):
    """A numba device array for ``arr`` (or anything with __cuda_array_interface__),
    checked contiguous."""
    if not hasattr(arr, "copy_to_host"):
        if not hasattr(arr, "__cuda_array_interface__"):
            raise TypeError(f"{name}: {arg} must be a device array (numba, or anything with "
                            f"__cuda_array_interface__), got {type(arr).__name__}")
        from numba import cuda
        arr = cuda.as_cuda_array(arr)
    if not arr.is_c_contiguous():
        raise ValueError(f"{name}: {arg} of shape {tuple(arr.shape)} is not contiguous")
    return arr


class Communicator(abc.ABC):
    """``rank`` of ``world_size``; ``kind`` "nccl" or "inprocess". Every collective goes
    through ``call``; ``recv`` may be ``send`` (in place)."""

    rank: int
    world_size: int
    kind: str

    def all_reduce(self, send, recv, op: str = "sum", stream=None):
        return self.call("all_reduce", send, recv, op=op, stream=stream)

    def all_gather(self, send, recv, stream=None):
        return self.call("all_gather", send, recv, stream=stream)

    def reduce_scatter(self, send, recv, op: str = "sum", stream=None):
        return self.call("reduce_scatter", send, recv, op=op, stream=stream)

    def broadcast(self, send, recv, root: int = 0, stream=None):
        return self.call("broadcast", send, recv, root=root, stream=stream)

    def call(self, name: str, send, recv, op: str = "sum", root: int = 0, stream=None):
        """Run collective ``name`` on device arrays; returns ``recv``."""
        if self.closed:
            raise RuntimeError(f"{name}: the {self.kind} communicator of rank {self.rank} is "
                               f"closed")
        send, recv = _device_array(send, name, "send"), _device_array(recv, name, "recv")
        check_args(name, send.size, recv.size, np.dtype(send.dtype).name,
                   np.dtype(recv.dtype).name, op, root, self.world_size)
        self._collective(name, send, recv, op, root, stream)
        return recv

    @abc.abstractmethod
    def _collective(self, name, send, recv, op, root, stream) -> None:
        """The checked collective."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Return once every rank has called barrier()."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the communicator; idempotent."""

    closed = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}"
                f"{', closed' if self.closed else ''})")


# --------------------------------------------------------------------------------------- NCCL

class NcclCommunicator(Communicator):
    """One rank of an NCCL communicator on numba's current device (select it first:
    ``numba.cuda.select_device``). ``uid`` is rank 0's ``nccl.unique_id()``, the same bytes on
    every rank; the constructor blocks until all ``world_size`` ranks have joined."""

    kind = "nccl"

    def __init__(self, rank: int, world_size: int, uid: bytes):
        if not 0 <= rank < world_size:
            raise ValueError(f"NcclCommunicator: rank {rank} is not in [0, {world_size})")
        from numba import cuda
        self.rank, self.world_size = int(rank), int(world_size)
        self.lib = nccl.lib()
        uid_struct = nccl.as_unique_id(uid)
        # NCCL takes the device from the CUDA runtime, which follows the current context
        self.device = cuda.get_current_device().id
        cuda.current_context()
        self.handle = nccl.Comm()
        self.lib.ncclCommInitRank(ctypes.byref(self.handle), self.world_size, uid_struct,
                                  self.rank)
        _OPEN_NCCL.add(self)
        self._barrier_buf = None
        self._barrier_stream = None

    def prepare(self, name: str, send_ptr: int, recv_ptr: int, count: int, dtype_name: str,
                op: str = "sum", stream_handle: int = 0, root: int = 0):
        """The no-argument callable that enqueues collective ``name`` on raw device pointers
        and a raw cudaStream_t (0: the legacy default stream), its arguments checked and
        converted once (a compiled step calls it every run). ``count`` is NCCL's: the
        elements of send for all_reduce, broadcast and all_gather (recv holds world_size *
        count), of recv for reduce_scatter (send holds world_size * count)."""
        if name not in COLLECTIVES:
            raise ValueError(f"collective {name!r} is not one of {list(COLLECTIVES)}")
        dt = nccl.dtype_code(dtype_name, name)
        if count < 0:
            raise ValueError(f"{name}: count {count} is negative")
        L, h, s = self.lib, self.handle, nccl.Stream(int(stream_handle) or None)
        args = (ctypes.c_void_p(send_ptr or None), ctypes.c_void_p(recv_ptr or None),
                ctypes.c_size_t(count), dt)
        if name == "all_reduce":
            fn, args = L.ncclAllReduce, args + (nccl.op_code(op, name), h, s)
        elif name == "all_gather":
            fn, args = L.ncclAllGather, args + (h, s)
        elif name == "reduce_scatter":
            fn, args = L.ncclReduceScatter, args + (nccl.op_code(op, name), h, s)
        else:
            if not 0 <= root < self.world_size:
                raise ValueError(f"broadcast: root {root} is not a rank of world_size "
                                 f"{self.world_size}")
            fn, args = L.ncclBroadcast, args + (int(root), h, s)

        def call():
            if self.closed:
                raise RuntimeError(f"{name}: the nccl communicator of rank {self.rank} is "
                                   f"closed")
            fn(*args)
        return call

    def _collective(self, name, send, recv, op, root, stream):
        count = recv.size if name == "reduce_scatter" else send.size
        self.prepare(name, send.device_ctypes_pointer.value or 0,
                     recv.device_ctypes_pointer.value or 0, count,
                     np.dtype(send.dtype).name, op, _stream_handle(stream), root)()

    def barrier(self) -> None:
        """A one-element all_reduce on a private stream, waited for."""
        from numba import cuda
        if self._barrier_buf is None:
            self._barrier_buf = cuda.device_array(1, dtype=np.int32)
            self._barrier_stream = cuda.stream()
        self.all_reduce(self._barrier_buf, self._barrier_buf, "sum", self._barrier_stream)
        self._barrier_stream.synchronize()

    def group_start(self) -> None:
        """ncclGroupStart: the collectives up to group_end() are fused into one launch."""
        self.lib.ncclGroupStart()

    def group_end(self) -> None:
        self.lib.ncclGroupEnd()

    def nccl_count(self) -> int:
        """ncclCommCount: the ranks NCCL sees (a check that set-up went as planned)."""
        n = ctypes.c_int(0)
        self.lib.ncclCommCount(self.handle, ctypes.byref(n))
        return n.value

    def nccl_rank(self) -> int:
        """ncclCommUserRank."""
        r = ctypes.c_int(0)
        self.lib.ncclCommUserRank(self.handle, ctypes.byref(r))
        return r.value

    def abort(self) -> None:
        """ncclCommAbort: tear down without waiting for the other ranks (after an error)."""
        if not self.closed:
            self.closed = True
            self.lib.ncclCommAbort(self.handle)

    def close(self) -> None:
        """ncclCommDestroy (waits for this rank's pending collectives)."""
        if not self.closed:
            self.closed = True
            self.lib.ncclCommDestroy(self.handle)


# communicators not yet closed: at interpreter exit each is aborted (ncclCommAbort stops its
# proxy threads without waiting for ranks that may be gone) before the libraries unload
_OPEN_NCCL: "weakref.WeakSet[NcclCommunicator]" = weakref.WeakSet()


@at_exit
def _abort_open_communicators() -> None:
    for comm in list(_OPEN_NCCL):
        if not comm.closed:
            log.warning("rlx_numba: NCCL communicator of rank %d of %d still open at exit: "
                        "aborted (call rlx_numba.distributed.destroy() to close it)",
                        comm.rank, comm.world_size)
            comm.abort()


def _stream_handle(stream) -> int:
    """The cudaStream_t of a numba stream (or an int handle); None and 0 are the default."""
    if stream is None:
        return 0
    return int(stream)


# --------------------------------------------------------------------------------- in-process

class GroupAborted(RuntimeError):
    """A rank's collective could not finish: another rank failed (the error that matters is
    that rank's), returned without calling it, or did not come within the timeout."""


class _Barrier:
    """A cyclic barrier that also fails fast: when the group is aborted (a rank raised), when
    a rank has returned without coming (it never will), or after ``timeout`` seconds.
    (threading.Barrier cannot tell "returned" from "late", and its abort() can reach a thread
    already released.)"""

    def __init__(self, parties: int, timeout: float):
        self.parties, self.timeout = parties, timeout
        self.cond = threading.Condition()
        self.count = self.generation = 0
        self.broken = False
        self.finished: set = set()

    def wait(self, rank: int, what: str) -> None:
        with self.cond:
            gen = self.generation
            self.count += 1
            if self.count == self.parties:
                self.count, self.generation = 0, gen + 1
                self.cond.notify_all()
                return
            deadline = time.monotonic() + self.timeout
            while self.generation == gen:
                why = None
                if self.broken:
                    why = "the group was aborted (another rank failed)"
                elif self.finished:
                    why = (f"rank(s) {sorted(self.finished)} returned without calling it (the "
                           f"ranks ran different sequences of collectives)")
                elif time.monotonic() >= deadline:
                    self.broken = True
                    self.cond.notify_all()
                    why = f"not every rank arrived within {self.timeout:g} s"
                if why:
                    raise GroupAborted(f"{what} on rank {rank}: {why}")
                self.cond.wait(max(0.0, deadline - time.monotonic()))

    def abort(self) -> None:
        with self.cond:
            self.broken = True
            self.cond.notify_all()

    def finish(self, rank: int) -> None:
        with self.cond:
            self.finished.add(rank)
            self.cond.notify_all()


class _Group:
    """What the ranks of one in-process group share: a barrier and one slot per rank.
    With ``serialize`` (the simulator), one rank runs at a time and ranks switch only at a
    barrier: numba's simulator swaps a kernel module's ``cuda`` global while a kernel runs,
    so two threads launching kernels at once break each other."""

    def __init__(self, world_size: int, timeout: float, serialize: bool):
        self.world_size, self.timeout, self.serialize = world_size, timeout, serialize
        self.barrier = _Barrier(world_size, timeout)
        self.slots: list = [None] * world_size
        self.turn = threading.Lock()

    def wait(self, comm: "InProcessCommunicator", what: str) -> None:
        held = comm._holds_turn
        if held:
            self.turn.release()
        try:
            self.barrier.wait(comm.rank, what)
        finally:
            if held:
                self.turn.acquire()

    def abort(self) -> None:
        self.barrier.abort()


_REDUCE = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum,
           "avg": np.add}


def _reduce(parts: list, op: str) -> np.ndarray:
    """Reduce equal-length host arrays in their dtype, in rank order (deterministic)."""
    fn = _REDUCE[op]
    acc = parts[0].copy()
    for p in parts[1:]:
        fn(acc, p, out=acc)
    if op == "avg":
        n = len(parts)
        if np.issubdtype(acc.dtype, np.integer):    # NCCL divides integers truncating to 0
            q = acc // n
            q[(acc % n != 0) & (acc < 0)] += 1
            acc = q
        else:
            acc = (acc / np.asarray(n, dtype=acc.dtype)).astype(acc.dtype)
    return acc


class InProcessCommunicator(Communicator):
    """Rank ``rank`` of a group of ``world_size`` ranks living as threads of this process
    (make them with ``group`` or ``run_ranks``). Collectives are synchronous: the stream is
    synchronized, send is copied to the host, the result computed with NumPy, copied into
    recv, and every rank leaves the collective together."""

    kind = "inprocess"

    def __init__(self, rank: int, world_size: int, group: _Group):
        self.rank, self.world_size, self._group = rank, world_size, group
        self._holds_turn = False

    @classmethod
    def group(cls, world_size: int, timeout: float = DEFAULT_TIMEOUT,
              serialize: bool | None = None) -> "list[InProcessCommunicator]":
        """One communicator per rank, sharing one group. ``serialize`` (default: under the
        simulator) is honoured by ``run_ranks``, which runs one rank at a time."""
        if int(world_size) < 1:
            raise ValueError(f"InProcessCommunicator.group: world_size {world_size} < 1")
        if serialize is None:
            from ..device import simulator_enabled
            serialize = simulator_enabled()
        g = _Group(int(world_size), float(timeout), bool(serialize))
        return [cls(r, int(world_size), g) for r in range(int(world_size))]

    def _exchange(self, desc: tuple, payload) -> list:
        """Publish (desc, payload), wait for every rank, check all descs agree; the list of
        payloads in rank order. The caller must call ``_group.wait`` once it has read them."""
        g = self._group
        g.slots[self.rank] = (desc, payload)
        g.wait(self, desc[0])
        descs = [s[0] for s in g.slots]
        if any(d != descs[0] for d in descs):
            rows = "; ".join(f"rank {r}: {d}" for r, d in enumerate(descs))
            raise ValueError(f"{desc[0]}: the ranks disagree on the call ({rows})")
        return [s[1] for s in g.slots]

    def _collective(self, name, send, recv, op, root, stream):
        _synchronize(stream)
        host = send.copy_to_host().reshape(-1)
        desc = (name, np.dtype(send.dtype).name, send.size, recv.size,
                op if name in REDUCING else None, root if name == "broadcast" else None)
        parts = self._exchange(desc, host)
        try:
            if name == "all_reduce":
                out = _reduce(parts, op)
            elif name == "all_gather":
                out = np.concatenate(parts)
            elif name == "reduce_scatter":
                n = recv.size
                out = _reduce([p[self.rank * n:(self.rank + 1) * n] for p in parts], op)
            else:
                out = parts[root].copy()
        finally:
            self._group.wait(self, name)    # nobody overwrites a slot before all have read it
        # synchronous copy: the stream's later work sees it
        recv.copy_to_device(np.ascontiguousarray(out).reshape(recv.shape))

    def barrier(self) -> None:
        if self.closed:
            raise RuntimeError(f"barrier: the inprocess communicator of rank {self.rank} is "
                               f"closed")
        self._exchange(("barrier",), None)
        self._group.wait(self, "barrier")

    def close(self) -> None:
        self.closed = True


def _synchronize(stream) -> None:
    if stream is None or (isinstance(stream, int) and stream == 0):
        return
    if hasattr(stream, "synchronize"):
        stream.synchronize()
    else:   # a raw handle: numba cannot wrap it here, so wait for the whole device
        from numba import cuda
        cuda.synchronize()


def run_ranks(world_size: int, fn, *args, timeout: float = DEFAULT_TIMEOUT,
              serialize: bool | None = None) -> list:
    """Run ``fn(comm, *args)`` on ``world_size`` threads, one per rank, each with its
    InProcessCommunicator as the thread's current communicator; the results in rank order.
    If a rank raises, the group's barrier is aborted (so no rank hangs) and that exception is
    re-raised with "rank r: " in front of its message. ``timeout``: seconds a rank waits at a
    collective for the others. ``serialize`` (default: under the simulator): one rank runs at
    a time, switching at collectives (the simulator cannot run kernels on two threads)."""
    comms = InProcessCommunicator.group(world_size, timeout, serialize)
    g = comms[0]._group
    results: list = [None] * len(comms)
    errors: list = []           # (rank, exception) in the order they happened
    lock = threading.Lock()

    def body(comm):
        set_current(comm)
        if g.serialize:
            g.turn.acquire()
            comm._holds_turn = True
        try:
            results[comm.rank] = fn(comm, *args)
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            with lock:
                errors.append((comm.rank, e))
            g.abort()
        else:
            g.barrier.finish(comm.rank)
        finally:
            if comm._holds_turn:
                comm._holds_turn = False
                g.turn.release()
            comm.close()
            set_current(None)

    threads = [threading.Thread(target=body, args=(c,), name=f"rlx-rank-{c.rank}", daemon=True)
               for c in comms]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        # the rank that failed first, not the ranks that saw the barrier break after it
        primary = [x for x in errors if not isinstance(x[1], GroupAborted)] or errors
        rank, e = primary[0]
        if e.args and isinstance(e.args[0], str):
            e.args = (f"rank {rank}: {e.args[0]}",) + e.args[1:]
        elif hasattr(e, "add_note"):
            e.add_note(f"(raised on rank {rank})")
        others = sorted({r for r, _ in errors} - {rank})
        if others and hasattr(e, "add_note"):
            e.add_note(f"ranks {others} failed too")
        raise e
    return results
