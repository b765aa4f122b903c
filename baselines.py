"""The Table 1 baselines, each a recipe on SEED's machinery without its stage 1 (docs/baselines.md).

Run:
  python baselines.py --method sdar                        # SDAR on the embedded household env + tiny model, CPU
  torchrun --nproc_per_node 8 baselines.py --method rlsd --env alfworld --data_dir /path/to/alfworld
  python baselines.py --method skill_grpo                  # trains with the skill, evaluates without it
  python baselines.py --method skill_prompt --model runs/skill_grpo/final   # Skill-GRPO*: that run, evaluated with it
--method picks the row (RECIPES); every flag the recipe sets can still be given (e.g. --lambda_opd 0.02).

Sources: SEED App. B.2, OPID App. B.2, GRSD §4.1; where they are short, the official SDAR code (ZJU-REAL/SDAR, a
verl-agent fork that implements OPSD, GRPO+OPSD, Skill-SD, RLSD and SDAR). The loop below is seed.py's stage 2
(rollout, samples, checkpoints: imported from seed.py); the update is seed.seed_update for the rows without a
teacher and baseline_update for those with one.

ℓ_T is the log-prob of the sampled token with a retrieved library skill in the context, ℓ_old that of θ_old, sg a
stop-gradient:
  Vanilla      the backbone, no training (--method vanilla: --eval_only).
  Skill-Prompt* Vanilla with the retrieved skill in the agent's context at evaluation (--method skill_prompt).
  GRPO         L_rl only (--method grpo).
  Skill-GRPO   GRPO with the retrieved skill in the policy's own context in rollouts and updates, evaluated
               without it (--method skill_grpo); Skill-GRPO* evaluates that run's weights with it (skill_prompt).
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
               stage 1, the teacher scored once per update with θ_old.
  Every skill baseline's teacher is θ_old with a library skill, scored once per update before the mini-batches, as
  in the SDAR code (RLSDRayTrainer._compute_teacher_log_probs); SEED's teacher is the current θ (Alg. 1 l.22).

Deviations / choices:
  * The SDAR code also adds an entropy bonus (0.001) and a dual clip (c = 3) to every baseline's RL term (verl
    defaults); none of our three papers states them and this file has neither.
  * SDAR prepends the raw skill text; H here puts it under a one-line header (seed.LIBRARY_HEADER) before the agent
    prompt, as for SEED's own skills.
  * The library defaults to skills/alfworld.jsonl (household, alfworld) or skills/search.jsonl (search): short
    hand-written libraries of ours, not SDAR's files; WebShop has none (--skill_library FILE).
  * The other settings are SEED's Table 5 values (seed.PAPER without stage 1), as the papers' shared rows use.
  * --lora_rank R > 0 (not in the paper, which trains every weight; issue 57): π_θ is the frozen base plus peft
    adapters W + (α/r)·B·A, and π_ref is that same model with its adapters off (models.AdapterOff), i.e. exactly
    the base. The engine samples from the merged weights (models.full_state_dict_iter).
"""
from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import dataclass

import torch

import common as C
import harness
import models
import seed as S  # SEED's equations (grpo_loss, opd_loss), samples, skill context and its stage-2 helpers
from harness import arg

HERE = os.path.dirname(os.path.abspath(__file__))
DISTILL = ("opd", "sdl")
# --method: the Table 1 row -> the flags it sets (a flag given on the command line wins); None-default fields the
# recipe leaves open get NO_RECIPE's value
RECIPES = {
    "vanilla": dict(eval_only=True),
    "skill_prompt": dict(eval_only=True, eval_with_skills=True),
    "grpo": dict(lambda_opd=0.0),
    "skill_grpo": dict(lambda_opd=0.0, train_with_skills=True),
    "opsd": dict(pg_coef=0.0),
    "grpo_opsd": dict(beta_opd=0.0),
    "skill_sd": dict(distill="sdl", lambda_opd=0.001),
    "rlsd": dict(lambda_opd=0.0, rlsd_lambda=0.5),
    "sdar": dict(),
}
NO_RECIPE = dict(lambda_opd=0.01, beta_opd=5.0, pg_coef=1.0, distill="opd", rlsd_lambda=0.0, train_with_skills=False,
                 eval_with_skills=False)
LIBRARIES = {"household": "skills/alfworld.jsonl", "alfworld": "skills/alfworld.jsonl", "search": "skills/search.jsonl"}


