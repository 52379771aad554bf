"""kvbucket: LLM inference caches (KV chunks, compiled artifacts) in object storage."""

from kvbucket.errors import KVBucketError

__version__ = "0.1.0"
__all__ = ["KVBucketError", "__version__"]
