"""Long runs (harness.Run): kill -9 and --resume under torchrun for every method, a kill while a checkpoint is
written, a used out_dir refused, --eval_only against the numbers training logged, plot / compare on real runs,
TensorBoard rows, and the CLI (defaults in --help, choices, no prefix abbreviations)."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tools import bench
import harness
from tools import plot
from conftest import HERE, SHARED, descendants, env, free_port, one_rank, rows_of, run, strict_rows_of

BASE = ["--tasks_per_update", "2", "--group_size", "2", "--eval_tasks", "2"]
FAST = {"seed": ["--sft_tasks", "2", "--sft_rollouts", "2"], "opid": [],
        "grsd": ["--max_response_len", "32", "--reflection_max_tokens", "32"]}


def torchrun(method, out, *extra):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
            str(free_port()), str(HERE / f"{method}.py"), "--out_dir", str(out), *BASE, *FAST[method], *extra]


def python(method, out, *extra):
    return [sys.executable, str(HERE / f"{method}.py"), "--out_dir", str(out), *BASE, *FAST[method], *extra]


def untimed(rows):
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def weights(path):
    from safetensors.torch import load_file
    return load_file(str(Path(path) / "model.safetensors"))


# ------------------------------------------------------------------------------------------------ kill -9, resume

@pytest.mark.slow
@pytest.mark.parametrize("method,first_state", [("seed", "stage1"), ("opid", "update1"), ("grsd", "update1")])
def test_kill_9_then_resume_equals_the_uninterrupted_run(method, first_state, tmp_path):
    """2 ranks, save_every 1. SEED is killed after its first checkpoint (θ_sft + skill library: stage 2 restarts
    with a fresh AdamW), OPID and GRSD after update 1 (AdamW moments restored). Generation, scoring and the update
    are deterministic on CPU given weights, optimizer and RNG, so the rows and final weights must be bit-equal."""
    flags = ["--updates", "2", "--save_every", "1", "--eval_every", "2"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run(torchrun(method, straight, *flags))

    proc = subprocess.Popen(torchrun(method, killed, *flags), cwd=HERE, env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (killed / first_state / harness.STATE / "meta.json").is_file():
        assert proc.poll() is None and time.time() < deadline, "the run ended before its first checkpoint"
        time.sleep(0.05)
    for pid in [proc.pid, *descendants(proc.pid)]:  # torchrun and both workers (each in a session of its own)
        os.kill(pid, signal.SIGKILL)
    proc.wait()
    assert not (killed / "final").exists(), "killed too late: the run had finished"
    logged = [r.get("update", -1) for r in rows_of(killed)]
    state = harness.latest_state(str(killed))[0]
    done = harness.read_meta(state)["next_update"]
    # nothing logged past the checkpoint: at most the update in flight is lost. A kill between save_state and
    # run.log leaves no row at all (SEED's stage 1 row, or OPID/GRSD's update 0): --resume restores it from meta.json.
    assert max(logged, default=-1) <= done - 1

    res = run(torchrun(method, killed, *flags, "--resume"))
    assert f"resuming {state} at update {done}" in res.stdout
    assert untimed(rows_of(killed)) == untimed(rows_of(straight))  # every row, the ones before the kill included
    a, b = weights(straight / "final"), weights(killed / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not any(p.name.endswith(".tmp") for p in killed.iterdir())


def two_nodes(method, out, *extra):
    """The same run as torchrun(), as 2 nodes × 1 process: two launchers (node ranks 0 and 1) meeting at a c10d
    rendezvous on 127.0.0.1, sharing out_dir as nodes share a filesystem. Returns node 0's stdout."""
    port = free_port()
    cmds = [[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1", "--node_rank",
             str(node), "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "two-nodes",
             str(HERE / f"{method}.py"), "--out_dir", str(out), *BASE, *FAST[method], *extra] for node in (0, 1)]
    procs = [subprocess.Popen(c, cwd=HERE, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in cmds]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return "".join(o for o, _ in outs)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["opid"])
