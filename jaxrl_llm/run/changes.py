"""What a relaunch changed since its run recorded itself (`record.record_run`): the newest run
record, the learned settings, the switches on or off, the prompt files and their tokenizer, and
the learning-rate schedule. The resume's checks (`run.loop`) and the study tools read it."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping

from jaxrl_llm import paths
from jaxrl_llm.config import SWITCH, Config, ConfigError, blocks_resume, tagged


def _resume_records(workdir: str) -> dict[str, int]:
  """{name: step} of `workdir`'s `config.resume-<step>.json` records."""
  names = [p.name for p in paths.listdir(workdir)]
  steps = {n: n[len("config.resume-") : -len(".json")] for n in names}
  return {n: int(s) for n, s in steps.items() if n.startswith("config.resume-") and s.isdigit()}


def unsaved_records(workdir: str, step: int) -> list[str]:
  """The `config.resume-<s>.json` records of `workdir` with s >= `step`, for a resume at
  `step`: the launches that wrote them saved no step after s, so nothing saved ran under
  their settings (a launch stopped while it compiled, or killed before its next checkpoint)."""
  if not paths.is_dir(workdir):
    return []
  return sorted(n for n, s in _resume_records(workdir).items() if s >= step)


def newest_record_path(workdir: str, before: int | None = None) -> str | None:
  """The path of the run record of `workdir` the latest launch wrote: its newest
  `config.resume-<step>.json`, else `config.json`; None without either. `before`: the step a
  resume starts at, whose state the records of earlier steps alone describe
  (`unsaved_records`)."""
  if not paths.is_dir(workdir):
    return None
  records = {p.name: p for p in paths.listdir(workdir)}
  steps = _resume_records(workdir)
  resumes = [n for n, s in steps.items() if before is None or s < before]
  newest = max(resumes, key=lambda n: steps[n], default=None)
  name = newest or ("config.json" if "config.json" in records else None)
  return None if name is None else paths.join(workdir, name)


A_MODEL = (
  "a Hugging Face model's config.json, not a run record: this folder holds a model; give the "
  "run a --workdir of its own (model.checkpoint may name this folder)"
)


def holds_a_model(workdir: str) -> bool:
  """Whether the local `workdir`'s config.json is a Hugging Face model's (a model_type and no
  run config), so that a run there would write into the model's folder."""
  try:
    with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
      record = json.load(f)
  except (OSError, ValueError):  # none, or not JSON: the run record's own checks say so
    return False
  return isinstance(record, dict) and "config" not in record and "model_type" in record


def newest_record(workdir: str, before: int | None = None) -> dict | None:
  """The run record of `workdir` the latest launch wrote (`newest_record_path`, `before` as
  there); None without one."""
  path = newest_record_path(workdir, before)
  if path is None:
    return None
  fix = (
    "restore it, or move it aside to resume (the run then records its config anew, and what "
    "changed since cannot be checked)"
  )
  try:
    record = json.loads(paths.read_text(path))
  except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError is a ValueError
    raise ConfigError(f"{path}: the run record is not valid JSON ({err}); {fix}") from None
  if isinstance(record, dict) and "config" not in record and "model_type" in record:
    raise ConfigError(f"{path}: {A_MODEL}")
  if not (isinstance(record, dict) and isinstance(record.get("config"), dict)):
    raise ConfigError(f'{path}: the run record is not an object with a "config" object; {fix}')
  return record


def as_used(record: Mapping) -> dict:
  """A config record's `config` with each objective hyperparameter as the run used it (its
  `resolved` entry: an unset field's default), so unset and the default said are one value."""
  config = dict(record.get("config") or {})
  resolved = record.get("resolved")
  for key, value in (resolved if isinstance(resolved, dict) else {}).items():
    section, _, name = key.partition(".")
    if isinstance(config.get(section), dict) and name in config[section]:
      config[section] = {**config[section], name: value}
  return config


