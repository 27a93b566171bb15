"""Prompt records → tokenized, checkpointable grain iterators of prompt batches.

  it, stats = make_text_prompt_iterator(
      train, tokenizer, template="qwen_math", prompt_len=256, batch_size=32, seed=0,
      shard_index=jax.process_index(), shard_count=jax.process_count())

``train`` is a list of records as ``records.load_records`` / ``records.train_eval_split`` give
them. Special-token strings inside a record's text (``<|im_end|>``, ...) are encoded as plain
text unless ``special_tokens_in_text`` is set, so a record cannot write control tokens.

Batches are dicts of numpy arrays (the keys ``records.BATCH_KEYS`` plus the metadata fields):

  tokens  [P, S] int32    rendered prompt, left-padded with ``tokenizer.pad_id``
  mask    [P, S] bool     True on prompt tokens
  answer  [P]    object   reference answers (python strings) for host-side verifiers
  index   [P]    int64    position of the row's record in ``records``
  <field> [P]             each metadata field (numeric dtype when every value is a number,
                          else object)

The iterator is the one ``pipeline.make_prompt_iterator`` builds, so it is saved and restored
with ``grain.checkpoint.CheckpointSave`` / ``CheckpointRestore`` like the task pipeline.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np
from absl import logging

from jaxrl_llm.data import pipeline, templates
from jaxrl_llm.data.records import DataError, skip_counts
from jaxrl_llm.data.tokenizers import HFTokenizer


def _object_column(values: list[Any]) -> np.ndarray:
  col = np.empty(len(values), dtype=object)
  col[:] = values
  return col


def _column(values: list[Any]) -> np.ndarray:
  """A 1-D column: numeric/bool dtype when every value is a number, else object."""
  if values and all(isinstance(v, (bool, numbers.Number)) for v in values):
    col = np.asarray(values)
    if col.ndim == 1 and col.dtype.kind in "biuf":
      return col
  return _object_column(values)


def _stack_rows(rows: Sequence[dict[str, Any]]) -> dict[str, np.ndarray]:
  """Batches rows: numpy values are stacked; python values (strings, lists, None) go into
  object arrays rather than becoming fixed-width ``<U`` arrays."""
  out = {}
  for key, first in rows[0].items():
    values = [r[key] for r in rows]
    if isinstance(first, (np.ndarray, np.generic)):
      out[key] = np.stack(values)
    else:
      out[key] = _object_column(values)
  return out


def _warn_special_tokens(
  records: Sequence[dict[str, Any]], tokenizer: HFTokenizer, in_text: bool
) -> None:
  """Logs how many prompts hold special-token strings, and how they were encoded."""
  found = [f for r in records if (f := tokenizer.find_special_tokens(r["prompt"]))]
  if found:
    logging.warning(
      "%d of %d prompts hold special-token strings (e.g. %r), encoded as %s "
      "(data.special_tokens_in_text=%s).",
      len(found),
      len(records),
      found[0][0],
      "control tokens" if in_text else "plain text",
      in_text,
    )


def _log_tokenized(
  template: str, prompt_len: int, stats: Mapping[str, int], what: str = "Prompt dataset"
) -> None:
  """Logs how many records (of `what`) were tokenized, dropped as too long, kept and skipped
  when read."""
  logging.info(
    "%s (template %r, prompt_len %d): %d records, %d longer than prompt_len "
    "dropped, %d kept; %d rows skipped for a null answer when read.",
    what,
    template,
    prompt_len,
    stats["num_records"],
    stats["num_too_long"],
    stats["num_kept"],
    stats["skipped_null_answer"],
  )


def _kept_examples(
  records: Sequence[dict[str, Any]], keep: np.ndarray, tokens: np.ndarray, mask: np.ndarray
) -> dict[str, np.ndarray]:
  """Example arrays of the kept records (rows ``keep`` of ``records``, tokenized as
  ``tokens`` / ``mask``): the batch keys plus a column per metadata field."""
  kept = [records[i] for i in keep]
  examples = {
    "tokens": tokens,
    "mask": mask,
    "answer": _object_column([r["answer"] for r in kept]),
    "index": keep.astype(np.int64),
  }
  for key in records[0]:
    if key not in ("prompt", "answer"):
      examples[key] = _column([r.get(key) for r in kept])
  return examples


def tokenize_records(
  records: Sequence[dict[str, Any]],
  tokenizer: HFTokenizer,
  *,
  template: str = "plain",
  prompt_len: int,
  system: str | None = None,
  special_tokens_in_text: bool = False,
  what: str = "Prompt dataset",
) -> tuple[dict[str, np.ndarray], dict[str, int]]:
  """Renders and tokenizes records, dropping prompts longer than ``prompt_len`` tokens
  (``what`` names them in the log line).

  Special-token strings inside a record's prompt (or ``system``) are encoded as plain text;
  only the control tokens a chat template writes around the messages are special-token ids.
  ``special_tokens_in_text=True`` encodes them as control tokens instead.

  Returns (example arrays with the batch keys of this module, one row per kept record, and
  stats ``{'num_records', 'num_too_long', 'num_kept', *records.SKIP_KEYS}``; the skip counts
  are those ``records`` carries as ``Records``, else zeros).
  """
  if not records:
    raise DataError("records is empty.")
  render = templates.render_prompt if special_tokens_in_text else templates.render_prompt_parts
  prompts = [render(r["prompt"], template, tokenizer=tokenizer, system=system) for r in records]
  specials = not templates.uses_chat_template(template)
  tokens, mask, too_long = tokenizer.encode_batch(
    prompts,
    prompt_len,
    left_pad=True,
    add_special_tokens=specials,
    overflow="drop",
  )
  keep = np.flatnonzero(~too_long)
  stats = {
    "num_records": len(records),
    "num_too_long": int(too_long.sum()),
    "num_kept": int(keep.size),
    **skip_counts(records),
  }
  _log_tokenized(template, prompt_len, stats, what)
  _warn_special_tokens(records, tokenizer, special_tokens_in_text)
  if keep.size == 0:
    shortest = min(len(tokenizer.encode(p, add_special_tokens=specials)) for p in prompts)
    raise DataError(
      f"All {len(records)} prompts are longer than data.prompt_len={prompt_len} tokens after "
      f"rendering with template {template!r} (shortest: {shortest} tokens); raise data.prompt_len."
    )
  return _kept_examples(records, keep, tokens, mask), stats


def make_text_prompt_iterator(
  records: Sequence[dict[str, Any]],
  tokenizer: HFTokenizer,
  *,
  template: str = "plain",
  prompt_len: int,
  batch_size: int,
  seed: int,
  shard_index: int = 0,
  shard_count: int = 1,
  shuffle: bool = True,
  num_epochs: int | None = None,
  system: str | None = None,
  special_tokens_in_text: bool = False,
  setting: str = "",
) -> tuple[grain.DatasetIterator, dict[str, int]]:
  """Checkpointable iterator of tokenized prompt batches (keys in the module docstring).

  Prompts are rendered with the named template (``templates.PROMPT_TEMPLATES``; ``system`` is
  used by the chat templates), left-padded to ``prompt_len`` and those that do not fit are
  dropped (counted in the returned stats). The rest follows ``pipeline.make_prompt_iterator``:
  shuffle by ``seed`` each epoch, repeat ``num_epochs`` (None = forever), take shard
  ``shard_index`` of ``shard_count`` (disjoint within an epoch), batch with the remainder
  dropped. Special-token strings in the records' text are plain text unless
  ``special_tokens_in_text`` (see ``tokenize_records``); the stats include the records' skip
  counts (``records.SKIP_KEYS``). A batch larger than a shard's prompts is refused naming
  ``setting``, the config value behind ``batch_size``.
  """
  examples, stats = tokenize_records(
    records,
    tokenizer,
    template=template,
    prompt_len=prompt_len,
    system=system,
    special_tokens_in_text=special_tokens_in_text,
  )
  per_shard = stats["num_kept"] // max(shard_count, 1)
  if batch_size > per_shard:
    per = f" ({batch_size} a shard)" if shard_count > 1 else ""
    raise DataError(
      f"{setting or f'a batch of {batch_size}'}{per} is more than the {per_shard} training prompts per shard: "
      f"{stats['num_kept']} of {stats['num_records']} records fit data.prompt_len={prompt_len} "
      f"({stats['num_too_long']} too long), over {shard_count} shard(s); allowed: at most "
      f"{per_shard * shard_count}, or more records, or a larger data.prompt_len"
    )
  it = pipeline.make_prompt_iterator(
    examples,
    batch_size,
    seed,
    shuffle=shuffle,
    num_epochs=num_epochs,
    shard_index=shard_index,
    shard_count=shard_count,
    batch_fn=_stack_rows,
  )
  return it, stats
