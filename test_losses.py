"""The equations, checked numerically: hand-computed values, autograd against the stated gradients, and the
papers' propositions on small exact categorical cases."""
import math

import pytest
import torch

import common as C
import models
import grsd
import opid
import seed


@pytest.fixture(scope="module")
def d():
    """The 1-rank gloo group of `python seed.py` (the one pytest already holds, if any; else formed here and torn down
    again with the environment restored), for the few checks that run a collective. tests/conftest.py's `d` does the
    same for tests/; this file stands alone beside the method files."""
    import os
    import torch.distributed as dist
    if dist.is_initialized():
        yield C.Dist(dist.get_rank(), dist.get_world_size(), torch.device("cpu"))
        return
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    saved = {k: os.environ.get(k) for k in keys}
    yield models.init_distributed(seed=0)
    dist.destroy_process_group()
    for k, v in saved.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def sig(x):
    return 1 / (1 + math.exp(-x))


# ---------------------------------------------------------------------------------------------- SEED Eq. (1)

def test_opd_delta_gate_and_loss_by_hand():
    logp = torch.tensor([[-1.0, -2.0, -0.3]])
    skill = torch.tensor([[-0.5, -2.5, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # third token is padding
    loss, gate = seed.opd_loss(logp, skill, mask, beta_opd=5.0)
    # Δ = [0.5, -0.5]; g = σ(5Δ) = [σ(2.5), σ(-2.5)]; L = mean(g·Δ) over the 2 valid tokens
    g1, g2 = sig(2.5), sig(-2.5)
    assert gate[0, :2].tolist() == pytest.approx([g1, g2], abs=1e-6)
    assert loss.item() == pytest.approx((g1 * 0.5 + g2 * -0.5) / 2, abs=1e-6)
    assert loss.item() == pytest.approx(0.2120711, abs=1e-6)


def test_opd_denominator_is_the_given_token_count():
    logp, skill, mask = torch.tensor([[-1.0, -1.0]]), torch.tensor([[0.0, 0.0]]), torch.ones(1, 2)
    loss, _ = seed.opd_loss(logp, skill, mask, 5.0, denom=8.0)  # e.g. a mini-batch of 8 tokens across ranks
    assert loss.item() == pytest.approx(2 * sig(5.0) * 1.0 / 8.0, abs=1e-6)


def test_opd_gradient_is_gate_weighted_nll_with_teacher_and_gate_detached():
    """∇L_opd = −E[m · g · ∇ℓ_θ]: the teacher branch uses the SAME parameters (different context) and must not
    contribute to the gradient, nor may the gate."""
    torch.manual_seed(0)
    z = torch.randn(5, 7, requires_grad=True)          # logits of 5 positions over a 7-token vocabulary
    ctx = torch.randn(5, 7)                             # the skill's effect on the logits
    tokens = torch.randint(0, 7, (5,))
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0])
    lp = lambda logits: torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)  # noqa: E731
    student, teacher = lp(z), lp(z + ctx)               # both depend on z
    loss, gate = seed.opd_loss(student[None], teacher[None], mask[None], beta_opd=5.0)
    (grad,) = torch.autograd.grad(loss, z)
    # the stated gradient, assembled from the per-token gradients ∇ℓ_θ
    expected = torch.zeros_like(z)
    for t in range(5):
        (g_t,) = torch.autograd.grad(lp(z)[t], z)
        expected -= mask[t] * gate[0, t].item() * g_t / mask.sum()
    assert torch.allclose(grad, expected, atol=1e-6)
    assert grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------- group advantage

def test_group_advantages_by_hand_and_tied_group_is_zero():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [0.9, -0.1, 0.0, -0.2]])
    a = seed.group_advantages(r, eps=1e-6)
    assert a[0].tolist() == pytest.approx([0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6)] * 1 + [-0.5 / (0.5 + 1e-6),
                                                                                           0.5 / (0.5 + 1e-6)])
    assert a[1].tolist() == [0.0, 0.0, 0.0, 0.0]  # σ = 0: exactly 0, not NaN
    mu = 0.15
    sd = math.sqrt(((0.75) ** 2 + 0.25 ** 2 + 0.15 ** 2 + 0.35 ** 2) / 4)  # population std
    assert a[2].tolist() == pytest.approx([(x - mu) / (sd + 1e-6) for x in [0.9, -0.1, 0.0, -0.2]], abs=1e-6)


@pytest.mark.parametrize("value", [0.9, 0.99, 2 / 3, -0.1, 0.7])
def test_tied_group_with_inexact_rewards_is_exactly_zero(value):
    """In float32, eight copies of 0.9 have R − μ ≈ σ ≈ 1e-8; (R − μ)/(σ + 1e-6) would be ~±0.05, not 0."""
    r = torch.full((1, 8), value)
    assert seed.group_advantages(r, eps=1e-6).tolist() == [[0.0] * 8]


def test_group_index_gathers_each_groups_rewards_and_scatters_the_advantages_back():
    """Trajectories of two interleaved groups (ids 7 and 2): by_group gives [G, N] rows in sorted group order, each
    in trajectory order; from_groups puts every value back at its trajectory (seed / opid build_samples)."""
    from types import SimpleNamespace
    trajs = [SimpleNamespace(group=g) for g in (7, 2, 7, 2)]
    group = C.group_index(trajs)
    assert group.tolist() == [1, 0, 1, 0]
    rewards = torch.tensor([10.0, 1.0, 0.0, 0.0])
    assert C.by_group(rewards, group).tolist() == [[1.0, 0.0], [10.0, 0.0]]
    adv = seed.group_advantages(C.by_group(rewards, group), eps=0.0)
    assert C.from_groups(adv, group).tolist() == [1.0, 1.0, -1.0, -1.0]
    assert C.by_group(torch.tensor([]), C.group_index([])).shape == (0, 0)  # a rank with no task

