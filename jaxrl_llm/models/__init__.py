"""Decoder-only transformer policies."""

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.kv_cache import KVCache, init_cache
from jaxrl_llm.models.transformer import ModelOutput, Transformer

__all__ = ["KVCache", "ModelConfig", "ModelOutput", "Transformer", "init_cache"]
