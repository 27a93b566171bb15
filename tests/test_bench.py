"""tools/bench.py runs warm fused steps and reports speed and memory as JSON-ready numbers."""

import importlib.util
import json
import os
import subprocess
import sys
import types

import jax
import numpy as np
import pytest
from conftest import REPO, cli_env


def _load(name):
  sys.path.insert(0, str(REPO / "tools"))
  spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


bench = _load("bench")
# The peer's interpreter (bench's --peer_python), e.g. a virtualenv with torch, transformers,
# peft and trl; unset: this one. The peer tests skip where it cannot import what they need.
PEER_PYTHON = os.environ.get("JAXRL_PEER_PYTHON")


def _peer_python(*modules: str) -> str | None:
  """PEER_PYTHON (None: this interpreter) if it imports `modules`, else skip the test."""
  if not PEER_PYTHON:
    for name in modules:
      pytest.importorskip(name)
    return None
  code = f"import {', '.join(modules)}"
  proc = subprocess.run([PEER_PYTHON, "-c", code], capture_output=True, text=True, timeout=120)
  if proc.returncode:
    tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
    pytest.skip(f"JAXRL_PEER_PYTHON={PEER_PYTHON} cannot {code}: {tail}")
  return PEER_PYTHON


@pytest.mark.extended  # ~30 s: a whole benchmark run
def test_bench_reports_all_measurements_at_the_tiny_shape():
  result = bench.run(bench.shape_config("tiny"), steps=2, shape="tiny")
  json.dumps(result)  # serialisable
  for key in ("rl_step_s", "compile_s", "sampler_tokens_per_s", "learner_tokens_per_s"):
    assert result[key] > 0, key
  assert 0 < result["sampling_share_of_step"] <= 1
  assert result["host_peak_rss_bytes"] > 0
  assert result["machine"]["platform"] == "cpu" and result["machine"]["device_count"] == 8

  cfg = result["config"]
  assert (cfg["prompts"], cfg["group_size"], cfg["max_new_tokens"], cfg["prompt_len"]) == (
    16,
    8,
    16,
    13,
  )
  assert cfg["epochs"] == cfg["minibatches"] == 1 and cfg["full_length"]
  # Every completion ran to full length: the sampler took all T decode steps.
  assert result["decode_steps"] == 16
  assert result["generated_tokens_per_step"] == 16 * 8 * 16
  assert result["decode_ms_per_step"] == pytest.approx(1e3 * result["sample_s"] / 16)
  assert result["learner_s"] == pytest.approx(result["rl_step_s"] - result["sample_s"])

  # Bytes a decode step reads: fp32 weights of the whole model; K and V of every layer's full
  # cache (B rows, S+T slots, 2 kv heads of 32).
  n = result["params"]["total"]
  mc = bench.parse(bench.shape_config("tiny")).model.arch
  assert n == bench._count_params(mc)
  assert result["sampler_weight_bytes"] == 4 * n
  assert result["kv_cache_bytes_per_decode_step"] == 128 * 4 * 2 * 2 * 32 * (13 + 16) * 4
  assert result["params"]["body"] == n - 64 * 128  # tied: the embedding is the output layer
  flops = 6 * result["params"]["body"] * 128 * 29 + 6 * 64 * 128 * 128 * 16
  flops += 12 * 4 * 4 * 32 * 29 * 128 * 29
  assert result["learner_flops_per_step"] == pytest.approx(flops)
  assert result["learner_tflops_per_s"] == pytest.approx(flops / result["learner_s"] / 1e12)

  # The honest floor: the KV slots filled by step i (S + i + 1), averaged over the 16 steps,
  # and what the staged attention reads (kv_block 128 >= T: one stage over all S+T slots).
  slot = 128 * 4 * 2 * 2 * 32 * 4
  assert result["config"]["kv_block"] == 128
  assert result["kv_filled_bytes_per_decode_step"] == slot * (13 + 17 / 2)
  assert result["kv_read_bytes_per_decode_step"] == result["kv_cache_bytes_per_decode_step"]
  assert result["kv_filled_bytes_per_decode_step"] < result["kv_cache_bytes_per_decode_step"]
  filled = result["decode_filled_bytes_per_step"]
  assert filled == 4 * n + result["kv_filled_bytes_per_decode_step"]
  assert filled < result["decode_bytes_per_step"]

  # A CPU has no spec-sheet limits: the percentages are null.
  assert result["decode_hbm_roofline_pct"] is None and result["learner_mfu_pct"] is None
  assert "decode_filled_floor_pct" in result and result["decode_filled_floor_pct"] is None
  mem = result["compiled_step_memory"]
  assert mem["argument_bytes"] > 0 and mem["temp_bytes"] > 0
  assert "peer" not in result


