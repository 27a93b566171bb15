"""The checks that span sections, or need what only the run knows (its devices, its task, the
model a checkpoint holds). Each section checks its own ranges; these run once more, before
anything compiles, and name every field involved."""

from __future__ import annotations

import math

import jax
from flax import linen as nn

from jaxrl_llm import sharding
from jaxrl_llm.config.acting import trace_tools
from jaxrl_llm.config.fields import invalid, need
from jaxrl_llm.config.sections import MAX_BUDGET
from jaxrl_llm.config.tree import Config
from jaxrl_llm.kernels import attention
from jaxrl_llm.models import moe
from jaxrl_llm.models.config import ModelConfig


def check(
  cfg: Config, *, num_devices: int, task=None, model: ModelConfig | None = None, device=None
) -> None:
  """Raises ConfigError listing every cross-section problem of `cfg` on `num_devices` devices
  with `task` (when built) and `model` (the architecture that will run: the checkpoint's when
  starting from one, else `cfg.model.arch`); `device`: one the program is compiled for (None:
  the default backend's first)."""
  mc = model or cfg.model.arch
  errors = (
    _batch(cfg)
    + _model(cfg, mc, device or jax.devices()[0])
    + _adapters(cfg, mc)
    + _learner(cfg, mc, task)
  )
  errors += _tool(cfg) + _tool_traces(cfg) + _gae_across_turns(cfg)
  errors += _devices(cfg, mc, num_devices) if not errors else []
  if task is not None:
    errors += _task(cfg, mc, task)
  if errors:
    raise invalid(errors)


def _batch(cfg: Config) -> list[str]:
  """B = P·G splits into the minibatches, a minibatch into its microbatches."""
  rl, b = cfg.rl, cfg.rl.num_prompts * cfg.sampling.group_size
  if b % rl.num_minibatches:
    return [
      f"rl.num_prompts * sampling.group_size = {b} sequences do not split into "
      f"rl.num_minibatches={rl.num_minibatches} equal minibatches"
    ]
  mb = b // rl.num_minibatches
  if rl.num_microbatches >= 1 and mb % rl.num_microbatches:  # 0 = auto picks a divisor
    return [
      f"minibatch of {mb} sequences does not split into rl.num_microbatches={rl.num_microbatches}"
    ]
  return []


def _model(cfg: Config, mc: ModelConfig, device) -> list[str]:
  """What the architecture that will run allows: cuDNN or Pallas attention, the MoE layers and
  their grouped kernel on `device`, a value head and the learner's MoE-only objectives."""
  out = []
  refusal = attention.cudnn_refusal(mc.compute_dtype, mc.head_dim)
  if cfg.model.attention == "cudnn" and refusal:
    out.append(f"model.attention='cudnn' cannot run: {refusal}; use auto, xla or einsum")
  dt = mc.compute_dtype  # the slots' count is checked when a decode step is traced
  refusal = attention.pallas_refusal(dt, dt, mc.head_dim, attention.DECODE_BLOCK)
  if cfg.model.attention == "pallas" and refusal:
    out.append(f"model.attention='pallas' cannot run: {refusal}; use auto, xla or einsum")
  if mc.moe_num_experts and mc.moe_impl == "kernel":
    dims = (mc.d_model, mc.moe_expert_mlp_dim)  # the grouped matmuls' widths
    refusal = moe.kernel_refusal(device, mc.compute_dtype, dims)
    out += [refusal] if refusal else []
  try:
    mc.moe  # noqa: B018 - builds (and checks) the MoE layers' config
  except ValueError as err:  # fields named moe.<x> are model.moe_<x> in the config
    out.append(str(err).replace("moe.", "model.moe_"))
  if cfg.model.checkpoint and cfg.model.arch.value_head:
    out.append("model.value_head with model.checkpoint is not supported (no pretrained value head)")
  is_moe = mc.moe_num_experts > 0
  if cfg.objective.name == "rspo" and not is_moe:
    out.append(
      "objective.name='rspo' (§2.8) needs a mixture-of-experts policy: set model.moe_num_experts > 0"
    )
  if cfg.replay.name in ("r2", "r3") and not is_moe:
    out.append(
      f"replay.name={cfg.replay.name!r} replays MoE routing: set model.moe_num_experts > 0"
    )
  if cfg.objective.name == "ppo_critic" and not mc.value_head:
    out.append("objective.name='ppo_critic' needs a value head: set model.value_head=True")
  return out


