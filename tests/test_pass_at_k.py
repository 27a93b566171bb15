"""The held-out evaluation's pass@k curve: unbiased pass@j estimates from the k samples drawn
for pass@k, checked against counting every j-subset of the samples."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.run.evaluate import _summarise, pass_at


@pytest.mark.parametrize("k", [2, 4, 8])
def test_pass_at_j_is_the_share_of_j_subsets_with_a_correct_sample(k):
  rng = np.random.default_rng(k)
  correct = (rng.random((40, k)) < rng.random((40, 1))).astype(np.float32)
  for j in range(1, k + 1):
    subsets = list(itertools.combinations(range(k), j))
    want = np.mean([np.mean([row[list(s)].max() for s in subsets]) for row in correct])
    assert float(pass_at(jnp.asarray(correct), j)) == pytest.approx(want, rel=1e-5)


def test_the_evaluation_logs_pass_at_every_power_of_two_below_k_and_the_curve_rises():
  rng = np.random.default_rng(0)
  correct = jnp.asarray((rng.random((64, 16)) < 0.2).astype(np.float32))
  out = _summarise(jnp.zeros(64), correct, jnp.ones(64), 16)
  curve = [out["eval/sample_accuracy"], *(out[f"eval/pass@{j}"] for j in (2, 4, 8, 16))]
  assert sorted(k for k in out if k.startswith("eval/pass@")) == [
    "eval/pass@16", "eval/pass@2", "eval/pass@4", "eval/pass@8",
  ]  # fmt: skip
  assert all(float(a) < float(b) for a, b in itertools.pairwise(curve))
  assert float(out["eval/pass@16"]) == pytest.approx(float(jnp.mean(correct.max(axis=1))))


def test_pass_at_j_is_exactly_zero_without_a_correct_sample_and_never_falls_with_j():
  """Under jit, where a division may be a reciprocal times the numerator: no correct sample
  gives pass@j = 0 exactly for every j up to k = 1000 (each factor (k - i) / (k - i) was a hair
  under 1, so pass@512 read 4e-6 and pass@1000 0), and the curve never falls with j."""
  import jax

  k = 1000
  rows = np.zeros((3, k), np.float32)
  rows[1, :1] = 1.0  # one correct sample of 1000
  rows[2, :500] = 1.0
  js = (1, 2, 64, 512, 999, 1000)
  at = jax.jit(lambda c: jnp.stack([jax.vmap(lambda r, j=j: pass_at(r[None], j))(c) for j in js]))
  got = np.asarray(at(jnp.asarray(rows)))  # [len(js), 3]
  assert (got[:, 0] == 0.0).all(), got[:, 0]
  assert (np.diff(got[:, 1:], axis=0) >= 0).all() and (got <= 1.0).all()
  assert got[-1, 1] == got[-1, 2] == 1.0  # j = k: any correct sample is in the one subset
