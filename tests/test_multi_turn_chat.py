"""Tools for Hugging Face tokenizers: calls and answers in ChatML's tool role and Llama 3's
`ipython` role, read and written as token ids inside the program (`tool_formats.ToolTokens`).

The tokenizers are real byte-level BPE tokenizers trained by `text_fixtures`, with the chat
tokens of each format; the rendered episode is checked against the chat template itself.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from parsed import build, train_and_evaluate
from text_fixtures import (
  LLAMA3_ANY_ROLE,
  LLAMA3_TOKENS,
  chat_tokenizer,
  math_file_run,
)

from jaxrl_llm import envs, metrics, tool_formats
from jaxrl_llm.config import ConfigError, parse
from jaxrl_llm.data.tasks.tokenizer import CharTokenizer
from jaxrl_llm.data.tokenizers import HFTokenizer
from jaxrl_llm.sampling import SamplingConfig
from jaxrl_llm.turns import Turns, over_budget, take_turns


def _rows(tok, texts):
  """Completion ids [N, T] right-padded, and each text's length in tokens."""
  ids = [tok.encode(t) for t in texts]
  out = np.full((len(ids), max(map(len, ids)) + 4), tok.pad_id, np.int32)
  for i, x in enumerate(ids):
    out[i, : len(x)] = x
  return out, np.asarray([len(x) for x in ids])


def _answers(env, texts):
  """The tool's answers (text, special tokens shown) to calls that end each text."""
  tok = env.tokenizer
  comp, n = _rows(tok, texts)
  end = n - env.close_len
  answer, length, error = env.respond(
    jnp.zeros((len(texts), 2), jnp.int32), jnp.asarray(comp), jnp.zeros_like(end), jnp.asarray(end)
  )
  shown = [
    tok.decode(a[:k], skip_special_tokens=False, stop_at_eos=False)
    for a, k in zip(np.asarray(answer), np.asarray(length))
  ]
  return shown, list(np.asarray(error))


def test_the_format_follows_the_tokenizers_chat_tokens(chatml, llama3, tmp_path_factory):
  assert tool_formats.tool_format(chatml).name == "chatml"
  assert tool_formats.tool_format(llama3).name == "llama3"
  assert tool_formats.tool_format(CharTokenizer()).name == "plain"
  no_eom = chat_tokenizer(tmp_path_factory, "llama3_no_eom", LLAMA3_ANY_ROLE, LLAMA3_TOKENS)
  with pytest.raises(ValueError, match=r"'<\|eom_id\|>', which is missing from the vocabulary"):
    tool_formats.tool_tokens(no_eom)


def test_chatml_calls_are_the_arithmetic_before_the_close_and_answers_are_a_tool_turn(chatml):
  calls = [
    "Let me compute <tool_call>12 * 35 + 7</tool_call>",
    "<tool_call>2+3*4</tool_call>",
    "so <tool_call>5 - 9 * 2</tool_call>",
    "<tool_call>12 +</tool_call>",
    "<tool_call>twelve</tool_call>",
    "<tool_call>9999999</tool_call>",
  ]
  turn = "<|im_end|>\n<|im_start|>tool\n{}<|im_end|>\n<|im_start|>assistant\n"
  chain, chain_errors = _answers(envs.Calculator(tokenizer=chatml), calls)
  usual, usual_errors = _answers(envs.Arithmetic(tokenizer=chatml), calls)
  values = ["427", "20", "-8"] + ["error"] * 3
  assert chain == [turn.format(v) for v in values]
  assert usual == [turn.format(v) for v in ["427", "14", "-13"] + ["error"] * 3]
  assert chain_errors == usual_errors == [False] * 3 + [True] * 3


def test_llama3_calls_close_with_eom_and_answers_are_an_ipython_turn(llama3):
  shown, errors = _answers(envs.Arithmetic(tokenizer=llama3), ["<|python_tag|>6*7+1<|eom_id|>"])
  assert shown == [
    "<|start_header_id|>ipython<|end_header_id|>\n\n43<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
  ]
  assert errors == [False]
  assert envs.Arithmetic(tokenizer=llama3).close_len == 1


