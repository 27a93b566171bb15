"""GGUF files with bad metadata: `import-gguf` refuses each in one `error:` line naming the file
and the key, with nothing written (no OUT_DIR, no half directory beside it).

The files are test_gguf's tiny Llama (`write_gguf`), with one value changed: bytes that are not
UTF-8, a value of the wrong type (written by swapping one of gguf's `GGUFWriter.add_<key>`
methods while the file is made), or a value the loader would refuse later (an epsilon of 0).
"""

import json
import pathlib
import subprocess
import sys

import pytest
from conftest import REPO, cli_env
from test_gguf import MERGES, _refused, write_gguf

from jaxrl_llm.models import gguf as gguf_import


def _cli_refuses(path: pathlib.Path, out: pathlib.Path, *names: str) -> str:
  """`hf_convert.py import-gguf path out` exits 2 with one `error:` line naming `path` and each
  of `names`, and leaves `out` uncreated and nothing beside it; returns the line."""
  before = sorted(out.parent.iterdir())
  proc = subprocess.run(
    [sys.executable, "tools/hf_convert.py", "import-gguf", str(path), str(out)],
    cwd=REPO,
    env=cli_env(),
    capture_output=True,
    text=True,
    timeout=120,
  )
  lines = proc.stderr.splitlines()
  assert proc.returncode == 2, (proc.returncode, proc.stderr)
  assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
  for name in (str(path), *names):
    assert name in lines[0], lines[0]
  assert "Traceback" not in proc.stderr and proc.stdout == ""
  assert not out.exists() and sorted(out.parent.iterdir()) == before
  return lines[0]


def _written(tmp_path, monkeypatch, swap=None, **kwargs) -> pathlib.Path:
  """test_gguf's tiny file at tmp_path/bad.gguf; `swap` maps a `GGUFWriter.add_<key>` method to
  a function (writer, value) run in its place while the file is written."""
  import gguf

  with monkeypatch.context() as m:
    for name, fn in (swap or {}).items():
      m.setattr(gguf.GGUFWriter, name, fn)
    write_gguf(tmp_path / "bad.gguf", "Q8_0", **kwargs)
  return tmp_path / "bad.gguf"


def _bytes_replaced(path: pathlib.Path, old: bytes, new: bytes) -> pathlib.Path:
  """`path` with its one occurrence of `old` replaced by `new` (of the same length)."""
  data = path.read_bytes()
  assert data.count(old) == 1 and len(old) == len(new)
  path.write_bytes(data.replace(old, new))
  return path


# ------------------------------------------------------------------- 1: bytes that are not UTF-8


def test_cli_refuses_a_name_that_is_not_utf8_before_writing(tmp_path, monkeypatch):
  """general.name is read for the summary: its bad byte used to fail after the five files were
  moved into OUT_DIR (an error, and a retry refused as 'already exists')."""
  path = _bytes_replaced(_written(tmp_path, monkeypatch), b"tiny-llama", b"\xffiny-llama")
  line = _cli_refuses(path, tmp_path / "out", "general.name", "UTF-8")
  assert "0xff" in line


def test_token_that_is_not_utf8_is_refused(tmp_path, monkeypatch):
  path = _bytes_replaced(_written(tmp_path, monkeypatch), b"<think>", b"\xfethink>")
  _refused(path, tmp_path / "out", str(path), "tokenizer.ggml.tokens", "UTF-8")


# ------------------------------------------------------------------- 2: values of the wrong type


def test_cli_refuses_a_string_embedding_length(tmp_path, monkeypatch):
  swap = {"add_embedding_length": lambda w, v: w.add_string("llama.embedding_length", "abc")}
  path = _written(tmp_path, monkeypatch, swap)
  line = _cli_refuses(path, tmp_path / "out", "llama.embedding_length='abc'", "whole number")
  assert "invalid literal" not in line


