"""The kernel disk cache (kernels/cache.py, codegen.load_kernel), AOT compilation and NVTX ranges.

A second process must reuse what the first wrote; a damaged or stale entry must be rebuilt,
never trusted. The simulator compiles nothing, so there the generated .py files are what a
second process reuses; numba's compiled-kernel cache (RlxCache) is checked on real numba
dispatchers in a process with the simulator off (numba builds dispatchers without a GPU; the
compiled kernel is then a stand-in, only its caching is under test), and end to end on a GPU
by the same tests when one is present.
"""
import io
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import rlx_numba as rlx
from conftest import ON_GPU
from rlx_numba.kernels import cache
from rlx_numba.runtime import trace

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, cache_dir, extra_env=None, arg: str = "") -> dict:
    """Run ``code`` in a fresh interpreter with this checkout importable and the cache at
    ``cache_dir``; it prints one JSON line last, returned parsed."""
    env = dict(os.environ, RLX_NUMBA_CACHE_DIR=str(cache_dir),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("NUMBA_CACHE_DIR", None)
    env.update(extra_env or {})
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code), arg], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


# ---- a second process reuses the generated kernels (and, on a GPU, numba's cache) ----------
BLOCK = """
import json, math, sys
import numpy as np
import rlx_numba as rlx
from rlx_numba.kernels import cache

rng = np.random.default_rng(int(sys.argv[1]))
g = rlx.Graph("block")
x = g.input("x", (3, 37), "f32")
gamma = g.param("gamma", (37,), "f32")
beta = g.param("beta", (37,), "f32")
y = g.layer_norm(g.gelu(x) + x, gamma, beta)
g.set_outputs([g.softmax(y * 2.0, axis=-1)])
exe = rlx.compile(g, compile_mode="aot")
xv = rng.standard_normal((3, 37)).astype(np.float32)
gv, bv = rng.standard_normal(37).astype(np.float32), rng.standard_normal(37).astype(np.float32)
exe.set_param("gamma", gv)
exe.set_param("beta", bv)
(out,) = exe.run({"x": xv})

# the oracle, in float64
x64 = xv.astype(np.float64)
h = x64 * 0.5 * (1 + np.vectorize(math.erf)(x64 / math.sqrt(2))) + x64
mu = h.mean(-1, keepdims=True)
ln = (h - mu) / np.sqrt(((h - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * gv + bv
e = np.exp(2 * ln - (2 * ln).max(-1, keepdims=True))
ref = e / e.sum(-1, keepdims=True)
print(json.dumps({"err": float(np.abs(out - ref).max()), "stats": dict(cache.STATS)}))
"""


def _files(d: Path) -> dict:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted((d / "kernels").glob("ew_*.py"))}


