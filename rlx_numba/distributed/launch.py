"""Starting the processes of a multi-GPU run, and handing rank 0's NCCL unique id to the
others (the rendezvous).

``launch(n, script, args)`` (``rlx-numba launch --gpus N script.py ...``) starts N Python
processes with the variables torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), so a script written for torchrun's environment runs unchanged;
the first process to fail takes the others down and its exit code is returned.

The exchanges move one small payload (the 128-byte ncclUniqueId) from rank 0 to every rank:
``exchange_tcp`` (rank 0 serves it on MASTER_ADDR:MASTER_PORT) and ``exchange_file`` (rank 0
writes a file on a filesystem all ranks see). Neither needs NCCL or a GPU.
"""
from __future__ import annotations

import ipaddress
import os
import socket
import struct
import subprocess
import sys
import time

EXCHANGE_TIMEOUT = 300.0    # seconds a rank waits for rank 0 (or rank 0 for the others)
_MAGIC = b"RLXN"            # so a stray connection or a foreign server is recognised


# ------------------------------------------------------------------------------- rendezvous

def _check(call: str, rank: int, world_size: int, payload) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"{call}: rank {rank} is not in [0, world_size {world_size})")
    if rank == 0 and not isinstance(payload, (bytes, bytearray)):
        raise ValueError(f"{call}: rank 0 must give the payload as bytes, got "
                         f"{type(payload).__name__}")


def exchange_file(path: str, rank: int, world_size: int, payload: bytes | None = None,
                  timeout: float = EXCHANGE_TIMEOUT, poll: float = 0.02) -> bytes:
    """Rank 0's ``payload`` on every rank, through the file ``path`` (a "file://" prefix is
    allowed). Rank 0 writes it atomically (a temporary file, then rename); the others poll
    for it, read it and leave ``path.ack<rank>``; rank 0 waits for every ack and removes the
    files, so the next run does not read this one's id. A file left by a crashed run would be
    read by the next one: use a fresh path per run, as with torch's file:// init."""
    _check("exchange_file", rank, world_size, payload)
    path = path[len("file://"):] if path.startswith("file://") else path
    if world_size == 1:
        return bytes(payload)
    deadline = time.monotonic() + timeout
    acks = [f"{path}.ack{r}" for r in range(1, world_size)]
    if rank == 0:
        _write_atomic(path, bytes(payload))
        while True:
            missing = [a for a in acks if not os.path.exists(a)]
            if not missing:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"exchange_file: rank 0 waited {timeout:g} s for the other "
                                   f"ranks to read {path}; still missing {missing}")
            time.sleep(poll)
        for f in [path, *acks]:
            try:
                os.remove(f)
            except FileNotFoundError:
                pass
        return bytes(payload)
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"exchange_file: rank {rank} waited {timeout:g} s for rank 0 to "
                               f"write {path}")
        time.sleep(poll)
    with open(path, "rb") as f:
        data = f.read()
    _write_atomic(f"{path}.ack{rank}", b"")
    return data


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp{os.getpid()}.{time.monotonic_ns()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _bind_address(addr: str) -> str:
    """Loopback stays loopback; any other address (often a host name that resolves to a
    127.0.1.1 alias on rank 0's own machine) listens on every interface, as torch's TCPStore
    does, so the other hosts can reach it."""
    try:
        if addr == "localhost" or ipaddress.ip_address(addr).is_loopback:
            return addr
    except ValueError:
        pass
    return ""


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def exchange_tcp(addr: str, port: int, rank: int, world_size: int,
                 payload: bytes | None = None, timeout: float = EXCHANGE_TIMEOUT) -> bytes:
    """Rank 0's ``payload`` on every rank, over TCP: rank 0 listens on ``addr:port`` and
    answers each other rank once; the others connect, retrying until rank 0 is up or
    ``timeout`` seconds have passed. Messages: rank -> 0: MAGIC, rank (u32); 0 -> rank:
    MAGIC, length (u32), payload."""
    _check("exchange_tcp", rank, world_size, payload)
    if world_size == 1:
        return bytes(payload)
    deadline = time.monotonic() + timeout
    if rank == 0:
        return _serve(addr, int(port), world_size, bytes(payload), deadline, timeout)
    last = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((addr, int(port)), timeout=min(5.0, timeout)) as s:
                s.settimeout(max(0.1, deadline - time.monotonic()))
                s.sendall(_MAGIC + struct.pack("<I", rank))
                head = _recv_exact(s, 8)
                if head[:4] != _MAGIC:
                    raise ConnectionError(f"{addr}:{port} is not rank 0's id server")
                (n,) = struct.unpack("<I", head[4:])
                return _recv_exact(s, n)
        except (ConnectionError, socket.timeout, OSError) as e:
            last = e
            time.sleep(0.05)
    raise TimeoutError(f"exchange_tcp: rank {rank} could not get the id from rank 0 at "
                       f"{addr}:{port} within {timeout:g} s (last error: {last}); is MASTER_ADDR "
                       f"rank 0's host and MASTER_PORT free there?")


def _serve(addr, port, world_size, payload, deadline, timeout) -> bytes:
    served: set = set()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            srv.bind((_bind_address(addr), port))
        except OSError as e:
            raise RuntimeError(f"exchange_tcp: rank 0 cannot listen on {addr}:{port} ({e}); "
                               f"set MASTER_PORT to a free port") from e
        srv.listen(world_size)
        while len(served) < world_size - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, world_size)) - served)
                raise TimeoutError(f"exchange_tcp: rank 0 waited {timeout:g} s on {addr}:{port}"
                                   f"; ranks {missing} never came")
            srv.settimeout(left)
            try:
                conn, _ = srv.accept()
            except socket.timeout:
                continue
            with conn:
                try:
                    conn.settimeout(min(5.0, max(0.1, deadline - time.monotonic())))
                    head = _recv_exact(conn, 8)
                    if head[:4] != _MAGIC:
                        continue            # not one of ours
                    (r,) = struct.unpack("<I", head[4:])
                    conn.sendall(_MAGIC + struct.pack("<I", len(payload)) + payload)
                except (ConnectionError, socket.timeout, OSError):
                    continue                # that rank retries
                if 0 < r < world_size:
                    served.add(r)
    return payload


