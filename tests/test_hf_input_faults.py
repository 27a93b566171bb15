"""Malformed Hugging Face checkpoints are refused in one line naming the file and the field or
tensor, never read as another model: a boolean field holding a string, a rope_theta of 0 or an
explicit null one, non-finite weights, a non-string file in the index's weight_map. An `import
--out` never replaces a meta.json that is already there.
"""

import json
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, cli_env
from safetensors.numpy import load_file, save_file

from jaxrl_llm.models import hf
from jaxrl_llm.models.hf_config import CheckpointFormatError, config_from_hf

FIXTURES = REPO / "tests" / "fixtures" / "hf"
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


def _copy(tmp_path: pathlib.Path, name: str = "llama") -> pathlib.Path:
  """A copy of the fixture checkpoint `name` under `tmp_path`."""
  return pathlib.Path(shutil.copytree(FIXTURES / name, tmp_path / name))


def _config(name: str, **changes) -> dict:
  """The config.json dict of fixture `name` with `changes`."""
  return {**json.loads((FIXTURES / name / "config.json").read_text()), **changes}


def _refused(hf_config: dict, source: str = "config.json") -> str:
  """The one-line CheckpointFormatError that config_from_hf raises for `hf_config`."""
  with pytest.raises(CheckpointFormatError) as e:
    config_from_hf(hf_config, source=source)
  assert "\n" not in str(e.value), e.value
  return str(e.value)


def test_a_string_tie_word_embeddings_is_refused_not_read_as_tied(tmp_path):
  """ "false" is a true string: read with bool() it tied the embeddings and dropped lm_head."""
  d = _copy(tmp_path)
  (d / "config.json").write_text(json.dumps(_config("llama", tie_word_embeddings="false")))
  with pytest.raises(CheckpointFormatError) as e:
    hf.load_checkpoint(d)
  assert str(e.value) == (
    f"{d / 'config.json'}: tie_word_embeddings='false' must be true or false (a JSON boolean)"
  )


@pytest.mark.parametrize(
  "name, key, value",
  [
    ("llama", "attention_bias", "false"),
    ("llama", "mlp_bias", "false"),
    ("llama", "tie_word_embeddings", 0),
    ("qwen2", "use_sliding_window", "false"),
    ("qwen3_moe", "norm_topk_prob", "true"),
    ("qwen3_moe", "tie_word_embeddings", 1),
  ],
)
def test_boolean_fields_must_hold_json_booleans(name, key, value):
  """Each boolean field config.json is read for: a string or number is named, not misread."""
  line = _refused(_config(name, **{key: value}), source="x/config.json")
  assert line == f"x/config.json: {key}={value!r} must be true or false (a JSON boolean)"
  for ok in (True, False, None):  # null: the family's default, as before
    if not (ok and key in ("attention_bias", "mlp_bias", "use_sliding_window")):
      config_from_hf(_config(name, **{key: ok}))


@pytest.mark.parametrize(
  "changes, want",
  [
    (
      {"rope_parameters": {"rope_theta": 0, "rope_type": "default"}},
      "rope_parameters.rope_theta=0",
    ),
    ({"rope_parameters": None, "rope_theta": 0}, "rope_theta=0"),
    ({"rope_parameters": None, "rope_theta": -5.0}, "rope_theta=-5.0"),
    ({"rope_parameters": None, "rope_theta": float("inf")}, "rope_theta=inf"),
    ({"rope_parameters": {"rope_theta": "5e5"}}, "rope_parameters.rope_theta='5e5'"),
  ],
)
def test_a_rope_theta_that_is_not_a_positive_number_is_refused(changes, want):
  """0 used to become the family's default 10000; a string was converted with float()."""
  line = _refused(_config("llama", **changes), source="x/config.json")
  assert line == f"x/config.json: {want} must be a finite number > 0", line


HUGE = 10**400  # a valid JSON integer no float holds


