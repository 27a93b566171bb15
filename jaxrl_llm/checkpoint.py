"""Orbax checkpoints of the training loop: TrainState, grain iterator position and JSON meta.

Layout: `<workdir>/checkpoints/<step>/{state,data,meta}`, one orbax `CheckpointManager` step per
saved RL step. `state` is any pytree of arrays (normally `types.TrainState`) saved with
`StandardSave` and restored into an abstract target carrying shardings; `data` is a grain
`DatasetIterator`/`DataLoaderIterator` (optional); `meta` is a JSON dict (model config, task, ...)
used to refuse resuming a workdir with an incompatible config (`jaxrl_llm.checkpoint_compat`).

PRNG keys: both typed keys (`jax.random.key`) and raw uint32 keys (`jax.random.PRNGKey`) round-trip
bit-exactly; orbax stores a typed key as its key data plus the key implementation and gives back a
typed key. The abstract target may hold either `jax.eval_shape`'s key dtype or the uint32 key-data
shape that `ocp.utils.to_shape_dtype_struct` produces.

Atomicity: a step directory counts only once orbax has finalised it (it holds
`commit_success.txt`); a crash mid-save leaves `<step>.orbax-checkpoint-tmp` or a step directory
without the marker, which is never listed, restored or removed by retention. Before re-saving such
a step the leftover is renamed aside (`<step>.uncommitted-<time>` / `<step>.partial-<time>`)
rather than deleted (orbax would delete it) unless it is empty. Leftovers of steps older than the
newest committed step, or of a step committed since, are removed (a complete checkpoint
supersedes them).

Integrity: every step gets `<step>/checksums.json`, the size and CRC-32 of every file of the step
(`jaxrl_llm.checkpoint_manifest`): in a single-process run before orbax writes the commit marker (a
committed step always has it), with several processes by process 0 once the step is committed.
`restore_latest` checks it before loading: a step whose files changed, vanished or were truncated
(or that fails to load), or that has no manifest (unverified), is skipped for the newest one that
verifies, and the skipped steps are renamed `<step>.corrupt-<time>` / `<step>.unverified-<time>`
(never deleted). Only when no step verifies is the newest unverified one loaded, with a warning;
when none loads, nothing is moved and the restore stops with the reasons.

Storage: every file operation goes through `jaxrl_llm.paths` (`etils.epath`), so the workdir may
be a `gs://` URL as well as a local path; orbax writes the arrays there with tensorstore. On an
object store a rename copies and deletes object by object: a step moved aside part-way by a crash
is found again (uncommitted, or failing its checksums) and moved aside on the next launch.

Errors: `save` raises `NonFiniteStateError`, `restore_latest` `CorruptCheckpointError`, and
`restore` `CheckpointMismatchError`; that one and `MetaCheck` (restore's `expect`) belong to
`jaxrl_llm.checkpoint_compat` and are part of the Checkpointer's API here as well.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import grain
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from jaxrl_llm import distributed, optim, paths
from jaxrl_llm.checkpoint_compat import (
  CheckpointMismatchError,
  MetaCheck,
  check_compatible,
  check_tree,
  meta_as_json,
)
from jaxrl_llm.checkpoint_manifest import MANIFEST, has_manifest, verify_manifest, write_manifest

PyTree = Any

_TMP_SUFFIX = ocp.path.atomicity.TMP_DIR_SUFFIX  # '.orbax-checkpoint-tmp'
_LEFTOVER_LABELS = ("partial", "uncommitted", _TMP_SUFFIX.lstrip("."))


class CorruptCheckpointError(RuntimeError):
  """No committed checkpoint step could be verified and loaded; `problems` maps step -> why."""

  def __init__(self, message: str, problems: Mapping[int, str] | None = None):
    super().__init__(message)
    self.problems = dict(problems or {})


class NonFiniteStateError(RuntimeError):
  """A state with NaN or inf values was about to be saved (it never is)."""


def non_finite_paths(tree: PyTree) -> list[str]:
  """Key paths of the floating-point leaves of `tree` that hold a NaN or inf."""
  leaves = [
    (path, x)
    for path, x in jax.tree_util.tree_leaves_with_path(tree)
    if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)
  ]
  if not leaves:
    return []
  finite = jax.device_get(_finite_leaves([x for _, x in leaves]))
  return [jax.tree_util.keystr(p) for (p, _), ok in zip(leaves, finite) if not ok]


_finite_leaves = jax.jit(optim.finite_leaves)  # one program for the whole list


class Checkpointer:
  """Saves and restores TrainState + data-iterator position + meta under `<workdir>/checkpoints`.

  `save` writes every `save_every` steps (or when `force`, or at a preemption sync point) and
  keeps the newest `max_to_keep` checkpoints. Saves are asynchronous: `save` returns once the
  arrays are copied off the devices (the caller may donate or overwrite `state` right away); call
  `wait()` before reading the files and `close()` at the end of training.
  """

  def __init__(
    self, workdir: str, *, save_every: int, max_to_keep: int | None = 3, async_save: bool = True
  ):
    """Opens (creating if needed) the checkpoint directory of `workdir`."""
    self.workdir = os.fspath(workdir)
    where = paths.as_path(self.workdir)
    if not paths.is_remote(where):  # orbax saves to absolute paths only (a relative --workdir)
      where = epath.Path(os.path.abspath(where))
    self.directory = where / "checkpoints"
    policies = [ocp.checkpoint_managers.PreemptionCheckpointingPolicy()]
    if save_every > 0:
      policies.append(ocp.checkpoint_managers.FixedIntervalPolicy(save_every))
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for item, save_arg, restore_arg, handler in (
      ("state", ocp.args.StandardSave, ocp.args.StandardRestore, None),
      ("meta", ocp.args.JsonSave, ocp.args.JsonRestore, None),
      (
        "data",
        grain.checkpoint.CheckpointSave,
        grain.checkpoint.CheckpointRestore,
        grain.checkpoint.CheckpointHandler,
      ),
    ):
      registry.add(item, save_arg, handler)
      registry.add(item, restore_arg, handler)
    options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep,
      save_decision_policy=ocp.checkpoint_managers.AnySavePolicy(policies),
      # Only steps holding orbax's commit marker count, whatever the file system.
      step_name_format=ocp.step.standard_name_format(
        temporary_path_cls=ocp.path.atomicity.CommitFileTemporaryPath
      ),
      cleanup_tmp_directories=False,
      enable_async_checkpointing=async_save,
      # One process: the checksums are written before orbax's commit marker, so a committed
      # step always has them (several processes: after the commit, by `_write_manifests`).
      async_options=ocp.AsyncOptions(post_finalization_callback=self._seal)
      if async_save and jax.process_count() == 1
      else None,
    )
    self._sealing: int | None = None  # the step whose save is in flight (for `_seal`)
    self._manager = ocp.CheckpointManager(
      self.directory, options=options, handler_registry=registry
    )
    self._unverified: set[int] = set()  # committed by this process, checksums not yet written
    self.clean_leftovers()
    if leftovers := self.uncommitted_dirs():
      logging.warning(
        "%s holds unfinished checkpoint directories (ignored, kept on disk): %s",
        self.directory,
        ", ".join(p.name for p in leftovers),
      )
    if strays := self.step_files():
      logging.warning(
        "%s holds files named like steps (ignored; a save of that step moves them aside): %s",
        self.directory,
        ", ".join(p.name for p in strays),
      )

  def clean_leftovers(self) -> list[str]:
    """Removes unfinished saves (`<s>.partial-*`, `<s>.uncommitted-*`, `<s>.orbax-checkpoint-tmp`)
    of steps older than the newest committed step or committed since, and uncommitted `<s>`
    folders (a retention delete the process died in, or a save that never committed) of older
    steps; returns the names removed (process 0)."""
    latest = self._manager.latest_step()
    if latest is None or jax.process_index() != 0:
      return []
    removed, committed = [], set(self._manager.all_steps())
    for p in paths.listdir(self.directory):
      head, _, tail = p.name.partition(".")
      if not head.isdigit():
        continue
      half_deleted = not tail and int(head) not in committed and int(head) < latest
      leftover = any(tail.startswith(label) for label in _LEFTOVER_LABELS)
      # a newer committed step, or the same step committed since (the last step's save that
      # a kill interrupted, saved again by the relaunch), supersedes an unfinished save
      leftover = leftover and (int(head) < latest or int(head) in committed)
      if (half_deleted or leftover) and paths.is_dir(p):
        paths.remove_tree(p)
        removed.append(p.name)
    if removed:
      logging.info("removed unfinished saves superseded by step %d: %s", latest, removed)
    return removed

  def _seal(self) -> None:
    """orbax's post-finalization callback: the step's checksums, written before its commit
    marker (one process only)."""
    if self._sealing is None:
      return
    final = self.directory / str(self._sealing)
    # Before the commit the files may still lie in orbax's temporary directory, renamed to
    # `<step>` with the marker: the manifest's paths are relative, so they hold after it.
    pending = [
      p
      for p in paths.listdir(self.directory)
      if p.name.startswith(f"{final.name}.orbax-checkpoint-tmp")
    ]
    write_manifest(pending[0] if len(pending) == 1 else final)

  def _write_manifests(self) -> None:
    """Writes the checksums of this process's committed steps that lack them (process 0)."""
    committed = set(self._manager.all_steps())
    for step in sorted(self._unverified & committed):
      if jax.process_index() == 0:
        step_dir = self.directory / str(step)
        if not has_manifest(step_dir):
          write_manifest(step_dir)
    self._unverified.clear()  # written, or deleted by retention before it was

  def all_steps(self) -> list[int]:
    """Steps of all committed checkpoints, ascending."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """Newest committed step, or None when the workdir has no checkpoint."""
    return self._manager.latest_step()

  def uncommitted_dirs(self) -> list[epath.Path]:
    """Directories under `checkpoints/` that look like steps but were never committed."""
    committed = {str(s) for s in self._manager.all_steps()}
    return [
      p
      for p in paths.listdir(self.directory)
      if p.name.split(".", 1)[0].isdigit() and p.name not in committed and paths.is_dir(p)
    ]

  def step_files(self) -> list[epath.Path]:
    """Files (not directories) under `checkpoints/` named like a step, `<step>`."""
    return [p for p in paths.listdir(self.directory) if p.name.isdigit() and not paths.is_dir(p)]

  def _free_name(self, base: str) -> epath.Path:
    """`<checkpoints>/<base>`, or `<base>-<n>` when that exists (a name to move a step to)."""
    target, n = self.directory / base, 1
    while paths.exists(target):
      target, n = self.directory / f"{base}-{n}", n + 1
    return target

  def _set_aside(self, step: int) -> None:
    """Moves an unfinished directory of `step` (or a file of its name) out of orbax's way
    (deleting an empty directory)."""
    if jax.process_index() != 0:
      return
    stamp = time.strftime("%Y%m%dT%H%M%S")
    for path, label in (
      (self.directory / str(step), "uncommitted"),
      (self.directory / f"{step}{_TMP_SUFFIX}", "partial"),
    ):
      if not paths.exists(path):
        continue
      if paths.is_dir(path) and not paths.listdir(path):
        paths.remove_tree(path)
        continue
      target = self._free_name(f"{step}.{label}-{stamp}")
      logging.warning("moving unfinished checkpoint %s aside to %s", path, target)
      paths.rename(path, target)

  def save(
    self,
    step: int,
    state: PyTree,
    data_iter: Any = None,
    meta: Mapping[str, Any] | None = None,
    force: bool = False,
  ) -> bool:
    """Saves `state`, `data_iter`'s position and `meta` at `step` if due; returns whether it did.

    Due means `step % save_every == 0`, a preemption sync point, or `force`. A step that is
    already saved is skipped (returns False), so a final forced save may repeat a periodic one.
    Must be called on every process.
    """
    step = int(step)
    if step in self._manager.all_steps():
      return False
    if not (force or self._manager.should_save(step)):
      return False
    bad = non_finite_paths(state)
    if bad:
      raise NonFiniteStateError(
        f"refusing to save step {step} in {self.directory}: {len(bad)} array(s) hold NaN or "
        f"inf ({', '.join(bad[:5])}{', ...' if len(bad) > 5 else ''}); the checkpoints already "
        "on disk are kept"
      )
    items = {
      "state": ocp.args.StandardSave(state),
      "meta": ocp.args.JsonSave(meta_as_json(meta)),
    }
    if data_iter is not None:
      items["data"] = grain.checkpoint.CheckpointSave(data_iter)
    self._set_aside(step)
    if self._manager.is_saving_in_progress():
      self._manager.wait_until_finished()  # the previous step commits; then its checksums
    self._write_manifests()
    self._sealing = step
    saved = self._manager.save(step, args=ocp.args.Composite(**items), force=True)
    if saved:
      self._unverified.add(step)
    return saved

  def _step_dir(self, step: int) -> epath.Path:
    if step not in self._manager.all_steps():
      raise FileNotFoundError(
        f"no committed checkpoint for step {step} in {self.directory}; "
        f"available steps: {self.all_steps()}"
      )
    return self.directory / str(step)

  def read_meta(self, step: int) -> dict[str, Any]:
    """The JSON meta saved at `step`."""
    self._step_dir(step)
    restored = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    return dict(restored.meta or {})

  def check_meta(self, step: int, expect: MetaCheck) -> None:
    """Raises CheckpointMismatchError when the meta saved at `step` differs from `expect`;
    a meta that cannot be read is left to the restore to report."""
    try:
      meta = self.read_meta(step)
    except Exception:  # a damaged step: `restore_latest` sets it aside or says why
      return
    self._check(meta, expect, step)

  def _check(self, meta: dict[str, Any], expect: MetaCheck, step: int) -> None:
    check_compatible(
      meta, expect.current, expect.keys, workdir=self.workdir, step=step,
      defaults=expect.defaults, ignore=expect.ignore, normalise=expect.normalise,
    )  # fmt: skip

  def restore(
    self,
    step: int,
    abstract_state: PyTree,
    data_iter: Any = None,
    *,
    expect: MetaCheck | None = None,
  ) -> tuple[PyTree, dict[str, Any]]:
    """Restores `step` into `abstract_state`'s structure, dtypes and shardings.

    `abstract_state` leaves are `jax.ShapeDtypeStruct`s with `sharding=` (or arrays, whose
    sharding is used). `data_iter`, when given, is set to the saved position in place. With
    `expect`, the saved meta is first checked against it (`check_compatible`). Raises
    CheckpointMismatchError naming each parameter path whose saved shape differs from the target.
    Returns `(state, meta)`.
    """
    step = int(step)
    step_dir = self._step_dir(step)
    meta = self.read_meta(step)
    if expect is not None:
      self._check(meta, expect, step)
    where = f"checkpoint step {step} in {self.directory}"
    saved_tree = self._manager.item_metadata(step).get("state")
    if saved_tree is not None:
      check_tree(saved_tree.tree, abstract_state, where)
    items = {"state": ocp.args.StandardRestore(abstract_state)}
    if data_iter is not None:
      if not paths.exists(step_dir / "data"):
        raise CheckpointMismatchError(
          f"{where} has no data-iterator state; it was saved without data_iter, so pass "
          "data_iter=None to restore it (the data pipeline then restarts from its beginning)."
        )
      items["data"] = grain.checkpoint.CheckpointRestore(data_iter)
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(**items))
    except ValueError as e:
      raise CheckpointMismatchError(f"{where} could not be restored into the target: {e}") from e
    return restored.state, meta

  def restore_latest(
    self, abstract_state: PyTree, data_iter: Any = None, **kwargs
  ) -> tuple[int, PyTree, dict[str, Any]] | None:
    """Restores the newest committed step that verifies: `(step, state, meta)`, or None when
    there is no checkpoint. `kwargs` go to `restore`.

    A step whose checksums do not match, or that fails to load for another reason than a
    config or shape mismatch (`CheckpointMismatchError`, raised at once: it is the config that
    is wrong, not the files), is skipped for the next older one, with a warning naming it; so
    is a step without a checksums manifest (unverified: a kill between commit and checksums,
    or a deleted manifest). Once one loads, the newer skipped steps are renamed
    `<step>.corrupt-<time>` or `<step>.unverified-<time>` (never deleted). Only when no step
    verifies is the newest unverified one that loads used, with a warning. When none loads,
    nothing is renamed and `CorruptCheckpointError` lists every step's reason.
    """
    steps = self.all_steps()
    if not steps:
      return None
    problems: dict[int, str] = {}
    unverified = [s for s in steps if not has_manifest(self.directory / str(s))]
    for step in reversed([s for s in steps if s not in unverified]):
      loaded = self._load(step, verify_manifest(self.directory / str(step)), problems,
                          abstract_state, data_iter, kwargs)  # fmt: skip
      if loaded is not None:
        for skipped in [s for s in [*problems, *unverified] if s > step]:
          self._move_step_aside(skipped, "corrupt" if skipped in problems else "unverified")
        return (step, *loaded)
    for step in reversed(unverified):  # no step verifies: the newest that loads, said so
      logging.warning(
        "checkpoint step %d in %s has no %s and no step verifies: loading it unverified",
        step,
        self.directory,
        MANIFEST,
      )
      loaded = self._load(step, None, problems, abstract_state, data_iter, kwargs)
      if loaded is not None:
        return (step, *loaded)
    listing = "; ".join(f"step {s}: {why}" for s, why in problems.items())
    raise CorruptCheckpointError(
      f"no checkpoint in {self.directory} can be loaded ({listing}). Nothing was moved or "
      "deleted; restore the files, move the bad steps out of the directory to start over, or "
      "use a new --workdir",
      problems,
    )

  def _load(self, step: int, why: str | None, problems: dict, abstract_state, data_iter, kwargs):
    """(state, meta) of `step` unless `why` (its checksums' verdict) or the load fails: then
    None, the reason in `problems`. A config or shape mismatch raises at once."""
    if why is None:
      try:
        return self.restore(step, abstract_state, data_iter, **kwargs)
      except CheckpointMismatchError:
        raise
      except Exception as e:  # unreadable files: corruption the checksums could not see
        why = f"it failed to load ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    logging.warning("checkpoint step %d in %s is unusable: %s", step, self.directory, why)
    problems[step] = why
    return None

  def misnamed(self, step: int, held: int) -> CheckpointMismatchError:
    """The error for step folder `step` holding the state of step `held` (a folder renamed, or
    copied in from elsewhere): resuming from it would train its steps again, and saving below
    its number would let the newest-first order drop the later ones."""
    return CheckpointMismatchError(
      f"{self.directory / str(step)} holds the state of step {held}, not {step} (a step folder "
      f"renamed or copied in?); rename it to {held} or move it out of {self.directory}, then "
      "relaunch; nothing was changed"
    )

  def _move_step_aside(self, step: int, label: str) -> None:
    """Renames the committed step `step` to `<step>.<label>-<time>` (process 0): a newer step
    than the one that loaded, corrupt or unverified, kept for the user to inspect."""
    if jax.process_index() == 0:
      path = self.directory / str(step)
      target = self._free_name(f"{step}.{label}-{time.strftime('%Y%m%dT%H%M%S')}")
      logging.warning("moving %s checkpoint step %d aside to %s", label, step, target)
      paths.rename(path, target)
    distributed.barrier(f"checkpoint-corrupt-{step}")  # every process sees it gone
    self._manager.reload()

  def wait(self) -> None:
    """Blocks until every pending asynchronous save is committed (and its checksums written)."""
    self._manager.wait_until_finished()
    self._write_manifests()
    self.clean_leftovers()

  def close(self) -> None:
    """Waits for pending saves, writes their checksums and releases the manager."""
    try:
      self._manager.wait_until_finished()
      self._write_manifests()
    finally:
      self._manager.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
