"""tools/mechanism.py: the measures by hand, the ground-truth replay, and one measurement on scripted household
trajectories (real token ids, the oracle over HTTP) checked against an independent recomputation."""
import math

import pytest
import torch

import common as C
import envs
import models
from tools import mechanism as M, oracle as O
import seed
from conftest import HERE, play


def test_within_auc_by_hand():
    # trajectory 0: good 3 vs bad 1 and 2 -> 2 wins; trajectory 1: good 5 vs bad 5 -> a tie (1/2); the good 9 of
    # trajectory 2 has no bad turn beside it, and no pair crosses trajectories (9 > every bad would count otherwise)
    auc, pairs = M.within_auc([3, 1, 2, 5, 5, 9], [True, False, False, True, False, True], [0, 0, 0, 1, 1, 2])
    assert pairs == 3 and auc == pytest.approx(2.5 / 3)
    assert M.within_auc([1, 2], [True, True], [0, 0]) == (None, 0)
    auc, _ = M.within_auc([0.5] * 4, [True, False, True, False], [0, 0, 0, 0])  # constant credit (GRPO): exactly 1/2
    assert auc == 0.5


def test_sign_agreement_by_hand():
    # good & +, good & 0 (no), bad & -, bad & + (no)
    assert M.sign_agreement([1.0, 0.0, -2.0, 0.1], [True, True, False, False]) == 0.5
    assert M.sign_agreement([], []) is None


def test_action_start_splits_think_from_action(tok):
    text = "<think>I am at the desk 1.</think>\n<action>go to drawer 1</action>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    k = M.action_start(tok, ids)
    assert "</think>" in tok.decode(ids[:k]) and "</think>" not in tok.decode(ids[:k - 1])  # (a token may hold ">\n")
    assert tok.decode(ids[k:]).strip() == "<action>go to drawer 1</action>"
    bare = tok("no tags", add_special_tokens=False)["input_ids"]
    assert M.action_start(tok, bare) == len(bare)


def test_small_room_layouts():
    full, small = envs.make_household_task("household-train-3", 0), envs.make_household_task("household-train-3", 0,
                                                                                            "small")
    # the full room is what it was before the room option (values read off the earlier envs.py)
    assert full["receptacles"] == ["cabinet 1", "cabinet 2", "cabinet 3", "coffeemachine 1", "countertop 1",
                                   "countertop 2", "diningtable 1", "drawer 1", "drawer 2", "fridge 1", "microwave 1",
                                   "safe 1", "sidetable 1", "sinkbasin 1", "sofa 1", "stoveburner 1", "toaster 1"]
    assert sorted(full["objects"]) == ["apple 1", "bread 1", "cd 1", "keychain 1", "knife 1", "mug 1", "pan 1",
                                       "potato 1", "soapbottle 1", "spatula 1", "spatula 2"]
    assert full["task"] == "heat some apple and put it in cabinet." and small["receptacles"] != full["receptacles"]
    for i in range(60):
        spec = envs.make_household_task(f"household-valid_seen-{i}", 5, "small")
        assert 7 <= len(spec["receptacles"]) <= 10, spec["receptacles"]
        others = [o for o in spec["objects"].values() if o["type"] != spec["otype"]]
        assert 2 <= len(others) <= 4
    env = envs.HouseholdEnv("valid_unseen", seed=5, room="small")
    assert len(env.task_ids()) == 120 and len(envs.HouseholdEnv("valid_seen").task_ids()) == 60
    for tid in env.task_ids()[:30]:  # the privileged expert still solves every task
        env.reset(tid)
        while not env.done:
            env.step(envs.format_expert_response(env.expert_action(), "household"))
        assert env.won
    with pytest.raises(ValueError, match="room"):
        envs.HouseholdEnv(room="big")


def scripted(tok, n_win: int, n_fail: int, task: int = 0):
    """One group on one small-room task of the measured layout seed: expert wins that first waste a step ("look"),
    and failures that wander (inventory, look, then the expert's first move) and run out of steps."""
    out = []
    for k in range(n_win + n_fail):
        env = M.mech_env("small", 30 if k < n_win else 4)()
        env.reset(env.task_ids()[task])
        detour = "<think>I look around.</think>\n<action>look</action>"
        steps = [detour] + [lambda e: envs.format_expert_response(e.expert_action(), "household")] * 20 if k < n_win \
            else ["<think>hmm</think>\n<action>inventory</action>", detour,
                  lambda e: envs.format_expert_response(e.expert_action(), "household"), "no tags"]
        tr = play(env, tok, steps)
        tr.task_id, tr.group = env.task_id, task
        out.append(tr)
    return out


