"""The warm start of `make demo`: 150 SFT steps on 3-digit addition's gold solutions.

python experiments/sft.py --config=experiments/configs/addition_sft.py --workdir=runs/sft
"""

from jetrl.sampling import GenerationConfig
from jetrl.train import EvalConfig, SFTConfig, TaskConfig


def get_config() -> SFTConfig:
  return SFTConfig(
    steps=150,
    sampling=GenerationConfig(max_new_tokens=64),
    task=TaskConfig(name="addition", difficulty=1, length=3),
    eval=EvalConfig(every=None, size=256),
  )
