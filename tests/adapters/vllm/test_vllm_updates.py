"""weightsync into real vLLM (the CPU build): two replicas receive every update through weightsync's engine inside
vLLM's workers, and after each one hold exactly what a reference engine of the same build holds after loading that
version from a checkpoint with vLLM's own ``reload_weights``. Checked from outside weightsync: vLLM's checksums of
its parameters and greedy top-5 logprobs, prompt by prompt."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any, get_args

import psutil
import pytest

pytest.importorskip("vllm", reason="the vLLM tests run in the vllm env: python3 -m hatch run vllm:test")

import ray  # noqa: E402

from tests.adapters.vllm.conftest import Serving  # noqa: E402
from tests.adapters.vllm.workloads import PROMPTS  # noqa: E402
from weightsync.api import SyncConfig  # noqa: E402
from weightsync.api.errors import LoadVerificationError, ReplicaTornError  # noqa: E402
from weightsync.cli.vllm.workload import SMALL  # noqa: E402
from weightsync.core import CheckpointEngineManager  # noqa: E402
from weightsync.vllm import VllmRolloutReplica  # noqa: E402
from weightsync.vllm.internals import VLLM_VERSION, InternalName  # noqa: E402



def _generate(serving: Serving, replica: VllmRolloutReplica, *, max_tokens: int = 6) -> list[dict[str, Any]]:
    """Each prompt on its own (a batch could change the arithmetic), greedy, top-5 logprobs."""
    return [ray.get(replica.generate(prompt, max_tokens=max_tokens, logprobs=5)) for prompt in PROMPTS]


def _version(serving: Serving, name: str, *, step: int | None = None, train: tuple[int, float] | None = (1, 1e-3)
             ) -> str:
    """Train the actor worker group (every rank) and write rank 0's model as checkpoint ``name``; its path."""
    if train is not None:
        ray.get(serving.actor_wg.call("train", *train))
    return str(ray.get(serving.actor_wg.handles[0].call.remote("save", str(serving.checkpoints / name))))


def _reference(serving: Serving, path: str) -> tuple[list[dict[str, Any]], dict[str, str]]:
    serving.run(serving.reference.call("reload", path))
    return _generate(serving, serving.reference), serving.run(serving.reference.vllm_checksums())


def _assert_same_as_reference(serving: Serving, path: str, replicas: list[VllmRolloutReplica] | None = None
                              ) -> list[dict[str, Any]]:
    outputs, checksums = _reference(serving, path)
    for replica in serving.replicas if replicas is None else replicas:
        mine = _generate(serving, replica)
        assert [o["token_ids"] for o in mine] == [o["token_ids"] for o in outputs], replica.name
        assert [o["logprobs"] for o in mine] == [o["logprobs"] for o in outputs], replica.name
        assert serving.run(replica.vllm_checksums()) == checksums, replica.name
    return outputs


def _manager(serving: Serving, **config: Any) -> CheckpointEngineManager:
    return CheckpointEngineManager(backend=config.pop("backend", "shm"), actor_wg=serving.actor_wg,
                                   replicas=serving.replicas, config=SyncConfig(bucket_bytes=256 << 10, **config))


LINEAR = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def test_what_vllm_checksums_see_on_this_cpu(serving: Serving) -> None:
    """What vLLM reports after load. Its CPU build repacks linear layers on some CPUs and not on others (with
    AVX-512 BF16, on AMD Zen, or where its small-GEMM kernel applies, the weight is replaced by an empty parameter):
    either every decoder linear weight keeps its shape, and the checksums cover q/k/v/o/gate/up/down, or every one
    is empty, and only the logprobs the other tests compare prove those layers. Nothing else is ever empty."""
    shapes = ray.get(serving.replicas[0].call("parameters"))
    linear = {name: shape for name, shape in shapes.items()
              if name.endswith(".weight") and any(f".{part}." in name for part in LINEAR)}
    others = {name: shape for name, shape in shapes.items() if name not in linear}
    assert len(linear) == 4 * SMALL["num_hidden_layers"], sorted(linear)
    assert others and all(0 not in shape for shape in others.values()), others
    kept = {name: 0 not in shape for name, shape in linear.items()}
    assert all(kept.values()) or not any(kept.values()), kept  # one rule for every layer
    if all(kept.values()):
        assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == [256, 128]
    print(f"vLLM's linear weights on this CPU: {'unpacked' if all(kept.values()) else 'repacked (empty)'}")


