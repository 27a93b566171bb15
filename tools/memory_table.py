"""Compile-only memory of the fused RL step at real model shapes (nothing is allocated).

  python tools/memory_table.py --shapes=qwen2.5-0.5b,qwen2.5-1.5b [--set=rl.num_microbatches=4]
  python tools/memory_table.py --prompt_len=512 --new_tokens=4096 \\
      --targets=cpu:1,cpu:8:fsdp=8,cpu:8:fsdp=4:model=2,tpu:v5e-8,tpu:v5p-8,tpu:v6e-8 --markdown

For each shape and target the whole fused step (sampling, verifier, old pass, learner,
optimiser) is built from abstract state (`plan.plan`: `build(config, abstract=True)`),
lowered and compiled, and `compiled.memory_analysis()` is reported per device: argument,
output, temporary bytes, and the peak (arguments + unaliased outputs + temp) against the
device's capacity (`--runs=N`: the packed step of a pack of N runs, `run/pack.py`).
Targets: `cpu:N[:AXIS=K...]` compiles for N CPU devices (fake ones when
N > 1) as a proxy for N GPUs of `--capacity_gib` each; `gpu:N[...]` for this machine's first N
GPUs, against their own capacity (compile only: nothing is allocated); `tpu:SLICE[:AXIS=K...]` (v5e-8, v5p-8,
v6e-8, ...) compiles for that TPU slice through libtpu (`pip install -e '.[tpu]'`) and uses the
chip's HBM. The mesh is fsdp over all N devices unless axes are given. On a CPU-only machine the
CPU backend's plan is an upper-bound proxy for a GPU's (GPU compilers fuse more). One JSON line
per row; `--markdown` adds the table. `--guard=held,twice` plans each row with the non-finite
guard's update held for its check and computed twice (`optim.guarded_update`; by default each
platform's own form). A bad shape, target, count, form or `--set` is one `error:` line on stderr
and exit code 2, before anything is compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:  # run from a checkout without installing it
  sys.path.insert(0, _REPO)

from jaxrl_llm.terminal import ArgParser  # noqa: E402 (after the path above; imports no JAX)

_SMALL: dict[str, object] = {  # a Qwen-vocabulary 8-layer d512 body
  "model.vocab_size": 151936,
  "model.d_model": 512,
  "model.num_layers": 8,
  "model.num_heads": 8,
  "model.num_kv_heads": 2,
  "model.head_dim": 64,
  "model.tie_embeddings": True,
  "sampling.max_new_tokens": 256,
}

# Qwen2.5 shapes (and MoE ones): the model fields the memory depends on (weights are never materialised).
SHAPES: dict[str, dict[str, object]] = {
  "qwen2.5-0.5b": {
    "model.vocab_size": 151936,
    "model.d_model": 896,
    "model.num_layers": 24,
    "model.num_heads": 14,
    "model.num_kv_heads": 2,
    "model.head_dim": 64,
    "model.mlp_dim": 4864,
    "model.attention_bias": True,
    "model.tie_embeddings": True,
    "sampling.max_new_tokens": 256,
  },
  "qwen2.5-1.5b": {
    "model.vocab_size": 151936,
    "model.d_model": 1536,
    "model.num_layers": 28,
    "model.num_heads": 12,
    "model.num_kv_heads": 2,
    "model.head_dim": 128,
    "model.mlp_dim": 8960,
    "model.attention_bias": True,
    "model.tie_embeddings": True,
    "sampling.max_new_tokens": 512,
  },
  "qwen2.5-7b": {
    "model.vocab_size": 152064,
    "model.d_model": 3584,
    "model.num_layers": 28,
    "model.num_heads": 28,
    "model.num_kv_heads": 4,
    "model.head_dim": 128,
    "model.mlp_dim": 18944,
    "model.attention_bias": True,
    "model.tie_embeddings": False,
    "sampling.max_new_tokens": 512,
  },
  "qwen2.5-14b": {
    "model.vocab_size": 152064,
    "model.d_model": 5120,
    "model.num_layers": 48,
    "model.num_heads": 40,
    "model.num_kv_heads": 8,
    "model.head_dim": 128,
    "model.mlp_dim": 13824,
    "model.attention_bias": True,
    "model.tie_embeddings": False,
    "sampling.max_new_tokens": 512,
  },
  "qwen2.5-32b": {
    "model.vocab_size": 152064,
    "model.d_model": 5120,
    "model.num_layers": 64,
    "model.num_heads": 40,
    "model.num_kv_heads": 8,
    "model.head_dim": 128,
    "model.mlp_dim": 27648,
    "model.attention_bias": True,
    "model.tie_embeddings": False,
    "sampling.max_new_tokens": 512,
  },
  # The mixture-of-experts acceptance pair: 64 experts top-8 of width 256 (active width 2048)
  # against the dense twin with mlp_dim 2048, R3 replay.
  "moe-e64": {
    **_SMALL,
    "model.moe_num_experts": 64,
    "model.moe_top_k": 8,
    "model.moe_expert_mlp_dim": 256,
    "replay.name": "r3",
  },
  "dense-e64-twin": {**_SMALL, "model.mlp_dim": 2048},
  "qwen3-30b-a3b": {
    "model.vocab_size": 151936,
    "model.d_model": 2048,
    "model.num_layers": 48,
    "model.num_heads": 32,
    "model.num_kv_heads": 4,
    "model.head_dim": 128,
    "model.qk_norm": True,
    "model.tie_embeddings": False,
    "model.moe_num_experts": 128,
    "model.moe_top_k": 8,
    "model.moe_expert_mlp_dim": 768,
    "replay.name": "r3",
    "sampling.max_new_tokens": 512,
  },
  "mixtral-8x7b": {
    "model.vocab_size": 32000,
    "model.d_model": 4096,
    "model.num_layers": 32,
    "model.num_heads": 32,
    "model.num_kv_heads": 8,
    "model.head_dim": 128,
    "model.rope_theta": 1e6,
    "model.tie_embeddings": False,
    "model.moe_num_experts": 8,
    "model.moe_top_k": 2,
    "model.moe_expert_mlp_dim": 14336,
    "replay.name": "r3",
    "sampling.max_new_tokens": 512,
  },
}

# The run around the model: 8 prompts x 8 completions, bf16 compute, one minibatch.
COMMON: dict[str, object] = {
  "model.dtype": "bfloat16",
  "model.param_dtype": "float32",
  "rl.num_prompts": 8,
  "sampling.group_size": 8,
  "rl.num_minibatches": 1,
  "task.max_len": 11,  # 13-token prompts
  "sft.steps": 0,
  "mesh.data": 1,
}


def shape_config(name: str, overrides: list[str] = ()):
  """The default config at shape `name` with COMMON and the user's `FIELD=VALUE` overrides,
  parsed by the trainer's own command-line parser (typed, unknown fields named)."""
  from jaxrl_llm import launch as trainer_main

  config_file = os.path.join(os.path.dirname(__file__), "..", "configs", "default.py")
  fixed = [f"--config.{k}={v}" for k, v in {**COMMON, **SHAPES[name]}.items()]
  return trainer_main.parse_config(
    ["memory_table", f"--config={config_file}", *fixed, *(f"--config.{o}" for o in overrides)]
  )


