"""The critic's state files line up with the trainer's checkpoints: `critic/step-<k>.pt` is the
critic once every batch before k is trained, whatever order the batches came in, and a run
resumed at the trainer's checkpoint k picks that file (or the nearest one, with a warning)."""

from __future__ import annotations

from pathlib import Path

import torch

from streamrl.critic.service import CriticRole, CriticSnapshots


class FakeCritic:
    """What the snapshots need of a `Critic`: save and load a state with its metadata."""

    def __init__(self, steps: int = 0):
        self.steps = steps

    def save(self, path: Path, **meta) -> None:
        torch.save({"steps": self.steps, "meta": meta}, path)

    def load(self, path: Path) -> dict:
        state = torch.load(path, weights_only=True)
        self.steps = state["steps"]
        return state["meta"]


def progress(save_every: int, next_batch: int = 0) -> CriticRole:
    """A critic role's batch bookkeeping alone (no bus, no model)."""
    role = CriticRole.__new__(CriticRole)
    role.next_batch, role.ahead, role.save_every = next_batch, set(), save_every
    return role


def trained(role: CriticRole, *keys: tuple[int, int]) -> list[int | None]:
    return [role._trained(key) for key in keys]


def test_a_boundary_is_passed_once_every_batch_before_it_is_trained() -> None:
    state = progress(save_every=2)
    assert trained(state, (0, 0), (1, 0), (2, 0), (3, 0)) == [None, 2, None, 4]
    # Out of order: batch 5 before 4; the boundary 6 comes once 4 and 5 are both in.
    assert trained(state, (5, 0), (4, 0)) == [None, 6]
    assert state.next_batch == 6 and state.ahead == set()


def test_batches_past_a_boundary_are_ahead_and_refill_rounds_do_not_move_it() -> None:
    state = progress(save_every=4)
    assert trained(state, (0, 0), (2, 0), (1, 1), (1, 0)) == [None, None, None, None]
    assert state.next_batch == 3
    assert trained(state, (4, 0), (3, 0)) == [None, 4]  # batch 4 was trained before the save
    assert state.next_batch == 5
    assert trained(state, (4, 0)) == [None]  # a batch seen again (retrained): no change


def test_snapshots_keep_the_newest_and_pick_the_one_for_a_resume(tmp_path: Path) -> None:
    snapshots = CriticSnapshots(tmp_path / "critic")
    assert snapshots.pick(None) is None
    for boundary in (2, 4, 6, 8, 10):
        snapshots.save(FakeCritic(steps=boundary), boundary, ahead=[])
    names = sorted(p.name for p in (tmp_path / "critic").iterdir())
    assert names == [f"step-{k:06d}.pt" for k in (4, 6, 8, 10)]  # the newest KEEP = 4
    assert snapshots.pick(None)[0] == 10  # a restart mid-run: the newest
    assert snapshots.pick(6)[0] == 6  # a resume at the trainer's checkpoint 6: exactly it
    assert snapshots.pick(7)[0] == 6  # none for 7: the nearest below
    assert snapshots.pick(2)[0] == 4  # none at or below: the oldest above
    critic = FakeCritic()
    assert critic.load(snapshots.pick(8)[1]) == {"next_batch": 8, "ahead": []}
    assert critic.steps == 8
