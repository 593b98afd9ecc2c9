"""A run's checkpoint as a Hugging Face folder: `export_run(ExportConfig(...))`, what
`experiments/export_hf.py` calls.

The checkpoint's own metadata holds the configuration it was trained with, so the export needs
only the workdir: the model (`model.name`, `model.n_layers`) and tokenizer (`model.tokenizer`)
of that configuration give the architecture and the tokenizer files, and the checkpoint gives
the params (verified against their checksums). The folder is written by
`jetrl.models.export_hf` (atomically, nothing non-finite) with the run's tokenizer, its chat
template, and a generation_config.json whose `eos_token_id` lists every id the run's samples
stopped on, so `transformers`' `generate` stops where jetrl's sampler did. A run on a preset
with the character tokenizer gets that tokenizer as a tokenizer.json `transformers` reads.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from typing import Optional

from jetrl.config import FlagError, check_fields, field, from_dict
from jetrl.models import PRESETS
from jetrl.models.io.export import EXPORT_DTYPES, export_hf
from jetrl.models.io.hub import is_hub_id
from jetrl.models.io.folder_paths import check_replaceable
from jetrl.train import pieces
from jetrl.models.lora import LoraConfig, merge
from jetrl.models.io.lora_export import export_peft
from jetrl.train.checkpoint import load_params_from, read_params
from jetrl.train.config import ModelSpec, Tree
from jetrl.train.validation import check_local, checkpoint_steps


@dataclasses.dataclass(frozen=True)
class ExportConfig(Tree):
  """`experiments/export_hf.py`: which run, which checkpoint, where to."""

  workdir: Optional[str] = field(None, "The workdir of an RL or SFT run (required).")
  out: Optional[str] = field(
    None,
    "The Hugging Face folder to write (required): outside every run's workdir; an existing "
    "non-empty one only with --overwrite, and only when an earlier export wrote it.",
  )
  step: Optional[int] = field(None, "The checkpoint's step (none: the newest intact one).", lo=0)
  dtype: Optional[str] = field(
    None,
    "Cast the weights to this dtype (none: as the checkpoint stores them).",
    choices=EXPORT_DTYPES,
  )
  overwrite: bool = field(
    False,
    "Replace a non-empty --out that an earlier export wrote (its .jetrl-export.json there) and "
    "that holds nothing else; any other folder is refused, naming what is in the way.",
  )
  adapter: bool = field(
    False,
    "For a LoRA run: write its adapters as a PEFT adapter folder (adapter_config.json, "
    "adapter_model.safetensors) instead of the base with the adapters merged.",
  )

  def __post_init__(self):
    check_fields(self)

  def check_paths(self) -> None:
    if not self.workdir:
      raise FlagError("workdir", "is required (the run whose checkpoint is exported)")
    check_local("workdir", self.workdir)
    if not os.path.isdir(self.workdir):
      raise FlagError("workdir", f"{self.workdir!r} is not a directory")
    if not checkpoint_steps(self.workdir):
      raise FlagError(
        "workdir",
        f"no checkpoint under {os.path.join(self.workdir, 'checkpoints')}; give the --workdir "
        "of an sft.py or train.py run",
      )
    if not self.out:
      raise FlagError("out", "is required (the folder to write)")
    check_local("out", self.out)
    check_out(self.out, self.workdir, self.overwrite)


def _holds_run(folder: str) -> bool:
  """A run's workdir: checkpoints, or metric records, in it."""
  return bool(checkpoint_steps(folder)) or any(
    os.path.lexists(os.path.join(folder, n)) for n in RUN_MARKS
  )


RUN_MARKS = ("metrics.jsonl", "sft_metrics.jsonl")


def check_out(out: str, workdir: str, overwrite: bool) -> None:
  """FlagError (--out) unless the export may write `out`: not the run's workdir, inside it or
  around it, nor inside any other run's workdir; missing or empty, or (with `overwrite`) an
  earlier export's folder holding only what that export wrote (`check_replaceable`). Nothing
  is touched before this passes."""
  real, run = os.path.realpath(out), os.path.realpath(workdir)
  where = (
    "is the run's --workdir"
    if real == run
    else "is inside the run's --workdir"
    if real.startswith(run + os.sep)
    else "holds the run's --workdir"
    if run.startswith(real.rstrip(os.sep) + os.sep)
    else None
  )
  if where:
    raise FlagError(
      "out",
      f"{out!r} {where} {workdir!r}; the export writes a folder of its own (replacing it with "
      "--overwrite): give a path outside the run, such as a sibling of the workdir",
    )
  folder = real
  while True:
    if _holds_run(folder):
      raise FlagError(
        "out",
        f"{out!r} {'is' if folder == real else 'is inside'} the workdir of a run ({folder}: "
        "checkpoints or metrics); give a path outside every run",
      )
    parent = os.path.dirname(folder)
    if parent == folder:
      break
    folder = parent
  try:
    check_replaceable(out, overwrite)
  except ValueError as e:
    raise FlagError(
      "out", str(e).removeprefix("export: ").replace("overwrite=True", "--overwrite")
    ) from None


