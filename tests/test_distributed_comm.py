"""rlx_numba.distributed's foundations without GPUs: the in-process communicator's
collectives against NumPy, the unique-id exchanges (file and TCP, ranks as threads), the NCCL
loader's failure report, and the launcher (real processes of a tiny script)."""
import os
import socket
import sys
import threading

import numpy as np
import pytest
from numba import cuda

import rlx_numba
import rlx_numba.distributed as dist
from rlx_numba.distributed import nccl
from rlx_numba.distributed.comm import check_args
from rlx_numba.distributed.launch import exchange_file, exchange_tcp, free_port, launch

OPS = ["sum", "prod", "max", "min", "avg"]


def _data(rank, n, dtype):
    rng = np.random.default_rng(100 + rank)
    if np.dtype(dtype).kind == "f":
        return rng.uniform(0.5, 1.5, n).astype(dtype) * (-1) ** rank
    return rng.integers(-5, 6, n).astype(dtype)


def _reduce_ref(parts, op):
    """Rank order, in the dtype (what InProcessCommunicator promises)."""
    fn = {"sum": np.add, "avg": np.add, "prod": np.multiply, "max": np.maximum,
          "min": np.minimum}[op]
    acc = parts[0].copy()
    for p in parts[1:]:
        acc = fn(acc, p).astype(acc.dtype)
    if op == "avg":
        n = len(parts)
        acc = (np.trunc(acc / n).astype(acc.dtype) if acc.dtype.kind == "i"
               else (acc / acc.dtype.type(n)).astype(acc.dtype))
    return acc


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_all_reduce_every_op(world, dtype):
    n = 7

    def rank_fn(comm):
        assert dist.current() is comm and comm.kind == "inprocess"
        out = {}
        for op in OPS:
            send = cuda.to_device(_data(comm.rank, n, dtype))
            recv = cuda.device_array(n, dtype=dtype)
            assert comm.all_reduce(send, recv, op) is recv
            out[op] = recv.copy_to_host()
        return out

    res = dist.run_ranks(world, rank_fn)
    parts = [_data(r, n, dtype) for r in range(world)]
    for op in OPS:
        want = _reduce_ref(parts, op)
        for r in range(world):
            assert res[r][op].dtype == np.dtype(dtype)
            np.testing.assert_array_equal(res[r][op], want, err_msg=f"{op} rank {r}")


def test_all_reduce_in_place_2d_and_stream():
    def rank_fn(comm):
        s = cuda.stream()
        buf = cuda.to_device(np.full((3, 5), comm.rank + 1, np.float32), stream=s)
        comm.all_reduce(buf, buf, "sum", s)
        return buf.copy_to_host()

    for out in dist.run_ranks(4, rank_fn):
        assert out.shape == (3, 5)
        np.testing.assert_array_equal(out, np.full((3, 5), 10, np.float32))


def test_avg_integers_truncate_toward_zero():
    def rank_fn(comm):
        send = cuda.to_device(np.array([[-3, 3, -1], [1, 2, 0]][comm.rank], np.int32))
        recv = cuda.device_array(3, np.int32)
        return comm.all_reduce(send, recv, "avg").copy_to_host()

    for out in dist.run_ranks(2, rank_fn):
        np.testing.assert_array_equal(out, [-1, 2, 0])      # -2/2, 5/2, -1/2


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_all_gather_and_broadcast(world, dtype):
    n = 7

    def rank_fn(comm):
        send = cuda.to_device(_data(comm.rank, n, dtype))
        gathered = cuda.device_array(world * n, dtype=dtype)
        comm.all_gather(send, gathered)
        bcast = []
        for root in range(world):
            recv = cuda.device_array(n, dtype=dtype)
            comm.broadcast(send, recv, root=root)
            bcast.append(recv.copy_to_host())
        return gathered.copy_to_host(), bcast

    parts = [_data(r, n, dtype) for r in range(world)]
    for gathered, bcast in dist.run_ranks(world, rank_fn):
        np.testing.assert_array_equal(gathered, np.concatenate(parts))
        for root in range(world):
            np.testing.assert_array_equal(bcast[root], parts[root])


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_reduce_scatter_every_op(world, dtype):
    n = 7

    def rank_fn(comm):
        out = {}
        for op in OPS:
            send = cuda.to_device(_data(comm.rank, world * n, dtype).reshape(world, n))
            recv = cuda.device_array(n, dtype=dtype)
            comm.reduce_scatter(send, recv, op)
            out[op] = recv.copy_to_host()
        return out

    res = dist.run_ranks(world, rank_fn)
    parts = [_data(r, world * n, dtype) for r in range(world)]
    for op in OPS:
        full = _reduce_ref(parts, op)
        for r in range(world):
            np.testing.assert_array_equal(res[r][op], full[r * n:(r + 1) * n],
                                          err_msg=f"{op} rank {r}")


