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
    (["curves", "{root}", "--out={tmp}"], ["it is a directory"]),
    (["passk", "{root}", "--out={tmp}/keep.png/x.png"], ["keep.png is a file, not a directory"]),
    (["passk", "{root}", "--step=2"], ["--step=2: no eval/pass@k logged there; eval steps: 0, 3"]),
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
  assert err == "warning: .: eval/accuracy is nan at step 2; not drawn there\n", err
  assert out.exists()


@pytest.mark.parametrize(
  "args, words",
  [
    (["--root={empty}"], ["no TensorBoard event files under"]),
    (["--root={bad:empty events}"], ["events/r: its event files hold no scalars (empty or un"]),
    (["--root={bad:garbage events}"], ["events/r: its event files hold no scalars"]),
    (["--root={root}", "--tags=,"], ["--tags=',' is empty"]),
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
