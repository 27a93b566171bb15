"""One update per rollout: ℓ^old = sg[ℓ] replaces the old-policy forward with the same update."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import run_steps, tiny_config

from jaxrl_llm.config import parse

CASES = {
  "grpo": ("default", {}),
  "tis_bf16": ("default", {"correction.name": "tis_token", "sampling.param_dtype": "bfloat16"}),
  "kl_loss_micro": ("grpo", {"rl.num_microbatches": 2, "rl.entropy_coef": 0.01}),
}


@pytest.mark.extended  # ~35 s each; the old-pass decision itself is tested below
@pytest.mark.parametrize("case", sorted(CASES))
def test_skipping_the_old_pass_gives_the_same_update(case):
  base, extra = CASES[case]
  over = {"rl.num_minibatches": 1, "optim.warmup_steps": 0, **extra}
  skip = tiny_config(base, **over)
  full = tiny_config(base, **over, **{"rl.old_pass": "always"})
  assert parse(skip).learner.skips_old_pass(is_moe=False)
  assert not parse(full).learner.skips_old_pass(is_moe=False)
  s_states, s_metrics = run_steps(skip, 2)
  f_states, f_metrics = run_steps(full, 2)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
    s_states[-1].params,
    f_states[-1].params,
  )
  for key in ("policy/loss", "optim/grad_norm", "policy/entropy", "behaviour/rho_mean"):
    for s, f in zip(s_metrics, f_metrics):
      np.testing.assert_allclose(s[key], f[key], rtol=1e-5, atol=1e-6, err_msg=key)
  if skip.kl.beta > 0:
    np.testing.assert_allclose(s_metrics[1]["kl/ref_kl"], f_metrics[1]["kl/ref_kl"], rtol=1e-4)


@pytest.mark.parametrize(
  "extra",
  [
    {"rl.num_minibatches": 2},
    {"rl.num_epochs": 2},
    {"correction.name": "mis_token"},
    {"kl.beta": 0.1, "kl.placement": "reward", "kl.name": "k1"},
  ],
)
def test_the_old_pass_stays_where_something_needs_it(extra):
  config = tiny_config(**{"rl.num_minibatches": 1, **extra})
  assert not parse(config).learner.skips_old_pass(is_moe=False)
  assert not parse(tiny_config(**{"rl.num_minibatches": 1})).learner.skips_old_pass(is_moe=True)
