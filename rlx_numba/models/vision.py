"""Image classifiers on the public graph API, reading torchvision's state-dict names: ResNet
(18/34/50/101/152) and ViT (B/16, B/32, L/16).

Inference only: each batch norm is folded into the convolution before it when the weights
load (w * gamma / sqrt(var + eps), beta - mean * gamma / sqrt(var + eps)), as inference
runtimes do, so a ResNet block is conv (+ bias) -> relu. Images are f32 [B, 3, H, W] (or one
[3, H, W]), already normalised the way the weights expect (torchvision: ImageNet mean and std).
``logits(images)`` runs one compiled executable per (batch, height, width), the most recent
``max_cached`` kept, all reading one device copy of the weights; ``classify(images, k)`` gives
the top-k classes and their softmax probabilities.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import compile
from ..ir.graph import Graph
from .blocks import Weights, encoder_attention, mlp, norm
from .executables import ExecutableCache, in_dtype, model_dtype
from .weights import check_params, load_safetensors


@dataclass
class ResNetConfig:
    block: str = "bottleneck"           # "basic" (ResNet-18/34) or "bottleneck" (50 and up)
    layers: tuple = (3, 4, 6, 3)        # blocks a stage
    width: int = 64                     # the stem's channels; stage i has width * 2**i planes
    num_classes: int = 1000
    bn_eps: float = 1e-5

    def __post_init__(self):
        if self.block not in ("basic", "bottleneck"):
            raise ValueError(f"ResNetConfig: block must be 'basic' or 'bottleneck', got "
                             f"{self.block!r}")
        self.layers = tuple(int(n) for n in self.layers)
        if not self.layers or any(n < 1 for n in self.layers):
            raise ValueError(f"ResNetConfig: layers must be one or more block counts >= 1, got "
                             f"{self.layers!r}")


@dataclass
class ViTConfig:
    image_size: int = 224
    patch_size: int = 16
    hidden_dim: int = 768
    num_layers: int = 12
    num_heads: int = 12
    mlp_dim: int = 3072
    num_classes: int = 1000
    ln_eps: float = 1e-6

    def __post_init__(self):
        if self.image_size % self.patch_size:
            raise ValueError(f"ViTConfig: image_size {self.image_size} is not a multiple of "
                             f"patch_size {self.patch_size}")
        if self.hidden_dim % self.num_heads:
            raise ValueError(f"ViTConfig: hidden_dim {self.hidden_dim} is not a multiple of "
                             f"num_heads {self.num_heads}")


ARCHS = {
    "resnet18": ResNetConfig("basic", (2, 2, 2, 2)),
    "resnet34": ResNetConfig("basic", (3, 4, 6, 3)),
    "resnet50": ResNetConfig("bottleneck", (3, 4, 6, 3)),
    "resnet101": ResNetConfig("bottleneck", (3, 4, 23, 3)),
    "resnet152": ResNetConfig("bottleneck", (3, 8, 36, 3)),
    "vit_b_16": ViTConfig(),
    "vit_b_32": ViTConfig(patch_size=32),
    "vit_l_16": ViTConfig(hidden_dim=1024, num_layers=24, num_heads=16, mlp_dim=4096),
}


def _arch(arch, kind):
    cfg = ARCHS.get(arch)
    if not isinstance(cfg, kind):
        names = [k for k, v in ARCHS.items() if isinstance(v, kind)]
        raise ValueError(f"{kind.__name__[:-6]}: arch must be one of {', '.join(names)}, got "
                         f"{arch!r}")
    return cfg


# ---- ResNet ----------------------------------------------------------------------------------
def _blocks(cfg: ResNetConfig):
    """(prefix, in, planes, out, stride, has_downsample) of every block, torchvision's order."""
    exp = 4 if cfg.block == "bottleneck" else 1
    cin, out = cfg.width, []
    for i, n in enumerate(cfg.layers):
        planes = cfg.width * 2 ** i
        for j in range(n):
            stride = 2 if i and not j else 1
            out.append((f"layer{i + 1}.{j}.", cin, planes, planes * exp, stride,
                        stride != 1 or cin != planes * exp))
            cin = planes * exp
    return out


