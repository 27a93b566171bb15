"""`configs/smollm2_arith.py` through TRL's GRPOTrainer: a peer to compare learning and step time.

  python tools/trl_arith.py --setting=lora|full --steps=N --out=DIR [--eval_size=N]
      [--eval_every=N] [--model=DIR] [--data=DIR] [--num_prompts=P] [--group_size=G]
      [--max_new_tokens=T] [--microbatches=K] [--eval_batch=B]

The same experiment as `python -m jaxrl_llm.main --config=configs/smollm2_arith.py:SETTING`, in
PyTorch: the Hugging Face directory `tools/get_smollm2.py` writes, loaded by transformers
(`AutoModelForCausalLM`, weights in the config's `model.param_dtype`; compute in `model.dtype`,
bfloat16 autocast for `full` on a GPU, float32 on a CPU), with PEFT LoRA adapters of the
config's rank, alpha, dropout and projections for `lora` (every parameter trains for `full`).
Prompts are the records' `prompt` under the tokenizer's chat template with the config's system
message (`configs/smollm2_arith.SYSTEM`), those longer than `data.prompt_len` tokens dropped as
the trainer drops them. The rewards are the project's verifier functions
(`jaxrl_llm.data.verifiers.REWARD_FNS`) named in `task.reward_weights`, given to GRPOTrainer as
`reward_funcs` with those weights as `reward_weights`.

Every hyperparameter is read from `get_config(setting)`, never typed here: prompts per update,
group size, new tokens, temperature, top-p/top-k, learning rate (constant: the config has no
warmup and no decay), Adam's b1/b2, weight decay, gradient clip, clip epsilons, KL beta (0:
no reference model), seed, and one optimiser update per generation batch (`num_iterations=1`,
steps_per_generation = gradient accumulation). `--num_prompts`, `--group_size` and
`--max_new_tokens` override three of them for quick runs (recorded in `overrides`).
Generation is transformers' `generate` inside TRL (no vLLM).

The held-out evaluation is greedy (transformers `generate`, `do_sample=False`) over the first
`--eval_size` problems of `eval.jsonl` that fit `data.prompt_len` (default `task.eval_size`, as
the trainer's), `max_new_tokens` new tokens, at step 0, every `--eval_every` updates (default
`train.eval_every`) and at the end: accuracy (`data.correct_term`), the format rate (the other
reward term) and each term's mean.

DIR/trl_arith.json is rewritten after every logged step and every evaluation: `settings` (what
ran, each from the config), `runtime` (device, versions, how TRL generated), `steps` (per
optimiser step: wall time, generation time, TRL's logged training reward, accuracy, format
rate, completion length), `eval` (the curve) and `status` (`running`, then `done`). A failure
before training (no model, no data, no TRL) is one `error:` line and exit status 2.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tools"))

from jaxrl_llm.terminal import ArgParser  # noqa: E402 (after the path above)

CONFIG_PATH = os.path.join(REPO, "configs", "smollm2_arith.py")
EXIT_BAD_INPUT = 2
FETCH_HINT = "python tools/get_smollm2.py"
OUT_NAME = "trl_arith.json"
# Our trainer's aggregation / advantage / objective, as TRL's GRPOConfig names them.
LOSS_TYPES = {"seq_mean_token_mean": "grpo"}  # each sequence's token mean, then their mean
SCALE_REWARDS = {"grpo": "group"}  # (R - group mean) / group std
# What TRL does differently from ours at the same settings, recorded with every result.
DIFFERENCES = (
  "advantage: TRL divides by (group std + 1e-4), ours by (group std + 1e-6)",
  "training prompts: TRL's seeded shuffle of train.jsonl, not ours (grain's): other problems",
  "LoRA: PEFT's initialisation (kaiming-uniform A, zero B) and random stream, not ours",
  "Adam epsilon: torch AdamW's default 1e-8, optax's default 1e-8 (not a config field)",
  "rewards: called in this process, not in verifier worker processes with a time limit",
)


class InputError(ValueError):
  """The run cannot start as asked (one line)."""


def load_config(setting: str):
  """`get_config(setting)` of configs/smollm2_arith.py (imported by path) and the module."""
  spec = importlib.util.spec_from_file_location("smollm2_arith_config", CONFIG_PATH)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  try:
    return module.get_config(setting), module
  except ValueError as e:
    raise InputError(str(e)) from None


def settings_from_config(cfg, args, module) -> dict:
  """Every setting of the run, read from the config (or a command-line override)."""
  from jaxrl_llm.models.config import target_names

  if cfg.optim.warmup_steps != 0 or cfg.optim.decay_to != 1.0:
    raise InputError(
      f"the config's learning rate is scheduled (warmup {cfg.optim.warmup_steps}, decay_to "
      f"{cfg.optim.decay_to}); this peer runs a constant one only"
    )
  for field, value, allowed in (
    ("aggregation.name", cfg.aggregation.name, LOSS_TYPES),
    ("advantage.name", cfg.advantage.name, SCALE_REWARDS),
    ("objective.name", cfg.objective.name, ("ppo_clip",)),
    ("correction.name", cfg.correction.name, ("none",)),
    ("filtering.name", cfg.filtering.name, ("none",)),
    ("shaping.name", cfg.shaping.name, ("none",)),
    ("replay.name", cfg.replay.name, ("none",)),
    ("sampling.tool", cfg.sampling.tool, ("none",)),  # the tool settings: ours only
  ):
    if value not in allowed:
      raise InputError(f"{field}={value!r} has no TRL counterpart here ({', '.join(allowed)})")
  if cfg.rl.num_epochs != 1 or cfg.rl.num_minibatches != 1:
    raise InputError("the config takes more than one update per rollout; this peer takes one")
  if cfg.rl.entropy_coef:
    raise InputError(f"rl.entropy_coef={cfg.rl.entropy_coef}: not run here")
  weights = {k: float(v) for k, v in cfg.task.reward_weights.items()}
  others = [t for t in weights if t != cfg.data.correct_term]
  overrides = {
    k: getattr(args, k) for k in ("num_prompts", "group_size", "max_new_tokens") if getattr(args, k)
  }
  s = {
    "config": f"configs/smollm2_arith.py:{args.setting}",
    "setting": args.setting,
    "steps": args.steps or int(cfg.train.num_steps),
    "num_prompts": overrides.get("num_prompts", cfg.rl.num_prompts),
    "group_size": overrides.get("group_size", cfg.sampling.group_size),
    "max_new_tokens": overrides.get("max_new_tokens", cfg.sampling.max_new_tokens),
    "temperature": float(cfg.sampling.temperature),
    "top_p": float(cfg.sampling.top_p),
    "top_k": int(cfg.sampling.top_k),
    "learning_rate": float(cfg.optim.learning_rate),
    "lr_schedule": "constant",
    "adam_b1": float(cfg.optim.b1),
    "adam_b2": float(cfg.optim.b2),
    "weight_decay": float(cfg.optim.weight_decay),
    "grad_clip": float(cfg.optim.grad_clip),
    "clip_low": float(cfg.objective.clip_low),
    "clip_high": float(cfg.objective.clip_high),
    "beta": float(cfg.kl.beta),
    "updates_per_rollout": cfg.rl.num_epochs * cfg.rl.num_minibatches,
    "loss_type": LOSS_TYPES[cfg.aggregation.name],
    "scale_rewards": SCALE_REWARDS[cfg.advantage.name],
    "reward_weights": weights,
    "correct_term": cfg.data.correct_term,
    "format_term": others[0] if len(others) == 1 else None,
    "system_prompt": cfg.data.system_prompt,
    "system_is_config_module_SYSTEM": cfg.data.system_prompt == module.SYSTEM,
    "template": cfg.data.template,
    "prompt_len": int(cfg.data.prompt_len),
    "eval_size": args.eval_size or int(cfg.task.eval_size),
    "eval_every": args.eval_every or int(cfg.train.eval_every),
    "eval_max_new_tokens": overrides.get("max_new_tokens", cfg.sampling.max_new_tokens),
    "lora_rank": int(cfg.model.lora_rank),
    "lora_alpha": float(cfg.model.lora_alpha),
    "lora_dropout": float(cfg.model.lora_dropout),
    "lora_targets": [f"{n}_proj" for n in target_names(cfg.model.lora_targets)],
    "param_dtype": cfg.model.param_dtype,
    "dtype": cfg.model.dtype,
    "seed": int(cfg.seed),
    "microbatches": args.microbatches,
    "overrides": overrides,
  }
  if s["group_size"] < 2:
    raise InputError(f"group_size={s['group_size']}: GRPO needs at least 2 samples a prompt")
  if (s["num_prompts"] * s["group_size"]) % s["microbatches"]:
    raise InputError(
      f"{s['num_prompts'] * s['group_size']} rows do not split into {s['microbatches']} "
      "microbatches"
    )
  if s["lora_rank"] <= 0:
    for k in ("lora_alpha", "lora_dropout", "lora_targets"):
      s[k] = None
  return s


def read_jsonl(path: str) -> list[dict]:
  """The records of a JSON-lines file, blank lines skipped."""
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def render(tokenizer, records: list[dict], system: str, prompt_len: int):
  """(prompt texts under the chat template, answers, records dropped as longer than
  `prompt_len` tokens), in the records' order."""
  texts = [
    tokenizer.apply_chat_template(
      [{"role": "system", "content": system}, {"role": "user", "content": r["prompt"]}],
      tokenize=False,
      add_generation_prompt=True,
    )
    for r in records
  ]
  ids = tokenizer(texts)["input_ids"]  # as TRL tokenizes a text prompt
  keep = [i for i, row in enumerate(ids) if len(row) <= prompt_len]
  return [texts[i] for i in keep], [str(records[i]["answer"]) for i in keep], len(texts) - len(keep)


