"""OPID beyond the loss functions: one real update on real expert trajectories with real analyses (non-degenerate
skill path), L_pg against an independently recomputed A_OPID, λ_skill = 0 is GRPO exactly (and equals a GRPO step
recomputed from scratch), ℓ_old/ℓ_skill scored once before any step, micro-batch and 2-rank invariance, routing,
the injection function H on real prompts, the analyzer's JSON parsing on ugly replies, analyzer retries over HTTP,
and end-to-end runs (1 process with an HTTP analyzer, torchrun with 2 ranks, real ALFWorld / Search data)."""
import json
import math
import multiprocessing
import random
import re
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler

import pytest
import torch

import common as C
import harness
import models
import envs
import opid
from conftest import (HERE, SHARED, TESTS, check_checkpoint, clean_env, free_port, reply, serve, strict_rows_of,
                      trajectories, worker_env)

# ------------------------------------------------------------------------------------------------ the batch

WIN = "Workflow: find the target object, take it, then place it at the target receptacle."
FAIL = "Avoid replying without exactly one admissible action inside the action tags."


def opid_batch(tok):
    """Two groups on two real household tasks: a mixed group (2 expert wins of 5 steps, 2 failures of 4 steps) and
    a tied group (4 failures). Analyses: two trajectories without one (no skill signal), step skills at steps 0, 2
    (and 4, which only the 5-step wins have), one at step 4 of a 4-step failure (never routed), episode-only ones."""
    ids = envs.make_env("household", split="train", seed=0).task_ids()
    g0, g1 = trajectories(tok, ids[0], 2, 2), trajectories(tok, ids[1], 0, 4)
    for tr in g1:
        tr.group = 1
    A = opid.Analysis
    analyses = [
        A(WIN, {0: "Go first to the receptacle most likely to hold the target object.",
                2: "Take the object as soon as you see it.", 4: "Put the object down at the goal receptacle."}),
        None,
        A(FAIL, {1: "Reason inside think tags, then write one action inside the action tags."}),
        A(FAIL),
        A(FAIL, {4: "Stop wandering and look for the target object."}),  # 4 steps: index 4 does not exist here
        None,
        A(FAIL, {0: "Open the closed receptacle before looking inside.", 3: "Use only admissible actions."}),
        A(FAIL, {2: "Never repeat the same command twice in a row."}),
    ]
    return g0 + g1, analyses


@pytest.fixture(scope="module")
def batch(tok):
    return opid_batch(tok)


def make_args(**kw):
    return opid.resolve(opid.Args(**kw))


def teacher_len(args):
    return opid.teacher_limit(args)


def run_update(d, tok, trajs, analyses, sgd=False, engine_shift=None, **kw):
    """One opid_update from the same tiny weights. With sgd=True the step is θ − clip(∇L) (lr 1), so the weights
    after the step show the gradient itself (Adam's first step is ~lr·sign(∇L) and hides its size). engine_shift=c
    hands every sample engine log-probs ℓ_old − c and turns on --rollout_is token."""
    args = make_args(lr=1e-3, **kw)
    mine = [(tr, a) for tr, a in zip(trajs, analyses) if tr.group % d.world == d.rank]  # whole groups per rank
    samples, adv, _ = opid.build_samples([tr for tr, _ in mine], [a for _, a in mine], tok, args)
    if engine_shift is not None:  # (set after resolve: the CLI allows --rollout_is only with --engine vllm)
        args.rollout_is = "token"
        old = C.score(models.load_model("tiny", 0), [s.prompt_ids for s in samples], [s.response_ids for s in samples],
                      8, d)
        for s, lp in zip(samples, old):
            s.engine_logp = (lp - engine_shift).tolist()
    policy = models.shard(models.load_model("tiny", 0), d, bf16=False, grad_ckpt=args.grad_ckpt)
    ref = models.shard(models.load_model("tiny", 0), d, bf16=False, trainable=False)
    opt = torch.optim.SGD(policy.parameters(), lr=1.0) if sgd else \
        torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    random.seed(d.rank)  # the same mini-batch order in every call
    row = opid.opid_update(policy, ref, opt, samples, args, d, harness.Timer())
    params = {k: v.full_tensor().clone() for k, v in policy.state_dict().items()}
    return row, params, samples, adv


_RUNS = {}


def cached_update(d, tok, batch, no_analyses=False, **kw):
    """run_update, memoised for the read-only uses several tests share (same inputs → same outputs)."""
    key = (no_analyses, tuple(sorted(kw.items())))
    if key not in _RUNS:
        trajs, analyses = batch
        _RUNS[key] = run_update(d, tok, trajs, [None] * len(trajs) if no_analyses else analyses, **kw)
    return _RUNS[key]


def routed_by_hand(analysis, t):
    """critical_first, written out: (episode, step) for step t."""
    if analysis is None:
        return None, None
    step = analysis.steps.get(t)
    return (None, step) if step else (analysis.episode, None)


@pytest.fixture(scope="module")
def independent(batch, tok):
    """ℓ_old and ℓ_skill of every sample, scored here on an unsharded copy of the initial weights (= θ_old),
    one sample at a time (no padding shared with the code under test)."""
    trajs, analyses = batch
    args = make_args()
    model = models.load_model("tiny", 0)
    out = []
    with torch.no_grad():
        for tr, an in zip(trajs, analyses):
            for t, turn in enumerate(tr.turns):
                ep, st = routed_by_hand(an, t)
                old, _ = C.sequence_logprobs(model, [turn.prompt_ids], [turn.response_ids], "cpu")
                skill = None
                if ep or st:
                    teacher = C.encode_prompt(tok, opid.inject_skill(turn.prompt_text, ep, st)[0], teacher_len(args))[0]
                    skill, _ = C.sequence_logprobs(model, [teacher], [turn.response_ids], "cpu")
                    skill = skill[0]
                out.append((old[0], skill))
    return out


def a_opid_by_hand(samples, scores, lam):
    """A_OPID = A_ep + λ(ℓ_skill − ℓ_old) on samples with a routed skill, A_ep elsewhere (per token)."""
    return [s.a_ep + (lam * (sk - old) if sk is not None else torch.zeros_like(old))
            for s, (old, sk) in zip(samples, scores)]


# ------------------------------------------------------------------------------------------------ 1. the update


