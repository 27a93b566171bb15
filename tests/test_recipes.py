"""Every §10 recipe config sets what its row of the spec's §10 table says and traces its fused RL
step with its objective-specific metrics; two run 3 steps and log them (three more, extended)."""

import math
import re

import numpy as np
import pytest
from conftest import REPO, run_steps, spec_section, tiny_config, traced_step_metrics
from parsed import build, train_and_evaluate

from jaxrl_llm import metrics
from jaxrl_llm.config import parse, recipes
from jaxrl_llm.rl import metrics as rl_metrics

# Tags that only a recipe's own objective / correction / filter / KL produces.
SPECIFIC_TAGS = {
  "grpo": ["kl/loss", "kl/ref_kl", "policy/clip_frac_high"],
  "dr_grpo": ["policy/clip_frac_low", "policy/ratio_max"],
  "dapo": ["filter/fill_frac", "filter/zero_std_frac", "reward/overlong"],
  "gspo": ["policy/seq_ratio_mean"],
  "gmpo": ["policy/seq_ratio_mean"],
  "cispo": ["policy/is_weight_mean"],
  "sapo": ["policy/gate_weight_mean"],
  "olmo3": ["filter/fill_frac", "behaviour/frac_truncated", "behaviour/ess"],
  "deepseek_v32": ["kl/loss", "behaviour/frac_masked_seqs"],
  "rloo": ["policy/ratio_mean"],
  "lite_ppo": ["adv/std"],
  "ppo": ["value/loss", "value/mean", "kl/ref_kl"],
  "rspo": ["policy/router_gamma_mean", "moe/route_disagree_old", "moe/aux_loss"],
  "moe_default": ["moe/route_disagree_sampler", "moe/router_prefers_other", "moe/z_loss"],
  "moe_grpo": ["moe/load_max_over_mean", "kl/loss", "policy/ratio_var"],
  "moe_gspo": ["policy/seq_ratio_mean", "moe/route_disagree_sampler"],
  "moe_rspo": ["policy/router_gamma_mean", "moe/route_disagree_old"],
}


def test_every_recipe_has_a_config_file():
  files = {p.stem for p in (REPO / "configs").glob("*.py")}
  names = set(recipes.RECIPES) | set(recipes.MOE_CONFIGS)
  assert names <= files
  assert set(SPECIFIC_TAGS) == names


def _spec_recipes() -> dict[str, list[str]]:
  """preset -> its row's cells (advantage, objective, aggregation, KL, extras), read from the
  spec's §10 table (docs/objectives.md)."""
  rows = {}
  for line in spec_section(10).splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) == 6 and cells[0].startswith("`"):
      rows[cells[0].strip("`")] = cells[1:]
  return rows


# Each "extras" phrase of §10: (the setting that carries it, the check); a setting no phrase of
# a row names stays at its default (no filter, shaping or correction; a dense policy without a
# value head).
_EXTRAS = {
  "dynamic sampling": ("filtering", lambda s, c: s.filtering.name == "dynamic_sampling"),
  "dynamic sampling (refill)": ("filtering", lambda s, c: s.filtering.name == "dynamic_sampling"),
  "soft overlong": ("shaping", lambda s, c: s.shaping.name == "soft_overlong"),
  "tis_token": ("correction", lambda s, c: s.correction.name == "tis_token"),
  "geo_mask upper-only": (
    "correction",
    lambda s, c: (s.correction.name, s.correction.geo_low) == ("geo_mask", 0),
  ),
  "MoE": ("moe", lambda s, c: c.model.moe_num_experts > 0),
  "value head": ("value_head", lambda s, c: c.model.value_head),
}
_DEFAULTS = {
  "filtering": lambda s, c: s.filtering.name == "none",
  "shaping": lambda s, c: s.shaping.name == "none",
  "correction": lambda s, c: s.correction.name == "none",
  "moe": lambda s, c: c.model.moe_num_experts == 0,
  "value_head": lambda s, c: not c.model.value_head,
}
# Objective cells' numbers: "a/b" or one number for both, in these hyperparameters.
_PAIRS = {"ppo_clip": ("clip_low", "clip_high"), "gspo": ("clip_low", "clip_high"),
          "sapo": ("tau_pos", "tau_neg")}  # fmt: skip


@pytest.mark.parametrize("name", sorted(recipes.RECIPES))
def test_every_recipe_sets_what_its_row_of_spec_section_10_says(name):
  """The recipe's parsed settings against its row of the spec's §10 table: advantage, objective
  and the numbers the row gives, aggregation, KL (name, placement, β; `none` is β = 0) and the
  extras, each extra the row does not name left at its default."""
  rows = _spec_recipes()
  assert set(rows) == set(recipes.RECIPES), sorted(set(rows) ^ set(recipes.RECIPES))
  advantage, objective, aggregation, kl, extras = rows[name]
  config = recipes.get_config(name)
  s = parse(config).learner
  assert s.advantage.name == advantage
  obj_name, *numbers = objective.replace("τ", "").split()
  assert s.objective.name == obj_name
  hyper = s.objective.hyperparameters
  for number in numbers:
    if number.startswith("δ_c="):
      assert hyper["clip_log"] == float(number.split("=")[1])
    else:
      low, _, high = number.partition("/")
      fields = _PAIRS[obj_name]
      assert (hyper[fields[0]], hyper[fields[1]]) == (float(low), float(high or low))
  assert s.aggregation.name == {"sequence mean": "seq_mean"}.get(aggregation, aggregation)
  if kl == "none":
    assert s.kl.beta == 0
  else:
    kl_name, *rest = re.split(r",\s*|\s+in\s+", kl)
    assert s.kl.name == kl_name and s.kl.beta > 0
    for item in rest:
      if item.startswith("β="):
        assert s.kl.beta == float(item[2:])
      else:
        assert s.kl.placement == item
  named = [] if extras == "–" else [e.strip() for e in extras.split(",")]
  for extra in named:
    assert _EXTRAS[extra][1](s, config), extra
  for setting, default in _DEFAULTS.items():
    if setting not in {_EXTRAS[e][0] for e in named}:
      assert default(s, config), f"{name} sets {setting}, which its row of §10 does not name"


