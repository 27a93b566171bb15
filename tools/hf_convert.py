"""Hugging Face checkpoints in and out of the trainer.

  python tools/hf_convert.py import --hf_dir=DIR [--out=CKPT_DIR] [--param_dtype=bfloat16] \\
      [--scan_layers]
  python tools/hf_convert.py export --workdir=TRAIN_WORKDIR [--step=N] --out=HF_DIR \\
      [--model_type=qwen2] [--dtype=bfloat16] [--max_shard_bytes=N] [--overwrite]

`import` loads and validates an HF checkpoint directory (config.json + safetensors) and prints
its ModelConfig, model type and parameter count; with --out it also writes the parameters as an
orbax checkpoint (`CKPT_DIR/params`, StandardSave) with `CKPT_DIR/meta.json` holding
{"model": ModelConfig dict, "hf_model_type": ...}. --scan_layers loads them in the scanned layout
(model.scan_layers: each layer parameter stacked on a leading layer axis).

`export` restores the policy parameters of a trainer checkpoint (`<workdir>/checkpoints/<step>`,
latest step by default) and writes them as an HF checkpoint. The ModelConfig comes from the
checkpoint's meta ('model'); the HF model type from --model_type, else the meta's
'hf_model_type', else the architecture (qwen3_moe / mixtral / qwen3 / qwen2 / llama). Tokenizer
files are not written: copy them from the model the run started from.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _param_count(params) -> int:
  import jax

  return sum(int(x.size) for x in jax.tree.leaves(params))


def cmd_import(args) -> dict:
  """Loads (and validates) an HF directory; optionally writes orbax params + meta.json."""
  from jaxrl_llm.models import hf

  cfg, params = hf.load_checkpoint(
    args.hf_dir, param_dtype=args.param_dtype, scan_layers=args.scan_layers or None
  )
  with open(os.path.join(args.hf_dir, "config.json")) as f:
    model_type = json.load(f)["model_type"]
  summary = {
    "hf_dir": os.path.abspath(args.hf_dir),
    "hf_model_type": model_type,
    "num_params": _param_count(params),
    "model": cfg.to_dict(),
  }
  if args.out:
    import orbax.checkpoint as ocp

    out = os.path.abspath(args.out)
    if os.path.exists(os.path.join(out, "params")):
      raise SystemExit(f"{out}/params already exists; choose a new --out")
    os.makedirs(out, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
      ckptr.save(os.path.join(out, "params"), params)
      ckptr.wait_until_finished()
    with open(os.path.join(out, "meta.json"), "w") as f:
      json.dump({"model": cfg.to_dict(), "hf_model_type": model_type}, f, indent=2)
    summary["out"] = out
  print(json.dumps(summary, indent=2))
  return summary


def restore_params(workdir: str, step: int | None = None):
  """(ModelConfig, params, meta, step) of a trainer checkpoint; only the params are read."""
  import flax.linen as nn
  import jax
  import orbax.checkpoint as ocp

  from jaxrl_llm.checkpoint import Checkpointer
  from jaxrl_llm.models import hf
  from jaxrl_llm.models.config import ModelConfig

  if not os.path.isdir(os.path.join(workdir, "checkpoints")):
    raise SystemExit(f"{workdir} has no checkpoints/ directory (not a trainer workdir?)")
  ckpt = Checkpointer(workdir, save_every=0, async_save=False)
  steps = ckpt.all_steps()
  if not steps:
    raise SystemExit(f"{workdir}/checkpoints holds no committed checkpoint")
  step = steps[-1] if step is None else step
  if step not in steps:
    raise SystemExit(f"{workdir}/checkpoints has no step {step}; available steps: {steps}")
  meta = ckpt.read_meta(step)
  ckpt.close()
  if "model" not in meta:
    raise SystemExit(f"checkpoint step {step} of {workdir} has no 'model' in its meta")
  cfg = ModelConfig.from_dict(meta["model"])
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  target = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
    nn.unbox(hf.abstract_params(cfg)),
  )
  item = {"params": target}
  restore_args = ocp.checkpoint_utils.construct_restore_args(item)
  path = os.path.join(workdir, "checkpoints", str(step), "state")
  with ocp.PyTreeCheckpointer() as ckptr:
    restored = ckptr.restore(
      path, args=ocp.args.PyTreeRestore(item, restore_args=restore_args, partial_restore=True)
    )
  return cfg, restored["params"], meta, step


def cmd_export(args) -> dict:
  """Writes the params of a trainer checkpoint as an HF checkpoint directory."""
  from jaxrl_llm.models import hf

  cfg, params, meta, step = restore_params(args.workdir, args.step)
  model_type = args.model_type or meta.get("hf_model_type") or hf.default_model_type(cfg)
  model_type = hf.save_checkpoint(
    args.out,
    cfg,
    params,
    model_type=model_type,
    dtype=args.dtype,
    max_shard_bytes=args.max_shard_bytes,
    overwrite=args.overwrite,
  )
  summary = {
    "workdir": os.path.abspath(args.workdir),
    "step": step,
    "out": os.path.abspath(args.out),
    "hf_model_type": model_type,
    "dtype": args.dtype,
    "num_params": _param_count(params),
    "files": sorted(os.listdir(args.out)),
  }
  print(json.dumps(summary, indent=2))
  return summary


def main(argv=None) -> dict:
  """Parses the sub-command and runs it; returns its summary dict."""
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  sub = p.add_subparsers(dest="command", required=True)
  imp = sub.add_parser("import", help="validate / inspect an HF checkpoint directory")
  imp.add_argument("--hf_dir", required=True, help="directory with config.json and safetensors")
  imp.add_argument("--out", default=None, help="write orbax params + meta.json here")
  imp.add_argument("--param_dtype", default=None, choices=["float32", "bfloat16", "float16"])
  imp.add_argument("--scan_layers", action="store_true", help="scanned layout (model.scan_layers)")
  exp = sub.add_parser("export", help="write a trainer checkpoint's policy as an HF checkpoint")
  exp.add_argument("--workdir", required=True, help="trainer workdir (holds checkpoints/)")
  exp.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
  exp.add_argument("--out", required=True, help="HF checkpoint directory to write")
  exp.add_argument("--model_type", default=None, help="llama, qwen2, qwen3, qwen3_moe, mixtral")
  exp.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
  exp.add_argument("--max_shard_bytes", type=int, default=5 * 2**30)
  exp.add_argument("--overwrite", action="store_true", help="replace weights already in --out")
  args = p.parse_args(argv)
  return cmd_import(args) if args.command == "import" else cmd_export(args)


if __name__ == "__main__":
  main()
