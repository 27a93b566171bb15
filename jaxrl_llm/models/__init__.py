"""Decoder-only transformer policies."""

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.transformer import KVCache, ModelOutput, Transformer, init_cache

__all__ = ["KVCache", "ModelConfig", "ModelOutput", "Transformer", "init_cache"]
