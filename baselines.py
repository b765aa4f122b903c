"""The Table 1 baselines that run on SEED's machinery, as `python seed.py FLAGS` (recipes: docs/baselines.md).

Sources: SEED App. B.2, OPID App. B.2, GRSD §4.1; where they are short, the official SDAR code (ZJU-REAL/SDAR, a
verl-agent fork that implements OPSD, GRPO+OPSD, Skill-SD, RLSD and SDAR). seed.py's main() calls baseline_update
instead of seed.seed_update when --teacher_params old; everything else (rollout, samples, checkpoints) is seed.py's.

ℓ_T is the log-prob of the sampled token with a retrieved library skill in the context (--skill_source library),
ℓ_old that of θ_old, sg a stop-gradient:
  Vanilla      the backbone, no training (--eval_only).
  Skill-Prompt* Vanilla with the retrieved skill in the agent's context at evaluation (--eval_only --eval_with_skills).
  GRPO         L_rl only (--skip_sft --lambda_opd 0).
  Skill-GRPO   GRPO with the retrieved skill in the policy's own context in rollouts and updates, evaluated
               without it (--train_with_skills); Skill-GRPO* evaluates that run's weights with it (--eval_with_skills).
  OPSD         no RL term: λ · token-mean[σ(β sg Δ)(sg ℓ_T − ℓ_θ)] + β_KL KL, λ 0.01, β 5 (--pg_coef 0). The SDAR
               code's variant (examples/opsd_trainer: "SDAR without GRPO loss"), not Zhao et al.'s full-vocabulary
               JSD, whose numbers the tables do not report.
  GRPO+OPSD    L_rl + λ · token-mean[0.5 (sg ℓ_T − ℓ_θ)]: the SDAR code runs SDAR with gate β = 0 (--beta_opd 0);
               its gradient is that of L_rl − 0.5 λ mean ℓ_θ, whatever the teacher says.
  Skill-SD     L_rl + 0.001 · token-mean[ρ · k3], e = ℓ_θ − sg ℓ_T, k3 = exp(−e) − 1 + e (−e ≤ 20 in the exp),
               ρ = exp(min(ℓ_θ − ℓ_old, 10)) with gradient through ρ and k3 (SDAR code compute_sdl_loss; --distill sdl).
  RLSD         no distillation loss: Â_t = A((1 − λ_t) + λ_t w_t), w_t = clip(exp(sign(A)(ℓ_T − ℓ_old)), 1 ± 0.2),
               λ_t = 0.5 (1 − t/100) for update t = 1, 2, … then 0 (SDAR code compute_rlsd_token_advantage,
               examples/rlsd_trainer; --rlsd_lambda 0.5).
  SDAR         L_rl + λ · token-mean[σ(β sg Δ)(sg ℓ_T − ℓ_θ)], λ 0.01, β 5: Eq. (1) with a static skill library, no
               stage 1, the teacher scored once per update with θ_old (--teacher_params old).
  Every skill baseline's teacher is θ_old with a library skill, scored once per update before the mini-batches, as
  in the SDAR code (RLSDRayTrainer._compute_teacher_log_probs); SEED's teacher is the current θ (Alg. 1 l.22).
  Vanilla, Skill-Prompt*, GRPO and Skill-GRPO have no teacher: they run seed.seed_update (λ_opd = 0).

Deviations / choices:
  * The SDAR code also adds an entropy bonus (0.001) and a dual clip (c = 3) to every baseline's RL term (verl
    defaults); none of our three papers states them and this file has neither.
  * SDAR prepends the raw skill text; H here puts it under a one-line header (seed.LIBRARY_HEADER) before the agent
    prompt, as for SEED's own skills.
"""
from __future__ import annotations

import json
import math
import os
import random

import torch

import common as C
import harness
import seed as S  # SEED's equations (grpo_loss, opd_loss), samples and skill context; used at call time


# ------------------------------------------------------------------------------------------------------------------
# The baselines' own equations
# ------------------------------------------------------------------------------------------------------------------


def sdl_loss(logp, old_logp, teacher_logp, mask, denom=None):
    """Skill-SD (SDAR code, skillsd_utils.compute_sdl_loss): L_sdl = token-mean[ρ · k3] with e = ℓ_θ − sg ℓ_T,
    k3 = exp(min(−e, 20)) − 1 + e (the k3 estimate of KL(π_θ ‖ π_T) on the sampled token) and
    ρ = exp(min(ℓ_θ − sg ℓ_old, 10)); the gradient flows through ρ and k3 alike."""
    e = logp - teacher_logp.detach()
    k3 = torch.exp((-e).clamp(max=20.0)) - 1.0 + e
    rho = torch.exp((logp - old_logp.detach()).clamp(max=10.0))
    return C.masked_mean(rho * k3, mask, denom)


