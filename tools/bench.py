"""Cost of SEED, OPID and GRSD against GRPO, measured in one invocation (GRSD Table 6 reports s/update ratios).

  python -m tools.bench                                                  # household, offline tiny model, 5 rounds
  python -m tools.bench --env alfworld --data_dir ../shared/data/alfworld --env_workers 2 --rounds 6 --out runs/bench_alfworld
  python -m tools.bench --smoke                                          # 1 round, tiny settings (what CI runs)
  python -m tools.bench --lora_rank 8                                    # also each method with LoRA (issue 57)

1. An endpoint: tools/oracle.py's oracle, an OpenAI-compatible HTTP server on localhost, plays SEED's stage-1
   annotator, OPID's analyzer and GRSD's judge (on ALFWorld it cannot replay the game and answers from the task line:
   still well-formed, so OPID's teacher and GRSD's judge still run).
2. A shared start: SEED's own stage 1 (seed.py: the policy's rollouts annotated by the oracle, hindsight-skill SFT)
   gives θ_sft. Every method starts from it, so all four see the same weights, tokenizer and reference policy, and
   SEED's stage-2 analyzer can write skills that parse (a random policy's never do; in one check, 30 SFT epochs on
   32 oracle skills, half of the stage-2 skills parsed).
3. Rounds: in round r every method runs one update from θ_sft with seed r (seed.py / opid.py / grsd.py in a fresh
   run each; the order is rotated from round to round), with the same env, tasks, lengths and micro-batching. Same
   weights and seed, so the four runs of a round roll out the same trajectories (the report checks the token
   counts): rollout and scoring are the same work, and the difference of two totals is the method's own work plus
   timing noise, not a drift of the policies apart. GRPO is seed.py --skip_sft --lambda_opd 0; SEED is seed.py
   --skip_sft (stage 2, Alg. 1); OPID and GRSD use the oracle.
4. Full-batch decoding (`calibrate`), timed on θ_sft in this process after the rounds, at the mean context of
   GRPO's rollout turns and of each method's generation outside rollouts: seconds per decoded token when every row
   of a batch decodes. It is the engine's throughput without lock-step waste (HF generate steps finished rows until
   the longest ends) or small late batches, which a continuous-batching engine (vLLM) avoids.
5. Report (from each run's metrics.jsonl; save and eval excluded): seconds per update by phase, × GRPO, the rollout
   split into generation and environment, padding, and each method's unavoidable extra work priced at GRPO's
   throughput measured in the same invocation (GRPO's rates, seconds per real token: a no-grad forward = its
   scoring time over its ℓ_old and ℓ_ref passes; a training forward + backward = its update time over one pass; a
   decode step = its rollout generation time, less its prompts' prefill priced as no-grad forward, per token):
       scored    perf/teacher_tokens × forward  +  perf/reflection_tokens (GRSD, Eq. 14) × (forward + training)
       generate  prompt tokens read outside rollouts (the analysis / reflection prompts: prefill) × forward
                 + tokens generated outside rollouts × decode
       endpoint  the seconds of the phases that wait on the endpoint (OPID analysis, GRSD judge)
   and extra / unavoidable, where extra = the method's seconds per update − GRPO's in the same round (± its standard
   deviation over the rounds); the method's own phases (analysis, reflection, judge, guidance, teacher: the work
   GRPO does not do, timed alone) over the same unavoidable cost; and, stricter, the own phases over the price with
   a decoded token at the full-batch rate of step 4 at its mean context (the remainder is lock-step waste and the
   Python around the engine). (GRSD's reflection scoring and training run inside its scoring and update phases: in
   `extra` only.) Mean lengths come from the runs' counts (perf/prompts, perf/rollout_turns, perf/teacher_seqs).

6. With --lora_rank R, every round also runs each method with --lora_rank R (the same seed, weights and flags), and
   the report adds LoRA's seconds per update against full fine-tuning's, per method and for the update phase alone.

Deviations / choices:
  * The policies are small and untrained (the tiny model after stage 1 on a few tasks): no rollout wins, so GRSD's
    groups are never mixed and its guidance and teacher do not run here, and its reflections rarely parse (then the
    judge is not asked). The table reports what each method did (teacher tokens, generated tokens) next to its time.
  * The endpoint runs in this process (a thread) and shares the CPU with the runs.
  * Each update runs in a fresh process: process start and model loading are outside time/total; the first update
    of a process may carry some warm-up, alike for every method. Every round measures a first update from θ_sft
    (Table 6 averages over training); on these untrained policies later updates do the same work.
"""
from __future__ import annotations

