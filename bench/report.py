"""One command for every GPU benchmark: run them, gather their JSON, write a report.

  python -m bench.report                  run the single-GPU benches, then build the report
  python -m bench.report --distributed    ... bench_distributed.py too (rlx-numba launch, 2 GPUs)
  python -m bench.report --no-run         build from bench/results/*.json as they are
  python -m bench.report --only models,attention    run these families (the report has every
                                                    family --results holds, each dated)
  python -m bench.report --gpus 2 --timeout 600    two benches at once, a GPU each (their
                                                    output in <results>/<family>.log)
  python -m bench.report --compare OLD.json         what moved since OLD (a report.json),
                                                    regressions first
  python -m bench.report ... --pack $OUT/bench.tar.gz   also the results and the report in
                                                    one archive (``tar xzf`` in the repo root),
                                                    rewritten as each family ends
  python -m bench.report --gpus 4 --deadline 540    stop by 540 s: a bench's time limit is cut
                                                    to what is left, none starts after it

  python -m bench.report --only signal --results bench/report/results --timeout 300 \
      --readme README.md                            add a family to the committed report and
                                                    rewrite the README's summary of it

Each bench_<family>.py writes bench/results/<family>.json in a shape of its own; beside it the
run writes <family>.run.json (GPU, driver, versions, date, commit, seconds, exit status), so a
report can be assembled from families run at different times (a GPU session too short for
every bench): each family's heading says when and at which commit it ran. A bench rewrites
its JSON as its rows complete (``complete`` false in it until its end), so one stopped by
--timeout or a fault still reports the rows it finished, its heading saying so. ``gather``
turns every row of them into one record: the family, a label (the row's identifying fields),
ours and the peer in the row's unit (torch, eager, cuBLAS, sentence-transformers: whichever
the bench measured beside us), the ratio (> 1: we are faster), the bar and pass/fail.
``build`` writes bench/report/README.md (one table per family, with the GPU, driver, versions,
date and commit), report.json (those records, for --compare) and PNG charts (matplotlib):
the ratio of every row grouped by family, decode and training tok/s by precision, attention
TFLOP/s by sequence length -- each only when the results hold its rows.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS, REPORT = HERE / "results", HERE / "report"
# (family, script and its arguments): the order the report shows them; the distributed bench
# runs only when asked. models_f16: MiniLM and its sentence corpus in f16 (issue 32's bars).
# The long benches run as several families, so that --gpus N spreads them over N GPUs and no
# one family outgrows a call's time limit (models alone took over 560 s on an H200).
BENCHES = [("models", "bench_models.py --only bert,llama"),
           ("models_1b", "bench_models.py --only decode1b"),
           ("models_formats", "bench_models.py --only formats"),
           ("models_qwen3next", "bench_models.py --only qwen3next"),
           ("models_f16", "bench_models.py --no-compile --only bert --dtype f16"),
           ("train", "bench_train.py"), ("vision", "bench_vision.py"),
           ("attention", "bench_attention.py --parts f32,decode_half"),
           ("attention_half", "bench_attention.py --parts half"),
           ("matmul", "bench_matmul.py"), ("quant", "bench_quant.py"),
           ("gemv", "bench_gemv.py"), ("elementwise", "bench_elementwise.py"),
           ("rows", "bench_rows.py"), ("reduce", "bench_reduce.py"),
           ("signal", "bench_signal.py"), ("linalg", "bench_linalg.py"),
           ("runtime", "bench_runtime.py"),
           ("control", "bench_control.py"), ("gated_delta", "bench_gated_delta.py"),
           ("custom_op", "bench_custom_op.py"),
           ("distributed", "bench_distributed.py")]
# a row's identifying fields, in the order its label joins them
ID_KEYS = ("row", "case", "name", "layer", "model", "mode", "op", "kind", "phase", "tier", "scheme",
           "shape", "dtype", "precision", "tc", "batch", "seq", "m", "n", "k", "experts", "rule",
           "blocks", "threads", "steps")
COUNTS = ("batch", "seq", "m", "n", "k", "experts", "blocks", "threads", "steps")  # name=value
NAMED = ("tier",)                                                   # "name value"
# the peer a row is compared with, preferred in this order (then any other torch_*)
PEERS = ("torch", "torch_bf16", "torch_mm", "torch_bf16_mm", "eager", "cublas", "st", "hf",
         "compile")
# bare fields that are ours (their name is the unit)
UNITS = ("us", "ms", "s", "gbs", "gbps", "tflops", "per_s", "tok_s", "us_run")
# where a row pairs ours with a peer in several units, the one shown: rates and times before
# memory, and before anything else a row pairs (a train row's first loss, say)
SHOWN_FIRST = ("tok_s", "sent_s", "per_s", "tflops", "gbs", "gbps", "ms", "us", "s", "us_run",
               "bytes")
# how a unit reads in the report (the rest as the bench names it)
UNIT_TEXT = {"tok_s": "tok/s", "sent_s": "sent/s", "per_s": "per s", "gbs": "GB/s", "gbps": "GB/s",
             "tflops": "TFLOP/s", "us_run": "us/run"}
LOWER_IS_BETTER = ("ms", "us", "s", "bytes")
WHOLE_MODEL_UNITS = ("tok_s", "sent_s", "per_s")      # the README block's headline rows                    # the other units are rates


# ---- gathering --------------------------------------------------------------------------------
def _rows_of(doc: dict) -> list[dict]:
    """The row dicts of one bench's JSON, whatever it calls them."""
    rows = [r for key in ("results", "rows") for r in doc.get(key) or [] if isinstance(r, dict)]
    if doc.get("bar") is not None:         # one bar for every row that passes or fails
        rows = [dict(r, bar=doc["bar"]) if "pass" in r and r.get("bar") is None else r
                for r in rows]
    for b in doc.get("bars") or []:          # bench_runtime: named values against bars
        rows.append({"name": b.get("name"), "value": b.get("value"), "bar": b.get("bar"),
                     "pass": b.get("passed")})
    if "ratio" in doc and not any("ratio" in r for r in rows):   # one verdict for the file
        rows.append({"name": doc.get("name", "summary"), "ratio": doc["ratio"],
                     "bar": doc.get("bar"), "pass": doc.get("pass")})
    return rows