def test_full_updates_over_shm_match_the_reference(serving: Serving) -> None:
    manager = _manager(serving)
    previous = _generate(serving, serving.replicas[0])
    for step in range(2):
        path = _version(serving, f"full{step}")
        report = serving.run(manager.update_weights())
        assert [r.state for r in report.replicas] == ["committed", "committed"]
        outputs = _assert_same_as_reference(serving, path)
        # At lr 1e-3 consecutive versions differ in at least one greedy token: the comparison can tell them apart.
        assert [o["token_ids"] for o in outputs] != [o["token_ids"] for o in previous]
        previous = outputs
        for replica in serving.replicas:
            assert serving.run(replica.call("weight_version")) == str(report.version)


def test_delta_updates_at_rl_learning_rate_match_the_reference(serving: Serving) -> None:
    manager = _manager(serving, delta=True)
    first = serving.run(manager.update_weights())  # a new manager's first update is full
    assert [o.received for o in first.replicas] == ["full", "full"]
    for step in range(2):
        path = _version(serving, f"delta{step}", train=(1, 1e-6))
        report = serving.run(manager.update_weights())
        assert [o.received for o in report.replicas] == ["changes", "changes"]
        assert report.changed_fraction < 0.1 and report.wire_bytes < report.nbytes / 4, report
        _assert_same_as_reference(serving, path)


def test_a_change_to_one_projection_still_loads_its_fused_layer_whole(serving: Serving) -> None:
    """Only ``q_proj`` of layer 1 changes (a delta of that tensor alone on the wire); vLLM's ``qkv_proj`` is rebuilt
    from q, k and v, so k and v must reach its loader too (a layer given part of its tensors is materialised from
    uninitialised memory)."""
    manager = _manager(serving, delta=True)
    serving.run(manager.update_weights())
    ray.get(serving.actor_wg.call("perturb", "model.layers.1.self_attn.q_proj.weight"))
    path = _version(serving, "q_only", train=None)
    report = serving.run(manager.update_weights())
    assert [o.received for o in report.replicas] == ["changes", "changes"]
    assert report.wire_bytes < report.nbytes / 4, report
    _assert_same_as_reference(serving, path)


def _internals(serving: Serving, avoid: list[str]) -> list[dict[str, dict[str, str]]]:
    """``internals.avoid(avoid)`` in every engine's actor and vLLM worker; what each then uses."""
    engines = [*serving.replicas, serving.reference]
    return [ray.get(engine.call("internals", avoid)) for engine in engines]


def _notes(serving: Serving) -> list[list[str]]:
    """What each replica's last update, and the reference's last reload, went without."""
    return [serving.run(engine.notes()) for engine in [*serving.replicas, serving.reference]]