def _adapters(cfg: Config, mc: ModelConfig) -> list[str]:
  """Low-rank adapters train on a fixed base: the KL reference is that base, and nothing else
  of the model trains."""
  if not mc.lora_rank:
    return []
  out, rank = [], f"model.lora_rank={mc.lora_rank}"
  if cfg.kl.beta > 0 and cfg.kl.reference != "frozen":
    out.append(
      f"kl.reference={cfg.kl.reference!r} moves the reference, but with {rank} the reference "
      "is the base the adapters sit on: use kl.reference='frozen' (or model.lora_rank=0)"
    )
  if mc.value_head:
    out.append(
      f"model.value_head with {rank}: only the adapters train, so the value head would stay "
      "at its initialisation; use model.lora_rank=0 for a critic"
    )
  return out


def _learner(cfg: Config, mc: ModelConfig, task) -> list[str]:
  """The critic pairs with GAE; prompt files need a budget and no warm start; L_cache < T."""
  out, critic, advantage = [], cfg.objective.name == "ppo_critic", cfg.advantage.name
  if critic and advantage != "gae":
    out.append(
      f"objective.name='ppo_critic' uses GAE advantages: set advantage.name='gae' (got {advantage!r})"
    )
  if advantage == "gae" and not critic:
    out.append(
      "advantage.name='gae' needs a critic: use objective.name='ppo_critic' with model.value_head=True"
    )
  if cfg.uses_files:
    t = cfg.sampling.max_new_tokens
    out += need(t >= 1, "sampling.max_new_tokens must be >= 1 with data.train_files")
  sh = cfg.shaping
  if sh.name == "soft_overlong" and task is not None:
    t_max = _budget(cfg, task)
    out += need(
      1 <= sh.cache_len < t_max,
      f"shaping.cache_len={sh.cache_len} must be in [1, T={t_max}), T the completion budget "
      "(sampling.max_new_tokens, or with 0 the task's, times the turns with a tool)",
    )
  return out


def _budget(cfg: Config, task) -> int:
  """The sampler's completion budget T for `task` (`SamplingSettings.budget`); a tool the task
  or its tokenizer cannot take counts as none here (`_tool` and `_task` name it)."""
  from jaxrl_llm import envs

  try:
    env = None if _tool(cfg) else envs.get_env(cfg.sampling.tool, task)
  except ValueError:
    env = None
  return cfg.sampling.budget(task, env)


def _devices(cfg: Config, mc: ModelConfig, num_devices: int) -> list[str]:
  """The mesh fits the devices, the rules split each parameter evenly, and every batch splits
  over the rows' devices."""
  try:
    sizes = cfg.mesh.sizes(num_devices)
  except ValueError as err:
    return [str(err)]
  out = []
  if jax.process_count() > 1 and math.prod(sizes.values()) != num_devices:
    out.append(
      " x ".join(f"mesh.{k}={v}" for k, v in sizes.items())
      + f" does not use all {num_devices} devices of the {jax.process_count()} processes; a "
      "multi-process mesh must span every device (mesh.data=-1 fills it)"
    )
  if sizes["expert"] > 1 and mc.moe_num_experts % sizes["expert"]:
    out.append(
      f"model.moe_num_experts={mc.moe_num_experts} is not divisible by mesh.expert="
      f"{sizes['expert']} (each expert-parallel device holds the same number of experts)"
    )
  if mc.d_model % sizes["fsdp"]:
    out.append(
      f"mesh.fsdp={sizes['fsdp']} does not divide model.d_model={mc.d_model} (FSDP splits "
      "every weight along d_model); use a divisor of it"
    )
  out += _tensor_parallel(mc, sizes["model"])
  if cfg.model.attention == "pallas" and math.prod(sizes.values()) > 1:
    out.append(
      f"model.attention='pallas' runs on one device (the mesh spans {math.prod(sizes.values())}):"
      " the decode kernel has no partitioning rule; use auto or einsum"
    )
  out += [] if out else _param_splits(cfg, mc, sizes)
  return out + ([] if out else _rows(cfg, sizes))


