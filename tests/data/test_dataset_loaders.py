"""GSM8K and MATH-500 tasks: loading (shared files and small files made here), splits, seeded
shuffles with a reshuffle per epoch, resuming, prompt templates."""

import json
import os
import subprocess
import sys

import pytest

from jetrl.data import GSM8K, CharTokenizer, Math500, Problem, get_task
from jetrl.data.prompts import CHAT_INSTRUCTION
from shared_data import GSM8K_DIR, MATH500_FILE, needs_shared, read_jsonl


@pytest.fixture(scope="module")
def gsm8k():
  return get_task("gsm8k", path=str(GSM8K_DIR), seed=3)


@pytest.fixture(scope="module")
def math500():
  return get_task("math500", path=str(MATH500_FILE.parent), seed=3)


@needs_shared
def test_row_counts(gsm8k, math500):
  assert gsm8k.num_problems("train") == 7473 and gsm8k.num_problems("test") == 1319
  assert math500.num_problems("train") == 400 and math500.num_problems("test") == 100
  whole = get_task("math500", path=str(MATH500_FILE), split={"train": "test", "test": "test"})
  assert whole.num_problems("train") == whole.num_problems("test") == 500


@needs_shared
def test_problems_match_the_files(gsm8k, math500):
  rows = read_jsonl(GSM8K_DIR / "test.jsonl")
  for i in (0, 1, 500, 1318):
    k = gsm8k.row_index("test", i)
    p = gsm8k.problem("test", i)
    assert rows[k]["question"].strip() in p.prompt
    assert p.answer == rows[k]["answer"].split("#### ")[-1].replace(",", "")
    assert p.solution.endswith("#### " + rows[k]["answer"].split("#### ")[-1])
    assert gsm8k.reward([p.prompt], [p.solution], [p.answer]) == [1.0]
  mrows = {r["problem"]: r for r in read_jsonl(MATH500_FILE)}
  for split in ("train", "test"):
    for i in range(0, 400, 37):
      p = math500.problem(split, i)
      row = next(r for q, r in mrows.items() if q.strip() in p.prompt)
      assert p.answer == row["answer"] and p.solution == row["solution"]
      assert math500.reward([p.prompt], [p.solution], [p.answer]) == [1.0]


@needs_shared
def test_every_row_once_per_epoch_and_reshuffled(math500):
  n = math500.num_problems("train")
  epoch0 = [math500.row_index("train", i) for i in range(n)]
  epoch1 = [math500.row_index("train", i) for i in range(n, 2 * n)]
  assert sorted(epoch0) == sorted(epoch1) == list(range(n))
  assert epoch0 != epoch1 and epoch0 != list(range(n))
  rows = math500.rows("train")
  assert math500.problem("train", n + 5) == math500.make_problem(rows[epoch1[5]])


@needs_shared
def test_shuffle_is_seeded_and_resumable(gsm8k):
  same = get_task("gsm8k", path=str(GSM8K_DIR), seed=3)
  other = get_task("gsm8k", path=str(GSM8K_DIR), seed=4)
  first = gsm8k.batch("train", 0, 50)
  assert first == same.batch("train", 0, 50)
  assert first != other.batch("train", 0, 50)
  # Resuming at position 30 (a fresh task, as after a restart) continues the same stream.
  resumed = get_task("gsm8k", path=str(GSM8K_DIR), seed=3)
  assert list(resumed.problems("train", start=30, count=20)) == first[30:]
  assert resumed.problem("train", 7473 * 3 + 2) == gsm8k.problem("train", 7473 * 3 + 2)
  unshuffled = get_task("gsm8k", path=str(GSM8K_DIR), shuffle=False)
  assert [unshuffled.row_index("test", i) for i in (0, 1, 1319, 1320)] == [0, 1, 0, 1]


@needs_shared
def test_held_out_rows_do_not_depend_on_the_seed(math500):
  a = {p.prompt for p in math500.batch("test", 0, 100)}
  b_task = get_task("math500", path=str(MATH500_FILE), seed=99)
  b = {p.prompt for p in b_task.batch("test", 0, 100)}
  train = {p.prompt for p in math500.batch("train", 0, 400)}
  assert a == b and len(a) == 100 and len(train) == 400 and not a & train


def write_jsonl(path, rows):
  with open(path, "w", encoding="utf-8") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")
  return str(path)


def gsm_rows(n, offset=0):
  return [
    {
      "question": f"What is {i} + {i}?",
      "answer": f"{i} + {i} = <<{i}+{i}={2 * i}>>{2 * i}\n#### {2 * i:,}",
    }
    for i in range(offset, offset + n)
  ]


