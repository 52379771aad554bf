"""Adapters that let other projects (LMCache, transformers) use kvbucket. Each needs its extra."""
