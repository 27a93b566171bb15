"""Compile-only: one guarded optimiser step of Qwen2.5-7B's state (float32 parameters and Adam
state, scanned layers, fsdp over a TPU v5p-8 through libtpu; nothing runs), with the update held
for its check and computed twice: temp and XLA's bytes accessed and FLOPs per chip, one JSON
line each (optimizer_step_7b_tpu.jsonl).

  python docs/cpu_runs/guard_memory/optimizer_step_7b_tpu.py > optimizer_step_7b_tpu.jsonl
"""

import json
import os
import pathlib
import sys

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
REPO = pathlib.Path(__file__).resolve().parents[3]
sys.path[:0] = [str(REPO), str(REPO / "tools")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import memory_table  # noqa: E402

from jaxrl_llm import optim, plan, run  # noqa: E402
from jaxrl_llm.config import parse  # noqa: E402

OVERRIDES = ["model.scan_layers=true", "sampling.param_dtype=bfloat16"]


def main() -> None:
  """Print the two forms' JSON lines."""
  devices = plan.tpu_slice_devices("v5p:2x2x1")
  config = parse(memory_table.row_config("qwen2.5-7b", "tpu:v5p-8", OVERRIDES, 4096))
  exp = run.build(config, abstract=True, devices=devices, prompt_len=512)
  tx, state = exp.program.learner.optimizer, exp.state
  repl = jax.sharding.NamedSharding(exp.mesh, jax.sharding.PartitionSpec())
  loss = jax.ShapeDtypeStruct((), jnp.float32, sharding=repl)
  for twice in (False, True):

    def step(g, s, p, lo, twice=twice):
      return optim.guarded_update(tx, g, s, p, lo, recompute=twice)

    lowered = jax.jit(step, donate_argnums=(1, 2)).lower(
      state.params, state.opt_state, state.params, loss
    )
    compiled = lowered.compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    memory = compiled.memory_analysis()
    row = {
      "form": "twice" if twice else "held",
      "devices": "TPU v5p-8 (4 chips), fsdp 4",
      "argument_gib": memory.argument_size_in_bytes / 2**30,
      "temp_gib": memory.temp_size_in_bytes / 2**30,
      "bytes_accessed_gib": cost.get("bytes accessed", float("nan")) / 2**30,
      "flops": cost.get("flops"),
    }
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
  main()