def test_small_local_files(tmp_path):
  d = tmp_path / "gsm"
  d.mkdir()
  write_jsonl(d / "train.jsonl", gsm_rows(30))
  write_jsonl(d / "test.jsonl", gsm_rows(7, 1000))
  task = get_task("gsm8k", path=str(d))
  assert (task.num_problems("train"), task.num_problems("test")) == (30, 7)
  p = task.problem("test", 0)
  assert p.answer in {str(2 * i) for i in range(1000, 1007)}
  assert "<<" not in p.solution and p.solution.endswith(f"#### {int(p.answer):,}")
  assert p.prompt.startswith("Question: What is 10") and p.prompt.endswith("Answer:\n")
  assert task.max_completion_chars == max(
    len(f"{i} + {i} = {2 * i}\n#### {2 * i:,}") for i in range(30)
  )
  # One file: carved 80/20, or with an explicit test_size.
  single = get_task("gsm8k", path=str(d / "train.jsonl"))
  assert (single.num_problems("train"), single.num_problems("test")) == (24, 6)
  sized = get_task("gsm8k", path=str(d / "train.jsonl"), test_size=10)
  assert (sized.num_problems("train"), sized.num_problems("test")) == (20, 10)
  carved = get_task("gsm8k", path=str(d), split="train", test_size=0.5)
  assert (carved.num_problems("train"), carved.num_problems("test")) == (15, 15)


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"path": "/nonexistent/dir"}, "does not exist"),
    ({"split": ["train"]}, "split must be"),
    ({"split": {"train": "train"}}, "split must be"),
    ({"test_size": 0}, "test_size"),
    ({"test_size": -0.5}, "test_size"),
    ({"template": "fancy"}, "unknown template"),
    ({"template": "chat"}, "needs tokenizer"),
    ({"seed": "1"}, "seed"),
  ],
)
def test_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    get_task("gsm8k", **kwargs)


def test_bad_files(tmp_path):
  (tmp_path / "empty").mkdir()
  with pytest.raises(ValueError, match="no \\*.jsonl"):
    get_task("gsm8k", path=str(tmp_path / "empty")).problem("train", 0)
  other = write_jsonl(tmp_path / "other.jsonl", [{"prompt": "x", "completion": "y"}] * 5)
  with pytest.raises(ValueError, match="lacks columns"):
    get_task("gsm8k", path=other).problem("train", 0)
  d = tmp_path / "three"
  d.mkdir()
  for name in ("a", "b", "c"):
    write_jsonl(d / f"{name}.jsonl", gsm_rows(5))
  with pytest.raises(ValueError, match="pass split="):
    get_task("gsm8k", path=str(d)).problem("train", 0)
  with pytest.raises(ValueError, match="no source split 'train'"):
    get_task("gsm8k", path=str(d), split={"train": "train", "test": "a"}).num_problems("test")
  assert get_task("gsm8k", path=str(d), split={"train": "a", "test": "b"}).num_problems("test") == 5
  with pytest.raises(ValueError, match="test_size"):
    get_task("gsm8k", path=str(d), split="a", test_size=5).num_problems("test")


def test_math_rows_without_solution(tmp_path):
  path = write_jsonl(
    tmp_path / "m.jsonl",
    [{"problem": f"Compute ${i}+1$.", "answer": str(i + 1)} for i in range(10)],
  )
  task = get_task("math500", path=path, test_size=2)
  p = task.problem("train", 0)
  assert p.solution == "" and p.prompt.startswith("Problem: Compute $")
  assert "\\boxed{}" in p.prompt and p.prompt.endswith("Solution:\n")
  assert task.reward(None, [f"\\boxed{{{p.answer}}}"], [p.answer]) == [1.0]
  assert task.reward(None, ["\\boxed{x}"], [p.answer]) == [0.0]


class FakeChatTokenizer(CharTokenizer):
  """The character tokenizer with a chat template of its own."""

  chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"

  def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False):
    assert tokenize is False and add_generation_prompt is True
    return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def test_the_chat_template_needs_a_tokenizer(tmp_path):
  path = write_jsonl(tmp_path / "train.jsonl", gsm_rows(10))
  for tok in (None, object()):
    with pytest.raises(
      ValueError, match="template='chat' needs tokenizer= \\(a jetrl.data.Tokenizer"
    ):
      get_task("gsm8k", path=path, template="chat", tokenizer=tok)


def test_chat_template(tmp_path):
  path = write_jsonl(tmp_path / "train.jsonl", gsm_rows(10))
  chat = get_task("gsm8k", path=path, template="chat", tokenizer=FakeChatTokenizer())
  p = chat.problem("train", 0)
  assert p.prompt.startswith("<user>What is ") and p.prompt.endswith(
    CHAT_INSTRUCTION + "<assistant>"
  )
  no_template = FakeChatTokenizer()
  no_template.chat_template = None
  plain = get_task("gsm8k", path=path, template="chat", tokenizer=no_template)
  assert plain.problem("train", 0).prompt.startswith("Question: ")


def test_message_template_is_the_unrendered_user_turn(tmp_path):
  path = write_jsonl(tmp_path / "train.jsonl", gsm_rows(10))
  chat = get_task("gsm8k", path=path, template="chat", tokenizer=FakeChatTokenizer())
  message = get_task("gsm8k", path=path, template="message")  # no tokenizer needed
  p, q = chat.problem("train", 3), message.problem("train", 3)
  assert p.prompt == f"<user>{q.prompt}<assistant>" and q.prompt.endswith(CHAT_INSTRUCTION)
  assert (p.answer, p.solution) == (q.answer, q.solution)