WRONG_TYPES = {
  # id: (GGUFWriter method -> what it writes instead, or write_gguf's meta; what is named)
  "head_count_kv array": (
    {"add_head_count_kv": lambda w, v: w.add_array("llama.attention.head_count_kv", [2, 2])},
    ("llama.attention.head_count_kv=[2, 2]", "whole number"),
  ),
  "block_count float": (
    {"add_block_count": lambda w, v: w.add_float32("llama.block_count", 2.5)},
    ("llama.block_count=2.5", "whole number"),
  ),
  "epsilon string": (
    {
      "add_layer_norm_rms_eps": lambda w, v: w.add_string(
        "llama.attention.layer_norm_rms_epsilon", "1e-5"
      )
    },
    ("llama.attention.layer_norm_rms_epsilon='1e-5'", "number"),
  ),
  "eos id string": (
    {"add_eos_token_id": lambda w, v: w.add_string("tokenizer.ggml.eos_token_id", "2")},
    ("tokenizer.ggml.eos_token_id='2'", "whole number"),
  ),
  "add_bos_token string": (
    {"add_add_bos_token": lambda w, v: w.add_string("tokenizer.ggml.add_bos_token", "false")},
    ("tokenizer.ggml.add_bos_token='false'", "true or false"),
  ),
  "integer merges": (
    {"add_token_merges": lambda w, v: w.add_array("tokenizer.ggml.merges", [1, 2, 3])},
    ("tokenizer.ggml.merges", "1", "strings"),
  ),
  "integer tokens": (
    {"add_token_list": lambda w, v: w.add_array("tokenizer.ggml.tokens", list(range(len(v))))},
    ("tokenizer.ggml.tokens", "strings"),
  ),
  "string pre-tokenizer list": (
    {"add_tokenizer_pre": lambda w, v: w.add_array("tokenizer.ggml.pre", ["smollm"])},
    ("tokenizer.ggml.pre=['smollm']",),
  ),
  "merge out of the vocabulary": (
    {"meta": {"token_merges": [*MERGES, "zzzq qqqz"]}},
    ("tokenizer.ggml.merges", "'zzzq qqqz'", "'zzzq'", "tokenizer.ggml.tokens"),
  ),
  "merge of a pair not in the vocabulary": (
    {"meta": {"token_merges": [*MERGES, "h t"]}},
    ("tokenizer.ggml.merges", "'h t'", "'ht'", "tokenizer.ggml.tokens"),
  ),
}


@pytest.mark.parametrize("case", WRONG_TYPES)
def test_value_of_the_wrong_type_is_refused_naming_its_key(tmp_path, monkeypatch, case):
  """A value of the wrong type: one GGUFError naming the file, the key and what it must be."""
  swap, names = WRONG_TYPES[case]
  swap = dict(swap)
  path = _written(tmp_path, monkeypatch, swap, meta=swap.pop("meta", None))
  msg = _refused(path, tmp_path / "out", str(path), *names)
  assert "int()" not in msg and "attribute" not in msg and "BPE" not in msg, msg


# ------------------------------------------------------------------- 3: values the loader refuses


def test_cli_refuses_an_epsilon_of_zero(tmp_path, monkeypatch):
  """An epsilon of 0 used to be imported (exit 0) into a directory that does not load."""
  path = _written(tmp_path, monkeypatch, meta={"layer_norm_rms_eps": 0.0})
  _cli_refuses(path, tmp_path / "out", "llama.attention.layer_norm_rms_epsilon=0.0", "> 0")


UNLOADABLE = {
  # id: (write_gguf's meta, what the message names)
  "epsilon nan": ({"layer_norm_rms_eps": float("nan")}, ("layer_norm_rms_epsilon=nan", "> 0")),
  "context_length 0": ({"context_length": 0}, ("llama.context_length=0", ">= 1")),
  "freq_base 0": ({"rope_freq_base": 0.0}, ("llama.rope.freq_base=0.0", "> 0")),
  "freq_base negative": ({"rope_freq_base": -1.0}, ("llama.rope.freq_base=-1.0", "> 0")),
  "embedding_length 0": ({"embedding_length": 0}, ("llama.embedding_length=0", ">= 1")),
  "no eos id": ({"eos_token_id": None}, ("tokenizer.ggml.eos_token_id", "missing")),
  "bos added but no bos id": (
    {"bos_token_id": None, "add_bos_token": True},
    ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.bos_token_id"),
  ),
}


@pytest.mark.parametrize("case", UNLOADABLE)
def test_value_the_loader_refuses_is_refused_before_writing(tmp_path, monkeypatch, case):
  """What would be written as a directory that does not load is refused by the import."""
  meta, names = UNLOADABLE[case]
  path = _written(tmp_path, monkeypatch, meta=meta)
  _refused(path, tmp_path / "out", str(path), *names)


def test_imported_directory_loads_with_the_loaders_own_checks(tmp_path, monkeypatch):
  """The file these tests change imports, and its directory passes the loader's checks."""
  from jaxrl_llm.data.tokenizers import HFTokenizer
  from jaxrl_llm.models import hf

  path = _written(tmp_path, monkeypatch)
  summary = gguf_import.import_gguf(path, tmp_path / "out")
  assert summary["name"] == "tiny-llama"
  cfg, _, _ = hf._load_config(str(tmp_path / "out"), {})
  assert cfg.norm_eps > 0 and cfg.rope_theta == 50000.0
  assert hf.read_source(tmp_path / "out").fields["max_position_embeddings"] == 256
  assert HFTokenizer.from_dir(tmp_path / "out").eos_ids


