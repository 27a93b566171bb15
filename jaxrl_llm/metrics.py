"""TensorBoard metrics without TensorFlow, and small helpers for logging progress.

`SummaryWriter` writes TensorBoard event files with tensorboard's own record framing and
summary builders (`histogram_pb`, `text_pb`, `hparams_pb`, `hparams_config_pb`). Only process 0
writes. Files go through `jaxrl_llm.paths`, so the logdir may be a gs:// URL (TensorBoard's own
`EventFileWriter` cannot append to an object without TensorFlow: each flush would replace the
file). The `read_*` helpers read event files back with tensorboard's own `EventAccumulator`,
which reads gs:// through fsspec.
"""

from __future__ import annotations

import collections
import itertools
import math
import os
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.plugins.histogram import metadata as histogram_metadata
from tensorboard.plugins.histogram import summary_v2 as histogram_summary
from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2
from tensorboard.plugins.hparams import metadata as hparams_metadata
from tensorboard.plugins.hparams import summary_v2 as hparams_summary
from tensorboard.plugins.text import metadata as text_metadata
from tensorboard.plugins.text import summary_v2 as text_summary
from tensorboard.summary.writer.record_writer import RecordWriter
from tensorboard.util import tensor_util

from jaxrl_llm import metric_info, paths
from jaxrl_llm.event_files import damaged_event_files, load

DEFAULT_BUCKETS = 30  # TensorBoard's own default bucket count for histograms
_FILE_IDS = itertools.count()


class EventFile:
  """Writes `Event` protos to TensorBoard event files in `logdir` (a local path or a URL).

  The records and the first event (the file version) are those of tensorboard's
  `EventFileWriter`, written synchronously through `paths.AppendFile`. A local file is flushed
  after every event. An object store cannot append, so each flush rewrites the whole object: it
  is flushed every `flush_secs` or `max_queue` events, and past `rollover_bytes` the next event
  starts a new file (`file_index` counts them).
  """

  def __init__(
    self, logdir: str, *, flush_secs: float, max_queue: int, rollover_bytes: int = 8 << 20
  ):
    """A writer for `logdir`; its first file is created by the first event."""
    self.logdir = paths.as_path(logdir)
    self.file_index = 0
    self._remote = paths.is_remote(self.logdir)
    self._flush_secs, self._max_queue, self._rollover = flush_secs, max_queue, rollover_bytes
    self._file: paths.AppendFile | None = None
    self._records: RecordWriter | None = None
    self._pending, self._flushed_at = 0, time.monotonic()

  def _open(self) -> RecordWriter:
    # tensorboard's EventFileWriter naming: time, host, process, a counter of this process.
    name = (
      f"{metric_info.EVENT_FILE_PREFIX}{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
    )
    name += f".{next(_FILE_IDS)}"
    self._file = paths.AppendFile(self.logdir / name)
    self._records = RecordWriter(self._file)
    version = event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2")
    self._records.write(version.SerializeToString())
    self.flush()
    return self._records

  def add_event(self, event: event_pb2.Event) -> None:
    """Appends `event`, flushing when due."""
    records = self._records if self._records is not None else self._open()
    records.write(event.SerializeToString())
    self._pending += 1
    due = (
      self._pending >= self._max_queue or time.monotonic() - self._flushed_at >= self._flush_secs
    )
    if not self._remote or due:
      self.flush()
    if self._remote and self._file.size >= self._rollover:
      self._close_file()
      self.file_index += 1

  def flush(self) -> None:
    """Makes every event written so far visible in the event file."""
    if self._file is not None:
      self._file.flush()
    self._pending, self._flushed_at = 0, time.monotonic()

  def _close_file(self) -> None:
    if self._file is not None:
      self._file.close()
    self._file = self._records = None

  def close(self) -> None:
    """Flushes and closes the current file."""
    self._close_file()


