"""tools/export_runs.py refuses bad input before writing anything: a run with no TensorBoard
scalars (a folder the tool itself wrote, a garbage events file), a config.json that is not the
trainer's run record, an --out that is a file, inside --root or with a file on the way to one
run's folder. Each refusal is one `error:` line and exit 2, and nothing under --out is written
or changed; a failed write removes what it made. No training: runs are written here."""

import json
import pathlib
import shutil
import sys

import pytest
from conftest import REPO

from jaxrl_llm import metrics

sys.path.insert(0, str(REPO / "tools"))
import export_runs

CONFIG = REPO / "docs" / "cpu_runs" / "smollm2_calc" / "calc_s1" / "config.json"


def _run(folder, events=True):
  """A run folder: the trainer's config.json and, with `events`, two steps of scalars."""
  folder.mkdir(parents=True)
  shutil.copy(CONFIG, folder / "config.json")
  if events:
    with metrics.SummaryWriter(str(folder)) as w:
      for step in (0, 1):
        w.scalars(step, {"eval/accuracy": 0.5 + step / 10})
  return folder


def _export(capsys, root, out):
  """(exit code, stderr lines) of the tool's main over --root/--out."""
  code = export_runs.main([f"--root={root}", f"--out={out}"])
  return code, capsys.readouterr().err.strip().splitlines()


def _refused(code, err, *names):
  assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
  assert all(str(n) in err[0] for n in names), err


def _tree(folder):
  """{relative path: bytes} of every file under `folder`."""
  return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_an_export_is_refused_as_a_root(capsys, tmp_path):
  _run(tmp_path / "root" / "a")
  out = tmp_path / "out"
  assert _export(capsys, tmp_path / "root", out)[0] == 0
  code, err = _export(capsys, out, tmp_path / "again")  # its runs: scalars.json, no events
  _refused(code, err, out / "a", "no TensorBoard scalars", "an export already")
  assert not (tmp_path / "again").exists()


def test_a_run_without_readable_events_is_refused(capsys, tmp_path):
  root = tmp_path / "root"
  _run(root / "a")
  (_run(root / "b", events=False) / "events.out.tfevents.1.host").write_bytes(b"garbage")
  code, err = _export(capsys, root, tmp_path / "out")
  _refused(code, err, root / "b", "no TensorBoard scalars")
  assert not (tmp_path / "out").exists()
  _run(root / "c", events=False)  # no event files at all
  (root / "b").rename(tmp_path / "b")
  code, err = _export(capsys, root, tmp_path / "out")
  _refused(code, err, root / "c", "no event files")
  assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
  "text", ["{not json", '{"step": 0}', '["config"]', '{"config": 3}', b"\xff\xfe"]
)
def test_a_config_that_is_not_a_run_record_is_refused(capsys, tmp_path, text):
  root = tmp_path / "root"
  _run(root / "a")
  config = _run(root / "b") / "config.json"
  config.write_bytes(text if isinstance(text, bytes) else text.encode())
  code, err = _export(capsys, root, tmp_path / "out")
  _refused(code, err, config)
  assert not (tmp_path / "out").exists()


def test_an_out_that_is_a_file_is_refused(capsys, tmp_path):
  _run(tmp_path / "root" / "a")
  out = tmp_path / "out"
  out.write_text("kept\n")
  _refused(*_export(capsys, tmp_path / "root", out), out, "is a file")
  assert out.read_text() == "kept\n"


def test_an_out_inside_the_root_is_refused(capsys, tmp_path):
  root = tmp_path / "root"
  _run(root / "a")
  before = _tree(root)
  _refused(*_export(capsys, root, root / "export"), root / "export", "inside --root")
  assert _tree(root) == before and not (root / "export").exists()


def test_every_destination_is_checked_before_any_is_written(capsys, tmp_path):
  root, out = tmp_path / "root", tmp_path / "out"
  _run(root / "a")
  _run(root / "z" / "r")
  out.mkdir()
  (out / "z").write_text("kept\n")  # OUT/a is free, OUT/z/r is not
  _refused(*_export(capsys, root, out), out / "z", "is a file")
  assert _tree(out) == {"z": b"kept\n"} and not (out / "a").exists()
  (out / "z").unlink()
  assert _export(capsys, root, out)[0] == 0  # once free: both runs, whole, no temporary folder
  files = ("config.json", "scalars.json", "samples.jsonl")
  assert set(_tree(out)) == {f"{run}/{f}" for run in ("a", "z/r") for f in files}
  assert json.loads((out / "z" / "r" / "scalars.json").read_text())["eval/accuracy"][0][0] == 0


