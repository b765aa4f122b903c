"""The oracle stand-in of the learning experiment (tools/experiment.py): the papers' external annotator, analyzer and
judge, served as an OpenAI-compatible endpoint.

  python -m tools.experiment oracle --port 8000    # alone: POST http://127.0.0.1:8000/v1/chat/completions (GET /stats)

An ORACLE STAND-IN for the papers' GLM-5.2 / DeepSeek annotator, analyzer and judge. It is an OpenAI-compatible HTTP
endpoint that parses the trajectory it is sent, finds the task and replays the actions in the privileged household
env, and writes from the replay: SEED hindsight skills, OPID's JSON (episode skill + step skills for the critical
steps) and 0-3 judge scores of reflections. Its texts state only what the trajectory shows or implies (where objects
were seen, which step went wrong, what was never searched); the privileged state checks those statements and never
adds a fact the trajectory does not contain. A trajectory it cannot replay gets a generic text from the task alone
(counted in /stats).

Deviations / choices:
  * The oracle's skills name receptacles and objects with their numbers ("the mug 1 was on the countertop 2"):
    grounding a household skill needs them, although SEED's analyzer prompt asks for no object numbers.
"""
from __future__ import annotations

if not __package__:  # run by its file path: the checkout's modules (envs, models, …) are not importable then
    raise SystemExit("tools/oracle.py is part of the learning experiment, not a command: from the checkout "
                     "root, run `python -m tools.experiment`")

import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler

import envs
from envs import APPLIANCE, OPENABLE, TREATMENT, kind


# ------------------------------------------------------------------------------------------------------------------
# 1. Hindsight facts of one household trajectory: replay its actions in the privileged env, keep what it showed
# ------------------------------------------------------------------------------------------------------------------

@dataclass
class Facts:
    task: str
    family: str
    otype: str                      # the object type the task needs
    rtype: str                      # the receptacle type it goes to
    won: bool
    actions: list                   # per step: the action, or None for an invalid step
    targets_seen: dict = field(default_factory=dict)   # object name -> (first 0-based step it was seen at, where)
    lamp_seen: str | None = None    # where the desklamp was seen, if it was
    visited: list = field(default_factory=list)        # receptacles the agent went to, in order
    searched: list = field(default_factory=list)       # receptacles whose contents an observation showed, in order
    unexplored: list = field(default_factory=list)     # receptacles whose contents were never shown
    wrong_takes: list = field(default_factory=list)    # (step, object) of other types picked up
    repeats: list = field(default_factory=list)        # steps that repeated the previous action
    took: list = field(default_factory=list)           # (step, object, receptacle) of target objects taken
    treated: int | None = None      # step of the clean / heat / cool of a target object
    placed: int | None = None       # step the (last) target object was put on the goal receptacle
    target_rec: str = ""            # the goal receptacle to name (the room listing shows every receptacle)


def contents_shown(env) -> bool:
    """The observation of the step just taken showed what is in/on the agent's receptacle."""
    return bool(env.loc) and (kind(env.loc) not in OPENABLE or env.loc in env.opened)


OBJECT_RE = re.compile(r"\b([a-z]+) (\d+)\b")


