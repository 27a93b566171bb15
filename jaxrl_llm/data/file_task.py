"""Prompts from JSONL / Parquet files, a Hugging Face tokenizer, and host-side verifiers.

A `FileTask` is the `Task` of real data: it renders prompts with a
template, tokenizes them (left-padded, over-long prompts filtered and counted), feeds them
through grain, and scores decoded completions on the host with the verifiers of `verifiers`
(exceptions and timeouts score 0 and are counted, never crash the run).
Training then uses the host-reward path of `rl.RLProgram`: jitted sampler → host
verifiers → jitted learner, with the same objectives and metrics as the fused step.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from absl import logging

from jaxrl_llm.data import prompt_batches, records, templates, verifiers
from jaxrl_llm.data.task import Task
from jaxrl_llm.data.tokenizers import HFTokenizer

# The key of `data.eval_fraction`'s prompt hash: one split for every run, whatever its `seed`,
# so runs that differ in seed train and are evaluated on the same prompts (as built-in tasks).
SPLIT_KEY = 0


@dataclasses.dataclass
class FileTask(Task):
  """A prompt dataset read from files, scored by named host verifiers (rewards on the host)."""

  tokenizer: HFTokenizer
  train_records: list[dict[str, Any]]
  eval_records: list[dict[str, Any]]
  template: str  # prompt template name (templates.PROMPT_TEMPLATES)
  prompt_len: int  # S: prompts are left-padded to this many tokens
  max_new_tokens: int  # T: completion budget
  reward_fns: dict[str, Callable[[str, str], float]]  # name -> verifier(completion, reference)
  timeout_s: float  # per-call verifier time limit (data.verifier_timeout_s)
  eval_size: int  # held-out prompts evaluated (task.eval_size)
  correct_term: str  # the reward term that defines accuracy (data.correct_term)
  special_tokens_in_text: bool  # special-token strings become control ids (data.*)
  system: str | None = None  # system message for chat templates

  name = "files"
  rewards_on_host = True  # host_reward_terms scores decoded completions
  reward_terms = None  # no in-graph verifier
  answer_len = 1  # the reference answers stay on the host; the device batch holds a [P, 1] stub
  data_stats: dict[str, float] = dataclasses.field(default_factory=dict)  # filled by train_iterator
  said: set[str] = dataclasses.field(default_factory=set)  # terms whose first failure was said

  def train_iterator(
    self, batch_size: int, seed: int, shard_index: int = 0, shard_count: int = 1, setting=""
  ):
    """The grain iterator of training prompt batches (checkpointable); a refusal of a batch
    larger than the prompts that fit names `setting`."""
    it, stats = prompt_batches.make_text_prompt_iterator(
      self.train_records,
      self.tokenizer,
      template=self.template,
      prompt_len=self.prompt_len,
      batch_size=batch_size,
      seed=seed,
      shard_index=shard_index,
      shard_count=shard_count,
      system=self.system,
      special_tokens_in_text=self.special_tokens_in_text,
      setting=setting,
    )
    self.data_stats = {f"data/{k}": float(v) for k, v in stats.items()}
    return it

  def eval_set(self, multiple_of: int = 1) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Up to `eval_size` held-out prompts (a multiple of `multiple_of`), tokenized, and their
    reference answers (the batch's ``answer`` column, taken out of it). Records too long for
    `prompt_len` are passed over: the split is read in chunks until `eval_size` fit."""
    chunk, kept = max(2 * self.eval_size, 256), []
    for at in range(0, len(self.eval_records), chunk):
      try:
        examples, _ = prompt_batches.tokenize_records(
          self.eval_records[at : at + chunk],
          self.tokenizer,
          template=self.template,
          prompt_len=self.prompt_len,
          system=self.system,
          special_tokens_in_text=self.special_tokens_in_text,
          what=(
            f"Held-out prompts {at}..{min(at + chunk, len(self.eval_records)) - 1} of "
            f"{len(self.eval_records)}"
          ),
        )
      except records.DataError:  # every prompt of this chunk is too long: read on
        continue
      kept.append(examples)
      if sum(len(e["tokens"]) for e in kept) >= self.eval_size:
        break
    fits = sum(len(e["tokens"]) for e in kept)
    n = min(fits, self.eval_size)
    n -= n % multiple_of
    if n < 1:
      raise records.DataError(
        f"{fits} of the {len(self.eval_records)} held-out prompts fit data.prompt_len="
        f"{self.prompt_len}, and an evaluation needs a multiple of {multiple_of} (devices); "
        "add eval data (data.eval_files or data.eval_fraction) or raise data.prompt_len"
      )
    batch = {k: np.concatenate([e[k] for e in kept])[:n] for k in kept[0]}
    return batch, batch.pop("answer")

  def decode(self, tokens: np.ndarray) -> list[str]:
    """Completion token rows [B, T] -> text (cut at the first stop token)."""
    return [self.tokenizer.decode(row.tolist()) for row in np.asarray(tokens)]

  def _verifiers(self) -> dict[str, Callable[[str, str], float]]:
    """The named verifiers (weighted or diagnostic), and `correct_term`'s (accuracy) when the
    weights do not name it."""
    fns = dict(self.reward_fns)
    if self.correct_term not in fns:
      fns[self.correct_term] = verifiers.get_reward_fn(self.correct_term)
    return fns

  @property
  def host_term_names(self) -> tuple[str, ...]:
    """The names of the reward terms `host_reward_terms` returns (`correct` among them)."""
    return tuple(sorted({*self._verifiers(), "correct"}))

  def host_reward_terms(
    self, completions: np.ndarray, references: Sequence[str]
  ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """Scores decoded completions: named [B] float32 reward terms and verifier failure counts."""
    texts = self.decode(completions)
    fns = self._verifiers()
    # Worker processes (kept between steps): a verifier that hangs is killed at the time limit,
    # scored 0 and counted in `verifier/timeouts`, which the step logs with its metrics.
    terms, stats = verifiers.score_batch(
      texts,
      [str(r) for r in references],
      terms=fns,
      timeout_s=self.timeout_s,
      executor="process",
      said=self.said,  # a term's first failure is said once a run; all are counted
    )
    terms["correct"] = terms[self.correct_term]  # accuracy metrics read `correct`
    return terms, stats

  def describe(self, prompt: np.ndarray, completion: np.ndarray) -> tuple[str, str]:
    """Human-readable (prompt, completion) of one row for the TensorBoard text summary."""
    prompt = np.asarray(prompt)
    # The left padding only: a pad id inside the prompt is a token it holds (SmolLM2 pads with
    # <|im_end|>, which closes each of its turns).
    real = np.nonzero(prompt != self.tokenizer.pad_id)[0]
    first = int(real[0]) if real.size else len(prompt)
    shown = self.tokenizer.decode(
      prompt[first:].tolist(), skip_special_tokens=False, stop_at_eos=False
    )
    return shown, self.decode(completion[None])[0]


def _split_files(spec: str) -> list[str]:
  return [f.strip() for f in spec.split(",") if f.strip()]


def _files_error(split: str, spec: str, e: Exception) -> records.DataError:
  """One `DataError` for data.<split>_files=`spec` (`split`: train or eval) that did not read;
  where the whole value, split at its commas, is one file, it says so and how to name that
  file (a glob)."""
  setting, note = f"data.{split}_files", ""
  if "," in spec and os.path.isfile(spec.strip()):
    note = (
      f"; {setting} is a comma-separated list, so this one file was read as several: give a "
      f"name holding a comma as a glob ({spec.strip().replace(',', '?')!r})"
    )
  return records.DataError(f"{setting}={spec!r}: {str(e).rstrip('.') if note else e}{note}")


ANSWER_CHECK = (1000, 200, 2.0)  # answers checked at start-up, their longest, seconds at most


def _warn_if_answers_do_not_parse(loaded: Sequence[dict], field: str, term: str) -> bool:
  """Warns (once) with the fraction of the first 1,000 reference answers that do not parse as
  a number: the math verifiers reward only an exact repeat of such a text, so a run on prose
  answers would train near reward 0 without a word. Answers over 200 characters count as not
  parsing, and the check stops after 2 s (the answers read by then are the sample). Returns
  whether it warned."""
  if not term.startswith(("math", "gsm8k")):
    return False
  most, longest, budget = ANSWER_CHECK
  norm, start, checked, bad = verifiers.normalize, time.monotonic(), 0, []
  for record in loaded[:most]:
    answer, checked = str(record["answer"]), checked + 1
    ok = len(answer) <= longest and verifiers.parse_number(norm(verifiers.reference_answer(answer)))
    if ok is None or ok is False:
      bad.append(answer)
    if time.monotonic() - start > budget:
      break
  if not bad:
    return False
  logging.warning(
    "data: %d of %d reference answers (%.0f%%, field %r) do not parse as a number, e.g. %r; "
    "data.correct_term=%s rewards those only for an exact repeat of the text: check "
    "data.answer_field",
    len(bad),
    checked,
    100 * len(bad) / checked,
    field,
    bad[0][:80],
    term,
  )
  return True


def _tokenizer(path: str, checkpoint: str) -> HFTokenizer:
  """The tokenizer at `path` (data.tokenizer: a directory holding tokenizer.json, or the
  file), else `checkpoint`'s (model.checkpoint); one `DataError` naming the setting it came
  from and what it must be. A file named tokenizer.json reads as its directory (with the
  tokenizer_config.json, generation_config.json and chat_template.jinja beside it); a file of
  another name is read alone, and has no end-of-sequence token of its own."""
  if not path and not checkpoint:
    raise records.DataError(
      "data.tokenizer is empty and there is no model.checkpoint to take the tokenizer from; "
      "set --config.data.tokenizer=DIR (a directory with tokenizer.json)"
    )
  setting = f"data.tokenizer={path!r}" if path else f"model.checkpoint={checkpoint!r}"
  given, path = bool(path), path or checkpoint
  try:
    if os.path.isdir(path):
      tok = HFTokenizer.from_dir(path)
    elif os.path.isfile(path) and os.path.basename(path) == "tokenizer.json":
      tok = HFTokenizer.from_dir(os.path.dirname(os.path.abspath(path)))
    else:
      tok = HFTokenizer.from_file(path)
  except (FileNotFoundError, ValueError) as e:
    alone = os.path.isfile(path) and os.path.basename(path) != "tokenizer.json"
    raise records.DataError(
      f"{setting}: {e} (a directory holding tokenizer.json, or that file"
      + (
        "; a file of another name is read alone, without the tokenizer_config.json and "
        "generation_config.json beside it: pass the directory holding them and tokenizer.json)"
        if alone
        else ")"
      )
    ) from e
  own = os.path.join(checkpoint, "tokenizer.json") if checkpoint else ""
  if given and os.path.isfile(own):
    _check_same_vocabulary(tok, own, setting, checkpoint)
  return tok


def _check_same_vocabulary(tok: HFTokenizer, own: str, setting: str, checkpoint: str) -> None:
  """A `DataError` when data.tokenizer's vocabulary is not that of model.checkpoint's own
  tokenizer.json `own`: the model would read every prompt through ids it never learned
  (another chat template is fine). An unreadable `own` is left to the checkpoint's import."""
  from tokenizers import Tokenizer

  try:
    theirs = Tokenizer.from_file(own).get_vocab(with_added_tokens=True)
  except Exception:  # the library's parse error: not this setting's fault
    return
  mine = tok.vocabulary()
  if mine == theirs:
    return
  differ = next((t for t in sorted(mine) if theirs.get(t) != mine[t]), None)
  if differ is None:
    at = ""
  elif differ in theirs:
    at = f"; {differ!r} is id {mine[differ]} in it, {theirs[differ]} in the checkpoint's"
  else:
    at = f"; {differ!r} (id {mine[differ]} in it) is not in the checkpoint's"
  raise records.DataError(
    f"{setting}: its vocabulary ({len(mine)} tokens) is not that of the tokenizer of "
    f"model.checkpoint={checkpoint} ({len(theirs)} tokens{at}): the model would read the prompts "
    "through ids it never learned; allowed: the checkpoint's own tokenizer (a copy, or one with "
    "another chat template), or leave data.tokenizer empty to use it"
  )


def _check_chat_template(tokenizer: HFTokenizer, first: dict[str, Any], d) -> None:
  """A chat template that cannot render a prompt (none in the tokenizer's files, a syntax error,
  a turn it refuses) is one `DataError` now, before the run starts, not a traceback at its
  first batch."""
  if not templates.uses_chat_template(d.template):
    return
  render = templates.render_prompt if d.special_tokens_in_text else templates.render_prompt_parts
  try:
    render(first["prompt"], d.template, tokenizer=tokenizer, system=d.system_prompt or None)
  except ValueError as e:
    plain = ", ".join(sorted(set(templates.PROMPT_TEMPLATES) - templates.CHAT_PROMPT_TEMPLATES))
    raise records.DataError(
      f"data.template={d.template!r} cannot render the first prompt: "
      f"{str(e).splitlines()[0].rstrip('.')}; give the tokenizer a chat template that renders a user turn (tokenizer_config.json's "
      "chat_template or chat_template.jinja), leave data.system_prompt empty where it refuses "
      f"a system turn, or use a template without one ({plain})"
    ) from None


def build_file_task(config, tokenizer_dir: str) -> FileTask:
  """The `FileTask` described by `config.data` (files, fields, template, verifiers)."""
  d = config.data
  fields = {"prompt_field": d.prompt_field, "answer_field": d.answer_field}
  try:  # the files first: a missing file is named before anything else is asked of the user
    loaded = records.load_records(_split_files(d.train_files), **fields)
  except (FileNotFoundError, records.DataError) as e:  # missing, unreadable, empty, malformed
    raise _files_error("train", d.train_files, e) from e
  _warn_if_answers_do_not_parse(loaded, d.answer_field, d.correct_term)
  tokenizer = _tokenizer(d.tokenizer, tokenizer_dir)
  eval_files = _split_files(d.eval_files) or None
  share = 0.0 if eval_files else d.eval_fraction
  try:
    train, evaluation = records.train_eval_split(
      loaded, eval_fraction=share, eval_files=eval_files, seed=SPLIT_KEY, **fields
    )
  except (FileNotFoundError, records.DataError) as e:
    if not eval_files:  # the split by data.eval_fraction, whose message names it
      raise
    raise _files_error("eval", d.eval_files, e) from e
  if not evaluation:
    raise records.DataError(
      "the evaluation split is empty: set data.eval_files or a data.eval_fraction > 0"
    )
  _check_chat_template(tokenizer, train[0] if train else evaluation[0], d)
  weights = dict(config.task.reward_weights)  # `correct`: data.correct_term's verifier
  # A verifier named at weight 0 is still scored and logged (`reward/NAME`, `eval/reward/NAME`)
  # but adds nothing to the reward: a diagnostic beside the runs that weight it. Names at weight
  # 0 that are no verifier here (the built-in tasks' `format`), or whose package is missing,
  # are left out, as before.
  reward_fns = {
    name: verifiers.get_reward_fn(name)
    for name, w in weights.items()
    if name != "correct"
    and (w or (name in verifiers.REWARD_FNS and verifiers.missing_package(name) is None))
  }
  return FileTask(
    tokenizer=tokenizer,
    train_records=train,
    eval_records=evaluation,
    template=d.template,
    prompt_len=d.prompt_len,
    max_new_tokens=config.sampling.max_new_tokens,
    reward_fns=reward_fns,
    system=d.system_prompt or None,
    timeout_s=d.verifier_timeout_s,
    eval_size=config.task.eval_size,
    correct_term=d.correct_term,
    special_tokens_in_text=d.special_tokens_in_text,
  )