def test_chat_template_of_a_transformers_tokenizer(tmp_path):
  transformers = pytest.importorskip("transformers")
  from jetrl.data import char_tokenizer

  hf = transformers.PreTrainedTokenizerFast(tokenizer_file=char_tokenizer().save(tmp_path / "t"))
  hf.chat_template = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
  )
  path = write_jsonl(tmp_path / "m.jsonl", [{"problem": "Find $x$.", "answer": "1"}] * 5)
  task = get_task("math500", path=path, template="chat", tokenizer=hf)
  assert task.problem("test", 0).prompt == f"[user] Find $x$.\n{CHAT_INSTRUCTION}\n[assistant] "


def test_hub_unreachable_is_a_clear_error():
  code = (
    "import jetrl.data as d\n"
    "try:\n  d.get_task('math500').problem('test', 0)\n  print('LOADED from a local cache')\n"
    "except RuntimeError as e:\n  print('ERR', e)\n"
  )
  env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
  out = subprocess.run(
    [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
  )
  if "LOADED" in out.stdout:
    pytest.skip("MATH-500 is in the local Hugging Face cache")
  assert "ERR could not load 'HuggingFaceH4/MATH-500'" in out.stdout, out.stderr[-2000:]
  assert "pass path=" in out.stdout


def test_classes():
  assert isinstance(get_task("gsm8k"), GSM8K) and isinstance(get_task("math500"), Math500)
  assert isinstance(Problem("p", "a", "s"), Problem)


@pytest.mark.parametrize(
  "name, rows, message",
  [
    ("gsm8k", "no_answer", r"train\.jsonl:187: the row lacks columns \['answer'\]"),
    ("gsm8k", "int_question", r"train\.jsonl:187: field 'question': must be a string, got int"),
    ("gsm8k", "empty_answer", r"train\.jsonl:187: field 'answer': is empty"),
    ("gsm8k", "no_hashes", r"train\.jsonl:187: field 'answer': must end in '#### "),
    (
      "math500",
      "null_answer",
      r"train\.jsonl:187: field 'answer': must be a non-empty string "
      r"or a number, got None",
    ),
    ("math500", "blank_answer", r"train\.jsonl:187: field 'answer': must be a non-empty"),
    ("math500", "list_solution", r"train\.jsonl:187: field 'solution': must be a string"),
  ],
)
def test_every_row_is_checked_when_the_task_loads(tmp_path, name, rows, message):
  if name == "gsm8k":
    change = {
      "no_answer": None,
      "int_question": {"question": 7},
      "empty_answer": {"answer": "  "},
      "no_hashes": {"answer": "4 + 4 = 8"},
    }[rows]
    data = gsm_rows(200)
    data[186] = (
      {k: v for k, v in data[186].items() if k != "answer"}
      if change is None
      else dict(data[186], **change)
    )
  else:
    data = [
      {"problem": f"Compute ${i}+1$.", "answer": str(i + 1), "solution": "s"} for i in range(200)
    ]
    data[186] = dict(
      data[186],
      **{
        "null_answer": {"answer": None},
        "blank_answer": {"answer": ""},
        "list_solution": {"solution": ["s"]},
      }[rows],
    )
  path = write_jsonl(tmp_path / "train.jsonl", data)
  task = get_task(name, path=path)
  with pytest.raises(ValueError, match=message):
    task.problem("train", 0)  # the first problem: the bad row is found at load, not at use


def test_file_errors_name_the_path_and_line(tmp_path):
  good = json.dumps(gsm_rows(1)[0])
  cases = {
    "torn.jsonl": (good + "\n" + good + "\n" + good[:30] + "\n" + good + "\n").encode(),
    "empty.jsonl": b"\n  \n",
    "latin1.jsonl": (good + "\n").encode() + '{"question": "caf\xe9"}\n'.encode("latin-1"),
    "array.jsonl": (good + "\n[1, 2]\n").encode(),
  }
  expected = {
    "torn.jsonl": r"torn\.jsonl:3: invalid JSON \(.*column",
    "empty.jsonl": r"empty\.jsonl: empty file",
    "latin1.jsonl": r"latin1\.jsonl:2: not UTF-8 text \(byte 0xe9 at column 18\)",
    "array.jsonl": r"array\.jsonl:2: a row must be a JSON object, got list",
  }
  for fname, data in cases.items():
    (tmp_path / fname).write_bytes(data)
    with pytest.raises(ValueError, match=expected[fname]):
      get_task("gsm8k", path=str(tmp_path / fname)).num_problems("train")
  # A .json file may hold one array of rows; a bad item is named by its index.
  (tmp_path / "rows.json").write_text(json.dumps(gsm_rows(10)))
  assert get_task("gsm8k", path=str(tmp_path / "rows.json")).num_problems("train") == 8
  (tmp_path / "bad.json").write_text(json.dumps(gsm_rows(3) + [{"question": "q"}]))
  with pytest.raises(ValueError, match=r"bad\.json item 3: the row lacks columns"):
    get_task("gsm8k", path=str(tmp_path / "bad.json")).num_problems("train")
