"""tools/plot.py: grouping and aggregation on synthetic runs, errors, and figures of a real sweep."""

import json
import subprocess
import sys

import matplotlib
import numpy as np
import pytest
from conftest import REPO, cli_env
from matplotlib import colors as mcolors
from matplotlib import image as mimage
from test_tools import CONFIG, TINY  # the tiny, fast sweep settings of tools/sweep.py's tests

from jaxrl_llm import metrics

sys.path.insert(0, str(REPO / "tools"))
import plot

BASE = {0.2: 0.1, 0.28: 0.5}  # arm -> accuracy at step 0, seed 0
SEEDS = (0, 1, 2)
STEPS = (0, 1, 2, 3)


def _accuracy(clip, seed, step):
  return BASE[clip] + 0.1 * seed + 0.01 * step


def _write_run(workdir, clip, seed, config=True):
  """A run with known scalars: accuracy = BASE + 0.1*seed + 0.01*step, entropy = 2 - step/10,
  and its warm start's sft/loss = 1 + seed at step 5 in `<workdir>/sft`."""
  with metrics.SummaryWriter(str(workdir)) as w:
    for step in STEPS:
      w.scalars(
        step, {"eval/accuracy": _accuracy(clip, seed, step), "policy/entropy": 2 - step / 10}
      )
  with metrics.SummaryWriter(str(workdir / "sft")) as w:  # the warm start's own run, merged
    w.scalars(5, {"sft/loss": 1.0 + seed})
  if config:
    fields = {
      "objective": {"clip_high": clip, "clip_low": None},
      "sampling": {"temperature": 1.0},
      "mesh": {"rules": []},
      "seed": seed,
      "train": {"num_steps": 3, "stop_after_steps": seed},  # differs, but changes no result
    }
    (workdir / "config.json").write_text(json.dumps({"config": fields, "step": 0}))


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
  """2 arms (objective.clip_high) x 3 seeds with config.json, under one root."""
  root = tmp_path_factory.mktemp("synthetic")
  for clip in BASE:
    for seed in SEEDS:
      _write_run(root / f"clip{clip}_s{seed}", clip, seed)
  return root


def test_arms_mean_and_band_over_seeds(synthetic):
  runs, grid_fields = plot.load_runs([str(synthetic)])
  assert len(runs) == 6 and {r.source for r in runs} == {"config.json"} and grid_fields == []
  assert all(r.scalars["sft/loss"] == [(5, 1.0 + r.params["seed"])] for r in runs)  # <run>/sft
  assert plot.swept_fields(runs) == ["objective.clip_high"]  # not seed, not stop_after_steps
  arms, curves = plot.curves_data(runs, ["eval/accuracy", "policy/*"])
  assert [a.label for a in arms] == ["clip_high=0.2", "clip_high=0.28"]
  assert [a.seeds for a in arms] == [list(SEEDS)] * 2
  assert list(curves) == ["eval/accuracy", "policy/entropy"]
  for clip, curve in zip(BASE, curves["eval/accuracy"]):
    assert curve.n == 3 and curve.steps.tolist() == list(STEPS)
    want = [[_accuracy(clip, s, t) for t in STEPS] for s in SEEDS]
    np.testing.assert_allclose(curve.values, want, rtol=1e-6)  # float32 in the event file
    np.testing.assert_allclose(curve.mean, [BASE[clip] + 0.1 + 0.01 * t for t in STEPS], rtol=1e-6)
    np.testing.assert_allclose(curve.lo, [BASE[clip] + 0.01 * t for t in STEPS], rtol=1e-6)
    np.testing.assert_allclose(curve.hi, [BASE[clip] + 0.2 + 0.01 * t for t in STEPS], rtol=1e-6)
  _, std = plot.curves_data(runs, ["eval/accuracy"], band="std")
  c = std["eval/accuracy"][1]
  np.testing.assert_allclose(c.hi - c.mean, [0.1] * 4, rtol=1e-5)  # sample std of 0, 0.1, 0.2
  np.testing.assert_allclose(c.mean - c.lo, [0.1] * 4, rtol=1e-5)
  # The t 95% interval band: the studies' interval of the mean (study_stats.t_intervals).
  sys.path.insert(0, str(REPO / "experiments"))
  import study_stats

  _, ci = plot.curves_data(runs, ["eval/accuracy"], band="ci")
  c = ci["eval/accuracy"][1]
  _, lo, hi = study_stats.t_intervals(c.values.T)
  np.testing.assert_allclose(c.lo, lo, rtol=1e-6)
  np.testing.assert_allclose(c.hi, hi, rtol=1e-6)
  assert (c.hi - c.lo)[0] > 0.4  # 4.30 x 0.1 / sqrt(3) each side
  # --where keeps one arm; --group_by=run puts every run in its own arm (nothing averaged).
  arms, curves = plot.curves_data(runs, ["eval/accuracy"], where=["clip_high=0.28"])
  assert [a.label for a in arms] == ["clip_high=0.28"] and curves["eval/accuracy"][0].n == 3
  arms, _ = plot.curves_data(runs, ["eval/accuracy"], group_by=["run"])
  assert len(arms) == 6 and all(len(a.runs) == 1 for a in arms)