def parse_target(spec: str) -> tuple[str, str, dict[str, int]]:
  """`cpu:8:fsdp=4:model=2` -> ("cpu", "8", {"data": 1, "fsdp": 4, "model": 2})."""
  kind, _, rest = spec.partition(":")
  name, *axes = rest.split(":") if rest else ["1"]
  if kind not in ("cpu", "gpu", "tpu"):
    raise ValueError(f"target {spec!r}: starts with cpu:, gpu: or tpu:")
  if kind != "tpu" and not (name.isdigit() and int(name) >= 1):
    raise ValueError(f"target {spec!r}: {kind}:N wants a device count N >= 1, not {name!r}")
  mesh, given = {"data": 1, "fsdp": -1}, set()
  for item in axes:
    axis, _, size = item.partition("=")
    if axis not in ("runs", "data", "fsdp", "expert", "model") or not size.lstrip("-").isdigit():
      raise ValueError(
        f"target {spec!r}: {item!r} is not AXIS=SIZE (runs, data, fsdp, expert, model)"
      )
    if axis in given:
      raise ValueError(f"target {spec!r}: axis {axis!r} given twice; give each axis once")
    given.add(axis)
    mesh[axis] = int(size)
    if mesh[axis] == 0 or mesh[axis] < -1:
      raise ValueError(f"target {spec!r}: {item!r}: SIZE is >= 1 (or -1: what is left)")
  return kind, name, mesh


