"""The papers' mechanism, measured directly and without training: does the skill signal credit the right turns?

  python -m tools.experiment mechanism    # on runs/experiment/backbone -> docs/results/mechanism.{json,md}
  (python -m tools.experiment --smoke runs it on 2 tasks x 2 rollouts of a 4-step backbone; tests/test_mechanism.py checks
  the measures by hand and one measurement on scripted trajectories against an independent recomputation)

A fixed batch of backbone rollouts on household train tasks (layout seed MECH_SEED, which no run trains or evaluates
on) is labelled turn by turn with the env's privileged ground truth (HouseholdEnv.turn_is_good: a good turn keeps
the task on a shortest completion, a bad one wastes the step). Then, for each method and each skill source, the
per-turn credit the method would apply in its first mini-batch (θ = θ_old) is computed with the method's own code:

  GRPO          A = (R − μ)/(σ + ε), identical for every turn of a trajectory (seed.group_advantages)
  SEED          the coefficient on ∇ℓ_θ per token, A + λ_opd·σ(β_opd Δ), Eq. (1) at θ = θ_old (seed.build_samples)
  SDAR          the same with a library skill (SEED's Eq. (1), static library, teacher θ_old)
  OPID          A_OPID = A_ep + λ_skill (ℓ_skill − ℓ_old), critical-first routing (opid.build_samples, opid_advantages)
  GRSD          Â = A (1 + λ q̂ m_x), Eq. (9)-(11) (grsd.build_samples, grsd.turn_advantages)
  RLSD          Â_t = A ((1 − λ_t) + λ_t w_t) at update 1 (baselines.rlsd_advantages), library skill

with Δ = ℓ_skill − ℓ_old per token: the log-prob of the same sampled token with and without the skill in context.
A turn's credit is its tokens' mean. Skill sources: `oracle` (the experiment's oracle endpoint over HTTP, answering
SEED's analyzer and OPID's analyzer prompts; for GRSD its reflections, judge scores and DO/AVOID guidance), `policy`
(the backbone analyzes / reflects / writes guidance itself; the oracle judges GRSD's reflections, as in the runs),
`library` (skills/alfworld.jsonl retrieved by task family; GRSD gets it as z_x of its mixed groups).

Reported per method and source: within-trajectory AUC (the probability that a good turn gets more credit than a bad
turn of the same trajectory, ties 1/2, pooled over all such pairs) inside failed and inside successful trajectories;
the mean Δ in nats per token on good and on bad turns, action tokens (from </think> on) apart from <think> tokens;
the fraction of labelled turns whose credit sign agrees with the ground truth (good > 0, bad < 0; 0 agrees with
neither); and the share of turns that got a skill at all. The gate (issue 25): the Δ-AUC within trajectories of the
oracle skills is >= 0.75 for SEED, OPID and GRSD.
"""
from __future__ import annotations

if not __package__:  # run by its file path: the checkout's modules (envs, models, …) are not importable then
    raise SystemExit("tools/mechanism.py is part of the learning experiment, not a command: from the checkout "
                     "root, run `python -m tools.experiment mechanism`")

import json
import random
import time
from collections import Counter

import envs

MECH_SEED = 7          # household layout seed of the measured rollouts (the runs use 0-4, the dev probes 100-101)
SOURCES = ("oracle", "policy", "library")
# OPID with the policy as its own analyzer is not a row: the backbone is never taught OPID's JSON analysis, and the
# measurement before stage 2 (docs/experiment.md) parsed 0 of 256 analyses in 1,475 s, half the whole measurement.
ROWS = (("GRPO", "-"), ("SEED", "oracle"), ("SEED", "policy"), ("SDAR", "library"), ("OPID", "oracle"),
        ("OPID", "library"), ("GRSD", "oracle"), ("GRSD", "policy"), ("GRSD", "library"), ("RLSD", "library"))
GATE = 0.75


# ------------------------------------------------------------------------------------------------------------------
# The measures: within-trajectory AUC, sign agreement, Δ per token class
# ------------------------------------------------------------------------------------------------------------------

