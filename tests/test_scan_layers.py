"""Scanned layers (model.scan_layers): the same model as the unrolled one, in a stacked layout.

Each test builds a small random model unrolled, converts its parameters with `scan_params` and
checks that the scanned model gives the same logits, cache, MoE routing, sampled tokens,
learner log-probs and (converted back) gradients; then the Hugging Face round trip, the
configuration error for layers that cannot be scanned and old checkpoints' metadata.
"""

import dataclasses
import functools
import json
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_steps, tiny_config
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file

from jaxrl_llm import checkpoint_compat, sharding
from jaxrl_llm.config import ConfigError, check, parse
from jaxrl_llm.models import ModelConfig, Transformer, hf, hf_export, init_cache
from jaxrl_llm.models.scan import scan_cache, scan_params, unscan_cache, unscan_params
from jaxrl_llm.models.transformer import REMAT_POLICIES, positions_from_mask
from jaxrl_llm.quant import sampler_params
from jaxrl_llm.sampling import SamplingConfig, sample, score

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
BASE = dict(vocab_size=24, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=48)
MOE = dict(moe_num_experts=4, moe_top_k=2, moe_expert_mlp_dim=16)
MODELS = {
  "dense": dict(num_layers=3, qk_norm=True),
  "dense_untied_bias": dict(num_layers=2, attention_bias=True, tie_embeddings=False),
  "moe": dict(num_layers=2, **MOE),
  "moe_every_2_shared": dict(num_layers=4, moe_every=2, moe_num_shared_experts=1, **MOE),
}
MOE_MODELS = ("moe", "moe_every_2_shared")


@functools.cache
def _setup(name):
  """(unrolled cfg, scanned cfg, unrolled params, scanned params, prompt [3, 7], mask)."""
  cfg = ModelConfig(**{**BASE, **MODELS[name]})
  scfg = dataclasses.replace(cfg, scan_layers=True)
  tokens = jax.random.randint(jax.random.PRNGKey(0), (3, 7), 3, cfg.vocab_size)
  mask = jnp.array([[0, 0, 1, 1, 1, 1, 1], [1] * 7, [0, 0, 0, 0, 0, 1, 1]], bool)
  tokens = jnp.where(mask, tokens, 0)
  init = lambda r: Transformer(cfg).init(r, tokens, positions_from_mask(mask), mask)["params"]  # noqa: E731
  params = nn.unbox(jax.jit(init)(jax.random.PRNGKey(1)))
  return cfg, scfg, params, scan_params(cfg, params), tokens, mask


def _close(a, b, atol=1e-5):
  np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=atol)


