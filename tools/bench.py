"""Benchmark the fused RL step, optionally against TRL's GRPOTrainer at the same shape.

  python tools/bench.py --config=configs/default.py [--config.rl.num_prompts=64] [--steps=5]
  python tools/bench.py --shape=medium [--peer=trl [--peer_cache=static]] [--set=sampling.param_dtype=bfloat16]
  python tools/bench.py --shape=qwen2.5-0.5b --profile_dir=DIR   # + a traced warm step

Prints one JSON object. Timings are medians over `--steps` warm steps (after compilation and one
warm-up step). The sampler is timed alone with the fused step's own sample phase (the sampler's
copy of the weights, `sampling.param_dtype`); the learner's time is the rest of the fused step
(reward, advantages, forward/backward, optimiser). Per phase:

  sampler   decode_ms_per_step = sampler time / decode steps taken (the prefill is included),
            decode_hbm_roofline_pct = (sampler weight bytes + the whole static KV cache's
            bytes, S+T slots) / decode step time / the device's HBM bandwidth;
            decode_filled_floor_pct, the honest floor: the same with only the KV slots filled
            (S + i + 1 at step i, averaged over the steps taken: kv_filled_bytes_per_decode_step);
            kv_read_bytes_per_decode_step is what the staged attention reads (`sampling.kv_block`)
  learner   learner_tflops_per_s and learner_mfu_pct from learner_flops_per_step =
            6·N_body·B·(S+T) + 6·V·D·B·T + 12·L·H·Dh·(S+T)·B·(S+T) (see `learner_flops`)
  step      rl_step_s, peak device memory, and the compiled step's argument / output / temp bytes

`--shape` (tiny, medium, qwen2.5-0.5b, qwen2.5-1.5b, smollm2-135m) benchmarks on 13-token
prompts with every completion at full length (the end-of-sequence id is made unreachable) and
one optimiser update per rollout: random-init weights, except smollm2-135m, whose architecture
and weights are SmolLM2-135M-Instruct's (`model.checkpoint`, models/pretrained.py's directory;
`--set=model.checkpoint=DIR` does the same for any Hugging Face directory on any shape).
`--peer=trl` first runs tools/peer_trl.py in a subprocess at the identical shape (its memory is
its own; the same checkpoint's weights when one is set) and adds TRL's numbers, how it ran
(`peer.peer_setup`) and the ratios TRL / ours; with `model.lora_rank` > 0 the peer trains PEFT
LoRA adapters of the same rank, alpha, dropout and targets (and reports trainable_params);
`model.lora_base_dtype=int8` has no peer. `--peer_cache=static` gives the peer transformers'
static KV cache, whose decode transformers compiles with torch.compile on a GPU (TRL's
strongest generation without vLLM; `peer_setup` says whether it compiled). `model_source` is
the checkpoint or "random-init". Device limits come from a table of public spec sheets by `device_kind`, or from
`--hbm_bytes_per_s` / `--peak_flops` (e.g. measured values); on a CPU the percentages are null
unless both are given.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

_TOOLS = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_TOOLS)
for _path in (_REPO, _TOOLS):  # run from a checkout without installing it
  if _path not in sys.path:
    sys.path.insert(0, _path)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl_llm import quant, sampling, terminal  # noqa: E402
from jaxrl_llm.config import ConfigError, parse  # noqa: E402
from jaxrl_llm.data import pipeline  # noqa: E402
from jaxrl_llm.paths import dir_problem  # noqa: E402
from jaxrl_llm.rl import make_rl_step  # noqa: E402
from jaxrl_llm.run import Experiment, build, build_task, to_global_batch  # noqa: E402

# Per-device limits from public spec sheets: (device_kind substring, HBM bytes/s, dense bf16
# FLOP/s). Matched in order against the lower-cased `device_kind`, so specific names come first.
DEVICE_LIMITS: tuple[tuple[str, float, float], ...] = (
  ("h100 pcie", 2.0e12, 756e12),
  ("h100 nvl", 3.9e12, 835e12),
  ("h100", 3.35e12, 989e12),  # SXM, "NVIDIA H100 80GB HBM3"
  ("h200", 4.8e12, 989e12),
  ("a100", 2.039e12, 312e12),  # 80GB SXM
  ("tpu v5 lite", 819e9, 197e12),  # v5e
  ("tpu v5e", 819e9, 197e12),
  ("tpu v5p", 2.765e12, 459e12),
  ("tpu v5", 2.765e12, 459e12),  # v5p reports "TPU v5"
  ("tpu v6 lite", 1.64e12, 918e12),  # v6e (Trillium)
  ("tpu v6e", 1.64e12, 918e12),
  ("tpu v4", 1.2e12, 275e12),
)

# What every --shape runs: random init, 13-token prompts (reverse task, 11 letters), no warm
# start, no reference model, one device, one optimiser update per rollout.
RUN: dict[str, object] = {
  "task.name": "reverse",
  "task.min_len": 11,
  "task.max_len": 11,
  "task.eval_size": 16,
  "sft.steps": 0,
  "mesh.data": 1,
  "rl.num_epochs": 1,
  "rl.num_minibatches": 1,
  "kl.beta": 0.0,
}


def _shapes() -> dict[str, dict[str, object]]:
  import memory_table

  from jaxrl_llm.models import pretrained

  fp32 = {"model.dtype": "float32", "model.param_dtype": "float32"}
  small = {"rl.num_prompts": 16, "sampling.group_size": 8, **fp32}
  shapes = {
    "tiny": {
      "model.vocab_size": 64,
      "model.d_model": 128,
      "model.num_layers": 4,
      "model.num_heads": 4,
      "model.num_kv_heads": 2,
      "model.head_dim": 32,
      "model.mlp_dim": 512,
      "sampling.max_new_tokens": 16,
      **small,
    },
    "medium": {
      "model.vocab_size": 4096,
      "model.d_model": 256,
      "model.num_layers": 6,
      "model.num_heads": 8,
      "model.num_kv_heads": 4,
      "model.head_dim": 32,
      "model.mlp_dim": 1024,
      "sampling.max_new_tokens": 64,
      **small,
    },
  }
  for name, fields in memory_table.SHAPES.items():  # 8 x 8, bf16 compute, fp32 params
    shapes[name] = {**memory_table.COMMON, **fields}
  # A real model (its architecture and weights from the checkpoint), small enough for a CPU.
  shapes["smollm2-135m"] = {
    "model.checkpoint": pretrained.model_dir("smollm2-135m-instruct"),
    "rl.num_prompts": 2,
    "sampling.group_size": 8,
    "sampling.max_new_tokens": 64,
    **fp32,
  }
  return shapes


SHAPE_NAMES = (
  "tiny",
  "medium",
  "qwen2.5-0.5b",
  "qwen2.5-1.5b",
  "moe-e64",
  "dense-e64-twin",
  "smollm2-135m",
)


def shape_config(name: str, overrides: list[str] = ()):
  """The default config at benchmark shape `name`, then the user's `FIELD=VALUE` overrides
  (parsed by the trainer's own command-line parser: typed, unknown fields named)."""
  from jaxrl_llm import launch as trainer_main

  shapes = _shapes()
  if name not in shapes:
    raise ConfigError(f"unknown shape {name!r}; known: {', '.join(shapes)}")
  config_file = os.path.join(_REPO, "configs", "default.py")
  fixed = [f"--config.{k}={v}" for k, v in {**RUN, **shapes[name]}.items()]
  return trainer_main.parse_config(
    ["bench", f"--config={config_file}", *fixed, *(f"--config.{o}" for o in overrides)]
  )


# ---- measurements -------------------------------------------------------------------------


def _peak_memory_bytes() -> dict[str, int | None]:
  """Peak device memory (accelerators) and peak host RSS of this process."""
  dev = jax.devices()[0]
  stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
  device_peak = stats.get("peak_bytes_in_use") if stats else None
  return {"device_peak_bytes": device_peak, "host_peak_rss_bytes": _rss_bytes()}


def _rss_bytes() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _machine() -> dict[str, object]:
  dev = jax.devices()[0]
  return {
    "platform": dev.platform,
    "device_kind": dev.device_kind,
    "device_count": jax.device_count(),
    "host": platform.node(),
    "cpu_count": os.cpu_count(),
    "load_avg_1m": os.getloadavg()[0],  # other work on the machine skews CPU timings
    "processor": platform.processor() or platform.machine(),
    "jax": jax.__version__,
  }


def device_limits(
  platform_name: str,
  device_kind: str,
  hbm_bytes_per_s: float | None = None,
  peak_flops: float | None = None,
) -> dict[str, object]:
  """HBM bandwidth and dense bf16 peak of one device: flags first, else the spec table
  (accelerators only: a CPU gets None unless both are given)."""
  kind = device_kind.lower()
  row = next((r for r in DEVICE_LIMITS if r[0] in kind), None)
  if platform_name == "cpu":
    row = None
  hbm = hbm_bytes_per_s if hbm_bytes_per_s else (row[1] if row else None)
  flops = peak_flops if peak_flops else (row[2] if row else None)
  source = {
    "hbm_bytes_per_s": "flag" if hbm_bytes_per_s else ("spec sheet" if row else None),
    "peak_flops": "flag" if peak_flops else ("spec sheet (dense bf16)" if row else None),
  }
  return {"hbm_bytes_per_s": hbm, "peak_flops": flops, "source": source}


def param_counts(params, mc) -> dict[str, int]:
  """Parameters in all, in the token embedding, in an untied output layer, and the rest (the
  body: attention, MLP, norms), from the real parameter tree."""
  total = int(sum(x.size for x in jax.tree.leaves(params)))
  embedding = int(params["embed"]["embedding"].size)
  output = 0 if mc.tie_embeddings else int(params["lm_head"]["kernel"].size)
  return {
    "total": total,
    "embedding": embedding,
    "untied_output_layer": output,
    "body": total - embedding - output,
  }


FLOPS_FORMULA = (
  "6*N_body*B*(S+T) + 6*V*D*B*T + 12*L*H*Dh*(S+T)*B*(S+T): forward+backward of the body (N "
  "without the embedding and output layer) over prompt+completion tokens, the output layer at "
  "the completion positions only (where the learner computes it), and attention scores over "
  "the full S+T window (PaLM convention, causal masking not subtracted); model FLOPs, block "
  "rematerialisation not counted"
)


def learner_flops(mc, body_params: int, b: int, s: int, t: int) -> float:
  """Model FLOPs of one learner pass over B sequences of S prompt + T completion tokens (see
  FLOPS_FORMULA): the one forward/backward of a single-update step."""
  tokens = b * (s + t)
  body = 6.0 * body_params * tokens
  head = 6.0 * mc.vocab_size * mc.d_model * b * t
  attention = 12.0 * mc.num_layers * mc.num_heads * mc.head_dim * (s + t) * tokens
  return body + head + attention


def decode_bytes(
  sampler_params, sampler_mc, b: int, s: int, t: int, steps: int = 0, kv_block: int = 0
) -> dict[str, int]:
  """Bytes a decode step reads: the sampler's weights (as `quant.sampler_params` makes them;
  int8 is fake-quantised, so its copy keeps the parameter dtype) and K and V of B rows, every
  layer, over: the whole static cache (S+T slots, `kv_cache_bytes_per_decode_step`); the slots
  filled (S + i + 1 at step i, `kv_filled_bytes_per_decode_step`) and the slots the staged
  attention reads (S + the end of step i's stage of `kv_block` steps,
  `kv_read_bytes_per_decode_step`), both averaged over the `steps` decode steps taken (0: T)."""
  weights = int(sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(sampler_params)))
  itemsize = np.dtype(sampler_mc.compute_dtype).itemsize
  slot = b * sampler_mc.num_layers * 2 * sampler_mc.num_kv_heads * sampler_mc.head_dim * itemsize
  n = steps or t
  ends = sampling.decode_stages(t, kv_block)
  read = [s + next(e for e in ends if i < e) for i in range(n)]  # slots step i attends
  return {
    "sampler_weight_bytes": weights,
    "kv_cache_bytes_per_decode_step": int(slot * (s + t)),
    "kv_filled_bytes_per_decode_step": round(slot * (s + (n + 1) / 2)),
    "kv_read_bytes_per_decode_step": round(slot * sum(read) / n),
  }


