"""Decoder-only transformer policies."""

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.transformer import KVCache, Transformer, init_cache

__all__ = ["KVCache", "ModelConfig", "Transformer", "init_cache"]
