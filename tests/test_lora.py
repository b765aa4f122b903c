"""LoRA (--lora_rank, issue 57): π_ref is the base exactly, the engines get W + (α/r)·B·A, checkpoints hold the
adapter and resume exactly, and bad flags are one line. (The vLLM engine after a LoRA update: test_vllm.py.)"""
from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import common as C
import harness
import models
import opid
from conftest import HERE, env, rows_of, run

pytest.importorskip("peft", reason="LoRA needs peft (requirements.txt)")


def lora_args(**kw):
    return SimpleNamespace(**{"lora_rank": 4, "lora_alpha": 8.0, "lora_dropout": 0.0, "seed": 0, "bf16": False,
                              "lora_targets": models.LORA_TARGETS, **kw})


def trained_adapter(d, rank: int = 4, seed: int = 1):
    """A sharded tiny LoRA policy whose adapters are not at their start (B = 0 would make every check trivial)."""
    policy = models.load_policy("tiny", "tiny", lora_args(lora_rank=rank))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in models.lora_layers(policy).values():
            layer.lora_B["default"].weight.normal_(0.0, 0.05, generator=g)
    return models.shard(policy, d, bf16=False)


PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13]]
RESPONSES = [[20, 21, 22, 23], [30, 31]]


def scores(model, d):
    return torch.cat(C.score(model, PROMPTS, RESPONSES, 8, d))


def test_the_reference_is_the_base_model_exactly(d):
    """π_ref = the policy with its adapters off: bit-equal log-probs to the base model itself (sharded the same way),
    while the adapted policy's differ."""
    policy = trained_adapter(d)
    base = models.shard(models.load_model("tiny", 0), d, bf16=False, trainable=False)
    ref, own = scores(models.AdapterOff(policy), d), scores(base, d)
    assert torch.equal(ref, own)
    assert (scores(policy, d) - own).abs().max() > 1e-3


def test_only_the_adapters_train(d):
    policy = trained_adapter(d)
    trained = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    # 2 layers × 7 projections × (A: r × in, B: out × r) at r = 4 of the 128-wide, 256-MLP tiny model
    per_layer = 4 * (128 + 128) + 4 * (128 + 64) + 4 * (128 + 64) + 4 * (128 + 128) + 2 * 4 * (128 + 256) \
        + 4 * (256 + 128)
    assert sum(p.numel() for n, p in policy.named_parameters() if p.requires_grad) == 2 * per_layer


def test_the_engine_gets_the_merged_weights_and_then_the_adapted_ones_alone(d):
    """HFEngine.sync: W + (α/r)·B·A under the base's names (the engine's log-probs equal the trainer's, fp32), every
    weight at the first sync, the adapted ones alone at the next; an engine left on the base is off."""
    policy = trained_adapter(d)
    engine = models.HFEngine(models.load_model("tiny", 0), models.load_tokenizer("tiny"), d.device)
    stale = scores(engine.model, d)
    engine.sync(policy)
    assert (scores(engine.model, d) - scores(policy, d)).abs().max() < 1e-5
    assert (stale - scores(policy, d)).abs().max() > 1e-3
    names = [n for n, _ in models.full_state_dict_iter(policy, torch.float32, adapted_only=True)]
    assert len(names) == 2 * 7 and all(n.startswith("model.layers.") and n.endswith("_proj.weight") for n in names)
    with torch.no_grad():
        for layer in models.lora_layers(policy).values():
            layer.lora_A["default"].weight.mul_(-1.0)  # (in place on the shards: a changed adapter)
    engine.sync(policy)  # the adapted weights alone
    assert (scores(engine.model, d) - scores(policy, d)).abs().max() < 1e-5