@pytest.mark.parametrize("internals", ["used", "avoided"])
def test_a_fused_layer_whose_parts_span_buckets_is_loaded_from_copies(serving: Serving, internals: str) -> None:
    """Buckets of 40 KiB put q, k and v of a layer in different buckets, two slots per side: the slot q arrived in
    is reused before v arrives. vLLM keeps q until v is there, so it must hold a copy of what it holds (the default,
    "held"); the negative control hands it the views and the replicas no longer match the reference.

    "avoided": every vLLM internal is avoided in every engine (``weightsync.vllm.internals.avoid``: as on a vLLM
    that lacks them), and the update still loads bit-exact through the fallbacks: every tensor copied
    (``copy="all"``), the pause through ``pause_generation``, the reference's reload timed whole; the
    missing-layer check is skipped, and each engine's notes say what it went without, naming vLLM's version."""
    avoid = list(get_args(InternalName)) if internals == "avoided" else []
    manager = CheckpointEngineManager(backend="shm", actor_wg=serving.actor_wg, replicas=serving.replicas,
                                      config=SyncConfig(bucket_bytes=40 << 10, slots=2))
    try:
        for used in _internals(serving, avoid):
            assert set(used) == {"actor", "worker0"}, used  # TP 1: one vLLM worker
            for statuses in used.values():
                assert [name for name, status in statuses.items() if status == "used"] == (
                    [] if avoid else list(get_args(InternalName))), used
        path = _version(serving, "spanning")
        serving.run(manager.update_weights())
        _assert_same_as_reference(serving, path)
        if avoid:
            *replicas, reference = _notes(serving)
            for notes in replicas:
                assert all(note.startswith(f"vLLM {VLLM_VERSION}: ") for note in notes), notes
                assert len(notes) == 4 and "missing-layer check is skipped" in "".join(notes), notes
                assert "pause_generation" in notes[0] and "copy='all'" in "".join(notes), notes
            assert len(reference) == 1 and "timed whole" in reference[0], reference
            assert ray.get(serving.reference.call("timings"))["read_seconds"] == 0.0
        for replica in serving.replicas:
            ray.get(replica.call("set_copy", "none"))
        path = _version(serving, "spanning_views")
        try:
            serving.run(manager.update_weights())
        except LoadVerificationError:  # the replicas' overwritten bytes differ: the manager's checksums see it
            assert [o.state for o in manager.status()] == ["torn", "torn"]
        else:
            with pytest.raises(AssertionError):
                _assert_same_as_reference(serving, path)
    finally:
        for replica in serving.replicas:
            ray.get(replica.call("set_copy", "held"))
        _internals(serving, [])
    serving.run(manager.update_weights())
    _assert_same_as_reference(serving, path)
    assert _notes(serving) == [[], [], []]  # control: with every internal used, nothing is gone without
    assert ray.get(serving.reference.call("timings"))["read_seconds"] > 0.0


@pytest.mark.parametrize("pause", ["pause_scheduler", "pause_generation"])
def test_a_request_kept_across_the_pause_finishes_on_both_versions(serving: Serving, pause: str) -> None:
    """The keep-mode pause, through the engine core's ``pause_scheduler_async`` (vLLM's internal) and through
    ``pause_generation``, its public fallback (``pause_scheduler`` avoided)."""
    manager = _manager(serving)
    serving.run(manager.update_weights())
    before = serving.run(serving.replicas[0].call("weight_version"))
    _version(serving, "kept")
    try:
        _internals(serving, ["pause_scheduler"] if pause == "pause_generation" else [])
        running = serving.replicas[0].generate(PROMPTS[0], max_tokens=480)

        async def update_while_it_runs() -> Any:
            await asyncio.sleep(0.5)
            return await manager.update_weights()

        report = serving.run(update_while_it_runs())
        notes = serving.run(serving.replicas[0].notes())
    finally:
        _internals(serving, [])
    output = ray.get(running)
    assert output["finish_reason"] == "length" and len(output["token_ids"]) == 480
    versions = [span[0] for span in output["weight_versions"]]
    assert versions == [before, str(report.version)], output["weight_versions"]
    assert ("pause_generation(mode='keep'" in "".join(notes)) == (pause == "pause_generation"), notes


def test_a_sender_that_omits_a_tensor_is_caught_by_the_proof_of_load(serving: Serving) -> None:
    """Every rank leaves ``model.layers.0.mlp.down_proj.weight`` out, so sender and receivers agree on the digest;
    vLLM's loader is left with a module that got nothing, which the engine names, and the replicas stay paused
    until a complete update repairs them."""
    manager = _manager(serving)
    serving.run(manager.update_weights())
    ray.get(serving.actor_wg.call("set_omit", ["model.layers.0.mlp.down_proj.weight"]))
    try:
        _version(serving, "omitted")
        with pytest.raises(LoadVerificationError) as caught:
            serving.run(manager.update_weights())
        assert "model.layers.0.mlp.down_proj" in str(caught.value)
        assert [o.state for o in manager.status()] == ["torn", "torn"]
        assert all(serving.run(r.call("is_paused")) for r in serving.replicas)
        with pytest.raises(ReplicaTornError):
            ray.get(serving.replicas[0].generate(PROMPTS[0]))
    finally:
        ray.get(serving.actor_wg.call("set_omit", []))
    path = _version(serving, "repaired", train=None)
    report = serving.run(manager.update_weights())
    assert [o.state for o in report.replicas] == ["committed", "committed"]
    _assert_same_as_reference(serving, path)


