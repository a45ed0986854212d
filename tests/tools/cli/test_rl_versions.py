"""``weightsync bench --mix rl``'s versions (``weightsync.cli.bench.rl``): one Adam step apart, their changed bytes
counted as the files on disk show them (compared here bitwise, independently of the module's own count)."""

from __future__ import annotations

import os

import pytest
import torch
from weightsync.cli.bench.rl import load_version, make_versions, version_path
from weightsync.cli.main import main

MODEL_BYTES = 4 * 2**20


def read_raw(path: str) -> torch.Tensor:
    with open(path, "rb") as handle:
        return torch.frombuffer(bytearray(handle.read()), dtype=torch.int16)


def test_versions_are_files_whose_changed_bytes_are_counted_bitwise() -> None:
    versions = make_versions(MODEL_BYTES, 3, lr=1e-6)
    try:
        raw = [read_raw(version_path(versions.directory, k)) for k in range(3)]
        assert all(version.numel() * 2 == versions.total_bytes for version in raw)
        assert versions.changed[0] == versions.total_bytes
        for k in (1, 2):
            assert versions.changed[k] == int((raw[k] != raw[k - 1]).sum()) * 2
        # At an RL learning rate most bf16 weights keep their bits, and some do not.
        assert 0 < versions.changed_fraction(range(1, 3)) < 0.2
        # The initial model: norms 1.0 (bf16 0x3f80) and weights N(0, 0.02).
        model = [torch.empty(shape, dtype=torch.bfloat16) for _, shape in versions.layout]
        load_version(versions.directory, 0, model)
        norm = next(index for index, (name, _) in enumerate(versions.layout) if name.endswith("norm.weight"))
        assert bool((model[norm] == 1.0).all())
        head = next(index for index, (name, _) in enumerate(versions.layout) if name == "lm_head.weight")
        assert abs(float(model[head].float().std()) - 0.02) < 0.002
        assert torch.equal(torch.cat([tensor.view(-1).view(torch.int16) for tensor in model]), raw[0])
    finally:
        versions.remove()
    assert not os.path.exists(versions.directory)


def test_a_larger_learning_rate_changes_more_bytes() -> None:
    small, large = make_versions(MODEL_BYTES, 2, lr=1e-6), make_versions(MODEL_BYTES, 2, lr=1e-3)
    try:
        assert small.changed_fraction(range(1, 2)) * 10 < large.changed_fraction(range(1, 2)) <= 1.0
    finally:
        small.remove()
        large.remove()


def test_a_version_file_that_does_not_match_the_layout_is_refused(tmp_path: os.PathLike[str]) -> None:
    versions = make_versions(MODEL_BYTES, 1)
    try:
        model = [torch.empty(shape, dtype=torch.bfloat16) for _, shape in versions.layout]
        with pytest.raises(ValueError, match="longer than its layout"):
            load_version(versions.directory, 0, model[:-1])
        with pytest.raises(ValueError, match="shorter than its layout"):
            load_version(versions.directory, 0, [*model, torch.empty(4, dtype=torch.bfloat16)])
    finally:
        versions.remove()


@pytest.mark.parametrize(("args", "message"), [
    (["--lr", "1e-3"], "--lr needs --mix rl"),
    (["--mix", "rl", "--lr", "0"], "must be in (0, 1]"),
    (["--mix", "rl", "--plot", "x.png"], "--plot does not apply with --mix rl"),
    (["--verify-every", "5"], "--verify-every needs --delta"),
    (["--delta", "--verify-every", "0"], "must be positive"),
    (["--parts", "tp2", "--mix", "small"], "--parts splits the matrices of the realistic or the rl mix"),
])
def test_bad_rl_options_are_refused(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *args]) == 2
    assert message in capsys.readouterr().err
