"""Weight loaders on small files the tests write: safetensors (one file, shards, bf16/f16),
GGUF (llama.cpp's tensor names and Q/K permutation, a Q8_0 tensor quantised here, the
vocabulary as a tokenizer), and bad files (truncated, wrong shapes, missing or unexpected
tensors, wrong dtypes) with errors that name the file and the tensor. No graph runs here."""
import json
import re

import ml_dtypes
import numpy as np
import pytest

from rlx_numba.models import (GGUFFile, LlamaConfig, LlamaForCausalLM, SentenceEncoder,
                              llama_param_shapes, reverse_permute)

gguf = pytest.importorskip("gguf")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")
from safetensors.numpy import save_file  # noqa: E402

CFG = LlamaConfig(vocab_size=265, hidden_size=32, intermediate_size=44, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rope_theta=500.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                  bos_token_id=262, eos_token_id=264)


def hf_params(cfg, seed=0):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32)
            for k, s in llama_param_shapes(cfg).items()}


def hf_config(cfg):
    """A transformers-5-style config.json (theta under rope_parameters)."""
    d = cfg.to_dict()
    d.pop("rope_theta")
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}, **d}


def write_hf_folder(path, cfg, params):
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config(cfg)))
    save_file(params, str(path / "model.safetensors"))


# ---- safetensors ----------------------------------------------------------------------------------
def test_safetensors_folder(tmp_path):
    params = hf_params(CFG)
    stored = dict(params)
    stored["model.layers.0.mlp.up_proj.weight"] = params["model.layers.0.mlp.up_proj.weight"].astype(
        ml_dtypes.bfloat16)
    stored["model.norm.weight"] = params["model.norm.weight"].astype(np.float16)
    stored["lm_head.weight"] = params["model.embed_tokens.weight"].copy()   # tied: ignored
    stored["model.layers.1.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
    write_hf_folder(tmp_path, CFG, stored)
    m = LlamaForCausalLM.from_safetensors(tmp_path)
    assert m.config.to_dict() == CFG.to_dict() and m.tokenizer is None
    assert set(m.params) == set(params)
    for k, v in params.items():
        want = stored[k].astype(np.float32)            # bf16 / f16 widened exactly
        assert m.params[k].dtype == np.float32
        np.testing.assert_array_equal(m.params[k], want, err_msg=k)
    assert not np.array_equal(m.params["model.norm.weight"], params["model.norm.weight"])


def test_safetensors_shards(tmp_path):
    params = hf_params(CFG, 1)
    names = list(params)
    shards = {"a.safetensors": names[:7], "b.safetensors": names[7:]}
    for f, keys in shards.items():
        save_file({k: params[k] for k in keys}, str(tmp_path / f))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}))
    (tmp_path / "config.json").write_text(json.dumps(hf_config(CFG)))
    m = LlamaForCausalLM.from_safetensors(tmp_path)
    for k, v in params.items():
        np.testing.assert_array_equal(m.params[k], v)