# The model fields that size a parameter dimension of each logical axis ("mlp": see `_field`).
_AXIS_FIELDS = {
  "vocab": "model.vocab_size",
  "embed": "model.d_model",
  "norm": "model.d_model",
  "heads": "model.num_heads",
  "kv_heads": "model.num_kv_heads",
  "head_dim": "model.head_dim",
  "expert": "model.moe_num_experts",
  "lora_rank": "model.lora_rank",
  "layers": "model.num_layers",
}


def _field(logical: str, path: str) -> str:
  """The model field behind dimension `logical` of parameter `path`."""
  if logical != "mlp":
    return _AXIS_FIELDS.get(logical, f"its {logical} dimension")
  if "/shared/" in path:
    return "model.moe_num_shared_experts x model.moe_shared_mlp_dim"
  return "model.moe_expert_mlp_dim" if "/moe/" in path else "model.mlp_dim"


def _param_splits(cfg: Config, mc: ModelConfig, sizes: dict[str, int]) -> list[str]:
  """Every parameter dimension the mesh rules split divides by the mesh axes it is split over
  (the model's parameter shapes, traced without allocating: the first that does not, named)."""
  if math.prod(sizes.values()) == 1:
    return []
  from jaxrl_llm.models.hf import abstract_params

  leaves = jax.tree_util.tree_flatten_with_path(
    abstract_params(mc), is_leaf=lambda v: isinstance(v, nn.LogicallyPartitioned)
  )[0]
  source = "mesh.rules" if cfg.mesh.rules else "the built-in rule table (mesh.rules=())"
  for path, leaf in leaves:
    if not isinstance(leaf, nn.LogicallyPartitioned):
      continue
    spec = sharding.mesh_axes(leaf.names, cfg.mesh.rule_table)
    for dim, (logical, axes) in enumerate(zip(leaf.names, spec, strict=True)):
      axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
      n, size = math.prod(sizes[a] for a in axes), leaf.value.shape[dim]
      if size % n:
        name = "/".join(str(getattr(p, "key", p)) for p in path)
        mesh = " x ".join(f"mesh.{a}={sizes[a]}" for a in axes)
        return [
          f"{source} maps {logical} to {mesh}, which does not divide "
          f"{_field(logical, '/' + name + '/')}={size} (param {name} dim {dim}); map it to "
          "mesh axes whose sizes divide it, or to None"
        ]
  return []


def _tensor_parallel(mc: ModelConfig, n: int) -> list[str]:
  """mesh.model = n divides every width it splits: the vocabulary, the query heads and the
  feed-forward widths the model has (dense, routed and shared experts)."""
  if n == 1:
    return []
  widths = {"model.vocab_size": mc.vocab_size, "model.num_heads": mc.num_heads}
  if len(mc.moe_layers) < mc.num_layers:  # dense feed-forward layers
    widths["model.mlp_dim"] = mc.mlp_dim
  if mc.moe is not None:
    widths["model.moe_expert_mlp_dim"] = mc.moe_expert_mlp_dim
    if mc.moe.shared_hidden_dim:
      widths["model.moe_num_shared_experts x model.moe_shared_mlp_dim"] = mc.moe.shared_hidden_dim
  bad = [f"{k}={v}" for k, v in widths.items() if v % n]
  return need(
    not bad,
    f"mesh.model={n} does not divide {', '.join(bad)} (tensor parallelism splits them over "
    "mesh.model); use a common divisor of them",
  )


