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
truncated file, a tokenizer model other than byte-level BPE, an unknown tensor, a tensor whose
shape the metadata does not give, a token id outside the vocabulary, metadata of the wrong type
or out of range, text that is not UTF-8) is refused with one `GGUFError` naming the file, the
key and what is allowed, before anything is written; so is anything the loader would refuse in
the directory about to be written (`_check_loads` runs its own checks on it). So is an OUT_DIR
that is a file or already holds weights or a file the import writes (`check_out_dir`).
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

from jaxrl_llm import paths
from jaxrl_llm.models import gguf_tokenizer
from jaxrl_llm.models.gguf_reader import (
  REQUIRED,
  GGUFError,
  array,
  field,
  open_reader,
  positive,
  whole,
)

# Tensor types imported (each dequantized by gguf.quants, tested against its own quantizer).
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
ARCHITECTURES = ("llama",)
DTYPES = ("float32", "bfloat16")


def _heads(reader, arch: str, heads: int, d: int, path: str) -> tuple[int, int, int]:
  """(query heads, key-value heads, head dimension) of the metadata, each checked against the
  others (`heads` from attention.head_count, `d` the embedding length)."""
  kv_heads = whole(reader, f"{arch}.attention.head_count_kv", heads, least=1)
  head_count = f"{arch}.attention.head_count={heads}"
  if heads < 1 or kv_heads < 1 or heads % kv_heads:
    raise GGUFError(
      f"{path}: {head_count} is not a multiple of {arch}.attention.head_count_kv={kv_heads}"
    )
  key_length = whole(reader, f"{arch}.attention.key_length")
  if key_length is None and d % heads:
    raise GGUFError(f"{path}: {arch}.embedding_length={d} is not a multiple of {head_count}")
  head_dim = key_length if key_length is not None else d // heads
  if head_dim < 2 or head_dim % 2:  # rotary embeddings turn pairs of dimensions
    raise GGUFError(f"{path}: the head dimension {head_dim} is not a positive even number")
  rope = whole(reader, f"{arch}.rope.dimension_count", head_dim)
  if rope != head_dim:
    where = (
      f"{arch}.attention.key_length={head_dim}"
      if key_length is not None
      else f"{arch}.embedding_length={d} / {head_count}"
    )
    # Fewer rotary dimensions than a head has is a real model we do not run; more is metadata
    # at odds with itself (a wrong head count, most likely).
    why = (
      "partial rotary dimensions are not imported"
      if rope < head_dim
      else "a head cannot hold more rotary dimensions than it has: the metadata contradicts itself"
    )
    raise GGUFError(
      f"{path}: {arch}.rope.dimension_count={rope} differs from the head dimension {head_dim} "
      f"({where}): {why}"
    )
  return heads, kv_heads, head_dim


