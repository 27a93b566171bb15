"""Tests for the TensorBoard writer: real event files, read back with tensorboard's own code."""

import json
import socket
import subprocess
import sys
import time
import urllib.request

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboard import context
from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
from tensorboard.plugins import base_plugin
from tensorboard.plugins.histogram import histograms_plugin
from tensorboard.plugins.histogram import summary_v2 as histogram_summary
from tensorboard.plugins.scalar import scalars_plugin
from tensorboard.plugins.text import text_plugin

from jaxrl_llm import metrics


def _write_run(logdir):
  rng = np.random.default_rng(0)
  weights = rng.normal(size=(64, 32)).astype(np.float32)
  with metrics.SummaryWriter(logdir) as writer:
    for step in range(1, 4):
      writer.scalars(step, {"rollout/reward_mean": 0.5 * step, "policy/loss": jnp.float32(-step)})
    writer.histograms(2, {"params/w": weights, "rollout/lengths": jnp.arange(10)})
    writer.text(3, "samples/completion", "**bold** answer: `42`")
  return weights


def _plugins(logdir):
  """TensorBoard's own dashboard plugins, fed by the data provider `tensorboard --logdir` uses."""
  mux = plugin_event_multiplexer.EventMultiplexer()
  mux.AddRunsFromDirectory(str(logdir))
  mux.Reload()
  ctx = base_plugin.TBContext(
    data_provider=data_provider.MultiplexerDataProvider(mux, str(logdir)), logdir=str(logdir)
  )
  return (
    scalars_plugin.ScalarsPlugin(ctx),
    histograms_plugin.HistogramsPlugin(ctx),
    text_plugin.TextPlugin(ctx),
  )


def test_scalars_round_trip(tmp_path):
  _write_run(tmp_path)
  scalars = metrics.read_scalars(tmp_path)
  assert set(scalars) == {"rollout/reward_mean", "policy/loss"}
  assert [s for s, _ in scalars["rollout/reward_mean"]] == [1, 2, 3]
  np.testing.assert_allclose([v for _, v in scalars["rollout/reward_mean"]], [0.5, 1.0, 1.5])
  np.testing.assert_allclose([v for _, v in scalars["policy/loss"]], [-1.0, -2.0, -3.0])


def test_tags_and_plugins(tmp_path):
  _write_run(tmp_path)
  tags = metrics.read_tags(tmp_path)
  assert sorted(tags["scalars"]) == ["policy/loss", "rollout/reward_mean"]
  assert sorted(tags["tensors"]) == ["params/w", "rollout/lengths", "samples/completion"]
  assert sorted(tags["plugins"]["histograms"]) == ["params/w", "rollout/lengths"]
  assert tags["plugins"]["text"] == ["samples/completion"]


def test_histogram_matches_tensorboard_reference(tmp_path):
  weights = _write_run(tmp_path)
  hists = metrics.read_histograms(tmp_path)
  ((step, buckets),) = hists["params/w"]
  assert step == 2
  reference = histogram_summary.histogram_pb("params/w", weights).value[0].tensor
  expected = np.frombuffer(reference.tensor_content, np.float64).reshape(30, 3)
  np.testing.assert_allclose(buckets, expected, rtol=1e-12, atol=1e-12)
  assert buckets[:, 2].sum() == weights.size


@pytest.mark.parametrize(
  "data",
  [np.full((5,), 3.0), np.zeros((0,)), np.array([1.0, np.nan, 2.0, np.inf]), np.arange(7)],
)
def test_histogram_edge_cases_match_reference(data, tmp_path):
  """Non-finite entries are left out; constant and empty data keep TensorBoard's layout."""
  with metrics.SummaryWriter(str(tmp_path)) as writer:
    writer.histograms(1, {"x": data}, buckets=4)
  finite = data[np.isfinite(data)]
  reference = histogram_summary.histogram_pb("x", finite, buckets=4).value[0].tensor
  expected = np.frombuffer(reference.tensor_content, np.float64).reshape(4, 3)
  ((_, written),) = metrics.read_histograms(str(tmp_path))["x"]
  np.testing.assert_allclose(written, expected)
  assert written[:, 2].sum() == finite.size


def test_text_round_trip(tmp_path):
  _write_run(tmp_path)
  assert metrics.read_text(tmp_path) == {"samples/completion": [(3, "**bold** answer: `42`")]}


