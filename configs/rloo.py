"""Recipe `rloo` of objectives.md §10 on the built-in task (settings in jaxrl_llm/config/recipes.py)."""

from jaxrl_llm.config import recipes


def get_config():
  """The default config with the `rloo` recipe applied."""
  return recipes.get_config("rloo")