def test_two_nodes_checkpoint_resume_and_match_one_node(method, tmp_path):
    """2 nodes × 1 process: 1 update (one checkpoint, final/), then --resume to 2 updates; the rows and the final
    weights equal one node with 2 processes running both updates straight (the same ranks, the same gloo maths).
    OPID alone (SEED's and GRSD's, ~65 s, were retired for issue 57's LoRA tests): the rendezvous, the shared out_dir
    and the checkpoint are the harness's, the same for every method, and each method's own 2-rank resume is
    test_kill_9_then_resume_equals_the_uninterrupted_run's."""
    flags = ["--eval_every", "1"]
    one, two = tmp_path / "one_node", tmp_path / "two_nodes"
    run(torchrun(method, one, *flags, "--updates", "2"))
    two_nodes(method, two, *flags, "--updates", "1")
    saved = sorted(p.name for p in two.iterdir() if (p / "config.json").is_file())
    assert saved == (["final", "stage1"] if method == "seed" else ["final"])  # SEED keeps θ_sft as stage1/
    out = two_nodes(method, two, *flags, "--updates", "2", "--resume")
    assert f"resuming {two / 'update1'} at update 1" in out
    assert untimed(rows_of(two)) == untimed(rows_of(one))
    a, b = weights(one / "final"), weights(two / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


KILL_IN_SECOND_MODEL_SAVE = """
import os, runpy, sys
calls = []
def hook(frame, event, arg):  # SIGKILL as the 2nd checkpoint starts writing weights (its RNG files are written)
    if event == "call" and frame.f_code.co_name == "save_pretrained" and "modeling_utils" in frame.f_code.co_filename:
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), 9)
sys.setprofile(hook)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_a_kill_while_saving_leaves_the_previous_checkpoint_usable(tmp_path):
    out = tmp_path / "run"
    flags = ["--updates", "3", "--save_every", "1", "--eval_every", "0"]
    cmd = [sys.executable, "-c", KILL_IN_SECOND_MODEL_SAVE, *python("opid", out, *flags)[1:]]
    res = subprocess.run(cmd, cwd=HERE, env=env(), capture_output=True, text=True, timeout=400)
    assert res.returncode == -signal.SIGKILL, res.stderr[-2000:]
    partial = out / "update2.tmp"
    assert (partial / harness.STATE / "rng_rank0.pt").is_file() and not (partial / harness.STATE / "meta.json").exists()
    assert not (out / "update2").exists() and harness.latest_state(str(out))[0] == str(out / "update1")
    assert [r["update"] for r in rows_of(out)] == [0]

    res = run(python("opid", out, *flags, "--resume"))
    assert f"resuming {out / 'update1'} at update 1" in res.stdout
    assert [r["update"] for r in rows_of(out)] == [0, 1, 2]
    assert not partial.exists() and (out / "update2" / "config.json").is_file()
    assert not (out / "update2" / harness.STATE).exists()  # pruned: one optimizer state on disk, the newest
    assert harness.read_meta(str(out / "final"))["next_update"] == 3


@pytest.mark.slow
def test_a_finished_run_extended_on_more_ranks_keeps_its_checkpoints(tmp_path):
    """1 process, 1 update; then --resume --updates 2 under torchrun with 2 ranks: the AdamW state (a full state
    dict) is broadcast from rank 0 and resharded; the RNG streams, saved per rank, start again from the seed."""
    out = tmp_path / "run"
    run(python("opid", out, "--updates", "1", "--eval_every", "0"))
    first = weights(out / "final")
    import opid
    with pytest.raises(SystemExit, match="nothing to resume with --updates 1"):
        opid.resolve(opid.Args(out_dir=str(out), resume=True, updates=1))
    res = run(torchrun("opid", out, "--updates", "2", "--eval_every", "0", "--resume"))
    assert f"resuming {out / 'update1'} at update 1" in res.stdout and "saved by 1 ranks, this run has 2" in res.stdout
    assert [r["update"] for r in rows_of(out)] == [0, 1]
    kept = weights(out / "update1")  # the old final/, renamed: the new last update wrote final/
    assert all(torch.equal(first[k], kept[k]) for k in first)
    assert harness.read_meta(str(out / "final"))["next_update"] == 2 and not (out / "update1" / harness.STATE).exists()
    # it trained on: the resharded AdamW state took a second step. (The weights need not move: the random tiny policy's
    # groups are all tied (A = 0) and it equals π_ref, so every gradient is exactly 0 now that scoring and training
    # forwards are batched alike; the old check passed on float noise between differently padded batches.)
    osd = torch.load(out / "final" / harness.STATE / "optimizer.pt", weights_only=True)
    steps = {float(v["step"]) for v in osd["state"].values()}
    assert steps == {2.0}, steps


# ------------------------------------------------------------------------------------------------ out_dir rules

@pytest.mark.slow
def test_a_used_out_dir_is_refused_without_resume_or_overwrite(tmp_path):
    import opid
    (tmp_path / "metrics.jsonl").write_text('{"update": 0}\n')
    before = (tmp_path / "metrics.jsonl").read_bytes()
    with pytest.raises(SystemExit, match="--resume .*--overwrite"):
        opid.resolve(opid.Args(out_dir=str(tmp_path)))
    t0 = time.time()
    res = subprocess.run([sys.executable, str(HERE / "grsd.py"), "--out_dir", str(tmp_path)], cwd=HERE, env=env(),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "already holds a run" in res.stderr and "Traceback" not in res.stderr
    assert time.time() - t0 < 60 and not (tmp_path / "args.json").exists()  # refused before anything was built
    assert (tmp_path / "metrics.jsonl").read_bytes() == before


def test_overwrite_deletes_the_old_run_and_nothing_else(tmp_path):
    import random

    import opid
    for name in ("update10", "final", "update5", "update20.tmp", "tensorboard"):
        (tmp_path / name).mkdir()
    for name in ("update10", "final"):
        (tmp_path / name / harness.STATE).mkdir()
        (tmp_path / name / harness.STATE / "meta.json").write_text('{"next_update": 10}')
    (tmp_path / "update5" / "config.json").write_text("{}")  # a pruned checkpoint: a plain HF directory
    (tmp_path / "notes").mkdir()
    (tmp_path / "metrics.jsonl").write_text('{"update": 9}\n')

    args = opid.resolve(opid.Args(out_dir=str(tmp_path), overwrite=True, eval_only=True))
    with one_rank() as d:  # eval-only: only the rows go (the model it scores may be one of these checkpoints)
        harness.Run(args, "opid", d, 1).close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "args.json", "final", "metrics.jsonl", "notes",
                                                            "tensorboard", "update10", "update20.tmp", "update5"]
    args = opid.resolve(opid.Args(out_dir=str(tmp_path), overwrite=True))
    rng = random.getstate(), torch.get_rng_state()
    with one_rank() as d:
        r = harness.Run(args, "opid", d, args.updates)
        r.close()
    assert random.getstate() == rng[0] and torch.equal(torch.get_rng_state(), rng[1])  # seeded streams untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "args.json", "metrics.jsonl", "notes"]
    assert (tmp_path / "metrics.jsonl").read_text() == "" and r.start == 0 and r.state is None


def test_resume_keeps_the_rows_its_checkpoint_covers_and_recovers_its_own(tmp_path):
    """A kill between saving update 2's checkpoint and logging its row, with update 3's row half written."""
    import models
    import opid
    (tmp_path / "metrics.jsonl").write_text('{"update": 0, "x": 0.5}\n{"update": 2, "x": 9}\n{"upda')
    with one_rank() as d:
        model = models.load_model("tiny", 0)
        harness.save_state(str(tmp_path / "update2"), model, models.load_tokenizer("tiny"), d,
                           torch.optim.AdamW(model.parameters()), {"next_update": 2, "row": {"update": 1, "x": 1.5}})
        args = opid.resolve(opid.Args(out_dir=str(tmp_path), resume=True, updates=4))
        r = harness.Run(args, "opid", d, args.updates)
        r.close()
    assert strict_rows_of(tmp_path) == [{"update": 0, "x": 0.5}, {"update": 1, "x": 1.5}]
    assert r.start == 2 and r.state == str(tmp_path / "update2")


# ------------------------------------------------------------------------------------------------ two real runs

@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """GRPO (opid --lambda_skill 0, with --track tensorboard) and OPID, 2 updates each, eval after each update."""
    root = tmp_path_factory.mktemp("runs")
    flags = ["--updates", "2", "--save_every", "1", "--eval_every", "1"]
    extra = ["--track", "tensorboard"] if importlib.util.find_spec("tensorboard") else []
    run(python("opid", root / "grpo", *flags, "--lambda_skill", "0", *extra))
    run(python("opid", root / "opid", *flags))
    return root / "grpo", root / "opid"


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint,row", [("update1", 0), ("final", 1)])
def test_eval_only_reproduces_the_eval_that_training_logged(two_runs, checkpoint, row, tmp_path):
    train_dir = two_runs[1]
    logged = rows_of(train_dir)[row]
    # the tiny preset's lengths, passed explicitly: a checkpoint path is not 'tiny', so it would get Table 5's
    run(python("opid", tmp_path, "--eval_only", "--model", str(train_dir / checkpoint), "--max_prompt_len", "1024",
               "--max_response_len", "48", "--max_steps", "6"))
    (ev,) = rows_of(tmp_path)
    keys = [k for k in logged if k.startswith("eval/")]
    assert {"eval/success", "eval/success_family_avg", "eval/response_tokens", "eval/episode_length"} <= set(keys)
    assert ev["eval_only"] == 1 and {k: ev[k] for k in keys} == {k: logged[k] for k in keys}
    assert logged["eval/response_tokens"] > 1  # a fingerprint of the sampled tokens, not just a 0 success rate
    assert not [p for p in tmp_path.iterdir() if (p / "config.json").exists()]  # no checkpoint written


@pytest.mark.slow
def test_tensorboard_gets_the_same_rows(two_runs):
    pytest.importorskip("tensorboard", reason="pip install tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(two_runs[0] / "tensorboard"))
    acc.Reload()
    for key in ("charts/success_rate", "losses/total", "train/tokens", "eval/response_tokens"):
        events = acc.Scalars(key)
        assert [e.step for e in events] == [1, 2]
        assert [e.value for e in events] == pytest.approx([r[key] for r in rows_of(two_runs[0])], rel=1e-6)


@pytest.mark.slow
def test_plot_draws_one_line_per_run_and_writes_a_png(two_runs, tmp_path):
    pytest.importorskip("matplotlib", reason="pip install matplotlib")
    import matplotlib.image
    out = tmp_path / "curves.png"
    fig = plot.plot_runs([str(p) for p in two_runs], str(out))
    for ax in fig.axes:
        assert len(ax.get_lines()) == 2, ax.get_title()
        labels = [line.get_label() for line in ax.get_lines()]
        assert labels[0].startswith("opid lambda_skill=0.0") and labels[1].startswith("opid lambda_skill=0.001")
    img = matplotlib.image.imread(str(out))
    assert img.shape[0] > 300 and img.shape[1] > 500 and out.stat().st_size > 10_000
    ys = fig.axes[2].get_lines()[0].get_ydata()  # total loss of the GRPO run, as logged
    assert list(ys) == [r["losses/total"] for r in rows_of(two_runs[0])]
    res = run([sys.executable, "-m", "tools.plot", "plot", *map(str, two_runs), "-o", str(tmp_path / "b.png")])
    assert "wrote" in res.stdout and (tmp_path / "b.png").stat().st_size > 10_000


@pytest.mark.slow
def test_compare_prints_one_row_per_run(two_runs):
    res = run([sys.executable, "-m", "tools.plot", "compare", *map(str, two_runs)])
    table, tasks = res.stdout.strip().split("\n\n")  # two runs with per-task records: then task by task
    n = len((two_runs[0] / "eval" / "1.jsonl").read_text().splitlines())  # --eval_tasks of the runs
    assert n >= 2 and f"{n} tasks paired at update 1" in tasks and f"| valid_seen | all | {n} |" in tasks
    lines = table.splitlines()
    assert lines[0].startswith("| run | updates | final eval | best eval |") and "× first" in lines[0]
    assert len(lines) == 4 and lines[2].endswith("| 1.00× |")
    for line, run_dir in zip(lines[2:], two_runs):
        rows = [r for r in rows_of(run_dir) if "eval/success" in r]
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[1] == "2" and cells[2] == f"{rows[-1]['eval/success']:.3f}"
        mean_total = sum(r["time/total"] for r in rows_of(run_dir)) / 2
        assert cells[-2] == f"{mean_total:.2f}"


def test_each_test_runs_in_its_own_scratch_directory_even_after_monkeypatch_undo(monkeypatch):
    """conftest.scratch_cwd (issue 41): not the checkout, empty, and kept when a test undoes its own monkeypatches
    (with monkeypatch.chdir, undo() went back to the checkout: 2 failures in a fresh clone after the Quick start)."""
    here = os.getcwd()
    assert Path(here) != HERE and not os.listdir(here)
    monkeypatch.setattr(os, "sep", os.sep)
    monkeypatch.undo()
    assert os.getcwd() == here


@pytest.fixture(scope="module")
def cwd_of_a_module_fixture():
    return os.getcwd()


def test_a_module_scoped_fixture_runs_outside_the_checkout(cwd_of_a_module_fixture):
    """Issue 54: module-scoped fixtures (e.g. one building Args with the default out_dir runs/opid) ran before the
    function-scoped scratch_cwd, in the checkout, and met the runs/ the docs' commands leave there (5 errors in the
    fast tier after `python opid.py` and `python grsd.py`). conftest's session-scoped scratch_session_cwd runs first."""
    assert HERE not in Path(cwd_of_a_module_fixture).resolve().parents and Path(cwd_of_a_module_fixture) != HERE


