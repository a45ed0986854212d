"""HCCL backend without torch_npu: the probe names what to install, and nothing raises a bare ImportError."""

from __future__ import annotations

import importlib.util

import pytest

from weightsync.api.errors import BackendUnavailableError
from weightsync.api.registry import backend_statuses, get_backend_spec, load_engine_class

HAS_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None


@pytest.mark.skipif(HAS_TORCH_NPU, reason="checks the message given where torch_npu is missing")
def test_probe_gives_the_install_hint_for_torch_npu() -> None:
    spec = get_backend_spec("hccl")
    assert spec.devices == frozenset({"npu"}) and spec.cross_node
    reason = spec.probe()
    assert reason is not None and "torch_npu" in reason and "pip install torch-npu" in reason
    status = next(status for status in backend_statuses() if status.backend == "hccl")
    assert status.status == "unusable here" and status.install.startswith("pip install weightsync-hccl; ")


@pytest.mark.skipif(HAS_TORCH_NPU, reason="checks the message given where torch_npu is missing")
def test_loading_and_building_raise_backend_unavailable_not_import_error() -> None:
    with pytest.raises(BackendUnavailableError, match="torch_npu"):
        load_engine_class("hccl")
    # The engine module itself imports without torch_npu (only building an engine needs it).
    from weightsync.hccl.engine import HcclCheckpointEngine, process_group_hccl

    assert HcclCheckpointEngine.devices == frozenset({"npu"}) and HcclCheckpointEngine.name == "hccl"
    with pytest.raises(BackendUnavailableError, match="torch_npu"):
        HcclCheckpointEngine(bucket_bytes=1 << 20)
    with pytest.raises(BackendUnavailableError, match="ProcessGroupHCCL is not importable"):
        process_group_hccl()


def test_hccl_shares_the_accelerator_engine_and_its_options() -> None:
    from weightsync.hccl.engine import HcclCheckpointEngine
    from weightsync.core.backend import AcceleratorCollectiveTransport

    assert issubclass(HcclCheckpointEngine.transport_class, AcceleratorCollectiveTransport)
    assert HcclCheckpointEngine.option_names == frozenset({"device_index", "relays"})


@pytest.mark.device
@pytest.mark.skipif(not HAS_TORCH_NPU, reason="needs Ascend NPUs with torch_npu and CANN")
def test_hccl_conformance_on_npus() -> None:
    from weightsync.api.testing import EngineHarness

    harness = EngineHarness("hccl", receivers=1, bucket_bytes=1 << 20)
    harness.start()
    try:
        harness.setup()
        harness.update("mixed", 1)
    finally:
        harness.close()
