"""MoE policies in the RL loop: recorded routing, replay (§9), RSPO's γ (§2.8), expert sharding."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_steps, tiny_config
from jax._src.pallas.mosaic_gpu.interpret.params import force_gpu_interpret_mode
from parsed import build

from jaxrl_llm import hlo, objectives
from jaxrl_llm.models import ModelConfig, Transformer
from jaxrl_llm.models.transformer import positions_from_mask
from jaxrl_llm.rl import stages
from jaxrl_llm.run import abstract_batch
from jaxrl_llm.sampling import SamplingConfig, sample, score


def _moe_model(top_k=2, **kw):
  cfg = ModelConfig(
    vocab_size=32,
    d_model=32,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    mlp_dim=64,
    num_layers=2,
    moe_num_experts=4,
    moe_top_k=top_k,
    moe_expert_mlp_dim=32,
    **kw,
  )
  model = Transformer(cfg)
  prompt = jax.random.randint(jax.random.PRNGKey(0), (4, 6), 3, 32)
  mask = jnp.ones(prompt.shape, bool).at[0, :2].set(False)
  prompt = jnp.where(mask, prompt, 0)
  params = nn.unbox(
    model.init(jax.random.PRNGKey(1), prompt, positions_from_mask(mask), mask)["params"]
  )
  return model, params, prompt, mask


def _perturb_routers(params, scale, seed=0):
  keys = iter(jax.random.split(jax.random.PRNGKey(seed), 16))

  def f(path, x):
    names = [getattr(p, "key", "") for p in path]
    if "router" in names:
      return x + scale * jax.random.normal(next(keys), x.shape)
    return x

  return jax.tree_util.tree_map_with_path(f, params)


def _rollout(model, params, prompt, mask):
  cfg = SamplingConfig(max_new_tokens=8, group_size=3, eos_id=2, temperature=1.0)
  return jax.jit(lambda p, k: sample(model, p, prompt, mask, k, cfg))(params, jax.random.PRNGKey(5))


def _valid(r):
  return np.concatenate([np.asarray(r.prompt_mask), np.asarray(r.loss_mask) > 0], axis=1)


@pytest.mark.extended
def test_sampler_records_routing_of_every_processed_token():
  model, params, prompt, mask = _moe_model()
  r = _rollout(model, params, prompt, mask)
  assert r.routing.shape == (12, 6 + 8, 2, 2) and r.routing.dtype == jnp.int8
  # The learner's own routing on the same tokens and parameters is the sampler's (float32).
  sc = score(model, params, r.prompt_tokens, r.prompt_mask, r.tokens, 1.0)
  valid = _valid(r)
  np.testing.assert_array_equal(np.asarray(sc.moe.routing)[valid], np.asarray(r.routing)[valid])


@pytest.mark.extended
def test_slots_the_decode_loop_never_reaches_hold_the_routing_sentinel():
  """One prompt, near-greedy sampling, and its greedy first token as EOS: every row ends after
  one step, so the loop stops and slots 2..8 are never routed (-1, never expert 0). Replaying
  that routing uses the router's own choice there and counts no disagreement."""
  model, params, prompt, mask = _moe_model()
  prompt, mask = jnp.repeat(prompt[1:2], 4, axis=0), jnp.repeat(mask[1:2], 4, axis=0)
  first = score(model, params, prompt, mask, jnp.zeros((4, 1), jnp.int32), 1.0, full_logits=True)
  greedy = int(jnp.argmax(first.logits[0, 0]))
  cfg = SamplingConfig(max_new_tokens=8, group_size=2, eos_id=greedy, temperature=1e-4)
  r = jax.jit(lambda p, k: sample(model, p, prompt, mask, k, cfg))(params, jax.random.PRNGKey(5))
  routing = np.asarray(r.routing)
  assert np.all(np.asarray(r.tokens)[:, 0] == greedy)
  assert np.all(routing[:, 6 + 1 :] == -1) and np.all(routing[:, : 6 + 1] >= 0)
  own = score(model, params, r.prompt_tokens, r.prompt_mask, r.tokens, 1.0)
  replayed = score(model, params, r.prompt_tokens, r.prompt_mask, r.tokens, 1.0, routing=r.routing)
  np.testing.assert_array_equal(np.asarray(replayed.logp), np.asarray(own.logp))
  assert not np.any(np.asarray(replayed.moe.own_differs))


