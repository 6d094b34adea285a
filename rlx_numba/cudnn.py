"""cuDNN through ctypes: convolution forward, backward-data and backward-filter (the conv tier
0 of ir/ops_vision.py), NCHW or NHWC (channels last) in f32, f16 or bf16, with the algorithm
found once when a step is bound. Half tensors (CUDNN_DATA_HALF / _BFLOAT16) run with compute type CUDNN_DATA_FLOAT (f32
accumulation, as torch's), tensor cores allowed, and never an engine whose numerical notes
say it reduces in reduced precision.

The library is NVIDIA's pip wheel (``nvidia-cudnn-cu12`` / ``-cu13``: ``nvidia/cudnn/lib``, or
``nvidia/cu13/lib``), ``$CUDA_HOME``, or the system loader; cuDNN 9's sub-libraries are loaded
from the same directory first (RTLD_GLOBAL), as its dispatcher opens them by name. Two APIs,
timed against each other when a step is bound: the descriptor API (cudnnFind*AlgorithmEx and
cudnnConvolutionForward and its two backward siblings), and the graph (backend) API, whose
engines the descriptor API does not reach (the implicit-GEMM engine torch runs for a 3x3
64->64 layer of 8x64x56x56: 65.7 us, against 96.6 for the descriptor API's best on an H200).
A fused bias + relu epilogue runs on the descriptor API (cudnnConvolutionBiasActivationForward). Math is CUDNN_FMA_MATH (no TF32) unless ``rlx_numba.cublas.allow_tf32`` is set when
the step is bound. 1-D convolutions run as 2-D ones of height 1. Each (device, stream) has one
workspace (WORKSPACE_BYTES), so steps on one stream share it and concurrent streams do not
(fused attention's backward may need more: ``workspace`` keeps a larger one per pair).
Fused attention (forward with or without its softmax stats, and backward) runs through
NVIDIA's cuDNN frontend: ``sdpa_plan``, ``sdpa_backward_plan``.
"""
from __future__ import annotations

import ctypes
import math
import threading
from ctypes import POINTER, byref, c_float, c_int, c_int64, c_size_t, c_void_p
from pathlib import Path

from .device import when_stream_dies

DATA_FLOAT, TENSOR_NCHW, TENSOR_NHWC, CROSS_CORRELATION = 0, 0, 1, 1
# cudnnDataType_t of the storage kinds (cudnn_graph.h: HALF 2, BFLOAT16 9)
DATA_TYPES = {"f32": DATA_FLOAT, "f16": 2, "bf16": 9}
ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2}
DEFAULT_MATH, TENSOR_OP_MATH, FMA_MATH = 0, 1, 3
WORKSPACE_BYTES = 64 << 20
SUBLIBS = ("graph", "ops", "cnn", "adv", "engines_precompiled", "engines_runtime_compiled",
           "heuristic")


class CudnnError(RuntimeError):
    def __init__(self, call: str, status: int, text: str = ""):
        self.call, self.status = call, status
        super().__init__(f"{call} failed: cuDNN status {status} {text}".rstrip())


class AlgoPerf(ctypes.Structure):   # cudnnConvolution{Fwd,BwdData,BwdFilter}AlgoPerf_t
    _fields_ = [("algo", c_int), ("status", c_int), ("time", c_float), ("memory", c_size_t),
                ("determinism", c_int), ("mathType", c_int), ("reserved", c_int * 3)]


