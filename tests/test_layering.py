"""The package's floors: a module imports only from its own floor or the ones below it.

    0 device.py, modes.py  discovery, the simulator switch; CompileMode / ExecMode and parsers
    1 ir/, memory.py     the graph, dtypes, op rules; the arena planner
    2 kernels/, cublas/, cudnn.py, cufft.py, distributed/   numba kernels; the cuBLAS /
                         cuBLASLt, cuDNN, cuFFT and NCCL shims, the communicators
    3 passes/            graph passes (fusion)
    4 runtime/           planning (plan.py), lowering to Steps (LowerCtx, Program), the
                         executable that runs a Program, params, CUDA graphs
    5 compiler.py        compile() / eager(), the pipeline's public entry; train.py
                         (compile_train) and optim.py (the optimizers) beside it
    6 models/, cli.py, __init__.py
"""
import ast
from pathlib import Path

import rlx_numba

PKG = Path(rlx_numba.__file__).parent
FLOORS = {"device": 0, "modes": 0, "ir": 1, "memory": 1, "kernels": 2, "cublas": 2, "cudnn": 2,
          "cufft": 2, "distributed": 2, "passes": 3,
          "runtime": 4, "compiler": 5, "train": 5, "optim": 5,
          "models": 6, "cli": 6, "__init__": 6}


def _part(mod_path: Path) -> str:
    rel = mod_path.relative_to(PKG)
    return rel.parts[0].removesuffix(".py")


def _imports(path: Path):
    """(line, top-level rlx_numba part) of every import in the file, function-level too."""
    pkg_parts = path.relative_to(PKG).parts[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:                      # relative: resolve against the package
                base = list(pkg_parts)[:len(pkg_parts) - (node.level - 1)]
                parts = base + (node.module.split(".") if node.module else [])
                if not parts:                   # "from . import x" at the top: x is the part
                    for a in node.names:
                        yield node.lineno, a.name
                    continue
                yield node.lineno, parts[0]
            elif node.module and node.module.startswith("rlx_numba."):
                yield node.lineno, node.module.split(".")[1]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("rlx_numba."):
                    yield node.lineno, a.name.split(".")[1]


def test_no_import_climbs_a_floor():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        own = FLOORS[_part(path)]
        rel = str(path.relative_to(PKG))
        for line, part in _imports(path):
            if part in FLOORS and FLOORS[part] > own:
                bad.append(f"{rel}:{line} imports {part} (floor {FLOORS[part]} > {own})")
    assert not bad, "\n".join(bad)


def test_every_module_has_a_floor():
    assert {_part(p) for p in PKG.rglob("*.py")} <= set(FLOORS)