@pytest.mark.parametrize(
  "changes, want",
  [
    ({"rms_norm_eps": HUGE}, f"rms_norm_eps={HUGE!r} must be a finite number > 0"),
    ({"rms_norm_eps": float("inf")}, "rms_norm_eps=inf must be a finite number > 0"),
    (
      {"router_aux_loss_coef": float("inf")},
      "router_aux_loss_coef=inf must be a finite number >= 0",
    ),
    (
      {"rope_parameters": None, "rope_theta": HUGE},
      f"rope_theta={HUGE!r} must be a finite number > 0",
    ),
    (
      {"rope_parameters": {"rope_type": "linear", "factor": float("inf")}},
      "unsupported llama config: rope_parameters.factor=inf must be a finite number > 0",
    ),
    (
      {"rope_parameters": {"rope_type": "linear", "factor": HUGE}},
      f"unsupported llama config: rope_parameters.factor={HUGE!r} must be a finite number > 0",
    ),
    (
      {"rope_parameters": {"rope_type": "linear", "factor": "2"}},
      "unsupported llama config: rope_parameters.factor='2' must be a finite number > 0",
    ),
    (
      {"rope_parameters": {"rope_type": "linear", "factor": True}},
      "unsupported llama config: rope_parameters.factor=True must be a finite number > 0",
    ),
    (
      {
        "rope_parameters": {
          "rope_type": "llama3",
          "factor": 8.0,
          "low_freq_factor": 1.0,
          "high_freq_factor": float("inf"),
          "original_max_position_embeddings": 8192.5,
        }
      },
      "unsupported llama config: rope_parameters.high_freq_factor=inf must be a finite number "
      "> 0; rope_parameters.original_max_position_embeddings=8192.5 must be an integer >= 1",
    ),
    (
      {"jaxrl_llm": {"moe_z_loss_coef": "x"}},
      "invalid model config: model.moe_z_loss_coef='x' must be a number",
    ),
    (
      {"jaxrl_llm": {"moe_aux_loss_coef": "x"}},
      "invalid model config: model.moe_aux_loss_coef='x' must be a number",
    ),
    (
      {"jaxrl_llm": {"moe_z_loss_coef": float("nan")}},
      "invalid model config: model.moe_z_loss_coef=nan must be a finite number",
    ),
    (
      {"jaxrl_llm": {"lora_rank": 2.5}},
      "invalid model config: model.lora_rank=2.5 must be an integer",
    ),
  ],
)
def test_a_number_no_float_holds_or_of_the_wrong_kind_is_refused_in_one_line(changes, want):
  """A 400-digit rms_norm_eps or rope_theta raised OverflowError with a traceback; an infinite
  norm epsilon (JSON's Infinity) or RoPE factor, a string or boolean factor and a fractional
  original length were taken (an infinite epsilon zeroes every normalised activation); a string
  in the `jaxrl_llm` extras was named only by Python's comparison error."""
  line = _refused(_config("llama", **changes), source="x/config.json")
  assert line == f"x/config.json: {want}", line


def test_a_null_rope_theta_in_rope_parameters_is_refused(tmp_path):
  """An explicit null beside a real top-level rope_theta used to become 10000; transformers keeps
  the null (and fails building the rotary embedding), so it is refused."""
  d = _copy(tmp_path)
  rope = {"rope_theta": None, "rope_type": "default"}
  (d / "config.json").write_text(
    json.dumps(_config("llama", rope_parameters=rope, rope_theta=500000.0))
  )
  with pytest.raises(CheckpointFormatError) as e:
    hf.load_checkpoint(d)
  assert str(e.value) == (
    f"{d / 'config.json'}: rope_parameters.rope_theta=None must be a finite number > 0 "
    "(or omitted, to use the top-level rope_theta or the default)"
  )
  # Omitted from rope_parameters, the top-level value applies.
  del rope["rope_theta"]
  cfg = config_from_hf(_config("llama", rope_parameters=rope, rope_theta=500000.0))
  assert cfg.rope_theta == 500000.0


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weights_are_refused_naming_the_file_and_tensor(tmp_path, bad):
  """A NaN or inf weight loaded silently; the run later blamed its learning rate."""
  d = _copy(tmp_path)
  index = json.loads((d / "model.safetensors.index.json").read_text())
  file = d / index["weight_map"][Q_PROJ]
  tensors = load_file(file)
  tensors[Q_PROJ] = tensors[Q_PROJ].copy()
  tensors[Q_PROJ][1, 2] = bad
  save_file(tensors, file, metadata={"format": "pt"})
  with pytest.raises(CheckpointFormatError) as e:
    hf.load_checkpoint(d)
  assert str(e.value) == f"{file}: tensor {Q_PROJ} holds non-finite values (NaN or inf)"


