"""Mamba (state-spaces/mamba, transformers' MambaForCausalLM) on the public graph API:
embedding, then per layer x + mixer(rms_norm(x)), final rms_norm, the tied LM head. The mixer:
in_proj to (x, z); a causal depthwise conv1d over x (left-padded by conv_kernel - 1) and
silu; x_proj to (dt, B, C); dt_proj; the selective scan (Graph.selective_scan: softplus on
dt, the D skip, the silu(z) gate); out_proj. Tensor names are transformers' (backbone.*).

Generation keeps the recurrent state as the cache: the prefill graph runs the prompt and
outputs each layer's conv state (the last conv_kernel - 1 inputs of the conv) and ssm state
(the scan's last state); a decode graph takes one token and those states and returns the
logits and the next states (the conv as a dot over the window, the scan as one step).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..compiler import compile
from ..ir.graph import Graph
from .blocks import Weights, causal_conv1d, embedding, norm
from .executables import ExecutableCache, in_dtype, model_dtype
from .weights import check_params, load_safetensors


@dataclass
class MambaConfig:
    vocab_size: int = 50280
    hidden_size: int = 768
    state_size: int = 16
    num_hidden_layers: int = 24
    conv_kernel: int = 4
    expand: int = 2
    time_step_rank: int | str = "auto"
    layer_norm_epsilon: float = 1e-5
    use_bias: bool = False
    use_conv_bias: bool = True
    tie_word_embeddings: bool = True

    def __post_init__(self):
        if self.time_step_rank == "auto":
            self.time_step_rank = math.ceil(self.hidden_size / 16)
        for k in ("vocab_size", "hidden_size", "state_size", "num_hidden_layers", "conv_kernel",
                  "expand", "time_step_rank"):
            v = getattr(self, k)
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"MambaConfig: {k} must be a positive int, got {v!r}")

    @property
    def intermediate_size(self) -> int:
        return self.expand * self.hidden_size

    @classmethod
    def from_hf(cls, cfg: dict) -> "MambaConfig":
        """From a transformers config.json dict (model_type "mamba")."""
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in cfg.items() if k in names})


def mamba_param_shapes(cfg: MambaConfig) -> dict[str, tuple]:
    d, di, n, r, k = (cfg.hidden_size, cfg.intermediate_size, cfg.state_size,
                      cfg.time_step_rank, cfg.conv_kernel)
    shapes = {"backbone.embeddings.weight": (cfg.vocab_size, d)}
    for i in range(cfg.num_hidden_layers):
        p = f"backbone.layers.{i}."
        shapes.update({
            p + "norm.weight": (d,),
            p + "mixer.in_proj.weight": (2 * di, d),
            p + "mixer.conv1d.weight": (di, 1, k),
            p + "mixer.x_proj.weight": (r + 2 * n, di),
            p + "mixer.dt_proj.weight": (di, r),
            p + "mixer.dt_proj.bias": (di,),
            p + "mixer.A_log": (di, n),
            p + "mixer.D": (di,),
            p + "mixer.out_proj.weight": (d, di),
        })
        if cfg.use_conv_bias:
            shapes[p + "mixer.conv1d.bias"] = (di,)
        if cfg.use_bias:
            shapes[p + "mixer.in_proj.bias"] = (2 * di,)
            shapes[p + "mixer.out_proj.bias"] = (d,)
    shapes["backbone.norm_f.weight"] = (d,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    return shapes


def build_mamba(cfg: MambaConfig, batch: int, seq: int, kind: str = "forward") -> Graph:
    """A Mamba graph over ``input_ids`` (i32 [batch, seq]). kind "forward": outputs the logits
    [batch, seq, vocab]. "prefill": the greedy next ids (i64 [batch], the argmax on the
    device) and the last position's logits [batch, vocab], then per layer i its conv state
    ``conv.i`` [batch, di, conv_kernel - 1] and ssm state ``ssm.i`` [batch, di, state_size].
    "decode" (seq 1): takes those states as inputs of the same names and outputs the next
    ids, the logits [batch, vocab] and the next states."""
    if kind not in ("forward", "prefill", "decode"):
        raise ValueError(f"build_mamba: kind must be 'forward', 'prefill' or 'decode', got "
                         f"{kind!r}")
    if kind == "decode" and seq != 1:
        raise ValueError(f"build_mamba: a decode graph takes one token a row (seq 1), got {seq}")
    b, s = int(batch), int(seq)
    g = Graph(f"mamba_{kind}_{b}x{s}")
    w = Weights.declare(g, mamba_param_shapes(cfg))
    ids = g.input("input_ids", (b, s), "i32")
    h = embedding(w, "backbone.embeddings", ids)                      # [b, s, d]
    states = []
    for i in range(cfg.num_hidden_layers):
        x = norm(w, f"backbone.layers.{i}.norm", h, eps=cfg.layer_norm_epsilon)
        out, state = mamba_mixer(w, cfg, f"backbone.layers.{i}.mixer.", x,
                                 state=(f"conv.{i}", f"ssm.{i}") if kind == "decode" else None)
        states += state
        h = g.add(h, out)
    h = norm(w, "backbone.norm_f", h, eps=cfg.layer_norm_epsilon)
    head = w["lm_head.weight" if "lm_head.weight" in w else "backbone.embeddings.weight"]
    if kind != "forward":
        h = g.reshape(g.narrow(h, 1, s - 1, 1), (b, cfg.hidden_size))
    logits = g.matmul(h, g.transpose(head, (1, 0)))
    g.set_outputs([logits] if kind == "forward" else [g.argmax(logits, 1), logits] + states)
    return g


def mamba_mixer(w: Weights, cfg: MambaConfig, p: str, x, *, state: tuple | None = None):
    """The Mamba mixer ``p`` over x [b, s, d] (module docstring) -> (its output [b, s, d],
    [conv state, ssm state] after the last token). ``state``: a decode step's (seq 1) input
    names of the conv state [b, di, conv_kernel - 1] and ssm state [b, di, state_size] it
    goes on from; the conv is then a dot over the window and the scan one step."""
    g = w.g
    (b, s, _), di, n = x.shape, cfg.intermediate_size, cfg.state_size
    r, k = cfg.time_step_rank, cfg.conv_kernel
    xz = w.linear(x, p + "in_proj")                                     # [b, s, 2 di]
    A = g.neg(g.exp(w[p + "A_log"]))
    if state is not None:
        xz = g.reshape(xz, (b, 2 * di))
        x, z = g.narrow(xz, 1, 0, di), g.narrow(xz, 1, di, di)
        xc, conv_state = causal_conv1d(g, g.reshape(x, (b, di, 1)), w[p + "conv1d.weight"],
                                       w.get(p + "conv1d.bias"),
                                       state=g.input(state[0], (b, di, k - 1)))
        xc = g.silu(g.reshape(xc, (b, di)))                             # [b, di]
        dbl = g.reshape(w.linear(g.reshape(xc, (b, 1, di)), p + "x_proj"), (b, r + 2 * n))
        dt = w.linear(g.narrow(dbl, 1, 0, r), p + "dt_proj")           # [b, di]
        y, ssm = g.selective_state_update(
            g.input(state[1], (b, di, n)), xc, dt, A, g.narrow(dbl, 1, r, n),
            g.narrow(dbl, 1, r + n, n), D=w[p + "D"], z=z, dt_softplus=True)
        out = w.linear(g.reshape(y, (b, 1, di)), p + "out_proj")
        return out, [conv_state, ssm]
    xzt = g.transpose(xz, (0, 2, 1))                                    # [b, 2 di, s]
    x, z = g.narrow(xzt, 1, 0, di), g.narrow(xzt, 1, di, di)
    xc, conv_state = causal_conv1d(g, x, w[p + "conv1d.weight"], w.get(p + "conv1d.bias"))
    xc = g.silu(xc)                                                     # [b, di, s]
    dbl = w.linear(g.transpose(xc, (0, 2, 1)), p + "x_proj")            # [b, s, r + 2n]
    dt = w.linear(g.narrow(dbl, 2, 0, r), p + "dt_proj")                # [b, s, di]
    Bm = g.transpose(g.narrow(dbl, 2, r, n), (0, 2, 1))                 # [b, n, s]
    Cm = g.transpose(g.narrow(dbl, 2, r + n, n), (0, 2, 1))
    y, last = g.selective_scan(xc, g.transpose(dt, (0, 2, 1)), A, Bm, Cm, D=w[p + "D"],
                               z=z, delta_softplus=True, return_last_state=True)
    out = w.linear(g.transpose(y, (0, 2, 1)), p + "out_proj")          # [b, s, d]
    return out, [conv_state, last]


class MambaForCausalLM:
    """transformers' MambaForCausalLM, inference: ``logits(ids)`` and greedy ``generate``."""

    def __init__(self, config: MambaConfig, params: dict, *, max_cached: int = 4,
                 source="params", dtype="f32"):
        if not isinstance(config, MambaConfig):
            raise ValueError(f"MambaForCausalLM: config must be a MambaConfig, got "
                             f"{type(config).__name__}")
        self.dtype = model_dtype("MambaForCausalLM", dtype)
        self.config = config
        self.params = check_params(mamba_param_shapes(config), params, source)
        self.max_cached = max_cached
        self._exes = ExecutableCache("mamba")

    @classmethod
    def from_config(cls, config: MambaConfig, seed: int = 0, **kw):
        """Random weights from ``seed``, at the scales of transformers' initialisation (A_log
        = log(1..N), D = 1, dt_proj's bias the inverse softplus of dt in [1e-3, 0.1])."""
        rng = np.random.default_rng(seed)
        params = {}
        for name, shape in mamba_param_shapes(config).items():
            if name.endswith("A_log"):
                v = np.log(np.broadcast_to(np.arange(1, shape[1] + 1, dtype=np.float64), shape))
            elif name.endswith(".D") or name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                v = np.ones(shape)
            elif name.endswith("dt_proj.bias"):
                dt = np.exp(rng.uniform(np.log(1e-3), np.log(0.1), shape))
                v = dt + np.log(-np.expm1(-dt))
            else:
                fan_in = shape[-1] if len(shape) > 1 else 1
                v = rng.standard_normal(shape) * (0.02 if "embeddings" in name else
                                                  1 / math.sqrt(fan_in * (shape[-2] if
                                                                name.endswith("conv1d.weight")
                                                                else 1)))
            params[name] = np.ascontiguousarray(v, np.float32)
        return cls(config, params, source=f"from_config(seed={seed})", **kw)

    @classmethod
    def from_safetensors(cls, path, config: MambaConfig | dict | None = None, **kw):
        """A transformers checkpoint: ``path`` a .safetensors file (config.json beside it unless
        ``config`` is given) or a folder holding model.safetensors and config.json."""
        path = Path(path)
        folder = path if path.is_dir() else path.parent
        if config is None:
            config = json.loads((folder / "config.json").read_text())
        if isinstance(config, dict):
            config = MambaConfig.from_hf(config)
        weights = load_safetensors(folder / "model.safetensors" if path.is_dir() else path)
        if config.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return cls(config, weights, source=str(path), **kw)

    def executable(self, batch: int, seq: int, kind: str):
        def make():
            exe = compile(in_dtype(build_mamba(self.config, batch, seq, kind), self.dtype),
                          params=self._exes.params,
                          stream=self._exes.stream)
            for name in exe.unset_params:
                exe.set_param(name, self.params[name])
            return exe
        return self._exes.fetch((batch, seq, kind), self.max_cached, make)

    def _ids(self, input_ids, op):
        ids = np.asarray(input_ids)
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim != 2 or ids.dtype.kind not in "iu" or ids.shape[1] < 1:
            raise ValueError(f"MambaForCausalLM.{op}: input_ids must be ints [batch, seq] (seq "
                             f">= 1), got {ids.dtype} {list(np.shape(input_ids))}")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(f"MambaForCausalLM.{op}: token ids must be in [0, "
                             f"{self.config.vocab_size}), got {ids.min()}..{ids.max()}")
        return ids.astype(np.int32)

    def logits(self, input_ids) -> np.ndarray:
        """f32 [batch, seq, vocab] for ids [batch, seq] (or [seq]: [seq, vocab])."""
        single = np.ndim(input_ids) == 1
        ids = self._ids(input_ids, "logits")
        (out,) = self.executable(*ids.shape, "forward").run({"input_ids": ids})
        return out[0] if single else out

    def generate(self, input_ids, max_new_tokens: int = 32) -> np.ndarray:
        """Greedy continuation: ids [batch, seq + max_new_tokens] (the prompt first). The
        prompt runs once (prefill); each new token is one decode step over the states."""
        single = np.ndim(input_ids) == 1
        ids = self._ids(input_ids, "generate")
        b, s = ids.shape
        layers = self.config.num_hidden_layers
        # views into the arenas: the next run copies its inputs in before writing any output
        out = self.executable(b, s, "prefill").run({"input_ids": ids}, outputs="view")
        tokens = [ids]
        step = self.executable(b, 1, "decode")
        for t in range(max_new_tokens):
            nxt = out[0].copy_to_host().astype(np.int32)[:, None]     # b ids, not b x vocab
            tokens.append(nxt)
            if t == max_new_tokens - 1:
                break
            feed = {"input_ids": nxt}
            for i in range(layers):
                feed[f"conv.{i}"], feed[f"ssm.{i}"] = out[2 + 2 * i], out[3 + 2 * i]
            out = step.run(feed, outputs="view")
        res = np.concatenate(tokens, axis=1)
        return res[0] if single else res
