"""The task data shipped in data/ (data/README.md): the published files, byte for byte, and
what the dataset tasks read from them with --task.data_path."""

import hashlib
import pathlib

from jetrl.data import get_task
from jetrl.data.loading import load_source_splits

DATA = pathlib.Path(__file__).resolve().parents[2] / "data"

# The published files' sha256 (openai/grade-school-math; MATH-500 as in openai/prm800k).
SHA256 = {
  "gsm8k/train.jsonl": "17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465",
  "gsm8k/test.jsonl": "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14",
  "math500/test.jsonl": "35dc41080a3680858b27fa7e0533d2d547825316fc5dafe5d316f4ccc5a06132",
}


def test_the_shipped_files_are_the_published_ones():
  for name, digest in SHA256.items():
    assert hashlib.sha256((DATA / name).read_bytes()).hexdigest() == digest, name
  for folder in ("gsm8k", "math500"):
    assert "MIT License" in (DATA / folder / "LICENSE").read_text()


def test_the_tasks_read_them_as_the_readme_says():
  gsm8k = load_source_splits(str(DATA / "gsm8k"), "openai/gsm8k")
  assert {k: len(v) for k, v in gsm8k.items()} == {"train": 7473, "test": 1319}
  assert len(load_source_splits(str(DATA / "math500"), "math500")["test"]) == 500
  # The first test question of GSM8K, and its final answer after "#### ".
  task = get_task("gsm8k", path=str(DATA / "gsm8k"), seed=0)
  answers = {p.answer for p in task.batch("test", 0, 1319)}
  assert "18" in answers  # Janet's ducks: 16 - 3 - 4 = 9 eggs at $2
