"""Learner slices sized by the device: `rl.microbatch_tokens=auto` (`plan.auto_learner`) takes
the fewest microbatches whose compile-only plan fits the device's memory with a margin, and
`rl.remat=auto` beside it the least recomputation (none, attention, full) that fits in few
slices. The plans are real compiles of the fused step on this machine's CPU."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, cli_env, tiny_config
from parsed import build
from text_fixtures import math_file_run

from jaxrl_llm import plan
from jaxrl_llm.config import ConfigError, parse
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.transformer import ATTENTION_NAMES, Transformer

ROWS = 64  # a device's minibatch rows: 8 prompts x 8, one minibatch


@pytest.fixture(scope="module")
def config():
  overrides = {"rl.num_prompts": 8, "sampling.group_size": 8, "rl.num_minibatches": 1}
  overrides |= {"model.d_model": 64, "model.mlp_dim": 512, "model.num_layers": 2}
  return parse(tiny_config(**overrides))


@pytest.fixture(scope="module")
def peaks(config):
  """{(remat, microbatches): the plan's peak bytes per device} on one CPU device."""
  out = {}
  for remat in ("none", "attention"):
    for k in (1, 2, 4, 8):
      rl = dataclasses.replace(config.rl, num_microbatches=k, remat=remat)
      out[remat, k] = plan.plan(dataclasses.replace(config, rl=rl), jax.devices()[:1]).peak_bytes
  return out


def _capacity(peak: float) -> int:
  """A capacity whose auto budget is just above `peak`."""
  return int(peak / (1 - plan.AUTO_MARGIN)) + 1


def test_the_search_finds_the_fewest_slices_whatever_the_guess():
  """`plan._fewest` over every threshold and every guess (right, low, high, none, not a
  divisor): the smallest divisor that fits, or None, no plan made twice; one plan where the
  first fits, two more where the guess is right or one short."""
  divisors = [1, 2, 4, 8, 16, 32, 64]
  for need in [*divisors, None]:  # None: nothing fits
    for g in [*divisors, 3, None]:
      calls = []

      def fits(k, need=need, calls=calls):
        calls.append(k)
        return need is not None and k >= need

      assert plan._fewest(divisors, fits, lambda g=g: g) == need, (need, g)
      assert len(calls) == len(set(calls))  # no plan compiled twice
      if need == 1:
        assert calls == [1]
      elif need is not None and g == need:
        assert calls == ([1, 2] if need == 2 else [1, need, need // 2])
      elif need is not None and g == need // 2 > 1:  # one short: the guess, then the one above
        assert calls == [1, g, need]
  calls = []
  assert plan._fewest(divisors, lambda k: calls.append(k) or k >= 8) == 8
  assert calls == [1, 64, 8, 4]  # without a guess: the largest, then bisection


@pytest.mark.extended
def test_the_attention_remat_keeps_the_attention_alone_and_changes_no_number():
  cfg = ModelConfig(
    vocab_size=64, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64
  )
  tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, 64)
  pos = jnp.broadcast_to(jnp.arange(8), (2, 8))
  valid = jnp.ones((2, 8), bool)
  params = Transformer(cfg).init(jax.random.key(0), tokens, pos, valid)["params"]

  def loss(remat):
    model = Transformer(cfg, remat=remat)
    return lambda p: jnp.sum(jnp.sin(model.apply({"params": p}, tokens, pos, valid).logits))

  def kept(remat):
    """What the backward keeps (one line per residual, with where it comes from)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      jax.ad_checkpoint.print_saved_residuals(loss(remat), params)
    return out.getvalue().strip().splitlines()

  full, attn, none = kept("full"), kept("attention"), kept("none")
  named = sorted(w.split("named '")[1].split("'")[0] for w in attn if "named '" in w)
  assert named == sorted(ATTENTION_NAMES)
  assert sorted(set(attn) - set(full)) == sorted(w for w in attn if "named '" in w)
  assert len(full) < len(attn) < len(none)  # between keeping nothing and keeping everything
  reference = jax.grad(loss("none"))(params)
  for x, y in zip(jax.tree.leaves(jax.grad(loss("attention"))(params)), jax.tree.leaves(reference)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)


@pytest.mark.extended
def test_auto_takes_the_fewest_slices_whose_plan_fits(config, peaks):
  assert peaks["none", 1] > peaks["none", 2] > peaks["none", 4]  # slices lower the peak
  none = dataclasses.replace(config, rl=dataclasses.replace(config.rl, remat="none"))
  cpu = jax.devices()[:1]
  k, remat, tried = plan.auto_learner(none, ROWS, cpu, capacity_bytes=_capacity(peaks["none", 2]))
  assert (k, remat) == (2, "none")
  assert all(t["fits"] == (t["peak_bytes"] <= peaks["none", 2]) for t in tried)
  k, _, tried = plan.auto_learner(none, ROWS, cpu, capacity_bytes=_capacity(peaks["none", 1]))
  assert k == 1
  assert len(tried) == 1  # a device that holds the whole minibatch costs one plan
  with pytest.raises(ConfigError, match=r"rl.microbatch_tokens=auto: no microbatching fits"):
    plan.auto_learner(none, ROWS, cpu, capacity_bytes=_capacity(peaks["none", 8] // 2))


@pytest.mark.extended
def test_auto_remat_recomputes_more_only_where_less_needs_many_slices(config, peaks):
  """Where no remat fits only in 8 slices and attention-only remat in 4, auto takes the
  latter; where no remat fits in 2, it takes that."""
  assert peaks["attention", 4] < peaks["none", 4]  # keeping less lowers the peak
  cpu = jax.devices()[:1]
  capacity = _capacity(peaks["attention", 4])
  assert peaks["none", 8] <= (1 - plan.AUTO_MARGIN) * capacity < peaks["none", 4]
  assert plan.auto_learner(config, ROWS, cpu, capacity_bytes=capacity)[:2] == (4, "attention")
  capacity = _capacity(peaks["none", 2])
  assert plan.auto_learner(config, ROWS, cpu, capacity_bytes=capacity)[:2] == (2, "none")


@pytest.mark.extended
def test_a_run_with_auto_slices_builds_with_the_planned_choice():
  """The trainer resolves auto at build time (this machine's memory holds a tiny run whole);
  a bad value is one line."""
  exp = build(parse(tiny_config(**{"rl.microbatch_tokens": "auto"})))
  rl = exp.program.learner.settings.rl
  assert (rl.num_microbatches, rl.remat) == (1, "none")
  with pytest.raises(ConfigError, match=r"rl.microbatch_tokens='fast'; allowed: a number >= 1"):
    parse(tiny_config(**{"rl.microbatch_tokens": "fast"}))


@pytest.mark.extended  # about 20 s each: two command lines from an empty compilation cache
@pytest.mark.parametrize("packed", [False, True], ids=["run", "pack"])
def test_a_host_verifier_run_compiles_its_learner_once_the_plan_and_the_step_alike(
  tmp_path, packed
):
  """`rl.microbatch_tokens=auto` compiles the sampler and learner of a prompt-file run (host
  verifiers) to plan them; the run's own calls are those same programs, so with a persistent
  compilation cache they are loaded, not compiled again: the cache holds one learner and one
  sampler after a run of the command line, or a pack of two (`tools/sweep.py --packed`)."""
  overrides, _ = math_file_run(tmp_path)
  overrides |= {"train.num_steps": 1, "train.eval_every": 1, "train.checkpoint_every": 1}
  overrides |= {"rl.microbatch_tokens": "auto", "sft.steps": 0, "model.d_model": 32}
  overrides |= {"model.mlp_dim": 64, "rl.num_prompts": 2, "sampling.group_size": 4}
  cache = tmp_path / "xla_cache"
  env = cli_env("JAX_COMPILATION_CACHE_DIR")
  env |= {
    "JAX_COMPILATION_CACHE_DIR": str(cache),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
  }
  env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
  if packed:
    cmd = [sys.executable, "tools/sweep.py", "--config=configs/default.py", "--packed"]
    cmd += [f"--root={tmp_path / 'pack'}", "--grid=objective.clip_high=0.2,0.28", "--seeds=0"]
    cmd += ["--set=" + ",".join(f"{k}={v}" for k, v in overrides.items())]
  else:
    cmd = [sys.executable, "-m", "jaxrl_llm.main", "--config=configs/default.py"]
    cmd += [f"--workdir={tmp_path / 'run'}", *(f"--config.{k}={v}" for k, v in overrides.items())]
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "rl.microbatch_tokens=auto: 1 slice(s), remat none, from 1 plan(s)" in proc.stderr
  programs = [p.name.split("-")[0] for p in cache.glob("*-cache")]  # not the LRU's -atime
  assert programs.count("jit_learn") == 1, sorted(programs)
  assert programs.count("jit_sample_phase") == 1, sorted(programs)
