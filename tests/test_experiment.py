"""experiment.py's parts: the oracle endpoint over real HTTP, the warm-start data, and a 1-update smoke run."""
import json
from collections import Counter
import os
import random
import re
import shutil
import subprocess
import sys
import urllib.request

import pytest

import common as C
import harness
import models
import envs
from tools import backbone as B, experiment as E, mechanism as M, oracle as O
import grsd
import opid
import seed
from conftest import HERE, clean_env

EXPERIMENT = ["-m", "tools.experiment"]  # as the docs run it: from the checkout root (cwd=HERE)

SEEDS, MAX_STEPS = (0,), 15


@pytest.fixture(scope="module")
def oracle():
    o = O.Oracle(SEEDS)
    server = O.serve_oracle(o)
    client = harness.ChatClient(f"http://127.0.0.1:{server.server_address[1]}/v1", "oracle", "oracle", timeout=10,
                          retries=0)
    yield o, client, server.server_address[1]
    server.shutdown()


def episodes(n_tasks: int, eps: float, rng_seed: int = 3):
    """(env, task id, actions, trajectory, facts) of noisy-expert episodes on train tasks of layout seed 0."""
    env, rng = envs.HouseholdEnv("train", seed=0, max_steps=MAX_STEPS), random.Random(rng_seed)
    for task_id in env.task_ids()[:n_tasks]:
        _, actions = B.play(env, task_id, eps, rng)
        traj = B.as_trajectory(env, task_id, actions)
        facts, _ = O.replay(env, task_id, actions)
        yield env, task_id, actions, traj, facts


def start_location(task_id: str, obj: str) -> str:
    return envs.make_household_task(task_id, 0)["objects"][obj]["loc"]


def test_oracle_skills_parse_with_the_methods_parsers_and_are_true(oracle):
    o, client, _ = oracle
    n = 0
    for env, task_id, actions, traj, facts in episodes(24, 0.4):
        skill = seed.parse_skill(client.complete([{"role": "user", "content": seed.trajectory_input(traj)}], 0, 256))
        assert skill is not None and skill.startswith("Workflow:" if traj.won else "Avoid"), skill
        reply = client.complete([{"role": "user", "content": opid.analyzer_prompt(traj, 5)}], 0, 512)
        analysis, events = opid.parse_analysis(reply, len(traj.turns), 5)
        errors = {"no_json", "no_episode_skill", "bad_step_skills", "bad_key", "out_of_range", "bad_skill", "duplicate",
                  "truncated"}
        assert analysis is not None and not errors & set(events), (reply, events)
        assert analysis.episode == skill and set(analysis.steps) <= set(range(len(traj.turns)))
        for t in analysis.steps:  # invalid steps are critical ones
            if not traj.turns[t].valid:
                assert "admissible action" in analysis.steps[t]
        # Every "the <object> was at the <place>" is the object's true place when the trajectory saw it there.
        for obj, rec in re.findall(r"the (\w+ \d+) was (?:seen )?at the (\w+ \d+)", skill):
            assert start_location(task_id, obj) == rec and any(rec in (t.action or "") for t in traj.turns)
        n += 1
    assert n == 24 and o.stats["replayed/seed"] >= 24 and o.stats.get("fallback/seed", 0) == 0


def test_oracle_never_names_a_place_the_trajectory_did_not_show(oracle):
    """Privileged state checks statements, never leaks: without having seen the object, the skill names no place of
    the target object, only the places the trajectory searched or left unexplored."""
    _, client, _ = oracle
    checked = 0
    for env, task_id, actions, traj, facts in episodes(40, 1.0, rng_seed=5):  # random walks
        if facts.targets_seen:
            continue
        skill = seed.parse_skill(client.complete([{"role": "user", "content": seed.trajectory_input(traj)}], 0, 256))
        true_places = {o["loc"] for o in envs.make_household_task(task_id, 0)["objects"].values()
                       if o["type"] == facts.otype}
        named = set(re.findall(r"\b[a-z]+ \d+\b", skill))
        assert named <= set(facts.searched) | set(facts.unexplored) | {facts.target_rec}
        assert f"{facts.otype} " not in skill.replace(f"no {facts.otype} was", "")  # no object instance named
        assert not true_places & set(facts.searched)  # "no <object> was at <searched>" is true
        assert true_places & named <= set(facts.unexplored)  # a suggestion to search there, not a fact
        checked += 1
    assert checked >= 5


def test_oracle_judge_scores_true_reflections_high_and_invented_ones_zero(oracle):
    _, client, _ = oracle
    for env, task_id, actions, traj, facts in episodes(12, 0.3):
        good = O.reflection(facts)
        assert grsd.parse_reflection(good) == good
        ask = lambda r: grsd.parse_judge(client.complete(  # noqa: E731
            [{"role": "user", "content": grsd.judge_prompt(traj, r, 400)}], 0, 16))
        assert ask(good) >= 2, good
        assert ask("1. Go to the safe 9.\n2. Take the ghost 7 there.\n3. Then stop.") == 0  # never shown
        wrong_outcome = "1. It succeeded.\n2. The task was done.\n3. Repeat this order." if not traj.won else \
            "1. I failed and ran out of steps.\n2. It was invalid.\n3. It was wrong."
        assert ask(wrong_outcome) == 0


