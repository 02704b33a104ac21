"""The tcp weight channel in a real run: with max_staleness=0 every sample depends on exactly
the weights of the step before, so the run must draw the same samples as with the object-store
channel; any lost, late or corrupted update would change them."""

from __future__ import annotations

import pytest

from tests.integration.conftest import QUICK, read_jsonl, run_cli

pytestmark = pytest.mark.integration


def digests(run_dir) -> list[str]:
    return [line["digest"] for line in read_jsonl(run_dir / "trained_samples.jsonl")]


def test_tcp_channel_gives_the_same_samples_as_the_object_store(tmp_path, quick_cache):
    common = [
        *QUICK,
        f"run.cache_dir={quick_cache}",
        "trainer.steps=6",
        "trainer.eval_every=0",
        "rollout.max_staleness=0",
    ]
    runs = {}
    for channel in ("object_store", "tcp"):
        run_dir = tmp_path / channel
        run_cli(["train", *common, f"runtime.weights.channel={channel}", f"run.run_dir={run_dir}"])
        runs[channel] = digests(run_dir)
    assert len(runs["tcp"]) == 6
    assert runs["tcp"] == runs["object_store"]


def test_tcp_channel_refuses_a_public_address_without_a_token(tmp_path, quick_cache):
    proc = run_cli(
        [
            "train",
            *QUICK,
            f"run.cache_dir={quick_cache}",
            "trainer.steps=1",
            "runtime.weights.channel=tcp",
            "runtime.weights.bind=0.0.0.0",
            f"run.run_dir={tmp_path / 'public'}",
        ],
        check_ok=False,
    )
    assert proc.returncode == 2  # refused before anything started
    assert "without a token" in proc.stderr
