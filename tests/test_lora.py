"""Low-rank adapters (`model.lora_*`, `models/lora.py`): the adapted model equals its base at
initialisation and a model whose weights are W + (alpha / r) A B (a reference written here),
the base alone runs as the plain projection, a run trains the adapters alone with the base as
its KL reference, and bad adapter settings are one error line each."""

import dataclasses
import json
import pathlib
import shutil
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import parsed
import pytest
from conftest import REPO, load_config, run_steps, tiny_config
from flax import traverse_util
from parsed import build, train_and_evaluate

from jaxrl_llm import metrics as metrics_lib
from jaxrl_llm import quant
from jaxrl_llm.checkpoint import Checkpointer, CheckpointMismatchError
from jaxrl_llm.config import ConfigError
from jaxrl_llm.config import parse as parse_config
from jaxrl_llm.models import ModelConfig, Transformer, lora
from jaxrl_llm.models.scan import SCAN_NAME
from jaxrl_llm.models.transformer import positions_from_mask
from jaxrl_llm.run.loop import resume_target

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


@pytest.mark.extended
@pytest.mark.parametrize(
  "kw",
  [dict(), dict(attention_bias=True, tie_embeddings=False)],  # scanned, MoE: the gradient test
  ids=["dense", "qwen2"],
)
def test_adapters_start_at_the_base_and_equal_merged_weights(kw):
  """Step 0: adapted == base (B = 0), and the base alone (adapters split off) runs unchanged.
  With random B the adapted model equals the plain model on merged weights."""
  rank, alpha = 4, 8.0
  plain, _ = _init(**kw)
  model, params = _init(lora_rank=rank, lora_alpha=alpha, **kw)
  base, adapters = lora.split_adapters(params)
  targets = set(lora.target_names(ModelConfig().lora_targets))
  assert set(lora.adapted(adapters)) == targets  # every projection, MoE shared experts too
  assert not lora.unmatched(model.cfg.lora_targets, adapters)
  np.testing.assert_array_equal(_logits(model, params), _logits(plain, base))
  np.testing.assert_array_equal(_logits(model, base), _logits(plain, base))

  keys = iter(jax.random.split(jax.random.PRNGKey(2), len(jax.tree.leaves(adapters))))
  noisy = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(next(keys), x.shape), adapters)
  adapted = _logits(model, lora.join_adapters(base, noisy))
  merged = _logits(plain, _merged(lora.join_adapters(base, noisy), alpha, rank))
  assert float(jnp.max(jnp.abs(adapted - _logits(plain, base)))) > 1e-3  # the adapters act
  np.testing.assert_allclose(adapted, merged, rtol=1e-4, atol=1e-4)


def test_targets_by_projection_or_hugging_face_name():
  """`q_proj,v_proj` adapts q and v only; the adapter shapes follow the kernel's axes."""
  _, params = _init(lora_rank=2, lora_targets="q_proj, v_proj")
  _, adapters = lora.split_adapters(params)
  assert lora.adapted(adapters) == {"q": 2, "v": 2}
  q = adapters["layer_0"]["attn"]["q"]
  assert q["lora_a"].shape == (32, 2) and q["lora_b"].shape == (2, 4, 8)
  assert q["lora_a"].dtype == jnp.float32  # adapters in float32 whatever the base stores


def test_targets_are_held_and_recorded_as_one_spelling_and_a_repeat_is_one_error_line():
  """The same projections in another order or by Hugging Face's names are one model, held
  (and recorded with its checkpoints) as the short names in PROJECTIONS order; a projection
  named twice (`q,q`, or `q` and `q_proj`) was accepted and recorded verbatim, and is now
  refused at config parse in one line naming it."""
  for targets in ("down_proj, q,k_proj", "k,down,q", "q,k,down"):
    cfg = ModelConfig(**BASE, lora_rank=2, lora_targets=targets)
    assert cfg.lora_targets == "q,k,down" and cfg.to_dict()["lora_targets"] == "q,k,down"
  for targets in ("q,q", "q_proj,v,q"):
    with pytest.raises(ConfigError) as err:
      parse_config(tiny_config(**{"model.lora_rank": 2, "model.lora_targets": targets}))
    line = str(err.value)
    assert "\n" not in line and f"model.lora_targets={targets!r} names q more than once" in line
    assert "name each of q, k, v, o, gate, up, down at most once" in line, line


@pytest.mark.extended  # CI's time (2026-12-06)
def test_a_resume_takes_the_same_targets_in_another_order_or_spelling(tmp_path):
  """A run with adapters on q,k,v,o,gate,up,down resumed with the same projections in another
  order, or by Hugging Face's names (which the docs call interchangeable), was refused: "holds
  a checkpoint (step 1) of a model/base with model.lora_targets='q,k,v,o,gate,up,down', but the
  config asks for model.lora_targets='k,q,...'". It resumes now; another set of projections is
  still refused in one line, and nothing is written."""
  workdir = tmp_path / "run"
  run = {"model.lora_rank": 4, "train.checkpoint_every": 1, "train.eval_every": 100}
  train_and_evaluate(tiny_config(**run, **{"train.num_steps": 1}), str(workdir))
  for steps, targets in ((2, "k,q,v,o,gate,up,down"), (3, "q_proj,k_proj,v,o,gate_proj,up,down")):
    config = tiny_config(**run, **{"train.num_steps": steps, "model.lora_targets": targets})
    train_and_evaluate(config, str(workdir))
    assert (workdir / "checkpoints" / str(steps)).is_dir(), targets
  before = sorted(p.name for p in (workdir / "checkpoints").iterdir())
  other = tiny_config(**run, **{"train.num_steps": 4, "model.lora_targets": "k_proj,q"})
  with pytest.raises(CheckpointMismatchError) as err:
    train_and_evaluate(other, str(workdir))
  line = str(err.value)
  assert "\n" not in line and "model.lora_targets='q,k,v,o,gate,up,down'" in line, line
  assert "but the config asks for model.lora_targets='q,k'" in line, line
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == before