def _memory_analysis(compiled) -> dict[str, int] | None:
  try:
    mem = compiled.memory_analysis()
  except Exception:  # not every backend reports one
    return None
  if mem is None:
    return None
  return {
    "argument_bytes": int(mem.argument_size_in_bytes),
    "output_bytes": int(mem.output_size_in_bytes),
    "temp_bytes": int(mem.temp_size_in_bytes),
    "alias_bytes": int(mem.alias_size_in_bytes),
    "generated_code_bytes": int(mem.generated_code_size_in_bytes),
  }


def _pct(num: float | None, den: float | None) -> float | None:
  return None if not num or not den else 100.0 * num / den


def program_for(exp: Experiment, full_length: bool):
  """The experiment's RL programs; with `full_length`, rebuilt with an end-of-sequence id no
  token can take, so every completion runs to max_new_tokens (fixed work per step)."""
  if not full_length:
    return exp.program
  ctx = exp.program.learner
  return make_rl_step(
    exp.model,
    ctx.optimizer,
    ctx.schedule,
    getattr(exp.task, "reward_terms", None),
    dataclasses.replace(ctx.sampling, eos_id=-1),
    ctx.settings,
    exp.mesh,
    exp.state_shardings,
    sampler_dtype=ctx.sampler_dtype,
    rules=exp.rules,
    rebuild_optimizer=ctx.rebuild_optimizer,
    values=exp.program.values,  # the trainer's own traced values, as its step takes them
  )


