"""Configuration trees of frozen dataclasses, checked when built; flags generated from them.

`jetrl.config.fields` declares and checks fields, `jetrl.config.tree` handles a tree as a
whole (paths, copies, stored trees read back); `jetrl.config.flags` turns a tree into absl
flags with dotted names (and reads `--config=FILE`). The trees themselves live with the code
that reads them: `jetrl.sampling.SamplingConfig`, `jetrl.rl.OptimizerConfig`,
`jetrl.rl.UpdateConfig`, `jetrl.train.TrainConfig` (and its model, task, eval, checkpoint and
logging nodes), `jetrl.train.SFTConfig`, `jetrl.study.StudyConfig`.
"""

from jetrl.config.fields import (
  INT_MAX,
  SEED_MAX,
  ConfigError,
  FlagError,
  check_choice,
  check_fields,
  check_float,
  check_int,
  field,
  node,
)
from jetrl.config.tree import (
  flatten,
  former_names,
  from_dict,
  leaf_paths,
  replace,
  resumable_paths,
  to_dict,
  upgrade,
)

__all__ = [
  "INT_MAX",
  "SEED_MAX",
  "ConfigError",
  "FlagError",
  "check_choice",
  "check_fields",
  "check_float",
  "check_int",
  "field",
  "flatten",
  "former_names",
  "from_dict",
  "leaf_paths",
  "node",
  "replace",
  "resumable_paths",
  "to_dict",
  "upgrade",
]