def test_a_checkpoint_recording_its_targets_in_another_spelling_resumes(tmp_path):
  """A checkpoint whose meta spells its targets otherwise than the config does (as checkpoints
  written before targets had one spelling hold them, verbatim) matches the same projections
  and no others; a refusal names both in the one spelling."""
  cfg = ModelConfig(**BASE, lora_rank=2, lora_targets="q,v")
  saved = {"model": {**cfg.to_dict(), "lora_targets": "v_proj, q"}}
  with Checkpointer(str(tmp_path), save_every=1, async_save=False) as ckpt:
    ckpt.save(1, {"x": jnp.zeros(2)}, meta=saved, force=True)
    ckpt.check_meta(1, resume_target(None, {"model": cfg.to_dict()})[1])
    other = dataclasses.replace(cfg, lora_targets="q,k")
    with pytest.raises(CheckpointMismatchError) as err:
      ckpt.check_meta(1, resume_target(None, {"model": other.to_dict()})[1])
  said = "model.lora_targets='q,v', but the config asks for model.lora_targets='q,k'"
  assert said in str(err.value), err.value  # both in the one spelling


def test_split_and_join_are_inverse():
  """split gives the base without adapters and the adapters alone; join restores the tree."""
  _, params = _init(lora_rank=2)
  base, adapters = lora.split_adapters(params)
  flat_base = traverse_util.flatten_dict(base)
  flat_adapters = traverse_util.flatten_dict(adapters)
  assert flat_adapters and all(lora.is_adapter(k) for k in flat_adapters)
  assert not any(lora.is_adapter(k) for k in flat_base)
  assert jax.tree.structure(lora.join_adapters(base, adapters)) == jax.tree.structure(params)


@pytest.mark.parametrize(
  "fields,says",
  [
    ({"lora_rank": 2, "lora_targets": "q,attn_out"}, "attn_out is no projection"),
    ({"lora_rank": 2, "lora_targets": ""}, "names no projection"),
    ({"lora_rank": 2, "lora_targets": "q,v,q_proj"}, "names q more than once"),
    ({"lora_rank": 40}, "model.lora_rank=40 is larger than projection 'k'"),
    ({"lora_rank": -1}, "model.lora_rank=-1 must be >= 0"),
    ({"lora_rank": 2, "lora_alpha": 0.0}, "model.lora_alpha=0.0 must be > 0"),
    (
      {"lora_rank": 2, "moe_num_experts": 4, "lora_targets": "q,gate"},
      "this model has no gate projection",
    ),
    ({"lora_rank": 2, "lora_base_dtype": "int4"}, "allowed: auto, int8"),
    # the setting given, not the other one at its default (it read "... / lora_dropout=0.0")
    ({"lora_base_dtype": "int8"}, "model.lora_base_dtype='int8' acts on adapters"),
    ({"lora_dropout": 0.1}, "model.lora_dropout=0.1 acts on adapters"),
    ({"lora_rank": 2, "lora_dropout": 1.0}, "model.lora_dropout=1.0 must be in [0, 1)"),
  ],
)
def test_bad_adapter_settings_are_one_error_each(fields, says):
  """Each bad setting is refused in one message naming the field and what is allowed."""
  with pytest.raises(ValueError) as err:
    ModelConfig(**{**BASE, **fields})
  problems = str(err.value).removeprefix("invalid model config: ").split("; ")
  assert sum(says in p for p in problems) == 1, str(err.value)


def _leaves(tree) -> dict:
  return {k: np.asarray(v) for k, v in traverse_util.flatten_dict(tree).items()}


@pytest.mark.extended
def test_a_run_with_adapters_trains_them_alone_on_the_base_and_its_reference_is_the_base():
  """Three fused updates with adapters and a KL term: the base is bit-identical, every adapter
  moves, the optimiser holds moments for the adapters only, no reference copy is made, and
  the KL to the reference (the base) grows from 0 as the adapters move."""
  overrides = {"model.lora_rank": 4, "kl.beta": 0.05, "rl.entropy_coef": 0.01}  # a gradient
  config = tiny_config(**overrides, **{"optim.learning_rate": 1e-2})  # whatever the rewards
  states, metrics = run_steps(config, 3)
  first, last = states[0], states[-1]
  assert first.ref_params is None and last.ref_params is None
  base0, adapters0 = lora.split_adapters(first.params)
  base3, adapters3 = lora.split_adapters(last.params)
  for path, value in _leaves(base0).items():
    np.testing.assert_array_equal(_leaves(base3)[path], value, err_msg=str(path))
  moved = [p for p, v in _leaves(adapters0).items() if not np.array_equal(_leaves(adapters3)[p], v)]
  assert len(moved) == len(_leaves(adapters0)), "every adapter matrix is trained"
  moments = sum(x.size for x in jax.tree.leaves(last.opt_state) if np.ndim(x))
  assert moments == 2 * sum(x.size for x in jax.tree.leaves(adapters0))  # Adam's mu and nu
  kl = [float(m["kl/ref_kl"]) for m in metrics]  # to the base: 0 until the adapters move
  assert all(np.isfinite(kl)) and kl[-1] > 0, kl
  assert all(np.isfinite(float(m["policy/loss"])) for m in metrics)


