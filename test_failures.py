"""Failure modes of the shared machinery: replies a degenerate policy writes, and what the parsers make of them.

Run: python -m pytest -q test_failures.py"""
import gc
import json
import multiprocessing
import time

import pytest

import common as C
import envs
import grsd
import opid
import seed

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
    "opid.find_json_object": (opid.find_json_object, None),
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
        gc.collect()
        gc.freeze()  # the test process's own heap (torch) is not the parser's cost: keep collections off it
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
    "opid.find_json_object": (opid.find_json_object, "\n```json\n" + PLAIN + "\n```", json.loads(PLAIN)),
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
    assert opid.drop_trailing_commas(text) == want