# -------------------------------------------------------------------------------- launcher

def free_port(addr: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (the OS's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def launch(nprocs: int, script: str, args=(), master_port: int | None = None,
           master_addr: str = "127.0.0.1", python: str | None = None,
           poll: float = 0.05) -> int:
    """Run ``python script *args`` as ``nprocs`` processes, rank r with RANK=LOCAL_RANK=r,
    WORLD_SIZE=LOCAL_WORLD_SIZE=nprocs, MASTER_ADDR, MASTER_PORT (a free port by default);
    wait for all. When one exits non-zero the others are terminated and its code is
    returned (128 + signal for a process killed by a signal); 0 when all succeed."""
    if int(nprocs) < 1:
        raise ValueError(f"launch: nprocs must be >= 1, got {nprocs}")
    if not os.path.isfile(script):
        raise FileNotFoundError(f"launch: script {script!r} not found")
    port = int(master_port) if master_port else free_port(master_addr)
    procs = []
    try:
        for r in range(int(nprocs)):
            env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nprocs),
                       LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR=master_addr,
                       MASTER_PORT=str(port))
            procs.append(subprocess.Popen([python or sys.executable, script, *map(str, args)],
                                          env=env))
        while True:
            codes = [p.poll() for p in procs]
            bad = [c for c in codes if c not in (None, 0)]
            if bad:
                _stop(procs)
                return _exit_code(bad[0])
            if all(c == 0 for c in codes):
                return 0
            time.sleep(poll)
    except KeyboardInterrupt:
        _stop(procs)
        return 130
    except BaseException:
        _stop(procs)
        raise


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code


def _stop(procs, grace: float = 10.0) -> None:
    """Terminate the processes still running; kill those that outlive ``grace`` seconds."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        p.terminate()
    deadline = time.monotonic() + grace
    for p in live:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
