"""The kernel settings are run config: `--kernels.*` flags whose defaults the JETRL_* variables
give (said in a line where they do), recorded in the run's config.json, and what every plan
of the run (sampler, update, evaluation) is resolved with."""

import json

import pytest

from conftest import parse_flags as parse
from jetrl.config import FlagError
from jetrl.kernels import Device, KernelConfig, resolve_plan
from jetrl.train import TrainConfig
from jetrl.kernels.device import kernel_defaults

GPU = Device("gpu", interpret=True)  # a GPU's program, run here


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--kernels.decode_gemm=triton"], "--kernels.decode_gemm: 'triton' is not accepted"),
    (["--kernels.gemm_backend=cuda"], "--kernels.gemm_backend: 'cuda' is not accepted"),
  ],
)
def test_a_bad_value_names_the_flag(argv, message):
  with pytest.raises(FlagError) as e:
    parse(argv)
  assert str(e.value).startswith(message), str(e.value)


def test_a_flag_reaches_the_resolved_plan():
  jet = TrainConfig().precision_recipe.train
  on_gpu = lambda argv: resolve_plan(
    jet, Device("gpu", interpret=True, kernels=parse(argv).kernels)
  )
  assert on_gpu([]).blocks.mlp == "fused" and on_gpu([]).blocks.norm_linear == "fused"
  unfused = on_gpu(["--kernels.fused_mlp=false"])
  assert unfused.blocks.mlp == "unfused" and unfused.blocks.norm_linear == "unfused"
  # What an FP8 GEMM whose recipe says "auto" runs: XLA on a CPU, unless the flag says.
  on_cpu = lambda argv: resolve_plan(jet, Device("cpu", kernels=parse(argv).kernels))
  assert on_cpu([]).blocks.linear == "xla"
  assert on_cpu(["--kernels.gemm_backend=pallas_interpret"]).blocks.linear == "pallas_interpret"
  assert not on_cpu(["--kernels.exact_cpu_kernel=false"]).device.kernels.exact_cpu_kernel


def test_the_variables_give_the_defaults_and_a_flag_overrides_them():
  env = {"JETRL_FUSED_MLP": "0", "JETRL_DECODE_GEMM": "pallas", "JETRL_FUSED_QUANT": ""}
  default, notes = kernel_defaults(TrainConfig(), env)
  assert default.kernels == KernelConfig(fused_mlp=False, decode_gemm="pallas")
  assert default.replace(kernels=KernelConfig()) == TrainConfig()  # nothing else changes
  assert sorted(notes) == [
    "JETRL_DECODE_GEMM sets the default of --kernels.decode_gemm to pallas (a flag or --config "
    "overrides it)",
    "JETRL_FUSED_MLP sets the default of --kernels.fused_mlp to false (a flag or --config "
    "overrides it)",
  ]
  assert parse([], default).kernels.fused_mlp is False
  assert parse(["--kernels.fused_mlp=true"], default).kernels.fused_mlp is True
  assert kernel_defaults(TrainConfig(), {}) == (TrainConfig(), [])
  with pytest.raises(ValueError, match="JETRL_FUSED_MLP must be 0, 1 or unset"):
    kernel_defaults(TrainConfig(), {"JETRL_FUSED_MLP": "yes"})


def test_a_run_records_its_settings_and_resolves_every_plan_with_them(
  tmp_path, tiny_train_config, monkeypatch
):
  from jetrl.train import evaluation, loop, rl_step, run

  seen = []

  def recording(name, fn):
    def wrapped(*args, **kwargs):
      seen.append((name, kwargs.get("kernels")))
      return fn(*args, **kwargs)

    return wrapped

  monkeypatch.setattr(rl_step, "sample", recording("rollout", rl_step.sample))
  monkeypatch.setattr(evaluation, "sample", recording("evaluation", evaluation.sample))
  monkeypatch.setattr(loop, "update_step", recording("update", loop.update_step))
  settings = KernelConfig(fused_mlp=False, exact_cpu_kernel=False, gemm_backend="xla")
  cfg = tiny_train_config(tmp_path, steps=1, kernels=settings)
  run(cfg, log=lambda *a, **k: None)
  names = {name for name, _ in seen}
  assert names == {"rollout", "evaluation", "update"}, names
  assert all(kernels == settings for _, kernels in seen), seen
  saved = json.loads((tmp_path / "config.json").read_text())
  assert saved["kernels"] == {
    "gemm_backend": "xla",
    "fused_quant": None,
    "fused_mlp": False,
    "decode_gemm": "cublaslt",
    "exact_cpu_kernel": False,
    "cublaslt_graphs": True,
  }
