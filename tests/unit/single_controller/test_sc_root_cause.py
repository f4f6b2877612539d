"""Which failed rank a WorkerGroupError names: the one whose process died, not a peer that lost its connection."""

from __future__ import annotations

from ray.exceptions import ActorDiedError, OutOfMemoryError, RayTaskError

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
