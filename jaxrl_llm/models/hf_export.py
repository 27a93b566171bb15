"""Export of our models as Hugging Face checkpoint directories (`save_checkpoint`), and of a
ModelConfig as a family's config.json (`config_to_hf`: RoPE in both transformers spellings, the
fields config.json has no name for under the `jaxrl_llm` key).

The tensors are written in the family's order, in safetensors shards of a bounded size (with an
index file when there are several); a scanned model's parameters come off the device one layer at
a time. `hf.load_checkpoint` of an export gives back the same ModelConfig and bit-identical
parameters. An export carries over the metadata of the directory the model was imported from
(`hf.read_source`): context length and special token ids in config.json, generation_config.json
and the tokenizer files.
"""

from __future__ import annotations

import inspect
import os
import shutil
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import ml_dtypes
import numpy as np
from absl import logging

from jaxrl_llm import paths
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.families import (
  BY_MODEL_TYPE,
  MODEL_TYPES,
  Family,
  default_model_type,
  features,
)
from jaxrl_llm.models.hf import HFSource, abstract_params, read_source
from jaxrl_llm.models.hf_config import (
  CARRIED_FIELDS,
  EXTRA_KEY,
  CheckpointFormatError,
  MissingCheckpointFileError,
  hf_fields,
)
from jaxrl_llm.models.hf_layout import (
  CONFIG_FILE,
  GENERATION_CONFIG_FILE,
  TOKENIZER_FILES,
  Entry,
  Param,
  flatten,
  param_entries,
  param_map,
  scanned_at,
  to_host,
  tokenizer_files,
  write_json,
)
from jaxrl_llm.models.hf_shards import ShardWriter, weight_files

__all__ = ["check_checkpoint", "save_checkpoint", "weight_files", "written_files"]

_SAVE_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


# --------------------------------------------------------------------------- arguments, metadata


def _inexpressible(cfg: ModelConfig, fam: Family) -> list[str]:
  """What `cfg` has that `fam`'s config.json cannot express (or lacks that it needs)."""
  mt = fam.model_type
  errors = [
    f"{mt} {'needs' if wanted else 'cannot have'} {name}"
    for name, have, wanted in features(cfg, fam)
    if have != wanted
  ]
  if not cfg.moe_num_experts:
    return errors
  if cfg.moe_num_shared_experts:
    errors.append(
      f"{mt} has no shared experts (moe_num_shared_experts={cfg.moe_num_shared_experts}), and "
      "no model_type the export writes has them: such a model stays in this trainer's checkpoints"
    )
  ex = fam.experts
  if ex is not None:
    fixed = []  # what the family's config.json has no field for
    if not ex.layer_pattern:
      fixed.append(("moe_every=1", cfg.moe_every == 1))
    if ex.normalize_key is None:
      fixed.append(("moe_normalize_gates=True", cfg.moe_normalize_gates))
    if not all(ok for _, ok in fixed):
      errors.append(f"{mt} needs " + " and ".join(name for name, _ in fixed))
  return errors


def _rope_hf(cfg: ModelConfig) -> dict[str, Any]:
  """The RoPE fields of config.json, in both spellings: `rope_theta` + `rope_scaling`
  (transformers 4) and `rope_parameters` (5)."""
  rope: dict[str, Any] = {"rope_type": "default"}
  if cfg.rope_scaling != "none":
    rope = {"rope_type": cfg.rope_scaling, "factor": cfg.rope_scaling_factor}
    if cfg.rope_scaling == "llama3":
      rope.update(
        low_freq_factor=cfg.rope_low_freq_factor,
        high_freq_factor=cfg.rope_high_freq_factor,
        original_max_position_embeddings=cfg.rope_original_max_len,
      )
  return {
    "rope_theta": cfg.rope_theta,
    "rope_scaling": None if cfg.rope_scaling == "none" else dict(rope),
    "rope_parameters": {**rope, "rope_theta": cfg.rope_theta},
  }


def _feature_hf(cfg: ModelConfig, fam: Family) -> dict[str, Any]:
  """The config.json fields of the family's features: biases, sliding window, experts."""
  out: dict[str, Any] = {}
  if not fam.qkv_bias:
    out["attention_bias"] = False
  if fam.window_key is not None:  # its flag off, or (where the field is the size) no window
    out.update({fam.window_key: False, "sliding_window": None})
  ex = fam.experts
  if ex is None:
    return out
  out.update({ex.count_key: cfg.moe_num_experts, ex.dim_key: cfg.moe_expert_mlp_dim})
  if ex.normalize_key is not None:
    out[ex.normalize_key] = cfg.moe_normalize_gates
  if ex.layer_pattern:
    out.update(decoder_sparse_step=cfg.moe_every, mlp_only_layers=[])
  out.update(
    num_experts_per_tok=cfg.moe_top_k,
    router_aux_loss_coef=cfg.moe_aux_loss_coef / cfg.moe_top_k,
    output_router_logits=False,
  )
  return out


