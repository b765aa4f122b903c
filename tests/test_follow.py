"""--follow paper|code (issue 56): each row of docs/methods.md's "paper text vs released code" table on its own small
input, by hand: the paper's value under --follow paper and the released code's under --follow code. Row numbers are
the table's."""
import math
import types

import pytest
import torch

import common as C
import grsd
import harness
import opid


def turn(reward: float, n_tokens: int = 2, penalty: float = 0.0) -> C.Turn:
    """A turn whose reward already has `penalty` taken off (as envs.Env.step pays it)."""
    return C.Turn("prompt", [1, 2], list(range(3, 3 + n_tokens)), "reply", "act", penalty == 0, "obs", reward, None,
                  penalty)


def traj(group: int, rewards: list[float], penalties: list[float] | None = None, **kw) -> C.Trajectory:
    penalties = penalties or [0.0] * len(rewards)
    tr = C.Trajectory(f"task{group}", group, "task", "family", "obs",
                      [turn(r, penalty=p, **kw) for r, p in zip(rewards, penalties)])
    tr.won = any(r > 0 for r in rewards)
    return tr


# ---------------------------------------------------------------------------------------------------------- row 1

def test_row1_the_penalty_on_the_invalid_step_and_step_sample_normalisation():
    """Rewards 10 and 0; the winner's first step was invalid (−0.1), so R = [9.9, 0]. Paper: A_ep = (R − μ)/σ per
    trajectory = [1, −1], broadcast to the steps: [1, 1, −1]. Code: step scores [10 − 0.1, 10, 0], normalised over
    the three step-samples with the unbiased std + 1e-6: [0.569, 0.586, −1.155]; WebShop's mean_norm: s − μ."""
    trajs = [traj(0, [-0.1, 10.0], [0.1, 0.0]), traj(0, [0.0])]
    assert [C.step_scores(tr) for tr in trajs] == [[9.9, 10.0], [0.0]]
    # verl_agent rules run a malformed reply's command: a penalised step can still win (10 − 0.1 = 9.9)
    assert C.step_scores(traj(0, [0.0, 9.9], [0.0, 0.1])) == [10.0, 9.9] and C.task_reward(traj(0, [9.9], [0.1])) == 10
    s = torch.tensor([9.9, 10.0, 0.0])
    want = ((s - s.mean()) / (s.std() + 1e-6)).tolist()  # by hand: μ 6.633, σ 5.745
    assert want == pytest.approx([0.5686, 0.5860, -1.1547], abs=1e-4)
    assert C.code_step_advantages(trajs) == [pytest.approx(want[:2], abs=1e-6), pytest.approx(want[2:], abs=1e-6)]
    assert C.code_step_advantages(trajs, std_norm=False) == [pytest.approx([3.2667, 3.3667], abs=1e-4),
                                                              pytest.approx([-6.6333], abs=1e-4)]
    assert opid.episode_advantages(torch.tensor([[9.9, 0.0]])).tolist() == [[1.0, -1.0]]
    assert C.code_step_advantages([traj(0, [0.7])]) == [[pytest.approx(0.7)]]  # one step-sample: μ 0, σ 1


def test_row11_a_float32_tie_is_not_zero_in_the_code():
    """Eight step-samples scoring 0.9: the paper's (R − μ)/σ of a tied group is exactly 0; the code's float32 mean
    is 0.90000004 and its std 6.4e-8, so (s − μ)/(σ + 1e-6) = −0.056 on every step."""
    trajs = [traj(0, [0.9]) for _ in range(8)]
    assert opid.episode_advantages(torch.full((1, 8), 0.9)).abs().sum() == 0
    code = [a for x in C.code_step_advantages(trajs) for a in x]
    assert code == pytest.approx([-0.0560] * 8, abs=2e-4)
    assert C.code_step_advantages([traj(0, [10.0]) for _ in range(8)]) == [[0.0]] * 8  # 0 and 10 tie exactly


# ---------------------------------------------------------------------------------------------------------- row 2

def test_row2_dual_clip_and_entropy_bonus():
    """A bad token (A = −1) whose ratio grew to 5: the paper's clipped loss is max(−ρA, −clip(ρ)A) = 5, the code's
    dual clip caps it at −c·A = 3; a good token (A = +1) is untouched. The entropy bonus subtracts 0.001 × the
    token-mean entropy."""
    logp, old = torch.log(torch.tensor([[5.0, 5.0]])), torch.zeros(1, 2)
    adv, mask = torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2)
    assert C.clipped_surrogate(logp, old, adv, 0.2)[0].tolist() == pytest.approx([5.0, -1.2])
    assert C.dual_clipped_surrogate(logp, old, adv, 0.2, 3.0)[0].tolist() == pytest.approx([3.0, -1.2])
    paper, _, _ = opid.opid_loss(logp, old, old, adv, mask, 0.2, 0.0)
    ent = torch.tensor([[0.5, 1.5]])
    code, pg, _ = opid.opid_loss(logp, old, old, adv, mask, 0.2, 0.0, None, 3.0, ent, 0.001)
    assert paper.item() == pytest.approx((5.0 - 1.2) / 2) and pg.item() == pytest.approx((3.0 - 1.2) / 2)
    assert code.item() == pytest.approx((3.0 - 1.2) / 2 - 0.001 * 1.0)


