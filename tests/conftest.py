"""Shared test setup for tests/ (test_losses.py, at the root, needs none of it). The checkout's modules import from
the repository root (`python -m pytest` puts it on sys.path), the evidence tools as `from tools import experiment`.
A child process gets a user's environment: it is started as the docs tell a user to start it (`python seed.py`,
`torchrun … seed.py`, `python -m tools.<name>`, from the checkout root), and nothing adds the checkout to its
PYTHONPATH, so a script that imports only because of that variable fails its test. The one exception is a test
module run as its own worker (`worker_env`), which is not a user command.

The fixtures several test modules use (`d`: the 1-rank gloo group, `tok`: the tiny tokenizer) live here, and so do
the plain helpers several modules share; a test module imports those with `from conftest import …` (never from
another test module). The 2-rank workers (`python -m torch.distributed.run tests/test_X.py OUT`) import them the
same way (they are started with `worker_env`).

Markers: `slow` marks the tests that spawn processes (seed.py / opid.py / grsd.py / tools/*.py, torchrun), start
vLLM, or play real benchmark games; `python -m pytest -q -m "not slow"` is the fast tier, `python -m pytest -q` the
full suite (what CI runs)."""
import contextlib
import functools
import json
import os
import socket
import subprocess
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import common as C
import envs
import models

