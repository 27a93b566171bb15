"""Arithmetic word problems in natural language, with a held-out split keyed by operands.

Two- and three-number problems over + − × in plain and story phrasings ("Tom has 12 marbles and
buys 35 more. ...", "What is 7 times 8 plus 15?"), drawn deterministically from a seed. A record
is `{"prompt", "answer", "operands", "ops", "expr", "level"}`: the question and `INSTRUCTION`
(the final answer on its own last line as `Answer: N`, read by the `answer_line_correct` /
`answer_line_format` verifiers); the integer answer as text; the numbers in the order the
question states them; the operators of `expr`, the answer's expression over the letters a, b, c
(those numbers in that order; × binds tighter); and the difficulty level (`LEVELS`).

Numbers are 2..999; a product has a factor of at most 12 or both at most 30; every step of a
computation is positive (no story spends more than it has) and an answer is none of its
operands. A record is held out iff a SHA-256 hash of its sorted operands falls below
`eval_fraction`, so no operand multiset is in both splits. No trivial answer
(`trivial_baselines`) is right on more than 1% of a split: two-number sums, products and
in-order differences (which "first+second" and the like solve) are drawn rarely (differences
stated in reverse, "has 45, needs 120", are not), and a draw that would take an answer or a
trivial rule over 1% of its split is dropped.
"""

from __future__ import annotations

import ast
import collections
import hashlib
import json
import operator
import os
import random
import re
from typing import Any, NamedTuple

# The final line asked for. With configs/smollm2_arith.py's system message, SmolLM2-135M-Instruct
# writes it in about 5% of its samples at temperature 0.7 before any training.
INSTRUCTION = 'End with a last line of the form "Answer: <number>".'
# level -> (weight, smallest answer, range of a general number "n", of a small factor "s", of a
# medium factor "m"). The smallest answers keep small results (a difference of two close
# numbers) from piling up on a few values that a constant answer would get right.
LEVELS = {
  "easy": (0.4, 10, (2, 30), (2, 9), (2, 12)),
  "medium": (0.4, 20, (10, 99), (2, 12), (2, 30)),
  "hard": (0.2, 100, (100, 999), (2, 12), (10, 30)),
}
NAMES = [
  ("Tom", "he"), ("Anna", "she"), ("Ravi", "he"), ("Mei", "she"), ("Lucas", "he"),
  ("Sofia", "she"), ("Omar", "he"), ("Priya", "she"), ("Ben", "he"), ("Lena", "she"),
]  # fmt: skip
ITEMS = ["marbles", "stickers", "pencils", "cards", "beads", "coins", "buttons", "shells", "stamps"]


# Two-number sums, products and in-order differences are rare (see the module doc).
MIX_WEIGHTS = {
  ("+",): 0.8, ("-",): 4.7, ("*",): 0.8, ("+", "+"): 10, ("+", "-"): 10, ("-", "+"): 10,
  ("-", "-"): 10, ("*", "+"): 11, ("*", "-"): 11, ("+", "*"): 11, ("-", "*"): 11, ("*", "*"): 7,
}  # fmt: skip
# The most records of a split that may share one answer, or one trivial rule's answer (so the
# most a constant or a rule of `TRIVIAL_RULES` scores on a split).
MAX_ANSWER_SHARE = 0.01
TRIVIAL_RULES = {  # operands in text order -> a trivial answer (None: no answer)
  "first": lambda x: x[0],
  "second": lambda x: x[1] if len(x) > 1 else None,
  "last": lambda x: x[-1],
  "largest": max,
  "first+second": lambda x: x[0] + x[1] if len(x) > 1 else None,
  "first*second": lambda x: x[0] * x[1] if len(x) > 1 else None,
  "first-second": lambda x: x[0] - x[1] if len(x) > 1 else None,
}
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate(expr: str, operands: list[int], steps: list[int] | None = None) -> int:
  """The value of `expr` (over letters a, b, c; + - * and parentheses) at `operands`; `steps`,
  when given, receives the value of every operation on the way."""
  env = dict(zip("abc", operands))

  def ev(node):
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
      value = _BINOPS[type(node.op)](ev(node.left), ev(node.right))
      if steps is not None:
        steps.append(value)
      return value
    if isinstance(node, ast.Name) and node.id in env:
      return env[node.id]
    raise ValueError(f"unsupported expression {expr!r}")

  return ev(ast.parse(expr, mode="eval").body)


