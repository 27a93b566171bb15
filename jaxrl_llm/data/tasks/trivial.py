"""The best trivial answers of a built-in task on its held-out split: what a policy scores
without solving anything, to read beside its accuracy.

Two kinds, each scored by the task's own in-graph verifier (`correct` term) on the evaluation
set: constant answers (each distinct reference answer of the split, answered to every prompt;
the best one is reported), and the task's rules over the prompt (`BuiltinTask.trivial_rules`:
echo an operand, add the first two, chain every digit with fixed operators, ...).
"""

from __future__ import annotations

import collections
from typing import Any

import jax
import numpy as np

from jaxrl_llm.data.tasks.base import BuiltinTask


def _scores(task: BuiltinTask, examples: dict, answers: list[list[str]]) -> np.ndarray:
  """Fraction [R] of the evaluation `examples` each list of answers (R lists of N texts)
  gets right. An answer longer than the task's longest is cut (it is wrong either way)."""
  tok, t = task.tokenizer, task.answer_len
  rows = [a[: t - 1] for answer in answers for a in answer]
  comp, mask = tok.encode_batch(rows, t, bos=False, eos=True, left_pad=False)
  r = len(answers)
  prompts, ref, ref_mask = (
    np.tile(examples[k], (r, 1)) for k in ("tokens", "answer", "answer_mask")
  )
  correct = jax.jit(task.reward_terms)(prompts, comp, mask.astype(np.float32), ref, ref_mask)
  return np.asarray(correct["correct"]).reshape(len(answers), -1).mean(-1)


def trivial_table(task: BuiltinTask, constants: int = 64) -> dict[str, Any]:
  """{rule: held-out accuracy} of the task's trivial rules and of its best constant answer
  (`constant: <text>`, the best of its `constants` most frequent reference answers), with
  `best` and `best_rule`. Exact-match tasks score a constant by its reference share."""
  examples = task.eval_examples()
  prompts, references = task.render(task.eval_indices())
  rules = task.trivial_rules(prompts)
  candidates = [a for a, _ in collections.Counter(references).most_common(constants)]
  const = _scores(task, examples, [[c] * len(prompts) for c in candidates])
  table = {name: float(s) for name, s in zip(rules, _scores(task, examples, list(rules.values())))}
  best_constant = int(np.argmax(const))
  table[f"constant {candidates[best_constant]}"] = float(const[best_constant])
  best_rule = max(table, key=table.get)
  return {"task": task.name, "n": len(prompts), "rules": table, "best": table[best_rule],
          "best_rule": best_rule}  # fmt: skip
