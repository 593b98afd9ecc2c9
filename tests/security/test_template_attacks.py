"""A model folder's chat template is a program from a download: it renders within a time and
a memory limit, in a worker process, and past either the run stops with an error saying so
(three nested range(100000) loops once printed nothing for 150 s; `'x' * 2000000000` ended in
a MemoryError after 19 s). The limit covers compiling the template, where jinja2 evaluates
constant expressions."""

from __future__ import annotations

import json
import time

import pytest

from jetrl import models as M
from jetrl.data import chat_prompt_ids
from jetrl.models.io.chat_render import ChatTemplateError, TemplateRenderer

tokenizers = pytest.importorskip("tokenizers")
jinja2 = pytest.importorskip("jinja2")

LOOPS = (
  "{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}"
  "{% endfor %}{% endfor %}{% endfor %}"
)
BOMBS = {
  "nested loops": LOOPS,
  "a huge string": "{{ 'x' * 2000000000 }}",
  "a doubling string": (
    "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}{{ ns.s|length }}"
  ),
  "a huge list": "{{ (range(100000)|list) * 100000 }}",
  "a wide center": "{{ 'x'|center(2000000000) }}",
  # Constant expressions, which jinja2 evaluates while compiling (once: 45.8 s, inside the
  # worker's start-up allowance, against a 10 s limit).
  "a constant power": "{{ (9 ** 30000000) % 7 }}",
  "a constant power in a filter": "{{ ((9 ** 30000000) % 7)|string }}",
  "a constant power among text": "a{{ 'b' ~ ((7 ** 30000000) % 5) }}c",
}


def folder(tmp_path, template: str):
  backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "hi": 1}, "[UNK]"))
  backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  backend.add_special_tokens(["<|im_end|>"])
  backend.save(str(tmp_path / "tokenizer.json"))
  cfg = {"eos_token": "<|im_end|>", "chat_template": template}
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
  return M.load_tokenizer(str(tmp_path))


@pytest.mark.parametrize("name", list(BOMBS))
def test_a_bomb_template_stops_within_its_limits(name):
  renderer = TemplateRenderer(BOMBS[name], timeout=3.0)
  start = time.monotonic()
  with pytest.raises(ChatTemplateError, match="within 3 s|memory limit"):
    renderer.render(messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True)
  assert time.monotonic() - start < 8.0
  renderer.close()


def test_a_tokenizer_with_a_bomb_template_is_an_error_not_a_stall(tmp_path):
  tok = folder(tmp_path, BOMBS["nested loops"])
  tok._compiled = TemplateRenderer(tok.chat_template, timeout=2.0)  # the limit, shortened
  start = time.monotonic()
  with pytest.raises(ChatTemplateError, match="did not finish rendering within 2 s"):
    chat_prompt_ids(tok, "hi")
  assert time.monotonic() - start < 6.0


def test_an_ordinary_template_renders_as_before(tmp_path):
  tok = folder(
    tmp_path,
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}",
  )
  text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
  assert text == "[user] hi<|im_end|>[assistant] "
  # Once a render timed out, the next starts a new worker.
  tok._compiled.close()
  assert tok.apply_chat_template([], add_generation_prompt=True) == "[assistant] "


def test_a_template_error_is_still_a_template_error(tmp_path):
  tok = folder(tmp_path, "{{ raise_exception('System role not supported') }}")
  with pytest.raises(jinja2.exceptions.TemplateError, match="^System role not supported$"):
    tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_the_sandbox_still_holds(tmp_path):
  tok = folder(tmp_path, "{{ ''.__class__.__mro__[1].__subclasses__() }}")
  with pytest.raises(jinja2.exceptions.TemplateError):
    tok.apply_chat_template([{"role": "user", "content": "hi"}])
