"""Hugging Face checkpoints in and out of the trainer.

  python tools/hf_convert.py import --hf_dir=DIR [--out=CKPT_DIR] [--param_dtype=bfloat16] \\
      [--scan_layers] [--debug]
  python tools/hf_convert.py import-gguf FILE.gguf OUT_DIR [--dtype=float32|bfloat16] [--debug]
  python tools/hf_convert.py export --workdir=TRAIN_WORKDIR [--step=N] --out=HF_DIR \\
      [--model_type=qwen2] [--dtype=bfloat16] [--max_shard_bytes=N] [--overwrite] \\
      [--hf_source=DIR|none] [--tokenizer=DIR|FILE|none] [--max_position_embeddings=N] \\
      [--adapters=DIR] [--debug]

`import` loads and validates an HF checkpoint directory (config.json + safetensors) and prints
its ModelConfig, model type, parameter count and the metadata an export carries over (context
length, token ids, generation_config.json, tokenizer files); with --out it also writes the
parameters as an orbax checkpoint (`CKPT_DIR/params`, StandardSave) with `CKPT_DIR/meta.json`
holding {"model": ModelConfig dict, "hf_model_type": ..., "hf_source": DIR} (an --out already
holding either is refused before anything is read or written). --scan_layers loads
them in the scanned layout (model.scan_layers: each layer parameter stacked on a leading layer
axis).

`import-gguf` writes the Hugging Face directory of a llama.cpp GGUF file (a Llama architecture;
F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 tensors, dequantized): config.json,
model.safetensors, tokenizer.json, tokenizer_config.json (with the chat template) and
generation_config.json, which `import` and `model.checkpoint` then read
(`jaxrl_llm/models/gguf.py`). Anything else in the file is refused and nothing is written; so is
an OUT_DIR that is a file or already holds weights (*.safetensors, an index) or one of those
files.

`export` restores the policy parameters of a trainer checkpoint (`<workdir>/checkpoints/<step>`,
latest step by default) and writes them as an HF checkpoint. The ModelConfig comes from the
checkpoint's meta ('model'); the HF model type from --model_type, else the meta's
'hf_model_type', else the source's, else the architecture (qwen3_moe / mixtral / qwen3 / qwen2 /
llama). The source is the HF directory the run started from: --hf_source, else the
`model.checkpoint` recorded in `<workdir>/config.json` (none for a randomly initialised model).
From it the export keeps max_position_embeddings, the bos / eos / pad token ids,
generation_config.json and the tokenizer files; --tokenizer (default: the run's
`data.tokenizer`, else the source's) picks other tokenizer files. A source whose config.json has
another vocab_size than the model, a token id at or past the model's vocab_size, or a
tokenizer.json of more tokens than it has rows is refused (one of another model), and so are
merged weights and adapters in one folder (--adapters naming --out or a folder of weights, an
--out holding adapter_config.json): transformers would put the adapters on top of weights that
already hold them. A model with no source gets the model type's default max_position_embeddings unless --max_position_embeddings is given.
Before anything is written, `export` refuses an --out or --adapters that is a trainer workdir
(its config.json is the run record: even with --overwrite), or is or lies inside a trainer's
checkpoints/ or a checkpoint the run started from or the export reads (its recorded
model.checkpoint, its adapters' base, --hf_source: even with --overwrite) and, without
--overwrite, one that holds files the export would replace (weights, config.json,
generation_config.json, the tokenizer files, the adapter files); a refused export leaves every
directory as it was. A packed sweep (its root or a run folder) is refused: `jaxrl_llm.run.packed.take_out` writes one
of its runs out as a workdir to export.

Bad input (a missing or malformed file, field or tensor) ends with one line on stderr,
`error: <file>: <what is wrong>`, and exit code 2; --debug also prints the traceback. An
export writes its weights beside the old ones and moves them in at the end, so a Ctrl-C (one line,
exit code 130) or a full disk leaves an export already at --out whole.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxrl_llm import terminal

EXIT_BAD_INPUT = 2
NONE = "none"  # --hf_source / --tokenizer value that turns the default off


class ConvertError(Exception):
  """Bad input to a sub-command (reported as one `error:` line, exit code 2)."""


def trainer_workdir(path: str) -> str | None:
  """Why directory `path` is a trainer workdir, or None (`hf_layout.trainer_workdir`)."""
  from jaxrl_llm.models import hf_layout  # imports jax; kept out of --help

  return hf_layout.trainer_workdir(path)


def _has_run_record(path: str) -> bool:
  """Whether directory `path` holds a run record config.json (`hf_layout.has_run_record`)."""
  from jaxrl_llm.models import hf_layout

  return hf_layout.has_run_record(path)


def _ancestors(path: str):
  """`path` made absolute with its links resolved (a link may lead into a workdir), then every
  directory above it, nearest first."""
  path = os.path.realpath(path)
  while True:
    yield path
    if (parent := os.path.dirname(path)) == path:
      return
    path = parent


def _trainer_checkpoints(path: str) -> str | None:
  """The checkpoints/ directory of a trainer workdir (beside a run record, or holding a numbered
  step) that `path` is or lies inside, else None."""
  for above in _ancestors(path):
    if os.path.basename(above) != "checkpoints" or not os.path.isdir(above):
      continue
    steps = [n for n in os.listdir(above) if n.isdigit() and os.path.isdir(f"{above}/{n}")]
    if steps or _has_run_record(os.path.dirname(above)):
      return above
  return None


def _packed_sweep(workdir: str) -> tuple[str, list] | None:
  """(root, run names) of the packed sweep that `workdir` is the root of (its newest checkpoint's
  meta names the pack's runs, 'pack') or a run folder of (ROOT/<name>, no checkpoints/ of its
  own), else None. The meta is read from its file: nothing under the root is touched."""
  root = os.path.abspath(workdir)
  if not os.path.isdir(root):
    return None
  if not os.path.isdir(os.path.join(root, "checkpoints")):
    root = os.path.dirname(root)
  steps = os.path.join(root, "checkpoints")
  names = os.listdir(steps) if os.path.isdir(steps) else []
  for step in sorted((int(n) for n in names if n.isdigit()), reverse=True):
    try:
      with open(os.path.join(steps, str(step), "meta", "metadata"), encoding="utf-8") as f:
        meta = json.load(f)
    except (OSError, ValueError):  # an unfinished step: look at the one before
      continue
    pack = meta.get("pack") if isinstance(meta, dict) else None
    return (root, list(pack.get("names") or [])) if isinstance(pack, dict) else None
  return None


def _check_not_a_pack(workdir: str) -> None:
  """ConvertError for a --workdir that is a packed sweep or one of its runs' folders: the
  pack's checkpoints hold every run's parameters stacked, which export does not read."""
  if (pack := _packed_sweep(workdir)) is None:
    return
  root, names = pack
  run = os.path.relpath(os.path.abspath(workdir), root)
  what = f"is a packed sweep (runs {', '.join(names)})"
  if run != ".":
    what = f"is run {run} of the packed sweep {root}"
  raise ConvertError(
    f"--workdir={workdir}: {what}, whose checkpoints hold every run at once, which export "
    "cannot read; write one run out as a workdir of its own with "
    "jaxrl_llm.run.packed.take_out(configs, root, name, workdir) (docs/sweeps.md) and export "
    "that workdir"
  )


def _check_dir_flag(flag: str, path: str) -> None:
  """ConvertError naming `flag` unless `path` is a directory or can be made one
  (`paths.dir_problem`; a directory that is not there yet is made and removed again, as only
  that finds a place where none can be made, such as /proc)."""
  from jaxrl_llm import paths

  if problem := paths.dir_problem(path):
    raise ConvertError(f"{flag}={path}: {problem}; name a directory")
  missing, above = [], os.path.abspath(path)
  while not os.path.lexists(above):
    missing.append(above)
    above = os.path.dirname(above)
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise ConvertError(
      f"{flag}={path}: cannot be made ({e.strerror}); name a directory that can be made"
    ) from None
  for made in missing:  # deepest first: nothing is left behind
    os.rmdir(made)


def _param_count(params) -> int:
  import jax

  return sum(int(x.size) for x in jax.tree.leaves(params))


def cmd_import(args) -> dict:
  """Loads (and validates) an HF directory; optionally writes orbax params + meta.json."""
  from jaxrl_llm.models import hf

  out = os.path.abspath(args.out) if args.out else None
  if os.path.isdir(args.hf_dir) and (why := trainer_workdir(args.hf_dir)):
    raise ConvertError(
      f"--hf_dir={args.hf_dir}: is a trainer workdir ({why}), not a Hugging Face checkpoint; "
      f"write one from it with: python tools/hf_convert.py export --workdir={args.hf_dir} "
      "--out=HF_DIR"
    )
  if out:
    _check_dir_flag("--out", args.out)
  for name in ("params", "meta.json") if out else ():  # what --out gets: never replaced
    if os.path.exists(os.path.join(out, name)):
      raise ConvertError(f"{out}/{name}: already exists; choose a new --out")
  cfg, params = hf.load_checkpoint(
    args.hf_dir, param_dtype=args.param_dtype, scan_layers=args.scan_layers or None
  )
  source = hf.read_source(args.hf_dir)
  summary = {
    "hf_dir": os.path.abspath(args.hf_dir),
    "hf_model_type": source.model_type,
    "num_params": _param_count(params),
    "carried": {
      "config": source.fields,
      "generation_config": source.generation_config,
      "tokenizer_files": list(source.tokenizer_files),
    },
    "model": cfg.to_dict(),
  }
  if out:
    import orbax.checkpoint as ocp

    os.makedirs(out, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
      ckptr.save(os.path.join(out, "params"), params)
      ckptr.wait_until_finished()
    meta = {
      "model": cfg.to_dict(),
      "hf_model_type": source.model_type,
      "hf_source": os.path.abspath(args.hf_dir),
    }
    with open(os.path.join(out, "meta.json"), "w") as f:
      json.dump(meta, f, indent=2)
    summary["out"] = out
  print(json.dumps(summary, indent=2))
  return summary


def _check_saved_params(path: str, target, where: str) -> None:
  """Raises ConvertError naming the first parameter whose saved shape differs from `target`."""
  import jax
  import orbax.checkpoint as ocp

  with ocp.PyTreeCheckpointer() as ckptr:
    saved = ckptr.metadata(path)
  saved = getattr(saved, "item_metadata", saved)  # StepMetadata (orbax >= 0.11) or the tree
  saved = getattr(saved, "tree", saved)
  if not isinstance(saved, dict) or "params" not in saved:
    raise ConvertError(f"{path}: holds no 'params' tree")
  key = lambda p: jax.tree_util.keystr(p, simple=True, separator="/")  # noqa: E731
  have = {key(p): x for p, x in jax.tree_util.tree_flatten_with_path(saved["params"])[0]}
  for p, want in jax.tree_util.tree_flatten_with_path(target)[0]:
    name = key(p)
    if name not in have:
      raise ConvertError(f"{path}: parameter params/{name} is missing ({where} implies it)")
    shape = tuple(getattr(have[name], "shape", ()) or ())
    if shape != tuple(want.shape):
      raise ConvertError(
        f"{path}: parameter params/{name} has shape {list(shape)}, but {where} implies "
        f"{list(want.shape)}"
      )


def restore_params(workdir: str, step: int | None = None):
  """(ModelConfig, params, meta, step) of a trainer checkpoint; only the params are read.

  Raises ConvertError naming the directory, step or parameter that is missing or misshaped.
  """
  import flax.linen as nn
  import jax
  import orbax.checkpoint as ocp

  from jaxrl_llm.checkpoint import Checkpointer
  from jaxrl_llm.models import hf, lora
  from jaxrl_llm.models.config import ModelConfig

  _check_not_a_pack(workdir)
  if not os.path.isdir(os.path.join(workdir, "checkpoints")):
    raise ConvertError(f"{workdir}: has no checkpoints/ directory (not a trainer workdir?)")
  ckpt = Checkpointer(workdir, save_every=0, async_save=False)
  try:
    steps = ckpt.all_steps()
    if not steps:
      raise ConvertError(f"{workdir}/checkpoints: holds no committed checkpoint")
    if step is not None and step not in steps:
      raise ConvertError(
        f"{workdir}/checkpoints: has no step {step}; available steps: {list(steps)}"
      )
    step = _verified_step(workdir, steps, step)
    meta = ckpt.read_meta(step)
  finally:
    ckpt.close()
  where = f"{workdir}/checkpoints/{step}/meta"
  if "model" not in meta:
    raise ConvertError(f"{where}: has no 'model' field")
  try:
    cfg = ModelConfig.from_dict(meta["model"])
  except (TypeError, ValueError) as e:
    raise ConvertError(f"{where}: field 'model' is not a valid model config ({e})") from None
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  target = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
    nn.unbox(hf.abstract_params(cfg)),
  )
  if "base" in meta:  # a run with adapters saved them alone
    target = lora.split_adapters(target)[1]
  path = os.path.join(workdir, "checkpoints", str(step), "state")
  _check_saved_params(path, target, f"the 'model' field of {where}")
  item = {"params": target}
  restore_args = ocp.checkpoint_utils.construct_restore_args(item)
  with ocp.PyTreeCheckpointer() as ckptr:
    restored = ckptr.restore(
      path, args=ocp.args.PyTreeRestore(item, restore_args=restore_args, partial_restore=True)
    )
  params = restored["params"]
  if "base" in meta:
    params = lora.join_adapters(_base_of(workdir, cfg, meta["base"], where), params)
  return cfg, params, meta, step


def _verified_step(workdir: str, steps: list[int], step: int | None) -> int:
  """`step` if its files match their checksums (ConvertError naming why not); without one,
  the newest step that verifies (a warning names each newer one skipped)."""
  from jaxrl_llm.checkpoint_manifest import MANIFEST, has_manifest, verify_manifest

  def why(s: int) -> str | None:
    step_dir = os.path.join(workdir, "checkpoints", str(s))
    if not has_manifest(step_dir):
      return f"it has no {MANIFEST}, so its files cannot be verified"
    return verify_manifest(step_dir)

  if step is not None:
    if (reason := why(step)) is not None:
      raise ConvertError(f"{workdir}/checkpoints/{step}: {reason}; export another --step")
    return step
  for s in reversed(steps):
    if (reason := why(s)) is None:
      return s
    print(f"warning: skipping checkpoint step {s}: {reason}", file=sys.stderr)
  raise ConvertError(f"{workdir}/checkpoints: no step verifies against its checksums")


def _base_of(workdir: str, cfg, base: dict, where: str):
  """The base weights a run's adapters sit on: its Hugging Face checkpoint (its weight files
  must give the recorded digest) or, for a random-init base, the run's own initialisation."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import ml_collections

  from jaxrl_llm.config import parse
  from jaxrl_llm.models import hf, lora
  from jaxrl_llm.run import build

  path = base.get("checkpoint")
  if path:
    if not os.path.isdir(path) or hf.weights_digest(path) != base.get("digest"):
      raise ConvertError(
        f"{where}: the adapters' base {path} is gone or its weights changed (digest "
        f"{base.get('digest')}); restore that checkpoint to export this run"
      )
    layout = {"param_dtype": cfg.param_dtype, "dtype": cfg.dtype, "scan_layers": cfg.scan_layers}
    weights = hf.load_checkpoint(path, **layout)[1]
    scales = lora.fresh_parts(nn.unbox(hf.abstract_params(cfg)))  # int8 bases: kernel_scale
    scales = jax.tree.map(lambda x: jnp.ones(x.shape, x.dtype), lora.split_adapters(scales)[0])
    return lora.quantize_base(lora.join_adapters(weights, scales))  # as the run trained on it
  record = os.path.join(workdir, "config.json")
  with open(record, encoding="utf-8") as f:
    config = json.load(f)["config"]
  if "init_seed" not in base:
    raise ConvertError(f"{where}: the adapters' base records neither a checkpoint nor a seed")
  config["seed"] = base["init_seed"]  # the checkpoint's record of its base, not config.json's
  exp = build(parse(ml_collections.ConfigDict(config)))  # the same seed, the same base
  built = lora.split_adapters(jax.device_get(exp.state.params))[0]
  want = lora.split_adapters(nn.unbox(hf.abstract_params(cfg)))[0]
  shapes = lambda tree: jax.tree.map(lambda x: tuple(x.shape), tree)  # noqa: E731
  if shapes(built) != shapes(want):
    raise ConvertError(
      f"{record}: its model differs from the checkpoint's ({where}): the adapters' random base "
      "cannot be rebuilt from it; restore the run's config.json"
    )
  return built