def test_a_directory_the_loader_refuses_is_refused_by_its_own_checks(tmp_path, monkeypatch):
  """The loader's checks run on what the import is about to write, as a last guard: a
  config.json it refuses (here an epsilon of 0, which the metadata's checks stop first in a
  real file) is one GGUFError naming the GGUF file and the field."""
  from tokenizers import Tokenizer

  path = _written(tmp_path, monkeypatch)
  out = tmp_path / "out"
  gguf_import.import_gguf(path, out)
  names = ("config.json", "tokenizer_config.json", "generation_config.json")
  files = {n: json.loads((out / n).read_text()) for n in names}
  tok = Tokenizer.from_file(str(out / "tokenizer.json"))
  gguf_import._check_loads(files, tok, str(path))  # what was imported passes
  bad = {**files, "config.json": {**files["config.json"], "rms_norm_eps": 0.0}}
  with pytest.raises(gguf_import.GGUFError) as e:
    gguf_import._check_loads(bad, tok, str(path))
  msg = str(e.value)
  assert msg.startswith(f"{path}: ") and "config.json: " in msg, msg
  assert "model.norm_eps=0.0 must be > 0" in msg and "gguf-import-check" not in msg, msg
  no_eos = {**files, "generation_config.json": {}}
  no_eos["tokenizer_config.json"] = {
    k: v for k, v in files["tokenizer_config.json"].items() if k != "eos_token"
  }
  with pytest.raises(gguf_import.GGUFError, match="no end-of-sequence token"):
    gguf_import._check_loads(no_eos, tok, str(path))


def test_a_tensor_with_non_finite_values_is_refused_before_writing(tmp_path):
  """An inf in the embedding (here an F32 file; a Q8_0 block's scale does the same) was written
  out with exit 0, and the directory was then refused by the import and the trainer."""
  import numpy as np

  written = write_gguf(tmp_path / "ok.gguf")["token_embd.weight"][1]
  bad = np.array(written, np.float32)
  bad.flat[0] = np.inf
  write_gguf(tmp_path / "bad.gguf", edit={"token_embd.weight": (bad, "F32")})
  line = _cli_refuses(tmp_path / "bad.gguf", tmp_path / "out", "'token_embd.weight'")
  assert line.endswith("holds non-finite values (NaN or inf)"), line


def test_a_quantized_block_whose_scale_is_inf_is_one_line_without_numpys_warning(tmp_path):
  """A Q8_0 block whose float16 scale is inf: the refusal was preceded by numpy's two-line
  RuntimeWarning from the dequantization (inf x 0); now it is the one `error:` line."""
  import numpy as np

  written = write_gguf(tmp_path / "ok.gguf", "Q8_0")["token_embd.weight"][1]
  bad = np.array(written, np.uint8)
  bad.reshape(-1)[:2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)  # block 0 scale
  bad.reshape(-1)[2] = 0  # its first weight 0: inf x 0, numpy's "invalid value" warning
  write_gguf(tmp_path / "bad.gguf", "Q8_0", edit={"token_embd.weight": (bad, "Q8_0")})
  line = _cli_refuses(tmp_path / "bad.gguf", tmp_path / "out", "'token_embd.weight'")
  assert line.endswith("holds non-finite values (NaN or inf)"), line


def test_a_weight_bfloat16_cannot_hold_is_refused_before_writing(tmp_path):
  """import-gguf --dtype=bfloat16 of a finite float32 3.4e38 wrote inf with exit 0 (the check
  ran before the cast); the directory was then refused by the import and the trainer."""
  import numpy as np

  written = write_gguf(tmp_path / "ok.gguf")["output_norm.weight"][1]
  big = np.full_like(np.asarray(written, np.float32), 3.4e38)
  write_gguf(tmp_path / "big.gguf", edit={"output_norm.weight": (big, "F32")})
  with pytest.raises(gguf_import.GGUFError) as e:
    gguf_import.import_gguf(tmp_path / "big.gguf", tmp_path / "out", dtype="bfloat16")
  assert str(e.value) == (
    f"{tmp_path / 'big.gguf'}: tensor model.norm.weight holds values beyond the range of "
    "bfloat16; allowed: --dtype=float32, or weights within its range"
  )
  assert not (tmp_path / "out").exists()
  gguf_import.import_gguf(tmp_path / "big.gguf", tmp_path / "out", dtype="float32")


def test_a_block_count_past_the_file_s_blocks_is_refused_at_once(tmp_path):
  """block_count=10**8: the expected tensors were listed block by block before any was
  checked, and the import ran past any wait. Now one line, counted from the tensors' names."""
  write_gguf(tmp_path / "layers.gguf", meta={"block_count": 10**8})
  line = _cli_refuses(tmp_path / "layers.gguf", tmp_path / "out", "block_count=100000000")
  assert line.endswith(
    "but the file holds 2 blocks (blk.<i>) of tensors; allowed: the number of blocks it holds"
  ), line