def test_safetensors_bad_files(tmp_path):
    params = hf_params(CFG, 2)
    write_hf_folder(tmp_path / "ok", CFG, params)
    data = (tmp_path / "ok" / "model.safetensors").read_bytes()

    def folder(name, tensors=None, raw=None):
        d = tmp_path / name
        write_hf_folder(d, CFG, tensors if tensors is not None else params)
        if raw is not None:
            (d / "model.safetensors").write_bytes(raw)
        return d

    f = folder("trunc", raw=data[:-1000])
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    size = len(data) - 1000 - 8 - n                # the data section left
    last = min((k for k in header if k != "__metadata__" and header[k]["data_offsets"][1] > size),
               key=lambda k: header[k]["data_offsets"][1])
    with pytest.raises(ValueError, match=re.escape(f"{f / 'model.safetensors'}: not a readable "
                                                   f"safetensors file") + ".*" +
                       re.escape(f"tensor {last!r} ends at byte")):
        LlamaForCausalLM.from_safetensors(f)
    f = folder("garbage", raw=b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(ValueError, match="garbage/model.safetensors: not a readable safetensors"):
        LlamaForCausalLM.from_safetensors(f)
    bad = dict(params)
    bad["model.layers.1.mlp.up_proj.weight"] = np.zeros((44, 31), np.float32)
    with pytest.raises(ValueError, match=r"shape/model.safetensors: tensor "
                                         r"'model.layers.1.mlp.up_proj.weight' has shape \[44, 31\], "
                                         r"expected \[44, 32\]"):
        LlamaForCausalLM.from_safetensors(folder("shape", bad))
    bad = {k: v for k, v in params.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match=r"missing/model.safetensors: missing tensor\(s\) "
                                         r"'model.norm.weight'"):
        LlamaForCausalLM.from_safetensors(folder("missing", bad))
    bad = dict(params, **{"model.layers.0.input_layernorm.weight": np.ones(32, np.int32)})
    with pytest.raises(ValueError, match=r"tensor 'model.layers.0.input_layernorm.weight' has "
                                         r"dtype int32; expected a float type"):
        LlamaForCausalLM.from_safetensors(folder("dtype", bad))
    bad = dict(params, **{"model.layers.2.mlp.up_proj.weight": np.ones((44, 32), np.float32)})
    with pytest.raises(ValueError, match=r"extra/model.safetensors: unexpected tensor\(s\) "
                                         r"'model.layers.2.mlp.up_proj.weight'"):
        LlamaForCausalLM.from_safetensors(folder("extra", bad))
    (tmp_path / "noconf").mkdir()
    with pytest.raises(FileNotFoundError, match="noconf/config.json: config.json not found"):
        LlamaForCausalLM.from_safetensors(tmp_path / "noconf")
    f = folder("mt")
    (f / "config.json").write_text(json.dumps({**hf_config(CFG), "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="mt/config.json: model_type is 'gpt2'"):
        LlamaForCausalLM.from_safetensors(f)


def test_sentence_folder_errors(tmp_path):
    (tmp_path / "modules.json").write_text(json.dumps(
        [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
         {"idx": 1, "name": "1", "path": "1_Dense", "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(ValueError, match=r"modules.json: module 'sentence_transformers.models."
                                         r"Dense' is not supported"):
        SentenceEncoder.from_pretrained(tmp_path)
    (tmp_path / "modules.json").write_text(json.dumps(
        [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
         {"idx": 1, "name": "1", "path": "1_Pooling",
          "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_mean_tokens": False, "pooling_mode_weightedmean_tokens": True}))
    with pytest.raises(ValueError, match=r"1_Pooling/config.json: pooling \['weightedmean'\] is "
                                         r"not supported"):
        SentenceEncoder.from_pretrained(tmp_path)


# ---- GGUF -----------------------------------------------------------------------------------------
def llama_cpp_permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf permutation of a Q/K projection (written out here)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def q8_0(w):
    """(bytes [rows, blocks * 34], dequantised) of ggml's Q8_0: per 32 values an f16 scale
    d = max|x| / 127 and int8 round(x / d)."""
    rows, cols = w.shape
    blocks = w.reshape(rows, cols // 32, 32).astype(np.float64)
    d = (np.abs(blocks).max(-1, keepdims=True) / 127).astype(np.float16)
    q = np.round(blocks / np.where(d == 0, 1, d.astype(np.float64))).astype(np.int8)
    raw = np.concatenate([d.view(np.uint8).reshape(rows, -1, 2), q.view(np.uint8)], -1)
    return raw.reshape(rows, -1), (q.astype(np.float32) * d.astype(np.float32)).reshape(rows, cols)


GGUF_NAMES = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
              "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
              "self_attn.o_proj.weight": "attn_output.weight",
              "post_attention_layernorm.weight": "ffn_norm.weight",
              "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
              "mlp.down_proj.weight": "ffn_down.weight"}


def gguf_name(hf):
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, n, rest = hf.split(".", 3)
    return f"blk.{n}.{GGUF_NAMES[rest]}"


def vocabulary():
    """A byte-level BPE vocabulary of 265 tokens: the 256 byte symbols, the 6 merges that make
    'hello', ' hello' and '12', and three control tokens."""
    from tokenizers import pre_tokenizers
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = ["h e", "l l", "he ll", "hell o", "Ġ hello", "1 2"]
    tokens += ["he", "ll", "hell", "hello", "Ġhello", "12"]
    tokens += ["<s>", "<|im_start|>", "<|im_end|>"]
    types = [1] * 262 + [3, 3, 3]
    return tokens, merges, types


def write_gguf(path, cfg, params, *, q8=(), f16=(), arch="llama", drop=(), replace=None,
               extra=None, truncate=0, more_meta=False):
    tokens, merges, types = vocabulary()
    w = gguf.GGUFWriter(str(path), arch)
    if more_meta:    # a value of every scalar type, arrays of each kind, another alignment
        w.add_custom_alignment(64)
        w.add_uint32("test.alignment_used", 64)
        for t, v in (("uint8", 200), ("int8", -5), ("uint16", 60000), ("int16", -300),
                     ("int32", -70000), ("uint64", 2**40 + 3), ("int64", -2**40),
                     ("float32", 0.1), ("float64", 0.1), ("bool", True), ("string", "héllo")):
            getattr(w, f"add_{t}")(f"test.{t}", v)
        w.add_array("test.ints", [1, -2, 3])
        w.add_array("test.floats", [0.5, -1.25])
        w.add_array("test.bools", [True, False, True])
        w.add_array("test.strings", ["a", "", "ünï"])
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    expect = {}
    for hf, arr in params.items():
        if hf in drop or (cfg.tie_word_embeddings and hf == "lm_head.weight"):
            continue
        name = gguf_name(hf)
        stored = arr
        if hf.endswith("q_proj.weight"):
            stored = llama_cpp_permute(arr, cfg.num_attention_heads)
        elif hf.endswith("k_proj.weight"):
            stored = llama_cpp_permute(arr, cfg.num_key_value_heads)
        if replace and hf in replace:
            stored = replace[hf]
        if hf in q8:
            raw, deq = q8_0(stored)
            w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            # what the loader must return: the dequantised rows, un-permuted
            expect[hf] = (reverse_permute(deq, cfg.num_attention_heads) if hf.endswith("q_proj.weight")
                          else reverse_permute(deq, cfg.num_key_value_heads)
                          if hf.endswith("k_proj.weight") else deq)
        elif hf in f16:
            w.add_tensor(name, stored.astype(np.float16))
            expect[hf] = arr.astype(np.float16).astype(np.float32)
        else:
            w.add_tensor(name, stored)
            expect[hf] = arr
    for name, arr in (extra or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if truncate:
        data = path.read_bytes()
        path.write_bytes(data[:-truncate])
    return expect


def test_gguf_llama_loads_unpermuted_and_dequantised(tmp_path):
    params = hf_params(CFG, 3)
    q8 = ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.gate_proj.weight")
    f16 = ("model.layers.1.self_attn.k_proj.weight",)
    path = tmp_path / "tiny.gguf"
    expect = write_gguf(path, CFG, params, q8=q8, f16=f16)
    m = LlamaForCausalLM.from_gguf(path)
    c = m.config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers,
            c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.max_position_embeddings,
            c.tie_word_embeddings, c.bos_token_id, c.eos_token_id) == \
        (265, 32, 44, 2, 4, 2, 8, 128, True, 262, 264)
    assert c.rope_theta == 500.0 and abs(c.rms_norm_eps - 1e-5) < 1e-11
    assert set(m.params) == set(params)
    for k in params:
        np.testing.assert_array_equal(m.params[k], expect[k], err_msg=k)
    # the Q8_0 tensor is close to the original, the permutation is undone exactly elsewhere
    q = "model.layers.0.self_attn.q_proj.weight"
    assert np.abs(m.params[q] - params[q]).max() <= np.abs(params[q]).max() / 127
    tokens = vocabulary()[0]
    ids = m.encode("hello hello12<|im_end|>")
    assert [tokens[i] for i in ids] == ["hello", "Ġhello", "1", "2", "<|im_end|>"]
    assert m.decode(ids) == "hello hello12<|im_end|>"
    f = GGUFFile(path)
    assert f.type_name(gguf_name(q)) == "Q8_0" and f.shape(gguf_name(q)) == (32, 32)


def test_llama_cpp_permutation_is_the_interleaved_rope_layout():
    """llama.cpp rotates interleaved pairs (GPT-J) of its permuted Q/K rows; Hugging Face
    rotates half-split pairs of the original rows. The two give the same attention scores,
    and reverse_permute takes the permuted rows back exactly."""
    rng = np.random.default_rng(4)
    nh, nkv, d, hidden, s = 4, 2, 8, 16, 5
    wq, wk = rng.standard_normal((nh * d, hidden)), rng.standard_normal((nkv * d, hidden))
    x = rng.standard_normal((s, hidden))
    ang = np.arange(s)[:, None] * (100.0 ** (-np.arange(0, d, 2) / d))[None, :]
    cos, sin = np.cos(ang), np.sin(ang)

    def neox(t):                     # [s, heads, d], pairs (i, i + d/2)
        a, b = t[..., :d // 2], t[..., d // 2:]
        c, z = cos[:, None], sin[:, None]
        return np.concatenate([a * c - b * z, b * c + a * z], -1)

    def gptj(t):                     # pairs (2i, 2i + 1)
        a, b = t[..., 0::2], t[..., 1::2]
        c, z = cos[:, None], sin[:, None]
        out = np.empty_like(t)
        out[..., 0::2], out[..., 1::2] = a * c - b * z, b * c + a * z
        return out

    def scores(q, k):
        k = np.repeat(k, nh // nkv, 1)
        return np.einsum("shd,thd->hst", q, k)

    hf = scores(neox((x @ wq.T).reshape(s, nh, d)), neox((x @ wk.T).reshape(s, nkv, d)))
    pq, pk = llama_cpp_permute(wq, nh), llama_cpp_permute(wk, nkv)
    cpp = scores(gptj((x @ pq.T).reshape(s, nh, d)), gptj((x @ pk.T).reshape(s, nkv, d)))
    np.testing.assert_allclose(cpp, hf, rtol=1e-10, atol=1e-10)
    assert not np.allclose(scores(neox((x @ pq.T).reshape(s, nh, d)),
                                  neox((x @ pk.T).reshape(s, nkv, d))), hf)
    np.testing.assert_array_equal(reverse_permute(pq, nh), wq)
    np.testing.assert_array_equal(reverse_permute(pk, nkv), wk)
    with pytest.raises(ValueError, match="reverse_permute: 30 rows do not split into 4 heads"):
        reverse_permute(np.zeros((30, 2)), 4)


def test_gguf_bad_files(tmp_path):
    params = hf_params(CFG, 5)

    def path(name):
        return tmp_path / f"{name}.gguf"

    write_gguf(path("trunc"), CFG, params, truncate=100)
    last = gguf_name("model.norm.weight")       # the last tensor written
    with pytest.raises(ValueError, match=re.escape(f"{path('trunc')}: tensor {last!r} (F32, [32]) "
                                                   f"ends at byte")):
        LlamaForCausalLM.from_gguf(path("trunc"))
    path("magic").write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match=re.escape(f"{path('magic')}: not a readable GGUF file: "
                                                   f"GGUF magic invalid")):
        LlamaForCausalLM.from_gguf(path("magic"))
    write_gguf(path("head"), CFG, params)
    path("head").write_bytes(path("head").read_bytes()[:200])
    with pytest.raises(ValueError, match=re.escape(f"{path('head')}: not a readable GGUF file")):
        LlamaForCausalLM.from_gguf(path("head"))
    write_gguf(path("arch"), CFG, params, arch="gemma")
    with pytest.raises(ValueError, match="arch.gguf: general.architecture is 'gemma'"):
        LlamaForCausalLM.from_gguf(path("arch"))
    write_gguf(path("missing"), CFG, params, drop=("model.layers.1.mlp.gate_proj.weight",))
    with pytest.raises(ValueError, match=r"missing.gguf: missing tensor\(s\) "
                                         r"'model.layers.1.mlp.gate_proj.weight'"):
        LlamaForCausalLM.from_gguf(path("missing"))
    write_gguf(path("shape"), CFG, params,
               replace={"model.layers.0.mlp.up_proj.weight": np.zeros((40, 32), np.float32)})
    with pytest.raises(ValueError, match=r"shape.gguf: tensor 'model.layers.0.mlp.up_proj.weight' "
                                         r"has shape \[40, 32\], expected \[44, 32\]"):
        LlamaForCausalLM.from_gguf(path("shape"))
    write_gguf(path("qshape"), CFG, params,
               replace={"model.layers.0.self_attn.k_proj.weight": np.zeros((12, 32), np.float32)})
    with pytest.raises(ValueError, match=r"qshape.gguf: tensor 'blk.0.attn_k.weight' has shape "
                                         r"\[12, 32\], expected 16 rows \(2 heads of 8\)"):
        LlamaForCausalLM.from_gguf(path("qshape"))
    write_gguf(path("int"), CFG, params,
               replace={"model.norm.weight": np.ones(32, np.int32)})
    with pytest.raises(ValueError, match=r"int.gguf: GGUF tensor 'output_norm.weight' has type "
                                         r"I32; a weight must be"):
        LlamaForCausalLM.from_gguf(path("int"))
    write_gguf(path("extra"), CFG, params, extra={"blk.0.attn_qkv.weight": np.ones((4, 32), np.float32)})
    with pytest.raises(ValueError, match="extra.gguf: unexpected tensor 'blk.0.attn_qkv.weight' "
                                         "for a llama model"):
        LlamaForCausalLM.from_gguf(path("extra"))
    with pytest.raises(FileNotFoundError, match="nothere.gguf: no such GGUF file"):
        LlamaForCausalLM.from_gguf(path("nothere"))


def test_gguf_weights_kept_packed(tmp_path):
    """weights="gguf": the Q8_0 projections go to the device as their blocks (u8 params, the
    products dequant_matmul), and the logits and greedy tokens equal the NumPy Llama's
    (test_models) over the dequantised f32 weights. One layer (the loader's layer loop is
    test_gguf_llama_loads_unpermuted_and_dequantised's): its q and k packed but not v, so the
    graph is the unfused one; then every packable projection packed: the fused one."""
    from dataclasses import replace
    from test_models import np_greedy, np_llama
    cfg = replace(CFG, num_hidden_layers=1)
    params = hf_params(cfg, 5)
    q8 = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
          "model.layers.0.mlp.up_proj.weight", "model.layers.0.self_attn.o_proj.weight",
          "model.embed_tokens.weight")
    path = tmp_path / "packed.gguf"
    write_gguf(path, cfg, params, q8=q8)
    deq = LlamaForCausalLM.from_gguf(path).params       # the dequantised f32 weights
    m = LlamaForCausalLM.from_gguf(path, weights="gguf", exec_mode="stream")
    assert sorted(m.packed) == sorted(q8) and all(s == "q8_0" for s, _ in m.packed.values())
    ids = np.array([[5, 17, 200, 3]], np.int32)
    want = np_llama(cfg, deq, ids)
    exe = m.executable("forward", 1, 4)
    (got,) = exe.run({"input_ids": ids})
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    g = exe.graph
    quantised = [n for n in g.nodes if n.op == "param" and str(n.dtype) == "u8"]
    # layer 0's q and k are packed but v is not: the unfused graph (one product a projection)
    assert sorted(n.name for n in quantised) == sorted(q8)
    # 4 rows of x: the GEMV path; the tied head too, and the token lookup dequantises rows
    assert sum(n.op == "dequant_matmul" for n in g.nodes) == 5
    assert sum(n.op == "dequantize" and n.attrs["gather"] for n in g.nodes) == 1
    # every projection of a pack packed with one scheme: the fused graph
    all_q8 = tuple(k for k in params if k.endswith("_proj.weight") and not k.endswith("down_proj.weight"))
    write_gguf(tmp_path / "all.gguf", cfg, params, q8=all_q8)
    deq2 = LlamaForCausalLM.from_gguf(tmp_path / "all.gguf").params
    m2 = LlamaForCausalLM.from_gguf(tmp_path / "all.gguf", weights="gguf", exec_mode="stream")
    exe2 = m2.executable("forward", 1, 4)
    names = {n.name for n in exe2.graph.nodes if n.op == "param" and str(n.dtype) == "u8"}
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.mlp.gate_up_proj.weight" in names
    want2 = np_llama(cfg, deq2, ids)
    (got2,) = exe2.run({"input_ids": ids})
    np.testing.assert_allclose(got2, want2, rtol=0, atol=1e-4 * np.abs(want2).max())
    assert m.generate(ids[0], max_new_tokens=2).tolist() == np_greedy(cfg, deq, ids, 2)[0].tolist()
    with pytest.raises(ValueError, match="weights='gguf' comes from from_gguf"):
        LlamaForCausalLM(CFG, params, weights="gguf")


def test_gguf_reader_matches_the_gguf_package(tmp_path):
    """GGUFFile reads the file itself (models/weights.py: gguf.GGUFReader took seconds over a
    real vocabulary): every metadata value and every tensor (type, dims, bytes) as
    gguf.GGUFReader gives them, on a file with scalars of each type, arrays of numbers,
    strings and bools, Q8_0 / F16 / F32 / I32 tensors and a non-default alignment."""
    params = hf_params(CFG, 7)
    path = tmp_path / "meta.gguf"
    q8 = ("model.layers.0.mlp.up_proj.weight",)
    write_gguf(path, CFG, params, q8=q8, f16=("model.layers.1.self_attn.v_proj.weight",),
               extra={"rope_freqs_like": np.arange(5, dtype=np.int32)}, more_meta=True)
    f = GGUFFile(path)
    ref = gguf.GGUFReader(str(path))
    want = {k: fld.contents() for k, fld in ref.fields.items() if not k.startswith("GGUF.")}
    assert f.metadata.keys() == want.keys()
    for k, v in want.items():
        assert f.metadata[k] == v and type(f.metadata[k]) is type(v), k
    assert f.get("test.alignment_used") == 64 and f.get("general.alignment") == 64
    assert f.names == [t.name for t in ref.tensors]
    for t in ref.tensors:
        assert f.type_name(t.name) == t.tensor_type.name
        assert f.shape(t.name) == tuple(int(d) for d in reversed(t.shape.tolist()))
        assert f.raw(t.name).tobytes() == np.asarray(t.data).tobytes()
    assert f.raw(gguf_name(q8[0])).shape == (44, 32 // 32 * 34)


def test_dequantize_blocks_equal_the_gguf_package():
    """weights.dequantize_blocks (whole-array numpy) against gguf.quants.dequantize (llama.cpp's
    reference, per block group) value for value, on random blocks of every 32-weight scheme
    (7 rows of 3 blocks, random nibbles and fifth bits, finite f16 scales of both signs), and
    one q5_0 / q4_1 block worked by hand."""
    from gguf.quants import dequantize
    from rlx_numba.models.weights import LEGACY_BLOCKS, dequantize_blocks
    rng = np.random.default_rng(11)
    for scheme, (size, head) in LEGACY_BLOCKS.items():
        raw = rng.integers(0, 256, (7, 3, size), dtype=np.uint8)
        scales = rng.uniform(-2, 2, (7, 3, 2)).astype(np.float16)   # d (and m)
        raw[..., 0:2] = scales[..., :1].view(np.uint8)
        if scheme.endswith("_1"):
            raw[..., 2:4] = scales[..., 1:].view(np.uint8)
        raw = raw.reshape(7, 3 * size)
        want = dequantize(raw, getattr(gguf.GGMLQuantizationType, scheme.upper()))
        got = dequantize_blocks(raw, scheme)
        assert got.dtype == np.float32 and got.shape == (7 * 96,)
        np.testing.assert_array_equal(got, want.reshape(-1), err_msg=scheme)
    # q5_0 by hand: d = 0.5, qh with bits 0 and 31 set, nibbles 0x21 (low 1, high 2)
    blk = np.zeros(22, np.uint8)
    blk[0:2] = np.array([0.5], np.float16).view(np.uint8)
    blk[2:6] = np.array([1 | (1 << 31)], "<u4").view(np.uint8)
    blk[6:] = 0x21
    want = np.array([(1 + 16 - 16) * 0.5] + [(1 - 16) * 0.5] * 15
                    + [(2 - 16) * 0.5] * 15 + [(2 + 16 - 16) * 0.5])
    np.testing.assert_array_equal(dequantize_blocks(blk, "q5_0"), want)
    # q4_1 by hand: d = 0.25, m = -1, nibbles 0xF3: weights 0..15 -> 3 d + m, 16..31 -> 15 d + m
    blk = np.zeros(20, np.uint8)
    blk[0:4] = np.array([0.25, -1.0], np.float16).view(np.uint8)
    blk[4:] = 0xF3
    np.testing.assert_array_equal(dequantize_blocks(blk, "q4_1"), [-0.25] * 16 + [2.75] * 16)


def test_gguf_types_and_tensors_equal_the_gguf_package(tmp_path, monkeypatch):
    """weights._GGML_TYPES (ours, so that reading a GGUF imports no gguf package) names and
    sizes every type as gguf.constants does, a type missing from it comes from the package,
    and GGUFFile.tensor's F32 / F16 / BF16 / Q8_0 / Q4_K values equal gguf.quants.dequantize's
    of the tensors gguf.GGUFReader reads."""
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize
    from rlx_numba.models import weights
    for q in gguf.GGMLQuantizationType:
        t = weights._ggml_type(int(q))
        assert (t.id, t.name, t.block, t.type_size) == (int(q), q.name, *GGML_QUANT_SIZES[q])
    with monkeypatch.context() as mp:
        mp.delitem(weights._GGML_TYPES, 8)
        assert weights._ggml_type(8) == weights.GGMLType(8, "Q8_0", 32, 34)
    assert weights._ggml_type(999) is None
    rng = np.random.default_rng(5)
    w32 = rng.standard_normal((3, 256)).astype(np.float32)
    bf16 = w32.astype(ml_dtypes.bfloat16).view(np.uint8)
    Q = gguf.GGMLQuantizationType
    path = tmp_path / "types.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("f32", w32)
    w.add_tensor("f16", w32.astype(np.float16))
    w.add_tensor("bf16", bf16, raw_dtype=Q.BF16)
    w.add_tensor("q8_0", weights.quantize(w32, "q8_0"), raw_dtype=Q.Q8_0)
    w.add_tensor("q4_k", weights.quantize(w32, "q4_k"), raw_dtype=Q.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(path)
    for t in gguf.GGUFReader(str(path)).tensors:
        want = dequantize(np.asarray(t.data), t.tensor_type).reshape(3, 256)
        got = f.tensor(t.name)
        assert got.dtype == np.float32 and f.type_name(t.name) == t.tensor_type.name
        np.testing.assert_array_equal(got, want, err_msg=t.name)
    np.testing.assert_array_equal(f.tensor("bf16"),
                                  w32.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_gguf_load_imports_no_gguf_package(tmp_path):
    """from_gguf of F32 / F16 / Q8_0 tensors (our dequantisers) never imports the gguf
    package (0.16 s of a warm process's load on an H200 host): a fresh interpreter."""
    import subprocess
    import sys
    path = tmp_path / "tiny.gguf"
    write_gguf(path, CFG, hf_params(CFG, 4), q8=("model.layers.0.mlp.up_proj.weight",),
               f16=("model.layers.1.mlp.up_proj.weight",))
    code = ("import sys; from rlx_numba.models import LlamaForCausalLM; "
            f"m = LlamaForCausalLM.from_gguf({str(path)!r}); "
            "print(sorted(k for k in sys.modules if k.split('.')[0] == 'gguf'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]"


def test_gguf_tokenizer_built_on_first_use(tmp_path, monkeypatch):
    """from_gguf builds the vocabulary's tokenizer when it is first used (0.3-0.6 s for a 49k
    vocabulary that generating from token ids never needs), once, and only then decodes the
    tokens and merges; a vocabulary it cannot build is still reported at load (a warning, no
    tokenizer)."""
    from rlx_numba.models import llama, weights
    path = tmp_path / "tiny.gguf"
    write_gguf(path, CFG, hf_params(CFG, 2))
    built, decoded = [], []
    real = llama.gguf_tokenizer
    monkeypatch.setattr(llama, "gguf_tokenizer", lambda f: built.append(1) or real(f))
    real_decode = weights._Strings.decode
    monkeypatch.setattr(weights._Strings, "decode",
                        lambda s: decoded.append(s.n) or real_decode(s))
    m = LlamaForCausalLM.from_gguf(path)
    assert built == [] and decoded == [] and m.config.vocab_size == 265
    ids = m.encode("hello hello12")
    assert built == [1] and m.tokenizer is m.tokenizer and built == [1]
    assert sorted(decoded) == [6, 265]           # the merges, the tokens: once each
    assert m.decode(ids) == "hello hello12"
    assert m.quantized("q8_0").tokenizer is m.tokenizer
    bad = tmp_path / "spm.gguf"
    write_gguf(bad, CFG, hf_params(CFG, 2))
    data = bad.read_bytes().replace(b"gpt2", b"llam", 1)     # tokenizer.ggml.model 'llam'
    bad.write_bytes(data)
    with monkeypatch.context() as mp:
        records = []
        mp.setattr(llama.log, "warning", lambda msg, *a: records.append(msg % a))
        m2 = LlamaForCausalLM.from_gguf(bad)
    assert m2.tokenizer is None
    assert records and "tokenizer.ggml.model is 'llam'; only the byte-level BPE" in records[0]
