"""Shared dataclasses and the dimension-letter glossary.

Dimension letters used in shape comments and einsum strings throughout the package:

  P  prompts per batch            G  completions per prompt (group size)
  B  sequences (B = P * G)        S  prompt length (left-padded)
  T  completion length            N  S + T, the full sequence length
  V  vocabulary                   D  model width
  H  query heads                  J  key/value heads (grouped-query attention)
  Dh head width                   F  MLP hidden width
  L  layers                       K  top-k (experts)       E  experts
  A  answer length (task targets)

One word per concept:

  run           one experiment's training: one config, its own folder of events and records
  pack          runs of one grid trained together as one program over a leading runs axis
  trainee       what the loop trains (`run.loop.train`): a single run (a pack of one) or a pack
  member        one run of a trainee as its user sees it: name, folder, events, log lines
  step          one RL update (sampling and learning in one jitted program)
  fresh state   the TrainState before any step (`run.assemble`)
  start state   what a launch continues from: the newest checkpoint that verifies, else the
                warm start, else the fresh state (`run.loop`)
  stored state  what a checkpoint holds of the state (under adapters, the adapters alone)
  learner sections  the config sections the learner is built from (`config.Settings.sections`)
  learned setting   a setting whose change blocks a resume (`config.blocks_resume`)
  traced setting    a setting a pack may vary that enters the step as a per-run value
"""

from __future__ import annotations

from typing import Any

import jax
from flax import struct

PyTree = Any


@struct.dataclass
class PromptBatch:
  """A batch of left-padded prompts and the task's reference answers."""

  tokens: jax.Array  # [P, S] int32, left-padded with the pad id
  mask: jax.Array  # [P, S] bool, True on real prompt tokens
  answer: jax.Array  # [P, A] int32, reference answer tokens (task-defined), pad-filled
  answer_mask: jax.Array  # [P, A] bool, True on real answer tokens


@struct.dataclass
class Rollout:
  """What the sampler produced for B = P * G sequences (spec §0)."""

  prompt_tokens: jax.Array  # [B, S] int32, left-padded prompts (each repeated G times)
  prompt_mask: jax.Array  # [B, S] bool
  tokens: jax.Array  # [B, T] int32, generated tokens; pad after EOS
  loss_mask: jax.Array  # [B, T] float32, 1 on the policy's tokens through EOS (0 on tool answers)
  lengths: jax.Array  # [B] int32, tokens generated (= loss_mask.sum(-1) without a tool)
  truncated: jax.Array  # [B] bool, True when max_new_tokens was reached without EOS
  logprobs: jax.Array  # [B, T] float32, ℓ^μ: sampler log-prob of each token (0 on padding)
  decode_steps: jax.Array  # [] int32, decode iterations run (< T when all finished early)
  routing: jax.Array | None = None  # [B, S+T, Lm, K] experts each processed token used (MoE)
  env_mask: jax.Array | None = None  # [B, T] float32, 1 on tool answers' tokens (multi-turn)
  tool_calls: jax.Array | None = None  # [B] int32, tool calls each row made (multi-turn)
  tool_errors: jax.Array | None = None  # [B] int32, calls the tool could not evaluate


@struct.dataclass
class TrainState:
  """Everything the RL update mutates; a checkpoint saves exactly this."""

  step: jax.Array  # [] int32, completed RL updates
  params: PyTree  # policy parameters
  opt_state: PyTree  # optax state
  ref_params: PyTree | None  # reference policy for KL (None when beta == 0)
  rng: jax.Array  # base PRNG key of the run; per-step keys are fold_in(rng, step)


@struct.dataclass
class PolicyBatch:
  """What the learner's optimiser steps consume, one row per sequence (spec §0-§5, §9).

  Every leaf has the batch dimension first, so minibatching is `jax.tree.map(lambda x: x[idx])`.
  Optional fields are None when the configuration does not use them (no leaves, no cost).
  """

  prompt_tokens: jax.Array  # [B, S] int32
  prompt_mask: jax.Array  # [B, S] bool
  tokens: jax.Array  # [B, T] int32, the completions
  loss_mask: jax.Array  # [B, T] float32 m: generated tokens of kept groups (§0, §6, §7)
  old_logp: jax.Array | None  # [B, T] float32 ℓ^old (None: sg[ℓ] of the learner's pass, §0)
  adv: jax.Array  # [B] or [B, T] float32 advantages (§1)
  weight: jax.Array | None  # [B, T] float32 behaviour weight w (§3; None: computed in the loss)
  behaviour_logp: jax.Array | None = None  # [B, T] ℓ^μ, when w is computed in the loss
  ref_logp: jax.Array | None = None  # [B, T] ℓ^ref (KL in the loss, §4)
  old_values: jax.Array | None = None  # [B, T] V of the old pass (critic, §2.9)
  returns: jax.Array | None = None  # [B, T] GAE returns (critic, §2.9)
  sampler_routing: jax.Array | None = None  # [B, S+T, Lm, K] sampler's experts (MoE)
  old_routing: jax.Array | None = None  # [B, S+T, Lm, K] old policy's experts (MoE)
  old_router_logp: jax.Array | None = None  # [B, S+T, Lm, K] old router log-probs of those
  replay: jax.Array | None = None  # [B, S+T, Lm, K] experts the learner must use (§9 r2/r3)
