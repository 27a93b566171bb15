"""The sampler/learner mismatch dial (§3) and step-level gradient accumulation (§5)."""

import jax
import numpy as np
import pytest
from conftest import run_steps, tiny_config
from parsed import build

from jaxrl_llm import quant


def _one_step(config):
  states, metrics = run_steps(config, 1)
  return states[-1].params, metrics[-1]


@pytest.mark.extended
@pytest.mark.parametrize(
  "dtype",
  [
    "float32",
    "int8",  # bfloat16 and int4 samplers: tests/test_rl_on_policy.py, tests/test_lora.py
  ],
)
def test_sampler_precision_drives_mismatch_metrics(dtype):
  config = tiny_config(**{"sampling.param_dtype": dtype, "correction.name": "tis_token"})
  _, m = _one_step(config)
  if dtype == "float32":
    assert m["behaviour/mismatch_max"] <= 1e-6
    assert abs(m["behaviour/rho_max"] - 1) <= 1e-5
    assert abs(m["behaviour/kl_k3"]) <= 1e-6
  else:
    assert m["behaviour/mismatch_max"] > 1e-4
    assert m["behaviour/kl_k3"] > 0
    # tis_token weights min(ρ, C) are no longer all 1.
    assert abs(m["behaviour/rho_mean"] - 1) > 1e-6 or abs(m["behaviour/rho_max"] - 1) > 1e-4


@pytest.mark.parametrize(("dtype", "top"), [("int8", 127), ("int4", 7)])
def test_integer_copy_is_per_channel_and_close(dtype, top):
  config = tiny_config()
  exp = build(config)
  p = exp.state.params
  q = quant.sampler_params(p, dtype)
  w, wq = (
    np.asarray(p["layer_0"]["mlp"]["up"]["kernel"]),
    np.asarray(q["layer_0"]["mlp"]["up"]["kernel"]),
  )
  scale = np.abs(w).max(axis=0, keepdims=True) / top  # one scale per output channel
  levels = wq / scale
  np.testing.assert_allclose(levels, np.round(levels), atol=1e-3)
  assert np.abs(np.round(levels)).max() == top  # each channel's largest weight is +-top
  assert len(np.unique(np.round(levels))) <= 2 * top + 1
  assert np.max(np.abs(w - wq)) <= scale.max() / 2 + 1e-7
  assert not np.array_equal(w, wq)
  # Norm scales (1-D) are untouched.
  np.testing.assert_array_equal(q["final_norm"]["scale"], p["final_norm"]["scale"])


# A correction that rejects tokens (int8 sampler, tight cap) with KL and entropy terms, whose
# kept-token normaliser must also be computed once per minibatch (§3, §5).
REJECTING = {
  "sampling.param_dtype": "int8",
  "correction.name": "mis_token+geo_mask",
  "correction.cap": 1.02,
  "kl.beta": 0.05,
  "rl.entropy_coef": 0.01,
}


@pytest.mark.extended  # CI checks the loss level (tests/objectives/test_loss.py)
@pytest.mark.parametrize(
  ("aggregation", "extra"),
  [
    ("seq_mean_token_mean", {}),
    ("seq_mean_token_sum_norm", {}),
    ("seq_mean_token_sum_norm", {"aggregation.sum_norm_sequences": False}),  # verl's
    ("seq_mean_token_mean", REJECTING),
  ],
  ids=["seq_mean_token_mean", "sum_norm", "sum_norm_verl", "seq_rej"],
)
def test_microbatches_do_not_change_the_update(aggregation, extra):
  base = {"aggregation.name": aggregation, "rl.num_minibatches": 1, "optim.grad_clip": 0.0, **extra}
  p1, m1 = _one_step(tiny_config(**base, **{"rl.num_microbatches": 1}))
  p4, m4 = _one_step(tiny_config(**base, **{"rl.num_microbatches": 4}))
  if extra is REJECTING:
    assert m1["behaviour/frac_masked_tokens"] > 0  # some tokens are rejected
    np.testing.assert_allclose(m1["kl/loss"], m4["kl/loss"], rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(m1["optim/grad_norm"], m4["optim/grad_norm"], rtol=1e-5)
  np.testing.assert_allclose(m1["policy/loss"], m4["policy/loss"], rtol=1e-5, atol=1e-7)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), p1, p4)