def recorded_inputs(workdir: str) -> tuple[str, str]:
  """(model.checkpoint, data.tokenizer) of the run config recorded in `<workdir>/config.json`;
  empty strings for a field, or both when the file is absent."""
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    return "", ""
  try:
    with open(path, encoding="utf-8") as f:
      record = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ConvertError(f"{path}: not valid JSON ({e})") from None
  config = record.get("config") if isinstance(record, dict) else None
  if not isinstance(config, dict):
    raise ConvertError(f"{path}: has no 'config' object (not a run record?)")
  model, data = config.get("model") or {}, config.get("data") or {}
  return str(model.get("checkpoint") or ""), str(data.get("tokenizer") or "")


def _resolve_inputs(args):
  """(HFSource or None, tokenizer path or None) of an export: the flags', else the run's."""
  from jaxrl_llm.models import hf

  recorded_source, recorded_tokenizer = recorded_inputs(args.workdir)
  record = os.path.join(args.workdir, "config.json")
  source = None
  if args.hf_source and args.hf_source != NONE:
    source = hf.read_source(args.hf_source)
  elif not args.hf_source and recorded_source:
    if not os.path.isdir(recorded_source):
      raise ConvertError(
        f"{record}: model.checkpoint={recorded_source!r} (the run's source checkpoint) is not a "
        f"directory any more; pass --hf_source=DIR (a copy of it) or --hf_source={NONE}"
      )
    source = hf.read_source(recorded_source)
  tokenizer = None
  if args.tokenizer and args.tokenizer != NONE:
    tokenizer = args.tokenizer
  elif not args.tokenizer and recorded_tokenizer:
    if not os.path.exists(recorded_tokenizer):
      raise ConvertError(
        f"{record}: data.tokenizer={recorded_tokenizer!r} (the run's tokenizer) does not exist "
        f"any more; pass --tokenizer=DIR or --tokenizer={NONE}"
      )
    tokenizer = recorded_tokenizer
  if args.tokenizer == NONE and source is not None:
    source = dataclasses.replace(source, tokenizer_files=())
  return source, tokenizer


