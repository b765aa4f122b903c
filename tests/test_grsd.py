"""GRSD beyond the equations (those are in test_losses.py): one real update on real expert trajectories with
hand-written reflections, judge scores and DO/AVOID guidance (non-degenerate path: a mixed group with guidance and
modulation, a tied group without); L_task and L_ref against Â and A_ref recomputed here from independently scored
ℓ_stu/ℓ_tea; λ = 0 / guidance 'none' is GRPO exactly (and equals a GRPO + α·L_ref step recomputed from scratch);
micro-batch and 2-rank invariance; ℓ_stu/ℓ_tea scored once before any step; the token / trajectory modulation
variants and the unaggregated / success-only guidance variants by hand; the judge and reflection parsers on ugly
outputs; λĜ < 1 enforced; Stage A with a judge over real HTTP; end-to-end runs (1 process with an HTTP judge,
torchrun with 2 ranks, real ALFWorld / Search data).

Wherever the policy would *generate* text (reflections s_i, guidance z_x) a scripted stand-in with the engine's
interface returns fixed token ids (`ScriptedEngine`): the random tiny policy never writes three numbered points, so
only a scripted generate reaches the non-degenerate path. Everything downstream (parsing, judge, Norm_G, teacher
contexts, scoring, modulation, the FSDP update) is the real code."""
import json
import math
import random
import subprocess
import sys
from http.server import BaseHTTPRequestHandler
from types import SimpleNamespace

import pytest
import torch

import common as C
import harness
import models
import envs
import grsd
from conftest import (HERE, SHARED, TESTS, check_checkpoint, clean_env, free_port, reply, serve, strict_rows_of,
                      trajectories, worker_env)

LAM, G_HAT, EPS = 0.5, 0.2, 1e-6  # the paper's λ, Ĝ; ε_adv = ε_gap of grsd.Args


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread for this module's in-process updates (restored afterwards): on 2 shared CPU cores a
    second OpenMP thread competing with other processes made each tiny-model forward ~50× slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ------------------------------------------------------------------------------------------------ the batch

GUIDE = ("### DO\n- Go to the countertop first and take the candle there.\n- Carry it straight to the bed.\n"
         "### AVOID\n- Replying without one action inside the action tags.\n- Looking around instead of moving.")
INVALID = "1. Look around the room.\n2. Open the drawer."  # two points: parse_reflection → None


def refl_text(i: int) -> str:
    return (f"1. Go to the countertop first [r{i}].\n2. Take the candle from it.\n"
            f"3. Put it in the bed without detours.")


# trajectory i: raw reflection (as sampled) and judge score. Group 0 (2 wins, 2 failures): the win 1 has a valid
# reflection whose judge reply was unusable (score None); group 1 (4 failures): trajectory 5's reflection is invalid
RAW = [refl_text(0), refl_text(1), refl_text(2), refl_text(3), refl_text(4), INVALID, refl_text(6), refl_text(7)]
SCORES = [3, None, 1, 0, 2, None, 2, 1]


def hand_norm(scores):
    """Eq. (1) over the valid entries (population variance, ε_adv), invalid → 0 (Alg. 1 l.10-11), by hand."""
    v = [s for s in scores if s is not None]
    mean = sum(v) / len(v)
    var = sum((x - mean) ** 2 for x in v) / len(v)
    return [0.0 if s is None else (s - mean) / math.sqrt(var + EPS) for s in scores]


# group 0: valid scores 3, 1, 0 → mean 4/3, variance 14/9; group 1: valid 2, 2, 1 → mean 5/3, variance 2/9
A_REF = [5 / 3 / math.sqrt(14 / 9 + EPS), 0.0, -1 / 3 / math.sqrt(14 / 9 + EPS), -4 / 3 / math.sqrt(14 / 9 + EPS),
         1 / 3 / math.sqrt(2 / 9 + EPS), 0.0, 1 / 3 / math.sqrt(2 / 9 + EPS), -2 / 3 / math.sqrt(2 / 9 + EPS)]
# task advantages: rewards 1, 1, −0.2, −0.2 → ±0.6/sqrt(0.36 + ε_adv); the tied group → exactly 0
A_TASK = [x * 0.6 / math.sqrt(0.36 + EPS) for x in (1, 1, -1, -1)] + [0.0] * 4


def response_ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]


def grsd_batch(tok):
    """Two groups on two real household tasks: group 0 = 2 expert wins + 2 failures (mixed), group 1 = 4 failures
    (tied), and refl = (p_ids, r_ids, reflections, scores) as reflect_and_judge returns it, with real token ids."""
    ids = envs.make_env("household", split="train", seed=0).task_ids()
    g0, g1 = trajectories(tok, ids[0], 2, 2), trajectories(tok, ids[1], 0, 4)
    for tr in g1:
        tr.group = 1
    trajs = g0 + g1
    p_ids = [C.encode_prompt(tok, grsd.reflection_prompt(tr, 400), 2048)[0] for tr in trajs]
    r_ids = [response_ids(tok, t) for t in RAW]
    reflections = [grsd.parse_reflection(t) for t in RAW]
    return trajs, (p_ids, r_ids, reflections, list(SCORES))


@pytest.fixture(scope="module")
def batch(tok):
    return grsd_batch(tok)


class ScriptedEngine:
    """A scripted stand-in for the policy's generate (θ_old in its non-acting roles): it returns fixed token ids
    (texts[k] for the k-th prompt of a call, cyclically) and records every prompt it was given."""

    def __init__(self, tok, texts):
        self.tok, self.texts, self.prompts, self.calls = tok, texts, [], []
        self.stops = models.stop_token_ids(tok)  # (the engine contract: collect and generate_texts read it)

    def generate(self, prompts, max_new_tokens, temperature, top_p=1.0, keys=None):
        self.prompts += prompts
        self.calls.append((len(prompts), max_new_tokens, temperature))
        return [response_ids(self.tok, self.texts[k % len(self.texts)]) for k in range(len(prompts))]


def make_args(**kw):
    return grsd.resolve(grsd.Args(**kw))


def task_advantages(trajs, args):
    """Alg. 1 l.4, as grsd.main computes it: A_i = Norm_G(R_i) per group."""
    adv = [0.0] * len(trajs)
    for g in sorted({tr.group for tr in trajs}):
        members = [i for i, tr in enumerate(trajs) if tr.group == g]
        for i, v in zip(members, grsd.norm_g(torch.tensor([trajs[i].reward for i in members]), args.eps_adv)):
            adv[i] = v.item()
    return adv


def teacher_len(args):
    return grsd.teacher_limit(args)


