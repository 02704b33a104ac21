"""Media preprocessing: its throughput per modality, its share of a step, and the trainer's wait.

Part 1, throughput: `prepare_prompt` (decode, processor, store) over generated prompts of each
modality (images: the shapes task's pictures; video: 8-frame clips of a moving square; audio:
1 s tones at 16 kHz), with an empty store, on the tiny Qwen2.5-VL's processor (image, video)
and the tiny Qwen2.5-Omni thinker's (audio).

Part 2, in a run, for each modality's built-in task (image: `examples/vision.yaml`, video:
`examples/video.yaml`, audio: `examples/audio.yaml`): `streamrl train` for a few steps twice,
side by side, with an empty media store (every prompt processed during the run, by the feeder)
and with the store the first run filled (nothing to process). It prints the feeder's
preprocessing seconds as a share of step time, and the trainer's idle fraction in both runs:
their difference is what preprocessing costs the trainer (near zero: it happens in the feeder,
ahead of the rollout). Each task's warm start is built once first, untimed (minutes).

    python benchmarks/multimodal.py                  # both parts, every modality
    python benchmarks/multimodal.py --steps 12 --prompts 256 --modalities audio
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, train_command  # noqa: E402


def _video_prompts(num: int, tmp: Path):
    from streamrl.media.refs import MediaRef, MultimodalPrompt

    rng = np.random.default_rng(0)
    out = []
    for i in range(num):
        frames = np.full((8, 56, 56, 3), 235, np.uint8)
        row, step = int(rng.integers(8, 32)), int(rng.choice([-4, 4]))
        for t in range(8):
            x = 20 + step * t
            frames[t, row : row + 14, x : x + 14] = (220, 40, 40)
        path = tmp / f"clip{i}.npy"
        np.save(path, frames)
        content = [{"type": "video"}, {"type": "text", "text": "Which way does it move?"}]
        out.append(
            MultimodalPrompt(
                [{"role": "user", "content": content}], (MediaRef("video", path=str(path)),)
            )
        )
    return out


def _audio_prompts(num: int):
    from streamrl.media.load import encode_wav
    from streamrl.media.refs import MediaRef, MultimodalPrompt

    out = []
    for i in range(num):
        t = np.arange(16000) / 16000.0  # 1 s at 16 kHz
        wav = encode_wav(0.4 * np.sin(2 * np.pi * (220.0 + 5 * i) * t), 16000)
        content = [{"type": "audio"}, {"type": "text", "text": "Is the tone high?"}]
        out.append(
            MultimodalPrompt([{"role": "user", "content": content}], (MediaRef("audio", data=wav),))
        )
    return out


def _image_prompts(num: int):
    from streamrl.data import shapes
    from streamrl.media.refs import MediaRef, MultimodalPrompt

    out = []
    for p in shapes.sample_pictures(num, seed=0, split="train"):
        content = [{"type": "image"}, {"type": "text", "text": p.prompt}]
        out.append(
            MultimodalPrompt(
                [{"role": "user", "content": content}], (MediaRef("image", data=p.png()),)
            )
        )
    return out


def throughput(num: int) -> None:
    from streamrl.media.cache import MediaCache
    from streamrl.media.load import MediaLimits
    from streamrl.media.prepare import MediaPreparer
    from streamrl.models.processors import load_processor
    from streamrl.models.tiny_omni import build_tiny_omni_model_dir
    from streamrl.models.tiny_vl import build_tiny_vl_model_dir

    tmp = Path(tempfile.mkdtemp(prefix="mm-bench-"))
    try:
        vision = load_processor(build_tiny_vl_model_dir(tmp / "model"))
        omni = load_processor(build_tiny_omni_model_dir(tmp / "omni"))
        print(
            f"{'modality':<10}{'prompts':>9}{'prompts/s':>12}{'ms/prompt':>11}{'tokens/prompt':>15}"
        )
        for kind, prompts, processor in (
            ("image", _image_prompts(num), vision),
            ("video", _video_prompts(num, tmp), vision),
            ("audio", _audio_prompts(num), omni),
        ):
            preparer = MediaPreparer(processor, MediaCache(tmp / f"store-{kind}"), MediaLimits())
            start = time.perf_counter()
            for prompt in prompts:
                assert preparer.prepare(prompt, kind) is not None
            seconds = time.perf_counter() - start
            tokens = preparer.num_media_tokens / len(prompts)
            print(
                f"{kind:<10}{len(prompts):>9}{len(prompts) / seconds:>12.1f}"
                f"{1000 * seconds / len(prompts):>11.2f}{tokens:>15.1f}"
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


EXAMPLES = {
    "image": "examples/vision.yaml",
    "video": "examples/video.yaml",
    "audio": "examples/audio.yaml",
}


def _run(example: str, run_dir: Path, cache_dir: Path, steps: int) -> dict:
    overrides = [
        example,
        f"trainer.steps={steps}",
        "trainer.eval_every=0",
        "trainer.checkpoint_every=0",
        "run.tensorboard=false",
        f"run.cache_dir={cache_dir}",
    ]
    cmd, env = train_command(run_dir, overrides)
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"streamrl train failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    steps_m = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if '"train/loss"' in line
    ]
    summary = json.loads((run_dir / "summary.json").read_text())
    step_s = sum(m.get("time/step_s", 0.0) for m in steps_m)
    feeder_s = sum(m.get("time/feeder_busy_s", 0.0) for m in steps_m)
    return {
        "feeder_share": feeder_s / max(step_s, 1e-9),
        "preprocess_s": steps_m[-1].get("media/preprocess_s", 0.0),
        "trainer_idle": summary["trainer_idle_fraction"],
    }


def in_a_run(steps: int, modalities: list[str]) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="mm-run-"))
    cache = tmp / "cache"
    head = f"{'modality':<10}{'media store':<13}{'preprocess s':>14}{'share of step':>15}"
    print(f"{head}{'trainer idle':>14}")
    try:
        for kind in modalities:
            example = EXAMPLES[kind]
            # The warm start, built once (not timed), shared by both runs through the cache.
            _run(example, tmp / f"{kind}-warmup", cache, 1)
            shutil.rmtree(cache / "media", ignore_errors=True)
            cold = _run(example, tmp / f"{kind}-cold", cache, steps)  # all processed in the run
            warm = _run(example, tmp / f"{kind}-warm", cache, steps)  # all already in the store
            for name, r in (("empty", cold), ("filled", warm)):
                print(
                    f"{kind:<10}{name:<13}{r['preprocess_s']:>14.3f}{r['feeder_share']:>15.4f}"
                    f"{r['trainer_idle']:>14.3f}"
                )
            wait = cold["trainer_idle"] - warm["trainer_idle"]
            print(f"{kind:<10}trainer wait on preprocessing {wait:+.3f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=256, help="prompts per modality (part 1)")
    parser.add_argument("--steps", type=int, default=12, help="steps of each run (part 2)")
    parser.add_argument("--skip-run", action="store_true", help="part 1 only")
    parser.add_argument(
        "--modalities",
        nargs="+",
        choices=list(EXAMPLES),
        default=list(EXAMPLES),
        help="whose built-in task part 2 runs",
    )
    args = parser.parse_args()
    throughput(args.prompts)
    if not args.skip_run:
        in_a_run(args.steps, args.modalities)


if __name__ == "__main__":
    main()
