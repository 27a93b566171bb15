"""Bad prompt files and tokenizer files, each refused in one line naming the file (or read as
it is meant): a damaged gzip or Parquet file, a number JSON cannot convert, a carriage return
inside a record, a file named twice, token ids in generation_config.json that are no ids, a
held-out split whose first prompts are too long, a broken tokenizer in the checkpoint.

Everything is real: files written with gzip, pyarrow and the `tokenizers` library, read by the
trainer's own loaders."""

import gzip
import json
import shutil

import pytest
from conftest import tiny_config
from text_fixtures import build_bpe_tokenizer, math_file_run, write_math_jsonl

from jaxrl_llm.data import file_task
from jaxrl_llm.data import records as records_lib
from jaxrl_llm.data.tokenizers import HFTokenizer

FIELDS = {"prompt_field": "prompt", "answer_field": "answer"}


def _lines(tmp_path):
  return [json.dumps(r) + "\n" for r in write_math_jsonl(tmp_path / "math.jsonl", n=12)]


def _load(*paths):
  return records_lib.load_records([str(p) for p in paths], **FIELDS)


def test_a_damaged_gzip_or_parquet_file_is_one_line_naming_it(tmp_path):
  raw = bytearray(gzip.compress("".join(_lines(tmp_path)).encode()))
  raw[len(raw) // 2] ^= 0xFF  # the deflate stream, not the header: read fails midway
  raw[len(raw) // 2 + 1] ^= 0xFF
  (tmp_path / "bad.jsonl.gz").write_bytes(bytes(raw))
  with pytest.raises(records_lib.DataError, match=r"bad\.jsonl\.gz: could not read"):
    _load(tmp_path / "bad.jsonl.gz")

  import pyarrow as pa
  import pyarrow.parquet as pq

  rows = [json.loads(line) for line in _lines(tmp_path)]
  table = pa.table({k: [r[k] for r in rows] for k in ("prompt", "answer")})
  pq.write_table(table, tmp_path / "ok.parquet", row_group_size=4)
  data = bytearray((tmp_path / "ok.parquet").read_bytes())
  for k in range(200, 600):  # the data pages; the footer stays readable
    data[k] ^= 0x5A
  (tmp_path / "bad.parquet").write_bytes(bytes(data))
  with pytest.raises(records_lib.DataError, match=r"bad\.parquet: not a readable Parquet") as e:
    _load(tmp_path / "bad.parquet")
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind", ["binary", "timestamp", "date_in_struct"])
def test_a_parquet_answer_of_no_text_kind_is_one_line_naming_the_row(tmp_path, kind):
  """A Parquet answer column of bytes, timestamps or a struct holding a date was a TypeError
  traceback (JSON could not write it); now one line names the file's row and the field."""
  import datetime

  import pyarrow as pa
  import pyarrow.parquet as pq

  answers = {
    "binary": pa.array([b"1", b"2"]),
    "timestamp": pa.array([datetime.datetime(2020, 1, 1)] * 2),
    "date_in_struct": pa.array([{"d": datetime.date(2020, 1, 1)}] * 2),
  }[kind]
  pq.write_table(pa.table({"prompt": ["a", "b"], "answer": answers}), tmp_path / "a.parquet")
  with pytest.raises(records_lib.DataError) as e:
    _load(tmp_path / "a.parquet")
  assert "a.parquet" in str(e.value) and "answer field 'answer' holds a " in str(e.value)
  assert "store it as text" in str(e.value) and "\n" not in str(e.value)


def test_a_number_json_cannot_convert_names_the_file_and_line(tmp_path):
  lines = _lines(tmp_path)
  big = '{"prompt": "x", "answer": "1", "id": %s}\n' % ("9" * 5000)  # past int's 4300 digits
  (tmp_path / "big.jsonl").write_text(lines[0] + big)
  with pytest.raises(records_lib.DataError, match=r"big\.jsonl:2: a value JSON cannot read"):
    _load(tmp_path / "big.jsonl")


def test_a_carriage_return_between_a_records_fields_keeps_the_record_whole(tmp_path):
  """JSON allows a raw CR as whitespace; universal newlines split the record there."""
  lines = _lines(tmp_path)
  with open(tmp_path / "cr.jsonl", "w", newline="") as f:
    f.write("".join(line.replace(', "answer"', ',\r"answer"') for line in lines))
  assert len(_load(tmp_path / "cr.jsonl")) == len(lines)


def test_a_file_named_twice_is_refused_not_read_twice(tmp_path):
  _lines(tmp_path)
  (tmp_path / "more.jsonl").write_text("".join(_lines(tmp_path)))
  path = tmp_path / "math.jsonl"
  for twice in ([path, path], [path, tmp_path / "." / "math.jsonl"], [tmp_path / "*.jsonl", path]):
    with pytest.raises(records_lib.DataError, match=r"math\.jsonl is named twice .* each file"):
      _load(*twice)
  assert len(_load(tmp_path / "*.jsonl")) == 24  # two distinct files: both read


@pytest.mark.parametrize(
  "key, value",
  [("eos_token_id", "12"), ("eos_token_id", 2.5), ("eos_token_id", [2, 3.7]),
   ("eos_token_id", True), ("pad_token_id", 1.9), ("pad_token_id", [0]), ("pad_token_id", -1)],
)  # fmt: skip
def test_generation_config_ids_that_are_not_ids_are_refused_naming_the_file(tmp_path, key, value):
  """A string "12" read as ids 1 and 2, a float 1.9 as id 1; a list pad id was a TypeError."""
  tok = build_bpe_tokenizer(tmp_path / "tok")
  (tok / "generation_config.json").write_text(json.dumps({key: value}))
  with pytest.raises(ValueError, match=rf"generation_config\.json: {key}=") as e:
    HFTokenizer.from_dir(tok)
  assert repr(value) in str(e.value)
  (tok / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2], key: 2}))
  assert 2 in HFTokenizer.from_dir(tok).eos_ids  # ids are still read


