"""Weight files: safetensors (one file or a sharded folder, through the ``safetensors``
library) and GGUF (read here; the ``gguf`` package dequantises the K-quants), and the one
check every loader ends with (``check_params``: names, shapes, dtypes against a model's
parameter spec).

Every error names the file and, where there is one, the tensor.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FLOAT_KINDS = "f"     # numpy kinds a weight may be stored as (bf16 comes as ml_dtypes, kind 'V')


def _need(module: str, extra: str = "models"):
    try:
        return __import__(module)
    except ImportError:
        raise ImportError(f"rlx_numba.models needs the {module!r} package to read these files: "
                          f"pip install 'rlx_numba[{extra}]'") from None


def is_float(arr) -> bool:
    """Whether an array holds floats (bf16 included: ml_dtypes)."""
    import ml_dtypes
    return arr.dtype.kind in FLOAT_KINDS or arr.dtype == ml_dtypes.bfloat16


# ---- safetensors ------------------------------------------------------------------------------
def _safetensors_diagnosis(path: Path) -> str:
    """Why a safetensors file failed to open, naming the tensor where the file says which one:
    the header is an 8-byte length and JSON (the format's documented layout)."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or 8 + n > size:
                return f"the header claims {n} bytes but the file has {size}"
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        return f"the header is unreadable ({e})"
    data = size - 8 - n
    cut = sorted((info["data_offsets"][1], name) for name, info in header.items()
                 if isinstance(info, dict) and len(info.get("data_offsets", ())) == 2
                 and info["data_offsets"][1] > data)
    if cut:                            # the first tensor the truncation reaches
        end, name = cut[0]
        more = f" ({len(cut) - 1} more after it)" if len(cut) > 1 else ""
        return (f"tensor {name!r} ends at byte {end} of the data section but the file holds "
                f"only {data}{more} (the file is truncated)")
    return ""


def load_safetensors(path, select=None) -> dict[str, np.ndarray]:
    """All tensors of one .safetensors file, or of a folder's model.safetensors (or its shards,
    model.safetensors.index.json), as numpy arrays (bf16 as ml_dtypes.bfloat16). ``select(name,
    shape)``: the index (a tuple of slices) of the part of a tensor to read, or None for all of
    it (a tensor-parallel rank reads only its slices)."""
    _need("safetensors")
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if path.is_dir():
        index = path / "model.safetensors.index.json"
        if index.exists():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{index}: not a safetensors index (weight_map missing or "
                                 f"unreadable: {e})") from None
            out = {}
            for shard in shards:
                out.update(load_safetensors(path / shard, select))
            return out
        path = path / "model.safetensors"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such safetensors file")
    out = {}
    try:
        with safe_open(str(path), framework="numpy") as f:
            for name in f.keys():
                try:
                    part = select(name, tuple(f.get_slice(name).get_shape())) if select \
                        else None
                    out[name] = f.get_tensor(name) if part is None else \
                        np.ascontiguousarray(f.get_slice(name)[part])
                except (SafetensorError, TypeError, ValueError) as e:
                    raise ValueError(f"{path}: tensor {name!r} cannot be read: {e}") from None
    except SafetensorError as e:
        why = _safetensors_diagnosis(path)
        raise ValueError(f"{path}: not a readable safetensors file: {e}"
                         + (f"; {why}" if why else "")) from None
    return out


# ---- GGUF ---------------------------------------------------------------------------------------
# GGUF's layout (ggml/docs/gguf.md): magic, version, tensor and key counts, the key-value
# metadata, the tensor infos (name, dims, type, offset), then the data at general.alignment.
# Read here rather than by gguf.GGUFReader, which makes numpy views of every item: the 49,152
# tokens and 48,900 merges of SmolLM2's vocabulary took it 3.3 s (8 s under cProfile) on this
# project's CPU, this reader 0.1 s. The gguf package is imported only to dequantise K-quants
# and to name a type newer than _GGML_TYPES (importing it took 0.16 s of a warm process's
# from_gguf on an H200 host).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}   # GGUF value type -> struct format; 8 is a string, 9 an array
_STRING, _ARRAY = 8, 9
_PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
          "I16": np.int16, "I32": np.int32, "I64": np.int64}   # others: the raw bytes
