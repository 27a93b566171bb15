"""tools/trl_arith.py: `configs/smollm2_arith.py` through TRL's GRPOTrainer.

A missing model directory is one `error:` line and exit status 2 (default tier, no model). The
slow tier trains SmolLM2-135M-Instruct with adapters for 2 updates at the smallest shape the
command line allows (1 prompt x 2 samples x 8 new tokens, 4 held-out problems) and checks the
JSON it writes: an evaluation at steps 0 and 2, finite values, and every setting not overridden
equal to the config's.
"""

import importlib.util
import json
import math
import subprocess
import sys

import pytest
from conftest import REPO, cli_env

SCRIPT = str(REPO / "tools" / "trl_arith.py")


def _run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, SCRIPT, *args],
    cwd=REPO,
    env=cli_env(),
    capture_output=True,
    text=True,
    timeout=timeout,
    check=False,
  )


def _config(setting: str):
  spec = importlib.util.spec_from_file_location("cfg_under_test", REPO / "configs/smollm2_arith.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(setting), module


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
  return lines[0]


def test_a_missing_model_directory_is_one_error_line(tmp_path):
  out = tmp_path / "out"
  proc = _run(
    "--setting=lora", "--steps=1", f"--out={out}", f"--model={tmp_path / 'no_model'}", timeout=120
  )
  line = _one_error_line(proc)
  assert str(tmp_path / "no_model") in line and "python tools/get_smollm2.py" in line
  assert not out.exists()


def test_an_unknown_setting_is_one_error_line(tmp_path):
  proc = _run("--setting=huge", f"--out={tmp_path}", timeout=120)
  assert "lora | full" in _one_error_line(proc)


@pytest.mark.parametrize("setting", ["tool", "full_tool", "calc", "full_calc"])
def test_a_tool_setting_is_refused_in_one_line(setting, tmp_path):
  """TRL's run has no tool here: the tool settings are ours alone, never run without it."""
  out = tmp_path / "out"
  no_model = f"--model={tmp_path / 'no_model'}"  # refused before the files are looked for
  proc = _run(f"--setting={setting}", "--steps=1", f"--out={out}", no_model, timeout=120)
  tool = _config(setting)[0].sampling.tool
  assert f"sampling.tool={tool!r} has no TRL counterpart" in _one_error_line(proc)
  assert not out.exists()


@pytest.mark.extended
def test_a_micro_run_writes_the_eval_curve_with_the_configs_settings(smollm2, tmp_path):
  for name in ("torch", "transformers", "trl", "peft", "datasets"):
    pytest.importorskip(name)
  from jaxrl_llm.data import arith

  hf_dir, _ = smollm2
  data = tmp_path / "arith"
  data.mkdir()
  train, held_out = arith.generate(64, 8, seed=0)
  for name, recs in (("train.jsonl", train), ("eval.jsonl", held_out)):
    (data / name).write_text("".join(json.dumps(r) + "\n" for r in recs))
  out = tmp_path / "out"
  proc = _run(
    "--setting=lora",
    "--steps=2",
    f"--out={out}",
    "--eval_size=4",
    f"--model={hf_dir}",
    f"--data={data}",
    "--num_prompts=1",
    "--group_size=2",
    "--max_new_tokens=8",
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  rec = json.loads((out / "trl_arith.json").read_text())
  print(json.dumps({k: rec[k] for k in ("eval", "runtime")}, indent=1)[:3000])
  assert rec["status"] == "done"

  assert [e["step"] for e in rec["eval"]] == [0, 2]
  for e in rec["eval"]:
    assert e["n"] == 4
    for key in ("accuracy", "format_rate", "length_mean", "wall_s"):
      assert math.isfinite(e[key]), (key, e)
    assert 0 <= e["accuracy"] <= 1 and 0 <= e["format_rate"] <= 1
    assert 1 <= e["length_mean"] <= 8
  assert [r["step"] for r in rec["steps"]] == [1, 2]
  for r in rec["steps"]:
    for key in ("wall_s", "generate_s", "reward", "accuracy", "format_rate"):
      assert r[key] is not None and math.isfinite(r[key]), (key, r)
    assert r["wall_s"] > r["generate_s"] > 0

  s = rec["settings"]
  assert s["overrides"] == {"num_prompts": 1, "group_size": 2, "max_new_tokens": 8}
  assert (s["steps"], s["eval_size"], s["num_prompts"], s["group_size"]) == (2, 4, 1, 2)
  assert s["max_new_tokens"] == s["eval_max_new_tokens"] == 8
  cfg, module = _config("lora")
  expected = {
    "temperature": cfg.sampling.temperature,
    "top_p": cfg.sampling.top_p,
    "top_k": cfg.sampling.top_k,
    "learning_rate": cfg.optim.learning_rate,
    "adam_b1": cfg.optim.b1,
    "adam_b2": cfg.optim.b2,
    "weight_decay": cfg.optim.weight_decay,
    "grad_clip": cfg.optim.grad_clip,
    "clip_low": cfg.objective.clip_low,
    "clip_high": cfg.objective.clip_high,
    "beta": cfg.kl.beta,
    "updates_per_rollout": cfg.rl.num_epochs * cfg.rl.num_minibatches,
    "reward_weights": dict(cfg.task.reward_weights),
    "correct_term": cfg.data.correct_term,
    "system_prompt": module.SYSTEM,
    "prompt_len": cfg.data.prompt_len,
    "eval_every": cfg.train.eval_every,
    "lora_rank": cfg.model.lora_rank,
    "lora_alpha": cfg.model.lora_alpha,
    "lora_dropout": cfg.model.lora_dropout,
    "param_dtype": cfg.model.param_dtype,
    "dtype": cfg.model.dtype,
    "seed": cfg.seed,
  }
  assert {k: s[k] for k in expected} == expected
  assert (s["beta"], s["updates_per_rollout"], s["lr_schedule"]) == (0.0, 1, "constant")
  assert s["format_term"] == "answer_line_format"
  short = [t.strip() for t in cfg.model.lora_targets.split(",")]
  assert s["lora_targets"] == [f"{t}_proj" for t in short]
  setup = rec["runtime"]["peer_setup"]
  assert setup["generation"].startswith("transformers generate") and setup["peft_lora_rank"] == 16
  assert 0 < rec["runtime"]["trainable_params"] < rec["runtime"]["num_params"] / 10
