"""Subword tokenizers: ``tokenizer.json`` files and the special tokens a model directory sets.

``HFTokenizer`` wraps a ``tokenizers.Tokenizer`` together with the special-token settings that a
model directory keeps beside it (``tokenizer_config.json``, ``generation_config.json``), and
renders its chat template with ``templates.apply_chat_template``. Prompt and chat templates are
in ``jaxrl_llm.data.templates``.

Needs the optional packages ``tokenizers`` and ``jinja2`` (for chat templates); both are imported
lazily, so this module can be imported without them.
"""

from __future__ import annotations

import functools
import json
import pathlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl_llm.data import templates

OVERFLOW_POLICIES = ("error", "drop")


def _read_json(path: pathlib.Path) -> dict[str, Any]:
  """Parses a JSON object from ``path``; ValueError naming the file when that fails."""
  try:
    value = json.loads(path.read_text(encoding="utf-8"))
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"Could not read JSON from {path}: {e}") from e
  if not isinstance(value, dict):
    raise ValueError(f"{path} must hold a JSON object, found {type(value).__name__}.")
  return value


def _generation_ids(gc: Mapping[str, Any]) -> tuple[list[int], int | None]:
  """(eos ids, pad id) of a generation_config: `eos_token_id` an id >= 0 or a list of them,
  `pad_token_id` an id >= 0, either null or absent; a ValueError naming a value that is not
  (a string, a float or a boolean is no id)."""

  def is_id(v):
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0

  eos = gc.get("eos_token_id")
  ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
  if not all(is_id(i) for i in ids):
    raise ValueError(f"eos_token_id={eos!r} is not a token id >= 0, a list of them or null")
  pad = gc.get("pad_token_id")
  if pad is not None and not is_id(pad):
    raise ValueError(f"pad_token_id={pad!r} is not a token id >= 0 or null")
  return ids, pad


def _config_dict(config: Mapping[str, Any] | str | pathlib.Path | None) -> tuple[dict, str]:
  """A config given as a dict or a JSON path → (dict, description for messages)."""
  if config is None:
    return {}, "<none>"
  if isinstance(config, Mapping):
    return dict(config), "<dict>"
  path = pathlib.Path(config)
  return _read_json(path), str(path)


def _token_content(value: Any) -> str | None:
  """A special token as written in tokenizer_config.json: a string or an AddedToken dict."""
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, Mapping) and isinstance(value.get("content"), str):
    return value["content"]
  raise ValueError(f"Cannot read a special token from {value!r}.")


def _pick_chat_template(value: Any) -> str | None:
  """``chat_template`` is a string or a list of ``{'name', 'template'}``; prefer 'default'."""
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, list):
    named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
    if "default" in named:
      return named["default"]
    if named:
      return next(iter(named.values()))
  raise ValueError(f"Cannot read chat_template from a {type(value).__name__}.")


def _joined(text: str | Sequence[str]) -> str:
  """A string, or the text of ``render_prompt_parts`` parts."""
  return text if isinstance(text, str) else "".join(text)


def _encodings(tok: Any, texts: list[str], add_special_tokens: bool) -> list[Any]:
  """``tokenizers`` encodings of ``texts`` (one batch call; a single text encoded directly)."""
  if len(texts) == 1:
    return [tok.encode(texts[0], add_special_tokens=add_special_tokens)]
  return tok.encode_batch(texts, add_special_tokens=add_special_tokens) if texts else []