def changed_learner(cfg: Config, workdir: str, before: int | None = None) -> list[str]:
  """`section.field: saved → now` for the seed and each learner field whose value differs from
  the run recorded in `workdir` (its newest `config.resume-<step>.json`, else `config.json`; empty
  without either; `before` as `newest_record_path`'s); objective hyperparameters compared as
  used (unset: the default)."""
  record = newest_record(workdir, before)
  if record is None:
    return []
  # A record from before `resolved` is compared as written (unset with unset).
  has = isinstance(record.get("resolved"), dict)
  resolved = {f"objective.{k}": v for k, v in cfg.objective.hyperparameters.items()} if has else {}
  saved = as_used(record)
  now = as_used({"config": json.loads(cfg.to_json()), "resolved": resolved})
  out = []  # the seed: the prompts' order and the evaluation's draws after the resume
  if "seed" in saved and saved["seed"] != now["seed"]:
    out.append(f"seed: {saved['seed']!r} → {now['seed']!r}")
  for section in Config.sections():
    old, new = saved.get(section, {}), now.get(section, {})
    for name in sorted(set(old) | set(new)):
      if not blocks_resume(f"{section}.{name}") or name not in old:  # added since: no change
        continue
      if old.get(name) != new.get(name):
        out.append(f"{section}.{name}: {old.get(name)!r} → {new.get(name)!r}")
  return out + _split_changed(saved.get("data", {}), now.get("data", {}))


def _split_changed(old: dict, new: dict) -> list[str]:
  """`data.eval_files: saved → now` where held-out files came or went on prompt files split by
  `data.eval_fraction`: the records that train change with them (another held-out file is no
  change)."""
  split = old.get("train_files") and old.get("eval_fraction", 0) > 0
  if not split or bool(old.get("eval_files")) == bool(new.get("eval_files")):
    return []
  how = "no longer split off the train files" if new.get("eval_files") else "split off them again"
  return [
    f"data.eval_files: {old.get('eval_files')!r} → {new.get('eval_files')!r} (the held-out "
    f"share data.eval_fraction={old['eval_fraction']} is {how}: other records train)"
  ]


def switched(cfg: Config, workdir: str, before: int | None = None) -> list[str]:
  """`section.field: saved → now` for each field that switches a term on or off (`SWITCH`: > 0
  or 0; kl.beta's reference model, optim.grad_clip's element of the optimiser state) across 0
  since the run recorded in `workdir` (`before` as `newest_record_path`'s): what a checkpoint
  holds differs, so no resume crosses it."""
  saved = newest_record(workdir, before)
  if saved is None:
    return []
  saved, now = saved.get("config", {}), json.loads(cfg.to_json())
  out = []
  for field in tagged(SWITCH):
    section, name = field.split(".")
    old, new = saved.get(section, {}).get(name), now.get(section, {}).get(name)
    if isinstance(old, int | float) and isinstance(new, int | float) and (old > 0) != (new > 0):
      out.append(f"{field}: {old!r} → {new!r}")
  return out


TOKENIZER = "tokenizer"  # data_files' entry of the prompts' tokenizer: its vocabulary


def data_files(cfg: Config) -> dict[str, dict[str, int | str]]:
  """{path: {"bytes", "sha256"}} of each prompt file `data.train_files` names (a glob: each
  file it matches), as read now, and under TOKENIZER {"tokens", "sha256"} of the vocabulary of
  the tokenizer it is read with (`data.tokenizer`, else model.checkpoint's; wherever it lies):
  the run record keeps them, so a resume finds a file whose contents changed at the same path,
  or prompts read through other ids. Empty for the built-in task."""
  import hashlib

  from jaxrl_llm.data import records, tokenizers

  out = {}
  for spec in (f.strip() for f in cfg.data.train_files.split(",")):
    for path in (p for p in records.matches(spec) if p and os.path.isfile(p)):
      digest = hashlib.sha256()
      with open(path, "rb") as f:
        for chunk in iter(lambda f=f: f.read(1 << 20), b""):
          digest.update(chunk)
      out[path] = {"bytes": os.path.getsize(path), "sha256": digest.hexdigest()}
  if out and (
    vocabulary := tokenizers.vocabulary_digest(cfg.data.tokenizer or cfg.model.checkpoint)
  ):
    out[TOKENIZER] = vocabulary
  return out


