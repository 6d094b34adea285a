"""BERT encoder (post-norm, absolute positions, token types, attention padding mask) built on
the public Graph API; BertModel runs it, SentenceEncoder adds a sentence-transformers folder's
tokenizer, pooling and normalisation.

Parameters keep Hugging Face's names (without a ``bert.`` prefix) and layouts; linear weights
[out, in] are read through a transpose the products take as an operand flag.
"""
from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass, fields

import numpy as np

from .. import Graph, compile
from .blocks import Weights, embedding, encoder_attention, mlp, norm
from .executables import ExecutableCache, bucket_length, in_dtype, model_dtype, next_pow2
from .weights import as_path, check_params, load_safetensors, read_json

# Hugging Face's hidden_act names -> Graph activation kinds
_ACTS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
         "gelu_fast": "gelu_tanh", "relu": "relu", "silu": "silu", "swish": "silu",
         "tanh": "tanh"}
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len")     # sentence-transformers' order
LOSSES = ("cross_entropy", "mse")


@dataclass
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0

    def __post_init__(self):
        for f in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "intermediate_size", "max_position_embeddings", "type_vocab_size"):
            v = getattr(self, f)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"BertConfig: {f} must be a positive int, got {v!r}")
            setattr(self, f, int(v))
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"BertConfig: hidden_size {self.hidden_size} is not a multiple of "
                             f"num_attention_heads {self.num_attention_heads}")
        if self.hidden_act not in _ACTS:
            raise ValueError(f"BertConfig: hidden_act {self.hidden_act!r} is not supported; "
                             f"expected one of {', '.join(_ACTS)}")

    @classmethod
    def from_dict(cls, d: dict, source="config") -> "BertConfig":
        """From a Hugging Face config.json dict."""
        mt = d.get("model_type", "bert")
        if mt != "bert":
            raise ValueError(f"{source}: model_type is {mt!r}; BertConfig reads 'bert' configs")
        pet = d.get("position_embedding_type", "absolute")
        if pet != "absolute":
            raise ValueError(f"{source}: position_embedding_type {pet!r} is not supported "
                             f"(only 'absolute')")
        names = {f.name for f in fields(cls)}
        try:
            return cls(**{k: d[k] for k in names if k in d and d[k] is not None})
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from None

    def to_dict(self) -> dict:
        return asdict(self)


