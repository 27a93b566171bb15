"""Frozen learner settings, one dataclass per config section, under the config's own names.

`Settings.from_config(config)` builds every section generically: a section's fields are exactly
the fields of its dataclass (a test holds them equal to `default_config.py`), values are
coerced to the annotated type, and nothing is renamed. Each section checks its own ranges in
`errors()`; checks that span sections live in `config_lib.validate`. The objective's own
hyperparameters (clip widths, temperatures) stay unset here unless a config sets them: the
objective's signature default applies (`objectives.registry`).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any, ClassVar

from jaxrl_llm import objectives
from jaxrl_llm.models.transformer import REMAT_POLICIES

_CASTS = {"float": float, "int": int, "bool": bool, "str": str}

REMATS = ("auto", *REMAT_POLICIES)  # rl.remat values
AUTO_REMAT_PARAMS = 100_000_000  # remat="auto" rematerialises blocks from this many parameters


def _coerce(annotation: str, value: Any, where: str) -> Any:
  """`value` as the annotated type ("float", "int | None", ...), or a ValueError naming it."""
  kinds = [k.strip() for k in annotation.split("|")]
  if value is None:
    if "None" in kinds:
      return None
    raise ValueError(f"{where} must be set (got None)")
  base = next(k for k in kinds if k != "None")
  if base not in _CASTS:  # tuples and other structured fields are kept as given
    return value
  if base == "bool" and not isinstance(value, bool | int):
    raise ValueError(f"{where}={value!r} must be a bool")
  try:
    return _CASTS[base](value)
  except (TypeError, ValueError):
    raise ValueError(f"{where}={value!r} must be a {base}") from None


class Section:
  """Mixin: build from a config section with exactly the dataclass's fields."""

  SECTION: ClassVar[str]

  @classmethod
  def from_section(cls, section: Mapping[str, Any]):
    """The settings of `section` (a ConfigDict or dict); ValueError on missing/unknown keys."""
    fields = {f.name: f.type for f in dataclasses.fields(cls)}
    given = dict(section.items())
    unknown, missing = sorted(set(given) - set(fields)), sorted(set(fields) - set(given))
    if unknown or missing:
      raise ValueError(
        f"config section {cls.SECTION!r}: unknown fields {unknown}, missing fields {missing}; "
        f"allowed: {sorted(fields)}"
      )
    return cls(**{k: _coerce(t, given[k], f"{cls.SECTION}.{k}") for k, t in fields.items()})

  def errors(self) -> list[str]:
    """Range-check messages of this section alone (empty when valid)."""
    return []


def _name_error(section: str, kind: str, name: str) -> list[str]:
  try:
    objectives.validate(kind, name)
  except ValueError as e:
    return [f"{section}.name: {e}"]
  return []


def _allowed(field: str, value: str, allowed: tuple[str, ...]) -> list[str]:
  return [] if value in allowed else [f"{field}={value!r}; allowed: {', '.join(allowed)}"]


def _need(ok: bool, message: str) -> list[str]:
  return [] if ok else [message]


@dataclasses.dataclass(frozen=True)
class RLSettings(Section):
  """`rl`: batch, epochs, minibatches, microbatches and the entropy bonus (§5, §8)."""

  SECTION: ClassVar[str] = "rl"
  num_prompts: int
  num_epochs: int
  num_minibatches: int
  num_microbatches: int
  microbatch_tokens: int
  remat: str
  old_pass: str
  share_prompt: str
  entropy_coef: float

  def errors(self) -> list[str]:
    """Counts >= 1 (microbatches >= 0, 0 = auto), a known remat policy, c_e >= 0."""
    out = []
    for name in ("num_prompts", "num_epochs", "num_minibatches", "microbatch_tokens"):
      out += _need(getattr(self, name) >= 1, f"rl.{name}={getattr(self, name)} must be >= 1")
    out += _need(
      self.num_microbatches >= 0,
      f"rl.num_microbatches={self.num_microbatches} must be >= 0 (0 = auto)",
    )
    out += _allowed("rl.remat", self.remat, REMATS)
    out += _allowed("rl.old_pass", self.old_pass, ("auto", "always"))
    out += _allowed("rl.share_prompt", self.share_prompt, ("auto", "always", "never"))
    return out + _need(self.entropy_coef >= 0, f"rl.entropy_coef={self.entropy_coef} must be >= 0")

  def resolved(self, *, rows_per_device: int, seq_len: int, num_params: int) -> RLSettings:
    """`auto` choices made concrete for one run (derived values; the config is unchanged).

    num_microbatches=0: the fewest microbatches k dividing a device's minibatch rows with
    (rows / k)·seq_len <= microbatch_tokens. remat="auto": "full" from 1e8 parameters up
    (activations dominate there), else "none".
    """
    k = self.num_microbatches
    if k == 0:
      k = next(
        (
          d
          for d in range(1, rows_per_device + 1)
          if rows_per_device % d == 0 and rows_per_device // d * seq_len <= self.microbatch_tokens
        ),
        rows_per_device,
      )
    remat = (
      self.remat
      if self.remat != "auto"
      else ("full" if num_params >= AUTO_REMAT_PARAMS else "none")
    )
    return dataclasses.replace(self, num_microbatches=k, remat=remat)


