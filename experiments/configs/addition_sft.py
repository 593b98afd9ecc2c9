"""The warm start of `make demo`: 200 SFT steps on 3-digit addition's gold solutions, half of
whose final answers are misreported (the scratchpad stays right): a model that works the
problem out and then reports it correctly about half of the time, which RL learns to fix
(docs/precision_study.md, "Finding a regime where bf16 learns").

python experiments/sft.py --config=experiments/configs/addition_sft.py --workdir=runs/sft
"""

from jetrl.sampling import GenerationConfig
from jetrl.train import EvalConfig, SFTConfig, TaskConfig


def get_config() -> SFTConfig:
  return SFTConfig(
    steps=200,
    answer_noise=0.5,
    sampling=GenerationConfig(max_new_tokens=64),
    task=TaskConfig(name="addition", difficulty=1, length=3),
    eval=EvalConfig(every=None, size=256),
  )
