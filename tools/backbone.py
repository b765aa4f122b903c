"""The warm-started backbone of the learning experiment (tools/experiment.py): warm-start data from the household
env's experts, then behaviour cloning in two stages into a Hugging Face checkpoint.

  python -m tools.experiment backbone     # -> runs/experiment/backbone (a copy is committed in docs/results/backbone)

A stand-in for an instruction-tuned LLM. A 4-layer Qwen2-style model (hidden 256, 3.5 M parameters) with a byte-
level BPE trained on household text (Qwen2's pre-tokenizer), behaviour-cloned on train tasks only (layout seeds the
runs never use): acting in the <think>/<action> format, where an unhinted prompt is labelled by a searching expert
that knows only what it has seen (search_action) and a prompt with a true hint in one of the three methods' skill /
guidance formats by the env's privileged expert, which follows the hint; plus SEED skills, GRSD reflections and GRSD
guidance written from the searcher's trajectories. Each acting response restates the task word for word before
reasoning (reasoned_response). AdamW, lr 1e-3 flat for 1,500 steps then a cosine to 1e-4 at 3,000 (bc_lr); stage 1
stops at the first check with 20-40 % held-out success (else it keeps its best check) ->
runs/experiment/backbone_clone. Stage 2 (skill reading) continues from there with hindsight-hinted pairs added
(hindsight_hinted: the states of the searcher's own noisy episodes, each prompt carrying what an analyzer writes
about that episode, labelled by the privileged expert) for at least 750 steps, to the next check with 20-40 %
success: without it the skills barely moved the backbone's log-probabilities (oracle Δ-AUC 0.55-0.63,
docs/experiment.md). Each stage resumes from its last check when run again.

Deviations / choices:
  * The household env's own expert is privileged (it walks straight to the object). Cloned without hints it taught
    a guess of where things are (0 % held-out success after 400 steps), so unhinted prompts are labelled by
    search_action instead; the privileged expert labels only prompts whose hint tells it what it knows.
  * The warm-start responses spell out the facts their action rests on (reasoned_response); the method runs use
    the env and the methods exactly as they are.
"""
from __future__ import annotations

if not __package__:  # run by its file path: the checkout's modules (envs, models, …) are not importable then
    raise SystemExit("tools/backbone.py is part of the learning experiment, not a command: from the checkout "
                     "root, run `python -m tools.experiment backbone`")

import json
import math
import os
import random
import shutil
import time

import envs
from envs import OPENABLE, kind

from tools.oracle import Facts, contents_shown, first_target, guidance, reflection, replay, seed_skill, step_skills


# ------------------------------------------------------------------------------------------------------------------
# 1. Warm-start data: the privileged expert on train tasks (layout seeds the runs never use), hinted or not
# ------------------------------------------------------------------------------------------------------------------

DATA_SEEDS = (1000, 1001, 1002)  # household layouts are a function of (seed, task id): the runs use seeds 0-2


def search_action(env, searched: list, rng: random.Random) -> str:
    """The expert without privileged knowledge of where things are (what the backbone clones when no hint is in
    its prompt): take a needed object it can see, else go back to one it saw, else open the closed receptacle it
    stands at, else go to a random receptacle whose contents it has not seen (random, not in the listed order:
    a 4-layer model did not learn "the next one in the list" in 500 warm-start steps, 0 % success, while copying
    one admissible "go to" is easy). Once it holds a needed object (or must put a wrong one down), the env's
    expert finishes, except that the desklamp is searched for the same way until it has been seen."""
    s, expert = env.spec, env.expert_action()
    lamp_known = s["lamp_at"] in searched
    if env.holding:
        if s["family"] != "look_at_obj_in_light" or lamp_known or env.objects[env.holding]["type"] != s["otype"]:
            return expert
        todo = [r for r in s["receptacles"] if kind(r) in envs.LAMP_HOLDERS and r not in searched]
    else:
        if contents_shown(env) and expert.startswith("take ") and expert.endswith(f" from {env.loc}"):
            return expert  # the needed object is right here
        seen_at = [o["loc"] for o in env.objects.values() if o["type"] == s["otype"] and o["loc"] in searched
                   and kind(o["loc"]) != s["rtype"]]
        if seen_at and not (contents_shown(env) and env.loc in seen_at):
            return f"go to {seen_at[0]}" if env.loc != seen_at[0] else expert  # one it saw earlier
        if env.loc and kind(env.loc) in OPENABLE and env.loc not in env.opened:
            return f"open {env.loc}"
        todo = [r for r in s["receptacles"] if r not in searched and kind(r) != s["rtype"]]
    todo = [r for r in todo if r != env.loc]
    return f"go to {rng.choice(todo)}" if todo else expert


