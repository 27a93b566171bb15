"""The config a command line names: `--config=FILE[:SETTING]` loaded (`load`) and its
`--config.SECTION.FIELD=VALUE` overrides checked against it (`check_overrides`), before absl's
config flag parses them (`launch.parse_config`, the trainer's `main`)."""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys

from ml_collections import ConfigDict

from jaxrl_llm.config.fields import ConfigError


def check_overrides(argv: list[str]) -> None:
  """Fails with a clear message when `--config` names two files or a `--config.a.b=v` flag
  names a field the config lacks."""
  paths = _config_paths(argv)
  if len(paths) > 1:
    raise ConfigError(
      f"--config is given {len(paths)} times ({', '.join(paths)}); a run reads one config: "
      "give one --config=FILE[:SETTING] and set fields with --config.SECTION.FIELD=VALUE"
    )
  path = paths[0] if paths else None
  overrides = [a for a in argv if a.startswith(("--config.", "--noconfig."))]
  for a in argv:  # absl's line for an unknown dotted flag says nothing of the form
    head = a.lstrip("-").split("=", 1)[0].split(".", 1)
    named = len(head) == 2 and head[0].isidentifier()  # not a value such as -0.5
    if a.startswith("-") and named and head[0] not in ("config", "noconfig"):
      raise ConfigError(
        f"{a}: no flag {head[0]}.*; config fields are set as --config.SECTION.FIELD=VALUE "
        "(e.g. --config.train.num_steps=100)"
      )
  if path is None and overrides:
    raise ConfigError(
      f"{overrides[0]} overrides a config, and no --config=FILE names one (e.g. "
      "--config=configs/default.py before it)"
    )
  if path is None:
    return
  config = load(path)
  for arg in overrides:
    field = arg.split("=", 1)[0].split(".", 1)[1]
    missing = missing_field(config, field)
    if missing:
      raise ConfigError(f"unknown config field {field!r} in {arg!r}: {missing}")


def _config_paths(argv: list[str]) -> list[str]:
  """The files `--config=FILE` or `--config FILE` (a space, which absl takes) name in `argv`,
  before a bare `--`."""
  paths = []
  for i, arg in enumerate(argv[1:], start=1):
    if arg == "--":
      break
    if arg.startswith("--config="):
      paths.append(arg.split("=", 1)[1])
    elif arg == "--config" and i + 1 < len(argv):
      paths.append(argv[i + 1])
  return paths


def missing_field(config, field: str) -> str | None:
  """None when the dotted `field` names a field of `config`, else which part is missing where,
  and what is allowed there."""
  node, seen = config, []
  for part in field.split("."):
    if not hasattr(node, "keys") or part not in node:
      where = ".".join(seen) or "the top level"
      allowed = sorted(node.keys()) if hasattr(node, "keys") else []
      return f"{where} has no field {part!r}; allowed: {allowed}"
    node, seen = node[part], [*seen, part]
  return None


def load(path: str) -> ConfigDict:
  """The ConfigDict that `--config=path` (FILE.py[:SETTING]) loads; ConfigError naming what is
  wrong with the file or the setting. The file's folder joins the end of `sys.path`, so a
  module beside it (an objective or a reward term of one's own) imports from any working
  directory, in `tools/sweep.py` and in the verifier workers too."""
  file, colon, arg = path.partition(":")
  if colon and not arg:  # ml_collections would call get_config("")
    raise ConfigError(
      f"--config={path} ends in ':' with no setting after it: drop the ':' or name a setting"
    )
  if not file.endswith(".py"):
    raise ConfigError(f"--config={path}: a config is a Python file (FILE.py[:SETTING])")
  folder = os.path.dirname(os.path.abspath(file))
  if folder not in sys.path:
    sys.path.append(folder)
  try:
    spec = importlib.util.spec_from_file_location("_jaxrl_llm_config", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if arg and not inspect.signature(module.get_config).parameters:
      raise ConfigError(
        f"{file} has no settings to choose (its get_config takes none): drop ':{arg}' from "
        f"--config={path}"
      )
    config = module.get_config(arg) if arg else module.get_config()
  except ConfigError:
    raise
  except Exception as e:
    raise ConfigError(f"cannot load config file {file!r}: {e}") from None
  if not isinstance(config, ConfigDict):
    raise ConfigError(
      f"{file}: get_config() returned a {type(config).__name__}; it must return the "
      "ml_collections.ConfigDict of configs/default.py's layout"
    )
  return config
