"""bench_device parts (b) the sampler, (c) one update step and (d) one RL step, per recipe."""

from __future__ import annotations

import time

from absl import flags

import jax
import jax.numpy as jnp
import numpy as np

from _bench_common import (
  Variant,
  call_time,
  decode_gemm,
  fused_quant,
  load_model,
  measure,
  param_count,
  profile,
  random_prompts,
  recipe_of,
  speedup_text,
  unfused_mlp,
)
from jetrl.rl import metrics as M

FLAGS = flags.FLAGS


def run_rollout(model: str, settings, interpret: bool, variants=(Variant("bf16"),)):
  """Sampler tokens/s per variant, for each (batch, prompt_len, new_tokens) in settings."""
  try:
    from jetrl.sampling import SamplingConfig, sample  # pylint: disable=import-outside-toplevel

    cfg, params = load_model(model, jnp.dtype(FLAGS.param_dtype))
  except Exception as e:  # pylint: disable=broad-except
    return [dict(skipped=f"{type(e).__name__}: {e}")]
  rows = []
  for batch, prompt_len, new_tokens in settings:
    prompts = random_prompts(cfg.vocab_size, batch, prompt_len)
    scfg = SamplingConfig(max_new_tokens=new_tokens, temperature=1.0, prompt_len=prompt_len)
    for v in variants:
      rec = recipe_of(v, interpret)

      def one(v=v, rec=rec):
        with decode_gemm(v.decode_gemm):
          t0 = time.perf_counter()
          run = lambda: (
            sample(params, cfg, prompts, jax.random.PRNGKey(1), scfg, rec.rollout).tokens
          )
          with fused_quant(v.fused_quant):
            jax.block_until_ready(run())
          first = time.perf_counter() - t0
          t = call_time(run, max(1, FLAGS.repeats - 1))
          res = dict(
            seconds=t,
            tokens_per_s=batch * new_tokens / t,
            ms_per_step=1e3 * t / new_tokens,
            first_call_s=first,
            compile_s=max(0.0, first - t),
          )
          if FLAGS.profile:  # per decode step: the prefill's kernels count in too
            res["profile"] = profile(run, new_tokens, f"{v.label} rollout")
          return res

      row = dict(v.row(), batch=batch, prompt_len=prompt_len, new_tokens=new_tokens)
      done = f"{v.label} {batch}x{prompt_len}+{new_tokens}"
      measure(rows, row, one, FLAGS.rollout_budget_fraction, done)
  return rows


def update_batch(cfg, rows_n, prompt_len, completion_len):
  """A random update batch: rows of prompt and completion tokens, rollout log-probs, advantages."""
  from jetrl.rl import make_train_batch  # pylint: disable=import-outside-toplevel

  rng = np.random.default_rng(0)
  prompt = jnp.asarray(rng.integers(1, cfg.vocab_size, (rows_n, prompt_len)), jnp.int32)
  tokens = jnp.asarray(rng.integers(1, cfg.vocab_size, (rows_n, completion_len)), jnp.int32)
  ones = lambda shape: jnp.ones(shape, bool)
  return make_train_batch(
    prompt,
    ones(prompt.shape),
    tokens,
    ones(tokens.shape),
    jnp.asarray(-rng.random((rows_n, completion_len)) * 3, jnp.float32),
    jnp.asarray(rng.standard_normal(rows_n), jnp.float32),
  )


def run_update(
  model: str,
  rows_n: int,
  prompt_len: int,
  completion_len: int,
  interpret: bool,
  variants=(Variant("bf16"), Variant("jet")),
):
  try:
    from jetrl.rl import UpdateConfig, init_train_state, update_step  # pylint: disable=import-outside-toplevel
    from jetrl.kernels.attention import use_flash  # pylint: disable=import-outside-toplevel
    from jetrl.rl.remat import resolve_remat  # pylint: disable=import-outside-toplevel

    # in the master dtype: the state's copy is then the only other one (8B bf16 on one H200)
    cfg, params = load_model(model, jnp.dtype(FLAGS.update_master_dtype))
    batch = update_batch(cfg, rows_n, prompt_len, completion_len)
    ucfg = UpdateConfig(master_dtype=FLAGS.update_master_dtype)
  except Exception as e:  # pylint: disable=broad-except
    return [dict(skipped=f"{type(e).__name__}: {e}")]
  tokens = rows_n * (prompt_len + completion_len)
  n_params = param_count(params)
  seq = prompt_len + completion_len - 1
  # as update_step decides it (flash attention on a GPU for FP8 and bf16 recipes alike)
  remat = resolve_remat(
    ucfg.remat, cfg, rows_n, seq, flash=use_flash(None, seq, cfg.head_dim, jnp.bfloat16)
  )
  rows = []
  for v in variants:
    rec = recipe_of(v, interpret)
    step = lambda state, i, rec=rec: update_step(
      state, batch, jax.random.PRNGKey(i), model_config=cfg, cfg=ucfg, precision=rec.train
    )

    def one(v=v, step=step):
      state = init_train_state(params, ucfg)
      times = []
      with unfused_mlp(not v.fused_mlp):
        for i in range(max(2, FLAGS.repeats)):
          t0 = time.perf_counter()
          with fused_quant(v.fused_quant and i == 0):
            state, metrics = step(state, i)
          jax.block_until_ready(metrics)
          times.append(time.perf_counter() - t0)
      t = float(np.median(times[1:]))
      res = dict(
        seconds=t,
        first_call_s=times[0],
        tokens_per_s=tokens / t,
        mfu_6nd=6.0 * n_params * tokens / t / (FLAGS.peak_tflops * 1e12),
        params=n_params,
        finite=bool(float(M.read(metrics, M.SKIPPED_UPDATES)) == 0),
      )
      if FLAGS.profile:
        res["profile"] = profile(lambda s=state: step(s, 0)[1], 1, f"{v.label} update")
      return res

    row = dict(
      v.row(),
      rows=rows_n,
      seq=prompt_len + completion_len,
      remat=remat,
      master_dtype=FLAGS.update_master_dtype,
    )
    measure(rows, row, one, FLAGS.update_budget_fraction, v.label)
  return rows


