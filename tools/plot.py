"""Curves and comparison tables from runs' metrics files (matplotlib only for `plot`):
  python tools/plot.py plot RUN_DIR... -o curves.png
  python tools/plot.py compare RUN_DIR...
"""
from __future__ import annotations

import json
import os

SIGNAL = {"seed": ("opd/gate_mean", "OPD gate mean"), "opid": ("adv/skill_share", "skill-advantage share"),
          "grsd": ("grsd/weight_range", "turn-weight range")}  # each method's own signal, one line per run
LABEL_SKIP = {"method", "run_id", "out_dir", "resume", "overwrite", "track", "eval_only"}


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
    """The method, plus the args in which a run differs from the other runs of the same method."""
    labels = []
    for args, _ in runs:
        peers = [a for a, _ in runs if a.get("method") == args.get("method")]
        diff = [k for k in args if k not in LABEL_SKIP and len({json.dumps(a.get(k)) for a in peers}) > 1]
        labels.append(" ".join([args.get("method", "?")] + [f"{k}={args[k]}" for k in diff]))
    return [f"{lab} ({os.path.basename(os.path.abspath(d))})" if labels.count(lab) > 1 else lab
            for lab, d in zip(labels, dirs)]


def plot_runs(run_dirs: list[str], out: str):
    """Training success, eval success, total loss, the method's own signal, invalid-action rate and response length
    per update, one line per run (an --eval_only run: a dashed level in the eval panel). Imports matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = [read_run(r) for r in run_dirs]
    fig, axes = plt.subplots(3, 2, figsize=(11, 10))
    panels = [("charts/success_rate", "training success rate"), ("eval/success", "eval success (all episodes)"),
              ("losses/total", "total loss"), (None, "method signal"),
              ("charts/invalid_action_rate", "training invalid-action rate"),
              ("charts/response_tokens", "training response tokens per turn")]
    for ax, (key, title) in zip(axes.flat, panels):
        for (args, rows), label in zip(runs, run_labels(runs, run_dirs)):
            k, what = (key, "") if key else SIGNAL.get(args.get("method"), (None, ""))
            pts = [(r["update"] + 1, r[k]) for r in rows if "update" in r and k in r]
            level = [r[k] for r in rows if r.get("eval_only") and k in r]
            if pts:
                ax.plot(*zip(*pts), marker="o" if k.startswith("eval") else None, ms=3,
                        label=f"{label}: {what}" if what else label)
            elif level:
                ax.axhline(level[-1], ls="--", color="gray", label=f"{label} (eval-only)")
        ax.set(title=title, xlabel="updates done")
        ax.xaxis.get_major_locator().set_params(integer=True)  # updates are whole numbers (not 1.2, 1.4)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return fig


def compare_runs(run_dirs: list[str]) -> str:
    """A markdown table: final / best eval success, per-family success at the final eval, mean seconds per update
    by phase (amortised over all updates: eval and save happen every k), and each run's time per update as a
    multiple of the first run's."""
    runs = [read_run(r) for r in run_dirs]
    evals = [[r for r in rows if "eval/success" in r] for _, rows in runs]
    train = [[r for r in rows if "update" in r] for _, rows in runs]
    fams = sorted({k for ev in evals for k in (ev[-1] if ev else {}) if k.startswith("eval/success/")})
    phases = sorted({k for tr in train for r in tr for k in r if k.startswith("time/") and k != "time/total"})
    mean = lambda rows, k: sum(r.get(k, 0.0) for r in rows) / len(rows) if rows else float("nan")  # noqa: E731
    base = mean(train[0], "time/total")
    head = (["run", "updates", "final eval", "best eval"] + [f.split("/")[-1] for f in fams]
            + [f"s/update {p.split('/')[-1]}" for p in phases] + ["s/update total", "× first"])
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


def cli(argv=None):
    import argparse
    p = argparse.ArgumentParser(prog="tools/plot.py", allow_abbrev=False, description="curves and tables of runs")
    sub = p.add_subparsers(dest="cmd", required=True)
    plot = sub.add_parser("plot", help="PNG of the curves, one line per run")
    plot.add_argument("runs", nargs="+", help="run directories (each with args.json and metrics.jsonl)")
    plot.add_argument("-o", "--out", default="curves.png", help="PNG to write [default: curves.png]")
    comp = sub.add_parser("compare", help="markdown table of eval success and seconds per update")
    comp.add_argument("runs", nargs="+", help="run directories (each with args.json and metrics.jsonl)")
    a = p.parse_args(argv)
    for r in a.runs:
        if not os.path.isfile(os.path.join(r, "metrics.jsonl")):
            raise SystemExit(f"{r}: no metrics.jsonl (not a run directory)")
    if a.cmd == "plot":
        plot_runs(a.runs, a.out)
        print(f"wrote {a.out}")
    else:
        print(compare_runs(a.runs))


if __name__ == "__main__":
    cli()