def test_an_undocumented_metric_key_fails_the_tests_that_read_rows(tmp_path):
    """conftest.rows_of, which every test of a real run's rows goes through, checks each key against docs/metrics.md
    (issue 41): a placeholder row covers any task family; a key the docs do not list fails."""
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"update": 0, "eval/success/look_at_obj_in_light": 0.5,
                                                        "losses/total": 0.1}) + "\n")
    assert rows_of(tmp_path)[0]["update"] == 0
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"update": 0, "losses/made_up": 1.0}) + "\n")
    with pytest.raises(AssertionError, match=r"keys missing from docs/metrics.md: \['losses/made_up'\]"):
        rows_of(tmp_path)


def test_plot_and_compare_stay_readable_with_six_runs(tmp_path, capsys):
    """Issue 41: with 6 runs the legends (`opid model=/root/.cache/... log_samples=4 threads=1 micro_batch=8 ...`)
    covered the panels, one eval point made an x axis from 1.9 to 2.1, `-o curves.png` landed in the working
    directory and `compare` printed 20 columns. Runs written by hand: labels name only the settings that differ (no
    operational flags, paths by their last part), one legend for the figure, x from 0, the PNG beside the runs."""
    pytest.importorskip("matplotlib", reason="pip install matplotlib")
    base = dict(method="opid", model="tiny", lr=1e-6, threads=None, log_samples=0, micro_batch=16, seed=0)
    runs = {"a": dict(base, model="/root/.cache/skill-sd/SmolLM2-135M-Instruct", log_samples=4, threads=1),
            "b": dict(base, lr=3e-6, micro_batch=8), "c": dict(base), "d": dict(base, method="seed"),
            "e": dict(base, method="seed", seed=1), "f": dict(base, method="grsd")}
    for name, args in runs.items():
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "args.json").write_text(json.dumps(args))
        rows = [{"update": u, "charts/success_rate": 0.1 * u, "losses/total": 0.5, "time/total": 2.0 + u,
                 "time/rollout": 1.0, "eval/success": 0.2, "eval/success/clean": 0.2}
                for u in range(1 if name == "f" else 2)]
        (tmp_path / "runs" / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    dirs = [str(tmp_path / "runs" / n) for n in runs]
    labels = plot.run_labels([plot.read_run(d) for d in dirs], dirs)
    assert labels == ["opid model=SmolLM2-135M-Instruct lr=1e-06", "opid model=tiny lr=3e-06",
                      "opid model=tiny lr=1e-06", "seed seed=0", "seed seed=1", "grsd"]
    plot.cli(["plot", *dirs])
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'runs' / 'curves.png'}"
    assert (tmp_path / "runs" / "curves.png").stat().st_size > 10_000 and not (Path.cwd() / "curves.png").exists()
    fig = plot.plot_runs(dirs, str(tmp_path / "one.png"))
    assert [t.get_text() for t in fig.legends[0].get_texts()] == labels and all(ax.get_legend() is None
                                                                                 for ax in fig.axes)
    assert all(ax.get_xlim() == (0.0, 2.5) for ax in fig.axes)
    plot.cli(["compare", *dirs])
    short = capsys.readouterr().out.splitlines()
    assert short[0] == "| run | updates | final eval | best eval | s/update | × first |" and len(short) == 8
    assert short[2] == "| opid model=SmolLM2-135M-Instruct lr=1e-06 | 2 | 0.200 | 0.200 | 2.50 | 1.00× |"
    plot.cli(["compare", "--all", *dirs])
    assert capsys.readouterr().out.splitlines()[0].endswith("| clean | s/update rollout | s/update | × first |")


