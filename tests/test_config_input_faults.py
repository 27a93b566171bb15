"""Config values that parsed and then trained nothing, or were changed without a word: a
correction whose bounds exclude every on-policy token, a whole-number setting given a bool or
a fraction, and a soft-overlong window checked against the wrong budget with a tool on."""

import pytest
from conftest import config_problems, tiny_config

from jaxrl_llm.config import ConfigError, acting, parse
from jaxrl_llm.config.checks import check
from jaxrl_llm.run.assemble import build_task


def _said_of(name: str, **overrides) -> str:
  """The ConfigError `parse` raises for `overrides` on configs/<name>.py made tiny ("" if
  none)."""
  try:
    parse(tiny_config(name, **overrides))
  except ConfigError as e:
    return str(e)
  return ""


def _said(**overrides) -> str:
  """The ConfigError `parse` raises for `overrides` on the tiny config ("" if none)."""
  return _said_of("default", **overrides)


@pytest.mark.parametrize(
  "overrides, said",
  [
    ({"correction.name": "geo_mask", "correction.geo_low": 5.0}, "correction.cap=2.0 (C_high)"),
    ({"correction.name": "tis_seq+geo_mask", "correction.geo_low": 4.0,
      "correction.geo_high": 3.0}, "correction.geo_high=3.0 (C_high)"),
    ({"correction.name": "geo_mask", "correction.geo_high": 0.9}, "correction.geo_high=0.9"),
    ({"correction.name": "mis_token", "correction.cap": 0.5}, "correction.cap=0.5 with"),
    ({"correction.name": "mis_seq", "correction.cap": 0.99}, "correction.cap=0.99 with"),
    ({"correction.name": "tis_token", "correction.cap": 0.5}, "correction.cap=0.5 with"),
  ],
)  # fmt: skip
def test_a_correction_that_excludes_every_on_policy_token_is_refused(overrides, said):
  """geo_low=5 (C_high 2) masked every sequence and trained nothing with exit 0; a cap below 1
  truncates or rejects every token whose ratio is 1."""
  got = _said(**overrides)
  assert got.startswith("invalid config: correction.") and said in got, got
  assert "\n" not in got


@pytest.mark.parametrize(
  "overrides",
  [
    {"correction.name": "geo_mask", "correction.geo_low": 0.5},  # [0.5, cap 2]
    {"correction.name": "geo_mask", "correction.geo_low": 1.0, "correction.geo_high": 1.01},
    {"correction.name": "geo_mask", "correction.geo_high": 3.0, "correction.cap": 0.5},
    {"correction.name": "mis_token", "correction.cap": 1.0},
    {"correction.name": "none", "correction.cap": 0.5},  # unused
  ],
)
def test_corrections_that_keep_on_policy_tokens_are_accepted(overrides):
  assert _said(**overrides) == ""


@pytest.mark.parametrize("value", [True, 4096.5, float("nan")])
def test_a_whole_number_setting_refuses_a_bool_or_a_fraction(value):
  """int(True) = 1 and int(4096.5) = 4096 were taken without a word."""
  got = _said(**{"rl.microbatch_tokens": value})
  assert got == f"invalid config: rl.microbatch_tokens={value!r} must be a whole number", got
  assert parse(tiny_config(**{"rl.microbatch_tokens": 4096.0})).rl.microbatch_tokens == 4096


def test_soft_overlong_is_checked_against_the_budget_a_tool_gives():
  """With a tool and max_new_tokens=0 the budget is max_turns x (answer + the tool's answer);
  the window was checked against the task's answer alone and refused what fits."""
  base = {
    "task.name": "addition",
    "sampling.tool": "calculator",
    "shaping.name": "soft_overlong",
    "shaping.weight": 1.0,
  }

  def problems(cache_len):
    cfg = parse(tiny_config(**base | {"shaping.cache_len": cache_len}))
    task = build_task(cfg)
    try:
      check(cfg, num_devices=1, task=task)
    except ConfigError as e:
      return str(e), cfg.sampling.sampler(task).max_new_tokens
    return "", cfg.sampling.sampler(task).max_new_tokens

  said, t = problems(1)
  assert said == "" and t > 3 * build_task(parse(tiny_config(**base))).max_new_tokens
  assert problems(t - 1)[0] == ""
  said, _ = problems(t)
  assert said.startswith(f"invalid config: shaping.cache_len={t} must be in [1, T={t})"), said


