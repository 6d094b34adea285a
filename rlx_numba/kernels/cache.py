"""The kernel disk cache: where it lives, and numba's compiled-kernel cache made safe.

Two kinds of entries live under ``cache_dir()`` (``RLX_NUMBA_CACHE_DIR``, else the platform
cache dir):

* ``kernels/ew_*.py``: generated element-wise kernels, real source files (codegen.load_kernel
  writes them atomically and rewrites one whose content differs from what it should be);
* ``numba/``: numba's compiled kernels (index ``.nbi`` and data ``.nbc`` files), for every
  kernel made by ``launch.jit`` or loaded by ``codegen.load_kernel``. ``NUMBA_CACHE_DIR``, when
  the user set it, takes its place. Nothing is ever written next to rlx_numba's own sources
  (they may be in a read-only site-packages).

numba's ``cache=True`` is not used as is, for four reasons found in numba-cuda 0.30.4:

* its index key is the signature, the device, the function's bytecode and its closure
  cells, not the jit options: closures of one factory that differ only in ``launch_bounds``
  would share an entry (a kernel built for 256 threads loaded for a 1024-thread launch);
* a kernel calls device functions of other modules, whose edits the key does not see (it
  stamps only the kernel's own file);
* a truncated or damaged .nbi/.nbc makes ``pickle`` raise inside the compile (only a missing
  file is treated as a miss), and a flipped byte that still unpickles would be trusted;
* its location falls back to ``__pycache__`` beside the source, or follows
  ``numba.config.CACHE_DIR``, which numba resets whenever a ``NUMBA_*`` variable changes.

So ``attach`` gives a dispatcher an ``RlxCache``: the key adds the jit options, the freshness
stamp adds a hash of every kernel module's source, each file carries a SHA-256 of its
payload (a damaged file reads as a miss: the kernel is compiled again and the file
rewritten), and the location is always ours. Closure kernels of the factories cache too:
``func_key`` hashes their cells (ints, bools, strings, numba types, device functions,
intrinsics), which must pickle the same in every process. numba pickles an intrinsic with a
uuid1 drawn per process (its ``_reduce_states``), so a kernel whose closure (or a device
function in it) holds one, e.g. kernels/ptx.py's loads in gemv's kernels, had a new key in
every process and was compiled every time: ``func_key`` pickles an intrinsic as its name and
definition instead. The simulator compiles nothing, so there ``attach`` does nothing.
"""
from __future__ import annotations

import collections
import hashlib
import logging
import os
import pickle
import stat
import tempfile
from pathlib import Path

from ..device import SIMULATOR

log = logging.getLogger("rlx_numba")

# per process: numba kernels served from the disk cache ("hits") or compiled ("misses"),
# damaged entries met ("corrupt"); generated sources written or reused ("py_written",
# "py_reused", counted by codegen.load_kernel)
STATS = collections.Counter()
# per process: "module.qualname signature" of each kernel the disk cache missed (a warm
# process should have none: a name here in every process is a key that does not repeat)
MISSED: list[str] = []


_PROCESS_DIR: Path | None = None


def cache_dir() -> Path:
    """RLX_NUMBA_CACHE_DIR, else the platform cache dir; a private temp dir if neither is
    writable (only one this user owns and nobody else may write: cached kernels are
    unpickled, so a directory another user could plant files in is never used); else a
    fresh directory of this process's own, removed at exit: it runs uncached, with a
    warning."""
    env = os.environ.get("RLX_NUMBA_CACHE_DIR")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rlx_numba"
    try:
        (base / "kernels").mkdir(parents=True, exist_ok=True)
        return base
    except OSError:
        pass
    tmp = Path(tempfile.gettempdir()) / f"rlx_numba-{os.getuid()}"
    try:
        tmp.mkdir(mode=0o700, exist_ok=True)
        st = tmp.lstat()
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022:
            (tmp / "kernels").mkdir(exist_ok=True)
            log.warning("rlx_numba: cache dir %s is not writable; using %s", base, tmp)
            return tmp
    except OSError:
        pass
    return _process_dir(base, tmp)