def _check_flags(args) -> None:
  """ConvertError for an export flag out of range, a directory flag naming a file, a
  --workdir that is a packed sweep (`_check_not_a_pack`) or a destination that `_check_kept`
  refuses (before any weights are read)."""
  _check_not_a_pack(args.workdir)
  if args.max_shard_bytes < 1:
    raise ConvertError(
      f"--max_shard_bytes={args.max_shard_bytes}: must be at least 1 (the most bytes of tensors "
      "in one safetensors file)"
    )
  if args.max_position_embeddings is not None and args.max_position_embeddings < 1:
    raise ConvertError(
      f"--max_position_embeddings={args.max_position_embeddings}: must be at least 1"
    )
  for flag, path in (("--out", args.out), ("--adapters", args.adapters)):
    if path:
      _check_dir_flag(flag, path)
  _check_kept(args, _kept_checkpoints(args, {}))
  _check_apart(args)


def _kept_checkpoints(args, meta: dict) -> list[tuple[str, str]]:
  """(directory, what it is) of each Hugging Face checkpoint that the run depends on or the
  export reads: the run's recorded model.checkpoint, its adapters' base (in the checkpoint's
  `meta`), --hf_source."""
  kept = [
    (recorded_inputs(args.workdir)[0], "the run's model.checkpoint"),
    ((meta.get("base") or {}).get("checkpoint") or "", "the base of the run's adapters"),
    (args.hf_source if args.hf_source != NONE else "", "--hf_source"),
  ]
  return [(path, what) for path, what in kept if path and os.path.isdir(path)]