if not __package__:  # run by its file path: the checkout's modules (envs, models, …) are not importable then
    raise SystemExit('run tools/bench.py as a module, from the checkout root: python -m tools.bench')

import argparse
import bisect
import json
import os
import subprocess
import sys
import time

import torch

import models
from tools import experiment, oracle

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

METHODS = ("grpo", "seed", "opid", "grsd")
PHASES = ("sync", "rollout", "analysis", "reflection", "judge", "guidance", "scoring", "teacher", "update")
ENDPOINT_PHASES = {"opid": "analysis", "grsd": "judge"}
OWN_PHASES = ("analysis", "reflection", "judge", "guidance", "teacher")  # what GRPO does not run (timed alone)


def settings(a) -> dict:
    """What every run shares (the tiny-model counterpart of Table 5; the paper's lr, KL and coefficients)."""
    return dict(env=a.env, env_rules="verl_agent", tasks_per_update=a.tasks, group_size=a.group,
                max_steps=a.max_steps, max_prompt_len=1024, max_response_len=48, micro_batch=16, minibatch_turns=256,
                eval_every=0, engine="hf", env_workers=a.env_workers,
                **({"data_dir": a.data_dir} if a.data_dir else {}))


def method_flags(method: str, url: str) -> tuple[str, dict, list[str]]:
    """(script, the method's own flags, switches)."""
    return {
        "grpo": ("seed.py", {"lambda_opd": 0}, ["--skip_sft"]),
        "seed": ("seed.py", {"annotator_max_tokens": 128}, ["--skip_sft"]),  # the oracle-taught skills: 78-85 tokens
        "opid": ("opid.py", {"analyzer_url": url, "analyzer_model": "oracle", "analyzer_max_tokens": 256}, []),
        "grsd": ("grsd.py", {"judge_url": url, "judge_model": "oracle", "reflection_max_tokens": 48,
                             "reflection_prompt_len": 2048, "guidance_max_tokens": 256}, []),
    }[method]


def argv(script: str, flags: dict, switches: list[str]) -> list[str]:
    return [sys.executable, script] + [x for k, v in flags.items() for x in (f"--{k}", str(v))] + switches


def run(cmd: list[str], log: str, threads: int) -> float:
    """One script run, its output to `log`; stops the benchmark on failure. Returns its wall seconds."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    t0 = time.time()
    with open(log, "a") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                            cwd=ROOT).returncode
    if rc != 0:
        with open(log) as f:
            raise SystemExit(f"[bench] {' '.join(cmd[1:3])} failed (exit {rc}); {log} ends:\n{f.read()[-3000:]}")
    return time.time() - t0


def lora_table(out: str, rank: int) -> tuple[str, dict]:
    """LoRA (--lora_rank rank) against full fine-tuning, per method: seconds per update and of its update phase."""
    lines = [f"| method | s/update full | s/update LoRA r={rank} | LoRA / full | update phase full | update phase "
             f"LoRA | LoRA / full |", "|---|---|---|---|---|---|---|"]
    summary = {}
    for m in METHODS:
        full, lora = update_rows(out, m), update_rows(out, f"{m}-lora")
        a, b = per_update(full), per_update(lora)
        ua, ub = mean(full, "time/update"), mean(lora, "time/update")
        summary[m] = {"full_s": a, "lora_s": b, "update_full_s": ua, "update_lora_s": ub}
        lines.append(f"| {m} | {a:.2f} | {b:.2f} | {b / a:.2f}× | {ua:.2f} | {ub:.2f} | {ub / ua:.2f}× |")
    return "\n".join(lines), summary


def round_dir(out: str, method: str, r: int) -> str:
    return os.path.join(out, method, f"round{r}")


def update_rows(out: str, method: str) -> list[dict]:
    """The method's update rows, one per round, in round order."""
    rounds = sorted(int(n[5:]) for n in os.listdir(os.path.join(out, method)) if n.startswith("round"))
    return [r for k in rounds for r in experiment.read_rows(round_dir(out, method, k)) if "update" in r]


