"""The in-graph tools answer only what they can evaluate: a value past the environment's limit
at any point of a call, a call that is no `+ - *` arithmetic over whole numbers, and a host
tool that cannot run in worker processes or returns no whole number are errors, never a wrong
value."""

import textwrap

import jax.numpy as jnp
import numpy as np
import pytest
from test_multi_turn import build_task
from test_multi_turn_chat import _answers
from text_fixtures import CHATML_ANY_ROLE, build_bpe_tokenizer
from tokenizers import Tokenizer

from jaxrl_llm import envs, host_tool
from jaxrl_llm.config import ConfigError
from jaxrl_llm.data.tasks import CharTokenizer
from jaxrl_llm.data.tokenizers import HFTokenizer

TOK = CharTokenizer()


def _respond(env, calls: list[str]):
  """The answers (text) and errors of the task alphabet's calls `calls`, each ending in `=`."""
  comp, _ = TOK.encode_batch(calls, 24, bos=False, eos=False, left_pad=False)
  prompts, _ = TOK.encode_batch([""] * len(calls), 9, bos=True, eos=False, left_pad=True)
  end = jnp.asarray([c.index("=") for c in calls], jnp.int32)
  answer, length, error = env.respond(jnp.asarray(prompts), jnp.asarray(comp), 0 * end, end)
  shown = [TOK.decode(a[:n]) for a, n in zip(np.asarray(answer), np.asarray(length))]
  return shown, list(np.asarray(error))


@pytest.fixture(scope="module")
def long_numbers(tmp_path_factory):
  """A ChatML tokenizer that also holds the 9-digit number token `294967338`."""
  d = build_bpe_tokenizer(tmp_path_factory.mktemp("long"), chat_template=CHATML_ANY_ROLE)
  tok = Tokenizer.from_file(str(d / "tokenizer.json"))
  tok.add_tokens(["294967338"])
  tok.save(str(d / "tokenizer.json"))
  return HFTokenizer.from_dir(d)


@pytest.mark.parametrize("env", [envs.Calculator, envs.Arithmetic])
def test_a_value_past_the_limit_anywhere_in_a_call_is_an_error_not_a_wrapped_value(env):
  """`65536*65536` wrapped to 0 in int32 (and `32768*65536` to INT_MIN, whose abs is negative):
  each was answered with a value and no error."""
  tool = env(tokenizer=CharTokenizer())
  calls = ["65536*65536=", "65536*65536+7=", "4096*4096*256+42=", "32768*65536="]
  calls += ["999999+1=", "0-999999-1=", "999999*1=", "1000*999=", "999998+1=", "5-999999="]
  answers, errors = _respond(tool, calls)
  assert answers == [":,"] * 6 + ["999999,", "999000,", "999999,", "-999994,"]
  assert errors == [True] * 6 + [False] * 4


def test_a_long_number_of_multi_digit_tokens_is_an_error_not_a_wrapped_value(long_numbers):
  """`4` then the token `294967338`: 4 * 10**9 + 294967338 wraps to 42 in int32."""
  tool = envs.Arithmetic(tokenizer=long_numbers)
  ids = long_numbers.encode("<tool_call>4294967338</tool_call>")
  assert any(long_numbers.decode([i]) == "294967338" for i in ids)
  shown, errors = _answers(tool, ["<tool_call>4294967338</tool_call>", "<tool_call>42</tool_call>"])
  assert [s.split("tool\n")[1].split("<|im_end|>")[0] for s in shown] == ["error", "42"]
  assert errors == [True, False]


def _values(shown, format_):
  """The answer's body: the value or the error word."""
  if format_ == "chatml":
    return [s.split("tool\n")[1].split("<|im_end|>")[0] for s in shown]
  return [s.split("\n\n")[1].split("<|eot_id|>")[0] for s in shown]


CUT = ["(2+3)*4", "10/2", "3.5 * 2", "2^10", "12 35", "a5+3", "x 12+3", "2+3 so 4"]
GOOD = ["12 * 35 + 7", "2+3*4", " 5 - 9 * 2", "7"]


@pytest.mark.parametrize("format_", ["chatml", "llama3"])
def test_a_tagged_call_is_all_that_follows_its_opening_tag(format_, request):
  """ChatML's `<tool_call>(2+3)*4</tool_call>` was answered 4 (the trailing `*4`), `10/2` 2,
  `3.5 * 2` 10, `2^10` 10, `12 35` 1235 and `a5+3` 8."""
  tok = request.getfixturevalue(format_)
  opening, close = ("<tool_call>", "</tool_call>")
  if format_ == "llama3":
    opening, close = ("<|python_tag|>", "<|eom_id|>")
  calls = [f"Let me compute {opening}{c}{close}" for c in CUT + GOOD]
  calls += [f"{opening}x{opening}6*7{close}"]  # the last opening tag starts the call
  shown, errors = _answers(envs.Arithmetic(tokenizer=tok), calls)
  assert _values(shown, format_) == ["error"] * len(CUT) + ["427", "14", "-13", "7", "42"]
  assert errors == [True] * len(CUT) + [False] * 5


