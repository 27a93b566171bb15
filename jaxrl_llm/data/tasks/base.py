"""`BuiltinTask`: the base class of the built-in synthetic tasks (a `data.task.Task`).

A task is a frozen (hashable) dataclass that owns a finite, indexable space of problems. Each
problem index maps to a prompt text and a reference answer text. A fixed hash of the problem's
split key holds out about ``holdout_fraction`` of the space; the evaluation set is drawn only from
held-out problems and the training set only from the rest, so the two are disjoint by
construction and the split does not depend on the training seed.

Example arrays (numpy, one row per problem):

  tokens       [N, S] int32  ``<pad>… <bos> prompt``, left-padded to ``prompt_len``
  mask         [N, S] bool   True on bos and prompt characters
  answer       [N, A] int32  ``answer <eos> <pad>…``, right-padded to ``answer_len``
  answer_mask  [N, A] bool   True on answer characters and the eos

Rewards are computed in-graph: ``reward_terms`` is a pure-JAX verifier of these arrays.
"""

from __future__ import annotations

import abc
import dataclasses
import zlib
from typing import ClassVar

import chex
import grain
import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.config.sections import TaskSettings
from jaxrl_llm.data import pipeline
from jaxrl_llm.data.task import Task
from jaxrl_llm.data.tasks.tokenizer import CharTokenizer

# The `task` config section declares every task field with its default and meaning, once.
TASK_DEFAULTS = TaskSettings()


def ranged(default, low: float, high: float):
  """A task field with its `default` and its allowed range [`low`, `high`] (field metadata that
  `BuiltinTask.field_errors` checks)."""
  return dataclasses.field(default=default, metadata={"range": (low, high)})


# The reward terms every built-in task's verifier returns (`BuiltinTask.reward_terms`): what
# `task.reward_weights` may weight without prompt files.
REWARD_TERMS = ("correct", "format", "partial")

# Problem spaces up to this size are enumerated; larger ones are sampled.
MAX_ENUMERATED_PROBLEMS = 1 << 22
# Training-set size used for sampled (non-enumerable) spaces when ``train_size`` is None.
DEFAULT_SAMPLED_TRAIN_SIZE = 1 << 20

_M64 = (1 << 64) - 1


def _mix64(x: np.ndarray, salt: int) -> np.ndarray:
  """SplitMix64 finaliser of ``x + salt``: a fixed, platform-independent 64-bit hash."""
  z = x.astype(np.uint64) + np.uint64((salt * 0x9E3779B97F4A7C15) & _M64)
  z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return z ^ (z >> np.uint64(31))


def tool_share(index: np.ndarray, share: float) -> np.ndarray:
  """Bool [N]: which problems' warm-start traces call the task's tool first, a fixed `share`
  of them by a hash of the problem index (`task.tool_traces`)."""
  u = (_mix64(np.asarray(index, np.int64), 0x7001) >> np.uint64(11)).astype(np.float64)
  return u * 2.0**-53 < share