def _label(row: dict) -> str:
    parts = []
    for k in ID_KEYS:
        v = row.get(k)
        if v in (None, "") or v is False or isinstance(v, (list, dict)):
            continue
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        parts.append(k if v is True else f"{k}={v}" if k in COUNTS
                     else f"{k} {v}" if k in NAMED else str(v))
    return " ".join(parts) or "?"


def _pair(row: dict):
    """(unit, ours, peer name, peer): ours from an ``rlx_<unit>`` field (or a bare unit field:
    ``us``), the peer from the same unit's ``<peer>_<unit>`` field; the unit first in
    SHOWN_FIRST, then the most preferred peer (PEERS, then any torch_*) wins; Nones where
    the row has no such pair."""
    best, alone = None, None
    for key, v in row.items():
        unit = key[4:] if key.startswith("rlx_") else key if key in UNITS else None
        if unit is None or not _num(v):
            continue
        alone = alone or (unit, float(v), None, None)
        for pk, pv in row.items():
            name = pk[: -len(unit) - 1]
            if pk == key or not pk.endswith("_" + unit) or not _num(pv) or not _is_peer(name):
                continue
            rank = (SHOWN_FIRST.index(unit) if unit in SHOWN_FIRST else len(SHOWN_FIRST),
                    PEERS.index(name) if name in PEERS else len(PEERS))
            if best is None or rank < best[0]:
                best = (rank, unit, float(v), name, float(pv))
    if best:
        return best[1:]
    if alone:
        return alone
    if _num(row.get("value")):
        return "value", float(row["value"]), None, None
    return None, None, None, None


def _is_peer(name: str) -> bool:
    return name in PEERS or name.startswith("torch_")


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def runs_of(results: Path = RESULTS, families=None) -> dict:
    """{family: its <family>.run.json} (how and where run_benches last ran it)."""
    runs = {}
    for path in sorted(results.glob("*.run.json")):
        fam = path.name[: -len(".run.json")]
        if families and fam not in families:
            continue
        try:
            runs[fam] = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            print(f"report: skipping {path.name}: {e}", file=sys.stderr)
    return runs


def gather(results: Path = RESULTS, families=None) -> tuple[list[dict], dict, set]:
    """(records, {family: the GPU its JSON names}, the families whose JSON says its bench did not
    finish: ``complete`` false, the rows it finished before a time limit or a fault stopped it)
    from results/<family>.json."""
    records, gpus, unfinished = [], {}, set()
    known = [f for f, _ in BENCHES]
    paths = sorted(results.glob("*.json"),
                   key=lambda p: known.index(p.stem) if p.stem in known else len(known))
    for path in paths:
        fam = path.stem
        if fam == "meta" or fam.endswith(".run") or (families and fam not in families):
            continue
        try:
            doc = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            print(f"report: skipping {path.name}: {e}", file=sys.stderr)
            continue
        if not isinstance(doc, dict):
            continue
        gpus[fam] = doc.get("gpu")
        if doc.get("complete") is False:
            unfinished.add(fam)
        for row in _rows_of(doc):
            unit, ours, peer_name, peer = _pair(row)
            # x peer: how much better than the peer, from the pair (> 1: better, whatever the
            # unit); the bench's own ratio is kept as it is (some are ours / peer in time)
            better = None
            if ours and peer:
                better = peer / ours if unit in LOWER_IS_BETTER else ours / peer
            ratio, ok = row.get("ratio"), row.get("pass")
            records.append(dict(
                family=fam, label=_label(row), unit=unit, ours=ours, peer_name=peer_name,
                peer=peer, better=better, ratio=float(ratio) if _num(ratio) else None,
                bar=None if row.get("bar") is None else str(row["bar"]),
                passed=None if ok is None else bool(ok), error=row.get("error"),
                seq=_seq(row), precision=_precision(row), rate=_rate(row),
                tflops=[float(row["rlx_tflops"]), float(row["torch_tflops"])
                        if _num(row.get("torch_tflops")) else None]
                if _num(row.get("rlx_tflops")) else None))
    return records, gpus, unfinished


