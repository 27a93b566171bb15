"""Prompt records from JSONL / Parquet files: reading, checking, and the train/eval split.

  records = load_records(["data/train-*.jsonl"], prompt_field="question", answer_field="solution")
  train, evals = train_eval_split(records, eval_fraction=0.05, seed=0)

Each record is ``{'prompt': str, 'answer': str, <metadata field>: value, ...}``. Rows whose
reference answer is null, NaN or empty are skipped when the files are read and counted in
``Records.skipped`` (``{'skipped_null_answer': n}``). A file or record that cannot be used
raises ``DataError`` naming the file (and line). Tokenizing records into checkpointable batches
is ``jaxrl_llm.data.prompt_batches`` (its stats repeat the skip counts).
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import math
import numbers
import os
import pathlib
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

from absl import logging

# .json: JSON Lines (what `datasets`' to_json writes) or one JSON array of records.
SUPPORTED_EXTENSIONS = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet")
BATCH_KEYS = ("tokens", "mask", "answer", "index")  # a prompt batch's keys; not metadata fields
SKIP_KEYS = ("skipped_null_answer",)  # counts of rows dropped while reading, in Records.skipped
_MISSING = object()


class DataError(ValueError):
  """A dataset file or record that cannot be used; the message names the file (and line)."""


USER_ERRORS = (DataError,)  # failure classes the command line reports as one line


def _check_text(where: str, field: str, value: str) -> None:
  """Refuses text that cannot be encoded (a lone surrogate such as an escaped \\udc80)."""
  try:
    value.encode("utf-8")
  except UnicodeEncodeError as e:
    bad = value[e.start : e.end].encode("unicode_escape").decode()
    raise DataError(
      f"{where}: field {field!r} holds {bad!r} at character {e.start}, which is not valid "
      "Unicode text (a lone surrogate); fix or drop the record"
    ) from None


class Records(list):
  """A list of records that also carries ``skipped``: ``{key: rows dropped}`` for ``SKIP_KEYS``
  (rows of the files read that did not become records)."""

  def __init__(
    self, records: Sequence[dict[str, Any]] = (), skipped: Mapping[str, int] | None = None
  ):
    super().__init__(records)
    self.skipped = {k: int((skipped or {}).get(k, 0)) for k in SKIP_KEYS}


def skip_counts(records: Sequence[dict[str, Any]]) -> dict[str, int]:
  """``records.skipped`` for ``Records``, zeros for any other sequence."""
  skipped = getattr(records, "skipped", None) or {}
  return {k: int(skipped.get(k, 0)) for k in SKIP_KEYS}


# ---- loading ----------------------------------------------------------------------------------


def matches(pattern: str) -> list[str]:
  """The files a glob `pattern` matches (sorted), or `[pattern]` itself when it is no glob."""
  return sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]


def _expand(files: Sequence[str] | str) -> list[str]:
  """Expands glob patterns (sorted matches); a pattern matching nothing is an error."""
  if isinstance(files, (str, pathlib.Path)):
    files = [files]
  out = []
  for f in map(str, files):
    if glob.has_magic(f):
      found = matches(f)
      if not found:
        raise FileNotFoundError(f"No files match the pattern {f!r}.")
      out.extend(found)
    else:
      if pathlib.Path(f).is_dir():  # a folder where a file belongs: name what it holds
        raise FileNotFoundError(
          f"Dataset file {f} is a directory; name its files (e.g. {f.rstrip('/')}/*.jsonl)."
        )
      if not pathlib.Path(f).is_file():  # one `tools/get_smollm2.py` writes: say so
        from jaxrl_llm.models.pretrained import write_hint

        raise FileNotFoundError(f"Dataset file {f} does not exist{write_hint(f) or '.'}")
      out.append(f)
  if not out:
    raise DataError("No dataset files given.")
  seen: dict[str, str] = {}
  for f in out:  # the same file twice would double its records without a word
    key = os.path.realpath(f)
    if key in seen:
      raise DataError(
        f"Dataset file {f} is named twice ({seen[key]!r} and {f!r}, by the names or patterns "
        "given); allowed: each file once"
      )
    seen[key] = f
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


def _is_null_answer(value: Any) -> bool:
  """Whether a reference answer is missing in substance: None, a NaN or blank text."""
  if value is None:
    return True
  if isinstance(value, str):
    return not value.strip()
  real = isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral)
  return real and math.isnan(value)


def _answer_text(value: Any, where: str, field: str) -> str:
  """Reference answers become strings: text as is, numbers via str, lists and objects as JSON;
  DataError for any other kind (a Parquet binary, date or timestamp column)."""
  if isinstance(value, str):
    return value
  if isinstance(value, (bool, numbers.Number)):
    return str(value)
  try:
    return json.dumps(value, ensure_ascii=False)
  except (TypeError, ValueError) as e:  # bytes, datetime, ... (in a list or object too)
    raise DataError(
      f"{where}: answer field {field!r} holds a {type(value).__name__} ({e}); a reference answer "
      "must be text, a number, or a list or object of those: store it as text"
    ) from None


def _json_rows(path: str, kind: str):
  """(location, parsed object, its fields) per record of a JSON file of `kind` (its extension):
  per non-blank line of JSON Lines (.jsonl, .json; gzipped too), or per element of a .json
  file's one array."""
  opener = gzip.open if kind.endswith(".gz") else open
  try:
    with opener(path, "rb") as f:
      data = f.read()
  except (OSError, EOFError, zlib.error) as e:
    raise DataError(f"{path}: could not read the file as UTF-8 text: {e}") from e
  data = data.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark, as Windows tools write
  if kind in (".json", ".json.gz") and data.lstrip()[:1] == b"[":
    try:
      text = data.decode("utf-8")
    except UnicodeDecodeError as e:
      raise DataError(
        f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); save the file "
        "as UTF-8"
      ) from None
    rows = enumerate(_loads(path, text, "the file"))
    where = f"{path} record {{}}"
  else:
    _refuse_one_object(path, data)
    rows = _json_lines(path, data)
    where = f"{path}:{{}}"
  for k, row in rows:
    if not isinstance(row, dict):
      raise DataError(f"{where.format(k)}: expected a JSON object, found {type(row).__name__}.")
    yield where.format(k), row, sorted(row)


