"""Every command the docs pages give still parses as written.

The commands are read from the pages' ```bash blocks and inline `python ...` / `pip install ...`
spans. Nothing is run: a trainer command (`python -m jaxrl_llm.main`) must name a config file
that is there, fields the config has (`launch.parse_config`, then `launch.parse_acting`: each
override typed and read by the run) and flags the trainer defines; a tool command (`python
tools/X.py`) must name a tool whose own parser takes its flags (its `main(argv)` is called up to
its parser, which then parses them; the sweep's, the memory table's and the benchmarks' own
checks of their grid and `--set` fields follow); `python -m pytest -m M` a registered marker;
`pip install -e '.[X]'` an extra of pyproject.toml. A renamed flag, field, file or extra fails
here, naming the page and line.

Placeholders: `[--flag]` is the flag; `...` in a tool command stands for the arguments of the
page's command before it with the same tool, elsewhere for nothing; a one-letter capital value
(`--runs=N`) for a number.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import re
import shlex
import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "tools"))

PAGES = ("running", "sweeps", "training", "data_and_checkpoints", "tasks", "tensorboard", "tests")


def _logical_lines(block: str) -> list[tuple[int, str]]:
  """(offset in lines, line) of a bash block, continuation lines joined."""
  out, start, held = [], 0, ""
  for i, line in enumerate(block.splitlines()):
    if not held:
      start = i
    if line.rstrip().endswith("\\"):
      held += line.rstrip()[:-1] + " "
      continue
    out.append((start, held + line))
    held = ""
  return out


def _argv(text: str) -> list[str]:
  """A command's words: comments, leading VAR=value assignments and `[ ]` around optional
  flags dropped, one-letter capital values made numbers."""
  words = shlex.split(text, comments=True)
  while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
    words = words[1:]
  words = [w[1:-1] if w.startswith("[") and w.endswith("]") else w for w in words]
  return [re.sub(r"^(--\w+)=[A-Z]$", r"\1=2", w) for w in words]


def _commands() -> list[tuple[str, list[str]]]:
  """(where: page:line, argv) of every command the pages give."""
  found = []
  for page in PAGES:
    text = (REPO / "docs" / f"{page}.md").read_text()
    for m in re.finditer(r"```bash\n(.*?)```", text, re.S):
      first = text[: m.start(1)].count("\n") + 1
      for offset, line in _logical_lines(m.group(1)):
        argv = _argv(line)
        if argv and argv[0] in ("python", "pip"):
          found.append((f"{page}.md:{first + offset}", argv))
    prose = re.sub(r"```.*?```", lambda b: "\n" * b.group(0).count("\n"), text, flags=re.S)
    for m in re.finditer(r"`((?:[A-Z_]+=\S* )*(?:python|pip install) [^`]+)`", prose):
      found.append((f"{page}.md:{prose[: m.start()].count(chr(10)) + 1}", _argv(m.group(1))))
  return _fill_ellipses(found)


def _program(argv: list[str]) -> str:
  return " ".join(argv[:3] if argv[1] == "-m" else argv[:2])


def _fill_ellipses(found):
  """`python tools/X.py ... --flag`: `...` becomes the arguments of the same page's command
  before it with tools/X.py; elsewhere `...` is dropped."""
  out, last = [], {}
  for where, argv in found:
    program, page = _program(argv), where.split(":")[0]
    if "..." in argv:
      earlier = last.get((page, program), []) if program.startswith("python tools/") else []
      i = argv.index("...")
      argv = argv[:i] + earlier + argv[i + 1 :]
    last[(page, program)] = argv[len(program.split()) :]
    out.append((where, argv))
  return out


COMMANDS = _commands()


class _Parsed(Exception):
  """A tool reached its parser: the parser, the words it was given, and whether unknown ones
  may stay (`parse_known_args`)."""

  def __init__(self, parser, args, known: bool):
    super().__init__("parsed")
    self.parser, self.args, self.known = parser, list(args), known


class _Working(Exception):
  """A tool reached its work (its backend started) past its own flag checks."""


def _config_check(argv: list[str]) -> None:
  """The trainer's config of `argv`'s `--config=FILE` and `--config.a.b=v` words: the file is
  there, every field exists, every value is typed and read by the run."""
  from jaxrl_llm import launch

  config = next((w for w in argv if w.startswith("--config=")), None)
  if config is None:
    assert not [w for w in argv if w.startswith(("--config.", "--noconfig."))], argv
    return
  file = config.split("=", 1)[1].partition(":")[0]
  assert (REPO / file).is_file(), f"{file} is not a file of the repository"
  words = ["prog", config, *(w for w in argv if w.startswith(("--config.", "--noconfig.")))]
  launch.parse_acting(launch.parse_config(words), launch.overridden_fields(words))


def _check_trainer(argv: list[str]) -> None:
  """`python -m jaxrl_llm.main ...`: its config, and each other flag one the trainer defines
  with a value of its type."""
  from absl import flags

  import jaxrl_llm.main  # noqa: F401  (defines the trainer's flags)

  ours = {f.name: f for f in flags.FLAGS.get_flags_for_module("jaxrl_llm.main")}
  for word in argv:
    if word.startswith(("--config", "--noconfig.")):
      continue
    assert word.startswith("--"), f"the trainer takes no argument {word!r}"
    name, eq, value = word[2:].partition("=")
    flag = ours[name] if name in ours else ours.get(name.removeprefix("no"))
    assert flag is not None, f"the trainer has no flag --{name}; it has {sorted(ours)}"
    if eq:
      copy.deepcopy(flag).parse(value)
  _config_check(argv)


# A tool's own checks after its parser, as its main makes them before any work.
def _after_sweep(module, args, tmp_path):
  args.root = str(tmp_path / "root")
  module._checked_runs(args)


_AFTER_PARSE = {
  "sweep": _after_sweep,
  "memory_table": lambda m, args, _: m.check_configs(args, m.check_args(args)),
  "bench": lambda m, args, _: args.shape and m.shape_config(args.shape, args.set),
  "bench_pack": lambda m, args, _: m.base_config(args.shape, args.set),
}


def _check_tool(script: str, argv: list[str], tmp_path, monkeypatch, capsys) -> None:
  """`python tools/X.py ...`: the tool's main reaches its parser, which takes `argv`."""
  from jaxrl_llm import backend

  path = REPO / script
  assert path.is_file(), f"{script} is not a file of the repository"
  if script.startswith("tests/"):  # a test helper run by hand: its file is all there is
    return
  module = importlib.import_module(path.stem)
  rest = []
  if path.stem == "launch_local" and "--" in argv:  # its command is checked as a command
    rest, argv = argv[argv.index("--") + 1 :], argv[: argv.index("--")]
  parse_known = argparse.ArgumentParser.parse_known_args

  def reached(known):
    def stop(self, args=None, namespace=None):
      raise _Parsed(self, sys.argv[1:] if args is None else args, known)

    return stop

  def working(*args, **kwargs):
    raise _Working

  with monkeypatch.context() as m:
    m.setattr(argparse.ArgumentParser, "parse_args", reached(False))
    m.setattr(argparse.ArgumentParser, "parse_known_args", reached(True))
    m.setattr(backend, "choose", working)
    try:
      code = module.main(argv)
      parsed = None
    except _Parsed as p:
      parsed = p
    except _Working:
      parsed, code = None, 0
    except SystemExit as e:
      parsed, code = None, e.code
  if parsed is None:
    assert code == 0, f"{script} refused {argv}: {capsys.readouterr().err.strip()}"
  else:
    try:
      args, extra = parse_known(parsed.parser, parsed.args)
    except SystemExit:
      pytest.fail(f"{script} refused {argv}: {capsys.readouterr().err.strip()}")
    overrides = [w for w in extra if w.startswith(("--config.", "--noconfig."))]
    assert extra == (overrides if parsed.known else []), f"{script} does not take {extra}"
    if path.stem in _AFTER_PARSE:
      _AFTER_PARSE[path.stem](module, args, tmp_path)
  _config_check(argv)
  if rest:
    _check(rest, tmp_path, monkeypatch, capsys)


