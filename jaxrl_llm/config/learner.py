"""The learner's sections (§1-§9): batch and epochs, advantage, objective, aggregation,
correction, KL, shaping, routing replay and filtering, and `Settings`, the subset of the tree
the fused step is built from. The objective's own hyperparameters (clip widths, temperatures)
are not declared here: they are the registered objectives' keyword parameters
(`objectives.registry`), so an objective with a hyperparameter of a new name is one file."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

from jaxrl_llm import objectives
from jaxrl_llm.config.fields import (
  PER_RUN,
  TRACED,
  LearnedSection,
  allowed,
  at_least,
  coerce,
  is_on,
  need,
  setting,
)
from jaxrl_llm.models.transformer import REMAT_POLICIES

REMATS = ("auto", *REMAT_POLICIES)  # rl.remat values
AUTO_REMAT_PARAMS = 100_000_000  # remat="auto" rematerialises blocks from this many parameters
REFERENCES = ("frozen", "reset_every", "ema")


def _name_error(section: str, kind: str, name: str) -> list[str]:
  try:
    objectives.validate(kind, name)
  except ValueError as e:
    return [f"{section}.name: {e}"]
  return []


@dataclasses.dataclass(frozen=True)
class RLSettings(LearnedSection):
  """`rl`: batch, epochs, minibatches, microbatches and the entropy bonus (§5, §8)."""

  SECTION: ClassVar[str] = "rl"
  num_prompts: int = setting(32, hparam=True)  # P prompts per RL update (B = P * G sequences)
  num_epochs: int = 1  # passes over each rollout batch
  num_minibatches: int = 2  # optimiser steps per epoch (B must divide evenly)
  num_microbatches: int = setting(
    0, resume=False
  )  # gradient-accumulation slices per minibatch (§5); 0 = auto
  microbatch_tokens: int | str = setting(
    4096, resume=False
  )  # auto microbatching: max tokens per device per slice, or auto (sized by the device's plan)
  remat: str = setting(
    "auto", resume=False
  )  # block remat: auto | none | attention | full | dots_saveable | dots_with_no_batch_dims_saveable
  old_pass: str = "auto"  # auto: ℓ^old = sg[ℓ] when the rollout gets one update | always
  share_prompt: str = setting(
    "auto", resume=False
  )  # prompt once per group in learner passes: auto | always | never
  entropy_coef: float = setting(0.0, per_run=TRACED)  # c_e of the entropy bonus (§8)

  def errors(self) -> list[str]:
    """Counts >= 1 (microbatches >= 0, 0 = auto), a known remat policy, c_e >= 0."""
    out = at_least("rl", self, 1, "num_prompts", "num_epochs", "num_minibatches")
    if isinstance(self.microbatch_tokens, str):
      out += need(
        self.microbatch_tokens == "auto",
        f"rl.microbatch_tokens={self.microbatch_tokens!r}; allowed: a number >= 1, or auto",
      )
    else:
      out += at_least("rl", self, 1, "microbatch_tokens")
    out += at_least("rl", self, 0, "num_microbatches", note=" (0 = auto)")
    out += allowed("rl.remat", self.remat, REMATS)
    out += allowed("rl.old_pass", self.old_pass, ("auto", "always"))
    out += allowed("rl.share_prompt", self.share_prompt, ("auto", "always", "never"))
    return out + at_least("rl", self, 0, "entropy_coef")

  def resolved(self, *, rows_per_device: int, seq_len: int, num_params: int) -> RLSettings:
    """`auto` choices made concrete for one run (derived values; the config is unchanged).

    num_microbatches=0: the fewest microbatches k dividing a device's minibatch rows with
    (rows / k)·seq_len <= microbatch_tokens. remat="auto": "full" from 1e8 parameters up
    (activations dominate there), else "none". microbatch_tokens="auto" is resolved from the
    device's compile-only plans (`plan.auto_learner`), not here.
    """
    k = self.num_microbatches
    if k == 0 and self.microbatch_tokens == "auto":
      raise ValueError("rl.microbatch_tokens=auto is resolved by plan.auto_learner")
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
class AdvantageSettings(LearnedSection):
  """`advantage`: the §1 estimator, whitening and GAE's γ, λ."""

  SECTION: ClassVar[str] = "advantage"
  name: str = setting(
    "grpo", hparam=True
  )  # §1: grpo | mean_only | rloo | batch_std | reinforce_baseline | reinforce_pp_baseline | gae
  whiten: bool = False  # whiten advantages over the batch
  whiten_variance: str = "population"  # population: /(σ + 1e-6) | unbiased (verl)
  gamma: float = 1.0  # GAE discount γ (gae only)
  lam: float = 0.95  # GAE λ (gae only)
  gae_carry_masked: bool = False  # gae: carry V, A across masked tokens (needed with a tool)

  def errors(self) -> list[str]:
    """A known estimator and whitening variance; γ, λ in [0, 1]."""
    return (
      _name_error("advantage", "advantage", self.name)
      + allowed("advantage.whiten_variance", self.whiten_variance, ("population", "unbiased"))
      + need(0 <= self.gamma <= 1, f"advantage.gamma={self.gamma} must be in [0, 1]")
      + need(0 <= self.lam <= 1, f"advantage.lam={self.lam} must be in [0, 1]")
    )