def test_inline_calls_are_the_arithmetic_before_the_equals_sign_and_answers_follow_it(chatml):
  """`arithmetic_inline`: the number, operator and blank run before ` =` in the policy's prose
  is the call (`x` multiplies too), and its value follows as that prose would write it."""
  env = envs.get_env("arithmetic_inline", type("Task", (), {"tokenizer": chatml})())
  assert (
    env.tokens.format.name == "inline"
    and envs.Arithmetic(tokenizer=chatml).tokens.format.name == "chatml"
  )
  calls = ["so it has 12 * 35 + 7 =", "2+3*4 =", "she buys 4 x 6 =", "Let a =", "12 + ="]
  shown, errors = _answers(env, calls)
  assert shown == [" 427", " 14", " 24", " ?", " ?"]
  assert errors == [False, False, False, True, True]


def _episode(env, policy_segments, t_max=96):
  """Runs `take_turns` over the policy's segments token by token, as the sampler's decode loop
  does (a pending answer's tokens are forced in); returns the completion ids, env mask and the
  final `Turns`."""
  cfg = SamplingConfig(max_new_tokens=t_max, tool=env, max_turns=len(policy_segments))
  tok = env.tokenizer
  queue = [list(tok.encode(s)) for s in policy_segments]
  turns = Turns.start(1, t_max, env.answer_len)
  tokens = jnp.full((1, t_max), tok.pad_id, jnp.int32)
  prompts = jnp.zeros((1, 2), jnp.int32)
  step = jax.jit(take_turns, static_argnums=0)
  for slot in range(t_max):
    forced = bool(turns.pending_i[0] < turns.pending_n[0])
    if forced:
      token = int(turns.pending[0, turns.pending_i[0]])
    else:
      while queue and not queue[0]:
        queue.pop(0)
      if not queue:
        break
      token = queue[0].pop(0)
    tokens = tokens.at[0, slot].set(token)
    turns = step(
      cfg,
      turns,
      prompts,
      tokens,
      jnp.asarray([token]),
      slot,
      jnp.asarray([True]),
      jnp.asarray([forced]),
    )
  return np.asarray(tokens[0, :slot]), np.asarray(turns.env_mask[0, :slot]), turns


@pytest.mark.parametrize("fmt", ["chatml", "llama3"])
def test_an_episode_renders_as_the_chat_template_with_a_tool_turn(fmt, request):
  """The policy's call, the tool's answer and the policy's next segment read exactly as the
  tokenizer's chat template renders the conversation with the tool's turn; the tool's tokens,
  and only they, are the environment's."""
  tok = request.getfixturevalue(fmt)
  env = envs.Arithmetic(tokenizer=tok)
  if fmt == "chatml":
    call, reply = "I will compute. <tool_call>14 * 23</tool_call>", "Answer: 322<|im_end|>"
    messages = [
      {"role": "user", "content": "A shop sells 14 boxes of 23 pens. How many pens?"},
      {"role": "assistant", "content": call},
      {"role": "tool", "content": "322"},
      {"role": "assistant", "content": "Answer: 322"},
    ]
  else:
    call, reply = "<|python_tag|>14 * 23<|eom_id|>", "Answer: 322<|eot_id|>"
    messages = [
      {"role": "user", "content": "A shop sells 14 boxes of 23 pens. How many pens?"},
      {"role": "assistant", "content": "<|python_tag|>14 * 23", "eom": True},
      {"role": "ipython", "content": "322"},
      {"role": "assistant", "content": "Answer: 322"},
    ]
  tokens, env_mask, turns = _episode(env, [call, reply])
  prompt = tok.apply_chat_template(messages[:1], add_generation_prompt=True)
  whole = tok.apply_chat_template(messages, add_generation_prompt=False)
  text = tok.decode(tokens, skip_special_tokens=False, stop_at_eos=False)
  assert prompt + text == whole.removesuffix("\n")  # the policy stops at its turn's end
  answer = tok.encode(tool_formats.FORMATS[fmt].prefix + "322" + tool_formats.FORMATS[fmt].suffix)
  n_call = len(tok.encode(call))
  assert np.array_equal(tokens[n_call : n_call + len(answer)], answer)
  assert np.array_equal(np.nonzero(env_mask)[0], np.arange(n_call, n_call + len(answer)))
  assert int(turns.calls[0]) == 1 and int(turns.errors[0]) == 0