def reasoned_response(env, action: str) -> str:
    """The warm start's response: a <think> that spells out, from what the prompt shows, the facts the action rests
    on (the task, where the agent is, what it sees or holds), then the action. Spelling them out turns "pick the
    right object / place" into copying for a 4-layer model (without it: 0 % of 'take' decisions right after 350
    steps). What it sees is the current observation's list copied word for word ("where I see a mug 1, and a pen
    2."): naming only the needed object when present taught the clone to claim it saw the object wherever it stood
    (a small-room backbone at 1,000 steps: 124 of 217 turns an inadmissible "take"). The task is restated word for word ("My task is to: put some X on Y."): each word then follows the
    same words in the prompt's task line, an induction copy; the shorter "The task needs a X." asks for a lookup
    of one token 400 tokens back, which the model never learned (0 of 60 held-out thinks named the right object
    after 550 steps)."""
    parts = [f"My task is to: {env.task}"]
    if env.holding:
        parts.append(f"I hold the {env.holding}.")
    if env.loc:
        here = env.loc + (", which is closed" if kind(env.loc) in OPENABLE and env.loc not in env.opened else "")
        shown = env.observation.split("you see ", 1)[1].rstrip(".") if contents_shown(env) and \
            "you see " in env.observation else ""  # the current observation's list, word for word
        parts.append(f"I am at the {here}" + (f", where I see {shown}." if shown else "."))
    parts.append(f"So I will {action}.")
    return f"<think>{' '.join(parts)}</think>\n<action>{action}</action>"


def play(env, task_id: str, eps: float, rng: random.Random, invalid: float = 0.05, hinted: bool = False):
    """One episode of a noisy teacher: the label is the privileged expert's action when `hinted` (a true hint is in
    the prompt), else search_action; the action taken is the label, a random admissible action with prob. eps,
    or an invalid reply with prob. `invalid`. Returns ([(prompt, label, response, the privileged expert's response)]
    per state, the actions taken)."""
    env.reset(task_id)
    labelled, actions, searched = [], [], []
    while not env.done:
        expert = env.expert_action()
        label = expert if hinted else search_action(env, searched, rng)
        labelled.append((env.prompt(), label, reasoned_response(env, label), reasoned_response(env, expert)))
        u = rng.random()
        action = None if u < invalid else rng.choice(env.admissible()) if u < invalid + eps else label
        env.step(envs.format_expert_response(action, "household") if action else "<think>hmm</think> go")
        actions.append(action)
        if action and action.split()[0] in ("go", "open", "examine") and contents_shown(env):
            searched = [r for r in searched if r != env.loc] + [env.loc]
    return labelled, actions


def as_trajectory(env, task_id: str, actions: list):
    """A common.Trajectory of a replayed action list (token ids left empty: only the analysis prompts need it)."""
    import common as C
    env.reset(task_id)
    traj = C.Trajectory(task_id, 0, env.task, env.family, env.observation)
    for a in actions:
        text = envs.format_expert_response(a, "household") if a else "<think>hmm</think> go"
        obs, reward, _, info = env.step(text)
        traj.turns.append(C.Turn("", [], [], text, info["action"] if info["valid"] else None, info["valid"], obs,
                                 reward))
        traj.won = bool(info["won"])
    return traj


def hinted_prompt(prompt: str, style: str, ok: Facts, bad: Facts | None, expert: str) -> str:
    """The agent prompt with a true hint in one method's format; the hint is about the successful episode `ok`."""
    import grsd
    import opid
    import seed
    if style == "seed":
        return seed.inject_skill(prompt, seed_skill(ok))
    if style == "opid_episode":
        return opid.inject_skill(prompt, episode=seed_skill(ok))[0]
    if style == "opid_step":
        return opid.inject_skill(prompt, step=f"{expert[0].upper() + expert[1:]}.")[0]
    return grsd.inject_guidance(prompt, guidance("", [ok], [bad] if bad else []))


HINT_STYLES = ("seed", "opid_episode", "opid_step", "grsd")


