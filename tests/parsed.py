"""The library's entry points as the tests call them: each `parse`s an experiment ConfigDict
first (the library takes a typed `Config`; a `Config` passes through)."""

from __future__ import annotations

from typing import Any

from jaxrl_llm import plan as plan_lib
from jaxrl_llm import run
from jaxrl_llm.config import parse
from jaxrl_llm.run import pack, packed


def build(config: Any, **kwargs):
  """`run.build` of a parsed `config`."""
  return run.build(parse(config), **kwargs)


def train_and_evaluate(config: Any, workdir: str, **kwargs):
  """`run.train_and_evaluate` of a parsed `config`."""
  return run.train_and_evaluate(parse(config), workdir, **kwargs)


def build_pack(configs, names=None, **kwargs):
  """`run.pack.build_pack` of parsed `configs`."""
  return pack.build_pack([parse(c) for c in configs], names, **kwargs)


def train_pack(configs, root: str, **kwargs):
  """`run.packed.train_pack` of parsed `configs`."""
  return packed.train_pack([parse(c) for c in configs], root, **kwargs)


def take_out(configs, root: str, name: str, workdir: str, **kwargs):
  """`run.packed.take_out` of parsed `configs`."""
  return packed.take_out([parse(c) for c in configs], root, name, workdir, **kwargs)


def plan(config: Any, *args, **kwargs):
  """`plan.plan` of a parsed `config`."""
  return plan_lib.plan(parse(config), *args, **kwargs)