def test_an_inline_episode_reads_as_prose_and_the_verifier_reads_the_policys_answer(chatml):
  """The value written after ` =` is the environment's (masked), the text reads as one piece of
  prose, and the completion the verifier reads is the policy's own after the last value."""
  from jaxrl_llm.data.verifiers.rewards import answer_line_correct
  from jaxrl_llm.turns import final_segment
  from jaxrl_llm.types import Rollout

  env = envs.InlineArithmetic(tokenizer=chatml)
  segments = ["A crate holds 14 * 23 =", " pens.\nAnswer: 322"]
  tokens, env_mask, turns = _episode(env, segments)
  text = chatml.decode(tokens, skip_special_tokens=False, stop_at_eos=False)
  assert text == "A crate holds 14 * 23 = 322 pens.\nAnswer: 322"
  n_call, k = len(chatml.encode(segments[0])), int(env_mask.sum())
  assert chatml.decode(tokens[n_call : n_call + k], stop_at_eos=False) == " 322"
  assert np.array_equal(np.nonzero(env_mask)[0], np.arange(n_call, n_call + k))
  assert int(turns.calls[0]) == 1 and int(turns.errors[0]) == 0
  t = len(tokens)
  rollout = Rollout(
    prompt_tokens=jnp.zeros((1, 2), jnp.int32),
    prompt_mask=jnp.ones((1, 2), bool),
    tokens=jnp.asarray(tokens)[None],
    loss_mask=jnp.asarray(1.0 - env_mask)[None],
    lengths=jnp.asarray([t]),
    truncated=jnp.asarray([False]),
    logprobs=jnp.zeros((1, t)),
    decode_steps=jnp.asarray(t),
    env_mask=jnp.asarray(env_mask)[None],
  )
  read, mask = final_segment(rollout)
  read = np.asarray(read[0])[np.asarray(mask[0]) > 0]
  assert chatml.decode(read, stop_at_eos=False) == " pens.\nAnswer: 322"
  assert answer_line_correct(chatml.decode(read, stop_at_eos=False), "322") == 1.0


def test_a_close_with_no_calls_left_is_not_a_call(chatml):
  env = envs.Arithmetic(tokenizer=chatml)
  # Two calls with max_turns=2: the second close finds no call left and gets no answer.
  call = "<tool_call>2*3</tool_call>"
  _, env_mask, turns = _episode(env, [call, call])
  assert int(turns.calls[0]) == 1
  assert env_mask.sum() == len(chatml.encode(tool_formats.FORMATS["chatml"].prefix + "6")) + len(
    chatml.encode(tool_formats.FORMATS["chatml"].suffix)
  )


def test_a_segment_over_the_turn_budget_ends_the_episode():
  env = envs.Calculator()
  cfg = SamplingConfig(max_new_tokens=16, tool=env, max_turns=3, turn_tokens=4)
  turns = Turns.start(2, 16, env.answer_len).replace(seg_start=jnp.asarray([0, 2]))
  active, forced = jnp.asarray([True, True]), jnp.asarray([False, False])
  assert list(np.asarray(over_budget(cfg, turns, 3, active, forced))) == [True, False]
  assert list(np.asarray(over_budget(cfg, turns, 5, active, forced))) == [True, True]
  assert not np.asarray(over_budget(cfg, turns, 5, active, jnp.asarray([True, True]))).any()
  off = SamplingConfig(max_new_tokens=16, tool=env, max_turns=3)
  assert not np.asarray(over_budget(off, turns, 15, active, forced)).any()


def test_the_turn_budget_bounds_every_policy_segment_of_a_rollout():
  from test_multi_turn import _multi_turn

  _, _, rollout = _multi_turn(**{"sampling.turn_tokens": 3, "sampling.max_new_tokens": 30})
  env_mask = np.asarray(rollout.env_mask) > 0
  live = np.arange(env_mask.shape[1])[None, :] < np.asarray(rollout.lengths)[:, None]
  longest = 0
  for row in live & ~env_mask:  # runs of the policy's tokens between the tool's answers
    edges = np.flatnonzero(np.diff(np.concatenate([[0], row.astype(int), [0]])))
    longest = max(longest, int(np.max(edges[1::2] - edges[::2])))
  assert longest == 3  # some segment reached the budget, none passed it


