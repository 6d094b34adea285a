"""Find and load libcublas, libcublasLt and libnvrtc (no GPU needed to load them).

Where they can be (searched in this order, for each CUDA major version in turn):
  * NVIDIA's pip wheels in any site-packages dir on sys.path: CUDA 13 puts every library in
    ``nvidia/cu13/lib``; CUDA 12 uses one dir per library (``nvidia/cublas/lib``,
    ``nvidia/cuda_nvrtc/lib``). The wheels ship only versioned names (``libcublas.so.12``).
  * ``$CUDA_HOME`` / ``$CUDA_PATH`` (``lib64``, ``lib``, ``targets/x86_64-linux/lib``) and
    ``/usr/local/cuda``;
  * the system loader (``LD_LIBRARY_PATH``, ldconfig) by soname.
The major version that matches the driver comes first (a CUDA 13 library needs a CUDA 13
driver; a CUDA 12 library runs on either), then older ones; without a driver, 12 then 13.
cuBLAS and cuBLASLt always come from the same directory (libcublas needs its own Lt).
"""
from __future__ import annotations

import ctypes
import os
import site
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..device import driver_version

MAJORS = (13, 12)
WHEEL_DIRS = {13: {"cublas": "nvidia/cu13/lib", "cublasLt": "nvidia/cu13/lib", "nvrtc": "nvidia/cu13/lib"},
              12: {"cublas": "nvidia/cublas/lib", "cublasLt": "nvidia/cublas/lib",
                   "nvrtc": "nvidia/cuda_nvrtc/lib"}}


class LibraryNotFound(RuntimeError):
    """A CUDA library could not be loaded; the message lists every place tried."""


@dataclass
class Loaded:
    name: str
    path: str           # absolute path, or the bare soname when the system loader found it
    major: int
    lib: ctypes.CDLL = field(repr=False)


def soname(name: str, major: int) -> str:
    return f"lib{name}.so.{major}"


def major_order(driver: int | None = None) -> list[int]:
    """CUDA majors to try, best first, for a driver version like 12040 (None: no driver)."""
    if driver is None:
        driver = driver_version()
    if not driver:
        return [12, 13]
    top = driver // 1000
    return [m for m in MAJORS if m <= top] or [min(MAJORS)]


def site_dirs() -> list[Path]:
    dirs = []
    try:
        dirs += site.getsitepackages()
    except AttributeError:  # some virtualenvs
        pass
    dirs += [site.getusersitepackages()] + sys.path
    seen, out = set(), []
    for d in dirs:
        p = Path(d or ".").resolve()
        if p not in seen and p.is_dir():
            seen.add(p)
            out.append(p)
    return out


def candidates(name: str, major: int) -> list[str]:
    """Paths to try for lib<name>.so.<major>, in order; the last is the bare soname."""
    so = soname(name, major)
    out = [str(d / WHEEL_DIRS[major][name] / so) for d in site_dirs()]
    for env in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(env)
        if root:
            out += [str(Path(root) / sub / so) for sub in ("lib64", "lib", "targets/x86_64-linux/lib")]
    out += [f"/usr/local/cuda/lib64/{so}", so]
    return list(dict.fromkeys(out))


def _try(path: str, tried: list[str]) -> ctypes.CDLL | None:
    if os.sep in path and not os.path.exists(path):
        tried.append(f"{path} (no such file)")
        return None
    try:
        return ctypes.CDLL(path)
    except OSError as e:
        tried.append(f"{path} ({e})")
        return None


_cache: dict[str, Loaded] = {}