def _metadata(reader, path: str) -> dict[str, Any]:
  """The architecture's hyperparameters, checked; GGUFError for what cannot be imported."""
  arch = field(reader, "general.architecture")
  if arch not in ARCHITECTURES:
    raise GGUFError(
      f"{path}: general.architecture={arch!r} is not imported; allowed: {', '.join(ARCHITECTURES)}"
    )

  def need(key: str) -> int:
    """Metadata `{arch}.{key}`: present, a whole number >= 1."""
    return whole(reader, f"{arch}.{key}", REQUIRED, least=1)

  scaling = field(reader, f"{arch}.rope.scaling.type", "none")
  if scaling not in ("none", None) or any(t.name == "rope_freqs.weight" for t in reader.tensors):
    raise GGUFError(f"{path}: RoPE scaling ({scaling!r} / rope_freqs.weight) is not imported")
  d = need("embedding_length")
  heads, kv_heads, head_dim = _heads(reader, arch, need("attention.head_count"), d, path)
  tokens = array(reader, "tokenizer.ggml.tokens", str, [])
  return {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": d,
    "intermediate_size": need("feed_forward_length"),
    "num_hidden_layers": need("block_count"),
    "num_attention_heads": heads,
    "num_key_value_heads": kv_heads,
    "head_dim": head_dim,
    "rms_norm_eps": positive(reader, f"{arch}.attention.layer_norm_rms_epsilon", REQUIRED),
    "rope_theta": positive(reader, f"{arch}.rope.freq_base", 10000.0),
    "max_position_embeddings": need("context_length"),
    "vocab_size": whole(reader, f"{arch}.vocab_size", len(tokens), least=1),
    "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    **{
      f"{k}_token_id": v
      for k, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"))
      if (v := whole(reader, f"tokenizer.ggml.{key}_token_id")) is not None
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


def _shapes(reader, config: Mapping[str, Any]) -> dict[str, list[tuple[int, str]]]:
  """The shape each Hugging Face tensor must have by the metadata: per dimension, (size, the
  metadata it comes from)."""
  arch = field(reader, "general.architecture")
  c = config
  d = (c["hidden_size"], f"{arch}.embedding_length={c['hidden_size']}")
  ffn = (c["intermediate_size"], f"{arch}.feed_forward_length={c['intermediate_size']}")
  vocab = (
    (c["vocab_size"], f"{arch}.vocab_size={c['vocab_size']}")
    if field(reader, f"{arch}.vocab_size") is not None
    else (c["vocab_size"], f"the {c['vocab_size']} tokens of tokenizer.ggml.tokens")
  )
  head_dim = f"head dimension {c['head_dim']}"
  q = (
    c["num_attention_heads"] * c["head_dim"],
    f"{arch}.attention.head_count={c['num_attention_heads']} x {head_dim}",
  )
  kv = (
    c["num_key_value_heads"] * c["head_dim"],
    f"{arch}.attention.head_count_kv={c['num_key_value_heads']} x {head_dim}",
  )
  layer = {
    "input_layernorm": [d],
    "post_attention_layernorm": [d],
    "self_attn.q_proj": [q, d],
    "self_attn.k_proj": [kv, d],
    "self_attn.v_proj": [kv, d],
    "self_attn.o_proj": [d, q],
    "mlp.gate_proj": [ffn, d],
    "mlp.up_proj": [ffn, d],
    "mlp.down_proj": [d, ffn],
  }
  out = {
    "model.embed_tokens.weight": [vocab, d],
    "model.norm.weight": [d],
    "lm_head.weight": [vocab, d],
  }
  for i in range(c["num_hidden_layers"]):
    out.update({f"model.layers.{i}.{k}.weight": v for k, v in layer.items()})
  return out


def _tensors(reader, config: Mapping[str, Any], path: str) -> list[tuple[str, Callable]]:
  """[(HF name, a function returning its float32 array)], checked before anything is read:
  each tensor's type, name and shape (against the metadata's)."""
  from gguf import quants

  held = {int(m.group(1)) for t in reader.tensors if (m := re.match(r"blk\.(\d+)\.", t.name))}
  if config["num_hidden_layers"] > len(held):  # before `_shapes` lists every layer's tensors
    raise GGUFError(
      f"{path}: block_count={config['num_hidden_layers']}, but the file holds {len(held)} "
      "blocks (blk.<i>) of tensors; allowed: the number of blocks it holds"
    )
  shapes = _shapes(reader, config)
  arch = field(reader, "general.architecture")
  out = []
  for t in reader.tensors:
    kind = t.tensor_type.name
    if kind not in TENSOR_TYPES:
      raise GGUFError(
        f"{path}: tensor {t.name!r} is of type {kind}, which is not imported; allowed: "
        f"{', '.join(TENSOR_TYPES)}"
      )
    name, permuted = _hf_name(t.name, path)
    if name not in shapes:  # a layer past the last one
      raise GGUFError(
        f"{path}: tensor {t.name!r} is beyond the {arch}.block_count={config['num_hidden_layers']}"
        " layers the metadata holds"
      )
    # Checked here, not when the import loads the model: a file whose metadata disagrees with
    # its tensors would otherwise be written as a directory that does not load.
    shape = [int(n) for n in reversed(t.shape)]  # GGUF lists dims innermost first
    want = shapes[name]
    if shape != [n for n, _ in want]:
      keys = [key for (n, key), got in zip(want, shape + [None] * len(want)) if n != got]
      raise GGUFError(
        f"{path}: tensor {t.name!r} has shape {shape}, but the metadata implies "
        f"{[n for n, _ in want]} ({', '.join(keys) or 'its number of dimensions'})"
      )
    heads = config["num_attention_heads" if permuted == "q" else "num_key_value_heads"]

    def load(t=t, permuted=permuted, heads=heads) -> np.ndarray:
      with np.errstate(all="ignore"):  # a NaN or inf scale: said in the one line below
        w = np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32)
      if not np.isfinite(w).all():  # as the Hugging Face loader refuses them: before writing
        raise GGUFError(f"{path}: tensor {t.name!r} holds non-finite values (NaN or inf)")
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


# What an import writes, and the weight files of any other layout: an OUT_DIR holding one of
# them is refused (the import would replace a user's file or leave two sets of weights).
WRITES = (
  "config.json",
  "model.safetensors",
  "tokenizer.json",
  "tokenizer_config.json",
  "generation_config.json",
)
WEIGHTS = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json")


def check_out_dir(out_dir: str) -> None:
  """GGUFError unless `out_dir` can take an import: a directory to be made (`paths.dir_problem`),
  or one that holds no weights and none of the files an import writes."""
  import glob

  from jaxrl_llm import paths

  if problem := paths.dir_problem(out_dir):
    raise GGUFError(f"{out_dir}: {problem}; choose a new directory")
  if not os.path.isdir(out_dir):
    return
  taken = [os.path.join(out_dir, n) for n in WRITES if os.path.lexists(os.path.join(out_dir, n))]
  taken += sorted({f for w in WEIGHTS for f in glob.glob(os.path.join(glob.escape(out_dir), w))})
  if taken:
    raise GGUFError(
      f"{taken[0]}: already exists ({len(set(taken))} such files in all); an import writes into a "
      f"new directory or one that holds no weights ({', '.join(WEIGHTS)}) and none of "
      f"{', '.join(WRITES)}"
    )


