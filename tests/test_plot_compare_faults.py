"""tools/plot.py and tools/compare.py on bad input: one `error:` line, exit status 2, no
traceback, and an existing output file left as it was. Tiny synthetic runs, no training."""

import json
import sys

import pytest
from conftest import REPO

from jaxrl_llm import metrics

sys.path.insert(0, str(REPO / "tools"))
import compare
import plot

KEEP = b"saved before"


def _write_run(workdir, clip, seed, nan=False):
  """A run of 4 steps with config.json; eval/pass@2 and eval/sample_accuracy at steps 0 and 3."""
  with metrics.SummaryWriter(str(workdir)) as w:
    for step in range(4):
      acc = float("nan") if nan and step == 2 else clip + 0.1 * seed + 0.01 * step
      w.scalars(step, {"eval/accuracy": acc})
      if step in (0, 3):
        w.scalars(step, {"eval/sample_accuracy": acc, "eval/pass@2": acc + 0.1})
  config = {"objective": {"clip_high": clip}, "seed": seed}
  (workdir / "config.json").write_text(json.dumps({"config": config, "step": 0}))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
  """2 arms (clip_high 0.2, 0.28) x 2 seeds."""
  root = tmp_path_factory.mktemp("runs")
  for clip in (0.2, 0.28):
    for seed in (0, 1):
      _write_run(root / f"c{clip}_s{seed}", clip, seed)
  return root


def _one_error(capsys, status, *words):
  err = capsys.readouterr().err
  assert status == 2, err
  assert len(err.splitlines()) == 1 and err.startswith("error: "), err
  for word in words:
    assert word in err, err
  return err


def _bad_root(tmp_path, kind):
  """A copy of one run whose settings or event files are broken as `kind` says."""
  bad = tmp_path / "bad"
  for clip, seed in ((0.2, 0), (0.2, 1), (0.28, 0)):
    _write_run(bad / f"c{clip}_s{seed}", clip, seed)
  run = bad / "c0.28_s0"
  if kind == "truncated config":
    (run / "config.json").write_text('{"config": {"seed": 0')
  elif kind == "config not the trainer's":
    (run / "config.json").write_text("[1, 2]")
  elif kind in ("empty events", "garbage events"):
    bad = tmp_path / "events"
    (bad / "r").mkdir(parents=True)
    text = "" if kind == "empty events" else "garbage, not an event file\n"
    (bad / "r" / "events.out.tfevents.1.x").write_text(text)
  return bad


@pytest.mark.parametrize(
  "args, words",
  [
    (["curves", "{bad:truncated config}"], ["c0.28_s0/config.json: not valid JSON", '"config"']),
    (["curves", "{bad:config not the trainer's}"], ["c0.28_s0/config.json: not the trainer's"]),
    (["curves", "{bad:empty events}"], ["r: its event files hold no scalars (empty or unread"]),
    (["curves", "{bad:garbage events}"], ["r: its event files hold no scalars"]),
    (["curves", "{root}", "--size=700x0.01"], ["70000x1 pixels", "limit is 65536 a side"]),
    (["curves", "{root}", "--dpi=0"], ["--dpi=0: must be a positive"]),
    (["heatmap", "{root}", "--x=clip_high", "--dpi=-3"], ["--dpi=-3: must be a positive"]),
    (["curves", "{root}", "--cols=0"], ["--cols=0: must be a positive"]),
    (["curves", "{root}", "--cols=-2"], ["--cols=-2: must be a positive"]),
    (["curves", "{root}", "--out={tmp}/p.xyz"], ["unknown format .xyz; give one of", ".png"]),
    (["curves", "{root}", "--out={tmp}/noext"], ["no file extension; give one of", ".pdf"]),
    (["curves", "{root}", "--out={tmp}"], ["is a directory; give a file path"]),
    (["curves", "{root}", "--out="], ["--out= is empty; name an image file (default: curves.png)"]),
    (["curves", "{root}", "--group_by="], ["--group_by=: give each field once (comma-separated)"]),
    (["passk", "{root}", "--group_by=a,a"], ["--group_by=a,a: give each field once"]),
    (["curves", "{root}", "--out=gs://bucket/c.png"], ["is a URL; give a local file path"]),
    (["passk", "{root}", "--out={tmp}/keep.png/x.png"], ["keep.png is a file, not a directory"]),
    (["curves", "{root}", "--out=/proc/no/c.png"], ["cannot make its folder /proc/no: "]),
    (["passk", "{root}", "--step=2"], ["--step=2: no eval/pass@k logged there; eval steps: 0, 3"]),
    (["curves", "{tmp}/keep.png"], ["keep.png: a file, not a directory; give a run's workdir"]),
    (["curves", "{tmp}/none"], ["none: no such directory; give a run's workdir or a sweep's"]),
  ],
)
def test_plot_bad_input_is_one_error_line(root, tmp_path, capsys, args, words):
  keep = tmp_path / "keep.png"
  keep.write_bytes(KEEP)
  argv = []
  for a in args:
    if a.startswith("{bad:"):
      a = str(_bad_root(tmp_path, a[5:-1]))
    argv.append(a.format(root=root, tmp=tmp_path))
  if not any(a.startswith("--out=") for a in argv):
    argv.append(f"--out={keep}")
  _one_error(capsys, plot.main(argv), *words)
  assert keep.read_bytes() == KEEP
  assert sorted(p.name for p in tmp_path.iterdir() if p.suffix) == ["keep.png"]  # nothing written