def config_to_hf(
  cfg: ModelConfig,
  model_type: str | None = None,
  *,
  dtype: str = "float32",
  max_position_embeddings: int | None = None,
):
  """The config.json dict of `cfg` as `model_type`; raises ValueError if it cannot express it.

  ModelConfig records no context length: `max_position_embeddings` defaults to the one the
  reference configuration class of `model_type` assumes when config.json omits it.
  """
  mt = model_type or default_model_type(cfg)
  if mt not in BY_MODEL_TYPE:
    raise ValueError(f"model_type={mt!r} is not supported; supported: {list(MODEL_TYPES)}")
  fam = BY_MODEL_TYPE[mt]
  errors = _inexpressible(cfg, fam)
  if errors:
    raise ValueError(f"cannot export this model as model_type={mt!r}: " + "; ".join(errors))
  hf: dict[str, Any] = {
    "architectures": [fam.architecture],
    "model_type": mt,
    "vocab_size": cfg.vocab_size,
    "hidden_size": cfg.d_model,
    "intermediate_size": cfg.mlp_dim,  # Mixtral's experts' width replaces it (`_feature_hf`)
    "num_hidden_layers": cfg.num_layers,
    "num_attention_heads": cfg.num_heads,
    "num_key_value_heads": cfg.num_kv_heads,
    "head_dim": cfg.head_dim,
    "hidden_act": "silu",
    "max_position_embeddings": max_position_embeddings or fam.default("max_position_embeddings"),
    "rms_norm_eps": cfg.norm_eps,
    **_rope_hf(cfg),
    "tie_word_embeddings": cfg.tie_embeddings,
    "torch_dtype": dtype,
    "use_cache": True,
    **_feature_hf(cfg, fam),
  }
  hard, _ = hf_fields(hf, "config_to_hf")
  ours = cfg.to_dict()
  hf[EXTRA_KEY] = {k: v for k, v in ours.items() if k not in hard}
  return hf


def _is_count(n: Any) -> bool:
  return isinstance(n, int) and not isinstance(n, bool) and n >= 1


def _check_save_args(dtype: str, max_position_embeddings: Any, max_shard_bytes: Any) -> None:
  """Raises ValueError for a storage dtype, context length or shard size that `save_checkpoint`
  refuses."""
  if dtype not in _SAVE_DTYPES:
    raise ValueError(f"dtype={dtype!r} must be one of {list(_SAVE_DTYPES)}")
  if not _is_count(max_shard_bytes):  # 0 or less would write every tensor in a shard of its own
    raise ValueError(f"max_shard_bytes={max_shard_bytes!r} must be an int >= 1")
  if max_position_embeddings is not None and not _is_count(max_position_embeddings):
    raise ValueError(f"max_position_embeddings={max_position_embeddings!r} must be an int >= 1")


def _export_config(
  cfg: ModelConfig,
  mt: str,
  source: HFSource | None,
  dtype: str,
  max_position_embeddings: int | None,
  hf_overrides: Mapping[str, Any] | None,
  warn: bool = True,
) -> dict[str, Any]:
  """The config.json of an export: `cfg` as `mt`, the source's carried fields, the overrides."""
  fields = dict(source.fields) if source is not None else {}
  max_pos = max_position_embeddings or fields.get("max_position_embeddings")
  if max_pos is None and warn:
    logging.warning(
      "no context length known for this model: config.json gets %s's default "
      "max_position_embeddings (pass max_position_embeddings or the source checkpoint)",
      mt,
    )
  hf = config_to_hf(cfg, mt, dtype=dtype, max_position_embeddings=max_pos)
  hf.update({k: fields.get(k) for k in CARRIED_FIELDS if k != "max_position_embeddings"})
  hf.update(hf_overrides or {})
  return hf


def _generation_config(hf: Mapping[str, Any], source: HFSource | None) -> dict[str, Any]:
  """The source's generation_config.json (or an empty one) with the token ids it lacks taken
  from the exported config.json."""
  out = dict(source.generation_config or {}) if source is not None else {}
  for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
    if out.get(key) is None and hf.get(key) is not None:
      out[key] = hf[key]
  return out