@pytest.mark.extended
def test_decode_stages_record_the_same_routing():
  """Decode stages (kv_block 3 over T = 8, and one stage of 16) sample the same tokens, log-probs
  and routing as the whole-cache decode (kv_block 0)."""
  model, params, prompt, mask = _moe_model()
  runs = {}
  for c in (0, 3, 16):
    cfg = SamplingConfig(max_new_tokens=8, group_size=2, eos_id=-1, kv_block=c)
    fn = jax.jit(lambda p, k, cfg=cfg: sample(model, p, prompt, mask, k, cfg))
    runs[c] = fn(params, jax.random.PRNGKey(5))
  for c in (3, 16):
    np.testing.assert_array_equal(runs[c].tokens, runs[0].tokens)
    np.testing.assert_array_equal(runs[c].routing, runs[0].routing)
    np.testing.assert_allclose(runs[c].logprobs, runs[0].logprobs, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("top_k", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_r3_replay_reproduces_sampler_logprobs_after_router_change(top_k):
  model, params, prompt, mask = _moe_model(top_k=top_k)
  r = _rollout(model, params, prompt, mask)
  moved = _perturb_routers(params, 0.5 if top_k == 1 else 0.15)
  m = np.asarray(r.loss_mask) > 0
  free = score(model, moved, r.prompt_tokens, r.prompt_mask, r.tokens, 1.0)
  replay = score(model, moved, r.prompt_tokens, r.prompt_mask, r.tokens, 1.0, routing=r.routing)
  err_free = np.abs(np.asarray(free.logp - r.logprobs))[m].mean()
  err_replay = np.abs(np.asarray(replay.logp - r.logprobs))[m].mean()
  disagree = np.any(
    np.sort(np.asarray(free.moe.routing), -1) != np.sort(np.asarray(r.routing), -1), -1
  )[_valid(r)]
  assert disagree.mean() > 0.05, (
    "the perturbation must change routing for this test to mean anything"
  )
  assert err_free > 1e-3
  if top_k == 1:  # a single normalised gate is 1: the replayed forward is the sampler's exactly
    assert np.abs(np.asarray(replay.logp - r.logprobs))[m].max() < 1e-5
  else:  # gates are recomputed from the moved router over the same experts: close, not equal
    assert err_replay < 0.8 * err_free, (err_replay, err_free)
  np.testing.assert_array_equal(
    np.asarray(replay.moe.routing)[_valid(r)], np.asarray(r.routing)[_valid(r)]
  )


@pytest.mark.extended
def test_router_gets_gradient_under_replay():
  model, params, prompt, mask = _moe_model()
  r = _rollout(model, params, prompt, mask)

  def loss(p):
    sc = score(model, p, r.prompt_tokens, r.prompt_mask, r.tokens, 1.0, routing=r.routing)
    return -jnp.sum(sc.logp * r.loss_mask)

  grads = jax.grad(loss)(params)
  for layer in ("layer_0", "layer_1"):
    g = np.asarray(grads[layer]["moe"]["router"]["kernel"])
    assert np.all(np.isfinite(g)) and np.abs(g).max() > 0


def test_rspo_gamma_from_the_model():
  model, params, prompt, mask = _moe_model()
  r = _rollout(model, params, prompt, mask)
  old = score(model, params, r.prompt_tokens, r.prompt_mask, r.tokens, 1.0)
  same = score(
    model, params, r.prompt_tokens, r.prompt_mask, r.tokens, 1.0, probe_experts=old.moe.routing
  )
  g_same = objectives.router_shift_gamma(same.moe.probe_logprobs, old.moe.used_logprobs)
  np.testing.assert_allclose(np.asarray(g_same), 1.0, atol=1e-6)
  moved = _perturb_routers(params, 0.5)
  new = score(
    model, moved, r.prompt_tokens, r.prompt_mask, r.tokens, 1.0, probe_experts=old.moe.routing
  )
  g = np.asarray(
    objectives.router_shift_gamma(new.moe.probe_logprobs, old.moe.used_logprobs, gamma_min=0.2)
  )
  assert g.min() >= 0.2 and g.max() <= 1.0
  shifted = np.any(
    np.sort(np.asarray(new.moe.routing), -1) != np.sort(np.asarray(old.moe.routing), -1),
    axis=(-1, -2),
  )
  valid = _valid(r)
  # Tokens whose routing moved have a lower γ than tokens whose routing did not.
  assert g[shifted & valid].mean() < g[~shifted & valid].mean() < 1.0


def _step_metrics(config, steps=1):
  states, metrics = run_steps(config, steps)
  return states[-1], metrics


def _assert_same_runs(run_a, run_b, keys, rtol):
  """Two `_step_metrics` runs agree: tokens exactly, `keys` at `rtol`, parameters at 1e-3."""
  (state_a, metrics_a), (state_b, metrics_b) = run_a, run_b
  for a, b in zip(metrics_a, metrics_b):
    np.testing.assert_array_equal(a["samples/tokens"], b["samples/tokens"])
    for key in keys:
      np.testing.assert_allclose(a[key], b[key], rtol=rtol, atol=1e-6, err_msg=key)
  jax.tree.map(
    lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-3, atol=1e-5),
    jax.device_get(state_a.params),
    jax.device_get(state_b.params),
  )


MOE = {"model.moe_num_experts": 4, "model.moe_top_k": 2, "model.moe_expert_mlp_dim": 32}


@pytest.mark.parametrize(
  "dtype",
  [pytest.param("int8", marks=pytest.mark.extended)],  # bfloat16: the moe_gspo study
)
def test_low_precision_sampler_routing_disagreement(dtype):
  free = tiny_config(**MOE, **{"sampling.param_dtype": dtype, "replay.name": "none"})
  _, (m,) = _step_metrics(free)
  assert m["moe/route_disagree_sampler"] > 0
  r3 = tiny_config(**MOE, **{"sampling.param_dtype": dtype, "replay.name": "r3"})
  _, (m,) = _step_metrics(r3)
  assert m["moe/route_disagree_sampler"] == 0.0
  assert m["moe/router_prefers_other"] > 0  # the learner's router would have chosen otherwise


EP = {**MOE, "model.moe_num_experts": 8, "replay.name": "r2", "rl.num_prompts": 8}


@pytest.mark.parametrize(
  "mesh,impl",
  [
    pytest.param({"mesh.expert": 8}, "ragged", marks=pytest.mark.extended),
    pytest.param({"mesh.expert": 4, "mesh.data": 2}, "portable", marks=pytest.mark.extended),
    pytest.param({"mesh.expert": 2, "mesh.fsdp": 4}, "portable", marks=pytest.mark.extended),
    # No expert parallelism: each device routes its own rows.
    pytest.param({"mesh.fsdp": 8}, "portable", marks=pytest.mark.extended),
  ],
)
def test_expert_parallel_step_equals_one_device(mesh, impl):
  """Experts split over the `expert` axis, tokens dispatched and returned by all-to-all (and
  weights split over `fsdp`, gathered per layer): two fused steps (sampling with routing, R2
  replay, learner) equal one device's."""
  one = tiny_config(**EP, **{"model.moe_impl": impl})
  many = tiny_config(**EP, **mesh, **{"model.moe_impl": impl})
  exp = build(many, abstract=True)
  w = exp.state.params["layer_0"]["moe"]["gate"]
  ep = mesh.get("mesh.expert", 1)
  assert w.sharding.shard_shape(w.shape)[0] == 8 // ep
  assert w.sharding.shard_shape(w.shape)[1] == 32 // mesh.get("mesh.fsdp", 1)
  # The sampler reads the experts in their stored layout (no whole copy of every expert);
  # the other weights are FSDP-gathered once per step.
  decode = exp.program.learner.decode_shardings["layer_0"]
  assert decode["moe"]["gate"].spec == w.sharding.spec
  assert "fsdp" not in str(decode["attn"]["q"]["kernel"].spec)
  text = exp.program.step.lower(exp.state, abstract_batch(exp), jax.random.PRNGKey(0))
  everything = [i for insts in hlo.computations(text.compile().as_text()).values() for i in insts]
  dispatch = [i for i in hlo.collectives(everything, "all-to-all") if "moe" in i.op_name]
  assert bool(dispatch) == (ep > 1)
  keys = ("policy/loss", "optim/grad_norm", "moe/aux_loss", "moe/route_disagree_old")
  _assert_same_runs(_step_metrics(one, 2), _step_metrics(many, 2), keys, rtol=2e-4)


def test_expert_count_must_divide_over_the_expert_axis():
  with pytest.raises(
    ValueError, match=r"model.moe_num_experts=4 is not divisible by mesh.expert=8"
  ):
    build(tiny_config(**MOE, **{"mesh.expert": 8}), abstract=True)


@pytest.mark.extended
def test_portable_grouped_matmul_gives_the_ragged_step():
  """The whole fused MoE step (R3 replay) with `moe_impl=portable` equals `ragged`'s."""
  ragged = tiny_config(**MOE, **{"replay.name": "r3", "model.moe_impl": "ragged"})
  portable = tiny_config(**MOE, **{"replay.name": "r3", "model.moe_impl": "portable"})
  s1, m1 = _step_metrics(ragged, 2)
  s2, m2 = _step_metrics(portable, 2)
  keys = ("policy/loss", "optim/grad_norm", "moe/aux_loss", "policy/entropy")
  _assert_same_runs((s1, m1), (s2, m2), keys, rtol=1e-3)


@pytest.mark.extended  # 46 s: the interpreter runs every kernel block through host callbacks
def test_hopper_kernel_gives_the_ragged_step_in_the_gpu_interpreter():
  """The whole fused MoE step (R3 replay, bf16) with `moe_impl=kernel`, its forward grouped
  matmuls run by the Pallas GPU interpreter, equals `ragged`'s."""
  wide = {**MOE, "model.d_model": 64, "model.moe_expert_mlp_dim": 64, "model.dtype": "bfloat16"}
  ragged = tiny_config(**wide, **{"replay.name": "r3", "model.moe_impl": "ragged"})
  kernel = tiny_config(**wide, **{"replay.name": "r3", "model.moe_impl": "kernel"})
  s1, m1 = _step_metrics(ragged, 2)
  with force_gpu_interpret_mode():
    s2, m2 = _step_metrics(kernel, 2)
  keys = ("policy/loss", "optim/grad_norm", "moe/aux_loss", "policy/entropy")
  _assert_same_runs((s1, m1), (s2, m2), keys, rtol=2e-2)


@pytest.mark.parametrize("replay", [pytest.param("none", marks=pytest.mark.slow), "r3"])
def test_old_pass_in_slices_equals_one_pass(replay):
  """The old pass scored in slices (the learner's microbatches) gives the one-pass scores,
  routing, load and z-loss; the strided split/merge round-trips rows and prompt blocks."""
  model, params, prompt, mask = _moe_model()
  params = _perturb_routers(params, 0.3)  # the learner's router differs from the sampler's
  r = _rollout(model, params, prompt, mask)  # 12 rows
  one = stages.old_pass(model, params, r, 1.0, replay)
  for chunks in (2, 3):
    parts = stages.old_pass(model, params, r, 1.0, replay, chunks=chunks)
    for got, want in ((parts.logp, one.logp), (parts.entropy, one.entropy)):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(parts.moe.routing, one.moe.routing)
    np.testing.assert_array_equal(parts.moe.own_differs, one.moe.own_differs)
    np.testing.assert_allclose(parts.moe.used_logprobs, one.moe.used_logprobs, atol=1e-5)
    np.testing.assert_allclose(parts.moe.load, one.moe.load, atol=1e-6)
    np.testing.assert_allclose(parts.moe.z_loss, one.moe.z_loss, rtol=1e-5)
  rows = jnp.arange(24).reshape(12, 2)
  for block in (1, 2):
    split = stages.split_leading(rows, 3, block)
    assert split.shape == (3, 4, 2)
    np.testing.assert_array_equal(stages.merge_leading(split, block), rows)


@pytest.mark.extended
def test_moe_statistics_count_real_tokens_only():
  """Padding after EOS changes neither the log-probs nor, given the completion mask, the MoE
  load, load-balance loss or z-loss (§8); without the mask the pads would be counted."""
  model, params, prompt, mask = _moe_model()
  p, m = prompt[:1], mask[:1]
  short = jnp.asarray([[8, 9, 2]])
  padded = jnp.asarray([[8, 9, 2, 0, 0, 0, 0, 0]])
  real = lambda t: (jnp.arange(t.shape[1]) < 3)[None].astype(jnp.float32)  # noqa: E731
  a = score(model, params, p, m, short, 1.0, completion_mask=real(short))
  b = score(model, params, p, m, padded, 1.0, completion_mask=real(padded))
  np.testing.assert_allclose(a.logp, b.logp[:, :3], rtol=1e-6, atol=1e-6)
  for key in ("load", "aux_loss", "z_loss"):
    np.testing.assert_allclose(getattr(a.moe, key), getattr(b.moe, key), rtol=1e-5, err_msg=key)
  counted = score(model, params, p, m, padded, 1.0)  # every position counted
  assert not np.allclose(counted.moe.z_loss, a.moe.z_loss)
