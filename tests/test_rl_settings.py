"""Learner settings: one dataclass per config section, objectives' own hyperparameters."""

from __future__ import annotations

import dataclasses
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, tiny_config
from parsed import build

from jaxrl_llm import launch, objectives
from jaxrl_llm.config import ConfigError, check, default_config, parse
from jaxrl_llm.config.fields import Section
from jaxrl_llm.data import pipeline
from jaxrl_llm.rl import Settings
from jaxrl_llm.run import to_global_batch


def _sections():
  hints = typing.get_type_hints(Settings)
  return {f.name: hints[f.name] for f in dataclasses.fields(Settings) if f.name != "reward_weights"}


@pytest.mark.parametrize("section", sorted(_sections()))
def test_each_settings_dataclass_has_exactly_its_config_sections_keys(section):
  cls = _sections()[section]
  assert issubclass(cls, Section) and cls.SECTION == section
  config_keys = set(default_config()[section].keys())
  assert set(cls().to_dict()) == config_keys


def test_settings_are_built_under_the_configs_own_names():
  c = default_config()
  c.kl.reference, c.kl.reset_every, c.rl.entropy_coef = "reset_every", 3, 1  # int -> float
  s = parse(c).learner
  assert s.kl.reference == "reset_every" and s.kl.reset_every == 3
  assert s.rl.entropy_coef == 1.0 and isinstance(s.rl.entropy_coef, float)
  assert s.objective.get("clip_low") is None  # unset: the objective's default applies
  assert s.reward_weights == (("correct", 1.0), ("format", 0.0))
  hash(s)  # frozen and hashable: static for jit


def test_a_section_with_an_unknown_or_missing_field_is_named():
  c = default_config()
  c.kl.unlock()
  c.kl.bogus = 1.0
  with pytest.raises(ConfigError, match=r"'kl'.*unknown fields \['bogus'\]"):
    parse(c)
  c = default_config()
  del c.shaping["cache_len"]
  with pytest.raises(ConfigError, match=r"'shaping'.*missing fields \['cache_len'\]"):
    parse(c)


@pytest.mark.parametrize(
  ("name", "widths"),
  [
    ("ppo_clip", {"clip_low": 0.2, "clip_high": 0.2}),
    ("gspo", {"clip_low": 3e-4, "clip_high": 4e-4}),
    ("gspo_token", {"clip_low": 3e-4, "clip_high": 4e-4}),
    ("cispo", {"is_clip_low": 1.0, "is_clip_high": 0.28, "clip_low": 0.2, "clip_high": 0.28}),
  ],
)
def test_objective_name_on_the_default_config_gets_that_objectives_widths(name, widths):
  argv = ["prog", f"--config={REPO}/configs/default.py", f"--config.objective.name={name}"]
  h = parse(launch.parse_config(argv)).learner.objective.hyperparameters
  assert {k: h[k] for k in widths} == widths
  assert h == objectives.get_objective(name).hyperparameters


def test_a_recipes_explicit_widths_win_and_a_flag_wins_over_both():
  objective = lambda *a: parse(launch.parse_config(["prog", *a])).objective  # noqa: E731
  dapo = objective(f"--config={REPO}/configs/dapo.py", "--config.objective.name=gspo")
  assert (dapo.hyperparameters["clip_low"], dapo.hyperparameters["clip_high"]) == (0.2, 0.28)
  gspo = objective(f"--config={REPO}/configs/gspo.py", "--config.objective.clip_high=0.01")
  assert (gspo.hyperparameters["clip_low"], gspo.hyperparameters["clip_high"]) == (3e-4, 0.01)
  sapo = objective(f"--config={REPO}/configs/default.py", "--config.objective.name=sapo")
  assert sapo.hyperparameters == {"tau_pos": 1.0, "tau_neg": 1.05}


@pytest.mark.extended
def test_gspo_from_the_command_line_trains_with_gspo_widths():
  """`--config.objective.name=gspo` runs an update whose clipping is GSPO's 3e-4/4e-4."""
  argv = [
    "prog",
    f"--config={REPO}/configs/default.py",
    "--config.objective.name=gspo",
    "--config.rl.num_prompts=4",
    "--config.sampling.group_size=4",
    "--config.sft.steps=0",
    "--config.optim.warmup_steps=0",
    "--config.optim.learning_rate=1e-3",
    "--config.task.eval_size=8",
    "--config.mesh.data=1",
  ]
  exp = build(launch.parse_config(argv))
  assert exp.meta["objective"] == {"name": "gspo", "clip_low": 3e-4, "clip_high": 4e-4}
  it = pipeline.make_prompt_iterator(exp.task.train_examples(0), 4, seed=0)
  batch = to_global_batch(next(it), exp.batch_sharding)
  rng = jax.random.PRNGKey(1)
  rollout = exp.program.sample(exp.state, batch, rng)
  correct = jnp.tile(jnp.array([1.0, 0.0, 0.0, 1.0]), 4)  # rewards with spread in every group
  _, m = exp.program.learn(exp.state, rollout, {"correct": correct}, rng)
  # The first minibatch is on-policy; after one step at lr 1e-3 the sequence ratios of the
  # second move by about 1e-3: far outside GSPO's 4e-4, far inside ppo_clip's 0.2.
  assert float(m["policy/clip_frac_first_minibatch"]) == 0.0
  assert float(m["policy/clip_frac_low"] + m["policy/clip_frac_high"]) > 0.0
  assert abs(float(m["policy/seq_ratio_mean"]) - 1.0) < 0.05
  assert np.isfinite(float(m["policy/loss"]))


def test_objective_range_checks_run_at_start_up_and_name_the_field():
  c = tiny_config(**{"objective.name": "gmpo", "objective.clip_log": -1.0})
  with pytest.raises(ConfigError, match=r"objective.clip_log=-1.0 must be in \(0, inf\)"):
    check(parse(c), num_devices=1)
  c = tiny_config(**{"objective.dual_clip": 0.5})
  with pytest.raises(ConfigError, match=r"objective\.dual_clip=0\.5 must be > 1"):
    check(parse(c), num_devices=1)
  # A width of another objective is ignored: gspo does not read clip_log.
  check(parse(tiny_config(**{"objective.name": "gspo", "objective.clip_log": -1.0})), num_devices=1)


@pytest.mark.extended
def test_generated_tokens_count_the_groups_dynamic_sampling_drops():
  """`perf/generated_tokens` counts every sampled row, the oversampled groups that §7 filters
  away included (the rollout/* statistics describe the kept batch)."""
  import jax
  import numpy as np
  from conftest import tiny_config

  from jaxrl_llm.data import pipeline
  from jaxrl_llm.rl import init_reference

  config = tiny_config(**{"filtering.name": "dynamic_sampling", "filtering.oversample": 2.0})
  exp = build(config)
  state = init_reference(exp.state, config.kl.beta)
  sampled = parse(config).sampled_prompts
  assert sampled == 2 * config.rl.num_prompts
  it = pipeline.make_prompt_iterator(exp.task.train_examples(0), sampled, seed=0)
  batch, rng = to_global_batch(next(it), exp.batch_sharding), jax.random.PRNGKey(3)
  rollout = jax.device_get(exp.program.sample(state, batch, rng))
  _, m = jax.device_get(exp.rl_step(state, batch, rng))
  assert len(rollout.lengths) == sampled * config.sampling.group_size
  assert m["perf/generated_tokens"] == np.sum(rollout.lengths)
  assert m["perf/generated_tokens"] > np.sum(m["hist/length"])  # the kept rows are fewer
