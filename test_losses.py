"""The equations, checked numerically: hand-computed values, autograd against the stated gradients, and the
papers' propositions on small exact categorical cases."""
import math

import pytest
import torch

import common as C
import seed


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
    tok = C.load_tokenizer("tiny")
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
    model = C.load_model("tiny", 0)
    prompts, responses = [[5, 6, 7, 8, 9], [10, 11]], [[12, 13, 14], [15]]
    logp, mask = C.sequence_logprobs(model, prompts, responses, "cpu")
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    for i, (p, r) in enumerate(zip(prompts, responses)):
        with torch.no_grad():
            lg = model(torch.tensor([p + r])).logits[0, len(p) - 1:-1].float().log_softmax(-1)
        ref = lg.gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
        assert torch.allclose(logp[i, :len(r)], ref, atol=1e-5)