def within_auc(signal: list[float], good: list[bool], traj: list[int]) -> tuple[float | None, int]:
    """P(signal of a good turn > signal of a bad turn of the SAME trajectory), ties count 1/2, pooled over every
    (good, bad) pair of every trajectory. Returns (AUC or None without pairs, number of pairs)."""
    by: dict[int, tuple[list, list]] = {}
    for s, g, t in zip(signal, good, traj):
        by.setdefault(t, ([], []))[0 if g else 1].append(s)
    wins, pairs = 0.0, 0
    for goods, bads in by.values():
        for a in goods:
            for b in bads:
                wins += 1.0 if a > b else 0.5 if a == b else 0.0
                pairs += 1
    return (wins / pairs if pairs else None), pairs


def sign_agreement(credit: list[float], good: list[bool]) -> float | None:
    """Fraction of turns with credit > 0 when good and < 0 when bad (a credit of exactly 0 agrees with neither)."""
    if not credit:
        return None
    return sum((c > 0) if g else (c < 0) for c, g in zip(credit, good)) / len(credit)


def action_start(tok, response_ids: list[int]) -> int:
    """Index of the first action token: the token after the one that completes "</think>" (len: no </think>)."""
    for k in range(1, len(response_ids) + 1):
        if "</think>" in tok.decode(response_ids[:k], skip_special_tokens=True):
            return k
    return len(response_ids)


# ------------------------------------------------------------------------------------------------------------------
# Ground truth and rollouts
# ------------------------------------------------------------------------------------------------------------------

def label_turns(trajs, make_env) -> list[list[bool]]:
    """Replay every trajectory in a fresh env: good/bad for each turn (HouseholdEnv.turn_is_good) before stepping it
    with the reply the policy wrote; the replay must show the observations the rollout saw."""
    labels = []
    for tr in trajs:
        env, out = make_env(), []
        env.reset(tr.task_id)
        for turn in tr.turns:
            command = envs.parse_action(turn.response_text, env.tags, env.admissible())[0]
            out.append(env.turn_is_good(command))
            obs = env.step(turn.response_text)[0]
            if obs != turn.observation:
                raise RuntimeError(f"{tr.task_id}: the replay diverged from the rollout at turn {len(out)}")
        labels.append(out)
    return labels


# ------------------------------------------------------------------------------------------------------------------
# Each method's per-token credit at θ = θ_old, through its own functions
# ------------------------------------------------------------------------------------------------------------------

def method_args(room: str, max_prompt: int, max_response: int, micro_batch: int):
    """The three methods' Args at their paper coefficients, with this experiment's lengths."""
    import grsd
    import opid
    import seed
    shared = dict(env="household", household_room=room, max_prompt_len=max_prompt, max_response_len=max_response,
                  micro_batch=micro_batch, micro_batch_tokens=micro_batch * (max_prompt + max_response))
    return (seed.Args(**shared, annotator_max_tokens=128),
            opid.Args(**shared, analyzer_max_tokens=256, max_critical=5),
            grsd.Args(**shared, reflection_max_tokens=128, reflection_prompt_len=2048, beta_kl=0.01))


