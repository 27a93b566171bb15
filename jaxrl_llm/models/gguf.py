"""GGUF files (llama.cpp's format) into a Hugging Face directory that `models.hf` loads.

`import_gguf(FILE.gguf, OUT_DIR)` reads the file with the `gguf` package and writes:

  * ``config.json`` from the GGUF metadata (a Llama architecture);
  * ``model.safetensors``: every tensor dequantized by `gguf.quants` (float32 or bfloat16), the
    query and key projections' rows put back in Hugging Face's order (llama.cpp's converter
    interleaves the two halves of each head's rotary dimensions);
  * ``tokenizer.json``: the byte-level BPE of the GGUF vocabulary and merges, its control tokens
    as special tokens, and the pre-tokenizer that ``tokenizer.ggml.pre`` names;
  * ``tokenizer_config.json`` (special tokens, the chat template) and ``generation_config.json``.

Anything else (a tensor type outside `TENSOR_TYPES`, an architecture other than Llama, a
truncated file, a tokenizer model other than byte-level BPE, an unknown tensor) is refused with
one `GGUFError` naming what was found and what is allowed, before anything is written.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

# Tensor types imported (each dequantized by gguf.quants, tested against its own quantizer).
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
ARCHITECTURES = ("llama",)
DTYPES = ("float32", "bfloat16")
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


class GGUFError(ValueError):
  """A GGUF file this importer cannot turn into a Hugging Face directory (one line)."""


def _reader(path: str):
  """gguf's reader of `path`, or a GGUFError when it is missing, truncated or not GGUF."""
  import gguf

  if not os.path.isfile(path):
    raise GGUFError(f"{path}: no such file")
  size = os.path.getsize(path)

  class Truncated(Exception):
    pass

  class Reader(gguf.GGUFReader):
    # gguf's reader slices its memory map, so a cut file fails later (a reshape, an index) with
    # an error that does not say why: every read past the end is caught here instead.
    def _get(self, offset, dtype, count=1, override_order=None):
      end = int(offset) + np.dtype(dtype).itemsize * int(count)
      if end > size:
        raise Truncated(end)
      return super()._get(offset, dtype, count, override_order)

  try:
    reader = Reader(path, "r")
  except Truncated as e:
    raise GGUFError(
      f"{path}: truncated: it needs {e.args[0]:,} bytes but the file holds {size:,} bytes"
    ) from None
  except Exception as e:  # the reader raises ValueError, IndexError, ... on bad bytes
    msg = " ".join(str(e).split())
    raise GGUFError(f"{path}: not a complete GGUF file ({type(e).__name__}: {msg})") from None
  return reader


def _field(reader, key: str, default: Any = None) -> Any:
  f = reader.fields.get(key)
  return default if f is None else f.contents()


def _metadata(reader, path: str) -> dict[str, Any]:
  """The architecture's hyperparameters, checked; GGUFError for what cannot be imported."""
  arch = _field(reader, "general.architecture")
  if arch not in ARCHITECTURES:
    raise GGUFError(
      f"{path}: general.architecture={arch!r} is not imported; allowed: {', '.join(ARCHITECTURES)}"
    )

  def need(key: str) -> Any:
    value = _field(reader, f"{arch}.{key}")
    if value is None:
      raise GGUFError(f"{path}: metadata {arch}.{key} is missing")
    return value

  scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
  if scaling not in ("none", None) or any(t.name == "rope_freqs.weight" for t in reader.tensors):
    raise GGUFError(f"{path}: RoPE scaling ({scaling!r} / rope_freqs.weight) is not imported")
  heads = int(need("attention.head_count"))
  d = int(need("embedding_length"))
  head_dim = int(_field(reader, f"{arch}.attention.key_length", d // heads))
  if _field(reader, f"{arch}.rope.dimension_count", head_dim) != head_dim:
    raise GGUFError(f"{path}: partial rotary dimensions are not imported")
  tokens = _field(reader, "tokenizer.ggml.tokens") or []
  return {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": d,
    "intermediate_size": int(need("feed_forward_length")),
    "num_hidden_layers": int(need("block_count")),
    "num_attention_heads": heads,
    "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
    "head_dim": head_dim,
    "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
    "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
    "max_position_embeddings": int(need("context_length")),
    "vocab_size": int(_field(reader, f"{arch}.vocab_size", len(tokens))),
    "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    **{
      f"{k}_token_id": int(v)
      for k, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"))
      if (v := _field(reader, f"tokenizer.ggml.{key}_token_id")) is not None
    },
  }


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
  """Undoes llama.cpp's row order of a query or key projection [heads * head_dim, D]: per head,
  rows (0, half, 1, half + 1, ...) back to (0, 1, ..., half - 1, half, ...)."""
  rows = w.shape[0]
  return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LAYER = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")
_LAYER_NAMES = {
  "attn_norm": "input_layernorm",
  "ffn_norm": "post_attention_layernorm",
  "attn_q": "self_attn.q_proj",
  "attn_k": "self_attn.k_proj",
  "attn_v": "self_attn.v_proj",
  "attn_output": "self_attn.o_proj",
  "ffn_gate": "mlp.gate_proj",
  "ffn_up": "mlp.up_proj",
  "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
  "token_embd.weight": "model.embed_tokens.weight",
  "output_norm.weight": "model.norm.weight",
  "output.weight": "lm_head.weight",
}


def _hf_name(name: str, path: str) -> tuple[str, str | None]:
  """(Hugging Face tensor name, 'q' / 'k' for a permuted projection or None)."""
  if name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[name], None
  m = _LAYER.match(name)
  if not m or m[2] not in _LAYER_NAMES:
    raise GGUFError(f"{path}: tensor {name!r} is not part of a Llama model")
  kind = {"attn_q": "q", "attn_k": "k"}.get(m[2])
  return f"model.layers.{m[1]}.{_LAYER_NAMES[m[2]]}.weight", kind


def _tensors(reader, config: Mapping[str, Any], path: str) -> list[tuple[str, Callable]]:
  """[(HF name, a function returning its float32 array)], checked before anything is read."""
  from gguf import quants

  out = []
  for t in reader.tensors:
    kind = t.tensor_type.name
    if kind not in TENSOR_TYPES:
      raise GGUFError(
        f"{path}: tensor {t.name!r} is of type {kind}, which is not imported; allowed: "
        f"{', '.join(TENSOR_TYPES)}"
      )
    name, permuted = _hf_name(t.name, path)
    heads = config["num_attention_heads" if permuted == "q" else "num_key_value_heads"]

    def load(t=t, permuted=permuted, heads=heads) -> np.ndarray:
      w = np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32)
      w = w.reshape([int(n) for n in reversed(t.shape)])  # GGUF lists dims innermost first
      return _unpermute(w, heads) if permuted else w

    out.append((name, load))
  names = {n for n, _ in out}
  want = {
    f"model.layers.{i}.{v}.weight"
    for i in range(config["num_hidden_layers"])
    for v in _LAYER_NAMES.values()
  } | {"model.embed_tokens.weight", "model.norm.weight"}
  if missing := sorted(want - names):
    raise GGUFError(f"{path}: tensor {missing[0]} ({len(missing)} in all) is missing")
  return out


