"""`moe_rspo`: see jaxrl_llm/config/recipes.py (spec §9-§10) for its settings."""

from jaxrl_llm.config import recipes


def get_config():
  """The default config with the `moe_rspo` settings applied."""
  return recipes.get_config("moe_rspo")
