"""Start-up validation of experiment configs and construction of the static settings.

Every check names the config field, the bad value and what is allowed, and runs before
anything is compiled. Derived values are computed here and never written back into the config.
"""

from __future__ import annotations

import math
from typing import Any

import ml_collections

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.quant import SAMPLER_DTYPES
from jaxrl_llm.rl_step import RLConfig
from jaxrl_llm.sampling import SamplingConfig

SHAPINGS = ("none", "soft_overlong")
FILTERS = ("none", "dynamic_sampling", "reinforce_rej")
REFERENCES = ("frozen", "reset_every", "ema")
REPLAYS = ("none", "r2", "r3")


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
  """The frozen `ModelConfig` described by `config.model` (without `checkpoint`)."""
  try:
    return ModelConfig.from_dict({k: v for k, v in config.model.items() if k != "checkpoint"})
  except (TypeError, ValueError) as e:
    raise ConfigError(str(e)) from None


def num_sampled_prompts(config) -> int:
  """Prompts drawn per RL update: P, or ceil(k·P) under dynamic sampling (§7)."""
  p = config.rl.num_prompts
  if config.filtering.name == "dynamic_sampling":
    return math.ceil(config.filtering.oversample * p)
  return p


def objective_kwargs(config) -> tuple[tuple[str, Any], ...]:
  """Keyword arguments of the selected §2 objective, taken from `config.objective`."""
  o = config.objective
  name = o.name
  if name in ("ppo_clip", "ppo_critic"):
    kw = {"clip_low": o.clip_low, "clip_high": o.clip_high}
    if o.dual_clip:
      kw["dual_clip"] = o.dual_clip
  elif name in ("gspo", "gspo_token"):
    kw = {"clip_low": o.clip_low, "clip_high": o.clip_high}
  elif name == "cispo":
    kw = {"clip_low": o.clip_low, "clip_high": o.clip_high, "cispo_mask": bool(o.cispo_mask)}
  elif name == "rspo":
    kw = {"clip_low": o.clip_low, "clip_high": o.clip_high}
  elif name == "gmpo":
    kw = {"clip_log": o.clip_log}
  elif name == "sapo":
    kw = {"tau_pos": o.tau_pos, "tau_neg": o.tau_neg}
  else:
    kw = {}
  return tuple(
    sorted(
      (k, float(v) if isinstance(v, float | int) and not isinstance(v, bool) else v)
      for k, v in kw.items()
    )
  )


def _check_names(config, e: list[str]) -> None:
  from jaxrl_llm import objectives

  for section, kind in (
    ("advantage", "advantage"),
    ("objective", "objective"),
    ("aggregation", "aggregation"),
    ("kl", "kl"),
  ):
    try:
      objectives.validate(kind, config[section].name)
    except ValueError as err:
      e.append(f"{section}.name: {err}")
  try:
    objectives.parse_correction(config.correction.name)
  except ValueError as err:
    e.append(f"correction.name: {err}")
  for section, allowed in (
    ("shaping", SHAPINGS),
    ("filtering", FILTERS),
  ):
    if config[section].name not in allowed:
      e.append(
        f"{section}.name={config[section].name!r} is unknown; valid names: {', '.join(allowed)}"
      )
  if config.kl.placement not in ("loss", "reward"):
    e.append(f"kl.placement={config.kl.placement!r}; allowed: loss, reward")
  if config.kl.reference not in REFERENCES:
    e.append(f"kl.reference={config.kl.reference!r}; allowed: {', '.join(REFERENCES)}")
  if config.sampling.param_dtype not in SAMPLER_DTYPES:
    e.append(
      f"sampling.param_dtype={config.sampling.param_dtype!r}; allowed: {', '.join(SAMPLER_DTYPES)}"
    )


