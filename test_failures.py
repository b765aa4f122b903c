"""Bad inputs and failing endpoints: a hung or dead endpoint or retriever costs a bounded time and is counted on
every rank (with a warning line, fatal under --require_endpoint), /retrieve replies are checked, the parsers are
linear on degenerate replies, and every bad flag is one line before anything loads."""
from __future__ import annotations

import importlib
import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import common as C
import envs
from test_runs import HERE, env, free_port, one_rank, rows_of, run
from test_seed import SHARED

QA_DATA = SHARED / "search_qa"
needs_qa = pytest.mark.skipif(not (QA_DATA / "corpus").is_dir(), reason=f"no Search-QA data at {QA_DATA}")

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
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def closed_url(path=""):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}{path}"


def test_a_hung_endpoint_costs_one_timeout_per_batch():
    server, url = serve(Hang)
    try:
        client = C.ChatClient(url + "/v1", "m", "judge", timeout=1.0, retries=2)
        t0 = time.perf_counter()
        out = client.complete_many(["x"] * 40, 0.0, 8)
        waited = time.perf_counter() - t0
    finally:
        server.shutdown()
    # 40 requests at once, none retried after its timeout (before: 3 tries × 120 s, 16 at a time: ~18 min)
    assert out == [None] * 40 and client.requests == client.failures == 40
    assert 1.0 <= waited < 3.0, waited


def test_a_refused_endpoint_is_retried_with_backoff_then_counted():
    client = C.ChatClient(closed_url("/v1"), "m", "analyzer", timeout=1.0, retries=1)
    t0 = time.perf_counter()
    assert client.complete_many(["x"] * 3, 0.0, 8) == [None] * 3
    assert 1.0 <= time.perf_counter() - t0 < 3.0  # 2 attempts, 1 s backoff between them
    assert client.requests == client.failures == 3


def test_endpoint_metrics_warn_once_and_require_endpoint_is_fatal(capsys):
    client = C.ChatClient(closed_url("/v1"), "m", "judge", timeout=1.0, retries=0)
    seen = [0, 0]
    with one_rank() as d:
        client.complete_many(["x"] * 2, 0.0, 8)
        assert C.endpoint_metrics(client, seen, d, False) == {"endpoint/judge/requests": 2,
                                                              "endpoint/judge/failures": 2}
        assert capsys.readouterr().out.count("WARNING judge: all 2 requests to ") == 1
        assert C.endpoint_metrics(client, seen, d, False) == {"endpoint/judge/requests": 0,  # per update
                                                              "endpoint/judge/failures": 0}
        assert "WARNING" not in capsys.readouterr().out
        client.complete_many(["x"], 0.0, 8)
        with pytest.raises(SystemExit, match="judge: all 1 requests .* failed this update .*--require_endpoint"):
            C.endpoint_metrics(client, seen, d, True)


class SearchPolicy:
    """A scripted policy (the real tiny tokenizer's ids of a well-formed search action, like the expert
    trajectories elsewhere): it searches at every step, so every step asks the retriever."""

    def __init__(self):
        self.tok = C.load_tokenizer("tiny")
        self.stops = C.stop_token_ids(self.tok)
        text = envs.format_expert_response("<search>VIVA Media</search>", "search")
        self.reply = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.convert_tokens_to_ids("<|im_end|>")]

    def generate(self, prompts, max_new_tokens, temperature, top_p=1.0):
        return [list(self.reply) for _ in prompts]


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
        row = stats.metrics(d)
        assert row["search/retrievals"] == 8  # 2 tasks × 2 rollouts × 2 steps
        assert (row["search/retrieval_failures"], row["search/bad_replies"]) == ((0, 8) if case == "bad_reply" else (8, 0))
        assert "WARNING search: all 8 retrievals failed this update" in capsys.readouterr().out
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
             (["--group_size", "1"], "group-relative advantages compare N ≥ 2"),
             (["--tasks_per_update", "0"], "--tasks_per_update must be ≥ 1"), (["--updates", "-1"], "--updates must be ≥ 1"),
             (["--updates", "0"], "--updates must be ≥ 1"), (["--max_steps", "0"], "--max_steps must be ≥ 1"),
             (["--eval_tasks", "0"], "--eval_tasks must be ≥ 1"), (["--endpoint_timeout", "0"], "--endpoint_timeout must be ≥"),
             (["--model", "/no/such/model"], "--model /no/such/model: no HF model directory"),
             (["--model", "runs/none/final"], "no HF model directory"),
             (["--env", "alfworld", "--data_dir", "/no/such/dir"], "--env alfworld needs its data"),
             (["--env", "search", "--data_dir", "/no/such/dir"], "--env search needs its data")]


@pytest.mark.parametrize("method", ["seed", "opid", "grsd"])
@pytest.mark.parametrize("argv,message", BAD_FLAGS)
def test_bad_flags_are_refused_before_anything_loads(method, argv, message, monkeypatch, tmp_path):
    mod = importlib.import_module(method)
    monkeypatch.setattr(sys, "argv", [f"{method}.py", "--out_dir", str(tmp_path), *argv])
    with pytest.raises(SystemExit, match=re.escape(message)):
        mod.resolve(C.parse_args(mod.Args, mod.PAPER, mod.TINY))
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("method", ["seed", "opid", "grsd"])
def test_a_bad_flag_exits_in_one_line_without_a_traceback(method, tmp_path):
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, str(HERE / f"{method}.py"), "--group_size", "1", "--out_dir", str(tmp_path)],
                         cwd=HERE, env=env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and res.stderr.strip().count("\n") == 0 and "--group_size" in res.stderr
    assert time.perf_counter() - t0 < 30 and not any(tmp_path.iterdir())  # imports only: no model, no env