def test_update_on_expert_trajectories(d, tok, batch):
    trajs, analyses = batch
    assert [len(tr.turns) for tr in trajs] == [5, 5, 4, 4, 4, 4, 4, 4]
    assert [tr.won for tr in trajs] == [True, True] + [False] * 6
    row, _, samples, adv = run_update(d, tok, trajs, analyses)  # the defaults: λ_skill 0.001, AdamW
    # A_ep = (R − μ)/σ, population σ, no ε: rewards 1, 1, −0.2, −0.2 → μ 0.4, σ 0.6 → ±1 up to float32 rounding
    # (an ε of 1e-6 in the denominator would already move them by 1.7e-6); the tied group → exactly 0
    assert [tr.reward for tr in trajs[:4]] == pytest.approx([1, 1, -0.2, -0.2])
    assert adv[0].tolist() == pytest.approx([1, 1, -1, -1], abs=3e-7)
    assert adv[1].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert [s.a_ep for s in samples] == [adv[tr.group, i % 4].item() for i, tr in enumerate(trajs) for _ in tr.turns]
    n_tok = sum(len(s.response_ids) for s in samples)
    n_skill = sum(len(s.response_ids) for s in samples if s.teacher_ids is not None)
    assert row["train/tokens"] == n_tok and 0 < n_skill < n_tok
    assert row["adv/episode_abs"] == pytest.approx(sum(abs(s.a_ep) * len(s.response_ids) for s in samples) / n_tok,
                                                   rel=1e-6)
    assert row["skill/token_frac"] == pytest.approx(n_skill / n_tok, rel=1e-9)
    assert row["losses/kl"] == pytest.approx(0.0, abs=1e-7)  # θ = π_ref before the step
    assert row["train/minibatches"] == 1 and row["train/grad_norm"] > 0
    # routing by hand (critical_first): 3+1+2+1 step turns (index 4 of the 4-step failure never routes), 18
    # episode turns, 9 turns of the two trajectories without an analysis, never both
    _, _, counts = opid.build_samples(trajs, analyses, tok, make_args())
    assert {k: counts[k] for k in ("step", "episode", "both", "none", "anchor_fallbacks")} == \
        {"step": 7, "episode": 18, "both": 0, "none": 9, "anchor_fallbacks": 0}
    assert [s.route for s in samples].count("step") == 7
    # every sample: the same prompt and response ids the policy produced; the teacher prompt is the chat-templated
    # H(h, s) of exactly the prompt text the student saw, with the skill routed by hand
    big = teacher_len(make_args())
    k = 0
    for tr, an in zip(trajs, analyses):
        for t, turn in enumerate(tr.turns):
            s, (ep, st) = samples[k], routed_by_hand(an, t)
            assert s.prompt_ids == turn.prompt_ids and s.response_ids == turn.response_ids
            want = C.encode_prompt(tok, opid.inject_skill(turn.prompt_text, ep, st)[0], big)[0] if ep or st else None
            assert s.teacher_ids == want
            assert s.route == ("step" if st else "episode" if ep else "none")
            k += 1
    assert k == len(samples) == 34


# ------------------------------------------------------------------------------------------------ 2. L_pg


def test_rollout_is_token_weights_the_pg_term_of_a_opid(d, tok, batch):
    """--rollout_is token with π_θold/π_engine = 1.5 on every token (under the cap 2): at θ = θ_old the clipped
    loss is −Σ w·A_OPID / n = 1.5 × the plain one; the KL term and the mismatch metrics see it as they should."""
    trajs, analyses = batch
    plain, _, _, _ = cached_update(d, tok, batch, sgd=True, lambda_skill=0.5, micro_batch=64)
    row, _, _, _ = run_update(d, tok, trajs, analyses, sgd=True, lambda_skill=0.5, micro_batch=64,
                              engine_shift=math.log(1.5))
    assert plain["losses/pg"] != 0
    assert row["losses/pg"] == pytest.approx(1.5 * plain["losses/pg"], rel=1e-4)
    assert row["losses/kl"] == pytest.approx(plain["losses/kl"], abs=1e-7)  # KL is not reweighted
    assert row["rollout/logp_diff_mean"] == pytest.approx(math.log(1.5), abs=1e-5)
    assert row["rollout/ratio_off_frac"] == 1.0 and "rollout/logp_diff_mean" not in plain


def test_pg_loss_at_first_minibatch_equals_token_sum_of_a_opid(d, tok, batch, independent):
    """One mini-batch, ρ = 1: L_pg = −Σ_tokens A_OPID / n_tokens, A_OPID from ℓ_old, ℓ_skill scored here."""
    lam = 0.5
    row, _, samples, _ = cached_update(d, tok, batch, sgd=True, lambda_skill=lam, micro_batch=64)
    row0, _, _, _ = cached_update(d, tok, batch, sgd=True, lambda_skill=0.0)
    assert row["train/minibatches"] == 1
    n_tok = sum(len(s.response_ids) for s in samples)
    a = a_opid_by_hand(samples, independent, lam)
    want = -sum(x.sum().item() for x in a) / n_tok
    want0 = -sum(s.a_ep * len(s.response_ids) for s in samples) / n_tok
    assert row["losses/pg"] == pytest.approx(want, abs=1e-5)
    assert row0["losses/pg"] == pytest.approx(want0, abs=1e-6)
    assert abs(want - want0) > 1e-4  # the skill term matters at this λ
    # the skill diagnostics from the same independent scores
    delta = [(sk - old) for old, sk in independent if sk is not None]
    n_sk = sum(len(x) for x in delta)
    assert row["adv/skill_abs"] == pytest.approx(lam * sum(x.abs().sum().item() for x in delta) / n_tok, rel=1e-4)
    assert row["skill/delta_mean"] == pytest.approx(sum(x.sum().item() for x in delta) / n_sk, rel=1e-4, abs=1e-6)
    assert row["skill/delta_abs"] == pytest.approx(sum(x.abs().sum().item() for x in delta) / n_sk, rel=1e-4)


# ------------------------------------------------------------------------------------------------ 3. λ = 0 is GRPO


def test_lambda_skill_zero_is_grpo_exactly(d, tok, batch):
    _, p_zero, _, _ = cached_update(d, tok, batch, sgd=True, lambda_skill=0.0)
    _, p_none, _, _ = cached_update(d, tok, batch, no_analyses=True, sgd=True, lambda_skill=0.01)
    _, p_opid, _, _ = cached_update(d, tok, batch, sgd=True, lambda_skill=0.5, micro_batch=64)
    assert all(torch.equal(p_zero[k], p_none[k]) for k in p_zero)  # both are GRPO, bit for bit
    assert max((p_zero[k] - p_opid[k]).abs().max().item() for k in p_zero) > 1e-5  # the skill term moves weights


