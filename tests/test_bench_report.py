"""bench/report.py builds its report from the JSON the benches write (no GPU): rows in the
shapes bench_models / bench_attention / bench_train / bench_control / bench_runtime /
bench_custom_op / bench_matmul give them, the Markdown tables, the charts and --compare."""
import json
import math
import shlex
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the repo root: bench/ is no
from bench import common, report  # noqa: E402                   # installed package

pytest.importorskip("matplotlib")
GPU = "NVIDIA H100 80GB HBM3"


def write_results(d: Path, decode_b1=890.0):
    docs = {
        "models": {"gpu": GPU, "rows": [
            dict(model="llama-1b", dtype="bf16", phase="decode", batch=1, rlx_per_s=decode_b1,
                 eager_per_s=85.0, ratio=decode_b1 / 85, bar=">= 971/s", **{"pass": decode_b1 >= 971}),
            dict(model="llama-1b", dtype="bf16", phase="decode", batch=8, rlx_per_s=5181.0,
                 eager_per_s=666.0, ratio=7.78, bar=">= 4x eager", **{"pass": True})]},
        "attention": {"gpu": GPU, "copy_gbps": 3000.0, "results": [
            dict(shape=f"B8 H32 S{s} D128 causal", rlx_ms=1.0, torch_ms=0.5 * s / 1024,
                 rlx_tflops=100.0 * s / 1024, torch_tflops=200.0, ratio=0.5, bar=0.8,
                 **{"pass": False}) for s in (1024, 4096)]},
        "train": {"gpu": GPU, "rows": [
            dict(case="llama train step", precision="bf16", batch=8, seq=256, rlx_tok_s=52000.0,
                 eager_tok_s=39000.0, compile_tok_s=40000.0, ratio=1.33, bar=1.3, **{"pass": True}),
            dict(case="llama train step memory", batch=8, seq=256, rlx_bytes=100, torch_bytes=200,
                 ratio=0.5, bar="<= 1.0x torch", **{"pass": True})]},
        "control": {"gpu": GPU, "rows": [
            dict(op="scan_rnn", steps=1024, batch=64, hidden=512, rlx_ms=24.34, torch_ms=57.52,
                 ratio=2.36, bar=">= 2x", **{"pass": True})]},
        "runtime": {"gpu": GPU, "rows": [], "bars": [
            dict(name="warm process start vs cold (AOT)", value=3.1, bar=">= 2x", passed=True)]},
        "custom_op": {"gpu": GPU, "rows": [{"name": "custom op step", "ms": 0.11, "gbps": 1219.4}],
                      "ratio": 0.994, "bar": 1.1, "pass": True},
        "matmul": {"gpu": GPU, "results": [dict(tier=5, shape="4096x4096x4096",
                                                error="CUDA_ERROR_ILLEGAL_ADDRESS",
                                                **{"pass": False})]},
    }
    d.mkdir(parents=True, exist_ok=True)
    for fam, doc in docs.items():
        (d / f"{fam}.json").write_text(json.dumps(doc))
    (d / "meta.json").write_text(json.dumps(dict(gpu=GPU, driver="580.159.04",
                                                 versions={"torch": "2.11.0"},
                                                 date="2026-11-28 00:00 UTC", commit="abc1234",
                                                 dirty=False)))