def _seq(row: dict):
    """The sequence length of an attention row (its sk / s field, or S<n> in its shape)."""
    for k in ("sk", "seq", "s"):
        if _num(row.get(k)):
            return int(row[k])
    m = re.search(r"\bS(?:k=?)?(\d+)", str(row.get("shape", "")))
    return int(m.group(1)) if m else None


def _precision(row: dict):
    for k in ("dtype", "precision", "weights"):
        if row.get(k):
            return str(row[k])
    return None


def _rate(row: dict):
    """(what, ours, peer) tokens a second of a decode or training row, else None."""
    for ours, peer in (("rlx_per_s", "eager_per_s"), ("rlx_tok_s", "torch_tok_s"),
                       ("rlx_tok_s", "eager_tok_s")):
        if _num(row.get(ours)):
            return [row.get("phase") or "train", float(row[ours]),
                    float(row[peer]) if _num(row.get(peer)) else None]
    return None


# ---- the report -------------------------------------------------------------------------------
def meta_now(results: Path = RESULTS, runs: dict | None = None) -> dict:
    """What the report is of: the newest family run record (GPU, driver, versions, date,
    commit), else results/meta.json where one was written by hand, else what this machine
    and checkout say now."""
    if runs:
        return max(runs.values(), key=lambda r: r.get("date") or "")
    path = results / "meta.json"
    if path.exists():
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError:
            pass
    return collect_meta()


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def collect_meta() -> dict:
    def out(*cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=30,
                                  cwd=HERE).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            return None
    smi = out("nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader")
    name, driver = ([s.strip() for s in smi.splitlines()[0].split(",", 1)] if smi and "," in smi
                    else (None, None))
    versions = {}
    for dist in ("rlx-numba", "numba-cuda", "numpy", "torch", "transformers"):
        try:
            from importlib.metadata import version
            versions[dist] = version(dist)
        except Exception:  # noqa: BLE001 - not installed: not reported
            pass
    return dict(gpu=name, driver=driver, versions=versions,
                date=_now(),
                # RLX_NUMBA_COMMIT: a copy of the tree without its .git (a remote GPU machine)
                commit=os.environ.get("RLX_NUMBA_COMMIT") or out("git", "rev-parse", "--short",
                                                                 "HEAD"),
                dirty=dirty(out("git", "status", "--porcelain", "--untracked-files=no") or ""))


OWN_OUTPUT = "bench/report/"     # where the report's results and README are written


def dirty(porcelain: str) -> bool:
    """Whether ``git status --porcelain`` names a change outside OWN_OUTPUT: the results and the
    report being gathered there are no local change to the code measured."""
    for line in porcelain.splitlines():
        parts = line.split(maxsplit=1)          # "XY path" or "XY old -> new"
        if len(parts) == 2 and any(not p.strip('"').startswith(OWN_OUTPUT)
                                   for p in parts[1].split(" -> ")):
            return True
    return False


def _fmt(v) -> str:
    if v is None:
        return "-"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.3g}"


def _judged(r: dict) -> bool:
    """A row the pass count holds: one with a bar, or one that failed (an error); a row
    without a bar that passed only checked its result."""
    return r["passed"] is False or (r["passed"] is not None and r["bar"] is not None)