def changed_data(cfg: Config, workdir: str, before: int | None = None) -> list[str]:
  """`data file PATH: saved → now` for each prompt file (`data_files`) whose size or contents
  differ from those the run recorded in `workdir` (`newest_record`), or that it did not read
  or no longer reads (none where the same bytes are read in the same order under other paths:
  a relative path, a moved folder, a glob), and `tokenizer vocabulary: saved → now` where the prompts' tokenizer has
  other tokens or ids (another path or chat template is no change). Empty without a record,
  or with one older than these fields (compat); `before` as `newest_record_path`'s."""
  saved = newest_record(workdir, before)
  if saved is None or "data_files" not in saved:
    return []
  old, new = dict(saved["data_files"]), data_files(cfg)
  if TOKENIZER not in old:  # recorded before the vocabulary was: nothing to compare
    new.pop(TOKENIZER, None)

  def shown(entry):
    if entry is None:
      return "none"
    size = f"{entry['tokens']} tokens" if "tokens" in entry else f"{entry['bytes']} bytes"
    return f"{size}, sha256 {entry['sha256'][:12]}"

  def files(entries):  # the files' sizes and digests in the order the run reads them
    return [entry for key, entry in entries.items() if key != TOKENIZER]

  keys = set(old) | set(new)
  if files(old) == files(new):  # the same bytes in the same order, however the paths are spelt
    keys = {TOKENIZER}
  name = {TOKENIZER: "tokenizer vocabulary"}
  return [
    f"{name.get(key, f'data file {key}')}: {shown(old.get(key))} → {shown(new.get(key))}"
    for key in sorted(keys)
    if old.get(key) != new.get(key)
  ]


def resume_notes(members, step: int) -> list[str]:
  """What a resume at `step` should say of the runs (`members`: .prefix, .config, .workdir)
  beyond a changed setting: a learning-rate schedule moved (`schedule_moved`), and a run with
  checkpoints but no record (config.json moved aside or lost), whose settings and prompt files
  nothing can check."""
  moved = "; ".join(
    m.prefix + x for m in members if (x := schedule_moved(m.config, m.workdir, step))
  )
  bare = [m.workdir for m in members if step > 0 and newest_record_path(m.workdir, step) is None]
  notes = [f"on another learning-rate schedule: {moved}"] if moved else []
  return notes + [
    f"without a run record in {w} (config.json): the settings and prompt files of its "
    "checkpoints' run cannot be checked against these; this launch records them anew"
    for w in bare
  ]


def schedule_moved(cfg: Config, workdir: str, step: int) -> str | None:
  """`learning rate at update U: saved → now` where `cfg`'s schedule (`Config.schedule_updates`
  long, shaped by optim.*) differs at `step` from the one `workdir` recorded."""
  try:
    rec = newest_record(workdir, step)["config"]
    sections = {n: type(getattr(cfg, n)).from_section(rec[n]) for n in ("optim", "rl", "train")}
    saved = dataclasses.replace(cfg, **sections)
  except (KeyError, TypeError, ValueError):  # no record, or one of another shape: no comparison
    return None
  at = step * saved.updates_per_step  # the optimiser's update count in the checkpoint
  was, now = (float(x.optim.build(x.schedule_updates)[1](at)) for x in (saved, cfg))
  if step > 0 and abs(was - now) > 1e-6 * max(abs(was), abs(now)):
    total, now_total = saved.schedule_updates, cfg.schedule_updates
    return f"learning rate at update {at}: {was:.3g} → {now:.3g} ({total} → {now_total} updates)"
  return None
