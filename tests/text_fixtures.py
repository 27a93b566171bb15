"""Reusable text fixtures: a real byte-level BPE tokenizer directory and a small math dataset.

Import from tests as ``from text_fixtures import build_bpe_tokenizer, write_math_jsonl``.
"""

from __future__ import annotations

import json
import pathlib
from fractions import Fraction

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# A Qwen-style ChatML template: a default system turn when the conversation has none.
CHATML_TEMPLATE = """{%- if messages[0]['role'] != 'system' %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message['role'] not in ['system', 'user', 'assistant'] %}
{{- raise_exception('Unknown role: ' + message['role']) }}
{%- endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""


def _fraction_text(x: Fraction) -> str:
  return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"


def math_records(n: int = 36) -> list[dict]:
  """``n`` deterministic arithmetic word problems: ``{'id', 'prompt', 'answer', 'level'}``.

  Answers are integers or reduced fractions written as text (``"12"``, ``"7/8"``).
  """
  out = []
  for i in range(n):
    a, b = 2 + (7 * i) % 17, 1 + (5 * i) % 9
    kind = i % 6
    if kind == 0:
      prompt, answer = (
        f"Mia has {a} apples and buys {b} more. How many apples does she have?",
        a + b,
      )
    elif kind == 1:
      prompt, answer = f"A box holds {a} pencils. How many pencils are in {b} boxes?", a * b
    elif kind == 2:
      prompt, answer = f"Leo had {a + b} stickers and gave away {b}. How many are left?", a
    elif kind == 3:
      q = 2 + i % 7
      prompt, answer = f"What is {a}/{q} + {b}/{q}?", Fraction(a + b, q)
    elif kind == 4:
      prompt = (
        f"A ribbon {a * b} cm long is cut into {b} equal pieces. How long is each piece in cm?"
      )
      answer = a
    else:
      c = 2 * a + 1
      prompt, answer = f"What is half of {c}?", Fraction(c, 2)
    answer = _fraction_text(Fraction(answer))
    out.append({"id": i, "prompt": prompt, "answer": answer, "level": 1 + i % 3})
  return out


def write_math_jsonl(path: str | pathlib.Path, n: int = 36) -> list[dict]:
  """Writes ``math_records(n)`` to ``path`` as JSON lines and returns the records."""
  records = math_records(n)
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  with path.open("w", encoding="utf-8") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")
  return records


def math_file_run(folder: str | pathlib.Path) -> tuple[dict, list[dict]]:
  """(config overrides, records) of a tiny RL run on a JSONL math file written in `folder`,
  with a BPE tokenizer built there and the Qwen math chat template: 3 RL steps, one
  evaluation of 4 held-out prompts at the end."""
  folder = pathlib.Path(folder)
  records = write_math_jsonl(folder / "math.jsonl", n=36)
  overrides = {
    "data.train_files": str(folder / "math.jsonl"),
    "data.tokenizer": str(build_bpe_tokenizer(folder / "tok")),
    "data.template": "qwen_math_chat",
    "data.prompt_len": 128,
    "data.eval_fraction": 0.25,
    "sampling.max_new_tokens": 12,
    "model.vocab_size": 512,
    "task.eval_size": 4,
    "train.num_steps": 3,
    "train.eval_every": 3,
    "train.checkpoint_every": 3,
  }
  return overrides, records


def _corpus() -> list[str]:
  text = [r["prompt"] + " " + r["answer"] for r in math_records(120)]
  text += [
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "The reasoning goes between <think> and </think>, the result between <answer> and </answer>.",
    "A dialogue between a User and an Assistant. You are a helpful assistant.",
    "system user assistant 0123456789 + - * / = ( ) . , ? !",
  ]
  return text * 4


def build_bpe_tokenizer(
  directory: str | pathlib.Path,
  *,
  vocab_size: int = 400,
  eos_token: str | None = "<|endoftext|>",
  pad_token: str | None = None,
  generation_eos: tuple[str, ...] | None = None,
  chat_template: str | None = CHATML_TEMPLATE,
) -> pathlib.Path:
  """Trains a small byte-level BPE tokenizer and writes a model-style directory; returns it.

  The directory holds ``tokenizer.json`` (specials ``<|endoftext|>``, ``<|im_start|>``,
  ``<|im_end|>`` with ids 0, 1, 2), ``tokenizer_config.json`` (``eos_token``, ``pad_token``,
  ChatML ``chat_template``) and, when ``generation_eos`` is given, ``generation_config.json``
  with those tokens' ids as ``eos_token_id``. Load it with ``HFTokenizer.from_dir``.
  """
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  d = pathlib.Path(directory)
  d.mkdir(parents=True, exist_ok=True)
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    special_tokens=list(SPECIAL_TOKENS),
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator(_corpus(), trainer)
  tok.save(str(d / "tokenizer.json"))
  config = {
    "eos_token": eos_token,
    "pad_token": pad_token,
    "bos_token": None,
    "add_bos_token": False,
    "chat_template": chat_template,
  }
  (d / "tokenizer_config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
  if generation_eos is not None:
    ids = [tok.token_to_id(t) for t in generation_eos]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}), encoding="utf-8")
  return d


# A ChatML template of any role (the tool's answers come back in a `tool` turn).
CHATML_ANY_ROLE = (
  "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n"
  "{{ message['content'] }}<|im_end|>\n{% endfor %}"
  "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Llama 3's header turns (the tool's answers come back in an `ipython` turn).
LLAMA3_ANY_ROLE = (
  "{%- for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
  "{{ message['content'] }}{% if message.get('eom') %}<|eom_id|>{% else %}<|eot_id|>{% endif %}"
  "{% endfor %}{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
  "{% endif %}"
)
LLAMA3_TOKENS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>")


def chat_tokenizer(tmp_path_factory, name, template, extra=()):
  """A trained BPE tokenizer with the chat tokens `extra` added as special tokens."""
  d = build_bpe_tokenizer(tmp_path_factory.mktemp(name), chat_template=template)
  if extra:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.add_special_tokens(list(extra))
    tok.save(str(d / "tokenizer.json"))
  from jaxrl_llm.data.tokenizers import HFTokenizer

  return HFTokenizer.from_dir(d)