def _run_line(run: dict | None, meta: dict, n_rows: int, unfinished: bool) -> str | None:
    """A family's run record in words, where it differs from the report's header, failed or
    stopped; ``n_rows``: the rows shown, ``unfinished``: its JSON says the bench did not finish
    (those rows are the ones it finished)."""
    parts, run = [], run or {}
    if run and ((run.get("commit"), run.get("gpu")) != (meta.get("commit"), meta.get("gpu"))
                or run.get("date") != meta.get("date")):
        parts.append(f"ran {run.get('date', '?')} at commit {run.get('commit') or '?'}"
                     + (f" on {run['gpu']}" if run.get("gpu") != meta.get("gpu") else ""))
    if run.get("seconds") is not None:
        parts.append(f"{run['seconds']:.0f} s")
    st = run.get("status")
    if st == TIMED_OUT:
        what = (f"stopped by its {run['timeout']:.0f} s time limit" if _num(run.get("timeout"))
                else "stopped by its time limit")
    elif st:
        what = f"exited with status {st}"
    else:
        what = "did not finish" if unfinished else None
    if what and unfinished and n_rows:
        parts.append(f"**{what} after {n_rows} row{'' if n_rows == 1 else 's'}**; the rows "
                     f"below are those it finished")
    elif what:
        parts.append(f"**{what}**" + (" after writing its results" if n_rows else ", no results"))
    return "_" + "; ".join(parts) + "_" if parts else None


def markdown(records: list[dict], gpus: dict, meta: dict, charts: list[str],
             runs: dict | None = None, results_name: str = "bench/results",
             unfinished: set = frozenset()) -> str:
    n_bar = [r for r in records if _judged(r)]
    runs = runs or {}
    known = [f for f, _ in BENCHES]
    fams = sorted(dict.fromkeys([r["family"] for r in records] + list(runs)),
                  key=lambda f: known.index(f) if f in known else len(known))
    cut = [f for f in fams if f in unfinished]
    ok = sum(r["passed"] for r in n_bar)
    gpu = meta.get("gpu") or next((g for g in gpus.values() if g), "?")
    vers = ", ".join(f"{k} {v}" for k, v in (meta.get("versions") or {}).items())
    lines = ["# rlx_numba benchmarks", "",
             f"{gpu}, driver {meta.get('driver') or '?'}; {vers or 'versions unknown'}.  ",
             f"Newest bench run {meta.get('date', '?')} at commit {meta.get('commit') or '?'}"
             f"{' (with local changes)' if meta.get('dirty') else ''} (a family run at another "
             f"time says so under its heading); made by `python -m bench.report`. Every figure "
             f"is the bench's own output (its JSON in `{results_name}`), each bench timing us "
             f"and the peer in one process.", "",
             f"**{ok} of {len(n_bar)} rows with a bar pass.** \"x peer\": how many times "
             f"better than the peer (faster, or less memory); \"ratio\": the bench's own, which "
             f"its bar is about."
             + (f" Stopped before their end, so only the rows they finished: {', '.join(cut)}."
                if cut else ""), ""]
    for c in charts:
        lines += [f"![{c}]({c})", ""]
    for fam in fams:
        rows = [r for r in records if r["family"] == fam]
        if gpus.get(fam) and gpus[fam] != gpu:
            lines.append(f"## {fam} (run on {gpus[fam]})")
        else:
            lines.append(f"## {fam}")
        said = _run_line(runs.get(fam), meta, len(rows), fam in unfinished)
        if said:
            lines += ["", said]
        if not rows:
            lines += ["", "No rows.", ""]
            continue
        lines += ["", "| row | unit | ours | peer | x peer | ratio | bar | pass |",
                  "|---|---|---:|---:|---:|---:|---|---|"]
        for r in rows:
            peer = f"{_fmt(r['peer'])} ({r['peer_name']})" if r["peer_name"] else "-"
            # a row without a bar passes or fails on the bench's own check (its error)
            verdict = ("ERROR: " + str(r["error"])[:60] if r["error"] else
                       "-" if r["passed"] is None else "PASS" if r["passed"] and r["bar"] else
                       "ok" if r["passed"] else "**FAIL**")
            better = "-" if r["better"] is None else f"{r['better']:.2f}x"
            lines.append(f"| {r['label']} | {UNIT_TEXT.get(r['unit'], r['unit'] or '-')} | {_fmt(r['ours'])} | {peer} | "
                         f"{better} | {_fmt(r['ratio'])} | {r['bar'] or '-'} | {verdict} |")
        lines.append("")
    return "\n".join(lines)