@dataclasses.dataclass(frozen=True)
class AdvantageSettings(Section):
  """`advantage`: the §1 estimator, whitening and GAE's γ, λ."""

  SECTION: ClassVar[str] = "advantage"
  name: str
  whiten: bool
  whiten_variance: str
  gamma: float
  lam: float
  gae_carry_masked: bool

  def errors(self) -> list[str]:
    """A known estimator and whitening variance; γ, λ in [0, 1]."""
    return (
      _name_error("advantage", "advantage", self.name)
      + _allowed("advantage.whiten_variance", self.whiten_variance, ("population", "unbiased"))
      + _need(0 <= self.gamma <= 1, f"advantage.gamma={self.gamma} must be in [0, 1]")
      + _need(0 <= self.lam <= 1, f"advantage.lam={self.lam} must be in [0, 1]")
    )


@dataclasses.dataclass(frozen=True)
class ObjectiveSettings(Section):
  """`objective`: the §2 surrogate by name, its hyperparameters (None = its own default) and
  the critic's value-loss coefficient and clip (§2.9)."""

  SECTION: ClassVar[str] = "objective"
  name: str
  clip_low: float | None
  clip_high: float | None
  is_clip_low: float | None
  is_clip_high: float | None
  dual_clip: float | None
  clip_log: float | None
  tau_pos: float | None
  tau_neg: float | None
  cispo_mask: bool | None
  gamma_min: float | None
  value_coef: float
  value_clip: float

  @property
  def spec(self) -> objectives.ObjectiveSpec:
    """The registry row of the selected objective."""
    return objectives.get_objective(self.name)

  @property
  def hyperparameters(self) -> dict[str, Any]:
    """The selected objective's hyperparameters: set fields over its signature defaults."""
    return self.spec.resolve(dataclasses.asdict(self))

  def errors(self) -> list[str]:
    """A registered objective whose own range checks pass; a positive value clip."""
    out = _name_error("objective", "objective", self.name)
    if not out:
      out += self.spec.errors(self.hyperparameters)
    return out + _need(self.value_clip > 0, f"objective.value_clip={self.value_clip} must be > 0")


@dataclasses.dataclass(frozen=True)
class AggregationSettings(Section):
  """`aggregation`: the §5 loss aggregation mode."""

  SECTION: ClassVar[str] = "aggregation"
  name: str
  sum_norm_sequences: bool

  def errors(self) -> list[str]:
    """A known mode."""
    return _name_error("aggregation", "aggregation", self.name)


@dataclasses.dataclass(frozen=True)
class CorrectionSettings(Section):
  """`correction`: the §3 behaviour correction, its cap C and geometric-mask bounds."""

  SECTION: ClassVar[str] = "correction"
  name: str
  cap: float
  geo_low: float
  geo_high: float

  def errors(self) -> list[str]:
    """A known correction; C > 0; 0 <= C_low < C_high."""
    out = _name_error("correction", "correction", self.name)
    out += _need(self.cap > 0, f"correction.cap={self.cap} must be > 0")
    out += _need(self.geo_low >= 0, f"correction.geo_low={self.geo_low} must be >= 0")
    if self.geo_high:
      out += _need(
        self.geo_high > self.geo_low,
        f"correction.geo_high={self.geo_high} must exceed correction.geo_low={self.geo_low}",
      )
    return out


REFERENCES = ("frozen", "reset_every", "ema")


