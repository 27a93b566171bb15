"""Names → functions for every configurable piece of the objective (objectives.md §1-§5, §10).

Config fields hold these names; `lookup` turns one into its function and rejects an unknown
name with a ValueError that lists the valid ones, so a config can be validated at start-up.

A §2 objective is registered beside its definition with `@register_objective(name, ...)`: the
decorated function is the whole plug-in. Its keyword-only parameters with defaults are its
hyperparameters (the numbers the docs cite); the config section `objective` fills them by name,
and a field left unset (None) keeps the signature default. Keyword-only parameters without a
default are extra array inputs that the learner provides by name (declared in `inputs`).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from jaxrl_llm.objectives import advantages
from jaxrl_llm.objectives.aggregation import AGGREGATION_MODES
from jaxrl_llm.objectives.corrections import CORRECTION_BASES, GEO_MASK, parse_correction
from jaxrl_llm.objectives.kl import KL_ESTIMATORS

# §1. Sequence estimators share the signature (rewards [B], group_size, *, eps, valid) -> [B];
# `reinforce_pp_baseline` also takes the token mask (`mask=`) and returns [B, T]; `gae` is
# token-level: (rewards_tok, values, mask, gamma, lam) -> (advantages, returns).
ADVANTAGES: Mapping[str, Callable[..., Any]] = {
  "grpo": advantages.grpo,
  "mean_only": advantages.mean_only,
  "rloo": advantages.rloo,
  "batch_std": advantages.batch_std,
  "reinforce_baseline": advantages.reinforce_baseline,
  "reinforce_pp_baseline": advantages.reinforce_pp_baseline,
  "gae": advantages.gae,
}

# Extra inputs an objective may declare; the learner knows how to compute each of them.
#   router_logp      [B, T, Lm, K] current router log-probs of the old policy's experts (MoE)
#   old_router_logp  [B, T, Lm, K] the same under the old policy's router
OBJECTIVE_INPUTS = ("router_logp", "old_router_logp")

Check = Callable[[Mapping[str, Any]], list[str]]


@dataclasses.dataclass(frozen=True)
class ObjectiveSpec:
  """One row of the §2 registry: the surrogate, its extra inputs and its range checks."""

  name: str
  fn: Callable[..., Any]  # (logp, old_logp, adv, mask, *, **inputs, **hyperparameters)
  inputs: tuple[str, ...] = ()  # names from OBJECTIVE_INPUTS the learner passes by keyword
  check: Check | None = None  # resolved hyperparameters -> list of error messages
  docs: tuple[tuple[str, str], ...] = ()  # (hyperparameter, its one-line meaning)

  @property
  def hyperparameters(self) -> dict[str, Any]:
    """The objective's own hyperparameters and their defaults, from its signature."""
    return {p.name: p.default for p in self._hyper_params()}

  def kinds(self) -> dict[str, type]:
    """{hyperparameter: the Python type its annotation names} (float | None -> float)."""
    out = {}
    for p in self._hyper_params():
      base = next(k.strip() for k in str(p.annotation).split("|") if k.strip() != "None")
      out[p.name] = {"float": float, "int": int, "bool": bool, "str": str}.get(base, float)
    return out

  def _hyper_params(self) -> list[inspect.Parameter]:
    params = inspect.signature(self.fn).parameters.values()
    return [
      p
      for p in params
      if p.kind is p.KEYWORD_ONLY and p.default is not p.empty and p.name not in self.inputs
    ]

  def resolve(self, values: Mapping[str, Any]) -> dict[str, Any]:
    """Hyperparameters with `values` (a config section) over the signature defaults.

    A value that is None (an unset config field) keeps the default; fields of other objectives
    are ignored, so one config section serves every objective.
    """
    out = self.hyperparameters
    for name in out:
      if values.get(name) is not None:
        out[name] = values[name]
    return out

  def errors(self, hyperparameters: Mapping[str, Any]) -> list[str]:
    """Range-check messages for resolved hyperparameters (empty when all are valid)."""
    return self.check(hyperparameters) if self.check else []


OBJECTIVES: dict[str, ObjectiveSpec] = {}


