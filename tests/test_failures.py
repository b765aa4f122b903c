"""Bad inputs and failing endpoints: a hung or dead endpoint or retriever costs a bounded time and is counted on
every rank (with a warning line, fatal under --require_endpoint), /retrieve replies are checked, the parsers are
linear on degenerate replies, and every bad flag is one line before anything loads."""
from __future__ import annotations

import gc
import importlib
import json
import multiprocessing
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler

import pytest

import common as C
import harness
import models
import envs
import grsd
import opid
import seed
from conftest import HERE, SHARED, Server, env, free_port, one_rank, rows_of, run

QA_DATA = SHARED / "search_qa"
needs_qa = pytest.mark.skipif(not (QA_DATA / "corpus").is_dir(), reason=f"no Search-QA data at {QA_DATA}")


# ---- parsers: linear time on degenerate replies
# A policy that repeats one token until max_tokens writes replies like these. Every parser must read them in linear
# time: each call runs in a forked child that times itself with time.process_time() (CPU time, so a loaded machine
# adds little) against SLACK_S + S_PER_MB per MB of input. The quadratic parsers took from 0.8 s to over 40 s on
# 100 KB and hung on 1 MB; the linear ones take < 0.25 s on 1 MB.

SIZES = [pytest.param(100_000, id="100KB"), pytest.param(1_000_000, id="1MB")]
SLACK_S, S_PER_MB = 0.25, 1.0  # 0.35 s for 100 KB, 1.25 s for 1 MB