def test_an_inline_call_cut_from_a_larger_expression_is_an_error(chatml):
  """`3.5 * 2 =` was answered 10 and `(2+3)*4 =` 4: the run before ` =` was only the end of
  the expression the policy wrote."""
  env = envs.get_env("arithmetic_inline", type("Task", (), {"tokenizer": chatml})())
  cut = ["so 3.5 * 2 =", "(2+3)*4 =", "10/2 =", "2^10 =", "12 35 =", "1,000 * 3 ="]
  good = ["so it has 12 * 35 + 7 =", "2+3*4 =", "she buys 4 x 6 =", "(12 * 3 =", "3. 5 * 2 ="]
  shown, errors = _answers(env, cut + good)
  assert shown == [" ?"] * len(cut) + [" 427", " 14", " 24", " 36", " 10"]
  assert errors == [True] * len(cut) + [False] * len(good)


def test_the_whole_segment_is_the_call_of_a_tagged_format_without_its_tag(chatml):
  shown, errors = _answers(
    envs.Calculator(tokenizer=chatml), ["2+3</tool_call>", "so 2</tool_call>"]
  )
  assert _values(shown, "chatml") == ["5", "error"] and errors == [False, True]


def test_a_host_tool_that_cannot_be_pickled_is_refused_in_one_line(tmp_path, monkeypatch):
  """A module-level lambda passed the config check, then failed inside `jax.pure_callback`
  with a traceback about a "reward term"."""
  (tmp_path / "user_tools.py").write_text(
    textwrap.dedent(
      """
      lam = lambda call, prompt: 7

      def make():
        def inner(call, prompt):
          return 7
        return inner

      inner = make()
      """
    )
  )
  monkeypatch.syspath_prepend(str(tmp_path))
  for name in ["lam", "inner"]:
    said = envs.host_callable(f"host:user_tools:{name}")
    assert isinstance(said, str) and "\n" not in said, said
    assert said.startswith(f"sampling.tool='host:user_tools:{name}'") and "module-level" in said
    assert "picklable" in said and "worker processes" in said
    with pytest.raises(ConfigError, match="picklable"):
      envs.get_env(f"host:user_tools:{name}", build_task())
  assert callable(envs.host_callable("host:host_tools:length"))


def five_and_a_bit(call: str, prompt: str) -> float:
  return 5.00000001


def true(call: str, prompt: str) -> bool:
  return True


def whole_float(call: str, prompt: str) -> float:
  return -5.0


def numpy_int(call: str, prompt: str):
  return np.int64(12)


def a_string(call: str, prompt: str):
  return "5"


def huge_float(call: str, prompt: str) -> float:
  return 1e6


def test_a_host_tool_answer_that_is_no_whole_number_is_an_error(monkeypatch):
  """`5.00000001` was answered 5 and `True` 1, both without error (float32 scores)."""
  monkeypatch.setattr(host_tool, "_WARNED", set())
  got = {}
  for fn in [five_and_a_bit, true, whole_float, numpy_int, a_string, huge_float]:
    host = envs.get_env(f"host:test_tool_answers:{fn.__name__}", build_task(), timeout_s=20.0)
    answers, errors = _respond(host, ["2+3="])
    got[fn.__name__] = (answers[0], bool(errors[0]))
  assert got == {
    "five_and_a_bit": (":,", True),
    "true": (":,", True),
    "whole_float": ("-5,", False),
    "numpy_int": ("12,", False),
    "a_string": (":,", True),
    "huge_float": (":,", True),
  }


def test_a_host_tool_that_can_never_take_a_call_and_a_prompt_is_refused_in_one_line(
  tmp_path, monkeypatch
):
  """A one-argument function and a generator function passed the start-up checks; the run
  trained with every call failing (tool/error_frac 1.0). A module raising KeyboardInterrupt as
  it is imported was taken for the user's Ctrl-C (exit 130, its workdir left behind)."""
  (tmp_path / "odd_tools.py").write_text(
    textwrap.dedent(
      """
      def one(call):
        return 1

      def gen(call, prompt):
        yield 1

      async def coro(call, prompt):
        return 1

      def three(call, prompt, extra):
        return 1

      def extra_default(call, prompt, extra=0, *args, **kwargs):
        return 1
      """
    )
  )
  (tmp_path / "interrupts.py").write_text("raise KeyboardInterrupt\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  for name, says in [
    ("one", "takes (call), not (call, prompt) (too many positional arguments)"),
    ("gen", "is a generator function"),
    ("coro", "is a coroutine function"),
    ("three", "takes (call, prompt, extra), not (call, prompt)"),
  ]:
    said = envs.host_callable(f"host:odd_tools:{name}")
    assert isinstance(said, str) and "\n" not in said, said
    assert said.startswith(f"sampling.tool='host:odd_tools:{name}': odd_tools.{name} {says}")
    assert said.endswith(
      "allowed: host:<module>:<function> naming a function(call, prompt) -> number"
    )
  assert callable(envs.host_callable("host:odd_tools:extra_default"))
  said = envs.host_callable("host:interrupts:f")
  assert said.startswith(
    "sampling.tool='host:interrupts:f': cannot import interrupts.f (KeyboardInterrupt"
  )
