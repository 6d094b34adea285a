"""rlx.onnx on models torch.onnx.export writes (GPU only: skipped under the simulator, where
these would take minutes): torchvision ResNet-18 and a small VisionTransformer, a small
transformers BertModel and LlamaForCausalLM (random weights, one padded sample), each exported
by the TorchScript exporter at opset 17 and the dynamo exporter at opset 18, run through
rlx.onnx.load beside the torch model (f32, TF32 off) and onnxruntime's CPU provider when it
is importable: within 1e-4 of each, relative to the largest output. bench/bench_onnx.py runs
the full-size models and times them."""
from __future__ import annotations

import numpy as np
import pytest

import rlx_numba as rlx

pytestmark = pytest.mark.skipif(rlx.simulator_enabled(), reason="needs a GPU (whole exported "
                                "models: minutes in the simulator)")
onnx = pytest.importorskip("onnx")
torch = pytest.importorskip("torch")

EXPORTERS = [("ts17", 17, False), ("dyn18", 18, True)]
B, S = 2, 16


def _hf(name):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    mask = torch.ones(B, S, dtype=torch.int64)
    mask[0, S - 5:] = 0
    if name == "bert":
        m = transformers.BertModel(transformers.BertConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            vocab_size=100, max_position_embeddings=128)).eval()
        field, kw = "last_hidden_state", {}
    else:
        m = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=100, max_position_embeddings=128)).eval()
        field, kw = "logits", {"use_cache": False}

    class Wrap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = m

        def forward(self, ids, mask):
            return getattr(self.m(input_ids=ids, attention_mask=mask, **kw), field)
    return Wrap().eval(), (torch.randint(0, 100, (B, S)), mask), ["input_ids", "attention_mask"]


def _vision(name):
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    if name == "resnet18":
        return tv.models.resnet18(weights=None).eval(), (torch.randn(B, 3, 64, 64),), ["x"]
    m = tv.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                                    hidden_dim=32, mlp_dim=64, num_classes=10).eval()
    torch.nn.init.normal_(m.heads.head.weight, std=0.1)     # zero-initialised by torchvision
    return m, (torch.randn(B, 3, 32, 32),), ["x"]


@pytest.mark.parametrize("exp,opset,dynamo", EXPORTERS, ids=[e[0] for e in EXPORTERS])
@pytest.mark.parametrize("name", ["resnet18", "vit", "bert", "llama"])
def test_exported_model_matches_torch_and_ort(name, exp, opset, dynamo, tmp_path):
    if dynamo:
        pytest.importorskip("onnxscript")
    model, args, names = _vision(name) if name in ("resnet18", "vit") else _hf(name)
    path = tmp_path / "m.onnx"
    fast = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)   # (ts17: MHA's fused op has no symbolic)
    try:
        with torch.no_grad():
            torch.onnx.export(model, args, str(path), dynamo=dynamo, opset_version=opset,
                              input_names=names)
    except Exception as e:  # noqa: BLE001 - torch's exporter, not rlx: named in the skip
        last = [ln for ln in str(e).splitlines() if ln.strip()][-1:] or [repr(e)]
        pytest.skip(f"torch.onnx.export ({exp}) cannot export {name}: {last[0][:200]}")
    finally:
        torch.backends.mha.set_fastpath_enabled(fast)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.no_grad():
            ref = model.cuda()(*(a.cuda() for a in args)).float().cpu().numpy()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    feeds = {n: a.numpy() for n, a in zip(names, args)}
    m = rlx.onnx.load(str(path))
    (y,) = m.run({n: feeds[n] for n in m.input_names})
    assert y.shape == ref.shape and np.isfinite(y).all()
    err = np.abs(y - ref).max() / np.abs(ref).max()
    assert err <= 1e-4, (name, exp, err)
    try:
        import onnxruntime as ort
    except ImportError:
        return
    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (yo,) = s.run(None, {i.name: feeds[i.name] for i in s.get_inputs()})
    err = np.abs(y - yo).max() / np.abs(yo).max()
    assert err <= 1e-4, (name, exp, "vs onnxruntime", err)
