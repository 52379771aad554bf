"""``doctor --model`` leaves nothing it cannot name (issue 40, outside tester F10).

Timing out, it left 4 x 32 MiB + small objects under ``_kvbucket_doctor/`` with no way to find
them; a GET past its deadline was reported as "small-0 came back missing". Now the timeout's line
carries the exact removal command (run here as a user would, and the bucket is clean after it),
and a failed load says it failed, with the cleanup done (or its command) before the exit."""

from __future__ import annotations

import re

from cli_run import assert_one_line_error, run_cli

from kvbucket.testing.s3_server import FaultProxy, S3Server


def _doctor_objects(seaweedfs: S3Server, bucket: str) -> list[str]:
    page = seaweedfs.client().list_objects_v2(Bucket=bucket, Prefix="kv/_kvbucket_doctor/")
    return [o["Key"] for o in page.get("Contents", [])]


def test_a_timed_out_measurement_names_the_command_that_removes_its_objects(
    seaweedfs: S3Server, s3_bucket: str, fault_proxy: FaultProxy, cli_env: dict[str, str]
) -> None:
    env = {**cli_env, **seaweedfs.env(), "AWS_ENDPOINT_URL": fault_proxy.url}
    fault_proxy.trickle(0.05, times=10_000, methods={"GET"}, path_contains="_kvbucket_doctor")
    r = run_cli("doctor", f"s3://{s3_bucket}/kv", "--model", "qwen2.5-0.5b", "--timeout", "4", env=env,
                timeout=120)
    line = assert_one_line_error(r, 1, "did not finish within 4 s", "remove them with kvbucket rm")
    fault_proxy.clear()
    assert _doctor_objects(seaweedfs, s3_bucket), "nothing was left to remove: the test proves nothing"
    m = re.search(r"kvbucket rm (\S+) --prefix (\S+) --yes", line)
    assert m, line
    rm = run_cli("rm", m.group(1), "--prefix", m.group(2), "--yes", env=env, timeout=60)
    assert rm.code == 0, (rm.out, rm.err)
    assert _doctor_objects(seaweedfs, s3_bucket) == []


def test_a_load_past_its_deadline_says_it_failed_and_cleans_up(
    seaweedfs: S3Server, s3_bucket: str, fault_proxy: FaultProxy, cli_env: dict[str, str]
) -> None:
    env = {**cli_env, **seaweedfs.env(), "AWS_ENDPOINT_URL": fault_proxy.url}
    fault_proxy.trickle(0.5, times=10_000, methods={"GET"}, path_contains="_kvbucket_doctor")
    r = run_cli("doctor", f"s3://{s3_bucket}/kv", "--model", "qwen2.5-0.5b", env=env, timeout=180)
    line = assert_one_line_error(r, 1, "measuring", "failed")
    assert "came back missing" not in line, line
    assert _doctor_objects(seaweedfs, s3_bucket) == [], line  # removed before the exit
