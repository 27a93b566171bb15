"""Every setting said once: `tools/settings_homes.py` counts the config settings that have a
second home in the package (a dotted name as a string, a list of field names, a default
written twice), and the method itself is tested on small sources."""

import importlib.util
import sys
import textwrap

from conftest import REPO


def _load(name):
  spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module  # dataclasses resolve the module of the classes it declares
  spec.loader.exec_module(module)
  return module


homes = _load("settings_homes")

TABLE = [
  ("seed", 0),
  ("task.name", "reverse"),
  ("sampling.temperature", 1.0),
  ("sampling.top_k", 0),
  ("sampling.top_p", 1.0),
  ("kl.name", "k3"),
  ("kl.beta", 0.0),
  ("objective.clip_low", None),
  ("objective.clip_high", None),
  ("model.dtype", "float32"),
  ("model.lora_rank", 0),
  ("model.lora_alpha", 16.0),
]


def _found(source: str, classes=None) -> dict[str, list[int]]:
  """{setting: lines} of the second homes `source` gives the settings of TABLE."""
  found = homes.second_homes({"m.py": textwrap.dedent(source)}, TABLE, classes)
  out: dict[str, list[int]] = {}
  for home in found:
    assert home.path == "m.py"
    out.setdefault(home.setting, []).append(home.line)
  return out


def test_no_setting_has_a_second_home():
  """Outside jaxrl_llm/config/ and models/config.py nothing names a setting, lists field
  names or writes a setting's default again (`python tools/settings_homes.py` lists them)."""
  found, total = homes.count()
  assert total == len(homes.settings()) > 120
  assert [str(h) for h in found] == []
  assert len({h.setting for h in found}) == 0


def test_a_list_of_field_names_is_a_second_home():
  found = _found(
    """
    PER_RUN = ("temperature", "top_p")  # 2: two sampling fields
    _SWITCHES = ("top_k",)  # 3: one field, an ALL_CAPS constant
    flags = {"temperature": True, "top_k": False}  # 4: a table keyed by field names
    spread = ("top_p", "top_k", *PER_RUN)  # 5
    one = ("top_k",)  # not a constant
    hf = ("temperature", "hidden_size")  # another vocabulary
    kw = {"temperature": t, "top_p": p}  # keyword arguments in another spelling
    mixed = ("temperature", "beta")  # one field of each of two sections
    """
  )
  assert found == {
    "sampling.temperature": [2, 4],
    "sampling.top_k": [3, 4, 5],
    "sampling.top_p": [2, 5],
  }


def test_fields_picked_by_name_are_a_list_of_field_names():
  source = """
    import dataclasses
    LORA = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name.startswith("lora_"))
    """
  assert _found(source, {"ModelConfig": "model"}) == {
    "model.lora_rank": [3],
    "model.lora_alpha": [3],
  }
  assert _found(source) == {}  # a class that is not a section's


def test_a_dotted_name_as_a_string_is_a_second_home():
  found = _found(
    '''
    """The docstring may mention kl.beta."""
    def f(values, x):
      """And so may this one: sampling.top_p."""
      if "kl.beta" in values:  # 5
        raise ValueError(f"kl.beta={x} must be >= 0; kl.beta")  # a message, for a reader
      return values.get("sampling.top_p"), "kl.beta > 0", "kl.bet"  # 7
    '''
  )
  assert found == {"kl.beta": [5], "sampling.top_p": [7]}


def test_a_default_written_twice_is_a_second_home():
  found = _found(
    """
    import dataclasses
    TOP_P = 1.0

    @dataclasses.dataclass
    class Sampler:
      temperature: float = 1  # 7: 1 == 1.0
      top_k: int = dataclasses.field(default=0)  # 8
      name: str = "k3"  # a choice's own name: not a default
      greedy: bool = False

    class Mirror:
      top_p: float = TOP_P  # 13: a module constant bound to the default
      beta = 0.0  # not annotated: not a field

    class Family:  # the families table: another vocabulary
      top_p: float = 1.0

    def sample(x, top_p=TOP_P, *, top_k=0, seed=0):  # a function's own API default
      return x
    """
  )
  assert found == {
    "sampling.temperature": [7],
    "sampling.top_k": [8],
    "sampling.top_p": [13],
  }


def test_mesh_axis_names_in_sharding_are_the_axes_not_settings():
  table = [("mesh.data", -1), ("mesh.fsdp", 1), ("mesh.model", 1)]
  source = 'AXES = ("data", "fsdp", "model")\n'
  found = homes.second_homes({"jaxrl_llm/sharding.py": source}, table)
  assert found == []
  elsewhere = homes.second_homes({"jaxrl_llm/run/x.py": source}, table)
  assert sorted(h.setting for h in elsewhere) == ["mesh.data", "mesh.fsdp", "mesh.model"]


def test_a_registered_objective_declares_its_own_hyperparameters():
  """The objective's hyperparameters are its registered objectives' keyword parameters: the
  registration and the signature are their home; the same names elsewhere are not."""
  found = _found(
    """
    DOCS = {"clip_low": "low width", "clip_high": "high width"}

    @register_objective("ppo", docs=DOCS, check=lambda h: ("clip_low", "clip_high"))
    def ppo(logp, *, clip_low=None, clip_high=None):
      return logp

    NOT_PER_RUN = ("clip_low", "clip_high")  # 8

    class Helper:
      clip_low: float | None = None  # 11
    """
  )
  assert found == {"objective.clip_low": [8, 11], "objective.clip_high": [8]}


def test_the_package_sources_leave_out_the_declarations_homes():
  paths = set(homes.package_sources())
  assert "jaxrl_llm/sampling.py" in paths and "jaxrl_llm/run/pack.py" in paths
  assert not [p for p in paths if p.startswith("jaxrl_llm/config/")]
  assert "jaxrl_llm/models/config.py" not in paths


def test_the_command_prints_each_home_and_the_count_and_max_fails_above_it(monkeypatch, capsys):
  two = [
    homes.SecondHome("jaxrl_llm/a.py", 3, "kl.beta", "string constant 'kl.beta'"),
    homes.SecondHome("jaxrl_llm/b.py", 9, "kl.beta", "string constant 'kl.beta'"),
    homes.SecondHome("jaxrl_llm/b.py", 4, "seed", "default seed=0 written twice"),
  ]
  monkeypatch.setattr(homes, "count", lambda: (two, 145))
  assert homes.main([]) == 0
  out = capsys.readouterr().out.splitlines()
  assert out == [
    "kl.beta: jaxrl_llm/a.py:3 string constant 'kl.beta'",
    "kl.beta: jaxrl_llm/b.py:9 string constant 'kl.beta'",
    "seed: jaxrl_llm/b.py:4 default seed=0 written twice",
    "2 of 145 settings have a second home",
  ]
  assert homes.main(["--max", "2"]) == 0
  assert homes.main(["--max", "1"]) == 1


def test_a_negative_max_is_one_line(capsys):
  """--max=-1 ran the count and exited 1 ("more than --max=-1"); it is refused, exit 2."""
  assert homes.main(["--max=-1"]) == 2
  assert capsys.readouterr().err == "error: --max=-1: give a count of settings >= 0\n"
