from __future__ import annotations

import pickle
from typing import Any

import pytest

from weightsync.api import errors
from weightsync.api.registry import (
    KNOWN_BACKENDS,
    BackendSpec,
    available_backends,
    backend_statuses,
    get_backend_spec,
    installed_backends,
    load_engine_class,
    register_backend,
)


def test_installed_backends_are_discovered_through_entry_points() -> None:
    assert {"shm", "gloo"} <= set(installed_backends())
    assert {"shm", "gloo"} <= set(available_backends())
    assert get_backend_spec("shm").devices == frozenset({"cpu"})
    assert get_backend_spec("gloo").cross_node and not get_backend_spec("shm").cross_node


def test_resolution_is_idempotent() -> None:
    assert load_engine_class("shm") is load_engine_class("shm")
    assert get_backend_spec("gloo") is get_backend_spec("gloo")


def test_missing_backend_names_what_to_install(hide_backend: Any) -> None:
    hide_backend("mooncake")
    with pytest.raises(errors.UnknownBackendError) as caught:
        get_backend_spec("mooncake")
    assert caught.value.install == KNOWN_BACKENDS["mooncake"]
    assert "pip install weightsync-mooncake[cpu]" in str(caught.value)
    assert "from a checkout: pip install -e 'packages/weightsync-mooncake[cpu]'" in str(caught.value)


def test_unusable_backend_raises_with_its_reason(hide_backend: Any) -> None:
    hide_backend("nixl")
    spec = BackendSpec(name="test-unusable", engine="nowhere:Nothing", distribution="x", devices=frozenset({"cuda"}),
                       cross_node=True, probe=lambda: "no CUDA device")
    register_backend(spec)
    register_backend(spec)  # idempotent
    with pytest.raises(errors.BackendUnavailableError, match="no CUDA device"):
        load_engine_class("test-unusable")
    statuses = {status.backend: status for status in backend_statuses()}
    assert statuses["test-unusable"].status == "unusable here"
    assert statuses["nixl"].status == "not installed"
    assert statuses["shm"].status == "available"
    with pytest.raises(ValueError):
        register_backend(BackendSpec(name="test-unusable", engine="a:b", distribution="y", devices=frozenset(),
                                     cross_node=False, probe=lambda: None))


def test_typed_errors_survive_pickling_with_their_fields() -> None:
    error = errors.StepTimeoutError("step 'transfer' timed out", step="transfer", workers=["replica1/worker0"])
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is errors.StepTimeoutError and isinstance(copy, TimeoutError)
    assert copy.step == "transfer" and copy.workers == ["replica1/worker0"] and str(copy) == str(error)


def test_renamed_keywords_are_rejected_with_the_new_name() -> None:
    with pytest.raises(errors.RenamedKeywordError, match="actor_wg_world_size=.*weightsync migrate"):
        errors.reject_renamed_keywords("build_topology", {"trainer_world_size": 2})


def test_every_install_hint_works_from_a_checkout() -> None:
    """Until the distributions are published, the hint's second half is what installs a backend: its folder."""
    import pathlib
    import re

    from weightsync.api.registry import install_hint

    root = pathlib.Path(__file__).resolve().parents[2]
    for name in KNOWN_BACKENDS:
        (folder,) = re.findall(r"pip install -e 'packages/([\w-]+)(?:\[\w+\])?'", install_hint(name))
        assert (root / "packages" / folder / "pyproject.toml").is_file(), (name, folder)