@pytest.mark.extended  # two short runs (about 40 s)
def test_a_resume_that_switches_kl_or_clipping_on_or_off_is_one_line(tmp_path):
  """kl.beta 0 → 0.04 adds a reference model the checkpoint lacks; optim.grad_clip 1 → 0
  drops the clip element of the optimiser state. With train.resume_changed both printed a
  dump of every differing path (84 for grad_clip) and never named the setting. Now one line
  names it, before anything is written; a change that keeps each on or off still resumes."""
  from parsed import train_and_evaluate

  workdir = tmp_path / "w"
  train_and_evaluate(tiny_config(**{"train.num_steps": 1}), str(workdir))
  before = {p.name: p.stat().st_mtime_ns for p in workdir.iterdir()}
  go_on = {"train.num_steps": 2, "train.resume_changed": True}
  for field, old, new in (("kl.beta", 0.0, 0.04), ("optim.grad_clip", 1.0, 0.0)):
    with pytest.raises(ConfigError) as e:
      train_and_evaluate(tiny_config(**go_on, **{field: new}), str(workdir))
    said = str(e.value)
    assert f"({field}: {old!r} → {new!r}: on or off" in said and "\n" not in said, said
    assert {p.name: p.stat().st_mtime_ns for p in workdir.iterdir()} == before
  train_and_evaluate(tiny_config(**go_on, **{"optim.grad_clip": 0.5}), str(workdir))


def test_a_changed_sampling_setting_blocks_a_resume_but_the_samplers_dtype_does_not(tmp_path):
  """Group size, temperature, budget and tool decide the rollouts learned from: a relaunch that
  changed them resumed with no word. The sampler's dtype and KV blocks are speed knobs."""
  import json

  from jaxrl_llm.run import changes

  (tmp_path / "config.json").write_text(
    json.dumps({"config": json.loads(parse(tiny_config()).to_json())})
  )
  changed = {
    "sampling.group_size": 2,
    "sampling.temperature": 0.3,
    "sampling.max_new_tokens": 3,
    "sampling.param_dtype": "bfloat16",
    "sampling.kv_block": 0,
  }
  said = changes.changed_learner(parse(tiny_config(**changed)), str(tmp_path))
  assert [s.split(":")[0] for s in said] == [
    "sampling.group_size",
    "sampling.max_new_tokens",
    "sampling.temperature",
  ], said
  assert "sampling.temperature: 1.0 → 0.3" in said
  said = changes.changed_learner(parse(tiny_config(seed=5)), str(tmp_path))  # the data order
  assert said == ["seed: 0 → 5"], said


def test_an_objective_default_said_explicitly_is_no_change_on_resume(tmp_path):
  """A run recorded with clip_high unset (the objective's default 0.2 used) relaunched with
  --config.objective.clip_high=0.2 learns the same: no change is reported (it refused the
  resume, `None → 0.2`); another value is one, said as the values used."""
  import json

  from jaxrl_llm.run import changes

  unset = parse(tiny_config())
  resolved = {f"objective.{k}": v for k, v in unset.objective.hyperparameters.items()}
  saved = {"config": json.loads(unset.to_json()), "resolved": resolved}
  assert (
    saved["config"]["objective"]["clip_high"] is None and resolved["objective.clip_high"] == 0.2
  )
  (tmp_path / "config.json").write_text(json.dumps(saved))
  said = changes.changed_learner(parse(tiny_config(**{"objective.clip_high": 0.2})), str(tmp_path))
  assert said == [], said
  said = changes.changed_learner(parse(tiny_config(**{"objective.clip_high": 0.28})), str(tmp_path))
  assert said == ["objective.clip_high: 0.2 → 0.28"], said