def test_smoothing_is_tensorboards_debiased_ema(synthetic):
  np.testing.assert_allclose(plot.ema([1.0, 2.0, float("nan"), 4.0], 0.5), [1, 5 / 3, np.nan, 3])
  np.testing.assert_allclose(plot.ema([3.0] * 5, 0.9), [3.0] * 5)  # no bias toward 0
  runs, _ = plot.load_runs([str(synthetic)])
  _, curves = plot.curves_data(runs, ["eval/accuracy"], smooth=0.5)
  raw = [BASE[0.2] + 0.1 + 0.01 * t for t in STEPS]  # the mean is linear, so EMA commutes
  np.testing.assert_allclose(curves["eval/accuracy"][0].mean, plot.ema(raw, 0.5), rtol=1e-6)


def test_heatmap_data_is_the_final_value_over_seeds(synthetic):
  runs, _ = plot.load_runs([str(synthetic)])
  grid = plot.heatmap_data(runs, "eval/accuracy", x="clip_high")
  assert grid.x == "objective.clip_high" and grid.y is None and grid.xs == [0.2, 0.28]
  final = [BASE[c] + 0.1 + 0.03 for c in BASE]  # mean over seeds at step 3
  np.testing.assert_allclose(grid.mean, [final], rtol=1e-6)
  np.testing.assert_allclose(grid.std, [[0.1, 0.1]], rtol=1e-5)
  assert grid.n.tolist() == [[3, 3]]


def test_settings_from_sweep_json_or_workdir_names_group_alike(tmp_path):
  """Runs without config.json: the overrides in sweep.json (the runs of its grid and of earlier
  grids), else the field=value workdir name."""
  names = [f"objective.clip_high={c},seed={s}" for c in BASE for s in SEEDS]
  for name in names:
    clip, seed = (float(p.split("=")[1]) for p in name.split(","))
    _write_run(tmp_path / name, clip, int(seed), config=False)
  entries = [{"name": n, "params": dict(p.split("=") for p in n.split(","))} for n in names]
  record = {
    "grid": {"objective.clip_high": ["0.2", "0.28"], "seed": ["0", "1", "2"]},
    "runs": entries[:4],
    "earlier_runs": entries[4:],  # a sweep run again with fewer seeds keeps these
  }
  (tmp_path / "sweep.json").write_text(json.dumps(record))
  for source in ("sweep.json", "name"):
    runs, grid_fields = plot.load_runs([str(tmp_path)])
    assert {r.source for r in runs} == {source}
    arms, curves = plot.curves_data(runs, ["eval/accuracy"], grid_fields=grid_fields)
    assert [a.label for a in arms] == ["clip_high=0.2", "clip_high=0.28"]
    assert [a.seeds for a in arms] == [list(SEEDS)] * 2
    np.testing.assert_allclose(curves["eval/accuracy"][1].mean[-1], 0.5 + 0.1 + 0.03, rtol=1e-6)
    (tmp_path / "sweep.json").unlink(missing_ok=True)


