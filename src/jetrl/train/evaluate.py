"""Evaluation of a model on a task's held-out problems, outside a run:
`run_eval(EvalRunConfig(...))`, what `experiments/evaluate.py` calls.

The model is a preset or a Hugging Face folder (`--model.name`, with `--model.tokenizer`),
optionally with the params of a run's newest checkpoint or of another Hugging Face folder
(`--init_from`); the task, its prompt format and reward are the `task` node of an RL run's
config, so the same flags evaluate a model before a run and the run's result after it. The
problems are the first `--eval.size` of the task's test split, sampled greedily (or
`--eval.samples` completions each at `--eval.temperature`) under the recipe's rollout
precision, `--eval.batch` at a time, stopping on every eos id of the tokenizer and the
generation config: the same numbers as a run's own evaluation at its step 0 and end.

With `--eval.k=1,4` (sampled: `--eval.temperature > 0`, `--eval.samples >= max k`) it also
reports pass@k and maj@k (`jetrl.train.pass_at_k`). The completions table (one JSON line per
completion: problem, sample, prompt, completion, answer, extracted answer, reward, correct,
length) goes to `--samples_out`, or, without it, beside `--out` (`result.json` ->
`result.samples.jsonl`); with neither it is not written.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Optional

import jax

from jetrl.config import field, node
from jetrl.train.progress import ticking
from jetrl.sampling import GenerationConfig
from jetrl.train import evaluation, pieces, validation
from jetrl.train.checkpoint import load_params_from
from jetrl.kernels import KernelConfig
from jetrl.train.config import KERNELS_HELP, RunConfig, recipe_field, seed_field
from jetrl.train.memory import check_eval_memory, eval_bytes
from jetrl.train.nodes import EvalConfig, ModelSpec, TaskConfig, given_task_config


@dataclasses.dataclass(frozen=True)
class EvalRunConfig(RunConfig):
  """`experiments/evaluate.py`: which model, which task, how many problems."""

  recipe: str = recipe_field("jet", "Precision recipe whose rollout precision samples.")
  init_from: Optional[str] = field(
    None,
    "Evaluate the params of the newest checkpoint of this run's workdir, or of this Hugging "
    "Face folder (none: --model.name's own weights).",
  )
  seed: int = seed_field("The task's seed (a random preset's init too).")
  out: Optional[str] = field(
    None,
    "Also write the result as JSON to this file, and the completions table beside it "
    "(FILE.json -> FILE.samples.jsonl) unless --samples_out names another file.",
  )
  samples_out: Optional[str] = field(
    None,
    "Write the completions table here (JSON lines: problem, sample, prompt, completion, "
    "answer, extracted, reward, correct, length; none: beside --out, or nowhere).",
  )
  model: ModelSpec = node(ModelSpec, "The model.")
  task: TaskConfig = node(TaskConfig, "The task, its prompt format and reward.")
  sampling: GenerationConfig = node(GenerationConfig, "The generation budget per problem.")
  eval: EvalConfig = node(EvalConfig(every=None), "How many held-out problems, how many a call.")
  kernels: KernelConfig = node(KernelConfig, KERNELS_HELP)

  def check_paths(self) -> None:
    validation.check_init_from(self.init_from)
    validation.check_model(self.model.name, self.model.tokenizer)
    validation.check_reward(self.task.reward)
    if self.out is not None:
      validation.check_local("out", self.out)
      if os.path.isdir(self.out):
        raise validation.FlagError("out", f"{self.out!r} is a directory; give a file name")
    if self.samples_out is not None:
      validation.check_local("samples_out", self.samples_out)
      if os.path.isdir(self.samples_out):
        raise validation.FlagError(
          "samples_out", f"{self.samples_out!r} is a directory; give a file name"
        )

  @property
  def table_path(self) -> Optional[str]:
    """Where the completions table goes: --samples_out, else beside --out, else None."""
    if self.samples_out is not None:
      return self.samples_out
    if self.out is not None:
      return os.path.splitext(self.out)[0] + ".samples.jsonl"
    return None


def run_eval(cfg: EvalRunConfig, *, task=None, log=print) -> dict:
  """Accuracy (greedy, or at `cfg.eval.temperature`), mean reward and mean length on the first
  `cfg.eval.size` test problems (and the seconds it took); written to `cfg.out` when given. `task`: a `jetrl.data.Task`
  object instead of the one `cfg.task` names. FlagErrors as for `jetrl.train.run`."""
  if task is not None:
    cfg = given_task_config(cfg, task)
  cfg.check_paths()
  reward = None
  try:
    reward = pieces.load_user_reward(cfg.task, log)
    tok = pieces.make_tokenizer(cfg.model, cfg.task)
    encode = pieces.prompt_encoder(cfg.task, tok)
    loaded, _ = pieces.load_task(
      cfg.task, seed=cfg.seed, tok=tok, encode=encode, given=task, reward=reward
    )
    problems = loaded.batch("test", 0, cfg.eval.size)
    width = pieces.prompt_width([encode(p.prompt) for p in problems])
    mcfg = pieces.model_config(cfg.model, tok, width + cfg.sampling.max_new_tokens)
    recipe = cfg.precision_recipe
    check_eval_memory(
      eval_bytes(
        mcfg,
        rows=cfg.eval.rows,
        max_new_tokens=cfg.sampling.max_new_tokens,
        resident=mcfg.n_params * 4,
        prompt_width=width,
        recipe=recipe,
      ),
      "--eval.batch / --eval.samples / --sampling.max_new_tokens",
    )
    params = pieces.make_params(cfg.model, mcfg, cfg.seed)
    if cfg.init_from:
      params = load_params_from(cfg.init_from, params, log)
    log(
      f"jetrl eval: model={pieces.describe_model(cfg.model)}{' from ' + cfg.init_from if cfg.init_from else ''} "
      f"task={cfg.task.name} ({cfg.task.prompt_format} prompts) recipe={cfg.recipe} "
      f"{cfg.eval.size} problems x {cfg.sampling.max_new_tokens} new tokens on "
      f"{jax.devices()[0].platform}"
    )
    t0 = time.time()
    run_pieces = pieces.Pieces(recipe, tok, encode, loaded, width, mcfg, kernels=cfg.kernels)
    table = [] if cfg.table_path is not None else None
    with ticking("compiling the sampler (first batch only) and evaluating", log) as clock:
      res = evaluation.evaluate(
        params,
        run_pieces,
        recipe.rollout,
        cfg.eval,
        max_new_tokens=cfg.sampling.max_new_tokens,
        log=clock.line,
        table=table,
      )
  finally:
    if reward is not None:
      reward.close()
  res = dict(res, problems=cfg.eval.size, seconds=round(time.time() - t0, 1))
  log(
    f"{cfg.eval.label} {res['eval_accuracy']:.3f} (reward {res['eval_reward']:.3f}, length "
    f"{res['eval_length']:.1f}) on {cfg.eval.size} held-out problems in {res['seconds']:.0f}s"
  )
  at_k = evaluation.at_k_line(res, cfg.eval.k)
  if at_k:
    log(at_k)
  if table is not None:
    _write_atomic(cfg.table_path, "".join(json.dumps(r) + "\n" for r in table))
    log(f"completions table: {cfg.table_path} ({len(table)} rows)")
  if cfg.out is not None:
    _write_atomic(cfg.out, json.dumps(dict(res, config=cfg.to_dict()), indent=1))
  return res


def _write_atomic(path: str, text: str) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(text)
  os.replace(tmp, path)