def mean(rows: list[dict], key: str) -> float:
    return sum(r.get(key, 0.0) for r in rows) / max(len(rows), 1)


def per_update(rows: list[dict]) -> float:
    """Seconds per update without checkpointing (every bench run saves every update, to resume)."""
    return mean(rows, "time/total") - mean(rows, "time/save")


def rates(grpo: list[dict]) -> dict:
    """GRPO's measured seconds per real token (module docstring): a no-grad forward (scoring: ℓ_old and ℓ_ref are
    two of its three equal passes), a training forward + backward (the third), and one decode step of generation,
    which is the rollout's generation time less its prompts' prefill priced as a no-grad forward."""
    real = max(1 - mean(grpo, "perf/padding_frac"), 1e-6)
    per_pass = max(mean(grpo, "perf/forward_tokens") / 3, 1) * real
    score = mean(grpo, "time/scoring") / (2 * per_pass)
    prefill = mean(grpo, "perf/rollout_prompt_tokens") * score
    decode = max(mean(grpo, "time/rollout_generation") - prefill, 0.0) / max(mean(grpo, "perf/rollout_gen_tokens"), 1)
    return {"score": score, "train": mean(grpo, "time/update") / per_pass, "decode": decode}


def lengths(rows: list[dict]) -> dict:
    """Mean lengths in tokens: a teacher sequence; outside rollouts (analysis / reflection) a prompt, and the context
    a decoded token sees (its prompt + half of what is written); the same context for a rollout turn."""
    turns = max(mean(rows, "perf/rollout_turns"), 1)
    n_x = max(mean(rows, "perf/prompts") - mean(rows, "perf/rollout_turns"), 1)
    read_x = (mean(rows, "perf/prompt_tokens") - mean(rows, "perf/rollout_prompt_tokens")) / n_x
    gen_x = (mean(rows, "perf/generated_tokens") - mean(rows, "perf/rollout_gen_tokens")) / n_x
    return {"teacher": mean(rows, "perf/teacher_tokens") / max(mean(rows, "perf/teacher_seqs"), 1),
            "prompt": read_x, "decode_context": read_x + gen_x / 2,
            "rollout_decode_context": (mean(rows, "perf/rollout_prompt_tokens") +
                                       mean(rows, "perf/rollout_gen_tokens") / 2) / turns}


def price(method: str, rows: list[dict], grpo: list[dict], decode_s: float | None = None) -> dict:
    """The method's unavoidable extra seconds per update at GRPO's measured throughput (module docstring); a decoded
    token at `decode_s` seconds instead of GRPO's rollout rate when given (the full-batch rate of `calibrate`)."""
    r = rates(grpo)
    teacher_tok, refl_tok = mean(rows, "perf/teacher_tokens"), mean(rows, "perf/reflection_tokens")
    extra_gen = mean(rows, "perf/generated_tokens") - mean(rows, "perf/rollout_gen_tokens")
    extra_read = mean(rows, "perf/prompt_tokens") - mean(rows, "perf/rollout_prompt_tokens")
    teacher = teacher_tok * r["score"] + refl_tok * (r["score"] + r["train"])
    generate = extra_read * r["score"] + extra_gen * (r["decode"] if decode_s is None else decode_s)
    endpoint = mean(rows, f"time/{ENDPOINT_PHASES[method]}") if method in ENDPOINT_PHASES else 0.0
    return {"teacher_s": teacher, "generate_s": generate, "endpoint_s": endpoint,
            "unavoidable_s": teacher + generate + endpoint, "teacher_tokens": teacher_tok,
            "reflection_tokens": refl_tok, "extra_gen_tokens": extra_gen, "extra_prompt_tokens": extra_read}