def charts(records: list[dict], out: Path, gpu: str) -> list[str]:
    """The PNGs the records have rows for; their file names."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    made = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        made.append(name)

    rated = [r for r in records if r["better"] is not None]
    if rated:
        fams = list(dict.fromkeys(r["family"] for r in rated))
        fig, ax = plt.subplots(figsize=(10, 1.5 + 0.22 * len(rated)))
        ys, labels, y = [], [], 0
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for fi, fam in enumerate(fams):
            rows = [r for r in rated if r["family"] == fam]
            for r in rows:
                ax.barh(y, r["better"], color=colors[fi % len(colors)],
                        hatch="//" if r["passed"] is False else None, edgecolor="black",
                        linewidth=0.3)
                ax.text(r["better"] * 1.03, y, f"{r['better']:.2f}x", va="center", fontsize=7)
                ys.append(y)
                labels.append(f"{fam}: {r['label']}"[:70])
                y -= 1
            y -= 0.6
        ax.axvline(1.0, color="black", linestyle="--", linewidth=1)
        ax.set_yticks(ys, labels, fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel("times better than the peer (log; > 1: rlx_numba faster or smaller)\n"
                      "hatched: the row misses its bar")
        ax.set_title(f"rlx_numba against the peer each bench names, {gpu}")
        save(fig, "ratios.png")
        # the README's chart: a family a bar, its median, whiskers to its slowest / fastest row
        fig, ax = plt.subplots(figsize=(8, 1.2 + 0.45 * len(fams)))
        for fi, fam in enumerate(fams):
            vals = sorted(r["better"] for r in rated if r["family"] == fam)
            med = vals[len(vals) // 2]
            ax.barh(-fi, med, color=colors[fi % len(colors)], edgecolor="black", linewidth=0.3)
            ax.plot([vals[0], vals[-1]], [-fi, -fi], color="black", linewidth=1)
            rows = f"{len(vals)} row{'' if len(vals) == 1 else 's'}"
            ax.text(max(vals[-1], med) * 1.08, -fi, f"{med:.2f}x ({rows})", va="center",
                    fontsize=8)
        ax.axvline(1.0, color="black", linestyle="--", linewidth=1)
        ax.set_yticks([-i for i in range(len(fams))], fams)
        ax.set_xscale("log")
        ax.set_xlabel("times better than the peer (log; > 1: rlx_numba faster)\n"
                      "bar: the family's median row; line: its slowest to fastest row")
        ax.set_title(f"rlx_numba against torch / cuBLAS by family, {gpu}")
        save(fig, "families.png")
    for phase, name, title in (("decode", "decode.png", "Decode"),
                               ("train", "train.png", "Training")):
        rows = [r for r in records if r["rate"] and r["rate"][0] == phase]
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(9, 1.5 + 0.35 * len(rows)))
        ys = range(len(rows))
        ax.barh([y + 0.2 for y in ys], [r["rate"][1] for r in rows], height=0.4,
                label="rlx_numba")
        ax.barh([y - 0.2 for y in ys], [r["rate"][2] or 0 for r in rows], height=0.4,
                label="torch (as the bench names it)")
        ax.set_yticks(list(ys), [f"{r['label']} [{r['precision'] or '?'}]"[:60] for r in rows],
                      fontsize=7)
        ax.set_xlabel("tokens / s (higher is better)")
        ax.set_title(f"{title} tokens a second by precision, {gpu}")
        ax.legend(fontsize=8)
        save(fig, name)
    att = [r for r in records if r["family"] == "attention" and r["seq"] and r["tflops"]]
    if att:
        fig, ax = plt.subplots(figsize=(8, 5))
        groups = {}
        for r in att:
            key = re.sub(r"\bS(?:k=?)?\d+\s*", "", r["label"]).strip()
            groups.setdefault(key, []).append(r)
        for key, rows in groups.items():
            rows.sort(key=lambda r: r["seq"])
            ax.plot([r["seq"] for r in rows], [r["tflops"][0] for r in rows], marker="o",
                    label=f"rlx {key}"[:50])
            if any(r["tflops"][1] for r in rows):
                ax.plot([r["seq"] for r in rows], [r["tflops"][1] or math.nan for r in rows],
                        marker="x", linestyle="--", label=f"torch {key}"[:50])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel("TFLOP/s (higher is better)")
        ax.set_title(f"Attention throughput by sequence length, {gpu}")
        ax.legend(fontsize=7)
        save(fig, "attention.png")
    return made


def build(results: Path = RESULTS, out: Path = REPORT, families=None) -> Path:
    """Write out/README.md, out/report.json and the charts; the README's path."""
    records, gpus, unfinished = gather(results, families)
    runs = runs_of(results, families)
    if not records and not runs:
        raise SystemExit(f"report: no bench results in {results} (run the benches first)")
    meta = meta_now(results, runs)
    out.mkdir(parents=True, exist_ok=True)
    gpu = meta.get("gpu") or next((g for g in gpus.values() if g), "?")
    made = charts(records, out, gpu)
    (out / "report.json").write_text(json.dumps(dict(meta=meta, gpus=gpus, runs=runs,
                                                     unfinished=sorted(unfinished),
                                                     rows=records), indent=1) + "\n")
    readme = out / "README.md"
    try:
        name = str(results.resolve().relative_to(HERE.parent))
    except ValueError:
        name = str(results)
    readme.write_text(markdown(records, gpus, meta, made, runs, name, unfinished) + "\n")
    return readme


README_START, README_END = "<!-- bench-report:start -->", "<!-- bench-report:end -->"