def _convs(cfg: ResNetConfig):
    """(conv name, its bn's name, [out, in, k, k], stride, padding) of every convolution."""
    convs = [("conv1", "bn1", (cfg.width, 3, 7, 7), 2, 3)]
    for p, cin, planes, cout, stride, down in _blocks(cfg):
        if cfg.block == "basic":
            convs += [(p + "conv1", p + "bn1", (planes, cin, 3, 3), stride, 1),
                      (p + "conv2", p + "bn2", (planes, planes, 3, 3), 1, 1)]
        else:
            convs += [(p + "conv1", p + "bn1", (planes, cin, 1, 1), 1, 0),
                      (p + "conv2", p + "bn2", (planes, planes, 3, 3), stride, 1),
                      (p + "conv3", p + "bn3", (cout, planes, 1, 1), 1, 0)]
        if down:
            convs.append((p + "downsample.0", p + "downsample.1", (cout, cin, 1, 1), stride, 0))
    return convs


def resnet_param_shapes(cfg: ResNetConfig) -> dict[str, tuple]:
    """torchvision's state-dict names and shapes (num_batches_tracked aside)."""
    shapes = {}
    for conv, bn, shape, _, _ in _convs(cfg):
        shapes[conv + ".weight"] = shape
        for s in ("weight", "bias", "running_mean", "running_var"):
            shapes[f"{bn}.{s}"] = (shape[0],)
    feat = _blocks(cfg)[-1][3]
    shapes["fc.weight"], shapes["fc.bias"] = (cfg.num_classes, feat), (cfg.num_classes,)
    return shapes


def fold_batch_norms(cfg: ResNetConfig, params: dict) -> dict:
    """Each conv with its bn folded in: ``<conv>.weight`` and ``<conv>.bias``; fc as it is."""
    out = {"fc.weight": params["fc.weight"], "fc.bias": params["fc.bias"]}
    for conv, bn, _, _, _ in _convs(cfg):
        g64 = params[bn + ".weight"].astype(np.float64)
        inv = g64 / np.sqrt(params[bn + ".running_var"].astype(np.float64) + cfg.bn_eps)
        w = params[conv + ".weight"].astype(np.float64) * inv[:, None, None, None]
        b = params[bn + ".bias"] - params[bn + ".running_mean"] * inv
        out[conv + ".weight"], out[conv + ".bias"] = w.astype(np.float32), b.astype(np.float32)
    return out


def to_channels_last(cfg: ResNetConfig, params: dict) -> dict:
    """fold_batch_norms' params with each conv weight [out, in, k, k] permuted to channels last
    [out, k, k, in] (what ``build_resnet(..., channels_last=True)`` reads)."""
    convs = {c[0] + ".weight" for c in _convs(cfg)}
    return {k: np.ascontiguousarray(v.transpose(0, 2, 3, 1)) if k in convs else v
            for k, v in params.items()}


