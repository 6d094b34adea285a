"""Lowering of the collective nodes (ir/ops_dist.py): one communicator call a node, on the
executable's stream. The communicator is the current one (``distributed.current()``) when the
graph is compiled: NCCL (NcclCommunicator: ncclAllReduce & co. on the arena's pointers, so a
CUDA graph captures them) or the in-process one of the simulator and CPU tests (host copies and
a barrier between the ranks' threads).

An "all_reduce_inplace" node with ``overlap`` (compile_train's data-parallel buckets) runs its
NCCL call on a second stream: an event forks it off the executable's stream once the bucket
is written, and ``join_steps`` (the update's first step) makes the stream wait for every such
call. The bucket is the node's own memory, live to the update, so the kernels that run
meanwhile never touch it; a CUDA graph captures the fork and the join."""
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


@lowering("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_reduce_inplace")
def _lower_collective(ctx, n):
    comm = _comm(n)
    src = ctx.graph.nodes[n.inputs[0]]
    send, recv = ctx.buf(src), ctx.buf(n)
    op, root = n.attrs.get("reduce", "sum"), n.attrs.get("root", 0)
    what = f"{n.op}{'.' + op if 'reduce' in n.op else ''} of " \
           f"{n.dtype} {fmt(src.shape)} over {comm.world_size} ranks ({comm.kind})"
    if n.size == 0:
        return []
    info = {"bytes": src.size * n.dtype.itemsize, "collective": True}
    kind = "all_reduce" if n.op == "all_reduce_inplace" else n.op
    if comm.kind == "nccl":
        count = n.size if n.op == "reduce_scatter" else src.size
        sp, rp = send.device_ctypes_pointer.value, recv.device_ctypes_pointer.value
        name = n.dtype.host.name

        def make(stream):
            if not n.attrs.get("overlap"):
                return comm.prepare(kind, sp, rp, count, name, op,
                                    int(stream) if stream is not None else 0, root)
            from numba import cuda
            side, ready, done = cuda.stream(), cuda.event(timing=False), cuda.event(timing=False)
            info["done"], info["side"] = done, side
            call = comm.prepare(kind, sp, rp, count, name, op, int(side), root)

            def go():
                ready.record(stream)
                ready.wait(side)
                call()
                done.record(side)
            return go
    else:
        if n.dtype == dt.BF16:
            raise ValueError(f"compile: {n.op} %{n.id}: bf16 collectives need NCCL (the "
                             f"in-process communicator reduces the stored uint16 values)")

        def make(stream):
            return lambda: comm.call(kind, send, recv, op=op, root=root, stream=stream)
    return [CallStep(step_name(n), what + (" on a second stream" if n.attrs.get("overlap") and
                                           comm.kind == "nccl" else ""), make, info)]


def join_steps(ctx) -> list:
    """A step that makes the executable's stream wait for every overlapped all_reduce lowered
    so far (none when there is none): compile_train's update runs after it. ``ctx``: the
    program's LowerCtx (its ``node_steps``); the caller binds the step."""
    infos = [s.info for steps in ctx.node_steps.values() for s in steps
             if "done" in s.info]
    if not infos:
        return []

    def make(stream):
        return lambda: [i["done"].wait(stream) for i in infos]
    return [CallStep("join", f"wait for {len(infos)} overlapped all_reduce(s)", make, {})]