def test_label_turns_by_hand(tok):
    trajs = scripted(tok, 1, 1)
    labels = M.label_turns(trajs, M.mech_env("small", 30))
    assert labels[0] == [False] + [True] * (len(trajs[0].turns) - 1)  # the look wastes a step, the expert's don't
    assert labels[1] == [False, False, True, False]  # inventory, look, the expert's move, a malformed reply
    broken = scripted(tok, 1, 0)
    broken[0].turns[1].observation = "something else"
    with pytest.raises(RuntimeError, match="diverged"):
        M.label_turns(broken, M.mech_env("small", 30))


def test_measure_on_scripted_trajectories(tok, d):
    """GRPO's credit is constant within a trajectory (AUC 1/2); SEED's Δ, credit and its AUC equal an independent
    recomputation from the oracle's skill, seed.inject_skill and common.score."""
    o = O.Oracle((M.MECH_SEED,), room="small")
    server = O.serve_oracle(o)
    try:
        trajs = scripted(tok, 2, 2)
        labels = M.label_turns(trajs, M.mech_env("small", 30))
        policy = models.load_model("tiny", 0).eval()
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        res = M.measure(policy, tok, trajs, labels, "small", url, str(HERE / "skills" / "alfworld.jsonl"), max_response=80,
                        rows=(("GRPO", "-"), ("SEED", "oracle"), ("GRSD", "oracle")), keep_turns=True, log=lambda *a: 0)
    finally:
        server.shutdown()
    grpo, seed_row, grsd_row = res["rows"]
    assert grpo["credit_auc"] == 0.5 and grpo["coverage"] == 0.0 and grpo["delta_auc"] is None
    a = seed.group_advantages(torch.tensor([[tr.reward for tr in trajs]]), 1e-6)[0].tolist()
    assert [r["credit"] for r in grpo["turn_rows"]] == pytest.approx([a[i] for i, tr in enumerate(trajs)
                                                                      for _ in tr.turns])
    # independent Δ: the oracle's skill for each trajectory, in SEED's format, scored on the same response ids
    client = O.Oracle((M.MECH_SEED,), room="small")
    deltas, credits = [], []
    for i, tr in enumerate(trajs):
        skill = seed.parse_skill(client.reply(seed.trajectory_input(tr)))
        assert skill
        for t in tr.turns:
            teacher = C.encode_prompt(tok, seed.inject_skill(t.prompt_text, skill), 2048)[0]
            lt = C.score(policy, [teacher], [t.response_ids], 1, C.Dist(0, 1, torch.device("cpu")))[0]
            lo = C.score(policy, [t.prompt_ids], [t.response_ids], 1, C.Dist(0, 1, torch.device("cpu")))[0]
            deltas.append((lt - lo).mean().item())
            credits.append((a[i] + 0.01 * torch.sigmoid(5.0 * (lt - lo))).mean().item())
    assert [r["delta"] for r in seed_row["turn_rows"]] == pytest.approx(deltas, abs=1e-5)
    assert [r["credit"] for r in seed_row["turn_rows"]] == pytest.approx(credits, abs=1e-6)
    flat = [(i, g) for i, labs in enumerate(labels) for g in labs]
    want, _ = M.within_auc(deltas, [g for _, g in flat], [i for i, _ in flat])
    assert seed_row["delta_auc"] == pytest.approx(want) and seed_row["coverage"] == 1.0
    assert seed_row["delta_pairs"] == sum(sum(labs) * (len(labs) - sum(labs)) for labs in labels)
    # GRSD: one mixed group -> every turn has the oracle's guidance, and Â keeps A's sign (|λq̂| <= 0.1)
    assert grsd_row["coverage"] == 1.0 and grsd_row["info"]["guided_groups"] == 1
    for r, g in zip(grsd_row["turn_rows"], grpo["turn_rows"]):
        assert math.copysign(1, r["credit"]) == math.copysign(1, g["credit"]) and abs(r["credit"] / g["credit"] - 1) <= 0.1 + 1e-6
    assert M.table(res).count("\n") == 4


def test_household_room_flag_is_refused_for_other_envs():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, str(HERE / "seed.py"), "--env", "search", "--household_room", "small"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "--household_room is the household env's option" in r.stderr, r.stderr[-500:]
