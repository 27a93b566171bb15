"""Writes the tiny Hugging Face checkpoints and reference outputs under tests/fixtures/hf/.

Needs torch and transformers, which nothing else in the project does. For each architecture it
builds a small randomly initialised model (weights, norm scales and biases all random, so that
every tensor's mapping matters), saves it with `save_pretrained(safe_serialization=True)` and
writes `reference.npz` next to it:

  tokens   [B, S] int32  left-padded prompts (pad id 0)
  mask     [B, S] bool   attention mask (False on padding)
  logits   [B, S, V] float32  the transformers model's logits, positions counted from the first
                              real token (0 on padding rows' pad positions)
  greedy   [B, T] int32  `generate(do_sample=False)` continuation (KV cache, no EOS)

`manifest.json` records the torch / transformers versions and what each fixture exercises.

  python tools/make_hf_fixtures.py [--out=tests/fixtures/hf] [--check_export]

--check_export also loads every fixture with `jaxrl_llm.models.hf`, exports it again and checks
that transformers reads the export back to the same logits.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

import numpy as np
import torch
import transformers

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, INTER = 64, 32, 2, 4, 2, 64
BATCH, PROMPT_LEN, NEW_TOKENS = 3, 7, 6
PADS = (0, 2, 4)  # left padding of each row
V5 = int(transformers.__version__.split(".")[0]) >= 5

# name -> (model type, config kwargs, save options, what it exercises)
FIXTURES = {
  "llama": (
    "llama",
    {"rope_theta": 5e5, "tie_word_embeddings": False},
    {"max_shard_size": "40KB"},
    "rope_theta 5e5, untied lm_head, sharded safetensors with an index",
  ),
  "llama3_rope_bf16": (
    "llama",
    {
      "rope_theta": 5e5,
      "tie_word_embeddings": True,
      "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
      },
    },
    {"dtype": torch.bfloat16},
    "Llama 3.1 RoPE scaling, tied embeddings, bfloat16 weights",
  ),
  "qwen2": (
    "qwen2",
    {"tie_word_embeddings": True},
    {},
    "random q/k/v biases, tied embeddings",
  ),
  "qwen3": (
    "qwen3",
    {"head_dim": 16, "tie_word_embeddings": False},
    {},
    "explicit head_dim 16 != hidden/heads, q_norm/k_norm",
  ),
  "qwen3_moe": (
    "qwen3_moe",
    {
      "num_experts": 4,
      "num_experts_per_tok": 2,
      "moe_intermediate_size": 16,
      "norm_topk_prob": True,
      "tie_word_embeddings": False,
    },
    {},
    "4 experts top-2, renormalised gates, every layer MoE",
  ),
  "qwen3_moe_mixed": (
    "qwen3_moe",
    {
      "num_experts": 4,
      "num_experts_per_tok": 2,
      "moe_intermediate_size": 16,
      "norm_topk_prob": False,
      "mlp_only_layers": [0],
      "tie_word_embeddings": True,
    },
    {},
    "un-normalised gates, layer 0 dense via mlp_only_layers (moe_every=2), tied embeddings",
  ),
  "mixtral": (
    "mixtral",
    {"num_local_experts": 4, "num_experts_per_tok": 2, "tie_word_embeddings": False},
    {},
    "w1/w3/w2 experts, block_sparse_moe router, default rope_theta 1e6 and eps 1e-5",
  ),
}

_CONFIGS = {
  "llama": "LlamaConfig",
  "qwen2": "Qwen2Config",
  "qwen3": "Qwen3Config",
  "qwen3_moe": "Qwen3MoeConfig",
  "mixtral": "MixtralConfig",
}


def make_config(model_type: str, kwargs: dict):
  """A tiny transformers config (RoPE keyword spelled for the installed major version)."""
  kwargs = dict(kwargs)
  scaling = kwargs.pop("rope_scaling", None)
  if V5:
    theta = kwargs.pop("rope_theta", None)
    if scaling or theta:
      params = dict(scaling or {"rope_type": "default"})
      if theta:
        params["rope_theta"] = theta
      kwargs["rope_parameters"] = params
  elif scaling:
    kwargs["rope_scaling"] = scaling
  cls = getattr(transformers, _CONFIGS[model_type])
  return cls(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    intermediate_size=INTER,
    attn_implementation="eager",
    **kwargs,
  )


def randomise(model, gen: torch.Generator) -> None:
  """Random weights of unit-scale activations; norm scales near 1; biases clearly non-zero."""
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
      if "norm" in name:
        p.copy_(1.0 + 0.2 * noise)
      elif name.endswith(".bias"):
        p.copy_(0.5 * noise)
      elif "embed_tokens" in name:
        p.copy_(noise)
      else:
        p.copy_(noise / p.shape[-1] ** 0.5)


def batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
  """Left-padded prompts, their mask and positions counted from the first real token."""
  tokens = torch.randint(3, VOCAB, (BATCH, PROMPT_LEN), generator=gen)
  mask = torch.ones(BATCH, PROMPT_LEN, dtype=torch.long)
  for row, pad in enumerate(PADS):
    tokens[row, :pad] = 0
    mask[row, :pad] = 0
  positions = (mask.cumsum(-1) - 1).clamp(min=0)
  return tokens, mask, positions


def greedy_by_full_forward(model, tokens, mask, steps):
  """Greedy continuation by repeated full forwards (no cache).

  Returns it and the smallest gap between the best and second-best logit over its steps and,
  for MoE models, between the K-th and (K+1)-th router logit over all real tokens, so that a
  fixture never sits on a near tie that rounding could flip.
  """
  out, margin = [], float("inf")
  for step in range(steps + 1):
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    moe = getattr(model.config, "num_experts_per_tok", None)
    result = model(
      input_ids=tokens,
      attention_mask=mask,
      position_ids=positions,
      output_router_logits=bool(moe) and step == steps,
    )
    if step == steps:
      for router in getattr(result, "router_logits", None) or ():
        top = torch.topk(router.reshape(*tokens.shape, -1), moe + 1, dim=-1).values
        gap = (top[..., moe - 1] - top[..., moe])[mask.bool()]
        margin = min(margin, float(gap.min()))
      break
    logits = result.logits[:, -1]
    top2 = torch.topk(logits, 2, dim=-1).values
    margin = min(margin, float((top2[:, 0] - top2[:, 1]).min()))
    nxt = logits.argmax(-1, keepdim=True)
    out.append(nxt)
    tokens = torch.cat([tokens, nxt], 1)
    mask = torch.cat([mask, torch.ones_like(nxt)], 1)
  return torch.cat(out, 1), margin


def build(name: str, out_dir: str, seed: int) -> dict:
  """Writes one fixture directory; returns its manifest entry."""
  model_type, kwargs, save_opts, what = FIXTURES[name]
  path = os.path.join(out_dir, name)
  dtype = save_opts.get("dtype")
  for attempt in range(20):  # re-draw until no decision is a near tie
    gen = torch.Generator().manual_seed(seed + 1000 * attempt)
    torch.manual_seed(seed + 1000 * attempt)
    model = transformers.AutoModelForCausalLM.from_config(make_config(model_type, kwargs))
    randomise(model, gen)
    shutil.rmtree(path, ignore_errors=True)
    shard = {k: v for k, v in save_opts.items() if k == "max_shard_size"}
    (model.to(dtype) if dtype is not None else model).save_pretrained(
      path, safe_serialization=True, **shard
    )
    # References come from the checkpoint as saved, read back in float32.
    model = transformers.AutoModelForCausalLM.from_pretrained(
      path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tokens, mask, positions = batch(gen)
    with torch.no_grad():
      logits = model(input_ids=tokens, attention_mask=mask, position_ids=positions).logits
      manual, margin = greedy_by_full_forward(model, tokens, mask, NEW_TOKENS)
    if margin > 1e-2:
      break
  else:
    raise RuntimeError(f"{name}: no seed gave decision margins above 1e-2")
  model.generation_config.eos_token_id = None
  model.generation_config.pad_token_id = 0
  with torch.no_grad():
    generated = model.generate(
      input_ids=tokens,
      attention_mask=mask,
      max_new_tokens=NEW_TOKENS,
      min_new_tokens=NEW_TOKENS,
      do_sample=False,
    )[:, PROMPT_LEN:]
  if not torch.equal(generated, manual):
    raise RuntimeError(f"{name}: generate() differs from the full-forward greedy loop")
  if os.path.exists(os.path.join(path, "generation_config.json")):
    os.remove(os.path.join(path, "generation_config.json"))
  valid = mask.bool().numpy()
  np.savez_compressed(
    os.path.join(path, "reference.npz"),
    tokens=tokens.numpy().astype(np.int32),
    mask=valid,
    logits=np.where(valid[..., None], logits.numpy(), 0.0).astype(np.float32),
    greedy=generated.numpy().astype(np.int32),
  )
  return {
    "model_type": model_type,
    "exercises": what,
    "dtype": str(dtype or torch.float32).replace("torch.", ""),
    "seed": seed + 1000 * attempt,
    "decision_margin": round(margin, 4),
  }


def check_export(out_dir: str) -> None:
  """Our import -> export must read back into transformers with the same logits."""
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from jaxrl_llm.models import hf

  for name in FIXTURES:
    ref = np.load(os.path.join(out_dir, name, "reference.npz"))
    cfg, params = hf.load_checkpoint(os.path.join(out_dir, name))
    with tempfile.TemporaryDirectory() as tmp:
      hf.save_checkpoint(tmp, cfg, params, model_type=FIXTURES[name][0], max_shard_bytes=40_000)
      model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp, attn_implementation="eager", dtype=torch.float32
      ).eval()
    tokens, mask = torch.from_numpy(ref["tokens"]).long(), torch.from_numpy(ref["mask"]).long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
      logits = model(input_ids=tokens, attention_mask=mask, position_ids=positions).logits
    diff = np.abs(np.where(ref["mask"][..., None], logits.numpy(), 0.0) - ref["logits"]).max()
    print(f"{name}: export read back by transformers, max |logit diff| = {diff:.2e}")
    assert diff <= 1e-4, name


def main(argv=None) -> None:
  """Writes all fixtures (and optionally checks our export against transformers)."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=os.path.join("tests", "fixtures", "hf"))
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--check_export", action="store_true")
  args = parser.parse_args(argv)
  torch.use_deterministic_algorithms(True)
  os.makedirs(args.out, exist_ok=True)
  manifest = {
    "transformers_version": transformers.__version__,
    "torch_version": torch.__version__.split("+")[0],
    "batch": {"rows": BATCH, "prompt_len": PROMPT_LEN, "left_pad": list(PADS)},
    "new_tokens": NEW_TOKENS,
    "fixtures": {},
  }
  for i, name in enumerate(FIXTURES):
    manifest["fixtures"][name] = build(name, args.out, args.seed + i)
    print(f"{name}: {manifest['fixtures'][name]}")
  with open(os.path.join(args.out, "manifest.json"), "w") as f:
    json.dump(manifest, f, indent=2)
    f.write("\n")
  if args.check_export:
    check_export(args.out)


if __name__ == "__main__":
  main()