def _rows(cfg: Config, sizes: dict[str, int]) -> list[str]:
  """Sampled prompts, P, minibatches, SFT batches and the built-in eval set split over the
  data-parallel devices (mesh.data x mesh.fsdp x mesh.expert)."""
  data = sizes["data"] * sizes["fsdp"] * sizes["expert"]
  rl, out, sampled = cfg.rl, [], cfg.sampled_prompts
  if sampled % data:
    what = (
      "ceil(filtering.oversample * rl.num_prompts)"
      if sampled != rl.num_prompts
      else "rl.num_prompts"
    )
    out.append(
      f"{what}={sampled} is not divisible by the {data} data-parallel devices of the mesh "
      f"(mesh.data x mesh.fsdp x mesh.expert = {sizes['data']} x {sizes['fsdp']} x "
      f"{sizes['expert']}); use a multiple of {data}"
    )
  if rl.num_prompts % data and sampled != rl.num_prompts:  # else said just above
    out.append(
      f"rl.num_prompts={rl.num_prompts} is not divisible by the {data} data-parallel devices"
    )
  mb = rl.num_prompts * cfg.sampling.group_size // rl.num_minibatches
  if not out:  # a minibatch of prompts that do not split does not either: one line is enough
    out += need(
      mb % data == 0,
      f"minibatch of {mb} sequences (rl.num_prompts x sampling.group_size / "
      f"rl.num_minibatches) is not divisible by the {data} data-parallel devices",
    )
  if cfg.sft.steps and cfg.sft.batch_size % data:
    out.append(f"sft.batch_size={cfg.sft.batch_size} is not divisible by {data} devices")
  if not cfg.uses_files and cfg.task.eval_size % data:  # file evals are padded
    out.append(
      f"task.eval_size={cfg.task.eval_size} is not divisible by the {data} data-parallel "
      f"devices; use a multiple of {data}"
    )
  return out


def _tool(cfg: Config) -> list[str]:
  """Countdown's tool checks countdown's expressions."""
  tool = cfg.sampling.tool
  return need(
    tool != "countdown" or (cfg.task.name == "countdown" and not cfg.uses_files),
    f"sampling.tool='countdown' checks countdown's expressions; task.name={cfg.task.name!r}"
    f"{' with prompt files' if cfg.uses_files else ''} (use calculator or arithmetic, or "
    "task.name=countdown)",
  )


def _gae_across_turns(cfg: Config) -> list[str]:
  """GAE under a tool carries V and A across the tool's answers: reset there, the tokens before a
  call would bootstrap from V = 0 and never see the episode's reward."""
  adv = cfg.advantage
  return need(
    cfg.sampling.tool == "none" or adv.name != "gae" or adv.gae_carry_masked,
    f"advantage.gae_carry_masked=False with sampling.tool={cfg.sampling.tool!r} resets GAE at "
    "each tool answer, so the tokens before a call never see the episode's reward; allowed "
    "with a tool: advantage.gae_carry_masked=True",
  )


def _tool_traces(cfg: Config) -> list[str]:
  """Warm-start traces that call the tool need a tool that answers those calls as the traces
  do (a task without tool traces ignores them: `acting._unused_reason`; a host tool is the user's)."""
  from jaxrl_llm import envs

  traces, tool = cfg.task.tool_traces, cfg.sampling.tool
  answer = trace_tools().get(cfg.task.name)
  if not traces or answer is None or cfg.uses_files or tool.startswith(envs.HOST):
    return []
  if tool == "none":
    return [
      f"task.tool_traces={traces} warm-starts on traces that call a tool, but "
      "sampling.tool='none' answers no call; allowed: task.tool_traces=0 without a tool, or "
      f"sampling.tool in {', '.join(answer)}"
    ]
  return need(
    tool in answer,
    f"task.tool_traces={traces}: {cfg.task.name}'s traces show the answers of "
    f"{' or '.join(answer)}, which sampling.tool={tool!r} does not give alike; allowed: "
    f"sampling.tool in {', '.join(answer)}, or task.tool_traces=0",
  )


