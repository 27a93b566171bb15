"""What a run says about itself: `config.json`, the config text table and the HParams session
in TensorBoard, the start banner and the closing summary on the terminal."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from absl import logging

from jaxrl_llm import __version__, backend, metric_info, paths
from jaxrl_llm import metrics as metrics_lib
from jaxrl_llm.config import HPARAM, INVOCATION, PER_RUN, STATE, Config, tagged
from jaxrl_llm.models import lora
from jaxrl_llm.run import changes


def _commit() -> str | None:
  """The git commit of the installed package's checkout, when it is one."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  try:
    out = subprocess.run(
      ["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
    )
  except (OSError, subprocess.SubprocessError):
    return None
  return out.stdout.strip() or None


def hparam_columns(cfg: Config) -> tuple[str, ...]:
  """The HParams columns of every run: the settings declared as such (`config.HPARAM`) and the
  selected objective's own numeric hyperparameters (its clip widths or temperatures)."""
  own = [f"objective.{k}" for k in cfg.objective.hyperparameters]
  traced = [f for f in tagged(PER_RUN) if f in own]
  return tuple(dict.fromkeys([*tagged(HPARAM), *traced]))


def run_hparams(
  cfg: Config, params=None, extra: Sequence[str] = ()
) -> dict[str, bool | int | float | str]:
  """The run's HParams: the fields named in `extra` (those a sweep varies, or the command line
  sets) first, so TensorBoard's HParams tab shows them as its first columns, then
  `hparam_columns`, and the parameter count when `params` is given. Unset fields read
  'default'."""
  out: dict[str, bool | int | float | str] = {}
  for field in dict.fromkeys([*extra, *hparam_columns(cfg)]):
    node = cfg.value(field)
    if isinstance(node, bool | int | float | str):
      out[field] = node
    else:
      out[field] = "default" if node is None else json.dumps(node)
  if params is not None:
    out["params"] = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  return out


MAX_FOLDER_NAME = 200  # characters of a run's folder name (file systems cap names at 255 bytes)


def folder_name(params: Mapping[str, object]) -> str:
  """A run's folder name from its varied fields: `a.b=1,c=x` (`run` when none; characters
  unsafe in a path become '_'; a very long name ends in a hash). The one naming of runs, for
  `tools/sweep.py`'s workdirs and a pack's folders alike."""
  import hashlib
  import re

  name = ",".join(f"{k}={v}" for k, v in params.items()) or "run"
  name = re.sub(r"[^A-Za-z0-9._=,+@-]", "_", name)
  if len(name) > MAX_FOLDER_NAME:
    digest = hashlib.sha1(name.encode()).hexdigest()[:10]
    name = f"{name[: MAX_FOLDER_NAME - 11]}~{digest}"
  return name


TRIAL_WIDTH = 16  # characters TensorBoard's HParams table shows of a trial id before cutting it


def trial_name(cfg: Config, fields: Sequence[str], fallback: str) -> str:
  """A trial id from `fields`' values short enough for TensorBoard's HParams table
  (`TRIAL_WIDTH`): each field as its initials and value (`ch0.28 t1.0 s1` for
  objective.clip_high, sampling.temperature and the seed, which is added when a field is given);
  the values alone when that is too long or two initials are the same; `fallback` when no field
  is given. The columns beside it hold the full names and values."""
  if not fields:
    return fallback
  names = [*dict.fromkeys([*fields, *tagged(PER_RUN, STATE)])]
  values = [str(cfg.value(name)) for name in names]
  initials = ["".join(w[:1] for w in n.rsplit(".", 1)[-1].split("_")) for n in names]
  forms = [" ".join(values)]
  if len(set(initials)) == len(initials):
    forms.insert(0, " ".join(map("".join, zip(initials, values))))
  return next((f for f in forms if len(f) <= TRIAL_WIDTH), forms[-1])


def _config_table(cfg: Config, record: Mapping, name: str) -> str:
  """The config as a markdown table of dotted fields, and where and with what it ran."""
  rows = ["| field | value |", "|---|---|"]
  rows += [f"| `{k}` | `{json.dumps(v)}` |" for k, v in sorted(cfg.flat().items())]
  rows.append(f"\n{name}: jaxrl_llm {__version__}, JAX {jax.__version__}, ")
  rows[-1] += f"{record['backend']} x {record['devices']} devices, commit {record['commit']}"
  return "\n".join(rows)


STOPPED = "stopped.json"  # in a pack's run folder: the run its guards stopped, and why


def write_stopped(workdir: str, step: int, why: str) -> None:
  """Records in `workdir` that its run stopped at `step` for `why` (process 0): a relaunch of
  the pack keeps it stopped, and `tools/sweep.py` marks it failed."""
  if jax.process_index() == 0:
    paths.write_text(paths.join(workdir, STOPPED), json.dumps({"step": step, "why": why}))


def read_stopped(workdir: str) -> dict | None:
  """{step, why} of a run stopped earlier (`write_stopped`), or None."""
  path = paths.join(workdir, STOPPED)
  if not paths.exists(path):
    return None
  try:
    return json.loads(paths.read_text(path))
  except ValueError:  # a torn write: it stopped; why is lost
    return {"step": -1, "why": "stopped (its record is unreadable)"}


def results_fields(fields):
  """A config record (its `config` object) less the settings that only end or pace an
  invocation (declared `invocation=True`: `train.stop_after_steps`, ...): a relaunch that
  changes only those writes no new record, and plots group runs without them."""
  if not isinstance(fields, dict):
    return fields
  out = dict(fields)
  for name in tagged(INVOCATION):
    section, _, field = name.partition(".")
    if isinstance(out.get(section), dict):
      out[section] = {k: v for k, v in out[section].items() if k != field}
  return out


def _set_aside_unsaved(workdir: str, step: int) -> None:
  """Renames `changes.unsaved_records` (a resume at `step`) to `<name>.unsaved-<time>.json`
  with a warning: no saved step ran under their settings, so they describe no checkpoint."""
  stamp = time.strftime("%Y%m%dT%H%M%S")
  for name in changes.unsaved_records(workdir, step):
    aside = f"{name.removesuffix('.json')}.unsaved-{stamp}.json"
    paths.rename(paths.join(workdir, name), paths.join(workdir, aside))
    logging.warning(
      "%s: the launch that wrote %s saved no step after it, so no checkpoint ran under its "
      "settings: moved aside to %s",
      workdir, name, aside,
    )  # fmt: skip


def record_run(
  cfg: Config,
  workdir: str,
  writer,
  step: int,
  hparams: Mapping[str, bool | int | float | str] | None = None,
  trial: str | None = None,
  varied: Sequence[str] = (),
) -> str | None:
  """Records the run's resolved config in `workdir` (process 0): `config.json` with every field
  after overrides, the selected objective's hyperparameters as it uses them (`resolved`:
  defaults filled in), the package version and commit, JAX version, backend and device count,
  the same fields as a TensorBoard text table (tag `config`), and `hparams` as the run's
  HParams session named `trial` (default: the workdir's name; metrics:
  `metric_info.HPARAMS_METRICS`; `varied`: the columns a sweep varies, shown first), with the
  prompt files' sizes and hashes (`changes.data_files`). A resumed run with the config and files
  of the latest launch (`changes.newest_record`) writes nothing; one with a changed config writes
  `config.resume-<step>.json` (and a new table at `step`; the HParams session stays the first
  one). Returns the file written, or None."""
  if jax.process_index() != 0:
    return None
  if step > 0:
    _set_aside_unsaved(workdir, step)
  fields, latest = json.loads(cfg.to_json()), changes.newest_record(workdir)
  files = changes.data_files(cfg)
  first = latest is None
  if (
    not first
    and results_fields(latest.get("config")) == results_fields(fields)
    and latest.get("data_files", files) == files
  ):
    return None
  path = paths.join(workdir, "config.json" if first else f"config.resume-{step}.json")
  record = {
    "config": fields,
    # What the selected objective uses: an unset hyperparameter (null above) as its default.
    "resolved": {f"objective.{k}": v for k, v in cfg.objective.hyperparameters.items()},
    "jaxrl_llm": __version__,
    "commit": _commit(),
    "jax": jax.__version__,
    "backend": jax.default_backend(),
    "devices": jax.device_count(),
    "processes": jax.process_count(),
    "step": step,
    "data_files": files,
    "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
  }
  paths.makedirs(workdir)
  paths.write_text(path, json.dumps(record, indent=2, sort_keys=True))
  writer.text(step, "config", _config_table(cfg, record, paths.as_path(path).name))
  if first and hparams:
    declared = [
      (tag, name, metric_info.info(tag).meaning) for tag, name in metric_info.HPARAMS_METRICS
    ]
    trial = trial or paths.as_path(workdir).name
    writer.hparams(hparams, declared, trial_id=trial, start_time=time.time(), varied=varied)
  return path


def settings(record: Mapping) -> dict[str, object]:
  """A `config.json` record's fields as {dotted name: value}, each objective hyperparameter as
  the run used it (`changes.as_used`: its `resolved` entry, an unset field's default). Raises
  KeyError/TypeError/AttributeError where `record` has no {"config": {...}}."""

  def flat(tree: Mapping, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in tree.items():
      if isinstance(v, dict) and v:
        out |= flat(v, f"{prefix}{k}.")
      else:
        out[f"{prefix}{k}"] = v
    return out

  if not isinstance(record["config"], Mapping):
    raise TypeError(f"its config is a {type(record['config']).__name__}, not an object")
  return flat(changes.as_used(record))


def parameter_counts(params, mc) -> tuple[int, int]:
  """(total, active per token) parameter counts: a MoE layer's experts count top_k / E."""
  total = active = 0
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    n = int(np.prod(x.shape))
    keys = [getattr(k, "key", "") for k in path]
    total += n
    if mc.moe_num_experts and "moe" in keys and keys[-1] in ("gate", "up", "down"):
      n = n * mc.moe_top_k // mc.moe_num_experts
    active += n
  return total, active


def log_banner(
  params, mc, mesh, workdir: str, cfg: Config | None = None, rl=None, varied: Sequence[str] = ()
) -> None:
  """The run's first lines: what runs where, what it optimises (`cfg`'s objective, a
  hyperparameter a pack `varied` said so, and the resolved `rl` microbatching and remat), and
  how to watch it."""
  total, active = parameter_counts(params, mc)
  shown = f"{total / 1e6:.3g}M parameters"
  if active != total:
    shown += f" ({active / 1e6:.3g}M active per token)"
  if lora.has_adapters(params):  # only the adapters train
    n = sum(x.size for x in jax.tree.leaves(lora.split_adapters(params)[1]))
    shown += f", {n / 1e6:.3g}M of them trained (rank-{mc.lora_rank} adapters)"
  axes = " x ".join(f"{k}={v}" for k, v in mesh.shape.items() if v > 1) or "one device"
  device = jax.devices()[0]
  logging.info(
    "jaxrl_llm %s | JAX %s | %s (%s) x %d devices, %d process(es) | mesh %s | %s",
    __version__,
    jax.__version__,
    device.platform,
    device.device_kind,
    jax.device_count(),
    jax.process_count(),
    axes,
    shown,
  )
  backend.log_fallback()
  if cfg is not None and rl is not None:
    hparams = ", ".join(
      f"{k} {'by run' if f'objective.{k}' in varied else v}"
      for k, v in cfg.objective.hyperparameters.items()
    )
    logging.info(
      "objective %s (%s) | learner: %d microbatch(es) per minibatch, remat %s",
      cfg.objective.name,
      hparams or "no hyperparameters",
      rl.num_microbatches,
      rl.remat,
    )
  logging.info("workdir %s | watch it: tensorboard --logdir %s", workdir, shlex.quote(workdir))


def text_summary(task, m: Mapping, limit: int) -> str:
  """A markdown table of the first `limit` sampled prompts, completions and rewards."""
  prompts, comps, rewards = m["samples/prompt"], m["samples/tokens"], m["samples/reward"]
  rows = ["| prompt | completion | reward |", "|---|---|---|"]
  for p, c, r in list(zip(prompts, comps, rewards))[:limit]:
    prompt_str, comp_str = task.describe(p, c)
    rows.append(f"| `{prompt_str}` | `{comp_str}` | {float(r):.2f} |")
  return "\n".join(rows)


def log_summary(
  workdir: str,
  checkpoints: str,
  span: tuple[int, int],
  times: tuple[float, float, float, float],
  tokens: float,
  evals: Sequence[tuple[int, Mapping[str, float]]],
  compiling_s: float = 0.0,
  label: str = "",
) -> None:
  """The run's last lines: steps, the RL loop's time and the whole wall time, RL steps/s and
  generated tokens/s after compilation, evaluations and the last save in the time (`times` =
  wall seconds, loop started at, compiled at, ended at; `compiling_s`: seconds after the first step spent compiling the held-out
  evaluation, left out of the rates), first and last evaluation, and where checkpoints and
  events are; each line begins with `label` (a pack's run: `[ch0.28 s0] `)."""
  (start, end), (wall_s, t_loop, t_compiled, t_end) = span, times
  steady = max(t_end - t_compiled - compiling_s, 1e-9)
  if end - start > 1:
    also = " and the evaluation's compilation" if compiling_s else ""
    rates = (
      f"{(end - start - 1) / steady:.3g} steps/s, {tokens / steady:.3g} generated tokens/s "
      f"after the first (compiling) step{also}, evaluations and the last save in the time"
    )
  else:  # "nan steps/s" before: the one step there was compiled, and no step came after it
    rates = f"{end - start} step{'' if end - start == 1 else 's'}: no rate after the first (compiling) one"
  logging.info(
    "%strained RL steps %d..%d in %s (the RL loop, of which %s %scompiling and the first step; "
    "%s wall time from the model's building on) | %s",
    label,
    start,
    end,
    metrics_lib.format_duration(t_end - t_loop),
    metrics_lib.format_duration(t_compiled - t_loop),
    "the first evaluation, " if start == 0 else "",  # a fresh run evaluates before step 1
    metrics_lib.format_duration(wall_s),
    rates,
  )
  if evals:
    (s0, first), (s1, last) = evals[0], evals[-1]
    pairs = [
      f"{k.removeprefix('eval/')} {first[k]:.3g} -> {last[k]:.3g}"
      for k in sorted(last, key=metric_info.tag_order)
      if k in first
    ]
    if s1 != s0:
      logging.info("%seval from step %d to %d: %s", label, s0, s1, ", ".join(pairs))
  logging.info(
    "%scheckpoints in %s | events in %s: tensorboard --logdir %s",
    label,
    checkpoints,
    workdir,
    shlex.quote(workdir),
  )
