"""compile(): a Graph becomes a CudaExecutable, one stage after another.

    legalise   ops that choose their tier here (OpDef.choose: the conv family,
               lower_vision.py conv_tier; the FFTs, lower_fft.py fft_tier) and got a tier that
               rewrites them become that tier's ops (im2col / col2im and products, numba
               implicit-GEMM nodes, the numba FFT nodes), on a copy of the graph
    validate   the graph has outputs; what runs: the outputs' ancestors and every in-place
               write (a kv_write into a param matters even when nothing reads it)
    views      nodes that own no memory alias their input (reshape, same-dtype cast, the
               transposes products read through an op-T flag, narrows of an aligned
               contiguous slice, and strided narrows only element-wise kernels read); in-place
               writes alias their target; no node may read memory after an in-place write
               replaced it
    layout     2-D weights read only by products are stored [N, K] (lower_matmul)
    fuse       element-wise regions and folded epilogues (passes/fusion.py)
    plan       activations, inputs, constants and outputs get byte ranges of one arena by
               liveness (memory.py); params live in a ParamStore instead
    bind       the LowerCtx allocates the arena, binds the params from the store and
               uploads the constants (runtime/program.py)
    lower      each node that runs becomes bound Steps (runtime/lower*.py, given the
               LowerCtx), each declaring the bytes it reads and writes: the Program
    AOT        compile_mode "aot": every kernel compiled (or loaded from disk) now
    runner     GRAPH / MULTISTREAM: the runner that captures or spreads the steps
               (runtime/cudagraph.py, made when the CudaExecutable binds the Program)

The stages up to ``plan`` are runtime/plan.py, ``bind`` .. ``AOT`` runtime/program.py (a
Program), the runner runtime/executable.py (a CudaExecutable runs the Program); this module
is the public entry above them (``legalise`` and ``plan_graph`` are re-exported for a look
at the stages, e.g. notebooks/08).
"""
from __future__ import annotations

from .ir.graph import Graph
from .modes import CompileMode, ExecMode, parse_precision
from .runtime.executable import CudaExecutable, compile_graph
from .runtime.params import ParamStore
from .runtime.plan import legalise, plan_graph  # noqa: F401 (the stages, for a look)


def compile(graph: Graph, compile_mode="jit", exec_mode="stream",  # noqa: A001
            params: ParamStore | None = None, stream=None, precision="f32") -> CudaExecutable:
    """Compile a graph: validate, plan memory, lower every node to a bound Step. ``params``:
    a ParamStore shared with other executables (one device copy of their params, set through
    any of them); by default the executable gets a store of its own. ``stream``: the numba
    stream its work is queued on (default: a new one), e.g. one stream for the graphs of a
    model, which run one after another. ``precision``: "f32" (the graph as built), or "bf16"
    / "f16": the graph's autocast copy is compiled (``graph.autocast``; the user's graph is
    not changed), its params read only by products stored in that dtype (set_param rounds
    them once; get_param returns the rounded values)."""
    p = parse_precision(precision)
    if p != "f32":
        graph = graph.autocast(p, half_params=True)
    return compile_graph(graph, compile_mode, exec_mode, params, stream)


def eager(graph: Graph, inputs: dict | None = None, params: dict | None = None):
    """Compile, set params and run once with a sync after every step; returns numpy outputs."""
    exe = compile(graph, CompileMode.JIT, ExecMode.EAGER)
    for k, v in (params or {}).items():
        exe.set_param(k, v)
    return exe.run(inputs or {})
