"""KL reference policy (§4): no reference at β = 0, frozen, reset_every N and EMA updates."""

import itertools

import jax
import numpy as np
import pytest
from conftest import run_steps, tiny_config


def _run(config, steps):
  return run_steps(config, steps)[0]


def _equal(a, b):
  """Whether two parameter trees are equal leaf for leaf: both present, the same structure (a
  missing reference, None, is never equal to parameters) and every array bit for bit."""
  assert a is not None and b is not None
  if jax.tree.structure(a) != jax.tree.structure(b):
    return False
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_beta_zero_has_no_reference_model():
  history = _run(tiny_config(**{"kl.beta": 0.0}), 1)
  assert history[0].ref_params is None and history[-1].ref_params is None


@pytest.mark.extended
def test_frozen_reference_stays_at_the_initial_policy():
  # The untrained tiny policy earns no reward (zero advantages): the entropy bonus moves it.
  history = _run(tiny_config(**{"kl.beta": 0.05, "rl.entropy_coef": 0.01}), 2)
  assert _equal(history[-1].ref_params, history[0].params)
  assert not _equal(history[-1].params, history[0].params)


@pytest.mark.extended
def test_reset_every_copies_the_policy():
  history = _run(
    tiny_config(
      **{
        "kl.beta": 0.05,
        "kl.reference": "reset_every",
        "kl.reset_every": 2,
        "rl.entropy_coef": 0.01,
      }
    ),
    3,
  )
  assert _equal(history[1].ref_params, history[0].params)  # step 1: not yet
  assert _equal(history[2].ref_params, history[2].params)  # step 2: reset to the policy
  assert _equal(history[3].ref_params, history[2].params)  # step 3: held until the next reset
  assert not _equal(history[3].params, history[2].params)  # (while the policy moves)


@pytest.mark.extended
def test_ema_reference():
  alpha = 0.25
  history = _run(
    tiny_config(
      **{"kl.beta": 0.05, "kl.reference": "ema", "kl.ema": alpha, "rl.entropy_coef": 0.01}
    ),
    2,
  )
  for prev, cur in itertools.pairwise(history):
    assert prev.ref_params is not None and cur.ref_params is not None
    want = jax.tree.map(lambda r, p: alpha * p + (1 - alpha) * r, prev.ref_params, cur.params)
    jax.tree.map(
      lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7), cur.ref_params, want
    )