def test_plot_pass_at_1_alone_says_it_makes_no_curve(tmp_path, capsys):
  with metrics.SummaryWriter(str(tmp_path / "r")) as w:
    w.scalars(0, {"eval/pass@1": 0.5, "eval/sample_accuracy": 0.5})
  _one_error(capsys, plot.main(["passk", str(tmp_path / "r"), "--out=x.png"]), "pass@1 alone")


def test_plot_size_limit_counts_all_pixels():
  plot._check_pixels(100, 100, 100, "ok")  # 10000 x 10000 pixels
  with pytest.raises(plot.PlotError, match=r"20000x20000 pixels; the limit is .* 268435456"):
    plot._check_pixels(200, 200, 100, "--size=200x200")


def test_plot_warns_once_of_nan_values(tmp_path, capsys):
  _write_run(tmp_path / "r", 0.2, 0, nan=True)
  out = tmp_path / "c.png"
  assert plot.main(["curves", str(tmp_path / "r"), f"--out={out}", "--dpi=20"]) == 0
  err = capsys.readouterr().err
  assert err == "warning: r: eval/accuracy is nan at step 2; not drawn there\n", err  # its folder
  assert out.exists()


@pytest.mark.parametrize(
  "args, words",
  [
    (["--root={empty}"], ["no TensorBoard event files under"]),
    (["--root={bad:empty events}"], ["events/r: its event files hold no scalars (empty or un"]),
    (["--root={bad:garbage events}"], ["events/r: its event files hold no scalars"]),
    (["--root={root}", "--tags=,"], ["--tags=',' is empty"]),
    (["--root={root}", "--sort="], ["--sort='' is empty; give a value or leave it out"]),
    (["--root={root}", "--minimize=,"], ["--minimize=',' is empty; give a value or"]),
    (["--root={root}", "--maximize="], ["--maximize='' is empty; give a value or"]),
    (
      ["--root={root}", "--tags=eval/*", "--minimize=loss/*"],
      ["--minimize pattern 'loss/*' matches none", "eval/"],
    ),
    (
      ["--root={root}", "--tags=eval/*", "--maximize=eval/acc"],
      ["--maximize pattern 'eval/acc' matches none"],
    ),
  ],
)
def test_compare_bad_input_is_one_error_line(root, tmp_path, capsys, args, words):
  keep = tmp_path / "keep.csv"
  keep.write_bytes(KEEP)
  (tmp_path / "empty").mkdir()
  argv = []
  for a in args:
    if "{bad:" in a:
      a = a.replace(a[a.index("{bad:") :], str(_bad_root(tmp_path, a[a.index("{bad:") + 5 : -1])))
    argv.append(a.format(root=root, empty=tmp_path / "empty"))
  _one_error(capsys, compare.main([*argv, f"--csv={keep}"]), *words)
  assert keep.read_bytes() == KEEP