def test_a_tool_the_task_cannot_take_is_named_not_a_traceback_of_the_budget_checks():
  """The budget checks build the tool's environment: countdown's on another task has no
  numbers to check (an AttributeError); `_tool` names it in one line instead."""
  for more in ({}, {"shaping.name": "soft_overlong", "shaping.weight": 1.0}):
    cfg = parse(tiny_config(**{"sampling.tool": "countdown"}, **more))
    with pytest.raises(ConfigError, match=r"sampling\.tool='countdown' checks countdown"):
      check(cfg, num_devices=1, task=build_task(cfg))


IGNORED = [  # (settings, the one a command line gives that has no effect, why)
  ({}, "objective.tau_pos", 2.0, "objective.name='ppo_clip' does not take it"),
  ({"objective.name": "sapo"}, "objective.clip_high", 0.28, "objective.name='sapo' does not"),
  ({}, "objective.value_coef", 1.0, "has no critic"),
  ({}, "kl.name", "k2", "kl.beta=0 has no KL term"),
  ({"kl.beta": 0.04, "kl.placement": "reward"}, "kl.name", "k2", "subtracts k1 from the"),
  ({"kl.beta": 0.04, "kl.placement": "reward"}, "kl.k3_clamp", 10.0, "subtracts k1"),
  ({"kl.beta": 0.04, "kl.name": "k2"}, "kl.k3_clamp", 10.0, "kl.name='k2' is not k3"),
  ({"kl.beta": 0.04}, "kl.reset_every", 10, "kl.reference='frozen'"),
  ({"kl.beta": 0.04, "kl.reference": "reset_every", "kl.reset_every": 5}, "kl.ema", 0.5, "ema"),
  ({}, "correction.cap", 3.0, "correction.name='none' does not use it"),
  ({"correction.name": "tis_token"}, "correction.geo_low", 0.5, "'tis_token' does not use it"),
  ({"correction.name": "geo_mask", "correction.geo_high": 3.0}, "correction.cap", 5.0, "does"),
  ({}, "model.moe_top_k", 4, "model.moe_num_experts=0 builds a dense model"),
  ({}, "model.lora_alpha", 32.0, "model.lora_rank=0 trains no adapters"),
  ({}, "model.lora_targets", "q_proj,v_proj", "lora_rank=0 trains"),  # as given, not 'q,v'
  ({}, "sampling.max_turns", 4, "sampling.tool='none' samples one segment"),
  ({}, "mesh.runs_at_once", 2, "a single run steps alone"),  # it paces a pack's runs only
]


@pytest.mark.parametrize("base, field, value, why", IGNORED)
def test_a_setting_the_run_ignores_is_refused_where_the_command_line_sets_it(
  base, field, value, why
):
  """A field the command line (or a sweep) sets that the run never reads was accepted without
  a word: `--config.objective.tau_pos=2` trained PPO-clip, `--config.kl.name=k2` trained with no
  KL (β = 0) or k1 (the reward placement). Now one line naming it, its value and why; the same
  value in the config file alone, or the embedded default's value, is no error."""
  from jaxrl_llm import launch

  config = tiny_config(**base, **{field: value})
  with pytest.raises(ConfigError) as e:
    launch.parse_acting(config, [*base, field])
  line = str(e.value)
  assert "\n" not in line and line.startswith(f"invalid config: {field}={value!r} has no effect")
  assert why in line, line
  launch.parse_acting(config, list(base))  # set by the file, not the command line: kept silent


