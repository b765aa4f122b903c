"""The Table 1 baselines (`python baselines.py --method …`, docs/baselines.md): each one's update on real expert
trajectories recomputed here from its written definition (< 1e-6 on the weights after one SGD step), the reductions
that must hold exactly, the library retrieval and the skill in the policy's own context, and every command of the
docs/baselines.md recipe table run end to end on the embedded env (1 update)."""
import json
import math
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import baselines
import common as C
import envs
import harness
import models
import seed
from conftest import HERE, clean_env, expert_batch

LIBRARY = str(HERE / "skills" / "alfworld.jsonl")


@pytest.fixture(scope="module")
def batch(tok):
    """The conftest expert batch (a mixed and a tied group on two real household tasks) with library skills."""
    trajs, _ = expert_batch(tok)
    lib = baselines.load_library(LIBRARY)
    return trajs, [baselines.retrieve_skill(lib, tr.family) for tr in trajs]


def run_update(d, tok, batch, method=None, update=0, **kw):
    """One update of a baseline's recipe (what baselines.main runs: baseline_update with a teacher, else
    seed.seed_update), or with method None SEED's (seed.seed_update, the current-θ teacher), on the batch's library
    skills, from the tiny weights with θ ← θ − clip(∇L) (SGD, lr 1), so the weights show the gradient."""
    kw = {"micro_batch": 64, **kw}  # one forward per pass, batched as independent_step does (float32 rounding)
    args = baselines.resolve(baselines.Args(method=method, **kw)) if method else \
        seed.resolve(seed.Args(skip_sft=True, **kw))
    trajs, skills = batch
    samples, _ = seed.build_samples(trajs, skills, tok, args, seed.LIBRARY_HEADER)
    policy = models.shard(models.load_model("tiny", 0), d, bf16=False, grad_ckpt=False)
    ref = models.shard(models.load_model("tiny", 0), d, bf16=False, trainable=False)
    random.seed(0)
    opt = torch.optim.SGD(policy.parameters(), lr=1.0)
    if method and baselines.has_teacher(args):
        row = baselines.baseline_update(policy, ref, opt, samples, args, d, harness.Timer(), update)
    else:
        row = seed.seed_update(policy, ref, opt, samples, args, d, harness.Timer())
    return row, {k: v.full_tensor().clone() for k, v in policy.state_dict().items()}, samples


def independent_step(samples, extra_loss, pg_coef=1.0, adv_of=None):
    """The definition, from scratch on an unsharded model in one batch: pg_coef · token-mean[−min(ρA, clip(ρ, 0.8,
    1.2)A)] + 0.01 · token-mean[k3 KL to π_ref = θ_0] + extra_loss(ℓ_θ, ℓ_old, ℓ_T, has, mask) / N, then clip to
    norm 1 and an SGD step; ℓ_T is θ_0 = θ_old on each turn's teacher prompt (0 and has = 0 without one)."""
    model = models.load_model("tiny", 0)
    P, R = [s.prompt_ids for s in samples], [s.response_ids for s in samples]
    with torch.no_grad():
        old, _ = C.sequence_logprobs(model, P, R, "cpu")
        teacher = torch.zeros_like(old)
        rows = [i for i, s in enumerate(samples) if s.teacher_ids]
        t, _ = C.sequence_logprobs(model, [samples[i].teacher_ids for i in rows], [R[i] for i in rows], "cpu")
        for k, i in enumerate(rows):
            teacher[i, :len(R[i])] = t[k, :len(R[i])]
    has = torch.tensor([[float(bool(s.teacher_ids))] for s in samples])
    logp, mask = C.sequence_logprobs(model, P, R, "cpu")
    adv = adv_of(old, teacher, has) if adv_of else torch.tensor([s.adv for s in samples])[:, None]
    ratio = torch.exp(logp - old)
    surrogate = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    r = old - logp
    n = mask.sum()
    loss = pg_coef * (surrogate * mask).sum() / n + 0.01 * ((torch.exp(r) - r - 1) * mask).sum() / n
    if extra_loss is not None:
        loss = loss + extra_loss(logp, old, teacher, has, mask) / n
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with torch.no_grad():
        return {k: v - (v.grad if v.grad is not None else 0) for k, v in model.named_parameters()}


