"""The typed settings tree: one frozen dataclass per config section.

fields.py    the Section mixin: coercion from ml-collections values, field comments, checks,
             and `setting`: a field's metadata (may a pack vary it, does a change block a
             resume, is it an HParams column, does it only end or pace one invocation), read
             through `tagged` and `blocks_resume`
learner.py   the learner's sections (rl, advantage, objective, ..., filtering) and `Settings`
sections.py  task, data, model, sampling, optim, sft, train, mesh
tree.py      `Config` (the whole tree), `parse` (ConfigDict -> Config, once, at the entry
             point), `default_config` (the embedded default, generated from the dataclasses)
             and `reference` (docs/config.md's config reference)
checks.py    the checks that span sections or need the devices, the task or the model
command_line.py  the config a command line names: the file loaded, its overrides checked
"""

from jaxrl_llm.config.checks import check
from jaxrl_llm.config.fields import (
  CONSTANT,
  HPARAM,
  INVOCATION,
  PER_RUN,
  STATE,
  SWITCH,
  TRACED,
  ConfigError,
  traced_dtype,
)
from jaxrl_llm.config.learner import Settings
from jaxrl_llm.config.tree import (
  Config,
  blocks_resume,
  default_config,
  parse,
  reference,
  tagged,
  typed,
)

get_config = default_config  # configs/default.py's entry: the embedded default experiment

__all__ = [
  "CONSTANT",
  "HPARAM",
  "INVOCATION",
  "PER_RUN",
  "STATE",
  "SWITCH",
  "TRACED",
  "Config",
  "ConfigError",
  "Settings",
  "blocks_resume",
  "check",
  "default_config",
  "get_config",
  "parse",
  "reference",
  "tagged",
  "traced_dtype",
  "typed",
]