P = c_void_p
PROTOS = {
    "cudnnCreate": [POINTER(c_void_p)],
    "cudnnDestroy": [c_void_p],
    "cudnnSetStream": [P, P],
    "cudnnCreateTensorDescriptor": [POINTER(c_void_p)],
    "cudnnSetTensorNdDescriptor": [P, c_int, c_int, POINTER(c_int), POINTER(c_int)],
    "cudnnCreateFilterDescriptor": [POINTER(c_void_p)],
    "cudnnSetFilterNdDescriptor": [P, c_int, c_int, c_int, POINTER(c_int)],
    "cudnnCreateConvolutionDescriptor": [POINTER(c_void_p)],
    "cudnnSetConvolutionNdDescriptor": [P, c_int, POINTER(c_int), POINTER(c_int), POINTER(c_int),
                                        c_int, c_int],
    "cudnnSetConvolutionGroupCount": [P, c_int],
    "cudnnSetConvolutionMathType": [P, c_int],
    "cudnnFindConvolutionForwardAlgorithmEx": [P, P, P, P, P, P, P, P, c_int, POINTER(c_int),
                                               POINTER(AlgoPerf), P, c_size_t],
    "cudnnFindConvolutionBackwardDataAlgorithmEx": [P, P, P, P, P, P, P, P, c_int,
                                                    POINTER(c_int), POINTER(AlgoPerf), P,
                                                    c_size_t],
    "cudnnFindConvolutionBackwardFilterAlgorithmEx": [P, P, P, P, P, P, P, P, c_int,
                                                      POINTER(c_int), POINTER(AlgoPerf), P,
                                                      c_size_t],
    "cudnnConvolutionForward": [P, P, P, P, P, P, P, c_int, P, c_size_t, P, P, P],
    "cudnnConvolutionBackwardData": [P, P, P, P, P, P, P, c_int, P, c_size_t, P, P, P],
    "cudnnConvolutionBackwardFilter": [P, P, P, P, P, P, P, c_int, P, c_size_t, P, P, P],
    "cudnnConvolutionBiasActivationForward": [P, P, P, P, P, P, P, c_int, P, c_size_t, P, P, P,
                                              P, P, P, P, P],
    "cudnnCreateActivationDescriptor": [POINTER(c_void_p)],
    "cudnnSetActivationDescriptor": [P, c_int, c_int, ctypes.c_double],
    "cudnnBackendCreateDescriptor": [c_int, POINTER(c_void_p)],
    "cudnnBackendDestroyDescriptor": [P],
    "cudnnBackendFinalize": [P],
    "cudnnBackendSetAttribute": [P, c_int, c_int, c_int64, P],
    "cudnnBackendGetAttribute": [P, c_int, c_int, c_int64, POINTER(c_int64), P],
    "cudnnBackendExecute": [P, P, P],
}
RELU, PROPAGATE_NAN = 1, 1

_lib = None
# A stream gets a handle and a WORKSPACE_BYTES workspace of its own (steps on two streams may
# run at once), taken from the device's idle ones when its stream dies. Not destroyed: on an
# H200 each cudnnCreate + cudnnDestroy left ~23 KB of host memory behind, and a compiled conv
# graph on a stream of its own ~87 KB against ~2.5 KB on a reused handle (tools/soak.py
# --graphs). The idle ones number at most the most streams alive at once.
_handles: dict = {}          # (device, stream) -> (cudnnHandle_t, workspace device array)
_idle: dict = {}             # device -> [(cudnnHandle_t, workspace)] whose stream died
_lock = threading.RLock()     # RLock: a collection inside handle() may run _drop_stream
_ONE, _ZERO = c_float(1.0), c_float(0.0)


def _candidates() -> list[str]:
    from .cublas.loader import wheel_candidates
    return wheel_candidates(("libcudnn.so.9",), ("nvidia/cudnn/lib", "nvidia/cu13/lib"))


def _sublibs(path: str) -> None:
    for sub in SUBLIBS:
        p = Path(path).parent / f"libcudnn_{sub}.so.9"
        if p.exists():
            ctypes.CDLL(str(p), mode=ctypes.RTLD_GLOBAL)


def lib():
    """The prototyped library, loaded once; raises RuntimeError naming every place tried."""
    global _lib
    if _lib is None:
        from .cublas.loader import load_first
        loaded = load_first("cuDNN (libcudnn.so.9)", _candidates(), ctypes.RTLD_GLOBAL,
                            before=_sublibs)
        err = loaded.cudnnGetErrorString
        err.argtypes, err.restype = [c_int], ctypes.c_char_p
        for name, argtypes in PROTOS.items():
            fn = getattr(loaded, name)
            fn.argtypes, fn.restype = argtypes, c_int
            fn.errcheck = (lambda status, func, args, err=err: _check(status, func, err))
        _lib = loaded
    return _lib


def _check(status, func, err):
    if status != 0:
        raise CudnnError(func.__name__, status, err(status).decode(errors="replace"))
    return status


def available() -> tuple[bool, str]:
    """(True, "") when the library loads (no GPU work), else (False, why). Never raises."""
    from .cublas.loader import probe
    return probe(lib)


def _key(stream):
    from numba import cuda
    return cuda.get_current_device().id, int(stream) if stream is not None else 0


