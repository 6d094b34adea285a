"""A seeded slice of the differential fuzzer (tools/fuzz.py): random graphs through the public
Graph API, every node checked against the fuzzer's own NumPy evaluator. Small enough for CI
under the simulator; `python -m tools.fuzz --n 200` runs more."""
import numpy as np

from tools import fuzz

# tiny graphs and tensors, the two exec modes that differ under the simulator
CI = fuzz.Config(dtypes=("f32", "f16", "bf16", "i32"), modes=("stream", "eager"), max_nodes=6,
                 max_size=48)


def test_fuzz_slice_has_no_findings():
    lines = []
    rep = fuzz.fuzz(40, 2024, CI, out=lines.append)
    assert rep.graphs >= 35 and rep.runs >= 4 * rep.graphs
    assert not rep.findings, "\n\n".join(rep.findings)


def test_fuzz_slice_halves_and_views():
    """Half-precision elementwise, reductions and view ops only (the rounding rules)."""
    cfg = fuzz.Config(dtypes=("f16", "bf16"), modes=("stream",), max_nodes=6, max_size=48,
                      ops=("unary", "binary", "reduce", "reshape", "narrow", "softmax", "norm"))
    rep = fuzz.fuzz(8, 7, cfg, out=lambda s: None)
    assert rep.graphs >= 6
    assert not rep.findings, "\n\n".join(rep.findings)


def test_fuzz_detects_a_wrong_result(monkeypatch):
    """A reference that is off by one makes findings, each with its reproducer."""
    for k in fuzz.BINARY:
        monkeypatch.setitem(fuzz.BINARY, k, lambda a, b: np.add(a, b) + 1.0)
    cfg = fuzz.Config(dtypes=("f32",), modes=("stream",), max_nodes=2, max_size=24,
                      ops=("binary",))
    lines = []
    rep = fuzz.fuzz(3, 0, cfg, out=lines.append)
    assert rep.findings and len(lines) == len(rep.findings)
    assert "python -m tools.fuzz --seed 0 --only" in rep.findings[0]
    assert "beyond tol" in rep.findings[0] and "graph 'fuzz_0_" in rep.findings[0]


def test_fuzz_cli_exit_status(monkeypatch, capsys):
    args = ["--n", "2", "--seed", "3", "--modes", "stream", "--max-nodes", "2", "--max-size",
            "24", "--ops", "binary", "--dtypes", "f32"]
    assert fuzz.main(args) == 0
    for k in fuzz.BINARY:                                      # wrong on purpose
        monkeypatch.setitem(fuzz.BINARY, k, lambda a, b: np.add(a, b) + 1.0)
    assert fuzz.main(args) == 1
    out = capsys.readouterr().out
    assert "FINDING seed=3 graph=" in out and "finding(s)" in out
