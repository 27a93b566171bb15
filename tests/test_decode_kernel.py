"""The Pallas decode kernel over filled slots (`attention.filled_slots_beside`) against the einsum
decode step it replaces (`attention.one_query_beside`, the reference), run here by the Pallas
interpreter: values, the slots it reads, a whole sampler, `auto`'s choice and its refusals."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.kernels import attention
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.sampling import SamplingConfig, sample


def _case(b, h, j, dh, n, pads, seed=0, dtype=jnp.float32):
  ks = jax.random.split(jax.random.PRNGKey(seed), 5)
  q = jax.random.normal(ks[0], (b, 1, h, dh), dtype)
  keys, values = (jax.random.normal(k, (b, j, n, dh), dtype) for k in ks[1:3])
  own_k, own_v = (jax.random.normal(k, (b, j, 1, dh), dtype) for k in ks[3:5])
  key_valid = jnp.arange(n)[None, :] >= jnp.asarray(pads)[:, None]
  return q, keys, values, own_k, own_v, key_valid


@pytest.mark.parametrize(
  "h,j,n,pads,starts",
  [
    (4, 4, 48, (0, 5, 30), (30, 31, 47)),  # MHA; 3 splits of one 16-slot block
    (9, 3, 96, (0, 17, 40), (40, 41, 95)),  # SmolLM2's 9/3 heads; 3 splits of 32
    (8, 2, 256, (0, 130, 200), (200, 201, 255)),  # 2 splits of one 128-slot block
  ],
)
def test_the_kernel_equals_the_einsum_decode_step(h, j, n, pads, starts):
  """float32, every row left-padded differently, at several decode slots (the first of them:
  the most-padded row has no filled slot but its own key)."""
  args = _case(3, h, j, 16, n, pads)
  for start in starts:
    got = jax.jit(attention.filled_slots_beside)(*args, jnp.int32(start))
    want = jax.jit(attention.one_query_beside)(*args, jnp.int32(start))
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-5, err_msg=f"start={start}")


def test_the_kernel_reads_no_block_past_the_step_nor_a_split_of_padding():
  """NaN written into the cache's blocks after the one holding the decode slot, and into a
  whole split of left padding, leaves the kernel's output equal to its output over a clean
  cache (the einsum step, which reads every slot, turns NaN)."""
  n, start = 256, 200  # block_k 128, 2 splits: slots 0-127 and 128-255
  assert attention.decode_blocks(n) == (128, 2)
  q, keys, values, own_k, own_v, key_valid = _case(2, 4, 2, 16, n, (130, 0))
  clean = jax.jit(attention.filled_slots_beside)(
    q, keys, values, own_k, own_v, key_valid, jnp.int32(start)
  )
  n48 = attention.decode_blocks(48)
  assert n48 == (16, 3)
  poisoned_row0 = keys.at[0, :, :128].set(jnp.nan)  # row 0's padding split (its first is 130)
  poisoned = poisoned_row0, values.at[0, :, :128].set(jnp.nan)
  got = jax.jit(attention.filled_slots_beside)(
    q, *poisoned, own_k, own_v, key_valid, jnp.int32(start)
  )
  np.testing.assert_array_equal(got[0], clean[0])
  einsum = attention.one_query_beside(q, *poisoned, own_k, own_v, key_valid, jnp.int32(start))
  assert not np.all(np.isfinite(np.asarray(einsum[0])))
  # 48 slots in 3 blocks of 16: at slot 20 only blocks 0 and 1 are read
  q, keys, values, own_k, own_v, key_valid = _case(2, 4, 2, 16, 48, (0, 3), seed=1)
  step = jnp.int32(20)
  clean = jax.jit(attention.filled_slots_beside)(q, keys, values, own_k, own_v, key_valid, step)
  late = keys.at[:, :, 32:].set(jnp.nan), values.at[:, :, 32:].set(jnp.nan)
  got = jax.jit(attention.filled_slots_beside)(q, *late, own_k, own_v, key_valid, step)
  np.testing.assert_array_equal(got, clean)


def _tiny(attention_impl, prompt_len=16, scan_layers=False):
  from flax import linen as nn

  from jaxrl_llm.models.transformer import Transformer, positions_from_mask

  cfg = ModelConfig(vocab_size=40, d_model=64, num_heads=6, num_kv_heads=2, head_dim=16, mlp_dim=96)
  cfg = dataclasses.replace(cfg, scan_layers=scan_layers)
  tokens = jax.random.randint(jax.random.PRNGKey(0), (2, prompt_len), 3, cfg.vocab_size)
  mask = jnp.arange(prompt_len)[None, :] >= jnp.array([[5], [0]])  # row 0 left-padded by 5
  tokens = jnp.where(mask, tokens, 0)
  model = Transformer(cfg, attention=attention_impl)
  params = nn.unbox(model.init(jax.random.PRNGKey(1), tokens, positions_from_mask(mask), mask))
  return model, params["params"], tokens, mask


def _sampler(impl, cfg, prompt_len=16, scan_layers=False):
  model, params, tokens, mask = _tiny(impl, prompt_len, scan_layers)
  return jax.jit(lambda p, k: sample(model, p, tokens, mask, k, cfg)), params


@pytest.mark.slow
def test_the_scanned_layers_decode_by_the_kernel_asked_for():
  """model.attention reaches the scanned layers (scan_layers=True) as it reaches the unrolled
  ones: `pallas` puts the kernel in the decode loop, `einsum` does not, and the two samplers
  draw the same tokens (they decoded by `auto` whatever was asked before)."""
  cfg = SamplingConfig(max_new_tokens=8, group_size=2, eos_id=-1)
  key = jax.random.PRNGKey(7)
  outs = {}
  for impl in ("einsum", "pallas"):
    fn, params = _sampler(impl, cfg, scan_layers=True)
    calls = str(jax.make_jaxpr(fn)(params, key)).count("pallas_call")
    assert (calls > 0) == (impl == "pallas"), (impl, calls)
    outs[impl] = fn(params, key)
  np.testing.assert_array_equal(outs["pallas"].tokens, outs["einsum"].tokens)
  np.testing.assert_allclose(outs["pallas"].logprobs, outs["einsum"].logprobs, atol=2e-5)


@pytest.mark.extended
@pytest.mark.parametrize("kv_block", [16])  # decode stages of 16 steps (the staged path)
def test_a_sampler_on_the_kernel_equals_the_einsum_sampler(kv_block):
  """model.attention=pallas: the decode steps run the kernel (the prefill stays einsum) and the
  rollout's tokens and log-probs equal the einsum sampler's, sampled at temperature 1 with 2
  completions per prompt, 32 tokens after a 16-token prompt (one row left-padded by 5), with the
  einsum decode in one stage of 48 slots or in stages of 32 and 48."""
  cfg = SamplingConfig(max_new_tokens=32, group_size=2, eos_id=-1, kv_block=kv_block)
  key = jax.random.PRNGKey(7)
  outs = {}
  for impl in ("einsum", "pallas"):
    fn, params = _sampler(impl, cfg)
    calls = str(jax.make_jaxpr(fn)(params, key)).count("pallas_call")
    assert (calls > 0) == (impl == "pallas"), calls
    outs[impl] = fn(params, key)
  np.testing.assert_array_equal(outs["pallas"].tokens, outs["einsum"].tokens)
  np.testing.assert_allclose(outs["pallas"].logprobs, outs["einsum"].logprobs, atol=2e-5)


def test_auto_decodes_by_einsum_off_a_gpu_and_the_check_passes_interpreted():
  """`auto` picks the kernel only on a GPU (where its check passes); here the einsum step runs.
  The device check's interpreted form of the kernel passes on this CPU; its GPU form skips."""
  from jaxrl_llm import fast_paths  # noqa: F401 - registers the checks
  from jaxrl_llm.kernels import verify

  assert attention.select_decode("auto", jnp.bfloat16, jnp.bfloat16, 64, 96) == "einsum"
  assert attention.select_decode("pallas", jnp.bfloat16, jnp.bfloat16, 64, 96) == "pallas"
  assert attention.select("pallas", jnp.float32, 16, 0) == "einsum"  # prefill, learner
  result = verify.run_check("pallas_decode", verify.INTERPRETED)
  assert result.status == "pass" and result.error < result.tolerance, result
  assert verify.run_check("pallas_decode").status == "skip"


