"""Compile kernels for a GPU without one: registers, spills and GPU-only typing errors.

The simulator runs kernels as Python, so it cannot see what only the GPU compiler sees: a
signed/unsigned mix that numba types as float64, a kernel that needs more registers than a
1024-thread block may have (it then fails to launch), spills. This compiles the row kernels,
the SGEMM (and its f64 kind) and the linear-algebra kernels (f32 and f64 kinds) for sm_90 with
numba's real compiler and runs ptxas on the PTX.

Needs libnvvm and ptxas (a CUDA toolkit, e.g. /usr/local/cuda) and NVRTC
(``pip install nvidia-cuda-nvrtc``); no GPU or driver.

  RLX_NUMBA_SIMULATOR=0 python tools/ptx_report.py [--ptxas /usr/local/cuda/bin/ptxas]
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ["RLX_NUMBA_SIMULATOR"] = "0"

import numba.cuda.dispatcher as _dispatcher  # noqa: E402
from numba import cuda  # noqa: E402
from numba import types as T  # noqa: E402


class _Sm90:
    compute_capability = (9, 0)


# device functions compile for "the current device"; there is none, so say sm_90
_dispatcher.get_current_device = lambda: _Sm90()


def ptxas(ptx: str, exe: str) -> str:
    """ptxas's register/spill line, plus a warning when the PTX does float64 math (usually an
    int64/uint64 mix that numba typed as float64)."""
    f64 = sum(1 for ln in ptx.splitlines() if re.match(r"\s+[a-z][a-z0-9.]*\.f64\b", ln))
    note = f"; {f64} FLOAT64 INSTRUCTIONS" if f64 else ""
    return _ptxas(ptx, exe) + note


def _ptxas(ptx: str, exe: str) -> str:
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([exe, "-arch=sm_90", "-v", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
    if r.returncode:
        return "ptxas failed: " + r.stderr.strip()
    info = [ln.split("info    : ")[-1] for ln in r.stderr.splitlines()]
    return "; ".join(s.strip() for s in info if "registers" in s or "spill" in s)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ptxas", default="/usr/local/cuda/bin/ptxas")
    args = p.parse_args(argv)
    from rlx_numba.kernels import rows

    f32 = T.float32[::1]
    names = {v: k for k, v in rows.KINDS.items()}
    for kind in rows.KINDS.values():
        for flags in ((False, False, False), (True, True, True)):
            for cols in (256, 4096, 8192):
                g, vpt, block, pf, _ = rows.row_plan(cols, kind in (rows.SOFTMAX, rows.LOG_SOFTMAX))
                k = rows.rows_reg(kind, g, vpt, block, *flags, pf, False)
                sig = (f32,) * 6 + (T.uint64, T.uint64, T.float32)
                ptx, _ = cuda.compile_ptx(k.py_func, sig, cc=(9, 0),
                                          launch_bounds=(block, max(1, 1024 // block)))
                print(f"rows_reg {names[kind]:<12} flags={int(any(flags))} g={g:<4} vpt={vpt:<2} "
                      f"block={block:<4} prefetch={int(pf)} {ptxas(ptx, args.ptxas)}")
            b = rows.LOOP_BLOCK
            k = rows.rows_loop(kind, b, rows.LOOP_UNROLL, rows.LOOP_CACHED, *flags)
            ptx, _ = cuda.compile_ptx(k.py_func, (f32,) * 6 + (T.uint64, T.uint64, T.float32),
                                      cc=(9, 0), launch_bounds=(b, max(1, 1024 // b)))
            print(f"rows_loop {names[kind]:<12} flags={int(any(flags))} {ptxas(ptx, args.ptxas)}")
            k = rows.cols(kind, *flags)
            ptx, _ = cuda.compile_ptx(k.py_func, (f32,) * 6 + (T.int64,) * 3 + (T.float32,),
                                      cc=(9, 0))
            print(f"cols      {names[kind]:<12} flags={int(any(flags))} {ptxas(ptx, args.ptxas)}")
    from rlx_numba.kernels import matmul as mm

    i64 = T.int64[::1]
    for ta in (False, True):
        for tb in (False, True):
            sig = (f32,) * 3 + (T.int64,) * 3 + (i64, i64, T.int64)
            ptx, _ = cuda.compile_ptx(mm.sgemm_kernel(ta, tb).py_func, sig, cc=(9, 0),
                                      launch_bounds=mm.LAUNCH_BOUNDS)
            print(f"sgemm     trans_a={int(ta)} trans_b={int(tb)} {mm.BM}x{mm.BN}x{mm.BK} "
                  f"tile, {mm.TM}x{mm.TN} a thread {ptxas(ptx, args.ptxas)}")
            f64 = T.float64[::1]     # the f64 kind (expected: float64 math, one block an SM)
            sig = (f64,) * 3 + (T.int64,) * 3 + (i64, i64, T.int64)
            ptx, _ = cuda.compile_ptx(mm.sgemm_kernel(ta, tb, "f64", "f64").py_func, sig,
                                      cc=(9, 0), launch_bounds=(mm.NT, 1))
            print(f"dgemm     trans_a={int(ta)} trans_b={int(tb)} {ptxas(ptx, args.ptxas)}")
    linalg(args.ptxas)
    return 0


def linalg(exe: str) -> None:
    """The linear-algebra kernels in both kinds (the f64 kind: float64 math expected)."""
    from rlx_numba.kernels import linalg as K
    i, info = T.int64, T.int32[::1]
    for f64 in (False, True):
        F = (T.float64 if f64 else T.float32)[::1]
        for name, k, sig in (
                ("lu solve", K.lu_kernel(True, f64), (F,) * 5 + (i,) * 3),
                ("lu slogdet", K.lu_kernel(False, f64), (F,) * 5 + (i,) * 3),
                ("cholesky", K.cholesky_kernel, (F, F, i, i)),
                ("trsm", K.trsm_kernel(False), (F, F, F, i, i, i)),
                ("qr", K.qr_kernel(f64), (F, F, F, i, i, i)),
                ("eigh", K.eigh_kernel(f64), (F, F, F, i, i)),
                ("svd", K.svd_kernel(f64), (F, F, F, i, i, i)),
                ("slogdet_lu", K.slogdet_lu(f64), (F, info, info, F, i, i)),
                ("qr form q", K.qr_form_q_kernel(True, f64), (F, F, F, i, i, i)),
                ("eigh post", K.eigh_post_kernel, (F, F, info, F, i, i)),
                ("svd post", K.svd_post_kernel, (F, F, F, info, F) + (i,) * 5)):
            ptx, _ = cuda.compile_ptx(k.py_func, sig, cc=(9, 0))
            print(f"linalg    {'f64' if f64 else 'f32'} {name:<11} {ptxas(ptx, exe)}")


if __name__ == "__main__":
    sys.exit(main())