def _is_or_inside(path: str, above: str) -> str:
  """How `path` stands to directory `above`, which is `path` or a directory above it."""
  same = os.path.isdir(path) and os.path.samefile(path, above)
  return "is" if same else f"lies inside {above}, which is"


def _check_apart(args) -> None:
  """ConvertError for merged weights and adapters in one folder: --adapters naming --out, a
  folder holding weights, or an --out holding adapter_config.json. transformers loads such a
  folder as the model with the adapters put on top of weights that already hold them."""
  from jaxrl_llm.models import hf_adapters, hf_export

  twice = "(the merged weights already hold the adapters: they would count twice)"
  if args.adapters and args.out and os.path.realpath(args.adapters) == os.path.realpath(args.out):
    raise ConvertError(
      f"--adapters={args.adapters}: is --out; transformers loads a folder holding a model and "
      f"adapter_config.json as the model with those adapters on top {twice}: name another "
      "--adapters"
    )
  if args.adapters and os.path.isdir(args.adapters) and hf_export.weight_files(args.adapters):
    raise ConvertError(
      f"--adapters={args.adapters}: holds model weights; transformers would load the adapters "
      f"on top of them {twice}, with --overwrite too: name a folder of its own"
    )
  config = os.path.join(args.out or "", hf_adapters.ADAPTER_CONFIG_FILE)
  if args.out and os.path.isfile(config):
    raise ConvertError(
      f"--out={args.out}: holds {hf_adapters.ADAPTER_CONFIG_FILE}; transformers would load "
      f"those adapters on top of the exported weights {twice}, with --overwrite too: name "
      "another --out"
    )


