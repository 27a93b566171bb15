"""Answer extraction, normalisation and equivalence for math completions (host side).

Pure Python over decoded strings; nothing here is jitted. The built-in checker compares answers
numerically where both sides parse as numbers (integers and fractions exactly, decimals and
scientific notation with a relative tolerance) and otherwise as normalised strings; the optional
`math_verify` backend hands the comparison to the `math-verify` package when it is installed.

Hostile inputs are cut short before any parsing: an answer is read from the last
`ANSWER_WINDOW_CHARS` characters of a completion only, and a window or answer that is too long
(`MAX_ANSWER_CHARS`) or nests braces too deep (`MAX_BRACE_DEPTH`) is no answer. Every scan is
linear in its input. The built-in checker never evaluates powers, factorials or binomials (it
compares them as strings), so no answer can make it compute a huge number.
"""

from __future__ import annotations

import math
import re
import threading
from fractions import Fraction

Number = Fraction | float

_BOX_CMDS = ("\\boxed", "\\fbox")
_EXTRACT_MODES = ("auto", "boxed", "gsm8k", "last_number")
_BACKENDS = ("builtin", "math_verify")
_MINUS = "\u2212"  # the Unicode minus sign, as in "−3"

# Input limits, checked before any parsing (see `within_limits`).
MAX_TEXT_CHARS = 1_000_000  # a longer completion scores 0 in every built-in reward, unread
ANSWER_WINDOW_CHARS = 10_000  # a completion's answer is read from its last this many characters
MAX_ANSWER_CHARS = 2_000  # a longer answer (or reference answer) is not compared
MAX_BRACE_DEPTH = 32  # text whose braces nest deeper is not parsed

_BRACE_TOKEN_RE = re.compile(r"\\.|[{}]", re.DOTALL)  # an escape pair, or a brace
_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![a-zA-Z])(?P<ws>[ \t]*)")
_BOX_TOKEN_RE = re.compile(r"[^\s$]+")

# ---------------------------------------------------------------------------------------------
# Extraction
# ---------------------------------------------------------------------------------------------


def brace_depth(text: str) -> int:
  """The deepest nesting of unescaped `{}` in `text` (one linear pass)."""
  depth = deepest = 0
  for m in _BRACE_TOKEN_RE.finditer(text):
    c = text[m.start()]
    if c == "{":
      depth += 1
      deepest = max(deepest, depth)
    elif c == "}" and depth:
      depth -= 1
  return deepest


def within_limits(
  text: str, max_chars: int = MAX_ANSWER_CHARS, max_depth: int = MAX_BRACE_DEPTH
) -> bool:
  """Whether `text` is at most `max_chars` long with braces nested at most `max_depth` deep.

  The guard every built-in verifier applies before parsing; linear in `len(text)`, and
  constant time for a text that is too long.
  """
  if len(text) > max_chars:
    return False
  return text.count("{") <= max_depth or brace_depth(text) <= max_depth


def _brace_pairs(text: str) -> dict[int, int]:
  """Index of the matching `}` for every balanced `{` (escaped `\\{`/`\\}` ignored): one pass."""
  pairs, stack = {}, []
  for m in _BRACE_TOKEN_RE.finditer(text):
    i = m.start()
    if text[i] == "{":
      stack.append(i)
    elif text[i] == "}" and stack:
      pairs[stack.pop()] = i
  return pairs


def _match_brace(text: str, open_idx: int) -> int | None:
  """Index of the `}` matching the `{` at `open_idx` (escaped `\\{`/`\\}` ignored), or None."""
  depth = 0
  for m in _BRACE_TOKEN_RE.finditer(text, open_idx):
    c = text[m.start()]
    if c == "{":
      depth += 1
    elif c == "}":
      depth -= 1
      if depth == 0:
        return m.start()
  return None