def test_lambda_skill_zero_matches_an_independent_grpo_step(d, tok, batch):
    """The λ_skill = 0 update, recomputed here from scratch on an unsharded model in one batch: ρ = exp(ℓ − ℓ_old),
    −min(ρA, clip(ρ)A) + 0.01·k3-KL to π_ref (= the initial weights), token mean, clip to norm 1, SGD step."""
    row, got, samples, _ = cached_update(d, tok, batch, sgd=True, lambda_skill=0.0)
    model = models.load_model("tiny", 0)
    P, R = [s.prompt_ids for s in samples], [s.response_ids for s in samples]
    with torch.no_grad():
        old, _ = C.sequence_logprobs(model, P, R, "cpu")
    logp, mask = C.sequence_logprobs(model, P, R, "cpu")
    adv = torch.tensor([s.a_ep for s in samples])[:, None]
    ratio = torch.exp(logp - old)
    surrogate = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    r = old - logp
    loss = ((surrogate + 0.01 * (torch.exp(r) - r - 1)) * mask).sum() / mask.sum()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with torch.no_grad():
        want = {k: v - (v.grad if v.grad is not None else 0) for k, v in model.named_parameters()}
    assert row["train/grad_norm"] == pytest.approx(norm.item(), rel=1e-5)  # the gradient itself, before clipping
    assert {round(s.a_ep) for s in samples} == {-1, 0, 1}  # OPID's A_ep: ±1 (mixed group), 0 (tied group)
    assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-6
    assert max(v.grad.abs().max().item() for v in model.parameters()) > 1e-4  # a real step, not a no-op


# ------------------------------------------------------------------------------------------------ 4. scored once


def checksum(model) -> float:
    return sum((v.full_tensor() if hasattr(v, "full_tensor") else v).double().sum().item()
               for v in model.state_dict().values())


def test_old_and_skill_logprobs_are_scored_once_before_any_step(d, tok, batch, independent, monkeypatch):
    """Alg. 1 l.18-22: ℓ_old, ℓ_ref and ℓ_skill are scored at θ_old before the first optimiser step, and A_OPID
    stays fixed over all mini-batches (SGD lr 1 moves θ a lot between them, so a re-scored A_OPID would show)."""
    lam, events, seen = 0.5, [], []
    initial = checksum(models.load_model("tiny", 0))
    real_score, real_step, real_loss = C.score, C.clip_and_step, opid.opid_loss

    def score(model, prompts, responses, *a, **kw):
        events.append(("score", checksum(model), len(prompts)))
        return real_score(model, prompts, responses, *a, **kw)

    def step(model, optimizer, max_norm, max_skips):
        events.append(("step",))
        return real_step(model, optimizer, max_norm, max_skips)

    def loss(logp, old_logp, ref_logp, adv, mask, *a, **kw):
        seen.append((adv.detach().cpu().clone(), mask.detach().cpu().clone()))
        return real_loss(logp, old_logp, ref_logp, adv, mask, *a, **kw)

    monkeypatch.setattr(opid.C, "score", score)
    monkeypatch.setattr(opid.C, "clip_and_step", step)
    monkeypatch.setattr(opid, "opid_loss", loss)
    trajs, analyses = batch
    row, _, samples, _ = run_update(d, tok, trajs, analyses, sgd=True, lambda_skill=lam, minibatch_turns=8,
                                    micro_batch=64)
    n_mb = row["train/minibatches"]
    assert n_mb >= 3 and [e[0] for e in events] == ["score"] * 3 + ["step"] * n_mb  # old, ref, teacher; then steps
    assert [e[1] for e in events[:3]] == pytest.approx([initial] * 3, rel=1e-12)
    assert [e[2] for e in events[:3]] == [34, 34, 25]  # the teacher pass scores the 25 turns with a routed skill
    # every sample's advantage in every mini-batch is the θ_old A_OPID computed here
    want = a_opid_by_hand(samples, independent, lam)
    free = list(range(len(samples)))
    assert len(seen) == n_mb
    for adv, mask in seen:
        for j in range(adv.shape[0]):
            n = int(mask[j].sum())
            hit = next((i for i in free if len(want[i]) == n and (adv[j, :n] - want[i]).abs().max() < 1e-5), None)
            assert hit is not None, f"a mini-batch row matches no θ_old A_OPID (row {j}, {n} tokens)"
            free.remove(hit)
    assert free == []  # each sample in exactly one mini-batch
    assert max((w.abs().max().item() for w in want)) > 1  # A_ep (±1) plus a real skill shift


# ------------------------------------------------------------------------------------------------ 5. invariances


def test_microbatching_does_not_change_the_update(d, tok, batch):
    ra, a, _, _ = cached_update(d, tok, batch, sgd=True, lambda_skill=0.5, micro_batch=1)
    rb, b, _, _ = cached_update(d, tok, batch, sgd=True, lambda_skill=0.5, micro_batch=64)
    _, c, _, _ = cached_update(d, tok, batch, sgd=True, lambda_skill=0.0)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6
    assert ra["train/grad_norm"] == pytest.approx(rb["train/grad_norm"], rel=1e-5)  # before clipping
    assert ra["losses/pg"] == pytest.approx(rb["losses/pg"], abs=1e-6)
    assert max((b[k] - c[k]).abs().max().item() for k in a) > 1e-5  # the skill term is well above that tolerance
    # length-aware micro-batches of ≤ 1500 padded tokens (1-2 turns each) against fixed ones of 8 turns
    rf, f, _, _ = cached_update(d, tok, batch, sgd=True, lambda_skill=0.5, micro_batch=8, micro_batch_tokens=0)
    rt, t, _, _ = cached_update(d, tok, batch, sgd=True, lambda_skill=0.5, micro_batch_tokens=1500)
    assert max((f[k] - t[k]).abs().max().item() for k in f) < 1e-6
    assert max((a[k] - t[k]).abs().max().item() for k in a) < 1e-6
    assert rt["perf/padding_frac"] < 0.02 < rf["perf/padding_frac"]