@pytest.mark.extended
def test_sample_only_times_the_sampler_alone_with_the_same_decode_figures():
  """`--sample_only` (the decode goal's measurement in a short GPU invocation): no fused step is
  compiled; the sampler's figures are those of the full bench's, at the same shape."""
  result = bench.run(bench.shape_config("tiny"), steps=2, shape="tiny", sample_only=True)
  json.dumps(result)
  for key in ("rl_step_s", "compile_s", "learner_s", "learner_tflops_per_s"):
    assert result[key] is None, key
  assert result["step_times_s"] == [] and result["compiled_step_memory"] is None
  assert result["decode_steps"] == 16 and result["sample_s"] > 0
  assert result["generated_tokens_per_step"] == 16 * 8 * 16
  assert result["decode_ms_per_step"] == pytest.approx(1e3 * result["sample_s"] / 16)
  assert result["kv_filled_bytes_per_decode_step"] == 128 * 4 * 2 * 2 * 32 * 4 * (13 + 17 / 2)


def _bench_cli(*args: str) -> subprocess.CompletedProcess:
  cmd = [sys.executable, "tools/bench.py", *args]
  return subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=600)


@pytest.mark.extended
def test_the_bench_command_line_takes_settings_and_device_limits():
  """`python tools/bench.py --shape=tiny --set=FIELD=VALUE --hbm_bytes_per_s --peak_flops`
  prints one JSON object: the setting applied (a bf16 sampler copy: 2 bytes a parameter), and
  the percentages computed from the limits given (on a CPU they are null without them)."""
  hbm, peak = 1e11, 1e12
  proc = _bench_cli(
    "--shape=tiny", "--steps=1", "--set=sampling.param_dtype=bfloat16",
    f"--hbm_bytes_per_s={hbm}", f"--peak_flops={peak}",
  )  # fmt: skip
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = json.loads(proc.stdout)
  assert got["config"]["sampler_param_dtype"] == "bfloat16" and got["shape"] == "tiny"
  assert got["sampler_weight_bytes"] == 2 * got["params"]["total"]
  step_s = got["decode_ms_per_step"] / 1e3
  assert got["decode_hbm_roofline_pct"] == pytest.approx(
    100 * got["decode_bytes_per_step"] / step_s / hbm, rel=1e-6
  )
  assert got["decode_filled_floor_pct"] == pytest.approx(
    100 * got["decode_filled_bytes_per_step"] / step_s / hbm, rel=1e-6
  )
  assert got["learner_mfu_pct"] == pytest.approx(100 * got["learner_tflops_per_s"] * 1e12 / peak)


@pytest.mark.parametrize(
  "args, says",
  [(["--shape=tiny", "--set=sampling.nope=1"], "unknown config field 'sampling.nope'"),
   (["--config=configs/default.py", "--config.sampling.temperature=-1"],
    "invalid config: sampling.temperature=-1.0 must be >= 0.01"),
   (["--shape=tiny", "--sample_only", "--peer=trl"], "--sample_only times our sampler alone")],
  ids=["unknown-field", "out-of-range", "sample-only-peer"],
)  # fmt: skip
def test_a_bad_bench_setting_is_one_error_line_and_exit_2(args, says):
  """A bad field or value given to tools/bench.py (by --set or --config.FIELD): its last line
  is `error: ...` naming it, no traceback, exit 2, before anything compiles."""
  proc = _bench_cli("--steps=1", *args)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("error: ") and says in last, last


