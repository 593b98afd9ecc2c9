"""Mesh strings, partition rules and the FP8 alignment check on one device (no mesh needed)."""

import dataclasses

import pytest
from jax.sharding import PartitionSpec as P

from jetrl import parallel
from jetrl.models import PRESETS, get_config
from jetrl.precision import get_recipe


def test_parse_mesh():
  assert parallel.parse_mesh("") == {"data": -1, "fsdp": 1, "tensor": 1}
  assert parallel.parse_mesh("data:2,fsdp:2,tensor:2") == {"data": 2, "fsdp": 2, "tensor": 2}
  assert parallel.parse_mesh("tensor:4") == {"data": 1, "fsdp": 1, "tensor": 4}
  assert parallel.resolve_mesh_shape("tensor:2,data:-1", 8) == {"data": 4, "fsdp": 1, "tensor": 2}
  assert parallel.resolve_mesh_shape("", 4) == {"data": 4, "fsdp": 1, "tensor": 1}


@pytest.mark.parametrize(
  "spec,msg",
  [
    ("data:2,pipe:2", "unknown axis 'pipe'"),
    ("data:x", "must be an integer"),
    ("data:0", "must be >= 1"),
    ("data", "is not 'axis:size'"),
    ("data:2,data:2", "given twice"),
    ("data:-1,fsdp:-1", "at most one axis"),
  ],
)
def test_bad_mesh_strings(spec, msg):
  with pytest.raises(ValueError, match=msg):
    parallel.parse_mesh(spec)


def test_mesh_must_use_every_device():
  with pytest.raises(ValueError, match="multiply to 4, but there are 8 devices"):
    parallel.resolve_mesh_shape("data:2,tensor:2", 8)
  with pytest.raises(ValueError, match="do not divide the 8 devices"):
    parallel.resolve_mesh_shape("data:-1,tensor:3", 8)


def test_train_rules_cover_every_parameter():
  cfg = PRESETS["qwen2.5-7b"]  # biases, untied head
  specs = parallel.param_specs(cfg, {"data": 2, "fsdp": 2, "tensor": 4})
  lay = specs["layers"]
  assert lay["wq"] == P(None, "fsdp", "tensor") and lay["wo"] == P(None, "tensor", "fsdp")
  assert lay["w_down"] == P(None, "tensor", "fsdp") and lay["bk"] == P(None, "tensor")
  assert lay["attn_norm"] == P(None, None) and specs["final_norm"] == P(None)
  assert specs["embed"] == P("tensor", "fsdp") and specs["lm_head"] == P("fsdp", "tensor")
  samp = parallel.param_specs(cfg, {"data": 2, "fsdp": 2, "tensor": 4}, "sample")
  assert samp["layers"]["wq"] == P(None, None, "tensor") and samp["embed"] == P("tensor", None)


def test_a_mixture_of_experts_splits_each_expert_like_the_dense_mlp():
  """qwen3-30b-a3b: every expert's [D, Fe] / [Fe, D] over fsdp x tensor, the expert axis
  whole; the router over fsdp on D; 128-wide FP8 shards (D 2048 / 8, Fe 768 / 2 = 384)."""
  cfg = PRESETS["qwen3-30b-a3b"]
  sizes = {"data": 1, "fsdp": 8, "tensor": 2}
  lay = parallel.param_specs(cfg, sizes)["layers"]
  assert lay["experts_gate"] == P(None, None, "fsdp", "tensor") == lay["experts_up"]
  assert lay["experts_down"] == P(None, None, "tensor", "fsdp")
  assert lay["router"] == P(None, "fsdp", None)
  parallel.check_fp8_alignment(cfg, parallel.param_specs(cfg, sizes), sizes, get_recipe("jet"))
  samp = parallel.param_specs(cfg, sizes, "sample")["layers"]
  assert samp["experts_gate"] == P(None, None, None, "tensor") and samp["router"] == P(
    None, None, None
  )
  # tensor:4 cuts an expert's width 768 into 192-wide shards: its 128x128 blocks would
  # straddle them (the dense check, on each expert's matrix).
  bad = {"fsdp": 1, "tensor": 4}
  with pytest.raises(ValueError) as e:
    parallel.check_fp8_alignment(cfg, parallel.param_specs(cfg, bad), bad, get_recipe("jet"))
  for part in ("'layers/experts_gate'", "(48, 128, 2048, 768)", "output dim N=768", "of 192"):
    assert part in str(e.value), (part, str(e.value))


def test_vocab_falls_back_to_replicated_when_not_divisible():
  cfg = dataclasses.replace(get_config("tiny"), vocab_size=37, n_kv_heads=4)
  specs = parallel.param_specs(cfg, {"tensor": 2})
  assert specs["embed"] == P(None, None) and specs["lm_head"] == P(None, None)


def test_model_dims_must_divide():
  with pytest.raises(ValueError, match="n_kv_heads=2 is not divisible by mesh axis 'tensor'"):
    parallel.param_specs(get_config("tiny"), {"tensor": 4})
  with pytest.raises(
    ValueError,
    match=r"'embed' of shape \(128, 256\): dim 256 is not "
    r"divisible by mesh axis 'fsdp' of size 3",
  ):
    parallel.param_specs(get_config("tiny"), {"fsdp": 3})


