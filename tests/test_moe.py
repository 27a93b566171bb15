"""Mixture-of-experts block: ragged vs dense reference, routing replay (§9), regularisers (§8)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret.params import force_gpu_interpret_mode

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.moe import (
  MoEConfig,
  MoEMLP,
  gather_expert_logprobs,
  index_dtype,
  weighted_loss,
)

D, B, N = 16, 2, 6
CFG = ModelConfig(d_model=D)


def _build(seed=0, **moe_kwargs):
  """A real MoEMLP, its unboxed params and a random input [B, N, D]."""
  kwargs = dict(num_experts=4, top_k=2, expert_mlp_dim=8)
  kwargs.update(moe_kwargs)
  module = MoEMLP(CFG, MoEConfig(**kwargs))
  kx, kp = jax.random.split(jax.random.PRNGKey(seed))
  x = jax.random.normal(kx, (B, N, D), jnp.float32)
  params = nn.unbox(module.init(kp, x))["params"]
  return module, params, x


def _with(module, **changes):
  return MoEMLP(module.cfg, MoEConfig(**{**module.moe.to_dict(), **changes}))


def _np_swiglu(x, w_gate, w_up, w_down):
  g, u = x @ w_gate, x @ w_up
  return (g / (1.0 + np.exp(-g)) * u) @ w_down


def _np_softmax(z):
  z = z - z.max(-1, keepdims=True)
  return np.exp(z) / np.exp(z).sum(-1, keepdims=True)


@pytest.mark.parametrize("impl", ["ragged", "portable"])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("shared", [0, 1])
def test_ragged_matches_dense_values_and_gradients(top_k, shared, impl):
  ragged, params, x = _build(top_k=top_k, num_shared_experts=shared, impl=impl)
  dense = _with(ragged, impl="dense")
  w = jax.random.normal(jax.random.PRNGKey(7), (B, N, D))

  def loss(module, p, x):
    y, aux = module.apply({"params": p}, x)
    return jnp.sum(y * w) + aux["aux_loss"] + aux["z_loss"], (y, aux)

  grads = {}
  for name, module in (("ragged", ragged), ("dense", dense)):
    (_, (y, aux)), g = jax.value_and_grad(
      lambda p, x, m=module: loss(m, p, x), argnums=(0, 1), has_aux=True
    )(params, x)
    grads[name] = (y, aux, g)
  yr, auxr, gr = grads["ragged"]
  yd, auxd, gd = grads["dense"]
  np.testing.assert_allclose(yr, yd, atol=1e-5, rtol=1e-5)
  for key in auxr:
    np.testing.assert_allclose(auxr[key], auxd[key], atol=1e-5, rtol=1e-5)
  assert jax.tree.structure(gr) == jax.tree.structure(gd)
  for a, b in zip(jax.tree.leaves(gr), jax.tree.leaves(gd)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
  # Every routed expert weight is exercised: non-trivial gradients on the used experts.
  used = np.unique(np.asarray(auxr["topk"]))
  assert np.all(np.abs(np.asarray(gr[0]["gate"])[used]).sum(axis=(1, 2)) > 0)
  assert np.abs(np.asarray(gr[0]["router"]["kernel"])).sum() > 0
  assert ("shared" in params) == bool(shared)


@pytest.mark.extended
def test_hopper_kernel_layer_matches_dense_in_the_gpu_interpreter():
  """`impl=kernel` (Mosaic GPU grouped matmuls, forward run by the Pallas GPU interpreter)
  gives the dense reference's output, losses and gradients in bf16, with and without replay."""
  cfg = ModelConfig(d_model=64, dtype="bfloat16")
  kwargs = dict(num_experts=4, top_k=2, expert_mlp_dim=64, num_shared_experts=1)
  kernel = MoEMLP(cfg, MoEConfig(impl="kernel", **kwargs))
  dense = MoEMLP(cfg, MoEConfig(**{**kwargs, "impl": "dense"}))
  kx, kp, kw = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(kx, (B, N, 64), jnp.float32)
  params = nn.unbox(dense.init(kp, x))["params"]  # the same parameters for every impl
  w = jax.random.normal(kw, (B, N, 64))

  def run(module, replay=None):
    def loss(p):
      y, aux = module.apply({"params": p}, x, replay=replay)
      return jnp.sum(y.astype(jnp.float32) * w) + aux["aux_loss"], (y, aux)

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

  with force_gpu_interpret_mode():
    (_, (yk, auxk)), gk = run(kernel)
    (_, (yr, _)), _ = run(kernel, replay=auxk["topk"])
  (_, (yd, auxd)), gd = run(dense)
  np.testing.assert_allclose(np.asarray(yk, np.float32), np.asarray(yd, np.float32), atol=3e-2)
  np.testing.assert_array_equal(np.asarray(yk), np.asarray(yr))  # own routing replayed
  np.testing.assert_array_equal(auxk["topk"], auxd["topk"])
  for a, b in zip(jax.tree.leaves(gk), jax.tree.leaves(gd)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("impl", ["ragged", "dense"])
@pytest.mark.parametrize("normalize", [True, False])
def test_replay_of_own_routing_is_exact(impl, normalize):
  module, params, x = _build(impl=impl, normalize_gates=normalize, num_shared_experts=1)
  y, aux = module.apply({"params": params}, x)
  y2, aux2 = module.apply({"params": params}, x, replay=aux["topk"])
  np.testing.assert_array_equal(y, y2)
  np.testing.assert_array_equal(aux["topk"], aux2["topk"])
  assert aux2["aux_loss"] == aux["aux_loss"]
  assert not np.any(aux2["route_differs"])


@pytest.mark.parametrize("impl", ["ragged", "portable", "dense"])
def test_replay_uses_given_experts(impl):
  module, params, x = _build(impl=impl, num_shared_experts=1, seed=3)
  _, aux = module.apply({"params": params}, x)
  logits = np.asarray(aux["router_logits"], np.float64)
  replay = np.argsort(logits, axis=-1)[..., :2]  # the router's two LEAST preferred experts
  y, aux_r = module.apply({"params": params}, x, replay=jnp.asarray(replay, jnp.int32))
  np.testing.assert_array_equal(aux_r["topk"], replay)
  assert np.all(aux_r["route_differs"])

  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  xn = np.asarray(x, np.float64)
  gates = _np_softmax(np.take_along_axis(logits, replay, axis=-1))  # over the replayed set
  expected = _np_swiglu(
    xn, p["shared"]["gate"]["kernel"], p["shared"]["up"]["kernel"], p["shared"]["down"]["kernel"]
  )
  for bi in range(B):
    for ni in range(N):
      for k in range(2):
        e = replay[bi, ni, k]
        out = _np_swiglu(xn[bi, ni], p["gate"][e], p["up"][e], p["down"][e])
        expected[bi, ni] += gates[bi, ni, k] * out
  np.testing.assert_allclose(y, expected, atol=1e-5, rtol=1e-5)


def test_router_gets_gradient_under_replay():
  module, params, x = _build(top_k=2)
  _, aux = module.apply({"params": params}, x)
  replay = jnp.argsort(aux["router_logits"], axis=-1)[..., :2]
  w = jax.random.normal(jax.random.PRNGKey(1), (B, N, D))

  def task_loss(p):  # output only, no regularisers
    y, _ = module.apply({"params": p}, x, replay=replay)
    return jnp.sum(y * w)

  g = jax.grad(task_loss)(params)["router"]["kernel"]
  assert np.all(np.isfinite(g))
  assert np.abs(np.asarray(g)).max() > 1e-4


@pytest.mark.parametrize("impl", ["ragged", "dense"])
def test_gates_sum_to_one_when_normalised(impl):
  # With every expert identical, y = (Σ_k g_k) · expert(x): equal to one expert iff Σ g = 1.
  module, params, x = _build(impl=impl, num_experts=5, top_k=3)
  params = dict(params)
  for name in ("gate", "up", "down"):
    params[name] = jnp.broadcast_to(params[name][:1], params[name].shape)
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  single = _np_swiglu(np.asarray(x, np.float64), p["gate"][0], p["up"][0], p["down"][0])
  y, aux = module.apply({"params": params}, x)
  np.testing.assert_allclose(y, single, atol=1e-5, rtol=1e-5)

  unnorm = _with(module, normalize_gates=False)
  y_u, _ = unnorm.apply({"params": params}, x)
  probs = np.exp(np.asarray(aux["router_logprobs"], np.float64))
  mass = np.take_along_axis(probs, np.asarray(aux["topk"], np.int64), axis=-1).sum(-1)
  assert np.all(mass < 1.0)
  np.testing.assert_allclose(y_u, single * mass[..., None], atol=1e-5, rtol=1e-5)


def test_regularisers_match_numpy():
  module, params, x = _build(num_experts=6, top_k=2, seed=5)
  _, aux = module.apply({"params": params}, x)
  logits = np.asarray(aux["router_logits"], np.float64)
  idx = np.asarray(aux["topk"], np.int64)
  e = 6
  np.testing.assert_array_equal(idx, np.argsort(-logits, axis=-1, kind="stable")[..., :2])
  probs = _np_softmax(logits)
  np.testing.assert_allclose(np.exp(aux["router_logprobs"]), probs, atol=1e-6)
  f = np.bincount(idx.reshape(-1), minlength=e) / idx.size
  p = probs.reshape(-1, e).mean(0)
  np.testing.assert_allclose(aux["load"], f, atol=1e-7)
  np.testing.assert_allclose(aux["load"].sum(), 1.0, atol=1e-6)
  np.testing.assert_allclose(aux["aux_loss"], e * np.sum(f * p), rtol=1e-5)
  lse = np.log(np.exp(logits).sum(-1))
  np.testing.assert_allclose(aux["z_loss"], np.mean(lse**2), rtol=1e-5)
  moe = module.moe
  np.testing.assert_allclose(
    weighted_loss(moe, aux),
    moe.aux_loss_coef * e * np.sum(f * p) + moe.z_loss_coef * np.mean(lse**2),
    rtol=1e-5,
  )
  np.testing.assert_allclose(
    gather_expert_logprobs(aux["router_logprobs"], aux["topk"]),
    np.log(np.take_along_axis(probs, idx, axis=-1)),
    atol=1e-5,
  )


@pytest.mark.parametrize("top_k", [1, 2])
def test_aux_loss_is_one_for_uniform_router(top_k):
  module, params, x = _build(num_experts=4, top_k=top_k)
  params = {**params, "router": {"kernel": jnp.zeros_like(params["router"]["kernel"])}}
  _, aux = module.apply({"params": params}, x)
  np.testing.assert_allclose(aux["aux_loss"], 1.0, rtol=1e-6)
  np.testing.assert_allclose(aux["z_loss"], np.log(4.0) ** 2, rtol=1e-6)
  # Balanced assignments with uniform probs also give the minimum 1 (E·Σ (1/E)(1/E)).
  e = 4
  np.testing.assert_allclose(e * np.sum(np.full(e, 1 / e) * np.full(e, 1 / e)), 1.0)


def test_masked_tokens_do_not_count():
  module, params, x = _build(num_experts=4, top_k=2, seed=2)
  mask = jnp.arange(N)[None, :] < jnp.array([[4], [2]])  # [B, N], rows of 4 and 2 valid tokens
  garbage = jax.random.normal(jax.random.PRNGKey(9), x.shape) * 10.0
  x2 = jnp.where(mask[..., None], x, garbage)
  y1, a1 = module.apply({"params": params}, x, mask=mask)
  y2, a2 = module.apply({"params": params}, x2, mask=mask)
  for key in ("load", "aux_loss", "z_loss"):
    np.testing.assert_allclose(a1[key], a2[key], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(
    np.asarray(y1)[np.asarray(mask)], np.asarray(y2)[np.asarray(mask)], atol=1e-6
  )
  # Equal to the statistics of the valid tokens alone.
  valid_x = jnp.concatenate([x[0, :4], x[1, :2]])[None]  # [1, 6, D]
  _, a3 = module.apply({"params": params}, valid_x)
  for key in ("load", "aux_loss", "z_loss"):
    np.testing.assert_allclose(a1[key], a3[key], rtol=1e-5, atol=1e-7)
  # And the masked tokens receive no gradient through the regularisers.
  g = jax.grad(
    lambda x: (lambda aux: aux["aux_loss"] + aux["z_loss"])(
      module.apply({"params": params}, x, mask=mask)[1]
    )
  )(x)
  assert np.all(np.asarray(g)[~np.asarray(mask)] == 0)
  assert np.abs(np.asarray(g)[np.asarray(mask)]).sum() > 0


def test_jit_matches_eager_and_compiles_once():
  module, params, x = _build(num_shared_experts=1)
  traces = []

  @jax.jit
  def fwd(p, x, replay, mask):
    traces.append(1)
    return module.apply({"params": p}, x, replay=replay, mask=mask)

  mask = jnp.ones((B, N), bool)
  y, aux = module.apply({"params": params}, x)
  y_j, aux_j = fwd(params, x, aux["topk"], mask)
  np.testing.assert_allclose(y_j, y, atol=1e-6)
  np.testing.assert_array_equal(aux_j["topk"], aux["topk"])
  np.testing.assert_allclose(aux_j["aux_loss"], aux["aux_loss"], rtol=1e-6)
  other = jnp.argsort(aux["router_logits"], axis=-1)[..., :2].astype(aux["topk"].dtype)
  fwd(params, x + 1.0, other, mask)
  assert len(traces) == 1


def test_compact_topk_dtype():
  assert index_dtype(1) == jnp.int8
  assert index_dtype(128) == jnp.int8
  assert index_dtype(129) == jnp.int16
  assert index_dtype(32768) == jnp.int16
  assert index_dtype(32769) == jnp.int32
  module, params, x = _build(num_experts=4)
  _, aux = module.apply({"params": params}, x)
  assert aux["topk"].dtype == jnp.int8
  assert aux["topk"].shape == (B, N, 2)
  assert aux["router_logits"].dtype == jnp.float32
  assert aux["router_logprobs"].shape == (B, N, 4)
  assert aux["load"].shape == (4,)
  assert aux["aux_loss"].shape == aux["z_loss"].shape == ()


def test_bfloat16_compute_keeps_router_float32():
  module = MoEMLP(ModelConfig(d_model=D, dtype="bfloat16"), MoEConfig(num_experts=4, top_k=2))
  x = jax.random.normal(jax.random.PRNGKey(0), (B, N, D))
  params = nn.unbox(module.init(jax.random.PRNGKey(1), x))["params"]
  y, aux = module.apply({"params": params}, x)
  assert y.dtype == jnp.bfloat16
  assert aux["router_logits"].dtype == aux["router_logprobs"].dtype == jnp.float32
  assert np.all(np.isfinite(np.asarray(y, np.float32)))


def test_params_carry_logical_axes():
  module = MoEMLP(CFG, MoEConfig(num_experts=4, top_k=2, expert_mlp_dim=8, num_shared_experts=2))
  x = jnp.zeros((B, N, D))
  boxed = module.init(jax.random.PRNGKey(0), x)["params"]
  specs = nn.get_partition_spec(boxed)
  assert tuple(specs["router"]["kernel"]) == ("embed", "expert")
  assert tuple(specs["gate"]) == tuple(specs["up"]) == ("expert", "embed", "mlp")
  assert tuple(specs["down"]) == ("expert", "mlp", "embed")
  assert tuple(specs["shared"]["gate"]["kernel"]) == ("embed", "mlp")
  params = nn.unbox(boxed)
  assert params["gate"].shape == (4, D, 8)
  assert params["down"].shape == (4, 8, D)
  assert params["shared"]["up"]["kernel"].shape == (D, 16)  # 2 shared experts x 8


@pytest.mark.parametrize(
  "kwargs, field",
  [
    (dict(num_experts=4, top_k=5), "moe.top_k=5"),
    (dict(top_k=0), "moe.top_k=0"),
    (dict(num_experts=0), "moe.num_experts=0"),
    (dict(expert_mlp_dim=0), "moe.expert_mlp_dim=0"),
    (dict(num_shared_experts=-1), "moe.num_shared_experts=-1"),
    (dict(shared_mlp_dim=-2), "moe.shared_mlp_dim=-2"),
    (dict(impl="gather"), "moe.impl='gather'"),
    (dict(aux_loss_coef=-0.1), "moe.aux_loss_coef=-0.1"),
    (dict(z_loss_coef=-1.0), "moe.z_loss_coef=-1.0"),
  ],
)
def test_config_validation_names_the_field(kwargs, field):
  with pytest.raises(ValueError, match=field.replace("[", r"\[")):
    MoEConfig(**kwargs)


def test_config_round_trip():
  moe = MoEConfig(num_experts=16, top_k=4, num_shared_experts=1, shared_mlp_dim=32)
  assert MoEConfig.from_dict(moe.to_dict()) == moe
  assert moe.shared_hidden_dim == 32
  assert MoEConfig(num_shared_experts=2, expert_mlp_dim=8).shared_hidden_dim == 16
  with pytest.raises(ValueError, match="capacity"):
    MoEConfig.from_dict({**moe.to_dict(), "capacity": 1.0})