def teacher_samples(method: str, source: str, trajs, engine, tok, sa, oa, ga, oracle_url: str | None, lib,
                    replay_env):
    """The method's samples (one per turn, in trajectory order) with their teacher prompts for this source, and what
    the analysis produced. GRSD's samples come with its group advantages A_i. replay_env: the privileged env the
    oracle's GRSD texts are written from."""
    import baselines
    import grsd
    import harness
    import opid
    import seed
    from tools import oracle as X
    client = (lambda role: harness.ChatClient(oracle_url, "oracle", role, 60.0, 0)) if oracle_url else None
    info = Counter()
    if method in ("SEED", "SDAR", "RLSD"):
        if source == "library":
            skills, header = [baselines.retrieve_skill(lib, tr.family) for tr in trajs], seed.LIBRARY_HEADER
        else:
            skills, header = seed.analyze(trajs, engine, sa, client("annotator") if source == "oracle"
                                          else None), seed.HINDSIGHT_HEADER
        info["skills"] = sum(s is not None for s in skills)
        return seed.build_samples(trajs, skills, tok, sa, header)[0], info
    if method == "OPID":
        if source == "library":
            analyses = [opid.Analysis(baselines.retrieve_skill(lib, tr.family)) for tr in trajs]
        else:
            analyses, events = opid.analyze(trajs, engine, oa, client("analyzer") if source == "oracle" else None)
            info.update({f"analysis_{k}": v for k, v in events.items()})
        info["skills"] = sum(a is not None for a in analyses)
        samples, _, routes = opid.build_samples(trajs, analyses, tok, oa)
        info.update({f"route_{k}": v for k, v in routes.items()})
        return samples, info
    # GRSD: reflections s_i, judge scores, m_x and z_x per group (Alg. 1 l.6-16), then the turn samples
    timer = harness.Timer()
    adv = grsd.group_norm(trajs, [tr.reward for tr in trajs], ga.eps_adv)
    if source == "policy":
        refl = grsd.reflect_and_judge(trajs, engine, ga, client("judge"), timer)
        mixed, guidance, empty = grsd.group_guidance(trajs, refl[2], refl[3], engine, ga, timer)
        info["empty_guidance"] = empty
    else:  # oracle: its reflections, scores and DO/AVOID guidance from the replayed facts; library: the skill as z_x
        oracle_facts = [X.replay(replay_env, tr.task_id, [t.action if t.valid else None for t in tr.turns])[0]
                        for tr in trajs]
        refl = ([[]] * len(trajs), [[]] * len(trajs), [X.reflection(f) for f in oracle_facts],  # true by making:
                [3] * len(trajs))                                                               # all valid (not ⊥)
        groups = sorted({tr.group for tr in trajs})
        mixed = {g: len({tr.won for tr in trajs if tr.group == g}) == 2 for g in groups}
        guidance = {}
        for g in groups:
            members = [(tr, f) for tr, f in zip(trajs, oracle_facts) if tr.group == g]
            if not mixed[g]:
                guidance[g] = None
            elif source == "oracle":
                guidance[g] = X.guidance(members[0][0].task, [f for tr, f in members if tr.won],
                                         [f for tr, f in members if not tr.won])
            else:
                guidance[g] = baselines.retrieve_skill(lib, members[0][0].family)
    info.update({f"seconds_{k}": round(v, 1) for k, v in timer.s.items()})
    info["reflections"] = sum(r is not None for r in refl[2])
    info["judged"] = sum(s is not None for s in refl[3])
    info["mixed_groups"] = sum(map(bool, mixed.values()))
    info["guided_groups"] = sum(z is not None for z in guidance.values())
    ga.alpha = 0.0  # the reflection samples are not turn credit
    return grsd.build_samples(trajs, adv, refl, guidance, tok, ga)[0], info


def credits(method: str, samples, old, tea, sa, oa, ga):
    """Per-token credit of every turn: the coefficient of ∇ℓ_θ at θ = θ_old (clip inactive, ρ = 1)."""
    import torch
    import baselines
    import grsd
    import opid
    if method == "GRPO":
        return [torch.full_like(o, s.adv) for s, o in zip(samples, old)]
    if method in ("SEED", "SDAR"):  # L_rl's A plus L_opd's λ_opd σ(β_opd Δ) where the turn has a skill (Eq. 1)
        return [o.new_full(o.shape, s.adv) + (sa.lambda_opd * torch.sigmoid(sa.beta_opd * (t - o)) if t is not None
                                              else 0.0) for s, o, t in zip(samples, old, tea)]
    if method == "OPID":  # Alg. 1 l.20-22
        out = []
        for s, o, t in zip(samples, old, tea):
            has = torch.tensor([[1.0 if t is not None else 0.0]])
            a_opid, _, _ = opid.opid_advantages(torch.tensor([s.a_ep]), o[None], (t if t is not None else o)[None],
                                                torch.ones(1, len(o)), has, oa.lambda_skill)
            out.append(a_opid[0])
        return out
    if method == "GRSD":  # Eq. (9)-(11)
        return grsd.turn_advantages(samples, old, [t if t is not None else o for o, t in zip(old, tea)], ga)[0]
    lam = baselines.rlsd_lambda_at(0, 0.5, 100)  # RLSD at update 1, the SDAR code's λ_0 = 0.5, W = 100
    return [baselines.rlsd_advantages(s.adv, o, t, lam, 0.2) for s, o, t in zip(samples, old, tea)]


# ------------------------------------------------------------------------------------------------------------------
# The measurement
# ------------------------------------------------------------------------------------------------------------------