def run_model_spec(meta: dict, workdir: str) -> ModelSpec:
  """The `model` node of the configuration a checkpoint was written with."""
  saved = meta.get("config", {}).get("model", {})
  try:
    model = from_dict(ModelSpec, saved, error=FlagError, prefix="model.")
  except FlagError as e:
    raise FlagError(
      "workdir", f"the run in {workdir} has a model config this version cannot read: {e}"
    ) from None
  for flag, path in (("model.name", model.name), ("model.tokenizer", model.tokenizer)):
    if path is not None and path not in PRESETS and not os.path.isdir(path) and not is_hub_id(path):
      raise FlagError(
        "workdir",
        f"the run in {workdir} was trained with --{flag}={path}, a "
        "folder that is not there any more (the export reads its config and "
        "tokenizer)",
      )
  return model


def _run_lora(meta: dict, workdir: str) -> Optional[LoraConfig]:
  """The LoRA config of the run a checkpoint comes from, or None for full fine-tuning."""
  saved = meta.get("config", {}).get("lora") or {}
  try:
    lora = from_dict(LoraConfig, saved, error=FlagError, prefix="lora.")
  except FlagError as e:
    raise FlagError(
      "workdir", f"the run in {workdir} has a LoRA config this version cannot read: {e}"
    ) from None
  return lora if lora.enabled else None


def _base_name(meta: dict, model: ModelSpec) -> str:
  """The base a LoRA run's adapters sit on: its --init_from, or its --model.name."""
  return meta.get("config", {}).get("init_from") or model.name


def _run_base(meta: dict, model: ModelSpec, mcfg, log):
  """A LoRA run's base params, built as the run built them (its seed, its --init_from)."""
  config = meta.get("config", {})
  params = pieces.make_params(model, mcfg, int(config.get("seed", 0)))
  init_from = config.get("init_from")
  if init_from:
    if not os.path.isdir(init_from):
      raise FlagError(
        "workdir",
        f"the LoRA run's base came from --init_from={init_from}, which is not there any more",
      )
    params = load_params_from(init_from, params, log)
  return params


def _stage_tokenizer(model: ModelSpec, tok, stop: tuple, dest: str) -> None:
  """The run's tokenizer files in `dest` (`tok.save_pretrained`), with a
  generation_config.json naming `stop`: the model's (or else the tokenizer folder's) own
  generation config with its eos ids replaced, or, where neither has one, the tokenizer's bos
  and pad ids."""
  tok.save_pretrained(dest)
  gen = {
    key: value
    for key, value in (("bos_token_id", tok.bos_token_id), ("pad_token_id", tok.pad_token_id))
    if value is not None
  }
  for folder in (pieces.model_folder(model), model.tokenizer):  # the model's config first
    path = os.path.join(folder or "", "generation_config.json")
    if folder and folder not in PRESETS and os.path.isfile(path):
      with open(path, encoding="utf-8") as f:
        gen = json.load(f)
      break
  gen["eos_token_id"] = [int(i) for i in stop]
  with open(os.path.join(dest, "generation_config.json"), "w", encoding="utf-8") as f:
    json.dump(gen, f, indent=2)


def export_run(cfg: ExportConfig, *, log=print) -> str:
  """Write checkpoint `cfg.step` (default: the newest intact one) of the run in `cfg.workdir`
  as a Hugging Face folder at `cfg.out`; returns its path. A FlagError names what is wrong."""
  cfg.check_paths()
  params, meta = read_params(cfg.workdir, cfg.step, flag="workdir", log=log)
  model = run_model_spec(meta, cfg.workdir)
  tok = pieces.make_tokenizer(model)
  stop = pieces.token_ids(tok).stop
  mcfg = pieces.model_config(model, tok, 0)
  lora = _run_lora(meta, cfg.workdir)
  if cfg.adapter and lora is None:
    raise FlagError("adapter", f"the run in {cfg.workdir} trained every weight, not LoRA adapters")
  if cfg.adapter:
    try:
      out = export_peft(
        params, mcfg, lora, cfg.out, base_model=_base_name(meta, model), overwrite=cfg.overwrite
      )
    except ValueError as e:
      raise FlagError("workdir", f"checkpoint {meta.get('step')} of {cfg.workdir}: {e}") from None
    log(
      f"exported the LoRA adapters of step {meta.get('step')} of {cfg.workdir} to {out} "
      f"(rank {lora.rank}, {', '.join(lora.targets)}); base {_base_name(meta, model)}"
    )
    return out
  if lora is not None:  # the run's base, rebuilt as the run built it, with the adapters merged
    params = merge(_run_base(meta, model, mcfg, log), params, lora)
  with tempfile.TemporaryDirectory(prefix="jetrl-export-tok-") as staging:
    _stage_tokenizer(model, tok, stop, staging)
    try:
      out = export_hf(
        params, mcfg, cfg.out, tokenizer_from=staging, dtype=cfg.dtype, overwrite=cfg.overwrite
      )
    except ValueError as e:
      raise FlagError("workdir", f"checkpoint {meta.get('step')} of {cfg.workdir}: {e}") from None
  log(
    f"exported step {meta.get('step')} of the {meta.get('kind', 'rl')} run in {cfg.workdir} "
    f"(model {model.name}, {mcfg.n_layers} layers) to {out}; stop ids {list(stop)}"
  )
  return out