def max_diff(got, want):
    return max((got[k] - want[k]).abs().max().item() for k in want)


def gated(beta):
    def extra(logp, old, teacher, has, mask):  # λ Σ m · σ(β sg Δ) · (sg ℓ_T − ℓ_θ), Δ = ℓ_T − ℓ_θ
        return 0.01 * (torch.sigmoid(beta * (teacher - logp).detach()) * (teacher - logp) * mask * has).sum()
    return extra


def test_library_retrieval_and_teacher_context(tok, batch):
    lib = baselines.load_library(LIBRARY)
    general = [x["skill"] for x in lib if "family" not in x]
    for fam in envs.FAMILIES:
        own = [x["skill"] for x in lib if x.get("family") == fam]
        assert len(general) == 1 and len(own) == 1
        assert baselines.retrieve_skill(lib, fam) == general[0] + "\n" + own[0]
    assert baselines.retrieve_skill(lib, "no_such_family") == general[0]
    assert baselines.retrieve_skill([x for x in lib if "family" in x], "no_such_family") is None
    # a stage-1 skills.jsonl: the family's successful skills come first
    stage1 = [{"family": "f", "won": False, "skill": "Avoid a."}, {"family": "f", "won": True, "skill": "Workflow: b."}]
    assert baselines.retrieve_skill(stage1, "f") == "Workflow: b.\nAvoid a."
    args = baselines.resolve(baselines.Args(method="sdar"))
    assert args.skill_library == LIBRARY  # the household default
    trajs, skills = batch
    samples, _ = seed.build_samples(trajs, skills, tok, args, seed.LIBRARY_HEADER)
    turns = [(t, sk) for tr, sk in zip(trajs, skills) for t in tr.turns]
    for s, (turn, sk) in zip(samples, turns):
        assert s.teacher_ids == C.chat_ids(tok, seed.inject_skill(turn.prompt_text, sk, seed.LIBRARY_HEADER))


def test_bad_library_gives_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="no such file"):
        baselines.load_library(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"family": "x", "skill": "ok fine"}\n{"family": "x"}\n')
    with pytest.raises(SystemExit, match="line 2"):
        baselines.load_library(str(bad))
    with pytest.raises(SystemExit, match="skills/ has none for --env webshop: pass --skill_library FILE"):
        baselines.resolve(baselines.Args(method="sdar", env="webshop"))
    with pytest.raises(SystemExit, match="RLSD .* add --lambda_opd 0"):
        baselines.resolve(baselines.Args(method="rlsd", lambda_opd=0.01))
    with pytest.raises(SystemExit, match="leaves only the KL"):
        baselines.resolve(baselines.Args(method="opsd", lambda_opd=0.0))
    with pytest.raises(SystemExit, match="--skill_source must be one of on_policy, static"):  # seed.py: SEED only
        seed.resolve(seed.Args(skill_source="library"))


def test_each_recipe_sets_its_row_and_a_given_flag_wins():
    """--method fills the None fields from RECIPES (over NO_RECIPE); a value given on the command line is kept."""
    def got(method, **kw):
        a = baselines.resolve(baselines.Args(method=method, **kw))
        return (a.lambda_opd, a.beta_opd, a.pg_coef, a.distill, a.rlsd_lambda, a.train_with_skills,
                a.eval_with_skills, a.eval_only, a.out_dir)
    assert got("sdar") == (0.01, 5.0, 1.0, "opd", 0.0, False, False, False, "runs/sdar")
    assert got("opsd") == (0.01, 5.0, 0.0, "opd", 0.0, False, False, False, "runs/opsd")
    assert got("grpo_opsd")[:3] == (0.01, 0.0, 1.0)
    assert got("skill_sd")[:4] == (0.001, 5.0, 1.0, "sdl")
    assert got("rlsd")[:5] == (0.0, 5.0, 1.0, "opd", 0.5)
    assert got("grpo")[0] == 0.0 and got("skill_grpo")[5] is True
    assert got("vanilla")[5:8] == (False, False, True) and got("skill_prompt")[5:8] == (False, True, True)
    assert got("sdar", lambda_opd=0.02, out_dir="x")[0] == 0.02 and got("sdar", out_dir="x")[-1] == "x"
    assert not baselines.has_teacher(baselines.resolve(baselines.Args(method="grpo")))
    for method, library in [("vanilla", None), ("grpo", None), ("skill_prompt", LIBRARY), ("sdar", LIBRARY)]:
        assert baselines.resolve(baselines.Args(method=method)).skill_library == library, method  # only if used


