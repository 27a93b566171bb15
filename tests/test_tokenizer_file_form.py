"""`data.tokenizer` and `hf_convert.py export --tokenizer` given as the tokenizer.json file (a
documented form) read as the directory holding it: its tokenizer_config.json (eos, pad, chat
template) and generation_config.json come along. A file of another name is read alone, and the
message says so and what to pass instead.

Everything is real: tokenizers trained with the `tokenizers` library and read by the trainer's
own loader."""

import shutil

import pytest
from text_fixtures import build_bpe_tokenizer

from jaxrl_llm.data import file_task
from jaxrl_llm.data import records as records_lib
from jaxrl_llm.data.tokenizers import HFTokenizer


def test_data_tokenizer_as_the_file_reads_as_its_directory(tmp_path):
  d = build_bpe_tokenizer(
    tmp_path / "tok", pad_token="<|im_start|>", generation_eos=("<|im_end|>",)
  )
  by_dir = HFTokenizer.from_dir(d)
  by_file = file_task._tokenizer(str(d / "tokenizer.json"), "")
  assert by_file.eos_ids == by_dir.eos_ids and len(by_file.eos_ids) == 2
  assert by_file.pad_id == by_dir.pad_id != by_file.eos_id
  assert by_file.chat_template == by_dir.chat_template is not None


def test_a_tokenizer_file_of_another_name_says_it_is_read_alone(tmp_path):
  d = build_bpe_tokenizer(tmp_path / "tok")
  other = shutil.copy(d / "tokenizer.json", d / "my_tokenizer.json")
  with pytest.raises(records_lib.DataError) as e:
    file_task._tokenizer(str(other), "")
  message = str(e.value)
  assert message.startswith(f"data.tokenizer={str(other)!r}: ") and "\n" not in message
  assert "read alone" in message and "pass the directory" in message
