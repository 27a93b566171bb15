"""`Config`, the typed settings tree of one run, and `parse`, which builds it from the user's
ml-collections ConfigDict once, at the entry point. Nothing below the entry point reads a
ConfigDict: every module gets the sections (or the one value) it needs from the tree."""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any

import ml_collections
from ml_collections.config_dict import FieldReference, placeholder

from jaxrl_llm.config.fields import (
  CONSTANT,
  PER_RUN,
  STATE,
  TRACED,
  ConfigError,
  coerce,
  field_docs,
  invalid,
  need,
  setting,
  tag_matches,
)
from jaxrl_llm.config.learner import (
  AdvantageSettings,
  AggregationSettings,
  CorrectionSettings,
  FilteringSettings,
  KLSettings,
  ObjectiveSettings,
  ReplaySettings,
  RLSettings,
  Settings,
  ShapingSettings,
)
from jaxrl_llm.config.sections import (
  DataSettings,
  MeshSettings,
  ModelSettings,
  OptimSettings,
  SamplingSettings,
  SFTSettings,
  TaskSettings,
  TrainSettings,
)


@dataclasses.dataclass(frozen=True)
class Config:
  """Every setting of a run: one frozen section per config section (fields, defaults,
  comments and range checks live in the section's dataclass)."""

  seed: int = setting(
    0, per_run=STATE, hparam=True
  )  # one PRNG key per run, in [0, 2**32); step keys are fold_in(key, step)
  task: TaskSettings = TaskSettings()
  data: DataSettings = DataSettings()
  model: ModelSettings = ModelSettings()
  sampling: SamplingSettings = SamplingSettings()
  rl: RLSettings = RLSettings()
  advantage: AdvantageSettings = AdvantageSettings()
  objective: ObjectiveSettings = ObjectiveSettings()
  aggregation: AggregationSettings = AggregationSettings()
  correction: CorrectionSettings = CorrectionSettings()
  kl: KLSettings = KLSettings()
  shaping: ShapingSettings = ShapingSettings()
  replay: ReplaySettings = ReplaySettings()
  filtering: FilteringSettings = FilteringSettings()
  optim: OptimSettings = OptimSettings()
  sft: SFTSettings = SFTSettings()
  train: TrainSettings = TrainSettings()
  mesh: MeshSettings = MeshSettings()

  @classmethod
  def sections(cls) -> dict[str, type]:
    """{section name: its dataclass}, in the config's order."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.name != "seed"}

  @property
  def learner(self) -> Settings:
    """The learner's settings (the sections the fused step is built from)."""
    weights = tuple(sorted(self.task.reward_weights))
    return Settings(**{n: getattr(self, n) for n in Settings.sections()}, reward_weights=weights)

  @property
  def uses_files(self) -> bool:
    """Whether prompts come from files (host verifiers) rather than the built-in task."""
    return bool(self.data.train_files)

  @property
  def sampled_prompts(self) -> int:
    """Prompts drawn per RL update: P, or ceil(k·P) under dynamic sampling (§7)."""
    return self.learner.sampled_prompts

  @property
  def updates_per_step(self) -> int:
    """Optimiser updates one RL step makes: rl.num_epochs × rl.num_minibatches."""
    return self.rl.num_epochs * self.rl.num_minibatches

  @property
  def schedule_updates(self) -> int:
    """The learning-rate schedule's length: train.num_steps × `updates_per_step`."""
    return self.train.num_steps * self.updates_per_step

  def to_dict(self) -> dict[str, Any]:
    """The tree as the user's config writes it (the JSON of `config.json`)."""
    return {"seed": self.seed} | {n: getattr(self, n).to_dict() for n in self.sections()}

  def flat(self) -> dict[str, Any]:
    """{dotted field: value} of every field (mappings such as the reward weights expanded)."""
    out: dict[str, Any] = {"seed": self.seed}
    for name in self.sections():
      for key, value in getattr(self, name).to_dict().items():
        items = value.items() if isinstance(value, dict) else [(None, value)]
        out |= {".".join(filter(None, (name, key, sub))): v for sub, v in items}
    return out

  def to_json(self) -> str:
    """`to_dict` as sorted JSON (the same text in every process of a job)."""
    return json.dumps(self.to_dict(), sort_keys=True)

  def value(self, path: str) -> Any:
    """The value of a dotted field (`objective.clip_high`); an objective's hyperparameter is
    resolved to what the selected objective uses."""
    if path == "seed":
      return self.seed
    section, name = path.split(".", 1)
    if section == "objective" and name in self.objective.hyperparameters:
      return self.objective.hyperparameters[name]
    value = getattr(self, section).to_dict()
    for key in name.split("."):  # a mapping field's entry: task.reward_weights.correct
      value = value[key]
    return value

  def step_values(self, *, constants: bool = True) -> dict[str, int | float]:
    """{dotted field: value} of every per-run field this run's step reads (`PER_RUN` TRACED:
    the selected objective's own hyperparameters and every other section's) that is not 0,
    since a traced 0 would turn its term on; without `constants`, less those a single run
    compiles in as constants (`CONSTANT`)."""
    own = {f"objective.{k}" for k in self.objective.hyperparameters}
    skip = () if constants else tagged(CONSTANT)
    return {
      f: self.value(f)
      for f in tagged(PER_RUN, TRACED)
      if (f in own or not f.startswith("objective.")) and f not in skip and self.value(f)
    }

  def errors(self) -> list[str]:
    """Every section's own range-check messages, then those across sections."""
    out = need(0 <= self.seed < 2**32, f"seed={self.seed} must be in [0, 2**32)")
    out += [e for n in self.sections() for e in getattr(self, n).errors()]
    if self.uses_files:  # said before any file is read
      sft = self.sft.steps
      out += need(
        sft == 0, f"sft.steps={sft} must be 0 with data.train_files (no warm start on files)"
      )
    return out + self._file_reward_errors()

  def _file_reward_errors(self) -> list[str]:
    """Every weighted reward term is one the task scores: with prompt files a host verifier, or
    `correct` (the verifier `data.correct_term` names), each with the optional package it needs;
    without, a built-in verifier's term (`tasks.base.REWARD_TERMS`)."""
    from jaxrl_llm.data import verifiers  # light; imported here to keep this lean

    known = {"correct", *verifiers.REWARD_FNS}
    used = [k for k, w in self.task.reward_weights if w]
    if not self.uses_files:
      from jaxrl_llm.data.tasks.base import REWARD_TERMS  # the built-in verifiers' terms

      return (
        [
          f"task.reward_weights names {', '.join(repr(k) for k in used if k not in REWARD_TERMS)}, "
          f"which the built-in task {self.task.name!r} does not score; allowed: "
          f"{', '.join(REWARD_TERMS)}"
        ]
        if set(used) - set(REWARD_TERMS)
        else []
      )
    if [k for k in used if k not in known]:
      return [
        f"task.reward_weights names {', '.join(repr(k) for k in used if k not in known)}, which "
        f"is not a host verifier (data.train_files is set); allowed: correct "
        f"(= data.correct_term), {', '.join(sorted(verifiers.REWARD_FNS))}"
      ]
    named = {self.data.correct_term: "correct"}  # defines accuracy, weighted or not
    named |= {k: k for k in used if k != "correct"}
    lost = {t: why for t in named if (why := verifiers.unpicklable(verifiers.REWARD_FNS[t]))}
    if lost:  # put in REWARD_FNS by hand: the workers could not receive it
      return [
        f"reward term {t!r} cannot reach the verifier worker processes ({why}); register a "
        "module-level function with verifiers.register_reward (docs/data_and_checkpoints.md)"
        for t, why in lost.items()
      ]
    other = sorted(set(verifiers.REWARD_FNS) - set(verifiers.NEEDS_PACKAGE))
    return [
      f"{'data.correct_term=' if k == 'correct' else 'task.reward_weights.'}{term}: the "
      f"verifier's optional package is not installed: {verifiers.missing_package(term)}; or "
      f"use another verifier: {', '.join(other)}"
      for term, k in named.items()
      if verifiers.missing_package(term)
    ]


