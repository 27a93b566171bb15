"""Held-out evaluation: greedy accuracy, pass@k and sample accuracy at the sampling
temperature, and the greedy completions' length; on the host-reward path also the mean of each
reward term over the greedy completions (`eval/reward/<term>`)."""

from __future__ import annotations

import functools
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_llm import distributed, sharding
from jaxrl_llm.config import Config
from jaxrl_llm.sampling import sample, with_values
from jaxrl_llm.turns import final_segment
from jaxrl_llm.types import PromptBatch


def pass_at(correct: jax.Array, j: int) -> jax.Array:
  """The unbiased pass@j estimate from k >= j samples per prompt (`correct` [P, k], 0/1):
  the mean over prompts of 1 - C(k - c, j) / C(k, j), c a prompt's correct samples."""
  k = correct.shape[1]
  c = correct.sum(axis=1).astype(jnp.float32)
  i = jnp.arange(j, dtype=jnp.float32)
  ratio = jnp.maximum(k - c[:, None] - i, 0.0) / (k - i)
  # Exactly 1 without a correct sample: a compiled division may be a reciprocal times the
  # numerator, a hair under 1, and a product of j of them read as pass@j > 0 (or < 0).
  none = jnp.prod(jnp.where(c[:, None] > 0, ratio, 1.0), axis=1)
  return jnp.mean(jnp.clip(1.0 - none, 0.0, 1.0))


def _summarise(acc, pk, lengths, k: int) -> dict:
  """The evaluation's scalars from per-prompt correctness (greedy [P], sampled [P, k]): pass@k,
  and the unbiased pass@j of every power of two j < k from the same samples (a pass@k curve;
  pass@1 is the sample accuracy)."""
  out = {
    "eval/accuracy": jnp.mean(acc),
    f"eval/pass@{k}": jnp.mean(jnp.max(pk, axis=1)),
    "eval/sample_accuracy": jnp.mean(pk),
    "eval/length_mean": jnp.mean(lengths.astype(jnp.float32)),
  }
  for j in (2**e for e in range(1, max(k - 1, 1).bit_length())):
    if j < k:
      out[f"eval/pass@{j}"] = pass_at(pk, j)
  return out


def _correct(task, rollout, batch: PromptBatch, g: int):
  """The in-graph verifier's `correct` term of each of `g` completions per prompt."""
  answer = jnp.repeat(batch.answer, g, axis=0)
  answer_mask = jnp.repeat(batch.answer_mask, g, axis=0)
  tokens, mask = final_segment(rollout)  # after a tool's last answer (multi-turn)
  terms = task.reward_terms(rollout.prompt_tokens, tokens, mask, answer, answer_mask)
  return terms["correct"]


def _eval_program(model, task, cfg: Config, mesh, rules, runs: int, param_axes):
  """The evaluation's device program `(params, batch, rng, values)`: greedy and pass@k sampling
  of the held-out prompts, scored inside (a pure-JAX verifier) or returned as tokens and
  lengths (a host verifier); vmapped over a pack's runs (`make_eval_fn`)."""
  groups, at_once = mesh.shape[sharding.RUNS_AXIS], cfg.mesh.runs_at_once
  vmapped = runs and not sharding.in_turn(at_once, groups)
  axis = sharding.PACK_AXIS if vmapped else None  # a vmapped pack's decode loops stop together
  sampler = functools.partial(
    cfg.sampling.sampler, task, tool_timeout_s=cfg.data.verifier_timeout_s
  )
  greedy_cfg = replace(sampler(greedy=True, group_size=1), loop_axis=axis)
  k = cfg.train.pass_k
  passk_cfg = replace(sampler(group_size=max(k, 1)), loop_axis=axis)
  repl = NamedSharding(mesh, PartitionSpec())
  host = task.rewards_on_host

  def eval_fn(params, batch: PromptBatch, rng, values):
    greedy = sample(model, params, batch.tokens, batch.mask, rng, with_values(greedy_cfg, values))
    sampled = sample(model, params, batch.tokens, batch.mask, rng, with_values(passk_cfg, values))
    if host:
      return greedy.tokens, sampled.tokens, greedy.lengths
    pk = _correct(task, sampled, batch, k).reshape(-1, k)
    return _summarise(_correct(task, greedy, batch, 1), pk, greedy.lengths, k)

  if runs:
    in_axes = (param_axes, None, 0, 0)
    eval_fn = sharding.vmap_runs(eval_fn, in_axes, at_once=at_once, groups=groups)
  jitted = jax.jit(sharding.traced_with_rules(eval_fn, mesh, rules), out_shardings=repl)
  return distributed.program(jitted, "evaluation", "the held-out evaluation")


def make_eval_fn(
  model, task, cfg: Config, mesh, rules=sharding.DEFAULT_RULES, runs=0, param_axes=0, own=None
):
  """Held-out evaluation `(params, batch, rng, answers=None, values=None) -> metrics`: greedy
  accuracy and pass@k at the sampling temperature (`values`: a packed run's own sampling
  values, traced, in place of the config's; a single run's default: `own`, its traced values
  (`run.assemble.own_values`), or None for the config's as constants).

  Sampling is one jitted program; a pure-JAX verifier runs inside it, a host verifier (file
  tasks) scores the decoded completions afterwards: `answers` are the eval set's host
  reference answers (None for in-graph tasks, whose answers are token arrays in `batch`).
  `runs` > 0: a pack's evaluation, vmapped over the runs axis of params, rng and values (the
  batch and answers are shared; `cfg.mesh.runs_at_once` of each device group's runs at a
  time); each metric gains a leading runs axis. `param_axes`: the
  params' vmap axes (`rl.step.run_axes`: None on a frozen base the runs share). Its `lower`
  lowers the device program for abstract arguments (`plan.plan(..., evaluation=True)`).
  """
  k, host = cfg.train.pass_k, task.rewards_on_host
  jitted = _eval_program(model, task, cfg, mesh, rules, runs, param_axes)

  def lower(params, batch: PromptBatch, rng, values=own):
    """The evaluation's device program lowered for these (abstract) arguments: a plan."""
    return jitted.lower(params, batch, rng, values)

  if not host:

    def device_eval(params, batch, rng, answers=None, values=own):
      return jitted(params, batch, rng, values)

    device_eval.lower = lower
    return device_eval

  def host_summary(greedy, sampled, lengths, answers):
    acc, _ = task.host_reward_terms(greedy, answers)
    pk, _ = task.host_reward_terms(sampled, np.repeat(answers, k))
    out = _summarise(acc["correct"], pk["correct"].reshape(-1, k), lengths, k)
    # Each host term of the greedy completions (a format rate beside the accuracy).
    return out | {f"eval/reward/{t}": jnp.mean(v) for t, v in acc.items() if t != "correct"}

  def host_eval(params, batch, rng, answers, values=own):
    greedy, sampled, lengths = jax.device_get(jitted(params, batch, rng, values))
    if not runs:
      return host_summary(greedy, sampled, lengths, answers)
    each = [host_summary(*out, answers) for out in zip(greedy, sampled, lengths, strict=True)]
    return {key: jnp.stack([m[key] for m in each]) for key in each[0]}

  host_eval.lower = lower
  return host_eval
