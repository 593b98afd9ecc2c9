import numpy as np, jax, jax.numpy as jnp, ml_dtypes
from jetrl.precision import quantize
from jetrl.kernels.quant_kernel import quantize_rows_cols
rng = np.random.default_rng(3)
x = rng.standard_normal((300, 520)) * np.exp(3 * rng.standard_normal((300, 1)))
x[4, :128] = 0.0
for fmt in (jnp.float8_e4m3fn, jnp.float8_e5m2):
  xb = jnp.asarray(x, jnp.bfloat16)
  (qr, sr_t), _ = jax.jit(lambda a: quantize_rows_cols(a, fmt))(xb)
  g = jax.jit(lambda a: quantize(a, (1, 128), fmt))(xb)
  c = jax.jit(lambda a: quantize(a, (1, 128), fmt))(jax.device_put(xb, jax.devices("cpu")[0]))
  # host reference: float32 math per spec, ml_dtypes RNE cast
  xf = np.asarray(xb).astype(np.float32)
  s = np.asarray(c[1]); inv = (np.float32(1) / s).astype(np.float32)
  fmax = np.float32(float(jnp.finfo(fmt).max))
  prod = xf.reshape(300, -1) * np.repeat(inv, 128, axis=1)[:, :520]
  h = np.clip(prod, -fmax, fmax).astype(fmt)
  u = lambda a: np.asarray(a).view(np.uint8)
  print(fmt.__name__ if hasattr(fmt,'__name__') else fmt, "kernel!=xla_gpu", (u(qr)!=u(g[0])).sum(), "kernel!=cpu", (u(qr)!=u(c[0])).sum(),
        "xla_gpu!=cpu", (u(g[0])!=u(c[0])).sum(), "host!=cpu", (u(h)!=u(c[0])).sum(), "host!=kernel", (u(h)!=u(qr)).sum(),
        "scales gpu==cpu", np.array_equal(np.asarray(g[1]), s), "kernel scales==cpu", np.array_equal(np.asarray(sr_t.T), s))
  idx = np.argwhere(u(qr)!=u(g[0]))[:3]
  for i,j in idx:
    print(" ", i, j, "x", float(xf[i,j]), "inv", float(inv[i,j//128]), "prod", repr(np.float32(prod[i,j])), "kernel", float(np.asarray(qr)[i,j].astype(np.float32)), "xla_gpu", float(np.asarray(g[0])[i,j].astype(np.float32)), "cpu", float(np.asarray(c[0])[i,j].astype(np.float32)))
