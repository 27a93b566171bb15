"""The learner: the fused RL update and its parts (spec §0-§9, §11).

step.py      make_rl_step: the jitted programs and `learn`, the stages in the spec's order
stages.py    reward, filtering, old / reference passes, advantages, behaviour weight, batch
update.py    epochs × minibatches × microbatches of optimiser steps; the reference policy
loss.py      the microbatch loss
metrics.py   rollout, routing and step metrics
(its settings, `Settings`, are the learner's sections of the tree in jaxrl_llm/config/learner.py)
"""

from jaxrl_llm.config.learner import Settings
from jaxrl_llm.rl.step import Learner, RLProgram, make_rl_step
from jaxrl_llm.rl.update import init_reference

__all__ = ["Learner", "RLProgram", "Settings", "init_reference", "make_rl_step"]
