"""Low-rank adapters on the model (`model.lora_*`, `models/lora.py`): the adapted model equals
its base at initialisation, equals a model whose weights are W + (alpha / r) A B (a reference
written here, with the adapters merged into the plain model's weights), the base alone runs as
the plain projection, and bad adapter settings are one error line each."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from flax import traverse_util

from jaxrl_llm.config import ConfigError, parse
from jaxrl_llm.models import ModelConfig, Transformer, lora
from jaxrl_llm.models.scan import SCAN_NAME
from jaxrl_llm.models.transformer import positions_from_mask

BASE = dict(vocab_size=24, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=48)
MOE = dict(moe_num_experts=4, moe_top_k=2, moe_expert_mlp_dim=16, moe_num_shared_experts=1)


def _inputs():
  tokens = jax.random.randint(jax.random.PRNGKey(0), (3, 7), 3, BASE["vocab_size"])
  mask = jnp.array([[0, 0, 1, 1, 1, 1, 1], [1] * 7, [0, 0, 0, 0, 0, 1, 1]], bool)
  return jnp.where(mask, tokens, 0), positions_from_mask(mask), mask


def _init(**kw):
  """(model, params) of a random-init model with `kw` over BASE."""
  model = Transformer(ModelConfig(**{**BASE, **kw}))
  return model, nn.unbox(model.init(jax.random.PRNGKey(1), *_inputs())["params"])


def _logits(model, params):
  return model.apply({"params": params}, *_inputs()).logits


def _merged(params, alpha: float, rank: int):
  """The reference: each adapted kernel replaced by W + (alpha / r) A B, adapters removed
  (scanned layers: one product per layer along the leading axis)."""
  flat = traverse_util.flatten_dict(params)
  out = {k: v for k, v in flat.items() if not lora.is_adapter(k)}
  for path in [k for k in flat if k[-1] == "lora_a"]:
    a, b = np.asarray(flat[path], np.float64), np.asarray(flat[(*path[:-1], "lora_b")], np.float64)
    w = np.asarray(flat[(*path[:-1], "kernel")], np.float64)
    if path[0] == SCAN_NAME:
      delta = np.stack([np.tensordot(a[i], b[i], 1) for i in range(len(a))])
    else:
      delta = np.tensordot(a, b, 1)
    assert delta.shape == w.shape, (path, delta.shape, w.shape)
    out[(*path[:-1], "kernel")] = jnp.asarray(w + delta * (alpha / rank), jnp.float32)
  return traverse_util.unflatten_dict(out)


@pytest.mark.parametrize(
  "kw",
  [dict(), dict(scan_layers=True), dict(attention_bias=True, tie_embeddings=False), MOE],
  ids=["dense", "scanned", "qwen2", "moe_shared"],
)
def test_adapters_start_at_the_base_and_equal_merged_weights(kw):
  """Step 0: adapted == base (B = 0), and the base alone (adapters split off) runs unchanged.
  With random B the adapted model equals the plain model on merged weights."""
  rank, alpha = 4, 8.0
  plain, _ = _init(**kw)
  model, params = _init(lora_rank=rank, lora_alpha=alpha, **kw)
  base, adapters = lora.split(params)
  targets = set(lora.target_names(ModelConfig().lora_targets))
  assert set(lora.adapted(adapters)) == targets  # every projection, MoE shared experts too
  assert not lora.unmatched(model.cfg.lora_targets, adapters)
  np.testing.assert_array_equal(_logits(model, params), _logits(plain, base))
  np.testing.assert_array_equal(_logits(model, base), _logits(plain, base))

  keys = iter(jax.random.split(jax.random.PRNGKey(2), len(jax.tree.leaves(adapters))))
  noisy = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(next(keys), x.shape), adapters)
  adapted = _logits(model, lora.join(base, noisy))
  merged = _logits(plain, _merged(lora.join(base, noisy), alpha, rank))
  assert float(jnp.max(jnp.abs(adapted - _logits(plain, base)))) > 1e-3  # the adapters act
  np.testing.assert_allclose(adapted, merged, rtol=1e-4, atol=1e-4)


def test_targets_by_projection_or_hugging_face_name():
  """`q_proj,v_proj` adapts q and v only; the adapter shapes follow the kernel's axes."""
  _, params = _init(lora_rank=2, lora_targets="q_proj, v_proj")
  _, adapters = lora.split(params)
  assert lora.adapted(adapters) == {"q": 2, "v": 2}
  q = adapters["layer_0"]["attn"]["q"]
  assert q["lora_a"].shape == (32, 2) and q["lora_b"].shape == (2, 4, 8)
  assert q["lora_a"].dtype == jnp.float32  # adapters in float32 whatever the base stores


def test_split_and_join_are_inverse():
  """split gives the base without adapters and the adapters alone; join restores the tree."""
  _, params = _init(lora_rank=2)
  base, adapters = lora.split(params)
  flat_base = traverse_util.flatten_dict(base)
  flat_adapters = traverse_util.flatten_dict(adapters)
  assert flat_adapters and all(lora.is_adapter(k) for k in flat_adapters)
  assert not any(lora.is_adapter(k) for k in flat_base)
  assert jax.tree.structure(lora.join(base, adapters)) == jax.tree.structure(params)


@pytest.mark.parametrize(
  "fields,says",
  [
    ({"lora_rank": 2, "lora_targets": "q,attn_out"}, "attn_out is no projection"),
    ({"lora_rank": 2, "lora_targets": ""}, "names no projection"),
    ({"lora_rank": 40}, "model.lora_rank=40 is larger than projection 'k'"),
    ({"lora_rank": -1}, "model.lora_rank=-1 must be >= 0"),
    ({"lora_rank": 2, "lora_alpha": 0.0}, "model.lora_alpha=0.0 must be > 0"),
    (
      {"lora_rank": 2, "moe_num_experts": 4, "lora_targets": "q,gate"},
      "this model has no gate projection",
    ),
  ],
)
def test_bad_adapter_settings_are_one_error_each(fields, says):
  """Each bad setting is refused in one message naming the field and what is allowed."""
  with pytest.raises(ValueError) as err:
    ModelConfig(**{**BASE, **fields})
  problems = str(err.value).removeprefix("invalid model config: ").split("; ")
  assert sum(says in p for p in problems) == 1, str(err.value)


def test_a_run_refuses_adapters_until_the_trainer_freezes_the_base():
  """The trainer would update base and adapters alike: a run with adapters is refused in one
  line naming the field."""
  with pytest.raises(ConfigError) as err:
    parse(tiny_config(**{"model.lora_rank": 2}))
  problems = str(err.value).splitlines()[1:]
  assert len(problems) == 1 and "model.lora_rank=2: a run cannot train adapters yet" in problems[0]