def _refuse_one_object(path: str, data: bytes) -> None:
  """A DataError for a file that is one JSON object written over several lines (`json.dump`
  with an indent), which reads as JSON Lines only as `not valid JSON` at its first line."""
  if data.lstrip().split(b"\n", 1)[0].strip() != b"{":
    return
  try:
    whole = json.loads(data.decode("utf-8"))
  except (ValueError, RecursionError):  # not one object: the lines' own errors say what is wrong
    return
  if isinstance(whole, dict):
    fields = ", ".join(repr(k) for k in list(whole)[:8])
    raise DataError(
      f"{path}: one JSON object over several lines (fields {fields}), not records: write one "
      f"record a line (JSON Lines) or, in a .json file, one array of records{_wrapped_hint(whole)}"
    )


def _wrapped_hint(obj: Mapping[str, Any]) -> str:
  """Names the field of `obj` that holds a list of objects (records wrapped in one object, as
  `{"version": 1, "data": [...]}`), or ''."""
  for key, value in obj.items():
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
      return (
        f" (its field {key!r} holds a list of {len(value)} objects: if those are the records, "
        "make that list the file's content)"
      )
  return ""


def _json_lines(path: str, data: bytes):
  """(line number, parsed value) per non-blank line of JSON Lines `data`."""
  # Lines end at "\n" alone: a JSON string may hold a raw carriage return.
  for line_no, raw in enumerate(data.split(b"\n"), start=1):
    try:
      line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
      raise DataError(
        f"{path}:{line_no}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
        "save the file as UTF-8"
      ) from None
    if line.strip():
      yield line_no, _loads(f"{path}:{line_no}", line, "line")


