"""Config fields that several experiments/ scripts declare alike (`jetrl.config.field`)."""

from __future__ import annotations

from typing import Optional

from jetrl.config import field, node
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