def extract_boxed(text: str) -> list[str]:
  """All `\\boxed{...}` / `\\fbox{...}` contents in order (nested braces, `\\boxed 5` form).

  Linear in `len(text)`: braces are matched in one pass, however many boxes there are.
  """
  out: list[str] = []
  pairs = None
  pos = 0
  while True:
    m = _BOX_RE.search(text, pos)
    if m is None:
      return out
    i = m.end()
    if i < len(text) and text[i] == "{":
      if pairs is None:
        pairs = _brace_pairs(text)
      end = pairs.get(i)
      if end is None:  # unbalanced: no answer here
        pos = i + 1
        continue
      out.append(text[i + 1 : end].strip())
      pos = end + 1
    elif m.group("ws"):  # `\boxed 5`: the next whitespace-delimited token
      tok = _BOX_TOKEN_RE.match(text, i)
      if tok is None:
        pos = i
        continue
      out.append(tok.group(0).rstrip(".,;"))
      pos = tok.end()
    else:
      pos = i


def extract_gsm8k(text: str) -> str | None:
  """The answer after the last `####` (to the end of that line), or None."""
  idx = text.rfind("####")
  if idx < 0:
    return None
  ans = text[idx + 4 :].strip().split("\n", 1)[0].strip()
  return ans or None


_NUMBER_RE = re.compile(
  r"(?:(?<![\w)}\].])[-+\u2212])?"  # a sign, unless it is a binary operator ("3-4")
  r"(?<![\d.])"  # never start inside another number
  r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)?"  # integer part, optionally with thousands commas
  r"(?:(?<=\d)|(?=\.\d))"  # some digits before, or a leading-dot decimal like ".5"
  r"(?:\.\d+)?"  # decimal part
  r"(?:/\d+(?:\.\d+)?)?"  # a fraction "3/4"
  r"(?:[eE][-+]?\d+)?"  # scientific notation
  r"(?!\d)"
)


def extract_last_number(text: str) -> str | None:
  """The last number in `text` ("1,000" → "1000", "−3" → "-3", "3/4", "2.5e3"), or None."""
  last = None
  for m in _NUMBER_RE.finditer(text):
    if m.group(0) and any(c.isdigit() for c in m.group(0)):
      last = m.group(0)
  if last is None:
    return None
  return last.replace(",", "").replace(_MINUS, "-").lstrip("+")


def extract_answer(text: str, mode: str = "auto") -> str | None:
  """The final answer of a completion: 'auto' = last boxed → GSM8K `####` → last number.

  Only the last `ANSWER_WINDOW_CHARS` characters are read, and a window whose braces nest
  deeper than `MAX_BRACE_DEPTH` has no answer (None), so the cost is bounded for any input.
  """
  if mode not in _EXTRACT_MODES:
    raise ValueError(f"extract mode {mode!r} is not one of {_EXTRACT_MODES}")
  text = text[-ANSWER_WINDOW_CHARS:]
  if not within_limits(text, max_chars=ANSWER_WINDOW_CHARS):
    return None
  if mode in ("auto", "boxed"):
    boxed = [b for b in extract_boxed(text) if b]
    if boxed:
      return boxed[-1]
    if mode == "boxed":
      return None
  if mode in ("auto", "gsm8k"):
    ans = extract_gsm8k(text)
    if ans is not None or mode == "gsm8k":
      return ans
  return extract_last_number(text)


# ---------------------------------------------------------------------------------------------
# Normalisation
# ---------------------------------------------------------------------------------------------

