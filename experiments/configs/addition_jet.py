"""The RL half of `make demo`: 30 GRPO steps under the unified FP8 flow (`jet`) on 3-digit
addition, from the warm start of addition_sft.py (the precision study's setting: temperature
0.5, lr 5e-5, 16 prompts x 8 samples).

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
    steps=30,
    prompts_per_step=16,
    task=TaskConfig(name="addition", difficulty=1, length=3),
    sampling=SamplingConfig(max_new_tokens=64, temperature=0.5, n=8),
    optimizer=OptimizerConfig(lr=5e-5),
    eval=EvalConfig(every=10, size=256),
    checkpoint=CheckpointConfig(every=10),
  )