_T0 = time.perf_counter()


def progress(what: str) -> None:
  """One line on stderr with the seconds since start: a run cut off by a time limit still says
  where its time went (compile, warm-up, steps, the peer)."""
  print(f"[{time.perf_counter() - _T0:7.1f} s] {what}", file=sys.stderr, flush=True)


def bench(
  config,
  steps: int,
  *,
  full_length: bool = True,
  hbm_bytes_per_s: float | None = None,
  peak_flops: float | None = None,
  profile_dir: str | None = None,
  sample_only: bool = False,
) -> dict[str, object]:
  """Runs `steps` warm fused RL steps and a sampler-only pass (with `sample_only`, the sampler
  alone: no fused step is compiled, its fields are null); returns the measurements."""
  config = parse(config)
  progress("building the run")
  start = time.perf_counter()
  exp = build(config)  # rl.microbatch_tokens=auto: its plans too (their count in the info log)
  build_s = time.perf_counter() - start
  program = program_for(exp, full_length)
  ctx = program.learner
  samp = ctx.sampling
  it = pipeline.make_prompt_iterator(
    exp.task.train_examples(config.seed), parse(config).sampled_prompts, seed=config.seed
  )
  batches = [to_global_batch(next(it), exp.batch_sharding) for _ in range(steps + 1)]
  state = exp.state
  if config.kl.beta > 0:
    state = state.replace(ref_params=jax.tree.map(lambda x: x.copy(), state.params))
  mc = exp.model.cfg
  counts = param_counts(state.params, mc)
  sampler_params = jax.eval_shape(
    functools.partial(quant.sampler_params, dtype=ctx.sampler_dtype), state.params
  )

  step_times, gen_tokens, compile_s, compiled_memory = [], [], None, None
  learner_tokens = None
  if not sample_only:
    progress("compiling the fused step")
    t0 = time.perf_counter()
    compiled = program.step.lower(state, batches[0], state.rng).compile()
    compile_s = time.perf_counter() - t0
    compiled_memory = _memory_analysis(compiled)
    progress(f"compiled in {compile_s:.1f} s; warm-up step")
    state, m = compiled(state, batches[0], jax.random.fold_in(state.rng, 0))  # warm-up
    jax.block_until_ready(m)
    for i in range(1, steps + 1):
      t0 = time.perf_counter()
      state, m = compiled(state, batches[i], jax.random.fold_in(state.rng, i))
      m = jax.device_get(m)
      step_times.append(time.perf_counter() - t0)
      gen_tokens.append(float(m["perf/generated_tokens"]))
      progress(f"step {i}/{steps}: {step_times[-1]:.3f} s")
    learner_tokens = float(m["perf/learner_tokens"])
    if profile_dir:  # one more warm step under the profiler (tools/trace_summary.py reads it)
      with jax.profiler.trace(profile_dir, create_perfetto_trace=True):
        state, m = compiled(state, batches[1], jax.random.fold_in(state.rng, 10_000))
        jax.block_until_ready(m)

  # The fused step's own sample phase: the sampler's weight copy (sampling.param_dtype).
  sample_fn = program.sample
  progress("the sampler alone: compile and warm-up")
  jax.block_until_ready(sample_fn(state, batches[0], state.rng))
  sample_times, sample_tokens, decode_steps = [], [], []
  for i in range(1, steps + 1):
    key = jax.random.fold_in(state.rng, 1000 + i)
    t0 = time.perf_counter()
    r = jax.block_until_ready(sample_fn(state, batches[i], key))
    sample_times.append(time.perf_counter() - t0)
    sample_tokens.append(float(np.sum(r.lengths)))
    decode_steps.append(int(r.decode_steps))

  sample_s = statistics.median(sample_times)
  step_s = statistics.median(step_times) if step_times else None
  learn_s = max(step_s - sample_s, 1e-9) if step_times else None
  b = config.sampled_prompts * samp.group_size
  s, t = exp.task.prompt_len, samp.max_new_tokens
  steps_taken = int(statistics.median(decode_steps))
  decode_ms = 1e3 * sample_s / max(steps_taken, 1)
  read = decode_bytes(sampler_params, ctx.sampler_model.cfg, b, s, t, steps_taken, samp.kv_block)
  weights = read["sampler_weight_bytes"]
  read["decode_bytes_per_step"] = weights + read["kv_cache_bytes_per_decode_step"]
  read["decode_filled_bytes_per_step"] = weights + read["kv_filled_bytes_per_decode_step"]
  flops = learner_flops(mc, counts["body"], b, s, t) * config.rl.num_epochs
  machine = _machine()
  limits = device_limits(machine["platform"], machine["device_kind"], hbm_bytes_per_s, peak_flops)
  hbm, peak = limits["hbm_bytes_per_s"], limits["peak_flops"]
  per_s = lambda n: n / (decode_ms / 1e3) if steps_taken else None  # noqa: E731
  achieved_bw = per_s(read["decode_bytes_per_step"])
  return {
    "model_source": model_source(config),
    "config": {
      "task": config.task.name,
      "model": mc.to_dict(),
      "prompts": config.rl.num_prompts,
      "group_size": samp.group_size,
      "prompt_len": s,
      "max_new_tokens": t,
      "epochs": config.rl.num_epochs,
      "minibatches": config.rl.num_minibatches,
      "microbatch_tokens": config.rl.microbatch_tokens,
      "microbatches": ctx.settings.rl.num_microbatches,
      "remat": ctx.settings.rl.remat,
      "sampler_param_dtype": ctx.sampler_dtype,
      "sampler_compute_dtype": ctx.sampler_model.cfg.dtype,
      "full_length": full_length,
      "kv_block": samp.kv_block,
      "attention": config.model.attention,  # pallas: decode reads about the filled slots
    },
    "build_s": build_s,
    "rl_step_s": step_s,
    "step_times_s": step_times,
    "compile_s": compile_s,
    "sampler_tokens_per_s": statistics.median(sample_tokens) / sample_s,
    "learner_tokens_per_s": learner_tokens / learn_s if learn_s else None,
    "sampling_share_of_step": min(sample_s / step_s, 1.0) if step_s else None,
    "generated_tokens_per_step": statistics.median(gen_tokens or sample_tokens),
    "sample_s": sample_s,
    "learner_s": learn_s,
    "decode_steps": steps_taken,
    "decode_ms_per_step": decode_ms,
    **read,
    "decode_bytes_per_s": achieved_bw,
    "decode_hbm_roofline_pct": _pct(achieved_bw, hbm),
    "decode_filled_floor_pct": _pct(per_s(read["decode_filled_bytes_per_step"]), hbm),
    "params": counts,
    "learner_tokens_per_step": learner_tokens,
    "learner_flops_per_step": flops,
    "learner_flops_formula": FLOPS_FORMULA,
    "learner_tflops_per_s": flops / learn_s / 1e12 if learn_s else None,
    "learner_mfu_pct": _pct(flops / learn_s, peak) if learn_s else None,
    "device_limits": limits,
    "compiled_step_memory": compiled_memory,
    **_peak_memory_bytes(),
    "machine": machine,
  }


