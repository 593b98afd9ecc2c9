"""RL training run: GRPO / DAPO / Dr.GRPO under a precision recipe, from a preset or a checkpoint.

  python experiments/train.py --workdir=runs/jet --recipe=jet --init_from=runs/sft \
      --task.name=addition --task.length=3 --sampling.temperature=0.7 --optimizer.lr=3e-5
  python experiments/train.py --config=experiments/configs/addition_jet.py --workdir=runs/jet
  # a Hugging Face folder on GSM8K, chat prompts, a reward function of your own
  python experiments/train.py --workdir=runs/gsm8k --recipe=jet \
      --model.name=$HOME/.cache/jetrl/models/SmolLM2-135M-Instruct --task.name=gsm8k \
      --task.data_path=data/gsm8k --task.prompt_format=chat \
      --task.reward=experiments/my_rewards.py:score
  python -m jetrl.launch --processes=2 --local_devices=2 -- experiments/train.py \
      --workdir=runs/jet2 --mesh=data:4      # 2 processes x 2 CPU devices (docs/scaling.md)

Every flag is a field of jetrl.train.TrainConfig, named by its path in the configuration
(--optimizer.lr, --sampling.n, --update.loss, ...); --config=FILE reads a whole configuration
(a Python file with get_config(), or JSON / YAML such as a run's config.json) and the flags
given override it. Metrics go to <workdir>/metrics.jsonl (+ eval.jsonl, TensorBoard under tb/,
PNG plots under plots/). Rerunning the same command resumes from the latest checkpoint.
experiments/export_hf.py writes a checkpoint as a Hugging Face folder; experiments/evaluate.py
evaluates a model or a run's checkpoint on held-out problems.
"""

from jetrl import parallel
from jetrl.data import RewardError
from jetrl.train import TrainConfig, run
from jetrl.train.checkpoint import CheckpointError
from jetrl.train.cli import main
from jetrl.train.skips import SkippedUpdatesError


def train(cfg: TrainConfig) -> None:
  summary = run(cfg)
  if parallel.is_primary():  # said once in a run of several processes
    print(
      f"done: held-out {cfg.eval.label} {summary['eval_before']} -> {summary['eval_after']}; "
      f"plots: {', '.join(summary.get('plots', []))}"
    )


if __name__ == "__main__":
  main(
    TrainConfig(),
    train,
    doc=__doc__,
    errors=(SkippedUpdatesError, CheckpointError, RewardError),
  )