# ---------------------------------------------------------------------------------------------- GRPO pieces

def test_clipped_surrogate_by_hand():
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 1.5, 0.5, 0.5]))
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss = C.clipped_surrogate(logp, old, adv, clip_eps=0.2)
    # −min(ρA, clip(ρ)A): ρ=1.5,A=1 → −1.2 | ρ=1.5,A=−1 → 1.5 | ρ=.5,A=1 → −0.5 | ρ=.5,A=−1 → 0.8
    assert loss.tolist() == pytest.approx([-1.2, 1.5, -0.5, 0.8], abs=1e-6)


def test_k3_kl_by_hand_and_clamp():
    kl = C.kl_k3(torch.tensor([-1.0, -2.0, -1.0, -30.0]), torch.tensor([-2.0, -1.0, -1.0, -5.0]))
    r1, r2 = -1.0, 1.0
    assert kl[:3].tolist() == pytest.approx([math.exp(r1) - r1 - 1, math.exp(r2) - r2 - 1, 0.0], abs=1e-6)
    assert kl[3].item() == 10.0  # exp(25) − 26 clamped to +10


def test_k3_kl_gradient_stays_finite_for_huge_log_ratios():
    logp = torch.tensor([-100.0, -1.0], requires_grad=True)  # r = ℓ_ref − ℓ_θ = 99 would overflow exp in float32
    kl = C.kl_k3(logp, torch.tensor([-1.0, -1.5]))
    kl.sum().backward()
    assert torch.isfinite(logp.grad).all() and kl[0].item() == 10.0


def test_grpo_loss_combines_masked_means():
    logp = torch.tensor([[-1.0, -1.0, -1.0]])
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-2.0, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, pg, kl = seed.grpo_loss(logp, old, ref, torch.tensor([[2.0]]), mask, 0.2, beta_kl=0.01)
    assert pg.item() == pytest.approx(-2.0)
    assert kl.item() == pytest.approx((math.exp(-1) + 1 - 1 + 0.0) / 2, abs=1e-6)
    assert loss.item() == pytest.approx(-2.0 + 0.01 * kl.item(), abs=1e-7)


def test_sft_loss_sums_tokens_and_averages_examples():
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert seed.sft_loss(logp, mask, n_examples=2).item() == pytest.approx((3.0 + 0.5) / 2)


# ---------------------------------------------------------------------------------------------- SEED Prop. 2

def expected_opd_loss(z, skill_shift, beta):
    """Eq. (9) as the OPD loss averaged over every candidate token v weighted by π_k(v) = softmax(z) (detached)."""
    logp = torch.log_softmax(z, -1)
    pi = logp.exp().detach()
    loss, gate = seed.opd_loss(logp[None], (logp + skill_shift)[None], pi[None], beta)
    return loss, gate[0], pi


def test_prop2_tied_rewards_rl_gradient_zero_opd_gradient_iff_gate_varies():
    torch.manual_seed(1)
    adv = seed.group_advantages(torch.tensor([[1.0, 1.0, 1.0, 1.0]]), 1e-6)
    assert adv.abs().max().item() == 0.0
    z = torch.randn(6, requires_grad=True)
    logp = torch.log_softmax(z, -1)[None]
    _, pg, _ = seed.grpo_loss(logp, logp.detach(), logp.detach(), adv[:, :1], torch.ones(1, 6), 0.2, 0.0)
    (g_rl,) = torch.autograd.grad(pg, z)
    assert g_rl.abs().max().item() == 0.0

    # constant shift: the gate is the same for every candidate → no OPD gradient (Var = 0)
    loss, gate, pi = expected_opd_loss(z, torch.full((6,), 0.3), beta=5.0)
    (g_const,) = torch.autograd.grad(loss, z)
    assert g_const.abs().max().item() < 1e-7

    # a varying shift: Eq. (10) ∂L/∂z_v = π(v)[Z − w(v)] and Eq. (11) ‖∇‖²_{π⁻¹} = Var_π[w]
    shift = torch.tensor([0.8, -0.4, 0.1, 0.0, -1.0, 0.5])
    loss, gate, pi = expected_opd_loss(z, shift, beta=5.0)
    (g,) = torch.autograd.grad(loss, z)
    w = gate.detach()
    Z = (pi * w).sum()
    assert torch.allclose(g, pi * (Z - w), atol=1e-6)
    var = (pi * (w - Z) ** 2).sum()
    assert ((g ** 2) / pi).sum().item() == pytest.approx(var.item(), rel=1e-5)
    assert var.item() > 1e-3


# ---------------------------------------------------------------------------------------------- scoring