@pytest.mark.extended
@pytest.mark.parametrize(
  "kw",
  [dict(scan_layers=True), MOE],  # dense and qwen2 layouts: the merged-weights test above
  ids=["scanned", "moe_shared"],
)
def test_the_adapters_gradient_is_the_merged_full_models_gradient(kw):
  """The reference: a plain model whose weights are W + (alpha / r) A B, differentiated
  through that merge with respect to A and B, gives the adapted model's loss and gradient
  (dense, scanned layers, biased attention with an untied head, and MoE with a shared
  expert: every adapter, the shared expert's included, gets its gradient)."""
  rank, alpha = 4, 8.0
  plain, _ = _init(**kw)
  model, params = _init(lora_rank=rank, lora_alpha=alpha, **kw)
  base, adapters = lora.split_adapters(params)
  keys = iter(jax.random.split(jax.random.PRNGKey(3), len(jax.tree.leaves(adapters))))
  adapters = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(next(keys), x.shape), adapters)
  tokens, positions, mask = _inputs()

  def nll(logits):
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
    picked = jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
    return -jnp.sum(picked * mask[:, 1:]) / jnp.sum(mask[:, 1:])

  def adapted(a):
    return nll(model.apply({"params": lora.join_adapters(base, a)}, tokens, positions, mask).logits)

  def merged(a):
    weights = lora.merged(lora.join_adapters(base, a), alpha / rank)
    return nll(plain.apply({"params": weights}, tokens, positions, mask).logits)

  (la, ga), (lm, gm) = jax.value_and_grad(adapted)(adapters), jax.value_and_grad(merged)(adapters)
  np.testing.assert_allclose(la, lm, rtol=1e-5)
  for path, g in _leaves(ga).items():
    np.testing.assert_allclose(g, _leaves(gm)[path], rtol=1e-4, atol=1e-6, err_msg=str(path))
  assert max(float(np.abs(g).max()) for g in _leaves(ga).values()) > 0
  assert min(float(np.abs(g).max()) for g in _leaves(ga).values()) > 0  # every adapter learns


@pytest.mark.parametrize(
  "kw",
  [
    dict(),
    pytest.param(dict(scan_layers=True), marks=pytest.mark.slow),
    dict(attention_bias=True, tie_embeddings=False),
    MOE,
  ],
  ids=["dense", "scanned", "qwen2", "moe_shared"],
)
def test_an_int8_base_is_the_model_on_its_dequantised_weights(kw):
  """model.lora_base_dtype=int8: every attention, MLP and shared-expert projection is stored
  int8 with one float32 scale per output channel, each weight within half a step of its float
  value; embeddings, norms, the head, the router and routed experts are not; and the model
  computes the plain model on the dequantised weights."""
  model, params = _init(lora_rank=4, lora_base_dtype="int8", **kw)
  stored = lora.quantize_base(params)
  flat, floats = traverse_util.flatten_dict(stored), traverse_util.flatten_dict(params)
  int8 = {k for k, v in flat.items() if v.dtype == jnp.int8}
  assert int8 == {k for k in flat if k[-1] == "kernel" and k[-2] in lora.PROJECTIONS}
  dequantized = traverse_util.flatten_dict(lora.dequantized(stored))
  for path in int8:
    step = float(np.max(flat[(*path[:-1], lora.SCALE)]))
    error = np.abs(np.asarray(dequantized[path]) - np.asarray(floats[path]))
    assert 0 < error.max() <= 0.5 * step * (1 + 1e-5), path
  plain, _ = _init(lora_rank=4, **kw)
  np.testing.assert_allclose(
    _logits(model, stored), _logits(plain, lora.dequantized(stored)), rtol=1e-5, atol=1e-5
  )
  for path in int8:
    np.testing.assert_array_equal(
      traverse_util.flatten_dict(lora.quantize_base(stored))[path], flat[path]
    )


@pytest.mark.parametrize("kw", [dict(), dict(scan_layers=True)], ids=["dense", "scanned"])
def test_the_sampler_runs_the_int8_base_itself(kw):
  """The sampler's copy of an int8 base (bfloat16, int8, int4 sampler dtypes) holds the very
  int8 kernels and float32 scales the learner holds, the 2-D attention scales [H, Dh]
  included: none is re-quantised or cast."""
  _, params = _init(lora_rank=8, lora_base_dtype="int8", **kw)
  stored = traverse_util.flatten_dict(lora.quantize_base(params))
  base = {k for k, v in stored.items() if v.dtype == jnp.int8}
  base |= {(*k[:-1], lora.SCALE) for k in base}
  assert any(stored[k].ndim - bool(kw) == 2 for k in base if k[-1] == lora.SCALE)
  for dtype in ("bfloat16", "int8", "int4"):
    sampler = jax.jit(quant.sampler_params, static_argnums=1)
    got = traverse_util.flatten_dict(sampler(traverse_util.unflatten_dict(stored), dtype))
    for path in base:
      assert got[path].dtype == stored[path].dtype, (dtype, path)
      np.testing.assert_array_equal(got[path], stored[path], err_msg=f"{dtype} {path}")


@pytest.mark.extended
def test_a_run_on_an_int8_base_trains_the_adapters_and_never_changes_the_base():
  """Three fused updates on an int8 base: the int8 kernels and their scales are bit-identical,
  every adapter moves, and the plan's resident weights shrink by the projections' 3 of 4
  bytes (float32 -> int8, plus the scales)."""

  overrides = {"model.lora_rank": 4, "kl.beta": 0.05, "rl.entropy_coef": 0.01}
  config = tiny_config(
    **overrides, **{"optim.learning_rate": 1e-2, "model.lora_base_dtype": "int8"}
  )
  states, metrics = run_steps(config, 3)
  base0, adapters0 = lora.split_adapters(states[0].params)
  base3, adapters3 = lora.split_adapters(states[-1].params)
  assert sum(v.dtype == np.int8 for v in _leaves(base0).values()) >= 7
  for path, value in _leaves(base0).items():
    np.testing.assert_array_equal(_leaves(base3)[path], value, err_msg=str(path))
  assert all(not np.array_equal(_leaves(adapters3)[p], v) for p, v in _leaves(adapters0).items())
  assert all(np.isfinite(float(m["policy/loss"])) for m in metrics)
  assert float(metrics[-1]["kl/ref_kl"]) != 0  # the reference is the int8 base itself

  devices = jax.devices()[:1]
  float_plan = parsed.plan(parse_config(tiny_config(**overrides)), devices=devices)
  int8_plan = parsed.plan(parse_config(config), devices=devices)
  kernels = [v for k, v in _leaves(base0).items() if v.dtype == np.int8]
  scales = [v for k, v in _leaves(base0).items() if k[-1] == lora.SCALE]
  saved = sum(3 * v.size for v in kernels) - sum(v.nbytes for v in scales)
  assert float_plan.argument_bytes - int8_plan.argument_bytes == pytest.approx(saved, rel=0.01)


