"""TRL's GRPOTrainer at one benchmark shape: the peer of `tools/bench.py --peer=trl`.

  python tools/peer_trl.py --spec='{"vocab_size": 64, "d_model": 128, ...}'

`bench.py` runs this in a subprocess (so its memory is its own) with a JSON spec of the shape
it benchmarks: the model's dimensions, prompts, group size, new tokens, dtypes, microbatches and
remat. The policy is a random-init `transformers` Qwen2ForCausalLM (qkv bias) or
LlamaForCausalLM (no bias) of the same dimensions, or, when the spec names a `checkpoint` (a
Hugging Face directory), that checkpoint's model and weights (`from_pretrained`, in
`param_dtype`; its dimensions must be the spec's); the prompts are random token strings of the
same length (ids 3 .. vocab_size-1, one word per token id of a word-level tokenizer); every
completion runs to full length (`min_new_tokens = max_new_tokens`, so the end-of-sequence
token is suppressed); each generation is followed by exactly one optimiser step
(gradient accumulation over the same number of microbatches as ours, no old-policy pass, no
reference model); the reward is a constant. With `lora_rank` > 0 the policy is wrapped by PEFT's
`LoraConfig` with the same rank, alpha, dropout and target projections (passed to GRPOTrainer as
`peft_config`): only the adapters train, the base stays frozen in `param_dtype`. The last stdout
line is `PEER_RESULT {json}`: median warm step time, median generation time, peak memory
(torch.cuda.max_memory_allocated on a GPU, peak RSS on a CPU), the parameters trained and how
it ran (`peer_setup`: generation path, KV cache and whether transformers compiled the generation,
dtypes, attention kernel, gradient checkpointing, the model's source). With `cache` static, the
peer is TRL's strongest without vLLM: transformers' static-cache generation, compiled with
torch.compile on a GPU (on a CPU transformers runs the static cache without compiling). A spec this cannot run (a checkpoint of other dimensions) is one `error: ...`
line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time

MARKER = "PEER_RESULT "

SPEC_FIELDS = (
  "vocab_size",
  "d_model",
  "num_layers",
  "num_heads",
  "num_kv_heads",
  "head_dim",
  "mlp_dim",
  "attention_bias",
  "tie_embeddings",
  "rope_theta",
  "norm_eps",
  "prompts",
  "group_size",
  "max_new_tokens",
  "prompt_len",
  "param_dtype",  # float32 | bfloat16: the weights (and Adam state) as stored
  "compute_dtype",  # float32 | bfloat16: bfloat16 = autocast (TRL's bf16=True)
  "microbatches",  # gradient-accumulation slices of the one optimiser step
  "gradient_checkpointing",
  "steps",  # warm steps timed
  "warmup",  # steps run first and not timed
  "learning_rate",
  "temperature",
  "seed",
  "lora_rank",  # rank r of PEFT LoRA adapters; 0 (the default, e.g. of older specs): none
  "lora_alpha",  # PEFT's lora_alpha (adapter scale alpha / r); only read when lora_rank > 0
  "lora_dropout",  # PEFT's lora_dropout on the adapters' input; only read when lora_rank > 0
  "lora_targets",  # Hugging Face module names given adapters (["q_proj", ...]); lora_rank > 0
  "checkpoint",  # a Hugging Face directory whose weights the policy loads; "" (default): random
  "cache",  # generation's KV cache: dynamic (transformers' default) | static (compiled on a GPU)
)
# What a spec may leave out (one from before LoRA: no adapters; before checkpoints: random init).
DEFAULTS = {"lora_rank": 0, "checkpoint": "", "cache": "dynamic"}
CACHES = ("dynamic", "static")
LORA_FIELDS = ("lora_alpha", "lora_dropout", "lora_targets")  # needed only when lora_rank > 0


def missing_fields(spec: dict) -> list[str]:
  """The fields of SPEC_FIELDS that `spec` lacks and needs (LORA_FIELDS only with adapters)."""
  lora = spec.get("lora_rank", DEFAULTS["lora_rank"]) > 0
  needed = [f for f in SPEC_FIELDS if f not in DEFAULTS and (lora or f not in LORA_FIELDS)]
  return [f for f in needed if f not in spec]


def _rss_bytes() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class SpecError(ValueError):
  """The spec cannot be run as given (one line, e.g. a checkpoint of other dimensions)."""


# (spec field, Hugging Face config attribute) of the dimensions a checkpoint must match.
CHECKED_DIMS = (
  ("vocab_size", "vocab_size"),
  ("d_model", "hidden_size"),
  ("num_layers", "num_hidden_layers"),
  ("num_heads", "num_attention_heads"),
  ("num_kv_heads", "num_key_value_heads"),
  ("head_dim", "head_dim"),
  ("mlp_dim", "intermediate_size"),
  ("tie_embeddings", "tie_word_embeddings"),
)


def dims_mismatch(spec: dict, hf_cfg) -> list[str]:
  """`field spec != checkpoint` for each of CHECKED_DIMS where the spec and the Hugging Face
  config `hf_cfg` (its text config) differ; head_dim defaults to hidden_size / heads."""
  text = hf_cfg.get_text_config()
  got = {attr: getattr(text, attr, None) for _, attr in CHECKED_DIMS}
  if got["head_dim"] is None:
    got["head_dim"] = text.hidden_size // text.num_attention_heads
  return [
    f"{field} {spec[field]} != {got[attr]}"
    for field, attr in CHECKED_DIMS
    if spec[field] != got[attr]
  ]


def load_checkpoint(spec: dict, dtype):
  """The spec's `checkpoint` as transformers loads it (`from_pretrained`, weights in `dtype`),
  after checking its config's dimensions are the spec's (SpecError naming the differences)."""
  import transformers

  path = spec["checkpoint"]
  try:
    hf_cfg = transformers.AutoConfig.from_pretrained(path)
  except (OSError, ValueError) as e:
    raise SpecError(f"checkpoint {path!r}: {' '.join(str(e).split())}") from None
  wrong = dims_mismatch(spec, hf_cfg)
  if wrong:
    raise SpecError(f"checkpoint {path!r} is not the spec's model: {', '.join(wrong)}")
  model = transformers.AutoModelForCausalLM.from_pretrained(path, config=hf_cfg, dtype=dtype)
  q = next(m for name, m in model.named_modules() if name.endswith("q_proj"))
  if (q.bias is not None) != spec["attention_bias"]:
    has = "has" if q.bias is not None else "has no"
    raise SpecError(
      f"checkpoint {path!r} {has} attention bias, the spec's attention_bias is "
      f"{spec['attention_bias']}"
    )
  return model


def build_model(spec: dict):
  """The spec's `checkpoint` (`load_checkpoint`), else a random-init causal LM of the spec's
  dimensions (Qwen2 with qkv bias, else Llama)."""
  import torch
  import transformers

  dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec["param_dtype"]]
  torch.manual_seed(spec["seed"])  # a random init's weights
  if spec["checkpoint"]:
    return load_checkpoint(spec, dtype)
  common = {
    "vocab_size": spec["vocab_size"],
    "hidden_size": spec["d_model"],
    "intermediate_size": spec["mlp_dim"],
    "num_hidden_layers": spec["num_layers"],
    "num_attention_heads": spec["num_heads"],
    "num_key_value_heads": spec["num_kv_heads"],
    "rms_norm_eps": spec["norm_eps"],
    "tie_word_embeddings": spec["tie_embeddings"],
    "max_position_embeddings": max(spec["prompt_len"] + spec["max_new_tokens"], 128),
    "rope_parameters": {"rope_type": "default", "rope_theta": spec["rope_theta"]},
  }
  if spec["attention_bias"]:  # Qwen2: bias on q, k, v (not o), like ours
    cfg = transformers.Qwen2Config(**common, use_sliding_window=False)
  else:
    cfg = transformers.LlamaConfig(**common, attention_bias=False, mlp_bias=False)
  cfg.head_dim = spec["head_dim"]
  return transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def build_tokenizer(vocab_size: int):
  """A word-level tokenizer with one word per model token id (`t0` pad, `t1` unk, `t2` eos),
  built locally (nothing is downloaded): a prompt of n words is n tokens. The special tokens
  match whole words only: as plain added tokens they would also match inside other words (`t13`
  became `t1` + an unknown `3`: two tokens)."""
  from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast

  vocab = {f"t{i}": i for i in range(vocab_size)}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="t1"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  word = lambda t: AddedToken(t, single_word=True, special=True, normalized=False)  # noqa: E731
  return PreTrainedTokenizerFast(
    tokenizer_object=tok,
    pad_token=word("t0"),
    unk_token=word("t1"),
    eos_token=word("t2"),
    padding_side="left",
    truncation_side="left",
  )


def check_prompts(tokenizer, dataset, spec: dict) -> None:
  """Every prompt is `prompt_len` tokens, the ids it was written from (none unknown)."""
  for text in dataset["prompt"]:
    ids = tokenizer(text)["input_ids"]
    if len(ids) != spec["prompt_len"] or " ".join(f"t{i}" for i in ids) != text:
      raise RuntimeError(f"prompt {text!r} tokenizes to {len(ids)} tokens {ids}")


def prompts_dataset(spec: dict, num: int):
  """`num` prompts of exactly `prompt_len` random tokens (never the pad/unk/eos ids)."""
  import numpy as np
  from datasets import Dataset

  rng = np.random.default_rng(spec["seed"])
  ids = rng.integers(3, spec["vocab_size"], size=(num, spec["prompt_len"]))
  return Dataset.from_dict({"prompt": [" ".join(f"t{i}" for i in row) for row in ids]})


def constant_reward(completions, **kwargs):
  """The same reward for every completion (the work measured does not depend on it)."""
  del kwargs
  return [1.0] * len(completions)


# What every GRPOConfig of ours (this peer, tools/trl_arith.py) sets alike: nothing saved,
# evaluated, reported or shown, no half-precision scaler, data loaded in the main process.
QUIET = {
  "fp16": False,
  "save_strategy": "no",
  "eval_strategy": "no",
  "report_to": "none",
  "disable_tqdm": True,
  "dataloader_num_workers": 0,
  "log_completions": False,
}


def grpo_config(spec: dict, cuda: bool):
  """TRL's GRPOConfig of the spec: one generation of P x G completions per optimiser step."""
  from trl import GRPOConfig

  b, k = spec["prompts"] * spec["group_size"], spec["microbatches"]
  if b % k:
    raise ValueError(f"{b} sequences do not split into {k} microbatches")
  return GRPOConfig(
    output_dir=tempfile.mkdtemp(prefix="peer_trl_"),
    per_device_train_batch_size=b // k,
    gradient_accumulation_steps=k,
    steps_per_generation=k,  # one generation of P x G completions per optimiser step
    num_generations=spec["group_size"],
    max_completion_length=spec["max_new_tokens"],
    num_iterations=1,  # one optimiser update per rollout: no old-policy pass
    beta=0.0,  # no reference model (ours: kl.beta = 0)
    loss_type="grpo",
    temperature=spec["temperature"],
    top_p=1.0,
    top_k=0,
    generation_kwargs={"min_new_tokens": spec["max_new_tokens"]},  # every completion full length
    # static: transformers compiles the decode step (torch.compile) where it can, on a GPU
    cache_implementation=None if spec["cache"] == "dynamic" else spec["cache"],
    learning_rate=spec["learning_rate"],
    lr_scheduler_type="constant",
    max_steps=spec["warmup"] + spec["steps"],
    bf16=spec["compute_dtype"] == "bfloat16",
    use_cpu=not cuda,
    gradient_checkpointing=spec["gradient_checkpointing"],
    logging_strategy="no",
    seed=spec["seed"],
    **QUIET,
  )