class HFTokenizer:
  """A ``tokenizers`` tokenizer plus its special tokens and chat template.

  ``eos_ids`` are all ids that end a completion: the configured ``eos_token`` first, then any
  further ids in ``generation_config.json``'s ``eos_token_id`` (an int or a list). ``pad_id``
  is the ``pad_token`` when one is configured, else ``generation_config``'s ``pad_token_id``,
  else it falls back to ``eos_id`` (padding is always masked, so sharing the id is harmless;
  but decode a left-padded prompt as ``ids[mask]``, or its padding reads as an eos).
  """

  def __init__(
    self,
    tokenizer: Any,
    *,
    eos_token: str | None = None,
    pad_token: str | None = None,
    bos_token: str | None = None,
    eos_token_ids: Sequence[int] = (),
    pad_token_id: int | None = None,
    chat_template: str | None = None,
    add_bos_token: bool = False,
    source: str = "<in-memory tokenizer>",
  ):
    self._tok = tokenizer
    self.source = source
    self.chat_template = chat_template
    self.add_bos_token = bool(add_bos_token)
    self.eos_token, self.pad_token, self.bos_token = eos_token, pad_token, bos_token
    eos = [self._id_of(eos_token, "eos_token")] if eos_token is not None else []
    for i in eos_token_ids:
      if int(i) not in eos:
        eos.append(int(i))
    if not eos:
      raise ValueError(
        f"{source}: no end-of-sequence token configured; set eos_token in tokenizer_config.json "
        "or eos_token_id in generation_config.json."
      )
    for i in eos:
      self._check_id(i, "eos id")
    self._eos_ids = tuple(eos)
    if self.eos_token is None:
      self.eos_token = self._tok.id_to_token(eos[0])
    if pad_token is not None:
      self._pad_id = self._id_of(pad_token, "pad_token")
    elif pad_token_id is not None:
      self._pad_id = self._check_id(int(pad_token_id), "pad_token_id")
    else:
      self._pad_id = eos[0]
    self._bos_id = self._id_of(bos_token, "bos_token") if bos_token is not None else None
    if self.add_bos_token and self._bos_id is None:
      raise ValueError(f"{source}: add_bos_token is true but no bos_token is configured.")

  # ---- construction -----------------------------------------------------------------------

  @classmethod
  def from_file(
    cls,
    path: str | pathlib.Path,
    *,
    tokenizer_config: Mapping[str, Any] | str | pathlib.Path | None = None,
    generation_config: Mapping[str, Any] | str | pathlib.Path | None = None,
    chat_template: str | None = None,
  ) -> HFTokenizer:
    """Loads ``tokenizer.json`` at ``path``; configs are dicts or paths to JSON files.

    Reads ``eos_token``, ``pad_token``, ``bos_token``, ``chat_template`` and ``add_bos_token``
    from ``tokenizer_config`` and ``eos_token_id`` / ``pad_token_id`` from
    ``generation_config``. An explicit ``chat_template`` overrides the config's.
    """
    from tokenizers import Tokenizer

    path = pathlib.Path(path)
    if not path.is_file():
      raise FileNotFoundError(f"Tokenizer file {path} does not exist.")
    try:
      tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust library raises a plain Exception
      raise ValueError(f"{path} is not a valid tokenizer.json: {e}") from e
    tc, tc_name = _config_dict(tokenizer_config)
    gc, gc_name = _config_dict(generation_config)
    try:
      eos, pad, bos = (_token_content(tc.get(k)) for k in ("eos_token", "pad_token", "bos_token"))
      template = chat_template or _pick_chat_template(tc.get("chat_template"))
    except ValueError as e:
      raise ValueError(f"{tc_name}: {e}") from e
    try:
      gen_eos, gen_pad = _generation_ids(gc)
    except ValueError as e:
      raise ValueError(f"{gc_name}: {e}") from e
    return cls(
      tok,
      eos_token=eos,
      pad_token=pad,
      bos_token=bos,
      eos_token_ids=gen_eos,
      pad_token_id=gen_pad,
      chat_template=template,
      add_bos_token=bool(tc.get("add_bos_token", False)),
      source=f"{path} (tokenizer_config: {tc_name}, generation_config: {gc_name})",
    )

  @classmethod
  def from_dir(cls, directory: str | pathlib.Path) -> HFTokenizer:
    """Loads a model directory: ``tokenizer.json`` plus optional ``tokenizer_config.json``,
    ``generation_config.json`` and ``chat_template.jinja`` (which, when present, takes
    precedence over the config's ``chat_template``)."""
    d = pathlib.Path(directory)
    if not d.is_dir():
      raise FileNotFoundError(f"Tokenizer directory {d} does not exist.")
    path = d / "tokenizer.json"
    if not path.is_file():
      held = sorted(p.name for p in d.iterdir())
      raise FileNotFoundError(f"{path} does not exist; {d} holds {held}.")
    tc, gc = d / "tokenizer_config.json", d / "generation_config.json"
    jinja = d / "chat_template.jinja"
    return cls.from_file(
      path,
      tokenizer_config=tc if tc.is_file() else None,
      generation_config=gc if gc.is_file() else None,
      chat_template=jinja.read_text(encoding="utf-8") if jinja.is_file() else None,
    )

  def _id_of(self, token: str, what: str) -> int:
    i = self._tok.token_to_id(token)
    if i is None:
      raise ValueError(f"{self.source}: {what} {token!r} is not in the vocabulary.")
    return int(i)

  def _check_id(self, i: int, what: str) -> int:
    if not 0 <= i < self.vocab_size:
      raise ValueError(
        f"{self.source}: {what} {i} is outside the vocabulary [0, {self.vocab_size})."
      )
    return i

  def __repr__(self) -> str:
    return (
      f"HFTokenizer(vocab_size={self.vocab_size}, eos_ids={self.eos_ids}, pad_id={self.pad_id}, "
      f"bos_id={self.bos_id}, chat_template={'yes' if self.chat_template else 'no'})"
    )

  # ---- special ids ------------------------------------------------------------------------

  @property
  def eos_id(self) -> int:
    """Primary end-of-sequence id (appended to SFT targets; the first of ``eos_ids``)."""
    return self._eos_ids[0]

  @property
  def eos_ids(self) -> tuple[int, ...]:
    """Every id that ends a completion (stop ids for the sampler)."""
    return self._eos_ids

  @property
  def pad_id(self) -> int:
    """Padding id: the pad token, or ``eos_id`` when the tokenizer defines none."""
    return self._pad_id

  @property
  def bos_id(self) -> int | None:
    """Beginning-of-sequence id, or None when the tokenizer has no bos token."""
    return self._bos_id

  @property
  def vocab_size(self) -> int:
    """Number of ids the tokenizer can produce, added tokens included (a model's embedding
    table may be larger)."""
    return int(self._tok.get_vocab_size(with_added_tokens=True))

  def vocabulary(self) -> dict[str, int]:
    """Token -> id, added tokens included."""
    return self._tok.get_vocab(with_added_tokens=True)

  # ---- encode / decode --------------------------------------------------------------------

  def _finish(self, ids: list[int], add_special_tokens: bool) -> list[int]:
    if add_special_tokens and self.add_bos_token and (not ids or ids[0] != self._bos_id):
      ids = [self._bos_id, *ids]
    return ids

  @functools.cached_property
  def special_tokens(self) -> tuple[str, ...]:
    """The special (control) token strings of the vocabulary, longest first."""
    added = self._tok.get_added_tokens_decoder().values()
    return tuple(
      sorted({t.content for t in added if t.special and t.content}, key=lambda t: (-len(t), t))
    )

  @functools.cached_property
  def _special_pattern(self) -> re.Pattern | None:
    """Matches a special token as the tokenizer does, with the whitespace that an ``lstrip`` /
    ``rstrip`` token absorbs; None when the vocabulary has no special tokens."""
    added = [t for t in self._tok.get_added_tokens_decoder().values() if t.special and t.content]
    alternatives = [
      (r"\s*" if t.lstrip else "") + re.escape(t.content) + (r"\s*" if t.rstrip else "")
      for t in sorted(added, key=lambda t: -len(t.content))
    ]
    return re.compile("|".join(alternatives)) if alternatives else None

  @functools.cached_property
  def _special_finder(self) -> re.Pattern | None:
    """Matches any special-token string exactly (longest first); None when there are none."""
    if not self.special_tokens:
      return None
    return re.compile("|".join(re.escape(t) for t in self.special_tokens))

  def replace_special_tokens(self, text: str, replace) -> str:
    """``text`` with each special-token string ``t`` replaced by ``replace(t)``."""
    if self._special_finder is None:
      return text
    return self._special_finder.sub(lambda m: replace(m.group()), text)

  def find_special_tokens(self, text: str) -> list[str]:
    """The special-token strings that occur in ``text``, in order (``[]`` for plain text)."""
    return [] if self._special_finder is None else self._special_finder.findall(text)

  @functools.cached_property
  def _plain(self) -> Any:
    """A copy of the tokenizer that encodes special-token strings as plain text."""
    from tokenizers import Tokenizer

    plain = Tokenizer.from_str(self._tok.to_str())
    plain.encode_special_tokens = True
    return plain

  def split_at_special_tokens(self, text: str) -> list[str]:
    """``text`` split around the special tokens the tokenizer finds in it:
    ``[text, special, text, ..., special, text]`` (odd items are special tokens)."""
    if self._special_pattern is None:
      return [text]
    parts, start = [], 0
    for m in self._special_pattern.finditer(text):
      parts += [text[start : m.start()], m.group()]
      start = m.end()
    parts.append(text[start:])
    return parts

  def _encode_many(
    self, items: Sequence[str | Sequence[str]], add_special_tokens: bool, split_special_tokens: bool
  ) -> list[list[int]]:
    """Ids of each item: a string, or parts ``[text, control, ..., text]`` as from
    ``render_prompt_parts`` (text parts plain text, control parts special tokens)."""
    whole: dict[int, str] = {}
    split: dict[int, list[str]] = {}
    for k, item in enumerate(items):
      if isinstance(item, str):
        whole[k] = item
        continue
      parts = list(item)
      if len(parts) % 2 != 1:
        raise ValueError(f"item {k}: parts must alternate text and control tokens, got {item!r}.")
      joined = "".join(parts)
      if len(self.split_at_special_tokens(joined)) == len(parts):
        whole[k] = joined  # no special-token string inside the text: encode as one string
      else:
        split[k] = parts
    out: list[list[int]] = [[] for _ in items]
    tok = self._plain if split_special_tokens else self._tok
    for k, enc in zip(whole, _encodings(tok, list(whole.values()), add_special_tokens)):
      out[k] = list(enc.ids)
    if split:
      from tokenizers import Encoding

      texts = _encodings(self._plain, [p for ps in split.values() for p in ps[0::2]], False)
      controls = _encodings(self._tok, [p for ps in split.values() for p in ps[1::2]], False)
      texts, controls = iter(texts), iter(controls)
      for k, parts in split.items():
        pieces = [next(controls) if j % 2 else next(texts) for j in range(len(parts))]
        if add_special_tokens:
          merged = Encoding.merge(pieces, growing_offsets=True)
          out[k] = list(self._tok.post_process(merged, None, True).ids)
        else:
          out[k] = [i for piece in pieces for i in piece.ids]
    return [self._finish(ids, add_special_tokens) for ids in out]

  def encode(
    self,
    text: str | Sequence[str],
    add_special_tokens: bool = False,
    *,
    split_special_tokens: bool = False,
  ) -> list[int]:
    """Token ids of ``text``. Special-token strings in the text (e.g. ``<|im_end|>``) map to
    their ids, unless ``split_special_tokens``, which encodes them as plain text. ``text`` may
    also be parts from ``render_prompt_parts``: text parts are encoded as plain text, control
    parts as special tokens. ``add_special_tokens`` runs the tokenizer's post-processor and
    prepends bos when ``add_bos_token`` is set; leave it off for text rendered by a chat
    template, which writes its own special tokens."""
    return self._encode_many([text], add_special_tokens, split_special_tokens)[0]

  def decode(
    self,
    ids: Sequence[int] | np.ndarray,
    skip_special_tokens: bool = True,
    stop_at_eos: bool = True,
  ) -> str:
    """Text of ``ids``; with ``stop_at_eos`` everything from the first of ``eos_ids`` is cut."""
    ids = [int(i) for i in np.asarray(ids).reshape(-1)]
    if stop_at_eos:
      stops = set(self._eos_ids)
      cut = next((k for k, i in enumerate(ids) if i in stops), len(ids))
      ids = ids[:cut]
    return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

  def encode_batch(
    self,
    texts: Sequence[str | Sequence[str]],
    length: int,
    *,
    left_pad: bool = True,
    add_special_tokens: bool = False,
    overflow: str = "error",
    split_special_tokens: bool = False,
  ) -> tuple[np.ndarray, ...]:
    """Encodes texts (strings or ``render_prompt_parts`` parts, as in ``encode``) into a padded
    ``[N, length]`` block.

    Returns ``(ids [N, L] int32, mask [N, L] bool)`` with ``pad_id`` outside the mask; the
    padding goes on the left when ``left_pad`` (prompts) else on the right. A text longer than
    ``length`` tokens raises ValueError under ``overflow='error'``; under ``overflow='drop'``
    such rows are left out and the result is ``(ids [M, L], mask [M, L], too_long [N] bool)``
    with ``M = N - too_long.sum()``.
    """
    if overflow not in OVERFLOW_POLICIES:
      raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, got {overflow!r}.")
    if length < 1:
      raise ValueError(f"length must be >= 1, got {length}.")
    seqs = self._encode_many(texts, add_special_tokens, split_special_tokens)
    lens = np.asarray([len(s) for s in seqs], np.int64)
    too_long = lens > length
    if overflow == "error" and too_long.any():
      first = int(np.argmax(too_long))
      raise ValueError(
        f"{int(too_long.sum())} of {len(seqs)} texts are longer than length={length} tokens "
        f"(longest: {int(lens.max())}); first is row {first} ({lens[first]} tokens): "
        f"{_joined(texts[first])[:80]!r}. Raise the length or pass overflow='drop'."
      )
    kept = [s for s, t in zip(seqs, too_long) if not t]
    ids = np.full((len(kept), length), self.pad_id, np.int32)
    mask = np.zeros((len(kept), length), bool)
    for r, s in enumerate(kept):
      if not s:
        continue
      cols = slice(length - len(s), length) if left_pad else slice(0, len(s))
      ids[r, cols] = s
      mask[r, cols] = True
    if overflow == "drop":
      return ids, mask, too_long
    return ids, mask

  # ---- chat template ----------------------------------------------------------------------

  def apply_chat_template(
    self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True, **kwargs
  ) -> str:
    """Renders ``messages`` with this tokenizer's chat template (see ``apply_chat_template``)."""
    if not self.chat_template:
      raise ValueError(
        f"{self.source} has no chat template (tokenizer_config.json chat_template or "
        "chat_template.jinja)."
      )
    specials = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
    if self.pad_token is not None:
      specials["pad_token"] = self.pad_token
    return templates.apply_chat_template(
      messages,
      self.chat_template,
      add_generation_prompt=add_generation_prompt,
      **{**specials, **kwargs},
    )


def vocabulary_digest(path: str) -> dict[str, int | str] | None:
  """{"tokens", "sha256"} of the vocabulary (token → id, added tokens included) of the tokenizer
  at `path` (a directory holding tokenizer.json, or the file): the same wherever it lies, other
  for other ids. None where it does not read (whoever builds the task names that)."""
  import hashlib
  import os

  from tokenizers import Tokenizer

  file = os.path.join(path, "tokenizer.json") if path and os.path.isdir(path) else path
  try:
    vocabulary = Tokenizer.from_file(file).get_vocab(with_added_tokens=True) if file else None
  except Exception:  # the library's own parse error
    return None
  if vocabulary is None:
    return None
  text = json.dumps(sorted(vocabulary.items()), ensure_ascii=False).encode()
  return {"tokens": len(vocabulary), "sha256": hashlib.sha256(text).hexdigest()}