@dataclass
class Args(harness.RunArgs):
    """A Table 1 baseline (docs/baselines.md): SEED's Table 5 defaults without stage 1; fields left at None take the
    recipe's value (--method), the per-env paper value, or the tiny preset."""
    method: str = arg("sdar", "the Table 1 row (RECIPES): vanilla, skill_prompt, grpo, skill_grpo, opsd, grpo_opsd, "
                              "skill_sd, rlsd or sdar", tuple(RECIPES))
    out_dir: str | None = arg(None, "metrics.jsonl and checkpoints go here (default: runs/<method>)", ops=True)
    skill_library: str | None = arg(None, "JSONL of {'skill': text, 'family': task family (absent: every task)} "
                                           "records (default: skills/alfworld.jsonl for household and alfworld, "
                                           "skills/search.jsonl for search), or a SEED run's stage1/skills.jsonl")
    # The recipe's terms (None: the recipe's value)
    lambda_opd: float | None = arg(None, "λ of the distillation term (default, by recipe: SDAR, OPSD, GRPO+OPSD "
                                         "0.01; Skill-SD 0.001; else 0)")
    beta_opd: float | None = arg(None, "gate sharpness β (default, by recipe: 5; GRPO+OPSD 0)")
    pg_coef: float | None = arg(None, "weight of the clipped GRPO term of L_rl (default, by recipe: OPSD 0, else 1)")
    distill: str | None = arg(None, "distillation term: opd (SEED Eq. 1, gated) or sdl (Skill-SD: ρ-weighted k3; "
                                        "default, by recipe: sdl for Skill-SD, else opd)",
                              DISTILL)
    rlsd_lambda: float | None = arg(None, "RLSD λ_0: teacher-weighted token advantages (default, by recipe: RLSD 0.5 "
                                          "as the SDAR code; else 0)")
    rlsd_warmdown: int = arg(100, "RLSD W: λ_t = λ_0 (1 − t/W) at update t = 1, 2, …, 0 from t = W on")
    rlsd_clip: float = arg(0.2, "RLSD ε_w: w_t clipped to [1 − ε_w, 1 + ε_w]")
    train_with_skills: bool | None = arg(None, "the retrieved skill in the policy's own context in rollouts and "
                                               "updates (default, by recipe: on for Skill-GRPO)")
    eval_with_skills: bool | None = arg(None, "validate with the retrieved skill in the policy's context "
                                              "(default, by recipe: on for Skill-Prompt*)")
    skill_max_tokens: int = arg(256, "skills are cut to this many tokens before injection", at_least=1)
    # GRPO (SEED Table 5)
    updates: int | None = arg(None, "policy updates (paper 150)", at_least=1)
    tasks_per_update: int | None = arg(None, "task batch (paper 16 ALFWorld/WebShop, 128 Search)", at_least=1)
    group_size: int | None = arg(None, "N rollouts per task (paper 8; group-relative advantages compare N ≥ 2)",
                                 at_least=2)
    lr: float = arg(1e-6, "learning rate (paper 1e-6)", above=0)
    weight_decay: float = arg(0.01, "AdamW weight decay")
    max_grad_norm: float = arg(1.0, "gradient clipping", above=0)
    clip_eps: float = arg(0.2, "PPO clip ε_clip (paper 0.2)", above=0)
    beta_kl: float = arg(0.01, "KL coefficient β_KL (paper 0.01)")
    adv_eps: float = arg(1e-6, "ε in (R − μ)/(σ + ε)")
    max_steps: int | None = arg(None, "episode step limit (paper 30 ALFWorld, 15 WebShop, 4 Search; laptop ≤ 6)",
                                at_least=1)
    minibatch_turns: int = arg(256, "turns per optimiser step over all ranks (paper 256, 1 epoch)", at_least=1)
    eval_temperature: float = arg(0.4, "validation sampling temperature (0 = greedy)")


STAGE1 = ("sft_tasks", "sft_rollouts", "annotator_max_tokens")
PAPER = {env: {k: v for k, v in p.items() if k not in STAGE1} for env, p in S.PAPER.items()}
LAPTOP = {k: v for k, v in S.LAPTOP.items() if k not in STAGE1}


def has_teacher(args) -> bool:
    """The rows that score ℓ_T (baseline_update): a distillation term or RLSD's weights."""
    return args.lambda_opd > 0 or args.rlsd_lambda > 0


def resolve(args: Args) -> Args:
    harness.check_choices(args, Args)
    for k, v in {**NO_RECIPE, **RECIPES[args.method]}.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if RECIPES[args.method].get("eval_only"):
        args.eval_only = True
    args.out_dir = args.out_dir or f"runs/{args.method}"
    if args.model is None:
        args.model = "tiny" if args.env == "household" else "Qwen/Qwen2.5-3B-Instruct"
    preset = LAPTOP if args.model == "tiny" or args.env == "household" else PAPER[args.env]
    for k, v in preset.items():
        if getattr(args, k) is None:
            setattr(args, k, min(v, PAPER[args.env][k]) if k == "max_steps" else v)  # laptop: ≤ 6 steps
    uses_library = (has_teacher(args) and not args.eval_only) or args.train_with_skills or args.eval_with_skills
    if uses_library and args.skill_library is None:
        if args.env not in LIBRARIES:
            raise SystemExit(f"--method {args.method} retrieves library skills and skills/ has none for --env "
                             f"{args.env}: pass --skill_library FILE")
        args.skill_library = os.path.join(HERE, LIBRARIES[args.env])
    if args.rlsd_lambda > 0 and args.lambda_opd > 0:
        raise SystemExit("RLSD (--rlsd_lambda > 0) has no distillation loss: add --lambda_opd 0")
    if args.pg_coef == 0 and args.lambda_opd == 0:
        raise SystemExit("--pg_coef 0 with --lambda_opd 0 leaves only the KL term to train")
    harness.check_run_args(args)  # tracker, counts, out_dir: before anything loads
    return args


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
        old = C.score(policy, P, R, args.micro_batch, d, args.micro_batch_tokens, args.temperature)
        # π_ref, for L_rl's KL
        ref_lp = C.score(ref, P, R, args.micro_batch, d, args.micro_batch_tokens, args.temperature)
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
                        C.add_sums(sums, m, gate=(gate * mk).sum(), gate_sq=(gate ** 2 * mk).sum())
                    else:  # Skill-SD
                        l_opd = sdl_loss(logp, old_lp, t_lp, mk, n_tok)
                    loss = loss + args.lambda_opd * l_opd
                    C.add_sums(sums, m, opd=l_opd, delta=((t_lp - logp) * mk).sum(), opd_tokens=mk.sum())
                m.backward(loss)
                C.add_sums(sums, m, pg=pg, kl=kl, tokens=mask.sum())
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