def test_without_the_missing_layer_check_an_omitted_tensor_is_only_noted(serving: Serving) -> None:
    """Where the installed vLLM does not let weightsync see what its layerwise reload received (``layer_progress``
    avoided), the check is skipped: the same omission as above commits, every replica on the same wrong mix (vLLM
    puts back the old weights of the module that got nothing, so the proof of load agrees), and each replica's
    notes are what says the check did not run."""
    manager = _manager(serving)
    serving.run(manager.update_weights())
    ray.get(serving.actor_wg.call("set_omit", ["model.layers.0.mlp.down_proj.weight"]))
    try:
        _internals(serving, ["layer_progress"])
        path = _version(serving, "omitted_unchecked")
        report = serving.run(manager.update_weights())
        notes = [serving.run(replica.notes()) for replica in serving.replicas]
    finally:
        ray.get(serving.actor_wg.call("set_omit", []))
        _internals(serving, [])
    assert [o.state for o in report.replicas] == ["committed", "committed"]
    assert all(len(mine) == 1 and "missing-layer check is skipped" in mine[0] for mine in notes), notes
    with pytest.raises(AssertionError):
        _assert_same_as_reference(serving, path)
    serving.run(manager.update_weights())
    _assert_same_as_reference(serving, path)


def test_an_update_that_fails_part_way_tears_and_the_next_repairs(serving: Serving) -> None:
    manager = CheckpointEngineManager(backend="shm", actor_wg=serving.actor_wg, replicas=serving.replicas,
                                      config=SyncConfig(bucket_bytes=40 << 10, slots=2))
    serving.run(manager.update_weights())
    kept = serving.replicas[1].generate(PROMPTS[1], max_tokens=480)
    ray.get(serving.actor_wg.call("set_fail_after", 12))
    try:
        _version(serving, "failing")

        async def fail_while_it_runs() -> None:
            await asyncio.sleep(0.5)
            await manager.update_weights()

        with pytest.raises(Exception):
            serving.run(fail_while_it_runs())
        assert [o.state for o in manager.status()] == ["torn", "torn"]
        assert all(serving.run(r.call("is_paused")) for r in serving.replicas)
        with pytest.raises(ReplicaTornError):  # the kept request ends, typed, instead of waiting for a resume
            ray.get(kept, timeout=60)
    finally:
        ray.get(serving.actor_wg.call("set_fail_after", None))
    path = _version(serving, "after_failure", train=None)
    report = serving.run(manager.update_weights())
    assert [o.state for o in report.replicas] == ["committed", "committed"]
    _assert_same_as_reference(serving, path)


def test_an_update_that_fails_before_any_byte_resumes_on_the_old_weights(serving: Serving) -> None:
    manager = _manager(serving)
    old = _version(serving, "old")
    serving.run(manager.update_weights())
    ray.get(serving.actor_wg.call("set_fail_after", 0))
    try:
        _version(serving, "never_sent")
        with pytest.raises(Exception):
            serving.run(manager.update_weights())
    finally:
        ray.get(serving.actor_wg.call("set_fail_after", None))
    assert [o.state for o in manager.status()] == ["committed", "committed"]
    assert not any(serving.run(r.call("is_paused")) for r in serving.replicas)
    _assert_same_as_reference(serving, old)


def test_a_replica_left_on_the_previous_version_fails_the_comparison(serving: Serving) -> None:
    manager = _manager(serving)
    previous = _version(serving, "previous")
    serving.run(manager.update_weights())
    current = _version(serving, "current")
    serving.run(manager.update_weights())
    serving.run(serving.replicas[1].call("reload", previous))
    with pytest.raises(LoadVerificationError) as caught:
        serving.run(manager.verify_loads())
    assert caught.value.details["replica"] in ("replica0", "replica1")
    with pytest.raises(AssertionError):  # the outside check sees it too
        _assert_same_as_reference(serving, current)
    serving.run(manager.update_weights())
    _assert_same_as_reference(serving, current)


