"""DAPO (spec §10) on GSM8K from a local Qwen2.5 checkpoint.

Point it at your files:

  python -m jaxrl_llm.main --config=configs/qwen2_5_gsm8k_dapo.py --workdir=/tmp/gsm8k \\
      --config.model.checkpoint=/models/Qwen2.5-1.5B-Instruct \\
      --config.data.train_files=/data/gsm8k/train.jsonl \\
      --config.data.eval_files=/data/gsm8k/test.jsonl

GSM8K records look like {"question": ..., "answer": "... #### 42"}; the verifier compares the
completion's final answer with the number after `####`.
"""

import ml_collections

from jaxrl_llm.config import recipes


def get_config():
  """DAPO + GSM8K + Qwen2.5 settings (paths must be given on the command line)."""
  c = recipes.get_config("dapo")
  c.model.checkpoint = "REQUIRED"  # a local Qwen2.5 Hugging Face directory
  c.model.dtype = "bfloat16"  # compute dtype; log-probs stay float32
  c.data.train_files = "REQUIRED"  # GSM8K train JSONL
  c.data.eval_files = ""  # GSM8K test JSONL (or set data.eval_fraction)
  c.data.prompt_field = "question"
  c.data.answer_field = "answer"
  c.data.template = "qwen_math_chat"
  c.data.prompt_len = 256
  c.data.correct_term = "gsm8k_correct"
  c.task.reward_weights = ml_collections.ConfigDict({"gsm8k_correct": 1.0})
  c.task.eval_size = 512
  c.sampling.max_new_tokens = 512
  c.sampling.temperature = 1.0
  c.sampling.group_size = 8
  c.shaping.cache_len = 128  # DAPO soft overlong punishment over the last 128 tokens
  c.rl.num_prompts = 64
  c.rl.num_minibatches = 8
  c.rl.num_microbatches = 4
  c.sft.steps = 0
  c.optim.learning_rate = 1e-6
  c.optim.warmup_steps = 10
  c.optim.weight_decay = 0.01
  c.optim.decay_to = 1.0
  c.train.num_steps = 500
  c.train.eval_every = 25
  c.train.log_every = 1
  c.train.checkpoint_every = 25
  c.train.pass_k = 4
  return c
