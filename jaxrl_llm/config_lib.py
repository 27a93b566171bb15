"""Start-up validation of experiment configs and construction of the static settings.

Every check names the config field, the bad value and what is allowed, and runs before
anything is compiled. Derived values are computed here and never written back into the config.
"""

from __future__ import annotations

import math

import jax
import ml_collections

from jaxrl_llm import sharding
from jaxrl_llm.kernels import attention
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.quant import SAMPLER_DTYPES
from jaxrl_llm.rl.settings import Settings
from jaxrl_llm.sampling import SamplingConfig


class ConfigError(ValueError):
  """A config value is missing, unknown or out of range."""


def _collect(errors: list[str], cond: bool, message: str):
  if not cond:
    errors.append(message)


# `config.model` fields that are not the architecture: not in ModelConfig nor checkpoint meta.
RUN_FIELDS = ("checkpoint", "attention")


def model_config(config: ml_collections.ConfigDict) -> ModelConfig:
  """The frozen `ModelConfig` described by `config.model` (without `RUN_FIELDS`)."""
  try:
    return ModelConfig.from_dict({k: v for k, v in config.model.items() if k not in RUN_FIELDS})
  except (TypeError, ValueError) as e:
    raise ConfigError(str(e)) from None


def num_sampled_prompts(config) -> int:
  """Prompts drawn per RL update: P, or ceil(k·P) under dynamic sampling (§7)."""
  p = config.rl.num_prompts
  if config.filtering.name == "dynamic_sampling":
    return math.ceil(config.filtering.oversample * p)
  return p


def learner_settings(config) -> Settings:
  """The frozen learner `Settings` of `config` (ConfigError naming a malformed section)."""
  try:
    return Settings.from_config(config)
  except ValueError as e:
    raise ConfigError(str(e)) from None


def _check_learner(config, e: list[str], mc: ModelConfig | None, t_max: int | None) -> None:
  """Each learner section's own checks, then the checks that span sections or the model."""
  try:
    settings = learner_settings(config)
  except ConfigError as err:
    e.append(str(err))
    return
  e.extend(settings.errors())
  name, advantage = settings.objective.name, settings.advantage.name
  is_moe = mc is not None and mc.moe_num_experts > 0
  if name == "rspo" and not is_moe:
    e.append(
      "objective.name='rspo' (§2.8) needs a mixture-of-experts policy: set model.moe_num_experts > 0"
    )
  if settings.replay.name in ("r2", "r3") and not is_moe:
    e.append(
      f"replay.name={settings.replay.name!r} replays MoE routing: set model.moe_num_experts > 0"
    )
  critic, has_head = name == "ppo_critic", mc is not None and mc.value_head
  if critic and not has_head:
    e.append("objective.name='ppo_critic' needs a value head: set model.value_head=True")
  if critic and advantage != "gae":
    e.append(
      f"objective.name='ppo_critic' uses GAE advantages: set advantage.name='gae' (got {advantage!r})"
    )
  if advantage == "gae" and not critic:
    e.append(
      "advantage.name='gae' needs a critic: use objective.name='ppo_critic' with model.value_head=True"
    )
  sh = settings.shaping
  if sh.name == "soft_overlong" and t_max is not None:
    _collect(
      e,
      1 <= sh.cache_len < t_max,
      f"shaping.cache_len={sh.cache_len} must be in [1, max_new_tokens={t_max})",
    )


def _attention_errors(value, mc: ModelConfig) -> list[str]:
  """A known `model.attention`; 'cudnn' only where cuDNN flash attention can run this model."""
  if value not in attention.IMPLEMENTATIONS:
    return [f"model.attention={value!r}; allowed: {', '.join(attention.IMPLEMENTATIONS)}"]
  refusal = attention.cudnn_refusal(mc.compute_dtype, mc.head_dim) if value == "cudnn" else None
  if refusal:
    return [f"model.attention='cudnn' cannot run: {refusal}; use auto, xla or einsum"]
  return []


def check_required(config: ml_collections.ConfigDict) -> None:
  """Fails naming every field an experiment file left as "REQUIRED" (paths the user must give)."""
  missing = []

  def visit(node, prefix):
    for key, value in node.items():
      if hasattr(value, "items"):
        visit(value, f"{prefix}{key}.")
      elif value == "REQUIRED":
        missing.append(f"{prefix}{key}")

  visit(config, "")
  if missing:
    flags = " ".join(f"--config.{m}=..." for m in missing)
    raise ConfigError(f"this config needs {', '.join(missing)}; pass {flags}")


