"""Curves and comparison tables from runs' metrics files (matplotlib only for `plot`):
  python -m tools.plot plot RUN_DIR...       # curves.png next to the runs (-o to choose)
  python -m tools.plot compare RUN_DIR...    # eval success and time per update (--all: per family and phase)
  python -m tools.plot tasks RUN_A RUN_B     # the same eval tasks paired: B's wins / losses, McNemar p (--update N)
"""
from __future__ import annotations

import json
import math
import os

SIGNAL = {"seed": ("opd/gate_mean", "OPD gate mean"), "opid": ("adv/skill_share", "skill-advantage share"),
          "grsd": ("grsd/weight_range", "turn-weight range")}  # each method's own signal, one line per run
# Settings that never name a run in a legend: bookkeeping and operational flags (speed, memory, I/O), not what trains
LABEL_SKIP = {"method", "run_id", "out_dir", "resume", "overwrite", "track", "eval_only", "threads", "log_samples",
              "micro_batch", "micro_batch_tokens", "save_every", "grad_ckpt", "endpoint_timeout", "endpoint_retries",
              "endpoint_workers", "require_endpoint", "cpu_kv_cache_gb", "gpu_memory_utilization", "max_skipped_steps"}
LABEL_SHOWN = 3  # settings per label; more become "+k"


def read_run(run_dir: str) -> tuple[dict, list[dict]]:
    """(args.json, the metrics rows); a last row cut short by a kill is left out, as --resume does (harness.read_rows);
    any other unreadable file or line is one line naming it."""
    path = os.path.join(run_dir, "metrics.jsonl")
    try:
        with open(os.path.join(run_dir, "args.json")) as f:
            args = json.load(f)
        with open(path) as f:
            lines = [line for line in f if line.strip()]
    except (OSError, ValueError) as e:
        raise SystemExit(f"{run_dir}: not a run directory ({e})") from None
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except ValueError:
            if i + 1 < len(lines):
                raise SystemExit(f"{path} line {i + 1} is not JSON: {line[:80]!r}") from None
    return args, rows


def run_labels(runs: list[tuple[dict, list[dict]]], dirs: list[str]) -> list[str]:
    """Short legend labels: the method, then the settings in which its runs differ (paths by their last part, at most
    LABEL_SHOWN of them, operational flags never); runs whose labels still tie get their folder's name."""
    def short(v):
        text = os.path.basename(v.rstrip("/")) if isinstance(v, str) and os.sep in v else json.dumps(v).strip('"')
        return text if len(text) <= 24 else text[:23] + "…"
    labels = []
    for args, _ in runs:
        peers = [a for a, _ in runs if a.get("method") == args.get("method")]  # a method's runs differ in what?
        diff = [k for k in args if k not in LABEL_SKIP and len({json.dumps(a.get(k)) for a in peers}) > 1]
        shown = [f"{k}={short(args[k])}" for k in diff]
        shown = shown[:LABEL_SHOWN] + ([f"+{len(shown) - LABEL_SHOWN}"] if len(shown) > LABEL_SHOWN else [])
        labels.append(" ".join([args.get("method", "?")] + shown))
    return [f"{lab} ({os.path.basename(os.path.abspath(d))})" if labels.count(lab) > 1 else lab
            for lab, d in zip(labels, dirs)]


def default_png(run_dirs: list[str]) -> str:
    """curves.png next to the runs: inside a single run's folder, else in the folder the runs share."""
    dirs = [os.path.abspath(r) for r in run_dirs]
    return os.path.join(dirs[0] if len(dirs) == 1 else os.path.commonpath(dirs), "curves.png")


