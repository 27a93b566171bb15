"""A fixed character-level tokenizer for the built-in synthetic tasks."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
# Every character any built-in task can emit, in id order after the three special ids.
ALPHABET = "0123456789+=>:abcdefghij ,-*"


@dataclasses.dataclass(frozen=True)
class CharTokenizer:
  """Maps characters of a small fixed alphabet to ids; 0 = pad, 1 = bos, 2 = eos.

  Character ``ALPHABET[i]`` gets id ``3 + i``. ``vocab_size`` is rounded up to a multiple of 8
  so embedding tables tile well; ids past the last character are never produced by ``encode``
  and are rendered as ``?`` by ``decode``.
  """

  alphabet: str = ALPHABET

  def __post_init__(self):
    if len(set(self.alphabet)) != len(self.alphabet):
      raise ValueError(f"CharTokenizer alphabet has repeated characters: {self.alphabet!r}")
    if not self.alphabet.isascii() or "\0" in self.alphabet:
      raise ValueError(f"CharTokenizer alphabet must be printable ASCII, got {self.alphabet!r}")

  @property
  def pad_id(self) -> int:
    """Id of the padding token."""
    return PAD_ID

  @property
  def bos_id(self) -> int:
    """Id of the beginning-of-sequence token."""
    return BOS_ID

  @property
  def eos_id(self) -> int:
    """Id of the end-of-sequence token."""
    return EOS_ID

  @property
  def num_special(self) -> int:
    """Number of special ids (pad, bos, eos) that precede the characters."""
    return 3

  @property
  def vocab_size(self) -> int:
    """Embedding-table size: specials + alphabet, rounded up to a multiple of 8."""
    n = self.num_special + len(self.alphabet)
    return -(-n // 8) * 8

  def char_id(self, ch: str) -> int:
    """Id of one character; raises ValueError for characters outside the alphabet."""
    i = self.alphabet.find(ch)
    if len(ch) != 1 or i < 0:
      raise ValueError(
        f"Character {ch!r} is not in the tokenizer alphabet; allowed characters: {self.alphabet!r}"
      )
    return self.num_special + i

  def ids_of(self, chars: str) -> np.ndarray:
    """Ids of each character of ``chars`` as an int32 array (for allowed-token sets)."""
    return np.asarray([self.char_id(c) for c in chars], dtype=np.int32)

  def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
    """Encodes ``text`` character by character, optionally adding bos / eos."""
    ids = [self.char_id(c) for c in text]
    return ([BOS_ID] if bos else []) + ids + ([EOS_ID] if eos else [])

  def encode_batch(
    self, texts: Sequence[str], length: int, *, bos: bool, eos: bool, left_pad: bool
  ) -> tuple[np.ndarray, np.ndarray]:
    """Encodes many strings into a padded ``[N, length]`` int32 array and its bool mask.

    Vectorised over the batch (used to build task datasets of ~10^5 rows). ``left_pad`` puts
    the padding before the text (prompts) instead of after it (answers). Raises ValueError when
    a text does not fit in ``length`` or contains a character outside the alphabet.
    """
    n = len(texts)
    if n == 0:
      return np.zeros((0, length), np.int32), np.zeros((0, length), bool)
    bad = set("".join(texts)) - set(self.alphabet)
    if bad:
      self.char_id(min(bad))  # raises, naming the character and the alphabet
    width = max(max(len(t) for t in texts), 1)
    raw = np.asarray(texts, dtype=f"S{width}").view(np.uint8).reshape(n, width)
    lut = np.full(256, PAD_ID, np.int32)  # byte 0 is numpy's right padding
    lut[np.frombuffer(self.alphabet.encode("ascii"), np.uint8)] = np.arange(
      self.num_special, self.num_special + len(self.alphabet), dtype=np.int32
    )
    body = lut[raw]  # [N, W]
    lens = (raw != 0).sum(-1) + int(bos) + int(eos)  # [N]
    if lens.max() > length:
      raise ValueError(f"Text of {lens.max()} tokens does not fit in length {length}.")
    parts = [body]
    if bos:
      parts.insert(0, np.full((n, 1), BOS_ID, np.int32))
    if eos:
      parts.append(np.full((n, 1), PAD_ID, np.int32))
    seq = np.concatenate(parts, axis=1)  # [N, W + bos + eos], right-padded
    if eos:
      seq[np.arange(n), lens - 1] = EOS_ID
    out = np.full((n, max(length, seq.shape[1])), PAD_ID, np.int32)
    out[:, : seq.shape[1]] = seq
    out = out[:, :length]
    mask = np.arange(length)[None, :] < lens[:, None]
    if left_pad:
      # Roll each row right by its padding amount.
      shift = length - lens  # [N]
      cols = (np.arange(length)[None, :] - shift[:, None]) % length
      out = np.take_along_axis(out, cols, axis=1)
      mask = np.take_along_axis(mask, cols, axis=1)
    return out, mask

  def decode(self, ids: Sequence[int] | np.ndarray, stop_at_eos: bool = True) -> str:
    """Decodes ids to text, dropping pad and bos; stops at the first eos when asked.

    With ``stop_at_eos=False`` eos is rendered as ``<eos>``. Ids outside the vocabulary's
    characters are rendered as ``?``.
    """
    out = []
    for i in np.asarray(ids).reshape(-1).tolist():
      if i == EOS_ID:
        if stop_at_eos:
          break
        out.append("<eos>")
      elif i in (PAD_ID, BOS_ID):
        continue
      elif self.num_special <= i < self.num_special + len(self.alphabet):
        out.append(self.alphabet[i - self.num_special])
      else:
        out.append("?")
    return "".join(out)