def handle(stream):
    """(cudnnHandle_t bound to the stream, workspace pointer) for (device, stream)."""
    key = _key(stream)
    with _lock:
        bound = _handles.get(key)
        if bound is None:
            from numba import cuda
            idle = _idle.get(key[0])
            if idle:
                bound = idle.pop()
                cuda.synchronize()    # work its dead stream left queued has used the workspace
            else:
                h = c_void_p()
                lib().cudnnCreate(byref(h))
                bound = h, cuda.device_array(WORKSPACE_BYTES, dtype="u1")
            lib().cudnnSetStream(bound[0], c_void_p(key[1]))
            _handles[key] = bound
            when_stream_dies(stream, _drop_stream, key)
    return bound[0], bound[1].device_ctypes_pointer.value


def live_handles() -> int:
    """cuDNN handles alive in this process: one per live stream that used cuDNN, and the idle
    ones kept for the next streams (as many as the most streams that were alive at once)."""
    return len(_handles) + sum(map(len, _idle.values()))


def _drop_stream(key) -> None:
    """(device, stream)'s handle and workspace go idle, for the next stream of the device;
    its grown workspaces are freed."""
    with _lock:
        _big_ws.pop(key, None)
        bound = _handles.pop(key, None)
        if bound is not None:
            _idle.setdefault(key[0], []).append(bound)


def _ints(vals):
    return (c_int * len(vals))(*vals)


def packed_strides(shape, channels_last=False) -> list:
    """The strides of a dense tensor of dims ``shape`` given in cuDNN's order [N, C, *S]
    ([K, C, *k] for a filter), stored in that order or, ``channels_last``, as [N, *S, C]."""
    order = ([0] + list(range(2, len(shape))) + [1]) if channels_last else list(range(len(shape)))
    strides, step = [0] * len(shape), 1
    for i in reversed(order):
        strides[i] = step
        step *= shape[i]
    return strides


def _tensor(shape, data_type=DATA_FLOAT, channels_last=False):
    d = c_void_p()
    lib().cudnnCreateTensorDescriptor(byref(d))
    strides = packed_strides(shape, channels_last)
    lib().cudnnSetTensorNdDescriptor(d, data_type, len(shape), _ints(shape), _ints(strides))
    return d


