"""How models come in and go out: Hugging Face and GGUF import, HF and PEFT export, tokenizers,
chat templates (rendered in a confined worker) and where model folders live. The rest of
`jetrl.models` is architecture only (docs/design.md, "Modules")."""