def test_decode_bytes_count_the_whole_cache_the_filled_slots_and_the_staged_reads():
  """S = 3, T = 5, 4 steps taken, stages of 2 steps (ends 2, 4, 5): step i fills S + i + 1
  slots (4, 5, 6, 7: mean 5.5) and reads S + its stage's end (5, 5, 7, 7: mean 6), of S+T = 8."""
  mc = types.SimpleNamespace(compute_dtype="float32", num_layers=2, num_kv_heads=1, head_dim=4)
  params = {"w": jax.ShapeDtypeStruct((10, 3), np.float32)}
  got = bench.decode_bytes(params, mc, 2, 3, 5, steps=4, kv_block=2)
  slot = 2 * 2 * 2 * 1 * 4 * 4  # B rows, L layers, K and V, J heads, Dh, float32
  assert got == {
    "sampler_weight_bytes": 120,
    "kv_cache_bytes_per_decode_step": slot * 8,
    "kv_filled_bytes_per_decode_step": slot * 5.5,
    "kv_read_bytes_per_decode_step": slot * 6,
  }
  whole = bench.decode_bytes(params, mc, 2, 3, 5, steps=4, kv_block=0)
  assert whole["kv_read_bytes_per_decode_step"] == whole["kv_cache_bytes_per_decode_step"]
  full = bench.decode_bytes(params, mc, 2, 3, 5)  # steps 0: all T = 5 (mean fill S + 3)
  assert full["kv_filled_bytes_per_decode_step"] == slot * 6


def test_device_limits_come_from_the_table_or_the_flags():
  h100 = bench.device_limits("gpu", "NVIDIA H100 80GB HBM3")
  assert (h100["hbm_bytes_per_s"], h100["peak_flops"]) == (3.35e12, 989e12)
  assert bench.device_limits("gpu", "NVIDIA H200")["hbm_bytes_per_s"] == 4.8e12
  assert bench.device_limits("tpu", "TPU v5 lite")["peak_flops"] == 197e12
  measured = bench.device_limits("gpu", "NVIDIA H100 80GB HBM3", 3.0e12, 8.0e14)
  assert (measured["hbm_bytes_per_s"], measured["peak_flops"]) == (3.0e12, 8.0e14)
  assert measured["source"]["peak_flops"] == "flag"
  cpu = bench.device_limits("cpu", "cpu")
  assert cpu["hbm_bytes_per_s"] is None and cpu["peak_flops"] is None
  assert bench.device_limits("cpu", "cpu", 1e11, 1e12)["peak_flops"] == 1e12
  assert bench.device_limits("gpu", "Unknown Accelerator")["peak_flops"] is None


# The shapes of random-init models (smollm2-135m reads a fetched checkpoint: its own tests).
RANDOM_INIT_SHAPES = [n for n in bench.SHAPE_NAMES if "model.checkpoint" not in bench._shapes()[n]]
HF_FIXTURES = REPO / "tests" / "fixtures" / "hf"


@pytest.mark.parametrize("shape", RANDOM_INIT_SHAPES)
def test_shapes_and_the_peer_spec_need_no_device(shape):
  config = bench.shape_config(shape, ["train.num_steps=7"])
  assert config.train.num_steps == 7
  assert config.rl.num_epochs == config.rl.num_minibatches == 1
  if config.model.moe_num_experts:  # TRL's peer is a dense transformers model
    with pytest.raises(bench.ConfigError, match="needs a dense model"):
      bench.peer_spec(config, steps=3)
    return
  spec = bench.peer_spec(config, steps=3)
  assert spec["prompt_len"] == 13 and spec["steps"] == 3 and spec["checkpoint"] == ""
  assert bench.model_source(config) == "random-init"
  assert spec["attention_bias"] == shape.startswith("qwen")
  if shape not in ("tiny", "medium"):  # the real-size shapes: 8 x 8, bf16 compute
    assert spec["compute_dtype"] == "bfloat16"
    assert spec["param_dtype"] == "float32" and spec["gradient_checkpointing"]
    assert (spec["prompts"], spec["group_size"]) == (8, 8)
  else:
    assert spec["compute_dtype"] == "float32" and not spec["gradient_checkpointing"]
    assert (spec["prompts"], spec["group_size"]) == (16, 8)
  rows = spec["prompts"] * spec["group_size"]
  seq = spec["prompt_len"] + spec["max_new_tokens"]
  assert rows % spec["microbatches"] == 0
  assert rows // spec["microbatches"] * seq <= config.rl.microbatch_tokens or (
    rows == spec["microbatches"]
  )


