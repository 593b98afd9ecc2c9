import numpy as np, jax, jax.numpy as jnp
from jetrl.precision import quantize
from jetrl.kernels.quant_kernel import quantize_rows_cols
rng = np.random.default_rng(3)
x = rng.standard_normal((300, 520)) * np.exp(3 * rng.standard_normal((300, 1)))
x[4, :128] = 0.0
u = lambda a: np.asarray(a).view(np.uint8)
for fmt in (jnp.float8_e4m3fn, jnp.float8_e5m2):
  xb = jnp.asarray(x, jnp.bfloat16)
  _, (qc_t, sc_t) = jax.jit(lambda a: quantize_rows_cols(a, fmt))(xb)
  g = jax.jit(lambda a: quantize(a.T, (1, 128), fmt))(xb)
  c = jax.jit(lambda a: quantize(a.T, (1, 128), fmt))(jax.device_put(xb, jax.devices("cpu")[0]))
  print(fmt, "k!=g", (u(qc_t)!=u(g[0])).sum(), "k!=c", (u(qc_t)!=u(c[0])).sum(), "g!=c", (u(g[0])!=u(c[0])).sum(),
        "sk==sc", np.array_equal(np.asarray(sc_t.T), np.asarray(c[1])), "sg==sc", np.array_equal(np.asarray(g[1]), np.asarray(c[1])))
  xf = np.asarray(xb).astype(np.float32).T
  s = np.asarray(c[1]); inv = (np.float32(1)/s).astype(np.float32)
  for i, j in np.argwhere(u(g[0])!=u(c[0]))[:4]:
    print(" ", i, j, "x", repr(xf[i,j]), "s", repr(s[i,j//128]), "inv", repr(inv[i,j//128]), "prod", repr(np.float32(xf[i,j]*inv[i,j//128])), "k", float(np.asarray(qc_t)[i,j].astype(np.float32)), "g", float(np.asarray(g[0])[i,j].astype(np.float32)), "c", float(np.asarray(c[0])[i,j].astype(np.float32)))
  print(jax.jit(lambda a: quantize(a.T, (1, 128), fmt)).lower(xb).compile().as_text()[-3000:])
