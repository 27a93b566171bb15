"""What the README says the terminal shows, read from real command-line runs: the banner's
workdir and TensorBoard command and a MoE model's active parameters, the progress line's values
against the scalars in TensorBoard, the closing summary's evaluation and paths, and what a
relaunch of a finished workdir prints. (The banner's first place, the compilation lines and the
bare lines under a pseudo-terminal are in tests/test_train.py.)"""

import re
import subprocess
import sys

import pytest
from conftest import REPO, TINY_CLI, cli_env

from jaxrl_llm import metrics

TINY = (*TINY_CLI, "--config.sft.steps=0")
MOE = (
  "--config.model.moe_num_experts=4",
  "--config.model.moe_top_k=2",
  "--config.model.moe_expert_mlp_dim=32",
  "--config.model.num_layers=2",
  "--config.model.moe_every=2",
)
PROGRESS = re.compile(r"step (\d+)/(\d+) \((\d+)%\) \S+ steps/s ETA \S+ \| (.*)$")


def _run(workdir, *args) -> list[str]:
  """The lines a command-line run prints (absl's prefix removed), after checking it ended well."""
  cmd = [sys.executable, "-m", "jaxrl_llm.main", "--config=configs/default.py"]
  cmd += [f"--workdir={workdir}", *TINY, *args]
  proc = subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return [re.sub(r"^[IWE]\d{4} [\d:.]+ +\d+ \S+:\d+\] ", "", x) for x in proc.stderr.splitlines()]


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
  """(workdir, lines of a 4-step run logging every 2 and evaluating every 2, lines of its
  relaunch once finished)."""
  workdir = tmp_path_factory.mktemp("dense") / "run"
  args = ("--config.train.num_steps=4", "--config.train.log_every=2", "--config.train.eval_every=2")
  return workdir, _run(workdir, *args), _run(workdir, *args)


def test_the_banner_names_the_workdir_and_the_tensorboard_command(dense):
  """After the banner: the workdir and `tensorboard --logdir <workdir>`; the dense model's count
  has no active-per-token part."""
  workdir, lines, _ = dense
  assert f"workdir {workdir} | watch it: tensorboard --logdir {workdir}" in lines
  banner = next(x for x in lines if x.startswith("jaxrl_llm "))
  assert "M parameters" in banner and "active per token" not in banner


def test_the_progress_lines_show_the_scalars_written_to_tensorboard(dense):
  """A progress line every `train.log_every` updates: step, total, percent, and the short names
  (reward, acc, len, ent, clip) with the values TensorBoard holds at that step, to 3 digits."""
  workdir, lines, _ = dense
  scalars = {k: dict(v) for k, v in metrics.read_scalars(str(workdir)).items()}
  progress = [PROGRESS.search(x) for x in lines]
  progress = [m for m in progress if m]
  assert [(int(m[1]), int(m[2]), int(m[3])) for m in progress] == [(2, 4, 50), (4, 4, 100)]
  for m in progress:
    shown = dict(zip(*[iter(m[4].split())] * 2))  # "reward 0.5 acc 0.25 ..." → {name: value}
    assert list(shown) == ["reward", "acc", "len", "ent", "clip"], m[0]
    for short, tag in {v: k for k, v in metrics.SHORT_NAMES.items()}.items():
      if short in shown:
        assert shown[short] == f"{scalars[tag][int(m[1])]:.3g}", (m[0], tag)


def test_the_summary_gives_rates_evaluations_and_where_things_are(dense):
  """The closing lines: steps 0..4 with steps/s and generated tokens/s, each evaluation tag from
  the first evaluation (step 0) to the last (step 4) as TensorBoard has them, the checkpoints'
  and events' places, then `final eval: ...; wall time ...; workdir ...`."""
  workdir, lines, _ = dense
  trained = next(x for x in lines if x.startswith("trained RL steps 0..4 in "))
  rates = re.search(r"\| (\S+) steps/s, (\S+) generated tokens/s after the first", trained)
  assert rates and float(rates[1]) > 0 and float(rates[2]) > 0, trained
  evals = next(x for x in lines if x.startswith("eval from step 0 to 4: "))
  scalars = metrics.read_scalars(str(workdir))
  pairs = {k: (a, b) for k, a, b in re.findall(r"(\S+) (\S+) -> ([^,\s]+)", evals)}
  eval_tags = {k for k in scalars if k.startswith("eval/")}
  assert {f"eval/{k}" for k in pairs} == eval_tags and len(eval_tags) >= 4
  for tag in eval_tags:
    first, last = scalars[tag][0], scalars[tag][-1]
    assert (first[0], last[0]) == (0, 4)
    assert pairs[tag[5:]] == (f"{first[1]:.3g}", f"{last[1]:.3g}"), tag
  ckpts = workdir / "checkpoints"
  place = f"checkpoints in {ckpts} | events in {workdir}: tensorboard --logdir {workdir}"
  assert place in lines and (ckpts / "4").is_dir()
  final = lines[-1]
  assert final.startswith("final eval: ") and final.endswith(f"; workdir {workdir}"), final
  assert f"accuracy={scalars['eval/accuracy'][-1][1]:.4g}" in final and "; wall time " in final


def test_a_relaunched_finished_workdir_says_so_and_prints_its_final_evaluation(dense):
  """Relaunched once finished: a line naming the step it holds and train.num_steps, no
  training, and the same recorded final evaluation as the run's own last line."""
  workdir, lines, again = dense
  assert f"{workdir} already holds step 4 of train.num_steps=4: nothing to train" in again
  assert not [x for x in again if PROGRESS.search(x) or x.startswith("trained RL steps")]
  strip = lambda line: line.split("; wall time")[0]  # noqa: E731
  assert strip(again[-1]) == strip(lines[-1]) and again[-1].startswith("final eval: eval/")


def test_a_moe_banner_gives_the_parameters_active_per_token(tmp_path):
  """A mixture-of-experts model (4 experts, top 2): the banner gives the total and, fewer, the
  parameters one token uses."""
  lines = _run(tmp_path / "moe", *MOE, "--config.train.num_steps=1", "--config.train.eval_every=1")
  banner = next(x for x in lines if x.startswith("jaxrl_llm "))
  got = re.search(r"([\d.]+)M parameters \(([\d.]+)M active per token\)", banner)
  assert got and 0 < float(got[2]) < float(got[1]), banner
