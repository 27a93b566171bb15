"""The typed settings tree: every section a frozen dataclass that owns its fields, defaults,
comments and checks; the embedded default config generated from it; an objective's
hyperparameters declared by the objective alone."""

from __future__ import annotations

import json
import re
import sys

import numpy as np
import pytest
from conftest import REPO, load_config, run_steps

from jaxrl_llm import launch, objectives
from jaxrl_llm.config import Config, ConfigError, default_config, parse, reference
from jaxrl_llm.config.fields import field_docs

FROZEN = json.loads((REPO / "tests" / "fixtures" / "default_config_before.json").read_text())
# Fields added after the freeze, with their defaults (every other field must be as it was).
ADDED = {
  "mesh": {"runs": 1, "runs_at_once": 0},
  "task": {"numbers": 4, "wrong_traces": 0.0, "tool_traces": 0.0},  # countdown: 4 digits
  "sampling": {"kv_block": 128, "tool": "none", "max_turns": 3, "turn_tokens": 0},
  "train": {"resume_changed": False, "max_failed_verifier_steps": 3, "compilation_cache": "auto"},
  "model": {
    "lora_rank": 0,
    "lora_alpha": 16.0,
    "lora_targets": "q,k,v,o,gate,up,down",
    "lora_dropout": 0.0,
    "lora_base_dtype": "auto",
  },
}


def _then_and_since(frozen: dict) -> dict:
  """A frozen config with the fields added since (a new field is not a changed default)."""
  out = json.loads(json.dumps(frozen))
  for section, fields in ADDED.items():
    out[section].update(fields)
  return out


def _as_json(config) -> dict:
  return json.loads(config.to_json_best_effort())


def test_the_generated_default_equals_the_tree_before_it():
  """Every field of the hand-written default config (frozen before the tree replaced it) is
  generated once, with the same default value, and nothing else is."""
  assert _as_json(default_config()) == _then_and_since(FROZEN["default"])


@pytest.mark.parametrize("name", sorted(k for k in FROZEN if k != "default"))
def test_every_experiment_file_gives_the_config_it_gave_before(name):
  config = load_config(name.removeprefix("configs/").removesuffix(".py"))
  assert _as_json(config) == _then_and_since(FROZEN[name])


def test_parsing_keeps_every_field_and_value():
  config = default_config()
  config.objective.clip_high, config.sampling.temperature = 0.28, 0.7
  tree = parse(config)
  assert json.loads(tree.to_json()) == _as_json(config)
  assert tree.objective.hyperparameters["clip_high"] == 0.28 and tree.sampling.temperature == 0.7
  assert tree.value("objective.clip_low") == 0.2  # resolved: ppo_clip's own default
  hash(tree)  # frozen and hashable


def test_every_field_has_one_comment():
  rows = reference()
  assert len(rows) == len({field for field, _, _ in rows}) > 120
  undocumented = [field for field, _, doc in rows if not doc]
  assert not undocumented
  assert field_docs(Config)["seed"].startswith("one PRNG key per run")


def _listed(doc: str) -> set[str]:
  """The names a field's comment lists as `label: a | b (note) | c, note`: the first word of
  each `|`-separated part, after the label."""
  parts = doc.split(":", 1)[-1].split("|")
  return {re.match(r"\s*([\w.]+)", p).group(1) for p in parts}


def test_a_name_fields_comment_lists_exactly_the_names_it_allows():
  """The config reference (README) names every value a choice field accepts and no other (it
  listed `bf16` for sampling.param_dtype, which is refused, and left out reinforce_pp_baseline)."""
  from jaxrl_llm import quant
  from jaxrl_llm.config.learner import REFERENCES, REMATS
  from jaxrl_llm.kernels import attention
  from jaxrl_llm.objectives import aggregation, corrections, kl, registry

  allowed = {
    "advantage.name": set(registry.ADVANTAGES),
    "aggregation.name": set(aggregation.AGGREGATION_MODES),
    "kl.name": set(kl.KL_ESTIMATORS),
    "correction.name": set(corrections.CORRECTION_BASES),
    "sampling.param_dtype": set(quant.SAMPLER_DTYPES),
    "model.attention": set(attention.IMPLEMENTATIONS),
    "rl.remat": set(REMATS),
    "kl.reference": set(REFERENCES),
  }
  docs = {field: doc for field, _, doc in reference()}
  wrong = {f: sorted(_listed(docs[f]) ^ names) for f, names in allowed.items()}
  assert {f: d for f, d in wrong.items() if d} == {}


