"""Rows that the reward cannot score are refused when the task loads, and prompts longer than
the model's positions when a run starts: each gold answer is scored once, against itself."""

from __future__ import annotations

import json
import os

import pytest

from jetrl.config import FlagError
from jetrl.data import char_tokenizer, get_task
from jetrl.train import TaskConfig
from jetrl.train import pieces


def write(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


def gsm_rows(n):
  return [
    {"question": f"What is {i} + {i}?", "answer": f"{i} + {i}\n#### {2 * i}"} for i in range(n)
  ]


@pytest.mark.parametrize(
  "answer", ["blah #### eighteen", "#### 18 - 2", "#### 1,0,8,0", "#### 1 8", "#### 18+2"]
)
def test_a_gsm8k_row_whose_gold_the_reward_cannot_read_is_refused(tmp_path, answer):
  rows = gsm_rows(6)
  rows[3]["answer"] = answer
  d = tmp_path / "gsm"
  d.mkdir()
  write(d / "train.jsonl", rows)
  write(d / "test.jsonl", gsm_rows(2))
  with pytest.raises(
    ValueError, match=r"train\.jsonl:4: field 'answer': its final answer .* score 0"
  ):
    get_task("gsm8k", path=str(d)).num_problems("train")


def test_gsm8k_rows_with_thousands_separators_load_and_score(tmp_path):
  d = tmp_path / "gsm"
  d.mkdir()
  write(d / "train.jsonl", [{"question": "q", "answer": "so\n#### 1,080"}] + gsm_rows(3))
  write(d / "test.jsonl", gsm_rows(2))
  task = get_task("gsm8k", path=str(d))
  assert task.num_problems("train") == 4
  assert sorted(p.answer for p in task.batch("train", 0, 4)) == ["0", "1080", "2", "4"]
  assert task.reward(None, ["#### 1080", "\\boxed{1,080}", "#### 108"], ["1080"] * 3) == [1, 1, 0]


def math_file(tmp_path, answers):
  rows = [{"problem": f"p{k}", "answer": a} for k, a in enumerate(answers)]
  return write(tmp_path / "math.jsonl", rows)


def test_a_math_number_answer_is_its_plain_digits(tmp_path):
  path = tmp_path / "math.jsonl"
  path.write_text('{"problem": "p", "answer": 1e20}\n{"problem": "q", "answer": 2.5e-3}\n')
  task = get_task("math500", path=str(path), split={"train": "math", "test": "math"})
  answers = sorted(p.answer for p in task.batch("train", 0, 2))
  assert answers == ["0.0025", "100000000000000000000"]
  gold = "100000000000000000000"
  completions = ["\\boxed{100000000000000000000}", "\\boxed{10^{20}}", "\\boxed{20+e}"]
  assert task.reward(None, completions, [gold] * 3) == [1.0, 1.0, 0.0]


@pytest.mark.parametrize("answer", ["\\frac{1}{2", "}{", "\\boxed{3"])
def test_a_math_answer_the_reward_cannot_match_is_refused(tmp_path, answer):
  path = math_file(tmp_path, ["1", answer, "3"])
  task = get_task("math500", path=str(path), split={"train": "math", "test": "math"})
  with pytest.raises(ValueError, match=r"math\.jsonl:2: field 'answer': .*cannot be scored"):
    task.num_problems("train")


def test_a_prompt_longer_than_the_model_is_refused_at_start_up(tmp_path):
  d = tmp_path / "gsm"
  d.mkdir()
  write(d / "train.jsonl", gsm_rows(4))
  long_test = gsm_rows(3)
  long_test[2]["question"] = "x" * 5000  # only in the test split: once found by the evaluation
  write(d / "test.jsonl", long_test)
  cfg = TaskConfig(name="gsm8k", data_path=str(d))
  tok = char_tokenizer()
  encode = lambda text: [0] * len(text)  # one id per character
  with pytest.raises(
    FlagError, match=r"^--task.data_path: problem \d+ of the test split .* prompt of 5\d\d\d tokens"
  ):
    pieces.load_task(cfg, seed=0, tok=tok, encode=encode, max_prompt_tokens=1024)
  _, width = pieces.load_task(
    cfg, seed=0, tok=tok, encode=encode
  )  # a preset's positions grow to fit it
  assert width >= 5000


def load(path):
  return pieces.load_task(
    TaskConfig(name="gsm8k", data_path=str(path)), seed=0, tok=char_tokenizer()
  )


def test_a_data_path_that_is_not_a_regular_file_is_refused_before_it_is_opened(tmp_path):
  """`--task.data_path` is the user's to give (read with their rights, links followed), but a
  FIFO in a data folder once blocked the start-up for ever, and /dev/zero never ends."""
  import signal

  def late(*_):
    raise TimeoutError("the data path blocked the start-up")

  d = tmp_path / "gsm"
  d.mkdir()
  write(d / "train.jsonl", gsm_rows(4))
  os.mkfifo(d / "test.jsonl")
  old = signal.signal(signal.SIGALRM, late)
  signal.alarm(30)
  try:
    with pytest.raises(FlagError, match=r"^--task.data_path: gsm8k: .*test\.jsonl: not a regular"):
      load(d)
    (d / "test.jsonl").unlink()
    os.symlink("/dev/zero", d / "test.jsonl")
    with pytest.raises(FlagError, match=r"test\.jsonl: not a regular file"):
      load(d)
    for path in ("/dev/zero", str(d / "test.jsonl")):
      with pytest.raises(FlagError, match=r"^--task.data_path: .*neither a regular file nor a"):
        load(path)
  finally:
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def test_a_data_path_anywhere_is_read_as_data_only(tmp_path):
  """A path outside the working directory (`../..`) is the user's own: it is read as JSON
  lines, and a file that is not is an error naming its line, never more of its content."""
  secret = tmp_path / "secret.txt"
  secret.write_text("password=hunter2\n")
  relative = os.path.relpath(secret)
  with pytest.raises(FlagError) as caught:
    load(relative)
  assert "secret.txt:1: invalid JSON" in str(caught.value)
  assert "hunter2" not in str(caught.value)
  assert secret.read_text() == "password=hunter2\n"
