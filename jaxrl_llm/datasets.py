"""Prompt datasets from JSONL / Parquet files → tokenized, checkpointable grain iterators.

  records = load_records(["data/train-*.jsonl"], prompt_field="question", answer_field="solution")
  train, evals = train_eval_split(records, eval_fraction=0.05, seed=0)
  it, stats = make_text_prompt_iterator(
      train, tokenizer, template="qwen_math", prompt_len=256, batch_size=32, seed=0,
      shard_index=jax.process_index(), shard_count=jax.process_count())

Batches are dicts of numpy arrays:

  tokens  [P, S] int32    rendered prompt, left-padded with ``tokenizer.pad_id``
  mask    [P, S] bool     True on prompt tokens
  answer  [P]    object   reference answers (python strings) for host-side verifiers
  index   [P]    int64    position of the row's record in ``records``
  <field> [P]             each metadata field (numeric dtype when every value is a number,
                          else object)

The iterator is the one ``jaxrl_llm.data.make_prompt_iterator`` builds, so it is saved and
restored with ``grain.checkpoint.CheckpointSave`` / ``CheckpointRestore`` like the task pipeline.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import numbers
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np
from absl import logging

from jaxrl_llm import data, text

SUPPORTED_EXTENSIONS = (".jsonl", ".jsonl.gz", ".parquet")
BATCH_KEYS = ("tokens", "mask", "answer", "index")
_MISSING = object()


# ---- loading ----------------------------------------------------------------------------------


def _expand(files: Sequence[str] | str) -> list[str]:
  """Expands glob patterns (sorted matches); a pattern matching nothing is an error."""
  if isinstance(files, (str, pathlib.Path)):
    files = [files]
  out = []
  for f in map(str, files):
    if glob.has_magic(f):
      matches = sorted(glob.glob(f, recursive=True))
      if not matches:
        raise FileNotFoundError(f"No files match the pattern {f!r}.")
      out.extend(matches)
    else:
      if not pathlib.Path(f).is_file():
        raise FileNotFoundError(f"Dataset file {f} does not exist.")
      out.append(f)
  if not out:
    raise ValueError("No dataset files given.")
  return out


def _lookup(record: Mapping[str, Any], path: str) -> Any:
  """Value at a field name or a dotted path (``'messages.0.content'``); _MISSING if absent."""
  if path in record:
    return record[path]
  value: Any = record
  for part in path.split("."):
    if isinstance(value, Mapping) and part in value:
      value = value[part]
    elif isinstance(value, (list, tuple)) and part.lstrip("-").isdigit():
      k = int(part)
      if not -len(value) <= k < len(value):
        return _MISSING
      value = value[k]
    else:
      return _MISSING
  return value


def _answer_text(value: Any) -> str:
  """Reference answers become strings: text as is, numbers via str, anything else as JSON."""
  if isinstance(value, str):
    return value
  if isinstance(value, (bool, numbers.Number)):
    return str(value)
  return json.dumps(value, ensure_ascii=False)


def _jsonl_rows(path: str):
  """(location, parsed object) per non-blank line of a .jsonl or .jsonl.gz file."""
  opener = gzip.open if path.endswith(".gz") else open
  try:
    with opener(path, "rt", encoding="utf-8") as f:
      lines = list(f)
  except (OSError, UnicodeDecodeError, EOFError) as e:
    raise ValueError(f"{path}: could not read the file as UTF-8 text: {e}") from e
  for line_no, line in enumerate(lines, start=1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}:{line_no}: not valid JSON ({e.msg}): {line[:80]!r}") from e
    if not isinstance(row, dict):
      raise ValueError(f"{path}:{line_no}: expected a JSON object, found {type(row).__name__}.")
    yield f"{path}:{line_no}", row, sorted(row)


def _parquet_rows(path: str, fields: Sequence[str]):
  """(location, row dict, column names) per row of a Parquet file; reads only the columns
  the fields need."""
  import pyarrow.parquet as pq

  try:
    pf = pq.ParquetFile(path)
  except Exception as e:  # pyarrow raises several error types for a bad file
    raise ValueError(f"{path}: not a readable Parquet file: {e}") from e
  names = pf.schema_arrow.names
  wanted = {f if f in names else f.split(".")[0] for f in fields}
  columns = [n for n in names if n in wanted]
  if len(columns) < len(wanted):
    columns = None  # some field is absent: read everything so the error lists the columns
  rows = pf.read(columns=columns).to_pylist()
  for k, row in enumerate(rows):
    yield f"{path} row {k}", row, names


def _file_kind(path: str) -> str:
  for ext in SUPPORTED_EXTENSIONS:
    if path.endswith(ext):
      return ext
  raise ValueError(
    f"{path}: unsupported file type; supported extensions: {', '.join(SUPPORTED_EXTENSIONS)}."
  )


def load_records(
  files: Sequence[str] | str,
  *,
  prompt_field: str = "prompt",
  answer_field: str | None = "answer",
  metadata_fields: Sequence[str] = (),
) -> list[dict[str, Any]]:
  """Reads prompt records from JSONL (``.jsonl``, ``.jsonl.gz``) and Parquet files.

  Each record becomes ``{'prompt': str, 'answer': str, <metadata field>: value, ...}``. Fields
  are names or dotted paths into nested values (``'messages.0.content'``, ``'info.level'``);
  file names may be glob patterns. ``answer_field=None`` gives every record an empty answer.
  Errors name the file and line (or Parquet row): invalid JSON, a missing field (listing the
  fields the record has), a prompt that is not a non-empty string; and an empty result.
  """
  paths = _expand(files)
  fields = [prompt_field, *([answer_field] if answer_field else []), *metadata_fields]
  clash = set(metadata_fields) & {*BATCH_KEYS, "prompt"}
  if clash:
    raise ValueError(
      f"metadata_fields {sorted(clash)} clash with the keys 'prompt' and {BATCH_KEYS}."
    )
  records = []
  for path in paths:
    kind = _file_kind(path)
    rows = _parquet_rows(path, fields) if kind == ".parquet" else _jsonl_rows(path)
    for where, row, has in rows:
      values = {}
      for field in fields:
        value = _lookup(row, field)
        if value is _MISSING:
          raise ValueError(f"{where}: record has no field {field!r}; its fields are {has}.")
        values[field] = value
      prompt = values[prompt_field]
      if not isinstance(prompt, str):
        hint = ""
        if isinstance(prompt, list):
          hint = f" (for chat-style records point prompt_field at the text, e.g. '{prompt_field}.0.content')"
        raise ValueError(
          f"{where}: prompt field {prompt_field!r} holds a {type(prompt).__name__}, "
          f"not a string{hint}."
        )
      if not prompt.strip():
        raise ValueError(f"{where}: prompt field {prompt_field!r} is empty.")
      record = {
        "prompt": prompt,
        "answer": _answer_text(values[answer_field]) if answer_field else "",
      }
      record.update({f: values[f] for f in metadata_fields})
      records.append(record)
  if not records:
    raise ValueError(f"No records in the dataset files {paths}.")
  return records


# ---- splits -----------------------------------------------------------------------------------


def _hash_unit(prompt: str, seed: int) -> float:
  """A stable uniform number in [0, 1) from the prompt text and the seed."""
  key = int(seed).to_bytes(8, "little", signed=True)
  digest = hashlib.blake2b(prompt.encode("utf-8"), digest_size=8, key=key).digest()
  return int.from_bytes(digest, "little") * 2.0**-64


def train_eval_split(
  records: Sequence[dict[str, Any]],
  *,
  eval_fraction: float = 0.0,
  eval_files: Sequence[str] | str | None = None,
  seed: int,
  **load_kwargs,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
  """Splits records into (train, eval).

  With ``eval_fraction`` a record goes to eval when a keyed hash of its prompt text falls
  below the fraction: the split is the same in every run and process, and identical prompts
  always land on the same side. With ``eval_files`` all ``records`` train and the eval records
  are loaded from those files (``load_kwargs`` go to ``load_records``). Neither gives
  ``(records, [])``.
  """
  if eval_files is not None and eval_fraction:
    raise ValueError("Give either eval_fraction or eval_files, not both.")
  if not 0.0 <= eval_fraction < 1.0:
    raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}.")
  records = list(records)
  if eval_files is not None:
    evals = load_records(eval_files, **load_kwargs)
    overlap = len({r["prompt"] for r in records} & {r["prompt"] for r in evals})
    if overlap:
      logging.warning("%d eval prompts also appear in the training records.", overlap)
    return records, evals
  if not eval_fraction:
    return records, []
  to_eval = [_hash_unit(r["prompt"], seed) < eval_fraction for r in records]
  train = [r for r, e in zip(records, to_eval) if not e]
  evals = [r for r, e in zip(records, to_eval) if e]
  if not train or not evals:
    raise ValueError(
      f"eval_fraction={eval_fraction} split {len(records)} records into {len(train)} train and "
      f"{len(evals)} eval; both sides need at least one record."
    )
  return train, evals


# ---- tokenized iterator -----------------------------------------------------------------------


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


def tokenize_records(
  records: Sequence[dict[str, Any]],
  tokenizer: text.HFTokenizer,
  *,
  template: str = "plain",
  prompt_len: int,
  system: str | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, int]]:
  """Renders and tokenizes records, dropping prompts longer than ``prompt_len`` tokens.

  Returns (example arrays with the batch keys of this module, one row per kept record, and
  stats ``{'num_records', 'num_too_long', 'num_kept'}``).
  """
  if not records:
    raise ValueError("records is empty.")
  prompts = [
    text.render_prompt(r["prompt"], template, tokenizer=tokenizer, system=system) for r in records
  ]
  specials = not text.uses_chat_template(template)
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
  }
  logging.info(
    "Prompt dataset (template %r, prompt_len %d): %d records, %d longer than prompt_len "
    "dropped, %d kept.",
    template,
    prompt_len,
    stats["num_records"],
    stats["num_too_long"],
    stats["num_kept"],
  )
  if keep.size == 0:
    shortest = min(len(tokenizer.encode(p, add_special_tokens=specials)) for p in prompts)
    raise ValueError(
      f"All {len(records)} prompts are longer than prompt_len={prompt_len} tokens after "
      f"rendering with template {template!r} (shortest: {shortest} tokens); raise prompt_len."
    )
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
  return examples, stats


def make_text_prompt_iterator(
  records: Sequence[dict[str, Any]],
  tokenizer: text.HFTokenizer,
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
) -> tuple[grain.DatasetIterator, dict[str, int]]:
  """Checkpointable iterator of tokenized prompt batches (keys in the module docstring).

  Prompts are rendered with the named template (``text.PROMPT_TEMPLATES``; ``system`` is used
  by the chat templates), left-padded to ``prompt_len`` and those that do not fit are dropped
  (counted in the returned stats). The rest follows ``data.make_prompt_iterator``: shuffle by
  ``seed`` each epoch, repeat ``num_epochs`` (None = forever), take shard ``shard_index`` of
  ``shard_count`` (disjoint within an epoch), batch with the remainder dropped.
  """
  examples, stats = tokenize_records(
    records, tokenizer, template=template, prompt_len=prompt_len, system=system
  )
  per_shard = stats["num_kept"] // max(shard_count, 1)
  if batch_size > per_shard:
    raise ValueError(
      f"batch_size={batch_size} exceeds the {per_shard} prompts per shard: {stats['num_kept']} "
      f"of {stats['num_records']} records fit prompt_len={prompt_len} "
      f"({stats['num_too_long']} too long), over {shard_count} shard(s)."
    )
  it = data.make_prompt_iterator(
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