@dataclasses.dataclass(frozen=True)
class ObjectiveSettings(LearnedSection):
  """`objective`: the §2 surrogate by name, the critic's value-loss coefficient and clip (§2.9),
  and the values set for the registered objectives' hyperparameters (`values`; a field left
  unset keeps the selected objective's signature default, fields of other objectives are
  ignored, so --config.objective.name=gspo trains GSPO with GSPO's widths)."""

  SECTION: ClassVar[str] = "objective"
  name: str = setting(
    "ppo_clip", hparam=True
  )  # §2: ppo_clip | pg | gspo | gspo_token | gmpo | cispo | sapo | ...
  value_coef: float = 0.5  # c_v of the clipped value loss (ppo_critic, §2.9)
  value_clip: float = 0.2  # ε_v of the clipped value loss (ppo_critic, §2.9)
  values: tuple[tuple[str, Any], ...] = ()  # hyperparameters set in the config, by name

  @classmethod
  def from_section(cls, section: Mapping[str, Any]) -> ObjectiveSettings:
    """The section's own fields plus every registered hyperparameter the config sets."""
    given = dict(section.items())
    hyper = objectives.hyperparameter_kinds()
    own = {f.name: f.type for f in dataclasses.fields(cls) if f.name != "values"}
    unknown = sorted(set(given) - set(own) - set(hyper))
    if unknown:
      raise ValueError(
        f"config section 'objective': unknown fields {unknown}; allowed: "
        f"{sorted([*own, *hyper])} (hyperparameters come from the registered objectives)"
      )
    kw = {k: coerce(t, given.get(k, cls.defaults()[k]), f"objective.{k}") for k, t in own.items()}
    values = []
    for k, kind in hyper.items():
      v = given.get(k)
      if v is not None:
        values.append((k, coerce(f"{kind.__name__} | None", v, f"objective.{k}")))
    return cls(**kw, values=tuple(values))

  @classmethod
  def config_fields(cls) -> dict[str, Any]:
    """The section as the default config writes it: name, every registered hyperparameter
    (unset), then the critic's fields."""
    hyper = dict.fromkeys(objectives.hyperparameter_kinds())
    return {"name": cls.name, **hyper, "value_coef": cls.value_coef, "value_clip": cls.value_clip}

  def to_dict(self) -> dict[str, Any]:
    """The section as the config's JSON holds it (unset hyperparameters are null)."""
    out = self.config_fields() | {"name": self.name}
    out |= dict(self.values) | {"value_coef": self.value_coef, "value_clip": self.value_clip}
    return out

  @classmethod
  def tagged(cls, key: str, value: Any = None) -> tuple[str, ...]:
    """The section's own fields tagged `key`; under PER_RUN (TRACED) also every hyperparameter
    the registered objectives declare a plain float (`objectives.traced_hyperparameters`)."""
    own = super().tagged(key, value)
    if key == PER_RUN and value in (None, TRACED):
      return (*own, *objectives.traced_hyperparameters())
    return own

  def get(self, name: str, default: Any = None) -> Any:
    """The value the config set for hyperparameter `name` (`default` when unset)."""
    return dict(self.values).get(name, default)

  @property
  def spec(self) -> objectives.ObjectiveSpec:
    """The registry row of the selected objective."""
    return objectives.get_objective(self.name)

  @property
  def hyperparameters(self) -> dict[str, Any]:
    """The selected objective's hyperparameters: set fields over its signature defaults."""
    return self.spec.resolve(dict(self.values))

  def errors(self) -> list[str]:
    """A registered objective whose own range checks pass; a positive value clip."""
    out = _name_error("objective", "objective", self.name)
    if not out:
      out += self.spec.errors(self.hyperparameters)
    out += need(
      self.value_coef > 0,
      f"objective.value_coef={self.value_coef} must be > 0 (the value loss's weight: at 0 the "
      "critic never trains, below it unlearns)",
    )
    return out + need(self.value_clip > 0, f"objective.value_clip={self.value_clip} must be > 0")


