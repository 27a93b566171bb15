"""A GGUF file's tokenizer as Hugging Face files: tokenizer.json (byte-level BPE of the GGUF
vocabulary and merges) and tokenizer_config.json (special tokens, chat template), each checked."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxrl_llm.models.gguf_reader import GGUFError, field

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
  pre = field(reader, "tokenizer.ggml.pre", "default")
  if pre not in PRE_TOKENIZERS:
    raise GGUFError(
      f"{path}: tokenizer.ggml.pre={pre!r} is not imported; allowed: "
      f"{', '.join(sorted(PRE_TOKENIZERS))}"
    )
  tokens = field(reader, "tokenizer.ggml.tokens")
  if not tokens:
    raise GGUFError(f"{path}: tokenizer.ggml.tokens is missing (a vocabulary is needed)")
  tokens = list(tokens)
  types = list(field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
  if len(types) != len(tokens):
    raise GGUFError(
      f"{path}: tokenizer.ggml.token_type holds {len(types)} entries but tokenizer.ggml.tokens "
      f"{len(tokens)}: there must be one per token"
    )
  merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges", [])]
  if bad := next((m for m in merges if len(m) != 2), None):
    raise GGUFError(f"{path}: tokenizer.ggml.merges holds {bad[0]!r}, not two tokens 'a b'")
  vocab = {tok: i for i, tok in enumerate(tokens)}
  tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
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


def _token_ids(reader, tokens: list[str], path: str) -> dict[str, int]:
  """{"bos" / "eos" / "pad" / "unk": token id} of the file, each checked to be in the vocabulary."""
  out = {}
  for k, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown")):
    i = field(reader, f"tokenizer.ggml.{key}_token_id")
    if i is None:
      continue
    if not 0 <= int(i) < len(tokens):
      raise GGUFError(
        f"{path}: tokenizer.ggml.{key}_token_id={int(i)} is outside the vocabulary of "
        f"{len(tokens)} tokens (ids 0 to {len(tokens) - 1})"
      )
    out[k] = int(i)
  return out


def tokenizer_config(reader, tokens: list[str], max_len: int, path: str) -> dict[str, Any]:
  """tokenizer_config.json of the file: its special tokens, BOS/EOS flags and chat template."""
  out: dict[str, Any] = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "add_bos_token": bool(field(reader, "tokenizer.ggml.add_bos_token", False)),
    "add_eos_token": bool(field(reader, "tokenizer.ggml.add_eos_token", False)),
    "clean_up_tokenization_spaces": False,
    "model_max_length": max_len,
  }
  for k, i in _token_ids(reader, tokens, path).items():
    out[f"{k}_token"] = tokens[i]
  template = field(reader, "tokenizer.chat_template")
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