def _loads(where: str, text: str, what: str) -> Any:
  """`text` parsed as JSON, or a DataError naming `where`."""
  try:
    return json.loads(text)
  except json.JSONDecodeError as e:
    raise DataError(f"{where}: not valid JSON ({e.msg}): {text[:80]!r}") from e
  except RecursionError:
    raise DataError(
      f"{where}: JSON nested too deeply to read ({len(text)} characters in {what}); records "
      "are flat objects with a prompt and an answer field"
    ) from None
  except ValueError as e:  # a number past Python's int conversion limit (4300 digits)
    raise DataError(f"{where}: a value JSON cannot read here ({e})") from None


def _parquet_rows(path: str, fields: Sequence[str]):
  """(location, row dict, column names) per row of a Parquet file; reads only the columns
  the fields need."""
  import pyarrow.parquet as pq

  try:
    pf = pq.ParquetFile(path)
  except Exception as e:  # pyarrow raises several error types for a bad file
    raise DataError(f"{path}: not a readable Parquet file: {' '.join(str(e).split())}") from e
  names = pf.schema_arrow.names
  wanted = {f if f in names else f.split(".")[0] for f in fields}
  columns = [n for n in names if n in wanted]
  if len(columns) < len(wanted):
    columns = None  # some field is absent: read everything so the error lists the columns
  try:
    rows = pf.read(columns=columns).to_pylist()
  except Exception as e:  # a damaged page: pyarrow raises OSError, ArrowInvalid and others
    raise DataError(f"{path}: not a readable Parquet file: {' '.join(str(e).split())}") from e
  for k, row in enumerate(rows):
    yield f"{path} row {k}", row, names


def _file_kind(path: str) -> str:
  for ext in SUPPORTED_EXTENSIONS:
    if path.endswith(ext):
      return ext
  raise DataError(
    f"{path}: unsupported file type; supported extensions: {', '.join(SUPPORTED_EXTENSIONS)}."
  )


def _check_prompt(where: str, prompt: Any, prompt_field: str) -> str:
  """A record's prompt: DataError unless it is a non-empty string of valid text."""
  if not isinstance(prompt, str):
    hint = ""
    if isinstance(prompt, list):
      hint = (
        f" (for chat-style records point prompt_field at the text, e.g. '{prompt_field}.0.content')"
      )
    raise DataError(
      f"{where}: prompt field {prompt_field!r} holds a {type(prompt).__name__}, not a string{hint}."
    )
  if not prompt.strip():
    raise DataError(f"{where}: prompt field {prompt_field!r} is empty.")
  _check_text(where, prompt_field, prompt)
  return prompt


def _file_records(
  path: str,
  fields: Sequence[str],
  *,
  prompt_field: str,
  answer_field: str | None,
  metadata_fields: Sequence[str],
) -> tuple[list[dict[str, Any]], int, int]:
  """(records, rows read, rows skipped for a null answer) of one dataset file."""
  kind = _file_kind(path)
  rows = _parquet_rows(path, fields) if kind == ".parquet" else _json_rows(path, kind)
  records = []
  num_rows = num_null = 0
  for where, row, has in rows:
    num_rows += 1
    values = {}
    for field in fields:
      value = _lookup(row, field)
      if value is _MISSING:
        raise DataError(
          f"{where}: record has no field {field!r}; its fields are {has}{_wrapped_hint(row)}."
        )
      values[field] = value
    prompt = _check_prompt(where, values[prompt_field], prompt_field)
    if answer_field and _is_null_answer(values[answer_field]):
      num_null += 1
      continue
    record = {
      "prompt": prompt,
      "answer": _answer_text(values[answer_field], where, answer_field) if answer_field else "",
    }
    _check_text(where, answer_field or "answer", record["answer"])
    record.update({f: values[f] for f in metadata_fields})
    records.append(record)
  return records, num_rows, num_null


