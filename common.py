"""Method-agnostic machinery shared by seed.py, opid.py and grsd.py.

Read top to bottom, this file is the life of one GRPO-style update without the method-specific part:
  distributed setup -> model/tokenizer (incl. an offline `tiny` model) -> FSDP2 sharding -> rollout engine
  (weights synced from the FSDP model) -> multi-turn collection in an environment -> log-prob scoring
  -> RL primitives (masked mean, clipped surrogate, k3 KL) -> mini-batch bookkeeping across ranks
  -> checkpoints, metrics, an OpenAI-compatible chat client for external annotators, validation.

Conventions (see DESIGN.md §3-4):
  * Every rank owns whole task groups (all N rollouts of a task), so group statistics are local.
  * FSDP forwards are collectives: every rank runs the same number of forward/backward calls. Ranks with fewer
    samples run a 2-token dummy micro-batch whose loss is multiplied by 0 (`pad_chunks`).
  * A loss that the paper writes as a masked mean over a mini-batch is divided by the *global* token count of
    that mini-batch (all-reduced) and multiplied by world size, because FSDP averages gradients over ranks.
"""
from __future__ import annotations

import datetime
import http.client
import json
import math
import os
import random
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()  # one progress bar per run: ours (Metrics)

# ----------------------------------------------------------------------------------------------------------------
# Distributed setup: plain `python` (a 1-rank gloo group) or `torchrun` (gloo on CPU, nccl on GPU)
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Dist:
    rank: int
    world: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(seed: int, timeout_minutes: int = 30) -> Dist:
    """One code path for 1 or many processes: without torchrun we form a 1-rank group on localhost."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        backend, device = "nccl", torch.device("cuda", local_rank)
    else:
        backend, device = "gloo", torch.device("cpu")
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=timeout_minutes),
                            device_id=device if backend == "nccl" else None)
    rank = dist.get_rank()
    random.seed(seed + rank)
    torch.manual_seed(seed + rank)  # sampling differs per rank (the tiny model's init forks its own RNG)
    return Dist(rank, dist.get_world_size(), device)


def shutdown():
    """Barrier, destroy the process group, then rank 0, which hosts the rendezvous store, leaves last. Seen here: rank
    0 leaving while another rank still tears down can abort it ("terminate called without an active exception")."""
    if not dist.is_initialized():
        return
    world, rank = dist.get_world_size(), dist.get_rank()
    store = dist.distributed_c10d._get_default_store()  # outlives the process group
    dist.barrier()
    dist.destroy_process_group()
    if world > 1:
        store.add("ranks_done", 1)
        deadline = time.time() + 60
        while rank == 0 and store.add("ranks_done", 0) < world and time.time() < deadline:
            time.sleep(0.01)


def all_reduce(x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    x = x.clone()
    dist.all_reduce(x, op=op)
    return x


def global_max(n: int, device) -> int:
    return int(all_reduce(torch.tensor([n], device=device), dist.ReduceOp.MAX).item())


def global_sum(values: list[float], device) -> list[float]:
    return all_reduce(torch.tensor(values, dtype=torch.float64, device=device)).tolist()


def all_gather_objects(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Model and tokenizer: any HF causal LM, or `tiny` (built offline, in-process, deterministic for a seed)
# ----------------------------------------------------------------------------------------------------------------

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Text the tiny tokenizer's BPE merges are learned from: the vocabulary of the agent prompts, so that prompts
# stay a few hundred tokens long. (Any byte string still encodes: the byte-level alphabet is always included.)
_TINY_CORPUS = """You are an expert agent operating in a household. Your task is to: put a clean mug in coffeemachine.
You are in the middle of a room. Looking quickly around you, you see a cabinet 1, a cabinet 2, a countertop 1,
a drawer 1, a fridge 1, a microwave 1, a sinkbasin 1, a desklamp 1, a shelf 1, a diningtable 1, a garbagecan 1.
You arrive at the countertop 1. On the countertop 1, you see a apple 1, a bowl 2, a knife 1, a mug 1, a plate 3.
The drawer 1 is closed. You open the drawer 1. The drawer 1 is open. In it, you see nothing. Nothing happens.
You pick up the mug 1 from the countertop 1. You clean the mug 1 using the sinkbasin 1. You heat the potato 1
using the microwave 1. You cool the tomato 1 using the fridge 1. You turn on the desklamp 1. You move the mug 1
to the coffeemachine 1. You are carrying: a mug 1. go to open close take from move to clean heat cool use with
examine look inventory. Observation: Action: Step Admissible actions: Now it's your turn to take an action.
<think> I need to find the mug first, then clean it with the sinkbasin, then put it in the coffeemachine. </think>
<action>go to countertop 1</action> <search> query </search> <answer> Paris </answer> <information> Doc 1
(Title: "History") The question asks who wrote the book and when the film was released. </information>
<skill> Workflow: locate the target object, take it, change its state, then place it. Avoid repeating actions
without checking the result. </skill> Analyze the trajectory below and write one reusable hindsight skill.
Task outcome: success failure reward invalid action episode step the a an of in on at is was what which who
"""


def build_tiny_tokenizer():
    """Byte-level BPE with Qwen2's pre-tokenizer regex and NFC, ChatML template (DESIGN.md §6)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tk = Tokenizer(models.BPE())
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator([_TINY_CORPUS] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   padding_side="left", chat_template=CHATML_TEMPLATE)


