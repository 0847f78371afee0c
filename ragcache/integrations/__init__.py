"""Integrations with other frameworks (llama-index)."""