# ---- the peer ------------------------------------------------------------------------------


def _count_params(mc) -> int:
  """Parameters of a dense `ModelConfig` (the same as the built tree; for `rl.remat=auto`)."""
  d, h, j, dh, f = mc.d_model, mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.mlp_dim
  attn = d * h * dh + 2 * d * j * dh + h * dh * d
  if mc.attention_bias:
    attn += h * dh + 2 * j * dh
  layer = attn + 3 * d * f + 2 * d + (2 * dh if mc.qk_norm else 0)
  head = 0 if mc.tie_embeddings else d * mc.vocab_size
  return mc.vocab_size * d + mc.num_layers * layer + d + head + (d + 1 if mc.value_head else 0)


def model_source(config) -> str:
  """Where the run's weights come from: the absolute `model.checkpoint` or "random-init"."""
  path = parse(config).model.checkpoint
  return os.path.abspath(path) if path else "random-init"


def model_arch(config):
  """The run's architecture without loading any weights: with `model.checkpoint`, its
  config.json's (as `build` reads it, with the config's dtypes, layout and adapters:
  `ModelConfig.onto`), else the config's own `model.*` fields."""
  from jaxrl_llm.models import hf_config
  from jaxrl_llm.run.from_checkpoint import check_dir

  config = parse(config)
  path = config.model.checkpoint
  if not path:
    return config.model.arch
  check_dir(path)  # the trainer's one line for a missing folder, a GGUF file, adapters, ...
  config_file = os.path.join(path, "config.json")
  try:
    with open(config_file) as f:
      mc = hf_config.config_from_hf(json.load(f), source=config_file)
  except (ValueError, OSError) as e:  # CheckpointFormatError, unreadable JSON
    raise ConfigError(" ".join(str(e).split())) from None
  return config.model.arch.onto(mc)