def test_float_sum_is_in_dtype_and_rank_order():
    # 1 + 1e-8 + ... in f32 loses the small terms; a float64 accumulation would not
    vals = [np.float32(1.0), np.float32(1e-8), np.float32(1e-8), np.float32(1e-8)]

    def rank_fn(comm):
        buf = cuda.to_device(np.array([vals[comm.rank]], np.float32))
        comm.all_reduce(buf, buf)
        comm.barrier()
        return buf.copy_to_host()[0]

    assert dist.run_ranks(4, rank_fn) == [np.float32(1.0)] * 4


@cuda.jit
def _add_rank(a, v):
    i = cuda.grid(1)
    if i < a.size:
        cuda.syncthreads()
        a[i] += v


def test_kernels_on_every_rank():
    # the simulator swaps this module's `cuda` while a kernel runs: run_ranks must keep two
    # ranks from launching (or calling cuda.to_device) at the same time
    def rank_fn(comm):
        for _ in range(3):
            a = cuda.to_device(np.zeros(40, np.float32))
            _add_rank[2, 32](a, comm.rank + 1.0)
            comm.all_reduce(a, a)
        return a.copy_to_host()

    for out in dist.run_ranks(4, rank_fn):
        np.testing.assert_array_equal(out, np.full(40, 10, np.float32))


def test_argument_errors():
    def rank_fn(comm):
        a = cuda.to_device(np.zeros(7, np.float32))
        errs = []
        for call in (lambda: comm.all_reduce(a, a, "mean"),
                     lambda: comm.all_reduce(a, cuda.device_array(6, np.float32)),
                     lambda: comm.all_reduce(a, cuda.device_array(7, np.int32)),
                     lambda: comm.all_gather(a, cuda.device_array(7, np.float32)),
                     lambda: comm.reduce_scatter(a, cuda.device_array(7, np.float32)),
                     lambda: comm.broadcast(a, a, root=2),
                     lambda: comm.call("all_to_all", a, a),
                     lambda: comm.all_reduce(np.zeros(7, np.float32), a)):
            with pytest.raises((ValueError, TypeError)) as e:
                call()
            errs.append(str(e.value))
        comm.barrier()      # the errors were raised before any exchange: the group is intact
        return errs

    errs = dist.run_ranks(2, rank_fn)[0]
    assert "all_reduce: op 'mean' is not one of" in errs[0]
    assert "all_reduce: recv has 6 elements; expected 7" in errs[1]
    assert "all_reduce: send is float32 but recv is int32" in errs[2]
    assert "all_gather: recv has 7 elements; expected 14 (world_size 2 x send's 7)" in errs[3]
    assert "reduce_scatter: send has 7 elements; expected 14 (world_size 2 x recv's 7)" in errs[4]
    assert "broadcast: root 2 is not a rank of world_size 2" in errs[5]
    assert "all_to_all" in errs[6]
    assert "all_reduce: send must be a device array" in errs[7]
    with pytest.raises(ValueError, match="dtype bool is not supported"):
        check_args("all_reduce", 3, 3, "bool", "bool", "sum", 0, 2)