def build_resnet(cfg: ResNetConfig, batch: int, height: int, width: int,
                 channels_last: bool = False) -> Graph:
    """The inference graph: input "images" f32 [batch, 3, height, width] -> logits; params
    are fold_batch_norms' names. ``channels_last``: the images transposed to [batch, height,
    width, 3] once, every conv and the max pool channels last (conv weights [out, k, k, in]:
    ``to_channels_last``), the global average pool a mean over the spatial axes."""
    g = Graph("resnet")
    P = {}
    for conv, _, shape, _, _ in _convs(cfg):
        wshape = (shape[0],) + shape[2:] + (shape[1],) if channels_last else shape
        P[conv + ".weight"] = g.param(conv + ".weight", wshape)
        P[conv + ".bias"] = g.param(conv + ".bias", (shape[0],))
    spec = {c[0]: c for c in _convs(cfg)}

    def conv(x, name, relu=True):
        _, _, _, stride, pad = spec[name]
        y = g.conv(x, P[name + ".weight"], P[name + ".bias"], stride=stride, padding=pad,
                   channels_last=channels_last)
        return g.relu(y) if relu else y

    x = g.input("images", (batch, 3, height, width))
    if channels_last:      # (in a half model: after the cast the input gets as it enters)
        x = g.transpose(x, (0, 2, 3, 1))
    x = g.pool(conv(x, "conv1"), "max", 3, 2, 1, channels_last=channels_last)
    n = 3 if cfg.block == "bottleneck" else 2
    for p, _, _, _, _, down in _blocks(cfg):
        h = x
        for i in range(1, n + 1):
            h = conv(h, f"{p}conv{i}", relu=i < n)
        skip = conv(x, p + "downsample.0", relu=False) if down else x
        x = g.relu(g.add(h, skip))
    if channels_last:
        feat = g.reduce_mean(x, (1, 2))
    else:
        feat = g.reshape(g.adaptive_avg_pool(x, (1, 1)), (batch, x.shape[1]))
    fc_w = g.param("fc.weight", (cfg.num_classes, feat.shape[1]))
    g.set_outputs([g.linear(feat, g.transpose(fc_w, (1, 0)), g.param("fc.bias",
                                                                        (cfg.num_classes,)))])
    return g