@pytest.mark.parametrize(
  "stored, value, param_dtype", [(np.float64, 1e300, None), (np.float32, 1e6, "float16")]
)
def test_a_weight_its_parameter_dtype_cannot_hold_is_refused(tmp_path, stored, value, param_dtype):
  """A finite float64 1e300 (or float32 1e6 read as float16) passed the stored dtype's check,
  became inf in the cast to the parameter dtype (with numpy's overflow warning) and loaded."""
  d = _copy(tmp_path)
  index = json.loads((d / "model.safetensors.index.json").read_text())
  file = d / index["weight_map"][Q_PROJ]
  tensors = load_file(file)
  tensors[Q_PROJ] = tensors[Q_PROJ].astype(stored)
  tensors[Q_PROJ][1, 2] = value
  save_file(tensors, file, metadata={"format": "pt"})
  want = "float32" if param_dtype is None else param_dtype
  with pytest.raises(CheckpointFormatError) as e:
    hf.load_checkpoint(d, **({} if param_dtype is None else {"param_dtype": param_dtype}))
  assert str(e.value) == (
    f"{file}: tensor {Q_PROJ} holds values beyond the range of {want}, the parameter dtype it "
    "is read as; allowed: a wider parameter dtype, or weights within its range"
  )


def test_a_bf16_nan_weight_is_refused(tmp_path):
  """bfloat16 tensors take another read path; a NaN among them is refused too."""
  d = _copy(tmp_path, "llama3_rope_bf16")
  file = next(d.glob("*.safetensors"))
  with open(file, "rb") as f:
    n = int.from_bytes(f.read(8), "little")
    header = json.loads(f.read(n))
  name = next(k for k in header if k.endswith("q_proj.weight"))
  assert header[name]["dtype"] == "BF16"
  data = bytearray(file.read_bytes())
  at = 8 + n + header[name]["data_offsets"][0]
  data[at : at + 2] = b"\xc0\x7f"  # a bfloat16 NaN, little-endian
  file.write_bytes(bytes(data))
  with pytest.raises(CheckpointFormatError) as e:
    hf.load_checkpoint(d)
  assert str(e.value) == f"{file}: tensor {name} holds non-finite values (NaN or inf)"


@pytest.mark.parametrize("value", [3, None, ["model-00001-of-00003.safetensors"]])
def test_a_non_string_file_in_the_weight_map_is_refused(tmp_path, value):
  """A number in weight_map failed sorting its values: `'<' not supported between int and str`."""
  d = _copy(tmp_path)
  index = d / "model.safetensors.index.json"
  listed = json.loads(index.read_text())
  listed["weight_map"][Q_PROJ] = value
  index.write_text(json.dumps(listed))
  with pytest.raises(CheckpointFormatError) as e:
    hf.load_checkpoint(d)
  assert str(e.value) == (
    f"{index}: weight_map[{Q_PROJ!r}]={value!r} must be the name of a safetensors file (a string)"
  )


def test_import_never_overwrites_an_existing_meta_json(tmp_path):
  """`import --out` wrote over a meta.json already there (only params/ was checked): it is
  refused in one line before anything is read or written."""
  out = tmp_path / "out"
  out.mkdir()
  (out / "meta.json").write_text('{"mine": 1}\n')
  proc = subprocess.run(
    [sys.executable, str(REPO / "tools" / "hf_convert.py"), "import",
     f"--hf_dir={FIXTURES / 'llama'}", f"--out={out}"],
    cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120,
  )  # fmt: skip
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stderr.splitlines() == [
    f"error: {out}/meta.json: already exists; choose a new --out"
  ], proc.stderr
  assert proc.stdout == ""
  assert (out / "meta.json").read_text() == '{"mine": 1}\n'
  assert sorted(p.name for p in out.iterdir()) == ["meta.json"]