@pytest.mark.parametrize("prompt", [
    "", "hello", "Task: put a mug in shelf.\n" + seed.ANALYZER_INSTRUCTIONS,
    "Task: put a candle in bed.\nTrajectory:\nInitial observation: You are in the middle of a room.\nStep 1\n  Action: "
    "go to the moon\n  Observation: Nothing happens.\n  Reward: 0\n\n" + seed.ANALYZER_INSTRUCTIONS,
    "Task: \u00e9\u6f22\ud83d\ude00\nTrajectory:\n" + "Step 1\n  Action: x\n" * 500 + seed.ANALYZER_INSTRUCTIONS,
    opid.ANALYZER_INSTRUCTIONS.format(k=5),
    "Grade an agent's reflection; Task: x\nReflection:\n1. a\n\nCriteria: none"])
def test_oracle_answers_odd_trajectories_without_crashing(oracle, prompt):
    o, client, _ = oracle
    reply = client.complete([{"role": "user", "content": prompt}], 0, 64)
    assert isinstance(reply, str) and o.stats.get("errors", 0) == 0
    role = O.role_of(prompt)
    if role == "seed":
        assert seed.parse_skill(reply) is not None  # the generic fallback is still a well-formed skill
    if role == "opid":
        assert opid.parse_analysis(reply, 1, 5)[0] is not None