@pytest.mark.parametrize(
  "where, says",
  [
    ("{root}/a/config.json", "inside the run folder {root}/a under --root="),
    ("{root}/a/table.csv", "inside the run folder {root}/a under --root="),
    ("{root}/a/new/table.csv", "inside the run folder {root}/a under --root="),
    ("{root}/a/checkpoints/t.csv", "inside the run folder {root}/a under --root="),
    ("{tmp}/notes.md", "is an existing file that is not a .csv table"),
    ("{root}/config.json", "is an existing file that is not a .csv table"),  # root is a run
  ],
)
def test_compare_csv_never_overwrites_a_runs_files(tmp_path, capsys, where, says):
  """--csv overwrote whatever was there, a run's own config.json among them; a table inside a
  run's folder, or over a file that is not a .csv table, is refused before a run is read."""
  root = tmp_path / "runs"
  _write_run(root / "a", 0.2, 0)
  _write_run(root, 0.28, 0)  # the root is itself a run, with a nested one
  (root / "a" / "checkpoints").mkdir()
  (tmp_path / "notes.md").write_bytes(KEEP)
  before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
  out = where.format(root=root, tmp=tmp_path)
  err = _one_error(capsys, compare.main([f"--root={root}", f"--csv={out}"]))
  assert err.startswith(f"error: --csv={out}: {says.format(root=root)}"), err
  assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_compare_csv_at_the_roots_top_level_or_over_a_table_is_written(tmp_path, capsys):
  """A table at the root's top level (a run's root too), and one written again over itself or
  over another .csv table, stay allowed."""
  root = tmp_path / "runs"
  _write_run(root / "a", 0.2, 0)
  (tmp_path / "keep.csv").write_bytes(KEEP)
  for out in (root / "table.csv", root / "table.csv", tmp_path / "keep.csv", root / "a" / "t.csv"):
    where = root / "a" if out.parent == root / "a" else root  # a run alone: its own root
    argv = [f"--root={where}", "--tags=eval/*", f"--csv={out}"]
    assert compare.main(argv) == 0, capsys.readouterr().err
    assert out.read_text().startswith("run,")


def test_compare_and_plot_warn_of_a_run_whose_events_do_not_read_beside_runs_that_do(
  root, tmp_path, capsys
):
  """A run whose event file is garbage, beside readable runs, was a blank row with exit 0 and
  nothing said (seed_table.py refuses the same root); plot.py drew its arm without it."""
  mixed = tmp_path / "mixed"
  _write_run(mixed / "a", 0.2, 0)
  (mixed / "b").mkdir()
  (mixed / "b" / "events.out.tfevents.1.x").write_text("garbage, not an event file\n")
  assert compare.main([f"--root={mixed}", "--tags=eval/accuracy"]) == 0
  out, err = capsys.readouterr()
  assert err == (
    f"warning: {mixed / 'b'}: its event files hold no scalars (empty or unreadable); its row "
    "is blank\n"
  )
  assert [line.split()[0] for line in out.splitlines()[-2:]] == ["a", "b"], out
  png = tmp_path / "c.png"
  assert plot.main(["curves", str(mixed), f"--out={png}", "--dpi=20"]) == 0
  err = capsys.readouterr().err
  assert f"warning: {mixed / 'b'}: its event files hold no scalars" in err and png.exists(), err


sys.path.insert(0, str(REPO / "experiments"))
import seed_table  # noqa: E402


def _seed_table(root, out):
  """seed_table's exit status over `root`'s arms of clip_high, writing --csv=`out`."""
  cols = "--cols=eval/accuracy@final"
  argv = [f"--root={root}", "--group_by=objective.clip_high", cols, f"--csv={out}"]
  try:
    return seed_table.main(argv)
  except SystemExit as e:
    return e.code


WRITERS = {  # the three tools that write a file a user names: {tool: (extension, run)}
  "compare --csv": (
    "csv",
    lambda root, out: compare.main([f"--root={root}", "--tags=eval/*", f"--csv={out}"]),
  ),
  "seed_table --csv": ("csv", _seed_table),
  "plot --out": ("png", lambda root, out: plot.main(["curves", str(root), f"--out={out}"])),
}