def _check_pytest(argv: list[str]) -> None:
  """`python -m pytest -m M`: M is a marker pyproject.toml registers."""
  tomllib = pytest.importorskip("tomllib")
  conf = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
  markers = {m.split(":")[0] for m in conf["markers"]}
  for i, word in enumerate(argv):
    if word == "-m":
      assert set(re.findall(r"\w+", argv[i + 1])) - {"not", "and", "or"} <= markers, argv


def _check_pip(argv: list[str]) -> None:
  """`pip install -e '.[X,Y]'`: each an extra of pyproject.toml."""
  tomllib = pytest.importorskip("tomllib")
  extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
  for word in argv:
    if m := re.fullmatch(r"\.\[([\w,]+)\]", word):
      missing = set(m.group(1).split(",")) - set(extras)
      assert not missing, f"pyproject.toml has no extra {missing}; it has {sorted(extras)}"


def _check(argv: list[str], tmp_path, monkeypatch, capsys) -> None:
  if argv[0] == "pip":
    _check_pip(argv)
  elif argv[1:3] == ["-m", "jaxrl_llm.main"]:
    _check_trainer(argv[3:])
  elif argv[1:3] == ["-m", "pytest"]:
    _check_pytest(argv[3:])
  else:
    assert argv[1].endswith(".py"), f"not a command this test knows: {argv}"
    _check_tool(argv[1], argv[2:], tmp_path, monkeypatch, capsys)


def test_every_page_gives_commands():
  """The extraction finds commands on every page (a changed block format would check none)."""
  assert {where.split(".md")[0] for where, _ in COMMANDS} == set(PAGES)


@pytest.mark.parametrize(
  "argv", [argv for _, argv in COMMANDS], ids=[f"{w} {_program(a)}" for w, a in COMMANDS]
)
def test_the_command_parses(argv, tmp_path, monkeypatch, capsys):
  """The command's program, flags, config file and fields exist as the page writes them."""
  _check(argv, tmp_path, monkeypatch, capsys)