def test_tensorboard_dashboards_see_the_data(tmp_path):
  weights = _write_run(tmp_path)
  scalars, histograms, text = _plugins(tmp_path)
  ctx = context.RequestContext()
  run = "."
  assert sorted(scalars.index_impl(ctx, experiment="")[run]) == [
    "policy/loss",
    "rollout/reward_mean",
  ]
  body, _ = scalars.scalars_impl(ctx, "rollout/reward_mean", run, "", output_format="json")
  assert [(s, v) for _, s, v in body] == [(1, 0.5), (2, 1.0), (3, 1.5)]
  assert sorted(histograms.index_impl(ctx, experiment="")[run]) == ["params/w", "rollout/lengths"]
  body, _ = histograms.histograms_impl(ctx, "params/w", run, "")
  ((_, step, buckets),) = body
  assert step == 2 and sum(b[2] for b in buckets) == weights.size
  assert text.index_impl(ctx, experiment="")[run] == ["samples/completion"]
  ((row),) = text.text_impl(ctx, run, "samples/completion", "", enable_markdown=True)
  assert row["step"] == 3 and "<strong>bold</strong>" in row["text"]


def test_second_writer_appends_a_new_file(tmp_path):
  with metrics.SummaryWriter(tmp_path) as writer:
    writer.scalars(1, {"a": 1.0})
  with metrics.SummaryWriter(tmp_path) as writer:
    writer.scalars(2, {"a": 2.0})
    writer.text(2, "t", "x")
  assert metrics.read_scalars(tmp_path) == {"a": [(1, 1.0), (2, 2.0)]}
  assert metrics.read_tags(tmp_path)["plugins"]["text"] == ["t"]


def _relaunched_from_step_2(logdir) -> None:
  """A launch that logged steps 1-4 and an evaluation at 3 (committing 2), then one relaunched
  from 2 logging 3-4 and no evaluation."""
  with metrics.SummaryWriter(logdir) as writer:
    writer.restart(1)
    writer.scalars(0, {"eval/accuracy": 0.0})
    for step in range(1, 5):
      writer.scalars(step, {"rollout/reward_mean": float(step)})
      if step == 3:  # an evaluation the relaunch does not make again (its eval_every changed)
        writer.scalars(step, {"eval/accuracy": 0.5})
  time.sleep(1.1)  # the second launch's event file is named by a later second, as a relaunch's
  with metrics.SummaryWriter(logdir) as writer:
    writer.restart(3)
    for step in (3, 4):
      writer.scalars(step, {"rollout/reward_mean": 10.0 * step})


def test_a_relaunch_from_an_older_step_replaces_what_the_last_launch_logged_past_it(tmp_path):
  """A launch killed after logging steps 1-4 but committing only step 2 is relaunched from 2
  and logs 3-4 again: the restart mark at step 3 makes TensorBoard's loaders (the dashboards'
  and the one `read_scalars` and the tools use) keep steps 1-2 of the first launch and 3-4 of
  the second, each once (they showed both copies of 3 and 4)."""
  _relaunched_from_step_2(tmp_path)
  kept = [(0, 0.0)], [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
  assert metrics.read_scalars(tmp_path) == {
    "eval/accuracy": kept[0],
    "rollout/reward_mean": kept[1],
  }
  scalars = _plugins(tmp_path)[0]
  body, _ = scalars.scalars_impl(
    context.RequestContext(), "rollout/reward_mean", ".", "", output_format="json"
  )
  assert [(s, v) for _, s, v in body] == kept[1]


# What each TensorBoard loader shows of the relaunched run: the Python one (`--load_fast=false`)
# honours the restart mark for every series; the Rust data server (`true`, and `auto` where it
# runs) drops a step only in the series the relaunch logs again (by its steps going back).
SERVED = {
  "false": [(0, 0.0)],
  "true": [(0, 0.0), (3, 0.5)],
  "auto": [(0, 0.0), (3, 0.5)],
}


@pytest.mark.parametrize("load_fast", sorted(SERVED))
def test_tensorboard_serves_a_relaunched_run_each_step_once(tmp_path, load_fast):
  """`tensorboard --logdir` (the real server, read over HTTP) on the relaunched run of the test
  above, by each loader: steps 1-2 of the first launch and 3-4 of the second, each once. The
  first launch's evaluation at step 3, which the relaunch did not make again, is dropped by the
  Python loader and kept by the fast one (the README says so)."""
  if load_fast != "false":
    data_server = pytest.importorskip("tensorboard_data_server")
    if not data_server.server_binary():
      pytest.skip("TensorBoard's data server has no binary for this platform")
  _relaunched_from_step_2(tmp_path / "run")
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
  cmd = [
    sys.executable,
    "-m",
    "tensorboard.main",
    f"--logdir={tmp_path}",
    f"--load_fast={load_fast}",
  ]
  cmd += ["--host=127.0.0.1", f"--port={port}", "--reload_interval=1"]
  server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  url = f"http://127.0.0.1:{port}/data/plugin/scalars/scalars?run=run&tag="
  got, deadline = {}, time.monotonic() + 120
  try:
    while len(got.get("rollout/reward_mean", [])) < 4:  # until the data server has loaded it
      assert server.poll() is None, server.stderr.read()[-2000:]
      assert time.monotonic() < deadline, got
      time.sleep(0.5)
      for tag in ("rollout/reward_mean", "eval/accuracy"):
        try:
          with urllib.request.urlopen(url + tag, timeout=5) as response:
            got[tag] = [(step, value) for _, step, value in json.loads(response.read())]
        except (OSError, ValueError):
          got[tag] = []
  finally:
    server.terminate()
    server.wait(timeout=30)
  assert got == {
    "rollout/reward_mean": [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)],
    "eval/accuracy": SERVED[load_fast],
  }