def test_sdar_matches_its_definition(d, tok, batch):
    """SDAR: L_rl + 0.01 · token-mean[σ(5 sg Δ)(sg ℓ_T − ℓ_θ)] with ℓ_T from θ_old and a library skill."""
    row, got, samples = run_update(d, tok, batch, "sdar")
    assert sum(bool(s.teacher_ids) for s in samples) == len(samples)  # the library has a skill for every family
    assert max_diff(got, independent_step(samples, gated(5.0))) < 1e-6
    assert 0 < row["opd/gate_mean"] < 1 and row["opd/token_frac"] == 1.0


def test_opsd_has_no_rl_term(d, tok, batch):
    """OPSD (SDAR code): 0.01 · gated OPD + 0.01 · KL, no policy-gradient term."""
    row, got, samples = run_update(d, tok, batch, "opsd")
    assert max_diff(got, independent_step(samples, gated(5.0), pg_coef=0.0)) < 1e-6
    assert row["losses/pg"] != 0  # the surrogate is computed (and logged) but carries no weight


def test_grpo_plus_opsd_gate_is_one_half_and_ignores_the_teacher(d, tok, batch, tmp_path):
    """GRPO+OPSD = SDAR with β = 0: g ≡ 0.5, and the gradient of 0.5 (sg ℓ_T − ℓ_θ) is −0.5 ∇ℓ_θ whatever ℓ_T is,
    so another skill library gives bit-identical weights."""
    row, got, samples = run_update(d, tok, batch, "grpo_opsd")
    assert row["opd/gate_mean"] == 0.5 and row["opd/gate_std"] == 0.0
    assert max_diff(got, independent_step(samples, gated(0.0))) < 1e-6
    trajs, _ = batch
    other = ["Avoid everything; " * k + "look twice." for k in range(1, len(trajs) + 1)]
    _, got2, samples2 = run_update(d, tok, (trajs, other), "grpo_opsd")
    assert samples2[0].teacher_ids != samples[0].teacher_ids
    assert all(torch.equal(got[k], got2[k]) for k in got)


def test_skill_sd_matches_its_definition(d, tok, batch):
    """Skill-SD: L_rl + 0.001 · token-mean[ρ k3], e = ℓ_θ − ℓ_T, k3 = exp(−e) − 1 + e, ρ = exp(ℓ_θ − ℓ_old)."""
    def sdl(logp, old, teacher, has, mask):
        e = logp - teacher
        k3 = torch.exp(torch.minimum(-e, torch.tensor(20.0))) - 1 + e
        return 0.001 * (torch.exp(torch.minimum(logp - old, torch.tensor(10.0))) * k3 * mask * has).sum()
    row, got, samples = run_update(d, tok, batch, "skill_sd")
    # 1.0e-6 measured, on the tied embedding only (its step is 0.09: float32 summation order, ρ·k3 reaches e^5)
    assert max_diff(got, independent_step(samples, sdl)) < 2e-6
    assert row["losses/opd"] > 0  # k3 ≥ 0, and the skill moves the teacher off the student
    assert "opd/gate_mean" not in row  # no gate in Skill-SD


