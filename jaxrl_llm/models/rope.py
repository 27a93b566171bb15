"""Rotary position embeddings (half-split convention) and their scaled frequencies."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.models.config import ModelConfig

__all__ = ["rope", "rope_inv_freq"]


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray | None:
  """Scaled RoPE inverse frequencies [Dh/2] (float32), or None for plain RoPE.

  `linear` divides every frequency by the factor; `llama3` divides the low frequencies by it,
  keeps the high ones and interpolates in between (as Llama 3.1 and Hugging Face do).
  """
  if cfg.rope_scaling == "none":
    return None
  dh = cfg.head_dim
  inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, dh, 2, dtype=np.float64) / dh))
  factor = cfg.rope_scaling_factor
  if cfg.rope_scaling == "linear":
    return (inv_freq / factor).astype(np.float32)
  low, high, orig = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_max_len
  wavelen = 2 * np.pi / inv_freq
  smooth = (orig / wavelen - low) / (high - low)
  mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
  out = np.where(wavelen > orig / low, inv_freq / factor, inv_freq)
  out = np.where((wavelen >= orig / high) & (wavelen <= orig / low), mid, out)
  return out.astype(np.float32)


def rope(
  x: jax.Array, positions: jax.Array, theta: float, inv_freq: np.ndarray | None = None
) -> jax.Array:
  """Rotary position embedding, half-split convention. x: [B, N, H, Dh], positions: [B, N].

  `inv_freq` [Dh/2] replaces the plain frequencies theta^(-2i/Dh) (see `rope_inv_freq`).
  """
  dh = x.shape[-1]
  if inv_freq is None:
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))  # [Dh/2]
  else:
    inv_freq = jnp.asarray(inv_freq, jnp.float32)
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, N, Dh/2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)
