"""``kvbucket ls NAMESPACE``: the buckets of a Hub user or organisation, as ``hf buckets ls alice``.

A bare Hub name that is no local path (``alice``, ``me``) names a namespace, as for ``hf``: its
buckets are listed with huggingface_hub's ``list_buckets`` (``me`` is sent as is: the Hub reads
it as the caller, as for ``hf buckets ls``).
"""

from __future__ import annotations

import os
from typing import Any

import typer

from kvbucket.cli.common import NoAnswerError, bounded, exit_now, fail, first_answer_deadline
from kvbucket.cli.output import print_json
from kvbucket.stores.urls import HANDLE_SCHEME, is_hub_name


def namespace_of(url: str) -> str | None:
    """The Hub namespace a bare name names (``alice``, ``me``: what ``hf buckets ls`` takes), else
    None. A name that exists here is the local directory (the rule of :mod:`kvbucket.stores.urls`)."""
    if "://" in url or "/" in url or os.path.lexists(url):
        return None
    return url if is_hub_name(url) else None


def list_namespace(namespace: str, *, as_json: bool, quiet: bool, timeout: float) -> None:
    """Print the buckets of ``namespace``: ``SIZE  FILES  ID [private]`` lines, ids alone with
    ``quiet``, or one JSON array of ``{id, private, size, total_files, created_at}``."""
    from huggingface_hub import HfApi, get_token
    from huggingface_hub.errors import HfHubHTTPError

    from kvbucket.stores.hub.config import check_hf_endpoint_env
    from kvbucket.stores.hub.whoami import refused_text

    check_hf_endpoint_env()
    endpoint = (os.environ.get("HF_ENDPOINT", "").strip() or "https://huggingface.co").rstrip("/")
    token = get_token()
    where = f"{HANDLE_SCHEME}{namespace}"  # for the endpoint a "no answer" line names

    def fetch() -> list[Any]:
        return list(HfApi(endpoint=endpoint).list_buckets(namespace=namespace, token=token or False))

    try:
        buckets = bounded(fetch, timeout, where, deadline=first_answer_deadline(timeout))
    except NoAnswerError as e:
        exit_now(str(e), 1)
    except HfHubHTTPError as e:
        status = getattr(e.response, "status_code", None)
        if status == 404:
            raise fail(f"no Hub namespace {namespace!r} on {endpoint}, and no local directory ./{namespace}: "
                       f"`kvbucket ls NAMESPACE` lists a user's or organisation's buckets (as `hf buckets "
                       f"ls`), `kvbucket ls NAMESPACE/BUCKET` a bucket's objects") from None
        if status == 401 and token:
            raise fail(refused_text("$HF_TOKEN" if os.environ.get("HF_TOKEN") else "the saved login",
                                    endpoint, f" while listing the buckets of {namespace!r}")) from None
        if status == 401:
            raise fail(f"no token found: listing the buckets of {namespace!r} on {endpoint} needs one; "
                       "set HF_TOKEN or run `hf auth login`") from None
        raise fail(f"{endpoint} refused to list the buckets of {namespace!r} (HTTP {status})", 1) from None
    except OSError as e:
        raise fail(f"cannot list the buckets of {namespace!r}: {e}; check that {endpoint} is up and "
                   "reachable", 1) from None
    if as_json:
        print_json([{"id": b.id, "private": b.private, "size": b.size, "total_files": b.total_files,
                     "created_at": b.created_at.isoformat() if b.created_at else None} for b in buckets])
        return
    for b in buckets:
        if quiet:
            typer.echo(b.id)
        else:
            files = "1 file" if b.total_files == 1 else f"{b.total_files} files"
            typer.echo(f"{b.size:>12}  {files:>12}  {b.id}{'  (private)' if b.private else ''}")
    if not buckets and not quiet:
        typer.echo("(empty)")  # as `hf buckets ls`