def conv_plan(stream, kind: str, x_shape, w_shape, y_shape, pad, stride, dilation, groups,
              x_ptr: int, w_ptr: int, y_ptr: int, tf32: bool = False, bias_ptr=None,
              z_ptr=None, dtype: str = "f32", channels_last: bool = False):
    """A no-argument callable enqueueing one convolution call on ``stream``, in the forward
    convolution's terms: x [N, C, *S] the input, w [K, C/groups, *k], y [N, K, *O] the output.
    ``kind`` "fwd" writes y from x and w; "bwd_data" writes x (dx) from y (dy) and w;
    "bwd_filter" writes w (dw) from x and y (dy). The fastest algorithm that fits the
    workspace is found now (cudnnFind*AlgorithmEx, run on these buffers). A forward with
    ``bias_ptr`` (a [K] bias) is relu(conv + bias (+ z [N, K, *O] at ``z_ptr``)) in one
    cudnnConvolutionBiasActivationForward (NaN propagated, as torch's relu). ``dtype`` ("f32",
    "f16", "bf16") is x's, w's and y's, and the bias's and z's (cuDNN's PSEUDO_HALF /
    PSEUDO_BFLOAT16 configurations); the math is f32 whatever it is (the f32 compute type:
    conv + bias + z and the relu in f32, rounded once on y's store). ``channels_last``: x, y
    (and z) are stored [N, *S, C] and w [K, *k, C/groups] (CUDNN_TENSOR_NHWC); the shapes are
    still given in the [N, C, *S] / [K, C/groups, *k] order."""
    L = lib()
    code = DATA_TYPES[dtype]
    half = dtype != "f32"
    if len(x_shape) == 3:        # 1-D as 2-D of height 1
        x_shape, w_shape, y_shape = ([*s[:2], 1, s[2]] for s in (x_shape, w_shape, y_shape))
        pad, stride, dilation = (0, *pad), (1, *stride), (1, *dilation)
    h, ws = handle(stream)
    cl = channels_last
    xd, yd = _tensor(list(x_shape), code, cl), _tensor(list(y_shape), code, cl)
    wd = c_void_p()
    L.cudnnCreateFilterDescriptor(byref(wd))
    L.cudnnSetFilterNdDescriptor(wd, code, TENSOR_NHWC if cl else TENSOR_NCHW, len(w_shape),
                                 _ints(list(w_shape)))
    cd = c_void_p()
    L.cudnnCreateConvolutionDescriptor(byref(cd))
    nd = len(x_shape) - 2
    L.cudnnSetConvolutionNdDescriptor(cd, nd, _ints(list(pad)), _ints(list(stride)),
                                      _ints(list(dilation)), CROSS_CORRELATION, DATA_FLOAT)
    L.cudnnSetConvolutionGroupCount(cd, groups)
    # half: tensor cores (f32 accumulation under the f32 compute type); f32: TF32 only if asked
    math_type = TENSOR_OP_MATH if half else DEFAULT_MATH if tf32 else FMA_MATH
    L.cudnnSetConvolutionMathType(cd, math_type)
    perf, count = (AlgoPerf * 8)(), c_int()
    x, w, y, wsp = (c_void_p(p) for p in (x_ptr, w_ptr, y_ptr, ws))
    find, call, args = {
        "fwd": ("cudnnFindConvolutionForwardAlgorithmEx", "cudnnConvolutionForward",
                (xd, x, wd, w, cd, yd, y)),
        "bwd_data": ("cudnnFindConvolutionBackwardDataAlgorithmEx",
                     "cudnnConvolutionBackwardData", (wd, w, yd, y, cd, xd, x)),
        "bwd_filter": ("cudnnFindConvolutionBackwardFilterAlgorithmEx",
                       "cudnnConvolutionBackwardFilter", (xd, x, yd, y, cd, wd, w)),
    }[kind]
    getattr(L, find)(h, *args, 8, byref(count), perf, wsp, WORKSPACE_BYTES)
    ok = [p for p in perf[:count.value] if p.status == 0 and p.memory <= WORKSPACE_BYTES
          and (tf32 or half or p.mathType == FMA_MATH)]      # never TF32 unless asked for
    if not ok:
        raise CudnnError(find, 0, f"found no algorithm for {kind} x {list(x_shape)} w "
                         f"{list(w_shape)} y {list(y_shape)}")
    fn = getattr(L, call)
    keep = (xd, yd, wd, cd)                           # the descriptors live with the callables
    if bias_ptr is not None:
        bd, ad = _tensor([1, y_shape[1]] + [1] * (len(y_shape) - 2), code, cl), c_void_p()
        L.cudnnCreateActivationDescriptor(byref(ad))
        L.cudnnSetActivationDescriptor(ad, RELU, PROPAGATE_NAN, 0.0)
        keep += (bd, ad)
        fn = L.cudnnConvolutionBiasActivationForward
        z = c_void_p(z_ptr) if z_ptr is not None else y

    def legacy(p):
        if bias_ptr is not None:
            head = (h, byref(_ONE), xd, x, wd, w, cd, p.algo, wsp, c_size_t(WORKSPACE_BYTES),
                    byref(_ONE if z_ptr is not None else _ZERO), yd, z, bd, c_void_p(bias_ptr),
                    ad, yd, y)
        else:
            head = (h, byref(_ONE), *args[:4], cd, p.algo, wsp, c_size_t(WORKSPACE_BYTES),
                    byref(_ZERO), *args[5:])

        def launch(fn=fn, head=head, keep=keep):
            fn(*head)
        launch.api = "descriptor"
        return launch

    # Find's ranking is one run each (it has put a 3x3x3 conv3d's 56 us algorithm before its
    # 16 us one): the first few (of the first one's math type: the descriptor holds one) are
    # timed again here, beside the graph API's engines
    ok = [p for p in ok if p.mathType == ok[0].mathType]
    L.cudnnSetConvolutionMathType(cd, ok[0].mathType)
    if bias_ptr is None:
        cands = [legacy(p) for p in ok[:3]] + _graph_plans(
            h, kind, x_shape, w_shape, y_shape, pad, stride, dilation, (x_ptr, w_ptr, y_ptr), ws,
            tf32, dtype, cl)
    else:   # the fused call may refuse an algorithm Find ranked for the plain forward (in half
        # too): the first three that run
        cands = [c for c in (legacy(p) for p in ok) if _runs(c)][:3]
        if not cands:
            raise CudnnError("cudnnConvolutionBiasActivationForward", 0,
                             f"no algorithm runs the fused bias + relu for {dtype} x "
                             f"{list(x_shape)} w {list(w_shape)} y {list(y_shape)}")
    if len(cands) == 1:
        return cands[0]
    return min(cands, key=lambda c: _time(c, stream))


def _runs(fn) -> bool:
    """Whether one call of ``fn`` succeeds (a cuDNN error status: False)."""
    try:
        fn()
    except CudnnError:
        return False
    return True