def replay(env: envs.HouseholdEnv, task_id: str, actions: list) -> tuple[Facts, list[str]]:
    """Play `actions` (None = an invalid step) from the start of task_id; returns the facts and the observations."""
    env.reset(task_id)
    s = env.spec
    f = Facts(env.task, env.family, s["otype"], s["rtype"], False, list(actions))
    f.target_rec = next(r for r in s["receptacles"] if kind(r) == s["rtype"])
    observations, prev = [], None
    for t, action in enumerate(actions):
        response = envs.format_expert_response(action, "household") if action else "(no action)"
        obs, _, done, info = env.step(response)
        observations.append(obs)
        if action is not None and not info["valid"]:
            raise ValueError(f"step {t}: {action!r} is not admissible in the replay")
        if action is None:
            continue
        verb = action.split()[0]
        if action == prev:
            f.repeats.append(t)
        prev = action
        if verb == "go":
            f.visited.append(action[len("go to "):])
        if verb in ("go", "open", "examine") and contents_shown(env):
            f.searched = [r for r in f.searched if r != env.loc] + [env.loc]  # its contents are in this observation
        for name, num in OBJECT_RE.findall(obs):  # what this observation showed, checked against the state
            obj = f"{name} {num}"
            where = env.objects.get(obj, {}).get("loc")
            if name == s["otype"] and where not in (None, "hand") and obj not in f.targets_seen:
                f.targets_seen[obj] = (t, where)
            if obj == "desklamp 1" and env.loc == s["lamp_at"]:
                f.lamp_seen = f.lamp_seen or env.loc
        if verb == "take":
            obj, rec = action[len("take "):].split(" from ")
            if env.objects[obj]["type"] == s["otype"]:
                f.took.append((t, obj, rec))
            else:
                f.wrong_takes.append((t, obj))
        if verb == TREATMENT.get(f.family) and env.objects[env.holding]["type"] == s["otype"]:
            f.treated = t  # the treatment the task needs (a stray "clean" in a pick-and-place task is not one)
        if verb == "move":
            obj, rec = action[len("move "):].split(" to ")
            if env.objects[obj]["type"] == s["otype"] and kind(rec) == s["rtype"]:
                f.placed, f.target_rec = t, rec
        if done:
            break
    f.won = env.won
    f.unexplored = [r for r in s["receptacles"] if r not in f.searched and kind(r) != s["rtype"]]
    return f, observations


# ------------------------------------------------------------------------------------------------------------------
# The oracle's texts, written from the facts only
# ------------------------------------------------------------------------------------------------------------------

def plan_from(f: Facts, obj: str, rec: str) -> list[str]:
    """The grounded workflow once `obj` is known to be at `rec`: commands the agent would type."""
    steps = [f"go to {rec}"] + ([f"open {rec}"] if kind(rec) in OPENABLE else []) + [f"take {obj} from {rec}"]
    need = TREATMENT.get(f.family)
    if need:
        steps += [f"go to {APPLIANCE[need]}", f"{need} {obj} with {APPLIANCE[need]}"]
    if f.family == "look_at_obj_in_light":
        steps += [f"go to {f.lamp_seen}", "use desklamp 1"] if f.lamp_seen else ["find the desklamp and use it"]
    else:
        steps += [f"go to {f.target_rec}", f"move {obj} to {f.target_rec}"]
    return steps


def first_target(f: Facts):
    """(object, receptacle, step) of the first target object the trajectory showed, else None."""
    if not f.targets_seen:
        return None
    obj, (t, rec) = min(f.targets_seen.items(), key=lambda kv: kv[1][0])
    return obj, rec, t


def sentence(steps: list[str]) -> str:
    return ", then ".join(steps) + "."


def seed_skill(f: Facts) -> str:
    """SEED's hindsight skill: 'Workflow: …' after a success, 'Avoid …' after a failure; at most three sentences."""
    seen = first_target(f)
    if f.won and seen:
        obj, rec, _ = seen
        return f"Workflow: the {obj} was at the {rec}. " + sentence(plan_from(f, obj, rec)).capitalize()
    if seen:
        obj, rec, t = seen
        return (f"Avoid wandering after the {f.otype} is found: the {obj} was seen at the {rec} at step {t + 1}. "
                + sentence(plan_from(f, obj, rec)).capitalize())
    searched = ", ".join(f.searched[-4:]) or "nothing"
    nxt = ", ".join(f.unexplored[:3]) or f.target_rec
    text = f"Avoid searching the same places again: no {f.otype} was at {searched}. Search {nxt} next."
    if sum(a is None for a in f.actions) > len(f.actions) / 3:
        text += " Write exactly one admissible action inside <action> </action> every step."
    return text