def _check_objective(config, e: list[str], mc: ModelConfig | None) -> None:
  o, name = config.objective, config.objective.name
  is_moe = mc is not None and mc.moe_num_experts > 0
  if name == "rspo":
    if not is_moe:
      e.append(
        "objective.name='rspo' (§2.8) needs a mixture-of-experts policy: set "
        "model.moe_num_experts > 0"
      )
    _collect(e, 0 < o.gamma_min <= 1, f"objective.gamma_min={o.gamma_min} must be in (0, 1]")
  replay = config.replay.name
  if replay not in REPLAYS:
    e.append(f"replay.name={replay!r} is unknown; valid names: {', '.join(REPLAYS)}")
  elif replay != "none" and not is_moe:
    e.append(f"replay.name={replay!r} replays MoE routing: set model.moe_num_experts > 0")
  hi_ok = 0 < o.clip_high < 1
  lo_ok = 0 < o.clip_low <= 1 if name == "cispo" else 0 < o.clip_low < 1
  if name in ("ppo_clip", "ppo_critic", "gspo", "gspo_token", "cispo", "rspo"):
    _collect(
      e, lo_ok, f"objective.clip_low={o.clip_low} must be in (0, 1{']' if name == 'cispo' else ')'}"
    )
    _collect(e, hi_ok, f"objective.clip_high={o.clip_high} must be in (0, 1)")
  if o.dual_clip:
    _collect(e, o.dual_clip > 1, f"objective.dual_clip={o.dual_clip} must be > 1 (or 0 = off)")
  _collect(e, o.clip_log > 0, f"objective.clip_log={o.clip_log} must be > 0")
  _collect(
    e,
    o.tau_pos > 0 and o.tau_neg > 0,
    f"objective.tau_pos/tau_neg=({o.tau_pos}, {o.tau_neg}) must be > 0",
  )
  critic = name == "ppo_critic"
  has_head = mc is not None and mc.value_head
  if critic and not has_head:
    e.append("objective.name='ppo_critic' needs a value head: set model.value_head=True")
  if critic and config.advantage.name != "gae":
    e.append(
      f"objective.name='ppo_critic' uses GAE advantages: set advantage.name='gae' (got {config.advantage.name!r})"
    )
  if config.advantage.name == "gae" and not critic:
    e.append(
      "advantage.name='gae' needs a critic: use objective.name='ppo_critic' with model.value_head=True"
    )
  _collect(e, 0 < o.value_clip, f"objective.value_clip={o.value_clip} must be > 0")
  _collect(
    e,
    0 <= config.advantage.gamma <= 1,
    f"advantage.gamma={config.advantage.gamma} must be in [0, 1]",
  )
  _collect(
    e, 0 <= config.advantage.lam <= 1, f"advantage.lam={config.advantage.lam} must be in [0, 1]"
  )