class SummaryWriter:
  """Writes scalars, histograms and markdown text to TensorBoard event files in `logdir`.

  On processes other than 0 every method is a no-op, so all processes may call it.
  """

  def __init__(
    self,
    logdir: str,
    *,
    flush_secs: float = 30.0,
    max_queue: int = 100,
    rollover_bytes: int = 8 << 20,
  ):
    """A writer for `logdir` (process 0 only), a local path or a gs:// URL. Its event file is
    opened by the first write, so a run that writes nothing (e.g. relaunched when finished)
    leaves no empty file. `flush_secs`, `max_queue` and `rollover_bytes`: see `EventFile`."""
    self.logdir = os.fspath(logdir)
    self._writer = EventFile(
      logdir, flush_secs=flush_secs, max_queue=max_queue, rollover_bytes=rollover_bytes
    )
    self._enabled = jax.process_index() == 0

  def _write(self, step: int, values: list[summary_pb2.Summary.Value]) -> None:
    if not self._enabled or not values:
      return
    event = event_pb2.Event(
      wall_time=time.time(), step=int(step), summary=summary_pb2.Summary(value=values)
    )
    self._writer.add_event(event)

  def scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    """Writes one event holding every scalar of `scalars` (tag -> number) at `step`."""
    if not self._enabled:
      return
    host = jax.device_get(dict(scalars))
    values = [
      summary_pb2.Summary.Value(tag=tag, simple_value=_to_float(tag, value))
      for tag, value in host.items()
    ]
    self._write(step, values)

  def histograms(
    self, step: int, arrays: Mapping[str, Any], *, buckets: int = DEFAULT_BUCKETS
  ) -> None:
    """Writes a histogram of every array of `arrays` (tag -> array of any shape) at `step`.

    Non-finite entries are left out of the buckets.
    """
    if not self._enabled:
      return
    host = jax.device_get(dict(arrays))
    values = []
    for tag, array in host.items():
      x = np.asarray(array, dtype=np.float64).ravel()
      values += histogram_summary.histogram_pb(tag, x[np.isfinite(x)], buckets=buckets).value
    self._write(step, values)

  def text(self, step: int, tag: str, markdown: str) -> None:
    """Writes `markdown` under `tag` at `step` (shown rendered in TensorBoard's TEXT tab)."""
    if not self._enabled:
      return
    self._write(step, list(text_summary.text_pb(tag, markdown).value))

  def hparams(
    self,
    hparams: Mapping[str, bool | int | float | str],
    metrics: Sequence[tuple[str, str, str]],
    *,
    trial_id: str,
    start_time: float,
    varied: Sequence[str] = (),
  ) -> None:
    """Writes an HParams session for this run: the experiment's columns (`hparams` names, each
    typed by its value, and `metrics` as (tag, display name, description)) and the session's
    values, at step 0. The columns named in `varied` (a sweep's) are marked as differing, so
    TensorBoard's HParams tab sorts them first and shows them when it opens.

    TensorBoard's HParams tab lists every run of a logdir that holds one, with the final
    value of each metric tag the run itself logged.
    """
    if not self._enabled:
      return
    declared = [
      hparams_summary.Metric(tag, display_name=name, description=text).as_proto()
      for tag, name, text in metrics
    ]
    columns = [
      api_pb2.HParamInfo(name=name, type=_hparam_type(value), differs=name in varied)
      for name, value in hparams.items()
    ]
    experiment = _plugin_summary(
      hparams_metadata.EXPERIMENT_TAG,
      plugin_data_pb2.HParamsPluginData(
        experiment=api_pb2.Experiment(
          hparam_infos=columns, metric_infos=declared, time_created_secs=start_time
        )
      ),
    )
    session = hparams_summary.hparams_pb(
      dict(hparams), trial_id=trial_id, start_time_secs=start_time
    )
    self._write(0, list(experiment.value) + list(session.value))

  def restart(self, step: int) -> None:
    """Marks a launch that logs from `step` on: TensorBoard's loaders drop every event an
    earlier launch logged at `step` or later (a run resumed from an older checkpoint than the
    step it had reached relogs those steps). The first such mark of a run drops nothing."""
    if self._enabled:
      start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
      self._writer.add_event(
        event_pb2.Event(wall_time=time.time(), step=int(step), session_log=start)
      )

  def session_end(self, step: int, status: str = "success") -> None:
    """Marks the HParams session ended with `status` (success | failure | running)."""
    if not self._enabled:
      return
    code = {
      "success": api_pb2.STATUS_SUCCESS,
      "failure": api_pb2.STATUS_FAILURE,
      "running": api_pb2.STATUS_RUNNING,
    }[status]
    end = plugin_data_pb2.SessionEndInfo(status=code, end_time_secs=time.time())
    data = plugin_data_pb2.HParamsPluginData(session_end_info=end)
    self._write(step, list(_plugin_summary(hparams_metadata.SESSION_END_INFO_TAG, data).value))

  def flush(self) -> None:
    """Writes pending events to the event file."""
    self._writer.flush()

  def close(self) -> None:
    """Flushes and closes the event file; later calls are no-ops."""
    self._writer.close()
    self._enabled = False

  def __enter__(self) -> SummaryWriter:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _to_float(key: str, value: Any) -> float:
  arr = np.asarray(value)
  if arr.size != 1:
    raise ValueError(f"metric {key!r} is not a scalar: shape {arr.shape}")
  return float(arr.reshape(()))


