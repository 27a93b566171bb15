"""The run's sections besides the learner's: task, data, model, sampling, optimiser, warm
start, loop and mesh. Each field's comment is its documentation (docs/config.md's config
reference and `--help`-style listings are generated from it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from jaxrl_llm import sharding
from jaxrl_llm.config.fields import (
  TRACED,
  LearnedSection,
  Section,
  allowed,
  at_least,
  coerce,
  field_docs,
  need,
  setting,
)
from jaxrl_llm.kernels import attention
from jaxrl_llm.models.config import ModelConfig, widths_from_checkpoint
from jaxrl_llm.quant import SAMPLER_DTYPES

REWARD_WEIGHTS = (("correct", 1.0), ("format", 0.0))  # the built-in tasks' reward terms
MIN_TEMPERATURE = 0.01  # sampling.temperature's floor
MAX_BUDGET = 2**20  # the completion budget's bound in tokens (sampling.max_new_tokens or derived)


@dataclasses.dataclass(frozen=True)
class TaskSettings(LearnedSection):
  """`task`: the built-in verifiable task (its fields go to the task's constructor) and the
  weights of the reward terms."""

  SECTION: ClassVar[str] = "task"
  name: str = setting(
    "reverse", hparam=True
  )  # built-in verifiable task: reverse | addition | sort | countdown
  digits: int = 2  # addition: operands in [0, 10**digits)
  numbers: int = 4  # countdown: digits 1-9 given to reach the target with + - *
  wrong_traces: float = 0.0  # countdown, addition: fraction of warm-start traces made wrong
  tool_traces: float = 0.0  # countdown, addition: fraction of traces calling the tool first
  min_len: int = 2  # reverse: shortest string
  max_len: int = 5  # reverse: longest string
  eval_size: int = setting(
    256, resume=False
  )  # held-out evaluation prompts (disjoint from training prompts)
  reward_weights: tuple[tuple[str, float], ...] = REWARD_WEIGHTS  # R = Σ w_k R^k (§6), by term

  @classmethod
  def from_section(cls, section: Mapping[str, Any]) -> TaskSettings:
    """The section, with the reward weights as (term, weight) pairs."""
    given = dict(section.items())
    weights = given.get("reward_weights")
    if hasattr(weights, "items"):
      given["reward_weights"] = tuple(
        (str(k), coerce("float", v, f"task.reward_weights.{k}")) for k, v in weights.items()
      )
    return super().from_section(given)

  def to_dict(self) -> dict[str, Any]:
    """The section as the config holds it (the reward weights as a mapping)."""
    return super().to_dict() | {"reward_weights": dict(self.reward_weights)}

  @property
  def task_fields(self) -> dict[str, Any]:
    """The fields handed to the built-in task's constructor (and recorded in checkpoints)."""
    return {k: v for k, v in super().to_dict().items() if k not in ("name", "reward_weights")}

  def errors(self) -> list[str]:
    """A built-in task's name, each task field in its task's range (`data.tasks.field_errors`),
    some non-zero reward weight."""
    from jaxrl_llm.data import tasks  # the tasks declare their fields' ranges

    weights = [w for _, w in self.reward_weights]
    known = allowed("task.name", self.name, tuple(sorted(tasks.TASKS)))
    return (
      known
      + tasks.field_errors(self.task_fields)
      + need(any(weights), "task.reward_weights are all 0: the reward would be constant")
    )


@dataclasses.dataclass(frozen=True)
class DataSettings(LearnedSection):
  """`data`: prompt files with host-verified answers (empty `train_files`: the built-in task)."""

  SECTION: ClassVar[str] = "data"
  train_files: str = setting(
    "", resume=False
  )  # JSON(L)/Parquet files or globs, comma-separated ("" = built-in task; a resume checks bytes)
  eval_files: str = setting(
    "", resume=False
  )  # held-out files ("" = split data.eval_fraction off the train files)
  eval_fraction: float = 0.05  # share of train records held out (hash of the prompt)
  prompt_field: str = "prompt"  # record field holding the question (dotted paths allowed)
  answer_field: str = "answer"  # record field holding the reference answer
  template: str = "qwen_math"  # prompt template: plain | r1 | qwen_math | chat | qwen_math_chat
  system_prompt: str = ""  # system message for chat templates ("" = none)
  special_tokens_in_text: bool = False  # special-token strings in prompts become control ids
  prompt_len: int = 256  # S: prompt tokens (longer prompts are filtered and counted)
  tokenizer: str = setting(
    "", resume=False
  )  # tokenizer dir or tokenizer.json ("" = model.checkpoint's)
  correct_term: str = "math_correct"  # host reward term that defines accuracy
  verifier_timeout_s: float = setting(
    5.0, resume=False
  )  # per-completion verifier time limit (failures score 0)

  def errors(self) -> list[str]:
    """Held-out share in [0, 1), S >= 1, a known template and accuracy term, a system prompt
    that is no spelling of None and (for prompt files) only with a chat template, named record
    fields, a time limit."""
    from jaxrl_llm.data import templates, verifiers  # light; imported here to keep this lean

    out = need(
      0 <= self.eval_fraction < 1, f"data.eval_fraction={self.eval_fraction} must be in [0, 1)"
    )
    out += at_least("data", self, 1, "prompt_len")
    unknown = allowed("data.template", self.template, tuple(sorted(templates.PROMPT_TEMPLATES)))
    out += unknown
    out += allowed("data.correct_term", self.correct_term, tuple(sorted(verifiers.REWARD_FNS)))
    out += need(  # the command line's None is the text "None", not "no system message"
      self.system_prompt.strip() not in ("None", "none", "null"),
      f"data.system_prompt={self.system_prompt!r} would be the system message's text; allowed: "
      "'' for no system message, or the message itself",
    )
    chat = tuple(sorted(templates.CHAT_PROMPT_TEMPLATES))
    out += need(
      unknown or not (self.train_files and self.system_prompt) or self.template in chat,
      f"data.system_prompt is set but data.template={self.template!r} has no system message; "
      f"allowed: a chat template ({', '.join(chat)}), or data.system_prompt=''",
    )
    for name in ("prompt_field", "answer_field"):  # '' would read no field of any record
      value = getattr(self, name)
      out += need(value.strip() != "", f"data.{name}={value!r}: name a field of the records")
    timeout = self.verifier_timeout_s
    return out + need(timeout > 0, f"data.verifier_timeout_s={timeout} must be > 0")


RUN_FIELDS = ("checkpoint", "attention")  # model.* fields that are not the architecture


@dataclasses.dataclass(frozen=True)
class ModelSettings(Section):
  """`model`: the architecture (every `ModelConfig` field, commented in models/config.py), the
  checkpoint to start from and the attention implementation."""

  SECTION: ClassVar[str] = "model"
  checkpoint: str = ""  # Hugging Face checkpoint dir to start from ("" = random init)
  attention: str = (
    attention.AUTO
  )  # auto (cuDNN/Pallas where verified, else einsum) | einsum | xla | cudnn | pallas
  arch: ModelConfig = ModelConfig()  # the architecture: the other model.* fields

  @classmethod
  def from_section(cls, section: Mapping[str, Any]) -> ModelSettings:
    """Splits the section into the architecture and the run fields."""
    given = dict(section.items())
    types = {f.name: f.type for f in dataclasses.fields(ModelConfig)}  # finite floats, typed
    arch = {k: coerce(types[k], v, f"model.{k}") if k in types else v for k, v in given.items()}
    run = {k: str(given.get(k, getattr(cls, k))) for k in RUN_FIELDS}
    with widths_from_checkpoint(bool(run["checkpoint"])):  # a checkpoint's widths bound a rank
      arch = ModelConfig.from_dict({k: v for k, v in arch.items() if k not in RUN_FIELDS})
    return cls(**run, arch=arch)

  def to_dict(self) -> dict[str, Any]:
    """The flat section: the architecture's fields, then the run fields."""
    return self.arch.to_dict() | {k: getattr(self, k) for k in RUN_FIELDS}

  @classmethod
  def tagged(cls, key: str, value: Any = None) -> tuple[str, ...]:
    """The run fields and the architecture's fields whose metadata sets `key` (to `value`)."""
    return (*super().tagged(key, value), *ModelConfig.tagged(key, value))

  @classmethod
  def docs(cls) -> dict[str, str]:
    """The architecture's comments and the run fields'."""
    own = field_docs(cls)
    return field_docs(ModelConfig) | {k: own[k] for k in RUN_FIELDS}

  def errors(self) -> list[str]:
    """A known attention implementation; no float16 parameters; at most 4096 blocks (a
    checkpoint's count is checked against its weights)."""
    out = allowed("model.attention", self.attention, attention.IMPLEMENTATIONS)
    if self.arch.num_layers > 4096:  # unrolled, each block is traced in turn: 10**9 never ends
      out.append(f"model.num_layers={self.arch.num_layers} must be in [1, 4096]")
    if self.arch.param_dtype == "float16":
      out.append(
        "model.param_dtype='float16' is refused: Adam's small updates underflow in float16 and "
        "the run turns NaN; keep float32 (or bfloat16) parameters and set model.dtype=float16 "
        "for float16 compute"
      )
    return out


@dataclasses.dataclass(frozen=True)
class SamplingSettings(LearnedSection):
  """`sampling`: the rollout's group size, budget and decoding, and the sampler's weights (what
  the rollouts are, so a change blocks a resume; the sampler's dtype and KV blocks do not)."""

  SECTION: ClassVar[str] = "sampling"
  group_size: int = setting(8, hparam=True)  # G completions per prompt (>= 2 for group advantages)
  max_new_tokens: int = 0  # T completion budget; 0 = the task's default
  temperature: float = setting(
    1.0, per_run=TRACED, hparam=True
  )  # τ_s >= 0.01; recorded log-probs are of logits / τ_s (§0)
  top_k: int = setting(
    0, per_run=TRACED, constant=True
  )  # draw among the k most likely tokens (0 = off)
  top_p: float = setting(
    1.0, per_run=TRACED, constant=True
  )  # nucleus sampling mass in (0, 1] (1 = off)
  param_dtype: str = setting(
    "auto", resume=False
  )  # sampler copy: auto (bf16, CPU f32) | float32 | bfloat16 | int8 | int4
  kv_block: int = setting(
    128, resume=False
  )  # decode stages of this many steps read only filled KV slots (0 = all S+T)
  tool: str = "none"  # multi-turn tool: none | calculator | arithmetic | arithmetic_inline | countdown | host:<m>:<f>
  max_turns: int = 3  # with a tool: the policy's segments per episode (at most max_turns - 1 calls)
  turn_tokens: int = 0  # with a tool: the most tokens of one policy segment (0 = only the budget T)

  def errors(self) -> list[str]:
    """G >= 2, τ_s >= MIN_TEMPERATURE, top-p in (0, 1], top-k, T and kv_block >= 0, a known sampler dtype."""
    out = need(
      self.group_size >= 2,
      f"sampling.group_size={self.group_size} must be >= 2 (group advantages need a group)",
    )
    out += need(
      self.temperature >= MIN_TEMPERATURE,
      f"sampling.temperature={self.temperature} must be >= {MIN_TEMPERATURE} (below it logits / "
      "τ_s overflow float32 and every update is skipped)",
    )
    out += need(0 < self.top_p <= 1, f"sampling.top_p={self.top_p} must be in (0, 1]")
    out += at_least("sampling", self, 0, "top_k", note=" (0 = off)")
    out += at_least("sampling", self, 0, "max_new_tokens", "kv_block")
    if self.tool == "none":  # with a tool, 2 or more (said below)
      out += at_least("sampling", self, 1, "max_turns")
    out += at_least("sampling", self, 0, "turn_tokens")
    out += need(
      self.max_new_tokens <= 0 or self.turn_tokens <= self.max_new_tokens,
      f"sampling.turn_tokens={self.turn_tokens} exceeds the completion budget "
      f"sampling.max_new_tokens={self.max_new_tokens}; allowed: 0 (off) to {self.max_new_tokens}",
    )
    out += self._budget_errors()
    from jaxrl_llm import envs  # the registry of tools (it reads the tasks' tokenizer)

    out += [] if envs.is_tool(self.tool) else allowed("sampling.tool", self.tool, envs.TOOLS)
    out += need(
      self.tool == "none" or self.max_turns >= 2,
      f"sampling.max_turns={self.max_turns} with sampling.tool={self.tool!r} leaves no turn for "
      "the tool's answer (max_turns - 1 calls); allowed: 2 or more, or sampling.tool='none'",
    )
    if envs.is_tool(self.tool) and self.tool.startswith(envs.HOST):  # importable, callable
      fn = envs.host_callable(self.tool)
      out += [fn] if isinstance(fn, str) else []
    return out + allowed("sampling.param_dtype", self.param_dtype, SAMPLER_DTYPES)

  def _budget_errors(self) -> list[str]:
    """The completion budget below `MAX_BUDGET` tokens (int32 far away): T when set; with a
    tool and T = 0, max_turns × (a segment, turn_tokens or the task's answer, + the tool's
    answer), which is at least max_turns × (max(turn_tokens, 1) + 1)."""
    limit = f"2**20 = {MAX_BUDGET} tokens"
    out = need(
      self.max_new_tokens < MAX_BUDGET,
      f"sampling.max_new_tokens={self.max_new_tokens} is too large; allowed: a completion "
      f"budget below {limit}",
    )
    if self.tool == "none":
      return out
    per_turn = 1 if self.max_new_tokens else max(self.turn_tokens, 1) + 1
    if not self.max_new_tokens and 2 * per_turn >= MAX_BUDGET:  # even a tool's 2 turns overflow
      why = (
        f"sampling.turn_tokens={self.turn_tokens} is too large: with sampling.max_new_tokens=0 "
        f"even the 2 turns a tool takes at least make a completion budget of at least "
        f"{2 * per_turn} tokens (2 x (turn_tokens + the tool's answer)); allowed: a budget "
        f"below {limit}: sampling.turn_tokens at most {(MAX_BUDGET - 1) // 2 - 1}"
      )
      return [*out, why]
    how = (
      f"sampling.max_new_tokens={self.max_new_tokens} allows at most that many turns"
      if self.max_new_tokens
      else f"with sampling.turn_tokens={self.turn_tokens} and sampling.max_new_tokens=0 it "
      f"makes a completion budget of at least {self.max_turns * per_turn} tokens (max_turns x "
      "(each segment + the tool's answer))"
    )
    return out + need(
      self.max_turns * per_turn < MAX_BUDGET,
      f"sampling.max_turns={self.max_turns} is too large: {how}; allowed: a budget below "
      f"{limit}: sampling.max_turns at most {(MAX_BUDGET - 1) // per_turn} here",
    )

  def budget(self, task, tool) -> int:
    """The completion budget T for `task` with the environment `tool` (None: no tool):
    `max_new_tokens` when set; else the task's answer, or with a tool max_turns × (a segment,
    turn_tokens or the task's answer, + the tool's answer)."""
    if self.max_new_tokens:
      return self.max_new_tokens
    if tool is None:
      return task.max_new_tokens
    return self.max_turns * ((self.turn_tokens or task.max_new_tokens) + tool.answer_len)

  def sampler(
    self, task, *, greedy: bool = False, group_size: int | None = None, tool_timeout_s=None
  ):
    """The static `SamplingConfig` of the RL sampler (or an evaluation sampler) for `task`; a
    host tool's calls get `tool_timeout_s` each (the run's `data.verifier_timeout_s`)."""
    from jaxrl_llm import envs
    from jaxrl_llm.sampling import SamplingConfig  # the sampler reads this section's defaults

    tool = envs.get_env(self.tool, task, tool_timeout_s)
    return SamplingConfig(
      max_new_tokens=self.budget(task, tool),
      group_size=group_size or self.group_size,
      temperature=self.temperature,
      top_k=self.top_k,
      top_p=self.top_p,
      greedy=greedy,
      eos_id=task.tokenizer.eos_id,
      pad_id=task.tokenizer.pad_id,
      kv_block=self.kv_block,
      tool=tool,
      max_turns=self.max_turns,
      turn_tokens=self.turn_tokens if tool is not None else 0,
    )


@dataclasses.dataclass(frozen=True)
class OptimSettings(Section):
  """`optim`: AdamW with linear warmup, cosine decay and global-norm clipping (RL phase)."""

  SECTION: ClassVar[str] = "optim"
  learning_rate: float = setting(
    3e-4, per_run=TRACED, hparam=True
  )  # peak AdamW learning rate of the RL phase
  warmup_steps: int = 10  # linear warmup (optimiser updates)
  decay_to: float = 0.1  # cosine decays to this fraction of the peak
  weight_decay: float = 0.0  # AdamW decoupled weight decay
  b1: float = 0.9  # Adam β1
  b2: float = 0.99  # Adam β2
  grad_clip: float = setting(1.0, switch=True)  # global-norm gradient clipping (0 = off)

  def errors(self) -> list[str]:
    """A positive rate, non-negative warmup, decay and clip, moment decays in [0, 1)."""
    lr = self.learning_rate
    out = need(lr > 0, f"optim.learning_rate={lr} must be > 0")
    out += at_least("optim", self, 0, "grad_clip", "warmup_steps", "weight_decay")
    for name in ("b1", "b2"):
      value = getattr(self, name)
      out += need(0 <= value < 1, f"optim.{name}={value} must be in [0, 1) (Adam's moment decay)")
    return out + need(0 <= self.decay_to <= 1, f"optim.decay_to={self.decay_to} must be in [0, 1]")

  def build(self, total_updates: int):
    """(optax transformation, learning-rate schedule) over `total_updates` updates."""
    from jaxrl_llm.optim import make_optimizer

    return make_optimizer(total_updates=total_updates, **self.to_dict())


@dataclasses.dataclass(frozen=True)
class SFTSettings(Section):
  """`sft`: the supervised warm start on prompt → reference answer before RL."""

  SECTION: ClassVar[str] = "sft"
  steps: int = 70  # supervised warm-start steps before RL (0 = none); logged in <workdir>/sft
  batch_size: int = 64  # sequences per supervised step
  learning_rate: float = 3e-3  # peak learning rate of the warm start

  def errors(self) -> list[str]:
    """steps >= 0, batch >= 1, a positive rate."""
    out = at_least("sft", self, 0, "steps") + at_least("sft", self, 1, "batch_size")
    return out + need(self.learning_rate > 0, f"sft.learning_rate={self.learning_rate} must be > 0")

  def optimizer(self, optim: OptimSettings) -> OptimSettings:
    """The warm start's optimiser: the RL phase's moments and clipping, its own peak rate,
    warmup over the first tenth (at most 10 steps), decay to 0.1 and no weight decay."""
    warmup = min(10, self.steps // 10)
    return dataclasses.replace(
      optim, learning_rate=self.learning_rate, warmup_steps=warmup, decay_to=0.1, weight_decay=0.0
    )


@dataclasses.dataclass(frozen=True)
class TrainSettings(Section):
  """`train`: the loop's length, evaluation, logging, checkpoints and guards."""

  SECTION: ClassVar[str] = "train"
  num_steps: int = 1000  # RL updates
  eval_every: int = 100  # held-out evaluation period (RL steps); also at start and end
  pass_k: int = 4  # k of the pass@k evaluation (sampled at τ_s)
  log_every: int = 10  # scalar summaries / progress line period
  checkpoint_every: int = 250  # orbax checkpoint period (RL steps); also at the end
  max_to_keep: int = 2  # checkpoints kept on disk (>= 1)
  max_skipped_updates: int = 10  # stop after this many consecutive non-finite updates
  max_failed_verifier_steps: int = 3  # steps in a row a verifier may fail every call (0 = no limit)
  text_samples: int = 8  # text summary rows: 1st completion of the first N prompts (all if fewer)
  stop_after_steps: int = setting(
    0, invocation=True
  )  # end this invocation after N steps (time-limited jobs; 0 = off)
  profile_steps: int = setting(
    0, invocation=True
  )  # trace N RL steps after the compiling one (TensorBoard Profile tab)
  resume_changed: bool = setting(
    False, invocation=True
  )  # resume a workdir whose learned settings or prompt files changed
  compilation_cache: str = setting(
    "auto", invocation=True
  )  # compiled programs kept for later launches: DIR, "" (none), "auto" (see docs/running.md)

  def errors(self) -> list[str]:
    """Periods, k and limits >= 1; optional counts >= 0."""
    out = at_least("train", self, 1, "num_steps", "eval_every", "log_every", "checkpoint_every")
    out += need(  # the state's step counter is an int32
      self.num_steps < 2**31, f"train.num_steps={self.num_steps} must be < 2**31 (an int32 step)"
    )
    out += at_least("train", self, 0, "stop_after_steps", "max_failed_verifier_steps")
    out += at_least("train", self, 0, "profile_steps", note=" (0 = off)")
    out += at_least("train", self, 1, "pass_k", "max_to_keep", "max_skipped_updates")
    return out + at_least("train", self, 0, "text_samples")


@dataclasses.dataclass(frozen=True)
class MeshSettings(Section):
  """`mesh`: the device mesh's axis sizes and the logical → mesh axis rules."""

  SECTION: ClassVar[str] = "mesh"
  data: int = -1  # data-parallel devices (-1 = all the other axes leave)
  fsdp: int = 1  # fully-sharded data parallel: params + optimiser state split (-1 = all left)
  expert: int = 1  # expert-parallel devices (the `expert` logical axis)
  model: int = 1  # tensor-parallel devices
  runs: int = 1  # a pack's device groups: each trains its share of the runs (1 = single run)
  runs_at_once: int = 0  # a pack's runs each group steps at once; the rest in turn (0 = all)
  rules: tuple = ()  # logical->mesh axis rules, e.g. (("mlp", "model"),); () = built-in table

  def errors(self) -> list[str]:
    """A well-formed rule table (the sizes are checked against the devices), runs_at_once >= 0."""
    out = at_least("mesh", self, 0, "runs_at_once", note=" (0 = every run at once)")
    try:
      sharding.rules_from_config(self.rules)
    except ValueError as e:
      return [*out, str(e)]
    return out

  @property
  def rule_table(self) -> tuple[tuple[str, Any], ...]:
    """The logical → mesh axis rules (the built-in table when none are configured)."""
    return sharding.rules_from_config(self.rules)

  def sizes(self, num_devices: int) -> dict[str, int]:
    """The axis sizes on `num_devices` devices (ValueError naming the fields if they misfit)."""
    return sharding.mesh_shape(
      num_devices,
      data=self.data,
      fsdp=self.fsdp,
      expert=self.expert,
      model=self.model,
      runs=self.runs,
    )