def _process_dir(base: Path, tmp: Path) -> Path:
    """A private directory for this process only (mkdtemp: mode 0700, a new name), its files
    gone at exit: nothing is cached across processes."""
    global _PROCESS_DIR
    if _PROCESS_DIR is None:
        import shutil

        from ..device import at_exit
        try:
            _PROCESS_DIR = Path(tempfile.mkdtemp(prefix="rlx_numba-process-"))
            (_PROCESS_DIR / "kernels").mkdir()
        except OSError as e:
            raise RuntimeError(f"rlx_numba: no writable directory for kernels (tried {base}, "
                               f"{tmp} and a new temp dir: {e})") from e
        log.warning("rlx_numba: no usable kernel cache dir (%s is not writable and %s is not a "
                    "private directory of this user): running uncached, in %s", base, tmp,
                    _PROCESS_DIR)
        at_exit(lambda d=_PROCESS_DIR: shutil.rmtree(d, ignore_errors=True))
    return _PROCESS_DIR


def numba_cache_dir() -> Path:
    """Where numba's compiled kernels go: NUMBA_CACHE_DIR when the user set it, else
    ``cache_dir() / "numba"``."""
    env = os.environ.get("NUMBA_CACHE_DIR")
    return Path(env) if env else cache_dir() / "numba"


def _sources_hash() -> str:
    """A hash of every kernel module: a kernel may call device functions (and read constants)
    of any of them, so an edit to one makes every cached kernel stale."""
    h = hashlib.sha256()
    for p in sorted(Path(__file__).parent.glob("*.py")):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


SOURCES_HASH = _sources_hash()


def _intrinsic_by_definition(name, defn):   # never called: the pickle is only hashed
    raise AssertionError("a kernel-cache key is not unpickled")


def _llvm_by_text(kind, text):   # never called: the pickle is only hashed
    raise AssertionError("a kernel-cache key is not unpickled")


def func_key(py_func) -> tuple[str, str]:
    """(hash of the bytecode, hash of the closure cells) of a kernel's Python function: the
    part of its disk-cache key that tells closures of one factory apart. The same in every
    process for the same factory arguments (tests/test_kernel_cache_keys.py checks it across
    processes and hash seeds)."""
    import io

    from numba.cuda.extending import _Intrinsic
    from numba.cuda.serialize import NumbaPickler

    from llvmlite.ir._utils import _StrCaching

    class KeyPickler(NumbaPickler):
        def reducer_override(self, obj):
            if isinstance(obj, _Intrinsic):   # not its per-process uuid (see the module doc)
                return _intrinsic_by_definition, (obj._name, obj._defn)
            if isinstance(obj, _StrCaching):
                # an llvmlite IR type or value (an intrinsic's codegen holds ir.IntType(32)):
                # by its IR text, not its __dict__, where str() caches that text once a
                # compile has printed it -- keys computed before and after a compile differed
                return _llvm_by_text, (type(obj).__qualname__, str(obj))
            return super().reducer_override(obj)

    code = hashlib.sha256(py_func.__code__.co_code).hexdigest()
    cells = tuple(c.cell_contents for c in py_func.__closure__ or ())
    if not cells:
        return code, ""
    with io.BytesIO() as buf:
        KeyPickler(buf, protocol=4).dump(cells)
        return code, hashlib.sha256(buf.getvalue()).hexdigest()


