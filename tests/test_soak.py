"""tools/soak.py (issue 36's long-run check): its loop, rows and verdicts, on a stand-in model
(the real run is a GPU's: a model's generation in the simulator takes minutes)."""
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import soak  # noqa: E402


class Model:
    """generate / trainer / cached_executables, counting calls; ``leak`` graphs a call."""

    def __init__(self, leak=0):
        self.cached_executables, self.leak, self.calls = 1, leak, []

    def generate(self, ids, n):
        assert ids.shape[0] == 1 and 25 <= ids.shape[1] <= 32 and n == 2
        self.calls.append(("generate", ids.shape))
        self.cached_executables += self.leak
        return np.zeros((1, ids.shape[1] + n), np.int64)

    def trainer(self, batch, seq, opt):
        return SimpleNamespace(step=lambda ids: self.calls.append(("step", ids.shape)) or 1.0)


ARGS = ["--config", "tiny", "--tokens", "8", "--new", "2", "--steps", "3", "--train-batch", "2",
        "--seq", "8", "--every", "2"]


def test_soak_runs_and_reports_flat(monkeypatch, capsys):
    m = Model()
    monkeypatch.setattr(soak, "load_model", lambda name: (SimpleNamespace(vocab_size=97), m))
    assert soak.main(ARGS + ["--slack", "1e9"]) == 0
    assert [c[0] for c in m.calls] == ["generate"] * 4 + ["step"] * 3
    assert m.calls[-1] == ("step", (2, 8))
    out = capsys.readouterr().out
    assert "tokens: after warm-up host +" in out and out.count("flat") == 2


def test_soak_fails_on_growth(monkeypatch, capsys):
    monkeypatch.setattr(soak, "load_model", lambda name: (SimpleNamespace(vocab_size=97),
                                                          Model(leak=1)))
    assert soak.main(ARGS + ["--steps", "0", "--slack", "1e9"]) == 1
    assert "graphs +3: GREW" in capsys.readouterr().out
    grow = iter(range(0, 10**12, 10**8))
    monkeypatch.setattr(soak, "load_model", lambda name: (SimpleNamespace(vocab_size=97), Model()))
    monkeypatch.setattr(soak, "rss", lambda: next(grow))
    assert soak.main(ARGS + ["--steps", "0", "--slack", "1e6"]) == 1
    assert "GREW" in capsys.readouterr().out


def test_soak_compiles_and_drops_distinct_graphs(monkeypatch, capsys):
    """--graphs: distinct graphs (a product, a convolution, a solve) compiled, run and dropped
    in turn; live library handles must not grow at all."""
    monkeypatch.setattr(soak, "load_model", lambda name: (_ for _ in ()).throw(AssertionError))
    assert soak.main(["--graphs", "3", "--tokens", "0", "--steps", "0", "--every", "1"]) == 0
    out = capsys.readouterr().out
    assert "graphs: after warm-up host +" in out and "handles +0: flat" in out
    count = iter(range(100))
    monkeypatch.setattr(soak, "live_handles", lambda: next(count))
    assert soak.main(["--graphs", "3", "--tokens", "0", "--steps", "0", "--every", "1",
                      "--slack", "1e12"]) == 1
    assert "handles +2: GREW" in capsys.readouterr().out


def test_soak_trace_names_where_host_memory_grew(monkeypatch, capsys):
    """--trace N: after a phase, the places whose live allocations grew since the baseline,
    with the frames that made them (here a stand-in model that keeps 64 KiB a call)."""
    kept = []

    class Leaky(Model):
        def generate(self, ids, n):
            kept.append(bytearray(64 << 10))
            return super().generate(ids, n)

    monkeypatch.setattr(soak, "load_model", lambda name: (SimpleNamespace(vocab_size=97), Leaky()))
    assert soak.main(ARGS + ["--steps", "0", "--slack", "1e9", "--trace", "3"]) == 0
    out = capsys.readouterr().out
    assert "KiB in" in out and "kept.append(bytearray(64 << 10))" in out, out