def test_fp8_alignment_names_parameter_shape_axis_block():
  tiny = get_config("tiny")  # kv_dim 128: tensor:2 gives 64-wide shards of wk / wv
  specs = parallel.param_specs(tiny, {"tensor": 2})
  with pytest.raises(ValueError) as e:
    parallel.check_fp8_alignment(tiny, specs, {"tensor": 2}, get_recipe("jet"))
  msg = str(e.value)
  for part in (
    "'layers/wk'",
    "(2, 256, 128)",
    "output dim N=128",
    "'tensor' (size 2)",
    "shards of 64",
    "FP8 block 128",
  ):
    assert part in msg, (part, msg)
  # fp8_rollout checks its rollout fprop; bf16 / fp32 have no blocks.
  with pytest.raises(ValueError, match="fp8_rollout.rollout.fprop"):
    parallel.check_fp8_alignment(tiny, specs, {"tensor": 2}, get_recipe("fp8_rollout"))
  parallel.check_fp8_alignment(tiny, specs, {"tensor": 2}, get_recipe("bf16"))
  # d_model 256 over fsdp:2 leaves 128-wide K shards: aligned.
  ok = parallel.param_specs(tiny, {"fsdp": 2})
  parallel.check_fp8_alignment(tiny, ok, {"fsdp": 2}, get_recipe("jet"))
  bad = parallel.param_specs(tiny, {"fsdp": 4})
  with pytest.raises(
    ValueError,
    match=r"contraction \(input\) dim K=256 split over mesh axis "
    r"'fsdp' \(size 4\) into shards of 64",
  ):
    parallel.check_fp8_alignment(tiny, bad, {"fsdp": 4}, get_recipe("jet"))


def test_multi_process_env_detection(monkeypatch):
  for var in (
    "JAX_NUM_PROCESSES",
    "SLURM_JOB_ID",
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
    "TPU_WORKER_HOSTNAMES",
  ):
    monkeypatch.delenv(var, raising=False)
  assert not parallel.multi_process_env()
  assert parallel.maybe_initialize_distributed(log=lambda *_: None) is False
  monkeypatch.setenv("JAX_NUM_PROCESSES", "1")
  assert not parallel.multi_process_env()
  monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
  assert parallel.multi_process_env()
  monkeypatch.delenv("JAX_NUM_PROCESSES")
  monkeypatch.setenv("SLURM_JOB_ID", "1")
  monkeypatch.setenv("SLURM_NTASKS", "2")
  assert parallel.multi_process_env()
  monkeypatch.delenv("SLURM_JOB_ID")
  monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "a,b")
  assert parallel.multi_process_env()


def test_train_config_mesh_flag():
  from jetrl.train import TrainConfig

  cfg = TrainConfig(workdir="/tmp/x", mesh="data:2,fsdp:2,tensor:2")
  assert cfg.mesh == "data:2,fsdp:2,tensor:2" and TrainConfig().mesh is None
  with pytest.raises(ValueError, match="^mesh: .*unknown axis 'model'"):
    TrainConfig(workdir="/tmp/x", mesh="model:2")


def test_start_up_variables(monkeypatch):
  from jetrl.config import ConfigError
  from jetrl.parallel.hosts import distributed_kwargs

  for var in (
    "JAX_NUM_PROCESSES",
    "JAX_PROCESS_ID",
    "JAX_COORDINATOR_ADDRESS",
    "JETRL_HEARTBEAT_TIMEOUT",
  ):
    monkeypatch.delenv(var, raising=False)
  assert distributed_kwargs() == {}
  monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
  with pytest.raises(ConfigError, match="JAX_NUM_PROCESSES=2 but JAX_PROCESS_ID is not set"):
    distributed_kwargs()
  monkeypatch.setenv("JAX_PROCESS_ID", "2")
  with pytest.raises(ConfigError, match="JAX_PROCESS_ID=2 is not below JAX_NUM_PROCESSES=2"):
    distributed_kwargs()
  monkeypatch.setenv("JAX_PROCESS_ID", "1")
  monkeypatch.setenv("JETRL_HEARTBEAT_TIMEOUT", "15")
  assert distributed_kwargs() == dict(
    num_processes=2, process_id=1, heartbeat_timeout_seconds=15, coordinator_address="10.0.0.1:1234"
  )
  monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
  with pytest.raises(ConfigError, match="JAX_NUM_PROCESSES='two' is not an integer"):
    distributed_kwargs()
  monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1")
  with pytest.raises(ConfigError, match="is not HOST:PORT"):
    distributed_kwargs()
  # The launcher's --processes=1 inside a Slurm allocation: one process.
  monkeypatch.setenv("JAX_NUM_PROCESSES", "1")
  monkeypatch.setenv("SLURM_JOB_ID", "1")
  monkeypatch.setenv("SLURM_NTASKS", "4")
  assert not parallel.multi_process_env()


def test_one_process_owns_every_row():
  import numpy as np

  x = np.arange(12).reshape(6, 2)
  rows = parallel.owned_rows(x)
  assert rows.tolist() == list(range(6))
  np.testing.assert_array_equal(parallel.rows_to_host(x, rows[2:4]), x[2:4])
  np.testing.assert_array_equal(parallel.gather_rows(x[:, 1] * 2, rows, 6), x[:, 1] * 2)
  assert parallel.on_primary(lambda: 7) == 7 and parallel.all_true(True)
  assert parallel.is_primary()
