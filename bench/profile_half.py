"""Where the time goes in the half-precision model rows of the benches (GPU only): our
per-step profile (``exe.profile``: steps launched one by one, no CUDA graph) summed by kernel
name, beside torch.profiler's per-kernel table for the same model in the same dtype.

    python3 bench/profile_half.py [resnet] [bert] [decode1b]      (default: all three)

resnet: ResNet-50 bf16 batch 32 (torch autocast bf16, channels-last); bert: the MiniLM config
in f16 at batch 256 x 128 (torch fp16); decode1b: the Llama-3.2-1B shape's bf16 decode step at
batch 1 and 8 (ours only, with its CUDA-graph replay time a token). Random weights."""
import collections
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from numba import cuda

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_models import LLAMA_1B, MINILM, load_torch  # noqa: E402


def by_kernel(prof, top=18):
    """Print our profile's time summed by kernel name (the first 40 characters)."""
    d = collections.defaultdict(lambda: [0.0, 0])
    for r in prof:
        d[r.kernel[:40]][0] += r.ms
        d[r.kernel[:40]][1] += 1
    print(f"  total {sum(v[0] for v in d.values()):.3f} ms over {len(prof)} steps")
    for k, (ms, n) in sorted(d.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {ms:8.3f} ms {n:4d}x  {k}")


def torch_table(fn, top=15):
    """Print torch.profiler's CUDA kernels of one call of ``fn`` (after one warm-up call)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=top,
                                 max_name_column_width=60))


def resnet():
    import torchvision
    from safetensors.torch import save_file

    from rlx_numba.models import ResNet
    torch.manual_seed(0)
    tm = torchvision.models.resnet50(weights=None).eval().cuda()
    with tempfile.TemporaryDirectory() as tmp:
        save_file({k: v.contiguous().cpu() for k, v in tm.state_dict().items()},
                  f"{tmp}/m.safetensors")
        ours = ResNet.from_safetensors(f"{tmp}/m.safetensors", "resnet50", dtype="bf16")
    exe = ours.executable(32, 224, 224)
    x = torch.randn(32, 3, 224, 224, device="cuda")
    print("== ResNet-50 bf16 batch 32, ours")
    by_kernel(exe.profile({"images": cuda.as_cuda_array(x)}, warmup=2))
    tm = tm.to(memory_format=torch.channels_last)
    tx = x.contiguous(memory_format=torch.channels_last)
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        print("== torch, autocast bf16, channels-last")
        torch_table(lambda: tm(tx))


def bert():
    import transformers

    from rlx_numba.models import BertConfig, BertModel
    ours = BertModel.from_config(BertConfig(**MINILM), seed=0, dtype="f16")
    ids = np.random.default_rng(0).integers(0, 30000, (256, 128)).astype(np.int32)
    mask, types = np.ones((256, 128), bool), np.zeros((256, 128), np.int32)
    print("== MiniLM f16 batch 256 x 128, ours")
    by_kernel(ours.executable(256, 128).profile(
        {"input_ids": ids, "token_type_ids": types, "attention_mask": mask}, warmup=2))
    hf = transformers.BertModel(transformers.BertConfig(**MINILM), add_pooling_layer=False)
    hf = load_torch(torch, hf, ours.params).cuda().eval().half()
    ti, tm = torch.from_numpy(ids).long().cuda(), torch.from_numpy(mask).long().cuda()
    with torch.no_grad():
        print("== torch fp16")
        torch_table(lambda: hf(input_ids=ti, attention_mask=tm))


def decode1b():
    from rlx_numba.models import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(**LLAMA_1B)
    m = LlamaForCausalLM.from_config(cfg, seed=0, dtype="bf16")
    for b in (1, 8):
        prompt = np.random.default_rng(1).integers(0, cfg.vocab_size, (b, 32))
        for _ in m.generate_stream(prompt, 8):      # compiles the prefill and decode graphs
            pass
        dec = m.executable("decode", b, 1, 128, (0.0, 0, 1.0))     # generate_stream's cache
        feed = {"input_ids": np.zeros((b, 1), np.int32), "pos": np.array([40], np.int32),
                "seed": np.array([1], np.int64)}
        print(f"== Llama-3.2-1B shape, bf16 decode step, batch {b}, ours")
        by_kernel(dec.profile(feed, warmup=2), 25)
        for _ in range(3):
            dec.run(feed, outputs="view")
        cuda.synchronize()
        t = time.perf_counter()
        for _ in range(50):
            dec.run(feed, outputs="view")
        cuda.synchronize()
        print(f"  graph replay {1e3 * (time.perf_counter() - t) / 50:.3f} ms a token")


if __name__ == "__main__":
    for name in sys.argv[1:] or ["resnet", "bert", "decode1b"]:
        {"resnet": resnet, "bert": bert, "decode1b": decode1b}[name]()