@pytest.mark.parametrize("tool", list(WRITERS))
@pytest.mark.parametrize(
  "where, words",
  [
    ("{tmp}", "is a directory; give a file path"),
    ("{tmp}/keep.{ext}/x.{ext}", "keep.{ext} is a file, not a directory"),
    ("gs://bucket/x.{ext}", "is a URL; give a local file path"),
  ],
)
def test_every_output_path_is_checked_alike(root, tmp_path, capsys, tool, where, words):
  """compare's and seed_table's --csv and plot's --out refuse the same bad paths with the same
  words (`paths.file_problem`) before reading a run; a file there is left as it was."""
  ext, run = WRITERS[tool]
  keep = tmp_path / f"keep.{ext}"
  keep.write_bytes(KEEP)
  out = where.format(tmp=tmp_path, ext=ext)
  _one_error(capsys, run(root, out), words.format(ext=ext))
  assert keep.read_bytes() == KEEP and sorted(p.name for p in tmp_path.iterdir()) == [keep.name]


@pytest.mark.parametrize("tool", list(WRITERS))
def test_every_output_makes_its_missing_folders(root, tmp_path, capsys, tool):
  """A --csv or --out in folders that do not exist yet is written there (compare and
  seed_table refused it), and written again over itself."""
  ext, run = WRITERS[tool]
  out = tmp_path / "new" / "deeper" / f"table.{ext}"
  for _ in range(2):
    assert run(root, str(out)) == 0, capsys.readouterr().err
    assert out.stat().st_size > 0
  assert sorted(p.name for p in out.parent.iterdir()) == [out.name]  # no temporary file left


@pytest.mark.parametrize(
  "name",
  ["events.out.tfevents.1700000000.host.1.0", "events.out.tfevents.1.h.v2", "x.tfevents.bak",
   "run.tfevents", "events.out.tfevent.1", "config.json", "scalars.json", "tfevents"],
)  # fmt: skip
def test_event_files_are_those_tensorboard_reads(name):
  """Every tool's test for an event file is TensorBoard's reader's own rule."""
  from tensorboard.backend.event_processing import io_wrapper

  from jaxrl_llm import metric_info

  assert metric_info.is_event_file(name) == io_wrapper.IsTensorFlowEventsFile(name)
  assert metric_info.is_event_file(f"/some/dir/{name}") == io_wrapper.IsTensorFlowEventsFile(
    f"/some/dir/{name}"
  )


def test_the_writers_event_files_are_found(tmp_path):
  """The trainer's own event files carry the prefix and are found by the run finders."""
  from jaxrl_llm import metric_info

  _write_run(tmp_path / "r", 0.2, 0)
  names = [p.name for p in (tmp_path / "r").iterdir() if p.name != "config.json"]
  assert names and all(n.startswith(metric_info.EVENT_FILE_PREFIX) for n in names)
  assert compare.find_runs(str(tmp_path)) == [str(tmp_path / "r")]


def _damage_the_middle(workdir):
  """Flips a byte in the middle record of `workdir`'s event file; returns (file, its size)."""
  (path,) = [p for p in workdir.iterdir() if metrics.metric_info.is_event_file(p.name)]
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0xFF
  path.write_bytes(bytes(data))
  return path, len(data)