def flatten_metrics(nested: Mapping[str, Any], sep: str = "/") -> dict[str, float]:
  """Flattens nested metric dicts to `{'a/b': float}`, with one `jax.device_get` for all.

  Raises ValueError naming the key of any value that is not a scalar.
  """
  host = jax.device_get(nested)
  flat: dict[str, float] = {}

  def visit(prefix: str, node: Any) -> None:
    if isinstance(node, Mapping):
      for k, v in node.items():
        visit(f"{prefix}{sep}{k}" if prefix else str(k), v)
    else:
      flat[prefix] = _to_float(prefix, node)

  visit("", host)
  return flat


def format_duration(seconds: float) -> str:
  """Formats seconds as `h:mm:ss` (hours are not wrapped at 24); '?' when unknown."""
  if not math.isfinite(seconds) or seconds < 0:
    return "?"
  total = round(seconds)
  return f"{total // 3600}:{total % 3600 // 60:02d}:{total % 60:02d}"


SHORT_NAMES = {  # progress-line names of the main scalars, most wanted first (a line too long
  # for its terminal drops them from the end; TensorBoard has every tag in full)
  "rollout/reward_mean": "reward",
  "rollout/accuracy": "acc",
  "policy/entropy": "ent",
  "kl/ref_kl": "kl",
  "rollout/length_mean": "len",
  "policy/clip_frac": "clip",
}
LINE_WIDTH = 80  # columns of the terminal a progress line must fit, its run's name included