def context(
  cfg: Config, prompt_len: int, new_tokens: int, limit: int | None, source: str
) -> list[str]:
  """The prompt and the completion the sampler allocates (S + T: with a tool every segment
  and tool answer of the episode) fit the checkpoint's context, `limit` positions
  (max_position_embeddings of `source`; None: not recorded, nothing to check)."""
  if limit is None or prompt_len + new_tokens <= limit:
    return []
  s = (
    f"data.prompt_len={prompt_len}" if cfg.uses_files else f"the task's prompt length {prompt_len}"
  )
  if cfg.sampling.max_new_tokens:
    t = f"sampling.max_new_tokens={new_tokens}"
  elif cfg.sampling.tool != "none":
    t = f"the completion budget {new_tokens} (sampling.max_new_tokens=0: "
    t += f"sampling.max_turns={cfg.sampling.max_turns} segments and the tool's answers)"
  else:
    t = f"the completion budget {new_tokens} (sampling.max_new_tokens=0: the task's)"
  return [
    f"{s} + {t} = {prompt_len + new_tokens} tokens exceed the checkpoint's context: "
    f"max_position_embeddings={limit} in {source}; allowed: a prompt and completion of at most "
    f"{limit} tokens together"
  ]


def _task(cfg: Config, mc: ModelConfig, task) -> list[str]:
  """The model's vocabulary holds the task's tokens; a batch fits in a built-in task's training
  split; a tool can write its calls and answers in the task's tokenizer."""
  vocab = task.tokenizer.vocab_size
  out = need(
    vocab <= mc.vocab_size,
    f"model.vocab_size={mc.vocab_size} is smaller than task {task.name!r}'s vocabulary of "
    f"{vocab} tokens",
  )
  split = _train_split(cfg, task)  # a batch past the split (or budget, below) is said first
  out += split or _int32_tokens(cfg, task)
  if cfg.sampling.tool != "none":
    from jaxrl_llm import envs, tool_formats

    try:
      env = envs.ENVIRONMENTS.get(cfg.sampling.tool, envs.ToolEnv)
      tool_formats.tool_tokens(task.tokenizer, env.inline)
    except ValueError as e:
      out.append(f"sampling.tool={cfg.sampling.tool!r}: {e}")
    else:
      out += _tool_budget(cfg, task) + _tool_room(cfg, task)
  return out


def _train_split(cfg: Config, task) -> list[str]:
  """A batch of RL prompts (P, or ceil(k·P) under dynamic sampling) and of the warm start fits
  in a built-in task's training problems: each batch draws distinct problems."""
  n = getattr(task, "num_train", None)
  if n is None:
    return []
  p, dynamic = cfg.sampled_prompts, cfg.filtering.name == "dynamic_sampling"
  rl = f"rl.num_prompts={cfg.rl.num_prompts}" + (
    f" with filtering.oversample={cfg.filtering.oversample} ({p} prompts drawn)" if dynamic else ""
  )
  batches = [(rl, p)] + (
    [(f"sft.batch_size={cfg.sft.batch_size}", cfg.sft.batch_size)] * bool(cfg.sft.steps)
  )
  return [
    f"{what} is more than the {n} training problems of task {task.space}; allowed: a batch of at most "
    f"{n}, or task settings with a larger problem space"
    for what, size in batches
    if size > n
  ]


def _int32_tokens(cfg: Config, task) -> list[str]:
  """The tokens of a rollout (sampled prompts x G rows) and of an evaluation (eval_size x
  pass_k sampled rows) stay below 2**31: JAX indexes an array's elements in int32. A budget
  past MAX_BUDGET is said by `_tool_budget` alone."""
  budget, bound = _budget(cfg, task), 2**31 - 1
  if budget >= MAX_BUDGET:
    return []
  length = task.prompt_len + budget
  p, drawn, k = f"rl.num_prompts={cfg.rl.num_prompts}", cfg.sampled_prompts, cfg.train.pass_k
  if drawn != cfg.rl.num_prompts:  # dynamic sampling draws ceil(k·P)
    p = f"ceil(filtering.oversample={cfg.filtering.oversample} x {p}) = {drawn} prompts"
  batches = (
    (f"{p} x sampling.group_size={cfg.sampling.group_size}", "a rollout"),
    (f"task.eval_size={cfg.task.eval_size} x train.pass_k={k}", "an evaluation"),
  )
  rows = (drawn * cfg.sampling.group_size, cfg.task.eval_size * k)
  return [
    f"{what} = {n} rows of {length} tokens (prompt and completion budget) make {n * length} "
    f"tokens in {where}; allowed: at most 2**31 - 1 = {bound} (arrays are indexed in int32)"
    for (what, where), n in zip(batches, rows, strict=True)
    if n * length > bound
  ]


