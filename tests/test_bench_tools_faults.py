"""The benchmark tools (tools/bench.py, bench_pack.py, bench_grouped.py, decode_copies.py,
peer_trl.py, sampler_memory.py) refuse a bad command line with one `error:` line on stderr, exit
status 2 and nothing on stdout, before anything is built; these were argparse's usage block,
tracebacks (`--steps=0`, `--runs=8,x`, a bad `--set`), or values taken without a word (a negative
peak FLOP/s, the peer's flags without a peer, a trace asked of a run that has no fused step), and
sampler_memory.py took no arguments at all. `terminal.ArgParser` and its argument types are what
the tools share for it."""

from __future__ import annotations

import argparse
import json
import sys

import pytest
from conftest import REPO, refused

from jaxrl_llm import terminal

sys.path.insert(0, str(REPO / "tools"))
import bench
import bench_grouped
import bench_pack
import decode_copies
import peer_trl
import sampler_memory


@pytest.mark.parametrize(
  "argv, says",
  [
    (["--shape=tiny", "--steps=0"], "argument --steps: '0': want a whole number >= 1"),
    (["--shape=tiny", "--steps=-2"], "argument --steps: '-2': want a whole number >= 1"),
    (["--shape=tiny", "--peak_flops=-1"], "argument --peak_flops: '-1': want a finite number > 0"),
    (["--shape=tiny", "--hbm_bytes_per_s=nan"], "'nan': want a finite number > 0"),
    (["--shape=tiny", "--peer_timeout_s=0"], "argument --peer_timeout_s: '0'"),
    (["--shape=tiny", "--peer_timeout_s=5"], "--peer_timeout_s: for the peer's run only"),
    (["--shape=tiny", "--peer_cache=static", "--peer_python=/x"], "--peer_python, --peer_cache"),
    (["--shape=tiny", "--sample_only", "--profile_dir=/tmp/p"], "which --sample_only does not"),
    (["--shape=tiny", "--peer=trl", "--peer_python=/nonexistent"], "no executable file there"),
    (["--shape=tiny", "--nosuch"], "unrecognised arguments: --nosuch"),
    (["--steps=3"], "give exactly one of --shape and --config"),
    (["--shape=tiny", f"--profile_dir={REPO / 'README.md'}/t"], "README.md is a file"),
  ],
)
def test_bench_refuses_a_bad_command_line_in_one_line(capsys, argv, says):
  """`--steps=0` was a StatisticsError traceback after the build, `--steps=-2` an IndexError;
  a negative or NaN device limit printed negative or NaN fractions of the hardware; the peer's
  flags without `--peer` and `--profile_dir` with `--sample_only` were dropped without a word,
  after minutes of benchmark, and a `--profile_dir` that could not be made failed only then; a
  mistyped flag printed the usage block; a missing `--peer_python` was a FileNotFoundError
  traceback after our side's benchmark."""
  refused(capsys, bench.main, argv, says)


def test_bench_reads_the_trainers_noconfig_flag_as_false():
  """The documented `--noconfig.FIELD` was always refused as the unknown field `.FIELD`: the
  11-character prefix was cut at 10, keeping its dot."""
  flags = ["--config.model.scan_layers=True", "--noconfig.model.scan_layers"]
  assert bench.flag_overrides(flags) == ["model.scan_layers=True", "model.scan_layers=False"]
  assert bench.shape_config("tiny", bench.flag_overrides(flags)).model.scan_layers is False


@pytest.mark.parametrize(
  "argv, says",
  [
    (["--runs=8,x"], "argument --runs: '8,x': want comma-separated whole numbers, each >= 1"),
    (["--runs=0"], "each >= 1"),
    (["--at_once=-1"], "argument --at_once: '-1': want comma-separated whole numbers, each >= 0"),
    (["--steps=0"], "argument --steps: '0'"),
    (["--shape=nosuch"], "unknown shape 'nosuch'; known: default, tiny, medium"),
    (["--set=nosuch.x=1", "--runs=1"], "unknown config field 'nosuch.x'"),
  ],
)
def test_bench_pack_refuses_a_bad_command_line_in_one_line(capsys, argv, says):
  """`--runs=8,x` was a ValueError traceback after one run's step had been timed; a bad `--set`,
  an unknown `--shape` and `--runs=0` (after one run's step too) were tracebacks."""
  refused(capsys, bench_pack.main, argv, says)