def rlsd_lambda_at(update: int, lam0: float, warmdown: int) -> float:
    """RLSD's schedule (SDAR code, RLSDRayTrainer._get_rlsd_lambda): λ_t = λ_0 (1 − t/W) for t < W, else 0, with
    t = update + 1 (verl counts global steps from 1)."""
    t = update + 1
    return lam0 * (1.0 - t / warmdown) if t < warmdown else 0.0


def rlsd_advantages(adv: float, old_lp: torch.Tensor, teacher_lp: torch.Tensor | None, lam: float,
                    clip_w: float) -> torch.Tensor:
    """RLSD (SDAR code, compute_rlsd_token_advantage): Â_t = A((1 − λ_t) + λ_t w_t), w_t = clip(exp(sign(A) Δ_t),
    1 − ε_w, 1 + ε_w), Δ_t = ℓ_T − ℓ_old (teacher and student both θ_old, so no gradient). The sign of A is kept
    and |Â_t / A − 1| ≤ λ_t ε_w. A turn without a teacher keeps Â_t = A."""
    if teacher_lp is None:
        return torch.full_like(old_lp, adv)
    w = torch.exp(math.copysign(1.0, adv) * (adv != 0) * (teacher_lp - old_lp)).clamp(1 - clip_w, 1 + clip_w)
    return adv * ((1 - lam) + lam * w)



# ------------------------------------------------------------------------------------------------------------------
# The skill library (--skill_source library): SDAR's SkillProvider, by task family
# ------------------------------------------------------------------------------------------------------------------


def load_library(path: str) -> list[dict]:
    """--skill_library: one JSON object per line with a non-empty "skill" text and an optional "family"."""
    if not os.path.isfile(path):
        raise SystemExit(f"--skill_library {path}: no such file (skills/alfworld.jsonl, skills/search.jsonl, or a "
                         f"SEED run's stage1/skills.jsonl)")
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SystemExit(f"--skill_library {path}: not UTF-8 at byte {e.start}") from None
    lib = []
    for n, line in enumerate(text.split("\n"), 1):  # (splitlines would also split at U+2028 inside a string)
        if not line.strip():
            continue
        try:
            x = json.loads(line)
            assert isinstance(x, dict) and isinstance(x.get("skill"), str) and x["skill"].strip()
        except (ValueError, AssertionError):
            raise SystemExit(f"--skill_library {path}, line {n}: expected {{\"skill\": text, \"family\": ...}}")
        lib.append(x)
    return lib


def retrieve_skill(lib: list[dict], family: str) -> str | None:
    """The task's library skill (SDAR's SkillProvider, by task type): every general record (no "family"), then the
    family's own (successful first when the records say "won"), one per line; None if the library has none."""
    general = [x["skill"] for x in lib if not x.get("family")]
    own = sorted((x for x in lib if x.get("family") == family), key=lambda x: not x.get("won", True))
    return "\n".join(general + [x["skill"] for x in own]) or None


def library_context(lib: list[dict], tok, args):
    """Skill-GRPO / Skill-Prompt*: the policy's own prompt is H(h, retrieved skill), for collect(context=...)."""
    def context(env) -> str:
        skill = retrieve_skill(lib, env.family)
        return S.inject_skill(env.prompt(), S.cut_skill(tok, skill, args.skill_max_tokens), S.LIBRARY_HEADER) if skill \
            else env.prompt()
    return context



# ------------------------------------------------------------------------------------------------------------------
# One update of a baseline: the teacher is θ_old with a library skill, scored once before the mini-batches
# ------------------------------------------------------------------------------------------------------------------


