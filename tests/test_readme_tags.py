"""docs/tensorboard.md's TensorBoard table (spec §11) against what real runs write.

The table after "Scalars (spec §11), written every `train.log_every` updates:" and the
"Histograms:" sentence after it are parsed from docs/tensorboard.md at test time. Every tag they name must
be declared in `metric_info`, and every tag must be logged, with finite values, by a tiny run that
switches on the row's feature: a MoE run (RSPO, KL, warm start, dynamic sampling, a correction,
soft overlong shaping), a PPO-critic run on a prompt file with host verifiers, and one fused step
each of CISPO and SAPO for their objective-specific means.
"""

import math
import re

import jax
import ml_collections
import numpy as np
import pytest
from conftest import REPO, run_steps, tiny_config
from parsed import train_and_evaluate
from text_fixtures import math_file_run

from jaxrl_llm import metric_info, metrics
from jaxrl_llm.config import parse

SCALARS_LINE = "Scalars (spec §11), written every `train.log_every` updates:"

# Rows every RL run logs, whatever its features (the objective-specific means aside).
COMMON = ("rollout/", "adv/", "policy/", "behaviour/", "optim/", "perf/", "eval/")
# The objective-specific means of the policy row and the objective that logs each here (seq_ratio
# is also logged by gspo, gspo_token and gmpo); a mean missing here is expected from every run.
OBJECTIVE_MEANS = {
  "policy/seq_ratio_mean": "rspo",
  "policy/router_gamma_mean": "rspo",
  "policy/is_weight_mean": "cispo",
  "policy/gate_weight_mean": "sapo",
  "policy/is_dual_clipped_mean": "dual_clip",  # PPO-clip with objective.dual_clip set
}
# The one-step runs of the objective-specific means the MoE run does not log.
MEAN_RUNS = {
  "cispo": {"objective.name": "cispo"},
  "sapo": {"objective.name": "sapo"},
  "dual_clip": {"objective.dual_clip": 3.0},
}
# Rows logged only when a feature is on; each test below names the ones its run covers.
FEATURE_ROWS = ("reward/", "kl/", "filter/", "value/", "moe/", "verifier/", "sft/", "tool/")
MOE = {"model.moe_num_experts": 4, "model.moe_top_k": 2, "model.moe_expert_mlp_dim": 32}
MOE |= {"model.num_layers": 2, "model.moe_every": 2}  # layer 0 dense, layer 1 MoE
SHORT = {"train.num_steps": 2, "train.eval_every": 2, "train.checkpoint_every": 2}
FILE_WEIGHTS = {"math_correct": 1.0, "math_format_boxed": 0.5}


def _scalar_section() -> list[str]:
  """README lines from the scalars line to the end of the "Histograms:" paragraph."""
  lines = (REPO / "docs" / "tensorboard.md").read_text().splitlines()
  start = lines.index(SCALARS_LINE)
  hist = next(i for i in range(start, len(lines)) if lines[i].startswith("Histograms:"))
  end = next((i for i in range(hist, len(lines)) if not lines[i].strip()), len(lines))
  return lines[start:end]


def _names(cell: str) -> list[str]:
  """Backticked names of a cell, parenthetical notes left out. A parenthesis holding only a
  list of backticked names, "(`correct`, `format`)", is names; any other is a note."""
  unwrap = lambda m: m[1] if re.fullmatch(r"(\s*`[^`]+`\s*,?)+", m[1]) else ""  # noqa: E731
  while "(" in cell:  # innermost first: "(see [Mixture of experts](#mixture-of-experts))"
    cell = re.sub(r"\(([^()]*)\)", unwrap, cell)
  return re.findall(r"`([^`]+)`", cell)


def _expand(name: str) -> list[str]:
  """`length_mean/min/max` -> length_mean, length_min, length_max; anything else as is."""
  m = re.fullmatch(r"(\w+?)_(\w+)((?:/\w+)+)", name)
  if not m:
    return [name]
  return [f"{m[1]}_{suffix}" for suffix in (m[2], *m[3].split("/")[1:])]


def readme_rows() -> dict[str, list[str]]:
  """{prefix: [tag name, ...]} of the README scalar table, placeholders (`<name>`) kept."""
  rows = {}
  for line in _scalar_section():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) == 2 and re.fullmatch(r"`\w+/`", cells[0]):
      rows[cells[0].strip("`")] = [t for n in _names(cells[1]) for t in _expand(n)]
  return rows


def readme_histograms() -> list[str]:
  """Histogram tags of the README's "Histograms:" sentence, placeholders (`<i>`) kept."""
  section = _scalar_section()
  paragraph = " ".join(section[next(i for i, s in enumerate(section) if s.startswith("Hist")) :])
  return _names(paragraph.split("Text:")[0])


def readme_scalars(*, terms, pass_k: int) -> list[str]:
  """Every README scalar tag, `<name>` expanded with the reward `terms`, `pass@k` with k."""
  tags = []
  for prefix, names in readme_rows().items():
    for name in names:
      name = name.replace("pass@k", f"pass@{pass_k}")
      filled = [name.replace("<name>", t) for t in terms] if "<name>" in name else [name]
      tags += [prefix + n for n in filled]
  return tags