def _check_kept(args, kept: list[tuple[str, str]]) -> None:
  """ConvertError for an --out or --adapters that is or lies inside a trainer's checkpoints/
  or a checkpoint of `kept` (`_kept_checkpoints`), with --overwrite too."""
  for flag, path in (("--out", args.out), ("--adapters", args.adapters)):
    if not path:
      continue
    if ckpts := _trainer_checkpoints(path):
      raise ConvertError(
        f"{flag}={path}: {_is_or_inside(path, ckpts)} a trainer's checkpoints/: the trainer "
        "would take what is written there for a corrupt step and train it again; --overwrite "
        f"or not, name another {flag}"
      )
    for above in _ancestors(path):
      for kept_path, what in kept:
        if os.path.isdir(above) and os.path.samefile(above, kept_path):
          raise ConvertError(
            f"{flag}={path}: {_is_or_inside(path, kept_path)} the Hugging Face checkpoint the "
            f"export reads or the run started from ({what}): writing there would change the "
            f"weights that the run's resume and export check; --overwrite or not, name another "
            f"{flag}"
          )


def _check_destinations(args, source, tokenizer, meta: dict) -> None:
  """ConvertError, before anything is written, for an export that would destroy what a
  directory holds: --out or --adapters naming a trainer workdir (even with --overwrite: its
  config.json is the run record), lying in a trainer's checkpoints/ or in a checkpoint the run
  started from or the export reads (`_check_kept`), or holding files the export replaces
  without --overwrite (weights, config.json, generation_config.json, tokenizer files,
  adapters)."""
  from jaxrl_llm.models import hf_adapters, hf_export

  workdir = os.path.isdir(args.workdir) and args.workdir
  for flag, path in (("--out", args.out), ("--adapters", args.adapters)):
    if not path or not os.path.isdir(path):
      continue
    why = "it is --workdir" if workdir and os.path.samefile(path, workdir) else None
    if why := why or trainer_workdir(path):
      raise ConvertError(
        f"{flag}={path}: is a trainer workdir ({why}); an export there would replace the run's "
        f"files, with --overwrite too: name another {flag}"
      )
  _check_kept(args, _kept_checkpoints(args, meta))  # again, with the adapters' base
  if args.overwrite:
    return
  # (flag, directory, whether weights go there, the other files written there)
  dests = [("--out", args.out, True, hf_export.written_files(source, tokenizer))]
  if args.adapters:
    adapter_files = [hf_adapters.ADAPTER_WEIGHTS_FILE, hf_adapters.ADAPTER_CONFIG_FILE]
    dests.append(("--adapters", args.adapters, False, adapter_files))
    if source is None:  # a random-init base is written beside the adapters (`_base_export`)
      base = os.path.join(args.adapters, "base")
      dests.append(("--adapters", base, True, hf_export.written_files()))
  for flag, path, weights, names in dests:
    if weights and (old := hf_export.weight_files(path)):
      raise ConvertError(
        f"{path} already holds weights ({', '.join(old)}); pass --overwrite to replace them or "
        f"name another {flag}"
      )
    for name in names:
      if os.path.lexists(os.path.join(path, name)):
        raise ConvertError(
          f"{os.path.join(path, name)}: already exists and the export would replace it; pass "
          f"--overwrite to replace it or name another {flag}"
        )