@pytest.mark.parametrize(
  "overrides,says",
  [
    ({"kl.beta": 0.05, "kl.reference": "ema", "kl.ema": 0.1}, "kl.reference='ema' moves"),
    (
      {"model.value_head": True, "objective.name": "ppo_critic", "advantage.name": "gae"},
      "model.value_head with",
    ),
  ],
)
def test_what_adapters_cannot_train_is_refused_in_one_line(overrides, says):
  """A moving reference or a value head beside adapters: refused before anything compiles."""
  with pytest.raises(ConfigError) as err:
    build(tiny_config(**{"model.lora_rank": 2, **overrides}))
  problems = str(err.value).splitlines()
  assert len(problems) == 1 and says in problems[0], str(err.value)  # one problem: one line


@pytest.mark.extended
def test_the_default_learns_through_adapters_on_a_base_it_never_changes(tmp_path):
  """`configs/lora.py`: held-out accuracy >= 0.8 and a gain >= 0.3 from training rank-32
  adapters alone (warm start and RL), and the final checkpoint's base equals the random
  initialisation, bit for bit."""
  config = load_config("lora")
  config.mesh.data = 1
  train_and_evaluate(config, str(tmp_path))
  evals = metrics_lib.read_scalars(str(tmp_path))["eval/accuracy"]
  start, end = evals[0][1], evals[-1][1]
  assert end >= 0.8 and end - start >= 0.3, evals

  exp = build(config)
  abstract, _ = resume_target(exp.stored(exp.state), exp.meta)
  ckpt = Checkpointer(str(tmp_path), save_every=0, async_save=False)
  step, stored, meta = ckpt.restore_latest(abstract)
  ckpt.close()
  assert step == config.train.num_steps and meta["base"] == {"checkpoint": None, "init_seed": 0}
  assert not lora.split_adapters(stored.params)[0]  # the checkpoint holds the adapters alone
  state = exp.from_stored(stored)
  base_then, base_now = (
    lora.split_adapters(jax.device_get(exp.state.params))[0],
    lora.split_adapters(state.params)[0],
  )
  for path, value in _leaves(base_then).items():
    np.testing.assert_array_equal(np.asarray(_leaves(base_now)[path]), value, err_msg=str(path))

  # The export rebuilds the random-init base from the run's config and merges the adapters.
  from jaxrl_llm.models import hf

  sys.path.insert(0, str(REPO / "tools"))
  import hf_convert

  hf_convert.main(["export", f"--workdir={tmp_path}", f"--out={tmp_path / 'hf'}"])
  merged = lora.merged(jax.device_get(state.params), config.model.lora_alpha / 32)
  exported = hf.load_checkpoint(tmp_path / "hf")[1]
  for path, value in _leaves(merged).items():
    np.testing.assert_allclose(_leaves(exported)[path], value, rtol=1e-6, err_msg=str(path))


def _assert_resumes_exactly(overrides: dict, tmp_path) -> None:
  """4 updates straight equal 2 + 2 across a restart, scalar for scalar (checkpoint every 2)."""
  train_and_evaluate(tiny_config(**overrides), str(tmp_path / "straight"))
  stop = {**overrides, "train.stop_after_steps": 2}
  train_and_evaluate(tiny_config(**stop), str(tmp_path / "resumed"))
  train_and_evaluate(tiny_config(**overrides), str(tmp_path / "resumed"))
  a = metrics_lib.read_scalars(str(tmp_path / "straight"))
  b = metrics_lib.read_scalars(str(tmp_path / "resumed"))
  for tag in ("policy/loss", "optim/grad_norm", "policy/entropy", "rollout/reward_mean"):
    assert dict(a[tag]) == dict(b[tag]) and sorted(dict(a[tag])) == [1, 2, 3, 4], tag


@pytest.mark.extended
def test_a_run_on_an_int8_base_resumes_and_exports_the_policy_it_trained(tmp_path):
  """An int8-base run stopped after 2 updates and resumed equals 4 straight updates; its
  export (merged weights in float) gives the adapted int8 model's logits."""
  from jaxrl_llm.models import hf

  sys.path.insert(0, str(REPO / "tools"))
  import hf_convert

  overrides = {"model.lora_rank": 4, "model.lora_base_dtype": "int8", "rl.entropy_coef": 0.01}
  overrides |= {"train.checkpoint_every": 2, "optim.learning_rate": 1e-2}
  _assert_resumes_exactly(overrides, tmp_path)

  config = tiny_config(**overrides)
  exp = build(config)
  abstract, _ = resume_target(exp.stored(exp.state), exp.meta)
  with Checkpointer(str(tmp_path / "straight"), save_every=0, async_save=False) as ckpt:
    _, stored, _ = ckpt.restore_latest(abstract)
  params = jax.device_get(exp.from_stored(stored).params)
  hf_convert.main(["export", f"--workdir={tmp_path / 'straight'}", f"--out={tmp_path / 'hf'}"])
  cfg, exported = hf.load_checkpoint(tmp_path / "hf")
  np.testing.assert_allclose(
    _logits(Transformer(cfg), exported), _logits(exp.model, params), rtol=1e-4, atol=1e-4
  )