def expr_ops(expr: str) -> list[str]:
  """The operators of `expr` in order ('a + b * c' → ['+', '*'])."""
  return re.findall(r"[-+*]", expr)


class Template(NamedTuple):
  """A question with slots {a} {b} {c} (numbers, in text order), {name} {name2} {pro} {Pro}
  {item}; `expr` computes the answer from a, b, c; `kinds` is each number's kind (n, s, m)."""

  text: str
  expr: str
  kinds: str
  share: float = 1.0  # its weight within its operator mix


# One template a line, `expr | kinds [weight] | text` (indented lines continue the text).
_TEMPLATE_TABLE = """
a + b | nn | {name} has {a} {item} and buys {b} more. How many {item} does {pro} have now?
a + b | nn | What is {a} plus {b}?
a + b | nn | There are {a} {item} in one basket and {b} in another. How many {item} are there in
    total?
a + b | nn | Add {a} and {b}. What do you get?
a + b | nn | {name} scored {a} points in the first game and {b} points in the second. How many
    points did {pro} score altogether?
a + b | nn | What is the sum of {a} and {b}?

a - b | nn | {name} has {a} {item} and gives away {b}. How many {item} are left?
a - b | nn | What is {a} minus {b}?
a - b | nn | A train has {a} seats and {b} passengers are seated. How many seats are empty?
b - a | nn 3.5 | Subtract {a} from {b}. What is the result?
b - a | nn 3.5 | {name} has {a} {item} but needs {b}. How many more {item} does {pro} need?
b - a | nn 3.5 | {name} has read {a} pages of a book with {b} pages. How many pages are left to
    read?
b - a | nn 3.5 | What number must be added to {a} to make {b}?
b - a | nn 3.5 | {name} is {a} centimeters tall and {name2} is {b} centimeters tall. How much
    taller is {name2}?

a * b | ns | What is {a} times {b}?
a * b | mm | A crate holds {a} boxes with {b} pens in each box. How many pens are in the crate?
a * b | sn | {name} buys {a} packs of {item}. Each pack has {b} {item}. How many {item} does {pro}
    buy?
a * b | ns | Multiply {a} by {b}. What is the result?
a * b | mm | A theater has {a} rows with {b} seats in each row. How many seats are there?
a * b | ns | Each ticket costs {a} dollars. How much do {b} tickets cost in dollars?

a + b + c | nnn | {name} has {a} {item}. {Pro} buys {b} more on Monday and {c} more on Tuesday.
    How many {item} does {pro} have now?
a + b + c | nnn | What is {a} plus {b} plus {c}?
a + b + c | nnn | Add {a}, {b} and {c}. What is the total?
a + b + c | nnn | Three shelves hold {a}, {b} and {c} books. How many books are on the shelves in
    total?
a + b + c | nnn | {name} walked {a} meters, then {b} meters, then {c} meters. How far did {pro}
    walk in meters?
a + b + c | nnn | What is the sum of {a}, {b} and {c}?

a + b - c | nnn | {name} has {a} {item}, buys {b} more and then gives {c} to {name2}. How many
    {item} does {name} have now?
a + b - c | nnn | What is {a} plus {b} minus {c}?
a + b - c | nnn | A bus has {a} passengers. At the first stop {b} people get on and {c} get off.
    How many passengers are on the bus now?
a + b - c | nnn | Start with {a}, add {b}, then subtract {c}. What is the result?
a + b - c | nnn | A shop had {a} {item}. It received {b} more and sold {c}. How many {item} does
    the shop have now?
a + b - c | nnn | {name} saved {a} dollars, earned {b} dollars more and spent {c} dollars. How
    many dollars does {pro} have left?

a - b + c | nnn | What is {a} minus {b} plus {c}?
a - b + c | nnn | {name} had {a} {item}, lost {b} of them and then found {c}. How many {item} does
    {pro} have now?
a - b + c | nnn | A parking lot has {a} cars. Then {b} cars leave and {c} cars arrive. How many
    cars are in the lot now?
a - b + c | nnn | Start with {a}, subtract {b}, then add {c}. What is the result?
a - b + c | nnn | A tank holds {a} liters of water. {b} liters leak out and {c} liters are added.
    How many liters are in the tank now?
a - b + c | nnn | {name} had {a} dollars, spent {b} dollars on lunch and then earned {c} dollars.
    How many dollars does {pro} have now?

a - b - c | nnn | What is {a} minus {b} minus {c}?
a - b - c | nnn | {name} has {a} {item}. {Pro} gives {b} to {name2} and {c} to a friend. How many
    {item} does {name} have left?
a - b - c | nnn | A farmer picked {a} apples. {b} were sold at the market and {c} were eaten. How
    many apples remain?
c - a - b | nnn | Take {a} and then {b} away from {c}. What is left?
a - b - c | nnn | A book has {a} pages. {name} read {b} pages yesterday and {c} pages today. How
    many pages are left to read?
a - b - c | nnn | A rope is {a} centimeters long. {name} cuts off {b} centimeters and then {c}
    more. How long is the rope now, in centimeters?

a * b + c | nsn | What is {a} times {b} plus {c}?
a * b + c | snn | {name} buys {a} bags with {b} {item} in each bag and already had {c} {item}. How
    many {item} does {pro} have now?
a * b + c | mmn | A crate holds {a} boxes of {b} pens each, plus {c} loose pens. How many pens are
    there in all?
a * b + c | mmn | A garden has {a} rows of {b} tulips and {c} roses. How many flowers are in the
    garden?
a * b + c | nsn | Multiply {a} by {b}, then add {c}. What is the result?
a * b + c | mmn | Each of {a} students brings {b} {item}, and the teacher brings {c}. How many
    {item} are there altogether?

a * b - c | nsn | What is {a} times {b} minus {c}?
a * b - c | mmn | {name} bought {a} boxes of {b} cookies each and ate {c} cookies. How many
    cookies are left?
a * b - c | mmn | A hall has {a} rows of {b} chairs, and {c} chairs are taken. How many chairs are
    free?
a * b - c | nsn | Multiply {a} by {b}, then subtract {c}. What is the result?
a * b - c | mmn | A baker made {a} trays of {b} muffins and sold {c} muffins. How many muffins are
    left?
a * b - c | smn | Each of {a} buses can carry {b} people. If {c} people are already seated, how
    many seats are still free?

a + b * c | nns | What is {a} plus the product of {b} and {c}?
a + b * c | nsn | {name} has {a} {item} and buys {b} packs of {c} {item} each. How many {item}
    does {pro} have now?
a + b * c | nmm | A library has {a} books and receives {b} boxes with {c} books in each. How many
    books does it have now?
a + b * c | nns | Add {a} to the product of {b} and {c}. What is the result?
a + b * c | nmm | A school has {a} teachers and {b} classes of {c} students. How many people are
    in the school?
a + b * c | nsn | {name} ran {a} meters, then ran {b} laps of {c} meters each. How many meters did
    {pro} run in total?

a - b * c | nns | What is {a} minus the product of {b} and {c}?
a - b * c | nss | {name} has {a} dollars and buys {b} books that cost {c} dollars each. How many
    dollars does {pro} have left?
a - b * c | nmm | A warehouse has {a} {item}. It ships {b} boxes of {c} {item} each. How many
    {item} remain?
c - a * b | snn | Subtract the product of {a} and {b} from {c}. What is the result?
a - b * c | nss | A tank holds {a} liters. Then {b} buckets of {c} liters each are taken out. How
    many liters remain?
a - b * c | nms | A farm has {a} eggs and fills {b} cartons with {c} eggs each. How many eggs are
    not in cartons?

a * b * c | sss | What is {a} times {b} times {c}?
a * b * c | sss | A truck carries {a} crates. Each crate holds {b} boxes and each box holds {c}
    pens. How many pens are on the truck?
a * b * c | sss | Multiply {a}, {b} and {c}. What is the product?
a * b * c | sss | A building has {a} floors with {b} rooms on each floor and {c} windows in each
    room. How many windows are there?
a * b * c | sss | {name} has {a} shelves with {b} jars on each shelf and {c} {item} in each jar.
    How many {item} are there?
a * b * c | sss | What is the product of {a}, {b} and {c}?
"""