def test_shapes_the_kernel_cannot_serve_are_refused_in_one_line():
  """A head_dim that is not a power of two >= 16, a cache whose slots are not a multiple of 16
  (the sampler's never are: `cache_slots`), a cache in another dtype: one ValueError line
  each; the config check names model.attention, and refuses the kernel on a mesh of 2."""
  from conftest import tiny_config

  from jaxrl_llm.config import ConfigError, check, parse

  for args, words in [
    ((jnp.float32, jnp.float32, 12, 48), "head_dim=12 must be a power of two >= 16"),
    ((jnp.float32, jnp.float32, 16, 40), "the cache's 40 slots must be a multiple of 16"),
    ((jnp.bfloat16, jnp.float32, 16, 48), "the cache's dtype float32"),
  ]:
    with pytest.raises(ValueError, match="attention='pallas'") as err:
      attention.select_decode("pallas", *args)
    assert words in str(err.value) and "\n" not in str(err.value)
  assert [attention.cache_slots(n) for n in (1, 16, 17, 141)] == [16, 16, 32, 144]
  config = tiny_config(**{"model.attention": "pallas", "model.head_dim": 12})
  with pytest.raises(ConfigError, match=r"model\.attention='pallas' cannot run: head_dim=12"):
    check(parse(config), num_devices=1)
  config = tiny_config(**{"model.attention": "pallas", "mesh.data": 2})
  with pytest.raises(ConfigError, match=r"model\.attention='pallas' runs on one device"):
    check(parse(config), num_devices=2)


def test_a_jax_without_the_pallas_decode_kernel_refuses_it_in_one_line(monkeypatch):
  """jax 0.11 deprecates the Pallas Triton ops the kernel comes from; a jax that has removed
  them failed every import of the package (the kernel was imported with it). Now it is imported
  when first needed, and a jax without it refuses `pallas` in one line, config check included."""
  import sys

  import jax.experimental.pallas.ops.gpu  # noqa: F401 - the package a jax without it keeps
  from conftest import tiny_config

  from jaxrl_llm.config import ConfigError, check, parse

  with monkeypatch.context() as m:
    m.setitem(sys.modules, "jax.experimental.pallas.ops.gpu.decode_attention", None)
    m.delattr(sys.modules["jax.experimental.pallas.ops.gpu"], "decode_attention", raising=False)
    attention._decode_kernel.cache_clear()
    try:
      with pytest.raises(ValueError, match="attention='pallas'") as err:
        attention.select_decode("pallas", jnp.float32, jnp.float32, 16, 48)
      assert "has no Pallas GPU decode kernel" in str(err.value) and "\n" not in str(err.value)
      with pytest.raises(ConfigError, match="has no Pallas GPU decode kernel"):
        check(parse(tiny_config(**{"model.attention": "pallas"})), num_devices=1)
    finally:
      attention._decode_kernel.cache_clear()
  assert attention.select_decode("pallas", jnp.float32, jnp.float32, 16, 48) == "pallas"
