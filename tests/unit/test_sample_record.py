"""The sample record (`trainer/record.py`): rows come back as the trainer received them, and a
trainer starting from a checkpoint forgets the record after it."""

from __future__ import annotations

import json

import numpy as np

from streamrl.trainer.record import (
    INDEX,
    read_step,
    record_bytes,
    record_dir,
    recorded_steps,
    truncate_record,
    write_step,
)


def _rows() -> list[dict]:
    return [
        {
            "sample_id": "b0-g0-s0",
            "group_id": "b0-g0",
            "batch_index": 0,
            "prompt_ids": [5, 6, 7],
            "response_ids": np.array([8, 9], dtype=np.int64),
            "rollout_logprobs": [-0.1234567890123, -2.5],
            "versions": [0, 1],
            "finish_reason": "stop",
            "reward": 1.0,
            "reward_status": "ok",
            "reward_components": {"acc": 1.0},
            "advantages": 0.7071067811865476,
            "old_logprobs": np.array([-0.1, -2.4], dtype=np.float32),
        },
        {
            "sample_id": "b0-g0-s1",
            "group_id": "b0-g0",
            "batch_index": 0,
            "prompt_ids": [5, 6, 7],
            "response_ids": np.array([], dtype=np.int64),
            "rollout_logprobs": [],
            "versions": [],
            "finish_reason": "length",
            "reward": None,
            "reward_status": "timeout",
            "reward_components": None,
            "advantages": None,
            "old_logprobs": np.array([], dtype=np.float32),
        },
        {  # per-token advantages, and a row without old_logprobs
            "sample_id": "b0-g1-s0",
            "group_id": "b0-g1",
            "batch_index": 0,
            "prompt_ids": [1],
            "response_ids": np.array([2, 3, 4], dtype=np.int64),
            "rollout_logprobs": [-1.0, -1.5, float("nan")],
            "versions": [1, 1, 1],
            "finish_reason": "stop",
            "reward": 0.0,
            "reward_status": "ok",
            "reward_components": {},
            "advantages": np.array([0.5, -0.25, 1e-8]),
        },
    ]


def test_rows_and_micro_batches_come_back_as_received(tmp_path) -> None:
    rows = _rows()
    events = [("train", None, 0, 2), ("drop", "surplus", 2, 3)]
    size = write_step(tmp_path, 3, rows, events, {"loss": 0.1 + 0.2, "grad_norm": 1e-300})
    assert size == record_bytes(tmp_path) > 0
    back = read_step(tmp_path, 3)
    assert back.step == 3 and back.events == events
    assert (back.loss, back.grad_norm) == (0.1 + 0.2, 1e-300)
    assert len(back.rows) == len(rows)
    for original, got in zip(rows, back.rows, strict=True):
        assert set(got) == set(original)
        for key, value in original.items():
            if value is None or isinstance(value, (str, dict)):
                assert got[key] == value, key
            elif np.ndim(value) == 0:
                assert got[key] == value and np.ndim(got[key]) == 0, key
            else:
                expected = np.asarray(value)
                np.testing.assert_array_equal(got[key], expected)  # NaN == NaN here
                # The learner reads them as float32 / int64 tensors: the same bits.
                assert np.array_equal(
                    np.asarray(got[key], dtype=np.float32),
                    np.asarray(expected, dtype=np.float32),
                    equal_nan=True,
                )
    assert back.micro_batches() == [back.rows[0:2]]
    line = json.loads((record_dir(tmp_path) / INDEX).read_text())
    assert line == {
        "step": 3,
        "file": "step-000003.npz",
        "bytes": size,
        "rows": 3,
        "micro_batches": 1,
        "loss": 0.1 + 0.2,
        "grad_norm": 1e-300,
    }
    with np.load(record_dir(tmp_path) / "step-000003.npz", allow_pickle=False) as npz:
        assert all(npz[name].dtype != object for name in npz.files)


def test_a_restart_from_a_checkpoint_forgets_the_steps_after_it(tmp_path) -> None:
    for step in range(1, 6):
        write_step(tmp_path, step, _rows()[:1], [("train", None, 0, 1)], {"loss": 0.0})
    assert truncate_record(tmp_path, 4) == 2
    assert recorded_steps(tmp_path) == [1, 2, 3]
    index = (record_dir(tmp_path) / INDEX).read_text().splitlines()
    assert [json.loads(line)["step"] for line in index] == [1, 2, 3]
    assert truncate_record(tmp_path, 0) == 3  # a start from step 0 keeps nothing
    assert recorded_steps(tmp_path) == [] and not (record_dir(tmp_path) / INDEX).read_text()