def test_an_event_file_damaged_inside_is_named_not_read_as_a_shorter_run(root, tmp_path, capsys):
  """A flipped byte in a run's event file: TensorBoard's reader stopped at that record without
  a word, so the run was read as a shorter one (its @final an earlier step's, a seed dropped
  from a later step, its export cut short). seed_table.py and export_runs.py refuse it naming
  the file and byte; compare.py and plot.py warn of it and show what precedes the damage."""
  import export_runs

  runs = tmp_path / "runs"
  for seed in (0, 1, 2):
    _write_run(runs / f"s{seed}", 0.2, seed)
  path, size = _damage_the_middle(runs / "s1")
  assert len(metrics.read_scalars(str(runs / "s1"), damaged_ok=True)["eval/accuracy"]) < 4
  with pytest.raises(SystemExit) as e:
    seed_table.main([f"--root={runs}", "--group_by=objective.clip_high", "--cols=eval/accuracy@2"])
  err = capsys.readouterr().err
  assert e.value.code == 2 and err.startswith(f"error: run {runs / 's1'}: {path}: damaged at byte ")
  assert f" of {size} (a record does not match its checksum)" in err, err
  assert export_runs.main([f"--root={runs}", f"--out={tmp_path / 'out'}"]) == 2
  assert f"{path}: damaged at byte " in capsys.readouterr().err
  assert not (tmp_path / "out").exists()
  assert compare.main([f"--root={runs}", "--tags=eval/accuracy"]) == 0
  err = capsys.readouterr().err
  assert err.startswith(f"warning: {path}: damaged at byte ") and "not shown" in err, err


def test_a_folder_named_like_an_event_file_is_one_line_in_every_reader(tmp_path, capsys):
  """A folder `events.out.tfevents.*` inside a run (a copy gone wrong): TensorBoard's reader
  failed on it with an IsADirectoryError traceback in compare.py, plot.py and seed_table.py.
  Each now says in one line which folder it is; the runs are left as they were."""
  import export_runs

  runs = tmp_path / "runs"
  for seed in (0, 1, 2):
    _write_run(runs / f"s{seed}", 0.2, seed)
  folder = runs / "s1" / "events.out.tfevents.1.copy"
  folder.mkdir()
  said = f"{folder}: a folder named like an event file"
  _one_error(capsys, compare.main([f"--root={runs}", "--tags=eval/accuracy"]), said)
  out = tmp_path / "p.png"
  _one_error(capsys, plot.main(["curves", str(runs), f"--out={out}", "--dpi=20"]), said)
  assert not out.exists()
  with pytest.raises(SystemExit) as e:
    seed_table.main([f"--root={runs}", "--group_by=objective.clip_high", "--cols=eval/accuracy@2"])
  _one_error(capsys, e.value.code, said)
  _one_error(capsys, export_runs.main([f"--root={runs}", f"--out={tmp_path / 'out'}"]), said)
  assert folder.is_dir() and len(metrics.read_scalars(str(runs / "s0"))["eval/accuracy"]) == 4


def test_plot_passk_refuses_runs_evaluated_at_other_steps(tmp_path, capsys):
  """A run that stopped early (its last pass@k at step 0, the others' at 3): its step-0 curve
  was averaged with the others' step-3 ones; with --step=3 its arm was drawn without it (a NaN
  mean) under a legend still counting it."""
  runs = tmp_path / "runs"
  for clip in (0.2, 0.28):
    for seed in (0, 1):
      _write_run(runs / f"c{clip}_s{seed}", clip, seed)
  short = runs / "c0.28_s2"
  with metrics.SummaryWriter(str(short)) as w:
    w.scalars(0, {"eval/accuracy": 0.3, "eval/sample_accuracy": 0.3, "eval/pass@2": 0.4})
  config = {"objective": {"clip_high": 0.28}, "seed": 2}
  (short / "config.json").write_text(json.dumps({"config": config, "step": 0}))
  png = tmp_path / "p.png"
  _one_error(
    capsys, plot.main(["passk", str(runs), f"--out={png}"]), "c0.28_s2's last", "at step 0"
  )
  _one_error(
    capsys, plot.main(["passk", str(runs), "--step=3", f"--out={png}"]), "c0.28_s2: no", "step 3"
  )
  assert not png.exists()
  assert plot.main(["passk", str(runs), "--step=0", f"--out={png}", "--dpi=20"]) == 0
  assert png.exists()