def bert_param_shapes(cfg: BertConfig) -> dict[str, tuple]:
    """Every parameter, by its Hugging Face BertModel name, with its shape."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    out = {"embeddings.word_embeddings.weight": (cfg.vocab_size, h),
           "embeddings.position_embeddings.weight": (cfg.max_position_embeddings, h),
           "embeddings.token_type_embeddings.weight": (cfg.type_vocab_size, h),
           "embeddings.LayerNorm.weight": (h,), "embeddings.LayerNorm.bias": (h,)}
    for n in range(cfg.num_hidden_layers):
        p = f"encoder.layer.{n}."
        for m in ("query", "key", "value"):
            out[p + f"attention.self.{m}.weight"] = (h, h)
            out[p + f"attention.self.{m}.bias"] = (h,)
        out[p + "attention.output.dense.weight"] = (h, h)
        out[p + "attention.output.dense.bias"] = (h,)
        out[p + "attention.output.LayerNorm.weight"] = (h,)
        out[p + "attention.output.LayerNorm.bias"] = (h,)
        out[p + "intermediate.dense.weight"] = (i, h)
        out[p + "intermediate.dense.bias"] = (i,)
        out[p + "output.dense.weight"] = (h, i)
        out[p + "output.dense.bias"] = (h,)
        out[p + "output.LayerNorm.weight"] = (h,)
        out[p + "output.LayerNorm.bias"] = (h,)
    return out


def _check_pooling(pooling):
    modes = (pooling,) if isinstance(pooling, str) else tuple(pooling or ())
    for m in modes:
        if m not in POOLING_MODES:
            raise ValueError(f"build_bert: pooling mode {m!r} is not supported; expected some "
                             f"of {', '.join(POOLING_MODES)}")
    return tuple(m for m in POOLING_MODES if m in modes)


def head_shapes(cfg: BertConfig, num_labels: int, pooling=("cls",)) -> dict[str, tuple]:
    """The params of a train graph's head (``build_bert`` kind "train"): ``classifier.weight``
    [num_labels, hidden * pooling modes] and ``classifier.bias`` [num_labels] (Hugging Face's
    names and [out, in] layout)."""
    width = cfg.hidden_size * len(_check_pooling(pooling))
    return {"classifier.weight": (num_labels, width), "classifier.bias": (num_labels,)}


def _check_head(num_labels, loss):
    """(num_labels, loss) of a train graph: loss defaults as Hugging Face's problem_type does,
    "mse" (regression) for one label, "cross_entropy" (single-label classes) for more."""
    if not isinstance(num_labels, (int, np.integer)) or isinstance(num_labels, bool) \
            or num_labels < 1:
        raise ValueError(f"build_bert: num_labels must be a positive int, got {num_labels!r}")
    loss = loss or ("mse" if num_labels == 1 else "cross_entropy")
    if loss not in LOSSES:
        raise ValueError(f"build_bert: loss {loss!r} is not supported; expected one of "
                         f"{', '.join(LOSSES)}")
    if loss == "cross_entropy" and num_labels < 2:
        raise ValueError("build_bert: loss 'cross_entropy' needs num_labels >= 2 (classes), got 1")
    return int(num_labels), loss


def build_bert(cfg: BertConfig, batch: int, seq: int, *, pooling=None,
               normalize: bool = False, kind: str = "forward", num_labels: int | None = None,
               loss: str | None = None) -> Graph:
    """A BERT encoder graph over ``input_ids``, ``token_type_ids`` (i32 [batch, seq]) and
    ``attention_mask`` (bool [batch, seq], True for real tokens; padded keys are masked out of
    every query's attention). Output: the last hidden state [batch, seq, hidden]; or, with
    ``pooling`` (some of "cls", "max", "mean", "mean_sqrt_len", concatenated in
    sentence-transformers' order), the pooled [batch, hidden * modes] over the real tokens,
    L2-normalised when ``normalize``.

    kind "train": the pooled embedding (``pooling`` defaults to "cls") through a linear head
    (params ``head_shapes``: ``classifier.weight`` [num_labels, width], ``classifier.bias``)
    to ``logits`` [batch, num_labels], scored against the input ``labels``. ``loss``
    "cross_entropy" (the default for num_labels >= 2): labels i64 [batch], class indices,
    -100 for a row with no loss, the mean over the other rows; "mse" (the default for one
    label, regression): labels f32 [batch, num_labels], the mean squared error over every
    element (torch's MSELoss). Outputs: the scalar loss (what ``rlx.compile_train``
    differentiates), then the logits. Hugging Face's BertForSequenceClassification puts a
    tanh pooler before its classifier; this head is the pooling and one linear layer (a
    pooler is a kind="forward" graph's output plus layers of your own)."""
    for arg, v in (("batch", batch), ("seq", seq)):
        if not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"build_bert: {arg} must be a positive int, got {v!r}")
    if seq > cfg.max_position_embeddings:
        raise ValueError(f"build_bert: seq {seq} exceeds max_position_embeddings "
                         f"{cfg.max_position_embeddings}")
    if kind not in ("forward", "train"):
        raise ValueError(f"build_bert: kind must be 'forward' or 'train', got {kind!r}")
    if kind == "train":
        num_labels, loss = _check_head(num_labels, loss)
        pooling = pooling or ("cls",)
    elif num_labels is not None or loss is not None:
        raise ValueError("build_bert: num_labels and loss belong to kind 'train' graphs")
    modes = _check_pooling(pooling)
    b, s, h, eps = batch, seq, cfg.hidden_size, cfg.layer_norm_eps
    g = Graph(f"bert_{b}x{s}")
    w = Weights.declare(g, bert_param_shapes(cfg))
    ids = g.input("input_ids", (b, s), "i32")
    types = g.input("token_type_ids", (b, s), "i32")
    mask = g.input("attention_mask", (b, s), "bool")
    words = embedding(w, "embeddings.word_embeddings", ids)
    where = g.narrow(w["embeddings.position_embeddings.weight"], 0, 0, s)   # positions 0..s-1
    x = norm(w, "embeddings.LayerNorm", words + where, eps=eps, kind="layer",
             residual=embedding(w, "embeddings.token_type_embeddings", types))
    keep = g.reshape(mask, (b, 1, 1, s))                   # every query sees the real keys
    for n in range(cfg.num_hidden_layers):
        x = bert_layer(w, cfg, f"encoder.layer.{n}.", x, keep)
    if not modes:
        g.set_outputs([x])
        return g
    m3 = g.reshape(mask, (b, s, 1))
    mf = g.cast(m3, "f32")
    pooled = []
    for mode in modes:
        if mode == "cls":
            pooled.append(g.reshape(g.narrow(x, 1, 0, 1), (b, h)))
        elif mode == "max":          # padding as -1e9, like sentence-transformers
            pooled.append(g.reduce_max(g.where(m3, x, -1e9), 1))
        else:
            total = g.sum(x * mf, 1)                                   # [b, h]
            count = g.sum(mf, 1)                                       # [b, 1]
            if mode == "mean":
                pooled.append(total / g.max(count, 1e-9))
            else:
                pooled.append(total / g.sqrt(g.max(count, 1e-9)))
    y = pooled[0] if len(pooled) == 1 else g.concat(pooled, -1)
    if normalize:                    # torch.nn.functional.normalize: x / max(||x||, 1e-12)
        y = y / g.max(g.sqrt(g.sum(y * y, -1, keep_dim=True)), 1e-12)
    if kind == "forward":
        g.set_outputs([y])
        return g
    H = {k: g.param(k, shape) for k, shape in head_shapes(cfg, num_labels, modes).items()}
    logits = g.linear(y, g.transpose(H["classifier.weight"], (1, 0)), H["classifier.bias"])
    if loss == "cross_entropy":
        labels = g.input("labels", (b,), "i64")
        value = g.cross_entropy(logits, labels, ignore_index=-100)
    else:
        labels = g.input("labels", (b, num_labels), "f32")
        diff = logits - labels
        value = g.mean(g.reshape(diff * diff, (b * num_labels,)), 0)
    g.set_outputs([value, logits])
    return g


def bert_layer(w: Weights, cfg: BertConfig, p: str, x, keep):
    """Encoder layer ``p`` (post-norm): x + attention -> LayerNorm, then x + MLP ->
    LayerNorm (each add in its norm's kernel); ``keep`` masks the padded keys."""
    eps = cfg.layer_norm_eps
    qkv = [p + f"attention.self.{m}" for m in ("query", "key", "value")]
    a = encoder_attention(w, x, (*qkv, p + "attention.output.dense"),
                          num_heads=cfg.num_attention_heads, mask=keep)
    x = norm(w, p + "attention.output.LayerNorm", a, eps=eps, kind="layer", residual=x)
    f = mlp(w, x, p + "intermediate.dense", p + "output.dense", activation=_ACTS[cfg.hidden_act])
    return norm(w, p + "output.LayerNorm", f, eps=eps, kind="layer", residual=x)


class BertModel:
    """A BERT encoder over rlx_numba executables (compiled per input shape and pooling, the
    ``max_cached`` most recent kept; all of them read one device copy of the weights, a
    ParamStore).
    ``params`` in Hugging Face BertModel names (a ``bert.`` prefix is dropped; pooler and
    pre-training heads are ignored)."""

    IGNORED = ("pooler.", "cls.", "embeddings.position_ids", "embeddings.token_type_ids")

    def __init__(self, config: BertConfig, params: dict, *, weights: str = "f32",
                 max_cached: int = 8, source="params", dtype="f32"):
        if not isinstance(config, BertConfig):
            raise ValueError(f"BertModel: config must be a BertConfig, got "
                             f"{type(config).__name__}")
        if weights not in ("f32", "f16", "bf16"):
            raise ValueError(f"BertModel: weights must be 'f32', 'f16' or 'bf16', got {weights!r}")
        self.dtype = model_dtype("BertModel", dtype)
        if self.dtype != "f32" and weights != "f32":
            raise ValueError(f"BertModel: dtype={self.dtype!r} stores every weight in "
                             f"{self.dtype} already; weights={weights!r} is for f32 models")
        self.config = config
        params = {k[5:] if k.startswith("bert.") else k: v for k, v in params.items()}
        self.params = check_params(bert_param_shapes(config), params, source, ignore=self.IGNORED)
        self.weights = weights
        self.max_cached = max_cached
        self._exes = ExecutableCache("bert")

    @classmethod
    def from_config(cls, config, seed: int = 0, std: float = 0.02, **kw) -> "BertModel":
        """Random weights from ``seed``: matrices N(0, std), biases N(0, std), LayerNorm gains
        1 + N(0, 0.1)."""
        if isinstance(config, dict):
            config = BertConfig.from_dict(config)
        rng = np.random.default_rng(seed)
        params = {}
        for name, shape in bert_param_shapes(config).items():
            scale = 0.1 if "LayerNorm" in name else std
            arr = scale * rng.standard_normal(shape)
            params[name] = (arr + 1 if name.endswith("LayerNorm.weight") else arr).astype(np.float32)
        return cls(config, params, source=f"from_config(seed={seed})", **kw)

    @classmethod
    def from_safetensors(cls, folder, **kw) -> "BertModel":
        """A Hugging Face folder: config.json and model.safetensors."""
        folder = as_path(folder)
        config = BertConfig.from_dict(read_json(folder / "config.json", "config.json"),
                                      source=folder / "config.json")
        return cls(config, load_safetensors(folder), source=folder / "model.safetensors", **kw)

    def trainer(self, batch: int, seq: int, optimizer, *, num_labels: int = 2, loss=None,
                pooling=("cls",), normalize: bool = False, head=None, seed: int = 0,
                clip_grad_norm=None, exec_mode="graph", deterministic=False,
                precision="f32") -> "BertTrainer":
        """Fine-tuning of this encoder with a linear head on [batch, seq] batches (the
        ``build_bert`` kind "train" graph through ``rlx.compile_train``): forward, backward
        and ``optimizer``'s update of the encoder's and the head's weights as one executable.
        See BertTrainer. ``precision``: "f32", or "bf16" / "f16" mixed precision
        (``rlx.compile_train``'s)."""
        return BertTrainer(self, batch, seq, optimizer, num_labels=num_labels, loss=loss,
                           pooling=pooling, normalize=normalize, head=head, seed=seed,
                           clip_grad_norm=clip_grad_norm, exec_mode=exec_mode,
                           deterministic=deterministic, precision=precision)

    def executable(self, batch: int, seq: int, pooling=None, normalize: bool = False):
        key = (batch, seq, _check_pooling(pooling), bool(normalize))
        return self._exes.fetch(key, self.max_cached,
                                lambda: self._compile(batch, seq, pooling, normalize))

    def _compile(self, batch, seq, pooling, normalize):
        g = build_bert(self.config, batch, seq, pooling=pooling, normalize=normalize)
        exe = compile(in_dtype(g, self.dtype), params=self._exes.params, stream=self._exes.stream)
        half = self.weights != "f32"
        for name in exe.unset_params:      # the first executable of the store uploads them
            arr = self.params[name]
            if half and arr.ndim == 2 and not name.startswith("embeddings."):   # the linears
                exe.set_param_half(name, arr, self.weights)
            else:
                exe.set_param(name, arr)
        return exe

    def run(self, input_ids, attention_mask=None, token_type_ids=None, *, pooling=None,
            normalize: bool = False) -> np.ndarray:
        """The last hidden state [batch, seq, hidden] of token ids [batch, seq] (or the
        pooled [batch, hidden * modes] with ``pooling``); the mask defaults to all tokens, the
        token types to 0."""
        ids = np.asarray(input_ids)
        if ids.ndim != 2 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"BertModel: input_ids must be a non-empty integer [batch, seq] "
                             f"array, got {ids.dtype} {list(ids.shape)}")
        mask = np.ones(ids.shape, bool) if attention_mask is None else np.asarray(attention_mask)
        types = np.zeros(ids.shape, np.int32) if token_type_ids is None else np.asarray(token_type_ids)
        for arg, a in (("attention_mask", mask), ("token_type_ids", types)):
            if a.shape != ids.shape:
                raise ValueError(f"BertModel: {arg} has shape {list(a.shape)}, expected input_ids' "
                                 f"{list(ids.shape)}")
        for arg, a, hi in (("input_ids", ids, self.config.vocab_size),
                           ("token_type_ids", types, self.config.type_vocab_size)):
            if a.size and (a.min() < 0 or a.max() >= hi):
                raise ValueError(f"BertModel: {arg} holds {int(a.min())}..{int(a.max())}, outside "
                                 f"[0, {hi})")
        exe = self.executable(*ids.shape, pooling=pooling, normalize=normalize)
        (y,) = exe.run({"input_ids": ids.astype(np.int32), "token_type_ids": types.astype(np.int32),
                        "attention_mask": mask.astype(bool)})
        return y

    __call__ = run


class BertTrainer:
    """Trains a BertModel's weights (f32) with a linear head on a pooled embedding.

    ``step(input_ids, labels, attention_mask=None, token_type_ids=None) -> loss`` runs one
    forward + backward + update on the device and returns the loss before the update
    (cross-entropy over class indices, -100 for no loss; or the mean squared error against
    f32 targets, [batch] for one label, [batch, num_labels] for more; see ``build_bert``
    kind "train"). The head (``classifier.weight`` [num_labels, width], ``classifier.bias``)
    starts from ``head`` (a dict of those arrays) or, without it, as Hugging Face initialises
    a classifier: weight N(0, 0.02) from ``seed``, bias 0. ``head_params()`` returns its
    trained values; ``update_model()`` copies the trained encoder weights back into the
    model's ``params`` and drops its compiled graphs, so ``run``/``encode`` then use them.
    ``trainer`` is the underlying rlx.Trainer (set_lr, memory_report, profile, ...)."""

    def __init__(self, model: BertModel, batch: int, seq: int, optimizer, *, num_labels: int = 2,
                 loss=None, pooling=("cls",), normalize: bool = False, head=None, seed: int = 0,
                 clip_grad_norm=None, exec_mode="graph", deterministic=False,
                 precision="f32"):
        from ..train import compile_train
        if not isinstance(model, BertModel):
            raise ValueError(f"BertTrainer: model must be a BertModel, got {type(model).__name__}")
        self.model, self.batch, self.seq = model, int(batch), int(seq)
        self.num_labels, self.loss = _check_head(num_labels, loss)
        self.pooling = _check_pooling(pooling)
        g = build_bert(model.config, batch, seq, pooling=self.pooling, normalize=normalize,
                       kind="train", num_labels=self.num_labels, loss=self.loss)
        shapes = head_shapes(model.config, self.num_labels, self.pooling)
        if head is None:
            rng = np.random.default_rng(seed)
            w_shape = shapes["classifier.weight"]
            head = {"classifier.weight": 0.02 * rng.standard_normal(w_shape),
                    "classifier.bias": np.zeros(shapes["classifier.bias"])}
        head = check_params(shapes, dict(head), "BertTrainer head")
        self.trainer = compile_train(g, g.tensor(g.outputs[0]), optimizer, exec_mode=exec_mode,
                                     clip_grad_norm=clip_grad_norm, deterministic=deterministic,
                                     precision=precision)
        for name, arr in {**model.params, **head}.items():
            self.trainer.set_param(name, arr)

    def step(self, input_ids, labels, attention_mask=None, token_type_ids=None) -> float:
        ids = np.asarray(input_ids)
        want = (self.batch, self.seq)
        mask = np.ones(want, bool) if attention_mask is None else np.asarray(attention_mask)
        types = np.zeros(want, np.int32) if token_type_ids is None else np.asarray(token_type_ids)
        for arg, a in (("input_ids", ids), ("token_type_ids", types)):
            if a.shape != want or not np.issubdtype(a.dtype, np.integer):
                raise ValueError(f"BertTrainer.step: {arg} must be an integer {list(want)} array "
                                 f"(the trainer's batch and seq), got {a.dtype} {list(a.shape)}")
        if mask.shape != want:
            raise ValueError(f"BertTrainer.step: attention_mask has shape {list(mask.shape)}, "
                             f"expected {list(want)}")
        cfg = self.model.config
        for arg, a, hi in (("input_ids", ids, cfg.vocab_size),
                           ("token_type_ids", types, cfg.type_vocab_size)):
            if a.min() < 0 or a.max() >= hi:
                raise ValueError(f"BertTrainer.step: {arg} hold {int(a.min())}..{int(a.max())}, "
                                 f"outside [0, {hi})")
        lab = np.asarray(labels)
        if self.loss == "cross_entropy":
            if lab.shape != (self.batch,) or not np.issubdtype(lab.dtype, np.integer):
                raise ValueError(f"BertTrainer.step: labels must be integer class indices "
                                 f"[{self.batch}], got {lab.dtype} {list(lab.shape)}")
            bad = (lab != -100) & ((lab < 0) | (lab >= self.num_labels))
            if bad.any():
                raise ValueError(f"BertTrainer.step: labels hold {int(lab[bad][0])}, outside "
                                 f"[0, {self.num_labels}) (and not -100)")
            lab = lab.astype(np.int64)
        else:
            shape = (self.batch, self.num_labels)
            if lab.shape == (self.batch,) and self.num_labels == 1:
                lab = lab.reshape(shape)
            if lab.shape != shape or not np.issubdtype(lab.dtype, np.number):
                raise ValueError(f"BertTrainer.step: labels must be numeric targets "
                                 f"{list(shape)}, got {lab.dtype} {list(lab.shape)}")
            lab = lab.astype(np.float32)
        return self.trainer.step({"input_ids": ids.astype(np.int32),
                                  "token_type_ids": types.astype(np.int32),
                                  "attention_mask": mask.astype(bool), "labels": lab})

    def set_lr(self, lr: float) -> None:
        self.trainer.set_lr(lr)

    def head_params(self) -> dict:
        """The head's trained ``classifier.weight`` and ``classifier.bias``."""
        return {k: self.trainer.get_param(k) for k in ("classifier.weight", "classifier.bias")}

    def update_model(self) -> None:
        names = bert_param_shapes(self.model.config)
        self.model.params.update({k: self.trainer.get_param(k) for k in self.trainer.params
                                  if k in names})
        # a fresh store: graphs still held elsewhere keep the old weights' store
        self.model._exes = ExecutableCache("bert")


class SentenceEncoder:
    """Sentence embeddings from a sentence-transformers folder (a BERT Transformer module,
    Pooling, optional Normalize): ``encode(texts) -> np.ndarray [n, dim]``.

    Texts are tokenised by the folder's tokenizer.json (``tokenizers``), truncated to
    max_seq_length and sorted by length, longest first; each batch takes the next
    ``batch_size`` rows of that order and is padded to the bucket of its longest
    (``seq_bucket``: 16, 24, 32, 48, 64, 96, ..., two lengths an octave, capped at
    max_seq_length), so a batch's longest row gets under half its length in padding (up to
    nearly all of it with power-of-two lengths) and a few graphs serve every corpus.
    ``max_tokens`` (default: none) caps the padded tokens of a run, fewer rows for long
    sentences, which bounds the activation memory of a big batch_size. The last batch's rows
    are padded to a power of two. The model keeps enough compiled graphs for every bucket (and a few last
    batches), so once warm a call compiles nothing."""

    def __init__(self, model: BertModel, tokenizer, *, pooling=("mean",), normalize: bool = False,
                 max_seq_length: int | None = None, max_tokens: int | None = None):
        if max_tokens is not None and (not isinstance(max_tokens, int)
                                       or isinstance(max_tokens, bool) or max_tokens < 1):
            raise ValueError(f"SentenceEncoder: max_tokens must be a positive int or None, got "
                             f"{max_tokens!r}")
        self.model = model
        self.max_tokens = max_tokens
        self.tokenizer = tokenizer
        self.pooling = _check_pooling(pooling)
        if not self.pooling:
            raise ValueError("SentenceEncoder: at least one pooling mode is needed")
        self.normalize = bool(normalize)
        limit = model.config.max_position_embeddings
        self.max_seq_length = min(max_seq_length or limit, limit)
        # one graph a bucket (its full batch), plus the last batches' power-of-two row counts
        buckets = {self.seq_bucket(n) for n in range(1, self.max_seq_length + 1)}
        model.max_cached = max(model.max_cached, len(buckets) + 4)
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_length=self.max_seq_length)

    @classmethod
    def from_pretrained(cls, path, **kw) -> "SentenceEncoder":
        """Read a sentence-transformers folder: modules.json (Transformer, Pooling, Normalize),
        config.json + model.safetensors + tokenizer.json of the Transformer module,
        1_Pooling/config.json, sentence_bert_config.json (max_seq_length)."""
        from tokenizers import Tokenizer

        root = as_path(path)
        if not root.is_dir():
            raise FileNotFoundError(f"{root}: not a folder")
        if (root / "modules.json").exists():
            mods = json.loads((root / "modules.json").read_text())
        else:                            # a bare Hugging Face folder: mean pooling, like ST
            mods = [{"type": "Transformer", "path": ""}, {"type": "Pooling", "path": None}]
        tdir, pooling, normalize = None, ("mean",), False
        for m in mods:
            kind = str(m.get("type", "")).rsplit(".", 1)[-1]
            sub = root / (m.get("path") or "")
            if kind == "Transformer":
                tdir = sub
            elif kind == "Pooling":
                if m.get("path") is not None and (sub / "config.json").exists():
                    pooling = _pooling_modes(read_json(sub / "config.json", "pooling config"),
                                             sub / "config.json")
            elif kind == "Normalize":
                normalize = True
            else:
                raise ValueError(f"{root / 'modules.json'}: module {m.get('type')!r} is not "
                                 f"supported (Transformer, Pooling and Normalize are)")
        if tdir is None:
            raise ValueError(f"{root / 'modules.json'}: no Transformer module")
        model = BertModel.from_safetensors(tdir, weights=kw.pop("weights", "f32"),
                                           dtype=kw.pop("dtype", "f32"))
        tok_file = tdir / "tokenizer.json"
        if not tok_file.exists():
            raise FileNotFoundError(f"{tok_file}: tokenizer.json not found")
        max_len = None
        sbc = tdir / "sentence_bert_config.json"
        if sbc.exists():
            max_len = read_json(sbc, "sentence_bert_config.json").get("max_seq_length")
        return cls(model, Tokenizer.from_file(str(tok_file)), pooling=pooling,
                   normalize=normalize, max_seq_length=max_len, **kw)

    @property
    def dim(self) -> int:
        return self.model.config.hidden_size * len(self.pooling)

    def seq_bucket(self, n: int) -> int:
        """The padded length of a batch whose longest sentence has ``n`` tokens."""
        return min(bucket_length(n, lo=16, steps=2), self.max_seq_length)

    def encode(self, texts, batch_size: int = 32) -> np.ndarray:
        """Embeddings [n, dim] (f32) of a list of strings ([dim] for one string), in the
        order given."""
        single = isinstance(texts, str)
        items = [texts] if single else list(texts)
        if not all(isinstance(t, str) for t in items):
            raise ValueError("SentenceEncoder.encode: texts must be strings")
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"SentenceEncoder.encode: batch_size must be a positive int, got "
                             f"{batch_size!r}")
        out = np.zeros((len(items), self.dim), np.float32)
        if not items:
            return out
        enc = self.tokenizer.encode_batch(items)
        lens = np.array([len(e.ids) for e in enc])
        # every sentence's tokens in one flat array: a batch is then gathered with one
        # fancy index, not a Python loop over its rows (4096 rows took ~40 ms of host time)
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
        flat_ids = np.fromiter(itertools.chain.from_iterable(e.ids for e in enc), np.int32,
                               int(lens.sum()))
        flat_types = np.fromiter(itertools.chain.from_iterable(e.type_ids for e in enc),
                                 np.int32, int(lens.sum()))
        order = np.argsort(-lens, kind="stable")       # longest first, ties in input order
        pad = self.model.config.pad_token_id
        start = 0
        while start < len(order):
            s = self.seq_bucket(lens[order[start]])
            full = batch_size if self.max_tokens is None else min(batch_size,
                                                                  max(1, self.max_tokens // s))
            rows = order[start:start + full]
            start += len(rows)
            b = full if len(rows) == full else min(next_pow2(len(rows)), full)
            ids = np.full((b, s), pad, np.int32)
            types = np.zeros((b, s), np.int32)
            mask = np.zeros((b, s), bool)              # padded rows: every key masked -> zeros
            mask[:len(rows)] = np.arange(s) < lens[rows][:, None]   # no padding: all tokens
            at = (starts[rows][:, None] + np.arange(s))[mask[:len(rows)]]
            ids[:len(rows)][mask[:len(rows)]] = flat_ids[at]
            types[:len(rows)][mask[:len(rows)]] = flat_types[at]
            y = self.model.run(ids, mask, types, pooling=self.pooling, normalize=self.normalize)
            out[rows] = y[:len(rows)]
        return out[0] if single else out


def _pooling_modes(d: dict, source) -> tuple:
    if isinstance(d.get("pooling_mode"), str):
        modes = [d["pooling_mode"]]
    else:
        keys = {"cls": "pooling_mode_cls_token", "max": "pooling_mode_max_tokens",
                "mean": "pooling_mode_mean_tokens", "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens",
                "weightedmean": "pooling_mode_weightedmean_tokens",
                "lasttoken": "pooling_mode_lasttoken"}      # (sentence-transformers' names)
        modes = [m for m, key in keys.items() if d.get(key)]
    bad = [m for m in modes if m not in POOLING_MODES]
    if bad or not modes:
        raise ValueError(f"{source}: pooling {bad or 'none'} is not supported (cls, max, mean, "
                         f"mean_sqrt_len are)")
    return tuple(modes)