def register_objective(
  name: str,
  *,
  inputs: tuple[str, ...] = (),
  check: Check | None = None,
  docs: Mapping[str, str] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
  """Decorator adding a §2 objective to `OBJECTIVES` under `name` (returns the function).

  `inputs` names the extra array inputs the function takes as keyword-only parameters without
  defaults; each must be one of OBJECTIVE_INPUTS. `check` validates resolved hyperparameters
  once at start-up, before anything compiles. `docs` gives a hyperparameter of a new name its
  one-line meaning (the config reference shows it, with each objective's default).
  """
  unknown = sorted(set(inputs) - set(OBJECTIVE_INPUTS))
  if unknown:
    raise ValueError(
      f"objective {name!r} declares unknown inputs {unknown}; known: {OBJECTIVE_INPUTS}"
    )

  def add(fn: Callable[..., Any]) -> Callable[..., Any]:
    OBJECTIVES[name] = ObjectiveSpec(
      name=name, fn=fn, inputs=tuple(inputs), check=check, docs=tuple((docs or {}).items())
    )
    return fn

  return add


def hyperparameter_kinds() -> dict[str, type]:
  """{name: type} of every registered objective's hyperparameters (the `objective` config
  section's fields besides its name and the critic's)."""
  out: dict[str, type] = {}
  for spec in OBJECTIVES.values():
    out.update({k: v for k, v in spec.kinds().items() if k not in out})
  return out


def traced_hyperparameters() -> tuple[str, ...]:
  """The hyperparameters every registered objective that takes them annotates as a plain
  `float`: a pack may vary them (a traced per-run value). `float | None` (None or 0 = off,
  e.g. `dual_clip`) switches a term and `bool` a branch: both change the program."""
  plain: dict[str, bool] = {}
  for spec in OBJECTIVES.values():
    for p in spec._hyper_params():
      plain[p.name] = plain.get(p.name, True) and str(p.annotation).strip() == "float"
  return tuple(k for k, ok in plain.items() if ok)


def hyperparameter_doc(name: str) -> str:
  """A hyperparameter's meaning (from the objectives that document it) and its default in
  each registered objective that takes it, e.g. 'ε_high (ppo_clip 0.2, gspo 0.0004)'."""
  meaning = next((d for s in OBJECTIVES.values() for k, d in s.docs if k == name), "")
  takes = [s for s in OBJECTIVES.values() if name in s.hyperparameters]
  defaults = [f"{s.name} {s.hyperparameters[name]}" for s in takes]
  return f"{meaning} ({', '.join(defaults)})".strip()


def in_range(name: str, value: Any, low: float, high: float, *, low_open=True, high_open=True):
  """An error message if `value` is outside the interval, else None (for objective checks)."""
  ok = (value > low if low_open else value >= low) and (
    value < high if high_open else value <= high
  )
  if ok:
    return None
  lo, hi = "(" if low_open else "[", ")" if high_open else "]"
  return f"objective.{name}={value} must be in {lo}{low:g}, {high:g}{hi}"


CORRECTIONS = (*CORRECTION_BASES, GEO_MASK)  # §3, bases compose with "+geo_mask"
AGGREGATIONS = AGGREGATION_MODES  # §5
KL = KL_ESTIMATORS  # §4


def lookup(table: Mapping[str, Any], name: str, kind: str) -> Any:
  """table[name], or a ValueError naming the kind and listing the valid names (§10 configs)."""
  if name not in table:
    raise ValueError(f"unknown {kind} {name!r}; valid names: {', '.join(sorted(table))}")
  return table[name]


def get_advantage(name: str) -> Callable[..., Any]:
  """The §1 advantage estimator called `name`."""
  return lookup(ADVANTAGES, name, "advantage")


def get_objective(name: str) -> ObjectiveSpec:
  """The registry row of the §2 objective called `name`."""
  return lookup(OBJECTIVES, name, "objective")


def validate(kind: str, name: str) -> None:
  """Raises ValueError if `name` is not a valid name of `kind` (config check, §10).

  kind ∈ {"advantage", "objective", "aggregation", "kl", "correction"}.
  """
  tables = {
    "advantage": ADVANTAGES,
    "objective": OBJECTIVES,
    "aggregation": dict.fromkeys(AGGREGATIONS),
    "kl": dict.fromkeys(KL),
  }
  if kind == "correction":
    parse_correction(name)
  elif kind in tables:
    lookup(tables[kind], name, kind)
  else:
    raise ValueError(f"unknown kind {kind!r}; valid kinds: {', '.join([*tables, 'correction'])}")