def _file_config(tmp_path, **more):
  overrides, _ = math_file_run(tmp_path)
  return tiny_config(**overrides | more)


def test_the_held_out_split_reads_past_prompts_too_long_for_prompt_len(tmp_path):
  """Only the first 2 x eval_size held-out records were tokenized: 6 long ones first left 2
  prompts (of 4 asked), and 8 said every prompt was too long, naming neither the split nor
  what fits."""
  lines = _lines(tmp_path)
  long = json.dumps({"prompt": "word " * 400, "answer": "1"}) + "\n"
  for first_long in (6, 8, 300):
    eval_file = tmp_path / f"eval_{first_long}.jsonl"
    eval_file.write_text(long * first_long + "".join(lines))
    cfg = _file_config(tmp_path, **{"data.eval_files": str(eval_file)})
    batch, answers = file_task.build_file_task(cfg, "").eval_set()
    assert len(answers) == 4 == len(batch["tokens"]), first_long
    assert list(answers) == [json.loads(line)["answer"] for line in lines[:4]]
  eval_file.write_text(long * 5)
  cfg = _file_config(tmp_path, **{"data.eval_files": str(eval_file)})
  with pytest.raises(records_lib.DataError, match=r"0 of the 5 held-out prompts fit data.prompt"):
    file_task.build_file_task(cfg, "").eval_set()


def test_a_broken_tokenizer_in_the_checkpoint_names_model_checkpoint(tmp_path):
  """With data.tokenizer empty the tokenizer is model.checkpoint's: its fault is not
  data.tokenizer's."""
  ckpt = tmp_path / "ckpt"
  shutil.copytree(build_bpe_tokenizer(tmp_path / "tok"), ckpt)
  (ckpt / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"}}')
  cfg = _file_config(tmp_path, **{"data.tokenizer": ""})
  with pytest.raises(records_lib.DataError) as e:
    file_task.build_file_task(cfg, str(ckpt))
  assert str(e.value).startswith(f"model.checkpoint={str(ckpt)!r}: "), e.value
  assert "not a valid tokenizer.json" in str(e.value) and "data.tokenizer" not in str(e.value)


def test_a_tokenizer_of_another_vocabulary_than_the_checkpoints_is_refused(tmp_path):
  """data.tokenizer from another model beside model.checkpoint's own: the run trained on
  prompts the model read through ids it never learned (digits gone, its own special tokens
  others), and the export shipped that tokenizer with the weights. The checkpoint's tokenizer
  under another chat template is its own vocabulary: accepted."""
  ckpt = tmp_path / "ckpt"
  shutil.copytree(build_bpe_tokenizer(tmp_path / "own", vocab_size=300), ckpt)
  other = build_bpe_tokenizer(tmp_path / "other", vocab_size=120)
  cfg = _file_config(tmp_path, **{"data.tokenizer": str(other)})
  with pytest.raises(records_lib.DataError) as e:
    file_task.build_file_task(cfg, str(ckpt))
  line = str(e.value)
  assert line.startswith(f"data.tokenizer={str(other)!r}: its vocabulary ("), line
  assert f"is not that of the tokenizer of model.checkpoint={ckpt} (" in line, line
  assert "\n" not in line and "None" not in line and "'s (" not in line, line
  again = tmp_path / "again"
  shutil.copytree(ckpt, again)
  config = json.loads((again / "tokenizer_config.json").read_text())
  config["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
  (again / "tokenizer_config.json").write_text(json.dumps(config))
  cfg = _file_config(tmp_path, **{"data.tokenizer": str(again)})
  assert (
    file_task.build_file_task(cfg, str(ckpt)).tokenizer.chat_template == config["chat_template"]
  )


@pytest.mark.parametrize("split", ["train", "held-out"])
def test_prompts_that_cannot_fit_are_one_line_before_the_run_writes(tmp_path, split):
  """A split whose every prompt is too long for data.prompt_len: the held-out one was a
  traceback after config.json, events and checkpoints/ were written; either left an empty
  checkpoints/ that kept the refused launch's fresh workdir. Now both are one line
  (`launch.explain`) before anything is written, and the fresh workdir goes."""
  from jaxrl_llm import launch
  from jaxrl_llm.config import parse
  from jaxrl_llm.run import train_and_evaluate

  long_file = tmp_path / "long.jsonl"
  long_file.write_text((json.dumps({"prompt": "word " * 400, "answer": "1"}) + "\n") * 5)
  files = {"data.eval_files": str(long_file), "data.eval_fraction": 0.0}
  if split == "train":  # the long prompts to learn from, the held-out split the good file
    files = {"data.train_files": str(long_file), "data.eval_files": str(tmp_path / "math.jsonl")}
  cfg = parse(_file_config(tmp_path, **(files | {"data.eval_fraction": 0.0})))
  workdir = tmp_path / "run"
  assert launch.open_workdir(str(workdir))  # made by this launch
  with pytest.raises(records_lib.DataError) as e:
    train_and_evaluate(cfg, str(workdir))
  line = launch.explain(e.value)
  assert line.startswith("error: ") and "\n" not in line and "data.prompt_len=128" in line
  assert list(workdir.iterdir()) == [], "nothing is written before the prompts are read"
  (workdir / "checkpoints").mkdir()  # what a later failure leaves: the Checkpointer's folder
  launch.remove_if_empty(str(workdir))
  assert not workdir.exists()