def _base_export(args, cfg, params, model_type: str) -> tuple[str, dict]:
  """(path, save_checkpoint arguments) of a random-init base the adapters sit on (no Hugging
  Face source to name): a Hugging Face checkpoint in `<adapters>/base`, whose absolute path the
  adapters' `base_model_name_or_path` names: `PeftModel.from_pretrained(<that base>,
  <adapters>)` is the trained policy (as `--out`'s merged export is: load adapters onto one or
  the other, not both)."""
  from jaxrl_llm.models import lora

  path = os.path.abspath(os.path.join(args.adapters, "base"))
  base = lora.split_adapters(params)[0]
  return path, dict(
    cfg=cfg.without_adapters(),
    params=lora.dequantized(base),  # an int8 base in float32, as the merged export holds it
    model_type=model_type,
    dtype=args.dtype,
    overwrite=args.overwrite,
    max_position_embeddings=args.max_position_embeddings,
  )


def _export_model(args, cfg, params, meta, source):
  """(hf model_type, the config and params written to --out): a run with adapters exports its
  merged weights; --adapters without any trained is refused."""
  from jaxrl_llm.models import families, lora

  model_type = (
    args.model_type
    or meta.get("hf_model_type")
    or (source.model_type if source is not None else None)
    or families.default_model_type(cfg.without_adapters())
  )
  adapted = lora.has_adapters(params)
  if args.adapters and not adapted:
    raise ConvertError(
      f"--adapters={args.adapters}: {args.workdir} trained no adapters (model.lora_rank=0); "
      "leave --adapters out"
    )
  if not adapted:
    return model_type, cfg, params
  return model_type, cfg.without_adapters(), lora.merged(params, cfg.lora_alpha / cfg.lora_rank)