def _time(fn, stream, runs: int = 3) -> float:
    """ms a call of ``fn`` (after one warm-up), by CUDA events on ``stream``."""
    from numba import cuda
    s = stream if stream is not None else 0
    fn()
    e0, e1 = cuda.event(), cuda.event()
    e0.record(s)
    for _ in range(runs):
        fn()
    e1.record(s)
    e1.synchronize()
    return cuda.event_elapsed_time(e0, e1) / runs


# ---- the graph (backend) API ----------------------------------------------------------------
# enum values of cudnn_graph.h (cuDNN 9): attribute types, descriptor types, attribute names
T_HANDLE, T_DATA_TYPE, T_INT64, T_FLOAT, T_VOID_PTR, T_CONV_MODE = 0, 1, 3, 4, 6, 7
T_HEUR_MODE, T_NOTE, T_DESC = 8, 11, 15
D_CONV, D_ENGINE, D_ENGINECFG, D_HEUR, D_PLAN = 1, 2, 3, 4, 5
D_OPGRAPH, D_VARIANT_PACK, D_TENSOR = 15, 16, 17
D_OP = {"fwd": 10, "bwd_filter": 11, "bwd_data": 12}
OP_ATTRS = {   # (alpha, beta, conv descriptor, {tensor role: attribute}) per operation
    "fwd": (700, 701, 702, {"w": 703, "x": 704, "y": 705}),
    "bwd_data": (706, 707, 708, {"w": 709, "x": 710, "y": 711}),       # dx, dy
    "bwd_filter": (712, 713, 714, {"w": 715, "x": 716, "y": 717}),     # dw, x, dy
}
NOTE_TENSOR_CORE, NOTE_DOWN_CONVERT, NOTE_REDUCED_PRECISION = 0, 1, 2
# engine configs asked of the heuristics, and the most tried (in their order): for f32 with TF32
# off most of them are tensor-core (TF32) engines, skipped; the 3x3 layer above has its FMA
# engine at places 28-30 of 32
HEUR_INSTANT, HEUR_CONFIGS, GRAPH_PLANS = 0, 64, 4


class _Desc:
    """A backend descriptor, destroyed with this object."""

    def __init__(self, kind: int):
        self.p = c_void_p()
        lib().cudnnBackendCreateDescriptor(kind, byref(self.p))

    def set(self, attr: int, typ: int, vals, ctype=c_int64):
        arr = (ctype * len(vals))(*vals)
        lib().cudnnBackendSetAttribute(self.p, attr, typ, len(vals), arr)
        return self

    def desc(self, attr: int, *descs):
        return self.set(attr, T_DESC, [d.p.value for d in descs], c_void_p)

    def get_descs(self, attr: int, kind: int, n: int) -> list:
        out = [_Desc(kind) for _ in range(n)]
        arr, count = (c_void_p * n)(*[d.p.value for d in out]), c_int64()
        lib().cudnnBackendGetAttribute(self.p, attr, T_DESC, n, byref(count), arr)
        return out[:count.value]

    def finalize(self):
        lib().cudnnBackendFinalize(self.p)
        return self

    def __del__(self):
        if self.p.value and _lib is not None:
            try:
                _lib.cudnnBackendDestroyDescriptor(self.p)
            except Exception:  # noqa: BLE001 - at interpreter exit the library may be gone
                pass


def _align(*ptrs, itemsize: int = 4) -> int:
    a = 16
    while a > itemsize and any(p % a for p in ptrs):
        a //= 2
    return a


