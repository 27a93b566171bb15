"""Every name the spec (docs/objectives.md) gives an advantage (§1), objective (§2), correction
(§3), KL estimator (§4) and aggregation (§5) is one the registry takes, and the registry takes
no other name than the few extras declared here."""

from __future__ import annotations

import re

import pytest
from conftest import spec_section

from jaxrl_llm.objectives import aggregation, corrections, kl, registry

# Names the registry holds beyond the spec's tables, each with where it comes from.
EXTRAS = {
  "advantage": {"reinforce_pp_baseline"},  # verl's REINFORCE++ baseline (docs/conventions.md)
  "aggregation": {"seq_mean"},  # §2.3 / §2.5 / §2.8's "mean over sequences"
}


def _table_names(number: int) -> set[str]:
  """The backquoted names that open the rows of §`number`'s table."""
  return set(re.findall(r"^\| `(\w+)`", spec_section(number), re.MULTILINE))


@pytest.mark.parametrize(
  "kind, number, held",
  [
    ("advantage", 1, set(registry.ADVANTAGES)),
    ("objective", 2, set(registry.OBJECTIVES)),
    ("correction", 3, set(corrections.CORRECTION_BASES) | {corrections.GEO_MASK}),
    ("kl", 4, set(kl.KL_ESTIMATORS)),
    ("aggregation", 5, set(aggregation.AGGREGATION_MODES)),
  ],
)
def test_the_registry_holds_every_name_of_the_spec_and_only_the_declared_extras(kind, number, held):
  if kind == "objective":  # §2 names each objective in a bold heading: **§2.N `name`**
    spec = set(re.findall(r"^\*\*§2\.\d+ `(\w+)`", spec_section(2), re.MULTILINE))
  else:
    spec = _table_names(number)
  assert len(spec) >= 4, spec  # the section was found and read
  assert spec - held == set(), f"§{number} names {sorted(spec - held)}, which the registry lacks"
  assert held - spec == EXTRAS.get(kind, set()), sorted(held - spec)
  for name in held:
    registry.validate(kind, name)  # the config's check takes each
  with pytest.raises(ValueError):
    registry.validate(kind, "not_in_the_spec")