def _tokenizer(reader, path: str):
  """The `tokenizers.Tokenizer` of the GGUF vocabulary (byte-level BPE only)."""
  from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

  kind = _field(reader, "tokenizer.ggml.model")
  if kind != "gpt2":
    raise GGUFError(
      f"{path}: tokenizer.ggml.model={kind!r} is not imported; allowed: gpt2 (byte-level BPE)"
    )
  pre = _field(reader, "tokenizer.ggml.pre", "default")
  if pre not in PRE_TOKENIZERS:
    raise GGUFError(
      f"{path}: tokenizer.ggml.pre={pre!r} is not imported; allowed: "
      f"{', '.join(sorted(PRE_TOKENIZERS))}"
    )
  tokens = list(_field(reader, "tokenizer.ggml.tokens"))
  types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
  merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
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


def _tokenizer_config(reader, tokens: list[str], max_len: int) -> dict[str, Any]:
  out: dict[str, Any] = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
    "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
    "clean_up_tokenization_spaces": False,
    "model_max_length": max_len,
  }
  for k, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown")):
    i = _field(reader, f"tokenizer.ggml.{key}_token_id")
    if i is not None:
      out[f"{k}_token"] = tokens[int(i)]
  template = _field(reader, "tokenizer.chat_template")
  if template:
    out["chat_template"] = template
  return out


def _check_template(config: Mapping[str, Any], path: str) -> None:
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


def import_gguf(path: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str = "float32"):
  """Writes the Hugging Face directory of the GGUF file `path` at `out_dir` (see the module
  docstring); returns a summary dict. GGUFError, with nothing written, for what it cannot."""
  from safetensors.numpy import save_file

  path, out_dir = os.fspath(path), os.fspath(out_dir)
  if dtype not in DTYPES:
    raise GGUFError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
  if os.path.exists(os.path.join(out_dir, "model.safetensors")):
    raise GGUFError(f"{out_dir}: already holds model.safetensors; choose a new directory")
  reader = _reader(path)
  config = _metadata(reader, path)
  tensors = _tensors(reader, config, path)
  tok, tokens = _tokenizer(reader, path)
  tok_config = _tokenizer_config(reader, tokens, config["max_position_embeddings"])
  _check_template(tok_config, path)
  if tok.get_vocab_size() != config["vocab_size"]:
    raise GGUFError(
      f"{path}: the vocabulary holds {tok.get_vocab_size()} tokens but the model "
      f"{config['vocab_size']}"
    )
  import ml_dtypes

  np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
  arrays = {name: load().astype(np_dtype) for name, load in tensors}
  parent = os.path.dirname(os.path.abspath(out_dir))
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".gguf-import-", dir=parent)
  try:  # written beside, then moved into place: an interrupted import leaves no half directory
    save_file(arrays, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    tok.save(os.path.join(tmp, "tokenizer.json"))
    generation = {
      k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config
    }
    files = {
      "config.json": {**config, "torch_dtype": dtype},
      "tokenizer_config.json": tok_config,
      "generation_config.json": generation,
    }
    for name, content in files.items():
      with open(os.path.join(tmp, name), "w") as f:
        json.dump(content, f, indent=2, sort_keys=True)
        f.write("\n")
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(tmp):
      os.chmod(os.path.join(tmp, name), 0o644)
      os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return {
    "gguf": os.path.abspath(path),
    "out": os.path.abspath(out_dir),
    "dtype": dtype,
    "tensors": len(arrays),
    "parameters": int(sum(a.size for n, a in arrays.items())),
    "tensor_types": sorted({t.tensor_type.name for t in reader.tensors}),
    "name": _field(reader, "general.name"),
  }
