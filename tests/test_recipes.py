"""Every §10 recipe config runs 3 fused RL steps and logs its objective-specific metrics."""

import math

import numpy as np
import pytest
from conftest import REPO, run_steps, tiny_config
from parsed import build, train_and_evaluate

from jaxrl_llm import metrics
from jaxrl_llm.config import parse, recipes

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


def test_rspo_needs_a_moe_model():
  with pytest.raises(ValueError, match="needs a mixture-of-experts policy"):
    build(tiny_config("rspo", **{"model.moe_num_experts": 0}))


# Recipes whose objective, correction and filter the default-run recipes and the unit tests
# (tests/objectives, test_rl_loss) already cover; their end-to-end runs are in the slow tier.
SLOW_RECIPES = {
  "dr_grpo",
  "gmpo",
  "cispo",
  "sapo",
  "deepseek_v32",
  "rloo",
  "lite_ppo",
  "moe_grpo",
  "moe_gspo",
  "moe_rspo",
  "rspo",  # the MoE router-shift path runs in moe_default too
  "gspo",  # sequence ratios: tests/test_rl_settings.py runs gspo from the command line
  "olmo3",
  "ppo",  # the critic path: tests/test_rl_loss.py and test_rl_settings.py
  "grpo",  # the default config with KL on: tests/test_train.py's tiny run has every grpo tag
}


@pytest.mark.parametrize(
  "name",
  [
    pytest.param(n, marks=pytest.mark.slow) if n in SLOW_RECIPES else n
    for n in sorted(SPECIFIC_TAGS)
  ],
)
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
  for tag, series in scalars.items():
    assert all(math.isfinite(v) for _, v in series), tag
  assert np.isfinite(result["eval/accuracy"])


def test_verl_grpo_config_sets_verls_conventions_and_runs():
  config = tiny_config("verl_grpo")
  s = parse(config).learner
  assert s.objective.hyperparameters == {"clip_low": 0.2, "clip_high": 0.2, "dual_clip": 3.0}
  assert (s.kl.name, s.kl.beta, s.kl.k3_clamp) == ("k3", 0.001, 10.0)
  assert (s.aggregation.name, s.advantage.whiten_variance) == ("token_mean", "unbiased")
  _, metrics = run_steps(config, 1)
  assert "policy/is_dual_clipped_mean" in metrics[0] and "kl/loss" in metrics[0]
