"""The embedded default experiment: a tiny transformer learns to reverse strings on a CPU.

Every config field of the trainer is defined (and commented) here, except the model's, which
are `ModelConfig`'s fields (commented in `jaxrl_llm/models/config.py`); experiment files in
`configs/` start from `get_config()` and change what they need.

A short supervised warm start (70 steps) leaves the policy at roughly 0.15 held-out accuracy;
GRPO (spec §10 `grpo` without the KL term) then drives it above 0.9 within a few hundred
updates. The whole run takes under two minutes on two CPU cores.

  python -m jaxrl_llm.main --config=configs/default.py --workdir=/tmp/jaxrl_default
"""

import dataclasses

import ml_collections
from ml_collections.config_dict import placeholder

from jaxrl_llm.models.config import ModelConfig


def unset(kind: type = float):
  """A typed field left unset (None): the objective's own signature default applies."""
  return placeholder(kind)


def get_config() -> ml_collections.ConfigDict:
  """Returns the default experiment config."""
  c = ml_collections.ConfigDict()
  c.seed = 0  # one PRNG key per run; step keys are fold_in(key, step)

  c.task = ml_collections.ConfigDict()
  c.task.name = "reverse"  # built-in verifiable task: reverse | addition | sort
  c.task.digits = 2  # addition: operands in [0, 10**digits)
  c.task.min_len = 2  # reverse: shortest string
  c.task.max_len = 5  # reverse: longest string
  c.task.eval_size = 256  # held-out evaluation prompts (disjoint from training prompts)
  c.task.reward_weights = ml_collections.ConfigDict(
    {"correct": 1.0, "format": 0.0}
  )  # R = Σ w_k R^k (§6)

  c.data = ml_collections.ConfigDict()
  c.data.train_files = ""  # JSONL/Parquet files or globs, comma-separated ("" = built-in task)
  c.data.eval_files = ""  # held-out files ("" = split data.eval_fraction off the train files)
  c.data.eval_fraction = 0.05  # share of train records held out (hash of the prompt)
  c.data.prompt_field = "prompt"  # record field holding the question (dotted paths allowed)
  c.data.answer_field = "answer"  # record field holding the reference answer
  c.data.template = "qwen_math"  # prompt template: plain | r1 | qwen_math | chat | qwen_math_chat
  c.data.system_prompt = ""  # system message for chat templates ("" = none)
  c.data.special_tokens_in_text = False  # special-token strings in prompts become control ids
  c.data.prompt_len = 256  # S: prompt tokens (longer prompts are filtered and counted)
  c.data.tokenizer = ""  # tokenizer dir or tokenizer.json ("" = model.checkpoint's)
  c.data.correct_term = "math_correct"  # host reward term that defines accuracy
  c.data.verifier_timeout_s = 5.0  # per-completion verifier time limit (failures score 0)

  # Every field of `ModelConfig` (jaxrl_llm/models/config.py, one comment per field there), with
  # its defaults: a 2-layer, 64-wide dense transformer; override e.g. --config.model.d_model=128.
  c.model = ml_collections.ConfigDict(dataclasses.asdict(ModelConfig()))
  c.model.checkpoint = ""  # Hugging Face checkpoint dir to start from ("" = random init)
  c.model.attention = "auto"  # auto (cuDNN where it runs, else einsum) | einsum | xla | cudnn

  c.sampling = ml_collections.ConfigDict()
  c.sampling.group_size = 8  # G completions per prompt (>= 2 for group advantages)
  c.sampling.max_new_tokens = 0  # T completion budget; 0 = the task's default
  c.sampling.temperature = 1.0  # τ_s > 0; recorded log-probs are of logits / τ_s (§0)
  c.sampling.top_k = 0  # draw among the k most likely tokens (0 = off)
  c.sampling.top_p = 1.0  # nucleus sampling mass in (0, 1] (1 = off)

  c.sampling.param_dtype = (
    "auto"  # sampler weights: auto (GPU/TPU bf16, CPU fp32)|float32|bf16|int8
  )

  c.rl = ml_collections.ConfigDict()
  c.rl.num_prompts = 32  # P prompts per RL update (B = P * G sequences)
  c.rl.num_epochs = 1  # passes over each rollout batch
  c.rl.num_minibatches = 2  # optimiser steps per epoch (B must divide evenly)
  c.rl.num_microbatches = 0  # gradient-accumulation slices per minibatch (§5); 0 = auto
  c.rl.microbatch_tokens = 4096  # auto microbatching: max tokens per device per slice
  c.rl.remat = "auto"  # block remat: auto (full from 1e8 params) | none | full | dots_saveable
  c.rl.old_pass = "auto"  # auto: ℓ^old = sg[ℓ] when the rollout gets one update | always
  c.rl.share_prompt = "auto"  # prompt once per group in learner passes: auto | always | never
  c.rl.entropy_coef = 0.0  # c_e of the entropy bonus (§8)

  c.advantage = ml_collections.ConfigDict()
  c.advantage.name = "grpo"  # §1: grpo | mean_only | rloo | batch_std | reinforce_baseline | gae
  c.advantage.whiten = False  # whiten advantages over the batch
  c.advantage.whiten_variance = "population"  # population: /(σ + 1e-6) | unbiased (verl)
  c.advantage.gamma = 1.0  # GAE discount γ (gae only)
  c.advantage.lam = 0.95  # GAE λ (gae only)
  c.advantage.gae_carry_masked = False  # gae: carry V, A across masked tokens (verl); False: reset

  # The objective's own hyperparameters are unset (None) by default: the selected objective's
  # signature default applies (docs/objectives.md §2 and the README's table cite them), so
  # --config.objective.name=gspo trains GSPO with GSPO's widths. Fields of other objectives are
  # ignored.
  c.objective = ml_collections.ConfigDict()
  c.objective.name = "ppo_clip"  # §2: ppo_clip | pg | gspo | gspo_token | gmpo | cispo | sapo | ...
  c.objective.clip_low = unset()  # ε_low (ppo_clip 0.2, gspo 3e-4; cispo's token mask 0.2)
  c.objective.clip_high = unset()  # ε_high (ppo_clip 0.2, gspo 4e-4; cispo's token mask 0.28)
  c.objective.is_clip_low = unset()  # ε^IS_low of CISPO's IS weight (1.0 = no floor)
  c.objective.is_clip_high = unset()  # ε^IS_high of CISPO's IS weight (0.28)
  c.objective.dual_clip = unset()  # dual-clip c > 1 for A < 0 (ppo_clip; unset = off)
  c.objective.clip_log = unset()  # δ_c, log-space clip width (gmpo 0.4)
  c.objective.tau_pos = unset()  # soft-gate temperature for A > 0 (sapo 1.0)
  c.objective.tau_neg = unset()  # soft-gate temperature for A <= 0 (sapo 1.05)
  c.objective.cispo_mask = unset(bool)  # cispo: drop tokens outside its mask widths (False)
  c.objective.gamma_min = unset()  # γ_min floor of the router-shift weight (rspo 0.1)
  c.objective.value_coef = 0.5  # c_v of the clipped value loss (ppo_critic, §2.9)
  c.objective.value_clip = 0.2  # ε_v of the clipped value loss (ppo_critic, §2.9)

  c.aggregation = ml_collections.ConfigDict()
  c.aggregation.name = "seq_mean_token_mean"  # §5: token_mean | seq_mean_token_mean | seq_mean_token_sum | seq_mean_token_sum_norm | seq_mean
  c.aggregation.sum_norm_sequences = True  # seq_mean_token_sum_norm: ÷ B'·L_max; False: ÷ L_max

  c.correction = ml_collections.ConfigDict()
  c.correction.name = (
    "none"  # §3: none | tis_token | tis_seq | mis_token | mis_seq, optional "+geo_mask"
  )
  c.correction.cap = 2.0  # C: truncation / rejection threshold of ρ
  c.correction.geo_low = 0.0  # C_low of geo_mask (0 = upper bound only)
  c.correction.geo_high = 0.0  # C_high of geo_mask (0 = use `cap`)

  c.kl = ml_collections.ConfigDict()
  c.kl.name = "k3"  # §4 estimator: k1 | k2 | k3 | k3_is
  c.kl.beta = 0.0  # β; 0 removes the reference model (no reference forward pass)
  c.kl.placement = "loss"  # loss: β·aggregate(k) in the loss | reward: k1 subtracted from rewards
  c.kl.reference = "frozen"  # frozen | reset_every | ema
  c.kl.reset_every = 0  # N: copy the policy into the reference every N steps (reset_every)
  c.kl.ema = 0.0  # α: π_ref ← α π_θ + (1 − α) π_ref after every step (ema)
  c.kl.reset_optimizer = False  # also reset optimiser state at each reference reset
  c.kl.k3_clamp = 0.0  # clip the k3 value to [-c, c] (0 = off, the spec; verl's low_var_kl uses 10)

  c.shaping = ml_collections.ConfigDict()
  c.shaping.name = "none"  # §6: none | soft_overlong (DAPO length penalty as a reward term)
  c.shaping.cache_len = 2  # L_cache of the soft overlong punishment (tokens)
  c.shaping.weight = 1.0  # weight of the overlong reward term
  c.shaping.overlong_filter = False  # truncated completions get no gradient (§6)
  c.shaping.overlong_in_group_stats = True  # filtered truncated ones stay in group stats

  c.replay = ml_collections.ConfigDict()
  c.replay.name = "none"  # §9 routing replay (MoE): none | r2 (old-policy mask) | r3 (sampler mask)

  c.filtering = ml_collections.ConfigDict()
  c.filtering.name = "none"  # §7: none | dynamic_sampling | reinforce_rej
  c.filtering.oversample = 2.0  # k: dynamic sampling draws ceil(k * P) prompt groups, keeps P

  c.optim = ml_collections.ConfigDict()
  c.optim.learning_rate = 3e-4  # peak AdamW learning rate of the RL phase
  c.optim.warmup_steps = 10  # linear warmup (optimiser updates)
  c.optim.decay_to = 0.1  # cosine decays to this fraction of the peak
  c.optim.weight_decay = 0.0  # AdamW decoupled weight decay
  c.optim.b1 = 0.9  # Adam β1
  c.optim.b2 = 0.99  # Adam β2
  c.optim.grad_clip = 1.0  # global-norm gradient clipping (0 = off)

  c.sft = ml_collections.ConfigDict()
  c.sft.steps = 70  # supervised warm-start steps before RL (0 = none); logged in <workdir>/sft
  c.sft.batch_size = 64  # sequences per supervised step
  c.sft.learning_rate = 3e-3  # peak learning rate of the warm start

  c.train = ml_collections.ConfigDict()
  c.train.num_steps = 1000  # RL updates
  c.train.eval_every = 100  # held-out evaluation period (RL steps); also at start and end
  c.train.pass_k = 4  # k of the pass@k evaluation (sampled at τ_s)
  c.train.log_every = 10  # scalar summaries / progress line period
  c.train.checkpoint_every = 250  # orbax checkpoint period (RL steps); also at the end
  c.train.max_to_keep = 2  # checkpoints kept on disk (>= 1)
  c.train.max_skipped_updates = 10  # stop after this many consecutive non-finite updates
  c.train.text_samples = 8  # completions shown in the TensorBoard text summary
  c.train.stop_after_steps = 0  # end this invocation after N steps (time-limited jobs; 0 = off)
  c.train.profile_steps = 0  # trace N RL steps after the compiling one (TensorBoard Profile tab)

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1  # data-parallel devices (-1 = all the other axes leave)
  c.mesh.fsdp = 1  # fully-sharded data parallel: params + optimiser state split (-1 = all left)
  c.mesh.expert = 1  # expert-parallel devices (the `expert` logical axis)
  c.mesh.model = 1  # tensor-parallel devices
  c.mesh.rules = ()  # logical->mesh axis rules, e.g. (("mlp", "model"),); () = built-in table
  return c
