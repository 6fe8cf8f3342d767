"""Models the runtime can build from nothing: the embedded default's tiny Qwen3 and its char tokenizer."""