def _export_summary(args, step, source, model_type, out_params, targets) -> dict:
  """What an export wrote, as `cmd_export` prints it."""
  summary = {
    "workdir": os.path.abspath(args.workdir),
    "step": step,
    "out": os.path.abspath(args.out),
    "hf_model_type": model_type,
    "hf_source": source.path if source is not None else None,
    "dtype": args.dtype,
    "num_params": _param_count(out_params),
    "files": sorted(os.listdir(args.out)),
  }
  if targets:
    summary["adapters"] = {"out": os.path.abspath(args.adapters), "target_modules": targets}
  return summary


def cmd_export(args) -> dict:
  """Writes the params of a trainer checkpoint as an HF checkpoint directory (adapters, when
  the run had them, merged into the weights they adapt). Every output is checked before any
  is written: a refused export leaves every directory as it was."""
  from jaxrl_llm.models import hf_adapters, hf_export

  _check_flags(args)
  source, tokenizer = _resolve_inputs(args)
  cfg, params, meta, step = restore_params(args.workdir, args.step)  # the run, then the outputs
  _check_destinations(args, source, tokenizer, meta)
  model_type, out_cfg, out_params = _export_model(args, cfg, params, meta, source)
  out_kwargs = dict(
    model_type=model_type,
    dtype=args.dtype,
    max_shard_bytes=args.max_shard_bytes,
    overwrite=args.overwrite,
    source=source,
    tokenizer=tokenizer,
    max_position_embeddings=args.max_position_embeddings,
  )
  # Each output checked before any is written: the adapters (and a random-init base beside
  # them, which PEFT needs too) are written first, so a refused --out would come too late.
  hf_export.check_checkpoint(args.out, out_cfg, out_params, **out_kwargs)
  base = source.path if source is not None else None  # the adapters' base model
  base_kwargs, targets = None, []
  if args.adapters:
    hf_adapters.check_adapters(
      args.adapters, cfg, params, model_type=model_type, overwrite=args.overwrite
    )
    if base is None:
      base, base_kwargs = _base_export(args, cfg, params, model_type)
      hf_export.check_checkpoint(base, **base_kwargs)
    if base_kwargs is not None:
      hf_export.save_checkpoint(base, **base_kwargs)
    targets = hf_adapters.save_adapters(
      args.adapters, cfg, params, model_type=model_type, base_model=base, overwrite=args.overwrite
    )
  model_type = hf_export.save_checkpoint(args.out, out_cfg, out_params, **out_kwargs)
  summary = _export_summary(args, step, source, model_type, out_params, targets)
  print(json.dumps(summary, indent=2))
  return summary


def cmd_import_gguf(args) -> dict:
  """Writes the HF directory of a GGUF file (`models.gguf.import_gguf`) and prints its summary."""
  from jaxrl_llm.models import gguf

  if os.path.lexists(args.out_dir) and not os.path.isdir(args.out_dir):
    raise ConvertError(f"OUT_DIR={args.out_dir}: is a file, not a directory; name a new directory")
  summary = gguf.import_gguf(args.gguf, args.out_dir, dtype=args.dtype)
  print(json.dumps(summary, indent=2))
  return summary