def test_readme_table_parses_and_every_tag_is_declared():
  """The README scalar table and histogram sentence parse into plain tag names (so a reworded
  table cannot make the end-to-end test below vacuous), and every scalar tag they promise is
  declared in `metric_info` (direction, meaning, peer names), as tools/compare.py and the HParams
  view rely on."""
  rows = readme_rows()
  assert set(rows) == set(COMMON + FEATURE_ROWS), "a row the tests below do not check, or lost"
  assert all(rows.values()), rows
  assert {"length_min", "length_mean", "length_max"} <= set(rows["rollout/"])
  assert {"ratio_min", "ratio_mean", "ratio_max", "clip_frac"} <= set(rows["policy/"])
  assert set(OBJECTIVE_MEANS) <= {"policy/" + n for n in rows["policy/"]}
  assert {"correct", "overlong", "errors/<name>"} <= {n for ns in rows.values() for n in ns}
  assert {"reward", "length", "advantage", "moe_load_layer<i>"} == set(readme_histograms())
  tags = readme_scalars(terms=("correct", "math_correct"), pass_k=4)
  assert all(re.fullmatch(r"[a-z0-9_]+/[a-z0-9_@/]+", t) for t in tags), tags
  assert [t for t in tags if metric_info.info(t) is None] == []


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
  """(workdir, config) of a 2-update MoE run with RSPO, KL to a reference, a 2-step warm start,
  dynamic sampling, a TIS correction and soft overlong shaping: the kl/, filter/, moe/,
  behaviour/ and sft/ rows, the built-in reward terms and the moe_load histograms."""
  workdir = tmp_path_factory.mktemp("moe")
  config = tiny_config(
    **MOE,
    **SHORT,
    **{
      "objective.name": "rspo",
      "kl.beta": 0.04,
      "sft.steps": 2,
      "sft.batch_size": 8,
      "filtering.name": "dynamic_sampling",
      "correction.name": "tis_token",
      "shaping.name": "soft_overlong",
    },
  )
  train_and_evaluate(config, str(workdir))
  return workdir, config


@pytest.fixture(scope="module")
def critic_file_run(tmp_path_factory):
  """(workdir, config) of a 2-update PPO-critic run on a JSONL prompt file scored by host
  verifiers (two reward terms): the value/ and verifier/ rows."""
  folder = tmp_path_factory.mktemp("critic_file")
  overrides, _ = math_file_run(folder)
  critic = {"objective.name": "ppo_critic", "model.value_head": True, "advantage.name": "gae"}
  config = tiny_config(**{**overrides, **SHORT, **critic})
  config.task.reward_weights = ml_collections.ConfigDict(FILE_WEIGHTS)
  train_and_evaluate(config, str(folder / "run"))
  return folder / "run", config


@pytest.fixture(scope="module")
def objective_step_metrics():
  """{objective: host metrics of one fused RL step} for CISPO, SAPO and dual-clip PPO."""
  return {name: run_steps(tiny_config(**over), 1)[1][0] for name, over in MEAN_RUNS.items()}


def _reward_terms(config) -> list[str]:
  """Host reward terms of a prompt-file run: each weighted term and `data.correct_term`."""
  weights = dict(config.task.reward_weights)
  return sorted(
    {n for n, w in weights.items() if w and n != "correct"} | {config.data.correct_term}
  )


def _assert_logged(scalars, tags, where):
  """Each tag of `tags` is in `scalars` (tag -> [(step, value)]) with only finite values."""
  missing = sorted(set(tags) - set(scalars))
  assert missing == [], f"{where} does not log {missing}"
  bad = sorted(t for t in tags if not np.all(np.isfinite([v for _, v in scalars[t]])))
  assert bad == [], f"{where} logs non-finite values for {bad}"


def _assert_rollout_relations(scalars, where):
  """Relations between the rollout scalars that a wrong value would break, step by step."""
  value = lambda tag: np.array([v for _, v in scalars[tag]])  # noqa: E731
  lo, mean, hi = (value(f"rollout/length_{s}") for s in ("min", "mean", "max"))
  assert np.all(lo <= mean + 1e-6) and np.all(mean <= hi + 1e-6), (where, lo, mean, hi)
  for tag in ("rollout/zero_std_group_frac", "rollout/truncated_frac", "rollout/accuracy"):
    assert np.all((value(tag) >= 0) & (value(tag) <= 1)), (where, tag, value(tag))
  assert np.all(value("rollout/reward_std") >= 0), where


def _split(tags, prefixes):
  """The tags under any of `prefixes`, less the objective-specific means."""
  return [t for t in tags if t.startswith(prefixes) and t not in OBJECTIVE_MEANS]


