"""Tasks with verifiable rewards: GSM8K, MATH-500 and synthetic tasks, and their tokenizer.

The RL loop uses `get_task(name, **kwargs) -> Task`; a task gives `problem(split, index) ->
Problem(prompt, answer, solution)` and `reward(prompts, completions, answers) -> list[float]`.
A user's own task joins them with `register_task`, a user's reward function with
`load_reward("file.py:fn")` and `WithReward(task, reward)`. See docs/tasks.md.
"""

from jetrl.data.answer_extraction import canonical_number, extract_boxed, gsm8k_answer
from jetrl.data.arithmetic import Addition, Multiplication
from jetrl.data.gsm8k import GSM8K
from jetrl.data.loading import DatasetTask, load_source_splits
from jetrl.data.math500 import Math500
from jetrl.data.math_equivalence import math_equal
from jetrl.data.math_normalize import normalize_latex
from jetrl.data.prompts import chat_prompt_ids
from jetrl.data.registry import (
  DATASET_TASKS,
  SYNTHETIC_TASKS,
  TASKS,
  get_task,
  register_task,
  task_kwargs,
  task_names,
  unregister_task,
)
from jetrl.data.rewards import gsm8k_format_reward, gsm8k_reward, math_format_reward, math_reward
from jetrl.data.sorting import Sorting
from jetrl.data.synthetic import SyntheticTask, final_answer
from jetrl.data.task import SPLITS, Problem, Task, WithReward
from jetrl.data.tokenizer import ALPHABET, CharTokenizer, Tokenizer, char_tokenizer, stop_token_ids
from jetrl.data.user_reward import RewardError, UserReward, load_reward

__all__ = [
  "canonical_number",
  "extract_boxed",
  "gsm8k_answer",
  "Addition",
  "Multiplication",
  "GSM8K",
  "DatasetTask",
  "load_source_splits",
  "Math500",
  "math_equal",
  "normalize_latex",
  "DATASET_TASKS",
  "SYNTHETIC_TASKS",
  "TASKS",
  "get_task",
  "task_kwargs",
  "gsm8k_format_reward",
  "gsm8k_reward",
  "math_format_reward",
  "math_reward",
  "Sorting",
  "SyntheticTask",
  "final_answer",
  "SPLITS",
  "Problem",
  "Task",
  "ALPHABET",
  "CharTokenizer",
  "char_tokenizer",
  "Tokenizer",
  "stop_token_ids",
  "chat_prompt_ids",
  "register_task",
  "unregister_task",
  "task_names",
  "WithReward",
  "RewardError",
  "UserReward",
  "load_reward",
]