@pytest.mark.slow
def test_two_ranks_give_the_single_process_update(d, tok, batch, tmp_path):
    """Each of 2 FSDP ranks holds one group and runs micro-batches of 5 (unequal counts: padding chunks); the step
    equals the 1-process step on the whole batch in one micro-batch. (With several mini-batches the split of turns
    into mini-batches depends on the number of ranks, by design, so this holds for one mini-batch.)"""
    row, single, _, _ = cached_update(d, tok, batch, sgd=True, lambda_skill=0.5, micro_batch=64,
                                      micro_batch_tokens=0)  # fixed micro-batches
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(TESTS / "test_opid.py"), str(tmp_path / "two.pt")]
    res = subprocess.run(cmd, cwd=HERE, env=worker_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    two = torch.load(tmp_path / "two.pt")
    assert two["row"]["train/tokens"] == row["train/tokens"]
    for k in ("losses/pg", "adv/episode_abs", "adv/skill_abs", "skill/token_frac", "skill/delta_mean"):
        assert two["row"][k] == pytest.approx(row[k], abs=1e-6), k
    # the gradient before clipping (clipping to norm 1 would hide a wrong world-size scale in the weights)
    assert two["row"]["train/grad_norm"] == pytest.approx(row["train/grad_norm"], rel=1e-5)
    assert row["train/grad_norm"] > 1e-3
    assert max((two["params"][k] - single[k]).abs().max().item() for k in single) < 1e-6


# ------------------------------------------------------------------------------------------------ 6. routing


def test_follow_code_passes_the_dual_clip_and_the_entropy_bonus_to_the_loss(d, tok, batch, monkeypatch):
    """Row 2 of docs/methods.md inside opid_update: every loss call gets c = 3, the policy's entropy and 0.001 under
    --follow code, and c = 0 with no entropy under the paper's reading."""
    calls, real = [], opid.opid_loss
    monkeypatch.setattr(opid, "opid_loss", lambda *a: calls.append(a[8:]) or real(*a))
    trajs, analyses = batch
    for follow, clip_c, coef in (("paper", 0.0, 0.0), ("code", 3.0, 0.001)):
        calls.clear()
        run_update(d, tok, trajs, analyses, follow=follow)
        assert calls and all(c == clip_c and (e is None) == (follow == "paper") and k == coef for c, e, k in calls)


def test_route_skills_by_hand():
    a = opid.Analysis("E", {1: "s1", 3: "s3"})
    E, N = "E", None
    assert opid.route_skills(a, 5, "critical_first") == [(E, N), (N, "s1"), (E, N), (N, "s3"), (E, N)]
    assert opid.route_skills(a, 5) == opid.route_skills(a, 5, "critical_first")  # the default
    assert opid.route_skills(a, 5, "episode_only") == [(E, N)] * 5
    assert opid.route_skills(a, 5, "step_only") == [(N, N), (N, "s1"), (N, N), (N, "s3"), (N, N)]
    assert opid.route_skills(a, 5, "additive") == [(E, N), (E, "s1"), (E, N), (E, "s3"), (E, N)]
    for mode in opid.MODES:
        assert opid.route_skills(None, 5, mode) == [(N, N)] * 5
        assert opid.route_skills(a, 0, mode) == []
    # critical_first: exclusive masks, q_step = 1 ⇒ q_ep = 0, and the episode skill everywhere off C_τ
    for t, (ep, st) in enumerate(opid.route_skills(a, 5)):
        assert (ep is None) != (st is None) and (st is not None) == (t in a.steps)
    # C_τ beyond the trajectory: every step falls back to the episode skill
    assert opid.route_skills(opid.Analysis("E", {7: "s7"}), 3) == [(E, N)] * 3


def test_build_samples_routes_every_mode(tok, batch):
    trajs, analyses = batch
    want = {"critical_first": dict(step=7, episode=18, both=0, none=9),
            "episode_only": dict(step=0, episode=25, both=0, none=9),
            "step_only": dict(step=7, episode=0, both=0, none=27),
            "additive": dict(step=0, episode=18, both=7, none=9)}
    for mode, counts in want.items():
        samples, _, got = opid.build_samples(trajs, analyses, tok, make_args(skill_mode=mode))
        assert {k: got[k] for k in counts} == counts, mode
        assert [s.response_ids for s in samples] == [t.response_ids for tr in trajs for t in tr.turns]
        assert [s.prompt_ids for s in samples] == [t.prompt_ids for tr in trajs for t in tr.turns]
        assert sum(s.teacher_ids is not None for s in samples) == len(samples) - counts["none"]
    with pytest.raises(SystemExit):
        make_args(skill_mode="both_levels")


# ------------------------------------------------------------------------------------------------ 7. injection H

EP, ST = "Workflow: find the object, take it, place it.", "Open the drawer before looking inside."
EP_BLOCK, ST_BLOCK = f"\n\n{opid.EPISODE_HEADER}\n{EP}", f"{opid.STEP_HEADER}\n{ST}\n\n"


def real_prompts():
    env = envs.make_env("household", split="train", seed=0)
    env.reset(env.task_ids()[3])
    prompts = [env.prompt()]
    env.step(envs.format_expert_response(env.expert_action(), "household"))
    env.step("no tags at all")
    prompts.append(env.prompt())  # with history lines
    if (SHARED / "search_qa").is_dir():
        s = envs.make_env("search", data_dir=str(SHARED / "search_qa"))
        s.reset(s.task_ids()[0])
        prompts.append(s.prompt())
    return prompts


@pytest.mark.parametrize("which", [0, 1, 2])
def test_injection_places_blocks_at_the_anchors_and_changes_nothing_else(which):
    prompts = real_prompts()
    if which >= len(prompts):
        pytest.skip(f"no search_qa data at {SHARED / 'search_qa'} (set SHARED_DATA)")
    p = prompts[which]
    assert p.count(envs.TASK_PREFIX) == 1 and p.count(envs.TURN_PREFIX) == 1
    for ep, st in [(EP, ST), (EP, None), (None, ST)]:
        text, missing = opid.inject_skill(p, ep, st)
        assert missing == 0
        back = text
        if ep:
            assert text.count(EP_BLOCK) == 1
            back = back.replace(EP_BLOCK, "", 1)
        if st:
            assert text.count(ST_BLOCK) == 1
            back = back.replace(ST_BLOCK, "", 1)
        assert back == p  # removing the inserted blocks gives back the prompt exactly
        lines = text.split("\n")
        task = next(i for i, line in enumerate(lines) if line.startswith(envs.TASK_PREFIX))
        turn = next(i for i, line in enumerate(lines) if line.startswith(envs.TURN_PREFIX))
        if ep:  # right after the task line
            assert lines[task + 1:task + 4] == ["", opid.EPISODE_HEADER, EP]
        if st:  # right before the "Now it's your turn" line
            assert lines[turn - 3:turn] == [opid.STEP_HEADER, ST, ""]
    assert opid.inject_skill(p) == (p, 0) and opid.inject_skill(p, "", "") == (p, 0)


def test_injection_without_anchors_prepends_appends_and_counts(tok, batch):
    p = real_prompts()[0]
    no_task = p.replace(envs.TASK_PREFIX, "Goal: ")
    no_turn = p[:p.rfind(envs.TURN_PREFIX)].rstrip("\n")
    neither = no_task[:no_task.rfind(envs.TURN_PREFIX)].rstrip("\n")
    head, tail = f"{opid.EPISODE_HEADER}\n{EP}\n\n", f"\n\n{opid.STEP_HEADER}\n{ST}"
    assert opid.inject_skill(neither, EP, ST) == (head + neither + tail, 2)
    assert opid.inject_skill(no_task, EP, None) == (head + no_task, 1)
    assert opid.inject_skill(no_turn, None, ST) == (no_turn + tail, 1)
    assert opid.inject_skill(no_task, None, ST)[1] == 0 and opid.inject_skill(no_turn, EP, None)[1] == 0
    # in build_samples: the fallbacks are counted, the response ids are untouched
    trajs, _ = batch
    tr = trajs[0]
    turns = [C.Turn(neither if i % 2 else t.prompt_text, t.prompt_ids, t.response_ids, t.response_text, t.action,
                    t.valid, t.observation, t.reward) for i, t in enumerate(tr.turns)]
    fake = C.Trajectory(tr.task_id, 0, tr.task, tr.family, tr.first_observation, turns, tr.won)
    samples, _, counts = opid.build_samples([fake], [opid.Analysis(EP, {1: ST, 2: ST})], tok,
                                            make_args(skill_mode="additive"))
    # turns 1 and 3 lack both anchors: turn 1 has both blocks (2 fallbacks), turn 3 the episode block (1)
    assert counts["anchor_fallbacks"] == 3 and counts["both"] == 2 and counts["episode"] == 3
    assert [s.response_ids for s in samples] == [t.response_ids for t in tr.turns]
    assert tok.decode(samples[1].teacher_ids).count(opid.STEP_HEADER) == 1


def test_teacher_prompt_keeps_the_whole_student_context(tok, batch):
    """The teacher limit leaves room for both blocks: a prompt at max_prompt_len plus two skills cut to
    skill_max_tokens (additive mode) is encoded without any further truncation of the student's text."""
    trajs, _ = batch
    tr = trajs[0]
    args = make_args(max_prompt_len=max(len(t.prompt_ids) for t in tr.turns), skill_mode="additive")
    long = " ".join(["Open the drawer, look inside, and take the mug before moving on."] * 60)
    an = opid.Analysis(long, {t: long[::-1] for t in range(len(tr.turns))})
    samples, _, counts = opid.build_samples([tr], [an], tok, args)
    assert counts["both"] == len(tr.turns)
    for s, turn in zip(samples, tr.turns):
        ep, st = opid.cut_skill(tok, long, 256), opid.cut_skill(tok, long[::-1], 256)
        text = opid.inject_skill(turn.prompt_text, ep, st)[0]
        assert C.encode_prompt(tok, text, teacher_len(args)) == (s.teacher_ids, text)  # the text is used whole
        assert s.teacher_ids == C.chat_ids(tok, text)


def test_long_skills_are_cut_to_skill_max_tokens(tok):
    long = " ".join(["Open the drawer and look inside before moving on."] * 40)
    cut = opid.cut_skill(tok, long, 16)
    assert long.startswith(cut) and len(tok(cut, add_special_tokens=False)["input_ids"]) <= 16
    assert opid.cut_skill(tok, EP, 256) == EP and opid.cut_skill(tok, None, 4) is None


# ------------------------------------------------------------------------------------------------ 8. parsing

E = "Find the target object first, then carry it to the goal receptacle."
PLAIN = json.dumps({"episode_skill": E, "step_skills": {"0": "Go to the countertop first.",
                                                       "2": "Clean the mug at the sinkbasin."}})
PLAIN_STEPS = {0: "Go to the countertop first.", 2: "Clean the mug at the sinkbasin."}
A = opid.Analysis


def obj(steps, episode=E, **extra):
    return json.dumps({"episode_skill": episode, "step_skills": steps, **extra})


PARSE_CASES = [
    # (reply, n_steps, max_critical, expected analysis, expected non-zero events)
    pytest.param(PLAIN, 5, 5, A(E, PLAIN_STEPS), {"critical_steps": 2}, id="plain"),
    pytest.param("Sure! Here is my analysis of the attempt.\n```json\n" + PLAIN + "\n```\nHope this helps {really}.",
                 5, 5, A(E, PLAIN_STEPS), {"critical_steps": 2}, id="fenced-with-prose"),
    pytest.param("```JSON\n" + PLAIN + "```", 5, 5, A(E, PLAIN_STEPS), {"critical_steps": 2}, id="fenced-upper"),
    pytest.param("<think>The reply is {episode_skill: ...}; step {3} was decisive.</think>\n" + PLAIN, 5, 5,
                 A(E, PLAIN_STEPS), {"critical_steps": 2}, id="braces-in-thinking"),
    pytest.param('<think>Draft: {"episode_skill": "draft idea"}</think>\n' + PLAIN, 5, 5, A(E, PLAIN_STEPS),
                 {"critical_steps": 2}, id="draft-json-inside-thinking-is-ignored"),
    pytest.param("</think>" + "<think>" * 7000 + PLAIN, 5, 5, None, {"no_json": 1},
                 id="unclosed-think-runs-to-the-end"),
    pytest.param(PLAIN + "\n<think>and a second thought " * 3000, 5, 5, A(E, PLAIN_STEPS), {"critical_steps": 2},
                 id="answer-then-unclosed-thinking"),
    pytest.param('You asked for {"episode_skill": "...", "step_skills": {"<step>": "...", ...}}. Here: ' + PLAIN,
                 5, 5, A(E, PLAIN_STEPS), {"critical_steps": 2}, id="echoed-template-first"),
    pytest.param('{\n  "episode_skill": "%s",\n  "step_skills": {\n    "1": "Open the drawer first.",\n  },\n}' % E,
                 5, 5, A(E, {1: "Open the drawer first."}), {"critical_steps": 1}, id="trailing-commas"),
    pytest.param(obj({"step 3": "a", "Step_1": "b", " 4 ": "c", "step-0": "d", "STEP2": "e"}), 5, 5,
                 A(E, {3: "a", 1: "b", 4: "c", 0: "d", 2: "e"}), {"critical_steps": 5}, id="step-n-keys"),
    pytest.param(obj([{"step": 2, "skill": "a"}, {"step": "step 0", "skill": "b"}, {"index": 1, "skill": "c"},
                      "not an item", {"step": True, "skill": "d"}, {"step": 2.0, "skill": "f"}]), 5, 5,
                 A(E, {2: "a", 0: "b", 1: "c"}), {"critical_steps": 3, "bad_key": 3}, id="list-of-items"),
    pytest.param(obj({"5": "a", "-1": "b", "9" * 30: "c", "4": "ok"}), 5, 5, A(E, {4: "ok"}),
                 {"critical_steps": 1, "out_of_range": 3}, id="out-of-range"),
    pytest.param(obj([{"step": 10 ** 30, "skill": "a"}, {"step": -1, "skill": "b"}, {"step": 5, "skill": "c"}]),
                 5, 5, A(E, {}), {"out_of_range": 3}, id="out-of-range-int"),
    pytest.param(obj({str(10 ** 30): "a"}), 5, 5, A(E, {}), {"out_of_range": 1}, id="out-of-range-31-digits"),
    pytest.param(obj({"abc": "a", "2.5": "b", "": "c", "3:": "d", "3": "ok"}), 5, 5, A(E, {3: "ok"}),
                 {"critical_steps": 1, "bad_key": 4}, id="bad-keys"),
    pytest.param(obj({"0": "", "1": "   \n ", "2": 5, "3": None, "4": ["x"]}), 5, 5, A(E, {}),
                 {"bad_skill": 5}, id="bad-skills"),
    pytest.param(obj({"2": "first", "step 2": "second", " 2": "third", "1": "one"}), 5, 5,
                 A(E, {2: "first", 1: "one"}), {"critical_steps": 2, "duplicate": 2}, id="duplicates"),
    pytest.param(obj({"3": "a", "bad": "x", "1": "b", "9": "oob", "4": "c", "0": "d"}), 5, 2, A(E, {3: "a", 1: "b"}),
                 {"critical_steps": 2, "bad_key": 1, "out_of_range": 1, "truncated": 2}, id="more-than-max"),
    pytest.param(json.dumps({"analysis": {"episode_skill": E, "step_skills": {"1": "a"}}, "confidence": 0.9}), 5, 5,
                 A(E, {1: "a"}), {"critical_steps": 1}, id="nested"),
    pytest.param(json.dumps({"result": {"items": [{"x": {"y": {"episode_skill": E}}}]}}), 5, 5, A(E, {}), {},
                 id="deeply-nested"),
    pytest.param('{"Episode": "%s", "Steps": {"1": "a"}}' % E, 5, 5, A(E, {1: "a"}), {"critical_steps": 1},
                 id="alias-keys"),
    pytest.param(obj({"1": "先打开抽屉，再找杯子。"}, episode="Öffne zuerst den Kühlschrank – dann 🧊 prüfen."), 5, 5,
                 A("Öffne zuerst den Kühlschrank – dann 🧊 prüfen.", {1: "先打开抽屉，再找杯子。"}),
                 {"critical_steps": 1}, id="unicode-escaped"),
    pytest.param(json.dumps({"episode_skill": "Öffne 🧊", "step_skills": {"1": "先打开抽屉"}}, ensure_ascii=False),
                 5, 5, A("Öffne 🧊", {1: "先打开抽屉"}), {"critical_steps": 1}, id="unicode-raw"),
    pytest.param(obj({"1": "\tOpen   the\n drawer "}, episode="  Find\n\nthe  mug.\u00a0"), 5, 5,
                 A("Find the mug.", {1: "Open the drawer"}), {"critical_steps": 1}, id="whitespace-collapsed"),
    pytest.param(obj("none"), 5, 5, A(E, {}), {"bad_step_skills": 1}, id="step-skills-a-string"),
    pytest.param(json.dumps({"episode_skill": E}), 5, 5, A(E, {}), {}, id="no-step-skills"),
    pytest.param(obj({"1": "a"}, episode=""), 5, 5, None, {"no_episode_skill": 1}, id="empty-episode-skill"),
    pytest.param(obj({"1": "a"}, episode=" \n "), 5, 5, None, {"no_episode_skill": 1}, id="blank-episode-skill"),
    pytest.param(obj({"1": "a"}, episode=5), 5, 5, None, {"no_episode_skill": 1}, id="non-string-episode-skill"),
    pytest.param(json.dumps({"step_skills": {"1": "a"}}), 5, 5, None, {"no_episode_skill": 1},
                 id="missing-episode-skill"),
    pytest.param(obj({"1": "a"}, episode=None), 5, 5, None, {"no_episode_skill": 1}, id="null-episode-skill"),
    pytest.param('{"episode_skill": "Avoid x, }", "step_skills": {"1": "a, ]",},}', 5, 5, A("Avoid x, }", {1: "a, ]"}),
                 {"critical_steps": 1}, id="trailing-commas-repaired-outside-strings-only"),
    pytest.param('{"episode_skill": "E", "step_skills": {"2": "first", "2": "second"}}', 5, 5, A("E", {2: "first"}),
                 {"critical_steps": 1}, id="repeated-json-key-keeps-first"),
    pytest.param("{x} " * 100 + PLAIN, 5, 5, A(E, PLAIN_STEPS), {"critical_steps": 2}, id="100-braces-before-json"),
    pytest.param("The agent failed because it never opened the fridge.", 5, 5, None, {"no_json": 1}, id="no-json"),
    pytest.param("{'episode_skill': 'python dict quotes'}", 5, 5, None, {"no_json": 1}, id="single-quotes"),
    pytest.param('{"episode_skill": "Find the mug", "step_skills": {"1": "Open the dr', 5, 5, None, {"no_json": 1},
                 id="cut-at-max-tokens"),
    pytest.param("", 5, 5, None, {"no_json": 1}, id="empty"),
    pytest.param(None, 5, 5, None, {"no_json": 1}, id="none"),
    pytest.param('{"episode_skill": "first"} and {"episode_skill": "second", "step_skills": {"0": "x"}}', 5, 5,
                 A("first", {}), {}, id="two-objects-first-wins"),
    pytest.param('{"note": "no skill here"}\n' + PLAIN, 5, 5, A(E, PLAIN_STEPS), {"critical_steps": 2},
                 id="skill-less-object-then-skill"),
]


@pytest.mark.parametrize("text,n_steps,max_critical,analysis,events", PARSE_CASES)
def test_parse_analysis(text, n_steps, max_critical, analysis, events):
    got, ev = opid.parse_analysis(text, n_steps, max_critical)
    assert got == analysis
    assert {k: v for k, v in ev.items() if v} == events


def test_truncation_keeps_the_first_ones_in_the_written_order():
    got, ev = opid.parse_analysis(obj({"4": "d", "0": "a", "2": "c", "1": "b"}), 5, 3)
    assert list(got.steps.items()) == [(4, "d"), (0, "a"), (2, "c")] and ev["truncated"] == 1


def _within(seconds, fn, *args):
    """fn(*args) in a forked child: ('ok', result) / ('raised', repr), or None if the call took longer than `seconds`
    (timed in the child; the parent waits 10× as long, so a slow fork of the busy test process is not the call's
    time: once, in a copy's fast tier, no answer came within the 2 s). A child that never answers (a fork of a
    multi-threaded process can inherit a held lock) is tried once more."""
    for _ in range(2):
        out, took = _call_in_fork(seconds, fn, *args)
        if took is not None:
            return out if took <= seconds else None
    return None


def _call_in_fork(seconds, fn, *args):
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)

    def child():
        t0 = time.perf_counter()
        try:
            out = ("ok", fn(*args))
        except BaseException as e:  # noqa: BLE001 — reported to the parent
            out = ("raised", repr(e))
        send.send((out, time.perf_counter() - t0))

    proc = ctx.Process(target=child, daemon=True)
    proc.start()
    out, took = recv.recv() if recv.poll(10 * seconds) else (None, None)
    proc.kill()
    proc.join()
    return out, took