def summary(records: list[dict], meta: dict, runs: dict, out: Path,
            unfinished: set = frozenset()) -> str:
    """The README's block: the whole-model rows against their peer, a line a family (rows with
    a bar that pass, the median "x peer", when and where it ran, how many rows a bench stopped
    early finished) and the family chart, linking the full report."""
    try:
        rel = out.resolve().relative_to(HERE.parent).as_posix()
    except ValueError:
        rel = out.as_posix()
    known = [f for f, _ in BENCHES]
    fams = sorted(dict.fromkeys([r["family"] for r in records] + list(runs)),
                  key=lambda f: known.index(f) if f in known else len(known))
    lines = [f"{meta.get('gpu') or '?'}, driver {meta.get('driver') or '?'}; the full tables "
             f"are in [{rel}/README.md]({rel}/README.md)."]
    whole = [r for r in records if r["unit"] in WHOLE_MODEL_UNITS and r["peer"]]
    if whole:               # what a reader deciding asks first: whole models against torch
        lines += ["", "Whole models and steps against their peer (tokens, sentences or images "
                      "a second):", "",
                  "| row | ours | peer | x peer | bar |", "|---|---:|---:|---:|---|"]
        for r in whole:
            verdict = "-" if not _judged(r) else f"{r['bar']}: " + (
                "PASS" if r["passed"] else "**FAIL**")
            lines.append(f"| {r['label']} ({UNIT_TEXT.get(r['unit'], r['unit'])}) | "
                         f"{_fmt(r['ours'])} | {_fmt(r['peer'])} ({r['peer_name']}) | "
                         f"{r['better']:.2f}x | {verdict} |")
    lines += ["", "Each family:", "", "| family | rows with a bar that pass | median x peer | run |",
              "|---|---|---:|---|"]
    for fam in fams:
        rows = [r for r in records if r["family"] == fam]
        barred = [r for r in rows if _judged(r)]
        better = sorted(r["better"] for r in rows if r["better"] is not None)
        med = f"{better[len(better) // 2]:.2f}x" if better else "-"
        run = runs.get(fam) or {}
        when = f"{run.get('date', '?')}, {run.get('commit') or '?'}" if run else "-"
        st = run.get("status")
        if st:
            when += ", timed out" if st == TIMED_OUT else f", exit status {st}"
        if fam in unfinished and rows:
            when += f", stopped after {len(rows)} row{'' if len(rows) == 1 else 's'}"
        verdict = f"{sum(r['passed'] for r in barred)} of {len(barred)}" if barred else "no bar"
        lines.append(f"| {fam} | {verdict} | {med} | {when} |" if rows else
                     f"| {fam} | no results | - | {when} |")
    if (out / "families.png").exists():
        lines += ["", f"![each family against its peer]({rel}/families.png)"]
    return "\n".join(lines)


def update_readme(path: Path, block: str) -> None:
    """Replace what lies between README_START and README_END in ``path`` with ``block``."""
    text = path.read_text()
    if README_START not in text or README_END not in text:
        raise SystemExit(f"report: {path} has no {README_START} ... {README_END} block")
    head, rest = text.split(README_START, 1)
    tail = rest.split(README_END, 1)[1]
    path.write_text(f"{head}{README_START}\n{block}\n{README_END}{tail}")


# ---- comparing two reports ----------------------------------------------------------------------
def compare(old: dict, new: dict, threshold: float = 0.05) -> list[str]:
    """Lines saying what moved from report ``old`` to ``new`` (their report.json documents):
    rows that stopped passing, then "x peer" figures that fell by more than ``threshold``,
    then those that rose, then rows only one of them has (saying so where that report's bench
    stopped before its end: the row was not reached rather than gone)."""
    key = lambda r: (r["family"], r["label"], r["unit"])  # noqa: E731
    a, b = {key(r): r for r in old["rows"]}, {key(r): r for r in new["rows"]}
    flips, worse, better = [], [], []
    for k in a.keys() & b.keys():
        ra, rb = a[k]["better"], b[k]["better"]
        what = f"{k[0]}: {k[1]}"
        if a[k]["passed"] and b[k]["passed"] is False:
            flips.append(f"FAIL now  {what}: {_fmt(ra)}x -> {_fmt(rb)}x (bar {b[k]['bar']})")
        elif ra and rb and rb < ra * (1 - threshold):
            worse.append((rb / ra, f"slower    {what}: {ra:.2f}x -> {rb:.2f}x ({rb / ra - 1:+.0%})"))
        elif ra and rb and rb > ra * (1 + threshold):
            better.append((rb / ra, f"faster    {what}: {ra:.2f}x -> {rb:.2f}x ({rb / ra - 1:+.0%})"))
        elif a[k]["passed"] is False and b[k]["passed"]:
            better.append((math.inf, f"passes now {what}: {_fmt(ra)}x -> {_fmt(rb)}x"))
    lines = sorted(flips) + [s for _, s in sorted(worse)] + \
        [s for _, s in sorted(better, key=lambda t: -t[0])]
    cut_old, cut_new = set(old.get("unfinished") or ()), set(new.get("unfinished") or ())
    lines += [f"new       {k[0]}: {k[1]}" + (" (the old run stopped before it)"
                                             if k[0] in cut_old else "")
              for k in sorted(b.keys() - a.keys())]
    lines += [f"gone      {k[0]}: {k[1]}" + (" (this run stopped before it)"
                                             if k[0] in cut_new else "")
              for k in sorted(a.keys() - b.keys())]
    return lines