def _repeat(unit: str, n: int, head: str = "", tail: str = "") -> str:
    return head + unit * max(1, (n - len(head) - len(tail)) // len(unit)) + tail


def _nest(open_: str, middle: str, close: str, n: int) -> str:
    k = max(1, n // (len(open_) + len(close)))
    return open_ * k + middle + close * k


DEGENERATE = {  # name -> a reply of about n characters
    "a": lambda n: _repeat("a", n),
    "newlines": lambda n: _repeat("\n", n),
    "blank-lines-inside": lambda n: _repeat("\n", n, "x", "x"),  # not stripped away: '^\s*' met every line start
    "braces": lambda n: _repeat("{", n),
    "brackets": lambda n: _repeat("[", n),
    "quotes": lambda n: _repeat('"', n),
    "escaped-quotes-after-unclosed-quote": lambda n: _repeat('\\"', n, '"'),
    "numbered": lambda n: _repeat("1. ", n),
    "skill-open-tags": lambda n: _repeat("<skill>", n),
    "think-open-tags": lambda n: _repeat("<think>", n),
    "action-open-tags": lambda n: _repeat("<action>", n, "<think>x</think>"),
    "nested-skill": lambda n: _nest("<skill>", " a b c ", "</skill>", n),
    "nested-think": lambda n: _nest("<think>", "x", "</think>", n),
    "open-objects": lambda n: _repeat('{"a":', n),
    "deep-objects": lambda n: _nest('{"x":', "1", "}", n),
    "nested-starts-then-long-list": lambda n: _repeat("1,", n, '{"a":' * 256 + "["),  # each '{' reads to the end
}


def _analysis(text):
    got, events = opid.parse_analysis(text, 5, 5)
    return got, {k: v for k, v in events.items() if v}


def _same(text):
    return text


def _after_first_think(text):
    return " " + text[text.index("</think>") + len("</think>"):]


PARSERS = {  # name -> (parser, what it returns on a degenerate reply (or a function of the reply) unless EXPECTED says)
    "seed.parse_skill": (seed.parse_skill, None),
    "envs.find_json_object": (envs.find_json_object, None),
    "opid.parse_analysis": (_analysis, (None, {"no_json": 1})),
    "opid._step_index": (opid._step_index, None),
    "grsd.parse_reflection": (grsd.parse_reflection, None),
    "grsd.parse_judge": (grsd.parse_judge, None),
    "common.strip_thinking": (C.strip_thinking, _same),  # no <think>: the reply itself
    "envs.parse_action": (lambda t: envs.parse_action(t, admissible=["look"]), (None, False)),
    "envs.parse_action-search": (lambda t: envs.parse_action(t, ("search", "answer")), (None, False)),
}
EXPECTED = {
    ("common.strip_thinking", "think-open-tags"): "",  # an unclosed <think> runs to the end
    ("common.strip_thinking", "nested-think"): _after_first_think,  # the first </think> closes the block
    ("common.strip_thinking", "action-open-tags"): _after_first_think,
}


def _timed(fn, make, n):
    """(CPU seconds, result) of fn(make(n)) in a forked child, or None when it did not return within a wall-clock
    limit far above the bound (the quadratic parsers run for minutes on 1 MB)."""
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)

    def child():
        text = make(n)
        gc.freeze()  # the test process's own heap (torch) is not the parser's cost: keep collections off it (no
        # gc.collect() first: walking the inherited heap copies its pages, 0.2-0.4 s a call in a full pytest run)
        start = time.process_time()
        result = fn(text)
        send.send((time.process_time() - start, result))

    proc = ctx.Process(target=child, daemon=True)
    proc.start()
    out = recv.recv() if recv.poll(5 + 10 * _bound(n)) else None
    proc.kill()
    proc.join()
    return out


def _bound(n: int) -> float:
    return SLACK_S + S_PER_MB * n / 1e6


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("family", sorted(DEGENERATE))
@pytest.mark.parametrize("parser", sorted(PARSERS))
def test_parser_is_linear_on_degenerate_replies(parser, family, n):
    fn, want = PARSERS[parser]
    want = EXPECTED.get((parser, family), want)
    out = _timed(fn, DEGENERATE[family], n)
    assert out is not None, f"{parser} did not return within {5 + 10 * _bound(n):.0f} s"
    cpu, got = out
    assert cpu < _bound(n), f"{parser} took {cpu:.2f} s CPU on {n} characters of {family!r}"
    assert got == (want(DEGENERATE[family](n)) if callable(want) else want)


E = "Find the target object first, then carry it to the goal receptacle."
PLAIN = json.dumps({"episode_skill": E, "step_skills": {"0": "Go to the countertop first."}})
P3 = "1. Go to the countertop first.\n2. Take the candle.\n3. Put it in the bed."
JUNK = {"a": "a", "newlines": "\n", "spaces": " ", "brackets": "[", "numbered": "1. "}
BURIED = {  # parser, what follows the junk, the answer expected
    "seed.parse_skill": (seed.parse_skill, "<skill>Open the fridge first.</skill>", "Open the fridge first."),
    "envs.find_json_object": (envs.find_json_object, "\n```json\n" + PLAIN + "\n```", json.loads(PLAIN)),
    "opid.parse_analysis": (_analysis, "\n" + PLAIN,
                            (opid.Analysis(E, {0: "Go to the countertop first."}), {"critical_steps": 1})),
    "grsd.parse_judge": (lambda t: grsd.parse_judge("<think>" + t), "</think>\nScore: 2", 2),
    "common.strip_thinking": (lambda t: C.strip_thinking("<think>" + t).strip(), "</think>answer", "answer"),
    "envs.parse_action": (lambda t: envs.parse_action("<think>" + t, admissible=["look"]),
                          "</think><action>look</action>", ("look", True)),
}


@pytest.mark.parametrize("junk", sorted(JUNK))
@pytest.mark.parametrize("parser", sorted(BURIED))
def test_answer_after_1mb_of_junk_is_found_in_linear_time(parser, junk):
    fn, answer, want = BURIED[parser]
    out = _timed(fn, lambda n: _repeat(JUNK[junk], n) + answer, 1_000_000)
    assert out is not None and out[0] < _bound(1_000_000), out and out[0]
    assert out[1] == want


def test_reflection_after_1mb_of_prose_is_found_in_linear_time():
    text = "x" + "\n" * 1_000_000 + P3
    out = _timed(grsd.parse_reflection, lambda n: text, 1_000_000)
    assert out is not None and out[0] < _bound(1_000_000) and out[1] == text


@pytest.mark.parametrize("text,want", [
    ("<skill><skill>Open the fridge first.</skill></skill>", None),
    ("<skill>Open the <skill>fridge</skill> first.</skill>", None),
    ("<skill>Open the fridge <skill> first.</skill>", None),
    ("<skill>Open the fridge first.</skill></skill>", None),
    ("</skill><skill>Open the fridge first.</skill>", None),
    ("</skill>Open the fridge first.<skill>", None),
    ("<skill>Open the fridge first.</skill> and again <skill>Open the fridge first.</skill>", None),
    ("Sure. <skill>Open the fridge first.</skill> Done.", "Open the fridge first."),
])
def test_a_skill_is_one_block_and_nested_or_repeated_tags_are_rejected(text, want):
    assert seed.parse_skill(text) == want


@pytest.mark.parametrize("text,want", [
    ('{"a": [1, 2,], "b": "x,}",}', '{"a": [1, 2], "b": "x,}"}'),  # inside strings kept
    ('{"a": "say \\"hi,}\\"",}', '{"a": "say \\"hi,}\\""}'),         # escaped quotes stay inside
    ('It is 5" long. {"a": "b",},}', 'It is 5" long. {"a": "b"}}'),  # an odd '"' pairs with the next one...
    ('{"a": "b",} "and \\" then ,}', '{"a": "b"} "and \\" then }'),  # ...one that never closes is an ordinary character
    ("no comma here", "no comma here"),
])
def test_trailing_commas_dropped_outside_strings_only(text, want):
    assert envs.drop_trailing_commas(text) == want


# ---- endpoints and the retriever: bounded in time, counted on every rank, loud when total

class Hang(BaseHTTPRequestHandler):
    """Accepts the request, then answers nothing for longer than any client here waits."""

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        time.sleep(6)
        try:
            self.send_response(500)
            self.end_headers()
        except OSError:
            pass

    def log_message(self, *a):
        pass


class Oops(BaseHTTPRequestHandler):
    """A server that answers /retrieve with the wrong shape."""

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        data = json.dumps({"result": "oops"}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


def serve(handler):
    server = Server(("127.0.0.1", 0), handler)  # a backlog for 40 simultaneous connections
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def closed_url(path=""):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}{path}"


def test_a_hung_endpoint_costs_one_timeout_per_batch():
    server, url = serve(Hang)
    try:
        client = harness.ChatClient(url + "/v1", "m", "judge", timeout=2.0, retries=2)
        t0 = time.perf_counter()
        out = client.complete_many(["x"] * 40, 0.0, 8)
        waited = time.perf_counter() - t0
    finally:
        server.shutdown()
    # 40 requests at once, none retried after its timeout (before: 3 tries × 120 s, 16 at a time: ~18 min)
    assert out == [None] * 40 and client.requests == client.failures == 40
    # one timeout (2 s) plus thread start-up on 2 loaded cores (3.05 s was seen with a 1 s timeout); a retry after
    # the timeout or batches of 16 would take ≥ 2 timeouts (4 s)
    assert 2.0 <= waited < 3.8, waited


def test_a_refused_endpoint_is_retried_with_backoff_then_counted():
    client = harness.ChatClient(closed_url("/v1"), "m", "analyzer", timeout=1.0, retries=1)
    t0 = time.perf_counter()
    assert client.complete_many(["x"] * 3, 0.0, 8) == [None] * 3
    assert 1.0 <= time.perf_counter() - t0 < 3.0  # 2 attempts, 1 s backoff between them
    assert client.requests == client.failures == 3


def test_endpoint_metrics_warn_once_and_require_endpoint_is_fatal(capsys):
    client = harness.ChatClient(closed_url("/v1"), "m", "judge", timeout=1.0, retries=0)
    seen = [0, 0]
    with one_rank() as d:
        client.complete_many(["x"] * 2, 0.0, 8)
        assert harness.endpoint_metrics(client, seen, d, False) == {"endpoint/judge/requests": 2,
                                                              "endpoint/judge/failures": 2}
        assert capsys.readouterr().out.count("WARNING judge: all 2 requests to ") == 1
        assert harness.endpoint_metrics(client, seen, d, False) == {"endpoint/judge/requests": 0,  # per update
                                                              "endpoint/judge/failures": 0}
        assert "WARNING" not in capsys.readouterr().out
        client.complete_many(["x"], 0.0, 8)
        with pytest.raises(SystemExit, match="judge: all 1 requests .* failed this update .*--require_endpoint"):
            harness.endpoint_metrics(client, seen, d, True)


class SearchPolicy:
    """A scripted policy (the real tiny tokenizer's ids of a well-formed search action, like the expert
    trajectories elsewhere): it searches at every step, so every step asks the retriever."""

    def __init__(self):
        self.tok = models.load_tokenizer("tiny")
        self.stops = models.stop_token_ids(self.tok)
        text = envs.format_expert_response("<search>VIVA Media</search>", "search")
        end = self.tok.convert_tokens_to_ids("<|im_end|>")
        self.reply = self.tok(text, add_special_tokens=False)["input_ids"] + [end]

    def generate(self, prompts, max_new_tokens, temperature, top_p=1.0, keys=None):
        return [list(self.reply) for _ in prompts]

    def sample(self, prompts, max_new_tokens, temperature, top_p=1.0, keys=None):  # collect() calls it: no log-probs
        return self.generate(prompts, max_new_tokens, temperature, top_p), None


def search_envs(data_dir, **kw):
    return lambda: envs.make_env("search", "train", data_dir=str(data_dir), max_steps=2, **kw)


@needs_qa
@pytest.mark.parametrize("case", ["dead", "bad_reply", "no_corpus"])
def test_failed_retrievals_are_counted_and_warned(case, tmp_path, capsys):
    data, server = QA_DATA, None
    if case == "dead":
        kw = dict(retriever_url=closed_url("/retrieve"), timeout=1.0, retries=0)
    elif case == "bad_reply":
        server, url = serve(Oops)
        kw = dict(retriever_url=url + "/retrieve", timeout=1.0, retries=0)
    else:  # the question files without the corpus/ folder: the built-in BM25 has nothing to load
        data = tmp_path / "qa"
        data.mkdir()
        shutil.copy(QA_DATA / "hotpotqa.jsonl", data)
        kw = {}
    make = search_envs(data, **kw)
    tasks = make().task_ids()[:2]
    try:
        trajs, stats = C.collect(SearchPolicy(), make, tasks, 2, 1024, 64, 1.0, 1.0)
    finally:
        if server:
            server.shutdown()
    assert all(t.valid and "Search failed" in t.observation for tr in trajs for t in tr.turns)
    with one_rank() as d:
        row = stats.metrics(d, search=True)
        assert row["search/retrievals"] == 8  # 2 tasks × 2 rollouts × 2 steps
        assert (row["search/retrieval_failures"], row["search/bad_replies"]) == ((0, 8) if case == "bad_reply" else (8, 0))
        where = kw.get("retriever_url") or f"the built-in BM25 over {data / 'corpus'}"
        assert f"WARNING search: all 8 retrievals from {where}" in capsys.readouterr().out
        with pytest.raises(SystemExit, match="--require_endpoint"):
            stats.metrics(d, require=True)


@needs_qa
def test_a_hung_retriever_costs_one_timeout_per_turn_for_all_envs():
    server, url = serve(Hang)
    make = search_envs(QA_DATA, retriever_url=url + "/retrieve", timeout=1.0, retries=2)
    tasks = make().task_ids()[:4]
    try:
        t0 = time.perf_counter()
        _, stats = C.collect(SearchPolicy(), make, tasks, 2, 1024, 64, 1.0, 1.0)
        waited = time.perf_counter() - t0
    finally:
        server.shutdown()
    assert stats.retrievals == stats.retrieval_failures == 16  # 8 envs × 2 steps
    assert 2.0 <= waited < 5.0, waited  # 2 turns × 1 s, the 8 searches of a turn at once (before: 8 × 2 × 3 × 10 s)


def test_the_retrieve_contract_is_checked():
    good = {"result": [[{"contents": '"T"\nbody'}], [{"document": {"contents": "x"}, "score": 1.0}]]}
    assert envs.check_retrieve_reply(good, 2) == good["result"]
    for bad in ({"result": "oops"}, {"result": [[{"contents": "x"}]]}, {"results": [[]]}, [[]],
                {"result": [[{"contents": 3}], []]}, {"result": [["just a string"], []]}):
        with pytest.raises(envs.BadRetrieverReply):
            envs.check_retrieve_reply(bad, 2)


@pytest.mark.slow
def test_dead_analyzer_counted_alike_on_one_and_two_ranks(tmp_path):
    url = closed_url("/v1")
    base = [str(HERE / "opid.py"), "--analyzer_url", url, "--updates", "1", "--tasks_per_update", "2",
            "--group_size", "2", "--eval_every", "0", "--endpoint_retries", "0"]
    one = run([sys.executable, *base, "--out_dir", str(tmp_path / "one")])
    two = run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), *base, "--out_dir", str(tmp_path / "two")])
    for res, out in ((one, "one"), (two, "two")):
        (row,) = rows_of(tmp_path / out)
        assert row["endpoint/analyzer/requests"] == row["endpoint/analyzer/failures"] == 4  # every trajectory
        assert row["analyzer/failed"] == 4 and row["analyzer/no_json"] == 0 and row["analyzer/requests"] == 4
        assert res.stdout.count(f"WARNING analyzer: all 4 requests to {url}/chat/completions failed") == 1
    res = subprocess.run([sys.executable, *base, "--out_dir", str(tmp_path / "req"), "--require_endpoint"], cwd=HERE,
                         env=env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 1 and "--require_endpoint" in res.stderr and "Traceback" not in res.stderr


# ---- every bad flag: one line naming it, before anything loads

BAD_FLAGS = [(["--save_every", "0"], "--save_every must be ≥ 1"), (["--micro_batch", "0"], "--micro_batch must be ≥ 1"),
             (["--group_size", "-1"], "--group_size must be ≥ 2"), (["--group_size", "0"], "--group_size must be ≥ 2"),
             (["--group_size", "1"], "group-relative advantages compare"),
             (["--tasks_per_update", "0"], "--tasks_per_update must be ≥ 1"), (["--updates", "-1"], "--updates must be ≥ 1"),
             (["--updates", "0"], "--updates must be ≥ 1"), (["--max_steps", "0"], "--max_steps must be ≥ 1"),
             (["--eval_tasks", "0"], "--eval_tasks must be ≥ 1"), (["--endpoint_timeout", "0"], "--endpoint_timeout must be ≥"),
             (["--model", "/no/such/model"], "--model /no/such/model: no HF model directory"),
             (["--model", "runs/none/final"], "no HF model directory"),
             (["--model", "./gpt2"], "no HF model directory"),
             (["--env", "alfworld", "--data_dir", "/no/such/dir"], "--env alfworld needs its data"),
             (["--env", "search", "--data_dir", "/no/such/dir"], "--env search needs its data"),
             (["--engine", "hf", "--rollout_is", "token"], "only --engine vllm returns"),
             (["--rollout_is_cap", "0.5"], "--rollout_is_cap must be ≥ 1"),
             (["--gpu_memory_utilization", "1.5"], "--gpu_memory_utilization is a fraction ≤ 1"),
             (["--cpu_kv_cache_gb", "0"], "--cpu_kv_cache_gb must be ≥"),
             (["--env", "webshop", "--data_dir", "/no/such/dir"], "--env webshop needs its data"),
             (["--env", "webshop", "--eval_split", "both"], "--env webshop has one held-out split"),
             (["--env", "search", "--env_rules", "strict"], "--env_rules strict is ALFWorld's admissibility rule")]


@pytest.mark.parametrize("method", ["seed", "opid", "grsd"])
@pytest.mark.parametrize("argv,message", BAD_FLAGS)
def test_bad_flags_are_refused_before_anything_loads(method, argv, message, monkeypatch, tmp_path):
    mod = importlib.import_module(method)
    monkeypatch.setattr(sys, "argv", [f"{method}.py", "--out_dir", str(tmp_path), *argv])
    with pytest.raises(SystemExit, match=re.escape(message)):
        mod.resolve(harness.parse_args(mod.Args, mod.PAPER, mod.LAPTOP))
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("method", ["seed", "opid", "grsd"])
def test_a_bad_flag_exits_in_one_line_without_a_traceback(method, tmp_path):
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, str(HERE / f"{method}.py"), "--group_size", "1", "--out_dir", str(tmp_path)],
                         cwd=HERE, env=env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and res.stderr.strip().count("\n") == 0 and "--group_size" in res.stderr
    assert time.perf_counter() - t0 < 30 and not any(tmp_path.iterdir())  # imports only: no model, no env


