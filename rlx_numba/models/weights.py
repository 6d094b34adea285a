"""Weight files: safetensors (one file or a sharded folder) and GGUF, read through their own
libraries (``safetensors``, ``gguf``), and the one check every loader ends with
(``check_params``: names, shapes, dtypes against a model's parameter spec).

Every error names the file and, where there is one, the tensor.
"""
from __future__ import annotations

import json
import os
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
def _gguf_reader(path: Path):
    """gguf.GGUFReader over ``path``, with truncation reported by tensor name (the reader itself
    fails with a bare reshape error when a tensor's data runs past the end of the file)."""
    gguf = _need("gguf")
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    class Reader(gguf.GGUFReader):
        def _build_tensors(self, start_offs, fields):
            size = len(self.data)
            for field in fields:
                _, name, _, dims, raw_type, off = field.parts
                tname = bytes(name).decode("utf-8", "replace")
                try:
                    qtype = GGMLQuantizationType(int(raw_type[0]))
                except ValueError:
                    raise ValueError(f"{path}: tensor {tname!r} has unknown GGML type "
                                     f"{int(raw_type[0])}") from None
                block, tsize = GGML_QUANT_SIZES[qtype]
                n = int(np.prod(dims.astype(np.int64)))
                end = int(start_offs + off[0]) + n * tsize // block
                if end > size:
                    raise ValueError(f"{path}: tensor {tname!r} ({qtype.name}, "
                                     f"{list(map(int, reversed(dims.tolist())))}) ends at byte "
                                     f"{end} but the file has {size} bytes (truncated)")
            return super()._build_tensors(start_offs, fields)

    if not path.exists():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    try:
        return Reader(str(path))
    except ValueError as e:
        if str(e).startswith(str(path)):
            raise
        raise ValueError(f"{path}: not a readable GGUF file: {e}") from None
    except (IndexError, KeyError, OverflowError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a readable GGUF file (truncated or corrupt header: "
                         f"{type(e).__name__}: {e})") from None


class GGUFFile:
    """A GGUF file's metadata (``metadata``: key -> value) and tensors, dequantised to f32 on
    request (``tensor(name)``; numpy shapes are GGUF's dims reversed, so a weight reads
    [out, in] like PyTorch's)."""

    def __init__(self, path):
        self.path = Path(path)
        self._reader = _gguf_reader(self.path)
        self.metadata = {}
        for key, field in self._reader.fields.items():
            if key.startswith("GGUF."):
                continue
            self.metadata[key] = field.contents()
        self._tensors = {t.name: t for t in self._reader.tensors}

    @property
    def names(self) -> list[str]:
        return list(self._tensors)

    def get(self, key, default=None):
        return self.metadata.get(key, default)

    def require(self, key):
        if key not in self.metadata:
            raise ValueError(f"{self.path}: GGUF metadata {key!r} is missing")
        return self.metadata[key]

    def shape(self, name: str) -> tuple:
        return tuple(int(d) for d in reversed(self._tensors[name].shape.tolist()))

    def type_name(self, name: str) -> str:
        return self._tensors[name].tensor_type.name

    def tensor(self, name: str) -> np.ndarray:
        """The tensor as float32, dequantised (Q4_0, Q4_1, Q8_0, K-quants, ... via
        gguf.quants.dequantize)."""
        from gguf.constants import GGMLQuantizationType as Q
        from gguf.quants import dequantize

        t = self._tensors.get(name)
        if t is None:
            raise ValueError(f"{self.path}: GGUF tensor {name!r} is missing")
        if t.tensor_type in (Q.I8, Q.I16, Q.I32, Q.I64, Q.F64):
            raise ValueError(f"{self.path}: GGUF tensor {name!r} has type {t.tensor_type.name}; "
                             f"a weight must be F32, F16, BF16 or a quantised type")
        shape = self.shape(name)
        try:
            arr = dequantize(np.asarray(t.data), t.tensor_type)
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
        for t in _gguf_reader(path).tensors:
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


def gguf_tokenizer(f: GGUFFile):
    """A ``tokenizers.Tokenizer`` built from a GGUF's own vocabulary (tokenizer.ggml.*): the
    byte-level BPE ('gpt2') family, with llama.cpp's pre-tokenizer split for the 'pre' names
    that isolate digits (smollm, starcoder, ...). Control tokens are special (never split)."""
    _need("tokenizers")
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    kind = f.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{f.path}: tokenizer.ggml.model is {kind!r}; only the byte-level BPE "
                         f"'gpt2' vocabularies are supported (SmolLM2, Llama 3, Qwen ...)")
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