def peer_spec(config, steps: int, cache: str = "dynamic") -> dict[str, object]:
  """The peer's shape and run, from `config` without touching a device (so that the peer's
  process can have the accelerator to itself first). With `model.checkpoint` the dimensions
  are the checkpoint's (`model_arch`) and the peer loads its weights (`checkpoint`); `cache`
  is its generation's KV cache (dynamic | static, see tools/peer_trl.py)."""
  config = parse(config)
  mc = model_arch(config)
  problems = []
  if mc.moe_num_experts:
    problems.append("a dense model (model.moe_num_experts=0)")
  if config.rl.num_epochs != 1 or config.rl.num_minibatches != 1:
    problems.append("one optimiser update per rollout (rl.num_epochs=1, rl.num_minibatches=1)")
  if config.kl.beta:
    problems.append("no reference model (kl.beta=0)")
  if config.mesh.data not in (1, -1) or config.mesh.model != 1:
    problems.append("one device (mesh.data=1)")
  if mc.lora_base_dtype == "int8":
    int8 = "TRL's 8-bit base is bitsandbytes, a different quantiser that needs a GPU"
    problems.append(f"a float LoRA base (model.lora_base_dtype=auto, not int8: {int8})")
  if problems:
    raise ConfigError("--peer needs " + "; ".join(problems))
  task = build_task(config)
  samp = config.sampling.sampler(task)
  p, g = config.rl.num_prompts, samp.group_size
  rl = config.rl.resolved(
    rows_per_device=p * g,
    seq_len=task.prompt_len + samp.max_new_tokens,
    num_params=_count_params(mc),
  )
  spec = {
    "vocab_size": mc.vocab_size,
    "d_model": mc.d_model,
    "num_layers": mc.num_layers,
    "num_heads": mc.num_heads,
    "num_kv_heads": mc.num_kv_heads,
    "head_dim": mc.head_dim,
    "mlp_dim": mc.mlp_dim,
    "attention_bias": mc.attention_bias,
    "tie_embeddings": mc.tie_embeddings,
    "rope_theta": mc.rope_theta,
    "norm_eps": mc.norm_eps,
    "prompts": p,
    "group_size": g,
    "max_new_tokens": samp.max_new_tokens,
    "prompt_len": task.prompt_len,
    "param_dtype": mc.param_dtype,
    "compute_dtype": mc.dtype,
    "microbatches": rl.num_microbatches,
    "gradient_checkpointing": rl.remat != "none",
    "steps": steps,
    "warmup": 1,
    "learning_rate": float(config.optim.learning_rate),
    "temperature": float(config.sampling.temperature),
    "seed": int(config.seed),
    "lora_rank": mc.lora_rank,
    "checkpoint": os.path.abspath(config.model.checkpoint) if config.model.checkpoint else "",
    "cache": cache,
  }
  if mc.lora_rank:  # PEFT LoRA at the same rank, alpha, dropout, on the same projections
    from jaxrl_llm.models.config import target_names

    spec |= {"lora_alpha": float(mc.lora_alpha), "lora_dropout": float(mc.lora_dropout)}
    spec["lora_targets"] = [f"{n}_proj" for n in target_names(mc.lora_targets)]  # HF_NAMES
  return spec