def test_a_checkpoint_set_on_a_shape_gives_the_peer_its_path_and_dimensions():
  """`--set=model.checkpoint=DIR` on the tiny shape: the run's architecture, and so the peer's
  spec, is the checkpoint's config.json (tiny Llama: 2 layers of 32, 4/2 heads of 8, untied),
  not the shape's model fields; the config's dtypes and adapters still apply; the peer loads
  the weights from the absolute path. A directory without config.json is one ConfigError."""
  llama = HF_FIXTURES / "llama"
  config = bench.shape_config("tiny", [f"model.checkpoint={llama}", "model.lora_rank=4"])
  spec = bench.peer_spec(config, steps=1)
  assert spec["checkpoint"] == str(llama) == bench.model_source(config)
  dims = ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim")
  assert [spec[k] for k in (*dims, "mlp_dim")] == [64, 32, 2, 4, 2, 8, 64]
  assert not spec["tie_embeddings"] and not spec["attention_bias"]
  assert spec["rope_theta"] == 500000.0 and spec["norm_eps"] == 1e-6
  assert spec["param_dtype"] == "float32" and spec["lora_rank"] == 4
  assert (spec["prompts"], spec["group_size"], spec["prompt_len"]) == (16, 8, 13)
  relative = bench.shape_config("tiny", ["model.checkpoint=tests/fixtures/hf/qwen2"])
  cwd = os.getcwd()
  try:
    os.chdir(REPO)
    qwen2 = bench.peer_spec(relative, steps=1)
  finally:
    os.chdir(cwd)
  assert qwen2["checkpoint"] == str(HF_FIXTURES / "qwen2")  # absolute: the peer's cwd differs
  assert qwen2["attention_bias"] and qwen2["tie_embeddings"]
  with pytest.raises(bench.ConfigError, match=r"has no config\.json") as err:
    bench.peer_spec(bench.shape_config("tiny", [f"model.checkpoint={HF_FIXTURES}"]), steps=1)
  assert "\n" not in str(err.value)


def test_peer_tokenizer_gives_one_token_per_word_at_a_real_vocabulary():
  """The peer's word-level tokenizer at SmolLM2's 49152 ids: each of the 13 random words is the
  one token it names; the special words (t0 pad, t1 unk, t2 eos) never match inside another
  word (`t13` is one token, not `t1` and an unknown `3`)."""
  pytest.importorskip("transformers")
  peer_trl = _load("peer_trl")
  spec = {"seed": 0, "vocab_size": 49152, "prompt_len": 13}
  tokenizer = peer_trl.build_tokenizer(spec["vocab_size"])
  assert (len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id) == (49152, 0, 2)
  dataset = peer_trl.prompts_dataset(spec, 64)
  peer_trl.check_prompts(tokenizer, dataset, spec)  # raises on a prompt of other ids
  assert tokenizer("t13 t2 t21 t0 t49151")["input_ids"] == [13, 2, 21, 0, 49151]


@pytest.mark.extended
def test_trl_peer_loads_a_checkpoint_of_the_specs_dimensions_only():
  """The spec's `checkpoint` (tiny Qwen2: qkv bias, tied) is what the peer trains: transformers'
  model of that directory, as many parameters as ours, 13-token prompts, full-length
  completions, and `peer_setup` saying how it ran. A spec whose dimensions are not the
  checkpoint's is one error line (exit 2), before any training."""
  python = _peer_python("trl")
  qwen2 = HF_FIXTURES / "qwen2"
  micro = ["rl.num_prompts=2", "sampling.group_size=2", "sampling.max_new_tokens=4"]
  config = bench.shape_config("tiny", [f"model.checkpoint={qwen2}", *micro])
  spec = bench.peer_spec(config, steps=1)
  result = bench.run_peer("trl", spec, python, timeout_s=600)
  assert "error" not in result, result
  assert result["model_class"] == "Qwen2ForCausalLM"
  assert result["num_params"] == result["trainable_params"] == 20768
  assert result["num_params"] == bench._count_params(bench.model_arch(config))
  assert result["prompt_length_min"] == result["prompt_length_max"] == 13
  assert result["completion_length_min"] == result["completion_length_max"] == 4
  setup = result["peer_setup"]
  assert setup["model_source"] == str(qwen2) and setup["generation"].startswith("transformers")
  assert (setup["param_dtype"], setup["compute_dtype"]) == ("float32", "float32")
  assert setup["gradient_checkpointing"] is False and setup["torch_compile"] is False

  wrong = bench.run_peer("trl", spec | {"d_model": 64, "num_layers": 3}, python, timeout_s=600)
  assert wrong["error"].startswith("exit status 2: checkpoint "), wrong
  assert "d_model 64 != 32" in wrong["error"] and "num_layers 3 != 2" in wrong["error"]
  assert "Traceback" not in wrong["output_tail"]