def test_plot_passk_reads_each_arm_at_its_end_and_names_a_nan(tmp_path, capsys):
  """Arms of other lengths (0.28's seeds evaluated last at step 5, 0.2's at 3) each give their
  own last evaluation (they were refused as runs that stopped early); a NaN pass@k of one seed
  is named (it was dropped from a mean still labelled with every seed)."""
  runs = tmp_path / "runs"
  for seed in (0, 1):
    _write_run(runs / f"c0.2_s{seed}", 0.2, seed)
    longer = runs / f"c0.28_s{seed}"
    _write_run(longer, 0.28, seed)
    with metrics.SummaryWriter(str(longer)) as w:
      w.scalars(5, {"eval/sample_accuracy": 0.5 + seed, "eval/pass@2": 0.7 + seed})
  loaded, grid = plot.load_runs([str(runs)])
  _, curves = plot.passk_data(loaded, grid_fields=grid)
  means = {c.arm.label: c.mean.tolist() for c in curves}
  assert means == {
    "clip_high=0.2": pytest.approx([0.28, 0.38]),
    "clip_high=0.28": pytest.approx([1.0, 1.2]),
  }, means
  third = runs / "c0.2_s2"
  with metrics.SummaryWriter(str(third)) as w:
    w.scalars(3, {"eval/sample_accuracy": 0.3, "eval/pass@2": float("nan")})
  (third / "config.json").write_text(
    json.dumps({"config": {"objective": {"clip_high": 0.2}, "seed": 2}})
  )
  png = tmp_path / "p.png"
  _one_error(capsys, plot.main(["passk", str(runs), f"--out={png}"]), "eval/pass@2 is nan", "")
  assert not png.exists()


def test_compare_names_a_single_runs_row_by_its_folder(root, capsys):
  """`--root` at one run's workdir: its row is named by the folder (it was `.`)."""
  assert compare.main([f"--root={root / 'c0.2_s1'}", "--tags=eval/accuracy"]) == 0
  rows = capsys.readouterr().out.splitlines()
  assert [r.split()[0] for r in rows if r.split() and r.split()[0].startswith("c0")] == ["c0.2_s1"]


def _extend(workdir, steps, at=3):
  """Records that `workdir`'s run was resumed at step `at` to `steps` steps (as the trainer does
  for a launch with changed settings: config.resume-<at>.json, and its sweep's run.json) and
  logs eval/accuracy at the steps after `at`."""
  record = json.loads((workdir / "config.json").read_text())
  record["config"]["train"] = {"num_steps": steps}
  (workdir / f"config.resume-{at}.json").write_text(json.dumps({**record, "step": at}))
  (workdir / "run.json").write_text(json.dumps({"overrides": {"train.num_steps": steps}}))
  with metrics.SummaryWriter(str(workdir)) as w:
    for step in range(at + 1, steps + 1):
      w.scalars(step, {"eval/accuracy": 0.5 + 0.01 * step})


def test_plot_and_seed_table_read_a_resumed_runs_newest_record(tmp_path, capsys):
  """Seeds 0 and 1 ran 3 steps and were resumed to 6 (config.resume-3.json), seed 2 ran 6
  from the start: one arm of three seeds. Both tools read the first launch's config.json, so
  plot drew two arms (num_steps=3 of seeds 0,1, which ran 6 steps) and warned that config.json
  and run.json disagree; seed_table split the arm as well."""
  from jaxrl_llm.run import changes

  runs = tmp_path / "runs"
  for seed in (0, 1, 2):
    _write_run(runs / f"s{seed}", 0.2, seed)
    record = json.loads((runs / f"s{seed}" / "config.json").read_text())
    record["config"]["train"] = {"num_steps": 3}
    (runs / f"s{seed}" / "config.json").write_text(json.dumps(record))
    _extend(runs / f"s{seed}", 6)
  (runs / "s2" / "config.resume-3.json").rename(runs / "s2" / "config.json")  # 6 from the start
  (runs / "s0" / "config.resume-2.json").write_text("{}")  # older than resume-3: not read
  (runs / "s0" / "config.resume-x.json").write_text("{}")  # not a step: not a record
  assert changes.newest_record_path(str(runs / "s0")) == str(runs / "s0/config.resume-3.json")
  assert changes.newest_record_path(str(runs / "s2")) == str(runs / "s2/config.json")
  assert changes.newest_record_path(str(tmp_path)) is None
  loaded, grid = plot.load_runs([str(runs)])
  assert {r.name: r.source for r in loaded} == {
    "s0": "config.resume-3.json",
    "s1": "config.resume-3.json",
    "s2": "config.json",
  }
  arms = plot.arms_for(loaded, grid, ["train.num_steps"])
  assert [(a.label, a.seeds) for a in arms] == [("num_steps=6", [0, 1, 2])]
  assert capsys.readouterr().err == ""
  (runs / "s1" / "run.json").write_text(json.dumps({"overrides": {"train.num_steps": 8}}))
  plot.load_runs([str(runs)])
  assert capsys.readouterr().err == (
    f"warning: {runs / 's1'}: config.resume-3.json has train.num_steps=6 but run.json 8\n"
  )
  argv = [f"--root={runs}", "--group_by=train.num_steps", "--cols=eval/accuracy@final"]
  assert seed_table.main(argv) == 0
  out = capsys.readouterr().out
  rows = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("|")]
  assert [r for r in rows if r.isdigit()] == ["6"], out