def run_peer(
  name: str, spec: dict, python: str | None = None, timeout_s: float | None = None
) -> dict[str, object]:
  """Runs tools/peer_<name>.py in its own process; its result, or {"error": ...}."""
  import peer_trl

  cmd = [
    python or sys.executable,
    os.path.join(_TOOLS, f"peer_{name}.py"),
    "--spec",
    json.dumps(spec),
  ]
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  t0 = time.perf_counter()
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
  except subprocess.TimeoutExpired:
    return {"name": name, "error": f"timed out after {timeout_s} s"}
  lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(peer_trl.MARKER)]
  if proc.returncode != 0 or not lines:
    tail = (proc.stdout + proc.stderr)[-3000:]
    last = (proc.stderr.strip().splitlines() or [""])[-1]
    said = f": {last[len('error: ') :]}" if last.startswith("error: ") else ""  # its one line
    return {"name": name, "error": f"exit status {proc.returncode}{said}", "output_tail": tail}
  result = json.loads(lines[-1][len(peer_trl.MARKER) :])
  result["wall_s"] = time.perf_counter() - t0
  return result


def compare(ours: dict, peer: dict) -> dict[str, object]:
  """Ratios peer / ours (above 1: ours is faster or smaller) and what memory was compared."""
  if "error" in peer:
    return {}
  on_device = ours["machine"]["platform"] != "cpu" and ours["device_peak_bytes"] is not None
  our_peak = ours["device_peak_bytes"] if on_device else ours["host_peak_rss_bytes"]
  ratios = {
    "step_time": peer["step_s"] / ours["rl_step_s"],
    "sample_time": peer["sample_s"] / ours["sample_s"],
    "learner_time": peer["learner_s"] / ours["learner_s"],
    "peak_memory": peer["peak_memory_bytes"] / our_peak,
    "memory_compared": (
      "device: JAX peak_bytes_in_use vs torch.cuda.max_memory_allocated"
      if on_device
      else "host: peak RSS of each process"
    ),
  }
  if not on_device:
    base = peer.get("host_baseline_rss_bytes")
    ours_base = ours.get("host_baseline_rss_bytes")
    if base and ours_base:
      ratios["peak_memory_above_baseline"] = (peer["peak_memory_bytes"] - base) / max(
        our_peak - ours_base, 1
      )
  return ratios