def reward_funcs(weights: dict[str, float]):
  """TRL reward functions for the terms of `weights` (each named as its term), and the weights."""
  from jaxrl_llm.data import verifiers

  def make(name):
    fn = verifiers.REWARD_FNS[name]

    def reward(completions, answer, **kwargs):
      del kwargs
      return [fn(_text(c), a) for c, a in zip(completions, answer, strict=True)]

    reward.__name__ = reward.__qualname__ = name
    return reward

  return [make(n) for n in weights], [weights[n] for n in weights]


def _text(completion) -> str:
  """A completion's text: TRL passes a string for text prompts, messages for chat ones."""
  return completion if isinstance(completion, str) else completion[-1]["content"]


def write_json(path: str, obj: dict) -> None:
  """Writes `obj` to `path` through a temporary file, so a reader never sees half of it."""
  tmp = f"{path}.partial"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=1)
  os.replace(tmp, path)


def greedy_eval(model, tokenizer, prompts, answers, s, batch, device, autocast) -> dict:
  """Greedy completions of `prompts` (transformers generate) scored by the reward terms."""
  import torch

  from jaxrl_llm.data import verifiers

  eos = tokenizer.eos_token_id
  gen_eos = model.generation_config.eos_token_id
  eos_ids = sorted({eos, *(gen_eos if isinstance(gen_eos, list) else [gen_eos])} - {None})
  texts, lengths = [], []
  was_training = model.training
  model.eval()
  t0 = time.perf_counter()
  with torch.no_grad(), autocast():
    for i in range(0, len(prompts), batch):
      enc = tokenizer(prompts[i : i + batch], return_tensors="pt", padding=True).to(device)
      out = model.generate(
        **enc,
        max_new_tokens=s["eval_max_new_tokens"],
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=eos_ids,
      )
      for row in out[:, enc["input_ids"].shape[1] :].tolist():
        stop = next((j for j, t in enumerate(row) if t in eos_ids), None)
        lengths.append(len(row) if stop is None else stop + 1)  # the stop token counted
        texts.append(tokenizer.decode(row[:stop], skip_special_tokens=True))
  wall = time.perf_counter() - t0
  if was_training:
    model.train()
  terms = {
    name: sum(verifiers.REWARD_FNS[name](t, a) for t, a in zip(texts, answers, strict=True))
    / len(texts)
    for name in s["reward_weights"]
  }
  return {
    "accuracy": terms[s["correct_term"]],
    "format_rate": terms[s["format_term"]] if s["format_term"] else None,
    "terms": terms,
    "length_mean": sum(lengths) / len(lengths),
    "n": len(texts),
    "wall_s": wall,
    "sample": texts[0],
  }