def _check_regularisers(config, e: list[str], t_max: int | None) -> None:
  kl, c, sh, f = config.kl, config.correction, config.shaping, config.filtering
  _collect(e, kl.beta >= 0, f"kl.beta={kl.beta} must be >= 0")
  if kl.name == "k3_is" and kl.placement == "reward":
    e.append(
      "kl.name='k3_is' is a loss estimator (its gradient is the point); use kl.placement='loss'"
    )
  if kl.beta > 0 and kl.reference == "reset_every":
    _collect(
      e,
      kl.reset_every >= 1,
      f"kl.reset_every={kl.reset_every} must be >= 1 with kl.reference='reset_every'",
    )
  if kl.beta > 0 and kl.reference == "ema":
    _collect(e, 0 < kl.ema <= 1, f"kl.ema={kl.ema} must be in (0, 1] with kl.reference='ema'")
  _collect(e, c.cap > 0, f"correction.cap={c.cap} must be > 0")
  _collect(e, c.geo_low >= 0, f"correction.geo_low={c.geo_low} must be >= 0")
  if c.geo_high:
    _collect(
      e,
      c.geo_high > c.geo_low,
      f"correction.geo_high={c.geo_high} must exceed correction.geo_low={c.geo_low}",
    )
  if sh.name == "soft_overlong" and t_max is not None:
    _collect(
      e,
      1 <= sh.cache_len < t_max,
      f"shaping.cache_len={sh.cache_len} must be in [1, max_new_tokens={t_max})",
    )
  if f.name == "dynamic_sampling":
    _collect(e, f.oversample >= 1, f"filtering.oversample={f.oversample} must be >= 1")
  _collect(e, config.rl.entropy_coef >= 0, f"rl.entropy_coef={config.rl.entropy_coef} must be >= 0")


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
  _collect(e, rl.num_prompts >= 1, f"rl.num_prompts={rl.num_prompts} must be >= 1")
  _collect(e, rl.num_epochs >= 1, f"rl.num_epochs={rl.num_epochs} must be >= 1")
  _collect(e, rl.num_minibatches >= 1, f"rl.num_minibatches={rl.num_minibatches} must be >= 1")
  _collect(e, rl.num_microbatches >= 1, f"rl.num_microbatches={rl.num_microbatches} must be >= 1")
  b = rl.num_prompts * g
  mb = b // max(rl.num_minibatches, 1)
  if rl.num_minibatches >= 1 and b % rl.num_minibatches:
    e.append(
      f"rl.num_prompts * sampling.group_size = {b} sequences do not split into "
      f"rl.num_minibatches={rl.num_minibatches} equal minibatches"
    )
  elif rl.num_microbatches >= 1 and mb % rl.num_microbatches:
    e.append(
      f"minibatch of {mb} sequences does not split into rl.num_microbatches={rl.num_microbatches}"
    )
  _check_names(config, e)
  inner = max(config.mesh.model, 1) * max(config.mesh.expert, 1)
  data = config.mesh.data if config.mesh.data != -1 else num_devices // inner
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
        f"of the mesh (mesh.data={config.mesh.data}); use a multiple of {data}"
      )
    if rl.num_prompts % data:
      e.append(
        f"rl.num_prompts={rl.num_prompts} is not divisible by the {data} data-parallel devices"
      )
    if rl.num_minibatches >= 1 and mb % data:
      e.append(f"minibatch of {mb} sequences is not divisible by the {data} data-parallel devices")
    if config.sft.steps and config.sft.batch_size % data:
      e.append(f"sft.batch_size={config.sft.batch_size} is not divisible by {data} devices")
  for name in ("num_steps", "eval_every", "log_every", "checkpoint_every"):
    _collect(e, tr[name] >= 1, f"train.{name}={tr[name]} must be >= 1")
  _collect(
    e, tr.stop_after_steps >= 0, f"train.stop_after_steps={tr.stop_after_steps} must be >= 0"
  )
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
    mc = model_override or model_config(config)
  except ConfigError as err:
    e.append(str(err))
    mc = None
  if model_override is not None and config.model.value_head:
    e.append("model.value_head with model.checkpoint is not supported (no pretrained value head)")
  if getattr(task, "host_reward", False):
    _collect(e, s.max_new_tokens >= 1, "sampling.max_new_tokens must be >= 1 with data.train_files")
    _collect(
      e, config.sft.steps == 0, "sft.steps must be 0 with data.train_files (no warm start on files)"
    )
    _collect(
      e, config.data.prompt_len >= 1, f"data.prompt_len={config.data.prompt_len} must be >= 1"
    )
  t_max = (s.max_new_tokens or task.max_new_tokens) if task is not None else None
  _check_objective(config, e, mc)
  _check_regularisers(config, e, t_max)
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
  """The static `RLConfig` of the learner, from the config's objective sections."""
  rl, kl, c, sh = config.rl, config.kl, config.correction, config.shaping
  return RLConfig(
    num_epochs=int(rl.num_epochs),
    num_minibatches=int(rl.num_minibatches),
    num_microbatches=int(rl.num_microbatches),
    entropy_coef=float(rl.entropy_coef),
    advantage=config.advantage.name,
    whiten=bool(config.advantage.whiten),
    gae_gamma=float(config.advantage.gamma),
    gae_lambda=float(config.advantage.lam),
    objective=config.objective.name,
    objective_kwargs=objective_kwargs(config),
    value_coef=float(config.objective.value_coef),
    value_clip=float(config.objective.value_clip),
    aggregation=config.aggregation.name,
    correction=c.name,
    correction_cap=float(c.cap),
    geo_low=float(c.geo_low),
    geo_high=float(c.geo_high) if c.geo_high else None,
    kl_beta=float(kl.beta),
    kl_estimator=kl.name,
    kl_placement=kl.placement,
    ref_update=kl.reference,
    ref_reset_every=int(kl.reset_every),
    ref_ema=float(kl.ema),
    ref_reset_optimizer=bool(kl.reset_optimizer),
    overlong_penalty=sh.name == "soft_overlong",
    overlong_cache_len=int(sh.cache_len),
    overlong_weight=float(sh.weight),
    overlong_filter=bool(sh.overlong_filter),
    replay=config.replay.name,
    gamma_min=float(config.objective.gamma_min),
    filtering=config.filtering.name,
    keep_prompts=int(rl.num_prompts),
    reward_weights=tuple(sorted((k, float(v)) for k, v in config.task.reward_weights.items())),
  )