@pytest.mark.extended
def test_a_run_with_adapters_resumes_exactly(tmp_path):
  """4 updates straight equal 2 + 2 across a restart, scalar for scalar."""
  overrides = {"model.lora_rank": 4, "rl.entropy_coef": 0.01, "train.checkpoint_every": 2}
  _assert_resumes_exactly(overrides, tmp_path)


@pytest.mark.slow
def test_export_of_a_run_with_adapters_is_the_merged_model(tmp_path):
  """`tools/hf_convert.py export` of a checkpoint holding adapters writes a plain Hugging Face
  checkpoint whose model gives the adapted model's logits (its weights W + (alpha / r) A B)."""
  import optax

  from jaxrl_llm.models import hf, hf_adapters
  from jaxrl_llm.types import TrainState

  sys.path.insert(0, str(REPO / "tools"))
  import hf_convert

  model, params = _init(lora_rank=4, lora_alpha=8.0)
  base, adapters = lora.split_adapters(params)
  keys = iter(jax.random.split(jax.random.PRNGKey(4), len(jax.tree.leaves(adapters))))
  params = lora.join_adapters(
    base, jax.tree.map(lambda x: x + 0.1 * jax.random.normal(next(keys), x.shape), adapters)
  )
  tx = optax.adamw(1e-3)
  state = TrainState(
    step=jnp.zeros((), jnp.int32),
    params=params,
    opt_state=tx.init(lora.split_adapters(params)[1]),
    ref_params=None,
    rng=jax.random.PRNGKey(0),
  )
  with Checkpointer(str(tmp_path / "run"), save_every=1, async_save=False) as ckpt:
    ckpt.save(2, state, meta={"model": model.cfg.to_dict()}, force=True)
  args = ["export", f"--workdir={tmp_path / 'run'}", f"--out={tmp_path / 'hf'}"]
  summary = hf_convert.main([*args, f"--adapters={tmp_path / 'peft'}"])
  assert len(summary["adapters"]["target_modules"]) == 7  # q k v o gate up down
  assert (tmp_path / "peft" / "adapter_model.safetensors").is_file()
  cfg, exported = hf.load_checkpoint(tmp_path / "hf")
  # PEFT's files read back
  _, reloaded = hf_adapters.load_adapters(tmp_path / "peft", cfg, exported)
  np.testing.assert_array_equal(
    np.asarray(lora.split_adapters(reloaded)[1]["layer_0"]["attn"]["q"]["lora_b"]),
    np.asarray(lora.split_adapters(params)[1]["layer_0"]["attn"]["q"]["lora_b"]),
  )
  assert cfg.lora_rank == 0 and not lora.has_adapters(exported)
  np.testing.assert_allclose(
    _logits(Transformer(cfg), exported), _logits(model, params), rtol=1e-4, atol=1e-4
  )
  # A random base has no source to name: it is exported beside the adapters, which name it,
  # and the adapters on that base are the trained policy (as the merged export is).
  config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
  assert config["base_model_name_or_path"] == str(tmp_path / "peft" / "base")
  base_cfg, base = hf.load_checkpoint(tmp_path / "peft" / "base")
  adapted_cfg, adapted = hf_adapters.load_adapters(tmp_path / "peft", base_cfg, base)
  np.testing.assert_allclose(
    _logits(Transformer(adapted_cfg), adapted), _logits(model, params), rtol=1e-4, atol=1e-4
  )


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_peft_format_adapters_add_up_to_the_merged_export(scan, tmp_path):
  """`hf_adapters.save_adapters` writes PEFT's LoRA files: for every adapted module M, the exported
  merged weight equals the base's plus (lora_alpha / r) lora_B @ lora_A, with PEFT's names,
  shapes and config; routed experts and unadapted modules get no entry."""
  from safetensors.numpy import load_file

  from jaxrl_llm.models import hf_adapters, hf_export

  rank, alpha = 4, 8.0
  model, params = _init(lora_rank=rank, lora_alpha=alpha, scan_layers=scan, lora_targets="q,o,down")
  base, adapters = lora.split_adapters(params)
  keys = iter(jax.random.split(jax.random.PRNGKey(5), len(jax.tree.leaves(adapters))))
  adapters = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(next(keys), x.shape), adapters)
  params, plain = lora.join_adapters(base, adapters), dataclasses.replace(model.cfg, lora_rank=0)
  targets = hf_adapters.save_adapters(
    tmp_path / "peft", model.cfg, params, model_type="llama", base_model="b"
  )
  hf_export.save_checkpoint(tmp_path / "base", plain, base, model_type="llama")
  hf_export.save_checkpoint(
    tmp_path / "merged", plain, lora.merged(params, alpha / rank), model_type="llama"
  )

  assert targets == ["mlp.down_proj", "self_attn.o_proj", "self_attn.q_proj"]
  config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
  assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", rank, alpha)
  assert config["target_modules"] == targets and config["base_model_name_or_path"] == "b"
  tensors = load_file(tmp_path / "peft" / "adapter_model.safetensors")
  assert len(tensors) == 2 * 3 * BASE.get("num_layers", ModelConfig().num_layers)

  def read(folder: str) -> dict:
    files = sorted((tmp_path / folder).glob("*.safetensors"))
    return {k: v for f in files for k, v in load_file(f).items()}

  weights_base, weights_merged = read("base"), read("merged")
  for name in [k.removesuffix(".lora_A.weight") for k in tensors if k.endswith("lora_A.weight")]:
    a, b = tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"]
    module = name.removeprefix("base_model.model.")
    w, merged = weights_base[f"{module}.weight"], weights_merged[f"{module}.weight"]
    assert a.shape == (rank, w.shape[1]) and b.shape == (w.shape[0], rank), name
    np.testing.assert_allclose(w + (alpha / rank) * b @ a, merged, rtol=1e-5, atol=1e-6)