def run(args) -> dict:
  """Trains and evaluates; returns the record also written to OUT/trl_arith.json."""
  t_start = time.perf_counter()
  cfg, module = load_config(args.setting)
  s = settings_from_config(cfg, args, module)  # a setting TRL cannot run, before the files
  model_dir = args.model or cfg.model.checkpoint
  data_dir = args.data or os.path.dirname(cfg.data.train_files)
  if not os.path.isfile(os.path.join(model_dir, "config.json")):
    raise InputError(f"no Hugging Face model directory at {model_dir}: run `{FETCH_HINT}` first")
  for split in ("train.jsonl", "eval.jsonl"):
    if not os.path.isfile(os.path.join(data_dir, split)):
      raise InputError(f"no {split} in {data_dir}: run `{FETCH_HINT}` first")
  s["model_dir"], s["data_dir"] = os.path.abspath(model_dir), os.path.abspath(data_dir)
  try:
    import peer_trl
    import torch
    import transformers
    import trl
    from datasets import Dataset
  except ImportError as e:
    raise InputError(f"{e}: install the peer's packages (pip install -e '.[peer]')") from None
  if s["lora_rank"] > 0:
    try:
      import peft
    except ImportError as e:
      raise InputError(f"{e}: install peft (pip install -e '.[peer]')") from None

  os.makedirs(args.out, exist_ok=True)
  out_path = os.path.join(args.out, OUT_NAME)
  cuda = torch.cuda.is_available()
  device = torch.device("cuda" if cuda else "cpu")
  sync = torch.cuda.synchronize if cuda else (lambda: None)
  dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
  bf16 = cuda and s["dtype"] == "bfloat16"  # a CPU computes in float32
  s["compute_dtype"] = "bfloat16 autocast" if bf16 else "float32"
  if s["dtype"] == "bfloat16" and not cuda:
    s["compute_dtype"] += " (the config's bfloat16 is a GPU setting)"

  tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
  eval_tok = transformers.AutoTokenizer.from_pretrained(model_dir)
  eval_tok.padding_side = "left"
  train_prompts, train_answers, train_dropped = render(
    tokenizer,
    read_jsonl(os.path.join(data_dir, "train.jsonl")),
    s["system_prompt"],
    s["prompt_len"],
  )
  eval_records = read_jsonl(os.path.join(data_dir, "eval.jsonl"))[: s["eval_size"] * 2]
  eval_prompts, eval_answers, eval_dropped = render(
    tokenizer, eval_records, s["system_prompt"], s["prompt_len"]
  )
  eval_prompts, eval_answers = eval_prompts[: s["eval_size"]], eval_answers[: s["eval_size"]]
  s["eval_size"] = len(eval_prompts)
  s["train_prompts"], s["train_dropped_over_prompt_len"] = len(train_prompts), train_dropped
  s["eval_dropped_over_prompt_len"] = eval_dropped

  model = transformers.AutoModelForCausalLM.from_pretrained(
    model_dir, dtype=dtypes[s["param_dtype"]]
  )
  num_params = sum(p.numel() for p in model.parameters())
  peft_config = None
  if s["lora_rank"] > 0:
    peft_config = peft.LoraConfig(
      r=s["lora_rank"],
      lora_alpha=s["lora_alpha"],
      lora_dropout=s["lora_dropout"],
      target_modules=list(s["lora_targets"]),
      bias="none",
      task_type="CAUSAL_LM",
    )
  rows, k = s["num_prompts"] * s["group_size"], s["microbatches"]
  funcs, weights = reward_funcs(s["reward_weights"])
  grpo_args = trl.GRPOConfig(
    output_dir=tempfile.mkdtemp(prefix="trl_arith_"),
    per_device_train_batch_size=rows // k,
    gradient_accumulation_steps=k,
    steps_per_generation=k,  # one generation of P x G completions per optimiser step
    num_generations=s["group_size"],
    max_completion_length=s["max_new_tokens"],
    num_iterations=s["updates_per_rollout"],
    beta=s["beta"],
    epsilon=s["clip_low"],
    epsilon_high=s["clip_high"],
    loss_type=s["loss_type"],
    scale_rewards=s["scale_rewards"],
    reward_weights=weights,
    mask_truncated_completions=False,
    temperature=s["temperature"],
    top_p=s["top_p"],
    top_k=s["top_k"],
    learning_rate=s["learning_rate"],
    lr_scheduler_type="constant",
    warmup_steps=0,
    adam_beta1=s["adam_b1"],
    adam_beta2=s["adam_b2"],
    weight_decay=s["weight_decay"],
    max_grad_norm=s["grad_clip"],
    max_steps=s["steps"],
    bf16=bf16,
    use_cpu=not cuda,
    gradient_checkpointing=False,
    logging_strategy="steps",
    logging_steps=1,
    seed=s["seed"],
    **peer_trl.QUIET,
  )
  dataset = Dataset.from_dict({"prompt": train_prompts, "answer": train_answers})
  trainer = trl.GRPOTrainer(
    model=model,
    reward_funcs=funcs,
    args=grpo_args,
    train_dataset=dataset,
    processing_class=tokenizer,
    peft_config=peft_config,
  )
  trained = [p for p in trainer.model.parameters() if p.requires_grad]
  step_times, gen_times, _, _ = peer_trl.attach_timers(trainer, sync)
  setup_spec = {"lora_rank": s["lora_rank"], "checkpoint": s["model_dir"]}
  record = {
    "settings": s,
    "runtime": {
      "device": torch.cuda.get_device_name() if cuda else "cpu",
      "versions": {
        "trl": trl.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        **({"peft": peft.__version__} if s["lora_rank"] > 0 else {}),
      },
      "generation": "transformers generate inside TRL (no vLLM); eval: transformers generate, "
      "greedy",
      "peer_setup": peer_trl.peer_setup(setup_spec, trainer, model),
      "num_params": num_params,
      "trainable_params": sum(p.numel() for p in trained),
      "torch_threads": torch.get_num_threads(),
    },
    "differences": list(DIFFERENCES),
    "status": "running",
    "steps": [],
    "eval": [],
  }
  logs_by_step: dict[int, dict] = {}
  eval_model = trainer.accelerator.unwrap_model(trainer.model)

  def autocast():
    if bf16:
      return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)

  batch = args.eval_batch or (len(eval_prompts) if cuda else 64)

  def evaluate(step: int) -> None:
    sync()
    result = greedy_eval(
      eval_model, eval_tok, eval_prompts, eval_answers, s, batch, device, autocast
    )
    record["eval"].append({"step": step, **result})
    print(
      f"eval step {step}: accuracy {result['accuracy']:.3f} format {result['format_rate']} "
      f"length {result['length_mean']:.1f} ({result['wall_s']:.1f}s)",
      file=sys.stderr,
      flush=True,
    )
    flush()

  def flush() -> None:
    record["steps"] = step_rows(step_times, gen_times, logs_by_step, s)
    record["wall_s"] = time.perf_counter() - t_start
    write_json(out_path, record)

  class EvalAndLog(transformers.TrainerCallback):
    def on_step_end(self, args_, state, control, **kwargs):
      if state.global_step % s["eval_every"] == 0 or state.global_step == s["steps"]:
        evaluate(state.global_step)

    def on_log(self, args_, state, control, logs=None, **kwargs):
      numbers = {k: v for k, v in (logs or {}).items() if isinstance(v, int | float)}
      if "train_runtime" in numbers:
        record["train_summary"] = numbers
      else:
        logs_by_step.setdefault(state.global_step, {}).update(numbers)
      flush()

  trainer.add_callback(EvalAndLog())  # after attach_timers' timer: evaluations are not timed
  flush()  # the settings, before anything can be cut off
  evaluate(0)
  trainer.train()
  if not record["eval"] or record["eval"][-1]["step"] != len(step_times):
    evaluate(len(step_times))
  record["status"] = "done"
  flush()
  return record