def test_non_scalar_metric_is_rejected(tmp_path):
  with metrics.SummaryWriter(tmp_path) as writer, pytest.raises(ValueError, match="'bad'"):
    writer.scalars(1, {"bad": np.ones(3)})


def test_flatten_metrics():
  nested = {"rollout": {"reward_mean": jnp.float32(0.25), "len": np.int32(7)}, "lr": 1e-3}
  flat = metrics.flatten_metrics(nested)
  assert flat == {"rollout/reward_mean": 0.25, "rollout/len": 7.0, "lr": 1e-3}
  assert all(type(v) is float for v in flat.values())
  with pytest.raises(ValueError, match="rollout/x"):
    metrics.flatten_metrics({"rollout": {"x": jnp.ones(2)}})


def test_progress_rate_and_eta_come_from_a_recent_window():
  """The first (compiling) step is not in the rate; the ETA follows recent steps only."""
  progress = metrics.Progress(1000, window=2)
  assert "? steps/s" in progress.line(1) and "ETA ?" in progress.line(1)
  progress.mark(1, now=100.0)  # first update done after 100 s of compiling
  progress.mark(11, now=101.0)  # then 10 steps/s
  assert progress.rate == pytest.approx(10.0)
  assert progress.eta_s == pytest.approx(98.9)
  progress.mark(21, now=103.0)
  progress.mark(31, now=105.0)  # slowed to 5 steps/s: the window (2 intervals) forgets the start
  assert progress.rate == pytest.approx(5.0) and progress.eta_s == pytest.approx(193.8)
  scalars = {
    "rollout/reward_mean": 0.123456,
    "policy/clip_frac": 0.02,
    "optim/skipped_updates": 0.0,
  }
  scalars.update({f"other/tag_{i}": 1.0 for i in range(40)})  # full metrics go to TensorBoard
  line = progress.line(31, scalars)
  assert line == "step 31/1000 3% 5 steps/s ETA 0:03:14 | reward 0.123 clip 0.02"
  assert "skipped 2" in progress.line(31, {**scalars, "optim/skipped_updates": 2.0})
  assert metrics.format_duration(3 * 3600 + 62) == "3:01:02"


