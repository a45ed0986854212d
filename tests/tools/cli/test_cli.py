"""The `weightsync` command as a user runs it: separate processes, a real local Ray cluster for the demo."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

from weightsync.cli.model import config_for_megabytes


def weightsync(*args: str, timeout: float = 300, **environ: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **environ}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", "weightsync.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_doctor_json_lists_every_known_backend() -> None:
    result = weightsync("doctor", "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    by_name = {row["backend"]: row for row in rows}
    assert set(by_name) >= {"shm", "gloo", "tcp", "nixl", "mooncake", "nccl", "hccl", "kimi"}
    assert all(set(row) == {"backend", "status", "reason", "install"} for row in rows)
    assert by_name["shm"]["status"] == "available" and by_name["gloo"]["status"] == "available"
    assert all(f"weightsync-{row['backend']}" in row["install"] for row in rows)
    assert all(row["reason"] for row in rows if row["status"] == "unusable here")
    assert {row["status"] for row in rows} <= {"available", "not installed", "unusable here"}


@pytest.mark.parametrize("argv", [
    ("demo", "--backend", "nosuch"), ("demo", "--model-mb", "nan"), ("demo", "--model-mb", "inf"),
    ("demo", "--steps", "0"), ("demo", "--tp", "0"), ("bench", "--backends", "shm,nosuch"), ("bench", "--model-mb", "nan"),
    ("bench", "--model-mb", "inf"), ("bench", "--receivers", "0"),
])
def test_bad_input_is_a_usage_error_before_any_work(argv: tuple[str, ...]) -> None:
    started = time.monotonic()
    result = weightsync(*argv)
    seconds = time.monotonic() - started
    assert result.returncode == 2 and result.stdout == "", (result.stdout, result.stderr)
    (line,) = result.stderr.strip().splitlines()  # one line, no traceback
    assert line.startswith(f"weightsync {argv[0]}: ") and ("nosuch" in line or "positive" in line), line
    assert seconds < 5, seconds  # before Ray or a testbed starts: neither is up within that


def test_version_names_every_distribution_torch_ray_and_python() -> None:
    result = weightsync("--version")
    assert result.returncode == 0, result.stderr
    found = dict(line.split() for line in result.stdout.strip().splitlines())
    assert found["weightsync-core"] == found["weightsync-cli"] == found["weightsync-shm"] == "0.1.0"
    assert found["torch"].startswith("2.13.") and found["ray"].startswith("2.60.")
    assert found["python"] == ".".join(map(str, sys.version_info[:3]))


def test_doctor_table() -> None:
    result = weightsync("doctor")
    assert result.returncode == 0 and "shm" in result.stdout and "available" in result.stdout
    assert result.stdout.startswith(weightsync("--version").stdout)  # the versions come first
    assert "host copies of large tensors: " in result.stdout
    assert "delta updates (SyncConfig.delta): compiled" in result.stdout
    (library,) = [line.split(": ", 1)[1] for line in result.stdout.splitlines()
                  if line.startswith("compiled helper (_stream_copy.c): ")]
    assert os.path.isfile(library) and os.path.basename(library).startswith("_stream_copy"), library
    assert "backend='auto' (the default): auto picks shm when every worker shares the sender's host, " in result.stdout


def test_doctor_says_what_a_missing_helper_costs() -> None:
    result = weightsync("doctor", WEIGHTSYNC_STREAM_COPY="0")
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("compiled helper (_stream_copy.c): ")]
    assert line.endswith("none (WEIGHTSYNC_STREAM_COPY=0): delta updates send every bucket dense and host copies use "
                         "memmove; install a C compiler (cc, gcc or clang, or set CC) and it is built at the next "
                         "start"), line


@pytest.mark.parametrize("megabytes", [8, 64, 100])
def test_demo_model_size_follows_the_flag(megabytes: int) -> None:
    assert abs(config_for_megabytes(megabytes).parameters * 4 / 1e6 - megabytes) < 0.25 * megabytes


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_demo_is_bit_exact(backend: str) -> None:
    """Over tcp the replicas are tensor-parallel (``--tp 2``): each of their two workers holds half of every split
    layer and verifies only its part (about half the model: the norms whole on both), and the halves put together
    give the trainer's logits. (gloo: the staged demo's backend.)"""
    tp = ["--tp", "2"] if backend == "tcp" else []
    result = weightsync("demo", "--backend", backend, "--steps", "2", "--model-mb", "12", "--replicas", "2", *tp)
    lines = result.stdout.strip().splitlines()
    assert result.returncode == 0, result.stdout + result.stderr
    assert lines[-1] == "2/2 steps bit-exact"
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 2 and all("digest ok" in line and "bit-exact" in line for line in steps)
    assert "[" in result.stderr and "2/2" in result.stderr  # the progress bar
    pattern = re.compile(r"step \d/2 .* ([\d.]+) MB  each worker verified its part \(([\d.]+) MB\)")
    sizes = [tuple(map(float, match.groups())) for line in steps if (match := pattern.match(line))]
    if tp:
        assert "of 2 workers, each holding its part" in lines[0]
        assert len(sizes) == 2 and all(0.45 * whole < part < 0.55 * whole for whole, part in sizes), result.stdout
    else:
        assert sizes == []  # whole-model replicas verify every byte


def test_demo_delta_sends_only_what_changed_after_the_first_update() -> None:
    result = weightsync("demo", "--backend", "shm", "--steps", "3", "--model-mb", "12", "--replicas", "2", "--delta")
    lines = result.stdout.strip().splitlines()
    assert result.returncode == 0, result.stdout + result.stderr
    assert lines[-1] == "3/3 steps bit-exact"
    assert "bf16, fp32 masters" in lines[0] and "lr 1e-06" in lines[0]
    pattern = re.compile(r"step (\d)/3 .* ([\d.]+) MB  sent ([\d.]+) MB \(([\d.]+)% changed; (\d)/2 replicas full\)")
    steps = [match.groups() for line in lines if (match := pattern.match(line)) and "digest ok" in line]
    assert [step[0] for step in steps] == ["1", "2", "3"], result.stdout
    size = float(steps[0][1])
    assert 4 < size < 8  # 12 MB of fp32 masters, sent as bf16
    assert steps[0][4] == "2" and float(steps[0][2]) >= size  # the first update is full: no replica holds a base
    for _, _, sent, changed, full in steps[1:]:
        assert full == "0" and float(changed) < 10 and float(sent) < 0.25 * size


def test_demo_staged_is_bit_exact() -> None:
    result = weightsync("demo", "--backend", "gloo", "--steps", "2", "--model-mb", "12", "--replicas", "2",
                        "--staged")
    lines = result.stdout.strip().splitlines()
    assert result.returncode == 0, result.stdout + result.stderr
    assert lines[-1] == "2/2 steps bit-exact" and "staged updates" in lines[0]
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 2 and all(re.search(r"replicas paused \d+ ms$", line) for line in steps), steps


def test_migrate_check_is_wired_into_the_command(tmp_path: pathlib.Path) -> None:
    clean = tmp_path / "clean.py"
    clean.write_text("x = 1\n")
    result = weightsync("migrate", "--check", str(clean))
    assert result.returncode == 0, result.stderr


def test_bench_reports_every_backend(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "bench.json"
    result = weightsync("bench", "--backends", "shm,gloo", "--model-mb", "16", "--bucket-mb", "4", "--repeat", "2",
                        "--no-ray", "--json", str(out))
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert [row["backend"] for row in data["results"]] == ["shm", "gloo", "naive", "bucketed"]
    assert all(row["gbps_p50"] > 0 and len(data["scenario"]["seconds"][row["backend"]]) == 2
               for row in data["results"])


def test_rollout_vllm_says_what_it_needs_where_vllm_is_missing() -> None:
    """This env has no vLLM: the command says so and how to get it, exit code 2, no traceback (the vllm env runs
    both for real: tests/adapters/vllm/test_vllm_cli.py)."""
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    for command in (["demo"], ["bench"]):
        result = weightsync(*command, "--rollout", "vllm")
        assert result.returncode == 2, result.stderr
        assert "--rollout vllm needs vllm" in result.stderr and "hatch run vllm:" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args", [["--hosts", "2"], ["--delta"], ["--mix", "rl"], ["--backends", "tcp"]])
def test_bench_rollout_vllm_refuses_what_it_does_not_take(args: list[str]) -> None:
    result = weightsync("bench", "--rollout", "vllm", *args)
    assert result.returncode == 2 and "--rollout vllm runs on this host" in result.stderr, result.stderr


@pytest.mark.parametrize("args", [["--disk-dir", "/var/tmp"], ["--tp", "2"], ["--hidden", "4096"]])
def test_bench_disk_dir_hidden_and_tp_need_rollout_vllm(args: list[str]) -> None:
    result = weightsync("bench", *args)
    assert result.returncode == 2 and "--disk-dir, --hidden and --tp need --rollout vllm" in result.stderr, \
        result.stderr


@pytest.mark.parametrize("hidden", ["1000", "0"])
def test_bench_rollout_vllm_hidden_is_a_multiple_of_256(hidden: str) -> None:
    """Refused before vLLM is looked for (the refusal needs no vLLM)."""
    result = weightsync("bench", "--rollout", "vllm", "--hidden", hidden)
    assert result.returncode == 2 and "--hidden must be a positive multiple of 256" in result.stderr, result.stderr