def step_skills(f: Facts, k: int) -> dict[int, str]:
    """OPID's critical steps (0-based) with one imperative instruction each, at most k."""
    out: dict[int, str] = {}
    seen = first_target(f)
    for t, a in enumerate(f.actions):
        if a is None:
            out.setdefault(t, "Write exactly one admissible action inside <action> </action>.")
    for t, obj in f.wrong_takes:
        out.setdefault(t, f"Do not pick up the {obj}: the task needs a {f.otype}.")
    if seen:
        obj, rec, t_seen = seen
        took = [t for t, o, _ in f.took if o == obj]
        if took:
            out.setdefault(took[0], f"Take the {obj} from the {rec}: it is what the task needs.")
        else:  # the first step after seeing it that did not take it
            t = t_seen + 1
            if t < len(f.actions):
                out.setdefault(t, f"Take the {obj} from the {rec} now: you have found it.")
    elif f.repeats:
        nxt = f.unexplored[0] if f.unexplored else f.target_rec
        out.setdefault(f.repeats[0], f"Do not repeat the last action; go to {nxt}, which is not searched yet.")
    if f.treated is not None:
        need = TREATMENT[f.family]
        out.setdefault(f.treated, f"{need.capitalize()} the {f.otype} with the {APPLIANCE[need]} before placing it.")
    return dict(sorted(out.items())[:k])


def opid_analysis(f: Facts, k: int) -> str:
    return json.dumps({"episode_skill": seed_skill(f), "step_skills": {str(t): s for t, s in step_skills(f, k).items()}})


def reflection(f: Facts) -> str:
    """A GRSD reflection (three numbered points tied to turns): the text the backbone learns to write."""
    seen, points = first_target(f), []
    if f.won and seen:
        obj, rec, _ = seen
        t_take = next((t for t, o, _ in f.took if o == obj), None)
        points.append(f"At turn {(t_take or 0) + 1} I took the {obj} from the {rec}; go there first.")
        if f.treated is not None:
            need = TREATMENT[f.family]
            points.append(f"At turn {f.treated + 1} I used the {APPLIANCE[need]} to {need} it; keep that step.")
        else:
            points.append(f"I carried the {obj} straight to where the task needed it; do not detour.")
        end = f.placed if f.placed is not None else len(f.actions) - 1
        points.append(f"At turn {end + 1} the task was done with {f.target_rec if f.placed is not None else 'the desklamp'}; "
                      "repeat this order.")
    else:
        bad = [t for t, a in enumerate(f.actions) if a is None]
        if f.wrong_takes:
            t, obj = f.wrong_takes[0]
            points.append(f"At turn {t + 1} I took the {obj}, which the task does not need; take a {f.otype}.")
        elif bad:
            points.append(f"At turn {bad[0] + 1} my reply was invalid; write one admissible action in <action> </action>.")
        else:
            points.append(f"I searched {', '.join(f.searched[-3:]) or 'nowhere'} and ran out of steps.")
        if seen:
            obj, rec, t = seen
            points.append(f"The {obj} was at the {rec} at turn {t + 1}; go there and take it.")
            points.append("Then " + sentence(plan_from(f, obj, rec)[2:] or ["finish the task"]))
        else:
            points.append(f"No {f.otype} was at {', '.join(f.searched[-3:]) or 'the start'}; search "
                          f"{', '.join(f.unexplored[:2]) or f.target_rec} next.")
            points.append("Do not repeat actions; every step should open or visit a new place.")
    return "\n".join(f"{i}. {p}" for i, p in enumerate(points[:3], 1))


def guidance(task: str, good: list[Facts], bad: list[Facts]) -> str:
    """GRSD group guidance z_x (DO / AVOID bullets) from the facts behind the reflections it contrasts."""
    do = []
    for f in good:
        seen = first_target(f)
        if seen:
            do.append(f"- Go to the {seen[1]} and take the {seen[0]}.")
            do += [f"- {s[0].upper() + s[1:]}." for s in plan_from(f, seen[0], seen[1])[3:]]
            break
    do = (do or [f"- Find a {good[0].otype if good else 'target object'} and finish the task."])[:4]
    avoid = []
    for f in bad:
        if f.wrong_takes:
            avoid.append(f"- Do not pick up the {f.wrong_takes[0][1]}.")
        if any(a is None for a in f.actions):
            avoid.append("- Do not write invalid actions.")
        if f.repeats:
            avoid.append("- Do not repeat the same action.")
        avoid.append("- Do not run out of steps searching.")
    avoid = list(dict.fromkeys(avoid))[:3]
    return "### DO\n" + "\n".join(do) + ("\n### AVOID\n" + "\n".join(avoid) if bad else "")