# -- staged updates (SyncConfig.staged): the replica's Ray actor stages while vLLM serves; one RPC swaps -----------


def _serve_during(serving: Serving, update: Any) -> tuple[Any, list[list[tuple[float, dict[str, Any]]]]]:
    """Await ``update`` while every replica serves one request after another; its result and, per replica, every
    request's (wall-clock end, output). A request that fails fails the call."""
    done: list[list[tuple[float, dict[str, Any]]]] = [[] for _ in serving.replicas]
    stop = asyncio.Event()

    async def serve(index: int) -> None:
        while not stop.is_set():
            output = await serving.replicas[index].generate(PROMPTS[index], max_tokens=4)
            done[index].append((time.time(), output))

    async def run() -> Any:
        servers = [asyncio.ensure_future(serve(index)) for index in range(len(serving.replicas))]
        try:
            return await update
        finally:
            stop.set()
            await asyncio.gather(*servers)

    return serving.run(run()), done


def _pauses(serving: Serving) -> list[list[list[float]]]:
    """Each replica's own log of its pauses, ``[paused, resumed]`` in wall-clock seconds."""
    return [ray.get(replica.call("pause_log")) for replica in serving.replicas]


def _slow_update(serving: Serving, manager: CheckpointEngineManager
                 ) -> tuple[Any, float, list[list[tuple[float, dict[str, Any]]]]]:
    """An update from a sender that waits 0.1 s before each tensor (about 2 s in all), the replicas serving: the
    report, when it started, what each replica served."""
    ray.get(serving.actor_wg.call("set_delay", 0.1))
    try:
        started = time.time()
        report, done = _serve_during(serving, manager.update_weights())
    finally:
        ray.get(serving.actor_wg.call("set_delay", 0.0))
    return report, started, done


@pytest.mark.parametrize("delta", [False, True], ids=["full", "delta"])
def test_staged_updates_serve_while_they_stage_and_swap_to_the_reference(serving: Serving, delta: bool) -> None:
    manager = _manager(serving, staged=True, delta=delta)
    old = serving.run(manager.update_weights()).version
    path = _version(serving, f"staged_{'delta' if delta else 'full'}", train=(1, 1e-6 if delta else 1e-3))
    before = _pauses(serving)
    report, started, done = _slow_update(serving, manager)
    assert [(o.state, o.resumed) for o in report.replicas] == [("committed", True)] * 2, report.replicas
    assert [o.received for o in report.replicas] == ["changes" if delta else "full"] * 2
    for replica, log, previous, served in zip(serving.replicas, _pauses(serving), before, done):
        assert len(log) == len(previous) + 1, (replica.name, log)  # paused once, for its swap
        paused, resumed = log[-1]
        assert resumed > paused
        staging = [output for end, output in served if started < end < paused]
        assert len(staging) >= 3, (replica.name, len(staging), [end - started for end, _ in served])
        assert all([span[0] for span in output["weight_versions"]] == [str(old)] for output in staging)
        assert all(output["finish_reason"] == "length" for _, output in served)
    _assert_same_as_reference(serving, path)
    if not delta:  # control: unstaged, the same slow sender's update pauses the replicas before it starts
        unstaged = _manager(serving)
        serving.run(unstaged.update_weights())
        _version(serving, "unstaged")
        _, started, done = _slow_update(serving, unstaged)
        for log, served in zip(_pauses(serving), done):
            assert len([end for end, _ in served if started < end < log[-1][0]]) < 3


def test_a_sender_failing_mid_stage_leaves_the_vllm_replicas_serving_their_old_version(serving: Serving) -> None:
    manager = _manager(serving, staged=True)
    old = _version(serving, "stage_kept")
    serving.run(manager.update_weights())
    before = _pauses(serving)
    ray.get(serving.actor_wg.call("set_fail_after", 12))  # some buckets are staged by then
    try:
        _version(serving, "stage_failed")
        with pytest.raises(Exception):
            serving.run(manager.update_weights())
    finally:
        ray.get(serving.actor_wg.call("set_fail_after", None))
    assert _pauses(serving) == before  # never paused
    assert [(o.state, o.resumed) for o in manager.status()] == [("committed", True)] * 2
    _assert_same_as_reference(serving, old)
    path = _version(serving, "stage_after_failure", train=None)
    serving.run(manager.update_weights())
    _assert_same_as_reference(serving, path)