PEFT_FIXTURE = REPO / "tests" / "fixtures" / "peft" / "llama_lora"
HF_LLAMA = REPO / "tests" / "fixtures" / "hf" / "llama"


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_adapters_saved_by_peft_load_and_give_peft_s_logits_and_export_back_bit_for_bit(
  scan, tmp_path
):
  """The fixture's adapters were written by PEFT's `save_pretrained` on the llama fixture
  (`tools/make_peft_fixture.py`), with the adapted transformers model's logits. Loaded onto
  the Hugging Face base they give those logits; `save_adapters` writes PEFT's tensors back
  unchanged."""
  from safetensors.numpy import load_file

  from jaxrl_llm.models import hf, hf_adapters

  cfg, base = hf.load_checkpoint(HF_LLAMA, scan_layers=scan)
  adapted_cfg, params = hf_adapters.load_adapters(PEFT_FIXTURE, cfg, base)
  assert (adapted_cfg.lora_rank, adapted_cfg.lora_alpha) == (4, 8.0)
  assert set(lora.target_names(adapted_cfg.lora_targets)) == {"q", "v", "o", "down"}
  ref = dict(np.load(HF_LLAMA / "reference.npz"))
  want = np.load(PEFT_FIXTURE / "reference.npz")["logits"]
  tokens, mask = jnp.asarray(ref["tokens"]), jnp.asarray(ref["mask"])
  out = (
    Transformer(adapted_cfg)
    .apply({"params": params}, tokens, positions_from_mask(mask), mask)
    .logits
  )
  real = ref["mask"][..., None]
  np.testing.assert_allclose(np.where(real, out, 0), np.where(real, want, 0), rtol=0, atol=1e-4)
  assert np.abs(np.where(real, want - ref["logits"], 0)).max() > 0.1  # the adapters act

  hf_adapters.save_adapters(tmp_path, adapted_cfg, params, model_type="llama")
  saved, peft_saved = (
    load_file(tmp_path / "adapter_model.safetensors"),
    load_file(PEFT_FIXTURE / "adapter_model.safetensors"),
  )
  assert sorted(saved) == sorted(peft_saved)
  for key, value in peft_saved.items():
    np.testing.assert_array_equal(saved[key], value, err_msg=key)


def test_bfloat16_adapters_load_as_their_values_rounded_and_give_peft_s_logits(tmp_path):
  """Adapters stored in bfloat16 (as many Hub adapters are) were refused as "holds dtype
  bfloat16; LoRA weights are floats". The fixture's adapters written in bfloat16 load as its
  float32 values rounded to bfloat16, and (where PEFT is installed) give the logits PEFT's
  `PeftModel` computes from the same files."""
  import ml_dtypes
  from safetensors.flax import save_file
  from safetensors.numpy import load_file

  from jaxrl_llm.models import hf, hf_adapters

  folder = tmp_path / "bf16"
  shutil.copytree(PEFT_FIXTURE, folder)
  fp32 = load_file(PEFT_FIXTURE / "adapter_model.safetensors")
  bf16 = {k: jnp.asarray(v, jnp.bfloat16) for k, v in fp32.items()}
  save_file(bf16, str(folder / "adapter_model.safetensors"))
  cfg, base = hf.load_checkpoint(HF_LLAMA)
  adapted_cfg, params = hf_adapters.load_adapters(folder, cfg, base)
  _, exact = hf_adapters.load_adapters(PEFT_FIXTURE, cfg, base)
  got = traverse_util.flatten_dict(lora.split_adapters(params)[1])
  want = traverse_util.flatten_dict(lora.split_adapters(exact)[1])
  assert sorted(got) == sorted(want)
  for key, value in want.items():
    rounded = np.asarray(value).astype(ml_dtypes.bfloat16).astype(np.float32)
    assert got[key].dtype == jnp.float32, key
    np.testing.assert_array_equal(got[key], rounded, err_msg=str(key))
  assert any(not np.array_equal(got[k], want[k]) for k in want)  # rounded, not the fp32 file

  peft = pytest.importorskip("peft")
  transformers = pytest.importorskip("transformers")
  import torch

  hf_model = transformers.AutoModelForCausalLM.from_pretrained(
    HF_LLAMA, dtype=torch.float32, attn_implementation="eager"
  )
  peft_model = peft.PeftModel.from_pretrained(hf_model, folder).eval()
  ref = dict(np.load(HF_LLAMA / "reference.npz"))
  mask = torch.tensor(ref["mask"], dtype=torch.long)
  with torch.no_grad():
    peft_logits = peft_model(
      input_ids=torch.tensor(ref["tokens"], dtype=torch.long),
      attention_mask=mask,
      position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
    ).logits.numpy()
  tokens, real = jnp.asarray(ref["tokens"]), jnp.asarray(ref["mask"])
  out = Transformer(adapted_cfg).apply({"params": params}, tokens, positions_from_mask(real), real)
  real = ref["mask"][..., None]
  np.testing.assert_allclose(
    np.where(real, out.logits, 0), np.where(real, peft_logits, 0), rtol=0, atol=1e-4
  )