def test_the_config_reference_page_is_generated_from_the_dataclasses():
  readme = (REPO / "docs" / "config.md").read_text()
  start, end = "<!-- config-reference:start -->", "<!-- config-reference:end -->"
  assert start in readme and end in readme
  shown = readme.split(start)[1].split(end)[0].strip()
  from jaxrl_llm.config.tree import reference_markdown

  assert shown == reference_markdown().strip(), (
    "docs/config.md's config reference differs from the settings' declarations: run "
    "`python tools/config_reference.py`"
  )


def test_the_config_reference_command_checks_and_rewrites_only_its_section(tmp_path):
  """`python tools/config_reference.py --check` exits 1 naming itself when the README's table
  differs; without --check it writes the table between the markers and nothing else."""
  import subprocess

  from conftest import cli_env

  from jaxrl_llm.config.tree import reference_markdown

  start, end = "<!-- config-reference:start -->", "<!-- config-reference:end -->"
  readme = tmp_path / "README.md"
  readme.write_text(f"# Title\n\nbefore\n{start}\n\n| old |\n\n{end}\nafter\n")

  def tool(*args):
    return subprocess.run(
      [sys.executable, "tools/config_reference.py", f"--readme={readme}", *args],
      cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip

  stale = tool("--check")
  assert stale.returncode == 1 and readme.read_text().count("| old |") == 1
  assert stale.stderr.strip().splitlines() == [
    "README.md: the config reference differs from the settings' declarations; "
    "run `python tools/config_reference.py`"
  ]
  assert tool().returncode == 0
  table = reference_markdown().strip()
  assert readme.read_text() == f"# Title\n\nbefore\n{start}\n\n{table}\n\n{end}\nafter\n"
  fresh = tool("--check")
  assert fresh.returncode == 0, fresh.stderr


@pytest.mark.parametrize(
  ("field", "value", "message"),
  [
    ("sampling.temperature", 0.0, r"sampling\.temperature=0\.0 must be >= 0\.01"),
    ("sampling.temperature", 1e-30, r"sampling\.temperature=1e-30 must be >= 0\.01"),
    ("model.norm_eps", float("nan"), r"model\.norm_eps=nan must be a finite number"),
    ("model.lora_alpha", float("inf"), r"model\.lora_alpha=inf must be a finite number"),
    ("model.rope_theta", -1.0, r"model\.rope_theta=-1\.0 must be > 0"),
    ("model.norm_eps", -1e-6, r"model\.norm_eps=-1e-06 must be > 0"),
    ("model.rope_scaling_factor", 0.0, r"model\.rope_scaling_factor=0\.0 must be > 0"),
    ("model.moe_aux_loss_coef", -0.1, r"model\.moe_aux_loss_coef=-0\.1 must be >= 0"),
    ("task.numbers", 0, r"task\.numbers=0 must be in \[2, 5\]"),  # countdown's, on reverse
    ("task.digits", 0, r"task\.digits=0 must be in \[1, 9\]"),
    ("optim.b2", 1.0, r"optim\.b2=1\.0 must be in \[0, 1\)"),
    ("train.max_to_keep", 0, r"train\.max_to_keep=0 must be >= 1"),
    ("data.template", "nope", r"data\.template='nope'; allowed: "),
    ("kl.ema", 2.0, r"kl\.ema=2\.0 must be in \[0, 1\]"),
    ("mesh.runs_at_once", -1, r"mesh\.runs_at_once=-1 must be >= 0 \(0 = every run at once\)"),
  ],
)
def test_each_section_checks_its_own_fields_when_parsed(field, value, message):
  config = default_config()
  section, name = field.split(".")
  config[section][name] = value
  with pytest.raises(ConfigError, match=message):
    parse(config)


@pytest.fixture
def plugin():
  """tests/plugin_objective.py's objective, registered for one test and removed after it."""
  sys.path.insert(0, str(REPO / "tests"))
  yield REPO / "tests" / "fixtures" / "plugin_config.py"
  objectives.OBJECTIVES.pop("tilted_pg", None)
  sys.modules.pop("plugin_objective", None)
  sys.path.remove(str(REPO / "tests"))


@pytest.mark.extended
def test_an_objective_with_a_new_hyperparameter_is_one_module(plugin):
  """A module outside the package registers `tilted_pg` with a hyperparameter named `tilt`;
  the command line sets it, and a fused step trains with it. Nothing else declares `tilt`."""
  assert "tilt" not in objectives.hyperparameter_kinds()
  argv = ["prog", f"--config={plugin}", "--config.objective.name=tilted_pg"]
  argv += ["--config.objective.tilt=0.5", "--config.sft.steps=0", "--config.rl.num_prompts=4"]
  argv += ["--config.sampling.group_size=4", "--config.task.eval_size=16", "--config.mesh.data=1"]
  config = launch.parse_config(argv)
  tree = parse(config)
  assert tree.objective.hyperparameters == {"tilt": 0.5}
  assert dict(r[::2] for r in reference())["objective.tilt"].startswith("τ of tilted_pg")
  _, metrics = run_steps(config, 1)
  assert float(metrics[0]["policy/tilt_mean"]) == pytest.approx(0.5)
  assert np.isfinite(float(metrics[0]["policy/loss"]))
  with pytest.raises(ConfigError, match=r"unknown config field 'objective\.tlit'"):
    launch.parse_config([*argv, "--config.objective.tlit=0.5"])


def test_packaging_source_names_no_removed_module():
  """The settings have one home: nothing imports the modules the tree replaced."""
  gone = re.compile(r"\b(config_lib|default_config\.get_config|jaxrl_llm\.train\b|rl\.settings)")
  for path in [*(REPO / "jaxrl_llm").rglob("*.py"), *(REPO / "tools").glob("*.py")]:
    assert not gone.search(path.read_text()), path


def test_settings_that_only_end_an_invocation_are_declared_once_and_leave_records_equal():
  """Which settings only end or pace one invocation is said at their declaration
  (`invocation=True`); the run record's comparison drops exactly those, so a relaunch that
  changes one writes no record, while any other change still does."""
  from jaxrl_llm.config import INVOCATION, tagged
  from jaxrl_llm.run.record import results_fields

  names = tagged(INVOCATION)
  assert set(names) == {
    "train.stop_after_steps", "train.profile_steps", "train.resume_changed",
    "train.compilation_cache",
  }  # fmt: skip
  base = json.loads(default_config().to_json())
  for name, value in zip(names, (7, 2, True, ""), strict=True):
    section, _, field = name.partition(".")
    changed = json.loads(json.dumps(base))
    changed[section][field] = value
    assert results_fields(changed) == results_fields(base) and changed != base, name
  learned = json.loads(json.dumps(base))
  learned["objective"]["clip_high"] = 0.5
  assert results_fields(learned) != results_fields(base)


def test_a_resume_that_moves_the_learning_rate_schedule_says_so(tmp_path):
  """Extending a run (train.num_steps 4 → 8) stretches its cosine schedule: at the resumed
  update the learning rate is another than the run's own schedule gave, which the relaunch
  said nothing of. `schedule_moved` names both values; the same schedule, or no record, is
  None."""
  from conftest import tiny_config

  from jaxrl_llm.config import parse
  from jaxrl_llm.run import changes

  base = {"train.num_steps": 4, "optim.warmup_steps": 0, "optim.decay_to": 0.1}
  first = parse(tiny_config(**base))
  (tmp_path / "config.json").write_text(json.dumps({"config": json.loads(first.to_json())}))
  assert changes.schedule_moved(first, str(tmp_path), 4) is None
  longer = parse(tiny_config(**{**base, "train.num_steps": 8}))
  per_step = first.rl.num_epochs * first.rl.num_minibatches
  was = float(first.optim.build(4 * per_step)[1](4 * per_step))
  now = float(longer.optim.build(8 * per_step)[1](4 * per_step))
  assert now > 2 * was  # the end of a decay against its middle
  line = changes.schedule_moved(longer, str(tmp_path), 4)
  assert line == (
    f"learning rate at update {4 * per_step}: {was:.3g} → {now:.3g} "
    f"({4 * per_step} → {8 * per_step} updates)"
  )
  assert changes.schedule_moved(longer, str(tmp_path / "none"), 4) is None