@dataclasses.dataclass(frozen=True)
class KLSettings(Section):
  """`kl`: the §4 estimator, β, where the penalty goes and how the reference moves."""

  SECTION: ClassVar[str] = "kl"
  name: str
  beta: float
  placement: str
  reference: str
  reset_every: int
  ema: float
  reset_optimizer: bool
  k3_clamp: float

  def errors(self) -> list[str]:
    """Known names; β, k3 clamp >= 0; reset period and EMA rate valid for the reference."""
    out = _name_error("kl", "kl", self.name) + _need(
      self.beta >= 0, f"kl.beta={self.beta} must be >= 0"
    )
    out += _need(self.k3_clamp >= 0, f"kl.k3_clamp={self.k3_clamp} must be >= 0 (0 = off)")
    out += _allowed("kl.placement", self.placement, ("loss", "reward"))
    out += _allowed("kl.reference", self.reference, REFERENCES)
    if self.name == "k3_is" and self.placement == "reward":
      out.append(
        "kl.name='k3_is' is a loss estimator (its gradient is the point); use kl.placement='loss'"
      )
    if self.beta > 0 and self.reference == "reset_every":
      out += _need(
        self.reset_every >= 1,
        f"kl.reset_every={self.reset_every} must be >= 1 with kl.reference='reset_every'",
      )
    if self.beta > 0 and self.reference == "ema":
      out += _need(
        0 < self.ema <= 1, f"kl.ema={self.ema} must be in (0, 1] with kl.reference='ema'"
      )
    return out


@dataclasses.dataclass(frozen=True)
class ShapingSettings(Section):
  """`shaping`: the §6 soft overlong punishment and overlong filtering."""

  SECTION: ClassVar[str] = "shaping"
  name: str
  cache_len: int
  weight: float
  overlong_filter: bool
  overlong_in_group_stats: bool

  def errors(self) -> list[str]:
    """A known shaping name (the cache length is checked against T by config_lib)."""
    return _allowed("shaping.name", self.name, ("none", "soft_overlong"))


@dataclasses.dataclass(frozen=True)
class ReplaySettings(Section):
  """`replay`: §9 routing replay of a mixture-of-experts policy."""

  SECTION: ClassVar[str] = "replay"
  name: str

  def errors(self) -> list[str]:
    """A known replay mode."""
    return _allowed("replay.name", self.name, ("none", "r2", "r3"))


@dataclasses.dataclass(frozen=True)
class FilteringSettings(Section):
  """`filtering`: §7 group filtering and dynamic sampling's oversampling factor."""

  SECTION: ClassVar[str] = "filtering"
  name: str
  oversample: float

  def errors(self) -> list[str]:
    """A known filter; oversampling factor >= 1 for dynamic sampling."""
    out = _allowed("filtering.name", self.name, ("none", "dynamic_sampling", "reinforce_rej"))
    if self.name == "dynamic_sampling":
      out += _need(self.oversample >= 1, f"filtering.oversample={self.oversample} must be >= 1")
    return out


@dataclasses.dataclass(frozen=True)
class Settings:
  """Every learner setting: one frozen dataclass per config section, plus the reward weights."""

  rl: RLSettings
  advantage: AdvantageSettings
  objective: ObjectiveSettings
  aggregation: AggregationSettings
  correction: CorrectionSettings
  kl: KLSettings
  shaping: ShapingSettings
  replay: ReplaySettings
  filtering: FilteringSettings
  reward_weights: tuple[tuple[str, float], ...]  # §6 weights of the task's reward terms

  @classmethod
  def from_config(cls, config) -> Settings:
    """The settings of an experiment config (sections by their own names)."""
    hints = typing.get_type_hints(cls)
    sections = {
      f.name: hints[f.name].from_section(config[f.name])
      for f in dataclasses.fields(cls)
      if f.name != "reward_weights"
    }
    weights = tuple(sorted((k, float(v)) for k, v in config.task.reward_weights.items()))
    return cls(**sections, reward_weights=weights)

  def skips_old_pass(self, is_moe: bool) -> bool:
    """Whether ℓ^old = sg[ℓ] can replace the old-policy forward (§0): one optimiser update per
    rollout (`rl.old_pass=auto`), and nothing needs ℓ^old before the learner's own forward:
    no critic (GAE needs V first), no KL in the reward, a correction that never rejects
    (none, tis_token, tis_seq: its weight is computed in the loss from sg[ℓ]), a dense model
    (routing replay and RSPO need the old pass's routing)."""
    base, geo = objectives.parse_correction(self.correction.name)
    return (
      self.rl.old_pass == "auto"
      and self.rl.num_epochs * self.rl.num_minibatches == 1
      and self.advantage.name != "gae"
      and not (self.kl.beta > 0 and self.kl.placement == "reward")
      and base in ("none", "tis_token", "tis_seq")
      and not geo
      and not is_moe
    )

  def errors(self) -> list[str]:
    """Every section's own range-check messages."""
    return [
      e
      for f in dataclasses.fields(self)
      if f.name != "reward_weights"
      for e in getattr(self, f.name).errors()
    ]