# ---- ViT ---------------------------------------------------------------------------------------
def vit_param_shapes(cfg: ViTConfig) -> dict[str, tuple]:
    d, m, p = cfg.hidden_dim, cfg.mlp_dim, cfg.patch_size
    seq = (cfg.image_size // p) ** 2 + 1
    shapes = {"conv_proj.weight": (d, 3, p, p), "conv_proj.bias": (d,),
              "class_token": (1, 1, d), "encoder.pos_embedding": (1, seq, d)}
    for i in range(cfg.num_layers):
        q = f"encoder.layers.encoder_layer_{i}."
        shapes.update({q + "ln_1.weight": (d,), q + "ln_1.bias": (d,),
                       q + "self_attention.in_proj_weight": (3 * d, d),
                       q + "self_attention.in_proj_bias": (3 * d,),
                       q + "self_attention.out_proj.weight": (d, d),
                       q + "self_attention.out_proj.bias": (d,),
                       q + "ln_2.weight": (d,), q + "ln_2.bias": (d,),
                       q + "mlp.0.weight": (m, d), q + "mlp.0.bias": (m,),
                       q + "mlp.3.weight": (d, m), q + "mlp.3.bias": (d,)})
    shapes.update({"encoder.ln.weight": (d,), "encoder.ln.bias": (d,),
                   "heads.head.weight": (cfg.num_classes, d), "heads.head.bias": (cfg.num_classes,)})
    return shapes


def split_in_proj(cfg: ViTConfig, params: dict) -> dict:
    """nn.MultiheadAttention's packed in_proj as separate q / k / v weights and biases."""
    out = dict(params)
    d = cfg.hidden_dim
    for i in range(cfg.num_layers):
        q = f"encoder.layers.encoder_layer_{i}.self_attention."
        w, b = out.pop(q + "in_proj_weight"), out.pop(q + "in_proj_bias")
        for j, m in enumerate("qkv"):
            out[f"{q}{m}.weight"], out[f"{q}{m}.bias"] = w[j * d:(j + 1) * d], b[j * d:(j + 1) * d]
    return out


def vit_graph_shapes(cfg: ViTConfig) -> dict[str, tuple]:
    """The params of ``build_vit``: vit_param_shapes' with each layer's packed in_proj as
    split_in_proj's q / k / v weights and biases."""
    d, out = cfg.hidden_dim, {}
    for name, shape in vit_param_shapes(cfg).items():
        if name.endswith(("in_proj_weight", "in_proj_bias")):
            what = "weight" if name.endswith("weight") else "bias"
            for m in "qkv":
                out[f"{name.rsplit('.', 1)[0]}.{m}.{what}"] = (d, d) if what == "weight" else (d,)
        else:
            out[name] = shape
    return out


def build_vit(cfg: ViTConfig, batch: int) -> Graph:
    """The inference graph: input "images" f32 [batch, 3, image_size, image_size] -> logits;
    params are split_in_proj's names (vit_graph_shapes)."""
    g = Graph("vit")
    w = Weights.declare(g, vit_graph_shapes(cfg))
    d, eps = cfg.hidden_dim, cfg.ln_eps
    grid = cfg.image_size // cfg.patch_size
    x = g.input("images", (batch, 3, cfg.image_size, cfg.image_size))
    x = g.conv(x, w["conv_proj.weight"], w["conv_proj.bias"], stride=cfg.patch_size)
    x = g.transpose(g.reshape(x, (batch, d, grid * grid)), (0, 2, 1))
    cls = g.expand(w["class_token"], (batch, 1, d))
    x = g.add(g.concat([cls, x], 1), w["encoder.pos_embedding"])
    for i in range(cfg.num_layers):           # pre-norm: x + attention(ln_1 x), x + mlp(ln_2 x)
        p = f"encoder.layers.encoder_layer_{i}."
        h = norm(w, p + "ln_1", x, eps=eps, kind="layer")
        names = tuple(f"{p}self_attention.{m}" for m in ("q", "k", "v", "out_proj"))
        x = g.add(x, encoder_attention(w, h, names, num_heads=cfg.num_heads))
        h = norm(w, p + "ln_2", x, eps=eps, kind="layer")
        x = g.add(x, mlp(w, h, p + "mlp.0", p + "mlp.3", activation="gelu"))
    x = norm(w, "encoder.ln", x, eps=eps, kind="layer")
    cls_out = g.reshape(g.narrow(x, 1, 0, 1), (batch, d))
    g.set_outputs([w.linear(cls_out, "heads.head")])
    return g


# ---- the models ----------------------------------------------------------------------------------
class _Classifier:
    KIND = None

    def __init__(self, config, params: dict, *, max_cached: int = 4, source="params",
                 dtype="f32"):
        if not isinstance(config, self.KIND):
            raise ValueError(f"{type(self).__name__}: config must be a {self.KIND.__name__}, got "
                             f"{type(config).__name__}")
        self.dtype = model_dtype(type(self).__name__, dtype)
        self.config = config
        self.params = check_params(self._shapes(config), params, source)
        self._device_params = self._prepare(config, self.params)
        self.max_cached = max_cached
        self._exes = ExecutableCache(type(self).__name__.lower())

    @classmethod
    def from_safetensors(cls, path, arch: str | None = None, config=None, **kw):
        """A torchvision state dict saved with safetensors; ``arch`` names the architecture
        (ARCHS) unless ``config`` is given."""
        if config is None:
            config = _arch(arch, cls.KIND)
        return cls(config, load_safetensors(path), source=path, **kw)

    @classmethod
    def from_config(cls, config, seed: int = 0, **kw):
        """Random weights from ``seed`` (scaled so activations stay O(1) through the depth)."""
        if isinstance(config, str):
            config = _arch(config, cls.KIND)
        rng = np.random.default_rng(seed)
        params = {name: cls._random(name, shape, rng).astype(np.float32)
                  for name, shape in cls._shapes(config).items()}
        return cls(config, params, source=f"from_config(seed={seed})", **kw)

    def executable(self, batch: int, height: int, width: int):
        return self._exes.fetch((batch, height, width), self.max_cached,
                                lambda: self._compile(batch, height, width))

    def _compile(self, batch, height, width):
        exe = compile(in_dtype(self._build(batch, height, width), self.dtype),
                      params=self._exes.params,
                      stream=self._exes.stream)
        for name in exe.unset_params:
            exe.set_param(name, self._device_params[name])
        return exe

    def logits(self, images) -> np.ndarray:
        """f32 [B, num_classes] for images f32 [B, 3, H, W] (or [3, H, W]: [num_classes])."""
        x = np.asarray(images)
        single = x.ndim == 3
        if single:
            x = x[None]
        if x.ndim != 4 or x.shape[1] != 3 or x.dtype.kind != "f":
            raise ValueError(f"{type(self).__name__}.logits: images must be float [B, 3, H, W] "
                             f"or [3, H, W], got {x.dtype} {list(np.shape(images))}")
        self._check_size(x.shape[2], x.shape[3])
        (out,) = self.executable(*x.shape[:1], x.shape[2], x.shape[3]).run(
            {"images": np.ascontiguousarray(x, np.float32)})
        return out[0] if single else out

    def classify(self, images, k: int = 5):
        """(top-k class indices [B, k], their softmax probabilities [B, k]), best first."""
        z = np.atleast_2d(self.logits(images)).astype(np.float64)
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        idx = np.argsort(-z, axis=1, kind="stable")[:, :k]
        return idx, np.take_along_axis(p, idx, 1).astype(np.float32)

    def _check_size(self, h, w):
        pass


class ResNet(_Classifier):
    """torchvision's ResNet, inference, batch norms folded (module docstring).
    ``channels_last`` (default: on for dtype f16 / bf16, off for f32) runs it NHWC after one
    transpose of the images (cuDNN's fast half layout; 1x1 convs as plain products), the conv
    weights permuted once when they load; the logits are the same."""
    KIND = ResNetConfig

    @staticmethod
    def _shapes(cfg):
        return resnet_param_shapes(cfg)

    def __init__(self, config, params: dict, *, channels_last=None, **kw):
        if channels_last is None:
            channels_last = model_dtype(type(self).__name__, kw.get("dtype", "f32")) != "f32"
        if not isinstance(channels_last, bool):
            raise ValueError(f"ResNet: channels_last must be True, False or None (on for f16 / "
                             f"bf16), got {channels_last!r}")
        self.channels_last = channels_last
        # the batch norms' step counters (training state) are not weights
        params = {k: v for k, v in params.items() if not k.endswith(".num_batches_tracked")}
        super().__init__(config, params, **kw)

    def _prepare(self, cfg, params):
        folded = fold_batch_norms(cfg, params)
        return to_channels_last(cfg, folded) if self.channels_last else folded

    @staticmethod
    def _random(name, shape, rng):
        if name.endswith("running_var"):
            return rng.uniform(0.5, 1.5, shape)
        if len(shape) == 4 or name == "fc.weight":
            return rng.standard_normal(shape) * math.sqrt(1.0 / math.prod(shape[1:]))
        base = 1.0 if name.endswith(".weight") else 0.0          # bn gamma around 1
        return base + 0.1 * rng.standard_normal(shape)

    def _build(self, batch, height, width):
        return build_resnet(self.config, batch, height, width, self.channels_last)

    def _check_size(self, h, w):
        if h < 32 or w < 32:
            raise ValueError(f"ResNet.logits: images must be at least 32 x 32 (five stride-2 "
                             f"stages), got {h} x {w}")


class ViT(_Classifier):
    """torchvision's VisionTransformer (class token, pre-norm encoder, exact GELU), inference."""
    KIND = ViTConfig

    @staticmethod
    def _shapes(cfg):
        return vit_param_shapes(cfg)

    @staticmethod
    def _prepare(cfg, params):
        return split_in_proj(cfg, params)

    @staticmethod
    def _random(name, shape, rng):
        if name.endswith(("ln_1.weight", "ln_2.weight", "ln.weight")):
            return 1.0 + 0.1 * rng.standard_normal(shape)
        if len(shape) >= 2 and not name.startswith(("class_token", "encoder.pos")):
            return rng.standard_normal(shape) * math.sqrt(1.0 / math.prod(shape[1:]))
        return 0.1 * rng.standard_normal(shape)

    def _build(self, batch, height, width):
        return build_vit(self.config, batch)

    def _check_size(self, h, w):
        s = self.config.image_size
        if (h, w) != (s, s):
            raise ValueError(f"ViT.logits: images must be {s} x {s} (the position embedding's "
                             f"size), got {h} x {w}")


__all__ = ["ARCHS", "ResNet", "ResNetConfig", "ViT", "ViTConfig", "build_resnet", "build_vit",
           "fold_batch_norms", "to_channels_last", "resnet_param_shapes", "vit_param_shapes",
           "vit_graph_shapes", "split_in_proj"]