def test_row2_the_entropy_is_the_policy_entropy_at_each_response_token(tok):
    """sequence_logprobs(with_entropy=True): −Σ_v p_v log p_v of the tiny model's next-token distribution, at the
    same positions as the log-probs (left-padded rows included)."""
    import models
    model = models.load_model("tiny", 0)
    prompts, responses = [[5, 6, 7], [8]], [[9, 10], [11, 12, 13]]
    logp, mask, ent = C.sequence_logprobs(model, prompts, responses, "cpu", with_entropy=True)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1:-1].float()
        dist = torch.distributions.Categorical(logits=logits)
        assert ent[i, :len(r)].tolist() == pytest.approx(dist.entropy().tolist(), abs=1e-5)
        assert logp[i, :len(r)].tolist() == pytest.approx(dist.log_prob(torch.tensor(r)).tolist(), abs=1e-5)


# ---------------------------------------------------------------------------------------------------------- row 3

def test_row3_additive_scores_the_two_skills_apart_and_adds_both_shifts():
    """ℓ_old 0, ℓ with the episode skill 1, with the step skill 2, with both in one context 1.5, λ = 0.001: the paper
    (one context with both skills) gives 0.001 × 1.5 = 0.0015, the code 0.001 × (1 − 0) + 0.001 × (2 − 0) = 0.003."""
    z, one, mask = torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1)
    paper = opid.opid_advantages(torch.zeros(1), z, torch.full((1, 1), 1.5), mask, one, 0.001)[0]
    code = opid.opid_advantages(torch.zeros(1), z, torch.full((1, 1), 1.0), mask, one, 0.001, torch.full((1, 1), 2.0),
                                one)[0]
    assert paper.item() == pytest.approx(0.0015) and code.item() == pytest.approx(0.003)


def test_row3_code_additive_builds_one_context_per_skill(tok):
    trajs = [traj(0, [0.0, 0.0]), traj(0, [10.0])]
    for tr in trajs:
        for t in tr.turns:
            t.prompt_text = "Your task is to: x\nNow it's your turn to take an action."
    analyses = [opid.Analysis("EPISODE", {1: "STEP"}), opid.Analysis("WIN", {})]
    args = types.SimpleNamespace(skill_mode="additive", skill_max_tokens=64, max_prompt_len=512, env="household")
    for follow in ("paper", "code"):
        samples, _, routes = opid.build_samples(trajs, analyses, tok, types.SimpleNamespace(**vars(args),
                                                                                                follow=follow))
        both = samples[1]
        text = tok.decode(both.teacher_ids)
        assert both.route == "both" and "EPISODE" in text and ("STEP" in text) == (follow == "paper")
        assert (both.step_teacher_ids is None) == (follow == "paper")
        if follow == "code":
            step_text = tok.decode(both.step_teacher_ids)
            assert "STEP" in step_text and "EPISODE" not in step_text
        assert samples[0].step_teacher_ids is None and routes["both"] == 1


# ---------------------------------------------------------------------------------------------------------- row 4

@pytest.mark.parametrize("step_skills,paper,code", [
    ('{"0": "", "2": "do X"}', {2: "do X"}, {0: ""}),           # max 1: the empty skill takes the code's one slot
    ('{"2": "a", "0": "b", "2": "c"}', {2: "a"}, {2: "c"}),     # a repeated key: first vs last value
    ('{"1": null, "2": 5}', {}, {1: "None"}),                   # not strings: dropped vs str()-ed
    ('{"step 1": "a", " 2 ": "b"}', {1: "a"}, {2: "b"}),        # "step 1": read vs skipped by int()
    ('{"1": "do \\ud83d it"}', {1: "do ? it"}, {1: "do ? it"}),  # a lone surrogate: '?' in both (tokenizable)
])
def test_row4_step_skills_as_the_code_parses_them(step_skills, paper, code):
    reply = '{"episode_skill": "E", "step_skills": ' + step_skills + '}'
    got = {f: opid.parse_analysis(reply, 3, 1, f)[0] for f in ("paper", "code")}
    assert got["paper"].steps == paper and got["code"].steps == code
    routes = opid.route_skills(got["code"], 3)  # an empty step skill routes to the episode skill
    assert [st for _, st in routes] == [code.get(t) or None for t in range(3)]
    assert all(ep == "E" for (ep, st) in routes if st is None)