def test_a_setting_that_acts_or_holds_its_default_is_accepted():
  """What the run reads, or a default restated (the kl_estimators study's kl.name=k3 beside
  kl.beta=0), passes."""
  from jaxrl_llm import launch

  moe = {"model.moe_num_experts": 4, "model.moe_top_k": 1, "model.moe_impl": "dense"}
  launch.parse_acting(tiny_config(**moe), list(moe))
  acting = {
    "objective.name": "sapo",
    "objective.tau_pos": 1.5,
    "kl.beta": 0.04,
    "kl.name": "k2",
    "correction.name": "tis_token",
    "correction.cap": 3.0,
  }
  launch.parse_acting(tiny_config(**acting), list(acting))
  restated = {"kl.beta": 0.0, "kl.name": "k3", "correction.cap": 2.0}
  launch.parse_acting(tiny_config(**restated), list(restated))


def test_a_sweep_leaves_out_what_a_point_never_reads_and_refuses_what_none_reads(tmp_path, capsys):
  """A point that would not read a field it is given (kl.name at kl.beta=0, SAPO's τ under
  PPO-clip) runs without it, said once; two points that then differ in nothing are one run,
  and a field no point reads is refused, before any run, packed or not."""
  import sys

  from conftest import REPO

  sys.path.insert(0, str(REPO / "tools"))
  import sweep

  config, root = str(REPO / "configs" / "default.py"), str(tmp_path / "sweep")
  runs = sweep.plan(config, root, ["kl.beta=0,0.04"], ["kl.name=k2"], None)
  assert [r.overrides for r in runs] == [{"kl.beta": "0"}, {"kl.name": "k2", "kl.beta": "0.04"}]
  assert "--config.kl.name=k2" not in runs[0].argv and "--config.kl.name=k2" in runs[1].argv
  note = capsys.readouterr().err.strip().splitlines()
  assert note == [
    "note: kl.name is left out of 1 of the 2 runs (kl.name='k2' has no effect: "
    "kl.beta=0 has no KL term (set kl.beta > 0))"
  ], note
  cases = [
    (
      ["--grid=objective.name=ppo_clip,sapo", "--grid=objective.tau_pos=1.0,2.0"],
      "error: grid points objective.name=ppo_clip,objective.tau_pos=1.0 and objective.name="
      "ppo_clip,objective.tau_pos=2.0 are the same run (objective.tau_pos=1.0 has no effect: "
      "objective.name='ppo_clip' does not take it",
    ),
    (  # the default (k3) reads as no change: the other value's reason is the one said
      ["--grid=kl.name=k2,k3"],
      "error: grid points kl.name=k2 and kl.name=k3 are the same run (kl.name='k2' has no "
      "effect: kl.beta=0 has no KL term (set kl.beta > 0)): give each value once, and only "
      "values the run reads",
    ),
    (
      ["--grid=objective.clip_high=0.2,0.3", "--set=objective.tau_pos=2.0"],
      "error: objective.tau_pos=2.0 has no effect: objective.name='ppo_clip' does not take it",
    ),
  ]
  for args, said in cases:
    for packed in ([], ["--packed"]):
      assert sweep.main([f"--config={config}", f"--root={root}", *packed, *args]) == 2
      err = capsys.readouterr().err.strip().splitlines()
      assert len(err) == 1 and err[0].startswith(said), err
  assert not (tmp_path / "sweep").exists()


def test_an_unknown_expert_implementation_is_refused_on_a_dense_model_too():
  """model.moe_impl='bogus' passed on a dense model (checked only with experts), to fail when a
  checkpoint or a later launch brought experts."""
  assert "model.moe_impl='bogus'; allowed: auto" in _said(**{"model.moe_impl": "bogus"})
  assert _said(**{"model.moe_impl": "dense"}) == ""