def run_update(d, tok, batch, sgd=False, engine_shift=None, **kw):
    """One grsd_update from the same tiny weights on this rank's groups (group % world == rank). Guidance comes from
    the real group_guidance with a scripted generate. With sgd=True the step is θ − clip(∇L) (lr 1), so the weights
    after it show the gradient itself (Adam's first step is ~lr·sign(∇L) and hides its size). The Â that the
    update computed (turn_advantages' output) is recorded."""
    args = make_args(lr=1e-3, **kw)
    trajs, refl = batch
    mine = [i for i, tr in enumerate(trajs) if tr.group % d.world == d.rank]  # whole groups per rank
    trajs = [trajs[i] for i in mine]
    refl = tuple([x[i] for i in mine] for x in refl)
    adv = task_advantages(trajs, args)
    engine = ScriptedEngine(tok, [GUIDE])
    mixed, guidance, n_empty = grsd.group_guidance(trajs, refl[2], refl[3], engine, args, harness.Timer())
    turns, refls = grsd.build_samples(trajs, adv, refl, guidance, tok, args)
    if engine_shift is not None:  # engine log-probs ℓ_old − c on every turn token, --rollout_is token
        args.rollout_is = "token"  # (set after resolve: the CLI allows it only with --engine vllm)
        old = C.score(models.load_model("tiny", 0), [s.prompt_ids for s in turns], [s.response_ids for s in turns], 8,
                      d)
        for s, lp in zip(turns, old):
            s.engine_logp = (lp - engine_shift).tolist()
    policy = models.shard(models.load_model("tiny", 0), d, bf16=False, grad_ckpt=args.grad_ckpt)
    ref = models.shard(models.load_model("tiny", 0), d, bf16=False, trainable=False)
    opt = torch.optim.SGD(policy.parameters(), lr=1.0) if sgd else \
        torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    seen, real = {}, grsd.turn_advantages

    def spy(*a, **k):
        seen["a_hat"], seen["delta"] = out = real(*a, **k)
        return out
    grsd.turn_advantages = spy
    try:
        random.seed(d.rank)  # the same mini-batch order in every call
        row = grsd.grsd_update(policy, ref, opt, turns, refls, args, d, harness.Timer())
    finally:
        grsd.turn_advantages = real
    params = {k: v.full_tensor().clone() for k, v in policy.state_dict().items()}
    return SimpleNamespace(row=row, params=params, turns=turns, refls=refls, adv=adv, mixed=mixed,
                           guidance=guidance, n_empty=n_empty, engine=engine, args=args, trajs=trajs, **seen)


_RUNS = {}
# the configurations several tests share (one SGD step, lr 1, all sequences of a kind in one micro-batch)
MAIN = dict(sgd=True, micro_batch=64)                                    # λ 0.5, Ĝ 0.2, α 0.01: full GRSD
LAM0 = dict(sgd=True, micro_batch=64, lambda_mod=0.0)                    # GRPO task advantages + α·L_ref
GRPO = dict(sgd=True, micro_batch=64, lambda_mod=0.0, alpha=0.0)         # plain GRPO
NONE = dict(sgd=True, micro_batch=64, guidance="none", alpha=0.0)        # 'w/o guidance', no L_ref


def cached_update(d, tok, batch, **kw):
    """run_update, memoised for the read-only uses several tests share (same inputs → same outputs)."""
    key = tuple(sorted(kw.items()))
    if key not in _RUNS:
        _RUNS[key] = run_update(d, tok, batch, **kw)
    return _RUNS[key]


@pytest.fixture(scope="module")
def independent(batch, tok):
    """ℓ_stu and ℓ_tea of every turn (trajectory order), scored here one sample at a time on an unsharded copy of
    the initial weights (= θ_old = θ̄), with the teacher context built here from GUIDE (None for group 1)."""
    trajs, _ = batch
    model, big = models.load_model("tiny", 0), teacher_len(make_args())
    out = []
    with torch.no_grad():
        for tr in trajs:
            for turn in tr.turns:
                stu, _ = C.sequence_logprobs(model, [turn.prompt_ids], [turn.response_ids], "cpu")
                tea = None
                if tr.group == 0:
                    ids = C.encode_prompt(tok, grsd.inject_guidance(turn.prompt_text, GUIDE), big)[0]
                    tea = C.sequence_logprobs(model, [ids], [turn.response_ids], "cpu")[0][0]
                out.append((stu[0], tea))
    return out


def a_hat_by_hand(batch, independent, lam=LAM, g_hat=G_HAT, unit="turn"):
    """Eq. (9)-(11) written out: per unit (a turn; a token; a whole trajectory) Δ = mean(ℓ_tea − ℓ_stu),
    q = sign(A)Δ, u = exp(q) − 1, D_x = mean |u| over group 0's units + ε_gap, q̂ = clip(u/D_x, ±Ĝ),
    Â = A(1 + λq̂) on group 0 (m_x = 1); group 1 keeps A. Returns Â per turn (1-D float64 tensors)."""
    trajs, _ = batch
    owner = [i for i, tr in enumerate(trajs) for _ in tr.turns]
    diffs = [(tea - stu).double() if tea is not None else None for stu, tea in independent]
    if unit == "turn":
        units = [[(j, k) for k in range(len(x))] for j, x in enumerate(diffs) if x is not None]
    elif unit == "token":
        units = [[(j, k)] for j, x in enumerate(diffs) if x is not None for k in range(len(x))]
    else:
        units = [[(j, k) for j in range(len(diffs)) if owner[j] == i for k in range(len(diffs[j]))]
                 for i in range(len(trajs)) if trajs[i].group == 0]
    delta = [sum(diffs[j][k].item() for j, k in u) / len(u) for u in units]
    a = [A_TASK[owner[u[0][0]]] for u in units]
    u_ = [math.expm1(math.copysign(1.0, x) * dl if x != 0 else 0.0) for x, dl in zip(a, delta)]
    d_x = sum(abs(x) for x in u_) / len(u_) + EPS
    q_hat = [min(max(x / d_x, -g_hat), g_hat) for x in u_]
    out = [torch.full((len(stu),), A_TASK[owner[j]], dtype=torch.float64) for j, (stu, _) in enumerate(independent)]
    for u, x, q in zip(units, a, q_hat):
        for j, k in u:
            out[j][k] = x * (1 + lam * q)
    return out


def n_tokens(tr):
    return sum(len(t.response_ids) for t in tr.turns)


# ------------------------------------------------------------------------------------------------ 1. the update


