"""Writes tests/fixtures/peft/llama_lora/: LoRA adapters saved by PEFT itself on the llama
fixture (tests/fixtures/hf/llama), with the adapted model's reference logits.

Needs torch, transformers and peft, which nothing else in the project does. PEFT wraps the
fixture's model with rank-4 adapters (lora_alpha 8) on q_proj, v_proj, o_proj and down_proj of
every layer; A and B are drawn at random (B too, so that the adapters change the outputs) and
saved with `save_pretrained`. `reference.npz` holds the adapted model's float32 logits on the
llama fixture's own reference batch (its tokens and mask, positions counted from the first real
token) and `manifest.json` the versions that wrote it.

  python tools/make_peft_fixture.py [--out=tests/fixtures/peft]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

import numpy as np
import peft
import torch
import transformers

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(_REPO, "tests", "fixtures", "hf", "llama")
RANK, ALPHA, TARGETS = 4, 8.0, ["q_proj", "v_proj", "o_proj", "down_proj"]


def main(argv=None) -> None:
  """Builds the adapters, saves them and their reference logits."""
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--out", default=os.path.join(_REPO, "tests", "fixtures", "peft"))
  args = p.parse_args(argv)
  path = os.path.join(args.out, "llama_lora")
  torch.manual_seed(0)
  base = transformers.AutoModelForCausalLM.from_pretrained(
    BASE, dtype=torch.float32, attn_implementation="eager"
  )
  config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0)
  model = peft.get_peft_model(base, config)
  gen = torch.Generator().manual_seed(1)
  with torch.no_grad():
    for name, param in model.named_parameters():
      if "lora_" in name:
        param.copy_(0.2 * torch.randn(param.shape, generator=gen))
  shutil.rmtree(path, ignore_errors=True)
  model.save_pretrained(path)
  os.remove(os.path.join(path, "README.md"))  # PEFT's model card template
  with open(os.path.join(path, "adapter_config.json")) as f:
    saved = json.load(f)
  saved["base_model_name_or_path"] = "tests/fixtures/hf/llama"  # not this machine's path
  with open(os.path.join(path, "adapter_config.json"), "w") as f:
    json.dump(saved, f, indent=2, sort_keys=True)
  ref = np.load(os.path.join(BASE, "reference.npz"))
  tokens = torch.tensor(ref["tokens"], dtype=torch.long)
  mask = torch.tensor(ref["mask"], dtype=torch.long)
  positions = (mask.cumsum(-1) - 1).clamp(min=0)
  model.eval()
  with torch.no_grad():
    logits = model(input_ids=tokens, attention_mask=mask, position_ids=positions).logits
  np.savez(os.path.join(path, "reference.npz"), logits=logits.numpy().astype(np.float32))
  manifest = {
    "base": "tests/fixtures/hf/llama",
    "torch_version": torch.__version__,
    "transformers_version": transformers.__version__,
    "peft_version": peft.__version__,
    "rank": RANK,
    "lora_alpha": ALPHA,
    "target_modules": TARGETS,
  }
  with open(os.path.join(args.out, "manifest.json"), "w") as f:
    json.dump(manifest, f, indent=2)
  print(json.dumps(manifest))


if __name__ == "__main__":
  main()