def test_failure_on_one_rank_does_not_hang_the_others():
    def rank_fn(comm):
        a = cuda.to_device(np.ones(4, np.float32))
        if comm.rank == 1:
            raise KeyError("boom")      # before the collective the others wait in
        comm.all_reduce(a, a)
        return "unreachable"

    with pytest.raises(KeyError, match="rank 1: boom"):
        dist.run_ranks(3, rank_fn)


def test_ranks_disagreeing_or_returning_early_fail_fast():
    def mismatched(comm):
        a = cuda.to_device(np.ones(4 + comm.rank, np.float32))
        comm.all_reduce(a, a)

    with pytest.raises(ValueError, match="all_reduce: the ranks disagree"):
        dist.run_ranks(2, mismatched)

    def early(comm):
        if comm.rank == 0:
            return 0
        comm.barrier()

    with pytest.raises(dist.GroupAborted, match=r"rank\(s\) \[0\] returned without calling"):
        dist.run_ranks(2, early, timeout=60)


def test_barrier_timeout():
    comms = dist.InProcessCommunicator.group(2, timeout=0.2)
    with pytest.raises(dist.GroupAborted, match="within 0.2 s"):
        comms[0].barrier()          # rank 1 never comes


def test_current_and_set_current():
    assert dist.current() is None
    comms = dist.InProcessCommunicator.group(1)
    dist.set_current(comms[0])
    try:
        assert dist.current() is comms[0]
        seen = []
        t = threading.Thread(target=lambda: seen.append(dist.current()))
        t.start()
        t.join()
        assert seen == [None]       # thread-local
    finally:
        dist.set_current(None)
    # world_size 1: every collective is a copy
    a = cuda.to_device(np.arange(5, dtype=np.float32))
    out = cuda.device_array(5, np.float32)
    comms[0].all_gather(a, out)
    np.testing.assert_array_equal(out.copy_to_host(), np.arange(5))


@pytest.mark.skipif(not rlx_numba.simulator_enabled(), reason="on a GPU init makes an NCCL comm")
def test_init_under_the_simulator_points_to_run_ranks():
    with pytest.raises(RuntimeError, match="run_ranks"):
        dist.init(rank=0, world_size=1)


# ------------------------------------------------------------------------------ exchanges

def _threads(world, fn):
    out, errs = [None] * world, []

    def body(r):
        try:
            out[r] = fn(r)
        except Exception as e:  # noqa: BLE001
            errs.append(e)

    ts = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errs, errs
    return out


def test_exchange_file(tmp_path):
    payload = os.urandom(nccl.NCCL_UNIQUE_ID_BYTES)
    path = str(tmp_path / "uid")
    got = _threads(4, lambda r: exchange_file("file://" + path, r, 4,
                                              payload if r == 0 else None, timeout=30))
    assert got == [payload] * 4
    assert os.listdir(tmp_path) == []       # rank 0 removed the id and the acks
    with pytest.raises(TimeoutError, match="waited 0.1 s for rank 0"):
        exchange_file(path, 1, 2, timeout=0.1)


def test_exchange_tcp():
    payload = os.urandom(nccl.NCCL_UNIQUE_ID_BYTES)
    port = free_port()

    def rank(r):
        if r == 0:          # rank 0 late: the others must retry
            threading.Event().wait(0.3)
        return exchange_tcp("127.0.0.1", port, r, 4, payload if r == 0 else None, timeout=30)

    assert _threads(4, rank) == [payload] * 4
    with pytest.raises(TimeoutError, match="could not get the id from rank 0"):
        exchange_tcp("127.0.0.1", free_port(), 1, 2, timeout=0.3)
    with pytest.raises(ValueError, match="rank 0 must give the payload"):
        exchange_tcp("127.0.0.1", port, 0, 2, None)