@pytest.mark.parametrize("mode", ["delta", "staged"])
def test_a_replica_that_rejoins_catches_up_from_its_peer_and_then_takes_updates_as_the_others(serving: Serving,
                                                                                               mode: str) -> None:
    """Replica 1 leaves after the first update, misses one and rejoins: ``connect`` catches it up from replica 0 —
    with ``delta`` its vLLM worker serving the copy its delta receiver keeps, from a thread while vLLM goes on; with
    ``staged`` its actor's stager serving the update it staged (``weightsync.vllm.peer``) — and both then generate
    as the reference of the version missed does; the next update is a delta for both with ``delta`` (full for both
    with ``staged``)."""
    manager = _manager(serving, **{mode: True})
    serving.run(manager.update_weights())
    manager.remove_replicas([serving.replicas[1]])
    missed = _version(serving, f"rejoin1-{mode}", train=(1, 1e-6))
    assert serving.run(manager.update_weights()).ok  # replica 0 alone
    manager.add_replicas([serving.replicas[1]])
    serving.run(manager.connect())
    assert [(state.state, state.version) for state in manager.status()] == [("committed", 2)] * 2, manager.status()
    _assert_same_as_reference(serving, missed)
    path = _version(serving, f"rejoin2-{mode}", train=(1, 1e-6))
    report = serving.run(manager.update_weights())
    assert report.ok and [outcome.received for outcome in report.replicas] == [
        "changes" if mode == "delta" else "full"] * 2, report.replicas
    _assert_same_as_reference(serving, path)


def _engine_core(replica: VllmRolloutReplica) -> psutil.Process:
    """The vLLM engine core process of ``replica``'s actor: the actor's one child that multiprocessing spawned (vLLM
    titles it ``VLLM::EngineCore`` where setproctitle takes; CI once saw it keep its spawn command line). Its workers
    are its own children, and the actor's resource tracker is not spawned."""
    actor = psutil.Process(int(ray.get(replica.handle.__ray_call__.remote(lambda _: os.getpid()))))
    children = [(child, " ".join(child.cmdline())) for child in actor.children()]
    cores = [child for child, line in children if "EngineCore" in line or "multiprocessing.spawn" in line]
    if len(cores) != 1:
        pytest.fail(f"not one engine core among the actor's children: {[(c.pid, line) for c, line in children]}")
    return cores[0]


def test_a_replica_whose_vllm_engine_died_is_evicted_and_the_other_commits(serving: Serving) -> None:
    """The last test of the session's TP-1 engines (the tensor-parallel module stops them next; this one does):
    replica 1's vLLM engine core process is killed, its Ray actor living on. Its ping answers ``WorkerDiedError``
    once vLLM says the engine is dead (``AsyncLLM.errored``); the next update evicts it before anything is paused
    and commits replica 0, still a delta, which then generates as the reference does."""
    manager = _manager(serving, delta=True)
    try:
        serving.run(manager.update_weights())
        core = _engine_core(serving.replicas[1])
        core.kill()
        core.wait(30)
        ping = serving.replicas[1].workers[0].execute_checkpoint_engine
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # vLLM's monitor thread marks the engine dead on its own time
            try:
                serving.run(ping("ping"))
            except Exception as exc:  # noqa: BLE001 - the answer looked for
                assert "WorkerDiedError" in type(exc).__name__ + str(exc), exc
                break
            time.sleep(0.2)
        else:
            pytest.fail("the killed engine's replica still answered its ping after 30 s")
        path = _version(serving, "after-engine-death", train=(1, 1e-6))
        report = serving.run(manager.update_weights())
        [evicted] = report.evicted
        assert (evicted.replica, evicted.state) == (1, "evicted") and "engine is dead" in str(evicted.error), evicted
        assert report.ok and [outcome.received for outcome in report.replicas] == ["changes"], report.replicas
        assert manager.replicas == (serving.replicas[0],)
        _assert_same_as_reference(serving, path, serving.replicas[:1])
    finally:
        serving.stop()