_rng = random.Random(0)
PROSE = " ".join(_rng.choice("the agent went to drawer and opened it then looked at mug on countertop step failed "
                             "because, however; (it) was: nothing happens".split()) for _ in range(9000))[:50_000]

BIG_CASES = [
    pytest.param(PROSE, None, id="random-prose"),
    pytest.param("{" * 50_000, None, id="braces"),
    pytest.param("[" * 50_000, None, id="brackets"),
    pytest.param('{"a": ' * 10_000, None, id="deep-objects"),
    pytest.param('{"episode_skill": "x", "step_skills": ' + "[" * 50_000, None, id="deep-list-in-skill-object"),
    pytest.param('{"episode_skill": "' + "a" * 50_000, None, id="unterminated-string"),
    pytest.param(PROSE + "\n" + PLAIN, A(E, PLAIN_STEPS), id="answer-after-50KB-prose"),
    pytest.param("```json\n" + " " * 50_000, None, id="open-fence-then-whitespace"),
]


@pytest.mark.parametrize("text,analysis", BIG_CASES)
def test_parse_analysis_on_50kb_returns_quickly_and_never_raises(text, analysis):
    out = _within(2.0, opid.parse_analysis, text, 5, 5)
    assert out is not None, "parse_analysis did not return within 2 s"
    assert out[0] == "ok", out[1]
    assert out[1][0] == analysis
    assert out[1][1]["no_json" if analysis is None else "critical_steps"] >= 1