def test_unsupported_peft_configs_are_one_error_line(tmp_path):
  """DoRA, rsLoRA, biases or another PEFT method: refused naming the field."""
  from jaxrl_llm.models import hf, hf_adapters, hf_config

  cfg, base = hf.load_checkpoint(HF_LLAMA)
  for key, value in (
    ("use_dora", True),
    ("use_rslora", True),
    ("bias", "all"),
    ("lora_bias", True),  # its lora_B.bias tensors read as "no LoRA weight PEFT saves"
    ("peft_type", "IA3"),
  ):
    folder = tmp_path / key
    shutil.copytree(PEFT_FIXTURE, folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    config[key] = value
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(hf_config.CheckpointFormatError, match=rf"adapter_config.json: {key}="):
      hf_adapters.load_adapters(folder, cfg, base)


def _edit_tensors(folder, fn):
  from safetensors.numpy import load_file, save_file

  tensors = load_file(folder / "adapter_model.safetensors")
  fn(tensors)
  save_file(tensors, folder / "adapter_model.safetensors")


def _first(tensors, suffix):
  return next(k for k in sorted(tensors) if k.endswith(suffix))


def _nan(t):
  t[_first(t, "lora_A.weight")][0, 0] = np.nan


def _unpaired(t):
  del t[_first(t, "lora_B.weight")]


def _beyond(t):
  key = _first(t, "lora_A.weight")
  t[key.replace("layers.0.", "layers.7.")] = t[key]


def _adapter_name(t):  # a model's state dict saved as is: `lora_A.default.weight`
  key = _first(t, "lora_A.weight")
  t[key.replace("lora_A.weight", "lora_A.default.weight")] = t.pop(key)


def _head(t):  # PEFT adapts lm_head when target_modules names it
  key = _first(t, "lora_A.weight")
  t["base_model.model.lm_head.lora_A.weight"] = t[key]


def _embedding(t):  # PEFT's embedding adapters: lora_embedding_A/B
  t["base_model.model.model.embed_tokens.lora_embedding_A"] = np.zeros((2, 8), np.float32)


def _wrong_shape(t):
  key = _first(t, "lora_A.weight")
  t[key] = t[key][:, :-1].copy()


def _transposed(t):  # the same number of values: it was reshaped into the slot, scrambled
  key = _first(t, "lora_A.weight")
  t[key] = np.ascontiguousarray(t[key].T)


BAD_ADAPTERS = {  # (edit of adapter_config.json or of the tensors, what the line says)
  "config-a-list": (lambda f: (f / "adapter_config.json").write_text("[1]"), "not a JSON object"),
  "no-r": (lambda f: _edit_config(f, r=None), "r=None; the rank is a whole number >= 1"),
  "r-0": (lambda f: _edit_config(f, r=0), "r=0; the rank"),
  "alpha-text": (lambda f: _edit_config(f, lora_alpha="big"), "lora_alpha='big'"),
  "r-wrong": (lambda f: _edit_config(f, r=8), "does not fit this model's"),
  "no-weights": (lambda f: (f / "adapter_model.safetensors").unlink(), "no such file"),
  "nan": (lambda f: _edit_tensors(f, _nan), "holds non-finite values"),
  "int32": (
    lambda f: _edit_tensors(f, lambda t: t.update({k: v.astype(np.int32) for k, v in t.items()})),
    "holds dtype int32; LoRA weights are floating-point",
  ),
  "unpaired": (lambda f: _edit_tensors(f, _unpaired), "is missing beside its pair"),
  "beyond-layers": (lambda f: _edit_tensors(f, _beyond), "matches no projection of this model"),
  "wrong-shape": (lambda f: _edit_tensors(f, _wrong_shape), "does not fit this model's"),
  "adapter-name": (lambda f: _edit_tensors(f, _adapter_name), "keeps the adapter name 'default'"),
  "lm-head": (lambda f: _edit_tensors(f, _head), "lora_A.weight adapts lm_head; this model's"),
  "embedding": (lambda f: _edit_tensors(f, _embedding), "lora_embedding_A adapts an embedding"),
  "transposed": (lambda f: _edit_tensors(f, _transposed), "does not fit this model's"),
  "targets-fewer": (
    lambda f: _edit_config(f, target_modules=["q_proj"]),
    ", outside target_modules=['q_proj']",
  ),
  "layers-it-lacks": (
    lambda f: _edit_config(f, layers_to_transform=[5]),
    "layers_to_transform=[5]; allowed: layer indices in [0, 2)",
  ),
  "layers-fewer": (
    lambda f: _edit_config(f, layers_to_transform=[1]),
    "the weights adapt layer 0, outside layers_to_transform=[1]",
  ),
  "dropout-text": (lambda f: _edit_config(f, lora_dropout="abc"), "lora_dropout='abc'; it is a"),
  "dropout-5": (lambda f: _edit_config(f, lora_dropout=5.0), "lora_dropout=5.0; it is a number"),
  "r-huge": (lambda f: _edit_config(f, r=10**7), "does not fit this model: r=10000000"),
}


def _edit_config(folder, **changes):
  config = json.loads((folder / "adapter_config.json").read_text())
  config.update(changes)
  (folder / "adapter_config.json").write_text(json.dumps(config))


def test_a_target_list_with_an_entry_no_module_matches_loads_as_peft_loads_it(tmp_path):
  """PEFT skips a target_modules entry no module matches while another does (a list shared
  across architectures): such adapters load, as the same adapters without the entry."""
  from jaxrl_llm.models import hf, hf_adapters

  cfg, base = hf.load_checkpoint(HF_LLAMA)
  folder = pathlib.Path(shutil.copytree(PEFT_FIXTURE, tmp_path / "shared"))
  targets = json.loads((folder / "adapter_config.json").read_text())["target_modules"]
  _edit_config(folder, target_modules=[*targets, "query_key_value"])
  got_cfg, got = hf_adapters.load_adapters(folder, cfg, base)
  want_cfg, want = hf_adapters.load_adapters(PEFT_FIXTURE, cfg, base)
  assert got_cfg == want_cfg
  jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.mark.parametrize("case", list(BAD_ADAPTERS))
def test_a_bad_peft_directory_is_one_error_naming_its_file(tmp_path, case):
  """Adapters with NaN, int32 or unpaired tensors, or for layers the model lacks, loaded
  without a word (the last two as zero adapters); a config without r, or of the wrong shape,
  and a missing weights file raised KeyError, reshape or FileNotFoundError naming nothing. A
  state dict's adapter name, an lm_head or embedding adapter were a model-config error
  naming lora_targets."""
  from jaxrl_llm.models import hf, hf_adapters, hf_config

  cfg, base = hf.load_checkpoint(HF_LLAMA)
  folder = tmp_path / case
  shutil.copytree(PEFT_FIXTURE, folder)
  edit, says = BAD_ADAPTERS[case]
  edit(folder)
  with pytest.raises(hf_config.CheckpointFormatError) as err:
    hf_adapters.load_adapters(folder, cfg, base)
  assert str(err.value).startswith(str(folder / "adapter_")) and says in str(err.value), err.value


def test_peft_adapters_on_routed_experts_are_refused_naming_the_tensor(tmp_path):
  """PEFT adapts every expert whose module name a target ends (`gate_proj` reaches
  `mlp.experts.E.gate_proj` in Qwen3-MoE); this model adapts no routed expert. Such adapters
  were dropped without a word (expert 0's) or named as matching no projection (the others)."""
  from safetensors.numpy import save_file

  from jaxrl_llm.models import hf, hf_adapters, hf_config

  cfg, base = hf.load_checkpoint(REPO / "tests" / "fixtures" / "hf" / "qwen3_moe")
  rng, r = np.random.default_rng(0), 2
  config = {"peft_type": "LORA", "r": r, "lora_alpha": 4, "target_modules": ["q_proj"]}
  q = "base_model.model.model.layers.0.self_attn.q_proj"
  q_out = cfg.num_heads * cfg.head_dim
  tensors = {
    f"{q}.lora_A.weight": rng.normal(size=(r, cfg.d_model)).astype(np.float32),
    f"{q}.lora_B.weight": rng.normal(size=(q_out, r)).astype(np.float32),
  }
  folder = tmp_path / "attention"
  folder.mkdir()
  (folder / "adapter_config.json").write_text(json.dumps(config))
  save_file(tensors, str(folder / "adapter_model.safetensors"))
  adapted_cfg, _ = hf_adapters.load_adapters(folder, cfg, base)  # the control: attention loads
  assert adapted_cfg.lora_rank == r
  for expert in (0, 3):
    e = f"base_model.model.model.layers.1.mlp.experts.{expert}.gate_proj"
    more = {
      f"{e}.lora_A.weight": rng.normal(size=(r, cfg.d_model)).astype(np.float32),
      f"{e}.lora_B.weight": rng.normal(size=(cfg.moe_expert_mlp_dim, r)).astype(np.float32),
    }
    folder = tmp_path / f"expert{expert}"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(
      json.dumps({**config, "target_modules": ["q_proj", "gate_proj"]})
    )
    save_file({**tensors, **more}, str(folder / "adapter_model.safetensors"))
    with pytest.raises(hf_config.CheckpointFormatError) as err:
      hf_adapters.load_adapters(folder, cfg, base)
    assert str(err.value) == (
      f"{folder / 'adapter_model.safetensors'}: tensor {e}.lora_A.weight adapts a routed "
      "expert; this model's adapters are on attention, dense MLP and shared-expert projections "
      "only (train the adapters without the experts' modules in target_modules)"
    )


@pytest.mark.extended
def test_the_memory_plan_holds_adam_moments_for_the_adapters_only():
  """`plan.plan` (the `--dry_run`) of a run with adapters: its resident state is the weights
  plus twice the adapters (Adam's moments), where full training holds three times the weights."""

  full = parsed.plan(parse_config(tiny_config()), devices=jax.devices()[:1])
  adapted_config = parse_config(tiny_config(**{"model.lora_rank": 4}))
  adapted = parsed.plan(adapted_config, devices=jax.devices()[:1])
  exp = build(adapted_config, abstract=True, devices=jax.devices()[:1])
  base, adapters = lora.split_adapters(exp.state.params)
  nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731
  assert adapted.argument_bytes - full.argument_bytes == pytest.approx(
    3 * nbytes(adapters) - 2 * nbytes(base), rel=0.01
  )


@pytest.mark.extended
def test_the_export_merges_the_adapters_onto_the_base_the_checkpoint_records(tmp_path):
  """A run with adapters on a random base: its checkpoint records the base's seed; editing
  config.json's seed afterwards does not move the export onto another base, and a
  config.json whose model no longer fits the checkpoint is refused in one line."""
  from jaxrl_llm.models import hf

  sys.path.insert(0, str(REPO / "tools"))
  import hf_convert

  config = tiny_config(**{"model.lora_rank": 4, "train.num_steps": 2, "rl.entropy_coef": 0.01})
  train_and_evaluate(config, str(tmp_path))
  exp = build(config)
  abstract, _ = resume_target(exp.stored(exp.state), exp.meta)
  with Checkpointer(str(tmp_path), save_every=0, async_save=False) as ckpt:
    _, stored, _ = ckpt.restore_latest(abstract)
  merged = lora.merged(jax.device_get(exp.from_stored(stored).params), 16.0 / 4)
  record_path = tmp_path / "config.json"
  record = json.loads(record_path.read_text())
  record["config"]["seed"] = 7  # another base, were the seed read from here
  record_path.write_text(json.dumps(record))
  hf_convert.main(["export", f"--workdir={tmp_path}", f"--out={tmp_path / 'hf'}"])
  exported = hf.load_checkpoint(tmp_path / "hf")[1]
  for path, value in _leaves(merged).items():
    np.testing.assert_allclose(_leaves(exported)[path], value, rtol=1e-6, err_msg=str(path))
  record["config"]["model"]["mlp_dim"] *= 2
  record_path.write_text(json.dumps(record))
  with pytest.raises(hf_convert.ConvertError, match="its model differs from the checkpoint"):
    hf_convert.main(["export", f"--workdir={tmp_path}", f"--out={tmp_path / 'hf2'}"])
