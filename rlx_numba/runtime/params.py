"""ParamStore: the device copies of params, shared by the executables that compile against it.

A model compiles many graphs (forward, prefill, decode, one per shape); each reads the same
weights. Every executable binds its params from a store (its own, private one unless
``compile(..., params=store)`` hands it a shared one), so the weights sit on the device once
and a ``set_param`` through any executable is seen by all of them. The arena plans only
activations.

An entry is keyed by (name, shape, dtype): a KV cache param of another batch size is another
entry. Its storage layout (row-major, or [N, K] for a 2-D weight read only by products, see
lower_matmul.transposed_weights) is per executable, so an entry keeps one device copy per
layout asked for, all rewritten by every set. A weight stored half by ``set_param_half`` has
a half copy per layout here too, and every executable reading it re-plans its products,
which then read the half copy (matmul tiers 0 and 3). Its f32 copy in a layout that only
products read as their weight (the [N, K] one always; a row-major one when no executable
reads it otherwise: nn.Linear weights through ``linear``) is then dropped. A product that
must still read f32 (no cuBLAS, a tier restriction) gets it back (``f32_copy``), kept while
the weight stays half; an executable binding it as something else's input (a tied embedding
table's gather) likewise; set_param brings every f32 copy back. An entry lives while an
executable uses it.

The copies are carved from slabs (``_Pool``), not allocated one by one: the driver maps an
allocation past ~1 MiB in whole 2 MiB pages, so a 1.3 MB weight took 2 MiB and a 2.2 MB one
4 MiB (measured on an H100) -- ~130 MiB of pages past the ~515 MiB of SmolLM2's weights.
"""
from __future__ import annotations

import weakref

import numpy as np

from ..device import byte_view
from ..ir.ops import fmt
from ..memory import ALIGN


def _cuda():
    from numba import cuda
    return cuda


SLAB = 16 << 20      # the most bytes a slab (a bigger copy gets a slab of its own size)
PAGE = 2 << 20       # the driver's mapping unit for big allocations


def _up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


class _Pool:
    """Device bytes carved from slabs: first fit over each slab's free ranges (coalesced when
    freed); a slab goes back to the driver when nothing in it is in use."""

    def __init__(self):
        self._slabs = []       # [device array, free ranges [(offset, bytes)] sorted, bytes used]
        self._where = {}       # id(view) -> (slab, offset, bytes)

    def alloc(self, nbytes: int, dtype=np.uint8):
        """A device array of ``nbytes`` (of ``dtype``; uint8: rounded up to ALIGN bytes)."""
        want, nbytes = nbytes, _up(max(nbytes, 1), ALIGN)
        slab = next((s for s in self._slabs if any(n >= nbytes for _, n in s[1])), None)
        if slab is None:
            # slabs grow with the pool (2, 2, 4, 8, 16, 16 ... MiB): a small graph's params
            # take one page, a model's waste at most the last slab's tail
            size = max(_up(nbytes, PAGE), min(SLAB, max(PAGE, self.nbytes)))
            slab = [_cuda().device_array(size, dtype=np.uint8), [(0, size)], 0]
            self._slabs.append(slab)
        free = slab[1]
        i = next(i for i, (_, n) in enumerate(free) if n >= nbytes)
        off, n = free[i]
        free[i:i + 1] = [(off + nbytes, n - nbytes)] if n > nbytes else []
        slab[2] += nbytes
        view = byte_view(slab[0], off, off + nbytes, np.uint8)
        if np.dtype(dtype) != np.uint8:
            view = byte_view(view, 0, want, dtype)
        self._where[id(view)] = (slab, off, nbytes)
        return view

    def free(self, view) -> None:
        slab, off, nbytes = self._where.pop(id(view))
        slab[2] -= nbytes
        if not slab[2]:
            self._slabs = [s for s in self._slabs if s is not slab]   # (== on arrays is element-wise)
            return
        free = slab[1]
        free.append((off, nbytes))
        free.sort()
        merged = [free[0]]
        for o, n in free[1:]:
            if merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((o, n))
        slab[1] = merged

    @property
    def nbytes(self) -> int:
        """Device bytes the slabs hold (in use or not)."""
        return sum(s[0].size for s in self._slabs)