def baseline_update(policy, ref, opt, samples: list, args, d, timer, update: int = 0) -> dict:
    """SDAR, OPSD (--pg_coef 0), GRPO+OPSD (--beta_opd 0), Skill-SD (--distill sdl), RLSD (--rlsd_lambda): ℓ_old,
    ℓ_ref and the teacher ℓ_T at θ_old (RLSDRayTrainer._compute_teacher_log_probs), RLSD's token advantages, then one
    epoch of mini-batches of pg_coef · L_clip + β_KL KL + λ · (Eq. 1, or L_sdl)."""
    P, R = [s.prompt_ids for s in samples], [s.response_ids for s in samples]
    with timer("scoring"):
        # ℓ_old: θ before the update
        old = C.score(policy, P, R, args.micro_batch, d.device, args.micro_batch_tokens, args.temperature)
        # π_ref, for L_rl's KL
        ref_lp = C.score(ref, P, R, args.micro_batch, d.device, args.micro_batch_tokens, args.temperature)
        teacher = S.teacher_scores(policy, samples, range(len(samples)), R, args, d)      # ℓ_T at θ_old, then fixed
    engine_lp = [s.engine_logp for s in samples]
    is_w = C.rollout_is_weights(old, engine_lp, args.rollout_is, args.rollout_is_cap)  # all 1 unless --rollout_is
    lam_t = rlsd_lambda_at(update, args.rlsd_lambda, args.rlsd_warmdown) if args.rlsd_lambda > 0 else 0.0
    adv_tok = [rlsd_advantages(s.adv, old[i], teacher[i], lam_t, args.rlsd_clip) for i, s in enumerate(samples)] \
        if args.rlsd_lambda > 0 else [torch.full_like(old[i], s.adv) for i, s in enumerate(samples)]  # RLSD, or A
    order = list(range(len(samples)))
    random.shuffle(order)  # `random` is seeded per rank in init_distributed
    n_mb = C.n_minibatches(len(order), args.minibatch_turns, d)
    # summed on the device, read back once (C.global_sums)
    sums = dict(pg=0.0, kl=0.0, opd=0.0, gate=0.0, gate_sq=0.0, delta=0.0, opd_tokens=0.0, tokens=0.0)
    norms = []
    with timer("update"):
        for mb in [order[i::n_mb] for i in range(n_mb)]:
            n_tok = C.global_sum([sum(len(R[i]) for i in mb)], d.device)[0]  # Σm over the whole mini-batch
            for m in C.minibatch_chunks(d, P, R, C.micro_batches(mb, P, R, args.micro_batch, args.micro_batch_tokens),
                                        temperature=args.temperature):
                logp, mask = m.logprobs(policy)                                    # ℓ_θ, with gradient
                old_lp, adv = m.rows(old), m.rows(adv_tok) * m.rows(is_w, dummy=1.0)  # A per token (· w: rollout_is)
                _, pg, kl = S.grpo_loss(logp, old_lp, m.rows(ref_lp), adv, mask, args.clip_eps, args.beta_kl, n_tok)
                loss = args.pg_coef * pg + args.beta_kl * kl  # L_rl; OPSD: pg_coef 0 keeps only the KL
                if args.lambda_opd > 0:  # RLSD has no distillation term
                    t_lp, mk = m.rows(teacher), (mask * m.has(teacher)).detach()
                    if args.distill == "opd":  # SDAR, OPSD, GRPO+OPSD: Eq. (1) with ℓ_T at θ_old
                        l_opd, gate = S.opd_loss(logp, t_lp, mk, args.beta_opd, n_tok)
                        sums["gate"] += (gate * mk).sum().detach()
                        sums["gate_sq"] += (gate ** 2 * mk).sum().detach()
                    else:  # Skill-SD
                        l_opd = sdl_loss(logp, old_lp, t_lp, mk, n_tok)
                    loss = loss + args.lambda_opd * l_opd
                    sums["opd"] += l_opd.detach()
                    sums["delta"] += ((t_lp - logp) * mk).sum().detach()
                    sums["opd_tokens"] += mk.sum().detach()
                (loss * m.scale).backward()
                sums["pg"] += pg.detach() * m.real
                sums["kl"] += kl.detach() * m.real
                sums["tokens"] += mask.sum().detach() * m.real
            norms.append(C.clip_and_step(policy, opt, args.max_grad_norm, args.max_skipped_steps))
    if args.rlsd_lambda > 0:  # mean Â/A over the tokens of turns with A ≠ 0: how much the teacher re-weighted
        sums["rlsd_w"] = sum((a / s.adv).sum().item() for a, s in zip(adv_tok, samples) if s.adv)
        sums["rlsd_tokens"] = float(sum(len(a) for a, s in zip(adv_tok, samples) if s.adv))
    tot = C.global_sums(sums, d)
    rlsd = {"rlsd/lambda": lam_t, "rlsd/weight_mean": tot["rlsd_w"] / max(tot["rlsd_tokens"], 1.0)} \
        if args.rlsd_lambda > 0 else {}
    n_opd = max(tot["opd_tokens"], 1.0)
    gate_mean = tot["gate"] / n_opd
    taught = [s for s in samples if s.teacher_ids]
    return {"losses/pg": tot["pg"] / n_mb, "losses/kl": tot["kl"] / n_mb, "losses/opd": tot["opd"] / n_mb,
            "losses/total": (args.pg_coef * tot["pg"] + args.beta_kl * tot["kl"] + args.lambda_opd * tot["opd"]) / n_mb,
            **({"opd/gate_mean": gate_mean, "opd/gate_std": math.sqrt(max(tot["gate_sq"] / n_opd - gate_mean ** 2, 0))}
               if args.distill == "opd" else {}),  # Skill-SD has no gate
            "opd/delta_mean": tot["delta"] / n_opd, "opd/token_frac": tot["opd_tokens"] / max(tot["tokens"], 1),
            "train/minibatches": n_mb, **C.grad_norm_metrics(norms), "train/tokens": tot["tokens"],
            **rlsd, **C.rollout_mismatch(old, engine_lp, d), **harness.padding_metrics(d),
            "perf/teacher_tokens": harness.sample_tokens([s.teacher_ids for s in taught], [s.response_ids for s in taught], d),
            "perf/teacher_seqs": harness.sample_count(taught, d)}
