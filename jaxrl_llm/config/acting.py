"""Settings a run never reads: a value other than the default of a field that the run of a
config ignores (another objective's hyperparameter, a KL setting without a KL term, GAE's γ
under a group estimator, ...) is refused on the command line and left out of a sweep's point
(docs/sweeps.md), so two runs that differ only there are not trained as different arms."""

from __future__ import annotations

import dataclasses

from jaxrl_llm import objectives
from jaxrl_llm.config.tree import Config
from jaxrl_llm.models.config import RESUME_SPELLINGS


def _kl_unused(cfg: Config, field: str) -> str | None:
  """Why the run ignores the KL setting `field` (None when it acts)."""
  kl = cfg.kl
  if field == "kl.beta":
    return None
  if kl.beta == 0:
    return "kl.beta=0 has no KL term (set kl.beta > 0)"
  if field in ("kl.name", "kl.k3_clamp") and kl.placement == "reward":
    return "kl.placement='reward' subtracts k1 from the rewards (§4)"
  if field == "kl.k3_clamp" and kl.name not in ("k3", "k3_is"):
    return f"kl.name={kl.name!r} is not k3 or k3_is"
  if field in ("kl.reset_every", "kl.reset_optimizer") and kl.reference != "reset_every":
    return f"kl.reference={kl.reference!r} (it acts with kl.reference='reset_every')"
  if field == "kl.ema" and kl.reference != "ema":
    return f"kl.reference={kl.reference!r} (it acts with kl.reference='ema')"
  return None


def _model_unused(cfg: Config, name: str) -> str | None:
  """Why the run ignores the model setting `name`: an expert's shape on a dense model built
  from the config (a checkpoint's own architecture is not judged), an adapter's alpha or
  targets without adapters, a RoPE scaling's setting without that scaling."""
  arch = cfg.model.arch
  moe = name.startswith("moe_") and name not in ("moe_num_experts", "moe_impl")
  if moe and not cfg.model.checkpoint and not arch.moe_num_experts:
    return "model.moe_num_experts=0 builds a dense model"
  if name in ("lora_alpha", "lora_targets") and not arch.lora_rank:
    return "model.lora_rank=0 trains no adapters"
  llama3 = name in ("rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_len")
  scaling = arch.rope_scaling
  if cfg.model.checkpoint or not (llama3 or name == "rope_scaling_factor"):
    return None
  if llama3 and scaling != "llama3":
    return f"model.rope_scaling={scaling!r} (it acts with model.rope_scaling='llama3')"
  if scaling == "none":
    return "model.rope_scaling='none' (it acts with model.rope_scaling='linear' or 'llama3')"
  return None


def _learner_unused(cfg: Config, field: str) -> str | None:
  """Why the run ignores the learner setting `field`: GAE's γ, λ under another estimator,
  whitening's variance without whitening, the soft overlong term's settings without it, the
  group statistics of overlong filtering without it, dynamic sampling's factor without it,
  the sum-norm divisor of another aggregation."""
  adv, sh, mode = cfg.advantage, cfg.shaping, cfg.aggregation.name
  if field in ("advantage.gamma", "advantage.lam", "advantage.gae_carry_masked"):
    gae = adv.name == "gae"
    return None if gae else f"advantage.name={adv.name!r} (it acts with advantage.name='gae')"
  if field == "advantage.whiten_variance" and not adv.whiten:
    return "advantage.whiten=False whitens nothing (it acts with advantage.whiten=True)"
  if field in ("shaping.cache_len", "shaping.weight") and sh.name != "soft_overlong":
    return f"shaping.name={sh.name!r} (it acts with shaping.name='soft_overlong')"
  if field == "shaping.overlong_in_group_stats" and not sh.overlong_filter:
    return (
      "shaping.overlong_filter=False filters nothing (it acts with shaping.overlong_filter=True)"
    )
  if field == "filtering.oversample" and cfg.filtering.name != "dynamic_sampling":
    name = cfg.filtering.name
    return f"filtering.name={name!r} (it acts with filtering.name='dynamic_sampling')"
  if field == "aggregation.sum_norm_sequences" and mode != "seq_mean_token_sum_norm":
    return f"aggregation.name={mode!r} (it acts with aggregation.name='seq_mean_token_sum_norm')"
  return None


def _task_unused(cfg: Config, name: str) -> str | None:
  """Why the run ignores the task setting `name`: tool traces on a task that writes none, a
  field of other built-in tasks than the selected one (`task.digits` of reverse)."""
  from jaxrl_llm.data import tasks

  selected, traces = cfg.task.name, trace_tools()
  if name == "tool_traces" and selected not in traces:
    return f"task.name={selected!r} writes no tool traces ({', '.join(traces)} do)"
  if cfg.uses_files or selected not in tasks.TASKS:
    return None
  takes = {n for n, c in tasks.TASKS.items() if name in {f.name for f in _fields(c)}}
  if not takes or selected in takes:
    return None
  return f"task.name={selected!r} does not take it (it acts with task.name in {sorted(takes)})"