def test_parsed_skills_with_lone_surrogates_do_not_crash_build_samples(tok, batch):
    """An external reply must never crash training: either parsing rejects (and counts) it, or the skill is usable."""
    analysis, _ = opid.parse_analysis('{"episode_skill": "Cool it first \\ud83d then place it."}', 5, 5)
    trajs, _ = batch
    samples, _, counts = opid.build_samples(trajs[:1], [analysis], tok, make_args())
    assert counts["episode"] == (5 if analysis is not None else 0)


# ------------------------------------------------------------------------------------------------ 9. analyze()


GARBAGE = "I am sorry, I cannot analyze this trajectory {without more context"
RETRY_MARK = "previous reply could not be used"


class GarbageThenJSON(BaseHTTPRequestHandler):
    """First request per trajectory: garbage; the retry (recognised by its text): valid JSON with one step skill
    in range and one index equal to the trajectory length (out of range)."""
    prompts: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        text = body["messages"][0]["content"]
        type(self).prompts.append(text)
        n = int(re.search(r"after (\d+) steps", text).group(1))
        outcome = "success" if "Outcome: success" in text else "failure"
        if RETRY_MARK in text:
            reply(self, "Here you go:\n```json\n" + json.dumps(
                {"episode_skill": f"Skill for a {outcome}.", "step_skills": {"0": "First step.", str(n): "x"}})
                + "\n```")
        else:
            reply(self, GARBAGE)

    def log_message(self, *a):
        pass