def plot_runs(run_dirs: list[str], out: str):
    """Training success, eval success, total loss, each method's own signal, invalid-action rate and response length
    per update, one line per run in one colour across the panels, one legend below them (an --eval_only run: a dashed
    level in the eval panel). Imports matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = [read_run(r) for r in run_dirs]
    labels = run_labels(runs, run_dirs)
    fig, axes = plt.subplots(3, 2, figsize=(11, 10), sharex=True)
    signals = sorted({SIGNAL[a["method"]][1] for a, _ in runs if a.get("method") in SIGNAL})
    panels = [("charts/success_rate", "training success rate"), ("eval/success", "eval success (all episodes)"),
              ("losses/total", "total loss"), (None, "method signal\n" + (", ".join(signals) or "none")),
              ("charts/invalid_action_rate", "training invalid-action rate"),
              ("charts/response_tokens", "training response tokens per turn")]
    last = max([r["update"] + 1 for _, rows in runs for r in rows if "update" in r] or [1])
    for ax, (key, title) in zip(axes.flat, panels):
        for i, ((args, rows), label) in enumerate(zip(runs, labels)):
            k = key or SIGNAL.get(args.get("method"), (None,))[0]
            pts = [(r["update"] + 1, r[k]) for r in rows if "update" in r and k in r]
            level = [r[k] for r in rows if r.get("eval_only") and k in r]
            if pts:
                ax.plot(*zip(*pts), color=f"C{i % 10}", marker="o" if len(pts) < 30 else None, ms=3, label=label)
            elif level:
                ax.axhline(level[-1], ls="--", color=f"C{i % 10}", label=f"{label} (eval-only)")
        ax.set(title=title)
        ax.set_xlim(0, last + 0.5)  # from the start, so one point is not a whole axis from 1.9 to 2.1
        ax.xaxis.get_major_locator().set_params(integer=True)  # updates are whole numbers (not 1.2, 1.4)
    for ax in axes[-1]:
        ax.set_xlabel("updates done")
    handles = {}
    for ax in axes.flat:
        handles.update(zip(*reversed(ax.get_legend_handles_labels())))
    columns = 1 if max(map(len, handles), default=0) > 50 else 2 if max(map(len, handles), default=0) > 25 else 3
    rows_of_legend = -(-len(handles) // columns)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=columns, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.025 * rows_of_legend + 0.01, 1, 1))
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return fig


def compare_runs(run_dirs: list[str], every_column: bool = False) -> str:
    """A markdown table: final / best eval success, mean seconds per update and its multiple of the first run's;
    with every_column, also the per-family success at the final eval and the seconds per update by phase (amortised
    over all updates: eval and save happen every k)."""
    runs = [read_run(r) for r in run_dirs]
    evals = [[r for r in rows if "eval/success" in r] for _, rows in runs]
    train = [[r for r in rows if "update" in r] for _, rows in runs]
    fams = sorted({k for ev in evals for k in (ev[-1] if ev else {}) if k.startswith("eval/success/")})
    phases = sorted({k for tr in train for r in tr for k in r if k.startswith("time/") and k != "time/total"})
    fams, phases = (fams, phases) if every_column else ([], [])
    mean = lambda rows, k: sum(r.get(k, 0.0) for r in rows) / len(rows) if rows else float("nan")  # noqa: E731
    base = mean(train[0], "time/total")
    head = (["run", "updates", "final eval", "best eval"] + [f.split("/")[-1] for f in fams]
            + [f"s/update {p.split('/')[-1]}" for p in phases] + ["s/update", "× first"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, ev, tr in zip(run_labels(runs, run_dirs), evals, train):
        last = ev[-1] if ev else {}
        cells = [label, str(len(tr)), f"{last.get('eval/success', float('nan')):.3f}",
                 f"{max((r['eval/success'] for r in ev), default=float('nan')):.3f}"]
        cells += [f"{last[f]:.3f}" if f in last else "–" for f in fams]
        cells += [f"{mean(tr, p):.2f}" if any(p in r for r in tr) else "–" for p in phases]
        cells.append(f"{mean(tr, 'time/total'):.2f}")
        cells.append(f"{mean(tr, 'time/total') / base:.2f}×" if tr and base > 0 else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)

def eval_files(run_dir: str) -> dict[int, str]:
    """{update: path} of the run's per-task eval records, eval/<update>.jsonl; none is one line naming the folder."""
    folder = os.path.join(run_dir, "eval")
    names = os.listdir(folder) if os.path.isdir(folder) else []
    files = {int(n[:-6]): os.path.join(folder, n) for n in names if n.endswith(".jsonl") and n[:-6].isdigit()}
    if not files:
        raise SystemExit(f"{folder}: no <update>.jsonl (the run predates per-task records or evaluated nothing)")
    return files


def read_tasks(path: str) -> dict[tuple[str, str], dict]:
    """One eval's records by (split, task id); an unreadable line or a task twice in a split is one line naming it."""
    tasks = {}
    with open(path) as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                raise SystemExit(f"{path} line {i + 1} is not JSON: {line[:80]!r}") from None
            if (row["split"], row["task"]) in tasks:
                raise SystemExit(f"{path} line {i + 1}: task {row['task']!r} of {row['split']} twice")
            tasks[row["split"], row["task"]] = row
    return tasks