def test_an_objectives_unset_field_groups_as_the_value_the_run_used(tmp_path):
  """config.json's `clip_high: null` (unset: the objective's default) with `resolved` naming
  0.2 is one arm with an explicit 0.2, not a `None` arm; a record without `resolved` (older)
  keeps its null."""
  for seed, clip in ((0, 0.2), (1, 0.2), (2, 0.28)):
    _write_run(tmp_path / "runs" / f"s{seed}", clip, seed)
    path = tmp_path / "runs" / f"s{seed}" / "config.json"
    record = json.loads(path.read_text())
    record["resolved"] = {"objective.clip_high": clip, "objective.clip_low": 0.2}
    record["config"]["objective"]["clip_high"] = None if seed == 0 else clip
    path.write_text(json.dumps(record))
  runs, _ = plot.load_runs([str(tmp_path / "runs")])
  arms, _ = plot.curves_data(runs, ["eval/accuracy"])
  assert [(a.label, a.seeds) for a in arms] == [("clip_high=0.2", [0, 1]), ("clip_high=0.28", [2])]
  grid = plot.heatmap_data(runs, "eval/accuracy", "clip_high", None)
  assert grid.xs == [0.2, 0.28] and grid.n.tolist() == [[2, 1]]
  (tmp_path / "old").mkdir()
  old = {"config": {"objective": {"clip_high": None}}}
  (tmp_path / "old" / "config.json").write_text(json.dumps(old))
  assert plot.run_params(str(tmp_path / "old"))[0] == {"objective.clip_high": None}


def test_config_json_wins_over_run_json_and_a_disagreement_is_reported(tmp_path, capsys):
  _write_run(tmp_path / "r", 0.2, 0)
  overrides = {"objective.clip_high": "0.28", "seed": "0", "train.stop_after_steps": "9"}
  (tmp_path / "r" / "run.json").write_text(json.dumps({"overrides": overrides}))
  (run,), _ = plot.load_runs([str(tmp_path)])
  assert run.source == "config.json" and run.params["objective.clip_high"] == 0.2
  err = capsys.readouterr().err
  assert "config.json has objective.clip_high=0.2 but run.json 0.28" in err
  assert "stop_after_steps" not in err  # a field that may change between invocations


@pytest.mark.parametrize(
  "args, message",
  [
    (["curves", "{empty}"], "error: no TensorBoard event files under"),
    (["curves", "{root}", "--tags=eval/acuracy"], "did you mean eval/accuracy? available: eval/"),
    (["heatmap", "{root}", "--x=sampling.temperature"], "is not swept (every run has 1.0)"),
    (["heatmap", "{root}", "--x=rl.clip_high"], "did you mean objective.clip_high?"),
    (["heatmap", "{root}", "--x=clip_high", "--y=seed"], "seeds are averaged over"),
    (["curves", "{root}", "--where=clip_high=0.3"], "matches no run (objective.clip_high is one"),
    (["curves", "{root}", "--smooth=1"], "--smooth must be in [0, 1)"),
  ],
)
def test_errors_are_one_line_with_exit_status_2(synthetic, tmp_path, capsys, args, message):
  (tmp_path / "empty").mkdir()
  argv = [a.format(root=synthetic, empty=tmp_path / "empty") for a in args]
  assert plot.main([*argv, f"--out={tmp_path / 'x.png'}"]) == 2
  err = capsys.readouterr().err
  assert message in err and err.count("\n") == 1, err
  assert not (tmp_path / "x.png").exists()


# ----------------------------------------------------------------------------- a real sweep


def _tool(name, *args):
  env = cli_env()
  cmd = [sys.executable, str(REPO / "tools" / f"{name}.py"), *args]
  return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def real_sweep(tmp_path_factory):
  """A real 2-point, 1-seed sweep of the tiny config (temperature differs, so do the metrics)."""
  root = tmp_path_factory.mktemp("sweep")
  grid = ["--grid=sampling.temperature=0.7,1.0", "--grid=objective.clip_high=0.2"]
  proc = _tool("sweep", CONFIG, f"--root={root}", *grid, "--seeds=0", *TINY, "--parallel=2")
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  return root


def _png(path, width, height):
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  img = mimage.imread(str(path))
  assert img.shape[:2] == (height, width), img.shape
  assert img[..., :3].var() > 0  # not blank
  return img[..., :3]


def _has_color(img, color, tol=0.02):
  return bool((np.abs(img - np.array(mcolors.to_rgb(color))).max(axis=-1) < tol).any())


