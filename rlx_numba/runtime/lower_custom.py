"""Lowering of custom ops (ir/ops_custom.py): one kernel Step launching the user's kernel as
``kernel[blocks, threads](out, *inputs)``, the arrays arena views shaped as their tensors (in
their storage dtypes), so the step is captured in CUDA graphs like the project's own; a node
with an empty output runs nothing. Its profile / trace name is ``%<id> custom.<name>``."""
from __future__ import annotations

from .lower import Step, lowering


def _shaped(buf, shape):
    """The flat device view ``buf`` with ``shape`` (C order)."""
    return buf.reshape(tuple(shape)) if tuple(buf.shape) != tuple(shape) else buf


@lowering("custom")
def _lower_custom(ctx, n):
    op = n.attrs["custom_op"]
    if n.size == 0:
        return []
    ins = [ctx.graph.nodes[i] for i in n.inputs]
    blocks, threads = op.geometry([i.shape for i in ins])
    args = (_shaped(ctx.buf(n), n.shape), *(_shaped(ctx.buf(i), i.shape) for i in ins))
    nbytes = n.nbytes + sum(i.nbytes for i in ins)
    return [Step(f"%{n.id} custom.{op.name}", f"custom {op.name}", op.kernel, blocks, threads,
                 args, {"bytes": nbytes, "custom_op": op.name})]
