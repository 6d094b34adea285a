"""Lowering of the collective nodes (ir/ops_dist.py): one communicator call a node, on the
executable's stream. The communicator is the current one (``distributed.current()``) when the
graph is compiled: NCCL (NcclCommunicator: ncclAllReduce & co. on the arena's pointers, so a
CUDA graph captures them) or the in-process one of the simulator and CPU tests (host copies and
a barrier between the ranks' threads)."""
from __future__ import annotations

from ..ir import dtypes as dt
from ..ir.ops import fmt
from .lower import CallStep, lowering, step_name


def _comm(n):
    from ..distributed import current
    comm = current()
    a = n.attrs
    if comm is None:
        raise ValueError(f"compile: {n.op} %{n.id} needs a communicator; call "
                         f"rlx_numba.distributed.init() (or compile inside distributed.run_ranks)")
    if (comm.world_size, comm.rank) != (a["world"], a["rank"]):
        raise ValueError(f"compile: {n.op} %{n.id} was built for rank {a['rank']} of "
                         f"{a['world']}, but the current communicator is rank {comm.rank} of "
                         f"{comm.world_size}")
    return comm


@lowering("all_reduce", "all_gather", "reduce_scatter", "broadcast")
def _lower_collective(exe, n):
    comm = _comm(n)
    src = exe.graph.nodes[n.inputs[0]]
    send, recv = exe.buf(src), exe.buf(n)
    op, root = n.attrs.get("reduce", "sum"), n.attrs.get("root", 0)
    what = f"{n.op}{'.' + op if n.op in ('all_reduce', 'reduce_scatter') else ''} of " \
           f"{n.dtype} {fmt(src.shape)} over {comm.world_size} ranks ({comm.kind})"
    if n.size == 0:
        return []
    if comm.kind == "nccl":
        count = n.size if n.op == "reduce_scatter" else src.size
        sp, rp = send.device_ctypes_pointer.value, recv.device_ctypes_pointer.value
        name = n.dtype.host.name

        def make(stream):
            handle = int(stream) if stream is not None else 0
            return lambda: comm.pointer_call(n.op, sp, rp, count, name, op, handle, root)
    else:
        if n.dtype == dt.BF16:
            raise ValueError(f"compile: {n.op} %{n.id}: bf16 collectives need NCCL (the "
                             f"in-process communicator reduces the stored uint16 values)")

        def make(stream):
            return lambda: comm.call(n.op, send, recv, op=op, root=root, stream=stream)
    return [CallStep(step_name(n), what, make,
                     {"bytes": src.size * n.dtype.itemsize, "collective": True})]