def summarize(turn_rows: list[dict], method: str) -> dict:
    """One table row from per-turn records {traj, won, good, credit, delta, d_act, n_act, d_think, n_think}."""
    out = {}
    for name, key in (("credit", "credit"), ("delta", "delta")):
        rows = [r for r in turn_rows if r[key] is not None]
        for part, keep in (("failed", False), ("successful", True)):
            sub = [r for r in rows if r["won"] == keep]
            auc, pairs = within_auc([r[key] for r in sub], [r["good"] for r in sub], [r["traj"] for r in sub])
            out[f"{name}_auc_{part}"], out[f"{name}_pairs_{part}"] = auc, pairs
        auc, pairs = within_auc([r[key] for r in rows], [r["good"] for r in rows], [r["traj"] for r in rows])
        out[f"{name}_auc"], out[f"{name}_pairs"] = auc, pairs
    taught = [r for r in turn_rows if r["delta"] is not None]
    for label, g in (("good", True), ("bad", False)):
        for part in ("act", "think"):
            sel = [r for r in taught if r["good"] == g]
            n = sum(r[f"n_{part}"] for r in sel)
            out[f"delta_{label}_{part}"] = sum(r[f"d_{part}"] for r in sel) / n if n else None
    out["sign_agreement"] = sign_agreement([r["credit"] for r in turn_rows], [r["good"] for r in turn_rows])
    out["delta_sign_agreement"] = sign_agreement([r["delta"] for r in taught], [r["good"] for r in taught])
    out["coverage"] = len(taught) / max(len(turn_rows), 1)
    out["turns"], out["good_turns"] = len(turn_rows), sum(r["good"] for r in turn_rows)
    return out


def mech_env(room: str, max_steps: int):
    """The factory of the measured rollouts' envs: household train tasks of layout seed MECH_SEED."""
    return lambda: envs.HouseholdEnv("train", seed=MECH_SEED, max_steps=max_steps, room=room)


def rollouts(policy, tok, n_tasks: int, group: int, max_steps: int, room: str, seed: int = 0, max_prompt: int = 1024,
             max_response: int = 80, log=print):
    """The fixed batch: `group` rollouts of each of the first n_tasks tasks at the training temperature (1.0)."""
    import torch
    import common as C
    import models
    t0, make = time.time(), mech_env(room, max_steps)
    engine = models.HFEngine(policy, tok, torch.device("cpu"))
    torch.manual_seed(seed)
    random.seed(seed)
    trajs, _ = C.collect(engine, make, make().task_ids()[:n_tasks], group, max_prompt, max_response, 1.0, 1.0)
    log(f"[mechanism] {len(trajs)} rollouts, success {sum(t.won for t in trajs) / len(trajs):.3f} "
        f"({time.time() - t0:.0f} s)")
    return trajs