@pytest.mark.extended
def test_the_static_cache_peer_generates_with_transformers_static_cache():
  """`--peer_cache=static`: the peer's generation uses transformers' static KV cache (compiled
  only on a GPU, and `peer_setup` says which), full length; an unknown cache is one line."""
  python = _peer_python("trl")
  micro = ["rl.num_prompts=2", "sampling.group_size=2", "sampling.max_new_tokens=4"]
  config = bench.shape_config("tiny", [f"model.checkpoint={HF_FIXTURES / 'qwen2'}", *micro])
  spec = bench.peer_spec(config, steps=1, cache="static")
  result = bench.run_peer("trl", spec, python, timeout_s=600)
  assert "error" not in result, result
  assert result["completion_length_min"] == result["completion_length_max"] == 4
  setup = result["peer_setup"]
  assert setup["kv_cache"] == "static"
  on_cpu = result["peak_memory_kind"] == "peak_rss"
  assert setup["generation_compiled"] is not on_cpu  # transformers compiles it on a GPU only
  bad = bench.run_peer("trl", spec | {"cache": "paged"}, python, timeout_s=600)
  assert "cache='paged'; allowed: dynamic, static" in bad["error"], bad


@pytest.mark.extended  # ~30 s: both sides compile and run a (micro) step
def test_bench_and_peer_both_start_from_the_checkpoint():
  """`--peer=trl --set=model.checkpoint=DIR`: ours loads the checkpoint's weights and the
  peer the same directory's; both say so, at the same parameter count and prompt length."""
  _peer_python("trl")
  qwen2 = HF_FIXTURES / "qwen2"
  micro = ["rl.num_prompts=2", "sampling.group_size=2", "sampling.max_new_tokens=4"]
  config = bench.shape_config("tiny", [f"model.checkpoint={qwen2}", *micro])
  result = bench.run(config, steps=1, shape="tiny", peer="trl", peer_python=PEER_PYTHON)
  json.dumps(result)
  peer = result["peer"]
  assert "error" not in peer and "warning" not in peer, peer
  assert result["model_source"] == peer["peer_setup"]["model_source"] == str(qwen2)
  assert result["config"]["model"] == bench.model_arch(config).to_dict()
  assert result["config"]["model"]["d_model"] == 32 and result["config"]["prompt_len"] == 13
  assert result["params"]["total"] == peer["num_params"] == 20768
  assert peer["ratios"]["step_time"] > 0


@pytest.mark.extended  # fetches SmolLM2-135M-Instruct once (the `smollm2` fixture)
def test_smollm2_shape_is_the_real_model_on_both_sides(smollm2):
  """The smollm2-135m shape: the architecture is the checkpoint's (30 layers of 576, 9 query
  and 3 KV heads of 64, MLP 1536, 49152 ids, tied, no bias: 134,515,008 parameters), a small
  fp32 CPU run (2 prompts x 8, 13 + 64 tokens), and the peer loads the same directory, whose
  transformers config agrees with the spec; `model.lora_rank=16` gives both sides rank-16
  adapters on the seven projections."""
  path, _ = smollm2
  config = bench.shape_config("smollm2-135m")
  spec = bench.peer_spec(config, steps=3)
  assert spec["checkpoint"] == os.path.abspath(path) == bench.model_source(config)
  dims = ("num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim", "mlp_dim")
  assert [spec[k] for k in (*dims, "vocab_size")] == [30, 576, 9, 3, 64, 1536, 49152]
  assert spec["tie_embeddings"] and not spec["attention_bias"]
  assert bench._count_params(bench.model_arch(config)) == 134_515_008
  assert (spec["prompts"], spec["group_size"], spec["prompt_len"]) == (2, 8, 13)
  assert spec["max_new_tokens"] == 64 and spec["lora_rank"] == 0
  assert spec["param_dtype"] == spec["compute_dtype"] == "float32"
  lora = bench.peer_spec(bench.shape_config("smollm2-135m", ["model.lora_rank=16"]), steps=3)
  assert lora["lora_rank"] == 16 and len(lora["lora_targets"]) == 7
  assert {k: v for k, v in lora.items() if not k.startswith("lora_")} == {
    k: v for k, v in spec.items() if k != "lora_rank"
  }
  transformers = pytest.importorskip("transformers")
  peer_trl = _load("peer_trl")
  assert peer_trl.dims_mismatch(spec, transformers.AutoConfig.from_pretrained(path)) == []


