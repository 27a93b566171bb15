"""A pack as the one loop (`run.loop.train`) trains it: `PackedRuns`, `train_pack` and
`take_out`. Each run's events, evaluations and summary are in `ROOT/<name>`, the pack's
checkpoints (and a profile trace) in `ROOT`."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from absl import logging

from jaxrl_llm import checkpoint as ckpt_lib
from jaxrl_llm import distributed, paths, sharding
from jaxrl_llm.config import Config, ConfigError
from jaxrl_llm.run.assemble import run_meta, verify_on_host
from jaxrl_llm.run.loop import Member, restore, train
from jaxrl_llm.run.pack import (
  Pack,
  PackIterator,
  batch_to_device,
  build_pack,
  own_runs,
  pack_iterator,
  packed_keys,
  per_run_sharding,
  put_run,
  to_rows,
  unstack,
)
from jaxrl_llm.run.warm_start import warm_start


class PackedRuns:
  """The runs of a pack as the loop trains them: one member per run, one program over the
  runs axis, the pack's checkpoints (every run's state and data position) in `root`."""

  resume_keys = ("model", "pack", "base")  # the checkpoint meta a resume must match

  def __init__(self, pack: Pack, root: str):
    self.pack, self.exp, self.root = pack, pack.exp, root
    self.members = [
      Member(name, pack.run(r), paths.join(root, name)) for r, name in enumerate(pack.names)
    ]
    self.varied = pack.varied  # fields that differ between the members
    runs = f"{pack.size} runs" if pack.size > 1 else "one run"
    self.intro = f"a pack of {runs} varying {', '.join(pack.varied) or 'nothing'}"
    keys = [np.asarray(jax.random.PRNGKey(c.seed + 7)) for c in pack.configs]  # a run's own
    self.eval_keys = jax.device_put(np.stack(keys), per_run_sharding(self.exp.mesh))
    self.stopped: dict[int, Any] = {}  # run -> its state when it stopped, kept from then on

  def hold(self, r: int, state) -> None:
    """Keeps run `r`'s parameters and optimiser state as they are in `state` from now on (a
    run stopped by its guards; the others go on)."""
    self.stopped[r] = unstack(state, r)

  def held(self, state):
    """`state` with every stopped run put back as it stopped."""
    for r, own in self.stopped.items():
      state = put_run(state, own, r)
    return state

  def meta(self) -> dict:
    """What the pack's checkpoints record (`Pack.meta`)."""
    return self.pack.meta()

  def fresh_state(self):
    """Every run's fresh state, stacked (no reference copy yet)."""
    return self.pack.state

  def warm_started(self):
    """Every run's state after the supervised warm start, run once per seed (it depends on
    nothing else a pack may vary); its events are in the first such run's `sft` folder."""
    pack, by_seed, states = self.pack, {}, []
    for r, cfg in enumerate(pack.configs):
      own = unstack(pack.state, r, pack.exp.state_shardings)
      if cfg.seed not in by_seed:
        view = dataclasses.replace(pack.run(r), state=own)
        by_seed[cfg.seed] = warm_start(view, self.members[r].workdir).params
      states.append(own.replace(params=by_seed[cfg.seed]))
    return pack.stacked(states)

  def step_of(self, state) -> int:
    """The pack's step (its runs step together), read from this process's own runs."""
    return int(distributed.local_block(state.step)[0])

  def data(self) -> PackIterator:
    """This process's share of every run's prompts (`pack_iterator`)."""
    return pack_iterator(self.pack)

  def update(self, state, np_batch: dict, step: int):
    """Every run's RL update: (state, [each run's host metrics])."""
    keys = packed_keys(state.rng, step)
    update = _host_reward_update if self.exp.task.rewards_on_host else _fused_update
    state, host = update(self.pack, state, np_batch, keys)
    return state, [{k: v[r] for k, v in host.items()} for r in range(self.pack.size)]

  def evaluate(self, params, batch, answers) -> list[dict]:
    """Each run's held-out evaluation of its `params` (stacked), in one program."""
    m = self.exp.eval_fn(params, batch, self.eval_keys, answers, self.pack.values)
    m = jax.device_get(m)
    return [{k: v[r] for k, v in m.items()} for r in range(self.pack.size)]


def _fused_update(pack: Pack, state, np_batch: dict, keys):
  """Every run's RL update in the pack's fused step; returns (state, host metrics [R])."""
  batch = batch_to_device(np_batch, pack.exp.mesh)
  state, metrics = pack.exp.program.step(state, batch, keys, pack.values)
  return state, distributed.host_values(metrics)  # rows gathered from every process