def test_update_on_expert_trajectories(d, tok, batch):
    trajs, refl = batch
    assert [len(tr.turns) for tr in trajs] == [5, 5, 4, 4, 4, 4, 4, 4]
    assert [tr.won for tr in trajs] == [True, True] + [False] * 6
    assert [tr.reward for tr in trajs] == pytest.approx([1, 1] + [-0.2] * 6)
    assert [r is None for r in refl[2]] == [False] * 5 + [True] + [False] * 2
    run = cached_update(d, tok, batch, **MAIN)  # the paper's λ 0.5, Ĝ 0.2, α 0.01, turn modulation
    row, args, turns, refls = run.row, run.args, run.turns, run.refls
    assert (args.lambda_mod, args.g_hat, args.alpha, args.modulation) == (LAM, G_HAT, 0.01, "turn")
    assert run.adv == pytest.approx(A_TASK, abs=1e-7)
    assert run.adv[4:] == [0.0] * 4
    # Stage B: group 0 mixed (S+ = {s_0}: s_1's judge failed; S− = {s_2, s_3}), group 1 all failures; the
    # scripted snapshot got exactly one p_guide, contrasting exactly those reflections, at the rollout temperature
    assert run.mixed == {0: True, 1: False} and run.guidance == {0: GUIDE, 1: None} and run.n_empty == 0
    want_ask = grsd.guidance_prompt(trajs[0].task, [RAW[0]], [RAW[2], RAW[3]])
    assert run.engine.prompts == [C.encode_prompt(tok, want_ask, 2 * args.max_prompt_len)[0]]
    assert run.engine.calls == [(1, args.reflection_max_tokens, args.temperature)]
    # turn samples: the student's own ids, the teacher context C(x, z_x, H) for group 0 only, weight 1/N_i; the
    # guidance block comes before the whole, unchanged student prompt (Eq. 8)
    p = trajs[0].turns[2].prompt_text
    h = grsd.inject_guidance(p, GUIDE)
    assert h.endswith("\n\n" + p) and h.startswith("[Privileged guidance") and GUIDE in h[:-len(p)]
    big = teacher_len(args)
    k = 0
    for i, tr in enumerate(trajs):
        for turn in tr.turns:
            s = turns[k]
            assert s.prompt_ids == turn.prompt_ids and s.response_ids == turn.response_ids
            assert s.teacher_ids == (C.encode_prompt(tok, grsd.inject_guidance(turn.prompt_text, GUIDE), big)[0]
                                     if tr.group == 0 else None)
            assert (s.traj, s.group, s.adv) == (i, tr.group, run.adv[i])
            assert s.weight == pytest.approx(1 / n_tokens(tr), rel=1e-12)
            k += 1
    assert k == len(turns) == 34
    # reflection samples: one per trajectory (the invalid one too: A_ref 0), p_ref ids, s_i ids, A_ref by hand
    assert [s.prompt_ids for s in refls] == refl[0] and [s.response_ids for s in refls] == refl[1]
    assert [s.adv for s in refls] == pytest.approx(A_REF, abs=1e-6)
    for g in (0, 1):  # A_REF written out above = Eq. (1) by hand = norm_g on the valid entries, invalid → 0
        sc = SCORES[4 * g:4 * g + 4]
        valid = torch.tensor([x is not None for x in sc])
        norm = grsd.norm_g(torch.tensor([float(x or 0) for x in sc]), EPS, valid).tolist()
        assert hand_norm(sc) == pytest.approx(A_REF[4 * g:4 * g + 4], abs=1e-12)
        assert norm == pytest.approx(hand_norm(sc), abs=1e-6)
    assert [s.weight for s in refls] == pytest.approx([1 / len(r) for r in refl[1]], rel=1e-12)
    assert all(s.teacher_ids is None for s in refls)
    # the update
    n_tok = sum(len(s.response_ids) for s in turns)
    assert row["train/tokens"] == n_tok and row["train/minibatches"] == 1
    assert row["losses/kl"] == pytest.approx(0.0, abs=1e-7)  # θ = π_ref before the step
    lo, hi = 1 - LAM * G_HAT, 1 + LAM * G_HAT
    assert lo - 1e-6 <= row["grsd/weight_min"] < 1 < row["grsd/weight_max"] <= hi + 1e-6  # Prop. 2, and real
    assert row["grsd/delta_abs_mean"] > 0 and row["grsd/adv_shift_abs"] > 0 and row["train/grad_norm"] > 0
    # the Â the update used: group 1 keeps A exactly (bit for bit), group 0 moves, never across sign(A)
    for s, a in zip(turns, run.a_hat):
        if s.group == 1:
            assert torch.equal(a, torch.full((len(s.response_ids),), s.adv))
        else:
            assert (a * s.adv > 0).all() and ((a / s.adv) >= lo - 1e-6).all() and ((a / s.adv) <= hi + 1e-6).all()
    assert any((a != s.adv).any() for s, a in zip(turns, run.a_hat) if s.group == 0)
    assert len(run.delta) == 18  # Δ of the 18 turns of group 0


# ------------------------------------------------------------------------------------------------ 2. L_task, L_ref


def test_rollout_is_token_weights_the_task_term_and_not_the_reflections(d, tok, batch):
    """--rollout_is token with π_θold/π_engine = 1.5 on every turn token: at θ = θ_old L_task = 1.5 × the plain one
    (Â·w in Eq. 13); L_ref (Eq. 14, reflections carry no engine log-probs) and the KL term are unchanged."""
    plain = cached_update(d, tok, batch, **MAIN).row
    row = run_update(d, tok, batch, engine_shift=math.log(1.5), **MAIN).row
    assert plain["losses/task"] != 0 and plain["losses/ref"] != 0
    assert row["losses/task"] == pytest.approx(1.5 * plain["losses/task"], rel=1e-4)
    assert row["losses/ref"] == pytest.approx(plain["losses/ref"], abs=1e-7)
    assert row["losses/kl"] == pytest.approx(plain["losses/kl"], abs=1e-7)
    assert row["rollout/logp_diff_mean"] == pytest.approx(math.log(1.5), abs=1e-5)


