"""SmolLM2-135M-Instruct imported from its GGUF file, against transformers' own load of that file.

The oracle is transformers reading the same GGUF (`from_pretrained(dir, gguf_file=...)`, its own
dequantization and tokenizer conversion); the project's side is `tools/hf_convert.py import-gguf`'s
directory read by `models.hf` and `HFTokenizer`. Slow tier: the model is fetched once (93 MB)
into the cache by the `smollm2` fixture, and each side loads 135M parameters.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.data import templates
from jaxrl_llm.data.tokenizers import HFTokenizer
from jaxrl_llm.models import hf
from jaxrl_llm.models.transformer import Transformer, positions_from_mask
from jaxrl_llm.sampling import SamplingConfig, sample

pytestmark = pytest.mark.slow
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

QUESTIONS = (
  "What is 12 + 35? Answer with the number only.",
  "Name three colors.",
  "Translate 'cat' to French.",
  "Write a haiku about rain.",
  "What is the capital of Italy?",
  "Count from 1 to 5.",
  "Why is the sky blue? One sentence.",
  "A shop sells 14 boxes of 23 pens. How many pens is that?",
)
GREEDY_TOKENS = 32
NEAR_TIE = 1e-4  # a greedy row may differ only where transformers' top-2 logits are this close


@functools.cache
def _oracle(gguf_file):
  """transformers' tokenizer and float32 model, loaded from the GGUF file itself."""
  kw = {"gguf_file": gguf_file.name}
  tok = transformers.AutoTokenizer.from_pretrained(gguf_file.parent, **kw)
  model = transformers.AutoModelForCausalLM.from_pretrained(
    gguf_file.parent, dtype=torch.float32, **kw
  )
  return tok, model.eval()


@functools.cache
def _ours(hf_dir):
  cfg, params = hf.load_checkpoint(hf_dir)
  return cfg, params, HFTokenizer.from_dir(hf_dir)


