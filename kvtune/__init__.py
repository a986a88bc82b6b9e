"""kvtune: KV-cache sizing, output caps and admission settings for self-hosted LLM serving."""

__version__ = "0.1.0"