def step_rows(step_times, gen_times, logs_by_step, s) -> list[dict]:
  """One row per optimiser step: wall and generation times and TRL's logged training metrics."""
  rows = []
  for i, wall in enumerate(step_times):
    logs = logs_by_step.get(i + 1, {})
    fmt = s["format_term"]
    rows.append(
      {
        "step": i + 1,
        "wall_s": wall,
        "generate_s": gen_times[i] if i < len(gen_times) else None,
        "reward": logs.get("reward"),
        "accuracy": logs.get(f"rewards/{s['correct_term']}/mean"),
        "format_rate": logs.get(f"rewards/{fmt}/mean") if fmt else None,
        "completion_length": logs.get("completions/mean_length"),
        "logs": logs,
      }
    )
  return rows


def main(argv=None) -> int:
  """Trains the config's setting with TRL's GRPOTrainer and writes its curve and step times."""
  p = ArgParser(description=__doc__.splitlines()[0])
  p.add_argument("--setting", default="lora", help="lora | full (the config's settings)")
  p.add_argument("--steps", type=int, default=0, help="optimiser steps (default: the config's)")
  p.add_argument("--out", required=True, help="directory of trl_arith.json")
  p.add_argument("--eval_size", type=int, default=0, help="held-out problems (config's)")
  p.add_argument("--eval_every", type=int, default=0, help="steps between evals (config's)")
  p.add_argument("--model", default=None, help="Hugging Face directory (config's checkpoint)")
  p.add_argument("--data", default=None, help="directory of train/eval.jsonl (config's)")
  p.add_argument("--num_prompts", type=int, default=0, help="override rl.num_prompts")
  p.add_argument("--group_size", type=int, default=0, help="override sampling.group_size")
  p.add_argument("--max_new_tokens", type=int, default=0, help="override max_new_tokens")
  p.add_argument("--microbatches", type=int, default=1, help="gradient-accumulation slices")
  p.add_argument("--eval_batch", type=int, default=0, help="eval rows at once (GPU: all)")
  args = p.parse_args(argv)
  for name in ("steps", "eval_size", "eval_every", "num_prompts", "group_size", "max_new_tokens"):
    if getattr(args, name) < 0:
      p.error(f"--{name}={getattr(args, name)} is negative")
  if args.microbatches < 1 or args.eval_batch < 0:
    p.error("--microbatches must be >= 1 and --eval_batch >= 0")
  # This process never computes with JAX (the config module imports it): keep it off the GPU.
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
  try:
    record = run(args)
  except InputError as e:
    print(f"error: {e}", file=sys.stderr)
    return EXIT_BAD_INPUT
  last = record["eval"][-1]
  times = [r["wall_s"] for r in record["steps"]]
  median = sorted(times)[len(times) // 2] if times else math.nan
  print(
    f"done: {len(times)} steps, median step {median:.2f}s, final eval accuracy "
    f"{last['accuracy']:.3f} format {last['format_rate']} -> {os.path.join(args.out, OUT_NAME)}"
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
