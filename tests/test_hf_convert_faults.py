"""`tools/hf_convert.py` refuses what would destroy or half-write a directory: an export into a
trainer workdir (the run's own, even with --overwrite), over files it would replace without
--overwrite, with --adapters written before --out is refused; bad flag values; an `import` of a
trainer workdir. Each refusal is one `error:` line naming the flag, written before anything is.
"""

import json
import os
import pathlib
import shutil
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from conftest import save_trainer_checkpoint

from jaxrl_llm.models import ModelConfig, Transformer, hf, hf_export

REPO = pathlib.Path(__file__).resolve().parents[1]
LLAMA = REPO / "tests" / "fixtures" / "hf" / "llama"
sys.path.insert(0, str(REPO / "tools"))

import hf_convert  # noqa: E402


def _save_run(workdir: pathlib.Path, cfg: ModelConfig, params, record: dict | None) -> None:
  """A trainer checkpoint of `params` at step 3 (meta: the model config) and the run record."""
  save_trainer_checkpoint(
    workdir, params, {"model": cfg.to_dict(), "hf_model_type": "llama"}, record
  )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """{"llama": a run started from a copy of the llama fixture (its record names it),
  "adapters": a run of a random-init model with adapters (no record)}."""
  root = tmp_path_factory.mktemp("runs")
  src = root / "llama"
  shutil.copytree(LLAMA, src)
  cfg, params = hf.load_checkpoint(src)
  record = {"config": {"model": {"checkpoint": str(src)}, "data": {"tokenizer": ""}}}
  _save_run(root / "llama_run", cfg, params, record)
  cfg = ModelConfig(
    vocab_size=24, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=48, lora_rank=4
  )
  tokens = jnp.ones((1, 4), jnp.int32)
  mask = jnp.ones((1, 4), bool)
  positions = jnp.arange(4)[None]
  params = nn.unbox(Transformer(cfg).init(jax.random.PRNGKey(1), tokens, positions, mask)["params"])
  _save_run(root / "lora_run", cfg, params, None)
  return {"llama": root / "llama_run", "adapters": root / "lora_run"}


def _tree(root: pathlib.Path) -> dict[str, bytes | None]:
  """Every path under `root` with its bytes (None for a directory)."""
  return {str(p): p.read_bytes() if p.is_file() else None for p in root.rglob("*")}


def _error(capsys, *argv: str) -> str:
  """Runs the command line, which must exit with 2 and one `error:` line; returns that line."""
  capsys.readouterr()
  assert hf_convert.cli(list(argv)) == 2
  captured = capsys.readouterr()
  lines = captured.err.splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
  assert captured.out == ""
  return lines[0]


def test_export_never_writes_into_a_trainer_workdir(runs, tmp_path, capsys):
  """--out naming the run's own workdir is refused even with --overwrite (its config.json is
  the run record), as is another run's workdir; nothing in either changes."""
  workdir = shutil.copytree(runs["llama"], tmp_path / "run")  # the fixture's stays whole
  before = _tree(workdir)
  for extra in ([], ["--overwrite"]):
    line = _error(capsys, "export", f"--workdir={workdir}", f"--out={workdir}", *extra)
    assert f"--out={workdir}" in line and "trainer workdir" in line, line
    assert _tree(workdir) == before
  other = tmp_path / "other_run"
  (other / "checkpoints").mkdir(parents=True)
  line = _error(capsys, "export", f"--workdir={workdir}", f"--out={other}", "--overwrite")
  assert f"--out={other}" in line and "trainer workdir" in line, line
  assert [p.name for p in other.iterdir()] == ["checkpoints"]


def test_export_never_writes_over_the_checkpoint_it_reads(runs, tmp_path, capsys):
  """--out naming the run's source checkpoint (its model.checkpoint), or the --hf_source given:
  refused with --overwrite too, the source untouched (its weights are what the export carries
  over, and what adapters exported beside it would name as their base)."""
  record = json.loads((runs["llama"] / "config.json").read_text())
  src = pathlib.Path(record["config"]["model"]["checkpoint"])
  before = _tree(src)
  for extra in ([], [f"--hf_source={src}"]):
    line = _error(
      capsys, "export", f"--workdir={runs['llama']}", f"--out={src}", "--overwrite", *extra
    )
    assert line.startswith(
      f"error: --out={src}: is the Hugging Face checkpoint the export reads"
    ), line
  assert _tree(src) == before