def test_mcnemar_p_by_hand():
    """Exact two-sided McNemar: 2 Σ_{k ≤ min(b, c)} C(b + c, k) / 2^(b + c), at most 1 (issue 55)."""
    assert plot.mcnemar_p(0, 5) == 2 / 32 == 0.0625
    assert plot.mcnemar_p(1, 9) == plot.mcnemar_p(9, 1) == 2 * (1 + 10) / 1024 == 0.021484375
    assert plot.mcnemar_p(3, 3) == 1.0 and plot.mcnemar_p(0, 0) == 1.0


def task_run(path, method, evals):
    """A run folder by hand: args.json, one metrics row, and eval/<update>.jsonl from {update: {split: [(task,
    family, success)]}}."""
    (path / "eval").mkdir(parents=True)
    (path / "args.json").write_text(json.dumps({"method": method}))
    (path / "metrics.jsonl").write_text(json.dumps({"update": 0, "eval/success": 0.0}) + "\n")
    for update, splits in evals.items():
        rows = [{"split": split, "task": task, "family": family, "success": success, "steps": 3, "return": success,
                 "invalid": 0, "response_tokens": 20} for split, tasks in splits.items()
                for task, family, success in tasks]
        (path / "eval" / f"{update}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def tasks_of(successes, families=("clean",) * 5 + ("heat",) * 3):
    return [(f"t{i}", family, s) for i, (family, s) in enumerate(zip(families, successes))]


@pytest.fixture
def paired_runs(tmp_path):
    """A and B on the same 8 valid_seen and 2 valid_unseen tasks (B's rows in another order), at updates 2 and 4; A
    also at 6. At 4, B wins t0-t4 (clean) and t1 of valid_unseen, and loses t5 (heat); at 2 they tie."""
    unseen = [("u0", "cool", 1), ("u1", "cool", 0)]
    a = task_run(tmp_path / "a", "grpo", {2: {"valid_seen": tasks_of([0] * 8)},
                                          4: {"valid_seen": tasks_of([0, 0, 0, 0, 0, 1, 0, 0]), "valid_unseen": unseen},
                                          6: {"valid_seen": tasks_of([1] * 8)}})
    b = task_run(tmp_path / "b", "seed", {2: {"valid_seen": tasks_of([0] * 8)[::-1]},
                                          4: {"valid_unseen": [("u1", "cool", 1), ("u0", "cool", 1)],
                                              "valid_seen": tasks_of([1, 1, 1, 1, 1, 0, 0, 0])[::-1]}})
    return a, b


def test_tasks_pairs_two_runs_at_their_latest_common_eval(paired_runs, capsys):
    """Issue 55: `tasks A B` pairs the per-task records by task id at the latest update both evaluated (4, not A's 6),
    per split and per family: B's wins (A failed, B succeeded), losses and McNemar's p; --update 2 pairs update 2."""
    plot.cli(["tasks", *paired_runs])
    assert capsys.readouterr().out.splitlines() == [
        "A = grpo, B = seed: 10 tasks paired at update 4",
        "| split | family | tasks | A success | B success | B wins | B losses | McNemar p |",
        "|---|---|---|---|---|---|---|---|",
        "| valid_seen | all | 8 | 0.125 | 0.625 | 5 | 1 | 0.219 |",  # 2 (1 + 6) / 2^6
        "| valid_seen | clean | 5 | 0.000 | 1.000 | 5 | 0 | 0.0625 |",
        "| valid_seen | heat | 3 | 0.333 | 0.000 | 0 | 1 | 1 |",
        "| valid_unseen | all | 2 | 0.500 | 1.000 | 1 | 0 | 1 |",
        "| valid_unseen | cool | 2 | 0.500 | 1.000 | 1 | 0 | 1 |"]
    plot.cli(["tasks", *paired_runs, "--update", "2"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("8 tasks paired at update 2")
    assert out[3] == "| valid_seen | all | 8 | 0.000 | 0.000 | 0 | 0 | 1 |"


def test_tasks_refuses_runs_that_evaluated_different_tasks_in_one_line(paired_runs, tmp_path):
    c = task_run(tmp_path / "c", "opid", {4: {"valid_seen": tasks_of([1] * 8)[:7] + [("t9", "heat", 1)]}})
    with pytest.raises(SystemExit, match=r"evaluated different tasks at update 4: 4 task ids in only one") as e:
        plot.compare_tasks(paired_runs[0], c)  # t7, t9 and A's 2 valid_unseen ids
    assert "\n" not in str(e.value)
    with pytest.raises(SystemExit, match=r"/c: no eval/6.jsonl \(evaluated updates: \[4\]\)$"):
        plot.compare_tasks(paired_runs[0], c, update=6)


def test_tasks_refuses_a_run_without_per_task_records_in_one_line(paired_runs, tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    (old / "args.json").write_text(json.dumps({"method": "grpo"}))
    (old / "metrics.jsonl").write_text(json.dumps({"update": 0, "eval/success": 0.0}) + "\n")
    with pytest.raises(SystemExit) as e:
        plot.cli(["tasks", str(old), paired_runs[1]])
    assert str(e.value) == f"{old / 'eval'}: no <update>.jsonl (the run predates per-task records or evaluated nothing)"


# ------------------------------------------------------------------------------------------------ the CLI

def test_cli_refuses_abbreviations_and_unknown_choices_before_loading(monkeypatch, capsys):
    import grsd
    import seed
    for argv in (["--upd", "3"], ["--eval_split", "valid_unsen"], ["--track", "mlflow"]):
        monkeypatch.setattr(sys, "argv", ["seed.py", *argv])
        with pytest.raises(SystemExit) as e:
            harness.parse_args(seed.Args, seed.PAPER, seed.LAPTOP)
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --upd" in err and "invalid choice: 'valid_unsen'" in err
    with pytest.raises(SystemExit, match="--guidance must be one of group, none, unaggregated, success_only"):
        grsd.resolve(grsd.Args(guidance="groups"))
    with pytest.raises(SystemExit, match="--save_every must be ≥ 1"):
        grsd.resolve(grsd.Args(save_every=0))
    with pytest.raises(SystemExit, match="--resume goes with neither --overwrite nor --eval_only"):
        grsd.resolve(grsd.Args(resume=True, eval_only=True))


def test_help_shows_defaults_and_what_none_resolves_to(monkeypatch, capsys):
    import opid
    monkeypatch.setattr(sys, "argv", ["opid.py", "--help"])
    with pytest.raises(SystemExit):
        harness.parse_args(opid.Args, opid.PAPER, opid.LAPTOP)
    out = " ".join(capsys.readouterr().out.split())
    assert "[default: alfworld 150, search 150, webshop 150, tiny model or household 2]" in out  # --updates
    assert "[default: alfworld 0.01, search 0.001, webshop 0.01, household 0.01]" in out          # --beta_kl
    assert "[default: 0.001]" in out and "{critical_first,episode_only,step_only,additive}" in out


@pytest.mark.parametrize("method", ["seed", "opid", "grsd", "baselines"])
def test_help_gives_the_value_each_env_resolves_to(method, monkeypatch, capsys, tmp_path):
    """Issue 54: `seed.py --help` said `household 30` for --max_steps, where household runs resolve to 6. For every
    flag whose default is None, the value --help names for an env (the paper model on a benchmark, the tiny model on
    household) is the one resolve() gives a run there."""
    import dataclasses
    import importlib
    import re
    mod = importlib.import_module(method)
    monkeypatch.setattr(sys, "argv", [f"{method}.py", "--help"])
    with pytest.raises(SystemExit):
        harness.parse_args(mod.Args, mod.PAPER, mod.LAPTOP)
    out = " ".join(capsys.readouterr().out.split())
    data = {"household": None, "alfworld": "alfworld", "search": "search_qa", "webshop": "webshop"}
    extra = {"method": "grpo"} if method == "baselines" else {}  # a recipe without a skill library (any env)
    resolved = {env: mod.resolve(mod.Args(env=env, data_dir=str(SHARED / d) if d else None, out_dir=str(tmp_path / env),
                                          **extra)) for env, d in data.items()}
    checked = 0
    for f in dataclasses.fields(mod.Args):
        shown = re.search(rf"--{f.name} {f.name.upper()} .*?\[default: ([^\]]*)\]", out)
        if f.default is not None or shown is None or f.name in extra:
            continue
        for part in shown[1].split(", "):
            env, value = part.rsplit(" ", 1) if " " in part else (None, part)
            env = "household" if env == "tiny model or household" else env
            if env not in resolved:
                continue  # a default that names no env (what None means is in the help line itself)
            assert str(getattr(resolved[env], f.name)) == value, (f.name, env, value)
            checked += 1
    assert checked >= 30 and re.search(r"--max_steps MAX_STEPS .*?household 6\]", out)


@pytest.mark.parametrize("method", ["seed", "opid", "grsd"])
def test_any_model_on_household_gets_the_laptop_preset_and_the_benchmarks_the_papers(method, tmp_path):
    """Issue 41: a model directory on household silently got the paper's scale (150 updates, 16 x 8 rollouts,
    512-token replies) on a laptop. Household is the laptop env: every model gets the laptop preset there, and an
    explicit size flag still wins; the benchmarks keep the paper's values."""
    import importlib
    mod = importlib.import_module(method)
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")  # resolve checks the files are there; nothing loads
    on_laptop = mod.resolve(mod.Args(model=str(model), out_dir=str(tmp_path / "a")))
    assert (on_laptop.updates, on_laptop.tasks_per_update, on_laptop.group_size, on_laptop.max_response_len,
            on_laptop.max_steps) == (2, 2, 4, 48, 6)
    assert mod.resolve(mod.Args(model=str(model), out_dir=str(tmp_path / "b"), updates=7)).updates == 7
    bench = mod.resolve(mod.Args(model=str(model), env="search", data_dir=str(SHARED / "search_qa"),
                                 out_dir=str(tmp_path / "c")))
    assert (bench.updates, bench.tasks_per_update, bench.max_response_len) == \
        (mod.PAPER["search"]["updates"], 128, 512)  # GRSD trains 240 updates, SEED and OPID 150


@pytest.mark.parametrize("tracker", ["wandb", "trackio"])
def test_a_tracker_without_its_package_is_named(tracker, tmp_path, monkeypatch):
    import opid
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == tracker else real(name, *a))
    with pytest.raises(SystemExit, match=f"--track {tracker} needs the {tracker} package: pip install {tracker}"):
        opid.resolve(opid.Args(out_dir=str(tmp_path), track=tracker))


def wandb_history(run_file: Path) -> list[dict]:
    """The history records of an offline W&B run file (`run-<id>.wandb`): a LevelDB-style log (7-byte header, 32 KiB
    blocks of [crc32c 4, length 2, type 1] chunks, 1 full / 2 first / 3 middle / 4 last) of wandb Record protobufs."""
    import struct
    from wandb.proto import wandb_internal_pb2
    data, pos, part, out = run_file.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == kind == 0:
            break
        part, pos = part + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            part = b""
            if record.WhichOneof("record_type") == "history":
                out.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return out


@pytest.mark.parametrize("tracker", ["wandb", "trackio"])
def test_a_run_sends_every_row_to_its_tracker(tracker, tmp_path, monkeypatch):
    """Issue 41: `--track wandb` (offline: no account, no network) and `--track trackio` (a local SQLite store),
    executed through harness.Run as a run logs: each update's scalars arrive at step update + 1, read back from the
    tracker's own files; the stage-1 row and a text value are not sent as scalars."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))  # read when trackio is imported
    pytest.importorskip(tracker, reason=f"pip install {tracker} (.ci/run installs it)")
    import seed
    import uuid
    out = tmp_path / f"run-{uuid.uuid4().hex[:8]}"  # the tracker's run name: seed:<this folder's name>
    args = seed.resolve(seed.Args(out_dir=str(out), updates=2, track=tracker))
    rows = [{"update": 0, "charts/success_rate": 0.25, "losses/total": 1.5e-5, "note": "text"},
            {"update": 1, "charts/success_rate": 0.5, "losses/total": 0.125}]
    with one_rank() as d:
        r = harness.Run(args, "seed", d, args.updates)
        for row in rows:
            r.log(dict(row))
        r.close()
    if tracker == "wandb":
        (run_file,) = out.glob("wandb/offline-run-*/run-*.wandb")
        got = [{k: h[k] for k in ("_step", "update", "charts/success_rate", "losses/total")}
               for h in wandb_history(run_file)]
    else:
        import sqlite3
        from trackio.utils import TRACKIO_DIR  # TRACKIO_DIR above, unless trackio was imported before this test
        with sqlite3.connect(Path(TRACKIO_DIR) / f"{harness.PROJECT}.db") as db:
            query = "select step, metrics from metrics where run_name = ? order by step"
            got = [{"_step": step, **{k: v for k, v in json.loads(m).items() if not k.startswith("_")}}
                   for step, m in db.execute(query, (f"seed:{out.name}",))]
    assert got == [{"_step": row["update"] + 1, **{k: v for k, v in row.items() if k != "note"}} for row in rows]


def test_bench_prices_unavoidable_work_at_grpos_rates():
    """bench.rates / lengths / price on hand-made rows: GRPO computes 3 passes of 3,000 tokens at 10 % padding
    (2,700 real each); scoring (2 passes) 1.08 s → 0.2 ms per real token; update 2.7 s → 1 ms; rollout generation
    3 s, of which 5,000 prompt tokens of prefill are 1 s → decode (3 − 1) s / 500 tokens = 4 ms."""
    grpo = [{"perf/padding_frac": 0.1, "perf/forward_tokens": 9000, "time/scoring": 1.08, "time/update": 2.7,
             "time/rollout_generation": 3.0, "perf/rollout_prompt_tokens": 5000, "perf/rollout_gen_tokens": 500}]
    r = bench.rates(grpo)
    assert r == pytest.approx({"score": 2e-4, "train": 1e-3, "decode": 4e-3})
    # GRSD: 1,000 teacher tokens, 100 reflection tokens scored and trained, 2,000 prompt tokens read and 50
    # generated outside its 400 + 4,000 rollout ones, 0.3 s waiting on the judge
    row = [{"perf/teacher_tokens": 1000, "perf/reflection_tokens": 100, "perf/generated_tokens": 450,
            "perf/rollout_gen_tokens": 400, "perf/prompt_tokens": 6000, "perf/rollout_prompt_tokens": 4000,
            "time/judge": 0.3}]
    p = bench.price("grsd", row, grpo)
    assert p["teacher_s"] == pytest.approx(1000 * 2e-4 + 100 * (2e-4 + 1e-3))  # 0.32 s
    assert p["generate_s"] == pytest.approx(2000 * 2e-4 + 50 * 4e-3)            # 0.6 s
    assert p["unavoidable_s"] == pytest.approx(0.32 + 0.6 + 0.3)
    # at a full-batch decode rate: GRSD's 4 reflection prompts (14 prompts − 10 rollout turns) read 2,000 tokens
    # and write 50: mean prompt 500, mean decode context 500 + 12.5 / 2; GRPO's turns decode at (5,000 + 500/2) / 10
    grpo[0]["perf/rollout_turns"] = 10
    row[0].update({"perf/teacher_seqs": 2, "perf/rollout_turns": 10, "perf/prompts": 14})
    assert bench.lengths(row) == {"teacher": 500, "prompt": 500, "decode_context": 506.25,
                                  "rollout_decode_context": (4000 + 400 / 2) / 10}
    assert bench.lengths(grpo)["rollout_decode_context"] == 525
    full = bench.price("grsd", row, grpo, decode_s=bench.at([[500, 1e-3], [525, 2e-3]], 506.25))  # 1.25 ms
    assert full["generate_s"] == pytest.approx(2000 * 2e-4 + 50 * 1.25e-3)
    assert bench.at([[1, 1.0], [3, 5.0], [4, 5.0]], 2) == 3 and bench.at([[1, 1.0], [3, 5.0]], 5) == 9 and \
        bench.at([[7, 2.0]], 100) == 2  # between, beyond the end, one point
    times = [{"time/total": t, "time/save": 0.5} for t in (11.0, 12.0, 13.0)]
    base = [{"time/total": t, "time/save": 0.5} for t in (10.0, 10.0, 11.0)]
    assert bench.paired_spread(times, base) == pytest.approx(3 ** -0.5)  # differences 1, 2, 2: sd √(1/3)


def test_threads_sets_torch_threads_for_the_run():
    import opid
    seen, before = [], torch.get_num_threads()
    try:
        harness.run_main(lambda a: seen.append(torch.get_num_threads()), opid.Args(threads=1))
    finally:
        torch.set_num_threads(before)
    assert seen == [1]
    with pytest.raises(SystemExit, match="--threads must be ≥ 1"):
        opid.resolve(opid.Args(threads=0))


def test_the_default_threads_are_half_the_cores_unless_omp_num_threads_says(monkeypatch):
    """Issue 41: torch's one thread per core ran `python opid.py` 2.5-3.6x slower while another run shared the 2 cores
    (harness.default_threads). The default is half the usable cores; OMP_NUM_THREADS (torchrun's 1) wins."""
    import opid
    seen, before = [], torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    try:
        harness.run_main(lambda a: seen.append(torch.get_num_threads()), opid.Args())
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
        harness.run_main(lambda a: seen.append(torch.get_num_threads()), opid.Args())
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        torch.set_num_threads(3)
        harness.run_main(lambda a: seen.append(torch.get_num_threads()), opid.Args())
    finally:
        torch.set_num_threads(before)
    assert seen == [4, 1, 3]


def test_record_keeps_the_first_n_and_counts_every_capped_reply():
    log = harness.Replies(2)
    log.record("analysis", ["p1", "p2", "p3"], ["a", "b", "c"], [True, False, True])
    log.record("judge", ["q1"], ["3"], 1)  # an endpoint: a count from finish_reason, per reply unknown
    with one_rank() as d:
        counts, kept = log.rows(4, d)
    assert counts == {"replies/analysis": 3, "replies/analysis_capped": 2, "replies/judge": 1,
                      "replies/judge_capped": 1}
    assert kept == [{"update": 4, "kind": "analysis", "prompt_tail": "p1", "reply": "a", "capped": True},
                    {"update": 4, "kind": "analysis", "prompt_tail": "p2", "reply": "b", "capped": False},
                    {"update": 4, "kind": "judge", "prompt_tail": "q1", "reply": "3", "capped": None}]
    assert log.kept == {} and log.count == {}  # emptied for the next update


@pytest.mark.slow
@pytest.mark.parametrize("method,kinds", [("seed", {"turn", "analysis"}), ("opid", {"turn", "analysis"}),
                                          ("grsd", {"turn", "reflection"})])
def test_log_samples_writes_readable_samples_and_counts_capped_replies(method, kinds, tmp_path):
    run(python(method, tmp_path, "--updates", "1", "--eval_every", "0", "--log_samples", "4"))
    every = [json.loads(x) for x in (tmp_path / "samples.jsonl").open()]
    assert {s["update"] for s in every} == ({-1, 0} if method == "seed" else {0})  # -1: SEED's stage 1, its own row
    samples = [s for s in every if s["update"] == 0]
    assert {s["kind"] for s in samples} >= kinds
    for kind in kinds:
        these = [s for s in samples if s["kind"] == kind]
        assert 1 <= len(these) <= 4 and all(isinstance(s["reply"], str) and s["prompt_tail"] for s in these)
    turns = [s for s in samples if s["kind"] == "turn"]
    assert all({"task", "action", "valid", "reward", "capped"} <= set(s) for s in turns)
    (row,) = [r for r in rows_of(tmp_path) if r.get("update") == 0 and "replies/turn" in r]
    assert row["replies/turn_capped"] == row["rollout/unterminated_responses"]  # the same count, two ways
    assert row["replies/turn"] == row["perf/rollout_turns"]
    if method == "seed":  # stage 1's annotations are counted in its row, not in update 0's
        (stage1,) = [r for r in rows_of(tmp_path) if r.get("stage") == 1]
        assert stage1["replies/analysis"] == stage1["sft/trajectories"] == 4  # --sft_tasks 2 × --sft_rollouts 2


def test_the_bar_counts_updates_and_shows_small_losses(tmp_path):
    """Before: SEED's bar showed 3/3 for 2 updates (stage 1 counted) and `loss=0` for losses/total = 1.57e-05
    (rounded to 4 decimals). The bar counts update rows (and an eval-only run's one), tqdm's 3 significant digits."""
    import seed
    args = seed.resolve(seed.Args(out_dir=str(tmp_path / "run"), updates=2))
    with one_rank() as d:
        r = harness.Run(args, "seed", d, args.updates)
        r.log({"stage": 1, "sft/trajectories": 4})
        r.log({"update": 0, "charts/success_rate": 0.25, "losses/total": 1.57e-05})
        after_one = (r.bar.n, r.bar.total, str(r.bar))
        r.log({"update": 1, "charts/success_rate": 0.5, "losses/total": float("nan")})  # null in the row: kept out
        r.close()
    assert after_one[:2] == (1, 2) and "loss=1.57e-5" in after_one[2] and "success=0.25" in after_one[2], after_one
    assert (r.bar.n, r.bar.total) == (2, 2) and "loss=1.57e-5" in str(r.bar)


def test_a_failing_run_ends_with_its_error_below_the_bar(tmp_path):
    """Before: a run stopped by a one-line refusal mid-run (a full disk while saving) printed the message, then its
    progress bar repainted below it at exit. run_main closes the bars first, for a refusal and a traceback alike."""
    script = ("import sys, types; sys.path.insert(0, {here!r}); import harness; from tqdm import tqdm\n"
              "def main(args):\n"
              "    bar = tqdm(total=3, desc='seed'); bar.update(1)\n"
              "    raise {error}\n"
              "harness.run_main(main, types.SimpleNamespace(threads=None, out_dir={out!r}))\n")
    for error, last in (("SystemExit('saving update2 failed: no space left on the device')",
                         "saving update2 failed: no space left on the device"),
                        ("ValueError('a traceback')", "ValueError: a traceback")):
        res = subprocess.run([sys.executable, "-c", script.format(here=str(HERE), error=error, out=str(tmp_path))],
                             cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=120)
        lines = [x for x in res.stderr.replace("\r", "\n").splitlines() if x.strip()]
        assert res.returncode == 1 and lines[-1] == last and any("1/3" in x for x in lines[:-1]), res.stderr[-1500:]


def test_identity_compare_names_each_difference_and_fails(tmp_path, capsys):
    """tools/identity.py (issue 42's behaviour check): identical files pass; a value changed in the last bit, a row
    missing, other weights or a configuration only on one side each fail, and are named."""
    from tools import identity
    row = {"update": 0, "losses/pg": 0.1 + 0.2, "charts/success_rate": 0.25}
    base = {"seed": {"rows": [row, {**row, "update": 1}], "weights": {"final/model.safetensors": "ab"}}}
    variants = {"value": {"seed": {**base["seed"], "rows": [{**row, "losses/pg": 0.3}, {**row, "update": 1}]}},
                "row": {"seed": {**base["seed"], "rows": [row]}},
                "weights": {"seed": {**base["seed"], "weights": {"final/model.safetensors": "cd"}}},
                "config": {**base, "opid": base["seed"]}}
    (tmp_path / "a.json").write_text(json.dumps(base))
    assert identity.compare(str(tmp_path / "a.json"), str(tmp_path / "a.json")) == 0
    assert "seed: identical (2 rows, 1 weight files)" in capsys.readouterr().out
    said = {"value": "row 0 losses/pg: 0.30000000000000004 != 0.3", "row": "2 rows != 1",
            "weights": "final weights differ", "config": "opid: only in"}
    for name, other in variants.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(other))
        assert identity.compare(str(tmp_path / "a.json"), str(tmp_path / f"{name}.json")) == 1, name
        assert said[name] in capsys.readouterr().out, name


def test_identity_runs_the_baselines_as_seed_flags_in_a_checkout_from_before_baselines_ran_alone(tmp_path):
    from tools import identity
    (tmp_path / "baselines.py").write_text("def baseline_update(): pass\n")
    cmd = identity.command(str(tmp_path), "sdar", "out")
    assert cmd[1:] == ["seed.py", "--out_dir", "out", "--threads", "1", *identity.BASELINE_FLAGS["sdar"]]
    assert identity.command(str(HERE), "sdar", "out")[1:] == ["baselines.py", "--out_dir", "out", "--threads", "1",
                                                              "--method", "sdar"]
