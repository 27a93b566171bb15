"""RL moves a real pretrained model: SmolLM2-135M-Instruct under `configs/smollm2_arith.py`.

One run (slow tier, about 17 minutes on 2 cores) of the README's command line, on a fixed set
of four easy arithmetic problems: the training reward its updates log rises. In the extended
tier the run is then exported to Hugging Face (`tools/hf_convert.py export`, the adapters
merged) and transformers' greedy generation from the export equals the trained policy's in the
project's sampler (the default tier's `tests/test_lora.py` checks a tiny run's merged export).
"""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, cli_env

from jaxrl_llm import metrics
from jaxrl_llm.data import arith
from jaxrl_llm.data.tokenizers import HFTokenizer
from jaxrl_llm.models.transformer import Transformer
from jaxrl_llm.sampling import SamplingConfig, sample

STEPS = 12
GREEDY_TOKENS = 32
NEAR_TIE = 1e-4  # merged and unmerged adapters may round differently only at a near tie


def _problems(path: pathlib.Path, n: int = 4) -> list[dict]:
  """The first `n` easy training problems of the default split, written as a JSONL file."""
  train, _ = arith.generate(2000, 10, seed=0)
  easy = [r for r in train if r["level"] == "easy"][:n]
  path.write_text("".join(json.dumps(r) + "\n" for r in easy))
  return easy


@pytest.fixture(scope="module")
def run(smollm2, tmp_path_factory):
  """(workdir, the problems): the adapter setting trained STEPS updates on 4 fixed problems."""
  hf_dir, _ = smollm2
  root = tmp_path_factory.mktemp("smollm2_rl")
  problems = _problems(root / "fixed.jsonl")
  workdir = root / "run"
  cmd = [
    sys.executable,
    "-m",
    "jaxrl_llm.main",
    "--config=configs/smollm2_arith.py",
    f"--workdir={workdir}",
    f"--config.model.checkpoint={hf_dir}",
    f"--config.data.train_files={root / 'fixed.jsonl'}",
    f"--config.data.eval_files={root / 'fixed.jsonl'}",
    "--config.task.eval_size=4",
    f"--config.train.num_steps={STEPS}",
    f"--config.train.eval_every={STEPS}",
    f"--config.train.checkpoint_every={STEPS}",
    "--config.optim.learning_rate=2e-4",
  ]
  proc = subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return workdir, problems


@pytest.mark.slow
def test_rl_raises_the_training_reward_of_a_real_model(run):
  workdir, _ = run
  scalars = metrics.read_scalars(str(workdir))
  reward = [v for _, v in scalars["rollout/reward_mean"]]
  fmt = [v for _, v in scalars["reward/answer_line_format"]]
  assert len(reward) == STEPS
  print("reward per update:", " ".join(f"{r:.3f}" for r in reward))
  print("format rate per update:", " ".join(f"{f:.3f}" for f in fmt))
  first, last = np.mean(reward[:4]), np.mean(reward[-4:])
  assert last > first + 0.1, (first, last)


@pytest.mark.extended  # about 7 minutes beside the run (the RL run itself: about 17 on 2 cores)
def test_the_export_generates_the_trained_policys_greedy_tokens(run, tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  workdir, problems = run
  sys.path.insert(0, str(REPO / "tools"))
  import hf_convert

  out = tmp_path / "export"
  hf_convert.main(["export", f"--workdir={workdir}", f"--out={out}"])
  cfg, params, meta, step = hf_convert.restore_params(str(workdir))
  assert step == STEPS and "base" in meta  # the adapters, on the recorded base

  tok = HFTokenizer.from_dir(out)
  texts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}]) for r in problems]
  tokens, mask = tok.encode_batch(texts, max(len(tok.encode(t)) for t in texts))
  greedy = SamplingConfig(max_new_tokens=GREEDY_TOKENS, greedy=True, eos_id=-1, kv_block=8)
  ours = jax.jit(
    lambda p: sample(
      Transformer(cfg), p, jnp.asarray(tokens), jnp.asarray(mask), jax.random.key(0), greedy
    )
  )(params)
  ours = np.asarray(ours.tokens)

  model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  am = torch.tensor(mask.astype(np.int64))
  with torch.no_grad():
    ref = model.generate(
      torch.tensor(tokens, dtype=torch.long),
      attention_mask=am,
      max_new_tokens=GREEDY_TOKENS,
      min_new_tokens=GREEDY_TOKENS,
      do_sample=False,
      eos_token_id=None,
      pad_token_id=tok.pad_id,
    )[:, tokens.shape[1] :].numpy()
  for row in np.flatnonzero((ours != ref).any(axis=1)):
    at = int(np.argmax(ours[row] != ref[row]))
    prefix = torch.tensor(np.concatenate([tokens[row][mask[row]], ref[row, :at]])[None])
    with torch.no_grad():
      logits = model(prefix).logits[0, -1].numpy()
    top2 = np.sort(logits)[-2:]
    print(f"row {row} differs first at step {at}: top-2 logit gap {top2[1] - top2[0]:.2e}")
    assert top2[1] - top2[0] < NEAR_TIE
  print(f"{int((ours == ref).all(axis=1).sum())} of {len(ours)} rows identical")
  print(repr(tok.decode(ref[0], stop_at_eos=False)))
