"""`control.json`: replica requests and the stop request, written from outside a running job."""

from __future__ import annotations

import pytest

from streamrl.runtime.control import (
    clear_stop,
    read_requests,
    request_stop,
    set_replicas,
    stop_requested,
)


@pytest.fixture
def run_dir(tmp_path):
    (tmp_path / "config.yaml").write_text("{}\n")
    return tmp_path


def test_stop_and_replica_requests_live_side_by_side(run_dir) -> None:
    assert not stop_requested(run_dir) and read_requests(run_dir) == {}
    set_replicas(run_dir, "rollout", 2)
    request_stop(run_dir)
    set_replicas(run_dir, "reward", 3)
    assert stop_requested(run_dir)
    assert read_requests(run_dir) == {"rollout": 2, "reward": 3}
    clear_stop(run_dir)
    assert not stop_requested(run_dir)
    assert read_requests(run_dir) == {"rollout": 2, "reward": 3}


def test_requests_need_a_run_directory_and_sensible_values(tmp_path, run_dir) -> None:
    with pytest.raises(FileNotFoundError, match="not a streamrl run directory"):
        request_stop(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="streamrl stop"):
        set_replicas(run_dir, "rollout", 0)
    with pytest.raises(ValueError, match="only .* have replicas"):
        set_replicas(run_dir, "trainer", 2)
    clear_stop(tmp_path / "nowhere")  # nothing asked, nothing to clear
