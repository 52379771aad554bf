"""kvbucket's SGLang HiCache backend vs SGLang's built-in ``file`` backend, on the same disk (and on
the Hub emulator / SeaweedFS S3, with the disk's ``file`` backend as the reference of the same run).

Both backends are created by SGLang's own ``StorageBackendFactory`` and move pages of a real
``MHATokenToKVPoolHost`` exactly as SGLang's cache controller does: the ``file`` backend through
the generic path (``batch_set`` of ``get_data_page`` tensors; ``batch_get`` into dummy pages, then
``set_from_flat_data_page``), kvbucket through the zero-copy v1 path (``batch_set_v1`` /
``batch_get_v1`` over host indices, ``"interface_v1": 1``). Batches of 128 pages
(SGLang's ``STORAGE_BATCH_SIZE``). Prints pages/s and the ratio kvbucket / file (goal >= 1.0x).
Every timed phase starts after ``os.sync()`` (the page cache's writeback of the previous phase
would otherwise land in it, whichever backend that is); within a phase the backends take turns
batch by batch, the order flipped every batch, so they see the same machine (on this VM the cost
of a buffered write swings 10x within seconds with the kernel's supply of free memory); the ratio
is the median of per-round ratios.

Runs inside the SGLang venv (``engines/venv.sh sglang``); started with another Python it builds
or reuses that venv, starts the servers ``--stores`` asks for (Hub emulator in its own process,
SeaweedFS) and re-runs itself there:

    python benchmarks/bench_sglang.py --pages 256 --rounds 3
    python benchmarks/bench_sglang.py --pages 128 --rounds 3 --stores dir,hub,s3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results import Results, add_argument

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=256, help="pages per round")
    ap.add_argument("--page-size", type=int, default=32, help="tokens per page")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--verbose", action="store_true", help="print every round's figures")
    ap.add_argument("--dir", default=None, help="where both backends write (default: a temp dir)")
    ap.add_argument("--stores", default="dir", help="kvbucket's stores, comma-separated: dir, hub, s3")
    add_argument(ap)
    args = ap.parse_args()
    from kvbucket.testing.engines import bench_in_engine_venv

    bench_in_engine_venv(ROOT, "sglang", args.stores, sys.argv)  # returns only inside the sglang venv
    run(args)
    import gc

    gc.unfreeze()  # run() froze its set-up; collected here, while the modules are still loaded
    gc.collect()


def run(args: argparse.Namespace) -> None:
    import logging

    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    logging.disable(logging.WARNING)
    ps, n = args.page_size, args.pages
    tokens = n * ps
    dev = MHATokenToKVPool(size=tokens, page_size=ps, dtype=torch.bfloat16, head_num=args.heads,
                           head_dim=args.head_dim, layer_num=args.layers, device="cpu",
                           enable_memory_saver=False, enable_alt_stream=False)

    def host() -> MHATokenToKVPoolHost:
        return MHATokenToKVPoolHost(dev._mha_buffer_info(), host_to_device_ratio=1.1, host_size=0,
                                    page_size=ps, layout="layer_first", pin_memory=False, device="cpu",
                                    device_capacity_tokens=tokens, start_layer=0, end_layer=args.layers)

    src = host()
    src_idx = src.alloc(tokens)
    src.kv_buffer.copy_(torch.randn(src.kv_buffer.shape).to(torch.bfloat16))
    page_mb = src.get_data_page(0).numel() * 2 / 2**20
    if args.dir is None:  # a temp dir of our own, removed at the end
        tmp = tempfile.TemporaryDirectory(prefix="bench-sglang-")
        base = Path(tmp.name)
    else:
        base = Path(args.dir)

    def config(extra: dict) -> HiCacheStorageConfig:
        return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                    attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
                                    is_page_first_layout=False, model_name="bench/model", extra_config=extra)

    B = 128
    from kvbucket.testing.engines import BENCH_TARGETS_ENV

    targets = json.loads(os.environ.get(BENCH_TARGETS_ENV, "{}")) or {"dir": {}}
    names = ["file", *(f"kvbucket-{t}" for t in targets)]
    # One destination pool per backend (their batches interleave), one backend of each kind for
    # the whole run, as SGLang keeps one for the server's life.
    dsts = {name: host() for name in names}
    dst_idx = {name: dsts[name].alloc(tokens) for name in names}
    file_backend = StorageBackendFactory.create_backend(
        "file", config({"file_storage_path": str(base / "file")}), src)
    kvb: dict[str, tuple[Any, Any]] = {}
    for t, spec in targets.items():  # a writer on the source pool, a reader on its own destination
        url = str(base / "kvb") if t == "dir" else spec["url"]
        extra = {"backend_name": "kvbucket", "module_path": "kvbucket.integrations.sglang",
                 "class_name": "KVBucketHiCacheStorage", "interface_v1": 1, "store_url": url,
                 "store_options": spec.get("options", {}), "prefix": "bench"}
        w = StorageBackendFactory.create_backend("dynamic", config(extra), src)
        w.register_mem_pool_host(src)
        rd = StorageBackendFactory.create_backend("dynamic", config(extra), dsts[f"kvbucket-{t}"])
        rd.register_mem_pool_host(dsts[f"kvbucket-{t}"])
        kvb[f"kvbucket-{t}"] = (w, rd)

    def set_batch(name: str, keys: list[str], i: int) -> None:
        if name == "file":  # SGLang's generic path: one flat page tensor per key
            data = [src.get_data_page(int(src_idx[j * ps])) for j in range(i, min(n, i + B))]
            assert file_backend.batch_set(keys[i : i + B], data)
        else:  # the zero-copy v1 path over host indices
            assert all(kvb[name][0].batch_set_v1(keys[i : i + B], src_idx[i * ps : (i + B) * ps]))

    def get_batch(name: str, keys: list[str], i: int) -> None:
        dst, idx = dsts[name], dst_idx[name]
        ks = keys[i : i + B]
        if name == "file":  # into dummy pages, then set_from_flat_data_page (SGLang's generic path)
            got = file_backend.batch_get(ks, [dst.get_dummy_flat_data_page() for _ in ks])
            for j, page in enumerate(got):
                assert page is not None
                dst.set_from_flat_data_page(int(idx[(i + j) * ps]), page)
        else:
            assert all(kvb[name][1].batch_get_v1(ks, idx[i * ps : (i + B) * ps]))

    def check_and_reset(name: str) -> None:
        dst, idx = dsts[name], dst_idx[name]
        for i in range(n):
            a = src.get_data_page(int(src_idx[i * ps])).view(torch.uint8)
            b = dst.get_data_page(int(idx[i * ps])).view(torch.uint8)
            assert torch.equal(a, b), f"a page {name} read back differs"
        dst.kv_buffer.zero_()

    # The import heap (SGLang, torch, transformers: a 250 ms full collection here) is not what is
    # compared: frozen, as SGLang's own processes do (sglang.srt.utils.freeze_gc), so a gen-2
    # collection does not land in whichever backend's batch happens to trigger it.
    import gc

    gc.collect()
    gc.freeze()
    res: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for r in range(args.rounds):
        if r:  # new bytes each round: Xet (Hub) would dedup a page it uploaded the round before
            src.kv_buffer.copy_(torch.randn(src.kv_buffer.shape).to(torch.bfloat16))
        keys = [f"r{r}-p{i}" for i in range(n)]
        spent = {name: [0.0, 0.0] for name in names}
        for phase, op in enumerate((set_batch, get_batch)):
            os.sync()  # the previous phase's writeback must not land in this one's time
            # Batch by batch, every backend in turn, the order flipped each batch: all see the same
            # machine (the page cache's supply of free memory swings within seconds here).
            for b_no, i in enumerate(range(0, n, B)):
                for name in names if (r + b_no) % 2 == 0 else names[::-1]:
                    t0 = time.perf_counter()
                    op(name, keys, i)
                    spent[name][phase] += time.perf_counter() - t0
        for name in names:
            res[name].append((n / spent[name][0], n / spent[name][1]))
            check_and_reset(name)
    for w, rd in kvb.values():
        w.close()
        rd.close()
    if args.verbose:
        for k, v in res.items():
            print(f"  {k}: per round set/get pages/s " + ", ".join(f"{a:.0f}/{b:.0f}" for a, b in v))
    print(f"{n} pages of {page_mb:.2f} MiB ({args.layers} layers, {args.heads} heads x {args.head_dim}, "
          f"{ps} tokens, bf16), batches of {B}, {args.rounds} rounds, dir {base}")
    med = {k: (statistics.median(s for s, _ in v), statistics.median(g for _, g in v))
           for k, v in res.items()}
    fs, fg = med["file"]
    for k, (s, g) in med.items():
        ratio = "" if k == "file" else f"   vs file (disk): set {s / fs:.2f}x get {g / fg:.2f}x"
        print(f"  {k:15s} set {s:8.1f} pages/s   get {g:8.1f} pages/s{ratio}")
    if "kvbucket-dir" in med:  # per-round ratios (paired: same round, adjacent in time), their median
        pairs = list(zip(res["kvbucket-dir"], res["file"], strict=True))
        rs = statistics.median(k[0] / f[0] for k, f in pairs)
        rg = statistics.median(k[1] / f[1] for k, f in pairs)
        print(f"  ratio kvbucket/file on the same disk, median of per-round ratios: set {rs:.2f}x  "
              f"get {rg:.2f}x  (goal >= 1.0x)")
    out = Results("bench_sglang", params=vars(args),
                  title="SGLang HiCache L3: kvbucket's backend against SGLang's file backend")
    for k, rounds in res.items():
        for i, (st, gt) in enumerate(rounds):
            out.run(backend=k, round=i + 1, set_pages_s=st, get_pages_s=gt)
        if k == "file":
            continue
        for j, op in enumerate(("set", "get")):
            out.compare(f"{k} {op}", f"{op} ({k}, {page_mb:.2f} MiB pages)", ours=med[k][j], ours_name=k,
                        peer=med["file"][j], peer_name="SGLang file backend (disk)", unit="pages/s",
                        goal=">= 1.0" if k == "kvbucket-dir" else None,
                        ratios=[a[j] / b[j] for a, b in zip(rounds, res["file"], strict=True) if b[j]])
    out.write(args.results_dir)


if __name__ == "__main__":
    main()