def test_task_loss_at_first_step_equals_the_modulated_advantage_by_hand(d, tok, batch, independent):
    """One mini-batch, ρ = 1: L_task = −(1/#traj) Σ_i (1/N_i) Σ_tokens Â, Â from ℓ_stu/ℓ_tea scored here."""
    trajs, _ = batch
    run = cached_update(d, tok, batch, **MAIN)
    run0 = cached_update(d, tok, batch, **LAM0)
    assert run.row["train/minibatches"] == 1
    a_hat = a_hat_by_hand(batch, independent)
    owner = [i for i, tr in enumerate(trajs) for _ in tr.turns]
    want = -sum(a.sum().item() / n_tokens(trajs[i]) for a, i in zip(a_hat, owner)) / len(trajs)
    want0 = -sum(A_TASK[i] * len(a) / n_tokens(trajs[i]) for a, i in zip(a_hat, owner)) / len(trajs)
    assert run.row["losses/task"] == pytest.approx(want, abs=1e-6)
    assert run0.row["losses/task"] == pytest.approx(want0, abs=1e-7)
    assert abs(want - want0) > 1e-4  # the modulation matters at λ = 0.5, Ĝ = 0.2
    # the Â the update used, token by token, and its Δ diagnostics
    # (ℓ scored here one sample at a time, there in padded batches: ~4e-6 apart after the division by D_x)
    assert max((a - b).abs().max().item() for a, b in zip(run.a_hat, a_hat)) < 3e-5
    deltas = [(tea - stu).double().mean().item() for stu, tea in independent if tea is not None]
    assert run.row["grsd/delta_mean"] == pytest.approx(sum(deltas) / len(deltas), abs=1e-6)
    assert run.row["grsd/delta_abs_mean"] == pytest.approx(sum(map(abs, deltas)) / len(deltas), abs=1e-6)
    w = torch.cat([a / A_TASK[i] for a, i in zip(a_hat, owner) if A_TASK[i] != 0])
    assert run.row["grsd/weight_min"] == pytest.approx(w.min().item(), abs=1e-6)
    assert run.row["grsd/weight_max"] == pytest.approx(w.max().item(), abs=1e-6)
    # L_ref at ρ = 1: each reflection's token mean of A_ref is A_ref, 1/#reflections over all 8 (invalid: 0).
    # (Norm_G centres each group's valid scores, so this sum is ~0 whatever the aggregation; the aggregation of
    # L_ref itself is checked through its gradient in test_alpha_and_lambda_zero_match_an_independent_step)
    assert run.row["losses/ref"] == pytest.approx(-sum(A_REF) / 8, abs=1e-7)
    assert run.row["losses/total"] == pytest.approx(run.row["losses/task"] + 0.01 * run.row["losses/kl"]
                                                    + 0.01 * run.row["losses/ref"], abs=1e-9)


# ------------------------------------------------------------------------------------------------ 3. GRPO


def test_lambda_zero_and_no_guidance_are_grpo_exactly(d, tok, batch):
    trajs, refl = batch
    zero = cached_update(d, tok, batch, **GRPO)
    none = cached_update(d, tok, batch, **NONE)
    assert zero.guidance == none.guidance == {0: None, 1: None} and zero.engine.prompts == none.engine.prompts == []
    assert zero.mixed == none.mixed == {0: True, 1: False}  # m_x is still reported
    assert all(torch.equal(zero.params[k], none.params[k]) for k in zero.params)  # both are GRPO, bit for bit
    assert all(torch.equal(a, torch.full_like(a, s.adv)) for s, a in zip(zero.turns, zero.a_hat))
    # the modulation moves the weights (λ 0.5 vs 0, both with α 0.01), and so does L_ref (α 0.01 vs 0, both λ 0)
    lam0, full = cached_update(d, tok, batch, **LAM0), cached_update(d, tok, batch, **MAIN)
    assert max((lam0.params[k] - full.params[k]).abs().max().item() for k in zero.params) > 1e-5
    assert max((lam0.params[k] - zero.params[k]).abs().max().item() for k in zero.params) > 1e-5
    # α = 0 leaves the reflection samples out entirely; α > 0 has one per trajectory with a non-empty s_i
    assert zero.refls == [] and none.refls == [] and len(lam0.refls) == 8
    _, refls = grsd.build_samples(trajs, A_TASK, refl, {0: None, 1: None}, tok, make_args(alpha=0.0))
    assert refls == []


def test_alpha_and_lambda_zero_match_an_independent_step(d, tok, batch):
    """The λ = 0 update, recomputed from scratch on an unsharded model in one batch: ρ = exp(ℓ − ℓ_old), the paper's
    aggregation 1/G Σ_i 1/N_i Σ_{t,k} of −min(ρA, clip(ρ)A) + 0.01·k3-KL to π_ref (= the initial weights), plus
    α·(1/#refl) Σ_i 1/|s_i| Σ_k −min(ρA_ref, clip(ρ)A_ref) on the reflection tokens, clip to norm 1, SGD step."""
    trajs, refl = batch
    for cfg in (GRPO, LAM0):
        run, alpha = cached_update(d, tok, batch, **cfg), cfg.get("alpha", 0.01)
        model = models.load_model("tiny", 0)

        def surrogate(prompts, responses, adv, weight):
            with torch.no_grad():
                old, _ = C.sequence_logprobs(model, prompts, responses, "cpu")
            logp, mask = C.sequence_logprobs(model, prompts, responses, "cpu")
            ratio = torch.exp(logp - old)
            a = torch.tensor(adv)[:, None]
            r = old - logp  # π_ref = the initial weights = θ_old
            per_tok = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a), torch.exp(r) - r - 1
            w = torch.tensor(weight)[:, None] * mask
            return [(x * w).sum() for x in per_tok]

        turns = [(t, i) for i, tr in enumerate(trajs) for t in tr.turns]
        pg, kl = surrogate([t.prompt_ids for t, _ in turns], [t.response_ids for t, _ in turns],
                           [A_TASK[i] for _, i in turns], [1 / n_tokens(trajs[i]) for _, i in turns])
        loss = (pg + 0.01 * kl) / len(trajs)
        if alpha:
            lref, _ = surrogate(refl[0], refl[1], A_REF, [1 / len(r) for r in refl[1]])
            loss = loss + alpha * lref / len(refl[1])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with torch.no_grad():
            want = {k: v - (v.grad if v.grad is not None else 0) for k, v in model.named_parameters()}
        assert run.row["train/grad_norm"] == pytest.approx(norm.item(), rel=1e-5), alpha  # before clipping
        assert max((run.params[k] - want[k]).abs().max().item() for k in want) < 1e-6, alpha
        assert max(v.grad.abs().max().item() for v in model.parameters()) > 1e-4  # a real step, not a no-op


# ------------------------------------------------------------------------------------------------ 4. invariances


def checksum(model) -> float:
    return sum((v.full_tensor() if hasattr(v, "full_tensor") else v).double().sum().item()
               for v in model.state_dict().values())


def test_follow_code_steps_the_reflections_after_the_task(d, tok, batch, monkeypatch):
    """Row 10 of docs/methods.md: under --follow code the reflections' α·L_ref is one optimizer step of its own after
    the task's mini-batch steps (n + 1 steps); the paper's reading puts them in the same n steps. With α = 0 both
    take n steps."""
    counts = []
    real_step = C.clip_and_step
    monkeypatch.setattr(grsd.C, "clip_and_step", lambda *a: counts.append(1) or real_step(*a))
    for follow, alpha, extra in (("paper", 0.01, 0), ("code", 0.01, 1), ("code", 0.0, 0)):
        counts.clear()
        run = run_update(d, tok, batch, sgd=True, minibatch_turns=8, micro_batch=64, follow=follow, alpha=alpha)
        assert len(counts) == run.row["train/minibatches"] + extra, (follow, alpha)
        assert (run.row["losses/ref"] != 0) == (alpha > 0)