_UNIT_WORDS = frozenset(
  "mm cm m km in ft yd mi mg g kg lb lbs oz ml l s sec min h hr hrs hour hours minute minutes "
  "second seconds day days week weeks month months year years cent cents dollar dollars "
  "meter meters metre metres inch inches foot feet yard yards mile miles unit units degree "
  "degrees percent sq square cubic mph kmh".split()
)
_TEXT_CMD_RE = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mbox|operatorname)\s*\{")
_PREFIX_RE = re.compile(
  r"^(?:the\s+)?(?:final\s+)?(?:answer|ans|solution)\s*(?:is|:|=)\s*:?\s*", re.IGNORECASE
)
_ASSIGN_RE = re.compile(r"^(?:[a-zA-Z]|\\[a-zA-Z]+)(?:_\{?\w+\}?)?\s*=\s*(?=\S)")
_FRAC_SHORT_RE = re.compile(r"\\frac\s*(\d|\{[^{}]*\})\s*(\d|\{[^{}]*\})")
_SQRT_SHORT_RE = re.compile(r"\\sqrt\s*(\d)")
_THOUSANDS_RE = re.compile(r"^[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_TRAILING_UNIT_RE = re.compile(
  r"^(?P<num>.*?[\d}.])(?P<sp>\s*)(?P<unit>[a-zA-Z]+(?:\s+[a-zA-Z]+)*)\s*(?:\^\{?[23]\}?)?$"
)


def _unwrap_commands(s: str) -> str:
  """Replaces `\\text{X}`-like commands (and `\\boxed{X}`) by their contents."""
  pattern = re.compile(_TEXT_CMD_RE.pattern + r"|\\(?:boxed|fbox)\s*\{")
  while True:
    m = pattern.search(s)
    if m is None:
      return s
    end = _match_brace(s, m.end() - 1)
    if end is None:
      return s[: m.start()] + s[m.end() :]
    inner = s[m.end() : end]
    if _TEXT_CMD_RE.match(m.group(0)):
      inner = f" {inner} "  # keep "5\text{cm}" apart so the unit reads as a word
    s = s[: m.start()] + inner + s[end + 1 :]


def _strip_units(s: str) -> str:
  """Drops trailing unit words ("5 cm", "12 dollars", "3 m^2") after a number."""
  m = _TRAILING_UNIT_RE.match(s)
  if m is None:
    return s
  words = m.group("unit").split()
  if not (m.group("sp") or all(w.lower() in _UNIT_WORDS for w in words)):
    return s  # "2x" is an expression, not "2 x"
  num = m.group("num").strip()
  if _parse_normalized(re.sub(r"\s+", "", num)) is None:
    return s
  return num


def _frac_braces(m: re.Match) -> str:
  """`\\frac12` / `\\frac1{2}` → `\\frac{1}{2}`."""
  return "\\frac{" + m[1].strip("{}") + "}{" + m[2].strip("{}") + "}"


def normalize(answer: str) -> str:
  """Canonical string form of an answer: no `$`, `\\text{}` units, `\\left`, spaces, `%`, `°`."""
  s = str(answer).strip().replace(_MINUS, "-")
  s = _PREFIX_RE.sub("", s)
  s = s.replace("\\$", "").replace("$", "")
  s = re.sub(r"^\\[\[(]|\\[\])]$", "", s.strip())
  s = _unwrap_commands(s)
  s = re.sub(r"\\(?:left|right|big|Big|bigl|bigr|Bigl|Bigr)(?![a-zA-Z])", "", s)
  s = re.sub(r"\\(?:displaystyle|limits)(?![a-zA-Z])", "", s)
  s = re.sub(r"\\[!,;:> ]", " ", s).replace("~", " ")
  s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?|°|\\degree(?![a-zA-Z])", "", s)
  s = re.sub(r"\\%|%|\bper\s*cent\b|\bpercent\b", "", s)
  s = re.sub(r"\\[dt]frac(?![a-zA-Z])", r"\\frac", s)
  s = _FRAC_SHORT_RE.sub(_frac_braces, s)
  s = _SQRT_SHORT_RE.sub(r"\\sqrt{\1}", s)
  s = s.strip()
  if s.count("=") == 1:
    s = _ASSIGN_RE.sub("", s)
  s = s.strip().rstrip(".").strip()
  s = _strip_units(s)
  s = re.sub(r"\s+", "", s)
  if _THOUSANDS_RE.match(s):
    s = s.replace(",", "")
  return s


# ---------------------------------------------------------------------------------------------
# Numbers
# ---------------------------------------------------------------------------------------------

_INT_RE = re.compile(r"^\d+$")
_DEC_RE = re.compile(r"^(?:\d+\.\d*|\.\d+)$")
_SCI_RE = re.compile(
  r"^(?P<m>\d+(?:\.\d*)?|\.\d+)(?:[eE](?P<e1>[-+]?\d+)|(?:\\times|\\cdot|\*|x)10\^\{?(?P<e2>[-+]?\d+)\}?)$"
)
_FRAC_RE = re.compile(r"^\\frac\{")


def _parse_unsigned(s: str) -> Number | None:
  """Parses a normalised, sign-free numeric literal or `\\frac{a}{b}`."""
  if _INT_RE.match(s):
    return Fraction(int(s))
  if _DEC_RE.match(s):
    return float(s)
  m = _SCI_RE.match(s)
  if m:
    return float(f"{m['m']}e{m['e1'] or m['e2']}")
  if _FRAC_RE.match(s):
    num_end = _match_brace(s, 5)
    if num_end is None or num_end + 1 >= len(s) or s[num_end + 1] != "{":
      return None
    den_end = _match_brace(s, num_end + 1)
    if den_end != len(s) - 1:
      return None
    return _divide(_parse_normalized(s[6:num_end]), _parse_normalized(s[num_end + 2 : den_end]))
  mixed = re.match(r"^(\d+)(\\frac\{.*)$", s)  # 1\frac{1}{2}
  if mixed:
    frac = _parse_unsigned(mixed[2])
    if frac is not None and 0 <= frac < 1:
      return Fraction(int(mixed[1])) + frac
    return None
  if s.count("/") == 1:
    a, b = s.split("/")
    return _divide(_parse_unsigned(a), _parse_unsigned(b))
  return None


def _divide(a: Number | None, b: Number | None) -> Number | None:
  """a / b keeping Fractions exact; None when either is missing or b is zero."""
  if a is None or b is None or b == 0:
    return None
  if isinstance(a, Fraction) and isinstance(b, Fraction):
    return a / b
  return float(a) / float(b)


def _strip_outer_braces(s: str) -> str:
  """`{{x}}` → `x`: drops redundant outer brace pairs (linear, one matching pass)."""
  if not (s.startswith("{") and s.endswith("}")):
    return s
  pairs, n, k = _brace_pairs(s), len(s), 0
  while k < n - 1 - k and pairs.get(k) == n - 1 - k:
    k += 1
  return s[k : n - k]


def _parse_normalized(s: str) -> Number | None:
  """Parses an already normalised (whitespace-free) string as a number, or None."""
  if len(s) > MAX_ANSWER_CHARS:
    return None
  s = _strip_outer_braces(s.strip())
  sign = 1
  if s and s[0] in "+-":
    sign = -1 if s[0] == "-" else 1
    s = s[1:]
  if _THOUSANDS_RE.match(s):
    s = s.replace(",", "")
  if not s:
    return None
  try:
    value = _parse_unsigned(s)
  except (ValueError, OverflowError, ZeroDivisionError):
    return None
  if value is None:
    return None
  return -value if sign < 0 else value


def parse_number(s: str) -> Number | None:
  """`s` as a number: Fraction for integers and fractions, float for decimals; else None."""
  if s is None or not within_limits(str(s)):
    return None
  return _parse_normalized(normalize(s))


def _numbers_equal(a: Number, b: Number, rel_tol: float) -> bool:
  """Exact for two Fractions, `math.isclose` (abs floor 1e-12) once either is a float."""
  if isinstance(a, Fraction) and isinstance(b, Fraction):
    return a == b
  try:
    return math.isclose(float(a), float(b), rel_tol=rel_tol, abs_tol=1e-12)
  except OverflowError:  # a Fraction beyond float range against a float
    return False


# ---------------------------------------------------------------------------------------------
# Equivalence
# ---------------------------------------------------------------------------------------------


def _split_top_level(s: str, sep: str = ",") -> list[str]:
  """Splits on `sep` outside any brackets."""
  parts, depth, start = [], 0, 0
  for i, c in enumerate(s):
    if c in "([{":
      depth += 1
    elif c in ")]}":
      depth -= 1
    elif c == sep and depth == 0:
      parts.append(s[start:i])
      start = i + 1
  parts.append(s[start:])
  return parts


def _atoms_equal(a: str, b: str, rel_tol: float) -> bool:
  """Equality of two normalised single answers: numeric if both parse, else string."""
  a, b = normalize(a), normalize(b)
  if not a or not b:
    return False
  if a == b:
    return True
  x, y = _parse_normalized(a), _parse_normalized(b)
  if x is not None and y is not None:
    return _numbers_equal(x, y, rel_tol)
  for opens, closes in (("(", ")"), ("[", "]"), ("\\{", "\\}")):  # tuples, intervals, sets
    if a.startswith(opens) and a.endswith(closes) and b.startswith(opens) and b.endswith(closes):
      ia, ib = a[len(opens) : -len(closes)], b[len(opens) : -len(closes)]
      pa, pb = _split_top_level(ia), _split_top_level(ib)
      if len(pa) > 1 or len(pb) > 1:
        return _lists_equal(pa, pb, rel_tol, ordered=opens != "\\{")
  return False


def _lists_equal(pa: list[str], pb: list[str], rel_tol: float, *, ordered: bool) -> bool:
  """Element-wise (ordered) or as a multiset (unordered) comparison of answer lists."""
  if len(pa) != len(pb):
    return False
  if ordered:
    return all(_atoms_equal(x, y, rel_tol) for x, y in zip(pa, pb))
  unused = list(pb)
  for x in pa:
    for j, y in enumerate(unused):
      if _atoms_equal(x, y, rel_tol):
        del unused[j]
        break
    else:
      return False
  return True


def _builtin_equivalent(pred: str, ref: str, rel_tol: float) -> bool:
  """The built-in checker: numbers, normalised strings, then unordered answer lists."""
  if _atoms_equal(pred, ref, rel_tol):
    return True
  np_, nr = normalize(pred), normalize(ref)
  pa, pb = _split_top_level(np_), _split_top_level(nr)
  if len(pa) > 1 and len(pb) > 1:  # "2, 3" vs "3,2"
    return _lists_equal(pa, pb, rel_tol, ordered=False)
  return False


def _math_verify_equivalent(pred: str, ref: str) -> bool:
  """Delegates to `math_verify.parse` / `verify` (gold = ref)."""
  try:
    import math_verify
  except ImportError as e:
    raise ImportError(
      "backend='math_verify' needs the optional `math-verify` package "
      "(pip install math-verify); the default backend='builtin' has no extra dependency"
    ) from e
  # math_verify's own timeouts use SIGALRM, which only works on the main thread; elsewhere
  # (e.g. inside score_batch's thread pool) the caller's timeout applies instead.
  main = threading.current_thread() is threading.main_thread()
  timeout = 5 if main else None

  def wrap(s: str) -> str:
    return s if ("$" in s or "\\boxed" in s) else f"${s}$"

  gold = math_verify.parse(wrap(ref), parsing_timeout=timeout)
  target = math_verify.parse(wrap(pred), parsing_timeout=timeout)
  if not gold or not target:
    return False
  return bool(math_verify.verify(gold, target, timeout_seconds=timeout))


def is_equivalent(
  pred: str | None, ref: str | None, *, rel_tol: float = 1e-6, backend: str = "builtin"
) -> bool:
  """Whether the answer `pred` matches `ref` (0.5 == 1/2 == \\frac{1}{2}; "2, 3" == "3,2").

  False without parsing when either side fails `within_limits` (too long or too deeply nested).
  """
  if backend not in _BACKENDS:
    raise ValueError(f"backend {backend!r} is not one of {_BACKENDS}")
  if pred is None or ref is None:
    return False
  pred, ref = str(pred), str(ref)
  if not (within_limits(pred) and within_limits(ref)):
    return False
  if backend == "math_verify":
    return _math_verify_equivalent(pred, ref)
  return _builtin_equivalent(pred, ref, rel_tol)