def hindsight_hinted(states: list, f: Facts, ok: Facts, rng: random.Random, max_critical: int = 5) -> list:
    """'act' pairs that teach reading a hindsight skill: every state of a searcher's episode, its prompt carrying what
    an analyzer writes about that same episode (the methods' teacher context: SEED's skill, OPID's step skill at its
    critical steps and the episode skill elsewhere, GRSD's guidance against the clean episode `ok`), labelled by the
    privileged expert at that state. Only episodes that showed a needed object: their skill names where it is and
    the expert goes there, so the skill and the label agree; an episode that never saw one gets "search elsewhere",
    which the expert's direct route would contradict."""
    import grsd
    import opid
    import seed
    if first_target(f) is None:
        return []
    critical, out = step_skills(f, max_critical), []
    for t, (prompt, _, _, expert_response) in enumerate(states):
        style = rng.choice(HINT_STYLES)
        if style == "seed":
            text = seed.inject_skill(prompt, seed_skill(f))
        elif style == "grsd":
            text = grsd.inject_guidance(prompt, guidance(f.task, [f] if f.won else [ok], [] if f.won else [f]))
        elif t in critical:  # OPID's critical-first routing: the step skill at a critical step
            text = opid.inject_skill(prompt, step=critical[t])[0]
        else:
            text = opid.inject_skill(prompt, episode=seed_skill(f))[0]
        out.append(("act", text, expert_response))
    return out


def warm_start_data(n_tasks: int, max_steps: int, seed: int = 0, room: str = "full",
                    hindsight: bool = False) -> list[tuple[str, str, str]]:
    """(kind, user text, target response) pairs: 'act' (plain or hinted prompt -> expert response), 'skill' (SEED's
    x_τ -> <skill>…</skill>), 'reflect' (GRSD's p_ref -> three points), 'guide' (GRSD's p_guide -> DO / AVOID)."""
    import grsd
    import seed as seed_mod
    rng, pairs = random.Random(seed), []
    for data_seed in DATA_SEEDS:
        env = envs.HouseholdEnv("train", seed=data_seed, max_steps=max_steps, room=room)
        for task_id in env.task_ids()[:n_tasks]:
            clean, clean_actions = play(env, task_id, 0.0, rng, invalid=0.0, hinted=True)  # the privileged expert
            ok, _ = replay(env, task_id, clean_actions)
            noisy = [play(env, task_id, eps, rng) for eps in (0.0, 0.3, 0.6)]  # the searcher, then noisier
            facts = [replay(env, task_id, acts)[0] for _, acts in noisy]
            bad = next((f for f in facts if not f.won), None)
            for prompt, _, response, _ in noisy[0][0] + noisy[1][0]:  # acting without a hint (DAgger-style labels)
                pairs.append(("act", prompt, response))
            style = rng.choice(HINT_STYLES)
            for prompt, label, response, _ in clean:  # acting with a true hint: the privileged expert follows it
                pairs.append(("act", hinted_prompt(prompt, style, ok, bad, label), response))
            if hindsight:
                for (states, _), f in zip(noisy[1:], facts[1:]):  # acting with the hindsight skill of one's own episode
                    pairs += hindsight_hinted(states, f, ok, rng)
            for f, (_, acts) in zip(facts, noisy):  # analysis texts of the searcher's episodes
                traj = as_trajectory(env, task_id, acts)
                if rng.random() < 0.5:
                    pairs.append(("skill", seed_mod.trajectory_input(traj), f"<skill>{seed_skill(f)}</skill>"))
                else:
                    pairs.append(("reflect", grsd.reflection_prompt(traj, 400), reflection(f)))
            if bad is not None and rng.random() < 0.5:
                good_r, bad_r = [reflection(ok)], [reflection(bad)]
                pairs.append(("guide", grsd.guidance_prompt(ok.task, good_r, bad_r), guidance(ok.task, [ok], [bad])))
    return pairs


# ------------------------------------------------------------------------------------------------------------------
# 2. The backbone: tokenizer + 4-layer Qwen2 config, behaviour cloning, early stop, HF checkpoint
# ------------------------------------------------------------------------------------------------------------------

SELECT_SEED = 999  # the early stop is judged on valid_seen layouts of this seed (the runs evaluate seeds 0-2)


def build_backbone(vocab_size: int, seed: int, layers: int = 4, hidden: int = 256):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config
    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=3 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=None, eos_token_id=2,
                      pad_token_id=0)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg)


