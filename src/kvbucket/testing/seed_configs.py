"""The engine-config YAMLs of the seeds (001: Hugging Face bucket plugin, 004: S3), verbatim.

Tests (ours and users') load them to check that LMCache users' files work as they are.
"""

from __future__ import annotations

from typing import Any

import yaml

SEED_001_MINIMAL = """
chunk_size: 256
local_cpu: false
save_unfull_chunk: false
remote_serde: "naive"
blocking_timeout_secs: 10
remote_storage_plugins: ["hfbucket"]
extra_config:
  remote_storage_plugin.hfbucket.bucket_handle: "hf://buckets/my-org/lmcache-kv/prod"
  remote_storage_plugin.hfbucket.token_env: "HF_TOKEN"
  remote_storage_plugin.hfbucket.create_bucket_if_missing: false
  remote_storage_plugin.hfbucket.download_tmp_dir: "/tmp/lmcache-hfbucket"
  remote_storage_plugin.hfbucket.metadata_cache_ttl_secs: 30
"""

SEED_001_MULTI = """
remote_storage_plugins: ["hfbucket.us", "hfbucket.eu"]
extra_config:
  remote_storage_plugin.hfbucket.us.bucket_handle: "hf://buckets/my-org/lmcache-kv/us"
  remote_storage_plugin.hfbucket.us.token_env: "HF_US_TOKEN"
  remote_storage_plugin.hfbucket.eu.bucket_handle: "hf://buckets/my-org/lmcache-kv/eu"
  remote_storage_plugin.hfbucket.eu.token_env: "HF_EU_TOKEN"
"""

SEED_004_BASIC = """
chunk_size: 256
local_cpu: False
save_unfull_chunk: False
remote_url: "s3://your-bucket-name"
remote_serde: "naive"
blocking_timeout_secs: 10
extra_config:
  s3_region: "us-east-1"
  s3_num_io_threads: 64
  save_chunk_meta: False
"""

SEED_004_COREWEAVE = """
chunk_size: 256
local_cpu: False
max_local_cpu_size: 50
save_unfull_chunk: False
enable_async_loading: True
remote_url: "s3://test-127.cwlota.com"
remote_serde: "naive"
blocking_timeout_secs: 10
extra_config:
  s3_num_io_threads: 320
  s3_prefer_http2: False
  s3_region: "US-WEST-04A"
  s3_enable_s3express: False
  save_chunk_meta: False
  disable_tls: True
  aws_access_key_id: "your-access-key-id"
  aws_secret_access_key: "your-secret-access-key"
"""



def seed_config(text: str, **extra_config: Any) -> dict[str, Any]:
    """A seed YAML as the mapping an engine reads, with ``extra_config`` entries set or replaced
    (a test's own bucket credentials or proxy), so tests run the seed's file and not a retyped copy."""
    data = yaml.safe_load(text)
    data["extra_config"] = {**data.get("extra_config", {}), **extra_config}
    return data


__all__ = ["SEED_001_MINIMAL", "SEED_001_MULTI", "SEED_004_BASIC", "SEED_004_COREWEAVE", "seed_config"]
