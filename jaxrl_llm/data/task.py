"""`Task`: the one interface the training loop uses, for built-in and file tasks alike.

A task supplies prompts (a checkpointable training iterator and a fixed evaluation set), the
static sizes the programs are compiled for, and the reward terms of its completions. Where
the rewards are computed is said by `rewards_on_host`:

  * in-graph (False; the built-in tasks of `tasks/`): `reward_terms` is a pure-JAX verifier
    that runs inside the fused jitted step, and `host_reward_terms` is None;
  * on the host (True; `file_task.FileTask`): the jitted sampler's completions are decoded and
    scored by `host_reward_terms` (Python verifiers), then the jitted learner runs, and
    `reward_terms` is None.

Only the assembly of the programs (the fused step or sample → host → learn; the evaluation
program) reads `rewards_on_host`; the loop itself treats every task alike.

Batches are dicts of numpy arrays holding ``tokens`` [P, S] int32 and ``mask`` [P, S] bool.
In-graph tasks add ``answer`` / ``answer_mask`` [P, A] (answer tokens, checked on device);
host tasks add ``answer`` [P], the reference answers as Python strings, which stay on the host.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import grain
import jax
import numpy as np

# (prompt_tokens [B, S], completion [B, T], completion_mask [B, T], answer [B, A],
#  answer_mask [B, A]) -> {term: [B] float32}, traced inside the jitted step.
InGraphRewardFn = Callable[..., dict[str, jax.Array]]
# (completion tokens [B, T], reference answers [B]) -> ({term: [B] float32}, verifier counts).
HostRewardFn = Callable[[np.ndarray, Sequence[str]], tuple[dict[str, np.ndarray], dict[str, float]]]


@runtime_checkable
class Task(Protocol):
  """What training needs from a task; the built-in tasks and `FileTask` implement it.

  Attributes:
    name: the task's name, shown in messages.
    tokenizer: its tokenizer (``eos_id``, ``pad_id``, ``vocab_size``, ``decode``).
    prompt_len: S, the static prompt length (prompts are left-padded to it).
    answer_len: A, the width of the device batch's ``answer`` (1 for host tasks, whose
      answers stay on the host).
    max_new_tokens: the completion budget T used when ``sampling.max_new_tokens`` is 0.
    rewards_on_host: whether `host_reward_terms` (True) or `reward_terms` (False) scores.
    data_stats: ``data/...`` scalars about the data read (records, too long, kept), logged at
      step 0; filled by `train_iterator`, empty for the built-in tasks.
    reward_terms: the pure-JAX verifier ``(prompt_tokens, completion, completion_mask,
      answer, answer_mask) -> {term: [B] float32}`` (with a ``correct`` term), or None.
    host_reward_terms: the host verifier ``(completion tokens [B, T], references [B]) ->
      ({term: [B] float32}, {count name: number})`` (with a ``correct`` term), or None.
  """

  name: str
  tokenizer: Any
  prompt_len: int
  answer_len: int
  max_new_tokens: int
  rewards_on_host: bool
  data_stats: Mapping[str, float]
  reward_terms: InGraphRewardFn | None
  host_reward_terms: HostRewardFn | None

  @abc.abstractmethod
  def train_iterator(
    self, batch_size: int, seed: int, shard_index: int = 0, shard_count: int = 1, setting=""
  ) -> grain.DatasetIterator:
    """Checkpointable iterator of this process's training batches (``batch_size`` rows each),
    shuffled by ``seed``; shard ``shard_index`` of ``shard_count`` reads its own rows of the
    same global batches. ``setting`` names the config value behind ``batch_size`` in a
    refusal (a dataset too small for it)."""

  @abc.abstractmethod
  def eval_set(self, multiple_of: int = 1) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """(the held-out evaluation batch, its reference answers for the host verifier or None).

    Host tasks trim the set to a multiple of ``multiple_of`` rows; in-graph tasks return
    their fixed held-out set as it is (config validation keeps ``task.eval_size`` a multiple
    of the data-parallel devices).
    """

  @abc.abstractmethod
  def describe(self, prompt: np.ndarray, completion: np.ndarray) -> tuple[str, str]:
    """Readable (prompt, completion) text of one row, for the TensorBoard samples table."""
