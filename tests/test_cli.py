"""`rlx-numba demo --train` (rlx_numba/models/tiny_lm.py, examples/train_tiny_llama.py's body):
a few steps of the tiny byte-level Llama, in this process. (`info` and `demo` run in fresh
processes in test_device.py.)"""
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rlx_numba.cli import main
from rlx_numba.models.tiny_lm import lr_at, main as train_main, tiny_config, train_tiny_llama


def test_demo_train_runs_and_learns(tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_bytes(b"the cat sat on the mat. " * 8)     # repetitive: two steps must help
    rc = main(["demo", "--train", "--text", str(text), "--steps", "2", "--sample", "0",
               "--out", str(tmp_path / "loss.png")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"text: {text} (192 bytes)" in out and "2 steps of" in out
    m = re.search(r"loss (\S+) -> (\S+) \(ln 256", out)
    assert m, out
    first, last = float(m.group(1)), float(m.group(2))
    assert math.isfinite(first) and math.isfinite(last)
    assert abs(first - math.log(256)) < 0.2        # std 0.02 init: about uniform over bytes
    assert last < first, out


def test_demo_train_argument_errors(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["demo", "--train", "--model", "minilm"])
    assert "--train and --model are exclusive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["demo", "--train", "--text", str(tmp_path / "missing.txt")])
    assert "missing.txt: no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_main(["--hidden", "18"])
    assert "train_tiny_llama: hidden must be a multiple of 4" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"train_tiny_llama: the text has 5 bytes; a window of "
                                         r"seq 8 needs at least 9"):
        train_tiny_llama(b"short", steps=1, batch=1, seq=8, hidden=16, layers=1, lr=1e-2)
    with pytest.raises(ValueError, match="train_tiny_llama: steps must be an int >= 1, got 0"):
        train_tiny_llama(b"x" * 64, steps=0, batch=1, seq=8, hidden=16, layers=1, lr=1e-2)
    with pytest.raises(ValueError, match="train_tiny_llama: hidden must be a multiple of 4"):
        tiny_config(18, 1, 8)


def test_tiny_config_and_schedule():
    cfg = tiny_config(128, 4, 128)
    assert (cfg.vocab_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.max_position_embeddings) == (256, 8, 4, 16, 344, 256)
    assert cfg.tie_word_embeddings
    lrs = np.array([lr_at(s, 100, 1e-3) for s in range(100)])
    assert np.allclose(lrs[:10], 1e-3 * np.arange(1, 11) / 10)       # warm-up
    assert lrs[10] == pytest.approx(1e-3) and np.all(np.diff(lrs[10:]) < 0)
    assert lrs[-1] > 1e-4                                                # decays towards lr/10


def test_example_script_help():
    script = Path(__file__).resolve().parents[1] / "examples" / "train_tiny_llama.py"
    r = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    for arg in ("--text", "--steps", "--batch", "--seq", "--hidden", "--layers", "--lr", "--out"):
        assert arg in r.stdout, arg


def test_info_weights_bytes_by_format(tmp_path, capsys):
    """`rlx-numba info --weights F`: a file's bytes by format from its header, against sizes
    worked out here (Q8_0: 34 bytes a block of 32)."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import quantize
    rng = np.random.default_rng(0)
    path = tmp_path / "w.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    q = quantize(rng.standard_normal((6, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("a", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("b", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("c", rng.standard_normal(7).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert main(["info", "--weights", str(path)]) == 0
    out = capsys.readouterr().out
    from rlx_numba.models.weights import weight_formats
    got = weight_formats(path)
    assert got == {"Q8_0": {"tensors": 1, "bytes": 6 * 2 * 34, "f32_bytes": 6 * 64 * 4},
                   "F32": {"tensors": 1, "bytes": 60, "f32_bytes": 60},
                   "F16": {"tensors": 1, "bytes": 14, "f32_bytes": 28}}
    assert re.search(r"Q8_0\s+1\s+0\.0\s+0\.0", out) and "total" in out
    st = pytest.importorskip("safetensors.numpy")
    st.save_file({"x": np.zeros((4, 8), np.float16), "y": np.zeros(3, np.float32)},
                 str(tmp_path / "model.safetensors"))
    assert weight_formats(tmp_path) == {"F16": {"tensors": 1, "bytes": 64, "f32_bytes": 128},
                                        "F32": {"tensors": 1, "bytes": 12, "f32_bytes": 12}}
    assert main(["info", "--weights", str(tmp_path / "missing.gguf")]) == 2
    assert "info --weights" in capsys.readouterr().err


def test_warmup_compiles_a_gguf_model(tmp_path, capsys):
    """`rlx-numba warmup MODEL`: loads a GGUF model and generates from a dummy prompt (its
    prefill and decode graphs compiled); bad arguments and paths are errors."""
    pytest.importorskip("gguf")
    from test_loaders import CFG, write_gguf
    from rlx_numba.models import LlamaForCausalLM
    path = tmp_path / "tiny.gguf"
    write_gguf(path, CFG, LlamaForCausalLM.from_config(CFG, seed=0).params)
    assert main(["warmup", str(path), "--prompt-len", "3", "--new", "1"]) == 0   # (prefill only:
    out = capsys.readouterr().out                                 # the simulator is slow)
    assert re.search(r"warmup .*tiny\.gguf: loaded in [\d.]+ s; prefill of 1 x 3 and 0 decode "
                     r"steps compiled and run", out)
    assert "kernel cache" in out
    assert main(["warmup", str(tmp_path / "none.bin")]) == 2
    assert "neither a .gguf file nor a model folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["warmup", str(path), "--new", "0"])
    assert "--new must be >= 1, got 0" in capsys.readouterr().err


def test_warmup_weights_argument(tmp_path, capsys):
    """`rlx-numba warmup --weights`: f32 or gguf (from_gguf's weights=), gguf only for a .gguf
    file; anything else is refused by the parser."""
    with pytest.raises(SystemExit):
        main(["warmup", str(tmp_path), "--weights", "q4"])
    assert "invalid choice: 'q4'" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    assert main(["warmup", str(tmp_path), "--weights", "gguf"]) == 2
    assert "--weights gguf is for a .gguf file" in capsys.readouterr().err