def _refused_then_overwritten(runs, tmp_path, capsys, name: str, text: str):
  """--out holding only `name` (`text`): the llama run's export is refused naming the file and
  --overwrite, leaving it as it was; with --overwrite it succeeds. Returns --out."""
  out = tmp_path / "out"
  out.mkdir()
  (out / name).write_text(text)
  line = _error(capsys, "export", f"--workdir={runs['llama']}", f"--out={out}")
  assert f"{out / name}" in line and "--overwrite" in line, line
  assert [p.name for p in out.iterdir()] == [name] and (out / name).read_text() == text
  argv = ["export", f"--workdir={runs['llama']}", f"--out={out}", "--overwrite"]
  assert hf_convert.cli(argv) == 0
  return out


def test_export_replaces_a_file_it_writes_only_with_overwrite(runs, tmp_path, capsys):
  """A directory holding a config.json the export would replace is refused, naming the file
  and --overwrite, and kept; with --overwrite the export is written there and loads."""
  out = _refused_then_overwritten(runs, tmp_path, capsys, "config.json", '{"the user": "s"}')
  assert hf.load_checkpoint(out)[0] == hf.load_checkpoint(LLAMA)[0]


def test_an_export_leaves_no_older_tokenizer_file_beside_its_own(runs, tmp_path, capsys):
  """An older export's tokenizer file the new one does not write (added_tokens.json here; a
  chat_template.jinja beside a template kept in tokenizer_config.json alike) was left in --out,
  with --overwrite too, and loaders mixed it into the new tokenizer. Without --overwrite it is
  refused by name; with it, it is removed and the tokenizer loads as exported."""
  transformers = pytest.importorskip("transformers")
  stale = '{"<stale>": 9999}'
  out = _refused_then_overwritten(runs, tmp_path, capsys, "added_tokens.json", stale)
  assert not (out / "added_tokens.json").exists()
  assert (out / "chat_template.jinja").read_text() == (LLAMA / "chat_template.jinja").read_text()
  ours, theirs = (transformers.AutoTokenizer.from_pretrained(p) for p in (out, LLAMA))
  assert ours.get_vocab() == theirs.get_vocab() and "<stale>" not in ours.get_vocab()


def test_export_with_a_tokenizer_json_file_brings_the_files_beside_it(runs, tmp_path, caplog):
  """--tokenizer=DIR/tokenizer.json (a documented form) copied that file alone: transformers
  loaded the export with no eos, no pad token and no chat template. It now reads as DIR. A file
  of another name is exported alone with one warning naming what the export lacks."""
  transformers = pytest.importorskip("transformers")
  tok = shutil.copytree(LLAMA, tmp_path / "tok")
  out = tmp_path / "out"
  argv = ["export", f"--workdir={runs['llama']}", f"--out={out}", "--hf_source=none"]
  assert hf_convert.cli([*argv, f"--tokenizer={tok / 'tokenizer.json'}"]) == 0
  ours, theirs = (transformers.AutoTokenizer.from_pretrained(p) for p in (out, LLAMA))
  assert (ours.eos_token, ours.pad_token) == (theirs.eos_token, theirs.pad_token) != (None, None)
  assert ours.chat_template == theirs.chat_template is not None
  alone = shutil.copy(tok / "tokenizer.json", tmp_path / "mine.json")
  out = tmp_path / "out2"
  argv = ["export", f"--workdir={runs['llama']}", f"--out={out}", "--hf_source=none"]
  caplog.clear()
  assert hf_convert.cli([*argv, f"--tokenizer={alone}"]) == 0
  warned = [r.getMessage() for r in caplog.records if "exported alone" in r.getMessage()]
  assert len(warned) == 1 and "no tokenizer_config.json" in warned[0], warned
  assert transformers.AutoTokenizer.from_pretrained(out).chat_template is None


def test_refused_out_writes_no_adapters(runs, tmp_path, capsys):
  """An --out holding weights is refused before --adapters gets a file, and the message names
  the flag --overwrite (not the function argument overwrite=True)."""
  out, peft = tmp_path / "out", tmp_path / "peft"
  out.mkdir()
  (out / "model.safetensors").write_bytes(b"earlier weights")
  args = ["export", f"--workdir={runs['adapters']}", f"--out={out}", f"--adapters={peft}"]
  line = _error(capsys, *args)
  assert "already holds weights" in line and "--overwrite" in line, line
  assert "overwrite=True" not in line
  assert not peft.exists()
  assert (out / "model.safetensors").read_bytes() == b"earlier weights"