def _tool_budget(cfg: Config, task) -> list[str]:
  """With a tool and sampling.max_new_tokens=0, the episode's budget (`SamplingSettings.budget`:
  max_turns x (a segment + the tool's answer), the task's sizes) below MAX_BUDGET tokens; the
  parse-time check bounds it from below only."""
  from jaxrl_llm import envs

  s = cfg.sampling
  if s.max_new_tokens or _tool(cfg):  # bounded at parse; a tool this task cannot take (named)
    return []
  env = envs.get_env(s.tool, task)
  segment = s.turn_tokens or task.max_new_tokens
  per_turn = segment + env.answer_len
  what = f"sampling.turn_tokens={segment}" if s.turn_tokens else f"the task's answer, {segment}"
  budget = s.budget(task, env)
  if budget >= MAX_BUDGET and s.turn_tokens and (MAX_BUDGET - 1) // per_turn < 2:
    return need(  # even a tool's fewest turns (2) overflow: the segment is what is too long
      False,
      f"sampling.turn_tokens={s.turn_tokens} is too large: with sampling.max_new_tokens=0 even "
      f"the 2 turns a tool takes at least make a completion budget of {2 * per_turn} tokens "
      f"(2 x (turn_tokens + the tool's answer, {env.answer_len})); allowed: a budget below "
      f"2**20 = {MAX_BUDGET} tokens: sampling.turn_tokens at most "
      f"{(MAX_BUDGET - 1) // 2 - env.answer_len} here",
    )
  return need(
    budget < MAX_BUDGET,
    f"sampling.max_turns={s.max_turns} is too large: with sampling.max_new_tokens=0 it makes a "
    f"completion budget of {budget} tokens (max_turns x ({what} + the tool's "
    f"answer, {env.answer_len})); allowed: a budget below 2**20 = {MAX_BUDGET} tokens: "
    f"sampling.max_turns at most {(MAX_BUDGET - 1) // per_turn} here",
  )


def _tool_room(cfg: Config, task) -> list[str]:
  """A policy segment of sampling.turn_tokens holds a call (a number token and the close), and
  the completion budget one call, the tool's shortest answer and a token after it: else the
  tool could never act."""
  from jaxrl_llm import envs

  s = cfg.sampling
  if _tool(cfg):  # a tool this task cannot take (named)
    return []
  t_ = envs.get_env(s.tool, task).tokens
  close, shown = len(t_.close), repr(t_.format.close)
  call, answer = 1 + close, len(t_.prefix) + 1 + len(t_.suffix)
  out = need(
    not s.turn_tokens or s.turn_tokens >= call,
    f"sampling.turn_tokens={s.turn_tokens} ends every segment before a call can close: a call "
    f"takes at least {call} tokens here (a number and the close {shown}, {close} "
    f"token{'s' if close > 1 else ''}); allowed: 0 (off) or at least {call}",
  )
  budget, least = _budget(cfg, task), call + answer + 1
  t = f"sampling.max_new_tokens={budget}" if s.max_new_tokens else f"the budget of {budget} tokens"
  return out + need(
    budget >= least,
    f"{t} leaves no room for a tool call: a call, the tool's answer and a token after it take "
    f"at least {least} tokens here (the call, a number and the close {shown}: {call}; the "
    f"shortest answer: {answer}; one after); allowed: sampling.max_new_tokens at least {least}, "
    "or sampling.tool='none'",
  )
