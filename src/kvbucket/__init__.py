"""kvbucket: LLM inference caches (KV chunks, compiled artifacts) in object storage."""

from kvbucket.errors import KVBucketError
from kvbucket.secrets import install_log_redaction

install_log_redaction()  # no credential reaches a log record, from kvbucket or its HTTP clients

__version__ = "0.1.0"
__all__ = ["KVBucketError", "__version__"]