def test_exchange_tcp_ignores_a_stray_connection():
    payload = b"x" * 128
    port = free_port()
    t = threading.Thread(target=lambda: socket.create_connection(("127.0.0.1", port),
                                                                 timeout=5).close())

    def rank(r):
        if r == 1:
            threading.Event().wait(0.2)
            t.start()
            t.join()
        return exchange_tcp("127.0.0.1", port, r, 2, payload if r == 0 else None, timeout=30)

    assert _threads(2, rank) == [payload] * 2


# ---------------------------------------------------------------------------------- NCCL

def test_nccl_unavailable_is_reported_not_raised(monkeypatch, tmp_path):
    monkeypatch.setattr(nccl, "_lib", None)
    monkeypatch.setattr(nccl, "_candidates",
                        lambda: [str(tmp_path / "libnccl.so.2"), "libnccl-missing.so.2"])
    ok, why = nccl.available()
    assert ok is False
    assert "libnccl.so.2" in why and str(tmp_path) in why and "libnccl-missing.so.2" in why
    assert "\n" not in why
    with pytest.raises(RuntimeError, match="not found"):
        nccl.lib()


def test_nccl_tables_and_error_message():
    assert nccl.DTYPES["float32"] == 7 and nccl.DTYPES["bfloat16"] == 9
    assert nccl.DTYPES["float16"] == 6 and nccl.DTYPES["int64"] == 4
    assert nccl.OPS == {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}
    e = nccl.NcclError("ncclAllReduce", 4, "invalid argument; last error: count is 0")
    assert str(e) == ("ncclAllReduce failed: ncclResult_t 4 (ncclInvalidArgument): invalid "
                      "argument; last error: count is 0")
    uid = bytes(range(128))
    assert bytes(nccl.as_unique_id(uid)) == uid
    with pytest.raises(ValueError, match="expected 128 bytes, got 16"):
        nccl.as_unique_id(b"x" * 16)


# -------------------------------------------------------------------------------- launcher

SCRIPT = """
import os, sys
out = sys.argv[1]
path = os.path.join(out, "rank" + os.environ["RANK"])
with open(path + ".tmp", "w") as f:
    f.write(" ".join(os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE",
                                             "MASTER_ADDR", "MASTER_PORT")))
os.replace(path + ".tmp", path)     # whole or absent, even if the launcher kills this rank
if len(sys.argv) > 2 and os.environ["RANK"] == sys.argv[2]:
    import glob, time             # fail only once every rank has written its file (a loaded
    t = time.monotonic()          # machine may start the others late)
    while (len(glob.glob(os.path.join(out, "rank[0-9]"))) < int(os.environ["WORLD_SIZE"])
           and time.monotonic() - t < 20):
        time.sleep(0.05)
    sys.exit(int(sys.argv[3]))
if len(sys.argv) > 2:
    import time; time.sleep(60)     # the launcher must stop this one
"""


def test_launch_two_processes(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    assert launch(2, str(script), [str(tmp_path)], master_port=12345,
                  python=sys.executable) == 0
    for r in range(2):
        assert (tmp_path / f"rank{r}").read_text() == f"{r} {r} 2 127.0.0.1 12345"


def test_launch_propagates_a_failure(tmp_path):
    import time
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    t0 = time.monotonic()
    assert launch(2, str(script), [str(tmp_path), "1", "7"]) == 7
    assert time.monotonic() - t0 < 30       # rank 0 (sleeping 60 s) was terminated
    port = (tmp_path / "rank0").read_text().split()[-1]
    assert port.isdigit() and int(port) > 0


def test_cli_launch(tmp_path, capsys):
    from rlx_numba.cli import main
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    assert main(["launch", "--gpus", "2", str(script), str(tmp_path), "0", "3"]) == 3
    with pytest.raises(SystemExit):
        main(["launch", "--gpus", "2", str(tmp_path / "missing.py")])
    assert "missing.py" in capsys.readouterr().err