def test_peer_needs_one_update_per_rollout():
  config = bench.shape_config("tiny", ["rl.num_minibatches=2"])
  with pytest.raises(bench.ConfigError, match="one optimiser update"):
    bench.peer_spec(config, steps=1)


MICRO = ["model.d_model=32", "model.num_layers=1", "model.mlp_dim=64", "rl.num_prompts=2"]
MICRO += ["sampling.group_size=2", "sampling.max_new_tokens=4", "model.attention_bias=True"]


@pytest.mark.extended
def test_trl_peer_at_a_micro_shape():
  python = _peer_python("trl")
  config = bench.shape_config("tiny", MICRO)
  spec = bench.peer_spec(config, steps=1)
  assert spec["lora_rank"] == 0 and "lora_targets" not in spec
  result = bench.run_peer("trl", spec, python, timeout_s=600)
  assert "error" not in result, result
  assert result["model_class"] == "Qwen2ForCausalLM"  # qkv bias, as ours
  assert result["num_params"] == bench._count_params(bench.parse(config).model.arch)
  assert result["trainable_params"] == result["num_params"]  # no adapters: all of it trains
  assert result["completion_length_min"] == result["completion_length_max"] == 4
  assert len(result["step_times_s"]) == 2 and result["step_s"] > 0 and result["sample_s"] > 0
  assert result["peak_memory_bytes"] > 0


def test_peer_spec_carries_the_lora_adapters_by_their_hugging_face_names():
  lora = ["model.lora_rank=4", "model.lora_alpha=8", "model.lora_dropout=0.1"]
  spec = bench.peer_spec(bench.shape_config("tiny", [*lora, "model.lora_targets=q,v"]), steps=1)
  assert (spec["lora_rank"], spec["lora_alpha"], spec["lora_dropout"]) == (4, 8.0, 0.1)
  assert spec["lora_targets"] == ["q_proj", "v_proj"]
  hf_named = bench.shape_config("tiny", [*lora, "model.lora_targets=o_proj,up"])
  assert bench.peer_spec(hf_named, steps=1)["lora_targets"] == ["o_proj", "up_proj"]
  plain = bench.peer_spec(bench.shape_config("tiny"), steps=1)
  assert [k for k in plain if k.startswith("lora_")] == ["lora_rank"] and plain["lora_rank"] == 0


def test_peer_refuses_an_int8_lora_base():
  config = bench.shape_config("tiny", ["model.lora_rank=4", "model.lora_base_dtype=int8"])
  with pytest.raises(bench.ConfigError) as err:
    bench.peer_spec(config, steps=1)
  message = str(err.value)
  assert message.startswith("--peer needs") and "\n" not in message
  assert "model.lora_base_dtype" in message and "int8" in message and "bitsandbytes" in message


def test_peer_spec_without_lora_fields_is_still_complete():
  """A spec from before LoRA (no lora_* fields) trains every parameter, as it did."""
  peer_trl = _load("peer_trl")
  spec = bench.peer_spec(bench.shape_config("tiny"), steps=1)
  del spec["lora_rank"]
  assert peer_trl.missing_fields(spec) == []
  assert peer_trl.missing_fields(spec | {"lora_rank": 2}) == list(peer_trl.LORA_FIELDS)