def at(points: list[list[float]], x: float) -> float:
    """A measured curve [[context, seconds per token], ...] at x: linear through the two nearest points (beyond the
    ends, through the two end points)."""
    pts = sorted(points)
    if len(pts) == 1:
        return pts[0][1]
    i = min(max(bisect.bisect_left([p[0] for p in pts], x), 1), len(pts) - 1)
    (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def decode_contexts(out: str) -> list[int]:
    """Where `calibrate` times decoding: GRPO's rollout turns, and each method's generation outside rollouts."""
    rows = {m: update_rows(out, m) for m in METHODS}
    ctx = [lengths(rows["grpo"])["rollout_decode_context"]] + [  # + SEED's analyses, GRSD's reflections
        lengths(rs)["decode_context"] for rs in rows.values()
        if mean(rs, "perf/generated_tokens") > mean(rs, "perf/rollout_gen_tokens")]
    return sorted({round(c) for c in ctx if c > 0})


def calibrate(model_dir: str, contexts: list[int], rows: int, new: int = 64, repeats: int = 3) -> dict:
    """Full-batch decoding of the start θ_sft, timed in this process (best of `repeats`): the seconds per decoded
    token at context C when all `rows` rows decode, = (generate(new + 1 tokens) − generate(1 token)) / (rows · new)
    on prompts of C − new/2 tokens, sampled as HFEngine samples, with min_new_tokens so no row stops early. The
    engine's throughput without lock-step waste (rows that finished but still step) or small batches."""
    tok, model = models.load_tokenizer(model_dir), models.load_model(model_dir, seed=0).eval().requires_grad_(False)
    g = torch.Generator().manual_seed(0)

    def seconds(x: torch.Tensor, k: int) -> float:
        t0 = time.perf_counter()
        model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=k, min_new_tokens=k,
                       do_sample=True, top_k=0, repetition_penalty=1.0, pad_token_id=tok.pad_token_id)
        return time.perf_counter() - t0

    points = []
    for c in contexts:
        x = torch.randint(len(tok), (rows, max(c - new // 2, 1)), generator=g)
        steps, first = (min(seconds(x, k) for _ in range(repeats)) for k in (new + 1, 1))
        points.append([c, (steps - first) / (rows * new)])
    return {"decode": points, "rows": rows, "new_tokens": new}


def paired_spread(rows: list[dict], grpo: list[dict]) -> float:
    """Standard deviation over rounds of (the method's s/update − GRPO's) in the same round: the run-to-run noise."""
    diffs = [(a["time/total"] - a.get("time/save", 0)) - (b["time/total"] - b.get("time/save", 0))
             for a, b in zip(rows, grpo)]
    m = sum(diffs) / max(len(diffs), 1)
    return (sum((x - m) ** 2 for x in diffs) / (len(diffs) - 1)) ** 0.5 if len(diffs) > 1 else 0.0


def same_rollouts(rows: list[dict], grpo: list[dict]) -> int:
    """Rounds whose rollouts read and wrote exactly GRPO's token counts (same weights and seed: same trajectories)."""
    keys = ("perf/rollout_prompt_tokens", "perf/rollout_gen_tokens")
    return sum(all(a.get(k) == b.get(k) for k in keys) for a, b in zip(rows, grpo))


def report(out: str, cal: dict | None = None) -> tuple[str, dict]:
    """The table (markdown) and its numbers; with a calibration (`calibrate`) also the own phases over their price
    at full-batch decoding."""
    rows = {m: update_rows(out, m) for m in METHODS}
    base = per_update(rows["grpo"])
    phases = [p for p in PHASES if any(f"time/{p}" in r for rs in rows.values() for r in rs)]
    head = ["method", "updates"] + [f"{p}" for p in phases] + [
        "rollout gen / env", "padding", "s/update", "× GRPO", "extra s (± sd)", "unavoidable s",
        "extra / unavoidable", "own phases s", "own / unavoidable", "own / unavoidable at full-batch decode"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    summary = {}
    for m in METHODS:
        rs = rows[m]
        total = per_update(rs)
        cells = [m, str(len(rs))] + [f"{mean(rs, f'time/{p}'):.2f}" if any(f"time/{p}" in r for r in rs) else "–"
                                     for p in phases]
        cells += [f"{mean(rs, 'time/rollout_generation'):.2f} / {mean(rs, 'time/rollout_env'):.2f}",
                  f"{mean(rs, 'perf/padding_frac'):.1%}", f"{total:.2f}", f"{total / base:.2f}×"]
        summary[m] = {"s_per_update": total, "x_grpo": total / base}
        if m == "grpo":
            cells += ["–"] * 6
        else:
            p = price(m, rs, rows["grpo"])
            full = price(m, rs, rows["grpo"], at(cal["decode"], lengths(rs)["decode_context"])) if cal else p
            extra, spread = total - base, paired_spread(rs, rows["grpo"])
            summary[m].update(p, extra_s=extra, extra_sd=spread, extra_over_unavoidable=extra / p["unavoidable_s"]
                              if p["unavoidable_s"] > 0 else None)
            own = sum(mean(rs, f"time/{q}") for q in OWN_PHASES)
            summary[m].update(own_s=own, same_rollouts=same_rollouts(rs, rows["grpo"]), lengths=lengths(rs),
                              unavoidable_full_batch_s=full["unavoidable_s"])
            ratio, own_ratio, own_full = (f"{x / u:.2f}" if u > 0 else "–" for x, u in (
                (extra, p["unavoidable_s"]), (own, p["unavoidable_s"]), (own, full["unavoidable_s"])))
            cells += [f"{extra:.2f} ± {spread:.2f}", f"{p['unavoidable_s']:.2f} (scored {p['teacher_s']:.2f}, "
                      f"generate {p['generate_s']:.2f}, endpoint {p['endpoint_s']:.2f})", ratio, f"{own:.2f}",
                      own_ratio, own_full if cal else "–"]
        lines.append("| " + " | ".join(cells) + " |")
    r, ctx = rates(rows["grpo"]), lengths(rows["grpo"])["rollout_decode_context"]
    work = ["", f"GRPO's rates, ms per token: no-grad forward {1e3 * r['score']:.4f}, training forward + backward "
            f"{1e3 * r['train']:.4f}, decode {1e3 * r['decode']:.3f} (its rollout turns, mean context {ctx:.0f})."]
    if cal:
        work += ["", f"Full-batch decode, ms per token ({cal['rows']} rows all decoding, θ_sft, by context): " +
                 ", ".join(f"{x:.0f}: {1e3 * y:.3f}" for x, y in cal["decode"]) +
                 f". GRPO's rollout decodes at {r['decode'] / at(cal['decode'], ctx):.1f}× the full-batch cost."]
    work += ["",
            "| method | teacher tokens | reflection tokens (scored + trained) | prompt tokens read outside rollouts | "
            "tokens generated outside rollouts | mean lengths: teacher, prompt outside rollouts | "
            "rounds with GRPO's rollouts | signal |", "|---|---|---|---|---|---|---|---|"]
    signal = {"grpo": "–", "seed": "skills/valid_rate", "opid": "analyzer/parsed_frac",
              "grsd": "guidance/active_groups"}
    for m in METHODS:
        rs = rows[m]
        key = signal[m]
        sig = f"{key} {mean(rs, key):.2f}" if key != "–" else "–"
        if m == "grsd":
            sig += f", reflection/valid_rate {mean(rs, 'reflection/valid_rate'):.2f}"
        work.append(f"| {m} | {mean(rs, 'perf/teacher_tokens'):.0f} | {mean(rs, 'perf/reflection_tokens'):.0f} | "
                    f"{mean(rs, 'perf/prompt_tokens') - mean(rs, 'perf/rollout_prompt_tokens'):.0f} | "
                    f"{mean(rs, 'perf/generated_tokens') - mean(rs, 'perf/rollout_gen_tokens'):.0f} | "
                    f"{lengths(rs)['teacher']:.0f}, {lengths(rs)['prompt']:.0f} | "
                    f"{same_rollouts(rs, rows['grpo'])}/{len(rs)} | {sig} |")
    return "\n".join(lines + work), summary


def main(argv_=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", default="household", choices=("household", "alfworld", "webshop", "search"))
    p.add_argument("--data_dir", default=None, help="benchmark data (alfworld, webshop, search)")
    p.add_argument("--out", default="runs/bench", help="bench folder [default: runs/bench]")
    p.add_argument("--rounds", type=int, default=5, help="updates per method, alternated [default: 5]")
    p.add_argument("--tasks", type=int, default=4, help="tasks per update [default: 4]")
    p.add_argument("--group", type=int, default=4, help="rollouts per task [default: 4]")
    p.add_argument("--max_steps", type=int, default=6, help="episode step limit [default: 6]")
    p.add_argument("--env_workers", type=int, default=0, help="env worker processes per run [default: 0]")
    p.add_argument("--sft_epochs", type=int, default=30, help="SEED stage-1 SFT epochs of the shared start "
                   "[default: 30: the tiny model then writes skills that parse]")
    p.add_argument("--threads", type=int, default=2, help="torch threads per run [default: 2]")
    p.add_argument("--smoke", action="store_true", help="1 round, 2 tasks x 2 rollouts, 3 steps, 2 SFT epochs")
    p.add_argument("--lora_rank", type=int, default=0, help="also run every method with --lora_rank R each round "
                   "and report LoRA against full fine-tuning [default: 0: full fine-tuning alone]")
    a = p.parse_args(argv_)
    if a.smoke:
        a.rounds, a.tasks, a.group, a.max_steps, a.sft_epochs = 1, 2, 2, 3, 2
    os.makedirs(a.out, exist_ok=True)
    served = oracle.Oracle((0,))
    server = oracle.serve_oracle(served)
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    shared = settings(a)
    start = os.path.join(a.out, "start")
    t0 = time.time()
    # 2. the shared start: SEED's stage 1 (its one update is not part of the comparison)
    sft = dict(shared, model="tiny", seed=0, out_dir=start, updates=1, annotator_url=url, annotator_model="oracle",
               annotator_max_tokens=48, sft_tasks=2 * a.tasks, sft_rollouts=a.group, sft_lr=3e-3,
               sft_epochs=a.sft_epochs, sft_batch=8)
    secs = run(argv("seed.py", sft, ["--overwrite"]), os.path.join(a.out, "start.log"), a.threads)
    print(f"[bench] shared start (SEED stage 1) in {secs:.0f} s: {start}/stage1", flush=True)
    model = os.path.join(start, "stage1")
    # 3. rounds: every method one update from θ_sft with the round's seed, the order rotated
    for r in range(a.rounds):
        for k in range(len(METHODS)):
            m = METHODS[(r + k) % len(METHODS)]
            script, own, switches = method_flags(m, url)
            flags = dict(shared, **own, model=model, seed=r, out_dir=round_dir(a.out, m, r), updates=1)
            secs = run(argv(script, flags, switches + ["--overwrite"]), os.path.join(a.out, f"{m}.log"), a.threads)
            print(f"[bench] round {r + 1}/{a.rounds} {m}: {secs:.0f} s (process)", flush=True)
            if a.lora_rank:  # the same update with LoRA adapters (π_ref: the adapters off)
                flags.update(lora_rank=a.lora_rank, out_dir=round_dir(a.out, f"{m}-lora", r))
                secs = run(argv(script, flags, switches + ["--overwrite"]), os.path.join(a.out, f"{m}-lora.log"),
                           a.threads)
                print(f"[bench] round {r + 1}/{a.rounds} {m} LoRA r={a.lora_rank}: {secs:.0f} s (process)", flush=True)
    server.shutdown()
    # 4. full-batch decoding at the contexts of the priced generation, on θ_sft, in this process
    torch.set_num_threads(a.threads)
    cal = calibrate(model, decode_contexts(a.out), rows=a.tasks * a.group)
    text, summary = report(a.out, cal)
    if a.lora_rank:
        table, lora = lora_table(a.out, a.lora_rank)
        text += "\n\n" + table
        summary = {**summary, "lora": lora}
    with open(os.path.join(a.out, "bench.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(a.out, "bench.json"), "w") as f:
        json.dump({"settings": shared, "rounds": a.rounds, "threads": a.threads, "calibration": cal,
                   "oracle": served.stats, "wall_s": time.time() - t0, "methods": summary}, f, indent=1)
    print(text)
    print(f"[bench] {time.time() - t0:.0f} s; oracle {dict(sorted(served.stats.items()))}; wrote {a.out}/bench.md, "
          f"bench.json")


if __name__ == "__main__":
    main()