TURN_RE = re.compile(r"\bturn (\d+)\b", re.I)


def judge_score(f: Facts, reflection_text: str, shown: str) -> int:
    """0-3 by the judge rubric, checked against the replay: 0 if it invents an object / place the attempt never showed
    or contradicts the outcome; else 1 + (names the decisive place or turn) + (concrete: cites a turn that exists)."""
    text = reflection_text.lower()
    named = {f"{a} {b}" for a, b in OBJECT_RE.findall(text) if a not in ("turn", "step")}
    if any(n not in shown for n in named):
        return 0
    claims_success = any(w in text for w in ("was done", "succeeded", "finished the task", "repeat this"))
    claims_failure = any(w in text for w in ("invalid", "ran out", "failed", "does not need", "wrong"))
    if (f.won and claims_failure and not claims_success) or (not f.won and claims_success and not claims_failure):
        return 0
    seen = first_target(f)
    decisive = ({seen[0], seen[1]} if seen else set(f.unexplored[:2])) | ({f.target_rec} if f.won else set())
    turns = [int(t) for t in TURN_RE.findall(text)]
    concrete = bool(turns) and all(1 <= t <= len(f.actions) for t in turns)
    return 1 + bool(decisive & named) + concrete


# ------------------------------------------------------------------------------------------------------------------
# 3. The oracle endpoint: parse the trajectory a method sends, find its task, replay it, answer for the role
# ------------------------------------------------------------------------------------------------------------------

INVALID_MARKS = ("(invalid", "INVALID")
TASK_LINE_RE = re.compile(r"^Task: (.+)$", re.M)
FORMATS = {  # role -> (first-observation regex, per-step (action, observation) regex), as seed.py / opid.py / grsd.py
    "seed": (re.compile(r"^Initial observation: (.*)$", re.M),
             re.compile(r"^Step \d+\n  Action: (.*)\n  Observation: (.*)\n  Reward: ", re.M)),
    "opid": (re.compile(r"^\[Step 0\]\nObservation: (.*)$", re.M),
             re.compile(r"^Action: (.*)\nFeedback: reward [^\n]*\n(?:\[Step \d+\]\nObservation|Final observation): "
                        r"(.*)$", re.M)),
    "judge": (re.compile(r"^Initial observation: (.*)$", re.M),
              re.compile(r"^Turn \d+: action: (.*)\n  observation: (.*)$", re.M)),
}


def role_of(prompt: str) -> str | None:
    """Which role a prompt asks for, from the instructions seed.py / opid.py / grsd.py write (None: not ours)."""
    import seed
    if seed.ANALYZER_INSTRUCTIONS in prompt:
        return "seed"
    if "Extract hindsight skills from it." in prompt and '"episode_skill"' in prompt:
        return "opid"
    if prompt.startswith("Grade an agent's reflection") and "\nReflection:\n" in prompt:
        return "judge"
    return None


@dataclass
class Parsed:
    task: str
    first_obs: str
    steps: list  # (action or None, observation text as shown)
    reflection: str = ""


def parse_record(prompt: str, role: str) -> Parsed | None:
    """The task, first observation and steps of a trajectory in the prompt format of `role`; None if it does not
    parse. The judge's prompt also carries the reflection to grade."""
    first_re, step_re = FORMATS[role]
    body, reflection_text = prompt, ""
    if role == "judge":
        body, _, rest = prompt.partition("\nReflection:\n")
        reflection_text = rest.split("\n\nCriteria:")[0]
    task, first = TASK_LINE_RE.search(body), first_re.search(body)
    if not task or not first:
        return None
    steps = [(None if a.startswith(INVALID_MARKS) else a.strip(), o) for a, o in step_re.findall(body)]
    return Parsed(task.group(1).strip(), first.group(1), steps, reflection_text)