# ------------------------------------------------------------------------------------------------ GRSD: rows 5-10

def modulate(adv, diffs, follow, unit="turn", lam=0.5, g_hat=0.2):
    """grsd.modulated_advantages on one mixed group: turn k has the per-token Δs diffs[k] (an empty list: no
    tokens); returns each turn's first-token Â (every token of a turn shares it)."""
    mask = C.pad_right([torch.ones(len(x)) for x in diffs], "cpu")
    diff = C.pad_right([torch.tensor(x, dtype=torch.float32) for x in diffs], "cpu")
    n = len(diffs)
    a_hat = grsd.modulated_advantages(torch.tensor(adv), diff, mask, torch.zeros(n, dtype=torch.long),
                                      torch.arange(n), torch.ones(n, dtype=torch.bool), unit, lam, g_hat, 1e-6, follow)
    return [a_hat[k, 0].item() if diffs[k] else None for k in range(n)]


def test_row5_the_code_clamps_q_at_20_and_floors_the_weight():
    """A [1, 1, −1], Δ [25, 22, −0.5], λ 0.5, Ĝ 0.2: the paper's q̂ keeps e^25 ≫ e^22 apart, so the second turn gets
    1 + 0.5·0.1423 = 1.0711; the code clamps both q to 20 (equal u), and both reach Ĝ: 1.1. The floor: Ĝ 3 (the
    code's own default) lets 1 + λq̂ reach 0 (q̂ = −2); the code floors it at 0.1."""
    assert modulate([1.0, 1.0, -1.0], [[25.0], [22.0], [-0.5]], "paper") == pytest.approx([1.1, 1.07114, -1.0],
                                                                                         abs=1e-5)
    assert modulate([1.0, 1.0, -1.0], [[25.0], [22.0], [-0.5]], "code") == pytest.approx([1.1, 1.1, -1.0], abs=1e-5)
    assert modulate([1.0, 1.0], [[-20.0], [0.0]], "code", g_hat=3.0) == pytest.approx([0.1, 1.0], abs=1e-6)


def test_row6_a_turn_without_tokens_counts_in_the_codes_d_x():
    """Turn lengths [2, 0, 1, 1], Δ [1, –, 0.01, 0.02]: the paper's D_x is the mean |u| over the 3 turns with tokens
    (0.583), the code's over all 4 (0.437): [1.1, 1.00862, 1.01733] vs [1.1, 1.0115, 1.0231]."""
    diffs = [[1.0, 1.0], [], [0.01], [0.02]]
    assert modulate([1.0] * 4, diffs, "paper") == [pytest.approx(1.1), None, pytest.approx(1.00862, abs=1e-5),
                                                   pytest.approx(1.01733, abs=1e-5)]
    assert modulate([1.0] * 4, diffs, "code") == [pytest.approx(1.1), None, pytest.approx(1.01150, abs=1e-5),
                                                  pytest.approx(1.02311, abs=1e-5)]


def test_row7_the_codes_guidance_groups_use_every_reflection(tok):
    """A win with a judged reflection and a loss whose reflection is not valid (no three points; the judge gave
    nothing): the paper's S− is empty, so m_x = 0; the code puts every reflection in S± by reward > 0, so m_x = 1."""
    trajs = [traj(0, [10.0]), traj(0, [0.0])]
    reflections, scores = ["1. a\n2. b\n3. c", "it went wrong"], [2, None]
    engine = types.SimpleNamespace(tok=tok)
    for follow, mixed in (("paper", False), ("code", True)):
        args = types.SimpleNamespace(follow=follow, guidance="unaggregated", lambda_mod=0.5, guidance_max_tokens=256)
        m, guidance, _ = grsd.group_guidance(trajs, reflections, scores, engine, args, harness.Timer())
        assert m == {0: mixed} and (guidance[0] is not None) == mixed
    assert grsd.parse_reflection("it went wrong") is None and grsd.parse_reflection("it went wrong", "code") == \
        "it went wrong"


def test_row8_the_codes_token_variant_is_not_normalised():
    """Token-level modulation, one turn with token Δs [0.01, 0.4, 0.5], A = 1: the paper divides u by the group's
    D_x over tokens (0.384), so the first token gets 1 + 0.5·0.0262 = 1.0131; the code (token_norm none) uses u
    itself: 1 + 0.5·(e^0.01 − 1) = 1.00503."""
    def first_token(follow):
        mask, diff = torch.ones(1, 3), torch.tensor([[0.01, 0.4, 0.5]])
        return grsd.modulated_advantages(torch.ones(1), diff, mask, torch.zeros(1, dtype=torch.long),
                                         torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.bool), "token",
                                         0.5, 0.2, 1e-6, follow)[0, 0].item()
    assert first_token("paper") == pytest.approx(1.01311, abs=1e-5)
    assert first_token("code") == pytest.approx(1 + 0.5 * math.expm1(0.01), abs=1e-6)