@dataclasses.dataclass(frozen=True)
class AggregationSettings(LearnedSection):
  """`aggregation`: the §5 loss aggregation mode."""

  SECTION: ClassVar[str] = "aggregation"
  name: str = setting(
    "seq_mean_token_mean", hparam=True
  )  # §5: token_mean | seq_mean_token_mean | seq_mean_token_sum | seq_mean_token_sum_norm | seq_mean
  sum_norm_sequences: bool = True  # seq_mean_token_sum_norm: ÷ B'·L_max; False: ÷ L_max

  def errors(self) -> list[str]:
    """A known mode."""
    return _name_error("aggregation", "aggregation", self.name)


@dataclasses.dataclass(frozen=True)
class CorrectionSettings(LearnedSection):
  """`correction`: the §3 behaviour correction, its cap C and geometric-mask bounds."""

  SECTION: ClassVar[str] = "correction"
  name: str = setting(
    "none", hparam=True
  )  # §3: none | tis_token | tis_seq | mis_token | mis_seq, optional "+geo_mask"
  cap: float = 2.0  # C: truncation / rejection threshold of ρ (>= 1 with a correction)
  geo_low: float = 0.0  # C_low of geo_mask, <= 1 (0 = upper bound only)
  geo_high: float = 0.0  # C_high of geo_mask (0 = use `cap`)

  def errors(self) -> list[str]:
    """A known correction; C > 0, and >= 1 where a base correction uses it (below 1 it truncates
    or rejects every on-policy token, ρ = 1); geo_mask's 0 <= C_low <= 1 <= C_high (geo_high, or
    C when 0), C_low < C_high."""
    out = _name_error("correction", "correction", self.name)
    out += need(self.cap > 0, f"correction.cap={self.cap} must be > 0")
    out += at_least("correction", self, 0, "geo_low")
    parts = self.name.split("+")
    out += need(
      all(p in ("none", "geo_mask") for p in parts) or self.cap >= 1,
      f"correction.cap={self.cap} with correction.name={self.name!r} truncates or rejects every "
      "on-policy token (ρ = 1 > C); allowed: a cap >= 1",
    )
    if "geo_mask" in parts:  # 1[C_low <= ρ_geo <= C_high] must keep an on-policy sequence
      high, which = (self.geo_high, "geo_high") if self.geo_high else (self.cap, "cap")
      out += need(
        self.geo_low <= 1 <= high and self.geo_low < high,
        f"correction.geo_low={self.geo_low} and correction.{which}={high} (C_high) leave "
        "geo_mask no interval around an on-policy sequence's ρ = 1, so it masks every "
        "sequence; allowed: geo_low <= 1 <= C_high (geo_low 0 = upper bound only)",
      )
    return out


@dataclasses.dataclass(frozen=True)
class KLSettings(LearnedSection):
  """`kl`: the §4 estimator, β, where the penalty goes and how the reference moves."""

  SECTION: ClassVar[str] = "kl"
  name: str = setting("k3", hparam=True)  # §4 estimator: k1 | k2 | k3 | k3_is
  beta: float = setting(
    0.0, per_run=TRACED, switch=True, hparam=True
  )  # β; 0 removes the reference model (no reference forward pass)
  placement: str = "loss"  # loss: β·aggregate(k) in the loss | reward: k1 subtracted from rewards
  reference: str = "frozen"  # frozen | reset_every | ema
  reset_every: int = 0  # N: copy the policy into the reference every N steps (reset_every)
  ema: float = 0.0  # α: π_ref ← α π_θ + (1 − α) π_ref after every step (ema)
  reset_optimizer: bool = False  # also zero Adam's moments at each reset (the LR schedule goes on)
  k3_clamp: float = 0.0  # clip k3 to [-c, c] (0 = off, the spec; verl's low_var_kl: 10)

  def errors(self) -> list[str]:
    """Known names; β, k3 clamp >= 0; reset period and EMA rate valid for the reference."""
    out = _name_error("kl", "kl", self.name) + at_least("kl", self, 0, "beta")
    out += at_least("kl", self, 0, "k3_clamp", note=" (0 = off)")
    out += need(0 <= self.ema <= 1, f"kl.ema={self.ema} must be in [0, 1]")
    out += allowed("kl.placement", self.placement, ("loss", "reward"))
    out += allowed("kl.reference", self.reference, REFERENCES)
    if self.name == "k3_is" and self.placement == "reward":
      out.append(
        "kl.name='k3_is' is a loss estimator (its gradient is the point); use kl.placement='loss'"
      )
    if self.beta > 0 and self.reference == "reset_every":
      out += need(
        self.reset_every >= 1,
        f"kl.reset_every={self.reset_every} must be >= 1 with kl.reference='reset_every'",
      )
    if self.beta > 0 and self.reference == "ema":
      out += need(0 < self.ema <= 1, f"kl.ema={self.ema} must be in (0, 1] with kl.reference='ema'")
    return out