def measure(policy, tok, trajs, labels, room: str, oracle_url: str | None, library_path: str, max_prompt: int = 1024,
            max_response: int = 80, micro_batch: int = 16, rows=ROWS, keep_turns: bool = False, log=print) -> dict:
    """Every (method, source) of `rows` on labelled trajectories: {"rows": [...], "rollouts": {...}}; keep_turns adds
    each row's per-turn records (traj, won, good, credit, delta, ...)."""
    import torch
    import baselines
    import common as C
    import models
    import seed as S
    t0 = time.time()
    replay_env = envs.HouseholdEnv("train", seed=MECH_SEED, max_steps=10_000, room=room)
    engine = models.HFEngine(policy, tok, torch.device("cpu"))
    cpu = C.Dist(0, 1, torch.device("cpu"))  # one process, no process group
    P = [t.prompt_ids for tr in trajs for t in tr.turns]
    R = [t.response_ids for tr in trajs for t in tr.turns]
    old = C.score(policy, P, R, micro_batch, cpu, micro_batch * (max_prompt + max_response))
    starts = [action_start(tok, r) for r in R]
    meta = [(i, tr.won, g) for i, (tr, labs) in enumerate(zip(trajs, labels)) for g in labs]
    sa, oa, ga = method_args(room, max_prompt, max_response, micro_batch)
    lib = baselines.load_library(library_path)
    out_rows, cache = [], {}
    for method, source in rows:
        t1 = time.time()
        key = ("SEED" if method in ("SDAR", "RLSD") else method, source)  # SDAR and RLSD share SEED's library prompts
        if method == "GRPO":  # seed.py at λ_opd = 0: A per trajectory, no teacher
            samples, info, tea = S.build_samples(trajs, [None] * len(trajs), tok, sa)[0], Counter(), [None] * len(R)
        else:
            if key not in cache:
                samples, info = teacher_samples(method, source, trajs, engine, tok, sa, oa, ga, oracle_url, lib,
                                                replay_env)
                rows_t = [i for i, s in enumerate(samples) if s.teacher_ids]
                scored = C.score(policy, [samples[i].teacher_ids for i in rows_t], [R[i] for i in rows_t], micro_batch,
                                 cpu, micro_batch * (2 * max_prompt + max_response))
                tea = [None] * len(samples)
                for i, lp in zip(rows_t, scored):
                    tea[i] = lp
                cache[key] = samples, info, tea
            samples, info, tea = cache[key]
        assert [s.response_ids for s in samples] == R, "the teacher branch must score the same sampled tokens"
        credit = credits(method, samples, old, tea, sa, oa, ga)
        turn_rows = []
        for (traj, won, good), o, t, c, k in zip(meta, old, tea, credit, starts):
            d = (t - o) if t is not None else None
            turn_rows.append({"traj": traj, "won": won, "good": good,  # means in float64: a constant stays exact
                              "credit": c.double().mean().item() if len(c) else 0.0,
                              "delta": d.double().mean().item() if d is not None and len(d) else None,
                              "d_act": d[k:].sum().item() if d is not None else 0.0, "n_act": len(o) - k,
                              "d_think": d[:k].sum().item() if d is not None else 0.0, "n_think": k})
        row = {"method": method, "source": source, **summarize(turn_rows, method), "info": dict(info),
               "seconds": time.time() - t1, **({"turn_rows": turn_rows} if keep_turns else {})}
        out_rows.append(row)
        log(f"[mechanism] {method}/{source}: Δ-AUC {_f(row['delta_auc'])} credit-AUC failed "
            f"{_f(row['credit_auc_failed'])} successful {_f(row['credit_auc_successful'])} sign "
            f"{_f(row['sign_agreement'])} coverage {row['coverage']:.2f} ({row['seconds']:.0f} s)")
    n = len(trajs)
    return {"rows": out_rows, "rollouts": {
        "layout_seed": MECH_SEED, "room": room, "trajectories": n, "groups": len({t.group for t in trajs}),
        "success": sum(t.won for t in trajs) / n, "turns": len(meta), "good_turns": sum(g for _, _, g in meta),
        "mixed_groups": sum(len({t.won for t in trajs if t.group == g}) == 2 for g in {t.group for t in trajs}),
        "seconds_scoring": time.time() - t0}}


def _f(v) -> str:
    return "–" if v is None else f"{v:.3f}"


def gate(result: dict) -> dict:
    """The Δ-AUC of the oracle skills within trajectories, per method, against GATE."""
    got = {r["method"]: r["delta_auc"] for r in result["rows"] if r["source"] == "oracle"}
    return {"threshold": GATE, "oracle_delta_auc": got,
            "met": bool(got) and all(v is not None and v >= GATE for v in got.values())}


def table(result: dict) -> str:
    """The markdown table of a measurement."""
    head = ["method", "skills", "turns with a skill", "Δ-AUC within traj.", "credit AUC in failed traj.",
            "credit AUC in successful traj.", "Δ good act / bad act (nats/token)", "Δ good think / bad think",
            "credit sign agrees", "Δ sign agrees"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        lines.append("| " + " | ".join([
            r["method"], r["source"], f"{r['coverage']:.0%}", _f(r["delta_auc"]),
            f"{_f(r['credit_auc_failed'])} ({r['credit_pairs_failed']})",
            f"{_f(r['credit_auc_successful'])} ({r['credit_pairs_successful']})",
            f"{_f(r['delta_good_act'])} / {_f(r['delta_bad_act'])}",
            f"{_f(r['delta_good_think'])} / {_f(r['delta_bad_think'])}",
            _f(r["sign_agreement"]), _f(r["delta_sign_agreement"])]) + " |")
    return "\n".join(lines)


def write(result: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
