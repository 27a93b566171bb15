"""A GGUF file's tokenizer as Hugging Face files: tokenizer.json (byte-level BPE of the GGUF
vocabulary and merges) and tokenizer_config.json (special tokens, chat template), each checked."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxrl_llm.models.gguf_reader import GGUFError, array, field, flag, text, whole

# tokenizer.ggml.pre values -> whether digits are split one by one before the byte-level regex
# (llama.cpp's "smollm", "starcoder" and "refact" pre-tokenizers do; "gpt-2" and "default" don't).
PRE_TOKENIZERS = {
  "default": False,
  "gpt-2": False,
  "smollm": True,
  "starcoder": True,
  "refact": True,
}
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values of added tokens


def tokenizer(reader, path: str):
  """The `tokenizers.Tokenizer` of the GGUF vocabulary (byte-level BPE only)."""
  from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

  kind = field(reader, "tokenizer.ggml.model")
  if kind != "gpt2":
    raise GGUFError(
      f"{path}: tokenizer.ggml.model={kind!r} is not imported; allowed: gpt2 (byte-level BPE)"
    )
  pre = text(reader, "tokenizer.ggml.pre", "default")
  if pre not in PRE_TOKENIZERS:
    raise GGUFError(
      f"{path}: tokenizer.ggml.pre={pre!r} is not imported; allowed: "
      f"{', '.join(sorted(PRE_TOKENIZERS))}"
    )
  tokens = array(reader, "tokenizer.ggml.tokens", str)
  if not tokens:
    raise GGUFError(f"{path}: tokenizer.ggml.tokens is missing (a vocabulary is needed)")
  types = array(reader, "tokenizer.ggml.token_type", int, [1] * len(tokens))
  if len(types) != len(tokens):
    raise GGUFError(
      f"{path}: tokenizer.ggml.token_type holds {len(types)} entries but tokenizer.ggml.tokens "
      f"{len(tokens)}: there must be one per token"
    )
  vocab = {tok: i for i, tok in enumerate(tokens)}
  merges = _merges(reader, vocab, path)
  try:
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
  except Exception as e:  # the Rust library raises a plain Exception
    msg = " ".join(str(e).split())
    raise GGUFError(
      f"{path}: tokenizer.ggml.tokens and tokenizer.ggml.merges do not make a BPE model ({msg})"
    ) from None
  tok = Tokenizer(bpe)
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
  tok.pre_tokenizer = (
    pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if PRE_TOKENIZERS[pre]
    else byte_level
  )
  tok.decoder = decoders.ByteLevel()
  added = [
    AddedToken(tokens[i], special=types[i] == _CONTROL, normalized=False)
    for i in range(len(tokens))
    if types[i] in (_CONTROL, _USER_DEFINED)
  ]
  tok.add_special_tokens([a for a in added if a.special])
  tok.add_tokens([a for a in added if not a.special])
  return tok, tokens


def _merges(reader, vocab: Mapping[str, int], path: str) -> list[tuple[str, str]]:
  """tokenizer.ggml.merges as pairs (a, b), each checked: two tokens 'a b', with a, b and ab
  each in the vocabulary (as BPE needs them)."""
  merges = []
  for i, merge in enumerate(array(reader, "tokenizer.ggml.merges", str, [])):
    pair = tuple(merge.split(" ", 1))
    if len(pair) != 2:
      raise GGUFError(f"{path}: tokenizer.ggml.merges holds {merge!r}, not two tokens 'a b'")
    if unknown := next((t for t in (*pair, "".join(pair)) if t not in vocab), None):
      raise GGUFError(
        f"{path}: tokenizer.ggml.merges[{i}]={merge!r} needs the token {unknown!r}, which is not "
        "in tokenizer.ggml.tokens (a merge 'a b' needs a, b and ab in the vocabulary)"
      )
    merges.append(pair)
  return merges


def _token_ids(reader, tokens: list[str], path: str) -> dict[str, int]:
  """{"bos" / "eos" / "pad" / "unk": token id} of the file, each checked to be in the vocabulary;
  the eos id is required."""
  out = {}
  for k, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown")):
    i = whole(reader, f"tokenizer.ggml.{key}_token_id")
    if i is None:
      continue
    if i >= len(tokens):
      raise GGUFError(
        f"{path}: tokenizer.ggml.{key}_token_id={i} is outside the vocabulary of "
        f"{len(tokens)} tokens (ids 0 to {len(tokens) - 1})"
      )
    out[k] = i
  if "eos" not in out:  # completions end with it: the loader refuses a tokenizer without one
    raise GGUFError(
      f"{path}: tokenizer.ggml.eos_token_id is missing: an import needs the end-of-sequence token"
    )
  return out


def tokenizer_config(reader, tokens: list[str], max_len: int, path: str) -> dict[str, Any]:
  """tokenizer_config.json of the file: its special tokens, BOS/EOS flags and chat template."""
  out: dict[str, Any] = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "add_bos_token": flag(reader, "tokenizer.ggml.add_bos_token"),
    "add_eos_token": flag(reader, "tokenizer.ggml.add_eos_token"),
    "clean_up_tokenization_spaces": False,
    "model_max_length": max_len,
  }
  ids = _token_ids(reader, tokens, path)
  if out["add_bos_token"] and "bos" not in ids:
    raise GGUFError(
      f"{path}: tokenizer.ggml.add_bos_token is true but tokenizer.ggml.bos_token_id is missing"
    )
  for k, i in ids.items():
    out[f"{k}_token"] = tokens[i]
  template = text(reader, "tokenizer.chat_template")
  if template:
    out["chat_template"] = template
  return out


def check_template(config: Mapping[str, Any], path: str) -> None:
  """Renders the chat template over a system, user and assistant turn (as training will);
  GGUFError when it cannot."""
  from jaxrl_llm.data import templates

  template = config.get("chat_template")
  if not template:
    return
  turns = [
    {"role": "system", "content": "s"},
    {"role": "user", "content": "u"},
    {"role": "assistant", "content": "a"},
  ]
  try:
    for messages in (turns[1:2], turns):
      templates.apply_chat_template(
        messages,
        template,
        bos_token=config.get("bos_token", ""),
        eos_token=config.get("eos_token", ""),
      )
  except Exception as e:  # a template may raise anything while it renders
    msg = " ".join(str(e).split())  # one line, whatever the template raised
    raise GGUFError(f"{path}: tokenizer.chat_template cannot be rendered: {msg}") from None


def check_vocabulary(reader, config: Mapping[str, Any], tok, tokens: list[str], path: str) -> None:
  """GGUFError unless the metadata's vocabulary size is the token list's, each token once."""
  arch = field(reader, "general.architecture")
  if len(tokens) != config["vocab_size"]:
    raise GGUFError(
      f"{path}: {arch}.vocab_size={config['vocab_size']} but tokenizer.ggml.tokens holds "
      f"{len(tokens)} tokens"
    )
  if tok.get_vocab_size() != len(tokens):  # a token listed twice
    raise GGUFError(
      f"{path}: tokenizer.ggml.tokens holds {len(tokens)} tokens but only "
      f"{tok.get_vocab_size()} distinct ones"
    )