def _tokenizer_sources(
  tokenizer: str | os.PathLike | None,
  source: HFSource | None,
  vocab: int | None = None,
  warn: bool = False,
) -> list[tuple[str, str]]:
  """(file to copy, name in the export) of each tokenizer file an export writes; a
  tokenizer.json that does not parse, or (given `vocab`, the model's rows) that knows more
  tokens (the tokenizer of another model), raises CheckpointFormatError. A file named
  tokenizer.json stands for its directory (the tokenizer_config.json, chat template etc.
  beside it come along); a file of another name is copied alone as tokenizer.json, with a
  warning when `warn`: the export then has no eos or pad token and no chat template."""
  if tokenizer is None:
    pairs = [(os.path.join(source.path, n), n) for n in source.tokenizer_files] if source else []
  elif os.path.isfile(tokenizer := os.fspath(tokenizer)):
    folder = os.path.dirname(os.path.abspath(tokenizer))
    if os.path.basename(tokenizer) == TOKENIZER_FILES[0]:
      pairs = [(os.path.join(folder, n), n) for n in tokenizer_files(folder)]
    else:
      pairs = [(tokenizer, TOKENIZER_FILES[0])]
      if warn:
        logging.warning(
          "tokenizer file %s is not named tokenizer.json, so it is exported alone: the export has "
          "no tokenizer_config.json (no eos or pad token, no chat template); pass the directory "
          "holding it with its tokenizer_config.json instead",
          tokenizer,
        )
  elif not os.path.isdir(tokenizer):
    raise MissingCheckpointFileError(f"{tokenizer}: no such tokenizer directory or file")
  elif not (names := tokenizer_files(tokenizer)):
    raise MissingCheckpointFileError(
      f"{tokenizer}: holds none of the tokenizer files {list(TOKENIZER_FILES)}"
    )
  else:
    pairs = [(os.path.join(tokenizer, n), n) for n in names]
  for path, name in pairs:  # checked before anything is written, as the trainer reads it
    if name == TOKENIZER_FILES[0]:
      from tokenizers import Tokenizer

      try:
        size = Tokenizer.from_file(path).get_vocab_size(with_added_tokens=True)
      except Exception as e:  # the library's own parse error
        raise CheckpointFormatError(f"{path} is not a valid tokenizer.json: {e}") from None
      if vocab is not None and size > vocab:
        raise CheckpointFormatError(
          f"{path}: a tokenizer of {size} tokens, more than the model's vocab_size={vocab} "
          "(the tokenizer of another model?)"
        )
  return pairs


_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


def _check_vocab(vocab: int, source: HFSource | None, configs: Mapping[str, Mapping]) -> None:
  """Raises CheckpointFormatError when `source` was made for another vocabulary than the
  model's `vocab` rows, or a token id an exported config (`configs`: file name -> dict) holds
  reaches past them (a source or override of another model)."""
  if source is not None and source.vocab_size is not None and source.vocab_size != vocab:
    raise CheckpointFormatError(
      f"{source.path}: config.json has vocab_size={source.vocab_size!r}, the model "
      f"{vocab}: not the checkpoint this model was imported from (its token ids and tokenizer "
      "would not fit)"
    )
  for name, conf in configs.items():
    for key in _TOKEN_IDS:
      value = conf.get(key)
      ids = value if isinstance(value, list) else [value]
      if any(isinstance(i, int) and i >= vocab for i in ids):
        where = os.path.join(source.path, name) if source is not None else f"the exported {name}"
        raise CheckpointFormatError(
          f"{where}: {key}={value!r} is not below the model's vocab_size={vocab}"
        )


# --------------------------------------------------------------------------- weights


def _check_params(
  cfg: ModelConfig, flat: Mapping, entries: list[Entry], mt: str, warn: bool = True
) -> None:
  """Raises ValueError naming a parameter of the wrong shape, a missing one or one that `mt`
  cannot store (a value head is only warned about: it is not exported)."""
  shapes = {k: v.shape for k, v in flatten(nn.unbox(abstract_params(cfg))).items()}
  for e in entries:
    if e.path not in flat or tuple(flat[e.path].shape) != tuple(shapes[e.path]):
      found = tuple(flat[e.path].shape) if e.path in flat else "absent"
      raise ValueError(f"params[{'/'.join(e.path)}]: expected shape {shapes[e.path]}, got {found}")
  extra = sorted("/".join(k) for k in set(flat) - {e.path for e in entries})
  if any(not k.startswith("value_head/") for k in extra):
    raise ValueError(f"params hold entries that {mt} cannot store: {extra}")
  if extra and warn:
    logging.warning("not exporting the value head (%s)", ", ".join(extra))