class AlwaysGarbage(GarbageThenJSON):
    prompts: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).prompts.append(body["messages"][0]["content"])
        reply(self, GARBAGE)


def test_analyzer_retry_and_failure_accounting(batch):
    trajs = batch[0][:4]  # 2 wins, 2 failures
    n, args = len(trajs), make_args()
    assert args.analyzer_retries == 1 and args.max_critical == 5
    server, url = serve(GarbageThenJSON)
    try:
        results, events = opid.analyze(trajs, None, args, harness.ChatClient(url, "m", retries=0))
    finally:
        server.shutdown()
    assert results == [A("Skill for a success.", {0: "First step."})] * 2 + \
        [A("Skill for a failure.", {0: "First step."})] * 2
    assert (events["requests"], events["no_json"], events["failed"]) == (2 * n, n, 0)
    assert (events["out_of_range"], events["critical_steps"]) == (n, n)
    first = [p for p in GarbageThenJSON.prompts if RETRY_MARK not in p]
    retries = [p for p in GarbageThenJSON.prompts if RETRY_MARK in p]
    assert len(first) == len(retries) == n
    assert sorted(first) == sorted(opid.analyzer_prompt(tr, args.max_critical) for tr in trajs)
    for p in retries:  # the retry quotes the problem and the unusable reply, after the original prompt
        assert "(no JSON object)" in p and GARBAGE in p and any(p.startswith(f) for f in first)
    assert all("[Step 0]" in p and "Reply with a single JSON object" in p for p in first)

    server, url = serve(AlwaysGarbage)
    try:
        results, events = opid.analyze(trajs, None, args, harness.ChatClient(url, "m", retries=0))
    finally:
        server.shutdown()
    assert results == [None] * n
    assert (events["requests"], events["no_json"], events["failed"]) == (2 * n, 2 * n, n)
    assert len(AlwaysGarbage.prompts) == 2 * n

    dead = harness.ChatClient(f"http://127.0.0.1:{free_port()}/v1", "m", retries=0)  # nothing listens there
    results, events = opid.analyze(trajs, None, make_args(analyzer_retries=2), dead)
    # an endpoint failure is not an unusable reply: it is not re-asked (the client retried already) and is not
    # counted as no_json; it shows in endpoint/analyzer/* (ChatClient.requests / failures)
    assert results == [None] * n and dead.failures == dead.requests == n
    assert (events["requests"], events["no_json"], events["failed"]) == (n, 0, n)