def test_follow_code_passes_the_dual_clip_and_the_entropy_bonus_to_the_task_loss(d, tok, batch, monkeypatch):
    """Row 2 of docs/methods.md inside grsd_update: c = 3, the policy's entropy and 0.001 under --follow code."""
    calls, real = [], grsd.grsd_task_loss
    monkeypatch.setattr(grsd, "grsd_task_loss", lambda *a: calls.append(a[9:]) or real(*a))
    for follow, clip_c, coef in (("paper", 0.0, 0.0), ("code", 3.0, 0.001)):
        calls.clear()
        run_update(d, tok, batch, follow=follow)
        assert calls and all(c == clip_c and (e is None) == (follow == "paper") and k == coef for c, e, k in calls)


def test_stu_and_tea_are_scored_once_before_any_step(d, tok, batch, independent, monkeypatch):
    """Alg. 1 l.17-29: ℓ_stu, ℓ_ref, the reflections' ℓ_old and ℓ_tea are scored at θ_old = θ̄ before the first
    optimiser step, and Â stays fixed over all mini-batches (SGD lr 1 moves θ a lot between them)."""
    events, seen = [], []
    initial = checksum(models.load_model("tiny", 0))
    real_score, real_step, real_loss = C.score, C.clip_and_step, grsd.grsd_task_loss

    def score(model, prompts, responses, *a, **kw):
        events.append(("score", checksum(model), len(prompts)))
        return real_score(model, prompts, responses, *a, **kw)

    def step(model, optimizer, max_norm, max_skips):
        events.append(("step",))
        return real_step(model, optimizer, max_norm, max_skips)

    def loss(logp, old_logp, ref_logp, adv_hat, mask, *a, **kw):
        seen.append((adv_hat.detach().cpu().clone(), mask.detach().cpu().clone()))
        return real_loss(logp, old_logp, ref_logp, adv_hat, mask, *a, **kw)

    monkeypatch.setattr(grsd.C, "score", score)
    monkeypatch.setattr(grsd.C, "clip_and_step", step)
    monkeypatch.setattr(grsd, "grsd_task_loss", loss)
    run = run_update(d, tok, batch, sgd=True, minibatch_turns=8, micro_batch=64)
    n_mb = run.row["train/minibatches"]
    assert n_mb >= 3 and [e[0] for e in events] == ["score"] * 4 + ["step"] * n_mb
    assert [e[1] for e in events[:4]] == pytest.approx([initial] * 4, rel=1e-12)
    # ℓ_stu, ℓ_ref, the 6 reflections with A_ref ≠ 0 (the other 2 add exactly 0 to L_ref), ℓ_tea (group 0's turns)
    assert [e[2] for e in events[:4]] == [34, 34, 6, 18]
    # every turn's Â in every mini-batch is the θ_old one computed here
    want = a_hat_by_hand(batch, independent)
    free = list(range(len(want)))
    assert len(seen) == n_mb
    for adv, mask in seen:
        for j in range(adv.shape[0]):
            n = int(mask[j].sum())
            hit = next((i for i in free if len(want[i]) == n and (adv[j, :n] - want[i]).abs().max() < 3e-5), None)
            assert hit is not None, f"a mini-batch row matches no θ_old Â (row {j}, {n} tokens)"
            free.remove(hit)
    assert free == []  # each turn in exactly one mini-batch
    # θ leaves π_ref after the first of the mini-batches: the KL term is live and enters the total with β = 0.01
    row = run.row
    assert row["losses/kl"] > 1e-6
    assert row["losses/total"] == pytest.approx(row["losses/task"] + 0.01 * row["losses/kl"] + 0.01 * row["losses/ref"],
                                                rel=1e-9)
    # and the whole update, replayed here step by step on an unsharded model, gives the same weights
    want = replay_update(batch, independent, want, n_mb, alpha=0.01, beta=0.01)
    assert max((run.params[k] - want[k]).abs().max().item() for k in want) < 1e-5


def replay_update(batch, independent, a_hat, n_mb, alpha, beta):
    """grsd_update's mini-batch loop written out on an unsharded model with SGD (lr 1): the same mini-batches (the
    code's shuffle, seeded with the rank), each a step on −min(ρÂ, clip(ρ)Â) + β·k3 to π_ref with weights 1/N_i,
    divided by the mini-batch's Σ 1/N_i over its tokens, plus α·Σ_refl (1/|s_i|) Σ −min(ρA_ref, clip(ρ)A_ref) / #refl;
    ρ against ℓ_stu (the scores of the fixture), π_ref = θ_old = the initial weights; clip to norm 1."""
    trajs, refl = batch
    turns = [(t, i) for i, tr in enumerate(trajs) for t in tr.turns]
    random.seed(0)
    order, r_order = list(range(len(turns))), list(range(len(refl[1])))
    random.shuffle(order)
    random.shuffle(r_order)
    model = models.load_model("tiny", 0)
    with torch.no_grad():
        r_old = [C.sequence_logprobs(model, [p], [r], "cpu")[0][0] for p, r in zip(refl[0], refl[1])]

    def pad(rows):
        out = torch.zeros(len(rows), max(len(x) for x in rows))
        for k, x in enumerate(rows):
            out[k, :len(x)] = x
        return out

    def surrogate(logp, old, adv):
        ratio = torch.exp(logp - old)
        return -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)

    for b in range(n_mb):
        mb, rmb = order[b::n_mb], r_order[b::n_mb]
        logp, mask = C.sequence_logprobs(model, [turns[j][0].prompt_ids for j in mb],
                                         [turns[j][0].response_ids for j in mb], "cpu")
        old = pad([independent[j][0] for j in mb])
        w = torch.tensor([1 / n_tokens(trajs[turns[j][1]]) for j in mb])[:, None]
        r = old - logp
        per_tok = surrogate(logp, old, pad([a_hat[j].float() for j in mb])) + beta * (torch.exp(r) - r - 1)
        loss = (per_tok * mask * w).sum() / sum(w[k].item() * len(turns[j][0].response_ids) for k, j in enumerate(mb))
        if alpha and rmb:
            logp, mask = C.sequence_logprobs(model, [refl[0][j] for j in rmb], [refl[1][j] for j in rmb], "cpu")
            a = torch.tensor([A_REF[j] for j in rmb])[:, None]
            w = torch.tensor([1 / len(refl[1][j]) for j in rmb])[:, None]
            loss = loss + alpha * (surrogate(logp, pad([r_old[j] for j in rmb]), a) * mask * w).sum() / len(rmb)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with torch.no_grad():
            for v in model.parameters():
                if v.grad is not None:
                    v -= v.grad
                    v.grad = None
    return {k: v.detach() for k, v in model.named_parameters()}