HERE = Path(__file__).resolve().parent.parent  # the checkout
TESTS = HERE / "tests"
SHARED = Path(os.environ.get("SHARED_DATA") or HERE.parent / "shared" / "data")
DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: spawns processes (a method script, torchrun, tools/*.py), starts vLLM "
                                       "or plays real benchmark games; deselect with -m \"not slow\"")


# ------------------------------------------------------------------------------------------------ fixtures

@pytest.fixture(scope="module")
def d():
    """A 1-rank gloo group, as `python opid.py` uses. When another test module already formed one (pytest keeps it
    for the session) it is reused; the group made here is torn down again so later modules can form their own."""
    if dist.is_initialized():
        cuda = torch.cuda.is_available()
        yield C.Dist(dist.get_rank(), dist.get_world_size(),
                     torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu"))
        return
    saved = {k: os.environ.get(k) for k in DIST_ENV}
    yield models.init_distributed(seed=0)
    dist.destroy_process_group()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session", autouse=True)
def scratch_session_cwd(tmp_path_factory):
    """Every fixture, whatever its scope, runs outside the checkout: the session starts in an empty directory of its
    own, before any module-scoped fixture builds `Args` with a default --out_dir (runs/<method>) that the docs' own
    runs may already fill in the checkout."""
    before = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("session_cwd"))
    yield
    os.chdir(before)


@pytest.fixture(autouse=True)
def scratch_cwd(tmp_path_factory):
    """Hermetic tests: each test runs in an empty working directory of its own, so a default --out_dir
    (runs/<method>, relative) never meets the runs/ the README's Quick start leaves in the checkout, and nothing a
    test writes lands there. Files of the checkout are read through HERE. (Not monkeypatch.chdir: a test's own
    monkeypatch.undo() would take the test back to the checkout.)"""
    before = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    yield
    os.chdir(before)


@pytest.fixture(scope="module")
def tok():
    return models.load_tokenizer("tiny")


@contextlib.contextmanager
def one_rank():
    """The 1-rank gloo group of `python opid.py` (another module's, when pytest already holds one; else formed
    here and torn down again, with the environment restored)."""
    if dist.is_initialized():
        yield C.Dist(dist.get_rank(), dist.get_world_size(), torch.device("cpu"))
        return
    saved = {k: os.environ.get(k) for k in DIST_ENV}
    try:
        yield models.init_distributed(seed=0)
    finally:
        dist.destroy_process_group()
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


# ------------------------------------------------------------------------------------------------ processes

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env():
    """A child's environment: this one without the process-group variables of a group pytest may hold (a plain
    `python opid.py` child would rendezvous on its port: EADDRINUSE), with 1 OpenMP thread, no tokenizer threads,
    unbuffered output."""
    return {**clean_env(), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def clean_env():
    """A user's environment: this one without the process-group variables of a group pytest may hold (a child would
    rendezvous on its port), unbuffered. The checkout is not added to PYTHONPATH: a child imports the root modules
    the way a user's command does, from the script's folder (`python seed.py`) or the working directory
    (`python -m tools.X` with cwd = the checkout)."""
    out = {k: v for k, v in os.environ.items() if k not in DIST_ENV + ("LOCAL_WORLD_SIZE",)}
    out["PYTHONUNBUFFERED"] = "1"
    return out


def worker_env():
    """For a test module run as its own worker (`python tests/test_X.py CHILD`, `torchrun tests/test_seed.py OUT`),
    not a user command: its sys.path[0] is tests/, so it gets the checkout on PYTHONPATH to import the root modules."""
    out = env()
    out["PYTHONPATH"] = os.pathsep.join([str(HERE)] + ([out["PYTHONPATH"]] if out.get("PYTHONPATH") else []))
    return out


def run(cmd, timeout=400):
    res = subprocess.run(cmd, cwd=HERE, env=env(), capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def rows_of(out):
    """metrics.jsonl of a run directory (blank lines skipped); every key must be documented in docs/metrics.md, so
    each test that reads a real run's rows fails on a key the code emits and the docs do not explain."""
    rows = [json.loads(line) for line in open(Path(out) / "metrics.jsonl") if line.strip()]
    missing = sorted({k for r in rows for k in r if not any(p.fullmatch(k) for p in documented_keys())})
    assert not missing, f"keys missing from docs/metrics.md: {missing}"
    return rows


@functools.cache
def documented_keys() -> list:
    """docs/metrics.md's keys, the first cell of its table rows; `<name>` matches one name without a slash."""
    import re
    keys = re.findall(r"^\| `([^`]+)` \|", (HERE / "docs" / "metrics.md").read_text(), re.M)
    return [re.compile(re.sub(r"<[^>]+>", "[^/]+", re.escape(k))) for k in keys]


def strict_rows_of(out):
    """metrics.jsonl of a run directory, every line a row (a blank line fails)."""
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


def check_checkpoint(path):
    """A saved final/ loads as a HF model + tokenizer and gives finite logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(path)
    t = AutoTokenizer.from_pretrained(path)
    ids = torch.tensor([t("You arrive at the countertop 1.")["input_ids"]])
    assert torch.isfinite(model(ids).logits).all()


# ------------------------------------------------------------------------------------------------ HTTP endpoints

class Server(envs.HTTPServer):
    """The tests' HTTP server (a thread per request, a backlog for a whole batch). A client that hung up before its
    answer was written (a timeout test: the handler is still asleep when the client gives up) is expected, not an
    error: socketserver would print its traceback in the middle of a later test's output."""

    def handle_error(self, request, client_address):
        import sys
        if not isinstance(sys.exc_info()[1], ConnectionError):  # BrokenPipeError, ConnectionResetError, …
            super().handle_error(request, client_address)


def serve(handler):
    """An OpenAI-style endpoint on localhost served by `handler`; returns (server, its /v1 URL)."""
    server = Server(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/v1"


class Quiet(BaseHTTPRequestHandler):
    """A request handler that logs nothing (the tests' servers)."""

    def log_message(self, *a):
        pass


def send_json(handler, obj):
    out = json.dumps(obj).encode()
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(out)))
    handler.end_headers()
    handler.wfile.write(out)


def reply(handler, content: str):
    """A chat-completion reply with `content`."""
    send_json(handler, {"choices": [{"message": {"role": "assistant", "content": content}}]})


# ------------------------------------------------------------------------------------------------ real trajectories

def play(env, tok, responses):
    """Turn raw response texts into a real Trajectory with real token ids from the real tokenizer."""
    tr = C.Trajectory(env_task_id(env), 0, env.task, env.family, env.observation)
    end = models.end_of_turn_id(tok)
    for text in responses:
        if callable(text):
            text = text(env)
        prompt = env.prompt()
        ids, _ = C.encode_prompt(tok, prompt, 1024)
        resp = tok(text, add_special_tokens=False)["input_ids"] + [end]
        obs, r, done, info = env.step(text)
        tr.turns.append(C.Turn(prompt, ids, resp, text, info["action"], info["valid"], obs, r, None, info["penalty"]))
        tr.won = info["won"]
        if done:
            break
    return tr


def env_task_id(env):
    return getattr(env, "task_id", "task")


def expert_turn(env):
    return envs.format_expert_response(env.expert_action(), "household")


def trajectories(tok, task_id, n_success, n_fail, steps=4):
    """n_success expert wins and n_fail failures (a few wandering moves and one malformed reply) on one real
    household task."""
    out = []
    for k in range(n_success + n_fail):
        env = envs.make_env("household", split="train", seed=0, max_steps=steps if k >= n_success else 30,
                            rules="strict")  # the hand-computed numbers of these tests use win = 1
        env.reset(task_id)
        if k < n_success:
            out.append(play(env, tok, [expert_turn] * 30))
        else:  # a failure: a few wandering moves and one malformed reply
            out.append(play(env, tok, ["<think>look around</think><action>look</action>", "no tags at all",
                                       "<think>x</think><action>inventory</action>", "<action>look</action>"]))
    return out


def expert_batch(tok):
    """Two groups on two real household tasks: a mixed group (2 expert wins, 2 failures) and a tied group
    (4 failures). Skills for all but two trajectories (those give no OPD tokens)."""
    ids = envs.make_env("household", split="train", seed=0).task_ids()
    g0, g1 = trajectories(tok, ids[0], 2, 2), trajectories(tok, ids[1], 0, 4)
    for tr in g1:
        tr.group = 1
    skills = ["Workflow: find the object, take it, then place it at the target receptacle."] * 8
    skills[1] = skills[5] = None
    return g0 + g1, skills


# ------------------------------------------------------------------------------------------------ hub ids, offline

HUB_ID = "rehearsal/tiny-qwen2"  # what a test passes as --model: a hub id, as every GPU user passes one


def offline_hub(root: Path, repo_id: str = HUB_ID, source: Path | None = None) -> dict:
    """A Hugging Face cache under `root` holding `repo_id` (a copy of the model directory `source`, or the tiny
    Qwen2-architecture model and its tokenizer) laid out as the hub client writes it (models--ORG--NAME/{refs/main,
    snapshots/<commit>/}), and the environment that serves it by hub id with no network (HF_HOME, HF_HUB_OFFLINE=1).
    Returns that environment's variables."""
    import shutil
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / "hub" / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    if not (snap / "config.json").is_file():
        if source is not None:
            shutil.copytree(source, snap)
        else:
            models.load_model("tiny", 0).save_pretrained(snap)
            models.load_tokenizer("tiny").save_pretrained(snap)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(commit)
    return {"HF_HOME": str(root), "HF_HUB_CACHE": str(root / "hub"), "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1"}


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc (Linux)."""
    parent = {}
    for p in Path("/proc").iterdir():
        try:
            parent[int(p.name)] = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError, IndexError):
            continue
    out, todo = [], [pid]
    while todo:
        me = todo.pop()
        kids = [c for c, pp in parent.items() if pp == me]
        out += kids
        todo += kids
    return out
