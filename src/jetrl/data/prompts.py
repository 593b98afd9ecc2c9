"""Prompt templates for the dataset tasks: plain text for base models, chat for chat models.

template="base": plain text with an answer-format instruction, ending in a newline after
  `Answer:` / `Solution:`, so a gold solution can follow directly.
template="chat": one user message (the question and the instruction to reason step by step
  and box the final answer) rendered by the tokenizer's own chat template
  (`tokenizer.apply_chat_template(..., add_generation_prompt=True)`). A tokenizer without a chat
  template gets the base prompt.
template="message": the content of that user message, not rendered: for a caller that applies
  the chat template itself, with a system prompt of its choice (`chat_prompt_ids`), the same
  way for every task (a user task's prompt is such a message too).

`chat_prompt_ids(tokenizer, content, system_prompt=...)` gives the ids of the rendered chat
prompt, equal to `transformers`' `apply_chat_template(messages, add_generation_prompt=True,
tokenize=True)` (tested on SmolLM2's template).
"""

from __future__ import annotations

from typing import Any, Optional

from jetrl.data.tokenizer import Tokenizer

TEMPLATES = ("base", "chat", "message")

BASE = {
  "gsm8k": (
    "Question: {question}\n"
    "Solve the problem step by step. Write the final answer as a number on the last "
    'line, in the form "#### <number>".\n'
    "Answer:\n"
  ),
  "math": (
    "Problem: {question}\n"
    "Solve the problem step by step. Put the final answer in \\boxed{{}}.\n"
    "Solution:\n"
  ),
}
CHAT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def check_template(template: str, tokenizer: Optional[Tokenizer]) -> str:
  if template not in TEMPLATES:
    raise ValueError(f"unknown template {template!r}; accepted: {list(TEMPLATES)}")
  if template == "chat" and not isinstance(tokenizer, Tokenizer):
    raise ValueError(
      "template='chat' needs tokenizer= (a jetrl.data.Tokenizer, e.g. a checkpoint "
      f"tokenizer or a transformers tokenizer), got {type(tokenizer).__name__}"
    )
  return template


def has_chat_template(tokenizer: Optional[Tokenizer]) -> bool:
  """True for a tokenizer whose `chat_template` is set (None: False)."""
  return tokenizer is not None and bool(tokenizer.chat_template)


def user_message(question: str) -> str:
  """The user turn of the chat prompt: the question and the instruction to box the answer."""
  return f"{question.strip()}\n{CHAT_INSTRUCTION}"


def chat_messages(question: str) -> list[dict[str, str]]:
  """The conversation (one user turn) of the chat template."""
  return [{"role": "user", "content": user_message(question)}]


def check_system_prompt(system_prompt: Any) -> None:
  if system_prompt is not None and not isinstance(system_prompt, str):
    raise ValueError(
      f"system_prompt must be None (the chat template's default) or a str, got "
      f"{type(system_prompt).__name__}"
    )


def conversation(content: str, system_prompt: str | None = None) -> list[dict[str, str]]:
  """[system turn (when system_prompt is not None), user turn with `content`]."""
  check_system_prompt(system_prompt)
  if not isinstance(content, str):
    raise ValueError(f"a chat prompt's user message must be a str, got {type(content).__name__}")
  turns = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
  return turns + [{"role": "user", "content": content}]


def chat_prompt_ids(
  tokenizer: Tokenizer, content: str, *, system_prompt: str | None = None
) -> list[int]:
  """Token ids of the chat prompt that asks `content` as the user, with a system turn holding
  `system_prompt` (None: no system turn, so the template's default applies, e.g. SmolLM2's
  "You are a helpful AI assistant named SmolLM..."; "" is an empty system turn), ending in the
  assistant's generation prompt. The rendered text is encoded without adding special tokens on
  top of the template's, as `transformers`' `apply_chat_template(..., tokenize=True)` does.
  `tokenizer`: a `Tokenizer` with a chat template (ValueError otherwise)."""
  if not has_chat_template(tokenizer):
    raise ValueError(
      "the chat prompt format needs a checkpoint tokenizer with a chat template "
      "(tokenizer_config.json, chat_template.jinja or chat_template.json); this "
      "tokenizer has none: use the plain prompt format"
    )
  text = tokenizer.apply_chat_template(
    conversation(content, system_prompt), tokenize=False, add_generation_prompt=True
  )
  if not isinstance(text, str):
    raise ValueError("tokenizer.apply_chat_template(..., tokenize=False) did not return a str")
  return list(tokenizer.encode(text, add_special_tokens=False))


def render_prompt(
  kind: str, question: str, template: str = "base", tokenizer: Optional[Tokenizer] = None
) -> str:
  """The prompt text for a question of `kind` ("gsm8k" or "math")."""
  if template == "message":
    return user_message(question)
  if template == "chat" and has_chat_template(tokenizer):
    text = tokenizer.apply_chat_template(
      chat_messages(question), tokenize=False, add_generation_prompt=True
    )
    if not isinstance(text, str):
      raise ValueError("tokenizer.apply_chat_template(..., tokenize=False) did not return a str")
    return text
  return BASE[kind].format(question=question.strip())