def _check_loads(files: Mapping[str, Any], tok, path: str) -> None:
  """GGUFError unless the JSON `files` and tokenizer about to be written pass the loader's own
  checks: `hf_config.config_from_hf` (as `hf.load_checkpoint` runs it), `hf.read_source` and
  `HFTokenizer.from_dir`, run on a scratch copy of them. The metadata's own checks name the GGUF
  key first; these keep the import from writing a directory the loader would refuse."""
  from jaxrl_llm.data.tokenizers import HFTokenizer
  from jaxrl_llm.models import hf, hf_config

  with tempfile.TemporaryDirectory(prefix="gguf-import-check-") as scratch:
    _write_json(scratch, files)
    tok.save(os.path.join(scratch, "tokenizer.json"))
    config = os.path.join(scratch, "config.json")
    try:
      hf_config.config_from_hf(files["config.json"], source=config)
      hf.read_source(scratch)
      HFTokenizer.from_dir(scratch)
    except ValueError as e:  # CheckpointFormatError is one
      msg = " ".join(str(e).replace(os.path.join(scratch, ""), "").split())
      raise GGUFError(
        f"{path}: it would be imported as a directory that does not load: {msg}"
      ) from None


def _write_json(directory: str, files: Mapping[str, Any]) -> None:
  """Writes each of `files` ({name: content}) as an indented JSON file in `directory`."""
  for name, content in files.items():
    with open(os.path.join(directory, name), "w") as f:
      json.dump(content, f, indent=2, sort_keys=True)
      f.write("\n")


def _read(path: str, dtype: str) -> tuple[Any, dict[str, Any], Any, list[tuple[str, Callable]]]:
  """(reader, {name: content} of the JSON files to write, the tokenizer, the tensors) of the GGUF
  file `path`: every value read and checked, here and by the loader's checks (`_check_loads`)."""
  reader = open_reader(path)
  config = _metadata(reader, path)
  tok, tokens = gguf_tokenizer.tokenizer(reader, path)
  tok_config = gguf_tokenizer.tokenizer_config(
    reader, tokens, config["max_position_embeddings"], path
  )
  gguf_tokenizer.check_template(tok_config, path)
  gguf_tokenizer.check_vocabulary(reader, config, tok, tokens, path)
  files = {
    "config.json": {**config, "torch_dtype": dtype},
    "tokenizer_config.json": tok_config,
    "generation_config.json": {
      k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config
    },
  }
  _check_loads(files, tok, path)
  return reader, files, tok, _tensors(reader, config, path)


def _write(out_dir: str, arrays: Mapping[str, np.ndarray], tok, files: Mapping[str, Any]) -> None:
  """Writes the weights, the tokenizer and the JSON `files` beside `out_dir`, then moves them in:
  an interrupted import leaves no half directory."""
  from safetensors.numpy import save_file

  parent = os.path.dirname(os.path.abspath(out_dir))
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".gguf-import-", dir=parent)
  try:
    save_file(dict(arrays), os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    tok.save(os.path.join(tmp, "tokenizer.json"))
    _write_json(tmp, files)
    os.makedirs(out_dir, exist_ok=True)
    # The weights last: their presence marks a complete import (as `pretrained.fetch` reads it).
    for name in sorted(os.listdir(tmp), key=lambda n: n == "model.safetensors"):
      paths.publish(os.path.join(tmp, name), os.path.join(out_dir, name))
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def import_gguf(path: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str = "float32"):
  """Writes the Hugging Face directory of the GGUF file `path` at `out_dir` (see the module
  docstring); returns a summary dict. GGUFError, with nothing written, for what it cannot: all
  of the file is read and checked (the summary's too) before anything is written."""
  import ml_dtypes

  path, out_dir = os.fspath(path), os.fspath(out_dir)
  if dtype not in DTYPES:
    raise GGUFError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
  check_out_dir(out_dir)
  reader, files, tok, tensors = _read(path, dtype)
  np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
  arrays = {}
  for name, load in tensors:
    with np.errstate(over="ignore"):  # said below, in one line
      arrays[name] = load().astype(np_dtype)
    if not np.isfinite(arrays[name]).all():  # float32's 3.4e38 is inf in bfloat16
      raise GGUFError(
        f"{path}: tensor {name} holds values beyond the range of {dtype}; allowed: "
        "--dtype=float32, or weights within its range"
      )
  summary = {
    "gguf": os.path.abspath(path),
    "out": os.path.abspath(out_dir),
    "dtype": dtype,
    "tensors": len(arrays),
    "parameters": int(sum(a.size for n, a in arrays.items())),
    "tensor_types": sorted({t.tensor_type.name for t in reader.tensors}),
    "name": field(reader, "general.name"),
  }
  _write(out_dir, arrays, tok, files)
  return summary