def test_a_failed_write_removes_what_it_made(capsys, tmp_path, monkeypatch):
  root, out = tmp_path / "root", tmp_path / "out"
  _run(root / "a")
  _run(root / "z" / "r")

  def full(path, *args, **kwargs):  # the disk fills while the second run is written
    if "w" in args[:1] and str(path).startswith(str(out / "z")):
      raise OSError(28, "No space left on device")
    return open(path, *args, **kwargs)

  monkeypatch.setattr(export_runs, "open", full, raising=False)
  code, err = _export(capsys, root, out)
  _refused(code, err, out, "No space left")
  assert not out.exists()


def test_a_root_that_is_itself_a_run_is_exported_under_its_folder_name(capsys, tmp_path):
  """--root=a single workdir: its run's name was "." and the write failed with a message
  blaming OUT (and an existing OUT was refused as "." being there already)."""
  run = _run(tmp_path / "w")
  _run(run / "inner")
  out = tmp_path / "out"
  out.mkdir()  # an existing, empty OUT
  code, err = _export(capsys, run, out)
  assert (code, err) == (0, [])
  files = ("config.json", "samples.jsonl", "scalars.json")
  assert sorted(_tree(out)) == sorted([f"w/{f}" for f in files] + [f"w/inner/{f}" for f in files])
  scalars = json.loads((out / "w" / "scalars.json").read_text())["eval/accuracy"]
  assert [step for step, _ in scalars] == [0, 1]


def test_a_relative_out_is_exported(capsys, tmp_path, monkeypatch):
  """A relative --out (as the tool's own --help shows) spun forever looking for a parent of
  "" and wrote nothing."""
  _run(tmp_path / "root" / "a")
  monkeypatch.chdir(tmp_path)
  code, err = _export(capsys, "root", "exported/here")
  assert (code, err) == (0, [])
  assert sorted(_tree(tmp_path / "exported" / "here")) == [
    "a/config.json", "a/samples.jsonl", "a/scalars.json"
  ]  # fmt: skip


def test_a_resumed_runs_records_are_exported_and_read_as_the_run_read_them(capsys, tmp_path):
  """A run resumed under other settings holds config.resume-<step>.json beside config.json:
  the export copied config.json alone, so a table made from the export grouped the run by its
  first launch's settings. Each record is copied as written; the newest is the export's."""
  from jaxrl_llm.run import changes

  run = _run(tmp_path / "root" / "r")
  record = json.loads(CONFIG.read_text())
  record["config"]["train"]["num_steps"] = 120
  (run / "config.resume-1.json").write_text(json.dumps(record))
  code, err = _export(capsys, tmp_path / "root", tmp_path / "out")
  assert (code, err) == (0, [])
  exported = tmp_path / "out" / "r"
  assert (exported / "config.resume-1.json").read_bytes() == (
    run / "config.resume-1.json"
  ).read_bytes()
  newest = json.loads(pathlib.Path(changes.newest_record_path(str(exported))).read_text())
  assert newest["config"]["train"]["num_steps"] == 120


def test_an_empty_out_or_root_is_refused(capsys, tmp_path, monkeypatch):
  """--out= exported every run into the current folder (the repository, run from there)."""
  _run(tmp_path / "root" / "a")
  monkeypatch.chdir(tmp_path)
  before = sorted(p.name for p in tmp_path.iterdir())
  for flag, args in (("--out", (tmp_path / "root", "")), ("--root", ("", tmp_path / "out"))):
    code, err = _export(capsys, *args)
    assert (code, err) == (2, [f"error: {flag}= is empty; name a folder"])
  assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_root_that_is_no_folder_is_named_so(capsys, tmp_path):
  """A --root that is a file or missing said "no runs (config.json) under it"."""
  (tmp_path / "file").write_text("")
  for root in (tmp_path / "file", tmp_path / "none"):
    code, err = _export(capsys, root, tmp_path / "out")
    assert (code, err) == (
      2,
      [f"error: --root={root}: not a directory; give the folder holding the runs"],
    )
  assert not (tmp_path / "out").exists()