# ------------------------------------------------------------------------------------------------ 10. end to end


class E2EAnalyzer(BaseHTTPRequestHandler):
    """Valid JSON with step skills at steps 0 and 1 and an out-of-range index 99, wrapped in prose and a fence."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        text = body["messages"][0]["content"]
        ep = ("Workflow: locate the object, take it, place it." if "Outcome: success" in text
              else "Avoid replying without one admissible action inside the action tags.")
        reply(self, "Analysis below.\n```json\n" + json.dumps(
            {"episode_skill": ep, "step_skills": {"0": "Look around before moving.", "1": "Open the drawer.",
                                                  "99": "Out of range."}}) + "\n```")

    def log_message(self, *a):
        pass


REQUIRED = ("losses/pg", "losses/kl", "losses/total", "adv/episode_abs", "adv/skill_abs", "skill/token_frac",
            "skills/critical_per_traj", "analyzer/out_of_range", "analyzer/parsed_frac", "analyzer/no_json",
            "analyzer/requests", "analyzer/failed", "charts/success_rate", "charts/episode_length",
            "train/grad_norm", "train/tokens", "time/rollout", "time/analysis", "time/scoring", "time/teacher",
            "time/update", "time/total")


def check_rows(rows, n):
    assert [r["update"] for r in rows] == list(range(n))
    for row in rows:
        for k in REQUIRED:
            assert k in row, k
        for k, v in row.items():
            assert v == v, f"{k} is NaN"
    assert "eval/success" in rows[-1] and 0 <= rows[-1]["eval/success"] <= 1


@pytest.mark.slow
def test_opid_end_to_end_single_process_with_http_analyzer(tmp_path):
    server, url = serve(E2EAnalyzer)
    cmd = [sys.executable, str(HERE / "opid.py"), "--out_dir", str(tmp_path), "--analyzer_url", url,
           "--analyzer_model", "m"]
    try:
        res = subprocess.run(cmd, cwd=HERE, env=clean_env(), capture_output=True, text=True, timeout=300)
    finally:
        server.shutdown()
    assert res.returncode == 0, res.stderr[-3000:]
    rows = strict_rows_of(tmp_path)
    check_rows(rows, 2)
    for row in rows:
        n_traj = 2 * 4  # tiny preset: 2 tasks × 4 rollouts
        assert row["analyzer/requests"] == n_traj and row["analyzer/parsed_frac"] == 1.0
        assert row["analyzer/no_json"] == 0 and row["analyzer/failed"] == 0
        assert row["analyzer/out_of_range"] == n_traj  # index 99 of every reply
        assert 1 <= row["charts/episode_length"] <= 6
        if row["charts/episode_length"] == 6:  # every episode ran the 6-step cap: steps 0 and 1 both exist
            assert row["skills/critical_per_traj"] == 2.0
            assert row["skills/route_step_frac"] == pytest.approx(2 / 6)
        assert row["skill/token_frac"] == 1.0 and row["skills/route_none_frac"] == 0.0  # every step got a skill
        assert row["adv/skill_abs"] > 0 and row["skill/delta_abs"] > 0
        assert row["losses/kl"] >= 0
    assert rows[0]["losses/kl"] == pytest.approx(0.0, abs=1e-6)  # one mini-batch at θ = π_ref
    args = json.load(open(tmp_path / "args.json"))
    assert args["analyzer_url"] == url and args["lambda_skill"] == 0.001 and args["max_critical"] == 5
    check_checkpoint(tmp_path / "final")


@pytest.mark.slow
def test_opid_end_to_end_torchrun_two_ranks_one_idle_policy_analyzer(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(HERE / "opid.py"), "--out_dir", str(tmp_path), "--updates", "1",
           "--tasks_per_update", "1", "--eval_tasks", "2"]  # one task group: rank 1 has nothing to play
    res = subprocess.run(cmd, cwd=HERE, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    (row,) = strict_rows_of(tmp_path)
    check_rows([row], 1)
    # the random tiny policy writes no JSON analysis: 4 first requests + 4 retries, all counted, no skill signal
    assert row["analyzer/requests"] == 8 and row["analyzer/no_json"] == 8 and row["analyzer/failed"] == 4
    assert row["analyzer/parsed_frac"] == 0 and row["skill/token_frac"] == 0 and row["skills/route_none_frac"] == 1
    assert row["train/tokens"] > 0
    check_checkpoint(tmp_path / "final")


@pytest.mark.slow
@pytest.mark.parametrize("env_name,data", [("alfworld", "alfworld"), ("search", "search_qa"), ("webshop", "webshop")])
def test_opid_runs_real_benchmark_episodes(env_name, data, tmp_path):
    if not (SHARED / data).is_dir():
        pytest.skip(f"no {data} data at {SHARED / data} (set SHARED_DATA)")
    if env_name == "alfworld":
        pytest.importorskip("alfworld", reason="pip install alfworld==0.4.2 pyyaml")
    cmd = [sys.executable, str(HERE / "opid.py"), "--env", env_name, "--model", "tiny", "--data_dir",
           str(SHARED / data), "--updates", "1", "--tasks_per_update", "2", "--group_size", "2",
           "--eval_tasks", "2", "--out_dir", str(tmp_path)]
    cmd += ["--max_steps", "3"] if env_name == "webshop" else []  # (WebShop's long pages: the cheapest real run)
    res = subprocess.run(cmd, cwd=HERE, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    (row,) = strict_rows_of(tmp_path)
    check_rows([row], 1)
    steps = {"alfworld": 6, "search": 4, "webshop": 3}[env_name]  # tiny: ALFWorld ≤ 6, Search-R1 4, WebShop 3 here
    assert 1 <= row["charts/episode_length"] <= steps and row["train/tokens"] > 0
    assert row["analyzer/requests"] >= 4 and (tmp_path / "final" / "config.json").is_file()


if __name__ == "__main__":  # the 2-rank worker of test_two_ranks_give_the_single_process_update
    dist_ = models.init_distributed(seed=0)
    tok_ = models.load_tokenizer("tiny")
    # micro_batch 5: each rank runs several real chunks and, where it has fewer, zero-weighted padding chunks
    row_, params_, _, _ = run_update(dist_, tok_, *opid_batch(tok_), sgd=True, lambda_skill=0.5, micro_batch=5,
                                     micro_batch_tokens=1500)
    if dist_.main:
        torch.save({"row": row_, "params": params_}, sys.argv[1])
    models.shutdown()
