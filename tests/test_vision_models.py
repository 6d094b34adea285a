"""ResNet and ViT (rlx_numba.models) on tiny configs against NumPy forward passes written here
from torchvision's architecture (batch norms applied as they are, not folded; attention spelled
out), loaded from safetensors files with torchvision's names. GPU: tests/test_vision_gpu.py
compares with torchvision itself."""
import numpy as np
import pytest

from test_conv import conv_ref, pool_ref
from rlx_numba.models import ResNet, ResNetConfig, ViT, ViTConfig


def np_resnet(cfg, P, x):
    def bn(y, n):
        s = (1, -1, 1, 1)
        return ((y - P[n + ".running_mean"].reshape(s)) / np.sqrt(P[n + ".running_var"].reshape(s)
                + cfg.bn_eps) * P[n + ".weight"].reshape(s) + P[n + ".bias"].reshape(s))

    def conv(y, n, stride=1, padding=0):
        return conv_ref(y, P[n + ".weight"], stride=stride, padding=padding)

    relu = lambda y: np.maximum(y, 0)     # noqa: E731
    y = relu(bn(conv(x, "conv1", 2, 3), "bn1"))
    y = pool_ref(y, "max", (3, 3), (2, 2), 1)
    cin = cfg.width
    exp = 4 if cfg.block == "bottleneck" else 1
    for i, n in enumerate(cfg.layers):
        planes = cfg.width * 2 ** i
        for j in range(n):
            p, stride = f"layer{i + 1}.{j}.", 2 if i and not j else 1
            if cfg.block == "basic":
                h = relu(bn(conv(y, p + "conv1", stride, 1), p + "bn1"))
                h = bn(conv(h, p + "conv2", 1, 1), p + "bn2")
            else:
                h = relu(bn(conv(y, p + "conv1"), p + "bn1"))
                h = relu(bn(conv(h, p + "conv2", stride, 1), p + "bn2"))
                h = bn(conv(h, p + "conv3"), p + "bn3")
            skip = y
            if stride != 1 or cin != planes * exp:
                skip = bn(conv(y, p + "downsample.0", stride), p + "downsample.1")
            y, cin = relu(h + skip), planes * exp
    return y.mean((2, 3)) @ P["fc.weight"].T + P["fc.bias"]