def _unused_reason(cfg: Config, field: str) -> str | None:
  """Why the run of `cfg` ignores the setting `field` (None when it acts or is not judged)."""
  section, _, name = field.partition(".")
  if section == "objective" and name in ("value_coef", "value_clip"):
    critic = cfg.objective.name == "ppo_critic"
    return None if critic else f"objective.name={cfg.objective.name!r} has no critic (ppo_critic)"
  if section == "objective" and name != "name":
    taken = cfg.objective.spec.hyperparameters
    if name in taken:
      return None
    return f"objective.name={cfg.objective.name!r} does not take it (it takes: {sorted(taken)})"
  if section == "kl":
    return _kl_unused(cfg, field)
  if section == "model":
    return _model_unused(cfg, name)
  if section in ("advantage", "shaping", "filtering", "aggregation"):
    return _learner_unused(cfg, field)
  if section == "task":
    return _task_unused(cfg, name)
  if section == "sft" and name != "steps" and not cfg.sft.steps:
    return "sft.steps=0 runs no warm start (it acts with sft.steps > 0)"
  if section == "sampling" and name in ("max_turns", "turn_tokens") and cfg.sampling.tool == "none":
    return "sampling.tool='none' samples one segment, with no turns"
  if section == "data" and name not in ("train_files", "verifier_timeout_s") and not cfg.uses_files:
    return f"data.train_files is empty: the built-in task {cfg.task.name!r} reads no files"
  if section == "correction" and name in ("cap", "geo_low", "geo_high"):
    parts = cfg.correction.name.split("+")
    if name == "cap" and parts != ["none"] and parts != ["geo_mask"]:
      return None
    if name == "cap" and "geo_mask" in parts and not cfg.correction.geo_high:
      return None  # geo_mask's C_high
    if name != "cap" and "geo_mask" in parts:
      return None
    return f"correction.name={cfg.correction.name!r} does not use it"
  return None


def trace_tools() -> dict[str, tuple[str, ...]]:
  """The built-in tasks that write tool traces (`task.tool_traces`), each with the tools whose
  answers its traces show."""
  from jaxrl_llm.data import tasks

  return {n: c.trace_tools for n, c in sorted(tasks.TASKS.items()) if hasattr(c, "trace_tools")}


def _fields(cls) -> tuple:
  """The constructor's fields of a task class."""
  return tuple(f for f in dataclasses.fields(cls) if f.init)


def _value(cfg: Config, field: str):
  """The value of the setting `field` ("section.name") in `cfg` (an objective's
  hyperparameter: the value set, None when unset)."""
  section, _, name = field.partition(".")
  node = getattr(cfg, section)
  if section == "model" and name not in ("checkpoint", "attention"):
    node = node.arch
  if section == "objective" and name in objectives.hyperparameter_kinds():
    return node.get(name)
  return getattr(node, name)


def ignored(cfg: Config, field: str, given=None) -> str | None:
  """`field=value has no effect: why` when the setting `field` holds another value than the
  embedded default and the run of `cfg` never reads it (`unused`); None otherwise. The value
  is said as `given` (the ConfigDict `cfg` was parsed from) spells it, where given."""
  from jaxrl_llm.config.tree import default_config, parse

  why = _unused_reason(cfg, field)
  if why is None or _value(cfg, field) == _value(parse(default_config()), field):
    return None
  value = _value(cfg, field)
  if given is not None and field in RESUME_SPELLINGS:  # the user's spelling, not the model's
    section, _, name = field.partition(".")
    value = given[section][name]
  return f"{field}={value!r} has no effect: {why}"


def unused(cfg: Config, fields, given=None) -> list[str]:
  """The settings among `fields` (those a command line or a sweep sets) that hold another value
  than the embedded default and that the run of `cfg` ignores, each with why: an objective
  hyperparameter the selected objective does not take, a KL setting without a KL term or beside
  what acts (k1 in the reward, the reference's update), a correction bound its correction does
  not use, an expert's or adapter's setting without experts or adapters or a RoPE scaling's
  without it, GAE's γ, λ under another estimator, a shaping, filtering, whitening or
  aggregation setting beside what acts, turns without a tool, tool traces on a task that
  writes none, another built-in task's field, the warm start's at sft.steps=0, a prompt file's
  setting without prompt files. Values are said as `given` (`cfg`'s ConfigDict) spells them."""
  said = [ignored(cfg, field, given) for field in dict.fromkeys(fields)]
  return [f"{line}; drop it or set what it acts with" for line in said if line]


def unused_alone(cfg: Config, fields) -> list[str]:
  """The settings among `fields` that only a pack of runs reads, set on a single run's command
  line: mesh.runs_at_once above 1 (how many of a pack's runs step at once)."""
  pace = cfg.mesh.runs_at_once
  if "mesh.runs_at_once" not in fields or pace <= 1:
    return []
  return [
    f"mesh.runs_at_once={pace} has no effect: a single run steps alone (it paces a pack of "
    "runs, tools/sweep.py); drop it"
  ]