def test_adapters_holding_adapters_are_refused_before_anything_is_written(runs, tmp_path, capsys):
  """An --adapters directory holding adapters is refused naming --overwrite, before its base
  (a random-init run's) or --out is written."""
  out, peft = tmp_path / "out", tmp_path / "peft"
  peft.mkdir()
  (peft / "adapter_model.safetensors").write_bytes(b"earlier adapters")
  args = ["export", f"--workdir={runs['adapters']}", f"--out={out}", f"--adapters={peft}"]
  line = _error(capsys, *args)
  assert f"{peft / 'adapter_model.safetensors'}" in line and "--overwrite" in line, line
  assert "overwrite=True" not in line
  assert [p.name for p in peft.iterdir()] == ["adapter_model.safetensors"]
  assert not out.exists()


@pytest.mark.parametrize("where", ["same", "adapters-beside-weights", "out-beside-adapters"])
def test_merged_weights_and_adapters_in_one_folder_are_refused(runs, tmp_path, capsys, where):
  """--adapters equal to --out wrote the merged weights and the adapters into one folder, exit
  0: transformers loads it as the model with the adapters on top of weights that already hold
  them (the adapters counted twice). So would a folder of weights given as --adapters, or one
  holding adapter_config.json given as --out. Nothing is written."""
  out, peft = tmp_path / "out", tmp_path / "peft"
  if where == "same":
    peft = out
  elif where == "adapters-beside-weights":
    peft.mkdir()
    (peft / "model.safetensors").write_bytes(b"a merged export")
  else:
    out.mkdir()
    (out / "adapter_config.json").write_text("{}")
  before = {p: _tree(p) for p in (out, peft) if p.exists()}
  args = ["export", f"--workdir={runs['adapters']}", f"--out={out}", f"--adapters={peft}"]
  line = _error(capsys, *args, "--overwrite")
  assert "count twice" in line, line
  assert {p: _tree(p) for p in (out, peft) if p.exists()} == before


@pytest.mark.parametrize("value", [0, -5])
def test_max_shard_bytes_below_one_is_refused(runs, tmp_path, capsys, value):
  """--max_shard_bytes below 1 is one error line naming it; nothing is written."""
  out = tmp_path / "out"
  args = ["export", f"--workdir={runs['llama']}", f"--out={out}", f"--max_shard_bytes={value}"]
  line = _error(capsys, *args)
  assert f"--max_shard_bytes={value}" in line and "at least 1" in line, line
  assert not out.exists()


def test_a_file_given_for_a_directory_is_named_by_its_flag(runs, tmp_path, capsys):
  """A file given as --out or --adapters: one line naming the flag, not `File exists`, and
  nothing is written (no --out beside a refused --adapters)."""
  taken = tmp_path / "taken"
  taken.write_text("a file")
  line = _error(capsys, "export", f"--workdir={runs['llama']}", f"--out={taken}")
  assert line == f"error: --out={taken}: is a file, not a directory; name a directory", line
  out = tmp_path / "out"
  args = ["export", f"--workdir={runs['adapters']}", f"--out={out}", f"--adapters={taken}"]
  line = _error(capsys, *args)
  assert line == f"error: --adapters={taken}: is a file, not a directory; name a directory"
  assert not out.exists() and taken.read_text() == "a file"


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")
def test_an_out_that_cannot_be_made_is_named_by_its_flag(runs, tmp_path, capsys):
  """An --out in a place where no directory can be made (/proc, writable to the checks that
  create nothing) was a bare `[Errno 2] No such file or directory`; one line names --out. A
  directory that can be made is not left behind by the check."""
  line = _error(capsys, "export", f"--workdir={runs['llama']}", "--out=/proc/ex")
  assert line.startswith("error: --out=/proc/ex: cannot be made (") and "traceback" not in line
  line = _error(capsys, "import", f"--hf_dir={LLAMA}", "--out=/proc/ex/sub")
  assert line.startswith("error: --out=/proc/ex/sub: cannot be made ("), line
  hf_convert._check_dir_flag("--out", str(tmp_path / "a" / "b"))
  assert not (tmp_path / "a").exists()


def test_a_destination_under_a_file_is_refused_the_same_way_by_import_and_import_gguf(
  tmp_path, capsys
):
  """An --out or OUT_DIR whose parent is a file: one line from the shared check
  (`paths.dir_problem`) naming the file in the way, before any input is read."""
  (tmp_path / "file").write_text("x")
  under = tmp_path / "file" / "sub"
  why = f"cannot be made: {tmp_path / 'file'} is a file, not a directory"
  line = _error(capsys, "import", f"--hf_dir={LLAMA}", f"--out={under}")
  assert line == f"error: --out={under}: {why}; name a directory", line
  line = _error(capsys, "import-gguf", str(tmp_path / "absent.gguf"), str(under))
  assert line == f"error: {under}: {why}; choose a new directory", line
  assert (tmp_path / "file").read_text() == "x"


