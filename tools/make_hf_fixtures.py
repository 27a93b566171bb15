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
The fixtures in `TOKENIZER_FIXTURES` also get the files of a model directory beside the weights:
a tiny BPE `tokenizer.json` (as many ids as the model's vocabulary), `tokenizer_config.json`,
`special_tokens_map.json`, `chat_template.jinja` and a `generation_config.json` with token ids
and sampling defaults (written by `write_model_files`, with the `tokenizers` package only).

  python tools/make_hf_fixtures.py [--out=tests/fixtures/hf] [--only=NAME,...] [--check_export]
  python tools/make_hf_fixtures.py --model_files_only   # needs neither torch nor transformers

--only rebuilds the named fixtures and keeps the others with their manifest entries (a rebuilt
entry records its torch / transformers versions where they differ from the manifest's); a
fixture's seed is fixed by its place in `FIXTURES`, so new ones go at the end. --check_export
also loads every fixture with `jaxrl_llm.models.hf`, exports it again (with the fixture as its
source) and checks that transformers reads the export back to the same logits, generation config
and tokenizer. --model_files_only rewrites only the tokenizer and generation files of the
`TOKENIZER_FIXTURES`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

import numpy as np

try:  # only --model_files_only runs without them
  import torch
  import transformers
except ImportError:
  torch = transformers = None

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, INTER = 64, 32, 2, 4, 2, 64
BATCH, PROMPT_LEN, NEW_TOKENS = 3, 7, 6
PADS = (0, 2, 4)  # left padding of each row

# name -> (model type, config kwargs, save options, what it exercises)
FIXTURES = {
  "llama": (
    "llama",
    {"rope_theta": 5e5, "tie_word_embeddings": False, "pad_token_id": 0},
    {"max_shard_size": "40KB"},
    "rope_theta 5e5, untied lm_head, sharded safetensors with an index, bos/eos/pad ids, "
    "tokenizer files and a generation_config.json",
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
    {"dtype": "bfloat16"},
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
  "mistral": (
    "mistral",
    {"sliding_window": None, "head_dim": 16, "tie_word_embeddings": False},
    {},
    "sliding_window null, explicit head_dim 16 != hidden/heads, untied lm_head",
  ),
}

# Fixtures written with the files of a model directory: name -> generation_config.json. Its
# token ids are those of `SPECIAL_TOKENS`; the sampling fields are those of a chat model.
TOKENIZER_FIXTURES = {
  "llama": {
    "bos_token_id": 1,
    "do_sample": True,
    "eos_token_id": [2, 3],
    "pad_token_id": 0,
    "temperature": 0.6,
    "top_p": 0.9,
  },
}
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<|eot_id|>")  # ids 0, 1, 2, 3
CHAT_TEMPLATE = (
  "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|eot_id|>"
  "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_CORPUS = (
  "the quick brown fox jumps over the lazy dog",
  "pack my box with five dozen liquor jugs",
  "how vexingly quick daft zebras jump",
  "the five boxing wizards jump quickly",
) * 8


def write_model_files(path: str, generation_config: dict) -> None:
  """Writes the tokenizer files and `generation_config` of a model directory into `path`.

  The tokenizer is a BPE (SentencePiece-style `▁` word marks, `<s>` prepended) trained on a few
  pangrams up to exactly `VOCAB` ids, the first ones `SPECIAL_TOKENS`.
  """
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.Metaspace()
  tok.decoder = decoders.Metaspace()
  trainer = trainers.BpeTrainer(
    vocab_size=VOCAB, special_tokens=list(SPECIAL_TOKENS), show_progress=False
  )
  tok.train_from_iterator(_CORPUS, trainer)
  if tok.get_vocab_size() != VOCAB:
    raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} ids, not {VOCAB}")
  if [tok.token_to_id(t) for t in SPECIAL_TOKENS] != list(range(len(SPECIAL_TOKENS))):
    raise RuntimeError("the special tokens do not have ids 0, 1, 2, ...")
  bos, eos, pad = "<s>", "</s>", "<pad>"
  tok.post_processor = processors.TemplateProcessing(
    single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
  )
  os.makedirs(path, exist_ok=True)
  tok.save(os.path.join(path, "tokenizer.json"))
  specials = {"bos_token": bos, "eos_token": eos, "pad_token": pad}
  tokenizer_config = {
    **specials,
    "add_bos_token": True,
    "add_eos_token": False,
    "clean_up_tokenization_spaces": False,
    "model_max_length": 2048,
    "tokenizer_class": "PreTrainedTokenizerFast",
  }
  for name, content in (
    ("tokenizer_config.json", tokenizer_config),
    ("special_tokens_map.json", specials),
    ("generation_config.json", generation_config),
  ):
    with open(os.path.join(path, name), "w") as f:
      json.dump(content, f, indent=2, sort_keys=True)
      f.write("\n")
  with open(os.path.join(path, "chat_template.jinja"), "w") as f:
    f.write(CHAT_TEMPLATE + "\n")


def make_config(model_type: str, kwargs: dict):
  """A tiny transformers config (RoPE keyword spelled for the installed major version)."""
  kwargs = dict(kwargs)
  scaling = kwargs.pop("rope_scaling", None)
  if int(transformers.__version__.split(".")[0]) >= 5:
    theta = kwargs.pop("rope_theta", None)
    if scaling or theta:
      params = dict(scaling or {"rope_type": "default"})
      if theta:
        params["rope_theta"] = theta
      kwargs["rope_parameters"] = params
  elif scaling:
    kwargs["rope_scaling"] = scaling
  dims = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS)
  dims.update(num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, intermediate_size=INTER)
  return transformers.AutoConfig.for_model(
    model_type, attn_implementation="eager", **dims, **kwargs
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
  dtype = getattr(torch, save_opts["dtype"]) if "dtype" in save_opts else None
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
  if name in TOKENIZER_FIXTURES:
    write_model_files(path, TOKENIZER_FIXTURES[name])
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
    "dtype": save_opts.get("dtype", "float32"),
    "seed": seed + 1000 * attempt,
    "decision_margin": round(margin, 4),
  }


def check_export(out_dir: str) -> None:
  """Our import -> export must read back into transformers with the same logits, token ids,
  generation config and tokenizer."""
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from jaxrl_llm.models import hf, hf_config, hf_export

  for name in FIXTURES:
    src = os.path.join(out_dir, name)
    ref = np.load(os.path.join(src, "reference.npz"))
    cfg, params = hf.load_checkpoint(src)
    with tempfile.TemporaryDirectory() as tmp:
      hf_export.save_checkpoint(
        tmp, cfg, params, model_type=FIXTURES[name][0], max_shard_bytes=40_000, source=src
      )
      model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp, attn_implementation="eager", dtype=torch.float32
      ).eval()
      for key in hf_config.CARRIED_FIELDS:
        want = transformers.AutoConfig.from_pretrained(src).to_dict().get(key)
        assert model.config.to_dict().get(key) == want, (name, key)
      if name in TOKENIZER_FIXTURES:
        gen = transformers.GenerationConfig.from_pretrained(tmp).to_dict()
        for key, want in TOKENIZER_FIXTURES[name].items():
          assert gen[key] == want, (name, key, gen[key])
        text = "the lazy fox"
        ids = transformers.AutoTokenizer.from_pretrained(tmp)(text)["input_ids"]
        assert ids == transformers.AutoTokenizer.from_pretrained(src)(text)["input_ids"], name
    tokens, mask = torch.from_numpy(ref["tokens"]).long(), torch.from_numpy(ref["mask"]).long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
      logits = model(input_ids=tokens, attention_mask=mask, position_ids=positions).logits
    diff = np.abs(np.where(ref["mask"][..., None], logits.numpy(), 0.0) - ref["logits"]).max()
    print(f"{name}: export read back by transformers, max |logit diff| = {diff:.2e}")
    assert diff <= 1e-4, name