def mcnemar_p(wins: int, losses: int) -> float:
    """McNemar's exact two-sided test (McNemar 1947, Psychometrika 12:153; its exact conditional form: Fagerland et
    al. 2013, BMC Med. Res. Methodol. 13:91): if neither run is better, each of the n = wins + losses discordant tasks
    goes either way with probability 1/2, so p = min(1, 2 Σ_{k ≤ min(wins, losses)} C(n, k) / 2^n); 1 at n = 0."""
    n = wins + losses
    return min(1.0, 2 * sum(math.comb(n, k) for k in range(min(wins, losses) + 1)) / 2 ** n)


def compare_tasks(run_a: str, run_b: str, update: int | None = None) -> str:
    """A markdown table pairing two runs' eval task by task at their latest common evaluated update (or `update`):
    per split, then per family, the tasks, both success rates, B's wins (A failed, B succeeded) and losses, and
    McNemar's p on them. Runs that evaluated different tasks (another --seed, --eval_tasks or --eval_split) are
    refused in one line."""
    files = [eval_files(run_a), eval_files(run_b)]
    common = sorted(set(files[0]) & set(files[1]))
    if update is None and not common:
        raise SystemExit(f"{run_a} and {run_b} share no evaluated update ({sorted(files[0])} vs {sorted(files[1])})")
    update = common[-1] if update is None else update
    for run_dir, f in zip((run_a, run_b), files):
        if update not in f:
            raise SystemExit(f"{run_dir}: no eval/{update}.jsonl (evaluated updates: {sorted(f)})")
    a, b = (read_tasks(f[update]) for f in files)
    if a.keys() != b.keys():
        raise SystemExit(f"{run_a} and {run_b} evaluated different tasks at update {update}: "
                         f"{len(a.keys() ^ b.keys())} task ids in only one of them "
                         "(the same --seed, --eval_tasks and --eval_split pair them)")
    labels = run_labels([read_run(run_a), read_run(run_b)], [run_a, run_b])
    head = ["split", "family", "tasks", "A success", "B success", "B wins", "B losses", "McNemar p"]
    lines = [f"A = {labels[0]}, B = {labels[1]}: {len(a)} tasks paired at update {update}",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for split in sorted({s for s, _ in a}):
        keys = [k for k in a if k[0] == split]
        for family in ["all"] + sorted({a[k]["family"] for k in keys}):
            pairs = [(bool(a[k]["success"]), bool(b[k]["success"])) for k in keys
                     if family in ("all", a[k]["family"])]
            wins, losses = sum(y and not x for x, y in pairs), sum(x and not y for x, y in pairs)
            cells = [split, family, str(len(pairs)), f"{sum(x for x, _ in pairs) / len(pairs):.3f}",
                     f"{sum(y for _, y in pairs) / len(pairs):.3f}", str(wins), str(losses),
                     f"{mcnemar_p(wins, losses):.3g}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cli(argv=None):
    import argparse
    p = argparse.ArgumentParser(prog="python -m tools.plot", allow_abbrev=False, description="curves and tables of runs")
    sub = p.add_subparsers(dest="cmd", required=True)
    plot = sub.add_parser("plot", help="PNG of the curves, one line per run")
    plot.add_argument("runs", nargs="+", help="run directories (each with args.json and metrics.jsonl)")
    plot.add_argument("-o", "--out", help="PNG to write [default: curves.png next to the runs]")
    comp = sub.add_parser("compare", help="markdown table of eval success and seconds per update")
    comp.add_argument("runs", nargs="+", help="run directories (each with args.json and metrics.jsonl)")
    comp.add_argument("--all", action="store_true", help="also per-family success and seconds per update by phase")
    tasks = sub.add_parser("tasks", help="markdown table pairing two runs' eval task by task: wins, losses, McNemar p")
    tasks.add_argument("runs", nargs=2, metavar="RUN", help="run directories A then B (each with eval/<update>.jsonl)")
    tasks.add_argument("--update", type=int, help="the evaluated update to pair [default: the latest both have]")
    a = p.parse_args(argv)
    for r in a.runs:
        if not os.path.isfile(os.path.join(r, "metrics.jsonl")):
            raise SystemExit(f"{r}: no metrics.jsonl (not a run directory)")
    if a.cmd == "plot":
        out = a.out or default_png(a.runs)
        plot_runs(a.runs, out)
        print(f"wrote {out}")
    elif a.cmd == "tasks":
        print(compare_tasks(*a.runs, a.update))
    else:
        print(compare_runs(a.runs, a.all))
        if len(a.runs) == 2 and all(os.path.isdir(os.path.join(r, "eval")) for r in a.runs):
            print("\n" + compare_tasks(*a.runs))  # two runs with per-task records: also task by task


if __name__ == "__main__":
    cli()