def test_activation_checkpointing_gives_the_adapters_the_same_gradients(d):
    """The GPU default (--grad_ckpt) with LoRA: the frozen base's recomputed layers pass the gradient on to the
    adapters (non-reentrant checkpointing needs no input that requires grad)."""
    grads = []
    for ckpt in (False, True):
        policy = models.load_policy("tiny", "tiny", lora_args())
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for layer in models.lora_layers(policy).values():
                layer.lora_B["default"].weight.normal_(0.0, 0.05, generator=g)
        policy = models.shard(policy, d, bf16=False, grad_ckpt=ckpt)
        logp, mask = C.sequence_logprobs(policy, PROMPTS, RESPONSES, d.device)
        (-(logp * mask).sum()).backward()
        grads.append({n: p.grad.full_tensor().clone() for n, p in policy.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and all(grads[0][k].abs().max() > 0 for k in grads[0])
    assert all(torch.allclose(grads[0][k], grads[1][k], atol=1e-6) for k in grads[0])


def test_merged_weights_equal_peft_merge_and_unload(d):
    """full_state_dict_iter's W + (α/r)·B·A is peft's own merge, tensor by tensor, under the base model's names."""
    policy = trained_adapter(d)
    ours = {n: t.clone() for n, t in models.full_state_dict_iter(policy, torch.float32)}
    plain = models.load_policy("tiny", "tiny", lora_args())
    plain.load_state_dict({k: v.full_tensor() if hasattr(v, "full_tensor") else v
                           for k, v in policy.state_dict().items()})
    merged = plain.merge_and_unload().state_dict()
    assert set(ours) == set(merged)
    assert all(torch.allclose(ours[k], merged[k], atol=1e-6) for k in ours)


@pytest.mark.parametrize("flags,message", [
    (dict(lora_rank=-1), "--lora_rank must be ≥ 0"),
    (dict(lora_rank=8, lora_alpha=0.0), "--lora_alpha must be > 0"),
    (dict(lora_rank=8, lora_dropout=1.0), "--lora_dropout is a probability < 1"),
])
def test_bad_lora_flags_are_one_line(flags, message):
    with pytest.raises(SystemExit, match=message):
        opid.resolve(opid.Args(**flags))


def test_an_unknown_target_lists_the_models_linear_modules():
    with pytest.raises(SystemExit, match="--lora_targets qkv: no such linear module in tiny; its linear modules: "
                                         "down_proj,gate_proj,k_proj,lm_head,o_proj,q_proj,up_proj,v_proj"):
        models.load_policy("tiny", "tiny", lora_args(lora_targets="q_proj,qkv"))


def test_a_missing_peft_names_the_requirement(monkeypatch):
    import importlib.util
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else find(name, *a))
    with pytest.raises(SystemExit, match=r"--lora_rank needs peft: pip install peft==0.21.2"):
        opid.resolve(opid.Args(lora_rank=8))


# ------------------------------------------------------------------------------------------------ whole runs

# the committed backbone (household, small room): its groups are not tied, so the adapter moves (the tiny model's
# replies are all malformed: every advantage 0)
FLAGS = ["--lora_rank", "8", "--updates", "2", "--model", str(HERE / "docs" / "results" / "backbone"),
         "--household_room", "small", "--max_steps", "4", "--tasks_per_update", "2", "--group_size", "4",
         "--eval_every", "0", "--save_every", "1", "--analyzer_max_tokens", "24", "--lr", "1e-3"]


def untimed(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]


@pytest.mark.slow
def test_lora_checkpoints_resume_exactly_and_final_holds_a_merged_model(tmp_path):
    """opid.py --lora_rank 8 on 2 FSDP ranks, 2 updates straight vs 1 update then --resume: the same rows and adapter
    (the sharded adapter and its AdamW state saved and restored); update1/ and final/ are peft adapters, final/merged
    an HF model equal to the adapter merged into the base; --eval_only scores the adapter directory and its merged
    model alike; a --resume with other LoRA flags is refused in one line."""
    from safetensors.torch import load_file
    from conftest import free_port
    straight, split = tmp_path / "straight", tmp_path / "split"
    py = [sys.executable, str(HERE / "opid.py")]
    def ranks():
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                str(free_port()), str(HERE / "opid.py")]
    run(ranks() + ["--out_dir", str(straight), *FLAGS])
    run(ranks() + ["--out_dir", str(split), *FLAGS, "--updates", "1"])
    res = run(ranks() + ["--out_dir", str(split), *FLAGS, "--resume"])
    assert "resuming" in res.stdout and "update1" in res.stdout
    assert untimed(rows_of(split)) == untimed(rows_of(straight))
    a, b = (load_file(p / "final" / "adapter_model.safetensors") for p in (straight, split))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(a[k].abs().max() > 0 for k in a if "lora_B" in k), "the adapter never moved: the test is void"
    assert (straight / "update1" / "adapter_config.json").is_file() and not (straight / "update1" / "merged").exists()
    assert json.load(open(straight / "final" / "adapter_config.json"))["r"] == 8
    assert json.load(open(straight / "args.json"))["lora_rank"] == 8
    # final/merged: a plain HF directory, equal to peft's merge of the adapter
    from transformers import AutoModelForCausalLM
    merged = AutoModelForCausalLM.from_pretrained(straight / "final" / "merged").state_dict()
    peft_merged = models.load_model(str(straight / "final"), 0).state_dict()
    assert all(torch.allclose(merged[k], peft_merged[k], atol=1e-6) for k in peft_merged)
    # --eval_only on the adapter and on its merged model: keyed sampling, the same weights -> the same episodes
    for name, model in (("ev_adapter", straight / "final"), ("ev_merged", straight / "final" / "merged")):
        run(py + ["--eval_only", "--model", str(model), "--out_dir", str(tmp_path / name), "--eval_tasks", "2",
                  "--household_room", "small", "--max_steps", "4"])
    assert (tmp_path / "ev_adapter" / "eval" / "0.jsonl").read_text() == \
        (tmp_path / "ev_merged" / "eval" / "0.jsonl").read_text()
    res = subprocess.run(py + ["--out_dir", str(split), *FLAGS, "--lora_rank", "16", "--updates", "3",
                               "--resume"], cwd=HERE, env=env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 1 and res.stderr.strip().splitlines()[-1] == (
        f"--resume: --lora_rank 16 conflicts with the run in {split}, which started with --lora_rank 8; pass the "
        f"run's LoRA flags, or --overwrite")


@pytest.mark.slow
def test_seed_with_lora_merges_the_stage1_adapter_into_theta_sft(tmp_path):
    """SEED --lora_rank 8: stage 1 trains an adapter by SFT and saves stage1/merged (θ_sft = the base + that adapter,
    merged); stage 2 trains a fresh adapter on θ_sft with π_ref = θ_sft (its adapter off): KL 0 at update 0, where
    a reference left at the base would not be. final/'s adapter names stage1/merged as its base."""
    import threading
    from http.server import ThreadingHTTPServer

    from safetensors.torch import load_file
    from test_seed import Annotator
    server = ThreadingHTTPServer(("127.0.0.1", 0), Annotator)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    run([sys.executable, str(HERE / "seed.py"), "--out_dir", str(tmp_path), "--annotator_url", url, "--lora_rank", "8",
         "--updates", "1", "--sft_tasks", "12", "--sft_rollouts", "1", "--sft_lr", "1e-3"])
    server.shutdown()
    stage1, stage2 = rows_of(tmp_path)
    assert stage1["sft/examples"] > 0 and stage1["sft/loss_last"] < stage1["sft/loss_first"]
    sft = load_file(tmp_path / "stage1" / "merged" / "model.safetensors")
    base = models.load_model("tiny", 0).state_dict()
    moved = [k for k in sft if not torch.equal(sft[k], base[k])]
    assert moved and all(k.endswith("_proj.weight") for k in moved)  # the adapted weights alone changed
    assert stage2["losses/kl"] == 0.0  # π_θ = θ_sft + a fresh adapter (B = 0) = π_ref at the first step
    assert json.load(open(tmp_path / "final" / "adapter_config.json"))["base_model_name_or_path"] == \
        str(tmp_path / "stage1" / "merged")


def test_bench_lora_table(tmp_path):
    """tools/bench.py --lora_rank: seconds per update (save excluded) and of the update phase, LoRA over full, from
    each run's rows, per method."""
    from tools import bench
    for m in bench.METHODS:
        for arm, total, update in (("", 10.0, 4.0), ("-lora", 8.0, 2.0)):
            for r in range(2):
                run_dir = tmp_path / f"{m}{arm}" / f"round{r}"
                run_dir.mkdir(parents=True)
                row = {"update": 0, "time/total": total + r, "time/save": 1.0, "time/update": update}
                (run_dir / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    text, summary = bench.lora_table(str(tmp_path), 8)
    assert "| grpo | 9.50 | 7.50 | 0.79× | 4.00 | 2.00 | 0.50× |" in text.splitlines()
    assert summary["opid"] == {"full_s": 9.5, "lora_s": 7.5, "update_full_s": 4.0, "update_lora_s": 2.0}