def test_report_tables_charts_and_records(tmp_path):
    res, out = tmp_path / "results", tmp_path / "report"
    write_results(res)
    assert report.main(["--no-run", "--results", str(res), "--out", str(out)]) == 0
    md = (out / "README.md").read_text()
    assert "NVIDIA H100 80GB HBM3, driver 580.159.04; torch 2.11.0" in md
    assert "commit abc1234" in md
    for fam in ("models", "attention", "train", "control", "runtime", "custom_op", "matmul"):
        assert f"## {fam}" in md
    assert md.index("## models") < md.index("## train") < md.index("## attention")
    # a row: its label, ours, the peer named, x peer computed from the pair, the bench's bar
    assert ("| llama-1b decode bf16 batch=1 | per s | 890 | 85 (eager) | 10.47x | 10.5 | "
            ">= 971/s | **FAIL** |") in md
    assert "| scan_rnn batch=64 steps=1024 | ms | 24.3 | 57.5 (torch) | 2.36x |" in md
    # memory: less is better, so x peer is torch's bytes over ours
    assert "| llama train step memory batch=8 seq=256 | bytes | 100 | 200 (torch) | 2.00x |" in md
    assert "| warm process start vs cold (AOT) | value | 3.1 | - | - | - | >= 2x | PASS |" in md
    assert "ERROR: CUDA_ERROR_ILLEGAL_ADDRESS" in md
    assert "**6 of 10 rows with a bar pass.**" in md
    for png in ("families.png", "ratios.png", "decode.png", "train.png", "attention.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
        assert f"![{png}]({png})" in md
    rows = json.loads((out / "report.json").read_text())["rows"]
    att = [r for r in rows if r["family"] == "attention"]
    assert [r["seq"] for r in att] == [1024, 4096] and att[1]["better"] == pytest.approx(2.0)


def test_compare_lists_regressions_first(tmp_path, capsys):
    old_res, new_res = tmp_path / "old", tmp_path / "new"
    write_results(old_res, decode_b1=1000.0)
    report.build(old_res, tmp_path / "old_report")
    write_results(new_res, decode_b1=890.0)
    doc = json.loads((new_res / "control.json").read_text())
    doc["rows"][0]["torch_ms"] = 80.0                 # the peer slower: we moved ahead
    (new_res / "control.json").write_text(json.dumps(doc))
    (new_res / "vision.json").write_text(json.dumps({"gpu": GPU, "results": [
        dict(model="resnet50", dtype="bf16", rlx_per_s=7000.0, torch_per_s=7100.0)]}))
    report.build(new_res, tmp_path / "report")
    assert report.main(["--out", str(tmp_path / "report"), "--compare",
                        str(tmp_path / "old_report" / "report.json")]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("FAIL now  models: llama-1b decode bf16 batch=1")
    assert lines[1].startswith("faster    control: scan_rnn")
    assert lines[-1] == "new       vision: resnet50 bf16"


def test_errors(tmp_path):
    with pytest.raises(SystemExit):
        report.main(["--no-run", "--only", "nonsense"])
    with pytest.raises(SystemExit, match="no bench results"):
        report.build(tmp_path / "empty", tmp_path / "out")


FAKE_BENCH = """import argparse, json, os, sys, time
from pathlib import Path
p = argparse.ArgumentParser(); p.add_argument("--out", type=Path); p.add_argument("--tag")
a = p.parse_args()
how = {how!r}
if how == "slow":
    time.sleep(30)
if how == "partial":         # two rows through the shared writer, then past its time limit
    sys.path.insert(0, {bench!r})
    from common import Results
    rows = []
    out = Results(a.out, gpu="G", bar=0.9, results=rows)
    for op, ms in (("sub", 1.0), ("div", 4.0)):
        rows.append({{"op": op, "rlx_ms": ms, "torch_ms": 2.0, "ratio": 2.0 / ms,
                      "pass": ms < 2}})
        out.save()
    (a.out.parent / ("." + a.out.name + ".999.tmp")).write_text("{{")    # as if stopped mid-write
    time.sleep(30)
    out.done()
a.out.write_text(json.dumps({{"gpu": "G", "bar": 0.9, "tag": a.tag, "results": [
    {{"op": "add", "tc": True, "steps": 3.0, "rlx_ms": 1.0, "host_ms": 0.01, "torch_ms": 2.0,
      "ratio": 2.0, "pass": True}},
    {{"op": "mul", "tc": False, "rlx_ms": 2.0, "torch_ms": 1.0, "ratio": 0.5, "pass": False}}]}}))
sys.exit(3 if how == "crash" else 0)
"""


def test_run_records_timeouts_and_failures(tmp_path, monkeypatch):
    """run_benches runs each bench with --out, removes a family's old JSON first, stops one past
    --timeout and writes <family>.run.json (status, seconds, whether it wrote); the report shows
    a failed or stopped family under its heading, a crash after writing keeps its rows; a doc's
    bar applies to its rows; the peer is a peer (host_ms is not); labels name true flags."""
    benches = []
    for how in ("ok", "slow", "partial", "crash"):
        path = tmp_path / f"bench_{how}.py"
        path.write_text(FAKE_BENCH.format(how=how, bench=str(report.HERE)))
        benches.append((how, f"{shlex.quote(str(path))} --tag {how}-args"))   # a script's arguments
    monkeypatch.setattr(report, "BENCHES", benches)
    res, out = tmp_path / "results", tmp_path / "report"
    res.mkdir()
    (res / "slow.json").write_text(json.dumps({"gpu": "G", "results": [{"op": "stale"}]}))
    status = report.run_benches(None, False, res, timeout=5)
    assert status == {"ok": 0, "slow": report.TIMED_OUT, "partial": report.TIMED_OUT,
                      "crash": 3}
    assert not (res / "slow.json").exists()            # the old rows went, none came back
    runs = report.runs_of(res)
    assert runs["slow"]["status"] == 124 and runs["slow"]["wrote"] is False
    assert runs["slow"]["rows"] == 0 and runs["slow"]["complete"] is None
    assert (runs["partial"]["status"], runs["partial"]["wrote"], runs["partial"]["rows"],
            runs["partial"]["complete"]) == (124, True, 2, False)
    assert runs["crash"]["rows"] == 2 and runs["crash"]["complete"] is None   # it does not say
    assert not list(res.glob(".*.tmp"))
    assert runs["slow"]["timeout"] == 5 and runs["slow"]["seconds"] >= 5
    assert runs["crash"]["status"] == 3 and runs["crash"]["wrote"] is True
    assert set(runs["ok"]) >= {"gpu", "commit", "date", "versions", "seconds"}
    assert json.loads((res / "ok.json").read_text())["tag"] == "ok-args"
    report.build(res, out)
    md = (out / "README.md").read_text()
    slow = md[md.index("## slow"):md.index("## partial")]
    assert "**stopped by its 5 s time limit**, no results" in slow and "No rows." in slow
    # the partial bench: its two rows, under a line saying where it stopped
    part = md[md.index("## partial"):md.index("## crash")]
    assert ("**stopped by its 5 s time limit after 2 rows**; the rows below are those it "
            "finished") in part
    assert "| sub | ms | 1 | 2 (torch) | 2.00x | 2 | 0.9 | PASS |" in part
    assert "| div | ms | 4 | 2 (torch) | 0.50x | 0.5 | 0.9 | **FAIL** |" in part
    assert "Stopped before their end, so only the rows they finished: partial." in md
    assert "**exited with status 3** after writing its results" in md
    assert "| add tc steps=3 | ms | 1 | 2 (torch) | 2.00x | 2 | 0.9 | PASS |" in md
    assert "| mul | ms | 2 | 1 (torch) | 0.50x | 0.5 | 0.9 | **FAIL** |" in md
    assert "**3 of 6 rows with a bar pass.**" in md     # the partial family's rows counted


def test_readme_block(tmp_path):
    """--readme rewrites only the text between the markers: a line a family, the chart."""
    res, out = tmp_path / "results", tmp_path / "report"
    write_results(res)
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{report.README_START}\nold\n{report.README_END}\nafter\n")
    assert report.main(["--no-run", "--results", str(res), "--out", str(out),
                        "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("intro\n" + report.README_START) and text.endswith(
        report.README_END + "\nafter\n") and "old" not in text
    assert "| models | 1 of 2 | 10.47x | - |" in text      # no run record: no date
    assert "families.png)" in text
    # the whole-model rows first (a rate against a peer), with their bar's verdict
    head = text.index("Whole models")
    assert head < text.index("| family |")
    assert ("| llama-1b decode bf16 batch=1 (per s) | 890 | 85 (eager) | 10.47x | >= 971/s: "
            "**FAIL** |") in text
    readme.write_text("no markers\n")
    with pytest.raises(SystemExit, match="no <!-- bench-report:start -->"):
        report.main(["--no-run", "--results", str(res), "--out", str(out),
                     "--readme", str(readme)])


def test_pack_puts_results_and_report_in_one_archive(tmp_path):
    """--pack: every result file and the report in one .tar.gz (a remote GPU machine returns
    only a few files), under the directories' own names."""
    import tarfile
    res, out, arc = tmp_path / "results", tmp_path / "report", tmp_path / "bench.tar.gz"
    write_results(res)
    assert report.main(["--no-run", "--results", str(res), "--out", str(out),
                        "--pack", str(arc)]) == 0
    with tarfile.open(arc) as tar:
        names = set(tar.getnames())
    assert {f"results/{p.name}" for p in res.iterdir()} <= names
    assert {"report/README.md", "report/report.json", "report/families.png"} <= names


def test_partial_family_in_readme_block_and_compare(tmp_path, capsys):
    """A JSON with complete=false beside a run record of status 124, no subprocess: the README
    block says after how many rows it stopped; --compare says a row the stopped run did not
    reach is not reached rather than gone, and a complete family is not marked."""
    old_res, new_res = tmp_path / "old", tmp_path / "new"
    write_results(old_res)
    report.build(old_res, tmp_path / "old_report")
    write_results(new_res)
    doc = json.loads((new_res / "attention.json").read_text())
    doc.update(complete=False, results=doc["results"][:1])     # its first row only
    (new_res / "attention.json").write_text(json.dumps(doc))
    (new_res / "attention.run.json").write_text(json.dumps(dict(
        gpu=GPU, date="2026-11-28 01:00 UTC", commit="abc1234", seconds=220.4, status=124,
        timeout=220, wrote=True, rows=1, complete=False)))
    readme = tmp_path / "README.md"
    readme.write_text(f"{report.README_START}\n{report.README_END}\n")
    assert report.main(["--no-run", "--results", str(new_res), "--out", str(tmp_path / "report"),
                        "--readme", str(readme)]) == 0
    md = (tmp_path / "report" / "README.md").read_text()
    att = md[md.index("## attention"):md.index("## matmul")]
    assert ("_220 s; **stopped by its 220 s time limit after 1 row**; the rows below are those "
            "it finished_") in att          # (the header names its date and commit: the newest)
    assert "| B8 H32 S1024 D128 causal |" in att and "S4096" not in att
    assert "**6 of 9 rows with a bar pass.**" in md     # (10 complete): the row not reached
    assert "| attention | 0 of 1 | 0.50x | 2026-11-28 01:00 UTC, abc1234, timed out, " \
           "stopped after 1 row |" in readme.read_text()
    assert json.loads((tmp_path / "report" / "report.json").read_text())["unfinished"] == \
        ["attention"]
    capsys.readouterr()
    assert report.main(["--out", str(tmp_path / "report"), "--compare",
                        str(tmp_path / "old_report" / "report.json")]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines == ["gone      attention: B8 H32 S4096 D128 causal (this run stopped before it)"]


def test_results_writer_leaves_valid_json_after_each_row(tmp_path, monkeypatch):
    """common.Results: after each save the file is whole JSON with the rows so far, the bench's
    own fields and complete=false; done() sets complete=true; NaN becomes null; a write that
    fails before its rename leaves the last good file and no temporary one."""
    path = tmp_path / "sub" / "fam.json"
    rows = []
    out = common.Results(path, gpu="G", copy_gbps=3000.0, results=rows)
    assert not path.exists()                 # nothing written before a row
    for i in range(3):
        rows.append(dict(op=f"op{i}", rlx_ms=float(i + 1), err=math.nan if i == 1 else 0.0))
        out.save()
        doc = json.loads(path.read_text())
        assert doc == dict(gpu="G", copy_gbps=3000.0, complete=False, results=[
            dict(op=f"op{j}", rlx_ms=float(j + 1), err=None if j == 1 else 0.0)
            for j in range(i + 1)])
    out.save(sweep=[1, 2])                   # a field added part way
    assert json.loads(path.read_text())["sweep"] == [1, 2]

    def fail(src, dst):
        raise OSError("disk full")
    monkeypatch.setattr(common.os, "replace", fail)
    rows.append(dict(op="op3"))
    with pytest.raises(OSError, match="disk full"):
        out.save()
    assert len(json.loads(path.read_text())["results"]) == 3      # the last good file
    assert sorted(p.name for p in path.parent.iterdir()) == ["fam.json"]
    monkeypatch.undo()
    out.done(ratio=1.5)
    doc = json.loads(path.read_text())
    assert doc["complete"] is True and doc["ratio"] == 1.5 and len(doc["results"]) == 4
    assert sorted(p.name for p in path.parent.iterdir()) == ["fam.json"]


def test_dirty_ignores_the_reports_own_output():
    """The header's "with local changes" counts changes outside bench/report/ only (the results
    and report being gathered there), renames by both names."""
    assert not report.dirty("")
    assert not report.dirty(" M bench/report/README.md\nM  bench/report/results/linalg.json\n"
                            "A  bench/report/results/signal.run.json")
    assert report.dirty(" M bench/report/README.md\n M rlx_numba/kernels/delta.py")
    assert report.dirty("MM bench/report.py")                 # the report's code is code
    assert report.dirty("R  bench/report/old.json -> bench/new.json")
    assert not report.dirty("R  bench/report/a.json -> bench/report/b.json")
    assert not report.dirty(' M "bench/report/results/odd name.json"')


def test_labels_and_the_unit_a_row_shows():
    """A row pairing ours with peers in several units shows its rate (a train row's first
    loss is paired too, and was shown as the row's figure); a vision row is named by its
    ``layer``, never by a list it holds; a tier reads "tier 2"; units read as words."""
    train = {"case": "llama train step", "precision": "f32", "batch": 8, "rlx_tok_s": 300.0,
             "eager_tok_s": 100.0, "rlx_loss0": 10.9, "torch_loss0": 10.9, "rlx_bytes": 5.0,
             "torch_bytes": 6.0}
    assert report._pair(train) == ("tok_s", 300.0, "eager", 100.0)
    assert report._label(train) == "llama train step f32 batch=8"
    vision = {"layer": "conv 3x3 b8", "steps": [["cudnn fwd", 71.3]], "rlx_us": 83.2,
              "torch_us": 74.6}
    assert report._label(vision) == "conv 3x3 b8" and report._pair(vision)[0] == "us"
    assert report._label({"tier": "2tf32", "shape": "1:64x64x64"}) == "tier 2tf32 1:64x64x64"
    memory = {"case": "memory", "rlx_bytes": 5.0, "torch_bytes": 6.0}
    assert report._pair(memory) == ("bytes", 5.0, "torch", 6.0)
    assert report.UNIT_TEXT["tflops"] == "TFLOP/s" and report.UNIT_TEXT["tok_s"] == "tok/s"


def test_results_run_parts_saves_after_each_and_counts(tmp_path, capsys):
    """run_parts runs the parts ``only`` names (None: all), rewrites the file after each (the
    first part's rows are on disk while the second runs), then writes it complete and says
    how many rows pass."""
    path, rows, seen = tmp_path / "b.json", [], []
    out = common.Results(path, gpu="G", results=rows)

    def second():
        seen.append(json.loads(path.read_text()))
        rows.append({"case": "b", "pass": False})

    parts = [("a", lambda: rows.append({"case": "a", "pass": True})), ("b", second),
             ("c", lambda: rows.append({"case": "c", "pass": True}))]
    out.run_parts(parts, None, rows)
    assert seen[0]["results"] == [{"case": "a", "pass": True}] and not seen[0]["complete"]
    doc = json.loads(path.read_text())
    assert doc["complete"] and [r["case"] for r in doc["results"]] == ["a", "b", "c"]
    assert set(doc["part_seconds"]) == {"a", "b", "c"}       # what a time limit must allow
    assert "2/3 rows pass" in capsys.readouterr().out
    rows.clear()
    out.run_parts(parts, "c", rows)
    assert [r["case"] for r in json.loads(path.read_text())["results"]] == ["c"]


PARALLEL_BENCH = """import argparse, json, os, time
from pathlib import Path
p = argparse.ArgumentParser(); p.add_argument("--out", type=Path); a = p.parse_args()
t0 = time.time()
print("hello from", os.environ["CUDA_VISIBLE_DEVICES"], flush=True)
time.sleep(1.0)
a.out.write_text(json.dumps({"gpu": "G", "device": os.environ["CUDA_VISIBLE_DEVICES"],
                             "t0": t0, "t1": time.time(),
                             "results": [{"op": "x", "rlx_ms": 1.0, "torch_ms": 2.0}]}))
"""


def test_gpus_runs_benches_side_by_side_each_on_its_own_gpu(tmp_path, monkeypatch):
    """--gpus 2: two benches at once, each seeing one GPU of the caller's CUDA_VISIBLE_DEVICES,
    its output in <family>.log and its device in the run record; every family runs once."""
    path = tmp_path / "bench_par.py"
    path.write_text(PARALLEL_BENCH)
    fams = ["a", "b", "c", "d"]
    monkeypatch.setattr(report, "BENCHES", [(f, shlex.quote(str(path))) for f in fams])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6")
    res = tmp_path / "results"
    assert report.run_benches(None, False, res, timeout=60, gpus=2) == dict.fromkeys(fams, 0)
    docs = {f: json.loads((res / f"{f}.json").read_text()) for f in fams}
    assert {d["device"] for d in docs.values()} == {"3", "5"}
    runs = report.runs_of(res)
    assert all(runs[f]["device"] == docs[f]["device"] for f in fams)
    assert all(f"hello from {docs[f]['device']}" in (res / f"{f}.log").read_text() for f in fams)
    spans = sorted((d["t0"], d["t1"]) for d in docs.values())
    assert any(b[0] < a[1] for a, b in zip(spans, spans[1:]))       # some two overlapped
    with pytest.raises(SystemExit, match="--gpus 4, but CUDA_VISIBLE_DEVICES names 3"):
        report.run_benches(None, False, res, gpus=4)


SLEEPY_BENCH = """import argparse, json, time
from pathlib import Path
p = argparse.ArgumentParser(); p.add_argument("--out", type=Path)
p.add_argument("--sleep", type=float); a = p.parse_args()
time.sleep(a.sleep)
a.out.write_text(json.dumps({"gpu": "G", "results": [{"op": "x", "rlx_ms": 1.0, "torch_ms": 2.0}]}))
"""


def test_deadline_cuts_limits_and_pack_follows_each_family(tmp_path, monkeypatch):
    """--deadline: a bench's time limit is what is left of it, one whose turn comes after it
    does not run (and is not in the answer); after_each runs as each family ends, and the
    archive pack writes then holds the families that ended (a run killed from outside keeps
    them)."""
    import tarfile
    path = tmp_path / "bench_sleepy.py"
    path.write_text(SLEEPY_BENCH)
    monkeypatch.setattr(report, "BENCHES", [(f, f"{shlex.quote(str(path))} --sleep {t}")
                                            for f, t in (("a", 0.2), ("b", 60), ("c", 0))])
    res, archive, seen = tmp_path / "results", tmp_path / "r.tar.gz", []

    def after():
        report.pack(archive, res, tmp_path / "report", report=False)
        with tarfile.open(archive) as tar:
            seen.append(sorted(n.rsplit("/", 1)[-1] for n in tar.getnames()
                               if n.endswith(".run.json")))
    status = report.run_benches(None, False, res, timeout=60, deadline=4, after_each=after)
    assert status == {"a": 0, "b": report.TIMED_OUT}      # c's turn came after the deadline
    runs = report.runs_of(res)
    assert runs["a"]["timeout"] <= 4 and runs["b"]["timeout"] < 4   # b got what was left
    assert runs["b"]["seconds"] < 6
    assert seen == [["a.run.json"], ["a.run.json", "b.run.json"]]
    assert not (res / "c.run.json").exists() and not list(tmp_path.glob("*.tmp"))