@pytest.mark.extended
def test_a_prompt_file_run_with_a_tool_trains_in_the_tokenizers_chat_format(tmp_path):
  """The trainer on a prompt file with a ChatML tokenizer and the arithmetic tool: the tool's
  tokens are counted and masked, and the update runs."""
  overrides, _ = math_file_run(tmp_path)
  overrides.update({"sampling.tool": "arithmetic", "sampling.max_new_tokens": 40})
  overrides.update({"train.num_steps": 1, "train.eval_every": 1, "train.checkpoint_every": 1})
  train_and_evaluate(tiny_config(**overrides), str(tmp_path / "run"))
  scalars = metrics.read_scalars(str(tmp_path / "run"))
  for tag in ("policy/loss", "tool/calls_mean", "tool/env_token_frac", "tool/turns_mean"):
    assert tag in scalars, tag
  assert np.isfinite(scalars["policy/loss"][0][1])


def test_bad_tool_settings_are_one_line_each(tmp_path):
  with pytest.raises(ConfigError, match=r"sampling.turn_tokens=40 exceeds the completion budget"):
    parse(tiny_config(**{"sampling.turn_tokens": 40, "sampling.max_new_tokens": 32}))
  with pytest.raises(ConfigError, match=r"sampling.tool='abacus'; allowed: none, calculator"):
    parse(tiny_config(**{"sampling.tool": "abacus"}))
  overrides, _ = math_file_run(tmp_path)
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())  # no chat tokens at all
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.train_from_iterator(["12 + 35 = 47"] * 4, trainers.BpeTrainer(special_tokens=["</s>"]))
  plain = tmp_path / "plain_tok"
  plain.mkdir()
  tok.save(str(plain / "tokenizer.json"))
  (plain / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
  overrides.update(
    {"data.tokenizer": str(plain), "data.template": "plain", "sampling.tool": "arithmetic"}
  )
  with pytest.raises(ConfigError, match=r"a tool needs a chat format with a tool role") as e:
    build(parse(tiny_config(**overrides)))
  assert "\n" not in str(e.value).strip()


@pytest.mark.slow
def test_smollm2s_tool_turns_render_as_its_own_chat_template(smollm2):
  """The real model's tokenizer (ChatML, no tool-call special tokens: the close is five BPE
  tokens) and its own chat template, with the example config's system message."""
  import runpy

  from conftest import REPO

  system = runpy.run_path(str(REPO / "configs" / "smollm2_arith.py"))["TOOL_SYSTEM"]
  hf_dir, _ = smollm2
  tok = HFTokenizer.from_dir(hf_dir)
  env = envs.Arithmetic(tokenizer=tok)
  assert env.close_len == len(tok.encode("</tool_call>")) > 1
  call = "The shop sells <tool_call>14 * 23</tool_call>"
  messages = [
    {"role": "system", "content": system},
    {"role": "user", "content": "A shop sells 14 boxes of 23 pens. How many pens?"},
    {"role": "assistant", "content": call},
    {"role": "tool", "content": "322"},
    {"role": "assistant", "content": "Answer: 322"},
  ]
  tokens, env_mask, turns = _episode(env, [call, "Answer: 322<|im_end|>"])
  prompt = tok.apply_chat_template(messages[:2], add_generation_prompt=True)
  whole = tok.apply_chat_template(messages, add_generation_prompt=False)
  text = tok.decode(tokens, skip_special_tokens=False, stop_at_eos=False)
  assert prompt + text == whole.removesuffix("\n")
  fmt = tool_formats.FORMATS["chatml"]
  assert int(turns.calls[0]) == 1
  assert env_mask.sum() == len(tok.encode(fmt.prefix)) + 3 + len(tok.encode(fmt.suffix))


@pytest.mark.slow
def test_smollm2s_inline_values_are_its_tokenizers_own_tokens(smollm2):
  """On the real model's tokenizer (every digit its own token), the calculations the untrained
  model writes get their values, in exactly the tokens the tokenizer gives the finished text."""
  hf_dir, _ = smollm2
  tok = HFTokenizer.from_dir(hf_dir)
  env = envs.InlineArithmetic(tokenizer=tok)
  calls = ["A building has 11 * 4 * 6 =", "Tom has 19 x 2 =", "so 30 - 2*4 =", "Let a ="]
  shown, errors = _answers(env, calls)
  assert shown == [" 264", " 38", " 22", " ?"] and errors == [False, False, False, True]
  tokens, env_mask, _ = _episode(env, ["It has 11 * 4 * 6 =", " windows.\nAnswer: 264"])
  assert list(tokens) == tok.encode("It has 11 * 4 * 6 = 264 windows.\nAnswer: 264")
  assert env_mask.sum() == len(tok.encode(" 264")) == 4