def _graph_plans(h, kind, x_shape, w_shape, y_shape, pad, stride, dilation, ptrs, ws, tf32,
                 dtype="f32", channels_last=False):
    """Launch callables for the first GRAPH_PLANS engine configs cuDNN's heuristics give for
    this convolution that finalize, fit the workspace and (f32, unless ``tf32``) do no TF32;
    in half, none that down-converts or reduces in reduced precision (the compute type is
    f32: the sums stay f32)."""
    half = dtype != "f32"
    skip = ({NOTE_DOWN_CONVERT, NOTE_REDUCED_PRECISION} if half
            else set() if tf32 else {NOTE_TENSOR_CORE, NOTE_DOWN_CONVERT})
    try:
        align = _align(*ptrs, itemsize=ITEMSIZE[dtype])
        tensors = {}
        for uid, (role, shape) in enumerate((("x", x_shape), ("w", w_shape),
                                             ("y", y_shape)), 1):
            strides = packed_strides(shape, channels_last)
            tensors[role] = (_Desc(D_TENSOR).set(901, T_DATA_TYPE, [DATA_TYPES[dtype]], c_int)
                             .set(902, T_INT64, list(shape)).set(903, T_INT64, strides)
                             .set(906, T_INT64, [uid]).set(900, T_INT64, [align]).finalize())
        conv = (_Desc(D_CONV).set(100, T_DATA_TYPE, [DATA_FLOAT], c_int)
                .set(101, T_CONV_MODE, [CROSS_CORRELATION], c_int)
                .set(106, T_INT64, [len(pad)]).set(102, T_INT64, list(dilation))
                .set(103, T_INT64, list(stride)).set(105, T_INT64, list(pad))
                .set(104, T_INT64, list(pad)).finalize())
        alpha, beta, conv_attr, roles = OP_ATTRS[kind]
        op = _Desc(D_OP[kind]).set(alpha, T_FLOAT, [1.0], c_float).set(beta, T_FLOAT, [0.0],
                                                                         c_float)
        for role, attr in roles.items():
            op.desc(attr, tensors[role])
        op.desc(conv_attr, conv).finalize()
        graph = _Desc(D_OPGRAPH).desc(801, op).set(800, T_HANDLE, [h.value], c_void_p).finalize()
        heur = (_Desc(D_HEUR).desc(201, graph).set(200, T_HEUR_MODE, [HEUR_INSTANT], c_int)
                .finalize())
        cfgs = heur.get_descs(202, D_ENGINECFG, HEUR_CONFIGS)
    except CudnnError:
        return []
    plans = []
    for cfg in cfgs:
        if len(plans) == GRAPH_PLANS:
            break
        try:
            if skip:
                engine = cfg.get_descs(300, D_ENGINE, 1)[0]
                notes, n = (c_int * 16)(), c_int64()
                lib().cudnnBackendGetAttribute(engine.p, 1303, T_NOTE, 16, byref(n), notes)
                if skip & set(notes[:n.value]):
                    continue
            plan = _Desc(D_PLAN).set(400, T_HANDLE, [h.value], c_void_p).desc(401, cfg).finalize()
            need = c_int64()
            lib().cudnnBackendGetAttribute(plan.p, 402, T_INT64, 1, byref(c_int64()),
                                           byref(need))
            if need.value > WORKSPACE_BYTES:
                continue
            pack = (_Desc(D_VARIANT_PACK).set(1000, T_INT64, [1, 2, 3])
                    .set(1001, T_VOID_PTR, list(ptrs), c_void_p)
                    .set(1003, T_VOID_PTR, [ws], c_void_p).finalize())
        except CudnnError:
            continue

        def launch(h=h, plan=plan, pack=pack, keep=(tensors, conv, op, graph, cfg)):
            lib().cudnnBackendExecute(h, plan.p, pack.p)
        launch.api, launch.workspace = "graph", need.value
        plans.append(launch)
    return plans


# ---- fused attention (scaled dot-product attention) through cuDNN's frontend ------------------
# NVIDIA's ``nvidia-cudnn-frontend`` package (the GPU extras, 1.14: its pygraph takes raw
# device pointers keyed by tensor uid and a raw cudnnHandle_t) builds the SDPA graphs (the
# forward, with or without its softmax stats, and the backward); cuDNN picks its fused
# flash-attention engines (tensor cores, f32 softmax and accumulation). Building those graphs
# by hand with backend descriptors is several hundred lines of attribute plumbing the frontend
# already keeps in step with each cuDNN release.
#
# The stats are each query row's log-sum-exp (natural log) of the scores cuDNN softmaxes:
# attn_scale * q.k + bias, masked (-inf where masked): max + log(sum exp(s - max)), f32
# [B, Hq, Sq, 1], the numbers the numba flash kernel saves as attention's LSE
# (kernels/attention.py), so a forward on either tier feeds a backward on either.
_Q, _K, _V, _O, _BIAS, _STATS, _DO, _DQ, _DK, _DV = range(1, 11)
_sdpa_cache: dict = {}
_big_ws: dict = {}            # (device, stream) -> workspaces past WORKSPACE_BYTES, largest last