class Oracle:
    """Finds a parsed trajectory's task among the household train tasks of the given layout seeds and replays it.
    Counts: requests, replayed, fallbacks (a text from the task alone), by role."""

    def __init__(self, seeds=(0, 1, 2), max_critical: int = 5, room: str = "full"):
        self.max_critical, self.index, self.envs = max_critical, {}, {}
        for s in seeds:
            env = envs.HouseholdEnv("train", seed=s, max_steps=10_000, room=room)  # the replay never stops early
            self.envs[s] = env
            for tid in env.task_ids():
                spec = envs.make_household_task(tid, s, room)
                self.index.setdefault(spec["task"], []).append((s, tid))
        # one replay env per layout seed, shared by the server's threads: a replay holds `replay_lock` so two
        # concurrent requests never reset and step the same env (a race that turned a replay into a fallback)
        self.stats, self.lock, self.replay_lock = {}, threading.Lock(), threading.Lock()

    def count(self, key: str):
        with self.lock:
            self.stats[key] = self.stats.get(key, 0) + 1

    def facts(self, parsed: Parsed) -> tuple[Facts, str] | None:
        """The replayed facts and the text the trajectory showed (for the judge's 'never invented' check)."""
        for s, tid in self.index.get(parsed.task, []):
            env = self.envs[s]
            env.reset(tid)
            if not env.observation.startswith(parsed.first_obs[:200]):
                continue
            try:
                f, observations = replay(env, tid, [a for a, _ in parsed.steps])
            except (ValueError, KeyError):
                continue
            if len(observations) == len(parsed.steps) and all(
                    o.startswith(shown[:150]) for o, (_, shown) in zip(observations, parsed.steps)):
                shown = " ".join([env.spec["task"], parsed.first_obs] + [f"{a} {o}" for a, o in zip(f.actions,
                                                                                                  observations)])
                return f, shown
        return None

    def reply(self, prompt: str) -> str:
        role = role_of(prompt)
        self.count(f"requests/{role}")
        parsed = parse_record(prompt, role) if role else None
        with self.replay_lock:
            found = self.facts(parsed) if parsed else None
        self.count(f"{'replayed' if found else 'fallback'}/{role}")
        if role is None:
            return "I can only analyze household trajectories."
        if found is None:  # nothing to ground a statement in: a text from the task line alone
            task = parsed.task if parsed else "the task"
            generic = f"Avoid acting at random: read the task ({task}) and search each place once."
            return {"seed": f"<skill>{generic}</skill>", "judge": "1",
                    "opid": json.dumps({"episode_skill": generic, "step_skills": {}})}[role]
        f, shown = found
        if role == "seed":
            return f"<skill>{seed_skill(f)}</skill>"
        if role == "opid":
            return opid_analysis(f, self.max_critical)
        return str(judge_score(f, parsed.reflection, shown))


def serve_oracle(oracle: Oracle, host: str = "127.0.0.1", port: int = 0) -> envs.HTTPServer:
    """OpenAI-compatible POST /v1/chat/completions (the last user message is the prompt); GET /stats. Runs in a
    daemon thread; returns the server (server.server_address[1] is the port)."""

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, obj):
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self._send(200, dict(oracle.stats)) if self.path.rstrip("/").endswith("/stats") else self._send(404, {})

        def do_POST(self):
            if not self.path.rstrip("/").endswith("/chat/completions"):
                return self._send(404, {"error": "POST /v1/chat/completions"})
            try:
                req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                prompt = [m for m in req["messages"] if m.get("role") == "user"][-1]["content"]
                if not isinstance(prompt, str):
                    prompt = "".join(p.get("text", "") for p in prompt if isinstance(p, dict))
            except (ValueError, KeyError, IndexError, TypeError, AttributeError):
                return self._send(400, {"error": "expected {'messages': [{'role': 'user', 'content': ...}]}"})
            try:
                text = oracle.reply(prompt)
            except Exception as e:  # an oracle bug must not look like a network failure: say what broke
                oracle.count("errors")
                return self._send(500, {"error": f"{type(e).__name__}: {e}"})
            self._send(200, {"object": "chat.completion", "model": req.get("model", "oracle"),
                             "choices": [{"index": 0, "finish_reason": "stop",
                                          "message": {"role": "assistant", "content": text}}]})

        def log_message(self, *a):
            pass

    server = envs.HTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