def written_files(
  source: HFSource | None = None, tokenizer: str | os.PathLike | None = None
) -> list[str]:
  """The names of the files other than weights that an export with this source and tokenizer
  writes or replaces (config.json, generation_config.json; where it writes a tokenizer, every
  tokenizer file name: one left from an older export would mix with it)."""
  copies = _tokenizer_sources(tokenizer, source)
  return [CONFIG_FILE, GENERATION_CONFIG_FILE, *(TOKENIZER_FILES if copies else ())]


def _check_weights(path: str, overwrite: bool, names: list[str]) -> None:
  """Refuses a file at `path`, a directory holding weights unless `overwrite`, and anything but
  a file where the export writes one of `names` (a folder named config.json, say), before
  anything is written: found after the weights moved in, it left an old export half replaced."""
  if os.path.lexists(path) and not os.path.isdir(path):
    raise NotADirectoryError(f"{path}: is a file, not a directory")
  old = weight_files(path)
  if old and not overwrite:
    raise FileExistsError(f"{path} already holds weights ({old}); pass overwrite=True")
  for target in [*old, *(os.path.join(path, n) for n in names)]:
    if os.path.lexists(target) and not os.path.isfile(target):
      raise IsADirectoryError(
        f"{target}: is not a file, and the export writes a file there; move it away or give "
        "another directory"
      )


def _written(copies: list[tuple[str, str]]) -> list[str]:
  """The names of the files an export writes beside its weights (`copies`: the tokenizer's)."""
  return [CONFIG_FILE, GENERATION_CONFIG_FILE, *(name for _, name in copies)]


def _stage(staged: list, path: str, generation: dict, hf: dict, copies: list) -> None:
  """Writes the export's JSON and tokenizer files beside their places (`.<name>.tmp`), adding
  each (temporary, final) pair to `staged` before it is written (so a failure part-way leaves
  the caller every file to remove). A tokenizer file copied onto itself is left out."""
  for name, content in ((GENERATION_CONFIG_FILE, generation), (CONFIG_FILE, hf)):
    staged.append((os.path.join(path, f".{name}.tmp"), os.path.join(path, name)))
    write_json(staged[-1][0], content)
  for src, name in copies:
    dst = os.path.join(path, name)
    if not (os.path.exists(dst) and os.path.samefile(src, dst)):
      staged.append((os.path.join(path, f".{name}.tmp"), dst))
      shutil.copyfile(src, staged[-1][0])


def _publish(path: str, staged: list, copies: list[tuple[str, str]]) -> None:
  """Moves the staged files into place (config.json last) and, where a tokenizer came, removes
  the directory's other tokenizer files: an older export's would mix in (a chat_template.jinja
  over the config's template, say)."""
  for tmp, final in sorted(staged, key=lambda pair: pair[1].endswith(os.sep + CONFIG_FILE)):
    paths.publish(tmp, final)
  for name in set(TOKENIZER_FILES) - {n for _, n in copies} if copies else ():
    if os.path.isfile(stale := os.path.join(path, name)):
      os.remove(stale)


def _write_params(
  shards: ShardWriter, cfg: ModelConfig, params_map: list[Param], flat: Mapping, dtype: str
) -> None:
  """Adds every HF tensor to `shards` in HF order, a scanned parameter one layer at a time off
  the device."""
  np_dtype = _SAVE_DTYPES[dtype]
  for p in params_map:
    at = scanned_at(cfg, p.path)
    host = to_host(flat[p.path] if at is None else flat[at[0]][at[1]])
    for e, name in enumerate(p.names):
      shards.add(name, p.to_hf(host[e] if p.stacked else host).astype(np_dtype))
    del host