def frontend():
    """(the ``cudnn`` frontend module bound to this module's libcudnn, None) or (None, why)."""
    ok, why = available()
    if not ok:
        return None, why
    lib()                   # its soname loaded first: the frontend's dlopen then finds it
    try:
        import cudnn as fe
    except Exception as e:  # noqa: BLE001 - any import failure means "no frontend"
        return None, (f"the cuDNN frontend (pip install nvidia-cudnn-frontend) is not "
                      f"importable: {type(e).__name__}: {e}")
    if not hasattr(fe, "pygraph") or fe.backend_version() < 90000:
        return None, "the cuDNN frontend or backend is too old for fused attention (cuDNN 9)"
    return fe, None


def workspace(stream, nbytes: int) -> int:
    """A device workspace of at least ``nbytes`` for (device, stream): the handle's own
    (WORKSPACE_BYTES) when that is enough, else one kept for the pair and grown to the largest
    size asked (the fused backward's holds an f32 dQ accumulator, B * Hq * Sq * D * 4 bytes).
    A grown-out one stays allocated: calls bound before hold its pointer. Steps on one stream
    run one at a time, so they share it."""
    h, ws = handle(stream)
    if nbytes <= WORKSPACE_BYTES:
        return ws
    from numba import cuda
    held = _big_ws.setdefault(_key(stream), [])
    if not held or held[-1].size < nbytes:
        held.append(cuda.device_array(int(nbytes), dtype="u1"))
    return held[-1].device_ctypes_pointer.value


def _sdpa_graph(stream, dtype: str, key, build, what: str):
    """The built SDPA graph of ``key`` (cached per handle), ``build(fe, g, io)`` adding its
    tensors and op to a fresh pygraph of io type ``dtype`` (f16 / bf16); with the handle and
    a workspace pointer that fits it. Raises CudnnError when cuDNN has no engine for it."""
    fe, why = frontend()
    if fe is None:
        raise CudnnError(what, -1, why)
    h, _ = handle(stream)
    key = (h.value, what, dtype) + tuple(key)
    g = _sdpa_cache.get(key)
    if g is None:
        io = {"f16": fe.data_type.HALF, "bf16": fe.data_type.BFLOAT16}[dtype]
        g = fe.pygraph(io_data_type=io, intermediate_data_type=fe.data_type.FLOAT,
                       compute_data_type=fe.data_type.FLOAT, handle=h.value)
        try:
            build(fe, g, io)
            g.validate()
            g.build_operation_graph()
            g.create_execution_plans([fe.heur_mode.A, fe.heur_mode.FALLBACK])
            g.check_support()
            g.build_plans()
        except Exception as e:  # noqa: BLE001 - the frontend raises several types
            raise CudnnError(what, -1, f"no fused-attention engine: {e}") from None
        _sdpa_cache[key] = g
    return g, h.value, workspace(stream, g.get_workspace_size())


def _stats_layout(dims_q):
    b, hq, sq, _ = dims_q
    return [b, hq, sq, 1], [hq * sq, sq, 1, 1]


def _bias_tensor(g, bias_dims, io):
    if not bias_dims:
        return None
    bs = [int(math.prod(bias_dims[i + 1:])) for i in range(4)]
    return g.tensor(name="bias", dim=list(bias_dims), stride=bs, data_type=io, uid=_BIAS)


def sdpa_plan(stream, *, dims_q, dims_kv, strides_q, strides_kv, dtype: str, scale: float,
              causal: str | None, bias_dims=None, ptrs: dict | None, stats: bool = False):
    """A callable running softmax(scale q k^T (+ bias), causal) v on ``stream``: q / o of
    ``dims_q`` [B, Hq, Sq, D], k / v of ``dims_kv`` [B, Hkv, Sk, D] (Hq a multiple of Hkv),
    each with its element strides (o's are q's); ``causal`` None, "top_left" or
    "bottom_right" (query i sees keys j <= i + Sk - Sq); ``bias_dims`` the additive bias's
    [B or 1, Hq or 1, Sq or 1, Sk] (contiguous, ``dtype``). ``stats``: also the rows'
    log-sum-exp (f32 [B, Hq, Sq], contiguous) at ptrs["stats"], for the backward. ``ptrs``:
    q, k, v, o (and bias, stats) device pointers; None: only build the graph (a tier's check)
    and return None. The built graph is cached per handle, shape and attributes. Raises
    CudnnError when cuDNN has no engine for it."""
    def build(fe, g, io):
        q = g.tensor(name="q", dim=list(dims_q), stride=list(strides_q), data_type=io, uid=_Q)
        k = g.tensor(name="k", dim=list(dims_kv), stride=list(strides_kv), data_type=io, uid=_K)
        v = g.tensor(name="v", dim=list(dims_kv), stride=list(strides_kv), data_type=io, uid=_V)
        o, st = g.sdpa(name="sdpa", q=q, k=k, v=v, is_inference=not stats,
                       attn_scale=float(scale), bias=_bias_tensor(g, bias_dims, io),
                       use_causal_mask=causal == "top_left",
                       use_causal_mask_bottom_right=causal == "bottom_right")
        o.set_output(True).set_dim(list(dims_q)).set_stride(list(strides_q)).set_uid(_O) \
            .set_data_type(io)
        if stats:
            dims, strides = _stats_layout(dims_q)
            st.set_output(True).set_dim(dims).set_stride(strides).set_uid(_STATS) \
                .set_data_type(fe.data_type.FLOAT)

    key = (tuple(dims_q), tuple(dims_kv), tuple(strides_q), tuple(strides_kv), float(scale),
           causal, tuple(bias_dims) if bias_dims else None, stats)
    g, hv, ws = _sdpa_graph(stream, dtype, key, build, "sdpa")
    if ptrs is None:
        return None
    pack = {_Q: ptrs["q"], _K: ptrs["k"], _V: ptrs["v"], _O: ptrs["o"]}
    if bias_dims:
        pack[_BIAS] = ptrs["bias"]
    if stats:
        pack[_STATS] = ptrs["stats"]
    return lambda: g.execute(pack, ws, hv)