# ---- running the benches ----------------------------------------------------------------------
TIMED_OUT = 124        # a family's status when --timeout stopped it (as timeout(1) says)


def run_benches(families, distributed: bool, results: Path = RESULTS,
                timeout: float | None = None, gpus: int = 1, deadline: float | None = None,
                after_each=None) -> dict:
    """Run each bench in its own process (a crash or a CUDA fault stays in it), at most
    ``timeout`` seconds each; {family: exit status}. A family's old JSON goes first (a bench
    that fails must not leave an earlier run's rows looking current); <family>.run.json
    records what ran where, how long and how it ended: ``wrote`` (its JSON exists), ``rows``
    (how many it holds) and ``complete`` (what the JSON says: false when the bench was stopped
    after those rows, None from a bench that does not say). ``gpus`` > 1: that many benches
    at once, each on a GPU of its own (CUDA_VISIBLE_DEVICES, within the caller's), its output
    in <family>.log; the distributed bench after them, on all of them. ``deadline``: seconds
    from now by which every bench has ended (each one's limit is cut to what is left; one
    whose turn comes later does not run and is left out of the answer). ``after_each()`` is
    called, one call at a time, as each family ends."""
    results.mkdir(parents=True, exist_ok=True)
    end = None if deadline is None else time.monotonic() + deadline
    ran = threading.Lock()

    def run_one(fam, spec, run_env, device=None):
        limit = timeout
        if end is not None:
            left = end - time.monotonic()
            if left < 1:
                print(f"\n==== {fam}: not run, the --deadline has passed", flush=True)
                return
            limit = left if limit is None else min(limit, left)
        status[fam] = _run_bench(fam, spec, results, limit, run_env, meta, device)
        if after_each is not None:
            with ran:
                after_each()

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(HERE.parent)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    meta = collect_meta()
    todo = [(fam, spec) for fam, spec in BENCHES if (not families or fam in families)
            and (fam != "distributed" or distributed)]
    status = {}
    if gpus <= 1:
        for fam, spec in todo:
            run_one(fam, spec, env)
        return status
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()] or \
        [str(i) for i in range(gpus)]
    if len(visible) < gpus:
        raise SystemExit(f"bench.report: --gpus {gpus}, but CUDA_VISIBLE_DEVICES names "
                         f"{len(visible)}: {','.join(visible)}")
    queue = [t for t in todo if t[0] != "distributed"]
    lock = threading.Lock()

    def worker(device):
        while True:
            with lock:
                if not queue:
                    return
                fam, spec = queue.pop(0)
            run_one(fam, spec, dict(env, CUDA_VISIBLE_DEVICES=device), device)

    threads = [threading.Thread(target=worker, args=(d,)) for d in visible[:gpus]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for fam, spec in todo:
        if fam == "distributed":          # every GPU, once the others are done
            run_one(fam, spec, env)
    return {fam: status[fam] for fam, _ in todo if fam in status}


def _run_bench(fam, spec, results, timeout, env, meta, device=None) -> int:
    """One family's bench (see run_benches): its exit status, its run record written. With a
    ``device`` its output goes to <family>.log (benches run side by side), else to ours."""
    out = results / f"{fam}.json"
    out.unlink(missing_ok=True)
    script, *args = shlex.split(spec)
    cmd = ([sys.executable, "-m", "rlx_numba.cli", "launch", "--gpus", "2"]
           if fam == "distributed" else [sys.executable]) + [str(HERE / script), *args,
                                                             "--out", str(out)]
    where = f" on GPU {device}, output in {results / (fam + '.log')}" if device else ""
    print(f"\n==== {fam}: {' '.join(cmd[1:])}{where}", flush=True)
    t0, started = time.perf_counter(), _now()
    log = open(results / f"{fam}.log", "w") if device else None
    try:
        code = subprocess.run(cmd, env=env, cwd=HERE.parent, timeout=timeout, stdout=log,
                              stderr=subprocess.STDOUT if log else None).returncode
    except subprocess.TimeoutExpired:
        code = TIMED_OUT
    finally:
        if log:
            log.close()
    seconds = round(time.perf_counter() - t0, 1)
    for tmp in results.glob(f".{out.name}.*.tmp"):    # common.write_json's, were it stopped
        tmp.unlink()                                   # between its write and its rename
    doc = _read_doc(out)
    run = dict(meta, date=started, seconds=seconds, status=code, timeout=timeout,
               wrote=out.exists(), rows=len(_rows_of(doc)), complete=doc.get("complete"))
    if device:
        run["device"] = device
    (results / f"{fam}.run.json").write_text(json.dumps(run, indent=1) + "\n")
    ended = ("ended" if not code else "timed out" if code == TIMED_OUT else "exited") + \
        (f" with status {code}" if code else "")
    if code or device:
        print(f"==== {fam} {ended} after {seconds} s"
              + (f"; its JSON holds the {run['rows']} rows it finished"
                 if run["complete"] is False else ""), flush=True)
    return code


def _read_doc(path: Path) -> dict:
    """A bench's JSON, {} where it is missing or unreadable."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return doc if isinstance(doc, dict) else {}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.report",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--no-run", dest="run", action="store_false",
                   help="build from the JSON already in bench/results")
    p.add_argument("--only", default=None, help="comma-separated families (default: all)")
    p.add_argument("--distributed", action="store_true", help="also the 2-GPU bench")
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--readme", type=Path, default=None, metavar="README.md",
                   help="also rewrite that file's bench-report block with the summary")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds a bench may run before it is stopped (default: no limit)")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds by which every bench has ended: each one's --timeout is cut "
                        "to what is left, and none starts after it (default: none)")
    p.add_argument("--gpus", type=int, default=1,
                   help="benches run at once, each on a GPU of its own (their output in "
                        "<results>/<family>.log); default 1")
    p.add_argument("--out", type=Path, default=REPORT)
    p.add_argument("--compare", type=Path, default=None, metavar="OLD.json",
                   help="print what moved since OLD (a report.json) and exit")
    p.add_argument("--pack", type=Path, default=None, metavar="FILE.tar.gz",
                   help="also pack the results and the report into one archive (a remote "
                        "machine that returns few files), the results alone rewritten as "
                        "each family ends (a run stopped from outside keeps what ended)")
    args = p.parse_args(argv)
    families = set(args.only.split(",")) if args.only else None
    if families and families - {f for f, _ in BENCHES}:
        p.error(f"--only: unknown families {sorted(families - {f for f, _ in BENCHES})}; "
                f"known: {', '.join(f for f, _ in BENCHES)}")
    if args.compare is not None:
        new_path = args.out / "report.json"
        lines = compare(json.loads(args.compare.read_text()), json.loads(new_path.read_text()))
        print("\n".join(lines) if lines else "nothing moved by more than 5%")
        return 0
    failed = {}
    if args.run:
        if args.gpus < 1:
            p.error(f"--gpus must be at least 1, got {args.gpus}")
        after = None if args.pack is None else (
            lambda: pack(args.pack, args.results, args.out, report=False))
        failed = {f: s for f, s in run_benches(families, args.distributed, args.results,
                                               args.timeout, args.gpus, args.deadline,
                                               after).items() if s}
    readme = build(args.results, args.out)      # every family with results there, run now or not
    if args.readme is not None:
        records, _, unfinished = gather(args.results)
        runs = runs_of(args.results)
        update_readme(args.readme, summary(records, meta_now(args.results, runs), runs, args.out,
                                           unfinished))
    print(f"\nwrote {readme} and its charts"
          + (f"; benches that failed: {', '.join(failed)}" if failed else ""))
    if args.pack is not None:
        pack(args.pack, args.results, args.out)
        print(f"packed {args.results} and {args.out} into {args.pack}")
    return 1 if failed else 0


def pack(archive: Path, results: Path, out: Path, report: bool = True) -> None:
    """``results`` (every family's JSON and run record) and ``out`` (the report; not with
    ``report=False``) in one .tar.gz, under their own names: ``tar xzf`` in the repo root puts
    them back. Written aside and renamed, so a reader never sees half an archive."""
    import tarfile
    tmp = archive.with_name(archive.name + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for d in dict.fromkeys((results, out) if report else (results,)):
            if d.exists():
                tar.add(d, arcname=_relative(d))
    os.replace(tmp, archive)


def _relative(d: Path) -> str:
    """``d`` relative to the repo root where it lies inside it, else its name."""
    try:
        return str(d.resolve().relative_to(HERE.parent))
    except ValueError:
        return d.name


if __name__ == "__main__":
    sys.exit(main())