def test_over_long_prompt_keeps_template_head_and_tail():
    tok = models.load_tokenizer("tiny")
    text = "Your task is to: put a mug in the sink.\n" + "Step Observation: nothing happens. " * 300 + "FINAL LINE"
    ids, used = C.encode_prompt(tok, text, 256)
    assert len(C.encode_prompt(tok, text, 10_000)[0]) > 256 and len(ids) <= 256 and used != text
    decoded = tok.decode(ids)
    assert decoded.startswith("<|im_start|>user\nYour task is to: put a mug") and "[...]" in decoded
    assert decoded.endswith("FINAL LINE<|im_end|>\n<|im_start|>assistant\n")
    assert ids == C.chat_ids(tok, used)  # the returned text is exactly what was encoded
    assert C.encode_prompt(tok, "short", 256) == (C.chat_ids(tok, "short"), "short")


def test_left_padded_scoring_matches_unpadded_forward():
    """ℓ(a_ℓ | h, a_<ℓ) from a padded micro-batch equals a lone unpadded forward of the same sequence."""
    model = models.load_model("tiny", 0)
    prompts, responses = [[5, 6, 7, 8, 9], [10, 11]], [[12, 13, 14], [15]]
    logp, mask = C.sequence_logprobs(model, prompts, responses, "cpu")
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    for i, (p, r) in enumerate(zip(prompts, responses)):
        with torch.no_grad():
            lg = model(torch.tensor([p + r])).logits[0, len(p) - 1:-1].float().log_softmax(-1)
        ref = lg.gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
        assert torch.allclose(logp[i, :len(r)], ref, atol=1e-5)



def test_scoring_at_the_sampling_temperature_is_the_tempered_distribution(d):
    """--temperature T ≠ 1: ℓ is log softmax(z / T)[a], the distribution the engine sampled from (verl's actor divides
    the logits by the rollout temperature), in sequence_logprobs, score and a training micro-batch alike; T = 1 is
    the model's own log-probs."""
    model = models.load_model("tiny", 0)
    prompts, responses = [[5, 6, 7, 8, 9], [10, 11]], [[12, 13, 14], [15]]
    for T in (1.0, 0.4):
        logp, _ = C.sequence_logprobs(model, prompts, responses, "cpu", temperature=T)
        scored = C.score(model, prompts, responses, 2, d, temperature=T)  # (d: they agree forward counts over ranks)
        (m,) = list(C.minibatch_chunks(d, prompts, responses, [[0, 1]], temperature=T))
        trained, _ = m.logprobs(model)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            with torch.no_grad():
                z = model(torch.tensor([p + r])).logits[0, len(p) - 1:-1].float()
            want = (z / T).log_softmax(-1).gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
            assert torch.allclose(logp[i, :len(r)], want, atol=1e-5) and torch.allclose(scored[i], want, atol=1e-5)
            assert torch.allclose(trained[i, :len(r)].detach(), want, atol=1e-5)
            if T != 1.0:  # and it is not the model's own: the test would notice a dropped temperature
                assert (want - z.log_softmax(-1).gather(-1, torch.tensor(r)[:, None]).squeeze(-1)).abs().max() > 0.01
    greedy, _ = C.sequence_logprobs(model, prompts, responses, "cpu", temperature=0.0)  # no division by 0: T = 1
    own, _ = C.sequence_logprobs(model, prompts, responses, "cpu")
    assert torch.isfinite(greedy).all() and torch.equal(greedy, own)


