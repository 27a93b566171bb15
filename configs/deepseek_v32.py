"""Recipe `deepseek_v32` of objectives.md §10 on the built-in task (settings in jaxrl_llm/config/recipes.py)."""

from jaxrl_llm.config import recipes


def get_config():
  """The default config with the `deepseek_v32` recipe applied."""
  return recipes.get_config("deepseek_v32")