@dataclasses.dataclass(frozen=True)
class BuiltinTask(Task):
  """Base class of a synthetic verifiable task (prompt source plus a pure-JAX verifier).

  Each task defines ``prompt_len`` (S: bos + longest prompt text) and ``answer_len`` (A:
  longest answer text + eos) of the `Task` interface, and ``num_problems``, ``answer_chars``
  and ``render`` below.

  Attributes:
    eval_size: number of held-out problems in ``eval_examples()`` (fewer if the held-out part
      of a small problem space is smaller: ``eval_shortfall`` says so, and the run warns).
    train_size: number of training problems; None means every non-held-out problem for spaces of
      at most ``MAX_ENUMERATED_PROBLEMS``, else ``DEFAULT_SAMPLED_TRAIN_SIZE`` sampled problems.
    holdout_fraction: fraction of the problem space reserved for evaluation.
    tokenizer: the character tokenizer shared by all built-in tasks.
  """

  name: ClassVar[str] = "task"
  rewards_on_host: ClassVar[bool] = False  # reward_terms runs inside the jitted step
  host_reward_terms: ClassVar[None] = None

  eval_size: int = TASK_DEFAULTS.eval_size
  train_size: int | None = None
  holdout_fraction: float = 0.1
  tokenizer: CharTokenizer = dataclasses.field(default_factory=CharTokenizer)

  def __post_init__(self):
    fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
    errors = self.field_errors(fields)
    if errors:
      raise ValueError(f"{self.name}: {errors[0]}")

  @classmethod
  def field_errors(cls, v: dict) -> list[str]:
    """Why the task's fields `v` (each init field's value) are out of range (empty: valid);
    the config's check (`config.sections.TaskSettings`) and the constructor both ask here."""
    out = [] if v["eval_size"] >= 1 else [f"task.eval_size={v['eval_size']} must be >= 1"]
    for f in dataclasses.fields(cls):
      low, high = f.metadata.get("range", (None, None))
      if low is not None and not low <= v[f.name] <= high:
        out.append(f"task.{f.name}={v[f.name]} must be in [{low}, {high}]")
    if v["train_size"] is not None and v["train_size"] < 1:
      out.append(f"train_size={v['train_size']} must be None or >= 1")
    if not 0.0 < v["holdout_fraction"] < 1.0:
      out.append(f"holdout_fraction={v['holdout_fraction']} must be in (0, 1)")
    return out

  # ---- what each task defines (and prompt_len, answer_len) ---------------------------------

  @property
  @abc.abstractmethod
  def num_problems(self) -> int:
    """Size of the problem space (problem indices are ``0 .. num_problems - 1``)."""

  @property
  @abc.abstractmethod
  def answer_chars(self) -> str:
    """Characters a well-formed answer may use (the ``format`` reward checks this)."""

  @abc.abstractmethod
  def render(self, index: np.ndarray) -> tuple[list[str], list[str]]:
    """Prompt texts (without bos) and answer texts (without eos) of problem indices [N]."""

  def split_key(self, index: np.ndarray) -> np.ndarray:
    """Key hashed for the train/eval split; problems sharing a key land on the same side."""
    return index

  def trivial_rules(self, prompts: list[str]) -> dict[str, list[str]]:
    """Answers of simple rules over the prompt texts (rule name -> one answer per prompt)
    that solve nothing in general; `trivial.trivial_table` scores them. None by default."""
    del prompts
    return {}

  @property
  def max_new_tokens(self) -> int:
    """Suggested completion budget T: exactly enough for the longest answer and its eos."""
    return self.answer_len

  # ---- split and example arrays -----------------------------------------------------------

  @property
  def _salt(self) -> int:
    return zlib.crc32(self.name.encode())

  def is_held_out(self, index: np.ndarray) -> np.ndarray:
    """Bool [N]: whether each problem index belongs to the held-out (evaluation) part."""
    return self.key_held_out(self.split_key(np.asarray(index, np.int64)))

  def key_held_out(self, key: np.ndarray) -> np.ndarray:
    """Bool [N]: whether each split key belongs to the held-out part."""
    h = _mix64(key, self._salt)
    return (h >> np.uint64(11)).astype(np.float64) * 2.0**-53 < self.holdout_fraction

  def _sample(self, rng: np.random.Generator, size: int, held_out: bool) -> np.ndarray:
    """Draws ``size`` indices (with replacement) from one side of the split."""
    out, have = [], 0
    while have < size:
      cand = rng.integers(0, self.num_problems, size=2 * size + 64, dtype=np.int64)
      cand = cand[self.is_held_out(cand) == held_out]
      out.append(cand)
      have += cand.size
    return np.concatenate(out)[:size]

  def train_indices(self, seed: int) -> np.ndarray:
    """Training problem indices [N] for ``seed`` (order shuffled by the seed)."""
    rng = np.random.default_rng([self._salt, 1, seed])
    if self.num_problems <= MAX_ENUMERATED_PROBLEMS:
      idx = np.arange(self.num_problems, dtype=np.int64)
      idx = rng.permutation(idx[~self.is_held_out(idx)])
      if self.train_size is not None:
        if self.train_size > idx.size:
          raise ValueError(
            f"{self.name}: train_size={self.train_size} exceeds the {idx.size} training "
            "problems of this configuration."
          )
        idx = idx[: self.train_size]
      return idx
    return self._sample(rng, self.train_size or DEFAULT_SAMPLED_TRAIN_SIZE, held_out=False)

  def eval_indices(self) -> np.ndarray:
    """Evaluation problem indices [N <= eval_size]: a fixed subset of the held-out part, one
    problem per split key (no two are the same problem, or reorderings of one)."""
    rng = np.random.default_rng([self._salt, 2])
    if self.num_problems <= MAX_ENUMERATED_PROBLEMS:
      idx = np.arange(self.num_problems, dtype=np.int64)
      idx = rng.permutation(idx[self.is_held_out(idx)])
    else:
      idx = self._sample(rng, 4 * self.eval_size, held_out=True)
    _, first = np.unique(self.split_key(idx), return_index=True)
    idx = idx[np.sort(first)][: self.eval_size]
    if idx.size == 0:
      raise ValueError(f"{self.name}: the held-out part of the problem space is empty.")
    return idx

  @property
  def num_train(self) -> int:
    """Training problems: the length of ``train_indices`` (the same for every seed)."""
    if self.num_problems > MAX_ENUMERATED_PROBLEMS:
      return self.train_size or DEFAULT_SAMPLED_TRAIN_SIZE
    n = int(np.count_nonzero(~self.is_held_out(np.arange(self.num_problems, dtype=np.int64))))
    return n if self.train_size is None else min(n, self.train_size)

  @property
  def space(self) -> str:
    """The task with the fields that shape its problem space: ``addition with digits=1``."""
    base = {f.name for f in dataclasses.fields(BuiltinTask)}
    own = [f.name for f in dataclasses.fields(self) if f.init and f.name not in base]
    shown = ", ".join(f"{k}={getattr(self, k)}" for k in own if not k.endswith("_traces"))
    return f"{self.name} with {shown}" if shown else self.name

  def eval_shortfall(self) -> str | None:
    """One line saying the held-out evaluation holds fewer prompts than ``eval_size`` and why
    (the held-out part of a small problem space is smaller); None when it holds them all."""
    n = len(self.eval_indices())
    if n >= self.eval_size:
      return None
    return (
      f"held-out evaluation: {n} prompts, fewer than task.eval_size={self.eval_size}: the "
      f"held-out split of {self.space} has only {n} problems (its problem space is smaller)"
    )

  def examples(self, index: np.ndarray) -> dict[str, np.ndarray]:
    """Example arrays (see module docstring) for the given problem indices [N]."""
    prompts, answers = self.render(np.asarray(index, np.int64))
    tok = self.tokenizer
    tokens, mask = tok.encode_batch(prompts, self.prompt_len, bos=True, eos=False, left_pad=True)
    answer, answer_mask = tok.encode_batch(
      answers, self.answer_len, bos=False, eos=True, left_pad=False
    )
    return {"tokens": tokens, "mask": mask, "answer": answer, "answer_mask": answer_mask}

  def train_examples(self, seed: int = 0) -> dict[str, np.ndarray]:
    """Training example arrays; disjoint from ``eval_examples()`` for every seed."""
    return self.examples(self.train_indices(seed))

  def eval_examples(self) -> dict[str, np.ndarray]:
    """Deterministic evaluation example arrays drawn from the held-out problems."""
    return self.examples(self.eval_indices())

  # ---- the Task interface's data side -----------------------------------------------------

  @property
  def data_stats(self) -> dict[str, float]:
    """No statistics: problems are generated, none are read or dropped."""
    return {}

  def train_iterator(
    self, batch_size: int, seed: int, shard_index: int = 0, shard_count: int = 1, setting=""
  ) -> grain.DatasetIterator:
    """The grain iterator over ``train_examples(seed)``, shuffled by ``seed`` (see
    `pipeline.make_prompt_iterator`); config checks bound the batch (`setting` is unused)."""
    del setting
    return pipeline.make_prompt_iterator(
      self.train_examples(seed),
      batch_size,
      seed=seed,
      shard_index=shard_index,
      shard_count=shard_count,
    )

  def eval_set(self, multiple_of: int = 1) -> tuple[dict[str, np.ndarray], None]:
    """(``eval_examples()``, None): the answers are token arrays, checked in-graph. The set
    is fixed: ``multiple_of`` is not applied."""
    del multiple_of
    return self.eval_examples(), None

  # ---- verifier ---------------------------------------------------------------------------

  def reward_terms(
    self,
    prompt_tokens: jax.Array,
    completion: jax.Array,
    completion_mask: jax.Array,
    answer: jax.Array,
    answer_mask: jax.Array,
  ) -> dict[str, jax.Array]:
    """Pure-JAX verifier: per-sequence reward terms, each [B] float32.

    Args:
      prompt_tokens: [B, S] int32 prompts (unused by the built-in tasks; part of the interface).
      completion: [B, T] int32 generated tokens.
      completion_mask: [B, T] float32, 1 on generated tokens (up to and including eos).
      answer: [B, A] int32 reference answers, ``answer <eos> <pad>…``.
      answer_mask: [B, A] bool, True on answer tokens including the eos.

    Returns:
      ``correct``: 1 iff the completion up to and including its first eos equals the answer.
      ``format``: 1 iff the completion ends with an eos after a non-empty body that uses only
        ``answer_chars``.
      ``partial``: fraction of answer positions (eos included) that the completion matches.
    Tokens after the first eos, and tokens where ``completion_mask`` is 0, are ignored.
    """
    chex.assert_rank([prompt_tokens, completion, completion_mask, answer, answer_mask], 2)
    chex.assert_equal_shape([completion, completion_mask])
    chex.assert_equal_shape([answer, answer_mask])
    chex.assert_equal_shape_prefix([prompt_tokens, completion, answer], 1)
    tok = self.tokenizer
    b, t = completion.shape
    a = answer.shape[1]

    pos = jnp.arange(t)[None, :]  # [1, T]
    tokens = jnp.where(completion_mask > 0, completion, tok.pad_id)  # [B, T]
    is_eos = tokens == tok.eos_id
    terminated = is_eos.any(-1)  # [B]
    first_eos = jnp.where(terminated, jnp.argmax(is_eos, -1), t)  # [B], T when none
    tokens = jnp.where(pos > first_eos[:, None], tok.pad_id, tokens)  # drop what follows eos

    body = pos < first_eos[:, None]  # [B, T]
    allowed = jnp.isin(tokens, jnp.asarray(tok.ids_of(self.answer_chars)))
    well_formed = terminated & (first_eos > 0) & jnp.all(allowed | ~body, -1)

    if t >= a:
      aligned = tokens[:, :a]
    else:
      aligned = jnp.pad(tokens, ((0, 0), (0, a - t)), constant_values=tok.pad_id)
    answer_mask = answer_mask.astype(bool)
    n_answer = answer_mask.sum(-1)  # [B]
    match = (aligned == answer) & answer_mask  # [B, A]
    correct = terminated & (first_eos + 1 == n_answer) & jnp.all(match | ~answer_mask, -1)
    partial = match.sum(-1) / jnp.maximum(n_answer, 1)
    out = dict(zip(REWARD_TERMS, (correct, well_formed, partial), strict=True))
    out = {k: v.astype(jnp.float32) for k, v in out.items()}
    chex.assert_shape(list(out.values()), (b,))
    return out

  def describe(
    self, prompt_tokens: np.ndarray, completion: np.ndarray
  ) -> tuple[str, str] | list[tuple[str, str]]:
    """Host helper: readable ``(prompt, completion)`` text, e.g. for TensorBoard summaries.

    One sequence (``prompt_tokens`` [S], ``completion`` [T]) gives one pair; a batch ([B, S],
    [B, T]) gives a list of B pairs. The prompt drops pad and bos; the completion is cut at its
    first eos, which is shown as ``<eos>``, or marked `` <no eos>`` when there is none.
    """
    tok = self.tokenizer
    prompt_tokens, completion = np.asarray(prompt_tokens), np.asarray(completion)
    if prompt_tokens.ndim == 1 and completion.ndim == 1:
      ended = bool((completion == tok.eos_id).any())
      return tok.decode(prompt_tokens), tok.decode(completion) + ("<eos>" if ended else " <no eos>")
    chex.assert_rank([prompt_tokens, completion], 2)
    chex.assert_equal_shape_prefix([prompt_tokens, completion], 1)
    return [self.describe(p, c) for p, c in zip(prompt_tokens, completion)]
