"""A tool's setup on the tokenizer and budget it is given: a Metaspace (SentencePiece-style)
tokenizer's digits are its own digit tokens, a tokenizer that cannot write the tool's pieces is
refused in one line, and a `sampling.max_turns` whose completion budget is too large is refused
before anything is written.

The tokenizers are real `tokenizers` models saved as Hugging Face directories; the refusals go
through the trainer's own command line.
"""

import json
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, cli_env, config_problems, tiny_config
from text_fixtures import write_math_jsonl

from jaxrl_llm import envs, tool_formats
from jaxrl_llm.config import ConfigError, parse
from jaxrl_llm.data.tokenizers import HFTokenizer

CONFIG = f"--config={REPO / 'configs' / 'default.py'}"
LLAMA_FIXTURE = REPO / "tests" / "fixtures" / "hf" / "llama"  # Metaspace, no digits and no "="


def _main(*args):
  """Runs the trainer's command line as a user would; (exit status, stderr's lines)."""
  cmd = [sys.executable, "-m", "jaxrl_llm.main", CONFIG, *args]
  proc = subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=600)
  return proc.returncode, proc.stderr.strip().splitlines()


def _metaspace_tokenizer(directory):
  """A Llama 2 / Mistral-style tokenizer: BPE under a Metaspace pre-tokenizer that writes a
  space as `▁` and prepends one, each digit its own token, and `▁1` / `▁5` merged tokens whose
  text alone also reads "1" / "5" (the decoder drops the first token's blank)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers

  vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", "▁"])}
  for c in "0123456789+-*=?xabcdefghijklmnopqrstuvwyz,.:":
    vocab[c] = len(vocab)
  merges = [("▁", "s"), ("▁s", "o"), ("▁", "1"), ("▁", "5"), ("▁", "a")]
  for a, b in merges:
    vocab[a + b] = len(vocab)
  tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
  tok.add_special_tokens(["<unk>", "<s>", "</s>"])
  tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
  tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
  directory.mkdir(parents=True, exist_ok=True)
  tok.save(str(directory / "tokenizer.json"))
  config = {"eos_token": "</s>", "bos_token": "<s>", "unk_token": "<unk>", "add_bos_token": False}
  (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
  return HFTokenizer.from_dir(directory)


def _answers_in_context(env, texts):
  """The tool's answer to the call that ends each text, as the episode reads: the text with
  the answer written after it, less the text (a Metaspace decoder drops the blank of a first
  token, so the answer is read where it stands); and whether each is an error."""
  tok = env.tokenizer
  ids = [tok.encode(t) for t in texts]
  comp = np.full((len(ids), max(map(len, ids)) + 4), tok.pad_id, np.int32)
  for i, x in enumerate(ids):
    comp[i, : len(x)] = x
  end = np.asarray([len(x) for x in ids]) - env.close_len
  answer, length, error = env.respond(
    jnp.zeros((len(texts), 2), jnp.int32), jnp.asarray(comp), jnp.zeros_like(end), jnp.asarray(end)
  )

  def text(x):
    return tok.decode(x, skip_special_tokens=False, stop_at_eos=False)

  shown = [
    text(x + list(np.asarray(a[:k])))[len(text(x)) :]
    for x, a, k in zip(ids, np.asarray(answer), np.asarray(length))
  ]
  return shown, [bool(e) for e in np.asarray(error)]


def test_a_metaspace_tokenizers_answers_are_written_in_its_digit_tokens(tmp_path):
  """`encode("5")` of a Metaspace tokenizer is `▁5` (or `▁`, `5`): the tool took its first id
  for the digit, and wrote blanks (or " 5" for every 5) as answers with no error."""
  tok = _metaspace_tokenizer(tmp_path / "metaspace")
  assert [tok._tok.id_to_token(i) for i in tok.encode("5")] == ["▁5"]
  env = envs.InlineArithmetic(tokenizer=tok)
  calls = ["so: 12 * 35 =", "so: 5 - 9 * 2 =", "so: a =", "so 12 * 35 =", "so12 * 3 ="]
  shown, errors = _answers_in_context(env, calls)
  assert shown == [" 420", " -13", " ?", " 420", " ?"]  # a call glued to a word is cut from it
  assert errors == [False, False, True, False, True]
  t = tool_formats.tool_tokens(tok, inline=True)
  assert [tok._tok.id_to_token(i) for i in (*t.digits, t.minus)] == [*"0123456789", "-"]
  assert [tok._tok.id_to_token(i) for i in t.error] == ["?"]


def test_a_tokenizer_without_the_tools_tokens_is_refused_naming_what_it_lacks():
  """The Llama fixture has no digit tokens and no "=": every piece the tool writes or reads
  was the `▁` id, and every space counted as a call."""
  tok = HFTokenizer.from_dir(LLAMA_FIXTURE)
  with pytest.raises(ValueError) as e:
    tool_formats.tool_tokens(tok, inline=True)
  message = str(e.value)
  assert "close ' ='" in message and "digits '0123456789'" in message
  assert "missing from the vocabulary" in message


def test_the_command_line_refuses_that_tokenizer_in_one_line(tmp_path):
  """A prompt-file run on that tokenizer (`data.tokenizer` is read with prompt files) trained
  with rc 0; now exit 2, one `error:` line naming sampling.tool and the close, no workdir."""
  workdir = tmp_path / "run"
  write_math_jsonl(tmp_path / "math.jsonl", n=120)
  code, err = _main(
    f"--workdir={workdir}",
    "--config.sampling.tool=arithmetic_inline",
    f"--config.data.train_files={tmp_path / 'math.jsonl'}",
    f"--config.data.tokenizer={LLAMA_FIXTURE}",
    "--config.data.template=plain",
    "--config.data.prompt_len=128",
    "--config.data.eval_fraction=0.25",
    "--config.sampling.max_new_tokens=12",
    "--config.model.vocab_size=512",
    "--config.task.eval_size=4",
    "--config.sft.steps=0",
    "--config.train.num_steps=1",
    "--config.train.eval_every=1",
  )
  errors = [line for line in err if line.startswith("error:")]
  assert code == 2, err[-5:]
  assert len(errors) == 1 and "sampling.tool='arithmetic_inline'" in errors[0], err[-5:]
  assert "close ' ='" in errors[0] and "digits '0123456789'" in errors[0]
  assert not workdir.exists()


def test_a_huge_max_turns_is_refused_at_parse():
  """max_turns x (a segment + an answer) tokens: the budget had no bound (an int32 overflow
  after the warm start). Below 2**20 tokens it is accepted, as before."""
  huge = {"sampling.tool": "calculator", "sampling.max_turns": 10**9}
  with pytest.raises(ConfigError, match=r"sampling.max_turns=1000000000 .* 2\*\*20") as e:
    parse(tiny_config(**huge))
  assert str(e.value).startswith("invalid config: sampling.max_turns=1000000000 is too large")
  long_turns = {
    "sampling.tool": "calculator",
    "sampling.max_turns": 4,
    "sampling.turn_tokens": 2**18,
  }
  with pytest.raises(ConfigError, match=r"sampling.max_turns=4 .* 2\*\*20"):
    parse(tiny_config(**long_turns))
  parse(tiny_config(**{"sampling.tool": "calculator", "sampling.max_turns": 1000}))
  with pytest.raises(ConfigError, match=r"sampling.max_new_tokens=10000000000 .* 2\*\*20"):
    parse(tiny_config(**{"sampling.max_new_tokens": 10**10}))
  with pytest.raises(ConfigError, match=r"sampling.max_turns=10000000000 .* at most 1048575"):
    parse(tiny_config(**{**huge, "sampling.max_turns": 10**10, "sampling.max_new_tokens": 64}))


def test_a_max_turns_whose_exact_budget_is_too_large_is_refused_with_the_task():
  """Parse bounds the budget from below (max_turns x 2); with the task built, the check uses
  its sizes: max_turns x (the task's answer + the tool's answer). The largest max_turns it
  names is accepted, one more is refused."""
  from jaxrl_llm.config.checks import check
  from jaxrl_llm.run.assemble import build_task

  def problems(max_turns):
    cfg = parse(tiny_config(**{"sampling.tool": "calculator", "sampling.max_turns": max_turns}))
    try:
      check(cfg, num_devices=1, task=build_task(cfg))
    except ConfigError as e:
      return str(e)
    return ""

  said = problems(2**19 - 1)  # accepted at parse: 2 x (2**19 - 1) < 2**20
  assert said.startswith("invalid config: sampling.max_turns=524287 is too large"), said
  assert "completion budget of" in said and "the tool's answer" in said, said
  most = int(said.rsplit("at most ", 1)[1].split()[0])
  assert problems(most) == ""
  assert problems(most + 1).startswith(f"invalid config: sampling.max_turns={most + 1} is too")


def test_a_huge_turn_tokens_is_named_with_its_largest_allowed_value():
  """turn_tokens past what even a tool's fewest turns (2) fit in the budget: the line blamed
  max_turns and offered "max_turns at most 0", which a tool refuses (2 or more)."""

  def problems(turn_tokens, **more):
    return config_problems(
      **{"sampling.tool": "calculator", "sampling.turn_tokens": turn_tokens, **more}
    )

  said = problems(10**8)  # at parse: the bound with the shortest answer (1 token)
  assert said.startswith("invalid config: sampling.turn_tokens=100000000 is too large"), said
  assert "max_turns" not in said and "turn_tokens at most 524286" in said, said
  said = problems(524286, **{"sampling.max_turns": 2})  # with the task: its answer's length
  assert said.startswith("invalid config: sampling.turn_tokens=524286 is too large"), said
  most = int(said.rsplit("at most ", 1)[1].split()[0])
  assert problems(most, **{"sampling.max_turns": 2}) == ""
  assert problems(most + 1, **{"sampling.max_turns": 2}).startswith(
    f"invalid config: sampling.turn_tokens={most + 1} is too large"
  )


@pytest.mark.parametrize("max_turns", [1000000000, 200000])  # refused at parse; with the task
def test_the_command_line_refuses_a_huge_max_turns_before_the_workdir_is_made(tmp_path, max_turns):
  workdir = tmp_path / "run"
  code, err = _main(
    f"--workdir={workdir}",
    "--config.sampling.tool=calculator",
    f"--config.sampling.max_turns={max_turns}",
    "--config.train.num_steps=1",
    "--config.sft.steps=1",
  )
  errors = [line for line in err if line.startswith("error:")]
  assert code == 2, err[-5:]
  assert len(errors) == 1 and f"sampling.max_turns={max_turns} is too large" in errors[0], err[-5:]
  assert not workdir.exists()


def test_gae_under_a_tool_must_carry_across_its_answers():
  """PPO with a critic (advantage.name=gae) and a tool reset V and A at each tool answer by
  default: the tokens before a call bootstrapped from V = 0 and never saw the episode's reward
  (its advantage there was −V, its value target 0). That combination is refused in one line;
  carrying across the answers (verl's convention) is accepted, and without a tool either is."""
  ppo = {"advantage.name": "gae", "objective.name": "ppo_critic", "model.value_head": True}
  ppo["task.name"] = "addition"
  tool = {**ppo, "sampling.tool": "calculator"}
  line = config_problems(**tool)
  assert line.startswith("invalid config: advantage.gae_carry_masked=False with sampling.tool=")
  assert "\n" not in line and "allowed with a tool: advantage.gae_carry_masked=True" in line
  assert config_problems(**tool, **{"advantage.gae_carry_masked": True}) == ""
  assert config_problems(**ppo) == ""
  # what the carry gives: the call segment's tokens credited with the episode's reward
  from jaxrl_llm.objectives.advantages import gae

  mask = jnp.array([[1, 1, 1, 0, 0, 1, 1.0]])  # the policy's call, the tool's answer, the rest
  reward = jnp.zeros((1, 7)).at[0, 6].set(1.0)
  reset, _ = gae(reward, jnp.zeros((1, 7)), mask, 1.0, 0.95)
  carried, _ = gae(reward, jnp.zeros((1, 7)), mask, 1.0, 0.95, carry_masked=True)
  assert np.all(np.asarray(reset)[0, :3] == 0) and np.all(np.asarray(carried)[0, :3] > 0.8)
