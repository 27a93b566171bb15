"""The embedded default: GRPO (no KL) teaches a tiny transformer to reverse strings on a CPU.

Every field is defined and commented in `jaxrl_llm/default_config.py`.
"""

from jaxrl_llm.default_config import get_config

__all__ = ["get_config"]
