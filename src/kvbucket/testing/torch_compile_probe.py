"""Compile a small model with torch.compile inside ``compile_cache(layout="torch")``, report counters.

Run in a fresh process (``python -m kvbucket.testing.torch_compile_probe TARGET CACHE_DIR [KEY]
[MODE]``) so that torch's in-memory caches start empty; point ``TORCHINDUCTOR_CACHE_DIR`` at an
empty dir to start cold on disk too. MODE ``artifacts`` (default) uses the ``torch`` layout
(portable artifacts); ``inductor-dir`` syncs ``TORCHINDUCTOR_CACHE_DIR`` itself with the
``directory`` layout (depth 2), which also carries the compiled C++/Triton binaries. Prints one
JSON line: Inductor/AOTAutograd cache hits and misses (what
tests assert on), the compile time (what the benchmark reports) and what the cache moved.
"""

from __future__ import annotations

import json
import sys
import time


def main(argv: list[str]) -> int:
    import torch
    from torch._dynamo.utils import counters

    from kvbucket.compile_cache import DirectoryLayout, compile_cache

    target, cache_dir = argv[0], argv[1]
    key = argv[2] if len(argv) > 2 else "probe-mlp"
    mode = argv[3] if len(argv) > 3 else "artifacts"
    if mode == "inductor-dir":
        import os

        from kvbucket.compile_cache.torch_env import torch_group

        kw: dict[str, object] = {"layout": DirectoryLayout(f"inductor-{torch_group()}", depth=2),
                                 "cache_dir": os.environ["TORCHINDUCTOR_CACHE_DIR"]}
    else:
        kw = {"layout": "torch", "key": key, "cache_dir": cache_dir}
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.LayerNorm(128), torch.nn.Linear(128, 32)
    )
    x = torch.randn(8, 64)
    t_enter = time.perf_counter()
    with compile_cache(target=target, **kw) as s:  # type: ignore[arg-type]
        enter_seconds = time.perf_counter() - t_enter
        compiled = torch.compile(model)
        t0 = time.perf_counter()
        with torch.no_grad():
            y = compiled(x)
        seconds = time.perf_counter() - t0
    assert torch.allclose(y, model(x), atol=1e-5)
    print(json.dumps({
        "seconds": seconds,
        "enter_seconds": enter_seconds,
        "fxgraph_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
        "fxgraph_cache_miss": counters["inductor"]["fxgraph_cache_miss"],
        "autograd_cache_hit": counters["aot_autograd"]["autograd_cache_hit"],
        "autograd_cache_miss": counters["aot_autograd"]["autograd_cache_miss"],
        "mode": mode,
        "loaded": s.loaded,
        "fetched": s.fetched.transferred if s.fetched else None,
        "synced": s.synced.transferred if s.synced else None,
        "degraded": s.degraded,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
