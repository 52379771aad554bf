"""Checks run INSIDE the vLLM venv (engines/venv.sh vllm) by tests/engines/test_vllm.py, with
vllm_checks.py: vLLM's own ``OffloadingConnector`` (a real ``VllmConfig``, scheduler side) with
kvbucket as its secondary tier, and the tier's model identity (the weights, revision and launch
settings it keys chunks by: another model misses and deletes nothing).
The stores come from $KVB_VLLM_TARGETS (see vllm_common.py).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from vllm.config.kv_transfer import KVTransferConfig
from vllm_common import TARGETS, N, engine, kv_data, offload_keys, store_target

from kvbucket.integrations import vllm_identity
from kvbucket.testing import vllm_engine
from kvbucket.testing.engines import target_listing
from kvbucket.testing.identity_models import write_safetensors


@pytest.fixture(params=sorted(TARGETS))
def target(request: pytest.FixtureRequest) -> dict[str, Any]:
    return store_target(request.param)


def connector(target: dict[str, Any], tmp: Path) -> Any:
    """vLLM's OffloadingConnector, scheduler side, with kvbucket as its secondary tier: a real
    VllmConfig (a local model config: no download; DeviceConfig("cpu"), as vLLM finds no GPU) and
    a KVCacheConfig of 2 full-attention layers, 16-token blocks."""
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    model = tmp / "tiny-llama"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
        "vocab_size": 1000, "max_position_embeddings": 2048, "torch_dtype": "bfloat16"}))
    write_safetensors(model / "model.safetensors", 1)  # the weights: the tier's identity is from the files
    tier = {"type": "KVBucketSecondaryTier", "module_path": "kvbucket.integrations.vllm",
            "store_url": target["url"], "store_options": target.get("options", {}),
            "prefix": target["prefix"]}
    extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1 << 22, "secondary_tiers": [tier]}
    transfer = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                kv_connector_extra_config=extra)
    cfg = VllmConfig(model_config=ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="bfloat16",
                                              max_model_len=512),
                     cache_config=CacheConfig(block_size=vllm_engine.TOKENS), kv_transfer_config=transfer,
                     device_config=DeviceConfig(device="cpu"))
    spec = FullAttentionSpec(block_size=vllm_engine.TOKENS, num_kv_heads=2, head_size=16,
                             dtype=torch.bfloat16)
    layers = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    page, blocks = spec.page_size_bytes, 64
    kv = KVCacheConfig(num_blocks=blocks, kv_cache_groups=[KVCacheGroupSpec(layers, spec)], kv_cache_tensors=[
        KVCacheTensor(size=page * blocks * 2, layers=layers, layer_stride=page * blocks, block_stride=page)])
    return OffloadingConnector(cfg, KVConnectorRole.SCHEDULER, kv)



def test_vllms_scheduler_finds_the_chunks_after_a_restart(target: dict[str, Any], tmp_path: Path) -> None:
    """vLLM's own OffloadingConnectorScheduler: a fresh connector (a restart) reports the tokens
    stored in the bucket by an earlier one, after deferring while the lookups are in flight."""
    from vllm import SamplingParams
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.request import Request

    def request(rid: str) -> Request:
        return Request(rid, list(range(100, 100 + 6 * vllm_engine.TOKENS + 3)), SamplingParams(max_tokens=1),
                       None, block_hasher=vllm_engine._HASHER)

    first = connector(target, tmp_path)
    sched = first.scheduler
    req = request("a")
    sched.on_new_request(req)
    state = sched._req_status["a"]
    state.update_offload_keys()
    keys = list(state.group_states[0].offload_keys)  # the scheduler's own keys of the request
    assert len(keys) == 6
    m = sched.manager
    view = m.primary_tier.get_kv_memoryview()
    cpu = torch.from_numpy(np.frombuffer(view, dtype=np.uint8).reshape(view.shape))
    kv = torch.randint(0, 255, (4, view.strides[0]), dtype=torch.uint8)
    ctx = ReqContext(req_id="store")
    with m.lock:  # the first 4 chunks reach the CPU tier (the GPU worker's copy, emulated)
        m.on_new_request(ctx)
        out = m.prepare_store(keys[:4], ctx)
        for i, c in enumerate(out.store_spec.chunk_ids):
            cpu[int(c)].copy_(kv[i])
        m.complete_store(keys[:4], ctx)
        m.on_request_finished(ctx)
    deadline = time.monotonic() + 60
    while m.has_pending_work():  # vLLM keeps stepping until the cascades are done
        first.build_connector_meta(SchedulerOutput.make_empty())
        assert time.monotonic() < deadline
        time.sleep(0.01)
    del cpu
    first.shutdown()

    second = connector(target, tmp_path)
    req = request("b")
    second.scheduler.on_new_request(req)
    answers = []
    for _ in range(500):
        n, load_async = second.get_num_new_matched_tokens(req, 0)
        answers.append(n)
        if n is not None:
            break
        second.build_connector_meta(SchedulerOutput.make_empty())
        time.sleep(0.01)
    assert answers[0] is None  # deferred while the bucket is asked
    assert (n, load_async) == (4 * vllm_engine.TOKENS, True)  # 4 chunks, loaded asynchronously
    second.build_connector_meta(SchedulerOutput.make_empty())  # ends the step (releases the manager)
    m2 = second.scheduler.manager
    view2 = m2.primary_tier.get_kv_memoryview()
    cpu2 = torch.from_numpy(np.frombuffer(view2, dtype=np.uint8).reshape(view2.shape))
    ctx2 = ReqContext(req_id="check")
    with m2.lock:  # the promoted bytes in the new engine's CPU tier are the stored ones
        spec = m2.prepare_load(keys[:4], ctx2)
        got = torch.stack([cpu2[int(c)].clone() for c in spec.chunk_ids])
        m2.complete_load(keys[:4], ctx2)
    assert torch.equal(got, kv)
    del cpu2
    second.shutdown()


def test_one_layer_changed_in_place_misses_then_its_bytes_back_hit(tmp_path: Path) -> None:
    """Issue 38 through vLLM's own offloading classes, each step in a fresh process: the tier's
    identity comes from the model directory vLLM names (OffloadingModelConfig.name); after one
    layer's bytes change in place every chunk misses and nothing is deleted; the original bytes
    back, every chunk hits, byte-identical (kvbucket.testing.redeploy).
    Every store at once: each step is one fresh process over the three stores (three processes,
    not nine: each costs seconds of vLLM imports); each store keeps its own prefix, and every
    assertion names the store that failed. Not parametrized: tests/engines/test_vllm.py counts it once."""
    from kvbucket.testing.redeploy import check_targets, make_model

    check_targets("vllm", make_model(tmp_path / "model"), TARGETS)



def test_vllms_names_the_identity_reads_are_pinned(target: dict[str, Any], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The launch settings the identity takes from vLLM's frames (--quantization, --revision: the
    files do not say them) are read by name: vLLM 0.33's. An upgrade that renames the local that
    holds the VllmConfig or the ModelConfig fields fails here, not quietly in the tier."""
    import dataclasses
    import inspect

    from vllm.config import ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    for cls in (OffloadingConnector, OffloadingConnectorScheduler):
        assert set(vllm_identity.CONFIG_LOCALS) <= set(inspect.signature(cls.__init__).parameters), cls
    assert "model_config" in {f.name for f in dataclasses.fields(VllmConfig)}
    assert set(vllm_identity.LAUNCH_FIELDS) <= {f.name for f in dataclasses.fields(ModelConfig)}
    # through vLLM's own call chain: its OffloadingConnector builds the tier, which finds them
    found: list[Any] = []
    real = vllm_identity.launch_extras
    monkeypatch.setattr(vllm_identity, "launch_extras", lambda: found.append(real()) or found[-1])
    c = connector(target, Path(tmp_path))
    try:
        tier = c.scheduler.manager.secondary_tiers[0]
        assert found and found[0] is not None and set(found[0]) == set(vllm_identity.LAUNCH_FIELDS), found
        assert tier.identity is not None and tier.identity.weights.startswith("files:")
        assert tier.identity.fields["kv_cache_dtype"] == "bfloat16"
    finally:
        c.shutdown()


