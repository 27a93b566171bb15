"""How tool calls and answers are written in a tokenizer's text, and read as token ids.

A multi-turn rollout's tool (`envs`) reads the policy's call and writes its answer in the
tokenizer's chat format (`FORMATS`, chosen by `tool_format`; `ToolTokens` holds the ids):

  plain   the built-in tasks' alphabet: ``5*3+8=`` is answered ``23,`` (an error ``:,``)
  chatml  ChatML's tool role: ``<tool_call>12*35</tool_call>`` is answered
          ``<|im_end|>\n<|im_start|>tool\n420<|im_end|>\n<|im_start|>assistant\n``
  llama3  Llama 3's: ``<|python_tag|>12*35<|eom_id|>`` is answered by an ``ipython`` turn
  inline  (`arithmetic_inline`, any Hugging Face tokenizer) in the policy's own prose, as a
          calculator fills in a result: ``so 12 * 35 =`` is answered `` 420`` (an error
          `` ?``) and the policy writes on; ``x`` and ``×`` multiply too
"""

from __future__ import annotations

import dataclasses
import functools
import re

from jaxrl_llm.data.tasks.tokenizer import CharTokenizer

CALL_CLOSE = "="  # ends a tool call: the environment answers after it
ANSWER_END = ","  # ends the environment's answer
ERROR = ":"  # the answer to a call the environment cannot evaluate
OPS = "+-*"
NUMBER = re.compile(r"[0-9]{1,9}")  # a number token's text (surrounding whitespace aside)


@dataclasses.dataclass(frozen=True)
class ToolFormat:
  """How calls and answers are written in a tokenizer's text: the policy closes a call with
  `close`; the environment answers `prefix + value + suffix` (or `prefix + error + suffix`).
  With `trailing`, the call is the run of number, operator and blank tokens just before the
  close (what precedes it, such as an opening tag, is the policy's prose); without, the whole
  segment since the last answer is the call."""

  name: str
  close: str
  prefix: str
  suffix: str
  error: str
  opening: str = ""  # the tag a call opens with, shown to the policy in its instructions
  trailing: bool = True
  times: tuple[str, ...] = ()  # other ways the policy may write `*` in a call


# The formats by tokenizer: the task alphabet's, ChatML's tool role, Llama 3's `ipython` role.
FORMATS = {
  "plain": ToolFormat("plain", CALL_CLOSE, "", ANSWER_END, ERROR, trailing=False),
  "chatml": ToolFormat(
    "chatml",
    "</tool_call>",
    "<|im_end|>\n<|im_start|>tool\n",
    "<|im_end|>\n<|im_start|>assistant\n",
    "error",
    opening="<tool_call>",
  ),
  "llama3": ToolFormat(
    "llama3",
    "<|eom_id|>",
    "<|start_header_id|>ipython<|end_header_id|>\n\n",
    "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    "error",
    opening="<|python_tag|>",
  ),
  "inline": ToolFormat("inline", " =", " ", "", "?", times=("x", "×")),
}


@dataclasses.dataclass(frozen=True)
class ToolTokens:
  """A tool's view of a tokenizer, as token ids: the close sequence, the number, operator and
  blank tokens a call is read from, and the pieces of an answer."""

  format: ToolFormat
  close: tuple[int, ...]
  numbers: tuple[tuple[int, int, int], ...]  # (id, value, digits) of each number token
  ops: tuple[tuple[int, int], ...]  # (id, 1 '+' | 2 '-' | 3 '*')
  blanks: tuple[int, ...]  # whitespace tokens, skipped inside a trailing call
  digits: tuple[int, ...]  # the ids of "0".."9", to write a value
  minus: int
  prefix: tuple[int, ...]
  suffix: tuple[int, ...]
  error: tuple[int, ...]
  pad: int
  vocab_size: int


def tool_format(tokenizer, inline: bool = False) -> ToolFormat:
  """The format of `tokenizer`'s calls: plain for the task alphabet; `inline` for a Hugging
  Face tokenizer when asked; else ChatML or Llama 3 by the chat tokens it holds, and a
  ValueError naming what it lacks otherwise."""
  if isinstance(tokenizer, CharTokenizer):
    return FORMATS["plain"]
  if inline:
    return FORMATS["inline"]
  special = set(tokenizer.special_tokens)
  if "<|start_header_id|>" in special:
    if "<|eom_id|>" not in special:
      raise ValueError(
        f"{tokenizer.source}: a tool needs the Llama 3 tool-call token '<|eom_id|>', which is "
        "missing from the vocabulary (Llama 3.1 and later have it)"
      )
    return FORMATS["llama3"]
  if "<|im_start|>" in special:
    return FORMATS["chatml"]
  raise ValueError(
    f"{tokenizer.source}: a tool needs a chat format with a tool role, ChatML (<|im_start|>) "
    "or Llama 3 (<|start_header_id|>); the tokenizer has neither"
  )