def test_microbatching_does_not_change_the_update(d, tok, batch):
    a = cached_update(d, tok, batch, sgd=True, micro_batch=1)
    b = cached_update(d, tok, batch, **MAIN)
    c = cached_update(d, tok, batch, **LAM0)
    assert max((a.params[k] - b.params[k]).abs().max().item() for k in a.params) < 1e-6
    for k in ("train/grad_norm", "losses/task", "losses/ref", "losses/kl"):
        assert a.row[k] == pytest.approx(b.row[k], rel=1e-5, abs=1e-6), k  # float32 sums in another order
    assert max((b.params[k] - c.params[k]).abs().max().item() for k in a.params) > 1e-5  # modulation ≫ tolerance
    # length-aware micro-batches of ≤ 1500 padded tokens (1-2 turns each) against fixed ones of 8 turns
    f = cached_update(d, tok, batch, **{**MAIN, "micro_batch": 8, "micro_batch_tokens": 0})
    t = cached_update(d, tok, batch, **{**MAIN, "micro_batch_tokens": 1500})
    assert max((f.params[k] - t.params[k]).abs().max().item() for k in f.params) < 1e-6
    assert max((a.params[k] - t.params[k]).abs().max().item() for k in a.params) < 1e-6
    assert t.row["perf/padding_frac"] < 0.02 < f.row["perf/padding_frac"]