class _Entry:
    __slots__ = ("name", "shape", "dtype", "copies", "half", "is_set", "users", "count",
                 "written", "f32_readers", "external")

    def __init__(self, name, shape, dtype):
        self.name, self.shape, self.dtype = name, tuple(shape), dtype
        # transposed (bool) -> flat uint8 device array; None: the f32 copy of a half weight,
        # dropped (only products read it, and they read the half copy)
        self.copies = {}
        self.half = None      # (half DType, {transposed: device array}) after set_param_half
        self.is_set = False
        self.users = weakref.WeakSet()   # executables bound to it (to re-plan their products)
        self.count = 0                   # how many of them are alive
        self.written = False             # some executable writes it in place (kv_write)
        # executables reading the row-major layout other than as a product's weight (a
        # gather, an element-wise op): that layout keeps its f32 copy when the weight is half
        self.f32_readers = weakref.WeakSet()
        self.external = False            # its row-major copy is memory the store's owner owns

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


class ParamStore:
    """Device copies of params shared by executables (see the module docstring).

    ``store.nbytes`` is what its copies take on the device; ``len(store)`` counts entries."""

    def __init__(self, name: str = "params", external: dict | None = None):
        """``external``: name -> (shape, dtype, flat uint8 device array) of params whose
        row-major value lives in memory the caller owns (compile_train's flat buffers): a
        param of that name, shape and dtype is bound to it, never to a pooled copy, and only
        row-major (a graph that would store it [N, K] gets a ValueError)."""
        self.name = name
        self._entries: dict[tuple, _Entry] = {}
        self._pool = _Pool()
        self._external = dict(external or {})

    def external(self, node):
        """The caller-owned flat array ``node`` is bound to (``external``), or None."""
        shape, dtype, mem = self._external.get(node.name, (None, None, None))
        return mem if (tuple(node.shape), node.dtype) == (shape, dtype) else None

    # ---- binding (compile time) -------------------------------------------------------------
    def bind(self, exe, node, transposed: bool, written: bool = False, weight_only=None):
        """(entry, the flat uint8 device array holding ``node``'s value in the layout
        ``transposed`` for ``exe`` -- None for a half weight that only products read there,
        from the half copy --, the device bytes this added to the store). ``weight_only``:
        ``exe`` reads the param only as a product's weight (always so in the [N, K] layout).
        ``written``: ``exe`` writes the param in place (kv_write). Such a param keeps one
        layout: the other would not see the writes."""
        weight_only = transposed if weight_only is None else weight_only
        key = (node.name, tuple(node.shape), node.dtype)
        mem = self.external(node)
        if mem is not None:
            return self._bind_external(exe, node, key, mem, transposed, written)
        e = self._entries.get(key)
        if e is None:
            e = self._new_entry(key, node)
        if (written or e.written) and len(set(e.copies) | {transposed}) > 1:
            what = "this graph writes it" if written else "another graph of the store writes it"
            here = "[N, K] (read only by products)" if transposed else "row-major"
            raise ValueError(f"compile: param {node.name!r} {fmt(node.shape)}: {what} in place, "
                             f"and this graph stores it {here}, another the other way (a second "
                             f"copy would not see the writes); give the graphs separate "
                             f"ParamStores or separate params")
        e.written = e.written or written
        if not weight_only:
            e.f32_readers.add(exe)
        added = 0
        if transposed in e.copies and e.copies[transposed] is None and not weight_only:
            self._hold_f32(e, fill=True, layouts=(transposed,))    # a reader of the f32 value
            added += e.nbytes
        if transposed not in e.copies:
            if e.half is not None and self._droppable(e, transposed):
                e.copies[transposed] = None    # products only: they read the half copy
            else:
                e.copies[transposed] = self._pool.alloc(e.nbytes)
                added += e.nbytes
                if e.is_set and e.size:        # derive the new layout from a held one
                    self._derive(e, transposed, exe.stream)
            if e.half is not None and e.size:
                hdt, halves = e.half
                halves[transposed] = self._half_copy(self._half_host(e, transposed), hdt)
                added += e.size * hdt.itemsize
        self._use(exe, key, e)
        return e, e.copies[transposed], added

    def _bind_external(self, exe, node, key, mem, transposed, written):
        if transposed:
            raise ValueError(f"compile: param {node.name!r} {fmt(node.shape)} lives row-major in "
                             f"memory its store's owner holds (a trainer's buffer), and this "
                             f"graph would store it [N, K]; compile it with its own ParamStore "
                             f"and copy the values with get_param")
        e = self._entries.get(key)
        created = e is None
        if created:
            e = self._new_entry(key, node)
            e.copies[False], e.external = mem, True
        e.written = e.written or written
        self._use(exe, key, e)
        return e, mem, e.nbytes if created else 0

    def _new_entry(self, key, node) -> _Entry:
        e = self._entries[key] = _Entry(node.name, node.shape, node.dtype)
        return e

    def _use(self, exe, key, e) -> None:
        """``exe`` reads entry ``e``: counted until it is collected."""
        e.users.add(exe)
        e.count += 1
        # (not at interpreter exit: the CUDA context may be gone by then)
        weakref.finalize(exe, self._release, key).atexit = False

    def _release(self, key):
        e = self._entries.get(key)
        if e is not None:
            e.count -= 1
            if not e.count:
                del self._entries[key]
                for buf in e.copies.values():
                    if buf is not None and not e.external:   # (the owner's, not the pool's)
                        self._pool.free(buf)
                self._free_halves(e)

    # ---- values ---------------------------------------------------------------------------------
    def entry(self, node) -> _Entry:
        return self._entries[(node.name, tuple(node.shape), node.dtype)]

    def set_host(self, node, host: np.ndarray) -> None:
        """Write a host value (already of the param's dtype and shape) to every layout, in
        f32 again after set_param_half."""
        e = self.entry(node)
        self._hold_f32(e, fill=False)
        self._write(e, host)
        self._set(e, None)

    def set_half(self, node, host: np.ndarray, hdt) -> None:
        """Store a float host value half (``hdt``) for products, and its half-rounded f32 in
        the row-major layout for everything else (see the module docstring)."""
        e = self.entry(node)
        rounded = host.astype(hdt.host)
        halves = {t: self._half_copy(np.ascontiguousarray(rounded.T if t else rounded), hdt)
                  if e.size else None for t in e.copies}
        drop = [t for t, buf in e.copies.items() if buf is not None and self._droppable(e, t)]
        for t in drop:                       # only products read it, and they read the half
            self._pool.free(e.copies[t])
            e.copies[t] = None
        if drop:
            self._rebind(e)
        self._write(e, rounded.astype(np.float32))
        self._set(e, (hdt, halves))

    @staticmethod
    def _droppable(e: _Entry, transposed: bool) -> bool:
        """Only products read the layout as f32: its copy may go while the weight is half."""
        return transposed or not e.f32_readers

    def hold_f32(self, node) -> None:
        """Every layout's f32 copy held again, with the value (a set_param from a device
        array after set_param_half writes one layout and derives the others)."""
        self._hold_f32(self.entry(node), fill=True)

    def f32_copy(self, node, transposed: bool):
        """The f32 copy in the layout ``transposed``, made again from the half copy where
        set_param_half dropped it (a product on a tier that reads f32); kept while the
        weight stays half."""
        e = self.entry(node)
        self._hold_f32(e, fill=True, layouts=(transposed,))
        return e.copies[transposed]

    def get_host(self, node, transposed: bool) -> np.ndarray:
        """The value as set (a half weight as its rounded f32), from the f32 copy in the
        layout ``transposed``, else from another held copy."""
        e = self.entry(node)
        if not e.size:
            return np.empty(e.shape, e.dtype.host)
        for t in (transposed, not transposed):
            buf = e.copies.get(t)
            if buf is not None:
                host = buf[:e.nbytes].copy_to_host().view(e.dtype.host)
                return _logical(host, e.shape, t)
        return self._half_host(e).astype(np.float32)

    def refresh_layouts(self, node, written: bool, stream) -> None:
        """After a device-side write into the layout ``written``: rewrite the other one."""
        e = self.entry(node)
        other = e.copies.get(not written)
        if other is not None and e.size:
            _transpose_into(other, e.copies[written], e, not written, stream)

    def mark_set(self, node) -> None:
        """A device-side write (set_param from a device array) filled the executable's layout;
        the caller has refreshed the other layouts."""
        self._set(self.entry(node), None)

    def _set(self, e: _Entry, half) -> None:
        had_half = e.half is not None
        if had_half and e.half is not half:
            self._free_halves(e)
        e.half, e.is_set = half, True
        if had_half or half is not None:     # products that read it plan their tier again
            for exe in list(e.users):
                exe.relower_products_named(e.name)

    def _write(self, e: _Entry, host: np.ndarray, layouts=(False, True)) -> None:
        """host (of the entry's dtype, logical shape) into the held copies of ``layouts``."""
        if not e.size:
            return
        for t in layouts:
            buf = e.copies.get(t)
            if buf is not None:
                byte_view(buf, 0, e.nbytes, e.dtype.storage).copy_to_device(
                    np.ascontiguousarray(host.T if t else host).view(e.dtype.storage).reshape(-1))

    def _hold_f32(self, e: _Entry, fill: bool, layouts=(False, True)) -> None:
        """Allocate the dropped f32 copies of ``layouts`` again (with the half copy's values
        when ``fill``), and point the executables at them."""
        missing = [t for t in layouts if t in e.copies and e.copies[t] is None]
        if not missing:
            return
        for t in missing:
            e.copies[t] = self._pool.alloc(e.nbytes)
        if fill:
            self._write(e, self._half_host(e).astype(np.float32), missing)
        self._rebind(e)

    def _rebind(self, e: _Entry) -> None:
        """An f32 copy was dropped or made again: its executables take the new views."""
        for exe in list(e.users):
            exe.rebind_param(e.name)

    def _derive(self, e: _Entry, t: bool, stream) -> None:
        """Fill the new f32 layout ``t`` from the other one, or from the half copy where that
        one was dropped."""
        other = e.copies.get(not t)
        if other is not None:
            _transpose_into(e.copies[t], other, e, t, stream)
        else:
            self._write(e, self._half_host(e).astype(np.float32), (t,))

    def _half_copy(self, host: np.ndarray, hdt):
        """A device copy of a C-contiguous host array of ``hdt`` from the pool, flat, of its
        storage dtype."""
        host = host.view(hdt.storage).reshape(-1)
        out = self._pool.alloc(host.nbytes, host.dtype)
        out.copy_to_device(host)
        return out

    def _half_host(self, e: _Entry, transposed: bool = False) -> np.ndarray:
        """A half entry's value on the host, of its half dtype, in the layout ``transposed``
        (C-contiguous), read from any of its half copies."""
        hdt, halves = e.half
        t, buf = next(iter(halves.items()))
        host = _logical(buf.copy_to_host().view(hdt.host), e.shape, t)
        return np.ascontiguousarray(host.T if transposed else host)

    def _free_halves(self, e: _Entry) -> None:
        if e.half is not None:
            for buf in e.half[1].values():
                if buf is not None:
                    self._pool.free(buf)

    # ---- reporting ------------------------------------------------------------------------------
    @staticmethod
    def entry_bytes(e: _Entry) -> dict:
        """Device bytes of the copies an entry holds, by format (dtype name; a half copy of a
        weight under its half dtype); formats it holds none of are left out."""
        held = sum(buf is not None for buf in e.copies.values())
        out = {e.dtype.name: held * e.nbytes}
        if e.half is not None:
            out[e.half[0].name] = out.get(e.half[0].name, 0) + len(e.half[1]) * e.size * e.half[0].itemsize
        return {k: v for k, v in out.items() if v}

    def bytes_by_format(self) -> dict:
        """Device bytes of every entry's copies, by format (``entry_bytes``)."""
        total: dict = {}
        for e in self._entries.values():
            for k, v in self.entry_bytes(e).items():
                total[k] = total.get(k, 0) + v
        return total

    @property
    def nbytes(self) -> int:
        return sum(self.bytes_by_format().values())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self):
        return f"ParamStore({self.name!r}, {len(self)} params, {self.nbytes / 2**20:.1f} MiB)"


def _logical(flat: np.ndarray, shape, transposed: bool) -> np.ndarray:
    """A flat host copy of a layout as the param's logical shape."""
    if transposed:
        return np.ascontiguousarray(flat.reshape(shape[::-1]).T)
    return flat.reshape(shape)


def _transpose_into(dst, src, e: _Entry, to_transposed: bool, stream) -> None:
    """dst <- src in the other layout of a 2-D entry (device to device)."""
    from .lower_shape import transpose_matrix
    rows, cols = e.shape if to_transposed else e.shape[::-1]
    st = e.dtype.storage
    transpose_matrix(dst[:e.nbytes].view(st), src[:e.nbytes].view(st), rows, cols, stream)
    stream.synchronize()


def check_store(params, what: str = "compile"):
    if params is not None and not isinstance(params, ParamStore):
        raise ValueError(f"{what}: params must be a rlx_numba.ParamStore (shared device "
                         f"params), got {type(params).__name__}")
    return params