# ------------------------------------------------------------------------------------------------------------------
# The loop: seed.py's stage 2 with a library skill per task (no stage 1, no analyzer)
# ------------------------------------------------------------------------------------------------------------------


def main(args: Args):
    args = resolve(args)
    harness.show_settings(args, args.method)  # the first line, before anything loads
    d = models.init_distributed(args.seed)
    base = models.resolve_model(args.model)  # a hub id: the cached snapshot every rank reads (rank 0 fetches)
    tok = models.load_tokenizer(base)
    train_ids, make_train, evals = harness.task_envs(args)
    library = load_library(args.skill_library) if args.skill_library else None
    train_context = library_context(library, tok, args) if args.train_with_skills else None  # Skill-GRPO
    eval_context = library_context(library, tok, args) if args.eval_with_skills else None  # Skill-Prompt*
    if args.eval_only:  # Vanilla, Skill-Prompt*, Skill-GRPO*
        return models.shutdown(harness.eval_only(args, args.method, d, base, tok, evals,
                                                 args.max_prompt_len + args.max_response_len, eval_context))
    run = harness.Run(args, args.method, d, args.updates)  # out_dir, metrics rows, --resume
    engine = models.make_engine(args, base, tok, d, args.max_prompt_len + args.max_response_len)  # agent turns only
    policy = models.shard(models.load_policy(run.state or base, base, args), d, args.bf16, grad_ckpt=args.grad_ckpt)
    ref = models.AdapterOff(policy) if args.lora_rank else \
        models.shard(models.load_model(base, args.seed), d, args.bf16, trainable=False)  # π_ref: the backbone
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    if run.state:
        harness.restore_state(run.state, policy, opt, d)  # AdamW moments and every rank's RNG

    for update in range(run.start, args.updates):
        C.set_lr(opt, args.lr, update, args.lr_warmup)
        timer, t0, work = harness.Timer(), time.perf_counter(), harness.engine_work(engine)
        with timer("sync"):
            engine.sync(policy)                                                      # θ_old ← θ
        tasks = C.rank_slice(C.sample_tasks(train_ids, args.tasks_per_update, update, args.seed), d)
        with timer("rollout"):                                                       # G_q ~ π_θold
            trajs, cstats = C.collect(engine, make_train, tasks, args.group_size, args.max_prompt_len,
                                      args.max_response_len, args.temperature, args.top_p, train_context)
        run.replies.record_turns(trajs, engine.stops)
        with timer("analysis"):  # the teacher's skill: the task family's library record (none without a teacher)
            skills = [retrieve_skill(library, tr.family) for tr in trajs] if has_teacher(args) else [None] * len(trajs)
        samples, adv = S.build_samples(trajs, skills, tok, args, S.LIBRARY_HEADER)
        engine.sleep()  # GPU: offload the engine's weights, free its KV cache for the update
        if has_teacher(args):
            stats = baseline_update(policy, ref, opt, samples, args, d, timer, update)
        else:  # GRPO, Skill-GRPO: L_rl alone, as SEED's update at λ_opd = 0
            stats = S.seed_update(policy, ref, opt, samples, args, d, timer)
        row = {"update": update, "stage": 2, **stats, **S.stage2_metrics(trajs, skills, adv, d)}
        row.update(cstats.metrics(d, args.require_endpoint, args.env == "search"))
        row.update(C.rollout_metrics(trajs, d))
        row.update(harness.engine_metrics(engine, work, d))
        row.update(harness.validate(update, args, engine, policy, evals, d, timer, eval_context))
        run.end_update(update, row, timer, t0, policy, opt, tok)  # checkpoint every save_every, then the row
    run.close()
    models.shutdown(engine)


if __name__ == "__main__":
    harness.run_main(main, harness.parse_args(Args, PAPER, LAPTOP))
