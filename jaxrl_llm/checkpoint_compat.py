"""Whether a checkpoint fits what resumes it: the saved meta against the config, the saved
parameter tree against the restore target.

`check_compatible` compares the JSON meta saved with a step (model config, task, ...) with the
running config's under chosen top-level keys; `MetaCheck` bundles what a
`jaxrl_llm.checkpoint.Checkpointer.restore(expect=...)` compares. `check_tree` compares the saved
array tree's paths and shapes with the abstract target. Both raise `CheckpointMismatchError`
naming every differing field or parameter path with its saved and expected value, so a workdir
is never resumed with an incompatible config.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

PyTree = Any


class CheckpointMismatchError(ValueError):
  """A checkpoint does not fit the current config or restore target.

  `diffs` maps each differing field or parameter path to `(saved, current)`.
  """

  def __init__(self, message: str, diffs: Mapping[str, tuple[Any, Any]] | None = None):
    super().__init__(message)
    self.diffs = dict(diffs or {})


_MISSING = "<absent>"


def _flatten_json(prefix: str, node: Any, out: dict[str, Any]) -> None:
  if isinstance(node, Mapping) and node:
    for k, v in node.items():
      _flatten_json(f"{prefix}.{k}" if prefix else str(k), v, out)
  else:
    out[prefix] = node


def meta_as_json(meta: Mapping[str, Any] | None) -> dict[str, Any]:
  """Returns `meta` as it reads back from JSON (tuples become lists), or raises TypeError."""
  try:
    return json.loads(json.dumps(dict(meta or {})))
  except TypeError as e:
    raise TypeError(f"checkpoint meta must be JSON-serialisable: {e}") from e


@dataclasses.dataclass(frozen=True)
class MetaCheck:
  """What a restore holds the saved meta against (compared by `check_compatible`)."""

  current: Mapping[str, Any]  # the running config's meta
  keys: Sequence[str] = ("model",)  # top-level meta fields that must match
  defaults: Mapping[str, Any] | None = None  # stand-ins for fields an older meta lacks
  ignore: Sequence[str] = ()  # dotted fields that are never compared
  normalise: Mapping[str, Callable[[Any], Any]] | None = None  # dotted field -> its one spelling


def _lookup(tree: Any, field: str) -> Any:
  """The value at dotted `field` of a JSON tree (`_MISSING` where it has none)."""
  for k in field.split("."):
    if not isinstance(tree, Mapping) or k not in tree:
      return _MISSING
    tree = tree[k]
  return tree


def _collapse_absent(diffs: dict, saved: Mapping, current: Mapping) -> dict:
  """`diffs` with each subtree that only one side holds said once, as that subtree (not a
  `<absent>` per field under it): `model.base=<absent>` against `model.base={...}`."""
  out: dict[str, tuple[Any, Any]] = {}
  for f, pair in diffs.items():
    side = 0 if pair[0] == _MISSING else 1 if pair[1] == _MISSING else None
    parts = f.split(".")
    top = f
    for i in range(len(parts) - 1, 0, -1):  # the widest parent absent on that side
      parent = ".".join(parts[:i])
      if side is None or _lookup((saved, current)[side], parent) is not _MISSING:
        break
      top = parent
    if top == f:
      out[f] = pair
    elif side is not None:
      out[top] = (_MISSING, _lookup(current, top)) if side == 0 else (_lookup(saved, top), _MISSING)
  return out


def check_compatible(
  saved_meta: Mapping[str, Any],
  current_meta: Mapping[str, Any],
  keys: Sequence[str] = ("model",),
  *,
  workdir: str | None = None,
  step: int | None = None,
  defaults: Mapping[str, Any] | None = None,
  ignore: Sequence[str] = (),
  normalise: Mapping[str, Callable[[Any], Any]] | None = None,
) -> None:
  """Raises CheckpointMismatchError if `saved_meta` and `current_meta` differ under `keys`.

  Values are compared as JSON (a tuple equals the list it is saved as); the message names the
  workdir and every differing dotted field with its saved and current value. `defaults` (same
  shape as the meta) stand in for fields the saved meta lacks: fields added after it was written.
  `ignore`: dotted fields that choose how a result is computed, not what (never compared).
  `normalise`: dotted fields compared through a function giving a value's one spelling (two
  spellings of one value are no difference; an older meta may hold another one).
  """
  saved_flat: dict[str, Any] = {}
  current_flat: dict[str, Any] = {}
  default_flat: dict[str, Any] = {}
  saved, current = meta_as_json(saved_meta), meta_as_json(current_meta)
  for key in keys:
    _flatten_json(key, saved.get(key, _MISSING), saved_flat)
    _flatten_json(key, current.get(key, _MISSING), current_flat)
    if defaults and key in defaults and key in saved:
      _flatten_json(key, meta_as_json(defaults)[key], default_flat)
  for f, value in default_flat.items():
    saved_flat.setdefault(f, value)
  for f, spell in (normalise or {}).items():
    for flat in (saved_flat, current_flat):
      if flat.get(f, _MISSING) != _MISSING:
        flat[f] = spell(flat[f])
  diffs = {
    f: (saved_flat.get(f, _MISSING), current_flat.get(f, _MISSING))
    for f in sorted(set(saved_flat) | set(current_flat))
    if saved_flat.get(f, _MISSING) != current_flat.get(f, _MISSING) and f not in ignore
  }
  if not diffs:
    return
  diffs = _collapse_absent(diffs, saved, current)
  where = f"workdir {workdir}" if workdir else "the checkpoint directory"
  at = f" (step {step})" if step is not None else ""
  what = "/".join(keys)
  saved_str = ", ".join(f"{f}={s!r}" for f, (s, _) in diffs.items())
  current_str = ", ".join(f"{f}={c!r}" for f, (_, c) in diffs.items())
  raise CheckpointMismatchError(
    f"{where} holds a checkpoint{at} of a {what} with {saved_str}, but the config asks for "
    f"{current_str}; use a new --workdir or match the {what} config.",
    diffs,
  )


def _path_str(path) -> str:
  return jax.tree_util.keystr(path, simple=True, separator="/")


def _saved_shape(leaf: Any) -> tuple[int, ...] | None:
  """Shape an array leaf has on disk (a typed PRNG key is stored as its key data)."""
  if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
    return None
  if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
    return tuple(jax.eval_shape(jax.random.key_data, leaf).shape)
  return tuple(leaf.shape)


def check_tree(saved_tree: PyTree, target: PyTree, where: str) -> None:
  """Raises CheckpointMismatchError naming every path whose presence or shape differs."""
  saved = {_path_str(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(saved_tree)[0]}
  wanted = {_path_str(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(target)[0]}
  diffs: dict[str, tuple[Any, Any]] = {}
  for path in sorted(set(saved) | set(wanted)):
    if path not in saved:
      diffs[path] = (_MISSING, _saved_shape(wanted[path]))
    elif path not in wanted:
      diffs[path] = (_saved_shape(saved[path]), _MISSING)
    else:
      s, w = _saved_shape(saved[path]), _saved_shape(wanted[path])
      if s is not None and w is not None and s != w:
        diffs[path] = (s, w)
  if not diffs:
    return
  lines = [f"  {p}: saved {s}, expected {w}" for p, (s, w) in list(diffs.items())[:20]]
  if len(diffs) > 20:
    lines.append(f"  ... and {len(diffs) - 20} more")
  raise CheckpointMismatchError(
    f"{where} does not match the state it is restored into ({len(diffs)} parameter paths differ; "
    "shapes as stored, typed PRNG keys as key data):\n" + "\n".join(lines),
    diffs,
  )