def _parse_templates(table: str) -> dict[tuple[str, ...], list[Template]]:
  """`_TEMPLATE_TABLE` as {operators of the expression: [Template, ...]}."""
  rows: list[str] = []
  for line in table.splitlines():
    if line.startswith(" "):
      rows[-1] += " " + line.strip()
    elif line.strip():
      rows.append(line)
  out: dict[tuple[str, ...], list[Template]] = {}
  for row in rows:
    expr, kinds, text = (part.strip() for part in row.split("|"))
    kinds, *weight = kinds.split()
    out.setdefault(tuple(expr_ops(expr)), []).append(
      Template(text, expr, kinds, *map(float, weight))
    )
  return out


TEMPLATES = _parse_templates(_TEMPLATE_TABLE)


def split_of(operands: list[int], eval_fraction: float = 0.1) -> str:
  """'eval' when a SHA-256 hash of the sorted operand tuple falls below `eval_fraction`."""
  key = ",".join(str(x) for x in sorted(operands)).encode()
  h = int.from_bytes(hashlib.sha256(key).digest()[:8], "big") / 2.0**64
  return "eval" if h < eval_fraction else "train"


def _operands(rng: random.Random, template: Template, level: str) -> list[int] | None:
  """Numbers for `template` at `level` with a valid answer (at least the level's smallest, no
  operand, nothing "first+second" and the like give for three numbers; every step on the way
  positive: no story spends more than it has), or None after 1,000 tries."""
  _, smallest, *ranges = LEVELS[level]
  ranges = dict(zip("nsm", ranges))
  for _ in range(1000):
    xs, steps = [rng.randint(*ranges[k]) for k in template.kinds], []
    ans = evaluate(template.expr, xs, steps)
    bad = {*xs} if len(xs) == 2 else {*xs, xs[0] + xs[1], xs[0] * xs[1], xs[0] - xs[1]}
    if ans >= smallest and ans not in bad and min(steps) > 0:
      return xs
  return None


