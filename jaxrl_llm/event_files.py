"""Event files damaged inside: TensorBoard's reader stops at a record whose checksum does not
match without a word, so every event after it would be silently lost (a run read as shorter).
`check_event_file` walks tensorboard's own record framing (length, its masked CRC-32C, data, its
CRC) with tensorboard's own checksum; `metrics.read_scalars` refuses such a file unless asked
to read what precedes the damage. `load` is the one reader the `metrics` readers go through."""

from __future__ import annotations

import os
import struct

from tensorboard.backend.event_processing import event_accumulator
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

from jaxrl_llm import metric_info, paths

__all__ = ["EventFileError", "check_event_file", "damaged_event_files", "load"]


class EventFileError(ValueError):
  """An event file damaged inside: TensorBoard's reader stops at the record without a word;
  `offset` is the byte where (0: nothing of it reads)."""

  def __init__(self, message: str, offset: int):
    super().__init__(message)
    self.offset = offset


def check_event_file(path: str) -> None:
  """Raises EventFileError when event file `path` holds a record whose length or data does
  not match its checksum (TensorBoard's framing: length, its masked CRC-32C, data, its CRC).
  A last record cut short (a writer killed mid-write) is no damage: the readers skip it."""
  data, offset = paths.as_path(path).read_bytes(), 0
  while len(data) - offset >= 12:
    header, header_crc = data[offset : offset + 8], data[offset + 8 : offset + 12]
    if struct.pack("<I", masked_crc32c(header)) != header_crc:
      break
    length = struct.unpack("<Q", header)[0]
    body = data[offset + 12 : offset + 12 + length]
    footer = data[offset + 12 + length : offset + 16 + length]
    if len(footer) < 4:
      return  # cut short at the end
    if struct.pack("<I", masked_crc32c(body)) != footer:
      break
    offset += 16 + length
  else:
    return
  raise EventFileError(
    f"{path}: damaged at byte {offset} of {len(data)} (a record does not match its checksum); "
    "TensorBoard reads no event after it",
    offset,
  )


def damaged_event_files(logdir: str) -> list[EventFileError]:
  """The EventFileError of each event file of `logdir` damaged inside (`check_event_file`), in
  name order."""
  out = []
  for path in paths.listdir(logdir):
    if metric_info.is_event_file(path.name) and path.is_file():
      try:
        check_event_file(str(path))
      except EventFileError as e:
        out.append(e)
  return out


def _resumed_past(record) -> bool:
  """False for TensorBoard's note that it drops the events a resumed run logged again
  ("Detected out of order event.step ..."): the purge the trainer's restart asks for, not a
  fault to report each time a workdir is read."""
  return "out of order event" not in record.getMessage()


class _Accumulator(event_accumulator.EventAccumulator):
  """TensorBoard's reader, whose purge at a restart mark (`SummaryWriter.restart`: a resumed
  launch) also drops the tensor summaries (text, histograms) an earlier launch logged at that
  step or later, as it drops scalars; TensorBoard's own plugin reader drops them too."""

  def _Purge(self, event, by_tags):
    super()._Purge(event, by_tags)
    if not by_tags:
      self.tensors.FilterItems(lambda x: x.step < event.step)


def load(logdir: str) -> event_accumulator.EventAccumulator:
  """Every event in `logdir`'s event files, as TensorBoard's reader keeps them (nothing
  sampled away; what a resumed launch logged again replaces the earlier launch's, tensor
  summaries included); the readers of `metrics` read through it. EventFileError for a folder
  named like an event file (the reader fails on it)."""
  from tensorboard.util import tb_logging

  for path in paths.listdir(logdir) if paths.is_dir(logdir) else []:
    if metric_info.is_event_file(path.name) and path.is_dir():
      raise EventFileError(
        f"{path}: a folder named like an event file, which TensorBoard's reader fails on (no "
        f"event of {logdir} reads): move it out of there",
        0,
      )
  guidance = {k: 0 for k in event_accumulator.STORE_EVERYTHING_SIZE_GUIDANCE}
  logger = tb_logging.get_logger()
  logger.addFilter(_resumed_past)
  try:
    return _Accumulator(os.fspath(logdir), size_guidance=guidance).Reload()
  finally:
    logger.removeFilter(_resumed_past)