def eval_success(model, tok, split: str, layout_seed: int, max_steps: int, n: int = 60, room: str = "full") -> float:
    """Greedy-free held-out success at the runs' eval temperature 0.4 (common.evaluate without a process group)."""
    import torch
    import common as C
    import models
    engine = models.HFEngine(model, tok, torch.device("cpu"))
    make = lambda: envs.HouseholdEnv(split, seed=layout_seed, max_steps=max_steps, room=room)  # noqa: E731
    torch.manual_seed(0)
    trajs, _ = C.collect(engine, make, make().task_ids()[:n], 1, 1024, 64, 0.4, 1.0)
    model.train().requires_grad_(True)  # HFEngine froze it
    return sum(t.won for t in trajs) / len(trajs)


def clone_loss(model, rows: list, prompt_weight: float):
    """Mean token NLL of the responses + prompt_weight x mean token NLL of the prompts. The prompt term is language
    modelling on the agent's own context (a pretrained LLM has that ability): its observations repeat in the history
    and its actions come from the admissible list, which teaches the model to copy from its context."""
    import torch
    seqs = [p + r for p, r in rows]
    width = max(map(len, seqs))
    ids, real = torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width, dtype=torch.long)
    is_resp, is_prompt = torch.zeros(len(rows), width), torch.zeros(len(rows), width)
    for i, (p, r) in enumerate(rows):  # right-padded: position ids 0.. are right for every row
        ids[i, :len(p) + len(r)], real[i, :len(p) + len(r)] = torch.tensor(p + r), 1
        is_prompt[i, 1:len(p)] = 1  # the first token has nothing to be predicted from
        is_resp[i, len(p):len(p) + len(r)] = 1
    logits = model(input_ids=ids, attention_mask=real).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), ids[:, 1:], reduction="none")
    resp, prompt = is_resp[:, 1:], is_prompt[:, 1:]
    return (nll * resp).sum() / resp.sum() + prompt_weight * (nll * prompt).sum() / prompt.sum().clamp(min=1)


def bc_lr(step: int, steps: int, decay_from: int) -> float:
    """The warm start's learning-rate factor: 20 warm-up steps, flat to decay_from, then cosine down to 0.1 at steps."""
    if step < decay_from:
        return min(1.0, (step + 1) / 20)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - decay_from) / max(1, steps - decay_from))))