def test_scoring_layout_is_as_wide_as_the_longest_sequence_and_counts_its_padding():
    """Right-aligned rows: a long prompt with a short response and a short prompt with a long response pad to
    max(len p + len r) = 8, not max len p + max len r = 11; the log-probs still equal lone unpadded forwards."""
    model = models.load_model("tiny", 0)
    prompts, responses = [[5, 6, 7, 8, 9, 10, 11], [10, 11]], [[12], [15, 16, 17, 18, 19]]
    tally = [0, 0]
    C.count_forward(tally, prompts, responses)  # what score() and MicroBatch.logprobs add for this forward
    logp, mask = C.sequence_logprobs(model, prompts, responses, "cpu")
    assert tally == [15, 16] and mask.tolist() == [[1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    for i, (p, r) in enumerate(zip(prompts, responses)):
        with torch.no_grad():
            lg = model(torch.tensor([p + r])).logits[0, len(p) - 1:-1].float().log_softmax(-1)
        assert torch.allclose(logp[i, :len(r)], lg.gather(-1, torch.tensor(r)[:, None]).squeeze(-1), atol=1e-5)


def test_minibatch_chunks_by_hand(d):
    """The iterator every update loop uses: its chunks in order (the main source's kind is "", a further source
    keeps its own), scale = world size; rows / column gather per-sample values (right-padded with 0); a dummy, as a
    rank with fewer chunks gets it, has no samples, scale 0, the 2-token DUMMY sequence and one `dummy` value.
    global_sums gives every value back under its name."""
    P, R = [[1, 2], [3], [4, 5, 6]], [[7], [8, 9], [10]]
    got = list(C.minibatch_chunks(d, P, R, [[1], [0, 2]], ("ref", [[11]], [[12, 13]], [[0]])))
    assert [(m.kind, m.idx, m.scale, m.real) for m in got] == [("", [1], 1.0, True), ("", [0, 2], 1.0, True),
                                                                ("ref", [0], 1.0, True)]
    assert got[1].prompts == [[1, 2], [4, 5, 6]] and got[1].responses == [[7], [10]]
    assert got[2].prompts == [[11]] and got[2].responses == [[12, 13]]
    adv = [torch.tensor([1.0]), torch.tensor([2.0, 3.0]), torch.tensor([4.0])]
    assert got[0].rows(adv).tolist() == [[2.0, 3.0]] and got[1].rows(adv).tolist() == [[1.0], [4.0]]
    assert got[1].column([0.5, 0.25, 0.125]).tolist() == [[0.5], [0.125]]
    teacher = [torch.tensor([-1.0]), None, torch.tensor([-2.0])]  # sample 1 has no teacher: zeros, has = 0
    assert got[0].rows(teacher).tolist() == [[0.0, 0.0]] and got[0].has(teacher).tolist() == [[0.0]]
    assert got[1].rows(teacher).tolist() == [[-1.0], [-2.0]] and got[1].has(teacher).tolist() == [[1.0], [1.0]]
    dummy = C.MicroBatch("", [], [C.DUMMY[0]], [C.DUMMY[1]], 0.0, torch.device("cpu"), [0, 0])
    assert not dummy.real and dummy.rows(adv, dummy=1.0).tolist() == [[1.0]] and dummy.column(adv).tolist() == [[0.0]]
    assert dummy.has(teacher).tolist() == [[0.0]]
    assert C.global_sums({"a": 1.5, "b": 2.0}, d) == {"a": 1.5 * d.world, "b": 2.0 * d.world}


def test_length_aware_micro_batches_by_hand():
    """Longest first; a micro-batch grows while rows × its width (its first, longest prompt + response: the
    right-aligned layout) ≤ the budget and it has ≤ rows rows. Lengths (p, r): 0 (5, 1) = 6, 1 (3, 4) = 7, 2 (8, 2)
    = 10, 3 (2, 1) = 3. Budget 20: [2] + 1 → 2 × 10 = 20, + 0 → 30 > 20; [0] + 3 → 2 × 6 = 12. Budget 19: [2] alone
    (2 × 10 > 19), [1] + 0 → 14, + 3 → 21 > 19: [3]. 0 = fixed chunks of `rows` in the given order."""
    P, R = [[0] * 5, [0] * 3, [0] * 8, [0] * 2], [[0], [0] * 4, [0] * 2, [0]]
    assert C.micro_batches([0, 1, 2, 3], P, R, rows=3, max_tokens=20) == [[2, 1], [0, 3]]
    assert C.micro_batches([0, 1, 2, 3], P, R, rows=3, max_tokens=19) == [[2], [1, 0], [3]]
    for mb in C.micro_batches([0, 1, 2, 3], P, R, rows=3, max_tokens=20):  # the width sequence_logprobs computes
        assert len(mb) * max(len(P[i]) + len(R[i]) for i in mb) <= 20
    assert C.micro_batches([0, 1, 2, 3], P, R, rows=1, max_tokens=100) == [[2], [1], [0], [3]]
    assert C.micro_batches([0, 1, 2, 3], P, R, rows=4, max_tokens=100) == [[2, 1, 0, 3]]
    assert C.micro_batches([3, 0, 1, 2], P, R, rows=3, max_tokens=0) == [[3, 0, 1], [2]]
    assert C.micro_batches([0, 2], P, R, rows=3, max_tokens=5) == [[2], [0]]  # over the budget: alone


# ---------------------------------------------------------------------------------------------- OPID §3.4

def test_opid_episode_advantages_by_hand_no_epsilon_and_ties_zero():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0], [0.9, 0.9, 0.9, 0.9], [0.0, 0.0, 0.0, 0.0]])
    a = opid.episode_advantages(r)
    assert a[0].tolist() == [1.0, -1.0, -1.0, 1.0]  # μ = 0.5, σ = 0.5 (population std), no ε: exactly ±1
    s = math.sqrt(0.1875)  # μ = 0.25, σ² = (0.75² + 3·0.25²)/4
    assert a[1].tolist() == pytest.approx([0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s], abs=1e-6)
    assert a[1, 0].item() == pytest.approx(math.sqrt(3), abs=1e-6)  # the bound sqrt(N − 1) is reached
    assert a[2].tolist() == [0.0] * 4 and a[3].tolist() == [0.0] * 4  # σ = 0: exactly 0, not NaN


