"""The embedded default experiment: a tiny transformer learns to reverse strings on a CPU.

Every config field of the trainer is defined (and commented) here; experiment files in
`configs/` start from `get_config()` and change what they need.

A short supervised warm start (70 steps) leaves the policy at roughly 0.15 held-out accuracy;
GRPO (spec §10 `grpo` without the KL term) then drives it above 0.9 within a few hundred
updates. The whole run takes under two minutes on two CPU cores.

  python -m jaxrl_llm.main --config=configs/default.py --workdir=/tmp/jaxrl_default
"""

import ml_collections


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
  c.data.prompt_len = 256  # S: prompt tokens (longer prompts are filtered and counted)
  c.data.tokenizer = ""  # tokenizer dir or tokenizer.json ("" = model.checkpoint's)
  c.data.correct_term = "math_correct"  # host reward term that defines accuracy
  c.data.verifier_timeout_s = 5.0  # per-completion verifier time limit (failures score 0)

  c.model = ml_collections.ConfigDict()
  c.model.checkpoint = ""  # Hugging Face checkpoint dir to start from ("" = random init)
  c.model.vocab_size = 32  # token ids; must cover the task tokenizer's vocabulary
  c.model.d_model = 64  # residual width D
  c.model.num_layers = 2  # transformer blocks L
  c.model.num_heads = 4  # query heads H
  c.model.num_kv_heads = 2  # key/value heads J (grouped-query attention)
  c.model.head_dim = 16  # per-head width
  c.model.mlp_dim = 256  # SwiGLU hidden width
  c.model.rope_theta = 10_000.0  # RoPE base
  c.model.rope_scaling = "none"  # none | linear | llama3 (Llama 3.1 per-frequency scaling)
  c.model.rope_scaling_factor = 1.0  # context extension factor of linear / llama3 scaling
  c.model.rope_low_freq_factor = 1.0  # llama3: wavelengths > orig_len / this are fully scaled
  c.model.rope_high_freq_factor = 4.0  # llama3: wavelengths < orig_len / this are not scaled
  c.model.rope_original_max_len = 8192  # llama3: the pre-training context length
  c.model.norm_eps = 1e-6  # RMSNorm epsilon
  c.model.attention_bias = False  # q/k/v bias (Qwen2 style)
  c.model.qk_norm = False  # per-head RMSNorm of q and k (Qwen3 style)
  c.model.tie_embeddings = True  # share embedding and output matrices
  c.model.value_head = False  # scalar value head on the trunk (needed by ppo_critic)
  c.model.moe_num_experts = 0  # routed experts E per MoE layer (0 = dense feed-forward)
  c.model.moe_top_k = 2  # experts per token K
  c.model.moe_expert_mlp_dim = 64  # SwiGLU hidden width of each routed expert
  c.model.moe_every = 1  # every n-th layer is MoE (1 = all; layers n-1, 2n-1, ...)
  c.model.moe_num_shared_experts = 0  # always-on shared experts (DeepSeek / Qwen-MoE style)
  c.model.moe_shared_mlp_dim = 0  # hidden width of one shared expert (0 = moe_expert_mlp_dim)
  c.model.moe_normalize_gates = True  # renormalise the top-k gates to sum to 1
  c.model.moe_impl = "ragged"  # ragged (dropless grouped matmul) | dense (one-hot reference)
  c.model.moe_aux_loss_coef = 0.01  # load-balance loss coefficient (§8)
  c.model.moe_z_loss_coef = 0.001  # router z-loss coefficient (§8)
  c.model.dtype = "float32"  # compute dtype: float32 | bfloat16 | float16
  c.model.param_dtype = "float32"  # parameter storage dtype

  c.sampling = ml_collections.ConfigDict()
  c.sampling.group_size = 8  # G completions per prompt (>= 2 for group advantages)
  c.sampling.max_new_tokens = 0  # T completion budget; 0 = the task's default
  c.sampling.temperature = 1.0  # τ_s > 0; recorded log-probs are of logits / τ_s (§0)
  c.sampling.top_k = 0  # draw among the k most likely tokens (0 = off)
  c.sampling.top_p = 1.0  # nucleus sampling mass in (0, 1] (1 = off)

  c.sampling.param_dtype = "float32"  # sampler's copy of the policy: float32 | bfloat16 | int8

  c.rl = ml_collections.ConfigDict()
  c.rl.num_prompts = 32  # P prompts per RL update (B = P * G sequences)
  c.rl.num_epochs = 1  # passes over each rollout batch
  c.rl.num_minibatches = 2  # optimiser steps per epoch (B must divide evenly)
  c.rl.num_microbatches = 1  # gradient-accumulation slices per minibatch (same gradient, §5)
  c.rl.entropy_coef = 0.0  # c_e of the entropy bonus (§8)

  c.advantage = ml_collections.ConfigDict()
  c.advantage.name = "grpo"  # §1: grpo | mean_only | rloo | batch_std | reinforce_baseline | gae
  c.advantage.whiten = False  # whiten advantages over the batch
  c.advantage.gamma = 1.0  # GAE discount γ (gae only)
  c.advantage.lam = 0.95  # GAE λ (gae only)

  c.objective = ml_collections.ConfigDict()
  c.objective.name = (
    "ppo_clip"  # §2: ppo_clip | pg | gspo | gspo_token | gmpo | cispo | sapo | rspo | ppo_critic
  )
  c.objective.clip_low = 0.2  # ε_low: lower clip width of the ratio, in (0, 1)
  c.objective.clip_high = 0.2  # ε_high: upper clip width of the ratio, in (0, 1)
  c.objective.dual_clip = 0.0  # dual-clip constant c > 1 for A < 0 (ppo_clip; 0 = off)
  c.objective.clip_log = 0.4  # δ_c: log-space clip width (gmpo)
  c.objective.tau_pos = 1.0  # soft-gate temperature for A > 0 (sapo)
  c.objective.tau_neg = 1.05  # soft-gate temperature for A <= 0 (sapo)
  c.objective.cispo_mask = False  # drop clipped tokens of the unified mask (cispo)
  c.objective.gamma_min = 0.1  # γ_min floor of the router-shift weight (rspo)
  c.objective.value_coef = 0.5  # c_v of the clipped value loss (ppo_critic)
  c.objective.value_clip = 0.2  # ε_v of the clipped value loss (ppo_critic)

  c.aggregation = ml_collections.ConfigDict()
  c.aggregation.name = "seq_mean_token_mean"  # §5: token_mean | seq_mean_token_mean | seq_mean_token_sum | seq_mean_token_sum_norm | seq_mean

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

  c.shaping = ml_collections.ConfigDict()
  c.shaping.name = "none"  # §6: none | soft_overlong (DAPO length penalty as a reward term)
  c.shaping.cache_len = 2  # L_cache of the soft overlong punishment (tokens)
  c.shaping.weight = 1.0  # weight of the overlong reward term
  c.shaping.overlong_filter = False  # truncated completions get no gradient (stay in group stats)

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
  c.sft.steps = 70  # supervised warm-start steps before RL (0 = none); logged under sft/
  c.sft.batch_size = 64  # sequences per supervised step
  c.sft.learning_rate = 3e-3  # peak learning rate of the warm start

  c.train = ml_collections.ConfigDict()
  c.train.num_steps = 1000  # RL updates
  c.train.eval_every = 100  # held-out evaluation period (RL steps); also at start and end
  c.train.pass_k = 4  # k of the pass@k evaluation (sampled at τ_s)
  c.train.log_every = 10  # scalar summaries / progress line period
  c.train.checkpoint_every = 250  # orbax checkpoint period (RL steps); also at the end
  c.train.max_to_keep = 2  # checkpoints kept on disk
  c.train.text_samples = 8  # completions shown in the TensorBoard text summary
  c.train.stop_after_steps = 0  # end this invocation after N steps (time-limited jobs; 0 = off)

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1  # data-parallel devices (-1 = all not used by `model`)
  c.mesh.expert = 1  # expert-parallel devices (the `expert` logical axis)
  c.mesh.model = 1  # tensor-parallel devices
  c.mesh.rules = ()  # logical->mesh axis rules, e.g. (("mlp", "model"),); () = built-in table
  return c