def run(
  config,
  steps: int,
  *,
  shape: str | None = None,
  peer: str | None = None,
  peer_python: str | None = None,
  peer_timeout_s: float | None = None,
  peer_cache: str = "dynamic",
  **bench_kwargs,
) -> dict[str, object]:
  """The peer (if any) first, in its own process, then ours; one JSON-ready result."""
  baseline = _rss_bytes()
  peer_result = None
  if peer and bench_kwargs.get("sample_only"):
    raise ConfigError("--sample_only times our sampler alone; it has no --peer")
  if peer:
    spec = peer_spec(config, steps, peer_cache)
    progress(f"the peer ({peer}) first, in its own process")
    peer_result = run_peer(peer, spec, peer_python, peer_timeout_s)
    progress(f"the peer ended: {peer_result.get('error') or 'ok'}")
    print(f"peer result: {json.dumps(peer_result)}", file=sys.stderr, flush=True)  # kept if cut
  result = {"shape": shape, **bench(config, steps, **bench_kwargs)}
  result["host_baseline_rss_bytes"] = baseline
  if peer_result is not None:
    used = (spec["microbatches"], spec["gradient_checkpointing"])
    ours = (result["config"]["microbatches"], result["config"]["remat"] != "none")
    warnings = []
    if used != ours:
      warnings.append(f"peer ran (microbatches, remat) {used}, ours {ours}")
    lengths = (peer_result.get("prompt_length_min"), peer_result.get("prompt_length_max"))
    if "error" not in peer_result and lengths != (spec["prompt_len"],) * 2:
      warnings.append(f"peer's prompts were {lengths} tokens (min, max), ours {spec['prompt_len']}")
    if warnings:
      peer_result["warning"] = "; ".join(warnings)
    peer_result["ratios"] = compare(result, peer_result)
    if peer_result["ratios"] and "sample_s" in peer_result:
      flops = result["learner_flops_per_step"]
      peer_result["learner_tflops_per_s"] = flops / peer_result["learner_s"] / 1e12
    result["peer"] = peer_result
  return result


def flag_overrides(flags: list[str]) -> list[str]:
  """The trainer's config flags as overrides: `--config.a.b=v` -> `a.b=v`, `--noconfig.a.b`
  -> `a.b=False`."""
  out = []
  for a in flags:
    if a.startswith("--config."):
      out.append(a[len("--config.") :])
    else:
      out.append(a[len("--noconfig.") :] + "=False")
  return out


