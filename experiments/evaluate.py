"""Evaluation of a model on a task's held-out problems (no training): greedy, or the mean
accuracy of --eval.samples completions per problem drawn at --eval.temperature.

  # SmolLM2 before RL, on 200 GSM8K test problems, chat prompts, under the jet recipe
  python experiments/evaluate.py --model.name=$HOME/.cache/jetrl/models/SmolLM2-135M-Instruct \
      --task.name=gsm8k --task.data_path=data/gsm8k --task.prompt_format=chat \
      --eval.size=200 --eval.batch=200 --sampling.max_new_tokens=128
  # the same after: the params of an RL run's newest checkpoint (or an exported folder)
  python experiments/evaluate.py ... --init_from=runs/gsm8k

  # pass@1, pass@4 and maj@4 from 8 samples a problem, and the completions table
  python experiments/evaluate.py ... --eval.temperature=1.0 --eval.samples=8 --eval.k=1,4 \
      --out=runs/eval.json  # the table: runs/eval.samples.jsonl (or --samples_out=FILE)

Every flag is a field of jetrl.train.evaluate.EvalRunConfig, named by its path; the model,
task and eval flags are those of experiments/train.py. --out=FILE also writes the result
(accuracy, mean reward, mean length, pass@k and maj@k with --eval.k, seconds) as JSON, and
the completions table (one JSON line per completion) beside it unless --samples_out=FILE
names another file (docs/tasks.md, "pass@k and maj@k").
"""

from jetrl.data import RewardError
from jetrl.train.checkpoint import CheckpointError
from jetrl.train.cli import main
from jetrl.train.evaluate import EvalRunConfig, run_eval

if __name__ == "__main__":
  main(
    EvalRunConfig(),
    run_eval,
    doc=__doc__,
    exclude=("eval.every", "eval.also_bf16"),  # one evaluation, in the recipe's precision
    errors=(CheckpointError, RewardError),
  )
