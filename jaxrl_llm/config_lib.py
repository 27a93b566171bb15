"""Start-up validation of experiment configs and construction of the static settings.

Every check names the config field, the bad value and what is allowed, and runs before
anything is compiled. Derived values are computed here and never written back into the config.
"""

from __future__ import annotations

import ml_collections

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.rl_step import RLConfig
from jaxrl_llm.sampling import SamplingConfig


class ConfigError(ValueError):
  """A config value is missing, unknown or out of range."""


def _get(config, path: str):
  node = config
  for part in path.split("."):
    if part not in node:
      raise ConfigError(f"config is missing the field {path!r}")
    node = node[part]
  return node


def _collect(errors: list[str], cond: bool, message: str):
  if not cond:
    errors.append(message)


def model_config(config: ml_collections.ConfigDict) -> ModelConfig:
  """The frozen `ModelConfig` described by `config.model`."""
  try:
    return ModelConfig.from_dict(dict(config.model))
  except (TypeError, ValueError) as e:
    raise ConfigError(str(e)) from None


def validate(config: ml_collections.ConfigDict, *, num_devices: int, task=None) -> None:
  """Raises ConfigError listing every problem found in `config`."""
  e: list[str] = []
  s, rl, tr = config.sampling, config.rl, config.train
  g = s.group_size
  _collect(e, g >= 2, f"sampling.group_size={g} must be >= 2 (group advantages need a group)")
  _collect(e, s.temperature > 0, f"sampling.temperature={s.temperature} must be > 0")
  _collect(e, 0 < s.top_p <= 1, f"sampling.top_p={s.top_p} must be in (0, 1]")
  _collect(e, s.top_k >= 0, f"sampling.top_k={s.top_k} must be >= 0 (0 = off)")
  _collect(e, s.max_new_tokens >= 0, f"sampling.max_new_tokens={s.max_new_tokens} must be >= 0")
  for name in ("clip_low", "clip_high"):
    v = rl[name]
    _collect(e, 0 < v < 1, f"rl.{name}={v} must be in (0, 1)")
  _collect(e, rl.kl_beta >= 0, f"rl.kl_beta={rl.kl_beta} must be >= 0")
  _collect(e, rl.num_prompts >= 1, f"rl.num_prompts={rl.num_prompts} must be >= 1")
  _collect(e, rl.num_epochs >= 1, f"rl.num_epochs={rl.num_epochs} must be >= 1")
  _collect(e, rl.num_minibatches >= 1, f"rl.num_minibatches={rl.num_minibatches} must be >= 1")
  b = rl.num_prompts * g
  if rl.num_minibatches >= 1 and b % rl.num_minibatches:
    e.append(
      f"rl.num_prompts * sampling.group_size = {b} sequences do not split into "
      f"rl.num_minibatches={rl.num_minibatches} equal minibatches"
    )
  data = config.mesh.data if config.mesh.data != -1 else num_devices // max(config.mesh.model, 1)
  if data >= 1:
    if rl.num_prompts % data:
      e.append(
        f"rl.num_prompts={rl.num_prompts} is not divisible by the {data} data-parallel devices "
        f"of the mesh (mesh.data={config.mesh.data}); use a multiple of {data}"
      )
    if rl.num_minibatches >= 1 and (b // rl.num_minibatches) % data:
      e.append(
        f"minibatch of {b // rl.num_minibatches} sequences is not divisible by the {data} "
        f"data-parallel devices"
      )
    if config.sft.steps and config.sft.batch_size % data:
      e.append(f"sft.batch_size={config.sft.batch_size} is not divisible by {data} devices")
  for name in ("num_steps", "eval_every", "log_every", "checkpoint_every"):
    _collect(e, tr[name] >= 1, f"train.{name}={tr[name]} must be >= 1")
  _collect(e, tr.stop_after_steps >= 0, f"train.stop_after_steps={tr.stop_after_steps} must be >= 0")
  _collect(e, tr.pass_k >= 1, f"train.pass_k={tr.pass_k} must be >= 1")
  _collect(e, config.sft.steps >= 0, f"sft.steps={config.sft.steps} must be >= 0")
  _collect(
    e,
    config.optim.learning_rate > 0,
    f"optim.learning_rate={config.optim.learning_rate} must be > 0",
  )
  _collect(e, config.optim.grad_clip >= 0, f"optim.grad_clip={config.optim.grad_clip} must be >= 0")
  _collect(
    e, 0 <= config.optim.decay_to <= 1, f"optim.decay_to={config.optim.decay_to} must be in [0, 1]"
  )
  try:
    from jaxrl_llm import objectives

    for kind, name in (
      ("advantage", rl.advantage),
      ("objective", rl.objective),
      ("aggregation", rl.aggregation),
      ("kl", rl.kl_estimator),
    ):
      objectives.validate(kind, name)
  except ValueError as err:
    e.append(f"rl: {err}")
  if rl.kl_estimator == "k3_is":
    e.append("rl.kl_estimator='k3_is' needs an old policy; use k1, k2 or k3 here")
  try:
    mc = model_config(config)
  except ConfigError as err:
    e.append(str(err))
    mc = None
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


def rl_config(config) -> RLConfig:
  """The static `RLConfig` of the learner."""
  rl = config.rl
  return RLConfig(
    num_epochs=int(rl.num_epochs),
    num_minibatches=int(rl.num_minibatches),
    advantage=rl.advantage,
    objective=rl.objective,
    aggregation=rl.aggregation,
    clip_low=float(rl.clip_low),
    clip_high=float(rl.clip_high),
    kl_beta=float(rl.kl_beta),
    kl_estimator=rl.kl_estimator,
    reward_weights=tuple(sorted((k, float(v)) for k, v in config.task.reward_weights.items())),
  )