@pytest.mark.parametrize("value", ["None", "none", " null "])
def test_a_system_prompt_spelled_none_is_refused(value):
  """--config.data.system_prompt=None trained with the literal system message "None" (the
  command line's None is text for a string field); "" is no system message."""
  got = _said(**{"data.system_prompt": value})
  assert got == (
    f"invalid config: data.system_prompt={value!r} would be the system message's text; "
    "allowed: '' for no system message, or the message itself"
  )
  assert _said(**{"data.system_prompt": ""}) == _said(**{"data.system_prompt": "Be brief."}) == ""


@pytest.mark.parametrize("field", ["prompt_field", "answer_field"])
def test_an_empty_record_field_name_is_refused(field):
  """--config.data.answer_field= read field '' of every record: every reference answer was
  empty and the run went on after a warning; now it is one config line."""
  for value in ("", "  "):
    got = _said(**{f"data.{field}": value})
    assert got == f"invalid config: data.{field}={value!r}: name a field of the records"
  assert _said(**{f"data.{field}": "question"}) == ""


@pytest.mark.parametrize("k", [64.5, 1e6, 1e300])
def test_an_oversampling_factor_past_its_bound_is_refused_in_a_short_line(k):
  """filtering.oversample=1e300 was refused only by the training split's size, in a line with
  a 300-digit prompt count, and with prompt files (no split size to check) not at all."""
  got = _said(**{"filtering.name": "dynamic_sampling", "filtering.oversample": k})
  assert got == (
    f"invalid config: filtering.oversample={k:g} must be in [1, 64] (it samples ceil(k * P) "
    "prompt groups in every update to keep P)"
  ), got
  assert _said(**{"filtering.name": "dynamic_sampling", "filtering.oversample": 64.0}) == ""


@pytest.mark.parametrize("name", ["tau_pos", "tau_neg"])
def test_a_sapo_temperature_below_its_floor_is_refused(name):
  """SAPO's loss is (4/τ)·σ(τ(r − 1))·A: τ=1e-40 passed (the range was (0, inf)) and gave an
  infinite loss with NaN gradients; τ=1e-30 a loss of 2e30."""
  for tau in (1e-40, 1e-30, 0.0, -1.0, 0.009):
    got = _said(**{"objective.name": "sapo", f"objective.{name}": tau})
    assert got == (
      f"invalid config: objective.{name}={tau} must be >= 0.01 (the loss scales as 4/τ: below "
      "the floor it swamps float32, and at 1e-38 it is inf with NaN gradients)"
    ), got
  assert _said(**{"objective.name": "sapo", f"objective.{name}": 0.01}) == ""


@pytest.mark.parametrize("template", ["plain", "qwen_math", "r1"])
def test_a_system_prompt_for_prompt_files_needs_a_chat_template(template):
  """A system prompt with a template that has no system turn (the default, qwen_math) passed
  every check and raised a ValueError with a traceback when the first prompt was rendered."""
  files = {"data.train_files": "prompts.jsonl", "data.system_prompt": "Be brief."}
  assert _said(**files, **{"data.template": template}) == (
    f"invalid config: data.system_prompt is set but data.template={template!r} has no system "
    "message; allowed: a chat template (chat, qwen_math_chat), or data.system_prompt=''"
  )
  for chat in ("chat", "qwen_math_chat"):
    assert _said(**files, **{"data.template": chat}) == ""
  assert _said(**{**files, "data.template": template, "data.system_prompt": ""}) == ""


def test_an_unknown_template_with_a_system_prompt_is_said_once():
  """data.template='bogus' also said that 'bogus' has no system message."""
  files = {"data.train_files": "prompts.jsonl", "data.system_prompt": "Be brief."}
  assert _said(**files, **{"data.template": "bogus"}) == (
    "invalid config: data.template='bogus'; allowed: chat, plain, qwen_math, qwen_math_chat, r1"
  )


