"""Integrations with inference engines (LMCache, transformers); each imports its engine lazily."""