def _trees_close(a, b, atol=1e-5):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
    assert x.shape == y.shape and x.dtype == y.dtype, path
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, err_msg=str(path))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_layout_matches_the_scanned_init_and_converts_back_exactly(name):
  cfg, scfg, params, scanned, tokens, mask = _setup(name)
  init = lambda r: Transformer(scfg).init(r, tokens, positions_from_mask(mask), mask)["params"]  # noqa: E731
  boxed = jax.eval_shape(init, jax.random.PRNGKey(0))
  shapes = jax.tree.map(lambda x: (x.shape, x.dtype), nn.unbox(boxed))
  assert jax.tree.map(lambda x: (x.shape, x.dtype), scanned) == shapes
  p = scfg.scan_period
  assert sorted(scanned["layers"]) == [f"block_{j}" for j in range(p)]
  q = scanned["layers"]["block_0"]["attn"]["q"]["kernel"]
  assert q.shape == (cfg.num_layers // p, 32, 4, 8)
  np.testing.assert_array_equal(q[1], params[f"layer_{p}"]["attn"]["q"]["kernel"])
  jax.tree.map(np.testing.assert_array_equal, unscan_params(cfg, scanned), params)
  # The leading axis is named "layers" and no sharding rule splits it.
  specs = nn.get_partition_spec(boxed)["layers"]["block_0"]
  assert specs["attn"]["q"]["kernel"] == P("layers", "embed", "heads", "head_dim")
  mesh = sharding.make_mesh(data=2, model=2, expert=2)
  s = sharding.param_shardings(boxed, mesh, sharding.DEFAULT_RULES)["layers"]["block_0"]
  assert s["attn"]["q"]["kernel"].spec == P(None, ("fsdp", "expert"), "model", None)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_forward_and_moe_outputs_match_unrolled(name):
  cfg, scfg, params, scanned, tokens, mask = _setup(name)
  pos = positions_from_mask(mask)
  kw = {}
  if cfg.moe_num_experts:  # replay a routing and probe other experts: [B, Q, Lm, K]
    lm = len(cfg.moe_layers)
    kw["routing"] = jax.random.randint(jax.random.PRNGKey(5), (3, 7, lm, 2), 0, 4)
    kw["probe_experts"] = jax.random.randint(jax.random.PRNGKey(6), (3, 7, lm, 2), 0, 4)
  want = Transformer(cfg).apply({"params": params}, tokens, pos, mask, **kw)
  got = jax.jit(lambda p: Transformer(scfg).apply({"params": p}, tokens, pos, mask, **kw))(scanned)
  _close(got.logits, want.logits)
  if cfg.moe_num_experts:
    assert got.moe.routing.shape == (3, 7, len(cfg.moe_layers), 2)
    np.testing.assert_array_equal(got.moe.routing, kw["routing"])
    _trees_close(got.moe, want.moe)
  else:
    assert got.moe is None and want.moe is None


@pytest.mark.parametrize(
  "name", ["dense", pytest.param("moe_every_2_shared", marks=pytest.mark.extended)]
)
def test_kv_cache_prefill_and_decode_match_unrolled(name):
  cfg, scfg, params, scanned, prompt, mask = _setup(name)
  valid = jnp.concatenate([mask, jnp.ones((3, 3), bool)], axis=1)
  pos = positions_from_mask(valid)
  nxt = jnp.array([[4], [5], [6]])
  caches = {}
  for c, p in ((cfg, params), (scfg, scanned)):
    m = Transformer(c)
    out = m.apply({"params": p}, prompt, pos[:, :7], valid, cache=init_cache(c, 3, 10))
    step = jax.jit(functools.partial(m.apply, cache_index=jnp.int32(7)))
    dec = step({"params": p}, nxt, pos[:, 7:8], valid, cache=out.cache)
    caches[c.scan_layers] = (out, dec)
  (pre, dec), (spre, sdec) = caches[False], caches[True]
  assert sdec.cache.k.shape == (cfg.num_layers, 3, 2, 10, 8)  # [L, B, J, N, Dh]
  _close(spre.logits, pre.logits)
  _close(sdec.logits, dec.logits)
  _trees_close(unscan_cache(sdec.cache), dec.cache)
  _trees_close(scan_cache(dec.cache), sdec.cache)


def _sample_and_score(cfg, params, prompt, mask, sampling):
  model = Transformer(cfg)
  r = jax.jit(lambda p: sample(model, p, prompt, mask, jax.random.PRNGKey(3), sampling))(params)
  args = (r.prompt_tokens, r.prompt_mask, r.tokens, sampling.temperature)
  return r, jax.jit(lambda p: score(model, p, *args, routing=r.routing))(params)


@pytest.mark.parametrize(
  "name",
  [
    "dense",
    pytest.param("moe", marks=pytest.mark.extended),
    pytest.param("moe_every_2_shared", marks=pytest.mark.extended),
  ],
)
def test_sampler_and_learner_match_unrolled(name):
  cfg, scfg, params, scanned, prompt, mask = _setup(name)
  scfg_s = SamplingConfig(max_new_tokens=6, group_size=3, temperature=0.9, eos_id=2)
  rollouts, scores = {}, {}
  for c, p in ((cfg, params), (scfg, scanned)):
    rollouts[c.scan_layers], scores[c.scan_layers] = _sample_and_score(c, p, prompt, mask, scfg_s)
  r, rs = rollouts[False], rollouts[True]
  np.testing.assert_array_equal(rs.tokens, r.tokens)
  np.testing.assert_array_equal(rs.lengths, r.lengths)
  _close(rs.logprobs, r.logprobs)
  if cfg.moe_num_experts:
    np.testing.assert_array_equal(rs.routing, r.routing)
  _close(scores[True].logp, scores[False].logp)
  _close(scores[True].entropy, scores[False].entropy)
  m = np.asarray(r.loss_mask) > 0
  _close(np.asarray(scores[True].logp)[m], np.asarray(rs.logprobs)[m])


def _loss_grads(cfg, params, batch, remat="none"):
  """Gradient of a learner-style loss: Σ weights · ℓ (+ MoE regularisers) with replay."""
  prompt, mask, tokens, weights, routing = batch
  model = Transformer(cfg, remat=remat)

  def loss(p):
    s = score(model, p, prompt, mask, tokens, 1.0, routing=routing)
    extra = 0.0 if s.moe is None else s.moe.aux_loss + s.moe.z_loss + jnp.sum(s.moe.used_logprobs)
    return jnp.sum(s.logp * weights) + extra

  return jax.jit(jax.grad(loss))(params)


def _batch(cfg, prompt, mask):
  tokens = jax.random.randint(jax.random.PRNGKey(8), (3, 5), 3, cfg.vocab_size)
  weights = jax.random.normal(jax.random.PRNGKey(9), (3, 5))
  routing = None
  if cfg.moe_num_experts:
    routing = jax.random.randint(jax.random.PRNGKey(10), (3, 12, len(cfg.moe_layers), 2), 0, 4)
  return prompt, mask, tokens, weights, routing


@functools.cache
def _unrolled_grads(name):
  cfg, _, params, _, prompt, mask = _setup(name)
  return _loss_grads(cfg, params, _batch(cfg, prompt, mask))


@pytest.mark.extended
@pytest.mark.parametrize(
  "name",
  [
    "dense_untied_bias",
    "moe",
    "moe_every_2_shared",
  ],
)
def test_gradients_match_unrolled(name):
  cfg, scfg, _, scanned, prompt, mask = _setup(name)
  got = _loss_grads(scfg, scanned, _batch(cfg, prompt, mask))
  _trees_close(unscan_params(cfg, got), _unrolled_grads(name), atol=1e-5)


@pytest.mark.extended
@pytest.mark.parametrize(
  "policy",
  sorted(set(REMAT_POLICIES) - {"none"}),
)
def test_remat_policies_with_scan_give_the_same_gradients(policy):
  cfg, scfg, _, scanned, prompt, mask = _setup("moe_every_2_shared")
  batch = _batch(cfg, prompt, mask)
  want = _unrolled_grads("moe_every_2_shared")
  got = _loss_grads(scfg, scanned, batch, remat=policy)
  _trees_close(unscan_params(cfg, got), want, atol=1e-5)
  # The policy is applied inside the scan: the backward pass recomputes the blocks.
  model = Transformer(scfg, remat=policy)
  prompt, mask, tokens, _, routing = batch
  f = lambda p: jnp.sum(score(model, p, prompt, mask, tokens, 1.0, routing=routing).logp)  # noqa: E731
  assert "remat" in str(jax.make_jaxpr(jax.grad(f))(scanned))


def test_int8_sampler_copy_quantises_each_layer_alone():
  cfg, _, params, scanned, _, _ = _setup("moe_every_2_shared")
  quant = jax.jit(sampler_params, static_argnums=1)
  want = scan_params(cfg, quant(params, "int8"))
  jax.tree.map(np.testing.assert_array_equal, quant(scanned, "int8"), want)


# ----------------------------------------------------------------------------- Hugging Face


@pytest.mark.parametrize("name", ["llama", "qwen3_moe", "qwen3_moe_mixed", "mixtral"])
def test_hf_import_scanned_and_export_round_trip_exactly(name, tmp_path):
  cfg, params = hf.load_checkpoint(FIXTURES / name)
  scfg, scanned = hf.load_checkpoint(FIXTURES / name, scan_layers=True)
  assert scfg == dataclasses.replace(cfg, scan_layers=True)
  jax.tree.map(np.testing.assert_array_equal, scanned, scan_params(cfg, params))
  ref = dict(np.load(FIXTURES / name / "reference.npz"))
  tokens, mask = jnp.asarray(ref["tokens"]), jnp.asarray(ref["mask"])
  logits = Transformer(scfg).apply({"params": scanned}, tokens, positions_from_mask(mask), mask)
  got = np.where(ref["mask"][..., None], np.asarray(logits.logits), 0.0)
  np.testing.assert_allclose(got, ref["logits"], rtol=0, atol=1e-4)

  model_type = json.loads((FIXTURES / name / "config.json").read_text())["model_type"]
  hf_export.save_checkpoint(tmp_path, scfg, scanned, model_type=model_type, max_shard_bytes=50_000)
  original, exported = {}, {}
  for src, dst in ((FIXTURES / name, original), (tmp_path, exported)):
    for f in sorted(src.glob("*.safetensors")):
      dst.update(load_file(f))
  assert sorted(original) == sorted(exported)
  for key, value in original.items():
    np.testing.assert_array_equal(value, exported[key], err_msg=key)
  cfg2, params2 = hf.load_checkpoint(tmp_path)  # the layout is saved with the config
  assert cfg2 == scfg
  jax.tree.map(np.testing.assert_array_equal, params2, scanned)
  _, unrolled = hf.load_checkpoint(tmp_path, scan_layers=False)
  jax.tree.map(np.testing.assert_array_equal, unrolled, params)


def test_hf_import_scanned_onto_a_mesh():
  mesh = sharding.make_mesh(data=2, model=2, expert=2)
  cfg, params = hf.load_checkpoint(FIXTURES / "qwen3_moe", mesh=mesh, scan_layers=True)
  block = params["layers"]["block_0"]
  assert block["attn"]["q"]["kernel"].sharding.spec == P(None, ("fsdp", "expert"), "model", None)
  assert block["moe"]["gate"].sharding.spec == P(None, "expert", "fsdp", "model")
  _, plain = hf.load_checkpoint(FIXTURES / "qwen3_moe")
  want = scan_params(dataclasses.replace(cfg, scan_layers=False), plain)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(params), jax.device_get(want))