def test_progress_and_eval_lines_fit_80_columns_with_a_packs_run_name():
  """With every scalar the line names at its widest, a 5-digit step count and skipped updates,
  a progress line fits 80 columns, and so does a pack run's line after its label (the pack's
  clock is its own line): the least wanted scalars go first, the skipped count stays. So does
  an evaluation's line."""
  from jaxrl_llm.run.held_out import eval_line

  progress = metrics.Progress(10000)
  progress.mark(9000, now=0.0)
  progress.mark(9990, now=1e4)
  wide = {tag: -0.0123456 for tag in metrics.SHORT_NAMES}
  wide["optim/skipped_updates"] = 12.0
  line = progress.line(9990, wide)
  assert len(line) <= metrics.LINE_WIDTH and line.startswith("step 9990/10000 100% 0.099 steps/s")
  assert "reward -0.0123" in line and line.endswith("skipped 12")
  for label in ("[ch0.28 t1.0 s11] ", "[0.0001234567 12345] "):
    line = label + progress.line(9990, wide, metrics.LINE_WIDTH - len(label), clock=False)
    assert len(line) <= metrics.LINE_WIDTH, line
    assert f"{label}step 9990: reward -0.0123 acc -0.0123" in line and line.endswith("skipped 12")
  full = progress.line(9990, wide, width=1000)
  assert all(f" {short} " in full for short in metrics.SHORT_NAMES.values())
  m = {"eval/length_mean": 12.25, "eval/pass@4": 0.6875, "eval/sample_accuracy": 0.4375}
  m["eval/accuracy"] = 0.5625
  line = eval_line(12000, m, 1.25, metrics.LINE_WIDTH - 21)
  assert len(line) <= 59 and line.startswith("eval step 12000: accuracy 0.562 pass@4 0.688")
  assert line.endswith("(1.2s)") and "length_mean 12.2" in eval_line(12000, m, 1.25, 200)
  ks = {f"eval/pass@{k}": k / 100 for k in (16, 2, 32, 4, 8)}  # as text: 16 < 2 < 32 < 4 < 8
  line = eval_line(3, {"eval/length_mean": 5.0, **ks, "eval/accuracy": 0.5}, 1.0, 200)
  assert "accuracy 0.5 pass@2 0.02 pass@4 0.04 pass@8 0.08 pass@16 0.16 pass@32 0.32 len" in line


def test_every_logged_tag_declares_itself_and_the_readme_maps_the_peers():
  """Each tag a real run writes has a metric_info entry (meaning, direction); docs/tensorboard.md's
  TRL/verl table is the registry's own."""
  from conftest import REPO

  from jaxrl_llm import metric_info

  readme = (REPO / "docs" / "tensorboard.md").read_text()
  assert metric_info.mapping_table() in readme
  for tag in ("eval/accuracy", "rollout/truncated_frac", "policy/clip_frac", "sft/loss"):
    assert metric_info.info(tag) is not None
  assert metric_info.direction("eval/pass@8") == "max"
  assert metric_info.direction("verifier/timeouts/math_correct") == "min"
  assert metric_info.direction("policy/entropy") is None


def _served_columns(logdir) -> list:
  """The HParams experiment TensorBoard's plugin serves for `logdir` (its own backend over its
  own data provider, as the HParams tab requests it: at most 5 columns shown first)."""
  from tensorboard.plugins.hparams import backend_context

  multiplexer = plugin_event_multiplexer.EventMultiplexer()
  multiplexer.AddRunsFromDirectory(str(logdir))
  multiplexer.Reload()
  provider = data_provider.MultiplexerDataProvider(multiplexer, str(logdir))
  ctx = backend_context.Context(base_plugin.TBContext(data_provider=provider, logdir=str(logdir)))
  request = context.RequestContext()
  experiment = ctx.experiment_from_metadata(
    request,
    "",
    True,
    ctx.hparams_metadata(request, ""),
    ctx.hparams_from_data_provider(request, "", 5),
    hparams_limit=5,
  )
  return list(experiment.hparam_infos)


def test_tensorboard_serves_a_sweeps_varied_fields_first_and_typed(tmp_path):
  """Two runs of a sweep over clip_high and temperature (and seed): the HParams plugin serves
  the varied columns first (the tab shows the first five), each typed (numbers as numbers),
  not the alphabetically first fixed fields."""
  from conftest import tiny_config

  from jaxrl_llm import metric_info
  from jaxrl_llm.config import parse
  from jaxrl_llm.run import record

  varied = ["objective.clip_high", "sampling.temperature", "seed"]
  declared = [(t, n, metric_info.info(t).meaning) for t, n in metric_info.HPARAMS_METRICS]
  for clip, temp, seed in ((0.2, 0.7, 0), (0.28, 1.0, 1)):
    cfg = parse(
      tiny_config(**{"objective.clip_high": clip, "sampling.temperature": temp, "seed": seed})
    )
    writer = metrics.SummaryWriter(str(tmp_path / f"clip={clip}"))
    hp = record.run_hparams(cfg, None, varied)
    writer.hparams(
      hp, declared, trial_id=record.trial_name(cfg, varied, ""), start_time=1.0, varied=varied
    )
    writer.close()
  columns = _served_columns(tmp_path)
  assert [c.name for c in columns[:3]] == sorted(varied) and all(c.differs for c in columns[:3])
  assert not any(c.differs for c in columns[3:])
  from tensorboard.plugins.hparams import api_pb2

  assert {c.type for c in columns[:3]} == {api_pb2.DATA_TYPE_FLOAT64}


