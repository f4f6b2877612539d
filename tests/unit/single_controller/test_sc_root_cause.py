"""Which failed rank a WorkerGroupError names: the one whose process died, not a peer that lost its connection."""

from __future__ import annotations

from ray.exceptions import ActorDiedError, OutOfMemoryError, RayActorError, RayTaskError

from workers.single_controller.futures import root_cause_rank


def _peer_error() -> RayTaskError:
    cause = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:39584.")
    return RayTaskError("update_actor", "Traceback ...", cause)


def test_a_rank_killed_by_the_memory_monitor_is_the_root_cause() -> None:
    # Seen here: Ray's memory monitor killed rank 1; rank 0 failed in its all-gather with the peer gone.
    failures = {0: _peer_error(), 1: OutOfMemoryError("Task was killed due to the node running low on memory.")}
    assert root_cause_rank(failures) == 1


def test_a_dead_actor_is_the_root_cause_and_the_lowest_dead_rank_wins() -> None:
    failures = {0: _peer_error(), 2: ActorDiedError(), 3: ActorDiedError()}
    assert root_cause_rank(failures) == 2


def test_without_a_dead_process_the_lowest_failed_rank_is_named() -> None:
    assert root_cause_rank({3: _peer_error(), 1: _peer_error()}) == 1


def test_a_dead_rank_s_error_names_its_node_and_pid_on_the_first_line() -> None:
    from ray.exceptions import RayActorError, RayTaskError

    from workers.single_controller.futures import WorkerGroupError

    text = "The actor died unexpectedly before finishing this task.\n\tpid: 4242\n\tip: 10.0.3.7\nSIGTERM"
    err = WorkerGroupError("actor_rollout_ref", 1, "generate_sequences", RayActorError(error_msg=text))
    assert str(err).splitlines()[0] == (
        "[actor_rollout_ref] rank 1 on node 10.0.3.7 (pid 4242) failed in generate_sequences(): "
        "RayActorError: The actor died unexpectedly before finishing this task."
    )
    raised = WorkerGroupError("critic", 0, "update", RayTaskError("update", "Traceback...", ValueError("bad")))
    assert str(raised).startswith("[critic] rank 0 failed in update()")  # a raised error: no node added


def test_a_lost_node_s_unavailable_actor_is_named_with_the_node_the_gcs_gives() -> None:
    # A node container SIGKILLed: the driver's connection to the rank resets, and Ray raises ActorUnavailableError,
    # whose text names no node; the location comes from the GCS (actor_location) and survives pickling.
    import pickle

    from ray.exceptions import ActorUnavailableError

    from workers.single_controller.futures import WorkerGroupError, actor_location

    lost = ActorUnavailableError("RpcError: recvmsg:Connection reset by peer", b"\x01" * 16)
    err = WorkerGroupError("actor_rollout_ref", 1, "update_actor", lost, {1: lost}, location=("10.89.0.5", 131))
    first = str(err).splitlines()[0]
    assert first.startswith("[actor_rollout_ref] rank 1 on node 10.89.0.5 (pid 131) failed in update_actor(): ")
    assert str(pickle.loads(pickle.dumps(err))).splitlines()[0] == first
    assert actor_location(ValueError("not an actor error")) is None
    named = RayActorError(actor_id="ab" * 16, error_msg="The actor died.\n\tpid: 7\n\tip: 10.0.0.1")
    assert actor_location(named) is None  # Ray's text names the node already: no GCS call
