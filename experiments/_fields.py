"""Config fields that several experiments/ scripts declare alike (`jetrl.config.field`)."""

from __future__ import annotations

import os
from typing import Optional

from jetrl.config import field, node
from jetrl.models import smollm2
from jetrl.precision import RECIPES
from jetrl.train import ModelSpec

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
  """--gsm8k: the GSM8K test split next to the checkout (shared/data/gsm8k)."""
  here = os.path.dirname(os.path.abspath(__file__))
  return field(
    os.path.join(here, "..", "..", "shared", "data", "gsm8k", "test.jsonl"),
    "GSM8K test split (JSON lines with `question` and `answer` fields).",
  )