def load_records(
  files: Sequence[str] | str,
  *,
  prompt_field: str = "prompt",
  answer_field: str | None = "answer",
  metadata_fields: Sequence[str] = (),
) -> Records:
  """Reads prompt records from JSON Lines (``.jsonl``, ``.json``; gzipped too), JSON arrays
  (``.json``) and Parquet files.

  Each record becomes ``{'prompt': str, 'answer': str, <metadata field>: value, ...}``. Fields
  are names or dotted paths into nested values (``'messages.0.content'``, ``'info.level'``);
  file names may be glob patterns. ``answer_field=None`` gives every record an empty answer.
  Rows whose answer is None (JSON null, Parquet null), NaN or blank text are skipped, with a
  warning per file, and counted in the result's ``skipped['skipped_null_answer']``; when every
  row is skipped that is an error naming the files and the field. Errors name the file and
  line (or Parquet row): invalid JSON, a missing field (listing the fields the record has), a
  prompt that is not a non-empty string; and an empty result.
  """
  paths = _expand(files)
  fields = [prompt_field, *([answer_field] if answer_field else []), *metadata_fields]
  clash = set(metadata_fields) & {*BATCH_KEYS, "prompt"}
  if clash:
    raise DataError(
      f"metadata_fields {sorted(clash)} clash with the keys 'prompt' and {BATCH_KEYS}."
    )
  records = []
  null_answers: dict[str, int] = {}  # path -> rows skipped for a null answer
  for path in paths:
    read, num_rows, num_null = _file_records(
      path,
      fields,
      prompt_field=prompt_field,
      answer_field=answer_field,
      metadata_fields=metadata_fields,
    )
    records.extend(read)
    if num_null:
      null_answers[path] = num_null
      logging.warning(
        "%s: skipped %d of %d rows whose answer field %r is null, NaN or empty.",
        path,
        num_null,
        num_rows,
        answer_field,
      )
  if not records and null_answers:
    raise DataError(
      f"Every row of the dataset files {sorted(null_answers)} has a null, NaN or empty answer "
      f"in the answer field {answer_field!r}; no records are left (check the answer field)."
    )
  if not records:
    raise DataError(f"No records in the dataset files {paths}.")
  return Records(records, skipped={"skipped_null_answer": sum(null_answers.values())})


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
  ``(records, [])``. Both sides are ``Records``; the train side keeps the skip counts of
  ``records`` (rows skipped in the files they were read from), the eval side has those of
  ``eval_files`` (zeros for a fraction split).
  """
  if eval_files is not None and eval_fraction:
    raise DataError("Give either eval_fraction or eval_files, not both.")
  if not 0.0 <= eval_fraction < 1.0:
    raise DataError(f"eval_fraction must be in [0, 1), got {eval_fraction}.")
  records = Records(records, skipped=skip_counts(records))
  if eval_files is not None:
    evals = load_records(eval_files, **load_kwargs)
    overlap = len({r["prompt"] for r in records} & {r["prompt"] for r in evals})
    if overlap:
      logging.warning("%d eval prompts also appear in the training records.", overlap)
    return records, evals
  if not eval_fraction:
    return records, Records()
  to_eval = [_hash_unit(r["prompt"], seed) < eval_fraction for r in records]
  train = Records([r for r, e in zip(records, to_eval) if not e], skipped=records.skipped)
  evals = Records([r for r, e in zip(records, to_eval) if e])
  if not train or not evals:
    raise DataError(
      f"data.eval_fraction={eval_fraction} split {len(records)} records into {len(train)} train "
      f"and {len(evals)} eval; both sides need at least one record: raise data.eval_fraction, "
      "add records, or give held-out prompts in data.eval_files"
    )
  return train, evals
