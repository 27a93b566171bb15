"""An objective from outside the package, with a hyperparameter of a name no built-in objective
has (`tilt`): importing this module is all it takes to train it and to set `tilt` from the
command line (tests/fixtures/plugin_config.py imports it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm import objectives


@objectives.register_objective(
  "tilted_pg", docs={"tilt": "τ of tilted_pg: J = (1 + τ)·r·A (an example plug-in's scale)"}
)
def tilted_pg(logp, old_logp, adv, mask, *, tilt: float = 0.0):
  """J = (1 + τ)·r·A: an importance-weighted policy gradient scaled by its `tilt`."""
  m = mask.astype(jnp.float32)
  delta = jnp.where(m > 0, logp - jax.lax.stop_gradient(old_logp), 0.0)
  a = adv[:, None] * m if adv.ndim == 1 else adv * m
  j = (1.0 + tilt) * jnp.exp(delta) * a
  no = jnp.zeros_like(m)
  diag = {"ratio": jnp.exp(delta), "log_ratio": delta, "is_clipped_low": no, "is_clipped_high": no}
  diag["tilt"] = jnp.full_like(m, tilt)
  return j, jax.tree.map(jax.lax.stop_gradient, diag)
