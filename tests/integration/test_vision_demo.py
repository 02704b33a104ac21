"""The vision demo and images from a user's data file, through the real CLI.

- `streamrl train examples/vision.yaml` as a user runs it (warm start included): the built-in
  tiny Qwen2.5-VL learns to count coloured shapes in generated pictures, held-out accuracy from
  <= 0.4 to >= 0.8; each step logs the media it prepared and the feeder's share of the work.
- A JSON-lines file whose rows keep images in each of the three layouts, with a missing and a
  corrupt image among them, trains on a vision-language `model.path` (a Qwen2.5-VL and a
  Qwen3-VL one): the bad rows are named in the log, left out and counted by reason, the first
  step's engine and trainer log-probs agree, and the run finishes.
"""

from __future__ import annotations

import io
import json

import pytest
from PIL import Image

from tests.integration.conftest import read_jsonl, run_cli

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_vision_demo_learns(tmp_path):
    run_dir = tmp_path / "vision"
    args = ["examples/vision.yaml", "run.progress=false", "run.tensorboard=false"]
    # The warm start from the shared cache; the media store of this run alone, so the feeder
    # processes every picture here whatever ran before in this checkout.
    media = f"data.media.store_dir={tmp_path / 'media'}"
    run_cli(["train", *args, media, f"run.run_dir={run_dir}"], timeout=1500)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["initial_eval_accuracy"] <= 0.4
    assert summary["final_eval_accuracy"] >= 0.8, summary
    steps = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in m]
    assert len(steps) == summary["num_steps"]
    # The first step trains samples of the weights it holds: engine and trainer agree.
    assert steps[0]["train/logprob_mismatch"] <= 1e-5, steps[0]["train/logprob_mismatch"]
    last = steps[-1]
    assert last["media/images"] >= 32 and last["media/tokens_per_prompt"] == 4.0
    assert last["media/preprocess_s"] > 0 and "time/feeder_busy_s" in last


def _png(color) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (56, 56), color).save(out, format="PNG")
    return out.getvalue()


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_a_data_file_with_bad_images_trains_and_counts_them(tmp_path, family):
    from streamrl.models.tiny_vl import build_tiny_vl_model_dir

    model = build_tiny_vl_model_dir(tmp_path / "model", family=family, seed=0)
    (tmp_path / "red.png").write_bytes(_png("red"))
    (tmp_path / "blue.png").write_bytes(_png("blue"))
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n not an image")

    def rows(num):
        out = []
        for i in range(num):
            image, answer = ["red.png", "blue.png"][i % 2], str(i % 2)
            out.append(
                [
                    {"prompt": "Is it blue? <image>", "images": [image], "answer": answer},
                    {
                        "prompt": [
                            {"role": "user", "content": [{"type": "image", "image": image}, "?"]}
                        ],
                        "answer": answer,
                    },
                    {"prompt": "Blue?", "image": image, "answer": answer},
                ][i % 3]
            )
        return out

    train = rows(16)
    train[3] = {"prompt": "<image>", "images": ["gone.png"], "answer": "0"}
    train[7] = {"prompt": "<image>", "images": ["broken.png"], "answer": "0"}
    data, evals = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in train))
    evals.write_text("\n".join(json.dumps(r) for r in rows(6)))
    run_dir = tmp_path / "run"
    proc = run_cli(
        [
            "train",
            f"model.path={model}",
            f"data.train_file={data}",
            f"data.eval_file={evals}",
            "rollout.batch_prompts=8",
            "rollout.group_size=2",
            "rollout.max_new_tokens=4",
            "trainer.steps=4",  # 32 prompts: every training row is met in the first epoch
            "trainer.eval_every=0",
            "runtime.mode=threads",
            "run.progress=false",
            "run.tensorboard=false",
            f"run.run_dir={run_dir}",
        ],
        timeout=600,
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["num_steps"] == 4
    log = proc.stdout + proc.stderr
    assert f"{data}:4" in log and "no such file" in log, log[-3000:]  # each bad row, named
    assert f"{data}:8" in log and "cannot decode" in log, log[-3000:]
    steps = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in m]
    assert steps[-1]["media/dropped_missing"] == 1 and steps[-1]["media/dropped_corrupt"] == 1
    assert steps[-1]["media/prompts"] == 14  # every other row, prepared once
    assert steps[0]["train/logprob_mismatch"] <= 1e-5, steps[0]["train/logprob_mismatch"]