@pytest.mark.extended
def test_trl_peer_trains_as_many_lora_parameters_as_ours():
  python = _peer_python("trl", "peft", "torch")
  from jaxrl_llm.models import hf, lora

  lora_set = ["model.lora_rank=4", "model.lora_alpha=8", "model.lora_dropout=0.05"]
  config = bench.shape_config("tiny", MICRO + lora_set)  # all seven projections adapted
  adapters = lora.split_adapters(hf.abstract_params(bench.parse(config).model.arch))[1]
  ours = sum(x.size for x in jax.tree.leaves(adapters))
  # r * (in + out) per projection: q, o 32 <-> 4x32; k, v 32 -> 2x32; gate, up, down 32 <-> 64.
  assert ours == 4 * (2 * (32 + 128) + 2 * (32 + 64) + 3 * (32 + 64))
  spec = bench.peer_spec(config, steps=1)
  result = bench.run_peer("trl", spec, python, timeout_s=600)
  assert "error" not in result, result
  assert result["trainable_params"] == ours
  assert result["trainable_dtypes"] == ["float32"]  # PEFT's adapters in float32, as ours
  assert result["num_params"] == bench._count_params(bench.parse(config).model.arch)
  projections = ("q", "k", "v", "o", "gate", "up", "down")
  assert result["spec"]["lora_targets"] == [f"{p}_proj" for p in projections]
  assert result["completion_length_min"] == result["completion_length_max"] == 4
  assert "peft" in result["versions"]


def test_grouped_sweep_tries_the_settings_in_use_and_only_valid_ones():
  """`tools/bench_grouped.py --sweep`'s grid holds the block sizes each Mosaic kernel uses now
  (so the sweep measures its own baseline) at the shapes of the MoE presets, and every setting
  tiles that kernel's output width."""
  bg = _load("bench_grouped")
  for k, n in ((1024, 384), (2048, 768), (4096, 14336), (128, 192)):
    for kernel, out in (("forward", n), ("input_grad", k), ("weight_grad", n)):
      settings = bg.sweep_settings(kernel, k, n)
      assert bg._in_use(kernel, k, n) in settings, (kernel, k, n)
      assert all(out % (s["block_n"] * s["grid_block_n"]) == 0 for s in settings)
      assert len(settings) == len({tuple(s.values()) for s in settings}) >= 6


@pytest.mark.extended
def test_grouped_sweep_checks_each_setting_against_ragged_dot_in_the_interpreter():
  """A sweep row of the forward kernel (under the Pallas GPU interpreter on CPU) carries its
  relative error against `jax.lax.ragged_dot` and its timings; a setting the kernel refuses
  becomes a row with the error, not a crash."""
  from jax._src.pallas.mosaic_gpu.interpret.params import force_gpu_interpret_mode

  bg = _load("bench_grouped")
  m, k, n = 256, 128, 192  # rows past the groups' 200, as `grouped.kernel_matmul` pads
  kx, kw, kd = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(kx, (m, k), jax.numpy.bfloat16)
  w = jax.random.normal(kw, (4, k, n), jax.numpy.bfloat16)
  dy = jax.random.normal(kd, (m, n), jax.numpy.bfloat16)
  args = (x, w, dy, jax.numpy.asarray([37, 0, 100, 63], jax.numpy.int32))
  want = bg.REFERENCES["forward"](*args)
  blocks = bg.sweep_settings("forward", k, n)
  with force_gpu_interpret_mode():
    rows = [bg._sweep_row("forward", b, args, want, iters=1) for b in (blocks[0], blocks[-1])]
    bad = bg._sweep_row("forward", {**blocks[0], "block_k": 48}, args, want, iters=1)
  for row in rows:
    assert "error" not in row, row
    assert row["rel_error"] <= bg.TOLERANCE and row["ms"] > 0 and row["ms_synced"] > 0
  assert rows[0]["block_m"] != rows[1]["block_m"]
  assert "error" in bad and "block_k" in bad["error"]


def test_bench_pack_takes_the_users_settings_on_either_base():
  """tools/bench_pack.py --set: typed overrides on configs/default.py and on a bench shape, and
  a mistyped field is named."""
  bench_pack = _load("bench_pack")
  default = bench_pack.base_config("default", ["model.scan_layers=true", "seed=7"])
  assert default.model.scan_layers is True and default.seed == 7
  medium = bench_pack.base_config("medium", ["model.scan_layers=true"])
  assert medium.model.scan_layers is True and medium.model.d_model == 256
  assert bench_pack.base_config("medium").model.scan_layers is False
  with pytest.raises((KeyError, AttributeError, ValueError), match="scan_layer"):
    bench_pack.base_config("medium", ["model.scan_layer=true"])