def run_e2e(
  model: str, prompts_n: int, group: int, prompt_len: int, new_tokens: int, interpret: bool
):
  """One RL step (rollout, reward, advantages, update) per recipe, with the time split."""
  try:
    from jetrl.rl import UpdateConfig, init_train_state, make_train_batch, update_step  # pylint: disable=import-outside-toplevel
    from jetrl.rl.advantages import group_advantages  # pylint: disable=import-outside-toplevel
    from jetrl.sampling import SamplingConfig, sample  # pylint: disable=import-outside-toplevel

    cfg, params = load_model(model, jnp.float32)
  except Exception as e:  # pylint: disable=broad-except
    return [dict(skipped=f"{type(e).__name__}: {e}")]
  prompts = random_prompts(cfg.vocab_size, prompts_n, prompt_len)
  scfg = SamplingConfig(max_new_tokens=new_tokens, temperature=1.0, prompt_len=prompt_len, n=group)
  ucfg = UpdateConfig(micro_batches=FLAGS.e2e_micro_batches)

  def rl_step(state, i, rec):
    t0 = time.perf_counter()
    out = sample(state.params, cfg, prompts, jax.random.PRNGKey(i), scfg, rec.rollout)
    jax.block_until_ready(out.tokens)
    t1 = time.perf_counter()
    # A stand-in verifiable reward: the share of even token ids (host-side, like a task's).
    toks, mask = np.asarray(out.tokens), np.asarray(out.mask)
    reward = ((toks % 2 == 0) & mask).sum(1) / np.maximum(mask.sum(1), 1)
    adv = group_advantages(jnp.asarray(reward, jnp.float32), group)
    batch = make_train_batch(
      out.prompt_tokens, out.prompt_mask, out.tokens, out.mask, out.logprobs, adv
    )
    t2 = time.perf_counter()
    state, metrics = update_step(
      state, batch, jax.random.PRNGKey(i), model_config=cfg, cfg=ucfg, precision=rec.train
    )
    jax.block_until_ready(metrics)
    return state, metrics, (t1 - t0, t2 - t1, time.perf_counter() - t2)

  def one(rec):
    state = init_train_state(params, ucfg)
    state, _, first = rl_step(state, 0, rec)
    state, metrics, (ro, rw, up) = rl_step(state, 1, rec)
    return dict(
      seconds=ro + rw + up,
      rollout_s=ro,
      reward_s=rw,
      update_s=up,
      first_step_s=sum(first),
      mismatch=float(M.read(metrics, M.AGREE_ABS_DIFF_MEAN)),
    )

  rows = []
  for v in (Variant("bf16"), Variant("jet")):
    rec = recipe_of(v, interpret)
    row = dict(v.row(), prompts=prompts_n, group=group, new_tokens=new_tokens)
    measure(rows, row, lambda rec=rec: one(rec), 0.97, v.label)
  return rows


# Each part's console line: (head, its width, body), formatted with a result's fields (and `ms`,
# its seconds in ms; `mfu`, its MFU in %); a skipped result shows its reason after the head.
LINES = {
  "rollout": (
    "{recipe:<12} {batch}x{prompt_len}+{new_tokens}",
    28,
    "{tokens_per_s:9.0f} tok/s  {ms_per_step:6.2f} ms/step  compile {compile_s:5.1f} s",
  ),
  "update": (
    "{recipe:<6} {rows}x{seq}",
    16,
    "{ms:9.1f} ms/step ({tokens_per_s:.0f} tok/s, MFU {mfu:.1f}%, peak {peak_gib} GiB, "
    "remat {remat})",
  ),
  "e2e": (
    "{recipe:<6} {prompts}x{group}",
    12,
    "{seconds:7.2f} s/step = rollout {rollout_s:.2f} + reward {reward_s:.2f} + update "
    "{update_s:.2f}",
  ),
}


class _Fields(dict):
  def __missing__(self, key):
    return ""


def result_line(part: str, r: dict) -> str:
  head_text, width, body = LINES[part]
  fields = _Fields(dict(recipe=part, peak_gib="?"), **r)
  head = head_text.format_map(fields)
  if "skipped" in r:
    return f"{head:<{width}} skipped: {r['skipped']}"
  fields.update(ms=1e3 * r["seconds"], mfu=100 * r.get("mfu_6nd", 0.0))
  return f"{head:<{width}} {body.format_map(fields)}{speedup_text(r)}"


def settings(text: str):
  """'64x256x256,256x256x256' -> [(64, 256, 256), (256, 256, 256)] (batch x prompt x new)."""
  return [tuple(int(v) for v in item.split("x")) for item in text.split(",") if item]
