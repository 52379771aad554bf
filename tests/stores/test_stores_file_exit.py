"""A FileStore still alive at interpreter exit closes its directory handles without an error."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path


def test_a_file_store_that_outlives_its_module_at_exit_closes_quietly(tmp_path: Path) -> None:
    # sys is torn down last, so the store's __del__ runs after kvbucket.stores.local.file's globals
    # were cleared (as after gc.freeze() in a benchmark): it must not need them.
    code = textwrap.dedent(f"""
        import sys
        from kvbucket.stores.local.file import FileStore
        s = FileStore({str(tmp_path)!r})
        s.put_many([("a", b"x")])
        sys._kvbucket_test_hold = s
        del s
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "Exception ignored" not in r.stderr, r.stderr
    assert (tmp_path / "a").read_bytes() == b"x"