@pytest.mark.extended
def test_figures_of_a_real_sweep(real_sweep, tmp_path):
  root = real_sweep
  out = tmp_path / "curves.png"
  tags = "--tags=policy/entropy,rollout/length_mean,eval/accuracy"
  proc = _tool("plot", "curves", str(root), tags, f"--out={out}", "--size=9x6", "--dpi=60")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "2 arm(s)" in proc.stdout and "temperature=0.7: 1 run(s), seeds 0" in proc.stdout
  img = _png(out, 540, 360)
  assert _has_color(img, "tab:blue") and _has_color(img, "tab:orange")  # one line per arm

  heat = tmp_path / "heat.png"
  xy = ["--x=sampling.temperature", "--y=objective.clip_high"]  # clip_high: a 1-value grid field
  proc = _tool("plot", "heatmap", str(root), "--tag=policy/entropy", *xy, f"--out={heat}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  img = _png(heat, 550, 300)  # default size: 5.5 x 3 inches at 100 dpi
  cmap = matplotlib.colormaps["viridis"]
  assert _has_color(img, cmap(0.0)[:3]) and _has_color(img, cmap(1.0)[:3])  # two unequal cells

  # The data behind the figures: arms from each run's config.json, values from its event file.
  runs, grid_fields = plot.load_runs([str(root)])
  assert {r.source for r in runs} == {"config.json"}
  assert grid_fields == ["sampling.temperature", "objective.clip_high", "seed"]
  grid = plot.heatmap_data(
    runs, "policy/entropy", "temperature", "clip_high", grid_fields=grid_fields
  )
  assert grid.xs == [0.7, 1.0] and grid.ys == [0.2] and grid.n.tolist() == [[1, 1]]
  for j, temp in enumerate(("0.7", "1.0")):
    run = root / f"sampling.temperature={temp},objective.clip_high=0.2,seed=0"
    assert grid.mean[0, j] == metrics.read_scalars(str(run))["policy/entropy"][-1][1]
  assert grid.mean[0, 0] != grid.mean[0, 1]


def test_without_matplotlib_the_tool_names_the_extra_that_installs_it(synthetic, tmp_path):
  """The README's first command installs no matplotlib: plot.py then says which extra brings
  it, in one line (exit 2), instead of a ModuleNotFoundError traceback."""
  script = (
    "import sys\n"
    "class NoMatplotlib:\n"
    "  def find_spec(self, name, path=None, target=None):\n"
    "    if name.split('.')[0] == 'matplotlib':\n"
    "      raise ModuleNotFoundError(\"No module named 'matplotlib'\")\n"
    "sys.meta_path.insert(0, NoMatplotlib())\n"
    f"sys.path.insert(0, {str(REPO / 'tools')!r})\n"
    "import plot\n"
    f"sys.exit(plot.main(['curves', {str(synthetic)!r}, '--out', {str(tmp_path / 'x.png')!r}]))\n"
  )
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines() == [
    "error: tools/plot.py needs matplotlib, which the base install leaves out: "
    "pip install -e '.[experiments]' (or pip install matplotlib)"
  ]
  assert not (tmp_path / "x.png").exists()


def test_passk_draws_each_arms_pass_at_k_curve_with_its_interval(synthetic, tmp_path):
  """`plot.py passk`: k = 1 from eval/sample_accuracy and each logged eval/pass@k, at the last
  evaluation of each run, the mean over seeds with the studies' t interval; a PNG is written."""
  root = tmp_path / "runs"
  for clip in BASE:
    for seed in SEEDS:
      workdir = root / f"clip{clip}_s{seed}"
      _write_run(workdir, clip, seed)
      with metrics.SummaryWriter(str(workdir)) as w:
        for step in (0, 3):
          base = _accuracy(clip, seed, step)
          w.scalars(step, {"eval/sample_accuracy": base, "eval/pass@2": base + 0.1})
          w.scalars(step, {"eval/pass@4": base + 0.2})
  runs, grid = plot.load_runs([str(root)])
  arms, curves = plot.passk_data(runs, grid_fields=grid)
  assert [a.label for a in arms] == ["clip_high=0.2", "clip_high=0.28"]
  for clip, c in zip(BASE, curves):
    assert c.steps.tolist() == [1, 2, 4] and c.n == 3
    mean = BASE[clip] + 0.1 + 0.03  # seeds 0, 1, 2 at step 3
    np.testing.assert_allclose(c.mean, [mean, mean + 0.1, mean + 0.2], rtol=1e-5)
    np.testing.assert_allclose(c.hi - c.mean, [4.303 * 0.1 / np.sqrt(3)] * 3, rtol=1e-3)
  _, early = plot.passk_data(runs, step=0, grid_fields=grid)
  np.testing.assert_allclose(early[0].mean[0], BASE[0.2] + 0.1, rtol=1e-5)
  out = tmp_path / "passk.png"
  assert plot.main(["passk", str(root), f"--out={out}", "--dpi=40"]) == 0
  assert mimage.imread(str(out)).shape[0] > 50
  assert plot.main(["passk", str(synthetic), f"--out={out}"]) == 2  # no pass@k logged