def test_tensorboard_shows_a_sweeps_trial_ids_whole_and_distinct(tmp_path):
  """The trial ids of a sweep over clip_high and temperature (and seed), as the HParams
  plugin serves them, fit the table's trial column (16 characters, where
  `clip_high=0.2 te` was cut) and tell the grid points apart."""
  from conftest import tiny_config

  from jaxrl_llm.config import parse
  from jaxrl_llm.run import record

  varied = ["objective.clip_high", "sampling.temperature", "seed"]
  grid = [(c, t, s) for c in (0.2, 0.28) for t in (0.7, 1.0) for s in (0, 11)]
  for clip, temp, seed in grid:
    cfg = parse(
      tiny_config(**{"objective.clip_high": clip, "sampling.temperature": temp, "seed": seed})
    )
    writer = metrics.SummaryWriter(str(tmp_path / f"{clip},{temp},{seed}"))
    hp = record.run_hparams(cfg, None, varied)
    trial = record.trial_name(cfg, varied, "unused")
    writer.hparams(hp, [], trial_id=trial, start_time=1.0, varied=varied)
    writer.close()
  names = [row["name"] for row in metrics.hparams_table(str(tmp_path))]
  assert len(set(names)) == len(grid)
  assert all(len(n) <= record.TRIAL_WIDTH for n in names), names
  assert "ch0.28 t0.7 s11" in names and "ch0.2 t1.0 s0" in names


def test_trial_ids_fall_back_to_values_when_initials_clash_or_run_long():
  """Two varied fields with the same initials, or values too long for the column, give the
  values alone; no varied field gives the fallback (the workdir's name)."""
  from conftest import tiny_config

  from jaxrl_llm.config import parse
  from jaxrl_llm.run import record

  cfg = parse(tiny_config(**{"sft.steps": 7, "seed": 3}))
  assert record.trial_name(cfg, ["sft.steps"], "w") == "7 3"  # sft.steps and seed: both `s`
  cfg = parse(tiny_config(**{"optim.learning_rate": 0.000123456, "seed": 3}))
  assert record.trial_name(cfg, ["optim.learning_rate"], "w") == "lr0.000123456 s3"
  cfg = parse(tiny_config(**{"optim.learning_rate": 0.0001234567, "seed": 12345}))
  assert record.trial_name(cfg, ["optim.learning_rate"], "w") == "0.0001234567 12345"
  assert record.trial_name(cfg, [], "w") == "w"


def test_a_relaunch_replaces_the_text_and_histograms_logged_past_its_step(tmp_path):
  """The restart mark drops an earlier launch's text and histograms (tensor summaries) at its
  step or later, as it drops scalars and as TensorBoard's Text dashboard does: a killed and
  resumed run's samples were read back twice for the relogged steps (`tools/export_runs.py`
  wrote both launches' rows)."""
  with metrics.SummaryWriter(tmp_path) as writer:
    writer.restart(1)
    for step in range(1, 5):
      writer.text(step, "samples", f"first {step}")
      writer.histograms(step, {"h": np.full(4, float(step))})
  time.sleep(1.1)  # the relaunch's event file is named by a later second
  with metrics.SummaryWriter(tmp_path) as writer:
    writer.restart(3)
    for step in (3, 4):
      writer.text(step, "samples", f"second {step}")
      writer.histograms(step, {"h": np.full(4, 10.0 * step)})
  kept = [(1, "first 1"), (2, "first 2"), (3, "second 3"), (4, "second 4")]
  assert metrics.read_text(tmp_path) == {"samples": kept}
  hist = metrics.read_histograms(tmp_path)["h"]
  assert [s for s, _ in hist] == [1, 2, 3, 4]
  text = _plugins(tmp_path)[2]
  shown = text.text_impl(context.RequestContext(), ".", "samples", "", enable_markdown=True)
  assert [row["step"] for row in shown] == [s for s, _ in kept]
