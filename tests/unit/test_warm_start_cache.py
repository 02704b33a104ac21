"""The warm start's cache: built once per settings, even by jobs that start together."""

from __future__ import annotations

import logging
import threading
import time

from streamrl.config.schema import Config
from streamrl.trainer import sft


def test_concurrent_builders_train_once_and_share_the_result(tmp_path, monkeypatch, caplog) -> None:
    caplog.set_level(logging.INFO, logger="streamrl.trainer.sft")
    cfg = Config()
    cfg.run.cache_dir = str(tmp_path)
    cfg.model.hidden_size, cfg.model.num_layers, cfg.model.num_heads = 32, 1, 2
    trained = []

    def slow_sft(model_dir, cfg, progress=None) -> None:
        trained.append(model_dir)
        time.sleep(0.5)  # long enough for the other builder to arrive meanwhile

    monkeypatch.setattr(sft, "run_sft", slow_sft)
    results: list = []
    builders = [
        threading.Thread(target=lambda: results.append(sft.ensure_policy_dir(cfg)))
        for _ in range(2)
    ]
    for b in builders:
        b.start()
    for b in builders:
        b.join()

    assert len(trained) == 1
    assert "another job is building the warm start" in caplog.text  # the one that waited says so
    assert results[0] == results[1] == sft.cached_policy_dir(cfg)
    assert (results[0] / "config.json").is_file()
    assert not list(tmp_path.glob(".tmp-*"))  # nothing half-built left behind