def _batch(tok):
  """The chat-formatted questions, tokenized by transformers, left-padded."""
  texts = [
    tok.apply_chat_template(
      [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
    )
    for q in QUESTIONS
  ]
  ids = [tok(t)["input_ids"] for t in texts]
  width = max(map(len, ids))
  tokens = np.full((len(ids), width), tok.pad_token_id, np.int32)
  mask = np.zeros((len(ids), width), bool)
  for i, row in enumerate(ids):
    tokens[i, width - len(row) :], mask[i, width - len(row) :] = row, True
  return texts, tokens, mask


def _torch_logits(model, tokens, mask):
  am = torch.tensor(mask.astype(np.int64))
  pos = (am.cumsum(-1) - 1).clamp(min=0)
  with torch.no_grad():
    out = model(torch.tensor(tokens, dtype=torch.long), attention_mask=am, position_ids=pos)
  return out.logits.numpy()


def test_the_import_matches_transformers_logits_on_chat_prompts(smollm2):
  hf_dir, gguf_file = smollm2
  tok, model = _oracle(gguf_file)
  cfg, params, _ = _ours(hf_dir)
  assert (cfg.num_layers, cfg.d_model, cfg.vocab_size) == (30, 576, 49152)
  _, tokens, mask = _batch(tok)
  assert len(tokens) >= 8 and (~mask).any()  # left padding is exercised
  ref = _torch_logits(model, tokens, mask)
  apply = jax.jit(
    lambda p, t, m: Transformer(cfg).apply({"params": p}, t, positions_from_mask(m), m)
  )
  ours = np.asarray(apply(params, jnp.asarray(tokens), jnp.asarray(mask)).logits)
  diff = np.abs(np.where(mask[..., None], ours - ref, 0.0)).max()
  print(f"max |logit difference| over {int(mask.sum())} positions: {diff:.2e}")
  assert diff < 2e-4


def test_greedy_generation_equals_transformers_or_differs_only_at_a_near_tie(smollm2):
  hf_dir, gguf_file = smollm2
  tok, model = _oracle(gguf_file)
  cfg, params, _ = _ours(hf_dir)
  _, tokens, mask = _batch(tok)
  width = tokens.shape[1]
  with torch.no_grad():
    ref = model.generate(
      torch.tensor(tokens, dtype=torch.long),
      attention_mask=torch.tensor(mask.astype(np.int64)),
      max_new_tokens=GREEDY_TOKENS,
      min_new_tokens=GREEDY_TOKENS,
      do_sample=False,
      eos_token_id=None,
      pad_token_id=tok.pad_token_id,
    )[:, width:].numpy()
  greedy = SamplingConfig(max_new_tokens=GREEDY_TOKENS, greedy=True, eos_id=-1, kv_block=8)
  run = jax.jit(
    lambda p: sample(
      Transformer(cfg), p, jnp.asarray(tokens), jnp.asarray(mask), jax.random.key(0), greedy
    )
  )
  ours = np.asarray(run(params).tokens)
  assert ours.shape == ref.shape == (len(QUESTIONS), GREEDY_TOKENS)
  for row in np.flatnonzero((ours != ref).any(axis=1)):
    step = int(np.argmax(ours[row] != ref[row]))
    prefix = np.concatenate([tokens[row][mask[row]], ref[row, :step]])[None]
    logits = _torch_logits(model, prefix.astype(np.int32), np.ones_like(prefix, bool))[0, -1]
    top2 = np.sort(logits)[-2:]
    print(f"row {row} differs first at step {step}: top-2 logit gap {top2[1] - top2[0]:.2e}")
    assert top2[1] - top2[0] < NEAR_TIE
  print(f"{int((ours == ref).all(axis=1).sum())} of {len(ours)} rows identical")
  print(repr(tok.decode(ours[0])))


def _strings() -> list[str]:
  """At least 200 strings: unicode, digits, whitespace runs, code, the special tokens."""
  base = [
    "Hello, world!",
    "What is 12 + 35?",
    "1234567890",
    "3.14159 and 2,718,281",
    "x = 10_000 * 42 // 7",
    "   leading spaces",
    "trailing spaces   ",
    "tabs\tand\t\ttabs",
    "new\nlines\n\n\nrun",
    "\r\nwindows\r\n",
    "mixed \t \n whitespace",
    "Ünïcödé façade naïve café",
    "日本語のテキスト",
    "中文字符测试",
    "한국어 문장",
    "Ελληνικά γράμματα",
    "русский текст",
    "עברית",
    "العربية",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧",
    "math ∑∫√∞ ≤ ≥ ≠ −3",
    "def f(x):\n    return x ** 2\n",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "text<|im_end|>more",
    "Answer: 42",
    "\\boxed{17}",
    "",
    " ",
    "a",
    "don't won't it's we're they've I'm you'll he'd",
    "URL https://example.org/path?q=1&r=2",
    "email me at someone@example.com",
    "CamelCaseWordsAndsnake_case_words",
    "$100.00 €50 £20 ¥1000",
  ]
  numbers = [str(n) for n in (0, 7, 10, 99, 100, 365, 1000, 2024, 65535, 1048576)]
  numbers += [f"{a} + {b} = {a + b}" for a, b in ((1, 2), (12, 35), (999, 1), (123, 456))]
  numbers += [f"{a}×{b}" for a, b in ((3, 4), (12, 12), (25, 40))]
  spaces = [" " * k + "x" + " " * k for k in range(1, 9)] + ["\n" * k for k in range(1, 5)]
  words = "the quick brown fox jumps over the lazy dog".split()
  combos = [" ".join(words[i : i + k]) for i in range(len(words)) for k in (1, 3)]
  out = base + numbers + spaces + combos
  out += [s.upper() for s in base[:30]] + [s + " " + t for s, t in zip(base[:40], numbers * 3)]
  out += [f"<|im_start|>{role}\n{s}<|im_end|>" for role, s in zip(["user", "assistant"] * 20, base)]
  pool = [*list("abcXYZ019 \t\n.,;!?'\"-+*/=()[]{}<>|_éüßñ日本语😀€∑"), "<|im_end|>", "  ", "12"]
  rng = np.random.default_rng(0)
  out += ["".join(rng.choice(pool, size=rng.integers(1, 24))) for _ in range(60)]
  return out


def _digits_first(tok):
  """transformers' tokenizer with the pre-tokenizer the GGUF names (`tokenizer.ggml.pre=smollm`:
  llama.cpp splits every digit off before the byte-level regex, as SmolLM2 was trained);
  transformers' GGUF reader drops that split, so the two differ where whitespace meets a digit."""
  from tokenizers import pre_tokenizers

  backend = type(tok.backend_tokenizer).from_str(tok.backend_tokenizer.to_str())
  backend.pre_tokenizer = pre_tokenizers.Sequence(
    [pre_tokenizers.Digits(individual_digits=True), backend.pre_tokenizer]
  )
  return backend


def test_token_ids_equal_transformers_on_over_200_strings(smollm2):
  hf_dir, gguf_file = smollm2
  tok, _ = _oracle(gguf_file)
  _, _, ours = _ours(hf_dir)
  from_dir = transformers.AutoTokenizer.from_pretrained(hf_dir)  # our files, read by transformers
  digits_first = _digits_first(tok)
  strings = _strings()
  same = []
  for s in strings:
    want = tok(s, add_special_tokens=False)["input_ids"]
    got = ours.encode(s)
    assert from_dir(s, add_special_tokens=False)["input_ids"] == got, s
    assert ours.decode(got, skip_special_tokens=False, stop_at_eos=False) == s, s
    if got == want:
      same.append(s)
      continue
    # Only whitespace before a digit tokenizes otherwise, and then as llama.cpp's rule says.
    assert re.search(r"\s\d", s), s
    assert got == digits_first.encode(s, add_special_tokens=False).ids, s
  print(f"{len(same)} of {len(strings)} strings: ids identical to transformers'")
  assert len(same) >= 200


CONVERSATIONS = (
  [{"role": "user", "content": "What is 2 + 2?"}],
  [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
  [
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "content": "7"},
    {"role": "user", "content": "Another?"},
  ],
  [{"role": "user", "content": "Ünïcödé 😀\n\n  spaced  "}],
)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_the_chat_template_renders_as_transformers_renders_it(smollm2, add_generation_prompt):
  hf_dir, gguf_file = smollm2
  tok, _ = _oracle(gguf_file)
  _, _, ours = _ours(hf_dir)
  for messages in CONVERSATIONS:
    want = tok.apply_chat_template(
      messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == want
  # The trainer's prompt path (data.template=chat, with and without data.system_prompt).
  for system in (None, "You are terse."):
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": "What is 2 + 2?"})
    want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    got = templates.render_prompt("What is 2 + 2?", "chat", tokenizer=ours, system=system)
    assert got == want
