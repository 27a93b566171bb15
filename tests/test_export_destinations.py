"""`tools/hf_convert.py export` never writes where it would destroy what a run depends on: the
Hugging Face checkpoint a run started from (its model.checkpoint, its adapters' base) and a
trainer's checkpoints/ are refused as --out or --adapters, --overwrite or not; a packed sweep
(its root or a run folder of it) is named as one. Each refusal is one `error:` line, exit 2, and
the protected files stay byte-identical. Run through the real command line."""

import dataclasses
import json
import pathlib
import shutil
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from conftest import REPO, cli_env, save_trainer_checkpoint

from jaxrl_llm.models import ModelConfig, hf, lora

LLAMA = REPO / "tests" / "fixtures" / "hf" / "llama"


def _filled(cfg: ModelConfig, value: float):
  """Parameters of `cfg` all equal to `value` (no model is initialised: nothing to compile)."""
  abstract = nn.unbox(hf.abstract_params(cfg))
  return jax.tree.map(lambda x: jnp.full(x.shape, value, x.dtype), abstract)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
  """(workdir, base): a run with adapters on a copy of the llama fixture, recorded both as the
  run's model.checkpoint (config.json) and as its adapters' base (the checkpoint meta)."""
  root = tmp_path_factory.mktemp("lsrc")
  base = root / "llama"
  shutil.copytree(LLAMA, base)
  cfg = dataclasses.replace(hf.load_checkpoint(base)[0], lora_rank=4)
  adapters = jax.tree.map(lambda x: x + 0.01, lora.split_adapters(_filled(cfg, 0.0))[1])
  meta = {
    "model": cfg.to_dict(),
    "hf_model_type": "llama",
    "base": {"checkpoint": str(base), "digest": hf.weights_digest(base)},
  }
  record = {"config": {"model": {"checkpoint": str(base)}, "data": {"tokenizer": ""}}}
  save_trainer_checkpoint(root / "run", adapters, meta, record)
  return root / "run", base


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
  """The root of a packed sweep of runs seed=0 and seed=1: one checkpoint of both runs'
  stacked parameters in ROOT/checkpoints (meta 'pack', as `Pack.meta` writes it) and a folder
  of each run's own (its run record, no checkpoints)."""
  root = tmp_path_factory.mktemp("pack")
  cfg = ModelConfig(vocab_size=24, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=48)
  params = jax.tree.map(lambda a, b: jnp.stack([a, b]), _filled(cfg, 0.5), _filled(cfg, 1.0))
  names = ["seed=0", "seed=1"]
  meta = {"model": cfg.to_dict(), "pack": {"names": names, "runs": [{"seed": 0}, {"seed": 1}]}}
  save_trainer_checkpoint(root, params, meta)
  for seed, name in enumerate(names):
    (root / name).mkdir()
    (root / name / "config.json").write_text(json.dumps({"config": {"seed": seed}}))
  return root


def _tree(root: pathlib.Path) -> dict[str, bytes | None]:
  """Every path under `root` with its bytes (None for a directory)."""
  return {str(p): p.read_bytes() if p.is_file() else None for p in root.rglob("*")}


def _refused(*argv: str) -> str:
  """Runs `tools/hf_convert.py export ARGV`, which must exit 2 with one `error:` line on stderr
  and nothing on stdout; returns that line."""
  proc = subprocess.run(
    [sys.executable, "tools/hf_convert.py", "export", *argv],
    cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300,
  )  # fmt: skip
  lines = proc.stderr.splitlines()
  assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
  assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
  assert proc.stdout == ""
  return lines[0]


@pytest.mark.parametrize("source", ["none", "copy"])
def test_out_is_never_the_run_s_recorded_checkpoint(lora_run, tmp_path, source):
  """--out naming the run's model.checkpoint (its adapters' base) is refused with --overwrite
  also when --hf_source is none or another directory (it compared --out with the source only,
  so the base's weights were replaced and the run could not be resumed or exported)."""
  workdir, base = lora_run
  hf_source = "none"
  if source == "copy":
    hf_source = str(shutil.copytree(LLAMA, tmp_path / "copy"))
  before = _tree(base)
  line = _refused(
    f"--workdir={workdir}", f"--out={base}", f"--hf_source={hf_source}", "--overwrite"
  )
  assert line.startswith(f"error: --out={base}: is the Hugging Face checkpoint"), line
  assert "model.checkpoint" in line and "name another --out" in line, line
  assert _tree(base) == before


@pytest.mark.parametrize("inside", [False, True])
def test_adapters_are_never_written_into_the_run_s_base(lora_run, tmp_path, inside):
  """--adapters naming the run's base checkpoint (or a folder inside it) is refused before
  anything is written: adapter_model.safetensors there changed the base's weights digest."""
  workdir, base = lora_run
  adapters = base / "peft" if inside else base
  before = _tree(base)
  out = tmp_path / "out"
  line = _refused(f"--workdir={workdir}", f"--out={out}", f"--adapters={adapters}")
  assert line.startswith(f"error: --adapters={adapters}: "), line
  assert str(base) in line and "name another --adapters" in line, line
  assert _tree(base) == before and not out.exists()


@pytest.mark.parametrize("flag", ["--out", "--adapters"])
def test_nothing_is_written_into_a_trainer_s_checkpoints(lora_run, tmp_path, flag):
  """--out or --adapters inside a trainer workdir's checkpoints/ (the step exported, or a step
  not there yet) is refused with --overwrite too: the next launch found that step corrupt and
  trained it again."""
  workdir, _ = lora_run
  inside = workdir / "checkpoints" / ("3" if flag == "--out" else "9")
  out = inside if flag == "--out" else tmp_path / "out"
  extra = [f"--adapters={inside}"] if flag == "--adapters" else []
  before = _tree(workdir)
  line = _refused(f"--workdir={workdir}", f"--out={out}", *extra, "--overwrite")
  assert line.startswith(f"error: {flag}={inside}: "), line
  assert f"{workdir}/checkpoints" in line and f"name another {flag}" in line, line
  assert _tree(workdir) == before and not (tmp_path / "out").exists()


def test_a_link_into_a_trainer_s_checkpoints_is_followed(lora_run, tmp_path):
  """--out through a symbolic link to a workdir's checkpoints/ passed (the check read the path
  as written): the export landed as checkpoints/7, which the next launch found unfinished."""
  workdir, _ = lora_run
  (tmp_path / "link").symlink_to(workdir / "checkpoints")
  out, before = tmp_path / "link" / "7", _tree(workdir)
  line = _refused(f"--workdir={workdir}", f"--out={out}")
  assert line.startswith(f"error: --out={out}: "), line
  assert f"{workdir}/checkpoints" in line and "name another --out" in line, line
  assert _tree(workdir) == before


@pytest.mark.parametrize("run", ["", "seed=0"])
def test_a_packed_sweep_is_named_as_one(pack, tmp_path, run):
  """--workdir naming a packed sweep's root, or one of its run folders, says it is a pack and
  how to export one run (take it out of the pack), not a misshaped parameter or a missing
  checkpoints/."""
  workdir = pack / run if run else pack
  before = _tree(pack)
  line = _refused(f"--workdir={workdir}", f"--out={tmp_path / 'out'}")
  assert line.startswith(f"error: --workdir={workdir}: "), line
  assert "packed sweep" in line and "take_out" in line, line
  assert "shape" not in line and "no checkpoints/" not in line, line
  assert _tree(pack) == before and not (tmp_path / "out").exists()