@pytest.mark.parametrize(
  "field, value, why",
  [
    ("advantage.gamma", 0.9, "advantage.name='grpo' (it acts with advantage.name='gae')"),
    ("advantage.lam", 0.9, "advantage.name='grpo' (it acts with advantage.name='gae')"),
    ("advantage.gae_carry_masked", True, "advantage.name='grpo' (it acts with advantage.name='gae')"),
    ("advantage.whiten_variance", "unbiased", "advantage.whiten=False whitens nothing (it acts with advantage.whiten=True)"),
    ("shaping.cache_len", 3, "shaping.name='none' (it acts with shaping.name='soft_overlong')"),
    ("shaping.weight", 2.0, "shaping.name='none' (it acts with shaping.name='soft_overlong')"),
    ("shaping.overlong_in_group_stats", False, "shaping.overlong_filter=False filters nothing (it acts with shaping.overlong_filter=True)"),
    ("filtering.oversample", 3.0, "filtering.name='none' (it acts with filtering.name='dynamic_sampling')"),
    ("aggregation.sum_norm_sequences", False, "aggregation.name='seq_mean_token_mean' (it acts with aggregation.name='seq_mean_token_sum_norm')"),
    ("model.rope_scaling_factor", 2.0, "model.rope_scaling='none' (it acts with model.rope_scaling='linear' or 'llama3')"),
    ("model.rope_low_freq_factor", 0.5, "model.rope_scaling='none' (it acts with model.rope_scaling='llama3')"),
    ("task.digits", 3, "task.name='reverse' does not take it (it acts with task.name in ['addition'])"),
    ("task.numbers", 3, "task.name='reverse' does not take it (it acts with task.name in ['countdown'])"),
    ("task.wrong_traces", 0.5, "task.name='reverse' does not take it (it acts with task.name in ['addition', 'countdown'])"),
    ("sft.batch_size", 32, "sft.steps=0 runs no warm start (it acts with sft.steps > 0)"),
    ("sft.learning_rate", 0.01, "sft.steps=0 runs no warm start (it acts with sft.steps > 0)"),
  ],
)  # fmt: skip
def test_a_setting_the_run_never_reads_is_refused(field, value, why):
  """advantage.gamma under grpo, shaping.weight without soft_overlong, task.digits of reverse,
  sft.* with sft.steps=0 (and the rest) were taken without a word, and a sweep over one
  trained identical arms under different names."""
  got = acting.unused(parse(tiny_config(**{field: value})), [field])
  assert got == [f"{field}={value!r} has no effect: {why}; drop it or set what it acts with"]


@pytest.mark.parametrize(
  "overrides, field",
  [
    ({"advantage.gamma": 1.0}, "advantage.gamma"),  # the default
    ({"advantage.name": "gae", "advantage.lam": 0.9}, "advantage.lam"),
    ({"advantage.whiten": True, "advantage.whiten_variance": "unbiased"}, "advantage.whiten_variance"),
    ({"shaping.name": "soft_overlong", "shaping.weight": 2.0}, "shaping.weight"),
    ({"filtering.name": "dynamic_sampling", "filtering.oversample": 3.0}, "filtering.oversample"),
    ({"model.rope_scaling": "linear", "model.rope_scaling_factor": 2.0}, "model.rope_scaling_factor"),
    ({"task.name": "addition", "task.digits": 3}, "task.digits"),
    ({"task.min_len": 3}, "task.min_len"),
    ({"task.eval_size": 8}, "task.eval_size"),
    ({"sft.steps": 2, "sft.batch_size": 8}, "sft.batch_size"),
  ],
)  # fmt: skip
def test_a_setting_the_run_reads_or_leaves_at_its_default_is_accepted(overrides, field):
  assert acting.unused(parse(tiny_config(**overrides)), [field]) == []


