"""The op registry (ir/opdef.py): every op declared once with inference, memory kind, dtype
rule and tiers; Graph.bind; the tier runner; `rlx-numba info --ops`."""
import ast
import logging
import re
from pathlib import Path

import numpy as np
import pytest

import rlx_numba as rlx
from rlx_numba.ir import dtypes as dt
from rlx_numba.ir import opdef as od
from rlx_numba.runtime import lower

PKG = Path(rlx.__file__).parent


def _op_literals():
    """(file, line, op) for every op name the package builds nodes of: the first argument of
    bind / _add calls and of defop, when it is a string literal."""
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("bind", "_add") and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)):
                yield path.relative_to(PKG), node.lineno, node.args[0].value


def test_every_op_is_declared_with_inference_memory_dtype_rule_and_tiers():
    bad = []
    for name, d in od.OPS.items():
        if d.owner == "undeclared" or not callable(d.infer):
            bad.append(f"{name}: no defop (tiers or a VJP registered on an undeclared op)")
        if d.memory not in od.MEMORY_KINDS or d.dtype_rule not in od.DTYPE_RULES:
            bad.append(f"{name}: memory {d.memory!r} / dtype rule {d.dtype_rule!r}")
        always_view = d.memory == od.VIEW and d.view_if is None
        if d.memory != od.LEAF and not always_view and not d.tiers:
            bad.append(f"{name}: computes but has no tier")
        if d.written_by is None and any(r not in od.OPS or od.OPS[r].written_by is None
                                        for r, _ in d.results):
            bad.append(f"{name}: a further result whose op is not filled by its producer")
    assert not bad, "\n".join(bad)


def test_every_op_built_in_the_package_is_declared():
    missing = [f"{f}:{line} builds {op!r}" for f, line, op in _op_literals() if op not in od.OPS]
    assert not missing, "\n".join(missing)


def test_an_op_is_declared_once():
    with pytest.raises(ValueError, match="op 'binary' is already declared"):
        od.defop("binary", od.same_as())
    with pytest.raises(ValueError, match="memory must be one of"):
        od.defop("test_bad_memory_kind", od.same_as(), memory="heap")
    assert "test_bad_memory_kind" not in od.OPS


@pytest.fixture
def two_result_op():
    """A throwaway op with two results, the second filled by the first's kernel."""
    def infer(x, *, k):
        if k < 1:
            raise ValueError(f"test_split: k must be >= 1, got {k}")
        return [(x.shape, x.dtype), ((x.shape[0], k), dt.I64)]
    od.defop("test_split_side", od.same_as(), written_by=0, doc="the second result")
    od.defop("test_split", infer, results=(("test_split_side", None),), doc="two results")
    yield "test_split"
    od.OPS.pop("test_split")
    od.OPS.pop("test_split_side")


def test_bind_returns_every_result_and_links_them_to_their_producer(two_result_op):
    g = rlx.Graph("b")
    x = g.input("x", (3, 5), "f16")
    y, idx = g.bind(two_result_op, [x], k=2)
    assert (y.shape, y.dtype, idx.shape, idx.dtype) == ((3, 5), dt.F16, (3, 2), dt.I64)
    assert idx.node.inputs == (y.id,) and y.node.results == [idx.id]
    assert y.node.attrs == {"k": 2}
    with pytest.raises(ValueError, match="test_split: k must be >= 1, got 0"):
        g.bind(two_result_op, [x], k=0)


def test_bind_checks_the_op_and_its_inputs():
    g, h = rlx.Graph("a"), rlx.Graph("b")
    x, z = g.input("x", (2, 3)), h.input("z", (2, 3))
    with pytest.raises(ValueError, match="unknown op 'no_such_op'"):
        g.bind("no_such_op", [x])
    with pytest.raises(ValueError, match="bind: param is a leaf"):
        g.bind("param", [])
    with pytest.raises(ValueError, match=r"binary: inputs\[1\] .* belongs to graph 'b'"):
        g.bind("binary", [x, z], kind="add")
    with pytest.raises(ValueError, match=r"add: shapes do not broadcast: a \[2, 3\], b \[4\]"):
        g.bind("binary", [x, g.input("w", (4,))], kind="add")
    t = g.bind("binary", [x, x], kind="mul")        # the same node the builder makes
    assert (t.node.op, t.node.attrs, t.shape, t.dtype) == ("binary", {"kind": "mul"}, (2, 3),
                                                          dt.F32)