_DEFAULT_ALIGNMENT = 32        # gguf.GGUF_DEFAULT_ALIGNMENT


@dataclass(frozen=True)
class GGMLType:
    """A tensor type: ggml's id and name, weights a block, bytes a block."""
    id: int
    name: str
    block: int
    type_size: int


# ggml's types (gguf.constants' GGMLQuantizationType and GGML_QUANT_SIZES; tests/test_loaders
# checks them against the package's)
_GGML_TYPES = {i: GGMLType(i, *v) for i, v in {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18)}.items()}


def _ggml_type(raw: int) -> GGMLType | None:
    """The type of id ``raw``: ours, else the gguf package's (one newer than our table)."""
    if raw in _GGML_TYPES:
        return _GGML_TYPES[raw]
    try:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        q = GGMLQuantizationType(raw)
    except (ImportError, ValueError):
        return None
    return GGMLType(raw, q.name, *GGML_QUANT_SIZES[q])


@dataclass(frozen=True)
class GGUFTensor:
    """A tensor's header and its data (a read-only view of the mapped file): the plain types
    as their numpy dtype, numpy dims (GGUF's reversed); the others as bytes, [..., bytes a row]
    (as gguf.GGUFReader gives them)."""
    name: str
    tensor_type: GGMLType
    shape: tuple                 # GGUF's dims (innermost first)
    n_elements: int
    n_bytes: int
    data: np.ndarray


class _Strings:
    """An array of strings left in the mapped file until first asked for (a vocabulary's
    tokens and merges, which generating from token ids never needs); len() without decoding."""

    def __init__(self, buf, order: str, off: int, n: int):
        self.buf, self.order, self.off, self.n = buf, order, off, n

    def __len__(self):
        return self.n

    def decode(self) -> list[str]:
        c = _Cursor(self.buf, self.order)
        c.off = self.off
        return c.strings(self.n)


class _Cursor:
    """Reads GGUF's little-endian items from a buffer; struct.error past its end."""

    def __init__(self, buf, order: str):
        self.buf, self.off, self.order = buf, 0, order

    def scalar(self, fmt: str):
        v = struct.unpack_from(self.order + fmt, self.buf, self.off)[0]
        self.off += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.scalar("Q")
        if self.off + n > len(self.buf):
            raise struct.error(f"a string of {n} bytes at byte {self.off} runs past the end")
        v = bytes(self.buf[self.off:self.off + n]).decode("utf-8")
        self.off += n
        return v

    def strings(self, n: int) -> list[str]:
        """n strings (a vocabulary: tens of thousands), in one tight loop."""
        buf, off, out = self.buf, self.off, []
        length = struct.Struct(self.order + "Q").unpack_from
        for _ in range(n):
            k = length(buf, off)[0]
            off += 8
            if off + k > len(buf):
                raise struct.error(f"a string of {k} bytes at byte {off} runs past the end")
            out.append(str(buf[off:off + k], "utf-8"))
            off += k
        self.off = off
        return out

    def skip_strings(self, n: int) -> _Strings:
        """n strings passed over, their lengths checked, left undecoded (_Strings)."""
        buf, off = self.buf, self.off
        length = struct.Struct(self.order + "Q").unpack_from
        for _ in range(n):
            off += 8 + length(buf, off)[0]
            if off > len(buf):
                raise struct.error(f"a string ending at byte {off} runs past the end")
        lazy = _Strings(self.buf, self.order, self.off, n)
        self.off = off
        return lazy

    def value(self, vtype: int, lazy: bool = False):
        """The value of type ``vtype``; ``lazy``: an array of strings as _Strings."""
        if vtype == _STRING:
            return self.string()
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype != _ARRAY:
            raise ValueError(f"unknown metadata value type {vtype} at byte {self.off}")
        itype, n = self.scalar("I"), self.scalar("Q")
        if itype == _STRING:
            return self.skip_strings(n) if lazy else self.strings(n)
        if itype in _SCALARS:
            fmt = np.dtype(self.order + _SCALARS[itype])
            if self.off + n * fmt.itemsize > len(self.buf):
                raise struct.error(f"an array of {n} items at byte {self.off} runs past the end")
            v = np.frombuffer(self.buf, fmt, n, self.off).tolist()
            self.off += n * fmt.itemsize
            return v
        return [self.value(itype) for _ in range(n)]   # arrays of arrays