def target_devices(kind: str, name: str):
  """The devices a target compiles for (the first N CPU or local GPU devices, or a TPU slice's)."""
  import jax

  from jaxrl_llm import plan

  if kind == "tpu":
    return plan.tpu_slice_devices(name)
  n = int(name)
  if kind == "gpu":
    gpus = [d for d in jax.local_devices() if d.platform == "gpu"]
    if len(gpus) < n:
      raise RuntimeError(f"gpu:{n} needs {n} GPUs; this process has {len(gpus)}")
    return gpus[:n]
  if jax.device_count() < n:
    raise RuntimeError(f"cpu:{n} needs {n} CPU devices; this process has {jax.device_count()}")
  return jax.devices()[:n]


def row_config(shape: str, target: str, overrides: list[str], new_tokens: int = 0):
  """The config of `shape` on `target`'s mesh with `new_tokens` (0: the shape's) and the
  user's overrides."""
  _, _, mesh = parse_target(target)
  extra = [f"mesh.{k}={v}" for k, v in mesh.items()]
  if new_tokens:
    extra.append(f"sampling.max_new_tokens={new_tokens}")
  return shape_config(shape, [*extra, *overrides])


GUARD_FORMS = ("auto", "held", "twice")  # --guard: each platform's own form, or one for all


def row(
  shape: str,
  target: str,
  overrides: list[str],
  prompt_len,
  new_tokens,
  capacity_gib,
  runs=0,
  guard="auto",
):
  """One table row: the plan of `shape` on `target` (a pack of `runs` runs when > 0; the
  guard's update in the form `guard`, one of GUARD_FORMS) as a JSON-able dict."""
  from jaxrl_llm import optim, plan
  from jaxrl_llm.config import parse

  kind, name, _ = parse_target(target)
  config = row_config(shape, target, overrides, new_tokens)
  out = {"shape": shape, "target": target, "overrides": overrides, "runs": runs or None}
  if guard != "auto":
    out["guard"] = guard
  try:
    devices = target_devices(kind, name)
  except RuntimeError as err:
    return {**out, "skipped": str(err)}
  capacity = int(capacity_gib * plan.GIB) if kind == "cpu" else None
  platform = devices[0].platform
  own = optim.RECOMPUTE_ON
  if guard != "auto":  # the guard picks its form by the platform compiled for
    optim.RECOMPUTE_ON = own | {platform} if guard == "twice" else own - {platform}
  try:
    p = plan.plan(parse(config), devices, prompt_len=prompt_len, capacity_bytes=capacity, runs=runs)
  finally:
    optim.RECOMPUTE_ON = own
  gib = plan.GIB
  return {
    **out,
    "prompt_len": prompt_len or None,
    "new_tokens": config.sampling.max_new_tokens,
    "sequences": config.rl.num_prompts * config.sampling.group_size,
    "mesh": p.mesh,
    "device_kind": p.device_kind,
    "argument_gib": p.argument_bytes / gib,
    "output_gib": p.output_bytes / gib,
    "alias_gib": p.alias_bytes / gib,
    "temp_gib": p.temp_bytes / gib,
    "peak_estimate_gib": p.peak_bytes / gib,
    "capacity_gib": None if p.capacity_bytes is None else p.capacity_bytes / gib,
    "fits": p.fits,
    "refused": p.refused or None,
    "compile_s": p.compile_s,
  }