def save_checkpoint(
  path: str | os.PathLike,
  cfg: ModelConfig,
  params: Any,
  *,
  model_type: str | None = None,
  dtype: str = "float32",
  max_shard_bytes: int = 5 * 2**30,
  hf_overrides: Mapping[str, Any] | None = None,
  overwrite: bool = False,
  source: str | os.PathLike | HFSource | None = None,
  tokenizer: str | os.PathLike | None = None,
  max_position_embeddings: int | None = None,
) -> str:
  """Writes `params` of `cfg` as a Hugging Face checkpoint directory; returns its model type.

  `model_type` defaults to `default_model_type(cfg)`. Tensors are stored as `dtype`, in shards of
  at most `max_shard_bytes` (with an index file when there are several). A value head is not
  exported. Refuses a directory that already holds weights unless `overwrite`; a tokenizer
  written there removes the directory's other tokenizer files (an older export's would mix in).

  `source` is the Hugging Face directory the model was imported from (or its `read_source`):
  its max_position_embeddings and bos / eos / pad token ids go into config.json, its
  generation_config.json is kept (token ids it lacks are filled in from config.json) and its
  tokenizer files are copied. `tokenizer` (a directory, or its tokenizer.json file: the
  tokenizer files beside it come along) replaces the source's tokenizer files. Without a source the token ids are null and max_position_embeddings
  is the model type's default, unless `max_position_embeddings` is given (it also overrides the
  source's). `hf_overrides` are merged into config.json last. generation_config.json is always
  written, with the token ids config.json holds.
  """
  path = os.fspath(path)
  mt, hf, generation, tokenizer_copies, params_map, flat = _prepare(
    path,
    cfg,
    params,
    model_type=model_type,
    dtype=dtype,
    max_shard_bytes=max_shard_bytes,
    hf_overrides=hf_overrides,
    overwrite=overwrite,
    source=source,
    tokenizer=tokenizer,
    max_position_embeddings=max_position_embeddings,
  )
  _check_weights(path, overwrite, _written(tokenizer_copies))
  _write(path, cfg, (params_map, flat), dtype, max_shard_bytes, (generation, hf, tokenizer_copies))
  return mt


def _write(path: str, cfg: ModelConfig, mapped, dtype: str, max_shard_bytes: int, files) -> None:
  """Writes the export: the shards (`mapped`: param map, flat params) and the JSON and tokenizer
  `files` (generation_config.json, config.json, tokenizer copies), every one beside its place
  before the first moves in; an interrupt or a full disk leaves an export there before whole."""
  writer = jax.process_index() == 0
  if writer:
    os.makedirs(path, exist_ok=True)
  shards, staged = ShardWriter(path, max_shard_bytes, writer), []
  try:
    _write_params(shards, cfg, *mapped, dtype)
    if writer:
      _stage(staged, path, *files)
    shards.close()
    if writer:
      _publish(path, staged, files[2])
  except BaseException:
    shards.abort()
    for tmp, _ in staged:  # those not moved in yet
      if os.path.exists(tmp):
        os.remove(tmp)
    raise


def _prepare(path: str, cfg: ModelConfig, params: Any, warn: bool = True, **kwargs):
  """Every check of `save_checkpoint(path, cfg, params, **kwargs)`, writing nothing; returns
  (model type, config.json, generation_config.json, tokenizer copies, param map, flat params).
  `warn`: log what the export lacks (a check leaves that to the export)."""
  source, tokenizer = kwargs["source"], kwargs["tokenizer"]
  dtype, max_pos = kwargs["dtype"], kwargs["max_position_embeddings"]
  _check_save_args(dtype, max_pos, kwargs["max_shard_bytes"])
  if source is not None and not isinstance(source, HFSource):
    source = read_source(source)
  mt = kwargs["model_type"] or default_model_type(cfg)
  hf = _export_config(cfg, mt, source, dtype, max_pos, kwargs["hf_overrides"], warn)
  generation = _generation_config(hf, source)
  tokenizer_copies = _tokenizer_sources(tokenizer, source, cfg.vocab_size, warn)
  _check_vocab(cfg.vocab_size, source, {CONFIG_FILE: hf, GENERATION_CONFIG_FILE: generation})
  params_map = param_map(cfg, BY_MODEL_TYPE[mt])
  flat = flatten(params)
  _check_params(cfg, flat, param_entries(cfg, params_map), mt, warn)
  _check_weights(path, kwargs["overwrite"], _written(tokenizer_copies))
  return mt, hf, generation, tokenizer_copies, params_map, flat


def check_checkpoint(path: str | os.PathLike, cfg: ModelConfig, params: Any, **kwargs) -> str:
  """Raises what `save_checkpoint(path, cfg, params, **kwargs)` would, writing nothing (for a
  caller writing several outputs: each is checked before any is written); returns the model
  type."""
  args = inspect.signature(save_checkpoint).bind(path, cfg, params, **kwargs)
  args.apply_defaults()
  given = {k: v for k, v in args.arguments.items() if k not in ("path", "cfg", "params")}
  return _prepare(os.fspath(path), cfg, params, warn=False, **given)[0]
