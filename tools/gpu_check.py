"""A GPU check at real shape, in one command, for the first machine with a GPU (no downloads, no vLLM needed).

  python tools/gpu_check.py               # 1 GPU: nccl, bf16, activation checkpointing (sized for ≤ 8 min on an H200)
  python tools/gpu_check.py --cpu-smoke   # the same checks with the tiny model on CPU (gloo, fp32): CI runs it

For each model — `tiny`, then (not in the smoke) a randomly initialised model of Qwen2.5-3B-Instruct's exact shape
(QWEN25_3B: hidden 2048, 36 layers, 16 query / 2 KV heads, FFN 11008, vocabulary 151,936, tied embeddings), built
in-process from that config and saved with the tiny tokenizer, whose ids all fit its vocabulary — it runs one
update of GRPO, SEED, OPID and GRSD on the household env, each as `torchrun --nproc_per_node 1 <method>.py`
with the HF engine. The in-repo oracle (tools/experiment.py) is SEED's stage-1 annotator, OPID's analyzer and GRSD's
judge, and SEED's stage 2 reads the stage-1 skills (--skill_source static), so the teacher branches run even though
a random policy writes nothing parseable (the table's teacher-token column says how much they scored).

It prints one row per (model, method): seconds per phase, generated tokens per second, trainer forward tokens per
second, peak GPU memory, and asserts every loss finite and no skipped step. Then it scores the same household
sequences with the model in fp32 and in bf16 (common.score, the training path) and asserts the mean per-token
log-prob gap below BF16_GAP. Exit code 0 means every check passed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]

QWEN25_3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                 num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
                 rms_norm_eps=1e-6, tie_word_embeddings=True)  # Qwen/Qwen2.5-3B-Instruct's config.json
BF16_GAP = 0.05  # nats per response token, mean |ℓ_bf16 − ℓ_fp32|
METHODS = ("grpo", "seed", "opid", "grsd")
SIZES = {  # per model: the run's shape (a real-shape update with short episodes; the smoke as small as it goes)
    "tiny": dict(tasks_per_update=4, group_size=4, max_steps=3, max_prompt_len=1024, max_response_len=64),
    "qwen2.5-3b-shape": dict(tasks_per_update=4, group_size=4, max_steps=3, max_prompt_len=2048, max_response_len=128),
    "smoke": dict(tasks_per_update=2, group_size=2, max_steps=2, max_prompt_len=512, max_response_len=16),
}


def build_real_shape(out: str, device: str) -> str:
    """Random Qwen2.5-3B-shaped weights (bf16) + the tiny tokenizer, as an HF directory."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    import models
    cfg = Qwen2Config(**QWEN25_3B, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it will run: seconds on a GPU, minutes on CPU
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out)
    models.load_tokenizer("tiny").save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    print(f"[gpu_check] built {n / 1e9:.2f} B random parameters of Qwen2.5-3B's shape in {out}")
    return out


def method_argv(method: str, model: str, out: str, url: str, size: dict) -> list[str]:
    """One update of `method`, its analyzer / annotator / judge the oracle at `url` (experiment.method_flags)."""
    import experiment as E
    b = E.Budget(updates=1, sft_tasks=12, sft_rollouts=2, **size)  # 12 stage-1 tasks: skills for every family
    script, extra = E.method_flags(method, url, b, lr=1e-6)
    if method == "seed":
        extra += ["--skill_source", "static"]  # stage 2 reads the oracle's stage-1 skills: the teacher branch runs
    # the experiment's shared flags (household, small room, HF engine, ...), no evaluation; later flags win
    return [script] + E.shared_flags(b, model, 0, out, 1e-6) + ["--eval_every", "0"] + extra


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_method(method: str, model: str, out: str, url: str, size: dict) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", str(free_port()),
           *[os.path.join(ROOT, a) if a.endswith(".py") else a for a in method_argv(method, model, out, url, size)]]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
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


def bf16_gap(model_dir: str, device: str, n: int = 8) -> tuple[float, float]:
    """(mean, max) |log π_bf16 − log π_fp32| per response token on n household prompts with expert responses,
    scored by common.score (the trainer's path: bf16 weights, log-softmax in fp32)."""
    import torch

    import common as C
    import envs
    import models
    tok = models.load_tokenizer(model_dir)
    prompts, responses = [], []
    env = envs.make_env("household", "valid_seen", seed=0, room="small")
    for task in env.task_ids()[:n]:
        env.reset(task)
        prompts.append(C.encode_prompt(tok, env.prompt(), 1024)[0])
        action = env.expert_action() or env.admissible()[0]
        responses.append(tok(envs.format_expert_response(action, "household"), add_special_tokens=False)["input_ids"])
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        model = models.load_model(model_dir, 0, dtype).to(device).eval()
        with torch.no_grad():
            out.append(torch.cat(C.score(model, prompts, responses, 4, torch.device(device))))
        del model
    gap = (out[0] - out[1]).abs()
    return gap.mean().item(), gap.max().item()


def table(rows: list[dict]) -> str:
    keys = list(rows[0])
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    return "\n".join(["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)] +
                     ["| " + " | ".join(fmt(r[k]) for k in keys) + " |" for r in rows])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU (gloo, fp32), the smallest shapes")
    p.add_argument("--out", default=None, help="where the runs and the built model go [default: a temp dir]")
    a = p.parse_args(argv)
    import torch

    import experiment as E
    import models
    if not a.cpu_smoke and not torch.cuda.is_available():
        raise SystemExit("[gpu_check] no GPU here: run it on a GPU machine, or pass --cpu-smoke")
    device = "cpu" if a.cpu_smoke else "cuda"
    print(f"[gpu_check] torch {torch.__version__}, device {torch.cuda.get_device_name(0) if device == 'cuda' else 'cpu'}"
          f", vLLM {'installed' if models.vllm_available() else 'absent'} (the check uses the HF engine)")
    root = a.out or tempfile.mkdtemp(prefix="gpu_check-")
    server = E.serve_oracle(E.Oracle((0,), room="small"))
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    todo = [("tiny", "tiny", SIZES["smoke" if a.cpu_smoke else "tiny"])]
    if not a.cpu_smoke:
        todo.append(("qwen2.5-3b-shape", None, SIZES["qwen2.5-3b-shape"]))
    rows, scored, t0 = [], {}, time.perf_counter()
    for name, model, size in todo:
        if model is None:
            model = build_real_shape(os.path.join(root, name), device)
        for method in METHODS:
            rows.append(summary(name, method, run_method(method, model, os.path.join(root, f"{name}-{method}"), url,
                                                         size)))
            print(f"[gpu_check] {name} {method}: {rows[-1]['wall s']:.0f} s, loss {rows[-1]['loss']:.4g}", flush=True)
        scored[name] = model if model != "tiny" else os.path.join(root, f"{name}-grpo", "final")
    server.shutdown()
    models.init_distributed(seed=0)  # common.score's collectives: a 1-rank group, formed after the last child ran
    gaps = {name: bf16_gap(path, device) for name, path in scored.items()}
    print(table(rows))
    for name, (mean, top) in gaps.items():
        print(f"[gpu_check] {name}: bf16 vs fp32 scoring gap, mean {mean:.4f} / max {top:.4f} nats per token "
              f"(bound: mean ≤ {BF16_GAP})")
        assert mean <= BF16_GAP, f"{name}: bf16 scoring gap {mean:.4f} > {BF16_GAP}"
    print(f"[gpu_check] all checks passed in {time.perf_counter() - t0:.0f} s; runs in {root}")


if __name__ == "__main__":
    main()
