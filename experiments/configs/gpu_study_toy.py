"""experiments/gpu_study.py at a toy size that runs on a CPU in a minute or two (the tests run
it): a 1-layer model, length 1, two steps of two prompts x two samples, four evaluation
problems, one warm-start chunk of four steps.

  PYTHONPATH=src python3 experiments/gpu_study.py --out=/tmp/toy \\
      --config=experiments/configs/gpu_study_toy.py
"""


def get_config() -> dict:
  """The fields that differ from the GPU design's (the script's defaults)."""
  return {
    "length": 1,
    "token_margin": 2,
    "seeds": [0, 1],
    "steps": 2,
    "prompts_per_step": 2,
    "model": {"n_layers": 1},
    "sampling": {"n": 2},
    "optimizer": {"warmup_steps": 0},
    "eval": {"size": 4, "samples": 2, "batch": 4},
    "sft": {"steps": 4, "batch_size": 4, "max_steps": 4, "optimizer": {"warmup_steps": 0}},
  }