@pytest.mark.parametrize("reply,paper,code", [("I'd give it a 2", None, 2), ("Score: 10/10", None, 1),
                                              ("2", 2, 2), ("4", None, None), ("", None, None)])
def test_row9_the_codes_judge_reads_the_first_digit_0_to_3(reply, paper, code):
    assert grsd.parse_judge(reply) == paper and grsd.parse_judge_code(reply) == code


def test_row10_a_ref_is_normalised_with_std_plus_eps_in_the_code():
    """A_ref: the code's (v − v̄)/(σ + 1e-6) and the paper's (v − v̄)/sqrt(σ² + 1e-6) agree on judge scores [3, 1, 0]
    ([1.3363, −0.2673, −1.0690]) but not when σ is near ε: [0, 0.001] gives ±0.998 vs ±0.447 (group_norm, the path
    build_samples takes); a group with one judged reflection gets 0 in both. (That the reflection step comes after
    the task's: tests/test_grsd.py::test_follow_code_steps_the_reflections_after_the_task.)"""
    v, ok = torch.tensor([3.0, 1.0, 0.0]), torch.ones(3, dtype=torch.bool)
    assert grsd.code_norm(v, ok).tolist() == pytest.approx([1.3363, -0.2673, -1.0690], abs=1e-4)
    assert grsd.code_norm(v, ok).tolist() == pytest.approx(grsd.norm_g(v, 1e-6, ok).tolist(), abs=1e-5)
    trajs = [traj(0, [1.0]), traj(0, [0.0])]
    assert grsd.group_norm(trajs, [0.0, 0.001], 1e-6, "code") == pytest.approx([-0.998, 0.998], abs=1e-3)
    assert grsd.group_norm(trajs, [0.0, 0.001], 1e-6, "paper") == pytest.approx([-0.4472, 0.4472], abs=1e-4)
    one = torch.tensor([True, False, False])
    assert grsd.code_norm(v, one).tolist() == grsd.norm_g(v, 1e-6, one).tolist() == [0.0, 0.0, 0.0]


def test_row12_the_codes_task_loss_is_a_token_mean(tok):
    """Two trajectories of 1 and 3 response tokens: Eq. (13)'s 1/G Σ_i 1/N_i gives each token of the first 1/2 and
    each of the second 1/6 of the loss; the code's token mean gives every token 1/4 (weight ω / Σ ω·tokens)."""
    trajs = [traj(0, [10.0], n_tokens=1), traj(0, [0.0], n_tokens=3)]
    refl = ([[1], [1]], [[2], [2]], ["1. a\n2. b\n3. c"] * 2, [1, 2])
    for follow, want in (("paper", [1 / 2, 1 / 6]), ("code", [1 / 4, 1 / 4])):
        args = types.SimpleNamespace(follow=follow, eps_adv=1e-6, alpha=0.01, guidance_max_tokens=64,
                                     max_prompt_len=256)
        turns, refls = grsd.build_samples(trajs, [1.0, -1.0], refl, {0: None}, tok, args)
        denom = sum(s.weight * len(s.response_ids) for s in turns)
        assert [s.weight / denom for s in turns] == pytest.approx(want)
        # the code's step-sample advantages: scores [10, 0], (s − 5)/(7.0711 + 1e-6)
        assert [s.adv for s in turns] == pytest.approx([1.0, -1.0] if follow == "paper" else [0.70711, -0.70711],
                                                       abs=1e-5)


def test_the_env_reports_each_steps_penalty():
    """info["penalty"] is what the step's reward lost (C.step_scores reads it from Turn.penalty): a malformed reply
    costs 0.1 on household, a valid one nothing."""
    import envs
    env = envs.make_env("household", split="train", seed=0)
    env.reset(env.task_ids()[0])
    _, r, _, info = env.step("no tags at all")
    assert info["penalty"] == 0.1 and r == -0.1
    _, r, _, info = env.step(envs.format_expert_response(env.expert_action(), "household"))
    assert info["penalty"] == 0.0 and r >= 0


def test_follow_is_a_choice_and_code_refuses_trajectory_modulation():
    with pytest.raises(SystemExit, match="^--follow must be one of paper, code; got 'text'"):
        opid.resolve(opid.Args(out_dir="run", follow="text"))
    with pytest.raises(SystemExit, match="^--follow code has no --modulation trajectory"):
        grsd.resolve(grsd.Args(out_dir="run", follow="code", modulation="trajectory"))
    assert grsd.resolve(grsd.Args(out_dir="run", follow="code", g_hat=3.0)).g_hat == 3.0  # the floor keeps A's sign
    with pytest.raises(SystemExit, match="λĜ < 1"):
        grsd.resolve(grsd.Args(out_dir="run", g_hat=3.0))
