"""The supervised warm start: prompt → reference answer, before RL, logged as its own run."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from absl import logging
from jax.sharding import PartitionSpec as P

from jaxrl_llm import distributed, paths, sharding, sigterm
from jaxrl_llm import metrics as metrics_lib
from jaxrl_llm.models import lora
from jaxrl_llm.optim import applied_rate, guarded_update
from jaxrl_llm.rl import update
from jaxrl_llm.run.assemble import Experiment, to_global_batch
from jaxrl_llm.run.guard import SkipGuard
from jaxrl_llm.run.preempt import Preempted
from jaxrl_llm.sampling import score
from jaxrl_llm.types import TrainState


def _sft_step(exp: Experiment, tx, state_shardings):
  """The jitted supervised update `(params, opt_state, batch, rng, step) -> (params, opt_state,
  loss, skipped)`: mean negative log-likelihood of the answer tokens, guarded. `rng` (the run's
  key, given when `model.lora_dropout` > 0) and `step` give the adapters' dropout key of the
  update; `rng` None: no dropout, no key made. Parameters and optimiser state come out in
  `state_shardings` (theirs going in: the RL step takes the parameters as the state holds them)."""
  model = exp.model

  def loss_fn(params, batch, dropout_key):
    tokens, mask, answer = batch.tokens, batch.mask, batch.answer
    logp = score(model, params, tokens, mask, answer, 1.0, dropout_key=dropout_key).logp
    m = batch.answer_mask.astype(jnp.float32)
    return -jnp.sum(logp * m) / jnp.maximum(jnp.sum(m), 1.0)

  def sft_update(params, opt_state, batch, rng=None, step=0):
    key = None
    if rng is not None:  # fold_in(fold_in(rng, DROPOUT_STREAM), step): a key per update
      key = jax.random.fold_in(update.adapter_dropout_key(model.cfg, rng), step)
    frozen, trained = lora.trainable(params)  # the adapters alone, when the model has them
    on_base = lambda p, b: loss_fn(lora.with_frozen(frozen, p), b, key)  # noqa: E731
    loss, grads = jax.value_and_grad(on_base)(trained, batch)
    trained, opt_state, skipped = guarded_update(tx, grads, opt_state, trained, loss)
    return lora.with_frozen(frozen, trained), opt_state, loss, skipped

  out_shardings = (*state_shardings, *2 * [jax.sharding.NamedSharding(exp.mesh, P())])
  traced = sharding.traced_with_rules(sft_update, exp.mesh, exp.rules)
  jitted = jax.jit(traced, out_shardings=out_shardings)
  return distributed.program(jitted, "sft-update", "the warm start's update")


def warm_start(exp: Experiment, workdir: str) -> TrainState:
  """Supervised warm start on prompt → reference answer (`sft.steps` steps).

  Logged under `sft/` in its own TensorBoard run, `<workdir>/sft`, with its own step axis
  (1..sft.steps): RL steps in `<workdir>` then start at 0 and compare cleanly across runs.
  """
  cfg = exp.config
  steps, log_every = cfg.sft.steps, cfg.train.log_every
  tx, schedule = cfg.sft.optimizer(cfg.optim).build(steps)
  index, count = distributed.shard_of(exp.batch_sharding, (cfg.sft.batch_size,), 0)
  it = exp.task.train_iterator(
    cfg.sft.batch_size // count,
    cfg.seed + 1,
    shard_index=index,
    shard_count=count,
    setting=f"sft.batch_size={cfg.sft.batch_size}",
  )
  params = exp.state.params
  trained = lora.trainable(params)[1]
  opt_state = sharding.init_opt_state(
    tx, trained, jax.tree.map(lambda x: x.sharding, trained), exp.mesh
  )
  shardings = jax.tree.map(lambda x: x.sharding, (params, opt_state))
  sft_step = _sft_step(exp, tx, shardings)
  progress = TrainState(jnp.zeros((), jnp.int32), params, opt_state, None, exp.state.rng)
  saved = _SFTProgress(exp, workdir, progress, it)
  progress, first = saved.restored()
  params, opt_state = progress.params, progress.opt_state
  t0, guard = time.time(), SkipGuard(cfg.train.max_skipped_updates, "sft")
  writer = metrics_lib.SummaryWriter(paths.join(workdir, "sft"))
  writer.restart(first + 1)  # a resumed warm start: what its stopped launch logged past it goes
  logging.info(
    "supervised warm start: %d steps (events in %s); its first step includes compilation ...",
    steps,
    writer.logdir,
  )
  rng = exp.state.rng if exp.model.cfg.lora_dropout else None  # adapter dropout's base key
  for i in range(first, steps):
    batch = to_global_batch(next(it), exp.batch_sharding)
    params, opt_state, loss, skipped = sft_step(params, opt_state, batch, rng, i)
    guard.update(i + 1, int(skipped), updates=1)
    if (i + 1) % log_every == 0 or i + 1 == steps:
      loss = float(loss)
      scalars = {"sft/loss": loss, "sft/learning_rate": float(applied_rate(schedule, opt_state))}
      scalars["sft/skipped_updates"] = float(guard.total)
      writer.scalars(i + 1, scalars)
      guard.finite_metrics(scalars)
      logging.info("sft %d/%d loss %.4f (%.1fs)", i + 1, steps, loss, time.time() - t0)
    if sigterm.seen() and i + 1 < steps:  # a preemption notice: keep what is done
      writer.close()
      saved.save(i + 1, progress.replace(params=params, opt_state=opt_state))
  writer.close()
  sigterm.unsaved(steps > 0)  # its result is in no checkpoint until `loop` saves it as step 0
  return exp.state.replace(params=params)


class _SFTProgress:
  """The warm start's progress in `<workdir>/sft/checkpoints`, saved when a SIGTERM stops it
  (parameters, or under adapters the adapters alone; optimiser state; data position) and
  restored by the next launch, which goes on from there."""

  def __init__(self, exp: Experiment, workdir: str, fresh: TrainState, data):
    self.exp, self.fresh, self.data = exp, fresh, data
    self.folder = paths.join(workdir, "sft")

  def restored(self) -> tuple[TrainState, int]:
    """(the saved progress, its step), or (the fresh state, 0) when there is none."""
    from jaxrl_llm import checkpoint as ckpt_lib

    if not paths.is_dir(paths.join(self.folder, "checkpoints")):
      return self.fresh, 0
    stored = self.exp.stored(self.fresh)
    abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), stored
    )
    with ckpt_lib.Checkpointer(self.folder, save_every=0, async_save=False) as ckpt:
      got = ckpt.restore_latest(abstract, data_iter=self.data)
    if got is None:
      return self.fresh, 0
    step, state, _ = got
    logging.info("resuming the warm start after sft step %d (%s)", step, self.folder)
    return self.exp.from_stored(state), step

  def save(self, step: int, state: TrainState) -> None:
    """Saves `state` as sft step `step` and stops the run (`Preempted`, one line)."""
    from jaxrl_llm import checkpoint as ckpt_lib

    with ckpt_lib.Checkpointer(self.folder, save_every=0, async_save=False) as ckpt:
      ckpt.save(step, self.exp.stored(state), data_iter=self.data, meta={}, force=True)
    raise Preempted(
      step,
      self.folder,
      f"stopped by SIGTERM during the warm start after sft step {step}: its progress is saved "
      f"in {self.folder}/checkpoints; relaunch the same command to resume",
    )
