"""The RL half of `make demo`: 100 GRPO steps under the unified FP8 flow (`jet`) on 3-digit
addition, from the warm start of addition_sft.py.

  python experiments/train.py --config=experiments/configs/addition_jet.py \
      --workdir=runs/jet --init_from=runs/sft
  # the same run under another recipe, or longer:
  python experiments/train.py --config=experiments/configs/addition_jet.py \
      --workdir=runs/bf16 --init_from=runs/sft --recipe=bf16 --steps=160
"""

from jetrl.rl import OptimizerConfig
from jetrl.sampling import SamplingConfig
from jetrl.train import CheckpointConfig, EvalConfig, TaskConfig, TrainConfig


def get_config() -> TrainConfig:
  return TrainConfig(
    recipe="jet",
    steps=100,
    prompts_per_step=16,
    task=TaskConfig(name="addition", difficulty=1, length=3),
    sampling=SamplingConfig(max_new_tokens=64, temperature=0.7, n=8),
    optimizer=OptimizerConfig(lr=3e-5, warmup_steps=5),
    eval=EvalConfig(every=25, size=256),
    checkpoint=CheckpointConfig(every=50),
  )