class Progress:
  """Steps/s and ETA of a loop from a recent window of its steps, so a first step that
  compiles (or a slow start) does not skew them; and a progress line that fits a terminal."""

  def __init__(self, total_steps: int, window: int = 5):
    self.total_steps = total_steps
    self._marks: collections.deque[tuple[int, float]] = collections.deque(maxlen=window + 1)

  def mark(self, step: int, now: float | None = None) -> None:
    """Records that `step` finished at `now` (default: the current time). Mark the first step
    after compilation as the start."""
    self._marks.append((step, time.time() if now is None else now))

  @property
  def rate(self) -> float:
    """Steps per second over the window; nan until two marks exist."""
    if len(self._marks) < 2:
      return float("nan")
    (s0, t0), (s1, t1) = self._marks[0], self._marks[-1]
    return (s1 - s0) / (t1 - t0) if t1 > t0 and s1 > s0 else float("nan")

  @property
  def eta_s(self) -> float:
    """Seconds left at the window's rate; nan while unknown."""
    if not self._marks:
      return float("nan")
    rate = self.rate
    return (self.total_steps - self._marks[-1][0]) / rate if rate > 0 else float("nan")

  def line(
    self,
    step: int,
    metrics: Mapping[str, float] | None = None,
    width: int = LINE_WIDTH,
    clock: bool = True,
  ) -> str:
    """`step 100/1000 10% 12.3 steps/s ETA 0:01:14 | reward 0.52 acc 0.41 ...`: the scalars
    of `metrics` named in SHORT_NAMES, 3 significant digits, as many as fit in `width`
    characters (the skipped-update count, when there is one, always). Without the `clock`
    (step, rate, ETA: a pack's runs share one line of it): `step 100: reward 0.52 ...`."""
    pct = 100.0 * step / self.total_steps if self.total_steps > 0 else 100.0
    rate = self.rate
    speed = f"{rate:.3g} steps/s" if math.isfinite(rate) else "? steps/s"
    head = f"step {step}/{self.total_steps} {pct:.0f}% {speed} ETA {format_duration(self.eta_s)}"
    head, sep = (head, " | ") if clock else (f"step {step}", ": ")
    metrics = metrics or {}
    shown = [f"{short} {metrics[tag]:.3g}" for tag, short in SHORT_NAMES.items() if tag in metrics]
    always = []
    if metrics.get("optim/skipped_updates"):
      always.append(f"skipped {metrics['optim/skipped_updates']:.0f}")
    line = head
    while shown or always:
      line = sep.join([head, " ".join(shown + always)])
      if len(line) <= width or not shown:
        break
      shown.pop()
    return line


def read_scalars(logdir: str, *, damaged_ok: bool = False) -> dict[str, list[tuple[int, float]]]:
  """Reads every scalar in `logdir`'s event files: tag -> [(step, value)] in step order.
  Raises `event_files.EventFileError` for an event file damaged inside, unless
  `damaged_ok` (the events before the damage are read)."""
  if not damaged_ok and (damaged := damaged_event_files(logdir)):
    raise damaged[0]
  acc = load(logdir)
  return {  # event files of the same second may load in either order: sort (stably) by step
    tag: sorted(((e.step, e.value) for e in acc.Scalars(tag)), key=lambda sv: sv[0])
    for tag in acc.Tags()["scalars"]
  }


def read_tags(logdir: str) -> dict[str, Any]:
  """Tags in `logdir` as EventAccumulator reports them ('scalars', 'histograms', 'tensors', ...).

  Histograms and text are tensor summaries, so they appear under 'tensors'; 'plugins' maps
  each plugin name ('histograms', 'text', ...) to its tags.
  """
  acc = load(logdir)
  return {**acc.Tags(), "plugins": _plugin_tags(acc)}


def _plugin_tags(acc: event_accumulator.EventAccumulator) -> dict[str, list[str]]:
  plugins: dict[str, list[str]] = {}
  for tag in acc.Tags()["tensors"]:
    plugins.setdefault(acc.SummaryMetadata(tag).plugin_data.plugin_name, []).append(tag)
  return plugins


def read_histograms(logdir: str) -> dict[str, list[tuple[int, np.ndarray]]]:
  """Reads every histogram in `logdir`: tag -> [(step, [buckets, 3] array)]."""
  acc = load(logdir)
  return {
    tag: [(e.step, tensor_util.make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag)]
    for tag in _plugin_tags(acc).get(histogram_metadata.PLUGIN_NAME, [])
  }


def _hparam_type(value: Any) -> int:
  """The HParams column type of `value` (TensorBoard sorts and filters columns by it)."""
  if isinstance(value, bool):
    return api_pb2.DATA_TYPE_BOOL
  if isinstance(value, int | float):
    return api_pb2.DATA_TYPE_FLOAT64
  return api_pb2.DATA_TYPE_STRING


def _plugin_summary(tag: str, data) -> summary_pb2.Summary:
  """A summary holding HParams plugin `data` under `tag` (as the plugin's own writers do)."""
  summary = summary_pb2.Summary()
  empty = tensor_util.make_tensor_proto(np.array("", dtype=np.object_))  # as hparams_pb writes
  md = hparams_metadata.create_summary_metadata(data)
  summary.value.add(tag=tag, metadata=md, tensor=empty)
  return summary


