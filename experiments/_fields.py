"""Config fields that several experiments/ scripts declare alike (`jetrl.config.field`)."""

from __future__ import annotations

import importlib.util
import os
from typing import Optional

from jetrl.config import FlagError, field, node
from jetrl.models.io import smollm2
from jetrl.precision import RECIPES
from jetrl.train import ModelSpec
from jetrl.train.validation import check_model

# ModelSpec's fields that a script building a preset with random weights does not use.
PRESET_ONLY = ("model.n_layers", "model.tokenizer")


def recipes_field(default: tuple[str, ...], help: str = "Recipes to compare.", extra=()):
  """Recipes (jetrl.precision.RECIPES, and the names in `extra`)."""
  return field(default, help, choices=(*extra, *RECIPES))


def preset_model(name: str = "tiny"):
  """--model.name: a preset, with random weights."""
  return node(ModelSpec(name=name), "The model: a preset (jetrl.models.PRESETS), random weights.")


def json_out_field() -> Optional[str]:
  return field(None, "Optional path for the results as JSON.")


def smollm2_model():
  """--model.name: a Hugging Face folder, by default the one `make smollm2` writes."""
  folder = os.path.join(os.path.expanduser(smollm2.DEFAULT_CACHE), smollm2.FOLDER)
  return node(
    ModelSpec(name=folder),
    "A Hugging Face folder (default: the SmolLM2-135M-Instruct folder of `make smollm2`).",
  )


def gsm8k_field() -> str:
  """--gsm8k: the GSM8K test split shipped in the checkout (data/gsm8k, data/README.md)."""
  here = os.path.dirname(os.path.abspath(__file__))
  return field(
    os.path.normpath(os.path.join(here, "..", "data", "gsm8k", "test.jsonl")),
    "GSM8K test split (JSON lines with `question` and `answer` fields; default: the one "
    "shipped in data/gsm8k).",
  )


def check_model_inputs(model: ModelSpec, gsm8k: str, packages: tuple[str, ...] = ()) -> None:
  """One-line FlagErrors, before anything loads, for a script that reads a Hugging Face model
  folder and GSM8K questions: the folder (`make smollm2` writes the default one), the GSM8K
  file, and the packages it compares against (torch, transformers: `make install-test`)."""
  missing = [p for p in packages if importlib.util.find_spec(p) is None]
  if missing:
    raise FlagError(
      None,
      f"this script compares against {' and '.join(packages)}, not installed here "
      f"(missing: {', '.join(missing)}); `make install-test` installs them into .venv",
    )
  if not os.path.isdir(model.name):
    raise FlagError(
      "model.name",
      f"{model.name!r} is not a folder; `make smollm2` writes SmolLM2-135M-Instruct's, or "
      "give a Hugging Face folder",
    )
  check_model(model.name, model.tokenizer)
  if not os.path.isfile(gsm8k):
    raise FlagError("gsm8k", f"{gsm8k!r} is not a file; give GSM8K's test.jsonl")
