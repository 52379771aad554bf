"""Integrations with inference engines. Each module imports its engine lazily (optional extras)."""