def test_import_of_a_trainer_workdir_points_to_export(runs, tmp_path, capsys):
  """`import --hf_dir=<trainer workdir>` says what the directory is and which sub-command
  reads it (not that model_type=None is unsupported)."""
  workdir = runs["llama"]
  line = _error(capsys, "import", f"--hf_dir={workdir}", f"--out={tmp_path / 'o'}")
  assert f"--hf_dir={workdir}" in line and "trainer workdir" in line, line
  assert f"export --workdir={workdir}" in line, line
  assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("value", [0, -1])
def test_save_checkpoint_refuses_max_shard_bytes_below_one(tmp_path, value):
  """`hf_export.save_checkpoint(max_shard_bytes < 1)` is a ValueError naming it, with nothing
  written (it wrote every tensor in a shard of its own)."""
  cfg, params = hf.load_checkpoint(LLAMA)
  with pytest.raises(ValueError, match=f"max_shard_bytes={value} must be an int >= 1"):
    hf_export.save_checkpoint(tmp_path / "out", cfg, params, max_shard_bytes=value)
  assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text", ['{"x":', '{"prompt": "q", "answer": "1"}'])
def test_a_tokenizer_file_that_does_not_parse_is_refused_before_writing(
  runs, tmp_path, capsys, text
):
  """--tokenizer=FILE was copied as tokenizer.json whatever it held (a truncated JSON, a line of
  prompt data), exit 0; the trainer then refused the export."""
  bad = tmp_path / "tok.json"
  bad.write_text(text)
  out = tmp_path / "out"
  line = _error(
    capsys, "export", f"--workdir={runs['llama']}", f"--out={out}", f"--tokenizer={bad}"
  )
  assert line.startswith(f"error: {bad} is not a valid tokenizer.json: "), line
  assert not out.exists()


@pytest.mark.parametrize("name", ["tokenizer_config.json", "config.json"])
def test_an_export_over_a_folder_where_it_writes_a_file_is_refused_before_writing(tmp_path, name):
  """An --overwrite export into a folder where a folder stood at one of its file names: the
  weights moved in, then writing that file failed, and the folder held the new weights beside
  the old config.json (a checkpoint no loader reads). Now refused before anything is written."""
  cfg, params = hf.load_checkpoint(LLAMA)
  out = pathlib.Path(shutil.copytree(REPO / "tests" / "fixtures" / "hf" / "qwen2", tmp_path / "o"))
  if name == "config.json":
    os.rename(out / name, tmp_path / "kept.json")
  (out / name).mkdir(exist_ok=name != "config.json")
  before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
  with pytest.raises(IsADirectoryError) as e:
    hf_export.save_checkpoint(out, cfg, params, overwrite=True, source=LLAMA)
  assert str(e.value) == (
    f"{out / name}: is not a file, and the export writes a file there; move it away or give "
    "another directory"
  )
  assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
  os.rmdir(out / name)  # the export then writes every file, none left behind
  hf_export.save_checkpoint(out, cfg, params, overwrite=True, source=LLAMA)
  assert not [p.name for p in out.iterdir() if p.name.startswith(".")]
  assert hf.load_checkpoint(out)[0] == cfg


def test_an_export_that_fails_while_staging_its_files_leaves_none_behind(tmp_path, monkeypatch):
  """A full disk while the tokenizer was staged: the files staged before it stayed in the
  folder as .<name>.tmp (the cleanup saw none), beside the older export, which stays whole."""
  cfg, params = hf.load_checkpoint(LLAMA)
  out = pathlib.Path(shutil.copytree(REPO / "tests" / "fixtures" / "hf" / "qwen2", tmp_path / "o"))
  before = {p.name: p.read_bytes() for p in out.iterdir()}

  def full_disk(src, dst):
    pathlib.Path(dst).write_bytes(b"half")
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(hf_export.shutil, "copyfile", full_disk)
  with pytest.raises(OSError, match="No space left"):
    hf_export.save_checkpoint(out, cfg, params, overwrite=True, source=LLAMA)
  assert {p.name: p.read_bytes() for p in out.iterdir()} == before