@dataclasses.dataclass(frozen=True)
class ShapingSettings(LearnedSection):
  """`shaping`: the §6 soft overlong punishment and overlong filtering."""

  SECTION: ClassVar[str] = "shaping"
  name: str = "none"  # §6: none | soft_overlong (DAPO length penalty as a reward term)
  cache_len: int = setting(2, per_run=TRACED)  # L_cache of the soft overlong punishment (tokens)
  weight: float = setting(1.0, per_run=TRACED)  # weight of the overlong reward term
  overlong_filter: bool = False  # truncated completions get no gradient (§6)
  overlong_in_group_stats: bool = True  # filtered truncated ones stay in group stats

  def errors(self) -> list[str]:
    """A known shaping name, L_cache >= 0 (checked against T with the task), a weight >= 0."""
    out = allowed("shaping.name", self.name, ("none", "soft_overlong"))
    out += need(
      self.weight >= 0,
      f"shaping.weight={self.weight} must be >= 0 (it scales a penalty: below 0 it would pay "
      "for overlong answers)",
    )
    return out + at_least("shaping", self, 0, "cache_len")


@dataclasses.dataclass(frozen=True)
class ReplaySettings(LearnedSection):
  """`replay`: §9 routing replay of a mixture-of-experts policy."""

  SECTION: ClassVar[str] = "replay"
  name: str = "none"  # §9 routing replay (MoE): none | r2 (old-policy mask) | r3 (sampler mask)

  def errors(self) -> list[str]:
    """A known replay mode."""
    return allowed("replay.name", self.name, ("none", "r2", "r3"))


MAX_OVERSAMPLE = 64  # dynamic sampling's largest oversampling factor k


@dataclasses.dataclass(frozen=True)
class FilteringSettings(LearnedSection):
  """`filtering`: §7 group filtering and dynamic sampling's oversampling factor."""

  SECTION: ClassVar[str] = "filtering"
  name: str = "none"  # §7: none | dynamic_sampling | reinforce_rej
  oversample: float = 2.0  # k in [1, 64]: dynamic sampling draws ceil(k * P) prompt groups, keeps P

  def errors(self) -> list[str]:
    """A known filter; oversampling factor in [1, MAX_OVERSAMPLE]."""
    out = allowed("filtering.name", self.name, ("none", "dynamic_sampling", "reinforce_rej"))
    return out + need(
      1 <= self.oversample <= MAX_OVERSAMPLE,
      f"filtering.oversample={self.oversample:g} must be in [1, {MAX_OVERSAMPLE}] (it samples "
      "ceil(k * P) prompt groups in every update to keep P)",
    )


@dataclasses.dataclass(frozen=True)
class Settings:
  """Every learner setting: the learner's sections of the tree, plus the reward weights."""

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
  def sections(cls) -> tuple[str, ...]:
    """The names of the tree's sections the learner is built from (its fields but the
    reward weights)."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.name != "reward_weights")

  @property
  def sampled_prompts(self) -> int:
    """Prompts drawn per RL update: P, or ceil(k·P) under dynamic sampling (§7)."""
    p = self.rl.num_prompts
    if self.filtering.name == "dynamic_sampling":
      return math.ceil(self.filtering.oversample * p)
    return p

  def with_values(self, values: Mapping[str, Any]) -> Settings:
    """These settings with traced values (dotted field -> traced scalar) in place of
    the fields they name; fields of other sections are left to their owners."""
    out = self
    for field, value in values.items():
      section, name = field.split(".", 1)
      if section not in self.sections():
        continue
      sec = getattr(out, section)
      if section == "objective" and name in objectives.hyperparameter_kinds():
        kept = tuple((k, v) for k, v in sec.values if k != name)
        sec = dataclasses.replace(sec, values=(*kept, (name, value)))
      else:
        sec = dataclasses.replace(sec, **{name: value})
      out = dataclasses.replace(out, **{section: sec})
    return out

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
      and not (is_on(self.kl.beta) and self.kl.placement == "reward")
      and base in ("none", "tis_token", "tis_seq")
      and not geo
      and not is_moe
    )

  def errors(self) -> list[str]:
    """Every section's own range-check messages."""
    return [e for name in self.sections() for e in getattr(self, name).errors()]
