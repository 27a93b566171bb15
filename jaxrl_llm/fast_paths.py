"""The checks of every fast path `auto` may choose, registered with `kernels.verify`.

Each case runs a fast path and its reference at a small shape on the default device and
returns (fast outputs, reference outputs): the Mosaic GPU grouped matmul (forward, input and
weight gradients), cuDNN attention at an odd length with left padding (values and dq, dk, dv),
the bf16 and int8 sampler copies (a small policy's token log-probs), and the chunked log-probs
(values and the hidden states' gradient). Importing this module registers them; the run
(`run/assemble.py`) and `tools/device_check.py` do. A process that never imports it has no
checks, so `auto` chooses no fast path there.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import quant
from jaxrl_llm.kernels import attention, grouped, logprobs
from jaxrl_llm.kernels.verify import Check, register
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.transformer import Transformer, positions_from_mask

_GROUPS = (37, 0, 150, 1, 64, 200, 100, 48)  # 600 rows over 8 experts, one empty, one of 1 row
# M (40 rows past the groups), K, N: N=384 takes the block sizes a model's experts do (192
# columns, 2 column blocks; `grouped.kernel_blocks`, `weight_grad_blocks`).
_GROUPED_SHAPE = (640, 128, 384)


def _grouped_case(ops: str, output: str):
  """The grouped matmul's forward (`output="y"`), input gradient ("dx") or weight gradient
  ("dw") by the Mosaic GPU kernels (`ops`) against `jax.lax.ragged_dot` in float32."""
  m, k, n = _GROUPED_SHAPE
  kx, kw, kc = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(kx, (m, k), jnp.bfloat16)
  w = (jax.random.normal(kw, (len(_GROUPS), k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
  dy = jax.random.normal(kc, (m, n), jnp.bfloat16)
  sizes = jnp.asarray(_GROUPS, jnp.int32)

  def fast(x, w):
    return grouped.kernel_matmul(x, w, sizes, ops)

  def ref(x, w):
    return jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), sizes)

  def pull(fn, x, w):
    y, vjp = jax.vjp(fn, x, w)
    dx, dw = vjp(dy.astype(y.dtype))
    return {"y": y, "dx": dx, "dw": dw}[output]

  got = jax.jit(functools.partial(pull, fast))(x, w)
  want = jax.jit(functools.partial(pull, ref))(x, w)
  return (got,), (want,)


def _grouped_refusal(interpreted: bool, backward: bool) -> Callable[[], str | None]:
  def refusal():
    if interpreted:
      if backward:
        return "the interpreter cannot run the backward kernels (transposed operands)"
      return None
    return grouped.kernel_unsupported(jax.devices()[0], jnp.bfloat16, _GROUPED_SHAPE[1:])

  return refusal


def _attention_case():
  """cuDNN attention (`padded_causal`) at an odd length with left padding, against the einsum
  reference, in values and in the gradients of q, k and v (valid positions only)."""
  b, t, h, j, dh = 3, 37, 4, 2, 64
  kq, kk, kv, kc = jax.random.split(jax.random.PRNGKey(1), 4)
  q = jax.random.normal(kq, (b, t, h, dh), jnp.bfloat16)
  keys = jax.random.normal(kk, (b, j, t, dh), jnp.bfloat16)
  values = jax.random.normal(kv, (b, j, t, dh), jnp.bfloat16)
  lengths = jnp.asarray([t, 20, 1])
  key_valid = jnp.arange(t)[None, :] >= (t - lengths)[:, None]  # left-padded rows
  cot = jax.random.normal(kc, (b, t, h, dh), jnp.float32) * key_valid[:, :, None, None]

  def loss(fn, q, keys, values):
    out = fn(q, keys, values).astype(jnp.float32)
    return jnp.sum(out * cot), out * key_valid[:, :, None, None]

  def fast(q, keys, values):
    return attention.padded_causal(q, keys, values, key_valid, "cudnn")

  def ref(q, keys, values):
    qf, kf, vf = (x.astype(jnp.float32) for x in (q, keys, values))
    return attention.reference(qf, kf, vf, attention.mask(key_valid, t, 0))

  def both(fn):
    grad = jax.grad(functools.partial(loss, fn), argnums=(0, 1, 2), has_aux=True)
    grads, out = jax.jit(grad)(q, keys, values)
    return (out, *grads)

  return both(fast), both(ref)


def _attention_refusal() -> str | None:
  return attention.cudnn_refusal(jnp.bfloat16, 64)


def _decode_case():
  """The Pallas decode kernel (`filled_slots_beside`) against the einsum decode step
  (`one_query_beside`): bfloat16, GQA 9/3 heads (SmolLM2's), Dh=64, 96 slots, rows left-padded
  by 0, 17 and 40 slots at decode slots 40, 41 and 95 (at 40 the last row has no filled slot but its own)."""
  b, h, j, dh, n = 3, 9, 3, 64, 96
  ks = jax.random.split(jax.random.PRNGKey(5), 5)
  q = jax.random.normal(ks[0], (b, 1, h, dh), jnp.bfloat16)
  keys, values = (jax.random.normal(k, (b, j, n, dh), jnp.bfloat16) for k in ks[1:3])
  own_k, own_v = (jax.random.normal(k, (b, j, 1, dh), jnp.bfloat16) for k in ks[3:5])
  key_valid = jnp.arange(n)[None, :] >= jnp.asarray([0, 17, 40])[:, None]
  got, want = [], []
  for start in (40, 41, 95):
    args = (q, keys, values, own_k, own_v, key_valid, jnp.int32(start))
    got.append(jax.jit(attention.filled_slots_beside)(*args))
    want.append(jax.jit(attention.one_query_beside)(*args))
  return tuple(got), tuple(want)


def _decode_refusal(interpreted: bool) -> Callable[[], str | None]:
  def refusal():
    if not interpreted and jax.devices()[0].platform != "gpu":
      return f"it needs a GPU (the default device is {jax.devices()[0].platform})"
    return attention.pallas_refusal(jnp.bfloat16, jnp.bfloat16, 64, 96)

  return refusal


def _sampler_case(dtype: str):
  """A small policy's token log-probs with the sampler's `dtype` copy of its weights against
  the float32 weights (the gap the behaviour corrections of spec §3 see)."""
  cfg = ModelConfig(vocab_size=64, d_model=64, num_layers=2, head_dim=16, mlp_dim=128)
  tokens = jax.random.randint(jax.random.PRNGKey(2), (4, 24), 0, cfg.vocab_size)
  valid = jnp.ones(tokens.shape, bool)
  pos = positions_from_mask(valid)
  params = nn.unbox(Transformer(cfg).init(jax.random.PRNGKey(3), tokens, pos, valid))["params"]

  def logp(p, compute):
    model = Transformer(dataclasses.replace(cfg, dtype=compute))
    logits = model.apply({"params": p}, tokens, pos, valid).logits
    return jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tokens[:, 1:, None], -1)

  compute = "bfloat16" if dtype in ("bfloat16", "int8") else "float32"
  got = jax.jit(lambda p: logp(quant.sampler_params(p, dtype), compute))(params)
  want = jax.jit(lambda p: logp(p, "float32"))(params)
  return (got,), (want,)


def _chunked_case(temperature: float = 0.7, reference_temperature: float = 0.7):
  """`logprobs.chunked` against `logprobs.reference`: ℓ, H and the gradient of the hidden
  states. (`reference_temperature` differs only in the tests' failing check.)"""
  b, t, d, v = 3, 16, 32, 97
  kh, kw, kt = jax.random.split(jax.random.PRNGKey(4), 3)
  hidden = jax.random.normal(kh, (b, t, d), jnp.float32)
  w = jax.random.normal(kw, (d, v), jnp.float32) / np.sqrt(d)
  tokens = jax.random.randint(kt, (b, t), 0, v)
  head = lambda h: jnp.einsum("...d,dv->...v", h, w)  # noqa: E731

  def run(fn, tau):
    def loss(h):
      lp, ent = fn(h, head, tokens, tau)
      return jnp.sum(lp) + 0.3 * jnp.sum(ent), (lp, ent)

    grad, (lp, ent) = jax.jit(jax.grad(loss, has_aux=True))(hidden)
    return lp, ent, grad

  return run(functools.partial(logprobs.chunked, chunk=4), temperature), run(
    logprobs.reference, reference_temperature
  )


def _anywhere() -> None:
  """The refusal of a check that runs on every backend: none."""
  return None


GROUPED_TOLERANCE = 2e-2  # relative error each grouped-matmul kernel may have (its checks)
_GROUPED_NOTE = "E=8 groups (one empty), M=640 (40 rows past the groups), K=N=128, bf16"


def _register() -> None:
  """Every check, in the order `tools/device_check.py` prints them."""
  grouped_checks = [  # each within GROUPED_TOLERANCE
    ("grouped_forward", "y", "Mosaic GPU grouped matmul forward; " + _GROUPED_NOTE),
    ("grouped_input_grad", "dx", "its input-gradient kernel (w read transposed)"),
    ("grouped_weight_grad", "dw", "its weight-gradient kernel (transposed grouped matmul)"),
  ]
  for name, output, note in grouped_checks:
    backward = output != "y"
    check = Check(
      functools.partial(_grouped_case, "mgpu", output),
      _grouped_refusal(False, backward),
      GROUPED_TOLERANCE,
      note,
    )
    interpreted = dataclasses.replace(
      check,
      case=functools.partial(_grouped_case, "mgpu_forward", output),
      refusal=_grouped_refusal(True, backward),
      interpreted=True,
    )
    register(name, check, interpreted)
  note = "cuDNN flash attention, T=37, left padding 0/17/36, GQA 4/2, Dh=64; values, dq, dk, dv"
  register("cudnn_attention", Check(_attention_case, _attention_refusal, 3e-2, note))
  note = "Pallas decode kernel over filled slots, 96 slots, left padding 0/17/40, GQA 9/3, bf16"
  check = Check(_decode_case, _decode_refusal(False), 2e-2, note)
  interpreted = dataclasses.replace(check, refusal=_decode_refusal(True), note=note + " (interp.)")
  register("pallas_decode", check, interpreted)
  for dtype, tol in (("bfloat16", 5e-2), ("int8", 1e-1)):
    note = f"log-probs with the {dtype} sampler copy vs float32 weights"
    register(
      f"sampler_{dtype}", Check(functools.partial(_sampler_case, dtype), _anywhere, tol, note)
    )
  note = "chunked log-probs and entropies (float32) and their gradient"
  register("chunked_logprobs", Check(_chunked_case, _anywhere, 1e-5, note))


_register()