@pytest.mark.parametrize(
  "overrides, said",
  [
    ({"task.min_len": 1, "task.max_len": 1, "sft.steps": 2},
     "sft.batch_size=64 is more than the 8 training problems of task reverse with min_len=1, "
     "max_len=1; allowed: a batch of at most 8, or task settings with a larger problem space"),
    ({"task.name": "addition", "task.digits": 1, "rl.num_prompts": 128, "rl.num_minibatches": 1},
     "rl.num_prompts=128 is more than the 90 training problems of task addition with digits=1; "
     "allowed: a batch of at most 90, or task settings with a larger problem space"),
    ({"task.name": "addition", "task.digits": 1, "rl.num_prompts": 64,
      "filtering.name": "dynamic_sampling"},
     "rl.num_prompts=64 with filtering.oversample=2.0 (128 prompts drawn) is more than the 90 "
     "training problems of task addition with digits=1"),
  ],
)  # fmt: skip
def test_a_batch_larger_than_the_training_split_is_refused(overrides, said):
  """A batch larger than a small task's training split ended in a traceback, `ValueError:
  batch_size must be in [1, 8] ... got 64`, naming neither sft.batch_size nor rl.num_prompts."""
  got = config_problems(**overrides)
  assert got.startswith(f"invalid config: {said}") and "\n" not in got, got


def test_a_batch_the_training_split_holds_is_accepted():
  assert config_problems(**{"task.name": "addition", "task.digits": 1, "rl.num_prompts": 90,
                     "rl.num_minibatches": 1}) == ""  # fmt: skip
  assert config_problems(**{"task.min_len": 1, "task.max_len": 1, "sft.steps": 0}) == ""


@pytest.mark.parametrize("rows, other, where", [("sampling.group_size", "rl.num_prompts=4",
                         "a rollout"), ("train.pass_k", "task.eval_size=16", "an evaluation")])  # fmt: skip
def test_a_batch_past_int32_tokens_is_refused_and_one_at_the_bound_accepted(rows, other, where):
  """sampling.group_size=10**9 (or train.pass_k) ended in a JAX traceback, `OverflowError:
  Python integer 32000000000 out of bounds for int32`, or in numpy's MemoryError while drawing
  the held-out set. The largest batch whose tokens fit int32 is accepted; one row more is one
  line naming the fields."""
  task = build_task(parse(tiny_config()))
  length = task.prompt_len + task.max_new_tokens  # no tool: the task's completion budget
  n = (2**31 - 1) // (int(other.split("=")[1]) * length)
  assert config_problems(**{rows: n, "rl.num_minibatches": 1}) == ""
  said = config_problems(**{rows: n + 1, "rl.num_minibatches": 1})
  total = int(other.split("=")[1]) * (n + 1)
  assert said.startswith(f"invalid config: {other} x {rows}={n + 1} = {total} rows of {length} "
                         f"tokens"), said  # fmt: skip
  assert f"make {total * length} tokens in {where}; allowed: at most 2**31 - 1" in said
  assert "\n" not in said


def test_the_prompts_dynamic_sampling_draws_are_what_the_int32_bound_counts():
  said = config_problems(**{"filtering.name": "dynamic_sampling", "sampling.group_size": 2**28,
                            "rl.num_minibatches": 1})  # fmt: skip
  assert said.startswith("invalid config: ceil(filtering.oversample=2.0 x rl.num_prompts=4) = 8 "
                         f"prompts x sampling.group_size={2**28} = {8 * 2**28} rows"), said  # fmt: skip


def test_more_experts_than_the_grouped_layout_indexes_is_one_line():
  """model.moe_num_experts=10**9 ended in `OverflowError: ... Got <class 'int'> with value
  7000000016` from the grouped matmuls' layout; 2**24 experts is the bound."""
  assert config_problems(**{"model.moe_num_experts": 2**24}) == ""
  said = config_problems(**{"model.moe_num_experts": 2**24 + 1})
  assert said == (
    f"invalid config: invalid model config: model.moe_num_experts={2**24 + 1} must be in "
    f"[0, 2**24 = {2**24}] (0 = dense; the grouped layout pads each expert's rows to a tile of "
    "up to 64 rows and indexes them in int32)"
  ), said


