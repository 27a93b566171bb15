"""verl's GRPO defaults on the built-in task, to compare a run with one made in verl.

Follows verl 0.8.0.dev (main branch of January 2026, `verl/trainer/config/actor/actor.yaml`,
`verl/trainer/ppo/core_algos.py`) with its GRPO example settings; each line below names the
verl setting it reproduces. docs/conventions.md lists every place the two trainers differ.
What stays different: verl divides `seq-mean-token-sum-norm` losses by its gradient-accumulation
steps as well, and a group of one completion gets A = R there (0 here; groups here have G >= 2).
"""

from jaxrl_llm.config import recipes


def get_config():
  """The default config with verl's GRPO conventions."""
  config = recipes.get_config("grpo")
  recipes.apply(
    config,
    {
      "advantage.name": "grpo",  # algorithm.adv_estimator=grpo, norm_adv_by_std_in_grpo=True
      "advantage.whiten_variance": "unbiased",  # verl_F.masked_whiten, if whitening is turned on
      "objective.name": "ppo_clip",  # actor.policy_loss.loss_mode=vanilla
      "objective.clip_low": 0.2,  # actor.clip_ratio_low
      "objective.clip_high": 0.2,  # actor.clip_ratio_high
      "objective.dual_clip": 3.0,  # actor.clip_ratio_c (always on in verl)
      "aggregation.name": "token_mean",  # actor.loss_agg_mode=token-mean
      "aggregation.sum_norm_sequences": False,  # seq-mean-token-sum-norm's normaliser, if chosen
      "kl.name": "k3",  # actor.use_kl_loss=True, kl_loss_type=low_var_kl (GRPO examples)
      "kl.beta": 0.001,  # actor.kl_loss_coef
      "kl.placement": "loss",  # algorithm.use_kl_in_reward=False
      "kl.k3_clamp": 10.0,  # low_var_kl clamps the k3 value to [-10, 10]
      "rl.entropy_coef": 0.0,  # actor.entropy_coeff
      "rl.num_epochs": 1,  # actor.ppo_epochs
    },
  )
  return config