def validate(
  config: ml_collections.ConfigDict,
  *,
  num_devices: int,
  task=None,
  model_override: ModelConfig | None = None,
) -> None:
  """Raises ConfigError listing every problem found in `config` (before anything compiles)."""
  e: list[str] = []
  s, rl, tr = config.sampling, config.rl, config.train
  g = s.group_size
  _collect(e, g >= 2, f"sampling.group_size={g} must be >= 2 (group advantages need a group)")
  _collect(e, s.temperature > 0, f"sampling.temperature={s.temperature} must be > 0")
  _collect(e, 0 < s.top_p <= 1, f"sampling.top_p={s.top_p} must be in (0, 1]")
  _collect(e, s.top_k >= 0, f"sampling.top_k={s.top_k} must be >= 0 (0 = off)")
  _collect(e, s.max_new_tokens >= 0, f"sampling.max_new_tokens={s.max_new_tokens} must be >= 0")
  b = rl.num_prompts * g
  mb = b // max(rl.num_minibatches, 1)
  if rl.num_minibatches >= 1 and b % rl.num_minibatches:
    e.append(
      f"rl.num_prompts * sampling.group_size = {b} sequences do not split into "
      f"rl.num_minibatches={rl.num_minibatches} equal minibatches"
    )
  elif rl.num_microbatches >= 1 and mb % rl.num_microbatches:  # 0 = auto picks a divisor
    e.append(
      f"minibatch of {mb} sequences does not split into rl.num_microbatches={rl.num_microbatches}"
    )
  if config.sampling.param_dtype not in SAMPLER_DTYPES:
    e.append(
      f"sampling.param_dtype={config.sampling.param_dtype!r}; allowed: {', '.join(SAMPLER_DTYPES)}"
    )
  m = config.mesh
  try:
    sizes = sharding.mesh_shape(
      num_devices, data=m.data, fsdp=m.get("fsdp", 1), expert=m.expert, model=m.model
    )
  except ValueError as err:
    e.append(str(err))
    sizes = None
  if sizes and jax.process_count() > 1 and math.prod(sizes.values()) != num_devices:
    e.append(
      " x ".join(f"mesh.{k}={v}" for k, v in sizes.items())
      + f" does not use all {num_devices} devices of the {jax.process_count()} processes; a "
      "multi-process mesh must span every device (mesh.data=-1 fills it)"
    )
  data = sizes["data"] * sizes["fsdp"] * sizes["expert"] if sizes else 0  # rows' devices
  if sizes and sizes["expert"] > 1:
    experts = model_override.moe_num_experts if model_override else config.model.moe_num_experts
    if experts % sizes["expert"]:
      e.append(
        f"model.moe_num_experts={experts} is not divisible by mesh.expert={sizes['expert']} "
        "(each expert-parallel device holds the same number of experts)"
      )
  if data >= 1 and not e:
    sampled = num_sampled_prompts(config)
    if sampled % data:
      what = (
        "ceil(filtering.oversample * rl.num_prompts)"
        if sampled != rl.num_prompts
        else "rl.num_prompts"
      )
      e.append(
        f"{what}={sampled} is not divisible by the {data} data-parallel devices "
        f"of the mesh (mesh.data x mesh.fsdp x mesh.expert = "
        f"{sizes['data']} x {sizes['fsdp']} x {sizes['expert']}); "
        f"use a multiple of {data}"
      )
    if rl.num_prompts % data:
      e.append(
        f"rl.num_prompts={rl.num_prompts} is not divisible by the {data} data-parallel devices"
      )
    if rl.num_minibatches >= 1 and mb % data:
      e.append(f"minibatch of {mb} sequences is not divisible by the {data} data-parallel devices")
    if config.sft.steps and config.sft.batch_size % data:
      e.append(f"sft.batch_size={config.sft.batch_size} is not divisible by {data} devices")
    eval_size = config.task.get("eval_size", 0)
    if not config.data.get("train_files") and eval_size % data:  # file evals are padded
      e.append(
        f"task.eval_size={eval_size} is not divisible by the {data} data-parallel devices; "
        f"use a multiple of {data}"
      )
  for name in ("num_steps", "eval_every", "log_every", "checkpoint_every"):
    _collect(e, tr[name] >= 1, f"train.{name}={tr[name]} must be >= 1")
  _collect(
    e, tr.stop_after_steps >= 0, f"train.stop_after_steps={tr.stop_after_steps} must be >= 0"
  )
  _collect(
    e, tr.profile_steps >= 0, f"train.profile_steps={tr.profile_steps} must be >= 0 (0 = off)"
  )
  _collect(e, tr.pass_k >= 1, f"train.pass_k={tr.pass_k} must be >= 1")
  _collect(e, config.sft.steps >= 0, f"sft.steps={config.sft.steps} must be >= 0")
  _collect(
    e,
    config.optim.learning_rate > 0,
    f"optim.learning_rate={config.optim.learning_rate} must be > 0",
  )
  _collect(e, config.optim.grad_clip >= 0, f"optim.grad_clip={config.optim.grad_clip} must be >= 0")
  for name in ("b1", "b2"):
    value = config.optim[name]
    _collect(e, 0 <= value < 1, f"optim.{name}={value} must be in [0, 1) (Adam's moment decay)")
  _collect(
    e,
    config.optim.warmup_steps >= 0,
    f"optim.warmup_steps={config.optim.warmup_steps} must be >= 0",
  )
  _collect(
    e,
    config.optim.weight_decay >= 0,
    f"optim.weight_decay={config.optim.weight_decay} must be >= 0",
  )
  _collect(
    e, config.sft.learning_rate > 0, f"sft.learning_rate={config.sft.learning_rate} must be > 0"
  )
  _collect(e, tr.max_to_keep >= 1, f"train.max_to_keep={tr.max_to_keep} must be >= 1")
  _collect(
    e,
    tr.max_skipped_updates >= 1,
    f"train.max_skipped_updates={tr.max_skipped_updates} must be >= 1",
  )
  _collect(
    e, config.task.get("digits", 1) >= 1, f"task.digits={config.task.get('digits')} must be >= 1"
  )
  _collect(e, config.sft.batch_size >= 1, f"sft.batch_size={config.sft.batch_size} must be >= 1")
  _collect(e, tr.text_samples >= 0, f"train.text_samples={tr.text_samples} must be >= 0")
  _collect(e, 0 <= config.kl.ema <= 1, f"kl.ema={config.kl.ema} must be in [0, 1]")
  _collect(
    e, config.shaping.cache_len >= 0, f"shaping.cache_len={config.shaping.cache_len} must be >= 0"
  )
  _collect(
    e,
    config.filtering.oversample >= 1,
    f"filtering.oversample={config.filtering.oversample} must be >= 1 (it draws ceil(k * P) "
    "prompt groups to keep P)",
  )
  d = config.data
  _collect(e, 0 <= d.eval_fraction < 1, f"data.eval_fraction={d.eval_fraction} must be in [0, 1)")
  _collect(e, d.prompt_len >= 1, f"data.prompt_len={d.prompt_len} must be >= 1")
  from jaxrl_llm.data import templates, verifiers  # light; imported here to keep this one lean

  if d.template not in templates.PROMPT_TEMPLATES:
    e.append(
      f"data.template={d.template!r}; allowed: {', '.join(sorted(templates.PROMPT_TEMPLATES))}"
    )
  if d.correct_term not in verifiers.REWARD_FNS:
    e.append(
      f"data.correct_term={d.correct_term!r}; allowed: {', '.join(sorted(verifiers.REWARD_FNS))}"
    )
  timeout = config.data.get("verifier_timeout_s", 1.0)
  _collect(e, timeout > 0, f"data.verifier_timeout_s={timeout} must be > 0")
  if (model_override.param_dtype if model_override else config.model.param_dtype) == "float16":
    e.append(
      "model.param_dtype='float16' is refused: Adam's small updates underflow in float16 and "
      "the run turns NaN; keep float32 (or bfloat16) parameters and set model.dtype=float16 "
      "for float16 compute"
    )
  _collect(
    e, 0 <= config.optim.decay_to <= 1, f"optim.decay_to={config.optim.decay_to} must be in [0, 1]"
  )
  try:
    mc = model_override or model_config(config)
  except ConfigError as err:
    e.append(str(err))
    mc = None
  if mc is not None:
    e.extend(_attention_errors(config.model.attention, mc))
    try:
      mc.moe  # noqa: B018 - builds (and checks) the MoE layers' config
    except ValueError as err:  # fields named moe.<x> are model.moe_<x> in the config
      e.append(str(err).replace("moe.", "model.moe_"))
  if mc is not None and sizes and mc.d_model % sizes["fsdp"]:
    e.append(
      f"mesh.fsdp={sizes['fsdp']} does not divide model.d_model={mc.d_model} (FSDP splits "
      "every weight along d_model); use a divisor of it"
    )
  if model_override is not None and config.model.value_head:
    e.append("model.value_head with model.checkpoint is not supported (no pretrained value head)")
  if task is not None and task.rewards_on_host:
    _collect(e, s.max_new_tokens >= 1, "sampling.max_new_tokens must be >= 1 with data.train_files")
    _collect(
      e, config.sft.steps == 0, "sft.steps must be 0 with data.train_files (no warm start on files)"
    )
    _collect(
      e, config.data.prompt_len >= 1, f"data.prompt_len={config.data.prompt_len} must be >= 1"
    )
  t_max = (s.max_new_tokens or task.max_new_tokens) if task is not None else None
  _check_learner(config, e, mc, t_max)
  if task is not None:
    if mc is not None and task.tokenizer.vocab_size > mc.vocab_size:
      e.append(
        f"model.vocab_size={mc.vocab_size} is smaller than task {task.name!r}'s vocabulary "
        f"of {task.tokenizer.vocab_size} tokens"
      )
    weights = dict(config.task.reward_weights)
    if not any(weights.values()):
      e.append("task.reward_weights are all 0: the reward would be constant")
  if e:
    raise ConfigError("invalid config:\n  - " + "\n  - ".join(e))


def sampling_config(config, task, *, greedy: bool = False, group_size: int | None = None):
  """The static `SamplingConfig` of the RL sampler (or the evaluation sampler)."""
  s = config.sampling
  return SamplingConfig(
    max_new_tokens=s.max_new_tokens or task.max_new_tokens,
    group_size=group_size or s.group_size,
    temperature=float(s.temperature),
    top_k=int(s.top_k),
    top_p=float(s.top_p),
    greedy=greedy,
    eos_id=task.tokenizer.eos_id,
    pad_id=task.tokenizer.pad_id,
  )