@functools.cache
def token_texts(tokenizer) -> tuple[str, ...]:
  """Each id's text as it reads inside an episode, after other text: decoded after an anchor
  token (special tokens kept), less the anchor's text. A Metaspace (SentencePiece-style)
  decoder drops the blank of a sequence's first token, so alone `▁5` reads "5" and `▁` reads
  ""; here they read " 5" and " "."""
  anchor = list(tokenizer.encode("a")[-1:])
  head = _decode(tokenizer, anchor)
  return tuple(_after(tokenizer, anchor, head, [i]) for i in range(tokenizer.vocab_size))


def _decode(tokenizer, ids):
  return tokenizer.decode(list(ids), skip_special_tokens=False, stop_at_eos=False)


def _after(tokenizer, anchor, head, ids):
  """The text `ids` write after the `anchor` ids (whose text is `head`)."""
  s = _decode(tokenizer, [*anchor, *ids])
  return s[len(head) :] if s.startswith(head) else _decode(tokenizer, ids)


def _reader(tokenizer):
  """(texts, encode, text_of) of `tokenizer`: each id's text (`token_texts`), the ids of a
  text, and the text a run of ids writes inside an episode."""
  if isinstance(tokenizer, CharTokenizer):
    texts = {tokenizer.char_id(c): c for c in tokenizer.alphabet}

    def encode(text):
      return tuple(int(i) for i in tokenizer.ids_of(text))

    return texts, encode, lambda ids: "".join(texts.get(i, "\ufffd") for i in ids)
  anchor = list(tokenizer.encode("a")[-1:])
  head = _decode(tokenizer, anchor)

  def encode(text):
    return tuple(tokenizer.encode(text))

  return (
    dict(enumerate(token_texts(tokenizer))),
    encode,
    functools.partial(_after, tokenizer, anchor, head),
  )


def _writer(texts, encode, text_of):
  """`ids(piece)`: the ids that write `piece` exactly (its encoding; without a blank that the
  tokenizer prepends to a sequence; or the one token of that text), None when none does."""
  exact = {}
  for i, s in texts.items():
    exact.setdefault(s, []).append(i)
  preferred = set(encode("0123456789-"))  # the tokenizer's own digit tokens (not byte fallback)

  def ids(piece):
    enc = encode(piece)
    if text_of(enc) == piece:
      return enc
    if len(enc) > 1 and not text_of(enc[:1]).strip() and text_of(enc[1:]) == piece:
      return enc[1:]
    if piece in exact:
      return (min(exact[piece], key=lambda i: (i not in preferred, i)),)
    return None

  return ids


@functools.cache
def tool_tokens(tokenizer, inline: bool = False) -> ToolTokens:
  """`tokenizer`'s `ToolTokens` in its format (`tool_format`), built once per tokenizer and
  format; a ValueError naming each piece the tool writes or reads (close, digits, minus,
  prefix, suffix, error) that no ids of the tokenizer write exactly."""
  fmt = tool_format(tokenizer, inline)
  texts, encode, text_of = _reader(tokenizer)
  ids = _writer(texts, encode, text_of)
  pieces = {"close": fmt.close, "prefix": fmt.prefix, "suffix": fmt.suffix, "error": fmt.error}
  written = {k: ids(v) if v else () for k, v in pieces.items()}
  digits = [ids(str(d)) for d in range(10)]
  minus = ids("-")
  missing = [f"{k} {pieces[k]!r}" for k, v in written.items() if v is None]
  lacking = "".join(str(d) for d in range(10) if not digits[d] or len(digits[d]) != 1)
  missing += [f"digits {lacking!r}"] if lacking else []
  missing += ["minus '-'"] if not minus or len(minus) != 1 else []
  if missing:
    raise ValueError(
      f"{getattr(tokenizer, 'source', 'the tokenizer')}: the tool's pieces missing from the "
      f"vocabulary: {', '.join(missing)} (no ids decode to exactly the text the tool writes "
      "or reads)"
    )
  strip = (lambda s: s.strip()) if fmt.trailing else (lambda s: s)
  numbers = tuple(
    (i, int(strip(s)), len(strip(s))) for i, s in texts.items() if NUMBER.fullmatch(strip(s))
  )
  ops = tuple(
    (i, OPS.index(strip(s)) + 1) for i, s in texts.items() if strip(s) and strip(s) in OPS
  )
  ops += tuple((i, 3) for i, s in texts.items() if strip(s) and strip(s) in fmt.times)
  blanks = tuple(i for i, s in texts.items() if fmt.trailing and s and not s.strip())
  return ToolTokens(
    format=fmt,
    **written,
    numbers=numbers,
    ops=ops,
    blanks=blanks,
    digits=tuple(d[0] for d in digits),
    minus=minus[0],
    pad=tokenizer.pad_id,
    vocab_size=tokenizer.vocab_size,
  )