def build_tiny_model(vocab_size: int, seed: int):
    """A 2-layer Qwen2-style model (hidden 128) with random weights: fast enough for a laptop CPU."""
    from transformers import AutoModelForCausalLM, Qwen2Config
    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                      tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.random.fork_rng():  # identical weights on every rank, per-rank sampling streams untouched
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(cfg)


def load_tokenizer(name: str):
    from transformers import AutoTokenizer
    return build_tiny_tokenizer() if name == "tiny" else AutoTokenizer.from_pretrained(name, padding_side="left")


def load_model(name: str, seed: int, dtype=torch.float32):
    """Full (unsharded) weights on CPU; identical on every rank (same seed / same files)."""
    from transformers import AutoModelForCausalLM
    if name == "tiny":
        return build_tiny_model(len(load_tokenizer("tiny")), seed).to(dtype)
    return AutoModelForCausalLM.from_pretrained(name, dtype=dtype)


def stop_token_ids(tok) -> list[int]:
    ids = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")}
    return sorted(i for i in ids if isinstance(i, int) and 0 <= i < len(tok))


# ----------------------------------------------------------------------------------------------------------------
# FSDP2: shard every decoder layer, then the root (trained policy and frozen reference alike)
# ----------------------------------------------------------------------------------------------------------------