def tagged(key: str, value: Any = None) -> tuple[str, ...]:
  """The dotted names of every setting whose declaration tags it `key` (`config.fields`:
  PER_RUN, SWITCH, HPARAM, INVOCATION; the model's "numerics"), to `value` if given, in config order."""
  top = [f.name for f in dataclasses.fields(Config) if tag_matches(f, key, value)]  # seed
  out = [name for name in top if name not in Config.sections()]
  for name, cls in Config.sections().items():
    out += [f"{name}.{field}" for field in cls.tagged(key, value)]
  return tuple(out)


def blocks_resume(path: str) -> bool:
  """Whether a changed value of setting `path` (`section.field`) blocks resuming a workdir
  without train.resume_changed (`Section.blocks_resume`)."""
  section, _, name = path.partition(".")
  cls = Config.sections().get(section)
  return cls is not None and cls.blocks_resume(name)


def typed(config: Any, where: str) -> Config:
  """`config` if it is a `Config`; a TypeError naming `where` otherwise (library functions take
  the typed tree: the entry point, tools and tests `parse` a ConfigDict once)."""
  if not isinstance(config, Config):
    raise TypeError(
      f"{where} takes a jaxrl_llm.config.Config, got {type(config).__name__}: "
      "parse an experiment ConfigDict first (jaxrl_llm.config.parse)"
    )
  return config