def lora_config(spec: dict):
  """PEFT's LoraConfig of the spec's adapters (None when `lora_rank` is 0): the same rank,
  alpha, dropout and target projections as ours; the base and its biases stay frozen."""
  if spec["lora_rank"] <= 0:
    return None
  import peft

  return peft.LoraConfig(
    r=spec["lora_rank"],
    lora_alpha=spec["lora_alpha"],
    lora_dropout=spec["lora_dropout"],
    target_modules=list(spec["lora_targets"]),
    bias="none",
    task_type="CAUSAL_LM",
  )


def attach_timers(trainer, sync) -> tuple[list[float], list[float], list[int], list[int]]:
  """Lists that fill as `trainer` trains: the wall time of each optimiser step (generation,
  scoring, forward/backward, update), of each generation alone (TRL's `_generate_single_turn`:
  transformers' generate for the batch), each completion's length and each prompt's."""
  from transformers import TrainerCallback

  step_times: list[float] = []
  gen_times: list[float] = []
  gen_lengths: list[int] = []
  prompt_lengths: list[int] = []

  class StepTimer(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
      sync()
      self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
      sync()
      step_times.append(time.perf_counter() - self.t0)

  generate = trainer._generate_single_turn

  def timed_generate(*a, **kw):
    prompt_lengths.extend(len(ids) for ids in (a[0] if a else kw["prompt_ids"]))
    sync()
    t0 = time.perf_counter()
    out = generate(*a, **kw)
    sync()
    gen_times.append(time.perf_counter() - t0)
    gen_lengths.extend(len(ids) for ids in out[0])
    return out

  trainer.add_callback(StepTimer())
  trainer._generate_single_turn = timed_generate
  return step_times, gen_times, gen_lengths, prompt_lengths


def run(spec: dict) -> dict:
  """Trains `warmup + steps` GRPO steps and returns the timings and peak memory."""
  import torch
  from trl import GRPOTrainer

  spec = DEFAULTS | spec
  baseline_rss = _rss_bytes()
  cuda = torch.cuda.is_available()
  sync = torch.cuda.synchronize if cuda else (lambda: None)
  total_steps = spec["warmup"] + spec["steps"]

  model = build_model(spec)
  num_params = sum(p.numel() for p in model.parameters())  # the base, before any adapter
  tokenizer = build_tokenizer(spec["vocab_size"])
  dataset = prompts_dataset(spec, spec["prompts"] * total_steps)
  check_prompts(tokenizer, dataset, spec)
  args = grpo_config(spec, cuda)

  trainer = GRPOTrainer(
    model=model,
    reward_funcs=constant_reward,
    args=args,
    train_dataset=dataset,
    processing_class=tokenizer,
    peft_config=lora_config(spec),  # None: every parameter trains
  )
  trained = [p for p in trainer.model.parameters() if p.requires_grad]
  step_times, gen_times, gen_lengths, prompt_lengths = attach_timers(trainer, sync)
  if cuda:
    torch.cuda.reset_peak_memory_stats()
  trainer.train()
  warm = slice(spec["warmup"], None)
  if len(step_times) != total_steps or len(gen_times) != total_steps:
    raise RuntimeError(
      f"expected {total_steps} steps with one generation each, timed {len(step_times)} steps "
      f"and {len(gen_times)} generations"
    )
  step_s = statistics.median(step_times[warm])
  gen_s = statistics.median(gen_times[warm])
  result = {
    "name": "trl",
    "model_class": type(model).__name__,
    "peer_setup": peer_setup(spec, trainer, model),
    "step_s": step_s,
    "sample_s": gen_s,
    "learner_s": max(step_s - gen_s, 1e-9),
    "decode_ms_per_step": 1e3 * gen_s / spec["max_new_tokens"],
    "step_times_s": step_times,
    "completion_length_min": min(gen_lengths),
    "completion_length_max": max(gen_lengths),
    "prompt_length_min": min(prompt_lengths),
    "prompt_length_max": max(prompt_lengths),
    "num_params": num_params,
    "trainable_params": sum(p.numel() for p in trained),
    "trainable_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in trained}),
    "host_peak_rss_bytes": _rss_bytes(),
    "host_baseline_rss_bytes": baseline_rss,
    "device": torch.cuda.get_device_name() if cuda else "cpu",
    "torch_threads": torch.get_num_threads(),
    "versions": _versions(spec),
    "spec": spec,
  }
  return result | _peak_memory(cuda, result["host_peak_rss_bytes"])


def peer_setup(spec: dict, trainer, model) -> dict[str, object]:
  """How the peer ran, as the trainer it built says: the generation path, dtypes, attention
  kernel, KV cache, gradient checkpointing and accumulation, adapters, the model's source."""
  import torch

  args = trainer.args
  if getattr(args, "use_vllm", False):
    generation = f"vLLM ({args.vllm_mode})"
  elif getattr(args, "use_transformers_continuous_batching", False):
    generation = "transformers continuous batching"
  elif getattr(args, "use_transformers_paged", False):
    generation = "transformers paged attention"
  else:
    generation = "transformers generate (model.generate, one batch of prompts x group)"
  unwrapped = trainer.accelerator.unwrap_model(trainer.model)
  return {
    "trainer": "trl.GRPOTrainer",
    "generation": generation,
    "kv_cache": args.cache_implementation or "dynamic (transformers' default)",
    # transformers' generate compiles its forward for a static cache on these devices
    "generation_compiled": args.cache_implementation == "static"
    and unwrapped.device.type in ("cuda", "xpu"),
    "attn_implementation": model.config._attn_implementation,
    "param_dtype": str(model.dtype).removeprefix("torch."),
    "compute_dtype": "bfloat16 autocast" if args.bf16 else str(model.dtype).removeprefix("torch."),
    "gradient_checkpointing": bool(args.gradient_checkpointing),
    "gradient_checkpointing_enabled": bool(getattr(unwrapped, "is_gradient_checkpointing", False)),
    "gradient_accumulation_steps": args.gradient_accumulation_steps,
    "torch_compile": bool(args.torch_compile),
    "peft_lora_rank": spec["lora_rank"],
    "model_source": spec["checkpoint"] or "random-init",
    "torch_threads": torch.get_num_threads(),
  }


def _peak_memory(cuda: bool, host_peak_rss: int) -> dict[str, object]:
  """The peak memory compared with ours: torch's allocations on a GPU, the peak RSS on a CPU."""
  import torch

  if not cuda:
    return {"peak_memory_bytes": host_peak_rss, "peak_memory_kind": "peak_rss"}
  return {
    "peak_memory_bytes": torch.cuda.max_memory_allocated(),
    "peak_memory_kind": "torch.cuda.max_memory_allocated",
    "cuda_max_memory_reserved_bytes": torch.cuda.max_memory_reserved(),
  }


def _versions(spec: dict) -> dict[str, str]:
  """The versions of the libraries the peer ran (peft only with adapters)."""
  import torch
  import transformers
  import trl

  modules = {"trl": trl, "transformers": transformers, "torch": torch}
  if spec["lora_rank"] > 0:
    import peft

    modules["peft"] = peft
  return {name: m.__version__ for name, m in modules.items()}


def main(argv: list[str]) -> int:
  """Command line: prints `PEER_RESULT {json}` as the last line."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--spec", required=True, help="JSON object with the fields SPEC_FIELDS")
  text = parser.parse_args(argv).spec
  try:
    given = json.loads(text)
  except ValueError:
    given = None  # not JSON: refused below as what is not an object
  if not isinstance(given, dict):
    print(
      f"error: --spec={text[:80]!r}: want a JSON object (peer_trl.SPEC_FIELDS)", file=sys.stderr
    )
    return 2
  spec = DEFAULTS | given  # an older spec: no adapters
  missing = missing_fields(spec)
  if missing:
    print(f"error: the spec lacks {missing} (peer_trl.SPEC_FIELDS)", file=sys.stderr)
    return 2
  if spec["cache"] not in CACHES:
    print(f"error: spec cache={spec['cache']!r}; allowed: {', '.join(CACHES)}", file=sys.stderr)
    return 2
  os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
  try:
    result = run(spec)
  except SpecError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(MARKER + json.dumps(result), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
