import sys, collections, numpy as np
import rlx_numba as rlx
from rlx_numba.models import BertConfig, BertModel, ViT, ViTConfig, ResNet, ResNetConfig
which = sys.argv[1]
if which == "bert":
    cfg = BertConfig(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                     intermediate_size=1536, max_position_embeddings=512, type_vocab_size=2,
                     layer_norm_eps=1e-12, hidden_act="gelu")
    m = BertModel.from_config(cfg, seed=0, dtype=sys.argv[2])
    b = 256
    exe = m.executable(b, 128, pooling=("mean",), normalize=True)
    feed = {"input_ids": np.random.randint(1000, 30000, (b, 128)).astype(np.int32),
            "token_type_ids": np.zeros((b, 128), np.int32), "attention_mask": np.ones((b, 128), bool)}
else:
    import torchvision, torch
    m = ViT.from_config(ViTConfig(), seed=0, dtype=sys.argv[2]) if which == "vit" else \
        ResNet.from_config(ResNetConfig("bottleneck", (3, 4, 6, 3)), seed=0, dtype=sys.argv[2])
    exe = m.executable(32, 224, 224)
    feed = {"images": np.random.randn(32, 3, 224, 224).astype(np.float32)}
prof = exe.profile(feed, warmup=2)
tot = collections.Counter(); cnt = collections.Counter()
for r in prof:
    k = r.kernel.split(" ")[0][:40]
    tot[k] += r.ms; cnt[k] += 1
print(f"{which} {sys.argv[2]} total {prof.total_ms:.3f} ms, {len(list(prof))} steps")
for k, v in tot.most_common(14):
    print(f"  {k:<42} {v:8.3f} ms  x{cnt[k]}")
