"""Lowering: each graph node becomes zero or more Steps with every argument bound ahead.

A Step is one kernel launch: a numba launcher already configured with grid, block and stream,
plus its argument tuple. run() only calls them.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import numpy as np

from ..ir import dtypes as dt
from ..ir.graph import Graph, Node
from ..kernels import codegen, matmul
from ..kernels.launch import grid_1d

log = logging.getLogger("rlx_numba")

ELEMENTWISE = ("activation", "binary", "compare", "where", "cast")
WRITTEN_BY_INPUT = ("residual_sum",)   # nodes filled by their input's kernel, not their own
LOWERINGS = {}   # op name -> fn(exe, node) -> list of Steps (None entries are dropped)
IDX32_LIMIT = 2**32  # below this many elements, broadcast offsets use magic-number division


def lowering(*ops):
    """Register ``fn(exe, node) -> [Step | None, ...]`` as the lowering of these ops. ``exe``
    gives ``exe.graph``, ``exe.buf(node)`` (flat device view) and ``exe.device_array(host)``."""
    def deco(fn):
        for op in ops:
            LOWERINGS[op] = fn
        return fn
    return deco


def step_name(n: Node) -> str:
    return f"%{n.id} {n.op}" + (f".{n.attrs['kind']}" if "kind" in n.attrs else "")


def is_view(node: Node, graph: Graph) -> bool:
    """Nodes that own no memory: they alias their input's buffer."""
    if node.op == "reshape":
        return True
    return node.op == "cast" and graph.nodes[node.inputs[0]].dtype == node.dtype


@dataclass
class Step:
    name: str                 # "%7 binary.add"
    kernel_name: str
    kernel: object            # the numba dispatcher
    grid: tuple
    block: tuple
    args: tuple
    info: dict = field(default_factory=dict)
    launch: object = None

    def bind(self, stream, aot: bool) -> None:
        k = self.kernel
        if aot:  # compile now, and skip per-launch type dispatch later
            k = k.specialize(*self.args)
        self.launch = k[self.grid, self.block, stream]

    def __call__(self) -> None:
        self.launch(*self.args)


def node_expr(node: Node, graph: Graph):
    """The single-op element-wise expression of a node, its inputs as in0, in1, ..."""
    leaves = tuple(("in", j, graph.nodes[i].dtype) for j, i in enumerate(node.inputs))
    attr = node.attrs.get("kind")
    return (node.op, attr, node.dtype) + leaves


def elementwise_step(name, expr, out, out_shape, ins, in_shapes, in_dtypes) -> Step | None:
    """A generated element-wise kernel writing ``out`` (flat) from flat inputs ``ins``."""
    n = math.prod(out_shape)
    if n == 0:
        return None
    modes, dims, strides = codegen.broadcast_layout(out_shape, in_shapes)
    idx32 = n < IDX32_LIMIT
    src = codegen.kernel_source(expr, in_dtypes, modes, len(dims), idx32)
    kernel = codegen.load_kernel(src)
    sizes = [n]   # passed as uint64: the kernel's index math is unsigned
    if "bcast" in modes:
        for d in dims[1:]:
            sizes += [d, *codegen.magic_divisor(d)] if idx32 else [d]
        for j, mode in enumerate(modes):
            if mode == "bcast":
                sizes += strides[j]
    args = [out, *ins, *(np.uint64(v) for v in sizes)]
    blocks, threads = grid_1d(n)
    return Step(name, "elementwise " + codegen.expr_repr(expr), kernel, (blocks,), (threads,),
                tuple(args), {"source": src, "modes": modes, "dims": dims, "n": n})


def matmul_steps(name, out, a, b, a_shape, b_shape, out_shape, device_array, epilogue=None):
    """Tiled SGEMM over the broadcast batch, then an optional element-wise epilogue on ``out``."""
    m, k = a_shape[-2], a_shape[-1]
    n = b_shape[-1]
    batch_shape = out_shape[:-2]
    batch = math.prod(batch_shape)
    steps = []
    if batch * m * n == 0:
        return steps
    # per-batch element offsets of A and B (0-stride on broadcast batch dims)
    z = np.arange(batch)
    offs = []
    for shape, mat in ((a_shape, m * k), (b_shape, k * n)):
        bshape = (1,) * (len(batch_shape) - len(shape[:-2])) + tuple(shape[:-2])
        idx = np.zeros(batch, np.int64)
        rem, mult = z.copy(), 1
        for d in range(len(batch_shape) - 1, -1, -1):
            coord = rem % batch_shape[d]
            rem //= batch_shape[d]
            if bshape[d] != 1:
                idx += coord * mult
            mult *= bshape[d]
        offs.append(device_array(idx * mat))
    if k == 0:  # empty sum: zeros (the epilogue then adds bias / applies the activation)
        steps.append(elementwise_step(name + " zero", ("cast", None, dt.F32, ("in", 0, dt.BOOL)),
                                      out, (batch * m * n,), [_false(device_array)], [(1,)], [dt.BOOL]))
    else:
        grid, block = matmul.sgemm_geometry(m, n, batch)
        steps.append(Step(name, f"sgemm_tiled {batch}x{m}x{n}x{k}", matmul.sgemm_tiled, grid, block,
                          (out, a, b, m, n, k, offs[0], offs[1], batch),
                          {"flops": 2 * batch * m * n * k}))
    if epilogue is not None:
        steps.append(epilogue)
    return steps


def _false(device_array):
    return device_array(np.zeros(1, np.bool_))


# ---- lowerings of the element-wise and matmul ops --------------------------------------------
@lowering(*ELEMENTWISE)
def _lower_elementwise(exe, n):
    ins = [exe.graph.nodes[i] for i in n.inputs]
    return [elementwise_step(step_name(n), node_expr(n, exe.graph), exe.buf(n), n.shape,
                             [exe.buf(i) for i in ins], [i.shape for i in ins],
                             [i.dtype for i in ins])]


@lowering("matmul")
def _lower_matmul(exe, n):
    a, b = (exe.graph.nodes[i] for i in n.inputs)
    return matmul_steps(step_name(n), exe.buf(n), exe.buf(a), exe.buf(b), a.shape, b.shape,
                        n.shape, exe.device_array)


@lowering("linear")
def _lower_linear(exe, n):
    ins = [exe.graph.nodes[i] for i in n.inputs]
    x, w = ins[0], ins[1]
    k, cols = x.shape[-1], w.shape[1]
    m = math.prod(x.shape[:-1])
    name, act, epi = step_name(n), n.attrs["activation"], None
    if n.attrs["has_bias"] or act:   # bias and activation in one in-place element-wise pass
        expr = ("in", 0, dt.F32)
        eins, eshapes = [exe.buf(n)], [(m, cols)]
        if n.attrs["has_bias"]:
            expr = ("binary", "add", dt.F32, expr, ("in", 1, dt.F32))
            eins.append(exe.buf(ins[2]))
            eshapes.append(ins[2].shape)
        if act:
            expr = ("activation", act, dt.F32, expr)
        epi = elementwise_step(name + " epilogue", expr, exe.buf(n), (m, cols), eins, eshapes,
                               [dt.F32] * len(eins))
    return matmul_steps(name, exe.buf(n), exe.buf(x), exe.buf(w), (m, k), w.shape, (m, cols),
                        exe.device_array, epi)
