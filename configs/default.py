"""The embedded default: GRPO (no KL) teaches a tiny transformer to reverse strings on a CPU.

Every field is defined and commented in its section's dataclass (`jaxrl_llm/config/`).
"""

from jaxrl_llm.config import get_config

__all__ = ["get_config"]