def test_model_identity_other_weights_revision_or_rope_miss_and_delete_nothing(
        target: dict[str, Any], tmp_path: Path) -> None:
    """One model path redeployed with other weights or another rope_scaling, and one Hub repo id
    at another revision (refs/main moved in the local Hub cache): every lookup misses, nothing is
    deleted; the first model's files again (copied anew, other mtimes) hit every chunk."""
    import shutil

    from huggingface_hub import constants

    from kvbucket.testing.identity_models import COMMITS, hub_snapshot, make_model_dirs

    dirs = make_model_dirs(tmp_path / "models")
    live = tmp_path / "serve" / "llama"  # the path the engine serves; a redeploy writes over it

    def deploy(variant: str) -> None:
        shutil.rmtree(live, ignore_errors=True)
        shutil.copytree(dirs[variant], live)
        now = time.time_ns()
        os.utime(live / "model.safetensors", ns=(now, now))

    keys, n = offload_keys(31), N
    deploy("base")
    a = engine(target, model=str(live))
    kv = kv_data(a, 31)
    a.store(keys, kv)
    a.close()
    assert a.tier.identity is not None and a.tier.identity.weights.startswith("files:")
    assert f"~{a.tier.identity.token}/" in a.tier.namespace
    before = target_listing(target)
    assert sum(1 for k in before if k.endswith("-g0")) == n
    assert any("/_identity/" in k for k in before), "the first writer records its identity"
    for variant in ("weights", "rope"):
        deploy(variant)
        b = engine(target, model=str(live))
        assert b.tier.identity is not None and b.tier.identity.token != a.tier.identity.token, variant
        assert b.load(keys)[0] == 0, variant
        b.close()
        assert target_listing(target) == before, f"{variant}: nothing deleted"
    deploy("base")
    c = engine(target, model=str(live))
    hits, got = c.load(keys)
    assert hits == n and torch.equal(got, kv)
    c.close()
    # a Hub repo id: the weights are the local Hub cache's refs/main commit (no request)
    repo = Path(os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE) / "models--org--llama"
    for commit in COMMITS:
        hub_snapshot(repo, commit, dirs["base"])
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(COMMITS[0])
    hub_keys = offload_keys(32)
    d = engine(target, model="org/llama")
    assert d.tier.identity is not None and d.tier.identity.weights == f"hub:{COMMITS[0]}"
    hub_kv = kv_data(d, 32)
    d.store(hub_keys, hub_kv)
    d.close()
    before = target_listing(target)
    (repo / "refs" / "main").write_text(COMMITS[1])  # a new revision was pulled
    e = engine(target, model="org/llama")
    assert e.load(hub_keys)[0] == 0
    e.close()
    assert target_listing(target) == before
    f = engine(target, model="org/llama", revision=COMMITS[0])  # pinned to the first revision
    hits, got = f.load(hub_keys)
    assert hits == n and torch.equal(got, hub_kv)
    f.close()