if not SIMULATOR:
    import numba_cuda
    from numba.cuda.core.caching import (IndexDataCacheFile, _CacheLocator,
                                         _SourceFileBackedLocatorMixin)
    from numba.cuda.dispatcher import CUDACache, CUDACacheImpl
    from numba.cuda.serialize import dumps
    from numba.cuda.utils import numba_target_override

    def _sha(b: bytes) -> str:
        return hashlib.sha256(b).hexdigest()

    class _Locator(_SourceFileBackedLocatorMixin, _CacheLocator):
        """numba_cache_dir()/<source dir name>_<hash of its path>, stamped by the source file's
        mtime and size (numba's rule) and the kernel sources' hash."""

        def __init__(self, py_func, py_file):
            self._py_file = py_file
            self._lineno = py_func.__code__.co_firstlineno
            self._cache_path = str(numba_cache_dir() / self.get_suitable_cache_subpath(py_file))

        def get_cache_path(self):
            return self._cache_path

        def get_source_stamp(self):
            return super().get_source_stamp(), SOURCES_HASH

    class _Impl(CUDACacheImpl):
        _locator_classes = [_Locator]   # no fallback to __pycache__ beside the source

    class _CheckedFile(IndexDataCacheFile):
        """numba's index and data files, each written as SHA-256 + pickle. A file whose hash
        does not match (truncated, damaged, or from another writer) reads as missing, so the
        kernel is compiled again and the file rewritten; it is never unpickled."""

        def _dump(self, obj):
            data = dumps(obj)
            return hashlib.sha256(data).digest() + data

        def _read(self, path):
            with open(path, "rb") as f:
                blob = f.read()
            if len(blob) < 32 or hashlib.sha256(blob[32:]).digest() != blob[:32]:
                STATS["corrupt"] += 1
                log.warning("rlx_numba: damaged kernel cache file %s: compiling the kernel "
                            "again", path)
                return None
            return pickle.loads(blob[32:])

        def _save_index(self, overloads):
            with self._open_for_write(self._index_path) as f:
                f.write(self._dump((self._version, self._source_stamp, overloads)))

        def _load_index(self):
            try:
                entry = self._read(self._index_path)
            except FileNotFoundError:
                return {}
            except Exception as e:  # noqa: BLE001 - e.g. written by another numba version
                STATS["corrupt"] += 1
                log.warning("rlx_numba: unreadable kernel cache index %s (%s): starting it "
                            "again", self._index_path, e)
                return {}
            if entry is None:
                return {}
            version, stamp, overloads = entry
            return overloads if (version, stamp) == (self._version, self._source_stamp) else {}

        def _load_data(self, name):
            return self._read(self._data_path(name))   # None (a miss) when damaged

        # Each data file also names its key: two processes saving different keys of one
        # function at once can both pick the same free data-file name, leaving the index
        # pointing at the other key's kernel; such an entry is a miss, never loaded.
        def save(self, key, data):
            super().save(key, (_sha(repr(key).encode()), data))

        def load(self, key):
            entry = super().load(key)
            if entry is None:
                return None
            if not (isinstance(entry, tuple) and len(entry) == 2
                    and entry[0] == _sha(repr(key).encode())):
                STATS["corrupt"] += 1
                log.warning("rlx_numba: kernel cache entry %s holds another kernel (two "
                            "writers at once?): compiling the kernel again", self._index_path)
                return None
            return entry[1]

    class RlxCache(CUDACache):
        """numba's CUDA kernel cache with the jit options in the key, checksummed files, our
        location, and read/write failures turned into a recompile (see the module doc)."""

        _impl_class = _Impl

        def __init__(self, py_func, options: dict):
            self._options = tuple(sorted(options.items()))
            self._func_key = None
            super().__init__(py_func)
            self._cache_file = _CheckedFile(self._cache_path, self._impl.filename_base,
                                            self._impl.locator.get_source_stamp())

        def _index_key(self, sig, codegen):
            if self._func_key is None:   # once: a load and the save after a miss must agree
                self._func_key = func_key(self._py_func)
            key = (sig, codegen.magic_tuple(), numba_cuda.__version__, self._func_key,
                   self._options)
            if self._launch_config_key is not None:   # as CUDACache._index_key
                key += (("launch_config", self._launch_config_key),)
            return key

        def load_overload(self, sig, target_context):
            # not through Cache.load_overload: it first refreshes the target context, which
            # imports every lowering registry (numba.cuda.np.arraymath pulls in scipy): 0.6 s
            # of a warm process on an H100 (cProfile), for nothing a rebuilt kernel needs; a
            # compile refreshes the context itself
            try:
                with numba_target_override(), self._guard_against_spurious_io_errors():
                    kernel = self._load_overload(sig, target_context)
            except Exception as e:  # noqa: BLE001 - an entry that cannot be rebuilt is a miss
                STATS["corrupt"] += 1
                log.warning("rlx_numba: cached kernel %s unreadable (%s): compiling it again",
                            self._name, e)
                kernel = None
            STATS["hits" if kernel is not None else "misses"] += 1
            if kernel is None:
                args = ", ".join(map(str, getattr(sig, "args", sig)))
                name = f"{self._py_func.__module__}.{self._py_func.__qualname__} ({args})"
                MISSED.append(name)
                log.info("rlx_numba: kernel %s not in the disk cache: compiling it", name)
            return kernel

        def save_overload(self, sig, data):
            try:
                super().save_overload(sig, data)
            except Exception as e:  # noqa: BLE001 - the kernel is compiled; only its reuse is lost
                log.warning("rlx_numba: could not cache kernel %s: %s", self._name, e)


def attach(dispatcher, options: dict | None = None):
    """Give a numba kernel dispatcher the disk cache (nothing in the simulator); returns it.
    ``options`` are the jit options that change the compiled code (launch_bounds...)."""
    if SIMULATOR:
        return dispatcher
    try:
        dispatcher._cache = RlxCache(dispatcher.py_func, dict(options or {}))
    except Exception as e:  # noqa: BLE001 - e.g. no writable location: compile every time
        log.warning("rlx_numba: kernel %s not cached on disk: %s", dispatcher.py_func.__qualname__, e)
    return dispatcher
