"""distributed/peers.py ``peer_gone``: which failed collectives say that another rank is gone (the trainer then ends
with one line and exit 69 instead of the collective's traceback), and the line it keeps."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from pretrain.checkpoint.store import CheckpointError
from pretrain.distributed.peers import peer_gone

GLOO_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
               "[127.0.0.1]:18643. This is typically caused by a remote worker crashing. Check the logs of the remote "
               "worker before reporting an error. GLHF!")
GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:19600: "
              "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the "
              "application.")


@pytest.mark.parametrize("error,line", [
    (RuntimeError(GLOO_CLOSED), "Connection closed by peer [127.0.0.1]:18643"),
    (RuntimeError(GLOO_RESET), "Read error [127.0.0.1]:19600: Connection reset by peer"),
    (RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network error, "
                  "NCCL version 2.21.5\nncclRemoteError: A call failed possibly due to a network error"),
     "NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network error, NCCL version "
     "2.21.5"),
    (dist.DistNetworkError("connect() timed out"), "connect() timed out"),
])
def test_a_collective_that_lost_a_rank_is_named_by_its_first_line(error, line):
    assert peer_gone(error) == line


def test_the_cause_of_a_failed_save_is_found_through_the_chain():
    try:
        try:
            raise RuntimeError(GLOO_CLOSED)
        except RuntimeError as e:
            raise CheckpointError("saving checkpoint step_00000004 failed (…); the ranks could not agree") from e
    except CheckpointError as e:
        assert peer_gone(e) == "Connection closed by peer [127.0.0.1]:18643"


@pytest.mark.parametrize("error", [RuntimeError("CUDA out of memory"), ValueError("bad config"),
                                   RuntimeError("Timed out waiting 600000ms for recv operation"),
                                   CheckpointError("saving checkpoint step_00000004 failed (ENOSPC)")])
def test_other_failures_are_not_taken_for_a_lost_rank(error):
    assert peer_gone(error) is None