def test_a_checkpoint_architecture_from_a_config_json_that_is_not_json_is_one_line(tmp_path):
  """The architecture read for the config check (before the weights load) read config.json with
  a plain json.load: a damaged file was a JSONDecodeError traceback, not the loader's line."""
  from conftest import tiny_config

  from jaxrl_llm.config import parse
  from jaxrl_llm.run import from_checkpoint

  (tmp_path / "config.json").write_text('{"model_type": "llama", ')
  cfg = parse(tiny_config(**{"model.checkpoint": str(tmp_path)}))
  with pytest.raises(CheckpointFormatError, match=r"config\.json: not valid JSON"):
    from_checkpoint.architecture(cfg)


def test_a_layer_count_past_the_weights_is_refused_at_once(tmp_path):
  """num_hidden_layers=10**8: the tensor map was built layer by layer before any tensor was
  checked, and the import ran past any wait. Now one line, counted from the weights' names."""
  d = _copy(tmp_path)
  (d / "config.json").write_text(json.dumps(_config("llama", num_hidden_layers=10**8)))
  with pytest.raises(CheckpointFormatError) as e:
    hf.load_checkpoint(d)
  assert str(e.value) == (
    f"{d / 'config.json'}: num_hidden_layers=100000000, but the weights hold 2 layers; allowed: "
    "the number of model.layers.<i> the weight files hold"
  )


def test_a_peft_adapter_folder_as_a_checkpoint_is_one_line_naming_its_base(tmp_path, capsys):
  """The folder `hf_convert.py export --adapters=DIR` writes (adapter_config.json +
  adapter_model.safetensors, as PEFT's save_pretrained wrote the fixture) given as
  `model.checkpoint` or `import --hf_dir` said only `has no config.json` / `config.json not
  found`; now one line names the adapters, their base and what to point the setting at."""
  from conftest import refused

  adapters = tmp_path / "adapters"
  adapters.mkdir()
  for name in ("adapter_config.json", "adapter_model.safetensors"):
    shutil.copy(REPO / "tests" / "fixtures" / "peft" / "llama_lora" / name, adapters)
  base = json.loads((adapters / "adapter_config.json").read_text())["base_model_name_or_path"]
  workdir = tmp_path / "w"
  proc = subprocess.run(
    [sys.executable, "-m", "jaxrl_llm.main", f"--config={REPO / 'configs' / 'default.py'}",
     f"--config.model.checkpoint={adapters}", f"--workdir={workdir}"],
    cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120,
  )  # fmt: skip
  said = proc.stderr.strip().splitlines()
  assert proc.returncode == 2 and len(said) == 1 and said[0].startswith("error: "), proc.stderr
  assert said[0].startswith(f"error: model.checkpoint={str(adapters)!r} is a PEFT adapter folder")
  assert f"its base model: {base!r}" in said[0]
  assert "point it at the base model" in said[0] and "merge_and_unload()" in said[0]
  assert "hf_adapters.load_adapters" in said[0]
  assert not workdir.exists()
  sys.path.insert(0, str(REPO / "tools"))
  import hf_convert

  line = refused(capsys, hf_convert.cli, ["import", f"--hf_dir={adapters}"], "PEFT adapter")
  assert line.startswith(f"error: {adapters} is a PEFT adapter folder"), line
  assert f"its base model: {base!r}" in line and "merge_and_unload()" in line, line
  (adapters / "adapter_config.json").write_text("{")  # unreadable: said so, still one line
  line = refused(capsys, hf_convert.cli, ["import", f"--hf_dir={adapters}"], "PEFT adapter")
  assert "base model is unknown (adapter_config.json is not readable JSON)" in line, line