@pytest.mark.parametrize("overrides, said", [
  ({"task.max_len": -1}, "task.max_len=-1 must be in [1, 12]"),
  ({"task.min_len": 99}, "task.min_len=99 must be in [1, 12]"),
  ({"task.min_len": 4, "task.max_len": 3}, "task.min_len=4 must be <= task.max_len=3"),
])  # fmt: skip
def test_a_string_length_out_of_range_is_said_once(overrides, said):
  """task.max_len=-1 also said `task.min_len=2 must be <= task.max_len=-1`: two lines for one
  mistake. The order of the lengths is checked once both are in range."""
  assert _said(**overrides) == f"invalid config: {said}"


def test_a_stack_deeper_than_4096_blocks_is_one_line():
  """model.num_layers=10**9 traced one block after another and never ended, a dry run too."""
  assert config_problems(**{"model.num_layers": 4096}) == ""
  said = config_problems(**{"model.num_layers": 4097})
  assert said == "invalid config: model.num_layers=4097 must be in [1, 4096]"


def test_a_batch_past_the_training_split_is_said_without_the_int32_line():
  said = config_problems(**{"rl.num_prompts": 10**9})
  assert said.startswith("invalid config: rl.num_prompts=1000000000 is more than the ") and (
    "\n" not in said
  ), said


@pytest.mark.parametrize("config, field, value, said", [
  ("ppo", "objective.value_coef", -1.0, "must be > 0 (the value loss's weight: at 0 the critic "
   "never trains, below it unlearns)"),
  ("ppo", "objective.value_coef", 0.0, "must be > 0"),
  ("dapo", "shaping.weight", -0.5, "must be >= 0 (it scales a penalty: below 0 it would pay for "
   "overlong answers)"),
])  # fmt: skip
def test_a_weight_that_turns_a_loss_or_a_penalty_around_is_refused(config, field, value, said):
  """The critic's value_coef=-1 and the overlong penalty's weight=-1 trained without a word:
  the critic away from the returns, the policy towards overlong answers."""
  got = _said_of(config, **{field: value})
  assert got.startswith(f"invalid config: {field}={value} {said}") and "\n" not in got, got


def test_a_penalty_weight_of_0_and_a_positive_value_weight_are_accepted():
  assert _said_of("dapo", **{"shaping.weight": 0.0}) == ""
  assert _said_of("ppo", **{"objective.value_coef": 1e-3}) == ""


@pytest.mark.parametrize("turns", [-1, 0, 1])
def test_too_few_turns_for_a_tool_is_said_once(turns):
  """sampling.max_turns=0 with a tool also said `must be >= 1`, which 1 does not cure."""
  tool = {"task.name": "addition", "sampling.tool": "calculator", "sampling.max_new_tokens": 24}
  assert _said(**tool, **{"sampling.max_turns": turns}) == (
    f"invalid config: sampling.max_turns={turns} with sampling.tool='calculator' leaves no turn "
    "for the tool's answer (max_turns - 1 calls); allowed: 2 or more, or sampling.tool='none'"
  )
  assert _said(**tool, **{"sampling.max_turns": 2}) == ""
  assert _said(**{"sampling.max_turns": turns}) == (
    "" if turns == 1 else f"invalid config: sampling.max_turns={turns} must be >= 1"
  )


def test_a_warm_start_on_prompt_files_is_refused_before_the_files_are_read(tmp_path):
  """sft.steps > 0 (the default 70) with data.train_files was refused only after the files
  were read and their warnings printed; it is now a config error, found before any file is
  opened (a file that does not exist is not reached)."""
  config = tiny_config(**{"data.train_files": str(tmp_path / "absent.jsonl"), "sft.steps": 70})
  with pytest.raises(ConfigError, match=r"sft\.steps=70 must be 0 with data\.train_files"):
    parse(config)