@pytest.mark.parametrize("argv", [["--rows=0"], ["--iters=x"], ["--experts=-4"]])
def test_bench_grouped_refuses_a_size_that_is_not_a_count(capsys, argv):
  """`--rows=0` timed an empty matmul and printed 0 TFLOP/s as a result, a negative expert
  count was a traceback from JAX; `x` printed the usage block."""
  refused(capsys, bench_grouped.main, argv, "want a whole number >= 1")


@pytest.mark.parametrize(
  "argv, says",
  [(["--dtype=int8"], "argument --dtype: invalid choice: 'int8'"), (["--runs=0"], "'0'")],
)
def test_decode_copies_refuses_a_bad_dtype_or_pack_size(capsys, argv, says):
  """`--dtype=int8` was ModelConfig's ValueError traceback, `--runs=0` numpy's, on stacking no
  runs."""
  refused(capsys, decode_copies.main, argv, says)


@pytest.mark.parametrize(
  "spec, says",
  [("[1", "--spec='[1': want a JSON object"), ("[]", "want a JSON object"), ("{}", "lacks")],
)
def test_peer_trl_refuses_a_spec_it_cannot_read_in_one_line(capsys, spec, says):
  """A spec that is not JSON was a JSONDecodeError traceback, a list a TypeError, and a missing
  field a line without `error:`."""
  refused(capsys, peer_trl.main, [f"--spec={spec}"], says)


def test_arg_parser_raises_the_tools_own_error_or_prints_one_line(capsys):
  """`raise_as` gives the tool its own exception (which it prints as its one line); without it
  the parser prints `error: ...` and exits 2, not the usage block."""

  class Mine(Exception):
    pass

  p = terminal.ArgParser(prog="x", raise_as=Mine)
  p.add_argument("--n", type=terminal.count)
  with pytest.raises(Mine, match="argument --n: '0': want a whole number >= 1"):
    p.parse_args(["--n=0"])
  assert p.parse_args(["--n=3"]).n == 3
  plain = terminal.ArgParser(prog="x")
  plain.add_argument("--xs", type=terminal.counts)
  assert plain.parse_args(["--xs=1, 2"]).xs == [1, 2]
  refused(capsys, plain.parse_args, ["--ys=1"], "unrecognized arguments: --ys=1")
  for bad in ("0", "inf", "-1", "x"):
    with pytest.raises(argparse.ArgumentTypeError):
      terminal.positive(bad)
  assert terminal.positive("2.5e12") == 2.5e12


@pytest.mark.parametrize(
  "argv, says",
  [(["--prompts=0"], "argument --prompts: '0'"), (["--out=/"], "--out: is a directory")],
)
def test_sampler_memory_refuses_a_bad_command_line(capsys, argv, says):
  """The tool was a module-level script that took no arguments: every flag was ignored."""
  refused(capsys, sampler_memory.main, argv, says)


def test_sampler_memory_measures_the_shape_it_is_given(tmp_path, capsys):
  """Its flags set the compiled shape (the record names it), and the fast path's temporaries
  are under the float32-logits reference's at Qwen2.5-0.5B's vocabulary."""
  out = tmp_path / "made" / "temp.json"
  argv = ["--prompts=2", "--group_size=2", "--prompt_len=8", "--new_tokens=8", "--layers=1"]
  assert sampler_memory.main([*argv, f"--out={out}"]) == 0
  printed = json.loads(capsys.readouterr().out)
  assert json.loads(out.read_text()) == printed
  assert "1 layers bf16, 2 prompts x G=2, S=8, T=8" in printed["shape"]
  temp = printed["temp_bytes"]
  assert 0 < temp["fast"] < temp["float32_logits"], temp
