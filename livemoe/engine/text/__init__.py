"""Text around the decoder: chat prompts, incremental detokenizing, token streaming, reasoning and tool-call
parsing."""