@pytest.mark.slow
def test_two_ranks_give_the_single_process_update(d, tok, batch, tmp_path):
    """Each of 2 FSDP ranks holds one group and runs micro-batches of 1 (unequal chunk counts, so padding chunks);
    the step equals the 1-process step on the whole batch in one micro-batch."""
    single = cached_update(d, tok, batch, **{**MAIN, "micro_batch_tokens": 0})  # fixed micro-batches
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(TESTS / "test_grsd.py"), str(tmp_path / "two.pt")]
    res = subprocess.run(cmd, cwd=HERE, env=worker_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    two = torch.load(tmp_path / "two.pt")
    assert two["row"]["train/tokens"] == single.row["train/tokens"]
    for k in ("losses/task", "losses/ref", "losses/kl", "grsd/delta_mean", "grsd/delta_abs_mean",
              "grsd/adv_shift_abs", "grsd/weight_min", "grsd/weight_max"):
        assert two["row"][k] == pytest.approx(single.row[k], abs=1e-6), k
    # the gradient before clipping (clipping to norm 1 would hide a wrong world-size scale in the weights)
    assert two["row"]["train/grad_norm"] == pytest.approx(single.row["train/grad_norm"], rel=1e-5)
    assert single.row["train/grad_norm"] > 1e-3
    assert max((two["params"][k] - single.params[k]).abs().max().item() for k in single.params) < 1e-6


# ------------------------------------------------------------------------------------------------ 5. variants


def test_token_and_trajectory_modulation_by_hand(tok, batch, independent):
    trajs, refl = batch
    owner = [i for i, tr in enumerate(trajs) for _ in tr.turns]
    old = [stu for stu, _ in independent]
    tea = [t if t is not None else stu for stu, t in independent]  # as grsd_update: ℓ_tea = ℓ_stu without z_x
    for unit in ("turn", "token", "trajectory"):
        args = make_args(modulation=unit)
        turns, _ = grsd.build_samples(trajs, A_TASK, refl, {0: GUIDE, 1: None}, tok, args)
        got, _ = grsd.turn_advantages(turns, old, tea, args)
        want = a_hat_by_hand(batch, independent, unit=unit)
        assert max((a - b).abs().max().item() for a, b in zip(got, want)) < 1e-6, unit
        for a, i in zip(got, owner):
            if A_TASK[i] == 0:
                assert (a == 0).all()
            else:  # within [1 − λĜ, 1 + λĜ]·A
                w = a.double() / A_TASK[i]
                assert (w >= 1 - LAM * G_HAT - 1e-6).all() and (w <= 1 + LAM * G_HAT + 1e-6).all(), unit
        if unit == "trajectory":  # one Â per rollout
            for i in range(4):
                assert len(torch.unique(torch.cat([a for a, o in zip(got, owner) if o == i]))) == 1
            assert len({got[owner.index(i)][0].item() for i in range(4)}) > 1
        elif unit == "token":  # Â varies inside a turn
            assert sum(len(torch.unique(a)) > 1 for a, i in zip(got, owner) if i < 4) >= 10
        else:  # one Â per turn, differing across the turns of a trajectory
            assert all(len(torch.unique(a)) == 1 for a in got)
            assert len({got[j][0].item() for j in range(5)}) > 1
    # λ = 0 with a guidance in place (teacher contexts built and scored): Â = A bit for bit, in every variant
    for unit in ("turn", "token", "trajectory"):
        args = make_args(modulation=unit, lambda_mod=0.0)
        turns, _ = grsd.build_samples(trajs, A_TASK, refl, {0: GUIDE, 1: None}, tok, args)
        assert sum(s.teacher_ids is not None for s in turns) == 18
        got, _ = grsd.turn_advantages(turns, old, tea, args)
        assert all(torch.equal(a, torch.full((len(s.response_ids),), s.adv)) for s, a in zip(turns, got))


def test_guidance_variants_by_hand(tok, batch):
    trajs, refl = batch
    good, bad = [RAW[0]], [RAW[2], RAW[3]]
    # 'w/o group aggregation': the raw valid reflections labelled by outcome, no generation
    engine = ScriptedEngine(tok, [GUIDE])
    mixed, guidance, n_empty = grsd.group_guidance(trajs, refl[2], refl[3], engine, make_args(guidance="unaggregated"),
                                                   harness.Timer())
    want = (f"From a successful attempt:\n{RAW[0]}\n\nFrom a failed attempt:\n{RAW[2]}\n\n"
            f"From a failed attempt:\n{RAW[3]}")
    assert grsd.unaggregated_guidance(good, bad) == want
    assert guidance == {0: want, 1: None} and mixed == {0: True, 1: False} and n_empty == 0 and engine.prompts == []
    # 'w/o failed reflections': p_guide from S+ only, no FAILED block and no AVOID section; m_x unchanged
    only = grsd.guidance_prompt(trajs[0].task, good, [])
    full = grsd.guidance_prompt(trajs[0].task, good, bad)
    assert "FAILED" not in only and "AVOID" not in only and RAW[0] in only and RAW[2] not in only
    assert "Reflections on attempts that FAILED:\n[1] " + RAW[2] + "\n\n[2] " + RAW[3] in full and "### AVOID" in full
    assert "Reflections on attempts that SUCCEEDED:\n[1] " + RAW[0] in full
    engine = ScriptedEngine(tok, [GUIDE])
    mixed, guidance, _ = grsd.group_guidance(trajs, refl[2], refl[3], engine, make_args(guidance="success_only"),
                                             harness.Timer())
    assert engine.prompts == [C.encode_prompt(tok, only, 2048)[0]] and guidance == {0: GUIDE, 1: None}
    assert mixed == {0: True, 1: False}
    # an empty sampled z_x deactivates the group (counted), so its turns get no teacher context
    engine = ScriptedEngine(tok, [" \n "])
    _, guidance, n_empty = grsd.group_guidance(trajs, refl[2], refl[3], engine, make_args(), harness.Timer())
    assert guidance == {0: None, 1: None} and n_empty == 1
    turns, _ = grsd.build_samples(trajs, A_TASK, refl, guidance, tok, make_args())
    assert all(s.teacher_ids is None for s in turns)
    # a group whose wins all lack a judge score is not mixed (S+ counts valid reflections only, Alg. 1 l.13)
    scores = [None, None] + refl[3][2:]
    mixed, guidance, _ = grsd.group_guidance(trajs, refl[2], scores, ScriptedEngine(tok, [GUIDE]), make_args(),
                                             harness.Timer())
    assert mixed == {0: False, 1: False} and guidance == {0: None, 1: None}


def test_unaggregated_guidance_keeps_every_reflection_within_the_budget(tok, batch):
    """Long reflections: each of the 3 valid ones of group 0 gets an equal share of guidance_max_tokens, so the failed
    ones (written last) are not the part that the budget cuts off."""
    trajs, refl = batch
    long = [None if r is None else r + " Then " + "check the countertop again carefully. " * 60 for r in refl[2]]
    args = make_args(guidance="unaggregated", guidance_max_tokens=120)
    _, guidance, _ = grsd.group_guidance(trajs, long, refl[3], ScriptedEngine(tok, [GUIDE]), args, harness.Timer())
    z = guidance[0]
    assert z.count("From a successful attempt:") == 1 and z.count("From a failed attempt:") == 2
    assert len(tok(z, add_special_tokens=False)["input_ids"]) <= 120
    turns, _ = grsd.build_samples(trajs, A_TASK, refl, guidance, tok, args)
    assert C.chat_ids(tok, grsd.inject_guidance(trajs[0].turns[0].prompt_text, z)) == turns[0].teacher_ids


# ------------------------------------------------------------------------------------------------ 6. parsers

JUDGE_CASES = [
    ("3", 3), ("3.", 3), (" 2 ", 2), ("Score: 1", 1),
    ("**Score:** 0", 0), ("**Score: 0**", 0), ("**3**", 3),
    ("**Score**: 0", 0), ("score = 2", 2), ("3\n", 3), ("0", 0),
    ("", None), (None, None), ("7", None), ("4", None), ("three", None), ("2/3", None), ("1 2", None),
    ("-1", None), ("Score: 3/3", None), ("2.5", None), ("The reflection names the decisive turn: 3", None),
    ("1 2 3 " * 2000 + "\n", None),  # 10 KB containing digits
    ("<think>\n\n</think>\n\n2", 2), ("<think>the reflection is decent, maybe 2 or 3", None),  # thinking judges
    ("Score: 2" + " " * 10_000, None),
]


@pytest.mark.parametrize("text,score", JUDGE_CASES)
def test_parse_judge(text, score):
    assert grsd.parse_judge(text) == score


P3 = "1. Go to the countertop first.\n2. Take the candle.\n3. Put it in the bed."
REFLECTION_CASES = [  # the documented rule: the numbered points (at line starts) are exactly 1, 2, 3 in order
    (P3, P3),
    ("1) Go to the countertop first.\n2) Take the candle.\n3) Put it in the bed.", "same"),
    ("**1.** Go first.\n**2.** Take it.\n**3.** Put it.", "same"),
    ("Here are my points:\n\n  " + P3 + "\n", P3.join(["Here are my points:\n\n  ", ""])),  # stripped
    ("1. Go to the countertop first.\n2. Take the candle.", None),  # two points
    (P3 + "\n4. Look again.", None),  # four points
    ("2. Take the candle.\n1. Go to the countertop first.\n3. Put it in the bed.", None),  # out of order
    ("1. a\n1. b\n2. c\n3. d", None),  # a repeated number
    ("1. a\n2. b\n3. c\n10. d", None), ("0. z\n1. a\n2. b\n3. c", None),  # multi-digit and zero numbers count
    ("1. Go first. 2. Take it. 3. Put it.", None),  # not numbered points at line starts
    ("- 1. Go first.\n- 2. Take it.\n- 3. Put it.", None),
    ("", None), (None, None), ("   \n", None),
    ("<think>\nPlan: 1. recall turns\n2. find the mistake\n</think>\n" + P3, P3),  # reasoning dropped
    ("<think>\n" + P3, None),  # unclosed reasoning: the points are inside it
]


@pytest.mark.parametrize("text,want", REFLECTION_CASES)
def test_parse_reflection(text, want):
    assert grsd.parse_reflection(text) == (text if want == "same" else want)


# ------------------------------------------------------------------------------------------------ 7. resolve


def test_resolve_refuses_a_sign_flipping_modulation():
    with pytest.raises(SystemExit, match="λĜ"):
        make_args(lambda_mod=5.0, g_hat=0.2)
    with pytest.raises(SystemExit, match="λĜ"):
        make_args(lambda_mod=1.0, g_hat=1.0)  # λĜ = 1: the paper's ≤ 1 would allow a zero weight
    with pytest.raises(SystemExit):
        make_args(lambda_mod=-0.1)
    args = make_args(lambda_mod=0.5, g_hat=0.2)  # λĜ = 0.1
    assert (args.lambda_mod, args.g_hat, args.model, args.group_size) == (0.5, 0.2, "tiny", 4)
    assert make_args(lambda_mod=0.0).lambda_mod == 0.0
    with pytest.raises(SystemExit):
        make_args(modulation="step")
    with pytest.raises(SystemExit):
        make_args(guidance="reference")


# ------------------------------------------------------------------------------------------------ 8. judge over HTTP


class Judge(BaseHTTPRequestHandler):
    """A scripted OpenAI-compatible judge on localhost: 'Score: 2' for most reflections, garbage for [r3], HTTP 500
    (every attempt) for [r6]."""
    bodies: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        text = body["messages"][0]["content"]
        if "[r6]" in text:
            self.send_response(500)
            self.end_headers()
        elif "[r3]" in text:
            reply(self, "I would give this reflection a 2 or maybe a 3.")
        else:
            reply(self, "Score: 2")

    def log_message(self, *a):
        pass


def test_reflect_and_judge_over_http(tok, batch):
    trajs, _ = batch
    texts = [refl_text(i) for i in range(8)]
    texts[5] = INVALID  # never sent to the judge
    engine = ScriptedEngine(tok, texts)
    args = make_args()
    server, url = serve(Judge)
    Judge.bodies = []
    client = harness.ChatClient(url, "judge-m", retries=1)
    try:
        p_ids, r_ids, reflections, scores = grsd.reflect_and_judge(trajs, engine, args, client, harness.Timer())
    finally:
        server.shutdown()
    want_p = [C.encode_prompt(tok, grsd.reflection_prompt(tr, 400), 2048)[0] for tr in trajs]
    assert engine.prompts == want_p and p_ids == want_p
    assert engine.calls == [(8, args.reflection_max_tokens, args.temperature)]  # sampled like the rollouts
    assert r_ids == [response_ids(tok, t) for t in texts]
    assert reflections == [t if i != 5 else None for i, t in enumerate(texts)]
    assert scores == [2, 2, 2, None, 2, None, None, 2]
    assert client.failures == 1  # [r6]: HTTP 500 on both attempts
    asked = [b["messages"][0]["content"] for b in Judge.bodies]
    assert len(asked) == 8 and asked.count(grsd.judge_prompt(trajs[6], texts[6], 400)) == 2  # 7 asks + 1 retry
    assert sorted(set(asked)) == sorted(grsd.judge_prompt(trajs[i], texts[i], 400) for i in range(8) if i != 5)
    assert all((b["model"], b["temperature"], b["max_tokens"]) == ("judge-m", 0.0, 16) for b in Judge.bodies)


# ------------------------------------------------------------------------------------------------ 9. end to end


class ScoreTwo(BaseHTTPRequestHandler):
    calls = 0

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        type(self).calls += 1
        reply(self, "2")

    def log_message(self, *a):
        pass


REQUIRED = ("losses/task", "losses/ref", "losses/kl", "losses/total", "reflection/reward_mean",
            "reflection/valid_rate", "reflection/judged_rate", "guidance/valid_group_ratio",
            "guidance/mixed_outcome_ratio", "grsd/delta_abs_mean", "grsd/weight_min", "grsd/weight_max",
            "charts/success_rate", "charts/episode_length", "train/grad_norm",
            "train/tokens", "time/rollout", "time/reflection", "time/judge", "time/scoring", "time/update",
            "time/total")


def check_rows(rows, n):
    assert [r["update"] for r in rows] == list(range(n))
    for row in rows:
        for k in REQUIRED:
            assert k in row, k
        for k, v in row.items():
            assert v == v, f"{k} is NaN"
        assert 0 <= row["reflection/valid_rate"] <= 1 and 0 <= row["guidance/valid_group_ratio"] <= 1
        assert 1 - LAM * G_HAT - 1e-6 <= row["grsd/weight_min"] <= row["grsd/weight_max"] <= 1 + LAM * G_HAT + 1e-6
        assert row["train/tokens"] > 0
    assert "eval/success" in rows[-1] and 0 <= rows[-1]["eval/success"] <= 1


def quiet_env():
    """clean_env() with one OpenMP thread per process (see one_thread; torchrun sets this itself for 2 ranks)."""
    return {**clean_env(), "OMP_NUM_THREADS": "1"}


def run(cmd, timeout=300):
    res = subprocess.run(cmd, cwd=HERE, env=quiet_env(), capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


SMALL = ["--max_response_len", "32", "--reflection_max_tokens", "32", "--eval_tasks", "2"]


@pytest.mark.slow
def test_grsd_end_to_end_single_process_with_http_judge(tmp_path):
    ScoreTwo.calls = 0
    server, url = serve(ScoreTwo)
    try:
        run([sys.executable, str(HERE / "grsd.py"), "--out_dir", str(tmp_path), "--judge_url", url,
             "--judge_model", "m", *SMALL])
    finally:
        server.shutdown()
    rows = strict_rows_of(tmp_path)
    check_rows(rows, 2)
    n_traj = 2 * 4  # tiny preset: 2 tasks × 4 rollouts
    # the judge is asked exactly once per valid reflection, and each of its "2" replies is a score of 2
    assert ScoreTwo.calls == round(sum(r["reflection/valid_rate"] for r in rows) * n_traj)
    for r in rows:
        assert r["reflection/judged_rate"] == r["reflection/valid_rate"] and r["endpoint/judge/failures"] == 0
        assert r["reflection/reward_mean"] == (2.0 if r["reflection/judged_rate"] else 0.0)
        assert 1 <= r["charts/episode_length"] <= 6 and r["charts/response_tokens"] <= 32
    assert rows[0]["losses/kl"] == pytest.approx(0.0, abs=1e-6)  # one mini-batch at θ = π_ref
    args = json.load(open(tmp_path / "args.json"))
    assert args["judge_url"] == url and (args["lambda_mod"], args["g_hat"], args["alpha"]) == (0.5, 0.2, 0.01)
    check_checkpoint(tmp_path / "final")


@pytest.mark.slow
def test_grsd_end_to_end_torchrun_two_ranks_one_idle_policy_judge(tmp_path):
    run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         str(HERE / "grsd.py"), "--out_dir", str(tmp_path), "--updates", "1", "--tasks_per_update", "1", *SMALL])
    (row,) = strict_rows_of(tmp_path)  # one task group: rank 1 has nothing to play, reflect or judge
    check_rows([row], 1)
    assert "endpoint/judge/failures" not in row and row["charts/episode_length"] >= 1  # θ_old judges
    check_checkpoint(tmp_path / "final")