def _read_gguf(path: Path):
    """(metadata: key -> value, [GGUFTensor]) of a GGUF file, its data mapped, not read; the
    arrays of strings as _Strings."""
    mm = np.memmap(path, np.uint8, mode="r")
    size = len(mm)
    buf = memoryview(mm)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError("GGUF magic invalid")
    order = "<"
    if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF == 0:     # written big-endian
        order = ">"
    c = _Cursor(buf, order)
    c.off = 4
    version = c.scalar("I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (this reader knows 2 and 3)")
    n_tensors, n_kv = c.scalar("Q"), c.scalar("Q")
    meta = {}
    for _ in range(n_kv):
        key = c.string()
        if key in meta:
            raise ValueError(f"metadata key {key!r} appears twice")
        meta[key] = c.value(c.scalar("I"), lazy=True)
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        dims = tuple(c.scalar("Q") for _ in range(c.scalar("I")))
        infos.append((name, dims, c.scalar("I"), c.scalar("Q")))
    align = meta.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise ValueError(f"general.alignment {align!r} is not a power of two")
    start = -(-c.off // align) * align
    tensors, seen = [], set()
    for name, dims, raw_type, off in infos:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice")
        seen.add(name)
        qtype = _ggml_type(raw_type)
        if qtype is None:
            raise ValueError(f"{path}: tensor {name!r} has unknown GGML type {raw_type}")
        block, tsize = qtype.block, qtype.type_size
        n = math.prod(dims)
        n_bytes = n * tsize // block
        begin = start + off
        if begin + n_bytes > size:
            raise ValueError(f"{path}: tensor {name!r} ({qtype.name}, {list(reversed(dims))}) "
                             f"ends at byte {begin + n_bytes} but the file has {size} bytes "
                             f"(truncated)")
        np_dims = tuple(reversed(dims))
        plain = _PLAIN.get(qtype.name)
        if plain is None:            # blocks: the innermost dim in bytes
            np_dims = np_dims[:-1] + (np_dims[-1] // block * tsize,)
            plain = np.uint8
        data = mm[begin:begin + n_bytes].view(np.dtype(plain).newbyteorder(order))
        tensors.append(GGUFTensor(name, qtype, dims, n, n_bytes, data.reshape(np_dims)))
    return meta, tensors


def _gguf_reader(path: Path):
    """_read_gguf with every failure a ValueError naming the file (truncation by tensor)."""
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    try:
        return _read_gguf(path)
    except ValueError as e:
        if str(e).startswith(str(path)):
            raise
        raise ValueError(f"{path}: not a readable GGUF file: {e}") from None
    except (struct.error, IndexError, KeyError, OverflowError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a readable GGUF file (truncated or corrupt header: "
                         f"{type(e).__name__}: {e})") from None


class GGUFFile:
    """A GGUF file's metadata (``metadata``: key -> value) and tensors, dequantised to f32 on
    request (``tensor(name)``; numpy shapes are GGUF's dims reversed, so a weight reads
    [out, in] like PyTorch's). An array of strings is decoded when a key first asks for it."""

    def __init__(self, path):
        self.path = Path(path)
        self._meta, tensors = _gguf_reader(self.path)
        self._tensors = {t.name: t for t in tensors}

    @property
    def metadata(self) -> dict:
        """Every key's value (decoding every array of strings)."""
        for key in self._meta:
            self.get(key)
        return self._meta

    @property
    def names(self) -> list[str]:
        return list(self._tensors)

    def get(self, key, default=None):
        v = self._meta.get(key, default)
        if isinstance(v, _Strings):
            try:
                v = self._meta[key] = v.decode()
            except (struct.error, UnicodeDecodeError) as e:
                raise ValueError(f"{self.path}: GGUF metadata {key!r} is unreadable "
                                 f"({type(e).__name__}: {e})") from None
        return v

    def require(self, key, decode: bool = True):
        """The value of ``key``, ValueError when it is missing; ``decode=False``: only the
        check (an array of strings stays undecoded)."""
        if key not in self._meta:
            raise ValueError(f"{self.path}: GGUF metadata {key!r} is missing")
        return self.get(key) if decode else None

    def length(self, key) -> int | None:
        """The item count of an array value (None when the key is missing), decoding nothing."""
        v = self._meta.get(key)
        return None if v is None else len(v)

    def shape(self, name: str) -> tuple:
        return tuple(int(d) for d in reversed(self._tensors[name].shape))

    def type_name(self, name: str) -> str:
        return self._tensors[name].tensor_type.name

    def tensor(self, name: str) -> np.ndarray:
        """The tensor as float32: F32, F16, BF16 and the 32-weight blocks (dequantize_blocks)
        here, the K-quants and others by gguf.quants.dequantize."""
        t = self._tensors.get(name)
        if t is None:
            raise ValueError(f"{self.path}: GGUF tensor {name!r} is missing")
        kind = t.tensor_type.name
        if kind in ("I8", "I16", "I32", "I64", "F64"):
            raise ValueError(f"{self.path}: GGUF tensor {name!r} has type {kind}; "
                             f"a weight must be F32, F16, BF16 or a quantised type")
        shape, data = self.shape(name), np.asarray(t.data)
        if kind in ("F32", "F16"):
            return np.ascontiguousarray(data, dtype=np.float32).reshape(shape)
        if kind == "BF16":           # the high half of an f32's bits
            return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
        if kind.lower() in LEGACY_BLOCKS:
            return dequantize_blocks(data, kind.lower()).reshape(shape)
        gguf = _need("gguf")
        from gguf.quants import dequantize
        try:
            arr = dequantize(data, gguf.GGMLQuantizationType(t.tensor_type.id))
        except NotImplementedError as e:
            raise ValueError(f"{self.path}: GGUF tensor {name!r}: {e}") from None
        return np.ascontiguousarray(arr, dtype=np.float32).reshape(shape)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored (u8 [rows, bytes a row]): a quantised tensor's blocks
        for Graph.dequant_matmul."""
        t = self._tensors.get(name)
        if t is None:
            raise ValueError(f"{self.path}: GGUF tensor {name!r} is missing")
        data = np.asarray(t.data)
        rows = self.shape(name)[0] if len(self.shape(name)) > 1 else 1
        return np.ascontiguousarray(data.view(np.uint8).reshape(rows, -1))


# llama.cpp's 32-weight blocks (ggml-common.h): (bytes a block, bytes before the 16 nibble
# bytes: the f16 scale d, the f16 min m (q*_1), the 32 fifth bits qh (q5_*)); q8_0 is d and 32
# int8s
LEGACY_BLOCKS = {"q4_0": (18, 2), "q4_1": (20, 4), "q5_0": (22, 6), "q5_1": (24, 8),
                 "q8_0": (34, 2)}


def dequantize_blocks(raw: np.ndarray, scheme: str) -> np.ndarray:
    """The f32 values (1-D, in block order) of GGUF blocks of a 32-weight scheme (q4_0, q4_1,
    q5_0, q5_1, q8_0): the gguf package's dequantize, value for value (q * d, or q * d + m,
    in f32), in a few whole-array passes instead of its per-block-group Python loop (a
    SmolLM2-135M GGUF's tensors: 4.8 s -> 0.6 s on one core)."""
    size, head = LEGACY_BLOCKS[scheme]
    b = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, size)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)           # [blocks, 1]
    out = np.empty((b.shape[0], 32), np.float32)
    if scheme == "q8_0":
        np.multiply(b[:, 2:].view(np.int8), d, out=out)
        return out.reshape(-1)
    q = np.empty((b.shape[0], 32), np.uint8)       # weight j: byte j's low nibble, j + 16 high
    np.bitwise_and(b[:, head:], 15, out=q[:, :16])
    np.right_shift(b[:, head:], 4, out=q[:, 16:])
    if scheme in ("q5_0", "q5_1"):                 # weight j's fifth bit: bit j of qh (LE u32)
        q |= np.unpackbits(b[:, head - 4:head], axis=1, bitorder="little") << 4
    if scheme in ("q4_0", "q5_0"):                 # signed: q - 8 / q - 16
        np.multiply(np.subtract(q.view(np.int8), 8 if scheme == "q4_0" else 16), d, out=out)
    else:
        np.multiply(q, d, out=out)
        out += b[:, 2:4].copy().view(np.float16).astype(np.float32)
    return out.reshape(-1)


def weight_formats(path) -> dict[str, dict]:
    """Bytes of a weight file by format, from its header (no tensor read): {format: {"tensors",
    "bytes" (as stored), "f32_bytes" (the same tensors held f32)}}. A GGUF file (types as
    gguf names them: Q4_0, Q4_K, F16 ...), a .safetensors file or a folder of them (F32,
    BF16 ...)."""
    path = as_path(path)
    out: dict[str, dict] = {}

    def add(fmt_, nbytes, elements):
        row = out.setdefault(fmt_, {"tensors": 0, "bytes": 0, "f32_bytes": 0})
        row["tensors"] += 1
        row["bytes"] += int(nbytes)
        row["f32_bytes"] += 4 * int(elements)

    if path.suffix == ".gguf":
        for t in _gguf_reader(path)[1]:
            add(t.tensor_type.name, t.n_bytes, t.n_elements)
        return out
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"weight_formats: {path} is not a .gguf or .safetensors file, nor a "
                         f"folder holding .safetensors files")
    _need("safetensors")
    from safetensors import safe_open
    size = {"F64": 8, "F32": 4, "I64": 8, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "U8": 1,
            "I8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
    for f in files:
        with safe_open(str(f), framework="numpy") as st:
            for name in st.keys():
                sl = st.get_slice(name)
                dtype, n = sl.get_dtype(), int(np.prod(sl.get_shape(), dtype=np.int64))
                add(dtype, n * size.get(dtype, 4), n)
    return out


def quantize(w: np.ndarray, scheme: str) -> np.ndarray:
    """GGUF blocks (u8 [N, K / block * bytes]) of an f32 weight [N, K], one row of blocks a
    row as Graph.dequant_matmul reads them: q4_0, q4_1, q5_0, q5_1, q8_0 by the gguf package
    (llama.cpp's reference quantisers), q4_k here (a min/max fit per 32-weight sub-block, its
    scale and min quantised to 6 bits against the super-block's f16 d and dmin: simpler than
    llama.cpp's search, the same format)."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize: w must be 2-D [N, K], got shape {list(w.shape)}")
    qk = 256 if scheme.endswith("_k") else 32
    if w.shape[1] % qk:
        raise ValueError(f"quantize: K = {w.shape[1]} is not a multiple of {scheme}'s block of "
                         f"{qk}")
    if scheme == "q4_k":
        return _quantize_q4_k(w)
    if scheme not in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0"):
        raise ValueError(f"quantize: scheme {scheme!r} is not one of q4_0, q4_1, q5_0, q5_1, "
                         f"q8_0, q4_k")
    gguf = _need("gguf")
    from gguf import quants
    return quants.quantize(w, getattr(gguf.GGMLQuantizationType, scheme.upper()))


def _quantize_q4_k(w: np.ndarray) -> np.ndarray:
    n, k = w.shape
    x = w.reshape(n, k // 256, 8, 32).astype(np.float64)
    lo = np.minimum(x.min(-1), 0.0)
    step = (x.max(-1) - lo) / 15
    d = (step.max(-1) / 63).astype(np.float16)
    dmin = ((-lo).max(-1) / 63).astype(np.float16)
    df, mf = d.astype(np.float64)[..., None], dmin.astype(np.float64)[..., None]
    sc = np.clip(np.rint(np.divide(step, df, out=np.zeros_like(step), where=df > 0)), 0, 63)
    mn = np.clip(np.rint(np.divide(-lo, mf, out=np.zeros_like(lo), where=mf > 0)), 0, 63)
    scale, low = df * sc, mf * mn
    q = np.clip(np.rint(np.divide(x + low[..., None], scale[..., None],
                                  out=np.zeros_like(x), where=scale[..., None] > 0)), 0, 15)
    sc, mn, q = sc.astype(np.uint8), mn.astype(np.uint8), q.astype(np.uint8)
    out = np.zeros((n, k // 256, 144), np.uint8)
    out[..., 0:2] = d[..., None].view(np.uint8)
    out[..., 2:4] = dmin[..., None].view(np.uint8)
    out[..., 4:8] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)          # ggml's get_scale_min_k4
    out[..., 8:12] = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
    out[..., 12:16] = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    pairs = q.reshape(n, k // 256, 4, 2, 32)                         # unit 2p low, 2p + 1 high
    out[..., 16:] = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(n, k // 256, 128)
    return out.reshape(n, -1)


def reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's permutation of a Q or K projection (rows [n_head * head_dim, ...]):
    its converter reorders each head's rows from the half-split rope layout (HF's rotate_half)
    to interleaved pairs, w.reshape(n_head, 2, hd/2, ...).swapaxes(1, 2); this is the inverse,
    as in transformers' GGUF loader. n_head is the query heads for Q, the kv heads for K."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"reverse_permute: {rows} rows do not split into {n_head} heads of "
                         f"pairs")
    half = rows // n_head // 2
    return np.ascontiguousarray(
        w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def check_gguf_vocab(f: GGUFFile) -> None:
    """ValueError unless the GGUF holds a vocabulary gguf_tokenizer builds (a cheap check: the
    build itself can wait until the tokenizer is used)."""
    kind = f.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{f.path}: tokenizer.ggml.model is {kind!r}; only the byte-level BPE "
                         f"'gpt2' vocabularies are supported (SmolLM2, Llama 3, Qwen ...)")
    f.require("tokenizer.ggml.tokens", decode=False)     # decoded by the build
    f.require("tokenizer.ggml.merges", decode=False)


def gguf_tokenizer(f: GGUFFile):
    """A ``tokenizers.Tokenizer`` built from a GGUF's own vocabulary (tokenizer.ggml.*): the
    byte-level BPE ('gpt2') family, with llama.cpp's pre-tokenizer split for the 'pre' names
    that isolate digits (smollm, starcoder, ...). Control tokens are special (never split)."""
    _need("tokenizers")
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    check_gguf_vocab(f)
    tokens = f.require("tokenizer.ggml.tokens")
    merges = f.require("tokenizer.ggml.merges")
    types = f.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = []
    for m in merges:
        a, _, b = m.partition(" ")
        pairs.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pre = f.get("tokenizer.ggml.pre", "default")
    if pre in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"):
        # llama.cpp splits every digit off before the GPT-2 regex for these
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    control = [t for t, k in zip(tokens, types) if k == 3]          # 3: CONTROL
    if control:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    return tok


# ---- the check every loader ends with -----------------------------------------------------------
def check_params(spec: dict, arrays: dict, source, *, ignore=()) -> dict[str, np.ndarray]:
    """``arrays`` checked against ``spec`` (name -> shape): every name present, shapes equal,
    float dtypes; returns f32 C-contiguous copies. Names in ``arrays`` that the spec lacks raise
    unless they match a prefix in ``ignore``. ``source`` (a path) goes into the messages."""
    missing = [k for k in spec if k not in arrays]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"{source}: missing tensor(s) {', '.join(map(repr, missing[:5]))}{more}")
    extra = [k for k in arrays if k not in spec and not any(k.startswith(p) for p in ignore)]
    if extra:
        raise ValueError(f"{source}: unexpected tensor(s) {', '.join(map(repr, extra[:5]))} "
                         f"(not part of this model)")
    out = {}
    for name, shape in spec.items():
        a = arrays[name]
        if tuple(a.shape) != tuple(shape):
            raise ValueError(f"{source}: tensor {name!r} has shape {list(a.shape)}, expected "
                             f"{list(shape)}")
        if not is_float(a):
            raise ValueError(f"{source}: tensor {name!r} has dtype {a.dtype}; expected a float "
                             f"type (f32, f16, bf16)")
        out[name] = np.ascontiguousarray(a, dtype=np.float32)
    return out


def read_json(path, what: str) -> dict:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: {what} not found")
    try:
        d = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: {what} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: {what} must hold a JSON object")
    return d


def as_path(p) -> Path:
    return Path(os.fspath(p)).expanduser()
