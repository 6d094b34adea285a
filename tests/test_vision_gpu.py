"""ResNet-50 and ViT-B/16 against torchvision on the GPU: random weights from a seed (batch
norm running statistics, and the ViT head and class token torchvision initialises to zero,
randomised too), written to safetensors with torchvision's names, loaded through
from_safetensors; logits within 1e-3 relative (TF32 off), the same top-5."""
import numpy as np
import pytest

from conftest import ON_GPU

torch = pytest.importorskip("torch") if ON_GPU else None
pytestmark = pytest.mark.skipif(not ON_GPU, reason="compares with torchvision on the GPU")


@pytest.mark.parametrize("arch", ["resnet50", "vit_b_16"])
def test_against_torchvision(tmp_path, arch):
    tv = pytest.importorskip("torchvision")
    from safetensors.torch import save_file

    from rlx_numba.models import ResNet, ViT
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    model = getattr(tv.models, arch)(weights=None).eval()
    with torch.no_grad():
        for name, t in model.named_parameters():     # torchvision's ViT zeroes these
            if name.startswith("heads.") or name == "class_token":
                t.normal_(0, 0.05)
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.normal_(1, 0.1)
                m.bias.normal_(0, 0.1)
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        want = model.cuda()(x.cuda()).cpu().numpy()
    ours = (ResNet if arch.startswith("resnet") else ViT).from_safetensors(path, arch)
    got = ours.logits(x.numpy())
    rel = np.abs(got - want).max() / np.abs(want).max()
    assert rel < 1e-3, rel
    top = ours.classify(x.numpy(), k=5)[0]
    assert np.array_equal(top, np.argsort(-want, axis=1)[:, :5])
