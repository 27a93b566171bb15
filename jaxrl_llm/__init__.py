"""jaxrl_llm: reinforcement learning on language models in JAX, one jitted program per update."""

__version__ = "0.1.0"
