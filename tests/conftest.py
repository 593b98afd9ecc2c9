"""Fixtures shared across the test packages: the repository root, a log that prints nothing,
the tiny model, and the tiny RL / SFT / study configurations the runner tests build on.

The tiny configurations share their shapes and static settings (task, model, generation
budget, batch, temperature, optimizer, run length), so that within one pytest process their
jitted sampler, update and SFT steps compile once and are reused by every test that runs them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import contextlib
import os
import pathlib

import pytest

# Compiling dominates the suite on a CPU: every test process, and the processes the tests start,
# compile with XLA's cheaper LLVM pipeline (the same HLO programs and the same IEEE operations;
# about 20% less time). Not on a machine with an NVIDIA GPU, nor when XLA_FLAGS already sets an
# optimization level or JETRL_TEST_FULL_XLA_OPT=1.
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if not (
  os.path.exists("/dev/nvidiactl")
  or os.environ.get("JETRL_TEST_FULL_XLA_OPT") == "1"
  or "xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", "")
):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAGS}".strip()


# With the compile-only plugins installed (the `aot` extra: the CUDA plugin, libtpu; `make
# test` runs tests/aot in that environment), JAX on a machine with neither device would try to
# start both: the tests, and the processes they start, run on the CPU unless the environment
# chose (compiling for a GPU or TPU needs no runtime of it: jetrl.aot), and several processes
# may load libtpu (it takes a machine-wide lock otherwise).
def _installed(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:  # its parent package is not there either
    return False


if _installed("libtpu") or _installed("jax_plugins.xla_cuda12"):
  if not os.path.exists("/dev/nvidiactl") and not os.path.exists("/dev/accel0"):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# On a GPU every process that touches it (each pytest-xdist worker, each process a test starts,
# which inherit this) would reserve 75% of its memory up front, so the second one runs out:
# each allocates what it uses instead, unless the environment already chose.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402  (after XLA_FLAGS and the allocator setting)

ROOT = pathlib.Path(__file__).resolve().parents[1]


def quiet(*args, **kwargs):
  """A `log` that prints nothing."""


@pytest.fixture(scope="session")
def root() -> pathlib.Path:
  return ROOT


@pytest.fixture(scope="session")
def tiny_model():
  """(config, float32 params) of a 1-layer `tiny` model with 64 positions."""
  from jetrl.models import get_config, init_params

  cfg = dataclasses.replace(get_config("tiny"), n_layers=1, max_seq_len=64)
  return cfg, init_params(cfg, jax.random.PRNGKey(0))


def _tiny_nodes():
  from jetrl.rl import OptimizerConfig
  from jetrl.sampling import SamplingConfig
  from jetrl.train import ModelSpec, TaskConfig

  return dict(
    model=ModelSpec(n_layers=1),
    task=TaskConfig(difficulty=1, length=1),
    sampling=SamplingConfig(max_new_tokens=24, temperature=0.7, n=2),
    optimizer=OptimizerConfig(lr=1e-4),
  )


@pytest.fixture(scope="session")
def tiny_train_config():
  """`make(workdir, **changes)`: a 2-step RL run of 2 prompts x 2 samples on 1-digit addition,
  checkpoints every step, evaluation of 4 problems at the start and the end."""
  from jetrl.train import CheckpointConfig, EvalConfig, LoggingConfig, TrainConfig

  nodes = _tiny_nodes()
  base = TrainConfig(
    recipe="bf16",
    steps=2,
    prompts_per_step=2,
    **nodes,
    eval=EvalConfig(every=None, size=4),
    checkpoint=CheckpointConfig(every=1),
    logging=LoggingConfig(tensorboard=False, plots=False),
  )

  def make(workdir, **changes):
    return base.replace(workdir=str(workdir), **changes)

  return make


@pytest.fixture(scope="session")
def tiny_sft_config():
  """`make(workdir, **changes)`: a 4-step SFT run of 4 problems a step on 1-digit addition."""
  from jetrl.sampling import GenerationConfig
  from jetrl.train import EvalConfig, SFTConfig

  nodes = _tiny_nodes()
  base = SFTConfig(
    steps=4,
    batch_size=4,
    sampling=GenerationConfig(max_new_tokens=nodes["sampling"].max_new_tokens),
    model=nodes["model"],
    task=nodes["task"],
    eval=EvalConfig(every=None, size=4),
  )

  def make(workdir, **changes):
    return base.replace(workdir=str(workdir), **changes)

  return make


@pytest.fixture(scope="session")
def tiny_study_config():
  """`make(report_dir, **changes)`: fp8_rollout and jet (no corrected arm) at length 1, one seed, runs shaped like
  `tiny_train_config`'s, warm starts like `tiny_sft_config`'s."""
  from jetrl.train import EvalConfig
  from jetrl.study import StudyConfig, WarmStartConfig

  nodes = _tiny_nodes()
  base = StudyConfig(
    recipes=("fp8_rollout", "jet"),
    corrected=(),
    lengths=(1,),
    seeds=(0,),
    steps=2,
    prompts_per_step=2,
    token_margin=2,
    model=nodes["model"],
    task=nodes["task"],
    sampling=nodes["sampling"],
    optimizer=nodes["optimizer"],
    eval=EvalConfig(every=None, size=4),
    sft=WarmStartConfig(steps=4, batch_size=4),
  )

  def make(report_dir, **changes):
    return base.replace(report_dir=str(report_dir), **changes)

  return make


# The longest files (minutes each on 2 cores) first: `make test` hands whole files to its
# workers in collection order (--dist loadfile), and a long file collected last keeps one
# worker busy while the other has finished.
LONGEST_FIRST = (
  "tests/parallel/test_multi_process.py",
  "tests/test_notebooks.py",
  "tests/parallel/test_multi_device.py",
  "tests/train/test_runner.py",
  "tests/train/test_study.py",
)


def pytest_collection_modifyitems(config, items):
  rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
  where = lambda item: item.path.resolve().relative_to(ROOT).as_posix()
  items.sort(key=lambda item: rank.get(where(item), len(rank)))  # stable: other orders kept


# A test process compiles thousands of programs: past half of Linux's cap on its memory mappings
# it clears JAX's caches after a test (jetrl.kernels.code_memory says why; at the cap four
# full-suite runs lost a worker, at 65469 mappings).
@pytest.fixture(autouse=True)
def _bounded_code_mappings():
  yield
  from jetrl.kernels.code_memory import bound_code_mappings  # pylint: disable=import-outside-toplevel

  bound_code_mappings()


@contextlib.contextmanager
def one_torch_thread():
  """torch's threads fight XLA's for 2 cores (a 32-token SmolLM2 reference: 2 s with one
  thread, 15 s with two)."""
  import torch  # pylint: disable=import-outside-toplevel

  before = torch.get_num_threads()
  torch.set_num_threads(1)
  try:
    yield
  finally:
    torch.set_num_threads(before)


def parse_flags(argv, default=None):
  """The config an entry point would build from `argv` over `default` (a TrainConfig when
  None), with fresh flags each time."""
  from absl import flags  # pylint: disable=import-outside-toplevel

  from jetrl.config.flags import config_from_flags, define_flags  # pylint: disable=import-outside-toplevel
  from jetrl.train import TrainConfig  # pylint: disable=import-outside-toplevel

  default = default or TrainConfig()
  fv = flags.FlagValues()
  define_flags(default, fv)
  fv(["prog", *argv])
  return config_from_flags(default, fv)


# A ChatML template with a default system turn (the tokenizer tests' own, checked by hand).
CHATML_TEMPLATE = (
  "{% for message in messages %}"
  "{% if loop.first and message['role'] != 'system' %}"
  "{{ '<|im_start|>system\nyou are kind<|im_end|>\n' }}{% endif %}"
  "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
  "{% endfor %}"
  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_llama_config(vocab_size: int, **overrides):
  """A `transformers.LlamaConfig` of a random 2-layer Llama (d_model 64, 4 heads, 2 kv heads,
  untied embeddings) for tests against transformers; `overrides` change any field."""
  import transformers  # pylint: disable=import-outside-toplevel

  fields = dict(
    vocab_size=vocab_size,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    bos_token_id=1,
  )
  return transformers.LlamaConfig(**{**fields, **overrides})


def tensorboard_events(directory):
  """The events of every TensorBoard event file in `directory` (a pathlib.Path), files in
  name order (as TensorBoard reads them): each record is a uint64 length, its crc, the
  serialized Event, the data's crc."""
  import struct

  from tensorboardX.proto.event_pb2 import Event

  for name in sorted(os.listdir(directory)):
    data = (directory / name).read_bytes()
    at = 0
    while at < len(data):
      (n,) = struct.unpack("<Q", data[at : at + 8])
      yield Event.FromString(data[at + 12 : at + 12 + n])
      at += 12 + n + 4
