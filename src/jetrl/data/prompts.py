"""Prompt templates for the dataset tasks: plain text for base models, chat for chat models.

template="base": plain text with an answer-format instruction, ending in a newline after
  `Answer:` / `Solution:`, so a gold solution can follow directly.
template="chat": one user message (the question and the instruction to reason step by step
  and box the final answer) rendered by the tokenizer's own chat template
  (`tokenizer.apply_chat_template(..., add_generation_prompt=True)`). A tokenizer without a chat
  template gets the base prompt.
"""

from __future__ import annotations

from typing import Any

TEMPLATES = ("base", "chat")

BASE = {
    "gsm8k": ("Question: {question}\n"
              "Solve the problem step by step. Write the final answer as a number on the last "
              "line, in the form \"#### <number>\".\n"
              "Answer:\n"),
    "math": ("Problem: {question}\n"
             "Solve the problem step by step. Put the final answer in \\boxed{{}}.\n"
             "Solution:\n"),
}
CHAT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def check_template(template: str, tokenizer: Any) -> str:
  if template not in TEMPLATES:
    raise ValueError(f"unknown template {template!r}; accepted: {list(TEMPLATES)}")
  if template == "chat" and tokenizer is None:
    raise ValueError("template='chat' needs tokenizer= (an object with apply_chat_template, "
                     "e.g. a transformers tokenizer)")
  return template


def has_chat_template(tokenizer: Any) -> bool:
  return (tokenizer is not None and callable(getattr(tokenizer, "apply_chat_template", None))
          and bool(getattr(tokenizer, "chat_template", None)))


def chat_messages(question: str) -> list[dict[str, str]]:
  """The conversation (one user turn) of the chat template."""
  return [{"role": "user", "content": f"{question.strip()}\n{CHAT_INSTRUCTION}"}]


def render_prompt(kind: str, question: str, template: str = "base", tokenizer: Any = None) -> str:
  """The prompt text for a question of `kind` ("gsm8k" or "math")."""
  if template == "chat" and has_chat_template(tokenizer):
    text = tokenizer.apply_chat_template(chat_messages(question), tokenize=False,
                                         add_generation_prompt=True)
    if not isinstance(text, str):
      raise ValueError("tokenizer.apply_chat_template(..., tokenize=False) did not return a str")
    return text
  return BASE[kind].format(question=question.strip())
