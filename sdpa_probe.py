import numpy as np, torch, time
from numba import cuda
import rlx_numba.cudnn as ours
ours.lib()
import cudnn
print("cudnn frontend", cudnn.__version__, "backend", cudnn.backend_version())
stream = cuda.stream()
h, _ws = ours.handle(stream)
hval = h.value if hasattr(h, "value") else int(h)
B, H, S, D = 4, 12, 128, 32
def run(bias_shape, causal=False, layout="bhsd"):
    g = cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=hval)
    def T(name, dims, uid, dtype=cudnn.data_type.BFLOAT16):
        st = [int(np.prod(dims[i+1:])) for i in range(4)]
        return g.tensor(name=name, dim=list(dims), stride=st, data_type=dtype, uid=uid)
    q, k, v = (T(n, (B, H, S, D), i + 1) for i, n in enumerate("qkv"))
    bias = T("bias", bias_shape, 5) if bias_shape else None
    o, _ = g.sdpa(name="sdpa", q=q, k=k, v=v, is_inference=True, attn_scale=D ** -0.5,
                  bias=bias, use_causal_mask=causal)
    o.set_output(True).set_dim([B, H, S, D]).set_stride([H*S*D, S*D, D, 1]).set_uid(4).set_data_type(cudnn.data_type.BFLOAT16)
    g.validate(); g.build_operation_graph(); g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support(); g.build_plans()
    tq, tk, tv = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    to = torch.empty_like(tq)
    tb = torch.randn(*bias_shape, device="cuda", dtype=torch.bfloat16) if bias_shape else None
    ws = torch.empty(max(g.get_workspace_size(), 1), device="cuda", dtype=torch.uint8)
    pack = {1: tq.data_ptr(), 2: tk.data_ptr(), 3: tv.data_ptr(), 4: to.data_ptr()}
    if tb is not None: pack[5] = tb.data_ptr()
    torch.cuda.synchronize()
    g.execute(pack, ws.data_ptr(), hval); stream.synchronize()
    ref = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=tb, is_causal=causal)
    err = (to.float() - ref.float()).abs().max().item()
    t0 = time.perf_counter()
    for _ in range(20): g.execute(pack, ws.data_ptr(), hval)
    stream.synchronize(); t = (time.perf_counter() - t0) / 20
    print("bias", bias_shape, "causal", causal, "err", err, f"{t*1e6:.1f} us")
for bs in [None, (B, 1, 1, S), (1, 1, S, S), (B, 1, S, S)]:
    try: run(bs)
    except Exception as e: print("bias", bs, "FAILED", type(e).__name__, str(e)[:300])
run(None, causal=True)