def test_sdl_loss_by_hand_including_its_clamps():
    """k3 = exp(min(−e, 20)) − 1 + e and ρ = exp(min(ℓ_θ − ℓ_old, 10)), token-mean over the mask; at e = 0 and
    ρ = 1 the loss and its gradient are 0; ∂/∂ℓ_θ of ρ k3 = ρ (k3 + 1 − exp(−e)) below both clamps."""
    logp = torch.tensor([[-1.0, -2.0, -30.0, 5.0]], requires_grad=True)
    teacher = torch.tensor([[-1.0, -1.5, -2.0, -30.0]])
    old = torch.tensor([[-1.0, -2.5, -30.0, -10.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss = baselines.sdl_loss(logp, old, teacher, mask)
    e1, rho1 = -0.5, math.exp(0.5)
    k31 = math.exp(0.5) - 1 + e1
    e2 = -28.0  # −e = 28 > 20: the exp is clamped at e^20
    k32 = math.exp(20.0) - 1 + e2
    assert loss.item() == pytest.approx((0.0 + rho1 * k31 + 1.0 * k32) / 3, rel=1e-6)
    loss.backward()
    g = logp.grad[0]
    assert g[0].item() == pytest.approx(0.0, abs=1e-7)
    assert g[1].item() == pytest.approx(rho1 * (k31 + 1 - math.exp(0.5)) / 3, rel=1e-5)
    assert g[2].item() == pytest.approx((k32 + 1) / 3, rel=1e-5)  # clamped exp: only ρ and the +e term move
    assert g[3].item() == 0.0  # masked (and ρ would be clamped at e^10)


def test_evaluate_uses_the_context(d, tok):
    """--eval_with_skills reaches the held-out episodes: evaluate hands every turn's prompt to the context."""
    lib = baselines.load_library(LIBRARY)
    args = baselines.resolve(baselines.Args(method="skill_prompt"))
    ctx, seen = baselines.library_context(lib, tok, args), []
    engine = models.HFEngine(models.load_model("tiny", 0), tok, torch.device("cpu"))
    make = lambda: envs.make_env("household", split="valid_seen", seed=0, max_steps=2)  # noqa: E731
    row, _ = C.evaluate(engine, make, make().task_ids()[:2], d, 1024, 8, 0.4, 0, "eval/",
                        lambda env: seen.append(ctx(env)) or seen[-1])
    assert row["eval/episode_length"] > 0 and len(seen) >= 2
    assert all(p.startswith(seed.LIBRARY_HEADER + "\n") for p in seen)


def test_rlsd_schedule_by_hand():
    assert baselines.rlsd_lambda_at(0, 0.5, 100) == pytest.approx(0.495)   # t = 1
    assert baselines.rlsd_lambda_at(49, 0.5, 100) == pytest.approx(0.25)   # t = 50
    assert baselines.rlsd_lambda_at(98, 0.5, 100) == pytest.approx(0.005)  # t = 99
    assert baselines.rlsd_lambda_at(99, 0.5, 100) == 0.0 and baselines.rlsd_lambda_at(500, 0.5, 100) == 0.0
    # w = clip(exp(sign(A) Δ), 0.8, 1.2): Δ = ln 1.1 → w 1.1 (A > 0), 1/1.1 (A < 0); Δ = 1 → 1.2 / 0.8
    old = torch.zeros(3)
    t = torch.tensor([math.log(1.1), 1.0, -1.0])
    lam = 0.5
    assert baselines.rlsd_advantages(2.0, old, t, lam, 0.2).tolist() == pytest.approx(
        [2 * (0.5 + 0.5 * 1.1), 2 * (0.5 + 0.5 * 1.2), 2 * (0.5 + 0.5 * 0.8)])
    assert baselines.rlsd_advantages(-2.0, old, t, lam, 0.2).tolist() == pytest.approx(
        [-2 * (0.5 + 0.5 / 1.1), -2 * (0.5 + 0.5 * 0.8), -2 * (0.5 + 0.5 * 1.2)])
    assert baselines.rlsd_advantages(0.0, old, t, lam, 0.2).tolist() == [0.0, 0.0, 0.0]
    assert baselines.rlsd_advantages(1.5, old, None, lam, 0.2).tolist() == [1.5, 1.5, 1.5]


def test_rlsd_matches_its_definition_and_decays_to_grpo(d, tok, batch):
    def adv_of(old, teacher, has):
        a = torch.tensor([s.adv for s in samples])[:, None]
        w = torch.exp(torch.sign(a) * (teacher - old)).clamp(0.8, 1.2)
        lam = 0.5 * (1 - 1 / 100) * has  # update 0 is t = 1
        return a * ((1 - lam) + lam * w)
    row, got, samples = run_update(d, tok, batch, "rlsd")
    assert row["rlsd/lambda"] == pytest.approx(0.495)
    assert 1 - 0.2 * 0.495 <= row["rlsd/weight_mean"] <= 1 + 0.2 * 0.495 and row["rlsd/weight_mean"] != 1.0
    assert max_diff(got, independent_step(samples, None, adv_of=adv_of)) < 1e-6
    _, late, _ = run_update(d, tok, batch, "rlsd", update=99)
    _, grpo, _ = run_update(d, tok, batch, "grpo")
    assert all(torch.equal(late[k], grpo[k]) for k in grpo)      # λ_t = 0 from t = W on: GRPO exactly
    assert any(not torch.equal(got[k], grpo[k]) for k in grpo)


def test_old_teacher_is_scored_once_before_the_minibatches(d, tok, batch, monkeypatch):
    """A baseline's teacher (θ_old) is scored once per update, never in the mini-batch loop, and with several
    mini-batches (θ moves between them) it differs from SEED's current-θ teacher; with one mini-batch θ = θ_old and
    both agree to rounding."""
    calls = []
    real = seed.teacher_scores
    monkeypatch.setattr(seed, "teacher_scores", lambda *a: calls.append(len(a[2])) or real(*a))  # turns it scored
    _, old_many, _ = run_update(d, tok, batch, "sdar", minibatch_turns=8)
    _, old_one, _ = run_update(d, tok, batch, "sdar")
    assert len(calls) == 2 and calls[0] == calls[1] > 8  # once per update, over all turns (mini-batches hold 8)
    monkeypatch.undo()
    _, cur_many, _ = run_update(d, tok, batch, minibatch_turns=8)
    _, cur_one, _ = run_update(d, tok, batch)
    assert max_diff(old_one, cur_one) < 1e-6
    assert max_diff(old_many, cur_many) > 1e-6


def test_skill_in_the_policy_context(tok):
    """Skill-GRPO / Skill-Prompt*: with a library the policy's prompt is H(prompt, retrieved skill) on every turn,
    and the sampled ids are scored on exactly that prompt; an empty library leaves collect as it was (GRPO)."""
    args = baselines.resolve(baselines.Args(method="skill_grpo", max_steps=3))
    lib = baselines.load_library(LIBRARY)
    engine = models.HFEngine(models.load_model("tiny", 0), tok, torch.device("cpu"))
    make = lambda: envs.make_env("household", split="train", seed=0, max_steps=3)  # noqa: E731
    ids = make().task_ids()[:2]

    def play(context):
        torch.manual_seed(0)
        return C.collect(engine, make, ids, 2, 1024, 16, 1.0, 1.0, context)[0]
    plain, empty, skilled = play(None), play(baselines.library_context([], tok, args)), \
        play(baselines.library_context(lib, tok, args))
    assert [[t.prompt_ids for t in tr.turns] for tr in plain] == [[t.prompt_ids for t in tr.turns] for tr in empty]
    assert [[t.response_ids for t in tr.turns] for tr in plain] == [[t.response_ids for t in tr.turns] for tr in empty]
    for tr in skilled:
        for t in tr.turns:
            head = f"{seed.LIBRARY_HEADER}\n{baselines.retrieve_skill(lib, tr.family)}\n\n"
            assert t.prompt_text.startswith(head)
            assert t.prompt_ids == C.encode_prompt(tok, t.prompt_text, 1024)[0]


# ------------------------------------------------------------------------------------------------------------------
# docs/baselines.md: the recipe tables, every command, on the embedded env
# ------------------------------------------------------------------------------------------------------------------

TINY_RUN = ["--updates", "1", "--tasks_per_update", "1", "--group_size", "2", "--max_steps", "2", "--eval_every", "1",
            "--eval_tasks", "2", "--sft_tasks", "1", "--sft_rollouts", "2", "--max_response_len", "24",
            "--annotator_max_tokens", "24"]


def recipe_commands() -> list[tuple[str, str]]:
    """(row, command) for every `python …` command in docs/baselines.md (section "Baselines")."""
    text = (HERE / "docs" / "baselines.md").read_text()
    section = text.split("## Baselines", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        m = re.match(r"\| ([^|]+?) \|.*?`(python [^`]+)`", line)
        if m:
            rows.append((m.group(1).strip(), m.group(2)))
    return rows


def test_recipe_table_covers_every_table1_row():
    names = {r for r, _ in recipe_commands()}
    for row in ["Vanilla", "Skill-Prompt*", "GRPO", "Skill-GRPO", "Skill-GRPO*", "OPSD", "GRPO+OPSD", "Skill-SD",
                "RLSD", "SDAR", "SEED", "OPID", "GRSD"]:
        assert row in names, row


def tiny_flags(script: str) -> list[str]:
    """TINY_RUN minus the flags a script does not have (its Args)."""
    mod = __import__(script[:-3])
    have = {f"--{k}" for k in mod.Args.__dataclass_fields__}
    out = []
    for k, v in zip(TINY_RUN[::2], TINY_RUN[1::2]):
        if k in have:
            out += [k, v]
    return out


def run_recipe(command: str, tmp_path: Path) -> tuple[str, list[dict] | str]:
    """`python script flags…` with runs/… paths moved under tmp_path and the TINY_RUN budget; a command without
    its own --out_dir writes to tmp_path/<row slug>. Returns (command, its metrics rows, or the stderr tail)."""
    script, *argv = command.split()[1:]
    argv = [str(tmp_path / a) if a.startswith("runs/") else a for a in argv]
    if "--out_dir" not in argv:
        argv += ["--out_dir", str(tmp_path / re.sub(r"\W+", "_", command))]
    out = Path(argv[argv.index("--out_dir") + 1])
    r = subprocess.run([sys.executable, script, *argv, *tiny_flags(script)], cwd=HERE,
                       env={**clean_env(), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        return command, r.stderr[-2000:]
    return command, [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_every_recipe_command_runs(tmp_path):
    """Every command of the docs/baselines.md recipe tables on the embedded env and the tiny model, 1 update (eval-only rows:
    one evaluation), with the flags as written; two at a time. The rows that write a named run
    (--out_dir runs/X) go first, so that a row evaluating runs/X/final (Skill-GRPO*) scores that very run."""
    from concurrent.futures import ThreadPoolExecutor
    commands = [c for _, c in recipe_commands()]
    producers = [c for c in commands if "--out_dir runs/" in c]
    for c in commands:
        m = re.search(r"--model runs/(\S+)/final", c)
        assert not m or any(f"--out_dir runs/{m.group(1)}" in p for p in producers), c
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda c: run_recipe(c, tmp_path), producers))
        results += list(pool.map(lambda c: run_recipe(c, tmp_path), [c for c in commands if c not in producers]))
    failed = {c: r for c, r in results if isinstance(r, str)}
    assert not failed, "\n\n".join(f"{c}\n{r}" for c, r in failed.items())
    for command, rows in results:
        assert any("eval/success" in x for x in rows), command
        method = re.search(r"--method (\w+)", command)
        if "--eval_only" in command or method and baselines.RECIPES[method.group(1)].get("eval_only"):
            assert [x.get("eval_only") for x in rows] == [1], command
        else:
            assert any(x.get("update") == 0 and "losses/total" in x for x in rows), command