def test_oracle_http_contract(oracle):
    o, _, port = oracle
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    bad = urllib.request.Request(url, data=b"{not json", headers={"Content-Type": "application/json"}, method="POST")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(bad, timeout=5)
    assert e.value.code == 400
    parts = json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}).encode()
    with urllib.request.urlopen(urllib.request.Request(url, data=parts, method="POST"), timeout=5) as r:
        assert json.loads(r.read())["choices"][0]["message"]["content"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/stats", timeout=5) as r:
        stats = json.loads(r.read())
    assert stats.get("requests/None", 0) >= 1


def test_oracle_concurrent_requests_get_the_sequential_replies(oracle):
    """The server's threads share one replay env per layout seed: concurrent requests must not interleave their
    resets and steps (an interleaved replay fails and the trajectory gets the generic fallback)."""
    from concurrent.futures import ThreadPoolExecutor
    o, client, _ = oracle
    prompts = [seed.trajectory_input(traj) for *_, traj, _ in episodes(16, 0.3, rng_seed=7)] * 4
    want = [o.reply(p) for p in prompts[:16]] * 4
    before, interval = o.stats.get("fallback/seed", 0), sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, as a loaded machine does
    try:
        with ThreadPoolExecutor(16) as pool:
            got = list(pool.map(lambda p: client.complete([{"role": "user", "content": p}], 0, 256), prompts))
    finally:
        sys.setswitchinterval(interval)
    assert got == want and o.stats.get("fallback/seed", 0) == before


def test_warm_start_data_labels_are_admissible_and_hints_true():
    pairs = B.warm_start_data(n_tasks=6, max_steps=MAX_STEPS, hindsight=True)  # stage 2's data: all of it
    kinds = {k for k, _, _ in pairs}
    assert kinds == {"act", "skill", "reflect", "guide"}
    hinted = 0
    for k, user, response in pairs:
        if k == "act":
            action, valid = envs.parse_action(response)
            admissible = re.search(r"Admissible actions: \[(.*)\]", user).group(1)
            assert valid and f"'{action}'" in admissible, (action, admissible)
            hinted += any(h in user for h in ("Hindsight skill", "[Privileged guidance"))
        elif k == "skill":
            assert seed.parse_skill(response) and user.endswith(seed.ANALYZER_INSTRUCTIONS)
        elif k == "reflect":
            assert grsd.parse_reflection(response) == response
        else:
            assert response.startswith("### DO\n- ") and "### AVOID" in response
    assert hinted > 0
    # The hints: every place a hint gives for an object is where that object starts (seed_skill on clean episodes).
    for data_seed in B.DATA_SEEDS:
        env = envs.HouseholdEnv("train", seed=data_seed, max_steps=30)  # the expert wins every task within 30 steps
        for task_id in env.task_ids()[:6]:
            _, actions = B.play(env, task_id, 0.0, random.Random(0), invalid=0.0, hinted=True)
            ok, _ = O.replay(env, task_id, actions)
            assert ok.won
            spec = envs.make_household_task(task_id, data_seed)
            for text in (O.seed_skill(ok), O.guidance("", [ok], [])):
                for rec, obj in re.findall(r"Go to the (\w+ \d+) and take the (\w+ \d+)", text):
                    assert spec["objects"][obj]["loc"] == rec
                for obj, rec in re.findall(r"the (\w+ \d+) was at the (\w+ \d+)", text):
                    assert spec["objects"][obj]["loc"] == rec


def test_hindsight_hinted_pairs_carry_the_episode_skill_and_the_expert_label():
    """Stage 2's pairs: one per state of a searcher's episode that saw a needed object (none otherwise), the prompt
    carrying that episode's own hindsight text in one method's format (OPID's step skill exactly at its critical
    steps), the response the privileged expert's at that state; the place the skill gives is where the object was."""
    rng, made, styles = random.Random(0), 0, Counter()
    for task_id in envs.HouseholdEnv("train", seed=B.DATA_SEEDS[0], room="small").task_ids()[:12]:
        env = envs.HouseholdEnv("train", seed=B.DATA_SEEDS[0], max_steps=MAX_STEPS, room="small")
        clean, acts = B.play(env, task_id, 0.0, rng, invalid=0.0, hinted=True)
        ok = O.replay(env, task_id, acts)[0]
        states, acts = B.play(env, task_id, 0.6, rng)
        f = O.replay(env, task_id, acts)[0]
        pairs = B.hindsight_hinted(states, f, ok, rng)
        if O.first_target(f) is None:
            assert pairs == []
            continue
        made += 1
        assert len(pairs) == len(states)
        critical = O.step_skills(f, 5)
        spec = envs.make_household_task(task_id, B.DATA_SEEDS[0], room="small")
        for t, ((kind, user, response), (prompt, _, _, expert)) in enumerate(zip(pairs, states)):
            assert kind == "act" and response == expert
            skill = O.seed_skill(f)
            opid_text = opid.inject_skill(prompt, step=critical[t])[0] if t in critical else \
                opid.inject_skill(prompt, episode=skill)[0]  # critical-first routing
            style = {seed.inject_skill(prompt, skill): "seed", opid_text: "opid",
                     grsd.inject_guidance(prompt, O.guidance(f.task, [f] if f.won else [ok], [] if f.won else [f])):
                     "grsd"}.get(user)
            assert style, user
            styles[style] += 1
            action, valid = envs.parse_action(response)
            assert valid and f"'{action}'" in re.search(r"Admissible actions: \[(.*)\]", prompt).group(1)
            for obj, rec in re.findall(r"the (\w+ \d+) was (?:seen )?at the (\w+ \d+)", user):
                assert spec["objects"][obj]["loc"] == rec
    assert made >= 3 and len(styles) == 3, (made, styles)


def test_clone_loss_is_the_response_nll_plus_weighted_prompt_nll():
    """Against common.sequence_logprobs (left-padded, the trainer's scorer) and a per-row recomputation."""
    import torch
    tok, model = models.load_tokenizer("tiny"), models.load_model("tiny", 0)
    rows = [(C.chat_ids(tok, "put a mug in shelf."), tok("<think>go</think><action>look</action>")["input_ids"]),
            (C.chat_ids(tok, "a longer prompt: go to cabinet 1, open it"), tok("x")["input_ids"])]
    with torch.no_grad():
        logp, mask = C.sequence_logprobs(model, [p for p, _ in rows], [r for _, r in rows], torch.device("cpu"))
        resp_nll = -(logp * mask).sum() / mask.sum()
        prompt_nll = []
        for p, _ in rows:  # token t of the prompt predicted from tokens < t, row by row (no padding at all)
            lp = torch.log_softmax(model(input_ids=torch.tensor([p])).logits[0, :-1].float(), -1)
            prompt_nll.append(-lp[torch.arange(len(p) - 1), torch.tensor(p[1:])])
        prompt_nll = torch.cat(prompt_nll).mean()
        assert abs(B.clone_loss(model, rows, 0.0) - resp_nll) < 1e-5
        assert abs(B.clone_loss(model, rows, 0.5) - (resp_nll + 0.5 * prompt_nll)) < 1e-5


def test_warm_start_resumes_bit_equal_and_follows_its_schedule(tmp_path):
    """A warm start killed after its first check and run again ends with the weights of an uninterrupted one; the
    learning-rate factor is 20 warm-up steps, flat, then a cosine to 0.1."""
    import torch
    from safetensors.torch import load_file
    assert [B.bc_lr(i, 100, 50) for i in (0, 19, 49)] == [0.05, 1.0, 1.0]
    assert B.bc_lr(75, 100, 50) == pytest.approx(0.55) and B.bc_lr(100, 100, 50) == pytest.approx(0.1)
    quiet = lambda *a: None  # noqa: E731
    torch.set_num_threads(1)
    small = dict(n_tasks=2, batch=4, decay_from=2, select_tasks=4)  # 4 held-out tasks judge each check
    whole = B.warm_start(str(tmp_path / "a"), 4, (2, 4), 2, **small, log=quiet)
    (tmp_path / "b").mkdir()
    os.system(f"cp -r {tmp_path / 'a' / 'step2'} {tmp_path / 'b'}")  # the state a kill after check 2 leaves
    resumed = B.warm_start(str(tmp_path / "b"), 4, (2, 4), 2, **small, log=quiet)
    assert resumed["resumed_at"] == 2 and whole["resumed_at"] is None
    assert [h["nll"] for h in resumed["history"]] == [h["nll"] for h in whole["history"]]
    a, b = (load_file(str(tmp_path / d / "step4" / "model.safetensors")) for d in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert whole["step"] == 4  # no check reached the target: the best one, the later on a tie
    (tmp_path / "c").mkdir()  # a check saved without training state: fresh AdamW moments, steps 3-4 only
    os.system(f"cp -r {tmp_path / 'a' / 'step2'} {tmp_path / 'c'} && rm {tmp_path / 'c' / 'step2' / 'train_state.pt'}")
    said = []
    fresh = B.warm_start(str(tmp_path / "c"), 4, (2, 4), 2, **small, log=said.append)
    assert fresh["resumed_at"] == 2 and [h["step"] for h in fresh["history"]] == [3, 4]
    assert any("fresh AdamW moments" in line for line in said) and (tmp_path / "c" / "config.json").is_file()
    c = load_file(str(tmp_path / "c" / "step4" / "model.safetensors"))
    assert not all(torch.equal(a[k], c[k]) for k in a)  # other moments, another batch order: other weights


def test_launch_all_skips_finished_runs_and_restarts_killed_ones(tmp_path):
    """A run dir with done.json is skipped; one without (the run was killed) is emptied and run again, so a rerun of
    a sitting never trips over a half-written run; on_done sees only clean exits."""
    job = tmp_path / "job.py"  # writes a marker, fails if the killed run's leftover is still there
    job.write_text("import os, sys\nout = sys.argv[sys.argv.index('--out_dir') + 1]\n"
                   "sys.exit(3 if os.path.exists(os.path.join(out, 'stale')) else 0)\n")
    for name in ("done", "killed"):
        (tmp_path / name).mkdir()
    (tmp_path / "done" / "done.json").write_text("{}")
    (tmp_path / "killed" / "stale").write_text("half a run")
    seen, said = [], []
    out = E.launch_all([(n, [str(job), "--out_dir", str(tmp_path / n)]) for n in ("done", "killed", "fresh")], 1, 1,
                       on_done=lambda name, out_dir, s: seen.append(name), log=said.append)
    assert set(out) == {"killed", "fresh"} and all(rc == 0 for rc, _ in out.values()), out
    assert seen == ["killed", "fresh"] and not (tmp_path / "killed" / "stale").exists()
    assert (tmp_path / "killed" / "done.json").is_file() and any("starting over" in line for line in said)


@pytest.mark.slow
def test_experiment_smoke_run(tmp_path):
    """The whole script at 1 update and 1 seed: backbone, mechanism, hints, the dev probe, 4 methods + the backbone
    evals, results JSONL, table and curves; a rerun of `runs` resumes run by run. Two runs at a time on 1 thread each
    (`--parallel 2`: both cores, two runs at once against one oracle server). It begins as a fresh clone would, with
    the README's learning-curve command: `curve --smoke` builds the smoke backbone the rest then uses."""
    out = tmp_path / "exp"
    env = clean_env()
    # the README's learning-curve command, at 1 update, in a folder with no backbone: its own record and plot
    curve = subprocess.run([sys.executable, *EXPERIMENT, "curve", "--smoke", "--out", str(out), "--threads", "1"],
                           capture_output=True, text=True, timeout=600, env=env, cwd=HERE)
    assert curve.returncode == 0, curve.stdout[-3000:] + curve.stderr[-3000:]
    assert "[experiment] curve: GRPO on layout 0, valid_seen" in curve.stdout and (out / "curve.png").is_file()
    assert (out / "backbone" / "warm_start.json").is_file()
    assert [r["name"] for r in E.load_results(str(out / "curve" / "runs.jsonl"))] == ["curve-grpo-s0"]
    r = subprocess.run([sys.executable, *EXPERIMENT, "--smoke", "--out", str(out), "--threads", "1", "--parallel", "2"],
                       capture_output=True, text=True, timeout=900, env=env, cwd=HERE)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    events = [ln.split(": ", 1)[1].split()[0] for ln in r.stdout.splitlines()
              if ln.startswith("[experiment] ") and ln.split(": ", 1)[-1].startswith(("started", "exit"))]
    assert events[:2] == ["started", "started"], events  # the second run began before the first ended
    assert (out / "backbone" / "config.json").is_file() and (out / "backbone" / "tokenizer.json").is_file()
    first = json.loads((out / "backbone_clone" / "warm_start.json").read_text())
    second = json.loads((out / "backbone" / "warm_start.json").read_text())  # stage 2 from stage 1's kept check
    assert not first["hindsight"] and second["hindsight"] and second["init"].endswith(f"step{first['step']}")
    assert first["step"] < second["step"] <= first["step"] + 2
    results = out / "results"
    records = {x["name"]: x for x in E.load_results(str(results / "runs.jsonl"))}
    assert set(records) == {"backbone-dev-s100", "grpo-dev-lr0.0001-s100", "backbone-s0"} | {f"{m}-s0" for m in E.METHODS}
    for m in E.METHODS:
        rec = records[f"{m}-s0"]
        assert rec["phase"] == "final" and rec["lr"] == 1e-4 and [e["update"] for e in rec["evals"]] == [1]
        assert set(rec["evals"][0]) == {"update", "valid_seen"} and rec["train"][0]["update"] == 1  # seen alone
        rows = E.read_rows(str(out / f"{m}-s0"))  # the record is the run's own metrics
        assert rec["evals"][0]["valid_seen"] == [x for x in rows if "update" in x][-1]["eval/success"]
    assert records["backbone-s0"]["evals"][0]["update"] == 0
    stats = json.loads((out / "oracle_stats_final.json").read_text())
    assert stats["replayed/seed"] > 0 and stats["replayed/opid"] > 0 and not any(k.startswith("fallback") for k in stats)
    mech = json.loads((results / "mechanism.json").read_text())
    assert [(x["method"], x["source"]) for x in mech["rows"]] == list(M.ROWS) and "met" in mech["gate"]
    assert set(json.loads((results / "hints.json").read_text())["styles"]) == {"none", *B.HINT_STYLES}
    table = (results / "table.md").read_text()
    assert all(f"| {m} | 1 |" in table for m in ("backbone",) + E.METHODS) and "| 0.0001 | 1 |" in table
    assert (results / "curves.png").stat().st_size > 10_000
    shutil.rmtree(out / "grpo-s0")  # as on a fresh machine: runs/ is gone, the record stays
    again = subprocess.run([sys.executable, *EXPERIMENT, "runs", "--smoke", "--out", str(out)],
                           capture_output=True, text=True, timeout=300, env=env, cwd=HERE)
    assert again.returncode == 0 and again.stdout.count("runs.jsonl, skipped") == 5, again.stdout  # resumes by record
    assert (results / "table.md").read_text() == table and not (out / "grpo-s0").exists()
    digest = json.loads((results / "backbone.json").read_text())
    assert digest["sha256"] == E.backbone_digest(str(out / "backbone")) and digest["step"] == second["step"]
    (results / "backbone.json").write_text(json.dumps({**digest, "sha256": "0" * 64}))  # a rebuild that differs
    refused = subprocess.run([sys.executable, *EXPERIMENT, "runs", "--smoke", "--out", str(out)],
                             capture_output=True, text=True, timeout=300, env=env, cwd=HERE)
    assert refused.returncode != 0 and "is not the one the runs" in refused.stderr, refused.stderr[-2000:]
    assert f"move {out} away and run this again" in refused.stderr, refused.stderr[-2000:]
    (results / "backbone.json").write_text(json.dumps(digest))
    scaled = subprocess.run([sys.executable, *EXPERIMENT, "scaled", "--smoke", "--out", str(out),
                             "--threads", "1", "--parallel", "2"], capture_output=True, text=True, timeout=600, env=env,
                            cwd=HERE)
    assert scaled.returncode == 0, scaled.stdout[-3000:] + scaled.stderr[-3000:]
    records = E.load_results(str(results / "runs.jsonl"))
    check = E.scaled_dev_check(records, 1e-4)
    for arm in E.SCALED_METHODS:  # dev run with its coefficient; a final run exactly when the check passes
        argv = json.loads((out / f"{arm}-dev-s100" / "done.json").read_text())["argv"]
        assert argv[-2:] == E.SCALED[arm.removesuffix("_scaled")] and check[arm] is not None
        assert (f"{arm}-s0" in {r["name"] for r in records}) == (check[arm] >= E.SCALED_FLOOR)
    assert "## Scaled arm (`scaled`), dev layouts" in (results / "table.md").read_text()
    # the curve again, after the study: its record is kept (not run again), nothing is added to the study's record
    curve = subprocess.run([sys.executable, *EXPERIMENT, "curve", "--smoke", "--out", str(out), "--threads", "1"],
                           capture_output=True, text=True, timeout=300, env=env, cwd=HERE)
    assert curve.returncode == 0 and "curve-grpo-s0: recorded in" in curve.stdout, curve.stdout[-3000:] + curve.stderr
    assert [r["name"] for r in E.load_results(str(out / "curve" / "runs.jsonl"))] == ["curve-grpo-s0"]
    assert "curve-grpo-s0" not in {r["name"] for r in E.load_results(str(results / "runs.jsonl"))}


def test_smoke_runs_default_to_their_own_folder(capsys):
    """A smoke backbone or plot never lands in the real run's folder: --smoke has its own default --out, and refuses
    the real one."""
    assert E.parse_args(["curve"]).out == E.OUT
    assert E.parse_args(["curve", "--smoke"]).out == E.SMOKE_OUT != E.OUT
    assert E.parse_args(["curve", "--smoke", "--out", "elsewhere"]).out == "elsewhere"
    with pytest.raises(SystemExit):
        E.parse_args(["curve", "--smoke", "--out", E.OUT])
    assert "not the real run's" in capsys.readouterr().err


def test_backbone_mismatch_names_the_folder_to_move_away(tmp_path):
    """check_backbone records the digest on first use; a backbone that differs later is refused with the folder to
    move away, in one line."""
    backbone, results = tmp_path / "exp" / "backbone", tmp_path / "results"
    backbone.mkdir(parents=True)
    results.mkdir()
    for name, text in (("model.safetensors", "weights"), ("tokenizer.json", "{}"),
                       ("warm_start.json", json.dumps({"step": 6, "select_success": 0.0}))):
        (backbone / name).write_text(text)
    E.check_backbone(str(backbone), str(results), str(tmp_path / "exp"))
    assert json.loads((results / "backbone.json").read_text())["sha256"] == E.backbone_digest(str(backbone))
    E.check_backbone(str(backbone), str(results), str(tmp_path / "exp"))  # the same backbone passes
    (backbone / "model.safetensors").write_text("rebuilt")
    with pytest.raises(SystemExit) as refused:
        E.check_backbone(str(backbone), str(results), str(tmp_path / "exp"))
    message = str(refused.value)
    assert message.endswith(f"move {tmp_path / 'exp'} away and run this again") and "\n" not in message, message


def test_report_regenerates_the_committed_table(tmp_path):
    """docs/results/table.md is what `python -m tools.experiment report` makes from docs/results/runs.jsonl."""
    committed = os.path.join(E.RESULTS, "runs.jsonl")
    if not os.path.isfile(committed):
        pytest.skip("no committed results yet")
    os.system(f"cp {committed} {tmp_path}/runs.jsonl")
    text = E.report(str(tmp_path), log=lambda *a: None)
    assert text == open(os.path.join(E.RESULTS, "table.md")).read()


def test_the_committed_backbone_is_the_one_the_runs_record():
    """docs/results/backbone (what `runs` uses on a fresh machine) has the digest docs/results/backbone.json holds."""
    path = os.path.join(E.RESULTS, "backbone")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        pytest.skip("no committed backbone")
    recorded = json.load(open(os.path.join(E.RESULTS, "backbone.json")))
    assert E.backbone_digest(path) == recorded["sha256"] and len(recorded["sha256"]) == 64
    assert json.load(open(os.path.join(path, "warm_start.json")))["step"] == recorded["step"]


def test_comparison_table_by_hand(tmp_path):
    """Paired gains and differences with 95 % t intervals, by hand: 3 seeds."""
    def rec(name, method, seed, seen, phase="final", lr=1e-4):
        return {"name": name, "phase": phase, "method": method, "seed": seed, "lr": lr, "seconds": 60.0,
                "evals": [{"update": 0 if method == "backbone" else 10, "valid_seen": seen, "valid_unseen": 0.0}],
                "train": [{"update": 1, "success": 0.5, "invalid": 0.1}], "time_per_update": {}}
    base, grpo, seed_m = (0.2, 0.3, 0.1), (0.4, 0.4, 0.4), (0.5, 0.4, 0.6)
    records = [rec(f"b{s}", "backbone", s, v) for s, v in enumerate(base)] + \
        [rec(f"g{s}", "grpo", s, v) for s, v in enumerate(grpo)] + [rec(f"s{s}", "seed", s, v) for s, v in enumerate(seed_m)]
    for r in records:
        E.append_result(str(tmp_path / "runs.jsonl"), r)
    assert len(E.load_results(str(tmp_path / "runs.jsonl"))) == 9
    table = E.comparison_table(E.load_results(str(tmp_path / "runs.jsonl")))
    # GRPO gains (0.2, 0.1, 0.3): mean 0.2, sd 0.1, half-width 4.303 * 0.1 / sqrt(3) = 0.2484
    assert "| grpo | 3 | 40.0 ± 0.0 % | +20.0 [-4.8, +44.8] | – |" in table
    # SEED gains (0.3, 0.1, 0.5): mean 0.3, sd 0.2, half-width 0.4969; SEED − GRPO (0.1, 0, 0.2): GRPO's half-width
    assert "| seed | 3 | 50.0 ± 10.0 % | +30.0 [-19.7, +79.7] | +10.0 [-14.8, +34.8] |" in table
    mu, half = E.mean_ci([0.2, 0.1, 0.3])
    assert mu == pytest.approx(0.2) and half == pytest.approx(4.303 * 0.1 / 3 ** 0.5)
    # two layouts give no interval: two equal differences would otherwise print "+5.0 [+5.0, +5.0]"
    assert E.mean_ci([0.05, 0.05]) == (pytest.approx(0.05), None) and E.fmt_ci(*E.mean_ci([0.05, 0.05])) == "+5.0"
    # one run: no spread and no interval; OPID on layout 0 is 0.25 (backbone 0.2, GRPO 0.4)
    one = E.comparison_table(E.load_results(str(tmp_path / "runs.jsonl")) + [rec("o0", "opid", 0, 0.25)])
    assert "| opid | 1 | 25.0 % | +5.0 | -15.0 |" in one
    assert E.best_dev_lr([rec("d1", "grpo", 100, 0.3, "dev", 1e-4), rec("d2", "grpo", 100, 0.5, "dev", 3e-4)]) == 3e-4
    # per layout: each run against its own layout's backbone; a run not done yet is "·"
    layouts = E.layout_table(E.load_results(str(tmp_path / "runs.jsonl")) + [rec("b3", "backbone", 3, 0.25)])
    assert "| 0 | 20.0 % | 40.0 % (+20.0) | 50.0 % (+30.0) | · | · |" in layouts
    assert "| 3 | 25.0 % | · | · | · | · |" in layouts and len(layouts.splitlines()) == 2 + 4


def test_scaled_arm_flags_parse_to_the_stated_coefficients(monkeypatch):
    """A scaled arm's argv is its paper method's argv plus SCALED's one coefficient, and the method's own CLI reads
    it back as that value (a later flag wins); the paper arms keep the paper values."""
    b = E.Budget()
    for arm, mod, field, want, paper in [("seed_scaled", seed, "lambda_opd", 0.3, 0.01),
                                         ("opid_scaled", opid, "lambda_skill", 4.0, 0.001),
                                         ("grsd_scaled", grsd, "lambda_mod", 2.5, 0.5)]:
        script, extra = E.run_flags(arm, "http://127.0.0.1:1/v1", b, 1e-5)
        paper_script, paper_extra = E.run_flags(arm.removesuffix("_scaled"), "http://127.0.0.1:1/v1", b, 1e-5)
        assert script == paper_script == f"{mod.__name__}.py" and extra[:len(paper_extra)] == paper_extra
        for flags, value in ((extra, want), (paper_extra, paper)):
            monkeypatch.setattr(sys, "argv", [script] + E.shared_flags(b, "m", 0, "o", 1e-5) + flags)
            assert getattr(harness.parse_args(mod.Args, mod.PAPER, mod.LAPTOP), field) == value
    monkeypatch.setattr(sys, "argv", ["grsd.py"] + E.run_flags("grsd_scaled", "u", b, 1e-5)[1])
    g = harness.parse_args(grsd.Args, grsd.PAPER, grsd.LAPTOP)
    assert g.lambda_mod * g.g_hat == pytest.approx(0.5)  # Â/A within [0.5, 1.5]: no sign flips (Prop. 2)


def test_scaled_arm_dev_check_pairs_by_layout_and_gates_the_final_runs():
    """scaled_dev_check by hand: the mean over dev layouts of (arm − GRPO at the same lr); an arm below SCALED_FLOOR,
    or with a dev layout missing, gets no final runs; the final runs go layout by layout."""
    def rec(method, seed, seen, lr=1e-5):
        return {"name": f"{method}-dev-s{seed}", "phase": "dev", "method": method, "seed": seed, "lr": lr,
                "seconds": 1.0, "evals": [{"update": 10, "valid_seen": seen}], "train": [], "time_per_update": {}}
    records = [rec("grpo", 100, 0.40), rec("grpo", 101, 0.30), rec("grpo", 100, 0.90, lr=1e-4),  # other lr: unused
               rec("seed_scaled", 100, 0.45), rec("seed_scaled", 101, 0.30),  # (+0.05 + 0) / 2 = +0.025
               rec("opid_scaled", 100, 0.20), rec("opid_scaled", 101, 0.20),  # (−0.20 − 0.10) / 2 = −0.15
               rec("grsd_scaled", 100, 0.60)]                                  # layout 101 not done
    check = E.scaled_dev_check(records, 1e-5)
    assert check["seed_scaled"] == pytest.approx(0.025) and check["opid_scaled"] == pytest.approx(-0.15)
    assert check["grsd_scaled"] is None
    b = E.Budget()
    assert E.planned_runs(b, "scaled", 1e-5, records) == [(f"seed_scaled-s{s}", "seed_scaled", s, 1e-5) for s in b.seeds]
    assert [n for n, *_ in E.planned_runs(b, "scaled-dev", 1e-5, [])] == [
        f"{m}_scaled-dev-s{s}" for s in b.dev_seeds for m in ("seed", "opid", "grsd")]
    final = [n for n, *_ in E.planned_runs(b, "final", 1e-5, [])]
    assert final[:10] == [f"backbone-s{s}" for s in b.seeds] + [f"grpo-s{s}" for s in b.seeds]
    assert final[10:13] == ["seed-s0", "opid-s0", "grsd-s0"] and len(final) == 25
    table = E.scaled_dev_table(records)
    assert "| opid_scaled | --lambda_skill 4 | 20.0 % (40.0 %) | 20.0 % (30.0 %) | -15.0 | no (< -10) |" in table
    assert "| seed_scaled | --lambda_opd 0.3 | 45.0 % (40.0 %) | 30.0 % (30.0 %) | +2.5 | yes |" in table
    assert "| grsd_scaled | --lambda_mod 2.5 | 60.0 % (40.0 %) | · | · | · |" in table


def test_learning_regime_plan_flags_and_sample_efficiency_by_hand(monkeypatch):
    """The learning regime: each candidate's run carries its overrides as flags (and the smoke keeps its size); the
    learn phase reuses the final phase's backbone evaluations, runs GRPO on every layout first, then the methods
    layout by layout; efficiency_table counts, per seed, the updates until the 3-update running mean of training
    success first reaches GRPO's final one (hand-computed below)."""
    b = E.Budget()
    for cand, over in E.LEARN_DEV.items():
        jb = E.job_budget(b, f"learn-dev-{cand}-s100")
        flags = E.shared_flags(jb, "m", 100, "o", jb.lr)
        for k, v in over.items():
            assert flags[flags.index(f"--{k}") + 1] == str(v), (cand, k)
    monkeypatch.setattr(E, "LEARN_PICK", None)
    with pytest.raises(SystemExit, match="no learning regime is frozen yet"):
        E.job_budget(b, "learn-grpo-s0")
    monkeypatch.setattr(E, "LEARN_PICK", "t04-g8-kl01-lr3e-5")
    assert E.job_budget(b, "grpo-s0") is b and E.job_budget(b, "learn-opid-s3") == E.job_budget(b, "curve-grpo-s0")
    assert E.job_budget(b, "learn-grpo-s1").temperature == 0.4
    assert E.job_budget(b, "learn-grpo-s1").eval_every == E.LEARN_DEV["t04-g8-kl01-lr3e-5"]["updates"]  # once, at the end
    small = E.job_budget(b, "learn-grpo-s0", smoke=True)
    assert (small.updates, small.group_size, small.lr) == (1, 2, E.LEARN_DEV[E.LEARN_PICK]["lr"])
    plan = [n for n, *_ in E.planned_runs(b, "learn", 1e-4, [])]
    assert plan[:10] == [f"backbone-s{s}" for s in b.seeds] + [f"learn-grpo-s{s}" for s in b.seeds]
    assert plan[10:13] == ["learn-seed-s0", "learn-opid-s0", "learn-grsd-s0"] and len(plan) == 25
    assert [n for n, *_ in E.planned_runs(b, "learn-dev", 0, [])] == [f"learn-dev-{c}-s100" for c in E.LEARN_DEV] + \
        [f"learn-dev-{c}-s101" for c in E.LEARN_CONFIRM]  # a candidate that gained on layout 100 is re-run on 101

    def rec(method, seed, train):
        return {"name": f"learn-{method}-s{seed}", "phase": "learn", "method": method, "seed": seed, "lr": 1e-4,
                "seconds": 60.0, "evals": [{"update": len(train), "valid_seen": 0.5}], "time_per_update": {},
                "train": [{"update": u + 1, "success": x, "invalid": 0.2} for u, x in enumerate(train)]}
    records = [rec("grpo", 0, [0.0, 0.3, 0.3, 0.6]),   # running means 0, .15, .2, .4: final .4
               rec("seed", 0, [0.6, 0.6, 0.0, 0.0]),   # .6 at update 1: reaches it at once
               rec("opid", 0, [0.0, 0.0, 0.3, 0.3]),   # .0, .0, .1, .2: never
               rec("grpo", 1, [0.2, 0.2, 0.2, 0.2]),   # final .2
               rec("seed", 1, [0.0, 0.3, 0.3, 0.3])]   # 0, .15, .2: update 3
    assert E.train_curve(records[0], [1, 2, 3, 4]) == pytest.approx([0.0, 0.15, 0.2, 0.4])
    table = E.efficiency_table(records)
    assert "| seed | 2 | 2.0 | 2 of 2 |" in table and "| opid | 1 | – | 0 of 1 |" in table
    assert "| grpo | 2 | 2.5 | 2 of 2 |" in table  # its own final value: at update 4 (seed 0) and 1 (seed 1)


def test_curve_band_starts_each_run_from_its_own_layouts_backbone():
    """`curve`'s band (held_out_band): at update 0 each committed run starts from its own layout's backbone, not
    layout 0's (the plot had pinned update 0 to layout 0's backbone with zero spread); an update missing from any
    run, or a layout without a backbone record, drops that point."""
    def rec(seed, evals):
        return {"seed": seed, "evals": [{"update": u, "valid_seen": v} for u, v in evals]}
    bases = {0: rec(0, [(0, 0.25)]), 1: rec(1, [(0, 0.35)])}
    band = [rec(0, [(8, 0.3), (16, 0.45)]), rec(1, [(16, 0.35)])]
    xs, stats = E.held_out_band(band, bases)
    assert xs == [0, 16]
    assert stats[0] == pytest.approx((0.30, 0.5 ** 0.5 * 0.1))  # mean .3, sample std of (.25, .35)
    assert stats[1] == pytest.approx((0.40, 0.5 ** 0.5 * 0.1))
    assert E.held_out_band(band, {0: bases[0]})[0] == [16]


def test_code_and_lora_arms_flags_plan_and_table_by_hand(monkeypatch):
    """learn-code / learn-lora (issues 56, 57): an arm's argv is its method's plus `--follow code` or LORA, which the
    method's CLI reads back; each runs on layout 0 (LoRA at LORA_LR_X × the regime's lr); arm_table puts the arm's
    training success per update under its method's learn run of the same layout."""
    b = E.Budget()
    for arm, mod, field, want in [("opid_code", opid, "follow", "code"), ("grsd_code", grsd, "follow", "code"),
                                  ("grpo_lora", seed, "lora_rank", 16)]:
        script, extra = E.run_flags(arm, "http://127.0.0.1:1/v1", b, 1e-5)
        assert script == f"{mod.__name__}.py"
        monkeypatch.setattr(sys, "argv", [script] + E.shared_flags(b, "m", 0, "o", 1e-5) + extra)
        assert getattr(harness.parse_args(mod.Args, mod.PAPER, mod.LAPTOP), field) == want
    assert E.planned_runs(b, "learn-code", 5e-5, []) == [("learn-opid_code-s0", "opid_code", 0, 5e-5),
                                                         ("learn-grsd_code-s0", "grsd_code", 0, 5e-5)]
    assert E.planned_runs(b, "learn-lora", 5e-5, []) == [("learn-grpo_lora-s0", "grpo_lora", 0, 5e-4)]

    def rec(method, phase, train, seen):
        return {"name": f"learn-{method}-s0", "phase": phase, "method": method, "seed": 0, "lr": 5e-5,
                "seconds": 1.0, "evals": [{"update": 2, "valid_seen": seen}], "time_per_update": {},
                "train": [{"update": u + 1, "success": x, "invalid": 0.0} for u, x in enumerate(train)]}
    table = E.arm_table([rec("grpo", "learn", [0.25, 0.5], 0.4), rec("grpo_lora", "learn-lora", [0.125, 0.75], 0.45)],
                        ("grpo_lora",))
    assert table.splitlines()[:4] == ["| run | 1 | 2 | valid_seen |", "|---|---|---|---|",
                                      "| grpo full, layout 0 | 25 | 50 | 40.0 % |",
                                      "| grpo LoRA, lr ×10, layout 0 | 12 | 75 | 45.0 % |"]