def shard(model, d: Dist, bf16: bool, trainable: bool = True, grad_ckpt: bool = False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(d.device.type, (d.world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else \
        MixedPrecisionPolicy()
    if grad_ckpt:  # recompute each decoder layer in backward instead of storing its activations
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to(d.device)
    model.requires_grad_(trainable)
    model.train(trainable)  # HF models have dropout 0; train() only matters for custom configs
    return model


def full_state_dict_iter(model):
    """Yield (name, full tensor) from an FSDP2 model. Collective: every rank iterates in the same order."""
    for name, t in model.state_dict().items():
        yield name, (t.full_tensor() if hasattr(t, "full_tensor") else t)


def save_checkpoint(model, tok, path: str, d: Dist):
    """An HF directory loadable with AutoModelForCausalLM.from_pretrained (DESIGN.md §6: FSDP2 state dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if d.main:
        os.makedirs(path, exist_ok=True)
        model.save_pretrained(path, state_dict=sd)
        tok.save_pretrained(path)
    dist.barrier()


# ----------------------------------------------------------------------------------------------------------------
# Rollout engine. One interface: sync(weights from the FSDP model) and generate(prompt ids) -> response ids.
# HFEngine is a plain, unsharded copy of the policy on each rank (so rollouts need no collectives). A vLLM
# engine (later issue) implements the same two methods.
# ----------------------------------------------------------------------------------------------------------------


class HFEngine:
    def __init__(self, model, tok, device, gen_batch: int = 64):
        self.model = model.to(device).eval().requires_grad_(False)
        self.tok, self.device, self.gen_batch = tok, device, gen_batch
        self.stops = stop_token_ids(tok)

    @torch.no_grad()
    def sync(self, fsdp_model):
        """θ_old ← θ: copy the trained weights into the rollout model."""
        own = self.model.state_dict()
        for name, t in full_state_dict_iter(fsdp_model):
            own[name].copy_(t)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, top_p: float = 1.0):
        """Sample one response per prompt; each response ends at (and includes) its first stop token."""
        out = []
        for i in range(0, len(prompts), self.gen_batch):
            ids, mask = left_pad(prompts[i:i + self.gen_batch], self.tok.pad_token_id, self.device)
            sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 \
                else dict(do_sample=False)
            # repetition_penalty=1: a checkpoint's generation_config (Qwen2.5: 1.05) would otherwise bend the
            # sampling distribution away from π_θold, and the importance ratio with it
            gen = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                      eos_token_id=self.stops, pad_token_id=self.tok.pad_token_id,
                                      repetition_penalty=1.0, **sampling)
            for row in gen[:, ids.shape[1]:].tolist():
                cut = next((j + 1 for j, t in enumerate(row) if t in self.stops), len(row))
                out.append(row[:cut])
        return out

    def generate_text(self, user_texts: list[str], max_prompt: int, max_new_tokens: int, temperature: float):
        """The policy in a non-acting role (analyzer, annotator, judge): chat prompt in, text out."""
        prompts = [encode_prompt(self.tok, t, max_prompt)[0] for t in user_texts]
        resp = self.generate(prompts, max_new_tokens, temperature)
        return [self.tok.decode(r, skip_special_tokens=True) for r in resp]


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


@dataclass
class Trajectory:
    task_id: str
    group: int                # index of the task group on this rank (all N rollouts of a task share it)
    task: str
    family: str
    first_observation: str    # what the agent saw before its first action
    turns: list[Turn] = field(default_factory=list)
    won: bool = False

    @property
    def reward(self) -> float:  # R(τ) = task outcome minus invalid-action penalties (DESIGN.md §4)
        return sum(t.reward for t in self.turns)


@dataclass
class CollectStats:
    truncated_prompts: int = 0
    unterminated_responses: int = 0


def collect(engine: HFEngine, make_env, task_ids: list[str], n: int, max_prompt: int, max_response: int,
            temperature: float, top_p: float) -> tuple[list[Trajectory], CollectStats]:
    """Play n rollouts of each task, all environments stepping in lock-step so each turn is one batched generate."""
    envs, trajs = [], []
    for g, task_id in enumerate(task_ids):
        for _ in range(n):
            env = make_env()
            env.reset(task_id)
            envs.append(env)
            trajs.append(Trajectory(task_id, g, env.task, env.family, env.observation))
    stats, active = CollectStats(), list(range(len(envs)))
    while active:
        texts = [envs[i].prompt() for i in active]
        encoded = [encode_prompt(engine.tok, t, max_prompt) for t in texts]
        stats.truncated_prompts += sum(used != t for t, (_, used) in zip(texts, encoded))
        responses = engine.generate([ids for ids, _ in encoded], max_response, temperature, top_p)
        still = []
        for i, (ids, text), resp in zip(active, encoded, responses):
            stats.unterminated_responses += resp[-1:] != [] and resp[-1] not in engine.stops
            resp_text = engine.tok.decode(resp, skip_special_tokens=True)
            obs, reward, done, info = envs[i].step(resp_text)
            trajs[i].turns.append(Turn(text, ids, resp, resp_text, info["action"], info["valid"], obs, reward))
            trajs[i].won = bool(info["won"])
            if not done:
                still.append(i)
            elif hasattr(envs[i], "close"):
                envs[i].close()
        active = still
    return trajs, stats


def rollout_metrics(trajs: list[Trajectory], d: Dist, prefix: str = "charts/") -> dict:
    """Success rate, return, episode length and invalid-action rate over all ranks."""
    turns = [t for tr in trajs for t in tr.turns]
    s = global_sum([len(trajs), sum(tr.won for tr in trajs), sum(tr.reward for tr in trajs), len(turns),
                    sum(not t.valid for t in turns), sum(len(t.response_ids) for t in turns)], d.device)
    n = max(s[0], 1)
    return {prefix + "success_rate": s[1] / n, prefix + "return": s[2] / n, prefix + "episode_length": s[3] / n,
            prefix + "invalid_action_rate": s[4] / max(s[3], 1), prefix + "response_tokens": s[5] / max(s[3], 1)}


def evaluate(engine, make_env, task_ids: list[str], d: Dist, max_prompt, max_response, temperature) -> dict:
    """Held-out success per task family; the overall number weighs families equally (SEED Eq. 16)."""
    mine = task_ids[d.rank::d.world]
    trajs, _ = collect(engine, make_env, mine, 1, max_prompt, max_response, temperature, 1.0) if mine else ([], 0)
    per_family: dict[str, list[int]] = {}
    for part in all_gather_objects([(tr.family, tr.won) for tr in trajs]):
        for fam, won in part:
            per_family.setdefault(fam, []).append(int(won))
    out = {f"eval/success/{f}": sum(v) / len(v) for f, v in sorted(per_family.items())}
    out["eval/success"] = sum(out.values()) / max(len(out), 1)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Log-prob scoring: log π(response token | prompt, earlier response tokens), fp32 log-softmax
# ----------------------------------------------------------------------------------------------------------------


def sequence_logprobs(model, prompts: list[list[int]], responses: list[list[int]], device):
    """Returns (logp [B, R], mask [B, R]). Layout per row: [left pad][prompt][response][right pad] (pads hold token
    0 and are masked), so every response starts at column P and is predicted by the logits at P-1 … P+R-2: the
    model computes only those (logits_to_keep). Left padding needs explicit position ids (DESIGN.md §4)."""
    P, R = max(len(p) for p in prompts), max(len(r) for r in responses)
    ids = torch.zeros((len(prompts), P + R), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, P - len(p):P + len(r)] = torch.tensor(p + r, dtype=torch.long)
        attn[i, P - len(p):P + len(r)] = 1
    ids, attn = ids.to(device), attn.to(device)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, logits_to_keep=R + 1).logits[:, :-1]
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, P:, None]).squeeze(-1)
    return logp, attn[:, P:].float()


DUMMY = ([0], [0])  # a 2-token micro-batch for ranks that have run out of real samples (its loss is scaled by 0)


def pad_chunks(chunks: list[list[int]], device) -> list[list[int]]:
    """Append empty chunks so every rank runs the same number of FSDP forwards (collectives)."""
    return chunks + [[] for _ in range(global_max(len(chunks), device) - len(chunks))]


def chunk(indices: list[int], size: int) -> list[list[int]]:
    return [indices[i:i + size] for i in range(0, len(indices), size)]


@torch.no_grad()
def score(model, prompts: list[list[int]], responses: list[list[int]], micro_bs: int, device):
    """Per-sample response log-probs (list of 1-D CPU tensors) for a whole rank-local batch, without gradients."""
    out = []
    for idx in pad_chunks(chunk(list(range(len(prompts))), micro_bs), device):
        p, r = ([prompts[i] for i in idx], [responses[i] for i in idx]) if idx else ([DUMMY[0]], [DUMMY[1]])
        logp, _ = sequence_logprobs(model, p, r, device)
        out += [logp[j, :len(responses[i])].cpu() for j, i in enumerate(idx)]
    return out


def pad_right(rows: list[torch.Tensor], device, value: float = 0.0) -> torch.Tensor:
    R = max(len(r) for r in rows)
    out = torch.full((len(rows), R), value, dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out.to(device)


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


def kl_k3(logp, ref_logp) -> torch.Tensor:
    """Low-variance KL(π_θ ‖ π_ref) estimator per token: exp(r) − r − 1 with r = ℓ_ref − ℓ_θ, clamped to ±10."""
    r = (ref_logp - logp).clamp(-20.0, 20.0)  # keeps exp finite: an inf here would make the gradient NaN
    return (torch.exp(r) - r - 1).clamp(-10.0, 10.0)


def clip_and_step(model, optimizer, max_norm: float) -> float:
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)


# ----------------------------------------------------------------------------------------------------------------
# Metrics: one JSON line per update, plus a tqdm bar on rank 0
# ----------------------------------------------------------------------------------------------------------------


class Metrics:
    def __init__(self, path: str, d: Dist, total: int, desc: str):
        from tqdm import tqdm
        self.d, self.path = d, path
        self.bar = tqdm(total=total, desc=desc, disable=not d.main, dynamic_ncols=True)
        if d.main:  # a new run starts a new file
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            open(path, "w").close()

    def log(self, row: dict):
        if self.d.main:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
            keys = [k for k in ("charts/success_rate", "losses/total", "time/total") if k in row]
            self.bar.set_postfix({k.split("/")[-1]: round(row[k], 4) for k in keys})
            self.bar.update(1)

    def close(self):
        self.bar.close()


class Timer:
    """Wall seconds per phase: `with timer("rollout"): ...` then timer.as_metrics()."""

    def __init__(self):
        self.s: dict[str, float] = {}

    def __call__(self, name):
        timer = self

        class _Ctx:
            def __enter__(self):
                self.t = time.perf_counter()

            def __exit__(self, *exc):
                timer.s[name] = timer.s.get(name, 0.0) + time.perf_counter() - self.t
        return _Ctx()

    def as_metrics(self) -> dict:
        return {f"time/{k}": v for k, v in self.s.items()}


# ----------------------------------------------------------------------------------------------------------------
# OpenAI-compatible chat client (stdlib only) for external analyzers / annotators / judges
# ----------------------------------------------------------------------------------------------------------------


class ChatClient:
    """POST {base_url}/chat/completions. Failures (after bounded retries with backoff: network errors, HTTP errors,
    cut-off bodies, malformed JSON) return None and are counted in `self.failures`; they never raise. A `content`
    given as a list of parts is joined; any other non-text content counts as a failure."""

    def __init__(self, base_url: str, model: str, api_key: str = "", timeout: float = 120.0, retries: int = 3,
                 workers: int = 16):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.api_key, self.timeout, self.retries, self.workers = model, api_key, timeout, retries, workers
        self.failures, self._lock = 0, threading.Lock()

    def complete(self, messages: list[dict], temperature: float, max_tokens: int) -> str | None:
        body = json.dumps({"model": self.model, "messages": messages, "temperature": temperature,
                           "max_tokens": max_tokens}).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        for attempt in range(self.retries):
            try:
                req = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
                with urllib.request.urlopen(req, timeout=self.timeout) as r:
                    content = json.loads(r.read())["choices"][0]["message"]["content"]
                if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                    content = "".join(p["text"] for p in content if isinstance(p, dict) and "text" in p)
                if isinstance(content, str):
                    return content
            except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError, KeyError, IndexError,
                    TypeError):
                pass
            if attempt + 1 < self.retries:
                time.sleep(min(2 ** attempt, 10))
        with self._lock:  # complete_many calls this from a thread pool
            self.failures += 1
        return None

    def complete_many(self, prompts: list[str], temperature: float, max_tokens: int) -> list[str | None]:
        with ThreadPoolExecutor(self.workers) as pool:
            return list(pool.map(lambda p: self.complete([{"role": "user", "content": p}], temperature, max_tokens),
                                 prompts))


# ----------------------------------------------------------------------------------------------------------------
# Small helpers the method files share
# ----------------------------------------------------------------------------------------------------------------


def task_envs(args):
    """From a method's Args: the train task ids, a seeded sample of `eval_tasks` held-out ids (split `eval_split`),
    and environment factories for both splits."""
    import envs
    kw = dict(seed=args.seed, data_dir=args.data_dir, max_steps=args.max_steps)
    if args.retriever_url:
        kw["retriever_url"] = args.retriever_url
    make_train = lambda: envs.make_env(args.env, split="train", **kw)  # noqa: E731
    make_valid = lambda: envs.make_env(args.env, split=args.eval_split, **kw)  # noqa: E731
    valid_ids = make_valid().task_ids()
    valid_ids = random.Random(args.seed).sample(valid_ids, min(args.eval_tasks, len(valid_ids)))
    return make_train().task_ids(), valid_ids, make_train, make_valid


def validate_and_save(update: int, args, engine, policy, tok, make_valid, valid_ids, d: Dist, timer) -> dict:
    """Held-out success every `eval_every` updates and after the last (θ pushed to the engine first); an HF
    checkpoint every `save_every` updates and after the last (`final/`)."""
    row, last = {}, update + 1 == args.updates
    if args.eval_every and ((update + 1) % args.eval_every == 0 or last):
        engine.sync(policy)
        with timer("eval"):
            row = evaluate(engine, make_valid, valid_ids, d, args.max_prompt_len, args.max_response_len,
                           args.eval_temperature)
    if (update + 1) % args.save_every == 0 or last:
        with timer("save"):
            save_checkpoint(policy, tok, os.path.join(args.out_dir, "final" if last else f"update{update + 1}"), d)
    return row


def sample_tasks(task_ids: list[str], k: int, update: int, seed: int) -> list[str]:
    """The same global task batch on every rank (seeded by update), without replacement when possible."""
    rng = random.Random(seed * 100_003 + update)
    return rng.sample(task_ids, k) if k <= len(task_ids) else [rng.choice(task_ids) for _ in range(k)]


def rank_slice(items: list, d: Dist) -> list:
    return items[d.rank::d.world]


def n_minibatches(n_local: int, minibatch_turns: int, d: Dist) -> int:
    """Mini-batch of `minibatch_turns` turns over all ranks (paper: 256, 1 epoch); the count agrees across ranks."""
    per_rank = max(1, minibatch_turns // d.world)
    return max(1, global_max(math.ceil(n_local / per_rank), d.device))


def split_even(indices: list[int], parts: int) -> list[list[int]]:
    return [indices[i::parts] for i in range(parts)]


def arg(default, help: str):
    """An Args field with its help line."""
    return field(default=default, metadata={"help": help})


def parse_args(cls):
    """A typed dataclass -> argparse CLI (`--field value`; booleans are `--flag` / `--no-flag`), CleanRL style."""
    import argparse
    import dataclasses
    import typing
    p = argparse.ArgumentParser(description=cls.__doc__)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        base = next((a for a in typing.get_args(kind) if a is not type(None)), kind)
        help_text = f.metadata.get("help", "")
        if base is bool:
            p.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        else:
            p.add_argument(f"--{f.name}", type=base, default=f.default, help=help_text)
    return cls(**vars(p.parse_args()))