def sdpa_backward_plan(stream, *, dims_q, dims_kv, strides_q, strides_kv, dtype: str,
                       scale: float, causal: str | None, bias_dims=None, ptrs: dict | None):
    """A callable running attention's backward on ``stream`` in one cuDNN call: dQ, dK, dV
    from q, k, v, the forward's output o, its gradient dO and the rows' log-sum-exp ``stats``
    (f32 [B, Hq, Sq], see above), the attributes as sdpa_plan's (o, dO and dQ have q's dims and
    strides, dK and dV k's; GQA: cuDNN sums dK / dV over a group's query heads). No bias
    gradient. cuDNN computes rowsum(dO * O) itself and accumulates dQ in f32 in its workspace
    (atomics: not bitwise deterministic run to run, as torch's default; grad(deterministic=True)
    keeps the numba kernels). ``ptrs``: q, k, v, o, do, stats, dq, dk, dv (and bias); None:
    only build the graph, as sdpa_plan's. Raises CudnnError when cuDNN has no engine for it."""
    def build(fe, g, io):
        t = lambda name, dims, strides, uid: g.tensor(   # noqa: E731
            name=name, dim=list(dims), stride=list(strides), data_type=io, uid=uid)
        q, o, do = (t(nm, dims_q, strides_q, uid) for nm, uid in
                    (("q", _Q), ("o", _O), ("dO", _DO)))
        k, v = (t(nm, dims_kv, strides_kv, uid) for nm, uid in (("k", _K), ("v", _V)))
        dims, strides = _stats_layout(dims_q)
        st = g.tensor(name="stats", dim=dims, stride=strides, data_type=fe.data_type.FLOAT,
                      uid=_STATS)
        dq, dk, dv = g.sdpa_backward(name="sdpa_backward", q=q, k=k, v=v, o=o, dO=do,
                                     stats=st, attn_scale=float(scale),
                                     bias=_bias_tensor(g, bias_dims, io),
                                     use_causal_mask=causal == "top_left",
                                     use_causal_mask_bottom_right=causal == "bottom_right")
        for grad, dims_, strides_, uid in ((dq, dims_q, strides_q, _DQ),
                                           (dk, dims_kv, strides_kv, _DK),
                                           (dv, dims_kv, strides_kv, _DV)):
            grad.set_output(True).set_dim(list(dims_)).set_stride(list(strides_)).set_uid(uid) \
                .set_data_type(io)

    key = (tuple(dims_q), tuple(dims_kv), tuple(strides_q), tuple(strides_kv), float(scale),
           causal, tuple(bias_dims) if bias_dims else None)
    g, hv, ws = _sdpa_graph(stream, dtype, key, build, "sdpa_backward")
    if ptrs is None:
        return None
    pack = {uid: ptrs[name] for uid, name in
            ((_Q, "q"), (_K, "k"), (_V, "v"), (_O, "o"), (_DO, "do"), (_STATS, "stats"),
             (_DQ, "dq"), (_DK, "dk"), (_DV, "dv"))}
    if bias_dims:
        pack[_BIAS] = ptrs["bias"]
    return lambda: g.execute(pack, ws, hv)