@pytest.mark.slow
@pytest.mark.parametrize("env_name,data", [("alfworld", "alfworld"), ("search", "search_qa"), ("webshop", "webshop")])
def test_grsd_runs_real_benchmark_episodes(env_name, data, tmp_path):
    if not (SHARED / data).is_dir():
        pytest.skip(f"no {data} data at {SHARED / data} (set SHARED_DATA)")
    if env_name == "alfworld":
        pytest.importorskip("alfworld", reason="pip install alfworld==0.4.2 pyyaml")
    short = ["--max_steps", "3"] if env_name == "webshop" else []  # (WebShop's long pages: the cheapest real run)
    run([sys.executable, str(HERE / "grsd.py"), "--env", env_name, "--model", "tiny", "--data_dir",
         str(SHARED / data), "--updates", "1", "--tasks_per_update", "2", "--group_size", "2", "--eval_tasks", "2",
         "--out_dir", str(tmp_path)] + short)
    (row,) = strict_rows_of(tmp_path)
    check_rows([row], 1)
    steps = {"alfworld": 6, "search": 4, "webshop": 3}[env_name]  # tiny: ALFWorld ≤ 6, Search-R1 4, WebShop 3 here
    assert 1 <= row["charts/episode_length"] <= steps
    assert (tmp_path / "final" / "config.json").is_file()


if __name__ == "__main__":  # the 2-rank worker of test_two_ranks_give_the_single_process_update
    dist_ = models.init_distributed(seed=0)
    tok_ = models.load_tokenizer("tiny")
    # micro-batches of ≤ 1500 padded tokens: the ranks run different numbers of real chunks (padding chunks)
    out_ = run_update(dist_, tok_, grsd_batch(tok_), **{**MAIN, "micro_batch_tokens": 1500})
    if dist_.main:
        torch.save({"row": out_.row, "params": out_.params}, sys.argv[1])
    models.shutdown()
