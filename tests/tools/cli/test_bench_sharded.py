"""`weightsync bench --sharded` as a user runs it: two actor ranks holding the bench's model under FSDP2 over gloo
(real spawned processes, a real gloo group, real shm rings), each sending its shards, against the same ranks
all-gathering every parameter while rank 0 sends. No timing assertions: what is checked is who sent what, that every
receiver holds the model sent, and that the reported ratio is the one the timings give."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from typing import Any

import pytest
import torch
from weightsync.cli.bench.scenario import model_layout
from weightsync.cli.bench.sharded import build_module, check_receivers, fill_rows, mismatches, row_pattern
from weightsync.cli.main import main

MiB = 2**20


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "weightsync.cli", "bench", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "GLOG_minloglevel": "2"}, check=False)


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    out = tmp_path_factory.mktemp("bench-sharded") / "sharded.json"
    result = bench("--backends", "shm", "--actor-ranks", "2", "--sharded", "--model-mb", "8", "--bucket-mb", "2",
                   "--repeat", "2", "--no-ray", "--json", str(out))
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(out.read_text()), result.stdout


def test_each_rank_sends_its_half_and_the_gathered_baseline_sends_from_rank_0(
        sharded_run: tuple[dict[str, Any], str]) -> None:
    data, _ = sharded_run
    rows = {row["backend"]: row for row in data["results"]}
    assert list(rows) == ["shm+sharded", "shm+gathered", "naive", "bucketed"]
    scenario = data["scenario"]
    total = scenario["model_bytes"]
    assert scenario["sharded"] is True and scenario["actor_ranks"] == 2 and abs(total - 8 * MiB) < MiB
    for name in ("shm+sharded", "shm+gathered"):
        row = rows[name]
        report = row["report"]
        assert report["backend"] == "shm"
        # committed: every receiver's digest matched what was sent (the manager compares them); and after the timed
        # updates each receiver's whole model was compared with the version sent, tensor by tensor.
        assert [outcome["state"] for outcome in report["replicas"]] == ["committed", "committed"]
        assert row["receivers_checked"] == 2
        senders = sorted((t for t in report["transfers"] if t["role"] == "actor"), key=lambda t: t["rank"])
        assert [t["rank"] for t in senders] == [0, 1]
        assert row["actor_bytes"] == [t["nbytes"] for t in senders]
        assert sum(row["actor_bytes"]) == total
    # Sharded: each rank its shards (a block of rows of every tensor: half, give or take one odd row); gathered:
    # rank 0 the whole model, rank 1 nothing (it drained its stream of gathered tensors).
    assert all(abs(nbytes - total / 2) < 0.01 * total for nbytes in rows["shm+sharded"]["actor_bytes"])
    assert rows["shm+gathered"]["actor_bytes"] == [total, 0]
    sharded_receivers = [t for t in rows["shm+sharded"]["report"]["transfers"] if t["role"] == "rollout"]
    assert all(t["nbytes"] == total for t in sharded_receivers)  # each read every rank's stream: the whole model


def test_ratio_is_gathered_over_sharded_and_is_printed(sharded_run: tuple[dict[str, Any], str]) -> None:
    data, stdout = sharded_run
    rows = {row["backend"]: row for row in data["results"]}
    seconds = data["scenario"]["seconds"]
    row = rows["shm+sharded"]
    assert row["gathered"] == "shm+gathered"
    assert row["ratio_gathered_sharded"] == pytest.approx(
        statistics.median(seconds["shm+gathered"]) / statistics.median(seconds["shm+sharded"]), rel=1e-3)
    assert "ratio_gathered_sharded" not in rows["shm+gathered"]
    assert f"shm+gathered / shm+sharded = {row['ratio_gathered_sharded']:.2f} x" in stdout
    assert "sharded (2 actor ranks hold the model under FSDP2" in stdout


def test_the_module_has_the_bench_models_names_and_shapes() -> None:
    layout = model_layout(8 * MiB, 2 * MiB, "realistic")
    module = build_module(layout)
    assert sorted((name, tuple(p.shape)) for name, p in module.named_parameters()) == sorted(layout)
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in module.parameters())


def test_the_pattern_gives_a_shard_the_rows_of_the_whole_it_holds() -> None:
    """Rank r fills its block of rows from where it starts: the blocks put together are the whole tensor's rows."""
    whole = torch.empty(5, 3, dtype=torch.bfloat16)
    fill_rows(whole, "w", 1, first_row=0)
    top, bottom = torch.empty(3, 3, dtype=torch.bfloat16), torch.empty(2, 3, dtype=torch.bfloat16)
    fill_rows(top, "w", 1, first_row=0)
    fill_rows(bottom, "w", 1, first_row=3)
    assert torch.equal(torch.cat([top, bottom]), whole)
    assert torch.equal(whole[:, 0], row_pattern("w", 1, range(5))) and len(set(whole[:, 0].tolist())) == 5


def test_the_receivers_check_finds_rows_out_of_place() -> None:
    """The negative control of ``receivers_checked``: a model holding the version sent passes; one whose two halves
    of a tensor's rows are swapped (rank 1's shard where rank 0's belongs), or an older version, does not."""
    layout = model_layout(2 * MiB, MiB, "realistic")
    held = {name: torch.empty(shape, dtype=torch.bfloat16) for name, shape in layout}
    for name, tensor in held.items():
        fill_rows(tensor, name, 3, first_row=0)
    assert mismatches(held, 3) == [] and check_receivers("shm+sharded", [[], []]) == 2
    assert len(mismatches(held, 2)) == len(layout)
    name = layout[-1][0]
    rows = held[name].shape[0]
    held[name].copy_(torch.cat([held[name][rows // 2:], held[name][:rows // 2]]))
    assert mismatches(held, 3) == [name]
    with pytest.raises(RuntimeError, match=f"receiver 1: 1 tensors \\({name}"):
        check_receivers("shm+sharded", [[], [name]])


@pytest.mark.parametrize(("argv", "says"), [
    (["--hosts", "2", "--actor-ranks", "2", "--backends", "tcp"], "with --hosts needs --backends auto"),
    (["--hosts", "2", "--actor-ranks", "3", "--receivers", "2"], "--receivers >= --actor-ranks"),
    ([], "--actor-ranks A, 2..16"),
    (["--actor-ranks", "1"], "--actor-ranks A, 2..16"),
    (["--actor-ranks", "2", "--delta"], "full updates"),
    (["--actor-ranks", "2", "--staged"], "full updates"),
    (["--actor-ranks", "2", "--parts", "tp2"], "neither --parts"),
    (["--actor-ranks", "2", "--mix", "rl"], "neither --parts"),
    (["--actor-ranks", "2", "--backends", "gloo"], "shm or auto"),
    (["--actor-ranks", "2", "--rollout", "vllm"], "--rollout vllm"),
])
def test_sharded_refuses_what_it_cannot_measure_in_one_line(argv: list[str], says: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--sharded", *argv]) == 2  # before any work: in this process, nothing spawned
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("weightsync bench: --sharded") and says in line, line


def test_actor_ranks_on_one_host_still_needs_sharded(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--actor-ranks", "2"]) == 2
    assert "need --hosts (--actor-ranks: or --sharded)" in capsys.readouterr().err