def test_second_process_hits_the_cache_and_damaged_entries_are_rebuilt(tmp_path):
    first = _python(BLOCK, tmp_path, arg="1")
    assert first["err"] < 1e-5
    written = first["stats"].get("py_written", 0)
    assert written >= 1 and first["stats"].get("py_reused", 0) == 0
    files = _files(tmp_path)
    assert len(files) == written                       # in RLX_NUMBA_CACHE_DIR, nowhere else
    if ON_GPU:                                         # numba compiled them all, and saved them
        assert first["stats"].get("misses", 0) >= 3 and first["stats"].get("hits", 0) == 0

    second = _python(BLOCK, tmp_path, arg="2")
    assert second["err"] < 1e-5
    assert second["stats"].get("py_written", 0) == 0
    assert second["stats"]["py_reused"] == written
    assert _files(tmp_path) == files                   # not rewritten: same inode, mtime, bytes
    if ON_GPU:                                         # every kernel from numba's disk cache
        assert second["stats"].get("misses", 0) == 0
        assert second["stats"]["hits"] == first["stats"]["misses"]

    # a damaged generated file (garbage, or cut short) is rewritten and the result is right
    name = next(iter(files))
    for damage in (b"\xff\xfe not python \x00", files[name][2][:len(files[name][2]) // 2]):
        (tmp_path / "kernels" / name).write_bytes(damage)
        third = _python(BLOCK, tmp_path, arg="3")
        assert third["err"] < 1e-5
        assert third["stats"]["py_written"] == 1
        assert third["stats"].get("py_reused", 0) == written - 1
        assert (tmp_path / "kernels" / name).read_bytes() == files[name][2]
    if ON_GPU and numba_files(tmp_path):
        # a damaged numba data file: recompiled (counted), never trusted, result still right
        nbc = numba_files(tmp_path, "*.nbc")[0]
        nbc.write_bytes(nbc.read_bytes()[:100])
        fourth = _python(BLOCK, tmp_path, arg="4")
        assert fourth["err"] < 1e-5
        assert fourth["stats"].get("corrupt", 0) >= 1 and fourth["stats"].get("misses", 0) >= 1


def numba_files(d: Path, pattern: str = "*.nb?"):
    return sorted((d / "numba").rglob(pattern))


# ---- where the cache lives ------------------------------------------------------------------
def test_cache_dir_honours_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("RLX_NUMBA_CACHE_DIR", str(tmp_path / "mine"))
    assert cache.cache_dir() == tmp_path / "mine" and (tmp_path / "mine" / "kernels").is_dir()
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    assert cache.numba_cache_dir() == tmp_path / "mine" / "numba"
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "numba_own"))
    assert cache.numba_cache_dir() == tmp_path / "numba_own"     # the user's choice wins

    monkeypatch.delenv("RLX_NUMBA_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == tmp_path / "xdg" / "rlx_numba"

    (tmp_path / "file").write_text("not a directory")           # unwritable: a temp dir instead
    monkeypatch.setenv("RLX_NUMBA_CACHE_DIR", str(tmp_path / "file" / "sub"))
    d = cache.cache_dir()
    assert d != tmp_path / "file" / "sub" and (d / "kernels").is_dir()


def test_temp_fallback_must_be_private(tmp_path, monkeypatch, caplog):
    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setenv("RLX_NUMBA_CACHE_DIR", str(tmp_path / "file" / "sub"))
    monkeypatch.setattr(cache.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    shared = tmp_path / "tmp" / f"rlx_numba-{os.getuid()}"
    shared.mkdir()
    shared.chmod(0o777)                  # anyone could plant cache files here: refused,
    monkeypatch.setattr(cache, "_PROCESS_DIR", None)    # a directory of this process instead
    with caplog.at_level("WARNING", logger="rlx_numba"):
        own = cache.cache_dir()
    assert own != shared and own.name.startswith("rlx_numba-process-")
    assert (own / "kernels").is_dir() and not own.stat().st_mode & 0o077
    assert "running uncached" in caplog.text and cache.cache_dir() == own     # once a process
    monkeypatch.setattr(cache, "_PROCESS_DIR", None)
    shared.chmod(0o700)
    assert cache.cache_dir() == shared and (shared / "kernels").is_dir()


def test_a_full_cache_runs_the_kernel_uncached(tmp_path, monkeypatch, caplog):
    """Writing a generated kernel's source fails (a full or read-only disk): the kernel
    still loads and runs, with a warning, and no temp file is left behind."""
    import errno

    from rlx_numba.kernels import codegen
    monkeypatch.setenv("RLX_NUMBA_CACHE_DIR", str(tmp_path / "c"))
    real = codegen.tempfile.NamedTemporaryFile

    def full(*a, **kw):
        f = real(*a, **kw)
        f.write = lambda *_: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left"))
        return f
    monkeypatch.setattr(codegen.tempfile, "NamedTemporaryFile", full)
    g = rlx.Graph("full_cache")
    x = g.input("x", (7,))
    g.set_outputs([g.exp(x * 0.731 + 0.25)])             # a new elementwise kernel
    with caplog.at_level("WARNING", logger="rlx_numba"):
        (y,) = rlx.compile(g).run({"x": np.arange(7, dtype=np.float32)})
    np.testing.assert_allclose(y, np.exp(np.arange(7) * 0.731 + 0.25), rtol=1e-6)
    assert "it runs without the disk cache" in caplog.text, caplog.text
    assert not list((tmp_path / "c" / "kernels").glob("*.tmp"))


# ---- numba's compiled-kernel cache, on real dispatchers ---------------------------------------
# numba cache stand-ins the subprocess scripts here and in test_kernel_cache_keys.py share
NUMBA_FAKES = """
class Codegen:                      # what numba's key reads from the codegen: the target
    def magic_tuple(self):
        return ("nvptx64-nvidia-cuda", "sm_90", "")


class Context:                      # what load_overload needs of numba's target context
    def refresh(self):
        pass

    def codegen(self):
        return Codegen()
"""

NUMBA_CACHE = """
import json, logging, sys
import numpy as np
import rlx_numba
from rlx_numba.kernels import cache, rows, shape
from numba.cuda import types

logging.basicConfig(level=logging.WARNING)


""" + NUMBA_FAKES + """


class Compiled:                     # a compiled kernel as numba's cache sees it
    codegen = Codegen()

    def _reduce_states(self):
        return dict(cooperative=False, name="stand_in", signature=None,
                    codelibrary=np.arange(5), debug=False, lineinfo=False, call_helper=None,
                    extensions=[])


sig = (types.float32[::1], types.float32[::1], types.int64[::1], types.int64, types.int64,
       types.int64, types.int64)
kernels = {"gather": shape.gather,                                  # module level
           "rows": rows.rows_reg(2, 32, 4, 256, True, False, False, True, False)}   # a closure
out = {"stats": None}
phase = sys.argv[1]
for name, k in kernels.items():
    c = k._cache
    out[name] = {"cls": type(c).__name__, "path": c.cache_path}
    if phase == "save":
        c.save_overload(sig, Compiled())
    loaded = c.load_overload(sig, Context())
    out[name]["loaded"] = None if loaded is None else loaded.entry_name
    if phase == "stale":   # an edit to any kernel module: a different sources hash
        real, cache.SOURCES_HASH = cache.SOURCES_HASH, "edited"
        fresh = cache.RlxCache(k.py_func, dict(c._options))
        out[name]["stale"] = fresh.load_overload(sig, Context())
        cache.SOURCES_HASH = real
if phase == "swap":   # two keys of one kernel whose data files got each other's contents
    import pathlib
    c, sig2 = kernels["rows"]._cache, (types.float64[::1],) + sig[1:]
    c.save_overload(sig, Compiled())
    c.save_overload(sig2, Compiled())
    files = sorted(pathlib.Path(c.cache_path).glob("rows.rows_reg*.nbc"))
    blobs = [f.read_bytes() for f in files]
    files[0].write_bytes(blobs[1])
    files[1].write_bytes(blobs[0])
    out["swapped"] = [c.load_overload(s_, Context()) for s_ in (sig, sig2)]
other = rows.rows_reg(2, 32, 4, 512, True, False, False, True, False)   # other launch bounds
out["bounds_differ"] = (other._cache._index_key(sig, Codegen())
                        != kernels["rows"]._cache._index_key(sig, Codegen()))
out["stats"] = dict(cache.STATS)
print(json.dumps(out, default=repr))
"""


def test_numba_cache_survives_processes_and_rejects_damaged_or_stale_entries(tmp_path):
    env = {"RLX_NUMBA_SIMULATOR": "0"}
    beside = {p: p.stat().st_mtime_ns for p in (ROOT / "rlx_numba").rglob("*.nb[ic]")}
    saved = _python(NUMBA_CACHE, tmp_path, env, "save")
    for name in ("gather", "rows"):
        assert saved[name]["cls"] == "RlxCache"
        assert Path(saved[name]["path"]).parent == tmp_path / "numba"
        assert saved[name]["loaded"] == "stand_in"
    assert saved["bounds_differ"]          # launch bounds are part of the key
    # nothing written beside the sources (older numba files there, if any, are left alone)
    assert {p: p.stat().st_mtime_ns for p in (ROOT / "rlx_numba").rglob("*.nb[ic]")} == beside

    again = _python(NUMBA_CACHE, tmp_path, env, "load")       # a second process: hits
    assert again["gather"]["loaded"] == again["rows"]["loaded"] == "stand_in"
    assert again["stats"]["hits"] == 2 and again["stats"].get("misses", 0) == 0

    idx = [p for p in numba_files(tmp_path, "*.nbi") if p.name.startswith("shape.gather")]
    data = [p for p in numba_files(tmp_path, "*.nbc") if p.name.startswith("rows.rows_reg")]
    assert len(idx) == 1 and len(data) == 1
    idx[0].write_bytes(b"garbage, not a pickle")
    data[0].write_bytes(data[0].read_bytes()[:-7])              # truncated
    damaged = _python(NUMBA_CACHE, tmp_path, env, "load")
    assert damaged["gather"]["loaded"] is None and damaged["rows"]["loaded"] is None
    assert damaged["stats"]["corrupt"] == 2 and damaged["stats"]["misses"] == 2

    rebuilt = _python(NUMBA_CACHE, tmp_path, env, "save")     # saved again over the damage
    assert rebuilt["gather"]["loaded"] == rebuilt["rows"]["loaded"] == "stand_in"
    stale = _python(NUMBA_CACHE, tmp_path, env, "stale")
    assert stale["gather"]["loaded"] == "stand_in"
    assert stale["gather"]["stale"] is None and stale["rows"]["stale"] is None
    # the index points each key at a data file that holds the other key's kernel: both miss
    swapped = _python(NUMBA_CACHE, tmp_path, env, "swap")
    assert swapped["swapped"] == [None, None] and swapped["stats"]["corrupt"] == 2


# ---- AOT: every kernel compiled in compile(), logged, a progress bar only when watched -----
def _small():
    g = rlx.Graph("aotg")
    x = g.input("x", (2, 9), "f32")
    w = g.param("w", (9,), "f32")
    g.set_outputs([g.rms_norm(g.silu(x) * w, w)])
    return g


def _oracle(x, w):
    h = x / (1 + np.exp(-x)) * w
    return h / np.sqrt((h * h).mean(-1, keepdims=True) + 1e-6) * w


def test_aot_logs_every_kernel_without_a_progress_bar_off_a_terminal(rng, caplog, capsys):
    x = rng.standard_normal((2, 9)).astype(np.float32)
    w = rng.standard_normal(9).astype(np.float32)
    with caplog.at_level(logging.INFO, logger="rlx_numba"):
        exe = rlx.compile(_small(), compile_mode="aot")
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compile aotg:")]
    assert logged == [f"compile aotg: {s.name} {s.kernel_name}" for s in exe.steps]
    assert len(logged) >= 2
    assert "kernel" not in capsys.readouterr().err           # stderr is no TTY here: no bar
    exe.set_param("w", w)
    np.testing.assert_allclose(exe.run({"x": x})[0], _oracle(x, w), rtol=1e-5, atol=1e-6)

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rlx_numba"):
        rlx.compile(_small(), compile_mode="jit")            # JIT stays lazy: nothing compiled
    assert not [r for r in caplog.records if r.getMessage().startswith("compile aotg:")]


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_aot_progress_bar_on_a_terminal(rng, monkeypatch):
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    exe = rlx.compile(_small(), compile_mode="aot")
    text = term.getvalue()
    assert "compile aotg" in text and f"0/{len(exe.steps)}" in text and "kernel/s" in text


# ---- NVTX -----------------------------------------------------------------------------------
class _FakeNvtx:
    """Records what rlx_numba asks of the nvtx package's domain API."""

    def __init__(self):
        self.events = []

    def get_domain(self, name):
        assert name == "rlx_numba"
        return self

    def get_event_attributes(self, message):
        return message

    def push_range(self, attrs):
        self.events.append(("push", attrs))

    def pop_range(self):
        self.events.append(("pop", None))


@pytest.fixture
def fake_nvtx(monkeypatch):
    nv = _FakeNvtx()
    monkeypatch.setitem(sys.modules, "nvtx", nv)
    monkeypatch.setattr(trace, "_domain", False)   # look the package up again
    return nv


def _ranges(events):
    assert events[0::2] == [("push", m) for _, m in events[0::2]]
    assert events[1::2] == [("pop", None)] * (len(events) // 2) and len(events) % 2 == 0
    return [m for _, m in events[0::2]]


def test_profile_puts_each_step_in_an_nvtx_range(rng, fake_nvtx, monkeypatch):
    monkeypatch.delenv("RLX_NUMBA_NVTX", raising=False)
    exe = rlx.compile(_small())
    assert exe._loop_steps is exe.steps                        # run(): the bare steps
    w = rng.standard_normal(9).astype(np.float32)
    exe.set_param("w", w)
    x = rng.standard_normal((2, 9)).astype(np.float32)
    exe.run({"x": x})
    assert fake_nvtx.events == []                              # no ranges outside tracing
    prof = exe.profile({"x": x}, warmup=0)
    assert _ranges(fake_nvtx.events) == [s.name for s in exe.steps] == [r.name for r in prof]


def test_rlx_numba_nvtx_ranges_every_run(rng, fake_nvtx, monkeypatch):
    monkeypatch.setenv("RLX_NUMBA_NVTX", "1")
    exe = rlx.compile(_small(), exec_mode="eager")
    w = rng.standard_normal(9).astype(np.float32)
    exe.set_param("w", w)
    x = rng.standard_normal((2, 9)).astype(np.float32)
    np.testing.assert_allclose(exe.run({"x": x})[0], _oracle(x, w), rtol=1e-5, atol=1e-6)
    assert _ranges(fake_nvtx.events) == [s.name for s in exe.steps]


def test_rlx_numba_nvtx_without_the_package_warns(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "nvtx", None)             # import nvtx fails
    monkeypatch.setattr(trace, "_domain", False)
    monkeypatch.setenv("RLX_NUMBA_NVTX", "1")
    with caplog.at_level(logging.WARNING, logger="rlx_numba"):
        exe = rlx.compile(_small())
    assert exe._loop_steps is exe.steps
    assert any("nvtx package is not installed" in r.getMessage() for r in caplog.records)