@pytest.mark.slow
def test_an_unreachable_hub_fails_in_seconds_after_the_settings_line(tmp_path):
    """Issue 41: `--env alfworld` without --model (a hub id) on a machine whose hub never answers took ~50 s of the
    hub client's retries, then a 77-line traceback, and the settings line never printed. The hub here accepts
    connections and never replies; the run must print its settings, then stop in one line naming --model tiny."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held = []
    threading.Thread(target=lambda: [held.append(server.accept()) for _ in range(16)], daemon=True).start()
    hub = {**env(), "HF_ENDPOINT": f"http://127.0.0.1:{server.getsockname()[1]}", "HF_HOME": str(tmp_path / "hf")}
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, str(HERE / "seed.py"), "--env", "alfworld", "--data_dir",
                          str(SHARED / "alfworld"), "--out_dir", str(tmp_path / "run")],
                         env=hub, capture_output=True, text=True, timeout=120)
    took = time.perf_counter() - t0
    server.close()
    assert res.returncode == 1 and res.stderr.strip().count("\n") == 0, res.stderr[-2000:]
    assert "did not answer within 5 s" in res.stderr and "pass --model tiny" in res.stderr, res.stderr
    assert res.stdout.startswith("[seed] env alfworld, model Qwen/Qwen2.5-3B-Instruct, engine hf, updates 150")
    assert took < 25, took  # imports (~5-10 s on 2 busy cores) + the 5 s probe


def test_a_cached_hub_model_loads_at_once_when_the_hub_does_not_answer(tmp_path, monkeypatch):
    """The probe's other side: a hub that does not answer is not asked further, and a model the cache holds is
    used (HF_HUB_OFFLINE unset); a model it does not hold stops in the one line naming --model tiny."""
    import huggingface_hub.constants as hub_constants
    from conftest import HUB_ID, offline_hub
    cache = offline_hub(tmp_path)["HF_HUB_CACHE"]
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", cache)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    asked = []
    monkeypatch.setattr(models, "hub_unreachable", lambda name: asked.append(name) or "no answer (test)")
    monkeypatch.setattr(models, "fetch_snapshot", lambda name, offline, real=models.fetch_snapshot:
                        real(name, offline) if offline else pytest.fail("asked the hub after no answer"))
    path = models.resolve_model(HUB_ID)
    assert asked == [HUB_ID] and path.startswith(cache) and os.path.isfile(os.path.join(path, "config.json"))
    with pytest.raises(SystemExit, match=r"no answer \(test\)\); pass --model tiny"):
        models.resolve_model("nobody/nothing")


@pytest.mark.parametrize("hub_id", ["gpt2", "Qwen/Qwen2.5-3B-Instruct"])
def test_hub_ids_are_not_taken_for_missing_paths(hub_id, tmp_path):
    import opid
    assert opid.resolve(opid.Args(model=hub_id, out_dir=str(tmp_path))).model == hub_id