# ----------------------------------------------------------------------------- configuration


def test_layers_that_cannot_be_scanned_are_refused_with_the_fields_named():
  with pytest.raises(ValueError, match=r"model\.scan_layers=True needs model\.num_layers=3 to be"):
    ModelConfig(num_layers=3, moe_num_experts=4, moe_every=2, scan_layers=True)
  ModelConfig(num_layers=3, moe_num_experts=4, moe_every=2)  # unrolled: fine
  ModelConfig(num_layers=4, moe_num_experts=4, moe_every=2, scan_layers=True)
  c = tiny_config(
    **{
      "model.scan_layers": True,
      "model.num_layers": 3,
      "model.moe_num_experts": 4,
      "model.moe_every": 2,
    }
  )
  with pytest.raises(ConfigError, match=r"multiple of model\.moe_every=2"):
    check(parse(c), num_devices=1)


def test_checkpoint_meta_from_before_the_field_reads_as_unrolled():
  old = {k: v for k, v in ModelConfig().to_dict().items() if k != "scan_layers"}
  defaults = {"model": ModelConfig().to_dict()}
  current = {"model": ModelConfig().to_dict()}
  checkpoint_compat.check_compatible({"model": old}, current, defaults=defaults)
  with pytest.raises(checkpoint_compat.CheckpointMismatchError) as e:
    checkpoint_compat.check_compatible({"model": old}, current)
  assert e.value.diffs == {"model.scan_layers": ("<absent>", False)}
  scanned = {"model": ModelConfig(scan_layers=True).to_dict()}
  with pytest.raises(checkpoint_compat.CheckpointMismatchError) as e:
    checkpoint_compat.check_compatible({"model": old}, scanned, defaults=defaults)
  assert e.value.diffs == {"model.scan_layers": (False, True)}
  assert ModelConfig.from_dict(old).scan_layers is False


@pytest.mark.extended
def test_config_field_reaches_the_model_and_an_rl_step_runs():
  c = tiny_config(**{"model.scan_layers": True, "train.num_steps": 1})
  assert parse(c).model.arch.scan_layers
  states, metrics = run_steps(c, steps=1)
  assert "layers" in states[0].params and "layer_0" not in states[0].params
  assert np.isfinite(float(metrics[0]["policy/loss"]))