def test_opid_token_advantages_by_hand():
    a_ep = torch.tensor([1.0, -0.5, 2.0])
    old = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0], [-1.0, -1.0, -1.0]])
    skill = torch.tensor([[-0.5, -2.5, -1.0], [-1.0, -0.25, 0.0], [-7.0, 0.0, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])  # row 1: one padded token
    has = torch.tensor([[1.0], [1.0], [0.0]])                                 # row 2: no routed skill
    a, a_e, a_s = opid.opid_advantages(a_ep, old, skill, mask, has, lambda_skill=0.1)
    assert a_s.tolist() == [[0.5, -0.5, 2.0], [-0.5, 0.25, 0.0], [0.0, 0.0, 0.0]]
    assert a_e.tolist() == [[1.0, 1.0, 1.0], [-0.5, -0.5, 0.0], [2.0, 2.0, 2.0]]
    assert torch.allclose(a, torch.tensor([[1.05, 0.95, 1.2], [-0.55, -0.475, 0.0], [2.0, 2.0, 2.0]]), atol=1e-6)
    a0, _, _ = opid.opid_advantages(a_ep, old, skill, mask, has, lambda_skill=0.0)
    assert torch.equal(a0, a_e)  # λ_skill = 0: the GRPO advantage, bit for bit


def test_opid_clips_the_combined_advantage():
    """§3.4 / A.1: PPO clipping acts on A_ep + λA_skill, which is not the sum of separately clipped terms."""
    old = torch.tensor([[0.0]])
    logp = old + math.log(1.5)  # ρ = 1.5, outside [0.8, 1.2]
    combined = torch.tensor([[1.0 - 0.5]])  # A_ep = 1, λA_skill = −0.5
    loss, pg, kl = opid.opid_loss(logp, old, logp, combined, torch.ones(1, 1), 0.2, 0.01)
    assert pg.item() == pytest.approx(-min(1.5 * 0.5, 1.2 * 0.5))  # −0.6
    separate = -min(1.5 * 1, 1.2 * 1) - min(1.5 * -0.5, 1.2 * -0.5)  # −1.2 + 0.75 = −0.45
    assert abs(pg.item() - separate) > 0.1
    assert kl.item() == 0.0 and loss.item() == pytest.approx(pg.item())


# ---------------------------------------------------------------------------------------------- OPID App. A

def exact_case(seed_=0, contexts=4, vocab=6):
    """Free categorical logits per context: behaviour b = softmax(z_old), skill teacher q = softmax(z_q)."""
    g = torch.Generator().manual_seed(seed_)
    z_old, z_q = torch.randn(contexts, vocab, generator=g), torch.randn(contexts, vocab, generator=g)
    return z_old, z_q, torch.randn(contexts, vocab, generator=g)


def skill_loss_via_code(z, z_old, z_q, lam, clip_eps):
    """The implemented loss with A_ep = 0 (a tied group), its expectation over i ~ ν_b (uniform over contexts) and
    a ~ b_i taken EXACTLY: every vocabulary entry is a 'token' weighted by b_i(a)/K in the masked mean."""
    old, skill, logp = (torch.log_softmax(x, -1) for x in (z_old, z_q, z))
    K = z.shape[0]
    adv, _, _ = opid.opid_advantages(torch.zeros(K), old, skill, torch.ones_like(old), torch.ones(K, 1), lam)
    weights = old.exp() / K
    _, pg, _ = opid.opid_loss(logp, old, old, adv, weights, clip_eps, 0.0, denom=1.0)
    return pg


def kl_rows(p_logits, q_logits):
    lp, lq = torch.log_softmax(p_logits, -1), torch.log_softmax(q_logits, -1)
    return (lp.exp() * (lp - lq)).sum(-1).mean()


@pytest.mark.parametrize("lam", [0.001, 0.5])
def test_prop1_unclipped_skill_loss_is_lambda_times_rkl_minus_behaviour_kl(lam):
    """Eq. (4): L_skill^unclip(θ) = λ[L_RKL(θ) − D_b(θ)] at any θ, value and gradient."""
    z_old, z_q, z_other = exact_case(1)
    z = (z_old + 0.7 * z_other).requires_grad_(True)  # θ ≠ θ_old
    loss = skill_loss_via_code(z, z_old, z_q, lam, clip_eps=1e9)  # clip range that never binds: unclipped
    want = lam * (kl_rows(z, z_q) - kl_rows(z, z_old))
    assert loss.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
    (g,), (g_want,) = torch.autograd.grad(loss, z), torch.autograd.grad(want, z)
    assert torch.allclose(g, g_want, atol=1e-6) and g.abs().max() > 1e-4 * lam


def test_prop1_at_theta_old_clipped_loss_value_and_gradient_are_lambda_rkl():
    """Eq. (5)-(7): at θ = θ_old the implemented (clipped) loss has value λ·L_RKL and gradient λ·∇L_RKL =
    −λ E[Δ ∇log p]: the clip interval contains ρ = 1."""
    lam = 0.3
    z_old, z_q, _ = exact_case(2)
    z = z_old.clone().requires_grad_(True)
    loss = skill_loss_via_code(z, z_old, z_q, lam, clip_eps=0.2)
    rkl = kl_rows(z, z_q)
    assert loss.item() == pytest.approx(lam * rkl.item(), rel=1e-5)
    (g,), (g_rkl,) = torch.autograd.grad(loss, z), torch.autograd.grad(rkl, z)
    assert torch.allclose(g, lam * g_rkl, atol=1e-6)
    # Eq. (7): −λ Σ_i (1/K) Σ_a b(a) Δ(a) ∇_z log p(a), assembled per token
    b, delta = torch.softmax(z_old, -1), torch.log_softmax(z_q, -1) - torch.log_softmax(z_old, -1)
    K, V = z_old.shape
    eq7 = torch.zeros_like(z_old)
    for i in range(K):
        for a in range(V):
            (ga,) = torch.autograd.grad(torch.log_softmax(z, -1)[i, a], z)
            eq7 -= lam * b[i, a] * delta[i, a] * ga / K
    assert torch.allclose(g, eq7, atol=1e-6) and g.abs().max() > 1e-3


def test_corollary2_matching_behaviour_kl_recovers_reverse_kl_exactly():
    """Eq. (9)-(10) with β = λ: L_skill^unclip + β·D_b = λ·L_RKL for every θ (value and gradient); β ≠ λ leaves
    (β − λ)·D_b."""
    lam = 0.25
    z_old, z_q, z_other = exact_case(3)
    z = (z_old - 1.3 * z_other).requires_grad_(True)
    unclip = skill_loss_via_code(z, z_old, z_q, lam, clip_eps=1e9)
    aux, rkl, d_b = unclip + lam * kl_rows(z, z_old), kl_rows(z, z_q), kl_rows(z, z_old)
    assert aux.item() == pytest.approx(lam * rkl.item(), rel=1e-5)
    (g,), (g_rkl,) = torch.autograd.grad(aux, z, retain_graph=True), torch.autograd.grad(rkl, z, retain_graph=True)
    assert torch.allclose(g, lam * g_rkl, atol=1e-6)
    beta = 0.05
    assert (unclip + beta * d_b).item() == pytest.approx((lam * rkl + (beta - lam) * d_b).item(), rel=1e-5)
    assert abs((beta - lam) * d_b.item()) > 1e-3  # the residual is real when β ≠ λ


def full_action_gradient(z_old, z_q, lam):
    """Corollary 3: one context, ∂/∂z of −λ Σ_v p(v)Δ(v) at p = b, through the implemented loss."""
    z = z_old.clone().requires_grad_(True)
    loss = skill_loss_via_code(z[None], z_old[None], z_q[None], lam, clip_eps=1e9)
    (g,) = torch.autograd.grad(loss, z)
    return g


def test_corollary3_full_action_gradient_vanishes_iff_teacher_equals_behaviour():
    lam = 0.7
    z_old, z_q, _ = exact_case(4, contexts=1, vocab=7)
    z_old, z_q = z_old[0], z_q[0]
    g = full_action_gradient(z_old, z_q, lam)
    p = torch.softmax(z_old, -1)
    delta = torch.log_softmax(z_q, -1) - torch.log_softmax(z_old, -1)
    assert torch.allclose(g, -lam * p * (delta - (p * delta).sum()), atol=1e-6)  # Eq. (11)
    assert g.abs().max() > 1e-3                                                 # q ≠ b: a real signal at a tie
    assert full_action_gradient(z_old, z_old.clone(), lam).abs().max() == 0.0   # q = b
    assert full_action_gradient(z_old, z_old + 2.5, lam).abs().max() < 1e-6     # same q, shifted logits


# ---------------------------------------------------------------------------------------------- GRSD Eq. (1), (9)-(11)

def test_grsd_norm_g_by_hand_valid_subset_and_ties():
    a = grsd.norm_g(torch.tensor([1.0, 0.0, 0.0, 1.0]), eps_adv=1e-6)
    x = 0.5 / math.sqrt(0.25 + 1e-6)  # v̄ = 0.5, population variance 0.25
    assert a.tolist() == pytest.approx([x, -x, -x, x], abs=1e-6)
    # Alg. 1 l.11: statistics over the valid entries only (scores 3, 1, 2 → mean 2, var 2/3); invalid → 0
    r = grsd.norm_g(torch.tensor([3.0, 0.0, 1.0, 2.0]), 1e-6, valid=torch.tensor([True, False, True, True]))
    sd = math.sqrt(2 / 3 + 1e-6)
    assert r.tolist() == pytest.approx([1 / sd, 0.0, -1 / sd, 0.0], abs=1e-6)
    assert grsd.norm_g(torch.tensor([0.9] * 8), 1e-6).tolist() == [0.0] * 8  # a tie is exactly 0
    assert grsd.norm_g(torch.tensor([2.0, 1.0]), 1e-6, valid=torch.tensor([True, False])).tolist() == [0.0, 0.0]


def test_grsd_turn_modulation_by_hand():
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 0.7, -0.7])
    delta = torch.tensor([0.02, -0.01, 0.5, -0.03, 0.4, -0.2])
    group = torch.tensor([0, 0, 0, 0, 1, 1])
    mixed = torch.tensor([True, False])  # group 1 is single-outcome: Â = A exactly
    a_hat, q_hat = grsd.turn_modulation(adv, delta, group, mixed, lam=0.5, g_hat=0.2, eps_gap=1e-6)
    q = [0.02, -0.01, -0.5, 0.03]                       # sign(A)·Δ
    u = [math.expm1(x) for x in q]
    d_x = sum(abs(x) for x in u) / 4 + 1e-6
    qh = [max(-0.2, min(0.2, x / d_x)) for x in u]
    assert qh[0] == pytest.approx(0.0202013 / 0.1135188, abs=1e-4) and qh[2] == -0.2  # unclipped; clipped
    want = [a * (1 + 0.5 * x) for a, x in zip([1.0, 1.0, -1.0, -1.0], qh)]
    assert a_hat[:4].tolist() == pytest.approx(want, abs=1e-6)
    assert q_hat[:4].tolist() == pytest.approx(qh, abs=1e-6)
    assert torch.equal(a_hat[4:], adv[4:]) and q_hat[4:].tolist() == [0.0, 0.0]