def _host_reward_update(pack: Pack, state, np_batch: dict, keys):
  """Every run's RL update with host verifiers: the packed sampler, then each run's decoded
  completions scored against its own prompts' answers, then the packed learner (as
  `host_reward_step` does for one run: each process scores its own rows, and the verifier
  counts are summed over processes); returns (state, host metrics [R])."""
  exp = pack.exp
  rollout = exp.program.sample(state, batch_to_device(np_batch, exp.mesh), keys, pack.values)
  tokens = distributed.local_block(rollout.tokens)  # [R_local, B_local, T]
  runs = own_runs(pack)
  answers = np_batch["answer"]
  scored = [verify_on_host(pack.run(r), tokens[i], answers[i]) for i, r in enumerate(runs)]
  terms = {k: np.stack([t[k] for t, _ in scored]) for k in scored[0][0]}
  terms = distributed.placed_like(terms, rollout.lengths, functools.partial(to_rows, mesh=exp.mesh))
  state, metrics = exp.program.learn(state, rollout, terms, keys, pack.values)
  host = distributed.host_values(metrics)
  names = sorted(scored[0][1])
  own = np.zeros((pack.size, len(names)), np.float64)  # runs of other processes count 0 here
  own[runs.start : runs.stop] = [[s[k] for k in names] for _, s in scored]
  counts = distributed.summed(own)
  host.update({k: counts[:, i].astype(np.float32) for i, k in enumerate(names)})
  return state, host


def train_pack(
  configs: Sequence[Config],
  root: str,
  *,
  names: Sequence[str] | None = None,
  hparam_fields: Sequence[str] = (),
) -> dict[str, dict[str, float]]:
  """Trains the runs `configs` (their `Config`s) as one pack in `root`, resuming from its
  latest checkpoint; returns each run's last evaluation by name. `hparam_fields`: fields to
  list in the HParams view before the varied ones and the declared columns."""
  started = time.time()
  pack = build_pack(configs, names)
  try:
    for cfg in pack.configs:  # every process started with the same grid
      distributed.check_same_config(cfg)
  except ValueError as err:
    raise ConfigError(str(err)) from None
  return train(PackedRuns(pack, root), hparam_fields=hparam_fields, started=started)


def take_out(
  configs: Sequence[Config],
  root: str,
  name: str,
  workdir: str,
  *,
  names: Sequence[str] | None = None,
) -> int:
  """Writes run `name` of the pack in `root` (built from `configs` and `names` as trained) as
  a single run's workdir: its events and config, and its state and data position at the
  pack's newest checkpoint, which `train_and_evaluate(its config, workdir)` (or the command
  line) continues alone. Returns that step; nothing in `root` changes."""
  pack = build_pack(configs, names)
  if name not in pack.names:
    raise ConfigError(f"the pack in {root} has no run {name!r}; its runs: {pack.names}")
  r, tr = pack.names.index(name), pack.configs[0].train
  if len(own_runs(pack)) < pack.size:
    raise ConfigError(
      f"take_out needs every run's data position in each process; mesh.runs="
      f"{pack.exp.mesh.shape[sharding.RUNS_AXIS]} spreads the runs over the processes: take a run out "
      "on one process (or from a pack trained with mesh.runs=1)"
    )
  runs = PackedRuns(pack, root)
  data = runs.data()
  with ckpt_lib.Checkpointer(root, save_every=tr.checkpoint_every) as ckpt:
    state = restore(runs, ckpt, data)
  if state is None:
    raise ConfigError(f"{root} holds no checkpoint of this pack to take run {name!r} out of")
  step, cfg = runs.step_of(state), pack.configs[r]
  shardings = pack.exp.state_shardings
  if state.ref_params is not None:
    shardings = shardings.replace(ref_params=shardings.params)
  own = unstack(state, r, shardings)
  for f in paths.files_under(paths.join(root, name)):  # its events, config and warm start
    target = paths.as_path(workdir) / f.relative_to(paths.as_path(paths.join(root, name)))
    target.parent.mkdir(parents=True, exist_ok=True)
    f.copy(target, overwrite=True)
  meta = run_meta(cfg, pack.exp.model.cfg)
  with ckpt_lib.Checkpointer(workdir, save_every=tr.checkpoint_every) as out:
    out.save(step, pack.exp.stored(own), data_iter=data.iterators[r], meta=meta, force=True)
  logging.info("took run %s out of the pack in %s at step %d into %s", name, root, step, workdir)
  return step