def read_hparams(logdir: str) -> dict[str, Any]:
  """The HParams plugin data of `logdir`'s event files: {'hparams': {name: value},
  'sessions': starts written, 'metrics': [tag, ...] and 'columns': [name, ...] (the
  experiment's declared columns), 'status': 'success' | 'failure' | 'running' when ended}.
  Empty when the run wrote no session."""
  acc = load(logdir)
  out: dict[str, Any] = {}
  for tag in _plugin_tags(acc).get(hparams_metadata.PLUGIN_NAME, []):
    content = acc.SummaryMetadata(tag).plugin_data.content
    data = plugin_data_pb2.HParamsPluginData.FromString(content)
    kind = data.WhichOneof("data")
    if kind == "session_start_info":
      hp = data.session_start_info.hparams
      out["hparams"] = {k: _hparam_value(v) for k, v in hp.items()}
      out["sessions"] = len(acc.Tensors(tag))  # session starts written (1 for one run)
    elif kind == "experiment":
      out["metrics"] = [m.name.tag for m in data.experiment.metric_infos]
      out["columns"] = [h.name for h in data.experiment.hparam_infos]
    elif kind == "session_end_info":
      status = data.session_end_info.status
      out["status"] = api_pb2.Status.Name(status).removeprefix("STATUS_").lower()
  return out


def hparams_table(root: str) -> list[dict[str, Any]]:
  """The session groups TensorBoard's HParams tab shows for `--logdir=root`, computed by the
  hparams plugin's own backend: one {'name', 'hparams': {..}, 'metrics': {tag: value},
  'status'} per run that wrote a session (metric values are each tag's last value)."""
  from tensorboard import context as tb_context
  from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
  from tensorboard.plugins import base_plugin
  from tensorboard.plugins.hparams import backend_context, list_session_groups

  mux = plugin_event_multiplexer.EventMultiplexer()
  mux.AddRunsFromDirectory(os.fspath(root))
  mux.Reload()
  provider = data_provider.MultiplexerDataProvider(mux, os.fspath(root))
  tb = base_plugin.TBContext(logdir=os.fspath(root), multiplexer=mux, data_provider=provider)
  statuses = [api_pb2.STATUS_UNKNOWN, api_pb2.STATUS_SUCCESS]
  statuses += [api_pb2.STATUS_FAILURE, api_pb2.STATUS_RUNNING]
  request = api_pb2.ListSessionGroupsRequest(
    start_index=0, slice_size=100_000, allowed_statuses=statuses
  )
  handler = list_session_groups.Handler(
    tb_context.RequestContext(), backend_context.Context(tb), "", request
  )
  rows = []
  for group in handler.run().session_groups:
    status = [api_pb2.Status.Name(s.status).removeprefix("STATUS_").lower() for s in group.sessions]
    rows.append(
      {
        "name": group.name,
        "hparams": {k: _hparam_value(v) for k, v in group.hparams.items()},
        "metrics": {m.name.tag: m.value for m in group.metric_values},
        "status": status[0] if len(status) == 1 else status,
      }
    )
  return sorted(rows, key=lambda r: r["name"])


def _hparam_value(value) -> Any:
  kind = value.WhichOneof("kind")
  return None if kind is None else getattr(value, kind)


def read_text(logdir: str) -> dict[str, list[tuple[int, str]]]:
  """Reads every text summary in `logdir`: tag -> [(step, markdown)] in step order (event
  files of the same second may load in either order: sorted, stably, by step)."""
  acc = load(logdir)
  out = {}
  for tag in _plugin_tags(acc).get(text_metadata.PLUGIN_NAME, []):
    rows = []
    for e in acc.Tensors(tag):
      value = tensor_util.make_ndarray(e.tensor_proto).item()
      rows.append((e.step, value.decode() if isinstance(value, bytes) else str(value)))
    out[tag] = sorted(rows, key=lambda row: row[0])
  return out