def main(argv: list[str]) -> int:
  """Command line: prints the benchmark result as JSON."""
  from absl import logging as absl_logging

  absl_logging.set_verbosity(absl_logging.INFO)  # the build's own lines (auto's plans) on stderr
  parser = terminal.ArgParser(
    description=__doc__.splitlines()[0],
    epilog="Other arguments --config.FIELD=VALUE override config fields (as for the trainer).",
  )
  parser.add_argument("--config", help="experiment config file (or give --shape)")
  parser.add_argument("--shape", choices=SHAPE_NAMES, help="benchmark shape (or give --config)")
  parser.add_argument("--set", action="append", default=[], help="FIELD=VALUE (repeatable)")
  parser.add_argument("--steps", type=terminal.count, default=5, help="warm RL steps to time")
  parser.add_argument(
    "--full_length",
    action="store_true",
    default=True,
    help="every completion runs to max_new_tokens, no end-of-sequence (the default)",
  )
  parser.add_argument("--nofull_length", dest="full_length", action="store_false")
  parser.add_argument("--peer", choices=["trl"], help="also run this trainer at the same shape")
  parser.add_argument("--peer_python", help="Python of the peer (default: this one)")
  parser.add_argument(
    "--peer_timeout_s", type=terminal.positive, help="give up on the peer after this long"
  )
  parser.add_argument(
    "--peer_cache",
    choices=["dynamic", "static"],
    help="the peer's generation cache (default dynamic): static is transformers' compiled "
    "static-cache decode",
  )
  parser.add_argument(
    "--hbm_bytes_per_s", type=terminal.positive, help="device HBM bandwidth (default: table)"
  )
  parser.add_argument(
    "--peak_flops", type=terminal.positive, help="device peak FLOP/s (default: table)"
  )
  parser.add_argument("--profile_dir", help="trace one more warm fused step into this directory")
  parser.add_argument(
    "--sample_only",
    action="store_true",
    help="time the sampler alone (decode figures; no fused step is compiled or run)",
  )
  args, rest = parser.parse_known_args(argv)
  unknown = [a for a in rest if not a.startswith(("--config.", "--noconfig."))]
  if unknown:
    parser.error(f"unrecognised arguments: {' '.join(unknown)}")
  if bool(args.shape) == bool(args.config):
    parser.error("give exactly one of --shape and --config")
  for_peer = [f"--{f}" for f in ("peer_python", "peer_timeout_s", "peer_cache") if getattr(args, f)]
  if for_peer and not args.peer:
    parser.error(f"{', '.join(for_peer)}: for the peer's run only; add --peer=trl or drop it")
  if args.peer_python and not (
    os.path.isfile(args.peer_python) and os.access(args.peer_python, os.X_OK)
  ):
    parser.error(f"--peer_python={args.peer_python}: no executable file there; give a Python")
  if args.profile_dir and args.sample_only:
    parser.error("--profile_dir traces a fused step, which --sample_only does not run: drop one")
  if args.profile_dir:  # found now, not after the benchmark's minutes
    if problem := dir_problem(args.profile_dir):
      parser.error(f"--profile_dir={args.profile_dir} {problem}")
  args.peer_cache = args.peer_cache or "dynamic"

  overrides = [*args.set, *flag_overrides(rest)]
  passed = ("shape", "peer", "peer_python", "peer_timeout_s", "full_length", "hbm_bytes_per_s")
  passed += ("peak_flops", "profile_dir", "peer_cache", "sample_only")
  from jaxrl_llm import launch

  launch.choose_backend()  # as the trainer's command line: a failing plugin's chatter kept off
  try:  # a bad field or value (or a peer that cannot run this config): one line
    config = _config(args, overrides)
    result = run(config, args.steps, **{name: getattr(args, name) for name in passed})
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(json.dumps(result, indent=2), flush=True)
  return 0


def _config(args, overrides: list[str]):
  """The benchmark's config: the `--shape`'s or the `--config` file's, with `overrides`."""
  if args.shape:
    config = shape_config(args.shape, overrides)
    path = config.model.checkpoint
    if path and path == _shapes()[args.shape].get("model.checkpoint"):
      if not os.path.isfile(os.path.join(path, "config.json")):  # the shape's model, not fetched
        raise ConfigError(
          f"--shape={args.shape} needs {path}: fetch it first with python tools/get_smollm2.py"
        )
    return config
  from jaxrl_llm import launch as trainer_main

  return trainer_main.parse_config(
    ["bench", f"--config={args.config}", *(f"--config.{o}" for o in overrides)]
  )


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