def check_required(config: ml_collections.ConfigDict) -> None:
  """Fails naming every field an experiment file left as "REQUIRED" (paths the user must give)."""
  missing = []

  def visit(node, prefix):
    for key, value in node.items():
      if hasattr(value, "items"):
        visit(value, f"{prefix}{key}.")
      elif value == "REQUIRED":
        missing.append(f"{prefix}{key}")

  visit(config, "")
  if missing:
    flags = " ".join(f"--config.{m}=..." for m in missing)
    raise ConfigError(f"this config needs {', '.join(missing)}; pass {flags}")


def parse(config: ml_collections.ConfigDict | Config) -> Config:
  """The typed tree of an experiment ConfigDict, range-checked section by section; raises
  ConfigError listing every problem (before anything is built). A `Config` is returned as is."""
  if isinstance(config, Config):
    return config
  check_required(config)
  unknown = sorted(set(config.keys()) - {"seed", *Config.sections()})
  errors = [f"unknown config section(s) {unknown}; allowed: {sorted(Config.sections())}"]
  errors = errors if unknown else []
  try:
    seed = coerce("int", config.seed, "seed")
  except ValueError as e:
    seed, errors = 0, [*errors, str(e)]
  sections = {}
  for name, cls in Config.sections().items():
    try:
      sections[name] = cls.from_section(config[name])
    except (KeyError, TypeError, ValueError) as e:
      message = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
      errors.append(f"config section {name!r}: missing" if isinstance(e, KeyError) else message)
  if errors:
    raise invalid(errors)
  tree = Config(seed=seed, **sections)
  errors = tree.errors()
  if errors:
    raise invalid(errors)
  return tree


def default_config() -> ml_collections.ConfigDict:
  """The embedded default experiment, generated from the dataclasses' defaults (unset fields
  are typed placeholders, so `--config.objective.clip_high=0.28` is accepted)."""
  tree = Config()
  out = ml_collections.ConfigDict()
  out.seed = tree.seed
  for name, cls in Config.sections().items():
    values = getattr(tree, name).to_dict()
    kinds = _kinds(name, cls)
    either = {f.name for f in dataclasses.fields(cls) if str(f.type) == "int | str"}
    section = ml_collections.ConfigDict()
    for key, value in values.items():
      if key in either:  # a number or a word (auto): not type-checked against the default's
        value = FieldReference(value, field_type=object)
      elif value is None:
        value = placeholder(kinds[key])
      elif isinstance(value, dict):
        value = ml_collections.ConfigDict(value)
      section[key] = value
    out[name] = section
  return out


def _kinds(name: str, cls: type) -> dict[str, type]:
  """{field: value type} of a section (objective: its registered hyperparameters' types)."""
  if name == "objective":
    from jaxrl_llm import objectives

    return objectives.hyperparameter_kinds()
  return cls.kinds()


def reference() -> list[tuple[str, Any, str]]:
  """(field, default, comment) of every config field: docs/config.md's config reference."""
  from jaxrl_llm import objectives

  tree, rows = Config(), [("seed", 0, field_docs(Config)["seed"])]
  for name, cls in Config.sections().items():
    docs = cls.docs()
    for key, value in getattr(tree, name).to_dict().items():
      doc = docs.get(key) or (objectives.hyperparameter_doc(key) if name == "objective" else "")
      rows.append((f"{name}.{key}", value, doc))
  return rows


def reference_markdown() -> str:
  """The config reference as a markdown table (docs/config.md's, kept equal by a test)."""
  rows = ["| field | default | meaning |", "|---|---|---|"]
  for field, default, doc in reference():
    shown = json.dumps(default, ensure_ascii=False) if default is not None else "unset"
    meaning = doc.replace("|", "\\|")  # a literal bar inside a table cell
    rows.append(f"| `{field}` | `{shown}` | {meaning} |")
  return "\n".join(rows)