def make_record(rng: random.Random, template: Template, level: str) -> dict[str, Any]:
  """One record of `template` at `level` (names, item and numbers drawn from `rng`)."""
  xs = _operands(rng, template, level)
  if xs is None:
    raise ValueError(f"no valid numbers for {template.text!r} at level {level!r}")
  (name, pro), (name2, _) = rng.sample(NAMES, 2)
  question = template.text.format(
    **dict(zip("abc", xs)), name=name, name2=name2, pro=pro, Pro=pro.capitalize(),
    item=rng.choice(ITEMS),
  )  # fmt: skip
  return {
    "prompt": f"{question}\n{INSTRUCTION}",
    "answer": str(evaluate(template.expr, xs)),
    "operands": xs,
    "ops": expr_ops(template.expr),
    "expr": template.expr,
    "level": level,
  }


def sample_record(rng: random.Random) -> dict[str, Any]:
  """A record of a random operator mix, template and level (weighted as configured)."""
  mixes = list(MIX_WEIGHTS)
  mix = rng.choices(mixes, weights=[MIX_WEIGHTS[m] for m in mixes])[0]
  templates = TEMPLATES[mix]
  template = rng.choices(templates, weights=[t.share for t in templates])[0]
  level = rng.choices(list(LEVELS), weights=[v[0] for v in LEVELS.values()])[0]
  return make_record(rng, template, level)