def test_graph_rewrite_keeps_results_linked(two_result_op):
    g = rlx.Graph("r")
    x = g.input("x", (4, 3))
    y, s = g.bind(two_result_op, [x], k=1)
    g.set_outputs([g.gelu(y), s])
    moved = {}
    c = g.rewritten(lambda g2, n, ins: None, moved)
    assert c.nodes[moved[y.id].id].results == [moved[s.id].id]


class _Ctx:
    graph = None


def test_tier_runner_order_availability_env_and_log(monkeypatch, caplog):
    od.defop("test_tiered", od.same_as(), doc="three tiers")
    try:
        ran = []
        od.add_tier("test_tiered", od.Tier("first", lambda c, n: ran.append(1) or ["s1"],
                                           lambda c, n: "no device for it"))
        od.add_tier("test_tiered", od.Tier("second", lambda c, n: None))   # does not apply
        od.add_tier("test_tiered", od.Tier("third", lambda c, n: ["s3"]))
        od.OPS["test_tiered"].tier_env = "RLX_NUMBA_TEST_TIERS"
        g = rlx.Graph("t")
        n = g.bind("test_tiered", [g.input("x", (2,))]).node
        monkeypatch.setenv("RLX_NUMBA_LOG_FALLBACK", "1")
        with caplog.at_level(logging.WARNING, logger="rlx_numba"):
            assert lower.plan_node(_Ctx(), n) == ["s3"] and ran == []
        assert ("test_tiered tier 2 (third); tier 0 (first): no device for it; "
                "tier 1 (second): does not apply") in caplog.text
        monkeypatch.setenv("RLX_NUMBA_TEST_TIERS", "1")
        with pytest.raises(NotImplementedError, match=r"no tier of test_tiered runs node %1: "
                           r"tier 0 \(first\) not allowed by RLX_NUMBA_TEST_TIERS"):
            lower.plan_node(_Ctx(), n)
        monkeypatch.setenv("RLX_NUMBA_TEST_TIERS", "7")
        with pytest.raises(ValueError, match="RLX_NUMBA_TEST_TIERS='7': expected a comma-"
                                             "separated subset of 0 \\(first\\)"):
            lower.plan_node(_Ctx(), n)
        with pytest.raises(ValueError, match="tier 'third' registered twice"):
            od.add_tier("test_tiered", od.Tier("third", lambda c, n: []))
    finally:
        od.OPS.pop("test_tiered")


def test_vjp_and_lowering_tables_are_views_of_the_opdefs():
    from rlx_numba.ir import autodiff
    assert autodiff.VJPS["binary"] is od.OPS["binary"].vjp
    assert lower.LOWERINGS["softmax"] is od.OPS["softmax"].tiers[0].plan
    assert "reshape" not in autodiff.VJPS or od.OPS["reshape"].vjp is not None
    with pytest.raises(ValueError, match="op binary already has a VJP"):
        autodiff.vjp("binary")(lambda g, n, dy: [dy, dy])


def test_info_ops_lists_every_op(capsys):
    from rlx_numba.cli import main
    assert main(["info", "--ops"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == f"{len(od.OPS)} ops"
    listed = {line.split()[0] for line in out[1:-1]}
    assert listed == set(od.OPS)
    conv = next(line for line in out if line.startswith("conv "))
    assert re.search(r"cuDNN > im2col .* \(rewrite\) > .*implicit-GEMM.*\[RLX_NUMBA_CONV_TIERS\]",
                     conv), conv
    assert re.search(r"^reshape\s+ops\s+view\s+storage \+c64\s+yes", "\n".join(out), re.M)