def load_cublas() -> tuple[Loaded, Loaded]:
    """(cublasLt, cublas) from one directory and one major version; cached."""
    if "cublas" not in _cache:
        tried: list[str] = []
        for major in major_order():
            for lt_path in candidates("cublasLt", major):
                lt = _try(lt_path, tried)
                if lt is None:
                    continue
                # libcublas from the same place (a bare soname: the loader's choice)
                same = (str(Path(lt_path).parent / soname("cublas", major)) if os.sep in lt_path
                        else soname("cublas", major))
                blas = _try(same, tried)
                if blas is not None:
                    _cache["cublasLt"] = Loaded("cublasLt", lt_path, major, lt)
                    _cache["cublas"] = Loaded("cublas", same, major, blas)
                    break
            if "cublas" in _cache:
                break
        else:
            raise LibraryNotFound(_message("cuBLAS/cuBLASLt", tried))
    return _cache["cublasLt"], _cache["cublas"]


def load_nvrtc() -> Loaded:
    if "nvrtc" not in _cache:
        tried: list[str] = []
        for major in major_order():
            for path in candidates("nvrtc", major):
                lib = _try(path, tried)
                if lib is not None:
                    _cache["nvrtc"] = Loaded("nvrtc", path, major, lib)
                    return _cache["nvrtc"]
        raise LibraryNotFound(_message("NVRTC", tried))
    return _cache["nvrtc"]


def wheel_candidates(sonames, subdirs) -> list[str]:
    """Paths to try for a library of NVIDIA's other wheels (cuDNN, cuFFT, NCCL): each site
    dir's ``subdirs``, then $CUDA_HOME / $CUDA_PATH (lib64, lib), then the bare sonames (the
    system loader)."""
    out = [str(d / sub / so) for so in sonames for d in site_dirs() for sub in subdirs]
    for env in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(env)
        if root:
            out += [str(Path(root) / sub / so) for so in sonames for sub in ("lib64", "lib")]
    return list(dict.fromkeys(out)) + list(sonames)


def load_first(what: str, paths, mode: int = ctypes.DEFAULT_MODE, before=None) -> ctypes.CDLL:
    """The first of ``paths`` that loads (``before(path)`` runs first for a full path: cuDNN's
    sub-libraries), its ``path`` set; LibraryNotFound naming every place tried."""
    tried: list[str] = []
    for path in paths:
        if os.sep in path and not os.path.exists(path):
            tried.append(f"{path} (no such file)")
            continue
        try:
            if before is not None and os.sep in path:
                before(path)
            lib = ctypes.CDLL(path, mode=mode)
        except OSError as e:
            tried.append(f"{path} ({e})")
            continue
        lib.path = path
        return lib
    raise LibraryNotFound(f"{what} not found; install NVIDIA's wheel (pip install "
                          f"'rlx_numba[cu12]' or [cu13]). Tried:\n  " + "\n  ".join(tried))


def prototyped(loaded: ctypes.CDLL, protos: dict, error) -> ctypes.CDLL:
    """``loaded`` with each function of ``protos`` (name -> argtypes) returning an int status
    that raises ``error(name, status)`` when not 0 (the cuFFT and cuSOLVER shims)."""
    def check(status, func, args):
        if status != 0:
            raise error(func.__name__, status)
        return status
    for name, argtypes in protos.items():
        fn = getattr(loaded, name)
        fn.argtypes, fn.restype, fn.errcheck = argtypes, ctypes.c_int, check
    return loaded


def probe(load, whole: bool = False) -> tuple[bool, str]:
    """(True, "") when ``load()`` succeeds (no GPU work), else (False, why): the error's first
    line, or ``whole`` of it on one line. Never raises."""
    try:
        load()
        return True, ""
    except Exception as e:  # noqa: BLE001 - reported, not raised
        lines = str(e).splitlines() or [type(e).__name__]
        return False, " ".join(x.strip() for x in lines) if whole else lines[0]


def _message(what: str, tried: list[str]) -> str:
    drv = driver_version()
    head = (f"{what} not found (driver {drv // 1000}.{drv % 1000 // 10}" if drv else
            f"{what} not found (no CUDA driver") + f"; CUDA majors tried {major_order()}). "
    hint = ("Install NVIDIA's wheels: pip install 'rlx_numba[cu12]' (or [cu13] for a CUDA 13 "
            "driver), or set CUDA_HOME to a toolkit. Tried:\n  ")
    return head + hint + "\n  ".join(tried)
