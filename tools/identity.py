"""Behaviour identity across a refactor: the same runs in two checkouts give the same metrics rows and final weights.

  python -m tools.identity record --checkout /tmp/before --out /tmp/before.json   # every configuration, ~15 min
  python -m tools.identity record --checkout .           --out /tmp/after.json
  python -m tools.identity compare /tmp/before.json /tmp/after.json               # exit 1 on any difference

A configuration is one default run on the embedded household env with the tiny model (CONFIGS): the three methods
in one process, under torchrun with 2 ranks and with --engine vllm; GRPO; and five Table 1 baselines that score a
teacher. Each run writes into a scratch folder, with one torch thread per process (thread counts change float sums).
What is compared: every metrics row without its wall-clock keys (time/*, perf/gpu_peak_gib), and the sha256 of each
*.safetensors file of the run's final/ checkpoint (and SEED's stage1/).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile

LIBRARY = ["--skill_source", "library", "--skill_library", "skills/alfworld.jsonl"]
# name -> (launcher, script, flags); baselines in the form of this checkout's baselines.py (BASELINE_FLAGS: before it
# became an entry point, issue 42, they were seed.py flags)
CONFIGS = {
    "seed": ("python", "seed.py", []), "opid": ("python", "opid.py", []), "grsd": ("python", "grsd.py", []),
    "seed-2rank": ("torchrun", "seed.py", []), "opid-2rank": ("torchrun", "opid.py", []),
    "grsd-2rank": ("torchrun", "grsd.py", []),
    "seed-vllm": ("python", "seed.py", ["--engine", "vllm"]), "opid-vllm": ("python", "opid.py", ["--engine", "vllm"]),
    "grsd-vllm": ("python", "grsd.py", ["--engine", "vllm"]),
    "grpo": ("python", "baselines.py", ["--method", "grpo"]),
    "opsd": ("python", "baselines.py", ["--method", "opsd"]),
    "grpo_opsd": ("python", "baselines.py", ["--method", "grpo_opsd"]),
    "skill_sd": ("python", "baselines.py", ["--method", "skill_sd"]),
    "rlsd": ("python", "baselines.py", ["--method", "rlsd"]),
    "sdar": ("python", "baselines.py", ["--method", "sdar"]),
}
BASELINE_FLAGS = {  # the same runs as seed.py flags (docs/baselines.md before issue 42)
    "grpo": ["--skip_sft", "--lambda_opd", "0"],
    "opsd": ["--skip_sft", "--pg_coef", "0", "--teacher_params", "old", *LIBRARY],
    "grpo_opsd": ["--skip_sft", "--beta_opd", "0", "--teacher_params", "old", *LIBRARY],
    "skill_sd": ["--skip_sft", "--distill", "sdl", "--lambda_opd", "0.001", "--teacher_params", "old", *LIBRARY],
    "rlsd": ["--skip_sft", "--lambda_opd", "0", "--rlsd_lambda", "0.5", "--teacher_params", "old", *LIBRARY],
    "sdar": ["--skip_sft", "--teacher_params", "old", *LIBRARY],
}
WALL_CLOCK = ("time/", "perf/gpu_peak_gib")


def command(checkout: str, name: str, out_dir: str) -> list[str]:
    launcher, script, flags = CONFIGS[name]
    if script == "baselines.py" and "__main__" not in open(os.path.join(checkout, script)).read():
        script, flags = "seed.py", BASELINE_FLAGS[name]  # a checkout from before baselines.py ran on its own
    if launcher == "torchrun":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
                script, "--out_dir", out_dir, *flags]
    return [sys.executable, script, "--out_dir", out_dir, "--threads", "1", *flags]


def weight_hashes(out_dir: str) -> dict[str, str]:
    out = {}
    for ckpt in ("stage1", "final"):
        folder = os.path.join(out_dir, ckpt)
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            if name.endswith(".safetensors"):
                out[f"{ckpt}/{name}"] = hashlib.sha256(open(os.path.join(folder, name), "rb").read()).hexdigest()
    return out


def record(checkout: str, out: str, names: list[str]) -> None:
    """Run each configuration in `checkout` and write {name: {rows, weights}} to `out` (rewritten after every run,
    and a configuration already in `out` is not run again)."""
    got = json.load(open(out)) if os.path.isfile(out) else {}
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    for name in names:
        if name in got:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = os.path.join(tmp, name)
            done = subprocess.run(command(checkout, name, run_dir), cwd=checkout, env=env, capture_output=True,
                                  text=True)
            if done.returncode != 0:
                raise SystemExit(f"[identity] {name} failed in {checkout}:\n{done.stderr[-3000:]}")
            rows = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
            got[name] = {"rows": [{k: v for k, v in r.items() if not k.startswith(WALL_CLOCK)} for r in rows],
                         "weights": weight_hashes(run_dir)}
        json.dump(got, open(out, "w"), indent=1)
        print(f"[identity] {name}: {len(got[name]['rows'])} rows, {len(got[name]['weights'])} weight files", flush=True)


def compare(a_path: str, b_path: str) -> int:
    """Every configuration of both files: identical rows (the same keys, values equal to the last bit) and weights."""
    a, b = json.load(open(a_path)), json.load(open(b_path))
    bad = 0
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            print(f"{name}: only in {a_path if name in a else b_path}")
            bad += 1
            continue
        ra, rb = a[name]["rows"], b[name]["rows"]
        diffs = [f"row {i} {k}: {x.get(k)!r} != {y.get(k)!r}" for i, (x, y) in enumerate(zip(ra, rb))
                 for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)]
        if len(ra) != len(rb):
            diffs.append(f"{len(ra)} rows != {len(rb)}")
        if a[name]["weights"] != b[name]["weights"]:
            diffs.append("final weights differ")
        print(f"{name}: {'identical' if not diffs else 'DIFFERENT'} ({len(ra)} rows, {len(a[name]['weights'])} "
              f"weight files)" + "".join(f"\n  {x}" for x in diffs[:8]))
        bad += bool(diffs)
    return 1 if bad else 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--checkout", default=".")
    r.add_argument("--out", required=True)
    r.add_argument("--only", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    a = p.parse_args()
    if a.cmd == "record":
        record(os.path.abspath(a.checkout), os.path.abspath(a.out), a.only)
    else:
        sys.exit(compare(a.a, a.b))