def test_rspo_needs_a_moe_model():
  with pytest.raises(ValueError, match="needs a mixture-of-experts policy"):
    build(tiny_config("rspo", **{"model.moe_num_experts": 0}))


# Recipes that run 3 fused steps end to end: two in the default tier, three in the extended tier
# (the critic, the behaviour-truncation path, the MoE router shift). Every recipe's step is also
# traced (below): its objective, correction, filter and KL wire up and name their metrics; the
# unit tests (tests/objectives, test_rl_loss) check their numbers.
RUN_RECIPES = {
  "dapo": (),
  "moe_default": (),
  "ppo": pytest.mark.extended,
  "olmo3": pytest.mark.extended,
  "moe_rspo": pytest.mark.extended,
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=m) for n, m in RUN_RECIPES.items()])
def test_recipe_runs_three_steps(name, tmp_path):
  config = tiny_config(
    name,
    **{"train.num_steps": 3, "train.eval_every": 3, "train.checkpoint_every": 3},
  )
  result = train_and_evaluate(config, str(tmp_path))
  scalars = metrics.read_scalars(str(tmp_path))
  for tag in SPECIFIC_TAGS[name]:
    assert tag in scalars, (tag, sorted(scalars))
    assert [s for s, _ in scalars[tag]] == [1, 2, 3]
  # A step whose groups dynamic sampling all filtered trained no token: its token means
  # (entropy, ratios, clip fractions) have no value and are NaN, not 0; nothing else may be.
  empty = {s for s, v in scalars.get("filter/fill_frac", []) if v == 0}
  for tag, series in scalars.items():
    bad = {s for s, v in series if not math.isfinite(v)}
    assert not bad or (tag.startswith(rl_metrics.TOKEN_MEANS) and bad <= empty), (tag, bad)
  assert np.isfinite(result["eval/accuracy"])


@pytest.mark.slow
def test_a_step_that_trained_no_token_logs_no_behaviour_mean(tmp_path):
  """DAPO without the overlong term: every reward of the untrained policy is 0, dynamic sampling
  filters every group (`filter/fill_frac` 0) and the step trains no token. Its behaviour/* means
  (over the old pass's whole batch, merged beside the policy/* ones) read 0 there: rho_mean 0
  (ρ is an exponential), ess 0 (read as collapse); like the policy/* token means they are NaN."""
  over = {"shaping.name": "none", "train.num_steps": 1, "train.eval_every": 1}
  train_and_evaluate(tiny_config("dapo", **over, **{"train.checkpoint_every": 1}), str(tmp_path))
  scalars = metrics.read_scalars(str(tmp_path))
  assert scalars["filter/fill_frac"] == [(1, 0.0)]
  behaviour = [t for t in scalars if t.startswith("behaviour/")]
  assert len(behaviour) == 9, behaviour
  for tag in [*behaviour, "policy/entropy", "policy/ratio_mean"]:
    assert [s for s, _ in scalars[tag]] == [1] and math.isnan(scalars[tag][0][1]), tag
  assert scalars["policy/loss"] == [(1, 0.0)]  # the loss of no token is 0
  # docs/tensorboard.md: no correct completion, length_correct_mean 0 (the seed tables read it).
  assert scalars["rollout/accuracy"] == scalars["rollout/length_correct_mean"] == [(1, 0.0)]


@pytest.mark.parametrize("name", sorted(set(SPECIFIC_TAGS) - set(RUN_RECIPES)))
def test_recipe_step_traces_with_its_metrics(name):
  """The fused step of every other recipe, traced (not compiled) on abstract state: it builds
  and returns a float32 scalar for each of its objective-specific metrics."""
  tags = traced_step_metrics(tiny_config(name))
  for tag in SPECIFIC_TAGS[name]:
    assert tag in tags, (tag, sorted(tags))
    assert (tags[tag].shape, tags[tag].dtype) == ((), np.float32), tag


@pytest.mark.extended
def test_verl_grpo_config_sets_verls_conventions_and_runs():
  config = tiny_config("verl_grpo")
  s = parse(config).learner
  assert s.objective.hyperparameters == {"clip_low": 0.2, "clip_high": 0.2, "dual_clip": 3.0}
  assert (s.kl.name, s.kl.beta, s.kl.k3_clamp) == ("k3", 0.001, 10.0)
  assert (s.aggregation.name, s.advantage.whiten_variance) == ("token_mean", "unbiased")
  _, metrics = run_steps(config, 1)
  assert "policy/is_dual_clipped_mean" in metrics[0] and "kl/loss" in metrics[0]