def build_parser() -> argparse.ArgumentParser:
  """The command-line parser of both sub-commands."""
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument("--debug", action="store_true", help="print the traceback of an error")
  p = terminal.ArgParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  sub = p.add_subparsers(dest="command", required=True)
  imp = sub.add_parser("import", parents=[common], help="validate / inspect an HF checkpoint")
  imp.add_argument("--hf_dir", required=True, help="directory with config.json and safetensors")
  imp.add_argument("--out", default=None, help="write orbax params + meta.json here")
  imp.add_argument("--param_dtype", default=None, choices=["float32", "bfloat16", "float16"])
  imp.add_argument("--scan_layers", action="store_true", help="scanned layout (model.scan_layers)")
  gg = sub.add_parser("import-gguf", parents=[common], help="a GGUF file as an HF directory")
  gg.add_argument("gguf", help="the .gguf file (a Llama architecture)")
  gg.add_argument(
    "out_dir",
    help="the HF directory to write: a new one, or one holding no weights (*.safetensors) and "
    "none of the files the import writes (config.json, tokenizer*.json, generation_config.json)",
  )
  gg.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  exp = sub.add_parser("export", parents=[common], help="write a trainer policy as HF checkpoint")
  exp.add_argument("--workdir", required=True, help="trainer workdir (holds checkpoints/)")
  exp.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
  exp.add_argument("--out", required=True, help="HF checkpoint directory to write")
  exp.add_argument(
    "--model_type", default=None, help="HF model_type: a family of jaxrl_llm/models/families.py"
  )
  exp.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
  exp.add_argument(
    "--max_shard_bytes", type=int, default=5 * 2**30, help="most bytes of one safetensors file"
  )
  exp.add_argument(
    "--overwrite",
    action="store_true",
    help="replace weights and the files an export writes already in --out / --adapters (never "
    "in a trainer workdir)",
  )
  exp.add_argument(
    "--adapters",
    default=None,
    help="a run with adapters (model.lora_rank): also write them here in PEFT's format "
    "(adapter_model.safetensors + adapter_config.json); --out always gets the merged weights",
  )
  exp.add_argument(
    "--hf_source",
    default=None,
    help="HF directory the run started from (default: the workdir's recorded model.checkpoint; "
    f"{NONE}: no source)",
  )
  exp.add_argument(
    "--tokenizer",
    default=None,
    help="tokenizer directory, or its tokenizer.json (the tokenizer files beside it come "
    "along), to copy (default: the run's data.tokenizer, "
    f"else the source's files; {NONE}: copy none)",
  )
  exp.add_argument(
    "--max_position_embeddings",
    type=int,
    default=None,
    help="context length for config.json (default: the source's, else the model type's)",
  )
  return p


def main(argv=None) -> dict:
  """Parses the sub-command and runs it; returns its summary dict (errors are raised)."""
  args = build_parser().parse_args(argv)
  commands = {"import": cmd_import, "import-gguf": cmd_import_gguf, "export": cmd_export}
  return commands[args.command](args)


def one_line(e: BaseException) -> str:
  """The message of `e` on one line (a multi-line list of problems joined with '; ')."""
  from jaxrl_llm.models.hf_config import CheckpointFormatError

  lines = [line.strip() for line in str(e).splitlines() if line.strip()]
  msg = ""
  for line in lines:
    msg += line if not msg else (" " if msg.endswith(":") else "; ") + line
  msg = msg or repr(e)
  known = (ConvertError, CheckpointFormatError, OSError, ValueError)
  if not isinstance(e, known):
    msg = f"{type(e).__name__}: {msg} (--debug shows the traceback)"
  return msg


def cli(argv=None) -> int:
  """Runs `main`; bad input prints one `error:` line to stderr and returns exit code 2."""
  argv = sys.argv[1:] if argv is None else list(argv)
  from jaxrl_llm import backend, terminal

  debug = "--debug" in argv
  terminal.setup(debug)  # plain lines; the libraries' chatter off the terminal unless --debug
  try:
    backend.choose(debug)  # a backend's native start-up chatter goes to the log, not here
    main(argv)
  except KeyboardInterrupt:
    if debug:
      traceback.print_exc()
    print("error: stopped by Ctrl-C: what was at the output before is as it was", file=sys.stderr)
    return 130
  except Exception as e:
    if debug:
      traceback.print_exc()
    print(f"error: {one_line(e)}", file=sys.stderr)
    return EXIT_BAD_INPUT
  return 0


if __name__ == "__main__":
  sys.exit(cli())