def start_manifest(out_dir: str, names: list[str]) -> tuple[dict, dict]:
  """(manifest, fields for each rebuilt entry): a new manifest when all fixtures are built, else
  the existing one, whose other entries stay; rebuilt entries record the torch / transformers
  versions that made them where those differ from the manifest's."""
  versions = {
    "transformers_version": transformers.__version__,
    "torch_version": torch.__version__.split("+")[0],
  }
  fresh = {
    **versions,
    "batch": {"rows": BATCH, "prompt_len": PROMPT_LEN, "left_pad": list(PADS)},
    "new_tokens": NEW_TOKENS,
    "fixtures": {},
  }
  path = os.path.join(out_dir, "manifest.json")
  if set(names) == set(FIXTURES) or not os.path.exists(path):
    return fresh, {}
  with open(path) as f:
    old = json.load(f)
  if (old.get("batch"), old.get("new_tokens")) != (fresh["batch"], fresh["new_tokens"]):
    raise SystemExit(f"{path} was made with another batch shape: rebuild every fixture")
  same = all(old.get(k) == v for k, v in versions.items())
  return old, {} if same else versions


def main(argv=None) -> None:
  """Writes the fixtures (and optionally checks our export against transformers)."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=os.path.join("tests", "fixtures", "hf"))
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--check_export", action="store_true")
  parser.add_argument(
    "--only", default="", help="comma-separated fixtures to rebuild (the others are kept)"
  )
  parser.add_argument(
    "--model_files_only", action="store_true", help="rewrite only the tokenizer/generation files"
  )
  args = parser.parse_args(argv)
  if args.model_files_only:
    for name, generation_config in TOKENIZER_FIXTURES.items():
      write_model_files(os.path.join(args.out, name), generation_config)
    return
  if torch is None:
    raise SystemExit("torch and transformers are needed (except for --model_files_only)")
  names = args.only.split(",") if args.only else list(FIXTURES)
  unknown = sorted(set(names) - set(FIXTURES))
  if unknown:
    raise SystemExit(f"--only: unknown fixture(s) {unknown}; known: {list(FIXTURES)}")
  torch.use_deterministic_algorithms(True)
  os.makedirs(args.out, exist_ok=True)
  manifest, versions = start_manifest(args.out, names)
  for name in names:  # each fixture's seed is fixed by its place in FIXTURES
    manifest["fixtures"][name] = {
      **build(name, args.out, args.seed + list(FIXTURES).index(name)),
      **versions,
    }
    print(f"{name}: {manifest['fixtures'][name]}")
  manifest["fixtures"] = {n: manifest["fixtures"][n] for n in FIXTURES if n in manifest["fixtures"]}
  with open(os.path.join(args.out, "manifest.json"), "w") as f:
    json.dump(manifest, f, indent=2)
    f.write("\n")
  if args.check_export:
    check_export(args.out)


if __name__ == "__main__":
  main()