def test_plot_heatmap_warns_of_a_seed_given_twice(root, tmp_path, capsys):
  """A run reached through a second sweep root with the same settings and seed: its cell read
  n=3 and a ±std over 2 seeds without a word (curves warns of the same runs)."""
  again = tmp_path / "again"
  _write_run(again / "c0.2_s0", 0.2, 0)
  (again / "c0.2_s0" / "config.json").write_text((root / "c0.2_s0" / "config.json").read_text())
  runs, grid = plot.load_runs([str(root), str(again)])
  heat = plot.heatmap_data(runs, "eval/accuracy", "clip_high", grid_fields=grid)
  assert heat.n.tolist() == [[3, 2]]  # the runs as they are
  assert capsys.readouterr().err == (
    "warning: cell 'objective.clip_high=0.2': several runs share a seed (0, 0, 1); all are "
    "averaged, and its n and ±std count those runs as seeds\n"
  )
  heat = plot.heatmap_data(runs, "eval/accuracy", "clip_high", where=["seed=1"])
  assert heat.n.tolist() == [[1, 1]] and capsys.readouterr().err == ""


def test_plot_curves_ci_claims_a_band_only_where_an_arm_has_one(
  root, tmp_path, capsys, monkeypatch
):
  """`--band=ci` over arms of 2 seeds draws no interval (it needs 3), yet the title and legend
  said "band: t 95% interval" and nothing said it was missing; with a third seed in one arm,
  only that arm has a band and the other is named."""
  figures = []
  monkeypatch.setattr(plot, "_save", lambda fig, out, dpi: figures.append(fig))

  def drawn(path):
    assert plot.main(["curves", str(path), "--band=ci", f"--out={tmp_path / 'c.png'}"]) == 0
    fig = figures.pop()
    texts = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    bands = sum(len(ax.collections) for ax in fig.axes)
    return fig._suptitle.get_text(), texts, bands, capsys.readouterr().err

  title, legend, bands, err = drawn(root)
  assert (title, bands) == ("mean over seeds", 0) and not any("band" in t for t in legend)
  assert err == (
    "warning: --band=ci: no interval for arms of fewer than 3 seeds: 'clip_high=0.2' (n=2), "
    "'clip_high=0.28' (n=2)\n"
  )
  more = tmp_path / "more"
  for clip, seed in ((0.2, 0), (0.2, 1), (0.28, 0), (0.28, 1), (0.28, 2)):
    _write_run(more / f"c{clip}_s{seed}", clip, seed)
  title, legend, bands, err = drawn(more)
  assert title == "mean over seeds; band: t 95% interval of the mean over seeds" and bands == 1
  assert legend[-1] == "band: t 95% interval of the mean over seeds", legend
  assert (
    err == "warning: --band=ci: no interval for arms of fewer than 3 seeds: 'clip_high=0.2' (n=2)\n"
  )