def test_grsd_modulated_advantages_on_turn_tensors_by_hand():
    """The estimator on [T] / [T, R] tensors (verl's shape): turns 0-1 of group 0 carry a guided teacher (Δ = 0.3 and
    −0.1 by token means); turn 2 (group 1, no guidance) keeps A. Ĝ = 1 leaves turn 1 unclipped; padding stays 0."""
    adv = torch.tensor([1.0, 1.0, -0.5])
    diff = torch.tensor([[0.2, 0.4, 0.0], [-0.1, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    group, traj, has = torch.tensor([0, 0, 1]), torch.tensor([0, 0, 1]), torch.tensor([True, True, False])
    u = [math.expm1(0.3), math.expm1(-0.1)]                             # Eq. (10), sign(A) = +1
    d_x = (abs(u[0]) + abs(u[1])) / 2 + 1e-6
    a1 = 1.0 * (1 + 0.5 * max(-1.0, min(1.0, u[1] / d_x)))               # Eq. (11): q̂ = u / D_x = −0.4277
    a_hat = grsd.modulated_advantages(adv, diff, mask, group, traj, has, "turn", 0.5, 1.0, 1e-6)
    assert a_hat.flatten().tolist() == pytest.approx([1.5, 1.5, 0.0, a1, 0.0, 0.0, -0.5, -0.5, -0.5], abs=1e-6)
    # one Δ per trajectory: (0.2 + 0.4 − 0.1) / 3 over its 3 tokens, alone in its group: q̂ = u / (|u| + ε) ≈ 1
    a_traj = grsd.modulated_advantages(adv, diff, mask, group, traj, has, "trajectory", 0.5, 1.0, 1e-6)
    u = math.expm1(0.5 / 3)
    a0 = 1 + 0.5 * u / (u + 1e-6)
    assert a_traj.flatten().tolist() == pytest.approx([a0, a0, 0.0, a0, 0.0, 0.0, -0.5, -0.5, -0.5], abs=1e-6)
    assert torch.equal(grsd.modulated_advantages(adv, diff, mask, group, traj, has, "turn", 0.0, 1.0, 1e-6),
                       adv[:, None] * mask)                                   # λ = 0: Â = A bit for bit


def test_grsd_turn_modulation_is_finite_for_huge_gaps():
    adv, delta = torch.tensor([1.0, -1.0, 1.0]), torch.tensor([500.0, -500.0, -3.0])
    a_hat, q_hat = grsd.turn_modulation(adv, delta, torch.zeros(3, dtype=torch.long), torch.tensor([True]),
                                        0.5, 0.2, 1e-6)
    assert torch.isfinite(a_hat).all() and a_hat.tolist() == pytest.approx([1.1, -1.1, 1.0 * (1 + 0.5 * q_hat[2].item())])


def test_grsd_prop2_bounded_sign_preserving_modulation_on_random_inputs():
    """Prop. 2 (Eq. 31-33): w ∈ [1−δ, 1+δ], |Â − A| ≤ δ|A|, sign(Â) = sign(A) for A ≠ 0; and sign(q̂) = sign(q)."""
    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        n, n_groups = int(torch.randint(1, 40, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        adv = torch.randn(n, generator=g) * 2
        adv[torch.rand(n, generator=g) < 0.1] = 0.0
        delta = torch.randn(n, generator=g) * float(torch.rand(1, generator=g) * 5)
        group = torch.randint(0, n_groups, (n,), generator=g)
        mixed = torch.rand(n_groups, generator=g) < 0.7
        g_hat = float(torch.rand(1, generator=g)) * 0.5 + 0.01
        lam = float(torch.rand(1, generator=g)) * 0.999 / g_hat
        delta_bound = lam * g_hat
        a_hat, q_hat = grsd.turn_modulation(adv, delta, group, mixed, lam, g_hat, 1e-6)
        nz = adv != 0
        w = a_hat[nz].double() / adv[nz].double()
        assert (w >= 1 - delta_bound - 1e-5).all() and (w <= 1 + delta_bound + 1e-5).all(), trial
        assert ((a_hat - adv).abs() <= delta_bound * adv.abs() + 1e-5).all()
        assert torch.equal(torch.sign(a_hat[nz]), torch.sign(adv[nz])) and (a_hat[~nz] == 0).all()
        q = torch.sign(adv) * delta
        on = mixed[group] & (q_hat != 0)
        assert torch.equal(torch.sign(q_hat[on]), torch.sign(q[on]))
        assert (q_hat[~mixed[group]] == 0).all()


def test_grsd_prop3_positive_reweighting_of_the_clipped_surrogate():
    """Eq. (38): φ_ε(ρ, wA) = w φ_ε(ρ, A) for w ≥ 0; Eq. (42): each token's GRSD gradient is w times GRPO's."""
    torch.manual_seed(3)
    z = torch.randn(6, 5, requires_grad=True)          # 6 tokens, vocabulary 5
    tokens = torch.randint(0, 5, (6,))
    old = (torch.log_softmax(z, -1).gather(-1, tokens[:, None]).squeeze(-1) + torch.randn(6) * 0.4).detach()
    adv = torch.tensor([1.0, 1.0, -0.5, -0.5, 2.0, 0.0])
    w = torch.tensor([1.1, 0.9, 1.0, 0.95, 1.05, 1.2])
    logp = torch.log_softmax(z, -1).gather(-1, tokens[:, None]).squeeze(-1)
    phi_w, phi = -C.clipped_surrogate(logp, old, w * adv, 0.2), -C.clipped_surrogate(logp, old, adv, 0.2)
    assert torch.allclose(phi_w, w * phi, atol=1e-7)
    ratio = torch.exp(logp - old)
    assert ((ratio < 0.8) | (ratio > 1.2)).any() and ((ratio > 0.8) & (ratio < 1.2)).any()  # both regimes present
    for k in range(6):
        (g_grsd,) = torch.autograd.grad(phi_w[k], z, retain_graph=True)
        (g_grpo,) = torch.autograd.grad(phi[k], z, retain_graph=True)
        assert torch.allclose(g_grsd, w[k] * g_grpo, atol=1e-7)


def test_grsd_aggregation_is_per_trajectory_mean_not_token_mean():
    """Eq. (2)/(13): (1/G) Σ_i (1/N_i) Σ_{t,k}. Trajectory a: one turn of 2 tokens, A = 1; trajectory b: turns of 3
    and 1 tokens, A = −0.5. At ρ = 1 the paper's loss is −(1 − 0.5)/2 = −0.25; a token mean would give 0."""
    logp = torch.zeros(3, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([[1.0], [-0.5], [-0.5]])
    weight = torch.tensor([[1 / 2], [1 / 4], [1 / 4]])  # 1/N_i
    denom = (mask * weight).sum().item()                # = 2 trajectories
    assert denom == pytest.approx(2.0)
    full = grsd.grpo_surrogate(logp, logp, adv, mask, weight, 0.2, denom)
    assert full.item() == pytest.approx(-0.25)
    assert C.masked_mean(C.clipped_surrogate(logp, logp, adv, 0.2), mask).item() == pytest.approx(0.0)
    parts = sum(grsd.grpo_surrogate(logp[i:i + 1], logp[i:i + 1], adv[i:i + 1], mask[i:i + 1], weight[i:i + 1], 0.2,
                                    denom) for i in range(3))  # micro-batches of one turn, the whole batch's denom
    assert parts.item() == pytest.approx(-0.25)
    loss, pg, kl = grsd.grsd_task_loss(logp, logp, logp - 1.0, adv, mask, weight, 0.2, 0.01, denom)
    k3 = math.exp(-1.0) + 1.0 - 1                        # r = ℓ_ref − ℓ_θ = −1: e^r − r − 1
    assert kl.item() == pytest.approx(k3) and loss.item() == pytest.approx(-0.25 + 0.01 * k3)


# ---------------------------------------------------------------------------------------------- --rollout_is

def test_rollout_is_weights_by_hand():
    old = [torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-0.1])]
    eng = [[-1.2, -1.0, -3.0], None]  # ℓ_old − ℓ_engine = [0.2, −1.0, 2.5]; the second sample has no engine log-probs
    tok = C.rollout_is_weights(old, eng, "token", cap=2.0)
    assert tok[0].tolist() == pytest.approx([math.exp(0.2), math.exp(-1.0), 2.0], abs=1e-6)  # e^2.5 truncated at C
    assert tok[1].tolist() == [1.0]
    seq = C.rollout_is_weights(old, eng, "sequence", cap=2.0)
    assert seq[0].tolist() == [2.0] * 3  # e^(0.2 − 1 + 2.5) = e^1.7 = 5.47, truncated at C = 2
    seq5 = C.rollout_is_weights(old, eng, "sequence", cap=10.0)
    assert seq5[0].tolist() == pytest.approx([math.exp(1.7)] * 3, abs=1e-5)  # one weight per response: e^Σ
    assert all(w.tolist() == [1.0] * len(o) for w, o in zip(C.rollout_is_weights(old, eng, "none", 2.0), old))
    huge = C.rollout_is_weights([torch.tensor([0.0])], [[-1e4]], "token", cap=2.0)
    assert huge[0].tolist() == [2.0]  # never inf


def test_rollout_is_weight_scales_the_clipped_surrogate_and_its_gradient():
    """The methods pass A·w as the advantage: −min(ρ·wA, clip(ρ)·wA) = w·(−min(ρA, clip(ρ)A)), value and
    gradient, for ratios inside and outside the clip range and both signs of A."""
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    w = torch.tensor([[0.5, 1.7, 2.0, 0.3]])
    x1 = torch.tensor([[-0.9, -1.5, -0.6, -1.05]], requires_grad=True)  # ρ = e^0.1, e^−0.5, e^0.4, e^−0.05
    x2 = x1.detach().clone().requires_grad_(True)
    weighted = C.clipped_surrogate(x1, old, adv * w, 0.2)
    plain = C.clipped_surrogate(x2, old, adv, 0.2)
    assert weighted[0].tolist() == pytest.approx((w * plain)[0].tolist(), abs=1e-6)
    weighted.sum().backward()
    (w * plain).sum().backward()
    assert x1.grad[0].tolist() == pytest.approx(x2.grad[0].tolist(), abs=1e-6)
    assert x1.grad[0, 0].item() == pytest.approx(-0.5 * math.exp(0.1), abs=1e-6)  # −w·A·ρ inside the clip range
    assert x1.grad[0, 2].item() == 0.0  # ρ = e^0.4 > 1 + ε with A > 0: clipped, no gradient, weight or not


def test_rollout_mismatch_sums_by_hand():
    old = [torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-0.1]), torch.tensor([-3.0, -3.0])]
    eng = [[-1.0, -2.05, -0.7], None, [-3.2, -2.95]]  # diffs 0, 0.05, 0.2 | none | 0.2, −0.05
    n, total, off, top = C.mismatch_sums(old, eng)
    assert (n, off) == (5, 2)  # |e^0.2 − 1| = 0.221 > 0.1; |e^±0.05 − 1| ≤ 0.052
    assert total == pytest.approx(0.5, abs=1e-6) and top == pytest.approx(0.2, abs=1e-6)
    assert C.mismatch_sums(old[1:2], [None]) == (0, 0.0, 0, 0.0)  # the HF engine: nothing to report