def np_vit(cfg, P, x):
    d, nh = cfg.hidden_dim, cfg.num_heads
    b = x.shape[0]

    def ln(y, n):
        u, v = y.mean(-1, keepdims=True), y.var(-1, keepdims=True)
        return (y - u) / np.sqrt(v + cfg.ln_eps) * P[n + ".weight"] + P[n + ".bias"]

    def lin(y, w, bias):
        return y @ w.T + bias

    from math import erf
    gelu = np.vectorize(lambda t: 0.5 * t * (1 + erf(t / np.sqrt(2))))
    y = conv_ref(x, P["conv_proj.weight"], P["conv_proj.bias"], stride=cfg.patch_size)
    y = y.reshape(b, d, -1).transpose(0, 2, 1)
    y = np.concatenate([np.broadcast_to(P["class_token"], (b, 1, d)), y], 1)
    y = y + P["encoder.pos_embedding"]
    for i in range(cfg.num_layers):
        p = f"encoder.layers.encoder_layer_{i}."
        h = ln(y, p + "ln_1")
        qkv = lin(h, P[p + "self_attention.in_proj_weight"], P[p + "self_attention.in_proj_bias"])
        q, k, v = (t.reshape(b, -1, nh, d // nh).transpose(0, 2, 1, 3) for t in np.split(qkv, 3, -1))
        s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(d // nh)
        a = np.exp(s - s.max(-1, keepdims=True))
        a = (a / a.sum(-1, keepdims=True)) @ v
        a = a.transpose(0, 2, 1, 3).reshape(b, -1, d)
        y = y + lin(a, P[p + "self_attention.out_proj.weight"], P[p + "self_attention.out_proj.bias"])
        h = ln(y, p + "ln_2")
        h = lin(gelu(lin(h, P[p + "mlp.0.weight"], P[p + "mlp.0.bias"])), P[p + "mlp.3.weight"],
                P[p + "mlp.3.bias"])
        y = y + h
    y = ln(y, "encoder.ln")
    return lin(y[:, 0], P["heads.head.weight"], P["heads.head.bias"])


def _save(tmp_path, params, extra=None):
    from safetensors.numpy import save_file
    path = tmp_path / "model.safetensors"
    save_file({**params, **(extra or {})}, str(path))
    return path


@pytest.mark.parametrize("cfg", [ResNetConfig("basic", (1, 1, 1, 1), width=4, num_classes=5),
                                 ResNetConfig("bottleneck", (2, 1, 1, 1), width=2, num_classes=3)])
def test_resnet_against_numpy(rng, tmp_path, monkeypatch, cfg):
    ref = ResNet.from_config(cfg, seed=1)
    # torchvision's state dict also holds the batch norms' step counters
    counters = {k.replace("running_mean", "num_batches_tracked"): np.array(3, np.int64)
                for k in ref.params if k.endswith("running_mean")}
    model = ResNet.from_safetensors(_save(tmp_path, ref.params, counters), config=cfg)
    x = rng.standard_normal((1, 3, 33, 32)).astype(np.float32)
    got = model.logits(x[0])              # one image [3, H, W]: [num_classes] (batch [B, 3, H,
    assert got.shape == (cfg.num_classes,)          # W] images: test_vit_against_numpy)
    want = np_resnet(cfg, {k: v.astype(np.float64) for k, v in model.params.items()},
                     x.astype(np.float64))[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    # classify: the softmax and top-k of those logits (its forward is logits(), just checked:
    # patched to return them, so the simulator runs the model once a config)
    monkeypatch.setattr(model, "logits", lambda images: got)
    idx, prob = model.classify(x[0], k=2)
    assert idx.shape == (1, 2) and list(idx[0]) == list(np.argsort(-want)[:2])
    soft = np.exp(want - want.max()) / np.exp(want - want.max()).sum()
    np.testing.assert_allclose(prob[0], soft[idx[0]], rtol=1e-4)
    assert np.all(prob[0, :-1] >= prob[0, 1:]) and 0 < prob.sum() <= 1 + 1e-6


def test_vit_against_numpy(rng, tmp_path):
    cfg = ViTConfig(image_size=8, patch_size=4, hidden_dim=8, num_layers=2, num_heads=2,
                    mlp_dim=12, num_classes=5)
    ref = ViT.from_config(cfg, seed=2)
    model = ViT.from_safetensors(_save(tmp_path, ref.params), config=cfg)
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    got = model.logits(x)
    want = np_vit(cfg, {k: v.astype(np.float64) for k, v in model.params.items()},
                  x.astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_vision_model_errors(tmp_path):
    cfg = ResNetConfig("basic", (1, 1, 1, 1), width=4, num_classes=5)
    model = ResNet.from_config(cfg)
    with pytest.raises(ValueError, match=r"ResNet.logits: images must be float \[B, 3, H, W\]"):
        model.logits(np.zeros((1, 1, 32, 32), np.float32))
    with pytest.raises(ValueError, match="at least 32 x 32"):
        model.logits(np.zeros((1, 3, 16, 16), np.float32))
    with pytest.raises(ValueError, match="arch must be one of resnet18, resnet34"):
        ResNet.from_safetensors(tmp_path / "x.safetensors", arch="vit_b_16")
    params = dict(model.params)
    params.pop("layer1.0.bn1.running_var")
    with pytest.raises(ValueError, match="missing tensor.*layer1.0.bn1.running_var"):
        ResNet(cfg, params)
    vit = ViTConfig(image_size=8, patch_size=4, hidden_dim=8, num_layers=1, num_heads=2,
                    mlp_dim=4, num_classes=3)
    with pytest.raises(ValueError, match="images must be 8 x 8"):
        ViT.from_config(vit).logits(np.zeros((1, 3, 16, 16), np.float32))
    with pytest.raises(ValueError, match="not a multiple of num_heads"):
        ViTConfig(hidden_dim=10, num_heads=4)