@pytest.mark.parametrize(
  "args, words",
  [
    (["--size=1.2.3x4"], ["--size='1.2.3x4': expected WIDTHxHEIGHT in inches"]),
    (["--size=.x4"], ["--size='.x4': expected WIDTHxHEIGHT in inches"]),
    (["--size=4x."], ["--size='4x.': expected WIDTHxHEIGHT in inches"]),
    (["--out={tmp}/c.pgf"], ["--out={tmp}/c.pgf: cannot write a .pgf file (", "give .png, .pdf"]),
    (['{sweep:[{"status": "done"}]}'], ["sweep.json: not a sweep's", "fix or remove it"]),
    (['{sweep:{"a": 1}}'], ["sweep.json: not a sweep's", "fix or remove it"]),
    (["{sweep:[1, 2}"], ["sweep.json: not valid JSON; expected a sweep's"]),
  ],
)
def test_plot_odd_size_format_or_sweep_record_is_one_error_line(
  root, tmp_path, capsys, monkeypatch, args, words
):
  """A size of two dots or a lone dot, a format whose program is not installed (.pgf without
  TeX), and a sweep.json that is not a sweep's record (a run without a name, runs as an
  object): a ValueError, RuntimeError, KeyError or TypeError traceback."""
  monkeypatch.setenv("PATH", str(tmp_path / "no_programs"))  # no TeX to find
  keep = tmp_path / "keep.png"
  keep.write_bytes(KEEP)
  argv = ["curves"]
  for a in args:
    if a.startswith("{sweep:"):
      sweep = tmp_path / "sweep"
      for seed in (0, 1):
        _write_run(sweep / f"s{seed}", 0.2, seed)
      (sweep / "sweep.json").write_text('{"runs": ' + a[7:-1] + "}")
      a = str(sweep)
    argv.append(a.format(tmp=tmp_path))
  if len(argv) == 2 and argv[1].startswith("--"):
    argv.insert(1, str(root))
  if not any(a.startswith("--out=") for a in argv):
    argv.append(f"--out={keep}")
  _one_error(capsys, plot.main(argv), *[w.format(tmp=tmp_path) for w in words])
  assert keep.read_bytes() == KEEP
  assert sorted(p.name for p in tmp_path.iterdir() if p.suffix) == ["keep.png"]  # nothing written


def test_seed_table_strips_spaces_around_expect_and_baseline_items(root, capsys):
  """`--expect='A:+, B:-'` and `--baseline=' 0.2'`, spaced as --cols may be: "--expect=
  eval/accuracy@avg:-: want COL:+ or COL:- with COL one of --cols" (it is one) and "--baseline=
  0.2 is no arm"."""
  argv = [f"--root={root}", "--group_by=objective.clip_high"]
  argv += ["--cols=eval/accuracy@final, eval/accuracy@avg", "--baseline= 0.2 "]
  argv += ["--expect=eval/accuracy@final:+, eval/accuracy@avg : - "]
  assert seed_table.main(argv) == 0
  out = capsys.readouterr().out
  rows = [line for line in out.splitlines() if line.startswith("| 0.28 ")]
  assert len(rows) == 2 and "too few seeds" in rows[1], out  # the means, the differences


@pytest.mark.parametrize(
  "argv, says",
  [
    (["compare.py"], "error: the following arguments are required: --root"),
    (["compare.py", "--root=.", "--tgs=x"], "error: unrecognized arguments: --tgs=x"),
    (["plot.py", "curves"], "error: the following arguments are required: PATH"),
    (["plot.py", "heatmap", "."], "error: the following arguments are required: --x"),
    (["export_runs.py"], "error: the following arguments are required: --root, --out"),
    (["hf_convert.py", "export"], "error: the following arguments are required: --workdir, --out"),
  ],
)
def test_a_tools_missing_or_unknown_argument_is_one_line_not_the_usage_block(argv, says):
  """compare, plot, export_runs and hf_convert printed argparse's usage block (3 to 5 lines)
  before their error; they now say one line, as the other tools do (`terminal.ArgParser`)."""
  import subprocess

  proc = subprocess.run(
    [sys.executable, str(REPO / "tools" / argv[0]), *argv[1:]],
    cwd=REPO, capture_output=True, text=True, timeout=120,
  )  # fmt: skip
  assert proc.returncode == 2 and proc.stdout == ""
  assert proc.stderr.strip().splitlines() == [says], proc.stderr