def warm_start(out: str, steps: int, checks: tuple, max_steps: int, n_tasks: int = 200, batch: int = 16,
               lr: float = 1e-3, decay_from: int = 1500, seed: int = 0, target: tuple = (0.2, 0.4),
               prompt_weight: float = 0.5, select_tasks: int = 60, room: str = "full", hindsight: bool = False,
               init: str | None = None, min_step: int = 0, log=print) -> dict:
    """Behaviour cloning (clone_loss: the responses, plus language modelling on the prompts), AdamW at lr x bc_lr.
    At each step in `checks` the weights, tokenizer and training state are saved to out/step<k>/ and the held-out
    success is measured (valid_seen, layout seed SELECT_SEED, `select_tasks` tasks, T 0.4); training stops at the first
    check inside `target` at or after min_step (that checkpoint is kept), else after `steps` (the best check is kept;
    the later on a tie), and the kept one is
    copied to out/. A rerun resumes from the last saved check (a check saved without training state resumes with
    fresh AdamW moments, and says so). hindsight: add the hindsight-hinted pairs (hindsight_hinted) to the data.
    init: a check of an earlier stage (out/step<k>/ with its training state) to continue from, at step k."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import common as C
    import models
    t0 = time.time()
    pairs = warm_start_data(n_tasks, max_steps, seed, room, hindsight)
    done = [k for k in checks if os.path.isfile(os.path.join(out, f"step{k}", "config.json"))]
    start = max(done, default=0)
    init_step = int(os.path.basename(init.rstrip("/"))[len("step"):]) if init else None
    new_stage = init is not None and start in (0, init_step)  # also after a kill before this stage's first check
    if new_stage and not start:  # the earlier stage's check becomes this folder's first
        start = init_step
        shutil.copytree(init, os.path.join(out, f"step{start}"), dirs_exist_ok=True)
    if start:  # resume: the tokenizer and weights of the last check
        tok = AutoTokenizer.from_pretrained(os.path.join(out, f"step{start}"))
        model = AutoModelForCausalLM.from_pretrained(os.path.join(out, f"step{start}")).train()
    else:
        tok = models.build_tiny_tokenizer([u for _, u, _ in pairs[::7]] + [r for _, _, r in pairs[::3]], vocab_size=2048)
        model = build_backbone(len(tok), seed)
    eos = models.end_of_turn_id(tok)
    encoded = {}
    for k, user, resp in pairs:
        encoded.setdefault(k, []).append((C.chat_ids(tok, user), tok(resp, add_special_tokens=False)["input_ids"] + [eos]))
    log(f"[backbone] {len(pairs)} pairs {dict((k, len(v)) for k, v in encoded.items())}, vocab {len(tok)}, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, data {time.time() - t0:.0f} s")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: bc_lr(start + i, steps, decay_from))
    rng, history, kept = random.Random(seed), [], None
    if start:
        state_file = os.path.join(out, f"step{start}", "train_state.pt")
        if os.path.isfile(state_file):
            state = torch.load(state_file, weights_only=False)
            opt.load_state_dict(state["optimizer"])
            rng.setstate(state["rng"])
            history, kept = state["history"], state["kept"]
        else:
            rng = random.Random(f"{seed}/{start}")
            history = [h for h in json.load(open(os.path.join(out, "warm_start.json")))["history"]
                       if h["step"] <= start] if os.path.isfile(os.path.join(out, "warm_start.json")) else []
            prior = [h for h in history if "select_success" in h]
            kept = max(prior[::-1], key=lambda h: h["select_success"]) if prior else None
            kept = kept and {"step": kept["step"], "select_success": kept["select_success"]}
            log(f"[backbone] step{start}/ has no training state: resuming with fresh AdamW moments")
        if new_stage:  # only this stage's checks can be kept
            kept = None
        log(f"[backbone] resumed at step {start}" + (f" from {init}" if new_stage else ""))
    kinds, weights = ["act", "skill", "reflect", "guide"], [0.7, 0.12, 0.12, 0.06]
    for step in range(start + 1, steps + 1):
        k = rng.choices(kinds, weights)[0]
        rows = rng.sample(encoded[k], min(len(encoded[k]), batch if k == "act" else batch // 2))
        loss = clone_loss(model, rows, prompt_weight)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        history.append({"step": step, "kind": k, "nll": loss.item()})
        if step % 25 == 0:
            recent = history[-25:]
            per_kind = {k: sum(h["nll"] for h in recent if h["kind"] == k) / max(1, sum(h["kind"] == k for h in recent))
                        for k in kinds}
            log(f"[backbone] step {step} nll " + " ".join(f"{k} {v:.3f}" for k, v in per_kind.items())
                + f" lr {sched.get_last_lr()[0]:.2e} ({time.time() - t0:.0f} s)")
        if step in checks:
            t_eval = time.time()
            success = eval_success(model, tok, "valid_seen", SELECT_SEED, max_steps, select_tasks, room)
            history[-1]["select_success"] = success
            log(f"[backbone] step {step}: valid_seen success (layout seed {SELECT_SEED}) {success:.3f} "
                f"({time.time() - t_eval:.0f} s)")
            in_target = target[0] <= success <= target[1] and step >= min_step
            if kept is None or success >= kept["select_success"] or in_target:  # on a tie, the later check
                kept = {"step": step, "select_success": success}
            path = os.path.join(out, f"step{step}")
            model.save_pretrained(path)
            tok.save_pretrained(path)
            torch.save({"optimizer": opt.state_dict(), "rng": rng.getstate(), "history": history, "kept": kept},
                       os.path.join(path, "train_state.pt"))
            if in_target:
                break
    for name in os.listdir(os.path.join(out, f"step{kept['step']}")):  # the kept check becomes the backbone
        if name != "train_state.pt":
            shutil.copy(os.path.join(out, f"step{kept['step']}", name), out)
    info = {**kept, "history": history, "seconds": time.time() - t0, "pairs": len(pairs), "lr": lr, "batch": batch,
            "decay_from": decay_from, "steps": steps, "prompt_weight": prompt_weight, "resumed_at": start or None,
            "room": room, "hindsight": hindsight, "init": init}
    with open(os.path.join(out, "warm_start.json"), "w") as f:
        json.dump(info, f)
    return info
