"""rlx_numba: a pure-Python CUDA backend (numba-cuda kernels, cuBLAS through ctypes) for an
RLX-style graph IR. Runs under the numba CUDA simulator when there is no GPU."""
from .device import is_available, patch_simulator, simulator_enabled  # first: decides the simulator
from .device import install_exit_teardown
from .ir.dtypes import DType, dtype
from .ir.graph import Graph, Node, Tensor
from .ir.ops_custom import CustomOp, custom_op, custom_vjp
from .modes import CompileMode, ExecMode
from .runtime.executable import CudaExecutable
from .compiler import compile, eager
from .runtime.params import ParamStore
from . import optim
from .train import Trainer, compile_train
from . import onnx  # noqa: F401  (rlx.onnx.load; the onnx package is imported on use)

if simulator_enabled():
    patch_simulator()
# after numba.cuda's import (the modules above): atexit runs the teardown before numba's handlers
install_exit_teardown()

__version__ = "0.1.0"

__all__ = ["is_available", "simulator_enabled", "DType", "dtype", "Graph", "Node", "Tensor",
           "CompileMode", "ExecMode", "CudaExecutable", "compile", "eager", "ParamStore", "optim",
           "compile_train", "Trainer", "onnx", "CustomOp", "custom_op", "custom_vjp", "__version__"]
