"""``weightsync demo --rollout vllm`` and ``weightsync bench --rollout vllm`` as a user runs them (separate
processes, their own Ray cluster and vLLM engines), on the tests' small Llama."""

from __future__ import annotations

import json
import pathlib

import pytest

pytest.importorskip("vllm", reason="the vLLM tests run in the vllm env: python3 -m hatch run vllm:test")

from tests.tools.cli.test_cli import weightsync  # noqa: E402


def test_demo_every_step_matches_the_reference_engine() -> None:
    """The default demo, with one replica (unstaged; staged updates into vLLM replicas are
    tests/adapters/vllm/test_vllm_updates.py's, the demo's staged flow test_cli.py's: a second run of its own engines
    would cost CI 100 s; several replicas are test_vllm_updates.py's too, and a third engine here 20 s)."""
    result = weightsync("demo", "--rollout", "vllm", "--steps", "2", "--model-mb", "1", "--replicas", "1")
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 2, result.stdout
    for line in lines:
        assert "vLLM checksums = reference: 1/1" in line and "greedy tokens = reference: 1/1" in line, line
    assert "2/2 steps: every replica holds what vLLM loads from that version's checkpoint" in result.stdout


def test_bench_compares_shm_with_the_disk_route(tmp_path: pathlib.Path) -> None:
    """One replica (a second engine would cost CI 20 s and show nothing more: the manager's comparison across
    replicas is test_vllm_updates.py's)."""
    out = tmp_path / "bench.json"
    result = weightsync("bench", "--rollout", "vllm", "--model-mb", "1", "--repeat", "2", "--receivers", "1",
                        "--json", str(out), "--disk-dir", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["rollout"] == "vllm" and report["routes_agree"] is True
    shm, disk = report["rows"]
    assert shm["backend"] == "shm" and disk["backend"] == "disk"
    for row in (shm, disk):
        assert row["samples"] == 2 * 1  # rounds x replicas
        assert 0 < row["load_ms_p50"] <= row["pause_ms_p50"] <= row["end_to_end_ms_p50"], row
        assert row["transfer_ms_p50"] > 0
    assert disk["write_ms_p50"] > 0 and disk["transfer_ms_p50"] >= disk["write_ms_p50"]
    assert "shm is" in result.stdout and "x faster end to end than disk" in result.stdout
    assert not list(tmp_path.glob("weightsync-bench-vllm-*"))  # the disk route's checkpoints are gone


def test_bench_refuses_a_memory_filesystem_for_the_disk_route() -> None:
    result = weightsync("bench", "--rollout", "vllm", "--disk-dir", "/dev/shm", timeout=120)
    assert result.returncode == 2 and "memory, not a disk" in result.stderr, result.stderr


def test_bench_tp2_compares_delivery_by_part_with_whole(tmp_path: pathlib.Path) -> None:
    """``--tp 2``: one replica of two workers fed by part, one fed whole, one update each in turn; each worker's
    stream CPU and the pauses are compared, and both kinds of replica end on identical weights."""
    out = tmp_path / "bench.json"
    result = weightsync("bench", "--rollout", "vllm", "--tp", "2", "--model-mb", "1", "--repeat", "1", "--json",
                        str(out), "--disk-dir", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["tensor_parallel_size"] == 2 and report["routes_agree"] is True
    parts, whole = report["rows"]
    assert parts["backend"] == "parts" and whole["backend"] == "whole"
    for row in (parts, whole):
        assert row["samples"] == 1  # one round, one replica
        assert 0 < row["load_ms_p50"] <= row["pause_ms_p50"] <= row["end_to_end_ms_p50"], row
        assert row["stream_cpu_worker0_ms_p50"] > 0 and row["stream_cpu_worker1_ms_p50"] > 0, row
    assert set(report["ratio_stream_cpu"]) == {"worker0", "worker1"} and report["ratio_outside_load"] > 0
    # Read from each worker's transfer report: a worker fed whole reads the model, one fed by part about half.
    assert whole["worker_read_bytes"] == report["model_bytes"], whole
    assert 0.4 * report["model_bytes"] < parts["worker_read_bytes"] <= 0.52 * report["model_bytes"] + 65536, parts
    assert "by part / whole: stream CPU per worker" in result.stdout


def test_bench_tp_needs_an_even_number_of_replicas() -> None:
    result = weightsync("bench", "--rollout", "vllm", "--tp", "2", "--receivers", "3", timeout=120)
    assert result.returncode == 2 and "even --receivers" in result.stderr, result.stderr