def generate(
  n_train: int, n_eval: int, seed: int = 0, eval_fraction: float = 0.1
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
  """(train, eval) records from `seed`: split by operands (`split_of`), each split free of
  repeated prompts (eval also of repeated (operands, ops)), no answer and no trivial rule's
  answer right in more than `MAX_ANSWER_SHARE` of a split's records (at least one)."""
  if n_train < 0 or n_eval < 0 or not 0 < eval_fraction < 1:
    msg = f"n_train={n_train}, n_eval={n_eval}, eval_fraction={eval_fraction}"
    raise ValueError(f"{msg}: need counts >= 0 and 0 < eval_fraction < 1")
  rng = random.Random(seed)
  out = {"train": [], "eval": []}
  want = {"train": n_train, "eval": n_eval}
  seen = {"train": set(), "eval": set()}
  per_answer = {k: collections.Counter() for k in out}  # answers, and trivial rules that hold
  cap = {k: max(1, int(MAX_ANSWER_SHARE * n)) for k, n in want.items()}
  for _ in range(50 * (n_train + n_eval) + 10_000):
    if all(len(out[k]) >= want[k] for k in out):
      return out["train"], out["eval"]
    r = sample_record(rng)
    split = split_of(r["operands"], eval_fraction)
    keys = [r["prompt"]] + ([(*r["operands"], *r["ops"])] if split == "eval" else [])
    ans = int(r["answer"])
    shared = [ans, *(k for k, rule in TRIVIAL_RULES.items() if rule(r["operands"]) == ans)]
    full = len(out[split]) >= want[split] or any(per_answer[split][k] >= cap[split] for k in shared)
    if full or any(k in seen[split] for k in keys):
      continue
    seen[split].update(keys)
    per_answer[split].update(shared)
    out[split].append(r)
  raise ValueError(f"could not draw {n_train} train and {n_eval} eval distinct problems")


def trivial_baselines(records: list[dict[str, Any]]) -> dict[str, Any]:
  """Accuracy on `records` of trivial answers: the best constant, an operand (first, second,
  last, largest), the first two operands added, multiplied or subtracted (`TRIVIAL_RULES`);
  and the best of all (`best`, named by `best_rule`)."""
  answers = [int(r["answer"]) for r in records]
  n = max(len(records), 1)
  table = {"constant": max(collections.Counter(answers).values(), default=0) / n}
  for name, rule in TRIVIAL_RULES.items():
    table[name] = sum(rule(r["operands"]) == a for r, a in zip(records, answers)) / n
  best_rule = max(table, key=table.get)
  return {**table, "best": table[best_rule], "best_rule": best_rule}


def write_splits(out_dir: str, n_train: int = 20000, n_eval: int = 500, seed: int = 0) -> dict:
  """Writes `train.jsonl`, `eval.jsonl` and `trivial.json` (the eval split's trivial
  baselines) in `out_dir`, each through a temporary file and trivial.json last (so all three
  there means a finished write); returns their paths, the counts and the baselines."""
  train, evaluation = generate(n_train, n_eval, seed)
  os.makedirs(out_dir, exist_ok=True)
  names = {"train": "train.jsonl", "eval": "eval.jsonl", "trivial": "trivial.json"}
  paths = {k: os.path.join(out_dir, name) for k, name in names.items()}
  trivial = trivial_baselines(evaluation)
  texts = {
    "train": "".join(json.dumps(r) + "\n" for r in train),
    "eval": "".join(json.dumps(r) + "\n" for r in evaluation),
    "trivial": json.dumps(trivial, indent=2),  # last: its presence marks the splits complete
  }
  for key, text in texts.items():  # each whole or not at all: an interrupted write leaves none
    with open(paths[key] + ".partial", "w") as f:
      f.write(text)
    os.replace(paths[key] + ".partial", paths[key])
  return {**paths, "n_train": len(train), "n_eval": len(evaluation), "baselines": trivial}