@pytest.mark.extended
def test_a_multi_turn_run_logs_its_readme_tool_tags(tmp_path):
  """Every README `tool/` scalar is in a multi-turn run's event files (the countdown tool on
  the countdown task) with finite values at each logged step; a single-turn run logs none."""
  cfg = {"task.name": "countdown", "sampling.tool": "countdown", "sampling.max_turns": 3}
  cfg.update({"train.num_steps": 2, "train.log_every": 1, "train.eval_every": 2, "sft.steps": 0})
  train_and_evaluate(tiny_config(**cfg), str(tmp_path))
  scalars = metrics.read_scalars(str(tmp_path))
  tags = _split(readme_scalars(terms=(), pass_k=2), ("tool/",))
  assert len(tags) == 8
  _assert_logged(scalars, tags, "the multi-turn run")
  assert all([s for s, _ in scalars[t]] == [1, 2] for t in tags)


@pytest.mark.extended
def test_the_moe_run_logs_its_readme_tags(moe_run):
  """Every README scalar of the common rows and of kl/, filter/, moe/ and reward/ (the built-in
  terms plus `overlong`) is in the MoE run's event files with finite values, as are RSPO's
  seq_ratio and router_gamma means and no other objective's; the warm start's sft/ tags are in
  <workdir>/sft only; and the reward/length/advantage and per-layer moe_load histograms exist,
  each load histogram over the run's experts. Guards the README promise end to end."""
  workdir, config = moe_run
  scalars = metrics.read_scalars(str(workdir))
  tags = readme_scalars(terms=(), pass_k=config.train.pass_k)
  rspo = [t for t, o in OBJECTIVE_MEANS.items() if o == "rspo"]
  own = _split(tags, (*COMMON, "kl/", "filter/", "moe/", "reward/")) + rspo
  _assert_logged(scalars, own, "the MoE run")
  assert sorted(set(OBJECTIVE_MEANS) & set(scalars)) == sorted(rspo)
  _assert_rollout_relations(scalars, "the MoE run")
  fill = [v for _, v in scalars["filter/fill_frac"]]
  assert all(0 <= v <= 1 for v in fill), fill
  sft = metrics.read_scalars(str(workdir / "sft"))
  _assert_logged(sft, [t for t in tags if t.startswith("sft/")], "the warm start")
  assert [s for s, _ in sft["sft/loss"]] == list(range(1, config.sft.steps + 1))
  assert not any(t.startswith("sft/") for t in scalars)

  # README: moe_load_layer<i> for model layer i; with moe_every=2 only layer 1 of 2 is a MoE
  # layer (it was named moe_load_layer0, by its rank among the MoE layers).
  layers = parse(config).model.arch.moe_layers
  assert layers == (1,)
  expected = [h.replace("<i>", str(i)) for h in readme_histograms() for i in layers]
  hists = metrics.read_histograms(str(workdir))
  assert set(expected) <= set(hists), sorted(set(expected) - set(hists))
  assert "moe_load_layer0" not in hists
  for tag in expected:
    assert all(np.all(np.isfinite(h)) for _, h in hists[tag]), tag
    if tag.startswith("moe_load_layer"):  # one value per expert
      assert all(h[:, 2].sum() == config.model.moe_num_experts for _, h in hists[tag]), tag


@pytest.mark.extended
def test_the_critic_file_run_logs_its_readme_tags(critic_file_run):
  """Every README scalar of the common rows, value/ and verifier/ (per-term errors/<name> and
  timeouts/<name> for each host reward term, which add up to the totals), and reward/<term> for
  each term, is in the PPO-critic prompt-file run's event files with finite values; no
  objective-specific mean and no moe_load histogram appears there (dense, ppo_critic)."""
  workdir, config = critic_file_run
  scalars = metrics.read_scalars(str(workdir))
  terms = _reward_terms(config)
  tags = readme_scalars(terms=terms, pass_k=config.train.pass_k)
  own = _split(tags, (*COMMON, "value/", "verifier/")) + [f"reward/{t}" for t in terms]
  _assert_logged(scalars, own, "the critic file run")
  assert not set(OBJECTIVE_MEANS) & set(scalars)
  _assert_rollout_relations(scalars, "the critic file run")
  for total in ("errors", "timeouts"):
    per_term = sum(np.array([v for _, v in scalars[f"verifier/{total}/{t}"]]) for t in terms)
    np.testing.assert_array_equal([v for _, v in scalars[f"verifier/{total}"]], per_term)
  hists = set(metrics.read_histograms(str(workdir)))
  dense = [h for h in readme_histograms() if "<" not in h]
  assert set(dense) <= hists and not any(h.startswith("moe_load") for h in hists)


@pytest.mark.extended
def test_cispo_sapo_and_dual_clip_log_their_objective_means(objective_step_metrics):
  """One fused step of CISPO logs `policy/is_weight_mean`, SAPO `policy/gate_weight_mean` and
  PPO-clip with a dual clip `policy/is_dual_clipped_mean`, finite, each without the other
  objectives' README means: the policy row's objective-specific means that the MoE run (RSPO)
  does not cover."""
  for objective, m in objective_step_metrics.items():
    own = [t for t, o in OBJECTIVE_MEANS.items() if o == objective]
    assert own and sorted(set(OBJECTIVE_MEANS) & set(m)) == own, (objective, sorted(m))
    assert all(math.isfinite(float(jax.device_get(m[t]))) for t in own), objective
  assert set(OBJECTIVE_MEANS.values()) - {"rspo"} == set(objective_step_metrics)