def markdown(rows: list[dict]) -> str:
  """The rows as a markdown table."""
  lines = [
    "| shape | target | mesh | arguments | temp | peak per device | capacity | fits |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    if "skipped" in r:
      lines.append(f"| {r['shape']} | {r['target']} | – | – | – | – | – | {r['skipped']} |")
      continue
    mesh = " x ".join(f"{k} {v}" for k, v in r["mesh"].items() if v > 1) or "1 device"
    if "guard" in r:
      mesh += f", update {r['guard']}"
    cap = "–" if r["capacity_gib"] is None else f"{r['capacity_gib']:.1f} GiB"
    fits = {True: "yes", False: "no", None: "unknown"}[r["fits"]]  # None: no capacity known
    lines.append(
      f"| {r['shape']} | {r['target']} | {mesh} | {r['argument_gib']:.1f} GiB | "
      f"{r['temp_gib']:.1f} GiB | {r['peak_estimate_gib']:.1f} GiB | {cap} | {fits} |"
    )
  return "\n".join(lines)


class ArgError(Exception):
  """A bad command line (reported as one `error:` line, exit code 2)."""


def check_args(args) -> list[tuple[str, str, dict[str, int]]]:
  """The parsed targets of valid arguments (JAX not imported yet: its platform is still to be
  chosen); ArgError names the first bad shape, target, count or capacity."""
  for name in args.shapes.split(","):
    if name not in SHAPES:
      raise ArgError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
  try:
    parsed = [parse_target(t) for t in args.targets.split(",")]
  except ValueError as err:
    raise ArgError(str(err)) from None
  for flag in ("prompt_len", "new_tokens", "runs"):
    if getattr(args, flag) < 0:
      raise ArgError(f"--{flag}={getattr(args, flag)}: want >= 0 (0: the default)")
  guards = args.guard.split(",")
  unknown = [g for g in guards if g not in GUARD_FORMS]
  if unknown:
    raise ArgError(f"--guard={args.guard}: unknown form {unknown[0]!r}; want of {GUARD_FORMS}")
  twice = [g for i, g in enumerate(guards) if g in guards[:i]]
  if twice:
    raise ArgError(f"--guard={args.guard}: form {twice[0]!r} given twice; give each form once")
  if not 0 < args.capacity_gib < float("inf"):
    raise ArgError(f"--capacity_gib={args.capacity_gib}: want a number of GiB > 0")
  return parsed


def check_on_target(config, kind: str, name: str) -> None:
  """Raises ConfigError (a ValueError) where the compile's own cross checks (`config.check`,
  run by `run.build`) refuse `config` on the target's devices; a target without them is not
  checked (its row is skipped, nothing compiled)."""
  import jax

  from jaxrl_llm import plan
  from jaxrl_llm.config import check

  try:
    devices = plan.tpu_slice_devices(name) if kind == "tpu" else jax.devices(kind)
  except RuntimeError:  # no libtpu, or no GPU: `row` reports the row skipped
    return
  check(config, num_devices=len(devices) if kind == "tpu" else int(name), device=devices[0])


def check_configs(args, parsed: list[tuple[str, str, dict[str, int]]]) -> None:
  """Before anything is compiled: ArgError names the first target whose mesh does not fit its
  devices, the first row config that `--set` makes unknown or invalid, or the first the
  compile's cross checks refuse on its target's devices (e.g. a mesh axis that does not
  divide the model)."""
  from absl import flags

  from jaxrl_llm import sharding
  from jaxrl_llm.config import parse

  shapes, targets = args.shapes.split(","), args.targets.split(",")
  for target, (kind, name, mesh) in zip(targets, parsed):
    try:  # a TPU slice's size is known once its devices are
      if kind != "tpu":
        sharding.mesh_shape(int(name), **mesh)
      if mesh.get("runs", 1) > 1 and not args.runs:
        raise ValueError("the runs axis splits a pack's runs: give --runs=N too")
    except ValueError as err:
      raise ArgError(f"target {target!r}: {err}") from None
  for shape in shapes:  # every row's config, so a bad --set stops the table before it starts
    for target, (kind, name, _) in zip(targets, parsed):
      # ConfigError (a ValueError): an unknown field or a value out of range; flags.Error: a
      # value of the wrong type or an override without one.
      try:
        config = parse(row_config(shape, target, args.set, args.new_tokens))
      except (ValueError, flags.Error) as err:
        raise ArgError(" ".join(str(err).split())) from None
      try:
        check_on_target(config, kind, name)
      except ValueError as err:
        raise ArgError(f"{shape} on target {target!r}: {' '.join(str(err).split())}") from None


def main(argv: list[str]) -> int:
  """Command line: one JSON line per (shape, target); a bad argument is one `error:` line on
  stderr and exit code 2, before anything is compiled."""
  parser = ArgParser(
    raise_as=ArgError, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument(
    "--shapes", default=",".join(SHAPES), help=f"comma-separated, of: {', '.join(SHAPES)}"
  )
  parser.add_argument(
    "--targets",
    default="cpu:1",
    help="comma-separated: cpu:N[:AXIS=K...] (N CPU devices as a proxy for N GPUs) or "
    "tpu:SLICE[:AXIS=K...] (e.g. tpu:v5p-8), AXIS one of data, fsdp, model, expert, runs",
  )
  parser.add_argument("--prompt_len", type=int, default=0, help="prompt tokens (0: 13)")
  parser.add_argument("--new_tokens", type=int, default=0, help="0: the shape's own")
  parser.add_argument(
    "--capacity_gib", type=float, default=80e9 / 2**30, help="per device for cpu targets (80 GB)"
  )
  parser.add_argument("--markdown", action="store_true", help="print the table at the end")
  parser.add_argument(
    "--runs",
    type=int,
    default=0,
    help="plan a pack of this many runs (0: one run); with a "
    "target axis runs=K the pack's runs are split over K device groups",
  )
  parser.add_argument(
    "--guard",
    default="auto",
    help="comma-separated forms of the non-finite guard's update to plan each row with: auto "
    "(the platform's own), held (kept for its check), twice (computed again where applied)",
  )
  parser.add_argument("--set", action="append", default=[], help="FIELD=VALUE (repeatable)")
  try:
    args = parser.parse_args(argv)
    parsed = check_args(args)
    most = max([int(n) for k, n, _ in parsed if k == "cpu"] or [1])
    # CPU targets compile on the CPU backend alone; a gpu target needs JAX's GPU platform too.
    # Both set before JAX is imported (`check_configs`) and starts.
    kinds = {k for k, _, _ in parsed}
    os.environ.setdefault("JAX_PLATFORMS", "cuda,cpu" if "gpu" in kinds else "cpu")
    if most > 1:  # fake CPU devices
      os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={most}"
      )
    check_configs(args, parsed)
  except ArgError as err:
    print(f"error: {err}", file=sys.stderr)
    return 2
  shapes, targets, guards = args.shapes.split(","), args.targets.split(","), args.guard.split(",")
  todo = [(s, t, g) for s in shapes for t in targets for g in guards]
  rows = []
  for i, (shape, target, guard) in enumerate(todo):
    # Progress on stderr: a large shape's compile can take many minutes on a small machine.
    form = "" if guard == "auto" else f" (update {guard})"
    print(f"[{i + 1}/{len(todo)}] compiling {shape} for {target}{form} ...",
          file=sys.stderr, flush=True)  # fmt: skip
    start = time.monotonic()
    r = row(
      shape,
      target,
      args.set,
      args.prompt_len,
      args.new_tokens,
      args.capacity_gib,
      args.runs,
      guard,
    )
    print(f"  done in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    rows.append(r)
    print(json.dumps(r), flush=True)
  if args.markdown:
    print(markdown(rows))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
